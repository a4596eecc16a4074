"""`lopd bank …`: fill, index, inspect and search the experience bank."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from lopd_cli.cli.common import DebugOpt, JsonOpt, ProjectOpt, RecipeOpt, console, print_json, progress
from lopd_cli.errors import LopdError

bank_app = typer.Typer(help="The experience bank: add rollouts, index, search, inspect.", no_args_is_help=True)


def _context(project: Path | None, recipe: str | None) -> tuple[Any, Any, Any]:
    """(project, recipe or None, bank settings). Without --recipe the project's default recipe
    is used when it exists, else the default bank settings."""
    from lopd_cli.bank.index import bank_settings
    from lopd_cli.project import open_project

    proj = open_project(project)
    rec = None
    if recipe is not None:
        rec = proj.load_recipe(recipe)
    else:
        try:
            path = proj.recipe_path(None)
        except LopdError:
            path = None
        if path is not None:
            rec = proj.load_recipe(None)
    return proj, rec, bank_settings(rec)


def _open_bank(project: Path | None, recipe: str | None, create: bool = False, min_reward: float | None = None):
    from lopd_cli.bank.store import Bank

    proj, rec, cfg = _context(project, recipe)
    bank = Bank(proj.bank_path(rec), cfg.min_reward if min_reward is None else min_reward, create=create)
    return proj, rec, cfg, bank


class _FormatSniffer:
    """Iterates a JSONL byte stream unchanged and notes the format of its first record."""

    def __init__(self, stream: Any):
        self.stream, self.format = stream, None

    def __iter__(self):
        from lopd_cli.bank.records import detect_format

        for raw in self.stream:
            if self.format is None and raw.strip():
                try:
                    self.format = detect_format(json.loads(raw)) or "unknown"
                except (ValueError, UnicodeDecodeError):
                    self.format = "unknown"
            yield raw


def _format_label(fmt: str | None) -> str:
    from lopd_cli.bank.records import FORMATS

    return FORMATS.get(fmt or "", "no records" if fmt is None else "unrecognised first record")


@bank_app.command("add-rollouts")
def add_rollouts(
    files: Annotated[list[str], typer.Argument(help="JSONL rollout files ('-' reads stdin).")],
    min_reward: Annotated[Optional[float], typer.Option(help="Success threshold (default: recipe bank.min_reward).")] = None,
    skip_invalid: Annotated[bool, typer.Option("--skip-invalid", help="Add the valid lines of a file that has bad ones.")] = False,
    recipe: RecipeOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Add rollouts (one transaction per file: a file with a bad line adds nothing unless --skip-invalid)."""
    proj, rec, cfg, bank = _open_bank(project, recipe, create=True, min_reward=min_reward)
    results, formats = [], []
    with bank:
        for name in files:
            if name == "-":
                sniffer = _FormatSniffer(sys.stdin.buffer)
                res = bank.add_stream(sniffer, "<stdin>", skip_invalid)
            else:
                path = Path(name)
                if not path.is_file():
                    raise LopdError(f"{name}: file not found")
                with progress(transient=True) as bar, open(path, "rb") as f:
                    task = bar.add_task(path.name, total=os.path.getsize(path), info="bytes")
                    sniffer = _FormatSniffer(bar.wrap_file(f, task_id=task))
                    res = bank.add_stream(sniffer, name, skip_invalid)
            results.append(res)
            formats.append(sniffer.format)
            if not as_json:
                typer.echo(f"{res.source}: format {_format_label(sniffer.format)}", err=True)
            for line, reason in res.invalid_lines:
                typer.echo(f"{res.source}:{line}: {reason}" + (" (skipped)" if skip_invalid else ""), err=True)
            if res.invalid > len(res.invalid_lines):
                typer.echo(f"{res.source}: … {res.invalid - len(res.invalid_lines)} more invalid lines", err=True)
    totals = {k: sum(getattr(r, k) for r in results) for k in ("added", "duplicates", "invalid", "successes")}
    rejected = [r.source for r in results if not r.written]
    if as_json:
        print_json(dict(files=[{**r.as_dict(), "format": fmt} for r, fmt in zip(results, formats)],
                        **totals, rejected=rejected))
    else:
        for r in results:
            state = "" if r.written else "  (rejected: nothing written)"
            typer.echo(f"{r.source}: added {r.added}, duplicates {r.duplicates}, invalid {r.invalid}, "
                       f"successful {r.successes}{state}")
        if len(results) > 1:
            typer.echo(f"total: added {totals['added']}, duplicates {totals['duplicates']}, "
                       f"invalid {totals['invalid']}, successful {totals['successes']}")
    if rejected:
        raise LopdError(f"{', '.join(rejected)}: invalid lines, nothing from "
                        f"{'that file' if len(rejected) == 1 else 'those files'} was written "
                        "(fix the lines or use --skip-invalid)")


