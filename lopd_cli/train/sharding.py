"""Sharded training (`train.parallel: fsdp`): the backbone under PyTorch FSDP2 (`fully_shard`).

What is sharded: each decoder layer of the student's transformer is an FSDP unit, and the
transformer itself (embeddings, final norm, LM head: tied weights stay in one unit) is the root.
That covers every parameter of the peft-wrapped backbone: the frozen base, the "student" LoRA
adapter (or, for a full student, the base itself), the composer's encoder adapter ψ and the
frozen "encoder0". A full student's frozen teacher copy (`train.teacher`: base or init) is
sharded the same way as a second root. χ (the composer's resampler) is a small separate module:
it stays replicated and its gradients are all-reduced as in data parallel
(`distributed.sum_gradients`). Between steps every rank holds 1/world of the weights, of their
gradients and of the optimiser states (AdamW's two moments: twice the trainable weights in fp32).

How a step runs (`stepping`, `train.fsdp_gather`):
    * layer (default, `per_layer`): each decoder layer is all-gathered for its own forward and
      resharded after it, gathered again for its backward, and its gradients are reduce-scattered
      into the shards as that backward ends (ZeRO-3), so a rank holds one layer's whole weights
      and gradients at a time beside its shards. The root unit (embeddings, final norm, LM head:
      lopd reads the head directly, outside the root's forward) stays whole for the update and
      its gradients are reduce-scattered once at the end (`sum_gradients`). Because every pass
      is now collective, a LOPD step, which differs between ranks (rollouts of different lengths,
      the composer pass on some rows only, encoder passes skipped for cached latents), runs on
      the uniform schedule of train/lockstep.py: the same number of micro-batches, encoder
      chunks and cache fills on every rank, filler passes weighing 0 where a rank has fewer;
    * step (`gathered`): each FSDP unit is all-gathered once at the start of a step and stays
      whole until the gradients are reduced; backward passes accumulate local, unsharded
      gradients and `sum_gradients` reduce-scatters them once per unit. The forwards and
      backwards are then collective-free; a rank holds the whole weights and the whole gradients
      of what trains during a step, and sharding saves the optimiser states.
Rollouts and validation (HF generate: a different number of forwards on each rank) run with the
student's units gathered whole (`gathered`), as inference needs them anyway.

Checkpoints (`save_optimizers`, `load_optimizers`): the student and the composer are written
whole by rank 0 in their usual formats (`full_state_dict`: each weight that training changes
gathered with `DTensor.full_tensor()`), so `lopd export`, `lopd eval` and `train.init_from` read
an FSDP checkpoint like any other; the optimiser states are written sharded with
`torch.distributed.checkpoint` (DCP) by every rank into `step_N/sharded/` (`__R_0.distcp` files
and a `.metadata`, keyed by parameter name) and loaded back into the same world size.
"""

from __future__ import annotations

import math
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

from lopd_cli.errors import LopdError
from lopd_cli.train import distributed as dist

SHARDED_DIR = "sharded"  # step_N/sharded/: the DCP folder of the optimiser states


@dataclass
class Sharding:
    """The FSDP units of one trainer: the student's (trainable) and the teacher copy's."""

    model: Any  # the peft-wrapped student backbone
    student_units: list = field(default_factory=list)  # FSDPModule, root last
    teacher_units: list = field(default_factory=list)
    whole: bool = False  # inside `gathered`: every unit is whole

    @property
    def units(self) -> list:
        return self.student_units + self.teacher_units

    @property
    def roots(self) -> list:
        return [u[-1] for u in (self.student_units, self.teacher_units) if u]


def _rng_kept(device: torch.device):
    """The RNG states as they were afterwards (the dummy passes here must not shift sampling)."""
    return torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else [])


