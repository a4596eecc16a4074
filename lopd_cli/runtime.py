"""Process-wide torch settings applied once at start-up."""

from __future__ import annotations

import os

_DONE = False


def setup_torch() -> None:
    """Flush denormals (CPU steps are ~20x slower without it) and size the thread pool.

    Threads follow the machine unless the user set OMP_NUM_THREADS / LOPD_THREADS.
    """
    global _DONE
    if _DONE:
        return
    import torch

    torch.set_flush_denormal(True)
    threads = os.environ.get("LOPD_THREADS") or os.environ.get("OMP_NUM_THREADS")
    n = int(threads) if threads else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, n))
    _DONE = True


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global RNGs from `seed`. Call it before any module is built:
    torch seeds its default generator at random at import, so an unseeded LoRA or composer
    init differs from one process to the next."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


_QUIET_ENV = "TRANSFORMERS_VERBOSITY"


def quiet_libraries(debug: bool) -> None:
    """Libraries' logging and progress bars (transformers' "Loading weights" and "Writing model
    shards", its deprecation notes, hub downloads) off, or back on with --debug.

    transformers reads TRANSFORMERS_VERBOSITY when it first configures its logger; when it is
    already imported (in-process callers, tests) its setters are called instead.
    """
    import logging

    logging.getLogger().setLevel(logging.WARNING if debug else logging.ERROR)
    try:
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

        (enable_progress_bars if debug else disable_progress_bars)()
    except ImportError:  # pragma: no cover - a dependency of transformers
        pass
    if debug:
        if os.environ.get(_QUIET_ENV) == "error" and os.environ.get("LOPD_SET_VERBOSITY"):
            del os.environ[_QUIET_ENV]
    elif _QUIET_ENV not in os.environ:
        os.environ[_QUIET_ENV] = "error"
        os.environ["LOPD_SET_VERBOSITY"] = "1"
    import sys

    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        if debug:
            hf_logging.set_verbosity_warning()
            hf_logging.enable_progress_bar()
        else:
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()


def cpu_has_fast_bf16() -> bool:
    """Whether torch has a fast bf16 matmul on this CPU (oneDNN with AVX512 or AMX).

    Without one (e.g. AVX2-only CPUs) bf16 matmuls take ATen's generic loop: on the 2-core AVX2
    EPYC this project was built on, a 576×1536 linear over 2,048 tokens took 9× longer forward and
    18× longer forward + backward under bf16 autocast than in fp32 (`benchmarks/RESULTS.md`,
    "bf16 on CPU")."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # private op; absent in some builds
        return False


def slow_bf16_message(setting: str, device: str, fast_bf16: bool) -> str | None:
    """The warning for a bf16 `setting` on `device`, or None when bf16 is fast there."""
    if not device.startswith("cpu") or fast_bf16:
        return None
    return (f"{setting}: this CPU has no fast bf16 matmul (no AVX512/AMX), so bf16 runs several times "
            "slower than float32 here; use float32 (model.dtype: float32, model.autocast_bf16: false)")


def warn_if_slow_bf16(setting: str, device: str) -> None:
    import warnings

    from lopd_cli.errors import LopdWarning

    msg = slow_bf16_message(setting, device, cpu_has_fast_bf16())
    if msg:
        warnings.warn(msg, LopdWarning, stacklevel=2)
