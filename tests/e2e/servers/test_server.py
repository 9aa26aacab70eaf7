"""A small MCP server (official Python SDK) with behaviours the reference servers lack:
reporting its own environment, sleeping, failing, crashing mid-call, and huge answers.

usage: test_server.py [--hang-at-start] [--many-tools N] [--tools-ttl-ms MS] [--legacy]

--tools-ttl-ms  the `ttlMs` its tools/list results carry (default: the SDK's, 0)
--legacy        speaks only the handshake era (answers `server/discover` with an error)
"""

import asyncio
import os
import sys
import time

if "--hang-at-start" in sys.argv:
    time.sleep(3600)  # never answers initialize: tests the startup timeout

from mcp.server import MCPServer
from mcp.server.caching import CacheHint
from mcp.server.mcpserver import Context


class CountingServer(MCPServer):
    """Counts the tools/list requests it answers (for the proxy's caching tests)."""

    tools_lists = 0

    async def _handle_list_tools(self, ctx, params):
        CountingServer.tools_lists += 1
        return await super()._handle_list_tools(ctx, params)


_hints = None
if "--tools-ttl-ms" in sys.argv:
    _hints = {"tools/list": CacheHint(ttl_ms=int(sys.argv[sys.argv.index("--tools-ttl-ms") + 1]))}
server = CountingServer("ironcell-test-server", cache_hints=_hints)


@server.tool()
def tools_list_count() -> int:
    """How many tools/list requests this server has answered."""
    return CountingServer.tools_lists


@server.tool()
def get_env(name: str) -> str:
    """Returns the value of one of this server's environment variables ('' if unset)."""
    return os.environ.get(name, "")


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


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
def log_line(megabytes: int) -> int:
    """Writes one line of `megabytes` MiB to stderr (a server logging what it was sent)."""
    chunk = "y" * (1 << 20)
    for _ in range(megabytes):
        sys.stderr.write(chunk)
    sys.stderr.write("\n")
    sys.stderr.flush()
    return megabytes


@server.tool()
def structured(n: int) -> dict:
    """Returns structured content: n and its square."""
    return {"n": n, "square": n * n}


@server.tool()
async def add_tool(name: str, ctx: Context) -> str:
    """Adds a tool called `name` (it returns its own name) and announces tools/list_changed."""

    def added() -> str:
        return name

    server.tool(name=name, description=f"Added at run time: {name}")(added)
    await ctx.session.send_tool_list_changed()
    return f"added {name}"


@server.tool()
async def add_tool_announced(name: str, ctx: Context) -> str:
    """Adds a tool called `name` and announces the change where each era listens: on
    subscriptions/listen streams (2026-07-28) and as a notification (handshake era)."""

    def added() -> str:
        return name

    server.tool(name=name, description=f"Added at run time: {name}")(added)
    await ctx.notify_tools_changed()
    await ctx.session.send_tool_list_changed()
    return f"added {name}"


def _add_many_tools(n):
    """N more tools with varied names and descriptions (for the search benchmark)."""
    verbs = ["create", "list", "get", "update", "delete", "search", "sync", "export", "import", "archive"]
    nouns = ["issue", "repository", "file", "user", "invoice", "ticket", "message", "event", "report",
             "dataset", "branch", "comment", "label", "project", "calendar", "contact", "order",
             "payment", "document", "folder"]
    for i in range(n):
        verb, noun = verbs[i % len(verbs)], nouns[(i // len(verbs)) % len(nouns)]
        name = f"{verb}_{noun}_{i}"
        desc = f"{verb.capitalize()} a {noun} in workspace {i}; returns the {noun} record."

        def tool(x: int = 0) -> int:
            return x

        server.tool(name=name, description=desc)(tool)


if "--many-tools" in sys.argv:
    _add_many_tools(int(sys.argv[sys.argv.index("--many-tools") + 1]))


async def _serve_legacy():
    """The handshake era only: the SDK's loop mode, which has no `server/discover`."""
    from mcp.server.runner import serve_loop
    from mcp.server.stdio import stdio_server

    low = server._lowlevel_server
    async with stdio_server() as (read, write), low.lifespan(low) as state:
        await serve_loop(low, read, write, lifespan_state=state, init_options=low.create_initialization_options())


if __name__ == "__main__":
    if "--legacy" in sys.argv:
        import anyio

        anyio.run(_serve_legacy)
    else:
        server.run()
