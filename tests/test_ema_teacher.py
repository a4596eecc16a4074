"""`train.teacher: ema`: the teacher starts as the student and moves `train.teacher_ema_rate` of the
way to it after every step (a LoRA student's teacher adapter, a full student's teacher copy), the
teacher pass reads it, and a resumed run continues the same average."""

import pytest
import torch

from _train_fixtures import build_project, train_run
from lopd_cli.train import checkpoint as ckpt

RATE = 0.25


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return build_project(tmp_path_factory.mktemp("ema") / "p")


def _student0(project, overrides):
    """The student's weights before step 1 (the same seed builds the same initial student)."""
    from lopd_cli.train.loop import build_trainer

    recipe = project.load_recipe("toolcall", overrides)
    tr = build_trainer(project, recipe, project.runs_dir / "unused")
    return [s.detach().clone() for _, s in tr.ema.pairs], [t.detach().clone() for t, _ in tr.ema.pairs]


def _student_at(run_dir, step, tr):
    """A checkpoint's student weights in the EMA's pair order, loaded into the trainer's model."""
    ckpt.load_student_weights(tr.model, run_dir / "checkpoints" / f"step_{step}" / "student")
    return [s.detach().clone() for _, s in tr.ema.pairs]


@pytest.mark.parametrize("algo,student", [("opsd", "lora"), ("lopd", "full")])
def test_the_ema_teacher_moves_at_its_rate(project, algo, student):
    overrides = [f"train.algo={algo}", f"model.student={student}", "train.teacher=ema",
                 f"train.teacher_ema_rate={RATE}", "train.lr=0.05"]
    s0, t0 = _student0(project, overrides)
    assert all(torch.equal(a, b) for a, b in zip(s0, t0)), "the teacher starts as the student"
    name = f"ema-{algo}-{student}"
    tr, rows = train_run(project, name, overrides)
    assert len(rows) == 2 and all(r["kl"] >= 0 for r in rows)
    run = project.runs_dir / name
    ema = [ckpt.load_state(run / "checkpoints" / f"step_{k}")["ema_teacher"] for k in (1, 2)]
    s1, s2 = _student_at(run, 1, tr), _student_at(run, 2, tr)
    moved = sum(not torch.equal(a, b) for a, b in zip(s0, s1))
    assert moved > 0, "the student must move for the test to mean anything"
    for prev, s, got in ((s0, s1, ema[0]), (ema[0], s2, ema[1])):
        for p, x, g in zip(prev, s, got):
            torch.testing.assert_close(g, (1 - RATE) * p + RATE * x, rtol=1e-5, atol=1e-7)
    # The trainer's teacher weights are the last average, and differ from the student's.
    assert all(torch.equal(t.detach().cpu(), g) for (t, _), g in zip(tr.ema.pairs, ema[1]))
    assert any(not torch.equal(t, s) for (t, s) in tr.ema.pairs)


def test_the_teacher_pass_reads_the_ema_weights(project):
    """A LoRA student's teacher pass under the "teacher" adapter: its log-probs change when (and
    only when) the teacher adapter's weights do."""
    from lopd_cli.train.ema_teacher import TEACHER, teacher_view
    from lopd_cli.train.loop import build_trainer
    from lopd_cli.train.step import step_setup

    recipe = project.load_recipe("toolcall", ["train.algo=opsd", "train.teacher=ema"])
    tr = build_trainer(project, recipe, project.runs_dir / "unused2")
    assert step_setup(tr).teacher_adapter == TEACHER and not step_setup(tr).teacher_live
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])

    def logits():
        with torch.no_grad(), teacher_view(tr.model):
            return tr.model(input_ids=ids).logits

    before = logits()
    with torch.no_grad():
        for t, _ in tr.ema.pairs:
            t.add_(0.05 * torch.randn_like(t))
    assert not torch.allclose(before, logits())
    tr.ema.reset()
    torch.testing.assert_close(before, logits())


def test_a_resumed_run_continues_the_same_average(project):
    from lopd_cli.train.loop import train

    overrides = ["train.algo=opsd", "train.teacher=ema", f"train.teacher_ema_rate={RATE}", "train.lr=0.05"]
    train_run(project, "ema-straight", overrides)
    train_run(project, "ema-resumed", [*overrides, "train.steps=1"])
    train(project, project.load_recipe("toolcall", overrides), project.runs_dir / "ema-resumed", resume=True)
    a = ckpt.load_state(project.runs_dir / "ema-straight" / "checkpoints" / "step_2")["ema_teacher"]
    b = ckpt.load_state(project.runs_dir / "ema-resumed" / "checkpoints" / "step_2")["ema_teacher"]
    assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))
