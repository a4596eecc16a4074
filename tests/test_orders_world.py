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
    from lopd_cli.compose.latent import FRAMING_AFTER, FRAMING_BEFORE
    from lopd_cli.envs.orders_agent import noisy_oracle_transcript
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.train.base_policy import _examples

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


# ---------------------------------------------------------------- house rules

from lopd_cli.envs.orders import (  # noqa: E402
    POLICY_ERROR, REFUND_REASONS, SIGN_OFFS, STORES, make_task, store_rules)


@pytest.fixture(scope="module")
def ruled():
    env = OrdersEnv(house_rules=True)
    return {s: env.tasks(s) for s in ("train", "validation", "test")}


def solve_ruled(task, calls=None, answer=None):
    env = OrdersEnv(house_rules=True)
    messages = env.reset(task)
    plan, oracle_answer = oracle_plan(task)
    outs = [env.step(c) for c in (plan if calls is None else calls)]
    messages.append({"role": "assistant", "content": oracle_answer if answer is None else answer})
    return env.reward(messages), env, outs


def test_house_rules_off_is_the_plain_world(splits):
    env = OrdersEnv(house_rules=False, rules_seed=5)
    assert [(t.instruction, t.data) for t in env.tasks("test")] == [(t.instruction, t.data) for t in splits["test"]]


def test_every_task_names_its_store_and_the_rules_are_the_stores(ruled):
    rules = store_rules(0)
    for t in ruled["test"] + ruled["train"]:
        assert t.instruction.startswith(f"[{t.data['store']}] ")
        assert t.data["rules"] == rules[t.data["store"]]
    assert {t.data["store"] for t in ruled["test"]} == set(STORES)


def test_rules_are_hidden_from_the_prompt_and_the_schemas(ruled):
    env = OrdersEnv(house_rules=True)
    for t in ruled["test"]:
        shown = json.dumps(env.reset(t)) + json.dumps(t.tools)
        r = t.data["rules"]
        assert r["refund_reason"] not in shown and r["sign_off"] not in shown
        assert "get_order before" not in shown and "policy" not in shown.lower()
    assert not any(x in json.dumps(ruled["test"][0].tools) for x in REFUND_REASONS + SIGN_OFFS)


def test_the_oracle_scores_one_on_every_test_task_with_rules_on(ruled):
    for t in ruled["test"]:
        reward, _, outs = solve_ruled(t)
        assert reward == 1.0 and not any("error" in json.loads(o) for o in outs), t.instruction


def test_a_rule_ignorant_policy_scores_clearly_lower(splits, ruled):
    """The plain world's oracle (right calls and facts, no house rules) on the same tasks."""
    plain = {t.id: t for t in splits["test"]}
    rewards = [solve_ruled(t, oracle_plan(plain[t.id])[0], oracle_plan(plain[t.id])[1])[0]
               for t in ruled["test"] if t.id in plain]
    assert len(rewards) >= 100
    assert max(rewards) < 1.0 and sum(rewards) / len(rewards) < 0.7


def _task_of(ruled, kind, **want):
    for t in ruled["test"] + ruled["validation"] + ruled["train"]:
        if t.data["kind"] == kind and all(t.data["rules"][k] == v for k, v in want.items()):
            return t
    pytest.skip(f"no {kind} task with {want}")


@pytest.mark.parametrize("kind", ["refund", "cancel"])
def test_verify_first_is_enforced(ruled, kind):
    t = _task_of(ruled, kind, verify_first=True)
    plan, answer = oracle_plan(t)
    assert plan[0].name == "get_order"
    reward, env, outs = solve_ruled(t, plan[1:], answer)  # skip the look-up
    assert json.loads(outs[0]) == {"error": POLICY_ERROR}
    assert env.world.db == t.data["db"] and reward < 1.0  # refused: nothing changed


def test_refund_reason_is_enforced(ruled):
    t = _task_of(ruled, "refund")
    plan, answer = oracle_plan(t)
    wrong = next(r for r in REFUND_REASONS if r != t.data["rules"]["refund_reason"])
    calls = [c if c.name != "refund_order" else ToolCall(c.name, {**c.arguments, "reason": wrong}, c.id) for c in plan]
    reward, env, outs = solve_ruled(t, calls, answer)
    assert json.loads(outs[-1]) == {"error": POLICY_ERROR} and reward < 1.0
    items = dict(checklist(t, env.world.db, answer))
    assert not all(items.values()) and items["answer follows store policy"]


def test_sign_off_is_enforced(ruled):
    t = _task_of(ruled, "status")
    plan, answer = oracle_plan(t)
    sign_off = t.data["rules"]["sign_off"]
    assert answer.endswith(sign_off)
    reward, env, _ = solve_ruled(t, plan, answer[: -len(sign_off)].strip())
    assert reward < 1.0 and dict(checklist(t, env.world.db, answer[: -len(sign_off)]))["answer follows store policy"] is False


def test_a_new_rules_seed_gives_different_rules(ruled):
    assert store_rules(0) == store_rules(0)
    assert all(store_rules(s) != store_rules(0) for s in range(1, 20))
    t = ruled["test"][0]
    other = make_task(t.data["seed"], "test", rules_seed=7)
    assert other.instruction == t.instruction and other.data["rules"] == store_rules(7)[t.data["store"]]


def test_the_recipes_larger_training_pool_leaves_validation_and_test_as_they_were():
    """orders-tiny has 2,048 training tasks (512 before): its validation and test tasks, which
    RESULTS compares across the two, are the same tasks, data included."""
    from lopd_cli.config import load_recipe
    from lopd_cli.project import packaged_recipe

    kwargs = load_recipe(packaged_recipe("orders-tiny"), []).env.kwargs
    assert kwargs["n_train"] == 2048
    big = OrdersEnv(**{**kwargs, "n_validation": 256, "n_test": 256})
    small = OrdersEnv(**{**kwargs, "n_train": 512, "n_validation": 256, "n_test": 256})
    assert len(big.tasks("train")) == 2048
    for split in ("validation", "test"):
        a, b = big.tasks(split), small.tasks(split)
        assert [(t.id, t.instruction, t.data) for t in a] == [(t.id, t.instruction, t.data) for t in b]


def test_a_splits_tasks_are_made_once_and_episodes_leave_them_as_made():
    """`OrdersEnv.tasks` keeps each split's tasks per process (envs.orders.split_tasks): a second
    env gets the same Task objects in a list of its own, and running episodes on them (the
    oracle, a wrong call) changes none of their data, so a cached task is what a fresh one is."""
    import pickle

    from lopd_cli.envs.orders import SPLIT_ORDER, split_tasks

    env = OrdersEnv(house_rules=True, n_train=40, n_validation=8, n_test=8)
    first = env.tasks("test")
    again = OrdersEnv(house_rules=True, n_train=40, n_validation=8, n_test=8).tasks("test")
    assert again is not first and all(a is b for a, b in zip(first, again))
    for t in first:
        solve(t)
        solve(t, calls=[ToolCall("cancel_order", {"order_id": t.data["plan"][0]["arguments"].get("order_id", 0)})])
    fresh = split_tasks.__wrapped__("test", (40, 8, 8), env.rules_seed)
    assert pickle.dumps(first) == pickle.dumps(list(fresh))
    assert [len(env.tasks(s)) for s in SPLIT_ORDER] == [40, 8, 8]
