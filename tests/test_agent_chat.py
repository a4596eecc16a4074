"""Chat rendering and transcript tokenisation (native `tools=` and the Hermes fallback)."""

import copy

import pytest

from lopd_cli.agent.chat import (
    end_of_turn_token,
    observation_ids,
    render_prompt_ids,
    render_text,
    template_supports_tools,
    tokenize_transcript,
)
from lopd_cli.models.backbone import load_tokenizer, resolve_backbone

# SmolLM2's template: ChatML without any tool support.
PLAIN_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS = [{"type": "function", "function": {"name": "get_order", "description": "Get an order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}}}]

TRANSCRIPT = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Status of orders 12 and 13?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": 12}'}},
        {"id": "c1", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": 13}'}}]},
    {"role": "tool", "tool_call_id": "c0", "content": '{"status": "shipped"}'},
    {"role": "tool", "tool_call_id": "c1", "content": '{"status": "pending"}'},
    {"role": "assistant", "content": "12 is shipped, 13 is pending."},
]


@pytest.fixture(scope="module")
def native():
    return load_tokenizer(resolve_backbone("tiny"))


@pytest.fixture(scope="module")
def hermes(native):
    tok = copy.deepcopy(native)
    tok.chat_template = PLAIN_CHATML
    return tok


def test_template_detection(native, hermes):
    assert template_supports_tools(native) and not template_supports_tools(hermes)


def test_hermes_fallback_renders_tools_calls_and_results(hermes):
    text = render_text(hermes, TRANSCRIPT, TOOLS, add_generation_prompt=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou help.") and "<tools>" in system and '"get_order"' in system
    assert '<tool_call>\n{"name": "get_order", "arguments": {"order_id": 13}}\n</tool_call>' in text
    # both results in one user turn
    assert "<|im_start|>user\n<tool_response>\n{\"status\": \"shipped\"}\n</tool_response>\n<tool_response>" in text
    assert "<|im_start|>tool" not in text


@pytest.mark.parametrize("which", ["native", "hermes"])
def test_tokenize_transcript_masks_exactly_the_assistant_turns(which, request):
    tok = request.getfixturevalue(which)
    ids, mask = tokenize_transcript(tok, TRANSCRIPT, TOOLS)
    assert len(ids) == len(mask)
    prompt = render_prompt_ids(tok, TRANSCRIPT[:2], TOOLS)
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    eot = end_of_turn_token(tok)
    # contiguous runs of mask 1 are the two assistant turns, each closed by the end-of-turn token
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    texts = [tok.decode(r) for r in runs]
    assert len(texts) == 2, texts
    assert texts[0].startswith("Checking.") and '"order_id": 13' in texts[0] and texts[0].endswith(eot)
    assert texts[1] == "12 is shipped, 13 is pending." + eot
    # unmasked tokens after the prompt: the template glue, the results and the next generation prompt
    glue = tok.decode([i for i, m in zip(ids[len(prompt):], mask[len(prompt):]) if not m])
    assert '{"status": "pending"}' in glue and glue.rstrip().endswith("assistant")
    # and the whole thing decodes to the template's rendering
    assert tok.decode(ids) == render_text(tok, TRANSCRIPT, TOOLS, add_generation_prompt=False).rstrip("\n")


def test_observation_ids_continue_after_the_end_of_turn_token(native):
    ids, _ = tokenize_transcript(native, TRANSCRIPT[:5], TOOLS)
    obs = observation_ids(native, TRANSCRIPT[:3], TRANSCRIPT[3:5], TOOLS)
    assert ids[-len(obs):] != obs  # a transcript ending on tool results has no generation prompt
    full, _ = tokenize_transcript(native, TRANSCRIPT, TOOLS)
    text = native.decode(obs)
    assert text.startswith("\n<|im_start|>user") and text.endswith("<|im_start|>assistant\n")
    assert native.decode(full).count(text) == 1
