"""Shared helpers: start the real ironcell binary and talk to it with the official MCP SDK."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(os.environ.get("IRONCELL_HARNESS", Path.home() / ".cache" / "mcp-harness"))
IRONCELL = Path(os.environ.get("IRONCELL_BIN", REPO / "target" / "release" / "ironcell"))
# The interpreter the suite runs sessions in: the system's (readable by every user, with the
# distro's numpy/pandas/matplotlib), unless IRONCELL_TEST_PYTHON names another. Launcher shims
# (pyenv) on PATH are dropped, as on a fresh machine: tests that choose another Python say so.
TEST_PYTHON = os.environ.get("IRONCELL_TEST_PYTHON", "/usr/bin/python3")
os.environ["PATH"] = os.pathsep.join(
    p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if "/.pyenv/" not in p
)
for _var in ("VIRTUAL_ENV", "CONDA_PREFIX", "IRONCELL_PYTHON"):
    os.environ.pop(_var, None)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    return d


def test_home(base: Path) -> Path:
    """A HOME of the test's own (`<base>/.test-home`, as open as `base` so `nobody` can use it):
    nothing the user running the suite configured (~/.config/mcp-bridge/config.json, Claude's
    configs) reaches a server the suite starts."""
    home = base / ".test-home"
    home.mkdir(exist_ok=True)
    home.chmod(base.stat().st_mode & 0o777)
    return home


def server_env(state_dir: Path, **overrides: str | None) -> dict[str, str]:
    """The environment ironcell is started with: nothing of the user's but PATH, a HOME and XDG
    dirs of the test's own (see `test_home`). An override of None removes a variable."""
    home = test_home(state_dir)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "MCP_BRIDGE_STATE_DIR": str(state_dir),
        "MCP_BRIDGE_LOG_LEVEL": "info",
        "IRONCELL_PYTHON": TEST_PYTHON,
    }
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@contextlib.asynccontextmanager
async def connect(state_dir: Path, **env: str):
    """A `ClientSession` over stdio to a fresh ironcell, initialized."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=str(IRONCELL), args=["serve"], env=server_env(state_dir, **env))
    errlog = open(state_dir / "server.log", "a")
    try:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session
    finally:
        errlog.close()


class Run:
    """One run_python result, unpacked."""

    def __init__(self, result: Any):
        self.raw = result
        # SDK 2.x names fields in snake_case, 1.x in camelCase.
        self.is_error = bool(_field(result, "is_error", "isError"))
        self.text = "\n".join(c.text for c in result.content if getattr(c, "type", None) == "text")
        self.record: dict[str, Any] = _field(result, "structured_content", "structuredContent") or {}

    def __getitem__(self, key: str) -> Any:
        return self.record[key]

    def __repr__(self) -> str:
        return f"Run(is_error={self.is_error}, text={self.text!r}, record={self.record!r})"


def _field(obj: Any, *names: str) -> Any:
    for n in names:
        if hasattr(obj, n):
            return getattr(obj, n)
    return None


async def run(client, code: str, **args: Any) -> Run:
    return Run(await client.call_tool("run_python", {"code": code, **args}))


AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all"]
# Root as in a container (Docker's default set): CAP_SYS_RESOURCE and CAP_SYS_ADMIN are gone.
AS_ROOT_WITHOUT_RESOURCE_CAPS = ["setpriv", "--bounding-set=-sys_resource,-sys_admin"]
PREFIX_FOR_USER = {"root": [], "nobody": AS_NOBODY, "root-without-resource-caps": AS_ROOT_WITHOUT_RESOURCE_CAPS}


def shared_tmp_dir(base: str = "/tmp") -> Path:
    """A fresh directory that an unprivileged user can use (pytest's tmp_path is root-only).
    `base="/var/tmp"` for host files an attack aims at: a session without a private mount
    namespace refuses `/tmp` paths in Python before the kernel sees them."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="ironcell-test-", dir=base))
    d.chmod(0o777)
    _SHARED_TMP_DIRS.append(d)
    return d


# Removed when the run ends (IRONCELL_KEEP_TEST_DIRS=1 keeps them for a post-mortem).
_SHARED_TMP_DIRS: list[Path] = []


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("IRONCELL_KEEP_TEST_DIRS") == "1":
        return
    for d in _SHARED_TMP_DIRS:
        # --one-file-system: a mount a failed test left inside is not descended into.
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(d)], stderr=subprocess.DEVNULL, check=False)


