"""A session's own child processes (docs/SECURITY.md #158-#160): where the kernel's Landlock can
scope signals (ABI 6+), `fork` (never `exec`) is allowed, so process pools run as written; every
child is confined as the worker, inside the session's limits, and dies with the run's timeout or
cancellation and with the session. Attacked from inside, as root and as `nobody`."""

from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import a_thread_runs, pid_alive, wait_until
from test_sandbox import USERS, Sandboxed, forking_sandbox


def children_allowed(b: Sandboxed) -> str:
    info = json.loads(b.srv.request("resources/read", {"uri": "system://info"})["result"]["contents"][0]["text"])
    return info["sandbox"]["child_processes"]


@pytest.fixture(scope="module", params=USERS)
def box(request):
    b = forking_sandbox(request.param)
    yield b
    b.close()


def value(rec: dict):
    assert rec["status"] == "ok", rec
    return ast.literal_eval(rec["result"])


def test_process_pools_and_shared_state_run_as_written(box):
    got = value(box.run(
        "import multiprocessing as mp, concurrent.futures as cf\n"
        "def sq(x):\n    return x * x, os.getpid()\n"
        "with mp.Pool(2) as pool:\n    out = pool.map(sq, range(20))\n"
        "with cf.ProcessPoolExecutor(2) as ex:\n    ppe = list(ex.map(abs, range(-5, 0)))\n"
        "counter, arr, lock = mp.Value('i', 0), mp.Array('d', 4), mp.Lock()\n"
        "def bump(i):\n    with lock:\n        counter.value += 1\n        arr[i] = i * 1.5\n"
        "ps = [mp.Process(target=bump, args=(i,)) for i in range(4)]\n"
        "[p.start() for p in ps]; [p.join() for p in ps]\n"
        "q = mp.Queue(); p = mp.Process(target=q.put, args=('from a child',)); p.start()\n"
        "msg = q.get(timeout=30); p.join()\n"
        "(sum(v for v, _ in out), all(pid != os.getpid() for _, pid in out), ppe, counter.value, list(arr), msg,"
        " [p.exitcode for p in ps], mp.get_start_method())",
        session="pools", timeout_s=120))
    assert got == (2470, True, [5, 4, 3, 2, 1], 4, [0.0, 1.5, 3.0, 4.5], "from a child", [0, 0, 0, 0], "fork")
    # The semaphores and heaps lived in the session's /dev/shm (its directory), now empty of them.
    assert value(box.run("[n for n in os.listdir('/dev/shm') if n.startswith(('sem.', 'pym-'))]", session="pools")) == []


