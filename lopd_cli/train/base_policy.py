"""The tiny base policy for `orders`: short imitation of a noisy scripted oracle.

LOPD needs a base model that already succeeds sometimes, calls tools and can read a solved
example — and that lacks the knowledge LOPD should teach. The embedded `tiny` backbone has
random weights, so this module trains it (1,600 + 300 + 600 steps) on transcripts of the oracle
(`orders.oracle_plan`) in the house-rules world, on tasks of its own seed range ("base": no
train, validation or test task is among them) and under its own rule set
(`BASE_POLICY_RULES_SEED`, not the recipes'). The result ships in the package
(`lopd_cli/models/data/orders-base-tiny`, float16) and `lopd init --example orders --model tiny`
copies it; `python -m lopd_cli.train.base_policy` (`make base-policy`) rebuilds it bit for bit
from its seed, `--check` compares.

- Plain examples imitate the oracle with a mistake in 25 % of episodes (a wrong id, stopping
  early, an answer missing its fact), under the policy's own rules: alone it succeeds on some
  but not most tasks, and on a new rule set less often.
- Reading examples (half) carry 1-2 solved transcripts of other tasks of the same store and kind
  as text in the very frame the teachers use (`compose.latent.with_reference_block`), and imitate
  the clean oracle. Their task and references are re-drawn under a rule set drawn at random for
  that example, so the rule can only be read off the reference. An instruct LM has seen worked
  examples and does better with one in its prompt; a tiny model must be taught it. This builds
  in, on purpose and only for the tiny stand-in, the premise every privileged-context method
  relies on: a solved example of the same procedure in the prompt helps.
- Number tokens (ids, amounts) and rule tokens (the refund reason and sign-off the policy
  writes) weigh 10× in the loss: they are few among the format tokens, and copying them from
  the context is what a tiny model learns last (an induction-style drop of the loss around
  step 550-750). Version 4 weighted numbers only: it copied ids but read a rule off a
  reference no better than a guess among four (benchmarks/RESULTS.md, "House rules").
  Version 5 (900 steps) weighted rules too but stopped before the copying drop (build loss
  ~0.4-0.5; 10 % success under its own rules). Version 6 trains 1,600 steps: the drop comes
  around step 700-900 and the policy copies ids (37 % under its own rules).
- Version 7 adds a second phase (`SPREAD`, `build_base_policy`): 300 steps from version 6's
  weights in which the plain examples, too, follow a rule set drawn per example. Version 6 knew
  its own rule set by heart (a recipe store's first rule token cost it ~10 nats, its own 0.01),
  so a teacher on its samples had almost no mass to move; after phase 2 every rule set's first
  token costs about a guess among four (`benchmarks/rule_prior.py`). That is what an instruct
  model knows of a store it has never seen: the kinds of rules stores have, not which.
- Version 8 adds a third phase (`COPY`): 600 steps from version 7's weights, like phase 2, in
  which the words an assistant turn copies from the request or a tool result (an e-mail, a
  status; `copied_words.py`) weigh like rule tokens. Version 7 copied digits but not names: asked
  for "I am eva55@mail.com", it looked up "hana55@mail.com", and got the e-mail right in 5 of 48
  validation look-ups (version 8: 15), so the look-up tasks (two in five) were out of reach for
  every method. An instruct model copies a name from the request; the stand-in now does so
  sometimes (benchmarks/history/2026-12-05-base-policy-v8.md, which also records a 1,200-step
  phase 3 that was tried and reverted).

Training shares the prompt prefix all orders episodes have in common (system prompt + tool
schemas): it is run once per step (batch 1, with gradients) and its KV cache is repeated for
the batch, which makes a step several times cheaper than padding full conversations.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Callable

from lopd_cli.agent.chat import tokenize_transcript
from lopd_cli.agent.types import Task
from lopd_cli.envs.orders import OrdersEnv
from lopd_cli.envs.orders_agent import noisy_oracle_transcript

POLICY_VERSION = 8  # bump when the recipe below changes, so cached policies are rebuilt
DEFAULTS = dict(steps=1600, batch_size=16, lr=5e-3, noise=0.25, warmup=20, number_weight=10.0, rule_weight=10.0,
                reference_fraction=0.5, max_references=2, n_tasks=1024)
# Phase 2 (version 7), from phase 1's weights: plain examples under random rule sets, so that
# without a reference the policy spreads its bets over the rules stores use instead of knowing
# one rule set by heart (version 6 gave a recipe store's first rule token ~10 nats).
SPREAD = dict(steps=300, lr=1e-3, n_tasks=2048, plain_rules="random")  # n_tasks: 2x phase 1's
# Phase 3 (version 8), from phase 2's weights: as phase 2, with copied words weighing like rules.
COPY = dict(steps=600, lr=3e-3, n_tasks=2048, plain_rules="random", copies=True)
# The rule set the base policy learns: not the packaged recipes' (orders.RECIPE_RULES_SEED), so the
# demo's house rules are new to it, as a new store's would be to a team's existing agent.
BASE_POLICY_RULES_SEED = 101
# How reference text is cut: the orders-tiny recipe's bank.obs_char_budget and composer.max_item_tokens × 4
# (what OPSD's teacher reads, lopd_cli.train.teacher_nll.text_reference_chars).
REFERENCE_OBS_CHARS, REFERENCE_MAX_CHARS = 600, 1536


def with_text_references(messages: list[dict], references: list, rng: random.Random,
                         max_references: int) -> list[dict]:
    """`messages` with 1..max_references of `references` (solved transcripts of other tasks) as
    plain text in the teacher's reference frame (`compose.latent.with_reference_block`)."""
    from lopd_cli.compose.latent import text_reference_block, with_reference_block

    if not references:
        return messages
    picked = rng.sample(references, min(len(references), rng.randint(1, max_references)))
    return with_reference_block(messages, text_reference_block(picked, REFERENCE_OBS_CHARS, REFERENCE_MAX_CHARS))


