"""The memory plan's arithmetic (lopd_cli/train/memory_plan.py) against what is really there: the
parameters of real modules, and the bytes autograd keeps for the backward (saved-tensor hooks),
per decoder layer and for χ, in fp32 and under bf16 autocast."""

import pytest
import torch

from lopd_cli.train import memory_plan as mp

QWEN = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=384, vocab_size=1000, tie_word_embeddings=True)


def _qwen(**kw):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3Config(**{**QWEN, **kw}), dtype=torch.float32)


def _llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=96, num_hidden_layers=2, num_attention_heads=3,
                                                        num_key_value_heads=1, intermediate_size=256, vocab_size=500,
                                                        tie_word_embeddings=False), dtype=torch.float32)


@pytest.mark.parametrize("build", [_qwen, _llama], ids=["qwen3", "llama"])
def test_parameter_counts_are_the_modules(build):
    from peft import LoraConfig, get_peft_model

    model = build()
    shape = mp.ModelShape.from_config(model.config)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    assert shape.qk_norm == (model.config.model_type == "qwen3")
    lora = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert shape.lora_params(8) == sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)


def test_resampler_parameters_are_the_module():
    from lopd_cli.compose.composer import Resampler, ResamplerDims

    shape = mp.ModelShape.from_config(_qwen().config)
    for share in (True, False):
        r = Resampler(ResamplerDims(shape.hidden, shape.heads, shape.head_dim, 16, 3, 4, share))
        assert shape.resampler_params(16, 3, 4, share) == sum(p.numel() for p in r.parameters())


