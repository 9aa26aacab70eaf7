"""The catalogue's attacks against forked sessions (docs/SECURITY.md #221-#228): a fork (B) of a
warm session (A) and A itself after the fork are refused everything a fresh session is refused,
run from one table; and the widenings a fork needs are attacked: forking to escape a limit, to
reach the other side, to pin the parent, the zygote or the host, to exhaust Landlock layers or the
uid's kernel memory. As root and as `nobody`; test_fork.py holds the fork's own behaviour."""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

import pytest

from conftest import pid_alive, wait_until
from test_fork import fork, value
from test_sandbox import (BPF_PROGRAMS, EPOLL_FILL, PROBE_PID, REFUSED_FOR_ANOTHER, USERS, Listener,
                          Sandboxed, memory_groups_of, with_scratch_quota)


def forks_allowed(b: Sandboxed) -> bool:
    return b.srv.info()["sandbox"]["child_processes"].startswith("allowed")


def start(user: str, abi: int | None = None, base: str = "/tmp", **env: str) -> Sandboxed:
    b = Sandboxed(user, abi_max=abi, base=base, **{"IRONCELL_MAX_SESSIONS": "40", **env})
    if not forks_allowed(b):
        b.close()
        pytest.skip("sessions cannot fork on this host")
    return b


def pid_and_dir(b: Sandboxed, session: str) -> tuple[int, str]:
    return value(b.run("(os.getpid(), os.getcwd())", session=session))


def send(b: Sandboxed, tool: str, args: dict) -> int:
    """Sends a tools/call without waiting; `collect` gathers the answers."""
    rid = b.srv.next_id
    b.srv.next_id += 1
    b.srv.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {"name": tool, "arguments": args}})
    return rid


def collect(b: Sandboxed, ids: set[int], got: dict[int, dict], timeout: float = 120.0) -> list[int]:
    """Reads answers until every id in `ids` is in `got`; returns the ids in the order answered."""
    order = []
    deadline = time.monotonic() + timeout
    while not ids <= got.keys():
        msg = b.srv.read(max(0.01, deadline - time.monotonic()))
        if msg.get("id") is not None and "result" in msg:
            got[msg["id"]] = msg["result"]
            order.append(msg["id"])
    return order


# ---------------------------------------------------------------------------------------------
# #221: one table of the catalogue's attacks, run in a fresh session, in B and in A after the fork
# ---------------------------------------------------------------------------------------------

# What each side runs: `OTHER` is the other side of the fork (for the fresh session, another
# session), `BYSTANDER` a session outside the fork. Calls seccomp answers by killing the process
# are made in a child of the session (`in_child`), so one cell runs the whole table.
ATTACKS = PROBE_PID + BPF_PROGRAMS + r'''
import errno, fcntl, resource, signal, socket, stat, struct, subprocess, sysconfig, termios
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_ssize_t
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
OTHER_PID, OTHER_DIR, BYSTANDER_PID, BYSTANDER_DIR, HOST_PID, PORT, UDP_PORT, ABSTRACT = ARGS
ZYGOTE = os.getppid()
REFUSED = REFUSED_TABLE

def in_child(nr, *args):
    """The system call in a child: how it ended (killed by a signal, an errno, or ok)."""
    pid = os.fork()
    if pid == 0:
        ctypes.set_errno(0)
        rc = libc.syscall(nr, *args)
        os._exit(200 if rc == 0 and nr == 56 else (0 if rc >= 0 else min(ctypes.get_errno(), 199)))
    _, st = os.waitpid(pid, 0)
    if os.WIFSIGNALED(st):
        return f"signal:{os.WTERMSIG(st)}"
    c = os.WEXITSTATUS(st)
    return "ok" if c == 0 else ("a clone ran" if c == 200 else "errno:" + errno.errorcode.get(c, str(c)))

def raw(nr, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(nr, *args)
    return "ok" if rc >= 0 else "errno:" + errno.errorcode.get(ctypes.get_errno(), "?")

def foreign_dirs_writable():
    """Every descriptor number held that names a directory other than the session's own, and
    through which a file could be made (what guessing descriptors would find)."""
    own, reached = os.stat("."), []
    for fd in range(1024):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino):
            try:
                os.close(os.open("fd-guess", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
                reached.append(fd)
            except OSError:
                pass
    return reached

def flood(make, limit=5000):
    """Makes descriptors until refused: (how many, errno name); gives them back."""
    made = []
    try:
        while len(made) < limit:
            made.append(make())
    except OSError as e:
        err = errno.errorcode.get(e.errno)
    else:
        err = None
    for fd in made:
        os.close(fd)
    return (len(made) <= resource.getrlimit(resource.RLIMIT_NOFILE)[0], err)

def timerfd():
    fd = libc.syscall(283, 1, 0)  # timerfd_create(CLOCK_MONOTONIC, 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "timerfd_create")
    return fd

def timers():
    class Event(ctypes.Structure):
        _fields_ = [('value', ctypes.c_long), ('signo', ctypes.c_int), ('notify', ctypes.c_int),
                    ('pad', ctypes.c_char * 48)]
    event, made = Event(0, signal.SIGRTMIN, 1), []
    while len(made) < 5000:
        t = ctypes.c_void_p()
        if libc.timer_create(1, ctypes.byref(event), ctypes.byref(t)) != 0:
            break
        made.append(t)
    err = errno.errorcode.get(ctypes.get_errno())
    for t in made:
        libc.timer_delete(t)
    return (len(made) <= 1024, err)

if not os.path.lexists("link-to-passwd"):
    os.symlink("/etc/passwd", "link-to-passwd")
open("s.sh", "w").write("#!/bin/sh\necho pwned > pwned\n")
r, w = os.pipe()
a, b = socket.socketpair()
page = libc.mmap(None, 4096, 3, 0x22, -1, 0)
ATTACK = {
    # Filesystem (#1-#10, #46), the other side's and another session's directories (#7, #193)
    "etc_passwd": lambda: open("/etc/passwd").read(),
    "list_root": lambda: os.listdir("/"),
    "list_home_root": lambda: os.listdir("/root"),
    "symlink_out": lambda: open("link-to-passwd").read(),
    "hard_link_out": lambda: os.link("/etc/passwd", "hard-link"),
    "proc_zygote": lambda: open(f"/proc/{ZYGOTE}/environ").read(),
    "proc_other": lambda: open(f"/proc/{OTHER_PID}/status").read(),
    "proc_host": lambda: open(f"/proc/{HOST_PID}/cmdline").read(),
    "stat_proc_other": lambda: os.stat(f"/proc/{OTHER_PID}"),
    "write_var_tmp": lambda: open("/var/tmp/ironcell-fork-escape", "w"),
    "write_stdlib": lambda: open(os.__file__, "a"),
    "write_site_pth": lambda: open(os.path.join(sysconfig.get_paths()["purelib"], "evil.pth"), "w"),
    "other_list": lambda: os.listdir(OTHER_DIR),
    "other_read": lambda: open(OTHER_DIR + "/secret.txt").read(),
    "other_write": lambda: open(OTHER_DIR + "/planted", "w"),
    "other_dotdot": lambda: open(OTHER_DIR + "/../" + os.path.basename(OTHER_DIR) + "/planted", "w"),
    "other_rename_into": lambda: os.rename("s.sh", OTHER_DIR + "/moved"),
    "bystander_list": lambda: os.listdir(BYSTANDER_DIR),
    "beside_own_dir": lambda: open(os.path.dirname(os.getcwd()) + "/planted", "w"),
    "chmod_exec": lambda: os.chmod("s.sh", 0o755),
    "foreign_dir_fds": foreign_dirs_writable,
    # Network (#12-#16)
    "tcp_connect": lambda: socket.create_connection(("127.0.0.1", PORT), timeout=2),
    "udp_send": lambda: socket.socket(2, 2).sendto(b"x", ("127.0.0.1", UDP_PORT)),
    "abstract_unix": lambda: socket.socket(1).connect(ABSTRACT),
    "netlink": lambda: socket.socket(16, 3, 0),
    "packet": lambda: socket.socket(17, 3, 0),
    # Programs (#10, #19)
    "subprocess": lambda: subprocess.run(["id"]),
    "execv": lambda: os.execv("/bin/sh", ["sh", "-c", "echo pwned > pwned"]),
    "exec_script": lambda: os.execv("./s.sh", ["s.sh"]),
    # Signals, limits and groups of the other side, another session, the zygote, the host (#20,
    # #21, #47, #140, #158, #194)
    "kill_other": lambda: os.kill(OTHER_PID, signal.SIGKILL),
    "kill_other_group": lambda: os.kill(-OTHER_PID, signal.SIGKILL),
    "kill_bystander": lambda: os.kill(BYSTANDER_PID, signal.SIGKILL),
    "kill_zygote": lambda: os.kill(ZYGOTE, 0),
    "kill_host": lambda: os.kill(HOST_PID, 0),
    "kill_init": lambda: os.kill(1, 0),
    "tgkill_other": lambda: raw(234, OTHER_PID, OTHER_PID, signal.SIGKILL),
    "sigqueue_other": lambda: raw(129, OTHER_PID, signal.SIGUSR1, ctypes.byref(ctypes.create_string_buffer(128))),
    "fsetown_other": lambda: fcntl.fcntl(r, fcntl.F_SETOWN, OTHER_PID),
    "pidfd_open_other": lambda: in_child(434, OTHER_PID, 0),
    "prlimit_other": lambda: resource.prlimit(OTHER_PID, resource.RLIMIT_NOFILE, (16, 16)),
    "prlimit_zygote": lambda: resource.prlimit(ZYGOTE, resource.RLIMIT_NOFILE),
    "prlimit_host": lambda: resource.prlimit(HOST_PID, resource.RLIMIT_AS, (1 << 20, 1 << 20)),
    "raise_hard_nofile": lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1] + 1,) * 2),
    "setpriority_other": lambda: os.setpriority(os.PRIO_PROCESS, OTHER_PID, 19),
    "affinity_other": lambda: raw(203, OTHER_PID, 8, ctypes.byref(ctypes.c_uint64(1))),
    "setpgid_join_other": lambda: os.setpgid(0, OTHER_PID),
    "setpgid_move_other": lambda: os.setpgid(OTHER_PID, 0),
    "setsid": os.setsid,
    "clone_parent": lambda: in_child(56, 0x8000 | 17, 0, 0, 0, 0),
    "probe_other": lambda: probe(OTHER_PID) == REFUSED,
    "probe_zygote": lambda: probe(ZYGOTE) == REFUSED,
    "probe_host": lambda: probe(HOST_PID) == REFUSED,
    "tiocsti": lambda: fcntl.ioctl(0, termios.TIOCSTI, b"x"),
    # Killed by seccomp (#22, #23, #56)
    "ptrace_other": lambda: in_child(101, 16, OTHER_PID, 0, 0),
    "process_vm_readv_other": lambda: in_child(310, OTHER_PID, 0, 0, 0, 0, 0),
    "process_madvise_other": lambda: in_child(440, 0, 0, 0, 0, 0),
    "kcmp_other": lambda: in_child(312, OTHER_PID, os.getpid(), 0, 0, 0),
    "pidfd_getfd": lambda: in_child(438, 0, 0, 0),
    "setns": lambda: in_child(308, 0, 0),
    "unshare_user": lambda: in_child(272, 0x10000000),
    "unshare_mount": lambda: in_child(272, 0x20000),
    "mount": lambda: in_child(165, 0, 0, 0, 0, 0),
    "fsopen": lambda: in_child(430, 0, 0),
    "open_tree": lambda: in_child(428, -100, 0, 0),
    "pivot_root": lambda: in_child(155, 0, 0),
    "open_by_handle_at": lambda: in_child(304, 0, 0, 0),
    "keyctl": lambda: in_child(250, 0, 0),
    "add_key": lambda: in_child(248, 0, 0, 0, 0, 0),
    "bpf": lambda: in_child(321, 0, 0, 0),
    "perf_event_open": lambda: in_child(298, 0, 0, -1, -1, 0),
    "userfaultfd": lambda: in_child(323, 0),
    "io_uring_setup": lambda: in_child(425, 1, 0),
    # Kernel memory no rlimit counts (#48, #112, #117, #120, #122, #127, #129, #131, #132)
    "memfd": lambda: os.memfd_create("grow"),
    "shared_anonymous": lambda: (libc.mmap(None, 4096, 3, 0x21, -1, 0), ctypes.get_errno()),
    "mlock": lambda: (libc.mlock(ctypes.c_void_p(page), 4096), ctypes.get_errno()),
    "socket_buffer": lambda: a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30),
    "descriptors_in_flight": lambda: a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", r))]),
    "splice": lambda: os.splice(r, w, 1),
    "filters": lambda: BPF_RESULT,
    "huge_pages_off": lambda: libc.prctl(42, 0, 0, 0, 0),
    "inotify": lambda: in_child(294, 0),
    "fanotify": lambda: in_child(300, 0, 0),
    "eventfd_flood": lambda: flood(lambda: os.eventfd(0)),
    "timerfd_flood": lambda: flood(timerfd),
    "posix_timers": timers,
}
{name: outcome(f) for name, f in ATTACK.items()}
'''

