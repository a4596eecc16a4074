"""Pin lopd's outcomes before a refactor and compare them after (a refactor changes no outcome).

    python benchmarks/behaviour_pin.py run --out pins/before.json      # on the old code
    python benchmarks/behaviour_pin.py run --out pins/after.json       # on the new code
    python benchmarks/behaviour_pin.py compare pins/before.json pins/after.json

`run` drives the public commands only (`lopd init`, `bank add-rollouts`, `rollout`, `bank index`,
`coldstart`, `train`, `eval`), so that it reads the same before and after modules move. In a fresh
project (tiny model, the house-rules orders world) it runs the demo's single-pass pipeline with
the demo's sizes: the team's logs, 64 student rollouts, index, an 80-step cold start, 12 LOPD
steps, and the base and the LOPD student on 128 test tasks, keeping each task's outcome. Then
2-step runs of LOPD, GRPO, OPSD and SFT on one seed, keeping every metrics row. What it
simplifies: the logs are written by the library's scripted agent, as `lopd demo` writes them.

`compare` checks that the task outcomes are identical and that every metric agrees to float
tolerance (wall-clock fields are left out); it exits 1 and names what differs. Run both sides
with the same LOPD_THREADS on the same machine: float rounding depends on the thread count.
About 10 minutes at LOPD_THREADS=1 on a 2-core machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# The demo's sizes (lopd_cli demo: DEMO_OVERRIDES, BANK_ROLLOUTS, AGENT_LOGS).
DEMO_SETS = ["eval.n=128", "coldstart.steps=80", "coldstart.eval_every=80", "train.steps=12", "train.save_every=6"]
BANK_ROLLOUTS = 64
AGENT_LOGS = 96
SHORT_SETS = ["train.steps=2", "train.save_every=2", "rollout.rollouts_per_step=8", "rollout.batch_size=8"]
ALGOS = ["lopd", "grpo", "opsd", "sft"]
# Metrics that measure the machine, not the algorithm.
CLOCK_WORDS = ("sec_", "second", "time", "_s", "rate", "rss", "memory", "elapsed", "eta", "tok_per", "wall")


def is_clock(key: str) -> bool:
    return any(w in key.lower() for w in CLOCK_WORDS)


def lopd(args: list[str], cwd: Path) -> str:
    cmd = [sys.executable, "-m", "lopd_cli", *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: lopd {' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def scripted_logs(project: Path) -> Path:
    """The demo's 'your agent's logs': the scripted agent on 96 training + all validation tasks."""
    code = f"""
import json, sys
from pathlib import Path
from lopd_cli.project import open_project
from lopd_cli.agent.runner import make_env_factory
for name in ("lopd_cli.envs.orders_agent", "lopd_cli.envs.orders_policy"):
    try:
        scripted_agent_records = __import__(name, fromlist=["x"]).scripted_agent_records
        break
    except (ImportError, AttributeError):
        continue
proj = open_project(Path("."))
recipe = proj.load_recipe("toolcall", {DEMO_SETS!r})
env = make_env_factory(recipe)()
records = scripted_agent_records(env.tasks("train")[-{AGENT_LOGS}:] + env.tasks("validation"), seed=recipe.train.seed)
Path("logs").mkdir(exist_ok=True)
Path("logs/agent.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in records))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: scripted logs\n{proc.stderr[-3000:]}")
    return project / "logs" / "agent.jsonl"


def task_outcomes(path: Path) -> list[list]:
    """(task id, reward, number of messages) per episode, in order."""
    rows = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        task = rec.get("task_id") or rec.get("id") or rec.get("instruction", "")[:80]
        rows.append([task, rec.get("reward"), len(rec.get("messages") or [])])
    return rows


def metric_rows(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if not is_clock(k)})
    return rows


