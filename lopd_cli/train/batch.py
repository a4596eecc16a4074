"""Student-side tensors for a batch of episodes, in the "prediction" layout the losses use.

Logits at position p predict token p+1, so every per-token tensor here is (B, T-1): entry
(b, p) is about token p+1 of episode b, scored from the hidden state at position p. The teacher's
hidden states are scattered into the same layout (`to_student_layout`), so teacher and student
are compared on exactly the same action tokens with the same mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lopd_cli.agent.types import Episode
from lopd_cli.compose.latent import TeacherBatch


@dataclass
class StudentBatch:
    input_ids: torch.Tensor  # (B, T) right-padded
    attention_mask: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, T-1): token p+1
    mask: torch.Tensor  # (B, T-1) bool: token p+1 was sampled by the policy
    behaviour_logprobs: torch.Tensor  # (B, T-1): the runner's log-prob of token p+1
    rewards: torch.Tensor  # (B,)

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def n_sequences(self) -> int:
        """Sequences with at least one supervised token (what the sequence-mean averages over)."""
        return int((self.mask.sum(1) > 0).sum())


@dataclass(frozen=True)
class BatchTotals:
    """What batch-level means divide by: counted over the WHOLE step's batch, which under
    torchrun is spread over several ranks (each rank weights its part by these)."""

    n_sequences: int  # episodes with at least one supervised token
    n_tokens: int  # supervised (action) tokens
    n_episodes: int


def batch_totals(episodes: Sequence[Episode]) -> BatchTotals:
    """The same counts `collate` gives (prediction layout: the first token is never a target)."""
    per_ep = [sum(ep.action_mask[1:]) for ep in episodes]
    return BatchTotals(sum(n > 0 for n in per_ep), sum(per_ep), len(episodes))


def collate(episodes: Sequence[Episode], pad_id: int, device: torch.device | str = "cpu") -> StudentBatch:
    T = max(len(ep.input_ids) for ep in episodes)
    B = len(episodes)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    act = torch.zeros((B, T), dtype=torch.bool)
    blp = torch.zeros((B, T), dtype=torch.float32)
    for b, ep in enumerate(episodes):
        n = len(ep.input_ids)
        ids[b, :n] = torch.tensor(ep.input_ids, dtype=torch.long)
        attn[b, :n] = 1
        act[b, :n] = torch.tensor(ep.action_mask, dtype=torch.bool)
        blp[b, :n] = torch.tensor(ep.logprobs, dtype=torch.float32)
    rewards = torch.tensor([float(ep.reward) for ep in episodes], dtype=torch.float32)
    return StudentBatch(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        targets=ids[:, 1:].to(device),
        mask=act[:, 1:].to(device),
        behaviour_logprobs=blp[:, 1:].to(device),
        rewards=rewards.to(device),
    )


def student_hidden(model, batch: StudentBatch) -> torch.Tensor:
    """Last hidden states (B, T-1, d) of the active view of `model`, prediction layout."""
    from lopd_cli.compose.composer import decoder_of
    from lopd_cli.compose.latent import decoder_hidden

    return decoder_hidden(decoder_of(model), batch.input_ids, batch.attention_mask)[:, :-1]


def to_student_layout(teacher_hidden: torch.Tensor, tb: TeacherBatch, shape: tuple[int, int]) -> torch.Tensor:
    """Teacher hidden states (B, T_teacher, d) → (B, T-1, d) in the student's prediction layout:
    the state predicting student token p sits at (b, p-1). Zeros elsewhere. Differentiable."""
    B, Tm1 = shape
    rows = teacher_hidden[tb.batch_index, tb.teacher_pos - 1]
    out = teacher_hidden.new_zeros((B, Tm1, teacher_hidden.shape[-1]))
    return out.index_put((tb.batch_index, tb.student_pos - 1), rows)


def filler_batch(episodes: Sequence[Episode], pad: int, device) -> StudentBatch:
    """A one-row batch for a filler pass of the uniform schedule (train/lockstep.py): the first
    episode, with at least one supervised token so that losses weighted by 0 stay finite."""
    sb = collate([episodes[0]], pad, device)
    if sb.n_tokens == 0:
        sb.mask[0, -1] = True
    return sb
