"""`lopd --version`, `lopd init`, `lopd models`, `lopd recipe check` from a user's point of view."""

import json
import subprocess
import sys

import yaml


def test_version_via_python_m():
    out = subprocess.run([sys.executable, "-m", "lopd_cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("lopd ")


def test_init_makes_the_layout_and_refuses_twice(lopd, tmp_path):
    # The trained base policy is built (and checked) by the slow band test in test_rollout_cli.
    r = lopd("init", "proj", "--example", "orders", "--model", "tiny", "--no-base-policy", cwd=tmp_path)
    assert r.code == 0, r
    root = tmp_path / "proj"
    for sub in ("recipes", "runs", "models", "index"):
        assert (root / sub).is_dir()
    settings = yaml.safe_load((root / "lopd.yaml").read_text())
    assert settings["name"] == "proj" and settings["recipe"] == "toolcall"
    assert (root / "recipes" / "toolcall.yaml").is_file()

    before = (root / "recipes" / "toolcall.yaml").read_text()
    (root / "recipes" / "toolcall.yaml").write_text(before + "\n# my edit\n")
    again = lopd("init", "proj", cwd=tmp_path)
    assert again.code == 1 and "already holds a lopd project" in again.err and "--force" in again.err
    assert "# my edit" in (root / "recipes" / "toolcall.yaml").read_text(), "a refused init must not touch files"

    forced = lopd("init", "proj", "--force", "--no-base-policy", cwd=tmp_path)
    assert forced.code == 0, forced


def test_init_rejects_unknown_example_and_model(lopd, tmp_path):
    r = lopd("init", "p", "--example", "chess", cwd=tmp_path)
    assert r.code == 1 and "--example 'chess'" in r.err
    r = lopd("init", "p2", "--model", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert r.code == 1 and "nowhere" in r.err
    assert not (tmp_path / "p2" / "lopd.yaml").exists()


def test_models_lists_embedded_backbones_and_embedder(lopd, tmp_path):
    r = lopd("models", "--json", cwd=tmp_path)
    assert r.code == 0, r
    rows = {row["name"]: row for row in json.loads(r.out)}
    assert {"tiny", "smollm2-135m-instruct", "all-minilm-l6-v2"} <= set(rows)
    assert rows["smollm2-135m-instruct"]["installed"] and rows["smollm2-135m-instruct"]["size_bytes"] > 50e6
    assert rows["all-minilm-l6-v2"]["kind"] == "embedder"


def test_recipe_check_names_bad_key_and_missing_plugin(lopd, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {backbone: tiny}\nenv: {class: 'lopd_cli.envs.nothing_here:Env'}\n")
    r = lopd("recipe", "check", str(bad), cwd=tmp_path)
    assert r.code == 1 and "nothing_here" in r.err and r.err.startswith("error: ")
    assert "Traceback" not in r.err

    bad.write_text("model: {backbone: tiny}\nenv: {class: 'my_env.py:Env'}\nreward: 'rewards.py:score'\n")
    r = lopd("recipe", "check", str(bad), cwd=tmp_path)
    assert r.code == 1 and "my_env.py" in r.err and "does not exist" in r.err

    r = lopd("recipe", "check", str(bad), "--set", "rollout.max_turns=zero", cwd=tmp_path)
    assert r.code == 1 and "rollout.max_turns" in r.err


def test_debug_shows_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {backbone: tiny}\nenv: {class: 'x.py:Env'}\n")
    out = subprocess.run([sys.executable, "-m", "lopd_cli", "recipe", "check", str(bad), "--debug"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_project_found_upward(lopd, tmp_path):
    assert lopd("init", "proj", "--no-base-policy", cwd=tmp_path).code == 0
    deep = tmp_path / "proj" / "runs" / "a"
    deep.mkdir(parents=True)
    r = lopd("recipe", "check", "toolcall", "--json", cwd=deep)
    assert r.code == 0, r
    assert json.loads(r.out)["env"]["class"] == "lopd_cli.envs.orders:OrdersEnv"
    r = lopd("recipe", "check", "nope", cwd=deep)
    assert r.code == 1 and "recipe 'nope' not found" in r.err and "toolcall" in r.err
    assert "lopd ships it" not in r.err
    r = lopd("recipe", "check", "bfcl-smollm2-sft", cwd=deep)  # shipped, not copied into the project
    assert r.code == 1 and "lopd ships it: cp " in r.err and "bfcl-smollm2-sft.yaml" in r.err
