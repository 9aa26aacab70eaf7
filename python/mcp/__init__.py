"""ironcell's in-sandbox `mcp` module: discover and call the tools of the user's other MCP servers.

The calls travel over the worker's session socket to the ironcell host, which forwards them to
the proxied servers; secrets configured for those servers never enter this process.

    from mcp import runtime                                   # also a global `runtime`
    servers = await runtime.discovered_servers()              # names; detailed=True for more
    docs = await runtime.query_tool_docs("github")            # tool=..., detail="full"
    hits = await runtime.search_tool_docs("create issue", limit=5)
    r = await mcp_servers["github"].call_tool("create_issue", {"owner": "o", "repo": "r", "title": "t"})
    r = await mcp_github.create_issue(owner="o", repo="r", title="t")
    from mcp.servers.github import create_issue

Every helper has a `*_sync` twin for code that is not async. Results are unwrapped: the tool's
`structuredContent` if present, else a single text block (parsed as JSON when it is JSON), else
the content list; `raw=True` returns the whole result. A result with `isError` raises
`ToolError`; unknown servers or tools and transport failures raise `MCPError` subclasses.
"""

import asyncio
import importlib.abc
import importlib.machinery
import inspect
import json
import keyword
import os
import sys
import types

__all__ = [
    "runtime", "mcp_servers", "MCPError", "ServerNotFoundError", "ToolNotFoundError",
    "ServerUnavailableError", "ToolError", "identifier",
]


class MCPError(Exception):
    """A proxied MCP call failed before the tool could answer."""


class ServerNotFoundError(MCPError, LookupError):
    """No configured server has that name."""


class ToolNotFoundError(MCPError, LookupError):
    """The server has no tool of that name."""


class ServerUnavailableError(MCPError):
    """The server could not be started, crashed, timed out, or answered too much."""


class ToolError(MCPError):
    """The tool ran and reported an error (`isError: true`). `.result` has the whole result."""

    def __init__(self, message, result=None):
        super().__init__(message)
        self.result = result


_ERRORS = {
    "unknown_server": ServerNotFoundError,
    "unknown_tool": ToolNotFoundError,
    "unavailable": ServerUnavailableError,
}


def identifier(name):
    """A server or tool name as a Python identifier: dashes and dots become `_`."""
    out = "".join(c if (c.isalnum() or c == "_") else "_" for c in str(name))
    if not out or out[0].isdigit():
        out = "_" + out
    if keyword.iskeyword(out):
        out += "_"
    return out


# ---------------------------------------------------------------------------------------------
# Transport: the Rust half (`_ironcell_bridge`) sends a request frame and resolves the answer.
# ---------------------------------------------------------------------------------------------

def _bridge():
    try:
        import _ironcell_bridge
    except ImportError:  # pragma: no cover - only outside an ironcell worker
        raise MCPError("the mcp bridge is only available inside an ironcell worker") from None
    return _ironcell_bridge


def _decode(payload):
    msg = json.loads(payload)
    err = msg.get("error")
    if err:
        raise _ERRORS.get(err.get("kind"), MCPError)(err.get("message", "MCP call failed"))
    return msg.get("result")


def _request_sync(method, params):
    return _decode(_bridge().request(method, json.dumps(params)))


def _request_async(method, params):
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(payload):
        if fut.done():
            return
        try:
            fut.set_result(_decode(payload))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting code
            fut.set_exception(exc)

    def on_answer(payload):  # runs on the bridge's reader thread
        try:
            loop.call_soon_threadsafe(settle, payload)
        except RuntimeError:
            pass  # the loop closed: nobody is waiting any more

    _bridge().submit(method, json.dumps(params), on_answer)
    return fut


def _unwrap(result, raw):
    if raw:
        return result
    if result.get("isError"):
        texts = [c.get("text", "") for c in result.get("content") or [] if c.get("type") == "text"]
        raise ToolError("; ".join(t for t in texts if t) or "the tool reported an error", result)
    if result.get("structuredContent") is not None:
        return result["structuredContent"]
    content = result.get("content") or []
    if len(content) == 1 and content[0].get("type") == "text":
        text = content[0].get("text", "")
        try:
            return json.loads(text)
        except (ValueError, TypeError):
            return text
    return content


# ---------------------------------------------------------------------------------------------
# Tool docs and signatures
# ---------------------------------------------------------------------------------------------

_JSON_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool",
               "array": "list", "object": "dict", "null": "None"}


def _annotation(schema):
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, list):
        return " | ".join(_JSON_TYPES.get(x, "Any") for x in t)
    return _JSON_TYPES.get(t, "Any")


