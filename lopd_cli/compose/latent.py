"""Teacher conditioning: the student's transcript with a latent reference block in its prompt.

The teacher's prompt is the student's prompt with a framed reference block at the start of the
first user message; the block holds `<|LATENT_PH|>`, expanded to n_ret·K positions whose input
embeddings are replaced by c_φ. Everything after the prompt (actions, tool observations) is the
student's token sequence unchanged, so teacher and student score exactly the same action tokens:

    teacher_ids = render_prompt_ids(teacher prompt messages) + episode.input_ids[prompt_len:]
    teacher position of student token i (i >= prompt_len) = i + (len(teacher prompt) - prompt_len)

Logits at position p-1 predict the token at p; `TeacherBatch` gives token positions.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from lopd_cli.agent.chat import render_prompt_ids
from lopd_cli.bank.records import content_text
from lopd_cli.errors import LopdError
from lopd_cli.models.backbone import latent_token_id
from lopd_cli.models.tiny import LATENT_TOKEN

FRAMING_BEFORE = (
    "Below is a reference: a compressed record of how a different, already-solved task was handled. "
    "It only illustrates the approach. Nothing of your task has been done yet; call the tools "
    "yourself and rely on their real results.\n\n"
)
FRAMING_AFTER = "\n\n--- end of reference ---\n\nNow solve your own task, starting from scratch:\n\n"


def with_reference_block(prompt_messages: list[dict], block: str) -> list[dict]:
    """The prompt with `block`, framed, at the start of the first user turn (a copy)."""
    msgs = copy.deepcopy(prompt_messages)
    idx = next((i for i, m in enumerate(msgs) if m.get("role") == "user"), None)
    if idx is None:
        raise LopdError("the episode's prompt has no user message to hold the reference block")
    msgs[idx]["content"] = FRAMING_BEFORE + block + FRAMING_AFTER + content_text(msgs[idx].get("content"))
    return msgs


def text_reference_block(items: Sequence, obs_char_budget: int, max_chars: int) -> str:
    """Retrieved items as plain text (observation-lite, each cut at `max_chars`): what OPSD's
    teacher reads where LOPD's reads c_φ."""
    from lopd_cli.bank.lite import lite_text

    return "\n\n".join(f"Reference {k + 1}:\n{lite_text(it, obs_char_budget)[:max_chars]}" for k, it in enumerate(items))


def teacher_prompt_messages(prompt_messages: list[dict]) -> list[dict]:
    """The prompt with the latent reference block (one placeholder) at the start of the first user turn."""
    return with_reference_block(prompt_messages, LATENT_TOKEN)


def text_teacher_prompt_ids(tokenizer, prompt_messages: list[dict], tools: list[dict] | None, items: Sequence,
                            obs_char_budget: int, max_chars: int) -> list[int]:
    """OPSD's teacher prompt: the same frame holding the retrieved items as text."""
    block = text_reference_block(items, obs_char_budget, max_chars)
    return render_prompt_ids(tokenizer, with_reference_block(prompt_messages, block), tools)


def teacher_prompt_ids(tokenizer, prompt_messages: list[dict], tools: list[dict] | None, n_latents: int) -> tuple[list[int], int]:
    """(teacher prompt ids with the placeholder expanded to n_latents, index of the first one)."""
    ids = render_prompt_ids(tokenizer, teacher_prompt_messages(prompt_messages), tools)
    ph = latent_token_id(tokenizer)
    where = [i for i, t in enumerate(ids) if t == ph]
    if len(where) != 1:
        raise LopdError(f"the chat template rendered {len(where)} latent placeholders instead of 1 (is {LATENT_TOKEN} in the prompt text?)")
    at = where[0]
    return ids[:at] + [ph] * n_latents + ids[at + 1:], at


