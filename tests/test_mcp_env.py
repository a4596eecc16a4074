"""env.mcp: an MCP server as the environment (lopd_cli/envs/mcp.py, lopd_cli/agent/mcp_server.py).

One toy server (tests/mcp_toy_server.py) is shared by the module (a process's servers are keyed
by how they are started, so every section below with the same command, arguments and folder
reaches the same process); only the start-failure tests start others. Tests that kill the server
check that it comes back, so the order of the tests does not matter.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from lopd_cli.agent import mcp_server
from lopd_cli.agent.mcp_server import CallResult, McpServerDied, McpServerError, shared_server
from lopd_cli.agent.types import Task, ToolCall
from lopd_cli.config import recipe_from_dict
from lopd_cli.envs.mcp import (load_task_records, make_mcp_env_factory, observation_text,
                               read_task_records, render)
from lopd_cli.errors import LopdError

TOY = Path(__file__).with_name("mcp_toy_server.py").resolve()
SERVER_TOOLS = ["add", "crash", "reset", "secret", "sleep", "total"]

TASKS = [
    {"id": "t1", "split": "train", "instruction": "Add 3 to the counter. [t1]", "data": {"start": 1, "want": 4}},
    {"id": "t2", "split": "train", "instruction": "Add 3 to the counter. [t2]", "data": {"start": 5, "want": 8}},
    {"id": "t3", "split": "train", "instruction": "Add 3 to the counter. [t3]", "data": {"start": 10, "want": 13}},
    {"id": "t4", "split": "train", "instruction": "Add 3 to the counter. [t4]", "data": {"start": 0, "want": 3}},
    {"id": "v1", "split": "validation", "data": {"start": 2, "want": 2},
     "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read the counter. [v1]"}]},
]

REWARD = '''
def score(task, transcript, server):
    return float(server.call("total")["value"] == task["data"]["want"])
'''


def mcp_section(**over) -> dict:
    sec = {
        "command": "{python}",
        "args": [str(TOY)],
        "tasks": "tasks.jsonl",
        "hide_tools": ["secret"],
        "rename_tools": {"add": "add_to_counter"},
        "call_arguments": {"key": "{episode}"},
        "reset": {"tool": "reset", "arguments": {"key": "{episode}", "start": "{data[start]}"}},
        "call_timeout_s": 2,
    }
    sec.update(over)
    return sec


def recipe_data(**over) -> dict:
    return {"model": {"backbone": "tiny"}, "env": {"mcp": mcp_section(**over)}, "reward": "reward.py:score",
            "rollout": {"tool_timeout_s": 5}}


class World:
    def __init__(self, base: Path):
        self.base = base
        self.recipe = recipe_from_dict(recipe_data(), source=base / "recipe.yaml")
        self.section = self.recipe.env.mcp

    def factory(self, **over):
        """An env factory over a variant of the recipe's env.mcp section (the same server)."""
        section = self.section.model_copy(update=over) if over else self.section
        return make_mcp_env_factory(section, self.base, self.recipe.reward)

    @property
    def server(self):
        return shared_server(mcp_server.spec_from_section(self.section, self.base))

    def task(self, tid: str) -> Task:
        env = self.factory()()
        split = next(r["split"] for r in TASKS if r["id"] == tid)
        return next(t for t in env.tasks(split) if t.id == tid)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("mcp")
    (base / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TASKS))
    (base / "reward.py").write_text(REWARD)
    w = World(base)
    w.factory()  # starts the server once for the module
    yield w
    mcp_server.close_all()


def pid_of(observation: str) -> int:
    return json.loads(observation)["pid"]


def gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def spy_calls(monkeypatch, server) -> list[tuple[str, dict]]:
    """Record every (tool, arguments) the server is called with."""
    seen: list[tuple[str, dict]] = []
    real = server.call

    def call(name, arguments, timeout_s):
        seen.append((name, dict(arguments)))
        return real(name, arguments, timeout_s)

    monkeypatch.setattr(server, "call", call)
    return seen


