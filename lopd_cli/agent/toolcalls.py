"""The tool-call protocol: Hermes/Qwen `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
or a JSON list of such objects inside one block (SmolLM2's format, `agent/chat_profiles.py`).

`parse_tool_calls` turns a model turn into (visible text, calls). It never raises: malformed
JSON, an unclosed tag (unless all that follows it is JSON: vLLM's Hermes reading), an unknown tool or arguments that do not fit the tool's JSON schema
become a `ToolCall` whose `error` the runner shows to the model as the observation.
Argument checking covers what tool schemas usually say (required keys, unknown keys, JSON
types, enums); it is not a full JSON-Schema validator.
"""

from __future__ import annotations

import json
import re
from typing import Any

from lopd_cli.agent.types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def tool_schemas_by_name(tools: list[dict]) -> dict[str, dict]:
    """{name: function schema} from OpenAI tool entries (`{"type": "function", "function": …}`)."""
    out = {}
    for t in tools:
        f = t.get("function", t)
        out[f["name"]] = f
    return out


def _type_ok(value: Any, expected: str | list[str]) -> bool:
    kinds = expected if isinstance(expected, list) else [expected]
    for k in kinds:
        py = _JSON_TYPES.get(k)
        if py is None:
            return True  # a type we do not check
        if isinstance(value, bool) and k in ("integer", "number"):
            continue
        if isinstance(value, py):
            return True
    return False


def check_arguments(schema: dict, arguments: dict[str, Any]) -> str | None:
    """A one-line problem with `arguments` for the function `schema`, or None when they fit."""
    params = schema.get("parameters") or {}
    props: dict = params.get("properties") or {}
    name = schema.get("name", "?")
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"{name}: missing required argument(s) {', '.join(missing)}"
    if props and params.get("additionalProperties", False) is False:
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return f"{name}: unknown argument(s) {', '.join(unknown)} (expected {', '.join(props)})"
    for key, value in arguments.items():
        spec = props.get(key) or {}
        if "type" in spec and not _type_ok(value, spec["type"]):
            return f"{name}: argument '{key}' should be {spec['type']}, got {json.dumps(value)}"
        if "enum" in spec and value not in spec["enum"]:
            return f"{name}: argument '{key}' must be one of {json.dumps(spec['enum'])}"
    return None


def _parse_block(body: str, index: int, schemas: dict[str, dict] | None) -> list[ToolCall]:
    """One `<tool_call>` block: a single call object (Hermes/Qwen) or a JSON list of them (the
    SmolLM2 / APIGen format, `agent/chat_profiles.py`; `[]` means no call)."""
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return [ToolCall(name="", arguments={}, id=f"call_{index}", error=f"malformed JSON in tool call ({e.msg})")]
    if isinstance(obj, list):
        return [_parse_one(o, index + i, schemas) for i, o in enumerate(obj)]
    return [_parse_one(obj, index, schemas)]


def _parse_one(obj: object, index: int, schemas: dict[str, dict] | None) -> ToolCall:
    call_id = f"call_{index}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(name="", arguments={}, id=call_id, error='a tool call must be {"name": ..., "arguments": {...}}')
    name = obj["name"]
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models put the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name=name, arguments={}, id=call_id, error=f"{name}: arguments are not a JSON object")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name=name, arguments={}, id=call_id, error=f"{name}: arguments must be a JSON object")
    call = ToolCall(name=name, arguments=args, id=call_id)
    if schemas is not None:
        if name not in schemas:
            call.error = f"unknown tool '{name}' (available: {', '.join(schemas)})"
        else:
            call.error = check_arguments(schemas[name], args)
    return call


def parse_tool_calls(text: str, tools: list[dict] | None = None, id_offset: int = 0) -> tuple[str, list[ToolCall]]:
    """Split a generated turn into its visible text and its tool calls (several allowed).

    With `tools`, names and arguments are checked against the schemas. Call ids are
    `call_{id_offset + i}` so they stay unique across the turns of an episode.
    """
    schemas = tool_schemas_by_name(tools) if tools is not None else None
    calls: list[ToolCall] = []
    for m in _BLOCK.finditer(text):
        calls.extend(_parse_block(m.group(1), id_offset + len(calls), schemas))
    visible = _BLOCK.sub("", text)
    # An opened but never closed call. When everything after the tag is one JSON value (the model
    # ended its turn where `</tool_call>` belonged) it is read as a block, as vLLM's Hermes parser
    # does (`<tool_call>(.*?)</tool_call>|<tool_call>(.*)`), so training, `lopd eval` and a vLLM
    # deployment agree on what counts as a call; anything else (cut off by max_new_tokens, prose
    # after the JSON) is an error.
    dangling = visible.find(OPEN)
    if dangling >= 0:
        rest = visible[dangling + len(OPEN):]
        if _is_json(rest):
            calls.extend(_parse_block(rest, id_offset + len(calls), schemas))
        else:
            calls.append(
                ToolCall(name="", arguments={}, id=f"call_{id_offset + len(calls)}",
                         error="unterminated <tool_call> (missing </tool_call>)")
            )
        visible = visible[:dangling]
    return visible.strip(), calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text.strip())
    except json.JSONDecodeError:
        return False
    return True


def render_tool_call(name: str, arguments: dict[str, Any] | str) -> str:
    """The text a model writes for one call (the Hermes/Qwen format the parser reads)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}\n{{"name": "{name}", "arguments": {args}}}\n{CLOSE}'


def to_openai_tool_calls(calls: list[ToolCall]) -> list[dict]:
    """Well-formed calls in OpenAI chat format (`arguments` is a JSON string)."""
    return [
        {"id": c.id, "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
        for c in calls
    ]


def from_openai_tool_call(entry: dict) -> ToolCall:
    """An OpenAI `tool_calls` entry back into a ToolCall (arguments decoded)."""
    f = entry.get("function", entry)
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name=f.get("name", ""), arguments={}, id=entry.get("id", ""), error="arguments are not JSON")
    return ToolCall(name=f.get("name", ""), arguments=args, id=entry.get("id", ""))


def call_key(call: ToolCall) -> str:
    """Identity of a call for counting repeats: name + canonical arguments."""
    return call.name + json.dumps(call.arguments, sort_keys=True, ensure_ascii=False)
