#!/usr/bin/env python3
"""Focused measurement of a new worker's cost (issue 12: fork -> ready, worker CPU, USS).

usage: scripts/profile_fork.py [--binary target/release/ironcell] [--python /usr/bin/python3]
                               [--preload numpy,pandas] [--sessions 30] [--bursts 3] [--json]

Uses scripts/bench.py's client and measures, in one server:
  fork -> ready per worker, host-timed (the host's `forked_ms`/`ready_ms` debug line), for
    sessions opened one at a time and for bursts of 20 at once (past the spare pool);
  worker CPU time from fork to its first result (/proc/<pid>/task/*/schedstat: all threads,
    independent of the machine's load);
  USS (/proc/<pid>/smaps_rollup) of each idle session after its first result.
Medians and p99, as bench.py prints them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("bench", HERE / "bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(HERE.parent / "target" / "release" / "ironcell"))
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--preload", default="")
    ap.add_argument("--sessions", type=int, default=30)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--pool", help="IRONCELL_POOL_SIZE (default: the binary's)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    c, log = bench.start_profiled_server(a.binary, a.python, "ironcell-prof-", bench.SPAWN_LOG,
                                         preload=a.preload, pool=a.pool)
    if a.preload:
        mods = [m.strip() for m in a.preload.split(",") if m.strip()]
        probe = c.run(f"import sys\nall(m in sys.modules for m in {mods!r})")
        assert probe["result"] == "True", f"preload did not take: {probe}"
    _, pids = bench.new_sessions(c, a.sessions, "s")
    cpu = [bench.worker_cpu_ms(p) for p in pids]
    burst_lat, _ = bench.burst(c, 20, a.bursts, "b")
    time.sleep(0.5)
    uss = [bench.uss_kib(p) / 1024 for p in pids]
    c.close()
    f2r_single = bench.fork_to_ready_ms(log, "s") + bench.fork_to_ready_ms(log, "(spare)")
    f2r_burst = bench.fork_to_ready_ms(log, "b")
    shutil.rmtree(os.path.dirname(log), ignore_errors=True)
    out = {
        "preload": a.preload or "-",
        "fork->ready one at a time (ms)": f2r_single,
        "fork->ready burst of 20 (ms)": f2r_burst,
        "worker CPU fork->first result (ms)": cpu,
        "USS idle session (MiB)": uss,
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(f"python {a.python}; preload {out['preload']}; pool {a.pool or 'default'}; "
              f"{a.sessions} sessions, {a.bursts} bursts of 20")
        for k, v in out.items():
            if isinstance(v, list) and v:
                print(f"  {k:<40} median {bench.med(v):7.3f}  p99 {bench.p99(v):7.3f}  (n={len(v)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