# ---------------------------------------------------------------------------- 1. tools listed

def test_agent_tools_are_the_servers_less_hidden_and_reset_renamed_without_injected_arguments(world):
    listed = {t["name"]: t for t in world.server.tools}
    assert sorted(listed) == SERVER_TOOLS
    assert "key" in listed["add"]["inputSchema"]["properties"], "the toy's add declares key (injected)"

    tools = world.factory()().tools()
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    assert sorted(by_name) == ["add_to_counter", "crash", "sleep", "total"]  # no secret, no reset, add renamed
    assert all(t["type"] == "function" for t in tools)
    back = {"add_to_counter": "add"}
    for name, fn in by_name.items():
        server_schema = listed[back.get(name, name)]["inputSchema"]
        assert fn["description"] == listed[back.get(name, name)]["description"]
        assert "key" not in fn["parameters"].get("properties", {})
        assert "key" not in fn["parameters"].get("required", [])
        assert set(fn["parameters"]["properties"]) == set(server_schema.get("properties", {})) - {"key"}
    assert by_name["add_to_counter"]["parameters"]["required"] == ["n"]
    assert by_name["add_to_counter"]["parameters"]["properties"]["n"]["type"] == "integer"
    # the server's own listing is untouched (the schemas are copies)
    assert "key" in listed["add"]["inputSchema"]["properties"]
    # the tasks carry the same schemas
    assert world.task("t1").tools == tools


# ---------------------------------------------------------------------------- 2. calls routed

def test_a_step_reaches_the_server_renamed_back_with_the_episode_key(world, monkeypatch):
    env = world.factory()()
    env.reset(world.task("t1"))
    seen = spy_calls(monkeypatch, world.server)
    obs = env.step(ToolCall("add_to_counter", {"n": 3}))
    assert seen == [("add", {"n": 3, "key": env.episode_key})]
    assert json.loads(obs) == {"ok": True, "value": 4, "pid": pid_of(obs)}
    # the state is on the server, under this episode's key
    assert json.loads(world.server.call("total", {"key": env.episode_key}, 2).text)["value"] == 4
    # a tool that does not declare the injected argument does not get it
    seen.clear()
    assert env.step(ToolCall("sleep", {"seconds": 0})) == "woke"
    assert seen == [("sleep", {"seconds": 0})]
    assert env.reward([]) == 1.0


def test_the_observation_key_picks_part_of_the_answer(world):
    env = world.factory(observation="value")()
    env.reset(world.task("t2"))
    assert env.step(ToolCall("add_to_counter", {"n": 3})) == "8"
    assert env.step(ToolCall("total", {})) == "8"
    assert env.step(ToolCall("sleep", {"seconds": 0})) == "woke", "no such key: the whole text"
    # dotted keys, the text read as JSON, errors
    nested = CallResult(text="{}", structured={"a": {"b": [1, 2]}, "c": 1})
    assert observation_text(nested, "a.b") == "[1, 2]"
    assert observation_text(nested, "a.x") == "{}"
    assert observation_text(CallResult(text='{"a": {"b": "hi"}}'), "a.b") == "hi"
    assert observation_text(CallResult(text="boom", is_error=True), None) == "ERROR: boom"


def test_opening_messages_of_a_task_are_its_prompt(world):
    env = world.factory()()
    (task,) = env.tasks("validation")
    assert task.instruction == "Read the counter. [v1]"
    assert env.reset(task) == TASKS[4]["messages"]
    assert json.loads(env.step(ToolCall("total", {})))["value"] == 2


def test_a_server_side_error_is_an_error_observation(world):
    env = world.factory()()
    env.reset(world.task("t1"))
    section = env.section
    env.section = section.model_copy(update={"call_arguments": {"key": "nobody"}})
    obs = env.step(ToolCall("add_to_counter", {"n": 1}))
    env.section = section
    # the toy's SDK hides an unexpected exception's message: "Error executing tool add"
    assert obs.lower().startswith("error") and "add" in obs, obs
    assert json.loads(env.step(ToolCall("total", {})))["value"] == 1, "the episode goes on"


