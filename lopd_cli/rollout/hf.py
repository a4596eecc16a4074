"""The default backend: transformers `generate` over a left-padded batch with the KV cache.

Log-probs come from the raw logits of each step (`output_logits`) divided by the sampling
temperature, so a trainer recomputes exactly the same numbers with one forward pass of the
same model over the recorded ids. (top_p, when below 1, truncates what is sampled but is not
folded into the recorded log-prob.) Greedy decoding (temperature 0) records log-probs at
temperature 1. Sampling is seeded with `torch.manual_seed(params.seed)`, so a batch is
reproducible for a given seed, batch composition and device.
"""

from __future__ import annotations

import torch

from lopd_cli.rollout.base import Generation, SamplingParams


class HFBackend:
    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else tokenizer.eos_token_id

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, stop_ids: list[int]) -> list[Generation]:
        if not prompts:
            return []
        ids, mask = self._left_pad(prompts)
        greedy = params.temperature <= 0
        sampling = (
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)
            if greedy
            else dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
        )
        torch.manual_seed(params.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=list(stop_ids),
                pad_token_id=self.pad_id,
                use_cache=True,
                output_logits=True,
                return_dict_in_generate=True,
                **sampling,
            )
        finally:
            self.model.train(was_training)
        new = out.sequences[:, ids.shape[1]:]
        temp = 1.0 if greedy else params.temperature
        # (steps, batch) log-probs of the sampled tokens.
        step_lp = torch.stack(
            [torch.log_softmax(l.float() / temp, dim=-1).gather(-1, new[:, t: t + 1]).squeeze(-1)
             for t, l in enumerate(out.logits)]
        ) if out.logits else torch.zeros((0, len(prompts)))
        stops = set(stop_ids)
        results = []
        for row in range(len(prompts)):
            toks = new[row].tolist()
            end = next((t + 1 for t, tok in enumerate(toks) if tok in stops), None)
            stopped = end is not None
            end = end if stopped else len(toks)
            results.append(Generation(toks[:end], step_lp[:end, row].tolist(), stopped))
        return results
