"""χ's input normalisation (`composer.input_norm`, issue 16): the encoder's states standardised
or centred by statistics measured on the bank's items, kept with χ when it is saved."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lopd_cli.compose.composer import QFORMER_FILE, Composer
from lopd_cli.errors import LopdError
from lopd_cli.train.coldstart import Example, input_norm_sequences
from test_composer_latent import episode, items, setup  # noqa: F401  (fixture)


def _composer(setup, norm: str) -> Composer:  # noqa: F811
    model, tok, recipe, _ = setup
    torch.manual_seed(1)
    return Composer(model, tok, recipe.composer.model_copy(update={"input_norm": norm}))


def _states(composer: Composer, seqs) -> torch.Tensor:
    with torch.no_grad():
        hidden, mask = composer._encode_chunk(seqs)
    return hidden[mask.bool()]


def test_standardise_gives_chi_zero_mean_unit_scale_inputs(setup):  # noqa: F811
    composer = _composer(setup, "standardise")
    seqs = [composer.item_token_ids(f"Where is order {i}?", it) for i, it in enumerate(items(6))]
    raw = _states(composer, seqs)
    ticks: list[int] = []
    composer.encode_batch_size = 4
    summary = composer.fit_input_norm(seqs, progress=ticks.append)
    assert ticks == [4, 2]  # one call per chunk of sequences
    assert summary["tokens"] == raw.shape[0] and 0.0 < summary["mean_energy_share"] < 1.0
    r = composer.resampler
    seen = (raw - r.input_mean) / r.input_scale
    assert seen.mean(0).abs().max() < 1e-4
    # unit scale wherever the dimension varies by more than the floor
    varies = raw.std(0, unbiased=False) > 1e-2 * raw.std(0, unbiased=False).median()
    assert torch.allclose(seen.std(0, unbiased=False)[varies], torch.ones(int(varies.sum())), atol=1e-3)


def test_centre_only_subtracts_and_none_is_the_identity(setup):  # noqa: F811
    seqs_of = lambda c: [c.item_token_ids("Where is order 7?", it) for it in items(4)]  # noqa: E731
    plain = _composer(setup, "none")
    seqs = seqs_of(plain)
    with torch.no_grad():
        before = plain.encode_ids(seqs)
    assert plain.fit_input_norm(seqs)["tokens"] == 0
    with torch.no_grad():
        assert torch.equal(before, plain.encode_ids(seqs))  # nothing fitted, same latents
    centred = _composer(setup, "centre")
    centred.fit_input_norm(seqs)
    assert torch.allclose(centred.resampler.input_mean, _states(centred, seqs).mean(0), atol=1e-5)
    assert torch.equal(centred.resampler.input_scale, torch.ones_like(centred.resampler.input_scale))
    # the same χ weights read centred states: other latents
    centred.resampler.load_state_dict({**plain.resampler.state_dict(),
                                       "input_mean": centred.resampler.input_mean,
                                       "input_scale": centred.resampler.input_scale})
    with torch.no_grad():
        assert not torch.allclose(before, centred.encode_ids(seqs), atol=1e-4)


def test_statistics_are_saved_with_chi_and_old_composers_load_as_identity(setup, tmp_path):  # noqa: F811
    model, tok, recipe, _ = setup
    composer = _composer(setup, "standardise")
    seqs = [composer.item_token_ids("x", it) for it in items(3)]
    composer.fit_input_norm(seqs)
    with torch.no_grad():
        before = composer.encode_ids(seqs)
    out = composer.save(tmp_path / "composer")
    assert json.loads((out / "manifest.json").read_text())["input_norm"] == "standardise"
    loaded = Composer.load(out, model, tok, recipe.composer)  # the recipe says "none": the manifest wins
    assert loaded.input_norm == "standardise"
    with torch.no_grad():
        assert torch.allclose(before, loaded.encode_ids(seqs), atol=1e-6)
    # a composer saved before input_norm existed: no buffers in its file, no key in its manifest
    state = {k: v for k, v in load_file(str(out / QFORMER_FILE)).items() if not k.startswith("input_")}
    save_file(state, str(out / QFORMER_FILE))
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["input_norm"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    old = Composer.load(out, model, tok, recipe.composer)
    assert old.input_norm == "none"
    assert torch.equal(old.resampler.input_mean, torch.zeros_like(old.resampler.input_mean))
    assert torch.equal(old.resampler.input_scale, torch.ones_like(old.resampler.input_scale))
    # a file that is not χ's is still an error naming it
    save_file({"queries": state["queries"]}, str(out / QFORMER_FILE))
    with pytest.raises(LopdError, match="qformer.safetensors"):
        Composer.load(out, model, tok, recipe.composer)


def test_the_statistics_are_measured_on_the_training_examples_references(setup):  # noqa: F811
    model, tok, recipe, _ = setup
    composer = _composer(setup, "standardise")
    refs = items(8)
    examples = [Example(episode(tok, 10 + i, 1), refs[2 * i : 2 * i + 2]) for i in range(4)]
    seqs = input_norm_sequences(composer, examples, n=5)
    pairs = [(ex.episode.task.instruction, it) for ex in examples for it in ex.refs]
    assert seqs == [composer.item_token_ids(*pairs[(i * 8) // 5]) for i in range(5)]
    assert input_norm_sequences(_composer(setup, "none"), examples) == []