SIGSYS = "ok:'signal:31'"
REFUSED_THE_SAME = {
    "etc_passwd": "PermissionError:13", "list_root": "PermissionError:13", "list_home_root": "PermissionError:13",
    "symlink_out": "PermissionError:13", "hard_link_out": {"PermissionError:13", "PermissionError:1", "OSError:18"},
    "proc_zygote": {"PermissionError:13", "FileNotFoundError:2"},
    "proc_other": {"PermissionError:13", "FileNotFoundError:2"},
    "proc_host": {"PermissionError:13", "FileNotFoundError:2"},
    "stat_proc_other": "FileNotFoundError:2",
    "write_var_tmp": "PermissionError:13", "write_stdlib": "PermissionError:13", "write_site_pth": "PermissionError:13",
    "other_list": "PermissionError:13", "other_read": "PermissionError:13", "other_write": "PermissionError:13",
    "other_dotdot": "PermissionError:13", "other_rename_into": {"PermissionError:13", "OSError:18"},
    "bystander_list": "PermissionError:13", "beside_own_dir": "PermissionError:13",
    "chmod_exec": "PermissionError:1", "foreign_dir_fds": "ok:[]",
    "tcp_connect": "PermissionError:1", "udp_send": "PermissionError:1", "abstract_unix": "PermissionError:1",
    "netlink": "PermissionError:1", "packet": "PermissionError:1",
    "subprocess": "PermissionError:1", "execv": "PermissionError:1", "exec_script": "PermissionError:1",
    "kill_other": "PermissionError:1", "kill_other_group": "PermissionError:1", "kill_bystander": "PermissionError:1",
    "kill_zygote": "PermissionError:1", "kill_host": "PermissionError:1", "kill_init": "PermissionError:1",
    "tgkill_other": "ok:'errno:EPERM'", "sigqueue_other": "ok:'errno:ENOSYS'",
    "fsetown_other": "PermissionError:1", "pidfd_open_other": SIGSYS,
    "prlimit_other": "PermissionError:1", "prlimit_zygote": "PermissionError:1", "prlimit_host": "PermissionError:1",
    "raise_hard_nofile": {"ValueError:None", "PermissionError:1"},
    "setpriority_other": "PermissionError:1", "affinity_other": "ok:'errno:EPERM'",
    "setpgid_join_other": "PermissionError:1", "setpgid_move_other": "PermissionError:1", "setsid": "PermissionError:1",
    "clone_parent": "ok:'errno:EPERM'",
    "probe_other": "ok:True", "probe_zygote": "ok:True", "probe_host": "ok:True",
    "tiocsti": "PermissionError:1",
    "ptrace_other": SIGSYS, "process_vm_readv_other": SIGSYS, "process_madvise_other": SIGSYS, "kcmp_other": SIGSYS,
    "pidfd_getfd": SIGSYS, "setns": SIGSYS, "unshare_user": SIGSYS, "unshare_mount": SIGSYS, "mount": SIGSYS,
    "fsopen": SIGSYS, "open_tree": SIGSYS, "pivot_root": SIGSYS, "open_by_handle_at": SIGSYS, "keyctl": SIGSYS,
    "add_key": SIGSYS, "bpf": SIGSYS, "perf_event_open": SIGSYS, "userfaultfd": SIGSYS, "io_uring_setup": SIGSYS,
    "memfd": "PermissionError:1", "shared_anonymous": "ok:(-1, 1)", "mlock": "ok:(-1, 1)",
    "socket_buffer": "PermissionError:1", "descriptors_in_flight": "PermissionError:1", "splice": "OSError:38",
    "filters": "ok:(1, 38, 1, 1, 0)", "huge_pages_off": "ok:1",
    "inotify": "ok:'errno:ENOSYS'", "fanotify": "ok:'errno:ENOSYS'",
    "eventfd_flood": "ok:(True, 'EMFILE')", "timerfd_flood": "ok:(True, 'EMFILE')",
    "posix_timers": "ok:(True, 'EAGAIN')",
}


