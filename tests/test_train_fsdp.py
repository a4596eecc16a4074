"""`train.parallel: fsdp` (train/sharding.py) and the explicit teacher (`train.teacher`).

Sharded (per-layer gathering, the default, and gather-once): 2 gloo processes under torchrun give
the losses and updated weights of 1 process over 2 LOPD and 2 SFT steps, for a LoRA and a full
student (and with activation checkpointing on), and over 2 GRPO and 2 SDPO steps for a LoRA
student; ranks whose steps differ (composer rows on one rank only, different micro-batch counts,
cached latents) keep the uniform schedule and do not hang; a SIGKILLed sharded run resumes to
what an uninterrupted one gives; `lopd export --merge-lora` turns a sharded checkpoint into a
plain transformers model.
Teacher: a full student's teacher is a frozen copy (base or init) or the student itself (live);
a LoRA student's live teacher reads its adapter; the composer objective never trains θ."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _train_fixtures import build_project, kill_torchrun_after_first_checkpoint, numeric
from lopd_cli.train.metrics import read_metrics

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# As in test_train_distributed: 4 rollouts in chunks of 2 and micro-batches of 2, so each of 2
# ranks rolls out and updates exactly what 1 process does with its half of the batch.
SETS = ["rollout.batch_size=2", "train.micro_batch=2", "train.save_every=1"]
FSDP = ["train.parallel=fsdp"]
TOL = 1e-5


def _env() -> dict:
    return {**os.environ, "LOPD_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _train_cmd(project, name: str, sets: list[str], nproc: int = 1, resume: bool = False) -> list[str]:
    lopd = ["-m", "lopd_cli", "train", "-C", str(project.root), "--recipe", "toolcall", "--json",
            "--run-name", name, *[a for s in SETS + sets for a in ("--set", s)], *(["--resume"] if resume else [])]
    if nproc == 1:
        return [sys.executable, *lopd]
    return [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), *lopd]


def _check(cmd: list[str], timeout: int = 900) -> None:
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]


def _weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds in safetensors files (student, composer), by file/name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(step_dir.rglob("*.safetensors")):
        for k, v in load_file(f).items():
            out[f"{f.relative_to(step_dir)}:{k}"] = v.float()
    return out


def _max_metric_diff(a: list[dict], b: list[dict]) -> float:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    worst = 0.0
    for x, y in zip(a, b):
        nx, ny = numeric(x), numeric(y)
        assert nx.keys() == ny.keys()
        for k in nx:
            if nx[k] is None or ny[k] is None:
                assert nx[k] is None and ny[k] is None, k
            else:
                worst = max(worst, abs(nx[k] - ny[k]))
    return worst


def _max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and wa
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return build_project(tmp_path_factory.mktemp("fsdp"))


# ----------------------------------------------------------------------------- the teacher


def _trainer(project, name: str, sets: list[str]):
    from lopd_cli.train.loop import build_trainer

    recipe = project.load_recipe("toolcall", SETS + sets)
    return build_trainer(project, recipe, project.runs_dir / name, show_progress=False)


def _theta_grads(tr, episodes, train_composer: bool) -> list[torch.Tensor]:
    """θ's gradient from one LOPD step's phases 2–4 on `episodes` (the composer pass on or off)."""
    from dataclasses import replace

    from lopd_cli.train.batch import batch_totals
    from lopd_cli.train.optim import _student_params
    from lopd_cli.train.step import lopd_step, retrieve_refs, step_setup

    for p in _student_params(tr.model) + list(tr.composer.parameters()):
        p.grad = None
    setup = step_setup(tr)  # the trainer's teacher and, with the composer pass, composer_leaves
    assert setup.composer_leaves is not None or (tr.recipe.model.student, tr.recipe.train.teacher) == ("lora", "base")
    if not train_composer:
        setup = replace(setup, train_composer=False, composer_leaves=None)
    tr.model.train()
    lopd_step(setup, episodes, retrieve_refs(tr, episodes), beta=1.0, totals=batch_totals(episodes))
    return [p.grad.clone() for p in _student_params(tr.model) if p.grad is not None]


@pytest.mark.parametrize("student,teacher", [("full", "base"), ("full", "live"), ("lora", "live")])
def test_the_composer_objective_never_trains_the_student(project, student, teacher):
    """θ's gradient is the student pass's alone, whether or not the composer pass runs (before
    issue 38 a full student's θ also took the composer objective's gradient, through its encoder
    pass and its teacher pass, which were its own weights)."""
    from lopd_cli.train.step import rollout_phase

    tr = _trainer(project, f"leak-{student}-{teacher}", [f"model.student={student}", f"train.teacher={teacher}"])
    assert (tr.teacher is not None) == (student == "full" and teacher == "base")
    with torch.no_grad():  # a student that differs from the teacher (a LoRA student starts equal)
        for n, p in tr.model.named_parameters():
            if ".lora_B.student." in n:
                p.normal_(0, 0.05)
    episodes = rollout_phase(tr, tr.train_tasks[:4], step=1)
    plain = _theta_grads(tr, episodes, train_composer=False)
    joint = _theta_grads(tr, episodes, train_composer=True)
    assert plain and len(plain) == len(joint) and any(bool(g.abs().sum() > 0) for g in plain)
    for a, b in zip(plain, joint):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)


def test_full_student_teacher_is_a_frozen_copy_of_the_base(project):
    """model.student=full, train.teacher=base (the default): the teacher copy keeps the base's
    weights while the student moves; the checkpoint says which teacher it was."""
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.train.loop import train

    recipe = project.load_recipe("toolcall", SETS + ["model.student=full", "train.steps=1"])
    tr = train(project, recipe, project.runs_dir / "full-base")
    base, _ = load_backbone("tiny", device="cpu")
    ref = dict(base.named_parameters())
    copy = dict(tr.teacher.named_parameters())
    assert copy.keys() == ref.keys()
    assert all(torch.equal(copy[k], ref[k]) for k in ref), "the teacher copy is the base, unchanged"
    assert not any(p.requires_grad for p in copy.values())
    student = {k.replace("base_model.model.", "").replace(".base_layer", ""): p
               for k, p in tr.model.named_parameters() if "lora_" not in k}
    assert any(not torch.equal(student[k], ref[k]) for k in ref), "one step moves the student"
    meta = json.loads((project.runs_dir / "full-base" / "checkpoints" / "latest" / "checkpoint.json").read_text())
    assert (meta["teacher"], meta["student"], meta["parallel"]) == ("base", "full", "ddp")


def test_a_bf16_teacher_copy_halves_its_weights_and_stays_close(project):
    """train.teacher_dtype=bfloat16: the frozen copy is held in bf16 (half the bytes) and a LOPD
    step trains against it; its logits stay within bf16 rounding of the fp32 copy's. `auto` on
    this CPU (no fast bf16) keeps the model's dtype."""
    from lopd_cli.train.loop import build_trainer

    sets = SETS + ["model.student=full"]
    auto = build_trainer(project, project.load_recipe("toolcall", sets), project.runs_dir / "t-auto", show_progress=False)
    half = build_trainer(project, project.load_recipe("toolcall", sets + ["train.teacher_dtype=bfloat16"]),
                         project.runs_dir / "t-bf16", show_progress=False)
    assert {p.dtype for p in auto.teacher.parameters()} == {torch.float32}
    assert {p.dtype for p in half.teacher.parameters()} == {torch.bfloat16}
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert size(half.teacher) * 2 == size(auto.teacher)
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        a, b = auto.teacher(input_ids=ids).logits, half.teacher(input_ids=ids).logits.float()
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.1, rtol=0.05)
    from lopd_cli.train.loop import train_step

    row = train_step(half)
    assert row["kl"] > 0 and row["grad_norm_student"] > 0 and not row.get("skipped_nonfinite")