def base_policy_tasks(n: int, rules_seed: int | None = BASE_POLICY_RULES_SEED) -> list[Task]:
    """The base policy's own orders tasks: a seed range no train, validation or test task comes
    from (and any task that an env split also holds is skipped), so every diagnostic and
    evaluation of a project scores tasks the base policy never saw."""
    from lopd_cli.envs.orders import generate_tasks, task_fingerprint

    held = {task_fingerprint(t) for hr in (False, True) for s in ("train", "validation", "test")
            for t in OrdersEnv(house_rules=hr).tasks(s)}
    return generate_tasks("base", n, held, rules_seed)


def _examples(tokenizer, tasks: list[Task], rng: random.Random, noise: float, reference_fraction: float = 0.0,
              max_references: int = DEFAULTS["max_references"],
              plain_rules: str = "own", copies: bool = False) -> list[tuple[list[int], list[int]]]:
    """(ids, action mask) per task. Plain examples imitate the noisy oracle under the tasks' own
    rules. Reading examples (`reference_fraction`) carry 1..max_references solved transcripts of
    other tasks of the same store and kind in the teacher's reference frame and imitate the clean
    oracle; with house rules they are all re-drawn under a *random* rule set, shared by the task
    and its references, so the only way to get the rule right is to read it off a reference.
    `plain_rules="random"` re-draws the plain examples under a random rule set too, so that
    without a reference the policy learns only the spread of rules stores use, not one rule set.
    `copies` marks the action tokens that copy a word of the conversation like rule tokens."""
    from types import SimpleNamespace

    from lopd_cli.envs.orders import make_task, random_store_rules
    from lopd_cli.train.copied_words import copied_token_mask

    def group(t: Task) -> tuple:
        return (t.data.get("kind"), t.data.get("store"))

    pool: dict[tuple, list[Task]] = {}
    for task in tasks:
        pool.setdefault(group(task), []).append(task)
    clean = random.Random(0)
    out = []
    for task in tasks:
        if rng.random() < reference_fraction:  # a solved example in the prompt: imitate the clean oracle
            others = [t for t in pool[group(task)] if t.instruction != task.instruction]
            if "rules" in task.data:
                rules = random_store_rules(rng)
                split = task.split
                task = make_task(task.data["seed"], split, rules=rules)
                others = [make_task(t.data["seed"], split, rules=rules) for t in others]
            refs = [SimpleNamespace(instruction=t.instruction, messages=noisy_oracle_transcript(t, clean, 0.0))
                    for t in others]
            messages = with_text_references(noisy_oracle_transcript(task, rng, 0.0), refs, rng, max_references)
        else:
            if plain_rules == "random" and "rules" in task.data:
                task = make_task(task.data["seed"], task.split, rules=random_store_rules(rng))
            messages = noisy_oracle_transcript(task, rng, noise)
        ids, mask = tokenize_transcript(tokenizer, messages, task.tools)
        if "rules" in task.data:
            mask = mark_rule_tokens(tokenizer, ids, mask, task.data["rules"])
        if copies:
            copied = copied_token_mask(tokenizer, ids, mask, messages, task.tools)
            mask = [2 if c else m for m, c in zip(mask, copied)]
        out.append((ids, mask))
    return out


