"""Rollout record parsing: every kind of bad line, and the normalisations that are allowed."""

import json

import pytest

from lopd_cli.bank.records import RecordError, content_hash, parse_line, parse_record, to_export


def rec(**kw):
    base = {"task_id": "t1", "instruction": "Refund order 4821",
            "messages": [{"role": "user", "content": "Refund order 4821"},
                         {"role": "assistant", "content": "done"}],
            "reward": 1.0}
    base.update(kw)
    return base


@pytest.mark.parametrize("line, reason", [
    ("{not json", "not JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps(rec(messages=[])), "no messages"),
    (json.dumps({k: v for k, v in rec().items() if k != "messages"}), "no messages"),
    (json.dumps(rec(messages="hello")), "no messages"),
    (json.dumps(rec(reward="high")), "reward must be a number"),
    (json.dumps(rec(reward=True)), "reward must be a number"),
    (json.dumps({k: v for k, v in rec().items() if k != "reward"}), "missing reward"),
    ('{"messages": [{"role": "user", "content": "x"}], "reward": NaN}', "finite"),
    (json.dumps(rec(messages=[{"role": "bot", "content": "x"}])), "unknown role 'bot'"),
    (json.dumps(rec(messages=[{"content": "x"}])), "unknown role None"),
    (json.dumps(rec(messages=["hi"])), "messages[0]: must be an object"),
    (json.dumps(rec(messages=[{"role": "user", "content": 5}])), "content must be"),
    (json.dumps(rec(messages=[{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}])),
     "function.name"),
    (json.dumps(rec(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}])),
     "arguments must be a JSON string or an object"),
    (json.dumps(rec(messages=[{"role": "assistant", "tool_calls": {"name": "f"}}])), "tool_calls must be a list"),
    (json.dumps({"messages": [{"role": "system", "content": "s"}], "reward": 1}), "no instruction and no user message"),
    (json.dumps(rec(instruction=["a"])), "instruction must be a string"),
    (json.dumps(rec(tools={"a": 1})), "tools must be a list"),
    (json.dumps(rec(meta=[1])), "meta must be an object"),
    (json.dumps(rec(task_id={"a": 1})), "task_id must be"),
])
def test_bad_line_kinds(line, reason):
    with pytest.raises(RecordError, match=reason.replace("[", r"\[").replace("(", r"\(")):
        parse_line(line)


def test_not_utf8():
    with pytest.raises(RecordError, match="not UTF-8"):
        parse_line(b'{"a": "\xff\xfe"}')


def test_arguments_object_and_string_normalise_to_the_same_record():
    call = {"id": "c1", "type": "function", "function": {"name": "get_order", "arguments": {"order_id": 4821}}}
    as_obj = rec(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "c1", "content": None}])
    as_str = json.loads(json.dumps(as_obj))
    as_str["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"order_id": 4821}'
    a, b = parse_record(as_obj), parse_record(as_str)
    assert a == b
    assert a["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"order_id": 4821}'
    assert a["messages"][1]["content"] is None and a["messages"][2]["content"] is None
    assert content_hash(a) == content_hash(b)


def test_instruction_from_first_user_message_and_extras_into_meta():
    r = parse_record({"messages": [{"role": "system", "content": "sys"},
                                   {"role": "user", "content": [{"type": "text", "text": "Find "}, {"type": "text", "text": "it"}]}],
                      "reward": 1, "model": "gpt", "meta": {"env": "orders"}})
    assert r["instruction"] == "Find it"
    assert r["reward"] == 1.0 and isinstance(r["reward"], float)
    assert r["meta"] == {"env": "orders", "extra": {"model": "gpt"}}
    assert r["task_id"] is None and r["tools"] == []


def test_export_record_reads_back_identically():
    r = parse_record(rec(extra_field=[1, 2], tools=[{"type": "function", "function": {"name": "f"}}], task_id=17))
    again = parse_record(json.loads(json.dumps(to_export(r))))
    assert again == r and content_hash(again) == content_hash(r)


def test_hash_depends_on_transcript_and_reward_not_meta():
    r = parse_record(rec())
    assert content_hash(parse_record(rec(meta={"seed": 3}))) == content_hash(r)
    assert content_hash(parse_record(rec(reward=0.5))) != content_hash(r)
    assert content_hash(parse_record(rec(messages=[{"role": "user", "content": "other"}]))) != content_hash(r)
