"""`bfcl`: the Berkeley Function-Calling Leaderboard (package `bfcl-eval`), scored by its own code.

Single-turn categories (simple_python, multiple, parallel, parallel_multiple, irrelevance,
live_*): the model answers the question with tool call(s), or with text when no function fits
(irrelevance). The first assistant turn's calls are converted to BFCL's `[{name: {arg: value}}]`
form and checked with the official AST checker; irrelevance passes when that turn holds no
call. `done()` is true after the first turn's calls.

Multi-turn categories (multi_turn_base, _miss_param, _long_context, _miss_func): a stateful
world of BFCL's Python classes. `step()` runs a call with the official executor (state lives in
a module global keyed by model name + entry id, so every episode uses a unique model name);
when the model ends a turn without calls, `next_user_message()` gives the entry's next user
turn (None after the last). The reward re-executes the transcript's calls with the official
`multi_turn_checker` (state and responses checked after every turn): 1.0 or 0.0, or with
`partial_credit=True` the fraction of leading turns that pass.

Splits are deterministic by entry id: sha256(id) picks train / validation / test
(`split_fractions`, default 0.7 / 0.1 / 0.2) within each category.

Tools are the entries' function docs converted to OpenAI JSON schemas with BFCL's own
`convert_to_tool` ("dict" -> object, "float" -> number, "." in names -> "_"; the checker maps
names back).

What it simplifies: the model speaks Hermes `<tool_call>` JSON instead of BFCL's Python-list
prompting format; in miss_func entries the held-out functions arrive as text in the user turn
(the episode's tool list is fixed at reset, so the runner's schema check rejects calls to them).
Needs the optional extra: `pip install --no-deps bfcl-eval` plus its checker dependencies.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
import uuid
from functools import lru_cache
from typing import Any

from lopd_cli.agent.toolcalls import parse_tool_calls, to_openai_tool_calls
from lopd_cli.agent.types import Task, ToolCall
from lopd_cli.envs import _bfcl_shim
from lopd_cli.errors import LopdError

SINGLE_TURN = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance",
               "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple", "live_irrelevance")
MULTI_TURN = ("multi_turn_base", "multi_turn_miss_param", "multi_turn_long_context", "multi_turn_miss_func")
DEFAULT_CATEGORIES = SINGLE_TURN
SPLITS = ("train", "validation", "test")

SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. "
    "Based on the question, make one or more function/tool calls to achieve the purpose. If none of the "
    "functions can be used, point it out and do not call any. If the question lacks the parameters "
    "required by the function, also point it out."
)
MULTI_TURN_SUFFIX = (
    " At each turn, try your best to complete the tasks requested by the user within the current turn. "
    "Continue to call functions until you have fulfilled the request; once you have no more functions to "
    "call, answer briefly and the user will continue."
)


def _bfcl():
    """bfcl_eval's pieces, imported behind the model_config stand-in."""
    try:
        _bfcl_shim.install()
        from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING
        from bfcl_eval.constants.enums import Language, ModelStyle
        from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
        from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
        from bfcl_eval.model_handler.utils import convert_to_tool
        from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry
    except ModuleNotFoundError as e:
        raise LopdError(
            f"bfcl: the bfcl-eval package is not installed ({e.name} missing); install the extra with "
            "`pip install --no-deps bfcl-eval && pip install tenacity filelock overrides python-dotenv "
            "tree_sitter==0.21.3 tree-sitter-java==0.21.0 tree-sitter-javascript==0.21.4`"
        ) from None
    return {
        "additional_function_prompt": DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
        "Language": Language, "ModelStyle": ModelStyle, "GORILLA_TO_OPENAPI": GORILLA_TO_OPENAPI,
        "ast_checker": ast_checker, "multi_turn_utils": multi_turn_utils,
        "multi_turn_checker": multi_turn_checker, "convert_to_tool": convert_to_tool,
        "load_dataset_entry": load_dataset_entry, "load_ground_truth_entry": load_ground_truth_entry,
    }


def split_of(entry_id: str, fractions: tuple[float, float, float]) -> str:
    """Deterministic split of an entry by the hash of its id."""
    x = int(hashlib.sha256(entry_id.encode()).hexdigest()[:8], 16) / 0x1_0000_0000
    if x < fractions[0]:
        return "train"
    return "validation" if x < fractions[0] + fractions[1] else "test"


