"""Forking a live session (`run_python` with `fork_from`, or `mcp.fork(name)` from code;
docs/SECURITY.md #193-#199): the new
session starts as a copy of the parent at the end of its last run (variables, imports, open
files, files), after which the two evolve apart and neither can reach or act on the other.
Attacked from inside both sides, as root and as `nobody`."""

from __future__ import annotations

import ast
import glob
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import pid_alive, shared_tmp_dir, wait_until
from test_sandbox import USERS, Sandboxed, forking_sandbox


@pytest.fixture(scope="module", params=USERS)
def box(request):
    b = forking_sandbox(request.param, IRONCELL_MAX_SESSIONS="56")
    yield b
    b.close()


def value(rec: dict):
    assert rec["status"] == "ok", (rec.get("error"), rec.get("notices"))
    return None if rec["result"] is None else ast.literal_eval(rec["result"])


def fork(b: Sandboxed, parent: str, child: str, code: str = "1", **args) -> dict:
    """The first run of `child`, forked from `parent` (which inherits the test prelude)."""
    r = b.srv.call(code, session=child, fork_from=parent, **args)
    b.sessions.add(child)
    return r


def test_a_fork_starts_with_the_parents_state_and_files_then_each_goes_its_own_way(box):
    # Through `/tmp` where it is the session's own directory (not when the state dir is in /tmp).
    tmp = "/tmp/" if box.private_tmp_is_namespace() else ""
    value(box.run(
        "import json, tempfile\nx = [1, 2, 3]\nos.makedirs('d/e', exist_ok=True)\n"
        f"open('d/e/deep.txt', 'w').write('deep')\nopen('{tmp}via-tmp.txt', 'w').write('tmp')\n"
        "log = open('log.txt', 'a'); log.write('a1\\n'); log.flush()\n"
        "reader = open('d/e/deep.txt')\n(os.getpid(), os.getcwd())", session="parent"))
    r = fork(box, "parent", "kid",
             "x.append(4); log.write('b1\\n'); log.flush()\n"
             "(x, json.dumps({'k': 1}), open('d/e/deep.txt').read(), open('via-tmp.txt').read(),"
             " reader.read(), open('log.txt').read(), tempfile.gettempdir() == os.getcwd(), os.getcwd())")
    assert not r["isError"], r["content"][0]["text"]
    rec = r["structuredContent"]
    assert rec["session_state"] == "forked" and rec["lineage"] == ["parent"], rec
    got = value(rec)
    assert got[:7] == ([1, 2, 3, 4], '{"k": 1}', "deep", "tmp", "deep", "a1\nb1\n", True), got
    kid_dir = got[7]
    # The parent saw none of it: its list, its file (and the shared-looking handle) are its own.
    parent_dir = value(box.run("log.write('a2\\n'); log.flush()\n(x, open('log.txt').read(), os.getcwd())",
                               session="parent"))
    assert parent_dir[:2] == ([1, 2, 3], "a1\na2\n"), parent_dir
    assert kid_dir != parent_dir[2]
    value(box.run("open('late.txt', 'w').write('parent only')", session="parent"))
    assert value(box.run("(os.path.exists('late.txt'), open('log.txt').read())", session="kid")) == (False, "a1\nb1\n")
    # `/tmp` by path is refused in the fork, with the reason; the session directory is the way.
    if tmp:
        assert "a forked session has no /tmp" in box.run("open('/tmp/x', 'w')", session="kid")["error"]["message"]
        assert value(box.run("open('/tmp/via-tmp.txt').read()", session="parent")) == "tmp"
    # system://info names the lineage.
    forks = {f["name"]: f["lineage"] for f in box.srv.info()["sessions"]["forks"]}
    assert forks["kid"] == ["parent"] and "parent" not in forks, forks


def test_277_what_a_fork_printed_just_before_it_died_is_in_its_result(box):
    # A fork cannot pass descriptors (seccomp): the host makes its pipes and keeps read ends.
    for i in range(5):
        value(box.run("x = 1", session=f"dying-parent-{i}"))
        r = fork(box, f"dying-parent-{i}", f"dying-fork-{i}",
                 "import os, sys\nprint('step 2 done')\nsys.stderr.write('warned\\n')\nos._exit(1)")
        rec = r["structuredContent"]
        assert rec["status"] == "crashed", rec
        assert (rec["stdout"], rec["stderr"]) == ("step 2 done\n", "warned\n"), rec
        # The parent's own pipes are its own still.
        rec = box.run("import ctypes\nprint('parent too')\nctypes.string_at(0)", session=f"dying-parent-{i}")
        assert rec["status"] == "crashed" and rec["stdout"] == "parent too\n", rec


def forked_in_code(b: Sandboxed, parent: str, code: str) -> dict:
    """A run of `parent` whose code calls `mcp.fork`."""
    return b.run("import mcp\n" + code, session=parent)


def test_mcp_fork_from_code_forks_the_session_as_the_run_leaves_it(box):
    rec = forked_in_code(box, "cp", "x = [1]\nf = open('f.txt', 'w'); f.write('one'); f.flush()\n"
                                    "h = mcp.fork('ck')\nx.append(2)\nh")
    box.sessions.add("ck")
    assert value(rec) == {"session": "ck", "forked_from": "cp", "when": "end_of_run"}, rec
    assert any('forked into session "ck"' in n for n in rec["notices"]), rec["notices"]
    # The fork has what the cell did after the call too; the two then go their own ways.
    kid = box.srv.call("x.append(3); f.write('+kid'); f.flush()\n(x, open('f.txt').read(), os.getcwd())",
                       session="ck")["structuredContent"]
    assert kid["session_state"] == "forked" and kid["lineage"] == ["cp"], kid
    got = value(kid)
    assert got[:2] == ([1, 2, 3], "one+kid"), got
    parent = value(box.run("(x, open('f.txt').read(), os.getcwd())", session="cp"))
    assert parent[:2] == ([1, 2], "one"), parent
    # Neither reaches the other's directory.
    for me, other in (("ck", parent[2]), ("cp", got[2])):
        assert box.outcome(f"os.listdir({other!r})", session=me) == "PermissionError:13", me
    forks = {f["name"]: f["lineage"] for f in box.srv.info()["sessions"]["forks"]}
    assert forks["ck"] == ["cp"], forks


