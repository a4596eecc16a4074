"""`orders`: a synthetic customer-service world (customers, orders, products, payments).

Every task is generated from its own seed: a small database (3 customers, their orders and
payments) and a request that needs 1–4 tool calls (look up, cancel, refund, change an
address, message the customer). Splits are disjoint: train, validation and test draw from
separate seed ranges and a later split drops any task (instruction + database) an earlier one holds.

Reward, like EnvScaler's checklists: the fraction of checklist items that hold at the end —
each intended database change, "nothing else changed", and facts the final answer must state.
`oracle_plan(task)` is the scripted policy that solves every task (tests, the tiny base policy).

House rules (`house_rules=True`, on in the packaged recipes and the demo): every task belongs
to one of `STORES`, named in its instruction, and each store has fixed procedures that appear
nowhere in the system prompt or the tool schemas (`store_rules`): the reason code a refund
needs, whether an order must be looked up with `get_order` before it is cancelled or refunded,
and the sign-off every final answer ends with. They are drawn from `rules_seed`, the same for
all of a store's tasks (so a student can learn them), and enforced: a refund or cancellation
that breaks one fails with the observation "store policy violated" (which rule is not said)
and changes nothing; a missing sign-off fails its checklist item. This is the kind of reusable
structure a team's experience holds and its prompt lacks, the case where a teacher that reads
past successes knows something the student can learn. `house_rules=False` is the plain world
(identical tasks to earlier versions), where a reference tells nothing the instruction does not.

What it simplifies: the world is a Python dict, not a service; the instructions come from a
handful of templates, so the variety is in the data, not the language.
"""

from __future__ import annotations

import copy
import functools
import json
import random
from typing import Any

from lopd_cli.agent.toolcalls import check_arguments, tool_schemas_by_name
from lopd_cli.agent.types import Task, ToolCall
from lopd_cli.errors import LopdError

SYSTEM_PROMPT = "You are a customer-service agent. Use the tools, then answer in one short sentence."

SPLIT_SEED_BASE = {"train": 0, "validation": 1_000_000, "test": 2_000_000,
                   "base": 3_000_000}  # "base": the tiny base policy's own tasks (train.base_policy)
SPLIT_ORDER = ("train", "validation", "test")
DEFAULT_SIZES = {"train": 512, "validation": 64, "test": 128}

FIRST_NAMES = ["ana", "ben", "cara", "dan", "eva", "finn", "gus", "hana", "ivan", "jade", "kai", "lena",
               "milo", "nora", "omar", "pia", "raj", "sara", "tom", "uma", "vik", "wen", "yara", "zoe"]
PRODUCTS = {"lamp": 24.5, "desk": 129.0, "chair": 59.9, "mug": 8.75, "rug": 74.0, "shelf": 45.25,
            "clock": 19.99, "vase": 32.4}
STREETS = ["Oak St", "Elm Rd", "Main St", "Lake Ave", "Hill Rd", "Park Ln", "Mill St", "Rose Ave"]
CANCELLABLE = ("pending", "processing")
REFUNDABLE = ("delivered",)
TASK_KINDS = ("status", "total", "cancel", "refund", "address", "cancel_mine", "refund_notify")

# House rules: the stores and the values their procedures are drawn from.
STORES = ("Alder", "Birch", "Cedar", "Maple")
REFUND_REASONS = ("damaged", "faulty", "return", "goodwill")
SIGN_OFFS = ("Thanks!", "Cheers!", "Regards.", "Bye now.")
POLICY_ERROR = "store policy violated"
RECIPE_RULES_SEED = 0  # the packaged recipes' and the demo's rule set


def _fn(name: str, desc: str, **params: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in params.items()},
                       "required": list(params)}}}


TOOLS: list[dict] = [
    _fn("find_customer", "Find a customer by email", email="string"),
    _fn("list_orders", "List a customer's orders", customer_id="integer"),
    _fn("get_order", "Get an order", order_id="integer"),
    _fn("cancel_order", "Cancel a pending order", order_id="integer"),
    _fn("refund_order", "Refund a delivered order", order_id="integer"),
    _fn("update_address", "Set a customer's address", customer_id="integer", address="string"),
    _fn("send_message", "Message a customer", customer_id="integer", text="string"),
]
_SCHEMAS = tool_schemas_by_name(TOOLS)
# With house rules refund_order takes a reason; which reason a store wants is not said anywhere.
TOOLS_HOUSE_RULES: list[dict] = [
    t if t["function"]["name"] != "refund_order" else _fn("refund_order", "Refund a delivered order",
                                                          order_id="integer", reason="string")
    for t in TOOLS]
