"""Every refusal explains itself (issue 44): a cell that fails, or warns, because of the sandbox
gets a short note in the result the model reads, naming what was refused and the way out.

Each case is a real refusal made from inside a session, as root and as `nobody`; the note is
looked for both in the record's `notices` and at the top of the text the model reads. Ordinary
errors get no note.
"""

from __future__ import annotations

import pytest

from test_sandbox import USERS, Sandboxed


@pytest.fixture(scope="module", params=USERS)
def box(request):
    # A small memory limit, so that holding it takes a moment.
    b = Sandboxed(request.param, MCP_BRIDGE_MEMORY_LIMIT="256m")
    yield b
    b.close()


def call(box: Sandboxed, code: str, session: str = "notes", **args) -> tuple[dict, str]:
    """The record and the text block of one run."""
    r = box.srv.call(code, session=session, **args)
    text = "\n".join(c.get("text", "") for c in r["content"] if c.get("type") == "text")
    return r["structuredContent"], text


def notes_of(rec: dict, text: str) -> str:
    notes = rec.get("notices") or []
    for n in notes:
        assert f"[note] {n}" in text, (n, text)
    return "\n".join(notes)


def test_a_path_outside_the_grants_names_the_path_and_the_grant_flags(box):
    rec, text = call(box, "open('/etc/passwd').read()")
    assert rec["status"] == "error" and rec["error"]["type"] == "PermissionError", rec
    notes = notes_of(rec, text)
    assert "access to '/etc/passwd' was refused by the sandbox" in notes, notes
    assert "--allow-read DIR" in notes and "--allow-write DIR" in notes, notes
    assert text.startswith("[note] "), text


def test_a_path_refusal_a_library_reports_in_its_own_words_is_explained(box):
    # The C-library style ('"PATH": Permission denied'), as duckdb words a refused read.
    code = ("try:\n    open('/etc/passwd')\nexcept OSError as e:\n"
            "    raise RuntimeError(f'Cannot open file \"{e.filename}\": {e.strerror}') from None")
    rec, text = call(box, code)
    assert rec["error"]["type"] == "RuntimeError", rec
    assert "access to '/etc/passwd' was refused by the sandbox" in notes_of(rec, text)


@pytest.mark.parametrize("code", [
    "open('/proc/self/status').read()",
    "import os\nos.listdir('/sys/fs/cgroup')",
    "import os\nos.listdir('/proc')",
], ids=["proc-self", "sys", "proc"])
def test_the_hosts_proc_and_sys_are_said_to_be_out_of_reach(box, code):
    """Whether the kernel answers ENOENT (an empty /proc) or EACCES, the note says the files
    are out of reach for every session, and does not send the model after a grant."""
    rec, text = call(box, code)
    assert rec["status"] == "error", rec
    notes = notes_of(rec, text)
    assert "is out of reach: sessions see none of the host's /proc and /sys" in notes, notes
    assert "--allow-read" not in notes, notes


@pytest.mark.parametrize("code", [
    "import urllib.request\nurllib.request.urlopen('http://example.com/', timeout=10)",
    "import socket\nsocket.getaddrinfo('example.com', 80)",
    "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)",
], ids=["urllib", "getaddrinfo", "socket"])
def test_no_network_reads_as_no_network_not_as_a_transient_error(box, code):
    rec, text = call(box, code)
    assert rec["status"] == "error", rec
    notes = notes_of(rec, text)
    assert "this session has no network" in notes and "retrying will not help" in notes, notes
    assert "MCP server" in notes, notes


def test_starting_a_program_is_explained(box):
    rec, text = call(box, "import subprocess\nsubprocess.run(['true'])")
    assert rec["status"] == "error" and rec["error"]["type"] == "PermissionError", rec
    assert "the sandbox refuses to start programs" in notes_of(rec, text)


def test_a_refused_child_process_is_explained_and_an_allowed_one_needs_no_note(box):
    """While `fork` is refused, a process pool's failure (or joblib's serial fallback) says why
    and points at threads; once the sandbox lets a session fork its own children, the same code
    works and carries no note."""
    code = ("import multiprocessing as mp\n"
            "with mp.Pool(2) as p:\n    r = p.map(abs, [-1, -2, -3])\nr")
    rec, text = call(box, code, timeout_s=60)
    notes = notes_of(rec, text)
    if rec["status"] == "ok":
        assert rec["result"] == "[1, 2, 3]" and "child process" not in notes, rec
    else:
        assert "the sandbox refused a child process" in notes and "threads" in notes, rec


def test_a_refused_signal_to_another_process_names_the_system_call_filter(box):
    rec, text = call(box, "import os\nos.kill(1, 0)")
    assert rec["error"]["type"] == "PermissionError", rec
    notes = notes_of(rec, text)
    assert "system-call filter" in notes and "signals to other processes" in notes, notes


def test_a_refused_mode_change_says_the_data_is_still_usable(box):
    rec, text = call(box, "import os\nopen('m.txt', 'w').write('x')\nos.chmod('m.txt', 0o600)")
    assert rec["error"]["type"] == "PermissionError", rec
    assert "refuses changing a file's mode" in notes_of(rec, text)


