#!/usr/bin/env python3
"""ironcell benchmark: prints medians beside baselines measured in the same run.

usage: scripts/bench.py [--binary target/release/ironcell] [--quick]

(a) new session to first output     vs. a fresh `python3 -c` subprocess per call
(b) warm run_python round trip      vs. `python3 -c` per call, and a warm ipykernel (if installed)
(c) private memory (USS) per idle session   vs. a fresh idle `python3` process
(d) server start to first result    vs. one `python3 -c` start
(e) proxied MCP call from Python    vs. the same call made directly to the server
(f) 200 concurrent proxied calls (asyncio.gather) in one cell
(g) runtime.search_tool_docs over 1,000 tools

(e)-(g) need the test peers (scripts/install_test_peers.sh); they are skipped without them.

The client is a minimal JSON-RPC-over-stdio client (no SDK), so the numbers are ironcell's.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = "/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else sys.executable


HARNESS = Path(os.environ.get("IRONCELL_HARNESS", Path.home() / ".cache" / "mcp-harness"))
TEST_SERVER = REPO / "tests" / "e2e" / "servers" / "test_server.py"


class Client:
    def __init__(self, binary: str, env: dict[str, str], cmd: list[str] | None = None):
        self.p = subprocess.Popen(cmd or [binary, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, env=env, bufsize=0)
        self.buf = b""
        self.id = 0

    def _line(self) -> dict:
        while b"\n" not in self.buf:
            select.select([self.p.stdout], [], [])
            chunk = os.read(self.p.stdout.fileno(), 1 << 20)
            if not chunk:
                raise EOFError
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def request(self, method: str, params: dict) -> dict:
        self.id += 1
        self.p.stdin.write(json.dumps({"jsonrpc": "2.0", "id": self.id, "method": method, "params": params}).encode() + b"\n")
        while True:
            m = self._line()
            if m.get("id") == self.id:
                return m

    def initialize(self) -> None:
        self.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                    "clientInfo": {"name": "bench", "version": "0"}})
        self.p.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')

    def run(self, code: str, session: str = "default", timeout_s: float = 120) -> dict:
        args = {"code": code, "session": session, "timeout_s": timeout_s}
        r = self.request("tools/call", {"name": "run_python", "arguments": args})
        res = r["result"]
        if res.get("isError"):
            raise RuntimeError(res["content"][0]["text"])
        return res["structuredContent"]

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(10)


def uss_kib(pid: int) -> int:
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    return total


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def python_c_ms(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run([PY, "-c", "print(1)"], stdout=subprocess.DEVNULL, check=True)
        out.append((time.perf_counter() - t) * 1000)
    return out


def ipykernel_round_trip_ms(n: int) -> list[float] | None:
    try:
        from jupyter_client.manager import start_new_kernel  # type: ignore
    except ImportError:
        return None
    km, kc = start_new_kernel()
    try:
        kc.execute_interactive("x = 0", timeout=30)
        out = []
        for _ in range(n):
            t = time.perf_counter()
            kc.execute_interactive("x += 1", timeout=30)
            out.append((time.perf_counter() - t) * 1000)
        return out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def proxy_rows(binary: str, env: dict[str, str], quick: bool) -> list[tuple[str, str, str]]:
    py = HARNESS / "venv" / "bin" / "python"
    if not py.exists():
        return [("(e)-(g) proxied calls", "skipped", "test peers not installed")]
    n_calls = 200 if quick else 1000
    server_cmd = [str(py), str(TEST_SERVER), "--many-tools", "1000"]
    # Direct: the same minimal client talking to the server itself.
    direct_client = Client(binary, {**env}, cmd=server_cmd)
    direct_client.initialize()
    direct = []
    for _ in range(n_calls):
        t = time.perf_counter()
        direct_client.request("tools/call", {"name": "structured", "arguments": {"n": 1}})
        direct.append((time.perf_counter() - t) * 1000)
    direct_client.close()
    config = {"mcpServers": {"t": {"command": server_cmd[0], "args": server_cmd[1:]}}}
    c = Client(binary, {**env, "MCP_BRIDGE_CONFIG": json.dumps(config)})
    c.initialize()
    code = f"""
import time, statistics, asyncio
mcp_t.structured_sync(n=1)
proxied = []
for _ in range({n_calls}):
    t = time.perf_counter(); mcp_t.structured_sync(n=1); proxied.append((time.perf_counter() - t) * 1000)
