"""Render conversations through a model's chat template and turn them into token ids.

Tools go through the template's native `tools=` argument when it has one (Qwen, the tiny
model); otherwise (e.g. SmolLM2) the conversation is rewritten in Hermes style first: a tools
block in the system message, tool calls as `<tool_call>` text in the assistant turn, tool
results as a user turn of `<tool_response>` blocks.

Token ids are built segment by segment, the same way the runner builds them while it samples:
prompt (system + first user turn + generation prompt), then for each assistant turn its text up
to and including the end-of-turn token (mask 1), then everything the template puts between that
token and the next generation prompt (mask 0). Segments are tokenised separately, so ids never
depend on how a tokenizer would merge across a turn boundary. This needs a template that
renders a conversation as a growing prefix (ChatML-style templates do); one that rewrites
earlier turns raises a LopdError.
"""

from __future__ import annotations

import json
from typing import Any

from lopd_cli.agent.toolcalls import render_tool_call
from lopd_cli.errors import LopdError

END_OF_TURN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")

HERMES_TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_supports_tools(tokenizer) -> bool:
    tpl = tokenizer.chat_template
    if isinstance(tpl, dict):
        return "tool_use" in tpl or any("tools" in t for t in tpl.values())
    return bool(tpl) and "tools" in tpl


def end_of_turn_token(tokenizer) -> str:
    """The token that closes an assistant turn in this model's template."""
    vocab = tokenizer.get_vocab()
    for tok in END_OF_TURN_CANDIDATES:
        if tok in vocab:
            return tok
    if tokenizer.eos_token is None:
        raise LopdError("the tokenizer has no end-of-turn or eos token")
    return tokenizer.eos_token


def stop_token_ids(tokenizer) -> list[int]:
    """Ids that end a generated turn: the end-of-turn token and eos."""
    ids = [tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer))]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Rewrite an OpenAI-format conversation for a template without tool support."""
    out: list[dict] = []
    if tools:
        block = HERMES_TOOLS_BLOCK.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0].get("role") == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{block}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    pending_results: list[str] = []

    def flush() -> None:
        if pending_results:
            body = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in pending_results)
            out.append({"role": "user", "content": body})
            pending_results.clear()

    for m in messages:
        role = m.get("role")
        if role == "tool":
            pending_results.append(str(m.get("content", "")))
            continue
        flush()
        if role == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            for tc in m["tool_calls"]:
                f = tc.get("function", tc)
                parts.append(render_tool_call(f["name"], f.get("arguments", {})))
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append({"role": role, "content": m.get("content") or ""})
    flush()
    return out


def render_text(tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    """The chat-template text of a conversation (tools natively or Hermes style)."""
    if template_supports_tools(tokenizer):
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        msgs = messages
    else:
        kwargs, msgs = {}, hermes_messages(messages, tools)
    try:
        return tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as e:  # jinja errors: a template that does not accept this conversation
        raise LopdError(f"chat template failed to render the conversation: {e.__class__.__name__}: {e}") from e


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def render_prompt_ids(tokenizer, prompt_messages: list[dict], tools: list[dict] | None) -> list[int]:
    """Token ids of the prompt (system + first user turn) followed by the generation prompt."""
    return encode(tokenizer, render_text(tokenizer, prompt_messages, tools, add_generation_prompt=True))


def _split_after_end_of_turn(tokenizer, text: str) -> tuple[str, str]:
    """(assistant text up to and including its end-of-turn token, what the template adds after)."""
    eot = end_of_turn_token(tokenizer)
    pos = text.find(eot)
    if pos < 0:
        raise LopdError(f"chat template does not close the assistant turn with {eot}")
    return text[: pos + len(eot)], text[pos + len(eot):]


def _prefix_delta(before: str, after: str) -> str:
    if not after.startswith(before):
        raise LopdError("chat template does not render the conversation as a growing prefix; "
                        "multi-turn token recording needs one that does (e.g. ChatML)")
    return after[len(before):]


def observation_ids(tokenizer, history: list[dict], new_messages: list[dict], tools: list[dict] | None,
                    add_generation_prompt: bool = True) -> list[int]:
    """Ids that follow an assistant turn's end-of-turn token: the rest of the template's
    assistant block, `new_messages` (tool results, user turns) and the next generation prompt.
    `history` ends with that assistant message."""
    with_assistant = render_text(tokenizer, history, tools, add_generation_prompt=False)
    _, carry = _split_after_end_of_turn(tokenizer, with_assistant[_last_assistant_start(tokenizer, history, tools):])
    extended = render_text(tokenizer, history + new_messages, tools, add_generation_prompt=add_generation_prompt)
    return encode(tokenizer, carry + _prefix_delta(with_assistant, extended))


def _last_assistant_start(tokenizer, history: list[dict], tools: list[dict] | None) -> int:
    """Character offset where the last (assistant) message's text starts in the rendering."""
    before = render_text(tokenizer, history[:-1], tools, add_generation_prompt=True)
    return len(before)


def tokenize_transcript(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """Tokenise a logged OpenAI-format transcript: (input_ids, action_mask).

    The mask is 1 on assistant-written tokens, end-of-turn token included, and 0 on the prompt,
    tool results and template glue. The prompt is everything before the first assistant turn.
    """
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    if first == 0:
        raise LopdError("transcript starts with an assistant turn: no prompt to condition on")
    ids = render_prompt_ids(tokenizer, messages[:first], tools)
    mask = [0] * len(ids)
    prev = render_text(tokenizer, messages[:first], tools, add_generation_prompt=True)
    i = first
    while i < len(messages):
        full = render_text(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
        gen_text, _ = _split_after_end_of_turn(tokenizer, _prefix_delta(prev, full))
        gen = encode(tokenizer, gen_text)
        ids += gen
        mask += [1] * len(gen)
        j = next((k for k in range(i + 1, len(messages)) if messages[k].get("role") == "assistant"), len(messages))
        if j == i + 1 and j < len(messages):
            raise LopdError(f"transcript: two assistant turns in a row at message {j}")
        if j > i + 1:
            obs = observation_ids(tokenizer, messages[: i + 1], messages[i + 1: j], tools,
                                  add_generation_prompt=j < len(messages))
            ids += obs
            mask += [0] * len(obs)
            prev = render_text(tokenizer, messages[:j], tools, add_generation_prompt=j < len(messages))
        i = j
    return ids, mask


def incremental_observation_ids(tokenizer, prompt_messages: list[dict], last_assistant: dict,
                                new_messages: list[dict], tools: list[dict] | None,
                                add_generation_prompt: bool = True) -> list[int]:
    """`observation_ids` rendered against a short anchor instead of the whole history: the
    prompt (system + first user turn, which carry the tools block), the last assistant message,
    then `new_messages`. The cost no longer grows with the number of turns.

    For templates that render each message on its own (ChatML, Hermes rewriting, the tiny
    model's template) the ids equal `observation_ids(tokenizer, history, new_messages, tools)`
    for any `history` that starts with `prompt_messages` and ends with `last_assistant` — the
    runner spot-checks this against the full rendering (see agent/runner.py) and tests assert it
    on multi-turn transcripts."""
    return observation_ids(tokenizer, list(prompt_messages) + [last_assistant], new_messages, tools,
                           add_generation_prompt=add_generation_prompt)
