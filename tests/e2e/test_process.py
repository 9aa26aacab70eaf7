"""Process model and protocol hygiene, checked from outside with raw JSON-RPC."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import IRONCELL, RawServer, pid_alive, wait_until, server_env, REPO


def worker_and_zygote_pids(srv: RawServer, session: str) -> tuple[int, int]:
    r = srv.call("import os\n(os.getpid(), os.getppid())", session=session)
    return ast.literal_eval(r["structuredContent"]["result"])


def test_stdin_eof_exits_promptly_and_leaves_no_process_behind(state_dir):
    srv = RawServer(state_dir)
    srv.initialize()
    w1, zyg = worker_and_zygote_pids(srv, "one")
    w2, zyg2 = worker_and_zygote_pids(srv, "two")
    assert zyg == zyg2 and w1 != w2
    started = time.monotonic()
    assert srv.close(timeout=5) == 0
    assert time.monotonic() - started < 2.5
    assert wait_until(lambda: not any(pid_alive(p) for p in (w1, w2, zyg)), 3)


def test_sigterm_exits_promptly_and_leaves_no_process_behind(state_dir):
    srv = RawServer(state_dir)
    srv.initialize()
    w, zyg = worker_and_zygote_pids(srv, "one")
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(timeout=2.5)
    assert wait_until(lambda: not pid_alive(w) and not pid_alive(zyg), 3)


def test_the_zygote_has_a_clean_environment_and_one_thread(state_dir):
    token = "ghp_TESTSECRET_1234567890"
    srv = RawServer(state_dir, GITHUB_TOKEN=token)
    srv.initialize()
    worker, zygote = worker_and_zygote_pids(srv, "s")
    with open(f"/proc/{zygote}/environ", "rb") as f:
        zenv = f.read()
    assert token.encode() not in zenv and b"GITHUB_TOKEN" not in zenv
    with open(f"/proc/{zygote}/status") as f:
        assert "Threads:\t1\n" in f.read()
    # The boot script is read from a memfd, not passed on the command line (`ps` stays readable),
    # and the zygote kept no fd beyond the control socket and the extension.
    with open(f"/proc/{zygote}/cmdline", "rb") as f:
        assert len(f.read()) < 300
    for fd in os.listdir(f"/proc/{zygote}/fd"):
        with contextlib.suppress(FileNotFoundError):
            assert "ironcell-boot" not in os.readlink(f"/proc/{zygote}/fd/{fd}")
    r = srv.call("import os\n(dict(os.environ), os.getcwd())", session="s")
    env, cwd = ast.literal_eval(r["structuredContent"]["result"])
    assert "GITHUB_TOKEN" not in env
    assert env["HOME"] == cwd, "the session directory is both HOME and the working directory"
    assert env["HOME"] == env["TMPDIR"] and env["HOME"].endswith("/s")
    assert not any(token in v for v in env.values())
    srv.close()


def test_discover_probe_ids_malformed_input_and_unknown_methods(state_dir):
    srv = RawServer(state_dir)
    srv.send({"jsonrpc": "2.0", "id": 0, "method": "server/discover", "params": {
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientInfo": {"name": "x", "version": "0"},
                  "io.modelcontextprotocol/clientCapabilities": {}}}})
    reply = srv.wait_for(0, timeout=5)
    assert "2026-07-28" in reply["result"]["supportedVersions"]
    srv.send({"jsonrpc": "2.0", "id": "init-1", "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {"somethingNew": {"x": 1}},
        "clientInfo": {"name": "raw", "version": "0"}}})
    assert srv.wait_for("init-1")["result"]["serverInfo"]["name"] == "ironcell"
    srv.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    srv.send_line(b"{this is not json")
    srv.send_line(b"\xff\xfe invalid utf-8 \xc3")
    srv.send_line(b'{"jsonrpc": "2.0", "id": 7, "method": 12}')
    r = srv.request("no/such/method", {})
    assert r["error"]["code"] == -32601
    r = srv.request("tools/call", {"name": "run_python", "arguments": {"code": "'ok'"}})
    assert r["result"]["structuredContent"]["result"] == "'ok'"
    assert srv.close() == 0


def test_cancelled_notification_interrupts_the_run_and_keeps_the_session(state_dir):
    srv = RawServer(state_dir)
    srv.initialize()
    srv.call("kept = 'yes'")
    srv.send({"jsonrpc": "2.0", "id": "long", "method": "tools/call",
              "params": {"name": "run_python", "arguments": {"code": "while True: pass", "timeout_s": 60}}})
    time.sleep(1)
    srv.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "long"}})
    started = time.monotonic()
    r = srv.call("kept")  # waits for the session, so it only returns once the loop stopped
    assert time.monotonic() - started < 10
    assert r["structuredContent"]["result"] == "'yes'"
    assert r["structuredContent"]["session_state"] == "kept"
    srv.close()


def test_a_run_cancelled_while_it_waits_for_its_session_never_runs(state_dir):
    """A call to a busy session waits for the run before it; cancelled meanwhile, it leaves the
    queue (before, it ran once its turn came, after the client had given up on it)."""
    srv = RawServer(state_dir)
    srv.initialize()
    srv.call("n = 0")
    srv.send({"jsonrpc": "2.0", "id": "first", "method": "tools/call",
              "params": {"name": "run_python", "arguments": {"code": "import time\ntime.sleep(3)\nn += 1"}}})
    time.sleep(0.5)
    srv.send({"jsonrpc": "2.0", "id": "queued", "method": "tools/call",
              "params": {"name": "run_python", "arguments": {"code": "n += 100"}}})
    time.sleep(0.5)
    srv.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "queued"}})
    r = srv.call("n")  # waits for the session: after the first run, and the queued one if it ran
    assert r["structuredContent"]["result"] == "1", r
    srv.close()


def test_a_10_mb_code_string_is_refused_with_an_error_result(state_dir):
    srv = RawServer(state_dir)
    srv.initialize()
    r = srv.call("x = '" + "a" * (10 * 1024 * 1024) + "'")
    assert r["isError"] and "limit" in r["content"][0]["text"]
    assert srv.call("2 * 21")["structuredContent"]["result"] == "42"
    srv.close()


def test_the_strict_e2e_client_passes_in_every_mode(state_dir):
    """The harness's strict third-party client: framing, ids, ping, cancel, shutdown, orphans."""
    import sys

    cmd = [sys.executable, str(REPO / "tests" / "tools" / "e2e_client.py"), "--mode", "raw,sdk,sdk-legacy",
           "--expect-tool", "run_python",
           "--call", "run_python", '{"code": "n = 20"}',
           "--call", "run_python", '{"code": "n * 2 + 2"}',
           "--call-expect-error", "run_python", '{"code": "raise ValueError(1)"}',
           "--call-cancel", "run_python", '{"code": "while True: pass"}', "1",
           "--list-resources", "--read-resource", "system://info",
           "--env", f"MCP_BRIDGE_STATE_DIR={state_dir}", "--", str(IRONCELL)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    report = json.loads(p.stdout)
    assert p.returncode == 0, json.dumps([(r["mode"], r["protocol_errors"], r["expectation_failures"]) for r in report["runs"]])
    raw = next(r for r in report["runs"] if r["mode"] == "raw")
    assert raw["calls"][1]["result"]["structuredContent"]["result"] == "42"
    assert raw["shutdown"]["how"] == "exited-on-stdin-eof"


def test_exec_prints_the_result_and_sets_the_exit_status(state_dir):
    env = server_env(state_dir)
    p = subprocess.run([str(IRONCELL), "exec", "print('hi')\n6 * 7"], capture_output=True, text=True, env=env, timeout=30)
    assert p.returncode == 0 and p.stdout == "hi\n=> 42\n", p
    p = subprocess.run([str(IRONCELL), "exec", "-"], input="1/0", capture_output=True, text=True, env=env, timeout=30)
    assert p.returncode == 1 and "ZeroDivisionError" in p.stdout


def test_demo_shows_output_state_an_error_and_a_timeout(state_dir):
    p = subprocess.run([str(IRONCELL), "demo"], capture_output=True, text=True, env=server_env(state_dir), timeout=60)
    assert p.returncode == 0, p.stderr
    for expected in ("=> 42", "area of a circle of radius 2: 12.566", "ZeroDivisionError", "timeout after", "=> 20", "'awaited'",
                     "PermissionError: Permission denied", "PermissionError: Operation not permitted"):
        assert expected in p.stdout, expected


def test_help_explains_each_command():
    p = subprocess.run([str(IRONCELL), "--help"], capture_output=True, text=True)
    for word in ("serve", "exec", "demo", "--timeout", "MCP_BRIDGE_TIMEOUT"):
        assert word in p.stdout
    assert "__zygote" not in p.stdout


def test_preloaded_modules_are_ready_in_every_session_and_the_zygote_stays_single_threaded(state_dir):
    srv = RawServer(state_dir, IRONCELL_PRELOAD="numpy,pandas,matplotlib.pyplot,no_such_module")
    srv.initialize()
    r = srv.call("import sys, os\n(sorted(m for m in ('numpy', 'pandas', 'matplotlib.pyplot') if m in sys.modules), os.getppid())")
    loaded, zygote = ast.literal_eval(r["structuredContent"]["result"])
    if not loaded:
        pytest.skip("numpy/pandas/matplotlib are not installed for this Python")
    assert loaded == ["matplotlib.pyplot", "numpy", "pandas"]
    with open(f"/proc/{zygote}/status") as f:
        assert "Threads:\t1\n" in f.read()
    # The boot script is read from a memfd, not passed on the command line (`ps` stays readable),
    # and the zygote kept no fd beyond the control socket and the extension.
    with open(f"/proc/{zygote}/cmdline", "rb") as f:
        assert len(f.read()) < 300
    for fd in os.listdir(f"/proc/{zygote}/fd"):
        with contextlib.suppress(FileNotFoundError):
            assert "ironcell-boot" not in os.readlink(f"/proc/{zygote}/fd/{fd}")
    r = srv.call("import numpy as np\nfloat(np.arange(10).sum())", session="other")
    assert r["structuredContent"]["result"] == "45.0"
    srv.close()


def test_session_dirs_of_a_server_that_died_are_removed_at_start(state_dir):
    stale = state_dir / "sessions-4000000"  # above the kernel's pid limit: never a live process
    (stale / "default").mkdir(parents=True)
    (stale / "default" / "left-behind.txt").write_text("x")
    srv = RawServer(state_dir)
    srv.initialize()
    assert srv.call("1")["structuredContent"]["result"] == "1"
    assert not stale.exists()
    srv.close()
