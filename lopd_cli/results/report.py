"""Training curves and final figures of one or more runs (`lopd report`).

Reads `runs/RUN/recipe.yaml` and `runs/RUN/metrics.jsonl`. Runs with the same recipe `name`
and algorithm are one group; their seeds (`train.seed`) are averaged and drawn as mean ± 95 %
t-band (a single seed is a plain line). Panels: training success and reward against
`rollouts_total` (rollouts are the cost that matters), validation success against
`rollouts_total` (`eval/success`, on the training row of its step or on its own
`"split": "validation"` row), β, Δ (with the margin m) and KL against `step`, and the composer's
health at each eval (LOPD): the latents' task spread, the teacher's NLL gap between another
task's references and its own (both on held-out bank trajectories) and ψ's gradient norm. The
table adds the share of steps where the margin binds (Δ < m, among steps where Δ is defined)
and χ's gradient norm. Keys a run did not log (GRPO has no β or Δ) are simply absent.

What it simplifies: seeds are aligned on the x values all of them logged; where none are
common (runs cut at different points) every logged x is used with the seeds present there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from lopd_cli.errors import LopdError
from lopd_cli.results.evaluate import markdown_table, mean_interval


@dataclass(frozen=True)
class Panel:
    key: str  # metrics.jsonl key
    x: str  # "rollouts_total" or "step"
    title: str


PANELS: tuple[Panel, ...] = (
    Panel("success", "rollouts_total", "training success"),
    Panel("reward", "rollouts_total", "training reward"),
    Panel("eval/success", "rollouts_total", "validation success"),
    Panel("beta", "step", "β (dual variable)"),
    Panel("delta", "step", "Δ (privileged margin)"),
    Panel("kl", "step", "KL(student ‖ teacher)"),
    Panel("composer/latent_task_spread", "step", "composer: latent task spread"),
    Panel("composer/nll_gap", "step", "composer: NLL(other refs) − NLL(own refs)"),
    Panel("grad_norm_encoder", "step", "ψ (encoder LoRA) gradient norm"),
)


UNIT_KEYS = {"success", "reward", "eval/success", "eval/reward"}


@dataclass
class Run:
    path: Path
    group: str
    seed: int
    margin_m: float | None
    rows: list[dict[str, Any]]  # training rows and validation rows, in file order


@dataclass
class Series:
    group: str
    x: list[float]
    mean: list[float]
    low: list[float | None]
    high: list[float | None]
    seeds: int


@dataclass
class Report:
    figure: Any  # matplotlib Figure
    series: dict[str, list[Series]]  # panel key → one series per group
    header: list[str]
    rows: list[list[str]]
    final: dict[str, dict[str, Any]] = field(default_factory=dict)  # group → figures (for --json)

    @property
    def markdown(self) -> str:
        return markdown_table(self.header, self.rows)


def _read_recipe(path: Path) -> dict[str, Any]:
    f = path / "recipe.yaml"
    if not f.is_file():
        return {}
    try:
        data = yaml.safe_load(f.read_text()) or {}
    except yaml.YAMLError as e:
        raise LopdError(f"{f}: not valid YAML ({e})") from None
    return data if isinstance(data, dict) else {}


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    f = path / "metrics.jsonl"
    if not f.is_file():
        raise LopdError(f"{path}: no metrics.jsonl (is this a run folder, runs/RUN/?)")
    rows = []
    lines = f.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # The last line of a run still being written may be cut off.
            if i == len(lines):
                continue
            raise LopdError(f"{f}:{i}: not valid JSON") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _margin_m(train_sec: dict[str, Any]) -> float:
    """A LOPD run's margin: train.lopd.margin_m (train.margin_m in runs of an earlier lopd)."""
    lopd = train_sec.get("lopd") if isinstance(train_sec.get("lopd"), dict) else {}
    value = lopd.get("margin_m", train_sec.get("margin_m"))
    return 0.05 if value is None else float(value)


