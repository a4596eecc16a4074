"""Test success of an evolve run's round students against the rollouts spent (issue 36).

    lopd eval --recipe toolcall --checkpoint runs/EV/rounds/r01/train-sft -n 128 --json > r01.json
    ...                                                       (one `lopd eval --json` per round)
    python benchmarks/evolve_test_curve.py runs/EV 1=r01.json 2=r02.json 3=r03.json \
        --label "SFT rounds, seed 0" --out benchmarks/results/evolve/curve.png

Reads the run's rounds.jsonl (rollouts spent up to each round, the gate's decision) and the
test figures `lopd eval --json` printed for each round's candidate, and draws test success (95 %
Wilson) against rollouts; accepted rounds filled, rejected hollow. Several runs: repeat
`--run DIR ROUND=FILE ...` groups with `--label`s. Writes the PNG and, beside it, the JSON of
the points. What it simplifies: the rollouts of the team's logs are not counted (the bank's
starting content is the same for every run compared).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def points(run_dir: Path, evals: list[str]) -> list[dict]:
    rounds = {r["round"]: r for r in map(json.loads, (run_dir / "rounds.jsonl").read_text().splitlines())}
    out = []
    for spec in evals:
        k, _, path = spec.partition("=")
        data = json.loads(Path(path).read_text())
        success = data["models"][0]["success"]
        r = rounds[int(k)]
        out.append({"round": int(k), "rollouts": r.get("rollouts_total") or 0, "accepted": r["accepted"],
                    "test_success": success})
    return sorted(out, key=lambda p: p["round"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, nargs="+", help="RUN_DIR ROUND=EVAL.json ... (several groups: --and)")
    ap.add_argument("--label", action="append", default=[])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    groups, cur = [], None
    for tok in map(str, args.run):
        if "=" not in tok:
            cur = (Path(tok), [])
            groups.append(cur)
        else:
            cur[1].append(tok)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    record = {}
    for i, (run_dir, evals) in enumerate(groups):
        label = args.label[i] if i < len(args.label) else run_dir.name
        pts = points(run_dir, evals)
        record[label] = pts
        x = [p["rollouts"] for p in pts]
        y = [p["test_success"]["mean"] for p in pts]
        err = [[p["test_success"]["mean"] - p["test_success"]["low"] for p in pts],
               [p["test_success"]["high"] - p["test_success"]["mean"] for p in pts]]
        line = ax.errorbar(x, y, yerr=err, capsize=3, label=label, marker="o")
        colour = line[0].get_color()
        for p in pts:
            if not p["accepted"]:
                ax.plot([p["rollouts"]], [p["test_success"]["mean"]], "o", mfc="white", mec=colour)
    ax.set_xlabel("rollouts the student generated (evolve rounds)")
    ax.set_ylabel("test success (128 tasks, greedy; 95 % Wilson)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
