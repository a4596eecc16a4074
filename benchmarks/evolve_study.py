"""The self-evolution study (issue 36): `lopd evolve` with SFT, LOPD and auto rounds, several seeds,
one rollout budget, each round's student scored on the test split.

    LOPD_THREADS=1 python benchmarks/evolve_study.py --project PROJECT --out benchmarks/results/evolve_study \
        --methods sft lopd auto --seeds 0 1 2 --budget 1344 --jobs 2 \
        --set evolve.start=incumbent --set evolve.steps=48 --set evolve.tasks_per_round=256 \
        --set train.sft.batch=32 --set rollout.batch_size=32 --set rollout.rollouts_per_step=16 \
        --method-set lopd:evolve.steps=12

PROJECT is a lopd project with a filled bank, an index and a cold-started composer (the demo's
project after its check stage, or any `lopd init` project taken that far). Each (method, seed)
runs in its own copy of it (under --work, default OUT/work), so every run starts from the same
bank: `lopd evolve --algo METHOD --run ev --rounds 99 --set evolve.seed=SEED
--set evolve.rollout_budget=BUDGET ...`, then `lopd eval --checkpoint` of every round's candidate
on the test split (`-n`, greedy). A round spends its own rollouts plus those its training
generates (LOPD, OPSD, GRPO), so at one budget SFT gets more rounds than LOPD; evolve stops
before a round that would exceed it.

Writes OUT/study.json (per run and round: rollouts spent, bank successes, validation success and
the gate's decision, the candidate's and the incumbent's test success), OUT/study.md (one table:
test success of the single SFT pass = round 1 of the SFT runs, of the final incumbents, and the
paired difference to the seed's SFT pass on the same test tasks) and OUT/study.png (test success
of the incumbent against rollouts spent; one faint line per seed, the mean in bold). Runs already
finished under --work are reused (delete the folder to rerun). What it simplifies: the team's
logs in the starting bank are not counted as rollouts (the same for every run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def lopd(args: list[str], cwd: Path, log: Path) -> str:
    """Run the CLI in `cwd`; stdout returned, everything appended to `log`; raise on failure."""
    env = {**os.environ, "LOPD_THREADS": os.environ.get("LOPD_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-m", "lopd_cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True)
    with log.open("a") as f:
        f.write(f"$ lopd {' '.join(args)}\n{proc.stderr}\n")
    if proc.returncode:
        raise RuntimeError(f"lopd {' '.join(args[:2])} in {cwd} failed (exit {proc.returncode}); see {log}")
    return proc.stdout


def rounds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.strip()]


def test_outcomes(eval_json: dict, episodes: Path) -> tuple[dict, dict[str, bool]]:
    """(success interval, {task id: solved}) of the single model `lopd eval --json --rollouts` scored."""
    thr = eval_json["success_threshold"]
    solved = {}
    for line in episodes.read_text().splitlines():
        ep = json.loads(line)
        solved[ep["task_id"]] = ep["reward"] >= thr
    return eval_json["models"][0]["success"], solved


def run_one(method: str, seed: int, a: argparse.Namespace) -> dict:
    """One evolve run in its own project copy, then every round's candidate on the test split."""
    work = a.work / f"{method}-s{seed}"
    done = work / "study_run.json"
    if done.exists():
        return json.loads(done.read_text())
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(a.project, work, ignore=shutil.ignore_patterns("evolve-*", "export*"))
    log = work / "study.log"
    sets = [*a.set, *(s.split(":", 1)[1] for s in a.method_set if s.split(":", 1)[0] == method),
            f"evolve.seed={seed}", f"evolve.rollout_budget={a.budget}"]
    args = ["evolve", "--recipe", a.recipe, "--algo", method, "--run", "ev", "--rounds", "99"]
    for s in sets:
        args += ["--set", s]
    lopd(args, work, log)
    run_dir = work / "runs" / "ev"
    rows, tests = rounds(run_dir), {}
    for r in rows:
        if r["round"] == 0 or not r.get("checkpoint"):
            continue
        out = lopd(["eval", "--recipe", a.recipe, "--checkpoint", str(run_dir / r["checkpoint"]), "-n", str(a.n),
                    "--json", "--rollouts", str(work / f"test_r{r['round']:02d}.jsonl")], work, log)
        tests[r["round"]] = test_outcomes(json.loads(out), work / f"test_r{r['round']:02d}.jsonl")
    points = []
    for r in rows:
        if r["round"] == 0:
            continue
        cand = tests.get(r["round"])
        inc = tests.get(r["incumbent_round"])
        points.append({"round": r["round"], "methods": r.get("methods"), "auto": r.get("auto"),
                       "method": r.get("method"), "rollouts_total": r["rollouts_total"],
                       "bank_successes": r.get("bank_successes"), "successes_added": r.get("successes_added"),
                       "validation": r["validation"], "accepted": r["accepted"],
                       "incumbent_round": r["incumbent_round"],
                       "test": cand[0] if cand else None,
                       "incumbent_test": inc[0] if inc else None})
    outcomes = {str(k): v[1] for k, v in tests.items()}
    result = {"method": method, "seed": seed, "sets": sets, "points": points,
              "final_incumbent_round": rows[-1]["incumbent_round"], "task_success": outcomes,
              "stopped": json.loads((run_dir / "evolve.json").read_text()).get("stopped")}
    done.write_text(json.dumps(result, indent=1))
    return result


