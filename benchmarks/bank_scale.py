"""Bank at scale: ingest rate, index build, and search latency (flat and HNSW).

    .venv/bin/python benchmarks/bank_scale.py --quick      # 5k rollouts
    .venv/bin/python benchmarks/bank_scale.py              # 100k rollouts

Ingest = `Bank.add_file` of a synthetic JSONL (tool-call transcripts of ~1.5 KB, 80 %
successful), one transaction, embedding excluded. Embedding is timed separately with the
real embedder on `--embed-sample` instructions (the rate is extrapolated to the whole bank);
the index then holds those real vectors plus, for the remaining rows, copies of them with
Gaussian noise, renormalised (so the 100k run does not spend ~6 min embedding on 2 cores;
`--embed-all` embeds every row instead). Search latency is per single query, k = 3, after
the query is embedded: the FAISS search alone, and the whole retrieval (over-fetch,
exclusions, reading the rows from SQLite), and per query when 32 are retrieved together (as
training does). Query embedding latency (50 single queries) is reported on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lopd_cli.bank.embed import embed_texts, load_embedder  # noqa: E402
from lopd_cli.bank.index import VectorIndex  # noqa: E402
from lopd_cli.bank.retrieve import Retriever  # noqa: E402
from lopd_cli.bank.store import Bank  # noqa: E402
from lopd_cli.config import BankSection  # noqa: E402

VERBS = ["Refund", "Cancel", "Track", "Update the address of", "Split", "Expedite", "Return", "Check the status of"]
THINGS = ["order", "subscription", "package", "invoice", "booking", "ticket"]
REASONS = ["it arrived broken", "the customer moved", "it is late", "they were charged twice", "the size is wrong",
           "it never arrived", "they changed their mind", "a coupon was not applied"]


def synthetic_record(i: int, rng: random.Random) -> dict:
    verb, thing, why = rng.choice(VERBS), rng.choice(THINGS), rng.choice(REASONS)
    instr = f"{verb} {thing} {1000 + i} for customer {rng.randint(1, 99999)} because {why}."
    out = json.dumps({"id": 1000 + i, "status": rng.choice(["shipped", "pending", "delivered"]),
                      "items": [{"sku": f"SKU{rng.randint(1, 9999)}", "qty": rng.randint(1, 4)} for _ in range(8)],
                      "history": ["event " * 8] * rng.randint(2, 8)})
    return {"task_id": f"bench-{i}", "instruction": instr,
            "messages": [{"role": "system", "content": "You are a customer-service agent with tools."},
                         {"role": "user", "content": instr},
                         {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                             "name": "get_order", "arguments": json.dumps({"order_id": 1000 + i})}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": out},
                         {"role": "assistant", "content": f"Done: {verb.lower()} {thing} {1000 + i}."}],
            "reward": 1.0 if rng.random() < 0.8 else 0.0,
            "tools": [{"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}],
            "meta": {"env": "bench", "seed": i}}


def percentile_ms(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1000, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5k rollouts instead of 100k")
    ap.add_argument("-n", type=int, help="number of rollouts (overrides --quick)")
    ap.add_argument("--embed-sample", type=int, default=2000, help="rows embedded for real (rate measured on them)")
    ap.add_argument("--embed-all", action="store_true", help="embed every successful row")
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n = args.n or (5_000 if args.quick else 100_000)
    rng = random.Random(0)
    res: dict = {"rollouts": n, "cpu_threads": os.cpu_count()}

    with tempfile.TemporaryDirectory(prefix="bank_scale-") as tmp:
        tmp = Path(tmp)
        src = tmp / "rollouts.jsonl"
        with open(src, "w") as f:
            for i in range(n):
                f.write(json.dumps(synthetic_record(i, rng)) + "\n")
        res["file_mb"] = round(src.stat().st_size / 1e6, 1)

        bank = Bank(tmp / "bank.sqlite")
        t = time.perf_counter()
        added = bank.add_file(src)
        dt = time.perf_counter() - t
        assert added.added == n, added
        res["ingest_s"] = round(dt, 2)
        res["ingest_rollouts_per_s"] = round(n / dt)
        t = time.perf_counter()
        again = bank.add_file(src)
        res["readd_duplicates_per_s"] = round(n / (time.perf_counter() - t))
        assert again.added == 0
        res["bank_mb"] = round(sum(p.stat().st_size for p in tmp.glob("bank.sqlite*")) / 1e6, 1)

        success_ids = np.asarray(bank.ids(success_only=True), dtype=np.int64)
        items = bank.get_many(success_ids[: args.embed_sample if not args.embed_all else len(success_ids)].tolist())
        texts = [items[i].instruction for i in sorted(items)]
        model = load_embedder("all-minilm-l6-v2")
        embed_texts(model, texts[:64])  # warm-up
        t = time.perf_counter()
        real = embed_texts(model, texts)
        dt = time.perf_counter() - t
        res["embed_texts"] = len(texts)
        res["embed_texts_per_s"] = round(len(texts) / dt)
        res["embed_all_successes_est_s"] = round(len(success_ids) / (len(texts) / dt))
        if len(real) < len(success_ids):
            noise_rng = np.random.default_rng(0)
            reps = real[noise_rng.integers(0, len(real), len(success_ids) - len(real))]
            reps = reps + noise_rng.normal(0, 0.05, reps.shape).astype(np.float32)
            reps /= np.linalg.norm(reps, axis=1, keepdims=True)
            vecs = np.concatenate([real, reps])
        else:
            vecs = real
        res["indexed"] = len(vecs)

        q_texts = [synthetic_record(n + j, rng)["instruction"] for j in range(args.queries)]
        t_embed = []
        for q in q_texts[:50]:
            t = time.perf_counter()
            embed_texts(model, [q])
            t_embed.append(time.perf_counter() - t)
        q_vecs = embed_texts(model, q_texts)
        res["query_embed_ms_p50"] = round(percentile_ms(t_embed, 50), 2)
        res["query_embed_ms_p99"] = round(percentile_ms(t_embed, 99), 2)

        flat_top = None
        for kind in ("flat", "hnsw"):
            t = time.perf_counter()
            index = VectorIndex(kind, vecs.shape[1], {})
            index.add(success_ids, vecs)
            res[f"{kind}_build_s"] = round(time.perf_counter() - t, 2)
            t = time.perf_counter()
            index.save(tmp / f"index-{kind}")
            VectorIndex.load(tmp / f"index-{kind}")
            res[f"{kind}_save_load_s"] = round(time.perf_counter() - t, 2)
            retriever = Retriever(bank, index, model, BankSection(index=kind))
            t_search, t_retr = [], []
            for j in range(len(q_vecs)):
                v = q_vecs[j:j + 1]
                t = time.perf_counter()
                index.search(v, 13)
                t_search.append(time.perf_counter() - t)
                t = time.perf_counter()
                retriever.retrieve_vectors(v, 3, [{f"bench-{j}"}], [set()])
                t_retr.append(time.perf_counter() - t)
            res[f"{kind}_search_ms_p50"] = round(percentile_ms(t_search, 50), 3)
            res[f"{kind}_search_ms_p99"] = round(percentile_ms(t_search, 99), 3)
            res[f"{kind}_retrieve_ms_p50"] = round(percentile_ms(t_retr, 50), 3)
            res[f"{kind}_retrieve_ms_p99"] = round(percentile_ms(t_retr, 99), 3)
            t = time.perf_counter()  # training retrieves for 32 tasks at once
            for s in range(0, len(q_vecs) - 31, 32):
                retriever.retrieve_vectors(q_vecs[s:s + 32], 3, [set()] * 32, [set()] * 32)
            res[f"{kind}_retrieve_batch32_ms_per_query"] = round(
                (time.perf_counter() - t) * 1000 / (len(q_vecs) // 32 * 32), 3)
            _, top = index.search(q_vecs, 10)
            if flat_top is None:
                flat_top = top
            else:
                res[f"{kind}_recall_at_10_vs_flat"] = round(float(np.mean(
                    [len(set(a) & set(b)) / 10 for a, b in zip(top, flat_top)])), 3)
        bank.close()

    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:32s} {v}")


if __name__ == "__main__":
    main()
