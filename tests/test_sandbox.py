"""The sandbox survives hostile programs: each returns a failed result with the reason."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from lopd_cli.envs.sandbox import _UID_RANGE, run_python

LIMITS = dict(timeout_s=3.0, memory_mb=256, max_procs=16, max_file_mb=4)


@pytest.fixture(scope="module")
def isolation() -> list[str]:
    res = run_python("print('ok')", **LIMITS)
    assert res.ok, res
    return res.isolation


def _leftover_sandbox_processes() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if _UID_RANGE[0] <= entry.stat().st_uid <= _UID_RANGE[1]:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_ok_program_output_and_clean_environment(monkeypatch):
    monkeypatch.setenv("LOPD_TEST_SECRET", "hunter2")
    res = run_python("import os, sys\nprint(sorted(os.environ))\nprint(os.environ.get('LOPD_TEST_SECRET'))\nprint(sys.flags.isolated)", **LIMITS)
    assert res.ok and res.returncode == 0 and res.reason == ""
    lines = res.stdout.splitlines()
    assert "LOPD_TEST_SECRET" not in lines[0] and lines[1] == "None" and lines[2] == "1"


def test_error_exit_reports_the_exception():
    res = run_python("raise ValueError('boom')", **LIMITS)
    assert not res.ok and res.returncode == 1
    assert "ValueError: boom" in res.reason


def test_infinite_loop_is_stopped():
    res = run_python("while True:\n    pass", **{**LIMITS, "timeout_s": 2.0})
    assert not res.ok
    assert res.reason.startswith(("timeout", "cpu_limit")), res.reason
    assert res.duration_s < 10


def test_sleeping_program_hits_the_wall_clock():
    res = run_python("import time\ntime.sleep(60)", **{**LIMITS, "timeout_s": 1.0})
    assert not res.ok and res.reason.startswith("timeout"), res.reason


def test_memory_hog_fails_with_memory_limit():
    res = run_python("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')", **LIMITS)
    assert not res.ok and res.reason.startswith("memory_limit"), res.reason
    assert "allocated" not in res.stdout


def test_fork_bomb_is_contained_and_cleaned_up(isolation):
    bomb = "import os\nwhile True:\n    os.fork()\n"
    res = run_python(bomb, **LIMITS)
    assert not res.ok
    assert res.reason.startswith(("process_limit", "timeout")), res.reason
    if "unprivileged-uid" in isolation:
        assert _leftover_sandbox_processes() == []


def test_file_size_limit():
    res = run_python("open('big', 'wb').write(b'x' * (8 * 1024 * 1024))", **LIMITS)
    assert not res.ok and res.reason.startswith("file_size_limit"), res.reason


def test_write_outside_the_working_folder_fails(tmp_path, isolation):
    if "readonly-fs" not in isolation:
        pytest.skip(f"no mount namespace here (isolation: {isolation})")
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable folder stays closed
    res = run_python(f"open({str(target)!r}, 'w').write('x')", **LIMITS)
    assert not res.ok and ("Read-only file system" in res.reason or "Permission denied" in res.reason), res.reason
    assert not target.exists()


def test_writing_inside_the_working_folder_works_and_is_removed():
    res = run_python("import os\nopen('note.txt', 'w').write('x')\nprint(os.getcwd())", **LIMITS)
    assert res.ok, res
    assert not Path(res.stdout.strip()).exists()


def test_network_is_cut_unless_allowed(isolation):
    if "no-network" not in isolation:
        pytest.skip(f"no network namespace here (isolation: {isolation})")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    try:
        res = run_python(connect, **LIMITS)
        assert not res.ok and "connected" not in res.stdout
        assert "unreachable" in res.reason or "refused" in res.reason, res.reason
        allowed = run_python(connect, **{**LIMITS, "network": True})
        assert allowed.ok and "connected" in allowed.stdout, allowed
    finally:
        server.close()


def test_extra_files_are_written_and_paths_checked():
    res = run_python("print(open('data/in.txt').read())", files={"data/in.txt": "hello"}, **LIMITS)
    assert res.ok and res.stdout.strip() == "hello"
    with pytest.raises(ValueError):
        run_python("pass", files={"../escape.txt": "x"}, **LIMITS)
