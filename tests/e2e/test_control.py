"""Keeping control of proxied tools: allow/deny/readOnly rules, approval of destructive calls
through the client (elicitation), and the audit trail of every run.

Peers: the reference memory server (its read tools are annotated readOnlyHint, its delete tools
destructiveHint) and the official Python SDK 2.x client, with and without an elicitation
callback.
"""

from __future__ import annotations

import ast
import contextlib
import json
import subprocess
from pathlib import Path

import pytest

from conftest import HARNESS, IRONCELL, Run, connect, run, server_env

pytestmark = pytest.mark.anyio


def memory_servers(tmp: Path, **rules_by_name: dict) -> str:
    base = json.loads((HARNESS / "proxied_servers.json").read_text())["mcpServers"]["memory"]
    servers = {}
    for name, rules in rules_by_name.items():
        servers[name] = dict(base, env={"MEMORY_FILE_PATH": str(tmp / f"{name}.jsonl")}, **rules)
    path = tmp / "servers.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return str(path)


@contextlib.asynccontextmanager
async def connect_asking(state_dir: Path, answers: list[str], asked: list[str], **env: str):
    """A client that supports elicitation and answers each question from `answers`
    (`accept`, `no` = accept with approve=false, `decline`)."""
    from mcp import ClientSession, StdioServerParameters, types
    from mcp.client.stdio import stdio_client

    async def on_elicit(context, params):
        asked.append(params.message)
        answer = answers.pop(0)
        if answer == "decline":
            return types.ElicitResult(action="decline")
        return types.ElicitResult(action="accept", content={"approve": answer == "accept"})

    params = StdioServerParameters(command=str(IRONCELL), args=["serve"], env=server_env(state_dir, **env))
    with open(state_dir / "server.log", "a") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write, elicitation_callback=on_elicit) as session:
                await session.initialize()
                yield session


