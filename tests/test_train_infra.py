"""Checkpoint writing is atomic and resumable; the task sampler resumes at the same position."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from lopd_cli.errors import LopdError
from lopd_cli.train.checkpoint import load_state, resolve_checkpoint, rng_state, save_checkpoint, set_rng_state
from lopd_cli.train.metrics import MetricsLog, read_metrics
from lopd_cli.train.sampler import TaskSampler


def _write_blob(path):
    path.mkdir()
    (path / "w.bin").write_bytes(os.urandom(1000))


def test_checkpoint_layout_and_latest(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, {"algo": "lopd"}, {"beta": 0.1}, {"student": _write_blob})
    save_checkpoint(root, 2, {"algo": "lopd"}, {"beta": 0.2}, {"student": _write_blob})
    step = resolve_checkpoint(tmp_path)
    assert step.name == "step_2" and (step / "student" / "w.bin").exists()
    assert load_state(step)["beta"] == 0.2
    assert json.loads((step / "checkpoint.json").read_text())["step"] == 2
    assert resolve_checkpoint(root / "step_1").name == "step_1"
    with pytest.raises(LopdError, match="not a lopd checkpoint"):
        resolve_checkpoint(tmp_path / "nothing")


def test_keep_last_prunes_old_steps(tmp_path):
    root = tmp_path / "c"
    for s in range(1, 5):
        save_checkpoint(root, s, {}, {}, {}, keep_last=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_3", "step_4"]


def test_sigkill_while_writing_keeps_previous_latest(tmp_path):
    root = tmp_path / "c"
    save_checkpoint(root, 1, {}, {"x": 1}, {})
    script = textwrap.dedent(f"""
        import time, pathlib
        from lopd_cli.train.checkpoint import save_checkpoint
        def slow(path):
            path.mkdir(); (path / "part").write_text("half"); print("writing", flush=True); time.sleep(60)
        save_checkpoint(pathlib.Path({str(root)!r}), 2, {{}}, {{"x": 2}}, {{"student": slow}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    latest = resolve_checkpoint(root)
    assert latest.name == "step_1" and load_state(latest)["x"] == 1
    assert not (root / "step_2").exists()


def test_rng_state_round_trip():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(a, torch.rand(3))


def test_sampler_resumes_exactly_and_covers_each_epoch():
    s = TaskSampler(10, seed=3)
    first = s.take(7)
    saved = s.state_dict()
    rest = s.take(13)
    again = TaskSampler.from_state(saved).take(13)
    assert rest == again
    epoch0 = first + rest[:3]
    assert sorted(epoch0) == list(range(10)), "each epoch visits every task once"
    assert TaskSampler(10, seed=4).take(10) != TaskSampler(10, seed=3).take(10)


def test_metrics_log_truncates_on_resume(tmp_path):
    log = MetricsLog(tmp_path)
    for s in range(1, 6):
        log.log({"step": s, "loss": float(s), "bad": float("nan")})
    assert read_metrics(tmp_path)[0]["bad"] is None
    MetricsLog(tmp_path, resume_step=3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