def mark_rule_tokens(tokenizer, ids: list[int], mask: list[int], rules: dict) -> list[int]:
    """The action mask with 2 (instead of 1) on the action tokens that spell a house rule (the
    refund reason, the sign-off), which the loss weighs `rule_weight` times: like numbers, they
    are few among the format tokens, and reading them off a reference is the skill that a tiny
    model otherwise learns last."""
    from lopd_cli.train.check import rule_token_mask

    start = mask.index(1) if 1 in mask else len(mask)
    marks = iter(rule_token_mask(tokenizer, ids[start:], mask[start:], [rules["refund_reason"], rules["sign_off"]]))
    return [m if i < start or not m else (2 if next(marks) else 1) for i, m in enumerate(mask)]


def number_token_ids(tokenizer) -> list[int]:
    """Ids of tokens that are digits (optionally after a space marker): ids and amounts."""
    out = []
    for tok, i in tokenizer.get_vocab().items():
        text = tok.lstrip("Ġ▁ ")
        if text and text.replace(".", "").isdigit():
            out.append(i)
    return out


def _common_prefix_len(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        if any(s[i] != first[i] for s in seqs):
            return i
    return n


def _length_bucketed(data: list, rng: random.Random, batch_size: int) -> list[int]:
    """A shuffled epoch in which each run of 8 batches is sorted by length (less padding)."""
    idx = rng.sample(range(len(data)), len(data))
    span = batch_size * 8
    out = []
    for lo in range(0, len(idx), span):
        out += sorted(idx[lo: lo + span], key=lambda i: len(data[i][0]))
    batches = [out[i: i + batch_size] for i in range(0, len(out), batch_size)]
    rng.shuffle(batches)
    return [i for b in batches for i in b]


def train_orders_base_policy(
    out_dir: Path,
    backbone: str = "tiny",
    seed: int = 0,
    steps: int = DEFAULTS["steps"],
    batch_size: int = DEFAULTS["batch_size"],
    lr: float = DEFAULTS["lr"],
    noise: float = DEFAULTS["noise"],
    number_weight: float = DEFAULTS["number_weight"],
    rule_weight: float = DEFAULTS["rule_weight"],
    reference_fraction: float = DEFAULTS["reference_fraction"],
    n_tasks: int = DEFAULTS["n_tasks"],
    rules_seed: int | None = BASE_POLICY_RULES_SEED,
    plain_rules: str = "own",
    copies: bool = False,
    init_from: Path | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> Path:
    """Train the base policy by imitation of the noisy oracle on the orders train split and save
    it (model + tokenizer) to `out_dir`. `progress(step, steps, loss)` after each step.

    Number tokens the policy writes (ids, amounts) weigh `number_weight` times more in the loss:
    they are few among the format tokens, and a tiny model otherwise learns to copy them from
    the context only after many more steps."""
    import torch

    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.runtime import setup_torch

    setup_torch()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tokenizer = load_backbone(str(init_from) if init_from else backbone, device="cpu")
    tasks = base_policy_tasks(n_tasks, rules_seed)
    data = _examples(tokenizer, tasks, rng, noise, reference_fraction, DEFAULTS["max_references"], plain_rules,
                     copies)
    plen = _common_prefix_len([ids for ids, _ in data]) - 1  # keep >= 1 token in every suffix
    prefix = torch.tensor([data[0][0][:plen]])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / DEFAULTS["warmup"]) * max(0.05, 1 - s / max(1, steps)))
    pad = tokenizer.pad_token_id
    is_number = torch.zeros(len(tokenizer), dtype=torch.float32)
    is_number[number_token_ids(tokenizer)] = 1.0
    order: list[int] = []
    for step in range(steps):
        if len(order) < batch_size:
            order += _length_bucketed(data, rng, batch_size)
        batch = [data[i] for i in order[:batch_size]]
        del order[:batch_size]
        width = max(len(ids) for ids, _ in batch) - plen
        x = torch.full((len(batch), width), pad, dtype=torch.long)
        m = torch.zeros((len(batch), width), dtype=torch.float32)
        for r, (ids, mask) in enumerate(batch):
            x[r, : len(ids) - plen] = torch.tensor(ids[plen:])
            m[r, : len(ids) - plen] = torch.tensor(mask[plen:], dtype=torch.float32)
        cache = model(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(batch))
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits
        # Suffix position j predicts suffix token j + 1 (right padding never feeds the loss).
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, x[:, 1:, None]).squeeze(-1)
        weight = torch.where(m[:, 1:] > 1, rule_weight, 1.0 + (number_weight - 1.0) * is_number[x[:, 1:]])
        target = (m[:, 1:] > 0).float() * weight
        loss = -(logp * target).sum() / target.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress:
            progress(step + 1, steps, loss.item())
    model.eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "lopd_model.json").write_text(json.dumps(
        {"name": "orders-base-tiny", "backbone": backbone, "seed": seed, "steps": steps, "lr": lr,
         "noise": noise, "batch_size": batch_size, "number_weight": number_weight, "rule_weight": rule_weight,
         "reference_fraction": reference_fraction, "max_references": DEFAULTS["max_references"],
         "n_tasks": n_tasks, "rules_seed": rules_seed, "version": POLICY_VERSION}))
    return out_dir