def audit(state_dir: Path, *args: str) -> str:
    out = subprocess.run(
        [str(IRONCELL), "audit", *args],
        env=server_env(state_dir),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def audit_lines(state_dir: Path) -> list[dict]:
    return [json.loads(line) for line in audit(state_dir, "--json").splitlines()]


async def test_allow_deny_and_read_only_shape_what_code_sees_and_can_call(state_dir, tmp_path):
    config = memory_servers(
        tmp_path,
        ro={"readOnly": True},
        nodelete={"deny": ["delete_*"], "confirm": False},
        only={"allow": ["read_graph", "create_*"]},
    )
    async with connect(state_dir, MCP_BRIDGE_CONFIG=config) as s:
        r = await run(s, "sorted(t['tool'] for t in await runtime.query_tool_docs('ro'))")
        assert ast.literal_eval(r["result"]) == ["open_nodes", "read_graph", "search_nodes"]
        r = await run(s, "sorted(t['tool'] for t in await runtime.query_tool_docs('nodelete'))")
        names = ast.literal_eval(r["result"])
        assert "create_entities" in names and not any(n.startswith("delete_") for n in names)
        r = await run(s, "sorted(t['tool'] for t in await runtime.query_tool_docs('only'))")
        assert ast.literal_eval(r["result"]) == ["create_entities", "create_relations", "read_graph"]

        # Annotations travel with the docs, so code can read them too.
        r = await run(s, "[t['annotations'] for t in await runtime.query_tool_docs('ro', detail='full')][0]")
        assert "readOnlyHint" in r["result"]

        # Search never offers a hidden tool.
        r = await run(s, "[(h['server'], h['tool']) for h in await runtime.search_tool_docs('delete entities', limit=50)]")
        hits = ast.literal_eval(r["result"])
        assert ("only", "create_entities") in hits, hits
        assert not [h for h in hits if h[0] == "nodelete" and h[1].startswith("delete_")], hits
        assert not [h for h in hits if h[0] in ("ro", "only") and h[1].startswith("delete_")], hits

        # Calling a hidden tool raises ToolError naming the rule; the run itself goes on.
        code = """
from mcp import ToolError
out = []
for server, tool, args in [("ro", "create_entities", {"entities": []}),
                           ("nodelete", "delete_entities", {"entityNames": ["x"]}),
                           ("only", "search_nodes", {"query": "x"}),
                           ("ro", "no_such_tool", {})]:
    try:
        await mcp_servers[server].call_tool(tool, args)
        out.append("called")
    except ToolError as e:
        out.append(str(e))
out
"""
        r = await run(s, code)
        assert not r.is_error, r
        ro_msg, deny_msg, allow_msg, ro_missing_msg = ast.literal_eval(r["result"])
        assert "readOnly" in ro_msg and "readOnlyHint" in ro_msg
        assert '"deny"' in deny_msg and "delete_*" in deny_msg
        assert '"allow"' in allow_msg
        # A readOnly server answers a name it lacks as it answers a hidden one: code cannot
        # tell which of its non-read-only names exist (#149).
        assert ro_missing_msg == ro_msg.replace("create_entities", "no_such_tool"), (ro_msg, ro_missing_msg)
        assert [c["outcome"] for c in r["upstream_calls"]] == ["denied"] * 4

        # The attribute form raises the same ToolError (not ToolNotFoundError), sync or not;
        # an unknown name's error lists only the tools code may see.
        code = """
from mcp import ToolError, ToolNotFoundError
out = []
for f in (lambda: mcp_nodelete.delete_entities, lambda: mcp_nodelete.delete_entities_sync,
          lambda: mcp_nodelete.no_such_tool):
    try:
        f()
        out.append("found")
    except ToolError as e:
        out.append("ToolError: " + str(e))
    except ToolNotFoundError as e:
        out.append("ToolNotFoundError: " + str(e))
out.append(hasattr(mcp_nodelete, "no_such_tool") or getattr(mcp_nodelete, "no_such_tool", "absent"))
try:
    await runtime.call_tool("nodelete", "no_such_tool", {})
except ToolNotFoundError as e:
    out.append("ToolNotFoundError: " + str(e))
out
"""
        r = await run(s, code)
        attr, attr_sync, unknown, absent, unknown_call = ast.literal_eval(r["result"])
        assert absent == "absent", r  # hasattr and getattr with a default work
        assert attr.startswith("ToolError: ") and '"deny"' in attr and "delete_*" in attr, attr
        assert attr_sync == attr, (attr, attr_sync)
        assert unknown.startswith("ToolNotFoundError: ") and "create_entities" in unknown, unknown
        assert unknown_call.startswith("ToolNotFoundError: ") and "create_entities" in unknown_call, unknown_call
        assert "delete_" not in unknown and "delete_" not in unknown_call, (unknown, unknown_call)

        # What the rules allow still works.
        r = await run(s, "await mcp_ro.read_graph()\n'read ok'")
        assert r["result"] == "'read ok'", r
        r = await run(s, "await mcp_nodelete.create_entities(entities=[{'name': 'a', 'entityType': 't', 'observations': []}])\n'ok'")
        assert r["result"] == "'ok'", r

    lines = audit_lines(state_dir)
    denied = [c for line in lines for c in line.get("upstream_calls", []) if c["outcome"] == "denied"]
    assert {(c["server"], c["tool"]) for c in denied} == {
        ("ro", "create_entities"), ("nodelete", "delete_entities"), ("only", "search_nodes"),
        ("ro", "no_such_tool"),
    }
    # Argument names are kept, values are not (no auditArguments).
    assert all("arguments" not in c for line in lines for c in line.get("upstream_calls", []))
    assert any(c["argument_keys"] == ["entityNames"] for c in denied)


async def test_destructive_calls_are_approved_or_declined_by_the_user(state_dir, tmp_path):
    config = memory_servers(tmp_path, memory={})
    asked: list[str] = []
    code = """
from mcp import ToolError
await mcp_memory.create_entities(entities=[{"name": "keep", "entityType": "t", "observations": []}])
try:
    await mcp_memory.delete_entities(entityNames=["keep"])
    outcome = "deleted"
except ToolError as e:
    outcome = "refused: " + str(e)
names = [e["name"] for e in (await mcp_memory.read_graph())["entities"]]
(outcome, names)
"""
    async with connect_asking(state_dir, ["decline", "no", "accept"], asked, MCP_BRIDGE_CONFIG=config) as s:
        r = await run(s, code, session="a")
        outcome, names = ast.literal_eval(r["result"])
        assert outcome.startswith("refused: declined"), outcome
        assert names == ["keep"]
        # Accepting the form without ticking "approve" is not approval.
        r = await run(s, code, session="a")
        outcome, names = ast.literal_eval(r["result"])
        assert outcome.startswith("refused: declined"), outcome
        assert names == ["keep"]
        r = await run(s, code, session="a")
        outcome, names = ast.literal_eval(r["result"])
        assert outcome == "deleted" and names == [], r
    assert len(asked) == 3
    # The question shows the server, the tool and the arguments.
    assert "delete_entities" in asked[0] and '"memory"' in asked[0] and "keep" in asked[0]

    outcomes = [c["outcome"] for line in audit_lines(state_dir) for c in line.get("upstream_calls", [])
                if c["tool"] == "delete_entities"]
    assert outcomes == ["declined", "declined", "ok"]


async def test_without_a_client_that_can_ask_destructive_calls_are_refused_with_the_fix(state_dir, tmp_path):
    config = memory_servers(tmp_path, memory={}, trusted={"confirm": False})
    async with connect(state_dir, MCP_BRIDGE_CONFIG=config) as s:
        code = """
from mcp import ToolError
try:
    await mcp_memory.delete_entities(entityNames=["x"])
    msg = "called"
except ToolError as e:
    msg = str(e)
msg
"""
        r = await run(s, code)
        msg = ast.literal_eval(r["result"])
        assert "cannot ask" in msg and '"confirm": false' in msg and "--approval allow" in msg
        # The config wins over the upstream's annotation.
        r = await run(s, "await mcp_trusted.delete_entities(entityNames=['x'])\n'called'")
        assert r["result"] == "'called'", r
    async with connect(state_dir, MCP_BRIDGE_CONFIG=config, IRONCELL_APPROVAL="allow") as s:
        r = await run(s, "await mcp_memory.delete_entities(entityNames=['x'])\n'called'")
        assert r["result"] == "'called'", r
    async with connect(state_dir, MCP_BRIDGE_CONFIG=config, IRONCELL_APPROVAL="deny") as s:
        r = await run(s, "await mcp_memory.delete_entities(entityNames=['x'])")
        assert r.is_error and "--approval deny" in r["error"]["message"]
    outcomes = [(c["server"], c["outcome"]) for line in audit_lines(state_dir)
                for c in line.get("upstream_calls", [])]
    assert outcomes == [("memory", "refused"), ("trusted", "ok"), ("memory", "ok"), ("memory", "refused")]


async def test_every_run_leaves_an_audit_line_and_audit_prints_them(state_dir, tmp_path):
    config = memory_servers(tmp_path, memory={"auditArguments": True})
    async with connect(state_dir, MCP_BRIDGE_CONFIG=config) as s:
        await run(s, "x = 1\nprint('hello')", session="one")
        await run(s, "raise ValueError('boom')", session="two")
        await run(s, "import time\ntime.sleep(30)", session="two", timeout_s=1)
        await run(s, "await mcp_memory.search_nodes(query='needle')", session="one")
        await run(s, "1", session="bad name!")
    lines = audit_lines(state_dir)
    assert [(e["session"], e["status"]) for e in lines] == [
        ("one", "ok"), ("two", "error"), ("two", "timeout"), ("one", "ok"), ("bad name!", "refused")
    ]
    first = lines[0]
    assert first["code_head"] == "x = 1\nprint('hello')" and len(first["code_sha256"]) == 64
    assert "wall_timeout" in lines[2]["limits_hit"]
    call = lines[3]["upstream_calls"][0]
    assert call["server"] == "memory" and call["tool"] == "search_nodes" and call["outcome"] == "ok"
    assert call["arguments"] == {"query": "needle"}, "auditArguments records values"
    assert "invalid session name" in lines[4]["refused"]

    table = audit(state_dir)
    assert "memory.search_nodes" in table and "timeout*" in table and "5 run(s)" in table
    only_two = audit(state_dir, "--session", "two")
    assert "2 run(s)" in only_two and "one " not in only_two
    assert "no runs recorded" in audit(state_dir, "--since", "2099-01-01T00:00:00Z")
    # The log is not reachable from inside a session.
    async with connect(state_dir, MCP_BRIDGE_CONFIG=config) as s:
        r = await run(s, f"open({str(state_dir / 'audit.jsonl')!r}, 'a').write('forged')")
        assert r.is_error and r["error"]["type"] == "PermissionError"


# The 2026-07-28 era: no server-to-client requests; a waiting tools/call answers
# `resultType: "input_required"` with the question, and the client retries it with the answer.
MODERN = "2026-07-28"

DELETE_KEEP = """
from mcp import ToolError
await mcp_memory.create_entities(entities=[{"name": "keep", "entityType": "t", "observations": []}])
try:
    await mcp_memory.delete_entities(entityNames=["keep"])
    outcome = "deleted"
except ToolError as e:
    outcome = "refused: " + str(e)
names = [e["name"] for e in (await mcp_memory.read_graph())["entities"]]
(outcome, names)
"""


@contextlib.asynccontextmanager
async def modern_client(state_dir: Path, answers: list[str] | None, asked: list[str], **env: str):
    """The official SDK 2.x client in auto mode (it lands in 2026-07-28); with an elicitation
    callback answering from `answers` unless `answers` is None."""
    from mcp import Client, StdioServerParameters, types
    from mcp.client.stdio import stdio_client

    async def on_elicit(context, params):
        asked.append(params.message)
        answer = answers.pop(0)
        if answer == "decline":
            return types.ElicitResult(action="decline")
        return types.ElicitResult(action="accept", content={"approve": answer == "accept"})

    params = StdioServerParameters(command=str(IRONCELL), args=["serve"], env=server_env(state_dir, **env))
    extra = {} if answers is None else {"elicitation_callback": on_elicit}
    with open(state_dir / "server.log", "a") as errlog:
        async with Client(stdio_client(params, errlog=errlog), mode="auto", **extra) as c:
            assert c.protocol_version == MODERN
            yield c


async def test_modern_era_destructive_calls_are_approved_or_declined_through_input_required(state_dir, tmp_path):
    config = memory_servers(tmp_path, memory={})
    asked: list[str] = []
    async with modern_client(state_dir, ["decline", "no", "accept"], asked, MCP_BRIDGE_CONFIG=config) as c:
        r = await run(c, DELETE_KEEP, session="a")
        outcome, names = ast.literal_eval(r["result"])
        assert outcome.startswith("refused: declined"), outcome
        assert names == ["keep"]
        r = await run(c, DELETE_KEEP, session="a")
        outcome, names = ast.literal_eval(r["result"])
        assert outcome.startswith("refused: declined"), outcome
        assert names == ["keep"]
        r = await run(c, DELETE_KEEP, session="a")
        outcome, names = ast.literal_eval(r["result"])
        assert outcome == "deleted" and names == [], r
        # The session's state survived the round trips.
        r = await run(c, "outcome", session="a")
        assert r["result"] == "'deleted'"
    assert len(asked) == 3
    assert "delete_entities" in asked[0] and '"memory"' in asked[0] and "keep" in asked[0]
    outcomes = [c["outcome"] for line in audit_lines(state_dir) for c in line.get("upstream_calls", [])
                if c["tool"] == "delete_entities"]
    assert outcomes == ["declined", "declined", "ok"]


async def test_modern_era_a_background_job_asks_through_run_python_job(state_dir, tmp_path):
    config = memory_servers(tmp_path, memory={})
    asked: list[str] = []
    code = "import time\ntime.sleep(3)\n" + DELETE_KEEP
    async with modern_client(state_dir, ["accept"], asked, MCP_BRIDGE_CONFIG=config, IRONCELL_WAIT_BUDGET="1s") as c:
        r = await run(c, code, session="bg", timeout_s=120)
        assert r["status"] == "running" and not asked, r
        done = Run(await c.call_tool("run_python_job", {"job": r["job"], "wait_s": 30}))
        while done["status"] == "running":
            done = Run(await c.call_tool("run_python_job", {"job": r["job"], "wait_s": 30}))
        outcome, names = ast.literal_eval(done["result"])
        assert outcome == "deleted" and names == [], done
    assert len(asked) == 1 and "delete_entities" in asked[0]


async def test_modern_era_without_elicitation_destructive_calls_are_refused_with_the_fix(state_dir, tmp_path):
    config = memory_servers(tmp_path, memory={}, trusted={"confirm": False})
    asked: list[str] = []
    async with modern_client(state_dir, None, asked, MCP_BRIDGE_CONFIG=config) as c:
        code = """
from mcp import ToolError
try:
    await mcp_memory.delete_entities(entityNames=["x"])
    msg = "called"
except ToolError as e:
    msg = str(e)
msg
"""
        r = await run(c, code)
        msg = ast.literal_eval(r["result"])
        assert "cannot ask" in msg and '"confirm": false' in msg and "--approval allow" in msg
        r = await run(c, "await mcp_trusted.delete_entities(entityNames=['x'])\n'called'")
        assert r["result"] == "'called'", r
    outcomes = [(c["server"], c["outcome"]) for line in audit_lines(state_dir)
                for c in line.get("upstream_calls", [])]
    assert outcomes == [("memory", "refused"), ("trusted", "ok")]


def test_modern_era_input_required_on_the_wire_and_retries_that_do_not_fit(state_dir, tmp_path):
    """The wire shape of an approval in 2026-07-28, and what a retry must carry."""
    from conftest import RawServer
    from test_protocol import modern_request

    config = memory_servers(tmp_path, memory={})
    caps = {"elicitation": {"form": {}}}
    srv = RawServer(state_dir, MCP_BRIDGE_CONFIG=config)
    args = {"code": "await mcp_memory.delete_entities(entityNames=['x'])\n'deleted'", "session": "w"}
    first = modern_request(srv, "tools/call", {"name": "run_python", "arguments": args}, caps)["result"]
    assert first["resultType"] == "input_required", first
    (key, req), = first["inputRequests"].items()
    assert req["method"] == "elicitation/create" and req["params"]["mode"] == "form"
    assert "delete_entities" in req["params"]["message"] and '"x"' in req["params"]["message"]
    assert req["params"]["requestedSchema"]["properties"]["approve"]["type"] == "boolean"
    state = first["requestState"]

    # Another call's arguments, or a forged state: refused, and the question stays open.
    other = dict(args, code="'something else'")
    bad = modern_request(srv, "tools/call", {"name": "run_python", "arguments": other, "requestState": state,
                                             "inputResponses": {key: {"action": "accept", "content": {"approve": True}}}}, caps)
    assert bad["error"]["code"] == -32602 and "same arguments" in bad["error"]["message"]
    forged = modern_request(srv, "tools/call", {"name": "run_python", "arguments": args, "requestState": "0" * 32}, caps)
    assert forged["error"]["code"] == -32602 and "unknown" in forged["error"]["message"]

    done = modern_request(srv, "tools/call", {"name": "run_python", "arguments": args, "requestState": state,
                                              "inputResponses": {key: {"action": "accept", "content": {"approve": True}}}}, caps)["result"]
    assert done["resultType"] == "complete" and done["structuredContent"]["result"] == "'deleted'", done
    # A state is good for one retry only.
    again = modern_request(srv, "tools/call", {"name": "run_python", "arguments": args, "requestState": state}, caps)
    assert again["error"]["code"] == -32602
    srv.close()


def test_modern_era_a_task_asks_through_tasks_get_and_is_answered_with_tasks_update(state_dir, tmp_path):
    """A run that became a task (tasks extension) and then needs approval: `tasks/get` shows the
    question (status input_required), `tasks/update` answers it, and the run goes on."""
    import time

    from conftest import RawServer
    from test_protocol import TASKS_EXT, modern_request, wait_task

    config = memory_servers(tmp_path, memory={})
    caps = {"elicitation": {"form": {}}, "extensions": {TASKS_EXT: {}}}
    srv = RawServer(state_dir, MCP_BRIDGE_CONFIG=config, IRONCELL_WAIT_BUDGET="1s")
    code = "import time\ntime.sleep(2)\n" + DELETE_KEEP
    task = modern_request(srv, "tools/call", {"name": "run_python", "arguments": {"code": code, "timeout_s": 120}}, caps)["result"]
    assert task["resultType"] == "task", task
    deadline = time.monotonic() + 60
    while True:
        t = modern_request(srv, "tasks/get", {"taskId": task["taskId"]}, caps)["result"]
        if t["status"] != "working" or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert t["status"] == "input_required", t
    (key, req), = t["inputRequests"].items()
    assert req["method"] == "elicitation/create" and "delete_entities" in req["params"]["message"]
    # Asked again, the same question under the same key, until it is answered.
    again = modern_request(srv, "tasks/get", {"taskId": task["taskId"]}, caps)["result"]
    assert list(again["inputRequests"]) == [key]
    bad = modern_request(srv, "tasks/update", {"taskId": task["taskId"], "inputResponses": {"nope": {}}}, caps)
    assert bad["error"]["code"] == -32602 and "not an outstanding input request" in bad["error"]["message"]
    ok = modern_request(srv, "tasks/update", {"taskId": task["taskId"],
                                              "inputResponses": {key: {"action": "accept", "content": {"approve": True}}}}, caps)
    assert "error" not in ok, ok
    done = wait_task(srv, task["taskId"], caps)
    assert done["status"] == "completed", done
    assert ast.literal_eval(done["result"]["structuredContent"]["result"]) == ("deleted", [])
    srv.close()
    outcomes = [c["outcome"] for line in audit_lines(state_dir) for c in line.get("upstream_calls", [])
                if c["tool"] == "delete_entities"]
    assert outcomes == ["ok"]
