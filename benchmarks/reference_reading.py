"""Does a base policy read a house rule off a reference? (RESULTS.md, "House rules")

For validation tasks of the house-rules orders world re-drawn under a *random* rule set, the
policy scores the clean oracle transcript with and without 1-2 solved same-store, same-kind
references (under the same rules) in the teachers' reference frame, and this prints the NLL of
the rule tokens (refund reason, sign-off) and of the first token of each rule: the choice among
four (ln 4 = 1.39 nats is a guess). What it simplifies: one seed, teacher-forced scoring.

    python benchmarks/reference_reading.py [MODEL_DIR]   # default: the shipped base policy
"""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import torch

from lopd_cli.agent.chat import tokenize_transcript
from lopd_cli.envs.orders import OrdersEnv, make_task, random_store_rules
from lopd_cli.envs.orders_agent import noisy_oracle_transcript
from lopd_cli.models.backbone import load_backbone
from lopd_cli.runtime import setup_torch
from lopd_cli.train.base_policy import SHIPPED_DIR, with_text_references
from lopd_cli.train.check import rule_token_mask


def main(path: str) -> dict:
    setup_torch()
    model, tok = load_backbone(path, device="cpu")
    tasks = OrdersEnv(house_rules=True, rules_seed=0, n_validation=64).tasks("validation")
    pool: dict = {}
    for t in tasks:
        pool.setdefault((t.data["kind"], t.data["store"]), []).append(t)
    rng, clean = random.Random(3), random.Random(0)
    sums = {"without": [0.0, 0, 0.0, 0], "with": [0.0, 0, 0.0, 0]}  # rule nll, n, first-token nll, n
    for t in tasks:
        others = [o for o in pool[(t.data["kind"], t.data["store"])] if o.instruction != t.instruction]
        if not others:
            continue
        rules = random_store_rules(rng)
        task = make_task(t.data["seed"], "validation", rules=rules)
        refs = [SimpleNamespace(instruction=o.instruction, messages=noisy_oracle_transcript(o, clean, 0.0))
                for o in (make_task(x.data["seed"], "validation", rules=rules) for x in others)]
        plain = noisy_oracle_transcript(task, clean, 0.0)
        r = task.data["rules"]
        for key, msgs in (("without", plain), ("with", with_text_references(plain, refs, rng, 2))):
            ids, mask = tokenize_transcript(tok, msgs, task.tools)
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
            nll = [-lp[i - 1, ids[i]].item() for i, m in enumerate(mask) if m]
            marks = rule_token_mask(tok, ids, mask, [r["refund_reason"], r["sign_off"]])
            s, prev = sums[key], False
            for x, m in zip(nll, marks):
                if m:
                    s[0] += x
                    s[1] += 1
                    if not prev:
                        s[2] += x
                        s[3] += 1
                prev = m
    out = {k: {"rule_nll": v[0] / v[1], "first_rule_token_nll": v[2] / v[3], "rules": v[3]} for k, v in sums.items()}
    print(out)
    return out


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(SHIPPED_DIR))
