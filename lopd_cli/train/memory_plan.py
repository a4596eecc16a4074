"""The memory plan: bytes per device of one LOPD step, from shapes alone (no model is built).

    plan(ModelShape, StepShape, TrainShape) -> MemoryPlan

Parts (each per device, during the step; `sharding: fsdp` below):

    parameters     the backbone in model.dtype, the LoRA adapters (student, encoder ψ, and the frozen
                   cold-start encoder the anchor term reads), χ and its frozen cold-start copy
    gradients      one per trainable parameter, in its dtype (student: LoRA or the whole backbone;
                   composer: ψ's LoRA and χ)
    optimiser      AdamW: two fp32 states per trainable parameter
    teacher copy   a full student's frozen copy of the backbone (train.teacher base|init;
                   train/loop.py load_teacher_copy), in `train.teacher_dtype` (bf16 where the device
                   has fast bf16, by default); none for a LoRA student (the teacher is the backbone
                   with its adapters off) or a live teacher
    activations    what autograd keeps for the backward of the largest pass (below)
    logits         `train.logit_chunk` rows of logits over the vocabulary and their transients
                   (train/losses.py never holds more than one chunk)
    vLLM           rollout.vllm_gpu_memory_utilization × device memory, when vLLM shares the device

Activations. The step's graphs live one phase at a time (train/step.py): a composer chunk
(`composer_micro_batch` rows) holds the encoder ψ over the chunk's n_ret retrieved items, χ, the
teacher with gradient into the latents and, for a moment, the student's no-grad forward, at once;
a student chunk (`composer_micro_batch` rows on composer steps, `micro_batch` otherwise) holds
the student. The peak is the larger phase. What one decoder layer keeps, in elements (d hidden,
q = heads·head_dim, k = kv_heads·head_dim, I intermediate, r LoRA rank, h heads):

    per query token, every pass   both norms' inputs 2d, the q/k-norm inputs q + k (Qwen3),
                                  attention's q and output 2q (the output is o_proj's input too)
                                  and its log-sum-exp h
        student, LoRA             + the norms' outputs 2d (read by the LoRA A's), the MLP's gate,
                                  up, silu and product 4I, the 7 LoRA A outputs 7r
        student, full             + each norm's normalised state and output 4d, the q/k norms'
                                  outputs q + k, 4I (every weight needs its input)
        frozen teacher            + gate, up and silu 3I (a frozen linear keeps no input)
    per key position and row      k and v over every key the row's queries read (the shared
                                  prefix's too): 2q when a mask is passed (transformers then
                                  repeats them to every head), else 2k
    per layer and pass            the attention mask as the float bias SDPA builds: rows·T_q·T_k

With a shared prefix (compose/latent.py decoder_hidden) the prefix's tokens count once (and not
at all for a frozen teacher, whose prefix needs no gradient). bf16 autocast with fp32 master
weights keeps the residual-stream tensors (norm inputs, q/k-norm inputs, normalised states, lse)
in fp32 and the rest in bf16; each LoRA A (each linear, for a full student) keeps its own bf16
cast of its input; every frozen fp32 weight a graph reads is cast to bf16 on each call and that
copy is kept (a weight that trains is cast once per autocast region). Outside the layers: the
embedding, final-norm and hidden-state tensors (3d fp32 per token). χ keeps, per item token,
its input projection's input and output (2d) and per block the key/value input, keys and values
and attention weights over the item and its K latents, (1 + K/L)(d + 2·inner + h·K), plus the K
latents' feed-forward. These counts are checked against autograd's saved tensors (fp32 and bf16
autocast) in tests/test_memory_plan.py.

Activation checkpointing (`train.activation_checkpointing`) keeps each layer's input (d fp32 per
token per layer), once per pass the boolean mask, and for a shared prefix its one-row keys and
values (models/activation_checkpointing.py); the backward recomputes one layer at a time, so one
layer of the largest pass (its activations, mask bias and weight casts) comes on top.

Sharding (`train.parallel: fsdp`, train/sharding.py). Per-layer gathering (`train.fsdp_gather:
layer`, the default): each device holds 1/world of every weight, gradient and AdamW state, plus
the root unit whole (embeddings, final norm, LM head, and its gradient until the end of the
update) and two decoder layers whole at a time (the one running and the one FSDP2 prefetches;
for a full student their gradients too, until reduce-scattered), for the student and for a
teacher copy alike. χ stays replicated. The rollout phase gathers the student whole
(`rollout_weights`: what it adds; no gradient or activation is live then) unless a colocated vLLM
engine samples (its copy of the weights is inside vLLM's share). Gather-once
(`train.fsdp_gather: step`) keeps every unit whole for the step beside its shard, and the whole
local gradients of what trains; only AdamW's states (and its step's transient) are 1/world.
Activations are per device (each rank runs its own rows).

Measured against this on a CPU (fp32): benchmarks/memory_plan_check.py. What it does not count:
the CUDA context (~0.5–1 GiB per process, outside torch's allocator), allocator fragmentation,
the rollout phase's KV cache (hf backend), and anything a model-specific kernel keeps beyond the
eager transformers layers described above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

GIB = 2**30
MIN_SHARED_PREFIX = 64  # compose/latent.py: shorter shared prefixes get one full pass

PassKind = Literal["lora", "full", "frozen"]


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    qk_norm: bool = True  # Qwen3's per-head RMSNorm on q and k

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        cfg = getattr(config, "text_config", config)
        heads = cfg.num_attention_heads
        return cls(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=heads,
                   kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
                   tied=bool(getattr(cfg, "tie_word_embeddings", True)),
                   qk_norm=getattr(cfg, "model_type", "") in ("qwen3", "qwen3_moe", "olmo2"))

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def k(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_params(self) -> int:
        """The seven projections of one decoder layer."""
        d, q, k, i = self.hidden, self.q, self.k, self.intermediate
        return d * q + 2 * d * k + q * d + 3 * d * i

    def layer_params(self) -> int:
        return self.linear_params() + 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def params(self) -> int:
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return emb + self.layers * self.layer_params() + self.hidden

    def lora_params(self, r: int) -> int:
        """LoRA on every linear of every layer ("all-linear"; the LM head is left out)."""
        d, q, k, i = self.hidden, self.q, self.k, self.intermediate
        return self.layers * r * ((d + q) + 2 * (d + k) + (q + d) + 2 * (d + i) + (i + d))

    def resampler_params(self, num_queries: int, depth: int, ff_mult: int, share_layers: bool) -> int:
        """χ (compose/composer.py Resampler) with inner width heads·head_dim."""
        d, inner = self.hidden, self.q
        block = (4 * d + d * inner + 2 * d * inner + inner * d) + (2 * d + 2 * ff_mult * d * d)
        return num_queries * d + 2 * (d * d + d) + 2 * d + (1 if share_layers else depth) * block


@dataclass(frozen=True)
class StepShape:
    """One step's sequences. Lengths in tokens; `action_tokens` per sequence."""

    rollouts: int
    micro_batch: int
    composer_micro_batch: int
    seq_tokens: int  # the longest student sequence (the padded length)
    shared_prefix: int  # what every student row shares (compose/latent.py shared_prefix_len)
    teacher_tokens: int  # the longest teacher sequence (latents included)
    teacher_shared_prefix: int
    action_tokens: int
    n_ret: int = 3
    num_queries: int = 32  # K latents per item
    item_tokens: int = 1024  # encoder tokens per retrieved item
    logit_chunk: int = 1024
    top_m: int = 20
    items_padded: bool = False  # encoder batches of unequal items (a mask, repeated k/v)


