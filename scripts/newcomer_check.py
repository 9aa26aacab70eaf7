#!/usr/bin/env python3
"""Follows README.md as a newcomer would: a fresh clone of this checkout's HEAD, a fresh HOME
(with Claude Code "installed", i.e. a ~/.claude folder, and a ~/project folder), and the shell
commands of README's "Try it", "Connect your client" and "First things to try" sections, read
from the clone's README.md (never copied here), run one by one from the clone's root.

Each must exit 0, and what README says it shows must be there. `scripts/test.sh` is not run a
second time: CI (.ci/run) has just run it, so this checks that .ci/run does run README's
command.

Cheap: the clone's target/ is seeded with a copy of this checkout's (the registry crates stay
built; only ironcell's own crates build again, as the clone's paths differ), and is removed at
the end. This checkout's target/ is never written.

usage: scripts/newcomer_check.py [--keep]   (--keep leaves the work dir for a look)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("Try it", "Connect your client", "First things to try")


def readme_commands(readme: str) -> list[tuple[str, str]]:
    """(section, command) for each line of the ```sh blocks of SECTIONS, comments removed."""
    out = []
    for section in re.split(r"^## ", readme, flags=re.M)[1:]:
        title = section.split("\n", 1)[0].strip()
        if title not in SECTIONS:
            continue
        for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S):
            for line in block.splitlines():
                command = re.split(r"\s{2,}#\s", line, maxsplit=1)[0].strip()
                if command and not command.startswith("#"):
                    out.append((title, command))
    return out


def expect(command: str, home: Path) -> list[str]:
    """What README says a command shows (checked beyond its exit status)."""
    if command.endswith("-- demo"):
        return ["Tools: run_python", "PermissionError", "Next steps:"]
    if "setup --dry-run" in command and "--tools" not in command:
        return [f"+++ {home}/.claude.json", "would install"]
    if "doctor --tools" in command:
        return ["local tools   2 loaded: analyze_text_complexity, safe_divide_numbers"]
    if command.endswith(" doctor"):
        return ["verdict       ready"]
    if "discovered_servers()" in command:
        return ["'hello'"]
    if "mcp_hello.greet" in command:
        return ["Hello, you!"]
    if "sys.version" in command:
        return ["=> '3."]
    return []


def main() -> int:
    keep = "--keep" in sys.argv
    work = Path(tempfile.mkdtemp(prefix="ironcell-newcomer-", dir="/var/tmp"))
    clone, home = work / "ironcell", work / "home"
    failures = []
    try:
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        commands = readme_commands((clone / "README.md").read_text())
        if not any(c == "scripts/test.sh" for _, c in commands):
            failures.append("README's 'Try it' has no `scripts/test.sh`")
        if "scripts/test.sh" not in (clone / ".ci/run").read_text():
            failures.append(".ci/run does not run README's `scripts/test.sh`")
        print(f"== seeding {clone}/target from {REPO}/target", flush=True)
        if (REPO / "target/release").is_dir():
            shutil.copytree(REPO / "target/release", clone / "target/release", symlinks=True,
                            ignore=shutil.ignore_patterns("incremental", "ironcell", "ironcell-*"))
            (clone / "target/CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n")
        (home / ".claude").mkdir(parents=True)
        (home / "project").mkdir()
        env = {
            "HOME": str(home),
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            # The toolchain and crate cache where they are; everything else of the user's is not.
            "CARGO_HOME": os.environ.get("CARGO_HOME", str(Path.home() / ".cargo")),
            "RUSTUP_HOME": os.environ.get("RUSTUP_HOME", str(Path.home() / ".rustup")),
            "LANG": "C.UTF-8",
        }
        for section, command in commands:
            if command == "scripts/test.sh":
                print(f"== [{section}] {command}: not run again (.ci/run has just run it)")
                continue
            print(f"== [{section}] {command}", flush=True)
            p = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                               stdin=subprocess.DEVNULL, timeout=3600)
            shown = p.stdout + p.stderr
            missing = [s for s in expect(command, home) if s not in shown]
            if p.returncode != 0 or missing:
                failures.append(f"{command}: exit {p.returncode}, missing {missing}\n{shown[-3000:]}")
                print(f"   FAILED (exit {p.returncode}; missing {missing})")
            else:
                print(f"   ok ({len(shown.splitlines())} lines of output)")
        # What the setup commands left: an entry that starts a binary outside the clone.
        entry = json.loads((home / ".claude.json").read_text())["mcpServers"]["ironcell"]
        installed = home / ".local/bin/ironcell"
        if entry["command"] != str(installed):
            failures.append(f"setup configured {entry['command']}, not the installed {installed}")
        shutil.rmtree(clone / "target")
        v = subprocess.run([str(installed), "--version"], capture_output=True, text=True, env=env)
        if v.returncode != 0:
            failures.append(f"the installed binary does not run once the clone's target/ is gone: {v}")
    finally:
        if keep:
            print(f"(kept {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        print(f"\nFAILED: {f}")
    print("\nnewcomer check:", "FAILED" if failures else "every README command worked")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
