"""What χ reads: statistics of the composer encoder's states over a project's bank, and a fresh
composer's latent task spread with its inputs raw, centred or standardised (`composer.input_norm`).

Run from a project whose bank holds successes (e.g. the demo's, or `lopd init DIR --example orders
--model smollm2-135m-instruct` plus the demo's logs):

    cd PROJECT && python LOPD_REPO/benchmarks/encoder_states.py [RECIPE]   # default recipe: toolcall

It prints the share of a token's squared norm that is the mean over bank tokens, the cosine of two
different items' mean-pooled states (raw, centred, standardised) and the three spreads, on 16
training and 16 held-out examples. What it simplifies: the encoder LoRA is at its init (the base
model's states), as at the start of cold start. Figures: benchmarks/RESULTS.md, "Why SmolLM2's
latents carry no task".
"""
import sys

import torch
from pathlib import Path
from lopd_cli.agent.plugins import load_env_class
from lopd_cli.bank.retrieve import Retriever
from lopd_cli.compose.composer import Composer
from lopd_cli.models.adapters import attach_adapters
from lopd_cli.models.backbone import load_backbone
from lopd_cli.project import open_project
from lopd_cli.runtime import seed_everything
from lopd_cli.train.coldstart import evenly_spaced, holdout_split, input_norm_sequences, make_examples
from lopd_cli.train.teacher_nll import latent_task_spread

recipe_name = sys.argv[1] if len(sys.argv) > 1 else "toolcall"
torch.set_flush_denormal(True)
project = open_project(Path("."))
recipe = project.load_recipe(recipe_name, [])
seed_everything(0)
retriever = Retriever.open(project, recipe)
items = retriever.bank.items(success_only=True)
search = [recipe.base_dir, project.root]
model, tok = load_backbone(recipe.model.backbone, recipe.model.dtype, recipe.model.device, search_dirs=search)
model = attach_adapters(model, recipe)
composer = Composer(model, tok, recipe.composer, recipe.bank.obs_char_budget)
env = load_env_class(recipe.env.cls, recipe.base_dir)(**recipe.env.kwargs)
tr_items, val_items = holdout_split(items, env, recipe.coldstart.val_fraction, 0)
val = evenly_spaced(make_examples(tok, retriever, val_items, recipe.bank.n_retrieve, recipe.rollout.max_prompt_tokens), 16)
train = evenly_spaced(make_examples(tok, retriever, tr_items, recipe.bank.n_retrieve, recipe.rollout.max_prompt_tokens), 16)

def hidden_of(examples):
    hs, pooled = [], []
    with torch.no_grad():
        for ex in examples:
            ids = [composer.item_token_ids(ex.episode.task.instruction, it) for it in ex.refs]
            h, m = composer._encode_chunk(ids)
            for i in range(h.shape[0]):
                hi = h[i, : int(m[i].sum())].float()
                hs.append(hi); pooled.append(hi.mean(0))
    return hs, torch.stack(pooled)

hs_tr, _ = hidden_of(train)
allh = torch.cat(hs_tr)
mu, sd = allh.mean(0), allh.std(0)
print("hidden dim", allh.shape, "tokens", allh.shape[0])
print("E||h||^2 %.2f  ||mu||^2 %.2f  share of energy in the mean %.3f" % (allh.pow(2).sum(1).mean(), mu.pow(2).sum(), mu.pow(2).sum() / allh.pow(2).sum(1).mean()))
top = mu.abs().topk(5)
print("top |mu| dims", top.indices.tolist(), [round(v, 2) for v in top.values.tolist()], "median |mu|", float(mu.abs().median()))
print("top sd dims", sd.topk(5).indices.tolist(), [round(v, 2) for v in sd.topk(5).values.tolist()], "median sd", float(sd.median()))
hs_val, pooled = hidden_of(val)
def cos_offdiag(p):
    p = torch.nn.functional.normalize(p, dim=-1); c = p @ p.T; n = c.shape[0]
    return float((c.sum() - c.diag().sum()) / (n * n - n))
print("pooled item cosine (val items) raw %.4f  centred %.4f  standardised %.4f" % (cos_offdiag(pooled), cos_offdiag(pooled - mu), cos_offdiag((pooled - mu) / sd)))
tokcos = cos_offdiag(torch.cat(hs_val)[torch.randperm(sum(h.shape[0] for h in hs_val))[:500]])
print("random token-pair cosine raw %.4f" % tokcos)

# A fresh composer (the same χ init) with each `composer.input_norm`, its statistics measured as
# `lopd coldstart` measures them (input_norm_sequences over all the training examples).
all_train = make_examples(tok, retriever, tr_items, recipe.bank.n_retrieve, recipe.rollout.max_prompt_tokens)
for kind in ["none", "centre", "standardise"]:
    seed_everything(0)
    fresh = Composer(model, tok, recipe.composer.model_copy(update={"input_norm": kind}), recipe.bank.obs_char_budget)
    fresh.fit_input_norm(input_norm_sequences(fresh, all_train))
    print(f"init latent task spread, input_norm {kind}: {latent_task_spread(fresh, val, 8):.2%}")
