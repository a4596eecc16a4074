"""`tiny`: a Qwen3-architecture causal LM built from a config, with a locally trained tokenizer.

What it simplifies: the weights are random (seeded) and the tokenizer is a byte-level BPE
trained in a fraction of a second on a built-in corpus, so tests and demos need no download.
It goes through exactly the same code as an 8B model; only its size differs.
"""

from __future__ import annotations

import json
from pathlib import Path

LATENT_TOKEN = "<|LATENT_PH|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", LATENT_TOKEN]

# Qwen2.5/Qwen3-style ChatML template with Hermes tool calls, so `tools=` renders natively.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if not loop.first %}<|im_start|>system\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% elif message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message.get('tool_calls') %}{% for tc in message['tool_calls'] %}"
    "{% set f = tc['function'] if tc.get('function') else tc %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ f["name"] }}", "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A small built-in corpus: enough for a BPE that packs chat, JSON tool calls, English and code.
_CORPUS_SNIPPETS = [
    "You are a helpful customer-service agent. Use the tools to solve the task, then answer.",
    "Task to solve:\nReference past trajectory:\n",
    '<tool_call>\n{"name": "get_order", "arguments": {"order_id": 4821}}\n</tool_call>',
    '<tool_response>\n{"status": "shipped", "total": 59.9, "items": ["lamp", "desk"]}\n</tool_response>',
    '{"type": "function", "function": {"name": "find_customer", "description": "Find a customer by email", '
    '"parameters": {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"]}}}',
    "Cancel order refund payment update address send message list orders customer product",
    "The order was cancelled and the refund of 120.50 is on its way. Your address is updated.",
    "def add(a: int, b: int) -> int:\n    return a + b\n\nfor i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "import math\nclass Solution:\n    def solve(self, nums: list[int]) -> int:\n        return sum(nums)\n",
    "the of and to in is that for it with as was on be by this are or from at which not have an",
    "pending processing shipped delivered cancelled refunded email name street city zip country",
    "0 1 2 3 4 5 6 7 8 9 10 42 100 1000 2024 3.14 -1 true false null None True False",
    "Hello! How can I help you today? Thank you. Sorry, I could not find that order.",
    "ERROR: unknown tool. ERROR: invalid arguments. ERROR: malformed JSON in tool call.",
]


def _corpus() -> list[str]:
    words = " ".join(_CORPUS_SNIPPETS).split()
    lines = list(_CORPUS_SNIPPETS) * 20
    # Deterministic recombinations so merges see words in many contexts.
    for i in range(2000):
        lines.append(" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(12)))
    return lines


def build_tokenizer(vocab_size: int = 3000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[LATENT_TOKEN],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int, pad_id: int, eos_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )


def build_tiny(out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny backbone (random weights from `seed`) and save it as a transformers dir."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "lopd_model.json").write_text(json.dumps({"name": "tiny", "seed": seed}))
    return out_dir
