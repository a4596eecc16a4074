"""Cold start (docs/algorithm.md, "Cold start"): SFT of the composer φ = (ψ, χ) with the backbone frozen.

For a successful bank rollout τ of task x, retrieve n_ret other successful rollouts (never of
x's own task or instruction), compose c_φ, and train φ so the teacher — the frozen backbone with
c_φ in its prompt — gives τ's action tokens high likelihood: loss = mean NLL over those tokens.
Plus, with `coldstart.contrastive_weight` > 0, a hinge that makes the teacher's NLL with the
task's own references beat its NLL with another task's by `coldstart.contrastive_margin`; and with
`coldstart.reconstruct_weight` > 0, an auto-encoding term (ICAE): the teacher, given the same
latent block, must reproduce one retrieved reference's own action tokens.
AdamW over χ and the encoder LoRA, each at its own learning rate (`coldstart.lr_resampler`,
`coldstart.lr_encoder`), both ramped up linearly over `coldstart.warmup_steps`, each clipped by
its own norm (`coldstart.clip_qformer`, `coldstart.clip_lora`). Every eval also logs the
latents' task spread and the own-vs-shuffled NLL gap (`composer_health`). Held-out successful rollouts (whole tasks, `coldstart.val_fraction`)
give the validation NLL every `coldstart.eval_every` steps.

Output in the run folder: composer/ (qformer.safetensors, encoder/ adapter, manifest.json,
latents0.safetensors = the c_φ0 cache for the env's training tasks), metrics.jsonl,
recipe.yaml, summary.json.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from lopd_cli.agent.chat import render_prompt_ids, tokenize_transcript
from lopd_cli.agent.types import Episode, Task
from lopd_cli.compose.composer import Composer
from lopd_cli.compose.latent import TeacherBatch, build_teacher_batch
from lopd_cli.compose.latent_cache import LatentCache
from lopd_cli.errors import LopdError
from lopd_cli.train.teacher_nll import latent_task_spread, teacher_example_logprobs, teacher_nll, teacher_token_logprobs

COMPOSER_DIR = "composer"
INPUT_NORM_ITEMS = 64  # (task, retrieved item) pairs that χ's input statistics are measured on


# ------------------------------------------------------------------------------ data


def input_norm_sequences(composer: Composer, examples: Sequence[Example], n: int = INPUT_NORM_ITEMS) -> list[list[int]]:
    """Token ids of up to n (task, retrieved item) pairs, evenly spaced over the training
    examples: what `Composer.fit_input_norm` measures χ's input statistics on."""
    if composer.input_norm == "none":
        return []
    pairs = [(ex.episode.task.instruction, it) for ex in examples for it in ex.refs]
    return [composer.item_token_ids(instr, it) for instr, it in evenly_spaced(pairs, n)]


def item_episode(tokenizer, item, max_tokens: int | None = None) -> Episode | None:
    """A bank item as a tokenised transcript (prompt = everything before the first assistant
    turn). None when it has no assistant turn or is longer than `max_tokens`."""
    msgs = item.messages
    first = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), None)
    if not first:
        return None
    tools = item.tools or None
    ids, mask = tokenize_transcript(tokenizer, msgs, tools)
    if max_tokens is not None and len(ids) > max_tokens:
        return None
    prompt = msgs[:first]
    task = Task(id=str(item.task_id or f"bank-{item.id}"), instruction=item.instruction, tools=item.tools or [])
    return Episode(task=task, prompt_messages=prompt, messages=msgs, reward=item.reward, input_ids=ids,
                   action_mask=mask, prompt_len=len(render_prompt_ids(tokenizer, prompt, tools)),
                   meta={"bank_id": item.id})


def task_key(item) -> str:
    return str(item.task_id) if item.task_id else item.instruction.strip()


def split_by_task(items: Sequence, val_fraction: float, seed: int) -> tuple[list, list]:
    """Held-out rollouts are whole tasks, so validation never sees a task it trained on."""
    keys = sorted({task_key(it) for it in items})
    random.Random(seed).shuffle(keys)
    n_val = int(round(len(keys) * val_fraction))
    if val_fraction > 0 and len(keys) >= 2:
        n_val = max(1, min(n_val, len(keys) - 1))
    val_keys = set(keys[:n_val])
    return [it for it in items if task_key(it) not in val_keys], [it for it in items if task_key(it) in val_keys]


