"""`lopd evolve`: rounds of experience. Each round

    a. rolls the incumbent out on training tasks (k samples per task, seeded by (evolve.seed,
       round), so every round draws new samples) and writes every episode to the bank, with
       provenance in meta (evolve run, round, the checkpoint that produced it);
    b. syncs the new successes into the retrieval index (when the method retrieves, or the
       project has an index);
    c. trains a candidate with the round's method on the bank as it now stands (the ordinary
       `lopd train` loop, `train.loop.train`, with per-round overrides: steps, seed, init_from);
    d. validates the candidate greedily on the same validation tasks every round and gates it:
       it replaces the incumbent only when the paired difference of per-task success
       (candidate − incumbent, the same tasks) is ≥ 0. A rejected round's experience stays in
       the bank. With `evolve.retain` the candidate is also scored greedily on each retention
       world's validation tasks, and a paired drop against the starting model beyond
       `evolve.retain_tolerance` rejects it (a rise never does). With `evolve.recover_steps`
       each candidate first goes through a recovery phase in each retention world: on-policy
       distillation (`train.algo: distill`) from the frozen starting model on that world's
       training tasks (`_recover`); the recovered student is the one validated and gated.

It stops after `evolve.rounds`, before a round that would exceed `evolve.rollout_budget`, or
after `evolve.patience` rounds without a rise of the incumbent's validation success.

The run folder runs/EVOLVE/:

    evolve.json     the state: settings, each round's finished stages and their results, the
                    incumbent, the rollout count (written atomically after every stage)
    recipe.yaml     the resolved recipe at the start
    rounds.jsonl    one row of metrics per finished round (round 0: the starting model)
    incumbent       a relative link to the incumbent's step folder (absent while the starting
                    model is the incumbent): `lopd eval/export --checkpoint runs/EVOLVE` use it
    rounds/rNN/     rollouts.jsonl, train-METHOD/ (a training run), validation-METHOD.jsonl,
                    coldstart/ (evolve.refresh_composer)

Faults: a stage's outputs are complete before the state file records it; a killed stage is
redone from scratch on `--resume` (its partial outputs are deleted first). Every stage is
seeded, and bank adds are idempotent by content hash, so a resumed run ends with the bank rows
and the incumbent of an uninterrupted one (same seed, same thread count). The figures a round
reports about the bank (rows added, duplicates) are counted from the rows' provenance, so they
too do not depend on where a run was killed.

`algo: auto` chooses from evidence the project has: the newest cold start's before-training
check (train/check.py; none: SFT only) and the candidates' validation success (round 1 trains
SFT, and LOPD too when the check found a teacher advantage, and the better on validation wins;
later rounds use the method that won).

What it simplifies: validation episodes are not counted toward the budget (as in `lopd
train`); `auto` does not re-try the losing method later; a killed training stage restarts from
its first step rather than from its last checkpoint.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from lopd_cli.errors import LopdError
from lopd_cli.results.evaluate import Interval, mean_interval, wilson_interval
from lopd_cli.train.checkpoint import EVOLVE_STATE, INCUMBENT

STATE_VERSION = 1
ROUNDS_FILE = "rounds.jsonl"
METHODS = ("sft", "lopd", "opsd", "sdpo", "grpo")
ALGOS = (*METHODS, "auto")
TRAINS_ON_ROLLOUTS = ("lopd", "opsd", "sdpo", "grpo")  # methods that roll out while training (budget)
VALIDATION_SEED = 10_007  # greedy decoding: the seed only matters for ties in sampling code paths

# The train.* keys each round's recipe gets from evolve (kept in one place).
TRAIN_KEYS = {
    "algo": "train.algo", "steps": "train.steps", "seed": "train.seed", "init_from": "train.init_from",
    "save_every": "train.save_every", "eval_every": "train.eval_every", "prior_rollouts": "train.prior_rollouts",
    "composer_from": "train.lopd.composer_from",
}

Say = Callable[[str], None]


# ----------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class GateDecision:
    accepted: bool
    diff: Interval  # paired mean of candidate − incumbent per-task success, with a t interval
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "paired_diff": self.diff.to_dict(), "reason": self.reason}


def paired_gate(candidate: Sequence[bool], incumbent: Sequence[bool]) -> GateDecision:
    """Accept the candidate when its mean per-task success difference to the incumbent, on the
    same tasks in the same order, is ≥ 0 (a tie keeps the student trained on more experience)."""
    if len(candidate) != len(incumbent) or not candidate:
        raise ValueError(f"paired gate: {len(candidate)} candidate vs {len(incumbent)} incumbent results")
    iv = mean_interval([float(c) - float(i) for c, i in zip(candidate, incumbent)])
    accepted = iv.estimate >= 0
    ci = "" if iv.low is None else f" (95 % CI {iv.low:+.3f} to {iv.high:+.3f})"
    verdict = "accepted: not worse than the incumbent" if accepted else "rejected: worse than the incumbent"
    return GateDecision(accepted, iv, f"{verdict}, paired success difference {iv.estimate:+.3f}{ci} "
                                      f"on {iv.n} validation tasks")


@dataclass(frozen=True)
class RetentionCheck:
    """A candidate on one retention world's validation tasks, paired against the starting model
    (what the gate tests) and against the incumbent (what the round changed)."""

    world: str
    vs_start: Interval
    vs_incumbent: Interval
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.vs_start.estimate >= -self.tolerance - 1e-12

    def to_dict(self) -> dict[str, Any]:
        return {"vs_start": self.vs_start.to_dict(), "vs_incumbent": self.vs_incumbent.to_dict(),
                "tolerance": self.tolerance, "ok": self.ok}


def retention_check(world: str, candidate: Sequence[bool], start: Sequence[bool], incumbent: Sequence[bool],
                    tolerance: float) -> RetentionCheck:
    """Only a drop counts: a candidate whose retention rose always passes."""
    if not (len(candidate) == len(start) == len(incumbent)) or not candidate:
        raise ValueError(f"retention {world}: {len(candidate)} candidate, {len(start)} start and "
                         f"{len(incumbent)} incumbent results")
    diff = lambda a, b: mean_interval([float(x) - float(y) for x, y in zip(a, b)])  # noqa: E731
    return RetentionCheck(world, diff(candidate, start), diff(candidate, incumbent), tolerance)


def gate_with_retention(target: GateDecision, checks: Sequence[RetentionCheck]) -> GateDecision:
    """The target gate, then every retention world: a drop beyond its tolerance against the
    starting model rejects a candidate the target would accept."""
    failed = [c for c in checks if not c.ok]
    parts = [f"{c.world} {c.vs_start.estimate:+.3f} vs start" for c in checks]
    if not failed:
        return GateDecision(target.accepted, target.diff,
                            target.reason + (f"; retention kept ({', '.join(parts)})" if checks else ""))
    worst = ", ".join(f"{c.world} {c.vs_start.estimate:+.3f} vs start (tolerance −{c.tolerance:.3f})" for c in failed)
    reason = f"rejected: forgets ({worst}); target: {target.reason}"
    return GateDecision(False, target.diff, reason)


def round_seed(seed: int, round_no: int) -> int:
    """A round's seed: distinct for every (evolve.seed, round)."""
    return seed * 1_000_003 + round_no


