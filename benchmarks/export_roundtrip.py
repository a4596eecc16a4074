"""Export round trip on a real backbone: LoRA "student" (perturbed, all linear layers) →
`export_merged` → max |logit difference| of the reloaded folder vs backbone + adapter, and time.

    LOPD_CACHE=$(mktemp -d) HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/export_roundtrip.py \
        [--backbone smollm2-135m-instruct] [--rank 16] [--scale 0.05]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backbone", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--scale", type=float, default=0.05, help="std of the random LoRA B weights")
    args = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model

    from lopd_cli.models.backbone import load_backbone, resolve_backbone
    from lopd_cli.models.student import read_checkpoint
    from lopd_cli.results.export import export_merged
    from lopd_cli.runtime import setup_torch

    setup_torch()
    work = Path(tempfile.mkdtemp(prefix="lopd-export-bench-"))
    try:
        model, _ = load_backbone(args.backbone, device="cpu")
        peft_model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"),
                                    adapter_name="student")
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * args.scale)
        step = work / "run" / "checkpoints" / "step_1"
        step.mkdir(parents=True)
        peft_model.save_pretrained(str(step / "student"))
        (step / "checkpoint.json").write_text(json.dumps({
            "step": 1, "algo": "lopd", "backbone": args.backbone,
            "backbone_path": str(resolve_backbone(args.backbone)), "student": "lora"}))
        del peft_model, model
        t0 = time.perf_counter()
        result = export_merged(read_checkpoint(step), work / "out", atol=float("inf"))
        secs = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in (work / "out").iterdir())
        print(json.dumps({"backbone": args.backbone, "rank": args.rank, "lora_b_std": args.scale,
                          "max_abs_logit_diff": result.max_abs_logit_diff, "export_s": round(secs, 1),
                          "out_mb": round(size / 2**20, 1), "files": result.files}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
