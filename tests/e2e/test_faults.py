"""Faults and a hostile worker, seen from the host: SECURITY.md cases 51-54.

The worker is the attacker: from inside run_python it writes forged frames onto its own
session socket (fd 3, the one the bridge uses), stops reading answers, or loses its zygote. The
host must kill it and say why, keep every cap, and give the session a fresh worker; other
sessions and the server keep serving. Forged frames are tried as root and as `nobody`.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RawServer, pid_alive, shared_tmp_dir, wait_until

TEST_SERVER = Path(__file__).parent / "servers" / "test_server.py"

FORGE = r'''
import os, struct, json, time
def frame(kind, payload):
    return struct.pack('>I', len(payload) + 1) + kind + payload
def done(**fields):
    msg = {"op": "done", "id": 1, "status": "ok", "result": None, "error": None, "exit_code": None}
    msg.update(fields)
    return frame(b'J', json.dumps(msg).encode())
'''

# (name, bytes the worker writes onto its session socket, what the report must say)
FORGERIES = [
    ("garbage", "b'\\x00\\x00\\x00\\x06Zjunk!'", "a frame of unknown kind 0x5a"),
    ("bad_json", "frame(b'J', b'{not json')", "not a valid message"),
    ("unknown_op", "frame(b'J', b'{\"op\":\"launch\"}')", "not a valid message"),
    ("huge_length", "b'\\xff\\xff\\xff\\xffJ' + b'x' * 100", "a frame the host cannot accept"),
    ("wrong_run_id", "done(id=999999999)", "a `done` frame for run 999999999"),
    # A done frame announcing a 100 MB result: refused at its header, never read or allocated.
    ("100_mb_result",
     "struct.pack('>I', 100_000_030) + b'J{\"op\":\"done\",\"id\":1,\"result\":\"' + b'x' * 1_000_000",
     "a frame the host cannot accept"),
    ("1_mb_result", "done(result='x' * 1_000_000)", "the result is 1000000 characters"),
    ("absolute_image_path",
     "done(images=[{'path': '/etc/passwd', 'mime': 'image/png', 'bytes': 1}])", "is absolute"),
    ("dotdot_image_path",
     "done(images=[{'path': '../../x.png', 'mime': 'image/png', 'bytes': 1}])", "`..` step"),
    ("oversized_image",
     "done(images=[{'path': 'a.png', 'mime': 'image/png', 'bytes': 1, 'data': 'A' * 4_000_000}])",
     "the budget (IRONCELL_IMAGE_BUDGET)"),
    ("ready_mid_run", "frame(b'J', b'{\"op\":\"ready\",\"pid\":1}')", "a `ready` message in the middle of a run"),
    ("bad_method", "frame(b'J', b'{\"op\":\"request\",\"id\":1,\"method\":\"../x\",\"params\":{}}')",
     "invalid method name"),
    # 2.2 MB of zeros: the host would hold ~75 MB parsed; refused before it is parsed.
    ("million_values",
     "frame(b'J', b'{\"op\":\"request\",\"id\":1,\"method\":\"memory.list\",\"params\":{\"p\":[' "
     "+ b'0,' * 1_100_000 + b'0]}}')",
     "JSON values"),
]


class Host:
    """A server run as `as_user` in a directory that user can use."""

    def __init__(self, as_user: str = "root", base: Path | None = None, **env: str):
        self.dir = shared_tmp_dir(str(base or "/tmp"))
        (self.dir / "state").mkdir(mode=0o777)
        os.chmod(self.dir / "state", 0o777)
        self.srv = RawServer(self.dir, as_user=as_user, MCP_BRIDGE_STATE_DIR=str(self.dir / "state"), **env)
        self.srv.initialize()

    def run(self, code: str, session: str = "s", **args) -> dict:
        return self.srv.call(code, session=session, **args)["structuredContent"]

    def live_workers(self) -> int:
        r = self.srv.request("resources/read", {"uri": "system://info"})
        return json.loads(r["result"]["contents"][0]["text"])["sessions"]["live_workers"]

    def workers_incl_spares(self) -> int:
        """Session workers plus the pool's waiting spares: every worker the host supervises."""
        r = self.srv.request("resources/read", {"uri": "system://info"})
        info = json.loads(r["result"]["contents"][0]["text"])
        return info["sessions"]["live_workers"] + info["spare_workers"]["waiting"]

    def zygote_pid(self) -> int:
        return ast.literal_eval(self.run("import os\nos.getppid()", session="probe")["result"])

    def worker_pids(self) -> set[int]:
        """The zygote's live children, as the kernel sees them."""
        zygote = self.zygote_pid()
        kids: set[int] = set()
        for task in os.listdir(f"/proc/{zygote}/task"):
            with open(f"/proc/{zygote}/task/{task}/children") as f:
                kids.update(int(p) for p in f.read().split())
        return {p for p in kids if pid_alive(p)}

    def close(self) -> None:
        self.srv.close()