_SCHEMAS_HOUSE_RULES = tool_schemas_by_name(TOOLS_HOUSE_RULES)


# ---------------------------------------------------------------- house rules

def store_rules(rules_seed: int) -> dict[str, dict[str, Any]]:
    """Each store's procedures for `rules_seed`: {store: {"refund_reason", "verify_first", "sign_off"}}."""
    rng = random.Random(f"orders-house-rules-{rules_seed}")
    return {store: {"refund_reason": rng.choice(REFUND_REASONS), "verify_first": rng.random() < 0.5,
                    "sign_off": rng.choice(SIGN_OFFS)} for store in STORES}


def random_store_rules(rng: random.Random) -> dict[str, dict[str, Any]]:
    """A rule set drawn from `rng` rather than a rules seed (the base policy's reading examples)."""
    return store_rules(rng.randrange(1 << 30))


def task_store(seed: int) -> str:
    """The store a task belongs to (its own stream, so the plain world's tasks stay as they were)."""
    return random.Random(f"orders-store-{seed}").choice(STORES)


# ---------------------------------------------------------------- the world

def _make_db(rng: random.Random) -> dict[str, Any]:
    names = rng.sample(FIRST_NAMES, 3)
    customers, orders, payments = {}, {}, {}
    used_ids: set[int] = set()
    for name in names:
        cid = rng.randrange(10, 100)
        while str(cid) in customers:
            cid = rng.randrange(10, 100)
        customers[str(cid)] = {"name": name.capitalize(), "email": f"{name}{rng.randrange(10, 100)}@mail.com",
                               "address": f"{rng.randrange(1, 100)} {rng.choice(STREETS)}"}
        for _ in range(rng.randrange(1, 4)):
            oid = rng.randrange(1, 10)  # one token for small tokenizers; <= 9 orders per database
            while oid in used_ids:
                oid = rng.randrange(1, 10)
            used_ids.add(oid)
            items = rng.sample(sorted(PRODUCTS), rng.randrange(1, 3))
            total = round(sum(PRODUCTS[i] for i in items), 2)
            status = rng.choice(["pending", "processing", "shipped", "delivered"])
            orders[str(oid)] = {"customer_id": cid, "items": items, "total": total, "status": status}
            payments[str(oid)] = {"amount": total, "status": "captured"}
    return {"customers": customers, "orders": orders, "payments": payments, "messages": []}


def _compact(obj: Any) -> str:
    """Tool output as compact JSON: short observations keep small models' contexts short."""
    return json.dumps(obj, separators=(",", ":"))


def _money(x: float) -> str:
    return f"{x:.2f}"


class OrdersWorld:
    """The database and the tool implementations; every tool returns JSON text."""

    def __init__(self, db: dict[str, Any]):
        self.db = copy.deepcopy(db)

    def call(self, name: str, args: dict[str, Any]) -> str:
        return _compact(getattr(self, f"_t_{name}")(**args))

    def _order(self, order_id: int) -> dict:
        o = self.db["orders"].get(str(order_id))
        if o is None:
            raise KeyError(f"no order {order_id}")
        return o

    def _customer(self, customer_id: int) -> dict:
        c = self.db["customers"].get(str(customer_id))
        if c is None:
            raise KeyError(f"no customer {customer_id}")
        return c

    def _t_find_customer(self, email: str) -> dict:
        for cid, c in self.db["customers"].items():
            if c["email"] == email.strip().lower():
                return {"customer_id": int(cid), "name": c["name"]}
        raise KeyError(f"no customer with email {email}")

    def _t_list_orders(self, customer_id: int) -> list[dict]:
        self._customer(customer_id)
        return [{"order_id": int(oid), "status": o["status"]}
                for oid, o in self.db["orders"].items() if o["customer_id"] == customer_id]

    def _t_get_order(self, order_id: int) -> dict:
        o = self._order(order_id)
        return {"status": o["status"], "total": o["total"], "items": o["items"]}

    def _t_cancel_order(self, order_id: int) -> dict:
        o = self._order(order_id)
        if o["status"] not in CANCELLABLE:
            raise ValueError(f"order {order_id} is {o['status']} and cannot be cancelled")
        o["status"] = "cancelled"
        self.db["payments"][str(order_id)]["status"] = "voided"
        return {"order_id": order_id, "status": "cancelled"}

    def _t_refund_order(self, order_id: int, reason: str = "") -> dict:
        o = self._order(order_id)
        if o["status"] not in REFUNDABLE:
            raise ValueError(f"order {order_id} is {o['status']} and cannot be refunded")
        o["status"] = "refunded"
        pay = self.db["payments"][str(order_id)]
        pay["status"] = "refunded"
        return {"order_id": order_id, "status": "refunded", "amount": pay["amount"]}

    def _t_update_address(self, customer_id: int, address: str) -> dict:
        self._customer(customer_id)["address"] = address.strip()
        return {"customer_id": customer_id, "address": address.strip()}

    def _t_send_message(self, customer_id: int, text: str) -> dict:
        self._customer(customer_id)
        self.db["messages"].append({"customer_id": customer_id, "text": text})
        return {"sent": True}