def test_a_fork_of_a_session_that_awaited_at_top_level_awaits_on_a_loop_of_its_own(box):
    # The parent's top-level `await` left a loop polling the parent's epoll instance and
    # self-pipe, which the fork closes; their numbers went to the fork's own descriptors, and the
    # fork's loop then waited on its own session socket: a thread's result handed to it
    # (`to_thread`, as the bridge hands answers) never came (h97: until the run's timeout).
    value(box.run("import asyncio\nawait asyncio.sleep(0)\n'a loop'", session="aw"))
    first = fork(box, "aw", "aw-kid", "1")
    assert not first["isError"], first["content"][0]["text"]
    cell = "import time\nawait asyncio.to_thread(lambda: time.sleep(0.05) or 'from a thread')"
    for _ in range(2):
        assert value(box.run(cell, session="aw-kid", timeout_s=20)) == "from a thread"
        assert value(box.run(cell, session="aw", timeout_s=20)) == "from a thread"
    assert value(box.run("'still serving'", session="aw-kid")) == "still serving"


@pytest.mark.parametrize("user", USERS)
def test_a_call_through_the_bridge_the_parent_left_open_fails_in_the_fork_and_says_so(user):
    d = shared_tmp_dir()
    cfg = d / "servers.json"
    server = Path(__file__).parent / "servers" / "plain_server.py"
    log = d / "upstream.jsonl"
    log.touch()
    log.chmod(0o666)
    cfg.write_text(json.dumps({"mcpServers": {"plain": {"command": "/usr/bin/python3", "args": [str(server)],
                                                        "env": {"PLAIN_SERVER_LOG": str(log)}}}}))
    cfg.chmod(0o644)
    b = forking_sandbox(user, IRONCELL_MAX_SESSIONS="10", MCP_BRIDGE_CONFIG=str(cfg))
    try:
        value(b.run("import asyncio\nawait mcp_plain.echo(text='warm')\n1", session="open-a"))
        value(b.run("t = asyncio.ensure_future(mcp_plain.sleep(seconds=3))\nawait asyncio.sleep(0.3)\nt.done()",
                    session="open-a"))
        first = fork(b, "open-a", "open-b", "1")
        rec = first["structuredContent"]
        assert any("1 call(s) through the bridge the parent had not had answered fail here" in n
                   for n in rec["notices"]), rec["notices"]
        # The inherited task belongs to the parent's loop: awaiting it raises at once, no hang.
        got = value(b.run("try:\n    await asyncio.wait_for(t, 10)\n    r = 'answered'\n"
                          "except Exception as e:\n    r = type(e).__name__ + ': ' + str(e)\nr", session="open-b", timeout_s=30))
        assert got.startswith("ValueError: The future belongs to a different loop"), got
        # The fork's own calls work; the parent's call is answered to the parent.
        assert "warm-b" in str(value(b.run("await mcp_plain.echo(text='warm-b')", session="open-b", timeout_s=30)))
        assert "slept" in str(value(b.run("await t", session="open-a", timeout_s=30)))
    finally:
        b.close()


def test_a_fork_that_is_reset_is_a_fork_no_longer(box):
    value(box.run("x = 'parent'", session="rl"))
    first = fork(box, "rl", "rl-kid", "x")
    assert first["structuredContent"]["lineage"] == ["rl"]
    # The text the model reads says so too.
    assert '[note] session "rl-kid" is a fork of "rl" (lineage: rl)' in first["content"][0]["text"]
    assert ["rl-kid", ["rl"]] in [[f["name"], f["lineage"]] for f in box.srv.info()["sessions"]["forks"]]
    rec = box.srv.call("'x' in globals()", session="rl-kid", reset=True)["structuredContent"]
    assert rec["result"] == "False" and not rec.get("lineage"), rec
    assert "rl-kid" not in [f["name"] for f in box.srv.info()["sessions"]["forks"]]


def test_mcp_fork_is_refused_at_once_with_the_reason(box):
    value(box.run("1", session="taken2"))
    cases = [
        ("mcp.fork('bad/name')", "ForkError", "not a session name"),
        ("mcp.fork('rp')", "ForkError", "fork of itself"),
        ("mcp.fork('taken2')", "ForkError", "exists already"),
        ("mcp.fork(7)", "TypeError", "a session name is a string"),
        ("mcp.fork('twice'); mcp.fork('twice')", "ForkError", '"twice" is the name of a fork that session "rp" asked for'),
    ]
    for code, kind, words in cases:
        rec = forked_in_code(box, "rp", code)
        assert rec["status"] == "error" and rec["error"]["type"] == kind, (code, rec)
        assert words in rec["error"]["message"], (code, rec["error"])
    # The run that asked twice made its first fork all the same: the call had returned.
    box.sessions.add("twice")
    assert box.srv.call("1", session="twice")["structuredContent"]["lineage"] == ["rp"]
    # A fork asked for by a run whose worker then dies is not made, and the result says why.
    rec = forked_in_code(box, "rp", "mcp.fork('never')\nos.kill(os.getpid(), 9)")
    assert rec["session_state"] == "lost", rec
    assert any('mcp.fork("never") did not happen' in n and "no live Python process" in n
               for n in rec["notices"]), rec["notices"]
    r = box.srv.call("1", session="never")["structuredContent"]
    box.sessions.add("never")
    assert "lineage" not in r and r["session_state"] == "new", r


def test_neither_side_can_reach_or_act_on_the_other(box):
    ppid, pdir = value(box.run("(os.getpid(), os.getcwd())", session="p2"))
    fork(box, "p2", "k2")
    kpid, kdir = value(box.run("(os.getpid(), os.getcwd())", session="k2"))
    attacks = (
        "import resource, signal\n"
        "other_pid, other_dir = {pid}, {dir!r}\n"
        "(outcome(lambda: open(other_dir + '/x', 'w')),"
        " outcome(lambda: os.listdir(other_dir)),"
        " outcome(lambda: open(other_dir + '/../../' + os.path.basename(other_dir) + '/y', 'w')),"
        " outcome(lambda: os.kill(other_pid, 0)),"
        " outcome(lambda: os.kill(other_pid, signal.SIGKILL)),"
        " outcome(lambda: resource.prlimit(other_pid, resource.RLIMIT_NOFILE, (16, 16))),"
        " outcome(lambda: os.setpgid(0, other_pid)),"
        " outcome(lambda: open(os.path.dirname(os.getcwd()) + '/planted', 'w')))"
    )
    for me, other_pid, other_dir in (("k2", ppid, pdir), ("p2", kpid, kdir)):
        got = value(box.run(attacks.format(pid=other_pid, dir=other_dir), session=me))
        assert all(g == "PermissionError:13" or g == "PermissionError:1" for g in got), (me, got)
    assert pid_alive(ppid) and pid_alive(kpid)
    assert value(box.run("'fine'", session="p2")) == value(box.run("'fine'", session="k2")) == "fine"


