"""docs/scale.md's table: the memory plan (lopd_cli/train/memory_plan.py) per GPU for Qwen3-4B and
Qwen3-8B, LoRA and full students, on 1×H200 and on 8×H100-80GB with FSDP (per-layer gathering, and
gather-once beside it), at the paper-like step of benchmarks/gpu/lopd_step_at_scale.py (its `paper`
preset), with what lopd does on a CUDA device: a bf16 teacher copy (`train.teacher_dtype: auto`)
and a fused AdamW. Computed, not measured.

    python benchmarks/memory_plan_table.py [--no-checkpointing] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

GPUS = {"1×H200 (141 GB)": (1, 141e9), "8×H100 (80 GB), FSDP": (8, 80e9)}


def rows(checkpointing: bool) -> list[dict]:
    import lopd_step_at_scale as scale

    from lopd_cli.train.memory_plan import GIB, plan

    w = scale.PRESETS["paper"]
    out = []
    for shape in ("qwen3-4b", "qwen3-8b"):
        for student in ("lora", "full"):
            step, _ = scale.predicted_plan(shape, w, student, checkpointing, "cuda", "bf16")
            recipe = scale.recipe_for(w, student, checkpointing)
            for gpu, (world, mem) in GPUS.items():
                t = scale.train_shape(recipe, "bf16", "cuda")
                t = replace(t, world_size=world, sharding="fsdp" if world > 1 else "none", device_bytes=int(mem),
                            teacher_bytes=2, fused_adamw=True)
                # each rank runs its share of the rollouts: the step shape per device is the same
                p = plan(scale.model_shape(shape), step, t)
                once = plan(scale.model_shape(shape), step, replace(t, fsdp_gather="step"))
                train_gib = p.total_bytes / GIB
                out.append({"model": shape, "student": student, "gpus": gpu, "params": p.parameters / GIB,
                            "grads": p.gradients / GIB, "optimiser": p.optimiser / GIB,
                            "teacher_copy": p.teacher_copy / GIB, "activations": p.activations / GIB,
                            "logits": p.logits / GIB, "per_token_mib": p.per_token["student"] / 2**20,
                            "per_token_ckpt_mib": p.per_token.get("checkpointed", 0) / 2**20,
                            "train_gib": train_gib, "device_gib": mem / GIB, "fsdp": world > 1,
                            "rollout_gib": p.rollout_bytes / GIB, "gather_once_gib": once.total_bytes / GIB,
                            "vllm_max": max(0.0, 1 - train_gib / (mem / GIB))})
    return out


def markdown(rs: list[dict]) -> str:
    lines = ["| model | student | GPUs | parameters | gradients | optimiser | teacher copy | activations "
             "(peak phase) | logits | training total | rollout phase | gather-once total | GPU | "
             "vLLM's share left (max gpu_memory_utilization) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        room = "does not fit" if r["vllm_max"] <= 0 else f"{r['vllm_max']:.2f}"
        once = f"{r['gather_once_gib']:.1f}" if r["fsdp"] else "–"
        lines.append(f"| {r['model']} | {r['student']} | {r['gpus']} | {r['params']:.1f} | {r['grads']:.1f} | "
                     f"{r['optimiser']:.1f} | {r['teacher_copy']:.1f} | {r['activations']:.1f} | {r['logits']:.1f} | "
                     f"**{r['train_gib']:.1f}** | {r['rollout_gib']:.1f} | {once} | {r['device_gib']:.0f} | "
                     f"{room} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rs = rows(not a.no_checkpointing)
    print(markdown(rs))
    ckpt = ("; kept per token with checkpointing: " + ", ".join(
        f"{r['model']} {r['per_token_ckpt_mib']:.2f} MiB" for r in rs if r["gpus"].startswith("1×") and r["student"] == "lora")
            if not a.no_checkpointing else "")
    print("\nGiB per GPU. Activations per token (student pass, all layers, bf16): "
          + ", ".join(f"{r['model']} {r['student']} {r['per_token_mib']:.1f} MiB"
                      for r in rs if r["gpus"].startswith("1×")) + ckpt)
    if a.json:
        a.json.write_text(json.dumps(rs, indent=1))


if __name__ == "__main__":
    main()
