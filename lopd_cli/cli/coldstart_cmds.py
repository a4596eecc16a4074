"""`lopd coldstart`: train the composer on the bank's successful rollouts (backbone frozen)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lopd_cli.cli.common import DebugOpt, JsonOpt, ProjectOpt, RecipeOpt, SetOpt, console, print_json


def coldstart(
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    run: Annotated[Optional[str], typer.Option("--run", help="Run folder name under runs/ (default: coldstart-TIME).")] = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """SFT of the composer (encoder LoRA + QFormer) so the teacher, given latents of retrieved
    successful rollouts, assigns high likelihood to successful trajectories. Saves
    runs/RUN/composer/ (weights, encoder adapter, manifest, c_φ0 cache)."""
    from lopd_cli.errors import LopdError
    from lopd_cli.project import open_project
    from lopd_cli.train.coldstart import run_coldstart

    proj = open_project(project)
    r = proj.load_recipe(recipe, set_ or [])
    run_dir = proj.new_run_dir(run, "coldstart")
    if (run_dir / "composer" / "manifest.json").exists():
        raise LopdError(f"{run_dir} already holds a composer (choose another --run)")
    summary = run_coldstart(proj, r, run_dir, show_progress=not as_json)
    if as_json:
        print_json(summary)
        return
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    console.print(f"[green]composer saved[/green] to {summary['composer']}")
    console.print(
        f"  {summary['train_examples']} training / {summary['val_examples']} held-out rollouts, {summary['steps']} steps; "
        f"held-out teacher NLL per token {fmt(summary['val_nll_before'])} → {fmt(summary['val_nll_after'])}"
    )
    console.print(f"  c_φ0 cache: {summary['anchor_cache_entries']} tasks")
    if summary.get("check"):
        print_check(summary["check"])


def print_check(check: dict) -> None:
    """The before-training check (lopd_cli/train/check.py)."""
    from lopd_cli.train.check import check_lines

    for line in check_lines(check):
        console.print(f"  {line}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(coldstart)
