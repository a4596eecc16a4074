"""Will LOPD help here? The check `lopd coldstart` ends with, before any training is paid for.

Self-distillation can only help where the teacher knows something the student does not: a
teacher that reads past successes must be a better model of a *new* task's success than the
student alone. So, on held-out successes (validation tasks; tasks neither the cold start nor
the base model trained on), the frozen teacher's NLL per action token is measured with

    none      no reference block: the student's own view (the same backbone, no adapters)
    learned   the latents c_φ of the task's own retrieved references
    other     the latents of another task's references (none in common with its own, and
              where the world names its rules, of a task under other rules: another store's):
              the right form without this task's information
    text      the same references as plain text in the same frame (what OPSD's teacher reads)

plus the latents' task spread (mean ‖c − c̄‖ / mean ‖c‖; ~0: a fixed soft prompt). Two lines
answer the questions: does a teacher beat the student (learned or text < none), and do the
latents carry the task's references (learned < other)? Each gap is a paired mean over the
held-out examples with a 95 % interval. Where the environment can name the tokens that carry
its reusable rules (`env.rule_strings(instruction)`, e.g. the orders world's house rules), the
NLL is also split into rule tokens and the others.

What it simplifies: the interval is a normal approximation over examples (not tokens, which
are correlated within a transcript), and a verdict needs the whole interval on one side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from lopd_cli.train.token_marks import token_pieces, tokens_overlapping

MODES = ("none", "learned", "other", "text")
LABELS = {"none": "no block (the student's view)", "learned": "learned latents, own references",
          "other": "learned latents, another task's references", "text": "references as text"}


@dataclass
class Gap:
    """A paired difference a − b of per-example mean NLLs: mean and 95 % interval."""

    mean: float
    lo: float
    hi: float
    n: int

    @property
    def above_zero(self) -> bool:
        return self.lo > 0

    def to_dict(self) -> dict:
        return {"mean": self.mean, "ci95": [self.lo, self.hi], "n": self.n}


def paired_gap(a: Sequence[float], b: Sequence[float]) -> Gap:
    d = [x - y for x, y in zip(a, b) if not (math.isnan(x) or math.isnan(y))]
    n = len(d)
    if n == 0:
        return Gap(float("nan"), float("nan"), float("nan"), 0)
    m = sum(d) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1)) if n > 1 else float("inf")
    half = 1.96 * sd / math.sqrt(n)
    return Gap(m, m - half, m + half, n)


def other_task_partners(ref_ids: Sequence[set], groups: Sequence | None = None) -> list[int]:
    """For each example, another example whose references share none with its own and, when
    `groups` are given (the rules an example's world applies, e.g. its store's), of another
    group: searched from half-way round the list, so neighbours, often of one kind, are not
    preferred. Without such an example: any with disjoint references; at worst itself."""
    n = len(ref_ids)
    out = []
    for i in range(n):
        candidates = [(i + k) % n for k in range(n // 2, n // 2 + n)]
        disjoint = [j for j in candidates if j != i and not (ref_ids[i] & ref_ids[j])]
        other_group = [j for j in disjoint if groups is not None and groups[j] != groups[i]]
        out.append((other_group or disjoint or [i])[0])
    return out


def rule_token_mask(tokenizer, input_ids: Sequence[int], action_mask: Sequence[int],
                    rule_strings: Sequence[str]) -> list[bool]:
    """For each action token (in order), whether its text overlaps an occurrence of one of
    `rule_strings` inside the transcript."""
    pieces = token_pieces(tokenizer, input_ids)
    text = "".join(pieces)
    hit = [False] * len(text)
    for s in rule_strings:
        if not s:
            continue
        at = text.find(s)
        while at >= 0:
            for c in range(at, at + len(s)):
                hit[c] = True
            at = text.find(s, at + 1)
    return [h for h, m in zip(tokens_overlapping(pieces, hit), action_mask) if m]


@dataclass
class CheckResult:
    """Per mode: pooled NLL per action token (all / rule / other tokens); gaps; verdict lines."""

    n_examples: int
    nll: dict[str, dict[str, float | None]]
    gaps: dict[str, Gap]
    task_spread: float
    verdicts: list[str]

    def to_dict(self) -> dict:
        return {"n_examples": self.n_examples, "nll": self.nll, "task_spread": self.task_spread,
                "gaps": {k: g.to_dict() for k, g in self.gaps.items()}, "verdicts": self.verdicts}


def _pooled(per_example: list, masks: list[list[bool]] | None, want: bool | None) -> float | None:
    total, count = 0.0, 0
    for i, lp in enumerate(per_example):
        for j, v in enumerate(lp):
            if want is None or masks[i][j] == want:
                total -= v
                count += 1
    return total / count if count else None


def _per_example_mean(per_example: list, masks: list[list[bool]] | None, want: bool | None) -> list[float]:
    out = []
    for i, lp in enumerate(per_example):
        vals = [-v for j, v in enumerate(lp) if want is None or masks[i][j] == want]
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return out


def run_check(model, tokenizer, composer, examples: Sequence, batch_size: int = 8,
              obs_char_budget: int = 600, text_max_chars: int = 1536,
              rule_strings: Callable[[str], list[str]] | None = None,
              progress: Callable[[int], None] | None = None) -> CheckResult:
    """The check on `examples` (coldstart.Example: a held-out success and its references).
    `progress(1)` is called after each teacher mode and after the spread (len(MODES) + 1 calls)."""
    from lopd_cli.train.teacher_nll import latent_task_spread, teacher_example_logprobs

    tick = progress or (lambda k=1: None)
    groups = [tuple(rule_strings(ex.episode.task.instruction)) for ex in examples] if rule_strings else None
    partners = other_task_partners([{getattr(r, "id", None) for r in ex.refs} for ex in examples], groups)
    per_mode = {}
    for m in MODES:
        per_mode[m] = [lp.tolist() for lp in teacher_example_logprobs(
            model, tokenizer, composer, examples, m, batch_size,
            obs_char_budget=obs_char_budget, text_max_chars=text_max_chars, partners=partners)]
        tick(1)
    masks = None
    if rule_strings is not None:
        masks = [rule_token_mask(tokenizer, ex.episode.input_ids, ex.episode.action_mask,
                                 rule_strings(ex.episode.task.instruction)) for ex in examples]
        if not any(any(m) for m in masks):
            masks = None
    parts = {"all": None} if masks is None else {"all": None, "rule": True, "other_tokens": False}
    nll = {m: {part: _pooled(per_mode[m], masks, want) for part, want in parts.items()} for m in MODES}
    means = {m: {part: _per_example_mean(per_mode[m], masks, want) for part, want in parts.items()} for m in MODES}
    gaps = {}
    for part in parts:
        suffix = "" if part == "all" else f"/{part}"
        gaps[f"none-text{suffix}"] = paired_gap(means["none"][part], means["text"][part])
        gaps[f"none-learned{suffix}"] = paired_gap(means["none"][part], means["learned"][part])
        gaps[f"other-learned{suffix}"] = paired_gap(means["other"][part], means["learned"][part])
    spread = latent_task_spread(composer, examples, batch_size)
    tick(1)
    return CheckResult(len(examples), nll, gaps, spread, verdict_lines(gaps, spread))


def _fmt_gap(g: Gap) -> str:
    return f"{g.mean:+.3f} nats/token (95 % CI {g.lo:+.3f} to {g.hi:+.3f}, {g.n} tasks)"


def verdict_lines(gaps: dict[str, Gap], spread: float, min_spread: float = 0.02) -> list[str]:
    text, learned, own = gaps["none-text"], gaps["none-learned"], gaps["other-learned"]
    if learned.above_zero:
        beats = f"yes: the latent teacher beats the student by {_fmt_gap(learned)}"
    elif text.above_zero:
        beats = (f"only with text: references as text beat the student by {_fmt_gap(text)}, the latents do not "
                 f"({_fmt_gap(learned)}); LOPD is unlikely to gain with this composer: rerun `lopd coldstart` with "
                 f"another coldstart.seed or more steps (docs/algorithm.md, \"Cold start\")")
    else:
        beats = (f"no: no teacher beats the student (text {_fmt_gap(text)}, latents {_fmt_gap(learned)}); "
                 "distilling toward it is unlikely to help")
    if own.above_zero:
        carry = f"yes: own references beat another task's by {_fmt_gap(own)}"
    else:
        carry = f"no: own references do not beat another task's ({_fmt_gap(own)})"
    if spread < min_spread:
        carry += f"; task spread {spread:.1%}: the composer is a fixed soft prompt"
    return [f"Does a teacher beat the student? {beats}", f"Do the latents carry the task's references? {carry}"]


def check_lines(check: dict) -> list[str]:
    """The check (`CheckResult.to_dict()`) as plain text lines: a small table, spread, verdicts."""
    fmt = lambda x: "      -" if x is None else f"{x:7.3f}"  # noqa: E731
    nll = check["nll"]
    split = any(v.get("rule") is not None for v in nll.values())
    width = max(len(v) for v in LABELS.values())
    head = f"{'teacher sees':<{width}}  {'all':>7}" + (f"  {'rule':>7}  {'other':>7}" if split else "")
    lines = [f"Will LOPD help here? teacher NLL per action token, {check['n_examples']} held-out validation successes",
             head]
    for m in MODES:
        row = f"{LABELS[m]:<{width}}  {fmt(nll[m]['all'])}"
        if split:
            row += f"  {fmt(nll[m].get('rule'))}  {fmt(nll[m].get('other_tokens'))}"
        lines.append(row)
    lines.append(f"latents' task spread: {check['task_spread']:.1%}")
    return lines + list(check["verdicts"])
