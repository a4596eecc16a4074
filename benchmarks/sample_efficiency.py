"""Sample efficiency on `orders` with the tiny base policy: LOPD vs GRPO vs OPSD vs SFT (+ ablations).

Every method gets the same total rollout budget B, and every rollout lopd generates counts:

    LOPD, OPSD, ablations: B = bank filling (N_bank student rollouts of the base policy, which
                           also feed the cold start) + training rollouts
    SFT:                   bank filling only (it trains on the bank's successes, `--sft-steps`
                           steps, and spends no rollout: its curve stands at N_bank)
    SFT → LOPD:            the seed's SFT student, then LOPD from it (`train.init_from`) with
                           the rest of the budget, the seed's cold-start composer and LOPD's
                           teacher (the frozen base backbone)
    GRPO:                  B = training rollouts

`--team-logs N` first imports the scripted agent's logs of the last N training tasks and of the
validation tasks into every seed's bank, as `lopd demo` does (the team's prior agent on the
house-rules world: the experience SFT and the composer learn from). They are the user's logs,
not rollouts lopd generated, so they do not count toward B (as in the demo).

Per seed s (the training seed `train.seed` and the bank-filling sampling seed): one project
(copy of a template holding the tiny orders base policy, the same for every seed), a bank of
N_bank rollouts on N_bank training tasks drawn with seed s, its index and one cold-started
composer (shared by `lopd`, `lopd_margin0` and `lopd_frozen`, so they differ only in what the
issue ablates). Each method trains with checkpoints at a few budget points; every checkpoint
is evaluated afterwards on the TEST split (greedy, `eval.n` tasks), so the success-vs-rollouts
curve is on test while nothing is chosen by looking at it. Hyper-parameters come from the
recipe plus `--set` overrides (tune those on the validation split only, with `--split validation`).

Outputs (incremental: written after every evaluated checkpoint, so a partial run still yields
figures): `<out>/sample_efficiency.json`, `<out>/sample_efficiency.png` (test success vs
rollouts, mean ± 95 % t-interval over seeds) and the `lopd report` figure of the training
metrics for all runs (`<out>/sample_efficiency_report.png`).

    .venv/bin/python benchmarks/sample_efficiency.py            # full study
    .venv/bin/python benchmarks/sample_efficiency.py --quick    # minutes: 1 seed, tiny budget

`--method-budget METHOD=B` gives one method a smaller budget (the ablations, when time is short);
its checkpoints keep the main runs' spacing, so its points sit at the same rollout counts as
theirs and compare at equal budget.

On several cores, run one process per seed (each with its own `--work` and `--out`) and then
aggregate their JSON files into one table, plot and report:

    .venv/bin/python benchmarks/sample_efficiency.py --merge OUT_S0/sample_efficiency.json \
        OUT_S1/sample_efficiency.json ... --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import random
import os
import shutil
import tempfile
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# method name -> recipe overrides (on top of the shared ones)
METHODS: dict[str, list[str]] = {
    "lopd": ["train.algo=lopd"],
    "grpo": ["train.algo=grpo"],
    "opsd": ["train.algo=opsd"],
    "lopd_margin0": ["train.algo=lopd", "train.lopd.margin_m=0"],
    "lopd_frozen": ["train.algo=lopd", "train.lopd.freeze_composer=true"],
    "sft": ["train.algo=sft"],
    "sft_lopd": ["train.algo=lopd"],  # from the seed's SFT student (run_method adds train.init_from)
}
USES_BANK = {"lopd", "opsd", "lopd_margin0", "lopd_frozen", "sft", "sft_lopd"}
USES_COMPOSER = {"lopd", "lopd_margin0", "lopd_frozen", "sft_lopd"}


def t_interval(values: list[float]) -> tuple[float | None, float | None]:
    """(mean, 95 % half-width) over seeds; half-width None for one seed."""
    from lopd_cli.results.evaluate import mean_interval

    if not values:
        return None, None
    iv = mean_interval(values)
    return iv.estimate, iv.half_width


def crossing_budget(curve: list[tuple[float, float]], target: float) -> float | None:
    """Smallest rollout count at which a piecewise-linear success curve reaches `target`."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if y0 >= target:
            return x0
        if y1 >= target:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    if curve and curve[-1][1] >= target:
        return curve[-1][0]
    return None


