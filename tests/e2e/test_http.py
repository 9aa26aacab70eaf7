"""`ironcell serve --http`: MCP Streamable HTTP for a team (docs/SECURITY.md #178-#180).

Driven with the official SDK 2.x client over HTTP in both eras (`mode="auto"` lands in
2026-07-28, `mode="legacy"` in 2025-11-25), with hashed static tokens and with JWTs from a
local issuer each test creates (its keys generated here). Attacks come from outside (requests
without or with bad tokens, forged JWTs, foreign origins, another principal's protocol session,
ids and URIs) and from inside the sandbox (one principal's code reaching for another's files).
Servers run as root and as `nobody`.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import httpx2 as httpx
import pytest

from conftest import IRONCELL, PREFIX_FOR_USER, Run, pid_alive, server_env, shared_tmp_dir, wait_until

pytestmark = pytest.mark.anyio

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
PLAIN_SERVER = Path(__file__).parent / "servers" / "plain_server.py"


class HttpServer:
    """`ironcell serve --http 127.0.0.1:0 ...` as `user`, in a directory `nobody` can use."""

    def __init__(self, user: str = "root", args: list[str] | None = None, **env: str):
        self.dir = shared_tmp_dir()
        self.state = self.dir / "state"
        self.state.mkdir(mode=0o777)
        self.state.chmod(0o777)
        self.log = self.dir / "server.log"
        self.user = user
        self.proc = subprocess.Popen(
            [*PREFIX_FOR_USER[user], str(IRONCELL), "serve", "--http", "127.0.0.1:0", *(args or [])],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"),
            env=server_env(self.state, **env),
        )
        found: list[str] = []

        def listening() -> bool:
            m = re.search(r"serving MCP at (http://\S+)/mcp", self.log.read_text(errors="replace"))
            if m:
                found.append(m.group(1))
            return bool(m) or self.proc.poll() is not None

        assert wait_until(listening, timeout=30), self.log.read_text()
        assert found, f"the server exited: {self.log.read_text()}"
        self.base = found[0]
        self.url = self.base + "/mcp"

    def file(self, name: str, text: str) -> Path:
        p = self.dir / name
        p.write_text(text)
        p.chmod(0o644)
        return p

    def principal_dirs(self) -> dict[str, Path]:
        base = self.state / "principals"
        if not base.exists():
            return {}
        return {(d / "principal").read_text(): d for d in base.iterdir() if (d / "principal").exists()}

    def audit(self, principal: str) -> list[dict]:
        f = self.principal_dirs()[principal] / "audit.jsonl"
        return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []

    def descendants(self) -> list[int]:
        """The pids of every process below the server (zygotes, workers, proxied servers)."""
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parent = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(parent, []).append(int(entry))
        found, todo = [], [self.proc.pid]
        while todo:
            for c in children.get(todo.pop(), []):
                found.append(c)
                todo.append(c)
        return found

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def servers():
    started: list[HttpServer] = []

    def start(*args: str, user: str = "root", **env: str) -> HttpServer:
        started.append(HttpServer(user, list(args), **env))
        return started[-1]

    yield start
    for s in started:
        s.stop()
        shutil.rmtree(s.dir, ignore_errors=True)


def _write_tokens(path: Path, table: dict[str, str]) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table))
    tmp.chmod(0o644)
    tmp.replace(path)
    return path


def hashed(tokens: dict[str, str]) -> dict[str, str]:
    return {name: "sha256:" + hashlib.sha256(tok.encode()).hexdigest() for name, tok in tokens.items()}


def tokens_server(servers, tokens: dict[str, str], *args: str, user: str = "root", **env: str) -> HttpServer:
    """A server whose token file (written before it starts) holds `tokens`, hashed."""
    d = shared_tmp_dir()
    path = _write_tokens(d / "tokens.json", hashed(tokens))
    srv = servers("--auth-tokens", str(path), *args, user=user, **env)
    srv.tokens_path = path  # type: ignore[attr-defined]
    return srv


class Issuer:
    """A local OAuth issuer: an RSA and an EC key of its own, published as a JWKS file."""

    def __init__(self, iss: str = "https://issuer.test", aud: str = "https://ironcell.test/mcp"):
        from cryptography.hazmat.primitives.asymmetric import ec, rsa

        self.iss, self.aud = iss, aud
        self.rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ec = ec.generate_private_key(ec.SECP256R1())
        self.dir = shared_tmp_dir()
        self.jwks = self.dir / "jwks.json"
        self.publish(self.rsa, self.ec)

    @staticmethod
    def jwk(key, kid: str) -> dict:
        from jwt.algorithms import ECAlgorithm, RSAAlgorithm

        algo = RSAAlgorithm if kid.startswith("rsa") else ECAlgorithm
        d = json.loads(algo.to_jwk(key.public_key()))
        d["kid"] = kid
        return d

    def publish(self, rsa_key, ec_key) -> None:
        doc = {"keys": [self.jwk(rsa_key, "rsa-1"), self.jwk(ec_key, "ec-1")]}
        tmp = self.dir / "jwks.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.chmod(0o644)
        tmp.replace(self.jwks)

    def token(self, sub: str, *, alg: str = "RS256", key=None, kid: str | None = None, **claims: Any) -> str:
        import jwt

        now = int(time.time())
        body = {"iss": self.iss, "aud": self.aud, "sub": sub, "iat": now, "exp": now + 600, **claims}
        body = {k: v for k, v in body.items() if v is not None}
        if key is None:
            key = self.rsa if alg.startswith(("RS", "PS")) else self.ec
        kid = kid or ("rsa-1" if alg.startswith(("RS", "PS")) else "ec-1")
        return jwt.encode(body, key, algorithm=alg, headers={"kid": kid})

    def args(self) -> list[str]:
        return ["--auth-jwks", str(self.jwks), "--auth-issuer", self.iss, "--auth-audience", self.aud]


@contextlib.asynccontextmanager
async def client(url: str, token: str | None, mode: str = "auto", **kwargs: Any):
    """The SDK's `Client` over Streamable HTTP with a bearer token."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with create_mcp_http_client(headers=headers) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode, **kwargs) as c:
            yield c


