"""Seconds per step of a bench_peer report, as the mean over the measured steps (issue 20).

bench_peer reports medians. With `train.lopd.composer_every` = k, one step in k is a composer step
and the others are not, so the median is an off-step's time and hides the composer's cost. The
mean over measured steps that span whole cycles is what a run pays per step: run bench_peer with
`--warmup 1 --steps` a multiple of k (steps 2 … k+1 hold exactly one composer step). "off-step": the mean
of the lopd steps without a composer pass, which is what a step with a frozen composer costs.

    python benchmarks/peer/cycle_table.py benchmarks/results/peer/tiny_issue20.json [--every 4]
"""

from __future__ import annotations

import argparse
import json
import statistics as st


def table(report: dict, every: int) -> list[dict]:
    warm = report["config"]["warmup"] if "config" in report and "warmup" in report["config"] else 1
    raw = report["raw_steps"]
    sdft = [r["total"] for r in raw["sdft"][warm:]] if "sdft" in raw else None
    rows = []
    for name, steps in raw.items():
        t = [r["total"] for r in steps[warm:]]
        # lopd steps without a composer pass (p_composer 0): what a frozen composer's step costs
        off = [r["total"] for r in steps[warm:] if "p_composer" in r and not r["p_composer"]]
        row = {"workload": name, "n": len(t), "median_s": st.median(t), "mean_s": st.mean(t),
               "whole_cycles": len(t) % every == 0, "off_step_mean_s": st.mean(off) if off else None}
        if sdft:
            row["mean_x_sdft"] = row["mean_s"] / st.mean(sdft)
            row["median_x_sdft"] = row["median_s"] / st.median(sdft)
            if off:
                row["off_x_sdft"] = row["off_step_mean_s"] / st.mean(sdft)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--every", type=int, default=4, help="composer_every of the lopd settings")
    a = ap.parse_args()
    for path in a.reports:
        rep = json.load(open(path))
        print(path)
        print(f"  {'workload':<20} {'n':>3} {'median s':>9} {'mean s':>8} {'mean x SDFT':>12} {'median x SDFT':>14}"
              f" {'off-step s':>11} {'off x SDFT':>11}")
        for r in table(rep, a.every):
            off = r["off_step_mean_s"]
            print(f"  {r['workload']:<20} {r['n']:>3} {r['median_s']:>9.2f} {r['mean_s']:>8.2f} "
                  f"{r.get('mean_x_sdft', float('nan')):>12.2f} {r.get('median_x_sdft', float('nan')):>14.2f}"
                  + (f" {off:>11.2f} {r.get('off_x_sdft', float('nan')):>11.2f}" if off else "")
                  + ("" if r["whole_cycles"] else "  (not whole cycles)"))


if __name__ == "__main__":
    main()