class RawServer:
    """ironcell driven with hand-written JSON-RPC lines, for protocol-level checks."""

    def __init__(self, state_dir: Path, *, as_user: str = "root", args: list[str] | None = None, **env: str):
        prefix = PREFIX_FOR_USER[as_user]
        self.proc = subprocess.Popen(
            [*prefix, str(IRONCELL), "serve", *(args or [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(state_dir / "raw-server.log", "ab"),
            env=server_env(state_dir, **env),
        )
        self.next_id = 1
        self._buf = b""

    def send_line(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.rstrip(b"\n") + b"\n")
        self.proc.stdin.flush()

    def send(self, msg: dict[str, Any]) -> None:
        self.send_line(json.dumps(msg).encode())

    def read(self, timeout: float = 30.0) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        # Our own buffer: select() on a buffered file object misses lines already read ahead.
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("no message from ironcell")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError("ironcell closed stdout")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)  # anything but one JSON-RPC message per line fails here
        assert msg.get("jsonrpc") == "2.0", msg
        return msg

    def request(self, method: str, params: dict[str, Any] | None = None, timeout: float = 30.0) -> dict[str, Any]:
        rid = self.next_id
        self.next_id += 1
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)
        return self.wait_for(rid, timeout)

    def wait_for(self, rid: Any, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            msg = self.read(max(0.01, deadline - time.monotonic()))
            if msg.get("id") == rid and ("result" in msg or "error" in msg):
                return msg

    def initialize(self) -> dict[str, Any]:
        r = self.request(
            "initialize",
            {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}},
        )
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return r

    def call(self, code: str, **args: Any) -> dict[str, Any]:
        r = self.request("tools/call", {"name": "run_python", "arguments": {"code": code, **args}})
        return r["result"]

    def info(self) -> dict[str, Any]:
        r = self.request("resources/read", {"uri": "system://info"})
        return json.loads(r["result"]["contents"][0]["text"])

    def wait_for_full_pool(self, timeout: float = 120.0) -> None:
        """Waits until the server's background forking is done: every plain spare waits, and the
        plot spare too when one is kept. Spares are forked only once the font cache is settled,
        so a full plain pool also means whether a plot spare is kept is known."""

        def full() -> bool:
            pool = self.info()["spare_workers"]
            plain = pool["waiting"] - pool["plot_spare_waiting"]
            return plain == pool["pool_size"] and pool["plot_spare_waiting"] == pool["plot_spare"]

        assert wait_until(full, timeout=timeout, step=0.1), self.info()["spare_workers"]

    def close(self, timeout: float = 5.0) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def worker_python_has(*modules: str) -> bool:
    """Whether the Python that ironcell embeds (Debian's python3.11) can import `modules`."""
    code = "import " + ", ".join(modules)
    return subprocess.run(["/usr/bin/python3.11", "-c", code], capture_output=True).returncode == 0


needs_plotting = pytest.mark.skipif(
    not worker_python_has("matplotlib", "numpy", "PIL"),
    reason="needs python3-matplotlib and python3-numpy (installed by .ci/run)",
)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone between the open and the read
        return False


def a_thread_runs(pid: int) -> bool:
    """Whether a thread of process `pid` is neither a zombie nor dead. `pid_alive` reads the main
    thread's state: a process whose main thread ended (the raw `exit` call ends one thread)
    shows `Z` while its other threads run on (docs/SECURITY.md #299)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except (FileNotFoundError, ProcessLookupError):
            pass
    return False


def wait_until(pred, timeout: float = 5.0, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


sys.path.insert(0, str(Path(__file__).parent))
