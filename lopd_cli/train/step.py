"""The LOPD (and OPSD) step, in the four phases of docs/algorithm.md, "The step".

    1. `rollout_phase`: the student (adapters on, no latents) plays this rank's share of the
       step's tasks (the loop runs it; GRPO's step starts with it too);
    2. `teacher_phase`: the teacher (`train.teacher`; by default the frozen backbone, adapters
       off, or a full student's frozen copy of it) on the teacher prompt — LOPD: latents c_φ
       from the composer in the placeholder positions; OPSD: the retrieved trajectories as
       plain text (`retrieve_refs`, `opsd_prompt_fn`) — keeping the top-M ids per action token;
    3. `student_phase`: reverse KL(p̃^S ‖ sg p̃^T) on those ids + tail, gradients into θ;
    4. `composer_phase` (LOPD, composer not frozen): `losses.composer_objective`, i.e.
       KL(sg p̃^S ‖ p̃^T) + β(m − Δ) + λ·anchor (+ w·contrastive hinge on the successful
       rollouts), gradients into φ (only: `composer_leaves`); then, after the optimiser steps,
       `dual_step` on β (only when Δ is defined).

`lopd_step` runs phases 2–4 on a batch of rollouts; `trainer_step` is what `train.loop.update`
calls (retrieval, the set-up from the recipe, the sum over ranks).

Δ's form is `margin_advantage`: "centred" (default) = sequence mean of 2(r − r̄)·δ with r̄ the
mean reward of the whole step's batch (over ranks too), or of each task's rollouts when tasks
repeat; "paper" = token mean of (2r − 1)·δ (losses.centred_margin / privileged_margin). A
centred Δ of a batch whose rewards are all equal is 0 by construction and says nothing:
`margin_defined` is then False.

What it simplifies relative to the reference code: φ does not change between phases 2 and 4, so
on the composer's rows one teacher forward *with* gradient serves both the student's targets
(detached) and the composer's loss. Phase order on those rows (issue 20): encoder + teacher with
grad, the student's log-probs without grad, the composer's backward (its graph freed), then the
student's forward and backward — no graph outlives its phase, at the price of one no-grad
student forward. `composer_rows` limits the composer pass to a share of the rows (the rest take a
no-grad teacher); each distinct (task, item) pair is encoded once (`encode_latents`).
Micro-batches accumulate gradients with weights that make the sums equal to the full-batch
losses (sequence means weight by sequences, the paper's Δ by tokens, the anchor by tasks, the
contrastive hinge by successful rollouts).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from lopd_cli.agent.types import Episode
from lopd_cli.compose.latent import build_teacher_batch, output_head, teacher_hidden
from lopd_cli.models.adapters import use_encoder, use_student
from lopd_cli.train import distributed as dist
from lopd_cli.train import lockstep, losses, sharding
from lopd_cli.train.batch import BatchTotals, StudentBatch, collate, filler_batch, student_hidden, to_student_layout

if TYPE_CHECKING:
    from lopd_cli.compose.latent import TeacherBatch
    from lopd_cli.train.trainer import Trainer


@dataclass
class StepSetup:
    model: object
    tokenizer: object
    top_m: int
    margin_m: float
    anchor_lambda: float
    micro_batch: int
    logit_chunk: int
    composer: object | None = None  # LOPD: lopd_cli.compose.composer.Composer; OPSD: None
    train_composer: bool = False
    latents0: Callable[[list[str], list[list]], torch.Tensor] | None = None  # anchor targets
    text_prompt: Callable[[Episode, list], list[int]] | None = None  # OPSD teacher prompt ids
    autocast: bool = False
    margin_advantage: str = "centred"  # "centred" | "paper"
    contrastive_weight: float = 0.0  # composer pass: weight of the own-vs-other-references hinge
    contrastive_margin: float = 0.1
    success_threshold: float = 1.0  # rollouts at or above it take part in the contrastive term
    # The composer pass's rows (None: all of them) and their counts over the whole step's batch
    # (None: counted here, which is right in one process); see lopd_step.
    composer_rows: Sequence[bool] | None = None
    composer_totals: BatchTotals | None = None
    # No-grad latents kept while φ does not change (the trainer clears it when φ steps); None:
    # a fresh one per call, so each distinct (task, item) is still encoded once per step.
    nograd_latents: "NoGradLatents | None" = None
    # Scale each token's student KL by how much the task's own references change the teacher
    # there, against another task's (losses.privilege_weights): distil where the teacher is
    # privileged, not wherever the reference frame merely shifts it. One more no-grad teacher pass.
    privilege_gate: bool = False
    composer_micro_batch: int | None = None  # composer-pass rows per chunk, at most micro_batch (None: micro_batch)
    # Whose weights the teacher pass runs (`train.teacher`): `teacher_model`, when set, is a module
    # of its own (a full student's frozen copy: its own LM head too); `teacher_live` reads `model`
    # through the student's view (its current weights) instead of with the adapters off.
    teacher_model: object | None = None
    teacher_live: bool = False
    teacher_adapter: str | None = None  # a LoRA student's EMA teacher: the adapter the teacher pass runs under
    # When set, the composer pass's backward reaches only these parameters (φ): a live teacher, or
    # a full student's encoder pass over its own base, puts the student's weights in that graph,
    # and the composer objective must not train them.
    composer_leaves: Callable[[], list] | None = None


@dataclass
class StepOutcome:
    kl: float = 0.0  # student-pass KL(p̃^S ‖ p̃^T), batch sequence-mean
    composer_kl: float = 0.0
    delta: float = 0.0
    anchor: float = 0.0
    composer_loss: float = 0.0
    contrastive: float = 0.0
    gate: float | None = None  # token mean of the privilege weights (privilege_gate only)
    margin_defined: bool = True  # False: centred Δ on a batch with no reward spread (no dual step)
    n_tokens: int = 0
    seconds: dict = field(default_factory=dict)
    finite: bool = True


# ----------------------------------------------------------------------- what the phases share


@dataclass
class StepBatch:
    """The step's batch as every phase sees it: the rows, what micro-batch weights divide by
    (counts over the whole step's batch, every rank's share included) and what is fixed for the step."""

    episodes: Sequence[Episode]
    refs: Sequence[list]
    full: StudentBatch  # the whole (rank's) batch, on the CPU
    pad: int
    device: torch.device
    head: object  # the student's output head (and the teacher's when the teacher is a view of the model)
    teacher: object  # the module the teacher pass runs: `setup.teacher_model` or the model itself
    teacher_head: object
    teacher_view: Callable | None  # the view of `teacher` it runs under (None: adapters off)
    lopd: bool  # latents from the composer (False: OPSD, references as text)
    n_seq_total: int
    n_tok_total: int
    c_seq_total: int  # the composer rows' counts
    c_tok_total: int
    c_eps_total: int
    advantages: torch.Tensor | None  # centred A(τ) of every row (None: the paper's Δ, or OPSD)
    margin_defined: bool  # False: centred Δ on a batch with no reward spread
    plain_rows: list[int]  # no-grad teacher, then the student
    composer_rows: list[int]  # teacher with grad, the composer pass, then the student
    n_successes: int  # the contrastive term's successful composer rows, over ranks (0: term off)
    n_latents: int
    controls: list[list | None] | None  # the privilege gate's control references (None: gate off)
    nograd: "NoGradLatents"


@dataclass
class MicroBatch:
    rows: list[int]  # indices into the step's batch
    episodes: list[Episode]
    refs: list[list]
    sb: StudentBatch
    w_seq: float  # its share of the step's sequences
    real: bool = True  # False: a filler pass of the uniform schedule (train/lockstep.py), weighing 0


@dataclass
class TeacherOutputs:
    topm_logprobs: torch.Tensor  # (B, T, M+1), no grad: the student's targets
    topm_ids: torch.Tensor  # (B, T, M)
    gate: torch.Tensor | None  # privilege weights (B, T) (privilege_gate only)
    token_logprobs: torch.Tensor | None = None  # no-grad rows, LOPD: log π^T of the taken actions (for Δ)
    hidden: torch.Tensor | None = None  # composer rows: the teacher's hidden states, with graph into φ
    latents: torch.Tensor | None = None  # composer rows: c_φ, with graph
    teacher_batch: "TeacherBatch | None" = None


@dataclass
class Tally:
    """What the phases add up over the micro-batches."""

    out: StepOutcome
    kl_plain: float = 0.0  # the student KL of the no-grad rows
    gate_sum: float = 0.0
    gate_n: int = 0
    seconds: dict = field(default_factory=lambda: {"teacher": 0.0, "student": 0.0, "composer": 0.0, "encode": 0.0})


# ----------------------------------------------------------------------------- the step


def lopd_step(setup: StepSetup, episodes: Sequence[Episode], refs: Sequence[list], beta: float,
              totals: BatchTotals | None = None) -> StepOutcome:
    """Phases 2–4 on a batch of rollouts: accumulate gradients of the student (θ) and, for LOPD,
    the composer (φ).

    The caller zeroes gradients before and steps the optimisers after (so it can check them),
    then takes the dual step on β (`dual_step`). `totals`: the counts of the whole step's batch
    when `episodes` is one rank's share of it (then the losses and gradients here are that
    rank's part of a sum over ranks).

    Rows: `setup.composer_rows` (None: every row when the composer trains) picks the sequences
    of the composer pass; `setup.composer_totals` counts them over the whole step's batch. The
    other rows take a teacher pass without gradient (latents encoded once per distinct
    (task, item) pair, no graph kept) and the student pass. Composer rows, per micro-batch:
    encoder + teacher with gradient → the student's log-probs without gradient → the composer's
    backward (its graph is freed) → the student's forward and backward. No graph outlives its
    phase: the price is one no-grad student forward on the composer rows. Δ for the dual step
    is measured on every row (the teacher's token log-probs of the others come without grad)."""
    batch = prepare_batch(setup, episodes, refs, totals)
    tally = Tally(StepOutcome(n_tokens=batch.full.n_tokens, margin_defined=batch.margin_defined))
    for mb in micro_batches(batch, batch.plain_rows, setup.micro_batch):
        teacher = teacher_phase(setup, batch, mb, tally, grad=False)
        t0 = time.perf_counter()
        kl, s_tok = student_phase(setup, batch, mb, teacher)
        tally.out.kl += kl * mb.w_seq
        tally.kl_plain += kl * mb.w_seq
        if batch.lopd and mb.real:
            tally.out.delta += float(margin_of(setup, batch, mb, teacher.token_logprobs, s_tok)) * delta_share(
                setup, mb.sb, batch.n_seq_total, batch.n_tok_total)
        tally.seconds["student"] += time.perf_counter() - t0
    composer_chunk = min(setup.composer_micro_batch or setup.micro_batch, setup.micro_batch)
    for mb in micro_batches(batch, batch.composer_rows, composer_chunk):
        teacher = teacher_phase(setup, batch, mb, tally, grad=True)
        composer_phase(setup, batch, mb, teacher, beta, tally)
        t0 = time.perf_counter()
        kl, _ = student_phase(setup, batch, mb, teacher)
        tally.out.kl += kl * mb.w_seq
        tally.seconds["student"] += time.perf_counter() - t0
    return finish(setup, batch, beta, tally)


def prepare_batch(setup: StepSetup, episodes: Sequence[Episode], refs: Sequence[list],
                  totals: BatchTotals | None) -> StepBatch:
    """Split the rows between the composer pass and the plain one and count what each term's
    micro-batch weights divide by; the centred advantages and the contrastive term's successes
    are reduced over ranks here (every rank calls the reductions, rows or not)."""
    from lopd_cli.train.batch import batch_totals

    model = setup.model
    tmodel = setup.teacher_model if setup.teacher_model is not None else model
    lopd = setup.composer is not None
    grad_phi = lopd and setup.train_composer
    pad = setup.tokenizer.pad_token_id or 0
    full = collate(episodes, pad, "cpu")
    rows_c = list(setup.composer_rows) if setup.composer_rows is not None else [grad_phi] * len(episodes)
    if not grad_phi:
        rows_c = [False] * len(episodes)
    ctot = setup.composer_totals if setup.composer_totals is not None else (
        totals if setup.composer_rows is None else None)
    if ctot is None:
        ctot = batch_totals([ep for ep, c in zip(episodes, rows_c) if c])
    advantages, defined = _margin_advantages(setup, episodes, full)
    idx_c = [i for i, c in enumerate(rows_c) if c]
    n_succ_total = 0
    if grad_phi and setup.contrastive_weight > 0:
        sc = _successes(setup, full.rewards[idx_c], full.mask[idx_c]) if idx_c else torch.zeros(0)
        n_succ_total = int(dist.all_reduce_sum({"n": int(sc.sum())})["n"])
    return StepBatch(
        episodes=episodes, refs=refs, full=full, pad=pad, device=next(model.parameters()).device,
        head=output_head(model), teacher=tmodel, teacher_head=output_head(tmodel),
        teacher_view=_teacher_view(setup), lopd=lopd,
        n_seq_total=max(1, totals.n_sequences if totals else full.n_sequences),
        n_tok_total=max(1, totals.n_tokens if totals else full.n_tokens),
        c_seq_total=max(1, ctot.n_sequences if ctot else full.n_sequences),
        c_tok_total=max(1, ctot.n_tokens if ctot else full.n_tokens),
        c_eps_total=max(1, ctot.n_episodes if ctot else len(episodes)),
        advantages=advantages, margin_defined=defined,
        plain_rows=[i for i, c in enumerate(rows_c) if not c], composer_rows=idx_c,
        n_successes=n_succ_total,
        n_latents=setup.composer.latents_per_item * len(refs[0]) if lopd and refs and refs[0] else 0,
        controls=control_references(episodes, refs) if setup.privilege_gate else None,
        nograd=setup.nograd_latents if setup.nograd_latents is not None else NoGradLatents(),
    )


def _teacher_view(setup: StepSetup) -> Callable | None:
    return teacher_view_for(setup.teacher_live, setup.teacher_adapter)


def teacher_view_for(live: bool, adapter: str | None) -> Callable | None:
    """The view of the model a teacher pass runs under: the student's (`train.teacher: live`),
    an adapter of its own (a LoRA student's EMA teacher), or None: adapters off."""
    if live:
        return use_student
    if adapter is not None:
        return lambda m: use_encoder(m, adapter)
    return None


def micro_batches(batch: StepBatch, rows: list[int], size: int) -> list[MicroBatch]:
    """`rows` in chunks of `size`, collated on the model's device; chunks with no supervised token
    are left out. Under the uniform schedule, filler chunks (weighing 0) follow up to the largest
    count over ranks."""
    out = []
    for lo in range(0, len(rows), size):
        chunk = rows[lo : lo + size]
        eps = [batch.episodes[i] for i in chunk]
        sb = collate(eps, batch.pad, batch.device)
        if sb.n_tokens == 0:
            continue
        out.append(MicroBatch(chunk, eps, [list(batch.refs[i]) for i in chunk], sb, sb.n_sequences / batch.n_seq_total))
    return [mb if real else replace(mb, w_seq=0.0, real=False)
            for mb, real in lockstep.padded(out, lambda: filler_micro_batch(batch, rows))]


def filler_micro_batch(batch: StepBatch, rows: list[int]) -> MicroBatch:
    """A one-row pass of the same kind for a rank with no chunk of its own (at least one supervised
    token, so that its zero-weighted losses stay finite)."""
    i = rows[0] if rows else 0
    sb = filler_batch([batch.episodes[i]], batch.pad, batch.device)
    return MicroBatch([i], [batch.episodes[i]], [list(batch.refs[i])], sb, 0.0, real=False)


# ------------------------------------------------------------------------------- phase 1


def rollout_phase(tr: Trainer, tasks: list, step: int, progress: Callable[[int], None] | None = None,
                  index_offset: int = 0) -> list[Episode]:
    """Phase 1: the student (backbone + student adapter, no latents) plays `tasks` (this rank's
    share of the step's), each token's sampling log-prob recorded. GRPO's step starts with it too."""
    from lopd_cli.agent.runner import run_episodes
    from lopd_cli.models import adapters as ad

    tr.model.eval()
    with torch.no_grad(), ad.use_student(tr.model):
        return run_episodes(
            tr.model, tr.tokenizer, tr.env_factory, tasks, tr.recipe.rollout,
            seed=tr.recipe.train.seed * 1_000_003 + step, reward_fn=tr.reward_fn, progress=progress,
            meta={"generated_by": "lopd", "phase": "train", "algo": tr.algo, "step": step},
            index_offset=index_offset,
        )


# ------------------------------------------------------------------------------- phase 2


def teacher_phase(setup: StepSetup, batch: StepBatch, mb: MicroBatch, tally: Tally, grad: bool) -> TeacherOutputs:
    """Phase 2 on a micro-batch: the teacher's top-M ids and log-probs per action token (the
    student's targets) and, with the gate on, the privilege weights. `grad` (composer rows):
    the teacher's hidden states and latents keep their graph for the composer phase; otherwise
    (LOPD) the taken actions' log-probs come along for Δ, without gradient."""
    t0 = time.perf_counter()
    pred, latents, tb = teacher_forward(setup, batch, mb.episodes, mb.refs, tally, grad)
    if grad:
        t_lp, t_ids = losses.chunked_teacher_topm(pred.detach(), batch.teacher_head, setup.top_m, mask=mb.sb.mask,
                                                  chunk_size=setup.logit_chunk)
        out = TeacherOutputs(t_lp, t_ids, None, hidden=pred, latents=latents, teacher_batch=tb)
    else:
        t_lp, t_ids = losses.chunked_teacher_topm(pred, batch.teacher_head, setup.top_m, mask=mb.sb.mask,
                                                  chunk_size=setup.logit_chunk)
        out = TeacherOutputs(t_lp, t_ids, None)
        if batch.lopd:
            with torch.no_grad():
                out.token_logprobs = losses.chunked_token_logprobs(pred, batch.teacher_head, mb.sb.targets,
                                                                   mask=mb.sb.mask, chunk_size=setup.logit_chunk)
        del pred, latents, tb
    out.gate = privilege_gate(setup, batch, mb, t_lp, t_ids, tally)
    tally.seconds["teacher"] += time.perf_counter() - t0
    return out


def teacher_forward(setup: StepSetup, batch: StepBatch, eps: list[Episode], mrefs: list[list], tally: Tally,
                    grad: bool) -> tuple[torch.Tensor, torch.Tensor | None, TeacherBatch]:
    """The teacher's hidden states in the student layout, the latents (LOPD; None for OPSD) and
    the teacher batch. No-grad latents come from the cache of (task, item) pairs."""
    model, device = setup.model, batch.device
    with torch.set_grad_enabled(grad), _autocast(setup.autocast, device):
        if batch.lopd:
            t0 = time.perf_counter()
            latents = encode_latents(setup.composer, mrefs, [ep.task.instruction for ep in eps],
                                     None if grad else batch.nograd)
            tally.seconds["encode"] += time.perf_counter() - t0
            tb = build_teacher_batch(eps, setup.tokenizer, batch.n_latents).to(device)
            th = teacher_hidden(batch.teacher, tb, latents.to(device), view=batch.teacher_view)
        else:
            latents = None
            tb = build_teacher_batch(eps, setup.tokenizer, 0,
                                     prompt_fn=lambda b, ep: setup.text_prompt(ep, mrefs[b])).to(device)
            th = teacher_hidden(batch.teacher, tb, th_empty_latents(len(eps), device, model), view=batch.teacher_view)
        return to_student_layout(th, tb, tuple(collate_shape(eps))), latents, tb


def privilege_gate(setup: StepSetup, batch: StepBatch, mb: MicroBatch, t_lp: torch.Tensor, t_ids: torch.Tensor,
                   tally: Tally) -> torch.Tensor | None:
    """Privilege weights (B, T) of a micro-batch (`losses.privilege_weights` against the teacher
    with the control references), or None (gate off). Rows without a control are ungated."""
    controls = batch.controls
    if controls is None:
        return None
    have = [controls[i] is not None for i in mb.rows]
    crefs = [controls[i] if controls[i] is not None else list(batch.refs[i]) for i in mb.rows]
    with torch.no_grad():
        c_pred, _, _ = teacher_forward(setup, batch, mb.episodes, crefs, tally, grad=False)
        c_lp, _ = losses.chunked_logprobs(c_pred, batch.teacher_head, topm_ids=t_ids, mask=mb.sb.mask,
                                          chunk_size=setup.logit_chunk)
        w = losses.privilege_weights(t_lp, c_lp)
        w[~torch.tensor(have, device=w.device)] = 1.0  # no control in the batch: ungated
        m = mb.sb.mask.bool()
        if mb.real:
            tally.gate_sum += float(w[m].sum())
            tally.gate_n += int(m.sum())
    return w


# ------------------------------------------------------------------------------- phase 3


def student_phase(setup: StepSetup, batch: StepBatch, mb: MicroBatch,
                  teacher: TeacherOutputs) -> tuple[float, torch.Tensor | None]:
    """Phase 3 on a micro-batch: reverse KL(p̃^S ‖ sg p̃^T) on the teacher's ids + tail (scaled by
    the privilege gate), backward into θ weighted by the micro-batch's share of the sequences.
    Returns the KL and (LOPD) the student's log-probs of the taken actions, detached."""
    model = setup.model
    sb = mb.sb
    with use_student(model), _autocast(setup.autocast, batch.device):
        s_pred = student_hidden(model, sb)
        s_topm_g, s_tok_g = losses.chunked_logprobs(
            s_pred, batch.head, topm_ids=teacher.topm_ids, token_ids=sb.targets if batch.lopd else None,
            mask=sb.mask, chunk_size=setup.logit_chunk,
        )
        kl = losses.topm_reverse_kl(s_topm_g, teacher.topm_logprobs, sb.mask, weight=teacher.gate)
    (kl.loss * mb.w_seq).backward()
    return float(kl.loss.detach()), s_tok_g.detach() if s_tok_g is not None else None


# ------------------------------------------------------------------------------- phase 4


def composer_phase(setup: StepSetup, batch: StepBatch, mb: MicroBatch, teacher: TeacherOutputs, beta: float,
                   tally: Tally) -> None:
    """Phase 4 on a micro-batch of composer rows: `losses.composer_objective` (KL(sg S ‖ T),
    β(m − Δ) without its constant β·m, λ·anchor, the contrastive hinge), each term weighted by
    its share of what it averages over, backward through the teacher and the encoder into φ.
    The teacher's graph is released here, before the student pass."""
    model, sb = setup.model, mb.sb
    t0 = time.perf_counter()
    instrs = [ep.task.instruction for ep in mb.episodes]
    with torch.no_grad(), use_student(model), _autocast(setup.autocast, batch.device):
        s_topm, s_tok = losses.chunked_logprobs(student_hidden(model, sb), batch.head, topm_ids=teacher.topm_ids,
                                                token_ids=sb.targets, mask=sb.mask, chunk_size=setup.logit_chunk)
    t_topm, t_tok = losses.chunked_logprobs(teacher.hidden, batch.teacher_head, topm_ids=teacher.topm_ids,
                                            token_ids=sb.targets, mask=sb.mask, chunk_size=setup.logit_chunk)
    ckl = losses.topm_reverse_kl(s_topm, t_topm, sb.mask, detach="student")
    delta = margin_of(setup, batch, mb, t_tok, s_tok)
    latents = teacher.latents
    anchor = (
        losses.anchor_loss(latents, setup.latents0(instrs, mb.refs).to(latents.device))
        if setup.latents0 is not None and setup.anchor_lambda > 0
        else latents.new_zeros(())
    )
    hinge, w_pairs = None, 1.0
    if batch.n_successes:
        h, n_pairs = contrastive_term(setup, batch, mb, teacher, t_tok)
        if n_pairs or lockstep.active():  # the schedule keeps the pass in the graph, weighing 0
            hinge, w_pairs = h, n_pairs / batch.n_successes
    wc_seq, wc_tok = sb.n_sequences / batch.c_seq_total, sb.n_tokens / batch.c_tok_total
    wc_task = len(mb.episodes) / batch.c_eps_total
    if not mb.real:  # a filler pass: every term weighs 0
        wc_seq = wc_tok = wc_task = w_pairs = 0.0
    weights = losses.TermWeights(kl=wc_seq, margin=wc_tok if setup.margin_advantage == "paper" else wc_seq,
                                 anchor=wc_task, contrastive=w_pairs)
    obj = losses.composer_objective(ckl.loss, beta, None, delta, anchor, setup.anchor_lambda,
                                    hinge, setup.contrastive_weight, weights)
    if setup.composer_leaves is not None:
        obj.backward(inputs=setup.composer_leaves())
    else:
        obj.backward()
    teacher.hidden = teacher.latents = None  # the graph is spent: nothing of it outlives this phase
    del latents, obj, t_topm, t_tok
    out = tally.out
    if not mb.real:
        tally.seconds["composer"] += time.perf_counter() - t0
        return
    if hinge is not None:
        out.contrastive += float(hinge.detach()) * w_pairs
    out.composer_kl += float(ckl.loss.detach()) * wc_seq
    out.delta += float(delta.detach()) * delta_share(setup, sb, batch.n_seq_total, batch.n_tok_total)
    out.anchor += float(anchor.detach()) * wc_task
    tally.seconds["composer"] += time.perf_counter() - t0


def contrastive_term(setup: StepSetup, batch: StepBatch, mb: MicroBatch, teacher: TeacherOutputs,
                     t_tok: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The composer pass's contrastive hinge on this micro-batch's successful rollouts: the
    teacher's NLL of each one with its own task's latents against the NLL with another task's
    (the micro-batch's latents rolled by one). Returns (mean hinge over the pairs, pairs)."""
    from lopd_cli.train.coldstart import other_task_order

    latents, tb, sb = teacher.latents, teacher.teacher_batch, mb.sb
    perm, ok = other_task_order([ep.task.id for ep in mb.episodes])
    succ = _successes(setup, sb.rewards, sb.mask).tolist()
    keep = [i for i in range(len(mb.episodes)) if ok[i] and succ[i]]
    if not keep and not lockstep.active():
        return latents.sum() * 0.0, 0
    # the uniform schedule runs the other-latents pass on every micro-batch; without a pair it weighs 0
    n_keep, keep = len(keep), keep or [0]
    with _autocast(setup.autocast, latents.device):
        th_o = teacher_hidden(batch.teacher, tb, latents[torch.tensor(perm, device=latents.device)],
                              view=batch.teacher_view)
        pred_o = to_student_layout(th_o, tb, tuple(sb.mask.shape))
    other = losses.chunked_token_logprobs(pred_o, batch.teacher_head, sb.targets, mask=sb.mask, chunk_size=setup.logit_chunk)
    idx = torch.tensor(keep, device=latents.device)
    nll_own = losses.per_sequence_mean(-t_tok, sb.mask)[idx]
    nll_other = losses.per_sequence_mean(-other, sb.mask)[idx]
    hinge = losses.contrastive_hinge(nll_own, nll_other, setup.contrastive_margin)
    return (hinge if n_keep else hinge * 0.0), n_keep


def margin_of(setup: StepSetup, batch: StepBatch, mb: MicroBatch, t_tok: torch.Tensor,
              s_tok: torch.Tensor) -> torch.Tensor:
    """Δ of a micro-batch: the paper's token mean of (2r − 1)·δ, or the centred sequence mean."""
    if setup.margin_advantage == "paper":
        return losses.privileged_margin(t_tok, s_tok, mb.sb.rewards, mb.sb.mask)
    adv = batch.advantages[mb.rows].to(t_tok.device)
    return losses.centred_margin(t_tok, s_tok, adv, mb.sb.mask)


def delta_share(setup: StepSetup, sb: StudentBatch, seq_total: int, tok_total: int) -> float:
    """A micro-batch's weight in Δ: its tokens (the paper's token mean) or its sequences (centred)."""
    return sb.n_tokens / tok_total if setup.margin_advantage == "paper" else sb.n_sequences / seq_total


def finish(setup: StepSetup, batch: StepBatch, beta: float, tally: Tally) -> StepOutcome:
    """The step's outcome: the composer loss on the batch totals, the gate's mean, the timings."""
    out = tally.out
    if batch.lopd:
        if not batch.composer_rows:  # no composer pass this step: its KL is the student's (the same numbers)
            out.composer_kl = tally.kl_plain
        out.composer_loss = composer_loss(setup, out, beta)
    if batch.controls is not None:
        out.gate = tally.gate_sum / max(tally.gate_n, 1)
    sec = tally.seconds
    out.seconds = sec if batch.lopd else {k: v for k, v in sec.items() if k != "encode"}
    out.finite = all(map(_finite, (out.kl, out.composer_kl, out.delta, out.anchor)))
    return out


def composer_loss(setup: StepSetup, out: StepOutcome, beta: float) -> float:
    """`losses.composer_objective` on the step's totals (the number logged as composer_loss)."""
    return losses.composer_objective(out.composer_kl, beta, setup.margin_m, out.delta, out.anchor,
                                     setup.anchor_lambda, out.contrastive, setup.contrastive_weight)


def dual_step(beta: float, out: StepOutcome, margin_m: float, eta: float) -> float:
    """The end of phase 4, after φ's optimiser step: β ← max(0, β + η(m − Δ)); β unchanged when
    the centred Δ is undefined (all rewards equal)."""
    return losses.dual_update(beta, margin_m, out.delta, eta) if out.margin_defined else beta


# ----------------------------------------------------------------------------- the trainer's step


def trainer_step(tr: Trainer, episodes: list[Episode], totals: BatchTotals | None = None,
                 rows: list[bool] | None = None, composer_totals: BatchTotals | None = None) -> StepOutcome:
    """What `train.loop.update` runs for LOPD and OPSD: retrieve each rollout's references,
    `lopd_step` with the recipe's settings, and (distributed) sum the loss parts over ranks."""
    refs = retrieve_refs(tr, episodes) if tr.retriever is not None else [[] for _ in episodes]
    setup = step_setup(tr, rows, composer_totals)
    o = lopd_step(setup, episodes, refs, tr.state.beta, totals)
    if dist.is_distributed():
        red = dist.all_reduce_sum({"kl": o.kl, "composer_kl": o.composer_kl, "delta": o.delta,
                                   "anchor": o.anchor, "contrastive": o.contrastive, "n_tokens": o.n_tokens})
        o.kl, o.composer_kl, o.delta, o.anchor = red["kl"], red["composer_kl"], red["delta"], red["anchor"]
        o.contrastive, o.n_tokens = red["contrastive"], int(red["n_tokens"])
        o.composer_loss = composer_loss(setup, o, tr.state.beta)
        o.finite = all(map(math.isfinite, (o.kl, o.composer_kl, o.delta, o.anchor)))
    return o


def step_setup(tr: Trainer, rows: list[bool] | None = None, composer_totals: BatchTotals | None = None) -> StepSetup:
    """The step's settings from the trainer and its recipe."""
    t = tr.recipe.train
    return StepSetup(
        tr.model, tr.tokenizer, t.distill.top_m, t.lopd.margin_m, t.lopd.anchor_lambda, t.micro_batch, t.logit_chunk,
        composer=tr.composer, train_composer=tr.trains_composer, latents0=tr.latents0,
        text_prompt=opsd_prompt_fn(tr) if tr.algo == "opsd" else plain_prompt_fn(tr) if tr.algo == "distill" else None,
        autocast=tr.autocast, margin_advantage=t.lopd.margin_advantage,
        contrastive_weight=t.lopd.contrastive_weight, contrastive_margin=t.lopd.contrastive_margin,
        success_threshold=tr.recipe.eval.success_threshold,
        composer_rows=rows, composer_totals=composer_totals, nograd_latents=tr.nograd_latents,
        privilege_gate=t.distill.privilege_gate, composer_micro_batch=t.lopd.composer_micro_batch,
        teacher_model=tr.teacher, teacher_live=t.teacher == "live", composer_leaves=composer_leaves(tr),
        teacher_adapter=ema_adapter(tr),
    )


def ema_adapter(tr: Trainer) -> str | None:
    """The adapter a LoRA student's EMA teacher lives in (train/ema_teacher.py); None otherwise."""
    from lopd_cli.train.ema_teacher import TEACHER

    return TEACHER if tr.ema is not None and tr.teacher is None else None


def composer_leaves(tr: Trainer) -> Callable[[], list] | None:
    """φ's parameters, for a composer backward that must reach nothing else: when the student's
    weights are in the composer pass's graph (a live teacher; a full student, whose encoder ψ
    reads its own base). None where they are not (a LoRA student's frozen teacher)."""
    from lopd_cli.models import adapters as ad

    if not tr.trains_composer or (tr.recipe.model.student != "full" and tr.recipe.train.teacher != "live"):
        return None

    def leaves() -> list:
        psi = [p for p in ad.adapter_parameters(tr.model, ad.ENCODER) if p.requires_grad]
        return sharding.autograd_leaves(tr.sharding, psi) + [p for p in tr.composer.parameters() if p.requires_grad]

    return leaves


def step_metrics(o: StepOutcome, tr: Trainer) -> dict:
    """The step's loss metrics for the metrics row."""
    t = tr.recipe.train
    row: dict = {"loss": o.kl, "kl": o.kl}
    if o.gate is not None:
        row["gate"] = o.gate
    if tr.algo == "lopd":
        # margin_binds: the constraint Δ ≥ m is violated this step (β rises); None when the
        # centred Δ is undefined (all rewards equal: no dual step).
        row.update(delta=o.delta, anchor=o.anchor, composer_loss=o.composer_loss,
                   margin_defined=o.margin_defined, margin_binds=(o.delta < t.lopd.margin_m) if o.margin_defined else None)
        if t.lopd.contrastive_weight > 0:
            row["contrastive"] = o.contrastive
    return row


def retrieve_refs(tr: Trainer, episodes: list[Episode]) -> list[list]:
    """Each rollout's references: its task's `bank.n_retrieve` nearest bank items (without the
    task itself unless `bank.allow_self_retrieval`)."""
    b = tr.recipe.bank
    instrs = [ep.task.instruction for ep in episodes]
    if b.allow_self_retrieval:
        return tr.retriever.retrieve_many(instrs, b.n_retrieve)
    return tr.retriever.retrieve_many(
        instrs, b.n_retrieve,
        exclude_task_ids_per_query=[[ep.task.id] for ep in episodes],
        exclude_instructions_per_query=[[ep.task.instruction] for ep in episodes],
    )


def plain_prompt_fn(tr: Trainer) -> Callable[[Episode, list], list[int]]:
    """`distill`: the teacher sees the student's own prompt, no privileged context."""
    from lopd_cli.agent.chat import render_prompt_ids

    return lambda ep, items: render_prompt_ids(tr.tokenizer, ep.prompt_messages, ep.task.tools)


def opsd_prompt_fn(tr: Trainer) -> Callable[[Episode, list], list[int]]:
    """OPSD's privileged context: the retrieved trajectories as plain text in the first user turn."""
    from lopd_cli.compose.latent import text_teacher_prompt_ids
    from lopd_cli.train.teacher_nll import text_reference_chars

    budget = tr.recipe.bank.obs_char_budget
    max_chars = text_reference_chars(tr.recipe)

    def prompt(ep: Episode, items: list) -> list[int]:
        return text_teacher_prompt_ids(tr.tokenizer, ep.prompt_messages, ep.task.tools, items, budget, max_chars)

    return prompt


# ----------------------------------------------------------------------------- latents


def item_key(task_instruction: str, item) -> tuple[str, object]:
    """What the encoder's output for one retrieved item depends on: the task it is rendered for
    (the encoder reads "Task to solve: {task}" in front of it) and the item."""
    return task_instruction, item.id


def encode_latents(composer, refs: Sequence[Sequence], instrs: Sequence[str],
                   cache: "NoGradLatents | None" = None) -> torch.Tensor:
    """c_φ (B, n_ret·K, d), encoding each distinct (task, item) pair once: the same pair in two
    rows of the batch (a task rolled out more than once, overlapping retrievals) shares one
    encoder pass, and gradients reach φ through both uses. `cache` (no-grad only): latents of
    pairs already encoded by this composer since it last changed."""
    counts = {len(r) for r in refs}
    if len(counts) > 1 or 0 in counts:
        return composer(refs, instrs)  # the composer's own error message
    n = counts.pop()
    keys = [item_key(instr, it) for instr, r in zip(instrs, refs) for it in r]
    items = {item_key(instr, it): (instr, it) for instr, r in zip(instrs, refs) for it in r}
    todo = [k for k in items if cache is None or k not in cache]
    if todo or lockstep.active():  # the uniform schedule encodes (filler chunks) even with every pair cached
        toks = [composer.item_tokens(*items[k]) for k in todo]
        fresh = composer.encode_ids([t[0] for t in toks], [t[1] for t in toks])
    else:
        fresh = None
    pos = {k: i for i, k in enumerate(todo)}
    if cache is not None:
        have = {k: cache.get(k) for k in items if k not in pos}
        rows = torch.stack([fresh[pos[k]] if k in pos else have[k] for k in keys])
        for k, i in pos.items():
            cache.put(k, fresh[i])
    else:
        rows = fresh[torch.tensor([pos[k] for k in keys], device=fresh.device)]
    K, d = composer.latents_per_item, composer.dims.dim
    return rows.reshape(len(refs), n * K, d)


def control_references(episodes: Sequence[Episode], refs: Sequence[Sequence]) -> list[list | None]:
    """For each row, the references of the next row (cyclically) of another task whose retrieved
    items are not the same set: the privilege gate's control block. None where the batch has no
    such row (one task only): that row is then distilled ungated."""
    ids = [{getattr(it, "id", id(it)) for it in r} for r in refs]
    out: list[list | None] = []
    n = len(episodes)
    for i in range(n):
        j = next((j for j in ((i + k) % n for k in range(1, n))
                  if episodes[j].task.id != episodes[i].task.id and ids[j] != ids[i]), None)
        out.append(list(refs[j]) if j is not None else None)
    return out


class NoGradLatents:
    """No-grad latents per (task, item) pair, valid while the composer does not change: the
    trainer clears it whenever φ takes an optimiser step (and never with a frozen composer).
    Bounded: the oldest entries go first past `max_entries`."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self.entries: dict = {}
        self.hits = self.misses = 0

    def __contains__(self, key) -> bool:
        hit = key in self.entries
        self.hits += hit
        self.misses += not hit
        return hit

    def get(self, key) -> torch.Tensor:
        return self.entries[key]

    def put(self, key, latents: torch.Tensor) -> None:
        self.entries[key] = latents.detach()
        while len(self.entries) > self.max_entries:
            self.entries.pop(next(iter(self.entries)))

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)


# ----------------------------------------------------------------------------- helpers


def _autocast(enabled: bool, device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def collate_shape(eps: Sequence[Episode]) -> tuple[int, int]:
    """The (B, T) of `collate(eps)`'s prediction-layout mask."""
    return len(eps), max(len(ep.input_ids) for ep in eps) - 1


def _margin_advantages(setup: StepSetup, episodes: Sequence[Episode], full) -> tuple[torch.Tensor | None, bool]:
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


def _successes(setup: StepSetup, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (rewards >= setup.success_threshold) & (mask.sum(1) > 0)


def th_empty_latents(batch: int, device, model) -> torch.Tensor:
    """OPSD's teacher has no latent positions: an empty (B, 0, d) latent tensor."""
    d = model.get_input_embeddings().weight.shape[1]
    return torch.zeros((batch, 0, d), device=device)


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
