"""The experience bank: one SQLite row per rollout (sqlite-utils, WAL mode, busy timeout).

Writes are all-or-nothing per call: `add_file` / `add_records` run in one `BEGIN IMMEDIATE`
transaction, so a crash or SIGKILL mid-file leaves the bank as it was, and several processes
adding at once queue on the write lock (busy timeout, `LOPD_BANK_TIMEOUT_S`, default 600 s)
instead of failing. Duplicates are found by content hash (UNIQUE), so re-adding adds nothing.
Ids come from AUTOINCREMENT and are never reused, so the FAISS id map cannot point a removed
row's vector at a new row.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

import sqlite_utils

from lopd_cli.bank.records import RecordError, content_hash, parse_line, parse_record, to_export
from lopd_cli.errors import LopdError

SCHEMA_VERSION = 1
MAX_REPORTED_INVALID = 1000  # reasons kept per file; the count is always exact

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT,
    instruction TEXT NOT NULL,
    messages TEXT NOT NULL,
    tools TEXT NOT NULL,
    reward REAL NOT NULL,
    success INTEGER NOT NULL,
    meta TEXT NOT NULL,
    source_file TEXT,
    source_line INTEGER,
    content_hash TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_success ON rollouts(success);
CREATE INDEX IF NOT EXISTS rollouts_task_id ON rollouts(task_id);
CREATE TABLE IF NOT EXISTS bank_info (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_INSERT = (
    "INSERT OR IGNORE INTO rollouts (task_id, instruction, messages, tools, reward, success, meta,"
    " source_file, source_line, content_hash, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)"
)
_COLUMNS = "id, task_id, instruction, messages, tools, reward, success, meta"


@dataclass
class BankItem:
    id: int
    task_id: str | None
    instruction: str
    messages: list[dict]
    tools: list[dict]
    reward: float
    success: bool
    meta: dict[str, Any]
    score: float | None = None  # similarity, set by retrieval

    def to_record(self) -> dict[str, Any]:
        return to_export(self.__dict__)


@dataclass
class AddResult:
    source: str
    added: int = 0
    duplicates: int = 0
    successes: int = 0  # among the added rows
    invalid: int = 0
    invalid_lines: list[tuple[int, str]] = field(default_factory=list)  # (line, reason)
    written: bool = True  # False when invalid lines made the whole file be rejected
    ids: list[int] = field(default_factory=list)  # ids of the added rows (add_records only)

    def as_dict(self) -> dict[str, Any]:
        return dict(source=self.source, added=self.added, duplicates=self.duplicates, successes=self.successes,
                    invalid=self.invalid, written=self.written,
                    invalid_lines=[{"line": n, "reason": r} for n, r in self.invalid_lines])


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _item(row: tuple) -> BankItem:
    id_, task_id, instruction, messages, tools, reward, success, meta = row
    return BankItem(id_, task_id, instruction, json.loads(messages), json.loads(tools), reward, bool(success),
                    json.loads(meta))


class Bank:
    """An experience bank file. Cheap to open; safe to use from several processes."""

    def __init__(self, path: Path, min_reward: float = 0.8, create: bool = True):
        self.path = Path(path)
        self.min_reward = float(min_reward)
        if not create and not self.path.exists():
            raise LopdError(f"{self.path}: no bank yet (run `lopd bank add-rollouts FILE`)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        timeout = float(os.environ.get("LOPD_BANK_TIMEOUT_S", "600"))
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        self.conn = sqlite3.connect(str(self.path), timeout=timeout, isolation_level=None)
        self.db = sqlite_utils.Database(self.conn)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
                if self.conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    self.db.enable_wal()
                self.conn.execute("PRAGMA synchronous = NORMAL")
                self._init_schema()
                break
            except sqlite3.OperationalError as e:
                # Switching a new file to WAL while another process creates it can answer
                # "locked" without waiting for the busy handler: retry until the timeout.
                if "locked" in str(e) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                self.conn.close()
                raise LopdError(f"{self.path}: cannot open the bank ({e})") from None
            except sqlite3.DatabaseError as e:
                self.conn.close()
                raise LopdError(f"{self.path}: not a lopd bank ({e})") from None

    def _init_schema(self) -> None:
        if "bank_info" in self.db.table_names():
            self._check_version()
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            for stmt in filter(str.strip, _SCHEMA.split(";")):
                self.conn.execute(stmt)
            self.conn.execute("INSERT OR IGNORE INTO bank_info VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        self._check_version()

    def _check_version(self) -> None:
        row = self.conn.execute("SELECT value FROM bank_info WHERE key='schema_version'").fetchone()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise LopdError(
                f"{self.path}: bank schema version {version} was written by a newer lopd "
                f"(this one reads up to {SCHEMA_VERSION}); upgrade lopd"
            )

    @property
    def schema_version(self) -> int:
        return int(self.conn.execute("SELECT value FROM bank_info WHERE key='schema_version'").fetchone()[0])

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Bank":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- writing -------------------------------------------------------------------------
    def _insert(self, cur: sqlite3.Cursor, rec: dict, source: str, line: int | None, now: str,
                min_reward: float, result: AddResult, keep_ids: bool) -> None:
        success = rec["reward"] >= min_reward
        cur.execute(_INSERT, (rec["task_id"], rec["instruction"], _dumps(rec["messages"]), _dumps(rec["tools"]),
                              rec["reward"], int(success), _dumps(rec["meta"]), source, line, content_hash(rec), now))
        if cur.rowcount == 1:
            if keep_ids:
                result.ids.append(cur.lastrowid)
            result.added += 1
            result.successes += int(success)
        else:
            result.duplicates += 1

    def _write(self, rows: Iterator[tuple[int | None, dict | RecordError]], source: str, skip_invalid: bool,
               min_reward: float | None, keep_ids: bool = False) -> AddResult:
        result = AddResult(source)
        thr = self.min_reward if min_reward is None else float(min_reward)
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        cur = self.conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            for line, rec in rows:
                if isinstance(rec, RecordError):
                    result.invalid += 1
                    if len(result.invalid_lines) < MAX_REPORTED_INVALID:
                        result.invalid_lines.append((line, str(rec)))
                    continue
                if result.invalid and not skip_invalid:
                    continue  # keep scanning to report every bad line; nothing will be written
                self._insert(cur, rec, source, line, now, thr, result, keep_ids)
            if result.invalid and not skip_invalid:
                cur.execute("ROLLBACK")
                result.written = False
                result.added = result.duplicates = result.successes = 0
                result.ids = []
            else:
                cur.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                cur.execute("ROLLBACK")
            raise
        return result

    def add_stream(self, stream: IO[bytes], source: str, skip_invalid: bool = False,
                   min_reward: float | None = None) -> AddResult:
        """Add a JSONL byte stream, line by line (never loaded whole), in one transaction."""

        def rows() -> Iterator[tuple[int, dict | RecordError]]:
            for n, raw in enumerate(stream, start=1):
                if not raw.strip():
                    continue
                try:
                    yield n, parse_line(raw)
                except RecordError as e:
                    yield n, e

        return self._write(rows(), source, skip_invalid, min_reward)

    def add_file(self, path: Path, skip_invalid: bool = False, min_reward: float | None = None) -> AddResult:
        try:
            with open(path, "rb") as f:
                return self.add_stream(f, str(path), skip_invalid, min_reward)
        except FileNotFoundError:
            raise LopdError(f"{path}: file not found") from None
        except IsADirectoryError:
            raise LopdError(f"{path}: is a directory, expected a JSONL file") from None

    def add_records(self, records: Iterable[dict], source: str = "runner", min_reward: float | None = None) -> AddResult:
        """Add rollout records (dicts in the JSONL format) in one transaction. An invalid record
        raises LopdError naming `source:#index` and nothing is written. `result.ids` lists the
        new rows' ids (e.g. for `Retriever.add`)."""

        def rows() -> Iterator[tuple[int | None, dict | RecordError]]:
            for i, obj in enumerate(records):
                try:
                    yield None, parse_record(obj)
                except RecordError as e:
                    raise LopdError(f"{source}:#{i}: {e}") from None

        return self._write(rows(), source, skip_invalid=False, min_reward=min_reward, keep_ids=True)

    def remove(self, ids: Iterable[int]) -> list[int]:
        """Delete rows; returns the ids that existed (and are now gone)."""
        ids = sorted({int(i) for i in ids})
        cur = self.conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            found = [r[0] for r in self._select_ids(cur, ids)]
            cur.executemany("DELETE FROM rollouts WHERE id = ?", [(i,) for i in found])
            cur.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                cur.execute("ROLLBACK")
            raise
        return found

    @staticmethod
    def _select_ids(cur: sqlite3.Cursor, ids: list[int]) -> list[tuple]:
        out = []
        for s in range(0, len(ids), 500):
            chunk = ids[s:s + 500]
            out += cur.execute(f"SELECT id FROM rollouts WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall()
        return out

    # ---- reading -------------------------------------------------------------------------
    def count(self, success_only: bool = False) -> int:
        where = " WHERE success = 1" if success_only else ""
        return self.conn.execute(f"SELECT count(*) FROM rollouts{where}").fetchone()[0]

    def get(self, id: int) -> BankItem:
        row = self.conn.execute(f"SELECT {_COLUMNS} FROM rollouts WHERE id = ?", (int(id),)).fetchone()
        if row is None:
            raise LopdError(f"{self.path}: no rollout with id {id}")
        return _item(row)

    def get_many(self, ids: Iterable[int]) -> dict[int, BankItem]:
        """Rows by id; ids that no longer exist are absent from the result."""
        ids = [int(i) for i in ids]
        out: dict[int, BankItem] = {}
        for s in range(0, len(ids), 500):
            chunk = ids[s:s + 500]
            q = f"SELECT {_COLUMNS} FROM rollouts WHERE id IN ({','.join('?' * len(chunk))})"
            for row in self.conn.execute(q, chunk):
                out[row[0]] = _item(row)
        return out

    def iter_items(self, success_only: bool = True, batch: int = 1000) -> Iterator[BankItem]:
        """All rows in id order, read in batches (constant memory)."""
        where = "success = 1 AND " if success_only else ""
        last = -1
        while True:
            rows = self.conn.execute(
                f"SELECT {_COLUMNS} FROM rollouts WHERE {where}id > ? ORDER BY id LIMIT ?", (last, batch)).fetchall()
            if not rows:
                return
            for row in rows:
                yield _item(row)
            last = rows[-1][0]

    def items(self, success_only: bool = True) -> list[BankItem]:
        return list(self.iter_items(success_only))

    def ids(self, success_only: bool = True) -> list[int]:
        where = " WHERE success = 1" if success_only else ""
        return [r[0] for r in self.conn.execute(f"SELECT id FROM rollouts{where} ORDER BY id")]

    def row_info(self, id: int) -> dict[str, Any]:
        """Where a row came from: source file and line, content hash, created_at."""
        r = self.conn.execute("SELECT source_file, source_line, content_hash, created_at FROM rollouts WHERE id=?",
                              (int(id),)).fetchone()
        if r is None:
            raise LopdError(f"{self.path}: no rollout with id {id}")
        return dict(source_file=r[0], source_line=r[1], content_hash=r[2], created_at=r[3])

    def stats(self, bins: int = 10) -> dict[str, Any]:
        c = self.conn
        total, successes, rmin, rmax, mean = c.execute(
            "SELECT count(*), coalesce(sum(success), 0), min(reward), max(reward), avg(reward) FROM rollouts").fetchone()
        per_env = [dict(env=e, total=n, successes=s) for e, n, s in c.execute(
            "SELECT json_extract(meta, '$.env') AS env, count(*), sum(success) FROM rollouts GROUP BY env ORDER BY env")]
        per_source = [dict(source=e, total=n, successes=s) for e, n, s in c.execute(
            "SELECT source_file, count(*), sum(success) FROM rollouts GROUP BY source_file ORDER BY source_file")]
        hist = []
        if total:  # bins over [0, 1] (the usual reward range), widened to cover outliers
            lo, hi = min(0.0, rmin), max(1.0, rmax)
            width = (hi - lo) / bins
            counts = [0] * bins
            for b, n in c.execute(
                    "SELECT min(CAST((reward - ?) / ? AS INTEGER), ?) AS b, count(*) FROM rollouts GROUP BY b",
                    (lo, width, bins - 1)):
                counts[int(b)] += n
            hist = [dict(lo=round(lo + i * width, 6), hi=round(lo + (i + 1) * width, 6), count=counts[i])
                    for i in range(bins)]
        return dict(path=str(self.path), schema_version=self.schema_version, total=total, successes=successes,
                    min_reward=self.min_reward, reward_min=rmin, reward_max=rmax, reward_mean=mean,
                    per_env=per_env, per_source=per_source, reward_histogram=hist)
