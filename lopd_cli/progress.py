"""lopd's own progress: a rich bar on a terminal, plain lines in a log.

When stderr is not a terminal (a log file, CI, a pipe), rich cannot redraw a bar, so a
`LogProgress` prints one line per open task every `LOPD_PROGRESS_EVERY` seconds (default 5)
with the count, rate and ETA, and a closing line for a task that lasted that long. A
`heartbeat` covers stretches without a bar (model builds, set-up): while it runs, a line
naming the current activity appears whenever no progress line was printed for an interval.

Displays nest: a bar opened while another is open adds its tasks to the open one (rich allows
one live display at a time).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

_LOCK = threading.RLock()
_OPEN: list[Any] = []  # open displays, outermost first
_LAST_LINE = [time.monotonic()]  # when a progress line was last printed (for the heartbeat)
_ACTIVITY: list[str] = []  # names of running activities, innermost last


def interval_s() -> float:
    try:
        return max(0.05, float(os.environ.get("LOPD_PROGRESS_EVERY", "5")))
    except ValueError:
        return 5.0


def fmt_duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def status_line(description: str, completed: float, total: float | None, elapsed: float, info: str = "",
                done: bool = False, since: float = 0.0) -> str:
    """One progress line: `rollouts 12/64 (19%) 0.52/s ETA 1m40s 23s elapsed  info`, or with
    `done` the closing one: `rollouts 64/64 (100%) 0.52/s done in 2m03s  info`. The rate counts
    what was done after `since` (a resumed run's earlier steps took no time here)."""
    rate = (completed - since) / elapsed if elapsed > 0 else 0.0
    parts = [description]
    if total:
        parts.append(f"{completed:g}/{total:g} ({100 * completed / total:.0f}%)")
    elif completed:
        parts.append(f"{completed:g} done")
    if completed > since:
        parts.append(f"{rate:.3g}/s" if rate >= 0.1 else f"{1 / rate:.3g}s each" if rate > 0 else "")
    if total and rate > 0 and completed < total and not done:
        parts.append(f"ETA {fmt_duration((total - completed) / rate)}")
    parts.append(f"done in {fmt_duration(elapsed)}" if done else f"{fmt_duration(elapsed)} elapsed")
    line = " ".join(p for p in parts if p)
    return f"{line}  {info}" if info else line


def _emit(line: str) -> None:
    stream = sys.stderr  # looked up at each call: tests and callers may swap it
    stream.write(line + "\n")
    stream.flush()
    _LAST_LINE[0] = time.monotonic()


@dataclass
class _LogTask:
    description: str
    total: float | None
    info: str = ""
    completed: float = 0.0
    since: float = 0.0  # completed when timing (re)started: the rate counts only what came after
    start: float = field(default_factory=time.monotonic)
    printed: bool = False
    finished: bool = False


class LogProgress:
    """The subset of rich.progress.Progress lopd uses, printing plain lines (see module doc)."""

    def __init__(self, every: float | None = None):
        self.every = interval_s() if every is None else every
        self.tasks: dict[int, _LogTask] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "LogProgress":
        self._thread = threading.Thread(target=self._loop, daemon=True, name="lopd-progress")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)
        with _LOCK:
            for t in self.tasks.values():
                self._close(t)

    def add_task(self, description: str, total: float | None = None, info: str = "", **_: Any) -> int:
        with _LOCK:
            tid = len(self.tasks)
            self.tasks[tid] = _LogTask(description, total, info)
            return tid

    def update(self, task_id: int, *, advance: float | None = None, completed: float | None = None,
               total: float | None = None, info: str | None = None, description: str | None = None,
               **_: Any) -> None:
        with _LOCK:
            t = self.tasks[task_id]
            if total is not None:
                t.total = total
            if completed is not None:
                t.completed = completed
            if advance:
                t.completed += advance
            if info is not None:
                t.info = info
            if description is not None:
                t.description = description
            if t.total and t.completed >= t.total:
                self._close(t)

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def reset(self, task_id: int, *, completed: float = 0.0, **_: Any) -> None:
        """Restart the clock at `completed` (rich's `Progress.reset`), e.g. when a run resumes."""
        with _LOCK:
            t = self.tasks[task_id]
            t.completed = t.since = completed
            t.start = time.monotonic()

    def wrap_file(self, file: Any, task_id: int, **_: Any) -> "_CountingReader":
        return _CountingReader(file, lambda n: self.advance(task_id, n))

    def remove_task(self, task_id: int) -> None:
        with _LOCK:
            self._close(self.tasks[task_id])

    def _close(self, t: _LogTask) -> None:
        if t.finished:
            return
        t.finished = True
        if t.printed:  # a closing line only for a task that lasted long enough to report
            elapsed = time.monotonic() - t.start
            _emit(status_line(t.description, t.completed, t.total, elapsed, t.info, done=True, since=t.since))

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            with _LOCK:
                now = time.monotonic()
                for t in self.tasks.values():
                    if not t.finished:
                        t.printed = True
                        _emit(status_line(t.description, t.completed, t.total, now - t.start, t.info, since=t.since))