@dataclass(frozen=True)
class TrainShape:
    student: Literal["lora", "full"] = "lora"
    lora_r: int = 16
    encoder_lora_r: int = 8
    precision: Literal["bf16", "fp32"] = "bf16"  # the compute dtype (model.autocast_bf16 resolved)
    master_bytes: int = 4  # model.dtype: float32 4, bfloat16 2
    optimiser_states: int = 2  # AdamW
    teacher_copy: bool = False
    activation_checkpointing: bool = False
    world_size: int = 1
    sharding: Literal["none", "fsdp"] = "none"
    trains_composer: bool = True
    anchor_copy: bool = True  # the frozen cold-start encoder + χ of the anchor term
    composer_depth: int = 8
    composer_ff_mult: int = 4
    composer_share_layers: bool = True
    device: Literal["cuda", "cpu"] = "cuda"
    vllm_gpu_memory_utilization: float = 0.0  # 0: vLLM does not share this device
    device_bytes: int | None = None
    fsdp_gather: Literal["layer", "step"] = "layer"  # train.fsdp_gather
    teacher_bytes: int | None = None  # the teacher copy's dtype (train.teacher_dtype); None: master_bytes
    fused_adamw: bool = False  # CUDA (train/optim.py adamw): no foreach temporaries at the step
    encode_batch_size: int = 8  # items per encoder call (Composer.encode_batch_size)


