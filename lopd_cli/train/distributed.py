"""Data-parallel training on PyTorch's own distributed stack (torchrun / accelerate launch).

`lopd train` reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and joins a `torch.distributed` process group: NCCL when CUDA is available (each
process on `cuda:LOCAL_RANK`), else gloo. Without those variables (or WORLD_SIZE=1) every
function here is the identity and nothing is initialised.

How a step is split (train/loop.py):
    * every rank draws the SAME global task list (same sampler, same seed) and rolls out its
      contiguous shard (`shard_range`); the runner seeds each batch chunk by its position in
      the global batch, so the rollouts are those one process would sample when the shard is a
      multiple of `rollout.batch_size`;
    * the episodes are gathered (`gather_lists`) so that rollout metrics, the failure guard,
      the budget counter and bank growth see the whole batch on every rank;
    * each rank computes its loss parts with weights relative to the GLOBAL counts (sequences,
      tokens, tasks), so the SUM over ranks of the gradients is the full-batch gradient;
      `sum_gradients` all-reduces them before clipping; loss metrics are summed likewise;
    * β is updated from the reduced Δ, so it is identical everywhere; rank 0 alone writes
      metrics.jsonl, checkpoints, bank rows and the index (`on_main` runs a job there and hands
      its result, or its error, to every rank).

Why explicit `all_reduce` of `.grad` rather than `DistributedDataParallel`: one step does two
backward passes per micro-batch into different parameter sets (the student adapter, then the
composer's encoder adapter and resampler) of ONE peft model with several adapters, and which
parameters receive gradients changes with the phase and the algorithm. DDP's reducer expects one
backward per forward over a fixed set of used parameters (`find_unused_parameters`, `no_sync`
juggling); summing the gradients once after all backward passes is the same arithmetic with one
collective per step and no wrapper around the model.

`train.parallel: fsdp` shards the backbone instead (PyTorch FSDP2, train/sharding.py): the split
of a step above is the same, FSDP's reduce-scatter sums the backbone's gradients into each rank's
shard, and `sum_gradients` here is left with χ (the composer's resampler, replicated).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from lopd_cli.errors import LopdError

T = TypeVar("T")

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_world_size() -> int:
    """WORLD_SIZE set by torchrun / accelerate (1 when launched as a plain process)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise LopdError(f"WORLD_SIZE='{os.environ['WORLD_SIZE']}' is not a number") from None


def init_from_env() -> bool:
    """Join the process group the launcher describes (idempotent). Returns whether training is
    distributed (world size > 1)."""
    if is_distributed():
        return True
    if launched_world_size() <= 1:
        return False
    missing = [v for v in ENV_VARS if v not in os.environ]
    if missing:
        raise LopdError(f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but {', '.join(missing)} not set: "
                        "launch with torchrun or accelerate launch")
    backend = "gloo"
    if torch.cuda.is_available():
        local = int(os.environ["LOCAL_RANK"])
        if local >= torch.cuda.device_count():
            raise LopdError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA device(s) on this node")
        torch.cuda.set_device(local)  # model.device "auto"/"cuda" then means this rank's GPU
        backend = "nccl"
    dist.init_process_group(backend=backend)
    atexit.register(_shutdown)
    return True


def _shutdown() -> None:
    # A colocated vLLM engine built its groups inside ours: it goes first.
    vllm_backend = sys.modules.get("lopd_cli.rollout.vllm")
    if vllm_backend is not None:
        vllm_backend.shutdown_engines()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def _device() -> torch.device:
    """Where collective buffers live: the rank's GPU under NCCL, the CPU under gloo."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------- sharding


def shard_range(n: int, rank_: int | None = None, world: int | None = None) -> tuple[int, int]:
    """[lo, hi) of this rank's contiguous share of n items (sizes differ by at most one)."""
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    base, extra = divmod(n, w)
    lo = r * base + min(r, extra)
    return lo, lo + base + (1 if r < extra else 0)


def shard(items: Sequence[T]) -> list[T]:
    lo, hi = shard_range(len(items))
    return list(items[lo:hi])