class _CountingReader:
    """A binary file whose reads advance a progress task by the bytes read."""

    def __init__(self, file: Any, on_read: Any):
        self._file, self._on_read = file, on_read

    def _count(self, data: bytes) -> bytes:
        if data:
            self._on_read(len(data))
        return data

    def read(self, size: int = -1) -> bytes:
        return self._count(self._file.read(size))

    def readline(self, size: int = -1) -> bytes:
        return self._count(self._file.readline(size))

    def __iter__(self) -> "_CountingReader":
        return self

    def __next__(self) -> bytes:
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


class _Nested:
    """A display opened inside another: its tasks go to the outer one and end with it."""

    def __init__(self, outer: Any):
        self.outer = outer
        self.ids: list[int] = []

    def __enter__(self) -> "_Nested":
        return self

    def __exit__(self, *exc) -> None:
        for tid in self.ids:
            try:
                self.outer.remove_task(tid)
            except KeyError:
                pass

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        tid = self.outer.add_task(description, total=total, **fields)
        self.ids.append(tid)
        return tid

    def update(self, task_id: int, **kw: Any) -> None:
        self.outer.update(task_id, **kw)

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.outer.advance(task_id, advance)

    def reset(self, task_id: int, **kw: Any) -> None:
        self.outer.reset(task_id, **kw)

    def wrap_file(self, file: Any, task_id: int, **kw: Any) -> Any:
        return self.outer.wrap_file(file, task_id=task_id, **kw)


class _Tracked:
    """Registers a display as open for as long as its `with` block runs."""

    def __init__(self, display: Any):
        self.display = display

    def __enter__(self) -> Any:
        with _LOCK:
            _OPEN.append(self.display)
        return self.display.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            self.display.__exit__(*exc)
        finally:
            with _LOCK:
                if self.display in _OPEN:
                    _OPEN.remove(self.display)


def is_terminal() -> bool:
    from lopd_cli.console import err_console

    return bool(err_console.is_terminal)


def make_progress(transient: bool = False) -> Any:
    """A progress display for `with`: rich on a terminal, LogProgress otherwise; nested when one is open."""
    with _LOCK:
        if _OPEN:
            return _Nested(_OPEN[-1])
    if not is_terminal():
        return _Tracked(LogProgress())
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from lopd_cli.console import err_console

    return _Tracked(Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=err_console, transient=transient,
    ))


@contextmanager
def activity(name: str) -> Iterator[None]:
    """Name a stretch of work without a count (a model build, a conversion) for the heartbeat,
    and on a terminal show it as a task with its elapsed time."""
    with _LOCK:
        _ACTIVITY.append(name)
    try:
        if is_terminal():
            with make_progress(transient=True) as bar:
                bar.add_task(name, total=None, info="")
                yield
        else:
            yield
    finally:
        with _LOCK:
            if name in _ACTIVITY:
                _ACTIVITY.remove(name)


@contextmanager
def heartbeat(label: str, every: float | None = None) -> Iterator[None]:
    """While the block runs and stderr is a log: a line `label: working (activity), T elapsed`
    whenever no progress line came for an interval, so a log never goes silent for long."""
    if is_terminal():
        yield
        return
    every = interval_s() if every is None else every
    stop = threading.Event()
    start = time.monotonic()
    _LAST_LINE[0] = start

    def loop() -> None:
        while not stop.wait(min(every, 1.0)):
            now = time.monotonic()
            with _LOCK:
                if now - _LAST_LINE[0] < every or _OPEN:  # an open bar reports on its own
                    continue
                doing = f" ({_ACTIVITY[-1]})" if _ACTIVITY else ""
                _emit(f"{label}: working{doing}, {fmt_duration(now - start)} elapsed")

    thread = threading.Thread(target=loop, daemon=True, name="lopd-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2)


def note_output() -> None:
    """Tell the heartbeat that something was just printed (e.g. a stage line of the demo)."""
    _LAST_LINE[0] = time.monotonic()


@contextmanager
def counter(description: str, total: int | None = None, transient: bool = True) -> Iterator[Callable[[int], None]]:
    """A bar for work that reports finished items, e.g. `run_episodes(progress=tick)`."""
    with make_progress(transient) as bar:
        tid = bar.add_task(description, total=total, info="")
        yield lambda k=1: bar.advance(tid, k)


@contextmanager
def step_counter(description: str, transient: bool = True) -> Iterator[Callable[[int, int, float], None]]:
    """A bar for `progress(step, steps, loss)` callbacks (the tiny base-policy build); the task
    appears on the first call, so nothing shows when the build is cached."""
    with make_progress(transient) as bar:
        tid: list[int] = []

        def on_step(step: int, steps: int, loss: float) -> None:
            if not tid:
                tid.append(bar.add_task(description, total=steps, info=""))
            bar.update(tid[0], completed=step, info=f"loss {loss:.3f}")

        yield on_step
