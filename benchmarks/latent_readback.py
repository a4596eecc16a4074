"""Can the teacher read a trajectory back out of its own latents? (RESULTS.md, "Latents that
carry the rules")

On held-out validation successes of a project's bank (the env's validation tasks, as the check),
each success h is put *into* its own reference block: the block is [h, r1, …, r_{n-1}] (h first,
then h's retrieved references), and the frozen teacher scores h's action tokens with:

- no block (the student's view);
- that block as latents from a cold-start composer (read-back: h's content is in the latents);
- the usual block of retrieved references as latents (what the check calls "own latents");
- that read-back block as text (what a teacher that reads h verbatim can do).

Per mode the NLL per action token, split into rule tokens (the env's `rule_strings`) and the
others. If the text read-back is near 0 on rule tokens and the latent read-back is not below no
block, the composer does not pass a trajectory's tokens through at all, whatever it was trained
on. What it simplifies: one composer, the first `--n` examples, pooled token means.

    python benchmarks/latent_readback.py PROJECT_DIR --composer runs/coldstart/composer [--n 45]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    from lopd_cli.agent.plugins import load_env_class
    from lopd_cli.bank.retrieve import Retriever
    from lopd_cli.compose.composer import Composer
    from lopd_cli.models.adapters import attach_adapters
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.project import open_project
    from lopd_cli.runtime import setup_torch
    from lopd_cli.train.check import rule_token_mask
    from lopd_cli.train.coldstart import Example, holdout_split, make_examples
    from lopd_cli.train.teacher_nll import teacher_example_logprobs, text_reference_chars

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("project", type=Path)
    ap.add_argument("--composer", required=True, help="a composer folder, relative to the project")
    ap.add_argument("--n", type=int, default=45)
    args = ap.parse_args()
    setup_torch()
    project = open_project(args.project)
    recipe = project.load_recipe(None)
    retriever = Retriever.open(project, recipe)
    env = load_env_class(recipe.env.cls, recipe.base_dir)(**recipe.env.kwargs)
    items = retriever.bank.items(success_only=True)
    _, held = holdout_split(items, env, recipe.coldstart.val_fraction, recipe.coldstart.seed)
    model, tok = load_backbone(recipe.model.backbone, recipe.model.dtype, "cpu",
                               search_dirs=[recipe.base_dir, project.root])
    model = attach_adapters(model, recipe)
    composer = Composer.load(project.path(args.composer), model, tok, recipe.composer)
    model.eval()
    n_ret = recipe.bank.n_retrieve
    usual = make_examples(tok, retriever, held, n_ret, recipe.rollout.max_prompt_tokens)[: args.n]
    by_id = {it.id: it for it in held}
    readback = [Example(ex.episode, [by_id[ex.episode.meta["bank_id"]]] + list(ex.refs[: n_ret - 1])) for ex in usual]
    chars = text_reference_chars(recipe)
    runs = {
        "no block": (usual, "none"),
        "latents, read-back block": (readback, "learned"),
        "latents, retrieved block": (usual, "learned"),
        "text, read-back block": (readback, "text"),
    }
    masks = [rule_token_mask(tok, ex.episode.input_ids, ex.episode.action_mask,
                             env.rule_strings(ex.episode.task.instruction)) for ex in usual]
    out = {}
    for name, (examples, mode) in runs.items():
        lps = teacher_example_logprobs(model, tok, composer, examples, mode, recipe.coldstart.batch_size,
                                       obs_char_budget=recipe.bank.obs_char_budget, text_max_chars=chars)
        sums = {"all": [0.0, 0], "rule": [0.0, 0], "other": [0.0, 0]}
        for lp, mask in zip(lps, masks):
            for v, is_rule in zip((-lp).tolist(), mask):
                for part in ("all", "rule" if is_rule else "other"):
                    sums[part][0] += v
                    sums[part][1] += 1
        out[name] = {k: s / max(c, 1) for k, (s, c) in sums.items()}
        print(f"{name:28s} all {out[name]['all']:.3f}  rule {out[name]['rule']:.3f}  other {out[name]['other']:.3f}",
              flush=True)
    print(json.dumps({"examples": len(usual), "composer": args.composer, "nll": out}))
    retriever.close()


if __name__ == "__main__":
    main()
