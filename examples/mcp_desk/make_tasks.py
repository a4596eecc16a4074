"""Write tasks.jsonl: 80 help-desk tasks (48 train, 16 validation, 16 test), each on its own desk.

Every task names a seed; the server's hidden `reset` tool builds that seed's desk for the episode
(the recipe's `env.mcp.reset: {tool: reset, arguments: {seed: "{data[seed]}"}}`), and this script
builds the same desk (server.build_desk) to write an instruction that fits it. Deterministic:
run it again and the file is the same.

    python make_tasks.py            # -> tasks.jsonl next to this file

A task record: {"id", "split", "instruction", "data": {"seed", "kind", "expect", "answer",
"answer_state", "calls"}}. The reward (reward.py) checks, on the desk at the end of the episode:
each `expect` entry ("kind:id:field" -> value, "*" = any new value), that nothing else changed,
and that the final answer contains each `answer` string and each `answer_state` value (a dotted
path into the final desk, e.g. the temporary password the server made).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from server import STAFF, build_desk

HERE = Path(__file__).resolve().parent
SPLITS = [("train", 48), ("validation", 16), ("test", 16)]
RESOLUTIONS = ["replaced the keyboard", "reinstalled the VPN client", "cleared the print queue",
               "updated the display driver", "granted drive access"]


def _lost_device(desk, rng):
    pairs = [(u, d) for d in desk["devices"].values() for u in [desk["users"][d["owner"]]]]
    u, d = rng.choice(pairs)
    kinds = [x["kind"] for x in desk["devices"].values() if x["owner"] == u["user_id"]]
    if kinds.count(d["kind"]) != 1:
        return None
    return (f"{u['name']} ({u['email']}) lost their {d['kind']}. Lock it remotely.",
            {"expect": {f"devices:{d['device_id']}:locked": True}},
            ["find_user", "list_devices", "lock_device"])


def _unlock_requester(desk, rng):
    locked = [t for t in desk["tickets"].values() if desk["users"][t["requester"]]["locked"]]
    if not locked:
        return None
    t = rng.choice(locked)
    return (f"Whoever opened ticket {t['ticket_id']} is locked out. Unlock their account.",
            {"expect": {f"users:{t['requester']}:locked": False}}, ["get_ticket", "unlock_account"])


def _reset_by_id(desk, rng):
    u = rng.choice(list(desk["users"].values()))
    return (f"Reset the password of user {u['user_id']} and tell me the temporary password.",
            {"expect": {f"users:{u['user_id']}:password_resets": 1, f"users:{u['user_id']}:temp_password": "*"},
             "answer_state": [f"users.{u['user_id']}.temp_password"]}, ["reset_password"])


def _reset_by_email(desk, rng):
    u = rng.choice(list(desk["users"].values()))
    return (f"{u['email']} forgot their password. Reset it and give me the temporary password.",
            {"expect": {f"users:{u['user_id']}:password_resets": 1, f"users:{u['user_id']}:temp_password": "*"},
             "answer_state": [f"users.{u['user_id']}.temp_password"]}, ["find_user", "reset_password"])


def _assign(desk, rng):
    t, agent = rng.choice(list(desk["tickets"])), rng.choice(STAFF)
    return (f"Assign ticket {t} to {agent}.", {"expect": {f"tickets:{t}:assignee": agent}}, ["assign_ticket"])


def _close(desk, rng):
    t, note = rng.choice(list(desk["tickets"])), rng.choice(RESOLUTIONS)
    return (f"Close ticket {t}: we {note}.",
            {"expect": {f"tickets:{t}:status": "closed", f"tickets:{t}:resolution": "*"}}, ["close_ticket"])


def _escalate(desk, rng):
    t, agent = rng.choice(list(desk["tickets"])), rng.choice(STAFF)
    return (f"Ticket {t} blocks payroll: make it urgent and assign it to {agent}.",
            {"expect": {f"tickets:{t}:priority": "urgent", f"tickets:{t}:assignee": agent}},
            ["set_priority", "assign_ticket"])


def _who_opened(desk, rng):
    t = rng.choice(list(desk["tickets"].values()))
    email = desk["users"][t["requester"]]["email"]
    return (f"Who opened ticket {t['ticket_id']}? Give me their e-mail address.",
            {"expect": {}, "answer": [email]}, ["get_ticket", "get_user"])


KINDS = {"reset_by_id": _reset_by_id, "assign": _assign, "close": _close, "who_opened": _who_opened,
         "reset_by_email": _reset_by_email, "escalate": _escalate, "unlock_requester": _unlock_requester,
         "lost_device": _lost_device}


def make_tasks() -> list[dict]:
    tasks, i = [], 0
    for split, n in SPLITS:
        for _ in range(n):
            kind = list(KINDS)[i % len(KINDS)]
            seed = 1000 + i
            while True:  # a desk this kind fits (e.g. a locked-out requester), the next seeds if not
                made = KINDS[kind](build_desk(seed), random.Random(seed))
                if made:
                    break
                seed += 100_000
            instruction, data, calls = made
            tasks.append({"id": f"desk-{split}-{i:03d}", "split": split, "instruction": instruction,
                          "data": {"seed": seed, "kind": kind, "expect": data["expect"],
                                   "answer": data.get("answer", []), "answer_state": data.get("answer_state", []),
                                   "calls": calls}})
            i += 1
    return tasks


if __name__ == "__main__":
    tasks = make_tasks()
    out = HERE / "tasks.jsonl"
    out.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    counts = {s: sum(t["split"] == s for t in tasks) for s, _ in SPLITS}
    print(f"wrote {len(tasks)} tasks to {out}: {counts}")