def test_timing_out_resetting_or_killing_one_leaves_the_other(box):
    value(box.run("state = 'kept'", session="p3"))
    fork(box, "p3", "k3")
    rec = box.run("while True: pass", session="k3", timeout_s=1)
    assert rec["status"] == "timeout", rec
    assert value(box.run("state", session="p3")) == "kept"
    rec = box.run("os.kill(os.getpid(), 9)", session="p3")
    assert rec["session_state"] == "lost", rec
    assert value(box.run("state", session="k3")) == "kept"
    value(box.run("state = 'again'", session="p3"))
    fork(box, "p3", "k3b")
    box.run("1", session="p3", reset=True)
    assert value(box.run("state", session="k3b")) == "again"
    # The parent timing out, and killed for it (SIGINT ignored), leaves its fork as it was.
    fork(box, "k3b", "k3c")
    rec = box.run("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass",
                  session="k3b", timeout_s=1)
    assert rec["status"] == "timeout", rec
    assert value(box.run("state", session="k3c")) == "again"


def test_forks_of_forks_work_to_the_stated_depth_then_are_refused_with_the_reason(box):
    value(box.run("depth = 0", session="f0"))
    n = 0
    while True:
        r = fork(box, f"f{n}", f"f{n + 1}", "depth += 1\ndepth")
        if r["isError"]:
            break
        assert value(r["structuredContent"]) == n + 1
        n += 1
        assert n < 20
    text = r["content"][0]["text"]
    assert n == 11 and "forks deep" in text and "Landlock layer" in text, (n, text)
    rec = forked_in_code(box, "f11", "mcp.fork('f12')")
    assert rec["error"]["type"] == "ForkError" and "forks deep" in rec["error"]["message"], rec
    lineage = box.srv.call("1", session="f11")["structuredContent"]["lineage"]
    assert lineage == [f"f{i}" for i in range(10, -1, -1)]
    # A session forks more than once; each fork is a sibling of the others.
    fork(box, "f0", "g1")
    assert value(box.run("depth", session="g1")) == 0


@pytest.mark.parametrize("user", USERS)
def test_a_session_that_forked_eleven_times_is_told_its_siblings_took_its_layers(user):
    b = Sandboxed(user, IRONCELL_MAX_SESSIONS="16")
    try:
        if not b.srv.info()["sandbox"]["child_processes"].startswith("allowed"):
            pytest.skip("sessions cannot fork here")
        value(b.run("seed = 'S'", session="sib"))
        for i in range(11):
            assert not fork(b, "sib", f"sib{i}")["isError"], i
        text = fork(b, "sib", "sib11")["content"][0]["text"]
        # Siblings, not a line: the message says each fork takes a layer from the parent too.
        assert "forks deep" not in text and "has taken part in 11 forks" in text, text
        assert "from its parent as well as from the fork" in text and "fork one of its forks" in text, text
        # As it says: a fork of it still has layers left.
        assert value(fork(b, "sib0", "sib0-kid", "seed")["structuredContent"]) == "S"
    finally:
        b.close()


def test_a_refused_fork_leaves_no_directories_behind(box):
    state = box.dir / "state"

    def fork_dirs(name: str) -> list[str]:
        return glob.glob(f"{state}/**/{name}-*", recursive=True)

    def nested_areas() -> set[str]:
        # A fork's own forks area: `@forks-<16 hex digits>` inside its parent's area.
        return {p for p in glob.glob(f"{state}/**/@forks-*/@forks-*", recursive=True)
                if len(Path(p).name) == len("@forks-") + 16}

    value(box.run("import threading\nheld = threading.Event()\n"
                  "threading.Thread(target=held.wait, daemon=True).start()", session="leaves"))
    before = nested_areas()
    # Refused after its directories were made: the parent runs a thread of its own (#226).
    r = fork(box, "leaves", "leaves-kid")
    assert r["isError"] and "thread" in r["content"][0]["text"], r
    assert fork_dirs("leaves-kid") == [] and nested_areas() == before, (fork_dirs("leaves-kid"), nested_areas() - before)
    value(box.run("held.set()", session="leaves"))
    assert wait_until(lambda: not fork(box, "leaves", "leaves-kid2")["isError"], timeout=10)
    assert len(fork_dirs("leaves-kid2")) == 1


@pytest.fixture(scope="module")
def xfs_base():
    """A loop-mounted XFS image (reflink on, mkfs.xfs's default) to hold a server's state
    directory; skipped where it cannot be made (no mkfs.xfs, not root, no loop devices). Its
    preallocation past the end of a file being written is fixed at 64 KiB: XFS's default grows
    with the file, and the quota counts blocks."""
    if os.geteuid() != 0 or not shutil.which("mkfs.xfs"):
        pytest.skip("a loop-mounted XFS needs root and mkfs.xfs (apt-get install xfsprogs, as .ci/run does)")
    work = Path(shared_tmp_dir())
    image, mnt = work / "xfs.img", work / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(1 << 30)
    made = subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], capture_output=True, text=True)
    mounted = made.returncode == 0 and subprocess.run(
        ["mount", "-o", "loop,allocsize=64k", str(image), str(mnt)], capture_output=True, text=True)
    if not mounted or mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an XFS image here: {(made.stderr or getattr(mounted, 'stderr', ''))[:200]}")
    mnt.chmod(0o777)
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("user", USERS)
def test_a_forks_files_are_reflinked_where_the_filesystem_can_and_count_against_its_quota(user, xfs_base):
    policy = (Path(__file__).parents[2] / "sandbox-policy" / "default.toml").read_text()
    assert "scratch_quota_mib = 1024" in policy
    pfile = Path(shared_tmp_dir()) / "policy.toml"
    pfile.write_text(policy.replace("scratch_quota_mib = 1024", "scratch_quota_mib = 128"))
    pfile.chmod(0o644)
    b = Sandboxed(user, base=xfs_base, IRONCELL_POLICY=str(pfile), IRONCELL_MAX_SESSIONS="8",
                  IRONCELL_MIN_FREE_DISK="32m")
    try:
        if not b.srv.info()["sandbox"]["child_processes"].startswith("allowed"):
            pytest.skip("sessions cannot fork here")
        digest = value(b.run(
            "import hashlib\ndata = os.urandom(64 << 20)\n"
            "with open('big.bin', 'wb') as f:\n    f.write(data)\n    os.fsync(f.fileno())\n"
            "hashlib.sha256(data).hexdigest()", session="rp"))
        free = os.statvfs(xfs_base)
        r = fork(b, "rp", "rk", "import hashlib\n(hashlib.sha256(open('big.bin', 'rb').read()).hexdigest(), os.getcwd())")
        got, kid_dir = value(r["structuredContent"])
        assert got == digest
        after = os.statvfs(xfs_base)
        # A reflink: the copy's extents are the parent's (filefrag's `shared`), and the disk did
        # not pay for 64 MiB again.
        used = (free.f_bfree - after.f_bfree) * free.f_frsize
        assert used < 16 << 20, used
        frag = subprocess.run(["filefrag", "-v", f"{kid_dir}/big.bin"], capture_output=True, text=True).stdout
        assert "shared" in frag, frag
        # Each side writes its own blocks from then on.
        value(b.run("open('big.bin', 'r+b').write(b'kid')", session="rk"))
        assert value(b.run("open('big.bin', 'rb').read(3)", session="rp")) != b"kid"
        # The copy still counts against the fork's quota: 64 MiB copied + 72 MiB written pass 128.
        rec = b.run("import time\nfor i in range(72):\n    open(f'more{i}', 'wb').write(os.urandom(1 << 20))\n"
                    "time.sleep(5)", session="rk")
        assert rec["status"] == "scratch_quota", rec
        assert value(b.run("os.path.getsize('big.bin')", session="rp")) == 64 << 20
    finally:
        b.close()


