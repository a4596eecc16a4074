"""Run untrusted (model-written) Python code in a limited child process.

`run_python(code, ...)` is the one entry point; environments and user reward plugins call it
for every execution of model code. What it enforces, where the OS allows:

- wall-clock timeout (the whole process group and PID namespace is killed) and CPU time;
- address-space (memory), process-count and file-size limits (rlimits), no core dumps;
- no network: a fresh network namespace holds only a downed loopback;
- a throw-away working folder (removed afterwards); every other mount is read-only;
- as root, the program runs under an unused unprivileged uid (the process limit does not
  apply to root); otherwise in a user namespace; capabilities dropped, no_new_privs;
- a minimal environment (none of the parent's variables, so no secrets) and `python -I -B`.

`SandboxResult.isolation` lists what was actually in force (e.g. without namespace support
only rlimits and the uid apply). This is process isolation, not a VM: kernel exploits are out
of scope.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_BOOT = Path(__file__).with_name("_sandbox_boot.py")
_OUTPUT_LIMIT = 64 * 1024  # characters of stdout/stderr kept in the result
_UID_RANGE = (200_000, 299_999)  # unused uids for programs run by root


@dataclass
class SandboxResult:
    ok: bool  # exited with code 0 within every limit
    returncode: int | None  # exit code; negative: killed by that signal; None: never ran
    stdout: str
    stderr: str
    reason: str  # "" when ok; otherwise why it failed, e.g. "timeout: ..." or "memory_limit: ..."
    duration_s: float
    isolation: list[str] = field(default_factory=list)


def _read_tail(path: Path, limit: int = _OUTPUT_LIMIT) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit * 4))
            data = f.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")[-limit:]


def _last_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def classify_failure(returncode: int, stderr: str, cpu_exceeded: bool) -> str:
    """A short reason for a non-zero exit, naming the limit when one was hit."""
    last = _last_error_line(stderr)
    if returncode < 0:
        sig = -returncode
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_exceeded):
            return f"cpu_limit: CPU time limit exceeded ({name})"
        if sig == signal.SIGXFSZ:
            return "file_size_limit: file size limit exceeded (SIGXFSZ)"
        return f"killed by {name}"
    if "MemoryError" in last or "Cannot allocate memory" in stderr:
        return f"memory_limit: {last}"
    if "Resource temporarily unavailable" in stderr and ("fork" in stderr or "BlockingIOError" in last):
        return f"process_limit: {last}"
    if "File too large" in stderr:
        return f"file_size_limit: {last}"
    return f"exit code {returncode}: {last}" if last else f"exit code {returncode}"


def _python_paths(python: str) -> tuple[str, str, str]:
    """(installation prefix, executable path relative to it, library dir relative to it)."""
    exe = Path(os.path.realpath(python))
    prefix = exe.parent.parent
    return str(prefix), str(exe.relative_to(prefix)), "lib"


def run_python(
    code: str,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_procs: int = 32,
    max_file_mb: int = 16,
    network: bool = False,
    cpu_s: float | None = None,
    files: dict[str, str] | None = None,
    python: str | None = None,
) -> SandboxResult:
    """Run `code` as a script in the sandbox and report how it went.

    timeout_s   wall clock; cpu_s (default = timeout_s) CPU seconds
    memory_mb   address-space limit of the program (Python itself needs ~30 MB)
    max_procs   processes + threads the program's uid may hold, itself included
    max_file_mb largest file it may write (stdout/stderr included)
    files       extra files written into the working folder before the run
    python      interpreter (default: the base interpreter of this one, stdlib only)
    """
    python = python or getattr(sys, "_base_executable", None) or sys.executable
    prefix, exe_rel, lib_rel = _python_paths(python)
    for name in files or {}:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"sandbox file {name!r} lies outside the working folder")
    start = time.monotonic()
    top = Path(tempfile.mkdtemp(prefix="lopd-sbx-"))
    os.chmod(top, 0o755)
    work = top / "work"
    work.mkdir()
    (work / "main.py").write_text(code)
    for name, text in (files or {}).items():
        target = work / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    is_root = os.geteuid() == 0
    run_uid = random.randint(*_UID_RANGE) if is_root else None
    py_mount = None
    if is_root:
        py_mount = top / "python"
        py_mount.mkdir()
        for p in [work, *work.rglob("*")]:
            os.chown(p, run_uid, run_uid)
        os.chmod(work, 0o700)
    run_prefix = str(py_mount) if py_mount else prefix
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(work),
        "TMPDIR": str(work),
        "LANG": "C.UTF-8",
        "LD_LIBRARY_PATH": os.path.join(run_prefix, lib_rel),
    }
    out_path, err_path = top / "stdout", top / "stderr"
    read_fd, write_fd = os.pipe()
    cfg = {
        "workdir": str(work),
        "script": "main.py",
        "python": os.path.join(run_prefix, exe_rel),
        "python_prefix": prefix,
        "python_mount": str(py_mount) if py_mount else None,
        "run_uid": run_uid,
        "network": network,
        "cpu_s": float(cpu_s if cpu_s is not None else timeout_s),
        "memory_mb": memory_mb,
        "max_procs": max_procs,
        "max_file_mb": max_file_mb,
        "env": env,
        "status_fd": write_fd,
    }
    timed_out = False
    try:
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", str(_BOOT), json.dumps(cfg)],
                stdin=subprocess.DEVNULL,
                stdout=out_f,
                stderr=err_f,
                cwd=str(top),
                env={"PATH": env["PATH"], "LANG": "C.UTF-8"},
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        os.close(write_fd)
        write_fd = -1
        try:
            proc.wait(timeout=timeout_s + 1.0)  # +1 s: namespace set-up and interpreter start
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            proc.wait()
        status_text = os.read(read_fd, 65536).decode(errors="replace").strip()
        duration = time.monotonic() - start
        stdout, stderr = _read_tail(out_path), _read_tail(err_path)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
        _kill_group_quietly(locals().get("proc"))
        if run_uid is not None:
            _kill_uid(run_uid)
        shutil.rmtree(top, ignore_errors=True)
    status: dict = {}
    for line in status_text.splitlines():
        status.update(json.loads(line))
    isolation = status.get("features", [])
    if timed_out:
        return SandboxResult(False, None, stdout, stderr, f"timeout: wall clock over {timeout_s:g} s", duration, isolation)
    if "setup_error" in status:
        return SandboxResult(False, None, stdout, stderr, f"sandbox setup failed: {status['setup_error']}", duration, isolation)
    if "exit" not in status and "signal" not in status:
        return SandboxResult(False, proc.returncode, stdout, stderr, "sandbox failed: no status reported", duration, isolation)
    returncode = -status["signal"] if "signal" in status else status["exit"]
    if returncode == 0:
        return SandboxResult(True, 0, stdout, stderr, "", duration, isolation)
    cpu_exceeded = status.get("cpu_s", 0.0) >= cfg["cpu_s"]
    reason = classify_failure(returncode, stderr, cpu_exceeded)
    return SandboxResult(False, returncode, stdout, stderr, reason, duration, isolation)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_group_quietly(proc: subprocess.Popen | None) -> None:
    """After a normal exit the group is empty; after an error make sure nothing is left."""
    if proc is None:
        return
    if proc.poll() is None:
        _kill_group(proc.pid)
        proc.wait()


def _kill_uid(uid: int) -> None:
    """Kill whatever still runs under the program's private uid (a no-op after a clean run)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid:
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
