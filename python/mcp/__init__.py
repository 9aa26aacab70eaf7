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


class ToolNotFoundError(MCPError, LookupError, AttributeError):
    """The server has no tool of that name. Also an AttributeError, so `hasattr(mcp_x, name)`
    and `getattr(mcp_x, name, None)` work on a server's module."""


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
    import asyncio  # only here and in `_call_local`: importing it took ~25 ms of a server's start

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


def _docstring(server, tool, full=True, local=False):
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
    if local:
        lines.append(f"Local tool {tool['name']!r}, run in ironcell's sandboxed tools session; "
                     f"call tools.{tool['name']}(...) with keyword arguments.")
    else:
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
        self._by_name = {}  # tool name and alias -> tool record, of `_tools`
        self._functions = {}  # attribute -> the function made for it from `_tools`
        self._error = error  # set for a server whose configuration is broken

    def _check_usable(self):
        if self._error:
            raise ServerUnavailableError(f"MCP server {self._name!r} is unavailable: {self._error}")

    def _tool_list(self):
        self._check_usable()
        if self._tools is None:
            tools = runtime.list_tools_sync(self._name)
            by_name = {}
            for t in tools:  # the first tool with a name or alias wins, as in the list's order
                by_name.setdefault(identifier(t["name"]), t)
                by_name.setdefault(t["name"], t)
            self._tools, self._by_name, self._functions = tools, by_name, {}
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
        # Made once per tool (a loop calls `mcp_x.tool_sync(...)` thousands of times), found by
        # name without walking a list of perhaps a thousand tools.
        made = self._functions.get(attr)
        if made is not None:
            return made
        tool = self._by_name.get(base)
        if tool is not None:
            made = self._functions[attr] = self._function(tool, sync)
            return made
        # Not in the list: hidden by a rule (a ToolError naming it, as a call would raise), or
        # added since the list was read, or not there at all.
        try:
            return self._function(_request_sync("tools", {"server": self._name, "tool": base}), sync)
        except ToolNotFoundError:
            pass
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
    """Called by the worker at start with [{"name", "description", "error"?, "config_broken"?}]
    of the configured servers (`error` for one that cannot be used, `config_broken` when that is
    because its configuration is broken)."""
    runtime._servers = list(servers)
    mcp_servers.clear()
    for s in servers:
        broken = s.get("error") if s.get("config_broken") else None
        mcp_servers[s["name"]] = ServerProxy(s["name"], s.get("description"), broken)


def _globals_for_user():
    g = {"runtime": runtime, "mcp_servers": mcp_servers, "save_memory": save_memory,
         "save_tool": save_tool,
         "load_memory": load_memory, "delete_memory": delete_memory,
         "list_memories": list_memories, "memory_exists": memory_exists,
         "update_memory": update_memory, "get_memory_info": get_memory_info}
    for name, proxy in mcp_servers.items():
        g["mcp_" + identifier(name)] = proxy
    return g


# ---------------------------------------------------------------------------------------------
# `from mcp.servers.github import create_issue`
# ---------------------------------------------------------------------------------------------

class _ServersFinder:  # a meta path finder and loader (importlib.abc would cost ~7 ms at start)
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


# ---------------------------------------------------------------------------------------------
# Local Python tools: `@tool` functions in the files given with --tools, and `save_tool(func)`.
#
# The host never runs them: a dedicated tools session (a worker like any other, with a read-only
# grant for the tools files) imports the files, turns type hints into JSON schemas and runs each
# call. Answers travel back as `tools.*` bridge requests, never as printed text.
# ---------------------------------------------------------------------------------------------

import dataclasses as _dataclasses
import enum as _enum
import typing as _typing

__all__ += ["tool", "tools", "save_tool", "ToolSchemaError"]

_TOOL_MARK = "__ironcell_tool__"
_WRAPPED = "x-ironcell-wrapped"


class ToolSchemaError(TypeError):
    """A tool's signature cannot be expressed as a JSON schema (e.g. an unsupported type hint)."""


def tool(func=None, *, name=None, description=None):
    """Marks a function as an MCP tool: `@tool`, or `@tool(name=..., description=...)`.

    The name defaults to the function's, the description to its docstring; the input schema
    comes from the type hints and defaults, the output schema from the return hint when it is
    structured (a dict, TypedDict, dataclass or list). Returns the function unchanged."""
    def mark(f):
        if not callable(f):
            raise TypeError("@tool marks functions")
        setattr(f, _TOOL_MARK, {"name": name, "description": description})
        return f
    return mark(func) if func is not None else mark


