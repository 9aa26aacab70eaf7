"""Forking a session whose arrays are in transparent huge pages (docs/SECURITY.md #271-#276, #283):
where root workers have a memory cgroup, a session and its forks share one group whose limit is
one session's per live member, so pages a parent rewrites after a fork (charged to the group
twice: its new copy, and the original its fork keeps) do not get it killed, and the group
shrinks and goes as its members do. Elsewhere (`nobody`) huge pages stay off."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import wait_until, worker_python_has
from test_fork import value
from test_sandbox import USERS, Sandboxed, forking_sandbox, group_file, memory_groups_of

pytestmark = pytest.mark.skipif(not worker_python_has("numpy"), reason="needs python3-numpy")

MIB = 300


@pytest.fixture(scope="module", params=USERS)
def box(request):
    b = forking_sandbox(request.param, MCP_BRIDGE_MEMORY_LIMIT="512m")
    yield b
    b.close()


def huge_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) >> 10
    return 0


def memory_group(pid: int) -> str:
    line = next(x for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if ":memory:" in x)
    return line.split(":", 2)[2]


def fork(b: Sandboxed, parent: str, child: str, code: str) -> dict:
    rec = b.srv.call(code, session=child, fork_from=parent)["structuredContent"]
    b.sessions.add(child)
    return rec


def test_a_forked_array_stays_in_huge_pages_and_its_rewrites_fit_the_lineages_group(box):
    groups = memory_groups_of(box)
    a = value(box.run(f"import numpy as np\na = np.ones(({MIB} << 20) // 8)\nos.getpid()", session="np-a"))
    b = value(fork(box, "np-a", "np-b", "(os.getpid(), float(a.sum()))"))
    assert b[1] == float((MIB << 20) // 8)
    if groups is None:
        # Huge pages off (#132): numpy's MADV_HUGEPAGE gets none.
        assert huge_mib(a) == 0 and huge_mib(b[0]) == 0
        return
    # numpy advises MADV_HUGEPAGE on large arrays: the parent's array is in 2 MiB pages, and so
    # is the fork's view of it (one page-table entry per 2 MiB copied, not 512).
    assert huge_mib(a) >= MIB - 4 and huge_mib(b[0]) >= MIB - 4, (huge_mib(a), huge_mib(b[0]))
    group = groups / Path(memory_group(a)).name
    assert memory_group(b[0]) == memory_group(a), "the fork stays in its parent's memory group"
    # Two members (the fork joined before its first result): two sessions' room.
    one = (512 + 128) << 20
    assert group_file(group, "memory.limit_in_bytes") == 2 * one
    # The parent rewrites its array twice, forking between: each generation the forks keep is
    # charged to the group (900 MiB for three generations, past one session's 640 MiB).
    value(box.run("a[:] = 2.0\n1", session="np-a"))
    value(fork(box, "np-a", "np-c", "float(a[0])"))
    value(box.run("a[:] = 3.0\n1", session="np-a"))
    assert group_file(group, "memory.max_usage_in_bytes") > one, "three generations, charged once each"
    assert value(box.run("float(a[0])", session="np-b")) == 1.0
    assert value(box.run("float(a[0])", session="np-c")) == 2.0
    assert value(box.run("float(a[0])", session="np-a")) == 3.0
    # Members reset (their workers reaped): the group's limit follows them down.
    assert group_file(group, "memory.limit_in_bytes") == 3 * one
    for kid in ("np-b", "np-c"):
        assert box.run("1", session=kid, reset=True)["status"] == "ok"
    assert wait_until(lambda: group_file(group, "memory.limit_in_bytes") == one, 10)
    assert box.run("1", session="np-a", reset=True)["status"] == "ok"
    assert wait_until(lambda: not group.exists(), 10), f"{group} left behind"


def test_a_fork_outliving_its_parent_keeps_the_lineages_group_under_a_new_name(box):
    groups = memory_groups_of(box)
    if groups is None:
        pytest.skip("no memory cgroups here")
    a = value(box.run("import numpy as np\na = np.ones((64 << 20) // 8)\nos.getpid()", session="gone-a"))
    b = value(fork(box, "gone-a", "gone-b", "os.getpid()"))
    assert box.run("1", session="gone-a", reset=True)["status"] == "ok"
    # The first worker is gone; its fork keeps the group, renamed, so a new worker given the
    # old pid makes a group of its own, and the group has one member's room.
    assert wait_until(lambda: not (groups / f"w{a}").exists(), 10)
    kept = groups / Path(memory_group(b)).name
    assert kept.name.startswith("l") and group_file(kept, "memory.limit_in_bytes") == (512 + 128) << 20
    assert value(box.run("float(a.sum())", session="gone-b")) == float((64 << 20) // 8)
    assert box.run("1", session="gone-b", reset=True)["status"] == "ok"
    assert wait_until(lambda: not kept.exists(), 10), f"{kept} left behind"


PARENT_GONE_MID_FORK = """
import signal, time, mcp
signal.signal(signal.SIGALRM, signal.SIG_DFL)
# Once the fork exists the parent arms its own death (SIGALRM's default action) and answers the
# host; the fork waits in its parent's after-fork hook before it says ready, meanwhile.
os.register_at_fork(after_in_parent=lambda: signal.setitimer(signal.ITIMER_REAL, 0.5),
                    after_in_child=lambda: time.sleep(3))
