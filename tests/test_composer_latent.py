"""Composer (ψ, χ), adapters and teacher conditioning on the tiny backbone."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from lopd_cli.agent.chat import render_prompt_ids, tokenize_transcript
from lopd_cli.agent.types import Episode, Task
from lopd_cli.config import recipe_from_dict
from lopd_cli.errors import LopdError
from lopd_cli.models.adapters import (
    BASE,
    ENCODER,
    STUDENT,
    adapter_of,
    adapter_parameters,
    attach_adapters,
    teacher_view,
    use_encoder,
    use_student,
)
from lopd_cli.compose.composer import Composer
from lopd_cli.compose.latent import action_token_logprobs, build_teacher_batch, teacher_inputs_embeds
from lopd_cli.models.backbone import latent_token_id, load_backbone

TOOLS = [{"type": "function", "function": {"name": "get_order", "description": "Look up an order",
          "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}}}}}]


@dataclass
class Item:
    id: str
    instruction: str
    messages: list[dict]
    tools: list[dict] = field(default_factory=lambda: TOOLS)


def transcript(order: int, turns: int, extra: str = "") -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful customer-service agent."},
            {"role": "user", "content": f"Where is order {order}?{extra}"}]
    for t in range(turns):
        call = {"id": f"c{t}", "type": "function",
                "function": {"name": "get_order", "arguments": json.dumps({"order_id": order + t})}}
        msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": f"c{t}", "content": json.dumps({"status": "shipped", "n": t})})
    msgs.append({"role": "assistant", "content": f"Order {order} has shipped."})
    return msgs


def episode(tok, order: int, turns: int, extra: str = "") -> Episode:
    msgs = transcript(order, turns, extra)
    ids, mask = tokenize_transcript(tok, msgs, TOOLS)
    task = Task(id=f"t{order}", instruction=msgs[1]["content"], tools=TOOLS)
    prompt_len = len(render_prompt_ids(tok, msgs[:2], TOOLS))
    return Episode(task=task, prompt_messages=msgs[:2], messages=msgs, reward=1.0,
                   input_ids=ids, action_mask=mask, prompt_len=prompt_len)


def items(n: int) -> list[Item]:
    return [Item(id=f"b{i}", instruction=f"Where is order {100 + i}?", messages=transcript(100 + i, 1 + i % 3)[1:])
            for i in range(n)]


@pytest.fixture()
def setup():
    model, tok = load_backbone("tiny", device="cpu")
    recipe = recipe_from_dict({"model": {"backbone": "tiny"}, "env": {"class": "x:Y"},
                               "composer": {"num_queries": 4, "depth": 2, "max_item_tokens": 200}})
    model = attach_adapters(model, recipe)
    torch.manual_seed(0)
    for n, p in model.named_parameters():  # non-zero LoRA B so every adapter changes the output
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    composer = Composer(model, tok, recipe.composer)
    return model, tok, recipe, composer


def test_views_differ_and_keep_grad_flags(setup):
    model, tok, _, _ = setup
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        with use_student(model):
            s = model(x).logits
        with use_encoder(model):
            e = model(x).logits
        with teacher_view(model):
            t = model(x).logits
        plain = model(x).logits
    assert not torch.allclose(s, e) and not torch.allclose(s, t) and not torch.allclose(e, t)
    assert torch.equal(plain, s)  # the student is the default view
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}
    assert all(not p.requires_grad for p in adapter_parameters(model, BASE))
    assert adapter_of("base_model.model.model.layers.0.mlp.up_proj.lora_B.encoder.weight") == ENCODER


def test_nested_views_restore_the_outer_one(setup):
    """A view inside another ends on the outer view: an inner teacher view leaves the adapters
    off until the outer one ends, and the active adapter comes back after the encoder's."""
    model, *_ = setup
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        s = model(x).logits
        with teacher_view(model):
            t = model(x).logits
            with teacher_view(model):
                pass
            assert torch.equal(model(x).logits, t)
        with use_encoder(model):
            e = model(x).logits
            with teacher_view(model):
                assert torch.equal(model(x).logits, t)
            assert torch.equal(model(x).logits, e)
        assert model.active_adapter == "student" and torch.equal(model(x).logits, s)