def to_openai_tools(functions: list[dict]) -> list[dict]:
    b = _bfcl()
    return b["convert_to_tool"](functions, b["GORILLA_TO_OPENAPI"], b["ModelStyle"].OPENAI_COMPLETIONS)


@lru_cache(maxsize=None)
def _category_entries(category: str) -> tuple[tuple[dict, Any], ...]:
    """(entry, ground truth or None) per entry of a category, in the data file's order."""
    b = _bfcl()
    entries = b["load_dataset_entry"](category)
    truths: dict[str, Any] = {}
    if "irrelevance" not in category:
        for row in b["load_ground_truth_entry"](category):
            truths[row["id"]] = row["ground_truth"]
    return tuple((e, truths.get(e["id"])) for e in entries)


def _task_from_entry(entry: dict, truth: Any, category: str, split: str) -> Task:
    first_turn = entry["question"][0]
    instruction = "\n\n".join(m["content"] for m in first_turn if m["role"] == "user")
    data = {"category": category, "entry_id": entry["id"], "functions": entry["function"],
            "ground_truth": truth, "multi_turn": category in MULTI_TURN, "first_turn": first_turn}
    if category in MULTI_TURN:
        data.update(turns=entry["question"], initial_config=entry["initial_config"],
                    involved_classes=entry["involved_classes"],
                    missed_function=entry.get("missed_function", {}))
    return Task(id=f"bfcl-{entry['id']}", instruction=instruction, tools=to_openai_tools(entry["function"]),
                data=data, split=split)


def call_string(name: str, arguments: dict[str, Any]) -> str:
    """BFCL's executable form of a call: name(k=repr(v), ...)."""
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