@dataclass
class TeacherBatch:
    """Right-padded teacher sequences and the map to the student's action tokens.

    input_ids, attention_mask, latent_mask: (B, T). latent_mask is True on the n_latents
    placeholder positions of each row. The action tokens of the whole batch, flattened in
    order (episode, position): `batch_index[j]` is the episode, `student_pos[j]` the token's
    position in `episode.input_ids`, `teacher_pos[j]` its position in `input_ids[b]`, and
    `token_ids[j]` the token itself (identical on both sides). `offsets[b]` = teacher pos −
    student pos for every token after the prompt.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    latent_mask: torch.Tensor
    batch_index: torch.Tensor
    student_pos: torch.Tensor
    teacher_pos: torch.Tensor
    token_ids: torch.Tensor
    offsets: list[int]
    lengths: list[int]

    def to(self, device) -> "TeacherBatch":
        fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return TeacherBatch(**fields)


def build_teacher_batch(episodes: Sequence, tokenizer, n_latents: int,
                        prompt_fn: Callable[[int, object], list[int]] | None = None) -> TeacherBatch:
    """Teacher sequences for student episodes (`lopd_cli.agent.types.Episode`: input_ids,
    action_mask, prompt_len, prompt_messages, task.tools).

    `prompt_fn(b, episode) -> teacher prompt ids` replaces the latent reference block with
    another privileged prompt (OPSD: retrieved trajectories as plain text); then n_latents must
    be 0 and the latent mask is empty. The alignment of action tokens is the same either way."""
    if prompt_fn is not None and n_latents:
        raise ValueError("prompt_fn builds a text-only teacher prompt: pass n_latents=0")
    pad = tokenizer.pad_token_id or 0
    rows, latent_rows, offsets = [], [], []
    b_idx, s_pos, t_pos, toks = [], [], [], []
    for b, ep in enumerate(episodes):
        if len(ep.action_mask) != len(ep.input_ids):
            raise LopdError(f"episode {b} ({ep.task.id}): action_mask and input_ids differ in length")
        student_prompt = render_prompt_ids(tokenizer, ep.prompt_messages, ep.task.tools)
        if list(ep.input_ids[: ep.prompt_len]) != student_prompt:
            raise LopdError(
                f"episode {b} ({ep.task.id}): input_ids[:prompt_len] is not the rendered prompt; "
                "the transcript was tokenised differently from lopd_cli.agent.chat.render_prompt_ids"
            )
        if prompt_fn is not None:
            prompt, at = list(prompt_fn(b, ep)), 0
        else:
            prompt, at = teacher_prompt_ids(tokenizer, ep.prompt_messages, ep.task.tools, n_latents)
        offset = len(prompt) - ep.prompt_len
        rows.append(prompt + list(ep.input_ids[ep.prompt_len:]))
        latent_rows.append((at, at + n_latents))
        offsets.append(offset)
        for i, m in enumerate(ep.action_mask):
            if m:
                if i < ep.prompt_len:
                    raise LopdError(f"episode {b} ({ep.task.id}): action token {i} lies inside the prompt")
                b_idx.append(b)
                s_pos.append(i)
                t_pos.append(i + offset)
                toks.append(ep.input_ids[i])
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), T), dtype=torch.long)
    lat = torch.zeros((len(rows), T), dtype=torch.bool)
    for b, (r, (lo, hi)) in enumerate(zip(rows, latent_rows)):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        attn[b, : len(r)] = 1
        lat[b, lo:hi] = True
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return TeacherBatch(
        input_ids=ids,
        attention_mask=attn,
        latent_mask=lat,
        batch_index=as_long(b_idx),
        student_pos=as_long(s_pos),
        teacher_pos=as_long(t_pos),
        token_ids=as_long(toks),
        offsets=offsets,
        lengths=[len(r) for r in rows],
    )


def teacher_inputs_embeds(model, teacher_ids: torch.Tensor, latents: torch.Tensor, latent_mask: torch.Tensor) -> torch.Tensor:
    """Token embeddings of `teacher_ids` with the placeholder positions (`latent_mask`, from
    TeacherBatch) replaced by `latents` (B, n_latents, d), in order. Differentiable with respect
    to `latents` (hence into φ). The mask, not the token id, marks the positions: a student could
    sample the placeholder token itself."""
    embeds = model.get_input_embeddings()(teacher_ids)
    per_row = latent_mask.sum(dim=1)
    if latents.dim() != 3 or latents.shape[0] != teacher_ids.shape[0] or bool((per_row != latents.shape[1]).any()):
        raise ValueError(
            f"latents {tuple(latents.shape)} do not fit the placeholders (per row: {per_row.tolist()})"
        )
    return embeds.masked_scatter(latent_mask.unsqueeze(-1).to(embeds.device), latents.to(embeds.dtype))


def action_token_logprobs(logits: torch.Tensor, batch_index: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log p(token at `positions`) from (B, T, V) logits: logits at position p-1 predict p."""
    rows = logits[batch_index, positions - 1].float()
    return torch.log_softmax(rows, dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


MIN_SHARED_PREFIX = 64  # tokens; below this the one-row prefix pass is not worth its overhead


def shared_prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      latent_mask: torch.Tensor | None = None) -> int:
    """How many leading positions every row shares: the same real token and no latent there.
    At least one position of each row is left after it."""
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)
    if latent_mask is not None:
        same &= ~latent_mask.bool().any(0)
    return min(int(same.long().cumprod(0).sum()), input_ids.shape[1] - 1)


