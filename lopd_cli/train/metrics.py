"""metrics.jsonl (one JSON object per step), optional TensorBoard, and peak-memory readings."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any


def peak_memory_mb() -> float:
    """Peak device memory on CUDA, else peak resident set size of this process."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):
        return _clean(v.item())
    return v


class MetricsLog:
    """Appends rows to runs/RUN/metrics.jsonl. On resume, rows after the resumed step are
    dropped first so the file reads as one uninterrupted run. `write=False` (torchrun ranks
    other than 0) touches nothing."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, resume_step: int | None = None,
                 write: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.write = write
        if not write:
            self._tb = None
            return
        if resume_step is not None and self.path.exists():
            kept = [l for l in self.path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= resume_step]
            self.path.write_text("".join(l + "\n" for l in kept))
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except ImportError:
                self._tb = None

    def log(self, row: dict[str, Any]) -> None:
        if not self.write:
            return
        row = {k: _clean(v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            step = row.get("step", 0)
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
