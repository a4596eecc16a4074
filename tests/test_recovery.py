"""The recovery phase (evolve.recover_steps) and what it runs on: `train.algo: distill` (on-policy
distillation with no privileged context) with `train.teacher_from` (a checkpoint's student,
frozen, as the teacher). The recovery's teacher is the frozen starting model, its student the
round's candidate, and the recovered student is what the gate judges."""

import json

import pytest
import torch

from test_evolve_retention import ROUND, build_project


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The retention project (target: house rules; retention world: the plain orders world) and
    an SFT pass on its bank in runs/sft: the starting model of the evolve runs below."""
    from lopd_cli.train.loop import train

    proj = build_project(tmp_path_factory.mktemp("recover") / "p")
    train(proj, proj.load_recipe("toolcall", ["train.algo=sft", "train.steps=2", "train.save_every=2",
                                              "train.lr=0.01"]), proj.runs_dir / "sft")
    return proj


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_distill_with_teacher_from_trains_the_student_beside_a_frozen_copy_of_that_checkpoint(project):
    from lopd_cli.models.student import load_policy
    from lopd_cli.train.loop import train

    sft = project.runs_dir / "sft"
    over = ["train.algo=distill", "train.steps=2", "train.save_every=2", "train.lr=0.05",
            f"train.teacher_from={sft}", "train.init_from=null"]
    recipe = project.load_recipe("plain", over)
    tr = train(project, recipe, project.runs_dir / "distill")
    ref, _, _ = load_policy(recipe, [project.root], checkpoint=sft)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25]])
    torch.testing.assert_close(_logits(tr.teacher, ids), _logits(ref, ids), rtol=1e-4, atol=1e-4)
    assert all(not p.requires_grad for p in tr.teacher.parameters())
    student, _, _ = load_policy(recipe, [project.root], checkpoint=project.runs_dir / "distill")
    assert not torch.allclose(_logits(student, ids), _logits(ref, ids)), "the student moved, its teacher did not"
    rows = [json.loads(x) for x in (project.runs_dir / "distill" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["kl"] >= 0 and r["rollouts_total"] > 0 for r in rows[:1])


def test_teacher_from_with_another_teacher_is_a_one_line_error(project):
    from lopd_cli.errors import LopdError
    from lopd_cli.train.loop import train

    recipe = project.load_recipe("plain", ["train.algo=distill", "train.teacher=live",
                                           f"train.teacher_from={project.runs_dir / 'sft'}"])
    with pytest.raises(LopdError, match="train.teacher_from: .* train.teacher=live names another"):
        train(project, recipe, project.runs_dir / "bad")


@pytest.mark.slow
def test_the_recovery_phase_distils_the_candidate_from_the_frozen_starting_model(project):
    from lopd_cli.config import load_recipe
    from lopd_cli.models.student import load_policy
    from lopd_cli.pipeline.evolve import evolve
    from lopd_cli.train.loop import load_teacher_from

    lines: list[str] = []
    res = evolve(project, "toolcall", [*ROUND, "evolve.recover_steps=1", f"train.init_from={project.runs_dir / 'sft'}",
                                       "evolve.retain_tolerance=1.0"],
                 run="rec", rounds=1, algo="sft", say=lines.append)
    run = project.runs_dir / "rec"
    state = json.loads((run / "evolve.json").read_text())
    stages = state["rounds"][1]["stages"]
    assert list(stages)[:5] == ["rollouts", "bank", "train:sft", "recover:sft:plain", "validate:sft"]
    rec_dir = run / stages["recover:sft:plain"]["run"]
    r = load_recipe(rec_dir / "recipe.yaml")
    start = state["start"]["checkpoint"]
    assert r.train.algo == "distill" and r.env.kwargs["house_rules"] is False  # the retention world's tasks
    assert r.train.teacher_from == start and r.train.init_from == str(run / stages["train:sft"]["checkpoint"])
    # Its teacher is the starting model, frozen: the same logits as the SFT student it started from.
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25]])
    plain = project.load_recipe("plain", [f"train.teacher_from={r.train.teacher_from}"])  # resolves models/ as the run did
    ref, _, _ = load_policy(plain, [project.root], checkpoint=start)
    torch.testing.assert_close(_logits(load_teacher_from(project, plain), ids), _logits(ref, ids), rtol=1e-4, atol=1e-4)
    # The recovered student is what was validated, gated and (accepted) became the incumbent.
    row = res.rounds[1]
    assert row["checkpoint"] == stages["recover:sft:plain"]["checkpoint"]
    assert row["rollouts"] == stages["rollouts"]["n"] + stages["recover:sft:plain"]["rollouts"]
    assert stages["recover:sft:plain"]["rollouts"] == r.rollout.rollouts_per_step
    val = [json.loads(x) for x in (run / stages["validate:sft"]["file"]).read_text().splitlines()]
    assert {v["meta"]["checkpoint"] for v in val} == {str(rec_dir / "checkpoints" / "step_1")}
    assert row["accepted"] and res.incumbent["checkpoint"] == row["checkpoint"]
