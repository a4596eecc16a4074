"""The default backend: a transformers model sampled step by step with a KV cache that lives
across the turns of a batch of episodes.

`HFBackend.open_batch(n)` gives an `HFBatch`: the runner hands it each turn's full token ids
of the live episodes, and only the ids not yet in the cache are prefilled (the tool
observation and the next assistant header after the turn's sampled tokens). On the first turn
the longest common prefix of the batch (system prompt + tool schemas) is computed once with
batch 1 and repeated over the batch (`DynamicCache.batch_repeat_interleave`); episodes that
end are dropped from the cache (`batch_select_indices`). Rows of different lengths share the
cache through holes: each prefill is left-padded *within its own chunk*, the padding and the
steps a row sits out after its stop id are masked (attention mask 0) and skipped by the
position ids, so every row computes exactly what a fresh forward pass over its own ids would,
up to float rounding.

Sampling follows transformers' `generate` step for step (scores / temperature, top-p as its
`TopPLogitsWarper`, `softmax` then one `torch.multinomial` over the whole batch per step;
greedy = argmax), so for a given seed it draws what `generate` draws on the same prompts. Only
the last position's logits are computed (`logits_to_keep=1`) and the sampled token's
log-prob is gathered at each step: no B×V logits are kept per generated position. The
recorded log-prob is log softmax(logits / temperature) of the raw logits (top_p, when below 1,
truncates what is sampled but is not folded in), so a trainer recomputes exactly the same
numbers with one forward pass over the recorded ids. Greedy decoding (temperature 0) records
log-probs at temperature 1. Sampling is seeded with `torch.manual_seed(params.seed)` at each
turn, so a batch is reproducible for a given seed, batch composition and device.
"""

from __future__ import annotations

import torch

from lopd_cli.rollout.base import Generation, SamplingParams


def _common_prefix_len(seqs: list[list[int]]) -> int:
    first, n = seqs[0], min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper (min_tokens_to_keep 1), on temperature-scaled scores."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cumulative_probs <= (1 - top_p)
    sorted_remove[..., -1:] = 0
    remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, -float("inf"))