def test_a_child_cannot_act_on_its_parent_another_session_or_the_host(box):
    other = value(box.run("os.getpid()", session="bystander"))
    host = box.srv.proc.pid
    got = value(box.run(
        "import resource, signal\n"
        "parent = os.getpid(); before = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    res = {\n"
        "        'prlimit_parent': outcome(lambda: resource.prlimit(parent, resource.RLIMIT_NOFILE, (16, 16))),\n"
        "        'getsid_parent': outcome(lambda: os.getsid(parent)),\n"
        "        'priority_parent': outcome(lambda: os.getpriority(os.PRIO_PROCESS, parent)),\n"
        f"        'kill_bystander': outcome(lambda: os.kill({other}, signal.SIGKILL)),\n"
        f"        'kill_host': outcome(lambda: os.kill({host}, 0)),\n"
        "        'setsid': outcome(os.setsid),\n"
        "        'setpgid': outcome(lambda: os.setpgid(0, parent)),\n"
        "        'exec': outcome(lambda: os.execv('/bin/true', ['true'])),\n"
        "        'own_limits': outcome(lambda: resource.getrlimit(resource.RLIMIT_NOFILE)),\n"
        "    }\n"
        "    os.write(w, repr(res).encode()); os._exit(0)\n"
        "os.close(w); res = __import__('ast').literal_eval(os.read(r, 65536).decode()); os.wait()\n"
        "(res, before == resource.getrlimit(resource.RLIMIT_NOFILE))",
        session="attacker"))
    res, limits_kept = got
    assert limits_kept
    for name in ("prlimit_parent", "getsid_parent", "priority_parent", "kill_bystander", "kill_host",
                 "setsid", "setpgid", "exec"):
        assert res[name] == "PermissionError:1", (name, res)
    assert res["own_limits"].startswith("ok:")
    assert pid_alive(other) and value(box.run("'still here'", session="bystander")) == "still here"
    # A child cannot signal its parent or a sibling; the parent can signal (terminate) them.
    got = value(box.run(
        "import signal, time\n"
        "def child(r):\n"
        "    k = os.fork()\n"
        "    if k == 0:\n        time.sleep(30); os._exit(0)\n"
        "    return k\n"
        "sib = child(None)\nr, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.write(w, repr((outcome(lambda: os.kill(os.getppid(), 0)), outcome(lambda: os.kill(sib, signal.SIGKILL)))).encode())\n"
        "    os._exit(0)\n"
        "seen = __import__('ast').literal_eval(os.read(r, 4096).decode()); os.wait()\n"
        "os.kill(sib, signal.SIGKILL); _, status = os.waitpid(sib, 0)\n"
        "(seen, os.WIFSIGNALED(status))", session="siblings"))
    assert got == (("PermissionError:1", "PermissionError:1"), True), got
    # SIGKILL to every process it may signal reaches its own session only (Landlock's scope).
    box.run("import signal\nif os.fork() == 0:\n    os.kill(-1, signal.SIGKILL)\n    os._exit(0)\n"
            "import time\ntime.sleep(5)", session="kamikaze", timeout_s=30)
    assert pid_alive(other) and box.srv.proc.poll() is None
    assert value(box.run("'still here'", session="bystander")) == "still here"
    # The start methods that would exec a fresh interpreter fork here instead (no exec).
    got = value(box.run(
        "import multiprocessing as mp\nctx = mp.get_context('spawn'); p = ctx.Process(target=print); p.start(); p.join()\n"
        "(p.exitcode, ctx.get_start_method(), mp.get_context('forkserver').get_start_method())", session="attacker"))
    assert got == (0, "fork", "fork")


def test_a_fork_bomb_stops_at_the_session_cap_and_nothing_else_notices(box):
    info = json.loads(box.srv.request("resources/read", {"uri": "system://info"})["result"]["contents"][0]["text"])
    cap = info["sandbox"]["limits"]["threads"]
    n, err = value(box.run(
        "import time\nn, err = 0, None\n"
        "try:\n"
        "    while n < 5000:\n"
        "        if os.fork() == 0:\n            time.sleep(60); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n    err = errno.errorcode[e.errno]\n"
        "(n, err)", session="bomb", timeout_s=60))
    assert err == "EAGAIN" and 0 < n <= cap, (n, err)
    assert value(box.run("'unaffected'", session="bystander2")) == "unaffected"
    assert subprocess.run(["/bin/true"]).returncode == 0
    box.run("1", session="bomb", reset=True)


def _sleepers(b: Sandboxed, session: str) -> list[int]:
    """Asleep: a child of the main thread, one of another thread, and a grandchild forked from a
    thread of a child that then ends (an orphan the zygote adopts; one forked from a main
    thread would die with its parent)."""
    return value(b.run(
        "import time, threading\nr, w = os.pipe()\n"
        "def forker(out):\n"
        "    k = os.fork()\n"
        "    if k == 0:\n"
        "        def grandchild():\n"
        "            g = os.fork()\n"
        "            if g == 0:\n                time.sleep(600); os._exit(0)\n"
        "            os.write(w, str(g).encode())\n"
        "        t = threading.Thread(target=grandchild); t.start(); t.join(); os._exit(0)\n"
        "    out.append(k)\n"
        "    c = os.fork()\n"
        "    if c == 0:\n        time.sleep(600); os._exit(0)\n"
        "    out.append(c)\n"
        "out = []; t = threading.Thread(target=forker, args=(out,)); t.start(); t.join()\n"
        "orphan = int(os.read(r, 64)); os.waitpid(out[0], 0)\n"
        "c = os.fork()\n"
        "if c == 0:\n    time.sleep(600); os._exit(0)\n"
        "[c, out[1], orphan]", session=session))


