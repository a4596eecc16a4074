"""The orders world: splits, tools, checklist reward, oracle and a do-nothing policy."""

import json

import pytest

from lopd_cli.agent.types import ToolCall
from lopd_cli.envs.orders import TASK_KINDS, OrdersEnv, checklist, oracle_plan, task_fingerprint
from lopd_cli.errors import LopdError


@pytest.fixture(scope="module")
def splits():
    env = OrdersEnv()
    return {s: env.tasks(s) for s in ("train", "validation", "test")}


def solve(task, calls=None, answer=None):
    env = OrdersEnv()
    messages = env.reset(task)
    plan, oracle_answer = oracle_plan(task)
    for c in plan if calls is None else calls:
        env.step(c)
    messages.append({"role": "assistant", "content": oracle_answer if answer is None else answer})
    return env.reward(messages), env


def test_splits_are_disjoint_reproducible_and_cover_every_kind(splits):
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [512, 64, 128]
    prints = {s: {task_fingerprint(t) for t in ts} for s, ts in splits.items()}
    assert not prints["train"] & prints["test"] and not prints["train"] & prints["validation"]
    assert not prints["validation"] & prints["test"]
    assert len({t.id for ts in splits.values() for t in ts}) == 704
    assert [t.instruction for t in OrdersEnv().tasks("test")] == [t.instruction for t in splits["test"]]
    assert {t.data["kind"] for t in splits["test"]} == set(TASK_KINDS)
    assert {len(t.data["plan"]) for t in splits["test"]} == {1, 2, 3, 4}
    with pytest.raises(LopdError, match="unknown split"):
        OrdersEnv().tasks("dev")


def test_oracle_scores_one_on_every_test_task(splits):
    for t in splits["test"]:
        reward, _ = solve(t)
        assert reward == 1.0, t.instruction


def test_do_nothing_scores_low(splits):
    rewards = [solve(t, calls=[], answer="Sorry, I cannot help.")[0] for t in splits["test"]]
    assert max(rewards) < 1.0 and sum(rewards) / len(rewards) < 0.3


def test_wrong_order_cancelled_breaks_the_checklist(splits):
    t = next(t for t in splits["test"] if t.data["kind"] == "cancel")
    target = t.data["plan"][0]["arguments"]["order_id"]
    others = [int(o) for o, row in t.data["db"]["orders"].items()
              if int(o) != target and row["status"] in ("pending", "processing")]
    if not others:
        pytest.skip("no second cancellable order in this database")
    reward, env = solve(t, calls=[ToolCall("cancel_order", {"order_id": others[0]})])
    items = dict(checklist(t, env.world.db, "Order is cancelled."))
    assert reward < 1.0 and items["nothing else changed"] is False


def test_tools_enforce_the_rules_and_report_errors():
    t = next(t for t in OrdersEnv().tasks("test") if t.data["kind"] == "status")
    env = OrdersEnv()
    env.reset(t)
    shipped = [int(o) for o, row in t.data["db"]["orders"].items() if row["status"] in ("shipped", "delivered")]
    if shipped:
        out = json.loads(env.step(ToolCall("cancel_order", {"order_id": shipped[0]})))
        assert "cannot be cancelled" in out["error"]
    assert "no order" in json.loads(env.step(ToolCall("get_order", {"order_id": 0})))["error"]
    assert "missing required" in json.loads(env.step(ToolCall("update_address", {"customer_id": 1})))["error"]
    assert env.world.db == t.data["db"], "failed calls change nothing"


def test_answer_facts_count(splits):
    t = next(t for t in splits["test"] if t.data["kind"] == "total")
    assert solve(t, answer="It cost something.")[0] == 0.0
    assert solve(t, answer=f"That was {t.data['facts'][0]} in total.")[0] == 1.0


def test_base_policy_examples_with_references_imitate_the_clean_oracle():
    """Base policy v3's data: a share of examples carry solved transcripts of other tasks of the
    same kind, as text in the teacher's reference frame, and then imitate the clean oracle."""
    import random

    from lopd_cli.agent.chat import tokenize_transcript
    from lopd_cli.envs.orders_policy import _examples, noisy_oracle_transcript
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.models.latent import FRAMING_AFTER, FRAMING_BEFORE

    _, tok = load_backbone("tiny", device="cpu")
    tasks = OrdersEnv(n_train=40).tasks("train")
    plain = _examples(tok, tasks, random.Random(1), noise=1.0, reference_fraction=0.0)
    framed = _examples(tok, tasks, random.Random(1), noise=1.0, reference_fraction=1.0, max_references=2)
    clean = random.Random(0)
    kinds = {t.instruction: t.data["kind"] for t in tasks}
    n_framed = 0
    for task, (ids, mask), (pids, pmask) in zip(tasks, framed, plain):
        text = tok.decode(ids)
        if FRAMING_BEFORE.strip() not in text:  # only when no other task of its kind exists
            continue
        n_framed += 1
        refs = text.split(FRAMING_BEFORE.strip())[1].split(FRAMING_AFTER.strip())[0]
        assert 1 <= refs.count("Reference ") <= 2
        assert f"Task: {task.instruction}\n" not in refs  # never its own task
        for line in refs.splitlines():
            if line.startswith("Task: "):
                assert kinds[line[len("Task: "):]] == task.data["kind"]
        # The actions after the prompt are the oracle's, with no mistake (noise=1.0 had one).
        want, want_mask = tokenize_transcript(tok, noisy_oracle_transcript(task, clean, 0.0), task.tools)
        assert [t for t, m in zip(ids, mask) if m] == [t for t, m in zip(want, want_mask) if m]
        # Without references the same task is imitated from the noisy oracle (noise=1.0: a mistake).
        assert FRAMING_BEFORE.strip() not in tok.decode(pids)
        assert [t for t, m in zip(pids, pmask) if m] != [t for t, m in zip(want, want_mask) if m]
    assert n_framed >= len(tasks) // 2
