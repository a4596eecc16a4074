"""The student's trainable parameters, the gradients' sum over ranks and their norm clipping,
shared by the loop's LOPD/GRPO/OPSD step (loop.py) and the SFT step (sft.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lopd_cli.models import adapters as ad
from lopd_cli.train import distributed as dist
from lopd_cli.train import sharding

if TYPE_CHECKING:
    from lopd_cli.train.trainer import Trainer


def adamw(params: list, **kwargs) -> torch.optim.AdamW:
    """AdamW, fused into one kernel per step where every parameter sits on a CUDA device (the CPU
    keeps the default multi-tensor path, whose numbers the behaviour pin holds)."""
    flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = bool(flat) and all(p.device.type == "cuda" for p in flat)
    return torch.optim.AdamW(params, fused=True if fused else None, **kwargs)


def _student_params(model) -> list[torch.nn.Parameter]:
    name = ad.STUDENT if ad.has_student_adapter(model) else ad.BASE
    return ad.adapter_parameters(model, name)


def _grad_norm(params: list[torch.nn.Parameter], clip: float) -> float:
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    if sharding.uses_dtensors(params):
        return sharding.clip_grad_norm(params, clip)
    return float(torch.nn.utils.clip_grad_norm_(params, clip))


def _sum_gradients(tr: Trainer, params: list[torch.nn.Parameter]) -> None:
    """The gradients summed over ranks: FSDP's reduce-scatter for a sharded backbone (whose
    parameters are then the shards: read them again), an all-reduce otherwise."""
    if tr.sharding is not None:
        sharding.sum_gradients(tr.sharding, params)
    else:
        dist.sum_gradients(params)
