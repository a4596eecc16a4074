"""The `lopd` command line (typer + rich). Each module registers one group of commands."""
