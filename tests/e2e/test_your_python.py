"""Your Python: sessions run in the interpreter the user chose (issue 9).

One build of ironcell runs every CPython from 3.9 on: the core cases run in each interpreter this
machine has (pyenv's 3.9-3.13 builds where present — readable by root only —, Debian's python3.11);
a venv made here with a package installed from a wheel; a conda-like prefix under a home
directory, chosen through CONDA_PREFIX, with the sandbox attacked from inside as root and as
`nobody`; and every refusal names the path and the fix.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import HARNESS, IRONCELL, TEST_PYTHON, RawServer, server_env, shared_tmp_dir, wait_until

PYENV = Path("/root/.pyenv/versions")


def _pyenv(minor: int) -> Path | None:
    try:
        found = sorted(PYENV.glob(f"3.{minor}.*"), key=lambda p: [int(x) for x in p.name.split(".") if x.isdigit()])
    except OSError:
        return None
    exe = found[-1] / "bin" / "python3" if found else None
    return exe if exe and os.access(exe, os.X_OK) else None


def _interpreters():
    for minor in range(9, 14):
        yield pytest.param(_pyenv(minor), id=f"pyenv-3.{minor}")
    yield pytest.param(Path("/usr/bin/python3.11"), id="debian-3.11")


def _version_of(python: Path) -> str:
    return subprocess.run([str(python), "-I", "-c", "import sys; print(sys.version.split()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _text(r: dict) -> str:
    return json.dumps(r)


def _result(r: dict) -> str:
    assert not r.get("isError"), r
    return r["structuredContent"]["result"]


def _info(srv: RawServer) -> dict:
    r = srv.request("resources/read", {"uri": "system://info"})
    return json.loads(r["result"]["contents"][0]["text"])


@pytest.mark.parametrize("python", list(_interpreters()))
def test_core_cases_run_in_each_interpreter(python, state_dir):
    if python is None or not python.exists():
        pytest.skip("this interpreter is not installed on this machine")
    version = _version_of(python)
    srv = RawServer(state_dir, IRONCELL_PYTHON=str(python))
    try:
        srv.initialize()
        assert _result(srv.call("import sys\nx = 41\nsys.version.split()[0]", session="s")) == repr(version)
        assert _result(srv.call("x + 1", session="s")) == "42", "state is kept between runs"
        r = srv.call("1/0", session="s")
        assert r.get("isError") and "ZeroDivisionError" in _text(r)
        assert _result(srv.call("print('out'); import json, mcp; 'ok'", session="s")) == "'ok'"
        # pymalloc's arenas come from ironcell's allocator: ~100 MiB of small objects made,
        # freed (arenas go back) and made again, in the zygote's interpreter.
        churn = ("import gc\nxs = [[str(i)] * 3 for i in range(1_000_000)]\nn = len(xs)\ndel xs\ngc.collect()\n"
                 "ys = [{i: (i,)} for i in range(300_000)]\nn + sum(len(y) for y in ys)")
        assert _result(srv.call(churn, session="s")) == "1300000"
        # The sandbox holds in every interpreter: no host files, no network.
        r = srv.call("try:\n    open('/etc/passwd').read(); r = 'read'\nexcept PermissionError: r = 'denied'\nr")
        assert _result(r) == "'denied'"
        r = srv.call("import socket\ntry:\n    socket.socket().connect(('127.0.0.1', 9)); r = 'connected'\n"
                     "except PermissionError: r = 'denied'\nexcept OSError as e: r = repr(e)\nr")
        assert _result(r) == "'denied'"
        info = _info(srv)["python"]
        assert info["version"] == version
        assert info["chosen_by"] == "--python / IRONCELL_PYTHON"
        assert Path(info["executable"]).resolve() == python.resolve()
    finally:
        srv.close()


THREADS_AFTER_FORK = """
import logging, threading
seen = {}
def probe():
    seen["lock free"] = logging._lock.acquire(blocking=False)
    if seen["lock free"]:
        logging._lock.release()
    logging.getLogger("probe").warning("from a thread")
    seen["logged"] = True
t = threading.Thread(target=probe)
t.start()
t.join(10)
import random, sys, _ironcell_runner
(not t.is_alive(), seen, threading.main_thread() is threading.current_thread(),
 threading._after_fork.__code__.co_name,
 getattr(logging, "_after_at_fork_child_reinit_locks", probe).__code__.co_name,
 random.Random.seed.__code__.co_name, random.Random(5).random(), random.random(),
 sorted(f.__qualname__ for f, _ in _ironcell_runner._quieted_fork_hooks), "matplotlib.pyplot" in sys.modules)
