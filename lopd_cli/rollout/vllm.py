"""The vLLM backend: student rollouts through a vLLM engine, the student LoRA as a `LoRARequest`.

vLLM loads the backbone from its transformers directory (the resolved `model.backbone`; the
in-memory model is not shared), so the student's weights reach it as a saved adapter: a backend
snapshots the model's "student" adapter when it is made and again on `refresh()`, and each
snapshot is served under a new `lora_int_id` (vLLM caches adapters by id). The runner makes a
backend per `run_episodes` call, so every training step samples from the latest adapter; the
engine itself is built once per process and reused (starting one takes 20–80 s on a CPU).

Records are the hf backend's: the sampled ids exactly as sampled (the stop id included when one
was sampled; only `stop_ids` stop, not the model's own EOS list), and per token the log-prob at
the sampling temperature (`logprobs_mode="processed_logprobs"`; greedy: temperature 1). Unlike
the hf backend, with `top_p < 1` the recorded log-prob is that of the top-p truncated
distribution (vLLM applies top-p before taking log-probs). Each prompt gets its own seed
(`params.seed + row`), so a rollout does not depend on the rest of its batch.

What it simplifies: one adapter (the student) per engine; a full fine-tuned student
(`model.student: full`) cannot be refreshed and is refused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from lopd_cli.errors import LopdError
from lopd_cli.rollout.base import Generation, SamplingParams

# The ranks vLLM can serve (`max_lora_rank` is one of these).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# KV cache on a CPU host when neither VLLM_CPU_KVCACHE_SPACE nor kv_cache_memory_bytes is given.
DEFAULT_CPU_KV_CACHE_GIB = 2

_ENGINES: dict[tuple, object] = {}
_ENGINE_LOCK = threading.Lock()
_NEXT_LORA_ID = [0]


def _new_lora_id() -> int:
    _NEXT_LORA_ID[0] += 1
    return _NEXT_LORA_ID[0]


def lora_rank_bucket(r: int) -> int:
    """The smallest rank vLLM supports that holds an adapter of rank r."""
    for bucket in VLLM_LORA_RANKS:
        if r <= bucket:
            return bucket
    raise LopdError(f"model.lora.r: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got {r}")


def backbone_dir(model) -> str:
    """The transformers directory the (possibly peft-wrapped) model was loaded from."""
    path = getattr(model.config, "_name_or_path", "") or ""
    if not path or not Path(path).is_dir():
        raise LopdError(
            f"rollout.backend vllm: the backbone must be a local transformers directory (got '{path}')"
        )
    return str(path)


def _dtype_name(model) -> str:
    import torch

    dtype = next(model.parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def get_engine(path: str, dtype: str, max_lora_rank: int | None, **engine_kwargs):
    """One `vllm.LLM` per (backbone dir, dtype, LoRA rank, extra args) for the whole process."""
    key = (path, dtype, max_lora_rank, tuple(sorted(engine_kwargs.items())))
    with _ENGINE_LOCK:
        if key not in _ENGINES:
            from vllm import LLM

            kwargs = dict(model=path, dtype=dtype, logprobs_mode="processed_logprobs", seed=0,
                          enable_prefix_caching=True)
            if max_lora_rank is not None:
                kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=max_lora_rank)
            if _on_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kwargs["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_GIB * 2**30
            kwargs.update(engine_kwargs)
            _ENGINES[key] = LLM(**kwargs)
        return _ENGINES[key]


def shutdown_engines() -> None:
    """Drop every cached engine (their worker processes end with them)."""
    with _ENGINE_LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for llm in engines:
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    import gc

    gc.collect()


class VLLMBackend:
    """`Backend` over a shared vLLM engine serving the backbone plus the student adapter."""

    def __init__(self, model, tokenizer, **engine_kwargs):
        from lopd_cli.models import adapters as ad

        self.model = model
        self.tokenizer = tokenizer
        self.lora_request = None
        self._snapshot_dir: Path | None = None
        rank = None
        if ad.is_wrapped(model):
            if not ad.has_student_adapter(model):
                raise LopdError("rollout.backend vllm needs a LoRA student (model.student: lora), "
                                "a full fine-tuned student cannot be refreshed in vLLM; use backend: hf")
            rank = lora_rank_bucket(int(model.peft_config[ad.STUDENT].r))
        self.llm = get_engine(backbone_dir(model), _dtype_name(model), rank, **engine_kwargs)
        if rank is not None:
            self.refresh()

    def refresh(self, adapter_dir: str | Path | None = None) -> None:
        """Serve the student adapter saved in `adapter_dir` (peft format), or a fresh snapshot of
        the in-memory model's student adapter, under a new LoRA id."""
        from vllm.lora.request import LoRARequest

        from lopd_cli.models import adapters as ad

        if adapter_dir is None:
            snapshot = Path(tempfile.mkdtemp(prefix="lopd-vllm-lora-"))
            ad.save_adapter(self.model, ad.STUDENT, snapshot)
            self._drop_snapshot()
            self._snapshot_dir = snapshot
            adapter_dir = snapshot
        lora_id = _new_lora_id()
        self.lora_request = LoRARequest(f"student-{lora_id}", lora_id, str(adapter_dir))

    def _drop_snapshot(self) -> None:
        # vLLM reads the files when a request first uses the id; an older snapshot is unused by then.
        if self._snapshot_dir is not None:
            shutil.rmtree(self._snapshot_dir, ignore_errors=True)
            self._snapshot_dir = None

    def __del__(self):
        self._drop_snapshot()

    def sampling_params(self, params: SamplingParams, stop_ids: list[int], row: int):
        from vllm import SamplingParams as VSamplingParams

        greedy = params.temperature <= 0
        return VSamplingParams(
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(stop_ids),
            ignore_eos=True,  # only stop_ids end a turn, as in the hf backend
            logprobs=0,  # the sampled token's log-prob only
            seed=None if greedy else (params.seed + row) % (2**63),
            detokenize=False,
            skip_special_tokens=False,
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop_ids: list[int]) -> list[Generation]:
        if not prompts:
            return []
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        sampling = [self.sampling_params(params, stop_ids, row) for row in range(len(prompts))]
        outputs = self.llm.generate(requests, sampling, lora_request=self.lora_request, use_tqdm=False)
        stops = set(stop_ids)
        results = []
        for out in outputs:
            comp = out.outputs[0]
            toks = list(comp.token_ids)
            lps = [step[tok].logprob for step, tok in zip(comp.logprobs or [], toks)]
            if len(lps) != len(toks):
                raise LopdError(f"vLLM returned {len(lps)} log-probs for {len(toks)} tokens")
            results.append(Generation(toks, lps, bool(toks) and toks[-1] in stops))
        return results
