"""`train.init_from`: a run starts from another run's student (SFT first, then LOPD). Its step-0
student is the source's final student; it records where it came from; `--resume` continues from
its own checkpoints; export and eval of the chained run give backbone + its final student; bad
sources fail with one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from _train_fixtures import build_project, numeric
from lopd_cli.errors import LopdError
from lopd_cli.train.metrics import read_metrics

PROMPT = [[{"role": "user", "content": "Refund order 4821 for customer ada@example.com."}]]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The LOPD-ready tiny project, with a 3-step SFT run (LoRA student) to start from."""
    from lopd_cli.train.loop import train

    proj = build_project(tmp_path_factory.mktemp("init"))
    recipe = proj.load_recipe("toolcall", ["train.algo=sft", "train.steps=3", "train.save_every=3"])
    train(proj, recipe, proj.runs_dir / "src-sft")
    return proj


def _train(project, name: str, overrides: list[str], resume: bool = False):
    from lopd_cli.train.loop import train

    recipe = project.load_recipe("toolcall", overrides)
    return train(project, recipe, project.runs_dir / name, resume=resume)


def _inputs(tokenizer):
    from lopd_cli.results.export import check_inputs

    return check_inputs(tokenizer, PROMPT + [[{"role": "user", "content": "Cancel my last order."}]])


def _student_logits(model, inputs):
    """Logits of the trainer model's student view (or of a plain / peft model as it is)."""
    from lopd_cli.models import adapters as ad
    from lopd_cli.results.export import prompt_logits

    if hasattr(model, "lopd_full_student"):
        with ad.use_student(model):
            return prompt_logits(model, inputs)
    return prompt_logits(model, inputs)


def _checkpoint_student(path):
    from lopd_cli.models.student import load_student, read_checkpoint, resolve_checkpoint

    return load_student(read_checkpoint(resolve_checkpoint(path)), device="cpu")


def _same(a, b, atol=0.0):
    return all(torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a, b, strict=True))


def test_step0_student_is_the_source_final_student(project):
    from lopd_cli.models.backbone import load_backbone

    src, tok = _checkpoint_student(project.runs_dir / "src-sft")
    inputs = _inputs(tok)
    source = _student_logits(src, inputs)
    backbone, _ = load_backbone("tiny", device="cpu")
    assert not _same(source, _student_logits(backbone, inputs), atol=1e-3), "the source must differ from the backbone"

    tr = _train(project, "chain0", ["train.steps=0", "train.init_from=runs/src-sft"])
    assert _same(_student_logits(tr.model, inputs), source)
    assert tr.extra["init_from"]["algo"] == "sft" and tr.extra["init_from"]["step"] == 3
    # optimiser state starts fresh
    assert not tr.student_opt.state


def test_chained_lopd_records_resumes_and_exports(project, tmp_path):
    from transformers import AutoModelForCausalLM

    from lopd_cli.models.student import read_checkpoint, resolve_checkpoint
    from lopd_cli.results.export import export_merged

    sets = ["train.init_from=runs/src-sft", "train.steps=2", "train.save_every=1"]
    tr = _train(project, "chain", sets)
    run = project.runs_dir / "chain"
    latest = resolve_checkpoint(run)
    meta = json.loads((latest / "checkpoint.json").read_text())
    src_step = resolve_checkpoint(project.runs_dir / "src-sft")
    assert meta["algo"] == "lopd" and meta["init_from"]["checkpoint"] == str(src_step)
    assert meta["init_from"]["run"] == str(project.runs_dir / "src-sft")
    assert "init_from: runs/src-sft" in (run / "recipe.yaml").read_text()

    # --resume continues from the run's own checkpoint (not the source again), and still records it
    _train(project, "chain-cut", [*sets[:1], "train.steps=1", "train.save_every=1"])
    _train(project, "chain-cut", sets, resume=True)
    straight, resumed = read_metrics(run), read_metrics(project.runs_dir / "chain-cut")
    assert [r["step"] for r in resumed] == [1, 2]
    for a, b in zip(straight, resumed):
        na, nb = numeric(a), numeric(b)
        assert na.keys() == nb.keys()
        for k in na:
            assert (nb[k] is None) if na[k] is None else nb[k] == pytest.approx(na[k], abs=1e-5, rel=1e-5), k
    cut_meta = json.loads((resolve_checkpoint(project.runs_dir / "chain-cut") / "checkpoint.json").read_text())
    assert cut_meta["init_from"]["checkpoint"] == str(src_step)

    # Export and eval (load_student) of the chained checkpoint give its final student, which is
    # neither the backbone nor the source: the saved adapter is the whole student.
    final = _student_logits(tr.model, _inputs(tr.tokenizer))
    src, tok = _checkpoint_student(project.runs_dir / "src-sft")
    inputs = _inputs(tok)
    assert not _same(final, _student_logits(src, inputs), atol=1e-6), "two LOPD steps must move the student"
    evaluated, _ = _checkpoint_student(run)
    assert _same(_student_logits(evaluated, inputs), final, atol=1e-5)
    out = tmp_path / "exported"
    export_merged(read_checkpoint(latest), out)
    plain = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert _same(_student_logits(plain, inputs), final, atol=1e-4)


