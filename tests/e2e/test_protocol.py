"""Both MCP eras, the tasks extension, and answers to malformed input.

- The official SDK 2.x client in `mode="auto"` must end up in the 2026-07-28 era (server/discover,
  no handshake) and in `mode="legacy"` in 2025-11-25, and each runs the same end-to-end
  scenarios: tools, resources, progress, cancellation, background jobs, proxied calls, images.
- A modern request that declares the `io.modelcontextprotocol/tasks` extension gets a task for a
  run that outlives the wait budget, pollable with `tasks/get` and stoppable with `tasks/cancel`.
- Every line the server cannot use gets a JSON-RPC error (catalogue 55), and it keeps serving.
"""

from __future__ import annotations

import ast
import contextlib
import json
import time

import anyio
import pytest

from conftest import IRONCELL, RawServer, Run, _field, run, server_env, worker_python_has
from test_proxy import proxy_env

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
TASKS_EXT = "io.modelcontextprotocol/tasks"


@contextlib.asynccontextmanager
async def sdk2_client(state_dir, mode: str, **env: str):
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=str(IRONCELL), args=["serve"], env=server_env(state_dir, **env))
    with open(state_dir / "server.log", "a") as errlog:
        async with Client(stdio_client(params, errlog=errlog), mode=mode) as c:
            yield c


