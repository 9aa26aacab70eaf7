"""How often the proxy asks a server for its tool list (issue 12's regression: a `ttlMs: 0`
server was listed twice per proxied call, ~230 ms per call with 1,000 tools, all serialized).

What a user relies on, counted by the server itself (servers/test_server.py's
`tools_list_count`, no timing): a proxied call goes by the last tool list unless the server
announced a change, concurrent first callers share one list, a name the list lacks is looked up
once more before it is called unknown, and an announced change is seen in either era.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import connect, run

pytestmark = pytest.mark.anyio

TEST_SERVER = str(Path(__file__).parent / "servers" / "test_server.py")

# The server variants: the Python SDK's default (2026-07-28, `ttlMs: 0`), the same with a long
# `ttlMs`, and the handshake era (no `ttlMs`, changes notified on the connection).
SERVERS = {
    "modern": [TEST_SERVER],
    "long_ttl": [TEST_SERVER, "--tools-ttl-ms", "600000"],
    "legacy": [TEST_SERVER, "--legacy"],
}


def cache_env(tmp: Path) -> dict[str, str]:
    config = {"mcpServers": {name: {"command": sys.executable, "args": args} for name, args in SERVERS.items()}}
    path = tmp / "servers.json"
    path.write_text(json.dumps(config))
    return {"MCP_BRIDGE_CONFIG": str(path), "MCP_BRIDGE_STARTUP_TIMEOUT": "20s"}


async def test_each_server_speaks_the_era_the_test_expects(state_dir, tmp_path):
    async with connect(state_dir, **cache_env(tmp_path)) as s:
        r = await run(s, "[mcp_modern.pid_sync(), mcp_long_ttl.pid_sync(), mcp_legacy.pid_sync()]")
        assert r["status"] == "ok", r.text
        info = json.loads((await s.read_resource("system://info")).contents[0].text)
        eras = {x["name"]: x["era"] for x in info["mcp"]["servers"]}
        assert eras == {"modern": "discover", "long_ttl": "discover", "legacy": "initialize"}, eras


@pytest.mark.parametrize("server", ["modern", "legacy"])
async def test_proxied_calls_list_the_tools_once_not_per_call(state_dir, tmp_path, server):
    async with connect(state_dir, **cache_env(tmp_path)) as s:
        code = f"""
import asyncio
first = await asyncio.gather(*(mcp_{server}.structured(n=i) for i in range(40)))
for i in range(40):
    assert mcp_{server}.structured_sync(n=i)["square"] == i * i
more = await asyncio.gather(*(mcp_{server}.structured(n=i) for i in range(40)))
assert [r["square"] for r in first + more] == [i * i for i in range(40)] * 2
mcp_{server}.tools_list_count_sync()["result"]
"""
        r = await run(s, code)
        # 120 calls (40 of them concurrent with an empty cache), then the count itself: one list,
        # fetched by the first callers together. Before the fix: 2 per call.
        assert r["result"] == "1", r.text


async def test_a_tool_added_without_notice_is_found_by_its_first_call(state_dir, tmp_path):
    # The SDK drops `ctx.session.send_tool_list_changed()` at 2026-07-28 (it belongs on a
    # subscriptions/listen stream), so ironcell hears nothing of `add_tool`: the name it does
    # not know makes it list the tools once more, and the call succeeds.
    async with connect(state_dir, **cache_env(tmp_path)) as s:
        code = """
mcp_modern.pid_sync()
before = mcp_modern.tools_list_count_sync()["result"]
mcp_modern.add_tool_sync(name="quiet_tool")
(runtime.call_tool_sync("modern", "quiet_tool"), mcp_modern.tools_list_count_sync()["result"] - before)
"""
        r = await run(s, code)
        assert r["result"] == "('quiet_tool', 1)", r.text


@pytest.mark.parametrize("server, lists", [("modern", 3), ("long_ttl", 0)])
async def test_an_unknown_tool_is_looked_up_in_a_fresh_list_then_named_unknown(state_dir, tmp_path, server, lists):
    async with connect(state_dir, **cache_env(tmp_path)) as s:
        code = f"""
