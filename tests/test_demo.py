"""`lopd demo`: its training runs keep the project's world (so `lopd eval --checkpoint
runs/evolve` works there without --recipe), only its test evaluations score 256 test tasks (the
first 128 of them the environment's usual test split), and every stage runs end to end."""

import json

import pytest

from lopd_cli.cli.eval_cmds import world_mismatch
from lopd_cli.config import load_recipe
from lopd_cli.pipeline.demo import DEMO_OVERRIDES, EVOLVE_OVERRIDES, TEST_OVERRIDES
from lopd_cli.project import packaged_recipe


def test_demo_runs_keep_the_projects_world_and_only_its_test_eval_is_larger(tmp_path):
    import yaml
    from types import SimpleNamespace

    from lopd_cli.agent.runner import make_env_factory

    path = packaged_recipe("orders-tiny")
    project = load_recipe(path, [])
    run = load_recipe(path, DEMO_OVERRIDES + EVOLVE_OVERRIDES)
    assert (run.env.cls, run.env.kwargs, run.reward) == (project.env.cls, project.env.kwargs, project.reward)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json", by_alias=True)))
    assert world_mismatch(SimpleNamespace(run_dir=tmp_path), project) is None

    scored = load_recipe(path, DEMO_OVERRIDES + TEST_OVERRIDES)
    assert scored.eval.n == 256
    usual = [t.id for t in make_env_factory(project)().tasks("test")]
    larger = [t.id for t in make_env_factory(scored)().tasks("test")]
    assert len(usual) == 128 and len(larger) == 256 and larger[:128] == usual


# Every stage with tiny sizes: coldstart, LOPD and each training step once, one evolve round on 4
# tasks, 6 test tasks; the user's --set goes last, so it sizes the test evaluations too.
SMOKE = ["coldstart.steps=1", "coldstart.eval_every=1", "coldstart.val_n=8", "train.steps=1", "train.save_every=1",
         "rollout.rollouts_per_step=4", "rollout.batch_size=4", "rollout.max_new_tokens=32", "evolve.rounds=1",
         "evolve.steps=1", "evolve.tasks_per_round=4", "evolve.val_n=4", "train.sft.batch=4", "eval.n=6"]


@pytest.mark.slow
def test_the_demo_runs_every_stage_and_its_evolve_run_is_scored_without_recipe(tmp_path, lopd):
    from lopd_cli.cli.eval_cmds import check_same_world
    from lopd_cli.models.student import read_checkpoint, resolve_checkpoint
    from lopd_cli.pipeline.demo import run_demo
    from lopd_cli.project import open_project

    lines = []
    res = run_demo(tmp_path / "demo", say=lines.append, overrides=SMOKE, agent_logs=8)
    # The order: base, logs, the check, LOPD's pass, evolve rounds, test, export and report.
    assert [s.name.split()[0] for s in res.stages] == ["init", "evaluate", "your", "the", "LOPD,", "evolve:",
                                                       "evaluate", "export"]
    assert [r["round"] for r in res.rounds] == [0, 1] and res.rounds[1]["method"] == "sft"
    for fig in (res.before, res.lopd, res.sft, res.after):
        assert fig.success.n == 6
    assert res.evolved_vs_sft.n == 6 and any(line.startswith("[6] evolve") for line in lines)
    assert res.report_png.is_file() and (res.export_dir / "config.json").is_file()
    summary = json.loads((res.project / "demo.json").read_text())
    assert summary["after"]["success"]["n"] == 6 and len(summary["stages"]) == 8
    # The runs keep the project's world: eval takes the evolve run with the project's own recipe.
    project = open_project(res.project)
    check_same_world(read_checkpoint(resolve_checkpoint(res.run_dir)), project.load_recipe("toolcall"))
    r = lopd("eval", "-C", res.project, "--checkpoint", res.run_dir, "-n", "2", "--json")
    assert r.code == 0, r
    assert json.loads(r.out)["models"][0]["label"].startswith("evolve incumbent")
