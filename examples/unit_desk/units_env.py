"""A unit-conversion help desk: an environment whose tasks are plain dicts, no lopd classes.

tasks() returns mappings with the protocol's keys (id, instruction, tools, data); lopd turns
them into its Task, and hands this env's reset() the very dict it returned. `step` receives a
`lopd_cli.agent.types.ToolCall` (name, arguments, id).
"""

from __future__ import annotations

import json

FACTORS = {("km", "mi"): 0.621371, ("mi", "km"): 1.609344, ("kg", "lb"): 2.204623, ("lb", "kg"): 0.453592}

TOOLS = [{"type": "function", "function": {
    "name": "convert", "description": "Convert a value between units (km, mi, kg, lb)",
    "parameters": {"type": "object", "properties": {
        "value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
        "required": ["value", "from_unit", "to_unit"]}}}]


class UnitDeskEnv:
    name = "unit-desk"

    def __init__(self, n_tasks: int = 24):
        self.n_tasks = n_tasks
        self.task: dict = {}

    def tasks(self, split: str) -> list[dict]:
        offset = {"train": 0, "validation": 1000, "test": 2000}[split]
        pairs = list(FACTORS)
        out = []
        for i in range(self.n_tasks):
            src, dst = pairs[i % len(pairs)]
            value = 5 + (offset + 7 * i) % 90
            answer = round(value * FACTORS[(src, dst)], 2)
            out.append({"id": f"units-{split}-{i:03d}", "instruction": f"How many {dst} is {value} {src}?",
                        "tools": TOOLS, "data": {"answer": answer}})
        return out

    def reset(self, task: dict) -> list[dict]:
        self.task = task
        return [{"role": "system", "content": "You are a unit-conversion desk. Use the convert tool, then answer."},
                {"role": "user", "content": task["instruction"]}]

    def step(self, call) -> str:
        if call.name != "convert":
            return json.dumps({"error": f"unknown tool {call.name}"})
        args = call.arguments
        factor = FACTORS.get((args.get("from_unit"), args.get("to_unit")))
        if factor is None or not isinstance(args.get("value"), (int, float)):
            return json.dumps({"error": "unsupported conversion"})
        return json.dumps({"result": round(args["value"] * factor, 2)})

    def done(self) -> bool:
        return False

    def reward(self, transcript: list[dict]) -> float:
        final = next((m.get("content") or "" for m in reversed(transcript)
                      if m["role"] == "assistant" and not m.get("tool_calls")), "")
        return 1.0 if str(self.task["data"]["answer"]) in final else 0.0
