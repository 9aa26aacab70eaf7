"""The proxy, end to end: sandboxed Python calling real MCP servers through ironcell.

Peers: the npm/PyPI reference servers installed by scripts/install_test_peers.sh, and
servers/test_server.py (official Python SDK) for crashes, hangs, secrets and big answers.
"""

from __future__ import annotations

import ast
import json
import sys
import time
from pathlib import Path

import anyio
import pytest

from conftest import HARNESS, connect, run

pytestmark = pytest.mark.anyio

TEST_SERVER = Path(__file__).parent / "servers" / "test_server.py"
TOKEN = "tok_IRONCELL_UPSTREAM_SECRET_42424242"


def proxied_config(tmp: Path, extra: dict | None = None) -> Path:
    base = json.loads((HARNESS / "proxied_servers.json").read_text())["mcpServers"]
    servers = {k: base[k] for k in ("everything", "filesystem", "memory", "time")}
    servers["memory"] = dict(servers["memory"], env={"MEMORY_FILE_PATH": str(tmp / "memory.jsonl")})
    servers["test-server"] = {
        "command": sys.executable,
        "args": [str(TEST_SERVER)],
        "env": {"SECRET_TOKEN": "${IRONCELL_TEST_TOKEN}"},
        "description": "ironcell's own test server",
    }
    servers["hangs"] = {"command": sys.executable, "args": [str(TEST_SERVER), "--hang-at-start"]}
    servers.update(extra or {})
    path = tmp / "servers.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def proxy_env(tmp: Path, **extra: str) -> dict[str, str]:
    return {
        "MCP_BRIDGE_CONFIG": str(proxied_config(tmp)),
        "IRONCELL_TEST_TOKEN": TOKEN,
        "MCP_BRIDGE_STARTUP_TIMEOUT": "20s",
        **extra,
    }


