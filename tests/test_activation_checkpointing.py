"""train.activation_checkpointing: the decoder layers recompute in the backward, in every pass with a
graph (student; encoder and teacher in the composer pass), with the same losses and gradients,
the shared-prefix pass kept (its caches replay), and a lower peak memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))


def _trainer(student: str, checkpointing: bool, tmp: Path):
    import lopd_step_at_scale as scale

    w = scale.PRESETS["tiny"]
    tr, _, episodes = scale.build_trainer("tiny", "cpu", w, student, checkpointing, tmp)
    for ep, r in zip(episodes, [1.0, 0.0, 0.0, 1.0]):
        ep.reward = r
    with torch.no_grad():  # a non-zero student and encoder LoRA, so every gradient path is exercised
        g = torch.Generator().manual_seed(1)
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
    return tr, episodes


def _step(tr, episodes):
    """One LOPD step (loop.train_step, rollouts replayed); its row and the gradients it left
    (the optimisers step after clipping, and gradients stay until the next step's zero_grad)."""
    import lopd_step_at_scale as scale
    from lopd_cli.train import loop

    with scale.replayed_rollouts(episodes):
        row = loop.train_step(tr)
    params = loop._student_params(tr.model) + [p for g in tr.composer_opt.param_groups for p in g["params"]]
    return row, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


@pytest.mark.parametrize("student", ["lora", "full"])
def test_checkpointing_gives_the_same_lopd_step(student, tmp_path, monkeypatch):
    from lopd_cli.models import activation_checkpointing as ac

    prefix_calls = []
    real_prefix_pass = ac.prefix_pass
    monkeypatch.setattr(ac, "prefix_pass", lambda *a, **k: prefix_calls.append(1) or real_prefix_pass(*a, **k))
    off, eps_off = _trainer(student, False, tmp_path / "off")
    on, eps_on = _trainer(student, True, tmp_path / "on")
    assert ac.is_enabled(on.model) and not ac.is_enabled(off.model)
    # a full student's teacher is its frozen copy (train.teacher: base), checkpointed as well
    assert (on.teacher is not None) == (student == "full") == (off.teacher is not None)
    if student == "full":
        assert ac.is_enabled(on.teacher) and not ac.is_enabled(off.teacher)
    for a, b in zip(off.model.parameters(), on.model.parameters()):
        assert torch.equal(a, b)
    calls = {"off": 0, "on": 0, "teacher off": 0, "teacher on": 0}

    def count(mlp, k):  # (module hooks do not fire in a recompute: count the forward)
        monkeypatch.setattr(mlp, "forward", lambda *a, f=mlp.forward: calls.__setitem__(k, calls[k] + 1) or f(*a))

    for k, tr in (("off", off), ("on", on)):
        count(tr.model.get_base_model().model.layers[0].mlp, k)
        if tr.teacher is not None:
            count(tr.teacher.model.layers[0].mlp, "teacher " + k)
    row_off, g_off = _step(off, eps_off)
    row_on, g_on = _step(on, eps_on)
    assert prefix_calls, "the shared-prefix pass ran with checkpointed layers"
    assert calls["on"] > calls["off"], f"the backward recomputes the layers: {calls}"
    if student == "full":  # the composer pass's teacher (the copy) recomputes in the backward too
        assert calls["teacher on"] > calls["teacher off"] > 0, calls
    for k in ("kl", "delta", "anchor", "composer_loss", "grad_norm_student", "grad_norm_composer"):
        assert row_on[k] == pytest.approx(row_off[k], rel=1e-5, abs=1e-7), k
    assert len(g_on) == len(g_off) and any(float(g.abs().sum()) > 0 for g in g_off)
    for a, b in zip(g_off, g_on):
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(a.abs().max()))
    for a, b in zip(off.model.parameters(), on.model.parameters()):  # and the optimiser steps alike
        assert float((a - b).abs().max()) <= 1e-5


def test_without_replaying_the_views_the_recompute_would_differ(tmp_path, monkeypatch):
    """The recompute of a teacher (adapters off) or encoder layer happens in the backward, after the
    view was left: without the replayed adapter state it runs another view and torch refuses."""
    import contextlib

    from lopd_cli.models import activation_checkpointing as ac

    monkeypatch.setattr(ac, "views_context_fn",
                        lambda model: (lambda: (contextlib.nullcontext(), contextlib.nullcontext())))
    tr, episodes = _trainer("lora", True, tmp_path)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        _step(tr, episodes)


def test_shared_prefix_under_checkpointing_matches_one_full_pass():
    """decoder_hidden with a shared prefix and checkpointed layers: the same states and gradients
    (into LoRA weights and into the inputs) as one plain pass without checkpointing."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    from lopd_cli.models import activation_checkpointing as ac
    from lopd_cli.compose.latent import decoder_hidden

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=300)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    model.train()
    dec = model.get_base_model().model
    ids = torch.randint(1, 300, (3, 120), generator=torch.Generator().manual_seed(0))
    ids[:, :80] = ids[0, :80]  # an 80-token shared prefix
    mask = torch.ones_like(ids)
    mask[2, -9:] = 0
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    w = torch.randn(3, 120, 64, generator=torch.Generator().manual_seed(1))

    def run(embeds_grad: bool):
        for p in lora:
            p.grad = None
        emb = dec.embed_tokens(ids).detach().requires_grad_(embeds_grad)
        h = decoder_hidden(dec, ids, mask, inputs_embeds=emb, min_prefix=16)
        ((h * w)[mask.bool()]).sum().backward()
        return h.detach(), [p.grad.clone() for p in lora], emb.grad

    h0, g0, e0 = run(True)
    ac.enable_activation_checkpointing(model)
    assert ac.recomputes(dec)
    h1, g1, e1 = run(True)
    assert float((h0 - h1)[mask.bool()].abs().max()) <= 1e-5
    assert all(float((a - b).abs().max()) <= 1e-5 for a, b in zip(g0, g1))
    assert float((e0 - e1).abs().max()) <= 1e-5
    with torch.no_grad():  # no gradient: the layers run as they are, with transformers' own cache
        assert not ac.recomputes(dec)
        h2 = decoder_hidden(dec, ids, mask, min_prefix=16)
    assert float((h0 - h2)[mask.bool()].abs().max()) <= 1e-5


@pytest.mark.slow
def test_checkpointing_lowers_the_peak_memory_of_a_step():
    """One LOPD step at the memory check's CPU shape (8 rollouts of ~1,000 tokens, 3 items of 256
    encoder tokens, K = 32, depth 8), each setting in a fresh process: the peak anonymous RSS the
    step adds to the loaded model (benchmarks/gpu/lopd_step_at_scale.py's meter)."""
    peaks = {}
    for setting in ("off", "on"):
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "lopd_step_at_scale.py"), "--worker", "tiny:lora",
               "--device", "cpu", "--preset", "cpu", "--steps", "1", "--generate-tokens", "0"]
        if setting == "off":
            cmd.append("--no-checkpointing")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "LOPD_THREADS": "1",
               "MALLOC_MMAP_THRESHOLD_": "131072"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
        res = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
        peaks[setting] = res["steps"][0]["measured_mib"]
    print(f"peak step memory, tiny LoRA: off {peaks['off']:.0f} MiB, on {peaks['on']:.0f} MiB")
    assert peaks["on"] < 0.75 * peaks["off"], peaks