def _doc_parts(doc):
    """(description, {arg: description}) from a docstring with an optional Google-style
    `Args:` section; `Returns:`/`Raises:` sections are left out of the description."""
    doc = inspect.cleandoc(doc or "")
    lines = doc.splitlines()
    desc, args, section, current = [], {}, None, None
    for line in lines:
        stripped = line.strip()
        header = stripped.rstrip(":").lower()
        if stripped.endswith(":") and header in ("args", "arguments", "parameters", "params",
                                                 "returns", "return", "raises", "yields", "examples", "example"):
            section = header
            current = None
            continue
        if section in ("args", "arguments", "parameters", "params"):
            if not stripped:
                continue
            head, sep, rest = stripped.partition(":")
            key = head.split("(")[0].strip().lstrip("*")
            if sep and key.isidentifier() and line[:len(line) - len(line.lstrip())] != "" and (
                    current is None or len(line) - len(line.lstrip()) <= args[current][1]):
                current = key
                args[key] = [rest.strip(), len(line) - len(line.lstrip())]
            elif current is not None:
                args[current][0] = (args[current][0] + " " + stripped).strip()
            continue
        if section is None:
            desc.append(line)
    return "\n".join(desc).strip(), {k: v[0] for k, v in args.items() if v[0]}


def _is_typeddict(tp):
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__annotations__") \
        and hasattr(tp, "__total__")


def _hints(obj):
    try:
        return _typing.get_type_hints(obj, include_extras=True)
    except TypeError:
        return _typing.get_type_hints(obj)


def _type_schema(tp, where, seen=()):
    """The JSON schema of a type hint; `where` names the field in error messages."""
    if tp is inspect.Parameter.empty or tp is _typing.Any or tp is object:
        return {}
    if tp is None or tp is type(None):
        return {"type": "null"}
    origin = _typing.get_origin(tp)
    args = _typing.get_args(tp)
    if origin is _typing.Annotated:
        schema = dict(_type_schema(args[0], where, seen))
        for meta in args[1:]:
            if isinstance(meta, str):
                schema["description"] = meta
        return schema
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    import collections.abc as cabc
    if tp in (list, set, frozenset, cabc.Sequence, cabc.Iterable) or origin in (list, set, frozenset, cabc.Sequence, cabc.Iterable):
        schema = {"type": "array"}
        if args:
            schema["items"] = _type_schema(args[0], where + "[]", seen)
        if tp in (set, frozenset) or origin in (set, frozenset):
            schema["uniqueItems"] = True
        return schema
    if tp is tuple or origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(args[0], where + "[]", seen)}
        return {"type": "array", "prefixItems": [_type_schema(a, f"{where}[{i}]", seen) for i, a in enumerate(args)],
                "minItems": len(args), "maxItems": len(args)}
    if tp is dict or origin in (dict, cabc.Mapping):
        schema = {"type": "object"}
        if args:
            if args[0] is not str:
                raise ToolSchemaError(f"`{where}`: dict keys must be str to be JSON (got {args[0]!r})")
            value = _type_schema(args[1], where + "[]", seen)
            if value:
                schema["additionalProperties"] = value
        return schema
    if origin is _typing.Union or type(tp).__name__ == "UnionType":
        subs = [_type_schema(a, where, seen) for a in args]
        if len(subs) == 2 and {"type": "null"} in subs:
            other = subs[0] if subs[1] == {"type": "null"} else subs[1]
            if isinstance(other.get("type"), str) and set(other) == {"type"}:
                return {"type": [other["type"], "null"]}
        return {"anyOf": subs}
    if origin is _typing.Literal:
        values = list(args)
        for v in values:
            if not isinstance(v, (str, int, float, bool, type(None))):
                raise ToolSchemaError(f"`{where}`: Literal values must be JSON scalars (got {v!r})")
        schema = {"enum": values}
        kinds = {_json_type_of(v) for v in values}
        if len(kinds) == 1:
            schema = {"type": kinds.pop(), "enum": values}
        return schema
    if isinstance(tp, type) and issubclass(tp, _enum.Enum):
        return {"enum": [m.value for m in tp]}
    if isinstance(tp, type) and (_is_typeddict(tp) or _dataclasses.is_dataclass(tp)):
        if tp in seen:
            raise ToolSchemaError(f"`{where}`: {tp.__name__} refers to itself; recursive types are not supported")
        seen = seen + (tp,)
        hints = _hints(tp)
        props, required = {}, []
        if _dataclasses.is_dataclass(tp):
            for f in _dataclasses.fields(tp):
                props[f.name] = _type_schema(hints.get(f.name, _typing.Any), f"{where}.{f.name}", seen)
                if f.default is not _dataclasses.MISSING:
                    d = _jsonable_default(f.default)
                    if d is not _NO_DEFAULT:
                        props[f.name]["default"] = d
                elif f.default_factory is _dataclasses.MISSING:
                    required.append(f.name)
        else:
            req = getattr(tp, "__required_keys__", set(hints))
            for k, h in hints.items():
                if _typing.get_origin(h) in _REQUIRED_WRAPPERS:
                    h = _typing.get_args(h)[0]
                props[k] = _type_schema(h, f"{where}.{k}", seen)
                if k in req:
                    required.append(k)
        schema = {"type": "object", "properties": props}
        if required:
            schema["required"] = required
        schema["additionalProperties"] = False
        return schema
    raise ToolSchemaError(f"`{where}`: type {getattr(tp, '__name__', None) or tp!r} cannot be expressed as JSON; "
                          "use str, int, float, bool, list, dict, Optional, Literal, a TypedDict or a dataclass")


