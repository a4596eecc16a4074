"""Peak memory of the student-pass reverse KL (forward + backward), chunked vs full logits.

Each mode runs in its own process; the figure is the process's peak RSS minus that of a
baseline process that builds the same inputs and the teacher's top-M but computes no loss.

    .venv/bin/python benchmarks/loss_memory.py [--vocab 49152 --tokens 2048 --hidden 576]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def run_mode(args: argparse.Namespace) -> dict:
    import torch

    from lopd_cli.runtime import setup_torch
    from lopd_cli.train.losses import chunked_reverse_kl, chunked_teacher_topm, reverse_kl_topm

    setup_torch()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5
    hidden = torch.randn(1, args.tokens, args.hidden, generator=g)
    mask = torch.ones(1, args.tokens, dtype=torch.bool)
    teacher_hidden = torch.randn(hidden.shape, generator=g)
    t_lp, ids = chunked_teacher_topm(teacher_hidden, weight, args.m, chunk_size=args.chunk)
    h = hidden.clone().requires_grad_(True)
    start = time.perf_counter()
    loss = None
    if args.mode == "unchunked":
        loss = reverse_kl_topm(h @ weight.T, t_lp, ids, mask).loss
    elif args.mode == "chunked":
        loss = chunked_reverse_kl(h, weight, t_lp, ids, mask, chunk_size=args.chunk).loss
    if loss is not None:
        loss.backward()
    seconds = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": args.mode, "peak_rss_mib": round(peak_mib), "seconds": round(seconds, 2),
            "loss": None if loss is None else float(loss)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--m", type=int, default=20)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--mode", choices=["baseline", "unchunked", "chunked"])
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    results = {}
    for mode in ["baseline", "chunked", "unchunked"]:
        cmd = [sys.executable, __file__, "--mode", mode] + [
            f"--{k}={getattr(args, k)}" for k in ("vocab", "tokens", "hidden", "m", "chunk")
        ]
        results[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    base = results["baseline"]["peak_rss_mib"]
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"vocab {args.vocab} x {args.tokens} tokens, hidden {args.hidden}, M {args.m}, chunk {args.chunk}; "
          f"one fp32 logits tensor = {logits_mib:.0f} MiB; baseline RSS {base} MiB")
    for mode in ["chunked", "unchunked"]:
        r = results[mode]
        print(f"{mode:>9}: peak RSS {r['peak_rss_mib']} MiB (+{r['peak_rss_mib'] - base} over baseline), "
              f"{r['seconds']} s fwd+bwd, loss {r['loss']:.6f}")


if __name__ == "__main__":
    main()