# ---------------------------------------------------------------- tasks

def _pick_order(rng: random.Random, db: dict, statuses: tuple[str, ...]) -> str | None:
    cands = sorted(oid for oid, o in db["orders"].items() if o["status"] in statuses)
    return rng.choice(cands) if cands else None


def _customer_with_single(db: dict, statuses: tuple[str, ...], rng: random.Random) -> str | None:
    """A customer holding exactly one order in `statuses` (so "my pending order" is unambiguous)."""
    cands = []
    for cid in sorted(db["customers"]):
        mine = [o for o in db["orders"].values() if o["customer_id"] == int(cid) and o["status"] in statuses]
        if len(mine) == 1:
            cands.append(cid)
    return rng.choice(cands) if cands else None


def _build_task(kind: str, rng: random.Random, db: dict) -> dict | None:
    """Instruction, oracle plan (calls + answer) and answer facts for one task kind."""
    if kind in ("status", "total"):
        oid = _pick_order(rng, db, ("pending", "processing", "shipped", "delivered"))
        o = db["orders"][oid]
        fact = o["status"] if kind == "status" else _money(o["total"])
        instr = f"What is the status of order {oid}?" if kind == "status" else f"How much did order {oid} cost?"
        answer = f"Order {oid} is {fact}." if kind == "status" else f"Order {oid} cost {fact}."
        return dict(instruction=instr, plan=[("get_order", {"order_id": int(oid)})], answer=answer, facts=[fact])
    if kind == "cancel":
        oid = _pick_order(rng, db, CANCELLABLE)
        if oid is None:
            return None
        return dict(instruction=f"Please cancel order {oid}.", plan=[("cancel_order", {"order_id": int(oid)})],
                    answer=f"Order {oid} is cancelled.", facts=["cancelled"])
    if kind == "refund":
        oid = _pick_order(rng, db, REFUNDABLE)
        if oid is None:
            return None
        amount = _money(db["orders"][oid]["total"])
        return dict(instruction=f"Order {oid} arrived broken. Please refund it.",
                    plan=[("refund_order", {"order_id": int(oid)})],
                    answer=f"Order {oid} is refunded: {amount}.", facts=[amount])
    if kind == "address":
        cid = rng.choice(sorted(db["customers"]))
        c = db["customers"][cid]
        new = f"{rng.randrange(1, 100)} {rng.choice(STREETS)}"
        while new == c["address"]:
            new = f"{rng.randrange(1, 100)} {rng.choice(STREETS)}"
        return dict(instruction=f"I am {c['email']}. Change my address to {new}.",
                    plan=[("find_customer", {"email": c["email"]}),
                          ("update_address", {"customer_id": int(cid), "address": new})],
                    answer=f"Your address is now {new}.", facts=[])
    if kind in ("cancel_mine", "refund_notify"):
        statuses = CANCELLABLE if kind == "cancel_mine" else REFUNDABLE
        cid = _customer_with_single(db, statuses, rng)
        if cid is None:
            return None
        c = db["customers"][cid]
        oid = next(k for k, o in sorted(db["orders"].items()) if o["customer_id"] == int(cid) and o["status"] in statuses)
        lookup = [("find_customer", {"email": c["email"]}), ("list_orders", {"customer_id": int(cid)})]
        if kind == "cancel_mine":
            return dict(instruction=f"I am {c['email']}. Cancel my pending order.",
                        plan=lookup + [("cancel_order", {"order_id": int(oid)})],
                        answer=f"Order {oid} is cancelled.", facts=[oid])
        amount = _money(db["orders"][oid]["total"])
        return dict(instruction=f"I am {c['email']}. Refund my delivered order and message me.",
                    plan=lookup + [("refund_order", {"order_id": int(oid)}),
                                   ("send_message", {"customer_id": int(cid), "text": f"Order {oid} is refunded."})],
                    answer=f"Order {oid} is refunded: {amount}.", facts=[oid])
    raise ValueError(kind)