# ---------------------------------------------------------------------------- 3. reset per episode

def test_episodes_get_their_own_key_and_state(world, monkeypatch):
    make = world.factory()
    a, b = make(), make()
    seen = spy_calls(monkeypatch, world.server)
    a.reset(world.task("t1"))
    b.reset(world.task("t2"))
    assert a.episode_key != b.episode_key and a.episode_key.startswith("e") and b.episode_key.startswith("e")
    resets = [args for tool, args in seen if tool == "reset"]
    assert resets == [{"key": a.episode_key, "start": 1}, {"key": b.episode_key, "start": 5}]
    assert all(type(r["start"]) is int for r in resets), "{data[start]} keeps its type"
    a.step(ToolCall("add_to_counter", {"n": 3}))
    assert json.loads(a.step(ToolCall("total", {})))["value"] == 4
    assert json.loads(b.step(ToolCall("total", {})))["value"] == 5
    assert a.reward([]) == 1.0 and b.reward([]) == 0.0


def test_episode_keys_are_reused_after_the_reward(world):
    make = world.factory()
    task = world.task("t4")
    holder = make()
    holder.reset(task)  # one episode stays live all along
    keys = []
    for _ in range(6):
        env = make()
        env.reset(task)
        keys.append(env.episode_key)
        assert env.episode_key != holder.episode_key
        assert json.loads(env.step(ToolCall("total", {})))["value"] == 0, "reset gave the reused key a fresh state"
        env.step(ToolCall("add_to_counter", {"n": 3}))
        assert env.reward([]) == 1.0
    assert len(set(keys)) == 1, keys
    # a reset of the same env object gives its previous key back first
    again = make()
    again.reset(task)
    first = again.episode_key
    again.reset(task)
    assert again.episode_key == first
    again.reward([])
    holder.reward([])


def test_render_fills_episode_task_id_and_typed_data():
    task = Task(id="t9", instruction="", tools=[], data={"n": 7, "obj": {"a": [1]}, "s": "x"})
    out = render({"k": "{episode}", "n": "{data[n]}", "obj": "{data[obj]}", "txt": "{task_id}/{data[n]}/{data[obj]}",
                  "list": ["{data[s]}", 3]}, "e4", task)
    assert out == {"k": "e4", "n": 7, "obj": {"a": [1]}, "txt": 't9/7/{"a": [1]}', "list": ["x", 3]}
    assert type(out["n"]) is int
    with pytest.raises(LopdError, match=r"task t9 has no data\['missing'\]"):
        render("{data[missing]}", "e0", task)


# ---------------------------------------------------------------------------- 4. through the runner

class ScriptedBackend:
    """Answers each episode with fixed turn texts, found by a marker in its prompt."""

    def __init__(self, tok, scripts: dict[str, list[str]]):
        self.tok, self.scripts = tok, scripts

    def generate(self, prompts, params, stop_ids):
        from lopd_cli.agent.chat import encode
        from lopd_cli.rollout.base import Generation

        out = []
        for ids in prompts:
            text = self.tok.decode(ids)
            turns = next(t for m, t in self.scripts.items() if m in text)
            done = text.count("<|im_start|>assistant") - 1
            toks = encode(self.tok, turns[min(done, len(turns) - 1)])[: params.max_new_tokens - 1]
            toks = toks + [stop_ids[0]]
            out.append(Generation(toks, [-0.5] * len(toks), True))
        return out


@pytest.fixture(scope="module")
def tok():
    from lopd_cli.models.backbone import load_tokenizer, resolve_backbone

    return load_tokenizer(resolve_backbone("tiny"))