async def run(c, code: str, *, settle: bool = True, **args: Any) -> Run:
    """A `run_python` call's result; with `settle`, a run that went on past the wait budget (a
    slow start on a busy machine) is waited for, so no assertion depends on the machine's speed."""
    r = Run(await c.call_tool("run_python", {"code": code, **args}))
    return await settled(c, r) if settle else r


async def settled(c, r: Run) -> Run:
    """`r`, or if it went on as a background job (past the wait budget), its outcome."""
    while r.record.get("status") == "running":
        r = Run(await c.call_tool("run_python_job", {"job": r["job"], "wait_s": 30}))
    return r


def value(r: Run) -> Any:
    assert not r.is_error and r["status"] == "ok", r
    return ast.literal_eval(r["result"])


def post(url: str, body: dict, token: str | None = None, **headers: str) -> httpx.Response:
    h = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if "_meta" in body.get("params", {}):  # a 2026-07-28 request names itself in headers too
        h.update({"MCP-Protocol-Version": MODERN, "Mcp-Method": body["method"]})
        if body["method"] == "tools/call":
            h["Mcp-Name"] = body["params"]["name"]
        elif body["method"].startswith("tasks/"):
            h["Mcp-Name"] = body["params"]["taskId"]
    h.update(headers)
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    return httpx.post(url, json=body, headers=h, timeout=30)


def modern(method: str, params: dict, caps: dict | None = None, rid: int = 1) -> dict:
    """A 2026-07-28 request: the version, client and capabilities in its `_meta`."""
    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
        "io.modelcontextprotocol/clientCapabilities": caps or {},
    }
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": {**params, "_meta": meta}}


def modern_call(code: str, rid: int = 1, caps: dict | None = None, **args: Any) -> dict:
    return modern("tools/call", {"name": "run_python", "arguments": {"code": code, **args}}, caps, rid)


def answer(resp: httpx.Response, rid: int = 1) -> dict:
    assert resp.status_code == 200, resp.text
    (msg,) = [m for m in sse_results(resp) if m.get("id") == rid]
    return msg


def sse_results(resp: httpx.Response) -> list[dict]:
    if resp.headers.get("content-type", "").startswith("application/json"):
        return [resp.json()]
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data:") and line[5:].strip():
            out.append(json.loads(line[5:]))
    return out