SHIPPED_DIR = Path(__file__).resolve().parent.parent / "models" / "data" / "orders-base-tiny"
SHIPPED_SEED = 0  # the seed the shipped weights were built from


def tensors_sha256(model_dir: Path) -> str:
    """One hash over every tensor of a saved model (names, dtypes, shapes, bytes): what "bit for
    bit" means for a rebuild."""
    import hashlib

    from safetensors import safe_open

    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                t = st.get_tensor(name)
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def package_base_policy(trained: Path, dest: Path) -> Path:
    """Write a trained base policy as package data: weights in float16 (half the size; the
    tiny model's weights are far inside its range, and projects load them as float32), the
    tokenizer, and a manifest with the build settings and the weights' hash."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float32).to(torch.float16)
    tmp = Path(str(dest) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(trained)).save_pretrained(tmp)
    manifest = json.loads((Path(trained) / "lopd_model.json").read_text())
    manifest.update(weights_dtype="float16", weights_sha256=tensors_sha256(tmp))
    (tmp / "lopd_model.json").write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def shipped_base_policy() -> Path | None:
    """The base policy that ships inside the package, when it is of the current version."""
    try:
        manifest = json.loads((SHIPPED_DIR / "lopd_model.json").read_text())
    except (OSError, ValueError):
        return None
    return SHIPPED_DIR if manifest.get("version") == POLICY_VERSION else None


def build_base_policy(out_dir: Path, seed: int = 0, steps: int = DEFAULTS["steps"],
                      n_tasks: int = DEFAULTS["n_tasks"], spread_steps: int = SPREAD["steps"],
                      copy_steps: int = COPY["steps"],
                      progress: Callable[[int, int, float], None] | None = None) -> Path:
    """The whole build: phase 1 (`steps` of imitation under the policy's own rules, reading
    examples under random ones), phase 2 (`spread_steps` from phase 1's weights with plain
    examples under random rules too), phase 3 (`copy_steps` from phase 2's, copied words
    weighted). Each phase starts from the previous one as packaged (float16), i.e. from the
    previous version's shipped weights. `progress` counts the phases as one run of steps."""
    import tempfile

    total = steps + spread_steps + copy_steps
    spread_tasks, copy_tasks = (n_tasks * p["n_tasks"] // DEFAULTS["n_tasks"] for p in (SPREAD, COPY))

    def phase(offset: int):
        return (lambda s, _n, loss: progress(offset + s, total, loss)) if progress else None

    with tempfile.TemporaryDirectory() as tmp:
        first = train_orders_base_policy(Path(tmp) / "phase1", seed=seed, steps=steps, n_tasks=n_tasks,
                                         progress=phase(0))
        first = package_base_policy(first, Path(tmp) / "phase1-packaged")
        second = train_orders_base_policy(Path(tmp) / "phase2", seed=seed, steps=spread_steps, lr=SPREAD["lr"],
                                          n_tasks=spread_tasks, plain_rules=SPREAD["plain_rules"], init_from=first,
                                          progress=phase(steps))
        second = package_base_policy(second, Path(tmp) / "phase2-packaged")
        out = copy_phase(second, out_dir, seed=seed, steps=copy_steps, n_tasks=copy_tasks,
                         progress=phase(steps + spread_steps))
    meta = json.loads((out / "lopd_model.json").read_text())
    meta.update(steps=steps, lr=DEFAULTS["lr"], n_tasks=n_tasks,
                spread_phase={"steps": spread_steps, "lr": SPREAD["lr"], "n_tasks": spread_tasks,
                              "plain_rules": SPREAD["plain_rules"]},
                copy_phase={"steps": copy_steps, "lr": COPY["lr"], "n_tasks": copy_tasks,
                            "plain_rules": COPY["plain_rules"], "copies": COPY["copies"]})
    (out / "lopd_model.json").write_text(json.dumps(meta))
    return out


def copy_phase(start: Path, out_dir: Path, seed: int = 0, steps: int = COPY["steps"], n_tasks: int = COPY["n_tasks"],
               progress: Callable[[int, int, float], None] | None = None) -> Path:
    """Phase 3 from a packaged phase-2 policy (`start`, e.g. version 7's shipped weights)."""
    return train_orders_base_policy(out_dir, seed=seed, steps=steps, lr=COPY["lr"], n_tasks=n_tasks,
                                    plain_rules=COPY["plain_rules"], copies=COPY["copies"], init_from=start,
                                    progress=progress)


def cached_orders_base_policy(seed: int = 0, progress: Callable[[int, int, float], None] | None = None) -> Path:
    """The tiny orders base policy for `seed`: the shipped one for its seed, otherwise trained
    once and kept in the model cache."""
    from lopd_cli.models.registry import build_once, cache_dir

    shipped = shipped_base_policy()
    if shipped is not None and seed == SHIPPED_SEED:
        return shipped
    out = cache_dir() / "models" / f"orders-base-tiny-s{seed}-v{POLICY_VERSION}"
    return build_once(out, lambda tmp: build_base_policy(tmp, seed=seed, progress=progress))


def install_orders_base_policy(dest: Path, seed: int = 0,
                               progress: Callable[[int, int, float], None] | None = None) -> Path:
    """Copy the tiny base policy (shipped, or cached after one build) into `dest`, e.g. a
    project's models/base."""
    src = cached_orders_base_policy(seed, progress)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    """`python -m lopd_cli.train.base_policy [--check] [--steps N] [--out DIR]`: rebuild the
    shipped base policy from its seed (`make base-policy`); `--check` builds into a temporary
    folder and compares the weights' hash with the shipped one (bit for bit: same machine
    type, same torch, `LOPD_THREADS` as recorded in the manifest)."""
    import argparse
    import tempfile
    import time

    ap = argparse.ArgumentParser(prog="python -m lopd_cli.train.base_policy", description=main.__doc__)
    ap.add_argument("--out", type=Path, default=SHIPPED_DIR, help="where to write the packaged policy")
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--tasks", type=int, default=DEFAULTS["n_tasks"], help="imitation tasks (the shipped build: default)")
    ap.add_argument("--spread-steps", type=int, default=SPREAD["steps"], help="phase 2's steps (plain examples under random rules)")
    ap.add_argument("--copy-steps", type=int, default=COPY["steps"], help="phase 3's steps (copied words weighted)")
    ap.add_argument("--check", action="store_true", help="rebuild in a temporary folder and compare with --out")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def say(step: int, steps: int, loss: float) -> None:
        if step % 25 == 0 or step == steps:
            el = time.perf_counter() - t0
            print(f"base policy: step {step}/{steps} loss {loss:.3f} ({el:.0f} s, ETA {el / step * (steps - step):.0f} s)",
                  flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        trained = build_base_policy(Path(tmp) / "trained", seed=SHIPPED_SEED, steps=args.steps,
                                    n_tasks=args.tasks, spread_steps=args.spread_steps,
                                    copy_steps=args.copy_steps, progress=say)
        meta = json.loads((trained / "lopd_model.json").read_text())
        meta["threads"] = __import__("torch").get_num_threads()
        (trained / "lopd_model.json").write_text(json.dumps(meta))
        dest = Path(tmp) / "packaged" if args.check else args.out
        package_base_policy(trained, dest)
        got = json.loads((dest / "lopd_model.json").read_text())["weights_sha256"]
        if args.check:
            want = json.loads((args.out / "lopd_model.json").read_text())["weights_sha256"]
            print(f"rebuilt {got}\nshipped {want}\n{'identical' if got == want else 'DIFFERENT'}")
            return 0 if got == want else 1
    print(f"wrote {dest} (weights sha256 {got}) in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