class Pair:
    """One server with a warm session A (state, open files, a symlink planted before the fork), a
    fork B of it, a bystander session and a fresh one; `pids`/`dirs` by session."""

    def __init__(self, user: str, abi: int | None = None, base: str = "/tmp"):
        self.box = start(user, abi, base)
        self.pids, self.dirs = {}, {}
        b = self.box
        value(b.run("open('secret.txt', 'w').write('bystander only')", session="bystander"))
        value(b.run(
            "import json, collections\nstate = collections.Counter('forked')\n"
            "open('secret.txt', 'w').write('A only')\nkept = open('kept.txt', 'a'); kept.write('a1'); kept.flush()\n"
            "reader = open('secret.txt')\ndir_fd = os.open('.', os.O_RDONLY | os.O_DIRECTORY)\n"
            "os.symlink('/etc/passwd', 'link-to-passwd')\nlen(state)", session="A"))
        r = fork(b, "A", "B", "state['b'] += 1\nsorted(state.items())")
        assert not r["isError"], r["content"][0]["text"]
        for s in ("A", "B", "bystander"):
            self.pids[s], self.dirs[s] = pid_and_dir(b, s)
        value(b.run("1", session="fresh"))
        self.pids["fresh"], self.dirs["fresh"] = pid_and_dir(b, "fresh")

    def close(self):
        self.box.close()


# Beneath /tmp sessions have no /tmp of their own; beneath /var/tmp, as with the default state
# directory, each has a private /tmp (a mount namespace), which a fork inherits and must not use.
@pytest.fixture(scope="module", params=[(u, base) for u in USERS for base in ("/tmp", "/var/tmp")],
                ids=lambda p: f"{p[0]}-state-in-{p[1].strip('/').replace('/', '-')}")
def pair(request):
    p = Pair(request.param[0], base=request.param[1])
    yield p
    p.close()


def run_the_table(p: Pair, me: str, other: str, listener: Listener, abstract: str) -> dict:
    args = (p.pids[other], p.dirs[other], p.pids["bystander"], p.dirs["bystander"], p.box.srv.proc.pid,
            listener.port, listener.udp_port, "\0" + abstract)
    code = ATTACKS.replace("ARGS", repr(args)).replace("REFUSED_TABLE", repr(REFUSED_FOR_ANOTHER))
    return value(p.box.run(code, session=me, timeout_s=120))


def expected_for(b) -> dict:
    """The catalogue's outcomes in this server's workers: where they have memory cgroups, huge
    pages are on, charged whole there (SECURITY.md #271); elsewhere off (#132)."""
    want = dict(REFUSED_THE_SAME)
    if memory_groups_of(b) is not None:
        want["huge_pages_off"] = "ok:0"
    return want


def mismatches(got: dict, expected: dict = REFUSED_THE_SAME) -> dict:
    out = {}
    for name, want in expected.items():
        if (got.get(name) not in want) if isinstance(want, set) else got.get(name) != want:
            out[name] = got.get(name)
    extra = set(got) - set(expected)
    assert not extra, extra
    return out


def the_catalogue_holds_in_a_fork(p: Pair) -> None:
    listener = Listener()
    abstract = f"ironcell-fork-catalogue-{os.getpid()}-{p.box.user}"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind("\0" + abstract)
    unix.listen(1)
    unix.settimeout(0.5)
    try:
        seen = {me: run_the_table(p, me, other, listener, abstract)
                for me, other in (("fresh", "bystander"), ("B", "A"), ("A", "B"))}
        # The reference first: a fresh session is refused each, as the catalogue says.
        want = expected_for(p.box)
        assert mismatches(seen["fresh"], want) == {}, seen["fresh"]
        assert mismatches(seen["B"], want) == {}, seen["B"]
        assert mismatches(seen["A"], want) == {}, seen["A"]
        assert seen["B"] == seen["fresh"] and seen["A"] == seen["fresh"]
        assert not listener.tcp_got_connection() and not listener.udp_got_datagram()
        with pytest.raises(socket.timeout):
            unix.accept()
    finally:
        listener.tcp.close()
        listener.udp.close()
        unix.close()
    # Every process is alive and every session keeps its own state.
    assert all(pid_alive(p.pids[s]) for s in ("A", "B", "bystander", "fresh")) and p.box.srv.proc.poll() is None
    assert value(p.box.run("sorted(state.items())[:2], open('secret.txt').read()", session="A")) == \
        ([("d", 1), ("e", 1)], "A only")
    assert value(p.box.run("state['b'], os.path.exists('pwned')", session="B")) == (1, False)


def test_221_the_catalogues_attacks_are_refused_in_a_fork_and_its_parent_as_in_a_fresh_session(pair):
    the_catalogue_holds_in_a_fork(pair)


def test_221_a_call_seccomp_kills_for_ends_the_fork_alone(pair):
    # The table makes these calls in children; made by the fork itself, it ends the fork only.
    b = pair.box
    value(b.run("kept = 'parent'", session="sigsys-a"))
    fork(b, "sigsys-a", "sigsys-b")
    a_pid, _ = pid_and_dir(b, "sigsys-a")
    rec = b.run(f"import ctypes\nctypes.CDLL(None).syscall(101, 16, {a_pid}, 0, 0)", session="sigsys-b")
    assert rec["status"] == "crashed" and "SIGSYS" in rec["error"]["message"], rec
    assert pid_alive(a_pid) and value(b.run("kept", session="sigsys-a")) == "parent"


@pytest.mark.parametrize("user", USERS)
def test_221_the_same_at_landlock_abi_6(user):
    # ABI 6 is the oldest at which sessions may fork (signal and abstract-socket scopes).
    p = Pair(user, abi=6)
    try:
        the_catalogue_holds_in_a_fork(p)
    finally:
        p.close()


# ---------------------------------------------------------------------------------------------
# #222: nothing of one side is held by the other (descriptors, pipes, sockets, /tmp)
# ---------------------------------------------------------------------------------------------

def held_objects(pid: int) -> tuple[set, set]:
    """What a process holds, seen from outside: the files (device, inode) its descriptors name,
    and its pipes and sockets by the kernel's name."""
    files, channels = set(), set()
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{n}")
            st = os.stat(f"/proc/{pid}/fd/{n}")
        except FileNotFoundError:
            continue
        if target.startswith(("pipe:", "socket:", "anon_inode:")):
            channels.add(target)
        else:
            files.add((st.st_dev, st.st_ino))
    return files, channels


