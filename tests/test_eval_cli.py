"""`lopd eval` end to end on the tiny backbone: several models, per-category figures, --json."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from test_export import make_checkpoint

ENV = textwrap.dedent('''
    from lopd_cli.agent.types import Task

    class CategoryEnv:
        """Six tasks in two categories; the reward depends only on the category."""
        name = "categories"

        def tasks(self, split):
            return [Task(id=f"{split}-{i}", instruction=f"Say hello {i}", tools=[], split=split,
                         data={"category": "easy" if i % 2 == 0 else "hard"}) for i in range(6)]

        def reset(self, task):
            self.task = task
            return [{"role": "user", "content": task.instruction}]

        def step(self, call):
            return "ok"

        def reward(self, transcript):
            return 1.0 if self.task.data["category"] == "easy" else 0.25
''')


@pytest.fixture
def recipe(tmp_path) -> Path:
    (tmp_path / "category_env.py").write_text(ENV)
    data = {"name": "categories-tiny", "model": {"backbone": "tiny"},
            "env": {"class": "category_env.py:CategoryEnv"},
            "rollout": {"max_new_tokens": 6, "max_turns": 1, "batch_size": 8},
            "eval": {"split": "test", "temperature": 0.0}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_eval_compares_models_with_categories(lopd, tmp_path, recipe):
    ckpt = make_checkpoint(tmp_path / "runs" / "r1")
    r = lopd("eval", "--recipe", recipe, "--backbone", "--checkpoint", ckpt.parent.parent, "-n", "4", "--json",
             "--rollouts", tmp_path / "eps.jsonl")
    assert r.code == 0, r
    out = json.loads(r.out)
    assert out["split"] == "test" and out["temperature"] == 0.0 and out["n"] == 4
    labels = [m["label"] for m in out["models"]]
    assert labels == ["backbone tiny", "r1/step_3 (lopd)"]
    for m in out["models"]:
        assert m["n"] == 4
        assert m["success"]["mean"] == 0.5  # 2 easy (reward 1) + 2 hard (reward 0.25)
        assert m["reward"]["mean"] == pytest.approx(0.625)
        assert m["categories"]["easy"]["success"]["mean"] == 1.0
        assert m["categories"]["hard"]["success"]["mean"] == 0.0
        assert m["categories"]["hard"]["reward"]["mean"] == 0.25
        assert 0 < m["behaviour"]["first_turn_tokens"]["mean"] <= 6
    records = [json.loads(line) for line in (tmp_path / "eps.jsonl").read_text().splitlines()]
    assert len(records) == 8 and {rec["meta"]["model"] for rec in records} == set(labels)


def test_eval_table_and_errors(lopd, tmp_path, recipe):
    r = lopd("eval", "--recipe", recipe, "-n", "2")
    assert r.code == 0, r
    assert "backbone tiny" in r.out and "success per category" in r.out
    bad = lopd("eval", "--recipe", recipe, "--checkpoint", tmp_path / "nowhere")
    assert bad.code == 1 and "error:" in bad.err and "nowhere" in bad.err


def test_eval_refuses_a_run_of_another_world_without_recipe_and_notes_it_with_one(tmp_path):
    """`lopd eval --checkpoint runs/X` without --recipe takes the project's recipe: a run trained
    in another env (its recipe.yaml) is refused instead of being scored on the wrong tasks; with
    --recipe it is scored there, with a note saying how the worlds differ."""
    from types import SimpleNamespace

    import yaml

    from lopd_cli.cli.eval_cmds import check_same_world, world_mismatch
    from lopd_cli.config import recipe_from_dict
    from lopd_cli.errors import LopdError

    here = {"model": {"backbone": "tiny"}, "env": {"class": "lopd_cli.envs.orders:OrdersEnv", "kwargs": {"house_rules": True}}}
    run = tmp_path / "run"
    run.mkdir()
    info = SimpleNamespace(run_dir=run)
    (run / "recipe.yaml").write_text(yaml.safe_dump(here))
    check_same_world(info, recipe_from_dict(here))  # same world: fine
    other = {**here, "env": {"class": "desk.py:UnitDesk", "kwargs": {}}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(other))
    with pytest.raises(LopdError, match="pass --recipe"):
        check_same_world(info, recipe_from_dict(here))
    # With --recipe eval scores the run where it is told and only notes the difference.
    seeded = {**here, "env": {**here["env"], "kwargs": {"house_rules": True, "rules_seed": 4242}}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(seeded))
    note = world_mismatch(info, recipe_from_dict(here))
    assert "'rules_seed': 4242" in note and "{'house_rules': True}" in note
    assert world_mismatch(info, recipe_from_dict(seeded)) is None


def test_eval_with_recipe_scores_a_run_of_another_world_and_says_so(lopd, tmp_path, recipe):
    ckpt = make_checkpoint(tmp_path / "runs" / "r2")
    run = ckpt.parent.parent
    saved = {"model": {"backbone": "tiny"}, "env": {"class": "category_env.py:CategoryEnv", "kwargs": {}}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(saved))
    same = lopd("eval", "--recipe", recipe, "--checkpoint", run, "-n", "2", "--json")
    assert same.code == 0, same
    assert "note" not in same.err
    saved["env"]["kwargs"] = {"rules_seed": 4242}
    (run / "recipe.yaml").write_text(yaml.safe_dump(saved))
    other = lopd("eval", "--recipe", recipe, "--checkpoint", run, "-n", "2", "--json")
    assert other.code == 0, other
    assert "note" in other.err and "rules_seed" in other.err and "scoring it in the recipe's world" in " ".join(other.err.split())
    assert json.loads(other.out)["models"][0]["n"] == 2