def _signature(tool):
    schema = tool.get("inputSchema") or {}
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    params = []
    for name in sorted(props, key=lambda n: (n not in required, list(props).index(n))):
        if not name.isidentifier() or keyword.iskeyword(name):
            continue
        default = inspect.Parameter.empty if name in required else None
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=_annotation(props[name])))
    return inspect.Signature(params)


def _docstring(server, tool, full=True):
    lines = [(tool.get("description") or "").strip() or f"The {tool['name']!r} tool of {server!r}."]
    schema = tool.get("inputSchema") or {}
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    if props and full:
        lines.append("")
        lines.append("Arguments:")
        for name, p in props.items():
            p = p if isinstance(p, dict) else {}
            flag = "required" if name in required else "optional"
            desc = (p.get("description") or "").strip()
            lines.append(f"  {name} ({_annotation(p)}, {flag}){': ' + desc if desc else ''}")
    lines.append("")
    lines.append(f"Proxied MCP tool {tool['name']!r} of server {server!r}; await it, or call {identifier(tool['name'])}_sync(...).")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The runtime object and server proxies
# ---------------------------------------------------------------------------------------------

class _Runtime:
    """Discovery and calls for every configured MCP server."""

    def __init__(self):
        self._servers = []  # [{"name", "description"}], set by the worker at start

    # discovery ---------------------------------------------------------------------------
    async def discovered_servers(self, detailed=False):
        """Names of the configured servers (detailed=True: dicts with name and description)."""
        return self.discovered_servers_sync(detailed)

    def discovered_servers_sync(self, detailed=False):
        if detailed:
            usable = [dict(s, identifier="mcp_" + identifier(s["name"]), available=True) for s in self._servers]
            return usable + [dict(s) for s in getattr(self, "_unavailable", [])]
        return [s["name"] for s in self._servers]

    async def list_tools(self, server):
        """The raw tool list (name, description, inputSchema) of one server."""
        return await _request_async("tools", {"server": server})

    def list_tools_sync(self, server):
        return _request_sync("tools", {"server": server})

    async def query_tool_docs(self, server, tool=None, detail="summary"):
        """Docs of a server's tools (or one tool). detail="full" adds arguments and schemas."""
        return self._docs(server, await self.list_tools(server), tool, detail)

    def query_tool_docs_sync(self, server, tool=None, detail="summary"):
        return self._docs(server, self.list_tools_sync(server), tool, detail)

    def _docs(self, server, tools, tool, detail):
        if detail not in ("summary", "full"):
            raise ValueError('detail must be "summary" or "full"')
        if tool is not None:
            match = [t for t in tools if t["name"] == tool or identifier(t["name"]) == tool]
            if not match:
                names = ", ".join(t["name"] for t in tools) or "(none)"
                raise ToolNotFoundError(f"server {server!r} has no tool {tool!r}; it has: {names}")
            tools = match
        out = []
        for t in tools:
            d = {"server": server, "tool": t["name"], "identifier": identifier(t["name"]),
                 "description": (t.get("description") or "").strip()}
            d["signature"] = f"{identifier(t['name'])}{_signature(t)}"
            if detail == "full":
                d["input_schema"] = t.get("inputSchema") or {}
                d["doc"] = _docstring(server, t)
            out.append(d)
        return out

    async def search_tool_docs(self, query, limit=5):
        """Tools of all servers ranked by fuzzy match on names and descriptions, with a score."""
        return await _request_async("search", {"query": str(query), "limit": int(limit)})

    def search_tool_docs_sync(self, query, limit=5):
        return _request_sync("search", {"query": str(query), "limit": int(limit)})

    # calls ---------------------------------------------------------------------------------
    async def call_tool(self, server, tool, arguments=None, raw=False):
        """Calls `tool` of `server` with a dict of arguments; returns the unwrapped result."""
        params = {"server": server, "tool": tool, "arguments": dict(arguments or {})}
        return _unwrap(await _request_async("call", params), raw)

    def call_tool_sync(self, server, tool, arguments=None, raw=False):
        params = {"server": server, "tool": tool, "arguments": dict(arguments or {})}
        return _unwrap(_request_sync("call", params), raw)

    def capability_summary(self):
        """A short text: the servers available and how to use them from Python."""
        lines = ["MCP servers available from Python (ironcell):"]
        for s in self._servers:
            desc = f" — {s['description']}" if s.get("description") else ""
            lines.append(f"  mcp_{identifier(s['name'])} ({s['name']!r}){desc}")
        if not self._servers:
            lines.append("  (none configured)")
        lines.append("Discover: await runtime.search_tool_docs('what you need'), await runtime.query_tool_docs(name)")
        lines.append("Call: await mcp_<server>.<tool>(**args) or await mcp_servers[name].call_tool(tool, args)")
        return "\n".join(lines)

    def __repr__(self):
        return f"<mcp runtime: {len(self._servers)} servers: {', '.join(s['name'] for s in self._servers)}>"