@dataclass
class MemoryPlan:
    parameters: int
    gradients: int
    optimiser: int
    teacher_copy: int
    activations: int
    logits: int
    vllm: int
    optimiser_step: int  # AdamW's transient at its step (when no activation is held)
    rollout_weights: int = 0  # per-layer FSDP: what gathering the student whole for the rollouts adds
    per_token: dict = field(default_factory=dict)  # activation bytes per token, all layers, by pass
    phases: dict = field(default_factory=dict)  # activation bytes of each phase
    notes: list = field(default_factory=list)

    @property
    def states(self) -> int:
        return self.parameters + self.gradients + self.optimiser + self.teacher_copy

    @property
    def total_bytes(self) -> int:
        """The step's peak: states + the larger of (activations + logits) and the optimiser step."""
        return self.states + max(self.activations + self.logits, self.optimiser_step) + self.vllm

    @property
    def rollout_bytes(self) -> int:
        """The rollout phase's states: the step's states, the student gathered whole under per-layer
        FSDP (no activation is live; the hf backend's KV cache is not counted)."""
        return self.states + self.rollout_weights + self.vllm

    def step_growth(self, first: bool) -> int:
        """What a step adds to the loaded model (parameters, and the optimiser states after the
        first step, already there): its gradients, then the larger of the activation peak and the
        optimiser's step (a first step creates AdamW's states there)."""
        if first:
            return self.gradients + max(self.activations + self.logits, self.optimiser + self.optimiser_step)
        return self.gradients + max(self.activations + self.logits, self.optimiser_step)

    def as_dict(self) -> dict:
        g = lambda b: round(b / GIB, 3)  # noqa: E731
        return {"parameters_gib": g(self.parameters), "gradients_gib": g(self.gradients),
                "optimiser_gib": g(self.optimiser), "teacher_copy_gib": g(self.teacher_copy),
                "activations_gib": g(self.activations), "logits_gib": g(self.logits), "vllm_gib": g(self.vllm),
                "optimiser_step_gib": g(self.optimiser_step), "total_gib": g(self.total_bytes),
                "rollout_weights_gib": g(self.rollout_weights), "rollout_total_gib": g(self.rollout_bytes),
                "first_step_growth_gib": g(self.step_growth(first=True)),
                "later_step_growth_gib": g(self.step_growth(first=False)),
                "per_token_kib": {k: round(v / 1024, 1) for k, v in self.per_token.items()},
                "phases_gib": {k: g(v) for k, v in self.phases.items()}, "notes": list(self.notes)}


# ----------------------------------------------------------------------------- activations


def layer_bytes_per_token(m: ModelShape, kind: PassKind, precision: str, r: int = 0) -> float:
    """Bytes one decoder layer keeps per query token for the backward: everything but the keys
    and values (`kv_bytes_per_key`), the mask and the weight casts."""
    d, q, k, i, h = m.hidden, m.q, m.k, m.intermediate, m.heads
    qk = (q + k) if m.qk_norm else 0
    if precision == "fp32":
        b = 2 * d + qk + 2 * q + h  # norm inputs, q/k-norm inputs, attention's q and output, lse
        if kind == "lora":
            b += 2 * d + 4 * i + 7 * r
        elif kind == "full":
            b += 4 * d + qk + 4 * i
        else:
            b += 3 * i
        return 4.0 * b
    f32 = 2 * d + qk + h  # residual-stream tensors and the lse stay fp32
    b16 = 2 * q
    if kind == "lora":
        b16 += 5 * d + 4 * i + 7 * r  # five bf16 input casts (q, k, v, gate, up), the MLP, LoRA A outputs
    elif kind == "full":
        f32 += 2 * d + qk  # normalised states for the norm weights' gradients
        b16 += 5 * d + 4 * i
    else:
        b16 += 3 * i
    return 4.0 * f32 + 2.0 * b16