def decoder_hidden(decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   inputs_embeds: torch.Tensor | None = None, latent_mask: torch.Tensor | None = None,
                   min_prefix: int | None = None) -> torch.Tensor:
    """decoder(...).last_hidden_state (B, T, d), with the prefix that every row shares (a world's
    system prompt and tool schemas: ~800 of ~1,000 tokens in `orders`) run once, on one row, and
    its key/value cache repeated for the rest. The same maths as one full pass (causal
    attention: a prefix position sees only the prefix); gradients reach whatever the prefix
    depends on through the repeated cache (summed over rows, as in the full pass). Right padding.
    A prefix shorter than `min_prefix` (default `MIN_SHARED_PREFIX`) gets one full pass."""
    from lopd_cli.models import activation_checkpointing as ac

    B = input_ids.shape[0]
    P = shared_prefix_len(input_ids, attention_mask, latent_mask) if B > 1 else 0
    full = P < (MIN_SHARED_PREFIX if min_prefix is None else min_prefix)
    if not full and ac.recomputes(decoder):  # checkpointed layers: caches that a recompute can replay
        out = ac.prefix_pass(decoder, input_ids, attention_mask, inputs_embeds, P, _cache_kwarg(type(decoder)))
        if out is not None:
            return out
        full = True
    if full:
        kw = {"inputs_embeds": inputs_embeds} if inputs_embeds is not None else {"input_ids": input_ids}
        return decoder(**kw, attention_mask=attention_mask, use_cache=False).last_hidden_state
    # The prefix is read from the token ids (no latent lies in it), so when only the latents need
    # gradients no graph is built through it.
    with ac.off_without_grad(decoder):
        head = decoder(input_ids=input_ids[:1, :P], attention_mask=attention_mask[:1, :P], use_cache=True)
        cache = getattr(head, "cache", None)  # transformers 5.19 has the field but fills past_key_values
        cache = cache if cache is not None else head.past_key_values
        cache.batch_repeat_interleave(B)
        rest = {"inputs_embeds": inputs_embeds[:, P:]} if inputs_embeds is not None else {"input_ids": input_ids[:, P:]}
        tail = decoder(**rest, attention_mask=attention_mask, **{_cache_kwarg(type(decoder)): cache},
                       use_cache=True).last_hidden_state
    return torch.cat([head.last_hidden_state.expand(B, -1, -1), tail], dim=1)


@functools.lru_cache(maxsize=None)
def _cache_kwarg(decoder_class: type) -> str:
    """transformers ≥ 5.x calls the forward's cache argument `cache`, earlier ones `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(decoder_class.forward).parameters else "past_key_values"


def teacher_hidden(model, batch: TeacherBatch, latents: torch.Tensor, view=None) -> torch.Tensor:
    """Last hidden states (B, T, d) of the teacher (adapters off, c_φ in the placeholders);
    gradients reach `latents`. Feed rows at `teacher_pos − 1` to the lm_head (chunked). `view`:
    another view of `model` than adapters off (adapters.use_student: `train.teacher: live`)."""
    from lopd_cli.compose.composer import decoder_of
    from lopd_cli.models.adapters import teacher_view

    with (view or teacher_view)(model):
        embeds = teacher_inputs_embeds(model, batch.input_ids, latents, batch.latent_mask)
        return decoder_hidden(decoder_of(model), batch.input_ids, batch.attention_mask, embeds, batch.latent_mask)


def output_head(model):
    """The LM head (hidden → logits) of a causal LM, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_output_embeddings()
