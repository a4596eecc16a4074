"""`lopd train` end to end on the tiny backbone: LOPD, GRPO and OPSD in one loop, the dual
variable, guards, checkpoints and an exact resume after SIGKILL."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from _train_fixtures import build_project, numeric, train_run
from lopd_cli.errors import LopdError
from lopd_cli.train.metrics import read_metrics


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A tiny project with a bank of (noisy) oracle rollouts, its index and a cold-start composer."""
    return build_project(tmp_path_factory.mktemp("proj"))


def _composer_tensors(run_dir):
    from safetensors.torch import load_file

    d = run_dir / "composer"
    return {**load_file(str(d / "qformer.safetensors")),
            **{f"enc.{k}": v for k, v in load_file(str(d / "encoder" / "adapter_model.safetensors")).items()}}


def test_coldstart_is_reproducible_from_its_seed(project):
    """torch seeds its generator at random at import, so an unseeded init of the encoder LoRA and
    χ made every `lopd coldstart` process a different composer (found when a rerun of an 80-step
    cold start collapsed where the first had not). The same seed gives the same composer, bit for
    bit, whatever ran before in the process; another seed gives another."""
    import shutil

    from lopd_cli.train.coldstart import run_coldstart

    again_dir, seed1_dir = project.runs_dir / "coldstart_again", project.runs_dir / "coldstart_seed1"
    try:
        torch.randn(7)  # move the global generator, as a previous stage of the process would
        run_coldstart(project, project.load_recipe("toolcall"), again_dir, show_progress=False)
        first, again = _composer_tensors(project.runs_dir / "coldstart"), _composer_tensors(again_dir)
        assert first.keys() == again.keys()
        assert all(torch.equal(first[k], again[k]) for k in first)
        run_coldstart(project, project.load_recipe("toolcall", ["coldstart.seed=1"]), seed1_dir, show_progress=False)
        seed1 = _composer_tensors(seed1_dir)
        assert any(not torch.equal(first[k], seed1[k]) for k in first)
    finally:  # the other tests train from the project's newest composer, which must stay runs/coldstart
        shutil.rmtree(again_dir, ignore_errors=True)
        shutil.rmtree(seed1_dir, ignore_errors=True)


