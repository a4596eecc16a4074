"""The cheaper composer phase (issue 20): each distinct (task, item) encoded once, the composer pass
on a share of the rows, no-grad latents kept while φ is unchanged, and the rows each step picks."""

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.fixture(scope="module")
def bench():
    import step_overhead as so

    b = so.Bench("tiny", types.SimpleNamespace(num_queries=4, depth=1, batch=6, length=160, action_tokens=40))
    for ep, r in zip(b.episodes, [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]):
        ep.reward = r
    with torch.no_grad():  # a non-zero encoder LoRA, so ψ's gradients and outputs are not trivial
        for p in b.composer_params:
            p.add_(0.01 * torch.randn_like(p))
    return b


def _grads(params):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def _zero(params):
    for p in params:
        p.grad = None


def _run(b, episodes, refs, rows=None, margin="centred", totals=None, beta=0.7, **kw):
    from lopd_cli.train.step import StepSetup, lopd_step

    t = b.recipe.train
    _zero(b.student_params + b.composer_params)
    lat0 = {i: l for i, l in zip(b.instrs, b.latents0)}
    setup = StepSetup(b.model, b.tok, t.distill.top_m, t.lopd.margin_m, t.lopd.anchor_lambda, 2, t.logit_chunk, composer=b.composer,
                         train_composer=True, latents0=lambda ins, r: torch.stack([lat0[i] for i in ins]),
                         margin_advantage=margin, composer_rows=rows, **kw)
    o = lopd_step(setup, episodes, refs, beta, totals)
    return o, _grads(b.student_params), _grads(b.composer_params)


def _close(a, b, tol=1e-5):
    """Every gradient within tol of the other, relative to its largest entry (at least 1)."""
    return all(float((x - y).abs().max()) <= tol * max(1.0, float(y.abs().max())) for x, y in zip(a, b))


def test_each_pair_encoded_once_gives_the_same_latents_and_gradients(bench, monkeypatch):
    from lopd_cli.train.step import encode_latents

    b = bench
    # rows 0 and 3 solve the same task with the same items; row 4 shares one item with row 1
    refs = [b.refs[0], b.refs[1], b.refs[2], b.refs[0], [b.refs[1][0], b.refs[4][1], b.refs[4][2]]]
    instrs = [b.instrs[0], b.instrs[1], b.instrs[2], b.instrs[0], b.instrs[1]]
    calls = []
    enc = b.composer.encode_ids
    monkeypatch.setattr(b.composer, "encode_ids", lambda seqs, keys=None: calls.append(len(seqs)) or enc(seqs, keys))
    w = torch.randn(b.composer.dims.dim)

    _zero(b.composer_params)
    lat = encode_latents(b.composer, refs, instrs)
    (lat.float() @ w).pow(2).sum().backward()
    g_once = _grads(b.composer_params)
    assert calls == [5 * 3 - 3 - 1], "15 item slots, 4 repeats: 11 distinct (task, item) pairs"

    _zero(b.composer_params)
    ref = b.composer(refs, instrs)
    (ref.float() @ w).pow(2).sum().backward()
    g_each = _grads(b.composer_params)
    assert lat.shape == ref.shape
    assert float((lat - ref).abs().max()) <= 1e-5
    assert _close(g_once, g_each)
    assert any(float(g.abs().sum()) > 0 for g in g_once)


def test_no_grad_cache_serves_repeats_and_matches_a_fresh_encode(bench):
    from lopd_cli.train.step import NoGradLatents, encode_latents

    b = bench
    cache = NoGradLatents()
    with torch.no_grad():
        first = encode_latents(b.composer, b.refs[:3], b.instrs[:3], cache)
        assert len(cache) == 9 and cache.hits == 0
        again = encode_latents(b.composer, b.refs[1:4], b.instrs[1:4], cache)
        fresh = b.composer(b.refs[1:4], b.instrs[1:4])
    assert cache.hits == 6 and len(cache) == 12
    assert float((again - fresh).abs().max()) <= 1e-5
    assert torch.equal(again[:2], first[1:3])
    small = NoGradLatents(max_entries=4)
    with torch.no_grad():
        encode_latents(b.composer, b.refs[:3], b.instrs[:3], small)
    assert len(small) == 4


def test_all_rows_equals_the_default_and_student_gradients_do_not_depend_on_the_rows(bench):
    b = bench
    o_all, gs_all, gc_all = _run(b, b.episodes, b.refs)
    o_rows, gs_rows, gc_rows = _run(b, b.episodes, b.refs, rows=[True] * 6)
    assert _close(gs_all, gs_rows) and _close(gc_all, gc_rows)
    o_sub, gs_sub, gc_sub = _run(b, b.episodes, b.refs, rows=[True, False, False, True, False, True])
    o_none, gs_none, gc_none = _run(b, b.episodes, b.refs, rows=[False] * 6)
    for o in (o_sub, o_none):  # the student pass and Δ (for β) see every row whatever the composer rows
        assert abs(o.kl - o_all.kl) <= 1e-6 and abs(o.delta - o_all.delta) <= 1e-6
    assert _close(gs_all, gs_sub) and _close(gs_all, gs_none)
    assert all(float(g.abs().sum()) == 0 for g in gc_none)
    assert not _close(gc_all, gc_sub, 1e-7), "a share of the rows is another composer gradient"
    assert abs(o_none.composer_kl - o_all.kl) <= 1e-6


