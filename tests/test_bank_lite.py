"""Observation-lite: long tool outputs keep head and tail; everything else is unchanged."""

from types import SimpleNamespace

from lopd_cli.bank.lite import embed_text, lite_messages, lite_text, trim_middle


def test_trim_keeps_head_and_tail_within_budget():
    text = "HEAD" + "x" * 5000 + "TAIL"
    out = trim_middle(text, 90)
    assert out.startswith("HEADxx") and out.endswith("xxTAIL")
    kept = out.split("\n")
    assert len(kept[0]) + len(kept[2]) == 90
    assert f"[{len(text) - 90} chars trimmed]" in out
    assert trim_middle("short", 90) == "short"


def test_lite_messages_trims_only_long_tool_outputs():
    long_out = "A" * 300 + "B" * 300
    msgs = [{"role": "user", "content": "U" * 1000},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": long_out},
            {"role": "tool", "content": "small"}]
    out = lite_messages(msgs, 60)
    assert out[0] == msgs[0] and out[1] == msgs[1] and out[3] == msgs[3]
    assert out[2]["tool_call_id"] == "c1"
    assert out[2]["content"].startswith("A" * 40) and out[2]["content"].endswith("B" * 20)
    assert len(out[2]["content"]) < 120
    assert msgs[2]["content"] == long_out  # input not modified


def test_lite_text_and_embed_text_modes():
    item = SimpleNamespace(instruction="Refund order 7", messages=[
        {"role": "system", "content": "You are a bot"},
        {"role": "user", "content": "Refund order 7"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "refund", "arguments": '{"id": 7}'}}]},
        {"role": "tool", "content": "ok" * 500},
        {"role": "assistant", "content": "Refunded."}])
    text = lite_text(item, 50)
    assert text.startswith("Task: Refund order 7")
    assert "You are a bot" not in text
    assert 'call refund({"id": 7})' in text and "[assistant] Refunded." in text
    assert "chars trimmed" in text and len(text) < 300
    assert embed_text(item, "instruction", 50) == "Refund order 7"
    assert embed_text(item, "instruction+trajectory", 50) == text
