"""`/tmp` inside a session: the session's own directory through a private mount namespace where
the kernel allows it, and an explained refusal (with TMPDIR/tempfile in the session dir) where it
does not. Both paths are attacked from inside run_python, as root and as `nobody`.

The state dir is outside `/tmp` here (under /var/tmp): with session directories beneath `/tmp`
ironcell falls back on purpose (a bind over `/tmp` would hide their real paths).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import RawServer

USERS = ["root", "nobody"]


def outside_tmp_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="ironcell-ptmp-", dir="/var/tmp"))
    d.chmod(0o777)
    (d / "state").mkdir(mode=0o777)
    (d / "state").chmod(0o777)
    return d


class Box:
    def __init__(self, as_user: str, **env: str):
        self.dir = outside_tmp_dir()
        self.state = self.dir / "state"
        self.srv = RawServer(self.dir, as_user=as_user, MCP_BRIDGE_STATE_DIR=str(self.state), **env)
        self.srv.initialize()

    def run(self, code: str, session: str = "s1") -> dict:
        return self.srv.call(code, session=session)["structuredContent"]

    def value(self, code: str, session: str = "s1"):
        rec = self.run(code, session)
        assert rec["status"] == "ok", rec
        return ast.literal_eval(rec["result"])

    def info(self) -> dict:
        r = self.srv.request("resources/read", {"uri": "system://info"})
        return json.loads(r["result"]["contents"][0]["text"])

    def close(self):
        self.srv.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(params=USERS)
def ns_box(request):
    b = Box(request.param)
    yield b
    b.close()


@pytest.fixture(params=USERS)
def fallback_box(request):
    b = Box(request.param, IRONCELL_PRIVATE_TMP="off")
    yield b
    b.close()


def test_tmp_is_the_sessions_own_directory_and_nothing_reaches_the_host(ns_box):
    marker = f"ironcell-ptmp-{os.getpid()}-{id(ns_box)}.txt"
    assert not os.path.exists(f"/tmp/{marker}")
    code = f"""
import os
open('/tmp/{marker}', 'w').write('session one')
os.makedirs('/tmp/sub', exist_ok=True)
open('/tmp/sub/x.json', 'w').write('{{}}')
(sorted(os.listdir('/tmp')), sorted(os.listdir('.')), os.path.samefile('/tmp', '.'))
"""
    in_tmp, in_cwd, same = ns_box.value(code)
    assert marker in in_tmp and "sub" in in_tmp and same, (in_tmp, in_cwd)
    # The host's /tmp never saw it; the file is in the session's own directory on the host.
    assert not os.path.exists(f"/tmp/{marker}")
    sessions = list(ns_box.state.glob("sessions-*/s1"))
    assert len(sessions) == 1 and (sessions[0] / marker).read_text() == "session one"
    # It persists for the session, and is a session resource.
    assert ns_box.value(f"open('/tmp/{marker}').read()") == "session one"
    listed = ns_box.srv.request("resources/list")["result"]["resources"]
    assert any(r["uri"].endswith(f"/s1/{marker}") for r in listed), listed
    # Another session has its own /tmp and cannot see this one's.
    assert ns_box.value(f"import os\n(os.path.exists('/tmp/{marker}'), os.listdir('/tmp'))", session="s2") == (False, [])
    info = ns_box.info()["sandbox"]["private_tmp"]
    assert info["detail"]["mechanism"] == "namespace", info


def test_the_worker_cannot_undo_or_remount_its_tmp(ns_box):
    for call in ("libc.umount2(b'/tmp', 2)", "libc.mount(b'/', b'/tmp', None, 4096, None)",
                 "libc.unshare(0x00020000)"):
        rec = ns_box.run(f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nrc = {call}\n(rc, ctypes.get_errno())")
        # seccomp kills the worker (mount family and unshare are on the kill list)...
        assert rec["status"] == "crashed" or ast.literal_eval(rec["result"])[0] == -1, rec
        # ...and the session's next worker still has its private /tmp, the host's is untouched.
        assert ns_box.value("import os\nopen('/tmp/again', 'w').write('x')\nos.path.samefile('/tmp', '.')")
        assert not os.path.exists("/tmp/again")


def test_forced_fallback_refuses_tmp_with_the_reason_and_the_way_out(fallback_box):
    code = """
import os, tempfile
try:
    open('/tmp/ironcell-fallback-probe', 'w')
    err = None
except PermissionError as e:
    err = (e.errno, str(e))
with tempfile.NamedTemporaryFile('w', suffix='.txt', delete=False) as f:
    f.write('ok')
