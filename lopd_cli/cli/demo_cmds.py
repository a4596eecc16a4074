"""`lopd demo`: the main job end to end on the embedded default, with a before/after table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from lopd_cli.cli.common import DebugOpt, JsonOpt, SetOpt, console, err_console, print_json


def demo(
    model: Annotated[str, typer.Option(help="Backbone of the demo project (tiny trains a small orders base policy).")] = "tiny",
    out: Annotated[Path, typer.Option("--out", help="Folder for the demo project.")] = Path("lopd-demo"),
    force: Annotated[bool, typer.Option("--force", help="Replace --out even if it holds a project the demo did not make.")] = False,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """init → base eval → rollouts into the bank → index → cold start → LOPD → eval → export → report."""
    from lopd_cli.pipeline.demo import run_demo, summary
    from lopd_cli.results.evaluate import comparison_rows

    say = (lambda s: err_console.print(s, highlight=False)) if as_json else (lambda s: console.print(s, highlight=False))
    result = run_demo(out, model=model, force=force, say=say, overrides=set_ or [])
    if as_json:
        print_json(summary(result))
        return
    header, rows = comparison_rows([result.before, result.after])
    table = Table(title=f"orders test split, before and after LOPD ({result.before.n} tasks, greedy)")
    for h in header:
        table.add_column(h)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"stages: " + ", ".join(f"{s.name} {s.seconds:.0f}s" for s in result.stages))
    console.print(f"total {result.seconds / 60:.1f} min; run {result.run_dir}; exported {result.export_dir}; "
                  f"report {result.report_png}")


def register(app: typer.Typer) -> None:
    app.command()(demo)
