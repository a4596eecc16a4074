"""Retention study (issue 47): evolve rounds with retention in the gate, one arm per method, several
seeds, the same rollout budget; each final incumbent scored on the target world's test tasks and
on the retention world's, paired against the starting model.

    PROJECT=$(mktemp -d)/rs   # any empty folder outside the repo
    LOPD_THREADS=1 python benchmarks/retention_study.py prepare --project "$PROJECT"
    LOPD_THREADS=1 python benchmarks/retention_study.py run --project "$PROJECT" \
        --out benchmarks/results/retention_study --seeds 0 1 --jobs 2 --budget 768

`prepare` makes the project: `lopd init --example orders --model tiny` (the shipped base policy),
the target recipe `toolcall` (house rule set 0, the demo's world), the retention recipe `plain`
(the orders world without house rules, where the base policy already succeeds: 28 % of 128 test
tasks), the demo's scripted-agent logs of rule set 0 in the bank, the index, a cold start
(LOPD's composer) and the starting model: SFT's pass on the logs (runs/sft). The house rules ask
for a refund reason, a look-up before acting and a sign-off that the plain world does not, so
learning them can cost what the model did there: forgetting is possible here by design.

`run` evolves each arm in its own copy of the project, from runs/sft (`train.init_from`,
`evolve.start=incumbent`), with `evolve.retain=[own-rules]`, until the next round would exceed
the budget; then `lopd eval` of the start and of the final incumbent on both test splits (an
incumbent that is still the start keeps the start's scores: greedy decoding gives the same
outcomes, as the SmolLM2 runs that re-scored it saw three times). An arm
is NAME=ALGO[:key=value,...] (default: sft, sft+recovery, lopd, sdpo, grpo). Writes OUT/study.json
(per arm and seed: rounds, rollouts, CPU seconds, target and retention test success and their
paired change against the start), OUT/study.md (the table) and OUT/study.png (target change
against retention change, one point per run, the arm's mean as a cross). Runs already finished
under OUT/work are reused, and so are the runs of earlier launches in OUT/study.json (same model,
rounds, budget and test size): a study can grow by a few arms per launch. start.json keeps the
starting model's sha256; a launch whose start differs stops (a start.json from before the hash
was kept is checked once by scoring the start's target test split again).

`--model smollm2` is the same study on SmolLM2-135M-Instruct, the issue's real model: the project
is `lopd init --example orders --model smollm2-135m-instruct` with the same logs, the retention
recipe `bfcl` (packaged `bfcl-smollm2-sft.yaml`: BFCL's five single-turn categories, official
checkers), no cold start in `prepare` and SmolLM2-sized rounds (SMOLLM2 below). `coldstart` then
adds LOPD's composer, trained for the teacher the lopd arm has: the starting model (`train.teacher=init`):

    PROJECT=$(mktemp -d)/rs2
    LOPD_THREADS=2 python benchmarks/retention_study.py prepare --model smollm2 --project "$PROJECT"
    LOPD_THREADS=1 python benchmarks/retention_study.py coldstart --model smollm2 --project "$PROJECT"
    LOPD_THREADS=1 python benchmarks/retention_study.py run --model smollm2 --project "$PROJECT" \
        --out benchmarks/results/retention_study_smollm2 --arms sft=sft sft+recovery=sft:evolve.recover_steps=1 \
        --seeds 0 --jobs 2 --budget 48 -n 64 --base retain

`retest` scores the target world's test split again at a larger n for the start and every final
incumbent in OUT/study.json, paired (OUT/retest-nN.json and .md; the issue asks n >= 128);
`--world retain` does the same on the retention world's test split (OUT/retest-retain-nN.*):

    LOPD_THREADS=1 python benchmarks/retention_study.py retest --model smollm2 --project "$PROJECT" \
        --out benchmarks/results/retention_study_smollm2 -n 128 --jobs 2 [--world retain]

Once both worlds are retested at one n, OUT/retest-nN.png plots them as study.png plots the study.
`plot --out OUT` redraws both plots from the files in OUT.

What it simplifies: with `--model tiny` (the default), the 1.1M model stands in for SmolLM2-135M
(one SmolLM2 SFT step costs minutes on 2 cores, an arm of rounds hours); with `--model smollm2`
the rounds are a few steps and the test splits 64 tasks, what this CPU allows. Evolve's own gate
keeps the validation tasks and the retention world's validation tasks apart from the test tasks
scored here.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from evolve_study import paired  # the paired mean and its normal 95 % interval, as that study reports it

START = "runs/sft"
ARMS = ["sft=sft", "sft+recovery=sft:evolve.recover_steps=4", "lopd=lopd", "sdpo=sdpo", "grpo=grpo"]


@dataclass(frozen=True)
class Profile:
    """One model's study: its worlds, its starting model's SFT pass, the rounds every arm shares."""
    model: str            # lopd init --model
    target: str           # the target recipe (the project's default, house rule set 0)
    retain: str           # the retention recipe (its file stem names the world in rounds.jsonl)
    start_sets: list      # SFT's pass on the logs: the starting model runs/sft
    common: list          # every arm's rounds
    coldstart: bool       # LOPD's composer (only the lopd arm needs it)


TINY = Profile(
    model="tiny", target="toolcall", retain="plain",
    start_sets=["train.algo=sft", "train.steps=48", "train.save_every=48", "train.sft.batch=32"],
    # a round: 64 rollouts of new training tasks; 12 training steps; LOPD/SDPO/GRPO roll out 16
    # episodes per step, SDPO and GRPO in groups of 4
    common=[f"train.init_from={START}", "evolve.start=incumbent", "evolve.retain=[plain]",
            "evolve.tasks_per_round=64", "evolve.steps=12", "evolve.val_n=64", "evolve.retain_tolerance=0.05",
            "rollout.rollouts_per_step=16", "rollout.batch_size=32", "train.sft.batch=32",
            "train.grpo.group_size=4", "train.sdpo.group_size=4", "train.lr=1e-3"],
    coldstart=True)
SMOLLM2 = Profile(
    model="smollm2-135m-instruct", target="toolcall", retain="bfcl",
    # 12 SFT steps of 8 logged successes (96 examples; 21.9 % of 32 orders test tasks when first run)
    start_sets=["train.algo=sft", "train.steps=12", "train.save_every=12", "train.sft.batch=8", "train.micro_batch=1"],
    # a round: 16 rollouts of new training tasks, 3 SFT steps of 8; on-policy arms 8 episodes per step
    # (groups of 4); 16 validation tasks per world, so the tolerance is two tasks (12.5 points)
    common=[f"train.init_from={START}", "evolve.start=incumbent", "evolve.retain=[bfcl]",
            "evolve.tasks_per_round=16", "evolve.steps=3", "evolve.val_n=16", "evolve.retain_tolerance=0.1",
            "rollout.rollouts_per_step=8", "rollout.batch_size=8", "train.sft.batch=8", "train.micro_batch=1",
            "train.grpo.group_size=4", "train.sdpo.group_size=4", "train.lr=1e-3"],
    coldstart=False)
PROFILES = {"tiny": TINY, "smollm2": SMOLLM2}
# `coldstart` (SmolLM2): the composer is trained for the teacher the lopd arm uses, the starting model
COLDSTART_SETS = ["train.teacher=init", f"train.init_from={START}"]


LIVE: set[int] = set()  # process groups of the lopd runs in flight
STOPPING = threading.Event()


def stop(signum: int, _frame) -> None:
    """SIGTERM/SIGINT: stop the lopd runs in flight too (left alone they run on, orphaned, holding the
    CPU), launch no more, and exit with one line. Finished runs and evaluations are kept."""
    STOPPING.set()
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        for pg in list(LIVE):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pg, sig)
        deadline = time.time() + wait_s
        while LIVE and time.time() < deadline:
            time.sleep(0.1)
    sys.exit(f"retention_study: stopped by {signal.Signals(signum).name}; its lopd runs were stopped too. "
             "Finished runs and evaluations are kept; unfinished ones start again on the next launch.")


def lopd(args: list[str], cwd: Path, log: Path) -> tuple[str, float]:
    """Run the CLI in `cwd`: (stdout, CPU seconds of that process and its children)."""
    if STOPPING.is_set():
        raise RuntimeError("stopped")
    env = {**os.environ, "LOPD_THREADS": os.environ.get("LOPD_THREADS", "1")}
    out = log.with_suffix(".out")
    with out.open("w") as fo, log.open("a") as fe:
        fe.write(f"$ lopd {' '.join(args)}\n")
        fe.flush()
        proc = subprocess.Popen([sys.executable, "-m", "lopd_cli", *args], cwd=cwd, env=env, text=True,
                                stdout=fo, stderr=fe, start_new_session=True)  # its own group: `stop` ends it whole
        LIVE.add(proc.pid)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            LIVE.discard(proc.pid)
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise RuntimeError(f"lopd {' '.join(args[:2])} in {cwd} failed (exit {code}); see {log}")
    return out.read_text(), usage.ru_utime + usage.ru_stime


def prepare(project: Path, prof: Profile) -> None:
    from lopd_cli.bank.index import build_index
    from lopd_cli.bank.store import Bank
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.envs.orders_agent import scripted_agent_records
    from lopd_cli.pipeline.demo import AGENT_LOGS, DEMO_OVERRIDES
    from lopd_cli.project.scaffold import create_project
    from lopd_cli.project import packaged_recipes
    from lopd_cli.train.coldstart import run_coldstart
    from lopd_cli.train.loop import train

    if project.exists():
        shutil.rmtree(project)
    proj = create_project(project, example="orders", model=prof.model)
    if prof is TINY:
        data = yaml.safe_load((proj.recipes_dir / f"{prof.target}.yaml").read_text())
        retain = {**data, "env": {**data["env"], "kwargs": {**data["env"]["kwargs"], "house_rules": False}}}
        head = "# the orders world without house rules: the retention world of benchmarks/retention_study.py\n"
        overrides = DEMO_OVERRIDES  # the demo's sizes, as the tiny study was first run
    else:
        retain = yaml.safe_load((packaged_recipes() / "bfcl-smollm2-sft.yaml").read_text())
        head = "# BFCL's single-turn categories: the retention world of benchmarks/retention_study.py --model smollm2\n"
        overrides = []
    (proj.recipes_dir / f"{prof.retain}.yaml").write_text(head + yaml.safe_dump({**retain, "name": prof.retain},
                                                                                  sort_keys=False))
    recipe = proj.load_recipe(prof.target, overrides)
    env = OrdersEnv(**recipe.env.kwargs)
    records = scripted_agent_records(env.tasks("train")[-AGENT_LOGS:] + env.tasks("validation"), seed=0)
    logs = proj.root / "logs" / "agent.jsonl"
    logs.parent.mkdir(exist_ok=True)
    logs.write_text("".join(json.dumps(r) + "\n" for r in records))
    with Bank(proj.bank_path(recipe), recipe.bank.min_reward) as bank:
        bank.add_file(logs)
    build_index(proj, recipe, progress=True)
    if prof.coldstart:
        run_coldstart(proj, recipe, proj.runs_dir / "coldstart", show_progress=True)
    train(proj, proj.load_recipe(prof.target, [*overrides, *prof.start_sets]), proj.runs_dir / "sft")


def coldstart(project: Path, prof: Profile) -> None:
    """LOPD's composer for a project `prepare` made without one: `lopd coldstart` with the target
    recipe's own cold-start settings, its teacher the starting model (train.teacher=init of runs/sft),
    the teacher the lopd arm distils from (COLDSTART_SETS); it ends with the check on held-out
    validation successes: does that teacher gain from the latents?"""
    if not (project / START / "checkpoints").is_dir():
        sys.exit(f"{project / START}: no starting model (run `prepare` first)")
    args = ["coldstart", "--recipe", prof.target, "--run", "coldstart", "--json"]
    for s in COLDSTART_SETS:
        args += ["--set", s]
    out, cpu = lopd(args, project, project / "logs" / "coldstart.log")
    print(out, end="")
    print(f"cold start: {cpu:.0f} CPU s; log {project / 'logs' / 'coldstart.log'}", flush=True)


def evaluate(recipe: str, checkpoint: str | None, n: int, work: Path, tag: str, log: Path) -> dict[str, bool]:
    """{task id: solved} of one model on a recipe's test split (greedy)."""
    eps = work / f"test-{tag}.jsonl"
    out_file = log.with_suffix(".out")
    if eps.exists() and out_file.exists() and _finished(json.loads(out_file.read_text()), recipe, n) \
            and len(eps.read_text().splitlines()) == n:
        out = out_file.read_text()
    else:
        args = ["eval", "--recipe", recipe, "--split", "test", "-n", str(n), "--json", "--rollouts", str(eps)]
        args += ["--checkpoint", checkpoint] if checkpoint else ["--backbone"]
        out, _ = lopd(args, work, log)
    thr = json.loads(out)["success_threshold"]
    return {(e := json.loads(line))["task_id"]: e["reward"] >= thr for line in eps.read_text().splitlines()}


