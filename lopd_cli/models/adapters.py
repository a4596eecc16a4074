"""One backbone, several views: the student adapter, the composer's encoder adapter, the teacher.

The backbone is wrapped once with peft. It holds up to two LoRA adapters that share the base
weights:

    "student"   recipe `model.lora` (absent when `model.student == "full"`: the base is the student)
    "encoder"   recipe `composer.encoder_lora`: ψ, the composer's encoder

Views (context managers; each restores what was active before):

    use_student(model)    the student's forward (student adapter, or the bare base when full FT)
    use_encoder(model)    the composer encoder's forward
    teacher_view(model)   every adapter skipped: the frozen backbone θ̄ (adapter layers disabled)

Which parameters receive gradients is set separately and explicitly with `set_trainable`: peft's
`set_adapter` flips `requires_grad` as a side effect, so the views save and restore those flags
and switching views never changes what an optimizer trains. The views switch the tuner layers
(`model.base_model`), not the PeftModel: from peft 0.22 `PeftModel.set_adapter` and
`disable_adapter()` reshard every FSDP2 unit, which would undo the whole roots a sharded step
gathers (train/sharding.py). Nothing is ever merged into the base in place; exporting merges a copy.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from lopd_cli.errors import LopdError

if TYPE_CHECKING:
    import torch

STUDENT = "student"
ENCODER = "encoder"
BASE = "base"  # pseudo-name for the backbone's own weights in set_trainable

_ADAPTER_PARAM = re.compile(r"\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\.([^.]+)(?:\.|$)")


def peft_lora_config(cfg):
    """A recipe `LoraConfig` section → peft's LoraConfig."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach_adapters(model, recipe):
    """Wrap `model` once with peft: a "student" adapter (unless `model.student == "full"`) and an
    "encoder" adapter. Afterwards only the adapters the recipe trains have gradients: the student
    adapter (or the base, for full fine-tuning) and the encoder adapter."""
    from peft import get_peft_model

    if is_wrapped(model):
        raise LopdError("the backbone already carries adapters: attach them once per loaded model")
    full = recipe.model.student == "full"
    first = ENCODER if full else STUDENT
    first_cfg = recipe.composer.encoder_lora if full else recipe.model.lora
    peft_model = get_peft_model(model, peft_lora_config(first_cfg), adapter_name=first)
    if not full:
        peft_model.add_adapter(ENCODER, peft_lora_config(recipe.composer.encoder_lora))
        _set_active(peft_model, STUDENT)
    peft_model.lopd_full_student = full
    set_trainable(peft_model, [BASE if full else STUDENT, ENCODER])
    return peft_model


def is_wrapped(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def adapter_names(model) -> list[str]:
    return list(getattr(model, "peft_config", {}).keys())


def has_student_adapter(model) -> bool:
    return STUDENT in adapter_names(model)


def adapter_of(param_name: str) -> str:
    """The adapter a parameter belongs to (by peft's naming), or BASE."""
    m = _ADAPTER_PARAM.search(param_name)
    return m.group(1) if m else BASE


def adapter_parameters(model, name: str) -> list:
    """The parameters of one adapter (or of the base with name=BASE), whatever their grad flag."""
    return [p for n, p in model.named_parameters() if adapter_of(n) == name]


def set_trainable(model, names: list[str] | tuple[str, ...]) -> None:
    """Give gradients to exactly these adapters (and to the base weights if BASE is named)."""
    known = set(adapter_names(model)) | {BASE}
    for n in names:
        if n not in known:
            raise LopdError(f"no adapter named '{n}' on this backbone (has: {', '.join(sorted(known))})")
    for n, p in model.named_parameters():
        p.requires_grad_(adapter_of(n) in names)


@contextmanager
def _keep_grad_flags(model) -> Iterator:
    """peft's set_adapter / disable_adapter / enable_adapter_layers rewrite requires_grad."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _set_active(model, name: str) -> None:
    """Activate one adapter without peft's side effect on requires_grad."""
    with _keep_grad_flags(model):
        model.base_model.set_adapter(name)
    model.active_adapter = name


def _layers_enabled(model) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) and not m.disable_adapters for m in model.modules())


@contextmanager
def _adapters_disabled(model) -> Iterator:
    """Every adapter layer skipped; re-enabled on exit unless they were already disabled (nested)."""
    enabled = _layers_enabled(model)
    with _keep_grad_flags(model):
        model.base_model.disable_adapter_layers()
        try:
            yield model
        finally:
            if enabled:
                model.base_model.enable_adapter_layers()


