"""The before-training check (`lopd_cli.train.check`): gaps, partners, rule tokens, and the
check on held-out validation successes of the house-rules world, end to end on tiny."""

from __future__ import annotations

import math

import pytest

from lopd_cli.train.check import other_task_partners, paired_gap, rule_token_mask, verdict_lines


def test_paired_gap_mean_and_interval():
    g = paired_gap([2.0, 3.0, 4.0, 5.0], [1.0, 1.0, 1.0, 1.0])
    assert g.mean == pytest.approx(2.5) and g.n == 4
    sd = math.sqrt(sum((x - 2.5) ** 2 for x in (1, 2, 3, 4)) / 3)
    assert g.hi - g.mean == pytest.approx(1.96 * sd / 2) and g.above_zero
    assert not paired_gap([1.0, 2.0], [1.5, 1.5]).above_zero  # differences +-0.5: 0 inside
    assert paired_gap([float("nan"), 2.0, 3.0], [0.0, 1.0, 1.0]).n == 2  # no rule token there: skipped


def test_other_task_partners_share_no_reference():
    refs = [{1, 2}, {2, 3}, {7, 8}, {1, 9}, {10}]
    partners = other_task_partners(refs)
    for i, j in enumerate(partners):
        assert j != i and not refs[i] & refs[j]
    assert other_task_partners([{1}, {1}]) == [0, 1]  # nobody to borrow from: itself
    groups = ["a", "a", "b", "a", "b"]
    for i, j in enumerate(other_task_partners(refs, groups)):
        assert groups[j] != groups[i] and not refs[i] & refs[j]


def test_rule_token_mask_marks_action_tokens_that_carry_a_rule():
    from lopd_cli.agent.chat import tokenize_transcript
    from lopd_cli.models.backbone import load_backbone

    _, tok = load_backbone("tiny", device="cpu")
    msgs = [{"role": "system", "content": "Be brief. Cheers!"}, {"role": "user", "content": "[Alder] Status of 3?"},
            {"role": "assistant", "content": "Order 3 is pending. Cheers!"}]
    ids, mask = tokenize_transcript(tok, msgs, None)
    marks = rule_token_mask(tok, ids, mask, ["Cheers!"])
    assert len(marks) == sum(mask) and any(marks) and not all(marks)
    action = [t for t, m in zip(ids, mask) if m]
    rule_text = "".join(tok.decode([t]) for t, hit in zip(action, marks) if hit)
    assert "Cheers" in rule_text and "pending" not in rule_text  # the system prompt's copy is no action
    assert not any(rule_token_mask(tok, ids, mask, ["faulty"]))


def test_verdicts_need_the_whole_interval_above_zero():
    from lopd_cli.train.check import Gap

    yes, no = Gap(0.3, 0.1, 0.5, 20), Gap(0.05, -0.02, 0.12, 20)
    lines = verdict_lines({"none-text": yes, "none-learned": no, "other-learned": yes}, 0.2)
    assert lines[0].startswith("Does a teacher beat the student? only with text") and "yes:" in lines[1]
    assert "another coldstart.seed" in lines[0]  # what to do about it
    lines = verdict_lines({"none-text": no, "none-learned": no, "other-learned": no}, 0.001)
    assert "no:" in lines[0] and "fixed soft prompt" in lines[1]


def test_orders_rule_strings_name_the_stores_rules():
    from lopd_cli.envs.orders import OrdersEnv, store_rules

    env = OrdersEnv(house_rules=True, rules_seed=3)
    r = store_rules(3)["Cedar"]
    assert env.rule_strings("[Cedar] Please cancel order 4.") == [r["refund_reason"], r["sign_off"]]
    assert OrdersEnv().rule_strings("[Cedar] Please cancel order 4.") == []


@pytest.mark.slow
def test_check_on_validation_successes_gives_distinct_finite_nlls(tmp_path, lopd):
    """`lopd coldstart` on a bank holding train and validation successes holds out the
    validation tasks and ends with the check: every mode finite, all different, rule tokens split."""
    import json

    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.envs.orders_agent import scripted_agent_records

    assert lopd("init", "p", "--example", "orders", "--model", "tiny", "--no-base-policy", cwd=tmp_path).code == 0
    project = tmp_path / "p"
    env = OrdersEnv(n_train=24, n_validation=8, house_rules=True, rules_seed=0)
    logs = tmp_path / "logs.jsonl"
    recs = scripted_agent_records(env.tasks("train") + env.tasks("validation"), noise=0.0)
    logs.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert lopd("bank", "add-rollouts", str(logs), cwd=project).code == 0
    sets = ["env.kwargs={n_train: 24, n_validation: 8, house_rules: true, rules_seed: 0}", "coldstart.steps=2",
            "coldstart.batch_size=4", "composer.num_queries=2", "composer.depth=1", "composer.max_item_tokens=96",
            "bank.n_retrieve=2", "coldstart.anchor_cache_tasks=0"]
    assert lopd("bank", "index", cwd=project).code == 0
    r = lopd("coldstart", "--recipe", "toolcall", "--json", *sum((["--set", s] for s in sets), []), cwd=project)
    assert r.code == 0, r
    s = json.loads(r.out)
    assert s["val_examples"] == 8  # the 8 validation tasks, none of them trained on
    check = s["check"]
    alls = [check["nll"][m]["all"] for m in ("none", "learned", "other", "text")]
    assert all(math.isfinite(x) and x > 0 for x in alls) and len(set(alls)) == 4, check
    assert all(check["nll"][m]["rule"] is not None for m in ("none", "learned", "other", "text"))
    assert check["nll"]["none"]["rule"] != check["nll"]["none"]["other_tokens"]
    assert 0 <= check["task_spread"] and len(check["verdicts"]) == 2
    assert check["gaps"]["none-text"]["n"] == 8
    plain = lopd("coldstart", "--recipe", "toolcall", "--run", "cs2", *sum((["--set", s] for s in sets), []),
                 cwd=project)
    assert plain.code == 0 and "Will LOPD help here?" in plain.out and "Does a teacher beat the student?" in plain.out
