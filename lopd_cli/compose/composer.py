"""The composer φ = (ψ, χ): retrieved trajectories → K latent tokens each (docs/algorithm.md, "Composer").

ψ is the backbone with the "encoder" LoRA adapter (lopd_cli.models.adapters): each retrieved item
is rendered as "Task to solve:\\n{current task}\\n\\nReference past trajectory:\\n{trajectory}",
truncated to `composer.max_item_tokens`, and its last hidden layer (after the final norm) is kept.
χ is a Perceiver resampler / QFormer that turns those L_j × d states into K × d latents. The
n_ret results of a task are concatenated: c_φ has n_ret·K rows.

Unlike the reference code, items are encoded in batches: right-padded, with padding masks in the
backbone and in χ, so a batch gives the same latents as one item at a time (tested to 1e-5).

One change to the reference initialisation: `norm_out`'s gain starts at the RMS of the
backbone's input-embedding entries instead of 1, so latents enter the teacher at the scale of
ordinary token embeddings (a LayerNorm with gain 1 gives rows of norm √d: 11.3 on the tiny
model, whose token embeddings have norm 0.23).

Keys of the cross-attention (`composer.key_tokens`): "content" makes χ read only the
trajectory's content tokens — the task frame and the chat markup, the same in every item, are
masked out of its keys and values (the encoder still reads them as context). With uniform
attention at init, a pooled latent is otherwise mostly template. The default is "all" (every
token, the reference code): on random tiny "content" kept less task spread. Measure it with
`benchmarks/coldstart_nll.py --set composer.key_tokens=all|content` (task spread, NLL gap).

Input normalisation (`composer.input_norm`): a real LM's last hidden states share one large
mean direction (SmolLM2-135M: 55 % of a token's squared norm is the mean over bank tokens, one
dimension at 34 against a median of 0.4), so the mean-pooled states of two different items have
cosine 0.99 and every latent starts from the same summary. "standardise" subtracts the per-
dimension mean over the bank's tokens and divides by its standard deviation before χ reads them
(statistics measured once by `fit_input_norm` before cold start, then fixed buffers saved with
χ); "centre" only subtracts the mean; "none" reads the states as they are (the reference code).

What it simplifies: the retrieved item's system prompt and tool schemas are left out of its
rendering (the teacher already sees both in its own prompt, and they would use up the
max_item_tokens budget); truncation keeps the first max_item_tokens tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from lopd_cli.errors import LopdError
from lopd_cli.models.adapters import ENCODER, add_frozen_adapter, load_adapter_weights, save_adapter, use_encoder

TASK_HEAD = "Task to solve:\n"
TASK_TAIL = "\n\nReference past trajectory:\n"
MANIFEST = "manifest.json"
QFORMER_FILE = "qformer.safetensors"
ENCODER_DIR = "encoder"
FORMAT_VERSION = 1


class ReferenceItem(Protocol):
    """What the composer reads from a bank item (lopd_cli.bank BankItem fits)."""

    id: int | str
    messages: list[dict]
    tools: list[dict] | None


# ---------------------------------------------------------------------------------------------
# χ: the resampler
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResamplerDims:
    dim: int
    heads: int
    dim_head: int
    num_queries: int
    depth: int
    ff_mult: int
    share_layers: bool

    @classmethod
    def from_backbone(cls, config, composer_cfg) -> "ResamplerDims":
        cfg = getattr(config, "text_config", config)
        dim, heads = cfg.hidden_size, cfg.num_attention_heads
        dim_head = getattr(cfg, "head_dim", None) or dim // heads
        return cls(
            dim=dim,
            heads=heads,
            dim_head=dim_head,
            num_queries=composer_cfg.num_queries,
            depth=composer_cfg.depth,
            ff_mult=composer_cfg.ff_mult,
            share_layers=composer_cfg.share_layers,
        )


class PerceiverAttention(nn.Module):
    """Latents attend to concat(inputs, latents); inputs and latents normalised separately."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.norm_inputs = nn.LayerNorm(dim)
        self.norm_latents = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor, latents: torch.Tensor, x_mask: torch.Tensor) -> torch.Tensor:
        """x_mask (b, n): 1 on the inputs the latents may read (real tokens, or only their content)."""
        b, n, _ = x.shape
        m = latents.shape[1]
        x = self.norm_inputs(x)
        latents = self.norm_latents(latents)
        q = self.to_q(latents).view(b, m, self.heads, self.dim_head).transpose(1, 2)
        k, v = self.to_kv(torch.cat([x, latents], dim=1)).chunk(2, dim=-1)
        k = k.view(b, n + m, self.heads, self.dim_head).transpose(1, 2)
        v = v.view(b, n + m, self.heads, self.dim_head).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(self.dim_head)
        keep = torch.cat([x_mask.bool(), x_mask.new_ones(b, m, dtype=torch.bool)], dim=1)
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(v.dtype)
        out = (weights @ v).transpose(1, 2).reshape(b, m, self.heads * self.dim_head)
        return self.to_out(out)


