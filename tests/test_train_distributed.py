"""`lopd train` under torchrun: 2 CPU processes (gloo) give the metrics of 1 process with the
same global batch and seed; a killed 2-process run resumes; a different world size is refused;
the runner samples a rank's share exactly as one process would."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _train_fixtures import build_project, kill_torchrun_after_first_checkpoint, numeric
from lopd_cli.train.distributed import shard_range
from lopd_cli.train.metrics import read_metrics

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# 4 rollouts per step in chunks of 2, micro-batches of 2: each of 2 ranks gets one chunk and one
# micro-batch, exactly the ones 1 process forms; so the runs must agree.
SETS = ["--set", "rollout.batch_size=2", "--set", "train.micro_batch=2", "--set", "train.steps=3",
        "--set", "train.save_every=1"]


def _env() -> dict:
    return {**os.environ, "LOPD_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _train_cmd(project, *extra: str, nproc: int = 1) -> list[str]:
    lopd = ["-m", "lopd_cli", "train", "-C", str(project.root), "--recipe", "toolcall", *SETS, "--json", *extra]
    if nproc == 1:
        return [sys.executable, *lopd]
    return [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), *lopd]


def _check(cmd: list[str]) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _assert_same_metrics(reference: list[dict], other: list[dict]) -> None:
    assert [r["step"] for r in other] == [r["step"] for r in reference]
    for a, b in zip(reference, other):
        na, nb = numeric(a), numeric(b)
        assert na.keys() == nb.keys()
        for k in na:
            if na[k] is None:
                assert nb[k] is None, k
            else:
                assert nb[k] == pytest.approx(na[k], abs=1e-4), (a["step"], k)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return build_project(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def single(project):
    """The reference: one process, 3 steps of 4 rollouts."""
    _check(_train_cmd(project, "--run", "single"))
    return read_metrics(project.runs_dir / "single")


def test_shard_ranges_cover_every_item_once():
    for n in range(12):
        for w in range(1, 5):
            ranges = [shard_range(n, r, w) for r in range(w)]
            assert [i for lo, hi in ranges for i in range(lo, hi)] == list(range(n))
            sizes = [hi - lo for lo, hi in ranges]
            assert max(sizes) - min(sizes) <= 1


def test_a_share_samples_what_one_process_samples():
    """The runner seeds chunks by their place in the global batch (index_offset)."""
    from lopd_cli.agent.runner import run_episodes
    from lopd_cli.config import RolloutSection
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.models.backbone import load_backbone

    model, tok = load_backbone("tiny", device="cpu")
    tasks = OrdersEnv(n_train=16, n_validation=4, n_test=16).tasks("test")[:4]
    cfg = RolloutSection(temperature=1.0, max_new_tokens=10, max_turns=1, batch_size=2)
    whole = run_episodes(model, tok, OrdersEnv, tasks, cfg, seed=5)
    second = run_episodes(model, tok, OrdersEnv, tasks[2:], cfg, seed=5, index_offset=2)
    unaware = run_episodes(model, tok, OrdersEnv, tasks[2:], cfg, seed=5)
    assert [e.input_ids for e in second] == [e.input_ids for e in whole[2:]]
    assert [e.logprobs for e in second] == [e.logprobs for e in whole[2:]]
    assert [e.input_ids for e in unaware] != [e.input_ids for e in whole[2:]], "the offset must matter"


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(project, single):
    _check(_train_cmd(project, "--run-name", "dual", nproc=2))
    dual = read_metrics(project.runs_dir / "dual")
    assert [r["step"] for r in dual] == [1, 2, 3], "rank 0 alone writes metrics"
    assert [r["rollouts_total"] for r in dual] == [28, 32, 36]
    assert dual[-1]["kl"] > 0 and dual[-1]["grad_norm_student"] > 0
    _assert_same_metrics(single, dual)
    latest = project.runs_dir / "dual" / "checkpoints" / "latest"
    assert json.loads((latest / "checkpoint.json").read_text())["world_size"] == 2

    # Resuming with another world size is refused, naming both sizes.
    res = subprocess.run(_train_cmd(project, "--run", "dual", "--resume", "--set", "train.steps=4"),
                         env=_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 1
    assert "written by 2 process(es), this run has 1" in res.stderr




@pytest.mark.slow
def test_killed_two_process_run_resumes(project, single):
    ckdir = project.runs_dir / "killed" / "checkpoints"
    kill_torchrun_after_first_checkpoint(_train_cmd(project, "--run-name", "killed", nproc=2), _env(), ckdir)
    assert (ckdir / "step_1").exists()
    assert not (ckdir / "step_3").exists(), "killed too late to test a resume"

    _check(_train_cmd(project, "--run-name", "killed", "--resume", nproc=2))
    resumed = read_metrics(project.runs_dir / "killed")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    _assert_same_metrics(single, resumed)
