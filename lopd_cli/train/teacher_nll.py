"""The teacher's NLL: how the frozen backbone scores action tokens with a reference block of
latents (c_φ, random, zeros, another task's), of the references as plain text (OPSD's teacher),
or with none. The cold start trains on it, the before-training check (check.py) and the
composer's health during training (coldstart.composer_health) measure with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from lopd_cli.agent.types import Episode
from lopd_cli.compose.composer import Composer
from lopd_cli.compose.latent import TeacherBatch, build_teacher_batch, output_head, teacher_hidden, text_teacher_prompt_ids
from lopd_cli.train.losses import chunked_token_logprobs

if TYPE_CHECKING:
    from lopd_cli.train.coldstart import Example


def text_reference_chars(recipe) -> int:
    """Characters of each text reference: the same order of context as the composer reads."""
    return recipe.composer.max_item_tokens * 4


def teacher_token_logprobs(model, batch: TeacherBatch, latents: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """log p_teacher of every action token in `batch` (flattened, TeacherBatch order)."""
    hidden = teacher_hidden(model, batch, latents)
    rows = hidden[batch.batch_index, batch.teacher_pos - 1]
    return chunked_token_logprobs(rows, output_head(model), batch.token_ids, chunk_size=chunk_size)


def plain_teacher_token_logprobs(model, episodes: Sequence[Episode], chunk_size: int = 1024) -> torch.Tensor:
    """The same tokens scored by the frozen backbone with no reference block at all."""
    from lopd_cli.compose.composer import decoder_of
    from lopd_cli.compose.latent import decoder_hidden
    from lopd_cli.models.adapters import teacher_view

    device = next(model.parameters()).device
    T = max(len(e.input_ids) for e in episodes)
    ids = torch.zeros((len(episodes), T), dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    b_idx, pos, toks = [], [], []
    for b, e in enumerate(episodes):
        ids[b, : len(e.input_ids)] = torch.tensor(e.input_ids, device=device)
        attn[b, : len(e.input_ids)] = 1
        for i, m in enumerate(e.action_mask):
            if m:
                b_idx.append(b)
                pos.append(i)
                toks.append(e.input_ids[i])
    with teacher_view(model):
        hidden = decoder_hidden(decoder_of(model), ids, attn)
    rows = hidden[torch.tensor(b_idx, device=device), torch.tensor(pos, device=device) - 1]
    return chunked_token_logprobs(rows, output_head(model), torch.tensor(toks, device=device), chunk_size=chunk_size)


def same_norm_random(latents: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Gaussian directions scaled to each latent's own norm."""
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype).to(latents.device)
    return noise / noise.norm(dim=-1, keepdim=True) * latents.norm(dim=-1, keepdim=True)


def teacher_example_logprobs(model, tokenizer, composer: Composer, examples: Sequence[Example], mode: str = "learned",
                             batch_size: int = 8, seed: int = 0, obs_char_budget: int = 600, text_max_chars: int = 1536,
                             partners: Sequence[int] | None = None,
                             progress: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """log p_teacher of each example's action tokens (one tensor per example, in order), no grad.
    `progress(n)` is called after each batch of n examples.

    mode: "learned" (c_φ of the retrieved items), "random" (random latents with c_φ's per-row
    norms), "zeros" (the framed block with all-zero latents: the framing alone), "shuffled" (c_φ
    of another example's retrieved items: latents of the right form without this task's
    information), "other" (c_φ of the items of example `partners[i]`, see `check.other_task_partners`),
    "text" (the retrieved items as plain text in the same frame: OPSD's teacher, what the
    references can tell a teacher that reads them verbatim), "none" (no reference block)."""
    gen = torch.Generator().manual_seed(seed)
    all_refs = [ex.refs for ex in examples]
    if mode == "shuffled":  # rotate over the whole set, so no batch boundary hands back its own
        all_refs = all_refs[1:] + all_refs[:1]
    elif mode == "other":
        if partners is None:
            raise ValueError("mode 'other' needs partners")
        all_refs = [all_refs[j] for j in partners]
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            eps = [ex.episode for ex in chunk]
            refs = all_refs[start : start + batch_size]
            if mode == "none":
                lp = plain_teacher_token_logprobs(model, eps)
            elif mode == "text":
                batch = build_teacher_batch(eps, tokenizer, 0, prompt_fn=lambda b, ep: text_teacher_prompt_ids(
                    tokenizer, ep.prompt_messages, ep.task.tools, refs[b], obs_char_budget, text_max_chars))
                device = next(model.parameters()).device
                empty = torch.zeros((len(eps), 0, model.get_input_embeddings().embedding_dim), device=device)
                lp = teacher_token_logprobs(model, batch.to(device), empty)
            else:
                latents = composer(refs, [e.task.instruction for e in eps])
                if mode == "random":
                    latents = same_norm_random(latents, gen)
                elif mode == "zeros":
                    latents = torch.zeros_like(latents)
                elif mode not in ("learned", "shuffled", "other"):
                    raise ValueError(f"unknown mode {mode!r}")
                batch = build_teacher_batch(eps, tokenizer, latents.shape[1]).to(latents.device)
                lp = teacher_token_logprobs(model, batch, latents)
            out += list(lp.float().cpu().split([sum(e.action_mask) for e in eps]))
            if progress is not None:
                progress(len(chunk))
    return out


def teacher_nll(model, tokenizer, composer: Composer, examples: Sequence[Example], mode: str = "learned",
                batch_size: int = 8, seed: int = 0, obs_char_budget: int = 600, text_max_chars: int = 1536,
                progress: Callable[[int], None] | None = None) -> float:
    """Per-token NLL of the examples' action tokens under the teacher (modes: `teacher_example_logprobs`)."""
    lps = teacher_example_logprobs(model, tokenizer, composer, examples, mode, batch_size, seed, obs_char_budget,
                                   text_max_chars, progress=progress)
    count = sum(lp.numel() for lp in lps)
    return float(-sum(lp.sum() for lp in lps)) / max(count, 1)


def latent_task_spread(composer: Composer, examples: Sequence[Example], batch_size: int = 8) -> float:
    """How much c_φ varies from task to task: mean ‖c − c̄‖ / mean ‖c‖ over the examples' latent
    rows (c̄ = the mean over examples, per row). 0 means the composer ignores what it reads (a
    fixed soft prompt); a fresh composer gives a few percent to tens of percent."""
    with torch.no_grad():
        lat = torch.cat([composer([ex.refs for ex in examples[i : i + batch_size]],
                                  [ex.episode.task.instruction for ex in examples[i : i + batch_size]])
                         for i in range(0, len(examples), batch_size)]).float()
    return float((lat - lat.mean(0, keepdim=True)).norm(dim=-1).mean() / lat.norm(dim=-1).mean().clamp(min=1e-12))
