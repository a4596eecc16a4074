"""Recipes: validation errors name the file and key; overrides are typed; plugins load or fail clearly."""

from pathlib import Path

import pytest
import yaml

from lopd_cli.agent.plugins import load_env_class, load_reward_fn
from lopd_cli.config import load_recipe
from lopd_cli.errors import LopdError

BASE = {"model": {"backbone": "tiny"}, "env": {"class": "envmod.py:MyEnv"}}

ENV_FILE = """
class MyEnv:
    def tasks(self, split): return []
    def reset(self, task): return []
    def step(self, call): return ""
    def reward(self, transcript): return 0.0

class NotAnEnv:
    pass

def score(task, transcript):
    return 1.0
"""


def write(tmp_path: Path, data: dict, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    (tmp_path / "envmod.py").write_text(ENV_FILE)
    return p


def test_defaults_are_the_papers(tmp_path):
    r = load_recipe(write(tmp_path, BASE))
    assert (r.bank.n_retrieve, r.composer.num_queries, r.composer.depth) == (3, 32, 8)
    assert (r.train.distill.top_m, r.train.lopd.margin_m, r.train.lopd.anchor_lambda) == (20, 0.05, 0.2)
    # Departures from the paper (issue 16): a centred margin, η_β in units of the default margin
    # (0.5 / 0.05), and only full successes as experience.
    assert (r.train.lopd.margin_advantage, r.train.lopd.eta_beta, r.bank.min_reward) == ("centred", 10.0, 1.0)
    # And φ on every 4th step (the paper: every step), the composer pass in chunks of 2 (issue 20).
    assert (r.train.lopd.composer_every, r.train.lopd.composer_micro_batch) == (4, 2)
    assert (r.composer.encoder_lora.r, r.composer.encoder_lora.alpha) == (8, 16)


def test_unknown_key_names_section_key_and_file(tmp_path):
    p = write(tmp_path, {**BASE, "train": {"lrr": 1e-4}})
    with pytest.raises(LopdError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert "lrr" in msg and "train" in msg and str(p) in msg and "\n" not in msg


def test_unknown_section(tmp_path):
    with pytest.raises(LopdError, match="unknown key 'trainer'"):
        load_recipe(write(tmp_path, {**BASE, "trainer": {}}))


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(LopdError, match=r"train\.steps"):
        load_recipe(write(tmp_path, {**BASE, "train": {"steps": "many"}}))


def test_missing_required_field(tmp_path):
    with pytest.raises(LopdError, match=r"missing required key 'model'"):
        load_recipe(write(tmp_path, {"env": BASE["env"]}))
    with pytest.raises(LopdError, match=r"env\.class"):
        load_recipe(write(tmp_path, {"model": BASE["model"], "env": {}}))


def test_invalid_yaml_names_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  backbone: tiny\n  x: [1, 2\n")
    with pytest.raises(LopdError, match=r"bad\.yaml:\d+: not valid YAML"):
        load_recipe(p)


def test_overrides_are_typed_and_recorded(tmp_path):
    p = write(tmp_path, BASE)
    r = load_recipe(p, ["train.lr=2e-4", "bank.grow=true", "rollout.max_turns=3"])
    assert r.train.lr == pytest.approx(2e-4) and r.bank.grow is True and r.rollout.max_turns == 3
    assert "lr: 0.0002" in r.to_yaml()
    with pytest.raises(LopdError, match=r"train\.lr"):
        load_recipe(p, ["train.lr=fast"])
    with pytest.raises(LopdError, match="unknown key 'nope'"):
        load_recipe(p, ["train.nope=1"])
    with pytest.raises(LopdError, match="expected section.key=value"):
        load_recipe(p, ["train.lr"])


def test_resolved_recipe_round_trips(tmp_path):
    r = load_recipe(write(tmp_path, BASE), ["train.steps=7"])
    again = tmp_path / "resolved.yaml"
    again.write_text(r.to_yaml())
    assert load_recipe(again).model_dump() == r.model_dump()


def test_plugins_load_relative_to_recipe_folder(tmp_path):
    r = load_recipe(write(tmp_path, BASE))
    cls = load_env_class(r.env.cls, r.base_dir)
    assert cls.__name__ == "MyEnv"
    assert load_reward_fn("envmod.py:score", r.base_dir)(None, []) == 1.0


@pytest.mark.parametrize(
    "spec, match",
    [
        ("missing_file.py:MyEnv", "does not exist"),
        ("envmod.py:Nope", "has no attribute 'Nope'"),
        ("envmod.py:NotAnEnv", "not an environment"),
        ("no_such_package.mod:Env", "module 'no_such_package.mod' not found"),
        ("envmod.py", "expected 'package.module:Name'"),
    ],
)
def test_plugin_errors_are_one_line_and_name_it(tmp_path, spec, match):
    write(tmp_path, BASE)
    with pytest.raises(LopdError, match=match) as e:
        load_env_class(spec, tmp_path)
    assert "\n" not in str(e.value)


def test_every_packaged_recipe_validates_and_its_env_loads():
    """A packaged recipe with a stale key or a wrong env path fails here, not on a user's machine."""
    from lopd_cli.project import packaged_recipes

    paths = sorted(packaged_recipes().glob("*.yaml"))
    assert len(paths) >= 7 and any(p.stem == "orders-smollm2-sft" for p in paths)
    for p in paths:
        r = load_recipe(p)
        assert r.name == p.stem, p
        if r.env.mcp is not None:  # an MCP world: the server starts, the tasks load
            from lopd_cli.agent.runner import make_env_factory

            r.source = p
            assert make_env_factory(r)().tasks("test")
        elif "bfcl" not in p.stem:  # bfcl-eval is an optional extra
            assert callable(load_env_class(r.env.cls, p.parent).tasks)
