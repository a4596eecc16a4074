"""Base scores of a backbone on the bfcl and code worlds (greedy), per category.

    python benchmarks/worlds_base_scores.py --recipe recipes/bfcl-smollm2.yaml --split validation \
        --per-category 20
    python benchmarks/worlds_base_scores.py --recipe recipes/code-smollm2.yaml --split test --n 40

Runs the same runner as `lopd rollout` (recipe's rollout section, temperature 0), prints one line
per category (success = reward 1.0, mean reward) and the wall time; `--out` writes the rollouts.
`--max-minutes` stops starting new batches after that long (the figures say how many ran).
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
    ap.add_argument("--max-minutes", type=float, default=None, help="stop starting new batches after this")
    args = ap.parse_args()
    setup_torch()
    overrides = list(args.set)
    if args.per_category:
        overrides.append(f"env.kwargs.n_per_category={args.per_category}")
    recipe = load_recipe(args.recipe, overrides)
    factory = make_env_factory(recipe)
    tasks = select_tasks(factory, args.split, args.n)
    # Round-robin over categories, so a run cut off by --max-minutes still covers each of them.
    groups: dict[str, list] = collections.defaultdict(list)
    for t in tasks:
        groups[t.data.get("category", "all")].append(t)
    tasks = [g[i] for i in range(max(len(g) for g in groups.values())) for g in groups.values() if i < len(g)]
    model, tok = load_backbone(recipe.model.backbone, recipe.model.dtype, recipe.model.device)
    t0 = time.time()
    episodes = []
    out = open(args.out, "w") if args.out else None
    step = recipe.rollout.batch_size
    for lo in range(0, len(tasks), step):  # chunk by chunk, so a cut-off run still reports
        if args.max_minutes and time.time() - t0 > 60 * args.max_minutes:
            break
        chunk = run_episodes(model, tok, factory, tasks[lo: lo + step], recipe.rollout, seed=0, temperature=0.0)
        episodes += chunk
        for ep in chunk:
            if out:
                out.write(json.dumps(ep.to_record()) + "\n")
                out.flush()
        print(f"  {len(episodes)}/{len(tasks)} done, {time.time() - t0:.0f}s", flush=True)
    wall = time.time() - t0
    by_cat: dict[str, list[float]] = collections.defaultdict(list)
    for ep in episodes:
        by_cat[ep.task.data.get("category") or ep.task.data.get("source", "all")].append(ep.reward)
    print(f"{recipe.name} {recipe.model.backbone} split={args.split} n={len(episodes)} wall={wall:.0f}s "
          f"errors={sum(1 for e in episodes if e.error)}")
    for cat, rs in by_cat.items():
        ok = sum(1 for r in rs if r >= 1.0)
        print(f"  {cat:24s} n={len(rs):4d} success={ok / len(rs):.3f} ({ok}/{len(rs)}) mean_reward={sum(rs) / len(rs):.3f}")
    if out:
        out.close()


if __name__ == "__main__":
    main()
