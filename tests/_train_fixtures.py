"""Shared helpers for training tests: a tiny LOPD-ready project (bank of noisy oracle rollouts of
the orders world, its index, a cold-start composer) and the fast recipe overrides it uses."""

from __future__ import annotations

from pathlib import Path

import yaml

FAST = {
    "env": {"class": "lopd_cli.envs.orders:OrdersEnv", "kwargs": {"n_train": 40, "n_validation": 8, "n_test": 8}},
    "rollout": {"max_new_tokens": 24, "max_turns": 2, "rollouts_per_step": 4, "batch_size": 4},
    "composer": {"num_queries": 4, "depth": 1, "max_item_tokens": 96},
    "coldstart": {"steps": 2, "batch_size": 4, "eval_every": 2, "val_fraction": 0.1},
    # composer_every 1: the training tests check φ, its warm-up and β step by step (the default 4 is
    # covered by test_composer_batch_and_every); composer_micro_batch stays 2 < micro_batch 4, so the
    # exact-resume and 2-process tests run the chunked composer pass.
    "train": {"steps": 2, "save_every": 1, "micro_batch": 4, "lr": 1e-3, "grpo": {"group_size": 2},
              "lopd": {"composer_lr": 1e-3, "composer_every": 1}},
}


def deep_update(base: dict, new: dict) -> dict:
    for k, v in new.items():
        base[k] = deep_update(base.get(k, {}), v) if isinstance(v, dict) and k != "kwargs" else v
    return base


def oracle_records(tasks, seed: int = 0):
    """Rollout records of the noisy oracle on `tasks`, scored by the orders world, tagged as
    lopd-generated so they count toward the training budget."""
    from lopd_cli.envs.orders_agent import scripted_agent_records

    for rec in scripted_agent_records(list(tasks), seed=seed, noise=0.2):
        rec["meta"]["generated_by"] = "lopd"
        yield rec


def build_project(root: Path, overrides: dict | None = None):
    """`lopd init` (orders, tiny) + recipes/toolcall.yaml with FAST (and `overrides`) + a bank of
    24 oracle rollouts, its index and a cold-start composer in runs/coldstart."""
    import copy

    from lopd_cli.bank.index import build_index
    from lopd_cli.bank.store import Bank
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.project import init_project, packaged_recipe
    from lopd_cli.train.coldstart import run_coldstart

    proj = init_project(root, example="orders", model="tiny")
    data = deep_update(yaml.safe_load(packaged_recipe("orders-tiny").read_text()), copy.deepcopy(FAST))
    if overrides:
        data = deep_update(data, overrides)
    (proj.recipes_dir / "toolcall.yaml").write_text(yaml.safe_dump(data))
    recipe = proj.load_recipe("toolcall")
    tasks = OrdersEnv(n_train=40, n_validation=8, n_test=8).tasks("train")[:24]
    with Bank(proj.bank_path(recipe), recipe.bank.min_reward) as bank:
        bank.add_records(list(oracle_records(tasks)), source="oracle")
    build_index(proj, recipe, progress=False)
    run_coldstart(proj, recipe, proj.runs_dir / "coldstart", show_progress=False)
    return proj


def numeric(row: dict) -> dict:
    """A metrics row without timing, throughput and memory readings (they vary run to run)."""
    skip = ("sec_", "tokens_per_s", "peak_memory")
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not k.startswith(skip) and not any(s in k for s in skip)}


def worker_pids(pid: int) -> list[int]:
    """The child processes of `pid` (torchrun's workers live in sessions of their own, so a
    kill of torchrun's group does not reach them: the tests check they end anyway)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def is_alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def kill_torchrun_after_first_checkpoint(cmd: list[str], env: dict, ckdir: Path) -> None:
    """Start `cmd` (a torchrun job), wait until it writes `ckdir/step_1`, then kill the whole job
    with SIGKILL at once: torchrun and its workers (each in a session of its own). Asserts that
    every worker is gone."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 600
    while not (ckdir / "step_1").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    workers = worker_pids(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for w in workers:
        try:
            os.killpg(w, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    end = time.time() + 30
    while any(is_alive(w) for w in workers) and time.time() < end:
        time.sleep(0.1)
    assert workers and not any(is_alive(w) for w in workers)


def train_run(project, name: str, overrides: list[str]):
    """`lopd train --recipe toolcall --set ...` in-process into runs/NAME: (result, metrics rows)."""
    from lopd_cli.train.loop import train
    from lopd_cli.train.metrics import read_metrics

    recipe = project.load_recipe("toolcall", overrides)
    return train(project, recipe, project.runs_dir / name), read_metrics(project.runs_dir / name)