def make_template(work: Path, say, base_policy: Path | None = None) -> Path:
    """The orders/tiny project every seed copies. `base_policy`: a tiny orders policy folder to
    use instead of the cached `lopd init` build (which trains one on first use)."""
    from lopd_cli.project import write_recipe_for_model
    from lopd_cli.project.scaffold import BASE_POLICY_BACKBONE, BASE_POLICY_DIR, _family_recipe, create_project

    tpl = work / "template"
    if tpl.exists():
        shutil.rmtree(tpl)
    create_project(tpl, example="orders", model="tiny", base_policy=base_policy is None)
    if base_policy is not None:
        shutil.copytree(base_policy, tpl / BASE_POLICY_DIR)
        write_recipe_for_model(_family_recipe("orders", "tiny"), tpl / "recipes" / "toolcall.yaml", BASE_POLICY_BACKBONE)
    say(f"template project {tpl} (base policy {base_policy or 'lopd init build'})")
    return tpl


def evaluate_model(recipe, model, tok, label: str, split: str, n: int | None) -> dict[str, Any]:
    from lopd_cli.results.evaluate import run_eval

    res, _ = run_eval(recipe, model, tok, label, split=split, n=n, success_threshold=recipe.eval.success_threshold)
    return {"success": res.success.estimate, "n": res.success.n,
            "reward": res.reward.estimate}


def fill_bank(project, recipe, n_bank: int, seed: int) -> dict[str, Any]:
    """N_bank base-policy rollouts on training tasks drawn with `seed`, into the bank, indexed."""
    import torch

    from lopd_cli.agent.runner import load_reward, make_env_factory, run_episodes, select_tasks
    from lopd_cli.bank.index import build_index
    from lopd_cli.bank.store import Bank
    from lopd_cli.models.backbone import load_backbone

    env_factory = make_env_factory(recipe)
    all_tasks = select_tasks(env_factory, "train", None)
    rng = random.Random(seed)
    tasks = [all_tasks[i] for i in rng.sample(range(len(all_tasks)), min(n_bank, len(all_tasks)))]
    tasks += [all_tasks[rng.randrange(len(all_tasks))] for _ in range(n_bank - len(tasks))]
    base, tok = load_backbone(recipe.model.backbone, recipe.model.dtype, recipe.model.device,
                              [recipe.base_dir, project.root])
    with torch.no_grad():
        eps = run_episodes(base, tok, env_factory, tasks, recipe.rollout, seed=seed, reward_fn=load_reward(recipe),
                           meta={"model": recipe.model.backbone, "split": "train", "generated_by": "lopd"})
    with Bank(project.bank_path(recipe), recipe.bank.min_reward) as bank:
        res = bank.add_records([e.to_record() for e in eps], source="sample_efficiency")
    build_index(project, recipe, progress=False)
    return {"added": res.added, "successes": res.successes}


def import_team_logs(project, recipe, n_train: int, seed: int) -> dict[str, Any]:
    """The scripted agent's logs (the team's prior agent, `envs.orders_agent.scripted_agent_records`)
    of the last `n_train` training tasks and of the validation tasks, through `logs/agent.jsonl`
    into the bank, as `lopd demo` does. Not indexed here: `fill_bank` indexes after it."""
    from lopd_cli.agent.runner import make_env_factory
    from lopd_cli.bank.store import Bank
    from lopd_cli.envs.orders_agent import scripted_agent_records

    env = make_env_factory(recipe)()
    records = scripted_agent_records(env.tasks("train")[-n_train:] + env.tasks("validation"), seed=seed)
    logs = project.root / "logs" / "agent.jsonl"
    logs.parent.mkdir(exist_ok=True)
    logs.write_text("".join(json.dumps(r) + "\n" for r in records))
    with Bank(project.bank_path(recipe), recipe.bank.min_reward) as bank:
        res = bank.add_file(logs)
    return {"added": res.added, "successes": res.successes}


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    return sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))


