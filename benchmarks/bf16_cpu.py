"""Is bf16 faster than float32 on this CPU? Times one linear layer and a backbone forward.

bf16 helps only where torch has a fast bf16 matmul (oneDNN with AVX512 or AMX). On AVX2-only CPUs
bf16 matmuls fall back to ATen's generic loop, and `model.dtype: bfloat16` or
`model.autocast_bf16: true` make everything slower; `lopd` warns when that is the case
(`lopd_cli.runtime.cpu_has_fast_bf16`). This script measures it, one thread:

    .venv/bin/python benchmarks/bf16_cpu.py                 # linear + tiny + SmolLM2 forward
    .venv/bin/python benchmarks/bf16_cpu.py --quick         # linear + tiny only (seconds)
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


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_linear(tokens: int, d_in: int, d_out: int, repeats: int) -> dict[str, float]:
    """Forward and forward+backward of one Linear over `tokens` rows."""
    import torch

    lin = torch.nn.Linear(d_in, d_out)
    x = torch.randn(tokens, d_in, requires_grad=True)
    out: dict[str, float] = {"tokens": tokens}
    for name, autocast in (("fp32", False), ("bf16_autocast", True)):
        def fwd():
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                lin(x)

        def fwd_bwd():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = lin(x)
            y.float().sum().backward()

        out[f"{name}_fwd_s"] = _median_seconds(fwd, repeats)
        out[f"{name}_fwd_bwd_s"] = _median_seconds(fwd_bwd, repeats)
    return out


def time_backbone_forward(name: str, tokens: int, repeats: int) -> dict[str, float]:
    """No-grad forward of a whole backbone on one sequence, weights in float32 vs bfloat16
    (what rollouts and evaluation do with `model.dtype`)."""
    import torch

    from lopd_cli.models.backbone import load_backbone

    out: dict[str, float] = {}
    for dtype in ("float32", "bfloat16"):
        model, _ = load_backbone(name, dtype, "cpu")
        ids = torch.randint(0, model.config.vocab_size, (1, tokens))
        with torch.no_grad():
            out[f"{dtype}_fwd_s"] = _median_seconds(lambda: model(input_ids=ids), repeats)
        del model
    return out


def main() -> None:
    import warnings

    import torch

    from lopd_cli.runtime import cpu_has_fast_bf16

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out", type=Path, default=None)
    a = p.parse_args()
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the bf16 warning is what this script measures
    res: dict = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "fast_bf16": cpu_has_fast_bf16(),
                 "linear_576x1536": time_linear(512 if a.quick else 2048, 576, 1536, a.repeats)}  # SmolLM2's MLP
    models = ["tiny"] if a.quick else ["tiny", "smollm2-135m-instruct"]
    for m in models:
        res[f"{m}_forward_256"] = time_backbone_forward(m, 256, a.repeats)
    lin = res["linear_576x1536"]
    res["slowdown_bf16_over_fp32"] = {
        "linear_fwd": lin["bf16_autocast_fwd_s"] / lin["fp32_fwd_s"],
        "linear_fwd_bwd": lin["bf16_autocast_fwd_bwd_s"] / lin["fp32_fwd_bwd_s"],
        **{f"{m}_forward": res[f"{m}_forward_256"]["bfloat16_fwd_s"] / res[f"{m}_forward_256"]["float32_fwd_s"]
           for m in models},
    }
    print(json.dumps(res, indent=2))
    if a.json_out:
        a.json_out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