def _finished(out: dict, recipe: str, n: int) -> bool:
    """An evaluation's JSON from before is this one: same recipe, split and number of tasks."""
    return Path(out.get("recipe", "")).stem == recipe and out.get("split") == "test" and out.get("n") == n


def rate(x: dict[str, bool]) -> float:
    return sum(x.values()) / len(x)


def start_fingerprint(project: Path) -> str:
    """sha256 of the starting model's weights: scores from another launch pair with this start only if equal."""
    h, n = hashlib.sha256(), 0
    for f in sorted((project / START / "checkpoints" / "latest").resolve().rglob("*.safetensors")):
        h.update(f.read_bytes())
        n += 1
    if not n:
        sys.exit(f"{project / START}: no checkpoint weights (run `prepare` first)")
    return h.hexdigest()


def start_scores(a: argparse.Namespace) -> dict:
    f = a.out / "start.json"
    done = json.loads(f.read_text()) if f.exists() else {}
    work = a.work / "start"
    work.mkdir(parents=True, exist_ok=True)
    prof = a.profile
    sha = start_fingerprint(a.project)
    if done.get("start_sha256") not in (None, sha):
        sys.exit(f"{f}: scored another starting model (start_sha256 {done['start_sha256'][:12]}, "
                 f"{a.project / START} is {sha[:12]}); use another --out or delete {f}")
    if "target" in done and "start_sha256" not in done:  # scored before the hash was kept: score the target again
        again = evaluate(prof.target, START, a.n, a.project, "start-target-again", work / "study-start-target-again.log")
        if again != done["target"]:
            sys.exit(f"{f}: {a.project / START} is not the start these scores are of (its target test outcomes "
                     f"differ on {sum(again[k] != done['target'].get(k) for k in again)} tasks); use another --out")
        done["start_sha256"] = sha
        f.write_text(json.dumps(done))
    todo = {"target": (prof.target, START, "start-target"), "retain": (prof.retain, START, "start-retain")}
    if a.base in ("both", "retain"):
        todo["base_retain"] = (prof.retain, None, "base-retain")
    if a.base == "both":
        todo["base_target"] = (prof.target, None, "base-target")
    todo = {k: v for k, v in todo.items() if k not in done}
    if not todo:
        return done
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:  # side by side, like the runs
        futures = {k: pool.submit(evaluate, recipe, ckpt, a.n, a.project, tag, work / f"study-{tag}.log")
                   for k, (recipe, ckpt, tag) in todo.items()}
        out = {**done, **{k: f.result() for k, f in futures.items()}, "start_sha256": sha}
    f.write_text(json.dumps(out))
    return out


