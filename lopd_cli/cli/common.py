"""Options every command shares, console helpers and progress bars."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from lopd_cli.console import console, err_console  # noqa: F401  (the commands import them from here)

ProjectOpt = Annotated[
    Optional[Path],
    typer.Option("-C", "--project", help="Project folder (default: nearest lopd.yaml upward).", show_default=False),
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
RecipeOpt = Annotated[
    Optional[str],
    typer.Option("--recipe", "-r", help="Recipe path or name in the project's recipes/ (default: the project's)."),
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="Override a recipe key, e.g. --set train.lr=2e-4 (repeatable)."),
]


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def progress(transient: bool = False) -> Any:
    """Progress with rate and ETA, for `with`: a rich bar when stderr is a terminal, otherwise
    one plain line per task every few seconds (lopd_cli/progress.py)."""
    from lopd_cli.progress import make_progress

    return make_progress(transient)
