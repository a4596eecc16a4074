"""`lopd train --algo sft`: rejection-sampling fine-tuning on the bank's successes, in the same
loop: the loss is the NLL of the action tokens, only rows at the success threshold are used, the
bank's rollouts count toward the budget, resume and torchrun give the metrics of one straight
run, and `lopd report` reads its runs."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from _train_fixtures import FAST, deep_update, numeric, oracle_records
from lopd_cli.errors import LopdError
from lopd_cli.train.metrics import read_metrics

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def build_sft_project(root: Path):
    """`lopd init` (orders, tiny) with the fast recipe and a bank of 24 oracle successes plus two
    rows below the success threshold (0.9 and 0.3: partial successes). No
    index or composer: SFT needs neither."""
    from lopd_cli.bank.store import Bank
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.project import init_project, packaged_recipe

    proj = init_project(root, example="orders", model="tiny")
    data = deep_update(yaml.safe_load(packaged_recipe("orders-tiny").read_text()), copy.deepcopy(FAST))
    (proj.recipes_dir / "toolcall.yaml").write_text(yaml.safe_dump(data))
    recipe = proj.load_recipe("toolcall")
    tasks = OrdersEnv(n_train=40, n_validation=8, n_test=8).tasks("train")[:26]
    recs = list(oracle_records(tasks))
    for rec, reward in zip(recs[24:], (0.9, 0.3)):
        rec["reward"] = reward
        rec["messages"][-1]["content"] = f"PARTIAL {reward}: " + str(rec["messages"][-1].get("content") or "")
    with Bank(proj.bank_path(recipe), recipe.bank.min_reward) as bank:
        bank.add_records(recs, source="oracle")
    return proj


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return build_sft_project(tmp_path_factory.mktemp("sft"))


def _bank_items(project):
    from lopd_cli.bank.store import Bank

    with Bank(project.bank_path(), create=False) as bank:
        return {it.id: it for it in bank.iter_items(success_only=False)}


def _train(project, name: str, overrides: list[str]):
    from lopd_cli.train.loop import train

    recipe = project.load_recipe("toolcall", ["train.algo=sft", *overrides])
    return train(project, recipe, project.runs_dir / name), read_metrics(project.runs_dir / name)


def _nll(model, tokenizer, items) -> float:
    """Token-mean NLL of the items' assistant tokens, from full logits (no chunking, no batching)."""
    from lopd_cli.agent.chat import tokenize_transcript

    total, n = 0.0, 0
    for it in items:
        ids, mask = tokenize_transcript(tokenizer, it.messages, it.tools)
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=x).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]
        m = torch.tensor(mask[1:], dtype=torch.bool)
        total += float(-lp[m].sum())
        n += int(m.sum())
    return total / n


def test_sft_lowers_the_nll_of_bank_successes(project):
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.models.student import load_student, read_checkpoint, resolve_checkpoint
    from lopd_cli.train.sampler import TaskSampler

    tr, rows = _train(project, "sft-a", ["train.steps=4", "train.micro_batch=3", "train.logit_chunk=16"])
    items = _bank_items(project)
    pool = [items[i] for i in tr.extra["sft_ids"]]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the bank's 26 lopd-generated rollouts are the budget SFT spent; training spends none
    assert [r["rollouts_total"] for r in rows] == [26] * 4
    for key in ("loss", "update_tokens", "sec_step", "peak_memory_mb", "grad_norm_student"):
        assert rows[-1][key] is not None, key
    assert "reward" not in rows[-1], "SFT rolls nothing out"

    base, tok = load_backbone("tiny", device="cpu")
    # Step 1's loss is the token-mean NLL of the sampled batch under the initial student (the
    # backbone: a fresh LoRA adds nothing), computed here without chunks or micro-batches.
    first = [pool[i] for i in TaskSampler(len(pool), 0).take(4)]
    assert rows[0]["loss"] == pytest.approx(_nll(base, tok, first), rel=1e-4)
    assert rows[0]["update_tokens"] > 0

    student, _ = load_student(read_checkpoint(resolve_checkpoint(project.runs_dir / "sft-a")), device="cpu")
    before, after = _nll(base, tok, pool), _nll(student, tok, pool)
    assert after < before - 0.2, (before, after)


def test_only_rows_at_the_success_threshold_are_used(project):
    items = _bank_items(project)
    tr, _ = _train(project, "sft-threshold", ["train.steps=1"])
    used = set(tr.extra["sft_ids"])
    assert used == {i for i, it in items.items() if it.reward >= 1.0} and len(used) == 24
    tr, _ = _train(project, "sft-threshold-09", ["train.steps=1", "eval.success_threshold=0.85"])
    assert set(tr.extra["sft_ids"]) == used | {i for i, it in items.items() if it.reward == 0.9}


