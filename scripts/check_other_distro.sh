#!/usr/bin/env bash
# Proves the ironcell binary works on a system whose only Python is 3.13 (issue 9): a Debian 13
# "trixie" root filesystem made with debootstrap from the Debian package registry, holding
# python3.13 and libpython3.13 and no other Python, with ironcell run inside it through chroot.
#
# Usage (as root):
#   scripts/check_other_distro.sh [ROOTFS_DIR]
#
#   ROOTFS_DIR              where the rootfs lives (default $IRONCELL_ROOTFS, else
#                           /var/tmp/ironcell-trixie). Made on the first run (about 2 minutes:
#                           debootstrap --variant=minbase --include=python3.13,libpython3.13);
#                           reused by later runs, so reruns take seconds.
#   IRONCELL_BIN            the binary to check (default target/release/ironcell of this repo);
#                           copied into the rootfs as /usr/local/bin/ironcell on every run
#   IRONCELL_DEBIAN_MIRROR  Debian mirror for debootstrap (default: the first non-security URI in
#                           this machine's apt sources, else http://deb.debian.org/debian)
#   IRONCELL_REBUILD=1      throw the rootfs away and make it again
#
# Checks, all inside `chroot ROOTFS_DIR` with a clean environment
# (env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root MCP_BRIDGE_STATE_DIR=/var/tmp/ironcell-state):
#   - the rootfs is trixie, has /usr/bin/python3.13 and libpython3.13, and no other Python
#   - the binary needs no libpython (ldd)
#   - ironcell --version
#   - ironcell doctor exits 0 and reports Python 3.13 (its output is printed)
#   - ironcell exec 'import sys; print(sys.version_info[:2])' prints (3, 13)
#   - ironcell exec: open('/etc/passwd') raises PermissionError inside the sandbox
#   - MCP over stdio: initialize, notifications/initialized, tools/call run_python {"code": "6*7"}
#     answered with 42 (the client is a small Python 3.13 script run inside the chroot)
#   - no process is left running inside the chroot afterwards
# For the checks the rootfs is bound onto itself (so / in the chroot is a mount point) and /proc,
# /dev and /sys are mounted inside it; all are unmounted on exit, also on failure or Ctrl-C.
# Prints PASS/FAIL per check and a summary; exits 1 if any check failed, 2 if it could not run.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${1:-${IRONCELL_ROOTFS:-/var/tmp/ironcell-trixie}}
BIN=${IRONCELL_BIN:-$REPO/target/release/ironcell}
SUITE=trixie
MARKER=.ironcell-check-rootfs
STATE=/var/tmp/ironcell-state
CHROOT_PATH=/usr/local/bin:/usr/bin:/bin
STEP_TIMEOUT=${IRONCELL_CHECK_TIMEOUT:-180}

die() { echo "check_other_distro: $*" >&2; exit 2; }

[[ $(id -u) == 0 ]] || die "must run as root (debootstrap, mount, chroot)"
for tool in debootstrap chroot mount umount timeout; do
  command -v "$tool" >/dev/null || die "needs $tool (apt-get install debootstrap coreutils mount)"