def test_children_die_with_a_timeout_a_cancel_a_reset_and_the_session(box):
    kids = _sleepers(box, "lifetimes")
    assert all(pid_alive(p) for p in kids), kids
    rec = box.run("import time\ntime.sleep(60)", session="lifetimes", timeout_s=1)
    assert rec["status"] == "timeout", rec
    assert wait_until(lambda: not any(pid_alive(p) for p in kids), timeout=30), kids
    # The session itself lives on and can fork again.
    kids = _sleepers(box, "lifetimes")
    box.run("1", session="lifetimes", reset=True)
    assert wait_until(lambda: not any(pid_alive(p) for p in kids), timeout=30), kids
    # Ending the server ends them too.
    b = Sandboxed(box.user)
    try:
        kids = _sleepers(b, "s")
    finally:
        b.close()
    assert wait_until(lambda: not any(pid_alive(p) for p in kids), timeout=30), kids


def test_children_count_against_the_session_memory_limit(box):
    limit = json.loads(box.srv.request("resources/read", {"uri": "system://info"})["result"]["contents"][0]["text"])["sandbox"]["limits"]["memory_bytes"]
    share = int(limit * 0.4)
    # Each child alone is under the limit; four together are not.

    def four_children_growing(after: str) -> str:
        return ("import time\n"
                "for _ in range(4):\n"
                "    if os.fork() == 0:\n"
                f"        {after}a = bytearray({share}); a[::4096] = b'x' * len(a[::4096]); time.sleep(30); os._exit(0)\n"
                "time.sleep(20)")

    rec = box.run(four_children_growing(""), session="memhog", timeout_s=60)
    assert rec["status"] == "crashed" and "memory" in rec["error"]["message"], rec
    # Children that grow only after the worker has sat still for a second: its CPU clock no
    # longer moves, which spares a childless worker's walk, never one with children.
    rec = box.run(four_children_growing("time.sleep(1.5); "), session="latehog", timeout_s=60)
    assert rec["status"] == "crashed" and "memory" in rec["error"]["message"], rec
    # A pool forked from a session holding a third of the limit is fine.
    got = value(box.run(
        f"import multiprocessing as mp\nbig = bytearray({limit // 3}); big[::4096] = b'y' * len(big[::4096])\n"
        "with mp.Pool(2) as p:\n    r = p.map(len, [big[:10]] * 8)\nsum(r)", session="honest", timeout_s=60))
    assert got == 80


# A child whose main thread ends with the raw exit call (SYS_exit ends one thread) while a thread
# of it runs on: its /proc/<pid>/status shows no memory counters and its stat the leader's `Z`.
LEADERLESS_CHILD = (
    "import ctypes, threading, time\n"
    "def leaderless_child(w, hold_bytes=0):\n"
    "    def hold():\n"
    "        os.write(w, b'%d\\n' % os.getpid())\n"
    "        time.sleep(0.5)  # the main thread ends meanwhile\n"
    "        a = bytearray(hold_bytes); a[::4096] = b'x' * len(a[::4096])\n"
    "        time.sleep(120); os._exit(0)\n"
    "    threading.Thread(target=hold).start()\n"
    "    ctypes.CDLL(None).syscall(60, 0)\n"
)