def test_a_server_dying_mid_run_fails_its_episodes_and_the_run_goes_on(world, tok):
    from lopd_cli.agent.runner import make_env_factory, run_episodes, select_tasks
    from lopd_cli.agent.toolcalls import render_tool_call
    from lopd_cli.config import RolloutSection

    add = render_tool_call("add_to_counter", {"n": 3})
    scripts = {
        "[t1]": [add, render_tool_call("crash", {}), "Done."],  # kills the server on its second turn
        "[t2]": [add, render_tool_call("total", {}), "Done."],  # was live on the old process
        "[t3]": [add, "Done."],
        "[t4]": [add, "Done."],
    }
    factory = make_env_factory(world.recipe)
    tasks = select_tasks(factory, "train", None)
    assert [t.id for t in tasks] == ["t1", "t2", "t3", "t4"]
    old_pid = pid_of(world.server.call("total", {}, 2).text)
    cfg = RolloutSection(batch_size=2, max_turns=4, tool_timeout_s=5)
    t0 = time.monotonic()
    eps = run_episodes(None, tok, factory, tasks, cfg, backend=ScriptedBackend(tok, scripts))
    assert time.monotonic() - t0 < 20

    e1, e2, e3, e4 = eps
    assert e1.error is not None and e1.reward == 0.0 and e1.meta["stop"] == "error"
    assert e1.error.startswith("env.step(crash):") and "stopped answering during crash" in e1.error
    assert "it was restarted" in e1.error and "\n" not in e1.error
    assert e2.error is not None and e2.reward == 0.0
    assert "restarted during this episode" in e2.error and "\n" not in e2.error
    # the first turns ran on the old process
    assert [m["role"] for m in e1.messages] == ["user", "assistant", "tool", "assistant"]
    assert pid_of(e1.messages[2]["content"]) == old_pid
    assert pid_of(e2.messages[2]["content"]) == old_pid
    for e in (e3, e4):
        assert e.error is None, e.error
        assert e.reward == 1.0 and e.meta["stop"] == "answer"
        (obs,) = [m["content"] for m in e.messages if m["role"] == "tool"]
        assert pid_of(obs) != old_pid, "later episodes ran on the restarted server"
    new_pid = pid_of(next(m["content"] for m in e3.messages if m["role"] == "tool"))
    assert gone(old_pid), "the crashed process was reaped"
    assert pid_of(world.server.call("total", {}, 2).text) == new_pid


def test_a_server_killed_by_a_signal_is_restarted_and_later_episodes_succeed(world):
    make = world.factory()
    live_a, live_b = make(), make()
    live_a.reset(world.task("t1"))
    live_b.reset(world.task("t2"))
    pid = pid_of(live_a.step(ToolCall("add_to_counter", {"n": 3})))
    generation = world.server.generation
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(McpServerDied, match="stopped answering during add.*it was restarted") as e:
        live_a.step(ToolCall("add_to_counter", {"n": 3}))
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 10
    assert world.server.generation == generation + 1
    with pytest.raises(McpServerError, match="restarted during this episode"):
        live_b.step(ToolCall("total", {}))
    with pytest.raises(McpServerError, match="restarted during this episode"):
        live_b.reward([])  # the reward plugin's calls fail the same way
    for tid in ("t3", "t4", "t1"):  # the run goes on
        env = make()
        env.reset(world.task(tid))
        obs = env.step(ToolCall("add_to_counter", {"n": 3}))
        assert pid_of(obs) != pid
        assert env.reward([]) == 1.0
    with pytest.raises(McpServerError, match="restarted during this episode"):
        live_a.reward([])


# ---------------------------------------------------------------------------- 5. call timeout

def test_a_slow_call_is_an_error_observation_and_the_next_call_works(world):
    env = world.factory(call_timeout_s=1.0, rename_tools={"add": "add_to_counter", "sleep": "nap"})()
    env.reset(world.task("t1"))
    pid = pid_of(env.step(ToolCall("total", {})))
    # Bounds relative to the 12 s nap, not timings: a loaded CI machine stays far inside them.
    t0 = time.monotonic()
    obs = env.step(ToolCall("nap", {"seconds": 12}))
    took = time.monotonic() - t0
    assert obs == "ERROR: nap timed out after 1s", "the agent sees the name it called"
    assert 0.9 <= took < 8.0, took
    assert json.loads(env.step(ToolCall("add_to_counter", {"n": 3}))) == {"ok": True, "value": 4, "pid": pid}
    assert time.monotonic() - t0 < 11.0, "the next call does not wait for the slow one"
    assert env.reward([]) == 1.0


