"""The student's trainable parameters and their gradient-norm clipping, shared by the loop's
LOPD/GRPO/OPSD step (loop.py) and the SFT step (sft.py)."""

from __future__ import annotations

import torch

from lopd_cli.models import adapters as ad


def _student_params(model) -> list[torch.nn.Parameter]:
    name = ad.STUDENT if ad.has_student_adapter(model) else ad.BASE
    return ad.adapter_parameters(model, name)


def _grad_norm(params: list[torch.nn.Parameter], clip: float) -> float:
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    return float(torch.nn.utils.clip_grad_norm_(params, clip))
