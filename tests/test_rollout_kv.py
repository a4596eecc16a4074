"""Multi-turn rollouts with the KV cache kept across turns (rollout/hf.HFBatch) and observation
ids rendered incrementally (chat.incremental_observation_ids): the recorded tokens and
log-probs are those a fresh forward pass and a full re-rendering give."""

import copy
import json

import pytest
import torch

from lopd_cli.agent.chat import (
    incremental_observation_ids,
    observation_ids,
    render_prompt_ids,
    tokenize_transcript,
)
from lopd_cli.agent.chat_profiles import apply_profile
from lopd_cli.agent.runner import run_episodes
from lopd_cli.agent.toolcalls import render_tool_call
from lopd_cli.config import RolloutSection
from lopd_cli.envs.orders import OrdersEnv, oracle_plan
from lopd_cli.rollout.base import Generation
from lopd_cli.rollout.hf import HFBackend

from test_agent_runner import ScriptedBackend, tasks, tiny  # noqa: F401  (fixtures shared with the runner tests)


class MultiTurnOrders(OrdersEnv):
    """Orders episodes that go on whatever a random model says: after each answer the next user
    turn carries the result of the task's next oracle tool call (cycling), for `turns` turns."""

    turns = 4

    def reset(self, task):
        msgs = super().reset(task)
        self._calls, _ = oracle_plan(task)
        self._k = 0
        return msgs

    def next_user_message(self):
        self._k += 1
        if self._k >= self.turns:
            return None
        call = self._calls[(self._k - 1) % len(self._calls)]
        return {"role": "user", "content": f"<tool_response>\n{self.step(call)}\n</tool_response>"}


def fresh_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) at `temperature` from one forward pass over the whole transcript."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_kv_reuse_logprobs_equal_a_fresh_forward_pass(tiny, tasks, temperature):
    model, tok = tiny
    cfg = RolloutSection(temperature=temperature, max_new_tokens=10, max_turns=4, batch_size=4)
    eps = run_episodes(model, tok, MultiTurnOrders, tasks[:6], cfg, seed=5)
    assert len({e.prompt_len for e in eps}) > 1, "prompts of different lengths (holes in the shared cache)"
    assert all(e.meta["turns"] == 4 for e in eps), [e.meta for e in eps]
    assert any(e.meta["truncated_turns"] for e in eps), "a turn cut at max_new_tokens (end-of-turn appended)"
    for e in eps:
        assert e.error is None
        assert len(e.input_ids) == len(e.action_mask) == len(e.logprobs)
        in_span = [0] * len(e.input_ids)
        for a, b in e.turn_spans:
            in_span[a:b] = [1] * (b - a)
        assert e.action_mask == in_span
        fresh = fresh_logprobs(model, e.input_ids, temperature if temperature > 0 else 1.0)
        mask = torch.tensor(e.action_mask[1:], dtype=torch.bool)
        recorded = torch.tensor(e.logprobs[1:])
        assert (fresh[mask] - recorded[mask]).abs().max().item() < 1e-4
        if temperature == 0:
            # greedy: every recorded token is the argmax of the fresh pass
            x = torch.tensor([e.input_ids])
            with torch.no_grad():
                top = model(input_ids=x).logits[0, :-1].argmax(-1)
            assert torch.equal(top[mask], x[0, 1:][mask])


class GenerateBackend:
    """The backend before the KV cache was kept across turns: transformers `generate` over the
    whole left-padded conversation each turn, log-probs from `output_logits` (the reference)."""

    def __init__(self, model, tok):
        self.model, self.pad = model, tok.pad_token_id

    def generate(self, prompts, params, stop_ids):
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
        greedy = params.temperature <= 0
        kw = (dict(do_sample=False, temperature=None, top_p=None, top_k=None) if greedy else
              dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0))
        torch.manual_seed(params.seed)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=params.max_new_tokens,
                                      eos_token_id=list(stop_ids), pad_token_id=self.pad, output_logits=True,
                                      return_dict_in_generate=True, **kw)
        new = out.sequences[:, width:]
        temp = 1.0 if greedy else params.temperature
        lp = torch.stack([torch.log_softmax(l.float() / temp, -1).gather(-1, new[:, t:t + 1])[:, 0]
                          for t, l in enumerate(out.logits)])
        res = []
        for r in range(len(prompts)):
            toks = new[r].tolist()
            end = next((t + 1 for t, x in enumerate(toks) if x in stop_ids), None)
            n = end or len(toks)
            res.append(Generation(toks[:n], lp[:n, r].tolist(), end is not None))
        return res


