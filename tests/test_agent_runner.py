"""The rollout runner: exact token / mask / log-prob recording, multi-turn bookkeeping, failures."""

import time

import pytest
import torch

from lopd_cli.agent.chat import encode, render_prompt_ids, stop_token_ids, tokenize_transcript
from lopd_cli.agent.metrics import summarize
from lopd_cli.agent.runner import run_episodes
from lopd_cli.agent.toolcalls import render_tool_call
from lopd_cli.config import RolloutSection
from lopd_cli.envs.orders import OrdersEnv, oracle_plan
from lopd_cli.models.backbone import load_backbone
from lopd_cli.rollout.base import Generation


@pytest.fixture(scope="module")
def tiny():
    return load_backbone("tiny", device="cpu")


@pytest.fixture(scope="module")
def tasks():
    return OrdersEnv(n_train=16, n_validation=4, n_test=16).tasks("test")


class ScriptedBackend:
    """Answers each episode with fixed turn texts, found by its prompt (a test double)."""

    def __init__(self, tokenizer, scripts):
        self.tok = tokenizer
        self.scripts = scripts  # [(prompt ids, [turn text, ...])]
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")

    def generate(self, prompts, params, stop_ids):
        out = []
        for ids in prompts:
            prompt, turns = next((p, t) for p, t in self.scripts if ids[: len(p)] == p)
            # each finished turn adds "<|im_start|>user …" and "<|im_start|>assistant" after it
            done = sum(1 for i in ids[len(prompt):] if i == self.im_start) // 2
            toks = encode(self.tok, turns[min(done, len(turns) - 1)])[: params.max_new_tokens]
            stopped = len(toks) < params.max_new_tokens
            toks = toks + [stop_ids[0]] if stopped else toks
            out.append(Generation(toks, [-0.25] * len(toks), stopped))
        return out


def oracle_turns(task):
    calls, answer = oracle_plan(task)
    return [render_tool_call(c.name, c.arguments) for c in calls] + [answer]


def scripted(tok, tasks, turns_of=oracle_turns):
    return ScriptedBackend(tok, [(render_prompt_ids(tok, OrdersEnv().reset(t), t.tools), turns_of(t)) for t in tasks])


