"""Find a training checkpoint and load the deployable student from it.

A checkpoint folder `runs/RUN/checkpoints/step_N/` holds `checkpoint.json`
(`{"step", "algo", "backbone", "backbone_path", "student": "lora"|"full", "init_from"}`) and
`student/`: a peft adapter (LoRA student) or a full transformers directory (full fine-tuning).
Everything else in it (composer, optimiser state) is for resuming training and is not read here:
at deployment only the student runs. A warm-started run (`train.init_from`, `warm_start` below)
saves its whole student the same way, so nothing here follows a chain of runs. A run with
`train.teacher: init` trains its student adapter on its own backbone, `runs/RUN/backbone/NAME/` (the
warm-start student merged, `train.init_backbone.merged_init_backbone`); its checkpoints record
that folder as their backbone (`"teacher": "init"`), and it must stay where it is.

`--checkpoint` accepts a run folder (its latest checkpoint), a step folder, a `latest` link or
text file (`step_N`), a run's `checkpoints/` folder, or the word `latest` (the newest run of the
project that has a checkpoint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from lopd_cli.errors import LopdError

CHECKPOINT_FILE = "checkpoint.json"
# What `lopd export` writes into the folder it exports to (results/export.py); a merged
# `train.teacher: init` backbone is recognised by it.
EXPORT_INFO_FILE = "lopd_export.json"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path  # the step folder
    step: int
    algo: str
    backbone: str  # the recipe's model.backbone spec
    backbone_path: str  # resolved absolute path when the checkpoint was written
    student: str  # "lora" | "full"
    teacher: str = "base"  # "init": backbone_path is the run's merged warm-start backbone

    @property
    def student_dir(self) -> Path:
        return self.path / "student"

    @property
    def run_dir(self) -> Path | None:
        """`runs/RUN/` when the step folder sits in `runs/RUN/checkpoints/`."""
        parent = self.path.parent
        return parent.parent if parent.name == "checkpoints" else None


def _newest_run_checkpoint(runs_dir: Path) -> Path:
    cands = [d for d in runs_dir.glob("*/checkpoints") if d.is_dir() and any(d.glob("step_*"))]
    if not cands:
        raise LopdError(f"--checkpoint latest: no run in {runs_dir} has a checkpoint yet")
    return max(cands, key=lambda d: d.stat().st_mtime)


def resolve_checkpoint(spec: str | Path, runs_dir: Path | None = None) -> Path:
    """The step folder `spec` names (see the module docstring for the accepted forms)."""
    from lopd_cli.train.checkpoint import resolve_checkpoint as resolve_path

    p = Path(spec).expanduser()
    if not p.exists() and not p.is_symlink():
        if str(spec) == "latest" and runs_dir is not None:
            p = _newest_run_checkpoint(runs_dir)
        else:
            raise LopdError(f"checkpoint {spec}: no such file or folder")
    return resolve_path(p)


def read_checkpoint(step_dir: Path) -> CheckpointInfo:
    f = Path(step_dir) / CHECKPOINT_FILE
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise LopdError(f"{f}: not found (not a checkpoint folder)") from None
    except json.JSONDecodeError as e:
        raise LopdError(f"{f}:{e.lineno}: not valid JSON ({e.msg})") from None
    missing = [k for k in ("backbone", "student") if k not in data]
    if missing:
        raise LopdError(f"{f}: missing key '{missing[0]}'")
    if data["student"] not in ("lora", "full"):
        raise LopdError(f"{f}: student must be 'lora' or 'full', got {data['student']!r}")
    return CheckpointInfo(
        path=Path(step_dir).resolve(),
        step=int(data.get("step", 0)),
        algo=str(data.get("algo", "?")),
        backbone=str(data["backbone"]),
        backbone_path=str(data.get("backbone_path") or ""),
        student=data["student"],
        teacher=str(data.get("teacher") or "base"),
    )


def adapter_dir(info: CheckpointInfo) -> Path:
    """The folder holding `adapter_config.json`: `student/`, or `student/student/` (what
    `PeftModel.save_pretrained` writes for an adapter named "student")."""
    for d in (info.student_dir, info.student_dir / "student"):
        if (d / "adapter_config.json").is_file():
            return d
    raise LopdError(f"{info.student_dir}: no adapter_config.json (checkpoint.json says student: lora)")


def backbone_source(info: CheckpointInfo, search_dirs: Iterable[Path] = ()) -> str:
    """The backbone the checkpoint was trained on: its recorded absolute path when it still
    exists, else the recipe spec (an embedded name is rebuilt in the cache). A `teacher: init`
    run's backbone is its own merged folder, found next to the checkpoint (so a moved project
    still works); there is nothing to fall back to."""
    if info.teacher == "init" and info.run_dir is not None:
        here = existing_init_backbone(info.run_dir)
        if here is not None:
            return str(here)
    if info.backbone_path and Path(info.backbone_path).is_dir():
        return info.backbone_path
    if info.teacher == "init":
        raise LopdError(f"{info.path}: the student was trained on its run's merged warm-start backbone "
                        f"{info.backbone_path or '(not recorded)'}, which is gone (train.teacher: init)")
    return info.backbone


def _has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def load_student(info: CheckpointInfo, dtype: str = "float32", device: str = "auto", search_dirs: Iterable[Path] = ()):
    """(model, tokenizer) of the student alone: backbone + the "student" LoRA adapter (a
    PeftModel, active adapter "student"), or the full fine-tuned model."""
    from lopd_cli.models.backbone import load_backbone, load_tokenizer

    search_dirs = list(search_dirs)
    if info.student == "full":
        if not (info.student_dir / "config.json").is_file():
            raise LopdError(f"{info.student_dir}: no config.json (checkpoint.json says student: full)")
        model, tok = load_backbone(str(info.student_dir), dtype=dtype, device=device)
        if not _has_tokenizer(info.student_dir):
            from lopd_cli.models.backbone import resolve_backbone

            tok = load_tokenizer(resolve_backbone(backbone_source(info), search_dirs))
        return model, tok
    from peft import PeftModel

    base, tok = load_backbone(backbone_source(info), dtype=dtype, device=device, search_dirs=search_dirs)
    model = PeftModel.from_pretrained(base, str(adapter_dir(info)), adapter_name="student", is_trainable=False)
    model.set_adapter("student")
    model.eval()
    return model, tok


# ----------------------------------------------------------------------------- warm starts


def resolve_init_from(spec: str, root: Path) -> CheckpointInfo:
    """`train.init_from`: a run folder (its latest checkpoint) or a checkpoint folder, relative
    to the project root, whose student a new run starts from."""
    from lopd_cli.train.checkpoint import resolve_checkpoint as resolve_path

    p = Path(spec).expanduser()
    p = p if p.is_absolute() else Path(root) / p
    if not p.exists() and not p.is_symlink():
        raise LopdError(f"train.init_from: {spec}: no such run or checkpoint folder")
    try:
        step_dir = resolve_path(p)
    except LopdError:
        raise LopdError(f"train.init_from: {spec} holds no student (no checkpoint in it yet)") from None
    info = read_checkpoint(step_dir)
    if not info.student_dir.is_dir():
        raise LopdError(f"train.init_from: {step_dir} holds no student (no student/ folder)")
    return info


def check_init_backbone(info: CheckpointInfo, spec: str, backbone: str, backbone_path: str) -> None:
    """The source's student must sit on this run's backbone (same spec, or the same directory)."""
    if info.backbone == backbone:
        return
    if info.backbone_path and backbone_path and Path(info.backbone_path).resolve() == Path(backbone_path).resolve():
        return
    raise LopdError(f"train.init_from: {spec} was trained on backbone '{info.backbone}', "
                    f"this recipe's model.backbone is '{backbone}'")


def warm_start(model, info: CheckpointInfo, spec: str, search_dirs: Iterable[Path] = ()) -> dict:
    """Load `info`'s student into a trainer's (peft-wrapped) model as its initial student.

    LoRA → LoRA: the adapter's weights become the "student" adapter (same rank, alpha and
    targets), so a later checkpoint's adapter is the whole student and export needs only it and
    the backbone; the teacher (adapters off) stays the plain backbone. LoRA → full: the adapter
    is merged into a private copy of the backbone whose weights become the base. Full → full:
    the weights are copied. Full → LoRA is refused (the base itself would have to change,
    and with it the teacher). Returns what a checkpoint records about the source."""
    from lopd_cli.models import adapters as ad
    from lopd_cli.train.checkpoint import copy_full_weights, load_student_weights

    lora_here = ad.has_student_adapter(model)
    if info.student == "full" and lora_here:
        raise LopdError(f"train.init_from: {spec} holds a fully fine-tuned student and this recipe trains a LoRA "
                        "student on the plain backbone (set model.student=full to continue it)")
    try:
        if info.student == "lora" and not lora_here:
            src, _ = load_student(info, dtype="float32", device="cpu", search_dirs=search_dirs)
            merged = src.merge_and_unload()
            dtype = next(model.parameters()).dtype
            copy_full_weights(model, {k: v.to(dtype) for k, v in merged.state_dict().items()})
            del src, merged
        else:
            load_student_weights(model, info.student_dir)
    except LopdError as e:
        raise LopdError(f"train.init_from: {spec}: {e}") from None
    return source_record(info)


def source_record(info: CheckpointInfo) -> dict:
    """What a warm-started run's checkpoints record about `train.init_from`'s checkpoint."""
    return {"checkpoint": str(info.path), "run": str(info.run_dir) if info.run_dir else None,
            "step": info.step, "algo": info.algo, "student": info.student}


def init_source(project, recipe) -> CheckpointInfo | None:
    """The checkpoint `train.init_from` names, checked against the recipe's backbone (None when
    the recipe has no init_from) and against its student kind and LoRA shape. Cheap: nothing is
    loaded but checkpoint.json and adapter_config.json."""
    from lopd_cli.models.backbone import resolve_backbone

    spec = recipe.train.init_from
    if not spec:
        if recipe.train.teacher == "init":
            raise LopdError("train.teacher: init needs train.init_from (the run whose student becomes the teacher)")
        return None
    info = resolve_init_from(spec, project.root)
    mine = resolve_backbone(recipe.model.backbone, [recipe.base_dir, project.root])
    check_init_backbone(info, spec, recipe.model.backbone, str(mine))
    if info.student == "full" and recipe.model.student == "lora":
        raise LopdError(f"train.init_from: {spec} holds a fully fine-tuned student and this recipe trains a LoRA "
                        "student on the plain backbone (set model.student=full to continue it)")
    if recipe.train.teacher == "init":
        # LoRA: a fresh student adapter on the merged backbone; full: the student starts from the
        # merged backbone and the teacher is a frozen copy of it. Any source shape will do.
        return info
    if info.student == "lora" and info.teacher == "init" and recipe.model.student == "lora":
        raise LopdError(f"train.init_from: {spec} trained its adapter on a merged warm-start backbone "
                        "(train.teacher: init); continue it with train.teacher=init, or with model.student=full")
    if info.student == "lora" and recipe.model.student == "lora":
        try:
            cfg = json.loads((adapter_dir(info) / "adapter_config.json").read_text())
        except LopdError as e:
            raise LopdError(f"train.init_from: {spec}: {e}") from None
        lora = recipe.model.lora
        for key, theirs, ours in (("r", cfg.get("r"), lora.r), ("alpha", cfg.get("lora_alpha"), lora.alpha)):
            if theirs != ours:
                raise LopdError(f"train.init_from: {spec} has a LoRA student with {key}={theirs}, this recipe's "
                                f"model.lora.{key} is {ours} (the adapter continues as it is: use the same shape)")
    return info


RUN_BACKBONE = "backbone"  # runs/RUN/backbone/NAME/: a `train.teacher: init` run's merged backbone


def existing_init_backbone(run_dir: Path) -> Path | None:
    """The merged backbone folder a `train.teacher: init` run made on its first start, if any."""
    found = sorted((Path(run_dir) / RUN_BACKBONE).glob(f"*/{EXPORT_INFO_FILE}"))
    return found[0].parent if found else None


def load_policy(recipe, search_dirs: Iterable[Path] = (), checkpoint: str | Path | None = None,
                model: str | None = None, runs_dir: Path | None = None):
    """(model, tokenizer, meta) of whichever policy a command rolls out: a trained student
    (`checkpoint`: what `--checkpoint` accepts), another model (`model`: a transformers folder or
    an embedded name), else the recipe's backbone. `meta` says which produced the episodes
    (`model`, and `checkpoint`: the step folder), for the records' meta."""
    from lopd_cli.models.backbone import load_backbone

    if checkpoint is not None and model is not None:
        raise LopdError("give --checkpoint or --model, not both")
    if checkpoint is not None:
        info = read_checkpoint(resolve_checkpoint(checkpoint, runs_dir=runs_dir))
        m, tok = load_student(info, recipe.model.dtype, recipe.model.device, search_dirs)
        return m, tok, {"model": info.backbone, "checkpoint": str(info.path)}
    spec = model or recipe.model.backbone
    m, tok = load_backbone(spec, recipe.model.dtype, recipe.model.device, list(search_dirs))
    return m, tok, {"model": spec}
