#!/usr/bin/env python3
"""Load through HAProxy onto replicas that are killed and restarted meanwhile (docs/DEPLOY.md).

    IRONCELL_BIN=target/release/ironcell ~/.cache/mcp-harness/venv/bin/python scripts/load_replicas.py \
        [--principals 30] [--sessions 5] [--rounds 20] [--events 6]

Three `ironcell serve --http` replicas (their own state directories, one token file) behind
Debian's HAProxy with deploy/haproxy/haproxy.cfg; the official SDK client, one per principal,
alternating the 2025-11-25 and 2026-07-28 eras. Each session runs `rounds` calls that count:

    try: n += 1
    except NameError: me, n = '<principal>/<session>', 1
    (me, n)

so every answer shows whose state it ran in and whether the state survived. Meanwhile, paced by
the calls made (not the clock), `--events` times a replica is SIGKILLed or (alternately)
SIGTERMed (a drain), then started again on the same port and state directory. Checked, and printed:
- nothing crossed: every answer carries its own principal's and session's `me`;
- every call answered: a result, or an error that says what happened (a protocol session not
  found, or a call in flight on a killed replica); none hangs (each call has 120 s);
- every lost session says so on its next call (`session_state: "new"`, counter back at 1),
  never a silent reset: a counter that went back while the state claims "kept" is a failure;
- HAProxy answered no client with a 5xx but a 502 for a call in flight on a killed replica (a
  JSON-RPC error that says so: the call is not replayed, its code may have had effects).
Exit status 0 only if all of that held.
"""

from __future__ import annotations

import argparse
import ast
import random
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import logging  # noqa: E402

import anyio  # noqa: E402

from conftest import Run, shared_tmp_dir, wait_until  # noqa: E402
from test_http import _write_tokens, client, hashed  # noqa: E402
from test_replicas import Balancer, Replica  # noqa: E402

CALL_LIMIT = 120


class Tally:
    def __init__(self) -> None:
        self.calls = 0
        self.ok_kept = 0
        self.new_first = 0
        self.lost_reported = 0  # a later round answered "new": the session was lost and said so
        self.protocol_404 = 0  # 2025-11-25: the protocol session was a lost replica's
        self.in_flight_errors = 0  # a call in flight on a replica that was killed
        self.drain_errors = 0
        self.failures: list[str] = []
        self.errors_seen: set[str] = set()
        self.latencies: list[float] = []
        self.kills = 0
        self.drains = 0


CODE = "try:\n    n += 1\nexcept NameError:\n    me, n = {me!r}, 1\n(me, n)"


async def principal(url: str, name: str, token: str, mode: str, sessions: int, rounds: int, t: Tally) -> None:
    async with anyio.create_task_group() as tg:
        for k in range(sessions):
            tg.start_soon(session, url, name, token, mode, k, rounds, t)


async def session(url: str, name: str, token: str, mode: str, k: int, rounds: int, t: Tally) -> None:
    """`rounds` counting calls in session s<k>, over a client that is opened again when its
    protocol session or connection was lost."""
    me = f"{name}/s{k}"
    st = {"rnd": 0, "expected": 0, "tries": 0}
    while st["rnd"] < rounds:
        try:
            async with client(url, token, mode) as c:
                while st["rnd"] < rounds:
                    outcome = await one_round(c, me, k, st, t)
                    if outcome == "fail":
                        return
                    if outcome == "reconnect":
                        break
        except Exception as e:  # noqa: BLE001 - closing a client of a lost replica may fail
            t.errors_seen.add(f"on close: {type(e).__name__}")
        if st["tries"] >= 5:
            t.failures.append(f"{me} round {st['rnd']}: no result in 5 attempts")
            return
        await anyio.sleep(0.5)


async def one_round(c, me: str, k: int, st: dict, t: Tally) -> str:
    """One call: "ok" (the round is done), "reconnect" (try it again on a new client), "fail"."""
    from mcp.shared.exceptions import MCPError

    rnd = st["rnd"]
    t.calls += 1
    st["tries"] += 1
    started = time.monotonic()
    try:
        with anyio.fail_after(CALL_LIMIT):
            r = Run(await c.call_tool("run_python", {"code": CODE.format(me=me), "session": f"s{k}"}))
    except TimeoutError:
        t.failures.append(f"{me} round {rnd}: no answer in {CALL_LIMIT} s")
        return "fail"
    except MCPError as e:
        msg = str(e)
        if "Session not found" in msg and "initialize" in msg:
            t.protocol_404 += 1
        elif "shutting down" in msg:
            t.drain_errors += 1
        elif "lost during it" in msg or "SSE stream" in msg or "onnection" in msg:
            t.in_flight_errors += 1
            t.errors_seen.add(msg[:120])
        else:
            t.failures.append(f"{me} round {rnd}: unexplained error: {msg[:200]}")
            return "fail"
        return "reconnect"
    t.latencies.append(time.monotonic() - started)
    state = r.record.get("session_state")
    if r.record.get("status") != "ok":
        t.failures.append(f"{me} round {rnd}: {r.record.get('status')}: {r.text[:200]}")
        return "fail"
    got = ast.literal_eval(r.record["result"])
    if got[0] != me:
        t.failures.append(f"{me} round {rnd}: CROSSED: ran in {got[0]}'s state")
        return "fail"
    if state == "kept":
        if got[1] != st["expected"] + 1:
            t.failures.append(f"{me} round {rnd}: kept but counter {got[1]} after {st['expected']}")
            return "fail"
        t.ok_kept += 1
    elif state in ("new", "restarted"):
        if got[1] != 1:
            t.failures.append(f"{me} round {rnd}: new session with counter {got[1]}")
            return "fail"
        if st["expected"] == 0:
            t.new_first += 1
        else:
            t.lost_reported += 1
    else:
        t.failures.append(f"{me} round {rnd}: session_state {state!r}")
        return "fail"
    st.update(expected=got[1], rnd=rnd + 1, tries=0)
    return "ok"