def _json_type_of(v):
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "null"


_NO_DEFAULT = object()
_REQUIRED_WRAPPERS = tuple(getattr(_typing, n) for n in ("Required", "NotRequired") if hasattr(_typing, n))


def _jsonable_default(v):
    try:
        return json.loads(json.dumps(_jsonable(v)))
    except (TypeError, ValueError):
        return _NO_DEFAULT


def _tool_spec(func, name=None, description=None):
    """{"name", "description", "inputSchema", "outputSchema"?} of a function."""
    mark = getattr(func, _TOOL_MARK, None) or {}
    name = name or mark.get("name") or func.__name__
    if not isinstance(name, str) or not name.isidentifier() or len(name) > 64:
        raise ToolSchemaError(f"tool name {name!r} must be a Python identifier of at most 64 characters")
    doc, arg_docs = _doc_parts(inspect.getdoc(func))
    description = description or mark.get("description") or doc or f"The {name} tool."
    sig = inspect.signature(func)
    hints = _hints(func)
    props, required = {}, []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolSchemaError(f"`{p.name}`: tools cannot take *args or **kwargs; name every argument")
        schema = dict(_type_schema(hints.get(p.name, inspect.Parameter.empty), p.name))
        if p.name in arg_docs and "description" not in schema:
            schema["description"] = arg_docs[p.name]
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
        else:
            d = _jsonable_default(p.default)
            if d is not _NO_DEFAULT:
                schema["default"] = d
        props[p.name] = schema
    input_schema = {"type": "object", "properties": props}
    if required:
        input_schema["required"] = required
    spec = {"name": name, "description": description, "inputSchema": input_schema}
    ret = hints.get("return", inspect.Parameter.empty)
    if ret is not inspect.Parameter.empty and ret is not None and ret is not type(None):
        out = _type_schema(ret, "return")
        if out.get("type") == "object":
            spec["outputSchema"] = out
        elif out.get("type") == "array":
            spec["outputSchema"] = {"type": "object", "properties": {"result": out},
                                    "required": ["result"], _WRAPPED: True}
    return spec


# --- validation (against the schemas made above), naming the field ---------------------------

def _describe(v):
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)
    shown = json.dumps(v, default=str)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{kind} ({shown})"


def _matches_type(v, t):
    if t == "null":
        return v is None
    if t == "boolean":
        return isinstance(v, bool)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, float) and v.is_integer())
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "string":
        return isinstance(v, str)
    if t == "array":
        return isinstance(v, list)
    if t == "object":
        return isinstance(v, dict)
    return True


_TYPE_WORDS = {"null": "null", "boolean": "true or false", "integer": "an integer", "number": "a number",
               "string": "a string", "array": "a list", "object": "an object"}


def _validate(v, schema, where):
    """Raises ValueError("`where`: what is wrong") if `v` does not match `schema`."""
    if not schema:
        return
    if "anyOf" in schema:
        errors = []
        for sub in schema["anyOf"]:
            try:
                _validate(v, sub, where)
                return
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else
                         f"`{where}`: {_describe(v)} matches none of the allowed types ({'; '.join(errors)})")
    t = schema.get("type")
    if t is not None:
        types_ = t if isinstance(t, list) else [t]
        if not any(_matches_type(v, x) for x in types_):
            want = " or ".join(_TYPE_WORDS.get(x, x) for x in types_)
            raise ValueError(f"`{where}` must be {want}, got {_describe(v)}")
    if "enum" in schema and v not in schema["enum"]:
        raise ValueError(f"`{where}` must be one of {', '.join(json.dumps(e) for e in schema['enum'])}, got {_describe(v)}")
    if isinstance(v, list):
        if "prefixItems" in schema:
            items = schema["prefixItems"]
            if len(v) != len(items):
                raise ValueError(f"`{where}` must have exactly {len(items)} items, got {len(v)}")
            for i, (x, s) in enumerate(zip(v, items)):
                _validate(x, s, f"{where}[{i}]")
        elif "items" in schema:
            for i, x in enumerate(v):
                _validate(x, schema["items"], f"{where}[{i}]")
    if isinstance(v, dict) and (schema.get("type") == "object" or "properties" in schema):
        props = schema.get("properties") or {}
        for k in schema.get("required") or []:
            if k not in v:
                raise ValueError(f"`{where}.{k}` is required but missing" if where else f"missing required argument `{k}`")
        for k, x in v.items():
            sub = f"{where}.{k}" if where else k
            if k in props:
                _validate(x, props[k], sub)
            elif schema.get("additionalProperties") is False or not where:  # no stray arguments
                allowed = ", ".join(props) or "(none)"
                raise ValueError(f"unknown field `{sub}`; allowed: {allowed}" if where else
                                 f"unknown argument `{k}`; this tool takes: {allowed}")
            elif isinstance(schema.get("additionalProperties"), dict):
                _validate(x, schema["additionalProperties"], sub)


def _convert(v, tp):
    """A validated JSON value as the Python type the function asked for."""
    if v is None:
        return None
    origin = _typing.get_origin(tp)
    args = _typing.get_args(tp)
    if origin is _typing.Annotated:
        return _convert(v, args[0])
    if tp is float and isinstance(v, int):
        return float(v)
    if tp is int and isinstance(v, float):
        return int(v)
    if origin is _typing.Union or type(tp).__name__ == "UnionType":
        for a in args:
            if a is type(None):
                continue
            try:
                _validate(_jsonable(v), _type_schema(a, "x"), "x")
            except (ValueError, ToolSchemaError):
                continue
            return _convert(v, a)
        return v
    if isinstance(tp, type) and issubclass(tp, _enum.Enum):
        return tp(v)
    if isinstance(tp, type) and _dataclasses.is_dataclass(tp) and isinstance(v, dict):
        hints = _hints(tp)
        return tp(**{k: _convert(x, hints.get(k, _typing.Any)) for k, x in v.items()})
    if isinstance(tp, type) and _is_typeddict(tp) and isinstance(v, dict):
        hints = _hints(tp)
        return {k: _convert(x, hints.get(k, _typing.Any)) for k, x in v.items()}
    if isinstance(v, list):
        if tp is tuple or origin is tuple:
            if args and not (len(args) == 2 and args[1] is Ellipsis):
                return tuple(_convert(x, a) for x, a in zip(v, args))
            return tuple(_convert(x, args[0] if args else _typing.Any) for x in v)
        if tp in (set, frozenset) or origin in (set, frozenset):
            kind = origin or tp
            return kind(_convert(x, args[0] if args else _typing.Any) for x in v)
        if args:
            return [_convert(x, args[0]) for x in v]
    if isinstance(v, dict) and args and (tp is dict or origin is dict):
        return {k: _convert(x, args[1]) for k, x in v.items()}
    return v


