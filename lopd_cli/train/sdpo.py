"""SDPO (Self-Distillation Policy Optimization, Hübotter et al., arXiv 2601.20802) as
`train.algo: sdpo`, with the defaults of its official implementation (lasgroup/SDPO, verl's
`actor.self_distillation`):

    1. G rollouts of each task (`train.sdpo.group_size`, as GRPO's groups);
    2. each rollout's teacher is the model itself, reprompted: the first user turn followed by a
       successful sibling's attempt ("Correct solution: ...") — never the rollout itself, even
       when it succeeded (`dont_reprompt_on_self_success`) — or, for a failed rollout whose
       group has no other success, the environment's feedback on it ("The following is feedback
       from your unsuccessful earlier attempt: ..."; only without a solution, as upstream's
       `environment_feedback_only_without_solution`); a rollout with neither gets no loss;
    3. the teacher's and the student's log-probs on the student's own top-k ids (k = 100) plus a
       tail bucket, and the generalized Jensen-Shannon divergence with α = 0.5 between them
       (upstream's `compute_self_distillation_loss`), each token's loss weighted by the
       importance ratio π_θ / π_old clipped at 2, averaged over the distilled tokens;
    4. the teacher's weights are an EMA of the student's at rate 0.05 (`train.teacher: ema`,
       SDPO's default here, `train.teacher_ema_rate`), updated after each optimiser step.

Where lopd departs, and why:
    - agents, not single answers: the teacher's prompt differs only in the first user turn, and
      the rest of the rollout (assistant turns, tool observations) follows it unchanged; the
      sibling's attempt is its transcript after the prompt, observation-lite
      (`bank.obs_char_budget`), the form OPSD's teacher reads references in;
    - one optimiser step per batch of rollouts (like lopd's GRPO), so π_old, the policy that
      sampled, is the one being updated and the clipped ratio is 1 at every token; the clip
      binds only where a batch is split over several updates (upstream's mini-batches);
    - "success" is `eval.success_threshold` (upstream: a reward ≥ 0.5 by default, which with
      the binary rewards it was run on is the same thing);
    - environment feedback is what an environment's optional `feedback(transcript)` returns
      (agent/runner.py puts it in the episode's meta); an environment without one gives none.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from lopd_cli.agent.types import Episode
from lopd_cli.compose.latent import build_teacher_batch, output_head, teacher_hidden
from lopd_cli.models.adapters import use_student
from lopd_cli.train import distributed as dist
from lopd_cli.train import lockstep, losses
from lopd_cli.train.batch import BatchTotals, collate, filler_batch, student_hidden, to_student_layout

# Upstream's reprompt templates (verl actor config, self_distillation), verbatim.
REPROMPT = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
SOLUTION = "\nCorrect solution:\n\n{successful_previous_attempt}\n\n"
FEEDBACK = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n"


@dataclass(frozen=True)
class TeacherContext:
    """What one rollout's teacher sees besides the prompt: a sibling's successful attempt (its
    index in the batch) or feedback on the rollout's own failed attempt; neither: no loss."""

    sibling: int | None = None
    feedback: str | None = None

    @property
    def active(self) -> bool:
        return self.sibling is not None or self.feedback is not None


def succeeded(ep: Episode, threshold: float) -> bool:
    return ep.error is None and ep.reward >= threshold - 1e-9


def teacher_contexts(episodes: Sequence[Episode], group_ids: Sequence[int], threshold: float,
                     use_feedback: bool = True) -> list[TeacherContext]:
    """Each rollout's teacher context: the first successful sibling of its group other than
    itself; else (a failed rollout, `use_feedback`) the feedback on its attempt; else none."""
    out = []
    for i, (ep, g) in enumerate(zip(episodes, group_ids)):
        sib = next((j for j, (o, h) in enumerate(zip(episodes, group_ids))
                    if h == g and j != i and succeeded(o, threshold)), None)
        if sib is not None:
            out.append(TeacherContext(sibling=sib))
            continue
        fb = feedback_of(ep) if use_feedback and not succeeded(ep, threshold) else None
        out.append(TeacherContext(feedback=fb))
    return out


def feedback_of(ep: Episode) -> str | None:
    """The environment's feedback on an attempt (its `feedback` hook), or the error that ended it."""
    fb = ep.meta.get("feedback") or ep.error
    return str(fb) if fb else None


def attempt_text(ep: Episode, obs_char_budget: int) -> str:
    """A sibling's attempt as the teacher reads it: its transcript after the prompt, observation-lite."""
    from lopd_cli.bank.lite import lite_messages, render_transcript

    return render_transcript(lite_messages(ep.messages[len(ep.prompt_messages):], obs_char_budget))


def reprompt_messages(prompt_messages: list[dict], solution: str | None, feedback: str | None) -> list[dict]:
    """The prompt with upstream's reprompt template in place of the first user turn."""
    from lopd_cli.bank.records import content_text

    msgs = copy.deepcopy(prompt_messages)
    idx = next(i for i, m in enumerate(msgs) if m.get("role") == "user")
    msgs[idx]["content"] = REPROMPT.format(
        prompt=content_text(msgs[idx].get("content")),
        solution=SOLUTION.format(successful_previous_attempt=solution) if solution is not None else "",
        feedback=FEEDBACK.format(feedback_raw=feedback) if feedback is not None else "")
    return msgs


