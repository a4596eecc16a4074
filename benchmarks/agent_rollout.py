"""Measure the agent side: tiny orders base-policy build time, its success on the train split at
temperature 1.0 (the 10–40 % band), and rollout throughput (episodes/s, generated tokens/s).

    python benchmarks/agent_rollout.py [--n 64] [--rebuild] [--backbone PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from lopd_cli.agent.metrics import summarize
from lopd_cli.agent.runner import run_episodes
from lopd_cli.config import load_recipe
from lopd_cli.envs.orders import OrdersEnv
from lopd_cli.models.backbone import load_backbone
from lopd_cli.runtime import setup_torch
from lopd_cli.train.base_policy import cached_orders_base_policy, train_orders_base_policy

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rebuild", action="store_true", help="time a fresh build instead of the cached one")
    ap.add_argument("--backbone", default=None)
    args = ap.parse_args()
    setup_torch()
    out: dict = {}
    if args.backbone:
        path = Path(args.backbone)
    elif args.rebuild:
        path = Path(tempfile.mkdtemp(prefix="orders-base-"))
        t0 = time.perf_counter()
        train_orders_base_policy(path, seed=args.seed)
        out["build_s"] = round(time.perf_counter() - t0, 1)
    else:
        path = cached_orders_base_policy(args.seed)
    recipe = load_recipe(REPO / "recipes" / "orders-tiny.yaml")
    model, tok = load_backbone(str(path), device="cpu")
    tasks = OrdersEnv().tasks("train")[: args.n]
    t0 = time.perf_counter()
    eps = run_episodes(model, tok, OrdersEnv, tasks, recipe.rollout, seed=args.seed)
    dt = time.perf_counter() - t0
    s = summarize(eps)
    out.update(n=len(eps), rollout_s=round(dt, 1), episodes_per_s=round(len(eps) / dt, 2),
               generated_tokens_per_s=round(sum(sum(e.action_mask) for e in eps) / dt, 1),
               **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items() if k != "first_error"})
    by_kind: dict[str, list[float]] = {}
    for e in eps:
        by_kind.setdefault(e.task.data["kind"], []).append(e.reward)
    out["mean_reward_by_kind"] = {k: round(sum(v) / len(v), 2) for k, v in sorted(by_kind.items())}
    print(json.dumps(out, indent=1))
    if args.rebuild:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