def kv_bytes_per_key(m: ModelShape, precision: str, padded: bool) -> float:
    """Attention's saved keys and values per key position and row (every key a query reads, the
    shared prefix's included): repeated to every head when a mask is passed."""
    return 2.0 * (m.q if padded else m.k) * (4 if precision == "fp32" else 2)


def outside_bytes_per_token(m: ModelShape) -> float:
    """Embedding output, final-norm input and the hidden states handed to the losses (fp32)."""
    return 3.0 * 4 * m.hidden


def resampler_bytes_per_token(m: ModelShape, depth: int, precision: str, num_queries: int, item_tokens: int) -> float:
    """χ's saved tensors per encoded item token: its input projection's input and output once,
    then per block the keys/values' input, keys and values and the attention weights over the
    item and the K latents, and the K latents' feed-forward (compose/composer.py Resampler)."""
    d, inner, h, K, L = m.hidden, m.q, m.heads, num_queries, max(1, item_tokens)
    over = 1 + K / L
    if precision == "fp32":
        return 4.0 * (2 * d + depth * (over * (d + 2 * inner + h * K) + 12 * K * d / L))
    return 6.0 * d + depth * (over * (2 * d + 4 * inner + 6 * h * K) + 24 * K * d / L)


@dataclass(frozen=True)
class Pass:
    """One forward with a graph: `rows` rows of `tokens` (of which `prefix` are shared and run
    once, on one row, when long enough) through every layer."""

    name: str
    kind: PassKind
    rows: int
    tokens: int
    prefix: int = 0
    prefix_graph: bool = True  # False: the shared prefix needs no gradient (a frozen teacher)
    padded: bool = True
    r: int = 0
    weight_cast_copies: int = 1  # frozen fp32 weights cast to bf16 and kept, per call


def pass_bytes(m: ModelShape, p: Pass, t: TrainShape) -> tuple[float, float]:
    """(bytes this pass keeps for its backward, bytes of one layer's recompute on top) — the
    second is 0 without checkpointing. With a shared prefix (compose/latent.py decoder_hidden) the
    prefix runs once on one row (no mask) and the rows' rest reads its repeated keys."""
    shared = p.rows > 1 and p.prefix >= MIN_SHARED_PREFIX
    q_len = p.tokens - p.prefix if shared else p.tokens
    head = p.prefix if (shared and p.prefix_graph) else 0
    per_q = layer_bytes_per_token(m, p.kind, t.precision, p.r)
    layer = (p.rows * q_len * (per_q + kv_bytes_per_key(m, t.precision, p.padded))
             + p.rows * (p.tokens - q_len) * kv_bytes_per_key(m, t.precision, p.padded)
             + head * (per_q + kv_bytes_per_key(m, t.precision, False)))
    mask = p.rows * q_len * p.tokens * (4 if t.precision == "fp32" else 2) if p.padded else 0
    casts = 2.0 * m.linear_params() * p.weight_cast_copies if (t.precision == "bf16" and t.master_bytes == 4) else 0.0
    tokens = p.rows * q_len + head
    outside = tokens * outside_bytes_per_token(m)
    if not t.activation_checkpointing:
        return m.layers * (layer + mask + casts) + outside, 0.0
    # kept: each layer's input, the boolean mask once, and (shared prefix) the one-row prefix keys
    # and values the replayable caches hold for the recompute (models/activation_checkpointing.py)
    cb = 4 if t.precision == "fp32" else 2
    kept = (m.layers * tokens * 4 * m.hidden + (p.rows * q_len * p.tokens if p.padded else 0) + outside
            + (m.layers * p.prefix * 2 * m.k * cb if shared else 0))
    return kept, layer + mask + casts


def nograd_forward_bytes(m: ModelShape, rows: int, tokens: int, prefix: int, precision: str) -> float:
    """The peak of a forward without gradient (the composer pass's student log-probs, held beside
    the composer's graphs): every layer's keys and values in the cache, one layer's working set
    (the MLP's three I-wide tensors, the keys and values repeated to every head, the mask bias)
    and the output states."""
    cb = 4 if precision == "fp32" else 2
    q_len = tokens - prefix if (rows > 1 and prefix >= MIN_SHARED_PREFIX) else tokens
    cache = m.layers * rows * tokens * 2 * m.k * cb
    work = rows * q_len * (3 * m.intermediate + 2 * m.hidden) * cb + rows * tokens * 2 * m.q * cb
    mask = rows * q_len * tokens * cb
    return cache + work + mask + rows * tokens * m.hidden * 4


