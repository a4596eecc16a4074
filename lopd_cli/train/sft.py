"""The SFT baseline (`--algo sft`): rejection-sampling fine-tuning of the student on the bank's
successful rollouts, in the same loop, checkpoints and metrics as LOPD, GRPO and OPSD.

The pool is every bank row whose reward reaches `eval.success_threshold` (the same "success"
as training metrics and `lopd eval`), except rows of the environment's validation tasks (held
out, as in the cold start, so validation figures and the check score tasks the student did not
train on), fixed when the run starts: its row ids go into each
checkpoint, so a resume trains on the same items even when the bank has grown meanwhile, and
under torchrun rank 0 picks them for every rank. Each item is tokenised once with the
transcript tokenisation the cold start uses (`agent/chat.py` `tokenize_transcript`): the loss is
on assistant-written tokens only (tool calls, answers, their end-of-turn token), never on the
prompt or tool results.

Each step draws `train.sft.batch` items (default `rollout.rollouts_per_step`) with the seeded,
checkpointed sampler the task sampler uses (epoch-wise shuffles of the pool), and takes one
optimiser step on the token-mean NLL of their action tokens — chunked over micro-batches
(`train.micro_batch`) and logit positions (`train.logit_chunk`). Under torchrun the batch is
split into contiguous shares; each rank weights its tokens by the batch's total, so the summed
gradients are the full-batch gradient.

What it simplifies: no rollouts are spent during training (`rollouts_total` stays at what
filling the bank cost, so SFT sits at the budget its data cost); no packing of sequences and no
loss masking of failed tool calls inside a successful transcript; a transcript longer than the
model's context is cut at it.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Iterator

import torch

from lopd_cli.agent.types import Episode, Task
from lopd_cli.compose.latent import output_head
from lopd_cli.errors import LopdError
from lopd_cli.models.adapters import use_student
from lopd_cli.train import distributed as dist
from lopd_cli.train import lockstep, losses
from lopd_cli.train.batch import batch_totals, collate, filler_batch, student_hidden
from lopd_cli.train.metrics import peak_memory_mb
from lopd_cli.train.sampler import TaskSampler

if TYPE_CHECKING:
    from lopd_cli.train.trainer import Trainer

IDS = "sft_ids"  # tr.extra: the pool's bank row ids (checkpointed)
POOL = "sft_pool"  # tr.extra: the tokenised pool, in IDS order (rebuilt from IDS, not saved)


def successful_rows(bank, threshold: float) -> Iterator:
    """The bank's rows that count as successes: reward ≥ `threshold` (eval.success_threshold) and
    no recorded error."""
    return (it for it in bank.iter_items(success_only=False) if it.reward >= threshold and not it.meta.get("error"))


def eligible_ids(project, recipe, held_out: set[str] = frozenset()) -> list[int]:
    """Bank rows that count as successes: reward ≥ eval.success_threshold, no recorded error,
    and not of a held-out task (`held_out`: task ids, the environment's validation tasks)."""
    from lopd_cli.bank.store import Bank

    path = project.bank_path(recipe)
    if not path.exists():
        raise LopdError(f"--algo sft: no bank at {path} (fill it first: lopd rollout --to-bank, lopd bank add-rollouts)")
    thr = recipe.eval.success_threshold
    with Bank(path, recipe.bank.min_reward, create=False) as bank:
        ids = [it.id for it in successful_rows(bank, thr) if str(it.task_id) not in held_out]
    if not ids:
        raise LopdError(f"--algo sft: the bank {path} holds no rollout with reward >= eval.success_threshold ({thr:g}) "
                        "outside the environment's validation tasks")
    return ids


def tokenize_pool(project, recipe, tokenizer, ids: list[int], max_len: int | None) -> list[Episode]:
    """The bank rows `ids` as episodes (input_ids + action mask), in that order."""
    from lopd_cli.agent.chat import tokenize_transcript
    from lopd_cli.bank.store import Bank

    with Bank(project.bank_path(recipe), recipe.bank.min_reward, create=False) as bank:
        items = bank.get_many(ids)
    missing = [i for i in ids if i not in items]
    if missing:
        raise LopdError(f"--algo sft: bank row {missing[0]} (one of {len(missing)}) of this run's pool is gone "
                        f"from {project.bank_path(recipe)}; the run cannot continue on the same data")
    pool = []
    for i in ids:
        it = items[i]
        try:
            input_ids, mask = tokenize_transcript(tokenizer, it.messages, it.tools)
        except LopdError as e:
            raise LopdError(f"--algo sft: bank row {i}: {e}") from None
        if max_len and len(input_ids) > max_len:
            input_ids, mask = input_ids[:max_len], mask[:max_len]
        pool.append(Episode(task=Task(str(it.task_id or i), it.instruction, it.tools), prompt_messages=[],
                            messages=it.messages, reward=float(it.reward), input_ids=input_ids, action_mask=mask,
                            logprobs=[0.0] * len(input_ids), meta={"bank_id": i}))
    return pool


def _max_len(model) -> int | None:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "max_position_embeddings", None)


