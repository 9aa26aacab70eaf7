"""A proxied MCP server in plain Python (standard library only, so an unprivileged user can run
it with the system interpreter), speaking the handshake era over stdio. It writes every request
it receives to the file named by PLAIN_SERVER_LOG (one JSON line each), so a test can see
exactly what reached it: the arguments of each call and every `notifications/cancelled`.

Tools: `write_file` (annotated destructiveHint; records the call, like a server that writes
the file it is given), `get-env` (a name with a dash: its Python alias is `get_env`), `echo`
(readOnlyHint) and `sleep` (answers after `seconds`, on a thread of its own, so other calls are
answered meanwhile).
"""

import json
import os
import sys
import threading
import time

LOG = os.environ["PLAIN_SERVER_LOG"]
OUT = threading.Lock()
CANCELLED = set()

TOOLS = [
    {"name": "write_file", "description": "Writes a file.",
     "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                     "required": ["path", "content"]},
     "annotations": {"destructiveHint": True, "readOnlyHint": False}},
    {"name": "get-env", "description": "Reads a setting.",
     "inputSchema": {"type": "object", "properties": {"name": {"type": "string"}}}},
    {"name": "echo", "description": "Echoes its text.",
     "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
     "annotations": {"readOnlyHint": True}},
    {"name": "sleep", "description": "Sleeps, then answers.",
     "inputSchema": {"type": "object", "properties": {"seconds": {"type": "number"}, "tag": {"type": "string"}}},
     "annotations": {"readOnlyHint": True}},
]


def log(entry):
    with OUT, open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")


def send(msg):
    with OUT:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()


def text(rid, value):
    send({"jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": value}]}})


def call(rid, name, args):
    log({"call": name, "arguments": args, "pid": os.getpid()})
    if name == "sleep":
        time.sleep(float(args.get("seconds", 0)))
        if rid in CANCELLED:
            log({"answered_after_cancel": rid})
            return
        text(rid, "slept " + str(args.get("tag", "")))
    elif name == "echo":
        text(rid, str(args.get("text", "")))
    else:
        text(rid, "done " + name)


def main():
    log({"started": os.getpid()})
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        method, rid = msg.get("method"), msg.get("id")
        params = msg.get("params") or {}
        if method == "initialize":
            send({"jsonrpc": "2.0", "id": rid, "result": {
                "protocolVersion": params.get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {}}, "serverInfo": {"name": "plain", "version": "1"}}})
        elif method == "tools/list":
            send({"jsonrpc": "2.0", "id": rid, "result": {"tools": TOOLS}})
        elif method == "tools/call":
            threading.Thread(target=call, args=(rid, params.get("name"), params.get("arguments") or {}),
                             daemon=True).start()
        elif method == "ping":
            send({"jsonrpc": "2.0", "id": rid, "result": {}})
        elif method == "notifications/cancelled":
            CANCELLED.add(params.get("requestId"))
            log({"cancelled": params.get("requestId"), "reason": params.get("reason")})
        elif rid is not None:
            send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "method not found"}})


main()
