"""The uniform schedule of a per-layer sharded step (`train.parallel: fsdp`, `train.fsdp_gather: layer`).

Under per-layer FSDP2 every forward through the backbone all-gathers each decoder layer and every
backward all-gathers it again and reduce-scatters its gradients, so every rank must run the same
sequence of passes, whatever its rollouts hold. While `on()` holds, the step's loops ask `count(n)`
how many micro-batches (encoder chunks, cache fills) to run: the largest `n` over the ranks. A rank
with fewer runs filler passes (`padded`: the item marked not real) whose losses weigh 0, so no rank
skips a collective because of its data. Outside a sharded step `count(n)` is `n` and nothing runs
that one process would not run.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from lopd_cli.train import distributed as dist

T = TypeVar("T")

_active = False


@contextmanager
def on(enabled: bool = True) -> Iterator[None]:
    """The uniform schedule for the duration (every rank must enter it together)."""
    global _active
    before, _active = _active, enabled and dist.is_distributed()
    try:
        yield
    finally:
        _active = before


def active() -> bool:
    return _active


def count(n: int) -> int:
    """How many passes of a kind this rank runs: `n`, or the largest `n` over ranks under the schedule."""
    if not _active:
        return n
    return int(dist.all_reduce_max({"n": float(n)})["n"])


def padded(items: list[T], filler: Callable[[], T]) -> list[tuple[T, bool]]:
    """`items` as (item, True), then (filler, False) up to `count(len(items))`. The filler is the
    first item when there is one (a pass of the same shape), else `filler()`."""
    n = count(len(items))
    out = [(x, True) for x in items]
    if n > len(items):
        f = items[0] if items else filler()
        out += [(f, False)] * (n - len(items))
    return out