# ---------------------------------------------------------------------------------------------
# Both eras, the same tools and resources, progress and cancellation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, era", [("auto", MODERN), ("legacy", LEGACY)])
async def test_both_eras_serve_tools_resources_progress_and_cancellation(servers, mode, era):
    srv = tokens_server(servers, {"alice": "alice-token-1"}, IRONCELL_WAIT_BUDGET="4s")
    async with client(srv.url, "alice-token-1", mode) as c:
        assert c.protocol_version == era
        assert {t.name for t in (await c.list_tools()).tools} == {"run_python", "run_python_job"}
        assert value(await run(c, "x = 41\nx + 1")) == 42
        r = await run(c, "open('era.txt', 'w').write('hello http')", session="files")
        uri = r["files"][0]["uri"]
        listed = [str(res.uri) for res in (await c.list_resources()).resources]
        assert "system://info" in listed and uri in listed
        assert (await c.read_resource(uri)).contents[0].text == "hello http"

        seen: list[str] = []

        async def on_progress(progress, total, message):
            seen.append(message or "")

        code = "import time\nfor i in range(4):\n    print(f'step {i}')\n    time.sleep(0.8)"
        assert not Run(await c.call_tool("run_python", {"code": code}, progress_callback=on_progress)).is_error
        assert len(seen) >= 2 and any("step" in m for m in seen), seen

        # Abandoning a call cancels the run; the session and its variables are kept.
        with anyio.move_on_after(1.5):
            await c.call_tool("run_python", {"code": "while True: pass", "timeout_s": 120})
        r = await run(c, "x")
        assert r["result"] == "41" and r["session_state"] == "kept", r

        # Past the wait budget, a background job.
        r = await run(c, "import time\ntime.sleep(6)\n'late'", session="slow", timeout_s=60, settle=False)
        assert r["status"] == "running", r
        done = await settled(c, r)
        assert done["result"] == "'late'", done

    # A reconnecting client of the same principal, in either era, finds its sessions.
    async with client(srv.url, "alice-token-1", "legacy" if mode == "auto" else "auto") as c:
        assert value(await run(c, "x")) == 41

    with httpx.Client() as h:
        assert h.get(srv.base + "/healthz").status_code == 200
    # SIGTERM: a clean exit that takes every zygote and worker with it.
    descendants = srv.descendants()
    assert len(descendants) >= 2, descendants  # a zygote and the sessions' workers at least
    assert srv.stop() == 0
    assert wait_until(lambda: not [p for p in descendants if pid_alive(p)], timeout=10), descendants
    # Every audit line names the principal.
    assert srv.audit("alice") and all(e["principal"] == "alice" for e in srv.audit("alice"))


# ---------------------------------------------------------------------------------------------
# #178: refusals. No token, a wrong one, forged and expired JWTs, a foreign Origin: nothing runs
# ---------------------------------------------------------------------------------------------


def b64(d: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()


def forged_tokens(issuer: Issuer) -> dict[str, str]:
    import hmac

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    now = int(time.time())
    claims = {"iss": issuer.iss, "aud": issuer.aud, "sub": "mallory", "exp": now + 600}
    pem = issuer.rsa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    jwk = json.dumps(Issuer.jwk(issuer.rsa, "rsa-1")).encode()

    def hs256(secret: bytes, kid: str = "rsa-1") -> str:
        head = b64({"alg": "HS256", "typ": "JWT", "kid": kid})
        body = b64(claims)
        sig = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
        return f"{head}.{body}." + base64.urlsafe_b64encode(sig).rstrip(b"=").decode()

    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return {
        "alg none": f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64(claims)}.",
        "alg None": f"{b64({'alg': 'None', 'typ': 'JWT', 'kid': 'rsa-1'})}.{b64(claims)}.",
        "HS256 with the public key's PEM": hs256(pem),
        "HS256 with the public JWK": hs256(jwk),
        "another key, the issuer's kid": issuer.token("mallory", key=stranger),
        "expired": issuer.token("mallory", exp=now - 3600, iat=now - 7200),
        "not yet valid": issuer.token("mallory", nbf=now + 3600),
        "wrong audience": issuer.token("mallory", aud="https://elsewhere.test/mcp"),
        "wrong issuer": issuer.token("mallory", iss="https://evil.test"),
        "no exp": issuer.token("mallory", exp=None),
        "no sub": issuer.token(None),  # type: ignore[arg-type]
        "ES256 header, RSA key": issuer.token("mallory", alg="ES256", kid="rsa-1"),
        "tampered claims": ".".join([issuer.token("mallory").split(".")[0], b64({**claims, "sub": "alice"}),
                                     issuer.token("mallory").split(".")[2]]),
        "garbage": "not-a-jwt",
    }