def tree(pid: int) -> set:
    """(device, inode) of a session directory and everything in it, walked from outside."""
    root = f"/proc/{pid}/cwd"
    found = {(os.stat(root).st_dev, os.stat(root).st_ino)}
    for d, dirs, names in os.walk(root):
        for n in dirs + names:
            st = os.lstat(os.path.join(d, n))
            found.add((st.st_dev, st.st_ino))
    return found


def test_222_neither_side_holds_a_descriptor_of_the_others_files_nor_reaches_its_tmp(pair):
    b = pair.box
    a_pid, b_pid = pair.pids["A"], pair.pids["B"]
    a_files, a_channels = held_objects(a_pid)
    b_files, b_channels = held_objects(b_pid)
    # A held its directory, two of its files and the host's pipes and socket when it forked.
    assert len(a_files) >= 3 and a_channels, (a_files, a_channels)
    assert not b_files & tree(a_pid) and not a_files & tree(b_pid), "a descriptor names the other side's file"
    assert not (a_channels & b_channels) - {"anon_inode:[eventfd]", "anon_inode:[eventpoll]"}, (a_channels, b_channels)
    # What B's code holds under A's names leads to B's copies or nowhere; A's later writes, by
    # path and through its descriptors, reach nothing of B's.
    value(b.run("open('secret.txt', 'w').write('A changed'); kept.write('a2'); kept.flush()\n"
                "open('a-later.txt', 'w').close()", session="A"))
    got = value(b.run(
        "reader.seek(0)\n"
        "(reader.read(), outcome(lambda: os.open('via-dir-fd', os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=dir_fd)),"
        " outcome(lambda: 'a-later.txt' in os.listdir(dir_fd)), sorted(os.listdir('.')), open('kept.txt').read())",
        session="B"))
    assert got[0] == "A only" and got[4] == "a1", got
    assert not got[1].startswith("ok") and got[2] != "ok:True" and "a-later.txt" not in got[3], got
    assert value(b.run("(os.path.exists('via-dir-fd'), open('kept.txt').read())", session="A")) == (False, "a1a2")
    if not b.private_tmp_is_namespace():
        return
    # /tmp (the parent's directory in the mount namespace B inherited): refused in Python with
    # the reason, and by C code (no Python hook) by the kernel, for A's later file too.
    value(b.run("open('/tmp/a-after-fork.txt', 'w').write('A')", session="A"))
    rec = b.run("open('/tmp/a-after-fork.txt').read()", session="B")
    assert rec["status"] == "error" and "a forked session has no /tmp" in rec["error"]["message"], rec
    got = value(b.run(
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def c_open(path, flags):\n"
        "    ctypes.set_errno(0)\n    fd = libc.open(path, flags, 0o600)\n"
        "    return 'ok' if fd >= 0 else ctypes.get_errno()\n"
        "[c_open(b'/tmp/a-after-fork.txt', os.O_RDONLY), c_open(b'/tmp/from-b', os.O_CREAT | os.O_WRONLY),"
        " c_open(b'/tmp', os.O_RDONLY | os.O_DIRECTORY), c_open(b'/tmp/../tmp/secret.txt', os.O_RDONLY)]",
        session="B"))
    assert got == [13, 13, 13, 13], got
    in_a_tmp = value(b.run("os.listdir('/tmp')", session="A"))
    assert "a-after-fork.txt" in in_a_tmp and "from-b" not in in_a_tmp, in_a_tmp


# ---------------------------------------------------------------------------------------------
# #223: forking to escape a limit (memory, scratch quota, the task cap)
# ---------------------------------------------------------------------------------------------

def test_223_a_fork_has_its_own_memory_limit_and_shares_none_of_its_parents(pair):
    b = pair.box
    limit = b.srv.info()["sandbox"]["limits"]["memory_bytes"]
    value(b.run(f"big = bytearray({int(limit * 0.45)}); big[::4096] = b'a' * len(big[::4096])", session="mem-a"))
    fork(b, "mem-a", "mem-b")
    # B writes every page of its copy (now its own memory), and cannot take more than its limit.
    assert value(b.run("big[::4096] = b'b' * len(big[::4096]); set(big[::4096])", session="mem-b")) == {ord("b")}
    rec = b.run(f"more = bytearray({int(limit * 0.6)})", session="mem-b")
    assert rec["status"] == "error" and rec["error"]["type"] == "MemoryError", rec
    assert value(b.run("len(big)", session="mem-b")) == int(limit * 0.45)
    # A keeps its bytes, and the room its own limit leaves it.
    assert value(b.run(f"more = bytearray({int(limit * 0.3)}); set(big[::4096])", session="mem-a")) == {ord("a")}
    b.srv.call("1", session="mem-b", reset=True)
    b.srv.call("1", session="mem-a", reset=True)


def test_223_a_forks_children_stop_at_its_task_cap(pair):
    b = pair.box
    cap = b.srv.info()["sandbox"]["limits"]["threads"]
    value(b.run("1", session="bomb-a"))
    fork(b, "bomb-a", "bomb-b")
    n, err = value(b.run(
        "import errno, time\nn, err = 0, None\n"
        "try:\n"
        "    while n < 5000:\n"
        "        if os.fork() == 0:\n            time.sleep(60); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n    err = errno.errorcode[e.errno]\n"
        "(n, err)", session="bomb-b", timeout_s=60))
    assert err == "EAGAIN" and 0 < n <= cap, (n, err, cap)
    assert value(b.run("'unaffected'", session="bystander")) == "unaffected"
    b.srv.call("1", session="bomb-b", reset=True)
    assert value(b.run("'still here'", session="bomb-a")) == "still here"


@pytest.mark.parametrize("user", USERS)
def test_223_a_fork_has_its_own_scratch_quota_counting_its_copy(user):
    b = with_scratch_quota(user, 16, IRONCELL_MAX_SESSIONS="40")
    try:
        if not forks_allowed(b):
            pytest.skip("sessions cannot fork here")
        value(b.run("open('ten', 'wb').write(b'a' * (10 << 20))\nstate = 'A'", session="q-a"))
        r = fork(b, "q-a", "q-b", "os.path.getsize('ten')")
        assert value(r["structuredContent"]) == 10 << 20
        # B's copy counts: 8 MiB more passes B's 16 MiB, not A's.
        rec = b.run("import time\nfor i in range(128):\n    open(f'b{i}', 'wb').write(b'b' * 65536)\ntime.sleep(5)",
                    session="q-b")
        assert rec["status"] == "scratch_quota", rec
        assert value(b.run("(state, os.path.getsize('ten'), len(os.listdir('.')))", session="q-a")) == ("A", 10 << 20, 1)
        value(b.run("open('four', 'wb').write(b'a' * (4 << 20))", session="q-a"))
        assert value(b.run("__import__('os').listdir('.')", session="q-b")) == []
    finally:
        b.close()


# ---------------------------------------------------------------------------------------------
# #224: a storm of forks against the live-session cap
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("user", USERS)
def test_224_a_storm_of_concurrent_forks_takes_the_free_slots_and_no_more(user):
    b = start(user, IRONCELL_MAX_SESSIONS="6")
    try:
        value(b.run("seed = 'A'", session="storm"))
        value(b.run("1", session="other"))
        # Ten forks sent at once, from the session and from its first fork: four slots are free.
        ids = {send(b, "run_python", {"code": "seed", "session": f"s{i}", "fork_from": "storm"}): f"s{i}"
               for i in range(6)}
        ids |= {send(b, "run_python", {"code": "seed", "session": f"t{i}", "fork_from": "s0"}): f"t{i}"
                for i in range(4)}
        got: dict[int, dict] = {}
        collect(b, set(ids), got)
        ok = [ids[i] for i, r in got.items() if not r["isError"]]
        refused = {ids[i]: r["content"][0]["text"] for i, r in got.items() if r["isError"]}
        assert len(ok) == 4, (ok, refused)
        assert all("live-session slots are taken" in t or "there is no session" in t for t in refused.values()), str(refused)
        assert all(got[i]["structuredContent"]["result"] == "'A'" for i in got if ids[i] in ok)
        # Nothing was evicted and the server holds the cap.
        assert value(b.run("seed", session="storm")) == "A" and value(b.run("'here'", session="other")) == "here"
        info = b.srv.info()["sessions"]
        assert len(info["forks"]) == 4 and info["known"] <= 6, info
    finally:
        b.close()


