"""The GRPO baseline in the same loop: G rollouts per task, group-normalised advantages, one
clipped policy-gradient update per batch (optionally with a k3 KL to the base model).

What it simplifies: one optimisation epoch per batch of rollouts (on-policy, as the paper's
GRPO baseline is run with the same rollouts per step as LOPD); the "old" log-probs are the
behaviour log-probs the runner recorded at the sampling temperature.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from lopd_cli.agent.types import Episode
from lopd_cli.compose.latent import output_head
from lopd_cli.models.adapters import teacher_view, use_student
from lopd_cli.train import lockstep, losses
from lopd_cli.train.batch import BatchTotals, collate, filler_batch, student_hidden


@dataclass
class GrpoSetup:
    model: object
    tokenizer: object
    temperature: float
    clip_eps: float
    kl_coef: float
    micro_batch: int
    logit_chunk: int
    autocast: bool = False


@dataclass
class GrpoOutcome:
    loss: float = 0.0
    clip_fraction: float = 0.0
    kl_ref: float = 0.0
    adv_abs: float = 0.0
    n_tokens: int = 0
    seconds: dict = field(default_factory=dict)
    finite: bool = True


def grpo_update(setup: GrpoSetup, episodes: Sequence[Episode], group_ids: Sequence[int],
                totals: BatchTotals | None = None) -> GrpoOutcome:
    """Accumulate the policy-gradient of the batch. `totals`: the whole step's counts when
    `episodes` is one rank's share (whole groups only); `adv_abs` is then this share's mean."""
    model, tok = setup.model, setup.tokenizer
    device = next(model.parameters()).device
    base_head = output_head(model)
    temp = setup.temperature if setup.temperature > 0 else 1.0
    head = lambda h: base_head(h) / temp  # noqa: E731 - log-probs at the sampling temperature
    pad = tok.pad_token_id or 0
    rewards = torch.tensor([float(ep.reward) for ep in episodes])
    adv = losses.group_advantages(rewards, torch.tensor(list(group_ids)))
    full = collate(episodes, pad, "cpu")
    n_seq_total = max(1, totals.n_sequences if totals else full.n_sequences)
    out = GrpoOutcome(n_tokens=full.n_tokens, adv_abs=float(adv.abs().mean()))
    t0 = time.perf_counter()
    chunks = []
    for lo in range(0, len(episodes), setup.micro_batch):
        sb = collate(list(episodes[lo : lo + setup.micro_batch]), pad, device)
        if sb.n_tokens:
            chunks.append((lo, sb))
    for (lo, sb), real in lockstep.padded(chunks, lambda: (0, filler_batch(episodes, pad, device))):
        w = sb.n_sequences / n_seq_total if real else 0.0  # a filler pass of the uniform schedule weighs 0
        a = adv[lo : lo + sb.input_ids.shape[0]].to(device)
        ref = None
        if setup.kl_coef > 0:
            with torch.no_grad(), teacher_view(model):
                ref = losses.chunked_token_logprobs(student_hidden(model, sb), head, sb.targets, mask=sb.mask,
                                                    chunk_size=setup.logit_chunk)
        with use_student(model), torch.autocast(device.type, torch.bfloat16, enabled=setup.autocast):
            new = losses.chunked_token_logprobs(student_hidden(model, sb), head, sb.targets, mask=sb.mask,
                                                chunk_size=setup.logit_chunk)
        res = losses.grpo_loss(new, sb.behaviour_logprobs, a, sb.mask, clip_eps=setup.clip_eps,
                               ref_logprobs=ref, kl_coef=setup.kl_coef)
        (res.loss * w).backward()
        if not real:
            continue
        out.loss += float(res.loss.detach()) * w
        out.clip_fraction += float(res.clip_fraction) * w
        out.kl_ref += float(res.kl) * w
    out.seconds = {"student": time.perf_counter() - t0}
    out.finite = out.loss == out.loss and abs(out.loss) != float("inf")
    return out
