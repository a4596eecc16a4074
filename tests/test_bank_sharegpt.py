"""ShareGPT-style logs (`conversations` with from/value) in `lopd bank add-rollouts`: mapped to
OpenAI messages with tool calls, the detected format named, bad lines as FILE:LINE: reason."""

import json

import pytest

from lopd_cli.bank.records import RecordError, parse_record
from lopd_cli.bank.store import Bank

TOOLS = [{"name": "get_order", "description": "look an order up", "parameters": {"type": "object", "properties": {}}}]


def hermes_record(**kw):
    """A ShareGPT record whose gpt turn holds a <tool_call> block (Hermes/Qwen style)."""
    r = {"conversations": [
        {"from": "system", "value": "You are a support agent."},
        {"from": "human", "value": "Where is order 4821?"},
        {"from": "gpt", "value": 'Let me look.\n<tool_call>\n{"name": "get_order", "arguments": {"order_id": 4821}}\n</tool_call>'},
        {"from": "tool", "value": '{"status": "shipped"}'},
        {"from": "gpt", "value": "It has shipped."}],
        "tools": json.dumps(TOOLS), "reward": 1.0, "id": "conv-1"}
    r.update(kw)
    return r


def function_call_record():
    """LLaMA-Factory style: function_call and observation turns, a top-level system prompt."""
    return {"system": "Be brief.", "reward": 0.5, "conversations": [
        {"from": "human", "value": "Refund 12 and 13"},
        {"from": "function_call", "value": json.dumps([{"name": "refund", "arguments": {"id": 12}},
                                                        {"name": "refund", "arguments": '{"id": 13}'}])},
        {"from": "observation", "value": "ok 12"},
        {"from": "observation", "value": "ok 13"},
        {"from": "gpt", "value": "Both refunded."}]}


def test_hermes_tool_calls_in_gpt_turns_become_openai_tool_calls():
    rec = parse_record(hermes_record())
    m = rec["messages"]
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "assistant"]
    assert m[2]["content"] == "Let me look."
    assert m[2]["tool_calls"] == [{"id": "call_0", "type": "function",
                                   "function": {"name": "get_order", "arguments": '{"order_id": 4821}'}}]
    assert m[3] == {"role": "tool", "content": '{"status": "shipped"}', "tool_call_id": "call_0", "name": "get_order"}
    assert rec["instruction"] == "Where is order 4821?"
    assert rec["tools"] == [{"type": "function", "function": TOOLS[0]}]
    assert rec["meta"]["format"] == "sharegpt" and rec["meta"]["extra"] == {"id": "conv-1"}


def test_function_call_turns_and_observations_pair_up_in_order():
    m = parse_record(function_call_record())["messages"]
    assert m[0] == {"role": "system", "content": "Be brief."}
    calls = m[2]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ['{"id": 12}', '{"id": 13}']
    assert [(x["tool_call_id"], x["content"]) for x in m[3:5]] == [("call_0", "ok 12"), ("call_1", "ok 13")]
    assert m[5] == {"role": "assistant", "content": "Both refunded."}


@pytest.mark.parametrize("bad, reason", [
    ({"conversations": [{"from": "bot", "value": "hi"}], "reward": 1}, "conversations[0]: unknown 'from' 'bot'"),
    ({"conversations": [{"from": "human", "value": "hi"},
                        {"from": "gpt", "value": "<tool_call>{nope}</tool_call>"}], "reward": 1},
     "conversations[1]: a <tool_call> block is not JSON"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "missing reward (a ShareGPT record needs"),
    ({"conversations": []}, "no conversations"),
])
def test_bad_sharegpt_records_say_why(bad, reason):
    with pytest.raises(RecordError) as e:
        parse_record(bad)
    assert reason in str(e.value)


def test_add_rollouts_names_the_format_and_reports_bad_lines(lopd, tmp_path):
    assert lopd("init", "p", "--no-base-policy", cwd=tmp_path).code == 0
    project = tmp_path / "p"
    good = project / "sharegpt.jsonl"
    good.write_text(json.dumps(hermes_record()) + "\n" + json.dumps(function_call_record()) + "\n")
    r = lopd("bank", "add-rollouts", "sharegpt.jsonl", "--min-reward", "0", cwd=project)
    assert r.code == 0, r
    assert "sharegpt.jsonl: format ShareGPT conversations (from/value)" in r.err
    assert "sharegpt.jsonl: added 2" in r.out
    with Bank(project / "bank.sqlite", 0.0, create=False) as bank:
        items = list(bank.iter_items(success_only=False))
    assert {i.messages[2]["tool_calls"][0]["function"]["name"] for i in items} == {"get_order", "refund"}

    bad = project / "bad.jsonl"
    bad.write_text(json.dumps(hermes_record(reward=0.2)) + "\n"
                   + json.dumps({"conversations": [{"from": "robot", "value": "x"}], "reward": 1}) + "\n")
    r = lopd("bank", "add-rollouts", "bad.jsonl", "--json", cwd=project)
    assert r.code == 1
    assert "bad.jsonl:2: conversations[0]: unknown 'from' 'robot'" in r.err
    assert json.loads(r.out)["files"][0]["format"] == "sharegpt"

    openai_file = project / "openai.jsonl"
    openai_file.write_text(json.dumps({"instruction": "x", "reward": 1.0,
                                       "messages": [{"role": "user", "content": "x"}]}) + "\n")
    r = lopd("bank", "add-rollouts", "openai.jsonl", cwd=project)
    assert r.code == 0 and "openai.jsonl: format OpenAI chat messages" in r.err, r
