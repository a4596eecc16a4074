"""An IT help desk as an MCP stdio server: users, their devices and their tickets.

This stands in for "your team's own MCP server". Every tool takes a `state_key`: the server keeps
one desk per key, in memory, so that many episodes can run against one process at once. lopd
fills `state_key` in itself (the recipe's `env.mcp.call_arguments: {state_key: "{episode}"}`)
and hides it from the agent.

Agent tools: find_user, get_user, list_devices, get_ticket, list_tickets, reset_password,
unlock_account, lock_device, assign_ticket, set_priority, close_ticket.
Hidden tools (the recipe's `hide_tools` and `reset`): reset(state_key, seed) builds a fresh desk
from a seed; get_state(state_key) returns it with the list of what changed, for the reward.

Run it alone: `python server.py` speaks MCP over stdin/stdout (the `mcp` SDK that lopd installs).
"""

from __future__ import annotations

import copy
import hashlib
import random
from typing import Any

from mcp.server.mcpserver import MCPServer
# Raise ToolError for a failure the agent should read: its message reaches the client. Any other
# exception is a "crash": the client gets only "Error executing tool NAME".
from mcp.server.mcpserver.exceptions import ToolError

STAFF = ["priya", "marco", "lena", "tomas", "aiko"]  # the help-desk agents tickets go to
FIRST = ["Alice", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ines", "Jonas",
         "Kofi", "Lucia", "Mateo", "Nadia", "Oskar", "Paula", "Quinn", "Rosa", "Sami", "Tara"]
LAST = ["Berg", "Costa", "Diaz", "Eriksen", "Fischer", "Garcia", "Haddad", "Ito", "Jensen",
        "Kowalski", "Lopez", "Moreau", "Novak", "Okafor", "Petrov", "Rossi", "Sato", "Weber"]
DEPARTMENTS = ["finance", "sales", "engineering", "legal", "support"]
DEVICE_KINDS = ["laptop", "phone", "tablet"]
ISSUES = ["VPN drops every hour", "cannot print to floor 3", "Outlook asks for password again",
          "laptop fan very loud", "monitor flickers", "no access to the shared drive",
          "Teams crashes on start", "keyboard keys stuck", "forgot password", "account locked out"]
PRIORITIES = ["low", "normal", "high", "urgent"]


def build_desk(seed: int) -> dict[str, Any]:
    """The desk of one seed: 6 users (some locked out), 1-2 devices each, 6 tickets. Deterministic."""
    rng = random.Random(seed)
    users, devices, tickets = {}, {}, {}
    names = rng.sample([(f, ln) for f in FIRST for ln in LAST], 6)
    for i, (first, last) in enumerate(names):
        uid = f"u{100 + rng.randrange(900)}"
        while uid in users:
            uid = f"u{100 + rng.randrange(900)}"
        users[uid] = {"user_id": uid, "name": f"{first} {last}",
                      "email": f"{first.lower()}.{last.lower()}@example.com",
                      "department": rng.choice(DEPARTMENTS), "locked": rng.random() < 0.3,
                      "password_resets": 0, "temp_password": None}
        for kind in rng.sample(DEVICE_KINDS, rng.choice([1, 2])):
            did = f"d{1000 + rng.randrange(9000)}"
            while did in devices:
                did = f"d{1000 + rng.randrange(9000)}"
            devices[did] = {"device_id": did, "kind": kind, "owner": uid, "locked": False}
    uids = list(users)
    for _ in range(6):
        tid = f"T-{rng.randrange(10, 100)}"
        while tid in tickets:
            tid = f"T-{rng.randrange(10, 100)}"
        tickets[tid] = {"ticket_id": tid, "title": rng.choice(ISSUES), "requester": rng.choice(uids),
                        "status": "open", "priority": rng.choice(PRIORITIES[:3]), "assignee": None,
                        "resolution": None}
    return {"seed": seed, "users": users, "devices": devices, "tickets": tickets}


def changes(before: dict, after: dict) -> list[str]:
    """What differs between two desks, as 'kind:id:field' strings (sorted)."""
    out = []
    for kind in ("users", "devices", "tickets"):
        for key, row in after[kind].items():
            for field, value in row.items():
                if before[kind][key].get(field) != value:
                    out.append(f"{kind}:{key}:{field}")
    return sorted(out)


def temp_password(seed: int, user_id: str, n: int) -> str:
    """A reset's temporary password: deterministic, so the same episode gives the same one."""
    return "Tmp-" + hashlib.sha256(f"{seed}/{user_id}/{n}".encode()).hexdigest()[:8]


# ------------------------------------------------------------------------------------ the server

DESKS: dict[str, dict] = {}    # state_key -> the desk now
INITIAL: dict[str, dict] = {}  # state_key -> the desk as reset made it


def _desk(state_key: str) -> dict:
    if state_key not in DESKS:
        raise ToolError(f"no desk for state_key {state_key!r}: call reset first")
    return DESKS[state_key]


def _user(desk: dict, user_id: str) -> dict:
    if user_id not in desk["users"]:
        raise ToolError(f"no user {user_id!r}")
    return desk["users"][user_id]


