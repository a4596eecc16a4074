"""Two LOPD steps at the paper's shape on one GPU, through lopd's own step code.

What it runs, per configuration (model shape × student kind), each in a fresh process:

    set-up    the backbone (Qwen3-4B or -8B shaped, random weights: no weights travel, no hub),
              the student and encoder adapters (train/loop.py's set-up: adapters, AdamW, the
              composer and its frozen cold-start copy for the anchor term, via loop._setup_composer)
    generate  one rollout batch with the product's rollout code (step.rollout_phase → agent/runner,
              the hf backend) on the orders world's prompts: `--generate-tokens` new tokens each
              (random weights write no tool call, so every episode is one turn)
    steps     `--steps` calls of loop.train_step, the product's whole LOPD step (teacher pass,
              student pass, composer pass, guards, both optimiser steps, the dual step on β), with
              its rollout phase replaced by prebuilt multi-turn episodes of the stated shape
              (random weights cannot play the orders world for several turns)

    vllm      (`--rollout vllm`, after the steps) the same rollout batch through the product's
              vLLM backend (rollout/vllm.py): an engine beside the trainer on `--vllm-share` of the
              GPU, the student refreshed into it (LoRA: its adapter; full: its weights, in process)
    server    (`--rollout vllm-server`) the same batch through rollout/vllm_server.py against a
              `vllm serve` started on the same GPU (`--vllm-share` of it), the LoRA adapter
              hot-loaded; a full student through the product's reload (`rollout.server_url: auto`:
              its weights saved, the server restarted on them)

and prints seconds per phase (encode, teacher, composer, student, update), update tokens per
second, the peak device memory (torch.cuda.max_memory_allocated; on a CPU the peak RSS) and the
memory plan's prediction for the same step (lopd_cli/train/memory_plan.py) beside it; for each
vLLM path the engine's or server's start, the refresh, the generation's seconds and tokens/s,
and the device memory in use while it is up (nvidia-smi, every process). vLLM loads Qwen3 shapes
with `load_format: dummy` (random weights of its own, from a config-only folder) and runs
eagerly (no CUDA-graph capture: start-up time is device time); the server runs with
`--skip-tokenizer-init` (random weights sample ids the tiny tokenizer does not have).

The episodes (`--preset paper`): 32 rollouts = 32 distinct tasks; a prompt of ~1,024 tokens (the
orders world's system prompt and tool schemas, ~690 tokens, padded with filler to 1,024; all but
the task instruction shared by every rollout), then 3 turns of 256 sampled (action) tokens with
two tool observations of 128 tokens between them: 2,048 tokens in all, 768 of them actions.
Retrieval: n_ret = 3 bank items per task, each rendered to 1,024 encoder tokens; the composer
makes K = 32 latents per item (96 per task) with depth 8 (the paper's). Micro-batches of 2
sequences (train.micro_batch, train.lopd.composer_micro_batch), logit chunks of 1,024, top-M 20,
LoRA r 16 (student) and 8 (encoder), every step a composer step (train.lopd.composer_every 1: the
step that sets peak memory). bf16 autocast with fp32 master weights (model.autocast_bf16 auto).

The tokenizer is the embedded `tiny` one (a byte-level BPE trained locally in a second); its
ids are a subset of the 151,936-row embedding, so every cost that depends on the vocabulary
(the LM head, logits) is the real model's.

    python benchmarks/gpu/lopd_step_at_scale.py                       # the GPU run (README.md)
    python benchmarks/gpu/lopd_step_at_scale.py --shape tiny --device cpu --preset tiny   # seconds
    .venv-vllm/bin/python benchmarks/gpu/lopd_step_at_scale.py --shape tiny --device cpu \
        --rollout hf vllm vllm-server                                    # the vLLM paths on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Qwen3-4B and Qwen3-8B as their config.json files give them (hidden, layers, heads, kv heads,
# head_dim, intermediate, vocab, tied embeddings); rope and norm settings as published.
QWEN3 = {
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                     max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                     max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
}
EMBEDDED = {"tiny": "tiny", "smollm2": "smollm2-135m-instruct"}
SHAPES = [*EMBEDDED, *QWEN3]


@dataclass(frozen=True)
class Workload:
    """The shape of one step (see the module docstring)."""

    rollouts: int = 32
    prompt_tokens: int = 1024
    turns: int = 3
    action_tokens: int = 256  # per turn
    observation_tokens: int = 128  # between two turns
    n_ret: int = 3
    num_queries: int = 32
    depth: int = 8
    item_tokens: int = 1024
    micro_batch: int = 2
    composer_micro_batch: int = 2
    logit_chunk: int = 1024
    generate_tokens: int = 128

    @property
    def seq_tokens(self) -> int:
        return self.prompt_tokens + self.turns * self.action_tokens + (self.turns - 1) * self.observation_tokens


PRESETS = {
    "paper": Workload(),
    # The CPU memory-plan check (benchmarks/memory_plan_check.py) and its --quick form.
    "cpu": Workload(rollouts=8, prompt_tokens=768, turns=3, action_tokens=64, observation_tokens=32, num_queries=32,
                    depth=8, item_tokens=256, micro_batch=4, composer_micro_batch=2, generate_tokens=0),
    # Seconds on a CPU: what tests/test_gpu_script.py runs so that this script does not rot.
    "tiny": Workload(rollouts=4, prompt_tokens=720, turns=2, action_tokens=12, observation_tokens=8, num_queries=4,
                     depth=1, item_tokens=48, micro_batch=2, composer_micro_batch=2, generate_tokens=4),
}


# ----------------------------------------------------------------------------- building


def build_backbone(shape: str, device: str):
    """(model, tokenizer): an embedded backbone with its weights, or a Qwen3-shaped one with
    random weights (built on `device` directly) and the embedded tiny tokenizer."""
    import torch

    from lopd_cli.models.backbone import load_backbone, load_tokenizer
    from lopd_cli.models.registry import materialise_backbone

    if shape in EMBEDDED:
        model, tok = load_backbone(EMBEDDED[shape], "float32", device)
        # transformers maps the safetensors file into memory: the weights' pages are the file's
        # until something writes them (a full student's first optimiser step turns all of them
        # into anonymous memory). Own copies now, so the loaded model is what it will be.
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.data = t.data.clone()
        return model, tok
    from transformers import AutoModelForCausalLM, Qwen3Config

    tok = load_tokenizer(materialise_backbone("tiny"))
    cfg = Qwen3Config(**QWEN3[shape], pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    return model, tok


def recipe_for(w: Workload, student: str, checkpointing: bool, composer_every: int = 1, autocast: str = "auto"):
    from lopd_cli.config import load_recipe
    from lopd_cli.project import packaged_recipe

    return load_recipe(packaged_recipe("orders-tiny"), [
        f"model.student={student}", f"model.autocast_bf16={autocast}", "model.device=auto",
        f"env.kwargs={{n_train: {w.rollouts * (1 + w.n_ret)}, n_validation: 4, n_test: 4}}",
        f"rollout.rollouts_per_step={w.rollouts}", f"rollout.batch_size={w.rollouts}",
        f"rollout.max_new_tokens={max(1, w.generate_tokens)}", "rollout.max_turns=1",
        f"rollout.max_prompt_tokens={max(4096, w.prompt_tokens + 64)}",
        f"bank.n_retrieve={w.n_ret}", f"composer.num_queries={w.num_queries}", f"composer.depth={w.depth}",
        f"composer.max_item_tokens={w.item_tokens}",
        f"train.micro_batch={w.micro_batch}", f"train.lopd.composer_micro_batch={w.composer_micro_batch}",
        f"train.logit_chunk={w.logit_chunk}", f"train.lopd.composer_every={composer_every}",
        f"train.activation_checkpointing={str(checkpointing).lower()}", "train.eval_every=0", "train.lopd.health_n=0",
    ])


def _filler(tok, rng: random.Random, n_tokens: int) -> str:
    """Text of about `n_tokens` tokens: decoded random non-special ids (re-encoding changes the
    count a little; callers measure what they get)."""
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    return tok.decode(rng.choices(vocab, k=max(0, n_tokens)), skip_special_tokens=True)


def _prompt_filler(tok, env, task, target: int, seed: int) -> str:
    """The longest filler (a prefix of one random token sequence, decoded) whose prompt renders to
    at most `target` tokens (bisection on the number of filler tokens)."""
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    ids = rng.choices([i for i in range(len(tok)) if i not in special], k=max(1, 2 * target))
    text = lambda k: tok.decode(ids[:k], skip_special_tokens=True)  # noqa: E731
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(_prompt(tok, env, task, text(mid))[1]) <= target:
            lo = mid
        else:
            hi = mid - 1
    return text(lo)


def _prompt(tok, env, task, filler: str):
    """The world's prompt with `filler` (shared by every task) at the end of its system message."""
    from lopd_cli.agent.chat import render_prompt_ids

    msgs = env.reset(task)
    msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + filler}
    return msgs, render_prompt_ids(tok, msgs, task.tools)


