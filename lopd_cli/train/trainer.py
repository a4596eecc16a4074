"""A training run's state: what `train.loop` builds and every phase reads (`Trainer`) and the
counters a checkpoint restores (`TrainState`). It sits below the loop and the step modules
(step.py, sft.py, optim.py, sdpo.py), which take a Trainer and import it from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from lopd_cli.config import Recipe
from lopd_cli.project import Project
from lopd_cli.train.metrics import MetricsLog
from lopd_cli.train.precision import model_device, resolve_autocast
from lopd_cli.train.sampler import TaskSampler


@dataclass
class TrainState:
    step: int = 0
    beta: float = 0.0
    rollouts_total: int = 0
    nonfinite_streak: int = 0
    sampler: TaskSampler | None = None


@dataclass
class Trainer:
    """Everything one run holds in memory (one backbone; adapters and composer on top)."""

    project: Project
    recipe: Recipe
    run_dir: Path
    model: Any
    tokenizer: Any
    env_factory: Callable[[], Any]
    reward_fn: Callable | None
    train_tasks: list
    student_opt: torch.optim.Optimizer
    state: TrainState
    retriever: Any = None
    composer: Any = None
    composer_opt: torch.optim.Optimizer | None = None
    composer_sched: Any = None  # the composer's warm-up (LambdaLR over composer_opt)
    health_examples: list | None = None  # held-out bank trajectories for composer health
    latents0: Callable | None = None
    latent_cache: Any = None
    composer_dir: Path | None = None
    embedder_fingerprint: str | None = None
    metrics: MetricsLog | None = None
    on_step: Callable[[dict], None] | None = None
    backbone_path: str = ""
    nograd_latents: Any = None  # step.NoGradLatents: no-grad c_φ per (task, item) while φ is unchanged
    teacher: Any = None  # a full student's frozen teacher copy (`teacher_copy_needed`); None: the teacher is a view of `model`
    ema: Any = None  # ema_teacher.EmaTeacher under train.teacher=ema
    sharding: Any = None  # sharding.Sharding under train.parallel=fsdp
    extra: dict = field(default_factory=dict)

    @property
    def algo(self) -> str:
        return self.recipe.train.algo

    @property
    def autocast(self) -> bool:
        """bf16 autocast for the training passes: `model.autocast_bf16` resolved on the model's device."""
        return resolve_autocast(self.recipe.model.autocast_bf16, model_device(self.model))

    @property
    def trains_composer(self) -> bool:
        return self.algo == "lopd" and not self.recipe.train.lopd.freeze_composer