def parse_call_string(text: str, functions: list[dict]) -> tuple[str, dict[str, Any]]:
    """'sort("a.pdf")' -> ('sort', {'file_name': 'a.pdf'}): positional arguments take the
    function doc's parameter order (used to replay BFCL ground truth as tool calls)."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call):
        raise ValueError(f"not a call: {text!r}")
    name = ast.unparse(node.func)
    doc = next((f for f in functions if f["name"] == name), None)
    order = list((doc or {}).get("parameters", {}).get("properties", {}))
    args = {order[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
    return name, args


def _message_calls(msg: dict) -> list[tuple[str, dict]]:
    """Well-formed (name, arguments) calls of an assistant message (OpenAI tool_calls, or
    <tool_call> blocks left in its text)."""
    out = []
    if msg.get("tool_calls"):
        for tc in msg["tool_calls"]:
            f = tc.get("function", tc)
            args = f.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    continue
            if f.get("name") and isinstance(args, dict):
                out.append((f["name"], args))
        return out
    _, calls = parse_tool_calls(msg.get("content") or "")
    return [(c.name, c.arguments) for c in calls if c.name and c.error is None]


def _safe_call(name: str, args: dict, allowed: set[str]) -> bool:
    """Only calls of the entry's own functions with identifier keys reach BFCL's eval()."""
    return name in allowed and all(isinstance(k, str) and k.isidentifier() for k in args)


class BfclEnv:
    """BFCL as an Environment (one instance per live episode)."""

    name = "bfcl"

    def __init__(self, categories: list[str] | str | None = None, n_per_category: int | None = None,
                 split_fractions: tuple[float, float, float] | list[float] = (0.7, 0.1, 0.2),
                 partial_credit: bool = False, system_prompt: str = SYSTEM_PROMPT):
        cats = [categories] if isinstance(categories, str) else list(categories or DEFAULT_CATEGORIES)
        unknown = [c for c in cats if c not in SINGLE_TURN + MULTI_TURN]
        if unknown:
            raise LopdError(f"bfcl: unknown category {unknown[0]!r} (choose from {', '.join(SINGLE_TURN + MULTI_TURN)})")
        fr = tuple(float(x) for x in split_fractions)
        if len(fr) != 3 or any(x < 0 for x in fr) or abs(sum(fr) - 1.0) > 1e-6:
            raise LopdError(f"bfcl: split_fractions must be three non-negative numbers summing to 1, got {list(fr)}")
        self.categories, self.n_per_category, self.fractions = cats, n_per_category, fr
        self.partial_credit, self.system_prompt = partial_credit, system_prompt
        self.task: Task | None = None
        self.turn = 0
        self.finished = False
        self.model_name = ""
        self.prompt_len = 0  # messages reset() returned; the episode's own turns come after
        self.last_result: dict = {}

    # ------------------------------------------------------------ tasks
    def tasks(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise LopdError(f"bfcl: unknown split '{split}' (train, validation or test)")
        out = []
        for cat in self.categories:
            chosen = [(e, t) for e, t in _category_entries(cat) if split_of(e["id"], self.fractions) == split]
            if self.n_per_category is not None:
                chosen = chosen[: self.n_per_category]
            out += [_task_from_entry(copy.deepcopy(e), copy.deepcopy(t), cat, split) for e, t in chosen]
        return out

    # ------------------------------------------------------------ episode
    def reset(self, task: Task) -> list[dict]:
        self.task, self.turn, self.finished, self.last_result = task, 0, False, {}
        self.model_name = "lopd_" + uuid.uuid4().hex[:12]
        system = self.system_prompt + (MULTI_TURN_SUFFIX if task.data["multi_turn"] else "")
        messages = [dict(m) for m in task.data["first_turn"]]
        self.prompt_len = len(messages) + (0 if messages and messages[0]["role"] == "system" else 1)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": system + "\n\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": system})
        return messages

    def step(self, call: ToolCall) -> str:
        assert self.task is not None, "reset() first"
        if not self.task.data["multi_turn"]:
            self.finished = True  # single turn: the calls are scored, not executed
            return json.dumps({"status": "recorded"})
        allowed = {f["name"] for f in self._functions_so_far()}
        if not _safe_call(call.name, call.arguments, allowed):
            return json.dumps({"error": f"unknown function '{call.name}'"})
        b = _bfcl()
        results, _ = b["multi_turn_utils"].execute_multi_turn_func_call(
            func_call_list=[call_string(call.name, call.arguments)],
            initial_config=self.task.data["initial_config"],
            involved_classes=self.task.data["involved_classes"],
            model_name=self.model_name, test_entry_id=self.task.data["entry_id"],
            long_context="long_context" in self.task.data["category"],
        )
        return results[0]

    def done(self) -> bool:
        return self.finished

    def next_user_message(self) -> dict | None:
        """The next user turn of a multi-turn entry (None when there is none): the runner
        calls it when the model ends a turn without tool calls."""
        assert self.task is not None, "reset() first"
        if not self.task.data["multi_turn"] or self.turn + 1 >= len(self.task.data["turns"]):
            return None
        self.turn += 1
        held = self.task.data.get("missed_function", {}).get(str(self.turn))
        if held:
            text = _bfcl()["additional_function_prompt"].format(functions=json.dumps(to_openai_tools(held)))
            return {"role": "user", "content": text}
        return {"role": "user", "content": "\n\n".join(m["content"] for m in self.task.data["turns"][self.turn])}

    def _functions_so_far(self) -> list[dict]:
        assert self.task is not None
        funcs = list(self.task.data["functions"])
        for turn, held in self.task.data.get("missed_function", {}).items():
            if int(turn) <= self.turn:
                funcs += held
        return funcs

    # ------------------------------------------------------------ reward
    def reward(self, transcript: list[dict]) -> float:
        assert self.task is not None, "reset() first"
        try:
            if self.task.data["multi_turn"]:
                return self._multi_turn_reward(transcript)
            return self._single_turn_reward(transcript)
        finally:
            self._forget_state()

    def _single_turn_reward(self, transcript: list[dict]) -> float:
        task = self.task
        first = next((m for m in transcript[self.prompt_len:] if m.get("role") == "assistant"), None)
        calls = _message_calls(first) if first else []
        if "irrelevance" in task.data["category"]:
            self.last_result = {"valid": not calls, "calls": len(calls)}
            return float(not calls)
        if not calls:
            self.last_result = {"valid": False, "error": "no function call"}
            return 0.0
        b = _bfcl()
        result = b["ast_checker"](task.data["functions"], [{n: a} for n, a in calls], task.data["ground_truth"],
                                  b["Language"].PYTHON, task.data["category"], self.model_name)
        self.last_result = result
        return 1.0 if result["valid"] else 0.0

    def decode_turns(self, transcript: list[dict]) -> list[list[list[str]]]:
        """The transcript's calls as BFCL's decoded result: turns -> steps -> call strings.
        Each user message after the prompt starts the next turn."""
        assert self.task is not None
        allowed = {f["name"] for f in self.task.data["functions"]}
        for held in self.task.data.get("missed_function", {}).values():
            allowed |= {f["name"] for f in held}
        turns: list[list[list[str]]] = [[]]
        for msg in transcript[self.prompt_len:]:
            if msg.get("role") == "user":
                turns.append([])
            elif msg.get("role") == "assistant":
                step = [call_string(n, a) for n, a in _message_calls(msg) if _safe_call(n, a, allowed)]
                if step:
                    turns[-1].append(step)
        return turns

    def _check(self, decoded: list[list[list[str]]], truth: list[list[str]], tag: str) -> dict:
        b = _bfcl()
        entry = {"id": self.task.data["entry_id"], "initial_config": self.task.data["initial_config"],
                 "involved_classes": self.task.data["involved_classes"]}
        return b["multi_turn_checker"](decoded, truth, entry, self.task.data["category"], f"{self.model_name}_{tag}")

    def _multi_turn_reward(self, transcript: list[dict]) -> float:
        truth = self.task.data["ground_truth"]
        decoded = self.decode_turns(transcript)
        if len(decoded) == len(truth):
            result = self._check(decoded, truth, "all")
            if result["valid"] or not self.partial_credit:
                self.last_result = {"valid": result["valid"], "error": result.get("error_message"), "turns_passed":
                                    len(truth) if result["valid"] else None}
                return 1.0 if result["valid"] else 0.0
        elif not self.partial_credit:
            self.last_result = {"valid": False, "error": f"{len(decoded)} of {len(truth)} turns reached"}
            return 0.0
        passed = 0
        for k in range(1, min(len(decoded), len(truth)) + 1):
            if not self._check(decoded[:k], truth[:k], f"k{k}")["valid"]:
                break
            passed = k
        self.last_result = {"valid": passed == len(truth), "turns_passed": passed}
        return passed / len(truth)

    def _forget_state(self) -> None:
        """Drop this episode's instances from the executor's module global."""
        if not self.model_name or "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils" not in __import__("sys").modules:
            return
        g = vars(_bfcl()["multi_turn_utils"])
        prefix = re.sub(r"[-./:]", "_", self.model_name)
        for key in [k for k in g if k.startswith(prefix)]:
            del g[key]


def _pick(options: Any) -> Any:
    """One acceptable value from a BFCL possible-answer option list ("" marks optional)."""
    if not isinstance(options, list):
        return _resolve(options)
    for opt in options:
        if opt != "":
            return _resolve(opt)
    return _OMIT


def _resolve(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: v for k, v in ((k, _pick(o)) for k, o in value.items()) if v is not _OMIT}
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    return value


_OMIT = object()


def ground_truth_calls(task: Task) -> list[list[tuple[str, dict[str, Any]]]]:
    """The reference answer as tool calls, one list per turn (single-turn tasks: one turn;
    irrelevance: one empty turn). Names use the tools' "_" spelling."""
    truth = task.data["ground_truth"]
    if task.data["multi_turn"]:
        funcs = list(task.data["functions"])
        for held in task.data.get("missed_function", {}).values():
            funcs += held
        return [[parse_call_string(s, funcs) for s in turn] for turn in truth]
    if truth is None:
        return [[]]
    calls = []
    for item in truth:
        (name, params), = item.items()
        args = {k: v for k, v in ((k, _pick(o)) for k, o in params.items()) if v is not _OMIT}
        calls.append((name.replace(".", "_"), args))
    return [calls]


