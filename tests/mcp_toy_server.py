"""A small MCP stdio server for the MCP environment's tests: a counter per state key.

Tools: reset(key), add(n, key), total(key) (reads the state), sleep(seconds), crash() (the
process exits, as a server that dies mid-run), secret() (hidden by the tests' recipe)."""

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("toy")
STATE: dict[str, int] = {}


@server.tool()
def reset(key: str, start: int = 0) -> dict:
    """Start a fresh counter for one episode."""
    STATE[key] = start
    return {"ok": True, "key": key, "value": start}


@server.tool()
def add(n: int, key: str = "default") -> dict:
    """Add n to the counter."""
    if key not in STATE:
        raise ValueError(f"no counter {key!r}")
    STATE[key] += n
    return {"ok": True, "value": STATE[key], "pid": os.getpid()}


@server.tool()
def total(key: str = "default") -> dict:
    """Read the counter."""
    return {"value": STATE.get(key), "pid": os.getpid()}


@server.tool()
async def sleep(seconds: float) -> str:
    """Wait, then answer."""
    await asyncio.sleep(seconds)
    return "woke"


@server.tool()
def crash() -> str:
    """The server dies."""
    os._exit(1)


@server.tool()
def secret() -> str:
    """Never shown to the agent."""
    return "hidden"


if __name__ == "__main__":
    if "--fail" in sys.argv:
        sys.stderr.write("toy: cannot open the database at /nowhere\n")
        sys.exit(2)
    server.run("stdio")
