"""The vllm-server backend's settings and failures that need no vLLM: the recipe keys, a server
that does not answer (one line, from the backend and from `lopd train`, nothing in the run lost),
and a full student, which a vLLM server cannot take. Rollouts against a real server are in
tests/test_vllm_server_rollouts.py (`make test-vllm`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from lopd_cli.config import RolloutSection
from lopd_cli.errors import LopdError
from lopd_cli.rollout.vllm_server import api_base, same_model


def _dead_url() -> str:
    """An http URL on loopback where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_server_url_is_the_openai_base_with_or_without_v1():
    assert api_base("http://h:8000") == "http://h:8000/v1"
    assert api_base("http://h:8000/v1/") == "http://h:8000/v1"
    with pytest.raises(LopdError, match="rollout.server_url: 'h:8000' is not an http"):
        api_base("h:8000")


def test_recipe_needs_a_server_url_and_an_absolute_adapter_folder():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="needs rollout.server_url"):
        RolloutSection(backend="vllm-server")
    with pytest.raises(ValidationError, match="server_adapter_dir must be an absolute path"):
        RolloutSection(backend="vllm-server", server_url="http://h:1", server_adapter_dir="adapters")
    with pytest.raises(ValidationError, match="server_url must be auto or an http"):
        RolloutSection(backend="vllm-server", server_url="h:8000")
    assert RolloutSection(backend="vllm-server", server_url="auto").server_url == "auto"
    ok = RolloutSection(backend="vllm-server", server_url="http://h:1", server_adapter_dir="/srv/adapters")
    assert ok.server_timeout_s == 600.0


def test_a_server_on_another_machine_is_matched_by_folder_name_or_hub_id(tmp_path):
    here = tmp_path / "tiny"
    here.mkdir()
    assert same_model(str(here), str(here))
    assert same_model("/models/on/the/server/tiny", str(here))
    assert not same_model(str(tmp_path), str(here))
    assert not same_model("/models/on/the/server/smollm2", str(here))
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert same_model("Qwen/Qwen3-8B", str(snapshot)) and same_model("/srv/Qwen3-8B", str(snapshot))
    assert not same_model("Qwen/Qwen3-4B", str(snapshot))


def _tiny_with(adapter_name: str):
    """tiny wrapped by peft with one adapter: "student" (a LoRA student) or "encoder" alone (what
    `attach_adapters` makes for model.student: full: the base weights are the student)."""
    from peft import LoraConfig, get_peft_model

    from lopd_cli.models.backbone import load_backbone

    model, tok = load_backbone("tiny", device="cpu")
    return get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"), adapter_name=adapter_name), tok


def test_a_server_that_does_not_answer_is_one_line_naming_it():
    from lopd_cli.rollout.factory import make_backend

    student, tok = _tiny_with("student")
    url = _dead_url()
    with pytest.raises(LopdError) as e:
        make_backend("vllm-server", student, tok, RolloutSection(backend="vllm-server", server_url=url))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"rollout.server_url {url}/v1: no server answers")
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve" in msg


def test_a_full_student_is_refused_before_any_request():
    from lopd_cli.rollout.vllm_server import VLLMServerBackend

    full, tok = _tiny_with("encoder")
    with pytest.raises(LopdError, match="full fine-tuned student .* use rollout.server_url auto .* or rollout.backend vllm"):
        VLLMServerBackend(full, tok, _dead_url())  # refused before it would find the server down


def test_lopd_train_against_a_down_server_is_one_line(tmp_path):
    from _train_fixtures import build_project

    project = build_project(tmp_path / "p")
    url = _dead_url()
    res = subprocess.run([sys.executable, "-m", "lopd_cli", "train", "-C", str(project.root), "--recipe", "toolcall",
                          "--run-name", "r", "--set", "rollout.backend=vllm-server", "--set", f"rollout.server_url={url}"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: rollout.server_url {url}/v1: no server answers"), \
        res.stderr[-2000:]
    assert not list((project.runs_dir / "r").glob("checkpoints/step_*"))


def test_resume_lets_the_server_move_but_not_the_experiment(tmp_path):
    from lopd_cli.config import Recipe
    from lopd_cli.train.loop import prepare_run_dir

    def recipe(**rollout) -> Recipe:
        return Recipe.model_validate({"model": {"backbone": "tiny"}, "env": {"class": "lopd_cli.envs.orders:OrdersEnv"},
                                      "rollout": {"backend": "vllm-server", **rollout}})

    run = tmp_path / "run"
    assert prepare_run_dir(run, recipe(server_url="http://a:8000/v1"), resume=False) is None
    # a restarted server elsewhere, another adapter folder and timeout: the same run, resumed
    assert prepare_run_dir(run, recipe(server_url="http://b:9000/v1", server_adapter_dir="/srv/a",
                                       server_timeout_s=30), resume=True) is None
    with pytest.raises(LopdError, match="the recipe differs .* in section\\(s\\) rollout"):
        prepare_run_dir(run, recipe(server_url="http://b:9000/v1", temperature=0.5), resume=True)


def test_auto_without_vllm_installed_is_one_line(monkeypatch):
    from lopd_cli.rollout import vllm_server

    monkeypatch.setattr(vllm_server.importlib.util, "find_spec", lambda name: None)  # as in an env without vLLM
    student, tok = _tiny_with("student")
    with pytest.raises(LopdError, match="^rollout.server_url auto: vLLM is not installed in this environment"):
        vllm_server.VLLMServerBackend(student, tok, "auto")