def test_composer_rows_give_the_gradient_of_those_rows_alone(bench):
    """With the paper's Δ (no batch centring), φ's gradient from rows S of a batch = φ's gradient
    of a batch holding S alone: each term is a mean over the composer rows."""
    b = bench
    rows = [False, True, False, True, True, False]
    pick = [i for i, r in enumerate(rows) if r]
    o_sub, _, gc_sub = _run(b, b.episodes, b.refs, rows=rows, margin="paper", contrastive_weight=0.5)
    o_alone, _, gc_alone = _run(b, [b.episodes[i] for i in pick], [b.refs[i] for i in pick], margin="paper",
                                contrastive_weight=0.5)
    assert _close(gc_sub, gc_alone)
    assert abs(o_sub.composer_kl - o_alone.composer_kl) <= 1e-6 and abs(o_sub.anchor - o_alone.anchor) <= 1e-6
    assert abs(o_sub.contrastive - o_alone.contrastive) <= 1e-6


def test_composer_micro_batch_chunks_the_composer_pass_and_keeps_the_gradients(bench, monkeypatch):
    """train.lopd.composer_micro_batch: the composer pass runs in chunks of that many rows (its graphs
    are what bound the step's peak memory) and the losses and gradients stay the same sums."""
    import lopd_cli.train.step as step

    b = bench
    o_ref, gs_ref, gc_ref = _run(b, b.episodes, b.refs)  # micro_batch 2 for every pass
    sizes = []
    th = step.teacher_hidden
    monkeypatch.setattr(step, "teacher_hidden",
                        lambda m, tb, lat, **kw: sizes.append((torch.is_grad_enabled(), lat.shape[0])) or th(m, tb, lat, **kw))
    o_one, gs_one, gc_one = _run(b, b.episodes, b.refs, composer_micro_batch=1)
    assert sizes == [(True, 1)] * 6, "six composer chunks of one row, each with gradient"
    for k in ("kl", "composer_kl", "delta", "anchor"):
        assert abs(getattr(o_one, k) - getattr(o_ref, k)) <= 1e-6, k
    assert _close(gs_one, gs_ref) and _close(gc_one, gc_ref)
    assert any(float(g.abs().sum()) > 0 for g in gc_one)
    sizes.clear()
    _run(b, b.episodes, b.refs, composer_micro_batch=5)
    assert sizes == [(True, 2)] * 3, "never more rows than micro_batch (2)"


def test_a_contrastive_term_with_smaller_composer_chunks_warns():
    from lopd_cli.config import TrainSection
    from lopd_cli.train.loop import contrastive_chunk_warning

    assert contrastive_chunk_warning(TrainSection()) is None  # no contrastive term by default
    assert contrastive_chunk_warning(TrainSection(lopd={"contrastive_weight": 1.0, "composer_micro_batch": 8})) is None
    msg = contrastive_chunk_warning(TrainSection(lopd={"contrastive_weight": 1.0, "composer_micro_batch": 1}))
    assert "composer_micro_batch=1" in msg and "none at 1" in msg and "composer_micro_batch=8" in msg
    assert contrastive_chunk_warning(TrainSection(algo="opsd", lopd={"contrastive_weight": 1.0})) is None


def test_rows_per_step_follow_composer_batch_and_every():
    from lopd_cli.agent.types import Episode  # noqa: F401
    from lopd_cli.config import TrainSection
    from lopd_cli.train.loop import composer_rows

    def tr(seed=0, **lopd):
        return types.SimpleNamespace(trains_composer=True,
                                     recipe=types.SimpleNamespace(train=TrainSection(seed=seed, lopd=lopd)))

    eps = [types.SimpleNamespace(action_mask=[0, 1, 1]) for _ in range(7)] + [types.SimpleNamespace(action_mask=[1, 0])]
    assert composer_rows(tr(), eps, 1) is None
    assert composer_rows(tr(composer_batch=8), eps, 1) is None
    r1 = composer_rows(tr(composer_batch=3), eps, 1)
    assert sum(r1) == 3 and not r1[7], "drawn among rows with supervised tokens"
    assert r1 == composer_rows(tr(composer_batch=3), eps, 1), "the same draw on every rank and on a resume"
    assert any(composer_rows(tr(composer_batch=3), eps, s) != r1 for s in range(2, 6))
    state = torch.random.get_rng_state()
    composer_rows(tr(composer_batch=3, seed=4), eps, 9)
    assert torch.equal(state, torch.random.get_rng_state())
    every = [composer_rows(tr(composer_every=3), eps, s) for s in range(1, 7)]
    assert [e is None for e in every] == [True, False, False, True, False, False]
    assert every[1] == [False] * 8
    frozen = types.SimpleNamespace(trains_composer=False, recipe=types.SimpleNamespace(train=TrainSection()))
    assert composer_rows(frozen, eps, 2) is None