# ---------------------------------------------------------------------------------------------
# #225: pinning the parent, the zygote or the host with a fork
# ---------------------------------------------------------------------------------------------

def test_225_a_fork_ordered_while_its_parent_runs_waits_for_the_run_and_pins_nothing_else(pair):
    b = pair.box
    a_pid, a_dir = pid_and_dir(b, "busy")
    value(b.run("x = 1", session="busy"))
    # The parent's cell waits for a file the test writes; meanwhile a fork of it is ordered, and
    # other sessions (an existing one, a new one, a fork of another session) are served.
    running = send(b, "run_python", {"code": "import time\nopen('started', 'w').close()\n"
                                             "while not os.path.exists('go'):\n    time.sleep(0.01)\n"
                                             "x = 2\n'released'", "session": "busy"})
    assert wait_until(lambda: os.path.exists(f"/proc/{a_pid}/cwd/started"), timeout=30)
    forked = send(b, "run_python", {"code": "x", "session": "busy-kid", "fork_from": "busy"})
    b.sessions.add("busy-kid")
    others = {send(b, "run_python", {"code": "'served'", "session": s}) for s in ("bystander", "brand-new")}
    others.add(send(b, "run_python", {"code": "'served'", "session": "side-fork", "fork_from": "A"}))
    b.sessions.add("side-fork")
    got: dict[int, dict] = {}
    collect(b, others, got)
    assert all(got[i]["structuredContent"]["result"] == "'served'" for i in others), [got[i] for i in others]
    assert running not in got and forked not in got, ("ended before it was released", got.get(running), got.get(forked))
    Path(f"/proc/{a_pid}/cwd/go").touch()
    order = collect(b, {running, forked}, got)
    assert got[running]["structuredContent"]["result"] == "'released'"
    # The fork is a copy of the parent as its run left it, never of a half-run cell.
    assert value(got[forked]["structuredContent"]) == 2, got[forked]
    assert order.index(running) < order.index(forked), order


THREADS = (
    "import threading, time\nlock = threading.Lock()\nticks = [0]\nstop = threading.Event()\n"
    "def hold():\n    with lock:\n        stop.wait()\n"
    "def tick():\n    while not stop.is_set():\n        ticks[0] += 1; time.sleep(0.01)\n"
    "threading.Thread(target=hold, daemon=True).start()\nthreading.Thread(target=tick, daemon=True).start()\n"
    "while not lock.locked():\n    time.sleep(0.01)\n'started'"
)


def test_225_a_fork_of_a_session_whose_threads_run_or_hold_a_lock_pins_neither_side(pair):
    # Refused (#226: its threads would keep the parent's wider sandbox), at once; the parent's
    # threads go on, the lock stays theirs, and another session forks meanwhile.
    b = pair.box
    value(b.run(THREADS, session="threads"))
    r = fork(b, "threads", "threads-kid", "(threading.active_count(), lock.locked())")
    assert r["isError"] and "threads of its own code" in r["content"][0]["text"], r
    assert value(b.run("import time\nbefore = ticks[0]; time.sleep(0.1)\n(ticks[0] > before, lock.locked())",
                       session="threads")) == (True, True)
    assert value(fork(b, "A", "threads-side", "'side'")["structuredContent"]) == "side"
    value(b.run("stop.set()", session="threads"))


def test_225_a_fork_of_a_session_whose_threads_run_is_refused_up_front_with_the_reason(pair):
    # Its threads would keep the parent's pre-fork sandbox (#226); the fork says which and how
    # to end them, leaves nothing, and works once they ended.
    b = pair.box
    value(b.run(THREADS, session="threads-told"))
    r = fork(b, "threads-told", "threads-told-kid", "threading.active_count()")
    text = r["content"][0]["text"]
    assert r["isError"] and "has 2 threads of its own code" in text and "fork again" in text, text
    assert "threads-told-kid" not in [f["name"] for f in b.srv.info()["sessions"]["forks"]]
    assert value(b.run("stop.set()\nfor t in threading.enumerate()[1:]:\n    t.join()\nticks[0] > 0",
                       session="threads-told")) is True
    assert value(fork(b, "threads-told", "threads-told-kid", "threading.active_count()")["structuredContent"]) == 1


def test_225_a_fork_whose_at_fork_hook_never_returns_is_killed_when_cancelled(pair):
    # The hook hangs in the fork (after it narrowed, in a group of its own); the client's cancel
    # ends the call and the fork's process and group; the parent is served, and forks again
    # once its hook lets go.
    b = pair.box
    a_pid = value(b.run("import threading, time\nHANG = True\nPARENT = os.getpid()\n"
                        "def hang():\n    while HANG and os.getpid() != PARENT:\n        time.sleep(0.05)\n"
                        "os.register_at_fork(after_in_child=hang)\nPARENT", session="hangs"))
    zygote = value(b.run("os.getppid()", session="hangs"))
    sid = os.getsid(a_pid)

    def stuck() -> list[int]:
        found = []
        for p in os.listdir("/proc"):
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if p.isdigit() and int(p) != a_pid and int(fields[1]) == zygote and int(fields[3]) == sid:
                found.append(int(p))
        return found

    rid = send(b, "run_python", {"code": "'never'", "session": "hangs-kid", "fork_from": "hangs"})
    b.sessions.add("hangs-kid")
    assert wait_until(lambda: len(stuck()) == 1, timeout=30), stuck()
    (kid,) = stuck()
    assert os.getpgid(kid) == kid  # it left the parent's group before the hook ran
    b.srv.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": rid}})
    assert wait_until(lambda: not pid_alive(kid), timeout=15), "the cancelled fork's process still runs"
    assert value(b.run("'served'", session="hangs")) == "served"
    assert "hangs-kid" not in [f["name"] for f in b.srv.info()["sessions"]["forks"]]
    value(b.run("HANG = False", session="hangs"))
    assert value(fork(b, "hangs", "hangs-kid", "'forked'")["structuredContent"]) == "forked"


def test_225_a_fork_of_a_session_that_imported_numpy_pandas_and_matplotlib_works(pair):
    # Their libraries' threads (OpenBLAS stops its pool at a fork; numexpr's runs on one
    # thread in a worker) do not make such a session's forks refused.
    b = pair.box
    have = value(b.run("import importlib.util\n"
                       "all(importlib.util.find_spec(m) for m in ('numpy', 'pandas', 'matplotlib'))", session="data"))
    if not have:
        pytest.skip("numpy, pandas or matplotlib is not installed for the test Python")
    value(b.run("import numpy as np, pandas as pd, matplotlib.pyplot as plt\n"
                "df = pd.DataFrame({'a': np.arange(100000)})\ns = float((np.ones((200, 200)) @ np.ones((200, 200))).sum())\n"
                "plt.plot([1, 2]); plt.savefig('p.png')\nint(df.eval('a * 2').sum())", session="data"))
    r = fork(b, "data", "data-kid", "(s, int(df.eval('a * 2').sum()), os.path.exists('p.png'))")
    assert not r["isError"], r["content"][0]["text"]
    assert value(r["structuredContent"]) == (40000 * 200.0, 9999900000, True)


