"""run_python end to end through the official MCP Python SDK, against the real binary."""

from __future__ import annotations

import ast
import time

import anyio
import pytest

from conftest import Run, connect, run

pytestmark = pytest.mark.anyio


async def test_sdk2_client_with_discover_probe_runs_code_and_keeps_state(state_dir):
    """mcp.Client(mode="auto") sends server/discover first; ironcell must answer at once."""
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client

    from conftest import IRONCELL, server_env

    params = StdioServerParameters(command=str(IRONCELL), args=[], env=server_env(state_dir))
    started = time.monotonic()
    with open(state_dir / "log", "w") as errlog:
        async with Client(stdio_client(params, errlog=errlog), mode="auto") as c:
            # A server that ignored the probe would stall the client for 10 s.
            assert time.monotonic() - started < 8
            assert c.server_info.name == "ironcell"
            tools = await c.list_tools()
            assert [t.name for t in tools.tools] == ["run_python", "run_python_job"]
            r = await run(c, "counter = 41")
            assert not r.is_error
            r = await run(c, "counter += 1\ncounter")
            assert r["result"] == "42"


async def test_stdout_stderr_and_the_last_expression_come_back_separately(state_dir):
    async with connect(state_dir) as s:
        r = await run(s, "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n{'a': 1}")
        assert not r.is_error
        assert r["status"] == "ok"
        assert r["stdout"] == "to stdout\n"
        assert r["stderr"] == "to stderr\n"
        assert r["result"] == "{'a': 1}"
        assert "to stdout" in r.text and "=> {'a': 1}" in r.text and "[stderr]" in r.text
        assert isinstance(r["duration_ms"], float)


async def test_writes_to_fd_1_and_from_c_are_captured_and_never_reach_the_protocol_stream(state_dir):
    code = (
        "import os, sys, ctypes\n"
        "os.write(1, b'not json on fd 1\\n')\n"
        "os.write(2, b'raw fd 2\\n')\n"
        "sys.__stdout__.write('dunder stdout\\n')\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.printf(b'from C printf\\n'); libc.fflush(None)\n"
    )
    async with connect(state_dir) as s:
        r = await run(s, code)
        assert not r.is_error, r
        for piece in ("not json on fd 1", "dunder stdout", "from C printf"):
            assert piece in r["stdout"]
        assert "raw fd 2" in r["stderr"]
        # The session (and the JSON-RPC stream) still works afterwards.
        assert (await run(s, "1 + 1"))["result"] == "2"


async def test_an_exception_is_an_error_result_with_a_short_traceback(state_dir):
    async with connect(state_dir) as s:
        r = await run(s, "def f(x):\n    return 1 / x\n\nf(0)")
        assert r.is_error
        assert r["status"] == "error"
        assert r["error"]["type"] == "ZeroDivisionError"
        assert 'File "<cell>", line 2, in f' in r["error"]["traceback"]
        assert "_ironcell_runner" not in r["error"]["traceback"]
        r = await run(s, "def broken(:\n  pass")
        assert r.is_error and r["error"]["type"] == "SyntaxError"


async def test_top_level_await_works(state_dir):
    async with connect(state_dir) as s:
        r = await run(s, "import asyncio\nasync def twice(x):\n    await asyncio.sleep(0.01)\n    return 2 * x\nawait asyncio.gather(twice(1), twice(2))")
        assert r["result"] == "[2, 4]", r
        r = await run(s, "q = asyncio.Queue()\nawait q.put(5)\nawait q.get()")
        assert r["result"] == "5", r


async def test_globals_imports_and_files_persist_within_a_session(state_dir):
    async with connect(state_dir) as s:
        await run(s, "import json\nstate = {'n': 1}\nopen('notes.txt', 'w').write('kept')")
        r = await run(s, "state['n'] += 1\n(json.dumps(state), open('notes.txt').read())")
        assert r["result"] == "('{\"n\": 2}', 'kept')"


async def test_globals_with_hostile_attribute_hooks_do_not_break_later_runs(state_dir):
    """After each cell the runner looks through the globals (functions it must remember,
    coroutines never awaited); objects whose `__getattr__` raises, or pretends to be a
    function, must be left alone."""
    code = """
class Hostile:
    def __getattr__(self, name):
        raise RuntimeError(f"no attribute lookups here: {name}")
class Pretender:
    __code__ = property(lambda self: 1 / 0)
h, p = Hostile(), Pretender()
def f():
    return 41
'defined'
"""
    async with connect(state_dir) as s:
        r = await run(s, code)
        assert r["status"] == "ok" and r["result"] == "'defined'", r.record
        r = await run(s, "f() + 1")
        assert r["status"] == "ok" and r["result"] == "42", r.record