def test_adamw_is_fused_only_on_cuda():
    from lopd_cli.train.optim import adamw

    opt = adamw([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    assert opt.defaults["fused"] is None  # a CPU parameter: the default multi-tensor path
    if torch.cuda.is_available():
        assert adamw([torch.nn.Parameter(torch.zeros(3, device="cuda"))], lr=1e-3).defaults["fused"] is True


def test_a_live_teacher_reads_the_students_current_weights(project):
    """train.teacher=live (LoRA): the teacher pass runs the student adapter, so changing the
    adapter changes the teacher's targets; with the default teacher (adapters off) it does not."""
    from lopd_cli.compose.latent import build_teacher_batch, teacher_hidden
    from lopd_cli.models.adapters import use_student
    from lopd_cli.train.step import rollout_phase

    tr = _trainer(project, "live-lora", [])
    episodes = rollout_phase(tr, tr.train_tasks[:2], step=1)
    latents = torch.randn((2, 4, tr.model.get_input_embeddings().weight.shape[1]))
    tb = build_teacher_batch(episodes, tr.tokenizer, 4)

    def both():
        with torch.no_grad():
            return teacher_hidden(tr.model, tb, latents), teacher_hidden(tr.model, tb, latents, view=use_student)

    base0, live0 = both()
    assert torch.equal(base0, live0), "a fresh adapter (B = 0) is the base"
    with torch.no_grad():
        for n, p in tr.model.named_parameters():
            if ".lora_B.student." in n:
                p.normal_(0, 0.05)
    base1, live1 = both()
    assert torch.equal(base0, base1) and not torch.allclose(live0, live1, atol=1e-4)


# ----------------------------------------------------------------------------- sharded training


@pytest.fixture(scope="module")
def runs(project):
    """`runs(student)`: the runs folder once it holds runs/one-STUDENT (1 process, this one) and
    runs/fsdp-STUDENT (2 FSDP processes), 2 LOPD steps each; each pair is trained on first use."""
    from lopd_cli.train.loop import train

    done: set[str] = set()

    def pair(student: str) -> Path:
        if student not in done:
            sets = [f"model.student={student}", "train.steps=2"]
            train(project, project.load_recipe("toolcall", SETS + sets), project.runs_dir / f"one-{student}")
            _check(_train_cmd(project, f"fsdp-{student}", sets + FSDP, nproc=2))
            done.add(student)
        return project.runs_dir

    return pair


@pytest.mark.slow
@pytest.mark.parametrize("student", ["lora", "full"])
def test_two_fsdp_processes_match_one_process(runs, student):
    one, two = runs(student) / f"one-{student}", runs(student) / f"fsdp-{student}"
    m1, m2 = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in m2] == [1, 2] and m2[-1]["kl"] > 0 and m2[-1]["grad_norm_student"] > 0
    assert _max_metric_diff(m1, m2) <= TOL
    for step in ("step_1", "step_2"):
        assert _max_weight_diff(one / "checkpoints" / step, two / "checkpoints" / step) <= TOL
    latest = two / "checkpoints" / "latest"
    meta = json.loads((latest / "checkpoint.json").read_text())
    assert (meta["parallel"], meta["world_size"], meta["teacher"]) == ("fsdp", 2, "base")
    # the optimiser states are sharded: one DCP file per rank, and none in state.pt
    assert sorted(p.name for p in (latest / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    state = torch.load(latest / "state.pt", weights_only=False)
    assert state["student_opt"] is None and state["sharded_optimizers"] == ["composer_opt", "student_opt"]


@pytest.mark.slow
@pytest.mark.parametrize("student", ["lora", "full"])
def test_two_fsdp_processes_match_one_process_in_sft(project, student):
    sets = [f"model.student={student}", "train.steps=2", "train.algo=sft"]
    from lopd_cli.train.loop import train

    train(project, project.load_recipe("toolcall", SETS + sets), project.runs_dir / f"sft-one-{student}")
    _check(_train_cmd(project, f"sft-fsdp-{student}", sets + FSDP, nproc=2))
    one, two = project.runs_dir / f"sft-one-{student}", project.runs_dir / f"sft-fsdp-{student}"
    m2 = read_metrics(two)
    assert [r["step"] for r in m2] == [1, 2] and m2[-1]["nll"] > 0
    assert _max_metric_diff(read_metrics(one), m2) <= TOL
    for step in ("step_1", "step_2"):
        assert _max_weight_diff(one / "checkpoints" / step, two / "checkpoints" / step) <= TOL


@pytest.mark.slow
def test_sdpo_under_per_layer_fsdp_matches_one_process(project):
    """SDPO distils only the rollouts with a teacher context (a successful sibling or feedback),
    so the ranks distil different numbers of rows: the schedule pads them, and 2 sharded
    processes give what 1 process gives (the update's token count is summed over ranks too)."""
    from lopd_cli.train.loop import train

    sets = ["train.algo=sdpo", "train.steps=2", "train.sdpo.group_size=2", "train.micro_batch=1", "train.teacher=base"]
    train(project, project.load_recipe("toolcall", SETS + sets), project.runs_dir / "sdpo-one")
    _check(_train_cmd(project, "sdpo-fsdp", sets + FSDP, nproc=2), timeout=300)
    one, two = project.runs_dir / "sdpo-one", project.runs_dir / "sdpo-fsdp"
    m2 = read_metrics(two)
    assert sum(r["distilled_rollouts"] for r in m2) > 0 and any(r["loss"] > 0 for r in m2)
    assert _max_metric_diff(read_metrics(one), m2) <= TOL
    assert _max_weight_diff(one / "checkpoints" / "step_2", two / "checkpoints" / "step_2") <= TOL


@pytest.mark.slow
def test_grpo_under_per_layer_fsdp_matches_one_process(project):
    """GRPO's groups (2 episodes of a task) fall within one rank's half of the batch, so 2 sharded
    processes give the advantages, losses and weights of 1 process. The rollouts are longer than
    FAST's so that a group's rewards differ and the update is not zero."""
    from lopd_cli.train.loop import train

    sets = ["train.algo=grpo", "train.steps=2", "rollout.max_new_tokens=64", "rollout.max_turns=3"]
    train(project, project.load_recipe("toolcall", SETS + sets), project.runs_dir / "grpo-one")
    _check(_train_cmd(project, "grpo-fsdp", sets + FSDP, nproc=2), timeout=300)
    one, two = project.runs_dir / "grpo-one", project.runs_dir / "grpo-fsdp"
    m1, m2 = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in m2] == [1, 2] and any(r["adv_abs"] > 0 and r["grad_norm_student"] > 0 for r in m2), m2
    assert _max_metric_diff(m1, m2) <= TOL
    assert _max_weight_diff(one / "checkpoints" / "step_2", two / "checkpoints" / "step_2") <= TOL


@pytest.mark.slow
def test_ranks_with_different_steps_keep_the_uniform_schedule(project):
    """One composer row in the whole batch (so one rank runs a composer pass and the other none),
    micro-batches of 1 (so the ranks run 1 and 2 plain passes), the contrastive term and the
    privilege gate on (extra teacher passes), latents cached between passes: per-layer FSDP
    finishes (without the schedule this run deadlocks in its first step) and gives what
    gather-once (`train.fsdp_gather: step`, whose passes run no collective) gives."""
    sets = ["train.steps=2", "train.micro_batch=1", "train.lopd.composer_batch=1", "train.lopd.contrastive_weight=0.1",
            "train.distill.privilege_gate=true", *FSDP]
    _check(_train_cmd(project, "uneven-step", sets + ["train.fsdp_gather=step"], nproc=2), timeout=300)
    _check(_train_cmd(project, "uneven-layer", sets, nproc=2), timeout=300)
    once, layer = project.runs_dir / "uneven-step", project.runs_dir / "uneven-layer"
    m = read_metrics(once)
    assert [r["composer_rows"] for r in m] == [1, 1] and all(r["grad_norm_composer"] > 0 for r in m)
    assert _max_metric_diff(m, read_metrics(layer)) <= TOL
    assert _max_weight_diff(once / "checkpoints" / "step_2", layer / "checkpoints" / "step_2") <= TOL


@pytest.mark.slow
def test_fsdp_with_activation_checkpointing_matches_one_process(project, runs):
    """train.activation_checkpointing under FSDP, full student (student pass, the encoder over its
    own base and the sharded teacher copy all recompute): the 1-process run without it."""
    one = runs("full") / "one-full"
    sets = ["model.student=full", "train.steps=2", "train.activation_checkpointing=true", *FSDP]
    _check(_train_cmd(project, "fsdp-full-ckpt", sets, nproc=2))
    two = project.runs_dir / "fsdp-full-ckpt"
    assert _max_metric_diff(read_metrics(one), read_metrics(two)) <= TOL
    for step in ("step_1", "step_2"):
        assert _max_weight_diff(one / "checkpoints" / step, two / "checkpoints" / step) <= TOL


@pytest.mark.slow
def test_a_killed_fsdp_run_resumes_to_the_uninterrupted_run(project, runs):
    sets = ["model.student=full", "train.steps=2", *FSDP]
    ckdir = project.runs_dir / "killed" / "checkpoints"
    kill_torchrun_after_first_checkpoint(_train_cmd(project, "killed", sets, nproc=2), _env(), ckdir)
    assert (ckdir / "step_1").exists() and not (ckdir / "step_2").exists(), "killed too late to test a resume"

    _check(_train_cmd(project, "killed", sets, nproc=2, resume=True))
    whole = runs("full") / "fsdp-full"
    assert _max_metric_diff(read_metrics(whole), read_metrics(project.runs_dir / "killed")) <= TOL
    assert _max_weight_diff(whole / "checkpoints" / "step_2", ckdir / "step_2") <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("student", ["lora", "full"])
def test_export_from_a_sharded_checkpoint_loads_in_transformers_and_generates(runs, student, lopd, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / f"export-{student}"
    res = lopd("export", str(runs(student) / f"fsdp-{student}"), "--merge-lora", "--out", str(out))
    assert res.code == 0, res
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": "Refund order 4821."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    gen = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] > ids.shape[1]
    # the export is the sharded run's student, which is the one-process run's student
    one = AutoModelForCausalLM.from_pretrained(str(_export(lopd, runs(student) / f"one-{student}", tmp_path)), dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, one(ids).logits, atol=1e-4)


def _export(lopd, run: Path, tmp_path: Path) -> Path:
    out = tmp_path / f"ref-{run.name}"
    res = lopd("export", str(run), "--merge-lora", "--out", str(out))
    assert res.code == 0, res
    return out
