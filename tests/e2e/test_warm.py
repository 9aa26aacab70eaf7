"""The `warm` frame (docs/ARCHITECTURE.md, "The hot path"; docs/SECURITY.md #265): when a
`tools/call` line naming a session arrives, the host tells that session's idle worker a run is
coming, before it parses the request, so the worker's code comes back into the caches while the
host works. It must change nothing a session sees, and a worker that stops reading its socket
must not make the host queue more than one of them.

The worker's `warm` is counted by the cells themselves: the worker calls the runner's `warm`
through the module each time, so a cell can wrap it.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import time

import pytest
from conftest import RawServer, shared_tmp_dir, wait_until

USERS = ["root", "nobody"]

COUNT_WARMS = """
import _ironcell_runner as _r
_warm_calls = []
def _counting(run_waiting=False, inner=_r.warm):
    _warm_calls.append(1)
    inner(run_waiting)
_r.warm = _counting
"""


def server(as_user: str) -> RawServer:
    d = shared_tmp_dir()
    state = d / "state"
    state.mkdir(mode=0o777)
    os.chmod(state, 0o777)
    srv = RawServer(d, as_user=as_user, MCP_BRIDGE_STATE_DIR=str(state))
    srv.initialize()
    return srv


def result(srv: RawServer, code: str, session: str) -> dict:
    r = srv.call(code, session=session)
    assert not r.get("isError"), r
    rec = r["structuredContent"]
    assert rec["status"] == "ok", rec
    return rec


@pytest.mark.parametrize("as_user", USERS)
def test_a_warmed_session_sees_nothing_of_the_warm_up(as_user):
    srv = server(as_user)
    try:
        result(srv, COUNT_WARMS + "x = 41\nx", session="s")
        names_before = ast.literal_eval(result(srv, "sorted(globals())", session="s")["result"])
        warms_before = int(result(srv, "len(_warm_calls)", session="s")["result"])
        for _ in range(3):
            time.sleep(0.05)  # idle: each call below is warmed first
            rec = result(srv, "print('out'); x += 1", session="s")
            assert rec["stdout"] == "out\n" and not rec["stderr"], rec
        time.sleep(0.05)
        rec = result(srv, "_, x, sorted(globals()), len(_warm_calls)", session="s")
        last, x, names, warms = ast.literal_eval(rec["result"])
        # `_` is the last value a cell showed, not the warm-up's; the warm-up set no global.
        assert (last, x) == (warms_before, 44)
        assert names == names_before
        assert warms - warms_before == 4, rec  # one per call after a pause, each before its run
    finally:
        srv.close()


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("as_user", USERS)
def test_a_worker_that_stops_reading_gets_one_warm_frame_and_the_host_answers_on(as_user):
    """The worker stops itself (SIGSTOP) after its cell, so the host sees an idle worker that
    reads nothing. 200 `tools/call` lines naming its session (for a tool that does not exist:
    each is answered at once) must all be answered, and the worker must find one `warm` frame
    when it reads again, not 200."""
    srv = server(as_user)
    try:
        pid = int(result(srv, COUNT_WARMS + "import os\nos.getpid()", session="v")["result"])
        result(srv, "import os, signal, threading\n"
                    "threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGSTOP)).start()", session="v")
        assert wait_until(lambda: state_of(pid) == "T", timeout=30, step=0.05)
        first = srv.next_id
        for i in range(200):
            srv.send({"jsonrpc": "2.0", "id": first + i, "method": "tools/call",
                      "params": {"name": "no_such_tool", "arguments": {"session": "v", "code": "1"}}})
        srv.next_id += 200
        answered = set()
        while len(answered) < 200:
            msg = srv.read()
            if "result" in msg or "error" in msg:
                answered.add(msg["id"])
        assert answered == set(range(first, first + 200))
        assert state_of(pid) == "T"
        os.kill(pid, signal.SIGCONT)
        rec = result(srv, "len(_warm_calls)", session="v")
        # The one frame queued while it was stopped, and this call's own if the worker had read
        # that one by the time this call arrived (one per line would be 201).
        assert json.loads(rec["result"]) in (1, 2), rec
    finally:
        srv.close()
