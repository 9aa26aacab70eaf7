#!/usr/bin/env bash
# Runs every test: formatting, clippy, Rust unit tests, and the end-to-end suite that starts the
# real binary and drives it with real MCP clients (the official Python SDK) and real peers.
# Installs the test peers on first use (scripts/install_test_peers.sh; needs npm and PyPI once).
#   IRONCELL_HARNESS  where the peers live (default ~/.cache/mcp-harness)
#   PYTEST_ARGS       extra pytest arguments, e.g. "-k timeout -x"
set -euo pipefail
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
echo "== cargo fmt --check"
cargo fmt --all -- --check
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
echo "== end-to-end (real binary, official MCP SDK)"
cargo build --release
export IRONCELL_BIN=$PWD/target/release/ironcell
# shellcheck disable=SC2086
"$H/venv/bin/python" -m pytest -q tests/e2e ${PYTEST_ARGS:-}