def test_teacher_loss_grads_reach_chi_and_psi_only(setup):
    model, tok, recipe, composer = setup
    eps = [episode(tok, 4821, 2), episode(tok, 77, 1)]
    its = [items(2), items(3)[1:]]
    latents = composer(its, [e.task.instruction for e in eps])
    assert latents.shape == (2, 2 * 4, model.config.hidden_size)
    batch = build_teacher_batch(eps, tok, latents.shape[1])
    with teacher_view(model):
        embeds = teacher_inputs_embeds(model, batch.input_ids, latents, batch.latent_mask)
        logits = model(inputs_embeds=embeds, attention_mask=batch.attention_mask).logits
    nll = -action_token_logprobs(logits, batch.batch_index, batch.teacher_pos, batch.token_ids).mean()
    nll.backward()
    chi = list(composer.resampler.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in chi)
    enc_b = [p for n, p in model.named_parameters() if adapter_of(n) == ENCODER and "lora_B" in n]
    assert enc_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in enc_b)
    assert all(p.grad is None for p in adapter_parameters(model, STUDENT))
    assert all(p.grad is None for p in adapter_parameters(model, BASE))


def test_placeholders_carry_exactly_c_phi(setup):
    model, tok, _, composer = setup
    eps = [episode(tok, 12, 1), episode(tok, 3456, 3, extra=" Please hurry.")]
    with torch.no_grad():
        latents = composer([items(1), items(2)[1:]], [e.task.instruction for e in eps])
    batch = build_teacher_batch(eps, tok, latents.shape[1])
    assert batch.latent_mask.sum(1).tolist() == [latents.shape[1]] * 2
    assert bool((batch.input_ids[batch.latent_mask] == latent_token_id(tok)).all())
    embeds = teacher_inputs_embeds(model, batch.input_ids, latents, batch.latent_mask)
    for b in range(2):
        assert torch.equal(embeds[b][batch.latent_mask[b]], latents[b])
    plain = model.get_input_embeddings()(batch.input_ids)
    assert torch.equal(embeds[~batch.latent_mask], plain[~batch.latent_mask])
    # The whole placeholder span is one block inside the first user turn.
    for b in range(2):
        pos = batch.latent_mask[b].nonzero().squeeze(1)
        assert pos.tolist() == list(range(int(pos[0]), int(pos[0]) + latents.shape[1]))
        text = tok.decode(batch.input_ids[b, : int(pos[0])])
        assert text.rstrip().endswith(tuple(["solved task was handled. It only illustrates the approach. Nothing of your task has been done yet; call the tools yourself and rely on their real results."]))


def test_teacher_student_alignment_is_exact_multi_turn(setup):
    _, tok, _, _ = setup
    eps = [episode(tok, 1, 3), episode(tok, 987654, 1, extra=" It was a gift."), episode(tok, 42, 0)]
    n_lat = 12
    batch = build_teacher_batch(eps, tok, n_lat)
    assert len(batch.token_ids) == sum(sum(e.action_mask) for e in eps)
    for b, ep in enumerate(eps):
        sel = batch.batch_index == b
        s_pos, t_pos = batch.student_pos[sel], batch.teacher_pos[sel]
        assert s_pos.tolist() == [i for i, m in enumerate(ep.action_mask) if m]
        ids = torch.tensor(ep.input_ids)
        assert torch.equal(batch.input_ids[b, t_pos], ids[s_pos])
        assert torch.equal(batch.token_ids[sel], ids[s_pos])
        # Everything after the prompt is the student's sequence, token for token.
        start = ep.prompt_len + batch.offsets[b]
        assert batch.input_ids[b, start: batch.lengths[b]].tolist() == ep.input_ids[ep.prompt_len:]
        assert batch.lengths[b] == len(ep.input_ids) + batch.offsets[b]
        assert int(batch.attention_mask[b].sum()) == batch.lengths[b]
        # The teacher prompt still holds the original task and ends with the generation prompt.
        prompt_text = tok.decode(batch.input_ids[b, :start])
        assert ep.task.instruction in prompt_text
        assert tok.decode(ep.input_ids[: ep.prompt_len]).endswith(prompt_text[-20:])
    assert batch.offsets[0] == batch.offsets[2]  # same system prompt and tools: same offset shape