# An at-fork hook that, in the fork before it narrows, makes a process of its own (a double fork,
# so the zygote adopts it; its own group) which says `ready` on the fork's socket naming itself
# and then runs the fork's cells in the parent's pre-fork sandbox; the fork itself never speaks.
IMPOSTOR = r'''
import os, stat, struct, json, time
PARENT_DIR = os.getcwd()
forging = [False]
def frame(fd, msg):
    body = json.dumps(msg).encode()
    os.write(fd, struct.pack(">I", len(body) + 1) + b"J" + body)
def read_exact(fd, n):
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out
def impostor(sock, middle):
    os.setpgid(0, 0)
    while os.getppid() == middle:  # until the zygote adopted it
        time.sleep(0.001)
    frame(sock, {"op": "ready", "pid": os.getpid()})
    scope = {"os": os, "outcome": outcome}
    while True:
        size, = struct.unpack(">I", read_exact(sock, 4))
        data = read_exact(sock, size)
        msg = json.loads(data[1:])
        if msg.get("op") != "run":
            continue
        try:
            result, error, status = repr(eval(msg["code"], scope)), None, "ok"
        except BaseException as e:
            result, status = None, "error"
            error = {"type": type(e).__name__, "message": str(e), "traceback": ""}
        frame(sock, {"op": "done", "id": msg["id"], "status": status, "result": result, "error": error,
                     "exit_code": None, "images": []})
def forge():
    if forging[0] or os.getcwd() != PARENT_DIR:
        return
    forging[0] = True
    socks = []
    for fd in range(3, 1024):
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                socks.append(fd)
        except OSError:
            pass
    c = os.fork()
    if c == 0:
        middle = os.getpid()
        if os.fork() == 0:
            try:
                impostor(socks[-1], middle)
            finally:
                os._exit(0)
        os._exit(0)
    os.waitpid(c, 0)
    time.sleep(3600)
os.register_at_fork(after_in_child=forge)
'''


def test_226_a_process_an_at_fork_hook_prepares_cannot_pose_as_the_fork(pair):
    b = pair.box
    _, a_dir = pid_and_dir(b, "posed")
    value(b.run(IMPOSTOR, session="posed"))
    r = fork(b, "posed", "posed-kid")
    if r["isError"]:
        return
    kid_pid = value(b.run("os.getpid()", session="posed-kid"))
    try:
        value(b.run("open('a-later.txt', 'w').write('A later')", session="posed"))
        got = value(b.run(f"(outcome(lambda: open({a_dir!r} + '/a-later.txt').read()),"
                          f" outcome(lambda: open({a_dir!r} + '/planted-by-the-fork', 'w').write('x')))",
                          session="posed-kid"))
        assert got == ("PermissionError:13", "PermissionError:13"), got
        assert "planted-by-the-fork" not in value(b.run("os.listdir('.')", session="posed"))
    finally:
        # Whatever answers as the fork may not follow the protocol's ending: it is stopped first.
        os.kill(kid_pid, 9)
        for s in ("posed-kid", "posed"):
            b.srv.call("1", session=s, reset=True)


# ---------------------------------------------------------------------------------------------
# #227: Landlock layers, which a session that may fork is allowed to add
# ---------------------------------------------------------------------------------------------

# A layer handling every filesystem right of ABI 1-7 and granting all of them beneath `/`: a
# layer can only take rights away, so the fork gains nothing. Returns what the calls answered.
WIDEN = r'''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
class Ruleset(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]
class Beneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]
ALL = (1 << 16) - 1
ruleset = libc.syscall(444, ctypes.byref(Ruleset(ALL, 0, 0)), ctypes.sizeof(Ruleset), 0)
root = os.open("/", os.O_PATH)
added = libc.syscall(445, ruleset, 1, ctypes.byref(Beneath(ALL, root)), 0)
restricted = libc.syscall(446, ruleset, 0)
(ruleset >= 0, added, restricted)
'''

STACK = (
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nn = 0\n"
    "attr = (ctypes.c_uint64 * 3)(0, 0, 2)\n"
    "while n < 40:\n"
    "    fd = libc.syscall(444, ctypes.byref(attr), 24, 0)\n"
    "    if fd < 0 or libc.syscall(446, fd, 0) != 0:\n        break\n"
    "    os.close(fd); n += 1\n"
    "n"
)


@pytest.fixture(scope="module", params=USERS)
def layers_box(request):
    b = start(request.param)
    yield b
    b.close()


def test_227_a_layer_of_the_forks_own_that_grants_everything_widens_nothing(layers_box):
    b = layers_box
    _, a_dir = pid_and_dir(b, "wide-a")
    fork(b, "wide-a", "wide-b")
    assert value(b.run(WIDEN, session="wide-b")) == (True, 0, 0)
    got = value(b.run(
        f"[outcome(lambda: open('/etc/passwd').read()), outcome(lambda: os.listdir({a_dir!r})),"
        f" outcome(lambda: open({a_dir!r} + '/planted', 'w')), outcome(lambda: open('/var/tmp/wide', 'w')),"
        " outcome(lambda: os.listdir('/')), outcome(lambda: os.kill(os.getppid(), 0)),"
        " outcome(lambda: open('mine', 'w').write('x'))]", session="wide-b"))
    assert got == ["PermissionError:13"] * 5 + ["PermissionError:1", "ok:1"], got


def test_227_forks_of_one_session_stop_at_its_layers_with_the_reason_and_a_reset_gives_them_back(layers_box):
    b = layers_box
    value(b.run("x = 'A'", session="siblings"))
    n = 0
    while n < 20:
        r = fork(b, "siblings", f"sib{n}", "x")
        if r["isError"]:
            break
        n += 1
    text = r["content"][0]["text"]
    assert n == b.srv.info()["sessions"]["max_fork_depth"] == 11 and "Landlock layer" in text, (n, text)
    assert value(b.run("x", session="siblings")) == "A" and value(b.run("x", session="sib10")) == "A"
    b.srv.call("1", session="siblings", reset=True)
    assert not fork(b, "siblings", "sib-after-reset")["isError"]
    for i in range(n):
        b.srv.call("1", session=f"sib{i}", reset=True)


def test_227_a_fork_that_used_up_its_own_layers_cannot_fork_and_its_parent_still_can(layers_box):
    b = layers_box
    value(b.run("1", session="stack-a"))
    fork(b, "stack-a", "stack-b")
    n = value(b.run(STACK, session="stack-b"))
    assert 0 < n < 16, n
    r = fork(b, "stack-b", "stack-c")
    assert r["isError"] and "cannot fork" in r["content"][0]["text"], r
    rec = b.run("1", session="stack-b")
    assert rec["session_state"] in ("restarted", "new") or "failed fork" in str(rec), rec
    # The parent's layers are its own: it forks as before.
    r = fork(b, "stack-a", "stack-d", "'forked'")
    assert not r["isError"] and value(r["structuredContent"]) == "forked", r


# ---------------------------------------------------------------------------------------------
# #228: the uid's kernel memory through forks; forks below Landlock ABI 6
# ---------------------------------------------------------------------------------------------

def test_228_forks_of_forks_take_no_more_epoll_watches_than_a_session_may(pair):
    # Epoll watches are kernel memory the whole uid shares (#115, #200). Whether a fork shares
    # its parent's share or gets its own, no side of a fork takes more than one share, and they
    # come back when the sides are gone.
    b = pair.box
    epoll = b.srv.info()["sandbox"]["epoll_watches"]
    share, before = epoll["per_session"], epoll["held"]
    assert value(b.run(EPOLL_FILL, session="ep-a")) == (share, "ENOSPC")
    fork(b, "ep-a", "ep-b")
    fork(b, "ep-b", "ep-c")
    sides = ("ep-a", "ep-b", "ep-c")
    for s in sides[1:]:
        added, err = value(b.run(EPOLL_FILL, session=s))
        assert added <= share and err == "ENOSPC", (s, added, err)
    held = b.srv.info()["sandbox"]["epoll_watches"]["held"]
    assert share <= held - before <= len(sides) * share, (held, before, share)
    for s in sides:
        b.srv.call("1", session=s, reset=True)
    assert wait_until(lambda: b.srv.info()["sandbox"]["epoll_watches"]["held"] <= before, timeout=30)


