"""`lopd report RUN_DIR... [-o FILE.png]`: training curves and a table of final figures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lopd_cli.cli.common import DebugOpt, JsonOpt, ProjectOpt, console, print_json
from lopd_cli.errors import LopdError


def report(
    runs: Annotated[list[str], typer.Argument(help="Run folders (runs/RUN), or run names in the project's runs/.")],
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="PNG to write (default: report.png in the first run folder).")] = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Plot success/reward against rollouts and β, Δ, KL against steps; seeds of one recipe
    and algorithm are averaged (mean ± 95 % band)."""
    from lopd_cli.project import open_project
    from lopd_cli.results.report import write_report

    proj = open_project(project, required=False)
    dirs = []
    for r in runs:
        p = Path(r)
        if not p.is_dir() and proj is not None and (proj.runs_dir / r).is_dir():
            p = proj.runs_dir / r
        if not p.is_dir():
            raise LopdError(f"run '{r}': no such folder" + (f" (nor {proj.runs_dir / r})" if proj else ""))
        dirs.append(p)
    png = out or dirs[0] / "report.png"
    result = write_report(dirs, png)
    if as_json:
        print_json({"png": str(png.resolve()), "groups": result.final})
        return
    typer.echo(result.markdown)
    console.print(f"[green]wrote[/green] {png}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(report)