# ---------------------------------------------------------------------------- 6. start failures

def test_a_server_that_does_not_start_is_one_line_with_its_stderr(world):
    section = world.section.model_copy(update={"args": [str(TOY), "--fail"]})
    with pytest.raises(LopdError) as e:
        make_mcp_env_factory(section, world.base, None)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"`{sys.executable} {TOY} --fail`" in msg and "did not start" in msg
    assert "cannot open the database" in msg


def test_a_missing_command_is_one_line(world):
    section = world.section.model_copy(update={"command": "/nonexistent/lopd-mcp-server"})
    with pytest.raises(LopdError) as e:
        make_mcp_env_factory(section, world.base, None)
    msg = str(e.value)
    assert "\n" not in msg and "/nonexistent/lopd-mcp-server" in msg and "did not start" in msg


# ---------------------------------------------------------------------------- 7. task files

def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_bad_jsonl_line_is_named_file_line(tmp_path):
    good = json.dumps(TASKS[0])
    p = write(tmp_path / "a.jsonl", f"{good}\n\n{{not json\n")
    with pytest.raises(LopdError, match=rf"^{p}:3: not valid JSON"):
        load_task_records(p.name, tmp_path)
    p = write(tmp_path / "b.jsonl", f"{good}\n\n\n" + json.dumps({"id": "x", "instruction": "hi"}) + "\n")
    with pytest.raises(LopdError) as e:
        load_task_records(p.name, tmp_path)
    assert str(e.value) == f"{p}:4: 'split' is None; expected one of train, validation, test"
    p = write(tmp_path / "c.jsonl", f"{good}\n" + json.dumps({**TASKS[1], "id": "t1"}) + "\n")
    with pytest.raises(LopdError, match=rf"^{p}:2: task id 't1' appears twice \(first at {p}:1\)$"):
        load_task_records(p.name, tmp_path)
    p = write(tmp_path / "d.jsonl", json.dumps({"id": "x", "split": "train"}) + "\n")
    with pytest.raises(LopdError, match=rf"^{p}:1: needs 'instruction'"):
        load_task_records(p.name, tmp_path)
    with pytest.raises(LopdError, match="does not exist"):
        load_task_records("nope.jsonl", tmp_path)


def test_a_json_array_names_the_line_of_a_bad_element(tmp_path):
    records = [TASKS[0], TASKS[1], {"id": "t9", "split": "dev", "instruction": "x"}]
    text = json.dumps(records, indent=2)
    starts = [i for i, ln in enumerate(text.splitlines(), 1) if ln == "  {"]
    assert len(starts) == 3
    line = starts[2]
    p = write(tmp_path / "tasks.json", text)
    with pytest.raises(LopdError) as e:
        load_task_records(p.name, tmp_path)
    assert str(e.value) == f"{p}:{line}: 'split' is 'dev'; expected one of train, validation, test"
    # the lines of a good file, in an object with a "tasks" array too
    p = write(tmp_path / "ok.json", '{"name": "x",\n "tasks": [\n' + ",\n".join(json.dumps(r) for r in TASKS[:3]) + "\n]}")
    assert [(w, r["id"]) for w, r in read_task_records(p)] == [(f"{p}:3", "t1"), (f"{p}:4", "t2"), (f"{p}:5", "t3")]
    p = write(tmp_path / "bad.json", "[\n" + json.dumps(TASKS[0]) + ",\n{oops}\n]")
    with pytest.raises(LopdError, match=rf"^{p}:3: not valid JSON"):
        load_task_records(p.name, tmp_path)


