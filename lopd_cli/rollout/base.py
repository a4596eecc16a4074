"""The backend interface the runner samples through (hf by default, vLLM in its own module).

Kept small on purpose: a backend gets token ids (never text), samples one continuation per
prompt until a stop id or `max_new_tokens`, and returns exactly the sampled ids with the
behaviour policy's log-prob of each at the sampling temperature.

A backend may also offer `open_batch(n)`: a `BatchSession` that keeps state (the hf backend:
the KV cache) across the turns of `n` episodes generated together. The runner then passes
each turn's whole ids of the live episodes and the session prefills only what it has not
seen; backends without it get the whole ids through `generate` every turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0


@dataclass
class Generation:
    token_ids: list[int]  # as sampled, the stop token included when one was sampled
    logprobs: list[float] = field(default_factory=list)  # log p(token) under logits / temperature
    stopped: bool = False  # ended on a stop id (False: hit max_new_tokens)


class Backend(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams, stop_ids: list[int]) -> list[Generation]: ...


class BatchSession(Protocol):
    """One turn of the live episodes of a batch: `rows` index the `n` episodes the session was
    opened for (rows only ever leave), `ids` are their whole token ids so far."""

    def generate(self, rows: list[int], ids: list[list[int]], params: SamplingParams,
                 stop_ids: list[int]) -> list[Generation]: ...
