"""Retention in `lopd evolve` (evolve.retain): every candidate is also scored on other worlds'
validation tasks, the gate rejects one that forgets beyond evolve.retain_tolerance and keeps one
that does not, and a run killed mid-round keeps the retention scores it had on --resume."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from _train_fixtures import deep_update
from lopd_cli.pipeline.evolve import gate_with_retention, paired_gate, retention_check


def test_retention_check_counts_only_a_drop_against_the_start():
    start = [True, True, True, True, False, False, False, False]
    inc = [True, True, False, False, False, False, False, False]
    rose = retention_check("w", [True] * 8, start, inc, 0.0)
    assert rose.ok and rose.vs_start.estimate == pytest.approx(0.5) and rose.vs_incumbent.estimate == pytest.approx(0.75)
    # 2 of the start's 4 successes lost: −0.25 against the start; the incumbent had already lost them.
    lost = [True, True, False, False, False, False, False, False]
    assert lost == inc
    assert retention_check("w", lost, start, inc, 0.25).ok
    c = retention_check("w", lost, start, inc, 0.2)
    assert not c.ok and c.vs_incumbent.estimate == 0
    with pytest.raises(ValueError):
        retention_check("w", [True], start, inc, 0.1)


def test_the_gate_with_retention_rejects_only_a_candidate_that_forgets():
    target = paired_gate([True, False, True], [False, False, True])
    assert target.accepted
    start, same = [True, True, False, False], [True, True, False, False]
    keeps = gate_with_retention(target, [retention_check("bfcl", same, start, same, 0.05)])
    assert keeps.accepted and "retention kept (bfcl +0.000 vs start)" in keeps.reason
    forgets = gate_with_retention(target, [retention_check("bfcl", [True, False, False, False], start, same, 0.05)])
    assert not forgets.accepted and forgets.reason.startswith("rejected: forgets (bfcl -0.250 vs start")
    assert forgets.diff == target.diff  # the target's paired difference is still what the row reports
    worse = paired_gate([False, False, False], [True, False, True])
    assert not gate_with_retention(worse, [retention_check("bfcl", [True] * 4, start, same, 0.05)]).accepted
    assert gate_with_retention(target, []).reason == target.reason


# ----------------------------------------------------------------------------- end to end (tiny worlds)

ROUND = ["evolve.tasks_per_round=2", "evolve.samples_per_task=1", "evolve.steps=2", "evolve.val_n=8",
         "evolve.retain=[plain]"]


def build_project(root: Path):
    """The shipped tiny base policy; target: the orders world under house rules (it rarely
    succeeds there); retention world: the plain orders world (recipes/plain.yaml), where it does."""
    from test_evolve import build_policy_project

    proj = build_policy_project(root, house_rules=True)
    data = yaml.safe_load((proj.recipes_dir / "toolcall.yaml").read_text())
    deep_update(data, {"name": "plain", "env": {"kwargs": {**data["env"]["kwargs"], "house_rules": False}}})
    (proj.recipes_dir / "plain.yaml").write_text(yaml.safe_dump(data))
    return proj


@pytest.fixture(scope="module")
def forgetful(tmp_path_factory):
    """One SFT round with an absurd learning rate (the candidate forgets the plain world), run
    twice from the same project copy: retain_tolerance 0.05, then 1.0."""
    from lopd_cli.pipeline.evolve import evolve
    from lopd_cli.project import open_project

    base = tmp_path_factory.mktemp("retain")
    template = build_project(base / "template")
    out = {}
    for tol in ("0.05", "1.0"):
        root = base / f"tol{tol}"
        shutil.copytree(template.root, root)
        proj = open_project(root)
        lines: list[str] = []
        res = evolve(proj, "toolcall", [*ROUND, "train.lr=1.0", f"evolve.retain_tolerance={tol}"], run="r",
                     rounds=1, algo="sft", say=lines.append)
        out[tol] = (proj, res, lines)
    return out


@pytest.mark.slow
def test_the_retention_gate_rejects_a_candidate_that_forgets_and_keeps_it_within_tolerance(forgetful):
    proj, res, lines = forgetful["0.05"]
    start, one = res.rounds
    kept0, kept1 = start["retention"]["plain"], one["retention"]["plain"]
    assert kept0["success"]["mean"] > 0.05, "the base policy must succeed in the retention world for this to mean anything"
    assert one["paired_diff"]["mean"] >= 0, "the target alone would accept the candidate"
    assert kept1["vs_start"]["mean"] < -0.05 and not kept1["ok"]
    assert not one["accepted"] and one["reason"].startswith("rejected: forgets (plain")
    assert res.incumbent["round"] == 0
    assert any("retention plain" in x and "rejected: forgets" in x for x in lines)
    assert (proj.runs_dir / "r" / "rounds" / "r01" / "retain-plain-sft.jsonl").is_file()
    # Where the round's time went: every stage's seconds are accounted for, once.
    split = one["time_split"]
    assert set(split) == {"rollouts", "training_steps", "validation", "bank_index", "setup"}
    assert all(v >= 0 for v in split.values()) and split["rollouts"] > 0 and split["training_steps"] > 0
    assert split["setup"] > 0 and split["validation"] > 0
    assert sum(split.values()) == pytest.approx(sum(v for v in one["seconds"].values() if v), abs=0.01)
    # The same candidate (same seeds) with a tolerance it meets is kept.
    _, res2, _ = forgetful["1.0"]
    one2 = res2.rounds[1]
    assert one2["retention"]["plain"]["vs_start"] == kept1["vs_start"] and one2["retention"]["plain"]["ok"]
    assert one2["accepted"] and "retention kept (plain" in one2["reason"] and res2.incumbent["round"] == 1
    # lopd report shows target and retention side by side.
    from lopd_cli.results.report import build_report

    rep = build_report([proj.runs_dir / "r"])
    col = rep.header.index("retention: success, vs start")
    assert rep.rows[1][col].endswith("forgets") and rep.rows[0][col].startswith("plain ")
    assert any(k.endswith("/retain/plain") for k in rep.series)


class Killed(Exception):
    pass


@pytest.mark.slow
def test_resume_after_a_kill_keeps_the_retention_scores(tmp_path, monkeypatch):
    from lopd_cli.pipeline import evolve as ev

    proj = build_project(tmp_path / "p")
    real_gate = ev.gate_with_retention

    def killed_gate(*a, **kw):
        raise Killed("killed before the gate")

    monkeypatch.setattr(ev, "gate_with_retention", killed_gate)
    with pytest.raises(Killed):
        ev.evolve(proj, "toolcall", ROUND, run="k", rounds=1, algo="sft", say=lambda s: None)
    run = proj.runs_dir / "k"
    state = json.loads((run / "evolve.json").read_text())
    stages = state["rounds"][1]["stages"]
    assert "retain:sft:plain" in stages and "gate" not in stages
    files = {p: p.stat().st_mtime_ns for p in (run / "rounds").rglob("retain-*.jsonl")}
    assert len(files) == 2
    monkeypatch.setattr(ev, "gate_with_retention", real_gate)
    res = ev.evolve(proj, resume=True, run="k", say=lambda s: None)
    after = json.loads((run / "evolve.json").read_text())
    assert after["rounds"][0]["stages"]["retain:start:plain"] == state["rounds"][0]["stages"]["retain:start:plain"]
    assert after["rounds"][1]["stages"]["retain:sft:plain"] == stages["retain:sft:plain"]  # not re-scored
    assert {p: p.stat().st_mtime_ns for p in files} == files
    rows = [json.loads(x) for x in (run / "rounds.jsonl").read_text().splitlines()]
    assert rows[1]["retention"]["plain"]["success"] == stages["retain:sft:plain"]["success"]
    assert rows[1]["retention"]["plain"]["vs_start"] == res.rounds[1]["retention"]["plain"]["vs_start"]


def test_a_retention_world_without_the_targets_backbone_is_a_one_line_error(tmp_path, lopd):
    from lopd_cli.project.scaffold import create_project

    proj = create_project(tmp_path / "p", example="orders", model="tiny")
    data = yaml.safe_load((proj.recipes_dir / "toolcall.yaml").read_text())
    data["model"]["backbone"] = "smollm2-135m-instruct"
    (proj.recipes_dir / "other.yaml").write_text(yaml.safe_dump(data))
    r = lopd("evolve", "-C", proj.root, "--set", "evolve.retain=[other]")
    assert r.code != 0 and r.err.strip().count("\n") == 0
    assert "evolve.retain" in r.err and "other.yaml" in r.err and "backbone" in r.err
    r = lopd("evolve", "-C", proj.root, "--set", "evolve.retain=[missing]")
    assert r.code != 0 and "recipe 'missing' not found" in r.err
    assert not list(proj.runs_dir.glob("*/evolve.json"))
