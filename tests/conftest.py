"""Shared test settings: offline, torch start-up settings."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lopd_cli.runtime import setup_torch  # noqa: E402

setup_torch()


import pytest  # noqa: E402


class CliResult:
    def __init__(self, code: int, out: str, err: str):
        self.code, self.out, self.err = code, out, err

    def __repr__(self) -> str:
        return f"CliResult(code={self.code}, out={self.out[-500:]!r}, err={self.err[-500:]!r})"


@pytest.fixture
def lopd(capsys, monkeypatch):
    """Run the CLI in-process: lopd("init", "p", cwd=tmp_path) -> CliResult(code, out, err)."""
    from lopd_cli.cli.main import run

    def call(*args: str, cwd: Path | None = None) -> CliResult:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            run([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return call