mcp.fork("late-b")
os.getpid()
"""


@pytest.mark.parametrize("user", USERS)
def test_294_a_fork_whose_parent_was_reaped_before_it_was_ready_has_one_sessions_room(user):
    # SECURITY.md #294: the parent, its group's first worker, reaped while its fork copied its
    # files, before the fork was verified: the fork joined counting the parent still alive, so
    # its group had two sessions' room for one (cut-down huge pages held 767 MiB under a 256 MiB
    # limit where one session's group stops at 383), kept the parent's name, and stayed after
    # the fork was reset. A server of its own: the module's holds its live-session cap.
    box = forking_sandbox(user, MCP_BRIDGE_MEMORY_LIMIT="512m")
    try:
        groups = memory_groups_of(box)
        a = value(box.run(PARENT_GONE_MID_FORK, session="late-a"))
        box.sessions.add("late-b")
        rec = box.run("os.getpid()", session="late-b")
        assert rec["lineage"] == ["late-a"], rec
        b = value(rec)
        assert b != a
        assert box.run("1", session="late-a")["session_state"] == "restarted", "the parent died mid-fork"
        if groups is None:
            return  # no memory groups (nobody): nothing is counted per lineage
        group = groups / Path(memory_group(b)).name
        assert (group / "cgroup.procs").read_text().split() == [str(b)]
        assert group_file(group, "memory.limit_in_bytes") == (512 + 128) << 20, "one member, one session's room"
        assert group.name != f"w{a}", "renamed: a new worker given the pid makes its own"
        assert box.run("1", session="late-b", reset=True)["status"] == "ok"
        assert wait_until(lambda: not group.exists(), 10), f"{group} left behind"
    finally:
        box.close()


def anonymous_mappings(pid: int) -> dict[tuple[int, int], dict[str, str]]:
    """The private writable anonymous mappings of `pid` (`[heap]` included): their `smaps`
    fields (`Size`, `AnonHugePages`, `VmFlags`, ...) by address range."""
    found, fields = {}, None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            path = head[5] if len(head) > 5 else ""
            fields = {} if head[1] == "rw-p" and path in ("", "[heap]") else None
            if fields is not None:
                found[tuple(int(x, 16) for x in head[0].split("-"))] = fields
        elif fields is not None:
            name, _, rest = line.partition(":")
            fields[name] = rest.strip()
    return found


def block_huge_mib(pid: int, mib: int) -> int:
    """How much of the anonymous mapping of `pid` that holds one malloc block of `mib` MiB (a
    little more: the chunk's header, and where workers keep huge pages up to 2 MiB to make it
    whole 2 MiB pages, #289) is in huge pages, in MiB."""
    (block,) = [m for (a, b), m in anonymous_mappings(pid).items() if mib << 20 < b - a <= (mib + 2) << 20]
    return int(block["AnonHugePages"].split()[0]) >> 10


def test_a_large_bytearray_is_in_huge_pages_where_workers_keep_them_and_not_elsewhere(box):
    # Where workers keep huge pages, Python's blocks of 4 MiB and more are advised MADV_HUGEPAGE
    # (large_blocks.rs, SECURITY.md #276), as numpy advises its arrays.
    groups = memory_groups_of(box)
    pid = value(box.run("big = bytearray(64 << 20)\nos.getpid()", session="ba-a"))
    kid = value(fork(box, "ba-a", "ba-b", "mine = b'x' * (40 << 20)\n(os.getpid(), len(big))"))
    assert kid[1] == 64 << 20
    # The parent's block, the fork's view of it, and a block the fork allocated itself.
    huge = (block_huge_mib(pid, 64), block_huge_mib(kid[0], 64), block_huge_mib(kid[0], 40))
    # Off (#132): none of it. On: all but the blocks' unaligned ends.
    assert huge == (0, 0, 0) if groups is None else min(huge[:2]) >= 60 and huge[2] >= 36, huge


@pytest.fixture(scope="module")
def root_without_groups():
    b = Sandboxed("root", IRONCELL_CGROUPS="off", MCP_BRIDGE_MEMORY_LIMIT="512m")
    yield b
    b.close()


# A list's table of pointers grows by realloc, which glibc does by mremap: before #289 every
# move to an address of another offset within 2 MiB split the huge pages moved, and a table
# grown by appends ended mostly in 4 KiB pages (6 of 92 MiB for 12 M items).
GROWN_TABLE = """
import ctypes
grown = [None for _ in range(8_000_000)]
(os.getpid(), ctypes.c_void_p.from_address(id(grown) + 24).value)  # the list's ob_item
"""


def table_mapping(pid: int, table: int) -> tuple[int, int]:
    """The size of the mapping of `pid` holding `table`, and how much of it is in huge pages, MiB."""
    ((lo, hi), m), = [(r, m) for r, m in anonymous_mappings(pid).items() if r[0] <= table < r[1]]
    return (hi - lo) >> 20, int(m["AnonHugePages"].split()[0]) >> 10


def test_289_a_list_grown_by_appends_keeps_its_table_in_huge_pages_and_so_does_its_fork(box):
    groups = memory_groups_of(box)
    pid, table = value(box.run(GROWN_TABLE, session="grown-a"))
    kid = value(fork(box, "grown-a", "grown-b", "os.getpid()"))
    sizes = (table_mapping(pid, table), table_mapping(kid, table))
    for size, huge in sizes:
        # 8 M pointers: a 64 MB table, over-allocated by an eighth.
        assert 60 <= size <= 76, sizes
        # Off (#132): none. On: all but its first 16-24 MiB (written before the table reached the
        # 16 MiB from which blocks are mapped in whole 2 MiB: the move there splits them; 46 of
        # 68 MiB measured), so more than half (before #289: 6-14).
        assert huge == 0 if groups is None else huge > size // 2, sizes


def test_a_root_worker_without_a_memory_group_gets_no_huge_pages_for_a_large_bytearray(root_without_groups):
    b = root_without_groups
    assert memory_groups_of(b) is None
    pid = value(b.run("big = bytearray(64 << 20)\nos.getpid()", session="off"))
    assert block_huge_mib(pid, 64) == 0
    assert value(b.run("import ctypes\nctypes.CDLL(None).prctl(42, 0, 0, 0, 0)", session="off")) == 1


# #132 without ctypes (#276): where workers keep huge pages, Python's blocks of 4 MiB and more
# are advised MADV_HUGEPAGE. This one glibc maps by itself, 6 MiB, 2 MiB-aligned: its last two
# 2 MiB ranges fault in as huge pages as the bytearray is zeroed (the first had its 4 KiB header
# written before the advice). Shrunk to 2 MiB + 8 KiB, realloc `mremap`s the block down, which
# frees the last and leaves the middle one mapped but for 12 KiB: 2 MiB that RssAnon counts as
# 12 KiB, beside the first 2 MiB it counts in full.
MALLOC_CUT_DOWN = """
import ctypes
PIECES = []
for _ in range(PIECE_COUNT):
    piece = bytearray((6 << 20) - 64)
    del piece[(2 << 20) + 8192:]
    PIECES.append(piece)
(ctypes.CDLL(None).prctl(42, 0, 0, 0, 0), len(PIECES), os.getpid())  # PR_GET_THP_DISABLE
"""


def test_276_cut_down_huge_pages_from_plain_python_are_charged_to_the_sessions_group(box):
    # 100 pieces: 200 MiB that RssAnon counts and 200 MiB cut down. The group is given room for
    # the first 200 and 56 MiB more (its limit lowered from outside, as only root can): the
    # cut-down pages take it to its limit, where reclaim splits them and frees their unmapped
    # parts, the cell done and nothing killed (#271, #275). A worker whose malloc never advised
    # huge pages (an older server) stays ~56 MiB below; without a group, huge pages are off.
    group, _ = group_with_room(box, "cut", "os.getpid()", 256)
    flag, kept, _ = value(box.run("PIECE_COUNT = 100\n" + MALLOC_CUT_DOWN, session="cut", timeout_s=300))
    assert kept == 100
    if not reached_its_limit_unkilled(group, flag):
        return
    assert box.run("1", session="cut", reset=True)["status"] == "ok"
    assert wait_until(lambda: not group.exists(), 10), f"{group} left behind"


def group_with_room(box, session: str, setup: str, room_mib: int) -> tuple[Path | None, int]:
    """Runs `setup` (ending in the worker's pid) in a new session; where it has a memory group,
    lowers the group's limit from outside (as only root can) to what it holds now plus
    `room_mib`. The group (None without groups) and what it held."""
    groups = memory_groups_of(box)
    pid = value(box.run(setup, session=session))
    if groups is None:
        return None, 0
    group = groups / Path(memory_group(pid)).name
    held = group_file(group, "memory.usage_in_bytes")
    (group / "memory.limit_in_bytes").write_text(str(held + (room_mib << 20)))
    return group, held


def reached_its_limit_unkilled(group: Path | None, thp_disabled: int) -> bool:
    """After a cut-down huge-page attack: without a memory group, huge pages were off in the
    worker (False); in one, huge pages were on and the group peaked at its limit, where reclaim
    split the cut-down pages, with nothing killed (True)."""
    if group is None:
        assert thp_disabled == 1, "huge pages are on in a worker that has no memory cgroup"
        return False
    assert thp_disabled == 0
    limit, peak = group_file(group, "memory.limit_in_bytes"), group_file(group, "memory.max_usage_in_bytes")
    assert limit - (32 << 20) <= peak <= limit, (peak >> 20, limit >> 20)
    assert "oom_kill 0" in (group / "memory.oom_control").read_text()
    return True


def advised_huge_mib(pid: int, addrs: list[int]) -> tuple[int, int]:
    """Over the anonymous mappings of `pid` that hold one of `addrs` and are advised
    MADV_HUGEPAGE (`hg`): their size and how much of them is in huge pages, in MiB."""
    size = huge = 0
    for (lo, hi), m in anonymous_mappings(pid).items():
        if "hg" in m["VmFlags"].split() and any(lo <= a < hi for a in addrs):
            size += (hi - lo) >> 20
            huge += int(m["AnonHugePages"].split()[0]) >> 10
    return size, huge


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) >> 10
    raise AssertionError(f"no Rss for {pid}")


