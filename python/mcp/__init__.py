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

Every helper has a `*_sync` twin for code that is not async. Results are unwrapped (the rules
are in `_unwrap` and the manual); `raw=True` returns the whole result. A result with `isError`
raises `ToolError`; unknown servers or tools and transport failures raise `MCPError` subclasses.
`save_memory(key, value)` / `load_memory(key)` keep JSON values across sessions and restarts.
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
    "ServerUnavailableError", "ToolError", "identifier", "save_memory", "load_memory",
    "delete_memory", "list_memories", "memory_exists", "update_memory", "get_memory_info",
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


class _BadRequest(MCPError, ValueError):
    """The request itself was wrong (e.g. a memory key that is too long)."""


_ERRORS = {
    "unknown_server": ServerNotFoundError,
    "unknown_tool": ToolNotFoundError,
    "unavailable": ServerUnavailableError,
    # The configuration's rules hide the tool, or its call needed approval it did not get.
    "denied": ToolError,
    "declined": ToolError,
    "refused": ToolError,
    "bad_request": _BadRequest,
}


class _Answer:
    """Mixin: a value that can also be awaited (and gives itself). The bridge's README calls
    some helpers with `await` and some without; both work."""

    def __await__(self):
        return self
        yield  # pragma: no cover - makes this a generator


class _AwaitableTuple(tuple):
    """A tuple (what the bridge's helpers return without `await`) that can also be awaited,
    giving a list (what ironcell's `await runtime.discovered_servers()` always gave)."""

    def __await__(self):
        return list(self)
        yield  # pragma: no cover - makes this a generator


class _AwaitableList(_Answer, list):
    pass


def _note_unavailable(unavailable):
    """Says once per session on stderr which servers cannot be used and why: the model reads
    the run's output, not ironcell's log."""
    for u in unavailable or []:
        name, why = u.get("server") or u.get("name"), u.get("error")
        if name and (name, why) not in _noted:
            _noted.add((name, why))
            print(f"[ironcell] MCP server {name!r} is unavailable: {why}", file=sys.stderr)


_noted = set()


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


class Record(dict):
    """A dict from a tool result whose keys also read as attributes (`issue.title`), as the
    bridge's README examples use them. Still a plain dict for everything else."""

    __slots__ = ()

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no field {name!r}; fields: {', '.join(map(str, self)) or '(none)'}") from None


def _records(value):
    if type(value) is dict:
        return Record((k, _records(v)) for k, v in value.items())
    if type(value) is list:
        return [_records(v) for v in value]
    return value


def _unwrap(result, raw):
    """What code gets from a tool result (documented in MANUAL.md, "Results"):

    1. `raw=True`: the whole result, untouched.
    2. `isError: true`: raises `ToolError` with the result's text.
    3. `structuredContent` present: that value; except when it is a one-field object whose
       value is a string exactly equal to the result's only text block, which gives that text
       (servers that mirror their text as `{"content": text}`).
    4. exactly one text block: the text parsed as JSON when it is JSON, else the text.
    5. anything else: the list of content blocks.
    Objects in 3 and 4 come back as `Record`s: dicts whose keys also read as attributes.
    """
    if raw:
        return result
    if result.get("isError"):
        texts = [c.get("text", "") for c in result.get("content") or [] if c.get("type") == "text"]
        raise ToolError("; ".join(t for t in texts if t) or "the tool reported an error", result)
    content = result.get("content") or []
    single_text = None
    if len(content) == 1 and content[0].get("type") == "text":
        single_text = content[0].get("text", "")
    structured = result.get("structuredContent")
    if structured is not None:
        if (isinstance(structured, dict) and len(structured) == 1 and single_text is not None
                and next(iter(structured.values())) == single_text):
            return single_text
        return _records(structured)
    if single_text is not None:
        try:
            return _records(json.loads(single_text))
        except (ValueError, TypeError):
            return single_text
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

