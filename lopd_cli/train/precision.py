"""Mixed precision: the compute dtype of the training passes.

`model.autocast_bf16` chooses it: "auto" (the default) runs the forward and backward passes
under bf16 autocast where the device has fast bf16 (a CUDA device that supports it) and in fp32
everywhere else, the CPU included (most CPUs have no fast bf16 matmul; `runtime.cpu_has_fast_bf16`
and benchmarks/bf16_cpu.py); true or false force it. Whatever the compute dtype:

- master weights, gradients and optimiser states stay in `model.dtype` (float32 by default);
- the reductions are fp32: every log-softmax, top-M + tail, KL and loss in train/losses.py casts
  the logits to float32 before it reduces, and χ's attention scores are float32.

Resolved once per run from the device the model sits on; on a CPU "auto" is exactly false.
"""

from __future__ import annotations

from typing import Literal

AutocastSetting = bool | Literal["auto"]


def device_has_fast_bf16(device: str) -> bool:
    """Whether "auto" turns bf16 on for `device` ("cpu", "cuda", "cuda:1", ...): a CUDA device
    that supports bf16 (Ampere or newer). CPUs never: see the module docstring."""
    if not device.startswith("cuda"):
        return False
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def resolve_autocast(setting: AutocastSetting, device: str, fast_bf16: bool | None = None) -> bool:
    """`model.autocast_bf16` on `device` → whether the passes run under bf16 autocast.
    `fast_bf16`: what `device_has_fast_bf16(device)` would say (given, for tests)."""
    if setting == "auto":
        return device_has_fast_bf16(device) if fast_bf16 is None else bool(fast_bf16)
    return bool(setting)


def model_device(model) -> str:
    return str(next(model.parameters()).device)