def _jsonable(v, depth=0):
    """A function's value as JSON data (dataclasses, tuples, sets, enums, numpy scalars, ...)."""
    if depth > 100:
        raise ValueError("the value is nested more than 100 levels deep")
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else str(v)
    if isinstance(v, _enum.Enum):
        return _jsonable(v.value, depth + 1)
    if _dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _jsonable(getattr(v, f.name), depth + 1) for f in _dataclasses.fields(v)}
    if isinstance(v, dict):
        return {str(k): _jsonable(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_jsonable(x, depth + 1) for x in v]
    for attr in ("model_dump", "tolist", "item"):  # pydantic models, numpy arrays and scalars
        f = getattr(v, attr, None)
        if callable(f):
            try:
                return _jsonable(f(), depth + 1)
            except Exception:
                pass
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return str(v)


# --- the tools session: loading files and running calls --------------------------------------

_registry = {"generation": None, "tools": {}, "errors": []}


def _error_line(exc, path):
    """The line of `path` where loading it failed."""
    if isinstance(exc, SyntaxError) and exc.filename == path:
        return exc.lineno
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _tool_files(paths, saved_file):
    """The files to import: the `--tools` paths (a folder's `.py` files), or the one saved tools
    file this session loads (each saved file has a session of its own)."""
    if saved_file:
        return [(saved_file, "saved")]
    files = []
    for p in paths:
        if os.path.isdir(p):
            try:
                names = sorted(os.listdir(p))
            except OSError as e:
                _registry["errors"].append({"file": p, "line": None, "reason": f"cannot list it: {e}"})
                continue
            files.extend((os.path.join(p, n), "file") for n in names
                         if n.endswith(".py") and not n.startswith(("_", ".")))
        else:
            files.append((p, "file"))
    return files


def _load_tools(spec):
    """Imports every tools file once per generation; a broken one is recorded, not fatal."""
    if _registry["generation"] == spec.get("generation"):
        return
    import importlib.util  # noqa: F401 - kept for the loaders below

    sys.dont_write_bytecode = True
    _registry.update(generation=spec.get("generation"), tools={}, errors=[])
    import signal

    def too_slow(signum, frame):
        raise _ImportTimeout(f"importing it took more than {IMPORT_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    try:
        for i, (path, origin) in enumerate(_tool_files(spec.get("paths") or [], spec.get("saved_file"))):
            _load_file(i, path, origin)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


IMPORT_SECONDS = 10


class _ImportTimeout(Exception):
    pass


def _load_file(i, path, origin):
    """Imports one tools file (at most IMPORT_SECONDS) and registers its `@tool` functions."""
    import importlib.util  # noqa: F401 - kept for the loaders below
    import signal

    folder = os.path.dirname(path)
    if origin == "file" and folder not in sys.path:
        sys.path.append(folder)  # sibling helper modules of a tools file are importable
    modname = f"ironcell_tools_{i}_{identifier(os.path.splitext(os.path.basename(path))[0])}"
    try:
        signal.setitimer(signal.ITIMER_REAL, IMPORT_SECONDS)
        try:
            mspec = importlib.util.spec_from_file_location(modname, path)
            module = importlib.util.module_from_spec(mspec)
            sys.modules[modname] = module
            mspec.loader.exec_module(module)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as exc:  # noqa: BLE001 - reported, and the other files still load
        if isinstance(exc, KeyboardInterrupt):
            raise
        sys.modules.pop(modname, None)
        reason = str(exc) if isinstance(exc, _ImportTimeout) else f"{type(exc).__name__}: {exc}"
        _registry["errors"].append({"file": path, "line": _error_line(exc, path), "reason": reason})
        return
    for attr, func in list(vars(module).items()):
        if not callable(func) or getattr(func, "__module__", None) != modname:
            continue
        if getattr(func, _TOOL_MARK, None) is None:
            continue
        line = getattr(getattr(func, "__code__", None), "co_firstlineno", None)
        try:
            spec_ = _tool_spec(func)
        except (ToolSchemaError, ValueError, TypeError, NameError) as exc:
            _registry["errors"].append({"file": path, "line": line,
                                        "reason": f"tool {attr!r}: {exc}"})
            continue
        if spec_["name"] in _registry["tools"]:
            other = _registry["tools"][spec_["name"]]
            _registry["errors"].append({"file": path, "line": line,
                                        "reason": f"tool {spec_['name']!r} is already defined in {other['file']}; this one is skipped"})
            continue
        spec_["file"], spec_["line"], spec_["origin"] = path, line, origin
        _registry["tools"][spec_["name"]] = dict(spec_, func=func)


def _public(spec):
    return {k: v for k, v in spec.items() if k != "func"}


def _tools_catalog(spec_json):
    """Run by the host in the tools session: loads the tools and sends their schemas."""
    spec = json.loads(spec_json)
    _registry["generation"] = None  # a catalog request always reloads
    _load_tools(spec)
    _request_sync("tools.catalog", {"token": spec["token"],
                                    "tools": [_public(t) for t in _registry["tools"].values()],
                                    "errors": _registry["errors"]})


def _traceback_of(exc):
    import traceback

    te = traceback.TracebackException.from_exception(exc, limit=-20)
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
    return "".join(te.format())


def _call_local(name, arguments):
    """Validates and runs one tool here; returns an envelope for the host."""
    t = _registry["tools"].get(name)
    if t is None:
        return {"ok": False, "kind": "unknown_tool",
                "message": f"no tool {name!r}; tools: {', '.join(_registry['tools']) or '(none)'}"}
    if not isinstance(arguments, dict):
        return {"ok": False, "kind": "validation", "message": "the arguments must be an object"}
    try:
        _validate(arguments, t["inputSchema"], "")
    except ValueError as e:
        return {"ok": False, "kind": "validation", "message": str(e)}
    func = t["func"]
    hints = _hints(func)
    params = inspect.signature(func).parameters
    args, kwargs = [], {}
    for pname, p in params.items():
        if pname not in arguments:
            continue
        value = _convert(arguments[pname], hints.get(pname, _typing.Any))
        if p.kind == p.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[pname] = value
    try:
        value = func(*args, **kwargs)
        if inspect.isawaitable(value):
            runner = sys.modules.get("_ironcell_runner")
            value = runner._run_awaitable(value) if runner else __import__("asyncio").run(value)
    except Exception as exc:  # noqa: BLE001 - the tool's own error, reported like run_python's
        return {"ok": False, "kind": "raised", "type": type(exc).__name__,
                "message": str(exc), "traceback": _traceback_of(exc)}
    data = _jsonable(value)
    out = {"ok": True, "value": data}
    schema = t.get("outputSchema")
    if schema is not None:
        structured = {"result": data} if schema.get(_WRAPPED) else data
        try:
            _validate(structured, schema, "return")
        except ValueError as e:
            return {"ok": False, "kind": "raised", "type": "TypeError",
                    "message": f"{name} returned a value that does not match its return annotation: {e}",
                    "traceback": ""}
        out["structured"] = structured
    return out


def _tools_invoke(spec_json):
    """Run by the host in the tools session for one call: loads the tools if needed, runs the
    call, and sends the envelope back."""
    spec = json.loads(spec_json)
    _load_tools(spec)
    _request_sync("tools.result", {"token": spec["token"],
                                   "envelope": _call_local(spec["name"], spec.get("arguments") or {})})


# --- the `tools` object for code in run_python, and save_tool ---------------------------------

class _Tools:
    """The local Python tools, callable from code: `tools.<name>(**arguments)` returns the
    function's value (as JSON data), run in the sandboxed tools session."""

    def _in_tools_session(self):
        return _registry["generation"] is not None

    def _catalog(self):
        if self._in_tools_session():
            return {"tools": [_public(t) for t in _registry["tools"].values()], "errors": _registry["errors"]}
        return _request_sync("tools.list", {})

    def list(self):
        """[{"name", "description", "inputSchema", ...}] of every tool."""
        return self._catalog()["tools"]

    @property
    def errors(self):
        """Tools files that could not be loaded: [{"file", "line", "reason"}]."""
        return self._catalog()["errors"]

    def call(self, name, arguments=None, **kwargs):
        """Calls tool `name` with a dict of arguments (or keyword arguments)."""
        arguments = dict(arguments or {}, **kwargs)
        if self._in_tools_session():
            answer = _call_local(name, json.loads(json.dumps(_jsonable(arguments))))
            if answer.get("ok"):
                return _records(answer["value"])
            raise (_ERRORS.get("unknown_tool") if answer.get("kind") == "unknown_tool" else
                   _BadRequest if answer.get("kind") == "validation" else ToolError)(answer.get("message"))
        return _records(_request_sync("tools.call", {"name": name, "arguments": _jsonable(arguments)}))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _ToolCall(self, name)

    def __dir__(self):
        try:
            return sorted(t["name"] for t in self.list())
        except MCPError:
            return []

    def __repr__(self):
        try:
            names = [t["name"] for t in self.list()]
        except MCPError as e:
            return f"<local tools: unavailable: {e}>"
        return f"<local tools: {', '.join(names) or '(none)'}>"


class _ToolCall:
    # `tools.<name>`: calling it calls the tool at once; its docstring and signature (for `help`
    # and `inspect`) are the tool's, looked up only when asked, so that a call never waits for
    # the whole catalog (a reload of the saved tools may be in progress).

    def __init__(self, owner, name):
        self._owner = owner
        self.__name__ = name
        self.__qualname__ = f"tools.{name}"

    def __call__(self, **kwargs):
        return self._owner.call(self.__name__, kwargs)

    def _spec(self):
        return next((t for t in self._owner.list() if t["name"] == self.__name__), None)

    @property
    def __doc__(self):
        t = self._spec()
        return _docstring("tools", t, local=True) if t else None

    @property
    def __signature__(self):
        t = self._spec()
        return _signature(t) if t else None

    def __get__(self, obj, objtype=None):
        # A method descriptor to `inspect`, so `help()` documents it as a function.
        return self

    def __repr__(self):
        return f"<local tool {self.__name__}>"


tools = _Tools()


def _function_source(func):
    """The source of `func` alone (its decorators dropped), also for a function defined in an
    earlier cell."""
    import ast
    import textwrap

    source = getattr(func, "_ironcell_cell_source", None)
    code = func.__code__
    if source is not None:
        lines = source.splitlines(True)
    else:
        try:
            lines, _ = inspect.findsource(func)
        except (OSError, TypeError) as e:
            raise ToolSchemaError(f"the source of {func.__name__} is not available ({e}); "
                                  "define it in a run_python cell or a file") from None
    tree = ast.parse("".join(lines))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name and (
                node.lineno == code.co_firstlineno or any(d.lineno == code.co_firstlineno for d in node.decorator_list)):
            return textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))
    raise ToolSchemaError(f"the source of {func.__name__} could not be found")


