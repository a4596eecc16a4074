"""Behaviour metrics of a set of episodes (the LOPD paper's, plus success and errors).

success_rate         share of episodes with reward >= success_threshold (default 1.0: every
                     checklist item holds)
mean_reward          mean reward (failed episodes count as 0)
tool_calls           mean tool calls per episode (invalid ones included)
repeated_tool_calls  mean calls per episode identical (name + arguments) to an earlier one
invalid_tool_calls   mean malformed / unknown-tool / bad-argument calls per episode
first_turn_tokens    mean length of the first generated turn, in tokens
"""

from __future__ import annotations

from statistics import fmean

from lopd_cli.agent.types import Episode


def summarize(episodes: list[Episode], success_threshold: float = 1.0) -> dict:
    if not episodes:
        return {"episodes": 0}

    def mean_meta(key: str) -> float:
        return fmean(float(e.meta.get(key, 0)) for e in episodes)

    errors = [e.error for e in episodes if e.error]
    return {
        "episodes": len(episodes),
        "success_rate": sum(e.reward >= success_threshold - 1e-9 for e in episodes) / len(episodes),
        "mean_reward": fmean(e.reward for e in episodes),
        "tool_calls": mean_meta("tool_calls"),
        "repeated_tool_calls": mean_meta("repeated_tool_calls"),
        "invalid_tool_calls": mean_meta("invalid_tool_calls"),
        "first_turn_tokens": mean_meta("first_turn_tokens"),
        "turns": mean_meta("turns"),
        "generated_tokens": fmean(sum(e.action_mask) for e in episodes),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }
