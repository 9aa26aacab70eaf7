"""A new session's first plot costs what a warm one does (issue 12): once the server has built
matplotlib's shared font cache, it has the zygote import matplotlib and pyplot (Agg) with that
cache, so every worker forked afterwards starts with them. Asserted functionally (the timings
live in scripts/bench.py):

- after the cache is ready, a new session's first cell finds `matplotlib.pyplot` imported, with
  the Agg backend, the shared cache and no figure left over from the zygote's own test draw; its
  first plot still comes back as an image; this holds for a spare from the pool and for a worker
  forked on demand (pool off), as root and as `nobody`;
- a zygote started again after it died is warmed again before it forks;
- a new session's first cell that plots takes the copy-on-write faults of its plot ahead, in
  bulk (the pages the zygote's probe plot wrote): the plot itself then faults far less than the
  same plot in a new session whose cell does not look like one, and still comes back whole;
- `IRONCELL_WARM_PLOTS=off` keeps pyplot out of new sessions (nothing is written ahead), and
  plots still work.

Readiness is polled the way a client sees it (a new session is given `MPLCONFIGDIR`), never by
sleeping.
"""

from __future__ import annotations

import ast
import itertools
import os
import signal

import pytest

from conftest import needs_plotting, pid_alive, wait_until
from test_sandbox import Sandboxed

pytestmark = needs_plotting

_fresh = itertools.count()

FIRST_CELL = (
    "import sys\n"
    "_m = sys.modules\n"
    "_seen = ('matplotlib.pyplot' in _m, 'matplotlib.font_manager' in _m)\n"
    "import os, matplotlib, matplotlib.pyplot as plt\n"
    "(*_seen, matplotlib.get_backend().lower(), matplotlib.get_cachedir() == os.environ.get('MPLCONFIGDIR'),\n"
    " plt.get_fignums(), os.getppid())"
)

PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 4, 2, 8])\nplt.title('first')\n'plotted'"


def new_session(box: Sandboxed) -> str:
    return f"fresh{next(_fresh)}"


def first_cell(box: Sandboxed, code: str) -> dict:
    """Runs `code` as the very first cell of a brand-new session (no prelude before it)."""
    session = new_session(box)
    box.sessions.add(session)
    rec = box.srv.call(code, session=session)["structuredContent"]
    assert rec["status"] == "ok", rec
    return rec | {"session": session}


def wait_for_shared_font_cache(box: Sandboxed) -> None:
    seen = []

    def ready() -> bool:
        rec = first_cell(box, "import os\nos.environ.get('MPLCONFIGDIR')")
        seen.append(rec["result"])
        return rec["result"] not in (None, "None")

    assert wait_until(ready, timeout=120, step=0.5), f"no session got the shared font cache: {seen[-3:]}"


def assert_first_cell_has_pyplot(box: Sandboxed) -> int:
    rec = first_cell(box, FIRST_CELL)
    pyplot, font_manager, backend, shared_cache, figures, zygote = ast.literal_eval(rec["result"])
    assert (pyplot, font_manager) == (True, True), rec
    assert backend == "agg", rec
    assert shared_cache, rec
    assert figures == [], rec  # the zygote's test draw left nothing behind
    # The first plot of that same session still comes back as an image.
    rec = box.run(PLOT, session=rec["session"])
    assert rec["status"] == "ok" and rec["result"] == "'plotted'", rec
    assert len(rec["images"]) == 1, rec
    return zygote


@pytest.fixture(scope="module", params=[("root", "2"), ("nobody", "2"), ("root", "0")],
                ids=["root", "nobody", "root-no-pool"])
def box(request):
    user, pool = request.param
    b = Sandboxed(user, IRONCELL_POOL_SIZE=pool)
    yield b
    b.close()


def test_a_new_sessions_first_cell_finds_pyplot_imported_and_its_first_plot_comes_back(box):
    wait_for_shared_font_cache(box)
    assert_first_cell_has_pyplot(box)
    # Several new sessions in a row (spares, then refills or on-demand forks): every one of them.
    for _ in range(3):
        assert_first_cell_has_pyplot(box)


# The same figure, counting the page faults the plot itself takes (getrusage, the worker's own):
# once as a cell with plotting words, once spelled so that no word gives it away.
COUNTED = (
    "import resource as _r\n_f0 = _r.getrusage(_r.RUSAGE_SELF).ru_minflt\n"
    "import matplotlib.pyplot as plt\n"
    "fig = plt.figure()\nplt.plot([1, 2, 3], [1, 4, 9])\nfig.savefig('p.png')\nplt.close(fig)\n"
    "_r.getrusage(_r.RUSAGE_SELF).ru_minflt - _f0\n"
)
COUNTED_UNMARKED = (
    "import resource as _r\n_f0 = _r.getrusage(_r.RUSAGE_SELF).ru_minflt\n"
    "m = __import__('matp' + 'lotlib.pyp' + 'lot', fromlist=['x'])\n"
    "fig = m.figure()\ngetattr(m, 'pl' + 'ot')([1, 2, 3], [1, 4, 9])\n"
    "getattr(fig, 'save' + 'fig')('p.png')\nm.close(fig)\n"
    "_r.getrusage(_r.RUSAGE_SELF).ru_minflt - _f0\n"
)
PAGES_AHEAD = "import _ironcell_runner\n_ironcell_runner._plot_pages_ahead"


def test_a_first_plot_takes_its_copy_on_write_faults_ahead(box):
    wait_for_shared_font_cache(box)
    marked = first_cell(box, COUNTED)
    unmarked = first_cell(box, COUNTED_UNMARKED)
    for rec in (marked, unmarked):
        assert [i["path"] for i in rec["images"]] == ["p.png"], rec
    faults_marked, faults_unmarked = int(marked["result"]), int(unmarked["result"])
    faults_warm = int(box.run(COUNTED, session=marked["session"])["result"])
    # Measured (Debian's 3.11): ~265 against ~3,600, and ~140 for the same plot in the warm
    # session; ~910 before the heap the plot grows into was written ahead as well.
    assert faults_marked * 2 < faults_unmarked, (faults_marked, faults_unmarked)
    assert faults_marked < 3 * faults_warm, (faults_marked, faults_warm)
    done, pages = ast.literal_eval(box.run(PAGES_AHEAD, session=marked["session"])["result"])
    assert done is False and pages > 500, (done, pages)
    # Once per worker: the session that hid its plot has not written anything ahead.
    assert box.run(PAGES_AHEAD, session=unmarked["session"])["result"] == "[True, 0]"


def mappings_of(pid: int, name: str) -> list[list[str]]:
    """The `/proc/<pid>/maps` lines (split) of the file whose name starts with `name`, in order."""
    with open(f"/proc/{pid}/maps") as f:
        return [ln.split() for ln in f if len(ln.split()) > 5 and os.path.basename(ln.split()[5]).startswith(name)]


# The worker changes the protection of one page of its own, under its sandbox: writable, then
# back to read-only.
OWN_MPROTECT = (
    "import ctypes\n"
    "_mp = ctypes.CDLL(None, use_errno=True).mprotect\n"
    "_mp.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n"
    "(_mp({addr}, 4096, 3), _mp({addr}, 4096, 1))"
)


