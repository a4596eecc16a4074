"""Retrieval API used by the composer, cold start and the OPSD baseline.

`Retriever.open(project, recipe)` loads the bank, the saved index and the embedder; it fails
with a clear message when there is no index or it was built with another embedder / text
template. Rows added to the bank after the index was saved are embedded in memory on open (and
removed rows dropped), so retrieval always sees the bank as it is; `save()` writes that back.

Results over-fetch so that exclusions (same task id, same instruction: no self-retrieval)
still return k items when the bank has them, and ties in similarity are broken by row id, so
the same query always returns the same items.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Sequence

import numpy as np

from lopd_cli.bank.embed import embed_texts, load_embedder
from lopd_cli.bank.index import VectorIndex, bank_settings, index_fingerprint, index_lock, stale_message, sync_index
from lopd_cli.bank.lite import embed_text
from lopd_cli.bank.store import Bank, BankItem
from lopd_cli.errors import LopdError

OVERFETCH = 10


class Retriever:
    def __init__(self, bank: Bank, index: VectorIndex, model: Any, cfg: Any, directory: Any = None):
        self.bank, self.index, self.model, self.cfg, self.directory = bank, index, model, cfg, directory

    @classmethod
    def open(cls, project: Any, recipe: Any = None, device: str = "cpu") -> "Retriever":
        """Bank + index + embedder of a project (recipe None: default bank settings)."""
        cfg = bank_settings(recipe)
        directory = project.index_dir(recipe)
        bank = Bank(project.bank_path(recipe), cfg.min_reward, create=False)
        index = VectorIndex.load(directory)
        if index is None:
            raise LopdError(f"{directory}: no index yet (run `lopd bank index`)")
        want = index_fingerprint(cfg)
        if index.fingerprint != want:
            raise LopdError(stale_message(directory, index.fingerprint, want))
        model = load_embedder(cfg.embedder, device)
        index, report = sync_index(index, bank, cfg, want, model=model)
        if report.added or report.removed:
            sys.stderr.write(f"note: index brought up to date in memory (+{report.added} -{report.removed} rows); "
                             "`lopd bank index` saves it\n")
        return cls(bank, index, model, cfg, directory)

    def __len__(self) -> int:
        return len(self.index)

    QUERY_CACHE = 65536  # query vectors kept (a 384-d float32 vector is 1.5 KiB)

    def embed(self, queries: list[str]) -> np.ndarray:
        """Query vectors, each distinct text embedded once per retriever: they depend on the
        embedder alone (fixed for the retriever's life), not on the bank, so a growing bank
        keeps them. Training re-asks the same task instructions every epoch. A new text is
        embedded on its own (batch of one), so its vector does not depend on which other queries
        came with it: a resumed run, whose cache starts empty, retrieves what the uninterrupted
        run retrieved."""
        cache = self.__dict__.setdefault("_query_vecs", {})
        for q in dict.fromkeys(q for q in queries if q not in cache):
            cache[q] = embed_texts(self.model, [q])[0]
        out = np.stack([cache[q] for q in queries]) if queries else embed_texts(self.model, [])
        while len(cache) > self.QUERY_CACHE:
            cache.pop(next(iter(cache)))
        return out

    # ---- searching -----------------------------------------------------------------------
    def _pick(self, scores: np.ndarray, ids: np.ndarray, k: int, ex_tasks: set, ex_instr: set,
              cache: dict[int, BankItem], fetched_all: bool) -> tuple[list[BankItem], bool]:
        """Filter one query's candidates; returns (items, settled). Not settled: more candidates
        might still change the answer (too few left, or a tie at the cut)."""
        cands = sorted(((float(s), int(i)) for s, i in zip(scores, ids) if i >= 0), key=lambda c: (-c[0], c[1]))
        need = [i for _, i in cands if i not in cache]
        if need:
            cache.update(self.bank.get_many(need))
        out: list[BankItem] = []
        for s, i in cands:
            item = cache.get(i)
            if item is None or (item.task_id is not None and item.task_id in ex_tasks):
                continue
            if item.instruction.strip() in ex_instr:
                continue
            out.append(BankItem(**{**item.__dict__, "score": s}))
        settled = fetched_all or (len(out) >= k and out[k - 1].score > cands[-1][0])
        return out[:k], settled

    def retrieve_many(self, queries: Sequence[str], k: int,
                      exclude_task_ids_per_query: Sequence[Iterable[str]] | None = None,
                      exclude_instructions_per_query: Sequence[Iterable[str]] | None = None) -> list[list[BankItem]]:
        """Top-k successful rollouts for each query (embedded in one batch), best first."""
        if not queries:
            return []
        if k <= 0 or len(self.index) == 0:
            return [[] for _ in queries]
        n = len(queries)
        ex_t = [set(x) for x in (exclude_task_ids_per_query or [()] * n)]
        ex_i = [{s.strip() for s in x} for x in (exclude_instructions_per_query or [()] * n)]
        if len(ex_t) != n or len(ex_i) != n:
            raise ValueError("one exclusion list per query is needed")
        return self.retrieve_vectors(self.embed(list(queries)), k, ex_t, ex_i)

    def retrieve_vectors(self, vecs: np.ndarray, k: int, ex_t: Sequence[set], ex_i: Sequence[set]) -> list[list[BankItem]]:
        """The search behind `retrieve_many`, for query vectors already embedded (normalised)."""
        n = len(vecs)
        if k <= 0 or len(self.index) == 0:
            return [[] for _ in range(n)]
        cache: dict[int, BankItem] = {}
        fetch = k + OVERFETCH + max(len(x) for x in ex_t) + max(len(x) for x in ex_i)
        scores, ids = self.index.search(vecs, fetch)
        results = []
        for q in range(n):
            f = fetch
            items, settled = self._pick(scores[q], ids[q], k, ex_t[q], ex_i[q], cache, f >= len(self.index))
            while not settled:
                f *= 2
                s, i = self.index.search(vecs[q:q + 1], f)
                items, settled = self._pick(s[0], i[0], k, ex_t[q], ex_i[q], cache, f >= len(self.index))
            results.append(items)
        return results

    def retrieve(self, query: str, k: int, exclude_task_ids: Iterable[str] = (),
                 exclude_instructions: Iterable[str] = ()) -> list[BankItem]:
        return self.retrieve_many([query], k, [list(exclude_task_ids)], [list(exclude_instructions)])[0]

    # ---- growing -------------------------------------------------------------------------
    def add(self, items: Iterable[BankItem | int]) -> int:
        """Index bank rows added after opening (BankItems or row ids); only successful rows not
        yet indexed are embedded. In memory; `save()` writes the index."""
        ids = [i.id if isinstance(i, BankItem) else int(i) for i in items]
        have = set(self.index.ids.tolist())
        rows = self.bank.get_many([i for i in dict.fromkeys(ids) if i not in have])
        new = [rows[i] for i in sorted(rows) if rows[i].success]
        if new:
            texts = [embed_text(it, self.cfg.embed_text, self.cfg.obs_char_budget) for it in new]
            self.index.add(np.asarray([it.id for it in new], dtype=np.int64), embed_texts(self.model, texts))
        return len(new)

    def save(self) -> None:
        if self.directory is None:
            raise LopdError("this retriever has no index folder to save to")
        with index_lock(self.directory):
            self.index.save(self.directory)

    def close(self) -> None:
        self.bank.close()
