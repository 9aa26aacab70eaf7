"""Spare workers: a new session takes a worker forked and locked down in advance (docs/ARCHITECTURE.md,
"Spare workers"; docs/SECURITY.md #80-#82).

A session is known to run in a spare when its worker process already existed, as a child of
the zygote, before the request was sent (read from /proc by the test, outside the sandbox).
"""

from __future__ import annotations

import ast
import contextlib
import os
import time

import pytest
from conftest import RawServer, pid_alive, shared_tmp_dir, wait_until, worker_python_has

USERS = ["root", "nobody"]


def children(pid: int) -> set[int]:
    kids: set[int] = set()
    with contextlib.suppress(FileNotFoundError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids.update(int(p) for p in f.read().split())
    return kids


def spares_waiting(srv: RawServer) -> int:
    """The plain spares waiting (not the plot spare, kept once plots are warm)."""
    pool = srv.info()["spare_workers"]
    return pool["waiting"] - pool["plot_spare_waiting"]


class Server:
    def __init__(self, as_user: str = "root", **env: str):
        self.dir = shared_tmp_dir()
        state = self.dir / "state"
        state.mkdir(mode=0o777)
        os.chmod(state, 0o777)
        self.state = state
        self.srv = RawServer(self.dir, as_user=as_user, MCP_BRIDGE_STATE_DIR=str(state), **env)
        self.srv.initialize()

    def run(self, code: str, session: str) -> dict:
        r = self.srv.call(code, session=session)
        assert not r.get("isError"), r
        return r["structuredContent"]

    def wait_for_full_pool(self, size: int = 2) -> None:
        assert wait_until(lambda: spares_waiting(self.srv) == size, timeout=60, step=0.1), self.srv.info()

    def workers(self) -> set[int]:
        """Every process the server's zygote(s) forked: spares and session workers."""
        return {w for z in children(self.srv.proc.pid) for w in children(z)}

    def new_session_from_spare(self, session: str, code: str = "") -> dict:
        """Runs `code` in a new session that must have taken a spare."""
        self.wait_for_full_pool()
        before = self.workers()
        rec = self.run("import os\n" + code + "\nos.getpid()", session)
        assert rec["status"] == "ok", rec
        assert rec["session_state"] == "new", rec
        assert int(rec["result"]) in before, f"{session} did not run in a pre-forked spare: {rec}"
        return rec

    def close(self) -> None:
        self.srv.close()


@pytest.fixture(params=USERS)
def server(request):
    s = Server(request.param)
    yield s
    s.close()


def test_a_new_session_runs_in_a_spare_that_knows_its_name_and_directory(server):
    rec = server.new_session_from_spare(
        "analysis",
        "_first = sorted(os.listdir('.'))\n"
        "import tempfile\n"
        "open('made-here.txt', 'w').write('x')\n"
        "with tempfile.NamedTemporaryFile(dir=None, delete=False) as f: f.write(b'y')\n"
        "_where = (os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'], os.environ['PWD'],\n"
        "          os.environ['IRONCELL_SESSION'], os.path.dirname(f.name), sorted(os.listdir('.')), _first)\n"
        "print(repr(_where))\n",
    )
    cwd, home, tmpdir, pwd, name, tmpfile_dir, listing, first = ast.literal_eval(rec["stdout"])
    assert first == [], f"the spare handed over a directory that is not empty: {first}"
    sessions_dir = next(server.state.glob("sessions-*"))
    expected = str(sessions_dir / "analysis")
    assert (cwd, home, tmpdir, pwd, name) == (expected, expected, expected, expected, "analysis")
    assert tmpfile_dir in (expected, "/tmp")  # the private /tmp is the session directory
    assert "made-here.txt" in listing
    # The host sees the file where the session says it is, and links it.
    assert (sessions_dir / "analysis" / "made-here.txt").read_text() == "x"
    assert any(f["path"] == "made-here.txt" for f in rec["files"]), rec
    # No spare directory is left holding the session's files.
    assert not any((p / "made-here.txt").exists() for p in sessions_dir.glob("@spare-*"))


def test_a_spare_leaves_no_name_in_its_session(server):
    """A spare runs a warm-up cell before it waits; the session that takes it must not see
    anything it left: no imported module, no `_` holding the last result."""
    server.wait_for_full_pool()
    before = server.workers()
    rec = server.run("_names = sorted(k for k in globals() if not k.startswith('__'))\n"
                     "import os\n(os.getpid(), _names)", "fresh")
    pid, names = ast.literal_eval(rec["result"])
    assert pid in before, f"the session did not take a spare: {rec}"
    assert "os" not in names and "_" not in names, names
    assert not [n for n in names if n.startswith("_ironcell")], names


def test_a_taken_spare_is_replaced_and_spares_stay_outside_the_session_cap(tmp_path):
    s = Server(IRONCELL_MAX_SESSIONS="1")
    try:
        s.new_session_from_spare("one")
        s.wait_for_full_pool()  # refilled in the background
        i = s.srv.info()
        assert i["sessions"]["live_workers"] == 1, i
        assert i["spare_workers"]["pool_size"] == 2
        # Directories made ahead: at most one set per session the server may hold.
        assert i["spare_workers"]["dirs_made_ahead"]["kept"] == 1, i
        # A second session evicts the first (cap 1) and still takes a spare.
        s.new_session_from_spare("two")
        assert wait_until(lambda: s.srv.info()["sessions"]["live_workers"] == 1)
        again = s.run("1", "one")
        assert any("make room" in n for n in again["notices"]), again
    finally:
        s.close()


def test_a_session_with_files_keeps_its_directory_when_its_worker_is_replaced(server):
    server.new_session_from_spare("keep", "open('data.txt', 'w').write('kept')")
    lost = server.srv.call("import os; os._exit(3)", session="keep")["structuredContent"]
    assert lost["session_state"] == "lost", lost
    rec = server.run("import os; open('data.txt').read(), os.getcwd().endswith('/keep')", "keep")
    assert rec["result"] == "('kept', True)", rec


def test_pool_size_zero_keeps_no_spares():
    s = Server(IRONCELL_POOL_SIZE="0")
    try:
        before = s.workers()
        rec = s.run("import os; os.getpid()", "fresh")
        assert rec["status"] == "ok" and int(rec["result"]) not in before, rec
        time.sleep(1.0)
        i = s.srv.info()
        assert i["spare_workers"]["waiting"] == 0 and i["spare_workers"]["pool_size"] == 0, i
        assert i["spare_workers"]["dirs_made_ahead"] == {"ready": 0, "kept": 0}, i
        sessions_dir = next(s.state.glob("sessions-*"))
        assert not list(sessions_dir.glob("@dir-*")), "directories made ahead without a pool"
    finally:
        s.close()


def test_spares_lost_with_their_zygote_are_not_handed_out(server):
    server.wait_for_full_pool()
    zygote = int(server.run("import os; os.getppid()", "probe")["result"])
    spares = children(zygote)
    os.kill(zygote, 9)
    gone = wait_until(lambda: not any(pid_alive(p) for p in spares | {zygote}), 5)
    assert gone, [(p, open(f"/proc/{p}/status").read()[:300]) for p in spares | {zygote} if pid_alive(p)]
    # The next new session must not get a dead spare: it runs, in a live worker.
    rec = server.srv.call("import os; os.getcwd().endswith('/after')", session="after")
    assert rec["structuredContent"]["status"] == "ok", rec
    assert rec["structuredContent"]["result"] == "True", rec


ATTACKS = {
    # docs/SECURITY.md #80: a spare is locked down before it waits; its session inherits that.
    "read /etc/passwd": "open('/etc/passwd').read()",
    "write a host file": "open({target!r}, 'w').write('pwned')",
    "list the sessions directory": "os.listdir('..')",
    "open an inet socket": "__import__('socket').socket().connect(('127.0.0.1', 9))",
    "start a shell": "os.execv('/bin/sh', ['sh', '-c', 'true'])",
}


@pytest.mark.parametrize("spare", ["plain", "plot"])
@pytest.mark.parametrize("user", USERS)
def test_80_a_session_from_a_spare_is_as_locked_down_as_a_fresh_one(user, spare):
    outside = shared_tmp_dir("/var/tmp")
    target = outside / "host-file"
    s = Server(user)
    try:
        if spare == "plain":
            s.new_session_from_spare("attack")
        else:
            if not worker_python_has("matplotlib"):
                pytest.skip("the plot spare needs matplotlib")
            # The plot spare: kept once plots are warm, taken by a first cell that plots.
            assert wait_until(lambda: s.srv.info()["spare_workers"]["plot_spare_waiting"], timeout=120, step=0.1)
            s.wait_for_full_pool()
            plot_spare = s.srv.info()["spare_workers"]["plot_spare_pid"]
            assert plot_spare in s.workers(), (plot_spare, s.workers())
            rec = s.run("import os  # matplotlib\nos.getpid()", "attack")
            assert int(rec["result"]) == plot_spare, rec
        for what, expr in ATTACKS.items():
            code = (
                "try:\n"
                f"    {expr.format(target=str(target))}\n"
                "    _r = 'ok'\n"
                "except BaseException as e:\n"
                "    _r = type(e).__name__\n"
                "_r"
            )
            rec = s.run(code, "attack")
            assert rec["status"] == "ok", (what, rec)
            assert rec["result"] != "'ok'", f"{what} succeeded in a session from a spare ({user})"
        assert not target.exists()
    finally:
        s.close()


@pytest.mark.parametrize("user", USERS)
def test_81_a_session_cannot_reach_the_spares_waiting_next_to_it(user):
    s = Server(user)
    try:
        s.new_session_from_spare("neighbour")
        s.wait_for_full_pool()
        sessions_dir = next(s.state.glob("sessions-*"))
        spares = sorted(p.name for p in sessions_dir.glob("@spare-*"))
        assert spares, "no spare directories to aim at"
        for name in spares:
            for expr in (f"os.listdir('../{name}')", f"open('../{name}/planted.py', 'w').write('x')"):
                rec = s.run(f"try:\n    {expr}\n    _r = 'ok'\nexcept OSError as e:\n    _r = e.errno\n_r", "neighbour")
                assert rec["result"] != "'ok'", (name, expr, rec)
        assert not any((sessions_dir / n / "planted.py").exists() for n in spares)
    finally:
        s.close()


# Directories made ahead (src/session/pool_dirs.rs): a worker started past the pool takes a
# session directory, a packages view and a forks area the host made before it was asked.


def wait_for_dirs_made_ahead(srv: RawServer) -> int:
    """Waits until the pool keeps its whole stock of directories made ahead; returns its size."""

    def stock() -> tuple[int, int]:
        made = srv.info()["spare_workers"]["dirs_made_ahead"]
        return made["ready"], made["kept"]

    assert wait_until(lambda: stock()[0] == stock()[1] > 0, timeout=60, step=0.1), stock()
    return stock()[1]


def burst(srv: RawServer, codes: dict[str, str]) -> dict[str, dict]:
    """Sends one `run_python` per session at once; each session's record."""
    ids = {}
    for session, code in codes.items():
        ids[srv.next_id] = session
        srv.send({"jsonrpc": "2.0", "id": srv.next_id, "method": "tools/call",
                  "params": {"name": "run_python", "arguments": {"code": code, "session": session}}})
        srv.next_id += 1
    out: dict[str, dict] = {}
    while len(out) < len(ids):
        msg = srv.read(60)
        if msg.get("id") in ids:
            assert not msg["result"].get("isError"), msg
            out[ids[msg["id"]]] = msg["result"]["structuredContent"]
    return out


FIRST_CELL_OF_A_BURST = """\
import os
_first = sorted(os.listdir('.'))
open('mine.txt', 'w').write(os.environ['IRONCELL_SESSION'])
_pkgs = os.environ.get('IRONCELL_PACKAGES_DIR')
try:
    open(os.path.join(_pkgs, 'planted.py'), 'w').write('x')
    _planted = 'ok'
except OSError as e:
    _planted = e.errno
(os.getcwd(), _first, _pkgs and sorted(os.listdir(_pkgs)), _planted)
"""


def test_a_burst_past_the_pool_gets_directories_made_ahead_each_its_own_and_private(server):
    kept = wait_for_dirs_made_ahead(server.srv)
    server.wait_for_full_pool()
    sessions_dir = next(server.state.glob("sessions-*"))
    names = [f"burst{i}" for i in range(6)]  # past the pool of 2: four workers take a made set
    records = burst(server.srv, dict.fromkeys(names, FIRST_CELL_OF_A_BURST))
    for name, rec in records.items():
        assert rec["status"] == "ok" and rec["session_state"] == "new", rec
        cwd, first, pkgs, planted = ast.literal_eval(rec["result"])
        assert cwd == str(sessions_dir / name), rec
        assert first == [], f"{name} was handed a directory that is not empty: {first}"
        assert pkgs == [] and planted != "ok", f"{name}'s packages view is not an empty read-only dir: {rec}"
        assert (sessions_dir / name / "mine.txt").read_text() == name
        assert (sessions_dir / name).stat().st_mode & 0o777 == 0o700
    # What waits made ahead holds nothing of a session's, and the stock is made again.
    assert all(not any(d.iterdir()) for d in sessions_dir.glob("@dir-*"))
    assert wait_for_dirs_made_ahead(server.srv) == kept
    # Each worker's packages view is its own: an install in one session shows in no other.
    rec = server.run("import os; os.environ['IRONCELL_PACKAGES_DIR']", "burst0")
    others = {server.run("import os; os.environ['IRONCELL_PACKAGES_DIR']", n)["result"] for n in names[1:]}
    assert rec["result"] not in others and len(others) == len(names) - 1


def test_a_session_with_files_keeps_its_directory_over_one_made_ahead(server):
    wait_for_dirs_made_ahead(server.srv)
    server.run("open('data.txt', 'w').write('kept')", "keeps")
    lost = server.srv.call("import os; os._exit(3)", session="keeps")["structuredContent"]
    assert lost["session_state"] == "lost", lost
    # Its next worker is started with directories from the stock, but not the session's own.
    rec = server.run("import os; open('data.txt').read(), os.getcwd().endswith('/keeps')", "keeps")
    assert rec["result"] == "('kept', True)", rec


@pytest.mark.parametrize("user", USERS)
def test_262_a_session_cannot_reach_the_directories_made_ahead(user):
    """docs/SECURITY.md #262: the directories waiting for the next workers (a session's
    directory, a forks area, a packages view) are the host's: a session can neither list them
    nor plant anything in them for the next session to find."""
    s = Server(user)
    try:
        wait_for_dirs_made_ahead(s.srv)
        s.run("1", "attacker")
        sessions_dir = next(s.state.glob("sessions-*"))
        views_dir = next((s.state / "packages").glob("views-*"))
        own_view = s.run("import os; os.environ['IRONCELL_PACKAGES_DIR']", "attacker")["result"].strip("'")
        targets = sorted(sessions_dir.glob("@dir-*")) + sorted(sessions_dir.glob("@forks-*"))[-3:]
        targets += [v for v in sorted(views_dir.iterdir()) if str(v) != own_view][-3:]
        assert len(targets) >= 5, targets
        for d in targets:
            for expr in (f"os.listdir({str(d)!r})", f"open({str(d / 'planted.py')!r}, 'w').write('x')",
                         f"os.symlink('/etc', {str(d / 'link')!r})", f"os.mkdir({str(d / 'sub')!r})"):
                rec = s.run(f"import os\ntry:\n    {expr}\n    _r = 'ok'\nexcept OSError as e:\n    _r = e.errno\n_r",
                            "attacker")
                assert rec["status"] == "ok" and rec["result"] != "'ok'", (d, expr, rec)
        # Nothing planted anywhere, including where those directories went meanwhile (a spare
        # taken by the attacker's first run was replaced with one of them).
        planted = [p for root in (sessions_dir, views_dir) for p in root.rglob("*")
                   if p.name in ("planted.py", "link", "sub")]
        assert not planted, planted
        # The next sessions take those directories, empty.
        records = burst(s.srv, {f"next{i}": "import os; sorted(os.listdir('.'))" for i in range(5)})
        assert all(r["result"] == "[]" for r in records.values()), records
    finally:
        s.close()
