"""`lopd rollout --recipe R -n N [--split S] [--out FILE] [--to-bank] [--checkpoint RUN | --model DIR]`:
run the recipe's model (or a trained student, or another model) in its world, write rollout JSONL
(the format `lopd bank add-rollouts` reads) and print the behaviour summary (success, reward, tool
calls, repeats, invalid calls, first-turn length)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from lopd_cli.cli.common import DebugOpt, JsonOpt, ProjectOpt, RecipeOpt, SetOpt, console, err_console, print_json, progress
from lopd_cli.errors import LopdError


def _default_out(root: Path, recipe_name: str, split: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return root / "rollouts" / f"{recipe_name}-{split}-{stamp}.jsonl"


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tmp.replace(path)


def rollout(
    recipe: RecipeOpt = None,
    n: Annotated[int, typer.Option("-n", help="Number of episodes (tasks are cycled if the split is smaller).", min=1)] = 32,
    split: Annotated[str, typer.Option(help="Task split: train, validation or test.")] = "train",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="JSONL file to write (default: rollouts/RECIPE-SPLIT-TIME.jsonl).")] = None,
    checkpoint: Annotated[Optional[str], typer.Option("--checkpoint", help="Roll out a trained student: a run folder, step folder or 'latest'.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Roll out this model instead: a plain transformers directory or embedded name.")] = None,
    to_bank: Annotated[bool, typer.Option("--to-bank", help="Also add the rollouts to the project's bank (successful ones are kept).")] = False,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed (default: the recipe's train.seed).")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Override rollout.temperature (0 = greedy).", min=0.0)] = None,
    set_: SetOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Roll the recipe's model out in its environment and record every episode."""
    from lopd_cli.agent.metrics import summarize
    from lopd_cli.agent.runner import load_reward, make_env_factory, run_episodes, select_tasks
    from lopd_cli.config import load_recipe
    from lopd_cli.project import find_recipe, open_project
    from lopd_cli.models.student import load_policy

    proj = open_project(project, required=recipe is None or to_bank)
    r = load_recipe(find_recipe(recipe or proj.settings.recipe, proj), set_ or [])
    env_factory = make_env_factory(r)
    reward_fn = load_reward(r)
    tasks = select_tasks(env_factory, split, n)
    search = [r.base_dir] + ([proj.root] if proj else [])
    policy, tokenizer, produced_by = load_policy(r, search, checkpoint=checkpoint, model=model,
                                                 runs_dir=proj.runs_dir if proj else None)
    seed = r.train.seed if seed is None else seed
    name = r.name or (Path(r.source).stem if r.source else "recipe")
    meta = {**produced_by, "recipe": name, "split": split, "generated_by": "lopd"}

    with progress() as bar:
        job = bar.add_task("rollouts", total=len(tasks), info="")
        episodes = run_episodes(
            policy, tokenizer, env_factory, tasks, r.rollout, seed=seed, reward_fn=reward_fn,
            progress=lambda k: bar.advance(job, k), temperature=temperature, meta=meta,
        )
    records = [e.to_record() for e in episodes]
    out_path = out or _default_out(proj.root if proj else Path.cwd(), name, split)
    write_jsonl(out_path, records)
    summary = summarize(episodes)
    summary["out"] = str(out_path)

    if to_bank:
        from lopd_cli.bank.store import Bank

        bank = Bank(proj.bank_path(r), min_reward=r.bank.min_reward)
        res = bank.add_records(records, source=str(out_path))
        summary["bank"] = {"path": str(proj.bank_path(r)), "added": res.added,
                           "duplicates": res.duplicates, "successes": res.successes}

    if summary["errors"] > len(episodes) / 2:
        raise LopdError(f"{summary['errors']} of {len(episodes)} episodes failed; first: {summary['first_error']}")
    if as_json:
        print_json(summary)
        return
    table = Table(title=f"{len(episodes)} rollouts of {name} ({split})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("success rate", f"{summary['success_rate']:.1%}"),
        ("mean reward", f"{summary['mean_reward']:.3f}"),
        ("tool calls / episode", f"{summary['tool_calls']:.2f}"),
        ("repeated identical calls / episode", f"{summary['repeated_tool_calls']:.2f}"),
        ("invalid calls / episode", f"{summary['invalid_tool_calls']:.2f}"),
        ("first-turn length (tokens)", f"{summary['first_turn_tokens']:.1f}"),
        ("failed episodes", str(summary["errors"])),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    if summary["first_error"]:
        err_console.print(f"[yellow]first error[/yellow]: {summary['first_error']}")
    console.print(f"wrote {out_path}")
    if "bank" in summary:
        b = summary["bank"]
        console.print(f"bank: added {b['added']} ({b['successes']} successful), {b['duplicates']} duplicates")


def register(app: typer.Typer) -> None:
    app.command("rollout")(rollout)
