"""The traps of a newcomer's first hour (issue 45), each as the user meets it: a proxied server
that starts slowly (a cold npx/uvx cache), one that fails to start, a broken config, and what
`doctor` says when the state dir falls back.

servers/slow_start.py sleeps before it becomes servers/test_server.py, so the `server/discover`
probe is still unanswered when rmcp gives up on it (after 10 s) and sends `initialize`; the late
answer to the probe then arrives first.
"""

from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import connect, run

pytestmark = pytest.mark.anyio

SLOW_START = Path(__file__).parent / "servers" / "slow_start.py"
# Longer than rmcp's fixed 10 s wait for the probe's answer.
SLOW_SECONDS = "12"


def config(tmp: Path, servers: dict) -> str:
    path = tmp / "servers.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return str(path)


async def test_a_server_slower_than_the_probe_works_on_its_first_call(state_dir, tmp_path):
    servers = {
        # Answers the probe (late) with "method not found", as an older SDK does.
        "slow-legacy": {"command": sys.executable, "args": [str(SLOW_START), SLOW_SECONDS, "--legacy"]},
        # Answers the probe (late) with a discover result, then the initialize that followed it.
        "slow-modern": {"command": sys.executable, "args": [str(SLOW_START), SLOW_SECONDS]},
    }
    async with connect(state_dir, MCP_BRIDGE_CONFIG=config(tmp_path, servers), MCP_BRIDGE_STARTUP_TIMEOUT="60s") as s:
        code = """
pids = [mcp_slow_legacy.pid_sync(), mcp_slow_modern.pid_sync()]
(pids, await runtime.discovered_servers(), sorted(h["server"] for h in await runtime.search_tool_docs("process id")))
"""
        # Both start at once (the `servers` argument starts them before the code runs).
        r = await run(s, code, timeout_s=120, servers=["slow-legacy", "slow-modern"])
        assert not r.is_error, r
        pids, usable, searched = ast.literal_eval(r["result"])
        assert all(isinstance(p["result"], int) and p["result"] > 0 for p in pids), pids
        assert sorted(usable) == ["slow-legacy", "slow-modern"]
        assert "slow-legacy" in searched and "slow-modern" in searched, searched
        info = json.loads((await s.read_resource("system://info")).contents[0].text)
        eras = {srv["name"]: (srv["running"], srv["era"]) for srv in info["mcp"]["servers"]}
        assert eras == {"slow-legacy": (True, "initialize"), "slow-modern": (True, "discover")}, info["mcp"]
        log = (state_dir / "server.log").read_text()
        assert "given up on; ignored" in log, log[-3000:]


async def test_a_server_that_fails_to_start_is_named_with_its_stderr_everywhere_the_model_looks(state_dir, tmp_path):
    servers = {"broken-npx": {"command": sys.executable, "args": [str(SLOW_START), "0", "--fail"]}}
    # At the quietest log level the server's stderr is still kept for the error.
    async with connect(state_dir, MCP_BRIDGE_CONFIG=config(tmp_path, servers), MCP_BRIDGE_LOG_LEVEL="error") as s:
        code = """
import mcp
try:
    mcp_broken_npx.pid_sync()
    called = "no error"
except mcp.ServerUnavailableError as e:
    called = str(e)
hits = runtime.search_tool_docs_sync("pid")
(called, list(runtime.discovered_servers_sync(detailed=True)), hits.unavailable, list(runtime.discovered_servers_sync()))
"""
        r = await run(s, code, timeout_s=60)
        called, detailed, unavailable, usable = ast.literal_eval(r["result"])
        assert 'server "broken-npx" failed to start' in called, called
        for said in (called, detailed[0]["error"], unavailable["broken-npx"]):
            assert "npm ERR! 404 Not Found - @example/no-such-server" in said, said
            assert "the last lines of its stderr" in said, said
            # The last lines only: the tail is bounded.
            assert "noise line 29" in said and "noise line 5\n" not in said and "fetching packages" not in said, said
        assert detailed[0]["available"] is False and usable == []
        assert "[ironcell] MCP server 'broken-npx' is unavailable" in r.record.get("stderr", r.text), r