def test_resume_equals_uninterrupted_even_after_the_bank_grows(project):
    from lopd_cli.bank.store import Bank
    from lopd_cli.envs.orders import OrdersEnv

    _, straight = _train(project, "sft-straight", ["train.steps=4", "train.save_every=2"])
    _, _ = _train(project, "sft-cut", ["train.steps=2", "train.save_every=2"])
    # Another run adds successes meanwhile: the resumed run keeps the pool it started with.
    extra = OrdersEnv(n_train=40, n_validation=8, n_test=8).tasks("train")[30:34]
    with Bank(project.bank_path(), create=False) as bank:
        assert bank.add_records(list(oracle_records(extra, seed=7)), source="later").added == 4
    from lopd_cli.train.loop import train

    recipe = project.load_recipe("toolcall", ["train.algo=sft", "train.steps=4", "train.save_every=2"])
    train(project, recipe, project.runs_dir / "sft-cut", resume=True)
    resumed = read_metrics(project.runs_dir / "sft-cut")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        na, nb = numeric(a), numeric(b)
        assert na.keys() == nb.keys()
        for k in na:
            assert nb[k] == pytest.approx(na[k], abs=1e-6, rel=1e-6), (a["step"], k)


def test_cli_sft_run_and_report(project, lopd, tmp_path):
    r = lopd("train", "-C", project.root, "--recipe", "toolcall", "--algo", "sft", "--run", "sft-cli",
             "--set", "train.steps=2", "--set", "train.eval_every=2", "--set", "train.eval_n=2", "--json")
    assert r.code == 0, r
    summary = json.loads(r.out)
    assert summary["algo"] == "sft" and summary["steps"] == 2
    last = summary["last"]
    assert last["eval/n"] == 2 and 0.0 <= last["eval/success"] <= 1.0
    ckpt = project.runs_dir / "sft-cli" / "checkpoints" / "latest"
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    assert meta["algo"] == "sft" and (ckpt / "student" / "adapter_model.safetensors").is_file()

    r = lopd("report", "-C", project.root, project.runs_dir / "sft-cli", "-o", tmp_path / "r.png", "--json")
    assert r.code == 0, r
    assert (tmp_path / "r.png").is_file()
    groups = json.loads(r.out)["groups"]
    assert [g for g in groups if g.endswith("sft")], groups


def test_errors_are_one_line(project, lopd, tmp_path):
    r = lopd("train", "-C", project.root, "--recipe", "toolcall", "--algo", "sfx", "--run", "bad")
    assert r.code == 1 and r.err.strip().startswith("error: --algo 'sfx'") and "sft" in r.err
    from lopd_cli.bank.store import Bank

    Bank(project.path("empty.sqlite")).close()
    with pytest.raises(LopdError, match=r"no rollout with reward >= eval.success_threshold \(1\)"):
        _train(project, "sft-none", ["train.steps=1", "bank.path=empty.sqlite"])
    with pytest.raises(LopdError, match=r"--algo sft: no bank at"):
        _train(project, "sft-nobank", ["train.steps=1", "bank.path=nothing.sqlite"])


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(project):
    env = {**os.environ, "LOPD_THREADS": "1", "OMP_NUM_THREADS": "1"}
    sets = ["--set", "train.algo=sft", "--set", "train.steps=3", "--set", "train.micro_batch=1",
            "--set", "train.sft.batch=5", "--set", "train.save_every=1"]
    base = ["-m", "lopd_cli", "train", "-C", str(project.root), "--recipe", "toolcall", *sets, "--json"]
    for cmd in ([sys.executable, *base, "--run", "sft-one"],
                [TORCHRUN, "--standalone", "--nproc_per_node", "2", *base, "--run-name", "sft-two"]):
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
    one, two = read_metrics(project.runs_dir / "sft-one"), read_metrics(project.runs_dir / "sft-two")
    assert [r["step"] for r in two] == [1, 2, 3], "rank 0 alone writes metrics"
    for a, b in zip(one, two):
        na, nb = numeric(a), numeric(b)
        assert na.keys() == nb.keys()
        for k in na:
            if na[k] is None:
                assert nb[k] is None, k
            else:
                assert nb[k] == pytest.approx(na[k], abs=1e-4), (a["step"], k)
    latest = project.runs_dir / "sft-two" / "checkpoints" / "latest"
    assert json.loads((latest / "checkpoint.json").read_text())["world_size"] == 2


def test_the_pool_leaves_out_the_environments_validation_tasks(tmp_path):
    """Bank successes of validation tasks (the demo imports logs of them for the check) are held
    out of SFT as of the cold start: a validation figure must not score tasks the student
    trained on. The run's pool is the training tasks' successes only."""
    from lopd_cli.agent.runner import make_env_factory
    from lopd_cli.bank.store import Bank
    from lopd_cli.train.coldstart import validation_task_ids
    from lopd_cli.train.sft import eligible_ids

    proj = build_sft_project(tmp_path / "p")
    recipe = proj.load_recipe("toolcall", ["train.algo=sft"])
    env = make_env_factory(recipe)()
    val_tasks = env.tasks("validation")[:2]
    with Bank(proj.bank_path(recipe), recipe.bank.min_reward) as bank:
        bank.add_records(list(oracle_records(val_tasks)), source="oracle")
    items = _bank_items(proj)
    val_rows = {i for i, it in items.items() if it.task_id in {t.id for t in val_tasks}}
    assert len(val_rows) == 2
    everything = eligible_ids(proj, recipe)
    held = eligible_ids(proj, recipe, validation_task_ids(env))
    assert val_rows <= set(everything) and not val_rows & set(held) and len(held) == len(everything) - 2
    _, rows = _train(proj, "pool", ["train.steps=1", "train.save_every=1"])
    assert rows[-1]["sft_pool"] == len(held) == 24
