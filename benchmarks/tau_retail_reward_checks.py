"""Check the τ²-retail reward before trusting it, on all 114 tasks (issue 46).

1. gold: the task's gold actions, run as an episode through the MCP server (reset hook, calls,
   the server's call log, the recipe's reward plugin), score 1.0. A task "can be replayed" when
   every gold call succeeds; the others (τ² scripts some failing calls) are named.
2. do nothing: an episode with no tool call scores 0 on every task whose gold actions change the
   database; tasks whose gold actions leave it unchanged are named (doing nothing passes them).
3. one item id changed: the gold actions with one item id swapped for another variant of the
   same product (in a gold action that succeeds: the new item of an exchange or modification where
   there is one, else the item of a return) score 0.

Checks 1 and 2 go through the server; check 3 scores the changed calls with the same replay
the reward plugin uses (`score_calls`), without a server.

    python benchmarks/tau_retail_reward_checks.py [--out benchmarks/results/tau_retail_reward_checks.json] [--ids 0,5,...]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lopd_cli.agent.runner import make_env_factory  # noqa: E402
from lopd_cli.config import load_recipe  # noqa: E402
from lopd_cli.envs import tau_retail as tr  # noqa: E402

RECIPE = ROOT / "recipes" / "tau-retail-smollm2.yaml"
ID_KEYS = ("item_ids", "new_item_ids")


def other_variant(item_id: str) -> str:
    """Another item id of the same product (a different variant), or of another product."""
    products = tr._package()._base_db()["products"]
    for product in products.values():
        if item_id in product["variants"]:
            others = sorted(v for v in product["variants"] if v != item_id)
            if others:
                return others[0]
    return next(v for p in products.values() for v in sorted(p["variants"]) if v != item_id)


def succeeding(actions: list[dict]) -> list[bool]:
    """Whether each gold action succeeds when the actions are replayed in order."""
    server = tr._package()
    db, ok = tr.fresh_db(), []
    for a in actions:
        try:
            server._execute_tool(db, a["name"], copy.deepcopy(a["arguments"]))
            ok.append(True)
        except Exception:  # noqa: BLE001
            ok.append(False)
    return ok


def with_one_item_changed(actions: list[dict]) -> tuple[list[dict], str] | None:
    """The gold actions with one item id changed, and what was changed; None when no succeeding
    action names one. The new item of an exchange or modification is preferred (the call still
    succeeds, with the wrong variant); else the first item of a return or exchange."""
    ok = succeeding(actions)
    for key in ("new_item_ids", "item_ids"):
        for i, a in enumerate(actions):
            ids = a["arguments"].get(key)
            if ids and ok[i]:
                changed = copy.deepcopy(actions)
                changed[i]["arguments"][key][0] = other_variant(ids[0])
                return changed, f"{a['name']}.{key}[0] {ids[0]} -> {changed[i]['arguments'][key][0]}"
    return None


def check_task(task, factory=None) -> dict:
    """The three checks on one task. With `factory` (the recipe's environment), the gold and
    do-nothing episodes run through the MCP server and the recipe's reward plugin; without, their
    calls are scored by the same replay (`score_calls`) in this process."""
    tid, actions = task.data["tau2_id"], task.data["gold_actions"]
    record = task.raw
    if factory is not None:
        env = factory()
        gold = tr.gold_episode(env, task)
        gold_reward = env.reward(gold)
        env = factory()
        nothing_reward = env.reward(env.reset(task) + [{"role": "assistant", "content": "I cannot help with that."}])
    else:
        info = task.data["communicate_info"]
        gold = [{"role": "assistant", "content": "Done." + (f" {', '.join(info)}." if info else "")}]
        gold_reward = tr.score_calls(record, actions, gold)
        nothing_reward = tr.score_calls(record, [], [{"role": "assistant", "content": "I cannot help with that."}])
    changed = with_one_item_changed(actions)
    changed_reward = tr.score_calls(record, changed[0], gold) if changed is not None else None
    return {"tau2_id": tid, "split": task.split, "gold_calls": len(actions), "gold_call_errors": tr.replay(actions)[1],
            "gold_reward": gold_reward, "changes_db": tr.gold_hash(tid) != base_hash(),
            "nothing_reward": nothing_reward, "changed": changed[1] if changed else None,
            "changed_reward": changed_reward}


@functools.cache
def base_hash() -> str:
    return tr.db_hash(tr._package()._base_db())


def all_tasks(factory) -> list:
    return [t for split in ("train", "validation", "test") for t in factory().tasks(split)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--ids", help="comma-separated τ² task ids (default: all 114)")
    ap.add_argument("--in-process", action="store_true",
                    help="score the gold and do-nothing calls by replay, without the server")
    args = ap.parse_args()

    factory = make_env_factory(load_recipe(RECIPE))
    tasks = all_tasks(factory)
    if args.ids:
        wanted = set(args.ids.split(","))
        tasks = [t for t in tasks if t.data["tau2_id"] in wanted]
    rows, t0 = [], time.perf_counter()
    for n, task in enumerate(tasks, 1):
        rows.append(check_task(task, None if args.in_process else factory))
        print(f"\r{n}/{len(tasks)} tasks", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    summary = summarise(rows)
    summary["through_server"] = not args.in_process
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "tasks": rows}, indent=1) + "\n")


def summarise(rows: list[dict]) -> dict:
    replayable = [r for r in rows if not r["gold_call_errors"]]
    db_changing = [r for r in rows if r["changes_db"]]
    applicable = [r for r in rows if r["changed"] is not None]
    summary = {
        "tasks": len(rows),
        "gold": {"replayable": len(replayable), "replayable_scoring_1": sum(r["gold_reward"] == 1.0 for r in replayable),
                 "all_scoring_1": sum(r["gold_reward"] == 1.0 for r in rows),
                 "not_replayable": {r["tau2_id"]: r["gold_call_errors"] for r in rows if r["gold_call_errors"]},
                 "failing": [r["tau2_id"] for r in replayable if r["gold_reward"] != 1.0]},
        "do_nothing": {"db_changing": len(db_changing), "db_changing_scoring_0": sum(r["nothing_reward"] == 0.0 for r in db_changing),
                       "failing": [r["tau2_id"] for r in db_changing if r["nothing_reward"] != 0.0],
                       "passes_without_acting": [r["tau2_id"] for r in rows if r["nothing_reward"] == 1.0]},
        "one_item_changed": {"applicable": len(applicable), "scoring_0": sum(r["changed_reward"] == 0.0 for r in applicable),
                             "by_argument": {k: sum(f".{k}[0] " in r["changed"] for r in applicable) for k in ID_KEYS},
                             "failing": [r["tau2_id"] for r in applicable if r["changed_reward"] != 0.0]},
    }
    return summary


if __name__ == "__main__":
    main()