# The 2 MiB ranges that hold a list's objects (CPython's id() is an object's address).
ADDRESSES = "(os.getpid(), sorted({{id(x) >> 21 << 21 for x in {name}}}))"


def test_283_many_small_objects_are_in_huge_pages_where_workers_keep_them_and_a_small_sessions_are_not(box):
    # A worker that keeps huge pages advises MADV_HUGEPAGE on the arena chunks it maps once it
    # holds 64 MiB of pymalloc's arenas more than it started with (arenas.rs, SECURITY.md #283):
    # 6 M ints are ~180 MiB of arenas, ~120 of them past that. A session holding a few MiB of
    # small objects maps none so advised.
    groups = memory_groups_of(box)
    pid, addrs = value(box.run(f"big = [i + 1000 for i in range(6_000_000)]\n{ADDRESSES.format(name='big')}",
                               session="ints-a"))
    # The fork leaves the list alone: touching an object writes its reference count, and a
    # write to a page it shares with its parent copies it (splitting that huge page, 4 KiB each).
    kid = value(fork(box, "ints-a", "ints-b", "os.getpid()"))
    small_pid, small_addrs = value(box.run(f"small = [str(i) for i in range(200_000)]\n{ADDRESSES.format(name='small')}",
                                           session="ints-small"))
    advised = (advised_huge_mib(pid, addrs), advised_huge_mib(kid, addrs), advised_huge_mib(small_pid, small_addrs))
    if groups is None:
        # Huge pages off (#132): nothing is advised.
        assert advised == ((0, 0), (0, 0), (0, 0)), advised
        return
    # The parent's arenas, and the fork's view of them, in 2 MiB pages: those past the first 64
    # MiB from their first touch, the first 64 MiB collapsed as the worker crossed them (#286).
    for size, huge in advised[:2]:
        assert size >= 170 and huge >= size - 4, advised
    assert advised[2] == (0, 0), advised
    # Freed, the arenas go (pymalloc may keep one empty), and the worker's memory with them.
    before = rss_mib(pid)
    assert value(box.run("del big\n1", session="ints-a")) == 1
    assert advised_huge_mib(pid, addrs)[0] <= 2 and rss_mib(pid) < before - 150, (before, rss_mib(pid))