def round_cost(n_rollouts: int, methods: Sequence[str], steps: int, rollouts_per_step: int) -> int:
    """Rollouts a round spends: its own plus those its training methods generate."""
    return n_rollouts + sum(steps * rollouts_per_step for m in methods if m in TRAINS_ON_ROLLOUTS)


def check_passed(check: dict | None) -> bool:
    """The before-training check found a teacher advantage: the latent teacher's NLL is below
    the no-block NLL with the whole 95 % interval (train/check.py, gap none − learned)."""
    gap = ((check or {}).get("gaps") or {}).get("none-learned")
    return bool(gap) and gap["ci95"][0] > 0


def auto_plan(round_no: int, check: dict | None, winner: str | None, won_round: int | None = None) -> tuple[list[str], str]:
    """`algo: auto`: the round's candidate methods and the one line that says why."""
    if winner is not None:
        return [winner], f"auto: {winner} — it won round {won_round} on validation"
    if check is None:
        return ["sft"], "auto: sft — no before-training check in this project (`lopd coldstart` ends with one)"
    g = check["gaps"]["none-learned"]
    figure = f"latents {g['mean']:+.3f} nats/token against no block, 95 % CI {g['ci95'][0]:+.3f} to {g['ci95'][1]:+.3f}"
    if check_passed(check):
        return ["sft", "lopd"], f"auto: sft and lopd — the check found a teacher advantage ({figure}); the better on validation is kept"
    return ["sft"], f"auto: sft — the check found no teacher advantage ({figure})"


