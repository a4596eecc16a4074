"""Entry point: `lopd …` and `python -m lopd_cli …`.

Errors a user can fix (LopdError) print as one line `error: …` and exit 1; `--debug` anywhere
on the command line shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

import typer
from typer.core import TyperGroup

from lopd_cli import __version__
from lopd_cli.errors import LopdError, LopdWarning

# `lopd --help` lists the commands in pipeline order, in these panels.
HELP_PANELS: dict[str, list[str]] = {
    "Project": ["init", "models", "recipe", "demo"],
    "Experience": ["rollout", "bank"],
    "Training": ["coldstart", "train", "evolve"],
    "Results": ["eval", "export", "report"],
}
HELP_ORDER = [name for names in HELP_PANELS.values() for name in names]


class PipelineOrder(TyperGroup):
    """Commands (and groups such as `bank`) in HELP_ORDER; anything unlisted goes last."""

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        rank = {n: i for i, n in enumerate(HELP_ORDER)}
        return sorted(names, key=lambda n: rank.get(n, len(rank)))


app = typer.Typer(
    name="lopd",
    help="Latent On-Policy Self-Distillation: make your agent better from its own experience.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=PipelineOrder,
)

# Each module defines register(app); HELP_PANELS sets the order in `lopd --help`.
COMMAND_MODULES = [
    "lopd_cli.cli.demo_cmds",
    "lopd_cli.cli.setup_cmds",
    "lopd_cli.cli.rollout_cmds",
    "lopd_cli.cli.bank_cmds",
    "lopd_cli.cli.eval_cmds",
    "lopd_cli.cli.export_cmds",
    "lopd_cli.cli.report_cmds",
    "lopd_cli.cli.coldstart_cmds",
    "lopd_cli.cli.train_cmds",
    "lopd_cli.cli.evolve_cmds",
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lopd {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    from lopd_cli.runtime import setup_torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup_torch()


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def _set_help_panels(typer_app: typer.Typer) -> None:
    panel_of = {name: panel for panel, names in HELP_PANELS.items() for name in names}
    for info in list(typer_app.registered_commands) + list(typer_app.registered_groups):
        name = info.name or (info.callback.__name__.replace("_", "-") if info.callback else None)
        if name is None and getattr(info, "typer_instance", None) is not None:
            name = info.typer_instance.info.name
        if name in panel_of:
            info.rich_help_panel = panel_of[name]


_set_help_panels(app)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, LopdWarning):
        typer.echo(f"warning: {message}", err=True)
    else:  # reached with --debug only (see _filter_warnings)
        (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


def _filter_warnings(debug: bool) -> None:
    """Libraries' warnings (transformers' FutureWarnings, ...) are ignored unless --debug;
    lopd's own always show. Called inside catch_warnings, so the filters end with the command."""
    if not debug:
        warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", category=LopdWarning)


def _command_label(argv: list[str]) -> str:
    words = [a for a in argv if not a.startswith("-")][:2]
    if words[:1] == ["bank"] or words[:1] == ["recipe"]:
        return "lopd " + " ".join(words)
    return "lopd " + (words[0] if words else "")


def run(argv: list[str] | None = None) -> None:
    from lopd_cli.progress import heartbeat
    from lopd_cli.runtime import quiet_libraries

    argv = list(sys.argv[1:] if argv is None else argv)
    warnings.showwarning = _show_warning
    debug = "--debug" in argv or os.environ.get("LOPD_DEBUG") == "1"
    quiet_libraries(debug)
    try:
        with warnings.catch_warnings(), heartbeat(_command_label(argv)):
            _filter_warnings(debug)
            app(args=argv, prog_name="lopd", standalone_mode=False)
    except LopdError as e:
        if debug:
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
    except (typer.Exit, SystemExit) as e:
        code = getattr(e, "exit_code", getattr(e, "code", 0))
        sys.exit(code or 0)
    except Exception as e:  # click usage errors and unexpected failures
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(1)
        if debug:
            raise
        typer.echo(f"error: {e.__class__.__name__}: {e} (run with --debug for the traceback)", err=True)
        sys.exit(1)
