"""`code`: write a Python function from a spec; reward = fraction of tests passed.

Splits: `train` and `validation` are generated tasks (see `code_tasks.py`); `test` is
HumanEval (evaluation only). The episode is one assistant turn (no tools): the answer's code
is taken from its ```python block (the one defining the function, else the first or the
longest), or the raw text. Scoring runs the solution and then each test unit, one by one with a
per-unit alarm, in one `sandbox.run_python` process; every unit reports as it finishes, so a
test that hangs or crashes the process still leaves the earlier results.

What it simplifies: the model's code and the test harness share one process, so a hostile
program could fake its own score (it cannot escape the sandbox); tests are asserts, not
property checks.
"""

from __future__ import annotations

import json
import re
import secrets

from lopd_cli.agent.types import Task, ToolCall
from lopd_cli.envs import code_tasks
from lopd_cli.envs.sandbox import SandboxResult, run_python
from lopd_cli.errors import LopdError

SYSTEM_PROMPT = ("You are an expert Python programmer. Answer with the complete function in one "
                 "```python code block, with any imports it needs.")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)

HARNESS = '''\
import json, os, signal, sys

class _UnitTimeout(BaseException):
    pass

def _alarm(signum, frame):
    raise _UnitTimeout()

def _report(text):
    os.write(1, ("\\n" + {marker!r} + text + "\\n").encode())

signal.signal(signal.SIGALRM, _alarm)
with open("units.json") as _f:
    _spec = json.load(_f)
_ns = {{"__name__": "solution"}}
try:
    signal.setitimer(signal.ITIMER_REAL, _spec["load_s"])
    exec(compile(open("solution.py").read(), "solution.py", "exec"), _ns)
    exec(compile(_spec["setup"], "setup", "exec"), _ns)
    signal.setitimer(signal.ITIMER_REAL, 0)
except BaseException as _e:
    signal.setitimer(signal.ITIMER_REAL, 0)
    _report("LOAD " + type(_e).__name__ + ": " + str(_e)[:200].replace("\\n", " "))
    sys.exit(1)
_ns["candidate"] = _ns.get(_spec["entry_point"])
for _i, _unit in enumerate(_spec["units"]):
    try:
        signal.setitimer(signal.ITIMER_REAL, _spec["unit_s"])
        exec(compile(_unit["code"], "test_%d" % _i, "exec"), _ns)
        signal.setitimer(signal.ITIMER_REAL, 0)
        _report("PASS %d" % _i)
    except BaseException as _e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _report("FAIL %d " % _i + type(_e).__name__)
'''


def extract_code(answer: str, entry_point: str | None = None) -> str:
    """The program in a model's answer: a fenced block (preferring one that defines
    `entry_point`, then python-tagged, then the longest), else the whole text."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(answer)]
    if not blocks:
        return answer.strip("\n")
    if entry_point:
        defining = [b for _, b in blocks if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.M)]
        if defining:
            return defining[0]
    tagged = [b for lang, b in blocks if lang in ("python", "py", "python3")]
    return max(tagged or [b for _, b in blocks], key=len)


def build_program(task: Task, code: str) -> str:
    """The solution file: the task's prefix (imports, helpers, the stub) and the model's code.
    Code that does not define the function is taken as the stub's body (HumanEval style)."""
    prefix = task.data.get("prefix", "")
    entry = task.data["entry_point"]
    if not prefix or re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
        return prefix + ("\n\n" if prefix else "") + code + "\n"
    return prefix + code + "\n"


def count_passed(stdout: str, marker: str) -> tuple[set[int], str | None]:
    passed, load_error = set(), None
    for line in stdout.splitlines():
        if not line.startswith(marker):
            continue
        rest = line[len(marker):]
        if rest.startswith("PASS "):
            passed.add(int(rest.split()[1]))
        elif rest.startswith("LOAD "):
            load_error = rest[5:]
    return passed, load_error


def score_program(task: Task, program: str, unit_timeout_s: float = 3.0, total_timeout_s: float = 20.0,
                  memory_mb: int = 512) -> tuple[float, dict]:
    """Fraction of the task's test units that pass, and details (passed, total, reason)."""
    units = task.data["units"]
    tests = [i for i, u in enumerate(units) if u["test"]]
    if not tests:
        raise LopdError(f"code task {task.id} has no tests")
    marker = "@@lopd-" + secrets.token_hex(8) + "@@ "
    spec = {"entry_point": task.data["entry_point"], "setup": task.data.get("setup", ""), "units": units,
            "unit_s": unit_timeout_s, "load_s": unit_timeout_s}
    res: SandboxResult = run_python(
        HARNESS.format(marker=marker), timeout_s=total_timeout_s, memory_mb=memory_mb, max_procs=16,
        files={"solution.py": program, "units.json": json.dumps(spec)},
    )
    passed, load_error = count_passed(res.stdout, marker)
    n_pass = len(passed & set(tests))
    reason = load_error or ("" if res.ok else res.reason)
    return n_pass / len(tests), {"passed": n_pass, "total": len(tests), "reason": reason}


def final_answer(transcript: list[dict]) -> str:
    for msg in reversed(transcript):
        if msg.get("role") == "assistant":
            return msg.get("content") or ""
    return ""


class CodeEnv:
    """The code world as an Environment (one instance per live episode)."""

    name = "code"

    def __init__(self, n_train: int = 512, n_validation: int = 64, n_test: int | None = None,
                 unit_timeout_s: float = 3.0, total_timeout_s: float = 20.0, memory_mb: int = 512,
                 system_prompt: str = SYSTEM_PROMPT):
        self.sizes = {"train": n_train, "validation": n_validation}
        self.n_test = n_test
        self.unit_timeout_s, self.total_timeout_s, self.memory_mb = unit_timeout_s, total_timeout_s, memory_mb
        self.system_prompt = system_prompt
        self.task: Task | None = None
        self.last_score: dict = {}

    def tasks(self, split: str) -> list[Task]:
        if split == "test":
            tasks = code_tasks.humaneval_tasks()
            return tasks[: self.n_test] if self.n_test else tasks
        if split not in self.sizes:
            raise LopdError(f"code: unknown split '{split}' (train, validation or test)")
        return code_tasks.generate_tasks(split, self.sizes[split])

    def reset(self, task: Task) -> list[dict]:
        self.task = task
        self.last_score = {}
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task.instruction}]

    def step(self, call: ToolCall) -> str:
        return json.dumps({"error": f"this world has no tools ('{call.name}' called); answer with the code"})

    def done(self) -> bool:
        return False

    def score_code(self, code: str) -> float:
        assert self.task is not None, "reset() first"
        program = build_program(self.task, code)
        reward, self.last_score = score_program(self.task, program, self.unit_timeout_s, self.total_timeout_s,
                                                self.memory_mb)
        return reward

    def reward(self, transcript: list[dict]) -> float:
        assert self.task is not None, "reset() first"
        return self.score_code(extract_code(final_answer(transcript), self.task.data["entry_point"]))
