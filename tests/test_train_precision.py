"""Precision and activation checkpointing through `lopd train`: `model.autocast_bf16: auto` (the
default) resolves to fp32 on a CPU and gives exactly the run that `false` gives; bf16 where the
device has fast bf16; `train.activation_checkpointing: true` gives the same step."""

import pytest

from _train_fixtures import build_project, numeric, train_run
from lopd_cli.errors import LopdError


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return build_project(tmp_path_factory.mktemp("proj"))


def test_auto_resolves_by_device():
    from lopd_cli.train.precision import device_has_fast_bf16, resolve_autocast

    assert resolve_autocast("auto", "cpu") is False
    assert device_has_fast_bf16("cpu") is False
    assert resolve_autocast("auto", "cuda", fast_bf16=True) is True
    assert resolve_autocast("auto", "cuda:1", fast_bf16=False) is False  # a GPU without bf16 (pre-Ampere)
    assert resolve_autocast(True, "cpu") is True and resolve_autocast(False, "cuda", fast_bf16=True) is False


def test_recipes_old_and_new_load():
    from lopd_cli.config import ModelSection, TrainSection, recipe_from_dict

    assert ModelSection(backbone="tiny").autocast_bf16 == "auto"
    for value in (True, False, "auto"):
        assert ModelSection(backbone="tiny", autocast_bf16=value).autocast_bf16 == value
    with pytest.raises(LopdError, match="model.autocast_bf16"):
        recipe_from_dict({"model": {"backbone": "tiny", "autocast_bf16": "fast"}, "env": {"class": "x:Y"}})
    assert TrainSection().activation_checkpointing is False
    for section, key in ((ModelSection, "autocast_bf16"), (TrainSection, "activation_checkpointing")):
        assert section.model_fields[key].description, key


def test_auto_is_fp32_here_and_the_same_run_as_false(project):
    tr_auto, auto = train_run(project, "prec-auto", [])
    tr_false, false = train_run(project, "prec-false", ["model.autocast_bf16=false"])
    assert tr_auto.recipe.model.autocast_bf16 == "auto" and tr_auto.autocast is False
    assert [numeric(r) for r in auto] == [numeric(r) for r in false]  # bit for bit
    assert auto[-1]["kl"] is not None and auto[-1]["grad_norm_student"] > 0


def test_activation_checkpointing_through_the_recipe_gives_the_same_step(project):
    from lopd_cli.models.activation_checkpointing import is_enabled

    tr_off, off = train_run(project, "ckpt-off", ["train.steps=1"])
    tr_on, on = train_run(project, "ckpt-on", ["train.steps=1", "train.activation_checkpointing=true"])
    assert is_enabled(tr_on.model) and not is_enabled(tr_off.model)
    a, b = numeric(off[0]), numeric(on[0])
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("algo", ["grpo", "opsd", "sft"])
def test_the_baselines_give_the_same_step_with_activation_checkpointing(project, algo):
    _, off = train_run(project, f"{algo}-ckpt-off", ["train.steps=1", f"train.algo={algo}"])
    _, on = train_run(project, f"{algo}-ckpt-on", ["train.steps=1", f"train.algo={algo}", "train.activation_checkpointing=true"])
    a, b = numeric(off[0]), numeric(on[0])
    assert a.keys() == b.keys() and "loss" in a
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
