"""An environment made of an MCP server and a task file (a recipe's `env.mcp` section).

The server's tools are the agent's tool schemas (some hidden or renamed); every call goes
through the runner's schema-checked protocol and then to the server. One server per process
(`mcp_server.shared_server`) serves every episode; a `reset` hook gives each episode its own
state, keyed by `{episode}`. The reward is a plugin `score(task, transcript, server)` that can
read the final state through `server.call(tool, arguments)`.

What happens when the server fails:
- it does not start: one line with the command and the end of its stderr (the command stops);
- it dies mid-run: the episode whose call found it dead fails with the reason, the server is
  started again, and the other episodes that were live on the old process fail too (their state
  went with it); the run goes on;
- a call takes longer than `call_timeout_s`: the agent gets `ERROR: ... timed out`.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lopd_cli.agent.mcp_server import (McpCallTimeout, McpServer, McpServerError, json_text, shared_server,
                                       spec_from_section)
from lopd_cli.agent.types import Task, ToolCall
from lopd_cli.errors import LopdError

SPLITS = ("train", "validation", "test")


# ---------------------------------------------------------------------------- the task file

def _object_lines(text: str, start: int) -> list[tuple[int, Any]]:
    """(line, value) of each element of the JSON array opening at text[start], so a bad element can
    be named FILE:LINE."""
    decoder = json.JSONDecoder()
    pos = start + 1
    out = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return out
        value, end = decoder.raw_decode(text, pos)
        out.append((text.count("\n", 0, pos) + 1, value))
        pos = end


def read_task_records(path: Path) -> list[tuple[str, Any]]:
    """(FILE:LINE, record) for every task of a JSONL file or a JSON array (or {"tasks": [...]})."""
    text = path.read_text()
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise LopdError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        start = text.index("[") if isinstance(data, list) else -1
        if isinstance(data, Mapping) and isinstance(data.get("tasks"), list):
            start = text.index("[", text.index('"tasks"'))
        if start < 0:
            raise LopdError(f"{path}:1: expected a JSON array of tasks (or {{\"tasks\": [...]}})")
        return [(f"{path}:{line}", rec) for line, rec in _object_lines(text, start)]
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{i}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise LopdError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    return out


def check_task_record(rec: Any, where: str) -> dict:
    """A task record: id, split, instruction or opening messages, data. One line naming `where` if not."""
    if not isinstance(rec, Mapping):
        raise LopdError(f"{where}: expected a JSON object with id, split, instruction or messages, data")
    if rec.get("id") in (None, ""):
        raise LopdError(f"{where}: no 'id'")
    split = rec.get("split")
    if split not in SPLITS:
        raise LopdError(f"{where}: 'split' is {split!r}; expected one of {', '.join(SPLITS)}")
    messages, instruction = rec.get("messages"), rec.get("instruction")
    if messages is None and not isinstance(instruction, str):
        raise LopdError(f"{where}: needs 'instruction' (a string) or 'messages' (the opening chat messages)")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise LopdError(f"{where}: 'messages' must be a non-empty list of {{\"role\": ..., \"content\": \"...\"}}")
        if not any(m["role"] == "user" for m in messages):
            raise LopdError(f"{where}: 'messages' has no user message")
    if not isinstance(rec.get("data", {}), Mapping):
        raise LopdError(f"{where}: 'data' must be an object")
    return dict(rec)


_TASKS_CACHE: dict[tuple, list[dict]] = {}


def load_task_records(source: str, base_dir: Path) -> list[dict]:
    """Every task record of `env.mcp.tasks`: a file (relative to the recipe) or 'module:function'."""
    path = Path(source).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if path.is_file():
        key: tuple = (str(path), path.stat().st_mtime_ns)
        if key not in _TASKS_CACHE:
            located = [(w, check_task_record(r, w)) for w, r in read_task_records(path)]
            _check_unique(located)
            _TASKS_CACHE[key] = [r for _, r in located]
        return _TASKS_CACHE[key]
    if ":" in source and not source.endswith((".json", ".jsonl")):
        from lopd_cli.agent.plugins import load_object

        key = (source, str(base_dir))
        if key not in _TASKS_CACHE:
            fn = load_object(source, base_dir, what="env.mcp.tasks")
            located = [(f"env.mcp.tasks '{source}'[{i}]", check_task_record(r, f"env.mcp.tasks '{source}'[{i}]"))
                       for i, r in enumerate(fn())]
            _check_unique(located)
            _TASKS_CACHE[key] = [r for _, r in located]
        return _TASKS_CACHE[key]
    raise LopdError(f"env.mcp.tasks: {path} does not exist")


def _check_unique(located: list[tuple[str, dict]]) -> None:
    """One line naming the second record of a task id (FILE:LINE), and where the first one is."""
    seen: dict[str, str] = {}
    for where, r in located:
        if str(r["id"]) in seen:
            raise LopdError(f"{where}: task id {r['id']!r} appears twice (first at {seen[str(r['id'])]})")
        seen[str(r["id"])] = where


# ---------------------------------------------------------------------------- templates

_FIELD = re.compile(r"\{(episode|task_id|data\[([^\]]+)\])\}")


def render(value: Any, episode: str, task: Task) -> Any:
    """`value` with {episode}, {task_id} and {data[KEY]} filled in (recursively). A string that is
    exactly one {data[KEY]} becomes that value itself, so numbers and objects keep their type."""
    if isinstance(value, Mapping):
        return {k: render(v, episode, task) for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, episode, task) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> Any:
        if m.group(1) == "episode":
            return episode
        if m.group(1) == "task_id":
            return task.id
        if m.group(2) not in task.data:
            raise LopdError(f"env.mcp: task {task.id} has no data[{m.group(2)!r}] (its data keys: {sorted(task.data)})")
        return task.data[m.group(2)]

    whole = _FIELD.fullmatch(value)
    if whole:
        return one(whole)
    return _FIELD.sub(lambda m: json_text(one(m)), value)


class _EpisodeKeys:
    """Episode keys e0, e1, ... handed out per process and reused once an episode is over, so a
    server that keeps a file per state key keeps as many as episodes run at once, not one per episode."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._next += 1
            return self._next - 1

    def give_back(self, n: int) -> None:
        with self._lock:
            self._free.append(n)


