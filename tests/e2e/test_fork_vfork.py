"""The `vfork` a session fork is made through, attacked from session code (docs/SECURITY.md #233,
#257-#259): where sessions may fork, the filter lets a raw `vfork` (system call 58) through, so
a cell can make a child that shares its worker's memory and stack. Its child must still be
unable to exec, count against the session's task cap, die with the run's timeout and with a
reset while the thread that made it waits, and keep a fork of its session refused while it
lives. At Landlock ABI 6 (the oldest that forks) and 7, as root and as `nobody`.

A `vfork` child runs on its parent's stack, so what it calls overwrites the frames its parent
returns through. The cells below keep the parent alive by making every call around the `vfork`
the same ctypes call with the same number of arguments (`sc(nr, 0)`): the parent then returns
as the child's last such call did, after it in the cell (its variables are the child's: one
memory). A child that runs other code instead leaves its parent to crash when it resumes, which
the host reports like any crash in native code."""

from __future__ import annotations

import ast
import platform

import pytest

from conftest import pid_alive, wait_until
from test_sandbox import USERS, forking_sandbox

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="vfork (58) is x86_64's")

# ctypes' `syscall`, returning a long; `me` is the worker's pid (a vfork child has its own).
SYSCALL = (
    "import ctypes, time, threading\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "sc = libc.syscall\nsc.restype = ctypes.c_long\n"
    "me = os.getpid()\n"
)


@pytest.fixture(scope="module", params=[(u, abi) for u in USERS for abi in (6, 7)], ids=lambda p: f"{p[0]}-abi{p[1]}")
def box(request):
    user, abi = request.param
    # As a user the memory watch may not tell a vfork child's memory from the worker's and
    # counts each at the worker's whole size (SECURITY.md #233: twice, never less), so a chain
    # of 253 counts ~1.2 GiB: room for it, or the watch ends the chain before the task cap does.
    b = forking_sandbox(user, abi_max=abi, IRONCELL_MAX_SESSIONS="40", MCP_BRIDGE_MEMORY_LIMIT="4g")
    yield b
    b.close()


def value(rec: dict):
    assert rec["status"] == "ok", (rec.get("status"), rec.get("error"), rec.get("notices"), rec.get("stderr"))
    return ast.literal_eval(rec["result"])


def test_257_a_vfork_child_cannot_exec_and_is_a_process_of_its_own(box):
    # The child asks for execve (59) of /bin/true, then for exit_group (231); the parent resumes
    # after the child's last call, with the child's answers in the memory they share.
    got = value(box.run(
        SYSCALL + "box = (ctypes.c_long * 4)()\n"
        "r = sc(58, 0)\n"
        "if os.getpid() != me:\n"
        "    box[0] = os.getpid()\n"
        "    box[1] = sc(59, ctypes.c_char_p(b'/bin/true'))\n"
        "    box[2] = ctypes.get_errno()\n"
        "    box[3] = sc(322, 0)\n"  # execveat
        "    sc(231, 0)\n"
        "(me, list(box), os.getpid())", session="vexec"))
    me, (child, execve, errno_, execveat), after = got
    assert after == me and child not in (0, me), got
    assert (execve, errno_, execveat) == (-1, 1, -1), got  # EPERM, from the filter
    # The session goes on, in the same worker.
    assert value(box.run("os.getpid()", session="vexec")) == me


def test_257_a_chain_of_vfork_children_stops_at_the_sessions_task_cap(box):
    cap = box.srv.info()["sandbox"]["limits"]["threads"]
    # Each child vforks again until the kernel refuses; the deepest records how deep and why,
    # and each level, resumed after the deepest's exit, exits too, up to the worker.
    depth, err = value(box.run(
        SYSCALL + "depth, err = 0, 0\n"
        "while depth < 5000:\n"
        "    r = sc(58, 0)\n"
        "    if r < 0:\n"
        "        err = ctypes.get_errno()\n"
        "        break\n"
        "    depth += 1\n"
        "while os.getpid() != me:\n"
        "    sc(231, 0)\n"
        "(depth, err)", session="vchain", timeout_s=120))
    assert err == 11 and 0 < depth <= cap, (depth, err, cap)  # EAGAIN at the session's cap
    assert value(box.run("'unaffected'", session="vbystander")) == "unaffected"
    # The chain is gone, and its room with it: the same session forks a child again.
    assert value(box.run("p = os.fork()\nif p == 0:\n    os._exit(7)\nos.waitpid(p, 0)[1] >> 8", session="vchain")) == 7