@pytest.mark.parametrize("user", ["root", "nobody"])
async def test_178_requests_without_a_valid_token_are_refused_and_nothing_runs(servers, user):
    issuer = Issuer()
    srv = servers(*issuer.args(), user=user)
    canary = "open('ran.txt', 'w').write('ran')\n'ran'"

    # No token: 401 with the challenge that points at the RFC 9728 metadata.
    r = post(srv.url, modern_call(canary))
    assert r.status_code == 401, r.text
    challenge = r.headers["www-authenticate"]
    m = re.fullmatch(r'Bearer resource_metadata="([^"]+)"', challenge)
    assert m, challenge
    meta = httpx.get(m.group(1)).json()
    assert meta["resource"] == srv.url and meta["authorization_servers"] == [issuer.iss], meta
    assert httpx.get(srv.base + "/.well-known/oauth-protected-resource").json() == meta

    for what, token in forged_tokens(issuer).items():
        r = post(srv.url, modern_call(canary), token)
        assert r.status_code == 401, (what, r.status_code, r.text)
        assert 'error="invalid_token"' in r.headers["www-authenticate"], what

    # A valid token from a foreign Origin (a web page the user visits): 403.
    good = issuer.token("alice")
    r = post(srv.url, modern_call(canary), good, Origin="http://evil.example")
    assert r.status_code == 403, r.text
    # Nothing ran for any of them: no principal's world was even started.
    assert srv.principal_dirs() == {}

    # The positive control: the same request with the valid token runs, as "alice".
    r = post(srv.url, modern_call("6 * 7"), good)
    assert r.status_code == 200, r.text
    (answer,) = [m for m in sse_results(r) if m.get("id") == 1]
    assert answer["result"]["structuredContent"]["result"] == "42", answer
    assert list(srv.principal_dirs()) == ["alice"]
    # An EC-signed token checks too.
    async with client(srv.url, issuer.token("bob", alg="ES256")) as c:
        assert value(await run(c, "'bob here'")) == "bob here"
    assert sorted(srv.principal_dirs()) == ["alice", "bob"]
    assert not any((d / "ran.txt").exists() for d in srv.state.rglob("*") if d.is_dir())


async def test_178_the_token_file_holds_hashes_and_is_read_again_when_it_changes(servers):
    srv = tokens_server(servers, {"alice": "tok-a"})
    path: Path = srv.tokens_path  # type: ignore[attr-defined]
    assert "tok-a" not in path.read_text()
    assert post(srv.url, modern_call("1"), "tok-b").status_code == 401
    # Adding a principal works without a restart; removing one locks it out at once.
    time.sleep(0.01)
    _write_tokens(path, hashed({"alice": "tok-a", "bob": "tok-b"}))
    assert post(srv.url, modern_call("1"), "tok-b").status_code == 200
    _write_tokens(path, hashed({"bob": "tok-b"}))
    assert post(srv.url, modern_call("1"), "tok-a").status_code == 401
    # A broken file accepts nobody (fail closed) until it is fixed.
    path.write_text("{not json")
    r = post(srv.url, modern_call("1"), "tok-b")
    assert r.status_code == 401, r.text
    assert "token file" in r.headers["www-authenticate"]
    _write_tokens(path, hashed({"bob": "tok-b"}))
    assert post(srv.url, modern_call("1"), "tok-b").status_code == 200


async def test_178_rotated_issuer_keys_are_picked_up_and_old_ones_refused(servers):
    issuer = Issuer()
    srv = servers(*issuer.args())
    old = issuer.token("alice")
    assert post(srv.url, modern_call("1"), old).status_code == 200
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    issuer.rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    issuer.publish(issuer.rsa, ec.generate_private_key(ec.SECP256R1()))
    assert post(srv.url, modern_call("1"), old).status_code == 401
    assert post(srv.url, modern_call("1"), issuer.token("alice")).status_code == 200


async def test_178_issuer_keys_fetched_from_a_url_check_tokens(servers):
    import functools
    import http.server
    import threading

    issuer = Issuer()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(issuer.dir))
    jwks_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=jwks_server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{jwks_server.server_address[1]}/jwks.json"
        srv = servers("--auth-jwks", url, "--auth-issuer", issuer.iss, "--auth-audience", issuer.aud)
        assert post(srv.url, modern_call("1"), issuer.token("alice")).status_code == 200
        assert post(srv.url, modern_call("1"), issuer.token("alice", alg="ES256")).status_code == 200
        assert post(srv.url, modern_call("1"), forged_tokens(issuer)["another key, the issuer's kid"]).status_code == 401
    finally:
        jwks_server.shutdown()