def test_mismatched_prompt_len_is_an_error(setup):
    _, tok, _, _ = setup
    ep = episode(tok, 5, 1)
    ep.prompt_len += 1
    with pytest.raises(LopdError, match="rendered prompt"):
        build_teacher_batch([ep], tok, 4)


def test_batched_and_single_encoding_agree(setup):
    _, tok, _, composer = setup
    its = items(5)
    seqs = [composer.item_token_ids("Refund order 9 please.", it) for it in its]
    assert len({len(s) for s in seqs}) > 1  # really different lengths, so padding is exercised
    with torch.no_grad():
        composer.encode_batch_size = 8
        together = composer.encode_ids(seqs)
        composer.encode_batch_size = 1
        alone = composer.encode_ids(seqs)
    assert together.shape == (5, 4, composer.dims.dim)
    assert (together - alone).abs().max().item() < 1e-5, (together - alone).abs().max().item()


def test_truncation_and_item_text(setup):
    _, tok, _, composer = setup
    it = items(1)[0]
    text_ids = composer.item_token_ids("Cancel order 5.", it)
    assert len(text_ids) <= composer.max_item_tokens
    decoded = tok.decode(text_ids)
    assert decoded.startswith("Task to solve:\nCancel order 5.\n\nReference past trajectory:\n")
    assert "Where is order 100?" in decoded and "helpful customer-service" not in decoded
    composer.max_item_tokens = 16
    assert len(composer.item_token_ids("Cancel order 5.", it)) == 16


def test_save_load_roundtrip_and_backbone_mismatch(setup, tmp_path):
    model, tok, recipe, composer = setup
    seqs = [composer.item_token_ids("x", it) for it in items(2)]
    with torch.no_grad():
        before = composer.encode_ids(seqs)
    out = composer.save(tmp_path / "composer", embedder_fingerprint="emb123")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dims"]["dim"] == model.config.hidden_size and manifest["embedder_fingerprint"] == "emb123"
    assert (out / "encoder" / "adapter_model.safetensors").is_file() and (out / "qformer.safetensors").is_file()
    # Scramble the live weights, then load: the saved latents come back exactly.
    with torch.no_grad():
        for p in composer.resampler.parameters():
            p.add_(1.0)
        for p in adapter_parameters(model, ENCODER):
            p.add_(0.1)
    loaded = Composer.load(out, model, tok, recipe.composer)
    with torch.no_grad():
        after = loaded.encode_ids(seqs)
    assert torch.allclose(before, after, atol=1e-6)
    manifest["backbone_fingerprint"] = "0000000000000000"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LopdError, match="backbone"):
        Composer.load(out, model, tok, recipe.composer)


def test_teacher_nll_reports_progress_per_batch(setup):
    """The cold start's "validation NLL before training" counter: one call per batch, summing to
    the number of examples, and the same NLL with or without it."""
    from lopd_cli.train.coldstart import Example
    from lopd_cli.train.teacher_nll import teacher_nll

    model, tok, _, composer = setup
    refs = items(5)
    examples = [Example(episode(tok, 10 + i, 1), refs[i : i + 1]) for i in range(5)]
    calls: list[int] = []
    with_bar = teacher_nll(model, tok, composer, examples, "learned", batch_size=2, progress=calls.append)
    assert calls == [2, 2, 1]
    assert abs(with_bar - teacher_nll(model, tok, composer, examples, "learned", batch_size=2)) < 1e-6