def run_one(arm: str, seed: int, a: argparse.Namespace, start: dict) -> dict:
    prof = a.profile
    name, spec = arm.split("=", 1)
    algo, _, extra = spec.partition(":")
    work = a.work / f"{name}-s{seed}"
    done = work / "study_run.json"
    if done.exists():
        result = json.loads(done.read_text())
        if "candidates" not in result:  # finished before the field existed: from its rounds.jsonl
            rows = [json.loads(x) for x in (work / "runs" / "ev" / "rounds.jsonl").read_text().splitlines()]
            result["candidates"] = [{"round": r["round"], "accepted": r["accepted"],
                                     "target_vs_start": r["validation"]["mean"] - rows[0]["validation"]["mean"],
                                     "retain_vs_start": r["retention"][prof.retain]["vs_start"]["mean"],
                                     "time_split": r.get("time_split")} for r in rows[1:]]
        return result
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(a.project, work, ignore=shutil.ignore_patterns("evolve-*", "export*", "test-*.jsonl"))
    log = work / "study.log"
    sets = [*prof.common, *a.set, *(s for s in extra.split(",") if s), f"evolve.seed={seed}",
            f"evolve.rollout_budget={a.budget}"]
    args = ["evolve", "--recipe", prof.target, "--algo", algo, "--run", "ev", "--rounds", "99"]
    for s in sets:
        args += ["--set", s]
    t0 = time.time()
    _, cpu = lopd(args, work, log)
    wall = time.time() - t0
    rows = [json.loads(x) for x in (work / "runs" / "ev" / "rounds.jsonl").read_text().splitlines()]
    final = str(work / "runs" / "ev")
    if rows[-1]["incumbent_round"] == 0:  # every candidate rejected: the incumbent is the start, already scored
        target, retain = start["target"], start["retain"]
    else:
        target = evaluate(prof.target, final, a.n, work, "target", log)
        retain = evaluate(prof.retain, final, a.n, work, "retain", log)
    result = {"arm": name, "algo": algo, "seed": seed, "sets": sets, "rounds": len(rows) - 1,
              "accepted": sum(r["accepted"] for r in rows[1:]), "incumbent_round": rows[-1]["incumbent_round"],
              "rollouts": rows[-1]["rollouts_total"], "evolve_cpu_s": round(cpu, 1), "evolve_wall_s": round(wall, 1),
              "target": rate(target), "retain": rate(retain),
              "target_vs_start": paired(target, start["target"]), "retain_vs_start": paired(retain, start["retain"]),
              "rejected_for_retention": sum(1 for r in rows[1:] if r["reason"].startswith("rejected: forgets")),
              "stage_seconds": [r.get("seconds") for r in rows[1:]],
              # every candidate the gate saw, on validation tasks: target and retention change against the start
              "candidates": [{"round": r["round"], "accepted": r["accepted"],
                              "target_vs_start": r["validation"]["mean"] - rows[0]["validation"]["mean"],
                              "retain_vs_start": r["retention"][prof.retain]["vs_start"]["mean"],
                              "time_split": r.get("time_split")} for r in rows[1:]]}
    done.write_text(json.dumps(result, indent=1))
    return result