@pytest.fixture(scope="module", params=["root", "nobody"])
def host(request):
    h = Host(request.param)
    yield h
    h.close()


def assert_fresh_after_loss(h: Host, session: str, old_pid: int, cause: str) -> None:
    """The next run in `session` says the state was lost (and why), and runs in a new worker."""
    nxt = h.run("import os\n(os.getpid(), 'x' in globals())", session=session)
    pid, had_x = ast.literal_eval(nxt["result"])
    assert nxt["status"] == "ok" and pid != old_pid and had_x is False, nxt
    assert any(cause in n and "fresh" in n for n in nxt["notices"]), nxt["notices"]


@pytest.mark.parametrize("name,payload,expected", FORGERIES, ids=[f[0] for f in FORGERIES])
def test_51_a_forged_frame_kills_the_worker_and_the_next_run_is_fresh(host, name, payload, expected):
    session = f"forge-{name}"
    before = host.run("import os\nx = 1\nos.getpid()", session=session)
    pid = int(before["result"])
    # After the forgery the cell sleeps: only the host killing it can end the run in time.
    code = FORGE + f"os.write(3, {payload})\ntime.sleep(600)\n"
    rec = host.run(code, session=session, timeout_s=600)
    assert rec["status"] == "crashed", rec
    assert rec["error"]["type"] == "ProtocolViolation", rec
    assert rec["error"]["message"].startswith("protocol violation: "), rec
    assert expected in rec["error"]["message"], rec["error"]["message"]
    assert len(json.dumps(rec)) < 200_000  # nothing the worker claimed came through
    assert not rec.get("images") and rec.get("result") is None
    assert wait_until(lambda: not pid_alive(pid), 5), "the violating worker still runs"
    assert_fresh_after_loss(host, session, pid, "protocol violation")
    # Each violating worker gave its session slot back: the slots held, plus the waiting spares,
    # are the live workers. (Polled: a background worker such as the font-cache builder or a
    # spare being started may come and go meanwhile; a leaked slot never converges.)
    assert wait_until(lambda: host.workers_incl_spares() == len(host.worker_pids()), 30), \
        (host.workers_incl_spares(), host.worker_pids())


def test_51_the_server_keeps_serving_other_sessions_after_forgeries(host):
    assert host.run("21 * 2", session="bystander")["result"] == "42"


def test_118_a_worker_killed_by_a_real_time_signal_is_reported_and_the_others_keep_their_state(host):
    # A real-time signal's exit status made the zygote's waitpid fail after reaping the worker;
    # the zygote ended and took every session's worker with it.
    assert host.run("kept = 'still here'", session="rt-bystander")["status"] == "ok"
    code = "import os, signal\nsignal.signal(signal.SIGRTMIN, signal.SIG_DFL)\nos.kill(os.getpid(), signal.SIGRTMIN)"
    rec = host.run(code, session="rt")
    assert rec["status"] == "crashed" and "SIGRTMIN+0" in rec["error"]["message"], rec
    assert host.run("kept", session="rt-bystander")["result"] == "'still here'"
    assert host.run("1 + 1", session="rt")["result"] == "2"


@pytest.mark.parametrize("as_user", ["nobody", "root-without-resource-caps"])
def test_117_descriptors_a_worker_leaves_in_flight_do_not_stop_new_sessions(as_user):
    """The kernel refuses to pass a descriptor while the sender's uid has more in flight than
    the sender's soft RLIMIT_NOFILE (CAP_SYS_RESOURCE exempts). A worker that sent descriptors
    to itself and never read them brought that count past 1024 (past 20,000 with racing
    threads), and the host could then hand no new worker its socket (ETOOMANYREFS). `sendmsg`,
    the one call that carries descriptors, is refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        h = Host(as_user)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fill = """
import array, os, socket
a, b = socket.socketpair()
a.setblocking(False)
batch = array.array('i', [os.eventfd(0)] * 253)
sent = 0
try:
    while True:
        a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, batch)])
        sent += 253
except OSError as e:
    stopped = e.errno
