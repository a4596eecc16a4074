"""`lopd evolve` and `lopd rollout --checkpoint`: a round puts the student's episodes in the bank
with provenance, the paired gate keeps a worse student out, the budget stops a run, auto says
why it chose its method, a SIGKILL mid-round then --resume ends where an uninterrupted run
does, bad input is a one-line error, and the gate scores eval.batch_size episodes at a time."""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _train_fixtures import FAST, deep_update, oracle_records
from lopd_cli.results.evaluate import mean_interval
from lopd_cli.pipeline.evolve import _train_tasks_of_round, auto_plan, paired_gate, round_cost

# Small rounds: 3 training tasks × 2 samples, 2 training steps, 3 validation tasks.
SMALL = ["evolve.tasks_per_round=3", "evolve.samples_per_task=2", "evolve.steps=2", "evolve.val_n=3"]


def build_sft_project(root: Path):
    """`lopd init` (orders, random tiny) with the fast recipe and a bank of 24 oracle successes."""
    from lopd_cli.bank.store import Bank
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.project import init_project, packaged_recipe

    proj = init_project(root, example="orders", model="tiny")
    data = deep_update(yaml.safe_load(packaged_recipe("orders-tiny").read_text()), copy.deepcopy(FAST))
    (proj.recipes_dir / "toolcall.yaml").write_text(yaml.safe_dump(data))
    recipe = proj.load_recipe("toolcall")
    with Bank(proj.bank_path(recipe), recipe.bank.min_reward) as bank:
        bank.add_records(list(oracle_records(OrdersEnv(n_train=40, n_validation=8, n_test=8).tasks("train")[:24])),
                         source="oracle")
    return proj


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return build_sft_project(tmp_path_factory.mktemp("evolve") / "template")


def _copy(template, dest: Path):
    from lopd_cli.project import open_project

    shutil.copytree(template.root, dest)
    return open_project(dest)


def _bank_rows(project) -> list[tuple]:
    from lopd_cli.bank.store import Bank

    with Bank(project.bank_path(), create=False) as bank:
        return bank.conn.execute("SELECT id, content_hash, meta FROM rollouts ORDER BY id").fetchall()


# ----------------------------------------------------------------------------- pure parts


def test_paired_gate_accepts_only_a_candidate_not_worse_on_the_same_tasks():
    inc = [True, True, False, True, False, False]
    worse = [True, False, False, False, False, False]
    d = paired_gate(worse, inc)
    assert not d.accepted and d.reason.startswith("rejected")
    ref = mean_interval([-0.0, -1.0, 0.0, -1.0, 0.0, 0.0])
    assert (d.diff.estimate, d.diff.low, d.diff.high) == pytest.approx((ref.estimate, ref.low, ref.high))
    assert d.diff.estimate == pytest.approx(-2 / 6)
    # The same success rate on other tasks is a tie of rates but not of pairs: still judged per task.
    swapped = [False, True, True, True, False, False]
    assert paired_gate(swapped, inc).accepted and paired_gate(swapped, inc).diff.estimate == 0
    better = paired_gate([True] * 6, inc)
    assert better.accepted and better.diff.estimate == pytest.approx(0.5) and "accepted" in better.reason
    with pytest.raises(ValueError):
        paired_gate([True], inc)


def test_auto_plan_and_round_cost():
    assert auto_plan(1, None, None)[0] == ["sft"]
    fail = {"gaps": {"none-learned": {"mean": -0.006, "ci95": [-0.02, 0.01], "n": 8}}}
    methods, line = auto_plan(1, fail, None)
    assert methods == ["sft"] and line.startswith("auto: sft — the check found no teacher advantage") and "-0.006" in line
    ok = {"gaps": {"none-learned": {"mean": 0.05, "ci95": [0.01, 0.09], "n": 8}}}
    assert auto_plan(1, ok, None)[0] == ["sft", "lopd"]
    assert auto_plan(2, ok, "lopd", 1) == (["lopd"], "auto: lopd — it won round 1 on validation")
    assert round_cost(10, ["sft"], 5, 4) == 10
    assert round_cost(10, ["sft", "lopd"], 5, 4) == 30
    assert round_cost(10, ["grpo"], 2, 8) == 26