def _ticket(desk: dict, ticket_id: str) -> dict:
    if ticket_id not in desk["tickets"]:
        raise ToolError(f"no ticket {ticket_id!r}")
    return desk["tickets"][ticket_id]


def _public_user(u: dict) -> dict:
    return {k: u[k] for k in ("user_id", "name", "email", "department", "locked")}


server = MCPServer("it-desk")


@server.tool()
def reset(state_key: str, seed: int) -> dict[str, Any]:
    """Hidden: build a fresh desk for one episode from a seed."""
    DESKS[state_key] = build_desk(seed)
    INITIAL[state_key] = copy.deepcopy(DESKS[state_key])
    return {"ok": True, "state_key": state_key, "seed": seed}


@server.tool()
def get_state(state_key: str) -> dict[str, Any]:
    """Hidden: the whole desk and what changed since reset (the reward reads it)."""
    desk = _desk(state_key)
    return {"desk": desk, "changes": changes(INITIAL[state_key], desk)}


@server.tool()
def find_user(query: str, state_key: str) -> dict[str, Any]:
    """Find users whose name or e-mail contains the query (case-insensitive)."""
    q = query.strip().lower()
    hits = [_public_user(u) for u in _desk(state_key)["users"].values()
            if q and (q in u["name"].lower() or q in u["email"].lower())]
    return {"users": hits}


@server.tool()
def get_user(user_id: str, state_key: str) -> dict[str, Any]:
    """A user's record: name, e-mail, department, whether the account is locked."""
    return _public_user(_user(_desk(state_key), user_id))


@server.tool()
def list_devices(user_id: str, state_key: str) -> dict[str, Any]:
    """The devices a user owns (id, kind, locked)."""
    desk = _desk(state_key)
    _user(desk, user_id)
    return {"devices": [d for d in desk["devices"].values() if d["owner"] == user_id]}


@server.tool()
def get_ticket(ticket_id: str, state_key: str) -> dict[str, Any]:
    """A ticket: title, requester (a user id), status, priority, assignee."""
    return dict(_ticket(_desk(state_key), ticket_id))


@server.tool()
def list_tickets(state_key: str, user_id: str = "", status: str = "") -> dict[str, Any]:
    """Tickets, optionally only a requester's (user_id) or only those with a status (open, closed)."""
    rows = [t for t in _desk(state_key)["tickets"].values()
            if (not user_id or t["requester"] == user_id) and (not status or t["status"] == status)]
    return {"tickets": rows}


@server.tool()
def reset_password(user_id: str, state_key: str) -> dict[str, Any]:
    """Reset a user's password; returns the temporary password to give them."""
    desk = _desk(state_key)
    user = _user(desk, user_id)
    user["password_resets"] += 1
    user["temp_password"] = temp_password(desk["seed"], user_id, user["password_resets"])
    return {"ok": True, "user_id": user_id, "temp_password": user["temp_password"]}


@server.tool()
def unlock_account(user_id: str, state_key: str) -> dict[str, Any]:
    """Unlock a user's locked-out account."""
    user = _user(_desk(state_key), user_id)
    was = user["locked"]
    user["locked"] = False
    return {"ok": True, "user_id": user_id, "was_locked": was}


@server.tool()
def lock_device(device_id: str, state_key: str) -> dict[str, Any]:
    """Remotely lock a device (lost or stolen)."""
    desk = _desk(state_key)
    if device_id not in desk["devices"]:
        raise ToolError(f"no device {device_id!r}")
    desk["devices"][device_id]["locked"] = True
    return {"ok": True, "device_id": device_id}


@server.tool()
def assign_ticket(ticket_id: str, agent: str, state_key: str) -> dict[str, Any]:
    """Assign a ticket to a help-desk agent (priya, marco, lena, tomas or aiko)."""
    ticket = _ticket(_desk(state_key), ticket_id)
    if agent.lower() not in STAFF:
        raise ToolError(f"no help-desk agent {agent!r} (agents: {', '.join(STAFF)})")
    ticket["assignee"] = agent.lower()
    return {"ok": True, "ticket_id": ticket_id, "assignee": ticket["assignee"]}


@server.tool()
def set_priority(ticket_id: str, priority: str, state_key: str) -> dict[str, Any]:
    """Set a ticket's priority: low, normal, high or urgent."""
    ticket = _ticket(_desk(state_key), ticket_id)
    if priority not in PRIORITIES:
        raise ToolError(f"priority must be one of {', '.join(PRIORITIES)}")
    ticket["priority"] = priority
    return {"ok": True, "ticket_id": ticket_id, "priority": priority}


@server.tool()
def close_ticket(ticket_id: str, resolution: str, state_key: str) -> dict[str, Any]:
    """Close a ticket with a short resolution note."""
    ticket = _ticket(_desk(state_key), ticket_id)
    if ticket["status"] == "closed":
        raise ToolError(f"ticket {ticket_id} is already closed")
    ticket["status"], ticket["resolution"] = "closed", resolution
    return {"ok": True, "ticket_id": ticket_id, "status": "closed"}


if __name__ == "__main__":
    server.run("stdio")
