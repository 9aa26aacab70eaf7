"""Load: 50 sessions, 5,000 runs, up to 100 in flight, through the official MCP SDK client.

Every run prints a unique token and returns it with the session's own run counter. Nothing may
be lost or crossed: each result carries its own token (in stdout and in the value), its own
session's name, and each session counts exactly 1..100. Nothing here depends on the machine's
speed beyond a generous overall bound.
"""

from __future__ import annotations

import ast
import time

import anyio
import pytest

from conftest import Run, connect

SESSIONS = 50
RUNS = 5_000
IN_FLIGHT = 100

CODE = """
n = globals().get('n', 0) + 1
print({token!r})
({token!r}, n)
"""


@pytest.mark.anyio
async def test_5000_runs_over_50_sessions_lose_and_cross_nothing(state_dir):
    results: dict[int, Run] = {}
    failures: list[str] = []
    limiter = anyio.CapacityLimiter(IN_FLIGHT)
    async with connect(state_dir, IRONCELL_MAX_SESSIONS=str(SESSIONS + 4), IRONCELL_WAIT_BUDGET="300s") as s:

        async def one(i: int) -> None:
            token = f"tok-{i:05d}-{(i * 7919) % 100_003:06d}"
            async with limiter:
                try:
                    r = Run(await s.call_tool("run_python", {
                        "code": CODE.format(token=token), "session": f"s{i % SESSIONS}", "timeout_s": 120,
                    }))
                except Exception as e:  # noqa: BLE001 - collected and reported below
                    failures.append(f"run {i}: {type(e).__name__}: {e}")
                    return
            results[i] = r

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for i in range(RUNS):
                tg.start_soon(one, i)
        elapsed = time.monotonic() - started

    assert not failures, failures[:5]
    assert len(results) == RUNS
    counts: dict[str, set[int]] = {}
    for i, r in results.items():
        token = f"tok-{i:05d}-{(i * 7919) % 100_003:06d}"
        assert not r.is_error and r["status"] == "ok", (i, r)
        assert r["session"] == f"s{i % SESSIONS}", (i, r.record)
        assert r["stdout"] == token + "\n", (i, r.record)
        got_token, n = ast.literal_eval(r["result"])
        assert got_token == token, (i, r.record)
        counts.setdefault(r["session"], set()).add(n)
    per_session = RUNS // SESSIONS
    assert all(c == set(range(1, per_session + 1)) for c in counts.values()), {
        k: (min(c), max(c), len(c)) for k, c in counts.items() if c != set(range(1, per_session + 1))
    }
    assert len(counts) == SESSIONS
    print(f"{RUNS} runs in {elapsed:.1f} s ({RUNS / elapsed:.0f} runs/s)")
