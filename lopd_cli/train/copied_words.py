"""Which action tokens repeat an entity of the conversation (the base policy's phase 3).

An agent's decisive tokens are often copies: the e-mail of the user's request in a tool call's
arguments, the status a tool returned in the answer. In a transcript they are a handful among
hundreds of format tokens, so under a token-mean loss a tiny model learns the format and writes a
likely name instead of the one in front of it.

A copy is a word (letters, digits and `@._+-` inside, e.g. `zoe29@mail.com`, `O-1042`, `12.50`)
of an assistant message that also occurs as a word in a user or tool message before it, and
occurs nowhere in the system prompt or the tool schemas (words the template and schemas supply,
like `email`, are format, not entities). A token is marked when its text overlaps a copy.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from lopd_cli.train.token_marks import token_pieces, tokens_overlapping

WORD = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9@._+-]*[A-Za-z0-9])?")


def words(text: str) -> set[str]:
    return set(WORD.findall(text))


def _content(message: dict) -> str:
    content = message.get("content") or ""
    return content if isinstance(content, str) else json.dumps(content)


def copyable_words(messages: Sequence[dict], tools: Sequence[dict] | None) -> list[set[str]]:
    """For each assistant message (in order), the words it may copy: those of the user and tool
    messages before it, less the words of the system prompt and the tool schemas."""
    format_words = words(json.dumps(list(tools or [])))
    seen: set[str] = set()
    per_turn = []
    for m in messages:
        role = m.get("role")
        if role == "system":
            format_words |= words(_content(m))
        elif role in ("user", "tool"):
            seen |= words(_content(m))
        elif role == "assistant":
            per_turn.append(seen - format_words)
    return per_turn


def _runs(action_mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of action tokens."""
    runs, start = [], None
    for i, m in enumerate(list(action_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def copied_token_mask(tokenizer, input_ids: Sequence[int], action_mask: Sequence[int],
                      messages: Sequence[dict], tools: Sequence[dict] | None) -> list[bool]:
    """Per token of `input_ids`: an action token whose text overlaps a copy (module docstring).
    The k-th run of action tokens is the k-th assistant message (`agent/chat.py`
    `tokenize_transcript` gives one run per assistant turn)."""
    marked = [False] * len(input_ids)
    for (start, end), copyable in zip(_runs(action_mask), copyable_words(messages, tools)):
        if not copyable:
            continue
        pieces = token_pieces(tokenizer, input_ids[start:end])
        text = "".join(pieces)
        hit = [False] * len(text)
        for m in WORD.finditer(text):
            if m.group() in copyable:
                hit[m.start():m.end()] = [True] * (m.end() - m.start())
        marked[start:end] = tokens_overlapping(pieces, hit)
    return marked
