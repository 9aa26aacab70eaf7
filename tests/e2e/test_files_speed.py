"""The scratch quota's measurement costs nothing while a session of many files sits idle, and
still catches every way of growing the directory (issue 12; no timing asserted here: the
timings live in scripts/bench.py).

The quota watch walks a session directory (a `stat` per entry) only when the session's worker
has used CPU since its last walk began: writing, by any means, costs the writer CPU. So:
- an idle session whose worker does nothing is walked once after its run, then left alone;
- a thread the code left behind that wakes up later (after idle checks that skipped the walk)
  and grows the directory is still measured and stopped, even when it writes through `mmap`
  into a sparse file (which the host's inotify watches never hear about).

Run as root and as the unprivileged user `nobody`, like the sandbox suite.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from conftest import wait_until
from test_sandbox import USERS, Sandboxed, background_filler, with_scratch_quota

QUOTA_MIB = 64
QUOTA_LOG = "ironcell=info,ironcell::session::quota=debug,rmcp=warn"
MANY = 10_000  # each counts 4 KiB: ~40 MiB of the 64 MiB quota


@pytest.fixture(params=USERS)
def box(request):
    b = with_scratch_quota(request.param, QUOTA_MIB, RUST_LOG=QUOTA_LOG)
    yield b
    b.close()


def walks(box: Sandboxed, session: str) -> list[int]:
    """Entries counted by each quota walk of `session` so far, from the host's debug log."""
    log = (box.dir / "raw-server.log").read_text(errors="replace")
    return [int(m.group(1)) for m in re.finditer(
        rf"measured the session directory against its quota session={re.escape(session)} entries=(\d+)", log)]


def session_dir(box: Sandboxed, session: str) -> Path | None:
    found = list((box.dir / "state").glob(f"sessions-*/{session}"))
    return found[0] if found else None


MAKE_MANY = (
    "os.mkdir('many')\n"
    f"for i in range({MANY}):\n"
    "    os.close(os.open(f'many/f{i}', os.O_CREAT | os.O_WRONLY, 0o600))\n"
    "len(os.listdir('many'))"
)


def test_an_idle_session_of_many_files_is_walked_once_then_left_alone(box):
    rec = box.run(MAKE_MANY, session="quiet")
    assert rec["status"] == "ok" and rec["result"] == str(MANY), rec
    # The walk after the run sees every file...
    assert wait_until(lambda: any(n > MANY for n in walks(box, "quiet")), timeout=60, step=0.2), \
        walks(box, "quiet")
    after_run = len(walks(box, "quiet"))
    # ...and while its worker does nothing, the session is not walked again (the watch looks at
    # idle sessions every 2 s; a slow machine can only make it look less often).
    time.sleep(7)
    assert len(walks(box, "quiet")) <= after_run + 1, walks(box, "quiet")
    # The session is intact and still in use: a run is measured again.
    rec = box.run("open('one-more', 'w').write('x')\nlen(os.listdir('many'))", session="quiet")
    assert rec["status"] == "ok" and rec["result"] == str(MANY), rec
    assert [f["path"] for f in rec["files"]] == ["one-more"], rec
    seen = len(walks(box, "quiet"))
    assert wait_until(lambda: len(walks(box, "quiet")) > seen, timeout=60, step=0.2)


# A thread that sleeps through several idle checks (its worker uses no CPU meanwhile, so they
# skip the walk), then grows the directory past the quota without a single write(): a sparse
# file's pages dirtied through a shared mapping (inotify reports no event for that).
MMAP_LATER = f"""
import mmap, threading, time
def fill():
    time.sleep(6)
    fd = os.open('sparse.bin', os.O_CREAT | os.O_RDWR, 0o600)
    size = {QUOTA_MIB} << 20
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    for off in range(0, size, mmap.PAGESIZE):
        m[off] = 1
    while True:
        time.sleep(1)
threading.Thread(target=fill, daemon=True).start()
'started'
"""


def test_a_thread_that_wakes_after_idle_checks_and_fills_a_sparse_file_through_mmap_is_stopped(box):
    rec = box.run(MAKE_MANY, session="sleeper")
    assert rec["status"] == "ok" and rec["result"] == str(MANY), rec
    rec = box.run(MMAP_LATER, session="sleeper")
    assert rec["status"] == "ok" and rec["result"] == "'started'", rec
    # Nobody calls run_python: the host notices on its own, kills the worker, removes the files.
    d = session_dir(box, "sleeper")
    assert d is not None
    assert wait_until(lambda: not (d / "many").exists(), timeout=120, step=0.2), walks(box, "sleeper")
    rec = box.run("import os\nlen(os.listdir('.'))", session="sleeper")
    assert rec["status"] == "ok" and rec["result"] == "0", rec
    assert rec["session_state"] == "restarted", rec
    note = " ".join(rec.get("notices", []))
    assert "killed between runs" in note and "quota" in note, rec


def test_a_writer_that_starts_after_idle_checks_in_a_session_of_many_files_is_stopped(box):
    rec = box.run(MAKE_MANY, session="late")
    assert rec["status"] == "ok", rec
    rec = box.run(
        background_filler(6),
        session="late",
    )
    assert rec["status"] == "ok", rec
    d = session_dir(box, "late")
    assert d is not None
    assert wait_until(lambda: not (d / "many").exists(), timeout=120, step=0.2), walks(box, "late")
    rec = box.run("import os\nlen(os.listdir('.'))", session="late")
    assert rec["status"] == "ok" and rec["result"] == "0", rec
    note = " ".join(rec.get("notices", []))
    assert "killed between runs" in note and "quota" in note, rec