import mcp
mcp_{server}.pid_sync()
before = mcp_{server}.tools_list_count_sync()["result"]
errors = []
for _ in range(3):
    try:
        runtime.call_tool_sync("{server}", "no_such_tool")
    except mcp.ToolNotFoundError as e:
        errors.append(str(e))
(len(errors), "no_such_tool" in errors[0], "structured" in errors[0],
 mcp_{server}.tools_list_count_sync()["result"] - before)
"""
        r = await run(s, code)
        # A `ttlMs: 0` list is stale at once: each unknown name costs one list (the tools may
        # have changed without notice). A list within its `ttlMs` is the answer as it stands.
        # Either way the error names the tools there are, and the known tool costs none.
        assert r["result"] == f"(3, True, True, {lists})", r.text


@pytest.mark.parametrize("server", ["long_ttl", "legacy"])
async def test_an_announced_change_reaches_listing_and_calls(state_dir, tmp_path, server):
    # Neither server's list goes stale by itself (a 10-minute ttlMs; no ttlMs in the handshake
    # era), so only the change notice can show the new tool: on the subscriptions/listen
    # stream for 2026-07-28, on the connection for the handshake era.
    async with connect(state_dir, **cache_env(tmp_path)) as s:
        code = f"""
import time
names = lambda: [t["name"] for t in runtime.list_tools_sync("{server}")]
before = names()
for _ in range(20):
    names()
cached = mcp_{server}.tools_list_count_sync()["result"]
mcp_{server}.add_tool_announced_sync(name="announced_tool")
deadline = time.monotonic() + 10
while "announced_tool" not in names() and time.monotonic() < deadline:
    time.sleep(0.05)
("announced_tool" in before, cached, "announced_tool" in names(),
 runtime.call_tool_sync("{server}", "announced_tool"))
"""
        r = await run(s, code)
        assert r["result"] == "(False, 1, True, 'announced_tool')", r.text


async def test_a_slow_call_does_not_hold_up_the_calls_after_it(state_dir, tmp_path):
    # No timing assert: the 20 calls sent after a 20-second call all come back while it is
    # still running (head-of-line blocking would make them wait for it).
    async with connect(state_dir, **cache_env(tmp_path)) as s:
        code = """
import asyncio
mcp_modern.pid_sync()
slow = asyncio.ensure_future(mcp_modern.sleep(seconds=20))
await asyncio.sleep(0)
fast = await asyncio.gather(*(mcp_modern.structured(n=i) for i in range(20)))
still_running = not slow.done()
slow.cancel()
(still_running, [r["square"] for r in fast] == [i * i for i in range(20)])
"""
        r = await run(s, code)
        assert r["result"] == "(True, True)", r.text


async def test_a_tool_of_a_server_with_a_thousand_tools_is_found_by_name_and_made_once(state_dir, tmp_path):
    """`mcp_<server>.<tool>` finds the tool by name or alias (not by walking the server's list on
    every access, which cost ~1 ms per call to the last of 1,000 tools) and hands back the same
    function each time, so a loop of calls builds its wrapper once."""
    config = {"mcpServers": {"many": {"command": sys.executable,
                                      "args": [TEST_SERVER, "--legacy", "--many-tools", "1000"]}}}
    path = tmp_path / "servers.json"
    path.write_text(json.dumps(config))
    async with connect(state_dir, MCP_BRIDGE_CONFIG=str(path), MCP_BRIDGE_STARTUP_TIMEOUT="20s") as s:
        code = """
last = [t["name"] for t in runtime.list_tools_sync("many")][-1]
f = getattr(mcp_many, last + "_sync")
(last, f is getattr(mcp_many, last + "_sync"), f.__name__, f(x=7).result,
 [getattr(mcp_many, last + "_sync")(x=i).result for i in range(3)],
 mcp_many.structured_sync is mcp_many.structured_sync, mcp_many.structured is not mcp_many.structured_sync)
"""
        r = await run(s, code)
        assert r["result"] == ("('archive_folder_999', True, 'archive_folder_999_sync', 7, [0, 1, 2], True, True)"), r.text