IRRELEVANCE_ANSWER = "None of the given functions can do this, so I will not call any."


def ground_truth_records(tasks: list[Task], env: "BfclEnv | None" = None) -> list[dict]:
    """Single-turn tasks answered with their reference calls, scored by the official checker, as
    rollout records (the JSONL `lopd bank add-rollouts` reads). They seed a bank when the agent
    itself never succeeds yet (a small model that scores 0 %): the teacher then reads how the
    references were solved. Multi-turn tasks are left out (their answers depend on state)."""
    env = env or BfclEnv()
    records = []
    for task in tasks:
        if task.data["multi_turn"]:
            continue
        messages = env.reset(task)
        calls = [ToolCall(name, args, f"call_{i}") for i, (name, args) in enumerate(ground_truth_calls(task)[0])]
        if calls:  # what the runner records: the calls, then each one's result
            messages.append({"role": "assistant", "content": "", "tool_calls": to_openai_tool_calls(calls)})
            messages += [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": env.step(c)} for c in calls]
        else:
            messages.append({"role": "assistant", "content": IRRELEVANCE_ANSWER})
        records.append({"task_id": task.id, "instruction": task.instruction, "messages": messages,
                        "reward": env.reward(messages), "tools": task.tools,
                        "meta": {"env": "bfcl", "agent": "ground_truth", "category": task.data["category"]}})
    return records
