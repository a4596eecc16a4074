"""`lopd demo`: the whole pipeline, end to end, in a fresh project on the embedded default.

    init (the shipped tiny orders base policy) → base eval on the test split → your agent's logs
    and student rollouts into the bank → index → cold start, ending with the before-training
    check → LOPD training → eval of the trained student → export (merged LoRA) → report PNG →
    a before/after table.

The world is `orders` with house rules (the project's `toolcall.yaml`): each store's refund
reason, look-up-first rule and sign-off show only in its past successful transcripts, and the
base policy learned another rule set (`train.base_policy.BASE_POLICY_RULES_SEED`). "Your agent's
logs" are the JSONL a team brings to `lopd bank add-rollouts`; the demo makes them with a
scripted agent that knows the stores' rules (the orders oracle with mistakes,
`envs.orders_agent.scripted_agent_records`), on training tasks and on the validation tasks the
check holds out, and writes them to `logs/agent.jsonl` first. They are the user's, not
rollouts lopd generated, so they do not count toward the training budget; the student's own
rollouts do.

Every stage is the same library call the CLI commands make; the demo only chains them in one
process (one backbone load per stage, as the commands would) and times them. What it
simplifies: sizes come from the project's `toolcall.yaml` (the orders-tiny recipe) plus the
few overrides in `DEMO_OVERRIDES`, chosen so the demo ends in minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lopd_cli.errors import LopdError

# Sized for a laptop: the recipe's own values except these.
# coldstart.eval_every 80: no validation pass mid-way; the check after the last step is the figure.
DEMO_OVERRIDES = ["eval.n=128", "coldstart.steps=80", "coldstart.eval_every=80", "train.steps=12",
                  "train.save_every=6"]
BANK_ROLLOUTS = 64
AGENT_LOGS = 96  # of training tasks; plus one log per validation task (the check's held-out successes)
DEMO_MARKER = ".lopd-demo"


@dataclass
class Stage:
    name: str
    seconds: float
    detail: str


@dataclass
class DemoResult:
    project: Path
    stages: list[Stage] = field(default_factory=list)
    before: object = None  # evaluate.ModelEval
    after: object = None
    check: dict | None = None  # the before-training check (train/check.py)
    run_dir: Path | None = None
    export_dir: Path | None = None
    report_png: Path | None = None

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)


def _stage(result: DemoResult, name: str, say: Callable[[str], None]):
    class _Timer:
        def __enter__(self):
            say(f"[{len(result.stages) + 1}] {name} …")
            self.t0 = time.perf_counter()
            self.detail = ""
            return self

        def __exit__(self, exc_type, exc, tb):
            if exc_type is None:
                result.stages.append(Stage(name, time.perf_counter() - self.t0, self.detail))
                say(f"    done in {result.stages[-1].seconds:.1f} s{': ' + self.detail if self.detail else ''}")
            return False

    return _Timer()


def run_demo(out: Path, model: str = "tiny", force: bool = False, say: Callable[[str], None] = print,
             overrides: list[str] | None = None, bank_rollouts: int = BANK_ROLLOUTS) -> DemoResult:
    """Run every stage; raise LopdError naming the stage that failed."""
    import torch

    from lopd_cli.agent.runner import load_reward, make_env_factory, run_episodes, select_tasks
    from lopd_cli.bank.index import build_index
    from lopd_cli.bank.store import Bank
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.models.student import load_student, read_checkpoint, resolve_checkpoint
    from lopd_cli.progress import counter, step_counter
    from lopd_cli.project.scaffold import create_project
    from lopd_cli.results.evaluate import run_eval
    from lopd_cli.results.export import export_merged
    from lopd_cli.results.report import write_report
    from lopd_cli.train.coldstart import run_coldstart
    from lopd_cli.train.loop import train

    out = Path(out)
    if (out / "lopd.yaml").exists():
        # Only a folder an earlier demo made is removed without asking.
        if not (force or (out / DEMO_MARKER).exists()):
            raise LopdError(f"{out} already holds a lopd project that the demo did not make (use --force or another --out)")
        shutil.rmtree(out)
    result = DemoResult(project=out.resolve())
    sets = DEMO_OVERRIDES + list(overrides or [])

    with _stage(result, f"init project ({model})", say) as st, step_counter("training the tiny base policy") as on_build:
        project = create_project(out, example="orders", model=model, progress=on_build)
        (project.root / DEMO_MARKER).write_text("made by `lopd demo`; the next demo run replaces this folder\n")
        recipe = project.load_recipe("toolcall", sets)
        search = [recipe.base_dir, project.root]
        st.detail = f"{project.root}, backbone {recipe.model.backbone}"

    with _stage(result, "evaluate the base model (test split)", say) as st:
        base, tok = load_backbone(recipe.model.backbone, recipe.model.dtype, recipe.model.device, search)
        with counter("eval base") as tick:
            result.before, _ = run_eval(recipe, base, tok, "base", progress=tick,
                                        success_threshold=recipe.eval.success_threshold)
        st.detail = f"success {result.before.success.estimate:.1%}, reward {result.before.reward.estimate:.3f}"

    with _stage(result, f"your agent's logs into the bank ({AGENT_LOGS} training + the validation tasks)", say) as st:
        from lopd_cli.envs.orders_agent import scripted_agent_records

        logs = project.root / "logs" / "agent.jsonl"
        logs.parent.mkdir(exist_ok=True)
        env = make_env_factory(recipe)()
        records = scripted_agent_records(env.tasks("train")[-AGENT_LOGS:] + env.tasks("validation"),
                                         seed=recipe.train.seed)
        logs.write_text("".join(json.dumps(r) + "\n" for r in records))
        with Bank(project.bank_path(recipe), recipe.bank.min_reward) as bank:
            res = bank.add_file(logs)
        st.detail = f"{logs.relative_to(project.root)}: {res.added} added, {res.successes} successful"

    with _stage(result, f"{bank_rollouts} student rollouts into the bank", say) as st:
        env_factory = make_env_factory(recipe)
        tasks = select_tasks(env_factory, "train", bank_rollouts)
        with torch.no_grad(), counter("rollouts", len(tasks)) as tick:
            eps = run_episodes(base, tok, env_factory, tasks, recipe.rollout, seed=recipe.train.seed,
                               reward_fn=load_reward(recipe), progress=tick,
                               meta={"model": recipe.model.backbone, "split": "train", "generated_by": "lopd"})
        del base
        with Bank(project.bank_path(recipe), recipe.bank.min_reward) as bank:
            res = bank.add_records([e.to_record() for e in eps], source="demo")
        st.detail = f"{res.added} added, {res.successes} successful"

    with _stage(result, "index the bank", say) as st:
        rep = build_index(project, recipe, progress=True)
        st.detail = f"{rep.total} successful rollouts indexed"

    with _stage(result, "cold start the composer", say) as st:
        cs = run_coldstart(project, recipe, project.runs_dir / "coldstart", show_progress=True)
        st.detail = f"held-out teacher NLL {cs['val_nll_before']:.3f} → {cs['val_nll_after']:.3f}" if cs["val_nll_after"] else ""
        result.check = cs.get("check")
    if result.check:
        from lopd_cli.train.check import check_lines

        for line in check_lines(result.check):
            say(f"    {line}")

    with _stage(result, "LOPD training", say) as st:
        result.run_dir = project.runs_dir / "lopd"
        tr = train(project, recipe, result.run_dir,
                   on_step=lambda row: say(f"    step {row['step']}: reward {row['reward']:.3f} "
                                           f"success {row['success']:.2f} β {row.get('beta', 0):.3f}"))
        st.detail = f"{tr.state.step} steps, {tr.state.rollouts_total} rollouts in total"

    with _stage(result, "evaluate the trained student (test split)", say) as st:
        info = read_checkpoint(resolve_checkpoint(result.run_dir))
        student, stok = load_student(info, search_dirs=search)
        with counter("eval LOPD student") as tick:
            result.after, _ = run_eval(recipe, student, stok, "LOPD student", progress=tick,
                                       success_threshold=recipe.eval.success_threshold)
        del student
        st.detail = f"success {result.after.success.estimate:.1%}, reward {result.after.reward.estimate:.3f}"

    with _stage(result, "export (merge LoRA)", say) as st:
        result.export_dir = project.models_dir / "student"
        ex = export_merged(info, result.export_dir, search_dirs=search, force=True)
        st.detail = f"{result.export_dir} (max |Δlogit| {ex.max_abs_logit_diff:.2g})"

    with _stage(result, "report", say) as st:
        result.report_png = project.root / "report.png"
        write_report([result.run_dir], result.report_png)
        st.detail = str(result.report_png)

    (project.root / "demo.json").write_text(json.dumps(summary(result), indent=2))
    return result


def summary(result: DemoResult) -> dict:
    return {
        "project": str(result.project),
        "seconds": result.seconds,
        "stages": [s.__dict__ for s in result.stages],
        "before": result.before.to_dict() if result.before else None,
        "after": result.after.to_dict() if result.after else None,
        "check": result.check,
        "run_dir": str(result.run_dir) if result.run_dir else None,
        "export_dir": str(result.export_dir) if result.export_dir else None,
        "report_png": str(result.report_png) if result.report_png else None,
    }
