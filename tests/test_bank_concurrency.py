"""Several processes writing the bank at once, and a writer killed mid-file."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

from lopd_cli.bank.store import Bank

# Each writer opens the bank, says ready, waits for the go file, then adds its whole file.
ADD_FILE = ("import sys, time; from pathlib import Path; from lopd_cli.bank.store import Bank; "
            "b = Bank(Path(sys.argv[1])); print('ready', flush=True); go = Path(sys.argv[3])\n"
            "while not go.exists(): time.sleep(0.01)\n"
            "r = b.add_file(Path(sys.argv[2])); print(r.added, r.duplicates, r.invalid, r.written)")
ADD_STDIN = ("import sys; from pathlib import Path; from lopd_cli.bank.store import Bank; "
             "print('started', flush=True); Bank(Path(sys.argv[1])).add_stream(sys.stdin.buffer, '<stdin>')")


def line(tag, i, pad=0):
    return json.dumps({"task_id": f"{tag}-{i}", "instruction": f"{tag} task {i}",
                       "messages": [{"role": "user", "content": f"{tag} task {i}"},
                                    {"role": "assistant", "content": "ok " + "p" * pad}],
                       "reward": 1.0 if i % 2 else 0.0}) + "\n"


def test_four_processes_adding_different_files_lose_nothing(tmp_path):
    bank_path = tmp_path / "bank.sqlite"  # created by the racing processes themselves
    files = []
    for p in range(4):
        f = tmp_path / f"part{p}.jsonl"
        f.write_text("".join(line(f"p{p}", i) for i in range(3000)))
        files.append(f)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", ADD_FILE, str(bank_path), str(f), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in files]
    for p in procs:
        first = p.stdout.readline().strip()
        if first != "ready":
            go.touch()
            raise AssertionError(f"writer did not start: {first!r} {p.communicate(timeout=60)}")
    go.touch()
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    for out, err, rc in results:
        assert rc == 0, err
        assert out.split() == ["3000", "0", "0", "True"], (out, err)
    bank = Bank(bank_path)
    assert bank.count() == 12000 and bank.count(success_only=True) == 6000
    assert len({i.task_id for i in bank.iter_items(success_only=False)}) == 12000


def test_sigkill_mid_add_leaves_the_bank_as_before(tmp_path):
    bank_path = tmp_path / "bank.sqlite"
    bank = Bank(bank_path)
    before = bank.add_records([json.loads(line("old", i)) for i in range(50)], source="old")
    assert before.added == 50
    bank.close()
    proc = subprocess.Popen([sys.executable, "-c", ADD_STDIN, str(bank_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"started"
    # Feed rows (several MB, more than SQLite's page cache, so pages spill into the WAL) and
    # kill the writer while its transaction is open and it waits for more input.
    wal = tmp_path / "bank.sqlite-wal"
    deadline = time.time() + 60
    i = 0
    while time.time() < deadline:
        proc.stdin.write("".join(line("new", j, pad=400) for j in range(i, i + 2000)).encode())
        proc.stdin.flush()
        i += 2000
        if wal.exists() and wal.stat().st_size > 4_000_000:
            break
        time.sleep(0.05)
    assert wal.exists() and wal.stat().st_size > 4_000_000, "the writer never got far into the file"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    bank = Bank(bank_path)
    assert bank.count() == 50
    assert {it.task_id for it in bank.iter_items(success_only=False)} == {f"old-{k}" for k in range(50)}
    con = sqlite3.connect(bank_path)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    # the bank is fully usable afterwards
    assert bank.add_records([json.loads(line("after", 0))]).added == 1
    assert bank.count() == 51