def test_a_cell_that_changes_its_memory_limits_is_told_they_are_the_servers_setting(box):
    # Lowering, which the filter refuses too (SECURITY.md #239, #260): CPython's own words for
    # that EPERM are "not allowed to raise maximum limit".
    low = "(64 << 20, 64 << 20)"
    for code, kind in ((f"import resource\nresource.setrlimit(resource.RLIMIT_AS, {low})", "ValueError"),
                       (f"import resource\nresource.prlimit(0, resource.RLIMIT_DATA, {low})", "PermissionError")):
        rec, text = call(box, code)
        assert rec["error"]["type"] == kind, rec
        assert "the sandbox fixes this session's memory limits (RLIMIT_AS and RLIMIT_DATA)" in rec["error"]["message"], rec
        assert "not allowed to raise" not in rec["error"]["message"], rec
        notes = notes_of(rec, text)
        assert "cannot change its own memory limits, not even lower them" in notes, notes
        assert "memory limit (256 MiB) is the server's setting" in notes and "MCP_BRIDGE_MEMORY_LIMIT" in notes, notes
        assert "system-call filter" not in notes, notes
    # Code that catches the refusal goes on as before; the limits are unchanged and readable.
    rec, _ = call(box, "import resource\nbefore = resource.getrlimit(resource.RLIMIT_DATA)\n"
                       f"try:\n    resource.setrlimit(resource.RLIMIT_DATA, {low})\nexcept ValueError:\n    pass\n"
                       "before == resource.getrlimit(resource.RLIMIT_DATA) and before[0] > (64 << 20)")
    assert rec["status"] == "ok" and rec["result"] == "True" and not rec.get("notices"), rec
    # Other limits are the session's own to lower, and raising one past its hard limit keeps
    # CPython's words, with no note about memory.
    rec, text = call(box, "import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
                          "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
                          "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard + 1))", session="nofile")
    assert rec["error"]["type"] == "ValueError", rec
    assert rec["error"]["message"] == "not allowed to raise maximum limit", rec
    assert "memory limits" not in notes_of(rec, text), rec


def test_a_missing_module_names_the_interpreter_and_how_to_add_it(box):
    python = box.srv.info()["python"]
    rec, text = call(box, "import ironcell_no_such_package_xyz")
    assert rec["error"]["type"] == "ModuleNotFoundError", rec
    notes = notes_of(rec, text)
    assert "'ironcell_no_such_package_xyz' is not installed" in notes, notes
    assert python["interpreter"] in notes and f"Python {python['version']}" in notes, (notes, python)
    # The distribution's own Python takes packages from its package manager (pip refuses it,
    # PEP 668); any other from pip (tests/e2e/test_census.py checks a venv's note).
    if python["interpreter"].startswith("/usr/bin/"):
        assert "apt install python3-ironcell-no-such-package-xyz" in notes, notes
    else:
        assert f"{python['interpreter']} -m pip install ironcell_no_such_package_xyz" in notes, notes
    assert "--python" in notes, notes


def test_a_session_at_its_memory_limit_says_so_until_memory_is_freed(box):
    s = "memory"
    # One allocation past the limit: nothing is held afterwards.
    rec, text = call(box, "x = bytearray(1 << 40)", session=s)
    assert rec["error"]["type"] == "MemoryError", rec
    notes = notes_of(rec, text)
    assert "needed more memory than this session's limit (256 MiB" in notes, notes
    # Fill the limit and keep it: the MemoryError leaves the session holding it.
    rec, text = call(box, "keep = []\nwhile True:\n    keep.append(bytearray(4 << 20))", session=s)
    assert rec["error"]["type"] == "MemoryError", rec
    notes = notes_of(rec, text)
    assert "this session holds" in notes and "of its 256 MiB memory limit" in notes, notes
    assert "reset=true" in notes and "del" in notes, notes
    # A later, unrelated failure still says so.
    rec, text = call(box, "import json\njson.loads('{' * 100 + '}')", session=s)
    assert rec["status"] == "error", rec
    assert "of its 256 MiB memory limit" in notes_of(rec, text), rec
    # Freed: an ordinary error carries no memory note.
    rec, _ = call(box, "del keep\nimport gc\ngc.collect()\nlen([0] * 1000)", session=s)
    assert rec["status"] == "ok", rec
    rec, text = call(box, "1/0", session=s)
    assert rec["error"]["type"] == "ZeroDivisionError" and "memory" not in notes_of(rec, text), rec


@pytest.mark.parametrize("code", [
    "1/0",
    "open('no-such-file.txt')",
    "import sys\nprint('Operation fine', file=sys.stderr)\nraise ValueError('bad value')",
    "import os\nos.mkdir('d')\nos.mkdir('d')",
], ids=["zero-division", "missing-file", "stderr-and-value-error", "exists"])
def test_ordinary_errors_carry_no_note(box, code):
    rec, text = call(box, code, session="ordinary")
    assert rec["status"] == "error", rec
    assert not rec.get("notices"), rec
    assert "[note]" not in text, text