@pytest.mark.parametrize("user", USERS)
def test_298_children_whose_main_thread_exited_count_against_the_session_memory_limit(user):
    # Four such children holding 180 MiB each under a 256 MiB limit: the watch read none of them
    # (720 MiB held, the cell "ok" as `nobody`; as root the memory group's limit ended it).
    b = forking_sandbox(user, MCP_BRIDGE_MEMORY_LIMIT="256m")
    try:
        rec = b.run(LEADERLESS_CHILD + "r, w = os.pipe()\n"
                    "for _ in range(4):\n"
                    "    if os.fork() == 0:\n        leaderless_child(w, 180 << 20)\n"
                    "said = b''\nwhile said.count(b'\\n') < 4:\n    said += os.read(r, 64)\n"
                    "open('kids', 'wb').write(said)\n"
                    "time.sleep(20)", session="leaderless", timeout_s=60)
        assert rec["status"] == "crashed" and "killed for holding" in rec["error"]["message"], rec
        kids = [int(k) for k in value(b.run("open('kids').read()", session="leaderless")).split()]
        assert len(kids) == 4, kids
        assert wait_until(lambda: not any(a_thread_runs(k) for k in kids), timeout=10), kids
    finally:
        b.close()


def test_299_a_child_whose_main_thread_exited_dies_with_the_run_and_once_orphaned(box):
    # Its stat shows the leader's `Z`, which the host took for a zombie: the kill of a timed-out
    # run's children skipped it, and the sweep of orphans that left their worker's group spared it
    # (it outlived the server, holding its memory).
    rec = box.run(LEADERLESS_CHILD + "r, w = os.pipe()\n"
                  "if os.fork() == 0:\n    leaderless_child(w)\n"
                  "print(int(os.read(r, 16)), flush=True)\ntime.sleep(60)", session="leaderless-run", timeout_s=3)
    assert rec["status"] == "timeout", rec
    kid = int(rec["stdout"].split()[0])
    assert wait_until(lambda: not a_thread_runs(kid), timeout=10), kid
    # Forked from a thread (no parent-death signal), in a group of its own, orphaned.
    orphan = value(box.run(
        LEADERLESS_CHILD + "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    def t():\n"
        "        if os.fork() == 0:\n            os.setpgid(0, 0); leaderless_child(w)\n"
        "    th = threading.Thread(target=t); th.start(); th.join(); time.sleep(0.5); os._exit(0)\n"
        "pid = int(os.read(r, 16)); os.wait(); pid", session="leaderless-escape"))
    assert wait_until(lambda: not a_thread_runs(orphan), timeout=10), orphan
    assert value(box.run("'still here'", session="leaderless-escape")) == "still here"


def test_dev_shm_is_the_sessions_own(box):
    assert value(box.run("open('/dev/shm/mine', 'w').write('a'); sorted(os.listdir('/dev/shm'))", session="shm-a")) == ["mine"]
    assert value(box.run("os.path.exists('/dev/shm/mine'), os.path.exists('mine')", session="shm-b")) == (False, False)
    assert value(box.run("os.path.exists('mine')", session="shm-a")) is True
    assert not os.path.exists("/dev/shm/mine")


def test_a_child_that_reaches_the_end_of_the_cell_ends_there(box):
    rec = box.run("import sys\npid = os.fork()\nprint('child' if pid == 0 else 'parent', flush=True)\n"
                  "if pid:\n    os.waitpid(pid, 0)\n'done'", session="stray")
    assert rec["status"] == "ok" and rec["result"] == "'done'", rec
    assert sorted(rec["stdout"].split()) == ["child", "parent"], rec
    assert value(box.run("'next run'", session="stray")) == "next run"
    # A child cannot call proxied tools (its requests would share the parent's socket).
    got = value(box.run(
        "import mcp\nr, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    try:\n        mcp.list_tools() if hasattr(mcp, 'list_tools') else mcp._request_sync('tools/list', {})\n"
        "        os.write(w, b'called')\n"
        "    except Exception as e:\n        os.write(w, str(e).encode())\n"
        "    os._exit(0)\n"
        "os.close(w); msg = os.read(r, 4096).decode(); os.wait(); msg", session="stray"))
    assert "only in the session's main process" in got, got