def test_178_serve_refuses_to_start_without_auth_and_names_the_flags(tmp_path):
    def start(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(IRONCELL), "serve", *args], env=server_env(tmp_path), capture_output=True,
                              text=True, timeout=30)

    out = start("--http", "0.0.0.0:0")
    assert out.returncode != 0
    assert "--auth-tokens" in out.stderr and "--auth-jwks" in out.stderr and "refusing" in out.stderr, out.stderr
    out = start("--http", "0.0.0.0:0", "--auth", "none")
    assert out.returncode != 0 and "loopback" in out.stderr, out.stderr
    out = start("--http", "127.0.0.1:0")
    assert out.returncode != 0 and "--auth none" in out.stderr, out.stderr
    out = start("--http", "127.0.0.1:0", "--auth-jwks", str(tmp_path / "jwks.json"))
    assert out.returncode != 0 and "--auth-issuer" in out.stderr, out.stderr
    (tmp_path / "tokens.json").write_text('{"alice": "the-token-in-clear"}')
    out = start("--http", "0.0.0.0:0", "--auth-tokens", str(tmp_path / "tokens.json"))
    assert out.returncode != 0 and "sha256" in out.stderr, out.stderr
    out = start("--http", "0.0.0.0:0", "--auth-jwks", "http://idp.example/jwks.json", "--auth-issuer", "i",
                "--auth-audience", "a")
    assert out.returncode != 0 and "https://" in out.stderr, out.stderr
    (tmp_path / "jwks.json").write_text('{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}')
    out = start("--http", "0.0.0.0:0", "--auth-jwks", str(tmp_path / "jwks.json"), "--auth-issuer", "i",
                "--auth-audience", "a")
    assert out.returncode != 0 and "symmetric" in out.stderr, out.stderr


