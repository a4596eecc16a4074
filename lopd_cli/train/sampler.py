"""Which training tasks each step uses: a seeded epoch-wise shuffle with a resumable position."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class TaskSampler:
    n_tasks: int
    seed: int
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def _shuffle(self) -> None:
        rng = random.Random(f"{self.seed}-{self.epoch}")
        self._order = list(range(self.n_tasks))
        rng.shuffle(self._order)

    def take(self, k: int) -> list[int]:
        """The next k task indices (wrapping into a new shuffled epoch when one runs out)."""
        if self.n_tasks == 0:
            raise ValueError("no training tasks")
        out: list[int] = []
        while len(out) < k:
            if not self._order:
                self._shuffle()
            if self.position >= self.n_tasks:
                self.epoch += 1
                self.position = 0
                self._shuffle()
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"n_tasks": self.n_tasks, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    @classmethod
    def from_state(cls, state: dict) -> "TaskSampler":
        s = cls(state["n_tasks"], state["seed"], state["epoch"], state["position"])
        s._shuffle()
        return s
