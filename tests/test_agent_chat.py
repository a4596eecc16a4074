"""Chat rendering and transcript tokenisation (native `tools=`, the Hermes fallback and the
SmolLM2 chat-format profile)."""

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
from lopd_cli.agent.chat_profiles import PROFILES, apply_profile, profile_for
from lopd_cli.agent.toolcalls import parse_tool_calls
from lopd_cli.errors import LopdError
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


@pytest.fixture(scope="module")
def smollm2(native):
    """The SmolLM2 profile's template on the tiny tokenizer (the same ChatML special tokens)."""
    tok = copy.deepcopy(native)
    apply_profile(tok, "smollm2")
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


@pytest.mark.parametrize("which", ["native", "hermes", "smollm2"])
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


def test_smollm2_profile_renders_the_apigen_format_and_parses_back(smollm2):
    text = render_text(smollm2, TRANSCRIPT, TOOLS, add_generation_prompt=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    assert '<tools>[{"type": "function"' in system and system.endswith("]</tool_call>\n\nYou help.")
    # both calls in one block, as a JSON list, after the visible text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert turn == ('Checking.\n<tool_call>[\n{"name": "get_order", "arguments": {"order_id": 12}},\n'
                    '{"name": "get_order", "arguments": {"order_id": 13}}\n]</tool_call>')
    visible, calls = parse_tool_calls(turn, TOOLS)
    assert visible == "Checking." and [(c.name, c.arguments, c.id, c.error) for c in calls] == [
        ("get_order", {"order_id": 12}, "call_0", None), ("get_order", {"order_id": 13}, "call_1", None)]
    # each tool result is its own user turn of <tool_response>
    assert text.count("<|im_start|>user\n<tool_response>\n") == 2 and "<|im_start|>tool" not in text
    # no tools: SmolLM2's own default system prompt, no tools block
    plain = render_text(smollm2, [{"role": "user", "content": "hi"}], None, add_generation_prompt=True)
    assert plain.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM") and "<tools>" not in plain


def test_profile_comes_from_the_model_folder(tmp_path):
    assert profile_for(tmp_path) is None  # no lopd_model.json: the model's own template
    (tmp_path / "lopd_model.json").write_text('{"name": "smollm2-135m-instruct"}')
    assert profile_for(tmp_path) == "smollm2"  # embedded SmolLM2 folders made before the key
    (tmp_path / "lopd_model.json").write_text('{"name": "smollm2-135m-instruct", "chat_format": "template"}')
    assert profile_for(tmp_path) is None  # opting out
    (tmp_path / "lopd_model.json").write_text('{"name": "mine", "chat_format": "smollm2"}')
    assert profile_for(tmp_path) == "smollm2" and "smollm2" in PROFILES
    (tmp_path / "lopd_model.json").write_text('{"chat_format": "llama9"}')
    with pytest.raises(LopdError, match="lopd_model.json: unknown chat_format 'llama9'"):
        profile_for(tmp_path)
