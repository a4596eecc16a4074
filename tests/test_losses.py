"""Losses against brute-force full-vocabulary computations (float64), edge cases, gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lopd_cli.train.losses import (
    anchor_loss,
    append_tail,
    centred_advantages,
    centred_margin,
    contrastive_hinge,
    rewards_have_spread,
    chunked_logprobs,
    chunked_reverse_kl,
    chunked_teacher_topm,
    chunked_token_logprobs,
    TermWeights,
    composer_objective,
    dual_update,
    group_advantages,
    grpo_loss,
    privileged_margin,
    reverse_kl_topm,
    sequence_mean,
    teacher_topm,
    token_logprobs,
    topm_kl_per_token,
    topm_reverse_kl,
    topm_tail_logprobs,
)

# ------------------------------------------------------------------ brute-force references


def brute_ptilde(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """p̃ in probability space, float64: full softmax, gather, tail = Σ of p outside `ids`.

    The tail sums the complement directly: 1 − Σ_ids would cancel to noise when the tail mass is
    ~1e-15 (large logits), which the loss, computing it exactly, does not do."""
    p = torch.softmax(logits.double(), -1)
    on = p.gather(-1, ids)
    outside = torch.ones_like(p).scatter(-1, ids, 0.0)
    tail = (p * outside).sum(-1, keepdim=True)  # 0 when the ids cover the vocabulary
    return torch.cat([on, tail], -1)


def brute_kl(ps: torch.Tensor, pt: torch.Tensor) -> torch.Tensor:
    terms = torch.where(ps > 0, ps * (ps.log() - pt.log()), torch.zeros_like(ps))
    return terms.sum(-1)


def brute_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    per_seq = []
    for v, w in zip(values.tolist(), mask.float().tolist()):
        if sum(w) > 0:
            per_seq.append(sum(a * b for a, b in zip(v, w)) / sum(w))
    return sum(per_seq) / len(per_seq) if per_seq else 0.0


def make_case(seed: int, b: int = 3, t: int = 5, v: int = 50, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(b, t, v, generator=g) * scale
    te = torch.randn(b, t, v, generator=g) * scale
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0, 0] = True
    return s, te, mask


# ------------------------------------------------------------------------ top-M + tail


def test_teacher_topm_matches_full_softmax():
    _, te, _ = make_case(0)
    lp, ids = teacher_topm(te, 7)
    ref = torch.softmax(te.double(), -1).topk(7, -1)
    assert torch.equal(ids, ref.indices)
    assert torch.allclose(lp.exp().double(), brute_ptilde(te, ids), atol=1e-6)
    assert lp.shape == (*te.shape[:-1], 8)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), m=st.integers(1, 60), v=st.integers(2, 40), scale=st.floats(0.1, 8.0, allow_subnormal=False))
@example(seed=35, m=25, v=35, scale=8.0)  # a teacher tail of ~1e-15: the old 1 − Σ reference failed here
def test_topm_kl_matches_brute_force(seed, m, v, scale):
    s, te, mask = make_case(seed, v=v, scale=scale)
    t_lp, ids = teacher_topm(te, m)
    out = reverse_kl_topm(s, t_lp, ids, mask)
    ref_tok = brute_kl(brute_ptilde(s, ids), brute_ptilde(te, ids))
    assert torch.isfinite(out.per_token).all()
    assert torch.allclose(out.per_token.double()[mask], ref_tok[mask], atol=1e-5, rtol=1e-4)
    assert (out.per_token[~mask] == 0).all()
    assert math.isclose(out.loss.item(), brute_sequence_mean(ref_tok, mask), rel_tol=1e-4, abs_tol=1e-5)


def test_peaked_teacher_keeps_its_tiny_tail():
    # teacher's top-3 hold all but ~1e-9 of the mass; the student's tail is large
    v = 30
    te = torch.full((1, 2, v), -10.0)
    te[..., :3] = torch.tensor([12.0, 11.0, 10.5])
    s = torch.randn(1, 2, v, generator=torch.Generator().manual_seed(1))
    t_lp, ids = teacher_topm(te, 3)
    ref_t = brute_ptilde(te, ids)
    assert ref_t[..., -1].max() < 1e-8
    assert torch.allclose(t_lp[..., -1].double(), ref_t[..., -1].log(), atol=1e-4)  # exact in log space
    out = reverse_kl_topm(s, t_lp, ids, torch.ones(1, 2, dtype=torch.bool))
    ref = brute_kl(brute_ptilde(s, ids), ref_t)
    assert torch.allclose(out.per_token.double(), ref, rtol=1e-5)
    # stored log-probs without logits: the clamped tail stays finite and tiny
    stored = append_tail(t_lp[..., :-1], v)
    assert torch.isfinite(stored).all() and stored[..., -1].max() < math.log(1e-6)


def test_append_tail_matches_logits_tail_for_ordinary_mass():
    _, te, _ = make_case(2)
    t_lp, _ = teacher_topm(te, 5)
    assert torch.allclose(append_tail(t_lp[..., :-1], te.shape[-1]), t_lp, atol=1e-5)


@pytest.mark.parametrize("m", [8, 20])
def test_m_at_least_vocab_has_empty_tail_contributing_zero(m):
    s, te, mask = make_case(3, v=8)
    s.requires_grad_(True)
    t_lp, ids = teacher_topm(te, m)
    assert ids.shape[-1] == 8 and torch.isneginf(t_lp[..., -1]).all()
    s_lp = topm_tail_logprobs(s, ids)
    assert torch.isneginf(s_lp[..., -1]).all()
    assert torch.isneginf(append_tail(t_lp[..., :-1], 8)[..., -1]).all()
    out = topm_reverse_kl(s_lp, t_lp, mask)
    full_kl = (torch.softmax(s.double(), -1) * (torch.log_softmax(s.double(), -1) - torch.log_softmax(te.double(), -1))).sum(-1)
    assert torch.allclose(out.per_token.double()[mask], full_kl[mask], atol=1e-5)
    out.loss.backward()
    assert torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    # composer direction through an empty tail: finite gradient too
    te2 = te.clone().requires_grad_(True)
    topm_reverse_kl(s_lp, topm_tail_logprobs(te2, ids), mask, detach="student").loss.backward()
    assert torch.isfinite(te2.grad).all()


def test_kl_is_zero_for_identical_and_positive_otherwise():
    s, te, mask = make_case(4)
    t_lp, ids = teacher_topm(te, 5)
    assert topm_kl_per_token(t_lp, t_lp).abs().max() < 1e-6
    assert (topm_kl_per_token(topm_tail_logprobs(s, ids), t_lp) >= -1e-6).all()


# ---------------------------------------------------------------- masking and normalisation


def test_all_masked_sequence_contributes_nothing():
    s, te, mask = make_case(5)
    mask[1] = False
    s.requires_grad_(True)
    t_lp, ids = teacher_topm(te, 5)
    full = reverse_kl_topm(s, t_lp, ids, mask)
    keep = [0, 2]
    sub = reverse_kl_topm(s[keep], t_lp[keep], ids[keep], mask[keep])
    assert torch.allclose(full.loss, sub.loss)
    full.loss.backward()
    assert (s.grad[1] == 0).all() and torch.isfinite(s.grad).all()


def test_nothing_supervised_gives_zero_without_nan():
    s, te, _ = make_case(6)
    s.requires_grad_(True)
    none = torch.zeros(s.shape[:-1], dtype=torch.bool)
    t_lp, ids = teacher_topm(te, 5)
    out = reverse_kl_topm(s, t_lp, ids, none)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.isfinite(s.grad).all() and (s.grad == 0).all()


def test_sequence_mean_weights_sequences_equally():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert sequence_mean(values, mask).item() == pytest.approx(3.0)  # not the token mean 1.8
    assert sequence_mean(torch.tensor([[float("nan"), 2.0]]), torch.tensor([[0, 1]])).item() == 2.0


# ------------------------------------------------------------------------ gradient sides


def test_student_pass_has_no_gradient_into_teacher_and_composer_none_into_student():
    s, te, mask = make_case(7)
    _, ids = teacher_topm(te, 5)
    s.requires_grad_(True)
    te.requires_grad_(True)
    s_lp, t_lp = topm_tail_logprobs(s, ids), topm_tail_logprobs(te, ids)

    topm_reverse_kl(s_lp, t_lp, mask, detach="teacher").loss.backward(retain_graph=True)
    assert te.grad is None and s.grad.abs().sum() > 0
    s.grad = None
    topm_reverse_kl(s_lp, t_lp, mask, detach="student").loss.backward()
    assert s.grad is None and te.grad.abs().sum() > 0
    with pytest.raises(ValueError):
        topm_reverse_kl(s_lp, t_lp, mask, detach="both")


def test_student_gradient_matches_brute_force():
    s, te, mask = make_case(8, v=12)
    t_lp, ids = teacher_topm(te, 4)
    s32 = s.clone().requires_grad_(True)
    reverse_kl_topm(s32, t_lp, ids, mask).loss.backward()
    s64 = s.double().requires_grad_(True)
    ref_tok = brute_kl(brute_ptilde(s64, ids), brute_ptilde(te, ids))
    per_seq = (ref_tok * mask).sum(-1) / mask.sum(-1)
    per_seq[mask.sum(-1) > 0].mean().backward()
    assert torch.allclose(s32.grad.double(), s64.grad, atol=1e-6)


# ------------------------------------------------------------------------- chunked forms


def _hidden_case(seed=9, b=2, t=7, d=16, v=300):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(b, t, d, generator=g)
    ht = torch.randn(b, t, d, generator=g)
    head = torch.nn.Linear(d, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, d, generator=g))
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0, 0] = True
    return hs, ht, head, mask


@pytest.mark.parametrize("chunk", [1, 3, 5, 64])
def test_chunked_kl_equals_unchunked_in_value_and_gradients(chunk):
    hs, ht, head, mask = _hidden_case()
    t_lp, ids = chunked_teacher_topm(ht, head, 6, mask=mask, chunk_size=chunk)
    t_ref, ids_ref = teacher_topm(head(ht), 6)
    assert torch.equal(ids[mask], ids_ref[mask]) and torch.allclose(t_lp[mask], t_ref[mask], atol=1e-5)

    h1 = hs.clone().requires_grad_(True)
    out = chunked_reverse_kl(h1, head, t_lp, ids, mask, chunk_size=chunk)
    out.loss.backward()
    g_h1, g_w1 = h1.grad.clone(), head.weight.grad.clone()
    head.weight.grad = None

    h2 = hs.clone().requires_grad_(True)
    ref = reverse_kl_topm(head(h2), t_lp, ids, mask)
    ref.loss.backward()
    assert torch.allclose(out.loss, ref.loss, atol=1e-5)
    assert torch.allclose(out.per_token, ref.per_token, atol=1e-5)
    assert torch.allclose(g_h1, h2.grad, atol=1e-5)
    assert torch.allclose(g_w1, head.weight.grad, atol=1e-5)


def test_chunked_composer_pass_equals_unchunked():
    """Teacher top-M + action log-prob in one chunked pass, gradient into the teacher side."""
    hs, ht, head, mask = _hidden_case(10)
    w = head.weight.detach().clone()
    actions = torch.randint(0, w.shape[0], hs.shape[:-1], generator=torch.Generator().manual_seed(0))
    t_lp0, ids = chunked_teacher_topm(ht, w, 5, mask=mask)
    s_lp = topm_tail_logprobs(hs @ w.T, ids)
    s_tok = token_logprobs(hs @ w.T, actions)
    reward = torch.tensor([1.0, 0.0])

    def objective(t_topm, t_tok):
        kl = topm_reverse_kl(s_lp, t_topm, mask, detach="student").loss
        delta = privileged_margin(t_tok, s_tok, reward, mask)
        return composer_objective(kl, 0.7, 0.05, delta, torch.tensor(0.0), 0.2)

    h1 = ht.clone().requires_grad_(True)
    t_topm, t_tok = chunked_logprobs(h1, w, topm_ids=ids, token_ids=actions, mask=mask, chunk_size=4)
    objective(t_topm, t_tok).backward()
    h2 = ht.clone().requires_grad_(True)
    logits = h2 @ w.T
    objective(topm_tail_logprobs(logits, ids), token_logprobs(logits, actions)).backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5)
    assert torch.allclose(
        chunked_token_logprobs(ht, w, actions, chunk_size=3), token_logprobs(ht @ w.T, actions), atol=1e-5
    )


def test_chunked_nothing_supervised():
    hs, _, head, _ = _hidden_case(11)
    none = torch.zeros(hs.shape[:-1], dtype=torch.bool)
    t_lp, ids = chunked_teacher_topm(hs, head, 4, mask=none)
    assert t_lp.shape == (*hs.shape[:-1], 5) and ids.shape == (*hs.shape[:-1], 4)
    h = hs.clone().requires_grad_(True)
    out = chunked_reverse_kl(h, head, t_lp, ids, none)
    out.loss.backward()
    assert out.loss.item() == 0.0 and (h.grad == 0).all()


# ------------------------------------------------------------- margin, anchor, dual, objective


def test_margin_sign_follows_reward_and_matches_hand_computation():
    teacher = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]], requires_grad=True)
    student = torch.tensor([[-1.5, -2.5, -9.0], [-2.0, -1.5, -3.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # δ on supervised tokens: 0.5, 0.5 | 1.0, 0.5, 0.0
    up = privileged_margin(teacher, student, torch.tensor([1.0, 1.0]), mask)
    assert up.item() == pytest.approx((0.5 + 0.5 + 1.0 + 0.5 + 0.0) / 5)
    down = privileged_margin(teacher, student, torch.tensor([0.0, 0.0]), mask)
    assert down.item() == pytest.approx(-up.item())
    mixed = privileged_margin(teacher, student, torch.tensor([1.0, 0.0]), mask)
    assert mixed.item() == pytest.approx((0.5 + 0.5 - 1.0 - 0.5 - 0.0) / 5)
    mixed.backward()
    assert student.grad is None
    assert torch.allclose(teacher.grad, torch.tensor([[0.2, 0.2, 0.0], [-0.2, -0.2, -0.2]]))


def test_dual_update_rises_below_margin_and_falls_to_zero_above():
    beta, m, eta = 0.0, 0.05, 0.5
    betas = []
    for _ in range(4):  # Δ < m: β rises by η (m − Δ) each step
        beta = dual_update(beta, m, torch.tensor(-0.1), eta)
        betas.append(beta)
    assert betas == pytest.approx([0.075, 0.15, 0.225, 0.3])
    for _ in range(10):  # Δ > m: β falls and is clamped at 0
        beta = dual_update(beta, m, 0.25, eta)
        betas.append(beta)
    assert all(b2 <= b1 for b1, b2 in zip(betas[3:], betas[4:]))
    assert betas[4] == pytest.approx(0.2) and betas[-1] == 0.0 and min(betas) >= 0.0


def test_anchor_is_the_squared_norm_summed_per_task_and_averaged_over_tasks():
    c0 = torch.randn(3, 6, 8, requires_grad=True)
    c = (c0.detach() + torch.randn(3, 6, 8)).requires_grad_(True)
    a = anchor_loss(c, c0)
    brute = sum(float(((c[b] - c0[b]).detach().double() ** 2).sum()) for b in range(3)) / 3  # ‖c_b − c0_b‖², mean over b
    assert a.item() == pytest.approx(brute, rel=1e-6)
    # one task as a 2-D (K, d) input is its plain squared norm
    assert anchor_loss(c[0], c0[0]).item() == pytest.approx(float(((c[0] - c0[0]) ** 2).sum()), rel=1e-6)
    a.backward()
    assert c0.grad is None and torch.allclose(c.grad, 2 * (c - c0).detach() / 3)


def test_composer_objective_pushes_margin_up_when_beta_positive():
    delta = torch.tensor(0.01, requires_grad=True)
    kl = torch.tensor(0.3, requires_grad=True)
    anchor = torch.tensor(0.5, requires_grad=True)
    loss = composer_objective(kl, 2.0, 0.05, delta, anchor, 0.2)
    assert loss.item() == pytest.approx(0.3 + 2.0 * (0.05 - 0.01) + 0.2 * 0.5)
    loss.backward()
    assert delta.grad.item() == pytest.approx(-2.0)  # descent increases Δ
    assert anchor.grad.item() == pytest.approx(0.2) and kl.grad.item() == pytest.approx(1.0)


def test_composer_objective_with_weights_and_the_contrastive_term_is_the_hand_formula():
    kl, delta, anchor, hinge = (torch.tensor(v, requires_grad=True) for v in (0.3, 0.02, 0.5, 0.4))
    beta, m, lam, cw = 1.5, 0.05, 0.2, 0.7
    w = TermWeights(kl=0.5, margin=0.25, anchor=0.75, contrastive=2.0)
    loss = composer_objective(kl, beta, m, delta, anchor, lam, hinge, cw, w)
    assert loss.item() == pytest.approx(0.5 * 0.3 + 1.5 * 0.25 * (0.05 - 0.02) + 0.2 * 0.75 * 0.5 + 0.7 * 2.0 * 0.4)
    loss.backward()
    grads = [kl.grad.item(), delta.grad.item(), anchor.grad.item(), hinge.grad.item()]
    assert grads == pytest.approx([0.5, -1.5 * 0.25, 0.2 * 0.75, 0.7 * 2.0])
    # margin_m None (the backward pass's form): β·m, a constant, is left out; the gradients stay
    d2 = delta.detach().clone().requires_grad_(True)
    no_const = composer_objective(kl.detach(), beta, None, d2, anchor.detach(), lam, hinge.detach(), cw, w)
    assert no_const.item() == pytest.approx(loss.item() - 1.5 * 0.25 * 0.05)
    no_const.backward()
    assert d2.grad.item() == delta.grad.item()
    # the step's logged composer_loss: Python floats, the terms added left to right, bit for bit
    floats = (0.31, 0.7, 0.05, 0.013, 0.42, 0.2, 0.09, 0.5)
    k, b_, m_, d, a, l_, c, cw_ = floats
    assert composer_objective(k, b_, m_, d, a, l_, c, cw_) == k + b_ * (m_ - d) + l_ * a + cw_ * c
    assert composer_objective(k, b_, m_, d, a, l_) == k + b_ * (m_ - d) + l_ * a  # no contrastive term


# ---------------------------------------------------------------------------------- GRPO


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 4), st.floats(0.0, 1.0, allow_subnormal=False)), min_size=1, max_size=24),
)
def test_group_advantages_zero_mean_unit_std_per_group(data):
    groups = torch.tensor([g for g, _ in data])
    rewards = torch.tensor([r for _, r in data])
    adv = group_advantages(rewards, groups)
    assert torch.isfinite(adv).all()
    for g in groups.unique():
        a = adv[groups == g].double()
        assert abs(a.mean().item()) < 1e-4
        r = rewards[groups == g].double()
        if len(r) > 1 and r.std() > 1e-3:
            assert a.std().item() == pytest.approx(1.0, rel=1e-3)
        if len(r) == 1:
            assert a.item() == 0.0


def test_grpo_clipped_objective_hand_case():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    out = grpo_loss(new, old, adv, mask, clip_eps=0.2)
    # token terms: min(1.5, 1.2)=1.2 | min(0.5, 0.8)=0.5 | min(-1.1,-1.1)=-1.1 | min(-0.7,-0.8)=-0.8
    assert out.per_token.tolist()[0] == pytest.approx([-1.2, -0.5, 1.1, 0.8])
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8) / 4)
    assert out.clip_fraction.item() == pytest.approx(0.5)
    out.loss.backward()
    # clipped tokens carry no gradient; unclipped ones −A·ρ/4
    assert new.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0])


def test_grpo_ratio_one_gradient_is_vanilla_policy_gradient():
    g = torch.Generator().manual_seed(12)
    lp = -torch.rand(3, 6, generator=g) * 3
    mask = torch.rand(3, 6, generator=g) > 0.3
    mask[:, 0] = True
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 0]))
    a = lp.clone().requires_grad_(True)
    grpo_loss(a, lp, adv, mask).loss.backward()
    b = lp.clone().requires_grad_(True)
    sequence_mean(-adv[:, None] * b, mask).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-7)


def test_grpo_k3_kl_to_reference():
    g = torch.Generator().manual_seed(13)
    new = -torch.rand(2, 5, generator=g)
    mask = torch.ones(2, 5)
    adv = torch.tensor([1.0, -1.0])
    same = grpo_loss(new, new, adv, mask, ref_logprobs=new, kl_coef=0.1)
    assert same.kl.item() == pytest.approx(0.0, abs=1e-7)
    ref = new - 0.3
    out = grpo_loss(new, new, adv, mask, ref_logprobs=ref, kl_coef=0.1)
    k3 = math.exp(-0.3) + 0.3 - 1.0
    assert out.kl.item() == pytest.approx(k3, rel=1e-5)
    assert out.loss.item() == pytest.approx(same.loss.item() + 0.1 * k3, rel=1e-5)
    no_coef = grpo_loss(new, new, adv, mask, ref_logprobs=ref)
    assert no_coef.loss.item() == pytest.approx(same.loss.item()) and no_coef.kl.item() > 0


def test_token_logprobs_is_gather_of_log_softmax():
    s, _, _ = make_case(14)
    ids = torch.randint(0, s.shape[-1], s.shape[:-1])
    assert torch.allclose(token_logprobs(s, ids), F.log_softmax(s, -1).gather(-1, ids[..., None]).squeeze(-1), atol=1e-6)


def test_group_of_equal_rewards_has_exactly_zero_advantage():
    # float32 mean of three 0.964168421288669 is off by an ulp; eps must not turn that into 0.06
    rewards = torch.tensor([0.964168421288669] * 3 + [0.0, 1.0])
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1]))
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[3] < 0 < adv[4]


# ----------------------------------------------------------------- the centred margin (issue 16)


def brute_centred_margin(teacher, student, rewards, mask) -> float:
    """2·(1/n)Σ_b (r_b − r̄)·(mean of δ over b's supervised tokens), over sequences with tokens."""
    rows = [(float(r), [float(t - s) for t, s, w in zip(tr, sr, mr) if w])
            for tr, sr, r, mr in zip(teacher.tolist(), student.tolist(), rewards.tolist(), mask.tolist())]
    rows = [(r, d) for r, d in rows if d]
    rbar = sum(r for r, _ in rows) / len(rows)
    return sum(2 * (r - rbar) * sum(d) / len(d) for r, d in rows) / len(rows)


@pytest.mark.parametrize("rbar", [0.1, 0.5, 0.9])
def test_margin_is_zero_when_teacher_equals_student_whatever_rbar(rbar):
    g = torch.Generator().manual_seed(int(rbar * 10))
    B, T = 20, 7
    student = -torch.rand(B, T, generator=g) * 3
    rewards = (torch.rand(B, generator=g) < rbar).float()
    rewards[0], rewards[1] = 0.0, 1.0
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    adv = centred_advantages(rewards, valid=mask.any(1))
    assert centred_margin(student.clone(), student, adv, mask).item() == 0.0
    assert privileged_margin(student.clone(), student, rewards, mask).item() == 0.0
    # A teacher that is uniformly less likely than the student (by c nats on every token, the
    # shape of −KL(S‖T)) has no privilege: the centred Δ is 0 whatever r̄ and whatever the lengths;
    # the paper's is not (it is c·(2r̄_tok − 1)·(−1), r̄_tok the token-weighted mean reward).
    shifted = student - 0.3
    assert centred_margin(shifted, student, adv, mask).item() == pytest.approx(0.0, abs=1e-6)
    paper = privileged_margin(shifted, student, rewards, mask).item()
    w = mask.float().sum(1)
    assert paper == pytest.approx(-0.3 * float(((2 * rewards - 1) * w).sum() / w.sum()), rel=1e-5)
    if rbar != 0.5:  # at r̄ = 1/2 the paper's form is (nearly) unbiased too
        assert abs(paper) > 0.05


def test_centred_margin_matches_brute_force_and_reaches_only_the_teacher():
    g = torch.Generator().manual_seed(3)
    teacher = (-torch.rand(6, 5, generator=g) * 2).requires_grad_(True)
    student = (-torch.rand(6, 5, generator=g) * 2).requires_grad_(True)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.0, 1.0])
    mask = torch.rand(6, 5, generator=g) > 0.4
    mask[:, 0] = True
    mask[4] = False  # no supervised token: out of the mean and of r̄
    adv = centred_advantages(rewards, valid=mask.any(1))
    assert adv[4] == 0 and float(adv.sum()) == pytest.approx(0.0, abs=1e-6)
    d = centred_margin(teacher, student, adv, mask)
    assert d.item() == pytest.approx(brute_centred_margin(teacher.detach(), student.detach(), rewards, mask), rel=1e-5)
    d.backward()
    assert student.grad is None and teacher.grad.abs().sum() > 0


