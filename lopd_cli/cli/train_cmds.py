"""`lopd train`: LOPD (default), or the GRPO / OPSD / SFT baselines, in one loop."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lopd_cli.cli.common import DebugOpt, JsonOpt, ProjectOpt, RecipeOpt, SetOpt, console, print_json, progress


def train(
    recipe: RecipeOpt = None,
    algo: Annotated[Optional[str], typer.Option("--algo", help="lopd (default), grpo, opsd, sdpo, distill or sft: sets train.algo.")] = None,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run from its latest checkpoint.")] = False,
    run: Annotated[Optional[str], typer.Option(
        "--run", "--run-name",
        help="Run folder name under runs/ (default: ALGO-TIME). Under torchrun write --run-name "
             "(torchrun reads --run as its own --run-path).")] = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Train the student on its own rollouts; writes runs/RUN/{recipe.yaml, metrics.jsonl, checkpoints/}."""
    from lopd_cli.errors import LopdError
    from lopd_cli.project import open_project
    from lopd_cli.train import distributed as dist
    from lopd_cli.train.loop import train as run_training

    dist.init_from_env()  # torchrun / accelerate launch: one process per rank runs this command
    proj = open_project(project)
    overrides = list(set_ or [])
    if algo is not None:
        if algo not in ("lopd", "grpo", "opsd", "sdpo", "distill", "sft"):
            raise LopdError(f"--algo '{algo}': choose lopd, grpo, opsd, sdpo, distill or sft")
        overrides.append(f"train.algo={algo}")
    r = proj.load_recipe(recipe, overrides)

    def pick_run_dir():
        if resume and not run:
            runs = sorted((p for p in proj.runs_dir.glob(f"{r.train.algo}-*") if (p / "recipe.yaml").exists()),
                          key=lambda p: p.stat().st_mtime)
            if not runs:
                raise LopdError(f"--resume: no {r.train.algo} run in {proj.runs_dir} (name one with --run)")
            return runs[-1]
        return proj.new_run_dir(run, r.train.algo)

    run_dir = dist.on_main(pick_run_dir)  # one name for all ranks (the default holds the time)
    if not dist.is_main():  # ranks other than 0 train silently; rank 0 shows progress and results
        run_training(proj, r, run_dir, resume=resume)
        return
    rows: list[dict] = []
    with progress(transient=as_json) as bar:
        task = bar.add_task(f"{r.train.algo} steps", total=r.train.steps, info="")

        def on_step(row: dict) -> None:
            if not rows and row["step"] > 1:  # resumed: time from here, so the rate counts only later steps
                bar.reset(task, completed=row["step"])
            rows.append(row)
            bar.update(task, completed=row["step"], info=_step_info(row))

        tr = run_training(proj, r, run_dir, resume=resume, on_step=on_step)
        bar.update(task, completed=tr.state.step)
    summary = {"run": str(run_dir), "algo": r.train.algo, "steps": tr.state.step,
               "rollouts_total": tr.state.rollouts_total, "last": rows[-1] if rows else None}
    if as_json:
        print_json(summary)
        return
    console.print(f"[green]done[/green]: {run_dir} ({tr.state.step} steps, {tr.state.rollouts_total} rollouts in total)")
    if rows:
        console.print(f"  last step: {_step_info(rows[-1], ', ')}")
    hint = f"--recipe {recipe} " if recipe else ""  # what the user typed finds the recipe again
    console.print(f"  next: lopd eval {hint}--checkpoint {run_dir}")


def _step_info(row: dict, sep: str = " ") -> str:
    """Reward and success of the step's rollouts (SFT has none: its loss), β and Δ for LOPD."""
    if row.get("reward") is None:
        parts = [f"loss {row.get('loss') or 0:.4f}"]
    else:
        parts = [f"reward {row['reward']:.3f}", f"success {row['success']:.2f}"]
    if row.get("eval/success") is not None:
        parts.append(f"validation success {row['eval/success']:.2f}")
    if row.get("beta") is not None:
        parts.append(f"β {row['beta']:.3f} Δ {row.get('delta', 0):.3f}")
    return sep.join(parts)


def register(app: typer.Typer) -> None:
    app.command()(train)