def feed_forward(dim: int, mult: int) -> nn.Sequential:
    return nn.Sequential(
        nn.LayerNorm(dim), nn.Linear(dim, mult * dim, bias=False), nn.GELU(), nn.Linear(mult * dim, dim, bias=False)
    )


class Resampler(nn.Module):
    """χ: K learned queries read a variable-length, padded sequence of hidden states."""

    def __init__(self, dims: ResamplerDims):
        super().__init__()
        self.dims = dims
        d = dims.dim
        self.queries = nn.Parameter(torch.randn(dims.num_queries, d) / math.sqrt(d))
        self.proj_in = nn.Linear(d, d)
        n_blocks = 1 if dims.share_layers else dims.depth
        self.attn = nn.ModuleList(PerceiverAttention(d, dims.heads, dims.dim_head) for _ in range(n_blocks))
        self.ff = nn.ModuleList(feed_forward(d, dims.ff_mult) for _ in range(n_blocks))
        self.proj_out = nn.Linear(d, d)
        self.norm_out = nn.LayerNorm(d)
        # x ↦ (x − input_mean) / input_scale before χ reads it; identity until fit_input_norm.
        self.register_buffer("input_mean", torch.zeros(d))
        self.register_buffer("input_scale", torch.ones(d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (N, L, d), mask: (N, L) with 1 on real tokens → (N, K, d). `key_mask` (N, L): the
        inputs the cross-attention may read (default: every real token); the latents themselves
        are always keys too, so a row with no readable input is still well defined."""
        x = self.proj_in((x - self.input_mean) / self.input_scale)
        keys = mask if key_mask is None else (key_mask.bool() & mask.bool())
        latents = self.queries.unsqueeze(0).expand(x.shape[0], -1, -1)
        for i in range(self.dims.depth):
            j = 0 if self.dims.share_layers else i
            latents = latents + self.attn[j](x, latents, keys)
            latents = latents + self.ff[j](latents)
        return self.norm_out(self.proj_out(latents))


# ---------------------------------------------------------------------------------------------
# ψ + χ: the composer
# ---------------------------------------------------------------------------------------------


def render_item_text(tokenizer, task_instruction: str, item: ReferenceItem, obs_char_budget: int) -> str:
    """The encoder's input for one retrieved item, conditioned on the task being solved: the
    observation-lite trajectory (tool outputs trimmed) through the chat template."""
    from lopd_cli.agent.chat import render_text
    from lopd_cli.bank.lite import lite_messages

    messages = [m for m in lite_messages(item.messages, obs_char_budget) if m.get("role") != "system"]
    trajectory = render_text(tokenizer, messages, None, add_generation_prompt=False)
    return TASK_HEAD + task_instruction.rstrip() + TASK_TAIL + trajectory


def _content_pieces(message: dict) -> list[str]:
    """The strings of a message that are its content (not chat markup): text, tool names, and the
    keys and values of tool-call arguments."""
    out: list[str] = []
    content = message.get("content")
    if isinstance(content, str) and content.strip():
        out.append(content.strip())
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        if fn.get("name"):
            out.append(str(fn["name"]))
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                out.append(args.strip())
                continue
        if isinstance(args, dict):
            for k, v in args.items():
                out.append(str(k))
                out.append(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
    return [p for p in out if p]


def render_item(tokenizer, task_instruction: str, item: ReferenceItem, obs_char_budget: int) -> tuple[str, list[tuple[int, int]]]:
    """`render_item_text` and the character spans of its content: each content piece of the
    trajectory's messages found, in order, in the rendered text. Everything else — the task frame
    ("Task to solve:\n{task}\n\nReference past trajectory:\n", the same in every item of a task)
    and the chat template's markup (role headers, end-of-turn tokens, tool-call scaffolding) — is
    not content. A piece the template rendered differently is simply not found (left as markup)."""
    from lopd_cli.bank.lite import lite_messages

    text = render_item_text(tokenizer, task_instruction, item, obs_char_budget)
    cursor = len(TASK_HEAD + task_instruction.rstrip() + TASK_TAIL)
    spans: list[tuple[int, int]] = []
    for m in lite_messages(item.messages, obs_char_budget):
        if m.get("role") == "system":
            continue
        for piece in _content_pieces(m):
            at = text.find(piece, cursor)
            if at >= 0:
                spans.append((at, at + len(piece)))
                cursor = at + len(piece)
    return text, spans


def content_token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for a token whose characters overlap a content span, else 0."""
    out, j = [], 0
    for a, b in offsets:
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        out.append(int(j < len(spans) and spans[j][0] < b and a < spans[j][1] and b > a))
    return out


def decoder_of(model) -> nn.Module:
    """The transformer body (no LM head) of a causal LM, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dec = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    if dec is None:
        raise LopdError(f"{type(base).__name__}: cannot find the transformer body for the composer encoder")
    return dec


class Composer(nn.Module):
    """c_φ for a batch of tasks. Holds χ as a submodule; the backbone (with its "encoder" adapter)
    is referenced, not owned, so `state_dict()` is χ alone."""

    def __init__(self, model, tokenizer, composer_cfg, obs_char_budget: int = 600, encode_batch_size: int = 8,
                 adapter: str = ENCODER):
        super().__init__()
        if adapter not in getattr(model, "peft_config", {}):
            raise LopdError(f"the backbone has no '{adapter}' adapter: call models.adapters.attach_adapters first")
        self._backbone = [model]  # a list so nn.Module does not register it
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.max_item_tokens = composer_cfg.max_item_tokens
        self.key_tokens = getattr(composer_cfg, "key_tokens", "all")
        self.input_norm = getattr(composer_cfg, "input_norm", "none")
        self.obs_char_budget = obs_char_budget
        self.encode_batch_size = encode_batch_size
        self.dims = ResamplerDims.from_backbone(model.config, composer_cfg)
        self.resampler = Resampler(self.dims).to(next(model.parameters()).device)
        with torch.no_grad():  # start latents at the scale of the backbone's token embeddings
            emb = model.get_input_embeddings().weight
            self.resampler.norm_out.weight.fill_(float(emb.float().pow(2).mean().sqrt()))

    @property
    def backbone(self):
        return self._backbone[0]

    @property
    def latents_per_item(self) -> int:
        return self.dims.num_queries

    def item_token_ids(self, task_instruction: str, item: ReferenceItem) -> list[int]:
        return self.item_tokens(task_instruction, item)[0]

    def item_tokens(self, task_instruction: str, item: ReferenceItem) -> tuple[list[int], list[int] | None]:
        """(token ids, key mask) of one item, truncated to max_item_tokens. The key mask (1 =
        χ may read the token) is None with `key_tokens: all`, or when the tokenizer cannot map
        tokens to characters (a slow tokenizer: every token is read)."""
        if self.key_tokens == "all" or not getattr(self.tokenizer, "is_fast", False):
            text = render_item_text(self.tokenizer, task_instruction, item, self.obs_char_budget)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.max_item_tokens], None
        text, spans = render_item(self.tokenizer, task_instruction, item, self.obs_char_budget)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        keys = content_token_mask(enc["offset_mapping"], spans)
        return enc["input_ids"][: self.max_item_tokens], keys[: self.max_item_tokens]

    def encode_ids(self, sequences: Sequence[Sequence[int]], key_masks: Sequence[Sequence[int] | None] | None = None) -> torch.Tensor:
        """Token sequences → latents (N, K, d), encoded `encode_batch_size` at a time. `key_masks`:
        per sequence, which tokens χ reads (None: all of them)."""
        from lopd_cli.train import lockstep

        # The uniform schedule of a per-layer sharded step: as many encoder passes as the rank with the
        # most, agreed before any of them runs; a filler pass joins the graph with weight 0.
        n_chunks = -(-len(sequences) // self.encode_batch_size)
        n_fillers = lockstep.count(n_chunks) - n_chunks
        out = []
        for start in range(0, len(sequences), self.encode_batch_size):
            chunk = sequences[start : start + self.encode_batch_size]
            hidden, mask = self._encode_chunk(chunk)
            hidden = hidden.to(self.resampler.queries.dtype)
            keys = None
            if key_masks is not None and any(k is not None for k in key_masks[start : start + self.encode_batch_size]):
                keys = torch.zeros_like(mask)
                for i, (s, k) in enumerate(zip(chunk, key_masks[start : start + self.encode_batch_size])):
                    keys[i, : len(s)] = torch.tensor(list(k) if k is not None else [1] * len(s), dtype=mask.dtype)
            out.append(self.resampler(hidden, mask, keys))
        filler = None
        for _ in range(n_fillers):
            hidden, mask = self._encode_chunk([list(sequences[0]) if sequences else [self.tokenizer.pad_token_id or 0]])
            f = self.resampler(hidden.to(self.resampler.queries.dtype), mask).sum() * 0.0
            filler = f if filler is None else filler + f
        if not out:
            d = self.dims.dim
            return self.resampler.queries.new_zeros(0, self.dims.num_queries, d)
        latents = torch.cat(out, dim=0)
        return latents if filler is None else latents + filler

    def _encode_chunk(self, chunk: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.backbone.parameters()).device
        longest = max(len(s) for s in chunk)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(chunk), longest), pad, dtype=torch.long, device=device)
        mask = torch.zeros((len(chunk), longest), dtype=torch.long, device=device)
        for i, s in enumerate(chunk):  # right padding: real tokens keep positions 0..L-1
            ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
            mask[i, : len(s)] = 1
        positions = torch.arange(longest, device=device).unsqueeze(0).expand(len(chunk), -1)
        with use_encoder(self.backbone, self.adapter):
            hidden = decoder_of(self.backbone)(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
            ).last_hidden_state
        return hidden, mask

    def fit_input_norm(self, sequences: Sequence[Sequence[int]], progress: Callable[[int], None] | None = None) -> dict:
        """Set χ's input statistics (per-dimension mean and standard deviation of the encoder's
        states over every real token of `sequences`) as `input_norm` asks; "none" leaves the
        identity. `progress(k)` after each chunk of k sequences. Returns a summary: tokens read
        and the share of the states' energy in the mean."""
        if self.input_norm == "none" or not sequences:
            return {"input_norm": self.input_norm, "tokens": 0}
        d = self.dims.dim
        total = torch.zeros(d, dtype=torch.float64)
        squares = torch.zeros(d, dtype=torch.float64)
        count = 0
        with torch.no_grad():
            for start in range(0, len(sequences), self.encode_batch_size):
                hidden, mask = self._encode_chunk(sequences[start : start + self.encode_batch_size])
                h = hidden[mask.bool()].double().cpu()
                total += h.sum(0)
                squares += h.pow(2).sum(0)
                count += h.shape[0]
                if progress is not None:
                    progress(len(sequences[start : start + self.encode_batch_size]))
        mean = total / count
        std = (squares / count - mean.pow(2)).clamp(min=0).sqrt()
        r = self.resampler
        r.input_mean.copy_(mean.to(r.input_mean))
        if self.input_norm == "standardise":  # floor: a near-constant dimension is not blown up
            r.input_scale.copy_(std.clamp(min=1e-2 * float(std.median()) + 1e-12).to(r.input_scale))
        mean_share = float(mean.pow(2).sum() / (squares.sum() / count))
        return {"input_norm": self.input_norm, "tokens": count, "mean_energy_share": mean_share}

    def forward(self, items_per_task: Sequence[Sequence[ReferenceItem]], task_instructions: Sequence[str]) -> torch.Tensor:
        """c_φ: (B, n_ret·K, d). Every task must come with the same number of items."""
        if len(items_per_task) != len(task_instructions):
            raise ValueError("items_per_task and task_instructions differ in length")
        counts = {len(items) for items in items_per_task}
        if len(counts) > 1 or 0 in counts:
            raise LopdError(
                f"every task needs the same, non-zero number of retrieved items (got {sorted(counts)}); "
                "the bank holds too few tasks for bank.n_retrieve"
            )
        n = counts.pop()
        toks = [self.item_tokens(instr, it) for items, instr in zip(items_per_task, task_instructions) for it in items]
        latents = self.encode_ids([t[0] for t in toks], [t[1] for t in toks])
        return latents.reshape(len(items_per_task), n * self.dims.num_queries, self.dims.dim)

    # -----------------------------------------------------------------------------------------
    # save / load
    # -----------------------------------------------------------------------------------------

    def manifest(self, backbone_fp: str, embedder_fp: str | None) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "dims": asdict(self.dims),
            "max_item_tokens": self.max_item_tokens,
            "key_tokens": self.key_tokens,
            "input_norm": self.input_norm,
            "obs_char_budget": self.obs_char_budget,
            "backbone_fingerprint": backbone_fp,
            "embedder_fingerprint": embedder_fp,
        }

    def save(self, out_dir: Path, embedder_fingerprint: str | None = None, extra: dict | None = None,
             backbone_state: dict | None = None) -> Path:
        """out_dir/{qformer.safetensors, encoder/ (peft adapter), manifest.json}. `backbone_state`:
        the backbone's weights when they are sharded (adapters.save_adapter)."""
        from safetensors.torch import save_file

        from lopd_cli.models.backbone import backbone_fingerprint

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.resampler.state_dict().items()}
        save_file(state, str(out_dir / QFORMER_FILE))
        save_adapter(self.backbone, self.adapter, out_dir / ENCODER_DIR, state_dict=backbone_state)
        manifest = self.manifest(backbone_fingerprint(self.backbone), embedder_fingerprint) | (extra or {})
        (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
        return out_dir

    @classmethod
    def load(cls, src_dir: Path, model, tokenizer, composer_cfg=None, encode_batch_size: int = 8,
             adapter: str = ENCODER, frozen: bool = False) -> "Composer":
        """A saved composer onto this (adapter-carrying) backbone. The manifest's dims win over the
        recipe's; a composer saved for another backbone is a LopdError. With `frozen=True` the
        encoder adapter is added under the new name `adapter` (e.g. "encoder0" for the cold-start
        composer the anchor term needs) and nothing of it is trainable."""
        from safetensors.torch import load_file

        from lopd_cli.config import ComposerSection
        from lopd_cli.models.backbone import backbone_fingerprint

        src_dir = Path(src_dir)
        manifest = read_manifest(src_dir)
        fp = backbone_fingerprint(model)
        if manifest.get("backbone_fingerprint") != fp:
            raise LopdError(
                f"{src_dir / MANIFEST}: composer was trained for backbone {manifest.get('backbone_fingerprint')}, "
                f"this backbone is {fp} (run `lopd coldstart` for this model)"
            )
        dims = manifest["dims"]
        base = composer_cfg or ComposerSection()
        cfg = base.model_copy(
            update={
                "num_queries": dims["num_queries"],
                "depth": dims["depth"],
                "ff_mult": dims["ff_mult"],
                "share_layers": dims["share_layers"],
                "max_item_tokens": manifest.get("max_item_tokens", base.max_item_tokens),
                # what χ was trained to read; composers saved before the key exists read everything
                "key_tokens": manifest.get("key_tokens", "all"),
                "input_norm": manifest.get("input_norm", "none"),
            }
        )
        if frozen:
            add_frozen_adapter(model, adapter, src_dir / ENCODER_DIR)
        composer = cls(model, tokenizer, cfg, manifest.get("obs_char_budget", 600), encode_batch_size, adapter)
        if asdict(composer.dims) != dims:
            raise LopdError(f"{src_dir / MANIFEST}: dims {dims} do not fit this backbone ({asdict(composer.dims)})")
        state = load_file(str(src_dir / QFORMER_FILE), device=str(composer.resampler.queries.device))
        # composers saved before input normalisation existed have no statistics: the identity
        missing, unexpected = composer.resampler.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"input_mean", "input_scale"}:
            raise LopdError(f"{src_dir / QFORMER_FILE}: does not match χ (missing {sorted(missing)}, "
                            f"unexpected {sorted(unexpected)})")
        if frozen:
            composer.requires_grad_(False)
        else:
            load_adapter_weights(model, adapter, src_dir / ENCODER_DIR)
        composer.loaded_manifest = manifest
        return composer


def read_manifest(src_dir: Path) -> dict:
    path = Path(src_dir) / MANIFEST
    if not path.is_file():
        raise LopdError(f"{src_dir}: no composer here ({MANIFEST} missing; run `lopd coldstart`)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LopdError(f"{path}: not valid JSON ({e})") from None
