"""Does cold start teach the composer anything? Teacher NLL of held-out successful trajectories.

Builds a throw-away project (orders world, tiny backbone by default), fills its bank with the
orders oracle's successful transcripts of N training tasks, indexes it, runs `lopd coldstart`'s
code path, then scores the held-out rollouts' action tokens with the frozen teacher six ways:

    learned   c_φ of the retrieved items (the cold-started composer)
    random    random latents with c_φ's per-row norms, same placeholders
    zeros     the framed block with all-zero latents (what the framing alone does)
    shuffled  c_φ of another held-out example's retrieved items (right form, wrong task)
    text      the retrieved items as plain text in the same frame (OPSD's teacher)
    none      no reference block at all (the plain prompt)

and also `learned` before training (the randomly initialised composer). `latent_task_spread`
(before/after) says how much c_φ varies between held-out tasks relative to its norm: near 0,
the composer has become a fixed soft prompt that ignores the references.

    .venv/bin/python benchmarks/coldstart_nll.py [--model tiny] [--tasks 96] [--steps 60] [--json-out F] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tasks", type=int, default=96)
    ap.add_argument("--steps", type=int, default=None, help="coldstart.steps (default: the recipe's)")
    ap.add_argument("--set", action="append", default=[], help="extra recipe overrides")
    ap.add_argument("--out", default=None, help="project folder (default: a temporary one)")
    ap.add_argument("--json-out", default=None, help="also write the result to this JSON file")
    ap.add_argument("--no-base-policy", action="store_true",
                    help="random tiny weights instead of the tiny orders base policy (a mechanism probe: no policy build)")
    ap.add_argument("--quick", action="store_true", help="8 tasks, 2 steps, a small composer: a minute; figures mean nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.tasks, args.steps = 8, 2
        args.set = ["coldstart.batch_size=2", "coldstart.val_fraction=0.25", "coldstart.eval_every=1",
                    "composer.num_queries=2", "composer.depth=1", "composer.max_item_tokens=64",
                    "bank.n_retrieve=2"] + args.set

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lopd_cli.runtime import setup_torch

    setup_torch()
    import torch

    from lopd_cli.bank.index import build_index
    from lopd_cli.bank.retrieve import Retriever
    from lopd_cli.bank.store import Bank
    from lopd_cli.compose.composer import Composer
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.envs.orders_agent import scripted_agent_records
    from lopd_cli.project.scaffold import create_project
    from lopd_cli.train.coldstart import holdout_split, make_examples, run_coldstart
    from lopd_cli.train.teacher_nll import latent_task_spread, teacher_nll

    root = Path(args.out or tempfile.mkdtemp(prefix="lopd-coldstart-"))
    project = create_project(root, example="orders", model=args.model, force=True, base_policy=not args.no_base_policy)
    overrides = [f"env.kwargs={{n_train: {args.tasks}}}", *args.set]
    if args.steps is not None:
        overrides.append(f"coldstart.steps={args.steps}")
    recipe = project.load_recipe("toolcall", overrides)

    env = OrdersEnv(n_train=args.tasks)
    records = scripted_agent_records(env.tasks("train"), noise=0.0)  # the oracle, no mistakes
    with Bank(project.bank_path(recipe), recipe.bank.min_reward) as bank:
        added = bank.add_records(records, source="oracle")
    build_index(project, recipe, progress=False)
    print(f"bank: {added.added} oracle rollouts, {added.successes} successful "
          f"(mean reward {sum(r['reward'] for r in records) / len(records):.3f})")

    t0 = time.perf_counter()
    summary = run_coldstart(project, recipe, project.runs_dir / "coldstart", show_progress=False)
    seconds = time.perf_counter() - t0

    # Score the same held-out split the cold start validated on, with the saved composer.
    from lopd_cli.models.adapters import attach_adapters
    from lopd_cli.models.backbone import load_backbone

    model, tok = load_backbone(recipe.model.backbone, recipe.model.dtype, "cpu", [recipe.base_dir, project.root])
    from lopd_cli.runtime import seed_everything

    seed_everything(recipe.coldstart.seed)  # `fresh` is then the init the cold start trained from
    model = attach_adapters(model, recipe)
    fresh = Composer(model, tok, recipe.composer, recipe.bank.obs_char_budget)
    retriever = Retriever.open(project, recipe)
    # the cold start's own held-out split (run_coldstart), so no scored task was trained on
    _, val_items = holdout_split(retriever.bank.items(success_only=True), env, recipe.coldstart.val_fraction,
                                 recipe.coldstart.seed)
    val = make_examples(tok, retriever, val_items, recipe.bank.n_retrieve, recipe.rollout.max_prompt_tokens)
    torch.manual_seed(0)
    before = teacher_nll(model, tok, fresh, val, "learned")
    spread_before = latent_task_spread(fresh, val)
    composer = Composer.load(Path(summary["composer"]), model, tok, recipe.composer)
    from lopd_cli.train.teacher_nll import text_reference_chars

    text = dict(obs_char_budget=recipe.bank.obs_char_budget, text_max_chars=text_reference_chars(recipe))
    nll = {m: teacher_nll(model, tok, composer, val, m, **text)
           for m in ("learned", "random", "zeros", "shuffled", "text", "none")}
    spread = latent_task_spread(composer, val)
    retriever.close()
    result = {
        "model": args.model, "bank_rollouts": added.successes, "train_examples": summary["train_examples"],
        "heldout_examples": len(val), "steps": summary["steps"], "coldstart_seconds": round(seconds, 1),
        "nll_learned_before": round(before, 6), **{f"nll_{k}": round(v, 6) for k, v in nll.items()},
        "latent_task_spread_before": round(spread_before, 4), "latent_task_spread": round(spread, 4),
        "nll_gap": round(nll["shuffled"] - nll["learned"], 4),  # > 0: the composer carries its references
        "composer_keys": recipe.composer.key_tokens, "contrastive_weight": recipe.coldstart.contrastive_weight,
        "spread_history": [round(r["composer/latent_task_spread"], 4) for r in map(json.loads, (
            project.runs_dir / "coldstart" / "metrics.jsonl").read_text().splitlines())
            if "composer/latent_task_spread" in r],
        "val_nll_logged": summary["val_nll_after"], "project": str(root),
    }
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