MAX_SAVED_TOOL_BYTES = 64 * 1024


def _signature_names(source):
    """Global names the function's signature uses (annotations and defaults)."""
    import ast

    node = ast.parse(source).body[0]
    a = node.args
    parts = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None]
    parts += [*a.defaults, *(d for d in a.kw_defaults if d is not None), node.returns]
    names = set()
    for part in parts:
        if part is not None:
            names.update(n.id for n in ast.walk(part) if isinstance(n, ast.Name))
    return names


def save_tool(func, name=None, description=None):
    """Saves `func` as a local MCP tool: it is listed by tools/list from now on (also after
    restarts; the client is told the list changed) and runs in the sandboxed tools session.

    The function must be self-contained: modules it uses from the session's globals are
    imported in the saved file, other globals are refused. Returns a confirmation."""
    if not inspect.isfunction(func):
        raise TypeError("save_tool takes a function defined with def")
    spec = _tool_spec(func, name, description)  # refuses what has no schema, here and now
    cv = inspect.getclosurevars(func)
    if cv.nonlocals:
        raise ToolSchemaError(f"{func.__name__} uses variables of an enclosing function "
                              f"({', '.join(cv.nonlocals)}); a saved tool must be self-contained")
    body = _function_source(func)
    needed = dict(cv.globals)
    for gname in _signature_names(body):  # names in annotations and defaults
        if gname in func.__globals__ and gname not in needed:
            needed[gname] = func.__globals__[gname]
    imports, refused = [], []
    stdlib = set(getattr(sys, "stdlib_module_names", ())) | {"typing", "collections", "dataclasses", "enum"}
    this = sys.modules[__name__]
    for gname, value in sorted(needed.items()):
        if gname.startswith("__") and gname.endswith("__"):
            continue  # `type(e).__name__` and the like: every module has its own
        module = getattr(value, "__module__", None) or ""
        real_name = getattr(value, "__name__", None) or getattr(value, "_name", None)
        if isinstance(value, types.ModuleType):
            imports.append(f"import {value.__name__}" if value.__name__ == gname
                           else f"import {value.__name__} as {gname}")
        elif getattr(this, gname, None) is value:
            imports.append(f"from mcp import {gname}")
        elif module.split(".")[0] in stdlib and isinstance(real_name, str) and real_name.isidentifier():
            imports.append(f"from {module} import {real_name}" + ("" if real_name == gname else f" as {gname}"))
        else:
            refused.append(gname)
    if refused:
        raise ToolSchemaError(f"{func.__name__} uses session globals that would not exist in a saved tool: "
                              f"{', '.join(refused)}; define them (or import them) inside the function, "
                              "or put the tool (with its types) in a tools file given with --tools")
    header = [f"# Saved with save_tool() from session {os.environ.get('IRONCELL_SESSION', '?')!r}.",
              "from mcp import tool", *sorted(set(i for i in imports if i)), "", ""]
    marker = f"@tool(name={spec['name']!r}, description={spec['description']!r})\n"
    source = "\n".join(header) + marker + body
    if len(source.encode()) > MAX_SAVED_TOOL_BYTES:
        raise ValueError(f"the tool's source is {len(source.encode())} bytes; the limit is {MAX_SAVED_TOOL_BYTES}")
    compile(source, f"<saved tool {spec['name']}>", "exec")
    answer = _request_sync("tools.save", {"name": spec["name"], "source": source})
    return answer.get("message") if isinstance(answer, dict) else f"Tool {spec['name']!r} saved."


