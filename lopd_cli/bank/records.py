"""Parse and validate one rollout record (a JSONL line) into a normalised dict.

The format is ARCHITECTURE.md's "Rollout record": OpenAI chat messages plus `instruction`,
`reward`, optional `task_id`, `tools` and `meta`. Normalisation is small and lossless for
what the bank keeps: tool-call `arguments` given as an object become the JSON string OpenAI
uses, a missing `instruction` is taken from the first user message, the reward becomes a
float, and unknown top-level fields move into `meta["extra"]`. Messages are otherwise kept
exactly as given (extra message keys such as `name` or `reasoning_content` stay).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
KNOWN_FIELDS = frozenset({"task_id", "instruction", "messages", "reward", "tools", "meta"})


class RecordError(ValueError):
    """A record that cannot go into the bank; the message is the reason, without location."""


def content_text(content: Any) -> str:
    """The text of a message `content`: a string, null, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return
    raise RecordError(f"{where}: content must be a string, null or a list of content parts")


def _normalise_tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise RecordError(f"{where}: tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise RecordError(f"{w}: must be an object")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise RecordError(f"{w}: missing 'function' object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RecordError(f"{w}: function.name must be a non-empty string")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        elif not isinstance(args, str):
            raise RecordError(f"{w}: function.arguments must be a JSON string or an object")
        if args is not fn.get("arguments"):
            call = {**call, "function": {**fn, "arguments": args}}
        out.append(call)
    return out


def _normalise_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RecordError("no messages (need a non-empty list 'messages')")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RecordError(f"{where}: must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise RecordError(f"{where}: unknown role {role!r} (expected one of {', '.join(sorted(ROLES))})")
        _check_content(m.get("content"), where)
        if m.get("tool_calls") is not None:
            m = {**m, "tool_calls": _normalise_tool_calls(m["tool_calls"], where)}
        out.append(m)
    return out


def parse_record(obj: Any) -> dict[str, Any]:
    """Validate one decoded record; returns task_id, instruction, messages, tools, reward, meta."""
    if not isinstance(obj, dict):
        raise RecordError(f"a record must be a JSON object, got {type(obj).__name__}")
    messages = _normalise_messages(obj.get("messages"))

    reward = obj.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise RecordError("missing reward" if reward is None else f"reward must be a number, got {reward!r}")
    reward = float(reward)
    if not math.isfinite(reward):
        raise RecordError(f"reward must be a finite number, got {reward}")

    instruction = obj.get("instruction")
    if instruction is None:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise RecordError("no instruction and no user message to take it from")
        instruction = content_text(first_user.get("content"))
    if not isinstance(instruction, str):
        raise RecordError("instruction must be a string")

    task_id = obj.get("task_id")
    if task_id is not None:
        if isinstance(task_id, bool) or not isinstance(task_id, (str, int)):
            raise RecordError("task_id must be a string or an integer")
        task_id = str(task_id)

    tools = obj.get("tools")
    tools = [] if tools is None else tools
    if not isinstance(tools, list):
        raise RecordError("tools must be a list of tool schemas")

    meta = obj.get("meta")
    meta = {} if meta is None else meta
    if not isinstance(meta, dict):
        raise RecordError("meta must be an object")
    extra = {k: v for k, v in obj.items() if k not in KNOWN_FIELDS}
    if extra:
        meta = dict(meta)
        prior = meta.get("extra")
        meta["extra"] = {**prior, **extra} if isinstance(prior, dict) else extra
    return dict(task_id=task_id, instruction=instruction, messages=messages, tools=tools, reward=reward, meta=meta)


def parse_line(line: bytes | str) -> dict[str, Any]:
    """Decode and validate one JSONL line."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError(f"not UTF-8 text (byte {e.start})") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise RecordError(f"not JSON ({e.msg} at column {e.colno})") from None
    return parse_record(obj)


def content_hash(rec: dict[str, Any]) -> str:
    """Identity of a rollout: what was asked, what happened and how it scored (not meta)."""
    key = [rec["task_id"], rec["instruction"], rec["messages"], rec["tools"], rec["reward"]]
    blob = json.dumps(key, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def to_export(rec: dict[str, Any]) -> dict[str, Any]:
    """The JSONL record written by `lopd bank export` (read back unchanged by add-rollouts)."""
    out: dict[str, Any] = {}
    if rec.get("task_id") is not None:
        out["task_id"] = rec["task_id"]
    out.update(instruction=rec["instruction"], messages=rec["messages"], reward=rec["reward"],
               tools=rec["tools"], meta=rec["meta"])
    return out