@contextmanager
def _active(model, name: str) -> Iterator:
    previous = model.active_adapter
    _set_active(model, name)
    try:
        yield model
    finally:
        _set_active(model, previous)


@contextmanager
def teacher_view(model) -> Iterator:
    """The frozen backbone: all adapters skipped for the duration (no copy, no merge). A model
    without adapters (a full student's frozen teacher copy) is already that."""
    if not is_wrapped(model):
        yield model
        return
    with _adapters_disabled(model):
        yield model


@contextmanager
def use_encoder(model, name: str = ENCODER) -> Iterator:
    """The composer encoder ψ: backbone + "encoder" adapter (or another encoder-type adapter,
    e.g. a frozen copy of the cold-start encoder loaded under its own name)."""
    with _active(model, name):
        yield model


@contextmanager
def use_student(model) -> Iterator:
    """The student: backbone + "student" adapter, or the bare (trainable) base for full FT."""
    if has_student_adapter(model):
        with _active(model, STUDENT):
            yield model
    else:
        with _adapters_disabled(model):
            yield model


def save_adapter(model, name: str, out_dir: Path, state_dict: dict | None = None) -> Path:
    """One adapter in standard peft format (adapter_config.json + adapter_model.safetensors),
    loadable by `PeftModel.from_pretrained(base, out_dir)`. `state_dict`: the model's weights
    under its own parameter names when the model's are sharded (train/sharding.py)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    if name not in adapter_names(model):
        raise LopdError(f"no adapter named '{name}' to save")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=name)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(out_dir / "adapter_model.safetensors"))
    model.peft_config[name].save_pretrained(str(out_dir))
    return out_dir


def whole_adapter_state(model, name: str) -> dict[str, torch.Tensor]:
    """One adapter's weights under the model's parameter names, each whole: a sharded one (FSDP2
    DTensor) is gathered on every rank, one parameter at a time, so under FSDP every rank must
    call this together. Only the adapter travels, never the backbone."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        if adapter_of(n) == name:
            weight = p.detach()
            out[n] = weight.full_tensor() if isinstance(weight, DTensor) else weight
    return out


def base_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The backbone's own weights (a full student's; every adapter left out) under the names
    `from_pretrained` reads: without peft's `base_model.model.` prefix and without the
    `.base_layer.` of a LoRA-wrapped layer. Tied weights come once. A sharded weight (FSDP2
    DTensor) is gathered whole, so under FSDP every rank must iterate together."""
    from torch.distributed.tensor import DTensor

    base = model.get_base_model() if is_wrapped(model) else model
    for name, p in base.named_parameters():
        if adapter_of(name) != BASE:
            continue
        weight = p.detach()
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
        yield name.replace(".base_layer.", "."), weight


def add_frozen_adapter(model, name: str, src_dir: Path) -> None:
    """Load a saved adapter under a new name, without gradients and without changing the active
    adapter or anyone's requires_grad."""
    if name in adapter_names(model):
        raise LopdError(f"adapter '{name}' already exists on this backbone")
    with _keep_grad_flags(model):
        model.load_adapter(str(src_dir), adapter_name=name, is_trainable=False)
    for p in adapter_parameters(model, name):
        p.requires_grad_(False)


def load_adapter_weights(model, name: str, src_dir: Path) -> None:
    """Load saved weights into the existing adapter `name`; its rank/alpha/targets must match."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    src_dir = Path(src_dir)
    cfg_file, weights = src_dir / "adapter_config.json", src_dir / "adapter_model.safetensors"
    if not weights.is_file() or not cfg_file.is_file():
        raise LopdError(f"{src_dir}: not a saved adapter (adapter_config.json + adapter_model.safetensors)")
    if name not in adapter_names(model):
        raise LopdError(f"no adapter named '{name}' on this backbone to load {src_dir} into")
    saved = json.loads(cfg_file.read_text())
    live = model.peft_config[name]
    for key in ("r", "lora_alpha"):
        if saved.get(key) != getattr(live, key):
            raise LopdError(
                f"{cfg_file}: adapter '{name}' has {key}={saved.get(key)} but the recipe gives {getattr(live, key)}"
            )
    result = set_peft_model_state_dict(model, load_file(str(weights)), adapter_name=name)
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if missing:
        raise LopdError(f"{weights}: {len(missing)} tensors do not fit this backbone (e.g. {missing[0]})")
