"""The epoll gate's shares after a fork (docs/SECURITY.md #205, #245-#247): a session and its forks
run one seccomp filter, so every `EPOLL_CTL_ADD` of the lineage reaches one listener; the host maps
each caller to its own session and counts it against that session's share. A fork that exhausts
its share cannot starve its parent, nor the parent its fork; a fork's children count against the
fork; a fork's share comes back when it ends, its parent's untouched. Attacked from inside the
sandbox, as root and as `nobody`."""

from __future__ import annotations

from conftest import pid_alive, wait_until
import test_fork
from test_fork import fork, value
from test_sandbox import Sandboxed

box = test_fork.box  # the fixture: a server whose sessions may fork, root and nobody

# Defined in a session before it forks, so its forks have it too. The gate counts every
# EPOLL_CTL_ADD, whether or not it succeeds, so adding one descriptor again and again (EEXIST)
# takes the share as surely as new watches do.
ADD = r'''
import ast, errno, os, select, signal

def add(n):
    """n EPOLL_CTL_ADDs: how many the gate let through before ENOSPC, and the error."""
    ep, fd, done = select.epoll(), os.eventfd(0), 0
    try:
        for _ in range(n):
            try:
                ep.register(fd)
            except FileExistsError:
                pass
            done += 1
    except OSError as e:
        return done, errno.errorcode.get(e.errno)
    finally:
        ep.close()
        os.close(fd)
    return done, None

def in_child(n, leave_group=False, grandchild=False):
    """add(n) in a child (that may first leave the group), or in that child's child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if leave_group:
                os.setpgid(0, 0)
            if grandchild:
                g = os.fork()
                if g == 0:
                    os.write(w, repr(add(n)).encode())
                    os._exit(0)
                os.waitpid(g, 0)
            else:
                os.write(w, repr(add(n)).encode())
        finally:
            os._exit(0)
    os.close(w)
    out = os.read(r, 200)
    os.waitpid(pid, 0)
    os.close(r)
    return ast.literal_eval(out.decode())
'''


def epoll(b: Sandboxed) -> dict:
    return b.srv.info()["sandbox"]["epoll_watches"]


def reset_and_wait(box, before, *sessions):
    """Resets `sessions` and waits until the server holds no more watches than `before`."""
    for s in sessions:
        box.srv.call("1", session=s, reset=True)
    assert wait_until(lambda: epoll(box)["held"] <= before, timeout=30), epoll(box)


def test_245_a_fork_and_its_parent_each_have_a_share_neither_can_take_from_the_other(box):
    # Before: the lineage had one share, so a fork that used it up left its parent ENOSPC (and
    # the other way round), and a fork of a fork got nothing at all.
    share, before = epoll(box)["per_session"], epoll(box)["held"]
    value(box.run(ADD, session="ep-a"))
    fork(box, "ep-a", "ep-b")
    assert value(box.run(f"add({share} + 10)", session="ep-b")) == (share, "ENOSPC")
    assert value(box.run(f"add({share} + 10)", session="ep-a")) == (share, "ENOSPC")
    # Both exhausted: a fork of each still gets a whole share, and a fork of a fork too.
    fork(box, "ep-b", "ep-bb")
    fork(box, "ep-a", "ep-c")
    assert value(box.run(f"add({share} + 10)", session="ep-bb")) == (share, "ENOSPC")
    assert value(box.run(f"add({share} + 10)", session="ep-c")) == (share, "ENOSPC")
    # No more than one share each, all of them counted against the server's.
    assert epoll(box)["held"] - before == 4 * share
    reset_and_wait(box, before, "ep-a", "ep-b", "ep-bb", "ep-c")


def test_246_a_forks_children_count_against_the_fork_and_unmapped_callers_are_refused(box):
    share, before = epoll(box)["per_session"], epoll(box)["held"]
    value(box.run(ADD, session="ch-a"))
    fork(box, "ch-a", "ch-b")
    # A child of the fork, in its group: the fork's share.
    assert value(box.run("in_child(1000)", session="ch-b")) == (1000, None)
    assert value(box.run(f"add({share})", session="ch-b")) == (share - 1000, "ENOSPC")
    # A child that left the fork's group (`setpgid(0, 0)`): its parent's session, the fork.
    fork(box, "ch-a", "ch-c")
    assert value(box.run("in_child(10, leave_group=True)", session="ch-c")) == (10, None)
    # Its own child is in no live worker's group and its parent is no worker: it maps to no
    # session, and is refused rather than counted against another (fail closed).
    assert value(box.run("in_child(5, leave_group=True, grandchild=True)", session="ch-c")) == (0, "ENOSPC")
    assert value(box.run(f"add({share})", session="ch-c")) == (share - 10, "ENOSPC")
    # The parent's share is whole: its forks' children took none of it.
    assert value(box.run(f"add({share} + 1)", session="ch-a")) == (share, "ENOSPC")
    assert epoll(box)["held"] - before == 3 * share
    reset_and_wait(box, before, "ch-a", "ch-b", "ch-c")


