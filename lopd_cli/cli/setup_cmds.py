"""`lopd init`, `lopd models`, `lopd recipe check`, `lopd recipe explain`: setting a project up."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from lopd_cli.cli.common import DebugOpt, JsonOpt, ProjectOpt, SetOpt, console, print_json
from lopd_cli.errors import LopdError

NARROW_COLUMNS = 110  # below this `recipe explain` prints a list, not a table


def init(
    directory: Annotated[Path, typer.Argument(help="Folder for the new project (created if missing).")],
    example: Annotated[str, typer.Option(help="Starting world: orders, bfcl, code or tau-retail.")] = "orders",
    model: Annotated[str, typer.Option(help="tiny, smollm2-135m-instruct, or a transformers directory.")] = "tiny",
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing project's settings and recipes.")] = False,
    seed: Annotated[int, typer.Option(help="Project seed.")] = 0,
    base_policy: Annotated[bool, typer.Option("--base-policy/--no-base-policy", help="With --example orders --model tiny: copy the shipped tiny base policy into models/base (make base-policy rebuilds it).")] = True,
    debug: DebugOpt = False,
) -> None:
    """Create a project: lopd.yaml, recipes/ (toolcall.yaml and code.yaml always), runs/, models/."""
    from lopd_cli.cli.common import progress as progress_bar
    from lopd_cli.project.scaffold import create_project

    with progress_bar(transient=True) as bar:
        job = None

        def on_step(step: int, steps: int, loss: float) -> None:
            nonlocal job
            if job is None:
                job = bar.add_task("training the tiny base policy", total=steps, info="")
            bar.update(job, completed=step, info=f"loss {loss:.3f}")

        project = create_project(directory, example=example, model=model, force=force, seed=seed,
                                 base_policy=base_policy, progress=on_step)
    console.print(f"[green]created[/green] lopd project in {project.root}")
    for r in sorted(project.recipes_dir.glob("*.yaml")):
        console.print(f"  recipes/{r.name}")
    if example == "tau-retail":
        from lopd_cli.project.scaffold import TAU_RETAIL_LOGS

        console.print(f"  {TAU_RETAIL_LOGS} (gold trajectories of the 60 train tasks)")
        console.print(f"next: cd {directory} && lopd bank add-rollouts {TAU_RETAIL_LOGS} && lopd bank index")
        return
    console.print(f"next: cd {directory} && lopd bank add-rollouts FILE.jsonl  (or lopd rollout --recipe toolcall -n 64 --to-bank)")


def models(as_json: JsonOpt = False, debug: DebugOpt = False) -> None:
    """List the embedded backbones and embedders: installed or not, and their size."""
    from lopd_cli.models.inventory import inventory

    rows = inventory()
    if as_json:
        print_json(rows)
        return
    table = Table(title="embedded models (offline)")
    for col in ("kind", "name", "installed", "cached", "size", "description"):
        table.add_column(col)
    for r in rows:
        size = f"{r['size_bytes'] / 1e6:.1f} MB" if r["size_bytes"] else "-"
        table.add_row(r["kind"], r["name"], "yes" if r["installed"] else "no", "yes" if r["cached"] else "no", size, r["description"])
    console.print(table)


recipe_app = typer.Typer(help="Inspect recipes.", no_args_is_help=True)


@recipe_app.command("check")
def recipe_check(
    recipe: Annotated[Optional[str], typer.Argument(help="Recipe path or name in the project's recipes/ (default: lopd.yaml's).")] = None,
    set_: SetOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Validate a recipe (schema, env class or MCP server and task file, reward plugin) and print it resolved."""
    from lopd_cli.agent.plugins import load_env_class, load_reward_fn
    from lopd_cli.agent.runner import make_env_factory
    from lopd_cli.config import load_recipe
    from lopd_cli.project import find_recipe, open_project

    proj = open_project(project, required=False)
    if recipe is None and proj is None:
        raise LopdError("lopd recipe check: name a recipe (a path), or run it in a project (its lopd.yaml names one)")
    path = find_recipe(recipe or proj.settings.recipe, proj)
    r = load_recipe(path, set_ or [])
    if r.env.mcp is not None:
        make_env_factory(r)  # starts the server, lists its tools, reads the task file
    else:
        load_env_class(r.env.cls, r.base_dir)
    if r.reward:
        load_reward_fn(r.reward, r.base_dir)
    if as_json:
        print_json(r.model_dump(mode="json", by_alias=True))
    else:
        console.print(f"# {path}: ok", highlight=False)
        console.print(r.to_yaml(), highlight=False, markup=False)


@recipe_app.command("explain")
def recipe_explain(
    key: Annotated[Optional[str], typer.Argument(help="A key (train.lopd.margin_m) or a section (train.lopd); default: all.")] = None,
    as_json: JsonOpt = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the whole reference as Markdown (docs/recipes.md).")] = False,
    debug: DebugOpt = False,
) -> None:
    """Print recipe keys with their defaults and descriptions: all, a section, or one key."""
    from lopd_cli.config import explain, recipe_reference_markdown

    if markdown:
        if key:
            raise LopdError("--markdown prints the whole reference; drop the KEY")
        sys.stdout.write(recipe_reference_markdown())
        return
    infos = explain(key)
    if as_json:
        print_json([{"key": i.key, "type": i.type, "default": i.default, "description": i.description}
                    for i in infos if not i.is_section])
        return
    if console.width < NARROW_COLUMNS:  # a table's description column would be a word wide
        for i in infos:
            head = Text(i.key, style="bold dim" if i.is_section else "bold")
            if not i.is_section:
                head.append(f"  {i.type}  ").append(i.default, style="cyan")
            console.print(head)
            console.print(Padding(Text(i.description), (0, 0, 0, 4)))
        return
    table = Table(title=f"recipe keys: {key}" if key else "recipe keys")
    for col, style in (("key", "bold"), ("type", None), ("default", "cyan")):
        table.add_column(col, style=style, no_wrap=True)
    table.add_column("description", ratio=1)
    for i in infos:  # Text: no rich markup in keys or descriptions
        if i.is_section:
            table.add_row(Text(i.key), Text("section"), Text(""), Text(i.description), style="dim")
        else:
            table.add_row(Text(i.key), Text(i.type), Text(i.default), Text(i.description))
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command()(init)
    app.command()(models)
    app.add_typer(recipe_app, name="recipe")