def test_283_a_root_worker_without_a_memory_group_advises_no_arena_chunks(root_without_groups):
    pid, addrs = value(root_without_groups.run(
        f"big = [i + 1000 for i in range(6_000_000)]\n{ADDRESSES.format(name='big')}", session="off-ints"))
    assert advised_huge_mib(pid, addrs) == (0, 0)


# #271 through pymalloc (#283): in a worker past 64 MiB of arenas (PAD), each new arena chunk is
# one 2 MiB page once touched. Objects of 480 bytes fill arenas in order; dropping those in each
# chunk's upper 1 MiB (id() // 1 MiB odd) frees that arena, which is unmapped: the chunk's huge
# page is split, its lower half still mapped (RssAnon counts it), its upper half charged to the
# group until reclaim splits it off. 192 MiB allocated: 96 kept, 96 cut down; then 96 MiB more.
ARENAS_CUT_DOWN = """
import ctypes
objs = [bytes(440) for _ in range((192 << 20) // 480)]
KEEP = [o for o in objs if not (id(o) >> 20) & 1]
del objs
MORE = b"x" * (96 << 20)
(ctypes.CDLL(None).prctl(42, 0, 0, 0, 0), len(KEEP))  # PR_GET_THP_DISABLE
"""


# The 2 MiB ranges holding two lists' objects, from inside a session.
TWO_ADDRESSES = "(os.getpid(), sorted({{id(x) >> 21 << 21 for x in {a}}}), sorted({{id(x) >> 21 << 21 for x in {b}}}))"


