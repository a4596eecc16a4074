"""`lopd demo`: self-evolution end to end, in a fresh project on the embedded default.

    init (the shipped tiny orders base policy) → the base model on the test split → your agent's
    logs into the bank → index → the check (cold start of the composer, ending with the
    before-training check) → LOPD's single pass → evolve: rounds of (roll the incumbent out →
    bank → SFT → validation gate); round 1 trains SFT from the base on the bank (SFT's single
    pass), later rounds train the incumbent further on the grown bank → LOPD, SFT and the evolved
    student on the test split → export of the evolved student → a report of the rounds → one table.

The world is `orders` with house rules (the project's `toolcall.yaml`): each store's refund
reason, look-up-first rule and sign-off show only in its past successful transcripts, and the
base policy learned another rule set (`train.base_policy.BASE_POLICY_RULES_SEED`). "Your agent's
logs" are the JSONL a team brings to `lopd bank add-rollouts`; the demo makes them with a
scripted agent that knows the stores' rules (the orders oracle with mistakes,
`envs.orders_agent.scripted_agent_records`), on training tasks and on the validation tasks the
check holds out, and writes them to `logs/agent.jsonl` first. They are the user's, not
rollouts lopd generated, so they do not count toward the training budget; the student's own
rollouts do.

Every stage is the same library call the CLI commands make (`lopd coldstart`, `lopd train`,
`lopd evolve`, `lopd eval`, `lopd export`, `lopd report`); the demo only chains them in one
process and times them. What it simplifies: sizes come from the project's `toolcall.yaml` (the
orders-tiny recipe) plus the overrides below, chosen so the demo ends in about a quarter of an
hour on 2 CPU cores; evolve's method is fixed to SFT, the method that led on this project
(docs/evolve.md), rather than `--algo auto`, which would also train a LOPD candidate each time.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lopd_cli.errors import LopdError

# Sized for a laptop: the recipe's own values except these (every stage's run takes them).
# coldstart.eval_every: no validation pass mid-way; the check after the last step is the figure.
DEMO_OVERRIDES = ["eval.n=128", "coldstart.steps=40", "coldstart.eval_every=40", "train.steps=12",
                  "train.save_every=12", "rollout.rollouts_per_step=16", "rollout.batch_size=16"]
# Evolve from the base model: round 1 rolls the base out and trains SFT on the bank (your logs and
# those rollouts): that candidate is SFT's single pass. Each later round rolls out the incumbent,
# adds the episodes to the bank and trains the incumbent further on the grown bank; the gate keeps
# the better one on the validation tasks.
# eval.batch_size: the gate's greedy validation (64 tasks) in one batch; sampling stays at 32.
EVOLVE_OVERRIDES = ["evolve.rounds=5", "evolve.start=incumbent", "evolve.steps=48", "evolve.tasks_per_round=256",
                    "evolve.samples_per_task=1", "train.sft.batch=32", "rollout.batch_size=32", "eval.batch_size=64"]
# The test evaluations only: 256 test tasks (the environment's first 128 and 128 more), because
# rounds gain a few points over SFT's single pass and on 128 tasks a paired interval is about ±7
# points wide. Not given to the runs, so their recipe.yaml names the project's world and
# `lopd eval --checkpoint runs/evolve` works without --recipe. Greedy, 64 episodes at a time.
TEST_OVERRIDES = ["eval.n=256", "env.kwargs.n_test=256", "eval.batch_size=64"]
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
    before: object = None  # results.evaluate.ModelEval of the base model
    lopd: object = None  # LOPD's single pass
    sft: object = None  # SFT's single pass
    after: object = None  # the evolved student
    evolved_vs_sft: object = None  # results.evaluate.Interval: paired difference on the same test tasks
    check: dict | None = None  # the before-training check (train/check.py)
    rounds: list | None = None  # evolve's rounds.jsonl rows
    run_dir: Path | None = None  # the evolve run
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


def _paired_difference(a: list, b: list, threshold: float):
    """Mean of per-task success(a) − success(b) over the same tasks, with its 95 % t interval."""
    from lopd_cli.results.evaluate import mean_interval

    by_task = {e.task.id: e.reward >= threshold for e in b}
    return mean_interval([float(e.reward >= threshold) - float(by_task[e.task.id]) for e in a])


def run_demo(out: Path, model: str = "tiny", force: bool = False, say: Callable[[str], None] = print,
             overrides: list[str] | None = None, agent_logs: int = AGENT_LOGS) -> DemoResult:
    """Run every stage; raise LopdError naming the stage that failed. `overrides` (--set) apply
    to every stage after the defaults above."""
    from lopd_cli.agent.runner import make_env_factory
    from lopd_cli.bank.index import build_index
    from lopd_cli.bank.store import Bank
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.models.student import load_student, read_checkpoint, resolve_checkpoint
    from lopd_cli.pipeline.evolve import evolve, read_rounds
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
    user = list(overrides or [])
    sets = DEMO_OVERRIDES + user

    with _stage(result, f"init project ({model})", say) as st, step_counter("training the tiny base policy") as on_build:
        project = create_project(out, example="orders", model=model, progress=on_build)
        (project.root / DEMO_MARKER).write_text("made by `lopd demo`; the next demo run replaces this folder\n")
        recipe = project.load_recipe("toolcall", sets)
        test_recipe = project.load_recipe("toolcall", DEMO_OVERRIDES + TEST_OVERRIDES + user)
        search = [recipe.base_dir, project.root]
        threshold = recipe.eval.success_threshold
        st.detail = f"{project.root}, backbone {recipe.model.backbone}"

    def evaluate(label: str, checkpoint: Path | None):
        if checkpoint is None:
            model_, tok_ = load_backbone(recipe.model.backbone, recipe.model.dtype, recipe.model.device, search)
        else:
            model_, tok_ = load_student(read_checkpoint(resolve_checkpoint(checkpoint)), search_dirs=search)
        with counter(f"eval {label}") as tick:
            figures, episodes = run_eval(test_recipe, model_, tok_, label, progress=tick, success_threshold=threshold)
        del model_
        return figures, episodes

    with _stage(result, "evaluate the base model (test split)", say) as st:
        result.before, _ = evaluate("base", None)
        st.detail = f"success {result.before.success.estimate:.1%}, reward {result.before.reward.estimate:.3f}"

    with _stage(result, f"your agent's logs into the bank ({agent_logs} training + the validation tasks), index", say) as st:
        from lopd_cli.envs.orders_agent import scripted_agent_records

        logs = project.root / "logs" / "agent.jsonl"
        logs.parent.mkdir(exist_ok=True)
        env = make_env_factory(recipe)()
        records = scripted_agent_records(env.tasks("train")[-agent_logs:] + env.tasks("validation"),
                                         seed=recipe.train.seed)
        logs.write_text("".join(json.dumps(r) + "\n" for r in records))
        with Bank(project.bank_path(recipe), recipe.bank.min_reward) as bank:
            res = bank.add_file(logs)
        rep = build_index(project, recipe, progress=True)
        st.detail = (f"{logs.relative_to(project.root)}: {res.added} added, {res.successes} successful; "
                     f"{rep.total} indexed")

    with _stage(result, "the check: cold start of the composer, then LOPD's teacher against the student", say) as st:
        cs = run_coldstart(project, recipe, project.runs_dir / "coldstart", show_progress=True)
        st.detail = f"held-out teacher NLL {cs['val_nll_before']:.3f} → {cs['val_nll_after']:.3f}" if cs["val_nll_after"] else ""
        result.check = cs.get("check")
    if result.check:
        from lopd_cli.train.check import check_lines

        for line in check_lines(result.check):
            say(f"    {line}")

    with _stage(result, "LOPD, one pass", say) as st:
        tr = train(project, recipe, project.runs_dir / "lopd",
                   on_step=lambda row: say(f"    step {row['step']}: reward {row['reward']:.3f} "
                                           f"success {row['success']:.2f} β {row.get('beta', 0):.3f}"))
        st.detail = f"{tr.state.step} steps, {tr.state.rollouts_total} rollouts in total"
        del tr

    with _stage(result, "evolve: roll out the incumbent → bank → SFT → validation gate, each round", say) as st:
        ev = evolve(project, "toolcall", DEMO_OVERRIDES + EVOLVE_OVERRIDES + user,
                    run="evolve", algo="sft", say=lambda line: say(f"    {line}"))
        result.run_dir = ev.run_dir
        result.rounds = read_rounds(ev.run_dir)
        last = result.rounds[-1]
        st.detail = (f"{len(result.rounds) - 1} rounds, incumbent from round {ev.incumbent['round']}, "
                     f"{last.get('rollouts_total', 0)} rollouts")

    with _stage(result, "evaluate LOPD, SFT and the evolved student (test split)", say) as st:
        result.lopd, _ = evaluate("LOPD, one pass", project.runs_dir / "lopd")
        # Round 1 trained SFT from the base on your logs (and the base's own rollouts): one pass.
        result.sft, sft_eps = evaluate("SFT, one pass", result.run_dir / "rounds" / "r01" / "train-sft")
        result.after, evo_eps = evaluate("evolved", result.run_dir)
        result.evolved_vs_sft = _paired_difference(evo_eps, sft_eps, threshold)
        d = result.evolved_vs_sft
        st.detail = (f"evolved {result.after.success.estimate:.1%}, SFT {result.sft.success.estimate:.1%}, "
                     f"LOPD {result.lopd.success.estimate:.1%}; evolved − SFT {d.estimate:+.1%}")

    with _stage(result, "export the evolved student (merge LoRA), report", say) as st:
        info = read_checkpoint(resolve_checkpoint(result.run_dir))
        result.export_dir = project.models_dir / "student"
        ex = export_merged(info, result.export_dir, search_dirs=search, force=True)
        result.report_png = project.root / "report.png"
        write_report([result.run_dir], result.report_png)
        st.detail = f"{result.export_dir} (max |Δlogit| {ex.max_abs_logit_diff:.2g}); {result.report_png}"

    (project.root / "demo.json").write_text(json.dumps(summary(result), indent=2))
    return result


def summary(result: DemoResult) -> dict:
    figures = lambda m: m.to_dict() if m else None  # noqa: E731
    return {
        "project": str(result.project),
        "seconds": result.seconds,
        "stages": [s.__dict__ for s in result.stages],
        "before": figures(result.before),
        "lopd": figures(result.lopd),
        "sft": figures(result.sft),
        "after": figures(result.after),
        "evolved_vs_sft": result.evolved_vs_sft.to_dict() if result.evolved_vs_sft else None,
        "check": result.check,
        "rounds": result.rounds,
        "run_dir": str(result.run_dir) if result.run_dir else None,
        "export_dir": str(result.export_dir) if result.export_dir else None,
        "report_png": str(result.report_png) if result.report_png else None,
    }
