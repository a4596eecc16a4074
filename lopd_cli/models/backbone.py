"""Load a backbone (embedded name, local transformers directory or hub id) and its tokenizer.

One backbone lives in memory for the whole pipeline: the student adapter, the composer's
encoder adapter and the teacher view (adapters disabled) all share these base weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from lopd_cli.agent.chat_profiles import apply_profile, profile_for
from lopd_cli.errors import LopdError
from lopd_cli.models.registry import BACKBONES, materialise_backbone
from lopd_cli.models.tiny import LATENT_TOKEN

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def resolve_backbone(spec: str, search_dirs: Iterable[Path] = ()) -> Path | str:
    """An embedded name → its cached directory; a relative path → the first search dir holding it
    (recipe folder, then project root); anything else is returned as a hub id."""
    if spec in BACKBONES:
        return materialise_backbone(spec)
    p = Path(spec).expanduser()
    if p.is_absolute():
        if not p.exists():
            raise LopdError(f"model.backbone: directory {p} does not exist")
        return p
    for base in search_dirs:
        cand = (Path(base) / p).resolve()
        if cand.exists():
            return cand
    if p.exists():
        return p.resolve()
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") != 1
    if looks_like_path or os.environ.get("HF_HUB_OFFLINE") == "1":
        names = ", ".join(BACKBONES)
        raise LopdError(f"model.backbone: '{spec}' is neither an embedded model ({names}) nor an existing directory")
    return spec  # a hub id such as Qwen/Qwen3-8B, where a hub is reachable


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_tokenizer(path: Path | str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if Path(str(path)).is_dir():
        apply_profile(tok, profile_for(path))
    if LATENT_TOKEN not in tok.get_vocab():
        tok.add_special_tokens({"additional_special_tokens": [LATENT_TOKEN]})
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_backbone(spec: str, dtype: str = "float32", device: str = "auto", search_dirs: Iterable[Path] = ()):
    """Returns (model, tokenizer). The tokenizer always holds `<|LATENT_PH|>`; if a user's model
    lacked it, the embedding matrix is resized to match (the row's value is never read: the
    teacher's placeholder embeddings are replaced by latents)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_backbone(spec, search_dirs)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, DTYPES[dtype]))
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))
    device = pick_device(device)
    if dtype == "bfloat16":
        from lopd_cli.runtime import warn_if_slow_bf16

        warn_if_slow_bf16("model.dtype=bfloat16", device)
    model.to(device)
    model.eval()
    return model, tokenizer


def latent_token_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids(LATENT_TOKEN)


def backbone_fingerprint(model) -> str:
    """Identifies a backbone's architecture and tokenizer size, for composer compatibility."""
    cfg = model.config
    keys = ["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    blob = json.dumps({k: getattr(cfg, k, None) for k in keys}, sort_keys=True)
    name = getattr(cfg, "_name_or_path", "")
    return hashlib.sha256((blob + "|" + Path(str(name)).name).encode()).hexdigest()[:16]