@pytest.mark.anyio
@pytest.mark.parametrize("mode, era", [("auto", MODERN), ("legacy", LEGACY)])
async def test_the_sdk2_client_lands_in_its_era_and_every_scenario_works(state_dir, tmp_path, mode, era):
    async with sdk2_client(state_dir, mode, IRONCELL_WAIT_BUDGET="5s", **proxy_env(tmp_path)) as c:
        assert c.protocol_version == era
        assert c.server_info is not None and c.server_info.name == "ironcell"

        # Tools: titles, honest annotations, a published output schema.
        tools = {t.name: t for t in (await c.list_tools()).tools}
        rp = tools["run_python"]
        assert rp.title == "Run Python"
        a = rp.annotations
        assert (a.read_only_hint, a.idempotent_hint, a.open_world_hint) == (False, False, True)
        assert rp.output_schema["required"] == ["status"]
        assert tools["run_python_job"].annotations.open_world_hint is False

        # State persists; structuredContent validates against the schema (the SDK checks it).
        assert not (await run(c, "x = 41")).is_error
        r = await run(c, "x + 1")
        assert r["result"] == "42" and r["status"] == "ok"

        # Resources: session files and system://info.
        r = await run(c, "open('era.txt', 'w').write('hello era')", session="files")
        uri = r["files"][0]["uri"]
        listed = [str(res.uri) for res in (await c.list_resources()).resources]
        assert "system://info" in listed and uri in listed
        assert (await c.read_resource(uri)).contents[0].text == "hello era"
        info = json.loads((await c.read_resource("system://info")).contents[0].text)
        assert info

        # Progress, with the newest output.
        seen = []

        async def on_progress(progress, total, message):
            seen.append((progress, message))

        code = "import time\nfor i in range(4):\n    print(f'step {i}')\n    time.sleep(0.8)"
        res = await c.call_tool("run_python", {"code": code}, progress_callback=on_progress)
        assert not Run(res).is_error
        assert len(seen) >= 2 and any("step" in (m or "") for _, m in seen), seen

        # Cancellation: abandoning the call sends notifications/cancelled; the loop stops and
        # the session (with its variables) is kept.
        with anyio.move_on_after(1.5):
            await c.call_tool("run_python", {"code": "while True: pass", "timeout_s": 120})
        r = await run(c, "x")
        assert r["result"] == "41" and r["session_state"] == "kept", r

        # A run past the wait budget goes on as a background job (no tasks declared here).
        r = await run(c, "import time\ntime.sleep(7)\n'late'", session="slow", timeout_s=60)
        assert r["status"] == "running", r
        done = Run(await c.call_tool("run_python_job", {"job": r["job"], "wait_s": 30}))
        while done["status"] == "running":
            done = Run(await c.call_tool("run_python_job", {"job": r["job"], "wait_s": 30}))
        assert done["result"] == "'late'"

        # Proxied calls: an old-era upstream (everything) and a new-era one (time).
        r = await run(c, "s = await mcp_everything.get_sum(a=2, b=3)\nt = await mcp_time.get_current_time(timezone='UTC')\n(s, t['timezone'])")
        assert not r.is_error, r.text
        while r["status"] == "running":  # starting both upstreams may take past the 5 s budget
            r = Run(await c.call_tool("run_python_job", {"job": r["job"], "wait_s": 30}))
        assert ast.literal_eval(r["result"]) == ("The sum of 2 and 3 is 5.", "UTC")

        # Images.
        if worker_python_has("matplotlib", "numpy", "PIL"):
            r = await run(c, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\n'plotted'")
            images = [b for b in r.raw.content if getattr(b, "type", None) == "image"]
            assert len(images) == 1 and _field(images[0], "mime_type", "mimeType") == "image/png"


def modern_meta(capabilities: dict | None = None, version: str = MODERN) -> dict:
    return {
        "io.modelcontextprotocol/protocolVersion": version,
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
        "io.modelcontextprotocol/clientCapabilities": capabilities or {},
    }


def modern_request(srv: RawServer, method: str, params: dict | None = None, caps: dict | None = None,
                   version: str = MODERN, timeout: float = 60.0) -> dict:
    params = dict(params or {})
    params["_meta"] = {**params.get("_meta", {}), **modern_meta(caps, version)}
    return srv.request(method, params, timeout=timeout)


def test_discover_lists_both_eras_and_a_modern_client_needs_no_handshake(state_dir):
    srv = RawServer(state_dir)
    d = modern_request(srv, "server/discover")["result"]
    assert d["supportedVersions"] == ["2024-11-05", "2025-03-26", "2025-06-18", LEGACY, MODERN]
    assert d["resultType"] == "complete"
    assert set(d["capabilities"]) >= {"tools", "resources"}
    assert TASKS_EXT in d["capabilities"]["extensions"]
    # No initialize: tools/list and tools/call straight away, every result typed.
    tools = modern_request(srv, "tools/list")["result"]
    assert tools["resultType"] == "complete" and "ttlMs" in tools
    r = modern_request(srv, "tools/call", {"name": "run_python", "arguments": {"code": "6 * 7"}})["result"]
    assert r["resultType"] == "complete" and r["structuredContent"]["result"] == "42"
    # A version ironcell does not serve: -32022 with the supported list.
    bad = modern_request(srv, "tools/list", version="2099-01-01")["error"]
    assert bad["code"] == -32022 and MODERN in bad["data"]["supported"] and LEGACY in bad["data"]["supported"]
    # ping is gone in 2026-07-28.
    assert modern_request(srv, "ping")["error"]["code"] == -32601
    assert srv.close() == 0


def test_a_legacy_client_gets_no_modern_fields(state_dir):
    srv = RawServer(state_dir)
    init = srv.initialize()["result"]
    assert init["protocolVersion"] == "2025-06-18"
    tools = srv.request("tools/list", {})["result"]
    assert "resultType" not in tools
    r = srv.call("1 + 1")
    assert "resultType" not in r and r["structuredContent"]["result"] == "2"
    assert srv.request("ping", {})["result"] == {}
    srv.close()


def wait_task(srv: RawServer, task_id: str, caps: dict, deadline_s: float = 90.0) -> dict:
    """Polls tasks/get until the task leaves `working` (bounded by a generous deadline)."""
    end = time.monotonic() + deadline_s
    while True:
        t = modern_request(srv, "tasks/get", {"taskId": task_id}, caps)["result"]
        if t["status"] != "working" or time.monotonic() > end:
            return t
        time.sleep(0.3)


def test_a_long_run_becomes_a_task_for_a_client_that_declared_the_extension(state_dir):
    caps = {"extensions": {TASKS_EXT: {}}}
    srv = RawServer(state_dir, IRONCELL_WAIT_BUDGET="1s")
    code = "import time\nprint('working')\ntime.sleep(3)\n'finished'"
    created = modern_request(srv, "tools/call", {"name": "run_python", "arguments": {"code": code, "timeout_s": 60}}, caps)
    task = created["result"]
    assert task["resultType"] == "task" and task["status"] == "working", task
    assert task["createdAt"].endswith("Z") and task["ttlMs"] > 0 and task["pollIntervalMs"] > 0
    # The session is busy meanwhile, and the refusal says how to follow the task.
    busy = modern_request(srv, "tools/call", {"name": "run_python", "arguments": {"code": "1"}}, caps)["result"]
    assert busy["isError"] and task["taskId"] in busy["content"][0]["text"] and "tasks/get" in busy["content"][0]["text"]
    done = wait_task(srv, task["taskId"], caps)
    assert done["status"] == "completed", done
    assert done["result"]["structuredContent"]["result"] == "'finished'"
    assert done["result"]["structuredContent"]["stdout"] == "working\n"
    # Read again: still there (kept for its ttl).
    assert wait_task(srv, task["taskId"], caps)["status"] == "completed"
    # tasks/get for a task that does not exist, and without declaring the extension.
    missing = modern_request(srv, "tasks/get", {"taskId": "job-999"}, caps)["error"]
    assert missing["code"] == -32602 and "no task" in missing["message"]
    undeclared = modern_request(srv, "tasks/get", {"taskId": task["taskId"]})["error"]
    assert undeclared["code"] == -32021
    srv.close()


def test_tasks_cancel_interrupts_the_run_and_keeps_the_session(state_dir):
    caps = {"extensions": {TASKS_EXT: {}}}
    srv = RawServer(state_dir, IRONCELL_WAIT_BUDGET="1s")
    modern_request(srv, "tools/call", {"name": "run_python", "arguments": {"code": "kept = 'yes'"}}, caps)
    task = modern_request(srv, "tools/call", {"name": "run_python", "arguments": {"code": "while True: pass", "timeout_s": 300}}, caps)["result"]
    assert task["resultType"] == "task"
    ack = modern_request(srv, "tasks/cancel", {"taskId": task["taskId"]}, caps)
    assert "error" not in ack, ack
    assert wait_task(srv, task["taskId"], caps)["status"] == "cancelled"
    r = modern_request(srv, "tools/call", {"name": "run_python", "arguments": {"code": "kept"}}, caps)["result"]
    assert r["structuredContent"]["result"] == "'yes'" and r["structuredContent"]["session_state"] == "kept"
    srv.close()


def test_without_the_extension_a_modern_client_gets_a_background_job(state_dir):
    srv = RawServer(state_dir, IRONCELL_WAIT_BUDGET="1s")
    r = modern_request(srv, "tools/call", {"name": "run_python", "arguments": {"code": "import time\ntime.sleep(3)\n5"}})["result"]
    assert r["resultType"] == "complete" and r["structuredContent"]["status"] == "running"
    job = r["structuredContent"]["job"]
    for _ in range(60):  # each wait is capped by the 1 s budget: the 3 s run ends within a few
        done = modern_request(srv, "tools/call", {"name": "run_python_job", "arguments": {"job": job, "wait_s": 30}})["result"]
        if done["structuredContent"]["status"] != "running":
            break
    assert done["structuredContent"]["result"] == "5"
    srv.close()


# Catalogue 55: every malformed line is answered, and the server keeps serving.
MALFORMED = [
    (b"{this is not json", -32700, None),
    (b"\xff\xfe invalid utf-8 \xc3", -32700, None),
    (b'{"jsonrpc": "2.0", "id": 5, "method": "tools/list", "params": {"x": "\xc3\x28"}}', -32700, None),
    (b'{"jsonrpc": "2.0", "id": 1e999, "method": "tools/list"}', -32700, None),
    (b'{"jsonrpc": "2.0", "id": 6, "method": "tools/list", "params": {"a": ' + b"[" * 5000 + b"]" * 5000 + b"}}", -32700, None),
    (b'{"jsonrpc": "2.0", "id": 7, "method": 12}', -32600, 7),
    (b'{"jsonrpc": "1.0", "id": "v", "method": "tools/list"}', -32600, "v"),
    (b'[{"jsonrpc": "2.0", "id": 8, "method": "tools/list"}]', -32600, None),
    (b"42", -32600, None),
    (b'{"jsonrpc": "2.0", "id": "p", "method": "tools/call", "params": "not an object"}', -32602, "p"),
    # SECURITY.md #296: a key named twice (here `code`, once escaped) is refused, not last-wins.
    (
        b'{"jsonrpc": "2.0", "id": 11, "method": "tools/call", "params": {"name": "run_python", '
        b'"arguments": {"code": "1", "\\u0063ode": "2"}}}',
        -32600,
        11,
    ),
    (b'{"jsonrpc": "2.0", "id": 12, "method": "ping", "method": "tools/call", "params": {}}', -32600, 12),
]


@pytest.mark.parametrize("as_user", ["root", "nobody"])
def test_every_malformed_line_gets_an_error_answer_and_the_server_keeps_serving(state_dir, as_user):
    from conftest import shared_tmp_dir

    d = shared_tmp_dir()
    (d / "state").mkdir(mode=0o777)
    (d / "state").chmod(0o777)
    srv = RawServer(d, as_user=as_user, MCP_BRIDGE_STATE_DIR=str(d / "state"))
    srv.initialize()
    for line, code, rid in MALFORMED:
        srv.send_line(line)
        reply = srv.read(timeout=30)
        assert "error" in reply, (line[:60], reply)
        assert reply["error"]["code"] == code and reply["id"] == rid, (line[:60], reply)
        assert reply["error"]["message"]
    # A malformed notification is not answered (JSON-RPC forbids it); the next request is.
    srv.send_line(b'{"jsonrpc": "2.0", "method": "notifications/cancelled", "params": 5}')
    assert srv.request("no/such/method", {})["error"]["code"] == -32601
    assert srv.call("'still serving'")["structuredContent"]["result"] == "'still serving'"
    assert srv.close() == 0


def test_an_oversized_line_is_a_parse_error_and_the_next_request_works(state_dir):
    srv = RawServer(state_dir)
    srv.initialize()
    # Past the 64 MiB line cap, with no newline for most of it: never buffered whole.
    chunk = b"x" * (1 << 20)
    assert srv.proc.stdin is not None
    srv.proc.stdin.write(b'{"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"code": "')
    for _ in range(66):
        srv.proc.stdin.write(chunk)
    srv.send_line(b'"}}')
    reply = srv.read(timeout=60)
    assert reply["error"]["code"] == -32700 and reply["id"] is None and "limit" in reply["error"]["message"]
    assert srv.call("1 + 2")["structuredContent"]["result"] == "3"
    srv.close()


# Issue 13: ironcell's client side speaks to each proxied server in that server's own era.
UPSTREAM_ERAS = {
    "time": MODERN,  # answers server/discover
    "git": MODERN,
    "everything": "initialize",  # answer server/discover with "method not found"
    "filesystem": "initialize",
    "memory": "initialize",
    "sequential-thinking": "initialize",
}


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_each_proxied_server_is_spoken_to_in_its_own_era(state_dir, tmp_path, mode):
    from conftest import HARNESS

    base = json.loads((HARNESS / "proxied_servers.json").read_text())["mcpServers"]
    servers = {name: base[name] for name in UPSTREAM_ERAS}
    servers["memory"] = dict(servers["memory"], env={"MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl")})
    config = tmp_path / "servers.json"
    config.write_text(json.dumps({"mcpServers": servers}))
    repo = base["git"]["args"][base["git"]["args"].index("--repository") + 1]
    async with sdk2_client(state_dir, mode, MCP_BRIDGE_CONFIG=str(config), MCP_BRIDGE_STARTUP_TIMEOUT="30s") as c:
        info = json.loads((await c.read_resource("system://info")).contents[0].text)
        assert all(s["protocol_version"] is None for s in info["mcp"]["servers"]), "nothing started yet"
        code = f"""
out = {{}}
out['time'] = (await mcp_time.get_current_time(timezone='UTC'))['timezone']
out['git'] = 'clean' if 'Repository status' in str(await mcp_git.git_status(repo_path={repo!r})) else 'unexpected'
out['everything'] = await mcp_everything.get_sum(a=2, b=3)
out['filesystem'] = str(await mcp_filesystem.list_allowed_directories())
out['memory'] = sorted(await mcp_memory.read_graph())
out['sequential-thinking'] = [t['tool'] for t in await runtime.query_tool_docs('sequential-thinking')]
out
"""
        r = await run(c, code, timeout_s=120)
        assert not r.is_error, r.text
        out = ast.literal_eval(r["result"])
        assert out["time"] == "UTC" and out["git"] == "clean"
        assert out["everything"] == "The sum of 2 and 3 is 5."
        assert "fsroot" in out["filesystem"] and out["memory"] == ["entities", "relations"]
        assert out["sequential-thinking"] == ["sequentialthinking"]
        assert [c["outcome"] for c in r["upstream_calls"]] == ["ok"] * 5

        info = json.loads((await c.read_resource("system://info")).contents[0].text)
        seen = {s["name"]: s for s in info["mcp"]["servers"]}
        for name, era in UPSTREAM_ERAS.items():
            s = seen[name]
            assert s["running"], s
            if era == MODERN:
                assert (s["era"], s["protocol_version"]) == ("discover", MODERN), s
            else:
                assert s["era"] == "initialize" and s["protocol_version"] in (
                    "2024-11-05", "2025-03-26", "2025-06-18", LEGACY), s
