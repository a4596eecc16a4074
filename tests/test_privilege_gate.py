"""The privilege gate (train.distill.privilege_gate): per-token weights from how much the task's own
references change the teacher against another task's, and the distillation they scale."""

import sys
import types
from pathlib import Path

import pytest
import torch

from lopd_cli.train.losses import privilege_weights, topm_reverse_kl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def _logp(probs):
    return torch.tensor(probs, dtype=torch.float64).log()


def test_weights_are_total_variation_zero_for_equal_teachers_one_for_disjoint():
    own = _logp([[0.7, 0.2, 0.1], [1.0 - 1e-12, 1e-12 / 2, 1e-12 / 2], [0.5, 0.25, 0.25]])
    ctrl = _logp([[0.7, 0.2, 0.1], [1e-12 / 2, 1.0 - 1e-12, 1e-12 / 2], [0.25, 0.5, 0.25]])
    w = privilege_weights(own, ctrl)
    assert w.shape == (3,)
    assert float(w[0]) == pytest.approx(0.0, abs=1e-9)
    assert float(w[1]) == pytest.approx(1.0, abs=1e-6)
    assert float(w[2]) == pytest.approx(0.25, abs=1e-9)  # 0.5 · (0.25 + 0.25 + 0)


def test_weighted_kl_scales_each_token_and_keeps_the_token_count():
    torch.manual_seed(0)
    s = torch.log_softmax(torch.randn(2, 5, 4, dtype=torch.float64), -1).requires_grad_(True)
    t = torch.log_softmax(torch.randn(2, 5, 4, dtype=torch.float64), -1)
    mask = torch.ones(2, 5)
    plain = topm_reverse_kl(s, t, mask)
    ones = topm_reverse_kl(s, t, mask, weight=torch.ones(2, 5))
    half = topm_reverse_kl(s, t, mask, weight=torch.full((2, 5), 0.5))
    assert float(ones.loss) == pytest.approx(float(plain.loss), rel=1e-12)
    assert float(half.loss) == pytest.approx(0.5 * float(plain.loss), rel=1e-12)
    w = torch.ones(2, 5)
    w[0, 2] = 0.0
    gated = topm_reverse_kl(s, t, mask, weight=w)
    (g,) = torch.autograd.grad(gated.loss, s)
    assert float(g[0, 2].abs().max()) == 0.0, "a token weighted 0 is not pulled"
    assert float(g[0, 1].abs().max()) > 0.0
    # the other tokens keep their share: the mean still divides by all five tokens of the row
    assert float(gated.per_token[0, 1]) == pytest.approx(float(plain.per_token[0, 1]), rel=1e-12)


def _ep(task_id):
    return types.SimpleNamespace(task=types.SimpleNamespace(id=task_id))


def _item(i):
    return types.SimpleNamespace(id=i)


def test_control_is_the_next_row_of_another_task_with_other_references():
    from lopd_cli.train.step import control_references

    a, b, c = [_item(1), _item(2)], [_item(3), _item(4)], [_item(2), _item(1)]
    eps = [_ep("t1"), _ep("t1"), _ep("t2"), _ep("t3")]
    refs = [a, a, b, c]  # t3's items are t1's in another order: the same set, no control for t1
    out = control_references(eps, refs)
    assert [[it.id for it in r] for r in out] == [[3, 4], [3, 4], [2, 1], [3, 4]]
    assert control_references([_ep("t1"), _ep("t1")], [a, a]) == [None, None]


@pytest.fixture(scope="module")
def bench():
    import step_overhead as so

    b = so.Bench("tiny", types.SimpleNamespace(num_queries=4, depth=1, batch=4, length=120, action_tokens=30))
    for ep, r in zip(b.episodes, [1.0, 0.0, 1.0, 0.0]):
        ep.reward = r
    return b


def _student_grads(b, refs, gate: bool, train_composer: bool = False):
    from lopd_cli.train.step import StepSetup, lopd_step

    t = b.recipe.train
    for p in b.student_params + b.composer_params:
        p.grad = None
    setup = StepSetup(b.model, b.tok, t.distill.top_m, t.lopd.margin_m, 0.0, 2, t.logit_chunk, composer=b.composer,
                         train_composer=train_composer, privilege_gate=gate)
    o = lopd_step(setup, b.episodes, refs, 0.5)
    return o, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in b.student_params]


@pytest.mark.parametrize("train_composer", [False, True])
def test_gate_changes_the_student_update_and_reports_its_mean(bench, train_composer):
    o_plain, g_plain = _student_grads(bench, bench.refs, gate=False, train_composer=train_composer)
    o_gate, g_gate = _student_grads(bench, bench.refs, gate=True, train_composer=train_composer)
    assert o_plain.gate is None
    assert 0.0 < o_gate.gate < 1.0
    assert o_gate.kl < o_plain.kl, "weights in [0, 1) shrink the KL"
    assert any(float((x - y).abs().max()) > 1e-7 for x, y in zip(g_plain, g_gate))
    # Δ (for β) is measured on the teacher with the task's own references, gate or not
    assert o_gate.delta == pytest.approx(o_plain.delta, abs=1e-6)


def test_gate_without_a_control_block_is_the_plain_update(bench):
    same = [bench.refs[0]] * len(bench.episodes)  # every row reads the same items: nothing to contrast
    o_plain, g_plain = _student_grads(bench, same, gate=False)
    o_gate, g_gate = _student_grads(bench, same, gate=True)
    assert o_gate.gate == pytest.approx(1.0)
    assert all(float((x - y).abs().max()) <= 1e-6 * max(1.0, float(y.abs().max())) for x, y in zip(g_gate, g_plain))
