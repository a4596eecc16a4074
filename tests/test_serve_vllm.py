"""The exported student served by `vllm serve` to a stock `openai` client, as README "Serve
your student" says: merged (`lopd export --merge-lora`) and adapter-only (`--adapter-only`
with `--enable-lora --lora-modules`).

Runs in `make test-vllm` (vLLM and openai in `.venv-vllm`); skipped elsewhere. Each server
listens on 127.0.0.1 only, every wait is bounded, and the server's process group is killed
when the test ends, whatever happened. A tiny random model writes no tool call by itself, so
the student's LoRA is first fitted (a few hundred CPU steps) to answer the test's chat with
one get_order call in lopd's <tool_call> format; the served answer must then come back as a
parsed OpenAI tool call, which also shows that the adapter (merged or as a LoRA module) is
what vLLM serves. A forced `tool_choice` is not used: with vLLM 0.32 and the hermes parser it
forced only the `<tool_call>{"name": ...` prefix and the arguments ran to max_tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from _vllm_server import serve  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REQUEST_TIMEOUT_S = 180
TOOLS = [{"type": "function", "function": {
    "name": "get_order", "description": "Look an order up by its id",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}}}]
MESSAGES = [{"role": "system", "content": "You are a customer-service agent. Use the tools."},
            {"role": "user", "content": "Where is order 4821?"}]

CALL_ARGS = {"order_id": 4821}


def teach_one_call(model, tok, max_steps: int = 600) -> int:
    """Fit the student LoRA until its greedy answer to MESSAGES is exactly one get_order call
    in lopd's format (a tiny random model writes no tool call by itself). Returns the steps taken."""
    import torch

    from lopd_cli.agent.chat import render_prompt_ids, stop_token_ids
    from lopd_cli.agent.toolcalls import render_tool_call

    prompt = render_prompt_ids(tok, MESSAGES, TOOLS)
    answer = tok.encode(render_tool_call("get_order", CALL_ARGS), add_special_tokens=False) + stop_token_ids(tok)[:1]
    ids = torch.tensor([prompt + answer])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    opt = torch.optim.Adam(params, lr=1e-2)
    for step in range(1, max_steps + 1):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0:
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=len(answer), do_sample=False)
            if out[0, len(prompt):].tolist() == answer:
                return step
    pytest.fail(f"the tiny student did not learn the tool call in {max_steps} steps (loss {loss.item():.3f})")


def make_checkpoint(run_dir: Path) -> Path:
    """A checkpoint in the trainer's layout: tiny + a LoRA adapter "student" that answers
    MESSAGES with one get_order call (the backbone alone does not)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from lopd_cli.models.backbone import load_backbone, resolve_backbone

    torch.manual_seed(0)
    model, tok = load_backbone("tiny", device="cpu")
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                                adapter_name="student")
    steps = teach_one_call(peft_model, tok)
    print(f"\nstudent learned the call in {steps} steps", flush=True)
    step_dir = run_dir / "checkpoints" / "step_1"
    step_dir.mkdir(parents=True)
    peft_model.save_pretrained(str(step_dir / "student"))
    (step_dir / "checkpoint.json").write_text(json.dumps({
        "step": 1, "algo": "lopd", "backbone": "tiny", "backbone_path": str(resolve_backbone("tiny")),
        "student": "lora"}))
    (run_dir / "checkpoints" / "latest").symlink_to("step_1")
    return run_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve") / "run")


def lopd_export(run_dir: Path, out: Path, mode: str) -> dict:
    lopd = Path(sys.executable).parent / "lopd"
    r = subprocess.run([str(lopd), "export", str(run_dir), mode, "-o", str(out), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def check_chat(client, model: str) -> None:
    """A chat with tools= as any OpenAI client sends it; the student's answer comes back as
    OpenAI tool_calls (vLLM's hermes parser read the call the student wrote)."""
    from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall

    resp = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=64,
                                          temperature=0)
    assert isinstance(resp, ChatCompletion) and resp.model == model
    choice = resp.choices[0]
    msg = choice.message
    print(f"answer: finish={choice.finish_reason} content={msg.content!r} tool_calls={msg.tool_calls!r}", flush=True)
    assert msg.role == "assistant" and choice.finish_reason == "tool_calls"
    assert isinstance(msg.tool_calls, list) and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert isinstance(call, ChatCompletionMessageToolCall) and call.type == "function" and call.id
    assert call.function.name == "get_order" and json.loads(call.function.arguments) == CALL_ARGS

    # The call and its result go back in as history: the server renders them with the exported
    # chat template and answers the next turn.
    history = MESSAGES + [
        {"role": "assistant", "content": msg.content or "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"status": "shipped"}'}]
    after = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert after.choices[0].message.role == "assistant"
    assert after.usage.prompt_tokens > resp.usage.prompt_tokens


def test_exported_chat_template_round_trips_through_the_hermes_parser(run_dir, tmp_path):
    """Our template writes a tool call the way vLLM's hermes parser reads it (no server needed)."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    out = tmp_path / "student"
    lopd_export(run_dir, out, "--merge-lora")
    tok = AutoTokenizer.from_pretrained(str(out))
    call = {"id": "c1", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": 4821}'}}
    prompt = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                                   tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    generated = full[len(prompt):].split("<|im_end|>")[0]  # what the model would generate
    request = ChatCompletionRequest(model="student", messages=MESSAGES, tools=TOOLS)
    parsed = Hermes2ProToolParser(tok).extract_tool_calls(generated, request)
    assert parsed.tools_called and len(parsed.tool_calls) == 1
    assert parsed.tool_calls[0].function.name == "get_order"
    assert json.loads(parsed.tool_calls[0].function.arguments) == {"order_id": 4821}


def test_merged_student_serves_an_openai_client_with_tools(run_dir, tmp_path):
    out = tmp_path / "student"
    info = lopd_export(run_dir, out, "--merge-lora")
    assert info["mode"] == "merged"
    args = ["--model", str(out), "--served-model-name", "student", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    for server in serve(args, tmp_path / "vllm-merged.log"):
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["student"]
        check_chat(client, "student")


def test_adapter_only_student_serves_with_lora_modules(run_dir, tmp_path):
    from lopd_cli.models.backbone import resolve_backbone

    out = tmp_path / "adapter"
    info = lopd_export(run_dir, out, "--adapter-only")
    assert info["mode"] == "adapter"
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base) == resolve_backbone("tiny")
    args = ["--model", base, "--enable-lora", "--lora-modules", f"student={out}", "--max-lora-rank", "8",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    for server in serve(args, tmp_path / "vllm-lora.log"):
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        assert "student" in [m.id for m in client.models.list().data]
        check_chat(client, "student")
        # The backbone alone, served by its own name, does not write that call: the adapter did.
        plain = client.chat.completions.create(model=base, messages=MESSAGES, tools=TOOLS, max_tokens=64, temperature=0)
        calls = plain.choices[0].message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in calls] != [("get_order", json.dumps(CALL_ARGS))]
