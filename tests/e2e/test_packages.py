"""Packages on demand: `%pip install` in a cell installs wheels for that session, after the user
approves, with the sandbox never getting a network (docs/SECURITY.md #181-#183).

The wheels are real PyPI wheels downloaded once by scripts/install_test_peers.sh into
`$HARNESS/pkg-wheels` (markdown-it-py with its dependency mdurl, tabulate, and msgpack, a binary
wheel), served here from a PEP 503 index on loopback that each test starts; the hostile wheels
are built by the tests. ironcell runs as root and as `nobody`, and resolves with the session
interpreter's own pip (Debian's python3.11 has pip 23).
"""

from __future__ import annotations

import ast
import base64
import contextlib
import hashlib
import http.server
import io
import json
import shutil
import socket
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from conftest import HARNESS, IRONCELL, PREFIX_FOR_USER, TEST_PYTHON, run, server_env, shared_tmp_dir

pytestmark = pytest.mark.anyio

WHEELS = HARNESS / "pkg-wheels"
MODERN = "2026-07-28"

needs_wheels = pytest.mark.skipif(
    not (WHEELS / "mdurl-0.1.2-py3-none-any.whl").exists(),
    reason="run scripts/install_test_peers.sh (downloads the test wheels once)",
)


def normalize(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


class Index:
    """A PEP 503 simple index of wheel files, served on loopback; `hang=True`: a server that
    accepts connections and never answers."""

    def __init__(self, root: Path, hang: bool = False):
        self.root = root
        self.files: dict[str, bytes] = {}
        self.sha_override: dict[str, str] = {}
        self.hang = hang
        self.requests = 0
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                index.requests += 1
                body, ctype = index.page(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        if hang:
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", 0))
            self.sock.listen(64)
            self.port = self.sock.getsockname()[1]
            self.held: list[socket.socket] = []

            def accept_forever():
                while True:
                    try:
                        conn, _ = self.sock.accept()
                    except OSError:
                        return
                    self.held.append(conn)

            threading.Thread(target=accept_forever, daemon=True).start()
        else:
            self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            self.port = self.httpd.server_address[1]
            threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/simple/"

    def add(self, filename: str, data: bytes) -> None:
        self.files[filename] = data

    def add_real(self, *prefixes: str) -> None:
        for w in WHEELS.iterdir():
            if any(w.name.startswith(p) for p in prefixes):
                self.add(w.name, w.read_bytes())

    def page(self, path: str):
        parts = [p for p in path.split("?")[0].split("/") if p]
        if parts[:1] == ["files"] and len(parts) == 2 and parts[1] in self.files:
            return self.files[parts[1]], "application/octet-stream"
        if parts[:1] == ["simple"] and len(parts) == 2:
            links = []
            for f in sorted(self.files):
                if normalize(f.split("-")[0]) == normalize(parts[1]):
                    sha = self.sha_override.get(f) or hashlib.sha256(self.files[f]).hexdigest()
                    links.append(f'<a href="/files/{f}#sha256={sha}">{f}</a><br>')
            if not links:
                return None, ""
            return ("<!DOCTYPE html><html><body>" + "".join(links) + "</body></html>").encode(), "text/html"
        return None, ""

    def stop(self) -> None:
        if self.hang:
            self.sock.close()
            for c in self.held:
                c.close()
        else:
            self.httpd.shutdown()
            self.httpd.server_close()


def build_wheel(name: str, version: str, files: dict[str, bytes], *, record: str | None = None,
                modes: dict[str, int] | None = None, tag: str = "py3-none-any",
                compress: bool = True) -> tuple[str, bytes]:
    """A wheel built here: `files` plus METADATA, WHEEL and a truthful RECORD (unless `record`
    is given); `modes` sets an entry's unix mode bits (symlinks, devices)."""
    dist = f"{name}-{version}.dist-info"
    all_files = dict(files)
    all_files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    all_files[f"{dist}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n".encode()
    lines = []
    for path, data in all_files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(data)}")
    lines.append(f"{dist}/RECORD,,")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        for path, data in all_files.items():
            info = zipfile.ZipInfo(path)
            info.compress_type = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
            mode = (modes or {}).get(path)
            info.external_attr = ((mode if mode is not None else 0o100644) << 16)
            z.writestr(info, data)
        z.writestr(f"{dist}/RECORD", record if record is not None else "\n".join(lines) + "\n")
    return f"{name}-{version}-{tag}.whl", buf.getvalue()


class Box:
    """What one ironcell of a test uses: a state dir `nobody` can use, the index, the env."""

    def __init__(self, user: str):
        self.user = user
        self.dir = shared_tmp_dir()
        self.state = self.dir / "state"
        self.state.mkdir(mode=0o777)
        self.state.chmod(0o777)
        self.index = Index(self.dir)

    def env(self, **extra: str) -> dict[str, str]:
        return {"PIP_INDEX_URL": self.index.url, "PIP_CONFIG_FILE": "/dev/null",
                "PIP_NO_CACHE_DIR": "1", **extra}

    def cli(self, *args: str) -> str:
        out = subprocess.run([*PREFIX_FOR_USER[self.user], str(IRONCELL), *args],
                             env=server_env(self.state, **self.env()), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def audit_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.cli("audit", "--json").splitlines()]

    def close(self) -> None:
        self.index.stop()
        subprocess.run(["chmod", "-R", "u+w", str(self.dir)], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(params=["root", "nobody"])
def user(request):
    return request.param


@pytest.fixture
def box(user):
    b = Box(user)
    yield b
    b.close()


@contextlib.asynccontextmanager
async def client(box: Box, era: str, answers: list[str] | None, asked: list[str], **env: str):
    """The official SDK client in `era` ("elicit": elicitation; "modern": 2026-07-28,
    input_required), answering each question from `answers` (`accept`, `no`, `decline`;
    None: the client cannot ask)."""
    from mcp import ClientSession, StdioServerParameters, types
    from mcp.client.stdio import stdio_client

    async def on_elicit(context, params):
        asked.append(params.message)
        answer = answers.pop(0) if answers else "decline"
        if answer == "decline":
            return types.ElicitResult(action="decline")
        return types.ElicitResult(action="accept", content={"approve": answer == "accept"})

    prefix = PREFIX_FOR_USER[box.user]
    command, args = (prefix[0], [*prefix[1:], str(IRONCELL), "serve"]) if prefix else (str(IRONCELL), ["serve"])
    params = StdioServerParameters(command=command, args=args,
                                   env=server_env(box.state, IRONCELL_WAIT_BUDGET="120s", **box.env(**env)))
    extra = {} if answers is None else {"elicitation_callback": on_elicit}
    with open(box.dir / "server.log", "a") as errlog:
        if era == "modern":
            from mcp import Client

            async with Client(stdio_client(params, errlog=errlog), mode="auto", **extra) as c:
                assert c.protocol_version == MODERN
                yield c
        else:
            async with stdio_client(params, errlog=errlog) as (read, write):
                async with ClientSession(read, write, **extra) as s:
                    await s.initialize()
                    yield s


def host_python_has(module: str) -> bool:
    return subprocess.run([TEST_PYTHON, "-c", f"import {module}"], capture_output=True).returncode == 0


# ---------------------------------------------------------------------------------------------
# The path a user relies on
# ---------------------------------------------------------------------------------------------


@needs_wheels
@pytest.mark.parametrize("era", ["elicit", "modern"])
async def test_pip_install_asks_once_then_installs_for_that_session_only(box, era):
    assert not host_python_has("markdown_it") and not host_python_has("mdurl")
    box.index.add_real("markdown_it_py-", "mdurl-")
    asked: list[str] = []
    async with client(box, era, ["accept"], asked) as c:
        r = await run(c, "%pip install markdown-it-py\nimport markdown_it\nmarkdown_it.__version__", session="a")
        assert r["status"] == "ok", r
        assert r["result"] == "'3.0.0'", r
        assert "Installed for this session: markdown-it-py==3.0.0, mdurl==0.1.2" in r["stdout"], r
        # One question, naming every package and version that was installed, the dependency too.
        (message,) = asked
        assert "markdown-it-py 3.0.0 — markdown_it_py-3.0.0-py3-none-any.whl" in message, message
        assert "mdurl 0.1.2 (dependency)" in message, message
        # The package works (its dependency is imported by it).
        r = await run(c, "markdown_it.MarkdownIt().render('# hi').strip()", session="a")
        assert r["result"] == "'<h1>hi</h1>'", r
        # Another session does not see it, and is told how to get it.
        r = await run(c, "import markdown_it", session="b")
        assert r["status"] == "error", r
        notes = "\n".join(r.record.get("notices") or [])
        assert r["error"]["type"] == "ModuleNotFoundError", r
        assert "`%pip install markdown_it` in a cell" in notes and "/usr/bin/python3" in notes, notes
    # The user's interpreter is unchanged.
    assert not host_python_has("markdown_it") and not host_python_has("mdurl")
    # Audited: who, what, from where, with hashes.
    (line,) = [e for e in box.audit_lines() if e["status"] == "packages_installed"]
    assert line["session"] == "a"
    pk = line["packages"]
    assert pk["requested"] == ["markdown-it-py"] and pk["decision"] == "approved by the user", pk
    got = {p["name"]: p for p in pk["packages"]}
    real = (WHEELS / "mdurl-0.1.2-py3-none-any.whl").read_bytes()
    assert got["mdurl"]["sha256"] == hashlib.sha256(real).hexdigest()
    assert got["mdurl"]["url"].startswith(f"http://127.0.0.1:{box.index.port}/files/")


@needs_wheels
async def test_a_second_session_links_from_the_store_without_the_network(box):
    box.index.add_real("tabulate-")
    asked: list[str] = []
    async with client(box, "elicit", ["accept", "accept"], asked) as c:
        r = await run(c, "!pip install tabulate==0.9.0\nimport tabulate\ntabulate.__version__", session="a")
        assert r["result"] == "'0.9.0'", r
        box.index.stop()  # no index from here on
        r = await run(c, "import mcp\nmcp.install(['tabulate==0.9.0'])\n"
                         "import tabulate\ntabulate.tabulate([[1, 2]])", session="b")
        assert r["status"] == "ok", r
        assert "1  2" in r["result"], r
        # Each session was asked for itself.
        assert len(asked) == 2
        # Installing again in a session with it already is a no-op that asks nothing.
        r = await run(c, "%pip install -q tabulate==0.9.0", session="b")
        assert r["status"] == "ok" and "Already installed in this session: tabulate==0.9.0" in r["stdout"], r
        assert len(asked) == 2
        # A restart of the session's worker keeps its packages; a session that expired would not.
        r = await run(c, "import os; os._exit(3)", session="b")
        r = await run(c, "import tabulate; tabulate.__version__", session="b")
        assert r["result"] == "'0.9.0'", r
    listing = box.cli("packages", "list")
    assert "tabulate" in listing and "1 wheel(s)" in listing, listing
    # The server is gone, so no view uses it: prune frees it.
    assert "removed 1 unused wheel(s)" in box.cli("packages", "prune")
    assert "0 wheel(s)" in box.cli("packages", "list")


@needs_wheels
async def test_a_binary_wheel_installs_and_its_extension_loads(box):
    assert not host_python_has("msgpack")
    box.index.add_real("msgpack-")
    async with client(box, "elicit", None, [], IRONCELL_PACKAGES_ALLOW="msgpack") as c:
        r = await run(c, "%pip install msgpack\nimport msgpack, msgpack._cmsgpack\n"
                         "msgpack.unpackb(msgpack.packb({'a': [1, 2]}))", session="a")
        assert r["status"] == "ok", r
        assert r["result"] == "{'a': [1, 2]}", r


@needs_wheels
async def test_pep_723_script_block_installs_its_dependencies_first(box):
    box.index.add_real("tabulate-")
    code = "# /// script\n# dependencies = [\n#   \"tabulate\",\n# ]\n# ///\nimport tabulate\ntabulate.__version__"
    async with client(box, "elicit", None, [], IRONCELL_PACKAGES_ALLOW="tab*") as c:
        r = await run(c, code, session="a")
        assert r["result"] == "'0.9.0'", r
    (line,) = [e for e in box.audit_lines() if e["status"] == "packages_installed"]
    assert line["packages"]["source"] == "script block"
    assert line["packages"]["decision"] == "allowed by --packages-allow"


def unpacked_size(wheel: Path) -> int:
    with zipfile.ZipFile(wheel) as z:
        return sum(i.file_size for i in z.infolist() if not i.is_dir())


@needs_wheels
async def test_the_store_keeps_to_its_budget_and_never_removes_what_a_session_uses(box):
    box.index.add_real("tabulate-", "mdurl-")
    tab, md = WHEELS / "tabulate-0.9.0-py3-none-any.whl", WHEELS / "mdurl-0.1.2-py3-none-any.whl"
    budget = unpacked_size(tab) + unpacked_size(md) - 1  # room for either, not both
    async with client(box, "elicit", None, [], IRONCELL_PACKAGES_ALLOW="*", IRONCELL_PACKAGES_BUDGET=str(budget)) as c:
        r = await run(c, "%pip install tabulate", session="a")
        assert r["status"] == "ok", r
        # Session a uses tabulate, so it stays; there is no room for mdurl.
        r = await run(c, "%pip install mdurl", session="b")
        msg = r["error"]["message"]
        assert "package store is full" in msg and "ironcell packages prune" in msg and "--packages-budget" in msg, r
        assert "in use" in box.cli("packages", "list")
        # Once no session uses it, making room removes it.
        r = await run(c, "1", session="a", reset=True)
        assert box_wait(lambda: "unused" in box.cli("packages", "list")), box.cli("packages", "list")
        r = await run(c, "%pip install mdurl\nimport mdurl", session="b")
        assert r["status"] == "ok", r
        listing = box.cli("packages", "list")
        assert "mdurl" in listing and "tabulate" not in listing, listing
        # And now tabulate has no room while session b uses mdurl.
        r = await run(c, "import mcp\nmcp.install(['tabulate'])", session="c")
        assert "package store is full" in r["error"]["message"], r


def box_wait(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


# ---------------------------------------------------------------------------------------------
# Policy: declined, cannot ask, allowed by pattern, off
# ---------------------------------------------------------------------------------------------


@needs_wheels
@pytest.mark.parametrize("era", ["elicit", "modern"])
async def test_a_declined_install_installs_nothing(box, era):
    box.index.add_real("tabulate-")
    asked: list[str] = []
    async with client(box, era, ["no"], asked) as c:
        r = await run(c, "%pip install tabulate", session="a")
        assert r["status"] == "error" and r["error"]["type"] == "InstallError", r
        assert "declined" in r["error"]["message"], r
        r = await run(c, "import tabulate", session="a")
        assert r["error"]["type"] == "ModuleNotFoundError", r
    assert len(asked) == 1
    assert [e["status"] for e in box.audit_lines() if e["status"].startswith("packages")] == ["packages_declined"]


@needs_wheels
async def test_a_client_that_cannot_ask_gets_a_refusal_naming_the_setting(box):
    box.index.add_real("tabulate-")
    async with client(box, "elicit", None, []) as c:
        r = await run(c, "%pip install tabulate", session="a")
        assert r["error"]["type"] == "InstallError", r
        msg = r["error"]["message"]
        assert "cannot ask" in msg and "--packages-allow" in msg and "IRONCELL_PACKAGES_ALLOW" in msg, msg


@needs_wheels
async def test_packages_off_refuses_and_names_the_setting(box):
    box.index.add_real("tabulate-")
    async with client(box, "elicit", ["accept"], [], IRONCELL_PACKAGES="off") as c:
        r = await run(c, "%pip install tabulate", session="a")
        msg = r["error"]["message"]
        assert "off" in msg and "--packages ask" in msg, r
    assert box.index.requests == 0


async def test_requirements_are_names_never_options_urls_or_paths(box):
    async with client(box, "elicit", ["accept"], []) as c:
        for bad in ["--index-url=http://evil.example/simple x", "-r /etc/shadow", "./local_dir",
                    "pkg @ https://evil.example/x.whl", "git+https://evil.example/x"]:
            r = await run(c, f"import mcp\nmcp.install({bad.split(' ', 1)!r})", session="a")
            assert r["status"] == "error", (bad, r)
            assert "not accepted" in r["error"]["message"] or "not a package" in r["error"]["message"], (bad, r)
        r = await run(c, "%pip install -e .", session="a")
        assert "not available in ironcell" in r["error"]["message"], r
        r = await run(c, "%pip uninstall x", session="a")
        assert "only `%pip install" in r["error"]["message"], r
    assert box.index.requests == 0


async def test_a_missing_module_names_the_interpreter_and_the_fix(box):
    async with client(box, "elicit", None, []) as c:
        r = await run(c, "import sklearn", session="a")
        notes = "\n".join(r.record.get("notices") or [])
        assert "`%pip install scikit-learn` in a cell installs it for this session" in notes, r
    async with client(box, "elicit", None, [], IRONCELL_PACKAGES="off") as c:
        r = await run(c, "import sklearn", session="a")
        notes = "\n".join(r.record.get("notices") or [])
        assert "is not installed" in notes and "%pip" not in notes, r


# ---------------------------------------------------------------------------------------------
# SECURITY.md #181: hostile wheels are refused before anything is written outside the store
# ---------------------------------------------------------------------------------------------

BOMB = b"\0" * (64 << 20)


def hostile_wheels() -> dict[str, tuple[tuple[str, bytes], str]]:
    """name → (wheel, what the refusal says)."""
    ok = b"x = 1\n"
    good_init = {"evilpkg/__init__.py": ok}
    lie = build_wheel("evilrecord", "1.0", {"evilrecord/__init__.py": ok},
                      record="evilrecord/__init__.py,sha256=AAAA,6\n"
                             "evilrecord-1.0.dist-info/RECORD,,\n")
    return {
        "evildotdot": (build_wheel("evildotdot", "1.0", {**good_init, "../../../escaped_dotdot.py": ok}), "escapes"),
        "evilabs": (build_wheel("evilabs", "1.0", {**good_init, "/tmp/escaped_abs.py": ok}), "absolute path"),
        "evillink": (build_wheel("evillink", "1.0", {**good_init, "evilpkg/link": b"/etc/shadow"},
                                 modes={"evilpkg/link": 0o120777}), "symbolic link"),
        "evildev": (build_wheel("evildev", "1.0", {**good_init, "evilpkg/dev": b""},
                                modes={"evilpkg/dev": 0o020666}), "not a plain file"),
        "evilbomb": (build_wheel("evilbomb", "1.0", {**good_init, "evilpkg/zeros.bin": BOMB}), "zip bomb"),
        "evilrecord": (lie, "RECORD"),
        "evilunlisted": (build_wheel("evilunlisted", "1.0", good_init,
                                     record="evilunlisted-1.0.dist-info/RECORD,,\n"), "not listed"),
        "evilpth": (build_wheel("evilpth", "1.0", {**good_init, "evil.pth": b"import os\n"}), ".pth"),
        "evilstd": (build_wheel("evilstd", "1.0", {"json/__init__.py": ok}), "standard library"),
        "evilmcp": (build_wheel("evilmcp", "1.0", {"mcp/__init__.py": ok}), "ironcell's own module"),
        "evilsite": (build_wheel("evilsite", "1.0", {"sitecustomize.py": ok}), "start-up"),
    }


async def test_181_hostile_wheels_are_refused_and_nothing_escapes_the_store(box):
    cases = hostile_wheels()
    for filename, data in (w for w, _ in cases.values()):
        box.index.add(filename, data)
    # A wheel whose bytes are not those the index's hash names: pip and the host refuse it.
    name, data = build_wheel("evilhash", "1.0", {"evilhash/__init__.py": b"x = 1\n"})
    box.index.add(name, data)
    box.index.sha_override[name] = hashlib.sha256(b"something else").hexdigest()
    cases["evilhash"] = ((name, data), "hash")
    async with client(box, "elicit", None, [], IRONCELL_PACKAGES_ALLOW="evil*") as c:
        for pkg, (_, why) in cases.items():
            r = await run(c, f"%pip install {pkg}", session="a")
            assert r["status"] == "error" and r["error"]["type"] == "InstallError", (pkg, r)
            assert why in r["error"]["message"], (pkg, r["error"]["message"])
        r = await run(c, "import os\nsorted(os.listdir(os.environ['IRONCELL_PACKAGES_DIR']))", session="a")
        assert r["result"] == "[]", r
    for escaped in ["/tmp/escaped_abs.py", box.state / "escaped_dotdot.py", box.state.parent / "escaped_dotdot.py"]:
        assert not Path(escaped).exists(), escaped
    store = box.state / "packages" / "store"
    assert not store.exists() or list(store.iterdir()) == []
    tmp = box.state / "packages" / "tmp"
    assert not tmp.exists() or list(tmp.iterdir()) == []
    statuses = [e["status"] for e in box.audit_lines() if e["status"].startswith("packages")]
    assert statuses == ["packages_refused"] * len(cases), statuses


# ---------------------------------------------------------------------------------------------
# SECURITY.md #182: the store and the views are read-only to workers, per session
# ---------------------------------------------------------------------------------------------

ATTACK = r"""
import os, sys, errno
view = os.environ['IRONCELL_PACKAGES_DIR']
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = 'ok'
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
attempt('create_in_view', lambda: open(os.path.join(view, 'planted.py'), 'w').write('x'))
attempt('write_installed', lambda: open(os.path.join(view, 'tabulate', '__init__.py'), 'a').write('x'))
attempt('unlink_installed', lambda: os.unlink(os.path.join(view, 'tabulate', '__init__.py')))
attempt('rename_view', lambda: os.rename(view, view + '.x'))
attempt('chmod_installed', lambda: os.chmod(os.path.join(view, 'tabulate', '__init__.py'), 0o666))
attempt('list_store', lambda: os.listdir(STORE))
attempt('read_other_view', lambda: os.listdir(OTHER))
attempt('link_into_view', lambda: os.link(os.path.join(view, 'tabulate', '__init__.py'), 'mine.py'))
out
"""


@needs_wheels
async def test_182_workers_cannot_change_the_store_or_another_sessions_view(box):
    box.index.add_real("tabulate-")
    async with client(box, "elicit", None, [], IRONCELL_PACKAGES_ALLOW="tabulate") as c:
        # Two sessions install the same wheel at once: both get it, the store holds it once.
        import anyio

        results = {}

        async def install(session):
            results[session] = await run(c, "%pip install tabulate\nimport os\nos.environ['IRONCELL_PACKAGES_DIR']",
                                         session=session)

        async with anyio.create_task_group() as tg:
            tg.start_soon(install, "a")
            tg.start_soon(install, "b")
        assert all(r["status"] == "ok" for r in results.values()), results
        other_view = results["b"]["result"].strip("'")
        assert len(list((box.state / "packages" / "store").iterdir())) == 1
        code = ATTACK.replace("STORE", repr(str(box.state / "packages" / "store"))).replace("OTHER", repr(other_view))
        r = await run(c, code, session="a")
        assert r["status"] == "ok", r
        out = ast.literal_eval(r["result"])
        assert len(out) == 8 and all(v in ("EACCES", "EPERM", "EXDEV") for v in out.values()), out
        r = await run(c, "import tabulate; tabulate.__version__", session="b")
        assert r["result"] == "'0.9.0'", r
    # The store's file is intact.
    (entry,) = (box.state / "packages" / "store").iterdir()
    init = entry / "files" / "tabulate" / "__init__.py"
    with zipfile.ZipFile(WHEELS / "tabulate-0.9.0-py3-none-any.whl") as z:
        assert init.read_bytes() == z.read("tabulate/__init__.py")


# ---------------------------------------------------------------------------------------------
# SECURITY.md #183: never built; an index that hangs fails within seconds
# ---------------------------------------------------------------------------------------------


async def test_183_sdist_only_and_platform_mismatched_packages_are_refused_never_built(box):
    # An sdist whose build would leave a mark: it must never run.
    mark = box.dir / "built"
    setup = f"open({str(mark)!r}, 'w').write('built')\nfrom setuptools import setup\nsetup(name='sdistonly', version='1.0')\n"
    buf = io.BytesIO()
    import tarfile

    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        info = tarfile.TarInfo("sdistonly-1.0/setup.py")
        info.size = len(setup)
        t.addfile(info, io.BytesIO(setup.encode()))
    box.index.add("sdistonly-1.0.tar.gz", buf.getvalue())
    name, data = build_wheel("winonly", "1.0", {"winonly/__init__.py": b""}, tag="cp311-cp311-win_amd64")
    box.index.add(name, data)
    async with client(box, "elicit", None, [], IRONCELL_PACKAGES_ALLOW="*") as c:
        for pkg in ["sdistonly", "winonly"]:
            r = await run(c, f"%pip install {pkg}", session="a")
            msg = r["error"]["message"]
            assert r["error"]["type"] == "InstallError" and "wheels only" in msg, (pkg, r)
    assert not mark.exists()


async def test_183_an_index_that_hangs_fails_within_seconds(user):
    box = Box(user)
    box.index.stop()
    box.index = Index(box.dir, hang=True)
    try:
        async with client(box, "elicit", None, [], IRONCELL_PACKAGES_ALLOW="*") as c:
            started = time.monotonic()
            r = await run(c, "%pip install anything", session="a")
            elapsed = time.monotonic() - started
            msg = r["error"]["message"]
            assert "did not answer within 5 s" in msg and "PIP_INDEX_URL" in msg, r
            # Far under the run's own timeout: the socket timeout ended it, not a deadline.
            assert elapsed < 60, elapsed
            # The session is still usable.
            r = await run(c, "1 + 1", session="a")
            assert r["result"] == "2"
    finally:
        box.close()


async def test_an_index_url_with_credentials_is_never_shown_or_audited(box):
    """Credentials in PIP_INDEX_URL stay in the host: not in an error, the audit, or a worker."""
    box.index.add(*build_wheel("credpkg", "1.0", {"credpkg/__init__.py": b""}))
    url = box.index.url.replace("http://", "http://user:s3cret-token@")
    async with client(box, "elicit", None, [], IRONCELL_PACKAGES_ALLOW="*", PIP_INDEX_URL=url) as c:
        r = await run(c, "%pip install credpkg\nimport os\nsorted(os.environ.items())", session="a")
        assert r["status"] == "ok", r
        assert "s3cret" not in json.dumps(r.record)
        r = await run(c, "%pip install nosuchpkg", session="a")
        assert r["status"] == "error" and "s3cret" not in json.dumps(r.record), r
    assert "s3cret" not in box.cli("audit", "--json")