def _delete_tool(name):
    return _request_sync("tools.delete", {"name": name})


# ---------------------------------------------------------------------------------------------
# Packages on demand: `%pip install NAME` in a cell, a PEP 723 `# /// script` block, or
# `mcp.install([...])`. The host resolves, asks the user, downloads wheels and links them
# read-only into this worker's package directory; the sandbox never gets a network.
# ---------------------------------------------------------------------------------------------

__all__ += ["install", "InstallError"]


class InstallError(MCPError):
    """A package install was refused, declined or failed; the message says why and the fix."""


def _use_packages_dir(path):
    """Puts this worker's package directory on `sys.path`, before the interpreter's own
    site-packages, so a version installed for this session is the one imported."""
    if not path or path in sys.path:
        return
    at = next((i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))), len(sys.path))
    sys.path.insert(at, path)


def install(requirements, *, quiet=False, _source="mcp.install"):
    """Installs packages for this session: `mcp.install(["tabulate", "markdown-it-py==3.0.0"])`.

    The user is asked first (naming every package and version, dependencies included) unless
    ironcell allows them by pattern. Wheels only, never built; other sessions and the user's
    interpreter are not changed. Returns the `name==version` of what was installed."""
    if isinstance(requirements, str):
        requirements = requirements.split()
    reqs = [str(r) for r in requirements]
    try:
        answer = _request_sync("packages.install", {"requirements": reqs, "source": _source})
    except MCPError as exc:
        raise InstallError(str(exc)) from None
    import importlib

    _use_packages_dir(answer.get("path") or os.environ.get("IRONCELL_PACKAGES_DIR"))
    importlib.invalidate_caches()
    done = [f"{p['name']}=={p['version']}" for p in answer.get("installed") or []]
    if not quiet:
        if done:
            print("Installed for this session: " + ", ".join(done))
        already = [f"{p['name']}=={p['version']}" for p in answer.get("already") or []]
        if already:
            print("Already installed in this session: " + ", ".join(already))
        if not done and not already:
            print("Nothing to install: already available (in this session or in the interpreter)")
    return done