# ----------------------------------------------------------------------------- the update


@dataclass
class SdpoSetup:
    model: object
    tokenizer: object
    top_k: int
    alpha: float
    is_clip: float | None
    success_threshold: float
    feedback: bool
    obs_char_budget: int
    micro_batch: int
    logit_chunk: int
    teacher_model: object | None = None  # a module of its own (a full student's EMA copy); None: a view of `model`
    teacher_view: Callable | None = None  # the view of the teacher module (None: adapters off)
    autocast: bool = False


@dataclass
class SdpoOutcome:
    loss: float = 0.0  # token mean of the weighted divergence over the distilled tokens
    distilled: int = 0  # rollouts with a teacher context
    with_solution: int = 0
    with_feedback: int = 0
    n_tokens: int = 0  # distilled tokens (this rank)
    seconds: dict = field(default_factory=dict)
    finite: bool = True


def sdpo_update(setup: SdpoSetup, episodes: Sequence[Episode], group_ids: Sequence[int],
                totals: BatchTotals | None = None) -> SdpoOutcome:
    """Accumulate SDPO's gradient for the batch (whole groups; under torchrun this rank's share:
    the token mean divides by the distilled tokens of every rank)."""
    from lopd_cli.agent.chat import render_prompt_ids
    from lopd_cli.train.step import th_empty_latents

    model, tok = setup.model, setup.tokenizer
    device = next(model.parameters()).device
    head = output_head(model)
    tmodel = setup.teacher_model if setup.teacher_model is not None else model
    t_head = output_head(tmodel)
    pad = tok.pad_token_id or 0
    ctx = teacher_contexts(episodes, group_ids, setup.success_threshold, setup.feedback)
    rows = [i for i, c in enumerate(ctx) if c.active]
    out = SdpoOutcome(distilled=len(rows), with_solution=sum(c.sibling is not None for c in ctx),
                      with_feedback=sum(c.sibling is None and c.feedback is not None for c in ctx))
    mine = sum(sum(episodes[i].action_mask[1:]) for i in rows)
    n_tok_total = int(dist.all_reduce_sum({"n": float(mine)})["n"]) if dist.is_distributed() else mine
    out.n_tokens = mine
    solutions = {i: attempt_text(episodes[c.sibling], setup.obs_char_budget) for i, c in enumerate(ctx)
                 if c.sibling is not None}

    def prompt(i: int) -> list[int]:
        ep = episodes[i]
        return render_prompt_ids(tok, reprompt_messages(ep.prompt_messages, solutions.get(i), ctx[i].feedback
                                                        if i not in solutions else None), ep.task.tools)

    seconds = {"teacher": 0.0, "student": 0.0}
    chunks = []
    for lo in range(0, len(rows), setup.micro_batch):
        idx = rows[lo: lo + setup.micro_batch]
        sb = collate([episodes[i] for i in idx], pad, device)
        if sb.n_tokens:
            chunks.append((idx, sb))
    # the uniform schedule of a per-layer sharded step: filler passes (the first row; weight 0)
    for (idx, sb), real in lockstep.padded(chunks, lambda: ([0], filler_batch(episodes, pad, device))):
        eps = [episodes[i] for i in idx]
        t0 = time.perf_counter()
        with use_student(model), torch.autocast(device.type, torch.bfloat16, enabled=setup.autocast):
            s_pred = student_hidden(model, sb)
        ids = losses.chunked_teacher_topm(s_pred.detach(), head, setup.top_k, mask=sb.mask,
                                          chunk_size=setup.logit_chunk)[1]  # the student's top k
        t1 = time.perf_counter()
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=setup.autocast):
            tb = build_teacher_batch(eps, tok, 0, prompt_fn=lambda b, ep: prompt(idx[b])).to(device)
            th = teacher_hidden(tmodel, tb, th_empty_latents(len(eps), device, model), view=setup.teacher_view)
            t_lp = losses.chunked_logprobs(to_student_layout(th, tb, tuple(sb.mask.shape)), t_head, topm_ids=ids,
                                           mask=sb.mask, chunk_size=setup.logit_chunk)[0]
            del th, tb
        t2 = time.perf_counter()
        s_lp, s_tok = losses.chunked_logprobs(s_pred, head, topm_ids=ids, token_ids=sb.targets, mask=sb.mask,
                                              chunk_size=setup.logit_chunk)
        per_token = losses.generalized_jsd(s_lp, t_lp, setup.alpha)
        if setup.is_clip is not None:
            per_token = per_token * losses.clipped_is_ratio(s_tok, s_tok.detach(), setup.is_clip)
        loss = torch.where(sb.mask, per_token, torch.zeros_like(per_token)).sum() / max(1, n_tok_total)
        if not real:
            (loss * 0.0).backward()
            continue
        loss.backward()
        out.loss += float(loss.detach())
        seconds["teacher"] += t2 - t1
        seconds["student"] += (t1 - t0) + (time.perf_counter() - t2)
    out.seconds = seconds
    out.finite = out.loss == out.loss and abs(out.loss) != float("inf")
    return out