def test_257_a_spinning_vfork_child_ends_with_the_runs_timeout(box):
    # The worker's only thread waits in vfork for a child that never ends.
    rec = box.run(
        SYSCALL + "fd = os.open('spinner.pid', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)\n"
        "r = sc(58, 0)\n"
        "if os.getpid() != me:\n"
        "    os.write(fd, str(os.getpid()).encode())\n"
        "    while True:\n        pass\n"
        "'never'", session="vspin", timeout_s=2)
    assert rec["status"] == "timeout", rec
    spinner = int(value(box.run("open('spinner.pid').read()", session="vspin")))
    assert wait_until(lambda: not pid_alive(spinner), timeout=30), spinner
    # The session is usable again (a worker that crashed on resuming is replaced, files kept).
    assert value(box.run("import os\nos.path.exists('spinner.pid')", session="vspin")) is True
    assert value(box.run("'unaffected'", session="vbystander")) == "unaffected"


def thread_vfork(leave_group: bool = False) -> str:
    """A cell whose thread vforks a child that waits until it is killed (after leaving the
    worker's process group, with `leave_group`: `setpgid(0, 0)` is allowed where sessions fork,
    #194); the cell returns the child's pid. The child waits in `pause` called as `sc(34, 0)`,
    the vfork's own shape, so once it is killed the thread resumes as from that call (the
    module's note) and ends. A child that spun in Python instead left the thread to return
    through frames the child overwrote: the worker crashed when the thread next ran, which
    under load was often during the session's next run (4 failures in 20 runs of this file
    beside two busy loops)."""
    return THREAD_VFORK.replace("LEAVE", "os.setpgid(0, 0)" if leave_group else "pass")


THREAD_VFORK = (
    SYSCALL + "def make():\n"
    "    r = sc(58, 0)\n"
    "    if os.getpid() != me:\n"
    "        LEAVE\n"
    "        fd = os.open('vchild.pid', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)\n"
    "        os.write(fd, str(os.getpid()).encode())\n"
    "        sc(34, 0)\n"
    "threading.Thread(target=make, daemon=True).start()\n"
    "for _ in range(3000):\n"
    "    if os.path.exists('vchild.pid') and os.path.getsize('vchild.pid'):\n        break\n"
    "    time.sleep(0.01)\n"
    "int(open('vchild.pid').read())"
)


@pytest.mark.parametrize("leave_group", [False, True], ids=["in-group", "left-group"])
def test_258_a_vfork_child_of_a_thread_outlives_its_cell_but_not_a_reset_and_keeps_its_session_from_forking(box, leave_group):
    # vfork stops only the calling thread: the cell returns while its child waits, sharing the
    # worker's memory (and its domain before any fork, which reaches a fork's directory).
    session = f"vthread-{int(leave_group)}"
    child = value(box.run(thread_vfork(leave_group), session=session, timeout_s=60))
    assert pid_alive(child)
    with open(f"/proc/{child}/stat") as f:
        group = int(f.read().rsplit(")", 1)[1].split()[2])
    worker = value(box.run("os.getpid()", session=session))
    assert (group == child) if leave_group else (group == worker), (group, child, worker)
    assert value(box.run("'still served'", session=session)) == "still served"
    r = box.srv.call("1", session=f"{session}-fork", fork_from=session)
    assert r["isError"], r
    why = r["content"][0]["text"]
    assert "1 thread of its own code" in why and "1 child process" in why, why
    assert f"{session}-fork" not in {f["name"] for f in box.srv.info()["sessions"]["forks"]}
    # A reset ends the worker with its thread still waiting in vfork, and the child with it (in
    # the worker's group, or, having left it, as an orphan the memory watch kills, #194).
    assert value(box.run("'fresh'", session=session, reset=True)) == "fresh"
    assert wait_until(lambda: not pid_alive(child), timeout=30), child
    # Nothing of it is left to refuse a fork for.
    r = box.srv.call("1", session=f"{session}-fork", fork_from=session)
    assert not r["isError"], r["content"][0]["text"]


def test_258_a_vfork_child_of_a_thread_dies_with_the_runs_timeout(box):
    rec = box.run(thread_vfork() + "\ntime.sleep(60)", session="vthread-timeout", timeout_s=3)
    assert rec["status"] == "timeout", rec
    child = int(value(box.run("open('vchild.pid').read()", session="vthread-timeout")))
    assert wait_until(lambda: not pid_alive(child), timeout=30), child
