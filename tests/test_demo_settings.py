"""The demo's settings: its training runs keep the project's world (so `lopd eval --checkpoint
runs/evolve` works there without --recipe), and only its test evaluations score 256 test tasks,
the first 128 of them the environment's usual test split."""

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
