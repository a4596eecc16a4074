"""The base policy's phase 3: which action tokens count as copies of the conversation."""

from __future__ import annotations

import json

import pytest

from lopd_cli.train.copied_words import copied_token_mask, copyable_words

TOOLS = [{"type": "function", "function": {"name": "find_customer", "description": "Look up a customer by email.",
                                           "parameters": {"type": "object", "properties": {"email": {"type": "string"}}}}}]


def _call(name: str, **args) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


MESSAGES = [
    {"role": "system", "content": "You help customers of the store. Sign off with Thanks."},
    {"role": "user", "content": "I am zoe29@mail.com. Where is my order? Thanks"},
    _call("find_customer", email="zoe29@mail.com"),
    {"role": "tool", "tool_call_id": "c1",
     "content": json.dumps({"customer_id": 7, "email": "zoe29@mail.com", "status": "pending"})},
    {"role": "assistant", "content": "Your order is pending, zoe29@mail.com. Thanks"},
]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from lopd_cli.models.backbone import load_tokenizer, resolve_backbone

    return load_tokenizer(resolve_backbone("tiny"))


def test_copyable_words_come_from_earlier_user_and_tool_messages_only():
    first, second = copyable_words(MESSAGES, TOOLS)
    assert "zoe29@mail.com" in first
    assert "pending" not in first, "the tool result comes after the first call"
    assert {"pending", "zoe29@mail.com", "7"} <= second
    # words of the system prompt ("Thanks") and of the tool schemas ("email", a key of the tool
    # result) are format, not entities, though the request and the result contain them
    assert "Thanks" not in first | second and "email" not in second


def test_the_copied_tokens_of_a_transcript(tiny_tokenizer):
    from lopd_cli.agent.chat import tokenize_transcript

    ids, mask = tokenize_transcript(tiny_tokenizer, MESSAGES, TOOLS)
    marked = copied_token_mask(tiny_tokenizer, ids, mask, MESSAGES, TOOLS)
    assert all(m for c, m in zip(marked, mask) if c), "only action tokens are marked"
    text = "".join(tiny_tokenizer.decode([t]) for t, c in zip(ids, marked) if c)
    # the call's argument; in the answer the request's words, the status and the e-mail; not
    # "Your" (the request says "my") and not the system prompt's sign-off
    assert text.replace(" ", "") == "zoe29@mail.com" + "orderispendingzoe29@mail.com", text
