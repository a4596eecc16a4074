"""What `lopd models` shows: each embedded model, whether it is installed and cached, its size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lopd_cli.models.registry import BACKBONES, EMBEDDERS, cache_dir, dir_size


def inventory() -> list[dict]:
    rows = []
    for b in BACKBONES.values():
        cached = cache_dir() / "models" / b.name
        is_cached = (cached / "config.json").exists()
        size = dir_size(cached) if is_cached else b.source_size()
        rows.append(
            dict(kind="backbone", name=b.name, installed=b.available(), cached=is_cached,
                 size_bytes=size, path=str(cached) if is_cached else None, description=b.description)
        )
    for e in EMBEDDERS.values():
        spec = importlib.util.find_spec(e.package)
        path = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
        rows.append(
            dict(kind="embedder", name=e.name, installed=path is not None, cached=path is not None,
                 size_bytes=dir_size(path) if path else None, path=str(path) if path else None,
                 description=e.description)
        )
    return rows
