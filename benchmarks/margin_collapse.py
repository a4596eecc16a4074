"""Margin ablation on tiny: with m = 0 and the composer free, does Δ collapse toward 0?

docs/algorithm.md: "Without the margin, minimising the KL over φ pulls the teacher onto the student
(collapse)". Set-up (everything real, small):

    backbone   the tiny orders base policy (`cached_orders_base_policy()`: tiny trained by
               imitation of a noisy oracle; succeeds on some tasks)
    bank       the orders oracle's successful transcripts of `--bank` training tasks
    composer   fresh (recipe orders-tiny: K 8, depth 2), cold-started for `--coldstart-steps`
               on those transcripts (references = 3 other tasks' transcripts, never its own)
    batch      `--rollouts` real rollouts of the base policy (student adapter at its zero init,
               temperature 1) on other training tasks, with the env's rewards; references =
               3 bank items of other tasks; the same batch every step
    steps      `lopd_step` + the composer's optimiser step + the dual step on β, exactly as
               `train.loop.update` does, but the student does not step (lr 0): only φ moves,
               so any change in Δ is the composer's doing

run once per margin from the same cold-started composer. Reported per step: Δ, β and the
composer's KL(sg S ‖ T). Anchor λ = 0.2 (the default) unless --anchor says otherwise. Δ's form
is `--margin-advantage` (centred, the default, or the paper's); η_β the recipe default 10.

    .venv/bin/python benchmarks/margin_collapse.py [--margins 0 0.5] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "margin_collapse.json"


def build(args) -> dict:
    """Backbone, cold-started composer (and its saved state), the fixed batch and references."""
    import torch

    from lopd_cli.agent.runner import make_env_factory, run_episodes
    from lopd_cli.bank.store import BankItem
    from lopd_cli.compose.composer import Composer
    from lopd_cli.config import load_recipe
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.envs.orders_agent import noisy_oracle_transcript
    from lopd_cli.models import adapters as ad
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.project import packaged_recipe
    from lopd_cli.train.base_policy import cached_orders_base_policy
    from lopd_cli.train.coldstart import Example, item_episode, train_composer

    torch.manual_seed(args.seed)
    base = cached_orders_base_policy()
    recipe = load_recipe(packaged_recipe("orders-tiny"), [
        f"model.backbone={base}", "model.device=cpu", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_turns={args.max_turns}", f"rollout.batch_size={args.rollouts}",
        f"coldstart.steps={args.coldstart_steps}", f"coldstart.lr={args.coldstart_lr}", "coldstart.batch_size=4",
        f"composer.max_item_tokens={args.max_item_tokens}"] + list(args.set))
    model, tok = load_backbone(str(base), device="cpu")
    model = ad.attach_adapters(model, recipe)
    composer = Composer(model, tok, recipe.composer, recipe.bank.obs_char_budget)

    env = OrdersEnv()
    tasks = env.tasks("train")
    bank_tasks, batch_tasks = tasks[: args.bank], tasks[args.bank: args.bank + args.rollouts]
    items = []
    for k, t in enumerate(bank_tasks):
        msgs = noisy_oracle_transcript(t, random.Random(k), 0.0)
        items.append(BankItem(k + 1, t.id, t.instruction, msgs, t.tools, 1.0, True, {}))
    n_ret = recipe.bank.n_retrieve
    rng = random.Random(args.seed)

    def others(exclude_id: str) -> list:
        return rng.sample([it for it in items if it.task_id != exclude_id], n_ret)

    examples = [Example(item_episode(tok, it), others(it.task_id)) for it in items]
    t0 = time.perf_counter()
    cs = train_composer(model, tok, composer, examples, [], recipe.coldstart) if args.coldstart_steps else {"history": []}
    coldstart_s = time.perf_counter() - t0

    factory = make_env_factory(recipe)
    model.eval()
    with torch.no_grad(), ad.use_student(model):
        episodes = run_episodes(model, tok, factory, batch_tasks, recipe.rollout, seed=args.seed)
    refs = [others(ep.task.id) for ep in episodes]
    with torch.no_grad():
        latents0 = composer(refs, [ep.task.instruction for ep in episodes]).detach().clone()
    state = {
        "resampler": {k: v.detach().clone() for k, v in composer.resampler.state_dict().items()},
        "encoder": [p.detach().clone() for p in ad.adapter_parameters(model, ad.ENCODER)],
    }
    return {"recipe": recipe, "model": model, "tok": tok, "composer": composer, "episodes": episodes,
            "refs": refs, "latents0": latents0, "state": state, "coldstart_s": coldstart_s,
            "coldstart_loss": [r["loss"] for r in cs["history"]]}


def restore(ctx: dict) -> None:
    import torch

    from lopd_cli.models import adapters as ad

    ctx["composer"].resampler.load_state_dict(ctx["state"]["resampler"])
    with torch.no_grad():
        for p, v in zip(ad.adapter_parameters(ctx["model"], ad.ENCODER), ctx["state"]["encoder"]):
            p.copy_(v)


def run_margin(ctx: dict, margin: float, steps: int, composer_lr: float, anchor: float, eta: float,
               form: str = "centred") -> list[dict]:
    """`steps` LOPD updates of φ only, from the cold-started composer. Returns one row per step:
    Δ, β and the composer KL measured at that step (before its optimiser step)."""
    import torch

    from lopd_cli.models import adapters as ad
    from lopd_cli.train.step import StepSetup, lopd_step
    from lopd_cli.train.losses import dual_update

    restore(ctx)
    model, composer, t = ctx["model"], ctx["composer"], ctx["recipe"].train
    ad.set_trainable(model, [ad.STUDENT, ad.ENCODER])
    composer.resampler.requires_grad_(True)
    params = list(composer.resampler.parameters()) + ad.adapter_parameters(model, ad.ENCODER)
    opt = torch.optim.AdamW(params, lr=composer_lr)
    student = ad.adapter_parameters(model, ad.STUDENT)
    latents0 = ctx["latents0"]
    setup = StepSetup(model, ctx["tok"], t.distill.top_m, margin, anchor, t.micro_batch, t.logit_chunk,
                         composer=composer, train_composer=True, latents0=lambda i, r: latents0,
                         margin_advantage=form)
    beta, rows = t.lopd.beta0, []
    model.train()
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        o = lopd_step(setup, ctx["episodes"], ctx["refs"], beta)
        for p in student:  # the student does not move (lr 0): only φ changes Δ
            p.grad = None
        gn = float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], t.grad_clip))
        opt.step()
        rows.append({"step": step, "delta": o.delta, "beta": beta, "composer_kl": o.composer_kl,
                     "anchor": o.anchor, "student_kl": o.kl, "grad_norm": gn, "margin_defined": o.margin_defined,
                     "margin_binds": (o.delta < margin) if o.margin_defined else None})
        if o.margin_defined:  # as train.loop.update: no dual step when the centred Δ is undefined
            beta = dual_update(beta, margin, o.delta, eta)
    model.eval()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--margins", nargs="+", type=float, default=[0.0, 0.5])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--composer-lr", type=float, default=1e-3)
    ap.add_argument("--anchor", type=float, default=0.2)
    ap.add_argument("--eta-beta", type=float, default=10.0, help="train.lopd.eta_beta (recipe default 10; the paper's 0.5)")
    ap.add_argument("--margin-advantage", choices=["centred", "paper"], default="centred",
                    help="train.lopd.margin_advantage: Δ's form")
    ap.add_argument("--bank", type=int, default=16)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--coldstart-steps", type=int, default=10)
    ap.add_argument("--coldstart-lr", type=float, default=3e-3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-item-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="extra recipe overrides")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lopd_cli.runtime import setup_torch

    setup_torch()
    t0 = time.time()
    ctx = build(args)
    eps = ctx["episodes"]
    print(f"cold start {len(ctx['coldstart_loss'])} steps in {ctx['coldstart_s']:.0f} s, loss "
          f"{[round(x, 3) for x in ctx['coldstart_loss']]}")
    print(f"batch: {len(eps)} rollouts, rewards {[round(e.reward, 2) for e in eps]}, "
          f"{sum(sum(e.action_mask) for e in eps)} action tokens")
    runs = {}
    for m in args.margins:
        rows = run_margin(ctx, m, args.steps, args.composer_lr, args.anchor, args.eta_beta, args.margin_advantage)
        runs[str(m)] = rows
        print(f"m={m}: Δ " + " ".join(f"{r['delta']:+.3f}" for r in rows))
        print(f"      β " + " ".join(f"{r['beta']:.2f}" for r in rows))
        print(f"    KL " + " ".join(f"{r['composer_kl']:.3f}" for r in rows))
    out = {"command": "benchmarks/margin_collapse.py " + " ".join(os.sys.argv[1:]), "args": vars(args) | {"out": str(args.out)},
           "rewards": [e.reward for e in eps], "action_tokens": sum(sum(e.action_mask) for e in eps),
           "coldstart_loss": ctx["coldstart_loss"], "runs": runs, "load_average": list(os.getloadavg()),
           "wall_seconds": round(time.time() - t0, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out} in {out['wall_seconds']} s")


if __name__ == "__main__":
    main()