async def test_every_call_style_reaches_the_reference_servers(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        r = await run(s, "await runtime.discovered_servers()")
        assert ast.literal_eval(r["result"]) == ["everything", "filesystem", "hangs", "memory", "test-server", "time"]
        r = await run(s, "[d['identifier'] for d in await runtime.discovered_servers(detailed=True)]")
        assert "mcp_test_server" in r["result"]
        code = """
a = await mcp_everything.get_sum(a=2, b=3)
b = await mcp_servers["everything"].call_tool("get-sum", {"a": 4, "b": 5})
c = await runtime.call_tool("everything", "get-sum", {"a": 1, "b": 1})
from mcp.servers.everything import get_sum
d = await get_sum(a=10, b=20)
e = mcp_everything.get_sum_sync(a=3, b=3)
f = mcp_servers["everything"].call_tool_sync("get-sum", {"a": 0, "b": 7})
g = runtime.call_tool_sync("everything", "get-sum", {"a": 2, "b": 2})
[a, b, c, d, e, f, g]
"""
        r = await run(s, code)
        assert not r.is_error, r.text
        results = ast.literal_eval(r["result"])
        assert results[0] == "The sum of 2 and 3 is 5."
        assert [x.rsplit(" ", 1)[1] for x in results] == ["5.", "9.", "2.", "30.", "6.", "7.", "4."]
        assert [c["tool"] for c in r["upstream_calls"]] == ["get-sum"] * 7
        assert all(c["server"] == "everything" and c["ok"] for c in r["upstream_calls"])


async def test_results_are_unwrapped_as_documented(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        # structuredContent wins; a single JSON text block is parsed; raw=True gives everything.
        r = await run(s, "await mcp_time.get_current_time(timezone='UTC')")
        assert ast.literal_eval(r["result"])["timezone"] == "UTC"
        r = await run(s, "await mcp_test_server.structured(n=4)")
        assert ast.literal_eval(r["result"]) == {"n": 4, "square": 16}
        r = await run(s, "(await mcp_everything.echo(message='hi'), await runtime.call_tool('everything', 'echo', {'message': 'hi'}, raw=True))")
        text, raw = ast.literal_eval(r["result"].replace("false", "False").replace("true", "True"))
        assert text == "Echo: hi" and raw["content"][0]["text"] == "Echo: hi"


async def test_help_and_docs_are_built_from_the_schema(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        r = await run(s, "help(mcp_everything.get_sum)")
        assert "get_sum(*, a: 'float', b: 'float')" in r["stdout"], r["stdout"]
        assert "a (float, required)" in r["stdout"]
        r = await run(s, "await runtime.query_tool_docs('everything', tool='get-sum', detail='full')")
        doc = ast.literal_eval(r["result"])  # one tool asked for: its dict, as the bridge answers
        assert doc["tool"] == "get-sum" and doc["identifier"] == "get_sum" and "inputSchema" in doc
        r = await run(s, "print(runtime.capability_summary())")
        assert "mcp_test_server ('test-server')" in r["stdout"]


async def test_search_ranks_the_obvious_tool_first(state_dir, tmp_path):
    # Search waits for every server's tool list: leave out the one that never starts, so a
    # slow machine only makes the test slower, never wrong.
    env = proxy_env(tmp_path, MCP_BRIDGE_STARTUP_TIMEOUT="120s")
    config = json.loads(Path(env["MCP_BRIDGE_CONFIG"]).read_text())
    del config["mcpServers"]["hangs"]
    Path(env["MCP_BRIDGE_CONFIG"]).write_text(json.dumps(config))
    async with connect(state_dir, **env) as s:
        for query, server, tool in [
            ("sum of two numbers", "everything", "get-sum"),
            ("current time in a timezone", "time", "get_current_time"),
            ("create entities knowledge graph", "memory", "create_entities"),
            ("list directory", "filesystem", "list_directory"),
        ]:
            r = await run(s, f"await runtime.search_tool_docs({query!r}, limit=5)")
            hits = ast.literal_eval(r["result"])
            assert (hits[0]["server"], hits[0]["tool"]) == (server, tool), (query, hits)
            scores = [h["score"] for h in hits]
            assert scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1


async def test_errors_name_what_exists(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        code = """
import mcp
out = {}
for name, call in {
    "server": lambda: mcp_servers["nope"],
    "server_call": lambda: runtime.call_tool_sync("nope", "x"),
    "tool": lambda: mcp_everything.no_such_tool,
    "tool_call": lambda: runtime.call_tool_sync("everything", "no-such-tool"),
    "tool_error": lambda: mcp_test_server.fail_sync(message="boom"),
}.items():
    try:
        call()
        out[name] = "no error"
    except mcp.MCPError as e:
        out[name] = (type(e).__name__, str(e))
out
"""
        r = await run(s, code)
        out = ast.literal_eval(r["result"])
        assert out["server"][0] == "ServerNotFoundError" and "everything, filesystem" in out["server"][1]
        assert out["server_call"][0] == "ServerNotFoundError"
        assert out["tool"][0] == "ToolNotFoundError" and "get_sum" in out["tool"][1]
        assert out["tool_call"][0] == "ToolNotFoundError" and "get-sum" in out["tool_call"][1]
        assert out["tool_error"][0] == "ToolError"


async def test_hostile_names_and_arguments_never_reach_a_command_line(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        code = """
import mcp
names = ["../../bin/sh", "--config=/etc/x", ";id", "${GITHUB_TOKEN}", "everything; id", "$(id)"]
outcomes = []
for n in names:
    try:
        runtime.call_tool_sync(n, "get-sum", {"a": 1, "b": 2})
        outcomes.append("called")
    except mcp.ServerNotFoundError:
        outcomes.append("not found")
echo = [mcp_everything.echo_sync(message=m) for m in ["${IRONCELL_TEST_TOKEN}", "$(id)", "`id`"]]
(outcomes, echo)
"""
        r = await run(s, code)
        outcomes, echo = ast.literal_eval(r["result"])
        assert outcomes == ["not found"] * 6
        assert echo == ["Echo: ${IRONCELL_TEST_TOKEN}", "Echo: $(id)", "Echo: `id`"]


async def test_a_crashing_server_is_reported_and_restarted_on_next_use(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        code = """
import mcp
try:
    mcp_test_server.crash_sync()
    first = "no error"
except mcp.ServerUnavailableError as e:
    first = str(e)
(first, mcp_test_server.get_env_sync(name="SECRET_TOKEN") is not None)
"""
        r = await run(s, code)
        first, second = ast.literal_eval(r["result"])
        assert "exited during the call" in first and "restarts on next use" in first, first
        assert second is True


async def test_a_server_that_never_starts_hits_the_startup_timeout(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path, MCP_BRIDGE_STARTUP_TIMEOUT="2s")) as s:
        code = """
import mcp, time
t = time.monotonic()
try:
    mcp_hangs.anything_sync()
    msg = "no error"
except mcp.ServerUnavailableError as e:
    msg = str(e)
(msg, round(time.monotonic() - t), mcp_everything.get_sum_sync(a=1, b=2))
"""
        r = await run(s, code, timeout_s=30)
        msg, seconds, other = ast.literal_eval(r["result"])
        assert "did not finish starting within 2 s" in msg and seconds <= 10
        assert other == "The sum of 1 and 2 is 3."


async def test_a_huge_answer_is_a_clear_error_and_the_server_recovers(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path, IRONCELL_CALL_TIMEOUT="5s")) as s:
        code = """
import mcp
try:
    mcp_test_server.huge_sync(megabytes=100)
    msg = "no error"
except mcp.ServerUnavailableError as e:
    msg = str(e)
(msg, len(mcp_test_server.huge_sync(megabytes=1)))
"""
        r = await run(s, code, timeout_s=60)
        msg, small = ast.literal_eval(r["result"])
        assert "huge" in msg and ("did not answer" in msg or "limit" in msg), msg
        assert small == 1 << 20


async def test_gathered_calls_run_concurrently(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        await run(s, "await mcp_test_server.sleep(seconds=0)")  # start the server first
        code = """
import asyncio, time
t = time.monotonic()
done = await asyncio.gather(*(mcp_test_server.sleep(seconds=1) for _ in range(10)))
(len(done), time.monotonic() - t)
"""
        r = await run(s, code)
        n, elapsed = ast.literal_eval(r["result"])
        assert n == 10 and elapsed < 5, elapsed  # one after another would take 10 s


async def test_an_answer_that_arrives_between_cells_reaches_its_thread(state_dir, tmp_path):
    """Between cells the worker's main thread reads the session socket itself (a reader thread
    takes over while a cell runs, see worker/inbox.rs): the answer to a call a thread made
    during the cell, arriving after the cell ended, must still reach that thread at once."""
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        await run(s, "mcp_test_server.sleep_sync(seconds=0)")  # start the server first
        code = """
import threading, time
answered, sent = [], threading.Event()
def ask():
    sent.set()
    mcp_test_server.sleep_sync(seconds=0.5)
    answered.append(time.monotonic())
asker = threading.Thread(target=ask, daemon=True)
asker.start()
sent.wait()
time.sleep(0.1)  # the request is on its way to the host while this cell still runs
cell_ends = time.monotonic()
"""
        await run(s, code)
        await anyio.sleep(1.5)
        r = await run(s, "next_cell = time.monotonic()\nasker.join(30)\n(answered, cell_ends, next_cell)")
        answered, cell_ends, next_cell = ast.literal_eval(r["result"])
        assert next_cell - cell_ends > 1.0
        assert len(answered) == 1
        # It came during the pause, not when the next cell started.
        assert cell_ends < answered[0] < next_cell - 0.3, (answered, cell_ends, next_cell)


async def test_a_call_made_between_cells_is_answered_while_the_next_cell_waits_for_it(state_dir, tmp_path):
    """While a cell runs, the worker reads the session socket only once something asked the host
    (worker/inbox.rs); a call a thread sent between cells must still have its answer read while
    the next cell waits for that thread."""
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        await run(s, "mcp_test_server.sleep_sync(seconds=0)")  # start the server first
        code = """
import threading, time
answered = []
def ask():
    time.sleep(0.3)  # after this cell has ended
    mcp_test_server.sleep_sync(seconds=0.5)
    answered.append(time.monotonic())
asker = threading.Thread(target=ask, daemon=True)
asker.start()
"""
        await run(s, code)
        await anyio.sleep(1.0)
        r = await run(s, "asker.join(20)\n(len(answered), asker.is_alive())", timeout_s=60)
        assert r["status"] == "ok" and r["result"] == "(1, False)", r.record


async def test_the_cells_own_blocking_calls_and_its_threads_calls_all_get_their_answers(state_dir, tmp_path):
    """A blocking call made by the cell's own thread while nobody reads the session socket is
    waited for by that thread reading the socket itself (worker/inbox.rs, `MainWait`): answers
    to a thread's calls that arrive meanwhile must reach that thread, a call still open when
    the cell's own call returns must be read by the reader thread (the hand-over), and the
    cell's call must not wait for it."""
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        await run(s, "mcp_test_server.sleep_sync(seconds=0)")  # start the server first
        code = """
import threading, time
stamps = {}
started = threading.Event()
def thread_calls():
    started.set()
    mcp_test_server.sleep_sync(seconds=0.2)
    stamps["thread_short"] = time.monotonic()
    mcp_test_server.sleep_sync(seconds=2)
    stamps["thread_long"] = time.monotonic()
t = threading.Thread(target=thread_calls)
t.start()
started.wait()
mcp_test_server.sleep_sync(seconds=1)
stamps["cell_call"] = time.monotonic()
quick = [mcp_test_server.sleep_sync(seconds=0) for _ in range(20)]
stamps["cell_quick"] = time.monotonic()
t.join(30)
(sorted(stamps, key=stamps.get), len(quick), t.is_alive())
"""
        r = await run(s, code, timeout_s=60)
        assert r["status"] == "ok", r.record
        order, n_quick, alive = ast.literal_eval(r["result"])
        assert (n_quick, alive) == (20, False)
        # The thread's short call was answered while the cell's own call waited, and neither
        # the cell's call nor its quick calls after it waited for the thread's long one.
        assert order == ["thread_short", "cell_call", "cell_quick", "thread_long"], order
        # Only blocking calls from the cell, many of them: every one answered, in order.
        r = await run(s, "[mcp_test_server.sleep_sync(seconds=0) is not None for _ in range(200)].count(True)")
        assert r["status"] == "ok" and r["result"] == "200", r.record


async def test_a_blocking_call_made_by_an_answer_callback_inside_the_cells_own_wait_is_answered(state_dir, tmp_path):
    """While the cell's thread reads the socket for its own blocking call, it also runs the
    callbacks of other answers (the bridge's `submit`); one that makes a blocking call of its
    own must read for it too, not wait for a reader that will never come."""
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        await run(s, "mcp_test_server.sleep_sync(seconds=0)")  # start the server first
        code = """
import _ironcell_bridge, threading, time
got = []
def on_answer(payload):
    got.append(_ironcell_bridge.request("files.changed", "{}"))
def submit_later():
    time.sleep(0.3)  # while the cell's own call below still waits
    _ironcell_bridge.submit("files.changed", "{}", on_answer)
t = threading.Thread(target=submit_later)
t.start()
mcp_test_server.sleep_sync(seconds=1.5)
t.join(10)
time.sleep(0.2)
len(got)
"""
        r = await run(s, code, timeout_s=20)
        assert r["status"] == "ok" and r["result"] == "1", r.record


async def test_a_blocking_call_made_by_an_answer_callback_on_the_reader_thread_is_answered(state_dir, tmp_path):
    """The reader thread runs the callbacks of the answers it reads (the bridge's `submit`); one
    that makes a blocking call must read for it too, and the next cell must start as usual."""
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        code = """
import _ironcell_bridge, time
got = []
def on_answer(payload):
    got.append(_ironcell_bridge.request("files.changed", "{}"))
_ironcell_bridge.submit("files.changed", "{}", on_answer)
for _ in range(200):
    if got:
        break
    time.sleep(0.05)
len(got)
"""
        r = await run(s, code, timeout_s=30)
        assert r["status"] == "ok" and r["result"] == "1", r.record
        r = await run(s, "mcp_test_server.sleep_sync(seconds=0)")
        assert r["status"] == "ok" and r["result"] is not None, dict(r.record)


async def test_a_cell_timed_out_in_its_own_blocking_call_leaves_the_session_working(state_dir, tmp_path):
    """The cell's thread reading its own answer is interrupted by the timeout: the call's late
    answer is read and dropped, and the next cell's calls are answered as usual."""
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        await run(s, "mcp_test_server.sleep_sync(seconds=0)")  # start the server first
        r = await run(s, "mcp_test_server.sleep_sync(seconds=3)", timeout_s=1)
        assert r["status"] == "timeout" and r["session_state"] == "kept", r.record
        r = await run(s, "[mcp_test_server.sleep_sync(seconds=0) is not None for _ in range(5)].count(True)")
        assert r["status"] == "ok" and r["result"] == "5", r.record
        await anyio.sleep(3)  # the first call's answer has come and gone
        r = await run(s, "mcp_test_server.sleep_sync(seconds=0.1) is not None")
        assert r["status"] == "ok" and r["result"] == "True", r.record


async def test_the_upstream_secret_reaches_its_server_and_nothing_else(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        r = await run(s, "mcp_test_server.get_env_sync(name='SECRET_TOKEN')")
        assert ast.literal_eval(r["result"]) == TOKEN  # {"result": text} mirroring the text unwraps to it
        code = f"""
import os, ctypes
libc = ctypes.CDLL(None)
libc.getauxval.restype = ctypes.c_ulong
top = libc.getauxval(31)  # AT_EXECFN: the executable's name, at the very top of the stack
stack = ctypes.string_at(top - 12000, 12000 + len(ctypes.string_at(top)))
needle = {TOKEN[:10]!r} + {TOKEN[10:]!r}
(needle in repr(dict(os.environ)), needle.encode() in stack)
"""
        r = await run(s, code)
        assert r["result"] == "(False, False)", r
        info = await s.read_resource("system://info")
        assert TOKEN not in info.contents[0].text
        tools = await s.list_tools()
        assert TOKEN not in json.dumps([t.model_dump(mode="json") for t in tools.tools])


async def test_servers_argument_prestarts_and_unknown_names_are_noted(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        r = await run(s, "1", servers=["memory", "nope"])
        assert any("nope" in n for n in r["notices"]), r
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = json.loads((await s.read_resource("system://info")).contents[0].text)
            running = {x["name"]: x["running"] for x in info["mcp"]["servers"]}
            if running["memory"]:
                break
            await __import__("anyio").sleep(0.2)
        assert running["memory"] and not running["time"]


async def test_a_malformed_entry_is_reported_and_the_rest_work(state_dir, tmp_path):
    cfg = tmp_path / "cfg.json"
    base = json.loads((HARNESS / "proxied_servers.json").read_text())["mcpServers"]
    cfg.write_text(json.dumps({"servers": {"everything": base["everything"], "broken": {"args": ["x"]}}}))
    async with connect(state_dir, MCP_BRIDGE_CONFIG=str(cfg)) as s:
        info = json.loads((await s.read_resource("system://info")).contents[0].text)
        assert any("server \"broken\", field `command`: is missing" in p for p in info["mcp"]["problems"]), info["mcp"]
        r = await run(s, "(await runtime.discovered_servers(), mcp_everything.get_sum_sync(a=1, b=1))")
        assert ast.literal_eval(r["result"]) == (["everything"], "The sum of 1 and 1 is 2.")


async def test_claude_desktop_siblings_are_proxied_but_not_ironcell_itself(state_dir, tmp_path):
    from conftest import IRONCELL

    home = tmp_path / "home"
    (home / ".config" / "Claude").mkdir(parents=True)
    base = json.loads((HARNESS / "proxied_servers.json").read_text())["mcpServers"]
    (home / ".config" / "Claude" / "claude_desktop_config.json").write_text(json.dumps({"mcpServers": {
        "ironcell": {"command": str(IRONCELL), "args": ["serve"]},
        "everything": base["everything"],
    }}))
    async with connect(state_dir, HOME=str(home)) as s:
        r = await run(s, "await runtime.discovered_servers()")
        assert ast.literal_eval(r["result"]) == ["everything"]


async def test_the_official_sdk_stays_importable_beside_the_injected_module(state_dir, tmp_path):
    site = next((HARNESS / "venv" / "lib").glob("python3*/site-packages"))
    policy = (Path(__file__).parents[2] / "sandbox-policy" / "default.toml").read_text()
    policy = policy.replace('read_only = [\n', f'read_only = [\n  "{site}",\n  "{Path(sys.base_prefix).resolve()}",\n', 1)
    pfile = tmp_path / "policy.toml"
    pfile.write_text(policy)
    async with connect(state_dir, IRONCELL_POLICY=str(pfile)) as s:
        code = f"""
import sys, mcp
sys.path.append({str(site)!r})
mcp.__path__[:] = mcp._sdk_dirs()
import mcp.types
(hasattr(mcp, 'runtime'), mcp.types.Tool.__name__)
"""
        r = await run(s, code)
        assert r["result"] == "(True, 'Tool')", r.text


async def test_the_tool_cache_refreshes_on_tools_list_changed(state_dir, tmp_path):
    async with connect(state_dir, **proxy_env(tmp_path)) as s:
        code = """
import mcp, time
before = [t["name"] for t in runtime.list_tools_sync("test-server")]
mcp_test_server.add_tool_sync(name="fresh_tool")
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    after = [t["name"] for t in runtime.list_tools_sync("test-server")]
    if "fresh_tool" in after:
        break
    time.sleep(0.05)
("fresh_tool" in before, "fresh_tool" in after, runtime.call_tool_sync("test-server", "fresh_tool"))
"""
        r = await run(s, code)
        assert r["result"] == "(False, True, 'fresh_tool')", r.text


def test_proxied_servers_stop_when_ironcell_exits(state_dir, tmp_path):
    from conftest import RawServer, pid_alive, wait_until

    srv = RawServer(state_dir, **proxy_env(tmp_path))
    srv.initialize()
    r = srv.call("mcp_test_server.pid_sync()")["structuredContent"]
    upstream = int(ast.literal_eval(r["result"])["result"])
    assert pid_alive(upstream)
    assert srv.close(timeout=5) == 0
    assert wait_until(lambda: not pid_alive(upstream), 5)