async def test_178_loopback_without_auth_needs_the_explicit_flag_and_checks_host_and_origin(servers):
    srv = servers("--auth", "none", "--http-allow-origin", "http://localhost:6274")
    async with client(srv.url, None) as c:
        assert value(await run(c, "1 + 1")) == 2
    assert list(srv.principal_dirs()) == ["local"]
    # DNS rebinding: a page on another name that resolves here.
    port = srv.base.rsplit(":", 1)[1]
    r = post(srv.url, modern_call("1"), Host=f"evil.example:{port}")
    assert r.status_code == 403, r.text
    assert post(srv.url, modern_call("1"), Origin="http://evil.example").status_code == 403
    r = post(srv.url, modern_call("1"), Origin="http://localhost:6274")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:6274"
    # The browser's preflight for the allowed origin, and none for another.
    pre = {"Origin": "http://localhost:6274", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type, mcp-session-id"}
    r = httpx.options(srv.url, headers=pre)
    assert r.status_code == 204 and "Mcp-Session-Id" in r.headers["access-control-allow-headers"], r.headers
    assert httpx.options(srv.url, headers={**pre, "Origin": "http://evil.example"}).status_code == 403


# ---------------------------------------------------------------------------------------------
# #179: principals never meet
# ---------------------------------------------------------------------------------------------


ATTACK = r"""
import os, glob
found = []
for pattern in [{state!r} + '/principals/*/**', '/proc/*/cwd/*', '../*', '../../*', '../../../*']:
    try:
        found += [p for p in glob.glob(pattern, recursive=True) if 'secret' in p]
    except Exception:
        pass
leaked = []
for p in {paths!r}:
    try:
        leaked.append(open(p).read())
    except OSError:
        pass
(found, leaked)
"""


@pytest.mark.parametrize("user", ["root", "nobody"])
async def test_179_principals_sharing_session_names_never_meet(servers, user):
    srv = tokens_server(servers, {"alice": "ta", "bob": "tb"}, user=user, IRONCELL_WAIT_BUDGET="2s")
    async with client(srv.url, "ta", "legacy") as a, client(srv.url, "tb", "auto") as b:
        assert value(await run(a, "x = 'alice'\nopen('secret.txt', 'w').write('alice secret')\nx")) == "alice"
        assert value(await run(b, "x = 'bob'\nx")) == "bob"
        assert value(await run(a, "x")) == "alice"
        # Files and resources: bob lists only his own, and alice's URI is nothing to him.
        alice_uri = next(str(r.uri) for r in (await a.list_resources()).resources if "secret.txt" in str(r.uri))
        assert not [r for r in (await b.list_resources()).resources if "secret" in str(r.uri)]
        with pytest.raises(Exception, match="no session|not found|No such"):
            await b.read_resource(alice_uri)
        assert value(await run(b, "import os\nos.listdir('.')")) == []
        # Jobs: bob cannot wait for, poll or cancel alice's job, nor even learn its id.
        slow = await run(a, "import time\ntime.sleep(5)\n'alice done'", session="slow", timeout_s=60, settle=False)
        assert slow["status"] == "running", slow
        for action in ("wait", "poll", "cancel"):
            r = Run(await b.call_tool("run_python_job", {"job": slow["job"], "action": action}))
            assert r.is_error and slow["job"] not in r.text.split("known:")[1], r.text
        done = Run(await a.call_tool("run_python_job", {"job": slow["job"], "wait_s": 30}))
        while done["status"] == "running":
            done = Run(await a.call_tool("run_python_job", {"job": slow["job"], "wait_s": 30}))
        assert done["result"] == "'alice done'", done
        # The memory store and saved tools are per principal.
        value(await run(a, "save_memory('plan', 'alice plan')\n1"))
        assert value(await run(b, "load_memory('plan', 'none')")) == "none"
        value(await run(a, "def shout(s: str) -> str:\n    'Shout.'\n    return s.upper()\nsave_tool(shout)\n1"))
        assert "shout" in {t.name for t in (await a.list_tools()).tools}
        assert "shout" not in {t.name for t in (await b.list_tools()).tools}
        # From inside bob's sandbox: alice's files are not there to find or open.
        alice_dir = srv.principal_dirs()["alice"]
        paths = [str(p) for p in alice_dir.rglob("secret.txt")]
        assert paths, list(alice_dir.rglob("*"))
        found, leaked = value(await run(b, ATTACK.format(state=str(srv.state), paths=paths)))
        assert found == [] and leaked == [], (found, leaked)

    # The audit: each principal's lines in its own file, stamped with its name.
    assert {e["principal"] for e in srv.audit("alice")} == {"alice"}
    assert {e["principal"] for e in srv.audit("bob")} == {"bob"}
    assert not any("alice" in e.get("code_head", "") for e in srv.audit("bob"))
    out = subprocess.run([str(IRONCELL), "audit", "--principal", "bob", "--json"], env=server_env(srv.state),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    key = ("time", "principal", "session", "code_sha256", "status")
    shown = [tuple(json.loads(line)[k] for k in key) for line in out.stdout.splitlines()]
    assert shown == [tuple(e[k] for k in key) for e in srv.audit("bob")]


async def test_179_a_protocol_session_belongs_to_the_principal_that_opened_it(servers):
    srv = tokens_server(servers, {"alice": "ta", "bob": "tb"})
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}
    r = post(srv.url, init, "ta")
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    hdr = {"Mcp-Session-Id": sid, "MCP-Protocol-Version": LEGACY}
    assert post(srv.url, {"jsonrpc": "2.0", "method": "notifications/initialized"}, "ta", **hdr).status_code == 202
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "run_python", "arguments": {"code": "'whose?'"}}}
    # Bob presenting alice's session id: as if it did not exist. Nothing runs.
    r = post(srv.url, call, "tb", **hdr)
    assert r.status_code == 404, r.text
    assert httpx.delete(srv.url, headers={"Authorization": "Bearer tb", **hdr}).status_code == 404
    assert "bob" not in srv.principal_dirs()
    r = post(srv.url, call, "ta", **hdr)
    assert r.status_code == 200
    (answer,) = [m for m in sse_results(r) if m.get("id") == 2]
    assert answer["result"]["structuredContent"]["result"] == "'whose?'"


