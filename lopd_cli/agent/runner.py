"""The batched multi-turn rollout runner: tasks in, recorded `Episode`s out.

Episodes run together, turn by turn: one batched generate for every live episode, then each
environment runs the tool calls of its episode. An episode ends on a final answer (a turn
without tool calls), at `rollout.max_turns`, when the environment says `done()`, when the
context reaches `rollout.max_prompt_tokens`, or when a plugin raises or a tool call times out
(then the error is kept in `meta` and in `Episode.error`; the rest of the batch goes on).

Token recording follows the chat module: the prompt ids are exactly
`render_prompt_ids(tokenizer, prompt_messages, tools)`; after that come the sampled ids exactly
as sampled (mask 1, with their behaviour log-probs) and the tokenised observation turns
(mask 0). Generated text is never re-tokenised. A turn cut off by `max_new_tokens` gets the
end-of-turn token appended with mask 0 before the observation, so the context stays well-formed.
When an episode stops at `max_turns` after a tool-call turn, the calls still run (the world
state counts for the reward) and their results are in `messages`, but no tokens are appended.

Cost per turn does not grow with the conversation: a backend with `open_batch` (hf) keeps the
batch's KV cache across turns and prefills only the new ids (observation + next assistant
header), and observation ids are rendered against a short anchor (prompt + last assistant
turn, `chat.incremental_observation_ids`) rather than the whole history. At every turn the
first live episode of the batch is also rendered in full and compared (it gets the full ids);
if the two ever differ (a template whose rendering depends on earlier turns), the rest of the
call renders whole histories.
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from lopd_cli.agent.chat import incremental_observation_ids, observation_ids, render_prompt_ids, stop_token_ids
from lopd_cli.agent.env import coerce_tasks, env_done, plugin_view
from lopd_cli.agent.toolcalls import call_key, parse_tool_calls, to_openai_tool_calls
from lopd_cli.agent.types import Episode, Task, ToolCall
from lopd_cli.config import Recipe, RolloutSection
from lopd_cli.errors import LopdError
from lopd_cli.rollout.base import Backend, SamplingParams
from lopd_cli.rollout.factory import make_backend


class ToolTimeout(Exception):
    pass


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run fn in a daemon thread; raise ToolTimeout if it has not returned in time (the thread
    is abandoned, which is why a timed-out episode is failed rather than continued)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise ToolTimeout(f"timed out after {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def reward_name(fn: Callable | None) -> str:
    return getattr(fn, "lopd_spec", None) or getattr(fn, "__qualname__", None) or repr(fn)


def check_reward(value: Any, source: str) -> float:
    """A reward must be a finite number in [0, 1]; otherwise a LopdError names its source."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise LopdError(f"{source} returned {value!r} ({type(value).__name__}); expected a number in [0, 1]")
    v = float(value)
    if not math.isfinite(v) or v < 0.0 or v > 1.0:
        raise LopdError(f"{source} returned {v!r}; expected a number in [0, 1]")
    return v


@dataclass
class _Live:
    episode: Episode
    env: Any
    calls: list[ToolCall] = field(default_factory=list)
    invalid_calls: int = 0
    turns: int = 0
    truncated_turns: int = 0
    done: bool = False
    stop: str = ""


def _fail(live: _Live, where: str, err: BaseException) -> None:
    msg = str(err) if isinstance(err, LopdError) else f"{err.__class__.__name__}: {err}"
    live.episode.error = f"{where}: {msg}"
    live.done, live.stop = True, "error"


def _start(task: Task, env_factory: Callable[[], Any], tokenizer) -> _Live:
    episode = Episode(task=task, prompt_messages=[], messages=[])
    try:
        env = env_factory()
    except Exception as e:  # noqa: BLE001 - a plugin error fails this episode only
        live = _Live(episode, None)
        _fail(live, "env init", e)
        return live
    live = _Live(episode, env)
    try:
        prompt = env.reset(task)
    except Exception as e:  # noqa: BLE001
        _fail(live, "env.reset", e)
        return live
    episode.prompt_messages = [dict(m) for m in prompt]
    episode.messages = [dict(m) for m in prompt]
    episode.input_ids = render_prompt_ids(tokenizer, episode.prompt_messages, task.tools)
    episode.action_mask = [0] * len(episode.input_ids)
    episode.logprobs = [0.0] * len(episode.input_ids)
    episode.prompt_len = len(episode.input_ids)
    return live


