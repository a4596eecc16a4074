"""Write logs/desk.jsonl: "your agent's logs" on the help desk, in OpenAI chat format.

A scripted agent (an oracle that makes mistakes on purpose, about one episode in three) works the
training tasks against the real server: it starts server.py over stdio with the `mcp` SDK, resets
a desk per task, makes its calls, and records the server's real answers as the tool turns. Each
record is scored with reward.py on the final desk, so the log holds successes and failures, as a
real agent's would. The records are what `lopd bank add-rollouts` reads (docs/bank.md).

    python logs.py                      # -> logs/desk.jsonl (the train split; --split, --out)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import yaml
from mcp import Client, StdioServerParameters

from reward import checklist

HERE = Path(__file__).resolve().parent
RECIPE = yaml.safe_load((HERE / "recipe.yaml").read_text())["env"]["mcp"]
KEY = "logs"  # the state key this script's episodes use, one at a time


def agent_tools(listed) -> list[dict]:
    """The tools as the agent sees them: less the hidden ones and the state_key argument."""
    hidden = {*RECIPE.get("hide_tools", []), RECIPE["reset"]["tool"]}
    out = []
    for t in listed:
        if t.name in hidden:
            continue
        params = json.loads(json.dumps(t.input_schema))
        for k in RECIPE.get("call_arguments", {}):
            params.get("properties", {}).pop(k, None)
            if k in params.get("required", []):
                params["required"].remove(k)
        out.append({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                     "parameters": params}})
    return out


class Episode:
    def __init__(self, client: Client, task: dict):
        self.client, self.task, self.n = client, task, 0
        self.messages = [{"role": "system", "content": RECIPE["system_prompt"]},
                         {"role": "user", "content": task["instruction"]}]

    async def call(self, name: str, **arguments) -> dict | None:
        """One tool call, recorded with the server's real answer; its JSON (None on an error)."""
        self.n += 1
        cid = f"call_{self.n}"
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]})
        result = await self.client.call_tool(name, {**arguments, "state_key": KEY})
        text = "\n".join(b.text for b in result.content if getattr(b, "type", "") == "text")
        self.messages.append({"role": "tool", "tool_call_id": cid, "content": text})
        return None if result.is_error else result.structured_content

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


async def solve(ep: Episode, rng: random.Random, slip: bool) -> None:
    """The oracle for each kind of task; `slip` makes one plausible mistake."""
    d, instr = ep.task["data"], ep.task["instruction"]
    words = instr.replace(":", " ").replace(",", " ").replace("?", " ").rstrip(".").split()
    kind = d["kind"]
    if kind in ("reset_by_id", "reset_by_email"):
        if kind == "reset_by_id":
            uid = next(w for w in words if w.startswith("u") and w[1:].isdigit())
        else:
            email = words[0]  # a slip: looks the user up by first name only and takes the first hit
            found = await ep.call("find_user", query=email.split(".")[0] if slip else email)
            uid = found["users"][0]["user_id"] if found and found["users"] else None
        if uid is None:
            return ep.answer("I could not find that user.")
        out = await ep.call("reset_password", user_id=uid)
        ep.answer("Done, the password is reset." if slip and kind == "reset_by_id" else
                  f"Done: the temporary password is {out['temp_password']}.")
    elif kind in ("assign", "escalate"):
        tid = next(w for w in words if w.startswith("T-"))
        agent = words[-1]
        if kind == "escalate":
            await ep.call("set_priority", ticket_id=tid, priority="high" if slip else "urgent")
        await ep.call("assign_ticket", ticket_id=tid, agent=rng.choice(["priya", "marco"]) if slip and kind == "assign" else agent)
        ep.answer(f"Ticket {tid} is now with {agent}.")
    elif kind == "close":
        tid = next(w for w in words if w.startswith("T-"))
        note = instr.split(": we ", 1)[1].rstrip(".")
        if slip:
            await ep.call("get_ticket", ticket_id=tid)
            return ep.answer(f"Ticket {tid} looks handled: {note}.")
        await ep.call("close_ticket", ticket_id=tid, resolution=note)
        ep.answer(f"Closed {tid}.")
    elif kind == "who_opened":
        tid = next(w for w in words if w.startswith("T-"))
        t = await ep.call("get_ticket", ticket_id=tid)
        if slip:
            return ep.answer(f"Ticket {tid} was opened by user {t['requester']}.")
        u = await ep.call("get_user", user_id=t["requester"])
        ep.answer(f"{u['name']} opened it: {u['email']}.")
    elif kind == "unlock_requester":
        tid = next(w for w in words if w.startswith("T-"))
        t = await ep.call("get_ticket", ticket_id=tid)
        if slip:  # resets the password instead: the wrong change
            await ep.call("reset_password", user_id=t["requester"])
        else:
            await ep.call("unlock_account", user_id=t["requester"])
        ep.answer(f"{t['requester']} can log in again.")
    elif kind == "lost_device":
        email = instr.split("(")[1].split(")")[0]
        lost = instr.split("lost their ")[1].split(".")[0]
        found = await ep.call("find_user", query=email)
        uid = found["users"][0]["user_id"]
        devs = (await ep.call("list_devices", user_id=uid))["devices"]
        pick = [x for x in devs if x["kind"] == lost][0]
        if slip and len(devs) > 1:
            pick = [x for x in devs if x["kind"] != lost][0]
        await ep.call("lock_device", device_id=pick["device_id"])
        ep.answer(f"Locked {pick['device_id']} ({pick['kind']}).")


async def main(split: str, out: Path, slip_rate: float, seed: int) -> None:
    tasks = [json.loads(line) for line in (HERE / "tasks.jsonl").read_text().splitlines() if line.strip()]
    tasks = [t for t in tasks if t["split"] == split]
    rng = random.Random(seed)
    params = StdioServerParameters(command=sys.executable, args=[str(HERE / "server.py")], cwd=str(HERE))
    records = []
    async with Client(params) as client:
        tools = agent_tools((await client.list_tools()).tools)
        for task in tasks:
            await client.call_tool(RECIPE["reset"]["tool"], {"state_key": KEY, "seed": task["data"]["seed"]})
            ep = Episode(client, task)
            slip = rng.random() < slip_rate
            await solve(ep, rng, slip)
            state = (await client.call_tool("get_state", {"state_key": KEY})).structured_content
            items = checklist(task["data"], state, ep.messages)
            reward = sum(ok for _, ok in items) / len(items)
            records.append({"task_id": task["id"], "instruction": task["instruction"], "messages": ep.messages,
                            "reward": reward, "tools": tools,
                            "meta": {"env": "mcp-desk", "agent": "scripted", "kind": task["data"]["kind"], "slip": slip}})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    ok = sum(r["reward"] >= 1.0 for r in records)
    print(f"wrote {len(records)} records to {out}: {ok} successful (reward 1.0), {len(records) - ok} not")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", default="train")
    ap.add_argument("--out", type=Path, default=Path("logs/desk.jsonl"))
    ap.add_argument("--slip-rate", type=float, default=0.3, help="share of episodes with a mistake")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    asyncio.run(main(a.split, a.out, a.slip_rate, a.seed))
