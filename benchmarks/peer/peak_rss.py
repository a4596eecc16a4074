"""Peak memory of one training step, each workload alone in a fresh process (issue 20).

`bench_peer.py` interleaves its workloads in one process, so its peak RSS is the process's
high-water mark over all of them. This runs `bench_peer.py` once per workload or lopd setting,
each in its own process (SDFT: a warm-up step and one measured step, so AdamW's state exists;
lopd: one step, which is a composer step), and tabulates each process's peak RSS against SDFT's.

    export TRL_EXPERIMENTAL_SILENCE=1 OMP_NUM_THREADS=1 LOPD_THREADS=1 HF_HUB_OFFLINE=1
    .venv-peer/bin/python benchmarks/peer/peak_rss.py --model ~/.cache/lopd/models/tiny \\
        --settings "lopd_cmb8:train.lopd.composer_micro_batch=8;lopd_default:" --out benchmarks/results/peer/peak_rss_tiny.json

A setting is `name:override,override` as in lopd_settings_plugin.py; `name:` alone is the
recipe defaults. Other bench_peer options (--batch, --prompt-len, ...) pass through after `--`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BENCH = Path(os.environ.get("LOPD_PEER_BENCH", HERE / "bench_peer.py"))
PLUGIN = HERE / "lopd_settings_plugin.py"


def run_alone(model: str, workload: str | None, setting: str | None, extra: list[str], workdir: str) -> dict:
    """One bench_peer process: `workload` (a built-in, e.g. sdft) or one lopd `setting`."""
    out = Path(workdir) / f"{(workload or setting.partition(':')[0])}.json"
    cmd = [sys.executable, str(BENCH), "--model", model, "--threads", "1", "--workdir", workdir, "--out", str(out)]
    env = dict(os.environ)
    if workload:
        cmd += ["--workloads", workload, "--warmup", "1", "--steps", "1"]
    else:
        cmd += ["--workloads", "", "--plugin", str(PLUGIN), "--warmup", "0", "--steps", "1"]
        env["LOPD_PEER_SETTINGS"] = setting
    subprocess.run(cmd + extra, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rep = json.loads(out.read_text())
    (name, w), = rep["workloads"].items()
    return {"name": name, "peak_rss_mb": rep["peak_rss_process_mb"], "step_s": w["total"]["median"],
            "overrides": rep["checks"][name].get("overrides") if workload is None else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--settings", default="lopd_default:", help="';'-separated name:override,... entries")
    ap.add_argument("--out", default=None)
    ap.add_argument("extra", nargs="*", help="bench_peer options, after --")
    a = ap.parse_args()
    model = str(Path(a.model).expanduser())
    rows = []
    with tempfile.TemporaryDirectory(prefix="peak-rss-") as wd:
        rows.append(run_alone(model, "sdft", None, a.extra, wd))
        for s in (e for e in a.settings.split(";") if e.strip()):
            rows.append(run_alone(model, None, s, a.extra, wd))
    base = rows[0]["peak_rss_mb"]
    print(f"{'process':<16} {'peak RSS MiB':>12} {'x SDFT':>7} {'step s':>8}  overrides")
    for r in rows:
        r["x_sdft"] = r["peak_rss_mb"] / base
        print(f"{r['name']:<16} {r['peak_rss_mb']:>12.0f} {r['x_sdft']:>7.2f} {r['step_s']:>8.1f}  {r['overrides'] or ''}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"model": model, "extra": a.extra, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
