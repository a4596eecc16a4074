"""The scripted agent of the orders world: the oracle (`orders.oracle_plan`) with mistakes.

Its transcripts stand in for "your agent's logs" in the demo and the tests
(`scripted_agent_records`, in the JSONL format `lopd bank add-rollouts` reads), and the tiny base
policy imitates them (`lopd_cli.train.base_policy`).
"""

from __future__ import annotations

import json
import random

from lopd_cli.agent.toolcalls import to_openai_tool_calls
from lopd_cli.agent.types import Task, ToolCall
from lopd_cli.envs.orders import OrdersEnv, oracle_plan


def noisy_oracle_transcript(task: Task, rng: random.Random, noise: float) -> list[dict]:
    """The oracle's episode for `task`; with probability `noise` it contains one mistake."""
    env = OrdersEnv()
    messages = env.reset(task)
    calls, answer = oracle_plan(task)
    mistake = rng.choice(["wrong_id", "early_stop", "vague_answer"]) if rng.random() < noise else None
    if mistake == "early_stop" and len(calls) > 1:
        calls = calls[: rng.randrange(1, len(calls))]
    if mistake == "wrong_id":
        i = rng.randrange(len(calls))
        args = dict(calls[i].arguments)
        key = next((k for k in ("order_id", "customer_id") if k in args), None)
        if key is None:
            mistake = "vague_answer"
        else:
            args[key] = args[key] + rng.choice([-1, 1]) * rng.randrange(1, 9)
            calls = calls[:i] + [ToolCall(calls[i].name, args, calls[i].id)]
    if mistake in ("vague_answer", "early_stop"):
        answer = "Done."
    for call in calls:
        messages.append({"role": "assistant", "content": "", "tool_calls": to_openai_tool_calls([call])})
        messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": env.step(call)})
    messages.append({"role": "assistant", "content": answer})
    return messages


def scripted_agent_records(tasks: list[Task], seed: int = 0, noise: float = 0.3) -> list[dict]:
    """Rollout records of a scripted agent (the oracle with mistakes at rate `noise`), scored
    by the orders world: stand-ins for the logs a team's existing agent has produced, in the
    JSONL format `lopd bank add-rollouts` reads."""
    rng = random.Random(seed)
    records = []
    for task in tasks:
        messages = noisy_oracle_transcript(task, rng, noise)
        env = OrdersEnv()
        env.reset(task)
        for m in messages:
            for c in m.get("tool_calls") or []:
                args = c["function"]["arguments"]
                env.step(ToolCall(c["function"]["name"], json.loads(args) if isinstance(args, str) else args, c["id"]))
        records.append({"task_id": task.id, "instruction": task.instruction, "messages": messages,
                        "reward": env.reward(messages), "tools": task.tools,
                        "meta": {"env": "orders", "agent": "scripted", "noise": noise, "seed": seed}})
    return records
