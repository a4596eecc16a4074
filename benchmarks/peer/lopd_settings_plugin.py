"""bench_peer plugin: the shared product plugin (../shared/peer_trl/lopd_product_plugin.py) with
recipe overrides, so several composer-phase settings interleave in one process.

    LOPD_PEER_SETTINGS="lopd_all:;lopd_c2:train.composer_batch=2;lopd_e4:train.composer_every=4"
    .venv-peer/bin/python $B --model ~/.cache/lopd/models/tiny --workloads sdft,sft \\
        --plugin benchmarks/peer/lopd_settings_plugin.py --plugin ... (once per setting)

Each --plugin occurrence takes the next `name:override,override` entry. The shared plugin's
step-structure check (2 backward calls, 2 chunked_logprobs calls: the old phase order) is
dropped: with composer rows split from the others the counts differ. Its backward/log-prob
labels follow call order, so for this code read the totals (p_update, total), not those labels.
"""
import builtins
import importlib.util
import os
from pathlib import Path

SHARED = Path(os.environ.get("LOPD_PEER_PLUGIN", Path(__file__).resolve().parents[3] / "shared" / "peer_trl"
                              / "lopd_product_plugin.py"))
_i = getattr(builtins, "_lopd_peer_setting", 0)
builtins._lopd_peer_setting = _i + 1
_entries = [e for e in os.environ.get("LOPD_PEER_SETTINGS", "lopd_product:").split(";") if e.strip()]
NAME, _, _ovr = _entries[_i].partition(":")
OVERRIDES = [o for o in _ovr.split(",") if o.strip()]


def make(args, data):
    import lopd_cli.config as cfg

    spec = importlib.util.spec_from_file_location(f"lopd_product_plugin_{_i}", SHARED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    orig = cfg.load_recipe
    cfg.load_recipe = lambda path, overrides=None, *a, **k: orig(path, list(overrides or []) + OVERRIDES, *a, **k)
    args_w = type(args)(**{**vars(args), "workdir": os.path.join(args.workdir, NAME)})
    try:
        d = mod.make(args_w, data)
    finally:
        cfg.load_recipe = orig
    inner = d["step"]

    def step(rec):
        try:
            inner(rec)
        except RuntimeError as e:
            if not str(e).startswith("unexpected step structure"):
                raise

    d["checks"]["overrides"] = OVERRIDES
    return {"name": NAME, "step": step, "checks": d["checks"]}
