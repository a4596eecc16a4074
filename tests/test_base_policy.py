"""The tiny orders base policy: shipped as package data, rebuilt from its seed by
`make base-policy` (python -m lopd_cli.train.base_policy), copied into projects by init."""

from __future__ import annotations

import json

import pytest

from lopd_cli.envs.orders import RECIPE_RULES_SEED
from lopd_cli.train.base_policy import (
    POLICY_VERSION, SHIPPED_DIR, main, shipped_base_policy, tensors_sha256)


def test_the_shipped_policy_is_current_and_matches_its_manifest():
    assert shipped_base_policy() == SHIPPED_DIR
    manifest = json.loads((SHIPPED_DIR / "lopd_model.json").read_text())
    assert manifest["version"] == POLICY_VERSION and manifest["weights_dtype"] == "float16"
    assert manifest["weights_sha256"] == tensors_sha256(SHIPPED_DIR)
    assert manifest["rules_seed"] != RECIPE_RULES_SEED  # the recipes' house rules are new to it


def test_init_copies_the_shipped_policy(lopd, tmp_path):
    assert lopd("init", "p", "--example", "orders", "--model", "tiny", cwd=tmp_path).code == 0
    base = tmp_path / "p" / "models" / "base"
    assert tensors_sha256(base) == tensors_sha256(SHIPPED_DIR)
    assert "backbone: ../models/base" in (tmp_path / "p" / "recipes" / "toolcall.yaml").read_text()


def test_a_short_build_still_runs_and_is_reproducible(tmp_path, capsys):
    out = tmp_path / "policy"
    assert main(["--steps", "3", "--tasks", "24", "--spread-steps", "2", "--copy-steps", "2", "--out", str(out)]) == 0
    manifest = json.loads((out / "lopd_model.json").read_text())
    assert manifest["steps"] == 3 and manifest["n_tasks"] == 24 and manifest["version"] == POLICY_VERSION
    assert manifest["spread_phase"] == {"steps": 2, "lr": 1e-3, "n_tasks": 48, "plain_rules": "random"}
    assert manifest["copy_phase"] == {"steps": 2, "lr": 3e-3, "n_tasks": 48, "plain_rules": "random", "copies": True}
    assert "base policy: step 7/7" in capsys.readouterr().out
    from lopd_cli.models.backbone import load_backbone

    model, tok = load_backbone(str(out), device="cpu")
    assert model.dtype.is_floating_point and len(tok) == model.get_input_embeddings().weight.shape[0]
    # Bit for bit: the same build again has the same weights' hash.
    assert main(["--steps", "3", "--tasks", "24", "--spread-steps", "2", "--copy-steps", "2", "--out", str(out),
                 "--check"]) == 0
    assert "identical" in capsys.readouterr().out


def test_reading_examples_mark_a_rule_their_reference_shows():
    """House-rules reading examples: the rule tokens the policy writes (weighted in its loss)
    spell a sign-off (and refund reason) that the references in the frame show, under a rule
    set drawn for that example; plain examples follow the policy's own rules."""
    import random

    from lopd_cli.compose.latent import FRAMING_AFTER, FRAMING_BEFORE
    from lopd_cli.envs.orders import SIGN_OFFS, store_rules
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.train.base_policy import BASE_POLICY_RULES_SEED, _examples, base_policy_tasks

    _, tok = load_backbone("tiny", device="cpu")
    tasks = base_policy_tasks(60)
    own = store_rules(BASE_POLICY_RULES_SEED)
    framed = _examples(tok, tasks, random.Random(2), noise=0.0, reference_fraction=1.0)
    plain = _examples(tok, tasks, random.Random(2), noise=0.0, reference_fraction=0.0)
    n_read, differs = 0, 0
    for task, (ids, mask), (pids, pmask) in zip(tasks, framed, plain):
        marked = "".join(tok.decode([t]) for t, m in zip(pids, pmask) if m == 2)
        assert marked.endswith(own[task.data["store"]]["sign_off"])
        text = tok.decode(ids)
        if FRAMING_BEFORE.strip() not in text:
            continue
        n_read += 1
        refs = text.split(FRAMING_BEFORE.strip())[1].split(FRAMING_AFTER.strip())[0]
        marked = "".join(tok.decode([t]) for t, m in zip(ids, mask) if m == 2)
        sign_off = next(s for s in SIGN_OFFS if marked.endswith(s))
        assert sign_off in refs
        differs += sign_off != own[task.data["store"]]["sign_off"]
    assert n_read >= len(tasks) // 2 and differs > 0


