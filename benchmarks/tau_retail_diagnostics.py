"""Diagnostics of τ²-retail rollouts (the files `lopd eval --rollouts FILE` writes): success, tool
calls, their validity, and the share of the task's gold actions the episode matched.

A gold action is matched when the episode made a call with the same name and the same arguments
(compared as JSON); the share is over all gold actions of the episodes' tasks. A call is valid
when it parsed and fit its schema (not among the runner's `invalid_tool_calls`); the server's
error share is over valid calls that τ²'s tools answered with `Error: ...`.

    python benchmarks/tau_retail_diagnostics.py base_test.jsonl [sft_test.jsonl ...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lopd_cli.envs import tau_retail as tr  # noqa: E402


def _key(name: str, arguments) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return json.dumps([name, arguments], sort_keys=True)


def episode_calls(messages: list[dict]) -> list[tuple[str, str]]:
    """(call key, observation) of every parsed tool call of a transcript."""
    observations = {m.get("tool_call_id"): str(m.get("content") or "") for m in messages if m.get("role") == "tool"}
    out = []
    for m in messages:
        for c in m.get("tool_calls") or []:
            out.append((_key(c["function"]["name"], c["function"]["arguments"]), observations.get(c.get("id"), "")))
    return out


def diagnose(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_id = tr.raw_tasks()
    n_calls = n_invalid = n_error = gold_total = gold_matched = 0
    stops: dict[str, int] = {}
    for r in rows:
        tid = r["task_id"].removeprefix("tau-retail-")
        calls = episode_calls(r["messages"])
        made = {k for k, _ in calls}
        n_calls += r["meta"].get("tool_calls", len(calls))  # the runner's count: every call, invalid ones too
        n_invalid += r["meta"].get("invalid_tool_calls", 0)
        n_error += sum(obs.startswith("Error") for _, obs in calls)  # τ²'s own errors; lopd's are "ERROR: "
        gold = [_key(a["name"], a["arguments"]) for a in by_id[tid]["evaluation_criteria"]["actions"] or []]
        gold_total += len(gold)
        gold_matched += sum(g in made for g in gold)
        stops[r["meta"].get("stop", "?")] = stops.get(r["meta"].get("stop", "?"), 0) + 1
    n = len(rows)
    return {
        "file": path.name, "episodes": n,
        "successes": sum(r["reward"] >= 1.0 for r in rows),
        "solved": sorted((r["task_id"].removeprefix("tau-retail-") for r in rows if r["reward"] >= 1.0), key=int),
        "tool_calls_per_episode": n_calls / max(1, n),
        "episodes_with_a_call": sum(bool(episode_calls(r["messages"]) or r["meta"].get("invalid_tool_calls"))
                                    for r in rows),
        "valid_call_share": (n_calls - n_invalid) / n_calls if n_calls else None,
        "server_error_share": n_error / max(1, n_calls - n_invalid) if n_calls - n_invalid else None,
        "gold_actions_matched": gold_matched, "gold_actions": gold_total,
        "gold_matched_share": gold_matched / max(1, gold_total),
        "stops": stops,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = [diagnose(p) for p in args.files]
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
