"""The compiled runner and `mcp` module kept between server starts (issue 50, SECURITY.md #211).

A server's zygote keeps the code it compiled in `<state dir>/code-cache` and runs it at the
next start instead of compiling again. That file is code the zygote runs outside the sandbox,
so these tests attack it:

- from inside the sandbox: a cell can neither write the cache directory nor replace a file in it;
- from beside it: a planted file with a valid checksum runs only when it is a regular file owned
  by the server's user and writable by nobody else (the positive control shows the cache is
  really used); owned by another user, group-writable, behind a symlink, or torn, it is never
  run: the server compiles from source, answers as usual and writes a good file again.

Run as root and as the unprivileged user `nobody`, like the sandbox suite.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, TEST_PYTHON
from test_sandbox import USERS, Sandboxed

RUNNER = REPO / "python" / "_ironcell_runner.py"


def cache_dir(box: Sandboxed) -> Path:
    return box.dir / "state" / "code-cache"


def runner_file(box: Sandboxed) -> Path:
    files = sorted(cache_dir(box).glob("_ironcell_runner-*.marshal"))
    assert len(files) == 1, files
    return files[0]


def restart(box: Sandboxed) -> None:
    """The same state dir, a new server (so a new zygote reads the cache)."""
    from conftest import RawServer

    box.srv.close()
    box.srv = RawServer(box.dir, as_user=box.user, MCP_BRIDGE_STATE_DIR=str(box.dir / "state"))
    box.srv.initialize()
    box.sessions = set()


def planted(marker: Path) -> bytes:
    """A cache file as the zygote writes one (SHA-256 of the payload, then the payload), whose
    code writes `marker` and then runs the real runner."""
    source = f"open({str(marker)!r}, 'w').write('ran')\n" + RUNNER.read_text()
    payload = subprocess.run(
        [TEST_PYTHON, "-c", "import marshal, sys; sys.stdout.buffer.write(marshal.dumps("
         "compile(sys.stdin.read(), '_ironcell_runner.py', 'exec', dont_inherit=True)))"],
        input=source.encode(), capture_output=True, check=True).stdout
    return hashlib.sha256(payload).digest() + payload


def other_uid(user: str) -> int:
    return pwd.getpwnam("nobody").pw_uid if user == "root" else 0


def server_uid(user: str) -> int:
    return pwd.getpwnam(user).pw_uid


@pytest.fixture(params=USERS)
def box(request):
    b = Sandboxed(request.param)
    assert b.run("1 + 1")["result"] == "2"
    yield b
    b.close()


def test_the_compiled_code_is_kept_private_and_no_cell_can_write_it(box):
    d = cache_dir(box)
    assert d.stat().st_mode & 0o777 == 0o700 and d.stat().st_uid == server_uid(box.user)
    names = sorted(p.name.split("-")[0] for p in d.iterdir())
    assert names == ["_ironcell_runner", "mcp"], names
    for f in d.iterdir():
        assert f.stat().st_mode & 0o777 == 0o600 and f.stat().st_uid == server_uid(box.user)
    target = runner_file(box)
    before = target.read_bytes()
    for attack in (
        f"open({str(d / 'evil.marshal')!r}, 'wb').write(b'x')",
        f"open({str(target)!r}, 'r+b').write(b'x')",
        f"os.rename('mine', {str(target)!r})",
        f"os.symlink('/etc/passwd', {str(d / 'link.marshal')!r})",
        f"os.unlink({str(target)!r})",
    ):
        box.run("open('mine', 'wb').write(b'x')")
        got = box.outcome(attack)
        assert got.startswith(("PermissionError", "FileNotFoundError", "OSError")), (attack, got)
    assert target.read_bytes() == before
    assert sorted(p.name.split("-")[0] for p in d.iterdir()) == ["_ironcell_runner", "mcp"]


@pytest.mark.parametrize("how", ["another user's", "group-writable", "behind a symlink", "torn"])
def test_a_planted_cache_file_is_run_only_when_it_is_the_servers_own(box, how):
    marker = box.dir / f"ran-{how.replace(' ', '-')}"
    target = runner_file(box)
    data = planted(marker)
    if how == "behind a symlink":
        real = box.dir / "planted.marshal"
        real.write_bytes(data)
        os.chown(real, server_uid(box.user), -1)
        target.unlink()
        target.symlink_to(real)
    else:
        target.write_bytes(data[:-100] if how == "torn" else data)
        os.chown(target, other_uid(box.user) if how == "another user's" else server_uid(box.user), -1)
        target.chmod(0o620 if how == "group-writable" else 0o600)
    restart(box)
    assert box.run("1 + 1")["result"] == "2"
    assert not marker.exists(), f"the zygote ran a cache file that was {how}"
    # Compiled from source and written again: a regular file of the server's own, intact.
    again = runner_file(box)
    assert not again.is_symlink() and again.stat().st_uid == server_uid(box.user)
    assert again.stat().st_mode & 0o777 == 0o600
    assert again.read_bytes() != data and len(again.read_bytes()) > 32


def test_the_servers_own_cache_file_is_what_the_next_start_runs(box):
    """The positive control: the same planted file, the server's own and private, is run (so
    the refusals above are the checks at work, not a cache that is never read)."""
    marker = box.dir / "ran-own"
    target = runner_file(box)
    target.write_bytes(planted(marker))
    os.chown(target, server_uid(box.user), -1)
    target.chmod(0o600)
    restart(box)
    assert box.run("1 + 1")["result"] == "2"
    assert marker.read_text() == "ran"
