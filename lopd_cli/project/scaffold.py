"""`lopd init`: lay out a project and copy the ready recipes, pointed at the project's model."""

from __future__ import annotations

from pathlib import Path

from lopd_cli.errors import LopdError
from lopd_cli.models.registry import BACKBONES
from lopd_cli.project import Project, init_project, packaged_recipes, write_recipe_for_model

EXAMPLES = ("orders", "bfcl", "code", "tau-retail")

# Project recipe name -> packaged recipe family. toolcall.yaml and code.yaml are always written.
ALWAYS = {"toolcall": "orders", "code": "code"}
# Worlds with one packaged recipe for every model (tiny's context cannot hold a τ² trajectory, so
# there is no tiny-sized variant), and that become the project's default recipe.
ONE_RECIPE = ("tau-retail",)
TAU_RETAIL_LOGS = "logs/tau-retail-gold.jsonl"


def _family_recipe(family: str, model: str) -> Path | None:
    """The packaged recipe of a world for a model: tiny → `<family>-tiny.yaml`; anything else
    starts from the real-model variant `<family>-smollm2.yaml`."""
    variant = "tiny" if model == "tiny" else "smollm2"
    p = packaged_recipes() / f"{family}-{variant}.yaml"
    if not p.is_file() and family in ONE_RECIPE:
        p = packaged_recipes() / f"{family}-smollm2.yaml"
    return p if p.is_file() else None


def _project_backbone(model: str) -> str:
    """What the project's recipes name as backbone (relative paths resolve from recipes/)."""
    if model in BACKBONES:
        return model
    p = Path(model).expanduser()
    if not p.exists():
        raise LopdError(f"--model '{model}': not an embedded model ({', '.join(BACKBONES)}) nor an existing directory")
    return str(p.resolve())


# Where `lopd init --example orders --model tiny` puts the trained base policy, as the project's
# recipes name it (relative paths resolve from the recipe's folder, recipes/).
BASE_POLICY_DIR = "models/base"
BASE_POLICY_BACKBONE = "../models/base"


def create_project(directory: Path, example: str, model: str, force: bool = False, seed: int = 0,
                   base_policy: bool = True, progress=None) -> Project:
    """Lay out a project. With `--example orders --model tiny` (and `base_policy`), the tiny
    orders base policy (short imitation of a noisy oracle, cached after the first build) is
    copied into models/base and the orders recipe points at it: random tiny weights never
    succeed, and LOPD needs a base model that sometimes does."""
    if example not in EXAMPLES:
        raise LopdError(f"--example '{example}': choose one of {', '.join(EXAMPLES)}")
    backbone = _project_backbone(model)
    project = init_project(Path(directory), example=example, model=model, force=force, seed=seed)
    orders_backbone = backbone
    if base_policy and model == "tiny" and example == "orders":
        from lopd_cli.train.base_policy import install_orders_base_policy

        install_orders_base_policy(project.root / BASE_POLICY_DIR, seed=seed, progress=progress)
        orders_backbone = BASE_POLICY_BACKBONE
    wanted = dict(ALWAYS)
    if example not in wanted.values():
        wanted[example] = example
    for name, family in wanted.items():
        src = _family_recipe(family, model)
        if src is not None:
            chosen = orders_backbone if family == "orders" else backbone
            write_recipe_for_model(src, project.recipes_dir / f"{name}.yaml", chosen)
    if not (project.recipes_dir / "toolcall.yaml").exists():
        raise LopdError("the packaged orders recipe is missing: reinstall lopd")
    if example == "tau-retail":
        _tau_retail_logs(project)
    return project


def _tau_retail_logs(project: Project) -> None:
    """The tau-retail project's default recipe, and its "team's logs": the gold trajectories of
    the 60 train tasks through the MCP server (lopd_cli/envs/tau_retail.py)."""
    import json

    import yaml

    from lopd_cli.config import load_recipe
    from lopd_cli.envs.tau_retail import gold_records
    from lopd_cli.project import PROJECT_FILE

    project.settings.recipe = "tau-retail"
    (project.root / PROJECT_FILE).write_text(yaml.safe_dump(project.settings.model_dump(), sort_keys=False))
    records = gold_records(load_recipe(project.recipes_dir / "tau-retail.yaml"), "train")
    out = project.root / TAU_RETAIL_LOGS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
