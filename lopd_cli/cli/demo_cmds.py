"""`lopd demo`: the main job end to end on the embedded default, with a before/after table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from lopd_cli.cli.common import DebugOpt, JsonOpt, SetOpt, console, err_console, print_json


def demo(
    model: Annotated[str, typer.Option(help="Backbone of the demo project (tiny: the shipped orders base policy is copied in).")] = "tiny",
    out: Annotated[Path, typer.Option("--out", help="Folder for the demo project.")] = Path("lopd-demo"),
    force: Annotated[bool, typer.Option("--force", help="Replace --out even if it holds a project the demo did not make.")] = False,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """init → base eval → your logs into the bank → the check → LOPD and SFT once → evolve rounds → test eval → export → report."""
    from lopd_cli.pipeline.demo import run_demo, summary
    from lopd_cli.results.evaluate import comparison_rows

    say = (lambda s: err_console.print(s, highlight=False)) if as_json else (lambda s: console.print(s, highlight=False))
    result = run_demo(out, model=model, force=force, say=say, overrides=set_ or [])
    if as_json:
        print_json(summary(result))
        return
    console.print(rounds_table(result.rounds))
    header, rows = comparison_rows([result.before, result.lopd, result.sft, result.after])
    table = Table(title=f"orders test split ({result.before.n} tasks, greedy): the base, one pass of LOPD and of SFT, "
                        f"and the evolved student")
    for h in header:
        table.add_column(h)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    d = result.evolved_vs_sft
    console.print(f"evolved − SFT on the same {d.n} test tasks: {d.estimate:+.1%} "
                  f"[{d.low:+.1%}, {d.high:+.1%}] (paired, 95 %)")
    console.print("stages: " + ", ".join(f"{s.name.split(':')[0]} {s.seconds:.0f}s" for s in result.stages))
    console.print(f"total {result.seconds / 60:.1f} min; evolve run {result.run_dir}; exported {result.export_dir}; "
                  f"report {result.report_png}")


def rounds_table(rounds: list[dict]) -> Table:
    """Evolve's rounds: validation success, the gate's decision, the bank's growth."""
    table = Table(title="evolve rounds (validation tasks, greedy)")
    for h in ("round", "method", "validation success", "paired diff vs incumbent", "accepted", "bank successes",
              "rollouts"):
        table.add_column(h)
    for r in rounds:
        v = r["validation"]
        pd = r.get("paired_diff")
        table.add_row(str(r["round"]), r["method"], f"{v['mean']:.1%} [{v['low']:.1%}, {v['high']:.1%}]",
                      "" if not pd else f"{pd['mean']:+.3f} [{pd['low']:+.3f}, {pd['high']:+.3f}]",
                      "yes" if r["accepted"] else "no", str(r.get("bank_successes", "")), str(r.get("rollouts_total", 0)))
    return table


def register(app: typer.Typer) -> None:
    app.command()(demo)
