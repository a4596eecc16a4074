"""Per-rank memory of sharded training on this CPU, against the memory plan, as the world grows.

    LOPD_THREADS=1 python benchmarks/fsdp_memory_check.py [--worlds 1 2 4] [--students full lora]

For each student and world size N: 2 SFT steps of SmolLM2-135M-Instruct (fp32, `train.parallel:
fsdp`, per-layer gathering, the default) under torchrun with N gloo processes, in a fresh project
whose bank holds the orders world's scripted-agent rollouts (N = 1 is one plain process). Each
rank reads its anonymous resident memory (RssAnon, sampled every 2 ms; glibc hands freed tensors
back at once with MALLOC_MMAP_THRESHOLD_=131072) before the model is loaded, and its peak over
the two steps; measured = peak − before. Plan = `train.memory_plan.plan` for the same model, step
shape (the longest sequence of the pool, the recipe's micro-batch and logit chunk) and world:
parameters + gradients + AdamW's states + the larger of (activations + logits) and AdamW's step,
for each rank at the longest sequence it trained on.

What it simplifies: SFT, not a LOPD step (one student pass per micro-batch: the states, which
sharding divides, are what the check is about; the LOPD passes are checked in one process by
benchmarks/memory_plan_check.py); no composer is built for SFT, so the plan is taken with a χ of
depth 0. The plan leaves out gloo's buffers and FSDP's all-gather copies beyond two layers.
JSON: benchmarks/results/fsdp_memory_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
OUT = ROOT / "benchmarks" / "results" / "fsdp_memory_check.json"
SETS = ["train.algo=sft", "train.steps=2", "train.micro_batch=1", "train.logit_chunk=256", "train.sft.batch=4",
        "train.save_every=100", "train.parallel=fsdp", "model.autocast_bf16=false"]


def build(root: Path) -> Path:
    """A SmolLM2 orders project with 32 scripted-agent rollouts in its bank."""
    from lopd_cli.bank.store import Bank
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.envs.orders_agent import scripted_agent_records
    from lopd_cli.project import init_project, packaged_recipe

    proj = init_project(root, example="orders", model="smollm2-135m-instruct")
    (proj.recipes_dir / "toolcall.yaml").write_text(packaged_recipe("orders-smollm2-sft").read_text())
    recipe = proj.load_recipe("toolcall")
    tasks = OrdersEnv(house_rules=True, rules_seed=0).tasks("train")[:32]
    with Bank(proj.bank_path(recipe), recipe.bank.min_reward) as bank:
        bank.add_records(list(scripted_agent_records(tasks, seed=0, noise=0.0)), source="logs")
    return proj.root


def worker(project: Path, student: str, out: Path) -> None:
    """One rank: RssAnon before the model loads, its peak over the steps, written to `out`."""
    from lopd_step_at_scale import Meter, _status_mib

    from lopd_cli.project import open_project
    from lopd_cli.train import distributed as dist
    from lopd_cli.train import sft
    from lopd_cli.train.loop import train

    longest = [0]
    nll_update = sft.nll_update

    def recording(tr, local, total_tokens):  # the longest sequence this rank trains on, for its plan
        longest[0] = max([longest[0], *(len(ep.input_ids) for ep in local)])
        return nll_update(tr, local, total_tokens)

    sft.nll_update = recording

    # transformers maps the safetensors file into memory: a LoRA backbone nobody writes stays in
    # file-backed pages, which RssAnon does not count (one process measured 0.76 of plan that way,
    # 2026-12-06), while sharding copies it into anonymous memory. Own copies at load, as
    # benchmarks/gpu/lopd_step_at_scale.py makes, so every world counts the same weights.
    from lopd_cli.train import loop

    real_load = loop.load_backbone

    def owned(*args, **kwargs):
        import torch

        model, tok = real_load(*args, **kwargs)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.data = t.data.clone()
        return model, tok

    loop.load_backbone = owned
    proj = open_project(project)
    recipe = proj.load_recipe("toolcall", SETS + [f"model.student={student}"])
    dist.init_from_env()
    before = _status_mib("RssAnon")
    meter = Meter()
    peaks: list[float] = []
    train(proj, recipe, proj.runs_dir / f"{student}-{dist.world_size()}",
          on_step=lambda row: (peaks.append(meter.peak()), meter.reset()))
    meter.close()
    rank = dist.rank()
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "before_mib": before, "step_peaks_mib": peaks,
                                                      "longest": longest[0]}))


def planned(project: Path, student: str, world: int, seq: int) -> dict:
    from transformers import AutoConfig

    from lopd_cli.models.registry import materialise_backbone
    from lopd_cli.project import open_project
    from lopd_cli.train.memory_plan import ModelShape, StepShape, TrainShape, plan

    proj = open_project(project)
    r = proj.load_recipe("toolcall", SETS + [f"model.student={student}"])
    path = materialise_backbone(r.model.backbone)
    m = ModelShape.from_config(AutoConfig.from_pretrained(path))
    s = StepShape(rollouts=r.train.sft.batch, micro_batch=1, composer_micro_batch=1, seq_tokens=seq, shared_prefix=0,
                  teacher_tokens=seq, teacher_shared_prefix=0, action_tokens=seq // 4, n_ret=1, num_queries=1,
                  item_tokens=1, logit_chunk=r.train.logit_chunk, top_m=1)
    t = TrainShape(student=student, lora_r=r.model.lora.r, encoder_lora_r=r.composer.encoder_lora.r, precision="fp32",
                   master_bytes=4, trains_composer=False, anchor_copy=False, composer_depth=0, device="cpu",
                   world_size=world, sharding="fsdp" if world > 1 else "none")
    p = plan(m, s, t)
    total = p.parameters + p.gradients + p.optimiser + max(p.activations + p.logits, p.optimiser_step)
    return {"plan_mib": total / 2**20, "plan": p.as_dict(), "seq_tokens": seq}


def compare(project: Path, student: str, world: int) -> dict:
    """Each rank against the plan for its own longest sequence."""
    row = run(project, student, world)
    ranks = []
    for r in row.pop("ranks"):
        p = planned(project, student, world, r["longest"])
        measured = max(r["step_peaks_mib"]) - r["before_mib"]
        ranks.append({"rank": r["rank"], "longest": r["longest"], "measured_mib": measured, "plan_mib": p["plan_mib"],
                      "ratio": measured / p["plan_mib"], "plan": p["plan"]})
    row["ranks"] = ranks
    row["measured_mib"] = max(x["measured_mib"] for x in ranks)
    row["plan_mib"] = max(x["plan_mib"] for x in ranks)
    return row


def run(project: Path, student: str, world: int) -> dict:
    env = {**os.environ, "LOPD_THREADS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "MALLOC_MMAP_THRESHOLD_": "131072"}
    with tempfile.TemporaryDirectory() as tmp:
        args = [str(Path(__file__).resolve()), "--worker", str(project), student, tmp]
        if world == 1:
            env = {k: v for k, v in env.items() if k not in ("WORLD_SIZE", "RANK")}
            cmd = [sys.executable, *args]
        else:
            cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", str(world), *args]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"{student} world {world}: failed\n{res.stderr[-3000:]}")
        ranks = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]
    return {"student": student, "world": world, "ranks": ranks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--students", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        project, student, out = a.worker
        worker(Path(project), student, Path(out))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        project = build(Path(tmp) / "proj")
        for student in a.students:
            for world in a.worlds:
                row = compare(project, student, world)
                rows.append(row)
                print(f"{student} world {world}: largest rank measured {row['measured_mib']:.0f} MiB, planned "
                      f"{row['plan_mib']:.0f} MiB; per rank measured/plan "
                      + ", ".join(f"{x['measured_mib']:.0f}/{x['plan_mib']:.0f}" for x in row["ranks"]), flush=True)
    a.out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