SPARSE_FILES = """
for i in range(4):
    with open(f'sparse{i}', 'wb') as f:
        f.seek((64 << 20) - 1)
        f.write(b'x')
sum(os.stat(f'sparse{i}').st_blocks * 512 for i in range(4))
"""


@pytest.mark.parametrize("user", USERS)
def test_295_sparse_files_are_measured_at_their_length_before_a_fork_copies_them(user):
    # SECURITY.md #295: a fork copies a sparse file's holes as zeros (on a filesystem without
    # reflinks), so 4 files of 64 MiB holding 4 KiB each, within a 128 MiB quota, became 256 MiB
    # written by the fork before it was a session; each such file costs its parent 8 KiB of
    # quota and becomes up to file_size_mib (256 MiB) in the copy. Now the fork is refused first.
    policy = (Path(__file__).parents[2] / "sandbox-policy" / "default.toml").read_text()
    assert "scratch_quota_mib = 1024" in policy
    pfile = Path(shared_tmp_dir()) / "policy.toml"
    pfile.write_text(policy.replace("scratch_quota_mib = 1024", "scratch_quota_mib = 128"))
    pfile.chmod(0o644)
    b = forking_sandbox(user, IRONCELL_POLICY=str(pfile))
    try:
        assert value(b.run(SPARSE_FILES, session="sparse")) < 1 << 20, "sparse: a few blocks each"
        r = fork(b, "sparse", "sparse-kid", "sum(os.stat(f'sparse{i}').st_blocks * 512 for i in range(4))")
        text = r["content"][0]["text"]
        assert r["isError"] and "past a session's quota of 128 MiB" in text and "sparse" in text, r
        assert glob.glob(f"{b.dir / 'state'}/**/sparse-kid-*", recursive=True) == []
        # A parent whose files fit at their length still forks.
        value(b.run("for i in range(3):\n    os.remove(f'sparse{i}')", session="sparse"))
        kid = value(fork(b, "sparse", "sparse-kid2", "os.path.getsize('sparse3')")["structuredContent"])
        assert kid == 64 << 20
    finally:
        b.close()


# The parent's files, grown from a signal handler of its own once the fork's copy has begun:
# 300 files of 4 KiB whose atime the copy's reads move (relatime), and four 4 KiB files the handler
# then ftruncates to 60 MiB each (free). The handler is a ctypes callback on SIGALRM, which runs
# while the worker idles between cells; its timer is armed by an after-fork hook, once the fork is
# made, and polls every 2 ms.
GROW_WHILE_COPIED = r'''
import ctypes, signal
libc = ctypes.CDLL(None, use_errno=True)
for i in range(300):
    with open(f'small{i:03}', 'wb') as f:
        f.write(b's' * 4096)
BIG = [os.open(f'big{i}', os.O_WRONLY | os.O_CREAT, 0o600) for i in range(4)]
for fd in BIG:
    os.write(fd, b'b' * 4096)
NAMES = [f'small{i:03}' for i in range(300)]
BEFORE = {n: os.stat(n).st_atime_ns for n in NAMES}
GROWN = []
def tick(_signal):
    if GROWN:
        return
    if any(os.stat(n).st_atime_ns != BEFORE[n] for n in NAMES):
        for fd in BIG:
            os.ftruncate(fd, 60 << 20)
        GROWN.append(True)
HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)(tick)
libc.signal.restype = ctypes.c_void_p
libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.signal(signal.SIGALRM, ctypes.cast(HANDLER, ctypes.c_void_p).value)
os.register_at_fork(after_in_parent=lambda: signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002))
len(NAMES)
'''


@pytest.mark.parametrize("user", USERS)
def test_300_files_the_parent_grows_while_the_fork_copies_them_stop_the_copy_at_its_room(user):
    # SECURITY.md #300: #295 measures the parent's files twice, the second time once the parent
    # runs nothing of its own; but a signal handler of its code runs while it idles, after both.
    # Four files grown to 60 MiB once the copy had begun: 242 MiB copied under a 64 MiB quota.
    # Now the fork copies no more than the room it was checked against, and fails past it.
    policy = (Path(__file__).parents[2] / "sandbox-policy" / "default.toml").read_text()
    assert "scratch_quota_mib = 1024" in policy
    pfile = Path(shared_tmp_dir()) / "policy.toml"
    pfile.write_text(policy.replace("scratch_quota_mib = 1024", "scratch_quota_mib = 64"))
    pfile.chmod(0o644)
    b = forking_sandbox(user, IRONCELL_POLICY=str(pfile))
    try:
        assert value(b.run(GROW_WHILE_COPIED, session="racer")) == 300
        r = fork(b, "racer", "racer-kid", "sum(os.path.getsize(f'big{i}') for i in range(4))")
        grown = value(b.run("signal.setitimer(signal.ITIMER_REAL, 0)\n(bool(GROWN), os.fstat(BIG[0]).st_size >> 20)",
                            session="racer"))
        assert grown == (True, 60), "the copy began and the handler grew the parent's files"
        if r["isError"]:
            text = r["content"][0]["text"]
            assert "grew past the 64 MiB" in text and "the fork is refused" in text, r
            assert glob.glob(f"{b.dir / 'state'}/**/racer-kid-*", recursive=True) == []
        else:  # every big file copied before the handler grew it: the copy is what was measured
            assert value(r["structuredContent"]) == 4 * 4096, r
    finally:
        b.close()


