"""Does a base policy know a rule set by heart? (RESULTS.md, "Base policy v7")

Without any reference, the policy scores the clean oracle transcripts of validation tasks of the
house-rules orders world under three rule sets: the recipes' (0), the one base policy v6
learned (101) and one never used (7). It prints the NLL per rule token (refund reason, sign-off),
per first rule token (the choice among four: ln 4 = 1.39 nats is a guess) and per other action
token. A policy that knows one rule set by heart gives that set's first tokens ~0 nats and the
others many nats; one with a spread prior gives all three about ln 4. What it simplifies: one
seed, teacher-forced scoring, 48 tasks.

    python benchmarks/rule_prior.py [MODEL_DIR]   # default: the shipped base policy
"""

from __future__ import annotations

import random
import sys

import torch

from lopd_cli.agent.chat import tokenize_transcript
from lopd_cli.envs.orders import OrdersEnv, make_task
from lopd_cli.envs.orders_agent import noisy_oracle_transcript
from lopd_cli.models.backbone import load_backbone
from lopd_cli.runtime import setup_torch
from lopd_cli.train.base_policy import SHIPPED_DIR, mark_rule_tokens

RULE_SEEDS = (0, 101, 7)


def rule_prior(path: str, n_tasks: int = 48) -> dict[int, dict[str, float]]:
    """{rules_seed: {"rule", "first", "other": mean NLL}} without references, on validation tasks."""
    setup_torch()
    model, tok = load_backbone(path, device="cpu")
    tasks = OrdersEnv(house_rules=True, rules_seed=0).tasks("validation")[:n_tasks]
    out = {}
    for rules_seed in RULE_SEEDS:
        sums = {k: [0.0, 0] for k in ("rule", "first", "other")}
        for t in tasks:
            t = make_task(t.data["seed"], "validation", rules_seed=rules_seed)
            ids, mask = tokenize_transcript(tok, noisy_oracle_transcript(t, random.Random(0), 0.0), t.tools)
            mask = mark_rule_tokens(tok, ids, mask, t.data["rules"])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
            nll = -logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
            for j, m in enumerate(mask[1:]):  # mask[j + 1] marks the token position j predicts
                if m == 2:
                    keys = ["rule", "first"] if mask[j] != 2 else ["rule"]
                else:
                    keys = ["other"] if m == 1 else []
                for k in keys:
                    sums[k][0] += nll[j].item()
                    sums[k][1] += 1
        out[rules_seed] = {k: s / max(1, n) for k, (s, n) in sums.items()}
    return out


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else str(SHIPPED_DIR)
    for rules_seed, nll in rule_prior(path).items():
        print(f"rules_seed {rules_seed:>3}: rule {nll['rule']:.3f}  first rule token {nll['first']:.3f}  "
              f"other {nll['other']:.3f}  (nats/token)")
