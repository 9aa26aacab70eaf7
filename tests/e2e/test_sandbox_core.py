"""The sandbox core's holes of 2026-12-06 (docs/SECURITY.md #151-#156), attacked from inside
through run_python, as root and as `nobody`, at the Landlock ABIs where each matters."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import RawServer, shared_tmp_dir
from test_sandbox import USERS, Sandboxed, root_threads_capped, worker_uid

# ---------------------------------------------------------------------------------------------
# #151: an open that truncates without write access, and the other write-ish flags and calls
# ---------------------------------------------------------------------------------------------

CONTENT = "precious bytes that must survive\n"

# Each attack names the victim as V; every one must fail, and the victim keep its bytes.
WRITEISH = {
    "rdonly_trunc": ("os.open(V, os.O_RDONLY | os.O_TRUNC)", {"PermissionError:1"}),
    "rdonly_trunc_creat_cloexec": ("os.open(V, os.O_RDONLY | os.O_TRUNC | os.O_CREAT | os.O_CLOEXEC)", {"PermissionError:1"}),
    "rdonly_trunc_nonblock_noatime": ("os.open(V, os.O_RDONLY | os.O_TRUNC | os.O_NONBLOCK | os.O_NOFOLLOW)", {"PermissionError:1"}),
    "accmode3_trunc": ("os.open(V, 3 | os.O_TRUNC)", {"PermissionError:1"}),
    "accmode3": ("os.open(V, 3)", {"PermissionError:1"}),
    "rdonly_trunc_dir_fd": ("os.open(os.path.basename(V), os.O_RDONLY | os.O_TRUNC, dir_fd=os.open(os.path.dirname(V), os.O_RDONLY))", {"PermissionError:1", "PermissionError:13"}),
    "libc_open_trunc": ("(lambda c: (c.CDLL(None, use_errno=True).open(V.encode(), 0o1000), c.get_errno()))(__import__('ctypes'))", {"ok:(-1, 1)"}),
    # openat2(AT_FDCWD, V, {flags: O_TRUNC}, 24): its flags are out of the filter's reach.
    "openat2_trunc": ("(lambda c: (c.CDLL(None, use_errno=True).syscall(437, -100, V.encode(), c.byref((c.c_uint64 * 3)(0o1000, 0, 0)), 24), c.get_errno()))(__import__('ctypes'))", {"ok:(-1, 38)"}),
    "wronly_trunc": ("os.open(V, os.O_WRONLY | os.O_TRUNC)", {"PermissionError:13"}),
    "rdwr": ("open(V, 'r+')", {"PermissionError:13"}),
    "append": ("open(V, 'a')", {"PermissionError:13"}),
    "rdonly_append_write": ("os.write(os.open(V, os.O_RDONLY | os.O_APPEND), b'x')", {"OSError:9", "PermissionError:13"}),
    "truncate": ("os.truncate(V, 0)", {"PermissionError:1"}),
    "ftruncate_rdonly": ("os.ftruncate(os.open(V, os.O_RDONLY), 0)", {"OSError:22", "OSError:9", "PermissionError:13"}),
    "fallocate_rdonly": ("os.posix_fallocate(os.open(V, os.O_RDONLY), 0, 1 << 20)", {"OSError:9", "PermissionError:13"}),
    "copy_file_range_into": ("os.copy_file_range(os.open((open('src', 'w').write('abc'), 'src')[1], os.O_RDONLY), os.open(V, os.O_RDONLY), 3)", {"OSError:9", "PermissionError:13"}),
    "creat_beside": ("os.open(V + '.new', os.O_RDONLY | os.O_CREAT)", {"PermissionError:13"}),
    "tmpfile_in_dir": ("os.open(os.path.dirname(V), os.O_TMPFILE | os.O_RDWR)", {"PermissionError:13", "OSError:95"}),
    "rename_over": ("os.rename('/dev/null', V)", {"PermissionError:13", "OSError:18"}),
    "open_by_handle_at": ("__import__('ctypes').CDLL(None).syscall(304, -100, 0, 0)", {"crashed"}),
}


def victims_of(user: str) -> tuple[Path, Path]:
    """A file in an --allow-read folder and one outside every grant, both owned by the worker's
    uid and writable by it as far as file modes go (only the sandbox stands in the way)."""
    granted = shared_tmp_dir("/var/tmp") / "granted"
    granted.mkdir()
    outside = shared_tmp_dir("/var/tmp")
    files = []
    for d in (granted, outside):
        f = d / "notes.txt"
        f.write_text(CONTENT)
        os.chown(f, worker_uid(user), -1)
        os.chown(d, worker_uid(user), -1)
        f.chmod(0o666)
        files.append(f)
    return files[0], files[1]


@pytest.mark.parametrize("user,abi", [(u, a) for u in USERS for a in (1, 2, 3, 4, 5, None)])
def test_151_no_open_flag_or_call_writes_a_file_the_code_may_only_read(user, abi):
    granted, outside = victims_of(user)
    b = Sandboxed(user, abi_max=abi, IRONCELL_ALLOW_READ=str(granted.parent))
    try:
        assert b.outcome(f"open({str(granted)!r}).read()") == "ok:" + repr(CONTENT)
        for victim in (granted, outside):
            for name, (attack, expected) in WRITEISH.items():
                code = attack.replace("V", repr(str(victim)))
                if "crashed" in expected:
                    rec = b.run(code, session=f"kill-{name}")
                    assert rec["status"] == "crashed" and "SIGSYS" in rec["error"]["message"], (name, rec)
                    continue
                got = b.outcome(code)
                assert got in expected, (name, str(victim), got)
            assert victim.read_text() == CONTENT, victim
            assert not Path(str(victim) + ".new").exists()
        # The session's own files: writing, truncating for writing and reading all work; only
        # the read-only truncating open is refused there too (one rule on every ABI).
        own = ("open('own.txt', 'w').write('x' * 10)\n"
               "fd = os.open('own.txt', os.O_WRONLY | os.O_TRUNC); os.close(fd)\n"
               "(os.path.getsize('own.txt'), outcome(lambda: os.open('own.txt', os.O_RDONLY | os.O_TRUNC)))")
        rec = b.run(own)
        assert rec["status"] == "ok", rec
        assert ast.literal_eval(rec["result"]) == (0, "PermissionError:1")
    finally:
        b.close()
        shutil.rmtree(granted.parent, ignore_errors=True)
        shutil.rmtree(outside.parent, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# #152: extended attributes by path
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("user", USERS)
def test_152_xattrs_of_host_files_cannot_be_read_by_path(user):
    d = shared_tmp_dir("/var/tmp")
    f = d / "download.zip"
    f.write_text("zip")
    try:
        os.setxattr(f, "user.xdg.origin.url", b"https://example.invalid/file?token=SECRET123")
    except OSError as e:  # a filesystem without user xattrs: nothing to leak, nothing to test
        pytest.skip(f"no user xattrs on /var/tmp: {e}")
    b = Sandboxed(user)
    try:
        v = repr(str(f))
        for call in (f"os.getxattr({v}, 'user.xdg.origin.url')",
                     f"os.getxattr({v}, 'user.xdg.origin.url', follow_symlinks=False)",
                     f"os.listxattr({v})", f"os.listxattr({v}, follow_symlinks=False)"):
            assert b.outcome(call) == "OSError:95", call
        # The descriptor forms still work on the session's own files, and copies still work.
        rec = b.run("open('a', 'w').write('x')\nimport shutil; shutil.copy2('a', 'b')\n"
                    "fd = os.open('a', os.O_RDONLY)\n(os.listxattr(fd), open('b').read())")
        assert rec["status"] == "ok", rec
        assert ast.literal_eval(rec["result"])[1] == "x"
    finally:
        b.close()
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# #153: each session's thread cap is its own
# ---------------------------------------------------------------------------------------------

HOLD_THREADS = r'''
import threading
threading.stack_size(32768)
held_event = threading.Event()
held, err = [], None
try:
    for _ in range(20000):
        t = threading.Thread(target=held_event.wait, daemon=True)
        t.start()
        held.append(t)
except RuntimeError as e:
    err = str(e)
threading.stack_size(0)
(len(held), err)
'''


@pytest.mark.parametrize("user", USERS)
def test_153_sessions_in_a_row_each_get_the_same_thread_cap_and_the_machine_can_still_fork(user):
    if user == "root" and not root_threads_capped():
        pytest.skip("root without a writable pids cgroup: nothing caps threads (doctor says so)")
    b = Sandboxed(user)
    try:
        counts = []
        for n in range(6):
            rec = b.run(HOLD_THREADS, session=f"hold-{n}", timeout_s=120)
            assert rec["status"] == "ok", rec
            started, err = ast.literal_eval(rec["result"])
            assert err == "can't start new thread", rec
            counts.append(started)
        # Every session stops at the policy's 256, whatever the sessions before it hold (the cap
        # once doubled with each session: 367, 738, 1,479, ...).
        assert all(16 <= c <= 256 for c in counts), counts
        assert max(counts) - min(counts) <= 8, counts
        # With all six holding their threads, anyone on the machine can still start a process.
        prefix = [] if user == "root" else ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        assert subprocess.run([*prefix, "/bin/true"], timeout=30).returncode == 0
        for n in range(6):
            assert b.run("held_event.set(); [t.join() for t in held]; 'released'", session=f"hold-{n}")["status"] == "ok"
    finally:
        b.close()


def hold(n: int) -> str:
    return ("import threading\nthreading.stack_size(32768)\nev = globals().setdefault('ev', threading.Event())\n"
            f"for _ in range({n}):\n    threading.Thread(target=ev.wait, daemon=True).start()\n"
            "threading.stack_size(0)\nthreading.active_count()")


def test_153_without_a_user_namespace_each_session_still_has_its_own_threads():
    # Where the kernel refuses user namespaces (forced here), the uid's count is shared: a
    # session's threads must not come out of the room of a session started before it.
    b = Sandboxed("nobody", IRONCELL_PRIVATE_TMP="off")
    try:
        assert not b.private_tmp_is_namespace()
        assert b.run(hold(190), session="first")["status"] == "ok"
        assert b.run(hold(190), session="second")["status"] == "ok"
        rec = b.run(hold(40), session="first")
        assert rec["status"] == "ok" and int(rec["result"]) >= 231, rec
        # A flood is stopped at the session's own limit: killed, and said why.
        rec = b.run(HOLD_THREADS, session="flood", timeout_s=120)
        if rec["status"] == "crashed":
            assert "killed for running" in rec["error"]["message"] and "limits.threads" in rec["error"]["message"], rec
        else:
            started, err = ast.literal_eval(rec["result"])
            assert started <= 256 and err == "can't start new thread", rec
        assert subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/bin/true"], timeout=30).returncode == 0
        for s in ("first", "second"):
            rec = b.run("ev.set(); threading.active_count() > 100", session=s)
            assert rec["status"] == "ok", rec
    finally:
        b.close()


# ---------------------------------------------------------------------------------------------
# #154: a host unmount reaches every worker and spare
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def shared_volume():
    """A tmpfs volume mounted on a shared mount (as systemd makes `/`), removed afterwards."""
    base = Path(f"/mnt/ironcell-prop-{os.getpid()}")
    base.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", str(base)], check=True)
    subprocess.run(["mount", "--make-shared", str(base)], check=True)
    vol = base / "vol"
    vol.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=755", "none", str(vol)], check=True)
    (vol / "data.txt").write_text("on the volume")
    yield vol
    subprocess.run(["umount", "-l", str(vol)], capture_output=True)
    subprocess.run(["umount", "-l", str(base)], capture_output=True)
    base.rmdir()


READ_VOLUME = "try:\n    r = open(VOL + '/data.txt').read()\nexcept OSError as e:\n    r = type(e).__name__\nr"


@pytest.mark.parametrize("user", USERS)
def test_154_a_volume_the_host_unmounts_is_gone_in_every_session_and_spare(user, shared_volume):
    b = Sandboxed(user, IRONCELL_ALLOW_READ=str(shared_volume))
    try:
        code = READ_VOLUME.replace("VOL", repr(str(shared_volume)))
        assert b.run(code, session="before")["result"] == repr("on the volume")
        b.srv.wait_for_full_pool()  # spares forked while the volume was mounted
        umount = subprocess.run(["umount", str(shared_volume)], capture_output=True, text=True)
        # Busy (EBUSY) would mean a worker's copy pins it: the mount is the host's to remove.
        assert umount.returncode == 0, umount.stderr
        assert b.run(code, session="before")["result"] == repr("FileNotFoundError")
        assert b.run(code, session="a-spare")["result"] == repr("FileNotFoundError")
    finally:
        b.close()


# ---------------------------------------------------------------------------------------------
# #155: no other process in /proc or /sys
# ---------------------------------------------------------------------------------------------

PROC_WALK = r'''
import os
def exists(p):
    try:
        os.stat(p)
        return True
    except OSError:
        return False
found = [n for n in range(1, 65536) if exists(f'/proc/{n}')]
forms = [p for p in ('/proc/1', '/proc/./1', '//proc/1', '/proc/../proc/1', '/proc/self', '/proc/thread-self',
                     '/proc/{host}', '/proc/{host}/task/{host}', '/proc/{zyg}', '/proc/{other}', '/proc/{other}/task/{other}',
                     '/dev/fd/0', '/proc/self/exe', '/proc/loadavg', '/sys/fs/cgroup', '/sys/fs/cgroup/pids',
                     '/sys/fs/cgroup/pids/ironcell/w{other}', '/sys/kernel') if exists(p)]
links = []
for p in ('/proc/1/exe', '/proc/self/exe', '/proc/{other}/cwd'):
    try:
        links.append(os.readlink(p))
    except OSError:
        pass
try:
    listing = os.listdir('/proc')
except OSError as e:
    listing = type(e).__name__
(found, forms, links, listing)
'''


@pytest.mark.parametrize("user", USERS)
def test_155_proc_and_sys_show_no_other_process(user):
    b = Sandboxed(user)
    try:
        other = int(b.run("import os; os.getpid()", session="other")["result"])
        # Keep the other session busy with threads so its task dir exists and has entries.
        b.run("import threading; ev = threading.Event(); [threading.Thread(target=ev.wait, daemon=True).start() for _ in range(4)]", session="other")
        zyg = int(Path(f"/proc/{other}/stat").read_text().rsplit(")", 1)[1].split()[1])
        code = PROC_WALK.replace("{host}", str(b.srv.proc.pid)).replace("{zyg}", str(zyg)).replace("{other}", str(other))
        rec = b.run(code, session="walker", timeout_s=120)
        assert rec["status"] == "ok", rec
        found, forms, links, listing = ast.literal_eval(rec["result"])
        assert found == [] and forms == [] and links == [], (found, forms, links)
        assert listing in ([], "PermissionError"), listing
        # Inside a session's own code, nothing it needs went: threads, time, temp files, CPUs.
        rec = b.run("import os, tempfile, time, threading\n"
                    "t = threading.Thread(target=time.sleep, args=(0.01,)); t.start(); t.join()\n"
                    "(os.cpu_count() >= 1, len(os.sched_getaffinity(0)) >= 1, tempfile.mkstemp()[0] > 2)", session="walker")
        assert rec["result"] == "(True, True, True)", rec
    finally:
        b.close()


# ---------------------------------------------------------------------------------------------
# #156: a new worker's memory holds nothing of other sessions
# ---------------------------------------------------------------------------------------------

# Reads the worker's whole malloc heap (where the zygote decoded every spawn request) from
# inside: from a fresh block down to the first unmapped page (mincore says ENOMEM), up to the
# break. The needles are written reversed so the cell's own text does not contain them.
SCAN_HEAP = r'''
import ctypes
libc = ctypes.CDLL(None)
libc.sbrk.restype = ctypes.c_void_p
libc.malloc.restype = ctypes.c_void_p
top = libc.sbrk(0)
p = libc.malloc(64) & ~4095
vec = ctypes.create_string_buffer(1)
while libc.mincore(ctypes.c_void_p(p - 4096), 4096, vec) == 0:
    p -= 4096
heap = ctypes.string_at(p, top - p)
needles = [bytes(reversed(n.encode())) for n in NEEDLES]
(len(heap), [heap.count(n) for n in needles])
'''


@pytest.mark.parametrize("user", USERS)
def test_156_a_new_worker_holds_nothing_of_sessions_spawned_before_it(user):
    # No pool: every session is a fresh fork right after the zygote decoded the one before.
    b = Sandboxed(user, IRONCELL_POOL_SIZE="0", IRONCELL_PLOT_SPARE="off")
    try:
        names = ["quarterly-layoffs-plan-emea-draft-2027", "merger-with-acme-corp", "patient-records-cleanup"]
        for name in names:
            assert b.run("1", session=name)["status"] == "ok"
        needles = [n[::-1] for n in ("layoffs-plan-emea", "merger-with-acme", "records-cleanup", "sessions/merger")]
        rec = b.run(SCAN_HEAP.replace("NEEDLES", repr(needles)), session="b")
        assert rec["status"] == "ok", rec
        scanned, hits = ast.literal_eval(rec["result"])
        assert scanned > 1 << 20 and hits == [0, 0, 0, 0], (scanned, hits)
    finally:
        b.close()


def test_156_the_zygote_itself_keeps_no_earlier_request(state_dir):
    """Seen from outside (root reads the zygote's memory): the freed copies are cleared."""
    srv = RawServer(state_dir, IRONCELL_POOL_SIZE="0", IRONCELL_PLOT_SPARE="off")
    try:
        srv.initialize()
        assert srv.call("1", session="quarterly-layoffs-plan-emea-draft-2027")["structuredContent"]["status"] == "ok"
        worker = int(srv.call("import os; os.getpid()", session="b")["structuredContent"]["result"])
        zygote = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
        time.sleep(0.2)
        hits = 0
        with open(f"/proc/{zygote}/maps") as maps, open(f"/proc/{zygote}/mem", "rb", 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                if "r" not in perms or "w" not in perms:
                    continue
                a, z = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(a)
                    hits += mem.read(z - a).count(b"layoffs-plan-emea")
                except OSError:
                    continue
        assert hits == 0
    finally:
        srv.close()


# ---------------------------------------------------------------------------------------------
# #157: the public /etc files libraries read are readable; the rest of /etc is not
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("user,abi", [(u, a) for u in USERS for a in (1, 3, 5, None)])
def test_157_mime_types_and_os_release_are_readable_and_nothing_else_of_etc(user, abi):
    b = Sandboxed(user, abi_max=abi)
    try:
        rec = b.run("import mimetypes, platform\nmimetypes.init()\n"
                    "(mimetypes.guess_type('book.xlsx')[0], bool(platform.freedesktop_os_release().get('ID')))")
        assert rec["status"] == "ok", rec
        assert ast.literal_eval(rec["result"]) == ("application/vnd.openxmlformats-officedocument.spreadsheetml.sheet", True)
        # Read-only: the grant is a file, and no write, truncate or neighbour comes with it.
        for attack in ("open('/etc/mime.types', 'a')", "os.open('/etc/mime.types', os.O_RDONLY | os.O_TRUNC)",
                       "open('/etc/mime.types.new', 'w')", "os.truncate('/etc/os-release', 0)"):
            assert b.outcome(attack) in ("PermissionError:13", "PermissionError:1"), attack
        for path in ("/etc/passwd", "/etc/shadow", "/etc/hostname", "/etc/ssh/sshd_config"):
            assert b.outcome(f"open({path!r}).read()") in ("PermissionError:13", "FileNotFoundError:2"), path
    finally:
        b.close()


# ---------------------------------------------------------------------------------------------
# #44: library thread pools are sized to the CPUs, not to 1
# ---------------------------------------------------------------------------------------------

def test_library_thread_pools_are_sized_to_the_cpus_the_host_may_use():
    b = Sandboxed("nobody")
    try:
        rec = b.run("import os\n[os.environ[k] for k in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS')]")
        assert rec["status"] == "ok", rec
        cpus = str(len(os.sched_getaffinity(0)))
        assert ast.literal_eval(rec["result"]) == [cpus] * 3
    finally:
        b.close()