async def test_sessions_are_separate_processes_with_separate_files(state_dir):
    async with connect(state_dir) as s:
        a = await run(s, "import os\nsecret = 'a'\nopen('mine.txt','w').write('a')\n(os.getpid(), os.getcwd())", session="alpha")
        b = await run(s, "import os\n(os.getpid(), os.getcwd(), os.path.exists('mine.txt'))", session="beta")
        pid_a, cwd_a = ast.literal_eval(a["result"])
        pid_b, cwd_b, sees_file = ast.literal_eval(b["result"])
        assert pid_a != pid_b and cwd_a != cwd_b and not sees_file
        r = await run(s, "secret", session="beta")
        assert r.is_error and r["error"]["type"] == "NameError"


async def test_system_exit_is_reported_and_the_session_is_kept(state_dir):
    async with connect(state_dir) as s:
        await run(s, "x = 'still here'")
        r = await run(s, "raise SystemExit(3)")
        assert r.is_error and r["status"] == "exit" and r["exit_code"] == 3
        assert "SystemExit(3)" in r.text
        assert (await run(s, "x"))["result"] == "'still here'"


async def test_os_exit_loses_the_session_and_the_next_run_says_so(state_dir):
    async with connect(state_dir) as s:
        await run(s, "x = 1")
        r = await run(s, "import os\nos._exit(1)")
        assert r.is_error and r["status"] == "crashed"
        assert "exited with status 1" in r["error"]["message"]
        assert r["session_state"] == "lost"
        r = await run(s, "x")
        assert r["error"]["type"] == "NameError"
        assert r["session_state"] == "restarted"
        assert any("previous worker was lost" in n for n in r["notices"]), r


async def test_a_segfault_is_reported_and_the_server_keeps_serving(state_dir):
    async with connect(state_dir) as s:
        r = await run(s, "import ctypes\nctypes.string_at(0)")
        assert r["status"] == "crashed"
        assert "SIGSEGV" in r["error"]["message"]
        assert (await run(s, "'alive'"))["result"] == "'alive'"


async def test_timeouts_interrupt_the_code_and_keep_the_session(state_dir):
    async with connect(state_dir) as s:
        await run(s, "kept = True")
        r = await run(s, "import time\nprint('before')\ntime.sleep(10**6)", timeout_s=1)
        assert r.is_error and r["status"] == "timeout" and r["session_state"] == "kept"
        assert r["stdout"] == "before\n"
        assert "timeout after" in r.text
        r = await run(s, "while True: pass", timeout_s=1)
        assert r["status"] == "timeout" and r["session_state"] == "kept"
        assert (await run(s, "kept"))["result"] == "True"


async def test_code_that_ignores_the_interrupt_is_killed_after_the_grace_period(state_dir):
    async with connect(state_dir, IRONCELL_INTERRUPT_GRACE="500ms") as s:
        await run(s, "x = 1")
        code = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass"
        r = await run(s, code, timeout_s=1)
        assert r["status"] == "timeout" and r["session_state"] == "lost", r
        r = await run(s, "x")
        assert r["error"]["type"] == "NameError"
        assert r["notices"], r


async def test_timeout_settings_accept_both_spellings_and_are_clamped(state_dir):
    async with connect(state_dir, MCP_BRIDGE_TIMEOUT="1", MCP_BRIDGE_MAX_TIMEOUT="2s") as s:
        r = await run(s, "import time\ntime.sleep(30)")
        assert r["status"] == "timeout" and r["duration_ms"] < 10_000
        r = await run(s, "1", timeout_s=100)
        assert r["result"] == "1"
        assert any("maximum" in n for n in r["notices"]), r


async def test_large_output_keeps_head_and_tail_and_the_whole_is_saved(state_dir):
    async with connect(state_dir) as s:
        r = await run(s, "for i in range(100_000):\n    print(f'line {i}')")
        assert r["status"] == "ok", r.text[:500]
        cut = r["stdout_truncated"]
        assert cut["file_complete"] and cut["total_bytes"] > 1_000_000
        assert r["stdout"].startswith("line 0\n") and r["stdout"].rstrip().endswith("line 99999")
        assert len(r.text) < 40_000
        assert cut["file"] in r.text
        check = await run(s, f"data = open({cut['file']!r}).read().splitlines()\n(len(data), data[0], data[-1])")
        assert check["result"] == "(100000, 'line 0', 'line 99999')"


