"""One MCP server per process, reached through the official `mcp` SDK's `Client`.

The SDK is asynchronous; lopd's runner is not. Each `McpServer` owns an asyncio loop on a
daemon thread: the `Client` context is entered and left by one task on that loop, and every
call from the runner is a coroutine submitted to it and waited for with a timeout. A server is
started on first use and shared by every episode of the process (`shared_server`); when it
dies, the next call raises `McpServerDied` and the server is started again, and its
`generation` goes up so that episodes begun on the old process know their state is gone.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import shutil
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lopd_cli.errors import LopdError


class McpServerError(LopdError):
    """The server could not be started, or it stopped answering."""


class McpServerDied(McpServerError):
    """The server process stopped answering mid-run; it has been restarted."""


class McpCallTimeout(Exception):
    """A tool call took longer than `env.mcp.call_timeout_s`."""


@dataclass(frozen=True)
class ServerSpec:
    """How to reach a server: a stdio command (with its arguments, environment and folder) or a URL."""

    command: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str | None = None
    start_timeout_s: float = 30.0

    @property
    def label(self) -> str:
        return self.url or " ".join([self.command or "", *self.args]).strip()


_PROCESS_TMP: str | None = None


def process_tmp() -> Path:
    """A folder of this process's own (removed at exit): `{tmp}` in a recipe's server section, so
    that two processes running the same recipe do not share a server's files."""
    global _PROCESS_TMP
    if _PROCESS_TMP is None:
        _PROCESS_TMP = tempfile.mkdtemp(prefix="lopd-mcp-")
        atexit.register(shutil.rmtree, _PROCESS_TMP, True)
    return Path(_PROCESS_TMP)


def expand(text: str, base_dir: Path) -> str:
    """`{python}` (this interpreter), `{tmp}` (process_tmp) and `{recipe_dir}` in a server setting."""
    return (text.replace("{python}", sys.executable).replace("{tmp}", str(process_tmp()))
            .replace("{recipe_dir}", str(base_dir)))


def spec_from_section(section: Any, base_dir: Path) -> ServerSpec:
    """A `ServerSpec` from a recipe's `env.mcp` section (command, args, env, cwd, url, start_timeout_s)."""
    return ServerSpec(
        command=expand(section.command, base_dir) if section.command else None,
        args=tuple(expand(a, base_dir) for a in section.args),
        env=tuple(sorted((k, expand(str(v), base_dir)) for k, v in section.env.items())),
        cwd=expand(section.cwd, base_dir) if section.cwd else str(base_dir),
        url=section.url,
        start_timeout_s=section.start_timeout_s,
    )


@dataclass
class CallResult:
    """A tool call's answer: its text blocks joined, its structured content, and the error flag."""

    text: str
    structured: Any = None
    is_error: bool = False