def validation_task_ids(env) -> set[str]:
    """The ids of the environment's validation tasks (empty for an env without that split): bank
    rows of these tasks are held out of every training set (cold start, SFT) so the check and
    validation figures score tasks no model trained on."""
    try:
        return {t.id for t in env.tasks("validation")}
    except Exception:  # an env without a validation split
        return set()


def holdout_split(items: Sequence, env, val_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out) bank items. Held out: the successes of the environment's validation
    tasks when the bank holds at least two of them (tasks no model trains on), otherwise a
    `val_fraction` share of whole tasks (`split_by_task`)."""
    val_ids = validation_task_ids(env)
    held = [it for it in items if it.task_id in val_ids]
    if len({task_key(it) for it in held}) >= 2:
        return [it for it in items if it.task_id not in val_ids], held
    return split_by_task(items, val_fraction, seed)


def retrieve_references(retriever, items: Sequence, n_ret: int) -> list[list]:
    """n_ret references per target item, excluding its own task id and instruction."""
    refs = retriever.retrieve_many(
        [it.instruction for it in items],
        n_ret,
        [[it.task_id] if it.task_id else [] for it in items],
        [[it.instruction] for it in items],
    )
    return refs


def evenly_spaced(items: Sequence, n: int | None) -> list:
    """At most n of `items`, spread evenly over the list (all of them when n is None or larger)."""
    items = list(items)
    if n is None or len(items) <= n:
        return items
    return [items[(i * len(items)) // n] for i in range(n)]


@dataclass
class Example:
    episode: Episode
    refs: list
    privilege: torch.Tensor | None = None  # per action token (coldstart.privilege_weight), else None
    # refs as transcripts, the reconstruction targets (`add_reference_episodes`; an entry is None
    # for a reference that is too long, has no action token or is a held-out task's)
    ref_episodes: list | None = None


def make_examples(tokenizer, retriever, items: Sequence, n_ret: int, max_tokens: int | None) -> list[Example]:
    refs = retrieve_references(retriever, items, n_ret)
    out = []
    for it, r in zip(items, refs):
        if len(r) < n_ret:
            continue
        ep = item_episode(tokenizer, it, max_tokens)
        if ep is not None and sum(ep.action_mask) > 0:
            out.append(Example(ep, r))
    return out


def add_reference_episodes(tokenizer, examples: Sequence[Example], max_tokens: int | None,
                           held_out: set[str]) -> int:
    """Fill each example's `ref_episodes` (the reconstruction targets) and return how many
    references can be reconstructed. A reference of a held-out task (`held_out`: task keys) is
    never a target, so no validation transcript is trained on."""
    cache: dict = {}
    usable = 0
    for ex in examples:
        eps = []
        for it in ex.refs:
            if it.id not in cache:
                ep = None if task_key(it) in held_out else item_episode(tokenizer, it, max_tokens)
                cache[it.id] = ep if ep is not None and sum(ep.action_mask) > 0 else None
            eps.append(cache[it.id])
            usable += eps[-1] is not None
        ex.ref_episodes = eps
    return usable


def reconstruction_targets(examples: Sequence[Example], rng: random.Random) -> list[tuple[int, Episode]]:
    """(row in the batch, episode) of one reconstructable reference per example, drawn at random."""
    out = []
    for b, ex in enumerate(examples):
        choices = [ep for ep in (ex.ref_episodes or []) if ep is not None]
        if choices:
            out.append((b, rng.choice(choices)))
    return out


# ------------------------------------------------------------------------------ training


def add_reference_privilege(model, tokenizer, examples: Sequence[Example], batch_size: int, obs_char_budget: int,
                            text_max_chars: int) -> float:
    """Fill each example's per-token reference privilege (`losses.reference_privilege`: how much
    the frozen teacher gains from reading its references as text) and return the share of the
    action tokens where it is above 0.1 nats. The references and the teacher are fixed during
    cold start, so this is measured once."""
    from lopd_cli.train.losses import reference_privilege

    was = model.training
    model.eval()
    none = teacher_example_logprobs(model, tokenizer, None, examples, "none", batch_size)
    text = teacher_example_logprobs(model, tokenizer, None, examples, "text", batch_size,
                                    obs_char_budget=obs_char_budget, text_max_chars=text_max_chars)
    model.train(was)
    hot = total = 0
    for ex, a, b in zip(examples, none, text):
        ex.privilege = reference_privilege(a, b)
        hot += int((ex.privilege > 0.1).sum())
        total += ex.privilege.numel()
    return hot / max(total, 1)


def composer_health(model, tokenizer, composer: Composer, examples: Sequence[Example], batch_size: int = 8) -> dict:
    """Is the composer still about the task? On held-out examples: the latents' task spread, the
    teacher NLL with each example's own references and with another example's ("shuffled"), and
    their gap (shuffled − own; > 0: the references the teacher reads matter). No grad."""
    if len(examples) < 2:
        return {}
    own = teacher_nll(model, tokenizer, composer, examples, "learned", batch_size=batch_size)
    other = teacher_nll(model, tokenizer, composer, examples, "shuffled", batch_size=batch_size)
    return {"latent_task_spread": latent_task_spread(composer, examples, batch_size),
            "nll_own": own, "nll_shuffled": other, "nll_gap": other - own}


def collapse_message(spread: float, threshold: float, where: str) -> str:
    """The one-line warning when the latents stop depending on what was retrieved."""
    return (f"{where}: the composer has collapsed into a fixed prompt: latent task spread "
            f"{100 * spread:.2f} % < {100 * threshold:.2f} % (train.lopd.min_task_spread); its latents barely "
            "depend on the retrieved references (see composer/nll_gap)")


def composer_param_groups(model, composer: Composer) -> tuple[list, list]:
    """(ψ = the encoder LoRA's parameters, χ = the resampler's)."""
    from lopd_cli.models.adapters import ENCODER, adapter_parameters

    return adapter_parameters(model, ENCODER), list(composer.resampler.parameters())


def composer_optimizer(model, composer: Composer, lr_encoder: float, lr_resampler: float, warmup_steps: int,
                       weight_decay: float = 0.0) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with ψ (group 0) and χ (group 1) at their own learning rates, both ramped up
    linearly over `warmup_steps` optimiser steps (step s runs at (s+1)/warmup of the rate)."""
    lora, chi = composer_param_groups(model, composer)
    from lopd_cli.train.optim import adamw

    opt = adamw([{"params": lora, "lr": lr_encoder, "name": "encoder"},
                 {"params": chi, "lr": lr_resampler, "name": "resampler"}], lr=lr_resampler, weight_decay=weight_decay)
    warm = max(0, int(warmup_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    return opt, sched


def per_sequence_nll(lp: torch.Tensor, batch_index: torch.Tensor, n: int) -> torch.Tensor:
    """Token-mean NLL of each sequence from flattened token log-probs (TeacherBatch order)."""
    tot = lp.new_zeros(n).index_add(0, batch_index, -lp)
    cnt = lp.new_zeros(n).index_add(0, batch_index, torch.ones_like(lp))
    return tot / cnt.clamp_min(1.0)


def other_task_order(task_keys: Sequence[str]) -> tuple[list[int], list[bool]]:
    """For each example the index of another example to borrow references from (the previous one,
    cyclically) and whether that one is of a different task (pairs of the same task are left out
    of the contrastive term)."""
    n = len(task_keys)
    perm = [(i - 1) % n for i in range(n)]
    return perm, [n > 1 and task_keys[j] != task_keys[i] for i, j in enumerate(perm)]


def contrastive_term(model, tokenizer, episodes: Sequence[Episode], latents: torch.Tensor, batch: TeacherBatch,
                     lp_own: torch.Tensor, task_keys: Sequence[str], margin: float) -> torch.Tensor:
    """hinge(NLL with own references − NLL with another task's references + margin), batch mean.

    The other task's latents are this batch's own, rolled by one (no extra encoder pass), so the
    gradient reaches ψ and χ through both sides. 0 (a graph) when no pair has different tasks."""
    from lopd_cli.train.losses import contrastive_hinge

    perm, ok = other_task_order(task_keys)
    keep = torch.tensor(ok, device=latents.device)
    if not keep.any():
        return latents.sum() * 0.0
    lp_other = teacher_token_logprobs(model, batch, latents[torch.tensor(perm, device=latents.device)])
    n = len(episodes)
    own = per_sequence_nll(lp_own, batch.batch_index, n)
    other = per_sequence_nll(lp_other, batch.batch_index, n)
    return contrastive_hinge(own[keep], other[keep], margin)


def reconstruction_nll(model, tokenizer, latents: torch.Tensor, targets: Sequence[tuple[int, Episode]]) -> torch.Tensor:
    """ICAE-style auto-encoding: the teacher's mean NLL of each target reference's own action
    tokens, with its prompt and the latent block of the example (row) the reference was retrieved
    for, which holds that reference's latents among the others'."""
    rows = torch.tensor([b for b, _ in targets], device=latents.device)
    batch = build_teacher_batch([ep for _, ep in targets], tokenizer, latents.shape[1]).to(latents.device)
    return -teacher_token_logprobs(model, batch, latents[rows]).mean()


def coldstart_step(model, tokenizer, composer: Composer, examples: Sequence[Example], optimizer,
                   clip_lora: float, clip_qformer: float, contrastive_weight: float = 0.0,
                   contrastive_margin: float = 0.1, scheduler=None, privilege_weight: float = 0.0,
                   reconstruct_weight: float = 0.0,
                   reconstruct: Sequence[tuple[int, Episode]] | None = None,
                   micro_batch: int | None = None) -> dict:
    """One step: loss = mean NLL of the examples' action tokens under the teacher with c_φ of
    their references (weighted by 1 + privilege_weight · each token's reference privilege when
    the examples carry it, `add_reference_privilege`) + contrastive_weight · `contrastive_term`
    + reconstruct_weight · `reconstruction_nll` of `reconstruct` ((row, reference episode) pairs,
    `reconstruction_targets`). ψ and χ are clipped separately.

    `micro_batch`: examples per forward/backward (gradients accumulate; one optimiser step). The
    NLL and the reconstruction are the same token means whatever the split; the contrastive pairs
    are formed within each micro-batch (so micro_batch 1 has no contrastive pair)."""
    from lopd_cli.train.losses import privilege_weighted_nll

    lora, chi = composer_param_groups(model, composer)
    n = len(examples)
    size = n if not micro_batch else max(1, int(micro_batch))
    total_tokens = max(1, sum(sum(ex.episode.action_mask) for ex in examples))
    weighted = privilege_weight > 0 and all(ex.privilege is not None for ex in examples)
    by_row: dict[int, list[Episode]] = {}
    for b, ep in reconstruct or []:
        by_row.setdefault(b, []).append(ep)
    n_targets = len(reconstruct or [])
    rec_tokens = max(1, sum(sum(ep.action_mask) for _, ep in reconstruct or []))
    optimizer.zero_grad(set_to_none=True)
    nll_sum = priv_num = priv_den = hinge_sum = rec_sum = 0.0
    norms = []
    for start in range(0, n, size):
        group = examples[start : start + size]
        eps = [ex.episode for ex in group]
        latents = composer([ex.refs for ex in group], [e.task.instruction for e in eps])
        batch = build_teacher_batch(eps, tokenizer, latents.shape[1]).to(latents.device)
        lp = teacher_token_logprobs(model, batch, latents)
        nll_sum += float(-lp.detach().sum())
        norms.append(float(latents.detach().norm(dim=-1).mean()))
        if weighted:  # the token mean over the whole step, whatever the split
            priv = torch.cat([ex.privilege for ex in group]).to(lp.device)
            loss = privilege_weighted_nll(lp, priv, privilege_weight) * (lp.numel() / total_tokens)
            priv_num += float((priv * -lp.detach()).sum())
            priv_den += float(priv.sum())
        else:
            loss = -lp.sum() / total_tokens
        if contrastive_weight > 0:
            hinge = contrastive_term(model, tokenizer, eps, latents, batch, lp, [e.task.id for e in eps],
                                     contrastive_margin)
            loss = loss + float(contrastive_weight) * hinge * (len(group) / n)
            hinge_sum += float(hinge.detach()) * len(group)
        rows = [(b - start, ep) for b in range(start, start + len(group)) for ep in by_row.get(b, [])]
        if reconstruct_weight > 0 and rows:
            rec = reconstruction_nll(model, tokenizer, latents, rows)
            share = sum(sum(ep.action_mask) for _, ep in rows) / rec_tokens
            loss = loss + float(reconstruct_weight) * rec * share
            rec_sum += float(rec.detach()) * share
        loss.backward()
    row: dict = {}
    if weighted:
        row["privileged_nll"] = priv_num / max(priv_den, 1e-12)
    if contrastive_weight > 0:
        row["contrastive"] = hinge_sum / n
    if reconstruct_weight > 0 and n_targets:
        row["reconstruct"] = rec_sum
    g_lora = torch.nn.utils.clip_grad_norm_(lora, clip_lora)
    g_chi = torch.nn.utils.clip_grad_norm_(chi, clip_qformer)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return {"loss": nll_sum / total_tokens, **row, "grad_norm_lora": float(g_lora), "grad_norm_qformer": float(g_chi),
            "tokens": total_tokens, "latent_norm": sum(norms) / len(norms),
            "lr_encoder": optimizer.param_groups[0]["lr"], "lr_resampler": optimizer.param_groups[1]["lr"]}


def train_composer(model, tokenizer, composer: Composer, train: Sequence[Example], val: Sequence[Example], cfg,
                   log: Callable[[dict], None] = lambda row: None,
                   on_step: Callable[[int, dict], None] = lambda step, row: None,
                   final_eval: bool = True) -> dict:
    """The cold-start loop: returns {"steps", "val_nll" (last), "history"}. `cfg` = recipe.coldstart.
    `final_eval` False skips the validation after the last step (the caller scores it itself:
    `run_coldstart`'s check covers the same figures)."""
    from lopd_cli.models.adapters import ENCODER, set_trainable
    from lopd_cli.train.sampler import TaskSampler

    if not train:
        raise LopdError("cold start: no training examples (the bank needs successful rollouts of at least "
                        "n_retrieve + 1 different tasks; see `lopd bank stats`)")
    if cfg.micro_batch == 1 and cfg.contrastive_weight > 0 and cfg.batch_size > 1:
        import warnings

        from lopd_cli.errors import LopdWarning

        warnings.warn("coldstart.micro_batch 1 forms no contrastive pair, so coldstart.contrastive_weight has no "
                      "effect; use micro_batch >= 2 or contrastive_weight 0", LopdWarning, stacklevel=2)
    set_trainable(model, [ENCODER])
    composer.resampler.requires_grad_(True)
    optimizer, scheduler = composer_optimizer(model, composer, cfg.lr_encoder or cfg.lr, cfg.lr_resampler or cfg.lr,
                                              cfg.warmup_steps)
    sampler = TaskSampler(len(train), cfg.seed)
    pick = random.Random(cfg.seed + 1)  # which reference each example reconstructs
    torch.manual_seed(cfg.seed)
    history: list[dict] = []
    val_nll = None
    model.train(False)  # dropout-free LoRA either way; the teacher must be deterministic
    for step in range(1, cfg.steps + 1):
        idx = sampler.take(min(cfg.batch_size, len(train)))
        batch = [train[i] for i in idx]
        targets = reconstruction_targets(batch, pick) if cfg.reconstruct_weight > 0 else None
        row = {"step": step, **coldstart_step(model, tokenizer, composer, batch, optimizer,
                                              cfg.clip_lora, cfg.clip_qformer, cfg.contrastive_weight,
                                              cfg.contrastive_margin, scheduler, cfg.privilege_weight,
                                              cfg.reconstruct_weight, targets, cfg.micro_batch)}
        if val and ((step == cfg.steps and final_eval) or (step < cfg.steps and step % cfg.eval_every == 0)):
            health = composer_health(model, tokenizer, composer, val, cfg.batch_size)
            val_nll = health["nll_own"] if health else teacher_nll(model, tokenizer, composer, val, "learned",
                                                                   batch_size=cfg.batch_size)
            row["val_nll"] = val_nll
            row.update({f"composer/{k}": v for k, v in health.items() if k in ("latent_task_spread", "nll_gap")})
        history.append(row)
        log(row)
        on_step(step, row)
    return {"steps": cfg.steps, "val_nll": val_nll, "history": history}


def build_anchor_cache(composer: Composer, retriever, tasks: Sequence[Task], n_ret: int,
                       allow_self_retrieval: bool) -> LatentCache:
    """c_φ0 for the tasks the trainer will see, retrieved the way it retrieves."""
    refs = retriever.retrieve_many(
        [t.instruction for t in tasks], n_ret,
        None if allow_self_retrieval else [[t.id] for t in tasks],
        None if allow_self_retrieval else [[t.instruction] for t in tasks],
    )
    cache = LatentCache()
    keep = [(t, r) for t, r in zip(tasks, refs) if len(r) == n_ret]
    cache.fill(composer, [t.instruction for t, _ in keep], [r for _, r in keep])
    return cache


def run_coldstart(project, recipe, run_dir: Path, show_progress: bool = True) -> dict:
    """`lopd coldstart`: load the backbone once, train φ, save the composer and the c_φ0 cache."""
    from lopd_cli.agent.runner import make_env_factory
    from lopd_cli.bank.embed import embedder_fingerprint
    from lopd_cli.bank.retrieve import Retriever
    from lopd_cli.models.adapters import attach_adapters
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.runtime import seed_everything
    from lopd_cli.train.metrics import MetricsLog

    cs, n_ret = recipe.coldstart, recipe.bank.n_retrieve
    seed_everything(cs.seed)  # the encoder LoRA's and χ's init: the same composer from the same seed
    retriever = Retriever.open(project, recipe)
    try:
        items = retriever.bank.items(success_only=True)
        if len({task_key(it) for it in items}) < n_ret + 1:
            raise LopdError(f"cold start needs successful rollouts of at least {n_ret + 1} different tasks "
                            f"(bank.n_retrieve = {n_ret}); the bank has {len({task_key(it) for it in items})}")
        search = [recipe.base_dir, project.root]
        backbone = recipe.model.backbone
        if recipe.train.teacher == "init":
            # The teacher LOPD will have after `train.init_from` (e.g. SFT): the warm-start model,
            # merged (as `lopd train` does), so the composer and the check are about that teacher.
            from lopd_cli.models.student import init_source
            from lopd_cli.train.init_backbone import merged_init_backbone

            backbone = str(merged_init_backbone(init_source(project, recipe), run_dir, recipe.model.dtype, search))
        model, tokenizer = load_backbone(backbone, recipe.model.dtype, recipe.model.device, search_dirs=search)
        model = attach_adapters(model, recipe)
        composer = Composer(model, tokenizer, recipe.composer, recipe.bank.obs_char_budget)
        env = make_env_factory(recipe)()
        train_items, val_items = holdout_split(items, env, cs.val_fraction, cs.seed)
        max_tokens = recipe.rollout.max_prompt_tokens
        train = make_examples(tokenizer, retriever, train_items, n_ret, max_tokens)
        val = evenly_spaced(make_examples(tokenizer, retriever, val_items, n_ret, max_tokens), cs.val_n)
        norm_seqs = input_norm_sequences(composer, train)
        if norm_seqs and show_progress:  # a minute on a real model on a CPU
            from lopd_cli.progress import counter

            with counter(f"χ's input statistics ({len(norm_seqs)} references)", total=len(norm_seqs)) as tick:
                input_norm = composer.fit_input_norm(norm_seqs, progress=tick)
        else:
            input_norm = composer.fit_input_norm(norm_seqs)
        reconstructable = None
        if cs.reconstruct_weight > 0:
            reconstructable = add_reference_episodes(tokenizer, train, max_tokens,
                                                     {task_key(it) for it in val_items})
        privileged_share = None
        if cs.privilege_weight > 0 and train:
            from lopd_cli.train.teacher_nll import text_reference_chars

            privileged_share = add_reference_privilege(model, tokenizer, train, cs.batch_size,
                                                       recipe.bank.obs_char_budget, text_reference_chars(recipe))

        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
        metrics = MetricsLog(run_dir)
        checks = len(val) >= 2  # the before-training check runs after the last step
        held: list[dict] = []  # the last step's row, logged with the check's validation figures

        def log_row(row: dict) -> None:
            (held.append if checks and row["step"] == cs.steps else metrics.log)(row)
        before = None
        if val and show_progress:  # minutes on a real model: say what is happening
            from lopd_cli.progress import counter

            with counter(f"validation NLL before training ({len(val)} held-out successes)", total=len(val)) as tick:
                before = teacher_nll(model, tokenizer, composer, val, "learned", cs.batch_size, progress=tick)
        elif val:
            before = teacher_nll(model, tokenizer, composer, val, "learned", cs.batch_size)
        if show_progress:
            from lopd_cli.progress import make_progress as progress

            with progress() as bar:
                task = bar.add_task("cold start", total=cs.steps, info="")

                def on_step(step: int, row: dict) -> None:
                    info = f"loss {row['loss']:.3f}" + (f"  val {row['val_nll']:.3f}" if "val_nll" in row else "")
                    bar.update(task, advance=1, info=info)

                result = train_composer(model, tokenizer, composer, train, val, cs, log_row, on_step,
                                        final_eval=not checks)
        else:
            result = train_composer(model, tokenizer, composer, train, val, cs, log_row, final_eval=not checks)

        # Saved before the check, so a check that fails (e.g. out of memory on a big model) loses no training.
        out = run_dir / COMPOSER_DIR
        emb_fp = embedder_fingerprint(recipe.bank.embedder)
        composer.save(out, emb_fp, extra={"kind": "coldstart", "steps": cs.steps, "val_nll": result["val_nll"],
                                          "n_retrieve": n_ret})
        check = None
        try:
            if checks:
                from lopd_cli.train.check import run_check
                from lopd_cli.train.teacher_nll import text_reference_chars

                model.eval()
                args = (model, tokenizer, composer, val, cs.batch_size, recipe.bank.obs_char_budget,
                        text_reference_chars(recipe), getattr(env, "rule_strings", None))
                if show_progress:
                    from lopd_cli.progress import counter
                    from lopd_cli.train.check import MODES

                    with counter(f"check on {len(val)} held-out successes (teacher modes + spread)",
                                 total=len(MODES) + 1) as tick:
                        check = run_check(*args, progress=tick)
                else:
                    check = run_check(*args)
                # The check scored the final composer on the held-out examples: its figures are the
                # last validation row (no second pass over them).
                own, other = check.nll["learned"]["all"], check.nll["other"]["all"]
                result["val_nll"] = own
                if not held:  # coldstart.steps 0
                    held.append({"step": cs.steps})
                held[0].update({"val_nll": own, "composer/latent_task_spread": check.task_spread,
                                "composer/nll_gap": other - own})
                manifest = json.loads((out / "manifest.json").read_text())
                (out / "manifest.json").write_text(json.dumps({**manifest, "val_nll": own}, indent=2))
        finally:
            for row in held:
                metrics.log(row)
            metrics.close()
        with torch.no_grad():
            tasks = env.tasks("train")[: cs.anchor_cache_tasks]
            cache = build_anchor_cache(composer, retriever, tasks, n_ret, recipe.bank.allow_self_retrieval)
        cache.save(out)
        summary = {
            "run_dir": str(run_dir), "composer": str(out), "steps": cs.steps,
            "teacher": recipe.train.teacher, "backbone": backbone,
            "train_examples": len(train), "val_examples": len(val),
            "val_nll_before": before, "val_nll_after": result["val_nll"],
            "anchor_cache_entries": len(cache), "input_norm": input_norm,
            "privileged_token_share": privileged_share,
            "reconstructable_references": reconstructable,
            "check": check.to_dict() if check else None,
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        retriever.close()
