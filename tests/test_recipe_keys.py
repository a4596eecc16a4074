"""Recipe keys: every key is described, renamed keys say their new name (in a file and in
--set), `lopd recipe explain` shows them, docs/recipes.md is generated from them and current,
and every shipped recipe passes `lopd recipe check`."""

import json
import types
import typing
from pathlib import Path

import pytest
import yaml

from lopd_cli.config import (RENAMED, Recipe, Section, explain, load_recipe, recipe_keys,
                             recipe_reference_markdown)
from lopd_cli.errors import LopdError

REPO = Path(__file__).resolve().parent.parent
BASE = {"model": {"backbone": "tiny"}, "env": {"class": "lopd_cli.envs.orders:OrdersEnv"}}
REGENERATE = "python -m lopd_cli recipe explain --markdown > docs/recipes.md"


def walk(model: type[Section] = Recipe, prefix: str = ""):
    """(dotted key, field) of every leaf key, straight from the pydantic models."""
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        key = prefix + (field.alias or name)
        ann = field.annotation
        if typing.get_origin(ann) in (typing.Union, types.UnionType):  # an optional section: env.mcp
            ann = next((a for a in typing.get_args(ann) if a is not type(None)), ann)
        if isinstance(ann, type) and issubclass(ann, Section):
            yield from walk(ann, key + ".")
        else:
            yield key, field


LEAVES = dict(walk())