@dataclass
class McpServer:
    spec: ServerSpec
    generation: int = 0
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _client: Any = field(default=None, repr=False)
    _stop: asyncio.Event | None = field(default=None, repr=False)
    _holder: Any = field(default=None, repr=False)
    _stderr_path: Path | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    tools: list[dict] = field(default_factory=list)

    # ------------------------------------------------------------------ life cycle

    @property
    def alive(self) -> bool:
        return self._client is not None and self._holder is not None and not self._holder.done()

    def ensure_started(self) -> None:
        with self._lock:
            if not self.alive:
                if self._holder is not None:  # it ended on its own: episodes begun on it lost their state
                    self.generation += 1
                self._start()

    def _start(self) -> None:
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        self._shutdown()
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="lopd-mcp", daemon=True).start()
        spec = self.spec
        self._stderr_path = None if spec.url else process_tmp() / f"server-{id(self)}-{self.generation}.stderr"

        async def hold(started: asyncio.Future) -> None:
            # The Client context is entered and left in this one task, as anyio requires.
            self._stop = asyncio.Event()
            errlog = open(self._stderr_path, "w") if self._stderr_path else None  # noqa: SIM115
            try:
                if spec.url:
                    target: Any = spec.url
                else:
                    params = StdioServerParameters(command=spec.command or "", args=list(spec.args),
                                                   env=dict(spec.env) or None, cwd=spec.cwd)
                    target = stdio_client(params, errlog=errlog)
                async with Client(target, cache=None) as client:
                    listed = await client.list_tools()
                    self.tools = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in listed.tools]
                    self._client = client
                    started.set_result(None)
                    await self._stop.wait()
            except BaseException as e:  # noqa: BLE001 - reported through `started` or by the next call
                if not started.done():
                    started.set_exception(e)
                raise
            finally:
                if errlog is not None:
                    errlog.close()

        async def launch() -> None:
            started = asyncio.get_running_loop().create_future()
            self._holder = asyncio.ensure_future(hold(started))
            await started

        fut = asyncio.run_coroutine_threadsafe(launch(), self._loop)
        try:
            fut.result(timeout=spec.start_timeout_s)
        except BaseException as e:  # noqa: BLE001
            fut.cancel()
            self._shutdown()
            reason = "no answer in time" if isinstance(e, TimeoutError) else _reason(e)
            raise McpServerError(f"MCP server `{spec.label}` did not start: {reason}{self._stderr_tail()}") from None

    def _shutdown(self) -> None:
        holder, self._holder, self._client = self._holder, None, None
        if holder is None or self._loop is None:
            return

        async def stop() -> None:
            if self._stop is not None:
                self._stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(holder), 5)
            except BaseException:  # noqa: BLE001 - a dead server's context may raise on the way out
                holder.cancel()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        except BaseException:  # noqa: BLE001
            pass

    def close(self) -> None:
        with self._lock:
            self._shutdown()
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None

    def _stderr_tail(self, n: int = 3) -> str:
        if not self._stderr_path or not self._stderr_path.exists():
            return ""
        lines = [ln.strip() for ln in self._stderr_path.read_text(errors="replace").splitlines() if ln.strip()]
        return f"; its stderr ends: {' | '.join(lines[-n:])}" if lines else ""

    # ------------------------------------------------------------------ calls

    def call(self, name: str, arguments: Mapping[str, Any], timeout_s: float) -> CallResult:
        """Call a tool. Raises McpCallTimeout after timeout_s, McpServerDied (after restarting the
        server) when the server stopped answering."""
        self.ensure_started()
        client, loop = self._client, self._loop
        assert loop is not None
        fut = asyncio.run_coroutine_threadsafe(client.call_tool(name, dict(arguments)), loop)
        try:
            result = fut.result(timeout=timeout_s)
        except TimeoutError:
            fut.cancel()
            if self.alive:
                raise McpCallTimeout(f"{name} timed out after {timeout_s:g}s") from None
            err: BaseException = RuntimeError("the server stopped answering")
        except Exception as e:  # noqa: BLE001
            if self.alive and not _is_connection_error(e):
                return CallResult(text=f"{type(e).__name__}: {e}", is_error=True)
            err = e
        else:
            text = "\n".join(getattr(b, "text", "") for b in result.content if getattr(b, "type", "") == "text")
            return CallResult(text=text, structured=result.structured_content, is_error=bool(result.is_error))
        tail = self._stderr_tail()
        self.restart()
        raise McpServerDied(f"MCP server `{self.spec.label}` stopped answering during {name} "
                            f"({_reason(err)}){tail}; it was restarted")

    def restart(self) -> None:
        with self._lock:
            self.generation += 1
            self._shutdown()
            try:
                self._start()
            except McpServerError:
                pass  # the next call tries again and reports it

    def ping(self) -> None:
        self.ensure_started()
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._client.send_ping(), self._loop).result(timeout=self.spec.start_timeout_s)


def _is_connection_error(e: BaseException) -> bool:
    import anyio

    if isinstance(e, (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream,
                      BrokenPipeError, ConnectionError, EOFError)):
        return True
    return "connection closed" in str(e).lower()


def _reason(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_reason(x) for x in e.exceptions)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class _OneLineStdoutNoise(logging.Filter):
    """The SDK logs a full traceback for every line a stdio server writes to stdout that is not
    JSON-RPC (a print() banner, a library's log); this makes each one line saying what to fix."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.getMessage().startswith("Failed to parse JSONRPC message"):
            exc = record.exc_info[1]
            errors = getattr(exc, "errors", None)
            line = errors()[0].get("input") if callable(errors) and errors() else str(exc).splitlines()[0]
            record.msg = ("warning: the MCP server wrote a line to stdout that is not JSON-RPC, which lopd "
                          "skips (a stdio server must log to stderr): %.200r")
            record.args = (line,)
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("mcp.client.stdio").addFilter(_OneLineStdoutNoise())


_SERVERS: dict[ServerSpec, McpServer] = {}
_SERVERS_LOCK = threading.Lock()


def shared_server(spec: ServerSpec) -> McpServer:
    """This process's server for `spec`, started on first use and reused by every episode."""
    with _SERVERS_LOCK:
        server = _SERVERS.get(spec)
        if server is None:
            server = _SERVERS[spec] = McpServer(spec)
    server.ensure_started()
    return server


def close_all() -> None:
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for s in servers:
        s.close()


atexit.register(close_all)


def json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

