"""The shared-prefix forward (`compose.latent.decoder_hidden`): time and exactness on a real bank.

In a world whose episodes all open with the same system prompt and tool schemas (orders: ~800
of ~1,000 tokens), `decoder_hidden` runs that prefix once, on one row, and repeats its KV cache
for the batch. This script takes a batch of the project's successful bank rollouts (the cold
start's training examples), and times one teacher pass (latents in the block, forward + backward
into the latents) and one student pass (LoRA on, forward + backward into the LoRA), each as one
full pass and as the shared-prefix pass, alternating, and reports the medians and the largest
difference between the two passes' hidden states.

    cd PROJECT && python /path/to/benchmarks/shared_prefix.py [--batch 8] [--repeats 3] [--json F]

What it simplifies: random latents stand in for c_φ (the cost does not depend on their values);
one process, so run it on a quiet machine (or read the ratio, not the seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="toolcall")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import torch

    from lopd_cli.bank.retrieve import Retriever
    from lopd_cli.compose.composer import decoder_of
    from lopd_cli.compose.latent import build_teacher_batch, decoder_hidden, shared_prefix_len, teacher_inputs_embeds
    from lopd_cli.models.adapters import attach_adapters, teacher_view, use_student
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.project import open_project
    from lopd_cli.runtime import setup_torch
    from lopd_cli.train.coldstart import make_examples

    setup_torch()
    project = open_project()
    recipe = project.load_recipe(a.recipe)
    ret = Retriever.open(project, recipe)
    try:
        items = ret.bank.items(success_only=True)
        model, tok = load_backbone(recipe.model.backbone, recipe.model.dtype, recipe.model.device,
                                   search_dirs=[recipe.base_dir, project.root])
        model = attach_adapters(model, recipe)
        examples = make_examples(tok, ret, items, recipe.bank.n_retrieve, recipe.rollout.max_prompt_tokens)[: a.batch]
    finally:
        ret.close()
    eps = [ex.episode for ex in examples]
    n_lat = recipe.bank.n_retrieve * recipe.composer.num_queries
    tb = build_teacher_batch(eps, tok, n_lat)
    d = model.get_input_embeddings().embedding_dim
    latents = torch.randn(len(eps), n_lat, d, requires_grad=True)
    # the teacher's shared prefix ends at the latent block; the student's (same ids here) may go on
    prefix = {"teacher": shared_prefix_len(tb.input_ids, tb.attention_mask, tb.latent_mask),
              "student": shared_prefix_len(tb.input_ids, tb.attention_mask)}

    def teacher(min_prefix: int) -> torch.Tensor:
        with teacher_view(model):
            emb = teacher_inputs_embeds(model, tb.input_ids, latents, tb.latent_mask)
            return decoder_hidden(decoder_of(model), tb.input_ids, tb.attention_mask, emb, tb.latent_mask,
                                  min_prefix=min_prefix)

    def student(min_prefix: int) -> torch.Tensor:
        with use_student(model):
            return decoder_hidden(decoder_of(model), tb.input_ids, tb.attention_mask, min_prefix=min_prefix)

    keep = tb.attention_mask.bool()
    out: dict = {"batch": len(eps), "tokens_per_row": tb.lengths,
                 "backbone": recipe.model.backbone, "threads": torch.get_num_threads()}
    for name, fn in (("teacher", teacher), ("student", student)):
        secs: dict[str, list[float]] = {"full": [], "shared_prefix": []}
        hidden = {}
        for _ in range(a.repeats):
            for label, mp in (("full", 10**9), ("shared_prefix", 1)):
                model.zero_grad(set_to_none=True)
                latents.grad = None
                t0 = time.perf_counter()
                h = fn(mp)
                (h[keep].float() ** 2).mean().backward()
                secs[label].append(time.perf_counter() - t0)
                hidden[label] = h.detach()[keep]
        full, pre = statistics.median(secs["full"]), statistics.median(secs["shared_prefix"])
        out[name] = {"shared_prefix": prefix[name], "full_s": round(full, 3), "shared_prefix_s": round(pre, 3), "speedup": round(full / pre, 2),
                     "max_abs_hidden_diff": float((hidden["full"] - hidden["shared_prefix"]).abs().max())}
        print(f"{name}: full pass {full:.2f} s, shared prefix {pre:.2f} s ({full / pre:.2f}x), "
              f"max |Δhidden| {out[name]['max_abs_hidden_diff']:.1e}  (forward + backward, {len(eps)} rows, "
              f"prefix {prefix[name]} of {max(tb.lengths)} tokens)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
