"""A tiny MCP server in plain Python (standard library only), to try ironcell's proxy with:
two tools, `greet(name)` and `add(a, b)`, over stdio (newline-delimited JSON-RPC).

It speaks the `initialize` handshake era; it answers `server/discover` with "method not found",
as older servers do, so ironcell falls back to `initialize`. See README.md beside it.
"""

import json
import sys

TOOLS = [
    {
        "name": "greet",
        "description": "Say hello to someone by name.",
        "inputSchema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        "annotations": {"readOnlyHint": True},
    },
    {
        "name": "add",
        "description": "Add two numbers.",
        "inputSchema": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
        "annotations": {"readOnlyHint": True},
    },
]


def call(name, args):
    if name == "greet":
        return f"Hello, {args['name']}! (from the hello server, through ironcell)"
    if name == "add":
        return args["a"] + args["b"]
    raise KeyError(name)


def answer(request):
    method, params = request.get("method"), request.get("params") or {}
    if method == "initialize":
        return {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                "serverInfo": {"name": "hello", "version": "1.0"}}
    if method == "ping":
        return {}
    if method == "tools/list":
        return {"tools": TOOLS}
    if method == "tools/call":
        try:
            value = call(params["name"], params.get("arguments") or {})
        except (KeyError, TypeError) as e:
            return {"content": [{"type": "text", "text": f"bad call: {e!r}"}], "isError": True}
        text = value if isinstance(value, str) else json.dumps(value)
        return {"content": [{"type": "text", "text": text}]}
    return None


for line in sys.stdin:
    try:
        request = json.loads(line)
    except ValueError:
        continue
    if "id" not in request:
        continue  # a notification
    result = answer(request)
    if result is None:
        reply = {"jsonrpc": "2.0", "id": request["id"], "error": {"code": -32601, "message": "method not found"}}
    else:
        reply = {"jsonrpc": "2.0", "id": request["id"], "result": result}
    print(json.dumps(reply), flush=True)