class ToolDocs(_AwaitableList):
    """Docs of a server's tools. It is the bridge's list of per-tool dicts (iterate, index,
    `len`) and also the mapping its README uses: tool name → schema, with `description` and
    `inputSchema` (`docs["read_file"]`, `docs.items()`, `docs.keys()`, `"read_file" in docs`)."""

    def __init__(self, docs, schemas):
        super().__init__(docs)
        self._schemas = schemas  # {tool name: {"name", "description", "inputSchema"}}

    def _schema(self, key):
        if key in self._schemas:
            return self._schemas[key]
        for name, schema in self._schemas.items():
            if identifier(name) == key:
                return schema
        raise KeyError(f"no tool {key!r}; tools: {', '.join(self._schemas) or '(none)'}")

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._schema(key)
        return super().__getitem__(key)

    def __contains__(self, item):
        if isinstance(item, str):
            try:
                self._schema(item)
                return True
            except KeyError:
                return False
        return super().__contains__(item)

    def keys(self):
        return self._schemas.keys()

    def values(self):
        return self._schemas.values()

    def items(self):
        return self._schemas.items()

    def get(self, key, default=None):
        try:
            return self._schema(key)
        except KeyError:
            return default


class _Runtime:
    """Discovery and calls for every configured MCP server."""

    def __init__(self):
        self._servers = []  # [{"name", "description", "error"?}], set by the worker at start

    # discovery ---------------------------------------------------------------------------
    def _current_servers(self):
        """The servers as the host sees them now (a failed start shows up as `error`)."""
        try:
            self._servers = list(_request_sync("servers", {}))
        except MCPError:
            pass
        return self._servers

    def discovered_servers(self, detailed=False):
        """Names of the usable servers (detailed=True: dicts with name, description and, for
        servers that cannot be used, `available: False` and `error`). Works with or without
        `await`. Unusable servers are also named on stderr, with the reason."""
        servers = self._current_servers()
        _note_unavailable([s for s in servers if s.get("error")])
        if detailed:
            out = []
            for s in servers:
                d = {"name": s["name"], "description": s.get("description"),
                     "identifier": "mcp_" + identifier(s["name"]), "available": not s.get("error")}
                if s.get("error"):
                    d["error"] = d["reason"] = s["error"]
                out.append(d)
            return _AwaitableTuple(out)
        return _AwaitableTuple(s["name"] for s in servers if not s.get("error"))

    def discovered_servers_sync(self, detailed=False):
        return self.discovered_servers(detailed)

    async def list_servers(self):
        """Names of the usable servers."""
        return tuple(self.discovered_servers())

    def list_servers_sync(self):
        return tuple(self.discovered_servers())

    def describe_server(self, name):
        """One server: name, alias, description and its tools (name, alias, description,
        inputSchema). Starts the server if needed."""
        server = next((s for s in self._current_servers() if s["name"] == name
                       or identifier(s["name"]) == name), None)
        if server is None:
            raise ServerNotFoundError(f"no MCP server {name!r}; configured: "
                                      f"{', '.join(s['name'] for s in self._servers) or '(none)'}")
        if server.get("error"):
            raise ServerUnavailableError(f"MCP server {server['name']!r} is unavailable: {server['error']}")
        tools = self.list_tools_sync(server["name"])
        return {"name": server["name"], "alias": identifier(server["name"]),
                "description": server.get("description"),
                "tools": [{"name": t["name"], "alias": identifier(t["name"]),
                           "description": (t.get("description") or "").strip(),
                           "inputSchema": t.get("inputSchema") or {}} for t in tools]}

    def list_loaded_server_metadata(self):
        """`describe_server` of every usable server."""
        out = []
        for name in self.discovered_servers():
            try:
                out.append(self.describe_server(name))
            except MCPError as e:
                print(f"[ironcell] MCP server {name!r} is unavailable: {e}", file=sys.stderr)
        return tuple(out)

    async def list_tools(self, server):
        """The raw tool list (name, description, inputSchema) of one server."""
        return await _request_async("tools", {"server": server})

    def list_tools_sync(self, server):
        return _request_sync("tools", {"server": server})

    async def query_tool_docs(self, server, tool=None, detail="summary"):
        """Docs of a server's tools: a list of dicts that is also a mapping tool name → schema.
        With `tool=`, that one tool's dict. detail="full" adds `inputSchema` and `doc`."""
        return self._docs(server, await self.list_tools(server), tool, detail)

    def query_tool_docs_sync(self, server, tool=None, detail="summary"):
        return self._docs(server, self.list_tools_sync(server), tool, detail)

    def _docs(self, server, tools, tool, detail):
        detail = str(detail or "summary").lower()
        if detail not in ("summary", "full"):
            raise ValueError('detail must be "summary" or "full"')
        if tool is not None:
            match = [t for t in tools if t["name"] == tool or identifier(t["name"]) == tool]
            if not match:
                names = ", ".join(t["name"] for t in tools) or "(none)"
                raise ToolNotFoundError(f"server {server!r} has no tool {tool!r}; it has: {names}")
            tools_shown = match
        else:
            tools_shown = tools
        out = []
        for t in tools_shown:
            d = {"server": server, "serverAlias": identifier(server), "tool": t["name"],
                 "toolAlias": identifier(t["name"]), "identifier": identifier(t["name"]),
                 "description": (t.get("description") or "").strip()}
            d["signature"] = f"{identifier(t['name'])}{_signature(t)}"
            if detail == "full":
                d["inputSchema"] = t.get("inputSchema") or {}
                d["doc"] = _docstring(server, t)
                d["annotations"] = t.get("annotations") or {}
            out.append(d)
        if tool is not None:
            return out[0]
        schemas = {t["name"]: {"name": t["name"], "description": (t.get("description") or "").strip(),
                               "inputSchema": t.get("inputSchema") or {}} for t in tools}
        return ToolDocs(out, schemas)

    def _search_answer(self, answer, detail):
        answer = answer if isinstance(answer, dict) else {"results": answer, "unavailable": []}
        hits = _AwaitableList(answer.get("results") or [])
        for h in hits:
            h.setdefault("serverAlias", identifier(h.get("server", "")))
            h.setdefault("toolAlias", identifier(h.get("tool", "")))
        hits.unavailable = {u["server"]: u["error"] for u in answer.get("unavailable") or []}
        _note_unavailable(answer.get("unavailable"))
        if str(detail).lower() == "full":
            for h in hits:
                try:
                    tools = self.list_tools_sync(h["server"])
                    h["inputSchema"] = next((t.get("inputSchema") or {} for t in tools
                                             if t["name"] == h["tool"]), {})
                except MCPError:
                    pass
        return hits

    async def search_tool_docs(self, query, limit=5, detail="summary"):
        """Tools of all servers ranked by fuzzy match on names and descriptions, with a score.
        `.unavailable` maps each server that could not be searched to the reason."""
        answer = await _request_async("search", {"query": str(query), "limit": int(limit)})
        return self._search_answer(answer, detail)

    def search_tool_docs_sync(self, query, limit=5, detail="summary"):
        answer = _request_sync("search", {"query": str(query), "limit": int(limit)})
        return self._search_answer(answer, detail)

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
            if s.get("error"):
                desc = f" — UNAVAILABLE: {s['error']}"
            lines.append(f"  mcp_{identifier(s['name'])} ({s['name']!r}){desc}")
        if not self._servers:
            lines.append("  (none configured)")
        lines.append("Discover: await runtime.search_tool_docs('what you need'), await runtime.query_tool_docs(name)")
        lines.append("Call: await mcp_<server>.<tool>(**args) or await mcp_servers[name].call_tool(tool, args)")
        lines.append("Memory across sessions: save_memory(key, value), load_memory(key), list_memories()")
        return "\n".join(lines)

    # memory (the bridge's names) -----------------------------------------------------------
    def save_memory(self, key, value, metadata=None):
        return save_memory(key, value, metadata)

    def load_memory(self, key, default=None):
        return load_memory(key, default)

    def delete_memory(self, key):
        return delete_memory(key)

    def list_memories(self):
        return list_memories()

    def memory_exists(self, key):
        return memory_exists(key)

    def update_memory(self, key, updater):
        return update_memory(key, updater)

    def get_memory_info(self, key):
        return get_memory_info(key)

    def __repr__(self):
        return f"<mcp runtime: {len(self._servers)} servers: {', '.join(s['name'] for s in self._servers)}>"