# ---------------------------------------------------------------------- aggregation (pure on the data)
def aggregate(data: dict[str, Any]) -> None:
    """Fill data["methods"] and data["lopd_fraction_of_budget_to_grpo_final"] from data["runs"]."""
    by_method: dict[str, list[dict]] = {}
    for r in data["runs"]:
        by_method.setdefault(r["method"], []).append(r)
    methods = {}
    for m, runs in by_method.items():
        finals = [r["curve"][-1]["success"] for r in runs]
        mean, hw = t_interval(finals)
        methods[m] = {"final_success_mean": mean, "final_success_ci95": hw, "seeds": [r["seed"] for r in runs],
                      "final_success_per_seed": finals,
                      "final_rollouts": [r["curve"][-1]["rollouts"] for r in runs],
                      "curve": mean_curve(runs)}
    data["methods"] = methods
    data["lopd_fraction_of_budget_to_grpo_final"] = None
    data["budget_fraction_to_grpo_final"] = None
    if "grpo" in methods:
        target = methods["grpo"]["final_success_mean"]
        # "with under 30 % of GRPO's rollouts": fractions are of the rollouts GRPO's final cost
        grpo_budget = sum(methods["grpo"]["final_rollouts"]) / len(methods["grpo"]["final_rollouts"])
        data["budget_fraction_to_grpo_final"] = {"target_grpo_final_success": target, "grpo_rollouts": grpo_budget,
                                                 "methods": {}}
        for m, runs in by_method.items():
            fr = [crossing_budget([(p["rollouts"], p["success"]) for p in last_at_each_budget(r["curve"])], target)
                  for r in runs]
            fr = [x / grpo_budget if x is not None else None for x in fr]
            got = [f for f in fr if f is not None]
            data["budget_fraction_to_grpo_final"]["methods"][m] = {
                "per_seed": fr, "seeds_reaching": len(got), "seeds": len(fr),
                "mean_over_reaching_seeds": t_interval(got)[0]}
    if "lopd" in methods and "grpo" in methods:
        target = methods["grpo"]["final_success_mean"]
        fracs, reached = [], []
        for r in by_method["lopd"]:
            x = crossing_budget([(p["rollouts"], p["success"]) for p in last_at_each_budget(r["curve"])], target)
            reached.append(x is not None)
            fracs.append(x / grpo_budget if x is not None else None)
        got = [f for f in fracs if f is not None]
        mean, hw = t_interval(got)
        data["lopd_fraction_of_budget_to_grpo_final"] = {
            "target_grpo_final_success": target, "per_seed": fracs, "seeds_reaching": sum(reached),
            "seeds": len(fracs), "mean_over_reaching_seeds": mean, "ci95": hw,
            "min": min(got) if got else None, "max": max(got) if got else None,
            "note": "per seed: first rollout count (linear between checkpoints) at which LOPD's test success "
                    "reaches GRPO's mean final test success, divided by GRPO's rollouts; None = not reached",
        }


def last_at_each_budget(curve: list[dict]) -> list[dict]:
    """A run's points without those a later point reached with no more rollouts. SFT spends no
    rollout, so its checkpoints all sit at the bank's count and only its final student stays."""
    kept: list[dict] = []
    for p in reversed(curve):
        if not kept or p["rollouts"] < kept[-1]["rollouts"]:
            kept.append(p)
    return kept[::-1]