# ----------------------------------------------------------------------------- files


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_jsonl_atomic(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def is_evolve_run(path: Path) -> bool:
    return (Path(path) / EVOLVE_STATE).is_file()


def read_rounds(run_dir: Path) -> list[dict]:
    """rounds.jsonl of an evolve run (round 0 first)."""
    f = Path(run_dir) / ROUNDS_FILE
    if not f.is_file():
        raise LopdError(f"{run_dir}: no {ROUNDS_FILE} (is this an evolve run folder?)")
    return read_jsonl(f)


def _relink(link: Path, target: Path | None) -> None:
    """Point `link` at `target` (relative), atomically; remove it when target is None."""
    if target is None:
        if link.is_symlink() or link.exists():
            link.unlink()
        return
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(os.path.relpath(target, link.parent))
    tmp.replace(link)


# ----------------------------------------------------------------------------- the run


@dataclass
class EvolveRun:
    project: Any  # project.Project
    recipe: Any  # config.Recipe (the user's, with --set values)
    recipe_path: Path
    overrides: list[str]
    run_dir: Path
    state: dict

    @property
    def cfg(self):
        return self.recipe.evolve

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def steps(self) -> int:
        return self.cfg.steps or self.recipe.train.steps

    def save(self) -> None:
        write_json_atomic(self.run_dir / EVOLVE_STATE, self.state)

    def path(self, rel: str | None) -> Path | None:
        """A path the state records (relative to the run folder when inside it)."""
        if rel is None:
            return None
        p = Path(rel)
        return p if p.is_absolute() else self.run_dir / p

    def rel(self, p: Path) -> str:
        p = Path(p).resolve()
        try:
            return str(p.relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(p)

    def round_dir(self, k: int) -> Path:
        return self.run_dir / "rounds" / f"r{k:02d}"

    @property
    def retain(self) -> dict[str, Any]:
        """The retention worlds' recipes by the names evolve.retain gives them (loaded once)."""
        if "_retain" not in self.__dict__:
            from lopd_cli.config import load_recipe

            self.__dict__["_retain"] = {w: load_recipe(Path(p)) for w, p in self.state.get("retain", {}).items()}
        return self.__dict__["_retain"]

    def record(self, k: int) -> dict:
        """The state's record of round k (created empty)."""
        rounds = self.state["rounds"]
        while len(rounds) <= k:
            rounds.append({"round": len(rounds), "stages": {}, "done": False})
        return rounds[k]


def _load_recipe(path: Path, overrides: list[str], train: dict[str, Any] | None = None):
    """The user's recipe with its --set values and, for a round, evolve's train.* values."""
    from lopd_cli.config import apply_overrides, read_yaml, recipe_from_dict

    data = apply_overrides(read_yaml(path), list(overrides))
    for key, value in (train or {}).items():
        node = data
        *parents, leaf = TRAIN_KEYS[key].split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):  # absent, or an empty section (`train:`)
                node[p] = {}
            node = node[p]
        node[leaf] = value
    return recipe_from_dict(data, where=str(path), source=path)


def newest_check(project) -> tuple[dict | None, Path | None]:
    """The before-training check of the newest cold start in the project (its summary.json)."""
    found = []
    for f in project.runs_dir.glob("*/summary.json"):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "composer" in data:
            found.append((f.stat().st_mtime, f, data))
    if not found:
        return None, None
    _, f, data = max(found, key=lambda x: x[0])
    return data.get("check"), f


def _train_tasks_of_round(env_factory, cfg, k: int, solved: frozenset[str] = frozenset()) -> list:
    """Round k's rollout tasks: a seeded draw of tasks_per_round training tasks (all when None),
    each repeated samples_per_task times. With `unsolved_first` the draw takes tasks whose id is
    not in `solved` (the bank's successes) before any solved one."""
    from lopd_cli.agent.runner import select_tasks

    tasks = select_tasks(env_factory, "train", None)
    if cfg.tasks_per_round is not None and cfg.tasks_per_round < len(tasks):
        rng = random.Random(round_seed(cfg.seed, k))
        if cfg.unsolved_first:
            fresh = [i for i, t in enumerate(tasks) if str(t.id) not in solved]
            done = [i for i, t in enumerate(tasks) if str(t.id) in solved]
            rng.shuffle(fresh)
            rng.shuffle(done)
            picked = (fresh + done)[:cfg.tasks_per_round]
        else:
            picked = rng.sample(range(len(tasks)), cfg.tasks_per_round)
        tasks = [tasks[i] for i in sorted(picked)]
    return [t for t in tasks for _ in range(cfg.samples_per_task)]


def solved_task_ids(project, recipe) -> frozenset[str]:
    """Task ids the bank holds a success of, as SFT counts one (train/sft.py `successful_rows`)."""
    from lopd_cli.bank.store import Bank
    from lopd_cli.train.sft import successful_rows

    path = project.bank_path(recipe)
    if not path.exists():
        return frozenset()
    with Bank(path, recipe.bank.min_reward, create=False) as bank:
        return frozenset(str(it.task_id) for it in successful_rows(bank, recipe.eval.success_threshold))


def _round_methods(run: EvolveRun, k: int) -> tuple[list[str], str | None]:
    algo = run.state["algo"]
    if algo != "auto":
        return [algo], None
    return auto_plan(k, run.state.get("check"), run.state.get("winner"), run.state.get("winner_round"))


def _round_cost(run: EvolveRun, env_factory, k: int) -> int:
    methods, _ = _round_methods(run, k)
    recovery = run.cfg.recover_steps * sum(r.rollout.rollouts_per_step for r in run.retain.values())
    return round_cost(len(_train_tasks_of_round(env_factory, run.cfg, k)), methods, run.steps,
                      run.recipe.rollout.rollouts_per_step) + len(methods) * recovery


def open_evolve(project, recipe: str | None = None, overrides: Sequence[str] = (), run: str | None = None,
                rounds: int | None = None, algo: str | None = None, resume: bool = False) -> EvolveRun:
    """A new evolve run (checked, folder and state written) or, with `resume`, an existing one."""
    from lopd_cli.agent.runner import make_env_factory
    from lopd_cli.project import find_recipe

    if algo is not None and algo not in ALGOS:
        raise LopdError(f"--algo '{algo}': choose {', '.join(ALGOS[:-1])} or auto")
    if resume:
        return _reopen(project, recipe, list(overrides), run, rounds, algo)
    recipe_path = find_recipe(recipe or project.settings.recipe, project)
    r = _load_recipe(recipe_path, list(overrides))
    run_dir = project.new_run_dir(run, "evolve")
    if run_dir.exists():
        raise LopdError(f"{run_dir} already exists (use --resume to continue it, or another --run)")
    cfg = r.evolve
    algo = algo or cfg.algo
    env_factory = make_env_factory(r)
    try:
        has_val = bool(env_factory().tasks("validation"))
    except Exception:  # noqa: BLE001 (an env that does not know the split)
        has_val = False
    if not has_val:
        raise LopdError(f"evolve: the environment {r.env.label} has no validation tasks; "
                        "the gate compares students on them")
    if not (cfg.steps or r.train.steps):
        raise LopdError("evolve.steps: train.steps is 0, so a round would train nothing; set evolve.steps")
    start = _start_model(project, r)
    retain = retain_worlds(project, r)
    state: dict[str, Any] = {
        "version": STATE_VERSION, "name": run_dir.name, "recipe": str(recipe_path), "overrides": list(overrides),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rounds_wanted": rounds or cfg.rounds, "algo": algo, "start": start, "composer": None, "check": None,
        "check_file": None, "rounds": [], "incumbent": None, "rollouts_total": 0, "since_rise": 0,
        "winner": None, "winner_round": None, "stopped": None,
        "retain": {w: str(p) for w, p in retain.items()}, "start_retain": None,
    }
    if algo == "auto":
        state["check"], f = newest_check(project)
        state["check_file"] = str(f) if f else None
    needs_composer = algo == "lopd" or (algo == "auto" and check_passed(state["check"]))
    if needs_composer and not cfg.refresh_composer:
        from lopd_cli.train.loop import find_composer

        state["composer"] = str(find_composer(project, r).resolve())
    ev = EvolveRun(project, r, recipe_path, list(overrides), run_dir, state)
    cost = _round_cost(ev, env_factory, 1)
    if cfg.rollout_budget is not None and cost > cfg.rollout_budget:
        raise LopdError(f"evolve.rollout_budget ({cfg.rollout_budget}) is smaller than one round "
                        f"({cost} rollouts); raise it or lower evolve.tasks_per_round / samples_per_task")
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.yaml").write_text(r.to_yaml())
    ev.save()
    return ev


def world_label(name: str) -> str:
    """A retention world's label (files and rows): the recipe's file stem."""
    return Path(name).stem


def retain_worlds(project, recipe) -> dict[str, Path]:
    """evolve.retain's recipes, checked: each has validation tasks and the target's backbone."""
    from lopd_cli.agent.runner import make_env_factory
    from lopd_cli.config import load_recipe
    from lopd_cli.project import find_recipe

    out: dict[str, Path] = {}
    for name in recipe.evolve.retain:
        path = find_recipe(name, project)
        w = world_label(name)
        if w in out:
            raise LopdError(f"evolve.retain: two retention worlds are named {w}")
        r = load_recipe(path)
        if r.model.backbone != recipe.model.backbone:
            raise LopdError(f"evolve.retain: {path} uses the backbone {r.model.backbone}, the target "
                            f"{recipe.model.backbone}; a retention world scores the same student")
        if recipe.evolve.recover_steps and (r.model.student, r.model.lora) != (recipe.model.student, recipe.model.lora):
            raise LopdError(f"evolve.recover_steps: {path} trains a different student (model.student / model.lora) "
                            "than the target; the recovery phase continues the target's candidate in it")
        try:
            has_val = bool(make_env_factory(r)().tasks("validation"))
        except LopdError:
            raise
        except Exception:  # noqa: BLE001 (an env that does not know the split)
            has_val = False
        if not has_val:
            raise LopdError(f"evolve.retain: {path}: the environment {r.env.label} has no validation tasks")
        out[w] = path
    return out


def _start_model(project, recipe) -> dict:
    """Round 0's incumbent: train.init_from's student when the recipe sets it, else the backbone."""
    from lopd_cli.models.student import init_source

    info = init_source(project, recipe)
    if info is None:
        return {"checkpoint": None, "model": recipe.model.backbone}
    return {"checkpoint": str(info.path), "model": info.backbone}


def _reopen(project, recipe: str | None, overrides: list[str], run: str | None, rounds: int | None,
            algo: str | None) -> EvolveRun:
    from lopd_cli.project import find_recipe

    if run:
        run_dir = project.new_run_dir(run, "evolve")
    else:
        found = sorted((p.parent for p in project.runs_dir.glob(f"*/{EVOLVE_STATE}")), key=lambda p: p.stat().st_mtime)
        if not found:
            raise LopdError(f"--resume: no evolve run in {project.runs_dir} (name one with --run)")
        run_dir = found[-1]
    if not is_evolve_run(run_dir):
        raise LopdError(f"--resume: {run_dir} is not an evolve run (no {EVOLVE_STATE})")
    state = json.loads((run_dir / EVOLVE_STATE).read_text())
    recipe_path = Path(state["recipe"])
    if recipe is not None and find_recipe(recipe, project) != recipe_path:
        raise LopdError(f"--resume: {run_dir.name} runs the recipe {recipe_path}, not {recipe}")
    if overrides and overrides != state["overrides"]:
        raise LopdError(f"--resume: {run_dir.name} runs with --set {' '.join(state['overrides']) or '(none)'}; "
                        "a resumed run keeps its settings (drop --set)")
    if algo is not None and algo != state["algo"]:
        raise LopdError(f"--resume: {run_dir.name} runs --algo {state['algo']}, not {algo}")
    r = _load_recipe(recipe_path, state["overrides"])
    from lopd_cli.config import load_recipe

    saved = load_recipe(run_dir / "recipe.yaml").model_dump()
    mine = r.model_dump()
    if saved != mine:
        diff = [k for k in mine if mine[k] != saved.get(k)]
        raise LopdError(f"--resume: {recipe_path} differs from {run_dir / 'recipe.yaml'} in section(s) {', '.join(diff)}")
    if rounds is not None:
        state["rounds_wanted"] = rounds
        if state.get("stopped") == "rounds":
            state["stopped"] = None
    ev = EvolveRun(project, r, recipe_path, state["overrides"], run_dir, state)
    ev.save()
    write_derived(ev)
    return ev


# ----------------------------------------------------------------------------- stages


def _stage(run: EvolveRun, k: int, name: str, fn: Callable[[], dict], say: Say) -> dict:
    """Run stage `name` of round k unless the state records it done; record its result."""
    rec = run.record(k)
    if name in rec["stages"]:
        return rec["stages"][name]
    t0 = time.perf_counter()
    out = fn()
    out["seconds"] = round(time.perf_counter() - t0, 3)
    rec["stages"][name] = out
    run.save()
    return out


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load_policy(run: EvolveRun, checkpoint: str | None):
    from lopd_cli.models.student import load_policy

    r = run.recipe
    return load_policy(r, [r.base_dir, run.project.root], checkpoint=run.path(checkpoint))


def _validate(run: EvolveRun, checkpoint: str | None, out: Path, label: str, recipe=None) -> dict:
    """Greedy episodes of the policy on the gate's validation tasks (of the target world, or of
    a retention world's `recipe`), written to `out`."""
    import torch

    from lopd_cli.agent.runner import load_reward, make_env_factory, run_episodes
    from lopd_cli.results.evaluate import episode_figures, eval_tasks
    from lopd_cli.progress import counter

    r = recipe or run.recipe
    t0 = time.perf_counter()
    env_factory = make_env_factory(r)
    tasks = eval_tasks(env_factory, "validation", run.cfg.val_n)
    model, tok, produced_by = _load_policy(run, checkpoint)
    load_s = time.perf_counter() - t0
    with torch.no_grad(), counter(f"validate {label}", len(tasks)) as tick:
        eps = run_episodes(model, tok, env_factory, tasks, r.eval_rollout, seed=VALIDATION_SEED, reward_fn=load_reward(r),
                           progress=tick, temperature=0.0,
                           meta={**produced_by, "split": "validation", "phase": "evolve-validation",
                                 "evolve_run": run.name})
    del model
    _free()
    write_jsonl_atomic(out, [e.to_record() for e in eps])
    wins = [episode_figures(e, r.eval.success_threshold).success for e in eps]
    return {"file": run.rel(out), "load_seconds": round(load_s, 3), "task_ids": [e.task.id for e in eps], "successes": wins,
            "success": wilson_interval(sum(wins), len(wins)).to_dict(),
            "reward": sum(e.reward for e in eps) / max(1, len(eps)), "errors": sum(e.error is not None for e in eps)}


def _rollouts(run: EvolveRun, k: int) -> dict:
    import torch

    from lopd_cli.agent.runner import load_reward, make_env_factory, run_episodes
    from lopd_cli.progress import counter

    r, cfg = run.recipe, run.cfg
    t0 = time.perf_counter()
    env_factory = make_env_factory(r)
    solved = solved_task_ids(run.project, r) if cfg.unsolved_first else frozenset()
    tasks = _train_tasks_of_round(env_factory, cfg, k, solved)
    checkpoint = run.state["incumbent"]["checkpoint"]
    model, tok, produced_by = _load_policy(run, checkpoint)
    load_s = time.perf_counter() - t0
    meta = {**produced_by, "split": "train", "generated_by": "lopd", "phase": "evolve", "evolve_run": run.name,
            "evolve_round": k, "checkpoint": str(run.path(checkpoint)) if checkpoint else None}
    with torch.no_grad(), counter(f"round {k}: rollouts", len(tasks)) as tick:
        eps = run_episodes(model, tok, env_factory, tasks, r.rollout, seed=round_seed(cfg.seed, k),
                           reward_fn=load_reward(r), progress=tick, temperature=cfg.temperature, meta=meta)
    del model
    _free()
    errors = sum(e.error is not None for e in eps)
    if errors > len(eps) / 2:
        first = next(e.error for e in eps if e.error)
        raise LopdError(f"round {k}: {errors} of {len(eps)} rollouts failed in the environment (first: {first})")
    out = run.round_dir(k) / "rollouts.jsonl"
    write_jsonl_atomic(out, [e.to_record() for e in eps])
    thr = r.eval.success_threshold
    wins = sum(e.error is None and e.reward >= thr - 1e-9 for e in eps)
    run.state["rollouts_total"] += len(eps)
    return {"file": run.rel(out), "load_seconds": round(load_s, 3), "n": len(eps), "successes": wins, "errors": errors,
            "temperature": r.rollout.temperature if cfg.temperature is None else cfg.temperature}


def _bank(run: EvolveRun, k: int) -> dict:
    """Add the round's episodes; the counts come from the rows' provenance (idempotent)."""
    from lopd_cli.bank.store import Bank

    r = run.recipe
    records = read_jsonl(run.path(run.record(k)["stages"]["rollouts"]["file"]))
    with Bank(run.project.bank_path(r), r.bank.min_reward) as bank:
        bank.add_records(records, source=f"evolve:{run.name}:round{k}")
        added, good = bank.conn.execute(
            "SELECT count(*), coalesce(sum(success), 0) FROM rollouts "
            "WHERE json_extract(meta, '$.evolve_run') = ? AND json_extract(meta, '$.evolve_round') = ?",
            (run.name, k)).fetchone()
        size, successes = bank.count(), bank.count(success_only=True)
    return {"added": added, "successes_added": good, "duplicates": len(records) - added,
            "bank_size": size, "bank_successes": successes}


def _needs_index(run: EvolveRun, methods: Sequence[str]) -> bool:
    return any(m in ("lopd", "opsd") for m in methods) or (run.project.index_dir(run.recipe) / "index.json").is_file()


def _index(run: EvolveRun) -> dict:
    from lopd_cli.bank.index import build_index

    rep = build_index(run.project, run.recipe, progress=False)
    return {"indexed": rep.total}


def _coldstart(run: EvolveRun, k: int) -> dict:
    from lopd_cli.train.coldstart import run_coldstart

    out = run.round_dir(k) / "coldstart"
    shutil.rmtree(out, ignore_errors=True)
    r = _load_recipe(run.recipe_path, [*run.overrides, f"coldstart.steps={run.cfg.refresh_composer}"])
    summary = run_coldstart(run.project, r, out, show_progress=False)
    return {"composer": run.rel(Path(summary["composer"])), "check": summary.get("check")}


def _train(run: EvolveRun, k: int, method: str, say: Say) -> dict:
    from lopd_cli.progress import counter
    from lopd_cli.train.loop import train
    from lopd_cli.train.checkpoint import resolve_checkpoint

    cfg = run.cfg
    out = run.round_dir(k) / f"train-{method}"
    shutil.rmtree(out, ignore_errors=True)  # a killed attempt is redone from scratch
    start = run.state["start"]["checkpoint"]
    init = run.state["incumbent"]["checkpoint"] if cfg.start == "incumbent" else start
    values: dict[str, Any] = {
        "algo": method, "steps": run.steps, "seed": round_seed(cfg.seed, k), "save_every": run.steps, "eval_every": 0,
        "init_from": str(run.path(init)) if init else None, "prior_rollouts": run.state["rollouts_total"],
    }
    if method == "lopd":
        composer = run.record(k)["stages"].get("coldstart", {}).get("composer") or run.state["composer"]
        values["composer_from"] = str(run.path(composer))
    r = _load_recipe(run.recipe_path, run.overrides, values)
    out.parent.mkdir(parents=True, exist_ok=True)
    steps_s: list[float] = []
    with counter(f"round {k}: {method} steps", run.steps) as tick:
        tr = train(run.project, r, out, on_step=lambda row: (tick(1), steps_s.append(row.get("sec_step", 0.0))))
    spent = tr.state.rollouts_total - values["prior_rollouts"]
    del tr
    _free()
    run.state["rollouts_total"] += spent
    return {"run": run.rel(out), "checkpoint": run.rel(resolve_checkpoint(out)), "rollouts": spent,
            "step_seconds": round(sum(steps_s), 3)}


def _recover(run: EvolveRun, k: int, method: str, world: str, checkpoint: str) -> dict:
    """The recovery phase in one retention world: `distill` (on-policy distillation, no
    privileged context) of the candidate on the world's training tasks, with the frozen starting
    model as the teacher (its student via train.teacher_from, or the plain backbone)."""
    from lopd_cli.config import load_recipe
    from lopd_cli.progress import counter
    from lopd_cli.train.checkpoint import resolve_checkpoint
    from lopd_cli.train.loop import train

    cfg = run.cfg
    out = run.round_dir(k) / f"recover-{method}-{world}"
    shutil.rmtree(out, ignore_errors=True)
    start = run.state["start"]["checkpoint"]
    prior = run.state["rollouts_total"]
    over = ["train.algo=distill", f"train.steps={cfg.recover_steps}", f"train.seed={round_seed(cfg.seed, k)}",
            f"train.save_every={cfg.recover_steps}", "train.eval_every=0", f"train.init_from={run.path(checkpoint)}",
            f"train.prior_rollouts={prior}", "train.teacher=base",
            f"train.teacher_from={run.path(start) if start else 'null'}"]
    r = load_recipe(run.state["retain"][world], over)
    steps_s: list[float] = []
    with counter(f"round {k}: recovery on {world}", cfg.recover_steps) as tick:
        tr = train(run.project, r, out, on_step=lambda row: (tick(1), steps_s.append(row.get("sec_step", 0.0))))
    spent = tr.state.rollouts_total - prior
    del tr
    _free()
    run.state["rollouts_total"] += spent
    return {"run": run.rel(out), "checkpoint": run.rel(resolve_checkpoint(out)), "rollouts": spent,
            "step_seconds": round(sum(steps_s), 3)}


# ----------------------------------------------------------------------------- rounds


@dataclass
class EvolveResult:
    run_dir: Path
    rounds: list[dict]  # rounds.jsonl rows
    incumbent: dict
    stopped: str


def run_evolve(run: EvolveRun, say: Say = print) -> EvolveResult:
    """Run (or continue) the rounds until a stop rule holds. Prints one line per stage result."""
    from lopd_cli.agent.runner import make_env_factory

    env_factory = make_env_factory(run.recipe)
    st = run.state
    if st["incumbent"] is None:
        res = _stage(run, 0, "validate:start", lambda: _validate(
            run, st["start"]["checkpoint"], run.round_dir(0) / "validation-start.jsonl", "the starting model"), say)
        kept = {w: _stage(run, 0, f"retain:start:{w}", lambda w=w: _validate(
            run, st["start"]["checkpoint"], run.round_dir(0) / f"retain-{w}-start.jsonl", f"the starting model on {w}",
            run.retain[w]), say) for w in run.retain}
        st["start_retain"] = {w: v["successes"] for w, v in kept.items()}
        st["incumbent"] = {"round": 0, "method": "start", "checkpoint": st["start"]["checkpoint"],
                           "successes": res["successes"], "success": res["success"], "retain": st["start_retain"]}
        run.record(0)["done"] = True
        run.save()
        write_derived(run)
        say(f"round 0: the starting model ({st['start']['checkpoint'] or st['start']['model']}): "
            f"validation success {_pct(res['success'])}"
            + "".join(f"; retention {w} {_pct(v['success'])}" for w, v in kept.items()))
    while True:
        k = len([x for x in st["rounds"] if x["done"]])
        started = k < len(st["rounds"]) and bool(st["rounds"][k]["stages"])
        if not started:
            stop = _stop_reason(run, env_factory, k)
            if stop:
                st["stopped"] = stop
                run.save()
                say(f"stopped: {stop}")
                break
        _run_round(run, k, say)
    return EvolveResult(run.run_dir, read_rounds(run.run_dir), st["incumbent"], st["stopped"])


def _stop_reason(run: EvolveRun, env_factory, k: int) -> str | None:
    st, cfg = run.state, run.cfg
    if k > st["rounds_wanted"]:
        return f"{st['rounds_wanted']} round(s) done"
    if cfg.patience is not None and st["since_rise"] >= cfg.patience:
        return f"evolve.patience: {st['since_rise']} round(s) without a rise in validation success"
    if cfg.rollout_budget is not None:
        cost = _round_cost(run, env_factory, k)
        if st["rollouts_total"] + cost > cfg.rollout_budget:
            return (f"evolve.rollout_budget: round {k} would spend {cost} rollouts, "
                    f"{st['rollouts_total']} of {cfg.rollout_budget} are spent")
    return None


def _pct(iv: dict) -> str:
    return f"{100 * iv['mean']:.1f} % [{100 * iv['low']:.1f}, {100 * iv['high']:.1f}]"


def _run_round(run: EvolveRun, k: int, say: Say) -> None:
    st = run.state
    rec = run.record(k)
    methods, line = _round_methods(run, k)
    if not rec["stages"]:
        rec["methods"], rec["auto"] = methods, line
        run.save()
    methods, line = rec["methods"], rec["auto"]
    if line:
        say(line)
    ro = _stage(run, k, "rollouts", lambda: _rollouts(run, k), say)
    b = _stage(run, k, "bank", lambda: _bank(run, k), say)
    say(f"round {k}: {ro['n']} rollouts, {ro['successes']} successful; bank +{b['added']} rows "
        f"({b['successes_added']} successes, {b['duplicates']} duplicates) → {b['bank_size']} rows")
    if _needs_index(run, methods):
        _stage(run, k, "index", lambda: _index(run), say)
    if "lopd" in methods and run.cfg.refresh_composer:
        _stage(run, k, "coldstart", lambda: _coldstart(run, k), say)
    vals, kept, checks, cand = {}, {}, {}, {}
    for m in methods:
        t = _stage(run, k, f"train:{m}", lambda m=m: _train(run, k, m, say), say)
        ck = t["checkpoint"]
        for w in run.retain if run.cfg.recover_steps else ():
            rv = _stage(run, k, f"recover:{m}:{w}", lambda m=m, w=w, ck=ck: _recover(run, k, m, w, ck), say)
            ck = rv["checkpoint"]
        cand[m] = ck
        vals[m] = _stage(run, k, f"validate:{m}", lambda m=m, ck=ck: _validate(
            run, ck, run.round_dir(k) / f"validation-{m}.jsonl", f"round {k} {m}"), say)
        kept[m] = {w: _stage(run, k, f"retain:{m}:{w}", lambda m=m, ck=ck, w=w: _validate(
            run, ck, run.round_dir(k) / f"retain-{w}-{m}.jsonl", f"round {k} {m} on {w}",
            run.retain[w]), say) for w in run.retain}
        checks[m] = [retention_check(w, kept[m][w]["successes"], st["start_retain"][w],
                                     st["incumbent"]["retain"][w], run.cfg.retain_tolerance) for w in run.retain]
    # A candidate that keeps its retention beats one that forgets; then validation success.
    best = max(methods, key=lambda m: (all(c.ok for c in checks[m]), vals[m]["success"]["mean"], -methods.index(m)))

    def gate() -> dict:
        inc = st["incumbent"]
        d = gate_with_retention(paired_gate(vals[best]["successes"], inc["successes"]), checks[best])
        rose = d.accepted and vals[best]["success"]["mean"] > inc["success"]["mean"]
        out = {**d.to_dict(), "method": best, "checkpoint": cand[best], "incumbent_before": inc["round"],
               "incumbent_success": inc["success"], "retention": {c.world: c.to_dict() for c in checks[best]}}
        if d.accepted:
            st["incumbent"] = {"round": k, "method": best, "checkpoint": cand[best],
                               "successes": vals[best]["successes"], "success": vals[best]["success"],
                               "retain": {w: v["successes"] for w, v in kept[best].items()}}
        st["since_rise"] = 0 if rose else st["since_rise"] + 1
        if len(methods) > 1:
            st["winner"], st["winner_round"] = best, k
        rec["done"] = True
        return out

    g = _stage(run, k, "gate", gate, say)
    write_derived(run)
    others = ", ".join(f"{m} {_pct(vals[m]['success'])}" for m in methods if m != best)
    kept_line = "".join(f"; retention {w} {_pct(v['success'])}" for w, v in kept[best].items())
    say(f"round {k}: {best} validation success {_pct(vals[best]['success'])}"
        + (f" (beat {others})" if others else "") + kept_line + f"; {g['reason']}")


# ----------------------------------------------------------------------------- derived files


def round_row(run: EvolveRun, rec: dict) -> dict:
    """rounds.jsonl's row of a finished round, from the state."""
    s = rec["stages"]
    seconds = {name: v.get("seconds") for name, v in s.items()}
    if rec["round"] == 0:
        v = s["validate:start"]
        return {"round": 0, "method": "start", "checkpoint": run.state["start"]["checkpoint"], "rollouts": 0,
                "rollouts_total": 0, "validation": v["success"], "incumbent_validation": v["success"],
                "retention": {w: {"success": s[f"retain:start:{w}"]["success"]} for w in run.state.get("retain", {})},
                "accepted": True, "reason": "the starting model", "incumbent_round": 0, "seconds": seconds}
    g = s["gate"]
    best = g["method"]
    spent = s["rollouts"]["n"] + sum(v["rollouts"] for name, v in s.items() if name.startswith(("train:", "recover:")))
    return {
        "round": rec["round"], "method": best, "methods": rec["methods"], "auto": rec.get("auto"),
        "checkpoint": g.get("checkpoint", s[f"train:{best}"]["checkpoint"]),
        "rollouts": spent, "rollouts_total": None,  # filled in by write_derived
        "rollout_successes": s["rollouts"]["successes"], "bank_size": s["bank"]["bank_size"],
        "bank_successes": s["bank"]["bank_successes"], "added": s["bank"]["added"],
        "successes_added": s["bank"]["successes_added"], "duplicates": s["bank"]["duplicates"],
        "validation": s[f"validate:{best}"]["success"],
        "candidates": {m: s[f"validate:{m}"]["success"] for m in rec["methods"]},
        "retention": {w: {"success": s[f"retain:{best}:{w}"]["success"], **c}
                      for w, c in g.get("retention", {}).items()},
        "incumbent_validation_before": g["incumbent_success"], "paired_diff": g["paired_diff"],
        "accepted": g["accepted"], "reason": g["reason"], "seconds": seconds, "time_split": time_split(s),
    }


def time_split(stages: dict) -> dict[str, float]:
    """Where a round's seconds went: generating its rollouts, training steps (the steps' own
    seconds, recovery's included), greedy validation (target and retention), the bank and the
    index, and set-up (loading models and environments, building trainers, checkpoints)."""
    split = {"rollouts": 0.0, "training_steps": 0.0, "validation": 0.0, "bank_index": 0.0, "setup": 0.0}
    for name, v in stages.items():
        sec, load = v.get("seconds") or 0.0, v.get("load_seconds") or 0.0
        if name == "rollouts":
            split["rollouts"] += sec - load
            split["setup"] += load
        elif name.startswith(("train:", "recover:")):
            steps = v.get("step_seconds") or 0.0
            split["training_steps"] += steps
            split["setup"] += sec - steps
        elif name.startswith(("validate:", "retain:")):
            split["validation"] += sec - load
            split["setup"] += load
        elif name in ("bank", "index", "coldstart"):
            split["bank_index"] += sec
    return {k: round(v, 3) for k, v in split.items()}


def write_derived(run: EvolveRun) -> None:
    """rounds.jsonl and the incumbent link, rebuilt from the state (so a kill between the state
    and these files loses nothing)."""
    rows, total, incumbent = [], 0, 0
    for rec in run.state["rounds"]:
        if not rec["done"]:
            break
        row = round_row(run, rec)
        total += row["rollouts"]
        row["rollouts_total"] = total
        if row["accepted"]:
            incumbent = row["round"]
        row["incumbent_round"] = incumbent
        rows.append(row)
    write_jsonl_atomic(run.run_dir / ROUNDS_FILE, rows)
    inc = run.state.get("incumbent")
    _relink(run.run_dir / INCUMBENT, run.path(inc["checkpoint"]) if inc and inc["checkpoint"] else None)


def evolve(project, recipe: str | None = None, overrides: Sequence[str] = (), run: str | None = None,
           rounds: int | None = None, algo: str | None = None, resume: bool = False, say: Say = print) -> EvolveResult:
    """Open (or resume) an evolve run and run it to its stop rule: the library call of `lopd evolve`."""
    return run_evolve(open_evolve(project, recipe, overrides, run, rounds, algo, resume), say)
