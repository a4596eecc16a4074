"""Export round trip: checkpoint (tiny + LoRA "student") → plain transformers dir → same logits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lopd_cli.errors import LopdError
from lopd_cli.models.backbone import load_backbone, resolve_backbone
from lopd_cli.models.student import read_checkpoint, resolve_checkpoint
from lopd_cli.results.export import CHECK_CONVERSATIONS, check_inputs, export_adapter, export_merged, prompt_logits


def make_checkpoint(run_dir: Path, step: int = 3, latest_as_file: bool = False) -> Path:
    """A checkpoint in the trainer's layout: tiny backbone + a perturbed LoRA adapter "student"."""
    from peft import LoraConfig, get_peft_model

    model, _ = load_backbone("tiny", device="cpu")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), adapter_name="student")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    step_dir = run_dir / "checkpoints" / f"step_{step}"
    step_dir.mkdir(parents=True)
    peft_model.save_pretrained(str(step_dir / "student"))  # writes student/student/ (named adapter)
    (step_dir / "checkpoint.json").write_text(json.dumps({
        "step": step, "algo": "lopd", "backbone": "tiny",
        "backbone_path": str(resolve_backbone("tiny")), "student": "lora",
    }))
    latest = run_dir / "checkpoints" / "latest"
    if latest_as_file:
        latest.write_text(f"step_{step}\n")
    else:
        latest.symlink_to(f"step_{step}")
    return step_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("run") / "run1")


def adapter_logits(step_dir: Path) -> list:
    from peft import PeftModel

    base, tok = load_backbone("tiny", device="cpu")
    plain = prompt_logits(base, check_inputs(tok))
    model = PeftModel.from_pretrained(base, str(step_dir / "student" / "student"), adapter_name="student")
    return plain, prompt_logits(model, check_inputs(tok))


def test_resolve_checkpoint_forms(tmp_path, checkpoint):
    run = checkpoint.parent.parent
    assert resolve_checkpoint(run) == checkpoint.resolve()
    assert resolve_checkpoint(run / "checkpoints" / "latest") == checkpoint.resolve()
    assert resolve_checkpoint(checkpoint) == checkpoint.resolve()
    assert resolve_checkpoint("latest", runs_dir=run.parent) == checkpoint.resolve()
    other = make_checkpoint(tmp_path / "run2", step=7, latest_as_file=True)
    assert resolve_checkpoint(tmp_path / "run2") == other.resolve()
    assert read_checkpoint(other).step == 7
    with pytest.raises(LopdError, match="checkpoint.json"):
        resolve_checkpoint(tmp_path)


@pytest.mark.slow
def test_merged_export_matches_backbone_plus_adapter(tmp_path, checkpoint):
    out = tmp_path / "exported"
    result = export_merged(read_checkpoint(checkpoint), out)
    assert result.max_abs_logit_diff <= 1e-4
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.startswith("adapter_") for n in names)

    plain, with_adapter = adapter_logits(checkpoint)
    # The adapter really changes the model, so matching it is not trivial.
    assert max(float((a - b).abs().max()) for a, b in zip(plain, with_adapter)) > 1e-2

    # Reload in a process that imports only transformers (lopd imports are refused) and
    # compare its logits with backbone + adapter computed here.
    expected = tmp_path / "expected.pt"
    torch.save(with_adapter, expected)
    script = textwrap.dedent(f"""
        import sys, importlib.abc
        class NoLopd(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "lopd_cli":
                    raise ImportError("lopd must not be needed to load an exported model")
        sys.meta_path.insert(0, NoLopd())
        import json, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained({str(out)!r})
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, dtype=torch.float32).eval()
        convs = json.loads({json.dumps(CHECK_CONVERSATIONS)!r})
        expected = torch.load({str(expected)!r})
        diffs = []
        for conv, ref in zip(convs, expected):
            ids = tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
            with torch.no_grad():
                diffs.append(float((model(input_ids=ids).logits - ref).abs().max()))
        print(json.dumps({{"max_diff": max(diffs), "latent_token": "<|LATENT_PH|>" in tok.get_vocab(),
                          "has_template": bool(tok.chat_template), "modules": sorted(m for m in sys.modules if m.startswith(("lopd", "peft")))}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["max_diff"] <= 1e-4
    assert report["latent_token"] and report["has_template"]
    assert report["modules"] == []


def test_export_refuses_non_empty_out(tmp_path, checkpoint):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "x").write_text("keep me")
    with pytest.raises(LopdError, match="not empty"):
        export_merged(read_checkpoint(checkpoint), out)
    assert (out / "x").read_text() == "keep me"


def test_adapter_only_export_loads_with_peft(tmp_path, checkpoint):
    from peft import PeftModel

    out = tmp_path / "adapter"
    export_adapter(read_checkpoint(checkpoint), out)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    base, tok = load_backbone("tiny", device="cpu")
    model = PeftModel.from_pretrained(base, str(out))
    got = prompt_logits(model, check_inputs(tok))
    _, expected = adapter_logits(checkpoint)
    assert max(float((a - b).abs().max()) for a, b in zip(got, expected)) <= 1e-5


def test_export_check_failure_is_a_clear_error_and_leaves_nothing(tmp_path, checkpoint):
    out = tmp_path / "bf16"
    # bfloat16 weights cannot match float32 backbone + adapter within 1e-4: the check must say so.
    with pytest.raises(LopdError, match="export check failed"):
        export_merged(read_checkpoint(checkpoint), out, dtype="bfloat16", atol=1e-4)
    assert not out.exists()


def test_full_student_export(tmp_path):
    """student: full — the checkpoint holds a whole model; export copies it with the backbone's
    generation defaults and checks its logits the same way."""
    model, tok = load_backbone("tiny", device="cpu")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    step = tmp_path / "run" / "checkpoints" / "step_2"
    model.save_pretrained(str(step / "student"))
    tok.save_pretrained(str(step / "student"))
    (step / "student" / "generation_config.json").unlink()
    (step / "checkpoint.json").write_text(json.dumps({
        "step": 2, "algo": "grpo", "backbone": "tiny", "backbone_path": str(resolve_backbone("tiny")), "student": "full"}))
    result = export_merged(read_checkpoint(resolve_checkpoint(step)), tmp_path / "out")
    assert result.max_abs_logit_diff <= 1e-4
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    base, _ = load_backbone("tiny", device="cpu")
    plain = prompt_logits(base, check_inputs(tok))
    from transformers import AutoModelForCausalLM
    exported = prompt_logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")), check_inputs(tok))
    assert max(float((a - b).abs().max()) for a, b in zip(plain, exported)) > 1e-3  # the fine-tuned weights, not the base
    with pytest.raises(LopdError, match="no adapter"):
        export_adapter(read_checkpoint(step), tmp_path / "adapter")