def test_recording_with_the_real_model_matches_a_fresh_forward_pass(tiny, tasks):
    model, tok = tiny
    cfg = RolloutSection(temperature=0.7, max_new_tokens=12, max_turns=2, batch_size=4)
    eps = run_episodes(model, tok, OrdersEnv, tasks[:4], cfg, seed=3)
    assert len({len(e.input_ids) for e in eps}) > 1, "prompts of different lengths exercise left padding"
    for e in eps:
        assert e.input_ids[: e.prompt_len] == render_prompt_ids(tok, e.prompt_messages, e.task.tools)
        assert len(e.input_ids) == len(e.action_mask) == len(e.logprobs)
        in_span = [0] * len(e.input_ids)
        for a, b in e.turn_spans:
            assert 0 < b - a <= cfg.max_new_tokens
            in_span[a:b] = [1] * (b - a)
        assert e.action_mask == in_span, "the mask is exactly the generated turns"
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.action_mask) if not m)
        ids = torch.tensor([e.input_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float() / cfg.temperature
        fresh = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(e.action_mask[1:], dtype=torch.bool)
        recorded = torch.tensor(e.logprobs[1:])
        assert mask.any()
        assert (fresh[mask] - recorded[mask]).abs().max().item() < 1e-4


def test_same_seed_same_rollouts_other_seed_differs(tiny, tasks):
    model, tok = tiny
    cfg = RolloutSection(temperature=1.0, max_new_tokens=10, max_turns=1, batch_size=3)
    a = run_episodes(model, tok, OrdersEnv, tasks[:3], cfg, seed=11)
    b = run_episodes(model, tok, OrdersEnv, tasks[:3], cfg, seed=11)
    c = run_episodes(model, tok, OrdersEnv, tasks[:3], cfg, seed=12)
    assert [e.input_ids for e in a] == [e.input_ids for e in b]
    assert [e.logprobs for e in a] == [e.logprobs for e in b]
    assert [e.input_ids for e in a] != [e.input_ids for e in c]


def test_multi_turn_oracle_recording_and_full_reward(tiny, tasks):
    """Scripted oracle through the runner: every test task solved; ids = the logged transcript's."""
    _, tok = tiny
    cfg = RolloutSection(max_new_tokens=96, max_turns=6, batch_size=8)
    seen_calls = 0
    for t in tasks:  # one by one: two test tasks may share an instruction (different databases)
        (e,) = run_episodes(None, tok, OrdersEnv, [t], cfg, backend=scripted(tok, [t]))
        assert e.error is None and e.reward == 1.0, (t.instruction, e.messages)
        n_calls = len(t.data["plan"])
        assert 1 <= n_calls <= 4 and e.meta["tool_calls"] == n_calls and e.meta["stop"] == "answer"
        assert len(e.turn_spans) == n_calls + 1
        ids, mask = tokenize_transcript(tok, e.messages, t.tools)
        assert (ids, mask) == (e.input_ids, e.action_mask)
        assert [m["role"] for m in e.messages].count("tool") == n_calls
        rec = e.to_record()
        assert rec["messages"][2]["tool_calls"][0]["type"] == "function"
        seen_calls += n_calls
    assert seen_calls > len(tasks), "the test split includes multi-call tasks"


def test_do_nothing_policy_scores_low(tiny, tasks):
    _, tok = tiny
    cfg = RolloutSection(batch_size=16)
    eps = run_episodes(None, tok, OrdersEnv, tasks, cfg,
                       backend=scripted(tok, tasks, lambda t: ["Sorry, I cannot help with that."]))
    s = summarize(eps)
    assert s["success_rate"] == 0.0 and s["mean_reward"] < 0.3 and s["tool_calls"] == 0


def test_invalid_calls_are_observations_and_repeats_are_counted(tiny, tasks):
    _, tok = tiny
    t = next(t for t in tasks if t.data["kind"] == "status")
    oid = t.data["plan"][0]["arguments"]["order_id"]
    turns = ['<tool_call>{"name": "get_order", "arguments": {oid}</tool_call>',
             '<tool_call>{"name": "nuke", "arguments": {}}</tool_call>',
             render_tool_call("get_order", {"order_id": oid}) + render_tool_call("get_order", {"order_id": oid}),
             t.data["answer"]]
    (e,) = run_episodes(None, tok, OrdersEnv, [t], RolloutSection(max_turns=6),
                        backend=ScriptedBackend(tok, [(render_prompt_ids(tok, OrdersEnv().reset(t), t.tools), turns)]))
    assert e.error is None and e.reward == 1.0
    tool_msgs = [m["content"] for m in e.messages if m["role"] == "tool"]
    assert tool_msgs[0].startswith("ERROR: malformed JSON") and "unknown tool 'nuke'" in tool_msgs[1]
    assert e.meta["invalid_tool_calls"] == 2 and e.meta["repeated_tool_calls"] == 1 and e.meta["tool_calls"] == 4
    # the recorded turns are the sampled tokens themselves (never re-rendered from the parsed calls)
    assert [tok.decode(e.input_ids[a:b]) for a, b in e.turn_spans] == [x + "<|im_end|>" for x in turns]


def test_max_turns_and_truncated_turns(tiny, tasks):
    _, tok = tiny
    t = next(t for t in tasks if len(t.data["plan"]) >= 2)
    (e,) = run_episodes(None, tok, OrdersEnv, [t], RolloutSection(max_turns=1), backend=scripted(tok, [t]))
    assert e.meta["stop"] == "max_turns" and e.meta["turns"] == 1 and e.reward < 1.0
    assert e.messages[-1]["role"] == "tool", "the last turn's calls still ran"
    (e,) = run_episodes(None, tok, OrdersEnv, [t], RolloutSection(max_turns=3, max_new_tokens=5), backend=scripted(tok, [t]))
    stop = stop_token_ids(tok)[0]
    assert e.meta["truncated_turns"] == e.meta["turns"] and e.meta["invalid_tool_calls"] >= 1
    a, b = e.turn_spans[0]
    assert b - a == 5 and e.input_ids[b] == stop and e.action_mask[b] == 0, "end-of-turn appended, unmasked"


class ExplodingEnv(OrdersEnv):
    def step(self, call):
        if self.task.id.endswith("00001"):
            raise RuntimeError("database on fire")
        return super().step(call)


class SlowEnv(OrdersEnv):
    def step(self, call):
        time.sleep(0.5)
        return super().step(call)


def test_a_plugin_exception_fails_only_its_episode(tiny, tasks):
    _, tok = tiny
    eps = run_episodes(None, tok, ExplodingEnv, tasks[:4], RolloutSection(batch_size=4), backend=scripted(tok, tasks[:4]))
    bad = [e for e in eps if e.error]
    assert [e.task.id for e in bad] == [tasks[1].id]
    assert "database on fire" in bad[0].error and bad[0].to_record()["meta"]["error"] == bad[0].error
    assert bad[0].reward == 0.0 and all(e.reward == 1.0 for e in eps if not e.error)


def test_tool_timeout_fails_the_episode(tiny, tasks):
    _, tok = tiny
    (e,) = run_episodes(None, tok, SlowEnv, tasks[:1], RolloutSection(tool_timeout_s=0.05), backend=scripted(tok, tasks[:1]))
    assert e.error and "timed out" in e.error and e.meta["stop"] == "error"


@pytest.mark.parametrize("value,fragment", [(1.5, "1.5"), ("good", "'good'"), (float("nan"), "nan"), (None, "None")])
def test_bad_reward_plugin_results_are_errors_naming_the_plugin(tiny, tasks, value, fragment):
    _, tok = tiny

    def score(task, transcript):
        return value

    score.lopd_spec = "my_rewards.py:score"
    (e,) = run_episodes(None, tok, OrdersEnv, tasks[:1], RolloutSection(), backend=scripted(tok, tasks[:1]), reward_fn=score)
    assert e.error and "my_rewards.py:score" in e.error and fragment in e.error and e.reward == 0.0


def test_reward_plugin_overrides_env_reward(tiny, tasks):
    _, tok = tiny
    seen = []

    def score(task, transcript):
        seen.append((task.id, transcript[-1]["content"]))
        return 0.25

    eps = run_episodes(None, tok, OrdersEnv, tasks[:2], RolloutSection(), backend=scripted(tok, tasks[:2]), reward_fn=score)
    assert [e.reward for e in eps] == [0.25, 0.25]
    assert seen == [(t.id, t.data["answer"]) for t in tasks[:2]]


def test_eval_batch_size_sets_how_many_episodes_scoring_generates_at_once(tiny, monkeypatch):
    """eval.batch_size: `lopd eval`, validation and the gate generate that many episodes at a time
    (null: rollout.batch_size); greedy, the episodes are the same tokens either way."""
    from lopd_cli.config import Recipe
    from lopd_cli.results.evaluate import run_eval
    from lopd_cli.rollout.hf import HFBackend

    opened: list[int] = []
    open_batch = HFBackend.open_batch
    monkeypatch.setattr(HFBackend, "open_batch", lambda self, n: opened.append(n) or open_batch(self, n))
    model, tok = tiny
    base = {"model": {"backbone": "tiny"},
            "env": {"class": "lopd_cli.envs.orders:OrdersEnv", "kwargs": {"n_train": 16, "n_validation": 4, "n_test": 6}},
            "rollout": {"batch_size": 2, "max_new_tokens": 24, "max_turns": 2}}
    per_rollout = Recipe.model_validate(base)
    assert per_rollout.eval_rollout is per_rollout.rollout
    _, eps_2 = run_eval(per_rollout, model, tok, "b2")
    assert opened == [2, 2, 2]
    opened.clear()
    per_eval = Recipe.model_validate({**base, "eval": {"batch_size": 6}})
    assert per_eval.eval_rollout.batch_size == 6 and per_eval.rollout.batch_size == 2  # sampling keeps its own
    _, eps_6 = run_eval(per_eval, model, tok, "b6")
    assert opened == [6]
    assert [e.input_ids for e in eps_6] == [e.input_ids for e in eps_2]