@pytest.mark.parametrize("abi", [1, 3, 4])
@pytest.mark.parametrize("user", USERS)
def test_228_below_landlock_abi_6_a_fork_is_refused_up_front_with_the_reason(user, abi):
    # test_fork.py holds ABI 5; on older kernels the refusal is the same, and nothing is left.
    b = Sandboxed(user, abi_max=abi)
    try:
        value(b.run("a = 1", session="one"))
        r = fork(b, "one", "two", "a")
        text = r["content"][0]["text"]
        assert r["isError"] and "sessions cannot fork here" in text and f"ABI {abi}" in text, text
        assert value(b.run("a", session="one")) == 1
        assert [f["name"] for f in b.srv.info()["sessions"]["forks"]] == []
        assert b.run("'a' in globals()", session="two")["result"] == "False"
    finally:
        b.close()


# ---------------------------------------------------------------------------------------------
# #226: what the parent's code left running before the fork (threads, children, at-fork hooks)
# ---------------------------------------------------------------------------------------------

# File calls through libc: the kernel's answer, without the runner's Python-level `/tmp` check.
C_IO = r'''
import ctypes, threading, queue
libc = ctypes.CDLL(None, use_errno=True)
def c_read(path):
    fd = libc.open(path.encode(), os.O_RDONLY)
    if fd < 0:
        raise OSError(ctypes.get_errno(), path)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)
def c_write(path, data):
    fd = libc.open(path.encode(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    if fd < 0:
        raise OSError(ctypes.get_errno(), path)
    os.write(fd, data.encode())
    os.close(fd)
    return "written"
'''

# A thread started before the fork that runs what it is given, later.
OLD_THREAD = C_IO + r'''
jobs, answers = queue.Queue(), queue.Queue()
def serve():
    while True:
        answers.put(outcome(jobs.get()))
threading.Thread(target=serve, daemon=True).start()
def later(f):
    jobs.put(f)
    return answers.get(timeout=30)
'''

# A child forked before the fork that runs what it is sent over a pipe, later.
OLD_CHILD = C_IO + r'''
cmd_r, cmd_w = os.pipe()
out_r, out_w = os.pipe()
if os.fork() == 0:
    os.close(cmd_w)
    for line in os.fdopen(cmd_r):
        os.write(out_w, (repr(outcome(eval(line))) + "\n").encode())
    os._exit(0)
os.close(cmd_r)
os.close(out_w)
replies = os.fdopen(out_r)
def later(f):
    os.write(cmd_w, (f + "\n").encode())
    return __import__('ast').literal_eval(replies.readline())
'''

# The same child, whose main thread ended with the raw exit call (SYS_exit ends one thread) while
# a thread of it serves: its stat shows the leader's `Z`, which the host's check of the parent took
# for a zombie, and the fork went on (#299).
OLD_LEADERLESS_CHILD = OLD_CHILD.replace(
    "    for line in os.fdopen(cmd_r):\n"
    "        os.write(out_w, (repr(outcome(eval(line))) + \"\\n\").encode())\n"
    "    os._exit(0)\n",
    "    def serve():\n"
    "        for line in os.fdopen(cmd_r):\n"
    "            os.write(out_w, (repr(outcome(eval(line))) + \"\\n\").encode())\n"
    "        os._exit(0)\n"
    "    threading.Thread(target=serve).start()\n"
    "    libc.syscall(60, 0)\n",
) + "import time\ntime.sleep(0.5)  # for the child's main thread to have ended when the fork is ordered\n"
assert "syscall(60" in OLD_LEADERLESS_CHILD

HOLE = ("HOLE (issue-52 tests): the fork narrows only the thread that forks; a thread or child the "
        "parent started before the fork keeps the parent's pre-fork Landlock domain, which grants the "
        "parent's forks area where the fork's directory is made (and, for a thread, may signal the fork)")


@pytest.mark.parametrize("left", ["thread", "child", "leaderless-child"])
def test_226_what_the_parent_left_running_before_the_fork_cannot_reach_the_forks_later_files(pair, left):
    b = pair.box
    a, kid = f"left-{left}", f"left-{left}-kid"
    value(b.run({"thread": OLD_THREAD, "child": OLD_CHILD, "leaderless-child": OLD_LEADERLESS_CHILD}[left], session=a))
    r = fork(b, a, kid, "open('b-secret.txt', 'w').write('B only')\nos.getcwd()")
    if r["isError"]:  # refused up front (with the reason) is a fix too
        text = r["content"][0]["text"]
        assert left.split("-")[-1] in text and "fork again" in text, r
        assert value(b.run("'served'", session=a)) == "served"
        return
    kid_dir = value(r["structuredContent"])
    kid_pid, _ = pid_and_dir(b, kid)
    read = f"lambda: c_read({kid_dir + '/b-secret.txt'!r})"
    write = f"lambda: c_write({kid_dir + '/planted-by-parent'!r}, 'x')"
    signal = f"lambda: os.kill({kid_pid}, 0)"
    if left == "thread":
        got = value(b.run(f"(outcome({read}), outcome({signal}), later({read}), later({write}), later({signal}))", session=a))
    else:
        got = value(b.run(f"(outcome({read}), outcome({signal}), later({read!r}), later({write!r}), later({signal!r}))",
                          session=a))
    # The parent's own (forking) thread is refused.
    assert got[:2] == ("PermissionError:13", "PermissionError:1"), got
    assert got[2:] == ("PermissionError:13", "PermissionError:13", "PermissionError:1"), got
    assert value(b.run("os.listdir('.')", session=kid)) == ["b-secret.txt"]


def test_226_a_thread_an_at_fork_hook_starts_in_the_fork_cannot_carry_its_data_to_the_parent(pair):
    b = pair.box
    value(b.run(C_IO + r'''
import __main__
PARENT_DIR = os.getcwd()
spy_done = threading.Event()
def spy():
    # In the fork, once its code wrote the secret: copy it into the parent's directory.
    while not os.path.exists("b-secret.txt"):
        time.sleep(0.01)
    __main__.spied = outcome(lambda: c_write(PARENT_DIR + "/leaked", c_read("b-secret.txt")))
    spy_done.set()
def hook():
    if os.getcwd() == PARENT_DIR:
        threading.Thread(target=spy, daemon=True).start()
import time
os.register_at_fork(after_in_child=hook)
''', session="hooked"))
    r = fork(b, "hooked", "hooked-kid", "open('b-secret.txt', 'w').write('B only')\n"
             "spy_done.wait(10) if threading.active_count() > 1 else None\nglobals().get('spied')")
    if not r["isError"]:
        assert value(r["structuredContent"]) in (None, "PermissionError:13", "FileNotFoundError:2"), r
    assert value(b.run("os.path.exists('leaked')", session="hooked")) is False


@pytest.mark.parametrize("user", USERS)
def test_223_a_fork_whose_copy_would_pass_the_disk_floor_is_refused_with_the_numbers(user):
    # A floor above any disk: a fork with files to copy is refused with the reason, up front.
    b = start(user, IRONCELL_MIN_FREE_DISK="1000000g")
    try:
        value(b.run("open('data', 'wb').write(b'd' * (3 << 20))", session="disk-a"))
        r = fork(b, "disk-a", "disk-b")
        text = r["content"][0]["text"]
        assert r["isError"] and "copying its files (3 MiB)" in text and "IRONCELL_MIN_FREE_DISK" in text, text
        assert [f["name"] for f in b.srv.info()["sessions"]["forks"]] == []
    finally:
        b.close()


