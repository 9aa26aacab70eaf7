#!/usr/bin/env bash
# Proves the ironcell binary works on a system whose only Python is not the host's: a Debian root
# filesystem made with debootstrap from the Debian package registry, holding one Python and its
# libpython and no other Python, with ironcell run inside it through chroot. Three suites:
#   trixie (default)  Debian 13, python3.13 only (issue 9)
#   sid               Debian unstable, python3.14 only (issue 44): 3.14 defaults multiprocessing
#                     to the `forkserver` start method, which execs a server process. This root
#                     also has Debian's `python3` package (/usr/bin/python3 -> python3.14), which
#                     is how ironcell finds it: its search by name stops at python3.13.
#   noble             Ubuntu 24.04 LTS, python3.12 only (where most Claude Code users on Linux
#                     are), from the Ubuntu archive; Debian's debootstrap has no noble script, so
#                     Ubuntu's common one (gutsy) is used, with the archive key taken from
#                     noble's ubuntu-keyring package. (Ubuntu's AppArmor limit on user namespaces
#                     is a host policy, not the root's: it is not exercised here.)
#
# Usage (as root):
#   scripts/check_other_distro.sh [--suite trixie|sid|noble] [ROOTFS_DIR]
#
#   ROOTFS_DIR              where the rootfs lives (default $IRONCELL_ROOTFS, else
#                           /var/tmp/ironcell-SUITE). Made on the first run (about 2 minutes:
#                           debootstrap --variant=minbase --include=python3.X,libpython3.X);
#                           reused by later runs, so reruns take seconds.
#   IRONCELL_BIN            the binary to check (default target/release/ironcell of this repo);
#                           copied into the rootfs as /usr/local/bin/ironcell on every run
#   IRONCELL_DEBIAN_MIRROR  Debian mirror for debootstrap (default: the first non-security URI in
#                           this machine's apt sources, else http://deb.debian.org/debian)
#   IRONCELL_UBUNTU_MIRROR  Ubuntu mirror for --suite noble (default http://archive.ubuntu.com/ubuntu)
#   IRONCELL_REBUILD=1      throw the rootfs away and make it again
#
# Checks, all inside `chroot ROOTFS_DIR` with a clean environment
# (env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root MCP_BRIDGE_STATE_DIR=/var/tmp/ironcell-state):
#   - the rootfs is the suite asked for, has /usr/bin/python3.X and libpython3.X, no other Python
#     (a /usr/bin/python3 there must lead to python3.X)
#   - the binary needs no libpython (ldd)
#   - ironcell --version
#   - ironcell doctor exits 0 and reports Python 3.X (its output is printed)
#   - ironcell exec 'import sys; print(sys.version_info[:2])' prints (3, X)
#   - ironcell exec: open('/etc/passwd') raises PermissionError inside the sandbox
#   - MCP over stdio: initialize, notifications/initialized, tools/call run_python {"code": "6*7"}
#     answered with 42 (the client is a small Python 3.X script run inside the chroot)
#   - process pools as written, each in a session of its own: multiprocessing.get_start_method()
#     is `fork`; mp.Pool(2).map(abs, [-1, -2]) returns [1, 2]; concurrent.futures'
#     ProcessPoolExecutor(2).map(abs, [-3, -4]) returns [3, 4]; pools asked for `forkserver`
#     or `spawn` by name work too (the runner gives them `fork`); on 3.14+ also that the same
#     Python outside the sandbox defaults to `forkserver` (so the pool checks test the change)
#   - no process is left running inside the chroot afterwards
# For the checks the rootfs is bound onto itself (so / in the chroot is a mount point) and /proc,
# /dev and /sys are mounted inside it; all are unmounted on exit, also on failure or Ctrl-C.
# Prints PASS/FAIL per check and a summary; exits 1 if any check failed, 2 if it could not run.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "check_other_distro: $*" >&2; exit 2; }

