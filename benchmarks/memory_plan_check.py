"""The memory plan (lopd_cli/train/memory_plan.py) against the memory one LOPD step takes here.

Each configuration (backbone × student × activation checkpointing) runs in a fresh process:
benchmarks/gpu/lopd_step_at_scale.py's worker builds the trainer as train/loop.py does (adapters,
composer and its frozen cold-start copy, AdamW), then runs two of loop.train_step's LOPD steps on
prebuilt episodes, in fp32 on the CPU. Measured: the peak RSS of each step (VmHWM, reset before
the step through /proc/self/clear_refs) minus the RSS just before step 1, after a garbage
collection and malloc_trim (so: what the step adds to the loaded model). glibc serves every
allocation above 128 KiB from its own mapping (MALLOC_MMAP_THRESHOLD_), so freed tensors leave
the RSS at once and it follows the live bytes. Predicted: the plan's step growth (gradients, then
the larger of the activation peak + logits and the optimiser's step; step 2 adds AdamW's states,
created in step 1).

The workload is the worker's `cpu` preset (benchmarks/gpu/lopd_step_at_scale.py PRESETS): 8
rollouts (4 for SmolLM2, whose steps take minutes on one thread) of ~1,024 tokens (a 768-token
prompt, or the world's own prompt where that is longer, then 3 turns of 64 action tokens), 3
retrieved items of 256 encoder tokens, K = 32 latents per item, χ depth 8, micro-batches 4
(student) and 2 (composer).

    LOPD_THREADS=1 python benchmarks/memory_plan_check.py                  # tiny + smollm2, ~10 min
    LOPD_THREADS=1 python benchmarks/memory_plan_check.py --shapes tiny --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "lopd_step_at_scale.py"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "memory_plan_check.json"


def run_one(shape: str, student: str, checkpointing: bool, preset: str, rollouts: int | None = None) -> dict:
    cmd = [sys.executable, str(SCRIPT), "--worker", f"{shape}:{student}", "--device", "cpu", "--preset", preset,
           "--steps", "2", "--generate-tokens", "0"]
    if rollouts:
        cmd += ["--rollouts", str(rollouts)]
    if not checkpointing:
        cmd.append("--no-checkpointing")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "131072",
           "LOPD_THREADS": os.environ.get("LOPD_THREADS", "1"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"worker failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads(line[7:])


def table(rows: list[dict]) -> str:
    out = ["| backbone | student | checkpointing | step | measured MiB | plan MiB | measured / plan | "
           "peak RSS growth MiB | plan: grads + optimiser / activations / logits MiB | step s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["plan"]
        mib = lambda k: p[k] * 1024  # noqa: E731
        for st in r["steps"]:
            out.append(f"| {r['shape']} | {r['student']} | {'on' if r['activation_checkpointing'] else 'off'} | "
                       f"{st['step']} | {st['measured_mib']:.0f} | {st['plan_mib']:.0f} | "
                       f"{st['measured_mib'] / st['plan_mib']:.2f} | {st.get('rss_growth_mib', float('nan')):.0f} | "
                       f"{mib('gradients_gib') + mib('optimiser_gib'):.0f} / "
                       f"{mib('activations_gib'):.0f} / {mib('logits_gib'):.0f} | {st['sec_step']:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    ap.add_argument("--students", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--rollouts", type=int, default=None, help="rollouts per step (default: the preset's 8; 4 for smollm2)")
    ap.add_argument("--quick", action="store_true", help="LoRA, checkpointing off only")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--merge", action="store_true", help="keep --out's rows of other configurations")
    a = ap.parse_args()
    students = ["lora"] if a.quick else a.students
    ckpts = ["off"] if a.quick else a.checkpointing
    rows = []
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for shape in a.shapes:
        for student in students:
            for c in ckpts:
                r = run_one(shape, student, c == "on", a.preset, a.rollouts or (4 if shape == "smollm2" else None))
                r["command"] = " ".join(["benchmarks/memory_plan_check.py", *sys.argv[1:]])
                rows.append(r)
                print(table([r]).splitlines()[-2], flush=True)
                print(table([r]).splitlines()[-1], flush=True)
                saved = json.loads(a.out.read_text())["rows"] if a.merge and a.out.exists() else []
                key = lambda x: (x["shape"], x["student"], x["activation_checkpointing"])  # noqa: E731
                kept = [x for x in saved if key(x) not in {key(y) for y in rows}]
                a.out.write_text(json.dumps({"rows": kept + rows}, indent=1))  # after every row
    print()
    print(table(rows))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
