"""The test server after a slow start, as an `npx`/`uvx` server with a cold cache: writes a line
to stderr, sleeps, then becomes servers/test_server.py (same interpreter, the other arguments).
Requests sent meanwhile wait in its stdin, so the `server/discover` probe goes unanswered for
as long as it sleeps.

usage: slow_start.py SECONDS [--fail] [test_server.py arguments]

--fail  after the sleep, writes a few lines to stderr and exits 3 instead (a start that fails)
"""

import os
import sys
import time
from pathlib import Path

seconds = float(sys.argv[1])
rest = [a for a in sys.argv[2:] if a != "--fail"]
print(f"slow_start: fetching packages for {seconds} s", file=sys.stderr, flush=True)
time.sleep(seconds)
if "--fail" in sys.argv:
    for n in range(30):
        print(f"slow_start: noise line {n}", file=sys.stderr)
    print("slow_start: npm ERR! 404 Not Found - @example/no-such-server", file=sys.stderr, flush=True)
    sys.exit(3)
server = Path(__file__).with_name("test_server.py")
os.execv(sys.executable, [sys.executable, str(server), *rest])
