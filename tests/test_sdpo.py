"""SDPO (`train.algo: sdpo`, train/sdpo.py): each rollout's teacher sees a successful sibling,
never the rollout itself, or the environment's feedback on its failure; the generalized JSD on
the student's top-k + tail; the clipped importance ratio; an EMA teacher by default; and the
loop runs it end to end."""

import math

import pytest
import torch

from _train_fixtures import build_project, oracle_records, train_run
from lopd_cli.agent.types import Episode, Task
from lopd_cli.train import losses
from lopd_cli.train.sdpo import (FEEDBACK, REPROMPT, SOLUTION, TeacherContext, reprompt_messages,
                                 teacher_contexts)


def _ep(reward: float, feedback: str | None = None, error: str | None = None) -> Episode:
    return Episode(task=Task("t", "do it", []), prompt_messages=[], messages=[], reward=reward, error=error,
                   meta={"feedback": feedback} if feedback else {})


def test_teacher_contexts_pick_a_successful_sibling_never_the_rollout_itself():
    eps = [_ep(1.0), _ep(0.0, "Not done: x."), _ep(1.0), _ep(0.0, "Not done: y."), _ep(1.0), _ep(0.5, "z")]
    groups = [0, 0, 0, 1, 1, 2]
    ctx = teacher_contexts(eps, groups, threshold=1.0)
    assert ctx[0] == TeacherContext(sibling=2)  # a success sees another success
    assert ctx[1] == TeacherContext(sibling=0) and ctx[2] == TeacherContext(sibling=0)
    assert ctx[3] == TeacherContext(sibling=4)  # a failure with a successful sibling: the solution, not feedback
    assert ctx[4] == TeacherContext()  # the only success of its group: no teacher signal (not itself)
    assert ctx[5] == TeacherContext(feedback="z")  # no success in the group: the feedback on its own attempt
    assert not ctx[4].active and ctx[5].active
    assert teacher_contexts(eps, groups, 1.0, use_feedback=False)[5] == TeacherContext()
    # An episode the environment failed (error) is not a success and its error is its feedback.
    errs = teacher_contexts([_ep(1.0, error="boom"), _ep(0.0)], [0, 0], 1.0)
    assert errs == [TeacherContext(feedback="boom"), TeacherContext()]
    for i, c in enumerate(ctx):
        assert c.sibling is None or (c.sibling != i and groups[c.sibling] == groups[i])


def test_reprompt_follows_the_official_templates():
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Cancel order 7."}]
    sol = reprompt_messages(prompt, "ATTEMPT", None)
    assert sol[0] == prompt[0] and prompt[1]["content"] == "Cancel order 7."  # a copy
    assert sol[1]["content"] == REPROMPT.format(prompt="Cancel order 7.", solution=SOLUTION.format(
        successful_previous_attempt="ATTEMPT"), feedback="")
    assert sol[1]["content"].endswith("\n\nCorrectly solve the original question.\n") and "Correct solution:" in sol[1]["content"]
    fb = reprompt_messages(prompt, None, "Not done: x.")
    assert fb[1]["content"] == "Cancel order 7." + FEEDBACK.format(feedback_raw="Not done: x.") + \
        "\n\nCorrectly solve the original question.\n"


def test_generalized_jsd_matches_its_definition_and_its_endpoints():
    torch.manual_seed(0)
    s = torch.log_softmax(torch.randn(3, 5), -1)
    t = torch.log_softmax(torch.randn(3, 5), -1)
    ps, pt = s.exp(), t.exp()
    kl = lambda p, q: (p * (p.log() - q.log())).sum(-1)  # noqa: E731
    torch.testing.assert_close(losses.generalized_jsd(s, t, 0.0), kl(pt, ps))
    torch.testing.assert_close(losses.generalized_jsd(s, t, 1.0), kl(ps, pt))
    m = 0.5 * ps + 0.5 * pt
    torch.testing.assert_close(losses.generalized_jsd(s, t, 0.5), 0.5 * kl(ps, m) + 0.5 * kl(pt, m))
    assert torch.all(losses.generalized_jsd(s, s, 0.5).abs() < 1e-6)
    # An empty tail bucket (log −inf on both sides) adds nothing and no NaN.
    s_empty = torch.cat([s, torch.full((3, 1), float("-inf"))], -1)
    t_empty = torch.cat([t, torch.full((3, 1), float("-inf"))], -1)
    out = losses.generalized_jsd(s_empty.requires_grad_(), t_empty, 0.5)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(s_empty.grad[:, :5]).all()
    # The teacher is a constant.
    t_req = t.clone().requires_grad_()
    assert not losses.generalized_jsd(s, t_req, 0.5).requires_grad
    # The ratio is clipped above and carries no gradient.
    new = torch.tensor([0.0, -0.1, -2.0], requires_grad=True)
    old = torch.tensor([-1.0, -0.1, -1.0])
    r = losses.clipped_is_ratio(new, old, 2.0)
    torch.testing.assert_close(r, torch.tensor([2.0, 1.0, math.exp(-1.0)]))
    assert not r.requires_grad


