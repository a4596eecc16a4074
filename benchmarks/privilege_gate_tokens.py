"""Where does the privilege gate open? (RESULTS.md, "House rules", probe 3)

On held-out validation successes of a project's bank (the env's validation tasks, as the
check), the frozen teacher reads the task's own references as text and, as the trainer's gate
does, another example's (`check.other_task_partners` without store groups: the next task whose
references differ). Per action token the gate's weight is the total-variation distance between
the two full next-token distributions. Prints the mean weight on rule tokens and on the others,
the share of the total weight on rule tokens, and the most-weighted tokens. What it simplifies:
the text teacher only (LOPD's latent teacher is gated the same way), full-vocabulary TV (the
trainer uses top-M+tail buckets), the first `--n` examples.

    python benchmarks/privilege_gate_tokens.py PROJECT_DIR [--n 24]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch


def main() -> None:
    from lopd_cli.agent.plugins import load_env_class
    from lopd_cli.bank.retrieve import Retriever
    from lopd_cli.compose.latent import build_teacher_batch, output_head, teacher_hidden, text_teacher_prompt_ids
    from lopd_cli.models.adapters import attach_adapters
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.project import open_project
    from lopd_cli.runtime import setup_torch
    from lopd_cli.train.check import other_task_partners, rule_token_mask
    from lopd_cli.train.coldstart import holdout_split, make_examples
    from lopd_cli.train.teacher_nll import text_reference_chars

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("project", type=Path)
    ap.add_argument("--n", type=int, default=24)
    args = ap.parse_args()
    setup_torch()
    project = open_project(args.project)
    recipe = project.load_recipe(None)
    retriever = Retriever.open(project, recipe)
    env = load_env_class(recipe.env.cls, recipe.base_dir)(**recipe.env.kwargs)
    _, held = holdout_split(retriever.bank.items(success_only=True), env, recipe.coldstart.val_fraction,
                            recipe.coldstart.seed)
    model, tok = load_backbone(recipe.model.backbone, recipe.model.dtype, "cpu",
                               search_dirs=[recipe.base_dir, project.root])
    model = attach_adapters(model, recipe)
    examples = make_examples(tok, retriever, held, recipe.bank.n_retrieve, recipe.rollout.max_prompt_tokens)[: args.n]
    partners = other_task_partners([{r.id for r in ex.refs} for ex in examples])
    head, chars = output_head(model), text_reference_chars(recipe)

    def next_token_probs(ex, refs):
        batch = build_teacher_batch([ex.episode], tok, 0, prompt_fn=lambda _b, ep: text_teacher_prompt_ids(
            tok, ep.prompt_messages, ep.task.tools, refs, recipe.bank.obs_char_budget, chars))
        with torch.no_grad():
            h = teacher_hidden(model, batch, torch.zeros((1, 0, model.config.hidden_size)))
            return torch.softmax(head(h[batch.batch_index, batch.teacher_pos - 1]).float(), -1), batch.token_ids

    rule_w, other_w, top = [], [], Counter()
    for i, ex in enumerate(examples):
        p, ids = next_token_probs(ex, ex.refs)
        q, _ = next_token_probs(ex, examples[partners[i]].refs)
        w = (0.5 * (p - q).abs().sum(-1)).tolist()
        rules = rule_token_mask(tok, ex.episode.input_ids, ex.episode.action_mask,
                                env.rule_strings(ex.episode.task.instruction) if hasattr(env, "rule_strings") else [])
        for t, wt, is_rule in zip(ids.tolist(), w, rules):
            (rule_w if is_rule else other_w).append(wt)
            if wt > 0.3:
                top[tok.decode([t])] += 1
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    print(f"{len(examples)} held-out successes; rule tokens {len(rule_w)}, mean weight {mean(rule_w):.3f}; "
          f"other tokens {len(other_w)}, mean weight {mean(other_w):.3f}")
    print(f"share of the gate's weight on rule tokens: {sum(rule_w) / max(sum(rule_w) + sum(other_w), 1e-12):.1%}")
    print("most-weighted tokens (weight > 0.3):", top.most_common(20))
    retriever.close()


if __name__ == "__main__":
    main()
