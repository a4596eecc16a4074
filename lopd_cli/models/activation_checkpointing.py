"""Activation checkpointing of the backbone's decoder layers (`train.activation_checkpointing`).

Every pass that keeps a graph (the student's; the encoder ψ's and the teacher's in the composer
pass) runs the same decoder layers, so checkpointing those layers covers all three: with
transformers' own mechanism (`activation_checkpointing_enable`, non-reentrant
`torch.utils.checkpoint`) a layer keeps only its inputs in the forward and is run again in the
backward. Passes without gradient (rollouts, the no-grad teacher) are not affected.

Two things are particular to lopd:

1. Views. One backbone is the student (student adapter), ψ (encoder adapter) and the teacher
   (adapters off), and a layer is recomputed in the backward, after the view that ran its forward
   has been left. Each checkpointed call therefore records the peft LoRA layers' state (active
   adapter, adapters disabled) and replays it around its recompute; without that the recompute of
   a teacher layer would run with the student adapter on.
2. The shared prefix (compose/latent.py `decoder_hidden`): the prompt prefix every row shares runs
   once, on one row, and its key/value cache is repeated for the others. transformers drops a
   cache under checkpointing, because the recompute would append to it a second time.
   `prefix_pass` gives the layers caches that a recompute can replay (`ReplayLayer`: a fixed
   one-row prefix, and each update returns it, expanded to the batch, + the new states without
   growing) and lets the layers keep those caches for the duration of the pass.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

FLAG = "lopd_activation_checkpointing"  # set on the transformers model once enabled


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _tuner_layers(model) -> list:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _views(tuners: list) -> list[tuple]:
    return [(m._disable_adapters, m._active_adapter) for m in tuners]


def _set_views(tuners: list, state: list[tuple]) -> None:
    for m, (disabled, active) in zip(tuners, state):
        m._disable_adapters, m._active_adapter = disabled, active


@contextlib.contextmanager
def _replaying(tuners: list, state: list[tuple]) -> Iterator[None]:
    now = _views(tuners)
    _set_views(tuners, state)
    try:
        yield
    finally:
        _set_views(tuners, now)


def views_context_fn(model):
    """torch.utils.checkpoint's `context_fn`: the forward runs as it is; the recompute runs with
    the adapters as they were in the forward (peft's LoRA layers of `model`, as attached now)."""
    tuners = _tuner_layers(model)

    def context_fn():
        return contextlib.nullcontext(), _replaying(tuners, _views(tuners))

    return context_fn


def enable_activation_checkpointing(model) -> None:
    """Checkpoint every decoder layer of `model` (a transformers causal LM, peft-wrapped or not).
    Call it after every adapter is attached: the recompute replays the adapters' state."""
    base = _base(model)
    kwargs = {"use_reentrant": False, "context_fn": views_context_fn(model)}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before activation_checkpointing_enable
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers also makes the input embeddings require grad (for reentrant checkpointing). The
    # non-reentrant form does not need it, and with it a frozen pass (the teacher's prefix, read
    # from token ids) would build a graph that nothing reads.
    if getattr(base, "_require_grads_hook", None) is not None:
        base.disable_input_require_grads()
    setattr(base, FLAG, True)


def is_enabled(model) -> bool:
    return bool(getattr(_base(model), FLAG, False))


def recomputes(decoder) -> bool:
    """Whether a pass through `decoder` (the transformer body) now checkpoints its layers: what
    transformers' layers check (checkpointing on, training mode, gradients enabled)."""
    return bool(getattr(decoder, "gradient_checkpointing", False) and decoder.training and torch.is_grad_enabled())


# ----------------------------------------------------------------------------- the shared prefix


def _replay_layer_class():
    from transformers.cache_utils import DynamicLayer

    class ReplayLayer(DynamicLayer):
        """A cache layer a recompute can replay. Without a prefix it records: `keys`/`values` are
        the states of its last update. With one (the head pass's recorded states, one row) each
        update returns that prefix, expanded to the batch, followed by the new states, and keeps
        nothing: what a recompute reads is the same, and the recompute closures that hold this
        cache keep one row of the prefix alive, not the batch's copies."""

        def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
            super().__init__()
            self.prefix = None if keys is None else (keys, values)
            if keys is not None:
                self.device, self.is_initialized = keys.device, True

        def update(self, key_states, value_states, *args, **kwargs):
            if self.prefix is None:
                self.keys, self.values, self.device, self.is_initialized = key_states, value_states, key_states.device, True
                return key_states, value_states
            pk, pv = self.prefix
            b = key_states.shape[0]
            keys = torch.cat([pk.expand(b, *pk.shape[1:]), key_states], dim=-2)
            values = torch.cat([pv.expand(b, *pv.shape[1:]), value_states], dim=-2)
            return keys, values

        def get_seq_length(self) -> int:
            return 0 if self.prefix is None else int(self.prefix[0].shape[-2])

    return ReplayLayer


@contextlib.contextmanager
def off_without_grad(decoder) -> Iterator[None]:
    """Checkpointing off while no gradient is taken (nothing to recompute then): transformers 5.19's
    checkpointed layers drop the cache in training mode even under no_grad."""
    layers = [m for m in decoder.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if torch.is_grad_enabled() or not layers:
        yield
        return
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


@contextlib.contextmanager
def _layers_keep_cache(layers) -> Iterator[None]:
    """transformers' layers drop a cache under checkpointing unless `_can_checkpoint_with_cache`."""
    saved = [layer.__dict__.get("_can_checkpoint_with_cache") for layer in layers]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer, s in zip(layers, saved):
            if s is None:
                del layer._can_checkpoint_with_cache
            else:
                layer._can_checkpoint_with_cache = s


def prefix_pass(decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, inputs_embeds: torch.Tensor | None,
                prefix: int, cache_kwarg: str) -> torch.Tensor | None:
    """`decoder_hidden`'s shared-prefix pass while the layers are checkpointed: the first `prefix`
    positions once on row 0, then the rest of every row over the repeated prefix cache, both
    through caches a recompute replays. The last hidden states (B, T, d), or None when the
    decoder has layers other than full attention (a sliding window: one full pass then)."""
    from transformers.cache_utils import Cache

    kinds = getattr(decoder.config, "layer_types", None) or ["full_attention"]
    if any(k != "full_attention" for k in kinds):
        return None
    layers = list(decoder.layers)
    replay = _replay_layer_class()
    B = input_ids.shape[0]
    with _layers_keep_cache(layers):
        head_cache = Cache(layers=[replay() for _ in layers])
        head = decoder(input_ids=input_ids[:1, :prefix], attention_mask=attention_mask[:1, :prefix],
                       **{cache_kwarg: head_cache}, use_cache=True)
        tail_cache = Cache(layers=[replay(layer.keys, layer.values) for layer in head_cache.layers])
        rest = ({"inputs_embeds": inputs_embeds[:, prefix:]} if inputs_embeds is not None
                else {"input_ids": input_ids[:, prefix:]})
        tail = decoder(**rest, attention_mask=attention_mask, **{cache_kwarg: tail_cache},
                       use_cache=True).last_hidden_state
    return torch.cat([head.last_hidden_state.expand(B, -1, -1), tail], dim=1)