KEEP = (a, b)
(sent, stopped)
"""
    try:
        rec = h.run(fill, session="hoarder")
        sent, stopped = ast.literal_eval(rec["result"])
        assert sent == 0 and stopped == errno.EPERM, rec
        for s in ("new-1", "new-2"):
            r = h.srv.call("print('hello')", session=s)
            assert not r["isError"] and r["structuredContent"]["stdout"] == "hello\n", r
        assert h.run("len(KEEP)", session="hoarder")["result"] == "2"
    finally:
        h.close()


def test_51_an_image_the_worker_names_is_linked_only_if_it_is_a_file_in_the_session(host):
    code = r'''
import os
os.makedirs('d', exist_ok=True)
with open('real.png', 'wb') as f:
    f.write(b'\x89PNG\r\n\x1a\n' + b'\0' * 32)
if not os.path.lexists('d/link.png'):
    os.symlink('/etc/hostname', 'd/link.png')
'done'
'''
    rec = host.run(code, session="images")
    assert rec["status"] == "ok", rec
    paths = [i["path"] for i in rec.get("images", [])]
    assert "real.png" in paths and "d/link.png" not in paths, rec["images"]


# ---------------------------------------------------------------------------------------------
# Faults: the zygote, a worker, an upstream dying
# ---------------------------------------------------------------------------------------------

def test_54_after_the_zygote_is_killed_the_next_run_says_state_was_lost_and_runs_fresh(host):
    before = host.run("import os\nx = 1\n(os.getpid(), os.getppid())", session="z")
    worker, zygote = ast.literal_eval(before["result"])
    os.kill(zygote, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(zygote) and not pid_alive(worker), 5)
    started = time.monotonic()
    nxt = host.run("import os\n(os.getpid(), os.getppid(), 'x' in globals(), 6 * 7)", session="z")
    assert time.monotonic() - started < 25  # an answer, not a background job that never ends
    pid, ppid, had_x, value = ast.literal_eval(nxt["result"])
    assert nxt["status"] == "ok" and value == 42 and had_x is False, nxt
    assert pid != worker and ppid != zygote
    assert nxt["session_state"] == "restarted", nxt
    assert any("zygote" in n and "lost" in n for n in nxt["notices"]), nxt["notices"]
    # The session is not stuck busy: it keeps its new state.
    assert host.run("x = 5\nx", session="z")["result"] == "5"
    assert host.run("x", session="z")["result"] == "5"


def test_54_a_run_in_progress_when_the_zygote_dies_finishes_with_a_clear_result(host):
    zygote = host.zygote_pid()
    srv = host.srv
    rid = "mid-run-zygote"
    srv.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": "run_python",
        "arguments": {"code": "import time\nprint('started', flush=True)\ntime.sleep(120)", "session": "zm",
                      "timeout_s": 300}}})
    time.sleep(2)
    os.kill(zygote, signal.SIGKILL)
    r = srv.wait_for(rid, timeout=30)["result"]["structuredContent"]
    assert r["status"] == "crashed" and r["session_state"] == "lost", r
    assert "worker" in r["error"]["message"], r
    nxt = host.run("1 + 1", session="zm")
    assert nxt["status"] == "ok" and nxt["result"] == "2", nxt


def test_a_run_of_many_proxied_calls_with_huge_names_leaves_a_bounded_record(host):
    """The worker chooses a proxied call's server, tool and argument names and how many calls
    it makes. Calls that fail their look-up (no such server) are counted, not listed
    (SECURITY.md #171): the record and the audit line stay small however many there are."""
    code = """
import asyncio
name = "S" * 1000
async def one():
    try:
        await runtime.call_tool(name, "t" * 1000, {"k" * 200 + str(i): i for i in range(40)})
    except Exception:
        pass
await asyncio.gather(*(one() for _ in range(1060)))
"done"
"""
    r = host.run(code, session="many-calls")
    assert r["result"] == "'done'", r
    assert "upstream_calls" not in r and r["upstream_lookups_failed"] == 1060, r
    line = (host.dir / "state" / "audit.jsonl").read_text().splitlines()[-1]
    entry = json.loads(line)
    assert entry["session"] == "many-calls" and entry["upstream_lookups_failed"] == 1060
    assert len(line) < 4_000, len(line)


def test_listing_memories_costs_the_host_what_the_list_holds(host):
    """Metadata is listed with every key, so it is capped at save, and an entry carrying more
    (saved before the cap) is listed without it: a listing stays small, and the host's memory
    does not grow by the entries' values."""
    r = host.run("try:\n    save_memory('big', 1, metadata={'a': [0] * 5000})\nexcept ValueError as e:\n"
                 "    refused = str(e)\nrefused", session="mem")
    assert "metadata" in r["result"] and "4096" in r["result"], r
    # Entries of ~1 MB each (numbers: many times that as parsed JSON) with small metadata.
    r = host.run("for i in range(20):\n    save_memory(f'k{i}', [0] * 400_000, metadata={'i': i})\n'saved'",
                 session="mem")
    assert r["result"] == "'saved'", r
    peak_before = host_peak_rss_mib(host)
    r = host.run("rows = list_memories()\n(len(rows), rows[3]['metadata'], rows[3]['bytes'] > 800_000)",
                 session="mem")
    assert r["result"] == "(20, {'i': 11}, True)", r
    # Parsing the 20 values would take the host hundreds of MiB; the list skips them.
    assert host_peak_rss_mib(host) - peak_before < 64, (peak_before, host_peak_rss_mib(host))


def host_peak_rss_mib(host: Host) -> float:
    with open(f"/proc/{host.srv.proc.pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 1024


def hold_deleted_space(files: int, start: str, end: str) -> str:
    """A cell that holds `files` x 200 MiB in files it deletes at once, each kept alive by a
    4 KiB `mmap` in `maps` (no fd, no name: the scratch quota cannot see them). Each is
    deleted before it is filled (`posix_fallocate` writes the blocks: seccomp answers the
    fallocate call EOPNOTSUPP), so a worker stopped while it fills leaves no named file."""
    return f"""
import os, mmap
{start}
for i in range({files}):
    fd = os.open(f"held{{i}}", os.O_RDWR | os.O_CREAT)
    os.unlink(f"held{{i}}")
    os.posix_fallocate(fd, 0, 200 << 20)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
{end}
"""


@contextlib.contextmanager
def own_disk(mib: int):
    """A file system of `mib` MiB that only this test writes to (a tmpfs), for the free-disk
    tests: on the shared disk, space that other work frees or takes meanwhile (a finished test's
    workers exiting late, the build) moves the free space these tests set their floor from."""
    d = shared_tmp_dir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0777", "ironcell-test-disk", str(d)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs for a disk of the test's own: {mounted.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "--lazy", str(d)], check=True)
        d.rmdir()


def free(disk: Path) -> int:
    return shutil.disk_usage(disk).free


@pytest.mark.parametrize("as_user", ["root", "nobody"])
def test_space_held_in_deleted_files_is_given_back_when_the_disk_runs_low(as_user):
    """The scratch quota counts the names in a session's directory; a worker can hold disk space
    in files it deleted but kept mapped (no fd, no name). The free-disk guard sees the disk's
    free space fall below IRONCELL_MIN_FREE_DISK, stops the worker (which gives the space back)
    and says why; the session then runs again with its files."""
    with own_disk(1200) as disk:
        floor = free(disk) - (400 << 20)  # the cell takes 800 MiB
        h = Host(as_user, base=disk, IRONCELL_MIN_FREE_DISK=str(floor))
        try:
            h.run("open('kept.txt', 'w').write('mine')\n'ok'", session="hog")
            code = hold_deleted_space(4, "maps = []", "import time\ntime.sleep(120)")
            started = time.monotonic()
            r = h.run(code, session="hog", timeout_s=300)
            assert r["status"] == "scratch_quota", r
            assert "IRONCELL_MIN_FREE_DISK" in json.dumps(r) and time.monotonic() - started < 60, r
            assert wait_until(lambda: free(disk) > floor, timeout=30)
            nxt = {}

            def runs_again() -> bool:
                nxt.update(h.run("open('kept.txt').read()", session="hog"))
                return nxt.get("status") == "ok"

            assert wait_until(runs_again, timeout=10), nxt
            assert nxt["result"] == "'mine'", nxt
        finally:
            h.close()


def test_a_session_that_takes_the_space_back_after_a_stop_is_stopped_again():
    """After a stop the held space comes back while no worker runs; the guard keeps looking
    then, so a new worker that takes it again is stopped again (before, the guard measured from
    the low point and let it hold all of it)."""
    with own_disk(1000) as disk:
        floor = free(disk) - (100 << 20)
        h = Host("root", base=disk, IRONCELL_MIN_FREE_DISK=str(floor))
        fill = hold_deleted_space(3, 'maps = globals().setdefault("maps", [])', "len(maps)")
        try:
            h.run(fill, session="hog")
            assert wait_until(lambda: free(disk) > floor, timeout=10)
            time.sleep(1)
            h.run(fill, session="hog")

            def stopped_again() -> bool:
                return h.run("len(globals().get('maps', []))", session="hog").get("result") == "0"

            assert wait_until(stopped_again, timeout=5)
            assert wait_until(lambda: free(disk) > floor, timeout=10)
        finally:
            h.close()


@pytest.mark.parametrize("as_user", ["root", "nobody"])
def test_a_session_that_takes_the_disk_again_and_again_does_not_stop_the_idle_ones(as_user):
    """The guard stops the workers that were running or writing as the disk fell. A session
    that takes the space and is stopped, round after round, does not stop an idle session's
    worker each time (before, every crossing stopped every worker)."""
    with own_disk(1000) as disk:
        floor = free(disk) - (100 << 20)
        h = Host(as_user, base=disk, IRONCELL_MIN_FREE_DISK=str(floor))
        fill = hold_deleted_space(3, 'maps = globals().setdefault("maps", [])', "len(maps)")
        try:
            assert h.run("x = 1\n'ok'", session="idle")["result"] == "'ok'"
            time.sleep(0.5)  # several of the guard's looks: the idle worker's clock stands still
            for round_no in range(3):
                h.run(fill, session="hog")
                assert wait_until(lambda: free(disk) > floor, timeout=10), round_no
                r = h.run("len(globals().get('maps', []))", session="hog")
                assert r["result"] == "0" and any("IRONCELL_MIN_FREE_DISK" in n for n in r["notices"]), r
                time.sleep(0.5)
            r = h.run("x", session="idle")
            assert r["status"] == "ok" and r["result"] == "1" and not r.get("notices"), r
        finally:
            h.close()


def test_a_disk_already_under_the_floor_at_start_stops_nothing():
    """The guard stops workers when the disk crosses the floor; a disk already under it when the
    server starts was not crossed by anyone, so the first session keeps its worker."""
    with own_disk(256) as disk:
        h = Host("root", base=disk, IRONCELL_MIN_FREE_DISK=str(free(disk) + (100 << 20)))
        try:
            assert h.run("x = 1\n'ok'", session="first")["result"] == "'ok'"
            time.sleep(0.5)  # several of the guard's looks
            r = h.run("x", session="first")
            assert r["status"] == "ok" and r["result"] == "1", r
        finally:
            h.close()


def test_named_files_under_the_floor_lock_no_session_out():
    """Files within the quota can keep the disk under the floor too. The guard stops the writer
    when the disk crosses the floor, every worker when the disk stays low after that (and again
    only if it falls a further 64 MiB), and never refuses runs: one session filling the disk
    within its quota cannot lock the others out."""
    with own_disk(1000) as disk:
        floor = free(disk) - (300 << 20)
        h = Host("root", base=disk, IRONCELL_MIN_FREE_DISK=str(floor))
        try:
            assert h.run("x = 1\n'ok'", session="victim")["result"] == "'ok'"
            code = "import os\nfor i in range(4):\n    fd = os.open(f'big{i}', os.O_RDWR | os.O_CREAT)\n" \
                   "    os.posix_fallocate(fd, 0, 100 << 20)\n    os.close(fd)\n'written'"
            h.run(code, session="filler")
            assert wait_until(lambda: free(disk) < floor)
            # The disk stays low after the filler's stop: every worker is stopped once (the
            # victim's idle one too: it says so)...
            stopped = {}

            def victim_was_stopped() -> bool:
                stopped.update(h.run("'x' in globals()", session="victim"))
                return stopped.get("result") == "False"

            assert wait_until(victim_was_stopped, timeout=5), stopped
            assert any("IRONCELL_MIN_FREE_DISK" in n for n in stopped["notices"]), stopped
            # ...then the sessions run, and keep their state, while the files keep the disk low.
            assert h.run("y = 2\n'ok'", session="victim")["status"] == "ok"
            time.sleep(0.5)
            again = h.run("y", session="victim")
            assert again["status"] == "ok" and again["result"] == "2", again
            assert free(disk) < floor
            cleared = h.run("import os\nsorted(os.listdir('.'))", session="filler", reset=True)
            assert cleared["status"] == "ok" and "big0" not in cleared["result"], cleared
            assert free(disk) > floor
        finally:
            h.close()


def test_a_worker_killed_mid_run_is_reported_and_the_next_run_is_fresh(host):
    pid = int(host.run("import os\nx = 1\nos.getpid()", session="wk")["result"])
    srv = host.srv
    rid = "mid-run-worker"
    srv.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": "run_python", "arguments": {"code": "import time\ntime.sleep(120)", "session": "wk"}}})
    time.sleep(1)
    os.kill(pid, signal.SIGKILL)
    r = srv.wait_for(rid, timeout=30)["result"]["structuredContent"]
    assert r["status"] == "crashed" and "SIGKILL" in r["error"]["message"], r
    assert_fresh_after_loss(host, "wk", pid, "SIGKILL")


# #277: what a cell printed just before its worker died. The worker's output pump reads its
# fd 1 and fd 2 pipes and forwards what it read; whatever it had not read died with the process
# (before: 13-18 of 20 such runs showed the line). The host now holds its own read ends and
# reads what is left once the worker is gone; `os._exit` first lets the pump send what it holds.
DIES_AFTER_PRINTING = {
    "os_exit": "import os, sys\nprint('step 2 done')\nsys.stderr.write('warned\\n')\nos._exit(1)\n",
    "segfault": "import ctypes, sys\nprint('step 2 done')\nsys.stderr.write('warned\\n')\nctypes.string_at(0)\n",
}


@pytest.mark.parametrize("how", DIES_AFTER_PRINTING)
def test_277_what_a_cell_printed_just_before_its_worker_died_is_in_its_result(host, how):
    results = [host.run(DIES_AFTER_PRINTING[how], session=f"dies-{how}-{i}") for i in range(10)]
    assert all(r["status"] == "crashed" for r in results), results
    assert [r["stdout"] for r in results] == ["step 2 done\n"] * 10, [r["stdout"] for r in results]
    assert [r["stderr"] for r in results] == ["warned\n"] * 10, [r["stderr"] for r in results]


def test_277_megabytes_printed_before_os_exit_arrive_whole_and_the_host_keeps_answering(host):
    # Far more than a pipe holds: the pump forwards most of it while the cell writes, the rest
    # (and the chunk the pump held) arrives before the end.
    for i in range(3):
        r = host.run("import os\nos.write(1, b'a' * (3 << 20))\nos._exit(1)\n", session=f"big-{i}")
        assert r["status"] == "crashed", r
        assert r["stdout_truncated"]["total_bytes"] == 3 << 20, r["stdout_truncated"]
        assert host.run("'still here'", session="bystander")["result"] == "'still here'"


@pytest.mark.parametrize("as_user", ["root", "nobody"])
def test_277_what_a_cell_printed_before_the_memory_watch_killed_it_is_in_its_result(as_user):
    from test_sandbox import HIDDEN_MEMORY

    h = Host(as_user, MCP_BRIDGE_MEMORY_LIMIT="256m")
    try:
        for i in range(3):
            r = h.run(HIDDEN_MEMORY + "print('step 2 done')\nhide(24)\nimport time\ntime.sleep(10)\n",
                      session=f"hog-{i}", timeout_s=25)
            assert r["status"] == "crashed" and "killed for holding" in r["error"]["message"], r
            assert r["stdout"] == "step 2 done\n", r
    finally:
        h.close()


# ---------------------------------------------------------------------------------------------
# With a proxied upstream (root only: the harness Python lives under /root)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def proxied():
    cfg_dir = shared_tmp_dir()
    cfg = cfg_dir / "servers.json"
    cfg.write_text(json.dumps({"mcpServers": {
        "test-server": {"command": sys.executable, "args": [str(TEST_SERVER)]},
    }}))
    h = Host("root", MCP_BRIDGE_CONFIG=str(cfg), IRONCELL_WAIT_BUDGET="120s")
    yield h
    h.close()


def test_a_proxied_servers_log_line_of_64_mib_is_skipped_not_held(proxied):
    """A server may log what a worker sent it: the host keeps at most 16 KiB of a line."""
    before = host_peak_rss_mib(proxied)
    rec = proxied.run("await mcp_test_server.log_line(megabytes=64)", session="loud-server")
    assert rec["status"] == "ok", rec
    assert wait_until(lambda: "log line longer than" in (proxied.dir / "raw-server.log").read_text(errors="replace"))
    assert host_peak_rss_mib(proxied) - before < 32, (before, host_peak_rss_mib(proxied))


def test_open_bridge_requests_may_hold_only_so_many_json_values(proxied):
    """Parsed, a request's parameters cost the host tens of bytes per JSON value, and it keeps
    them until the request is answered: a worker's open requests may hold 1,000,000 values in all.
    One past that is answered with an error at once (not held, the worker not killed); the
    open one is answered as usual."""
    code = """
import threading, time, mcp
pad = [0] * 600_000
res = {}
def first():
    res["first"] = mcp._request_sync("call", {"server": "test-server", "tool": "sleep",
                                              "arguments": {"seconds": 3}, "pad": pad})
t = threading.Thread(target=first)
t.start()
time.sleep(1)
try:
    mcp._request_sync("call", {"server": "test-server", "tool": "sleep", "arguments": {"seconds": 0}, "pad": pad})
    second = "answered"
except Exception as e:
    second = f"{type(e).__name__}: {e}"
t.join()
(second, "first" in res)
"""
    rec = proxied.run(code, session="big-params", timeout_s=60)
    assert rec["status"] == "ok", rec
    second, first_answered = ast.literal_eval(rec["result"])
    assert "JSON values" in second and "1000000" in second, second
    assert first_answered
    assert proxied.run("1", session="big-params")["session_state"] != "lost"


def host_threads(host: Host) -> int:
    with open(f"/proc/{host.srv.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


@pytest.mark.parametrize("as_user", ["root", "nobody"])
def test_memory_requests_of_workers_that_died_do_not_pile_up_on_the_host(as_user):
    """Memory requests do their file I/O on the host's blocking threads, which cannot drop a job
    once it started. Before, a worker that sent 64 `memory.list` requests and exited left 64 of
    them queued there, holding their parameters: eight such runs filled the pool's 512 threads,
    and every other session's quota walk, file reads and `load_memory` waited behind them. Now
    a worker's memory requests go one at a time, two in the whole host, and those still waiting
    go with their worker."""
    h = Host(as_user)
    try:
        fill = "from mcp import save_memory\nfor i in range(600):\n    save_memory(f'k{i:04d}', 'x' * 12000)\n'ok'"
        assert h.run(fill, session="fill", timeout_s=120)["status"] == "ok"
        attack = ("import os, threading, time, mcp\n"
                  "for _ in range(64):\n"
                  "    threading.Thread(target=lambda: mcp._request_sync('memory.list', {}), daemon=True).start()\n"
                  "time.sleep(0.3)\n"
                  "os._exit(0)\n")
        peak = host_threads(h)
        for _ in range(8):
            h.run(attack, session="attacker")
            peak = max(peak, host_threads(h))
        # Before: 108-124 threads here (512 with a larger store); now under 10.
        assert peak < 40, f"the host had {peak} threads"
        r = h.run("from mcp import load_memory\nload_memory('k0001')[:3]", session="other", timeout_s=60)
        assert r["status"] == "ok" and r["result"] == "'xxx'", r
    finally:
        h.close()


@pytest.mark.parametrize("as_user", ["root", "nobody"])
def test_a_run_of_many_empty_output_frames_stops_at_the_output_limit(as_user):
    """Frames of no bytes added nothing to the output total, so the limit never stopped a run
    that sent them: the host decoded tens of millions of them, a core busy for the whole run.
    Each output frame now counts 64 bytes at least."""
    h = Host(as_user, IRONCELL_MAX_OUTPUT="1m")
    try:
        code = FORGE + ("empty = frame(b'O', b'') * 4096\n"
                        "while True:\n"
                        "    os.write(3, empty)\n")
        r = h.run(code, session="frames", timeout_s=30)
        assert r["status"] == "output_limit", r
    finally:
        h.close()


def test_52_five_hundred_gathered_calls_complete(proxied):
    code = """
import asyncio
r = await asyncio.gather(*(mcp_test_server.sleep(seconds=0) for _ in range(500)))
(len(r), sum(x["result"] if isinstance(x, dict) else x for x in r))
"""
    rec = proxied.run(code, session="gather", timeout_s=120)
    assert rec["status"] == "ok" and ast.literal_eval(rec["result"]) == (500, 0), (rec.get("error"), rec.get("stderr"))
    assert len(rec["upstream_calls"]) == 500


def test_52_a_timeout_ends_five_hundred_pending_calls_and_the_session_recovers(proxied):
    proxied.run("kept = 'yes'", session="stuck")
    code = """
import asyncio
await asyncio.gather(*(mcp_test_server.sleep(seconds=60) for _ in range(500)))
"""
    started = time.monotonic()
    rec = proxied.run(code, session="stuck", timeout_s=3)
    assert rec["status"] == "timeout", rec
    assert time.monotonic() - started < 30
    nxt = proxied.run("kept", session="stuck")
    assert nxt["status"] == "ok", nxt
    assert nxt["result"] == "'yes'" or nxt["session_state"] in ("restarted", "lost"), nxt


def test_52_a_cancel_ends_five_hundred_pending_calls_and_the_session_recovers(proxied):
    srv = proxied.srv
    rid = "gather-cancel"
    code = "import asyncio\nawait asyncio.gather(*(mcp_test_server.sleep(seconds=60) for _ in range(500)))"
    srv.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": "run_python", "arguments": {"code": code, "session": "cancel", "timeout_s": 300}}})
    time.sleep(2)
    srv.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": rid}})
    started = time.monotonic()
    nxt = proxied.run("'after'", session="cancel")  # queues behind the cancelled run
    assert time.monotonic() - started < 30
    assert nxt["status"] == "ok" and nxt["result"] == "'after'", nxt


def test_52_a_worker_that_stops_reading_answers_cannot_wedge_the_session(proxied):
    # 200 calls with 1 MiB answers, then the cell holds the GIL (a huge switch interval), so the
    # worker's reader thread, which needs the GIL to hand out answers, stops reading: the
    # answers fill the socket and the host's writes to the worker block. Timeout must still
    # work, and the session must recover.
    proxied.run("kept = 'yes'", session="noread")
    code = """
import asyncio, sys
tasks = [asyncio.ensure_future(mcp_test_server.huge(megabytes=1)) for _ in range(200)]
await asyncio.sleep(1)
sys.setswitchinterval(1000)
while True:
    pass
"""
    started = time.monotonic()
    rec = proxied.run(code, session="noread", timeout_s=5)
    assert rec["status"] == "timeout", rec
    assert time.monotonic() - started < 40
    nxt = proxied.run("import sys\nsys.setswitchinterval(0.005)\n(kept, 2 + 3)", session="noread", timeout_s=60)
    assert nxt["status"] == "ok" and ast.literal_eval(nxt["result"]) == ("yes", 5), nxt


def test_52_more_open_requests_than_the_limit_is_a_protocol_violation(proxied):
    code = """
import json, os, struct, time
def frame(kind, payload):
    return struct.pack('>I', len(payload) + 1) + kind + payload
for i in range(65):
    p = {"server": "test-server", "tool": "sleep", "arguments": {"seconds": 60}}
    os.write(3, frame(b'J', json.dumps({"op": "request", "id": 10**6 + i, "method": "call", "params": p}).encode()))
time.sleep(600)
"""
    rec = proxied.run(code, session="flood", timeout_s=600)
    assert rec["status"] == "crashed" and rec["error"]["type"] == "ProtocolViolation", rec
    assert "more than 64 bridge requests open at once" in rec["error"]["message"]
    assert proxied.run("1", session="flood")["status"] == "ok"


def test_53_a_megabyte_search_query_is_refused_and_ping_keeps_answering(proxied):
    code = """
import mcp
try:
    await runtime.search_tool_docs("sleep " * 200_000)
    msg = "no error"
except mcp.MCPError as e:
    msg = str(e)
msg
"""
    srv = proxied.srv
    rid = "big-search"
    srv.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": "run_python", "arguments": {"code": code, "session": "search"}}})
    pong = srv.request("ping", timeout=10)
    assert "result" in pong
    msg = ast.literal_eval(srv.wait_for(rid, timeout=30)["result"]["structuredContent"]["result"])
    assert "1200000 characters" in msg and "limit is 1000" in msg, msg
    hits = ast.literal_eval(proxied.run("await runtime.search_tool_docs('sleep', limit=1)", session="search")["result"])
    assert hits[0]["tool"] == "sleep"


def test_an_upstream_killed_mid_call_is_reported_and_restarted_on_next_use(proxied):
    proxied.run("kept = 1", session="up")
    pid_of_upstream = "r = mcp_test_server.pid_sync()\nr['result'] if isinstance(r, dict) else r"
    upstream = int(proxied.run(pid_of_upstream, session="up")["result"])
    srv = proxied.srv
    rid = "upstream-kill"
    code = """
import mcp
try:
    mcp_test_server.sleep_sync(seconds=60)
    msg = "no error"
except mcp.MCPError as e:
    msg = type(e).__name__ + ": " + str(e)
msg
"""
    srv.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": "run_python", "arguments": {"code": code, "session": "up", "timeout_s": 120}}})
    time.sleep(2)
    os.kill(upstream, signal.SIGKILL)
    r = srv.wait_for(rid, timeout=60)["result"]["structuredContent"]
    assert r["status"] == "ok", r
    assert "ServerUnavailableError" in r["result"], r
    again = proxied.run(pid_of_upstream + "\n", session="up")
    assert again["status"] == "ok" and int(again["result"]) != upstream, again
    assert proxied.run("kept", session="up")["result"] == "1"


def test_a_host_started_with_a_low_open_file_limit_holds_many_sessions():
    """The host holds ~6 descriptors per session; started with a soft limit of 256 (desktops
    often give 1,024), it raises its own limit to the hard one instead of refusing sessions
    past ~35 (~160 at 1,024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        h = Host("root", IRONCELL_MAX_SESSIONS="70")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        for i in range(60):
            rec = h.run(f"{i} * 2", session=f"many-{i}")
            assert rec["status"] == "ok" and rec["result"] == str(i * 2), rec
        assert h.live_workers() >= 60
    finally:
        h.close()
