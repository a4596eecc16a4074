"""One LOPD (or OPSD) update on a batch of student rollouts: phases 2–4 of LOPD.md.

    2. teacher pass: the teacher (`train.teacher`; by default the frozen backbone, adapters off, or
       a full student's frozen copy of it) on the teacher prompt — LOPD: latents
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
    # The composer pass's rows (None: all of them) and their counts over the whole step's batch
    # (None: counted here, which is right in one process); see distill_update.
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
    # When set, the composer pass's backward reaches only these parameters (φ): a live teacher, or
    # a full student's encoder pass over its own base, puts the student's weights in that graph,
    # and the composer objective must not train them.
    composer_leaves: Callable[[], list] | None = None


@dataclass
class DistillOutcome:
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


def _autocast(enabled: bool, device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


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
    if todo:
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


def distill_update(setup: DistillSetup, episodes: Sequence[Episode], refs: Sequence[list], beta: float,
                   totals: BatchTotals | None = None) -> DistillOutcome:
    """Accumulate gradients of the student (θ) and, for LOPD, the composer (φ) over the batch.

    The caller zeroes gradients before and steps the optimisers after (so it can check them).
    `totals`: the counts of the whole step's batch when `episodes` is one rank's share of it
    (then the losses and gradients here are that rank's part of a sum over ranks).

    Rows: `setup.composer_rows` (None: every row when the composer trains) picks the sequences
    of the composer pass; `setup.composer_totals` counts them over the whole step's batch. The
    other rows take a teacher pass without gradient (latents encoded once per distinct
    (task, item) pair, no graph kept) and the student pass. Composer rows, per micro-batch:
    encoder + teacher with gradient → the student's log-probs without gradient → the composer's
    backward (its graph is freed) → the student's forward and backward. No graph outlives its
    phase: the price is one no-grad student forward on the composer rows. Δ for the dual step
    is measured on every row (the teacher's token log-probs of the others come without grad)."""
    import time

    model, tok = setup.model, setup.tokenizer
    device = next(model.parameters()).device
    head = output_head(model)
    tmodel = setup.teacher_model if setup.teacher_model is not None else model
    t_head = output_head(tmodel) if setup.teacher_model is not None else head
    t_view = use_student if setup.teacher_live else None
    pad = tok.pad_token_id or 0
    full = collate(episodes, pad, "cpu")
    n_seq_total = max(1, totals.n_sequences if totals else full.n_sequences)
    n_tok_total = max(1, totals.n_tokens if totals else full.n_tokens)
    out = DistillOutcome(n_tokens=full.n_tokens)
    sec = {"teacher": 0.0, "student": 0.0, "composer": 0.0, "encode": 0.0}
    lopd = setup.composer is not None
    grad_phi = lopd and setup.train_composer
    rows_c = list(setup.composer_rows) if setup.composer_rows is not None else [grad_phi] * len(episodes)
    if not grad_phi:
        rows_c = [False] * len(episodes)
    ctot = setup.composer_totals if setup.composer_totals is not None else (
        totals if setup.composer_rows is None else None)
    sub = [ep for ep, c in zip(episodes, rows_c) if c]
    if ctot is None:
        from lopd_cli.train.batch import batch_totals

        ctot = batch_totals(sub)
    c_seq_total = max(1, ctot.n_sequences if ctot else full.n_sequences)
    c_tok_total = max(1, ctot.n_tokens if ctot else full.n_tokens)
    c_eps_total = max(1, ctot.n_episodes if ctot else len(episodes))
    adv_full, out.margin_defined = _margin_advantages(setup, episodes, full)
    idx_c = [i for i, c in enumerate(rows_c) if c]
    idx_p = [i for i, c in enumerate(rows_c) if not c]
    n_succ_total = 0
    if grad_phi and setup.contrastive_weight > 0:  # every rank calls the reduction, rows or not
        sc = _successes(setup, full.rewards[idx_c], full.mask[idx_c]) if idx_c else torch.zeros(0)
        n_succ_total = int(dist.all_reduce_sum({"n": int(sc.sum())})["n"])
    n_latents = setup.composer.latents_per_item * len(refs[0]) if lopd and refs and refs[0] else 0
    kl_plain = 0.0
    nograd = setup.nograd_latents if setup.nograd_latents is not None else NoGradLatents()

    def delta_of(t_tok, s_tok, sb, rows):
        if setup.margin_advantage == "paper":
            return losses.privileged_margin(t_tok, s_tok, sb.rewards, sb.mask)
        adv = adv_full[rows].to(t_tok.device)
        return losses.centred_margin(t_tok, s_tok, adv, sb.mask)

    def delta_weight(sb, seq_total, tok_total):
        return sb.n_tokens / tok_total if setup.margin_advantage == "paper" else sb.n_sequences / seq_total

    def teacher(eps, mrefs, grad: bool):
        """Teacher hidden states in the student layout (+ latents, the teacher batch)."""
        with torch.set_grad_enabled(grad), _autocast(setup.autocast, device):
            if lopd:
                t0 = time.perf_counter()
                latents = encode_latents(setup.composer, mrefs, [ep.task.instruction for ep in eps],
                                         None if grad else nograd)
                sec["encode"] += time.perf_counter() - t0
                tb = build_teacher_batch(eps, tok, n_latents).to(device)
                th = teacher_hidden(tmodel, tb, latents.to(device), view=t_view)
            else:
                latents = None
                tb = build_teacher_batch(eps, tok, 0, prompt_fn=lambda b, ep: setup.text_prompt(ep, mrefs[b])).to(device)
                th = teacher_hidden(tmodel, tb, th_empty_latents(len(eps), device, model), view=t_view)
            return to_student_layout(th, tb, tuple(collate_shape(eps))), latents, tb

    controls = control_references(episodes, refs) if setup.privilege_gate else None
    gate_sum, gate_n = 0.0, 0

    def gate_of(rows, eps, sb, t_lp, t_ids):
        """Privilege weights (B, T) of a micro-batch, or None (gate off)."""
        nonlocal gate_sum, gate_n
        if controls is None:
            return None
        have = [controls[i] is not None for i in rows]
        crefs = [controls[i] if controls[i] is not None else list(refs[i]) for i in rows]
        with torch.no_grad():
            c_pred, _, _ = teacher(eps, crefs, grad=False)
            c_lp, _ = losses.chunked_logprobs(c_pred, t_head, topm_ids=t_ids, mask=sb.mask, chunk_size=setup.logit_chunk)
            w = losses.privilege_weights(t_lp, c_lp)
            w[~torch.tensor(have, device=w.device)] = 1.0  # no control in the batch: ungated
            m = sb.mask.bool()
            gate_sum += float(w[m].sum())
            gate_n += int(m.sum())
        return w

    def student_pass(sb, t_lp, t_ids, w_seq, weight=None):
        with use_student(model), _autocast(setup.autocast, device):
            s_pred = student_hidden(model, sb)
            s_topm_g, s_tok_g = losses.chunked_logprobs(
                s_pred, head, topm_ids=t_ids, token_ids=sb.targets if lopd else None, mask=sb.mask,
                chunk_size=setup.logit_chunk,
            )
            kl = losses.topm_reverse_kl(s_topm_g, t_lp, sb.mask, weight=weight)
        (kl.loss * w_seq).backward()
        return float(kl.loss.detach()), s_tok_g.detach() if s_tok_g is not None else None

    # Rows without the composer pass: no-grad teacher, then the student.
    for lo in range(0, len(idx_p), setup.micro_batch):
        rows = idx_p[lo : lo + setup.micro_batch]
        eps = [episodes[i] for i in rows]
        mrefs = [list(refs[i]) for i in rows]
        sb = collate(eps, pad, device)
        if sb.n_tokens == 0:
            continue
        w_seq = sb.n_sequences / n_seq_total
        t0 = time.perf_counter()
        t_pred, _, _ = teacher(eps, mrefs, grad=False)
        t_lp, t_ids = losses.chunked_teacher_topm(t_pred, t_head, setup.top_m, mask=sb.mask, chunk_size=setup.logit_chunk)
        if lopd:
            with torch.no_grad():
                t_tok = losses.chunked_token_logprobs(t_pred, t_head, sb.targets, mask=sb.mask, chunk_size=setup.logit_chunk)
        del t_pred
        gate = gate_of(rows, eps, sb, t_lp, t_ids)
        sec["teacher"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        kl_v, s_tok = student_pass(sb, t_lp, t_ids, w_seq, gate)
        out.kl += kl_v * w_seq
        kl_plain += kl_v * w_seq
        if lopd:
            out.delta += float(delta_of(t_tok, s_tok, sb, rows)) * delta_weight(sb, n_seq_total, n_tok_total)
        sec["student"] += time.perf_counter() - t0

    # Composer rows: teacher with grad → student log-probs (no grad) → composer backward → student.
    cmb = min(setup.composer_micro_batch or setup.micro_batch, setup.micro_batch)
    for lo in range(0, len(idx_c), cmb):
        rows = idx_c[lo : lo + cmb]
        eps = [episodes[i] for i in rows]
        mrefs = [list(refs[i]) for i in rows]
        instrs = [ep.task.instruction for ep in eps]
        sb = collate(eps, pad, device)
        if sb.n_tokens == 0:
            continue
        w_seq = sb.n_sequences / n_seq_total
        wc_seq, wc_tok, wc_task = sb.n_sequences / c_seq_total, sb.n_tokens / c_tok_total, len(eps) / c_eps_total
        t0 = time.perf_counter()
        t_pred, latents, tb = teacher(eps, mrefs, grad=True)
        t_lp, t_ids = losses.chunked_teacher_topm(t_pred.detach(), t_head, setup.top_m, mask=sb.mask,
                                                  chunk_size=setup.logit_chunk)
        gate = gate_of(rows, eps, sb, t_lp, t_ids)
        sec["teacher"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad(), use_student(model), _autocast(setup.autocast, device):
            s_topm, s_tok = losses.chunked_logprobs(student_hidden(model, sb), head, topm_ids=t_ids,
                                                    token_ids=sb.targets, mask=sb.mask, chunk_size=setup.logit_chunk)
        t_topm, t_tok = losses.chunked_logprobs(t_pred, t_head, topm_ids=t_ids, token_ids=sb.targets, mask=sb.mask,
                                                chunk_size=setup.logit_chunk)
        ckl = losses.topm_reverse_kl(s_topm, t_topm, sb.mask, detach="student")
        delta = delta_of(t_tok, s_tok, sb, rows)
        w_delta = wc_tok if setup.margin_advantage == "paper" else wc_seq
        anchor = (
            losses.anchor_loss(latents, setup.latents0(instrs, mrefs).to(latents.device))
            if setup.latents0 is not None and setup.anchor_lambda > 0
            else latents.new_zeros(())
        )
        # = w·(KL + β(m − Δ) + λ·anchor) with each term weighted by what it averages over in the
        # composer rows (β·m is a constant: it has no gradient and is left out).
        obj = wc_seq * ckl.loss - beta * w_delta * delta + setup.anchor_lambda * wc_task * anchor
        if n_succ_total:
            hinge, n_pairs = _contrastive(setup, tmodel, t_head, eps, tb, sb, latents, t_tok, t_view)
            if n_pairs:
                w_c = n_pairs / n_succ_total
                obj = obj + setup.contrastive_weight * w_c * hinge
                out.contrastive += float(hinge.detach()) * w_c
        obj.backward(inputs=setup.composer_leaves()) if setup.composer_leaves is not None else obj.backward()
        del t_pred, latents, obj, t_topm, t_tok
        out.composer_kl += float(ckl.loss.detach()) * wc_seq
        out.delta += float(delta.detach()) * delta_weight(sb, n_seq_total, n_tok_total)
        out.anchor += float(anchor.detach()) * wc_task
        sec["composer"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        kl_v, _ = student_pass(sb, t_lp, t_ids, w_seq, gate)
        out.kl += kl_v * w_seq
        sec["student"] += time.perf_counter() - t0
    if lopd:
        if not idx_c:  # no composer pass this step: its KL is the student's (the same numbers)
            out.composer_kl = kl_plain
        out.composer_loss = (out.composer_kl + beta * (setup.margin_m - out.delta) + setup.anchor_lambda * out.anchor
                             + setup.contrastive_weight * out.contrastive)
    if controls is not None:
        out.gate = gate_sum / max(gate_n, 1)
    out.seconds = sec if lopd else {k: v for k, v in sec.items() if k != "encode"}
    out.finite = all(map(_finite, (out.kl, out.composer_kl, out.delta, out.anchor)))
    return out


def collate_shape(eps: Sequence[Episode]) -> tuple[int, int]:
    """The (B, T) of `collate(eps)`'s prediction-layout mask."""
    return len(eps), max(len(ep.input_ids) for ep in eps) - 1


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


def _contrastive(setup: DistillSetup, model, head, eps, tb, sb, latents, t_tok, view=None) -> tuple[torch.Tensor, int]:
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
        th_o = teacher_hidden(model, tb, latents[torch.tensor(perm, device=latents.device)], view=view)
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