def test_301_a_file_the_parent_maps_shared_is_refused_not_shared_with_the_fork(box):
    # SECURITY.md #301: a fork inherits its parent's memory mappings, and a MAP_SHARED one maps
    # the parent's own file: the fork wrote "B-WROT" into the parent's file through it, and saw
    # the parent's later writes. Now such a fork is refused with the reason, and made once the
    # mapping is closed; each side's file is then its own.
    value(box.run("import mmap\nopen('shared.bin', 'wb').write(b'.' * 4096)\nf = open('shared.bin', 'r+b')\n"
                  "m = mmap.mmap(f.fileno(), 4096)\nm[:6] = b'A-orig'", session="mapper"))
    r = fork(box, "mapper", "mapper-kid", "m[:6] = b'B-WROT'; m.flush(); 'written'")
    text = r["content"][0]["text"]
    assert r["isError"] and "maps 1 file(s) shared" in text and "m.close()" in text, r
    assert glob.glob(f"{box.dir / 'state'}/**/mapper-kid-*", recursive=True) == []
    assert value(box.run("open('shared.bin', 'rb').read(6)", session="mapper")) == b"A-orig"
    value(box.run("m.close(); f.close()", session="mapper"))
    kid = fork(box, "mapper", "mapper-kid2", "f = open('shared.bin', 'r+b'); m = mmap.mmap(f.fileno(), 4096)\n"
               "m[:6] = b'B-WROT'; m.flush(); bytes(m[:6])")
    assert value(kid["structuredContent"]) == b"B-WROT", kid
    assert value(box.run("open('shared.bin', 'rb').read(6)", session="mapper")) == b"A-orig"


def test_304_a_file_the_parent_deleted_but_holds_open_is_the_forks_own_copy(box):
    # SECURITY.md #304: a descriptor on a file no longer in any folder (tempfile.TemporaryFile,
    # or open then os.remove) is not among the files the fork copies; the fork kept the parent's
    # read-only one and read the parent's later writes through it, and closed a read-write one
    # (TemporaryFile's). Now each such file is the fork's own copy, as it was at the fork, with
    # the same offset and mode, two descriptors on it still sharing it; neither side sees the
    # other's later writes.
    value(box.run(
        "import tempfile\nt = tempfile.TemporaryFile(); t.write(b'T-before'); t.flush(); t.seek(2)\n"
        "open('gone.txt', 'w').write('G-before')\nr = open('gone.txt'); rw = open('gone.txt', 'r+')\n"
        "r.read(2); os.remove('gone.txt')", session="deleter"))
    kid = fork(box, "deleter", "deleter-kid", "(t.tell(), r.tell(), sorted(os.listdir('.')))")
    assert not kid["isError"], kid["content"][0]["text"]
    assert value(kid["structuredContent"]) == (2, 2, []), kid
    # Three descriptors (t, r, rw) on two files; nothing else a worker holds is copied.
    assert "3 open file(s) the parent session had deleted" in json.dumps(kid["structuredContent"]), kid
    value(box.run("1", session="plain"))
    plain = json.dumps(fork(box, "plain", "plain-kid")["structuredContent"])
    assert "had deleted" not in plain and "now maps this session's copies" not in plain, plain
    value(box.run("t.seek(0); t.write(b'T-late-A'); t.flush(); rw.write('G-late-A'); rw.flush()",
                  session="deleter"))
    seen = "t.seek(0); r.seek(0); (t.read(), r.read())"
    assert value(box.run(seen, session="deleter-kid")) == (b"T-before", "G-before")
    value(box.run("t.seek(0); t.write(b'T-late-B'); t.flush(); rw.seek(0); rw.write('G-late-B'); rw.flush()",
                  session="deleter-kid"))
    assert value(box.run(seen, session="deleter-kid")) == (b"T-late-B", "G-late-B")
    assert value(box.run(seen, session="deleter")) == (b"T-late-A", "G-late-A")


def test_305_memory_the_parent_maps_privately_from_its_files_maps_the_forks_copies(box):
    # SECURITY.md #305: a private mapping (mmap ACCESS_COPY, numpy memmap mode='c', arrow's
    # memory maps) stays on the parent's file in the fork, so the pages the fork has not
    # written showed the parent's later writes to the file. Now they map the fork's copy; the
    # pages written before the fork stay as they were; the same for a deleted file's mapping.
    value(box.run(
        "import mmap, tempfile\nopen('data.bin', 'wb').write(b'A' * 8192)\nf = open('data.bin', 'rb')\n"
        "m = mmap.mmap(f.fileno(), 8192, access=mmap.ACCESS_COPY); m[:6] = b'A-wrot'\n"
        "t = tempfile.TemporaryFile(); t.write(b't' * 4096); t.flush()\n"
        "tm = mmap.mmap(t.fileno(), 4096, access=mmap.ACCESS_COPY)", session="cow"))
    seen = "(bytes(m[:6]), bytes(m[4096:4102]), bytes(tm[:4]))"
    kid = fork(box, "cow", "cow-kid", seen)
    assert not kid["isError"], kid["content"][0]["text"]
    assert value(kid["structuredContent"]) == (b"A-wrot", b"AAAAAA", b"tttt"), kid
    assert "now maps this session's copies" in json.dumps(kid["structuredContent"]), kid
    value(box.run("w = open('data.bin', 'r+b'); w.write(b'A-late'); w.seek(4096); w.write(b'A-late'); w.close()\n"
                  "t.seek(0); t.write(b'T-lt'); t.flush()", session="cow"))
    assert value(box.run(seen, session="cow-kid")) == (b"A-wrot", b"AAAAAA", b"tttt")
    # The fork's writes to its own files show in its mappings, never in the parent's.
    value(box.run("w = open('data.bin', 'r+b'); w.seek(4096); w.write(b'B-late'); w.close()\n"
                  "t.seek(0); t.write(b'B-lt'); t.flush()", session="cow-kid"))
    assert value(box.run(seen, session="cow-kid")) == (b"A-wrot", b"B-late", b"B-lt")
    assert value(box.run(seen, session="cow")) == (b"A-wrot", b"A-late", b"T-lt")


