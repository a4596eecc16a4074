"""The two rich consoles lopd prints to: results on stdout, messages and progress on stderr.

They live below cli/ so that progress displays (lopd_cli.progress) share the commands' stderr
console without importing the command layer."""

from rich.console import Console

console = Console()
err_console = Console(stderr=True)
