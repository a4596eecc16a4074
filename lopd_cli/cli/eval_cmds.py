"""`lopd eval --recipe R [--checkpoint DIR | --model PATH]...`: the student alone, with 95 % CIs.

Each model is loaded, rolled out on the recipe's `eval` split (greedy by default), summarised
and freed before the next, so several models fit where one does. Several models give one
comparison table; tasks with `data["category"]` (BFCL) add a per-category table.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from lopd_cli.cli.common import DebugOpt, JsonOpt, ProjectOpt, RecipeOpt, SetOpt, console, err_console, print_json, progress
from lopd_cli.errors import LopdError


def _free(model) -> None:
    import torch

    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A rich table that is not squeezed to 80 columns when stdout is a file or a pipe."""
    from rich.console import Console

    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    out = console if console.is_terminal else Console(width=200, highlight=False)
    out.print(table)


def world_mismatch(info, r) -> str | None:
    """How the world a run was trained in (its own recipe.yaml: env and reward) differs from the
    recipe `r`, or None when they are the same (or the run saved no recipe)."""
    import yaml

    saved = (info.run_dir / "recipe.yaml") if info.run_dir else None
    if saved is None or not saved.is_file():
        return None
    data = yaml.safe_load(saved.read_text()) or {}
    env = data.get("env") or {}
    trained = (env.get("class"), env.get("kwargs") or {}, env.get("mcp"), data.get("reward"))
    mcp_here = r.env.mcp.model_dump(mode="json") if r.env.mcp is not None else None
    here = (r.env.cls, r.env.kwargs, mcp_here, r.reward)
    if trained == here:
        return None

    def label(world: tuple) -> str:
        if world[2]:
            return f"MCP server {world[2].get('url') or ' '.join([world[2].get('command') or '', *world[2].get('args', [])])}"
        return f"{world[0]} {world[1]}"
    return (f"{info.run_dir} was trained in env {label(trained)} (its recipe.yaml), but the "
            f"recipe '{r.name or r.source}' is env {label(here)}")


def check_same_world(info, r) -> None:
    """Without --recipe, eval uses the project's default recipe: refuse a run trained in another
    world, which would be scored on the wrong tasks."""
    differs = world_mismatch(info, r)
    if differs:
        raise LopdError(f"{differs}: pass --recipe")