def test_305_a_library_the_parent_loaded_from_its_directory_still_runs_in_the_fork(box):
    # #305 moves the fork's private mappings of the parent's files onto its copies: a shared
    # library loaded from the session's directory is such a file (its code, and its relocated
    # data, written privately, which stays), and the fork calls into it as the parent did.
    lib = next(p for p in ("/usr/lib/x86_64-linux-gnu/libz.so.1", "/lib/x86_64-linux-gnu/libz.so.1",
                           "/usr/lib64/libz.so.1") if os.path.exists(p))
    call = "z.crc32(0, b'abc', 3), z.zlibVersion()"
    parent = value(box.run(
        f"import ctypes, shutil\nshutil.copy({lib!r}, 'libz-copy.so')\nz = ctypes.CDLL('./libz-copy.so')\n"
        f"z.crc32.restype = ctypes.c_ulong; z.zlibVersion.restype = ctypes.c_char_p\n({call})", session="lib"))
    assert parent[0] == 891568578, parent
    kid = fork(box, "lib", "lib-kid", f"({call})")
    assert not kid["isError"], kid["content"][0]["text"]
    assert value(kid["structuredContent"]) == parent
    assert "now maps this session's copies" in json.dumps(kid["structuredContent"]), kid
    assert value(box.run(f"({call})", session="lib")) == parent


def test_refusals_say_why(box):
    cases = [
        ({"session": "r1", "fork_from": "nosuch"}, "there is no session"),
        ({"session": "r1", "fork_from": "r1"}, "fork of itself"),
    ]
    value(box.run("1", session="r0"))
    value(box.run("1", session="taken"))
    cases.append(({"session": "taken", "fork_from": "r0"}, "exists already"))
    for args, words in cases:
        r = box.srv.call("1", **args)
        assert r["isError"] and words in r["content"][0]["text"], (args, r)


@pytest.mark.parametrize("user", USERS)
def test_a_fork_past_the_live_session_cap_is_refused_not_evicting(user):
    b = Sandboxed(user, IRONCELL_MAX_SESSIONS="2")
    try:
        if not b.srv.info()["sandbox"]["child_processes"].startswith("allowed"):
            pytest.skip("sessions cannot fork here")
        value(b.run("a = 1", session="one"))
        value(b.run("b = 2", session="two"))
        r = fork(b, "one", "three")
        assert r["isError"] and "live-session slots are taken" in r["content"][0]["text"], r
        rec = forked_in_code(b, "one", "mcp.fork('three')")
        assert rec["error"]["type"] == "ForkError", rec
        assert "live-session slots are taken" in rec["error"]["message"], rec
        assert value(b.run("(a, 'kept')", session="one")) == (1, "kept")
        assert value(b.run("b", session="two")) == 2
    finally:
        b.close()


def test_a_session_that_used_up_its_landlock_layers_cannot_fork_and_is_stopped(box):
    got = value(box.run(
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nn = 0\n"
        "attr = (ctypes.c_uint64 * 3)(0, 0, 2)\n"
        "while n < 40:\n"
        "    fd = libc.syscall(444, ctypes.byref(attr), 24, 0)\n"
        "    if fd < 0 or libc.syscall(446, fd, 0) != 0:\n        break\n"
        "    os.close(fd); n += 1\n"
        "n", session="layers"))
    assert 0 < got <= 15
    r = fork(box, "layers", "layers-kid")
    assert r["isError"] and "cannot fork" in r["content"][0]["text"], r
    rec = box.run("1", session="layers")
    assert rec["session_state"] in ("restarted", "new") or "failed fork" in json.dumps(rec), rec


def test_a_child_that_leaves_its_group_dies_once_orphaned(box):
    # A child forked from a thread of a child (no parent-death signal) makes a group of its own
    # (allowed: forks need it) and is orphaned; the host kills it, as nothing would count it.
    pid = value(box.run(
        "import threading, time\nr, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    def t():\n"
        "        if os.fork() == 0:\n"
        "            os.setpgid(0, 0); os.write(w, str(os.getpid()).encode()); time.sleep(120); os._exit(0)\n"
        "    th = threading.Thread(target=t); th.start(); th.join(); time.sleep(0.5); os._exit(0)\n"
        "os.close(w); pid = int(os.read(r, 64)); os.wait(); pid", session="escape"))
    assert wait_until(lambda: not pid_alive(pid), timeout=10), pid
    assert value(box.run("'still here'", session="escape")) == "still here"


@pytest.mark.parametrize("user", USERS)
def test_below_landlock_abi_6_a_fork_is_refused_up_front_with_the_reason(user):
    b = Sandboxed(user, abi_max=5)
    try:
        value(b.run("a = 1", session="one"))
        r = fork(b, "one", "two")
        text = r["content"][0]["text"]
        assert r["isError"] and "sessions cannot fork here" in text and "ABI 5" in text, text
        rec = forked_in_code(b, "one", "mcp.fork('two')")
        assert rec["error"]["type"] == "ForkError", rec
        assert "sessions cannot fork here" in rec["error"]["message"] and "ABI 5" in rec["error"]["message"], rec
        assert value(b.run("a", session="one")) == 1
    finally:
        b.close()


@pytest.mark.parametrize("user", USERS)
def test_a_session_holding_most_of_its_memory_limit_forks_and_both_live(user):
    # A fork's middle process, like any child the session forks, is a whole copy of it: counted
    # at the parent's resident size plus the child's share, a parent holding 400 of 500 MiB
    # with a child (or mid-fork) counted ~600 MiB and was killed. Both now count by their share,
    # as a user too: the worker hands the host its own smaps_rollup during setup (#241).
    b = Sandboxed(user, MCP_BRIDGE_MEMORY_LIMIT="500m")
    try:
        if not b.srv.info()["sandbox"]["child_processes"].startswith("allowed"):
            pytest.skip("sessions cannot fork here")
        value(b.run("import time\nbig = bytearray(b'a') * (400 << 20)\n"
                    "kid = os.fork()\nif kid == 0:\n    time.sleep(2.5); os._exit(0)\n"
                    "time.sleep(1.5)  # the memory watch reads each worker at least once a second\n"
                    "os.waitpid(kid, 0)[1]", session="m1"))
        for i in range(2):
            assert value(fork(b, "m1", f"mk{i}", "big[-1]")["structuredContent"]) == 97, i
        assert value(b.run("big[-1]", session="m1")) == 97
    finally:
        b.close()