def test_lopd_steps_update_student_and_composer(project):
    tr, rows = train_run(project, "lopd-a", [])
    assert [r["step"] for r in rows] == [1, 2]
    # every rollout counts: the 24 lopd-generated bank rows, then 4 per step
    assert [r["rollouts_total"] for r in rows] == [28, 32]
    for key in ("reward", "success", "kl", "delta", "beta", "anchor", "grad_norm_student", "grad_norm_composer",
                "sec_teacher", "sec_student", "sec_composer", "peak_memory_mb"):
        assert rows[-1][key] is not None, key
    assert all(r["beta"] >= 0 for r in rows)
    ckpt = project.runs_dir / "lopd-a" / "checkpoints" / "latest"
    assert (ckpt / "student" / "adapter_model.safetensors").exists() and (ckpt / "composer" / "manifest.json").exists()
    from safetensors.torch import load_file

    before = load_file(str(project.runs_dir / "coldstart" / "composer" / "qformer.safetensors"))
    after = load_file(str(ckpt / "composer" / "qformer.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before), "the composer must train"
    lora = load_file(str(ckpt / "student" / "adapter_model.safetensors"))
    assert any(float(v.abs().sum()) > 0 for k, v in lora.items() if "lora_B" in k), "the student must train"


def test_frozen_composer_does_not_change(project):
    tr, rows = train_run(project, "lopd-frozen", ["train.lopd.freeze_composer=true"])
    from safetensors.torch import load_file

    before = load_file(str(project.runs_dir / "coldstart" / "composer" / "qformer.safetensors"))
    after = load_file(str(project.runs_dir / "lopd-frozen" / "checkpoints" / "latest" / "composer" / "qformer.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert rows[-1]["grad_norm_composer"] is None


def test_composer_batch_and_every(project):
    """φ on 2 of the 4 rows on step 1 and not at all on step 2 (composer_every 2): no composer
    gradient, no warm-up or β step there; the student trains on every step."""
    tr, rows = train_run(project, "lopd-share", ["train.lopd.composer_batch=2", "train.lopd.composer_every=2"])
    assert [r["composer_rows"] for r in rows] == [2, 0]
    assert rows[0]["grad_norm_composer"] > 0 and rows[1]["grad_norm_composer"] is None
    assert rows[1]["beta"] == rows[0]["beta"]
    assert all(r["grad_norm_student"] > 0 and r["kl"] is not None for r in rows)
    assert tr.composer_sched.last_epoch == 1
    assert len(tr.nograd_latents) > 0, "step 2's no-grad latents are kept: φ has not changed since"


@pytest.mark.parametrize("algo", ["grpo", "opsd"])
def test_baselines_run_in_the_same_loop(project, algo):
    tr, rows = train_run(project, f"{algo}-a", [f"train.algo={algo}"])
    assert [r["algo"] for r in rows] == [algo, algo]
    assert rows[-1]["rollouts_total"] == (8 if algo == "grpo" else 32)
    assert "beta" not in rows[-1]
    assert (project.runs_dir / f"{algo}-a" / "checkpoints" / "latest" / "student").is_dir()


def test_beta_rises_below_margin_and_stays_zero_above(project):
    _, high = train_run(project, "beta-high", ["train.lopd.margin_m=10.0", "train.steps=3"])
    betas = [r["beta"] for r in high]
    assert betas[0] > 0 and betas == sorted(betas) and betas[-1] > betas[0], betas
    _, low = train_run(project, "beta-low", ["train.lopd.margin_m=-10.0", "train.lopd.beta0=1.0", "train.steps=2"])
    assert [r["beta"] for r in low] == [0.0, 0.0], "β falls to 0 (clamped) when Δ > m"


def test_composer_health_at_every_eval_and_collapse_warning(project):
    from lopd_cli.errors import LopdWarning

    # a threshold no composer reaches: the collapse warning must fire at each eval
    with pytest.warns(LopdWarning, match="collapsed into a fixed prompt"):
        _, rows = train_run(project, "health", ["train.eval_every=1", "train.eval_n=2", "train.lopd.health_n=4",
                                           "train.lopd.min_task_spread=1e6"])
    for r in rows:
        assert 0 < r["composer/latent_task_spread"] < 10
        assert r["composer/nll_gap"] == pytest.approx(r["composer/nll_shuffled"] - r["composer/nll_own"])
        assert r["grad_norm_encoder"] > 0 and r["grad_norm_resampler"] > 0
        assert r["margin_binds"] in (True, False, None) and "margin_defined" in r
        assert (r["margin_binds"] is None) == (not r["margin_defined"])


def test_paper_margin_form_still_runs(project):
    _, rows = train_run(project, "paper-margin", ["train.lopd.margin_advantage=paper", "train.steps=1"])
    assert rows[0]["margin_defined"] is True and isinstance(rows[0]["delta"], float)


def test_rerun_into_existing_folder_is_refused(project):
    train_run(project, "once", ["train.steps=1", "train.algo=grpo"])
    with pytest.raises(LopdError, match="already holds a run"):
        train_run(project, "once", ["train.steps=1", "train.algo=grpo"])


def test_exact_resume_after_sigkill(project):
    env = {**os.environ, "LOPD_THREADS": "1"}
    cmd = [sys.executable, "-m", "lopd_cli", "train", "-C", str(project.root), "--recipe", "toolcall",
           "--set", "train.steps=4", "--set", "train.save_every=2", "--json"]
    subprocess.run(cmd + ["--run", "straight"], check=True, env=env, capture_output=True)
    straight = read_metrics(project.runs_dir / "straight")

    proc = subprocess.Popen(cmd + ["--run", "killed"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckdir = project.runs_dir / "killed" / "checkpoints"
    deadline = time.time() + 600
    while not (ckdir / "step_2").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (ckdir / "step_2").exists()
    assert not (ckdir / "step_4").exists(), "killed too late to test a resume"
    subprocess.run(cmd + ["--run", "killed", "--resume"], check=True, env=env, capture_output=True)
    resumed = read_metrics(project.runs_dir / "killed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight[2:], resumed[2:]):
        na, nb = numeric(a), numeric(b)
        assert na.keys() == nb.keys()
        for k in na:
            if na[k] is None:
                assert nb[k] is None
            else:
                assert nb[k] == pytest.approx(na[k], abs=1e-5, rel=1e-5), k