(err, os.path.dirname(f.name) == os.getcwd(), os.environ['TMPDIR'] == os.getcwd())
"""
    err, tempfile_in_session, tmpdir_is_session = fallback_box.value(code)
    assert err[0] == 13 and "IRONCELL_PRIVATE_TMP=off" in err[1] and "TMPDIR" in err[1], err
    assert tempfile_in_session and tmpdir_is_session
    assert not os.path.exists("/tmp/ironcell-fallback-probe")
    # The sandbox, not the message, is the boundary: a raw open(2) is refused by Landlock too.
    rc = fallback_box.value("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                            "(libc.open(b'/tmp/ironcell-fallback-raw', os.O_CREAT | os.O_WRONLY, 0o644), ctypes.get_errno())")
    assert rc == (-1, 13)
    assert not os.path.exists("/tmp/ironcell-fallback-raw")
    info = fallback_box.info()["sandbox"]["private_tmp"]
    assert info["detail"]["mechanism"] == "fallback" and "IRONCELL_PRIVATE_TMP=off" in info["in_force"]


def test_session_dirs_beneath_tmp_fall_back_and_say_why(tmp_path):
    srv = RawServer(tmp_path, MCP_BRIDGE_STATE_DIR=str(tmp_path / "state"))
    try:
        srv.initialize()
        r = srv.call("import os\ntry:\n    open('/tmp/x-ironcell', 'w')\nexcept PermissionError as e:\n    print(e)")
        assert "MCP_BRIDGE_STATE_DIR" in r["structuredContent"]["stdout"], r
        # The session dir itself (beneath /tmp here) stays usable by absolute path and tempfile.
        r = srv.call("import tempfile\nd = tempfile.mkdtemp()\nopen(os.path.join(d, 'f'), 'w').write('x')\n"
                     "open(os.path.abspath('g'), 'w').write('y')\n(d.startswith(os.getcwd()), open('g').read())")
        assert r["structuredContent"]["result"] == "(True, 'y')", r
        info = json.loads(srv.request("resources/read", {"uri": "system://info"})["result"]["contents"][0]["text"])
        assert info["sandbox"]["private_tmp"]["detail"]["mechanism"] == "fallback"
    finally:
        srv.close()


def test_doctor_says_which_tmp_is_in_force():
    import subprocess

    from conftest import IRONCELL

    d = outside_tmp_dir()
    try:
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "MCP_BRIDGE_STATE_DIR": str(d / "state")}
        out = subprocess.run([str(IRONCELL), "doctor"], env=env, capture_output=True, text=True, timeout=60).stdout
        assert "/tmp          private per session" in out, out
        out = subprocess.run([str(IRONCELL), "doctor"], env={**env, "IRONCELL_PRIVATE_TMP": "off"},
                             capture_output=True, text=True, timeout=60).stdout
        assert "/tmp          fallback" in out, out
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting beneath the host's /tmp needs root")
@pytest.mark.parametrize("as_user", USERS)
def test_a_mount_beneath_the_hosts_tmp_does_not_change_what_is_reported(as_user):
    """A chroot's /proc or a FUSE mount beneath the host's /tmp is locked in a user namespace:
    the report must still match what the workers get (it said fallback while they had their
    private /tmp)."""
    import subprocess

    from conftest import IRONCELL

    mnt = Path(tempfile.mkdtemp(prefix="ironcell-ptmp-mnt-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "none", str(mnt)], check=True)
    box = None
    try:
        box = Box(as_user)
        assert box.value("import os\nopen('/tmp/mine', 'w').write('x')\nos.path.samefile('/tmp', '.')") is True
        info = box.info()["sandbox"]["private_tmp"]
        assert info["detail"]["mechanism"] == "namespace", info
        runner = ["/usr/sbin/runuser", "-u", "nobody", "--"] if as_user == "nobody" else []
        env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "MCP_BRIDGE_STATE_DIR": str(box.state)}
        out = subprocess.run([*runner, "env", *(f"{k}={v}" for k, v in env.items()), str(IRONCELL), "doctor"],
                             capture_output=True, text=True, timeout=60).stdout
        assert "/tmp          private per session" in out, out
    finally:
        if box:
            box.close()
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def test_a_worker_in_its_namespace_is_still_supervised(ns_box):
    # The host still interrupts it on timeout (SIGINT; the session survives)...
    rec = ns_box.srv.call("import time\ntime.sleep(60)", session="slow", timeout_s=1)["structuredContent"]
    assert rec["status"] == "timeout" and rec["session_state"] != "lost", rec
    assert ns_box.value("import os\nos.path.samefile('/tmp', '.')", session="slow") is True
    # ...and kills it when it ignores the interrupt (SIGKILL; the next run starts fresh).
    code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
    rec = ns_box.srv.call(code, session="slow", timeout_s=1)["structuredContent"]
    assert rec["session_state"] == "lost", rec
    assert ns_box.value("import os\nos.path.samefile('/tmp', '.')", session="slow") is True