RAW_FORK = (
    "import ctypes, platform\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "nr = {'x86_64': 56, 'aarch64': 220}[platform.machine()]\n"
    "r = libc.syscall(nr, 17, 0, 0, 0, 0)  # clone(SIGCHLD): a plain fork, without libc's wrapper\n"
    "if r == 0:\n    os._exit(0)\n"
    "clone3 = libc.syscall(435, 0, 0)\n"
    "e = ctypes.get_errno()\n"
    "# vfork (x86_64 only), let through only where children are (SECURITY.md #233): refused here\n"
    "vf = libc.syscall(58) if platform.machine() == 'x86_64' else -1\n"
    "(r, e, clone3, vf)"
)


# A child (forked from a thread: no parent-death signal) that, once its worker died, writes to the
# stdout pipe it inherited as fast as it can, while the host reads what the worker left there
# (SECURITY.md #277): the host stops at an empty pipe or at its cap, never waits for the writer.
FLOODS_AFTER_ITS_PARENT = (
    "import threading, time\n"
    "parent = os.getpid()\n"
    "def spawn():\n"
    "    if os.fork() == 0:\n"
    "        open('flooder.pid', 'w').write(str(os.getpid()))\n"
    "        while os.getppid() == parent:\n            time.sleep(0.0005)\n"
    "        while True:\n            os.write(1, b'c' * 65536)\n"
    "t = threading.Thread(target=spawn); t.start(); t.join()\n"
    "while not os.path.exists('flooder.pid'):\n    time.sleep(0.001)\n"
    "print('step 2 done', flush=True)\ntime.sleep(0.05)\nos._exit(1)\n"
)


def test_277_a_child_writing_to_stdout_after_its_worker_died_cannot_stall_the_host(box):
    for i in range(5):
        rec = box.run(FLOODS_AFTER_ITS_PARENT, session=f"flood-{i}")
        assert rec["status"] == "crashed", rec
        assert rec["stdout"].startswith("step 2 done\n"), rec["stdout"][:100]
        total = (rec.get("stdout_truncated") or {}).get("total_bytes", len(rec["stdout"]))
        assert total <= len("step 2 done\n") + (1 << 20), total  # the host's cap per stream
        assert value(box.run("'answering'", session="bystander")) == "answering"
        kid = int(Path(value(box.run("import os\nos.getcwd()", session=f"flood-{i}"))).joinpath("flooder.pid").read_text())
        assert wait_until(lambda: not pid_alive(kid), 10), f"the flooding child {kid} outlived its worker"


@pytest.mark.parametrize("abi", [1, 3, 4, 5])
@pytest.mark.parametrize("user", USERS)
def test_below_landlock_abi_6_children_are_refused_and_the_note_says_why(user, abi):
    # Without Landlock's signal scope (ABI 6) a child could signal whatever the uid may: no
    # children, on every older ABI, by libc, by multiprocessing and by the raw system calls.
    b = Sandboxed(user, abi_max=abi)
    try:
        assert children_allowed(b).startswith(f"refused: this kernel's Landlock (ABI {abi})")
        assert b.outcome("os.fork()") == "PermissionError:1"
        rec = b.run("import multiprocessing as mp\nwith mp.Pool(2) as p:\n    p.map(abs, [1])", timeout_s=60)
        assert rec["status"] == "error", rec
        notes = " ".join(rec.get("notices", []))
        assert "refused a child process" in notes and f"ABI {abi}" in notes, rec
        raw = b.run(RAW_FORK, session="raw")
        assert raw["status"] == "ok", raw
        r, errno_, clone3, vfork = ast.literal_eval(raw["result"])
        assert r == -1 and errno_ in (1, 38) and clone3 == -1 and vfork == -1, raw  # EPERM or ENOSYS
        # The pid rules there still let the worker name itself.
        assert b.outcome("os.getsid(os.getpid()) == os.getpid()") == "ok:True"
    finally:
        b.close()