_KEYS = _EpisodeKeys()


# ---------------------------------------------------------------------------- tool schemas

def agent_tools(server_tools: list[dict], section: Any) -> list[dict]:
    """The agent's OpenAI tool schemas: the server's tools, less hidden ones and the injected call
    arguments, renamed where the recipe says."""
    listed = {t["name"] for t in server_tools}
    for name in [*section.hide_tools, *section.rename_tools]:
        if name not in listed:
            raise LopdError(f"env.mcp: the server has no tool '{name}' (it has {', '.join(sorted(listed))})")
    hidden = set(section.hide_tools)
    if section.reset is not None:
        hidden.add(section.reset.tool)
    out = []
    for t in server_tools:
        if t["name"] in hidden:
            continue
        params = json.loads(json.dumps(t.get("inputSchema") or {"type": "object", "properties": {}}))
        props = params.get("properties") or {}
        for key in section.call_arguments:
            props.pop(key, None)
        if "required" in params:
            params["required"] = [k for k in params["required"] if k not in section.call_arguments]
        fn = {"name": section.rename_tools.get(t["name"], t["name"]), "description": t.get("description") or "",
              "parameters": params}
        out.append({"type": "function", "function": fn})
    return out


def observation_text(result: Any, key: str | None) -> str:
    """What the agent sees of a call result: the dotted `key` of its JSON (structured content, or
    the text parsed as JSON), or the whole text; `ERROR: ...` when the server flagged an error."""
    text = result.text
    if key:
        doc = result.structured
        if doc is None:
            try:
                doc = json.loads(text)
            except json.JSONDecodeError:
                doc = None
        for part in key.split("."):
            doc = doc.get(part) if isinstance(doc, Mapping) else None
        if doc is not None:
            text = json_text(doc)
    if result.is_error and not text.startswith(("ERROR", "Error")):
        return f"ERROR: {text}"
    return text


# ---------------------------------------------------------------------------- the environment

class EpisodeServer:
    """What a reward plugin gets: the server, with this episode's call arguments added to each call."""

    def __init__(self, env: McpEnv):
        self._env = env

    @property
    def episode(self) -> str:
        return self._env.episode_key

    def call(self, tool: str, arguments: Mapping[str, Any] | None = None) -> Any:
        """Call a server tool (by its server name); returns its structured content, or its text
        parsed as JSON where it is JSON, or the text."""
        result = self._env.call_server(tool, dict(arguments or {}))
        if result.structured is not None:
            return result.structured
        try:
            return json.loads(result.text)
        except json.JSONDecodeError:
            return result.text


