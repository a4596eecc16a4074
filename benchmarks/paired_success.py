"""Paired test-success differences between students evaluated on the same tasks.

Two students scored on the same 128 test tasks have correlated outcomes (most tasks are easy
or hard for both), so their Wilson intervals overlap long before the difference is noise. This
reads the rollout files `lopd eval … --rollouts FILE.jsonl` writes, matches episodes by task id
and reports, for each file against the first, the mean paired difference in success (reward ≥
the threshold) with a 95 % normal interval over tasks (`lopd_cli.train.check.paired_gap`), and
the discordant counts (tasks only one of the two solves).

    .venv/bin/python benchmarks/paired_success.py BASE.jsonl OTHER.jsonl [MORE.jsonl ...] [--threshold 1.0] [--json]

What it simplifies: one episode per task and file (greedy evaluation); the interval is the normal
approximation of a paired mean, fine at n ≥ 100 with a few discordant tasks, loose below that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def read_successes(path: Path, threshold: float) -> dict[str, float]:
    """task id → 1.0 / 0.0 from a rollout JSONL (one line per episode)."""
    out: dict[str, float] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out[str(rec["task_id"])] = 1.0 if float(rec["reward"]) >= threshold else 0.0
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"{path}:{n}: not a rollout record with task_id and reward ({e.__class__.__name__})")
    return out


def compare(base: dict[str, float], other: dict[str, float]) -> dict:
    from lopd_cli.train.check import paired_gap

    ids = sorted(set(base) & set(other))
    a, b = [other[i] for i in ids], [base[i] for i in ids]
    gap = paired_gap(a, b)
    return {"n": len(ids), "base": sum(b) / max(len(b), 1), "other": sum(a) / max(len(a), 1),
            "diff": gap.mean, "ci95": [gap.lo, gap.hi],
            "only_other": sum(1 for x, y in zip(a, b) if x > y), "only_base": sum(1 for x, y in zip(a, b) if y > x)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--threshold", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if len(args.files) < 2:
        ap.error("give a base file and at least one other")
    base = read_successes(args.files[0], args.threshold)
    rows = [{"base_file": str(args.files[0]), "file": str(f), **compare(base, read_successes(f, args.threshold))}
            for f in args.files[1:]]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"base: {args.files[0]}")
        for r in rows:
            print(f"{r['file']}: {100 * r['other']:.1f} % vs {100 * r['base']:.1f} % on {r['n']} tasks, "
                  f"paired diff {100 * r['diff']:+.1f} pts [{100 * r['ci95'][0]:+.1f}, {100 * r['ci95'][1]:+.1f}], "
                  f"solved only by it {r['only_other']}, only by base {r['only_base']}")
    return rows


if __name__ == "__main__":
    main()