def earlier_runs(a: argparse.Namespace, launched: set[tuple[str, int]]) -> list[dict]:
    """Runs in OUT/study.json from earlier launches of the same study (same model, rounds, budget,
    test size and overrides; start.json has checked the start) that this launch did not run again."""
    f = a.out / "study.json"
    if not f.exists():
        return []
    old = json.loads(f.read_text())
    same = (old.get("model"), old.get("common"), old.get("budget"), old.get("n_test"), old.get("sets")) == \
        (a.profile.model, a.profile.common, a.budget, a.n, a.set)
    if not same:
        print(f"{f}: an earlier study with other settings; its runs are not kept", flush=True)
        return []
    return [r for r in old["runs"] if (r["arm"], r["seed"]) not in launched]


def table(results: list[dict], start: dict, val_n: int) -> str:
    pct = lambda iv: f"{100 * iv['mean']:+.1f} [{100 * iv['low']:+.1f}, {100 * iv['high']:+.1f}]"  # noqa: E731
    base = "".join(f"; base model, {what}: {100 * rate(start[k]):.1f} %" + (
        f" (start − base {pct(paired(start[k[5:]], start[k]))})" if k == "base_retain" else "")
        for k, what in (("base_target", "target"), ("base_retain", "retention")) if k in start)
    lines = [f"Start (SFT's pass): target {100 * rate(start['target']):.1f} % of {len(start['target'])}, retention "
             f"{100 * rate(start['retain']):.1f} % of {len(start['retain'])}{base} (test tasks, greedy).", "",
             "| arm | seed | rounds (accepted; rejected for retention) | rollouts | CPU s | target test % | "
             "− start (points) | retention test % | − start (points) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["arm"], r["seed"])):
        lines.append(f"| {r['arm']} | {r['seed']} | {r['rounds']} ({r['accepted']}; {r['rejected_for_retention']}) "
                     f"| {r['rollouts']} | {r['evolve_cpu_s']:.0f} | {100 * r['target']:.1f} | {pct(r['target_vs_start'])} "
                     f"| {100 * r['retain']:.1f} | {pct(r['retain_vs_start'])} |")
    lines += ["", f"Every candidate the gate judged (validation tasks, greedy, {val_n} per world; before the gate), "
              "mean over rounds, and where the rounds' time went:", "",
              "| arm | seed | candidates | target − start | retention − start | rollouts / training steps / "
              "validation / set-up (% of the rounds' time) |", "|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["arm"], r["seed"])):
        c = r.get("candidates") or []
        if not c:
            continue
        split = {k: sum((x["time_split"] or {}).get(k, 0.0) for x in c) for k in
                 ("rollouts", "training_steps", "validation", "bank_index", "setup")}
        total = sum(split.values()) or 1.0
        lines.append(f"| {r['arm']} | {r['seed']} | {len(c)} | {100 * sum(x['target_vs_start'] for x in c) / len(c):+.1f} "
                     f"| {100 * sum(x['retain_vs_start'] for x in c) / len(c):+.1f} | "
                     + " / ".join(f"{100 * split[k] / total:.0f}" for k in ("rollouts", "training_steps", "validation", "setup"))
                     + " |")
    return "\n".join(lines) + "\n"


def study_points(results: list[dict]) -> list[dict]:
    """(arm, seed, target − start, retention − start) in points, from study.json's runs."""
    return [{"arm": r["arm"], "seed": r["seed"], "x": 100 * r["target_vs_start"]["mean"],
             "y": 100 * r["retain_vs_start"]["mean"]} for r in results]


def retest_points(target: dict, retain: dict) -> list[dict]:
    """The same, from the two retests at one n (retest-nN.json, retest-retain-nN.json): the runs
    retested on both worlds."""
    kept = {(r["arm"], r["seed"]): r for r in retain["runs"] if r["retested"]}
    return [{"arm": r["arm"], "seed": r["seed"], "x": 100 * r["target_vs_start"]["mean"],
             "y": 100 * kept[(r["arm"], r["seed"])]["retain_vs_start"]["mean"]}
            for r in target["runs"] if r["retested"] and (r["arm"], r["seed"]) in kept]


def shared_spots(points: list[dict]) -> dict[tuple[float, float], list[str]]:
    """The spots where two or more runs land (to 0.01 points), with the runs' names."""
    spots: dict[tuple[float, float], list[str]] = {}
    for p in points:
        spots.setdefault((round(p["x"], 2), round(p["y"], 2)), []).append(f"{p['arm']} s{p['seed']}")
    return {xy: sorted(names) for xy, names in spots.items() if len(names) > 1}


def plot(points: list[dict], out: Path, title: str = "evolve arms: what each gained and kept") -> None:
    """Target against retention per run, each arm's mean as an X. Runs that land on the same spot
    (unchanged incumbents sit on (0, 0)) are named beside it, so none is hidden."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 5), constrained_layout=True)
    for i, arm in enumerate(sorted({p["arm"] for p in points})):
        runs = [p for p in points if p["arm"] == arm]
        xs, ys = [p["x"] for p in runs], [p["y"] for p in runs]
        c = plt.get_cmap("tab10")(i)
        ax.scatter(xs, ys, color=c, alpha=0.6)
        ax.scatter([sum(xs) / len(xs)], [sum(ys) / len(ys)], color=c, marker="X", s=120, label=f"{arm} (mean)")
    for (x, y), names in shared_spots(points).items():
        ax.annotate(f"{len(names)} runs: " + ", ".join(sorted(names)), (x, y), xytext=(6, -4),
                        textcoords="offset points", fontsize=6, va="top", wrap=True)
    ax.axhline(0, color="grey", lw=0.8)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel("target test success − start (points, paired)")
    ax.set_ylabel("retention test success − start (points, paired)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def replot(out: Path) -> list[Path]:
    """Redraw OUT/study.png from study.json, and OUT/retest-nN.png wherever both worlds were
    retested at n = N."""
    if not (out / "study.json").exists():
        sys.exit(f"{out}: no study.json here (run `run` first)")
    study = json.loads((out / "study.json").read_text())
    plot(study_points(study["runs"]), out / "study.png",
         f"evolve arms: what each gained and kept (n = {study['n_test']})")
    drawn = [out / "study.png"]
    for target_file in sorted(out.glob("retest-n*.json")):
        n = target_file.stem.removeprefix("retest-n")
        retain_file = out / f"retest-retain-n{n}.json"
        if retain_file.exists():
            png = out / f"retest-n{n}.png"
            plot(retest_points(json.loads(target_file.read_text()), json.loads(retain_file.read_text())), png,
                 f"evolve arms: what each gained and kept (retested, n = {n})")
            drawn.append(png)
    return drawn


def sign_test(up: int, down: int) -> float:
    """Exact two-sided sign test (McNemar's) on the discordant tasks: with few flips the normal
    interval of `paired` is too narrow (5 up, 0 down gives [+0.5, +7.3] points at n = 128, p = 0.06)."""
    n, k = up + down, min(up, down)
    return 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def retest(a: argparse.Namespace) -> None:
    """One world's test split (`--world`: target or retain) again at a larger n (`-n`), for the start
    and every final incumbent in OUT/study.json: OUT/retest-nN.json and .md for the target,
    OUT/retest-retain-nN.* for the retention world. An incumbent that is still the start
    takes the start's outcomes; a run whose work folder is gone is listed as not retested. The
    first tasks are those the study scored, so each model's outcomes there are checked against its
    earlier ones (greedy decoding: they should agree)."""
    prof, out = a.profile, a.out
    if not (out / "study.json").exists() or not (out / "start.json").exists():
        sys.exit(f"{out}: no study.json and start.json here (run `run` first)")
    study = json.loads((out / "study.json").read_text())
    first = json.loads((out / "start.json").read_text())
    sha = start_fingerprint(a.project)
    if first.get("start_sha256") != sha:
        sys.exit(f"{out / 'start.json'}: another starting model than {a.project / START}; use its own project")
    world = a.world
    recipe = prof.target if world == "target" else prof.retain
    tag = f"{world}-n{a.n}"
    name = f"retest-n{a.n}" if world == "target" else f"retest-{world}-n{a.n}"

    def earlier(path: Path) -> dict[str, bool]:
        """The study's outcomes of one incumbent on the first tasks, at the world's threshold."""
        if not path.exists():
            return {}
        return {(e := json.loads(x))["task_id"]: e["reward"] >= thr for x in path.read_text().splitlines()}

    def score(r: dict) -> dict[str, bool] | None:
        work = a.work / f"{r['arm']}-s{r['seed']}"
        if not (work / "runs" / "ev").exists():
            return None
        return evaluate(recipe, str(work / "runs" / "ev"), a.n, work, tag, work / f"study-{tag}.log")

    (a.work / "start").mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:  # the start and the moved incumbents side by side
        start_job = pool.submit(evaluate, recipe, START, a.n, a.project, f"start-{tag}",
                                a.work / "start" / f"study-start-{tag}.log")
        jobs = [None if r["incumbent_round"] == 0 else pool.submit(score, r) for r in study["runs"]]
        start = start_job.result()
        scored = [start if j is None else j.result() for j in jobs]
    thr = json.loads((a.work / "start" / f"study-start-{tag}.out").read_text())["success_threshold"]
    start_flips = sum(start[k] != v for k, v in first[world].items())
    rows = []
    for r, got in zip(study["runs"], scored):
        row = {"arm": r["arm"], "seed": r["seed"], "incumbent_round": r["incumbent_round"], "retested": got is not None}
        if got is not None:
            before = {} if r["incumbent_round"] == 0 else \
                earlier(a.work / f"{r['arm']}-s{r['seed']}" / f"test-{world}.jsonl")
            row |= {world: rate(got), f"{world}_vs_start": paired(got, start),
                    "up": sum(got[t] and not start[t] for t in got), "down": sum(start[t] and not got[t] for t in got),
                    "flips_against_n_test": sum(got[k] != v for k, v in before.items())}
            row["sign_test_p"] = sign_test(row["up"], row["down"])
        rows.append(row)
    (out / f"{name}.json").write_text(json.dumps({"n": a.n, "n_test": study["n_test"], "start": rate(start),
                                                         "start_flips_against_n_test": start_flips, "runs": rows}, indent=1))
    pct = lambda iv: f"{100 * iv['mean']:+.1f} [{100 * iv['low']:+.1f}, {100 * iv['high']:+.1f}]"  # noqa: E731
    title = "Target test split" if world == "target" else f"Retention world ({recipe}) test split"
    lines = [f"{title} at n = {a.n} (the study scored the first {study['n_test']}): start "
             f"{100 * rate(start):.1f} % ({start_flips} of its first {study['n_test']} outcomes differ from the study's).", "",
             f"| arm | seed | incumbent round | {world} test % | − start (points) | tasks up / down | exact sign test p | "
             f"outcomes that differ from the first {study['n_test']} |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["arm"], r["seed"])):
        if not r["retested"]:
            lines.append(f"| {r['arm']} | {r['seed']} | {r['incumbent_round']} | not retested (its work folder is gone) | | | | |")
            continue
        lines.append(f"| {r['arm']} | {r['seed']} | {r['incumbent_round']} | {100 * r[world]:.1f} | "
                     f"{pct(r[f'{world}_vs_start'])} | {r['up']} / {r['down']} | {r['sign_test_p']:.3g} | "
                     + ("(the start)" if r["incumbent_round"] == 0 else str(r["flips_against_n_test"])) + " |")
    md = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(md)
    print(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["prepare", "coldstart", "run", "retest", "plot"])
    ap.add_argument("--project", type=Path, help="The study's project folder (every command but plot).")
    ap.add_argument("--model", choices=sorted(PROFILES), default="tiny", help="Which study (PROFILES).")
    ap.add_argument("--base", choices=["both", "retain", "none"], default="both",
                    help="Where the backbone itself is scored too: both test splits, the retention world's, none.")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/retention_study"))
    ap.add_argument("--arms", nargs="+", default=ARMS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--budget", type=int, default=768, help="evolve.rollout_budget of every run.")
    ap.add_argument("-n", type=int, default=128, help="Test tasks per world and evaluation.")
    ap.add_argument("--jobs", type=int, default=1, help="Runs side by side (give each LOPD_THREADS=1).")
    ap.add_argument("--set", action="append", default=[], help="A recipe override for every run.")
    ap.add_argument("--world", choices=["target", "retain"], default="target", help="retest: which test split.")
    a = ap.parse_args()
    if a.what == "plot":
        print("\n".join(str(p) for p in replot(a.out)))
        return
    if a.project is None:
        ap.error(f"{a.what} needs --project")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    a.project = a.project.resolve()
    a.profile = PROFILES[a.model]
    if a.what == "prepare":
        prepare(a.project, a.profile)
        return
    if a.what == "coldstart":
        coldstart(a.project, a.profile)
        return
    a.work = (a.out / "work").resolve()
    if a.what == "retest":  # reads a finished study: makes no folder before it has checked OUT
        retest(a)
        replot(a.out)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    start = start_scores(a)
    jobs = [(arm, s) for s in a.seeds for arm in a.arms]
    results = []
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        futures = {pool.submit(run_one, arm, s, a, start): (arm, s) for arm, s in jobs}
        for f, (arm, s) in futures.items():
            try:
                results.append(f.result())
                print(f"done: {arm} seed {s}", flush=True)
            except Exception as e:  # one failed run must not lose the others
                print(f"FAILED: {arm} seed {s}: {e}", flush=True)
    results += earlier_runs(a, {(arm.split("=", 1)[0], s) for arm, s in jobs})
    md = table(results, start, next(int(x.split("=")[1]) for x in a.profile.common if x.startswith("evolve.val_n=")))
    (a.out / "study.json").write_text(json.dumps({"budget": a.budget, "model": a.profile.model, "common": a.profile.common, "sets": a.set,
                                                  "arms": sorted({r["arm"] for r in results}),
                                                  "n_test": a.n, "runs": results}, indent=1))
    (a.out / "study.md").write_text(md)
    replot(a.out)
    print(md)


if __name__ == "__main__":
    main()