def check_step_split(rollouts_per_step: int, group_size: int | None = None) -> None:
    """Every rank must get an equal share, and GRPO groups must not straddle two ranks."""
    w = world_size()
    if w == 1:
        return
    if rollouts_per_step % w:
        raise LopdError(f"rollout.rollouts_per_step ({rollouts_per_step}) must be a multiple of the world size ({w})")
    if group_size and (rollouts_per_step // w) % group_size:
        raise LopdError(f"rollout.rollouts_per_step / world size ({rollouts_per_step // w}) must be a multiple of "
                        f"the group size ({group_size}, train.grpo / train.sdpo) so that each group stays on one rank")


# ----------------------------------------------------------------------------- collectives


def gather_lists(local: list[T]) -> list[T]:
    """Every rank's list, concatenated in rank order (= global order for contiguous shards)."""
    if not is_distributed():
        return list(local)
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, list(local))
    return [x for part in parts for x in part]


def broadcast_object(obj: T) -> T:
    """Rank 0's `obj` on every rank."""
    if not is_distributed():
        return obj
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_main(fn: Callable[[], T]) -> T:
    """Run fn on rank 0 only; every rank gets its result, or raises its error (a LopdError with
    the same message), so the others never wait for a rank that failed."""
    if not is_distributed():
        return fn()
    result: tuple[str, Any] = ("ok", None)
    if is_main():
        try:
            result = ("ok", fn())
        except LopdError as e:
            result = ("error", str(e))
        except Exception as e:  # noqa: BLE001 - re-raised below on rank 0, reported on the others
            result = ("crash", f"rank 0 failed: {e.__class__.__name__}: {e}")
            broadcast_object(result)
            raise
    status, value = broadcast_object(result)
    if status != "ok":
        raise LopdError(value)
    return value


def _numeric(values: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool))


def _reduce(values: dict[str, Any], op) -> dict[str, Any]:
    keys = _numeric(values)
    if not is_distributed() or not keys:
        return dict(values)
    buf = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_device())
    dist.all_reduce(buf, op=op)
    out = dict(values)
    out.update({k: float(v) for k, v in zip(keys, buf.tolist())})
    return out


def all_reduce_sum(values: dict[str, Any]) -> dict[str, Any]:
    """Sum of each numeric entry over ranks (non-numeric entries are kept as they are). Every
    rank must pass the same keys."""
    return _reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values: dict[str, Any]) -> dict[str, Any]:
    return _reduce(values, dist.ReduceOp.MAX)


def all_reduce_mean(values: dict[str, Any], weight: float) -> dict[str, Any]:
    """Weighted mean over ranks: Σ_r w_r·v_r / Σ_r w_r (e.g. a per-episode mean weighted by the
    rank's episode count, a per-token mean by its token count)."""
    if not is_distributed():
        return dict(values)
    keys = _numeric(values)
    summed = all_reduce_sum({**{k: float(values[k]) * weight for k in keys}, "__weight__": float(weight)})
    total = summed.pop("__weight__")
    out = dict(values)
    out.update({k: summed[k] / total if total else 0.0 for k in keys})
    return out


def sum_gradients(params: Sequence[torch.nn.Parameter], bucket_numel: int = 2**24) -> None:
    """All-reduce SUM of `.grad` over ranks, in place. A parameter that got a gradient on some
    rank only gets zeros on the others first; one that got none anywhere keeps `grad = None`
    (so the optimiser skips it, as it would in one process)."""
    if not is_distributed() or not params:
        return
    dev = _device()
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dev)
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    live = [p for p, has in zip(params, present.tolist()) if has]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for dtype in sorted({p.grad.dtype for p in live}, key=str):
        group = [p for p in live if p.grad.dtype == dtype]
        start = 0
        while start < len(group):
            bucket, numel = [], 0
            while start < len(group) and (not bucket or numel + group[start].numel() <= bucket_numel):
                bucket.append(group[start])
                numel += group[start].numel()
                start += 1
            flat = torch.cat([p.grad.reshape(-1) for p in bucket]).to(dev)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset: offset + n].view_as(p.grad))
                offset += n


@torch.no_grad()
def broadcast_parameters(params: Sequence[torch.Tensor]) -> None:
    """Rank 0's values of `params` on every rank (what DDP does at construction)."""
    if not is_distributed():
        return
    dev = _device()
    for p in params:
        buf = p.data.to(dev)
        dist.broadcast(buf, src=0)
        if buf.data_ptr() != p.data.data_ptr():
            p.data.copy_(buf)
