"""Pick a generation backend by the recipe's name (`rollout.backend`).

Its own module so that the interface (base.py) never imports the backends that implement it.
"""

from __future__ import annotations

from lopd_cli.errors import LopdError
from lopd_cli.rollout.base import Backend


def make_backend(name: str, model, tokenizer, rollout=None) -> Backend:
    """The recipe's `rollout.backend` for an already loaded model (`rollout`: the recipe's
    rollout section, for the backends' own settings)."""
    if name == "hf":
        from lopd_cli.rollout.hf import HFBackend

        return HFBackend(model, tokenizer)
    if name == "vllm":
        try:
            from lopd_cli.rollout.vllm import VLLMBackend  # type: ignore[import-not-found]
        except ImportError as e:
            raise LopdError(f"rollout.backend: vllm is not available here ({e}); use backend: hf") from None
        return VLLMBackend(model, tokenizer,
                           gpu_memory_utilization=rollout.vllm_gpu_memory_utilization if rollout is not None else None)
    if name == "vllm-server":
        from lopd_cli.rollout.vllm_server import VLLMServerBackend

        if rollout is None or not rollout.server_url:
            raise LopdError("rollout.backend vllm-server needs rollout.server_url (the vLLM server's URL)")
        return VLLMServerBackend(model, tokenizer, rollout.server_url, adapter_dir=rollout.server_adapter_dir,
                                 timeout_s=rollout.server_timeout_s, max_model_len=rollout.max_prompt_tokens,
                                 gpu_memory_utilization=rollout.vllm_gpu_memory_utilization)
    raise LopdError(f"rollout.backend: unknown backend '{name}' (hf, vllm or vllm-server)")
