"""Keeping control of proxied tools: allow/deny/readOnly rules, approval of destructive calls
through the client (elicitation), and the audit trail of every run.

Peers: the reference memory server (its read tools are annotated readOnlyHint, its delete tools
destructiveHint) and the official Python SDK 2.x client, with and without an elicitation
callback.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest

from conftest import HARNESS, IRONCELL, connect, run, server_env

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
        assert eval(r["result"]) == ["open_nodes", "read_graph", "search_nodes"]
        r = await run(s, "sorted(t['tool'] for t in await runtime.query_tool_docs('nodelete'))")
        names = eval(r["result"])
        assert "create_entities" in names and not any(n.startswith("delete_") for n in names)
        r = await run(s, "sorted(t['tool'] for t in await runtime.query_tool_docs('only'))")
        assert eval(r["result"]) == ["create_entities", "create_relations", "read_graph"]

        # Annotations travel with the docs, so code can read them too.
        r = await run(s, "[t['annotations'] for t in await runtime.query_tool_docs('ro', detail='full')][0]")
        assert "readOnlyHint" in r["result"]

        # Search never offers a hidden tool.
        r = await run(s, "[(h['server'], h['tool']) for h in await runtime.search_tool_docs('delete entities', limit=50)]")
        hits = eval(r["result"])
        assert ("only", "create_entities") in hits, hits
        assert not [h for h in hits if h[0] == "nodelete" and h[1].startswith("delete_")], hits
        assert not [h for h in hits if h[0] in ("ro", "only") and h[1].startswith("delete_")], hits

        # Calling a hidden tool raises ToolError naming the rule; the run itself goes on.
        code = """
from mcp import ToolError
out = []
for server, tool, args in [("ro", "create_entities", {"entities": []}),
                           ("nodelete", "delete_entities", {"entityNames": ["x"]}),
                           ("only", "search_nodes", {"query": "x"})]:
    try:
        await mcp_servers[server].call_tool(tool, args)
        out.append("called")
    except ToolError as e:
        out.append(str(e))
out
"""
        r = await run(s, code)
        assert not r.is_error, r
        ro_msg, deny_msg, allow_msg = eval(r["result"])
        assert "readOnly" in ro_msg and "readOnlyHint" in ro_msg
        assert '"deny"' in deny_msg and "delete_*" in deny_msg
        assert '"allow"' in allow_msg
        assert [c["outcome"] for c in r["upstream_calls"]] == ["denied", "denied", "denied"]

        # What the rules allow still works.
        r = await run(s, "await mcp_ro.read_graph()\n'read ok'")
        assert r["result"] == "'read ok'", r
        r = await run(s, "await mcp_nodelete.create_entities(entities=[{'name': 'a', 'entityType': 't', 'observations': []}])\n'ok'")
        assert r["result"] == "'ok'", r

    lines = audit_lines(state_dir)
    denied = [c for line in lines for c in line.get("upstream_calls", []) if c["outcome"] == "denied"]
    assert {(c["server"], c["tool"]) for c in denied} == {
        ("ro", "create_entities"), ("nodelete", "delete_entities"), ("only", "search_nodes")
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
        outcome, names = eval(r["result"])
        assert outcome.startswith("refused: declined"), outcome
        assert names == ["keep"]
        # Accepting the form without ticking "approve" is not approval.
        r = await run(s, code, session="a")
        outcome, names = eval(r["result"])
        assert outcome.startswith("refused: declined"), outcome
        assert names == ["keep"]
        r = await run(s, code, session="a")
        outcome, names = eval(r["result"])
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
        msg = eval(r["result"])
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
