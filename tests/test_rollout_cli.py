"""`lopd rollout` from a user's point of view: JSONL the bank accepts, plugins, failures."""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_env" / "recipe.yaml"


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture
def project(lopd, tmp_path):
    assert lopd("init", "p", "--no-base-policy", cwd=tmp_path).code == 0
    return tmp_path / "p"


def test_example_plugin_runs_in_a_fresh_project_and_feeds_the_bank(lopd, project):
    r = lopd("rollout", "--recipe", str(EXAMPLE), "-n", "4", "--out", "thermo.jsonl", "--json", cwd=project)
    assert r.code == 0, r
    summary = json.loads(r.out)
    assert summary["episodes"] == 4 and summary["errors"] == 0
    recs = lines(project / "thermo.jsonl")
    assert len(recs) == 4 and recs[0]["task_id"] == "thermostat-train-000"
    assert recs[0]["messages"][0]["role"] == "system" and recs[0]["meta"]["env"] == "thermostat"
    assert all(0.0 <= x["reward"] <= 1.0 for x in recs)
    added = lopd("bank", "add-rollouts", "thermo.jsonl", "--min-reward", "0", cwd=project)
    assert added.code == 0, added


def test_orders_rollout_to_bank_and_summary(lopd, project):
    r = lopd("rollout", "--recipe", "toolcall", "-n", "3", "--split", "test", "--to-bank", "--json",
             "--set", "rollout.max_new_tokens=8", cwd=project)
    assert r.code == 0, r
    s = json.loads(r.out)
    for key in ("success_rate", "mean_reward", "tool_calls", "repeated_tool_calls", "invalid_tool_calls", "first_turn_tokens"):
        assert key in s
    assert s["first_turn_tokens"] <= 8 and Path(s["out"]).is_file() and "bank" in s
    recs = lines(Path(s["out"]))
    assert [x["task_id"] for x in recs] == ["orders-test-00000", "orders-test-00001", "orders-test-00002"]
    assert (project / "bank.sqlite").exists()


def test_a_reward_plugin_that_returns_nonsense_is_named(lopd, project, tmp_path):
    (tmp_path / "bad_reward.py").write_text("def score(task, transcript):\n    return 7\n")
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(EXAMPLE.read_text().replace("reward: my_rewards.py:score", "reward: bad_reward.py:score")
                      .replace("class: thermostat_env.py", f"class: {EXAMPLE.parent}/thermostat_env.py"))
    r = lopd("rollout", "--recipe", str(recipe), "-n", "2", "--set", "rollout.max_new_tokens=4", cwd=project)
    assert r.code == 1 and "bad_reward.py:score" in r.err and "[0, 1]" in r.err, r


@pytest.mark.slow
def test_tiny_base_policy_has_the_skill_but_no_house_rules(lopd, tmp_path):
    """`lopd init` copies the shipped tiny orders base policy (v8). In the plain world (no house
    rules) it succeeds on some but not most test tasks (greedy): it has the tool-use skill. Under
    house rules it succeeds less often, under the recipe's rules and under the rule set its first
    build phase used (rules_seed 101) alike: what it lacks is the stores' rules, and it knows no
    rule set by heart (tests/test_base_policy.py checks the prior directly)."""
    from lopd_cli.train.base_policy import BASE_POLICY_RULES_SEED

    assert lopd("init", "p", "--example", "orders", "--model", "tiny", cwd=tmp_path).code == 0
    project = tmp_path / "p"
    assert (project / "models" / "base" / "config.json").is_file()
    assert "backbone: ../models/base" in (project / "recipes" / "toolcall.yaml").read_text()

    def success(*sets: str) -> float:
        r = lopd("eval", "--recipe", "toolcall", "--split", "test", "-n", "64", "--json", *sets, cwd=project)
        assert r.code == 0, r
        return json.loads(r.out)["models"][0]["success"]["mean"]

    plain = success("--set", "env.kwargs={house_rules: false}")
    phase1 = success("--set", f"env.kwargs={{house_rules: true, rules_seed: {BASE_POLICY_RULES_SEED}}}")
    new = success()
    assert 0.10 <= plain <= 0.50 and phase1 < plain and new < plain, (plain, phase1, new)
    r = lopd("rollout", "--recipe", "toolcall", "-n", "8", "--json", cwd=project)
    assert r.code == 0 and lopd("bank", "add-rollouts", json.loads(r.out)["out"], cwd=project).code == 0


@pytest.mark.slow
def test_smollm2_rollout_writes_records_the_bank_accepts(lopd, project):
    r = lopd("rollout", "--recipe", str(REPO / "recipes" / "orders-smollm2.yaml"), "-n", "2", "--json",
             "--set", "rollout.max_new_tokens=24", "--set", "rollout.max_turns=2", cwd=project)
    assert r.code == 0, r
    s = json.loads(r.out)
    assert s["episodes"] == 2 and s["errors"] == 0
    assert lopd("bank", "add-rollouts", s["out"], "--min-reward", "0", cwd=project).code == 0


@pytest.mark.parametrize("fast", [False, True])
def test_bf16_where_it_is_slow_prints_one_warning_line(lopd, project, monkeypatch, fast):
    import warnings

    from lopd_cli import runtime
    from lopd_cli.errors import LopdWarning

    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: fast)
    with warnings.catch_warnings():
        warnings.simplefilter("always", LopdWarning)  # not "once per process": each case must show it
        r = lopd("rollout", "--recipe", "toolcall", "-n", "1", "--set", "model.dtype=bfloat16",
                 "--set", "rollout.max_new_tokens=4", "--json", cwd=project)
    assert r.code == 0, r
    ours = [line for line in r.err.splitlines() if "bfloat16" in line]
    if fast:
        assert ours == []
    else:
        assert len(ours) == 1 and ours[0].startswith("warning: model.dtype=bfloat16: this CPU has no fast bf16")
