"""`lopd init`: lay out a project and copy the ready recipes, pointed at the project's model."""

from __future__ import annotations

from pathlib import Path

from lopd_cli.errors import LopdError
from lopd_cli.models.registry import BACKBONES
from lopd_cli.project import Project, init_project, packaged_recipes, write_recipe_for_model

EXAMPLES = ("orders", "bfcl", "code")

# Project recipe name -> packaged recipe family. toolcall.yaml and code.yaml are always written.
ALWAYS = {"toolcall": "orders", "code": "code"}


def _family_recipe(family: str, model: str) -> Path | None:
    """The packaged recipe of a world for a model: tiny → `<family>-tiny.yaml`; anything else
    starts from the real-model variant `<family>-smollm2.yaml`."""
    variant = "tiny" if model == "tiny" else "smollm2"
    p = packaged_recipes() / f"{family}-{variant}.yaml"
    return p if p.is_file() else None


def _project_backbone(model: str) -> str:
    """What the project's recipes name as backbone (relative paths resolve from recipes/)."""
    if model in BACKBONES:
        return model
    p = Path(model).expanduser()
    if not p.exists():
        raise LopdError(f"--model '{model}': not an embedded model ({', '.join(BACKBONES)}) nor an existing directory")
    return str(p.resolve())


def create_project(directory: Path, example: str, model: str, force: bool = False, seed: int = 0) -> Project:
    if example not in EXAMPLES:
        raise LopdError(f"--example '{example}': choose one of {', '.join(EXAMPLES)}")
    backbone = _project_backbone(model)
    project = init_project(Path(directory), example=example, model=model, force=force, seed=seed)
    wanted = dict(ALWAYS)
    if example not in wanted.values():
        wanted[example] = example
    for name, family in wanted.items():
        src = _family_recipe(family, model)
        if src is not None:
            write_recipe_for_model(src, project.recipes_dir / f"{name}.yaml", backbone)
    if not (project.recipes_dir / "toolcall.yaml").exists():
        raise LopdError("the packaged orders recipe is missing: reinstall lopd")
    return project
