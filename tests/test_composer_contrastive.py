"""The composer must carry its references (issue 16): the contrastive term's gradient reaches ψ
and χ, χ reads only content tokens, and ψ and χ have their own learning rates and warm-up."""

from __future__ import annotations

import pytest
import torch

from lopd_cli.models.adapters import ENCODER, adapter_parameters
from lopd_cli.compose.composer import Composer, content_token_mask, render_item
from lopd_cli.compose.latent import build_teacher_batch
from lopd_cli.train.coldstart import (
    Example,
    composer_optimizer,
    contrastive_term,
    other_task_order,
    teacher_token_logprobs,
)
from test_composer_latent import episode, items, setup  # noqa: F401  (fixture)


def test_contrastive_gradient_reaches_encoder_lora_and_resampler(setup):  # noqa: F811
    model, tok, recipe, composer = setup
    refs = items(6)
    examples = [Example(episode(tok, 10 + i, 1 + i % 2), refs[2 * i : 2 * i + 2]) for i in range(3)]
    eps = [ex.episode for ex in examples]
    for p in model.parameters():
        p.grad = None
    latents = composer([ex.refs for ex in examples], [e.task.instruction for e in eps])
    batch = build_teacher_batch(eps, tok, latents.shape[1])
    lp = teacher_token_logprobs(model, batch, latents)
    # a margin far above any NLL difference: every pair's hinge is active
    hinge = contrastive_term(model, tok, eps, latents, batch, lp, [e.task.id for e in eps], margin=50.0)
    assert hinge.item() > 40
    hinge.backward()
    psi = adapter_parameters(model, ENCODER)
    chi = list(composer.resampler.parameters())
    assert psi and any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in psi), "no gradient into ψ"
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in chi), "no gradient into χ"
    # the backbone itself (the teacher's θ̄) stays frozen
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_contrastive_pairs_skip_same_task():
    perm, ok = other_task_order(["a", "b", "a", "c"])
    assert perm == [3, 0, 1, 2] and ok == [True, True, True, True]
    perm, ok = other_task_order(["a", "a", "b"])
    assert perm == [2, 0, 1] and ok == [True, False, True]
    assert other_task_order(["a"])[1] == [False]


def test_keys_are_the_trajectory_content_not_the_frame_or_markup(setup):  # noqa: F811
    model, tok, recipe, _ = setup
    composer = Composer(model, tok, recipe.composer.model_copy(update={"key_tokens": "content"}))
    item = items(3)[2]
    text, spans = render_item(tok, "Where is order 77?", item, 600)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    keys = content_token_mask(enc["offset_mapping"], spans)
    read = "".join(text[a:b] for (a, b), k in zip(enc["offset_mapping"], keys) if k)
    skipped = "".join(text[a:b] for (a, b), k in zip(enc["offset_mapping"], keys) if not k)
    assert "Where is order 102?" in read and "get_order" in read and "shipped" in read
    assert "Task to solve" in skipped and "Reference past trajectory" in skipped and "77" in skipped
    assert "<|im_start|>" in skipped and "<|im_start|>" not in read and "Task" not in read
    ids, mask = composer.item_tokens("Where is order 77?", item)
    assert mask is not None and len(mask) == len(ids) and 0 < sum(mask) < len(mask)
    # key_tokens=all: χ reads every token (the reference code), so the same χ gives other latents
    all_keys = Composer(model, tok, recipe.composer.model_copy(update={"key_tokens": "all"}))
    all_keys.resampler.load_state_dict(composer.resampler.state_dict())
    assert all_keys.item_tokens("Where is order 77?", item)[1] is None
    with torch.no_grad():
        a = composer([[item]], ["Where is order 77?"])
        b = all_keys([[item]], ["Where is order 77?"])
    assert a.shape == b.shape and not torch.allclose(a, b)


def test_encoder_and_resampler_have_their_own_rates_and_a_linear_warmup(setup):  # noqa: F811
    model, tok, recipe, composer = setup
    opt, sched = composer_optimizer(model, composer, lr_encoder=1e-3, lr_resampler=2e-4, warmup_steps=4)
    names = [g["name"] for g in opt.param_groups]
    assert names == ["encoder", "resampler"]
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in adapter_parameters(model, ENCODER)}
    assert {id(p) for p in opt.param_groups[1]["params"]} == {id(p) for p in composer.resampler.parameters()}
    seen = []
    for _ in range(6):
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]))
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx((1e-3 / 4, 2e-4 / 4))
    assert seen[3] == pytest.approx((1e-3, 2e-4)) and seen[5] == pytest.approx((1e-3, 2e-4))
    assert seen[1][0] < seen[2][0] < seen[3][0]


def test_reference_privilege_is_the_text_teachers_gain_clipped_at_zero():
    from lopd_cli.train.losses import privilege_weighted_nll, reference_privilege

    lp_none = torch.log(torch.tensor([0.25, 0.9, 0.5]))
    lp_text = torch.log(torch.tensor([0.9, 0.5, 0.5]))
    priv = reference_privilege(lp_none, lp_text)
    assert priv.tolist() == pytest.approx([float(torch.log(torch.tensor(0.9 / 0.25))), 0.0, 0.0])
    lp = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    assert float(privilege_weighted_nll(lp, priv, 0.0)) == pytest.approx(float(-lp.mean()))
    want = float(((1 + 2.0 * priv) * -lp).mean())
    assert float(privilege_weighted_nll(lp, priv, 2.0)) == pytest.approx(want)


def test_privilege_weighting_moves_the_step_towards_privileged_tokens(setup):  # noqa: F811
    """add_reference_privilege fills one weight per action token (>= 0, from the frozen teacher);
    with privilege_weight > 0 the cold-start step's gradient changes, and a token with zero
    privilege everywhere gives exactly the plain step."""
    from lopd_cli.train.coldstart import add_reference_privilege, coldstart_step

    model, tok, recipe, composer = setup
    refs = items(6)
    examples = [Example(episode(tok, 10 + i, 1 + i % 2), refs[2 * i : 2 * i + 2]) for i in range(3)]
    share = add_reference_privilege(model, tok, examples, 2, 600, 800)
    assert 0.0 <= share <= 1.0
    for ex in examples:
        assert ex.privilege.shape == (sum(ex.episode.action_mask),) and float(ex.privilege.min()) >= 0

    def grads(weight: float, zero: bool = False) -> torch.Tensor:
        exs = [Example(ex.episode, ex.refs, torch.zeros_like(ex.privilege) if zero else ex.privilege)
               for ex in examples]
        opt = torch.optim.SGD([{"params": adapter_parameters(model, ENCODER)},
                               {"params": list(composer.resampler.parameters())}], lr=0.0)
        coldstart_step(model, tok, composer, exs, opt, 1e9, 1e9, privilege_weight=weight)
        g = torch.cat([p.grad.flatten() for p in composer.resampler.parameters() if p.grad is not None])
        return g

    for ex in examples:  # make sure some token is privileged, whatever the random teacher does
        ex.privilege[0] = 3.0
    plain, weighted, zeroed = grads(0.0), grads(4.0), grads(4.0, zero=True)
    assert not torch.allclose(plain, weighted)
    assert torch.allclose(plain, zeroed, atol=1e-7)