class McpEnv:
    """The environment protocol (lopd_cli/agent/env.py) over an MCP server; one instance per episode."""

    name = "mcp"

    def __init__(self, section: Any, base_dir: Path, reward_fn: Callable[..., float] | None = None,
                 reward_spec: str | None = None):
        self.section, self.base_dir = section, base_dir
        self.reward_fn, self.reward_spec = reward_fn, reward_spec
        self.spec = spec_from_section(section, base_dir)
        self.task: Task | None = None
        self.generation = -1
        self._slot: int | None = None
        self._finalizer: Any = None
        self._back = {v: k for k, v in section.rename_tools.items()}

    @property
    def server(self) -> McpServer:
        return shared_server(self.spec)

    @property
    def episode_key(self) -> str:
        return f"e{self._slot}" if self._slot is not None else ""

    def tools(self) -> list[dict]:
        return agent_tools(self.server.tools, self.section)

    def tasks(self, split: str) -> list[Task]:
        tools = self.tools()
        out = []
        for rec in load_task_records(self.section.tasks, self.base_dir):
            if rec["split"] != split:
                continue
            messages = rec.get("messages")
            instruction = rec.get("instruction")
            if not isinstance(instruction, str):
                instruction = next(m["content"] for m in messages if m["role"] == "user")
            out.append(Task(id=str(rec["id"]), instruction=instruction, tools=tools, data=dict(rec.get("data") or {}),
                            split=split, raw=rec))
        return out

    def reset(self, task: Task) -> list[dict]:
        self._release()
        self.task = task
        self._slot = _KEYS.take()
        self._finalizer = weakref.finalize(self, _KEYS.give_back, self._slot)
        server = self.server
        self.generation = server.generation
        hook = self.section.reset
        if hook is not None:
            result = self.call_server(hook.tool, render(hook.arguments, self.episode_key, task))
            if result.is_error:
                raise LopdError(f"env.mcp.reset: {hook.tool} answered an error: {result.text[:300]}")
        raw = task.raw if isinstance(task.raw, Mapping) else {}
        if raw.get("messages"):
            return [dict(m) for m in raw["messages"]]
        system = self.section.system_prompt
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": task.instruction}]

    def call_server(self, tool: str, arguments: dict) -> Any:
        """Call a server tool for this episode, with the recipe's call arguments added where it
        declares them. Raises McpServerError when the server this episode began on is gone."""
        server = self.server
        server.ensure_started()
        if server.generation != self.generation:
            raise McpServerError(f"the MCP server was restarted during this episode (its state is gone): "
                                 f"`{self.spec.label}`")
        declared = next((t for t in server.tools if t["name"] == tool), None)
        if declared is not None and self.task is not None:
            props = (declared.get("inputSchema") or {}).get("properties") or {}
            for key, value in self.section.call_arguments.items():
                if key in props:
                    arguments[key] = render(value, self.episode_key, self.task)
        return server.call(tool, arguments, self.section.call_timeout_s)

    def step(self, call: ToolCall) -> str:
        tool = self._back.get(call.name, call.name)
        try:
            result = self.call_server(tool, dict(call.arguments))
        except McpCallTimeout:  # named as the agent called it (not the server's name of a renamed tool)
            return f"ERROR: {call.name} timed out after {self.section.call_timeout_s:g}s"
        return observation_text(result, self.section.observation)

    def reward(self, transcript: list[dict]) -> float:
        if self.reward_fn is None:
            raise LopdError("env.mcp: no reward plugin: set the recipe's `reward:` to a function "
                            "score(task, transcript, server)")
        task = self.task.raw if self.task is not None and self.task.raw is not None else self.task
        try:
            if _takes_server(self.reward_fn):
                return self.reward_fn(task, transcript, EpisodeServer(self))
            return self.reward_fn(task, transcript)
        finally:
            self._release()

    def _release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # gives the episode key back, once
            self._finalizer, self._slot = None, None


def _takes_server(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def make_mcp_env_factory(section: Any, base_dir: Path, reward_spec: str | None) -> Callable[[], McpEnv]:
    """A zero-argument constructor of McpEnv; starts the server now, so a start failure is one line
    before any rollout."""
    reward_fn = None
    if reward_spec:
        from lopd_cli.agent.plugins import load_reward_fn

        reward_fn = load_reward_fn(reward_spec, base_dir)
    probe = McpEnv(section, base_dir, reward_fn, reward_spec)
    probe.tools()  # starts the server; checks hide_tools / rename_tools
    check_templates(section, load_task_records(section.tasks, base_dir))  # checks the task file
    if reward_fn is None:  # McpEnv has no reward of its own: every episode would fail at its end
        raise LopdError("env.mcp: no reward plugin: set the recipe's `reward:` to a function "
                        "score(task, transcript, server), e.g. reward.py:score")
    return lambda: McpEnv(section, base_dir, reward_fn, reward_spec)


def check_templates(section: Any, records: list[dict]) -> None:
    """Every task has the data keys that the reset hook's arguments and the call arguments name: a
    missing one is one line before any rollout, not a failed episode of that task in every run."""
    templates = {"env.mcp.call_arguments": section.call_arguments}
    if section.reset is not None:
        templates["env.mcp.reset.arguments"] = section.reset.arguments
    for rec in records:
        task = Task(id=str(rec["id"]), instruction="", tools=[], data=dict(rec.get("data") or {}))
        for key, value in templates.items():
            try:
                render(value, "e0", task)
            except LopdError as e:
                raise LopdError(f"{key}: {str(e).removeprefix('env.mcp: ')}") from None
