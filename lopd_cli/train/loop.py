"""`lopd train`: the main job. One loop for LOPD and its baselines (GRPO, OPSD, SFT).

Each step:
    1. rollouts: the student (backbone + student adapter), no latents, on training tasks;
    2–4. LOPD / OPSD: teacher pass, student reverse-KL update, composer update and, after the
         optimiser steps, the dual step on β (train/step.py);
         GRPO: group-normalised clipped policy gradient (train/grpo.py);
         SDPO: the model reprompted with a successful sibling (or feedback) as teacher (train/sdpo.py);
    (SFT has no rollouts: one NLL step on successful bank items, train/sft.py;)
    then bank growth (`bank.grow`), metrics, periodic validation and checkpoints.

Every rollout counts toward `rollouts_total`, including those spent before training (bank
filling, cold start: `train.prior_rollouts`), so methods compare at equal budget. Checkpoints
hold everything needed for an exact resume: adapters, composer, optimiser states, β, RNG
states, the task sampler's position and the counters. `train.init_from` starts the student from
another run's (student.py `warm_start`); the optimisers start fresh. With `train.teacher: init`
that student, merged, becomes the run's backbone and so its teacher (`init_teacher_backbone`).
A full student's teacher ("base", "init") is a frozen copy of the weights it starts from
(`Trainer.teacher`); `train.teacher: live` makes the student its own teacher, and `ema` a moving
average of it (train/ema_teacher.py).

Under torchrun / accelerate launch each rank rolls out its share of the step's tasks and the
gradients are summed over ranks (train/distributed.py); in one process every helper there is
the identity. `train.parallel: fsdp` shards the backbone with FSDP2 (train/sharding.py): rollouts
run on gathered weights, the update per layer (`train.fsdp_gather`), and the checkpoints hold
the optimiser states sharded.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch

from lopd_cli.agent.metrics import summarize
from lopd_cli.agent.runner import load_reward, make_env_factory, run_episodes, select_tasks
from lopd_cli.agent.types import Episode
from lopd_cli.config import Recipe
from lopd_cli.errors import LopdError
from lopd_cli.models import adapters as ad
from lopd_cli.models.backbone import load_backbone, resolve_backbone
from lopd_cli.project import Project
from lopd_cli.runtime import seed_everything, warn_if_slow_bf16
from lopd_cli.train import checkpoint as ckpt
from lopd_cli.train import distributed as dist
from lopd_cli.train import sharding
from lopd_cli.train.batch import BatchTotals, batch_totals
from lopd_cli.train.grpo import GrpoSetup, grpo_update
from lopd_cli.train.metrics import MetricsLog, peak_memory_mb
from lopd_cli.train.optim import _grad_norm, _student_params, _sum_gradients, adamw
from lopd_cli.train.precision import model_device, resolve_autocast
from lopd_cli.train.sampler import TaskSampler
from lopd_cli.train.step import NoGradLatents, dual_step, rollout_phase, step_metrics, trainer_step
from lopd_cli.train.trainer import Trainer, TrainState


# The algorithms whose loss is distillation from a teacher (train.teacher applies).
DISTILLS = ("lopd", "opsd", "sdpo", "distill")

# ----------------------------------------------------------------------------- set-up


def find_composer(project: Project, recipe: Recipe) -> Path:
    """`train.lopd.composer_from`, else the newest composer `lopd coldstart` saved in the project."""
    from lopd_cli.compose.composer import MANIFEST

    if recipe.train.lopd.composer_from:
        p = project.path(recipe.train.lopd.composer_from)
        for cand in (p, p / "composer"):
            if (cand / MANIFEST).is_file():
                return cand
        raise LopdError(f"train.lopd.composer_from: no composer in {p} ({MANIFEST} missing)")
    found = sorted(project.runs_dir.glob(f"*/composer/{MANIFEST}"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise LopdError(
            "no cold-start composer in this project: run `lopd coldstart --recipe R` first "
            "(or set train.lopd.composer_from)"
        )
    return found[-1].parent


def lopd_generated_rollouts(project: Project, recipe: Recipe) -> int:
    """Rollouts lopd generated into the bank (bank filling): they count toward the budget."""
    from lopd_cli.bank.store import Bank

    path = project.bank_path(recipe)
    if not path.exists():
        return 0
    with Bank(path, recipe.bank.min_reward, create=False) as bank:
        return sum(1 for it in bank.iter_items(success_only=False) if it.meta.get("generated_by") == "lopd")


def contrastive_chunk_warning(t) -> str | None:
    """The one-line warning when the composer pass's chunks are smaller than micro_batch and the
    contrastive term is on: its pairs form within a chunk, so smaller chunks form fewer pairs."""
    chunk = min(t.lopd.composer_micro_batch, t.micro_batch)
    if t.algo != "lopd" or t.lopd.freeze_composer or t.lopd.contrastive_weight <= 0 or chunk >= t.micro_batch:
        return None
    return (f"train.lopd.contrastive_weight > 0 pairs successes only within a composer chunk of "
            f"train.lopd.composer_micro_batch={chunk} rows" + (" (none at 1)" if chunk == 1 else "")
            + f"; set train.lopd.composer_micro_batch={t.micro_batch} to pair within micro_batch as before")


def build_trainer(project: Project, recipe: Recipe, run_dir: Path, show_progress: bool = True) -> Trainer:
    t = recipe.train
    if (msg := contrastive_chunk_warning(t)) is not None:
        import warnings

        from lopd_cli.errors import LopdWarning

        warnings.warn(msg, LopdWarning, stacklevel=2)
    seed_everything(t.seed)
    if t.teacher == "ema" and t.parallel == "fsdp" and dist.is_distributed():
        raise LopdError("train.teacher=ema: not available under train.parallel=fsdp yet (use ddp)")
    search = [recipe.base_dir, project.root]
    backbone = str(init_teacher_backbone(project, recipe, run_dir)) if t.teacher == "init" else recipe.model.backbone
    model, tok = load_backbone(backbone, recipe.model.dtype, recipe.model.device, search)
    if resolve_autocast(recipe.model.autocast_bf16, model_device(model)):
        warn_if_slow_bf16("model.autocast_bf16=true", model_device(model))
    model = ad.attach_adapters(model, recipe)
    if t.teacher == "ema" and recipe.model.student == "lora":
        from lopd_cli.train.ema_teacher import add_teacher_adapter

        add_teacher_adapter(model, recipe.model.lora)
    trainable = [ad.BASE if recipe.model.student == "full" else ad.STUDENT]
    if t.algo == "lopd" and not t.lopd.freeze_composer:
        trainable.append(ad.ENCODER)
    ad.set_trainable(model, trainable)
    env_factory = make_env_factory(recipe)
    tasks = select_tasks(env_factory, "train", None)
    student_opt = adamw(_student_params(model), lr=t.lr)
    tr = Trainer(
        project=project, recipe=recipe, run_dir=run_dir, model=model, tokenizer=tok,
        env_factory=env_factory, reward_fn=load_reward(recipe), train_tasks=tasks,
        student_opt=student_opt, state=TrainState(beta=t.lopd.beta0, sampler=TaskSampler(len(tasks), t.seed)),
        backbone_path=str(Path(resolve_backbone(backbone, search)).resolve()),
    )
    if t.algo in ("lopd", "opsd"):  # the methods whose teacher sees retrieved experience
        from lopd_cli.bank.retrieve import Retriever

        tr.retriever = Retriever.open(project, recipe)
        tr.embedder_fingerprint = _embedder_fp(tr.retriever)
    if t.algo == "lopd":
        _setup_composer(tr)
    if t.algo == "sft":
        from lopd_cli.train import sft

        sft.setup(tr)
    prior = t.prior_rollouts
    if prior is None:
        prior = lopd_generated_rollouts(project, recipe) if t.algo in ("lopd", "opsd", "sft") else 0
    tr.state.rollouts_total = prior
    if t.teacher_from and t.algo in DISTILLS:
        rng = ckpt.rng_state()
        tr.teacher = load_teacher_from(project, recipe)
        ckpt.set_rng_state(rng)
    elif teacher_copy_needed(recipe):
        rng = ckpt.rng_state()  # loading the copy must not shift what the run samples
        tr.teacher = load_teacher_copy(backbone, recipe, search)
        ckpt.set_rng_state(rng)
    if t.teacher == "ema" and t.algo in DISTILLS:
        from lopd_cli.train import ema_teacher

        pairs = (ema_teacher.full_pairs(tr.teacher, model) if recipe.model.student == "full"
                 else ema_teacher.lora_pairs(model))
        tr.ema = ema_teacher.EmaTeacher(pairs, t.teacher_ema_rate)
        tr.ema.reset()
    apply_activation_checkpointing(tr)
    return tr


def apply_activation_checkpointing(tr: Trainer) -> None:
    """`train.activation_checkpointing`: checkpoint the decoder layers of the backbone and of a
    full student's teacher copy (its composer pass keeps a graph too). Call it after every adapter
    is attached (the anchor's encoder0 too): the recompute replays them."""
    if not tr.recipe.train.activation_checkpointing:
        return
    from lopd_cli.models.activation_checkpointing import enable_activation_checkpointing

    enable_activation_checkpointing(tr.model)
    if tr.teacher is not None:
        enable_activation_checkpointing(tr.teacher)
        # transformers recomputes a layer only in training mode; the copy is only read in training
        # steps (a LoRA student's teacher, the same model, is in training mode there too)
        tr.teacher.train()


def teacher_copy_needed(recipe: Recipe) -> bool:
    """A full student's LOPD/OPSD teacher ("base", "init") is a frozen copy of the weights the
    student starts from: the student's own base weights move with every step ("live")."""
    return recipe.model.student == "full" and recipe.train.algo in DISTILLS and recipe.train.teacher != "live"


def load_teacher_copy(backbone: str, recipe: Recipe, search: list) -> Any:
    """The frozen teacher copy: the run's backbone (the recipe's, or the merged warm start of
    `train.teacher: init`) loaded once more, without adapters or gradients."""
    model, _ = load_backbone(backbone, recipe.model.dtype, recipe.model.device, search)
    model.requires_grad_(False)
    model.eval()
    return frozen_teacher_dtype(model, recipe)


def frozen_teacher_dtype(model: Any, recipe: Recipe) -> Any:
    """`train.teacher_dtype`: a frozen teacher copy is only read, so it can be held in bf16 (half
    the memory of fp32 weights) where the passes run in bf16 anyway. An EMA teacher keeps the
    model's dtype: its small steps would round away."""
    want = recipe.train.teacher_dtype
    if want == "auto":
        from lopd_cli.train.precision import device_has_fast_bf16, model_device

        want = "bfloat16" if device_has_fast_bf16(model_device(model)) else None
    if want is None or recipe.train.teacher == "ema":
        return model
    return model.to(getattr(torch, want))


def load_teacher_from(project: Project, recipe: Recipe) -> Any:
    """`train.teacher_from`: that checkpoint's student (a LoRA one merged), frozen, as the teacher
    copy; the student, whatever it starts from, is trained beside it (evolve's recovery phase:
    the starting model teaches the round's candidate)."""
    from lopd_cli.models.backbone import resolve_backbone
    from lopd_cli.models.student import check_init_backbone, load_student, resolve_init_from

    spec = recipe.train.teacher_from
    if recipe.train.teacher != "base":
        raise LopdError(f"train.teacher_from: {spec} is the teacher; train.teacher={recipe.train.teacher} "
                        "names another (leave it at base)")
    info = resolve_init_from(spec, project.root)
    search = [recipe.base_dir, project.root]
    check_init_backbone(info, spec, recipe.model.backbone, str(resolve_backbone(recipe.model.backbone, search)))
    model, _ = load_student(info, recipe.model.dtype, recipe.model.device, search)
    if ad.is_wrapped(model):
        model = model.merge_and_unload()
    model.requires_grad_(False)
    model.eval()
    return frozen_teacher_dtype(model, recipe)


def init_teacher_backbone(project: Project, recipe: Recipe, run_dir: Path) -> Path:
    """`train.teacher: init`: the run's own backbone folder, `init_from`'s student merged (made
    by rank 0 on the run's first start; a resume reuses it without looking at the source)."""
    from lopd_cli.models.student import existing_init_backbone, init_source
    from lopd_cli.train.init_backbone import merged_init_backbone

    found = existing_init_backbone(run_dir)
    if found is not None:
        return found
    info = init_source(project, recipe)
    search = [recipe.base_dir, project.root]
    return dist.on_main(lambda: merged_init_backbone(info, Path(run_dir), recipe.model.dtype, search))


def _embedder_fp(retriever) -> str | None:
    fp = getattr(retriever.index, "fingerprint", None)
    return str(fp.get("embedder")) if isinstance(fp, dict) else None


def _setup_composer(tr: Trainer) -> None:
    from lopd_cli.compose.composer import Composer
    from lopd_cli.compose.latent_cache import LatentCache

    recipe = tr.recipe
    tr.composer_dir = find_composer(tr.project, recipe)
    tr.composer = Composer.load(tr.composer_dir, tr.model, tr.tokenizer, recipe.composer)
    tr.nograd_latents = NoGradLatents()
    if recipe.train.lopd.freeze_composer:
        tr.composer.requires_grad_(False)
    else:
        from lopd_cli.train.coldstart import composer_optimizer

        t = recipe.train
        tr.composer_opt, tr.composer_sched = composer_optimizer(
            tr.model, tr.composer, t.lopd.composer_lr_encoder or t.lopd.composer_lr, t.lopd.composer_lr_resampler or t.lopd.composer_lr,
            t.lopd.composer_warmup_steps, weight_decay=0.01)
    if recipe.train.lopd.anchor_lambda > 0 and not recipe.train.lopd.freeze_composer:
        composer0 = Composer.load(tr.composer_dir, tr.model, tr.tokenizer, recipe.composer,
                                  adapter="encoder0", frozen=True)
        tr.latent_cache = LatentCache.load(tr.composer_dir)

        def latents0(instrs: list[str], refs: list[list]) -> torch.Tensor:
            return tr.latent_cache.get_or_fill(composer0, instrs, refs)

        tr.latents0 = latents0


# ----------------------------------------------------------------------------- one step


def pick_tasks(tr: Trainer) -> tuple[list, list[int]]:
    """The step's tasks: R distinct tasks (LOPD/OPSD), or R/G tasks × G rollouts (GRPO)."""
    R = tr.recipe.rollout.rollouts_per_step
    if tr.algo in ("grpo", "sdpo"):
        G = group_size(tr.recipe)
        if R % G:
            raise LopdError(f"rollout.rollouts_per_step ({R}) must be a multiple of train.{tr.algo}.group_size ({G})")
        idx = tr.state.sampler.take(R // G)
        return [tr.train_tasks[i] for i in idx for _ in range(G)], [g for g in range(len(idx)) for _ in range(G)]
    idx = tr.state.sampler.take(R)
    return [tr.train_tasks[i] for i in idx], list(range(R))


def group_size(recipe: Recipe) -> int | None:
    """Rollouts per task in a step: GRPO's and SDPO's groups; None for the others."""
    t = recipe.train
    return t.grpo.group_size if t.algo == "grpo" else t.sdpo.group_size if t.algo == "sdpo" else None


def warm_start_teacher_warning(recipe, source_student: str) -> str | None:
    """The one-line warning for a distillation run warm-started from a LoRA student: its
    teacher is the plain backbone (adapters off), not the warm-start model, which a user
    chaining SFT → LOPD may not expect (`train.teacher: init` is the other choice; what each
    gave is in benchmarks/RESULTS.md, "the teacher of a warm-started run"). None where that
    does not apply."""
    if (recipe.train.algo not in ("lopd", "opsd") or source_student != "lora" or recipe.model.student != "lora"
            or recipe.train.teacher == "init"):
        return None
    return (f"train.init_from: {recipe.train.init_from}: the {recipe.train.algo.upper()} teacher is the plain "
            "backbone (adapters off), not this warm-start student; train.teacher=init makes the warm-start "
            "model the teacher")


def _norm(params: list[torch.nn.Parameter]) -> float:
    if sharding.uses_dtensors(params):
        return sharding.grad_norm(params)
    grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


def composer_health_row(tr: Trainer, step: int) -> dict[str, Any]:
    """At every eval (LOPD): the latents' task spread and the own-vs-shuffled teacher NLL gap on
    `train.lopd.health_n` held-out bank trajectories (the cold start's validation tasks), as
    composer/* keys, plus a LopdWarning when the spread is below `train.lopd.min_task_spread`."""
    import warnings

    from lopd_cli.errors import LopdWarning
    from lopd_cli.train.coldstart import collapse_message, composer_health, make_examples, split_by_task

    t = tr.recipe.train
    if tr.composer is None or tr.retriever is None or not t.lopd.health_n:
        return {}
    if tr.health_examples is None:
        cs = tr.recipe.coldstart
        items = tr.retriever.bank.items(success_only=True)
        _, held = split_by_task(items, cs.val_fraction, cs.seed)
        tr.health_examples = make_examples(tr.tokenizer, tr.retriever, (held or items)[: 4 * t.lopd.health_n],
                                           tr.recipe.bank.n_retrieve, tr.recipe.rollout.max_prompt_tokens)[: t.lopd.health_n]
    tr.model.eval()
    h = composer_health(tr.model, tr.tokenizer, tr.composer, tr.health_examples, t.micro_batch)
    if h and h["latent_task_spread"] < t.lopd.min_task_spread and dist.is_main():
        warnings.warn(collapse_message(h["latent_task_spread"], t.lopd.min_task_spread, f"train step {step}"),
                      LopdWarning, stacklevel=2)
    return {f"composer/{k}": v for k, v in h.items()}


def composer_rows(tr: Trainer, episodes: list[Episode], step: int) -> list[bool] | None:
    """Which of the step's sequences (the whole batch, every rank alike) take the composer pass:
    None = all of them (the composer trains every step on every row), all False on a step
    without a φ update (`train.lopd.composer_every`), else `train.lopd.composer_batch` rows drawn with a
    generator seeded by (seed, step) among those with supervised tokens (the global RNG, and so
    the rest of the run, is untouched)."""
    t = tr.recipe.train
    if not tr.trains_composer:
        return None
    if (step - 1) % t.lopd.composer_every:
        return [False] * len(episodes)
    valid = [i for i, ep in enumerate(episodes) if sum(ep.action_mask[1:]) > 0]
    if t.lopd.composer_batch is None or t.lopd.composer_batch >= len(valid):
        return None
    pick = set(random.Random(t.seed * 1_000_003 + 7 * step + 1).sample(valid, t.lopd.composer_batch))
    return [i in pick for i in range(len(episodes))]


def sdpo_setup(tr: Trainer):
    from lopd_cli.train.sdpo import SdpoSetup
    from lopd_cli.train.step import ema_adapter, teacher_view_for

    t, s = tr.recipe.train, tr.recipe.train.sdpo
    view = teacher_view_for(t.teacher == "live", ema_adapter(tr))
    return SdpoSetup(tr.model, tr.tokenizer, s.top_k, s.alpha, s.is_clip, tr.recipe.eval.success_threshold,
                     s.feedback, tr.recipe.bank.obs_char_budget, t.micro_batch, t.logit_chunk,
                     teacher_model=tr.teacher, teacher_view=view, autocast=tr.autocast)


def update(tr: Trainer, episodes: list[Episode], group_ids: list[int],
           totals: BatchTotals | None = None, rows: list[bool] | None = None,
           composer_totals: BatchTotals | None = None, phi_step: bool = True) -> dict[str, Any]:
    """Gradients, guards and optimiser steps for one batch. Returns the step's loss metrics.

    Distributed: `episodes` is this rank's share and `totals` counts the whole batch; the loss
    parts and gradients are summed over ranks before the guards, so every rank steps alike.
    `rows` (this rank's share of `composer_rows`), `composer_totals` (their whole-batch counts):
    the composer pass's sequences; `phi_step` False (no composer row in the whole batch): φ, its
    warm-up and β do not step, and the no-grad latents stay valid."""
    t = tr.recipe.train
    phi_step = phi_step and tr.composer_opt is not None
    tr.model.train()
    tr.student_opt.zero_grad(set_to_none=True)
    if tr.composer_opt is not None:
        tr.composer_opt.zero_grad(set_to_none=True)
    row: dict[str, Any] = {}
    t0 = time.perf_counter()
    if tr.algo == "grpo":
        setup = GrpoSetup(tr.model, tr.tokenizer, tr.recipe.rollout.temperature, t.grpo.clip_eps, t.grpo.kl_coef,
                          t.micro_batch, t.logit_chunk, tr.autocast)
        o = grpo_update(setup, episodes, group_ids, totals)
        if dist.is_distributed():
            red = dist.all_reduce_sum({"loss": o.loss, "clip_fraction": o.clip_fraction, "kl_ref": o.kl_ref,
                                       "n_tokens": o.n_tokens})
            o.loss, o.clip_fraction, o.kl_ref, o.n_tokens = red["loss"], red["clip_fraction"], red["kl_ref"], int(red["n_tokens"])
            o.adv_abs = dist.all_reduce_mean({"adv_abs": o.adv_abs}, weight=len(episodes))["adv_abs"]
            o.finite = math.isfinite(o.loss)
        row.update(loss=o.loss, pg_loss=o.loss, clip_fraction=o.clip_fraction, kl_ref=o.kl_ref, adv_abs=o.adv_abs)
        finite, seconds, n_tokens = o.finite, o.seconds, o.n_tokens
    elif tr.algo == "sdpo":
        from lopd_cli.train.sdpo import sdpo_update

        o = sdpo_update(sdpo_setup(tr), episodes, group_ids, totals)
        if dist.is_distributed():
            red = dist.all_reduce_sum({"loss": o.loss, "distilled": o.distilled, "with_solution": o.with_solution,
                                       "with_feedback": o.with_feedback, "n_tokens": o.n_tokens})
            o.loss, o.distilled, o.n_tokens = red["loss"], int(red["distilled"]), int(red["n_tokens"])
            o.with_solution, o.with_feedback = int(red["with_solution"]), int(red["with_feedback"])
            o.finite = math.isfinite(o.loss)
        row.update(loss=o.loss, jsd=o.loss, distilled_rollouts=o.distilled, with_solution=o.with_solution,
                   with_feedback=o.with_feedback)
        finite, seconds, n_tokens = o.finite, o.seconds, o.n_tokens
    else:
        o = trainer_step(tr, episodes, totals, rows, composer_totals)
        row.update(step_metrics(o, tr))
        finite, seconds, n_tokens = o.finite, o.seconds, o.n_tokens
    comp_params = [p for g in tr.composer_opt.param_groups for p in g["params"]] if tr.composer_opt else []
    _sum_gradients(tr, _student_params(tr.model) + comp_params)
    student_norm = _grad_norm(_student_params(tr.model), t.grad_clip)
    if tr.composer_opt is not None:  # ψ's and χ's own norms, before the joint clip
        for g in tr.composer_opt.param_groups:
            row[f"grad_norm_{g.get('name', 'composer')}"] = _norm(g["params"])
    composer_norm = _grad_norm(comp_params, t.grad_clip)
    finite = finite and math.isfinite(student_norm) and math.isfinite(composer_norm)
    row.update(grad_norm_student=student_norm, grad_norm_composer=composer_norm if phi_step else None)
    if finite:
        tr.student_opt.step()
        if tr.ema is not None:
            tr.ema.update()
        if phi_step:
            tr.composer_opt.step()
            if tr.nograd_latents is not None:
                tr.nograd_latents.clear()  # φ changed: its no-grad latents are stale
            if tr.composer_sched is not None:
                tr.composer_sched.step()
            tr.state.beta = dual_step(tr.state.beta, o, t.lopd.margin_m, t.lopd.eta_beta)
        tr.state.nonfinite_streak = 0
    else:
        tr.student_opt.zero_grad(set_to_none=True)
        if tr.composer_opt is not None:
            tr.composer_opt.zero_grad(set_to_none=True)
        tr.state.nonfinite_streak += 1
        row["skipped_nonfinite"] = True
    tr.model.eval()
    row.update(dist.all_reduce_max({f"sec_{k}": v for k, v in seconds.items()}))
    row["sec_update"] = time.perf_counter() - t0
    row["update_tokens"] = n_tokens
    return row


def grow_bank(tr: Trainer, episodes: list[Episode]) -> int:
    """`bank.grow`: successful training rollouts join the bank and the index as training goes."""
    from lopd_cli.bank.store import Bank

    good = [ep for ep in episodes if ep.error is None and ep.reward >= tr.recipe.bank.min_reward]
    if not good or tr.retriever is None:
        return 0

    def write() -> list[int]:  # rank 0 writes the rows; every rank indexes them in memory
        with Bank(tr.project.bank_path(tr.recipe), tr.recipe.bank.min_reward) as bank:
            return list(bank.add_records([ep.to_record() for ep in good], source=f"train:{tr.run_dir.name}").ids)

    return tr.retriever.add(dist.on_main(write))


def validate(tr: Trainer, step: int) -> dict[str, Any]:
    t = tr.recipe.train
    tasks = select_tasks(tr.env_factory, "validation", t.eval_n)
    lo, hi = dist.shard_range(len(tasks))
    tr.model.eval()
    with torch.no_grad(), ad.use_student(tr.model):
        eps = run_episodes(tr.model, tr.tokenizer, tr.env_factory, tasks[lo:hi], tr.recipe.eval_rollout,
                           seed=10_007 + step, reward_fn=tr.reward_fn, temperature=tr.recipe.eval.temperature,
                           meta={"phase": "validation"}, index_offset=lo)
    s = summarize(dist.gather_lists(eps), success_threshold=tr.recipe.eval.success_threshold)
    return {"eval/reward": s["mean_reward"], "eval/success": s["success_rate"], "eval/n": s["episodes"]}


def train_step(tr: Trainer, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    if tr.algo == "sft":
        from lopd_cli.train.sft import sft_step

        with sharding.stepping(tr.sharding, tr.recipe.train.fsdp_gather):
            return sft_step(tr)
    step = tr.state.step + 1
    t0 = time.perf_counter()
    tasks, group_ids = pick_tasks(tr)
    # Distributed: the same global task list on every rank, each rolling out its own share.
    dist.check_step_split(len(tasks), group_size(tr.recipe))
    lo, hi = dist.shard_range(len(tasks))
    # hf samples through the student's weights, gathered whole; a vLLM engine or server holds its own copy.
    own_copy = tr.recipe.rollout.backend in ("vllm", "vllm-server")
    with sharding.gathered(None if own_copy else tr.sharding, teacher=False):
        local = rollout_phase(tr, tasks[lo:hi], step, progress, index_offset=lo)
    if tr.recipe.rollout.backend == "vllm":
        from lopd_cli.rollout.vllm import sleep_engines

        sleep_engines()
    episodes = dist.gather_lists(local)
    t_roll = dist.all_reduce_max({"t": time.perf_counter() - t0})["t"]
    tr.state.rollouts_total += len(episodes)
    failed = sum(ep.error is not None for ep in episodes)
    if failed > len(episodes) / 2:
        first = next(ep.error for ep in episodes if ep.error)
        raise LopdError(f"step {step}: {failed} of {len(episodes)} episodes failed in the environment (first: {first})")
    s = summarize(episodes, success_threshold=tr.recipe.eval.success_threshold)
    row: dict[str, Any] = {
        "step": step, "algo": tr.algo, "rollouts_total": tr.state.rollouts_total,
        "reward": s["mean_reward"], "success": s["success_rate"],
        "tool_calls": s["tool_calls"], "repeated_tool_calls": s["repeated_tool_calls"],
        "invalid_tool_calls": s["invalid_tool_calls"], "first_turn_tokens": s["first_turn_tokens"],
        "episode_errors": failed,
    }
    rows = composer_rows(tr, episodes, step)
    with sharding.stepping(tr.sharding, tr.recipe.train.fsdp_gather):
        if rows is None:
            row.update(update(tr, local, group_ids[lo:hi], batch_totals(episodes)))
        else:
            row.update(update(tr, local, group_ids[lo:hi], batch_totals(episodes), rows[lo:hi],
                              batch_totals([ep for ep, r in zip(episodes, rows) if r]), phi_step=any(rows)))
            row["composer_rows"] = sum(rows)
    if tr.algo == "lopd":
        row["beta"] = tr.state.beta
    if tr.recipe.bank.grow and tr.algo in ("lopd", "opsd"):
        row["bank_added"] = grow_bank(tr, episodes)
    gen_tokens = sum(sum(ep.action_mask) for ep in episodes)
    row.update(sec_rollout=t_roll, gen_tokens_per_s=gen_tokens / max(t_roll, 1e-9),
               update_tokens_per_s=row["update_tokens"] / max(row["sec_update"], 1e-9),
               **dist.all_reduce_max({"sec_step": time.perf_counter() - t0, "peak_memory_mb": peak_memory_mb()}))
    tr.state.step = step
    if tr.state.nonfinite_streak >= tr.recipe.train.max_nonfinite:
        raise LopdError(
            f"step {step}: non-finite loss or gradient in {tr.state.nonfinite_streak} steps in a row; "
            "stopped without writing a checkpoint (lower train.lr / train.lopd.composer_lr, or check the data)"
        )
    return row


# ----------------------------------------------------------------------------- checkpoints


def save(tr: Trainer) -> Path:
    model = tr.model
    # Sharded: the weights that train gathered on rank 0, the optimiser states written sharded.
    whole = sharding.full_state_dict(tr) if tr.sharding is not None else None
    writers: dict[str, Callable[[Path], None]] = {}
    if ad.has_student_adapter(model):
        writers["student"] = lambda p: ad.save_adapter(model, ad.STUDENT, p, state_dict=whole)
    else:
        writers["student"] = lambda p: save_full_student(model, tr.tokenizer, p, state_dict=whole)
    if tr.composer is not None:
        def write_composer(p: Path) -> None:
            tr.composer.save(p, tr.embedder_fingerprint, backbone_state=whole)
            if tr.latent_cache is not None:
                tr.latent_cache.save(p)
        writers["composer"] = write_composer
    state = {
        "step": tr.state.step, "beta": tr.state.beta, "rollouts_total": tr.state.rollouts_total,
        "nonfinite_streak": tr.state.nonfinite_streak, "sampler": tr.state.sampler.state_dict(),
        "student_opt": tr.student_opt.state_dict() if tr.sharding is None else None,
        "composer_opt": tr.composer_opt.state_dict() if tr.composer_opt and tr.sharding is None else None,
        "composer_sched": tr.composer_sched.state_dict() if tr.composer_sched else None,
        "rng": ckpt.rng_state(), "sft_ids": tr.extra.get("sft_ids"),
        "ema_teacher": tr.ema.state_dict() if tr.ema is not None else None,
    }
    if tr.sharding is not None:
        tmp = tr.run_dir / "checkpoints" / f".step_{tr.state.step}.{sharding.SHARDED_DIR}.tmp"
        state["sharded_optimizers"] = sharding.save_optimizers(tr, tmp)
        writers[sharding.SHARDED_DIR] = lambda p: tmp.rename(p) if tmp.is_dir() else None
    meta = {"algo": tr.algo, "backbone": tr.recipe.model.backbone, "backbone_path": tr.backbone_path,
            "student": tr.recipe.model.student, "rollouts_total": tr.state.rollouts_total,
            "world_size": dist.world_size(), "init_from": tr.extra.get("init_from"),
            "teacher": tr.recipe.train.teacher, "parallel": "fsdp" if tr.sharding is not None else "ddp"}
    # Rank 0 alone writes (every rank holds the same weights and state); the others wait.
    return dist.on_main(lambda: ckpt.save_checkpoint(tr.run_dir / "checkpoints", tr.state.step, meta, state,
                                                     writers, keep_last=tr.recipe.train.keep_last))


def save_full_student(model, tokenizer, out: Path, state_dict: dict | None = None) -> None:
    """Full fine-tuning: the base weights (LoRA layers of the composer left out) as a plain
    transformers directory. `state_dict`: the peft model's weights when they are sharded."""
    base = model.get_base_model()
    if state_dict is None:
        state_dict = base.state_dict()
    else:
        prefix = "base_model.model."
        state_dict = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}
    sd = {k.replace(".base_layer.", "."): v for k, v in state_dict.items() if "lora_" not in k}
    clean = type(base)(base.config)
    clean.load_state_dict(sd, strict=False)
    clean.save_pretrained(out)
    tokenizer.save_pretrained(out)


def check_world_size(step_dir: Path, meta: dict | None = None) -> None:
    """A resume continues the same run, and how each step is split over ranks is part of it
    (which rank samples which episodes with which seeds): the world size must match."""
    meta = meta if meta is not None else ckpt.read_checkpoint_meta(step_dir)
    theirs = int(meta.get("world_size", 1))
    if theirs != dist.world_size():
        raise LopdError(
            f"{step_dir}: checkpoint was written by {theirs} process(es), this run has {dist.world_size()}; "
            f"resume with the same world size (torchrun --nnodes × --nproc_per_node = {theirs})"
        )


def restore(tr: Trainer, step_dir: Path) -> None:
    from lopd_cli.compose.composer import Composer

    meta = ckpt.read_checkpoint_meta(step_dir)
    if meta.get("algo") != tr.algo:
        raise LopdError(f"{step_dir}: checkpoint is from algo '{meta.get('algo')}', this run is '{tr.algo}'")
    check_world_size(step_dir, meta)
    state = ckpt.load_state(step_dir)
    ckpt.load_student_weights(tr.model, step_dir / "student")
    tr.extra["init_from"] = meta.get("init_from")
    if state.get("sft_ids") is not None:
        tr.extra["sft_ids"] = state["sft_ids"]
    if tr.composer is not None:
        loaded = Composer.load(step_dir / "composer", tr.model, tr.tokenizer, tr.recipe.composer)
        tr.composer.resampler.load_state_dict(loaded.resampler.state_dict())
    if state["student_opt"] is not None:  # None: sharded (train.parallel=fsdp), loaded after sharding
        tr.student_opt.load_state_dict(state["student_opt"])
    if tr.composer_opt is not None and state.get("composer_opt"):
        tr.composer_opt.load_state_dict(state["composer_opt"])
    if tr.composer_sched is not None and state.get("composer_sched"):
        tr.composer_sched.load_state_dict(state["composer_sched"])
    tr.extra["sharded_optimizers"] = state.get("sharded_optimizers")
    if tr.ema is not None:
        if state.get("ema_teacher") is None:
            raise LopdError(f"{step_dir}: train.teacher=ema but the checkpoint holds no EMA teacher")
        tr.ema.load_state_dict(state["ema_teacher"])
    tr.state.step = state["step"]
    tr.state.beta = state["beta"]
    tr.state.rollouts_total = state["rollouts_total"]
    tr.state.nonfinite_streak = state["nonfinite_streak"]
    tr.state.sampler = TaskSampler.from_state(state["sampler"])
    ckpt.set_rng_state(state["rng"])


# ----------------------------------------------------------------------------- the run


def prepare_run_dir(run_dir: Path, recipe: Recipe, resume: bool) -> Path | None:
    """Create the run folder (resolved recipe.yaml) or, for --resume, find its latest checkpoint."""
    from lopd_cli.config import load_recipe

    if resume:
        if not (run_dir / "recipe.yaml").is_file():
            raise LopdError(f"--resume: {run_dir} is not a run folder (no recipe.yaml)")
        saved = load_recipe(run_dir / "recipe.yaml", upgrade=True)  # a run an earlier lopd wrote resumes
        # where rollouts are served may move between runs (a restarted server); the experiment may not
        free = {"train": {"steps", "save_every", "eval_every"},
                "rollout": {"server_url", "server_adapter_dir", "server_timeout_s"}}
        mine, theirs = recipe.model_dump(exclude=free), saved.model_dump(exclude=free)
        if mine != theirs:
            diff = [k for k in mine if mine[k] != theirs.get(k)]
            raise LopdError(f"--resume: the recipe differs from {run_dir / 'recipe.yaml'} in section(s) {', '.join(diff)}")
        try:
            return ckpt.resolve_checkpoint(run_dir)
        except LopdError:
            return None  # killed before its first checkpoint: start over in the same folder
    if (run_dir / "metrics.jsonl").exists():
        raise LopdError(f"{run_dir} already holds a run (use --resume to continue it, or --run NAME)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
    return None


def train(project: Project, recipe: Recipe, run_dir: Path, resume: bool = False,
          on_step: Callable[[dict], None] | None = None,
          progress: Callable[[int], None] | None = None) -> Trainer:
    """Run (or resume) training to `train.steps`. Returns the trainer (its state is final).

    Under torchrun / accelerate launch (WORLD_SIZE > 1) every rank calls this with the same
    arguments; rank 0 alone writes the run folder, metrics and checkpoints."""
    from lopd_cli.models.student import init_source, warm_start

    dist.init_from_env()
    init = None if resume else init_source(project, recipe)  # its errors before the run folder exists
    step_dir = dist.on_main(lambda: prepare_run_dir(run_dir, recipe, resume))
    if step_dir is not None:
        check_world_size(step_dir)  # before the (possibly long) model load
    elif resume:
        init = init_source(project, recipe)  # killed before its first checkpoint: start over
    tr = build_trainer(project, recipe, run_dir)
    if step_dir is not None:
        restore(tr, step_dir)
    elif init is not None and recipe.train.teacher == "init":
        from lopd_cli.models.student import source_record

        tr.extra["init_from"] = source_record(init)  # already the backbone; the student adapter starts fresh
    elif init is not None:
        msg = warm_start_teacher_warning(recipe, init.student)
        if msg:
            import warnings

            from lopd_cli.errors import LopdWarning

            warnings.warn(msg, LopdWarning, stacklevel=2)
        rng = ckpt.rng_state()  # loading the source must not shift what the run samples
        tr.extra["init_from"] = warm_start(tr.model, init, recipe.train.init_from, [recipe.base_dir, project.root])
        ckpt.set_rng_state(rng)
        if tr.ema is not None:
            tr.ema.reset()  # the EMA teacher starts from the warm-started student
    if dist.is_distributed():  # what DDP does at construction: start from rank 0's weights
        comp = [p for g in tr.composer_opt.param_groups for p in g["params"]] if tr.composer_opt else []
        dist.broadcast_parameters(_student_params(tr.model) + comp)
    if recipe.train.parallel == "fsdp" and dist.is_distributed():
        tr.sharding = sharding.shard_trainer(tr)
        if step_dir is not None:
            sharding.load_optimizers(tr, step_dir / sharding.SHARDED_DIR, tr.extra.get("sharded_optimizers") or [])
    tr.metrics = MetricsLog(run_dir, recipe.train.tensorboard, resume_step=tr.state.step if resume else None,
                            write=dist.is_main())
    t = recipe.train
    try:
        while tr.state.step < t.steps:
            # fsdp_gather=step: the whole step on gathered units (the contexts inside are no-ops)
            with sharding.gathered(tr.sharding if t.fsdp_gather == "step" else None):
                row = train_step(tr, progress)
            if t.eval_every and tr.state.step % t.eval_every == 0:
                with sharding.gathered(tr.sharding, teacher=False):
                    row.update(validate(tr, tr.state.step))
                    row.update(composer_health_row(tr, tr.state.step))
            tr.metrics.log(row)
            if on_step:
                on_step(row)
            if tr.state.step % t.save_every == 0 or tr.state.step == t.steps:
                save(tr)
    finally:
        tr.metrics.close()
        if tr.retriever is not None and recipe.bank.grow and dist.is_main():
            tr.retriever.save()
    return tr
