"""The benchmark scripts' quick modes run end to end and write what their RESULTS.md tables read.

They measure (time, memory); nothing here asserts a timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_step_overhead_quick(tmp_path):
    out = tmp_path / "step_overhead.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_overhead.py"), "--quick", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["models"]) == {"tiny"}
    tiny = data["models"]["tiny"]
    assert tiny["shapes"]["action_tokens"] == 4 * 128 and tiny["shapes"]["student_tokens"] == 4 * 256
    assert tiny["shapes"]["teacher_tokens"] > tiny["shapes"]["student_tokens"]  # reference block + latents
    for prec in ("fp32", "bf16"):
        s = tiny["summary"][prec]
        assert set(s["seconds"]) == {"sft", "student", "lopd", "enc_fwd", "enc_fwdbwd", "head_pass"}
        assert all(v > 0 for v in s["seconds"].values())
        assert s["ratio_to_sft"]["sft"] == 1.0
        assert set(s["over_floor"]) == {"student", "lopd"}
        assert set(s["lopd_phase_seconds"]) == {"teacher", "student", "composer"}
        assert len(tiny["timing"][prec]["runs"]["lopd"]) == 2
    mem = tiny["summary"]["fp32"]["memory"]
    assert set(mem) == {"sft", "student", "lopd"}
    for phase in mem.values():
        assert phase["peak_rss_mib"] >= phase["setup_peak_rss_mib"] > 0
    assert "| fp32 | lopd |" in res.stdout