def setup(tr: "Trainer") -> None:
    """The pool (rank 0's view of the bank, for every rank) and its sampler."""
    from lopd_cli.train.coldstart import validation_task_ids

    ids = dist.on_main(lambda: eligible_ids(tr.project, tr.recipe, validation_task_ids(tr.env_factory())))
    tr.extra[IDS] = ids
    tr.extra[POOL] = tokenize_pool(tr.project, tr.recipe, tr.tokenizer, ids, _max_len(tr.model))
    tr.state.sampler = TaskSampler(len(ids), tr.recipe.train.seed)


def _ensure_pool(tr: "Trainer") -> list[Episode]:
    """After a resume `tr.extra[IDS]` holds the checkpoint's pool: retokenise if it differs."""
    pool = tr.extra.get(POOL)
    ids = tr.extra[IDS]
    if pool is None or [ep.meta["bank_id"] for ep in pool] != ids:
        pool = tr.extra[POOL] = tokenize_pool(tr.project, tr.recipe, tr.tokenizer, ids, _max_len(tr.model))
    return pool


def batch_size(recipe) -> int:
    return recipe.train.sft.batch or recipe.rollout.rollouts_per_step


def nll_update(tr: "Trainer", local: list[Episode], total_tokens: int) -> tuple[float, int]:
    """Backward of this share's part of the batch's token-mean NLL. Returns (loss part, tokens)."""
    t = tr.recipe.train
    model = tr.model
    device = next(model.parameters()).device
    head = output_head(model)
    pad = tr.tokenizer.pad_token_id or 0
    loss, n_tokens = 0.0, 0
    chunks = [sb for sb in (collate(local[lo: lo + t.micro_batch], pad, device)
                            for lo in range(0, len(local), t.micro_batch)) if sb.n_tokens]
    # the uniform schedule of a per-layer sharded step: filler passes weigh 0
    for sb, real in lockstep.padded(chunks, lambda: filler_batch(local or _ensure_pool(tr), pad, device)):
        with use_student(model), torch.autocast(device.type, torch.bfloat16, enabled=tr.autocast):
            lp = losses.chunked_token_logprobs(student_hidden(model, sb), head, sb.targets, mask=sb.mask,
                                               chunk_size=t.logit_chunk)
        part = -(lp * sb.mask).sum() / max(1, total_tokens)
        if not real:
            (part * 0.0).backward()
            continue
        part.backward()
        loss += float(part.detach())
        n_tokens += sb.n_tokens
    return loss, n_tokens


def sft_step(tr: "Trainer") -> dict[str, Any]:
    """One SFT step: sample, NLL backward, all-reduce, clip, optimiser step (or skip when not
    finite). Returns the metrics row; advances tr.state like train_step."""
    from lopd_cli.train.optim import _grad_norm, _student_params, _sum_gradients

    t = tr.recipe.train
    step = tr.state.step + 1
    t0 = time.perf_counter()
    pool = _ensure_pool(tr)
    batch = [pool[i] for i in tr.state.sampler.take(batch_size(tr.recipe))]
    totals = batch_totals(batch)
    lo, hi = dist.shard_range(len(batch))
    tr.model.train()
    tr.student_opt.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    loss, _ = nll_update(tr, batch[lo:hi], totals.n_tokens)
    sec_student = time.perf_counter() - t1
    loss = dist.all_reduce_sum({"loss": loss})["loss"]
    _sum_gradients(tr, _student_params(tr.model))
    norm = _grad_norm(_student_params(tr.model), t.grad_clip)  # read again: sharded after the sum
    row: dict[str, Any] = {"step": step, "algo": tr.algo, "rollouts_total": tr.state.rollouts_total,
                           "loss": loss, "nll": loss, "grad_norm_student": norm, "grad_norm_composer": None}
    if math.isfinite(loss) and math.isfinite(norm):
        tr.student_opt.step()
        tr.state.nonfinite_streak = 0
    else:
        tr.student_opt.zero_grad(set_to_none=True)
        tr.state.nonfinite_streak += 1
        row["skipped_nonfinite"] = True
    tr.model.eval()
    sec_update = time.perf_counter() - t1
    row.update(dist.all_reduce_max({"sec_student": sec_student, "sec_update": sec_update}))
    row.update(update_tokens=totals.n_tokens, batch_sequences=totals.n_sequences, sft_pool=len(pool),
               update_tokens_per_s=totals.n_tokens / max(row["sec_update"], 1e-9),
               **dist.all_reduce_max({"sec_step": time.perf_counter() - t0, "peak_memory_mb": peak_memory_mb()}))
    tr.state.step = step
    if tr.state.nonfinite_streak >= t.max_nonfinite:
        raise LopdError(
            f"step {step}: non-finite loss or gradient in {tr.state.nonfinite_streak} steps in a row; "
            "stopped without writing a checkpoint (lower train.lr, or check the data)"
        )
    return row