def test_tasks_from_a_module_function(tmp_path, monkeypatch):
    (tmp_path / "lopd_mcp_test_tasks.py").write_text(
        f"RECORDS = {TASKS[:2]!r}\n"
        "def make():\n    return RECORDS\n"
        "def broken():\n    return [RECORDS[0], {'id': 'x', 'split': 'train'}]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recs = load_task_records("lopd_mcp_test_tasks:make", tmp_path)
    assert [r["id"] for r in recs] == ["t1", "t2"]
    assert [r["id"] for r in load_task_records("lopd_mcp_test_tasks.py:make", tmp_path)] == ["t1", "t2"]
    with pytest.raises(LopdError, match=r"^env.mcp.tasks 'lopd_mcp_test_tasks:broken'\[1\]: needs 'instruction'"):
        load_task_records("lopd_mcp_test_tasks:broken", tmp_path)


def test_module_tasks_reach_the_environment(world, tmp_path, monkeypatch):
    (tmp_path / "lopd_mcp_env_tasks.py").write_text(f"def make():\n    return {TASKS!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = world.factory(tasks="lopd_mcp_env_tasks:make")()
    assert [t.id for t in env.tasks("train")] == ["t1", "t2", "t3", "t4"]
    assert [t.id for t in env.tasks("validation")] == ["v1"]
    assert env.tasks("test") == []


# ---------------------------------------------------------------------------- 8. config and CLI

def test_env_needs_exactly_one_of_class_and_mcp():
    both = recipe_data()
    both["env"]["class"] = "lopd_cli.envs.orders:OrdersEnv"
    for env in (both["env"], {}):
        with pytest.raises(LopdError) as e:
            recipe_from_dict({**both, "env": env})
        msg = str(e.value)
        assert "\n" not in msg and "env" in msg and "exactly one of env.class" in msg
    with pytest.raises(LopdError, match="exactly one of command"):
        recipe_from_dict(recipe_data(url="http://localhost:1/mcp"))
    recipe_from_dict(recipe_data())  # the good one


def test_call_timeout_must_be_below_the_tool_timeout():
    for call_timeout in (5, 9):
        with pytest.raises(LopdError) as e:
            recipe_from_dict(recipe_data(call_timeout_s=call_timeout))
        assert "\n" not in str(e.value) and "call_timeout_s" in str(e.value) and "tool_timeout_s" in str(e.value)
    assert recipe_from_dict(recipe_data(call_timeout_s=4.5)).env.mcp.call_timeout_s == 4.5


def test_recipe_check_of_an_mcp_recipe(world, lopd):
    good = world.base / "recipe.yaml"
    good.write_text(yaml.safe_dump(recipe_data()))
    r = lopd("recipe", "check", str(good), cwd=world.base)
    assert r.code == 0, r
    assert f"# {good}: ok" in r.out and "add_to_counter" in r.out
    broken = world.base / "broken.yaml"
    broken.write_text(yaml.safe_dump(recipe_data(command="/nonexistent/lopd-mcp-server")))
    r = lopd("recipe", "check", str(broken), cwd=world.base)
    assert r.code == 1, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "/nonexistent/lopd-mcp-server" in lines[0], r
    hidden = world.base / "hidden.yaml"
    hidden.write_text(yaml.safe_dump(recipe_data(hide_tools=["secret", "nope"])))
    r = lopd("recipe", "check", str(hidden), cwd=world.base)
    assert r.code == 1 and r.err.strip().startswith("error: env.mcp: the server has no tool 'nope'"), r


# ---------------------------------------------------------------------------- 9. hide/rename a missing tool

def test_hiding_or_renaming_a_tool_the_server_lacks_is_one_line(world):
    for over in ({"hide_tools": ["secret", "nope"]}, {"rename_tools": {"nope": "x"}}):
        with pytest.raises(LopdError) as e:
            world.factory(**over)
        assert str(e.value) == f"env.mcp: the server has no tool 'nope' (it has {', '.join(SERVER_TOOLS)})"
