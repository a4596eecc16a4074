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
    """The before-training check (lopd_cli/train/check.py) as a table and two verdict lines."""
    from rich.table import Table

    from lopd_cli.train.check import LABELS, MODES

    nll = check["nll"]
    split = any(v.get("rule") is not None for v in nll.values())
    table = Table(title=f"Will LOPD help here? Teacher NLL per action token on {check['n_examples']} held-out "
                        "validation successes (lower is better)")
    table.add_column("teacher sees")
    table.add_column("all tokens", justify="right")
    if split:
        table.add_column("rule tokens", justify="right")
        table.add_column("other tokens", justify="right")
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for m in MODES:
        row = [LABELS[m], fmt(nll[m]["all"])]
        if split:
            row += [fmt(nll[m].get("rule")), fmt(nll[m].get("other_tokens"))]
        table.add_row(*row)
    console.print(table)
    console.print(f"  latents' task spread: {check['task_spread']:.1%}")
    for line in check["verdicts"]:
        console.print(f"  {line}")


def register(app: typer.Typer) -> None:
    app.command()(coldstart)