def test_286_a_fork_or_its_parent_crossing_the_threshold_collapses_no_chunk_they_share(box):
    # A session holding 40 MiB of small objects (its own arenas, below the 64 MiB past which
    # they are collapsed, #286) forks; the fork allocates 60 MiB more, crossing, and so does the
    # parent afterwards. Each collapses the chunks it mapped since the fork, never those the
    # fork shares copy-on-write (a collapse would copy them whole: 40 MiB more on either side).
    groups = memory_groups_of(box)
    value(box.run("early = [bytes(440) for _ in range((40 << 20) // 480)]\n1", session="shared-a"))
    late = "late = [bytes(440) for _ in range((60 << 20) // 480)]\n"
    kid, kid_early, kid_late = value(fork(box, "shared-a", "shared-b", late + TWO_ADDRESSES.format(a="early", b="late")))
    pid, early, own = value(box.run(late + TWO_ADDRESSES.format(a="early", b="late"), session="shared-a"))
    shared = (advised_huge_mib(kid, kid_early), advised_huge_mib(pid, early))
    crossed = (advised_huge_mib(kid, kid_late), advised_huge_mib(pid, own))
    assert shared == ((0, 0), (0, 0)), (shared, crossed)
    if groups is None:
        assert crossed == ((0, 0), (0, 0)), crossed
        return
    # Each side's 60 MiB: the chunks past its threshold, and those before it collapsed.
    for size, huge in crossed:
        assert size >= 56 and huge >= size - 4, crossed


