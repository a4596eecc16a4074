"""A reward plugin: `score(task, transcript) -> float` in [0, 1].

lopd calls it once per finished episode with the Task and the OpenAI-format transcript
(system, user, assistant turns with `tool_calls`, `tool` results). Returning a value outside
[0, 1] or a non-number is reported as an error naming this plugin.
"""

from __future__ import annotations

import json


def _calls(transcript):
    for m in transcript:
        for tc in m.get("tool_calls") or []:
            f = tc["function"]
            yield f["name"], json.loads(f["arguments"])


def score(task, transcript) -> float:
    data = task.data
    final = next((m.get("content") or "" for m in reversed(transcript)
                  if m["role"] == "assistant" and not m.get("tool_calls")), "")
    if data["kind"] == "set":
        set_ok = any(name == "set_temperature" and args.get("room") == data["room"]
                     and args.get("celsius") == data["target"] for name, args in _calls(transcript))
        return 1.0 if set_ok else 0.0
    looked = any(name == "get_temperature" and args.get("room") == data["room"] for name, args in _calls(transcript))
    said = str(data["answer"]) in final
    return (looked + said) / 2
