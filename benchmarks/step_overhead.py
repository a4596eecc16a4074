"""What one LOPD update costs next to a plain SFT step, on the same tokens.

Three phases, each a full optimiser step on the same synthetic batch:

    sft      student adapter forward + token NLL on the action tokens + backward + AdamW step
    student  the LOPD student phase alone: composer forward and teacher forward without grad
             (latents in the placeholders), the teacher's top-M (`chunked_teacher_topm`), the
             student's `chunked_reverse_kl` + backward + step
    lopd     the whole LOPD update: `lopd_cli.train.step.lopd_step` (per micro-batch:
             encoder + teacher with grad, the composer's backward, then the student pass) + both
             optimiser steps + the dual step on β
    lopd_share  the same with `train.lopd.composer_batch` = a quarter of the rows (the others: a
             no-grad teacher)
    lopd_off the step between φ updates (`train.lopd.composer_every` > 1): no-grad encode and teacher,
             the student, its optimiser step

and two reference pieces for the floors: the composer alone without grad (`enc_fwd`) and with
forward + backward into ψ and χ (`enc_fwdbwd`). Floors (from the issue): student phase ≈
1.1–1.3 × SFT + enc_fwd; whole update ≈ 1.7 × SFT + enc_fwdbwd.

Time: one process per model runs every phase in fp32 and in bf16 autocast (fp32 master
weights), warm-up once, then `--repeats` rounds that interleave the phases (so a change in the
machine's load hits all of them); the figure is the median. Memory: each (model, precision,
phase) runs one step in a fresh process; the figure is that process's peak RSS (ru_maxrss, a
high-water mark of resident pages, so it includes Python, torch, the weights and whatever the
allocator kept) and the step's part of it: peak RSS − the RSS just before the step.

Batch: 8 episodes × 256 tokens (a system + user chat prompt rendered with the model's template,
then 4 assistant turns holding 128 action tokens between tool-output spans; random non-special
token ids), rewards alternating 1/0; 3 retrieved items per task = orders-oracle transcripts as
bank items (OpenAI messages). LoRA r 16 on the student and r 8 on the encoder (the recipes'),
composer num_queries 32, depth 8 (the paper's), top-M 20, one micro-batch, logit chunk 1024.

    .venv/bin/python benchmarks/step_overhead.py            # tiny + smollm2-135m-instruct
    .venv/bin/python benchmarks/step_overhead.py --quick    # tiny only, batch 4, 2 repeats, fp32 memory
                                                            # (< 1 min on an idle machine)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PHASES = ("sft", "student", "lopd", "lopd_share", "lopd_off")
PIECES = ("enc_fwd", "enc_fwdbwd", "head_pass")
PRECISIONS = ("fp32", "bf16")
RECIPES = {"tiny": "orders-tiny", "smollm2-135m-instruct": "orders-smollm2"}
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "step_overhead.json"


# ----------------------------------------------------------------------------- the workload


def synthetic_batch(tok, n: int, length: int, n_action: int, n_ret: int, seed: int = 0):
    """(episodes, refs): `n` Episodes of `length` tokens with `n_action` action tokens, and
    `n_ret` bank items (orders-oracle transcripts of other tasks) per episode."""
    import torch  # noqa: F401  (seeded below through random only)

    from lopd_cli.agent.chat import render_prompt_ids
    from lopd_cli.agent.types import Episode, Task
    from lopd_cli.bank.store import BankItem
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.envs.orders_agent import noisy_oracle_transcript

    rng = random.Random(seed)
    env = OrdersEnv()
    tasks = env.tasks("train")[: n + n * n_ret]
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    vocab = [i for i in range(len(tok)) if i not in special]
    episodes = []
    for b, task in enumerate(tasks[:n]):
        prompt = env.reset(task)
        pids = render_prompt_ids(tok, prompt, None)
        n_obs = length - len(pids) - n_action
        if n_obs < 0:
            raise SystemExit(f"prompt of {len(pids)} tokens leaves no room for {n_action} action tokens")
        turns = 4
        ids, mask = list(pids), [0] * len(pids)
        for t in range(turns):
            a = n_action // turns + (1 if t < n_action % turns else 0)
            ids += rng.choices(vocab, k=a)
            mask += [1] * a
            if t < turns - 1:
                o = n_obs // (turns - 1) + (1 if t < n_obs % (turns - 1) else 0)
                ids += rng.choices(vocab, k=o)
                mask += [0] * o
        ids += rng.choices(vocab, k=length - len(ids))
        mask += [0] * (length - len(mask))
        episodes.append(Episode(
            task=Task(task.id, task.instruction, tools=[]), prompt_messages=prompt, messages=prompt,
            reward=float(b % 2 == 0), input_ids=ids, action_mask=mask,
            logprobs=[-1.0 if m else 0.0 for m in mask], prompt_len=len(pids)))
    items = []
    for k, task in enumerate(tasks[n:]):
        msgs = noisy_oracle_transcript(task, random.Random(k), 0.0)
        items.append(BankItem(k + 1, task.id, task.instruction, msgs, task.tools, 1.0, True, {}))
    refs = [items[b * n_ret:(b + 1) * n_ret] for b in range(n)]
    return episodes, refs


class Bench:
    """One backbone with student + encoder adapters, a fresh composer, optimisers and a batch."""

    def __init__(self, model_name: str, args):
        import torch

        from lopd_cli.compose.composer import Composer
        from lopd_cli.compose.latent import output_head
        from lopd_cli.config import load_recipe
        from lopd_cli.models import adapters as ad
        from lopd_cli.models.backbone import load_backbone
        from lopd_cli.project import packaged_recipe

        torch.manual_seed(0)
        self.recipe = load_recipe(packaged_recipe(RECIPES[model_name]), [
            f"composer.num_queries={args.num_queries}", f"composer.depth={args.depth}",
            f"train.micro_batch={args.batch}", "model.device=cpu"])
        model, tok = load_backbone(model_name, device="cpu")
        self.model = ad.attach_adapters(model, self.recipe)
        ad.set_trainable(self.model, [ad.STUDENT, ad.ENCODER])
        self.tok = tok
        self.composer = Composer(self.model, tok, self.recipe.composer, self.recipe.bank.obs_char_budget)
        self.head = output_head(self.model)
        t = self.recipe.train
        self.student_params = ad.adapter_parameters(self.model, ad.STUDENT)
        self.composer_params = list(self.composer.resampler.parameters()) + ad.adapter_parameters(self.model, ad.ENCODER)
        self.student_opt = torch.optim.AdamW(self.student_params, lr=t.lr)
        self.composer_opt = torch.optim.AdamW(self.composer_params, lr=t.lopd.composer_lr)
        self.episodes, self.refs = synthetic_batch(tok, args.batch, args.length, args.action_tokens,
                                                   self.recipe.bank.n_retrieve)
        self.instrs = [ep.task.instruction for ep in self.episodes]
        with torch.no_grad():  # c_φ0 as the trainer's latent cache hands it over
            self.latents0 = self.composer(self.refs, self.instrs).detach().clone()
        self.beta = 1.0
        self.last_seconds: dict = {}
        self.model.train()

    # -- shapes, for the report
    def shapes(self) -> dict:
        from lopd_cli.compose.latent import build_teacher_batch

        tb = build_teacher_batch(self.episodes, self.tok, self.composer.latents_per_item * len(self.refs[0]))
        enc = [len(self.composer.item_token_ids(i, it)) for i, r in zip(self.instrs, self.refs) for it in r]
        return {"batch": len(self.episodes), "student_tokens": sum(len(e.input_ids) for e in self.episodes),
                "action_tokens": sum(sum(e.action_mask) for e in self.episodes),
                "teacher_tokens": sum(tb.lengths), "encoder_items": len(enc), "encoder_tokens": sum(enc),
                "latents_per_task": self.composer.latents_per_item * len(self.refs[0]),
                "params": sum(p.numel() for p in self.model.parameters()),
                "student_trainable": sum(p.numel() for p in self.student_params),
                "composer_trainable": sum(p.numel() for p in self.composer_params)}

    def _autocast(self, bf16: bool):
        import torch

        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    def _clip_step(self, params, opt) -> None:
        import torch

        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], self.recipe.train.grad_clip)
        opt.step()

    def sft(self, bf16: bool) -> None:
        from lopd_cli.models.adapters import use_student
        from lopd_cli.train import losses
        from lopd_cli.train.batch import collate, student_hidden

        self.student_opt.zero_grad(set_to_none=True)
        sb = collate(self.episodes, self.tok.pad_token_id or 0)
        with use_student(self.model), self._autocast(bf16):
            h = student_hidden(self.model, sb)
            lp = losses.chunked_token_logprobs(h, self.head, sb.targets, mask=sb.mask,
                                               chunk_size=self.recipe.train.logit_chunk)
        (-losses.sequence_mean(lp, sb.mask)).backward()
        self._clip_step(self.student_params, self.student_opt)

    def student(self, bf16: bool) -> None:
        import torch

        from lopd_cli.compose.latent import build_teacher_batch, teacher_hidden
        from lopd_cli.models.adapters import use_student
        from lopd_cli.train import losses
        from lopd_cli.train.batch import collate, student_hidden, to_student_layout

        t = self.recipe.train
        self.student_opt.zero_grad(set_to_none=True)
        sb = collate(self.episodes, self.tok.pad_token_id or 0)
        with torch.no_grad(), self._autocast(bf16):
            latents = self.composer(self.refs, self.instrs)
            tb = build_teacher_batch(self.episodes, self.tok, latents.shape[1])
            t_pred = to_student_layout(teacher_hidden(self.model, tb, latents), tb, tuple(sb.mask.shape))
        t_lp, t_ids = losses.chunked_teacher_topm(t_pred, self.head, t.distill.top_m, mask=sb.mask, chunk_size=t.logit_chunk)
        with use_student(self.model), self._autocast(bf16):
            kl = losses.chunked_reverse_kl(student_hidden(self.model, sb), self.head, t_lp, t_ids, sb.mask,
                                           chunk_size=t.logit_chunk)
        kl.loss.backward()
        self._clip_step(self.student_params, self.student_opt)

    def lopd(self, bf16: bool, rows=None) -> None:
        from lopd_cli.train.step import StepSetup, lopd_step
        from lopd_cli.train.losses import dual_update

        t = self.recipe.train
        self.student_opt.zero_grad(set_to_none=True)
        self.composer_opt.zero_grad(set_to_none=True)
        lat0 = dict(zip(self.instrs, self.latents0))
        setup = StepSetup(self.model, self.tok, t.distill.top_m, t.lopd.margin_m, t.lopd.anchor_lambda, t.micro_batch, t.logit_chunk,
                             composer=self.composer, train_composer=True,
                             latents0=lambda ins, r: torch_stack([lat0[i] for i in ins]),
                             autocast=bf16, composer_rows=rows)
        out = lopd_step(setup, self.episodes, self.refs, self.beta)
        self._clip_step(self.student_params, self.student_opt)
        if rows is None or any(rows):
            self._clip_step(self.composer_params, self.composer_opt)
            self.beta = dual_update(self.beta, t.lopd.margin_m, out.delta, t.lopd.eta_beta)
        self.last_seconds = dict(out.seconds)

    def lopd_share(self, bf16: bool) -> None:
        """`train.lopd.composer_batch` = a quarter of the rows: φ's pass on those, a no-grad teacher on the rest."""
        n = len(self.episodes)
        self.lopd(bf16, rows=[i < max(1, n // 4) for i in range(n)])

    def lopd_off(self, bf16: bool) -> None:
        """A step without φ (`train.lopd.composer_every` > 1, off step): no-grad encode + teacher, student."""
        self.lopd(bf16, rows=[False] * len(self.episodes))

    def head_pass(self, bf16: bool) -> None:
        """One no-grad lm_head pass over the action tokens (top-M + token log-probs): what
        step.py's composer phase spent re-reading the student's log-probs before they came
        out of the student pass."""
        import torch

        from lopd_cli.train import losses
        from lopd_cli.train.batch import collate

        sb = collate(self.episodes, self.tok.pad_token_id or 0)
        if not hasattr(self, "_hidden"):
            g = torch.Generator().manual_seed(0)
            d = self.model.config.hidden_size
            self._hidden = torch.randn((*sb.mask.shape, d), generator=g)
            self._ids = torch.randint(0, len(self.tok), (*sb.mask.shape, self.recipe.train.distill.top_m), generator=g)
        with torch.no_grad():
            losses.chunked_logprobs(self._hidden, self.head, topm_ids=self._ids, token_ids=sb.targets, mask=sb.mask,
                                    chunk_size=self.recipe.train.logit_chunk)

    def enc_fwd(self, bf16: bool) -> None:
        import torch

        with torch.no_grad(), self._autocast(bf16):
            self.composer(self.refs, self.instrs)

    def enc_fwdbwd(self, bf16: bool) -> None:
        self.composer_opt.zero_grad(set_to_none=True)
        with self._autocast(bf16):
            lat = self.composer(self.refs, self.instrs)
        lat.float().pow(2).mean().backward()
        self.composer_opt.zero_grad(set_to_none=True)


def torch_stack(xs):
    import torch

    return torch.stack(xs)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- workers


def worker_time(args) -> dict:
    import torch

    from lopd_cli.runtime import setup_torch

    setup_torch()
    bench = Bench(args.model, args)
    out = {"shapes": bench.shapes(), "threads": torch.get_num_threads(), "precisions": {}}
    for prec in args.precisions:
        bf16 = prec == "bf16"
        names = PHASES + PIECES
        runs: dict[str, list[float]] = {k: [] for k in names}
        split: dict[str, list[float]] = {}
        for _ in range(args.warmup):
            for name in names:
                getattr(bench, name)(bf16)
        for _ in range(args.repeats):
            for name in names:
                t0 = time.perf_counter()
                getattr(bench, name)(bf16)
                runs[name].append(time.perf_counter() - t0)
                if name.startswith("lopd"):
                    for k, v in bench.last_seconds.items():
                        split.setdefault(k if name == "lopd" else f"{name}.{k}", []).append(v)
        med = {k: statistics.median(v) for k, v in runs.items()}
        out["precisions"][prec] = {"seconds": med, "runs": runs,
                                   "lopd_phase_seconds": {k: statistics.median(v) for k, v in split.items()}}
    return out


def worker_memory(args) -> dict:
    import gc

    from lopd_cli.runtime import setup_torch

    setup_torch()
    bench = Bench(args.model, args)
    gc.collect()
    before = rss_mib()
    getattr(bench, args.phase)(args.precisions[0] == "bf16")
    peak = rss_mib()
    return {"setup_peak_rss_mib": round(before), "peak_rss_mib": round(peak), "step_rss_mib": round(peak - before)}


# ----------------------------------------------------------------------------- driver


def _worker_cmd(args, kind: str, model: str, extra: list[str]) -> list[str]:
    return [sys.executable, __file__, "--worker", kind, "--model", model, "--batch", str(args.batch),
            "--length", str(args.length), "--action-tokens", str(args.action_tokens),
            "--num-queries", str(args.num_queries), "--depth", str(args.depth), *extra]


_worker_env: dict = {}


def _run_worker(cmd: list[str]) -> dict:
    res = subprocess.run(cmd, capture_output=True, text=True, env=_worker_env)
    if res.returncode != 0:
        raise SystemExit(f"worker failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def summarise(timing: dict, memory: dict) -> dict:
    out = {}
    for prec, t in timing["precisions"].items():
        s = t["seconds"]
        sft = s["sft"]
        ratio = {k: s[k] / sft for k in s}
        floor_student = (1.1 + ratio["enc_fwd"], 1.3 + ratio["enc_fwd"])
        floor_lopd = 1.7 + ratio["enc_fwdbwd"]
        mem = memory.get(prec, {})
        sft_step = mem.get("sft", {}).get("step_rss_mib")
        out[prec] = {
            "seconds": s,
            "ratio_to_sft": ratio,
            "floor": {"student": list(floor_student), "lopd": floor_lopd},
            "over_floor": {"student": ratio["student"] / floor_student[1], "lopd": ratio["lopd"] / floor_lopd},
            "lopd_phase_seconds": t["lopd_phase_seconds"],
            "memory": mem,
            "memory_ratio_to_sft": {
                k: {"peak_rss": v["peak_rss_mib"] / mem["sft"]["peak_rss_mib"],
                    "step_rss": (v["step_rss_mib"] / sft_step) if sft_step else None}
                for k, v in mem.items()} if "sft" in mem else {},
        }
    return out


def markdown(results: dict) -> str:
    lines = []
    for model, r in results["models"].items():
        sh = r["shapes"]
        lines.append(f"**{model}** ({sh['params'] / 1e6:.1f} M params; student {sh['student_tokens']} tokens, "
                     f"{sh['action_tokens']} action; teacher {sh['teacher_tokens']} tokens incl. "
                     f"{sh['latents_per_task']} latents/task; encoder {sh['encoder_items']} items, "
                     f"{sh['encoder_tokens']} tokens)\n")
        lines.append("| precision | phase | median s | × SFT | floor × SFT | measured / floor | peak RSS MiB | step RSS MiB | step RSS × SFT |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for prec, p in r["summary"].items():
            for ph in PHASES + PIECES:
                fl = {"student": "{:.2f}–{:.2f}".format(*p["floor"]["student"]),
                      "lopd": f"{p['floor']['lopd']:.2f}"}.get(ph, "")
                ov = f"{p['over_floor'][ph]:.2f}" if ph in p["over_floor"] else ""
                m = p["memory"].get(ph, {})
                mr = p["memory_ratio_to_sft"].get(ph, {})
                step_ratio = mr.get("step_rss")
                lines.append(
                    f"| {prec} | {ph} | {p['seconds'][ph]:.3f} | {p['ratio_to_sft'][ph]:.2f} | {fl} | {ov} | "
                    f"{m.get('peak_rss_mib', '')} | {m.get('step_rss_mib', '')} | "
                    f"{'' if step_ratio is None else f'{step_ratio:.2f}'} |")
            split = p["lopd_phase_seconds"]
            lines.append(f"| {prec} | lopd split | " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()) + " | | | | | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny only, 2 repeats")
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--no-memory", action="store_true", help="skip the per-phase memory processes")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per worker (default 1: on a shared 2-core machine two OpenMP threads "
                         "made a tiny SFT step ~10x slower under load)")
    ap.add_argument("--jobs", type=int, default=None, help="memory processes at once (default 1; --quick 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones")
    ap.add_argument("--memory-precisions", nargs="+", default=None, choices=PRECISIONS,
                    help="precisions given a memory process per phase (default: all; --quick: fp32)")
    ap.add_argument("--batch", type=int, default=None, help="episodes per batch (default 8; --quick 4)")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--action-tokens", type=int, default=128)
    ap.add_argument("--num-queries", type=int, default=32)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--merge", action="store_true", help="add these models to an existing --out file")
    ap.add_argument("--worker", choices=["time", "memory"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    args.batch = args.batch or (4 if args.quick else 8)
    if args.worker:
        args.repeats = args.repeats or 3
        res = worker_time(args) if args.worker == "time" else worker_memory(args)
        print(json.dumps(res))
        return

    _worker_env.update(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"),
                       LOPD_THREADS=str(args.threads))
    models = args.models or (["tiny"] if args.quick else ["tiny", "smollm2-135m-instruct"])
    repeats = args.repeats or (2 if args.quick else 3)
    jobs = args.jobs or (3 if args.quick else 1)
    mem_precisions = args.memory_precisions or (["fp32"] if args.quick else args.precisions)
    t_start = time.time()
    results = {"command": " ".join(["benchmarks/step_overhead.py", *sys.argv[1:]]),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
               "load_average_start": load_average(), "repeats": repeats, "warmup": args.warmup,
               "config": {"threads": args.threads, "batch": args.batch, "length": args.length, "action_tokens": args.action_tokens,
                          "num_queries": args.num_queries, "depth": args.depth, "n_retrieve": 3, "top_m": 20,
                          "student_lora_r": 16, "encoder_lora_r": 8, "logit_chunk": 1024},
               "models": {}}
    for model in models:
        memory: dict = {}
        if not args.no_memory:
            cmds = {(prec, ph): _worker_cmd(args, "memory", model, ["--phase", ph, "--precisions", prec])
                    for prec in mem_precisions for ph in PHASES}
            with ThreadPoolExecutor(jobs) as pool:
                done = dict(zip(cmds, pool.map(_run_worker, cmds.values())))
            for (prec, ph), v in done.items():
                memory.setdefault(prec, {})[ph] = v
        load_before = load_average()
        timing = _run_worker(_worker_cmd(args, "time", model, ["--repeats", str(repeats), "--warmup", str(args.warmup),
                                                               "--precisions", *args.precisions]))
        results["models"][model] = {"config": dict(results["config"]), "command": results["command"],
                                    "repeats": repeats, "warmup": args.warmup,
                                    "shapes": timing["shapes"], "threads": timing["threads"],
                                    "load_average_timing": [load_before, load_average()],
                                    "timing": timing["precisions"], "summary": summarise(timing, memory)}
    results["load_average_end"] = load_average()
    results["wall_seconds"] = round(time.time() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    this_run = results
    if args.merge and args.out.exists():
        old = json.loads(args.out.read_text())
        old["models"].update(results["models"])
        old.setdefault("runs", []).append({k: results[k] for k in ("command", "load_average_start", "load_average_end",
                                                                    "wall_seconds")})
        results = old
    args.out.write_text(json.dumps(results, indent=2))
    print(markdown(this_run))
    print(f"\nwrote {args.out} in {this_run['wall_seconds']} s; load average {this_run['load_average_start']} → "
          f"{this_run['load_average_end']}")


if __name__ == "__main__":
    main()
