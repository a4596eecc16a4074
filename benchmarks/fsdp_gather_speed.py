"""Per-layer gathering against gather-once (`train.fsdp_gather`): seconds per update on this CPU.

    python benchmarks/fsdp_gather_speed.py [--world 2] [--steps 3]

For a LoRA and a full SmolLM2-135M-Instruct student: `lopd train --algo sft` with `--steps` steps
under torchrun with `--world` gloo processes (one thread each), once per mode, in the project of
benchmarks/fsdp_memory_check.py; the figure is the median of `sec_update` (the update's
wall-clock seconds, the slowest rank) over the steps after the first. Per-layer gathering runs
one all-gather per layer and pass and one reduce-scatter per layer and backward; gather-once one
all-gather per unit per step and one reduce-scatter per unit per step. What it leaves out: GPUs
and NCCL (the trade there is different: collectives overlap with compute), LOPD's extra passes.
JSON: benchmarks/results/fsdp_gather_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = ROOT / "benchmarks" / "results" / "fsdp_gather_speed.json"


def run(project: Path, student: str, mode: str, world: int, steps: int) -> dict:
    from fsdp_memory_check import SETS

    from lopd_cli.train.metrics import read_metrics

    name = f"speed-{student}-{mode}"
    sets = [s for s in SETS if not s.startswith("train.steps=")] + [
        f"train.steps={steps}", f"model.student={student}", f"train.fsdp_gather={mode}"]
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", str(world),
           "-m", "lopd_cli", "train", "-C", str(project), "--recipe", "toolcall", "--json", "--run-name", name,
           *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "LOPD_THREADS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{name}: failed\n{res.stderr[-3000:]}")
    rows = read_metrics(project / "runs" / name)
    secs = [r["sec_update"] for r in rows]
    return {"student": student, "mode": mode, "world": world, "sec_update": secs,
            "median_sec_update": statistics.median(secs[1:] or secs)}


def main() -> None:
    from fsdp_memory_check import build

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        project = build(Path(tmp) / "proj")
        for student in ("lora", "full"):
            for mode in ("layer", "step"):
                row = run(project, student, mode, a.world, a.steps)
                rows.append(row)
                print(f"{student} {mode}: median sec_update {row['median_sec_update']:.2f} s "
                      f"({', '.join(f'{x:.2f}' for x in row['sec_update'])})", flush=True)
    a.out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
