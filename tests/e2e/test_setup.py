"""`ironcell setup`, policy overlays and grants, the state dir fallback, and the Windows-side
Claude Desktop servers under WSL2 — all through the real binary.

WSL2 is faked with `IRONCELL_PROBE_ROOT`: a directory holding `proc/sys/fs/binfmt_misc/WSLInterop`
and a `mnt/c` drive with a Windows user's Claude Desktop config.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import IRONCELL, PREFIX_FOR_USER, RawServer, server_env

TEST_SERVER = Path(__file__).parent / "servers" / "test_server.py"
WIN_CFG = "AppData/Roaming/Claude/claude_desktop_config.json"

OTHER_SERVERS = """{
    "globalShortcut": "Ctrl+Space",
    "mcpServers": {
        "git":   {"command": "uvx", "args": ["mcp-server-git"]},
        "files": {
            "command": "npx",
            "env": {"TOKEN": "s\\u00e9cret"}
        }
    }
}
"""


def setup(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    e = {"PATH": "/usr/bin:/bin", "HOME": str(home), **env}
    return subprocess.run([str(IRONCELL), "setup", *args], capture_output=True, text=True, env=e,
                          stdin=subprocess.DEVNULL, timeout=60)


def fake_wsl(root: Path, interop: str = "enabled", windows_config: str | None = None) -> Path:
    (root / "proc/sys/fs/binfmt_misc").mkdir(parents=True)
    (root / "proc/sys/fs/binfmt_misc/WSLInterop").write_text(interop + "\n")
    (root / "proc/version").write_text("Linux version 6.6.87.2-microsoft-standard-WSL2\n")
    cfg = root / "mnt/c/Users/ann" / WIN_CFG
    cfg.parent.mkdir(parents=True)
    (root / "mnt/c/Users/Public").mkdir()
    if windows_config is not None:
        cfg.write_text(windows_config)
    return cfg


def entry_of(path: Path, name: str = "ironcell") -> dict:
    return json.loads(path.read_text())["mcpServers"][name]


def configured(home: Path) -> str:
    """The binary setup puts in the config: a build's binary (in a cargo `target/`, marked by
    its CACHEDIR.TAG) is installed as ~/.local/bin/ironcell first; an installed one is used as
    it is."""
    if (IRONCELL.resolve().parents[1] / "CACHEDIR.TAG").is_file():
        return str(home / ".local/bin/ironcell")
    return str(IRONCELL.resolve())


# ---------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------

def test_claude_code_dry_run_shows_a_diff_passes_settings_as_flags_and_writes_nothing(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    p = setup("--client", "claude-code", "--dry-run", "--allow-read", str(proj), "--timeout", "60s", home=tmp_path)
    assert p.returncode == 0, p.stderr
    assert f"+++ {tmp_path}/.claude.json" in p.stdout
    for line in ['+      "type": "stdio",', f'+      "command": "{configured(tmp_path)}",', '+        "--allow-read",',
                 f'+        "{proj}"', '+        "60s",']:
        assert line in p.stdout, p.stdout
    assert "claude mcp add --scope user ironcell -- " in p.stdout
    assert "ironcell doctor" in p.stdout and "system://info" in p.stdout
    assert not (tmp_path / ".claude.json").exists() and not (tmp_path / ".local/bin/ironcell").exists()


def test_claude_code_project_scope_writes_mcp_json_in_the_current_folder(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    p = subprocess.run([str(IRONCELL), "setup", "--client", "claude-code", "--scope", "project"], cwd=proj,
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                       stdin=subprocess.DEVNULL, timeout=60)
    assert p.returncode == 0, p.stderr
    e = entry_of(proj / ".mcp.json")
    assert e["command"] == configured(tmp_path) and e["args"] == ["serve"], e


def test_merging_keeps_every_other_byte_and_leaves_a_timestamped_backup(tmp_path):
    cfg = tmp_path / ".config/Claude/claude_desktop_config.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(OTHER_SERVERS)
    p = setup("--client", "claude-desktop", "--memory-limit", "2g", home=tmp_path)
    assert p.returncode == 0, p.stderr
    new = cfg.read_text()
    # Byte for byte: everything before ironcell's entry and after it is the old text.
    cut = OTHER_SERVERS.rindex("\n        }") + len("\n        }")
    assert new.startswith(OTHER_SERVERS[:cut]) and new.endswith(OTHER_SERVERS[cut:]), new
    e = entry_of(cfg)
    assert e == {"command": configured(tmp_path), "args": ["serve", "--memory-limit", "2g"]}
    backups = list(cfg.parent.glob("claude_desktop_config.json.bak-*"))
    assert len(backups) == 1 and backups[0].read_text() == OTHER_SERVERS, backups
    assert str(backups[0]) in p.stdout
    # Again with the same settings: nothing to do, no second backup.
    p = setup("--client", "claude-desktop", "--memory-limit", "2g", home=tmp_path)
    assert p.returncode == 0 and "already has this entry" in p.stdout, p.stdout
    assert len(list(cfg.parent.glob("*.bak-*"))) == 1
    # Other settings change only the entry (merged with it: see the merge test).
    p = setup("--client", "claude-desktop", "--replace", home=tmp_path)
    assert p.returncode == 0, p.stderr
    assert entry_of(cfg)["args"] == ["serve"]
    assert cfg.read_text().startswith(OTHER_SERVERS[:cut])


def test_a_private_config_stays_private_in_its_backups_and_they_do_not_pile_up(tmp_path):
    cfg = tmp_path / ".claude.json"
    cfg.write_text('{"oauthAccount": {"token": "private"}, "mcpServers": {}}\n')
    cfg.chmod(0o600)
    for n in range(1, 7):
        p = setup("--client", "claude-code", "--timeout", f"{n}s", home=tmp_path)
        assert p.returncode == 0, p.stderr
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    backups = sorted(tmp_path.glob(".claude.json.bak-*"))
    assert len(backups) == 3, backups
    for b in backups:
        assert stat.S_IMODE(b.stat().st_mode) == 0o600, b
    # The newest three: the configs with 3 s, 4 s and 5 s.
    kept = sorted(entry_of(b)["args"][-1] for b in backups)
    assert kept == ["3s", "4s", "5s"], kept
    assert entry_of(cfg)["args"][-1] == "6s"
    # A backup the user made by hand is not setup's to remove.
    mine = tmp_path / ".claude.json.bak-mine"
    mine.write_text("{}")
    setup("--client", "claude-code", "--timeout", "7s", home=tmp_path)
    assert mine.exists() and len(list(tmp_path.glob(".claude.json.bak-2*"))) == 3


def test_running_setup_again_keeps_the_earlier_settings_and_says_so_unless_told_to_replace(tmp_path):
    cfg = tmp_path / ".claude.json"
    data = tmp_path / "data"
    data.mkdir()
    p = setup("--client", "claude-code", "--allow-read", str(data), "--timeout", "60s", home=tmp_path)
    assert p.returncode == 0, p.stderr
    e = entry_of(cfg)
    e["env"] = {"MCP_BRIDGE_CONFIG": "/etc/mine.json"}
    cfg.write_text(json.dumps({"mcpServers": {"ironcell": e}}))
    # One new flag, one changed: the earlier grant and env stay, the timeout is the new one.
    p = setup("--client", "claude-code", "--memory-limit", "1g", "--timeout", "90s", home=tmp_path)
    assert p.returncode == 0, p.stderr
    e = entry_of(cfg)
    assert e["args"] == ["serve", "--timeout", "90s", "--memory-limit", "1g", "--allow-read", str(data)], e
    assert e["env"] == {"MCP_BRIDGE_CONFIG": "/etc/mine.json"}
    assert "kept from the existing \"ironcell\" entry" in p.stdout, p.stdout
    assert f"--allow-read {data}, env MCP_BRIDGE_CONFIG" in p.stdout and "--replace drops them" in p.stdout
    # A repeatable flag adds to the earlier values.
    other = tmp_path / "other"
    other.mkdir()
    p = setup("--client", "claude-code", "--allow-read", str(other), home=tmp_path)
    args = entry_of(cfg)["args"]
    assert args.count("--allow-read") == 2 and str(other) in args and str(data) in args, args
    # --replace: exactly this run's entry, and what went is named.
    p = setup("--client", "claude-code", "--replace", home=tmp_path)
    assert p.returncode == 0, p.stderr
    assert entry_of(cfg) == {"type": "stdio", "command": configured(tmp_path), "args": ["serve"], "env": {}}
    assert "--replace: dropping" in p.stdout and "--memory-limit 1g" in p.stdout and "--timeout 90s" in p.stdout, p.stdout


def test_a_build_binary_is_installed_so_the_config_survives_cargo_clean(tmp_path):
    # A build tree of its own (cargo marks target/ with CACHEDIR.TAG), to be "cleaned".
    target = tmp_path / "clone/target"
    (target / "release").mkdir(parents=True)
    (target / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n")
    built = target / "release/ironcell"
    shutil.copy2(IRONCELL, built)
    home = tmp_path / "home"
    home.mkdir()
    p = subprocess.run([str(built), "setup", "--client", "claude-code"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(home)}, stdin=subprocess.DEVNULL, timeout=60)
    assert p.returncode == 0, p.stderr
    installed = home / ".local/bin/ironcell"
    assert f"installed {built} as {installed}" in p.stdout and "run setup again" in p.stdout, p.stdout
    assert entry_of(home / ".claude.json")["command"] == str(installed)
    assert stat.S_IMODE(installed.stat().st_mode) == 0o755
    shutil.rmtree(tmp_path / "clone")  # cargo clean, or the clone moved
    v = subprocess.run([str(installed), "--version"], capture_output=True, text=True, timeout=30)
    assert v.returncode == 0 and v.stdout.startswith("ironcell "), v
    # --no-install configures the build's binary itself; --ironcell names one.
    p = setup("--client", "claude-code", "--no-install", "--replace", home=home)
    assert entry_of(home / ".claude.json")["command"] == str(IRONCELL.resolve())
    p = setup("--client", "claude-code", "--ironcell", str(installed), home=home)
    assert p.returncode == 0 and "installed" not in p.stdout, p.stdout
    assert entry_of(home / ".claude.json")["command"] == str(installed)


def test_a_venv_goes_first_on_the_users_own_path(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").symlink_to("/usr/bin/python3")
    nvm = tmp_path / ".nvm/versions/node/v22/bin"
    nvm.mkdir(parents=True)
    p = setup("--client", "claude-code", "--venv", str(venv), home=tmp_path, PATH=f"{nvm}:/usr/bin:/bin")
    assert p.returncode == 0, p.stderr
    e = entry_of(tmp_path / ".claude.json")
    assert e["command"] == "/usr/bin/env", e
    assert e["args"][:2] == [f"VIRTUAL_ENV={venv}", f"PATH={venv}/bin:{nvm}:/usr/bin:/bin"], e


def test_a_config_that_is_not_json_is_left_untouched_with_a_clear_error(tmp_path):
    cfg = tmp_path / ".config/Claude/claude_desktop_config.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('{"mcpServers": {,}')
    p = setup("--client", "claude-desktop", home=tmp_path)
    assert p.returncode != 0
    assert str(cfg) in p.stderr and "not valid JSON" in p.stderr and "Fix the file" in p.stderr, p.stderr
    assert cfg.read_text() == '{"mcpServers": {,}'
    assert not list(cfg.parent.glob("*.bak-*"))


def test_with_no_client_found_setup_names_the_choices(tmp_path):
    p = setup(home=tmp_path)
    assert p.returncode != 0 and "--client claude-code" in p.stderr and "--client docker" in p.stderr, p.stderr


def test_a_grant_of_a_missing_folder_fails_at_setup_not_in_the_client(tmp_path):
    p = setup("--client", "claude-code", "--allow-read", str(tmp_path / "nope"), home=tmp_path)
    assert p.returncode != 0 and "--allow-read" in p.stderr and "nope" in p.stderr, p.stderr
    assert not (tmp_path / ".claude.json").exists()


def test_wsl2_writes_the_windows_side_config_with_wsl_exe_the_distro_and_flags(tmp_path):
    root = tmp_path / "root"
    cfg = fake_wsl(root, windows_config=OTHER_SERVERS)
    p = setup("--timeout", "60s", "--dry-run", home=tmp_path, IRONCELL_PROBE_ROOT=str(root), WSL_DISTRO_NAME="Ubuntu-24.04")
    assert p.returncode == 0, p.stderr
    assert "Claude Desktop on Windows (through WSL2)" in p.stdout and f"+++ {cfg}" in p.stdout, p.stdout
    assert cfg.read_text() == OTHER_SERVERS  # dry run
    p = setup("--timeout", "60s", home=tmp_path, IRONCELL_PROBE_ROOT=str(root), WSL_DISTRO_NAME="Ubuntu-24.04")
    assert p.returncode == 0, p.stderr
    e = entry_of(cfg)
    assert e == {"command": "wsl.exe",
                 "args": ["-d", "Ubuntu-24.04", "--exec", configured(tmp_path), "serve", "--timeout", "60s"]}
    assert "env" not in e  # Windows-side env would not cross wsl.exe without WSLENV
    assert entry_of(cfg, "git") == {"command": "uvx", "args": ["mcp-server-git"]}


def test_wsl2_with_a_conda_env_starts_through_the_conda_executable_not_bashrc(tmp_path):
    root = tmp_path / "root"
    cfg = fake_wsl(root)
    conda = tmp_path / "miniconda3/bin/conda"
    conda.parent.mkdir(parents=True)
    conda.write_text("#!/bin/sh\n")
    conda.chmod(0o755)
    p = setup("--conda-env", "science", "--windows-user", "ann", home=tmp_path,
              IRONCELL_PROBE_ROOT=str(root), WSL_DISTRO_NAME="Ubuntu")
    assert p.returncode == 0, p.stderr
    assert entry_of(cfg)["args"] == ["-d", "Ubuntu", "--exec", str(conda), "run", "--no-capture-output", "-n", "science",
                                     configured(tmp_path), "serve"]


def test_docker_prints_init_mounts_grants_and_doctor_first(tmp_path):
    p = setup("--client", "docker", "--allow-read", "/Users/me/proj", "--allow-write", "/Users/me/out",
              "--image", "ironcell:full", home=tmp_path)
    assert p.returncode == 0, p.stderr
    start = p.stdout.index("{")
    snippet, _ = json.JSONDecoder().raw_decode(p.stdout[start:])
    e = snippet["mcpServers"]["ironcell"]
    assert e["command"] == "docker"
    assert e["args"] == ["run", "-i", "--rm", "--init", "-v", "/Users/me/proj:/data/proj:ro", "-v", "/Users/me/out:/data/out",
                         "ironcell:full", "serve", "--allow-read", "/data/proj", "--allow-write", "/data/out"], e
    assert "docker run --rm ironcell:full doctor" in p.stdout
    assert "Library/Application Support/Claude/claude_desktop_config.json" in p.stdout


# ---------------------------------------------------------------------------------------------
# policy overlays and grants
# ---------------------------------------------------------------------------------------------

def policy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(IRONCELL), "policy", "show", *args], capture_output=True, text=True, timeout=30)


def test_a_partial_policy_file_is_merged_over_the_default(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text(f'[limits]\nmemory_mib = 512\n[filesystem]\nallow_read = ["{tmp_path}"]\n')
    p = policy("--policy", str(f))
    assert p.returncode == 0, p.stderr
    assert "memory_mib = 512" in p.stdout and "cpu_seconds = 3600" in p.stdout and '"/usr/share/zoneinfo"' in p.stdout
    assert f'allow_read = [\n  "{tmp_path}",\n]' in p.stdout, p.stdout
    f.write_text('base = "strict"\n[limits]\nopen_files = 100\n')
    p = policy("--policy", str(f))
    assert p.returncode == 0 and 'name = "strict"' in p.stdout and "cpu_seconds = 600" in p.stdout and "open_files = 100" in p.stdout


@pytest.mark.parametrize("text,needle", [
    ("[limits]\nmemori_mib = 5\n", "`limits.memori_mib` is not a policy key"),
    ("network = true\n", "`network` is not a policy key"),
    ('[limits]\nmemory_mib = "5"\n', "`limits.memory_mib` is a string, but it must be an integer"),
    ("[limits]\nmemory_mib = 1\n", "`limits.memory_mib` is 1"),
    ("[filesystem]\nallow_write = [3]\n", "`filesystem.allow_write[0]` is an integer"),
    ('[filesystem]\nallow_read = ["/no/such/dir"]\n', "`filesystem.allow_read`"),
    ('base = "lax"\n', "`base`"),
])
def test_only_unknown_or_invalid_keys_are_errors_and_they_name_the_key(tmp_path, text, needle):
    f = tmp_path / "p.toml"
    f.write_text(text)
    p = policy("--policy", str(f))
    assert p.returncode != 0 and needle in p.stderr and str(f) in p.stderr, p.stderr


def test_a_grant_overlapping_the_state_dir_is_refused(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    p = subprocess.run([str(IRONCELL), "policy", "show", "--allow-read", str(tmp_path)], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "MCP_BRIDGE_STATE_DIR": str(state)}, timeout=30)
    assert p.returncode != 0 and "overlaps ironcell's state dir" in p.stderr, p.stderr


def granted_dirs() -> Path:
    """Folders an unprivileged user can reach, outside /tmp (sessions get their own /tmp)."""
    base = Path(tempfile.mkdtemp(prefix="ironcell-grants-", dir="/var/tmp"))
    for d in ("readable", "writable", "sibling"):
        (base / d).mkdir()
        (base / d / "data.txt").write_text(f"{d} data\n")
        for p in (base / d, base / d / "data.txt"):
            p.chmod(0o777 if p.is_dir() else 0o666)
    base.chmod(0o755)
    return base


GRANT_PROBE = r'''
import os
def outcome(f):
    try:
        return "ok:" + repr(f())[:80]
    except BaseException as e:
        return type(e).__name__
B = {base!r}
{{
  "read granted": outcome(lambda: open(B + "/readable/data.txt").read()),
  "list granted": outcome(lambda: sorted(os.listdir(B + "/readable"))),
  "write to read grant": outcome(lambda: open(B + "/readable/new.txt", "w").write("x")),
  "read sibling": outcome(lambda: open(B + "/sibling/data.txt").read()),
  "list parent": outcome(lambda: os.listdir(B)),
  "write granted": outcome(lambda: open(B + "/writable/new.txt", "w").write("hello")),
  "read back": outcome(lambda: open(B + "/writable/new.txt").read()),
}}
'''


@pytest.mark.parametrize("as_user", ["root", "nobody"])
@pytest.mark.parametrize("how", ["flags", "policy-file"])
def test_granted_folders_are_reachable_and_their_siblings_are_not(as_user, how):
    base = granted_dirs()
    state = base / "state"
    state.mkdir(mode=0o777)
    state.chmod(0o777)
    if how == "flags":
        args = ["--allow-read", str(base / "readable"), "--allow-write", str(base / "writable")]
    else:
        f = base / "policy.toml"
        f.write_text(f'[filesystem]\nallow_read = ["{base}/readable"]\nallow_write = ["{base}/writable"]\n')
        f.chmod(0o644)
        args = ["--policy", str(f)]
    srv = RawServer(state, as_user=as_user, args=args, MCP_BRIDGE_STATE_DIR=str(state))
    try:
        srv.initialize()
        r = srv.call(GRANT_PROBE.format(base=str(base)))["structuredContent"]
        assert r["status"] == "ok", r
        got = ast.literal_eval(r["result"])
        assert got["read granted"] == "ok:'readable data\\n'", got
        assert got["list granted"] == "ok:['data.txt']", got
        assert got["write to read grant"] == "PermissionError", got
        assert got["read sibling"] == "PermissionError", got
        assert got["list parent"] == "PermissionError", got
        assert got["write granted"] == "ok:5", got
        assert got["read back"] == "ok:'hello'", got
        assert (base / "writable/new.txt").read_text() == "hello"
        info = json.loads(srv.request("resources/read", {"uri": "system://info"})["result"]["contents"][0]["text"])
        assert info["sandbox"]["granted"] == {"read_only": [f"{base}/readable"], "read_write": [f"{base}/writable"]}, info
        assert not (base / "readable/new.txt").exists()
    finally:
        srv.close()
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# state dir fallback and startup errors
# ---------------------------------------------------------------------------------------------

def raw_server(env: dict[str, str], log: Path, as_user: str = "root") -> RawServer:
    srv = RawServer.__new__(RawServer)
    prefix = PREFIX_FOR_USER[as_user]
    srv.proc = subprocess.Popen([*prefix, str(IRONCELL), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=open(log, "ab"), env=env)
    srv.next_id = 1
    srv._buf = b""
    return srv


@pytest.mark.parametrize("as_user", ["root", "nobody"])
def test_an_unwritable_home_falls_back_to_a_private_dir_with_a_warning(as_user):
    tmp = Path(tempfile.mkdtemp(prefix="ironcell-fallback-", dir="/var/tmp"))
    tmp.chmod(0o777)
    # HOME under /proc: nobody (nor root) can create ~/.local/state there.
    env = {"PATH": "/usr/bin:/bin", "HOME": "/proc/ironcell-no-home", "TMPDIR": str(tmp), "MCP_BRIDGE_LOG_LEVEL": "warn"}
    log = tmp / "server.log"
    srv = raw_server(env, log, as_user)
    try:
        srv.initialize()
        r = srv.call("import os\nos.getcwd()")["structuredContent"]
        assert r["status"] == "ok", r
        uid = 0 if as_user == "root" else 65534
        fallback = tmp / f"ironcell-{uid}"
        assert str(fallback) in r["result"], r
        st = fallback.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == uid
        text = log.read_text()
        assert "/proc/ironcell-no-home/.local/state/ironcell" in text and str(fallback) in text
        assert "MCP_BRIDGE_STATE_DIR" in text, text
    finally:
        srv.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_fallback_dir_owned_by_someone_else_is_not_used(tmp_path):
    tmp = Path(tempfile.mkdtemp(prefix="ironcell-fallback-", dir="/var/tmp"))
    tmp.chmod(0o777)
    planted = tmp / "ironcell-65534"
    planted.mkdir(mode=0o777)  # root's, world-writable: a trap for nobody
    planted.chmod(0o777)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/proc/nope", "TMPDIR": str(tmp)}
    srv = raw_server(env, tmp_path / "server.log", "nobody")
    try:
        srv.initialize()
        r = srv.call("import os\nos.getcwd()")["structuredContent"]
        assert r["status"] == "ok" and str(planted) + "/" not in r["result"] and str(tmp / "ironcell-65534-") in r["result"], r
        assert os.listdir(planted) == []
    finally:
        srv.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_with_no_usable_state_dir_every_request_gets_an_error_naming_the_path_and_fix(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": "/proc/nope", "MCP_BRIDGE_STATE_DIR": "/proc/ironcell-state",
           "TMPDIR": "/proc/ironcell-tmp"}
    log = tmp_path / "server.log"
    srv = raw_server(env, log)
    r = srv.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                   "clientInfo": {"name": "raw", "version": "0"}}, timeout=30)
    msg = r["error"]["message"]
    assert "/proc/ironcell-state" in msg and "MCP_BRIDGE_STATE_DIR" in msg, r
    r = srv.request("tools/list", timeout=30)
    assert "error" in r
    assert srv.close() != 0
    assert "/proc/ironcell-state" in log.read_text()


# ---------------------------------------------------------------------------------------------
# WSL2: the Windows-side Claude Desktop servers
# ---------------------------------------------------------------------------------------------

FAKE_CMD_EXE = """#!/bin/sh
# Stands in for Windows' cmd.exe: records how it was called, then runs the "Windows" program.
echo "$@" > "$(dirname "$0")/cmd-args.txt"
echo "WSLENV=$WSLENV" >> "$(dirname "$0")/cmd-args.txt"
shift
prog=$1
shift
[ "$prog" = winpython ] && exec {python} "$@"
exit 9
"""


def windows_side(root: Path, interop: str) -> Path:
    servers = {
        "ironcell": {"command": "wsl.exe", "args": ["-d", "Ubuntu", "--exec", str(IRONCELL), "serve"]},
        "inside": {"command": "wsl.exe", "args": ["-d", "Ubuntu", "--exec", sys.executable, str(TEST_SERVER)]},
        "win-tool": {"command": "winpython", "args": [str(TEST_SERVER)], "env": {"SECRET_TOKEN": "t0k"}},
        "other-distro": {"command": "wsl.exe", "args": ["-d", "Debian", "--exec", "python3", "server.py"]},
    }
    cfg = fake_wsl(root, interop=interop, windows_config=json.dumps({"mcpServers": servers}))
    cmd = root / "mnt/c/Windows/System32/cmd.exe"
    cmd.parent.mkdir(parents=True)
    cmd.write_text(FAKE_CMD_EXE.replace("{python}", sys.executable))
    cmd.chmod(0o755)
    return cfg


PROBE_SERVERS = """
d = await runtime.discovered_servers(detailed=True)
(await runtime.discovered_servers(), {s["name"]: s.get("reason") for s in d if not s["available"]})
"""


@pytest.mark.anyio
@pytest.mark.parametrize("interop", ["enabled", "disabled"])
async def test_windows_side_servers_are_used_when_they_can_run_and_listed_with_a_reason_when_not(state_dir, tmp_path, interop):
    from conftest import connect, run

    root = tmp_path / "root"
    windows_side(root, interop)
    env = {"IRONCELL_PROBE_ROOT": str(root), "WSL_DISTRO_NAME": "Ubuntu", "MCP_BRIDGE_STARTUP_TIMEOUT": "20s"}
    async with connect(state_dir, **env) as s:
        r = await run(s, PROBE_SERVERS)
        names, skipped = ast.literal_eval(r["result"])
        assert "other-distro" in skipped and "Debian" in skipped["other-distro"], skipped
        # ironcell itself is listed as skipped, with why; "inside" runs a file of this clone,
        # whose path may well contain "ironcell": that is no reason to skip it.
        assert "ironcell" not in names and "does not proxy itself" in skipped["ironcell"], skipped
        assert "inside" in names
        r = await run(s, "await mcp_inside.pid()")
        assert r["status"] == "ok", r
        if interop == "enabled":
            assert "win-tool" in names, names
            r = await run(s, "await mcp_win_tool.get_env(name='SECRET_TOKEN')")
            assert "'t0k'" in r["result"], r  # the env reached the "Windows" program
            recorded = (root / "mnt/c/Windows/System32/cmd-args.txt").read_text()
            assert recorded.startswith(f"/c winpython {TEST_SERVER}") and "WSLENV=SECRET_TOKEN" in recorded, recorded
        else:
            assert "win-tool" not in names and "interop" in skipped["win-tool"], skipped
        res = await s.read_resource("system://info")
        info = json.loads(res.contents[0].text)
        assert {x["name"] for x in info["mcp"]["skipped"]} >= {"other-distro"}, info["mcp"]
    doc = subprocess.run([str(IRONCELL), "doctor"], capture_output=True, text=True, timeout=120,
                         env=server_env(state_dir, **env))
    assert 'skipped     "other-distro"' in doc.stdout and "Debian" in doc.stdout, doc.stdout
