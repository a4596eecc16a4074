"""The environment protocol a world (built-in or a user's plugin) implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lopd_cli.agent.types import Task, ToolCall


@runtime_checkable
class Environment(Protocol):
    """One instance runs one episode at a time; the runner makes one instance per live episode.

    tasks(split)        the tasks of a split: "train", "validation" or "test"
    reset(task)         initial chat messages (system + user) for that task
    step(call)          run one tool call, return the observation text
    done()              optional: the env ended the episode
    reward(transcript)  in [0, 1]; a recipe's reward plugin may override it
    """

    def tasks(self, split: str) -> list[Task]: ...

    def reset(self, task: Task) -> list[dict]: ...

    def step(self, call: ToolCall) -> str: ...

    def reward(self, transcript: list[dict]) -> float: ...


def env_done(env: object) -> bool:
    fn = getattr(env, "done", None)
    return bool(fn()) if callable(fn) else False
