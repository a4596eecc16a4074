"""BFCL world: ground-truth answers pass the official checkers, altered ones fail."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("bfcl_eval")

from lopd_cli.agent.types import ToolCall  # noqa: E402
from lopd_cli.envs.bfcl import BfclEnv, ground_truth_calls, split_of  # noqa: E402
from lopd_cli.errors import LopdError  # noqa: E402


def _assistant(calls: list[tuple[str, dict]], content: str = "") -> dict:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}


def _replay(env: BfclEnv, task, drop_last_call: bool = False) -> float:
    """Play the reference calls turn by turn through step() and next_user_message()."""
    msgs = env.reset(task)
    turns = ground_truth_calls(task)
    for ti, calls in enumerate(turns):
        if ti > 0:
            msgs.append(env.next_user_message())
        if drop_last_call and ti == len(turns) - 1:
            calls = calls[:-1]
        for i, (name, args) in enumerate(calls):
            msgs.append(_assistant([(name, args)]))
            obs = env.step(ToolCall(name=name, arguments=args, id=f"c{ti}_{i}"))
            msgs.append({"role": "tool", "tool_call_id": f"c{ti}_{i}", "content": obs})
        msgs.append({"role": "assistant", "content": "Done."})
    assert env.next_user_message() is None
    return env.reward(msgs)


def test_no_vendor_sdk_is_imported():
    BfclEnv(categories=["simple_python"]).tasks("validation")
    assert not [m for m in ("openai", "anthropic", "mistralai", "cohere", "boto3") if m in sys.modules]


def test_splits_are_deterministic_disjoint_and_cover_the_category():
    env = BfclEnv(categories=["simple_python"])
    ids = {s: [t.id for t in env.tasks(s)] for s in ("train", "validation", "test")}
    assert sum(len(v) for v in ids.values()) == 400
    assert not set(ids["train"]) & set(ids["test"]) and not set(ids["validation"]) & set(ids["test"])
    assert ids["test"] == [t.id for t in BfclEnv(categories=["simple_python"]).tasks("test")]
    assert split_of("simple_python_7", (0.7, 0.1, 0.2)) == split_of("simple_python_7", (0.7, 0.1, 0.2))
    assert 0.6 < len(ids["train"]) / 400 < 0.8


def test_tools_are_openai_json_schemas():
    task = BfclEnv(categories=["simple_python"], n_per_category=50).tasks("train")[0]
    for tool in task.tools:
        f = tool["function"]
        assert tool["type"] == "function" and "." not in f["name"]
        assert f["parameters"]["type"] == "object"
        for spec in f["parameters"]["properties"].values():
            assert spec["type"] in ("string", "integer", "number", "boolean", "array", "object")


@pytest.mark.parametrize("category", ["simple_python", "parallel_multiple", "live_simple"])
def test_single_turn_ground_truth_passes_and_altered_answers_fail(category):
    env = BfclEnv(categories=[category], n_per_category=25)
    tasks = env.tasks("validation") + env.tasks("test")
    assert tasks
    for task in tasks:
        prompt = env.reset(task)
        calls = ground_truth_calls(task)[0]
        assert env.reward(prompt + [_assistant(calls)]) == 1.0, (task.id, env.last_result)
        renamed = [(n + "_x", a) for n, a in calls]
        assert env.reward(prompt + [_assistant(renamed)]) == 0.0
        name, args = calls[0]
        wrong_args = {k: (v + 1000 if isinstance(v, (int, float)) and not isinstance(v, bool) else f"{v}-wrong")
                      for k, v in args.items()}
        if wrong_args != args and wrong_args:
            assert env.reward(prompt + [_assistant([(name, wrong_args)] + calls[1:])]) == 0.0, task.id
        assert env.reward(prompt + [{"role": "assistant", "content": "I cannot help."}]) == 0.0


def test_single_turn_episode_is_done_after_the_first_calls_and_reads_raw_tool_call_text():
    env = BfclEnv(categories=["simple_python"], n_per_category=10)
    task = env.tasks("train")[0]
    prompt = env.reset(task)
    assert not env.done()
    (name, args), = ground_truth_calls(task)[0]
    env.step(ToolCall(name=name, arguments=args))
    assert env.done()
    raw = f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
    assert env.reward(prompt + [{"role": "assistant", "content": raw}]) == 1.0


def test_irrelevance_passes_without_calls_and_fails_with_one():
    env = BfclEnv(categories=["irrelevance", "live_irrelevance"], n_per_category=10)
    for task in env.tasks("validation"):
        prompt = env.reset(task)
        assert env.reward(prompt + [{"role": "assistant", "content": "None of the tools fit."}]) == 1.0
        if task.tools:
            call = (task.tools[0]["function"]["name"], {})
            assert env.reward(prompt + [_assistant([call])]) == 0.0


@pytest.mark.parametrize("category", ["multi_turn_base", "multi_turn_miss_func"])
def test_multi_turn_ground_truth_replay_passes_and_a_dropped_call_fails(category):
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    env = BfclEnv(categories=[category], n_per_category=8)
    for task in env.tasks("validation"):
        assert _replay(env, task) == 1.0, (task.id, env.last_result)
        assert _replay(env, task, drop_last_call=True) == 0.0, task.id
    # The executor's module-global state of finished episodes is dropped.
    assert not [k for k in vars(multi_turn_utils) if k.startswith("lopd_")]


def test_multi_turn_state_is_per_episode_and_partial_credit_counts_leading_turns():
    env = BfclEnv(categories=["multi_turn_base"], n_per_category=3, partial_credit=True)
    task = env.tasks("validation")[0]
    n_turns = len(task.data["ground_truth"])
    assert _replay(env, task, drop_last_call=True) == pytest.approx((n_turns - 1) / n_turns)
    other = BfclEnv(categories=["multi_turn_base"], n_per_category=3)
    assert _replay(other, task) == 1.0  # a fresh episode starts from the entry's initial state


def test_step_refuses_functions_outside_the_entry():
    env = BfclEnv(categories=["multi_turn_base"], n_per_category=2)
    env.reset(env.tasks("validation")[0])
    out = env.step(ToolCall(name="__import__", arguments={"name": "os"}))
    assert "unknown function" in out


def test_bad_configuration_is_a_lopd_error():
    with pytest.raises(LopdError, match="unknown category"):
        BfclEnv(categories=["simple_cobol"])
    with pytest.raises(LopdError, match="split_fractions"):
        BfclEnv(split_fractions=[0.5, 0.5, 0.5])


def test_ground_truth_records_score_one_and_are_valid_rollout_records():
    from lopd_cli.bank.records import parse_record
    from lopd_cli.envs.bfcl import ground_truth_records

    env = BfclEnv(categories=["simple_python", "parallel", "irrelevance", "multi_turn_base"], n_per_category=4)
    tasks = env.tasks("train")
    records = ground_truth_records(tasks, env)
    assert len(records) == 12  # the 4 multi-turn tasks are left out
    assert all(r["reward"] == 1.0 for r in records), [(r["task_id"], r["reward"]) for r in records]
    for r in records:
        answer = next(m for m in r["messages"] if m["role"] == "assistant")
        results = [m for m in r["messages"] if m["role"] == "tool"]
        if r["meta"]["category"] == "irrelevance":
            assert "tool_calls" not in answer and not results
        else:
            assert len(answer["tool_calls"]) == len(results) >= (2 if r["meta"]["category"] == "parallel" else 1)
        parse_record(json.loads(json.dumps(r)))  # the format `lopd bank add-rollouts` accepts
