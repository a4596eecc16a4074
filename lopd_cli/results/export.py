"""Export the student of a checkpoint: a plain transformers model, or its peft adapter.

`export_merged` loads the backbone fresh from disk, attaches the student adapter, records the
logits of that (backbone + adapter) model on a few chat prompts, merges the adapter into this
process's own copy of the backbone (peft's `merge_and_unload()` rewrites the base weights in
place, so it never runs on a backbone someone else holds), saves safetensors + config +
tokenizer (with its chat template) + generation config, reloads the folder from disk and checks
its logits against the recorded ones. A mismatch above `atol + rtol · max|logit|` (the
`torch.allclose` form; defaults 1e-4 and 1e-5) is an error and the folder is removed. The
relative term is there because float32 itself is not exact: on SmolLM2-135M (logits up to ~39)
backbone + adapter in float32 is 8e-5 away from the same model in float64, and the merged model
1.2e-4 from the unmerged one; a wrong merge is off by 1e-2 or more.

What is kept: the tokenizer and the embedding matrix exactly as the backbone had them during
training, including the `<|LATENT_PH|>` placeholder token. The student never emits or reads it
(it only marks where the teacher's latents go); it stays as an unused special token, because
removing its row would change the vocabulary size and a model served by vLLM needs config and
tokenizer to agree.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from lopd_cli.errors import LopdError
from lopd_cli.models.student import EXPORT_INFO_FILE, CheckpointInfo, adapter_dir, backbone_source, load_student

# Prompts for the logit check: a plain chat, a tool-call style request and a code request.
CHECK_CONVERSATIONS: list[list[dict]] = [
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello! Who are you?"}],
    [{"role": "user", "content": "Refund order 4821 for customer ada@example.com and tell me the total."}],
    [{"role": "user", "content": "Write a Python function add(a, b) that returns a + b."}],
]


@dataclass
class ExportResult:
    out: str
    mode: str  # "merged" | "adapter"
    checkpoint: str
    step: int
    algo: str
    backbone: str
    dtype: str
    max_abs_logit_diff: float | None = None
    max_abs_logit: float | None = None
    atol: float | None = None
    rtol: float | None = None
    tolerance: float | None = None  # atol + rtol * max_abs_logit
    prompts_checked: int = 0
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not force:
            raise LopdError(f"{out}: folder exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def check_inputs(tokenizer, conversations: Iterable[list[dict]] = CHECK_CONVERSATIONS) -> list:
    """Token id tensors (1 × L) of the check prompts, rendered with the chat template."""
    ids = []
    for conv in conversations:
        enc = tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids.append(enc["input_ids"])
    return ids


def prompt_logits(model, inputs: list) -> list:
    """Full-sequence logits (float32, CPU) for each prompt, one at a time (no padding)."""
    import torch

    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for ids in inputs:
            out.append(model(input_ids=ids.to(device)).logits.float().cpu())
    return out


def max_abs_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _verify_reloaded(out: Path, inputs: list, reference: list, device: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).to(device)
    reloaded.eval()
    diff = max_abs_diff(prompt_logits(reloaded, inputs), reference)
    del reloaded
    return diff


def _copy_backbone_generation_config(info: CheckpointInfo, out: Path, search_dirs: Iterable[Path]) -> None:
    """The backbone's generation defaults (stop ids, sampling) win over what the model object
    carried: a fully fine-tuned student is saved from a config-built model that lacks them."""
    from lopd_cli.models.backbone import resolve_backbone

    src = resolve_backbone(backbone_source(info), search_dirs)
    if isinstance(src, Path) and (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", out / "generation_config.json")


def export_merged(
    info: CheckpointInfo,
    out: Path,
    dtype: str = "float32",
    device: str = "cpu",
    atol: float = 1e-4,
    rtol: float = 1e-5,
    search_dirs: Iterable[Path] = (),
    force: bool = False,
) -> ExportResult:
    """Write a plain transformers directory holding backbone + student merged; verify it."""
    import torch

    from lopd_cli.progress import activity

    out = Path(out)
    _prepare_out(out, force)
    # Merge and check in float32; the saved weights are cast to `dtype` afterwards.
    with activity("loading backbone + student"):
        model, tokenizer = load_student(info, dtype="float32", device=device, search_dirs=search_dirs)
        inputs = check_inputs(tokenizer)
        reference = prompt_logits(model, inputs)
    with activity(f"merging and writing {out.name}"):
        if info.student == "lora":
            # `model` wraps the backbone this function just loaded from disk: merging rewrites that
            # private copy, never a backbone shared with a trainer.
            model = model.merge_and_unload()
        model = model.to(getattr(torch, dtype))
        model.config.dtype = dtype
        model.save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(str(out))
        _copy_backbone_generation_config(info, out, search_dirs)
        del model
    with activity("checking the exported logits"):
        diff = _verify_reloaded(out, inputs, reference, device)
    scale = max(float(x.abs().max()) for x in reference)
    tolerance = atol + rtol * scale
    if not diff <= tolerance:
        shutil.rmtree(out, ignore_errors=True)
        hint = f"; saving as {dtype} needs a looser --atol" if dtype != "float32" else ""
        raise LopdError(
            f"export check failed: logits of the exported model differ from backbone + adapter by {diff:.3g} "
            f"(allowed {atol:g} + {rtol:g} x max|logit| {scale:.3g} = {tolerance:.3g}){hint}"
        )
    result = ExportResult(
        out=str(out.resolve()), mode="merged", checkpoint=str(info.path), step=info.step, algo=info.algo,
        backbone=info.backbone, dtype=dtype, max_abs_logit_diff=diff, max_abs_logit=scale, atol=atol, rtol=rtol,
        tolerance=tolerance, prompts_checked=len(inputs),
    )
    return _finish(out, result)


def export_adapter(info: CheckpointInfo, out: Path, search_dirs: Iterable[Path] = (), force: bool = False) -> ExportResult:
    """Write the student's peft adapter (adapter_config.json + adapter_model.safetensors) and
    the tokenizer; `base_model_name_or_path` points at the backbone it was trained on."""
    if info.student != "lora":
        raise LopdError(f"{info.path}: the student is fully fine-tuned, there is no adapter (use --merge-lora)")
    from lopd_cli.models.backbone import load_tokenizer, resolve_backbone

    src = adapter_dir(info)
    out = Path(out)
    _prepare_out(out, force)
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if not (out / "adapter_model.safetensors").exists() and not (out / "adapter_model.bin").exists():
        raise LopdError(f"{src}: no adapter_model.safetensors")
    base = resolve_backbone(backbone_source(info), search_dirs)
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(base)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    load_tokenizer(base).save_pretrained(str(out))
    result = ExportResult(
        out=str(out.resolve()), mode="adapter", checkpoint=str(info.path), step=info.step, algo=info.algo,
        backbone=info.backbone, dtype="as trained",
    )
    return _finish(out, result)


def _finish(out: Path, result: ExportResult) -> ExportResult:
    result.files = sorted(p.name for p in out.iterdir()) + [EXPORT_INFO_FILE]
    (out / EXPORT_INFO_FILE).write_text(json.dumps(result.to_dict(), indent=2))
    return result
