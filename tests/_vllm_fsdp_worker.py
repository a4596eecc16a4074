"""One rank of tests/test_vllm_fsdp.py, under torchrun: a tiny student sharded with FSDP2 (per
layer, as lopd's trainer shards it) and this rank's own in-process vLLM engine.

    torchrun --nproc_per_node 2 tests/_vllm_fsdp_worker.py {lora|full} OUT_DIR

Step 1's weights are served (the backend refreshes when it is made), greedy ids and log-probs
recorded; the sharded weights then change (each rank its own shard, as an optimiser step does);
the same backend samples once more without a refresh (stale) and once after one (step 2). The
whole student is gathered only afterwards, to score each record with an hf forward. Writes
OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as tdist


def main(kind: str, out_dir: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lopd_cli.config import recipe_from_dict
    from lopd_cli.models import adapters as ad
    from lopd_cli.models.backbone import load_backbone
    from lopd_cli.rollout.base import SamplingParams
    from lopd_cli.rollout.factory import make_backend
    from lopd_cli.rollout.vllm import shutdown_engines
    from lopd_cli.train.distributed import is_distributed
    from lopd_cli.train import sharding

    tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    model, tok = load_backbone("tiny", device="cpu")
    student = {"lora": {"r": 8}} if kind == "lora" else {"student": "full"}
    recipe = recipe_from_dict({"model": {"backbone": "tiny", **student}, "env": {"class": "x:Y"}})
    model = ad.attach_adapters(model, recipe)
    units = sharding.shard_module(model, init_device_mesh("cpu", (tdist.get_world_size(),)))
    trained = [p for n, p in model.named_parameters() if ("lora_B" in n and ".student" in n) or
               (kind == "full" and ad.adapter_of(n) == ad.BASE)]
    assert trained and is_distributed() and all(isinstance(p, torch.distributed.tensor.DTensor) for p in trained)

    def change(seed: int, sign: float = 1.0) -> None:
        """A new value for every trained weight, written into this rank's shard only."""
        g = torch.Generator().manual_seed(seed * 100 + rank)
        with torch.no_grad():
            for p in trained:
                local = p.to_local()
                local.add_(sign * torch.randn(local.shape, generator=g) * (0.3 if kind == "lora" else 0.05))

    change(1)
    prompts = [tok(f"Where is order {40 + rank}?")["input_ids"], tok(f"Cancel order {7 + rank}, please.")["input_ids"]]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    with ad.use_student(model):
        backend = make_backend("vllm", model, tok)  # refreshed: step 1's weights
        step1 = backend.generate(prompts, params, [])
        change(2)
        stale = backend.generate(prompts, params, [])
        backend.refresh()
        step2 = backend.generate(prompts, params, [])

    def scored(gens) -> dict:
        """The records and the gathered student's own log-probs of the same ids (temperature 1)."""
        out = []
        for p, g in zip(prompts, gens):
            x = torch.tensor([p + g.token_ids])
            with torch.no_grad(), ad.use_student(model):
                logits = model(input_ids=x).logits[0, :-1].float()
            fresh = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0][len(p) - 1:]
            with torch.no_grad(), ad.use_student(model):
                greedy = model.generate(torch.tensor([p]), max_new_tokens=len(g.token_ids), do_sample=False,
                                        min_new_tokens=len(g.token_ids))[0, len(p):].tolist()
            out.append({"ids": g.token_ids, "logprobs": g.logprobs, "hf_logprobs": fresh.tolist(),
                        "hf_greedy": greedy})
        return out

    with sharding.gathered(sharding.Sharding(model=model, student_units=units)):
        result = {"step2": scored(step2), "stale": scored(stale)}
    change(2, sign=-1.0)  # back to step 1's weights (the same draws subtracted)
    with sharding.gathered(sharding.Sharding(model=model, student_units=units)):
        result["step1"] = scored(step1)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    tdist.barrier()
    shutdown_engines()  # before the process group its own groups were built in (it may end that too)
    if tdist.is_initialized():
        tdist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
