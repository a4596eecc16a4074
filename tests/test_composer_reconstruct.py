"""The reconstruction term (`coldstart.reconstruct_weight`, ICAE-style): the teacher must
reproduce a retrieved reference's own action tokens from the latent block. Its gradient reaches
ψ and χ, a held-out task's transcript is never a target, and training lowers it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lopd_cli.models.adapters import ENCODER, adapter_parameters
from lopd_cli.train.coldstart import (
    Example,
    add_reference_episodes,
    coldstart_step,
    composer_optimizer,
    reconstruction_nll,
    reconstruction_targets,
)
from test_composer_latent import Item, episode, items, setup  # noqa: F401  (fixture)


@dataclass
class BankLike(Item):
    task_id: str | None = None
    reward: float = 1.0


def bank_items(n: int) -> list[BankLike]:
    return [BankLike(id=it.id, instruction=it.instruction, messages=it.messages, task_id=f"task{i}")
            for i, it in enumerate(items(n))]


def restorer(model, composer):
    """A function that puts φ (the encoder LoRA ψ and the resampler χ) back to what it is now,
    so two arms of a test start from the same composer."""
    psi = adapter_parameters(model, ENCODER)
    saved = ([p.detach().clone() for p in psi], {k: v.clone() for k, v in composer.resampler.state_dict().items()})

    def restore() -> None:
        with torch.no_grad():
            for p, v in zip(psi, saved[0]):
                p.copy_(v)
        composer.resampler.load_state_dict(saved[1])

    return restore


def examples_for(tok, refs) -> list[Example]:
    return [Example(episode(tok, 10 + i, 1 + i % 2), refs[2 * i: 2 * i + 2]) for i in range(len(refs) // 2)]


def test_reconstruction_gradient_reaches_encoder_lora_and_resampler(setup):  # noqa: F811
    model, tok, _, composer = setup
    examples = examples_for(tok, bank_items(6))
    assert add_reference_episodes(tok, examples, None, set()) == 6
    targets = reconstruction_targets(examples, random.Random(0))
    assert [b for b, _ in targets] == [0, 1, 2]
    for b, ep in targets:  # each target is one of its own example's references
        assert ep.task.id in {r.task_id for r in examples[b].refs}
    for p in model.parameters():
        p.grad = None
    latents = composer([ex.refs for ex in examples], [ex.episode.task.instruction for ex in examples])
    rec = reconstruction_nll(model, tok, latents, targets)
    assert torch.isfinite(rec) and rec.item() > 0
    rec.backward()
    psi = adapter_parameters(model, ENCODER)
    chi = list(composer.resampler.parameters())
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in psi), "no gradient into ψ"
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in chi), "no gradient into χ"
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_held_out_tasks_are_never_reconstructed(setup):  # noqa: F811
    _, tok, _, _ = setup
    refs = bank_items(6)
    examples = examples_for(tok, refs)
    assert add_reference_episodes(tok, examples, None, {"task1", "task4"}) == 4
    assert examples[0].ref_episodes[1] is None and examples[2].ref_episodes[0] is None
    rng = random.Random(3)
    for _ in range(20):
        for _, ep in reconstruction_targets(examples, rng):
            assert ep.task.id not in ("task1", "task4")
    # a reference longer than max_tokens is not a target either; an example with none is skipped
    examples = examples_for(tok, refs)
    assert add_reference_episodes(tok, examples, 5, set()) == 0
    assert reconstruction_targets(examples, rng) == []


def test_training_with_the_term_lowers_the_reconstruction_nll(setup):  # noqa: F811
    model, tok, _, composer = setup
    examples = examples_for(tok, bank_items(6))
    add_reference_episodes(tok, examples, None, set())
    targets = reconstruction_targets(examples, random.Random(0))
    restore = restorer(model, composer)

    def rec_after(weight: float) -> float:
        restore()
        opt, _ = composer_optimizer(model, composer, 1e-2, 1e-2, 0)
        for _ in range(3):
            row = coldstart_step(model, tok, composer, examples, opt, 3.0, 30.0, reconstruct_weight=weight,
                                 reconstruct=targets)
            assert ("reconstruct" in row) == (weight > 0)
        with torch.no_grad():
            lat = composer([ex.refs for ex in examples], [ex.episode.task.instruction for ex in examples])
            return float(reconstruction_nll(model, tok, lat, targets))

    off, on = rec_after(0.0), rec_after(1.0)
    assert on < off - 1e-3, (on, off)  # deterministic; a random tiny model reads latents weakly (~0.005)


def test_micro_batches_give_the_same_step_as_one_batch(setup):  # noqa: F811
    """coldstart.micro_batch accumulates gradients: without the contrastive term (whose pairs
    are formed within a micro-batch) the step's loss and update match the one-batch step."""
    model, tok, _, composer = setup
    examples = examples_for(tok, bank_items(8))
    add_reference_episodes(tok, examples, None, set())
    targets = reconstruction_targets(examples, random.Random(0))
    psi = adapter_parameters(model, ENCODER)
    restore = restorer(model, composer)
    before = [p.detach().clone() for p in psi] + [p.detach().clone() for p in composer.resampler.parameters()]

    def step(micro: int | None):
        restore()
        opt = torch.optim.SGD([{"params": psi}, {"params": list(composer.resampler.parameters())}], lr=0.1)
        row = coldstart_step(model, tok, composer, examples, opt, 1e9, 1e9, reconstruct_weight=0.5,
                             reconstruct=targets, micro_batch=micro)
        return row, [p.detach().clone() for p in psi] + [p.detach().clone() for p in composer.resampler.parameters()]

    whole, after_whole = step(None)
    split, after_split = step(3)
    assert abs(whole["loss"] - split["loss"]) < 1e-5 and whole["tokens"] == split["tokens"]
    assert abs(whole["grad_norm_lora"] - split["grad_norm_lora"]) < 1e-3 * max(1.0, whole["grad_norm_lora"])
    assert any(not torch.allclose(a, b) for a, b in zip(before, after_whole))  # the step did move φ
    for a, b in zip(after_whole, after_split):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-3)


def test_micro_batch_one_with_the_contrastive_term_warns(setup):  # noqa: F811
    import pytest

    from lopd_cli.config import ColdstartSection
    from lopd_cli.errors import LopdWarning
    from lopd_cli.train.coldstart import train_composer

    model, tok, _, composer = setup
    examples = examples_for(tok, bank_items(4))
    cfg = ColdstartSection(steps=1, batch_size=2, micro_batch=1, contrastive_weight=1.0)
    with pytest.warns(LopdWarning, match="no contrastive pair"):
        train_composer(model, tok, composer, examples, [], cfg)


def test_val_n_takes_an_evenly_spaced_subset():
    from lopd_cli.train.coldstart import evenly_spaced

    assert evenly_spaced(range(10), None) == list(range(10))
    assert evenly_spaced(range(10), 20) == list(range(10))
    assert evenly_spaced(range(10), 4) == [0, 2, 5, 7]
    assert evenly_spaced(range(45), 16)[-1] < 45 and len(set(evenly_spaced(range(45), 16))) == 16