done
CHROOT=$(command -v chroot)
[[ -x $BIN ]] || die "no ironcell binary at $BIN (cargo build --release, or set IRONCELL_BIN)"
[[ $ROOT == /* ]] || ROOT=$PWD/$ROOT
ROOT=${ROOT%/}
[[ $ROOT != "" && $ROOT != / ]] || die "refusing to use / as the rootfs"

# The mirror apt uses on this machine: the first URI of a non-security source.
apt_mirror() {
  local uri=""
  if compgen -G '/etc/apt/sources.list.d/*.sources' >/dev/null; then
    uri=$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/) { print $i; exit } }' \
      /etc/apt/sources.list.d/*.sources)
  fi
  if [[ -z $uri && -r /etc/apt/sources.list ]]; then
    uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {
            if ($i !~ /security/) { print $i; exit } else break } }' /etc/apt/sources.list)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR=${IRONCELL_DEBIAN_MIRROR:-$(apt_mirror)}

# Every mount point at or below $1, deepest first (mountinfo field 5 is the mount point).
mounts_under() {
  awk -v p="$1" '$5 == p || index($5, p "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r
}
unmount_under() {
  local m
  while read -r m; do
    [[ -n $m ]] || continue
    umount "$m" 2>/dev/null || umount -l "$m" || echo "warning: could not unmount $m" >&2
  done < <(mounts_under "$1")
}

# ---------------------------------------------------------------------------------- rootfs
rootfs_complete() {
  [[ -f $ROOT/$MARKER && ! -d $ROOT/debootstrap && -x $ROOT/usr/bin/python3.13 ]]
}

if [[ ${IRONCELL_REBUILD:-0} == 1 && -d $ROOT ]]; then
  [[ -f $ROOT/$MARKER ]] || die "$ROOT was not made by this script (no $MARKER); not deleting it"
  echo "== IRONCELL_REBUILD=1: removing $ROOT"
  unmount_under "$ROOT"
  rm -rf --one-file-system "$ROOT"
fi

DEBOOTSTRAP_SECS=reused
if rootfs_complete; then
  echo "== reusing the $SUITE rootfs at $ROOT ($(cat "$ROOT/$MARKER"))"
else
  if [[ -e $ROOT ]]; then
    die "$ROOT exists but is no complete rootfs made by this script; remove it or pick another directory"
  fi
  PARTIAL=$ROOT.partial
  if [[ -e $PARTIAL ]]; then
    echo "== removing the unfinished $PARTIAL of an earlier run"
    unmount_under "$PARTIAL"
    rm -rf --one-file-system "$PARTIAL"
  fi
  mkdir -p "$PARTIAL"
  echo "== debootstrap --variant=minbase --include=python3.13,libpython3.13 $SUITE $PARTIAL $MIRROR"
  start=$SECONDS
  if ! debootstrap --variant=minbase --include=python3.13,libpython3.13 \
      "$SUITE" "$PARTIAL" "$MIRROR" >"$PARTIAL.log" 2>&1; then
    tail -n 30 "$PARTIAL.log" >&2
    unmount_under "$PARTIAL"
    die "debootstrap failed (log: $PARTIAL.log)"
  fi
  DEBOOTSTRAP_SECS=$((SECONDS - start))
  unmount_under "$PARTIAL"
  echo "suite=$SUITE mirror=$MIRROR made=$(date -u +%FT%TZ)" >"$PARTIAL/$MARKER"
  mv "$PARTIAL" "$ROOT"
  mv "$PARTIAL.log" "$ROOT.debootstrap.log"
  echo "== debootstrap done in ${DEBOOTSTRAP_SECS}s (log: $ROOT.debootstrap.log)"
fi

# ---------------------------------------------------------------------------------- mounts
MOUNTED=()
# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  local rc=$? i pid
  # Processes still inside the chroot are ours (this script started them); end them by pid so
  # the mounts can go.
  for pid in $(leftover_pids); do kill -KILL "$pid" 2>/dev/null || true; done
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do unmount_under "${MOUNTED[i]}"; done
  if [[ -n $(mounts_under "$ROOT") ]]; then
    echo "warning: still mounted under $ROOT: $(mounts_under "$ROOT" | tr '\n' ' ')" >&2
  fi
  exit "$rc"
}
leftover_pids() {
  local p
  for p in /proc/[0-9]*; do
    [[ $(readlink "$p/root" 2>/dev/null) == "$ROOT" ]] && echo "${p#/proc/}"
  done
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

unmount_under "$ROOT"  # leftovers of a run that was killed before its trap ran
# The rootfs bound onto itself, so that / inside the chroot is a mount point as on a real system
# (ironcell makes its mounts private for a session's own /tmp; that needs / to be a mount).
mount --bind "$ROOT" "$ROOT" && MOUNTED+=("$ROOT")
mount --make-private "$ROOT"
mount -t proc proc "$ROOT/proc" && MOUNTED+=("$ROOT/proc")
mount --bind /dev "$ROOT/dev" && MOUNTED+=("$ROOT/dev")
# /sys with its submounts (the pids cgroup that caps a worker's threads lives under it).
mount --rbind /sys "$ROOT/sys" && MOUNTED+=("$ROOT/sys")
mount --make-rslave "$ROOT/sys"

# ---------------------------------------------------------------------------------- checks
install -m 0755 "$BIN" "$ROOT/usr/local/bin/ironcell"
rm -rf "${ROOT:?}$STATE"
echo "== binary: $BIN ($(stat -c '%s bytes, built %y' "$BIN"))"
echo "   sha256 $(sha256sum "$BIN" | cut -d' ' -f1), copied to $ROOT/usr/local/bin/ironcell"
echo "== mirror: $MIRROR"

in_root() {
  timeout --kill-after=10 "$STEP_TIMEOUT" env -i PATH="$CHROOT_PATH" HOME=/root \
    MCP_BRIDGE_STATE_DIR="$STATE" "$CHROOT" "$ROOT" "$@"
}

RESULTS=()
FAILED=0
OUT=""
# check NAME CONDITION-FUNCTION: prints the outcome and records it.
record() {
  local name=$1 ok=$2 why=${3:-}
  if [[ $ok == 1 ]]; then
    RESULTS+=("PASS  $name")
    echo "-- PASS: $name"
  else
    RESULTS+=("FAIL  $name${why:+ ($why)}")
    echo "-- FAIL: $name${why:+ ($why)}"
    FAILED=1
  fi
}
# run_in_root LABEL CMD...: runs CMD in the chroot, shows its output, leaves it in OUT and the
# exit status in RC.
RC=0
run_in_root() {
  local label=$1; shift
  echo
  echo "== $label"
  echo "\$ chroot $ROOT $*"
  set +e
  OUT=$(in_root "$@" 2>&1 <"${STDIN_FILE:-/dev/null}")
  RC=$?
  set -e
  printf '%s\n' "$OUT" | sed 's/^/   | /'
  echo "   (exit $RC)"
}

echo
echo "== rootfs contents"
# shellcheck disable=SC1091  # the rootfs's os-release
codename=$(. "$ROOT/etc/os-release" && echo "${VERSION_CODENAME:-?} ($PRETTY_NAME)")
echo "   os-release: $codename"
pythons=$(cd "$ROOT" && { ls -d usr/bin/python* usr/local/bin/python* usr/lib/python3.* \
  usr/lib/x86_64-linux-gnu/libpython* 2>/dev/null || true; })
printf '%s\n' "$pythons" | sed 's/^/   /'
run_in_root "python packages installed (dpkg)" sh -c "dpkg-query -W -f '\${Package} \${Version}\n' | grep -i python"
[[ $codename == trixie* ]] && ok=1 || ok=0
record "rootfs is Debian 13 trixie" "$ok" "$codename"
others=$(printf '%s\n' "$pythons" | grep -E 'python3\.([0-9]|1[0-24-9])([^0-9]|$)|python2' || true)
if [[ -x $ROOT/usr/bin/python3.13 && -e $ROOT/usr/lib/x86_64-linux-gnu/libpython3.13.so.1.0 \
      && -z $others && ! -e $ROOT/usr/bin/python3.11 ]]; then
  ok=1
else
  ok=0
fi
record "rootfs has python3.13 + libpython3.13 and no other Python (no python3.11)" $ok \
  "${others:+others: $(tr '\n' ' ' <<<"$others")}"

run_in_root "ldd ironcell" ldd /usr/local/bin/ironcell
[[ $RC == 0 && $OUT != *libpython* ]] && ok=1 || ok=0
record "binary runs on trixie's libc and links no libpython" $ok

run_in_root "ironcell --version" ironcell --version
[[ $RC == 0 && $OUT == ironcell* ]] && ok=1 || ok=0
record "ironcell --version" $ok

run_in_root "ironcell doctor" ironcell doctor
if [[ $RC == 0 ]] && grep -qE '^python .*python3\.13' <<<"$OUT" \
    && grep -qE '^ +version +3\.13\.' <<<"$OUT"; then ok=1; else ok=0; fi
record "ironcell doctor exits 0 and reports Python 3.13" $ok "exit $RC"

run_in_root "smoke run" ironcell exec 'import sys; print(sys.version_info[:2])'
[[ $RC == 0 ]] && grep -qx '(3, 13)' <<<"$OUT" && ok=1 || ok=0
record "ironcell exec prints (3, 13)" $ok "exit $RC"

SANDBOX_CODE=$(mktemp)
cat >"$SANDBOX_CODE" <<'EOF'
try:
    open('/etc/passwd').read()
except PermissionError:
    print('denied')
else:
    print('READABLE: the sandbox let /etc/passwd be read')
EOF
STDIN_FILE=$SANDBOX_CODE run_in_root "sandbox: open('/etc/passwd') (code on stdin)" ironcell exec -
rm -f "$SANDBOX_CODE"
[[ $RC == 0 ]] && grep -qx 'denied' <<<"$OUT" && ok=1 || ok=0
record "sandbox refuses open('/etc/passwd') with PermissionError" $ok "exit $RC"

# A minimal MCP client over stdio, run by the chroot's python3.13; it starts `ironcell serve`.
mkdir -p "$ROOT/usr/local/share/ironcell-check"
cat >"$ROOT/usr/local/share/ironcell-check/mcp_roundtrip.py" <<'EOF'
import json, queue, subprocess, sys, threading

server = subprocess.Popen(["ironcell", "serve"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, bufsize=1)
lines = queue.Queue()
threading.Thread(target=lambda: [lines.put(l) for l in server.stdout] + [lines.put(None)],
                 daemon=True).start()

def send(msg):
    print(">>", json.dumps(msg))
    server.stdin.write(json.dumps(msg) + "\n")
    server.stdin.flush()

def answer(msg_id, timeout=60):
    while True:
        line = lines.get(timeout=timeout)
        if line is None:
            sys.exit("server closed stdout before answering id %s" % msg_id)
        print("<<", line.rstrip()[:600])
        msg = json.loads(line)
        if msg.get("id") == msg_id and ("result" in msg or "error" in msg):
            return msg

send({"jsonrpc": "2.0", "id": 1, "method": "initialize",
      "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                 "clientInfo": {"name": "check_other_distro", "version": "1"}}})
init = answer(1)
send({"jsonrpc": "2.0", "method": "notifications/initialized"})
send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
      "params": {"name": "run_python", "arguments": {"code": "6*7"}}})
call = answer(2)
server.stdin.close()
rc = server.wait(timeout=30)
print("server exit status", rc)
result = call.get("result", {})
text = " ".join(c.get("text", "") for c in result.get("content", []))
ok = (init.get("result", {}).get("serverInfo", {}).get("name") == "ironcell"
      and not result.get("isError") and "42" in text and rc == 0)
print("MCP round trip:", "ok" if ok else "FAILED", repr(text))
sys.exit(0 if ok else 1)
EOF
run_in_root "MCP round trip over stdio (python3.13 client -> ironcell serve)" \
  python3.13 /usr/local/share/ironcell-check/mcp_roundtrip.py
[[ $RC == 0 ]] && grep -q '^MCP round trip: ok' <<<"$OUT" && ok=1 || ok=0
record "MCP initialize + tools/call run_python 6*7 answers 42" $ok "exit $RC"

sleep 1
left=$(leftover_pids | tr '\n' ' ')
if [[ -z $left ]]; then ok=1; else
  ok=0
  for pid in $left; do echo "   left running: $pid $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)"; done
fi
record "no process left running inside the chroot" $ok "${left:+pids $left}"

# ---------------------------------------------------------------------------------- summary
echo
echo "================ check_other_distro summary ================"
if [[ $DEBOOTSTRAP_SECS == reused ]]; then made="reused"; else made="debootstrap ${DEBOOTSTRAP_SECS}s"; fi
echo "rootfs   $ROOT ($SUITE, $made)"
echo "binary   $BIN"
printf '%s\n' "${RESULTS[@]}"
if [[ $FAILED == 0 ]]; then
  echo "PASS: ironcell works on a Python-3.13-only Debian 13 system (${SECONDS}s)"
else
  echo "FAIL: see the failed checks above (${SECONDS}s)"
fi
exit "$FAILED"