def eval_cmd(
    recipe: RecipeOpt = None,
    checkpoint: Annotated[Optional[list[str]], typer.Option("--checkpoint", help="A run folder, step folder or 'latest' (repeatable).")] = None,
    model: Annotated[Optional[list[str]], typer.Option("--model", help="A plain transformers directory or embedded name (repeatable).")] = None,
    backbone: Annotated[bool, typer.Option("--backbone", help="Also evaluate the recipe's backbone (the default when no model is given).")] = False,
    split: Annotated[Optional[str], typer.Option(help="Task split (default: the recipe's eval.split).")] = None,
    n: Annotated[Optional[int], typer.Option("-n", help="Number of tasks (default: the recipe's eval.n, else the whole split).", min=1)] = None,
    rollouts: Annotated[Optional[Path], typer.Option("--rollouts", help="Also write every episode as rollout JSONL here.")] = None,
    success_threshold: Annotated[Optional[float], typer.Option(help="An episode succeeds when its reward reaches this (default: the recipe's eval.success_threshold).", min=0.0, max=1.0)] = None,
    set_: SetOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Evaluate students alone (no bank, composer or teacher): success and reward with 95 %
    intervals, and behaviour (tool calls, repeats, invalid calls, first-turn length)."""
    from lopd_cli.config import load_recipe
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.models.student import load_student, read_checkpoint, resolve_checkpoint
    from lopd_cli.project import find_recipe, open_project
    from lopd_cli.results.evaluate import category_rows, comparison_rows, run_eval

    proj = open_project(project, required=recipe is None)
    r = load_recipe(find_recipe(recipe or proj.settings.recipe, proj), set_ or [])
    if success_threshold is None:
        success_threshold = r.eval.success_threshold
    search = [r.base_dir] + ([proj.root] if proj else [])
    split = split or r.eval.split
    n = n if n is not None else r.eval.n

    # (label, loader) in the order: backbone, checkpoints, models.
    loaders = []
    if backbone or not (checkpoint or model):
        loaders.append((f"backbone {r.model.backbone}", lambda: load_backbone(r.model.backbone, r.model.dtype, r.model.device, search)))
    for spec in checkpoint or []:
        info = read_checkpoint(resolve_checkpoint(spec, runs_dir=proj.runs_dir if proj else None))
        if recipe is None:
            check_same_world(info, r)
        elif differs := world_mismatch(info, r):  # on purpose (transfer) or a forgotten --set: say so
            err_console.print(f"[yellow]note[/yellow]: {differs}; scoring it in the recipe's world")
        if info.backbone != r.model.backbone:
            err_console.print(f"[yellow]note[/yellow]: {info.path} was trained on '{info.backbone}', the recipe names '{r.model.backbone}'")
        run = info.run_dir.name if info.run_dir else info.path.parent.name
        label = f"{run}/step_{info.step} ({info.algo})"
        if (Path(spec) / "evolve.json").exists():  # an evolve run: its incumbent, named after the run
            label = f"{Path(spec).resolve().name} incumbent ({label})"
        loaders.append((label,
                        lambda info=info: load_student(info, r.model.dtype, r.model.device, search)))
    for spec in model or []:
        loaders.append((Path(spec).name or spec, lambda spec=spec: load_backbone(spec, r.model.dtype, r.model.device, search)))
    labels = [label for label, _ in loaders]
    if len(set(labels)) != len(labels):
        raise LopdError(f"two models would share the label {next(l for l in labels if labels.count(l) > 1)!r}")

    results, all_episodes = [], []
    with progress() as bar:
        for label, load in loaders:
            task = bar.add_task(f"eval {label}", total=None, info="loading")
            m, tok = load()
            bar.update(task, info=f"{split}, running")  # loaded: the count appears as episodes finish
            episodes_done = [0]

            def tick(k: int, task=task) -> None:
                episodes_done[0] += k
                bar.update(task, advance=k, info=f"{split}")

            res, episodes = run_eval(r, m, tok, label, split=split, n=n, progress=tick, success_threshold=success_threshold)
            bar.update(task, total=len(episodes), completed=len(episodes), info=f"success {res.success.estimate:.1%}")
            results.append(res)
            all_episodes += episodes
            _free(m)

    if rollouts is not None:
        rollouts.parent.mkdir(parents=True, exist_ok=True)
        with rollouts.open("w") as f:
            for ep in all_episodes:
                f.write(json.dumps(ep.to_record(), ensure_ascii=False) + "\n")

    settings = {"recipe": str(r.source), "split": split, "n": results[0].n if results else 0,
                "temperature": r.eval.temperature, "success_threshold": success_threshold}
    if as_json:
        print_json({**settings, "models": [x.to_dict() for x in results]})
        return
    decoding = "greedy" if r.eval.temperature == 0 else f"temperature {r.eval.temperature:g}"
    header, rows = comparison_rows(results)
    humaneval = bool(all_episodes) and all(ep.task.id.startswith("HumanEval") for ep in all_episodes)
    if humaneval and r.eval.temperature == 0 and success_threshold == 1.0:
        decoding += " · success = HumanEval pass@1"
    _print_table(f"{r.name or 'recipe'} · split {split} · {decoding}", header, rows)
    cheader, crows = category_rows(results)
    if crows:
        _print_table("success per category (95 % Wilson interval)", cheader, crows)
    console.print(
        f"success: reward ≥ {success_threshold:g} (1 = all checks pass; greedy on code: pass@1), 95 % Wilson interval; "
        "reward and behaviour: mean ± 95 % t-interval half-width.", style="dim", highlight=False,
    )
    errors = sum(x.errors for x in results)
    if errors:
        err_console.print(f"[yellow]note[/yellow]: {errors} episode(s) failed with an env/plugin error (counted as failures); see --rollouts")
    if rollouts is not None:
        console.print(f"episodes written to {rollouts}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