def test_179_tasks_belong_to_the_principal_that_started_them(servers):
    caps = {"extensions": {"io.modelcontextprotocol/tasks": {}}}
    srv = tokens_server(servers, {"alice": "ta", "bob": "tb"}, IRONCELL_WAIT_BUDGET="1s")
    task = answer(post(srv.url, modern_call("import time\ntime.sleep(3)\n'alice task'", caps=caps, timeout_s=60), "ta"))
    task = task["result"]
    assert task["resultType"] == "task", task
    tid = task["taskId"]
    # Bob has a task of his own with the same kind of id; alice's is not his to read or cancel.
    bobs = answer(post(srv.url, modern_call("import time\ntime.sleep(3)", caps=caps, timeout_s=60), "tb"))["result"]
    assert bobs["resultType"] == "task" and bobs["taskId"] == tid, (bobs, tid)
    for method in ("tasks/get", "tasks/cancel"):
        r = answer(post(srv.url, modern(method, {"taskId": "job-999"}, caps), "tb"))
        assert "no task" in r["error"]["message"], r

    def finished(token: str) -> dict:
        deadline = time.monotonic() + 60
        while True:
            got = answer(post(srv.url, modern("tasks/get", {"taskId": tid}, caps), token))["result"]
            if got["status"] != "working" or time.monotonic() > deadline:
                return got
            time.sleep(0.3)

    got = finished("ta")
    assert got["status"] == "completed" and got["result"]["structuredContent"]["result"] == "'alice task'", got
    got = finished("tb")
    assert got["status"] == "completed" and got["result"]["structuredContent"]["result"] is None, got


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_179_an_approval_question_goes_to_the_client_that_made_the_call(servers, mode):
    from mcp import types

    log = shared_tmp_dir() / "upstream.jsonl"
    log.touch()
    log.chmod(0o666)
    config = shared_tmp_dir() / "servers.json"
    config.write_text(json.dumps({"mcpServers": {"plain": {
        "command": "/usr/bin/python3", "args": [str(PLAIN_SERVER)], "env": {"PLAIN_SERVER_LOG": str(log)}}}}))
    config.chmod(0o644)
    srv = tokens_server(servers, {"alice": "ta", "bob": "tb"}, MCP_BRIDGE_CONFIG=str(config),
                        IRONCELL_WAIT_BUDGET="60s")
    asked: dict[str, list[str]] = {"alice": [], "bob": []}

    def answerer(who: str):
        async def on_elicit(context, params):
            asked[who].append(params.message)
            return types.ElicitResult(action="accept", content={"approve": True})
        return on_elicit

    code = ("out = await runtime.call_tool('plain', 'write_file', {'path': 'a.txt', 'content': 'from alice'})\nout")
    async with client(srv.url, "ta", mode, elicitation_callback=answerer("alice")) as a, \
            client(srv.url, "tb", mode, elicitation_callback=answerer("bob")) as b:
        assert value(await run(b, "'bob is here'")) == "bob is here"
        r = await run(a, code)
        assert not r.is_error, r
    assert len(asked["alice"]) == 1 and asked["bob"] == [], asked
    assert "write_file" in asked["alice"][0]


# ---------------------------------------------------------------------------------------------
# #180: one principal cannot starve the others
# ---------------------------------------------------------------------------------------------


async def test_180_per_principal_limits_on_runs_and_live_sessions(servers):
    srv = tokens_server(servers, {"alice": "ta", "bob": "tb"}, IRONCELL_PRINCIPAL_MAX_RUNS="2",
                        IRONCELL_MAX_SESSIONS="3", IRONCELL_WAIT_BUDGET="1s")
    async with client(srv.url, "ta") as a, client(srv.url, "tb") as b:
        busy = [await run(a, "import time\ntime.sleep(20)", session=f"busy{i}", timeout_s=60, settle=False)
                for i in range(2)]
        assert all(r["status"] == "running" for r in busy), busy
        r = await run(a, "1", session="third", settle=False)
        assert r.is_error and "IRONCELL_PRINCIPAL_MAX_RUNS" in r.text, r.text
        # Bob is not held up by alice's share.
        for i in range(3):
            assert value(await run(b, f"{i} + 1", session=f"b{i}")) == i + 1
        for r in busy:
            Run(await a.call_tool("run_python_job", {"job": r["job"], "action": "cancel"}))
        # Alice's live sessions are capped at 3: her oldest idle one gives way, bob's are kept.
        for i in range(4):
            assert value(await run(a, f"v = {i}\nv", session=f"s{i}")) == i
        r = await run(b, "1", session="b0")
        assert r["session_state"] == "kept", r


def test_180_a_principal_holds_at_most_256_protocol_sessions(servers):
    srv = tokens_server(servers, {"alice": "ta", "bob": "tb"})
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}
    with httpx.Client(timeout=30) as h:
        hdr = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        ids = []
        for _ in range(256):
            r = h.post(srv.url, json=init, headers={**hdr, "Authorization": "Bearer ta"})
            assert r.status_code == 200, r.text
            ids.append(r.headers["mcp-session-id"])
        r = h.post(srv.url, json=init, headers={**hdr, "Authorization": "Bearer ta"})
        assert r.status_code == 429 and "DELETE" in r.text, r.text
        # Bob is not held up; alice closing one makes room for one.
        assert h.post(srv.url, json=init, headers={**hdr, "Authorization": "Bearer tb"}).status_code == 200
        r = h.delete(srv.url, headers={"Authorization": "Bearer ta", "Mcp-Session-Id": ids[0],
                                       "MCP-Protocol-Version": LEGACY})
        assert r.status_code in (200, 202, 204), r.text
        assert h.post(srv.url, json=init, headers={**hdr, "Authorization": "Bearer ta"}).status_code == 200


