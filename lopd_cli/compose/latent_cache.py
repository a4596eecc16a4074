"""The c_φ0 cache: cold-start latents for the anchor term λ‖c_φ − sg[c_φ0]‖².

Keyed by the task being solved and the tuple of retrieved bank ids (in retrieval order): the
encoder sees "Task to solve: {task}" in front of each item, so the same items give different
latents for a different task. Stored next to the composer as `latents0.safetensors`, one
(n_ret·K, d) tensor per key. Misses (e.g. items added to a growing bank) are computed with the
cold-start composer (`fill`) — load it frozen with `Composer.load(dir, …, adapter="encoder0",
frozen=True)` so it does not disturb the trained one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import torch

CACHE_FILE = "latents0.safetensors"


def cache_key(task_instruction: str, item_ids: Sequence[int | str]) -> str:
    task = hashlib.sha1(task_instruction.strip().encode()).hexdigest()[:16]
    return f"{task}|{','.join(str(i) for i in item_ids)}"


class LatentCache:
    def __init__(self, entries: dict[str, torch.Tensor] | None = None):
        self.entries: dict[str, torch.Tensor] = dict(entries or {})

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, task_instruction: str, items: Sequence) -> torch.Tensor | None:
        return self.entries.get(cache_key(task_instruction, [it.id for it in items]))

    def put(self, task_instruction: str, items: Sequence, latents: torch.Tensor) -> None:
        self.entries[cache_key(task_instruction, [it.id for it in items])] = latents.detach().to("cpu").contiguous()

    def lookup(self, task_instructions: Sequence[str], items_per_task: Sequence[Sequence], device=None) -> torch.Tensor | None:
        """(B, n_ret·K, d) when every task is cached, else None."""
        got = [self.get(t, its) for t, its in zip(task_instructions, items_per_task)]
        if any(g is None for g in got):
            return None
        return torch.stack(got).to(device) if device is not None else torch.stack(got)

    @torch.no_grad()
    def fill(self, composer0, task_instructions: Sequence[str], items_per_task: Sequence[Sequence],
             batch_tasks: int = 8) -> int:
        """Compute and store the missing entries with the cold-start composer; returns how many."""
        from lopd_cli.train import lockstep

        todo = [(t, its) for t, its in zip(task_instructions, items_per_task) if its and self.get(t, its) is None]
        chunks = [todo[start : start + batch_tasks] for start in range(0, len(todo), batch_tasks)]
        # a per-layer sharded step runs as many composer passes on every rank (fillers are not stored)
        known = [(t, its) for t, its in zip(task_instructions, items_per_task) if its][:1]
        for chunk, real in lockstep.padded(chunks, lambda: known):
            latents = composer0([its for _, its in chunk], [t for t, _ in chunk])
            if real:
                for (t, its), lat in zip(chunk, latents):
                    self.put(t, its, lat)
        return len(todo)

    def get_or_fill(self, composer0, task_instructions: Sequence[str], items_per_task: Sequence[Sequence], device=None) -> torch.Tensor:
        self.fill(composer0, task_instructions, items_per_task)
        out = self.lookup(task_instructions, items_per_task, device)
        assert out is not None
        return out

    def save(self, directory: Path) -> Path:
        from safetensors.torch import save_file

        path = Path(directory) / CACHE_FILE
        tmp = path.with_suffix(".tmp")
        save_file(self.entries, str(tmp))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, directory: Path) -> "LatentCache":
        """The cache saved with a composer (empty if there is none)."""
        from safetensors.torch import load_file

        path = Path(directory) / CACHE_FILE
        return cls(load_file(str(path)) if path.is_file() else {})