@bank_app.command("index")
def index(
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Re-embed everything (needed after changing the embedder or embed_text).")] = False,
    recipe: RecipeOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Embed the successful rollouts not indexed yet and save the FAISS index."""
    from lopd_cli.bank.index import build_index

    proj, rec, cfg = _context(project, recipe)
    report = build_index(proj, rec, rebuild=rebuild, progress=not as_json)
    if as_json:
        print_json(dict(report.as_dict(), index_dir=str(proj.index_dir(rec))))
    else:
        console.print(f"index ({report.kind}): {report.total} rollouts; embedded {report.added} new, "
                      f"removed {report.removed} ({report.seconds:.1f} s, embedding {report.embed_seconds:.1f} s)",
                      highlight=False)


@bank_app.command("stats")
def stats(
    recipe: RecipeOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Totals, successes, per env and per source file, reward histogram."""
    from lopd_cli.bank.index import VectorIndex

    proj, rec, cfg, bank = _open_bank(project, recipe)
    with bank:
        s = bank.stats()
    idx = VectorIndex.load(proj.index_dir(rec))
    s["indexed"] = len(idx) if idx is not None else None
    if as_json:
        print_json(s)
        return
    console.print(f"{s['path']}: {s['total']} rollouts, {s['successes']} successful (reward >= {s['min_reward']}), "
                  f"indexed {s['indexed'] if s['indexed'] is not None else 'no index'}", highlight=False)
    if s["total"]:
        console.print(f"reward min {s['reward_min']:.3g}  mean {s['reward_mean']:.3g}  max {s['reward_max']:.3g}",
                      highlight=False)
    for key, title in (("per_env", "env"), ("per_source", "source")):
        t = Table(title=f"per {title}")
        for col in (title, "rollouts", "successful"):
            t.add_column(col)
        for row in s[key]:
            t.add_row(str(row[title if title == "env" else "source"]), str(row["total"]), str(row["successes"]))
        console.print(t)
    if s["reward_histogram"]:
        top = max(b["count"] for b in s["reward_histogram"]) or 1
        for b in s["reward_histogram"]:
            console.print(f"  [{b['lo']:.2f}, {b['hi']:.2f})  {b['count']:>8}  {'#' * round(40 * b['count'] / top)}",
                          highlight=False, markup=False)


@bank_app.command("search")
def search(
    text: Annotated[str, typer.Argument(help="Query text (a task instruction).")],
    k: Annotated[int, typer.Option("-k", help="How many rollouts.")] = 3,
    recipe: RecipeOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """The k successful rollouts nearest to TEXT."""
    from lopd_cli.bank.retrieve import Retriever

    proj, rec, _ = _context(project, recipe)
    r = Retriever.open(proj, rec)
    try:
        items = r.retrieve(text, k)
    finally:
        r.close()
    if as_json:
        print_json([dict(id=i.id, score=i.score, **i.to_record()) for i in items])
        return
    t = Table()
    for col in ("id", "score", "task_id", "reward", "instruction"):
        t.add_column(col)
    for i in items:
        instr = i.instruction if len(i.instruction) <= 100 else i.instruction[:97] + "..."
        t.add_row(str(i.id), f"{i.score:.3f}", str(i.task_id or "-"), f"{i.reward:.3g}", instr)
    console.print(t)


@bank_app.command("show")
def show(
    id: Annotated[int, typer.Argument(help="Row id (see `lopd bank search`).")],
    recipe: RecipeOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """One rollout: its record, where it came from, and the transcript."""
    from lopd_cli.bank.lite import render_transcript

    _, _, _, bank = _open_bank(project, recipe)
    with bank:
        item, info = bank.get(id), bank.row_info(id)
    if as_json:
        print_json(dict(id=item.id, success=item.success, **info, **item.to_record()))
        return
    console.print(f"#{item.id}  task {item.task_id or '-'}  reward {item.reward:g}  "
                  f"{'successful' if item.success else 'not successful'}", highlight=False)
    src = f"{info['source_file']}:{info['source_line']}" if info["source_line"] else info["source_file"]
    console.print(f"from {src}  added {info['created_at']}  meta {json.dumps(item.meta)}", highlight=False, markup=False)
    console.print(f"instruction: {item.instruction}\n", highlight=False, markup=False)
    console.print(render_transcript(item.messages), highlight=False, markup=False)


@bank_app.command("export")
def export(
    file: Annotated[str, typer.Argument(help="Output JSONL ('-' for stdout).")],
    success_only: Annotated[bool, typer.Option("--success-only", help="Only successful rollouts.")] = False,
    recipe: RecipeOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Write the bank as JSONL that `lopd bank add-rollouts` reads back unchanged."""
    _, _, _, bank = _open_bank(project, recipe)
    n = 0
    with bank:
        if file == "-":
            for item in bank.iter_items(success_only):
                sys.stdout.write(json.dumps(item.to_record(), ensure_ascii=False) + "\n")
                n += 1
            return
        out = Path(file)
        tmp = out.with_name(out.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for item in bank.iter_items(success_only):
                f.write(json.dumps(item.to_record(), ensure_ascii=False) + "\n")
                n += 1
        os.replace(tmp, out)
    if as_json:
        print_json(dict(file=str(out), rollouts=n))
    else:
        console.print(f"exported {n} rollouts to {out}", highlight=False)


@bank_app.command("rm")
def rm(
    ids: Annotated[list[int], typer.Argument(help="Row ids to remove.")],
    recipe: RecipeOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Remove rollouts from the bank and from the index."""
    from lopd_cli.bank.index import remove_from_index

    proj, rec, _, bank = _open_bank(project, recipe)
    with bank:
        missing = sorted(set(ids) - set(bank.get_many(ids)))
        if missing:
            raise LopdError(f"{bank.path}: no rollout with id {', '.join(map(str, missing))} (nothing removed)")
        removed = bank.remove(ids)
    unindexed = remove_from_index(proj.index_dir(rec), removed)
    if as_json:
        print_json(dict(removed=removed, removed_from_index=unindexed))
    else:
        console.print(f"removed {len(removed)} rollouts ({unindexed} from the index)", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(bank_app, name="bank")