# #283's attack on a worker's first 64 MiB of arenas, which it collapses into huge pages as it
# crosses them (#286): 60 MiB of objects in them, 16 MiB more to cross, then every chunk's
# upper arena freed: 30 MiB that RssAnon counts, 30 MiB cut down that it does not; 64 MiB more.
EARLY_ARENAS_CUT_DOWN = """
import ctypes
EARLY = [bytes(440) for _ in range((60 << 20) // 480)]
PAD = [bytes(440) for _ in range((16 << 20) // 480)]
KEEP = [o for o in EARLY if not (id(o) >> 20) & 1]
del EARLY
MORE = b"x" * (64 << 20)
(ctypes.CDLL(None).prctl(42, 0, 0, 0, 0), len(KEEP))  # PR_GET_THP_DISABLE
"""


def test_286_collapsed_first_arenas_cut_down_by_freed_arenas_are_charged_to_the_sessions_group(box):
    # The group is given room for 128 MiB more than the new session holds: what the cell keeps
    # (30 + 16 + 64 MiB) fits with ~16 MiB to spare, with the 30 MiB cut down it does not, so the
    # group reaches its limit (its failcnt rises), where reclaim splits the cut-down pages and
    # frees their unmapped halves, the cell done and nothing killed (#271, #275). A worker that
    # left its first arenas in 4 KiB pages (an older server) never reaches the limit.
    group, _ = group_with_room(box, "cut-early", "os.getpid()", 128)
    flag, kept = value(box.run(EARLY_ARENAS_CUT_DOWN, session="cut-early", timeout_s=300))
    assert kept > 50_000, kept
    if not reached_its_limit_unkilled(group, flag):
        return
    assert group_file(group, "memory.failcnt") > 0
    assert box.run("1", session="cut-early", reset=True)["status"] == "ok"
    assert wait_until(lambda: not group.exists(), 10), f"{group} left behind"


def test_283_arena_chunks_cut_down_by_freed_arenas_are_charged_to_the_sessions_group(box):
    # The group is given room for 256 MiB more than the padded session holds (its limit lowered
    # from outside, as only root can): what the cell keeps (96 + 96 MiB) fits, with the cut-down
    # halves it does not, so the group reaches its limit, where reclaim splits them and frees
    # their unmapped halves, the cell done and nothing killed (#271, #275). A worker whose arenas
    # are never in huge pages (an older server) peaks at ~195 MiB more (the 192 MiB in flight).
    pad = "PAD = [bytes(440) for _ in range((80 << 20) // 480)]\nos.getpid()"
    group, padded = group_with_room(box, "cut-arenas", pad, 256)
    flag, kept = value(box.run(ARENAS_CUT_DOWN, session="cut-arenas", timeout_s=300))
    assert kept > 150_000, kept
    if not reached_its_limit_unkilled(group, flag):
        return
    # Freed, the kept halves go with what is left of their pages: the group's usage returns.
    value(box.run("del KEEP, PAD, MORE\n1", session="cut-arenas"))
    assert group_file(group, "memory.usage_in_bytes") < padded, (group_file(group, "memory.usage_in_bytes") >> 20, padded >> 20)
    assert box.run("1", session="cut-arenas", reset=True)["status"] == "ok"
    assert wait_until(lambda: not group.exists(), 10), f"{group} left behind"
