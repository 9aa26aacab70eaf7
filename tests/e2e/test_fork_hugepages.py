"""Forking a session whose arrays are in transparent huge pages (docs/SECURITY.md #271-#274):
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