def write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "toolcall.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def nested(key: str, value) -> dict:
    out: dict = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def other_value(default):
    """A valid value other than a key's default."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default * 2 + 1
    return {None: None, "centred": "paper"}[default]


def test_every_key_and_section_has_a_one_line_description():
    assert len(LEAVES) == 153  # 107 + the 16 evolve keys + train.parallel + train.activation_checkpointing
    # + train.teacher_ema_rate + train.teacher_from + train.sdpo's 5 + train.fsdp_gather + train.teacher_dtype
    # + env.mcp's 13 keys and its reset hook's 2 + rollout.server_url, server_adapter_dir, server_timeout_s
    # + eval.batch_size
    for key, field in LEAVES.items():
        d = field.description or ""
        assert d.strip() and "\n" not in d and len(d) <= 140, key
    for info in recipe_keys():
        assert info.description.strip() and "\n" not in info.description, info.key


def test_each_algorithm_has_its_own_train_section():
    train = {k for k in LEAVES if k.startswith("train.")}
    assert {k.split(".")[1] for k in train if k.count(".") == 2} == {"distill", "lopd", "grpo", "sdpo", "sft"}
    assert "train.lopd.margin_m" in train and "train.grpo.group_size" in train and "train.sft.batch" in train
    assert "train.margin_m" not in train and "train.sft_batch" not in train


def test_every_renamed_key_points_at_a_key_and_keeps_its_default():
    for old, new in RENAMED.items():
        assert new in LEAVES and old not in LEAVES, (old, new)


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_name_in_a_recipe_file_says_the_new_one(tmp_path, old):
    p = write(tmp_path, {**BASE, **nested(old, 2)})
    with pytest.raises(LopdError) as e:
        load_recipe(p)
    assert str(e.value) == f"{p}: {old} was renamed {RENAMED[old]}"


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_name_in_set_says_the_new_one(tmp_path, old):
    p = write(tmp_path, BASE)
    with pytest.raises(LopdError) as e:
        load_recipe(p, [f"{old}=2"])
    assert str(e.value) == f"--set '{old}=2': {old} was renamed {RENAMED[old]}"
    value = other_value(yaml.safe_load(explain(RENAMED[old])[0].default))
    node = load_recipe(p, [f"{RENAMED[old]}={json.dumps(value)}"])  # the new name takes the value
    for part in RENAMED[old].split("."):
        node = getattr(node, part)
    assert node == value


def test_old_names_fail_in_the_cli_with_one_line(lopd, tmp_path):
    p = write(tmp_path, {**BASE, "train": {"sft_batch": 8}})
    r = lopd("recipe", "check", str(p), cwd=tmp_path)
    assert r.code == 1 and r.err.strip() == f"error: {p}: train.sft_batch was renamed train.sft.batch"
    r = lopd("recipe", "check", str(write(tmp_path, BASE)), "--set", "train.kl_coef=0.1", cwd=tmp_path)
    assert r.code == 1 and r.err.strip() == "error: --set 'train.kl_coef=0.1': train.kl_coef was renamed train.grpo.kl_coef"


def test_a_run_folder_written_before_the_rename_still_resumes(tmp_path):
    """--resume reads runs/RUN/recipe.yaml, which an earlier lopd wrote with the old names."""
    from lopd_cli.train.loop import prepare_run_dir

    recipe = load_recipe(write(tmp_path, BASE), ["train.lopd.margin_m=0.2", "train.grpo.group_size=4"])
    old_form = yaml.safe_load(recipe.to_yaml())
    train = old_form["train"]
    for old, new in RENAMED.items():
        section, _, leaf = new.removeprefix("train.").partition(".")
        train[old.removeprefix("train.")] = train[section].pop(leaf)
    for section in ("distill", "lopd", "grpo", "sft"):
        assert train.pop(section) == {}
    run = tmp_path / "runs" / "lopd-old"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump(old_form))
    with pytest.raises(LopdError, match=r"recipe\.yaml: train\.top_m was renamed train\.distill\.top_m"):
        load_recipe(run / "recipe.yaml")  # a user's recipe file with the old names: an error
    saved = load_recipe(run / "recipe.yaml", upgrade=True)
    assert saved.model_dump() == recipe.model_dump()
    assert prepare_run_dir(run, recipe, resume=True) is None  # no checkpoint yet: starts over, no error
    changed = load_recipe(write(tmp_path, BASE), ["train.lopd.margin_m=0.3"])
    with pytest.raises(LopdError, match="differs"):
        prepare_run_dir(run, changed, resume=True)


def test_explain_all_a_section_a_key_and_unknown():
    leaves = [i for i in explain() if not i.is_section]
    assert [i.key for i in leaves] == list(LEAVES)
    lopd = explain("train.lopd")
    assert lopd[0].is_section and lopd[0].key == "train.lopd"
    assert {i.key for i in lopd[1:]} == {k for k in LEAVES if k.startswith("train.lopd.")}
    (one,) = explain("train.lopd.margin_m")
    assert (one.type, one.default) == ("float", "0.05") and "margin" in one.description
    (req,) = explain("model.backbone")
    assert req.default == "(required)"
    (cls,) = explain("env.class")  # by its alias
    assert cls.key == "env.class"
    with pytest.raises(LopdError) as e:
        explain("train.lopd.margn_m")
    assert "unknown recipe key 'train.lopd.margn_m'" in str(e.value) and "did you mean train.lopd.margin_m?" in str(e.value)
    with pytest.raises(LopdError, match=r"did you mean train\.distill\.top_m\?"):
        explain("top_m")
    with pytest.raises(LopdError, match=r"^train\.sft_batch was renamed train\.sft\.batch$"):
        explain("train.sft_batch")


def test_explain_command_table_json_and_errors(lopd, tmp_path):
    r = lopd("recipe", "explain", "train.grpo", "--json", cwd=tmp_path)
    assert r.code == 0, r
    rows = json.loads(r.out)
    assert [row["key"] for row in rows] == ["train.grpo.group_size", "train.grpo.clip_eps", "train.grpo.kl_coef"]
    assert rows[0]["default"] == "8" and rows[0]["description"] == LEAVES["train.grpo.group_size"].description
    r = lopd("recipe", "explain", cwd=tmp_path)
    assert r.code == 0 and "train.lopd.composer_every" in r.out and "eval.success_threshold" in r.out
    r = lopd("recipe", "explain", "train.sft.batch", cwd=tmp_path)
    assert r.code == 0 and "train.sft.batch" in r.out and "train.lopd" not in r.out
    r = lopd("recipe", "explain", "rollout.max_turn", cwd=tmp_path)
    assert r.code == 1 and r.err.count("\n") == 1 and "did you mean rollout.max_turns?" in r.err


def test_docs_recipes_md_is_generated_and_current(lopd, tmp_path):
    text = (REPO / "docs" / "recipes.md").read_text()
    assert text == recipe_reference_markdown(), f"docs/recipes.md is stale: regenerate it with `{REGENERATE}`"
    assert REGENERATE in text.splitlines()[3]  # its first lines say how to regenerate it
    r = lopd("recipe", "explain", "--markdown", cwd=tmp_path)
    assert r.code == 0 and r.out == text


def test_docs_recipes_md_covers_every_key_with_its_default():
    text = recipe_reference_markdown()
    for info in recipe_keys():
        if not info.is_section:
            row = next((line for line in text.splitlines() if line.startswith(f"| `{info.key}` |")), None)
            assert row is not None, info.key
            assert f"`{info.default}`" in row and LEAVES[info.key].description.replace("|", "\\|") in row


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")) + sorted((REPO / "examples").glob("*/recipe.yaml")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_recipe_passes_recipe_check(lopd, tmp_path, path):
    from lopd_cli.project import packaged_recipes

    if "bfcl" in path.name:
        pytest.importorskip("bfcl_eval")  # the optional extra
    for p in {path, packaged_recipes() / path.name} if path.parent.name == "recipes" else {path}:
        r = lopd("recipe", "check", str(p), "--json", cwd=tmp_path)
        assert r.code == 0, r
        assert json.loads(r.out)["name"] == yaml.safe_load(p.read_text())["name"]


def test_every_recipe_key_line_has_a_comment():
    """torchtune style: each key in a shipped recipe says what it is, on its line or the one above."""
    for path in sorted((REPO / "recipes").glob("*.yaml")) + sorted((REPO / "examples").glob("*/recipe.yaml")):
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# ") and any("lopd " in line for line in lines[:25] if line.startswith("#")), path
        for i, line in enumerate(lines):
            stripped = line.strip()
            if not stripped or stripped.startswith("#") or stripped.endswith(":") or line.startswith(" " * 13):
                continue  # comments, section headers, continuation lines of a flow list
            assert "#" in line or lines[i - 1].strip().startswith("#"), f"{path.name}:{i + 1}: {line}"


def test_report_reads_the_margin_of_runs_from_before_and_after_the_rename(tmp_path):
    from lopd_cli.results.report import load_run

    for name, train in (("old", {"algo": "lopd", "margin_m": 0.3}), ("new", {"algo": "lopd", "lopd": {"margin_m": 0.3}}),
                        ("default", {"algo": "lopd"}), ("grpo", {"algo": "grpo"})):
        run = tmp_path / name
        run.mkdir()
        (run / "recipe.yaml").write_text(yaml.safe_dump({**BASE, "train": train}))
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        assert load_run(run).margin_m == {"old": 0.3, "new": 0.3, "default": 0.05, "grpo": None}[name]


def test_explained_defaults_are_the_values_a_recipe_gets():
    """The default `lopd recipe explain` and docs/recipes.md show is what a recipe that leaves
    the key out really holds (composer.encoder_lora is LoRA r 8, not LoraConfig's own 16)."""
    from lopd_cli.config import _yaml_value

    recipe = Recipe.model_validate(BASE)
    mcp = Recipe.model_validate({**BASE, "env": {"mcp": {"command": "server", "tasks": "t.jsonl",
                                                         "reset": {"tool": "reset"}}}})
    for info in recipe_keys():
        if info.is_section or info.default == "(required)" or info.key in ("env.class", "env.mcp.command"):  # set here
            continue
        node = mcp if info.key.startswith("env.mcp.") else recipe
        for part in info.key.split("."):
            node = getattr(node, "cls" if part == "class" else part)
        assert info.default == _yaml_value(node), info.key
    assert next(i for i in recipe_keys() if i.key == "composer.encoder_lora.r").default == "8"


@pytest.mark.parametrize("width", [80, 140])
def test_explain_reads_whole_descriptions_on_a_narrow_terminal(lopd, tmp_path, monkeypatch, width):
    """Below 110 columns a table would squeeze the description to a word per line: a list instead."""
    from lopd_cli.cli import common

    monkeypatch.setattr(common.console, "width", width)
    r = lopd("recipe", "explain", "evolve", cwd=tmp_path)
    assert r.code == 0, r
    assert ("┃ key" in r.out) == (width >= 110)
    if width < 110:  # every description whole, each under its key
        flat = " ".join(r.out.split())
        for key in ("evolve.rounds", "evolve.samples_per_task", "evolve.refresh_composer"):
            assert f"{key} " in flat and LEAVES[key].description in flat
