"""Checkpoints that survive a SIGKILL: written to a temporary folder, renamed, `latest` last.

    runs/RUN/checkpoints/step_N/
        checkpoint.json   step, algo, backbone spec and resolved path, student kind
        student/          peft adapter (student: lora) or a transformers dir (student: full)
        composer/         the composer (LOPD only)
        state.pt          optimiser states, beta, RNG states, data position, counters
    runs/RUN/checkpoints/latest -> step_N
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from lopd_cli.errors import LopdError

LATEST = "latest"
# An evolve run (runs/EVOLVE/, pipeline/evolve.py) points at its incumbent's step folder with a
# relative link `incumbent`; its state file `evolve.json` marks the folder as an evolve run.
INCUMBENT = "incumbent"
EVOLVE_STATE = "evolve.json"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    meta: dict[str, Any],
    state: dict[str, Any],
    writers: dict[str, Callable[[Path], None]],
    keep_last: int | None = None,
) -> Path:
    """Write step_N atomically. `writers` fill subfolders (e.g. {"student": model.save_pretrained}).

    The folder is complete before it gets its final name, and `latest` moves only after that,
    so a crash at any point leaves the previous checkpoint intact and `latest` valid.
    """
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step}"
    tmp = ckpt_root / f".step_{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, write in writers.items():
        write(tmp / name)
    torch.save(state, tmp / "state.pt")
    (tmp / "checkpoint.json").write_text(json.dumps({"step": step, **meta}, indent=2))
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    link_tmp = ckpt_root / f".{LATEST}.tmp-{os.getpid()}"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    link_tmp.symlink_to(final.name)
    link_tmp.replace(ckpt_root / LATEST)
    _fsync_dir(ckpt_root)
    if keep_last:
        _prune(ckpt_root, keep_last)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _prune(ckpt_root: Path, keep_last: int) -> None:
    steps = sorted((int(p.name.split("_")[1]), p) for p in ckpt_root.glob("step_*") if p.is_dir())
    current = resolve_checkpoint(ckpt_root)
    for _, p in steps[:-keep_last]:
        if p.resolve() != current.resolve():
            shutil.rmtree(p, ignore_errors=True)


def resolve_checkpoint(path: Path) -> Path:
    """A run folder, its checkpoints/ folder, `latest`, a step folder, or an evolve run's folder
    (its incumbent) -> the step folder."""
    path = Path(path)
    if (path / INCUMBENT).exists():
        path = path / INCUMBENT
    elif (path / EVOLVE_STATE).is_file():
        raise LopdError(f"{path}: no round of this evolve run has been accepted yet (its incumbent is the starting model)")
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if (path / LATEST).exists() or (path / LATEST).is_symlink():
        path = path / LATEST
    if path.name == LATEST and path.is_file() and not path.is_symlink():
        path = path.parent / path.read_text().strip()
    path = path.resolve()
    if not (path / "checkpoint.json").is_file():
        raise LopdError(f"{path}: not a lopd checkpoint (no checkpoint.json)")
    return path


def read_checkpoint_meta(step_dir: Path) -> dict[str, Any]:
    return json.loads((Path(step_dir) / "checkpoint.json").read_text())


def load_state(step_dir: Path) -> dict[str, Any]:
    return torch.load(Path(step_dir) / "state.pt", weights_only=False)


# ----------------------------------------------------------------------------- student weights


def copy_full_weights(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a plain transformers state dict into the base weights of a peft-wrapped trainer
    model (where a LoRA-wrapped layer keeps its weight under `.base_layer.`)."""
    own = dict(model.get_base_model().named_parameters())
    with torch.no_grad():
        for k, v in state_dict.items():
            for name in (k, k.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")):
                if name in own:
                    own[name].copy_(v)
                    break


def load_student_weights(model, student_dir: Path) -> None:
    """A checkpoint's `student/` into the trainer's model, in place: a peft adapter into the
    "student" adapter (LoRA student), or a transformers directory into the base (full FT)."""
    from lopd_cli.models import adapters as ad

    student_dir = Path(student_dir)
    if ad.has_student_adapter(model):
        for d in (student_dir, student_dir / "student"):
            if (d / "adapter_config.json").is_file():
                student_dir = d
                break
        ad.load_adapter_weights(model, ad.STUDENT, student_dir)
        return
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(student_dir, dtype=next(model.parameters()).dtype)
    copy_full_weights(model, full.state_dict())