async def chaos(replicas: list[Replica], lb: Balancer, events: int, step: int, stop: anyio.Event, t: Tally) -> None:
    """`events` times, once `step` more calls were made: a SIGKILL, then a drain, alternately,
    of a replica that is up, which is then started again while the load goes on (progress, not
    the clock, paces it)."""
    rng = random.Random(49)

    async def back(r: Replica) -> None:
        await anyio.to_thread.run_sync(r.proc.wait)  # a drain ends when its runs have
        await anyio.sleep(1)
        await anyio.to_thread.run_sync(r.start)
        await anyio.to_thread.run_sync(lambda: wait_until(lambda: lb.states().get(r.name) == "UP", timeout=60))
        print(f"  [{time.strftime('%X')}] {r.name} back", flush=True)

    async with anyio.create_task_group() as tg:
        for i in range(events):
            while t.calls < (i + 1) * step and not stop.is_set():
                await anyio.sleep(0.05)
            up = [r for r in replicas if r.proc.poll() is None]
            if stop.is_set() or len(up) < 2:
                break
            r = rng.choice(up)
            if i % 2 == 0:
                t.kills += 1
                r.proc.kill()
                print(f"  [{time.strftime('%X')}] SIGKILL {r.name} after {t.calls} calls", flush=True)
            else:
                t.drains += 1
                r.proc.send_signal(signal.SIGTERM)
                print(f"  [{time.strftime('%X')}] SIGTERM {r.name} (drain) after {t.calls} calls", flush=True)
            tg.start_soon(back, r)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--principals", type=int, default=30)
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--events", type=int, default=6, help="replicas killed or drained (alternately)")
    ap.add_argument("--user", default="root", choices=["root", "nobody"])
    a = ap.parse_args()
    logging.getLogger("mcp").setLevel(logging.ERROR)  # the SDK warns on every 202 to its DELETE
    # Fixed tokens: HAProxy places them the same way on every run.
    tokens = {f"p{i:02d}": f"load-token-{i:02d}" for i in range(a.principals)}
    path = _write_tokens(shared_tmp_dir() / "tokens.json", hashed(tokens))
    env = {"IRONCELL_POOL_SIZE": "0", "IRONCELL_WARM_PLOTS": "off", "IRONCELL_DRAIN_GRACE": "20s",
           "IRONCELL_WAIT_BUDGET": "110s", "IRONCELL_PRINCIPAL_MAX_RUNS": str(a.sessions)}
    replicas = [Replica(f"r{i + 1}", path, a.user, env) for i in range(3)]
    for r in replicas:
        r.start()
    lb = Balancer(replicas)
    t = Tally()
    try:
        assert wait_until(lambda: set(lb.states().values()) == {"UP"}, timeout=30)
        print(f"{a.principals} principals x {a.sessions} sessions x {a.rounds} rounds through HAProxy "
              f"onto 3 replicas ({a.user}); {a.events} replicas killed or drained on the way")
        started = time.monotonic()
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            step = a.principals * a.sessions * a.rounds // (a.events + 2)
            tg.start_soon(chaos, replicas, lb, a.events, step, stop, t)
            async with anyio.create_task_group() as work:
                for i, name in enumerate(tokens):
                    work.start_soon(principal, lb.url, name, tokens[name], "legacy" if i % 2 == 0 else "auto",
                                    a.sessions, a.rounds, t)
            stop.set()
        elapsed = time.monotonic() - started
        fivexx = [s for s in lb.statuses() if s >= 500]
        placed = {r.name: len(r.principals()) for r in replicas}
        print(f"  principals' worlds per replica (a moved principal has one on each it used): {placed}")
        lat = sorted(t.latencies)
        p = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: 0.0)
        answered = t.ok_kept + t.new_first + t.lost_reported
        print(f"done in {elapsed:.1f} s: {t.kills} SIGKILLs, {t.drains} drains")
        print(f"  calls {t.calls}; results {answered} (kept {t.ok_kept}, first run new {t.new_first}, "
              f"lost and reported new {t.lost_reported})")
        print(f"  errors that said what happened: protocol session not found {t.protocol_404}, "
              f"in flight on a killed replica {t.in_flight_errors}, drain refusals {t.drain_errors}")
        print(f"  latency of answered calls: median {statistics.median(lat) * 1000 if lat else 0:.0f} ms, "
              f"p99 {p(0.99):.0f} ms, max {p(1.0):.0f} ms")
        print(f"  HAProxy 5xx to clients: {len(fivexx)} ({', '.join(str(c) for c in sorted(set(fivexx))) or 'none'}: "
              f"502 is a call in flight on a killed replica); failures: {len(t.failures)}")
        for e in sorted(t.errors_seen):
            print("    transport error seen:", e)
        for f in t.failures[:20]:
            print("   ", f)
        # The only 5xx allowed: a 502 for a call whose replica died under it (counted above).
        ok = (not t.failures and set(fivexx) <= {502} and len(fivexx) <= t.in_flight_errors
              and answered == a.principals * a.sessions * a.rounds)
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        for r in replicas:
            r.stop()
        lb.stop()
        for d in [path.parent, lb.dir, *(r.dir for r in replicas)]:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(anyio.run(main))