@pytest.mark.parametrize("as_user", ["root", "nobody"])
def test_doctor_reports_the_state_dir_and_tmp_that_serve_uses_when_home_is_unwritable(as_user):
    """`nobody` with a HOME it cannot write: serve falls back to a private dir under the temp
    dir, where sessions cannot have a private /tmp. doctor used to print the unusable dir and
    "private per session"; it must say what serve does."""
    import subprocess
    import tempfile

    from conftest import IRONCELL, PREFIX_FOR_USER, RawServer, TEST_PYTHON

    tmp = Path(tempfile.mkdtemp(prefix="ironcell-doctor-", dir="/tmp"))
    tmp.chmod(0o777)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/proc/ironcell-no-home", "TMPDIR": str(tmp),
           "IRONCELL_PYTHON": TEST_PYTHON, "MCP_BRIDGE_LOG_LEVEL": "warn"}
    doc = subprocess.run([*PREFIX_FOR_USER[as_user], str(IRONCELL), "doctor"], capture_output=True, text=True,
                         env=env, timeout=180)
    uid = 0 if as_user == "root" else 65534
    fallback = tmp / f"ironcell-{uid}"
    assert f"state dir     {fallback}\n" in doc.stdout, doc.stdout
    assert "FALLBACK    /proc/ironcell-no-home/.local/state/ironcell" in doc.stdout, doc.stdout
    tmp_line = next(line for line in doc.stdout.splitlines() if line.startswith("/tmp "))
    srv = RawServer(tmp, as_user=as_user, HOME="/proc/ironcell-no-home", TMPDIR=str(tmp), MCP_BRIDGE_STATE_DIR=None)
    try:
        srv.initialize()
        info = srv.info()
    finally:
        srv.close()
        shutil.rmtree(tmp, ignore_errors=True)
    assert info["state_dir"]["path"] == str(fallback) and info["state_dir"]["fallback"] is True, info["state_dir"]
    assert info["state_dir"]["configured"] == "/proc/ironcell-no-home/.local/state/ironcell"
    # Session dirs beneath /tmp: serve refuses /tmp in sessions, and doctor now says so too.
    assert tmp_line == "/tmp          " + info["sandbox"]["private_tmp"]["in_force"], (tmp_line, info["sandbox"])
    assert tmp_line.startswith("/tmp          fallback:"), tmp_line


async def test_a_broken_config_is_named_to_the_model_and_doctor_is_not_ready(state_dir, tmp_path):
    import subprocess

    from conftest import IRONCELL, server_env, test_home

    cfg = test_home(state_dir) / ".config/mcp-bridge/config.json"
    cfg.parent.mkdir(parents=True)
    # A trailing comma: the whole file is unreadable.
    cfg.write_text('{"mcpServers": {"time": {"command": "uvx", "args": ["mcp-server-time"]},}}\n')
    async with connect(state_dir) as s:
        r = await run(s, "(list(runtime.discovered_servers_sync(detailed=True)), list(runtime.discovered_servers_sync()))")
        detailed, usable = ast.literal_eval(r["result"])
        assert usable == []
        assert [d["name"] for d in detailed] == [str(cfg)], detailed
        assert detailed[0]["available"] is False and "not valid JSON" in detailed[0]["error"], detailed
        assert "Fix it and restart ironcell" in detailed[0]["error"]
        info = json.loads((await s.read_resource("system://info")).contents[0].text)
        assert any("not valid JSON" in p for p in info["mcp"]["problems"]), info["mcp"]
        assert info["state_dir"] == {"path": str(state_dir), "configured": str(state_dir), "fallback": False,
                                     "note": None, "memory_backed": None}, info["state_dir"]
        assert info["local_tools"] == {"loaded": [], "failed": []}
    doc = subprocess.run([str(IRONCELL), "doctor"], capture_output=True, text=True, timeout=180, env=server_env(state_dir))
    assert doc.returncode != 0, doc.stdout
    assert f"mcp config    {cfg}" in doc.stdout and f"  BROKEN      {cfg}: not valid JSON" in doc.stdout, doc.stdout
    assert "verdict       NOT ready: an MCP server configuration it reads is broken" in doc.stdout, doc.stdout
    # Fixed: ready, and the server it names is started and counted.
    cfg.write_text(json.dumps({"mcpServers": {"test-server": {"command": sys.executable,
                                                              "args": [str(SLOW_START.with_name("test_server.py"))]}}}))
    doc = subprocess.run([str(IRONCELL), "doctor"], capture_output=True, text=True, timeout=180, env=server_env(state_dir))
    assert doc.returncode == 0, doc.stdout
    assert '  server      "test-server": started, ' in doc.stdout and "verdict       ready" in doc.stdout, doc.stdout