class StatelessHF:
    """The hf backend without `open_batch`: the runner passes whole conversations every turn."""

    def __init__(self, model, tok):
        self.inner = HFBackend(model, tok)

    def generate(self, prompts, params, stop_ids):
        return self.inner.generate(prompts, params, stop_ids)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9), (0.0, 1.0)])
def test_kv_reuse_samples_what_generate_samples(tiny, tasks, temperature, top_p):
    """Seeded as before: the cached runner draws the same tokens as `generate` re-run on the whole
    conversation every turn, and as the stateless backend; log-probs agree to rounding."""
    model, tok = tiny
    cfg = RolloutSection(temperature=temperature, top_p=top_p, max_new_tokens=8, max_turns=3, batch_size=3)
    runs = {name: run_episodes(model, tok, MultiTurnOrders, tasks[:5], cfg, seed=2, backend=b)
            for name, b in [("kv", None), ("generate", GenerateBackend(model, tok)), ("stateless", StatelessHF(model, tok))]}
    for name in ("generate", "stateless"):
        for a, b in zip(runs["kv"], runs[name]):
            assert a.input_ids == b.input_ids, name
            assert a.action_mask == b.action_mask and a.turn_spans == b.turn_spans
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert all(e.meta["turns"] == 3 for e in runs["kv"])


def test_episodes_leaving_the_batch_keep_the_others_exact(tiny, tasks):
    """Episodes of different lengths: rows leave the shared cache as they end."""
    model, tok = tiny

    class Varied(MultiTurnOrders):
        def reset(self, task):
            msgs = super().reset(task)
            self.turns = 1 + int(task.id[-1]) % 4
            return msgs

    cfg = RolloutSection(temperature=1.0, max_new_tokens=6, max_turns=4, batch_size=8)
    eps = run_episodes(model, tok, Varied, tasks[:8], cfg, seed=9)
    assert len({e.meta["turns"] for e in eps}) > 2
    ref = run_episodes(model, tok, Varied, tasks[:8], cfg, seed=9, backend=StatelessHF(model, tok))
    for e, r in zip(eps, ref):
        assert e.input_ids == r.input_ids
        fresh = fresh_logprobs(model, e.input_ids, 1.0)
        mask = torch.tensor(e.action_mask[1:], dtype=torch.bool)
        assert (fresh[mask] - torch.tensor(e.logprobs[1:])[mask]).abs().max().item() < 1e-4


# ---------------------------------------------------------------- incremental rendering

def oracle_turns(task, list_format: bool = False):
    calls, answer = oracle_plan(task)
    if list_format:  # SmolLM2's shape: one block holding a JSON list
        return [f'<tool_call>[\n{{"name": "{c.name}", "arguments": {json.dumps(c.arguments)}}}\n]</tool_call>'
                for c in calls] + [answer]
    return [render_tool_call(c.name, c.arguments) for c in calls] + [answer]


def hermes_tokenizer(tok):
    """The tiny tokenizer with a plain ChatML template (no tools): the Hermes rewriting path."""
    t = copy.deepcopy(tok)
    t.chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return t


def with_template(tok, template: str):
    """native: the tiny template; hermes: the rewriting path; smollm2: the SmolLM2 profile."""
    if template == "hermes":
        return hermes_tokenizer(tok)
    if template == "smollm2":
        t = copy.deepcopy(tok)
        apply_profile(t, "smollm2")
        return t
    return tok