def plan(m: ModelShape, s: StepShape, t: TrainShape) -> MemoryPlan:
    """Bytes per device of one LOPD step (a composer step: the larger one). See the module docstring."""
    full = t.student == "full"
    shard = t.world_size if t.sharding == "fsdp" else 1
    cbytes = 2 if t.precision == "bf16" else 4
    backbone = m.params()
    lora_s = 0 if full else m.lora_params(t.lora_r)
    lora_e = m.lora_params(t.encoder_lora_r)
    chi = m.resampler_params(s.num_queries, t.composer_depth, t.composer_ff_mult, t.composer_share_layers)
    frozen_copies = (lora_e + chi) if t.anchor_copy else 0
    params = backbone * t.master_bytes + (lora_s + lora_e + chi + frozen_copies) * 4
    trainable_student = backbone if full else lora_s
    trainable_master = trainable_student * (t.master_bytes if full else 4)
    trainable_composer = (lora_e + chi) if t.trains_composer else 0
    grads = trainable_master + trainable_composer * 4
    optimiser = t.optimiser_states * 4 * (trainable_student + trainable_composer)
    teacher_bytes = t.teacher_bytes or t.master_bytes
    teacher = backbone * teacher_bytes if (full and t.teacher_copy) else 0
    notes = []

    # The passes. A live full-student teacher (no copy) reads weights that train: it keeps what a
    # full pass keeps, and its shared prefix builds a graph too.
    live_teacher = full and not t.teacher_copy
    cmb = min(s.composer_micro_batch, s.micro_batch)
    items = cmb * s.n_ret
    calls = math.ceil(items / t.encode_batch_size)
    kind = "full" if full else "lora"
    # Weights that train are cast once per autocast region (cached); frozen ones (the teacher
    # copy's too: it is in model.dtype) on every call.
    student = Pass("student", kind, s.micro_batch, s.seq_tokens, s.shared_prefix, r=t.lora_r)
    teacher_pass = Pass("teacher", "full" if live_teacher else "frozen", cmb, s.teacher_tokens,
                        s.teacher_shared_prefix, prefix_graph=live_teacher)
    # a full student's encoder shares the teacher's autocast region, and so its cached weight casts,
    # unless the teacher is a copy
    encoder = Pass("encoder", kind, items, s.item_tokens, 0, padded=s.items_padded, r=t.encoder_lora_r,
                   weight_cast_copies=(1 if t.teacher_copy else 0) if full else calls)
    phases = {"student_chunk": sum(pass_bytes(m, student, t))}
    if t.trains_composer and cmb < s.micro_batch:  # on composer steps the student runs in composer chunks
        phases["student_chunk_composer_step"] = sum(pass_bytes(m, replace(student, rows=cmb), t))
    kv = kv_bytes_per_key(m, t.precision, True)
    per_token = {"student": m.layers * (layer_bytes_per_token(m, student.kind, t.precision, t.lora_r) + kv),
                 "teacher": m.layers * (layer_bytes_per_token(m, teacher_pass.kind, t.precision) + kv),
                 "encoder": m.layers * (layer_bytes_per_token(m, encoder.kind, t.precision, t.encoder_lora_r)
                                        + kv_bytes_per_key(m, t.precision, s.items_padded)),
                 "resampler": resampler_bytes_per_token(m, t.composer_depth, t.precision, s.num_queries,
                                                        s.item_tokens)}
    if t.activation_checkpointing:
        per_token["checkpointed"] = m.layers * 4.0 * m.hidden
    if t.trains_composer:
        t_kept, t_re = pass_bytes(m, teacher_pass, t)
        e_kept, e_re = pass_bytes(m, encoder, t)
        chi_bytes = items * s.item_tokens * per_token["resampler"]
        # the teacher's states in the student layout and the chunk's latents, held across the phase
        held = cmb * s.seq_tokens * m.hidden * 4 + cmb * s.n_ret * s.num_queries * m.hidden * 4
        nograd = nograd_forward_bytes(m, cmb, s.seq_tokens, s.shared_prefix, t.precision)
        phases["composer_chunk"] = t_kept + e_kept + chi_bytes + held + max(t_re, e_re, nograd)
    if full and t.trains_composer and not t.teacher_copy:
        notes.append("full student without a teacher copy: the teacher's and the encoder's graphs run through "
                     "the weights that train (what the current code does)")
    activations = max(phases.values())
    # logits: the bf16 (or fp32) chunk, its fp32 copy, the tail's masked copy and the exp inside
    # logsumexp, then its gradient in the backward; under autocast the LM head's fp32 weight is
    # cast to bf16 on each chunk as well.
    chunk = min(s.logit_chunk, max(1, s.micro_batch * s.action_tokens))
    logits = chunk * m.vocab * (4 * 3 + (cbytes if t.precision == "bf16" else 0))
    if t.precision == "bf16" and t.master_bytes == 4:
        logits += m.vocab * m.hidden * 2
    # AdamW's step: on CUDA the foreach form holds one fp32 temporary per trainable parameter (the
    # square roots of the second moments); on a CPU the per-tensor form two of the largest tensor
    if t.device == "cuda" and t.fused_adamw:
        optimiser_step = 0  # one kernel per parameter group, no whole-model temporaries
    elif t.device == "cuda":
        optimiser_step = 4 * (trainable_student + trainable_composer)
    else:
        biggest = max(m.vocab * m.hidden, m.hidden * m.intermediate) if full else \
            max(t.composer_ff_mult * m.hidden * m.hidden, m.hidden * m.q)
        optimiser_step = 2 * 4 * biggest
    rollout_weights = 0
    if shard > 1 and t.fsdp_gather == "step":
        # train/sharding.py `gathered`: every unit whole for the step, beside its shard; the local
        # gradients whole until the reduce-scatter; AdamW's states and step on the shards
        params, teacher = (x + -(-x // shard) for x in (params, teacher))
        optimiser, optimiser_step = (-(-x // shard) for x in (optimiser, optimiser_step))
        notes.append(f"FSDP over {shard}, gather-once: AdamW's states sharded; during the step the weights (and the "
                     "teacher copy) are gathered whole and the gradients are whole until reduced; activations per device")
    elif shard > 1:
        # train/sharding.py `per_layer`: shards of everything, the root whole, two layers whole at a time
        root = m.vocab * m.hidden * (1 if m.tied else 2) + m.hidden
        layer = m.layer_params() + (lora_s + lora_e * (2 if t.anchor_copy else 1)) // m.layers  # with its adapters
        adapters = (lora_s + lora_e + (lora_e if t.anchor_copy else 0)) * 4
        chi_all = chi * (2 if t.anchor_copy else 1) * 4
        params = -(-(backbone * t.master_bytes + adapters) // shard) + chi_all + root * t.master_bytes \
            + 2 * layer * t.master_bytes
        if teacher:
            teacher = -(-teacher // shard) + (root + 2 * m.layer_params()) * teacher_bytes
        if full:
            grads = -(-backbone * t.master_bytes // shard) + (root + 2 * m.layer_params()) * t.master_bytes
        else:
            grads = -(-lora_s * 4 // shard) + 2 * (lora_s // m.layers) * 4
        grads += (-(-lora_e * 4 // shard) + chi * 4) if t.trains_composer else 0
        optimiser, optimiser_step = (-(-x // shard) for x in (optimiser, optimiser_step))
        if t.vllm_gpu_memory_utilization > 0:  # a colocated engine holds its own copy, in vLLM's share
            notes.append(f"FSDP over {shard}, per layer: weights, gradients and AdamW's states sharded; the root unit and "
                         "two decoder layers whole at a time; rollouts in this rank's vLLM engine (its share)")
        else:
            rollout_weights = backbone * t.master_bytes + adapters - (params - chi_all)
            notes.append(f"FSDP over {shard}, per layer: weights, gradients and AdamW's states sharded; the root unit and "
                         "two decoder layers whole at a time; the rollout phase gathers the student whole")
    vllm = int(t.vllm_gpu_memory_utilization * t.device_bytes) if t.device_bytes else 0
    return MemoryPlan(parameters=int(params), gradients=int(grads), optimiser=int(optimiser),
                      teacher_copy=int(teacher), activations=int(activations), logits=int(logits), vllm=vllm,
                      optimiser_step=int(optimiser_step), rollout_weights=int(max(0, rollout_weights)), per_token=per_token,
                      phases={k: int(v) for k, v in phases.items()}, notes=notes)

