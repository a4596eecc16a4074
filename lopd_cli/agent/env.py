"""The environment protocol a world (built-in or a user's plugin) implements, and the checks that
turn what a plugin returns into lopd's types (or one line saying what was wrong)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from lopd_cli.agent.types import Task, ToolCall
from lopd_cli.errors import LopdError

TASK_KEYS = "id, instruction, tools, data"


@runtime_checkable
class Environment(Protocol):
    """One instance runs one episode at a time; the runner makes one instance per live episode.

    tasks(split)        the tasks of a split: "train", "validation" or "test"; each a `Task` or a
                        mapping with the keys id, instruction, tools (JSON schemas), data
    reset(task)         initial chat messages (system + user) for that task
    step(call)          run one tool call (a `ToolCall`: name, arguments, id), return the observation text
    done()              optional: the env ended the episode
    reward(transcript)  in [0, 1]; a recipe's reward plugin may override it
    """

    def tasks(self, split: str) -> list[Task]: ...

    def reset(self, task: Task) -> list[dict]: ...

    def step(self, call: ToolCall) -> str: ...

    def reward(self, transcript: list[dict]) -> float: ...


def env_done(env: object) -> bool:
    fn = getattr(env, "done", None)
    return bool(fn()) if callable(fn) else False


def describe(value: Any, limit: int = 60) -> str:
    """A short, one-line description of a returned value: its type and a clipped repr."""
    text = repr(value).replace("\n", " ")
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"


def _tool_schema(tool: Any) -> dict | None:
    """An OpenAI tool schema; a bare function schema ({"name", "parameters"}) gets its wrapper."""
    if not isinstance(tool, Mapping):
        return None
    if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
        return dict(tool)
    if isinstance(tool.get("name"), str):
        return {"type": "function", "function": dict(tool)}
    return None


def coerce_task(item: Any, split: str, where: str) -> Task:
    """A `Task` from what a plugin's tasks() returned: a Task, or a mapping with the same keys.

    A mapping is kept as `Task.raw`, so the plugin's own reset() and reward get back exactly
    the object it made. `where` names the plugin method and index for the error message.
    """
    expected = f"expected a Task or a mapping with keys {TASK_KEYS}"
    if isinstance(item, Task):
        return item
    if not isinstance(item, Mapping):
        raise LopdError(f"{where} is {describe(item)}; {expected}")
    missing = [k for k in ("id", "instruction") if item.get(k) in (None, "")]
    if missing:
        raise LopdError(f"{where} has no {' or '.join(repr(k) for k in missing)} (keys: {sorted(map(str, item))}); {expected}")
    if not isinstance(item["instruction"], str):
        raise LopdError(f"{where}['instruction'] is {describe(item['instruction'])}; expected a string")
    tools_in = item.get("tools") or []
    if isinstance(tools_in, (str, bytes, Mapping)) or not isinstance(tools_in, Iterable):
        raise LopdError(f"{where}['tools'] is {describe(tools_in)}; expected a list of JSON tool schemas")
    tools = []
    for j, tool in enumerate(tools_in):
        schema = _tool_schema(tool)
        if schema is None:
            raise LopdError(f"{where}['tools'][{j}] is {describe(tool)}; expected a JSON tool schema "
                            '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
        tools.append(schema)
    data = item.get("data") or {}
    if not isinstance(data, Mapping):
        raise LopdError(f"{where}['data'] is {describe(data)}; expected a mapping")
    return Task(id=str(item["id"]), instruction=item["instruction"], tools=tools, data=dict(data),
                split=str(item.get("split") or split), raw=item)


def coerce_tasks(value: Any, split: str, source: str) -> list[Task]:
    """Every task of a tasks(split) result; `source` names the plugin (e.g. "env.class 'x.py:Env'")."""
    where = f"{source} tasks({split!r})"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise LopdError(f"{where} returned {describe(value)}; expected a list of Task or of mappings "
                        f"with keys {TASK_KEYS}")
    return [coerce_task(item, split, f"{where}[{i}]") for i, item in enumerate(value)]


def check_messages(value: Any, source: str) -> list[dict]:
    """reset()'s result: a list of chat messages, each a mapping with a role and string content."""
    expected = 'expected a list of chat messages like {"role": "user", "content": "..."}'
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise LopdError(f"{source} reset() returned {describe(value)}; {expected}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise LopdError(f"{source} reset() returned {describe(m)} at [{i}]; {expected}")
        out.append(dict(m))
    if not out:
        raise LopdError(f"{source} reset() returned an empty list; {expected}")
    return out


def check_observation(value: Any, source: str, call: ToolCall) -> str:
    if not isinstance(value, str):
        raise LopdError(f"{source} step() returned {describe(value)} for tool '{call.name}'; "
                        "expected the observation as a string (json.dumps a dict)")
    return value


def plugin_view(task: Task) -> Any:
    """The task as the plugin made it (its mapping), for the plugin's own reset() and reward."""
    return task.raw if task.raw is not None else task
