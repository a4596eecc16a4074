"""The project directory: `lopd.yaml` at its root, like a git repository.

    lopd.yaml  recipes/  bank.sqlite  index/  runs/RUN/  models/
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from lopd_cli.config import Recipe, load_recipe
from lopd_cli.errors import LopdError

PROJECT_FILE = "lopd.yaml"


class ProjectSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    recipe: str = "toolcall"
    model: str = "tiny"
    seed: int = 0
    example: str = "orders"


@dataclass(frozen=True)
class Project:
    root: Path
    settings: ProjectSettings

    @property
    def recipes_dir(self) -> Path:
        return self.root / "recipes"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    def path(self, rel: str) -> Path:
        p = Path(rel).expanduser()
        return p if p.is_absolute() else self.root / p

    def bank_path(self, recipe: Recipe | None = None) -> Path:
        return self.path(recipe.bank.path if recipe else "bank.sqlite")

    def index_dir(self, recipe: Recipe | None = None) -> Path:
        return self.path(recipe.bank.index_dir if recipe else "index")

    def recipe_path(self, name: str | None) -> Path:
        return find_recipe(name or self.settings.recipe, self)

    def load_recipe(self, name: str | None, overrides: list[str] | None = None) -> Recipe:
        return load_recipe(self.recipe_path(name), overrides)

    def new_run_dir(self, name: str | None, prefix: str) -> Path:
        if not name:
            name = f"{prefix}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise LopdError(f"--run '{name}': use letters, digits, '.', '_' or '-'")
        return self.runs_dir / name


def find_project_root(start: Path | None = None) -> Path | None:
    cur = (start or Path.cwd()).resolve()
    for d in [cur, *cur.parents]:
        if (d / PROJECT_FILE).is_file():
            return d
    return None


def open_project(project_dir: Path | None = None, required: bool = True) -> Project | None:
    root = (project_dir.resolve() if project_dir else find_project_root())
    if root is None or not (root / PROJECT_FILE).is_file():
        if not required:
            return None
        where = f"{project_dir}" if project_dir else f"{Path.cwd()} or any folder above it"
        raise LopdError(f"no {PROJECT_FILE} in {where} (run `lopd init DIR` or pass -C DIR)")
    path = root / PROJECT_FILE
    try:
        data = yaml.safe_load(path.read_text()) or {}
        settings = ProjectSettings.model_validate(data)
    except yaml.YAMLError as e:
        raise LopdError(f"{path}: not valid YAML ({e})") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise LopdError(f"{path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return Project(root, settings)


def find_recipe(name: str, project: Project | None) -> Path:
    """A path, or a name in the project's recipes/: `toolcall`, `toolcall.yaml` and
    `recipes/toolcall.yaml` all work from the project folder."""
    cands = [Path(name)]
    if project is not None:
        stem = Path(name)
        cands += [project.root / stem, project.recipes_dir / stem.name]
        if stem.suffix not in (".yaml", ".yml"):
            cands += [project.recipes_dir / f"{stem.name}.yaml", project.recipes_dir / f"{stem.name}.yml"]
    for c in cands:
        if c.is_file():
            return c.resolve()
    known = sorted(p.stem for p in project.recipes_dir.glob("*.yaml")) if project else []
    hint = f" (project recipes: {', '.join(known)})" if known else ""
    shipped = packaged_recipes() / f"{Path(name).stem}.yaml"
    if shipped.is_file():  # recipes are the project's editable copies, so say how to get one
        hint += f"; lopd ships it: cp {shipped} {project.recipes_dir if project else '.'}/"
    raise LopdError(f"recipe '{name}' not found{hint}")


def packaged_recipes() -> Path:
    return Path(str(resources.files("lopd_cli") / "recipes"))


def packaged_recipe(name: str) -> Path:
    p = packaged_recipes() / f"{name}.yaml"
    if not p.is_file():
        raise LopdError(f"no packaged recipe '{name}'")
    return p


def write_recipe_for_model(src: Path, dst: Path, backbone: str) -> None:
    """Copy a packaged recipe, pointing `model.backbone` at the project's model. The header
    comments (how to run it) are kept."""
    text = src.read_text()
    text, n = re.subn(r"(?m)^(  backbone:\s*).*$", lambda m: f"{m.group(1)}{backbone}", text, count=1)
    if n == 0:
        raise LopdError(f"packaged recipe {src.name} has no model.backbone line")
    dst.write_text(text)


def init_project(root: Path, example: str, model: str, force: bool = False, seed: int = 0) -> Project:
    root = root.resolve()
    if (root / PROJECT_FILE).exists() and not force:
        raise LopdError(f"{root} already holds a lopd project (use --force to overwrite its recipes and settings)")
    for sub in ("recipes", "runs", "models", "index"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    settings = ProjectSettings(name=root.name, recipe="toolcall", model=model, seed=seed, example=example)
    (root / PROJECT_FILE).write_text(yaml.safe_dump(settings.model_dump(), sort_keys=False))
    return Project(root, settings)