def mean_curve(runs: list[dict]) -> list[dict[str, Any]]:
    """Per checkpoint step: success mean and 95 % t half-width over the seeds evaluated there, at
    the seeds' mean rollout count (a seed whose bank lost a duplicate rollout is one behind)."""
    curves = [last_at_each_budget(r["curve"]) for r in runs]
    out = []
    for step in sorted({p["step"] for c in curves for p in c}):
        pts = [p for c in curves for p in c if p["step"] == step]
        mean, hw = t_interval([p["success"] for p in pts])
        out.append({"step": step, "rollouts": round(sum(p["rollouts"] for p in pts) / len(pts)),
                    "success_mean": mean, "success_ci95": hw, "seeds": len(pts)})
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    """Success vs rollouts, mean and 95 % interval over seeds, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_method: dict[str, list[dict]] = {}
    for r in data["runs"]:
        by_method.setdefault(r["method"], []).append(r)
    right = max((p["rollouts"] for r in data["runs"] for p in r["curve"]), default=1)
    for m, runs in by_method.items():
        pts = mean_curve(runs)
        xs = [p["rollouts"] for p in pts]
        mean = [p["success_mean"] for p in pts]
        hw = [p["success_ci95"] or 0.0 for p in pts]
        style = {}
        if len(pts) == 1:  # spends no rollout after the bank (SFT): its level, drawn across
            xs, mean, hw, style = [xs[0], right], mean * 2, hw * 2, {"ls": "--"}
        lo = [a - b for a, b in zip(mean, hw)]
        hi = [a + b for a, b in zip(mean, hw)]
        line, = ax.plot(xs, mean, marker="o", ms=3, label=f"{m} ({len(runs)} seed{'s' if len(runs) > 1 else ''})",
                        **style)
        ax.fill_between(xs, np.clip(lo, 0, 1), np.clip(hi, 0, 1), color=line.get_color(), alpha=0.15)
    top = max((p["success"] for r in data["runs"] for p in r["curve"]), default=0.0)
    ax.set_ylim(0, min(1.0, max(0.25, top + 0.1)))  # from 0, so small differences look small
    ax.axvline(data["bank_rollouts"], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("rollouts (bank filling included)")
    ax.set_ylabel(f"{data['eval_split']} success (greedy, n={data['eval_n']})")
    ax.set_title(f"orders, tiny base policy, B={data['budget']}" + (" (PARTIAL)" if data["partial"] else ""))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def save(data: dict[str, Any], out: Path) -> None:
    """Write out/sample_efficiency.json atomically."""
    path = out / "sample_efficiency.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def finish(data: dict[str, Any], out: Path, report: bool) -> None:
    """Aggregate, save, plot and (optionally) draw the `lopd report` figure of every run."""
    aggregate(data)
    save(data, out)
    if data["runs"]:
        plot(data, out / "sample_efficiency.png")
        if report:
            from lopd_cli.results.report import write_report

            write_report([Path(r["run_dir"]) for r in data["runs"]], out / "sample_efficiency_report.png")


class Study:
    def __init__(self, args, say):
        self.args, self.say = args, say
        self.work = Path(args.work)
        self.out = Path(args.out)
        self.started = time.time()
        self.seed_projects: dict[int, tuple[Any, Path | None, bool]] = {}
        self.data: dict[str, Any] = {
            "partial": True, "budget": args.budget, "bank_rollouts": args.bank,
            "rollouts_per_step": args.rollouts_per_step, "eval_split": args.split, "eval_n": args.eval_n,
            "checkpoints_per_run": args.points, "base_policy": args.base_policy, "overrides": args.set, "methods": {}, "runs": [],
            "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        }

    # ------------------------------------------------------------------ recipe / steps
    def recipe(self, project, method: str, seed: int, extra: list[str] = ()):
        a = self.args
        sets = [f"rollout.rollouts_per_step={a.rollouts_per_step}", f"rollout.batch_size={a.rollouts_per_step}",
                f"train.seed={seed}", f"coldstart.seed={seed}", f"eval.split={a.split}", f"eval.n={a.eval_n}",
                f"coldstart.steps={a.coldstart_steps}"] + METHODS.get(method, []) + list(a.set) + list(extra)
        return project.load_recipe("toolcall", sets)

    def budget_for(self, method: str) -> int:
        return self.args.method_budget.get(method, self.args.budget)

    def steps_for(self, method: str) -> int:
        if method == "sft":
            return self.args.sft_steps
        prior = self.args.bank if method in USES_BANK else 0
        return max(1, (self.budget_for(method) - prior) // self.args.rollouts_per_step)

    # ------------------------------------------------------------------ stages
    def run(self) -> dict[str, Any]:
        from lopd_cli.runtime import setup_torch

        setup_torch()
        a = self.args
        self.out.mkdir(parents=True, exist_ok=True)
        tpl = make_template(self.work, self.say, Path(a.base_policy) if a.base_policy else None)
        from lopd_cli.project import open_project

        tproj = open_project(tpl)
        rec = self.recipe(tproj, "lopd", 0)
        from lopd_cli.models.backbone import load_backbone

        t0 = time.perf_counter()
        base, tok = load_backbone(rec.model.backbone, rec.model.dtype, rec.model.device, [rec.base_dir, tproj.root])
        self.data["base"] = evaluate_model(rec, base, tok, "base", a.split, a.eval_n)
        del base
        self.say(f"base policy on {a.split}: success {self.data['base']['success']:.3f} ({time.perf_counter() - t0:.0f} s)")
        self.save()
        # The headline pair first over all seeds, then the other methods: a partial run still
        # answers the main question.
        first = [m for m in a.methods if m in ("lopd", "grpo")]
        rest = [m for m in a.methods if m not in first]
        for group in (first, rest):
            for seed in a.seeds:
                for method in group:
                    if any(r["method"] == method and r["seed"] == seed for r in self.data["runs"]):
                        continue  # the SFT run an sft_lopd already made for this seed
                    project, composer_dir, bank_ok = self.prepare_seed(tpl, seed)
                    if method in USES_BANK and not bank_ok:
                        self.data.setdefault("skipped", []).append({"method": method, "seed": seed,
                                                                    "why": "too few successful bank rollouts"})
                        continue
                    self.run_method(project, method, seed, composer_dir)
        self.data["partial"] = False
        self.finish()
        return self.data

    def prepare_seed(self, tpl: Path, seed: int) -> tuple[Any, Path | None, bool]:
        """The seed's project: bank (N_bank base-policy rollouts), index, cold-started composer."""
        from lopd_cli.project import open_project
        from lopd_cli.train.coldstart import run_coldstart

        if seed in self.seed_projects:
            return self.seed_projects[seed]
        a = self.args
        pdir = self.work / f"seed{seed}"
        if pdir.exists():
            shutil.rmtree(pdir)
        shutil.copytree(tpl, pdir)
        project = open_project(pdir)
        composer_dir = None
        if any(m in USES_BANK for m in a.methods):
            t0 = time.perf_counter()
            rec = self.recipe(project, "lopd", seed)
            logged = {"added": 0, "successes": 0}
            if a.team_logs:
                logged = import_team_logs(project, rec, a.team_logs, seed)
                self.data.setdefault("team_logs", {})[str(seed)] = logged
            filled = fill_bank(project, rec, a.bank, seed)
            self.say(f"seed {seed}: bank {filled}, team logs {logged} ({time.perf_counter() - t0:.0f} s)")
            self.data.setdefault("bank", {})[str(seed)] = filled
            successes = filled["successes"] + logged["successes"]
            if successes < rec.bank.n_retrieve + 1:
                # Nothing to retrieve: the bank methods cannot run on this seed (recorded, not hidden).
                self.say(f"seed {seed}: only {successes} successful bank rollouts; bank methods skipped")
                self.seed_projects[seed] = (project, None, False)
                return self.seed_projects[seed]
            if any(m in USES_COMPOSER for m in a.methods):
                t0 = time.perf_counter()
                run_coldstart(project, rec, project.runs_dir / "coldstart", show_progress=False)
                composer_dir = project.runs_dir / "coldstart" / "composer"
                self.say(f"seed {seed}: cold start ({time.perf_counter() - t0:.0f} s)")
        self.seed_projects[seed] = (project, composer_dir, True)
        return self.seed_projects[seed]

    def run_method(self, project, method: str, seed: int, composer_dir: Path | None) -> None:
        from lopd_cli.models.student import load_student, read_checkpoint
        from lopd_cli.train.loop import train

        a = self.args
        steps = self.steps_for(method)
        # A method with a smaller budget keeps the main budget's checkpoint spacing, so its points
        # line up with the other curves' (equal-rollout comparisons).
        every = max(1, math.ceil(self.steps_for("lopd" if method in USES_BANK else "grpo") / a.points))
        if method == "sft":
            every = max(1, math.ceil(steps / a.points))
        extra = [f"train.steps={steps}", f"train.save_every={every}"]
        if composer_dir is not None and method in USES_COMPOSER:
            extra.append(f"train.lopd.composer_from={composer_dir}")
        start = self.data["base"]
        if method == "sft_lopd":
            sft_dir, start = self.sft_student(project, seed, composer_dir)
            extra.append(f"train.init_from={sft_dir}")
        rec = self.recipe(project, method, seed, extra)
        run_dir = project.runs_dir / method
        if run_dir.exists():
            shutil.rmtree(run_dir)
        t0 = time.perf_counter()
        tr = train(project, rec, run_dir)
        t_train = time.perf_counter() - t0
        # the bank's rollouts as added (a duplicate is dropped, so it can be one short of --bank)
        prior = self.data["bank"][str(seed)]["added"] if method in USES_BANK else 0
        curve = [{"rollouts": prior, "step": 0, **start}]
        t0 = time.perf_counter()
        for ck in checkpoint_dirs(run_dir):
            info = read_checkpoint(ck)
            meta = json.loads((ck / "checkpoint.json").read_text())
            model, tok = load_student(info, search_dirs=[rec.base_dir, project.root])
            fig = evaluate_model(rec, model, tok, method, a.split, a.eval_n)
            del model
            curve.append({"rollouts": int(meta["rollouts_total"]), "step": info.step, **fig})
        self.say(f"seed {seed} {method}: {steps} steps, {tr.state.rollouts_total} rollouts, train {t_train:.0f} s, "
                 f"eval {time.perf_counter() - t0:.0f} s; {a.split} success "
                 + " ".join(f"{p['rollouts']}:{p['success']:.3f}" for p in curve))
        self.data["runs"].append({"method": method, "seed": seed, "steps": steps, "budget": self.budget_for(method),
                                  "run_dir": str(run_dir),
                                  "train_seconds": t_train, "curve": curve})
        self.finish()

    def sft_student(self, project, seed: int, composer_dir: Path | None) -> tuple[Path, dict[str, Any]]:
        """The seed's SFT run (made by the "sft" method, or here when only "sft_lopd" runs) and its
        final checkpoint's figures: where SFT → LOPD starts."""
        done = [r for r in self.data["runs"] if r["method"] == "sft" and r["seed"] == seed]
        if not done:
            self.run_method(project, "sft", seed, composer_dir)
            done = [r for r in self.data["runs"] if r["method"] == "sft" and r["seed"] == seed]
        final = {k: v for k, v in done[-1]["curve"][-1].items() if k not in ("rollouts", "step")}
        return Path(done[-1]["run_dir"]), final

    # ------------------------------------------------------------------ output
    def save(self) -> None:
        self.data["elapsed_s"] = time.time() - self.started
        save(self.data, self.out)

    def finish(self) -> None:
        self.data["elapsed_s"] = time.time() - self.started
        finish(self.data, self.out, self.args.report)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, tiny budget: minutes")
    p.add_argument("--budget", type=int, default=512, help="total rollouts per method (B)")
    p.add_argument("--bank", type=int, default=64, help="bank-filling rollouts (LOPD/OPSD/ablations)")
    p.add_argument("--rollouts-per-step", type=int, default=16)
    p.add_argument("--points", type=int, default=4, help="checkpoints (test evaluations) per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--split", default="test", help="test for final figures; validation while tuning")
    p.add_argument("--eval-n", type=int, default=64, help="tasks per checkpoint evaluation (spread over the split)")
    p.add_argument("--base-policy", default=None, help="tiny orders policy folder (default: the cached `lopd init` one)")
    p.add_argument("--coldstart-steps", type=int, default=60)
    p.add_argument("--sft-steps", type=int, default=12, help="SFT steps (sft, and the start of sft_lopd)")
    p.add_argument("--team-logs", type=int, default=0,
                   help="import the scripted agent's logs of this many training tasks (+ validation) per seed")
    p.add_argument("--method-budget", action="append", default=[], metavar="METHOD=B",
                   help="a smaller budget for one method (e.g. the ablations), checkpoints spaced as the main runs'")
    p.add_argument("--set", action="append", default=[], help="extra recipe override KEY=VALUE (repeatable)")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "lopd_sample_efficiency"))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--no-report", dest="report", action="store_false", help="skip the `lopd report` figure")
    a = p.parse_args(argv)
    if a.quick:
        # Exercises every stage in minutes; the figures mean nothing. bank.min_reward 0 keeps
        # the bank non-empty whatever the base policy's success rate.
        a.budget, a.bank, a.rollouts_per_step, a.points, a.eval_n = 24, 8, 4, 1, 4
        a.seeds, a.coldstart_steps, a.sft_steps = a.seeds[:1], 2, 2
        a.team_logs = a.team_logs or 8
        a.set = ["rollout.max_new_tokens=32", "rollout.max_turns=3", "train.grpo.group_size=2",
                 "bank.min_reward=0.0", "bank.n_retrieve=1", "coldstart.val_n=8"] + a.set
    if a.bank >= a.budget:
        p.error("--bank must be below --budget")
    budgets = {}
    for item in a.method_budget:
        name, _, value = item.partition("=")
        if name not in METHODS or not value.isdigit() or not a.bank < int(value) <= a.budget:
            p.error(f"--method-budget {item!r}: want METHOD=B with METHOD one of {', '.join(METHODS)} "
                    f"and {a.bank} < B <= {a.budget}")
        budgets[name] = int(value)
    a.method_budget = budgets
    return a