SUITE=trixie
ARGS=()
while (($#)); do
  case $1 in
    --suite) (($# >= 2)) || die "--suite needs a value (trixie, sid or noble)"; SUITE=$2; shift 2 ;;
    --suite=*) SUITE=${1#--suite=}; shift ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    -*) die "unknown option $1 (usage: $0 [--suite trixie|sid|noble] [ROOTFS_DIR])" ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
((${#ARGS[@]} <= 1)) || die "one ROOTFS_DIR at most (usage: $0 [--suite trixie|sid|noble] [ROOTFS_DIR])"
# Per suite: its only Python, the packages debootstrap adds, how its os-release names it.
case $SUITE in
  trixie) PYVER=3.13 EXTRA="" DISTRO="Debian 13 trixie" OS_MATCH='trixie*' ;;
  sid) PYVER=3.14 EXTRA="" DISTRO="Debian sid (unstable)" OS_MATCH='*/sid*' ;;
  noble) PYVER=3.12 EXTRA="t64" DISTRO="Ubuntu 24.04 noble" OS_MATCH='noble (Ubuntu 24.04*' ;;
  *) die "unknown suite '$SUITE' (trixie, sid or noble)" ;;
esac
PYTHON=python$PYVER
INCLUDE=$PYTHON,lib$PYTHON$EXTRA
PYRE=${PYVER/./\\.}  # the version as a regular expression
ROOT=${ARGS[0]:-${IRONCELL_ROOTFS:-/var/tmp/ironcell-$SUITE}}
BIN=${IRONCELL_BIN:-$REPO/target/release/ironcell}
MARKER=.ironcell-check-rootfs
STATE=/var/tmp/ironcell-state
CHROOT_PATH=/usr/local/bin:/usr/bin:/bin
STEP_TIMEOUT=${IRONCELL_CHECK_TIMEOUT:-180}

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
DEBOOTSTRAP_ARGS=()
if [[ $SUITE == noble ]]; then
  MIRROR=${IRONCELL_UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
  DEBOOTSTRAP_SCRIPT=/usr/share/debootstrap/scripts/gutsy
  [[ -f $DEBOOTSTRAP_SCRIPT ]] || die "debootstrap has no Ubuntu script ($DEBOOTSTRAP_SCRIPT)"
fi

# noble's archive key, from its ubuntu-keyring package (Debian ships none): the package's path
# comes from the archive's package index; the key then checks the Release file debootstrap reads.
ubuntu_keyring() {
  local dir=$1 deb
  command -v xz >/dev/null || die "--suite noble needs xz (apt-get install xz-utils)"
  deb=$(curl -fsS "$MIRROR/dists/noble/main/binary-amd64/Packages.xz" | xz -dc \
    | awk '/^Package: / { p = ($2 == "ubuntu-keyring") } p && /^Filename:/ && !n++ { print $2 }') \
    || die "could not read noble's package index from $MIRROR"
  [[ -n $deb ]] || die "noble's package index names no ubuntu-keyring"
  curl -fsS -o "$dir/keyring.deb" "$MIRROR/$deb" || die "could not fetch $MIRROR/$deb"
  dpkg-deb -x "$dir/keyring.deb" "$dir/x"
  [[ -f $dir/x/usr/share/keyrings/ubuntu-archive-keyring.gpg ]] || die "$deb holds no ubuntu-archive-keyring.gpg"
  echo "$dir/x/usr/share/keyrings/ubuntu-archive-keyring.gpg"
}

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
  [[ -f $ROOT/$MARKER && ! -d $ROOT/debootstrap && -x $ROOT/usr/bin/$PYTHON ]] \
    && grep -q "^suite=$SUITE " "$ROOT/$MARKER" \
    && { [[ $INCLUDE != *,python3 ]] || [[ -e $ROOT/usr/bin/python3 ]]; }
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
    die "$ROOT exists but is no complete $SUITE rootfs made by this script (with $INCLUDE); remove it, set IRONCELL_REBUILD=1 if this script made it, or pick another directory"
  fi
  PARTIAL=$ROOT.partial
  if [[ -e $PARTIAL ]]; then
    echo "== removing the unfinished $PARTIAL of an earlier run"
    unmount_under "$PARTIAL"
    rm -rf --one-file-system "$PARTIAL"
  fi
  mkdir -p "$PARTIAL"
  echo "== debootstrap --variant=minbase --include=$INCLUDE $SUITE $PARTIAL $MIRROR"
  start=$SECONDS
  if [[ $SUITE == noble ]]; then
    mkdir -p "$PARTIAL.keyring"
    keyring=$(ubuntu_keyring "$PARTIAL.keyring") || exit 2
    DEBOOTSTRAP_ARGS=(--keyring="$keyring" --components=main)
  fi
  if ! debootstrap --variant=minbase --include="$INCLUDE" "${DEBOOTSTRAP_ARGS[@]}" \
      "$SUITE" "$PARTIAL" "$MIRROR" ${DEBOOTSTRAP_SCRIPT:+"$DEBOOTSTRAP_SCRIPT"} >"$PARTIAL.log" 2>&1; then
    tail -n 30 "$PARTIAL.log" >&2
    unmount_under "$PARTIAL"
    die "debootstrap failed (log: $PARTIAL.log)"
  fi
  DEBOOTSTRAP_SECS=$((SECONDS - start))
  unmount_under "$PARTIAL"
  echo "suite=$SUITE mirror=$MIRROR made=$(date -u +%FT%TZ)" >"$PARTIAL/$MARKER"
  mv "$PARTIAL" "$ROOT"
  mv "$PARTIAL.log" "$ROOT.debootstrap.log"
  rm -rf "$PARTIAL.keyring"
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
# shellcheck disable=SC2053  # OS_MATCH is a glob
[[ $codename == $OS_MATCH ]] && ok=1 || ok=0
record "rootfs is $DISTRO" "$ok" "$codename"
others=$(printf '%s\n' "$pythons" | grep -E 'python(2|3\.[0-9]+)' \
  | grep -vE "python$PYRE([^0-9]|$)" || true)
python3_to=$(readlink "$ROOT/usr/bin/python3" 2>/dev/null || true)
echo "   usr/bin/python3 -> ${python3_to:-(none)}"
if [[ -x $ROOT/usr/bin/$PYTHON && -e $ROOT/usr/lib/x86_64-linux-gnu/lib$PYTHON.so.1.0 \
      && -z $others && ! -e $ROOT/usr/bin/python3.11 \
      && ( ! -e $ROOT/usr/bin/python3 || $python3_to == "$PYTHON" ) ]]; then
  ok=1
else
  ok=0
fi
record "rootfs has $PYTHON + lib$PYTHON and no other Python (no python3.11)" $ok \
  "${others:+others: $(tr '\n' ' ' <<<"$others")}"

run_in_root "ldd ironcell" ldd /usr/local/bin/ironcell
[[ $RC == 0 && $OUT != *libpython* ]] && ok=1 || ok=0
record "binary runs on $SUITE's libc and links no libpython" $ok

run_in_root "ironcell --version" ironcell --version
[[ $RC == 0 && $OUT == ironcell* ]] && ok=1 || ok=0
record "ironcell --version" $ok

run_in_root "ironcell doctor" ironcell doctor
if [[ $RC == 0 ]] && grep -qE "^python +/usr/bin/python3(\\.${PYVER#3.})? " <<<"$OUT" \
    && grep -qE "^ +version +$PYRE\\." <<<"$OUT"; then ok=1; else ok=0; fi
record "ironcell doctor exits 0 and reports Python $PYVER" $ok "exit $RC"

run_in_root "smoke run" ironcell exec 'import sys; print(sys.version_info[:2])'
[[ $RC == 0 ]] && grep -qx "(3, ${PYVER#3.})" <<<"$OUT" && ok=1 || ok=0
record "ironcell exec prints (3, ${PYVER#3.})" $ok "exit $RC"

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

# A minimal MCP client over stdio, run by the chroot's Python; it starts `ironcell serve`.
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
run_in_root "MCP round trip over stdio ($PYTHON client -> ironcell serve)" \
  "$PYTHON" /usr/local/share/ironcell-check/mcp_roundtrip.py
[[ $RC == 0 ]] && grep -q '^MCP round trip: ok' <<<"$OUT" && ok=1 || ok=0
record "MCP initialize + tools/call run_python 6*7 answers 42" $ok "exit $RC"

# Process pools as written (issue 44), each in a session of its own. Sessions may fork children;
# `spawn` and `forkserver` (3.14's default) exec an interpreter, which the sandbox refuses, so the
# runner hands out `fork` for them. Each pool also answers from a process other than the session.
if ((${PYVER#3.} >= 14)); then
  run_in_root "$PYTHON outside the sandbox: its default start method" \
    "$PYTHON" -c 'import multiprocessing as mp; print(mp.get_start_method())'
  [[ $RC == 0 && $OUT == forkserver ]] && ok=1 || ok=0
  record "$PYTHON outside the sandbox defaults multiprocessing to forkserver" $ok "exit $RC"
fi

run_in_root "session: multiprocessing.get_start_method()" ironcell exec \
  'import multiprocessing as mp; print("start method:", mp.get_start_method())'
[[ $RC == 0 ]] && grep -qx 'start method: fork' <<<"$OUT" && ok=1 || ok=0
record "multiprocessing.get_start_method() in a session is fork" $ok "exit $RC"

run_in_root "session: mp.Pool(2).map(abs, [-1, -2])" ironcell exec 'import multiprocessing as mp, os
print("pool:", mp.Pool(2).map(abs, [-1, -2]))
with mp.Pool(2) as pool:
    print("pool child is another process:", pool.apply(os.getpid) != os.getpid())'
[[ $RC == 0 ]] && grep -qx 'pool: \[1, 2\]' <<<"$OUT" \
  && grep -qx 'pool child is another process: True' <<<"$OUT" && ok=1 || ok=0
record "plain mp.Pool(2).map(abs, [-1, -2]) returns [1, 2] from child processes" $ok "exit $RC"

run_in_root "session: ProcessPoolExecutor(2).map(abs, [-3, -4])" ironcell exec \
  'import os
from concurrent.futures import ProcessPoolExecutor
with ProcessPoolExecutor(2) as ex:
    print("executor:", list(ex.map(abs, [-3, -4])))
    print("executor child is another process:", ex.submit(os.getpid).result() != os.getpid())'
[[ $RC == 0 ]] && grep -qx 'executor: \[3, 4\]' <<<"$OUT" \
  && grep -qx 'executor child is another process: True' <<<"$OUT" && ok=1 || ok=0
record "ProcessPoolExecutor(2).map(abs, [-3, -4]) returns [3, 4] from child processes" $ok "exit $RC"

run_in_root "session: pools asked for forkserver and spawn by name" ironcell exec \
  'import multiprocessing as mp
print("forkserver context:", mp.get_context("forkserver").Pool(1).map(abs, [-5]))
mp.set_start_method("spawn", force=True)
print("spawn default:", mp.Pool(1).map(abs, [-6]))'
[[ $RC == 0 ]] && grep -qx 'forkserver context: \[5\]' <<<"$OUT" \
  && grep -qx 'spawn default: \[6\]' <<<"$OUT" && ok=1 || ok=0
record "get_context('forkserver') and set_start_method('spawn') pools work too" $ok "exit $RC"

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
  echo "PASS: ironcell works on a Python-$PYVER-only $DISTRO system (${SECONDS}s)"
else
  echo "FAIL: see the failed checks above (${SECONDS}s)"
fi
exit "$FAILED"