def _assistant_message(text: str, visible: str, calls: list[ToolCall]) -> dict:
    if any(not c.name for c in calls):
        # Unparseable calls cannot be written as OpenAI tool_calls: keep the raw text.
        return {"role": "assistant", "content": text}
    msg: dict[str, Any] = {"role": "assistant", "content": visible}
    if calls:
        msg["tool_calls"] = to_openai_tool_calls(calls)
    return msg


def _run_calls(live: _Live, calls: list[ToolCall], timeout_s: float) -> list[dict]:
    """Tool messages for the calls of one turn; marks the episode failed if the env raises."""
    results = []
    for call in calls:
        if call.error:
            live.invalid_calls += 1
            observation = f"ERROR: {call.error}"
        else:
            try:
                observation = call_with_timeout(lambda c=call: live.env.step(c), timeout_s)
            except ToolTimeout as e:
                _fail(live, f"tool {call.name}", e)
                return results
            except Exception as e:  # noqa: BLE001 - a plugin exception fails this episode only
                _fail(live, f"env.step({call.name})", e)
                return results
            observation = observation if isinstance(observation, str) else str(observation)
        live.calls.append(call)
        results.append({"role": "tool", "tool_call_id": call.id, "name": call.name or "invalid",
                        "content": observation})
    return results