def test_lora_source_into_full_student_merges_it(project):
    src, tok = _checkpoint_student(project.runs_dir / "src-sft")
    inputs = _inputs(tok)
    tr = _train(project, "full0", ["train.algo=sft", "train.steps=0", "model.student=full",
                                   "train.init_from=runs/src-sft"])
    assert _same(_student_logits(tr.model, inputs), _student_logits(src, inputs), atol=1e-5)


def test_full_source_continues_full_and_is_refused_by_lora(project):
    _train(project, "src-full", ["train.algo=sft", "train.steps=1", "model.student=full", "train.lr=1e-4"])
    from lopd_cli.models.backbone import load_backbone

    src, tok = _checkpoint_student(project.runs_dir / "src-full")
    inputs = _inputs(tok)
    backbone, _ = load_backbone("tiny", device="cpu")
    assert not _same(_student_logits(src, inputs), _student_logits(backbone, inputs), atol=1e-5)
    tr = _train(project, "full-full0", ["train.algo=sft", "train.steps=0", "model.student=full",
                                        "train.init_from=runs/src-full"])
    assert _same(_student_logits(tr.model, inputs), _student_logits(src, inputs))
    with pytest.raises(LopdError, match="fully fine-tuned student and this recipe trains a LoRA"):
        _train(project, "full-lora", ["train.algo=sft", "train.steps=0", "train.init_from=runs/src-full"])


def test_bad_sources_fail_with_one_line(project, lopd):
    def err(spec: str, name: str) -> str:
        r = lopd("train", "-C", project.root, "--recipe", "toolcall", "--run", name,
                 "--set", "train.steps=1", "--set", f"train.init_from={spec}")
        assert r.code == 1, r
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: train.init_from: "), r.err
        assert not (project.runs_dir / name).exists(), "nothing is written for a bad source"
        return lines[0]

    assert "runs/nope: no such run or checkpoint folder" in err("runs/nope", "bad1")
    assert "runs/coldstart holds no student" in err("runs/coldstart", "bad2")

    line = lopd("train", "-C", project.root, "--recipe", "toolcall", "--run", "bad5", "--set", "model.lora.r=4",
                "--set", "train.init_from=runs/src-sft").err.strip()
    assert line == ("error: train.init_from: runs/src-sft has a LoRA student with r=16, this recipe's model.lora.r "
                    "is 4 (the adapter continues as it is: use the same shape)"), line
    assert not (project.runs_dir / "bad5").exists()

    fake = project.root / "elsewhere"
    shutil.copytree(project.runs_dir / "src-sft" / "checkpoints" / "step_3", fake)
    meta = json.loads((fake / "checkpoint.json").read_text())
    (fake / "checkpoint.json").write_text(json.dumps({**meta, "backbone": "smollm2-135m-instruct",
                                                      "backbone_path": "/nowhere/smollm2"}))
    assert "was trained on backbone 'smollm2-135m-instruct', this recipe's model.backbone is 'tiny'" in err(
        "elsewhere", "bad3")
    (fake / "checkpoint.json").write_text(json.dumps(meta))
    shutil.rmtree(fake / "student")
    assert "holds no student (no student/ folder)" in err(str(fake), "bad4")


