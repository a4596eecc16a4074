"""Parse and validate one rollout record (a JSONL line) into a normalised dict.

The format is ARCHITECTURE.md's "Rollout record": OpenAI chat messages plus `instruction`,
`reward`, optional `task_id`, `tools` and `meta`. Normalisation is small and lossless for
what the bank keeps: tool-call `arguments` given as an object become the JSON string OpenAI
uses, a missing `instruction` is taken from the first user message, the reward becomes a
float, and unknown top-level fields move into `meta["extra"]`. Messages are otherwise kept
exactly as given (extra message keys such as `name` or `reasoning_content` stay).

ShareGPT-style records (`conversations`: [{"from": ..., "value": ...}], as many fine-tuning
sets and agent stacks write them) are turned into OpenAI messages first; see `from_sharegpt`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
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


# ShareGPT speaker -> OpenAI role; `function_call` turns become assistant tool calls.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool", "observation": "tool",
                  "function_response": "tool", "function_call": "assistant"}
FORMATS = {"openai": "OpenAI chat messages", "sharegpt": "ShareGPT conversations (from/value)"}
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def detect_format(obj: Any) -> str | None:
    """"openai" (a `messages` list), "sharegpt" (a `conversations` list) or None."""
    if not isinstance(obj, dict):
        return None
    if "messages" in obj:
        return "openai"
    if "conversations" in obj:
        return "sharegpt"
    return None


def _openai_call(spec: Any, k: int, where: str) -> dict:
    """{"name", "arguments"} (arguments an object or a JSON string) -> an OpenAI tool call."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RecordError(f"{where}: a tool call needs a 'name' (got {json.dumps(spec)[:60]})")
    args = spec.get("arguments", spec.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise RecordError(f"{where}: arguments of '{spec['name']}' are not JSON") from None
    if not isinstance(args, dict):
        raise RecordError(f"{where}: arguments of '{spec['name']}' must be an object")
    return {"id": f"call_{k}", "type": "function",
            "function": {"name": spec["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _calls_in_text(text: str, first_id: int, where: str) -> tuple[str, list[dict]]:
    """The text outside <tool_call> blocks, and the blocks' calls."""
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            spec = json.loads(block)
        except json.JSONDecodeError:
            raise RecordError(f"{where}: a <tool_call> block is not JSON") from None
        calls.append(_openai_call(spec, first_id + len(calls), where))
    return (_TOOL_CALL.sub("", text).strip() if calls else text), calls


def _tool_schemas(tools: Any) -> Any:
    """ShareGPT sets often store tools as a JSON string and as bare function schemas."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else []
        except json.JSONDecodeError:
            raise RecordError("tools is a string but not JSON") from None
    if isinstance(tools, list):
        tools = [t if not isinstance(t, dict) or "function" in t or "name" not in t
                 else {"type": "function", "function": t} for t in tools]
    return tools


def from_sharegpt(obj: dict) -> dict:
    """A ShareGPT record as an OpenAI one: `conversations` -> `messages`, ids for tool calls.

    Speakers: system, human/user, gpt/assistant, tool/observation/function_response, and
    function_call (a JSON call, or a list of them, that becomes the assistant's tool_calls).
    Tool calls in gpt turns are read from <tool_call>{"name", "arguments"}</tool_call> blocks.
    A tool turn answers the oldest call not yet answered. A top-level `system` string becomes
    the first message; every other key is kept for parse_record.
    """
    turns = obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise RecordError("no conversations (need a non-empty list 'conversations')")
    messages: list[dict] = []
    if isinstance(obj.get("system"), str) and obj["system"]:
        messages.append({"role": "system", "content": obj["system"]})
    pending: list[dict] = []  # calls without a tool answer yet
    n_calls = 0
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(f"{where}: must be an object with 'from' and 'value'")
        speaker, value = turn.get("from"), turn.get("value")
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise RecordError(f"{where}: unknown 'from' {speaker!r} (expected one of {', '.join(SHAREGPT_ROLES)})")
        if speaker == "function_call":
            try:
                spec = json.loads(value) if isinstance(value, str) else value
            except json.JSONDecodeError:
                raise RecordError(f"{where}: a function_call value must be JSON") from None
            specs = spec if isinstance(spec, list) else [spec]
            calls = [_openai_call(s, n_calls + j, where) for j, s in enumerate(specs)]
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        elif not isinstance(value, str):
            raise RecordError(f"{where}: 'value' must be a string")
        elif role == "assistant":
            text, calls = _calls_in_text(value, n_calls, where)
            messages.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
        elif role == "tool":
            call = pending.pop(0) if pending else None
            msg = {"role": "tool", "content": value}
            if call is not None:
                msg.update(tool_call_id=call["id"], name=call["function"]["name"])
            messages.append(msg)
            continue
        else:
            messages.append({"role": role, "content": value})
            continue
        n_calls += len(calls)
        pending = list(calls)
    out = {k: v for k, v in obj.items() if k not in ("conversations", "system")}
    out["messages"] = messages
    if "tools" in out:
        out["tools"] = _tool_schemas(out["tools"])
    return out


def parse_record(obj: Any) -> dict[str, Any]:
    """Validate one decoded record; returns task_id, instruction, messages, tools, reward, meta.

    OpenAI-format records and ShareGPT ones (see from_sharegpt) are read; a ShareGPT record's
    meta gets `format: sharegpt`."""
    if not isinstance(obj, dict):
        raise RecordError(f"a record must be a JSON object, got {type(obj).__name__}")
    fmt = detect_format(obj)
    if fmt == "sharegpt":
        obj = from_sharegpt(obj)
    elif fmt is None:
        raise RecordError("no messages (need a non-empty list 'messages', or ShareGPT 'conversations')")
    messages = _normalise_messages(obj.get("messages"))

    reward = obj.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        if reward is None:
            hint = " (a ShareGPT record needs a top-level 'reward' number as well)" if fmt == "sharegpt" else ""
            raise RecordError(f"missing reward{hint}")
        raise RecordError(f"reward must be a number, got {reward!r}")
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
    if fmt == "sharegpt":
        meta = {**meta, "format": "sharegpt"}
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