"""


@pytest.mark.parametrize("python", list(_interpreters()))
def test_threads_and_logging_work_in_a_fresh_worker(python, state_dir):
    """The zygote lets workers skip two after-fork hooks before 3.12 (they only repair what other
    threads left behind) and each worker puts them back: a thread it starts can log (logging's
    module lock, held by the zygote while it forked, is free again) and the hooks are the
    standard library's own again, in a pre-forked spare, in a worker forked on demand, and (with
    matplotlib) in one forked after the zygote's plot warm-up. `random`'s hook still reseeds
    every worker: no two sessions draw the same numbers."""
    import random

    if python is None or not python.exists():
        pytest.skip("this interpreter is not installed on this machine")
    before_3_12 = tuple(int(x) for x in _version_of(python).split(".")[:2]) < (3, 12)
    draws = []

    def probe(srv, session, pool) -> bool:
        done, seen, main, threading_hook, logging_hook, seed_code, seeded, drawn, quieted, pyplot = \
            ast.literal_eval(_result(srv.call(THREADS_AFTER_FORK, session=session)))
        assert done and seen == {"lock free": True, "logged": True}, (pool, session, seen)
        assert main, "the worker's main thread is threading's main thread"
        assert threading_hook == "_after_fork", threading_hook
        assert logging_hook in ("_after_at_fork_child_reinit_locks", "probe"), logging_hook
        assert seed_code == "seed" and seeded == random.Random(5).random()
        draws.append(drawn)
        # The hooks were quieted in this fork (so this test tests something) before 3.12 only.
        if before_3_12:
            assert "_after_fork" in quieted, quieted
        else:
            assert quieted == [], quieted
        return pyplot

    for pool in ("2", "0"):
        srv = RawServer(state_dir, IRONCELL_PYTHON=str(python), IRONCELL_POOL_SIZE=pool)
        try:
            srv.initialize()
            for session in ("a", "b"):
                probe(srv, session, pool)
            # Where matplotlib is installed the zygote warms up for plots between two forks and
            # quiets the hooks again: workers forked after that, too.
            if pool == "2" and ast.literal_eval(_result(srv.call("import importlib.util\n"
                                                      "importlib.util.find_spec('matplotlib') is not None"))):
                fresh = iter(range(1000))
                assert wait_until(lambda: probe(srv, f"w{next(fresh)}", pool), timeout=120, step=0.5), \
                    "no new session found pyplot imported by the warmed zygote"
                probe(srv, "after-warm-up", pool)
        finally:
            srv.close()
    assert len(set(draws)) == len(draws), f"two sessions drew the same random number: {draws}"


def _wheel() -> Path | None:
    found = sorted((HARNESS / "wheels").glob("tabulate-*.whl")) if (HARNESS / "wheels").is_dir() else []
    return found[-1] if found else None


@pytest.fixture(scope="module")
def venv_with_package():
    """A venv of Debian's python3.11 with `tabulate` (pure Python, from PyPI: the wheel is
    fetched by scripts/install_test_peers.sh) installed into it, usable by `nobody` too."""
    wheel = _wheel()
    if wheel is None:
        pytest.skip("no tabulate wheel in the harness (scripts/install_test_peers.sh downloads it)")
    if subprocess.run(["/usr/bin/python3.11", "-c", "import ensurepip"], capture_output=True).returncode:
        pytest.skip("python3.11-venv is not installed")
    base = shared_tmp_dir("/var/tmp")
    venv = base / "venv"
    subprocess.run(["/usr/bin/python3.11", "-m", "venv", str(venv)], check=True, capture_output=True)
    subprocess.run([str(venv / "bin/pip"), "install", "-q", "--no-index", str(wheel)], check=True,
                   capture_output=True)
    subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
    yield venv
    shutil.rmtree(base, ignore_errors=True)


def test_a_venvs_packages_are_importable_and_absent_without_it(venv_with_package, state_dir):
    code = "import sys\ntry:\n    import tabulate; r = (tabulate.__name__, sys.prefix)\nexcept ImportError: r = 'absent'\nr"
    srv = RawServer(state_dir, IRONCELL_PYTHON=str(venv_with_package))
    try:
        srv.initialize()
        assert ast.literal_eval(_result(srv.call(code))) == ("tabulate", str(venv_with_package))
        info = _info(srv)["python"]
        assert info["prefix"] == str(venv_with_package) and info["base_prefix"] == "/usr"
        assert any("site-packages" in p and str(venv_with_package) in p for p in info["site_packages"])
    finally:
        srv.close()
    srv = RawServer(state_dir)
    try:
        srv.initialize()
        assert _result(srv.call(code)) == "'absent'", "without --python the venv's packages are not there"
    finally:
        srv.close()
    # VIRTUAL_ENV (an activated venv) chooses it too.
    srv = RawServer(state_dir, IRONCELL_PYTHON=None, VIRTUAL_ENV=str(venv_with_package))
    try:
        srv.initialize()
        assert ast.literal_eval(_result(srv.call(code)))[0] == "tabulate"
        assert _info(srv)["python"]["chosen_by"] == "VIRTUAL_ENV"
    finally:
        srv.close()


@pytest.fixture(scope="module")
def conda_like_prefix():
    """A relocatable prefix under a home directory, as conda makes them: Debian's python3.11
    executable (it links no libpython) with a copy of its stdlib, all readable by `nobody`, and
    next to it a file of the home's owner that no session may read."""
    home = Path(shared_tmp_dir("/var/tmp")) / "home" / "ann"
    prefix = home / "miniconda3" / "envs" / "data"
    (prefix / "bin").mkdir(parents=True)
    shutil.copy2("/usr/bin/python3.11", prefix / "bin" / "python3.11")
    (prefix / "bin" / "python3").symlink_to("python3.11")
    shutil.copytree("/usr/lib/python3.11", prefix / "lib" / "python3.11", symlinks=True,
                    ignore=shutil.ignore_patterns("test", "__pycache__", "idlelib", "tkinter", "dist-packages"))
    # Where this interpreter looks for packages (Debian's site.py says dist-packages).
    found = subprocess.run([str(prefix / "bin" / "python3"), "-I", "-c", "import site; print(site.getsitepackages()[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    site = Path(found)
    assert site.is_relative_to(prefix), site
    site.mkdir(parents=True, exist_ok=True)
    (site / "ann_pkg.py").write_text("VALUE = 'from the env'\n")
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_ed25519").write_text("PRIVATE KEY\n")
    subprocess.run(["chmod", "-R", "a+rX", str(home.parent.parent)], check=True)
    yield prefix
    shutil.rmtree(home.parent.parent, ignore_errors=True)


ATTACKS = r"""
import os, sys
import ann_pkg
prefix = sys.prefix
home = os.path.dirname(os.path.dirname(os.path.dirname(prefix)))
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = "done"
    except PermissionError:
        out[name] = "denied"
    except OSError as e:
        out[name] = type(e).__name__
attempt("write_site_packages", lambda: open(os.path.join(os.path.dirname(ann_pkg.__file__), "evil.py"), "w").write("x"))
attempt("write_stdlib", lambda: open(os.path.join(prefix, "lib/python3.11/os.py"), "a").write("x"))
attempt("read_home_key", lambda: open(os.path.join(home, ".ssh/id_ed25519")).read())
attempt("list_home", lambda: os.listdir(home))
attempt("read_prefix_bin", lambda: open(os.path.join(prefix, "bin/python3.11"), "rb").read(4))
attempt("read_etc", lambda: open("/etc/hostname").read())
out["pkg"] = ann_pkg.VALUE
out["prefix"] = prefix
out
"""


@pytest.mark.parametrize("as_user", ["root", "nobody"])
def test_the_sandbox_holds_with_a_conda_like_prefix_under_a_home(conda_like_prefix, as_user):
    state = shared_tmp_dir("/var/tmp")
    try:
        srv = RawServer(state, as_user=as_user, IRONCELL_PYTHON=None, CONDA_PREFIX=str(conda_like_prefix))
        try:
            srv.initialize()
            out = ast.literal_eval(_result(srv.call(ATTACKS)))
            assert out["pkg"] == "from the env" and out["prefix"] == str(conda_like_prefix)
            for attack in ("write_site_packages", "write_stdlib", "read_home_key", "list_home",
                           "read_prefix_bin", "read_etc"):
                assert out[attack] == "denied", (attack, out)
            assert _info(srv)["python"]["chosen_by"] == "CONDA_PREFIX"
        finally:
            srv.close()
        assert not list(conda_like_prefix.rglob("evil.py"))
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _first_run_error(state_dir: Path, as_user: str = "root", **env) -> str:
    srv = RawServer(state_dir, as_user=as_user, **env)
    try:
        srv.initialize()
        r = srv.call("1 + 1")
        assert r.get("isError"), r
        info = _info(srv)["python"]
        assert "error" in info, info
        return _text(r) + "\n" + info["error"]
    finally:
        srv.close()


def _doctor(state_dir: Path, **env) -> str:
    p = subprocess.run([str(IRONCELL), "doctor"], env=server_env(state_dir, **env), capture_output=True,
                       text=True, timeout=120)
    return p.stdout + p.stderr


def test_a_missing_interpreter_is_named_with_the_fix(state_dir):
    err = _first_run_error(state_dir, IRONCELL_PYTHON="/opt/no-such-python/bin/python3")
    assert "/opt/no-such-python/bin/python3" in err and "does not exist" in err
    assert "/opt/no-such-python" in _doctor(state_dir, IRONCELL_PYTHON="/opt/no-such-python/bin/python3")


def test_a_venv_whose_base_is_gone_says_how_to_recreate_it(state_dir, tmp_path):
    venv = tmp_path / "broken-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /opt/gone-python/bin\ninclude-system-site-packages = false\n")
    (venv / "bin" / "python3").symlink_to("/opt/gone-python/bin/python3")
    err = _first_run_error(state_dir, IRONCELL_PYTHON=str(venv))
    assert "/opt/gone-python/bin" in err and "python3 -m venv --clear" in err


@pytest.mark.parametrize("minor", [7, 8])
def test_a_too_old_python_is_refused_with_the_fix(state_dir, minor):
    found = sorted(PYENV.glob(f"3.{minor}.*")) if os.access(PYENV, os.R_OK) else []
    if not found:
        pytest.skip(f"no Python 3.{minor} on this machine")
    err = _first_run_error(state_dir, IRONCELL_PYTHON=str(found[-1] / "bin" / "python3"))
    assert "3.9 or newer" in err and str(found[-1]) in err


def test_a_free_threaded_build_is_refused_with_the_fix(state_dir):
    found = [p for p in PYENV.glob("3.1[3-9]*t*/bin/python3*t")] if os.access(PYENV, os.R_OK) else []
    if not found:
        pytest.skip("no free-threaded CPython (3.13t) on this machine")
    err = _first_run_error(state_dir, IRONCELL_PYTHON=str(found[0]))
    assert "free-threaded" in err


def test_a_prefix_the_user_cannot_read_is_named_with_the_fix():
    python = _pyenv(12) or _pyenv(11)
    if python is None or os.access("/root", os.R_OK | os.X_OK) is False:
        pytest.skip("no root-only pyenv interpreter on this machine")
    if os.geteuid() != 0:
        pytest.skip("needs root to start ironcell as nobody")
    state = shared_tmp_dir("/var/tmp")
    try:
        err = _first_run_error(state, as_user="nobody", IRONCELL_PYTHON=str(python))
        assert "nobody" in err and "not readable" in err and "--python" in err
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_the_host_links_no_libpython():
    p = subprocess.run(["ldd", str(IRONCELL)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "libpython" not in p.stdout, p.stdout


def test_a_relative_python_is_taken_from_the_starting_directory_and_a_bare_name_from_path(state_dir, tmp_path):
    # The zygote starts in /, so a relative --python once failed with "No such file".
    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "env" / "bin" / "python3").symlink_to(TEST_PYTHON)
    env = server_env(state_dir, IRONCELL_PYTHON=None, PATH=f"{Path(TEST_PYTHON).parent}:/usr/bin:/bin")
    for given in ("env/bin/python3", Path(TEST_PYTHON).name):
        p = subprocess.run([str(IRONCELL), "exec", "--python", given, "6 * 7"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=60)
        assert p.returncode == 0 and "42" in p.stdout, (given, p.stdout, p.stderr)


def test_a_setting_that_cannot_be_used_names_the_variable_it_came_from(state_dir):
    env = server_env(state_dir, MCP_BRIDGE_MEMORY_LIMIT="20m")
    p = subprocess.run([str(IRONCELL), "exec", "1"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and "at least 64m" in p.stderr and "MCP_BRIDGE_MEMORY_LIMIT" in p.stderr, p.stderr
    # `0` turns the free-disk guard off, as documented, rather than being refused.
    env = server_env(state_dir, IRONCELL_MIN_FREE_DISK="0")
    p = subprocess.run([str(IRONCELL), "exec", "6 * 7"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and "42" in p.stdout, p.stderr