@pytest.mark.parametrize("user", USERS)
def test_memory_shared_copy_on_write_is_not_counted_twice(user):
    # Limit 500 MiB: the parent holds 400 MiB, its fork writes 200 MiB of its own. Counted by
    # its resident memory the fork would hold ~630 MiB and be killed; by its share (PSS, as the
    # memory watch counts it) ~420 MiB, and the parent still its ~430. Its RLIMIT_DATA, its
    # parent's, counted the 400 MiB it inherited (MemoryError past ~100 MiB of its own) until
    # the host raised it by what the fork inherited (SECURITY.md #239).
    b = Sandboxed(user, MCP_BRIDGE_MEMORY_LIMIT="500m")
    try:
        if not b.srv.info()["sandbox"]["child_processes"].startswith("allowed"):
            pytest.skip("sessions cannot fork here")
        value(b.run("big = bytearray(b'a') * (400 << 20)\nlen(big) >> 20", session="m1"))
        r = fork(b, "m1", "m2", "mine = bytearray(b'b') * (200 << 20)\n(len(big) >> 20, len(mine) >> 20)")
        assert value(r.get("structuredContent", r)) == (400, 200), r
        time.sleep(1.5)  # the memory watch reads each worker at least once a second
        assert value(b.run("(big[-1], mine[-1])", session="m2")) == (97, 98)
        assert value(b.run("big[-1]", session="m1")) == 97
    finally:
        b.close()


# The memory limits from inside (SECURITY.md #239): where sessions fork, the hard RLIMIT_DATA and
# RLIMIT_AS are twice the soft ones, room the host fits a fork's soft limits into; the filter
# refuses every change of them (the new value is behind a pointer it cannot read), reading them
# stays allowed. Tried through Python, `setrlimit(2)`, and `prlimit64` with a pointer whose low
# 32 bits are 0 and a resource number with high bits set.
CHANGE_MEMORY_LIMITS = """
import ctypes, platform, resource
libc = ctypes.CDLL(None, use_errno=True)
PRLIMIT64, SETRLIMIT = {"x86_64": (302, 160), "aarch64": (261, 164)}[platform.machine()]
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
# A page at 1 << 36 (MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE): its address's low half is 0.
page = libc.mmap(1 << 36, 4096, 3, 0x22 | 0x100000, -1, 0)
assert page == 1 << 36, hex(page or 0)
memory = (resource.RLIMIT_DATA, resource.RLIMIT_AS)
before = [resource.getrlimit(r) for r in memory]
tried = []
for r, (soft, hard) in zip(memory, before):
    for new in ((hard, hard), (soft // 2, hard), (soft, soft)):
        try:
            resource.setrlimit(r, new)
            tried.append("changed")
        except ValueError as e:
            tried.append(str(e))
    (ctypes.c_uint64 * 2).from_address(page)[:] = [hard, hard]
    for nr, args in ((PRLIMIT64, (0, r | 1 << 32, page, None)), (SETRLIMIT, (r, page))):
        ctypes.set_errno(0)
        tried.append((libc.syscall(nr, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args]), ctypes.get_errno()))
(before, [resource.getrlimit(r) for r in memory], tried)
"""


# The runner's words for the filter's refusal (CPython's would be "not allowed to raise maximum
# limit", lowering too: SECURITY.md #260).
FIXED = ("the sandbox fixes this session's memory limits (RLIMIT_AS and RLIMIT_DATA): they cannot be "
         "changed from inside the session, lowered or raised (resource.getrlimit reads them)")


def assert_memory_limits_unchanged(got, errno_eperm=1):
    before, after, tried = got
    assert after == before, got
    assert tried == ([FIXED] * 3 + [(-1, errno_eperm)] * 2) * 2, tried
    return before


def test_239_a_session_cannot_change_its_memory_limits_from_inside(box):
    limit = box.srv.info()["sandbox"]["limits"]["memory_bytes"]
    (data, address_space) = assert_memory_limits_unchanged(value(box.run(CHANGE_MEMORY_LIMITS, session="lim")))
    assert data == (limit, 2 * limit) and address_space[1] == 2 * address_space[0] > 2 * limit, (data, address_space)
    # Other limits stay its own to lower.
    assert value(box.run("import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
                         "resource.setrlimit(resource.RLIMIT_NOFILE, (soft // 2, hard))\n"
                         "resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft // 2", session="lim")) is True


@pytest.mark.parametrize("user", USERS)
def test_239_a_forks_limits_follow_what_it_shares_and_it_cannot_change_them(user):
    # Limit 500 MiB; the parent holds 300 MiB. The fork's soft limits are raised by the part of
    # that not charged to it (about half: it shares it with its parent), and lowered again once
    # it rewrote its copy (its own now); it cannot change them itself; the parent's stay.
    b = Sandboxed(user, MCP_BRIDGE_MEMORY_LIMIT="500m")
    try:
        if not b.srv.info()["sandbox"]["child_processes"].startswith("allowed"):
            pytest.skip("sessions cannot fork here")
        mib = 1 << 20
        value(b.run("import resource\nbig = bytearray(b'a') * (300 << 20)", session="fa"))
        got = value(fork(b, "fa", "fb", CHANGE_MEMORY_LIMITS)["structuredContent"])
        (soft, hard), _ = assert_memory_limits_unchanged(got)
        assert hard == 1000 * mib and 500 * mib + 140 * mib < soft < 500 * mib + 200 * mib, soft / mib
        value(b.run("big[::4096] = b'b' * len(big[::4096])", session="fb"))
        soft = value(b.run("resource.getrlimit(resource.RLIMIT_DATA)[0]", session="fb"))
        assert 500 * mib <= soft < 500 * mib + 40 * mib, soft / mib
        # Its own 300 MiB and 200 MiB more pass no longer: a MemoryError, not a kill.
        rec = b.run("more = bytearray(200 << 20)", session="fb")
        assert rec["status"] == "error" and rec["error"]["type"] == "MemoryError", rec
        assert value(b.run("(big[0], big[-1])", session="fb")) == (98, 97)
        assert value(b.run("(big[-1], resource.getrlimit(resource.RLIMIT_DATA))", session="fa")) == (97, (500 * mib, 1000 * mib))
    finally:
        b.close()


