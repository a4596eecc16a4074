"""Rollout throughput: generated tokens/s of the runner against a bare `model.generate` loop on
the same prompts, in the same process, and of the vLLM backend where vLLM is installed.

The prompts are `orders` test tasks rendered exactly as the runner renders them (system prompt
and tool schemas included). The model is what `lopd train` rolls out: the backbone with a
student LoRA attached (B = 0 as at the start of training, so every path samples the same
distribution). Each path gets one untimed warm-up batch (vLLM: the engine start), then timed
runs interleaved across paths; the fastest of `--repeats` counts. The runner is limited to one turn per episode so it does the same generation work
as the bare loop; the difference is its own cost (log-probs, tool-call parsing, bookkeeping).

    python benchmarks/rollout_throughput.py                    # tiny and SmolLM2, every backend here
    python benchmarks/rollout_throughput.py --quick            # a few minutes
    python benchmarks/rollout_throughput.py --models smollm2-135m-instruct --backends hf,vllm

Run it with `.venv-vllm/bin/python` (see `make setup-vllm`) to include vLLM on a CPU machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from dataclasses import asdict, dataclass

MODELS = ("tiny", "smollm2-135m-instruct")


@dataclass
class Row:
    model: str
    path: str  # "bare generate", "runner hf", "runner vllm"
    episodes: int
    tokens: int
    seconds: float
    tok_s: float
    ratio_to_bare: float | None = None


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def student_model(backbone: str):
    """The backbone with the recipe's student LoRA attached and active, as `lopd train` has it."""
    from lopd_cli.config import recipe_from_dict
    from lopd_cli.models import adapters as ad
    from lopd_cli.models.backbone import load_backbone

    model, tok = load_backbone(backbone, device="cpu")
    recipe = recipe_from_dict({"model": {"backbone": backbone}, "env": {"class": "x:Y"}})
    return ad.attach_adapters(model, recipe), tok


def bare_generate(model, tok, prompts: list[list[int]], batch: int, max_new: int, temperature: float,
                  stop_ids: list[int], seed: int) -> int:
    """Plain `model.generate` over left-padded batches; returns the generated tokens (to the stop)."""
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stops, total = set(stop_ids), 0
    torch.manual_seed(seed)
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo: lo + batch]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0, eos_token_id=stop_ids,
                                 pad_token_id=pad)
        for row in out[:, width:].tolist():
            total += next((t + 1 for t, x in enumerate(row) if x in stops), len(row))
    return total


def run_runner(model, tok, tasks, cfg, seed: int) -> int:
    from lopd_cli.agent.runner import run_episodes
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.models import adapters as ad

    with ad.use_student(model):
        eps = run_episodes(model, tok, OrdersEnv, tasks, cfg, seed=seed)
    return sum(sum(e.action_mask) for e in eps)


def measure(backbone: str, backends: list[str], n: int, batch: int, max_new: int, temperature: float,
            repeats: int, seed: int = 0) -> list[Row]:
    """Rows for one backbone: each path warmed up on one batch, then timed `repeats` times,
    interleaved (bare, runner hf, runner vllm, bare, ...) so load changes hit every path alike;
    the best (fastest) repeat counts."""
    from lopd_cli.agent.chat import render_prompt_ids, stop_token_ids
    from lopd_cli.config import RolloutSection
    from lopd_cli.envs.orders import OrdersEnv

    model, tok = student_model(backbone)
    model.eval()
    tasks = OrdersEnv().tasks("test")[:n]
    prompts = [render_prompt_ids(tok, OrdersEnv().reset(t), t.tools) for t in tasks]
    stop_ids = stop_token_ids(tok)

    def bare(k: int) -> int:
        return bare_generate(model, tok, prompts[:k], batch, max_new, temperature, stop_ids, seed)

    def runner(backend: str):
        cfg = RolloutSection(backend=backend, temperature=temperature, max_new_tokens=max_new, max_turns=1,
                             batch_size=batch, max_prompt_tokens=max(map(len, prompts)) + max_new + 16)
        return lambda k: run_runner(model, tok, tasks[:k], cfg, seed)

    paths = {"bare generate": bare, **{f"runner {b}": runner(b) for b in backends}}
    for fn in paths.values():
        fn(min(batch, n))  # warm-up (vLLM: starts the engine)
    best: dict[str, tuple[int, float]] = {}
    for _ in range(repeats):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            tokens = fn(n)
            secs = time.perf_counter() - t0
            if name not in best or secs < best[name][1]:
                best[name] = (tokens, secs)
    rows = [Row(backbone, name, n, tok_n, secs, tok_n / secs) for name, (tok_n, secs) in best.items()]
    for r in rows:
        r.ratio_to_bare = r.tok_s / rows[0].tok_s
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| model | path | episodes | generated tokens | s | tokens/s | × bare generate |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.path} | {r.episodes} | {r.tokens} | {r.seconds:.1f} | "
                     f"{r.tok_s:.1f} | {r.ratio_to_bare:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few episodes and tokens (a few minutes)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--backends", default=None, help="default: hf, plus vllm where installed")
    ap.add_argument("--n", type=int, default=None, help="episodes per path (default 32, quick 8)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 64, quick 16")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per path, best counts (default 2, quick 1)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lopd_cli.runtime import setup_torch

    setup_torch()
    import torch

    backends = args.backends.split(",") if args.backends else ["hf"] + (["vllm"] if vllm_installed() else [])
    n = args.n or (8 if args.quick else 32)
    max_new = args.max_new_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 2)
    load_before = os.getloadavg()
    rows: list[Row] = []
    try:
        for backbone in args.models.split(","):
            rows += measure(backbone, backends, n, args.batch, max_new, args.temperature, repeats)
            print(markdown([r for r in rows if r.model == backbone]), flush=True)
    finally:
        if "vllm" in backends and vllm_installed():
            from lopd_cli.rollout.vllm import shutdown_engines

            shutdown_engines()
    result = {
        "rows": [asdict(r) for r in rows], "batch": args.batch, "max_new_tokens": max_new, "repeats": repeats,
        "temperature": args.temperature, "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
    }
    print(markdown(rows))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