def run(out: Path, workdir: Path | None) -> None:
    work = Path(workdir or tempfile.mkdtemp(prefix="lopd-pin-"))
    work.mkdir(parents=True, exist_ok=True)
    proj = work / "pin-project"
    say = lambda s: print(s, flush=True)  # noqa: E731
    say(f"project {proj}")
    lopd(["init", str(proj), "--example", "orders", "--model", "tiny", "--force"], work)
    logs = scripted_logs(proj)
    lopd(["bank", "add-rollouts", str(logs)], proj)
    say("rollouts")
    lopd(["rollout", "-n", str(BANK_ROLLOUTS), "--split", "train", "--to-bank", "--out", "rollouts/bank.jsonl",
          *sum((["--set", s] for s in DEMO_SETS), [])], proj)
    lopd(["bank", "index"], proj)
    say("cold start")
    sets = sum((["--set", s] for s in DEMO_SETS), [])
    lopd(["coldstart", "--recipe", "toolcall", "--run", "coldstart", *sets], proj)
    say("LOPD, 12 steps")
    lopd(["train", "--recipe", "toolcall", "--run", "lopd", *sets], proj)
    say("eval base and student")
    lopd(["eval", "--recipe", "toolcall", "--backbone", "-n", "128", "--rollouts", "eval/base.jsonl", *sets], proj)
    lopd(["eval", "--recipe", "toolcall", "--checkpoint", "runs/lopd", "-n", "128", "--rollouts", "eval/lopd.jsonl",
          *sets], proj)
    pins: dict = {
        "threads": os.environ.get("LOPD_THREADS"),
        "demo": {
            "base": task_outcomes(proj / "eval" / "base.jsonl"),
            "lopd": task_outcomes(proj / "eval" / "lopd.jsonl"),
            "bank_rollouts": task_outcomes(proj / "rollouts" / "bank.jsonl"),
            "lopd_metrics": metric_rows(proj / "runs" / "lopd"),
        },
        "short": {},
    }
    for algo in ALGOS:
        say(f"{algo}, 2 steps")
        lopd(["train", "--recipe", "toolcall", "--algo", algo, "--run", f"short-{algo}",
              *sum((["--set", s] for s in SHORT_SETS), [])], proj)
        pins["short"][algo] = metric_rows(proj / "runs" / f"short-{algo}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(pins, indent=1))
    solved = lambda rows: sum(1 for r in rows if (r[1] or 0) >= 1.0)  # noqa: E731
    say(f"wrote {out}: base {solved(pins['demo']['base'])}/128, LOPD {solved(pins['demo']['lopd'])}/128 solved")


def diff(a, b, where: str, out: list[str], rel: float = 1e-5, abs_: float = 1e-6) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(k for k in set(a) | set(b) if not is_clock(k)):
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'after' if k not in a else 'before'}")
            else:
                diff(a[k], b[k], f"{where}.{k}", out, rel, abs_)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{where}: {len(a)} entries before, {len(b)} after")
        for i, (x, y) in enumerate(zip(a, b)):
            diff(x, y, f"{where}[{i}]", out, rel, abs_)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if not (math.isclose(a, b, rel_tol=rel, abs_tol=abs_) or (math.isnan(a) and math.isnan(b))):
            out.append(f"{where}: {a!r} before, {b!r} after")
    elif a != b:
        out.append(f"{where}: {a!r} before, {b!r} after")


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    problems: list[str] = []
    if a.get("threads") != b.get("threads"):
        problems.append(f"threads: {a.get('threads')} before, {b.get('threads')} after (rerun with the same LOPD_THREADS)")
    diff(a["demo"], b["demo"], "demo", problems)
    diff(a["short"], b["short"], "short", problems)
    n_tasks = len(a["demo"]["base"]) + len(a["demo"]["lopd"])
    n_rows = len(a["demo"]["lopd_metrics"]) + sum(len(v) for v in a["short"].values())
    if problems:
        print(f"{len(problems)} difference(s):")
        for p in problems[:50]:
            print(f"  {p}")
        return 1
    print(f"identical: {n_tasks} task outcomes, {n_rows} metrics rows (LOPD 12 steps; LOPD, GRPO, OPSD, SFT 2 steps)")
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--workdir", type=Path, default=None)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args()
    if args.cmd == "run":
        importlib.import_module("lopd_cli")
        run(args.out, args.workdir)
    else:
        sys.exit(compare(args.before, args.after))


if __name__ == "__main__":
    main()