def group_members(pgid: int) -> set[int]:
    """The live processes of a process group, from /proc."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.add(int(entry))
    return found


def fork_stuck_in_a_hook(b: Sandboxed, own_group: bool = False) -> tuple[int, int, str]:
    """A session whose at-fork hook never returns in the child (which, with `own_group`, calls
    `setpgid(0, 0)` too; the fork leads a group of its own before any hook runs), and a fork of
    it ordered: the session's pid, the stuck process (the zygote's child in the session's
    session id that is not the session's worker, found from outside), the fork's background job."""
    a_pid, _ = pid_and_dir(b, "hang")
    zygote = value(b.run("os.getppid()", session="hang"))
    sid = os.getsid(a_pid)
    leave = "os.setpgid(0, 0); " if own_group else ""
    value(b.run("import time\nPARENT = os.getpid()\n"
                f"def hang():\n    if os.getpid() != PARENT:\n        {leave}time.sleep(3600)\n"
                "os.register_at_fork(after_in_child=hang)\nx = 1", session="hang"))
    r = fork(b, "hang", "hang-kid", "x")
    rec = r["structuredContent"]
    assert rec["status"] == "running", r

    def stuck() -> list[int]:
        found = []
        for p in os.listdir("/proc"):
            if not p.isdigit() or int(p) == a_pid:
                continue
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == zygote and int(fields[3]) == sid:
                found.append(int(p))
        return found

    assert wait_until(lambda: len(stuck()) == 1, timeout=30), stuck()
    (kid,) = stuck()
    assert os.getpgid(kid) == kid  # the fork left the parent's group before the hook ran
    return a_pid, kid, rec["job"]


@pytest.mark.parametrize("user", USERS)
def test_225_a_fork_whose_at_fork_hook_never_returns_pins_nobody_and_is_ended_by_its_cancel(user):
    b = start(user, IRONCELL_WAIT_BUDGET="2s")
    try:
        a_pid, stuck, job = fork_stuck_in_a_hook(b)
        assert value(b.run("x", session="hang")) == 1
        assert value(b.run("'served'", session="other")) == "served"
        assert not fork(b, "other", "other-kid")["isError"]
        # The parent resets and runs on; the stuck fork (a group of its own) waits for its
        # job's cancel or its 120 s, which end it (the next test).
        b.srv.call("1", session="hang", reset=True)
        assert value(b.run("'again'", session="hang")) == "again"
        r = b.srv.request("tools/call", {"name": "run_python_job", "arguments": {"job": job, "action": "cancel"}},
                          timeout=60)["result"]
        assert wait_until(lambda: not pid_alive(stuck), timeout=30), (stuck, r)
    finally:
        b.close()


@pytest.mark.parametrize("user", USERS)
def test_225_cancelling_a_fork_that_never_becomes_ready_ends_it(user):
    b = start(user, IRONCELL_WAIT_BUDGET="2s")
    try:
        _, stuck, job = fork_stuck_in_a_hook(b)
        r = b.srv.request("tools/call", {"name": "run_python_job", "arguments": {"job": job, "action": "cancel"}},
                          timeout=60)["result"]
        said = r.get("structuredContent", {}).get("status") or r["content"][0]["text"]
        assert said != "running" and "cancel" in said, r
        assert wait_until(lambda: not pid_alive(stuck), timeout=30), stuck
        assert value(b.run("x", session="hang")) == 1
    finally:
        b.close()


@pytest.mark.parametrize("user", USERS)
def test_225_a_fork_that_never_became_ready_dies_with_a_killed_server(user):
    # Left in the parent's group it dies or not as the zygote's ending races (2 of 12 runs);
    # in a group of its own (setpgid(0, 0), which a fork may call) nothing reaches it.
    b = start(user, IRONCELL_WAIT_BUDGET="2s")
    _, stuck, _ = fork_stuck_in_a_hook(b, own_group=True)
    b.srv.proc.kill()
    b.srv.proc.wait()
    try:
        # The session's own processes are gone within a second of the server.
        assert wait_until(lambda: not pid_alive(stuck), timeout=5), stuck
    finally:
        if pid_alive(stuck):
            os.kill(stuck, 9)


def test_226_a_thread_a_before_hook_starts_in_the_parent_stops_the_fork(pair):
    # `os.register_at_fork(before=...)` runs in the parent before it forks, so the thread keeps
    # its pre-fork domain: the host finds it once the parent narrowed, before the fork copies
    # anything, and refuses with the reason.
    b = pair.box
    value(b.run("import threading\nhold = threading.Event()\n"
                "os.register_at_fork(before=lambda: threading.Thread(target=hold.wait, daemon=True).start())",
                session="before-hook"))
    r = fork(b, "before-hook", "before-hook-kid", "'forked'")
    text = r["content"][0]["text"]
    assert r["isError"] and "1 thread of its own code" in text, text
    assert value(b.run("hold.set()\n'served'", session="before-hook")) == "served"
    assert "before-hook-kid" not in [f["name"] for f in b.srv.info()["sessions"]["forks"]]


# ---------------------------------------------------------------------------------------------
# #311: ironcell's own threads of a parent keep its pre-fork domain; no code of the session runs there
# ---------------------------------------------------------------------------------------------

# Run in A after the fork (A's later code): a native (ctypes) handler for SIGUSR1, and the same
# handler for glibc's two internal signals through the raw call (glibc's `sigaction` refuses
# them, and its `pthread_sigmask` never blocks them). Then each of A's threads but the main one
# is sent SIGUSR1; the handler lists and writes B's directory from whichever thread it runs on.
# The main thread (narrowed) is sent one too: the handler does run, and is refused there.
HANDLER_ON_OWN_THREADS = r'''
import ctypes, errno, os, threading, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
B = BDIR
seen = []
def attempt(f):
    try:
        return ('ok', f())
    except OSError as e:
        return (type(e).__name__, e.errno)
def on_signal(signum):
    seen.append((signum, threading.get_native_id() == main,
                 attempt(lambda: sorted(os.listdir(B))),
                 attempt(lambda: open(B + '/planted-by-A', 'w').write('A'))))
handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(on_signal)
libc.signal(10, handler)
class Action(ctypes.Structure):
    _fields_ = [('handler', ctypes.c_void_p), ('flags', ctypes.c_ulong),
                ('restorer', ctypes.c_void_p), ('mask', ctypes.c_ulong)]
usr1 = Action()
libc.syscall(13, 10, None, ctypes.byref(usr1), 8)   # rt_sigaction: SIGUSR1's, as glibc set it
installed = {}
for internal in (32, 33):
    ctypes.set_errno(0)
    got = libc.syscall(13, internal, ctypes.byref(usr1), None, 8)
    installed[internal] = (got, ctypes.get_errno())
main = threading.get_native_id()
me = os.getpid()
others = [t for t in TIDS if t != main]   # read by the test from /proc/<pid>/task
for t in others:
    libc.syscall(234, me, t, 10)
libc.syscall(234, me, main, 10)
time.sleep(0.5)
(installed, len(others), seen)
'''


@pytest.mark.parametrize("abi", [None, 6], ids=["abi-of-the-host", "abi-6"])
@pytest.mark.parametrize("user", USERS)
def test_311_no_handler_of_the_parents_code_runs_on_its_own_pre_fork_threads(user, abi):
    b = start(user, abi)
    try:
        a_pid, _ = pid_and_dir(b, "sig-a")
        fork(b, "sig-a", "sig-b", "open('b-secret.txt', 'w').write('B only')")
        _, b_dir = pid_and_dir(b, "sig-b")
        tids = sorted(int(t) for t in os.listdir(f"/proc/{a_pid}/task"))
        code = HANDLER_ON_OWN_THREADS.replace("BDIR", repr(b_dir)).replace("TIDS", repr(tids))
        installed, others, seen = value(b.run(code, session="sig-a", timeout_s=60))
        eperm = (-1, errno.EPERM)
        assert installed == {32: eperm, 33: eperm}, installed
        assert others >= 2, others                     # the reader and the output pump
        # The handler ran on the main thread only (so it does run), refused there by its domain.
        assert [s[:2] for s in seen] == [(10, True)], seen
        assert seen[0][2][0] == "PermissionError" and seen[0][3][0] == "PermissionError", seen
        assert value(b.run("sorted(os.listdir('.'))", session="sig-b")) == ["b-secret.txt"]
        # glibc's own handler of SIGSETXID is in place (the zygote had it installed): `setuid`,
        # which sends it to every other thread, is refused by the filter, not killed by it.
        assert value(b.run("try:\n    os.setuid(os.getuid())\nexcept PermissionError:\n    r = 'refused'\nr",
                           session="sig-b")) == "refused"
    finally:
        b.close()