def _cache_kwarg(model) -> str:
    """`cache` (transformers ≥ 5.2x) or `past_key_values` (older; deprecated since)."""
    import inspect

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    try:
        params = inspect.signature(type(base).forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


class HFBatch:
    """The KV cache of one batch of episodes across their turns (see the module docstring).

    `generate(rows, ids, params, stop_ids)`: `rows` are the episodes (indices into the batch
    opened) still running, `ids` their whole token ids so far. Rows only ever leave; the ids
    already in the cache must be a prefix of what is passed (checked).
    """

    def __init__(self, backend: "HFBackend", n: int):
        self.backend = backend
        self.n = n
        self.rows: list[int] = []  # batch index of each cache row
        self.fed: list[list[int]] = []  # per cache row: the ids whose keys/values are cached
        self.cache = None
        self.mask: torch.Tensor | None = None  # (rows, width) 1 = real token, 0 = hole
        self.started = False
        self.prefix_len = 0

    # ------------------------------------------------------------------ internals
    def _forward(self, chunk: list[list[int]]) -> torch.Tensor:
        """Feed one chunk per cache row (left-padded within the chunk; [] = a masked hole);
        return the float32 logits at each row's last position (rows, V)."""
        b = self.backend
        width = max(len(c) for c in chunk)
        dev = b.device
        ids = torch.full((len(chunk), width), b.pad_id, dtype=torch.long)
        new_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        pos = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, c in enumerate(chunk):
            start = len(self.fed[r])
            if c:
                ids[r, width - len(c):] = torch.tensor(c, dtype=torch.long)
                new_mask[r, width - len(c):] = 1
                pos[r, width - len(c):] = torch.arange(start, start + len(c))
            pos[r, : width - len(c)] = max(start - 1, 0)  # holes: any valid position, masked anyway
            self.fed[r].extend(c)
        new_mask = new_mask.to(dev)
        self.mask = new_mask if self.mask is None else torch.cat([self.mask, new_mask], dim=1)
        out = b.model(
            input_ids=ids.to(dev), attention_mask=self.mask, position_ids=pos.to(dev),
            use_cache=True, logits_to_keep=1, **{b.cache_kwarg: self.cache},
        )
        self.cache = getattr(out, b.cache_kwarg)
        return out.logits[:, -1, :].float()

    def _open(self, rows: list[int], ids: list[list[int]]) -> None:
        """First turn: the shared prefix once with batch 1, repeated over the batch."""
        from transformers import DynamicCache

        b = self.backend
        self.rows = list(rows)
        self.fed = [[] for _ in rows]
        self.cache = DynamicCache(config=b.model.config)
        # Leave at least one id per row, so the first sampled token has its own logits.
        p = min(_common_prefix_len(ids), min(len(s) for s in ids) - 1) if len(ids) > 1 else 0
        self.prefix_len = max(p, 0)
        if self.prefix_len:
            prefix = ids[0][: self.prefix_len]
            out = b.model(
                input_ids=torch.tensor([prefix], dtype=torch.long, device=b.device),
                attention_mask=torch.ones((1, self.prefix_len), dtype=torch.long, device=b.device),
                use_cache=True, logits_to_keep=1, **{b.cache_kwarg: self.cache},
            )
            self.cache = getattr(out, b.cache_kwarg)
            self.cache.batch_repeat_interleave(len(rows))
            self.mask = torch.ones((len(rows), self.prefix_len), dtype=torch.long, device=b.device)
            self.fed = [list(prefix) for _ in rows]
        self.started = True

    def _select(self, rows: list[int]) -> None:
        if rows == self.rows:
            return
        where = {r: i for i, r in enumerate(self.rows)}
        missing = [r for r in rows if r not in where]
        if missing:
            raise ValueError(f"HFBatch: rows {missing} left the batch earlier (rows only ever leave)")
        keep = [where[r] for r in rows]
        idx = torch.tensor(keep, dtype=torch.long, device=self.backend.device)
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]
        self.fed = [self.fed[i] for i in keep]
        self.rows = list(rows)

    # ------------------------------------------------------------------ the turn
    @torch.no_grad()
    def generate(self, rows: list[int], ids: list[list[int]], params: SamplingParams,
                 stop_ids: list[int]) -> list[Generation]:
        if not rows:
            return []
        if len(rows) != len(ids):
            raise ValueError("HFBatch.generate: one id list per row")
        model = self.backend.model
        was_training = model.training
        model.eval()
        try:
            if not self.started:
                self._open(rows, ids)
            else:
                self._select(rows)
            pending = []
            for r, seq in enumerate(ids):
                fed = self.fed[r]
                if len(seq) <= len(fed) or seq[: len(fed)] != fed:
                    raise ValueError("HFBatch.generate: the ids in the cache are not a strict prefix of the "
                                     f"ids passed for batch row {self.rows[r]}")
                pending.append(seq[len(fed):])
            return self._sample(pending, params, stop_ids)
        finally:
            model.train(was_training)

    def _sample(self, pending: list[list[int]], params: SamplingParams, stop_ids: list[int]) -> list[Generation]:
        greedy = params.temperature <= 0
        temp = 1.0 if greedy else params.temperature
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        n = len(pending)
        torch.manual_seed(params.seed)
        toks: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        active = torch.ones(n, dtype=torch.bool)
        logits = self._forward(pending)
        for step in range(params.max_new_tokens):
            if greedy:
                nxt = torch.argmax(logits, dim=-1)
            else:
                scores = logits / temp
                if params.top_p < 1.0:
                    scores = _top_p_filter(scores, params.top_p)
                nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            lp = torch.log_softmax(logits / temp, dim=-1).gather(-1, nxt[:, None])[:, 0]
            nxt_l, lp_l, act_l = nxt.cpu().tolist(), lp.cpu().tolist(), active.tolist()
            for r in range(n):
                if act_l[r]:
                    toks[r].append(nxt_l[r])
                    lps[r].append(lp_l[r])
            active &= ~torch.isin(nxt.cpu(), stops)
            if not active.any() or step == params.max_new_tokens - 1:
                break
            act_l = active.tolist()
            logits = self._forward([[toks[r][-1]] if act_l[r] else [] for r in range(n)])
        stop_set = set(stop_ids)
        return [Generation(t, lp, bool(t) and t[-1] in stop_set) for t, lp in zip(toks, lps)]


class HFBackend:
    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else tokenizer.eos_token_id
        self.cache_kwarg = _cache_kwarg(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def open_batch(self, n: int) -> HFBatch:
        """A KV cache for `n` episodes generated together, turn after turn."""
        return HFBatch(self, n)

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop_ids: list[int]) -> list[Generation]:
        """One turn for each prompt (no state kept): a fresh batch, its shared prefix computed once."""
        if not prompts:
            return []
        return self.open_batch(len(prompts)).generate(list(range(len(prompts))), prompts, params, stop_ids)
