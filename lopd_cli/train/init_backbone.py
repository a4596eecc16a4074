"""`train.teacher: init`: a run's own backbone, the warm-start student merged into its backbone.

Written once to `runs/RUN/backbone/NAME/` with `lopd export --merge-lora`'s logit check, so it
sits above both the student loader (models/student.py) and the export (results/export.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from lopd_cli.models.student import RUN_BACKBONE, CheckpointInfo, backbone_source, existing_init_backbone
from lopd_cli.results.export import export_merged


def merged_init_backbone(info: CheckpointInfo, run_dir: Path, dtype: str = "float32",
                         search_dirs: Iterable[Path] = ()) -> Path:
    """`train.teacher: init`: `info`'s student merged into its backbone, written to
    `run_dir/backbone/NAME/` (NAME: the backbone folder's own name) as a plain transformers folder
    (with `lopd export --merge-lora`'s logit check) and loaded as the run's backbone. The teacher
    (adapters off) is then the warm-start model, and the fresh student adapter (LoRA B = 0)
    starts equal to it. The name is kept because a composer is matched to its backbone by
    architecture and folder name: the cold-start composer of the plain backbone applies. Written
    once: a resumed run reuses the folder, whatever the source run has done since."""
    from lopd_cli.models.backbone import resolve_backbone

    found = existing_init_backbone(run_dir)
    if found is not None:
        return found
    name = Path(str(resolve_backbone(backbone_source(info), search_dirs))).name
    out = Path(run_dir) / RUN_BACKBONE / name
    save_dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "float32"
    # A half-precision folder is checked against the float32 merge with a tolerance to match.
    atol, rtol = (1e-4, 1e-5) if save_dtype == "float32" else (5e-2, 1e-2)
    export_merged(info, out, dtype=save_dtype, device="cpu", atol=atol, rtol=rtol,
                  search_dirs=search_dirs, force=True)
    return out
