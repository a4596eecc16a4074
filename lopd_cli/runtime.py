"""Process-wide torch settings applied once at start-up."""

from __future__ import annotations

import os

_DONE = False


def setup_torch() -> None:
    """Flush denormals (CPU steps are ~20x slower without it) and size the thread pool.

    Threads follow the machine unless the user set OMP_NUM_THREADS / LOPD_THREADS.
    """
    global _DONE
    if _DONE:
        return
    import torch

    torch.set_flush_denormal(True)
    threads = os.environ.get("LOPD_THREADS") or os.environ.get("OMP_NUM_THREADS")
    n = int(threads) if threads else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, n))
    _DONE = True
