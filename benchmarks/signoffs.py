"""Which sign-off does each store's answer end with? (RESULTS.md, "House rules")

Reads rollout JSONL written by `lopd eval --rollouts FILE` on the house-rules orders world and
counts, per store, answers ending with the store's sign-off under the recipes' rules
(`orders.RECIPE_RULES_SEED`), with the base policy's (`BASE_POLICY_RULES_SEED`), another one, or
none, beside the store's successes. What it simplifies: the sign-off is looked up anywhere in the
last assistant message.

    python benchmarks/signoffs.py ROLLOUTS.jsonl [...]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from lopd_cli.envs.orders import RECIPE_RULES_SEED, SIGN_OFFS, store_rules
from lopd_cli.train.base_policy import BASE_POLICY_RULES_SEED


def count_signoffs(lines: list[str]) -> dict[str, dict[str, int]]:
    """{store: {"tasks", "success", "recipe", "base", "other", "none"}} over rollout records."""
    recipe, base = store_rules(RECIPE_RULES_SEED), store_rules(BASE_POLICY_RULES_SEED)
    out: dict[str, Counter] = {}
    for line in lines:
        r = json.loads(line)
        store = r["instruction"][1:].split("]", 1)[0]
        answer = next((m.get("content") or "" for m in reversed(r["messages"]) if m["role"] == "assistant"), "")
        said = next((s for s in SIGN_OFFS if s in answer), None)
        kind = ("none" if said is None else "recipe" if said == recipe[store]["sign_off"]
                else "base" if said == base[store]["sign_off"] else "other")
        c = out.setdefault(store, Counter())
        c.update(tasks=1, success=int(r["reward"] >= 1.0), **{kind: 1})
    return {s: {k: c.get(k, 0) for k in ("tasks", "success", "recipe", "base", "other", "none")}
            for s, c in sorted(out.items())}


def main(paths: list[str]) -> None:
    for p in paths:
        print(p)
        for store, c in count_signoffs(Path(p).read_text().splitlines()).items():
            print(f"  {store}: {c}")


if __name__ == "__main__":
    main(sys.argv[1:])
