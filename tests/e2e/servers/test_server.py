"""A small MCP server (official Python SDK) with behaviours the reference servers lack:
reporting its own environment, sleeping, failing, crashing mid-call, and huge answers.

usage: test_server.py [--hang-at-start]
"""

import asyncio
import os
import sys
import time

if "--hang-at-start" in sys.argv:
    time.sleep(3600)  # never answers initialize: tests the startup timeout

from mcp.server import MCPServer

server = MCPServer("ironcell-test-server")


@server.tool()
def get_env(name: str) -> str:
    """Returns the value of one of this server's environment variables ('' if unset)."""
    return os.environ.get(name, "")


@server.tool()
async def sleep(seconds: float) -> float:
    """Sleeps, then returns the seconds slept."""
    await asyncio.sleep(seconds)
    return seconds


@server.tool()
def fail(message: str) -> str:
    """Always fails with `message` (an isError result)."""
    raise ValueError(message)


@server.tool()
def crash() -> str:
    """Exits the server process in the middle of the call."""
    os._exit(3)


@server.tool()
def huge(megabytes: int) -> str:
    """Returns a string of `megabytes` MiB."""
    return "x" * (megabytes << 20)


@server.tool()
def structured(n: int) -> dict:
    """Returns structured content: n and its square."""
    return {"n": n, "square": n * n}


if __name__ == "__main__":
    server.run()