# ---------------------------------------------------------------------------------------------
# Memory: JSON values kept by the host across sessions and restarts (the bridge's API)
# ---------------------------------------------------------------------------------------------

def _memory(op, **params):
    return _request_sync("memory." + op, params)


def _memory_key(key):
    if not isinstance(key, str):
        raise TypeError(f"memory keys are strings, not {type(key).__name__}")
    return key


def save_memory(key, value, metadata=None):
    """Saves `value` (JSON; other objects are stored as their str()) under `key`, for this and
    every later session of this user. Returns a confirmation."""
    value = json.loads(json.dumps(value, default=str))
    if metadata is not None:
        metadata = json.loads(json.dumps(metadata, default=str))
    _memory("save", key=_memory_key(key), value=value, metadata=metadata)
    return f"Memory {key!r} saved."


def load_memory(key, default=None):
    """The value saved under `key`, or `default`."""
    answer = _memory("load", key=_memory_key(key))
    return answer["entry"].get("value") if answer.get("found") else default


def delete_memory(key):
    """Deletes `key`; says whether it existed."""
    answer = _memory("delete", key=_memory_key(key))
    return f"Memory {key!r} deleted." if answer.get("deleted") else f"Memory {key!r} not found."


def list_memories():
    """Every saved key with its metadata and times."""
    return _memory("list")