def test_247_a_forks_share_comes_back_when_it_ends_and_its_parents_stays(box):
    share, before = epoll(box)["per_session"], epoll(box)["held"]
    value(box.run(ADD, session="end-a"))
    assert value(box.run("add(100)", session="end-a")) == (100, None)
    for f in ("end-reset", "end-killed", "end-timeout"):
        fork(box, "end-a", f)
        assert value(box.run(f"add({share} + 1)", session=f)) == (share, "ENOSPC")
    # A fork of a fork, whose parent then ends: its share is its own and stays.
    fork(box, "end-reset", "end-grand")
    assert value(box.run("add(50)", session="end-grand")) == (50, None)
    assert epoll(box)["held"] - before == 100 + 3 * share + 50
    # Reset, killed from inside, timed out (SIGINT ignored, so the worker is killed).
    box.srv.call("1", session="end-reset", reset=True)
    assert box.run("os.kill(os.getpid(), 9)", session="end-killed")["session_state"] == "lost"
    rec = box.run("signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass", session="end-timeout",
                  timeout_s=1)
    assert rec["status"] == "timeout", rec
    # Their shares come back; the parent's 100 and the grandchild's 50 stay counted.
    assert wait_until(lambda: epoll(box)["held"] - before == 150, timeout=30), epoll(box)
    # The parent's share is as it was (100 taken), the grandchild's too (50), and a new fork
    # gets a whole one.
    assert value(box.run(f"add({share})", session="end-a")) == (share - 100, "ENOSPC")
    assert value(box.run(f"add({share})", session="end-grand")) == (share - 50, "ENOSPC")
    fork(box, "end-a", "end-new")
    assert value(box.run(f"add({share} + 1)", session="end-new")) == (share, "ENOSPC")
    reset_and_wait(box, before, "end-a", "end-grand", "end-new", "end-reset", "end-killed", "end-timeout")


def test_248_a_forks_share_is_kept_while_a_process_it_left_behind_lives(box):
    # A process of the fork that left its group, forked from a thread (so no parent-death
    # signal), holds 1,000 watches; the fork is reset. The process, orphaned outside every
    # worker's group, is killed by the memory watch; until it is gone, the watches it holds stay
    # counted (before, a share given back with its holder alive let the server's count fall
    # below what the uid's processes held).
    share, before = epoll(box)["per_session"], epoll(box)["held"]
    value(box.run(ADD, session="left-a"))
    fork(box, "left-a", "left-b")
    code = """
import threading, time
r, w = os.pipe()
if os.fork() == 0:
    def t():
        if os.fork() == 0:
            os.setpgid(0, 0)
            eps, fd = [select.epoll() for _ in range(10)], os.eventfd(0)
            for n in range(200, 300):  # a watch per (file, descriptor number) and instance
                os.dup2(fd, n)
                for ep in eps:
                    ep.register(n)
            os.write(w, str(os.getpid()).encode())
            time.sleep(120)
            os._exit(0)
    threading.Thread(target=t).start()
    time.sleep(120)
    os._exit(0)
os.close(w)
int(os.read(r, 64))
"""
    left = value(box.run(code, session="left-b"))
    assert pid_alive(left)
    assert epoll(box)["held"] - before == 1000
    box.srv.call("1", session="left-b", reset=True)
    samples, early = 0, []
    while True:
        held = epoll(box)["held"] - before
        alive = pid_alive(left)
        samples += 1
        if held < 1000 and alive:
            early.append(samples)
        if held == 0:
            break
        assert samples < 20_000, (held, alive)
    assert not early, f"the share came back while its holder lived (samples {early[:5]})"
    assert not pid_alive(left)
    assert value(box.run(f"add({share} + 1)", session="left-a")) == (share, "ENOSPC")
    box.srv.call("1", session="left-a", reset=True)
    assert wait_until(lambda: epoll(box)["held"] <= before, timeout=30), epoll(box)


def test_250_the_parents_epoll_instance_and_pipe_above_a_lowered_descriptor_limit_do_not_reach_the_fork(box):
    # The parent puts an epoll instance and a pipe's write end at 900 and 901, then lowers its
    # soft RLIMIT_NOFILE to 64 to hide them from the fork's scan below that limit: had the
    # fork kept them, it could add watches its share counts to an instance the parent holds on
    # after the fork ends, and write to the parent's pipe. Neither may reach it.
    value(box.run(
        "import resource, select\ne = select.epoll()\nr, w = os.pipe()\nos.dup2(e.fileno(), 900)\n"
        "os.dup2(w, 901)\nresource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))",
        session="nofile-a"))
    r = fork(box, "nofile-a", "nofile-b", (
        "import fcntl\nheld = []\nfor n in (900, 901):\n    try:\n        fcntl.fcntl(n, fcntl.F_GETFD)\n"
        "        held.append(n)\n    except OSError:\n        pass\nheld"))
    assert not r["isError"], r
    assert value(r["structuredContent"]) == []
    for s in ("nofile-a", "nofile-b"):
        box.srv.call("1", session=s, reset=True)