def test_303_a_workers_libraries_come_with_their_relro_and_data_in_one_mapping(box):
    """The zygote makes each library's RELRO writable again before it forks, so it joins the
    library's data mapping (fewer mappings for every fork to copy; SECURITY.md #303): libc
    (loaded at start) and matplotlib's `_path` and libpng (loaded by the plot warm-up) each come
    as headers, code, read-only data and one writable mapping. A writable RELRO is the worker's
    own memory, whose protection it could always change itself: under its sandbox it makes a
    page of libc's read-only data writable and back."""
    wait_for_shared_font_cache(box)
    rec = first_cell(box, "import os\nos.getpid()")
    pid = int(rec["result"])
    libc, path_ext, png = (mappings_of(pid, n) for n in ("libc.so", "_path.cpython", "libpng"))
    for maps in (libc, path_ext, png):
        assert [m[1] for m in maps] == ["r--p", "r-xp", "r--p", "rw-p"], (libc, path_ext, png)
    read_only = int(libc[2][0].split("-")[0], 16)
    own = box.run(OWN_MPROTECT.format(addr=read_only), session=rec["session"])
    assert own["status"] == "ok" and own["result"] == "(0, 0)", own


def pool_info(box: Sandboxed) -> dict:
    return box.srv.info()["spare_workers"]


def private_mib(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith("Private_"))
    return sum(int(v.split()[0]) for v in fields.values()) / 1024


PLOT_WITH_PID = "import os\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.savefig('p.png')\nos.getpid()"


def test_a_new_session_whose_first_cell_plots_takes_the_spare_that_wrote_its_pages_ahead(box):
    if pool_info(box)["pool_size"] == 0:
        # No pool, no plot spare: the session writes the pages itself (the test above).
        assert pool_info(box)["plot_spare"] is False
        return
    wait_for_shared_font_cache(box)
    assert pool_info(box)["plot_spare"] is True
    assert_first_cell_has_pyplot(box)
    for _ in range(2):
        assert wait_until(lambda: pool_info(box)["plot_spare_waiting"], timeout=60, step=0.1), pool_info(box)
        plot_spare = pool_info(box)["plot_spare_pid"]
        # Read outside the sandbox: it holds a first plot's pages already (~12 MiB private,
        # against ~1.4 MiB for a plain spare).
        assert private_mib(plot_spare) > 6, private_mib(plot_spare)
        # A session that does not plot leaves it waiting...
        other = first_cell(box, "import os\nos.getpid()")
        assert int(other["result"]) != plot_spare, other
        assert pid_alive(plot_spare) and pool_info(box)["plot_spare_pid"] == plot_spare
        # ...and one whose first cell plots takes it, and its plot comes back.
        rec = first_cell(box, PLOT_WITH_PID)
        assert int(rec["result"]) == plot_spare, rec
        assert [i["path"] for i in rec["images"]] == ["p.png"], rec
        done, pages = ast.literal_eval(box.run(PAGES_AHEAD, session=rec["session"])["result"])
        assert done is False and pages > 500, (done, pages)


def test_a_zygote_started_again_after_it_died_is_warmed_again_before_it_forks(box):
    wait_for_shared_font_cache(box)
    zygote = assert_first_cell_has_pyplot(box)
    for _ in range(3):
        os.kill(zygote, signal.SIGKILL)
        assert wait_until(lambda: not pid_alive(zygote), 10)
        # Spares of the dead zygote are dying with it (their parent-death signal was sent
        # before it became a zombie), maybe before the server has read the end of its socket:
        # a session asking right now is handed none of them, and its first cell runs in a
        # worker of the new zygote.
        now = assert_first_cell_has_pyplot(box)
        assert now != zygote
        zygote = now


def test_with_warm_plots_off_new_sessions_import_matplotlib_themselves():
    b = Sandboxed("root", IRONCELL_WARM_PLOTS="off")
    try:
        wait_for_shared_font_cache(b)
        for _ in range(2):
            rec = first_cell(b, FIRST_CELL)
            pyplot, font_manager, backend, shared_cache, figures, _ = ast.literal_eval(rec["result"])
            assert (pyplot, font_manager) == (False, False), rec
            assert backend == "agg" and shared_cache and figures == [], rec
            rec = b.run(PLOT, session=rec["session"])
            assert rec["status"] == "ok" and len(rec["images"]) == 1, rec
            # No probe ran: nothing to write ahead.
            assert b.run(PAGES_AHEAD, session=rec["session"])["result"] == "[False, 0]"
    finally:
        b.close()