def load_run(path: Path) -> Run:
    path = Path(path)
    recipe = _read_recipe(path)
    train_sec = recipe.get("train") or {}
    name = recipe.get("name") or path.name
    algo = train_sec.get("algo", "lopd")
    rows = _read_metrics(path)
    return Run(
        path=path,
        group=f"{name} · {algo}",
        seed=int(train_sec.get("seed", 0)),
        margin_m=_margin_m(train_sec) if algo == "lopd" else None,
        rows=rows,
    )


def group_runs(runs: Sequence[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    return groups


def _points(rows: list[dict[str, Any]], key: str, x_key: str) -> dict[float, float]:
    out = {}
    for row in rows:
        x, y = row.get(x_key), row.get(key)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            out[float(x)] = float(y)  # a repeated x (resume) keeps the last value
    return out


def aggregate(runs: Sequence[Run], panel: Panel) -> Series | None:
    """Mean ± 95 % t-band across the runs (seeds) of one group, or None if none logged it."""
    per_run = [_points(r.rows, panel.key, panel.x) for r in runs]
    per_run = [p for p in per_run if p]
    if not per_run:
        return None
    common = set.intersection(*(set(p) for p in per_run))
    xs = sorted(common or set().union(*per_run))
    mean, low, high = [], [], []
    for x in xs:
        iv = mean_interval([p[x] for p in per_run if x in p])
        mean.append(iv.estimate)
        low.append(iv.low)
        high.append(iv.high)
    return Series(runs[0].group, xs, mean, low, high, seeds=len(per_run))


def _final_value(rows: list[dict[str, Any]], key: str, last: int | None = 1) -> float | None:
    """The mean of the last `last` logged values of `key` (None: of all of them; booleans count
    as 0/1, so a flag's mean is the share of rows where it held)."""
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    if not vals:
        return None
    tail = vals if last is None else vals[-last:]
    return sum(tail) / len(tail)


FINAL_COLUMNS = (
    # (label, key, how many last logged values to average)
    ("success (last 5 steps)", "success", 5),
    ("reward (last 5 steps)", "reward", 5),
    ("validation success", "eval/success", 1),
    ("β", "beta", 1),
    ("Δ", "delta", 1),
    ("KL", "kl", 1),
    ("margin binds (share of steps)", "margin_binds", None),
    ("task spread", "composer/latent_task_spread", 1),
    ("NLL gap", "composer/nll_gap", 1),
    ("‖∇ψ‖", "grad_norm_encoder", 1),
    ("‖∇χ‖", "grad_norm_resampler", 1),
)


def final_figures(groups: dict[str, list[Run]]) -> tuple[list[str], list[list[str]], dict[str, dict[str, Any]]]:
    header = ["run group", "seeds", "steps", "rollouts"] + [c[0] for c in FINAL_COLUMNS]
    rows, data = [], {}
    for group, runs in groups.items():
        steps = [_final_value(r.rows, "step") for r in runs]
        rollouts = [_final_value(r.rows, "rollouts_total") for r in runs]
        entry: dict[str, Any] = {
            "runs": [str(r.path) for r in runs],
            "seeds": sorted(r.seed for r in runs),
            "steps": max((s for s in steps if s is not None), default=None),
            "rollouts_total": max((s for s in rollouts if s is not None), default=None),
        }
        row = [group, str(len(runs)), _fmt_num(entry["steps"], 0), _fmt_num(entry["rollouts_total"], 0)]
        for label, key, last in FINAL_COLUMNS:
            vals = [v for r in runs if (v := _final_value(r.rows, key, last)) is not None]
            iv = mean_interval(vals)
            entry[key] = iv.to_dict()
            if iv.estimate is None:
                row.append("-")
            elif iv.half_width is None:
                row.append(f"{iv.estimate:.3f}")
            else:
                row.append(f"{iv.estimate:.3f} ± {iv.half_width:.3f}")
        rows.append(row)
        data[group] = entry
    return header, rows, data


def _fmt_num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def build_report(run_dirs: Sequence[Path]) -> Report:
    """Load the runs, plot every panel and compute the final-figures table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise LopdError("give at least one run folder (runs/RUN)")
    evolves = [Path(d) for d in run_dirs if (Path(d) / "evolve.json").is_file()]
    if evolves:
        if len(evolves) != len(run_dirs):
            raise LopdError(f"{evolves[0]} is an evolve run: report evolve runs apart from training runs")
        return build_evolve_report(evolves)
    runs = [load_run(Path(d)) for d in run_dirs]
    groups = group_runs(runs)
    colours = {g: plt.get_cmap("tab10")(i % 10) for i, g in enumerate(groups)}

    # Only what some run logged gets a panel (GRPO and SFT log no β, Δ or composer health).
    aggregated = {panel: {g: aggregate(members, panel) for g, members in groups.items()} for panel in PANELS}
    panels = [p for p in PANELS if any(s is not None for s in aggregated[p].values())] or list(PANELS[:1])
    n_rows = -(-len(panels) // 3)
    fig, axes = plt.subplots(n_rows, 3, figsize=(16, 4.4 * n_rows), constrained_layout=True, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    series: dict[str, list[Series]] = {p.key: [] for p in PANELS}
    for ax, panel in zip(axes.flat, panels):
        for group in groups:
            s = aggregated[panel][group]
            if s is None:
                continue
            series[panel.key].append(s)
            label = f"{group} (n={s.seeds})" if s.seeds > 1 else group
            marker = "o" if panel.key.startswith("eval/") or len(s.x) < 25 else None
            ax.plot(s.x, s.mean, color=colours[group], label=label, marker=marker, markersize=3)
            # Rewards and success rates live in [0, 1]; a 2-seed t-band (t = 12.7) would not.
            lo_clip, hi_clip = (0.0, 1.0) if panel.key in UNIT_KEYS else (-float("inf"), float("inf"))
            band = [(x, max(lo, lo_clip), min(hi, hi_clip)) for x, lo, hi in zip(s.x, s.low, s.high) if lo is not None]
            if band:
                bx, blo, bhi = zip(*band)
                ax.fill_between(bx, blo, bhi, color=colours[group], alpha=0.2, linewidth=0)
        if panel.key == "delta":
            margins = {r.margin_m for r in runs if r.margin_m is not None and any("delta" in row for row in r.rows)}
            for m in sorted(margins):
                ax.axhline(m, color="grey", linestyle="--", linewidth=1, label=f"margin m = {m:g}")
        ax.set_title(panel.title)
        ax.set_xlabel("rollouts" if panel.x == "rollouts_total" else "step")
        ax.set_ylabel(panel.key)
        ax.grid(alpha=0.3)
        if panel.key in ("success", "eval/success"):
            ax.set_ylim(-0.02, 1.02)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"lopd report: {len(runs)} run(s), {len(groups)} group(s); bands = 95 % t-interval over seeds")
    header, rows, final = final_figures(groups)
    return Report(fig, series, header, rows, final)


def write_report(run_dirs: Sequence[Path], out: Path) -> Report:
    report = build_report(run_dirs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report.figure.savefig(out, dpi=110)
    return report


# ----------------------------------------------------------------------------- evolve runs


def _retention_cell(retention: dict) -> str:
    """`bfcl 40.0 % (−2.5)`: a world's validation success and its paired change against the start."""
    if not retention:
        return "-"
    cells = []
    for w, v in retention.items():
        vs = v.get("vs_start")
        cells.append(f"{w} {100 * v['success']['mean']:.1f} %" + (f" ({100 * vs['mean']:+.1f})" if vs else "")
                     + ("" if v.get("ok", True) else " forgets"))
    return "; ".join(cells)


def build_evolve_report(run_dirs: Sequence[Path]) -> Report:
    """`lopd report runs/EVOLVE`: each round's validation success (95 % Wilson interval; hollow
    markers: rejected candidates) and the incumbent's, against rounds and against rollouts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lopd_cli.results.evaluate import fmt_interval, Interval
    from lopd_cli.pipeline.evolve import read_rounds

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    header = ["run", "round", "method", "rollouts", "bank rows", "successes added", "duplicates",
              "validation success (95 % CI)", "paired diff (95 % CI)", "retention: success, vs start", "accepted"]
    rows, series, final = [], {"evolve/validation_by_round": [], "evolve/validation_by_rollouts": []}, {}
    for i, d in enumerate(run_dirs):
        rounds = read_rounds(d)
        colour = plt.get_cmap("tab10")(i % 10)
        name = Path(d).name
        val = [r["validation"] for r in rounds]
        inc_by_round = {r["round"]: r for r in rounds}
        incumbent = [inc_by_round[r["incumbent_round"]]["validation"]["mean"] for r in rounds]
        for ax, x_key, key in ((axes[0], "round", "evolve/validation_by_round"),
                               (axes[1], "rollouts_total", "evolve/validation_by_rollouts")):
            xs = [r[x_key] for r in rounds]
            means = [v["mean"] for v in val]
            # max(0, …): at 0/n Wilson's low end can sit a rounding error above the estimate.
            err = [[max(0.0, m - v["low"]) for m, v in zip(means, val)], [max(0.0, v["high"] - m) for m, v in zip(means, val)]]
            ax.errorbar(xs, means, yerr=err, fmt="none", ecolor=colour, alpha=0.5, capsize=3)
            acc = [j for j, r in enumerate(rounds) if r["accepted"]]
            rej = [j for j, r in enumerate(rounds) if not r["accepted"]]
            ax.plot([xs[j] for j in acc], [means[j] for j in acc], "o", color=colour, label=f"{name}: accepted")
            if rej:
                ax.plot([xs[j] for j in rej], [means[j] for j in rej], "o", mfc="none", color=colour,
                        label=f"{name}: rejected")
            ax.step(xs, incumbent, where="post", color=colour, label=f"{name}: incumbent")
            series[key].append(Series(name, [float(x) for x in xs], means, [v["low"] for v in val],
                                      [v["high"] for v in val], seeds=1))
            for w in rounds[0].get("retention", {}):  # the candidates' retention, dashed
                kept = [r["retention"][w]["success"] for r in rounds]
                ax.plot(xs, [v["mean"] for v in kept], "--", marker="x", color=colour, alpha=0.7,
                        label=f"{name}: retention {w}")
                series.setdefault(f"{key}/retain/{w}", []).append(Series(
                    name, [float(x) for x in xs], [v["mean"] for v in kept], [v["low"] for v in kept],
                    [v["high"] for v in kept], seeds=1))
        for r in rounds:
            pd = r.get("paired_diff")
            rows.append([name, str(r["round"]), r["method"], str(r["rollouts_total"]), str(r.get("bank_size", "-")),
                         str(r.get("successes_added", "-")), str(r.get("duplicates", "-")),
                         fmt_interval(Interval(r["validation"]["mean"], r["validation"]["low"], r["validation"]["high"],
                                               r["validation"]["n"]), percent=True),
                         "-" if not pd else fmt_interval(Interval(pd["mean"], pd["low"], pd["high"], pd["n"])),
                         _retention_cell(r.get("retention") or {}), "yes" if r["accepted"] else "no"])
        last = rounds[-1]
        final[name] = {"rounds": len(rounds) - 1, "incumbent_round": last["incumbent_round"],
                       "incumbent_validation": inc_by_round[last["incumbent_round"]]["validation"],
                       "rollouts_total": last["rollouts_total"]}
    for ax, xlabel in zip(axes, ("round", "rollouts (evolve's own, training included)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation success")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("validation success by round (greedy, same tasks; 95 % Wilson)")
    axes[1].set_title("validation success by rollouts spent")
    axes[0].xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"lopd report: {len(run_dirs)} evolve run(s)")
    return Report(fig, series, header, rows, final)