def merge(paths: list[Path], out: Path, report: bool = True) -> dict[str, Any]:
    """One study from several runs of this script (e.g. one process per seed, or a longer run of
    one method). They must share the design (bank, rollouts per step, split, eval size); budgets
    may differ (each run keeps its own). Runs are concatenated, except that a later file's run
    of the same method and seed replaces an earlier file's (e.g. GRPO rerun to a larger budget)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    design = ("bank_rollouts", "rollouts_per_step", "eval_split", "eval_n")
    for p, d in zip(paths[1:], parts[1:]):
        for k in design:
            if d.get(k) != parts[0].get(k):
                raise SystemExit(f"{p}: {k} = {d.get(k)!r} differs from {paths[0]}'s {parts[0].get(k)!r}")
    data = dict(parts[0])
    runs: dict[tuple[str, int], dict] = {}
    replaced = []
    for p, d in zip(paths, parts):
        for r in d["runs"]:
            r = {"budget": d["budget"], **r}
            key = (r["method"], r["seed"])
            if key in runs:
                replaced.append(f"{key[0]} seed {key[1]}: {runs[key]['budget']} by {r['budget']} rollouts ({p})")
            runs[key] = r
    data["runs"] = list(runs.values())
    data["replaced_runs"] = replaced
    data["budget"] = max(d["budget"] for d in parts)
    data["partial"] = any(d.get("partial", True) for d in parts)
    data["bank"] = {k: v for d in parts for k, v in d.get("bank", {}).items()}
    data["team_logs"] = {k: v for d in parts for k, v in d.get("team_logs", {}).items()}
    data["skipped"] = [x for d in parts for x in d.get("skipped", [])]
    data["command"] = " && ".join(d["command"] for d in parts)
    data["merged_from"] = [str(p) for p in paths]
    data["elapsed_s"] = sum(d.get("elapsed_s", 0.0) for d in parts)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    finish(data, out, report)
    return data


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--merge":
        p = argparse.ArgumentParser(description="aggregate several sample_efficiency.json files")
        p.add_argument("--merge", nargs="+", required=True, type=Path)
        p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
        p.add_argument("--no-report", dest="report", action="store_false")
        m = p.parse_args(argv)
        return merge(m.merge, Path(m.out), m.report)
    args = parse_args(argv)
    return Study(args, lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", flush=True)).run()


if __name__ == "__main__":
    main()
