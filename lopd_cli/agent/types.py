"""Data that flows from environments through the runner into the bank and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Task:
    id: str
    instruction: str
    tools: list[dict]  # OpenAI function schemas: {"type": "function", "function": {...}}
    data: dict[str, Any] = field(default_factory=dict)  # env-specific (seed, expected state …)
    split: str = "train"
    # The mapping a plugin's tasks() returned, when it returned one (see agent/env.coerce_task).
    raw: Any = field(default=None, repr=False, compare=False)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""
    error: str | None = None  # parse/validation problem; the env is not stepped, the model sees it


@dataclass
class Episode:
    """One rollout, recorded exactly as generated so training can score the same tokens.

    `input_ids` is the whole conversation; `action_mask[i] == 1` where token i was sampled by
    the policy; `logprobs[i]` is the behaviour policy's log-prob of token i at the sampling
    temperature (0.0 where the mask is 0). `prompt_len` tokens render `prompt_messages`
    (system + first user turn) with `tools`; everything after comes from generation and tool
    observations, so a teacher prompt that differs only in the first user turn can be spliced
    in front of `input_ids[prompt_len:]`.
    """

    task: Task
    prompt_messages: list[dict]
    messages: list[dict]  # the full OpenAI-format transcript
    reward: float = 0.0
    input_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each generated turn
    prompt_len: int = 0
    error: str | None = None  # set when an env/plugin raised: the episode counts as failed
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def success_tokens(self) -> int:
        return sum(self.action_mask)

    def to_record(self) -> dict[str, Any]:
        """The rollout JSONL record of ARCHITECTURE.md (what `lopd bank add-rollouts` reads)."""
        meta = dict(self.meta)
        if self.error:
            meta["error"] = self.error
        return {
            "task_id": self.task.id,
            "instruction": self.task.instruction,
            "messages": self.messages,
            "reward": float(self.reward),
            "tools": self.task.tools,
            "meta": meta,
        }
