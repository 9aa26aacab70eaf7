#!/usr/bin/env python3
"""Which pages a new worker faults on, from its fork to its first result (issue 50's burst).

usage: scripts/profile_faults.py [--binary target/release/ironcell] [--python /usr/bin/python3]
                                 [--bursts 1] [--top 40] [--env NAME=VALUE ...]

Starts one server (scripts/bench.py's client), waits until its spares are ready, then records
every page fault on the machine (`perf record -e page-faults -c 1 -d -a`: software events,
which this VM has) while it opens `--bursts` bursts of 20 new sessions (cell `1`), and
attributes each fault of those workers, per worker, to:
  - the zygote's mapping holding the address (the worker's layout is its zygote's): the heap,
    each pymalloc arena chunk by size, the interpreter's data, each library's code and data;
  - in writable memory, the object: a static of the interpreter (its dynamic symbols, e.g.
    `_PyRuntime`, `PyDict_Type`), or the Python object in the pymalloc block holding the
    address, read from the zygote's memory (type, and a function's or code object's name);
  - the faulting instruction's symbol.
Also each worker's minor faults (`/proc/<pid>/stat`) after its first result. Needs root (perf
system-wide and the zygote's `/proc/<pid>/mem`) and `perf`. Read-only faults on code and
read-only data are the pages whose page tables `fork` does not copy (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("bench", HERE / "bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) \S+ \S+\s*(.*)$")
POOL = 16 * 1024  # pymalloc's pool on 64-bit CPython 3.10+ (the block's size class is in its header)


def maps(pid: int) -> list[tuple[int, int, str, int, str]]:
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            m = MAPPING.match(line)
            if m:
                out.append((int(m[1], 16), int(m[2], 16), m[3], int(m[4], 16), m[5].strip()))
    return out


def label(start: int, end: int, perms: str, name: str) -> str:
    if name.startswith("["):
        return f"{name} {perms}"
    if not name:
        return f"anon {(end - start) // 1024} KiB {perms}"
    return f"{os.path.basename(name.split(' ')[0])} {perms}"


class Memory:
    """Another process's memory, read through `/proc/<pid>/mem`."""

    def __init__(self, pid: int):
        self.f = open(f"/proc/{pid}/mem", "rb", buffering=0)  # noqa: SIM115 - kept for the run
        self.names: dict[int, str | None] = {}

    def read(self, addr: int, n: int) -> bytes | None:
        if not 0 < addr < 1 << 47:
            return None
        try:
            self.f.seek(addr)
            return self.f.read(n)
        except (OSError, ValueError, OverflowError):
            return None

    def word(self, addr: int) -> int:
        b = self.read(addr, 8)
        return struct.unpack("Q", b)[0] if b and len(b) == 8 else 0

    def text(self, addr: int, n: int = 60) -> str:
        b = (self.read(addr, n) or b"").split(b"\0")[0]
        return b.decode() if b and all(32 <= c < 127 for c in b) else ""

    def type_name(self, t: int) -> str | None:
        """`tp_name` of the type object at `t`, if it is one (its type's type is `type`)."""
        if t not in self.names:
            meta = self.word(t + 8) if t % 8 == 0 else 0
            root = self.word(meta + 8) if meta else 0
            ok = root and self.word(root + 8) == root
            self.names[t] = self.text(self.word(t + 24)) or None if ok else None
        return self.names[t]

    def short_str(self, p: int) -> str:
        """A compact ASCII str's text (CPython 3.11's layout), or ''."""
        n = self.word(p + 16)
        return self.text(p + 48, n) if 0 < n <= 60 else ""


def interpreter_statics(zygote: int) -> tuple[int, list[tuple[int, int, str]]]:
    """The interpreter executable's load bias and its dynamic data symbols (start, size, name)."""
    exe = os.readlink(f"/proc/{zygote}/exe")
    with open(exe, "rb") as f:
        pie = struct.unpack("H", f.read(18)[16:18])[0] == 3  # ET_DYN
    bias = min((s - off for s, _, _, off, n in maps(zygote) if n == exe), default=0) if pie else 0
    nm = subprocess.run(["nm", "-D", "--defined-only", "-S", exe], capture_output=True, text=True).stdout
    syms = []
    for line in nm.splitlines():
        p = line.split()
        if len(p) == 4 and p[2] in "BbDd":
            syms.append((int(p[0], 16) + bias, int(p[1], 16), p[3]))
    return bias, sorted(syms)