class _ObservationRenderer:
    """Observation ids of an episode's new messages: incremental, spot-checked (module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.incremental = True

    def __call__(self, ep: Episode, new_messages: list[dict], check: bool) -> list[int]:
        history = ep.messages[: len(ep.messages) - len(new_messages)]
        if not self.incremental:
            return observation_ids(self.tokenizer, history, new_messages, ep.task.tools)
        ids = incremental_observation_ids(self.tokenizer, ep.prompt_messages, history[-1], new_messages,
                                          ep.task.tools)
        if check:
            full = observation_ids(self.tokenizer, history, new_messages, ep.task.tools)
            if full != ids:
                self.incremental = False
                return full
        return ids


def _after_generation(live: _Live, gen, tokenizer, stop_ids: list[int], cfg: RolloutSection,
                      render: _ObservationRenderer | None = None, check: bool = False) -> None:
    ep = live.episode
    start = len(ep.input_ids)
    ep.input_ids += gen.token_ids
    ep.action_mask += [1] * len(gen.token_ids)
    ep.logprobs += list(gen.logprobs)
    ep.turn_spans.append((start, len(ep.input_ids)))
    live.turns += 1
    if live.turns == 1:
        ep.meta["first_turn_tokens"] = len(gen.token_ids)
    if not gen.stopped:
        live.truncated_turns += 1
    body = gen.token_ids[:-1] if gen.stopped else gen.token_ids
    text = tokenizer.decode(body, skip_special_tokens=True)
    visible, calls = parse_tool_calls(text, ep.task.tools, id_offset=len(live.calls))
    assistant = _assistant_message(text, visible, calls)
    ep.messages.append(assistant)
    if not calls:
        # A final answer ends the episode, unless a multi-turn env has a next user turn.
        try:
            nxt = _next_user_message(live.env) if live.turns < cfg.max_turns else None
        except Exception as e:  # noqa: BLE001
            _fail(live, "env.next_user_message", e)
            return
        if nxt is None:
            live.done, live.stop = True, "answer"
            return
        ep.messages.append(nxt)
        _append_observation(live, [nxt], gen.stopped, tokenizer, stop_ids, cfg, render, check)
        return
    results = _run_calls(live, calls, cfg.tool_timeout_s)
    ep.messages += results
    if live.done:
        return
    try:
        ended = env_done(live.env)
    except Exception as e:  # noqa: BLE001
        _fail(live, "env.done", e)
        return
    if ended or live.turns >= cfg.max_turns:
        live.done, live.stop = True, "env_done" if ended else "max_turns"
        return
    _append_observation(live, results, gen.stopped, tokenizer, stop_ids, cfg, render, check)


def _next_user_message(env) -> dict | None:
    """Optional hook of multi-turn environments (e.g. BFCL multi-turn): the next user message
    after the model answered without a tool call, or None when the conversation is over."""
    fn = getattr(env, "next_user_message", None)
    return fn() if callable(fn) else None


def _append_observation(live: _Live, new_messages: list[dict], stopped: bool, tokenizer, stop_ids: list[int],
                        cfg: RolloutSection, render: _ObservationRenderer | None = None, check: bool = False) -> None:
    """Tokens of tool results or a new user turn (mask 0), up to the next generation prompt."""
    ep = live.episode
    render = render or _ObservationRenderer(tokenizer)
    obs = render(ep, new_messages, check)
    if not stopped:
        obs = [stop_ids[0]] + obs
    ep.input_ids += obs
    ep.action_mask += [0] * len(obs)
    ep.logprobs += [0.0] * len(obs)
    if len(ep.input_ids) >= cfg.max_prompt_tokens:
        live.done, live.stop = True, "context"


def _finish(live: _Live, reward_fn: Callable | None, base_meta: dict) -> Episode:
    ep = live.episode
    keys = [call_key(c) for c in live.calls if not c.error]
    ep.meta.update(base_meta)
    ep.meta.update(
        turns=live.turns,
        stop=live.stop,
        tool_calls=len(live.calls),
        invalid_tool_calls=live.invalid_calls,
        repeated_tool_calls=len(keys) - len(set(keys)),
        truncated_turns=live.truncated_turns,
    )
    ep.meta.setdefault("first_turn_tokens", 0)
    if live.env is not None:
        ep.meta.setdefault("env", getattr(live.env, "name", type(live.env).__name__))
    if ep.error is None:
        source = f"reward plugin '{reward_name(reward_fn)}'" if reward_fn else f"env {ep.meta.get('env')}.reward"
        try:
            raw = reward_fn(ep.task, ep.messages) if reward_fn else live.env.reward(ep.messages)
            ep.reward = check_reward(raw, source)
            feedback = getattr(live.env, "feedback", None)  # optional: what SDPO's teacher reads on a failure
            if callable(feedback):
                ep.meta["feedback"] = feedback(ep.messages)
        except LopdError as e:
            ep.error = str(e)
        except Exception as e:  # noqa: BLE001 - a plugin error fails this episode only
            ep.error = f"{source} raised {e.__class__.__name__}: {e}"
    if ep.error is not None:
        ep.reward = 0.0
        ep.meta["stop"] = "error"
    return ep


def run_episodes(
    model,
    tokenizer,
    env_factory: Callable[[], Any],
    tasks: list[Task],
    rollout_cfg: RolloutSection,
    seed: int = 0,
    reward_fn: Callable[[Task, list[dict]], float] | None = None,
    progress: Callable[[int], None] | None = None,
    backend: Backend | None = None,
    temperature: float | None = None,
    meta: dict | None = None,
    index_offset: int = 0,
) -> list[Episode]:
    """Roll out one episode per task (repeat a task in `tasks` for several rollouts of it).

    Episodes are generated `rollout_cfg.batch_size` at a time. `temperature` overrides the
    recipe's (e.g. 0 for greedy evaluation). `progress(k)` is called as k episodes finish.
    `meta` is merged into every episode's meta (e.g. model name). Deterministic for a seed.
    `index_offset`: where `tasks` start in a larger batch split across processes (torchrun
    ranks); sampling is seeded per chunk by the chunk's position in that global batch, so a
    rank whose share starts on a chunk boundary samples exactly what one process would.
    """
    backend = backend or make_backend(rollout_cfg.backend, model, tokenizer, rollout_cfg)
    stop_ids = stop_token_ids(tokenizer)
    temp = rollout_cfg.temperature if temperature is None else temperature
    render = _ObservationRenderer(tokenizer)
    out: list[Episode] = []
    for lo in range(0, len(tasks), rollout_cfg.batch_size):
        chunk_key = _chunk_key(index_offset + lo, rollout_cfg.batch_size)
        lives = [_start(t, env_factory, tokenizer) for t in tasks[lo: lo + rollout_cfg.batch_size]]
        session = backend.open_batch(len(lives)) if callable(getattr(backend, "open_batch", None)) else None
        turn = 0
        while True:
            rows = [i for i, lv in enumerate(lives) if not lv.done]
            live = [lives[i] for i in rows]
            if not live:
                break
            room = min(rollout_cfg.max_prompt_tokens - len(lv.episode.input_ids) for lv in live)
            params = SamplingParams(
                temperature=temp, top_p=rollout_cfg.top_p,
                max_new_tokens=max(1, min(rollout_cfg.max_new_tokens, room)),
                seed=(seed * 1_000_003 + chunk_key * 10_007 + turn) % (2**63),
            )
            prompts = [lv.episode.input_ids for lv in live]
            gens = (session.generate(rows, prompts, params, stop_ids) if session is not None
                    else backend.generate(prompts, params, stop_ids))
            for lv, gen in zip(live, gens):
                _after_generation(lv, gen, tokenizer, stop_ids, rollout_cfg, render, check=lv is live[0])
                if lv.done and progress:
                    progress(1)
            turn += 1
        for lv in lives:
            if lv.stop == "error" and lv.turns == 0 and progress:
                progress(1)  # failed before generating
            out.append(_finish(lv, reward_fn, {"seed": seed, **(meta or {})}))
    return out


def _chunk_key(start: int, batch_size: int) -> int:
    """The sampling-seed key of a chunk starting at global episode index `start`: its chunk
    number when it starts on a chunk boundary (always, in one process), a distinct key otherwise."""
    return start // batch_size + (start % batch_size) * 100_003


# ---------------------------------------------------------------- recipe helpers

def make_env_factory(recipe: Recipe) -> Callable[[], Any]:
    """A zero-argument constructor of the recipe's environment (one instance per episode): its
    class, or an MCP server (`env.mcp`, lopd_cli/envs/mcp.py)."""
    from lopd_cli.agent.plugins import load_env_class

    if recipe.env.mcp is not None:
        from lopd_cli.envs.mcp import make_mcp_env_factory

        return make_mcp_env_factory(recipe.env.mcp, recipe.base_dir, recipe.reward)

    cls = load_env_class(recipe.env.cls, recipe.base_dir)
    kwargs = dict(recipe.env.kwargs)
    try:
        cls(**kwargs)
    except TypeError as e:
        raise LopdError(f"env.kwargs: {recipe.env.cls} does not accept {sorted(kwargs)} ({e})") from None
    return lambda: cls(**kwargs)


def load_reward(recipe: Recipe) -> Callable[[Task, list[dict]], float] | None:
    """The recipe's reward plugin (None: the environment's own reward). An MCP environment calls
    the plugin itself, with a handle on its server."""
    if not recipe.reward or recipe.env.mcp is not None:
        return None
    from lopd_cli.agent.plugins import load_reward_fn

    fn = load_reward_fn(recipe.reward, recipe.base_dir)

    def score(task: Task, transcript: list[dict]) -> float:
        return fn(plugin_view(task), transcript)

    score.lopd_spec = recipe.reward  # type: ignore[attr-defined]
    return score


def select_tasks(env_factory: Callable[[], Any], split: str, n: int | None) -> list[Task]:
    """The first n tasks of a split, cycling through it when n exceeds its size."""
    try:
        env = env_factory()
        returned = env.tasks(split)
    except LopdError:
        raise
    except Exception as e:  # noqa: BLE001
        raise LopdError(f"env.tasks('{split}') failed: {e.__class__.__name__}: {e}") from e
    # Envs from load_env_class are checked already; this covers factories built by hand.
    tasks = coerce_tasks(returned, split, f"env {type(env).__name__}")
    if not tasks:
        raise LopdError(f"the environment has no tasks in split '{split}'")
    if n is None:
        return tasks
    return [tasks[i % len(tasks)] for i in range(n)]