async def test_180_principals_at_once_are_capped_and_an_idle_one_makes_room(servers):
    srv = tokens_server(servers, {"alice": "ta", "bob": "tb"}, IRONCELL_MAX_PRINCIPALS="1",
                        IRONCELL_SESSION_TTL="2s")
    async with client(srv.url, "ta") as a, client(srv.url, "tb") as b:
        assert value(await run(a, "1")) == 1
        with pytest.raises(Exception, match="IRONCELL_MAX_PRINCIPALS"):
            await run(b, "2")
        # Alice's session expires (its worker ends): her world gives way to bob's.
        await anyio.sleep(4)
        assert value(await run(b, "2")) == 2
        with pytest.raises(Exception, match="IRONCELL_MAX_PRINCIPALS"):
            await run(a, "3")


# ---------------------------------------------------------------------------------------------
# Load: 20 principals x 10 sessions over HTTP, both eras, nothing lost or crossed
# ---------------------------------------------------------------------------------------------

PRINCIPALS = 20
SESSIONS = 10


async def test_load_20_principals_by_10_sessions_lose_and_cross_nothing(servers):
    tokens = {f"p{i:02d}": secrets.token_urlsafe(16) for i in range(PRINCIPALS)}
    srv = tokens_server(servers, tokens, IRONCELL_POOL_SIZE="0", IRONCELL_WARM_PLOTS="off", IRONCELL_PRINCIPAL_MAX_RUNS=str(SESSIONS),
                        IRONCELL_WAIT_BUDGET="120s")
    failures: list[str] = []
    seen: dict[tuple[str, int], Any] = {}
    limiter = anyio.CapacityLimiter(40)
    started = time.monotonic()

    async def principal(name: str, index: int) -> None:
        mode = "auto" if index % 2 else "legacy"
        async with client(srv.url, tokens[name], mode) as c:

            async def session(k: int) -> None:
                me = f"{name}/s{k}"
                try:
                    async with limiter:
                        first = await run(c, f"me = {me!r}\nn = 1\nme", session=f"s{k}", timeout_s=60)
                    async with limiter:
                        second = await run(c, "n += 1\nprint(me)\n(me, n)", session=f"s{k}", timeout_s=60)
                    seen[(name, k)] = (value(first), value(second), second["stdout"])
                except Exception as e:  # noqa: BLE001 - collected and reported below
                    failures.append(f"{me}: {type(e).__name__}: {e}")

            async with anyio.create_task_group() as tg:
                for k in range(SESSIONS):
                    tg.start_soon(session, k)

    async with anyio.create_task_group() as tg:
        for i, name in enumerate(tokens):
            tg.start_soon(principal, name, i)
    elapsed = time.monotonic() - started
    assert not failures, failures[:5]
    assert len(seen) == PRINCIPALS * SESSIONS
    for (name, k), (first, second, stdout) in seen.items():
        me = f"{name}/s{k}"
        assert first == me and second == (me, 2) and stdout.strip() == me, (me, first, second, stdout)
    assert sorted(srv.principal_dirs()) == sorted(tokens)
    for name in tokens:
        lines = srv.audit(name)
        assert len(lines) == 2 * SESSIONS and {e["principal"] for e in lines} == {name}
    print(f"{PRINCIPALS * SESSIONS * 2} runs of {PRINCIPALS} principals x {SESSIONS} sessions in {elapsed:.1f} s")


def test_296_a_body_naming_a_key_twice_is_refused_and_nothing_runs(servers):
    """JSON leaves a repeated key's meaning open: a gateway reading the first `code` would show one
    program while the last ran. Over HTTP as on stdio the request is refused, whatever the depth."""
    srv = tokens_server(servers, {"alice": "ta"})
    one = json.dumps(modern_call("'first'", rid=3))
    two = one.replace('"code": "\'first\'"', '"code": "\'first\'", "\\u0063ode": "\'second\'"')
    assert two != one
    h = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": "tools/call",
        "Mcp-Name": "run_python",
        "Authorization": "Bearer ta",
    }
    resp = httpx.post(srv.url, content=two.encode(), headers=h, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert err["id"] == 3 and err["error"]["code"] == -32600 and "twice" in err["error"]["message"], err
    assert "alice" not in srv.principal_dirs() or not srv.audit("alice"), srv.audit("alice")
    # The same request with each key once runs, and is audited.
    got = answer(httpx.post(srv.url, content=one.encode(), headers=h, timeout=30), rid=3)
    assert got["result"]["structuredContent"]["result"] == "'first'", got
    assert [e for e in srv.audit("alice") if e.get("code_sha256")], srv.audit("alice")