def test_a_distillation_run_warm_started_from_lora_warns_that_its_teacher_is_the_backbone(project):
    """A chained user may expect the warm-start model to teach: LOPD and OPSD warm-started from a
    LoRA student say in one line that the teacher is the plain backbone; GRPO, SFT, a full
    student (whose base is the merged source) and train.teacher=init do not."""
    import warnings

    from lopd_cli.errors import LopdWarning
    from lopd_cli.train.loop import warm_start_teacher_warning

    def msg(*sets: str, source: str = "lora"):
        return warm_start_teacher_warning(project.load_recipe("toolcall", ["train.init_from=runs/src-sft", *sets]),
                                          source)

    for algo in ("lopd", "opsd"):
        m = msg(f"train.algo={algo}")
        assert m and "\n" not in m and "init_from: runs/src-sft" in m and "plain backbone" in m
    assert msg("train.algo=grpo") is None and msg("train.algo=sft") is None
    assert msg("model.student=full") is None and msg(source="full") is None
    assert msg("train.teacher=init") is None

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _train(project, "warned", ["train.init_from=runs/src-sft", "train.steps=1", "train.save_every=1"])
    assert sum(issubclass(w.category, LopdWarning) and "plain backbone" in str(w.message) for w in seen) == 1


def _teacher_logits(model, inputs):
    from lopd_cli.models import adapters as ad
    from lopd_cli.results.export import prompt_logits

    with ad.teacher_view(model):
        return prompt_logits(model, inputs)


def test_teacher_init_makes_the_warm_start_model_the_teacher(project, tmp_path):
    """train.teacher=init: the source student, merged, is the run's backbone (runs/RUN/backbone/),
    so the teacher (adapters off) is the warm-start model and stays it while the fresh student
    adapter moves; checkpoints, eval and export follow that backbone; a resume reuses the folder
    without reading the source again."""
    import warnings

    from lopd_cli.errors import LopdWarning
    from lopd_cli.models.student import load_student, read_checkpoint, resolve_checkpoint
    from lopd_cli.results.export import export_merged

    src, tok = _checkpoint_student(project.runs_dir / "src-sft")
    inputs = _inputs(tok)
    source = _student_logits(src, inputs)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tr0 = _train(project, "tinit0", ["train.init_from=runs/src-sft", "train.teacher=init", "train.steps=0"])
    assert not [w for w in seen if issubclass(w.category, LopdWarning)], "no plain-backbone warning"
    from lopd_cli.models.backbone import resolve_backbone

    merged = project.runs_dir / "tinit0" / "backbone" / Path(str(resolve_backbone("tiny"))).name
    assert (merged / "lopd_export.json").is_file(), "the backbone folder keeps its name (composers match by it)"
    assert _same(_teacher_logits(tr0.model, inputs), source, atol=1e-5)
    assert _same(_student_logits(tr0.model, inputs), source, atol=1e-5), "a fresh adapter starts at the teacher"
    del tr0

    shutil.copytree(project.runs_dir / "src-sft", project.runs_dir / "src-copy")
    sets = ["train.init_from=runs/src-copy", "train.teacher=init", "train.steps=2", "train.save_every=1"]
    tr = _train(project, "tinit", sets)
    assert _same(_teacher_logits(tr.model, inputs), source, atol=1e-5), "the teacher stays the warm-start model"
    final = _student_logits(tr.model, inputs)
    assert not _same(final, source, atol=1e-6), "two LOPD steps must move the student"

    latest = resolve_checkpoint(project.runs_dir / "tinit")
    meta = json.loads((latest / "checkpoint.json").read_text())
    assert meta["teacher"] == "init" and meta["init_from"]["algo"] == "sft"
    assert Path(meta["backbone_path"]).parent == (project.runs_dir / "tinit" / "backbone").resolve()
    evaluated, _ = load_student(read_checkpoint(latest), device="cpu")
    assert _same(_student_logits(evaluated, inputs), final, atol=1e-5)
    out = tmp_path / "exported"
    export_merged(read_checkpoint(latest), out)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert _same(_student_logits(plain, inputs), final, atol=1e-4)

    # resume: cut after step 1, remove the source, continue; the same metrics as the straight run
    _train(project, "tinit-cut", [*sets[:2], "train.steps=1", "train.save_every=1"])
    shutil.rmtree(project.runs_dir / "src-copy")
    _train(project, "tinit-cut", sets, resume=True)
    straight, resumed = read_metrics(project.runs_dir / "tinit"), read_metrics(project.runs_dir / "tinit-cut")
    assert [r["step"] for r in resumed] == [1, 2]
    for a, b in zip(straight, resumed):
        na, nb = numeric(a), numeric(b)
        for k in na:
            assert (nb[k] is None) if na[k] is None else nb[k] == pytest.approx(na[k], abs=1e-5, rel=1e-5), k

    # its checkpoints find that folder next to them (a moved run works); gone, they say so
    # instead of falling back to the plain backbone
    resumed_final = _student_logits(_train(project, "tinit-cut", sets, resume=True).model, inputs)
    shutil.move(project.runs_dir / "tinit-cut", tmp_path / "moved")
    moved = read_checkpoint(resolve_checkpoint(tmp_path / "moved"))
    assert _same(_student_logits(load_student(moved, device="cpu")[0], inputs), resumed_final, atol=1e-5)
    shutil.rmtree(tmp_path / "moved" / "backbone")
    with pytest.raises(LopdError, match="merged warm-start backbone .* which is gone"):
        load_student(moved, device="cpu")


