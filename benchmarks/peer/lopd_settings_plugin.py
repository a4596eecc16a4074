"""bench_peer plugin: the product plugin (lopd_product_plugin.py, next to this file) with
recipe overrides, so several composer-phase settings interleave in one process.

    LOPD_PEER_SETTINGS="lopd_all:;lopd_c2:train.lopd.composer_batch=2;lopd_e4:train.lopd.composer_every=4"
    .venv-peer/bin/python benchmarks/peer/bench_peer.py --model ~/.cache/lopd/models/tiny --workloads sdft,sft \\
        --plugin benchmarks/peer/lopd_settings_plugin.py --plugin ... (once per setting)

Each --plugin occurrence takes the next `name:override,override` entry. The product plugin's
step-structure check (2 backward calls, 2 chunked_logprobs calls: the old phase order) is
dropped: with composer rows split from the others the counts differ. Its backward/log-prob
labels follow call order, so for this code read the totals (p_update, total), not those labels.

The word `fresh` among a setting's overrides empties the trainer's no-grad latent cache before
every step: the harness repeats its 8 prompts every step, so between φ updates the cache would
serve every latent, which a run that samples new tasks each step does not get.
"""
import builtins
import importlib.util
import os
from pathlib import Path

SHARED = Path(os.environ.get("LOPD_PEER_PLUGIN", Path(__file__).resolve().parent / "lopd_product_plugin.py"))
_i = getattr(builtins, "_lopd_peer_setting", 0)
builtins._lopd_peer_setting = _i + 1
_entries = [e for e in os.environ.get("LOPD_PEER_SETTINGS", "lopd_product:").split(";") if e.strip()]
NAME, _, _ovr = _entries[_i].partition(":")
OVERRIDES = [o for o in _ovr.split(",") if o.strip() and o.strip() != "fresh"]
FRESH = "fresh" in [o.strip() for o in _ovr.split(",")]


def make(args, data):
    import lopd_cli.config as cfg
    import lopd_cli.train.loop as loop_mod

    spec = importlib.util.spec_from_file_location(f"lopd_product_plugin_{_i}", SHARED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    orig = cfg.load_recipe
    cfg.load_recipe = lambda path, overrides=None, *a, **k: orig(path, list(overrides or []) + OVERRIDES, *a, **k)
    built = []
    orig_build = loop_mod.build_trainer
    loop_mod.build_trainer = lambda *a, **k: built.append(orig_build(*a, **k)) or built[-1]
    args_w = type(args)(**{**vars(args), "workdir": os.path.join(args.workdir, NAME)})
    try:
        d = mod.make(args_w, data)
    finally:
        cfg.load_recipe = orig
        loop_mod.build_trainer = orig_build
    inner = d["step"]
    tr = built[-1]

    def step(rec):
        if FRESH and tr.nograd_latents is not None:
            tr.nograd_latents.clear()
        try:
            inner(rec)
        except RuntimeError as e:
            if not str(e).startswith("unexpected step structure"):
                raise

    d["checks"]["overrides"] = OVERRIDES + (["fresh"] if FRESH else [])
    return {"name": NAME, "step": step, "checks": d["checks"]}