def test_unsolved_first_draws_the_tasks_the_bank_has_not_solved_before_any_solved_one():
    from types import SimpleNamespace

    from lopd_cli.envs.orders import OrdersEnv

    def factory():
        return OrdersEnv(n_train=20, n_validation=4, n_test=4)

    ids = [t.id for t in factory().tasks("train")]
    solved = frozenset(ids[:14])
    cfg = SimpleNamespace(tasks_per_round=8, samples_per_task=2, seed=3, unsolved_first=True)
    drawn = [t.id for t in _train_tasks_of_round(factory, cfg, 2, solved)]
    assert len(drawn) == 16 and drawn[::2] == drawn[1::2]  # each task twice, in split order
    assert set(ids[14:]) <= set(drawn) and len(set(drawn) & solved) == 2  # all 6 unsolved, then 2 solved
    assert drawn == [t.id for t in _train_tasks_of_round(factory, cfg, 2, solved)]  # seeded
    plain = SimpleNamespace(**{**vars(cfg), "unsolved_first": False})
    assert [t.id for t in _train_tasks_of_round(factory, plain, 2, solved)] == \
        [t.id for t in _train_tasks_of_round(factory, plain, 2)]  # off: the bank does not matter
    everything = SimpleNamespace(**{**vars(cfg), "tasks_per_round": None})
    assert len(_train_tasks_of_round(factory, everything, 2, solved)) == 40


# ----------------------------------------------------------------------------- end to end


