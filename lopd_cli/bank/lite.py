"""Observation-lite: a transcript with long tool outputs trimmed, for retrieval and the composer.

A tool output longer than the character budget keeps its head and tail (two thirds / one third
of the budget) around a `…[N chars trimmed]…` marker; everything else is unchanged. The full
transcript stays in the bank. `lite_text` renders a bank item as plain text for embedding.
"""

from __future__ import annotations

from typing import Any

from lopd_cli.bank.records import content_text

# Bump when lite_text's layout changes: the index fingerprint includes it, so an index built
# from the old text is detected as stale.
TEXT_TEMPLATE_VERSION = 1


def trim_middle(text: str, budget: int) -> str:
    """Keep at most `budget` characters of `text`: head and tail around a marker."""
    if len(text) <= budget:
        return text
    tail = budget // 3
    head = budget - tail
    return f"{text[:head]}\n…[{len(text) - head - tail} chars trimmed]…\n{text[len(text) - tail:] if tail else ''}"


def lite_messages(messages: list[dict], budget_chars: int) -> list[dict]:
    """The transcript with each tool output trimmed to `budget_chars` (head + tail kept)."""
    out = []
    for m in messages:
        if m.get("role") == "tool":
            text = content_text(m.get("content"))
            if len(text) > budget_chars:
                m = {**m, "content": trim_middle(text, budget_chars)}
        out.append(m)
    return out


def _render_call(call: dict) -> str:
    fn = call.get("function", {})
    return f"call {fn.get('name')}({fn.get('arguments', '')})"


def render_transcript(messages: list[dict]) -> str:
    """Messages as `[role] text` lines; tool calls as `call name(args)`; system turns skipped."""
    lines = []
    for m in messages:
        role = m.get("role")
        if role == "system":
            continue
        text = content_text(m.get("content")).strip()
        if role == "tool":
            label = f"[tool {m['name']}]" if m.get("name") else "[tool]"
            lines.append(f"{label} {text}")
            continue
        parts = [text] if text else []
        parts += [_render_call(c) for c in m.get("tool_calls") or []]
        lines.append(f"[{role}] " + "\n  ".join(parts))
    return "\n".join(lines)


def lite_text(item: Any, budget: int) -> str:
    """`Task: instruction` followed by the observation-lite transcript of a bank item (anything
    with `.instruction` and `.messages`)."""
    body = render_transcript(lite_messages(item.messages, budget))
    return f"Task: {item.instruction}\n{body}"


def embed_text(item: Any, mode: str, budget: int) -> str:
    """What the index embeds for an item: `instruction` or `instruction+trajectory`."""
    if mode == "instruction":
        return item.instruction
    if mode == "instruction+trajectory":
        return lite_text(item, budget)
    raise ValueError(f"unknown embed_text mode {mode!r}")
