"""Base scores of a backbone on the bfcl and code worlds (greedy), per category.

    python benchmarks/worlds_base_scores.py --recipe recipes/bfcl-smollm2.yaml --split validation \
        --per-category 20
    python benchmarks/worlds_base_scores.py --recipe recipes/code-smollm2.yaml --split test --n 40

Runs the same runner as `lopd rollout` (recipe's rollout section, temperature 0), prints one line
per category (success = reward 1.0, mean reward) and the wall time; `--out` writes the rollouts.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from lopd_cli.agent.runner import make_env_factory, run_episodes, select_tasks
from lopd_cli.config import load_recipe
from lopd_cli.models.backbone import load_backbone
from lopd_cli.runtime import setup_torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--split", default="validation")
    ap.add_argument("--n", type=int, default=None, help="first n tasks of the split")
    ap.add_argument("--per-category", type=int, default=None, help="bfcl: n tasks per category")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup_torch()
    overrides = list(args.set)
    if args.per_category:
        overrides.append(f"env.kwargs.n_per_category={args.per_category}")
    recipe = load_recipe(args.recipe, overrides)
    factory = make_env_factory(recipe)
    tasks = select_tasks(factory, args.split, args.n)
    model, tok = load_backbone(recipe.model.backbone, recipe.model.dtype, recipe.model.device)
    t0 = time.time()
    episodes = run_episodes(model, tok, factory, tasks, recipe.rollout, seed=0, temperature=0.0)
    wall = time.time() - t0
    by_cat: dict[str, list[float]] = collections.defaultdict(list)
    for ep in episodes:
        by_cat[ep.task.data.get("category") or ep.task.data.get("source", "all")].append(ep.reward)
    print(f"{recipe.name} {recipe.model.backbone} split={args.split} n={len(episodes)} wall={wall:.0f}s "
          f"errors={sum(1 for e in episodes if e.error)}")
    for cat, rs in by_cat.items():
        ok = sum(1 for r in rs if r >= 1.0)
        print(f"  {cat:24s} n={len(rs):4d} success={ok / len(rs):.3f} ({ok}/{len(rs)}) mean_reward={sum(rs) / len(rs):.3f}")
    if args.out:
        with open(args.out, "w") as f:
            for ep in episodes:
                f.write(json.dumps(ep.to_record()) + "\n")


if __name__ == "__main__":
    main()