# Options of `pip install` that change nothing here (ironcell always installs for the session).
_PIP_HARMLESS = {"-q", "--quiet", "-U", "--upgrade", "--user", "--no-cache-dir", "--progress-bar=off",
                 "--disable-pip-version-check", "--no-input", "--only-binary=:all:", "-v", "--verbose"}


def _pip_magic(line):
    """`%pip install ...` / `!pip install ...` / `%uv pip install ...` in a cell."""
    import shlex

    words = shlex.split(line)
    if words[:1] != ["install"]:
        raise InstallError(f"only `%pip install NAME ...` works in ironcell (not {line.strip()!r}): "
                           "the host installs packages for this session; `import NAME` checks one")
    names = []
    for w in words[1:]:
        if w.startswith("-"):
            if w in _PIP_HARMLESS:
                continue
            raise InstallError(f"`pip install {w}` is not available in ironcell: it installs wheels "
                               "by name from the package index the user configured (`%pip install NAME[==VERSION]`)")
        names.append(w)
    return install(names, _source="%pip install")


# ---------------------------------------------------------------------------------------------
# `mcp.fork(name)`: this session forked into a new one when this run ends (the host makes it).
# ---------------------------------------------------------------------------------------------

__all__ += ["fork", "ForkError"]


class ForkError(MCPError):
    """A fork was refused; the message says why and what to do instead."""


def fork(name):
    """Forks this session into the new session `name` as this run leaves it: when the cell
    returns, `name` starts with a copy of every variable, import and file of this session (as
    `run_python`'s `fork_from` would), and the two go their own ways. Refused at once, with
    the reason, where the fork cannot be made (the name is taken or not a name, sessions cannot
    fork here, the line of forks is too deep, no live-session slot, the files would not fit);
    the run's result says whether the fork was made. Returns {"session": name, ...}."""
    if not isinstance(name, str):
        raise TypeError(f"a session name is a string, not {type(name).__name__}")
    try:
        return _request_sync("session.fork", {"name": name})
    except MCPError as exc:
        raise ForkError(str(exc)) from None


def _script_dependencies(code):
    """The `dependencies` of an inline script metadata block (PEP 723) in `code`, or None."""
    import re

    block = re.search(r"(?m)^# /// script$\s(?P<content>(^#(| .*)$\s)+)^# ///$", code)
    if block is None:
        return None
    content = "".join(line[2:] if line.startswith("# ") else line[1:]
                      for line in block.group("content").splitlines(keepends=True))
    try:
        import tomllib
    except ImportError:  # Python < 3.11: the one key we need, read as a list literal
        import ast

        found = re.search(r"(?ms)^dependencies\s*=\s*(\[.*?\])", content)
        return list(ast.literal_eval(found.group(1))) if found else []
    return list(tomllib.loads(content).get("dependencies") or [])
