# ironcell's zygote boot script. The host runs `python -I -c <loader> PRELOAD LOG_FILTER` with
# the control socket on fd 3, ironcell's extension module (a sealed memfd) on fd 4 and this
# script (a sealed memfd) on fd 5, which the one-line loader reads, closes and runs.
# It loads the extension and hands over to it; any failure is reported on the control socket
# so the host can name the problem instead of seeing a silent exit. It imports nothing it does
# not need on the way (`socket` and `json` only to fail): each import is part of a server's start.
# PRELOAD LOG_FILTER [CODE_CACHE]: the last is the directory of the compiled runner and `mcp`.
import sys


def _fail(message):
    import json
    import socket

    try:
        ctl = socket.socket(fileno=3)
        ctl.send(json.dumps({"op": "failed", "message": message}).encode())
        ctl.detach()
    finally:
        sys.exit(3)


_impl = getattr(getattr(sys, "implementation", None), "name", "cpython")
_version = sys.version.split()[0]
_fix = (
    "Choose another with --python PATH or IRONCELL_PYTHON (an interpreter, a venv or a conda env "
    "prefix), e.g. a conda env with `conda create -n NAME python=3.12`"
)
if _impl != "cpython":
    _fail("%s is %s %s; ironcell needs CPython 3.9 or newer. %s" % (sys.executable, _impl, _version, _fix))
if sys.version_info < (3, 9):
    _fail("%s is Python %s; ironcell needs CPython 3.9 or newer. %s" % (sys.executable, _version, _fix))
# Free-threaded builds exist from 3.13 on; `sysconfig` is not imported for the others.
if sys.version_info >= (3, 13) and __import__("sysconfig").get_config_var("Py_GIL_DISABLED"):
    _fail(
        "%s is a free-threaded build of Python %s, which cannot load stable-ABI extensions such as "
        "ironcell's; use the regular build of the same version (e.g. python3.13 rather than "
        "python3.13t). %s" % (sys.executable, _version, _fix)
    )

try:
    from importlib.machinery import ExtensionFileLoader
    from importlib.util import module_from_spec, spec_from_loader

    _loader = ExtensionFileLoader("_ironcell_bridge", "/proc/self/fd/4")
    _bridge = module_from_spec(spec_from_loader("_ironcell_bridge", _loader))
    _loader.exec_module(_bridge)
    sys.modules["_ironcell_bridge"] = _bridge
    del _loader
except BaseException as e:  # noqa: BLE001 - every failure must reach the host
    _fail(
        "ironcell's extension module did not load into %s (Python %s): %s: %s"
        % (sys.executable, sys.version.split()[0], type(e).__name__, e)
    )

_preload = [m for m in sys.argv[1].split(",") if m.strip()]
_bridge.zygote_main(_preload, sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
