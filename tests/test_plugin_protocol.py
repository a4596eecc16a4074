"""The environment protocol taken structurally: dict tasks work end to end, and a plugin that
returns the wrong thing gets one line naming the plugin, the method, the value and what is expected."""

import json
import sys
from pathlib import Path

import pytest

from lopd_cli.agent.env import coerce_tasks
from lopd_cli.agent.plugins import load_env_class
from lopd_cli.agent.types import Task, ToolCall
from lopd_cli.errors import LopdError

REPO = Path(__file__).resolve().parents[1]
UNITS = REPO / "examples" / "unit_desk" / "recipe.yaml"


@pytest.fixture
def project(lopd, tmp_path):
    assert lopd("init", "p", "--no-base-policy", cwd=tmp_path).code == 0
    return tmp_path / "p"


def test_a_dict_task_env_rolls_out_in_a_fresh_project(lopd, project):
    r = lopd("rollout", "--recipe", str(UNITS), "-n", "3", "--out", "units.jsonl", "--json",
             "--set", "rollout.max_new_tokens=12", cwd=project)
    assert r.code == 0, r
    summary = json.loads(r.out)
    assert summary["episodes"] == 3 and summary["errors"] == 0, summary
    recs = [json.loads(x) for x in (project / "units.jsonl").read_text().splitlines()]
    assert [x["task_id"] for x in recs] == ["units-train-000", "units-train-001", "units-train-002"]
    assert recs[0]["instruction"] == "How many mi is 5 km?"
    assert recs[0]["tools"][0]["function"]["name"] == "convert"
    assert recs[0]["messages"][1] == {"role": "user", "content": "How many mi is 5 km?"}
    assert recs[0]["meta"]["env"] == "unit-desk"
    assert lopd("bank", "add-rollouts", "units.jsonl", "--min-reward", "0", cwd=project).code == 0


def test_the_plugin_gets_its_own_dict_back_and_step_a_toolcall(tmp_path):
    (tmp_path / "seen.py").write_text(
        "SEEN = []\n"
        "class Env:\n"
        "    def tasks(self, split):\n"
        "        return [{'id': 7, 'instruction': 'hi', 'tools': [{'name': 'f', 'parameters': {}}], 'data': {'k': 1}}]\n"
        "    def reset(self, task):\n"
        "        SEEN.append(task)\n"
        "        return [{'role': 'user', 'content': task['instruction']}]\n"
        "    def step(self, call):\n"
        "        SEEN.append(call)\n"
        "        return 'ok'\n"
        "    def reward(self, transcript):\n"
        "        return 1.0\n")
    cls = load_env_class("seen.py:Env", tmp_path)
    env = cls()
    [task] = env.tasks("test")
    assert isinstance(task, Task) and task.id == "7" and task.split == "test" and task.data == {"k": 1}
    # a bare function schema gets the OpenAI wrapper
    assert task.tools == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert env.reset(task) == [{"role": "user", "content": "hi"}]
    # This test's own seen.py module (the one whose SEEN the plugin's methods append to), not the
    # first module in sys.modules that has a SEEN: another test's plugin may have one too.
    plugin = cls.__mro__[1]
    module = sys.modules[plugin.__module__]
    assert Path(module.__file__) == (tmp_path / "seen.py").resolve() and plugin.reset.__globals__ is vars(module)
    seen = module.SEEN
    assert seen[-1] == {"id": 7, "instruction": "hi", "tools": [{"name": "f", "parameters": {}}], "data": {"k": 1}}
    call = ToolCall(name="f", arguments={})
    assert env.step(call) == "ok" and seen[-1] is call and len(seen) == 2
    assert isinstance(env, plugin) and cls.__name__ == "Env"


BAD_RETURNS = {
    "tasks_str": ("def tasks(self, split):\n        return 'not tasks'\n",
                  ["tasks('train') returned str 'not tasks'", "expected a list of Task or of mappings"]),
    "task_int": ("def tasks(self, split):\n        return [3]\n",
                 ["tasks('train')[0] is int 3", "expected a Task or a mapping with keys id, instruction, tools, data"]),
    "task_no_instruction": ("def tasks(self, split):\n        return [{'id': 'a', 'prompt': 'x'}]\n",
                            ["tasks('train')[0] has no 'instruction'", "keys: ['id', 'prompt']"]),
}


@pytest.mark.parametrize("case", sorted(BAD_RETURNS))
def test_a_wrong_tasks_return_is_one_line_through_the_cli(lopd, project, tmp_path, case):
    method, needles = BAD_RETURNS[case]
    (tmp_path / "bad_env.py").write_text(
        "class BadEnv:\n    " + method +
        "    def reset(self, task):\n        return []\n"
        "    def step(self, call):\n        return ''\n"
        "    def reward(self, transcript):\n        return 0.0\n")
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model: {backbone: tiny}\nenv: {class: bad_env.py:BadEnv}\n")
    r = lopd("rollout", "--recipe", str(recipe), "-n", "1", cwd=project)
    assert r.code == 1, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: env.class 'bad_env.py:BadEnv' "), r.err
    for needle in needles:
        assert needle in lines[0], r.err


def test_a_wrong_reset_or_step_return_fails_the_episode_with_a_named_line(lopd, project, tmp_path):
    (tmp_path / "half.py").write_text(
        "class HalfEnv:\n"
        "    def tasks(self, split):\n"
        "        return [{'id': 'a', 'instruction': 'x', 'tools': [], 'data': {}}]\n"
        "    def reset(self, task):\n        return 'hello'\n"
        "    def step(self, call):\n        return ''\n"
        "    def reward(self, transcript):\n        return 0.0\n")
    recipe = tmp_path / "half.yaml"
    recipe.write_text("model: {backbone: tiny}\nenv: {class: half.py:HalfEnv}\n")
    r = lopd("rollout", "--recipe", str(recipe), "-n", "2", cwd=project)
    assert r.code == 1, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert "env.class 'half.py:HalfEnv' reset() returned str 'hello'" in lines[0]
    assert "expected a list of chat messages" in lines[0]


def test_coerce_tasks_keeps_task_objects_as_they_are():
    t = Task(id="x", instruction="y", tools=[])
    assert coerce_tasks([t], "train", "env E")[0] is t
    with pytest.raises(LopdError, match=r"env E tasks\('train'\)\[0\]\['tools'\] is str"):
        coerce_tasks([{"id": "x", "instruction": "y", "tools": "convert"}], "train", "env E")