def test_round_adds_episodes_with_provenance_budget_stops_and_auto_says_why(template, lopd, tmp_path):
    proj = _copy(template, tmp_path / "p")
    before = len(_bank_rows(proj))
    # One round costs 6 rollouts (SFT spends none while training): a budget of 10 allows one.
    r = lopd("evolve", "-C", proj.root, "--recipe", "toolcall", "--run", "ev", "--rounds", "3",
             *[a for s in SMALL for a in ("--set", s)], "--set", "evolve.rollout_budget=10")
    assert r.code == 0, r
    assert "auto: sft — no before-training check in this project" in r.out
    assert "stopped: evolve.rollout_budget: round 2 would spend 6 rollouts, 6 of 10 are spent" in r.out
    run = proj.runs_dir / "ev"
    rows = [json.loads(x) for x in (run / "rounds.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rows] == [0, 1]
    one = rows[1]
    assert one["method"] == "sft" and one["rollouts"] == 6 and one["rollouts_total"] == 6
    assert one["added"] + one["duplicates"] == 6 and one["bank_size"] == before + one["added"]
    assert one["validation"]["n"] == 3 and set(one["seconds"]) >= {"rollouts", "bank", "train:sft", "validate:sft", "gate"}
    # The bank holds the round's episodes, each saying where it came from.
    mine = [json.loads(m) for _, _, m in _bank_rows(proj) if json.loads(m).get("evolve_run") == "ev"]
    assert len(mine) == one["added"] > 0
    assert all(m["evolve_round"] == 1 and m["generated_by"] == "lopd" and m["checkpoint"] is None
               and m["model"] == "tiny" for m in mine)
    episodes = (run / "rounds" / "r01" / "rollouts.jsonl").read_text().splitlines()
    assert len(episodes) == 6
    # Random tiny never succeeds: the candidate ties the base on every task and is accepted, so
    # the run's incumbent is round 1's student, which eval, export and report read.
    assert one["accepted"] and one["paired_diff"]["mean"] == 0
    state = json.loads((run / "evolve.json").read_text())
    assert (run / "incumbent").resolve() == (run / state["incumbent"]["checkpoint"]).resolve()
    r = lopd("eval", "-C", proj.root, "--recipe", "toolcall", "--checkpoint", run, "-n", "2", "--split", "validation", "--json")
    assert r.code == 0, r
    assert json.loads(r.out)["models"][0]["label"] == "ev incumbent (train-sft/step_2 (sft))"
    r = lopd("export", "-C", proj.root, run, "--merge-lora", "-o", tmp_path / "merged", "--json")
    assert r.code == 0, r
    assert json.loads(r.out)["step"] == 2
    r = lopd("report", "-C", proj.root, run, "-o", tmp_path / "r.png", "--json")
    assert r.code == 0, r
    assert (tmp_path / "r.png").is_file() and json.loads(r.out)["groups"]["ev"]["incumbent_round"] == 1


def _state(run: Path) -> dict | None:
    try:
        return json.loads((run / "evolve.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _weights(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(step_dir / "student" / "adapter_model.safetensors"))


# `lopd ARGS…` that SIGKILLs itself after the first step of round 2's training.
KILL_IN_ROUND_2_TRAINING = """
import os, signal, sys
from pathlib import Path
import lopd_cli.train.loop as loop
from lopd_cli.cli.main import run

real_train = loop.train

def train(project, recipe, run_dir, *a, on_step=None, **kw):
    def step(row):
        if on_step:
            on_step(row)
        if Path(run_dir).parent.name == "r02":
            os.kill(os.getpid(), signal.SIGKILL)
    return real_train(project, recipe, run_dir, *a, on_step=step, **kw)

loop.train = train
run(sys.argv[1:])
"""


@pytest.mark.slow
def test_sigkill_mid_round_then_resume_gives_the_uninterrupted_bank_and_incumbent(template, tmp_path):
    import torch

    from lopd_cli.pipeline.evolve import evolve

    straight, cut = _copy(template, tmp_path / "a"), _copy(template, tmp_path / "b")
    sets = [*SMALL, "evolve.start=incumbent"]
    evolve(straight, "toolcall", sets, run="x", rounds=2, algo="sft", say=lambda s: None)

    env = {**os.environ, "LOPD_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    args = ["evolve", "-C", str(cut.root), "--recipe", "toolcall", "--algo", "sft", "--rounds", "2", "--run", "x"]
    cmd = [sys.executable, "-m", "lopd_cli", *args]
    # The kill lands at a fixed point: SIGKILL after round 2's first training step, when round 2's
    # rollouts are in the bank and its training run is half written. (Killing from here once the
    # state showed round 2's bank stage raced the process: its training takes a second or two, so
    # a late poll killed it after train:sft, or after it had finished.)
    killed = subprocess.run([sys.executable, "-c", KILL_IN_ROUND_2_TRAINING, *args,
                             *[a for s in sets for a in ("--set", s)]],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run = cut.runs_dir / "x"
    st = _state(run)
    assert not st["rounds"][2]["done"] and "train:sft" not in st["rounds"][2]["stages"], "killed mid-round"
    assert "bank" in st["rounds"][2]["stages"] and (run / "rounds" / "r02" / "train-sft").is_dir()
    res = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]

    a, b = _bank_rows(straight), _bank_rows(cut)
    assert [(i, h) for i, h, _ in a] == [(i, h) for i, h, _ in b]
    assert len({h for _, h, _ in b}) == len(b), "no row added twice"
    # Round 2 rolled out round 1's student, and says so.
    r2 = [json.loads(m) for _, _, m in b if json.loads(m).get("evolve_round") == 2]
    assert r2 and all(m["checkpoint"].endswith("rounds/r01/train-sft/checkpoints/step_2") for m in r2)
    rows_a = [json.loads(x) for x in (straight.runs_dir / "x" / "rounds.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (run / "rounds.jsonl").read_text().splitlines()]
    strip = lambda r: {k: v for k, v in r.items() if k not in ("seconds", "time_split")}  # noqa: E731 (wall clock)
    assert [strip(r) for r in rows_a] == [strip(r) for r in rows_b]
    wa, wb = _weights((straight.runs_dir / "x" / "incumbent").resolve()), _weights((run / "incumbent").resolve())
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (run / "incumbent").resolve().parts[-4:] == ("r02", "train-sft", "checkpoints", "step_2")


# ----------------------------------------------------------------------------- a worse student, a trained student


def build_policy_project(root: Path, house_rules: bool = False):
    """`lopd init --example orders --model tiny` (the shipped base policy) in the plain world,
    where it has the skill and succeeds on some tasks (under house rules it rarely does), with
    short episodes, and a bank of 24 oracle successes (of the plain world)."""
    from lopd_cli.bank.store import Bank
    from lopd_cli.envs.orders import OrdersEnv
    from lopd_cli.project.scaffold import create_project

    proj = create_project(root, example="orders", model="tiny")
    data = yaml.safe_load((proj.recipes_dir / "toolcall.yaml").read_text())
    deep_update(data, {"env": {"kwargs": {"n_train": 40, "n_validation": 8, "n_test": 8, "house_rules": house_rules}},
                       "rollout": {"max_new_tokens": 48, "max_turns": 3, "rollouts_per_step": 4, "batch_size": 8},
                       "train": {"micro_batch": 4}})
    (proj.recipes_dir / "toolcall.yaml").write_text(yaml.safe_dump(data))
    recipe = proj.load_recipe("toolcall")
    tasks = OrdersEnv(n_train=40, n_validation=8, n_test=8, house_rules=False).tasks("train")[:24]
    with Bank(proj.bank_path(recipe), recipe.bank.min_reward) as bank:
        bank.add_records(list(oracle_records(tasks)), source="oracle")
    return proj


@pytest.fixture(scope="module")
def rejected(tmp_path_factory):
    """One evolve round on the base policy whose candidate is trained with an absurd lr."""
    from lopd_cli.pipeline.evolve import evolve

    proj = build_policy_project(tmp_path_factory.mktemp("policy") / "p")
    lines: list[str] = []
    res = evolve(proj, "toolcall", ["evolve.tasks_per_round=2", "evolve.samples_per_task=1", "evolve.steps=2",
                                    "evolve.val_n=8", "train.lr=1.0"], run="bad", rounds=1, algo="sft", say=lines.append)
    return proj, res, lines


@pytest.mark.slow
def test_the_gate_rejects_a_worse_student_end_to_end(rejected, lopd):
    proj, res, lines = rejected
    start, one = res.rounds
    assert start["validation"]["mean"] > 0, "the base policy must succeed somewhere for the test to mean anything"
    assert one["validation"]["mean"] < start["validation"]["mean"]
    assert not one["accepted"] and one["reason"].startswith("rejected") and one["paired_diff"]["mean"] < 0
    assert one["incumbent_round"] == 0 and res.incumbent["round"] == 0
    assert any("rejected: worse than the incumbent" in x for x in lines)
    run = proj.runs_dir / "bad"
    assert not (run / "incumbent").exists()
    # The rejected round's experience stays in the bank.
    assert sum(json.loads(m).get("evolve_run") == "bad" for _, _, m in _bank_rows(proj)) == one["added"] > 0
    r = lopd("eval", "-C", proj.root, "--checkpoint", run, "-n", "1")
    assert r.code == 1 and r.err.strip().startswith("error:") and "no round of this evolve run has been accepted" in r.err


@pytest.mark.slow
def test_rollout_checkpoint_rolls_out_the_trained_student(rejected, lopd, tmp_path):
    proj, res, _ = rejected
    ckpt = proj.runs_dir / "bad" / res.rounds[1]["checkpoint"]
    common = ["rollout", "-C", proj.root, "--recipe", "toolcall", "--split", "validation", "-n", "8",
              "--temperature", "0", "--seed", "3", "--json"]
    base = lopd(*common, "-o", tmp_path / "base.jsonl")
    again = lopd(*common, "-o", tmp_path / "again.jsonl")
    student = lopd(*common, "--checkpoint", ckpt, "-o", tmp_path / "student.jsonl")
    assert base.code == again.code == student.code == 0, (base, student)
    b, a, s = (json.loads(x.out)["success_rate"] for x in (base, again, student))
    assert a == b, "same seed, same model: same episodes"
    assert s != b and b > 0
    recs = [json.loads(x) for x in (tmp_path / "student.jsonl").read_text().splitlines()]
    assert all(r["meta"]["checkpoint"] == str(ckpt.resolve()) for r in recs)
    assert all("checkpoint" not in json.loads(x)["meta"] for x in (tmp_path / "base.jsonl").read_text().splitlines())
    r = lopd(*common, "--checkpoint", ckpt, "--model", "tiny")
    assert r.code == 1 and "give --checkpoint or --model, not both" in r.err


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_a_one_line_error(template, lopd, tmp_path):
    proj = _copy(template, tmp_path / "p")
    base = ["evolve", "-C", proj.root, "--recipe", "toolcall"]

    def err(*args) -> str:
        r = lopd(*base, *args)
        assert r.code == 1, r
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.err
        return lines[0]

    assert "--algo 'sfx': choose sft, lopd, opsd, sdpo, grpo or auto" in err("--algo", "sfx")
    assert "evolve.rollout_budget (5) is smaller than one round (6 rollouts)" in err(
        "--run", "b", *[a for s in SMALL for a in ("--set", s)], "--set", "evolve.rollout_budget=5")
    assert "has no validation tasks" in err("--run", "v", "--set", "env.kwargs.n_validation=0")
    assert "evolve.steps: train.steps is 0" in err("--run", "s", "--set", "train.steps=0")
    assert f"--resume: {proj.runs_dir / 'nope'} is not an evolve run" in err("--resume", "--run", "nope")
    assert "--resume: no evolve run in" in err("--resume")
    (proj.runs_dir / "taken").mkdir()
    assert "runs/taken already exists (use --resume to continue it, or another --run)" in err("--run", "taken")
    assert "unknown key 'roundz' in section 'evolve'" in err("--set", "evolve.roundz=2")
    assert not any((proj.runs_dir / n).exists() for n in ("b", "v", "s")), "a refused run leaves no folder"


def test_unsolved_first_rolls_out_only_tasks_the_bank_has_not_solved(template, lopd, tmp_path):
    from lopd_cli.pipeline.evolve import solved_task_ids

    proj = _copy(template, tmp_path / "p")
    solved = solved_task_ids(proj, proj.load_recipe("toolcall"))
    assert len(solved) == 24  # the 24 oracle successes, each of its own training task
    r = lopd("evolve", "-C", proj.root, "--recipe", "toolcall", "--algo", "sft", "--run", "ev", "--rounds", "1",
             *[a for s in SMALL for a in ("--set", s)], "--set", "evolve.unsolved_first=true")
    assert r.code == 0, r
    episodes = [json.loads(x) for x in (proj.runs_dir / "ev" / "rounds" / "r01" / "rollouts.jsonl").read_text().splitlines()]
    assert len(episodes) == 6 and not {e["task_id"] for e in episodes} & solved  # 40 training tasks, 16 unsolved


def test_patience_and_rounds_stop_a_run(template):
    from lopd_cli.agent.runner import make_env_factory
    from lopd_cli.pipeline.evolve import EvolveRun, _load_recipe, _stop_reason

    path = template.recipes_dir / "toolcall.yaml"
    r = _load_recipe(path, [*SMALL, "evolve.patience=2", "evolve.rollout_budget=20"])
    run = EvolveRun(template, r, path, [], template.runs_dir / "none",
                    {"rounds_wanted": 4, "since_rise": 1, "rollouts_total": 8, "algo": "sft"})
    envf = make_env_factory(r)
    assert _stop_reason(run, envf, 2) is None
    run.state["since_rise"] = 2
    assert _stop_reason(run, envf, 3) == "evolve.patience: 2 round(s) without a rise in validation success"
    run.state["since_rise"] = 0
    run.state["rollouts_total"] = 15  # + 6 > 20
    assert _stop_reason(run, envf, 3).startswith("evolve.rollout_budget: round 3 would spend 6 rollouts, 15 of 20")
    assert _stop_reason(run, envf, 5) == "4 round(s) done"


@pytest.mark.slow
def test_the_study_script_runs_end_to_end(template, tmp_path):
    """benchmarks/evolve_study.py in its smallest form: one method, two seeds, a budget of two
    rounds; every round's student scored on test, the table, the JSON and the plot written."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "study"
    cmd = [sys.executable, str(repo / "benchmarks" / "evolve_study.py"), "--project", str(template.root),
           "--out", str(out), "--methods", "sft", "--seeds", "0", "1", "--budget", "12", "-n", "2", "--jobs", "1",
           *(a for s in SMALL for a in ("--set", s))]
    env = {**os.environ, "LOPD_THREADS": "1", "PYTHONPATH": str(repo)}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((out / "study.json").read_text())
    assert [(r["method"], r["seed"]) for r in data["runs"]] == [("sft", 0), ("sft", 1)]
    for run in data["runs"]:  # 6 rollouts a round: two rounds in a budget of 12, each scored on 2 test tasks
        assert [p["rollouts_total"] for p in run["points"]] == [6, 12]
        assert all(p["test"]["n"] == 2 and p["incumbent_test"] is not None for p in run["points"])
        assert "evolve.rollout_budget" in run["stopped"]
    assert {row["vs_sft_pass"]["n"] for row in data["summary"]} == {2}
    assert (out / "study.png").stat().st_size > 0 and "| **sft** | mean ± sd |" in (out / "study.md").read_text()


def test_the_gate_and_training_validation_generate_eval_batch_size_episodes_at_once(template, tmp_path, monkeypatch):
    """eval.batch_size reaches evolve's gate (`_validate`) and `train.eval_every`'s validation;
    rollout.batch_size stays what training samples with."""
    from lopd_cli.pipeline.evolve import EvolveRun, _load_recipe, _validate
    from lopd_cli.rollout.hf import HFBackend
    from lopd_cli.train.loop import build_trainer, validate

    opened: list[int] = []
    open_batch = HFBackend.open_batch
    monkeypatch.setattr(HFBackend, "open_batch", lambda self, n: opened.append(n) or open_batch(self, n))
    path = template.recipes_dir / "toolcall.yaml"
    r = _load_recipe(path, [*SMALL, "rollout.batch_size=1", "rollout.max_new_tokens=8", "eval.batch_size=3"])
    assert r.rollout.batch_size == 1
    run = EvolveRun(template, r, path, [], tmp_path / "ev", {"algo": "sft"})
    gate = _validate(run, None, tmp_path / "ev" / "validation.jsonl", "start")
    assert opened == [3] and len(gate["task_ids"]) == 3  # evolve.val_n=3 in one batch, not three of 1

    opened.clear()
    sets = ["train.algo=grpo", "rollout.batch_size=1", "rollout.max_new_tokens=8", "train.eval_n=4", "eval.batch_size=2"]
    tr = build_trainer(template, template.load_recipe("toolcall", sets), tmp_path / "train", show_progress=False)
    assert validate(tr, 1)["eval/n"] == 4 and opened == [2, 2]
