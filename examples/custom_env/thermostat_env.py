"""A user's own world for lopd: a smart-home thermostat with two tools.

Copy this folder to start your own: an environment class (this file), a reward plugin
(my_rewards.py) and a recipe (recipe.yaml) that names both by file path.
"""

from __future__ import annotations

import json
import random

ROOMS = ["kitchen", "bedroom", "office", "hall", "bath"]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_temperature", "description": "Current temperature of a room in C",
        "parameters": {"type": "object", "properties": {"room": {"type": "string"}}, "required": ["room"]}}},
    {"type": "function", "function": {
        "name": "set_temperature", "description": "Set a room's target temperature in C",
        "parameters": {"type": "object",
                       "properties": {"room": {"type": "string"}, "celsius": {"type": "integer"}},
                       "required": ["room", "celsius"]}}},
]


class ThermostatEnv:
    """Implements lopd's Environment protocol: tasks, reset, step, done, reward."""

    name = "thermostat"

    def __init__(self, n_tasks: int = 40):
        self.n_tasks = n_tasks
        self.temps: dict[str, int] = {}
        self.targets: dict[str, int] = {}

    def tasks(self, split: str):
        from lopd_cli.agent.types import Task  # the only lopd import a plugin needs

        offset = {"train": 0, "validation": 10_000, "test": 20_000}[split]
        out = []
        for i in range(self.n_tasks):
            rng = random.Random(offset + i)
            temps = {room: rng.randrange(15, 26) for room in ROOMS}
            room = rng.choice(ROOMS)
            if i % 2 == 0:
                target = rng.randrange(17, 24)
                instruction = f"Set the {room} to {target} degrees."
                data = {"temps": temps, "kind": "set", "room": room, "target": target}
            else:
                instruction = f"How warm is the {room}?"
                data = {"temps": temps, "kind": "get", "room": room, "answer": temps[room]}
            out.append(Task(id=f"thermostat-{split}-{i:03d}", instruction=instruction, tools=TOOLS, data=data, split=split))
        return out

    def reset(self, task):
        self.temps = dict(task.data["temps"])
        self.targets = {}
        return [{"role": "system", "content": "You control a thermostat. Use the tools, then answer briefly."},
                {"role": "user", "content": task.instruction}]

    def step(self, call):
        room = call.arguments.get("room")
        if room not in self.temps:
            return json.dumps({"error": f"unknown room {room!r}"})
        if call.name == "get_temperature":
            return json.dumps({"room": room, "celsius": self.temps[room]})
        if call.name == "set_temperature":
            self.targets[room] = int(call.arguments["celsius"])
            return json.dumps({"room": room, "target": self.targets[room]})
        return json.dumps({"error": f"unknown tool {call.name}"})

    def done(self):
        return False

    def reward(self, transcript):
        # Used only when the recipe names no reward plugin; my_rewards.score replaces it here.
        return 0.0
