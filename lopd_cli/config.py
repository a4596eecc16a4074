"""Recipes: typed, validated YAML with `--set section.key=value` overrides.

A recipe is the only thing that differs between a laptop run with the tiny model and an 8B run
on GPUs. Defaults are the LOPD paper's (see LOPD.md); unknown keys are errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lopd_cli.errors import LopdError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(Section):
    r: int = Field(16, ge=1)
    alpha: float = 32.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: str | list[str] = "all-linear"


class ModelSection(Section):
    backbone: str  # embedded name (tiny, smollm2-135m-instruct), a directory, or a hub id
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    autocast_bf16: bool = False  # bf16 autocast for forward/backward with fp32 master weights
    student: Literal["lora", "full"] = "lora"
    lora: LoraConfig = LoraConfig()
    device: str = "auto"  # auto | cpu | cuda | cuda:N


class EnvSection(Section):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    cls: str = Field(alias="class")  # "package.module:Name" or "file.py:Name"
    kwargs: dict[str, Any] = {}


class RolloutSection(Section):
    backend: Literal["hf", "vllm"] = "hf"
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(256, ge=1)
    max_turns: int = Field(8, ge=1)
    rollouts_per_step: int = Field(32, ge=1)
    batch_size: int = Field(32, ge=1)  # episodes generated together
    tool_timeout_s: float = Field(10.0, gt=0)
    max_prompt_tokens: int = Field(4096, ge=16)
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0, le=1)


class BankSection(Section):
    path: str = "bank.sqlite"
    index_dir: str = "index"
    embedder: str = "all-minilm-l6-v2"
    embed_text: Literal["instruction", "instruction+trajectory"] = "instruction"
    # Which rollouts are experience (successful): reward ≥ min_reward. Default: the recipe's success
    # threshold `eval.success_threshold` (1.0; filled in by Recipe), so partial successes are not
    # experience.
    min_reward: float = 1.0
    n_retrieve: int = Field(3, ge=1)
    allow_self_retrieval: bool = False
    obs_char_budget: int = Field(600, ge=20)  # observation-lite: max chars kept per tool output
    index: Literal["flat", "hnsw"] = "flat"
    grow: bool = False  # add each step's successful rollouts to the bank while training


class ComposerSection(Section):
    num_queries: int = Field(32, ge=1)  # K latents per retrieved experience
    depth: int = Field(8, ge=1)
    ff_mult: int = Field(4, ge=1)
    share_layers: bool = True
    encoder_lora: LoraConfig = LoraConfig(r=8, alpha=16.0, dropout=0.0)
    max_item_tokens: int = Field(1024, ge=16)  # truncation of one rendered reference trajectory
    # What χ's cross-attention reads as keys/values of a retrieved item: "content" = the
    # trajectory's own text (message contents, tool names and arguments), with the chat markup and
    # the item's copy of the task frame ("Task to solve: … Reference past trajectory:") masked
    # out, so the template repeated in every item cannot dominate the pooled latents; "all" =
    # every token (the reference code; the default: on random tiny, benchmarks/coldstart_nll.py
    # 48 tasks × 30 steps, "all" kept more task spread, 3.5 % vs 1.6 %, 6.3 % vs 5.7 % with the
    # contrastive term and warm-up). The encoder ψ reads the whole text either way.
    key_tokens: Literal["content", "all"] = "all"
    # What χ's inputs are (models/composer.py, "Input normalisation"): the encoder's states
    # "standardise"d per dimension by their mean and standard deviation over the bank's tokens,
    # only "centre"d, or as they are ("none", the reference code).
    input_norm: Literal["none", "centre", "standardise"] = "none"


class ColdstartSection(Section):
    steps: int = Field(200, ge=0)
    batch_size: int = Field(4, ge=1)
    # Examples per forward/backward within a step (gradients accumulate): memory, not the maths,
    # except that contrastive pairs are formed within a micro-batch (1: no contrastive pair).
    micro_batch: int | None = Field(None, ge=1)
    lr: float = Field(1e-4, gt=0)
    # Separate learning rates for ψ (encoder LoRA) and χ (resampler); None: `lr`. Both ramp up
    # linearly from 0 over `warmup_steps` (a fresh χ under full-size Adam steps amplifies the
    # component shared by every item before it has learnt to read them).
    lr_encoder: float | None = Field(None, gt=0)
    lr_resampler: float | None = Field(None, gt=0)
    warmup_steps: int = Field(10, ge=0)
    # Contrastive term: weight · mean max(0, NLL(own refs) − NLL(another task's refs) + margin).
    contrastive_weight: float = Field(1.0, ge=0.0)
    contrastive_margin: float = Field(0.1, ge=0.0)  # nats per token
    # Reference privilege: weight each action token's NLL by 1 + privilege_weight · max(0, NLL with
    # no block − NLL with the references as text), measured once per training example with the
    # frozen teacher before the first step. The latents are pushed hardest where reading the
    # references verbatim helps (what they hold that the prompt does not). 0: plain mean NLL.
    privilege_weight: float = Field(0.0, ge=0.0)
    # Reconstruction (ICAE-style auto-encoding): + weight · the teacher's NLL of one retrieved
    # reference's own action tokens, read from the same latent block. It asks the latents to carry
    # what the item says, token by token, not only what helps the target. 0: off.
    reconstruct_weight: float = Field(0.0, ge=0.0)
    clip_lora: float = Field(3.0, gt=0)
    clip_qformer: float = Field(30.0, gt=0)
    eval_every: int = Field(50, ge=1)
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    # Held-out examples scored (validation NLL before/during training, composer health, the
    # check): None = all of them. Each costs ~10 teacher passes over it, minutes on a real model
    # on a CPU; a cap takes an evenly spaced subset.
    val_n: int | None = Field(None, ge=2)
    # c_φ0 computed right after cold start for this many training tasks; the others are
    # computed once, on first use, during training (with the cold-start composer kept frozen).
    anchor_cache_tasks: int = Field(128, ge=0)
    seed: int = 0


class TrainSection(Section):
    algo: Literal["lopd", "grpo", "opsd", "sft"] = "lopd"
    steps: int = Field(100, ge=0)
    lr: float = Field(1e-4, gt=0)  # student; LoRA wants more than the paper's full-FT 1e-5
    composer_lr: float = Field(1e-5, gt=0)
    # The composer phase: ψ's and χ's own learning rates (None: composer_lr) and their linear
    # warm-up (steps); a contrastive term on the step's successful rollouts (see coldstart).
    composer_lr_encoder: float | None = Field(None, gt=0)
    composer_lr_resampler: float | None = Field(None, gt=0)
    composer_warmup_steps: int = Field(5, ge=0)
    contrastive_weight: float = Field(0.0, ge=0.0)
    contrastive_margin: float = Field(0.1, ge=0.0)
    # The composer pass's cost (issue 20): φ is updated on `composer_batch` of each step's
    # sequences (None: all; a seeded draw per step, the same on every rank) and on every
    # `composer_every`-th step only (the dual step on β goes with it; Δ is measured on every row).
    # Default 4: on the house-rules demo project φ every step, every 4th step and frozen gave the
    # same students (validation and test success, two seeds), and every 4th step makes a step
    # ~0.75x as long (tiny and SmolLM2; benchmarks/RESULTS.md, "A LOPD step against TRL's SDFT step").
    composer_batch: int | None = Field(None, ge=1)
    composer_every: int = Field(4, ge=1)
    # Sequences per chunk of the composer pass (at most micro_batch). That pass holds the
    # encoder's and the teacher's graphs with gradient at once (2-3x a student chunk's
    # activations), so its chunk sets the step's peak memory; the gradients are the same sums,
    # except the contrastive term's, whose pairs form within a chunk (a warning says so).
    composer_micro_batch: int = Field(2, ge=1)
    top_m: int = Field(20, ge=1)
    margin_m: float = 0.05
    # Δ's form: "centred" = sequence mean of 2(r − r̄)·δ (privilege: the teacher beats the student
    # more on successes than on failures); "paper" = token mean of (2r − 1)·δ, which a teacher
    # that merely differs from the student satisfies when most rollouts fail. train/losses.py.
    margin_advantage: Literal["centred", "paper"] = "centred"
    # LOPD and OPSD: scale each token's distillation by how much the task's own references change
    # the teacher there against another task's (train/distill.py, losses.privilege_weights).
    privilege_gate: bool = False
    anchor_lambda: float = Field(0.2, ge=0.0)  # weight of ‖c − c0‖² (summed over a task's elements)
    # Dual step β += η (m − Δ); Δ is in nats per token, so η = 10 (= the paper's 0.5 / m) raises β
    # by 0.5 for a shortfall of one default margin (the paper's 0.5 moves β ≤ 0.025 a step).
    eta_beta: float = Field(10.0, ge=0.0)
    beta0: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0)
    freeze_composer: bool = False
    group_size: int = Field(8, ge=1)  # GRPO: rollouts per task
    clip_eps: float = Field(0.2, gt=0)  # GRPO ratio clip
    kl_coef: float = Field(0.0, ge=0.0)  # GRPO: optional KL to the base model
    micro_batch: int = Field(8, ge=1)  # sequences per forward/backward chunk
    logit_chunk: int = Field(1024, ge=1)  # tokens per chunk when reading logits
    save_every: int = Field(50, ge=1)
    eval_every: int = Field(0, ge=0)  # 0: no periodic validation
    eval_n: int = Field(32, ge=1)
    # Composer health at every eval: task spread of c_φ and the own-vs-shuffled teacher NLL gap on
    # this many held-out bank trajectories (the cold start's validation tasks); a warning when the
    # spread falls below min_task_spread (the composer has become a fixed prompt).
    health_n: int = Field(16, ge=0)
    min_task_spread: float = Field(0.01, ge=0.0)
    max_nonfinite: int = Field(3, ge=1)
    tensorboard: bool = False
    keep_last: int | None = Field(None, ge=1)  # keep only the newest N checkpoints
    # LOPD: the cold-start composer (a composer folder or a run folder holding one);
    # default: the newest composer saved by `lopd coldstart` in this project.
    composer_from: str | None = None
    # Rollouts already spent before training (bank filling, cold start) for budget accounting;
    # default: LOPD/OPSD/SFT count the bank rows lopd generated (meta.generated_by == "lopd"), GRPO 0.
    prior_rollouts: int | None = Field(None, ge=0)
    # SFT (train/sft.py): successful bank items per step; default rollout.rollouts_per_step.
    sft_batch: int | None = Field(None, ge=1)
    # Warm start: the student of another run (runs/RUN, or a checkpoint folder) as the initial
    # student of this one; optimiser states start fresh.
    init_from: str | None = None
    teacher: Literal["base", "init", "live"] = Field("base", description=(
        "The LOPD/OPSD teacher's weights (it reads the privileged context either way). "
        "'base': the recipe's backbone, frozen, as in the paper: a LoRA student's backbone with its "
        "adapters off; a full student's frozen copy of the backbone (before issue 38 a full student's "
        "teacher was the student itself). 'init': train.init_from's student, frozen: for a LoRA student "
        "it is merged into this run's backbone (written once to runs/RUN/backbone/NAME/, student.py "
        "`merged_init_backbone`) and a fresh student adapter starts equal to it; a full student starts "
        "from it and keeps a frozen copy. 'live': the student's current weights (TRL SDFT's live "
        "teacher), moving with every step; its outputs are targets only, so no gradient reaches the "
        "student through the teacher pass."))
    parallel: Literal["ddp", "fsdp"] = Field("ddp", description=(
        "How `lopd train` under torchrun splits the model. 'ddp': data parallel, every rank holds the "
        "whole model and optimiser states and the gradients are summed. 'fsdp': PyTorch FSDP2 "
        "(fully_shard on each decoder layer and the transformer; a full student's teacher copy too): "
        "weights, gradients and optimiser states are sharded between steps and gathered for a step, "
        "the optimiser states are checkpointed sharded (torch.distributed.checkpoint). Ignored in one "
        "process. train/sharding.py."))
    seed: int = 0


class EvalSection(Section):
    split: str = "test"
    n: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    # An episode "succeeds" when its reward reaches this: in training metrics, validation and
    # `lopd eval` alike. (bank.min_reward is a different thing: which rollouts the bank keeps.)
    success_threshold: float = Field(1.0, ge=0.0, le=1.0)


class Recipe(Section):
    name: str | None = None
    description: str | None = None
    model: ModelSection  # required: which backbone
    env: EnvSection  # required: which world
    reward: str | None = None
    rollout: RolloutSection = RolloutSection()
    bank: BankSection = BankSection()
    composer: ComposerSection = ComposerSection()
    coldstart: ColdstartSection = ColdstartSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()

    # Where the recipe came from: relative plugin paths resolve against its folder.
    source: Path | None = Field(None, exclude=True)

    @property
    def base_dir(self) -> Path:
        return self.source.parent if self.source else Path.cwd()

    @model_validator(mode="before")
    @classmethod
    def _default_min_reward(cls, data: Any) -> Any:
        """bank.min_reward unset (or null): the bank's success threshold is eval's."""
        if not isinstance(data, dict) or not isinstance(data.get("bank", {}) or {}, dict):
            return data
        bank = dict(data.get("bank") or {})
        if bank.get("min_reward") is None:
            ev = data.get("eval") or {}
            thr = ev.get("success_threshold") if isinstance(ev, dict) else getattr(ev, "success_threshold", None)
            bank["min_reward"] = 1.0 if thr is None else thr
            data = {**data, "bank": bank}
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


def _format_error(err: ValidationError, where: str) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        section, _, leaf = key.rpartition(".")
        what = f"unknown key '{leaf}'" + (f" in section '{section}'" if section else " (not a recipe section)")
    elif kind == "missing":
        what = f"missing required key '{key}'"
    else:
        what = f"{key}: {first['msg']} (got {first.get('input')!r})"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{where}: {what}{more}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.lr=2e-4' -> (['train', 'lr'], 0.0002); the value is read as YAML."""
    if "=" not in text:
        raise LopdError(f"--set {text!r}: expected section.key=value")
    key, _, raw = text.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise LopdError(f"--set {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise LopdError(f"--set {text!r}: value is not valid YAML ({e.__class__.__name__})") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise LopdError(f"--set {text!r}: '{p}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def recipe_from_dict(data: dict[str, Any], where: str = "recipe", source: Path | None = None) -> Recipe:
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise LopdError(_format_error(e, where)) from None
    recipe.source = source
    return recipe


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise LopdError(f"{path}: recipe file not found") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise LopdError(f"{path}{line}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LopdError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    return data


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file. Errors name the file and the key."""
    path = Path(path).resolve()
    data = apply_overrides(read_yaml(path), overrides or [])
    return recipe_from_dict(data, where=str(path), source=path)