def apply_rules(spec: dict, rules: dict[str, Any]) -> dict:
    """The oracle's plan and answer for a task under its store's rules."""
    plan = []
    for name, args in spec["plan"]:
        if name in ("cancel_order", "refund_order") and rules["verify_first"]:
            plan.append(("get_order", {"order_id": args["order_id"]}))
        if name == "refund_order":
            args = {**args, "reason": rules["refund_reason"]}
        plan.append((name, args))
    return {**spec, "plan": plan, "answer": f"{spec['answer']} {rules['sign_off']}"}


def make_task(seed: int, split: str, rules_seed: int | None = None,
              rules: dict[str, dict[str, Any]] | None = None) -> Task | None:
    """The task of `seed`; with `rules_seed` (or an explicit {store: rules}), under house rules."""
    rng = random.Random(seed)
    db = _make_db(rng)
    kind = TASK_KINDS[seed % len(TASK_KINDS)]
    spec = _build_task(kind, rng, db)
    if spec is None:
        return None
    data: dict[str, Any] = {"seed": seed, "kind": kind}
    if rules_seed is not None or rules is not None:
        store = task_store(seed)
        mine = (rules if rules is not None else store_rules(rules_seed))[store]
        spec = apply_rules({**spec, "instruction": f"[{store}] {spec['instruction']}"}, mine)
        data.update(store=store, rules=mine, rules_seed=rules_seed)
    world = OrdersWorld(db)
    for name, args in spec["plan"]:
        world.call(name, args)
    return Task(
        id=f"orders-{split}-{seed - SPLIT_SEED_BASE[split]:05d}",
        instruction=spec["instruction"],
        tools=TOOLS if "rules" not in data else TOOLS_HOUSE_RULES,
        data={**data, "db": db, "expected_db": world.db,
              "plan": [{"name": n, "arguments": a} for n, a in spec["plan"]],
              "answer": spec["answer"], "facts": spec["facts"]},
        split=split,
    )


def generate_tasks(split: str, n: int, exclude: set[str] = frozenset(), rules_seed: int | None = None) -> list[Task]:
    if split not in SPLIT_SEED_BASE:
        raise LopdError(f"orders: unknown split '{split}' (train, validation or test)")
    tasks, seen = [], set(exclude)
    seed = SPLIT_SEED_BASE[split]
    while len(tasks) < n:
        t = make_task(seed, split, rules_seed)
        seed += 1
        if t is not None and task_fingerprint(t) not in seen:
            seen.add(task_fingerprint(t))
            tasks.append(t)
    return tasks


@functools.lru_cache(maxsize=8)
def split_tasks(split: str, sizes: tuple[int, int, int], rules_seed: int | None) -> tuple[Task, ...]:
    """The tasks of `split` when the splits (train, validation, test) have `sizes`: each split
    skips every task an earlier split holds. Kept per process: a run asks for the same splits
    many times, and generating them costs about a millisecond a task. Tasks are not modified
    after they are made (environments copy the database they start from)."""
    seen: set[str] = set()
    for earlier in SPLIT_ORDER[: SPLIT_ORDER.index(split)]:
        seen |= {task_fingerprint(t) for t in split_tasks(earlier, sizes, rules_seed)}
    return tuple(generate_tasks(split, sizes[SPLIT_ORDER.index(split)], seen, rules_seed))


def task_fingerprint(task: Task) -> str:
    """Instruction + starting database: two tasks are the same task when both match."""
    return task.instruction + json.dumps(task.data["db"], sort_keys=True)


# ---------------------------------------------------------------- checklist reward

def final_answer(transcript: list[dict]) -> str:
    """The last assistant turn without tool calls ('' when the episode ended on a call)."""
    for m in reversed(transcript):
        if m.get("role") == "assistant":
            return "" if m.get("tool_calls") else (m.get("content") or "")
    return ""


def checklist(task: Task, db: dict, answer: str) -> list[tuple[str, bool]]:
    """(item, holds) for each checklist item of a task, given the final database and answer."""
    start, want = task.data["db"], task.data["expected_db"]
    items: list[tuple[str, bool]] = []
    changed_keys = set()
    for table in ("customers", "orders", "payments"):
        for key, row in want[table].items():
            if row != start[table].get(key):
                changed_keys.add((table, key))
                items.append((f"{table} {key} updated", db[table].get(key) == row))
    if want["messages"]:
        for msg in want["messages"]:
            items.append((f"customer {msg['customer_id']} messaged",
                          any(m["customer_id"] == msg["customer_id"] for m in db["messages"])))
    if changed_keys or want["messages"]:
        untouched = all(db[t].get(k) == start[t].get(k) for t in ("customers", "orders", "payments")
                        for k in start[t] if (t, k) not in changed_keys)
        items.append(("nothing else changed", untouched))
    low = answer.lower()
    for fact in task.data["facts"]:
        items.append((f"answer states {fact}", str(fact).lower() in low))
    if "rules" in task.data:
        items.append(("answer follows store policy", task.data["rules"]["sign_off"].lower() in low))
    return items


