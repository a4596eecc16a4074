"""Shared test settings: offline, torch start-up settings."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lopd_cli.runtime import setup_torch  # noqa: E402

setup_torch()
