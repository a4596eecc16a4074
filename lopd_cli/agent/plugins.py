"""Load user code named in a recipe: `package.module:Name` or `relative/file.py:Name`.

Relative file paths resolve against the recipe's folder, so a project's recipes can sit next to
their environment and reward files.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from lopd_cli.errors import LopdError


def load_object(spec: str, base_dir: Path | None = None, what: str = "plugin") -> Any:
    if ":" not in spec:
        raise LopdError(f"{what} '{spec}': expected 'package.module:Name' or 'file.py:Name'")
    target, _, attr = spec.rpartition(":")
    if not attr or not target:
        raise LopdError(f"{what} '{spec}': expected 'package.module:Name' or 'file.py:Name'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser()
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        path = path.resolve()
        if not path.is_file():
            raise LopdError(f"{what} '{spec}': file {path} does not exist")
        name = "lopd_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        if name in sys.modules:
            module = sys.modules[name]
        else:
            mod_spec = importlib.util.spec_from_file_location(name, path)
            assert mod_spec and mod_spec.loader
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module
            # Let a plugin file import its neighbours.
            sys.path.insert(0, str(path.parent))
            try:
                mod_spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[name]
                raise LopdError(f"{what} '{spec}': importing {path.name} failed: {e.__class__.__name__}: {e}") from e
            finally:
                sys.path.remove(str(path.parent))
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise LopdError(f"{what} '{spec}': module '{target}' not found ({e.name})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise LopdError(f"{what} '{spec}': '{target}' has no attribute '{attr}'") from None


ENV_METHODS = ("tasks", "reset", "step", "reward")


def load_env_class(spec: str, base_dir: Path | None = None) -> type:
    obj = load_object(spec, base_dir, what="env.class")
    if not isinstance(obj, type):
        raise LopdError(f"env.class '{spec}': expected a class, got {type(obj).__name__}")
    missing = [m for m in ENV_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise LopdError(f"env.class '{spec}': not an environment (missing {', '.join(missing)})")
    return checked_env_class(obj, f"env.class '{spec}'")


def checked_env_class(cls: type, source: str) -> type:
    """A subclass of a plugin's environment class that holds its results to the protocol.

    tasks() may return `Task`s or mappings with the same keys (turned into Tasks; the plugin's
    reset() and reward get its own mapping back); a wrong return type of tasks(), reset() or
    step() raises a one-line LopdError naming the plugin, the method, what it returned and what
    is expected. A subclass (not a wrapper) keeps isinstance, class attributes and `name`.
    """
    from lopd_cli.agent.env import check_messages, check_observation, coerce_tasks, plugin_view

    if getattr(cls, "_lopd_checked", False):
        return cls

    def tasks(self, split: str):
        return coerce_tasks(cls.tasks(self, split), split, source)

    def reset(self, task):
        return check_messages(cls.reset(self, plugin_view(task)), source)

    def step(self, call):
        return check_observation(cls.step(self, call), source, call)

    body = {"tasks": tasks, "reset": reset, "step": step, "_lopd_checked": True,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls,), body)


def load_reward_fn(spec: str, base_dir: Path | None = None) -> Callable[..., float]:
    obj = load_object(spec, base_dir, what="reward")
    if not callable(obj):
        raise LopdError(f"reward '{spec}': expected a function score(task, transcript), got {type(obj).__name__}")
    return obj
