"""Rollout throughput: generated tokens/s of the runner against a bare `model.generate` loop on
the same multi-turn episodes, in the same process, and of the vLLM backend where vLLM is installed.

Episodes are `orders` test tasks rendered exactly as the runner renders them (system prompt and
tool schemas included) that last `--turns` turns whatever the model says: after each answer
the next user turn carries the result of the task's next oracle tool call (a random or
untrained model rarely calls tools itself; tool calls it does make run as usual). The model is
what `lopd train` rolls out: the backbone with a student LoRA attached (B = 0 as at the start of
training, so every path samples the same distribution).

"bare generate" replays the runner's episodes turn by turn: for each batch and turn, one
`model.generate` over the whole conversation so far of the episodes still running (left-padded,
seeded as the runner seeds that turn), i.e. what a loop around `generate` does without KV reuse
across turns, without log-probs, parsing, tools or rendering. It draws the runner's tokens (the
hf runner samples exactly as `generate` does), so both paths do the same generation work. Each
path gets one untimed warm-up batch (vLLM: the engine start), then timed runs interleaved
across paths; the fastest of `--repeats` counts. `--turns 1` measures the runner's own cost on
a single turn (no reuse to gain).

    python benchmarks/rollout_throughput.py                    # tiny and SmolLM2, every backend here
    python benchmarks/rollout_throughput.py --quick            # a few minutes (one turn)
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


def multi_turn_env(turns: int):
    """OrdersEnv whose episodes go on for `turns` turns: after an answer, the next user turn
    carries the result of the task's next oracle tool call (cycling through the plan)."""
    from lopd_cli.envs.orders import OrdersEnv, oracle_plan

    class MultiTurnOrders(OrdersEnv):
        def reset(self, task):
            msgs = super().reset(task)
            self._calls, self._k = oracle_plan(task)[0], 0
            return msgs

        def next_user_message(self):
            self._k += 1
            if self._k >= turns:
                return None
            call = self._calls[(self._k - 1) % len(self._calls)]
            return {"role": "user", "content": f"<tool_response>\n{self.step(call)}\n</tool_response>"}

    return MultiTurnOrders


def turn_seed(seed: int, chunk: int, turn: int) -> int:
    """The runner's per-turn sampling seed (agent/runner.run_episodes, one process)."""
    return (seed * 1_000_003 + chunk * 10_007 + turn) % (2**63)


def bare_generate(model, tok, episodes, batch: int, max_new: int, temperature: float,
                  stop_ids: list[int], seed: int) -> int:
    """Replay `episodes` (the runner's) with plain `model.generate`: per batch and turn, the whole
    conversation so far of the episodes still running, left-padded, seeded as the runner seeds
    that turn. Returns the generated tokens (to the stop)."""
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stops, total = set(stop_ids), 0
    for lo in range(0, len(episodes), batch):
        chunk = episodes[lo: lo + batch]
        for turn in range(max(len(e.turn_spans) for e in chunk)):
            prompts = [e.input_ids[: e.turn_spans[turn][0]] for e in chunk if len(e.turn_spans) > turn]
            width = max(map(len, prompts))
            ids = torch.full((len(prompts), width), pad)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for r, p in enumerate(prompts):
                ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
            torch.manual_seed(turn_seed(seed, lo // batch, turn))
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=True,
                                     temperature=temperature, top_k=0, top_p=1.0, eos_token_id=stop_ids,
                                     pad_token_id=pad)
            for row in out[:, width:].tolist():
                total += next((t + 1 for t, x in enumerate(row) if x in stops), len(row))
    return total


def run_runner(model, tok, tasks, cfg, seed: int, turns: int):
    """(generated tokens, episodes) of the runner on `tasks`."""
    from lopd_cli.agent.runner import run_episodes
    from lopd_cli.models import adapters as ad

    with ad.use_student(model):
        eps = run_episodes(model, tok, multi_turn_env(turns), tasks, cfg, seed=seed)
    return sum(sum(e.action_mask) for e in eps), eps


def measure(backbone: str, backends: list[str], n: int, batch: int, max_new: int, temperature: float,
            repeats: int, seed: int = 0, turns: int = 4) -> list[Row]:
    """Rows for one backbone: each path warmed up on one batch, then timed `repeats` times,
    interleaved (runner hf, bare replaying the hf runner's episodes, runner vllm, ...) so load
    changes hit every path alike; the best (fastest) repeat counts."""
    from lopd_cli.agent.chat import render_prompt_ids, stop_token_ids
    from lopd_cli.config import RolloutSection
    from lopd_cli.envs.orders import OrdersEnv

    model, tok = student_model(backbone)
    model.eval()
    tasks = OrdersEnv().tasks("test")[:n]
    prompts = [render_prompt_ids(tok, OrdersEnv().reset(t), t.tools) for t in tasks]
    stop_ids = stop_token_ids(tok)
    # Room for every turn: no episode stops on max_prompt_tokens, so each turn samples max_new.
    room = max(map(len, prompts)) + turns * (max_new + 400) + 16

    def runner(backend: str):
        cfg = RolloutSection(backend=backend, temperature=temperature, max_new_tokens=max_new, max_turns=turns,
                             batch_size=batch, max_prompt_tokens=room)
        return lambda k: run_runner(model, tok, tasks[:k], cfg, seed, turns)

    runners = {f"runner {b}": runner(b) for b in backends}
    hf_name = "runner hf" if "hf" in backends else next(iter(runners))
    # warm-up (vLLM: starts the engine); the bare loop replays the hf runner's episodes
    _, eps = runners[hf_name](min(batch, n))
    bare_generate(model, tok, eps, batch, max_new, temperature, stop_ids, seed)
    for name, fn in runners.items():
        if name != hf_name:
            fn(min(batch, n))
    best: dict[str, tuple[int, float]] = {}

    def keep(name: str, tokens: int, secs: float) -> None:
        if name not in best or secs < best[name][1]:
            best[name] = (tokens, secs)

    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens, eps = runners[hf_name](n)
        keep(hf_name, tokens, time.perf_counter() - t0)
        t0 = time.perf_counter()
        tokens = bare_generate(model, tok, eps, batch, max_new, temperature, stop_ids, seed)
        keep("bare generate", tokens, time.perf_counter() - t0)
        for name, fn in runners.items():
            if name != hf_name:
                t0 = time.perf_counter()
                keep(name, fn(n)[0], time.perf_counter() - t0)
    order = ["bare generate"] + list(runners)
    rows = [Row(backbone, name, n, best[name][0], best[name][1], best[name][0] / best[name][1]) for name in order]
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
    ap.add_argument("--turns", type=int, default=None, help="turns per episode (default 4, quick 1)")
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
    turns = args.turns or (1 if args.quick else 4)
    load_before = os.getloadavg()
    rows: list[Row] = []
    try:
        for backbone in args.models.split(","):
            rows += measure(backbone, backends, n, args.batch, max_new, args.temperature, repeats, turns=turns)
            print(markdown([r for r in rows if r.model == backbone]), flush=True)
    finally:
        if "vllm" in backends and vllm_installed():
            from lopd_cli.rollout.vllm import shutdown_engines

            shutdown_engines()
    result = {
        "rows": [asdict(r) for r in rows], "batch": args.batch, "max_new_tokens": max_new, "repeats": repeats,
        "turns": turns,
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
