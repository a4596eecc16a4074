"""One LOPD (or OPSD) update on a batch of student rollouts: phases 2–4 of LOPD.md.

    2. teacher pass: the frozen backbone (adapters off) on the teacher prompt — LOPD: latents
       c_φ from the composer in the placeholder positions; OPSD: the retrieved trajectories as
       plain text — keeping the top-M ids per action token;
    3. student pass: reverse KL(p̃^S ‖ sg p̃^T) on those ids + tail, gradients into θ;
    4. composer pass (LOPD, composer not frozen): KL(sg p̃^S ‖ p̃^T) + β(m − Δ) + λ·anchor
       (+ w·contrastive hinge on the successful rollouts), gradients into φ; then the dual step on
       β (done by the caller, from the returned Δ, and only when Δ is defined).

Δ's form is `margin_advantage`: "centred" (default) = sequence mean of 2(r − r̄)·δ with r̄ the
mean reward of the whole step's batch (over ranks too), or of each task's rollouts when tasks
repeat; "paper" = token mean of (2r − 1)·δ (losses.centred_margin / privileged_margin). A
centred Δ of a batch whose rewards are all equal is 0 by construction and says nothing:
`margin_defined` is then False.

What it simplifies relative to the reference code: φ does not change between phases 2 and 4, so
one teacher forward *with* gradient serves both the student's targets (detached) and the
composer's loss; the composer's KL and Δ use the student's log-probs from the student pass (before
its update, detached), so the student's lm_head runs once per micro-batch.
Micro-batches accumulate gradients with weights that make the sums equal to the full-batch
losses (sequence means weight by sequences, the paper's Δ by tokens, the anchor by tasks, the
contrastive hinge by successful rollouts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from lopd_cli.agent.types import Episode
from lopd_cli.models.adapters import use_student
from lopd_cli.models.latent import build_teacher_batch, output_head, teacher_hidden
from lopd_cli.train import distributed as dist
from lopd_cli.train import losses
from lopd_cli.train.batch import BatchTotals, collate, student_hidden, to_student_layout


@dataclass
class DistillSetup:
    model: object
    tokenizer: object
    top_m: int
    margin_m: float
    anchor_lambda: float
    micro_batch: int
    logit_chunk: int
    composer: object | None = None  # LOPD: lopd_cli.models.composer.Composer; OPSD: None
    train_composer: bool = False
    latents0: Callable[[list[str], list[list]], torch.Tensor] | None = None  # anchor targets
    text_prompt: Callable[[Episode, list], list[int]] | None = None  # OPSD teacher prompt ids
    autocast: bool = False
    margin_advantage: str = "centred"  # "centred" | "paper"
    contrastive_weight: float = 0.0  # composer pass: weight of the own-vs-other-references hinge
    contrastive_margin: float = 0.1
    success_threshold: float = 1.0  # rollouts at or above it take part in the contrastive term


@dataclass
class DistillOutcome:
    kl: float = 0.0  # student-pass KL(p̃^S ‖ p̃^T), batch sequence-mean
    composer_kl: float = 0.0
    delta: float = 0.0
    anchor: float = 0.0
    composer_loss: float = 0.0
    contrastive: float = 0.0
    margin_defined: bool = True  # False: centred Δ on a batch with no reward spread (no dual step)
    n_tokens: int = 0
    seconds: dict = field(default_factory=dict)
    finite: bool = True


def _autocast(enabled: bool, device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def distill_update(setup: DistillSetup, episodes: Sequence[Episode], refs: Sequence[list], beta: float,
                   totals: BatchTotals | None = None) -> DistillOutcome:
    """Accumulate gradients of the student (θ) and, for LOPD, the composer (φ) over the batch.

    The caller zeroes gradients before and steps the optimisers after (so it can check them).
    `totals`: the counts of the whole step's batch when `episodes` is one rank's share of it
    (then the losses and gradients here are that rank's part of a sum over ranks)."""
    import time

    model, tok = setup.model, setup.tokenizer
    device = next(model.parameters()).device
    head = output_head(model)
    pad = tok.pad_token_id or 0
    full = collate(episodes, pad, "cpu")
    n_seq_total = max(1, totals.n_sequences if totals else full.n_sequences)
    n_tok_total = max(1, totals.n_tokens if totals else full.n_tokens)
    n_eps_total = max(1, totals.n_episodes if totals else len(episodes))
    out = DistillOutcome(n_tokens=full.n_tokens)
    t_teacher = t_student = t_composer = 0.0
    lopd = setup.composer is not None
    adv_full, out.margin_defined = _margin_advantages(setup, episodes, full)
    n_succ_total = _n_successes(setup, full) if lopd and setup.contrastive_weight > 0 else 0
    n_latents = setup.composer.latents_per_item * len(refs[0]) if lopd and refs and refs[0] else 0
    for lo in range(0, len(episodes), setup.micro_batch):
        eps = list(episodes[lo : lo + setup.micro_batch])
        mrefs = [list(r) for r in refs[lo : lo + setup.micro_batch]]
        sb = collate(eps, pad, device)
        if sb.n_tokens == 0:
            continue
        w_seq = sb.n_sequences / n_seq_total
        w_tok = sb.n_tokens / n_tok_total
        w_task = len(eps) / n_eps_total

        # Phase 2: teacher (gradient into φ only when the composer trains).
        t0 = time.perf_counter()
        grad_phi = lopd and setup.train_composer
        with torch.set_grad_enabled(grad_phi), _autocast(setup.autocast, device):
            if lopd:
                instrs = [ep.task.instruction for ep in eps]
                latents = setup.composer(mrefs, instrs)
                tb = build_teacher_batch(eps, tok, n_latents).to(device)
                th = teacher_hidden(model, tb, latents)
            else:
                latents = None
                tb = build_teacher_batch(eps, tok, 0, prompt_fn=lambda b, ep: setup.text_prompt(ep, mrefs[b])).to(device)
                th = teacher_hidden(model, tb, th_empty_latents(len(eps), device, model))
            t_pred = to_student_layout(th, tb, tuple(sb.mask.shape))
        t_lp, t_ids = losses.chunked_teacher_topm(t_pred.detach(), head, setup.top_m, mask=sb.mask, chunk_size=setup.logit_chunk)
        t_teacher += time.perf_counter() - t0

        # Phase 3: student, reverse KL against the detached teacher.
        t0 = time.perf_counter()
        # One lm_head pass gives the student's top-M+tail log-probs for the KL and, for LOPD, the
        # taken tokens' log-probs; both serve phase 4 detached (no second student head pass).
        with use_student(model), _autocast(setup.autocast, device):
            s_pred = student_hidden(model, sb)
            s_topm_g, s_tok_g = losses.chunked_logprobs(
                s_pred, head, topm_ids=t_ids, token_ids=sb.targets if lopd else None, mask=sb.mask,
                chunk_size=setup.logit_chunk,
            )
            kl = losses.topm_reverse_kl(s_topm_g, t_lp, sb.mask)
        (kl.loss * w_seq).backward()
        out.kl += float(kl.loss.detach()) * w_seq
        t_student += time.perf_counter() - t0

        # Phase 4: composer, through the same teacher graph.
        if lopd:
            t0 = time.perf_counter()
            s_topm, s_tok = s_topm_g.detach(), s_tok_g.detach()
            with torch.set_grad_enabled(grad_phi):
                t_topm, t_tok = losses.chunked_logprobs(
                    t_pred, head, topm_ids=t_ids, token_ids=sb.targets, mask=sb.mask, chunk_size=setup.logit_chunk
                )
                ckl = losses.topm_reverse_kl(s_topm, t_topm, sb.mask, detach="student")
                if setup.margin_advantage == "paper":
                    delta, w_delta = losses.privileged_margin(t_tok, s_tok, sb.rewards, sb.mask), w_tok
                else:
                    adv = adv_full[lo : lo + setup.micro_batch].to(t_tok.device)
                    delta, w_delta = losses.centred_margin(t_tok, s_tok, adv, sb.mask), w_seq
                anchor = (
                    losses.anchor_loss(latents, setup.latents0(instrs, mrefs).to(latents.device))
                    if setup.latents0 is not None and setup.anchor_lambda > 0
                    else latents.new_zeros(())
                )
                # = w·(KL + β(m − Δ) + λ·anchor) with each term weighted by what it averages over
                # (β·m is a constant: it has no gradient and is left out).
                obj = w_seq * ckl.loss - beta * w_delta * delta + setup.anchor_lambda * w_task * anchor
                if n_succ_total and grad_phi:
                    hinge, n_pairs = _contrastive(setup, model, head, eps, tb, sb, latents, t_tok)
                    if n_pairs:
                        w_c = n_pairs / n_succ_total
                        obj = obj + setup.contrastive_weight * w_c * hinge
                        out.contrastive += float(hinge.detach()) * w_c
            if grad_phi:
                obj.backward()
            out.composer_kl += float(ckl.loss.detach()) * w_seq
            out.delta += float(delta.detach()) * w_delta
            out.anchor += float(anchor.detach()) * w_task
            t_composer += time.perf_counter() - t0
        del th, t_pred
    if lopd:
        out.composer_loss = (out.composer_kl + beta * (setup.margin_m - out.delta) + setup.anchor_lambda * out.anchor
                             + setup.contrastive_weight * out.contrastive)
    out.seconds = {"teacher": t_teacher, "student": t_student, "composer": t_composer}
    out.finite = all(map(_finite, (out.kl, out.composer_kl, out.delta, out.anchor)))
    return out


def _margin_advantages(setup: DistillSetup, episodes: Sequence[Episode], full) -> tuple[torch.Tensor | None, bool]:
    """Centred advantages of the whole batch (r̄ over every rank's sequences, or per task when
    tasks repeat) and whether Δ is defined (the rewards differ). Paper form: (None, True)."""
    if setup.composer is None or setup.margin_advantage == "paper":
        return None, True
    valid = full.mask.sum(1) > 0
    r = full.rewards.double()
    rv = r[valid]
    red = dist.all_reduce_sum({"sum": float(rv.sum()), "n": int(valid.sum())})
    ext = dist.all_reduce_max({"max": float(rv.max()) if rv.numel() else -1e30,
                               "negmin": -float(rv.min()) if rv.numel() else -1e30})
    defined = red["n"] > 1 and ext["max"] > -ext["negmin"]
    ids = [ep.task.id for ep in episodes]
    groups = torch.tensor([ids.index(i) for i in ids])
    adv = losses.centred_advantages(full.rewards, groups, valid, mean=red["sum"] / max(red["n"], 1))
    if torch.unique(groups[valid]).numel() < int(valid.sum()):  # per-task groups: defined where a group varies
        defined = bool((adv != 0).any())
    return adv, bool(defined)


def _successes(setup: DistillSetup, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (rewards >= setup.success_threshold) & (mask.sum(1) > 0)


def _n_successes(setup: DistillSetup, full) -> int:
    n = int(_successes(setup, full.rewards, full.mask).sum())
    return int(dist.all_reduce_sum({"n": n})["n"])


def _contrastive(setup: DistillSetup, model, head, eps, tb, sb, latents, t_tok) -> tuple[torch.Tensor, int]:
    """The composer pass's contrastive hinge on this micro-batch's successful rollouts: the
    teacher's NLL of each one with its own task's latents against the NLL with another task's
    (the micro-batch's latents rolled by one). Returns (mean hinge over the pairs, pairs)."""
    from lopd_cli.train.coldstart import other_task_order

    perm, ok = other_task_order([ep.task.id for ep in eps])
    succ = _successes(setup, sb.rewards, sb.mask).tolist()
    keep = [i for i in range(len(eps)) if ok[i] and succ[i]]
    if not keep:
        return latents.sum() * 0.0, 0
    with _autocast(setup.autocast, latents.device):
        th_o = teacher_hidden(model, tb, latents[torch.tensor(perm, device=latents.device)])
        pred_o = to_student_layout(th_o, tb, tuple(sb.mask.shape))
    other = losses.chunked_token_logprobs(pred_o, head, sb.targets, mask=sb.mask, chunk_size=setup.logit_chunk)
    idx = torch.tensor(keep, device=latents.device)
    nll_own = losses.per_sequence_mean(-t_tok, sb.mask)[idx]
    nll_other = losses.per_sequence_mean(-other, sb.mask)[idx]
    return losses.contrastive_hinge(nll_own, nll_other, setup.contrastive_margin), len(keep)


def th_empty_latents(batch: int, device, model) -> torch.Tensor:
    """OPSD's teacher has no latent positions: an empty (B, 0, d) latent tensor."""
    d = model.get_input_embeddings().weight.shape[1]
    return torch.zeros((batch, 0, d), device=device)


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