def test_teacher_init_for_a_full_student_is_a_frozen_copy_of_the_warm_start(project):
    """model.student=full, train.teacher=init: the student starts from the warm start (merged
    into runs/RUN/backbone/) and the teacher is a frozen copy of it, which training leaves as it
    is; the checkpoint records the teacher."""
    from lopd_cli.models.student import read_checkpoint, resolve_checkpoint

    src, tok = _checkpoint_student(project.runs_dir / "src-sft")
    inputs = _inputs(tok)
    source = _student_logits(src, inputs)
    tr = _train(project, "tinit-full", ["train.init_from=runs/src-sft", "train.teacher=init", "model.student=full",
                                        "train.steps=1", "train.save_every=1"])
    assert _same(_student_logits(tr.teacher, inputs), source, atol=1e-5), "the teacher is the warm start"
    assert not _same(_student_logits(tr.model, inputs), source, atol=1e-6), "one step moves the student"
    info = read_checkpoint(resolve_checkpoint(project.runs_dir / "tinit-full"))
    assert (info.teacher, info.student) == ("init", "full")


def test_teacher_init_refusals_are_one_line(project, lopd):
    def err(name: str, *sets: str) -> str:
        r = lopd("train", "-C", project.root, "--recipe", "toolcall", "--run", name, "--set", "train.steps=1",
                 *[a for s in sets for a in ("--set", s)])
        assert r.code == 1, r
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.err
        assert not (project.runs_dir / name).exists(), "nothing is written for a refused run"
        return lines[0]

    assert "train.teacher: init needs train.init_from" in err("ti1", "train.teacher=init")
    _train(project, "tinit1", ["train.init_from=runs/src-sft", "train.teacher=init", "train.algo=sft",
                               "train.steps=1", "train.save_every=1"])
    assert "continue it with train.teacher=init" in err("ti3", "train.init_from=runs/tinit1")


def test_coldstart_with_teacher_init_trains_and_checks_against_the_warm_start_model(project):
    """`lopd coldstart --set train.init_from=runs/SFT --set train.teacher=init`: the composer is
    trained for, and the check measures, the teacher such a chained LOPD run will have: the
    check's "no block" NLL is the warm-start student's, not the plain backbone's."""
    import json as _json

    from lopd_cli.train.coldstart import run_coldstart

    recipe = project.load_recipe("toolcall", ["train.init_from=runs/src-sft", "train.teacher=init",
                                              "coldstart.steps=1"])
    summary = run_coldstart(project, recipe, project.runs_dir / "coldstart-ti", show_progress=False)
    assert summary["teacher"] == "init"
    assert Path(summary["backbone"]).parent == project.runs_dir / "coldstart-ti" / "backbone"
    plain = _json.loads((project.runs_dir / "coldstart" / "summary.json").read_text())
    assert summary["check"] is not None and plain["check"] is not None
    mine, theirs = summary["check"]["nll"]["none"]["all"], plain["check"]["nll"]["none"]["all"]
    assert mine == mine and abs(mine - theirs) > 1e-4, (mine, theirs)

    # a LOPD run on the same teacher takes that composer (it is matched to the backbone by name)
    tr = _train(project, "ti-lopd", ["train.init_from=runs/src-sft", "train.teacher=init", "train.steps=1",
                                     "train.lopd.composer_from=runs/coldstart-ti"])
    assert tr.composer_dir == project.runs_dir / "coldstart-ti" / "composer"