def test_spread_phase_examples_draw_plain_rules_at_random():
    """Phase 2 of the build (`plain_rules="random"`): plain examples, with no reference to read,
    follow rule sets drawn per example, so one store's examples show several sign-offs and the
    policy cannot learn one rule set by heart; the default keeps the policy's own rules."""
    import random

    from lopd_cli.envs.orders import SIGN_OFFS, store_rules
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.train.base_policy import BASE_POLICY_RULES_SEED, _examples, base_policy_tasks

    _, tok = load_backbone("tiny", device="cpu")
    tasks = base_policy_tasks(48)
    own = store_rules(BASE_POLICY_RULES_SEED)

    def sign_offs(plain_rules: str) -> list[tuple[str, str]]:
        out = []
        for task, (ids, mask) in zip(tasks, _examples(tok, tasks, random.Random(3), noise=0.0,
                                                      plain_rules=plain_rules)):
            marked = "".join(tok.decode([t]) for t, m in zip(ids, mask) if m == 2)
            out.append((task.data["store"], next(s for s in SIGN_OFFS if marked.endswith(s))))
        return out

    assert all(s == own[store]["sign_off"] for store, s in sign_offs("own"))
    spread = sign_offs("random")
    assert sum(s != own[store]["sign_off"] for store, s in spread) >= len(spread) // 2
    by_store: dict[str, set] = {}
    for store, s in spread:
        by_store.setdefault(store, set()).add(s)
    assert all(len(v) >= 2 for v in by_store.values())


def test_the_shipped_policy_knows_no_rule_set_by_heart():
    """Version 7's point, kept by version 8 (benchmarks/rule_prior.py on validation tasks):
    without a reference, the first token of a rule costs about a guess among four under the
    recipes' rule set, the one phase 1 trained on and a never-used one alike. Version 6 gave
    10 nats vs 0.01."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from rule_prior import rule_prior

    firsts = [nll["first"] for nll in rule_prior(str(SHIPPED_DIR), n_tasks=16).values()]
    assert all(0.4 < f < 2.5 for f in firsts), firsts
    assert max(firsts) - min(firsts) < 1.0, firsts


@pytest.mark.slow
def test_the_shipped_policy_copies_the_email_of_a_look_up(lopd, tmp_path):
    """Version 8's point: asked "I am EMAIL. …", its first call looks up that e-mail. Of the 48
    look-ups among 128 validation tasks (greedy) version 8 copies 15 exactly, version 7 copied 5
    (benchmarks/history/2026-12-05-base-policy-v8.md)."""
    import re

    assert lopd("init", "p", "--example", "orders", "--model", "tiny", cwd=tmp_path).code == 0
    r = lopd("eval", "--recipe", "toolcall", "--split", "validation", "-n", "128", "--set",
             "env.kwargs.n_validation=128", "--set", "rollout.max_turns=1", "--rollouts", tmp_path / "r.jsonl",
             cwd=tmp_path / "p")
    assert r.code == 0, r
    asked, copied = 0, 0
    for line in (tmp_path / "r.jsonl").read_text().splitlines():
        rec = json.loads(line)
        m = re.search(r"I am (\S+@mail\.com)\.", rec["instruction"])
        if not m:
            continue
        asked += 1
        calls = [c["function"] for msg in rec["messages"] if msg["role"] == "assistant"
                 for c in msg.get("tool_calls") or []]
        if calls and calls[0]["name"] == "find_customer":
            try:
                copied += json.loads(calls[0]["arguments"]).get("email") == m.group(1)
            except ValueError:
                pass
    assert asked >= 40, asked
    assert copied >= 12, (copied, asked)
