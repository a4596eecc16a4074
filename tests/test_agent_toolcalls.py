"""Tool-call parsing: well-formed, several per turn, malformed, unknown tools, bad arguments."""

import json

from lopd_cli.agent.toolcalls import call_key, parse_tool_calls, render_tool_call, to_openai_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_order", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}}},
    {"type": "function", "function": {"name": "send_message", "parameters": {
        "type": "object", "properties": {"customer_id": {"type": "integer"}, "text": {"type": "string"}},
        "required": ["customer_id", "text"]}}},
]


def test_one_well_formed_call_and_visible_text():
    text = 'Let me look.\n<tool_call>\n{"name": "get_order", "arguments": {"order_id": 42}}\n</tool_call>'
    visible, calls = parse_tool_calls(text, TOOLS)
    assert visible == "Let me look."
    assert len(calls) == 1 and calls[0].error is None
    assert (calls[0].name, calls[0].arguments, calls[0].id) == ("get_order", {"order_id": 42}, "call_0")


def test_several_calls_in_one_turn_keep_order_and_unique_ids():
    text = render_tool_call("get_order", {"order_id": 1}) + "\n" + render_tool_call(
        "send_message", {"customer_id": 7, "text": "hi <b>"}) + render_tool_call("get_order", {"order_id": 2})
    visible, calls = parse_tool_calls(text, TOOLS, id_offset=3)
    assert visible == ""
    assert [c.name for c in calls] == ["get_order", "send_message", "get_order"]
    assert [c.id for c in calls] == ["call_3", "call_4", "call_5"]
    assert calls[1].arguments == {"customer_id": 7, "text": "hi <b>"}
    assert all(c.error is None for c in calls)


def test_a_json_list_in_one_block_is_several_calls_and_an_empty_list_none():
    """SmolLM2's (APIGen) format: one block holding a list of calls; `[]` = no call."""
    text = ('<tool_call>[\n{"name": "get_order", "arguments": {"order_id": 1}},\n'
            '{"name": "send_message", "arguments": {"customer_id": 7}}\n]</tool_call>'
            '<tool_call>{"name": "get_order", "arguments": {"order_id": 2}}</tool_call>')
    visible, calls = parse_tool_calls(text, TOOLS, id_offset=1)
    assert visible == ""
    assert [(c.name, c.id) for c in calls] == [("get_order", "call_1"), ("send_message", "call_2"), ("get_order", "call_3")]
    assert calls[0].error is None and "missing required argument(s) text" in calls[1].error and calls[2].error is None
    assert parse_tool_calls("<tool_call>[]</tool_call>All done.", TOOLS) == ("All done.", [])


def test_plain_answer_has_no_calls():
    visible, calls = parse_tool_calls("Order 42 is shipped.", TOOLS)
    assert visible == "Order 42 is shipped." and calls == []


def test_malformed_json_becomes_an_error_not_an_exception():
    _, calls = parse_tool_calls('<tool_call>{"name": "get_order", "arguments": {order_id: 4}</tool_call>', TOOLS)
    assert len(calls) == 1 and calls[0].error.startswith("malformed JSON")


def test_unterminated_call_is_reported():
    visible, calls = parse_tool_calls('ok <tool_call>\n{"name": "get_order", "argu', TOOLS)
    assert visible == "ok"
    assert len(calls) == 1 and "unterminated" in calls[0].error


def test_unclosed_call_whose_rest_is_json_is_read_as_vllm_hermes_does():
    # The turn ended where </tool_call> belonged: a call (object or SmolLM2's list), checked as usual.
    visible, calls = parse_tool_calls('ok <tool_call>\n{"name": "get_order", "arguments": {"order_id": 4}}\n', TOOLS)
    assert visible == "ok" and [(c.name, c.arguments, c.error) for c in calls] == [("get_order", {"order_id": 4}, None)]
    _, calls = parse_tool_calls('<tool_call>[\n{"name": "get_order", "arguments": {"order_id": 4}}, '
                                '{"name": "get_order", "arguments": {}}\n]', TOOLS, id_offset=2)
    assert [c.id for c in calls] == ["call_2", "call_3"]
    assert calls[0].error is None and "missing required argument(s) order_id" in calls[1].error
    # Prose after the JSON is not a call: still unterminated.
    _, calls = parse_tool_calls('<tool_call>{"name": "get_order", "arguments": {"order_id": 4}} then I wait', TOOLS)
    assert len(calls) == 1 and "unterminated" in calls[0].error


def test_wrong_shape_unknown_tool_and_bad_arguments():
    cases = {
        '<tool_call>["get_order"]</tool_call>': '{"name"',
        '<tool_call>{"name": "drop_table", "arguments": {}}</tool_call>': "unknown tool 'drop_table'",
        '<tool_call>{"name": "get_order", "arguments": {}}</tool_call>': "missing required argument(s) order_id",
        '<tool_call>{"name": "get_order", "arguments": {"order_id": "42"}}</tool_call>': "should be integer",
        '<tool_call>{"name": "get_order", "arguments": {"order_id": true}}</tool_call>': "should be integer",
        '<tool_call>{"name": "get_order", "arguments": {"order_id": 4, "x": 1}}</tool_call>': "unknown argument(s) x",
        '<tool_call>{"name": "get_order", "arguments": [4]}</tool_call>': "must be a JSON object",
    }
    for text, expected in cases.items():
        _, calls = parse_tool_calls(text, TOOLS)
        assert len(calls) == 1 and calls[0].error and expected in calls[0].error, (text, calls)


def test_arguments_given_as_a_json_string_are_accepted():
    _, calls = parse_tool_calls('<tool_call>{"name": "get_order", "arguments": "{\\"order_id\\": 9}"}</tool_call>', TOOLS)
    assert calls[0].error is None and calls[0].arguments == {"order_id": 9}


def test_without_schemas_names_are_not_checked():
    _, calls = parse_tool_calls('<tool_call>{"name": "anything", "arguments": {"a": 1}}</tool_call>')
    assert calls[0].error is None and calls[0].name == "anything"


def test_openai_format_and_repeat_identity():
    _, calls = parse_tool_calls(render_tool_call("get_order", {"order_id": 5}) * 2, TOOLS)
    entries = to_openai_tool_calls(calls)
    assert entries[0]["type"] == "function" and json.loads(entries[0]["function"]["arguments"]) == {"order_id": 5}
    assert call_key(calls[0]) == call_key(calls[1])