def paired(a: dict[str, bool], b: dict[str, bool]) -> dict | None:
    """Mean of (a − b) over the common tasks with a normal 95 % interval."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    d = [float(a[t]) - float(b[t]) for t in common]
    m = sum(d) / len(d)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / max(1, len(d) - 1))
    half = 1.96 * sd / math.sqrt(len(d))
    return {"mean": m, "low": m - half, "high": m + half, "n": len(d)}


def summarise(results: list[dict]) -> tuple[list[dict], str]:
    sft_pass = {r["seed"]: r["task_success"].get("1") for r in results if r["method"] == "sft"}
    rows = []
    for r in results:
        fin = r["final_incumbent_round"]
        last = r["points"][-1] if r["points"] else None
        final_test = last["incumbent_test"] if last else None
        fin_tasks = r["task_success"].get(str(fin))
        base = sft_pass.get(r["seed"])
        rows.append({"method": r["method"], "seed": r["seed"], "rounds": len(r["points"]),
                     "rollouts": last["rollouts_total"] if last else 0, "incumbent_round": fin,
                     "test": final_test, "vs_sft_pass": paired(fin_tasks, base) if fin_tasks and base else None,
                     "round1_test": r["points"][0]["test"] if r["points"] else None,
                     "stopped": r["stopped"]})
    pct = lambda iv: "–" if not iv else f"{100 * iv['mean']:.1f}"
    lines = ["| method | seed | rounds | rollouts | round 1 test % | final incumbent (round) test % "
             "| − SFT's pass, paired (points) |", "|---|---|---|---|---|---|---|"]
    for x in sorted(rows, key=lambda x: (x["method"], x["seed"])):
        v = x["vs_sft_pass"]
        vs = "–" if not v else f"{100 * v['mean']:+.1f} [{100 * v['low']:+.1f}, {100 * v['high']:+.1f}]"
        lines.append(f"| {x['method']} | {x['seed']} | {x['rounds']} | {x['rollouts']} | {pct(x['round1_test'])} "
                     f"| {pct(x['test'])} (r{x['incumbent_round']}) | {vs} |")
    for m in sorted({x["method"] for x in rows}):
        vals = [100 * x["test"]["mean"] for x in rows if x["method"] == m and x["test"]]
        if vals:
            mean = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / max(1, len(vals) - 1))
            lines.append(f"| **{m}** | mean ± sd | | | | **{mean:.1f} ± {sd:.1f}** | |")
    return rows, "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path, n_test: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    colours = {}
    for r in sorted(results, key=lambda r: (r["method"], r["seed"])):
        pts = [p for p in r["points"] if p["incumbent_test"]]
        x = [p["rollouts_total"] for p in pts]
        y = [100 * p["incumbent_test"]["mean"] for p in pts]
        kw = {"color": colours[r["method"]]} if r["method"] in colours else {"label": f"{r['method']} rounds"}
        line, = ax.plot(x, y, marker="o", alpha=0.45, **kw)
        colours.setdefault(r["method"], line.get_color())
    for m, colour in colours.items():  # the seeds' mean, round by round (rounds cost the same within a method)
        runs = [[p for p in r["points"] if p["incumbent_test"]] for r in results if r["method"] == m]
        k = min(map(len, runs))
        if k and len(runs) > 1:
            x = [sum(run[i]["rollouts_total"] for run in runs) / len(runs) for i in range(k)]
            y = [sum(100 * run[i]["incumbent_test"]["mean"] for run in runs) / len(runs) for i in range(k)]
            ax.plot(x, y, color=colour, lw=2.5, marker="o", label=f"{m}: mean of {len(runs)} seeds")
    ax.set_xlabel("rollouts the student generated (rounds' rollouts + training rollouts)")
    ax.set_ylabel(f"incumbent's test success % ({n_test} tasks, greedy)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None, help="Where the runs' project copies go (default OUT/work).")
    ap.add_argument("--recipe", default="toolcall")
    ap.add_argument("--methods", nargs="+", default=["sft", "lopd", "auto"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--budget", type=int, required=True, help="evolve.rollout_budget of every run.")
    ap.add_argument("-n", type=int, default=128, help="Test tasks per evaluation.")
    ap.add_argument("--jobs", type=int, default=1, help="Runs side by side (give each LOPD_THREADS=1).")
    ap.add_argument("--set", action="append", default=[], help="A recipe override for every run.")
    ap.add_argument("--method-set", action="append", default=[], help="METHOD:key=value, for one method's runs.")
    a = ap.parse_args()
    a.project = a.project.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    a.work = (a.work or a.out / "work").resolve()
    a.work.mkdir(parents=True, exist_ok=True)
    jobs = [(m, s) for s in a.seeds for m in a.methods]
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        futures = {pool.submit(run_one, m, s, a): (m, s) for m, s in jobs}
        results = []
        for f, (m, s) in futures.items():
            try:
                results.append(f.result())
                print(f"done: {m} seed {s}", flush=True)
            except Exception as e:  # one failed run must not lose the others
                print(f"FAILED: {m} seed {s}: {e}", flush=True)
    rows, table = summarise(results)
    (a.out / "study.json").write_text(json.dumps({"budget": a.budget, "sets": a.set, "method_sets": a.method_set,
                                                  "n_test": a.n, "runs": results, "summary": rows}, indent=1))
    (a.out / "study.md").write_text(table)
    plot(results, a.out / "study.png", a.n)
    print(table)


if __name__ == "__main__":
    main()