def checklist_reward(task: Task, db: dict, transcript: list[dict]) -> float:
    items = checklist(task, db, final_answer(transcript))
    return sum(ok for _, ok in items) / len(items) if items else 0.0


# ---------------------------------------------------------------- the environment

def breaks_store_policy(rules: dict[str, Any], call: ToolCall, looked_up: set[int]) -> bool:
    """Whether `call` breaks one of the store's procedures (checked before the tool runs)."""
    if call.name not in ("cancel_order", "refund_order"):
        return False
    if rules["verify_first"] and call.arguments.get("order_id") not in looked_up:
        return True
    return call.name == "refund_order" and str(call.arguments.get("reason", "")).strip().lower() != rules["refund_reason"]


class OrdersEnv:
    """The orders world as an Environment (one instance per live episode)."""

    name = "orders"

    def __init__(self, n_train: int = DEFAULT_SIZES["train"], n_validation: int = DEFAULT_SIZES["validation"],
                 n_test: int = DEFAULT_SIZES["test"], system_prompt: str = SYSTEM_PROMPT,
                 house_rules: bool = False, rules_seed: int = RECIPE_RULES_SEED):
        self.sizes = {"train": n_train, "validation": n_validation, "test": n_test}
        self.system_prompt = system_prompt
        self.rules_seed = rules_seed if house_rules else None
        self.task: Task | None = None
        self.world: OrdersWorld | None = None
        self.looked_up: set[int] = set()  # orders read with get_order this episode (verify_first)

    def tasks(self, split: str) -> list[Task]:
        if split not in self.sizes:
            raise LopdError(f"orders: unknown split '{split}' (train, validation or test)")
        return list(split_tasks(split, tuple(self.sizes[s] for s in SPLIT_ORDER), self.rules_seed))

    def reset(self, task: Task) -> list[dict]:
        self.task = task
        self.world = OrdersWorld(task.data["db"])
        self.looked_up = set()
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task.instruction}]

    def step(self, call: ToolCall) -> str:
        assert self.world is not None and self.task is not None, "reset() first"
        rules = self.task.data.get("rules")
        schemas = _SCHEMAS if rules is None else _SCHEMAS_HOUSE_RULES
        problem = check_arguments(schemas[call.name], call.arguments) if call.name in schemas else f"unknown tool '{call.name}'"
        if problem:
            return _compact({"error": problem})
        if rules is not None and breaks_store_policy(rules, call, self.looked_up):
            return _compact({"error": POLICY_ERROR})
        try:
            out = self.world.call(call.name, call.arguments)
        except (KeyError, ValueError) as e:
            return _compact({"error": str(e).strip("'\"")})
        if call.name == "get_order":
            self.looked_up.add(call.arguments["order_id"])
        return out

    def done(self) -> bool:
        return False

    def rule_strings(self, instruction: str) -> list[str]:
        """The texts that carry the house rules of an instruction's store (its refund reason and
        sign-off): how `lopd coldstart`'s check tells rule tokens from the others."""
        if self.rules_seed is None or not instruction.startswith("["):
            return []
        rules = store_rules(self.rules_seed).get(instruction[1:].split("]", 1)[0])
        return [rules["refund_reason"], rules["sign_off"]] if rules else []

    def reward(self, transcript: list[dict]) -> float:
        assert self.task is not None and self.world is not None, "reset() first"
        return checklist_reward(self.task, self.world.db, transcript)

    def feedback(self, transcript: list[dict]) -> str | None:
        """The checklist items the episode missed (what SDPO's teacher reads on a failure); None: all met."""
        assert self.task is not None and self.world is not None, "reset() first"
        missed = [item for item, ok in checklist(self.task, self.world.db, final_answer(transcript)) if not ok]
        return "Not done: " + "; ".join(missed) + "." if missed else None


# ---------------------------------------------------------------- the scripted oracle

def oracle_plan(task: Task) -> tuple[list[ToolCall], str]:
    """The calls (in order) and the final answer that solve a task."""
    calls = [ToolCall(name=c["name"], arguments=dict(c["arguments"]), id=f"call_{i}")
             for i, c in enumerate(task.data["plan"])]
    return calls, task.data["answer"]
