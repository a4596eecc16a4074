"""Embedded backbones load offline, generate, and carry the latent placeholder token."""

import json

import pytest
import torch

from lopd_cli.models.backbone import backbone_fingerprint, latent_token_id, load_backbone, load_tokenizer
from lopd_cli.models.registry import materialise_backbone
from lopd_cli.models.tiny import LATENT_TOKEN, build_tiny


def _check_backbone(name: str) -> None:
    model, tok = load_backbone(name)
    ph = latent_token_id(tok)
    assert ph != tok.unk_token_id and ph < model.get_input_embeddings().weight.shape[0]
    text = f"before {LATENT_TOKEN} after"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(ph) == 1, "the placeholder must be one token"
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt")["input_ids"]
    torch.manual_seed(0)
    out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt.shape[1]
    # Reload from the cached directory: the placeholder round-trips through save/load.
    again = load_tokenizer(materialise_backbone(name))
    assert latent_token_id(again) == ph


def test_tiny_loads_generates_and_has_placeholder():
    _check_backbone("tiny")


@pytest.mark.slow
def test_smollm2_loads_generates_and_has_placeholder():
    _check_backbone("smollm2-135m-instruct")
    model, tok = load_backbone("smollm2-135m-instruct")
    assert model.config.hidden_size == 576 and model.config.num_hidden_layers == 30
    reply = model.generate(
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                add_generation_prompt=True, return_tensors="pt")["input_ids"],
        max_new_tokens=12, do_sample=False,
    )
    assert "Paris" in tok.decode(reply[0]), "the converted GGUF weights must behave like the instruct model"


def test_tiny_is_deterministic_for_a_seed(tmp_path):
    a, b, c = (build_tiny(tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    from safetensors.torch import load_file

    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    assert json.loads((a / "tokenizer.json").read_text()) == json.loads((b / "tokenizer.json").read_text())


def test_fingerprint_tells_backbones_apart():
    tiny, _ = load_backbone("tiny")
    assert backbone_fingerprint(tiny) == backbone_fingerprint(tiny)
    other = type(tiny)(tiny.config.__class__(**{**tiny.config.to_dict(), "hidden_size": 64, "head_dim": 16}))
    assert backbone_fingerprint(other) != backbone_fingerprint(tiny)


def test_unknown_backbone_is_a_clear_error(tmp_path):
    from lopd_cli.errors import LopdError

    with pytest.raises(LopdError, match="does not exist"):
        load_backbone(str(tmp_path / "nope"))
    with pytest.raises(LopdError, match="neither an embedded model"):
        load_backbone("./not-a-model-dir")


def test_build_once_leaves_nothing_behind_when_a_build_fails(tmp_path):
    from lopd_cli.models.registry import build_once

    def broken(d):
        (d / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        build_once(tmp_path / "m", broken)
    assert list(tmp_path.iterdir()) == [], "no half-written model and no temporary folder"
    calls = []
    out = build_once(tmp_path / "m", lambda d: (calls.append(d), (d / "config.json").write_text("{}")))
    assert (out / "config.json").exists() and len(calls) == 1
    build_once(tmp_path / "m", lambda d: calls.append(d))
    assert len(calls) == 1, "a finished build is reused"


def test_bf16_warning_only_on_a_cpu_without_fast_bf16():
    from lopd_cli.runtime import slow_bf16_message

    msg = slow_bf16_message("model.dtype=bfloat16", "cpu", fast_bf16=False)
    assert msg is not None and msg.startswith("model.dtype=bfloat16:") and "\n" not in msg
    assert slow_bf16_message("model.dtype=bfloat16", "cpu", fast_bf16=True) is None
    assert slow_bf16_message("model.autocast_bf16=true", "cuda", fast_bf16=False) is None
    assert slow_bf16_message("model.autocast_bf16=true", "cuda:0", fast_bf16=False) is None


@pytest.mark.parametrize("fast", [False, True])
def test_loading_bf16_warns_when_bf16_is_slow_here(monkeypatch, fast):
    import warnings

    from lopd_cli import runtime
    from lopd_cli.errors import LopdWarning

    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: fast)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, _ = load_backbone("tiny", "bfloat16", "cpu")
    ours = [w for w in seen if issubclass(w.category, LopdWarning)]
    assert model.dtype == torch.bfloat16
    assert len(ours) == (0 if fast else 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        load_backbone("tiny", "float32", "cpu")
    assert not [w for w in seen if issubclass(w.category, LopdWarning)]



def test_building_an_embedded_model_on_first_use_keeps_the_random_streams(tmp_path, monkeypatch):
    """A seeded run on an empty cache (the tiny backbone is built then, with a random init) draws
    the same random numbers afterwards as the same run on a warm cache."""
    import random

    import numpy as np

    monkeypatch.setenv("LOPD_CACHE", str(tmp_path / "cache"))

    def draws(build: bool):
        torch.manual_seed(3), random.seed(3), np.random.seed(3)
        if build:
            materialise_backbone("tiny")
        return torch.rand(4), random.random(), float(np.random.rand())

    assert not (tmp_path / "cache" / "models" / "tiny").exists()
    cold = draws(build=True)
    assert (tmp_path / "cache" / "models" / "tiny" / "config.json").exists()
    warm = draws(build=False)
    assert torch.equal(cold[0], warm[0]) and cold[1:] == warm[1:]