@pytest.mark.parametrize("template", ["native", "hermes", "smollm2"])
def test_incremental_observation_ids_equal_full_rendering(tiny, tasks, template):
    """Every observation point of multi-turn orders transcripts (tool results, a second user turn)."""
    _, tok = tiny
    tok = with_template(tok, template)
    checked = 0
    for t in tasks:
        calls, answer = oracle_plan(t)
        env = OrdersEnv()
        prompt = env.reset(t)
        msgs = [dict(m) for m in prompt]
        for i, c in enumerate(calls):
            msgs.append({"role": "assistant", "content": "Let me check." if i % 2 else "",
                         "tool_calls": [{"id": c.id, "type": "function",
                                         "function": {"name": c.name, "arguments": c.arguments}}]})
            new = [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": env.step(c)}]
            if i == 1:
                new = new * 2  # two results in one turn
            assert incremental_observation_ids(tok, prompt, msgs[-1], new, t.tools) == \
                observation_ids(tok, msgs, new, t.tools)
            msgs += new
            checked += 1
        msgs.append({"role": "assistant", "content": answer})
        user = [{"role": "user", "content": "Thanks. Anything else on that order?"}]
        assert incremental_observation_ids(tok, prompt, msgs[-1], user, t.tools) == \
            observation_ids(tok, msgs, user, t.tools)
        checked += 1
    assert checked > 2 * len(tasks)


@pytest.mark.parametrize("template", ["native", "hermes", "smollm2"])
def test_runner_ids_equal_tokenize_transcript_in_one_batch(tiny, tasks, template):
    """All 16 multi-call oracle episodes in one batch (only the first live one is spot-checked
    against the full rendering, the others are rendered incrementally): ids and mask equal
    `tokenize_transcript` of the logged transcript, and the prompt `render_prompt_ids`."""
    _, tok = tiny
    tok = with_template(tok, template)
    scripts = [(render_prompt_ids(tok, OrdersEnv().reset(t), t.tools), oracle_turns(t, template == "smollm2"))
               for t in tasks]
    backend = ScriptedBackend(tok, scripts)
    eps = run_episodes(None, tok, OrdersEnv, tasks, RolloutSection(max_new_tokens=96, max_turns=6, batch_size=16),
                       backend=backend)
    assert sum(e.meta["tool_calls"] for e in eps) > len(tasks)
    for e, t in zip(eps, tasks):
        assert e.error is None and e.reward == 1.0
        assert e.input_ids[: e.prompt_len] == render_prompt_ids(tok, e.prompt_messages, t.tools)
        assert tokenize_transcript(tok, e.messages, t.tools) == (e.input_ids, e.action_mask)


def test_a_template_that_rewrites_earlier_turns_falls_back_to_full_rendering(tiny, tasks):
    """A template numbering its messages renders differently against the short anchor: the spot
    check sees it and the call renders whole histories, so the ids stay exact."""
    _, tok = tiny
    t2 = copy.deepcopy(tok)
    t2.chat_template = tok.chat_template.replace(
        "<tool_response>\n{{ message['content'] }}", "<tool_response>\n#{{ loop.index }} {{ message['content'] }}")
    assert t2.chat_template != tok.chat_template
    multi = [t for t in tasks if len(t.data["plan"]) >= 2]
    # the anchor really renders differently from the second tool turn on
    t0, env = multi[0], OrdersEnv()
    prompt = env.reset(t0)
    msgs, differs = [dict(m) for m in prompt], []
    for c in oracle_plan(t0)[0][:2]:
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}]})
        new = [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": env.step(c)}]
        differs.append(incremental_observation_ids(t2, prompt, msgs[-1], new, t0.tools)
                       != observation_ids(t2, msgs, new, t0.tools))
        msgs += new
    assert differs == [False, True]
    scripts = [(render_prompt_ids(t2, OrdersEnv().reset(t), t.tools), oracle_turns(t)) for t in multi]
    eps = run_episodes(None, t2, OrdersEnv, multi, RolloutSection(max_new_tokens=96, max_turns=6, batch_size=16),
                       backend=ScriptedBackend(t2, scripts))
    for e, t in zip(eps, multi):
        assert e.error is None
        assert tokenize_transcript(t2, e.messages, t.tools) == (e.input_ids, e.action_mask)


def test_throughput_benchmark_bare_replay_draws_the_runners_tokens(tmp_path):
    """benchmarks/rollout_throughput.py on multi-turn episodes: the bare `generate` loop replays
    the runner's conversations turn by turn with the runner's seeds and samples the same tokens,
    so both paths do the same generation work."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import importlib

    rt = importlib.import_module("benchmarks.rollout_throughput")
    out = tmp_path / "rt.json"
    data = rt.main(["--models", "tiny", "--backends", "hf", "--n", "5", "--batch", "3", "--turns", "3",
                    "--max-new-tokens", "6", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data)) and data["turns"] == 3
    rows = {r["path"]: r for r in data["rows"]}
    assert list(rows) == ["bare generate", "runner hf"]
    # 5 episodes × 3 turns of 1 to 6 tokens
    assert 5 * 3 <= rows["bare generate"]["tokens"] == rows["runner hf"]["tokens"] <= 5 * 3 * 6