t = time.perf_counter()
await asyncio.gather(*(mcp_t.structured(n=i) for i in range(200)))
gather_ms = (time.perf_counter() - t) * 1000
runtime.search_tool_docs_sync("create invoice", limit=5)
search = []
for _ in range(100):
    t = time.perf_counter(); runtime.search_tool_docs_sync("export calendar event", limit=5); search.append((time.perf_counter() - t) * 1000)
(statistics.median(proxied), gather_ms, statistics.median(search))
"""
    proxied_ms, gather_ms, search_ms = eval(c.run(code)["result"])
    c.close()
    d = med(direct)
    return [
        ("(e) proxied call from Python", f"{proxied_ms:.3f} ms", f"direct to the server: {d:.3f} ms; overhead {proxied_ms - d:.3f} ms"),
        ("(f) 200 concurrent proxied calls", f"{gather_ms:.1f} ms", f"one direct call x 200: {d * 200:.1f} ms"),
        ("(g) search_tool_docs, 1,000 tools", f"{search_ms:.3f} ms", "round trip from Python included"),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=str(REPO / "target" / "release" / "ironcell"))
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    a = ap.parse_args()
    n_sessions, n_warm, n_start, n_base = (10, 100, 3, 10) if a.quick else (50, 1000, 10, 30)
    state = tempfile.mkdtemp(prefix="ironcell-bench-")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
           "MCP_BRIDGE_STATE_DIR": state, "IRONCELL_MAX_SESSIONS": str(n_sessions + 10)}

    base_c = python_c_ms(n_base)
    rows = []

    # (d) server start to first result
    starts = []
    for _ in range(n_start):
        t = time.perf_counter()
        c = Client(a.binary, env)
        c.initialize()
        c.run("1")
        starts.append((time.perf_counter() - t) * 1000)
        c.close()

    c = Client(a.binary, env)
    c.initialize()
    c.run("x = 0")
    # (a) new session to first output (fork + lockdown + first cell + MCP round trip)
    new_sess, pids = [], []
    for i in range(n_sessions):
        t = time.perf_counter()
        r = c.run("import os\nprint(os.getpid())", session=f"s{i}")
        new_sess.append((time.perf_counter() - t) * 1000)
        pids.append(int(r["stdout"]))
    # (b) warm round trip
    warm = []
    for _ in range(n_warm):
        t = time.perf_counter()
        c.run("x += 1")
        warm.append((time.perf_counter() - t) * 1000)
    info = json.loads(c.request("resources/read", {"uri": "system://info"})["result"]["contents"][0]["text"])
    lockdown_ms = info.get("worker_lockdown_ms_median") or 0.0
    # (c) USS of idle sessions
    time.sleep(0.5)
    uss = [uss_kib(p) / 1024 for p in pids]
    c.close()

    idle = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
    time.sleep(0.5)
    base_uss = uss_kib(idle.pid) / 1024
    idle.kill()
    ipk = ipykernel_round_trip_ms(min(n_warm, 200))

    rows.append(("(a) new session to first output", f"{med(new_sess):.2f} ms", f"python3 -c per call: {med(base_c):.1f} ms"))
    rows.append(("    of which: kernel lockdown", f"{lockdown_ms:.2f} ms",
                 f"so without it: {med(new_sess) - lockdown_ms:.2f} ms"))
    b_base = f"python3 -c per call: {med(base_c):.1f} ms"
    if ipk:
        b_base += f"; ipykernel warm: {med(ipk):.2f} ms"
    else:
        b_base += "; ipykernel: not installed"
    rows.append(("(b) warm round trip `x += 1`", f"{med(warm):.3f} ms", b_base))
    rows.append(("(c) USS per idle session", f"{med(uss):.2f} MiB", f"fresh idle python3: {base_uss:.1f} MiB"))
    rows.append(("(d) server start to first result", f"{med(starts):.1f} ms", f"python3 -c start: {med(base_c):.1f} ms"))
    rows.extend(proxy_rows(a.binary, env, a.quick))
    print(f"ironcell benchmark ({'quick' if a.quick else 'full'}): medians; n = {n_sessions} sessions, "
          f"{n_warm} warm calls, {n_start} starts, {n_base} baseline runs")
    w = max(len(r[0]) for r in rows)
    for name, val, base in rows:
        print(f"  {name:<{w}}  {val:>12}   baseline: {base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