async def test_a_100_mb_print_stops_at_the_output_limit_and_the_server_keeps_serving(state_dir):
    async with connect(state_dir) as s:
        await run(s, "y = 7")
        r = await run(s, "print('x' * 10**8)")
        assert r.is_error and r["status"] == "output_limit", r.text[:500]
        assert "output limit" in r.text
        assert not r["stdout_truncated"]["file_complete"]
        assert len(r.text) < 40_000
        assert (await run(s, "y"))["result"] == "7"


async def test_an_endless_print_loop_ends_with_output_limit(state_dir):
    async with connect(state_dir, IRONCELL_MAX_OUTPUT="1m") as s:
        await run(s, "w = 1")
        r = await run(s, "while True:\n    print('spam')")
        assert r["status"] == "output_limit", r.text[:300]
        assert r["session_state"] == "kept"


async def test_bad_arguments_are_clear_error_results_and_nothing_breaks(state_dir):
    async with connect(state_dir) as s:
        cases = [
            ({"code": 5}, "`code` must be a string"),
            ({}, "missing required argument `code`"),
            ({"code": "1", "timeout_s": "ten"}, "`timeout_s` must be a number"),
            ({"code": "1", "session": "../../etc"}, "invalid session name"),
            ({"code": "1", "reset": "please"}, "`reset` must be true or false"),
            ({"code": "x" * (10 * 1024 * 1024)}, "the limit is"),
        ]
        for args, expected in cases:
            r = Run(await s.call_tool("run_python", args))
            assert r.is_error and expected in r.text, (args.keys(), r.text)
        r = Run(await s.call_tool("no_such_tool", {}))
        assert r.is_error and "run_python" in r.text
        assert (await run(s, "'fine'"))["result"] == "'fine'"


async def test_reset_starts_the_session_over(state_dir):
    async with connect(state_dir) as s:
        await run(s, "v = 1\nopen('f.txt','w').write('x')")
        r = await run(s, "import os\n('v' in globals(), os.path.exists('f.txt'))", reset=True)
        assert r["result"] == "(False, False)"
        assert any("reset" in n for n in r["notices"])


async def test_output_modes_toon_and_json(state_dir):
    import json

    async with connect(state_dir, MCP_BRIDGE_OUTPUT_MODE="toon") as s:
        r = await run(s, "print('hi')\n42")
        assert "status: ok" in r.text and 'stdout: "hi\\n"' in r.text and 'result: "42"' in r.text
        assert r["result"] == "42"
    async with connect(state_dir, MCP_BRIDGE_OUTPUT_MODE="json") as s:
        r = await run(s, "print('hi')\n42")
        assert json.loads(r.text)["result"] == "42"


async def test_past_the_session_cap_the_least_recently_used_idle_session_is_evicted(state_dir):
    async with connect(state_dir, IRONCELL_MAX_SESSIONS="2") as s:
        await run(s, "a = 1", session="a")
        await run(s, "b = 1", session="b")
        await run(s, "c = 1", session="c")  # evicts "a", the least recently used
        assert (await run(s, "b", session="b"))["result"] == "1"
        r = await run(s, "a", session="a")
        assert r["error"]["type"] == "NameError"
        assert any("make room" in n for n in r["notices"]), r


async def test_when_every_session_is_busy_a_new_one_is_refused(state_dir):
    async with connect(state_dir, IRONCELL_MAX_SESSIONS="1") as s:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, s, "import time\ntime.sleep(3)", )
            await anyio.sleep(1)
            r = await run(s, "1", session="other")
            assert r.is_error and "busy" in r.text


async def test_idle_sessions_expire(state_dir):
    async with connect(state_dir, IRONCELL_SESSION_TTL="1s") as s:
        await run(s, "z = 1\nopen('f','w').write('1')")
        await anyio.sleep(3.5)
        r = await run(s, "import os\n('z' in globals(), os.path.exists('f'))")
        assert r["result"] == "(False, False)"
        assert any("expired" in n for n in r["notices"]), r


async def test_system_info_resource(state_dir):
    import json

    async with connect(state_dir) as s:
        listed = await s.list_resources()
        assert "system://info" in [str(r.uri) for r in listed.resources]
        info = await s.read_resource("system://info")
        data = json.loads(info.contents[0].text)
        assert data["python"]["version"].startswith("3.")
        assert data["limits"]["default_timeout_s"] == 30.0
        assert data["memory"]["total_bytes"] > 0 and data["kernel"]