def _saved_bytes(fn, exclude) -> int:
    """Bytes of the distinct storages autograd saves while `fn` runs (parameters and `exclude` left out)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        k = t.untyped_storage().data_ptr()
        if k not in skip:
            seen[k] = max(seen.get(k, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["full", "lora", "frozen"])
@pytest.mark.parametrize("padded", [True, False])
def test_layer_formula_counts_what_autograd_saves(kind, precision, padded):
    """Two layers of a Qwen3 decoder, 2 rows × 96 tokens: the plan's per-layer bytes (+ keys and
    values, the mask and, under bf16 with fp32 weights, the weight casts) within 6 % of the
    saved-tensor bytes."""
    from peft import LoraConfig, get_peft_model

    model = _qwen()
    shape = mp.ModelShape.from_config(model.config)
    r = 8
    if kind == "lora":
        model = get_peft_model(model, LoraConfig(r=r, target_modules="all-linear", task_type="CAUSAL_LM"))
    for n, p in model.named_parameters():
        p.requires_grad_(kind == "full" or "lora_" in n)
    model.train()
    body = model.get_base_model().model if kind == "lora" else model.model
    B, T = 2, 96
    ids = torch.randint(0, 1000, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, T, dtype=torch.long)
    if padded:
        mask[1, -7:] = 0
    embeds = body.embed_tokens(ids).detach().requires_grad_(kind == "frozen")
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        got = _saved_bytes(lambda: body(inputs_embeds=embeds, attention_mask=mask, use_cache=False),
                           [*model.parameters(), embeds])
    t = mp.TrainShape(precision=precision, activation_checkpointing=False)
    p = mp.Pass("x", kind, B, T, padded=padded, r=r)
    predicted, _ = mp.pass_bytes(shape, p, t)
    predicted -= B * T * mp.outside_bytes_per_token(shape) - B * T * 4 * shape.hidden  # only the final norm's input
    assert got == pytest.approx(predicted, rel=0.06), (got, predicted)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("depth,queries,length", [(1, 8, 200), (8, 32, 256)])
def test_resampler_formula_counts_what_autograd_saves(precision, depth, queries, length):
    from lopd_cli.compose.composer import Resampler, ResamplerDims

    shape = mp.ModelShape.from_config(_qwen().config)
    chi = Resampler(ResamplerDims(shape.hidden, shape.heads, shape.head_dim, queries, depth, 4, True))
    x = torch.randn(6, length, shape.hidden, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        got = _saved_bytes(lambda: chi(x, torch.ones(6, length, dtype=torch.long)), [*chi.parameters(), *chi.buffers(), x])
    predicted = 6 * length * mp.resampler_bytes_per_token(shape, depth, precision, queries, length)
    assert got == pytest.approx(predicted, rel=0.1), (got, predicted)


def _paper_step(**kw) -> mp.StepShape:
    return mp.StepShape(rollouts=32, micro_batch=2, composer_micro_batch=2, seq_tokens=2048, shared_prefix=1000,
                        teacher_tokens=2200, teacher_shared_prefix=1100, action_tokens=768, **kw)


QWEN3_8B = mp.ModelShape(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                         vocab=151936, tied=False)


def test_gather_once_sharding_as_train_sharding_does_it():
    """`train.fsdp_gather: step` gathers every unit for the whole step: AdamW's states are 1/8, the
    weights and the teacher copy whole beside their shards, the gradients whole until reduced."""
    one = mp.plan(QWEN3_8B, _paper_step(), mp.TrainShape(student="full", teacher_copy=True))
    eight = mp.plan(QWEN3_8B, _paper_step(), mp.TrainShape(student="full", teacher_copy=True, world_size=8,
                                                            sharding="fsdp", fsdp_gather="step"))
    assert eight.optimiser == pytest.approx(one.optimiser / 8, rel=1e-6)
    for part in ("parameters", "teacher_copy"):
        assert getattr(eight, part) == pytest.approx(getattr(one, part) * 9 / 8, rel=1e-6)
    assert eight.gradients == one.gradients and eight.activations == one.activations
    # fp32 master weights, gradients and two AdamW states: 16 bytes per parameter of the backbone
    assert one.parameters + one.gradients + one.optimiser >= 16 * QWEN3_8B.params()
    # the teacher copy is loaded in train.teacher_dtype (model.dtype unless set), not the compute dtype
    assert one.teacher_copy == 4 * QWEN3_8B.params()
    assert mp.plan(QWEN3_8B, _paper_step(), mp.TrainShape(student="full", teacher_copy=True,
                                                          master_bytes=2)).teacher_copy == 2 * QWEN3_8B.params()
    assert mp.plan(QWEN3_8B, _paper_step(), mp.TrainShape(student="full", teacher_copy=True,
                                                          teacher_bytes=2)).teacher_copy == 2 * QWEN3_8B.params()


def test_per_layer_sharding_holds_shards_the_root_and_two_layers():
    """`train.fsdp_gather: layer` (the default): weights, gradients and AdamW's states 1/world, the
    root unit and two decoder layers whole beside them; the states fall as the world grows, and
    the rollout phase adds the student gathered whole."""
    m = QWEN3_8B
    root = m.vocab * m.hidden * (1 if m.tied else 2) + m.hidden
    plans = {w: mp.plan(m, _paper_step(), mp.TrainShape(student="full", teacher_copy=True, world_size=w,
                                                         sharding="fsdp" if w > 1 else "none"))
             for w in (1, 2, 4, 8)}
    one, eight = plans[1], plans[8]
    no_phi = mp.plan(m, _paper_step(), mp.TrainShape(student="full", teacher_copy=True, world_size=8, sharding="fsdp",
                                                     trains_composer=False))
    assert no_phi.gradients == pytest.approx(4 * (m.params() / 8 + root + 2 * m.layer_params()), rel=1e-6)
    assert eight.teacher_copy == pytest.approx(4 * (m.params() / 8 + root + 2 * m.layer_params()), rel=1e-6)
    assert eight.optimiser == pytest.approx(one.optimiser / 8, rel=1e-6)
    states = [plans[w].states for w in (1, 2, 4, 8)]
    assert states == sorted(states, reverse=True) and states[-1] < states[0] / 3
    assert eight.activations == one.activations  # each rank runs its own rows
    assert eight.rollout_weights == pytest.approx(one.parameters - eight.parameters, rel=0.01)
    assert one.rollout_weights == 0


def test_checkpointing_lora_and_precision_move_the_parts_the_right_way():
    base = mp.TrainShape(student="lora")
    off = mp.plan(QWEN3_8B, _paper_step(), base)
    on = mp.plan(QWEN3_8B, _paper_step(), mp.TrainShape(student="lora", activation_checkpointing=True))
    assert on.activations < off.activations / 4
    assert (on.parameters, on.gradients, on.optimiser) == (off.parameters, off.gradients, off.optimiser)
    full = mp.plan(QWEN3_8B, _paper_step(), mp.TrainShape(student="full"))
    extra = QWEN3_8B.params() - QWEN3_8B.lora_params(16)  # what a full student trains beyond the LoRA
    assert full.gradients - off.gradients == 4 * extra and full.optimiser - off.optimiser == 8 * extra
    fp32 = mp.plan(QWEN3_8B, _paper_step(), mp.TrainShape(student="lora", precision="fp32"))
    assert fp32.per_token["student"] > off.per_token["student"]
    vllm = mp.plan(QWEN3_8B, _paper_step(), mp.TrainShape(vllm_gpu_memory_utilization=0.5, device_bytes=141 * 2**30))
    assert vllm.total_bytes - off.total_bytes == int(0.5 * 141 * 2**30)
