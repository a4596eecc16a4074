"""LOPD and GRPO losses as pure torch functions (spec: docs/algorithm.md, "Objective").

Layout. Per-position tensors are (B, T, ...) — B sequences, T positions — with a mask
ω of shape (B, T) (bool or 0/1 float) marking the supervised (assistant/action) tokens.
Log-probabilities are always float32, whatever the model's dtype.

Pieces:
- top-M + tail distributions p̃ (M ids, plus one bucket holding 1 − their mass), taken from
  logits (exact tail: logsumexp over the ids' complement) or from stored log-probs (tail
  by log1mexp, clamped);
- the masked reverse KL(p̃^S ‖ p̃^T), with which side is detached made explicit: the student
  pass trains θ against a detached teacher; the composer pass trains φ through the teacher
  against a detached student;
- the privileged margin Δ (the paper's form and the centred one), the anchor term, the dual
  step on β, the composer's contrastive hinge and the composer objective;
- GRPO: group-normalised advantages and the clipped surrogate with an optional k3 KL;
- chunked forms that take last-layer hidden states and the lm_head and never build logits for
  more than `chunk_size` positions at once, in the forward or the backward (each chunk is
  recomputed under `torch.utils.checkpoint`).

Normalisation ("sequence mean"): a per-token quantity v is reduced as
    mean over sequences b with Σ_t ω_bt > 0 of ( Σ_t ω_bt v_bt / Σ_t ω_bt ),
i.e. the spec's E[ Σ ω·KL / Σ ω ] with the expectation over sequences (rollouts). Sequences
with no supervised token are left out of the mean; a batch with none gives 0 (still a graph).
Exceptions: the paper's Δ (`privileged_margin`) is, as in the spec, the mean over *all*
supervised tokens of the batch; the anchor is a sum over a task's elements (the spec's ‖·‖²).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

LMHead = Callable[[Tensor], Tensor] | Tensor
"""A module/callable mapping hidden states (n, d) to logits (n, V), or a weight (V, d)."""

DEFAULT_CHUNK = 1024
# Tail from stored log-probs: the top-M log-sum-exp is clamped to at most this, i.e. the tail
# mass is at least ~1e-7 (below fp32's resolution of 1 − Σp anyway). Same clamp as SDPO.
_LSE_MAX = -1e-7


class MaskedLoss(NamedTuple):
    loss: Tensor  # scalar, sequence-mean normalised
    per_token: Tensor  # (B, T), 0 where the mask is 0


class GrpoLoss(NamedTuple):
    loss: Tensor  # scalar, sequence-mean normalised
    per_token: Tensor  # (B, T) surrogate (+ kl_coef·k3), 0 where the mask is 0
    clip_fraction: Tensor  # scalar: share of supervised tokens where the clip was active
    kl: Tensor  # scalar: sequence-mean k3 KL to the reference (0 without one), detached


# ----------------------------------------------------------------------------- reductions


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ_t ω v / Σ_t ω per sequence, then the mean over sequences that have a supervised token.

    values, mask: (B, T). Masked-out entries are ignored even if they hold NaN/inf.
    Returns a scalar; 0 (connected to `values`' graph) when nothing is supervised.
    """
    w = mask.to(values.dtype)
    v = torch.where(w != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
    per_seq_weight = w.sum(-1)
    has_tokens = per_seq_weight > 0
    per_seq = (v * w).sum(-1) / per_seq_weight.clamp_min(torch.finfo(values.dtype).tiny)
    n_seq = has_tokens.sum()
    if n_seq == 0:
        return v.sum() * 0.0
    return torch.where(has_tokens, per_seq, torch.zeros_like(per_seq)).sum() / n_seq


def token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ_{b,t} ω v / Σ_{b,t} ω over the whole batch (0 when nothing is supervised)."""
    w = mask.to(values.dtype)
    v = torch.where(w != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (v * w).sum() / w.sum().clamp_min(1.0)


# ----------------------------------------------------------------- log-probs from logits


def _tail_from_logits(logits: Tensor, lse: Tensor, ids: Tensor) -> Tensor:
    """log(1 − Σ_{i∈ids} p_i) exactly: logsumexp of the logits outside `ids` minus the full one.

    `ids` must be distinct per position. When they cover the vocabulary the tail is empty and
    the result is −inf (no gradient), which the KL treats as a zero-mass bucket.
    """
    if ids.shape[-1] >= logits.shape[-1]:
        return torch.full_like(lse, float("-inf"))
    outside = logits.scatter(-1, ids, torch.finfo(logits.dtype).min)
    return torch.logsumexp(outside, -1, keepdim=True) - lse


def _logprob_parts(
    logits: Tensor, topm_ids: Tensor | None, token_ids: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    logits = logits.float()
    lse = torch.logsumexp(logits, -1, keepdim=True)
    topm = token = None
    if topm_ids is not None:
        on_ids = logits.gather(-1, topm_ids) - lse
        topm = torch.cat([on_ids, _tail_from_logits(logits, lse, topm_ids)], -1)
    if token_ids is not None:
        token = (logits.gather(-1, token_ids.unsqueeze(-1)) - lse).squeeze(-1)
    return topm, token


def token_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """log softmax(logits)[ids]: logits (..., V), ids (...) -> (...) float32."""
    return _logprob_parts(logits, None, ids)[1]


def topm_tail_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """log p̃ on `ids` plus the tail bucket: logits (..., V), ids (..., M) -> (..., M+1).

    The last entry is log(1 − Σ_{ids} p), computed exactly from the logits outside `ids`
    (no cancellation, so a peaked distribution keeps its tiny tail); −inf when M ≥ V.
    """
    return _logprob_parts(logits, ids, None)[0]


def teacher_topm(logits: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """Teacher's top-M: logits (..., V) -> (log p̃^T (..., M'+1) with tail, ids (..., M')).

    M' = min(m, V). Ids are sorted by decreasing probability. No gradient is taken.
    """
    with torch.no_grad():
        m_eff = min(int(m), logits.shape[-1])
        ids = logits.topk(m_eff, dim=-1).indices
        return topm_tail_logprobs(logits, ids), ids


def append_tail(topm_logprobs: Tensor, vocab_size: int) -> Tensor:
    """Add the tail bucket to stored top-M log-probs: (..., M) -> (..., M+1).

    For log-probs that come without logits (e.g. an inference server's top-M). The tail is
    log1mexp(logsumexp) with the log-sum-exp clamped to ≤ −1e-7 (tail mass ≥ ~1e-7), stable
    in both regimes; −inf when M ≥ vocab_size (the ids cover the vocabulary).
    """
    lse = torch.logsumexp(topm_logprobs.float(), -1, keepdim=True)
    if topm_logprobs.shape[-1] >= vocab_size:
        return torch.cat([topm_logprobs.float(), torch.full_like(lse, float("-inf"))], -1)
    x = lse.clamp(max=_LSE_MAX)
    # log(1 − e^x): expm1 form near 0, log1p form far from it.
    tail = torch.where(
        x > -0.6931471805599453,
        torch.log(-torch.expm1(x)),
        torch.log1p(-torch.exp(x)),
    )
    return torch.cat([topm_logprobs.float(), tail], -1)


# ------------------------------------------------------------------------- chunked forms


def _logits_fn(lm_head: LMHead) -> Callable[[Tensor], Tensor]:
    if isinstance(lm_head, Tensor):
        weight = lm_head
        return lambda h: F.linear(h, weight)
    return lm_head


def _chunked(
    hidden: Tensor,
    lm_head: LMHead,
    chunk_size: int,
    mask: Tensor | None,
    topm_ids: Tensor | None,
    token_ids: Tensor | None,
) -> tuple[Tensor | None, Tensor | None]:
    """Run `_logprob_parts` over chunks of positions; checkpoint each chunk when grad is on."""
    head = _logits_fn(lm_head)
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    n = h.shape[0]
    sel = mask.reshape(-1).nonzero().squeeze(-1) if mask is not None else None
    if sel is not None:
        h = h.index_select(0, sel)
    tids = topm_ids.reshape(n, -1) if topm_ids is not None else None
    kids = token_ids.reshape(n) if token_ids is not None else None
    if sel is not None:
        tids = tids.index_select(0, sel) if tids is not None else None
        kids = kids.index_select(0, sel) if kids is not None else None

    if isinstance(lm_head, Tensor):
        head_needs_grad = lm_head.requires_grad
    elif isinstance(lm_head, torch.nn.Module):
        head_needs_grad = any(p.requires_grad for p in lm_head.parameters())
    else:  # an opaque callable may close over trainable weights
        head_needs_grad = True
    use_ckpt = torch.is_grad_enabled() and (h.requires_grad or head_needs_grad)

    def run(hc: Tensor, tc: Tensor | None, kc: Tensor | None) -> tuple[Tensor, ...]:
        topm, token = _logprob_parts(head(hc), tc, kc)
        return tuple(x for x in (topm, token) if x is not None)

    topm_parts: list[Tensor] = []
    token_parts: list[Tensor] = []
    for start in range(0, h.shape[0], max(1, int(chunk_size))):
        sl = slice(start, start + chunk_size)
        args = (h[sl], tids[sl] if tids is not None else None, kids[sl] if kids is not None else None)
        outs = checkpoint(run, *args, use_reentrant=False) if use_ckpt else run(*args)
        outs = list(outs)
        if tids is not None:
            topm_parts.append(outs.pop(0))
        if kids is not None:
            token_parts.append(outs.pop(0))

    def assemble(parts: list[Tensor], tail_shape: tuple[int, ...]) -> Tensor:
        if parts:
            flat = torch.cat(parts, 0)
        else:  # nothing to compute: zeros still connected to `hidden` so backward() works
            flat = h.new_zeros((0, *tail_shape), dtype=torch.float32) + 0.0 * h.float().sum()
        if sel is not None:
            # zeros at unsupervised positions (index_copy keeps the gradient to `flat`)
            full = flat.new_zeros((n, *tail_shape))
            flat = full.index_copy(0, sel, flat)
        return flat.reshape(*lead, *tail_shape)

    topm = assemble(topm_parts, (tids.shape[-1] + 1,)) if tids is not None else None
    token = assemble(token_parts, ()) if kids is not None else None
    return topm, token


def chunked_logprobs(
    hidden: Tensor,
    lm_head: LMHead,
    *,
    topm_ids: Tensor | None = None,
    token_ids: Tensor | None = None,
    mask: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[Tensor | None, Tensor | None]:
    """Top-M+tail log-probs on `topm_ids` and/or log-probs of `token_ids`, chunk by chunk.

    hidden (..., d): last-layer hidden states (HF `hidden_states[-1]`, final norm included);
    lm_head: logits = lm_head(h) for h (n, d) (a module such as `model.lm_head`) or a weight
    (V, d); topm_ids (..., M); token_ids (...); mask (...): positions to compute — others come
    back as 0 and cost nothing. Returns (topm (..., M+1) or None, token (...) or None), float32.
    Logits exist for at most `chunk_size` positions at a time, in the backward too.
    """
    return _chunked(hidden, lm_head, chunk_size, mask, topm_ids, token_ids)


def chunked_token_logprobs(
    hidden: Tensor, lm_head: LMHead, ids: Tensor, *, mask: Tensor | None = None, chunk_size: int = DEFAULT_CHUNK
) -> Tensor:
    """`token_logprobs` from hidden states, chunked: hidden (..., d), ids (...) -> (...)."""
    return _chunked(hidden, lm_head, chunk_size, mask, None, ids)[1]


def chunked_topm_tail_logprobs(
    hidden: Tensor, lm_head: LMHead, ids: Tensor, *, mask: Tensor | None = None, chunk_size: int = DEFAULT_CHUNK
) -> Tensor:
    """`topm_tail_logprobs` from hidden states, chunked: hidden (..., d), ids (..., M) -> (..., M+1)."""
    return _chunked(hidden, lm_head, chunk_size, mask, ids, None)[0]


def chunked_teacher_topm(
    hidden: Tensor, lm_head: LMHead, m: int, *, mask: Tensor | None = None, chunk_size: int = DEFAULT_CHUNK
) -> tuple[Tensor, Tensor]:
    """`teacher_topm` from hidden states, chunked, without gradient.

    Returns (log p̃^T (..., M'+1), ids (..., M')); positions outside `mask` hold 0 and id 0.
    """
    head = _logits_fn(lm_head)
    with torch.no_grad():
        lead = hidden.shape[:-1]
        h = hidden.reshape(-1, hidden.shape[-1])
        n = h.shape[0]
        sel = mask.reshape(-1).nonzero().squeeze(-1) if mask is not None else torch.arange(n, device=h.device)
        lp_out: Tensor | None = None
        id_out: Tensor | None = None
        for start in range(0, sel.numel(), max(1, int(chunk_size))):
            idx = sel[start : start + chunk_size]
            lp, ids = teacher_topm(head(h.index_select(0, idx)), m)
            if lp_out is None:
                lp_out = lp.new_zeros((n, lp.shape[-1]))
                id_out = ids.new_zeros((n, ids.shape[-1]))
            lp_out[idx] = lp
            id_out[idx] = ids
        if lp_out is None:  # nothing supervised: shapes from (at most) one probe position
            probe_lp, probe_ids = teacher_topm(head(h[:1]), m)
            lp_out = probe_lp.new_zeros((n, probe_lp.shape[-1]))
            id_out = probe_ids.new_zeros((n, probe_ids.shape[-1]))
        return lp_out.reshape(*lead, -1), id_out.reshape(*lead, -1)


# ------------------------------------------------------------------------------ LOPD terms


def topm_kl_per_token(student_logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """KL(p̃^S ‖ p̃^T) = Σ_k p̃^S_k (log p̃^S_k − log p̃^T_k) over the M+1 buckets: (..., M+1) -> (...).

    A bucket with p̃^S_k = 0 (log −inf, e.g. the empty tail when M ≥ V) contributes exactly 0
    and no NaN, in value and gradient.
    """
    s, t = student_logprobs.float(), teacher_logprobs.float()
    empty = torch.isneginf(s)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    s_safe = torch.where(empty, zero, s)
    t_safe = torch.where(empty, zero, t)
    terms = torch.where(empty, zero, s_safe.exp() * (s_safe - t_safe))
    return terms.sum(-1)


def generalized_jsd(student_logprobs: Tensor, teacher_logprobs: Tensor, alpha: float) -> Tensor:
    """SDPO's divergence per token on top-k+tail log-probs (..., k+1) -> (...), teacher detached:
    α = 0 forward KL(T ‖ S), α = 1 reverse KL(S ‖ T), between them the generalized
    Jensen-Shannon divergence (1 − α) KL(S ‖ M) + α KL(T ‖ M), M = (1 − α) S + α T.
    Empty buckets (log −inf, e.g. the tail when k ≥ V) contribute 0."""
    s, t = student_logprobs.float(), teacher_logprobs.detach().float()
    kl = topm_kl_per_token  # KL(p ‖ q) over the buckets, 0 where p has no mass
    if alpha == 0.0:
        return kl(t, s)
    if alpha == 1.0:
        return kl(s, t)
    a = torch.tensor(alpha, dtype=s.dtype, device=s.device)
    m = torch.logsumexp(torch.stack([s + torch.log1p(-a), t + torch.log(a)]), dim=0)
    return torch.lerp(kl(s, m), kl(t, m), a)


def clipped_is_ratio(logprobs: Tensor, old_logprobs: Tensor, clip: float) -> Tensor:
    """exp(log π_θ − log π_old), detached and clipped above at `clip` (SDPO's `is_clip`)."""
    return torch.exp((logprobs - old_logprobs).detach().clamp(-20.0, 20.0)).clamp(max=clip)


def topm_reverse_kl(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    detach: Literal["teacher", "student"] = "teacher",
    weight: Tensor | None = None,
) -> MaskedLoss:
    """L = sequence_mean(KL(p̃^S ‖ p̃^T), ω) on top-M+tail log-probs (B, T, M+1).

    detach="teacher": the student pass (gradient into θ only, teacher is a constant).
    detach="student": the composer pass, KL(sg[S] ‖ T) (gradient into φ through the teacher).
    weight (B, T), no gradient: each token's KL is scaled by it (`privilege_weights`); the
    sequence mean still divides by the supervised tokens, so a weight of 0 removes a token's
    pull without raising the others'.
    """
    if detach == "teacher":
        teacher_logprobs = teacher_logprobs.detach()
    elif detach == "student":
        student_logprobs = student_logprobs.detach()
    else:
        raise ValueError(f"detach must be 'teacher' or 'student', not {detach!r}")
    per_token = topm_kl_per_token(student_logprobs, teacher_logprobs)
    if weight is not None:
        per_token = per_token * weight.detach().to(per_token.dtype)
    per_token = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    return MaskedLoss(sequence_mean(per_token, mask), per_token)


def privilege_weights(teacher_logprobs: Tensor, control_logprobs: Tensor) -> Tensor:
    """Where the teacher's references matter: the total-variation distance between the teacher
    with the task's own references and the same teacher with another task's (a control block of
    the same form), on the teacher's top-M+tail buckets: (..., M+1) × 2 -> (...) in [0, 1], no grad.

    A token whose prediction the references do not change (the frame's general effect, shared by
    both blocks) gets ~0; one that the task's own references decide (a store's rule) gets up to
    1. The student is not in it: this measures privilege, not disagreement with the student."""
    with torch.no_grad():
        p, q = teacher_logprobs.float().exp(), control_logprobs.float().exp()
        return (0.5 * (p - q).abs().sum(-1)).clamp(0.0, 1.0)


def reverse_kl_topm(
    student_logits: Tensor, teacher_logprobs: Tensor, topm_ids: Tensor, mask: Tensor
) -> MaskedLoss:
    """Student-pass loss from full logits: student_logits (B, T, V), teacher (B, T, M+1), ids (B, T, M).

    Same as `topm_reverse_kl(topm_tail_logprobs(student_logits, topm_ids), teacher, mask)`.
    """
    return topm_reverse_kl(topm_tail_logprobs(student_logits, topm_ids), teacher_logprobs, mask)


def chunked_reverse_kl(
    student_hidden: Tensor,
    lm_head: LMHead,
    teacher_logprobs: Tensor,
    topm_ids: Tensor,
    mask: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK,
) -> MaskedLoss:
    """`reverse_kl_topm` from the student's hidden states (B, T, d), chunked in forward and backward."""
    student = chunked_topm_tail_logprobs(student_hidden, lm_head, topm_ids, mask=mask, chunk_size=chunk_size)
    return topm_reverse_kl(student, teacher_logprobs, mask)


MarginForm = Literal["paper", "centred"]


def paper_advantages(rewards: Tensor) -> Tensor:
    """The paper's A(τ) = 2r − 1 ∈ [−1, 1] (docs/algorithm.md, "Objective"): (B,) -> (B,) float32."""
    return 2.0 * rewards.detach().float() - 1.0


def centred_advantages(rewards: Tensor, group_ids: Tensor | None = None, valid: Tensor | None = None,
                       mean: float | None = None) -> Tensor:
    """A(τ) = 2 (r − r̄): the paper's advantage with its fixed centre 1/2 replaced by the mean reward.

    rewards (B,); valid (B,) bool: the sequences that enter the margin (those with a supervised
    token) — r̄ is their mean and the others get 0. Groups: when `group_ids` (B,) repeats a
    task among the valid sequences (GRPO-style groups of rollouts of one task), r̄ is the group's
    mean and a group of one gets 0; otherwise r̄ is the batch mean, or `mean` when given (the
    mean over all ranks). The factor 2 keeps the paper's scale (|A| = 1 for r ∈ {0, 1} at
    r̄ = 1/2), so the margin m means the same nats per token. Float64 inside; returns (B,)
    float32, no gradient.
    """
    r = rewards.detach().double()
    ok = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.bool().to(r.device)
    if group_ids is not None and torch.unique(group_ids[ok]).numel() < int(ok.sum()):
        _, inv = torch.unique(group_ids, return_inverse=True)
        w = ok.double()
        n = torch.zeros(int(inv.max()) + 1, dtype=r.dtype, device=r.device).index_add_(0, inv, w)
        tot = torch.zeros_like(n).index_add_(0, inv, r * w)
        centre = (tot / n.clamp_min(1.0))[inv]
        adv = torch.where((n <= 1)[inv], torch.zeros_like(r), 2.0 * (r - centre))
    else:
        centre = float(mean) if mean is not None else (float(r[ok].mean()) if ok.any() else 0.0)
        adv = 2.0 * (r - centre)
    return torch.where(ok, adv, torch.zeros_like(adv)).float()


def rewards_have_spread(rewards: Tensor, valid: Tensor | None = None) -> bool:
    """Whether the centred margin says anything: the rewards of the valid sequences differ.

    With every rollout failing (or every one succeeding) the centred advantages are all 0, Δ is
    0 by construction and carries no evidence about privilege; the trainer then skips the dual
    step instead of reading Δ = 0 < m as a violation."""
    r = rewards.detach().double()
    if valid is not None:
        r = r[valid.bool().to(r.device)]
    return r.numel() > 1 and bool(r.max() > r.min())


def privileged_margin(
    teacher_token_logprobs: Tensor, student_token_logprobs: Tensor, reward: Tensor, mask: Tensor
) -> Tensor:
    """The paper's Δ = token_mean over all supervised tokens of A(τ)·δ, δ = log π^T(a) − sg[log π^S(a)].

    teacher/student token log-probs (B, T) of the taken actions; reward (B,) with A = 2r − 1
    (∈ [−1, 1] for r ∈ [0, 1]). Gradient flows into the teacher side only. 0 if nothing is
    supervised. `train.lopd.margin_advantage: paper`.

    Why it is not the default: on the student's own samples E[δ] = −KL(S‖T) ≤ 0, so
    Δ ≈ (1 − 2r̄)·KL + a covariance term; when most rollouts fail, any teacher that merely
    differs from the student satisfies Δ ≥ m (and long failing rollouts dominate the token
    mean). See `centred_margin`.
    """
    delta = teacher_token_logprobs.float() - student_token_logprobs.detach().float()
    advantage = paper_advantages(reward).to(delta).unsqueeze(-1)
    return token_mean(advantage * delta, mask)


def centred_margin(
    teacher_token_logprobs: Tensor, student_token_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> Tensor:
    """Δ_c = sequence_mean of A(τ)·δ with centred advantages (`centred_advantages`): the default,
    `train.lopd.margin_advantage: centred`.

    With batch centring Δ_c = 2·Cov_τ(r, δ̄_τ), δ̄_τ = the token mean of δ in rollout τ: the
    teacher is privileged when it is more likely than the student on successful rollouts
    *relative to* failed ones. Two changes from the paper's form, each removing a way to satisfy
    the margin by disagreement alone:
    - centring (r − r̄): Σ_τ A_τ = 0, so a δ that is the same on every rollout (e.g. −KL(S‖T) of
      a teacher that merely differs) contributes exactly 0, whatever r̄ — the (1 − 2r̄)·KL term
      is gone and only the covariance of reward and δ remains;
    - the mean per sequence, then over sequences (not over all tokens): with a token mean a
      constant δ = −c would still give −c·Σ_τ A_τ L_τ / Σ L, which is > 0 whenever failing
      rollouts are longer than successful ones (they usually are).
    Why centring rather than "Δ on successes only" (which also removes the disagreement term):
    when most rollouts fail the successes are few (6 of 32 at r̄ = 0.2), so a successes-only Δ is
    a noisy estimate that ignores the failures' evidence, while the centred form uses every
    rollout and asks for the *relative* gain (teacher better on successes than on failures).
    teacher/student (B, T); advantages (B,) (constants); mask (B, T). Gradient into the teacher.
    """
    delta = teacher_token_logprobs.float() - student_token_logprobs.detach().float()
    return sequence_mean(advantages.detach().to(delta).unsqueeze(-1) * delta, mask)


def per_sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ_t ω v / Σ_t ω for each sequence: (B, T) -> (B,); 0 for a sequence with no supervised token."""
    w = mask.to(values.dtype)
    v = torch.where(w != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (v * w).sum(-1) / w.sum(-1).clamp_min(1.0)


def contrastive_hinge(nll_own: Tensor, nll_other: Tensor, margin: float) -> Tensor:
    """mean_b max(0, NLL_own − NLL_other + margin): the teacher's NLL of a trajectory with its own
    task's references must beat its NLL with another task's references by `margin` (nats per
    token). nll_own, nll_other: (B,) per-sequence token-mean NLLs, both differentiable (the
    gradient reaches ψ and χ through both sets of latents). 0 (still a graph) for an empty batch."""
    if nll_own.numel() == 0:
        return nll_own.sum() * 0.0
    return torch.relu(nll_own.float() - nll_other.float() + float(margin)).mean()


def reference_privilege(lp_none: Tensor, lp_text: Tensor) -> Tensor:
    """Per token, how much reading the references as text helps the frozen teacher:
    max(0, NLL without a block − NLL with the references as text), in nats. Large where the
    references hold something the prompt does not (a store's sign-off), ~0 where they tell nothing
    new or mislead (another task's ids)."""
    return (lp_text.float() - lp_none.float()).clamp_min(0.0)


def privilege_weighted_nll(lp: Tensor, privilege: Tensor, weight: float) -> Tensor:
    """Token mean of (1 + weight · privilege) · NLL: the plain NLL plus `weight` times the NLL on
    the tokens where the references are privileged, each scaled by that privilege."""
    return ((1.0 + float(weight) * privilege.to(lp.dtype)) * -lp).mean()


def anchor_loss(latents: Tensor, latents0: Tensor) -> Tensor:
    """The anchor as the spec writes it: ‖c − sg[c0]‖², summed over a task's elements, then the
    mean over the batch's tasks.

    latents, latents0: (B, n_ret·K, d), one task per leading index (a 2-D (K, d) input is one
    task). Scale: a task's ‖c − c0‖² adds up n_ret·K·d squared coordinates, so with latents at
    token-embedding scale (row norm ρ, the composer's init) a relative drift ε in every row costs
    n_ret·K·ε²·ρ², and λ = 0.2 weighs it against KL and Δ, which are nats per token. (Before
    issue 16 this was a mean over elements, 1/(n_ret·K·d) of the spec — 1/13,824 on SmolLM2 —
    so the anchor was effectively off.) Gradient flows into `latents` only.
    """
    diff = latents.float() - latents0.detach().float()
    if diff.dim() <= 2:
        return diff.pow(2).sum()
    return diff.pow(2).flatten(1).sum(-1).mean()


def dual_update(beta: float, margin_m: float, delta: float | Tensor, eta: float) -> float:
    """β ← max(0, β + η (m − Δ)): β grows while Δ < m and decays to 0 once Δ > m.

    Units: Δ and m are nats per token, so η is β per nat. The paper's η = 0.5 with m = 0.05 moves
    β by at most 0.025 a step (≈ 0.2 in 8 steps): inert in short runs. The recipe default is
    `train.lopd.eta_beta = 10` = 0.5 / 0.05, i.e. a shortfall of one default margin raises β by 0.5.
    """
    d = float(delta.detach()) if isinstance(delta, Tensor) else float(delta)
    return max(0.0, float(beta) + float(eta) * (float(margin_m) - d))


class TermWeights(NamedTuple):
    """What each term of `composer_objective` is multiplied by: the share of the step's batch that
    a micro-batch holds, per term (its sequences, tokens, tasks, contrastive pairs). 1: unweighted."""

    kl: float = 1.0
    margin: float = 1.0
    anchor: float = 1.0
    contrastive: float = 1.0


def composer_objective(
    kl_sg_student: Tensor | float,
    beta: float,
    margin_m: float | None,
    delta: Tensor | float,
    anchor: Tensor | float,
    anchor_lambda: float,
    contrastive: Tensor | float | None = None,
    contrastive_weight: float = 0.0,
    weights: TermWeights = TermWeights(),
) -> Tensor | float:
    """Composer loss KL(sg[S] ‖ T) + β (m − Δ) + λ · anchor (+ w · contrastive), β a constant.

    The one place this objective is written: the composer pass backpropagates it per micro-batch
    (`weights`: each term's share of the batch; `margin_m` None: β·m, a constant with no gradient,
    is left out) and the step reports it on the batch totals (Python floats). Each weight
    multiplies its coefficient before the term (`β·w·Δ`, `λ·w·anchor`), and the terms are added
    left to right: the order the numbers were always computed in. `contrastive` None: no term
    (0 pairs in the micro-batch).
    """
    obj = weights.kl * kl_sg_student
    if margin_m is None:
        obj = obj - float(beta) * weights.margin * delta
    else:
        obj = obj + float(beta) * weights.margin * (float(margin_m) - delta)
    obj = obj + float(anchor_lambda) * weights.anchor * anchor
    if contrastive is not None:
        obj = obj + float(contrastive_weight) * weights.contrastive * contrastive
    return obj


# ------------------------------------------------------------------------------------ GRPO


def group_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """(r − mean_g) / (std_g + eps) per group of rollouts of the same task.

    rewards (N,), group_ids (N,) any integers. std_g is the unbiased sample std (as TRL's
    GRPO); a group of one rollout, or of equal rewards, gets advantage exactly 0. Computed in
    float64 (a float32 group mean of equal rewards is off by an ulp, which eps would turn into a
    spurious advantage); returns (N,) float32, no gradient.
    """
    r = rewards.detach().double()
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.to(r.dtype)
    mean = torch.zeros_like(n).index_add_(0, inv, r) / n
    centred = r - mean[inv]
    sq = torch.zeros_like(n).index_add_(0, inv, centred * centred)
    std = torch.where(n > 1, (sq / (n - 1).clamp_min(1.0)).sqrt(), torch.zeros_like(n))
    spread = torch.zeros_like(n).index_reduce_(0, inv, r, "amax", include_self=False) - torch.zeros_like(n).index_reduce_(
        0, inv, r, "amin", include_self=False)
    adv = torch.where((spread > 0)[inv], centred / (std[inv] + eps), torch.zeros_like(centred))
    return adv.float()


def grpo_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
) -> GrpoLoss:
    """Clipped PPO/GRPO surrogate, sequence-mean normalised like the KL.

    new/old/ref log-probs (B, T) of the taken tokens; advantages (B,) (one per rollout) or
    (B, T). Per token: −min(ρ A, clip(ρ, 1−ε, 1+ε) A) with ρ = exp(new − old), plus
    kl_coef · k3 where k3 = exp(ref − new) − (ref − new) − 1 (≥ 0, unbiased KL(new‖ref)
    estimator). old, ref and advantages are treated as constants.
    """
    new = new_logprobs.float()
    old = old_logprobs.detach().float()
    adv = advantages.detach().float()
    if adv.dim() == new.dim() - 1:
        adv = adv.unsqueeze(-1)
    ratio = torch.exp(new - old)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl_tok = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        log_r = ref_logprobs.detach().float() - new
        kl_tok = torch.exp(log_r) - log_r - 1.0
        if kl_coef:
            per_token = per_token + kl_coef * kl_tok
    m = mask.bool()
    per_token = torch.where(m, per_token, torch.zeros_like(per_token))
    was_clipped = (clipped < unclipped).float()  # min picked the clipped branch
    return GrpoLoss(
        loss=sequence_mean(per_token, mask),
        per_token=per_token,
        clip_fraction=token_mean(was_clipped, mask).detach(),
        kl=sequence_mean(kl_tok.detach(), mask),
    )
