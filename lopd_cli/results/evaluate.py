"""Evaluation statistics: confidence intervals, per-model summaries and the comparison table.

- Success rate: Wilson score interval (95 %), which behaves at 0/n and n/n where the normal
  (Wald) interval collapses to a point.
- Mean reward (and the behaviour metrics): Student t-interval, mean ± t_{0.975, n−1} · s/√n.
  t quantiles come from a table for n−1 ≤ 30 and a Cornish–Fisher expansion of the normal
  quantile above (|error| < 1e-4 there), so scipy is not needed. With n = 1 there is no
  interval (low = high = None).

Everything here is a pure function over numbers and `Episode`s except `run_eval`, which rolls
out the student alone (no bank, composer or teacher) on a recipe's environment with the recipe's
`eval` settings (temperature 0 = greedy, so success on HumanEval is pass@1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

Z975 = 1.959963984540054  # standard normal 0.975 quantile

# Student t 0.975 quantiles for 1..30 degrees of freedom.
_T975 = [
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
    2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
    2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
]


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError("degrees of freedom must be >= 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z975
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


@dataclass(frozen=True)
class Interval:
    """An estimate with its 95 % interval over `n` observations (low/high None when n < 2
    for a mean, or n = 0)."""

    estimate: float | None
    low: float | None
    high: float | None
    n: int

    @property
    def half_width(self) -> float | None:
        if self.low is None or self.high is None:
            return None
        return (self.high - self.low) / 2

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.estimate, "low": self.low, "high": self.high, "n": self.n}


def wilson_interval(successes: int, n: int, z: float = Z975) -> Interval:
    """Wilson score interval for a binomial proportion."""
    if n <= 0:
        return Interval(None, None, None, 0)
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return Interval(p, max(0.0, centre - spread), min(1.0, centre + spread), n)


def mean_interval(values: Sequence[float]) -> Interval:
    """Mean with a Student t 95 % interval."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Interval(None, None, None, 0)
    mean = sum(xs) / n
    if n == 1:
        return Interval(mean, None, None, 1)
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    half = t_quantile_975(n - 1) * math.sqrt(var / n)
    return Interval(mean, mean - half, mean + half, n)


# ---------------------------------------------------------------- episodes → figures

SUCCESS_THRESHOLD = 1.0  # an episode succeeds when its reward reaches this (all checks pass)


@dataclass(frozen=True)
class EpisodeFigures:
    """What eval reads from one episode."""

    reward: float
    success: bool
    tool_calls: int
    repeated_calls: int
    invalid_calls: int
    first_turn_tokens: int
    category: str | None = None


@dataclass
class ModelEval:
    """One model's evaluation: overall figures and a breakdown per task category."""

    label: str
    n: int
    reward: Interval
    success: Interval
    behaviour: dict[str, Interval]
    categories: dict[str, "ModelEval"] = field(default_factory=dict)
    errors: int = 0  # episodes where the env or a plugin raised (counted as failures)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "n": self.n,
            "errors": self.errors,
            "reward": self.reward.to_dict(),
            "success": self.success.to_dict(),
            "behaviour": {k: v.to_dict() for k, v in self.behaviour.items()},
            "categories": {k: v.to_dict() for k, v in self.categories.items()},
        }


BEHAVIOUR_METRICS = ("tool_calls", "repeated_calls", "invalid_calls", "first_turn_tokens")


def summarize_figures(label: str, figures: Sequence[EpisodeFigures], errors: int = 0, by_category: bool = True) -> ModelEval:
    n = len(figures)
    result = ModelEval(
        label=label,
        n=n,
        reward=mean_interval([f.reward for f in figures]),
        success=wilson_interval(sum(f.success for f in figures), n),
        behaviour={m: mean_interval([getattr(f, m) for f in figures]) for m in BEHAVIOUR_METRICS},
        errors=errors,
    )
    if by_category:
        cats = sorted({f.category for f in figures if f.category is not None})
        for c in cats:
            result.categories[c] = summarize_figures(c, [f for f in figures if f.category == c], by_category=False)
    return result


