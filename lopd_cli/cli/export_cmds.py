"""`lopd export CHECKPOINT --merge-lora -o OUT` (or `--adapter-only`): ship the student alone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lopd_cli.cli.common import DebugOpt, JsonOpt, ProjectOpt, console, err_console, print_json
from lopd_cli.errors import LopdError


def export(
    checkpoint: Annotated[str, typer.Argument(help="A run folder (its latest checkpoint), a step folder, or 'latest'.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output folder (created; must be empty unless --force).")],
    merge_lora: Annotated[bool, typer.Option("--merge-lora", help="Merge the student adapter into the backbone: a plain transformers model.")] = False,
    adapter_only: Annotated[bool, typer.Option("--adapter-only", help="Write the peft adapter (and tokenizer) instead.")] = False,
    dtype: Annotated[str, typer.Option(help="Saved weight dtype: float32, bfloat16 or float16 (merge and check run in float32).")] = "float32",
    atol: Annotated[float, typer.Option(help="Allowed logit difference to backbone + adapter: atol + rtol x max|logit|.")] = 1e-4,
    rtol: Annotated[float, typer.Option(help="Relative part of the allowed logit difference (float32 rounding grows with logit size).")] = 1e-5,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")] = "cpu",
    force: Annotated[bool, typer.Option("--force", help="Overwrite a non-empty output folder.")] = False,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Export a checkpoint's student: no bank, composer or teacher is needed at inference."""
    from lopd_cli.models.backbone import pick_device
    from lopd_cli.models.student import read_checkpoint, resolve_checkpoint
    from lopd_cli.project import open_project
    from lopd_cli.results.export import export_adapter, export_merged

    if merge_lora == adapter_only:
        raise LopdError("choose one of --merge-lora or --adapter-only")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise LopdError(f"--dtype {dtype}: use float32, bfloat16 or float16")
    proj = open_project(project, required=False)
    search = [proj.root] if proj else []
    info = read_checkpoint(resolve_checkpoint(checkpoint, runs_dir=proj.runs_dir if proj else None))
    with err_console.status(f"exporting step {info.step} of {info.path.parent.parent.name} …"):
        if adapter_only:
            result = export_adapter(info, out, search_dirs=search, force=force)
        else:
            result = export_merged(info, out, dtype=dtype, device=pick_device(device), atol=atol, rtol=rtol, search_dirs=search, force=force)
    if as_json:
        print_json(result.to_dict())
        return
    console.print(f"[green]exported[/green] {result.mode} student (step {result.step}, {result.algo}) → {result.out}", highlight=False)
    if result.max_abs_logit_diff is not None:
        console.print(
            f"  check: max |logit difference| to backbone + adapter = {result.max_abs_logit_diff:.2e} "
            f"on {result.prompts_checked} prompts (allowed {result.tolerance:.2e})", highlight=False,
        )
        console.print(f"  load: AutoModelForCausalLM.from_pretrained({result.out!r})  ·  serve: vllm serve {result.out} "
                      "--enable-auto-tool-choice --tool-call-parser hermes (docs/serving.md)", highlight=False)
    else:
        console.print(f"  load: PeftModel.from_pretrained(base, {result.out!r})", highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(export)