def object_at(mem: Memory, addr: int) -> str:
    """The Python object in the pymalloc block holding `addr` (plain or GC-tracked), or '?'."""
    pool = addr & ~(POOL - 1)
    szidx = struct.unpack("I", (mem.read(pool + 36, 4) or b"\xff" * 4))[0]
    if szidx >= 32:
        return "? (not a pymalloc pool)"
    size = (szidx + 1) * 16
    block = pool + 48 + ((addr - pool - 48) // size) * size
    for base in (block, block + 16):
        name = mem.type_name(mem.word(base + 8))
        if name:
            extra = ""
            if name == "function":
                extra = mem.short_str(mem.word(base + 40))  # func_qualname
            elif name == "code":
                extra = mem.short_str(mem.word(base + 120))  # co_name
            elif name == "str":
                extra = mem.short_str(base)
            return f"{name} {extra}".rstrip()
    return f"? ({size}-byte block)"


def attribute(perf_data: str, zygote: int, workers: set[int], top: int) -> None:
    script = subprocess.run(["perf", "script", "-i", perf_data, "-F", "pid,addr,ip,sym,dso"],
                            capture_output=True, text=True).stdout
    zmaps, mem = maps(zygote), Memory(zygote)
    _, statics = interpreter_statics(zygote)
    per_worker, by_map, by_object, by_code = (collections.Counter() for _ in range(4))
    for line in script.splitlines():
        p = line.split()
        if len(p) < 3 or not p[0].isdigit() or int(p[0]) not in workers:
            continue
        addr = int(p[1], 16)
        per_worker[int(p[0])] += 1
        where = next((label(s, e, perms, n) for s, e, perms, _, n in zmaps if s <= addr < e), "new mapping")
        by_map[where] += 1
        by_code[" ".join(p[3:])] += 1
        if " rw" in where:
            sym = next((n for s, size, n in statics if s <= addr < s + max(size, 8)), None)
            what = f"static {sym}" if sym else object_at(mem, addr) if "anon" in where else "?"
            by_object[(where, what)] += 1
    n = max(1, len(per_worker))
    print(f"workers {len(per_worker)}; faults per worker (perf) {sorted(per_worker.values())}")
    for title, counter in (("by mapping", by_map), ("by object (writable memory)", by_object),
                           ("by faulting instruction: (perf's data mapping) address symbol (object)", by_code)):
        print(f"{title}, per worker:")
        for k, v in counter.most_common(top):
            print(f"  {v / n:7.1f}  {' / '.join(k) if isinstance(k, tuple) else k}")


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        out += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return out


def minflt(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(HERE.parent / "target" / "release" / "ironcell"))
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--bursts", type=int, default=1)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    a = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in a.env)
    c, log = bench.start_profiled_server(a.binary, a.python, "ironcell-faults-", bench.SPAWN_LOG, **extra)
    bench.wait_for_spares(c, 30, plots_warm=True)
    zygote = next(k for k in children(c.p.pid) if "python" in Path(f"/proc/{k}/comm").read_text())
    before = set(children(zygote))
    with tempfile.TemporaryDirectory(prefix="ironcell-faults-") as tmp:
        data = os.path.join(tmp, "perf.data")
        perf = subprocess.Popen(["perf", "record", "-q", "-e", "page-faults", "-c", "1", "-d", "-a", "-o", data],
                                stderr=subprocess.DEVNULL)
        time.sleep(1.5)  # perf is recording
        for r in range(a.bursts):
            bench.wait_for_spares(c, 30)
            c.burst([{"name": "run_python", "arguments": {"code": "1", "session": f"b{r}x{i}"}}
                     for i in range(20)])
        perf.send_signal(signal.SIGINT)
        perf.wait()
        workers = set(children(zygote)) - before
        print(f"zygote {zygote}; minor faults per worker after its first result (/proc/<pid>/stat; "
              f"with the spares forked after the burst): {sorted(minflt(p) for p in workers)}")
        attribute(data, zygote, workers, a.top)
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
