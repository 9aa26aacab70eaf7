#!/usr/bin/env bash
# Runs every test: formatting, clippy, Rust unit tests, the mcp module's plain-CPython tests,
# and the end-to-end suite that starts the real binary and drives it with real MCP clients (the
# official Python SDK) and real peers. Installs the test peers (and HAProxy) on first use
# (scripts/install_test_peers.sh; needs npm and PyPI once).
#   --quick           the quick tier: formatting, ruff, the size check (scripts/check_sizes.py),
#                     the host's, the core's and the extension's unit tests (the MCP handler's
#                     among them), the mcp module's tests, and one smoke file of the end-to-end
#                     suite (tests/e2e/test_core.py). No clippy, no lockdown or sandbox attack
#                     suites: run the whole thing before a commit.
#   IRONCELL_HARNESS  where the peers live (default ~/.cache/mcp-harness)
#   PYTEST_ARGS       extra pytest arguments, e.g. "-k timeout -x"
set -euo pipefail
QUICK=
if [[ "${1:-}" == "--quick" ]]; then QUICK=1; shift; fi
if [[ $# -gt 0 ]]; then echo "usage: scripts/test.sh [--quick]" >&2; exit 2; fi
cd "$(dirname "$0")/.."
H=${IRONCELL_HARNESS:-$HOME/.cache/mcp-harness}
if [[ ! -x "$H/venv/bin/python" ]] || ! "$H/venv/bin/python" -c 'import mcp, pytest' 2>/dev/null; then
  echo "== installing test peers into $H"
  bash scripts/install_test_peers.sh "$H"
  "$H/venv/bin/pip" install -q 'pytest==9.2.0'
fi
echo "== ruff (the Python in python/, scripts/, tests/)"
if [[ ! -x "$H/venv/bin/ruff" ]]; then "$H/venv/bin/pip" install -q 'ruff==0.14.6'; fi
"$H/venv/bin/ruff" check python scripts tests
echo "== sizes (no .rs file over 700 lines of code before its tests, no function over 80 lines without its reason)"
python3 scripts/check_sizes.py
# The replica tests run Debian's HAProxy and validate deploy/kubernetes (tests/e2e/test_replicas.py).
if [[ ! -x "$H/venv/bin/kubernetes-validate" ]]; then "$H/venv/bin/pip" install -q 'kubernetes-validate==1.37.0'; fi
if [[ -z "$QUICK" ]] && ! command -v haproxy >/dev/null && [[ ! -x /usr/sbin/haproxy ]]; then
  echo "== installing HAProxy (the load balancer tests/e2e/test_replicas.py runs)"
  sudo=(); ((EUID == 0)) || sudo=(sudo)
  if command -v apt-get >/dev/null; then "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq haproxy
  elif command -v dnf >/dev/null; then "${sudo[@]}" dnf install -y -q haproxy
  elif command -v apk >/dev/null; then "${sudo[@]}" apk add -q haproxy
  else echo "no apt-get, dnf or apk here: install haproxy yourself (test_replicas.py needs it)" >&2
  fi
fi
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== the mcp module's pure logic (plain CPython, no host)"
"$H/venv/bin/python" -m pytest -q tests/unit
if [[ -n "$QUICK" ]]; then
  echo "== cargo test (host and core unit tests)"
  CARGO_TARGET_DIR=target/unit-tests cargo test --release -p ironcell -p ironcell-core --lib
  echo "== cargo test (the Python extension's pure logic, no interpreter)"
  CARGO_TARGET_DIR=target/python-tests cargo test --release -p ironcell-python --lib
  echo "== end-to-end smoke (tests/e2e/test_core.py)"
  cargo build --release
  export IRONCELL_BIN=$PWD/target/release/ironcell
  # shellcheck disable=SC2086
  "$H/venv/bin/python" -m pytest -q tests/e2e/test_core.py ${PYTEST_ARGS:-}
  exit 0
fi
# clippy and the unit tests each build in a target dir of their own. In one dir they rebuilt
# ironcell three times a run with nothing changed (~3.5 min): the Python extension build.rs
# embeds is a build-dependency whose unit keeps one fingerprint while the ironcell-core it is
# built against differs between `clippy --workspace`, `test --workspace --exclude …` and
# `build` (cargo's log: "dirty: UnitDependencyInfoChanged"), so each command rebuilt it, then
# ran build.rs again and rebuilt ironcell. Apart, each stays built.
echo "== cargo clippy"
CARGO_TARGET_DIR=target/clippy cargo clippy --release --workspace --all-targets -- -D warnings
echo "== cargo test"
CARGO_TARGET_DIR=target/unit-tests cargo test --release --workspace --exclude ironcell-python
# The extension's tests link no libpython: its pure logic (the bridge's queue and frames, the
# scrubbing allocator, the arena fallback). In a target dir of their own, so this build of the
# extension (without ironcell-core's `host` feature) never meets the libironcell_python.so the
# host's build.rs embeds and watches (see the rebuilds above).
CARGO_TARGET_DIR=target/python-tests cargo test --release -p ironcell-python --lib
echo "== end-to-end (real binary, official MCP SDK)"
cargo build --release
export IRONCELL_BIN=$PWD/target/release/ironcell
# shellcheck disable=SC2086
"$H/venv/bin/python" -m pytest -q tests/e2e ${PYTEST_ARGS:-}