def decoder_layers(causal_lm: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a causal LM (`model.layers` in Llama-style models)."""
    from lopd_cli.compose.composer import decoder_of

    layers = getattr(decoder_of(causal_lm), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise LopdError(f"{type(causal_lm).__name__}: no decoder layers (model.layers) to shard with train.parallel=fsdp")
    return layers


def shard_module(causal_lm: nn.Module, mesh) -> list:
    """fully_shard each decoder layer, then the causal LM as the root. Gradients are reduced by
    SUM (the losses carry the global weights), and one forward through the root fixes it as the
    root (FSDP2 takes the first module forwarded; lopd also calls the decoder body directly)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in decoder_layers(causal_lm):
        fully_shard(layer, mesh=mesh)
    fully_shard(causal_lm, mesh=mesh)
    units = [m for m in causal_lm.modules() if isinstance(m, FSDPModule) and m is not causal_lm] + [causal_lm]
    for m in units:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    device = next(causal_lm.parameters()).device
    with torch.no_grad(), _rng_kept(device):
        causal_lm(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    for m in units:
        m.reshard()
    return units


def shard_trainer(tr) -> Sharding:
    """Shard the trainer's backbone (and teacher copy) in place and point its optimisers at the
    sharded parameters. Call after every weight is loaded (warm start, checkpoint) and made equal
    on every rank, before the first step; optimiser states are loaded after (`load_optimizers`)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_distributed():
        raise LopdError("train.parallel=fsdp needs a distributed launch (torchrun); this is one process")
    device = next(tr.model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.world_size(),))
    names = {id(p): n for n, p in tr.model.named_parameters()}
    sh = Sharding(model=tr.model, student_units=shard_module(tr.model.get_base_model(), mesh))
    if getattr(tr, "teacher", None) is not None:
        sh.teacher_units = shard_module(tr.teacher, mesh)
    sharded = dict(tr.model.named_parameters())
    for opt in (tr.student_opt, tr.composer_opt):
        if opt is None:
            continue
        if opt.state:
            raise LopdError("shard_trainer: an optimiser already holds state (shard before loading or stepping)")
        for group in opt.param_groups:
            group["params"] = [sharded[names[id(p)]] if id(p) in names else p for p in group["params"]]
    return sh


@contextmanager
def gathered(sh: Sharding | None, teacher: bool = True) -> Iterator[None]:
    """Every unit whole for the duration (one all-gather each, in the same order on every rank),
    with backward passes accumulating local gradients; resharded on exit. `teacher` False leaves
    a teacher copy sharded (rollouts and validation do not read it). No-op without FSDP, or
    inside another `gathered`."""
    if sh is None or sh.whole:
        yield
        return
    units = sh.units if teacher else sh.student_units
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
        m.set_requires_gradient_sync(False, recurse=False)
    for m in units:
        m.unshard()
    sh.whole = True
    try:
        yield
    finally:
        sh.whole = False
        for m in units:
            m.reshard()


@contextmanager
def per_layer(sh: Sharding | None) -> Iterator[None]:
    """An update with each decoder layer gathered for its own forward and backward and its
    gradients reduce-scattered as its backward ends; the roots whole for the duration (their
    gradients reduced by `sum_gradients`). Runs the step's loops on the uniform schedule. No-op
    without FSDP, or inside `gathered`."""
    from lopd_cli.train import lockstep

    if sh is None or sh.whole:
        yield
        return
    roots = sh.roots
    for m in sh.units:
        layer = not any(m is r for r in roots)
        m.set_reshard_after_forward(layer, recurse=False)
        m.set_reshard_after_backward(layer, recurse=False)
        m.set_requires_gradient_sync(layer, recurse=False)
    for m in sh.student_units:
        m.set_reduce_scatter_unused_params(True, recurse=False)
    for m in roots:
        m.unshard()
    try:
        with lockstep.on():
            yield
    finally:
        for m in sh.units:
            m.reshard()


def stepping(sh: Sharding | None, mode: str):
    """The update's context under `train.fsdp_gather` (`layer`: `per_layer`; `step`: `gathered`)."""
    return per_layer(sh) if mode == "layer" else gathered(sh)


def autograd_leaves(sh: Sharding | None, params: Sequence[torch.nn.Parameter]) -> list:
    """What `backward(inputs=...)` must name for `params`: under FSDP2 a forward runs on each
    parameter's unsharded twin (the graph's leaf), not on the sharded parameter the module holds
    between passes (FSDP2 keeps the twin as `FSDPParam._unsharded_param`; no public accessor)."""
    if sh is None:
        return list(params)
    twins = {}
    for unit in sh.student_units:
        group = unit._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group is not None else []:
            twins[id(fp.sharded_param)] = fp
    out = []
    for p in params:
        fp = twins.get(id(p))
        if fp is None or not hasattr(fp, "_unsharded_param"):
            out.append(p)
            continue
        # peft's adapter switches flip requires_grad on the parameters a module holds at that moment;
        # a twin unsharded inside such a switch keeps the flipped flag until its next all-gather
        fp._unsharded_param.requires_grad_(p.requires_grad)
        out.append(fp._unsharded_param)
    return out


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def sum_gradients(sh: Sharding, params: Sequence[torch.nn.Parameter]) -> None:
    """The step's gradient sum over ranks: FSDP reduce-scatters the backbone's accumulated
    gradients into the shards (one summing reduce-scatter per unit, zeros for a trainable
    parameter that got none on a rank) and reshards the student; the other `params` (χ) are
    all-reduced. Afterwards the backbone's parameters are the sharded ones: read them again."""
    from lopd_cli.models import adapters as ad

    managed = {id(p) for p in sh.model.parameters()}
    rest = [p for p in params if id(p) not in managed and not _is_dtensor(p)]
    for m in sh.student_units:
        m.set_requires_gradient_sync(True, recurse=False)
        m.set_reduce_scatter_unused_params(True, recurse=False)
    try:
        # A zero-gradient backward through the root makes FSDP run its post-backward reduction on
        # every unit (the root's final callback covers units this graph does not reach).
        root = sh.student_units[-1]
        device = next(root.parameters()).device
        with torch.enable_grad(), ad.use_student(sh.model), _rng_kept(device):
            logits = root(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device)).logits
        if not logits.requires_grad:
            raise LopdError("train.parallel=fsdp: the student has no trainable weights to reduce")
        logits.backward(torch.zeros_like(logits))
    finally:
        for m in sh.student_units:
            m.set_requires_gradient_sync(False, recurse=False)
            m.reshard()
    dist.sum_gradients(rest)


def grad_norm(params: Sequence[torch.nn.Parameter]) -> float:
    """The global L2 norm of the gradients of `params`, sharded (DTensor) or not."""
    sharded = [p.grad for p in params if p.grad is not None and _is_dtensor(p.grad)]
    plain = [p.grad for p in params if p.grad is not None and not _is_dtensor(p.grad)]
    sq = 0.0
    if sharded:
        n = torch.nn.utils.get_total_norm(sharded)
        sq += float(n.full_tensor() if _is_dtensor(n) else n) ** 2
    if plain:
        sq += float(torch.nn.utils.get_total_norm(plain)) ** 2
    return math.sqrt(sq)


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """`clip_grad_norm_` over a mix of sharded and plain gradients; returns the norm before."""
    total = grad_norm(params)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return total


def uses_dtensors(params: Sequence[torch.nn.Parameter]) -> bool:
    return any(_is_dtensor(p) for p in params)


# ----------------------------------------------------------------------------- checkpoints


def full_state_dict(tr) -> dict[str, torch.Tensor]:
    """The student backbone's weights that training changes, gathered whole on rank 0 (CPU; {}
    on the others) under the peft model's parameter names: a LoRA student's adapters (the
    student's and the encoder's), or every weight of a full student. Collective: every rank
    calls it, one parameter at a time."""
    from lopd_cli.models import adapters as ad

    lora = ad.has_student_adapter(tr.model)
    out: dict[str, torch.Tensor] = {}
    for name, p in tr.model.named_parameters():
        if lora and ad.adapter_of(name) == ad.BASE:
            continue
        whole = p.detach().full_tensor() if _is_dtensor(p) else p.detach()
        if dist.is_main():
            out[name] = whole.cpu().clone()
    return out


def _holder(tr) -> nn.Module:
    """One module that names every optimised parameter: the backbone and the composer (χ)."""
    parts = {"backbone": tr.model}
    if tr.composer is not None:
        parts["composer"] = tr.composer
    return nn.ModuleDict(parts)


def _optimizers(tr) -> dict[str, torch.optim.Optimizer]:
    return {k: v for k, v in (("student_opt", tr.student_opt), ("composer_opt", tr.composer_opt)) if v is not None}


def save_optimizers(tr, out: Path) -> list[str]:
    """Every rank writes its shards of the optimiser states (those that have stepped) into the
    DCP folder `out` (replaced). Returns the optimisers saved. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = Path(out)
    if dist.is_main():
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    holder = _holder(tr)
    state = {name: get_optimizer_state_dict(holder, opt) for name, opt in _optimizers(tr).items() if opt.state}
    if state:
        dcp.save(state, checkpoint_id=str(out))
    dist.barrier()
    return sorted(state)


def load_optimizers(tr, folder: Path, names: Sequence[str]) -> None:
    """The optimiser states `names` from the DCP folder into the (sharded) trainer. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    opts = _optimizers(tr)
    missing = [n for n in names if n not in opts]
    if missing:
        raise LopdError(f"{folder}: holds optimiser state '{missing[0]}' this run does not have")
    if not names:
        return
    if not Path(folder).is_dir():
        raise LopdError(f"{folder}: the sharded optimiser states are missing (checkpoint written with train.parallel=fsdp)")
    holder = _holder(tr)
    state = {n: get_optimizer_state_dict(holder, opts[n]) for n in names}
    dcp.load(state, checkpoint_id=str(folder))
    for n in names:
        set_optimizer_state_dict(holder, opts[n], state[n])
