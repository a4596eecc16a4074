"""`lopd report`: synthetic runs (2 recipes/algos × 2 seeds) → PNG with the expected series."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import yaml

from lopd_cli.errors import LopdError
from lopd_cli.results.report import build_report, load_run, write_report


def make_run(root: Path, name: str, algo: str, seed: int, steps: int = 12, per_step: int = 32, eval_every: int = 4) -> Path:
    """A run folder as the trainer writes it (GRPO rows have no beta/delta)."""
    run = root / f"{name}-{algo}-s{seed}"
    run.mkdir(parents=True)
    recipe = {"name": name, "model": {"backbone": "tiny"}, "env": {"class": "lopd_cli.envs.orders:OrdersEnv"},
              "train": {"algo": algo, "seed": seed, "lopd": {"margin_m": 0.05}}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    rng = random.Random(f"{name}-{algo}-{seed}")
    slope = 0.04 if algo == "lopd" else 0.025
    lines = []
    for step in range(1, steps + 1):
        success = min(1.0, max(0.0, 0.2 + slope * step + rng.uniform(-0.08, 0.08)))
        row = {"step": step, "rollouts_total": step * per_step, "reward": success + 0.1, "success": success,
               "kl": 1.0 / step, "loss/distill": 0.5}
        if algo == "lopd":
            row.update({"delta": 0.01 * step, "beta": max(0.0, 0.3 - 0.02 * step), "anchor": 0.001,
                        "margin_binds": step % 3 == 0 if step != 5 else None,  # step 5: Δ undefined
                        "grad_norm_encoder": 0.1, "grad_norm_resampler": 0.2})
            if step % eval_every == 0:
                row.update({"composer/latent_task_spread": 0.4 / step, "composer/nll_gap": 0.05})
        lines.append(row)
        if step % eval_every == 0:
            val = {"eval/reward": success, "eval/success": success - 0.05}
            if seed % 2:  # the trainer's form: validation figures on the step's own row
                row.update(val)
            else:  # or a row of its own
                lines.append({"step": step, "rollouts_total": step * per_step, **val, "split": "validation"})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    return [make_run(tmp_path, "orders-tiny", algo, seed) for algo in ("lopd", "grpo") for seed in (0, 1)]


def test_report_png_and_series(tmp_path, runs):
    out = tmp_path / "plots" / "report.png"
    report = write_report(runs, out)
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000

    groups = {s.group for s in report.series["success"]}
    assert groups == {"orders-tiny · lopd", "orders-tiny · grpo"}
    lopd = next(s for s in report.series["success"] if s.group == "orders-tiny · lopd")
    assert lopd.seeds == 2 and lopd.x == [32.0 * k for k in range(1, 13)]
    # Mean and band are those of the two seeds' values at each x.
    a, b = (load_run(r) for r in runs[:2])
    ya, yb = a.rows[0]["success"], b.rows[0]["success"]
    assert lopd.mean[0] == pytest.approx((ya + yb) / 2)
    assert lopd.low[0] < lopd.mean[0] < lopd.high[0]
    assert lopd.high[0] - lopd.mean[0] == pytest.approx(12.706205 * abs(ya - yb) / 2, rel=1e-5)

    # GRPO logs no β or Δ: those panels hold only the LOPD group.
    assert [s.group for s in report.series["beta"]] == ["orders-tiny · lopd"]
    assert [s.group for s in report.series["delta"]] == ["orders-tiny · lopd"]
    assert len(report.series["kl"]) == 2
    val = report.series["eval/success"]
    assert len(val) == 2 and val[0].x == [128.0, 256.0, 384.0]

    # What the figure shows: one line per group per panel, titles, the margin line on Δ.
    axes = {ax.get_title(): ax for ax in report.figure.axes}
    assert {"training success", "training reward", "validation success", "β (dual variable)",
            "Δ (privileged margin)", "KL(student ‖ teacher)"} <= set(axes)
    labels = [l.get_label() for l in axes["training success"].get_lines()]
    assert labels == ["orders-tiny · lopd (n=2)", "orders-tiny · grpo (n=2)"]
    assert "margin m = 0.05" in [l.get_label() for l in axes["Δ (privileged margin)"].get_lines()]


def test_final_table(runs):
    report = build_report(runs)
    assert report.header[:4] == ["run group", "seeds", "steps", "rollouts"]
    rows = {r[0]: r for r in report.rows}
    assert rows["orders-tiny · lopd"][1:4] == ["2", "12", "384"]
    beta_col = report.header.index("β")
    assert rows["orders-tiny · grpo"][beta_col] == "-"
    assert rows["orders-tiny · lopd"][beta_col].startswith("0.060")
    assert report.markdown.splitlines()[0].startswith("| run group |")
    succ = report.final["orders-tiny · lopd"]["success"]
    assert succ["n"] == 2 and not math.isnan(succ["mean"])


def test_single_run_without_recipe_and_bad_input(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "rollouts_total": 8, "success": 0.5}\n{"step": 2, "rollo')
    report = build_report([run])  # a cut-off last line (run still writing) is skipped
    (s,) = report.series["success"]
    assert s.group == "bare · lopd" and s.x == [8.0] and s.low == [None]
    with pytest.raises(LopdError, match="metrics.jsonl"):
        build_report([tmp_path / "nothing"])


def test_margin_binding_share_and_composer_health(runs):
    report = build_report(runs)
    rows = {r[0]: r for r in report.rows}
    col = report.header.index("margin binds (share of steps)")
    # steps 3, 6, 9, 12 bind, of the 11 steps where Δ is defined (step 5 logged None)
    assert rows["orders-tiny · lopd"][col].startswith(f"{4 / 11:.3f}")
    assert rows["orders-tiny · grpo"][col] == "-"
    spread = report.header.index("task spread")
    assert rows["orders-tiny · lopd"][spread].startswith(f"{0.4 / 12:.3f}")
    assert rows["orders-tiny · lopd"][report.header.index("‖∇χ‖")].startswith("0.200")
    (s,) = report.series["composer/latent_task_spread"]
    assert s.x == [4.0, 8.0, 12.0] and s.mean == pytest.approx([0.1, 0.05, 0.4 / 12])
    titles = {ax.get_title() for ax in report.figure.axes}
    assert {"composer: latent task spread", "ψ (encoder LoRA) gradient norm"} <= titles


def test_a_panel_only_for_what_some_run_logged(tmp_path):
    """GRPO logs no β, Δ or composer health: its report draws no panel for them (no empty panel)."""
    grpo = [make_run(tmp_path, "orders-tiny", "grpo", seed) for seed in (0, 1)]
    titles = [ax.get_title() for ax in build_report(grpo).figure.axes]
    assert "training success" in titles and "validation success" in titles
    assert not {"β (dual variable)", "Δ (privileged margin)", "composer: latent task spread"} & set(titles)
    assert all(ax.lines for ax in build_report(grpo).figure.axes)
