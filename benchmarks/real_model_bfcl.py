"""A real model on BFCL single-turn: base vs after LOPD, with the product's own commands.

SmolLM2-135M-Instruct scores 0 % on every BFCL call category (it answers in prose), so its own
rollouts cannot fill the bank. This script seeds the bank with BFCL's reference answers for
training-split tasks (`lopd_cli.envs.bfcl.ground_truth_records`, each scored 1.0 by the official
checker), then runs what a user runs:

    lopd init W --example bfcl --model M
    lopd bank add-rollouts ground_truth.jsonl && lopd bank index
    lopd coldstart --recipe bfcl                      # composer on the references
    lopd train --recipe bfcl --run lopd               # LOPD on the student's own rollouts
    lopd eval --recipe bfcl --backbone --checkpoint runs/lopd --split validation -n N

What it simplifies: a handful of cold-start and training steps (a CPU budget of about an hour for
SmolLM2), and evaluation on part of the validation split (tasks spread over the categories).

    .venv/bin/python benchmarks/real_model_bfcl.py                     # SmolLM2, about an hour on 1 thread
    .venv/bin/python benchmarks/real_model_bfcl.py --quick             # tiny, a few minutes; figures mean nothing
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BANK_FILE = "ground_truth.jsonl"  # also marks a --work folder as this script's


def lopd(args: list[str], cwd: Path) -> dict | None:
    """Run one `lopd` command in the project; returns its --json output when asked for."""
    cmd = [sys.executable, "-m", "lopd_cli", *args]
    t = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    print(f"[{time.perf_counter() - t:7.1f} s] lopd {' '.join(args)}", flush=True)
    if res.returncode != 0:
        raise SystemExit(f"lopd {' '.join(args)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout) if "--json" in args else None


def write_bank_records(path: Path, categories: list[str], per_category: int) -> dict[str, int]:
    from lopd_cli.envs.bfcl import BfclEnv, ground_truth_records

    env = BfclEnv(categories=categories, n_per_category=per_category)
    records = ground_truth_records(env.tasks("train"), env)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return {"records": len(records), "reward_1": sum(r["reward"] == 1.0 for r in records)}


def main(argv: list[str] | None = None) -> dict:
    from lopd_cli.envs.bfcl import SINGLE_TURN

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lopd_real_model_bfcl")
    ap.add_argument("--categories", nargs="+", default=list(SINGLE_TURN))
    ap.add_argument("--bank-per-category", type=int, default=20, help="training tasks per category whose reference answers seed the bank")
    ap.add_argument("--eval-n", type=int, default=40, help="validation tasks (spread over the categories)")
    ap.add_argument("--coldstart-steps", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=4)
    ap.add_argument("--rollouts-per-step", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], help="extra recipe override KEY=VALUE for every command")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny backbone, 2 categories, 1+1 steps: minutes; figures mean nothing")
    a = ap.parse_args(argv)
    if a.quick:
        a.model, a.categories, a.bank_per_category, a.eval_n = "tiny", ["simple_python", "irrelevance"], 4, 4
        a.coldstart_steps, a.train_steps, a.rollouts_per_step = 1, 1, 2
        a.set = a.set + ["composer.max_item_tokens=64", "rollout.max_new_tokens=16", "rollout.max_prompt_tokens=1024"]

    t0 = time.perf_counter()
    work = a.work
    if work.exists():  # a fresh project each time: `init --force` would keep the old bank and runs
        if not (work / BANK_FILE).is_file():
            raise SystemExit(f"--work {work}: exists and was not made by this script; choose another folder")
        shutil.rmtree(work)
    lopd(["init", str(work), "--example", "bfcl", "--model", a.model, "--force"], cwd=REPO)
    cats = "[" + ", ".join(a.categories) + "]"
    common = ["--recipe", "bfcl", "--set", f"env.kwargs.categories={cats}"]
    for s in a.set:
        common += ["--set", s]
    bank_file = work / BANK_FILE
    bank = write_bank_records(bank_file, a.categories, a.bank_per_category)
    lopd(["bank", "add-rollouts", str(bank_file), "--recipe", "bfcl"], cwd=work)
    lopd(["bank", "index", "--recipe", "bfcl"], cwd=work)
    # anchor_cache_tasks=0: training fills the anchor latents c_φ0 for the tasks it meets; filling
    # 128 up front took longer than this whole cold start on SmolLM2 on a CPU (RESULTS.md).
    lopd(["coldstart", *common, "--set", f"coldstart.steps={a.coldstart_steps}",
          "--set", "coldstart.batch_size=4", "--set", "coldstart.anchor_cache_tasks=0"], cwd=work)
    train = lopd(["train", *common, "--set", f"train.steps={a.train_steps}", "--set", f"train.save_every={a.train_steps}",
                  "--set", f"rollout.rollouts_per_step={a.rollouts_per_step}",
                  "--set", f"rollout.batch_size={a.rollouts_per_step}", "--set", "train.micro_batch=2",
                  "--run", "lopd", "--json"], cwd=work)
    ev = lopd(["eval", *common, "--backbone", "--checkpoint", "runs/lopd", "--split", "validation",
               "-n", str(a.eval_n), "--json"], cwd=work)
    out = {"model": a.model, "categories": a.categories, "bank": bank, "coldstart_steps": a.coldstart_steps,
           "train_steps": a.train_steps, "rollouts_per_step": a.rollouts_per_step, "eval_n": a.eval_n,
           "train": train, "eval": ev, "seconds": time.perf_counter() - t0}
    for m in ev["models"]:
        b = m["behaviour"]
        print(f"{m['label']:<40} success {m['success']['mean']:.3f} [{m['success']['low']:.3f}, {m['success']['high']:.3f}]"
              f"  reward {m['reward']['mean']:.3f}  tool calls {b['tool_calls']['mean']:.2f}"
              f"  invalid {b['invalid_calls']['mean']:.2f}")
    if a.json_out:
        a.json_out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