def memory_exists(key):
    return bool(_memory("load", key=_memory_key(key)).get("found"))


def update_memory(key, updater):
    """Saves `updater(current value or None)` and returns it."""
    new = updater(load_memory(key))
    save_memory(key, new)
    return new


def get_memory_info(key):
    """Key, metadata and times of one entry (without its value), or None."""
    answer = _memory("load", key=_memory_key(key))
    if not answer.get("found"):
        return None
    return {k: v for k, v in answer["entry"].items() if k != "value"}


class ServerProxy:
    """One proxied server. Attributes are its tools (async functions with `_sync` twins)."""

    def __init__(self, name, description=None, error=None):
        self._name = name
        self._description = description
        self._tools = None
        self._error = error  # set for a server whose configuration is broken

    def _check_usable(self):
        if self._error:
            raise ServerUnavailableError(f"MCP server {self._name!r} is unavailable: {self._error}")

    def _tool_list(self):
        self._check_usable()
        if self._tools is None:
            self._tools = runtime.list_tools_sync(self._name)
        return self._tools

    async def call_tool(self, tool, arguments=None, raw=False):
        self._check_usable()
        return await runtime.call_tool(self._name, tool, arguments, raw)

    def call_tool_sync(self, tool, arguments=None, raw=False):
        self._check_usable()
        return runtime.call_tool_sync(self._name, tool, arguments, raw)

    async def list_tools(self):
        return await runtime.list_tools(self._name)

    def list_tools_sync(self):
        return runtime.list_tools_sync(self._name)

    def _function(self, tool, sync):
        server = self._name
        if sync:
            def call(raw=False, **kwargs):
                return runtime.call_tool_sync(server, tool["name"], kwargs, raw)
        else:
            async def call(raw=False, **kwargs):
                return await runtime.call_tool(server, tool["name"], kwargs, raw)
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
        if self._error:
            return f"<MCP server {self._name!r}: UNAVAILABLE: {self._error}>"
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
    """Called by the worker at start with [{"name", "description", "error"?}] of the configured
    servers (`error` for one whose configuration is broken or whose start failed)."""
    runtime._servers = list(servers)
    mcp_servers.clear()
    for s in servers:
        broken = s.get("error") if str(s.get("error") or "").startswith("its configuration") else None
        mcp_servers[s["name"]] = ServerProxy(s["name"], s.get("description"), broken)


def _globals_for_user():
    g = {"runtime": runtime, "mcp_servers": mcp_servers, "save_memory": save_memory,
         "load_memory": load_memory, "delete_memory": delete_memory,
         "list_memories": list_memories, "memory_exists": memory_exists,
         "update_memory": update_memory, "get_memory_info": get_memory_info}
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