@pytest.mark.parametrize("user", USERS)
def test_239_a_parent_that_fills_its_memory_before_a_fork_gets_the_fork_nothing_past_the_limit(user):
    # The attack on the fitted limits: A holds 450 of its 500 MiB just before the fork, so the
    # fork's soft RLIMIT_DATA is raised by ~225 MiB. The fork lets go of the copy and takes 700
    # MiB of its own, which that soft limit lets through: the memory watch, counting its share,
    # kills it past the limit. A lives on with its bytes.
    b = Sandboxed(user, MCP_BRIDGE_MEMORY_LIMIT="500m")
    try:
        if not b.srv.info()["sandbox"]["child_processes"].startswith("allowed"):
            pytest.skip("sessions cannot fork here")
        value(b.run("import mmap, time\nm = mmap.mmap(-1, 450 << 20, flags=mmap.MAP_PRIVATE)\n"
                    "m[::4096] = b'a' * len(m[::4096])", session="ia"))
        rec = fork(b, "ia", "ib", "m.close()\nmine = bytearray(b'b') * (700 << 20)\ntime.sleep(5)",
                   timeout_s=60)["structuredContent"]
        assert rec["status"] == "crashed" and "memory" in rec["error"]["message"], rec
        assert value(b.run("m[-4096]", session="ia")) == 97
    finally:
        b.close()


def session_members(sid: int) -> list[int]:
    """The live processes of Unix session `sid` (a worker's line of forks stays in it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry))
    return found


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def fork_in_the_making(sid: int) -> list[int]:
    """A session fork's process B before it is taken: in its parent's Unix session `sid`, and
    the zygote's child (not the short-lived middle process, nor B while still the middle's)."""
    members = session_members(sid)
    return [p for p in members if p != sid and parent_of(p) not in (*members, None)]


def pids_group_of(pid: int) -> Path | None:
    """A root worker's own pids group (`.../w<pid>`, cgroup v1), if it has one."""
    with open(f"/proc/{pid}/cgroup") as f:
        rel = next((line.split(":", 2)[2].strip() for line in f if ":pids:" in line), "")
    return Path("/sys/fs/cgroup/pids" + rel) if rel.endswith(f"/w{pid}") else None


def test_a_parent_that_dies_mid_fork_fails_the_fork_at_once_and_leaves_nothing_behind(box):
    # A's `after_in_parent` hook runs once the fork B exists, before A answers the host: it waits
    # for the test's word, then kills A. B holds a copy of A's socket until the host's go-ahead,
    # so A's end never reads as closed: the host must learn of A's death from the zygote.
    a_pid, a_dir = value(box.run(
        "import signal, time\n"
        "def die():\n"
        "    while not os.path.exists('die-now'):\n        time.sleep(0.01)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.register_at_fork(after_in_parent=die)\n(os.getpid(), os.getcwd())", session="dying"))
    group = pids_group_of(a_pid)
    assert (group is not None) == (box.user == "root" and os.path.isdir("/sys/fs/cgroup/pids")), group
    answer: list = []
    call = threading.Thread(target=lambda: answer.append(box.srv.call("1", session="dying-kid", fork_from="dying")))
    call.start()
    # B: the other process of A's Unix session, waiting for the host's go-ahead.
    assert wait_until(lambda: fork_in_the_making(a_pid), timeout=30), "no fork seen"
    (b_pid,) = fork_in_the_making(a_pid)
    told = time.monotonic()
    Path(a_dir, "die-now").touch()
    call.join(60)
    took = time.monotonic() - told
    assert answer, "no answer to the fork"
    r = answer[0]
    assert r["isError"], r
    text = r["content"][0]["text"]
    # Well before the 30 s the host waits for a parent's answer: it was told A ended.
    assert took < 15, (took, text)
    assert 'session "dying"\'s worker ended during the fork' in text and "SIGKILL" in text, text
    # Nothing is left: not B, not its directories, not A's pids group (B was in it).
    assert wait_until(lambda: not pid_alive(b_pid) and not session_members(a_pid), timeout=10), session_members(a_pid)
    assert glob.glob(f"{box.dir}/state/**/dying-kid-*", recursive=True) == []
    if group is not None:
        assert wait_until(lambda: not group.exists(), timeout=10), group
    assert "dying-kid" not in {f["name"] for f in box.srv.info()["sessions"]["forks"]}
    # A starts afresh, told why; the zygote still forks sessions, and the name is free.
    rec = box.run("'fresh'", session="dying")
    assert value(rec) == "fresh" and any("failed fork" in n for n in rec.get("notices", [])), rec
    value(box.run("seed = 'S'", session="other-parent"))
    assert value(fork(box, "other-parent", "other-kid", "seed")["structuredContent"]) == "S"
    assert value(fork(box, "dying", "dying-kid", "'made'")["structuredContent"]) == "made"


def test_234_a_process_the_parents_after_fork_hook_starts_is_in_the_forks_own_pids_group(box):
    # A's `after_in_child` hook runs in B as B starts (Python's at-fork hooks): the process it
    # starts must be counted, limited and killed with B, so B must already be in its own pids
    # group (as root) when the hook runs, not still in A's.
    box.run(
        "import time\n"
        "_hook_kids = []\n"
        "def _start_one():\n"
        "    k = os.fork()\n"
        "    if k == 0:\n        time.sleep(60); os._exit(0)\n"
        "    _hook_kids.append(k)\n"
        "os.register_at_fork(after_in_child=_start_one)\n", session="hooked")
    b_pid, kids = value(fork(box, "hooked", "hooked-kid", "(os.getpid(), _hook_kids)")["structuredContent"])
    assert len(kids) == 1, kids
    b_group = pids_group_of(b_pid)
    assert (b_group is not None) == (box.user == "root" and os.path.isdir("/sys/fs/cgroup/pids")), b_group
    with open(f"/proc/{kids[0]}/cgroup") as f:
        kid_group = next((line.split(":", 2)[2].strip() for line in f if ":pids:" in line), "")
    with open(f"/proc/{b_pid}/cgroup") as f:
        b_rel = next((line.split(":", 2)[2].strip() for line in f if ":pids:" in line), "")
    assert kid_group == b_rel, (kid_group, b_rel)