def test_centred_advantages_per_group_when_tasks_repeat():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 5])
    adv = centred_advantages(rewards, groups)
    # groups {0,1}: ±1; group {2,3}: all fail → 0; singletons 4, 5 → 0 (as GRPO)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    # distinct tasks: the batch mean (r̄ = 0.5)
    assert centred_advantages(rewards, torch.arange(6)).tolist() == [1.0, -1.0, -1.0, -1.0, 1.0, 1.0]
    assert centred_advantages(rewards, torch.arange(6), mean=0.25).tolist() == pytest.approx(
        [1.5, -0.5, -0.5, -0.5, 1.5, 1.5])
    assert not rewards_have_spread(torch.zeros(5)) and rewards_have_spread(rewards)
    assert not rewards_have_spread(rewards, valid=torch.tensor([False, True, True, True, False, False]))


def _random_teacher_batch(seed: int, B: int = 64, T: int = 12, V: int = 30, success_rate: float = 0.15):
    """A mostly failing batch of the student's own samples and a teacher that differs from the
    student at random (no relation to reward): full-vocabulary brute force, actions ~ student.
    Failing rollouts are longer, as in practice."""
    g = torch.Generator().manual_seed(seed)
    s_logits = torch.randn(B, T, V, generator=g) * 2
    t_logits = s_logits + torch.randn(B, T, V, generator=g) * 1.5
    s_lp, t_lp = torch.log_softmax(s_logits.double(), -1), torch.log_softmax(t_logits.double(), -1)
    actions = torch.multinomial(s_lp.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    rewards = (torch.rand(B, generator=g) < success_rate).float()
    lengths = torch.where(rewards > 0, torch.randint(3, 7, (B,), generator=g), torch.randint(6, T + 1, (B,), generator=g))
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    take = lambda lp: lp.gather(-1, actions.unsqueeze(-1)).squeeze(-1).float()
    kl = float((s_lp.exp() * (s_lp - t_lp)).sum(-1)[mask].mean())
    return take(t_lp), take(s_lp), rewards, mask, kl


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_teacher_on_a_mostly_failing_batch_satisfies_the_paper_margin_not_the_centred_one(seed):
    teacher, student, rewards, mask, kl = _random_teacher_batch(seed)
    m = 0.05
    assert 0.0 < float(rewards.mean()) < 0.35 and kl > 0.3
    paper = privileged_margin(teacher, student, rewards, mask).item()
    adv = centred_advantages(rewards, valid=mask.any(1))
    centred = centred_margin(teacher, student, adv, mask).item()
    assert paper >= m, paper  # ≈ (1 − 2r̄)·KL: disagreement passes as privilege
    assert centred < m, centred  # only Cov(r, δ̄) is left, ≈ 0 for a teacher unrelated to reward
    # ... while a teacher that is better exactly on the successes does satisfy it
    better = teacher + 0.5 * rewards.unsqueeze(-1)
    assert centred_margin(better, student, adv, mask).item() >= m


def test_contrastive_hinge_hand_case_and_gradient():
    own = torch.tensor([1.0, 2.0, 0.5], requires_grad=True)
    other = torch.tensor([1.5, 1.0, 0.55], requires_grad=True)
    h = contrastive_hinge(own, other, 0.1)
    # terms: max(0, −0.4) = 0, max(0, 1.1) = 1.1, max(0, 0.05) = 0.05
    assert h.item() == pytest.approx((0.0 + 1.1 + 0.05) / 3)
    h.backward()
    assert own.grad.tolist() == pytest.approx([0.0, 1 / 3, 1 / 3])
    assert other.grad.tolist() == pytest.approx([0.0, -1 / 3, -1 / 3])
    assert contrastive_hinge(torch.zeros(0), torch.zeros(0), 0.1).item() == 0.0