@pytest.mark.parametrize("view", ["teacher", "student"])
def test_shared_prefix_pass_equals_one_full_pass(setup, view):
    """`decoder_hidden` runs the rows' common prefix (system prompt, tools) once and repeats its
    cache: the hidden states and the gradients (into c_φ, and into a LoRA that the prefix depends
    on, in the student view) are those of one full pass."""
    from lopd_cli.compose.composer import decoder_of
    from lopd_cli.compose.latent import decoder_hidden, shared_prefix_len

    model, tok, _, composer = setup
    eps = [episode(tok, 4821, 2), episode(tok, 77, 1), episode(tok, 5, 3, extra=" Please hurry.")]
    latents = composer([items(2), items(3)[1:], items(2)], [e.task.instruction for e in eps])
    batch = build_teacher_batch(eps, tok, latents.shape[1])
    P = shared_prefix_len(batch.input_ids, batch.attention_mask, batch.latent_mask)
    first_latent = int(batch.latent_mask[0].nonzero()[0])
    assert 0 < P <= first_latent and P < min(batch.lengths)

    results, calls = [], []
    hook = decoder_of(model).register_forward_hook(lambda mod, args, out: calls.append(1))
    for min_prefix in (10**9, 1):  # full pass, then the shared-prefix pass
        for p in list(model.parameters()) + list(composer.resampler.parameters()):
            p.grad = None
        with teacher_view(model) if view == "teacher" else use_student(model):
            embeds = teacher_inputs_embeds(model, batch.input_ids, latents, batch.latent_mask)
            h = decoder_hidden(decoder_of(model), batch.input_ids, batch.attention_mask, embeds, batch.latent_mask,
                               min_prefix=min_prefix)
        calls.append("|")
        keep = batch.attention_mask.bool()
        (h[keep] ** 2).mean().backward(retain_graph=True)
        grads = {n: p.grad.clone() for n, p in list(model.named_parameters()) + list(composer.resampler.named_parameters())
                 if p.grad is not None}
        results.append((h.detach()[keep], grads))
    hook.remove()
    assert calls == [1, "|", 1, 1, "|"]  # one pass, then the prefix pass and the rest: the shared path ran
    (h_full, g_full), (h_pre, g_pre) = results
    assert torch.allclose(h_full, h_pre, atol=1e-5, rtol=1e-4)
    assert g_full.keys() == g_pre.keys() and g_full
    if view == "student":
        assert any(adapter_of(n) == STUDENT for n in g_full)  # the prefix's gradient path is kept
    for n in g_full:
        assert torch.allclose(g_full[n], g_pre[n], atol=1e-6, rtol=1e-3), n


def test_base_weights_are_a_full_students_own_under_transformers_names():
    """What the vLLM backend copies into its engine for model.student=full: the student's
    current base weights, named as a plain transformers model names them (no peft prefix, no
    `.base_layer`), without the encoder adapter, and loadable as a whole model."""
    from lopd_cli.models.adapters import base_weights

    model, tok = load_backbone("tiny", device="cpu")
    plain, _ = load_backbone("tiny", device="cpu")
    recipe = recipe_from_dict({"model": {"backbone": "tiny", "student": "full"}, "env": {"class": "x:Y"}})
    model = attach_adapters(model, recipe)
    with torch.no_grad():  # a trained student: its base weights moved away from the backbone's
        for p in adapter_parameters(model, BASE):
            p.add_(0.05 * torch.randn_like(p))
    weights = dict(base_weights(model))
    assert set(weights) == {n for n, _ in plain.named_parameters()}
    assert not any("lora_" in n or "base_model" in n or "base_layer" in n for n in weights)
    plain.load_state_dict(weights, strict=False)
    x = torch.tensor([tok("Where is order 42?")["input_ids"]])
    with torch.no_grad(), use_student(model):
        want = model(input_ids=x).logits
    with torch.no_grad():
        got = plain(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5)
