"""The help desk's reward: a checklist read from the server's final state, in [0, 1].

lopd calls score(task, transcript, server) once the episode is over; `server.call(tool, args)`
calls a tool of this episode's server (lopd adds the hidden state_key) and returns its structured
content. Items: each expected change holds, nothing else changed, and the final answer states
each required fact. The reward is the fraction that holds; 1.0 is a success.
"""

from __future__ import annotations

from typing import Any


def _final_answer(transcript: list[dict]) -> str:
    for m in reversed(transcript):
        if m.get("role") == "assistant" and not m.get("tool_calls"):
            return str(m.get("content") or "")
    return ""


def _dig(desk: dict, path: str) -> Any:
    value: Any = desk
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def checklist(data: dict, state: dict, transcript: list[dict]) -> list[tuple[str, bool]]:
    desk, changed = state["desk"], set(state["changes"])
    items = []
    for key, want in data["expect"].items():
        kind, row, field = key.split(":")
        have = desk[kind].get(row, {}).get(field)
        ok = key in changed if want == "*" else have == want
        items.append((f"{key} = {want!r}", ok))
    extra = changed - set(data["expect"])
    items.append((f"nothing else changed ({sorted(extra)})", not extra))
    answer = _final_answer(transcript).lower()
    for fact in data.get("answer", []):
        items.append((f"answer states {fact}", fact.lower() in answer))
    for path in data.get("answer_state", []):
        fact = _dig(desk, path)
        items.append((f"answer states {path}", fact is not None and str(fact).lower() in answer))
    return items


def score(task: dict, transcript: list[dict], server) -> float:
    state = server.call("get_state", {})
    items = checklist(task["data"], state, transcript)
    return sum(ok for _, ok in items) / len(items)
