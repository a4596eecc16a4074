"""benchmarks/gpu/lopd_step_at_scale.py, the prepared single-GPU run, at tiny shape on the CPU (so
that it does not rot), and the Qwen3 shapes it writes down against the published model sizes."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "lopd_step_at_scale.py"
sys.path.insert(0, str(SCRIPT.parent))


def test_tiny_on_cpu_runs_both_students_through_the_product_step(tmp_path):
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "LOPD_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--device", "cpu", "--student", "lora",
                           "full", "--steps", "2", "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert [(r["shape"], r["student"]) for r in res] == [("tiny", "lora"), ("tiny", "full")]
    for r in res:
        assert "error" not in r and r["precision"] == "fp32" and r["activation_checkpointing"]
        assert r["generate"]["new_tokens"] > 0 and r["generate"]["tokens_per_s"] > 0
        assert [s["step"] for s in r["steps"]] == [1, 2]
        for s in r["steps"]:
            assert math.isfinite(s["kl"]) and s["grad_norm_composer"] > 0  # every step a composer step
            for phase in ("sec_encode", "sec_teacher", "sec_composer", "sec_student", "sec_update"):
                assert s[phase] > 0, phase
            assert s["measured_mib"] > 0 and s["plan_mib"] > 0
        assert r["plan"]["activations_gib"] > 0 and r["step_shape"]["rollouts"] == 4
    assert res[1]["trainable_student"] > 5 * res[0]["trainable_student"], "full trains the backbone"
    assert "tiny lora (fp32" in proc.stdout and "step 2 memory" in proc.stdout


def test_qwen3_shapes_are_the_published_sizes():
    """Qwen3-4B: 4.0 B parameters, 3.6 B without embeddings; Qwen3-8B: 8.2 B and 6.95 B (model cards)."""
    import lopd_step_at_scale as scale

    for name, total, body in (("qwen3-4b", 4.0e9, 3.6e9), ("qwen3-8b", 8.2e9, 6.95e9)):
        m = scale.model_shape(name)
        emb = m.vocab * m.hidden * (1 if m.tied else 2)
        assert m.params() == pytest.approx(total, rel=0.02), name
        assert m.params() - emb == pytest.approx(body, rel=0.01), name


def test_the_plan_of_the_gpu_run_is_computed_without_a_model():
    """What the script checks before it starts a configuration: the paper-shaped step's plan from
    the tokenizer and the episodes alone."""
    import lopd_step_at_scale as scale

    w = scale.PRESETS["paper"]
    shape, lora = scale.predicted_plan("qwen3-4b", w, "lora", True, "cuda", "bf16")
    assert shape.rollouts == 32 and shape.num_queries == 32 and shape.n_ret == 3 and shape.item_tokens == 1024
    assert 2000 <= shape.seq_tokens <= 2100 and shape.action_tokens == 768 and shape.shared_prefix > 900
    _, full = scale.predicted_plan("qwen3-4b", w, "full", True, "cuda", "bf16")
    assert full.optimiser > 20 * lora.optimiser and full.total_bytes > lora.total_bytes
    _, no_ckpt = scale.predicted_plan("qwen3-4b", w, "lora", False, "cuda", "bf16")
    assert no_ckpt.activations > 4 * lora.activations


def test_a_random_qwen3_backbone_from_its_config_with_the_tiny_tokenizer(tmp_path, monkeypatch):
    """The GPU run's own path for the Qwen3 shapes (a backbone built from config numbers with
    random weights, the full 151,936-row vocabulary, the tiny tokenizer's ids a subset of it),
    made small: generation samples ids the tokenizer does not have, and a step runs."""
    import lopd_step_at_scale as scale

    small = {**scale.QWEN3["qwen3-4b"], "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64}
    monkeypatch.setitem(scale.QWEN3, "qwen3-4b", small)
    res = scale.run_config("qwen3-4b", "lora", "cpu", scale.PRESETS["tiny"], steps=1, checkpointing=True)
    assert res["params"] > 151936 * 32 and res["generate"]["episodes"] == 4
    assert math.isfinite(res["steps"][0]["kl"]) and res["steps"][0]["grad_norm_student"] > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_tiny_on_cpu_times_the_vllm_paths(tmp_path):
    """The colocated engine and the server path of the GPU script, at tiny shape on the CPU
    (`make test-vllm`): each starts, refreshes and rolls the batch out; a full student's server
    refresh is a restart on its saved weights."""
    pytest.importorskip("vllm")
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "LOPD_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--device", "cpu", "--student", "lora",
                           "full", "--steps", "1", "--rollout", "vllm", "vllm-server", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lora, full = json.loads(out.read_text())["results"]
    for g in (lora["generate_vllm"], lora["generate_vllm-server"], full["generate_vllm"], full["generate_vllm-server"]):
        assert "error" not in g and "skipped" not in g, g
        assert g["episodes"] == 4 and g["new_tokens"] > 0 and g["tokens_per_s"] > 0
        assert g["sec_start"] > 0 and g["sec_refresh"] > 0
    assert full["generate_vllm-server"]["sec_refresh"] > 5 * lora["generate_vllm-server"]["sec_refresh"]  # a restart
    assert "generate" not in lora  # no hf generate phase asked for
    assert "generate (vllm-server): start" in proc.stdout