def episode_figures(episode, success_threshold: float = SUCCESS_THRESHOLD) -> EpisodeFigures:
    """The figures of one runner `Episode` (behaviour counts come from the runner's meta)."""
    meta = episode.meta
    return EpisodeFigures(
        reward=float(episode.reward),
        success=episode.error is None and episode.reward >= success_threshold - 1e-9,
        tool_calls=int(meta.get("tool_calls", 0)),
        repeated_calls=int(meta.get("repeated_tool_calls", 0)),
        invalid_calls=int(meta.get("invalid_tool_calls", 0)),
        first_turn_tokens=int(meta.get("first_turn_tokens", 0)),
        category=(episode.task.data or {}).get("category"),
    )


def evaluate_episodes(label: str, episodes: Sequence, success_threshold: float = SUCCESS_THRESHOLD) -> ModelEval:
    figures = [episode_figures(e, success_threshold) for e in episodes]
    return summarize_figures(label, figures, errors=sum(e.error is not None for e in episodes))


def spread(items: Sequence, n: int | None) -> list:
    """n items evenly spaced through `items` (all of them when n is None or larger), so a
    split ordered by category (BFCL) keeps every category in a small sample. Deterministic."""
    if n is None or n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def eval_tasks(env_factory, split: str, n: int | None) -> list:
    """n tasks of a split, each once (repeating a task under greedy decoding would only narrow
    the interval without adding information)."""
    from lopd_cli.agent.runner import select_tasks

    return spread(select_tasks(env_factory, split, None), n)


def run_eval(recipe, model, tokenizer, label: str, split: str | None = None, n: int | None = None,
             progress=None, success_threshold: float = SUCCESS_THRESHOLD) -> tuple[ModelEval, list]:
    """Roll out `model` alone on the recipe's environment and summarise: (figures, episodes)."""
    from lopd_cli.agent.runner import load_reward, make_env_factory, run_episodes

    env_factory = make_env_factory(recipe)
    tasks = eval_tasks(env_factory, split or recipe.eval.split, n if n is not None else recipe.eval.n)
    episodes = run_episodes(
        model, tokenizer, env_factory, tasks, recipe.eval_rollout, seed=recipe.train.seed,
        reward_fn=load_reward(recipe), progress=progress, temperature=recipe.eval.temperature,
        meta={"model": label, "split": split or recipe.eval.split},
    )
    return evaluate_episodes(label, episodes, success_threshold), episodes


# ---------------------------------------------------------------- comparison table

def fmt_interval(iv: Interval, percent: bool = False, digits: int = 3) -> str:
    """`0.800 [0.490, 0.943]`, or `80.0 % [49.0, 94.3]` with percent."""
    if iv.estimate is None:
        return "-"
    if percent:
        est = f"{100 * iv.estimate:.1f} %"
        return est if iv.low is None else f"{est} [{100 * iv.low:.1f}, {100 * iv.high:.1f}]"
    est = f"{iv.estimate:.{digits}f}"
    return est if iv.low is None else f"{est} ± {iv.half_width:.{digits}f}"


def comparison_rows(results: Iterable[ModelEval]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison table (one row per model)."""
    header = ["model", "n", "success (95 % CI)", "reward (95 % CI)", "tool calls", "repeated", "invalid", "first turn tok"]
    rows = []
    for r in results:
        b = r.behaviour
        rows.append([
            r.label, str(r.n), fmt_interval(r.success, percent=True), fmt_interval(r.reward),
            fmt_interval(b["tool_calls"], digits=2), fmt_interval(b["repeated_calls"], digits=2),
            fmt_interval(b["invalid_calls"], digits=2), fmt_interval(b["first_turn_tokens"], digits=1),
        ])
    return header, rows


def category_rows(results: Sequence[ModelEval]) -> tuple[list[str], list[list[str]]]:
    """Success per category (rows) for each model (columns); empty when no task has one."""
    cats = sorted({c for r in results for c in r.categories})
    if not cats:
        return [], []
    header = ["category", "n"] + [r.label for r in results]
    rows = []
    for c in cats:
        ns = {r.categories[c].n for r in results if c in r.categories}
        row = [c, "/".join(str(n) for n in sorted(ns))]
        for r in results:
            row.append(fmt_interval(r.categories[c].success, percent=True) if c in r.categories else "-")
        rows.append(row)
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
