"""`lopd evolve --recipe R [--rounds N] [--algo sft|lopd|opsd|sdpo|grpo|auto] [--run NAME] [--resume]`:
rounds of (roll out the incumbent → bank → train → gated replacement), pipeline/evolve.py."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lopd_cli.cli.common import DebugOpt, JsonOpt, ProjectOpt, RecipeOpt, SetOpt, print_json


def evolve(
    recipe: RecipeOpt = None,
    rounds: Annotated[Optional[int], typer.Option("--rounds", help="Rounds to run (default: evolve.rounds); with --resume, extends or shortens the run.", min=1)] = None,
    algo: Annotated[Optional[str], typer.Option("--algo", help="sft, lopd, opsd, sdpo, grpo or auto (default: evolve.algo).")] = None,
    run: Annotated[Optional[str], typer.Option("--run", help="Run folder name under runs/ (default: evolve-TIME).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run (--run NAME, default the newest evolve run) from its last finished stage.")] = False,
    set_: SetOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Grow the bank from the student's own rollouts, round after round: each round rolls the
    incumbent out, adds the episodes to the bank, trains a candidate and keeps it only if it is
    not worse on the same validation tasks. Writes runs/RUN/{evolve.json, rounds.jsonl, incumbent}."""
    from lopd_cli.pipeline.evolve import open_evolve, run_evolve
    from lopd_cli.project import open_project

    proj = open_project(project)
    ev = open_evolve(proj, recipe, list(set_ or []), run, rounds, algo, resume)
    def say(line: str) -> None:  # plain lines: a log keeps each whole (rich would wrap them at 80 columns)
        typer.echo(line, err=as_json)

    say(f"{'resuming' if resume else 'evolve run'} {ev.run_dir} ({ev.state['algo']}, {ev.state['rounds_wanted']} round(s))")
    result = run_evolve(ev, say)
    if as_json:
        print_json({"run": str(result.run_dir), "stopped": result.stopped, "incumbent_round": result.incumbent["round"],
                    "rounds": result.rounds})
        return
    inc = result.incumbent
    say(f"done: {result.run_dir} ({result.stopped}); incumbent: round {inc['round']} ({inc['method']}), "
        f"validation success {100 * inc['success']['mean']:.1f} %")
    if inc["checkpoint"]:
        say(f"  next: lopd eval --checkpoint {result.run_dir}")


def register(app: typer.Typer) -> None:
    app.command()(evolve)