def synthetic_episodes(tok, recipe, w: Workload, seed: int = 0):
    """(tasks, episodes, refs): `w.rollouts` multi-turn episodes of the orders world's training
    tasks, and `w.n_ret` bank items (other tasks, rendered to at least w.item_tokens) per task."""
    from lopd_cli.agent.types import Episode
    from lopd_cli.bank.store import BankItem
    from lopd_cli.envs.orders import OrdersEnv

    rng = random.Random(seed)
    env = OrdersEnv(**recipe.env.kwargs)
    all_tasks = env.tasks("train")
    tasks, others = all_tasks[: w.rollouts], all_tasks[w.rollouts: w.rollouts * (1 + w.n_ret)]
    filler = _prompt_filler(tok, env, tasks[0], w.prompt_tokens, seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    episodes = []
    for b, task in enumerate(tasks):
        msgs, pids = _prompt(tok, env, task, filler)
        ids, mask = list(pids), [0] * len(pids)
        for t in range(w.turns):
            ids += rng.choices(vocab, k=w.action_tokens)
            mask += [1] * w.action_tokens
            if t < w.turns - 1:
                ids += rng.choices(vocab, k=w.observation_tokens)
                mask += [0] * w.observation_tokens
        episodes.append(Episode(task=task, prompt_messages=msgs, messages=msgs, reward=float(b % 2 == 0),
                                input_ids=ids, action_mask=mask, logprobs=[-1.0 if m else 0.0 for m in mask],
                                prompt_len=len(pids), meta={"generated_by": "lopd"}))
    items = [BankItem(k + 1, t.id, t.instruction,
                      [{"role": "user", "content": t.instruction},
                       {"role": "assistant", "content": _filler(tok, rng, w.item_tokens)}],
                      t.tools, 1.0, True, {}) for k, t in enumerate(others)]
    refs = {t.instruction: items[b * w.n_ret:(b + 1) * w.n_ret] for b, t in enumerate(tasks)}
    return tasks, episodes, refs


class ReplayedRetriever:
    """The retriever's one method the step calls, over the prebuilt bank items."""

    def __init__(self, refs: dict):
        self.refs = refs

    def retrieve_many(self, instructions, n, **_exclusions):
        return [list(self.refs[i][:n]) for i in instructions]


@contextlib.contextmanager
def replayed_rollouts(episodes):
    """loop.train_step's rollout phase returns the prebuilt episodes of the tasks it picked."""
    from lopd_cli.train import loop

    by_task = {ep.task.id: ep for ep in episodes}
    real = loop.rollout_phase
    loop.rollout_phase = lambda tr, tasks, step, progress=None, index_offset=0: [by_task[t.id] for t in tasks]
    try:
        yield
    finally:
        loop.rollout_phase = real


def build_trainer(shape: str, device: str, w: Workload, student: str, checkpointing: bool, workdir: Path,
                  composer_every: int = 1, autocast: str = "auto"):
    """A loop.Trainer set up as train/loop.py's build_trainer sets one up, on an in-memory
    backbone (a full student's frozen teacher copy: a copy of its random weights):
    (trainer, tasks, episodes)."""
    import copy

    import torch

    from lopd_cli.compose.composer import Composer
    from lopd_cli.models import adapters as ad
    from lopd_cli.project import Project, ProjectSettings
    from lopd_cli.runtime import seed_everything
    from lopd_cli.agent.runner import make_env_factory
    from lopd_cli.train import loop
    from lopd_cli.train.sampler import TaskSampler

    recipe = recipe_for(w, student, checkpointing, composer_every, autocast)
    seed_everything(recipe.train.seed)
    model, tok = build_backbone(shape, device)
    teacher = None
    if loop.teacher_copy_needed(recipe):  # as loop.load_teacher_copy: frozen, no adapters
        teacher = copy.deepcopy(model).requires_grad_(False).eval()
    model = ad.attach_adapters(model, recipe)
    ad.set_trainable(model, [ad.BASE if student == "full" else ad.STUDENT, ad.ENCODER])
    tasks, episodes, refs = synthetic_episodes(tok, recipe, w)
    coldstart = workdir / "coldstart"
    Composer(model, tok, recipe.composer, recipe.bank.obs_char_budget).save(coldstart)
    recipe.train.lopd.composer_from = str(coldstart)
    tr = loop.Trainer(
        project=Project(workdir, ProjectSettings(name="scale")), recipe=recipe, run_dir=workdir / "run",
        model=model, tokenizer=tok, env_factory=make_env_factory(recipe), reward_fn=None, train_tasks=tasks,
        student_opt=torch.optim.AdamW(loop._student_params(model), lr=recipe.train.lr),
        state=loop.TrainState(beta=recipe.train.lopd.beta0, sampler=TaskSampler(len(tasks), recipe.train.seed)),
        teacher=teacher,
    )
    loop._setup_composer(tr)
    loop.apply_activation_checkpointing(tr)
    tr.retriever = ReplayedRetriever(refs)
    return tr, tasks, episodes


# ----------------------------------------------------------------------------- measuring


def step_shape(tok, recipe, episodes, retriever):
    """The memory plan's StepShape of these episodes (lengths as the step will see them)."""
    from lopd_cli.compose.composer import render_item_text
    from lopd_cli.compose.latent import build_teacher_batch, shared_prefix_len
    from lopd_cli.train.batch import collate
    from lopd_cli.train.memory_plan import StepShape

    r, t = recipe, recipe.train
    sb = collate(episodes, tok.pad_token_id or 0)
    tb = build_teacher_batch(episodes, tok, r.composer.num_queries * r.bank.n_retrieve)
    refs = retriever.retrieve_many([ep.task.instruction for ep in episodes], r.bank.n_retrieve)
    item_lens = {min(r.composer.max_item_tokens, len(tok(render_item_text(tok, ep.task.instruction, it,
                                                                         r.bank.obs_char_budget),
                                                         add_special_tokens=False)["input_ids"]))
                 for ep, rs in zip(episodes, refs) for it in rs}
    return StepShape(
        rollouts=len(episodes), micro_batch=t.micro_batch, composer_micro_batch=t.lopd.composer_micro_batch,
        seq_tokens=sb.input_ids.shape[1], shared_prefix=shared_prefix_len(sb.input_ids, sb.attention_mask),
        teacher_tokens=tb.input_ids.shape[1],
        teacher_shared_prefix=shared_prefix_len(tb.input_ids, tb.attention_mask, tb.latent_mask),
        action_tokens=int(sb.mask.sum()) // len(episodes), n_ret=r.bank.n_retrieve,
        num_queries=r.composer.num_queries, item_tokens=max(item_lens), logit_chunk=t.logit_chunk,
        top_m=t.distill.top_m, items_padded=len(item_lens) > 1)


def train_shape(recipe, precision: str, device: str, world_size: int = 1):
    from lopd_cli.train.loop import teacher_copy_needed
    from lopd_cli.train.memory_plan import TrainShape

    r = recipe
    return TrainShape(
        student=r.model.student, lora_r=r.model.lora.r, encoder_lora_r=r.composer.encoder_lora.r,
        precision=precision, master_bytes=2 if r.model.dtype == "bfloat16" else 4,
        activation_checkpointing=r.train.activation_checkpointing, teacher_copy=teacher_copy_needed(r),
        trains_composer=not r.train.lopd.freeze_composer, anchor_copy=r.train.lopd.anchor_lambda > 0,
        composer_depth=r.composer.depth, composer_ff_mult=r.composer.ff_mult,
        composer_share_layers=r.composer.share_layers, device="cpu" if device == "cpu" else "cuda",
        world_size=world_size)


def model_shape(shape: str, model=None):
    from lopd_cli.train.memory_plan import ModelShape

    if model is not None:
        return ModelShape.from_config(model.config)
    from transformers import Qwen3Config

    return ModelShape.from_config(Qwen3Config(**QWEN3[shape]))


def predicted_plan(shape: str, w: Workload, student: str, checkpointing: bool, device: str,
                   precision: str, model=None, tok=None):
    """The memory plan of one configuration from the tokenizer and the episodes alone (no model
    is needed for the Qwen3 shapes)."""
    from lopd_cli.models.backbone import load_tokenizer
    from lopd_cli.models.registry import materialise_backbone
    from lopd_cli.train.memory_plan import plan

    recipe = recipe_for(w, student, checkpointing)
    tok = tok or load_tokenizer(materialise_backbone("tiny"))
    _, episodes, refs = synthetic_episodes(tok, recipe, w)
    s = step_shape(tok, recipe, episodes, ReplayedRetriever(refs))
    return s, plan(model_shape(shape, model), s, train_shape(recipe, precision, device))


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Meter:
    """Memory readings in MiB. On a CUDA device: torch's allocator (memory_allocated, and its peak
    since `reset`). On a CPU: the process's anonymous resident memory (RssAnon: the tensors and
    the heap, not the shared libraries' code pages, which the first call of each kernel adds to
    the RSS for good: ~15-30 MiB over one LOPD step here), its peak sampled every 2 ms by a
    thread (torch releases the GIL inside its ops), and the kernel's peak RSS (VmHWM, reset with
    /proc/self/clear_refs) beside it."""

    def __init__(self):
        import threading

        import torch

        self.cuda = torch.cuda.is_available()
        self._peak = 0.0
        self._stop = threading.Event()
        self._thread = None
        if not self.cuda:
            self._peak = self.now()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            v = _status_mib("RssAnon")
            if v > self._peak:
                self._peak = v

    def now(self) -> float:
        import torch

        return torch.cuda.memory_allocated() / 2**20 if self.cuda else _status_mib("RssAnon")

    def reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        self._peak = self.now()
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def peak(self) -> float:
        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        return max(self._peak, self.now())

    def peak_rss(self) -> float:
        """CPU: the kernel's peak RSS (VmHWM) since `reset`, code pages included."""
        return _status_mib("VmHWM")

    def close(self) -> None:
        self._stop.set()


def _trim() -> None:
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def run_config(shape: str, student: str, device: str, w: Workload, steps: int, checkpointing: bool,
               composer_every: int = 1, rollouts: tuple[str, ...] = ("hf",), vllm_share: float = 0.3) -> dict:
    """Build one configuration, generate, run `steps` LOPD steps; a JSON-ready dict."""
    import torch

    from lopd_cli.runtime import setup_torch
    from lopd_cli.train import loop
    from lopd_cli.train.memory_plan import plan

    setup_torch()
    import transformers

    out: dict = {"shape": shape, "student": student, "device": device, "workload": asdict(w),
                 "activation_checkpointing": checkpointing, "steps": [],
                 "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                 "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lopd-scale-") as wd:
        tr, tasks, episodes = build_trainer(shape, device, w, student, checkpointing, Path(wd), composer_every)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out["sec_setup"] = time.perf_counter() - t0
        out["precision"] = "bf16" if tr.autocast else "fp32"
        out["params"] = sum(p.numel() for p in tr.model.parameters())
        out["trainable_student"] = sum(p.numel() for p in loop._student_params(tr.model))
        meter = Meter()
        if w.generate_tokens and "hf" in rollouts:
            meter.reset()
            t1 = time.perf_counter()
            eps = loop.rollout_phase(tr, tasks, 0)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            sec = time.perf_counter() - t1
            gen = sum(sum(ep.action_mask) for ep in eps)
            out["generate"] = {"episodes": len(eps), "new_tokens": gen, "prompt_tokens": max(ep.prompt_len for ep in eps),
                               "sec": sec, "tokens_per_s": gen / max(sec, 1e-9), "peak_mib": meter.peak()}
            del eps
        shape_s = step_shape(tr.tokenizer, tr.recipe, episodes, tr.retriever)
        predicted = plan(model_shape(shape, tr.model), shape_s,
                         train_shape(tr.recipe, out["precision"], device))
        out["step_shape"] = asdict(shape_s)
        out["plan"] = predicted.as_dict()
        _trim()
        out["mib_before_steps"] = meter.now()
        out["rss_mib_before_steps"] = _status_mib("VmRSS")
        with replayed_rollouts(episodes):
            for _ in range(steps):
                meter.reset()
                row = loop.train_step(tr)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                keep = {k: v for k, v in row.items() if k.startswith("sec_") or k in (
                    "step", "kl", "delta", "beta", "update_tokens", "update_tokens_per_s", "composer_rows",
                    "grad_norm_student", "grad_norm_composer")}
                keep["peak_mib"] = meter.peak()
                if not torch.cuda.is_available():
                    keep["rss_growth_mib"] = meter.peak_rss() - out["rss_mib_before_steps"]
                # measured against predicted: on a device all of torch's memory; on a CPU the peak
                # RSS over the loaded model (parameters are not part of it there)
                first = len(out["steps"]) == 0
                on_device = torch.cuda.is_available()
                keep["measured_mib"] = keep["peak_mib"] - (0 if on_device else out["mib_before_steps"])
                keep["plan_mib"] = ((predicted.parameters + predicted.teacher_copy if on_device else 0)
                                    + (0 if first else predicted.optimiser) + predicted.step_growth(first)) / 2**20
                out["steps"].append(keep)
        meter.close()
        for name in (r for r in rollouts if r != "hf"):
            if importlib.util.find_spec("vllm") is None:
                out[f"generate_{name}"] = {"skipped": "vLLM is not installed here"}
                continue
            _trim()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            try:
                out[f"generate_{name}"] = VLLM_PATHS[name](tr, tasks, shape, device, vllm_share, Path(wd))
            except ImportError as e:
                out[f"generate_{name}"] = {"skipped": f"vLLM is not installed here ({e})"}
            except Exception as e:  # noqa: BLE001 - one path failing must not lose the others' figures
                out[f"generate_{name}"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    out["sec_total"] = time.perf_counter() - t0
    return out


# ----------------------------------------------------------------------------- vLLM rollouts


def _device_used_mib() -> float | None:
    """Memory in use on GPU 0 by every process (an engine or server is another process), or None."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, check=True, timeout=30).stdout.splitlines()[0]
        return float(line)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


def served_dir(tr, shape: str, workdir: Path) -> tuple[Path, bool]:
    """(folder vLLM loads the backbone from, whether its weights are vLLM's dummy ones): an embedded
    backbone's own folder, or for a Qwen3 shape its config and the tokenizer alone."""
    if shape in EMBEDDED:
        return Path(tr.model.config._name_or_path), False
    d = workdir / "backbone"
    tr.model.config.save_pretrained(d)
    tr.tokenizer.save_pretrained(d)
    tr.model.config._name_or_path = str(d)  # the backends check the served folder against it
    return d, True


def _episodes_with(tr, tasks, backend) -> list:
    """The rollout phase (step.rollout_phase's call) through a given backend."""
    import torch

    from lopd_cli.agent.runner import run_episodes
    from lopd_cli.models import adapters as ad

    tr.model.eval()
    with torch.no_grad(), ad.use_student(tr.model):
        return run_episodes(tr.model, tr.tokenizer, tr.env_factory, tasks, tr.recipe.rollout, seed=1,
                            reward_fn=tr.reward_fn, backend=backend)


def _generation(eps, sec: float) -> dict:
    gen = sum(sum(ep.action_mask) for ep in eps)
    return {"episodes": len(eps), "new_tokens": gen, "prompt_tokens": max(ep.prompt_len for ep in eps),
            "sec": sec, "tokens_per_s": gen / max(sec, 1e-9), "device_used_mib": _device_used_mib()}


def _refresh_and_generate(tr, tasks, backend, out: dict) -> dict:
    """Time a second refresh (what every step pays) and one rollout batch into `out`."""
    t0 = time.perf_counter()
    backend.refresh()
    out["sec_refresh"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    eps = _episodes_with(tr, tasks, backend)
    out.update(_generation(eps, time.perf_counter() - t0))
    return out


def vllm_colocated(tr, tasks, shape: str, device: str, share: float, workdir: Path) -> dict:
    """The product's vLLM backend beside the trainer: start (engine + first refresh), a second
    refresh, one rollout batch."""
    from lopd_cli.rollout.vllm import VLLMBackend, shutdown_engines

    folder, dummy = served_dir(tr, shape, workdir)
    kwargs = {"max_model_len": tr.recipe.rollout.max_prompt_tokens, "enforce_eager": True}
    if dummy:
        kwargs["load_format"] = "dummy"
    t0 = time.perf_counter()
    backend = VLLMBackend(tr.model, tr.tokenizer, gpu_memory_utilization=share, **kwargs)
    try:
        out = {"sec_start": time.perf_counter() - t0, "served": str(folder), "dummy_weights": dummy}
        return _refresh_and_generate(tr, tasks, backend, out)
    finally:
        del backend
        shutdown_engines()


def vllm_server(tr, tasks, shape: str, device: str, share: float, workdir: Path) -> dict:
    """The product's server backend with `rollout.server_url: auto`: a `vllm serve` on the same
    device that the backend starts (start = server start + the student's first load: a LoRA
    adapter, or a full student's saved weights and the server started on them), a second
    refresh, one rollout batch."""
    from lopd_cli.models import adapters as ad
    from lopd_cli.rollout.vllm_server import VLLMServerBackend, stop_servers

    folder, dummy = served_dir(tr, shape, workdir)
    lora = ad.has_student_adapter(tr.model)
    args = ("--enforce-eager",) + (("--skip-tokenizer-init",) if dummy else ())
    if dummy and lora:  # a full student's server loads the weights it saved; a LoRA one vLLM's own random ones
        args += ("--load-format", "dummy")
    t0 = time.perf_counter()
    try:
        backend = VLLMServerBackend(tr.model, tr.tokenizer, "auto", timeout_s=600, gpu_memory_utilization=share,
                                    max_model_len=tr.recipe.rollout.max_prompt_tokens, server_args=args)
        out = {"sec_start": time.perf_counter() - t0, "served": str(folder), "dummy_weights": dummy and lora}
        return _refresh_and_generate(tr, tasks, backend, out)
    finally:
        stop_servers()


VLLM_PATHS = {"vllm": vllm_colocated, "vllm-server": vllm_server}


# ----------------------------------------------------------------------------- report


def summary_lines(res: dict) -> list[str]:
    if "skipped" in res:
        return [f"{res['shape']} {res['student']}: skipped ({res['skipped']})"]
    if "error" in res:
        return [f"{res['shape']} {res['student']}: FAILED: {res['error']}"]
    p = res["plan"]
    lines = [f"{res['shape']} {res['student']} ({res['precision']}, activation checkpointing "
             f"{'on' if res['activation_checkpointing'] else 'off'}): {res['params'] / 1e9:.2f} B params, "
             f"set-up {res['sec_setup']:.0f} s"]
    if "generate" in res:
        g = res["generate"]
        lines.append(f"  generate: {g['episodes']} episodes x {g['new_tokens'] // max(1, g['episodes'])} new tokens "
                     f"(prompt {g['prompt_tokens']}): {g['sec']:.1f} s, {g['tokens_per_s']:.0f} tokens/s, "
                     f"peak {g['peak_mib'] / 1024:.1f} GiB")
    for name in VLLM_PATHS:
        g = res.get(f"generate_{name}")
        if g is None:
            continue
        if "skipped" in g or "error" in g:
            lines.append(f"  generate ({name}): {g.get('skipped') or 'FAILED: ' + g['error'][-300:]}")
            continue
        used = f", device in use {g['device_used_mib'] / 1024:.1f} GiB" if g.get("device_used_mib") else ""
        lines.append(f"  generate ({name}): start {g['sec_start']:.1f} s, refresh {g['sec_refresh']:.2f} s, "
                     f"{g['episodes']} episodes x {g['new_tokens'] // max(1, g['episodes'])} new tokens: "
                     f"{g['sec']:.1f} s, {g['tokens_per_s']:.0f} tokens/s{used}")
    for s in res["steps"]:
        phases = ", ".join(f"{k[4:]} {v:.1f}" for k, v in s.items()
                           if k.startswith("sec_") and k not in ("sec_step", "sec_rollout"))
        lines.append(f"  step {s['step']}: {s['sec_step']:.1f} s ({phases}); {s['update_tokens_per_s']:.0f} update "
                     f"tokens/s; peak {s['peak_mib'] / 1024:.2f} GiB")
    what = "peak" if res["device"].startswith("cuda") else "peak anonymous RSS growth over the loaded model"
    for st in res["steps"]:
        lines.append(f"  step {st['step']} memory: {what} {st['measured_mib'] / 1024:.2f} GiB, plan "
                     f"{st['plan_mib'] / 1024:.2f} GiB (measured/plan {st['measured_mib'] / max(st['plan_mib'], 1e-9):.2f})")
    lines.append(f"  plan: params {p['parameters_gib']:.2f}, grads {p['gradients_gib']:.2f}, optimiser "
                 f"{p['optimiser_gib']:.2f}, teacher copy {p['teacher_copy_gib']:.2f}, activations "
                 f"{p['activations_gib']:.2f} ({', '.join(f'{k} {v:.2f}' for k, v in p['phases_gib'].items())}), "
                 f"logits {p['logits_gib']:.2f} GiB")
    return lines


def _fits(shape: str, student: str, w: Workload, checkpointing: bool, device_gib: float) -> tuple[bool, float]:
    """The memory plan's verdict before a configuration is started (no model is built)."""
    if shape not in QWEN3:
        return True, 0.0
    gib = predicted_plan(shape, w, student, checkpointing, "cuda", "bf16")[1].total_bytes / 2**30
    return gib <= device_gib * 0.97, gib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["qwen3-4b", "qwen3-8b"], choices=SHAPES)
    ap.add_argument("--student", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS), help="default: paper (tiny for --shape tiny)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--generate-tokens", type=int, default=None, help="new tokens per rollout in the generate phase")
    ap.add_argument("--rollouts", type=int, default=None)
    ap.add_argument("--no-checkpointing", action="store_true", help="train.activation_checkpointing off")
    ap.add_argument("--composer-every", type=int, default=1)
    ap.add_argument("--rollout", nargs="+", default=["hf", "vllm", "vllm-server"], choices=["hf", *VLLM_PATHS],
                    help="rollout backends to time (the vLLM ones after the steps; skipped where vLLM is absent)")
    ap.add_argument("--vllm-share", type=float, default=0.3, help="fraction of the GPU a vLLM engine or server takes")
    ap.add_argument("--budget-s", type=float, default=450, help="start no configuration after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default: $OUT/lopd_step_at_scale.json if $OUT)")
    ap.add_argument("--in-process", action="store_true", help="no subprocess per configuration (tests)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    w = PRESETS[a.preset or ("tiny" if a.shape == ["tiny"] else "paper")]
    if a.generate_tokens is not None:
        w = replace(w, generate_tokens=a.generate_tokens)
    if a.rollouts is not None:
        w = replace(w, rollouts=a.rollouts)
    ckpt = not a.no_checkpointing
    if a.worker:
        shape, student = a.worker.split(":")
        print("RESULT " + json.dumps(run_config(shape, student, a.device, w, a.steps, ckpt, a.composer_every,
                                                tuple(a.rollout), a.vllm_share)))
        return
    device_gib = _device_gib() if a.device.startswith("cuda") else None
    out = a.out or (Path(os.environ["OUT"]) / "lopd_step_at_scale.json" if os.environ.get("OUT") else None)
    results, t0 = [], time.perf_counter()
    for shape in a.shape:
        for student in a.student:
            elapsed = time.perf_counter() - t0
            if elapsed > a.budget_s:
                res = {"shape": shape, "student": student, "skipped": f"time budget ({elapsed:.0f} s > {a.budget_s:.0f} s)"}
            elif device_gib and not (fit := _fits(shape, student, w, ckpt, device_gib))[0]:
                res = {"shape": shape, "student": student,
                       "skipped": f"the memory plan predicts {fit[1]:.0f} GiB > {device_gib:.0f} GiB on this device"}
            elif a.in_process:
                res = run_config(shape, student, a.device, w, a.steps, ckpt, a.composer_every, tuple(a.rollout),
                                 a.vllm_share)
            else:
                cmd = [sys.executable, __file__, "--worker", f"{shape}:{student}", "--device", a.device,
                       "--steps", str(a.steps), "--composer-every", str(a.composer_every),
                       "--preset", a.preset or ("tiny" if a.shape == ["tiny"] else "paper"),
                       "--generate-tokens", str(w.generate_tokens), "--rollouts", str(w.rollouts),
                       "--rollout", *a.rollout, "--vllm-share", str(a.vllm_share)]
                if a.no_checkpointing:
                    cmd.append("--no-checkpointing")
                proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                res = json.loads(line[7:]) if line else {"shape": shape, "student": student,
                                                        "error": (proc.stderr or proc.stdout)[-2000:]}
            results.append(res)
            print("\n".join(summary_lines(res)), flush=True)
            if out:  # after every configuration: a run cut short keeps what it measured
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps({"workload": asdict(w), "results": results}, indent=1))
    if out:
        print(f"wrote {out}")


def _device_gib() -> float | None:
    """GPU 0's memory from nvidia-smi (this process starts no CUDA context of its own), else torch's."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, check=True, timeout=30).stdout.splitlines()[0]
        name, mib = line.rsplit(",", 1)
        print(f"device: {name.strip()}, {float(mib) / 1024:.0f} GiB", flush=True)
        return float(mib) / 1024
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        import torch

        if not torch.cuda.is_available():
            print("device: no CUDA device", flush=True)
            return None
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        print(f"device: {torch.cuda.get_device_name(0)}, {gib:.0f} GiB", flush=True)
        return gib


if __name__ == "__main__":
    main()
