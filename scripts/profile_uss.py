#!/usr/bin/env python3
"""Where an idle session's private memory comes from (issue 12: USS <= 1.5 MiB per session).

usage: scripts/profile_uss.py [--binary target/release/ironcell] [--python /usr/bin/python3]
                              [--preload numpy,pandas] [--warm-plots 0|1] [--sessions 10]
                              [--breakdown] [--json] [--env NAME=VALUE ...]

Starts one server, waits until the zygote is warmed for plots (with --warm-plots 1 and
matplotlib installed), opens `--sessions` sessions one at a time the way scripts/bench.py does
(each runs `import os; os.getpid()`, so most take a pre-forked spare), lets them idle, and
prints the median and p99 USS (Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup, as
bench.py's "USS per idle session" row) and the host-timed fork -> ready. With --breakdown, also
the median private KiB per kind of mapping (from /proc/<pid>/smaps): [heap], [stack], anonymous
mappings by size (pymalloc arenas are 1 MiB or 256 KiB), thread stacks, and each file mapping
(libpython's .data/.bss, extension modules, ...). Needs to read the workers' /proc entries (run
as the same user as the server, or root).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("bench", HERE / "bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def classify(start: int, end: int, perms: str, name: str) -> str:
    size_kib = (end - start) // 1024
    if name.startswith("["):
        return name
    if not name:
        return f"anon {size_kib} KiB {perms}"
    base = os.path.basename(name)
    return f"{base} {perms}"


def private_by_mapping(pid: int) -> dict[str, int]:
    """Private KiB per kind of mapping (anonymous ones grouped by size and permissions)."""
    out: dict[str, int] = collections.Counter()
    key = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = MAPPING.match(line)
            if m:
                key = classify(int(m.group(1), 16), int(m.group(2), 16), m.group(3), m.group(4).strip())
                continue
            if key and line.startswith(("Private_Clean:", "Private_Dirty:")):
                out[key] += int(line.split()[1])
    return out


def wait_for_log(log: str, needle: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if needle in Path(log).read_text(errors="replace"):
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(HERE.parent / "target" / "release" / "ironcell"))
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--preload", default="")
    ap.add_argument("--warm-plots", default="1", choices=["0", "1"])
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--pool", help="IRONCELL_POOL_SIZE (default: the binary's)")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--rust-log", default=bench.SPAWN_LOG, help="RUST_LOG for the server (default: bench.py's)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="one more variable for the server, e.g. IRONCELL_CGROUPS=off (repeatable)")
    a = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in a.env)
    c, log = bench.start_profiled_server(a.binary, a.python, "ironcell-uss-", a.rust_log, preload=a.preload,
                                         pool=a.pool, IRONCELL_WARM_PLOTS=a.warm_plots, **extra)
    warmed = None
    if a.warm_plots == "1":
        warmed = wait_for_log(log, "new sessions start with matplotlib.pyplot imported", 120)
        time.sleep(0.5)
    _, pids = bench.new_sessions(c, a.sessions, "s")
    time.sleep(0.5)
    uss = [bench.uss_kib(p) / 1024 for p in pids]
    per_map = [private_by_mapping(p) for p in pids] if a.breakdown else []
    # After the reading, in a session of its own: a cell naming matplotlib writes a first plot's
    # pages ahead (~12 MiB), which would count in the idle session it ran in.
    probe = c.run("import sys\n'matplotlib.pyplot' in sys.modules", session="probe")["result"]
    c.close()
    f2r = bench.fork_to_ready_ms(log, "s") + bench.fork_to_ready_ms(log, "(spare)")
    shutil.rmtree(os.path.dirname(log), ignore_errors=True)
    out = {"preload": a.preload or "-", "warm_plots": a.warm_plots, "pyplot_in_worker": probe,
           "warmed": warmed, "USS idle session (MiB)": uss, "fork->ready (ms)": f2r}
    if per_map:
        keys = set().union(*per_map)
        med = {k: bench.med([m.get(k, 0) for m in per_map]) for k in keys}
        out["breakdown (KiB, median)"] = dict(sorted(med.items(), key=lambda kv: -kv[1]))
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"python {a.python}; preload {out['preload']}; warm plots {a.warm_plots} "
          f"(pyplot in worker: {probe}); {a.sessions} sessions")
    for k in ("USS idle session (MiB)", "fork->ready (ms)"):
        v = out[k]
        if v:
            print(f"  {k:<28} median {bench.med(v):7.3f}  p99 {bench.p99(v):7.3f}  (n={len(v)})")
    if per_map:
        print("  private KiB per mapping (median over sessions):")
        rows = list(out["breakdown (KiB, median)"].items())
        for k, v in rows[: a.top]:
            if v:
                print(f"    {v:8.0f}  {k}")
        print(f"    {sum(v for _, v in rows):8.0f}  (sum of medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