# ----------------------------------------------------------------------------- on the model


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return build_project(tmp_path_factory.mktemp("sdpo") / "p")


def _episodes(tokenizer, marks: list[str], rewards: list[float]) -> list[Episode]:
    """Oracle transcripts of one orders task, each with its own mark in the final answer."""
    from lopd_cli.agent.chat import render_prompt_ids, tokenize_transcript
    from lopd_cli.envs.orders import OrdersEnv

    task = OrdersEnv(n_train=8, n_validation=2, n_test=2).tasks("train")[0]
    rec = next(oracle_records([task]))
    out = []
    for mark, reward in zip(marks, rewards):
        msgs = [dict(m) for m in rec["messages"]]
        msgs[-1]["content"] = f"{msgs[-1]['content']} ref {mark}"
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        ids, mask = tokenize_transcript(tokenizer, msgs, rec["tools"])
        out.append(Episode(task=Task(task.id, task.instruction, rec["tools"]), prompt_messages=msgs[:first],
                           messages=msgs, reward=reward, input_ids=ids, action_mask=mask, logprobs=[0.0] * len(ids),
                           prompt_len=len(render_prompt_ids(tokenizer, msgs[:first], rec["tools"]))))
    return out


def test_the_teacher_never_sees_the_rollout_it_scores(project, monkeypatch):
    from lopd_cli.train import sdpo
    from lopd_cli.train.loop import build_trainer, sdpo_setup

    recipe = project.load_recipe("toolcall", ["train.algo=sdpo", "train.sdpo.group_size=3"])
    tr = build_trainer(project, recipe, project.runs_dir / "unused")
    assert recipe.train.teacher == "ema" and tr.ema is not None  # SDPO's default teacher
    marks = ["QQALPHA", "QQBRAVO", "QQCHARLIE"]
    eps = _episodes(tr.tokenizer, marks, [1.0, 0.0, 1.0])
    seen: dict[int, str] = {}
    real = sdpo.build_teacher_batch

    def spy(episodes, tokenizer, n_latents, prompt_fn):
        for b, ep in enumerate(episodes):
            seen[next(i for i, e in enumerate(eps) if e is ep)] = tokenizer.decode(prompt_fn(b, ep))
        return real(episodes, tokenizer, n_latents, prompt_fn=prompt_fn)

    monkeypatch.setattr(sdpo, "build_teacher_batch", spy)
    tr.model.train()
    o = sdpo.sdpo_update(sdpo_setup(tr), eps, [0, 0, 0])
    assert sorted(seen) == [0, 1, 2] and o.distilled == 3 and o.with_solution == 3 and math.isfinite(o.loss) and o.loss > 0
    assert marks[2] in seen[0] and marks[0] not in seen[0]  # a success reads the other success
    assert marks[0] in seen[1] and marks[1] not in seen[1]
    assert marks[0] in seen[2] and marks[2] not in seen[2]
    assert all("Correct solution:" in v and "Correctly solve the original question." in v for v in seen.values())
    from lopd_cli.models import adapters as ad
    from lopd_cli.train.ema_teacher import TEACHER

    assert all(p.grad is not None for p in ad.adapter_parameters(tr.model, ad.STUDENT) if p.requires_grad)
    assert all(p.grad is None for p in ad.adapter_parameters(tr.model, TEACHER))


def test_sdpo_trains_end_to_end_with_feedback_and_its_ema_teacher(project):
    from lopd_cli.train import checkpoint as ckpt

    tr, rows = train_run(project, "sdpo", ["train.algo=sdpo", "train.sdpo.group_size=2", "train.lr=0.01"])
    assert len(rows) == 2
    for r in rows:
        assert r["algo"] == "sdpo" and math.isfinite(r["loss"]) and r["loss"] >= 0
        assert r["distilled_rollouts"] == r["with_solution"] + r["with_feedback"] <= 4
    # The tiny random model rarely succeeds: its failures are taught from the orders world's feedback.
    assert sum(r["with_feedback"] for r in rows) > 0
    state = ckpt.load_state(project.runs_dir / "sdpo" / "checkpoints" / "step_2")
    assert state["ema_teacher"] is not None
    meta = ckpt.read_checkpoint_meta(project.runs_dir / "sdpo" / "checkpoints" / "step_2")
    assert meta["algo"] == "sdpo" and meta["teacher"] == "ema"