class ServerProxy:
    """One proxied server. Attributes are its tools (async functions with `_sync` twins)."""

    def __init__(self, name, description=None):
        self._name = name
        self._description = description
        self._tools = None

    def _tool_list(self):
        if self._tools is None:
            self._tools = runtime.list_tools_sync(self._name)
        return self._tools

    async def call_tool(self, tool, arguments=None, raw=False):
        return await runtime.call_tool(self._name, tool, arguments, raw)

    def call_tool_sync(self, tool, arguments=None, raw=False):
        return runtime.call_tool_sync(self._name, tool, arguments, raw)

    async def list_tools(self):
        return await runtime.list_tools(self._name)

    def list_tools_sync(self):
        return runtime.list_tools_sync(self._name)

    def _function(self, tool, sync):
        server = self._name
        if sync:
            def call(**kwargs):
                return runtime.call_tool_sync(server, tool["name"], kwargs)
        else:
            async def call(**kwargs):
                return await runtime.call_tool(server, tool["name"], kwargs)
        name = identifier(tool["name"]) + ("_sync" if sync else "")
        call.__name__ = name
        call.__qualname__ = f"mcp_{identifier(server)}.{name}"
        call.__module__ = f"mcp.servers.{identifier(server)}"
        call.__signature__ = _signature(tool)
        call.__doc__ = _docstring(server, tool)
        return call

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        sync = attr.endswith("_sync")
        base = attr[:-5] if sync else attr
        tools = self._tool_list()
        for t in tools:
            if identifier(t["name"]) == base or t["name"] == base:
                return self._function(t, sync)
        names = ", ".join(identifier(t["name"]) for t in tools) or "(none)"
        raise ToolNotFoundError(f"server {self._name!r} has no tool {base!r}; it has: {names}")

    def __dir__(self):
        try:
            return sorted(identifier(t["name"]) for t in self._tool_list())
        except MCPError:
            return []

    def __repr__(self):
        return f"<MCP server {self._name!r}{': ' + self._description if self._description else ''}>"


class _Servers(dict):
    def __missing__(self, key):
        for name, proxy in self.items():
            if identifier(name) == key:
                return proxy
        raise ServerNotFoundError(f"no MCP server {key!r}; configured: {', '.join(self) or '(none)'}")


runtime = _Runtime()
mcp_servers = _Servers()


def _configure(servers):
    """Called by the worker at start with [{"name", "description"}] of the configured servers."""
    # Servers configured but not startable here come with "available": False and a "reason".
    runtime._servers = [s for s in servers if s.get("available", True)]
    runtime._unavailable = [s for s in servers if not s.get("available", True)]
    servers = runtime._servers
    mcp_servers.clear()
    for s in servers:
        mcp_servers[s["name"]] = ServerProxy(s["name"], s.get("description"))


def _globals_for_user():
    g = {"runtime": runtime, "mcp_servers": mcp_servers}
    for name, proxy in mcp_servers.items():
        g["mcp_" + identifier(name)] = proxy
    return g


# ---------------------------------------------------------------------------------------------
# `from mcp.servers.github import create_issue`
# ---------------------------------------------------------------------------------------------

class _ServersFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    PREFIX = __name__ + ".servers"

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.PREFIX or fullname.startswith(self.PREFIX + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=(fullname == self.PREFIX))
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == self.PREFIX:
            module.__path__ = []
            module.__doc__ = "Proxied MCP servers as modules: from mcp.servers.<server> import <tool>"
            return
        ident = module.__name__[len(self.PREFIX) + 1:]
        proxy = mcp_servers[ident]
        module.__doc__ = repr(proxy)

        def __getattr__(attr, _proxy=proxy):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return getattr(_proxy, attr)

        module.__getattr__ = __getattr__
        module.__dir__ = lambda _proxy=proxy: dir(_proxy)


if not any(isinstance(f, _ServersFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _ServersFinder())


def _sdk_dirs():
    """Directories of an installed official `mcp` SDK, so its submodules (e.g. `mcp.client`)
    stay importable beneath this module."""
    found = []
    for entry in sys.path:
        if not entry or not os.path.isabs(entry):
            continue
        candidate = os.path.join(entry, "mcp")
        if os.path.isfile(os.path.join(candidate, "__init__.py")):
            found.append(candidate)
    return found


__path__ = _sdk_dirs()
