//! `ironcell serve --http ADDR:PORT`: MCP Streamable HTTP at `/mcp` for a team.
//!
//! The HTTP stack is axum on hyper; `/mcp` is rmcp's Streamable HTTP service, which serves both
//! protocol eras (2025-11-25 with `initialize` and `Mcp-Session-Id`, 2026-07-28 stateless with
//! `server/discover`). In front of it, in this order:
//!
//! 1. the `Origin` check (every route): a request from a browser page whose origin is not
//!    listed with `--http-allow-origin` gets 403, whatever else it carries (DNS rebinding, a
//!    page driving a local server);
//! 2. authentication (`/mcp`): a bearer token ([`auth`]) proves a principal, or the answer is
//!    401 with `WWW-Authenticate: Bearer resource_metadata="…"` pointing at the RFC 9728
//!    metadata this server publishes;
//! 3. the protocol session's owner: an `Mcp-Session-Id` belongs to the principal whose
//!    `initialize` created it; any other principal presenting it gets 404, as for a session
//!    that does not exist.
//!
//! Then rmcp checks the `Host` (loopback names only when bound to loopback) and the protocol,
//! and every request reaches its principal's world ([`principals`]).
//!
//! `GET /healthz` answers 200 while the server accepts work and 503 once it is draining, for
//! load balancers and readiness probes; `GET /livez` answers 200 while the process serves, the
//! drain included, for liveness probes. SIGTERM drains ([`drain`]) before the server stops.

pub mod auth;
mod drain;
mod fetch;
pub mod principals;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tokio_util::sync::CancellationToken;

use self::auth::{AuthError, Authenticator, Principal};
use self::principals::{HttpHandler, Worlds};
use crate::config::Settings;
use crate::lock;

/// The flags of `serve` that choose and secure the HTTP transport.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// Serve MCP Streamable HTTP at `/mcp` on this address (`127.0.0.1:8765`, `0.0.0.0:8765`)
    /// instead of stdio. Off loopback it needs authentication (`--auth-tokens` or
    /// `--auth-jwks`); on loopback, `--auth none` serves without.
    #[arg(long, env = "IRONCELL_HTTP", value_name = "ADDR:PORT")]
    pub http: Option<String>,

    /// `none`: serve HTTP without authentication (loopback addresses only; every request is the
    /// one principal "local").
    #[arg(long, env = "IRONCELL_AUTH", value_name = "none")]
    pub auth: Option<AuthNone>,

    /// A JSON file of principal name to `"sha256:<hex of its bearer token>"`. Read again when
    /// it changes.
    #[arg(long, env = "IRONCELL_AUTH_TOKENS", value_name = "FILE")]
    pub auth_tokens: Option<PathBuf>,

    /// OAuth 2.1 resource-server mode: the issuer's public keys, a JWKS file or URL. Bearer JWTs
    /// must be signed by one of them; their `sub` is the principal.
    #[arg(long, env = "IRONCELL_AUTH_JWKS", value_name = "FILE|URL")]
    pub auth_jwks: Option<String>,

    /// The `iss` every JWT must carry (with `--auth-jwks`).
    #[arg(long, env = "IRONCELL_AUTH_ISSUER", value_name = "URL")]
    pub auth_issuer: Option<String>,

    /// The `aud` every JWT must carry: this server's resource identifier (with `--auth-jwks`).
    #[arg(long, env = "IRONCELL_AUTH_AUDIENCE", value_name = "AUD")]
    pub auth_audience: Option<String>,

    /// The URL clients reach this server at (`https://sandbox.example.com`), when behind a
    /// proxy: named in the 401's `resource_metadata` and the metadata document, and accepted as
    /// `Host`. Default: `http://` and the request's `Host`.
    #[arg(long, env = "IRONCELL_PUBLIC_URL", value_name = "URL")]
    pub public_url: Option<String>,

    /// A browser origin allowed to call (`https://app.example.com`). Repeatable; the variable
    /// takes a comma-separated list. Requests carrying any other `Origin` get 403.
    #[arg(
        long = "http-allow-origin",
        env = "IRONCELL_HTTP_ALLOW_ORIGIN",
        value_delimiter = ',',
        value_name = "ORIGIN"
    )]
    pub allow_origins: Vec<String>,

    /// Runs one principal may have going at once; one more is refused with a clear error (its
    /// live sessions are capped by IRONCELL_MAX_SESSIONS, which counts per principal here).
    #[arg(long, env = "IRONCELL_PRINCIPAL_MAX_RUNS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub principal_max_runs: u32,

    /// Principals with a world at once (each has its own zygote and spares). Past it, the
    /// longest-idle principal without a live session is closed, or the request refused.
    #[arg(long, env = "IRONCELL_MAX_PRINCIPALS", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_principals: u32,

    /// On SIGTERM: how long runs already going may take to finish (`/healthz` answers 503 and
    /// new runs and sessions get 503 meanwhile, for the balancer to send elsewhere). Runs still
    /// going after it are stopped.
    #[arg(long, env = "IRONCELL_DRAIN_GRACE", default_value = "30s", value_parser = crate::config::parse_duration)]
    pub drain_grace: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuthNone {
    None,
}

/// Everything the layers in front of rmcp need.
struct Gate {
    auth: Authenticator,
    allowed_origins: Vec<String>,
    public_url: Option<String>,
    bound: SocketAddr,
    /// `Mcp-Session-Id` → the principal whose `initialize` created it.
    owners: std::sync::Mutex<std::collections::HashMap<String, Principal>>,
    drain: Arc<drain::Drain>,
    /// The largest request body rmcp takes (the drain reads bodies up to it).
    max_body: usize,
}

const SESSION_HEADER: &str = "mcp-session-id";
/// Protocol sessions one principal may hold open at once (each costs a task and buffers).
const MAX_PROTOCOL_SESSIONS_PER_PRINCIPAL: usize = 256;

/// Checks the flags: which authentication, and whether this address may be served with it.
async fn authenticator(
    args: &ServeArgs,
    loopback: bool,
    addr: &str,
) -> anyhow::Result<Authenticator> {
    let jwt_parts = [&args.auth_issuer, &args.auth_audience];
    let how = "--auth-tokens FILE (principal → \"sha256:<hex of its token>\"), or --auth-jwks \
               FILE|URL with --auth-issuer and --auth-audience (OAuth 2.1 bearer JWTs)";
    match (args.auth, &args.auth_tokens, &args.auth_jwks) {
        (Some(AuthNone::None), None, None) if jwt_parts.iter().all(|p| p.is_none()) => {
            if !loopback {
                anyhow::bail!(
                    "--auth none is for loopback addresses only, and {addr} is not one: anyone \
                     who can reach it could run code. Use {how}"
                );
            }
            Ok(Authenticator::None)
        }
        (Some(_), _, _) => {
            anyhow::bail!("--auth none cannot be combined with other --auth-* flags")
        }
        (None, Some(_), Some(_)) => {
            anyhow::bail!("choose one of --auth-tokens and --auth-jwks")
        }
        (None, Some(path), None) => {
            if jwt_parts.iter().any(|p| p.is_some()) {
                anyhow::bail!(
                    "--auth-issuer and --auth-audience go with --auth-jwks, not --auth-tokens"
                );
            }
            Ok(Authenticator::Tokens(
                auth::TokenFile::open(path).map_err(|e| anyhow::anyhow!("--auth-tokens: {e}"))?,
            ))
        }
        (None, None, Some(jwks)) => {
            let (Some(issuer), Some(audience)) = (&args.auth_issuer, &args.auth_audience) else {
                anyhow::bail!(
                    "--auth-jwks needs --auth-issuer (the iss tokens must carry) and \
                     --auth-audience (the aud they must carry: this server's resource URL)"
                );
            };
            let source =
                auth::JwksSource::parse(jwks).map_err(|e| anyhow::anyhow!("--auth-jwks {e}"))?;
            let verifier = auth::JwtVerifier::open(source, issuer.clone(), audience.clone())
                .await
                .map_err(|e| anyhow::anyhow!("--auth-jwks: {e}"))?;
            Ok(Authenticator::Jwt(verifier))
        }
        (None, None, None) => {
            if jwt_parts.iter().any(|p| p.is_some()) {
                anyhow::bail!("--auth-issuer and --auth-audience need --auth-jwks FILE|URL");
            }
            if loopback {
                anyhow::bail!(
                    "serving HTTP needs authentication: {how}; or, on this loopback address \
                     only, --auth none"
                )
            }
            anyhow::bail!(
                "refusing to serve {addr} without authentication: anyone who can reach it could \
                 run code. Use {how}"
            )
        }
    }
}

/// Whether the `auth`-related flags were given without `--http`.
pub fn check_stdio_flags(args: &ServeArgs) -> anyhow::Result<()> {
    if args.http.is_none()
        && (args.auth.is_some()
            || args.auth_tokens.is_some()
            || args.auth_jwks.is_some()
            || args.auth_issuer.is_some()
            || args.auth_audience.is_some())
    {
        anyhow::bail!(
            "the --auth* flags are for `serve --http ADDR:PORT`; stdio serves the one client that started ironcell"
        );
    }
    Ok(())
}

/// Resolves `ADDR:PORT`: the address to bind, and whether every address it names is loopback.
async fn resolve(addr: &str) -> anyhow::Result<(SocketAddr, bool)> {
    let all: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .with_context(|| format!("--http {addr}: give an address and port, e.g. 127.0.0.1:8765"))?
        .collect();
    let first = *all
        .first()
        .with_context(|| format!("--http {addr}: the name resolves to no address"))?;
    Ok((first, all.iter().all(|a| a.ip().is_loopback())))
}

/// `ironcell serve --http ADDR:PORT`: until SIGTERM or SIGINT (then a drain).
///
/// Long on purpose: it wires the stack in order, each step a call: flags, state, the worlds,
/// the rmcp service, the gate, the routes, the listener, the background tasks, the drain.
pub async fn serve(settings: Settings, args: ServeArgs, exe: PathBuf) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let addr = args.http.clone().unwrap_or_default();
    let (bind, loopback) = resolve(&addr).await?;
    let auth = authenticator(&args, loopback, &addr).await?;
    // What stdio reports to its client on every request, HTTP refuses to start with.
    let state_dir = settings.prepare_state_dir()?;
    settings.sandbox()?;
    crate::python::choose(&crate::python::ProcessLookup(settings.python.as_deref()))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let public_url = args
        .public_url
        .as_deref()
        .map(|u| u.trim_end_matches('/').to_string());
    if let Some(u) = &public_url
        && !(u.starts_with("https://") || u.starts_with("http://"))
    {
        anyhow::bail!(
            "--public-url {u}: give the URL clients use, e.g. https://sandbox.example.com"
        );
    }
    let max_body = usize::try_from(settings.max_code_bytes.saturating_mul(8))
        .unwrap_or(usize::MAX)
        .max(crate::stdio::DEFAULT_MAX_LINE_BYTES);
    let worlds = Worlds::new(
        settings.clone(),
        state_dir,
        exe,
        args.principal_max_runs,
        args.max_principals as usize,
    )?;
    let info = crate::server::server_config(true);
    let stop = CancellationToken::new();
    let mut config = StreamableHttpServerConfig::default()
        .with_cancellation_token(stop.child_token())
        .with_sse_keep_alive(Some(Duration::from_secs(15)))
        .with_max_request_body_bytes(max_body);
    if loopback {
        let mut hosts: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
        if let Some(host) = public_url.as_deref().and_then(url_host) {
            hosts.push(host);
        }
        config = config.with_allowed_hosts(hosts);
    } else {
        // Off loopback every request must prove a principal, so a rebinding page gains nothing.
        config = config.disable_allowed_hosts();
    }
    let sessions = Arc::new(LocalSessionManager::default());
    let handler = HttpHandler {
        worlds: worlds.clone(),
        info,
    };
    let mcp = StreamableHttpService::new(move || Ok(handler.clone()), sessions.clone(), config);
    let gate = Arc::new(Gate {
        auth,
        allowed_origins: args
            .allow_origins
            .iter()
            .map(|o| normalize_origin(o))
            .collect(),
        public_url,
        bound: bind,
        owners: std::sync::Mutex::new(Default::default()),
        drain: Arc::new(drain::Drain::default()),
        max_body,
    });
    let app = routes(mcp, gate.clone());
    let listener = tokio::net::TcpListener::bind(bind)
        .await
        .with_context(|| format!("binding {bind}"))?;
    let local = listener.local_addr()?;
    tracing::warn!(
        "serving MCP at http://{local}/mcp (auth: {})",
        gate.auth.describe()
    );
    let sigterm = signal(SignalKind::terminate())?;
    let sigint = signal(SignalKind::interrupt())?;
    let reaper = tokio::spawn(worlds.clone().reap_idle_periodically());
    let pruner = tokio::spawn(prune_owners(gate.clone(), sessions.clone()));
    let shutdown = drain::on_signal(
        gate.drain.clone(),
        worlds.clone(),
        args.drain_grace,
        stop.clone(),
        (sigterm, sigint),
    );
    let served = axum::serve(listener, app).with_graceful_shutdown(shutdown);
    let outcome = served.await.context("serving HTTP");
    reaper.abort();
    pruner.abort();
    worlds.shutdown().await;
    outcome
}

/// `/mcp` behind the authentication layer, the probes and the RFC 9728 metadata, all behind the
/// `Origin` check.
fn routes(
    mcp: StreamableHttpService<HttpHandler, LocalSessionManager>,
    gate: Arc<Gate>,
) -> axum::Router {
    axum::Router::new()
        .route_service("/mcp", mcp)
        .route_layer(axum::middleware::from_fn_with_state(
            gate.clone(),
            authenticate,
        ))
        .route("/healthz", axum::routing::get(healthz))
        .route("/livez", axum::routing::get(|| async { "ok\n" }))
        .route(
            "/.well-known/oauth-protected-resource",
            axum::routing::get(resource_metadata),
        )
        .route(
            "/.well-known/oauth-protected-resource/mcp",
            axum::routing::get(resource_metadata),
        )
        .layer(axum::middleware::from_fn_with_state(
            gate.clone(),
            check_origin,
        ))
        .with_state(gate)
}

/// The host of a URL (`https://h:8443/x` → `h:8443`), for the allowed `Host` values.
fn url_host(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let host = rest.split(['/', '?', '#']).next()?;
    (!host.is_empty()).then(|| host.to_string())
}

/// An origin compared as browsers send it: lowercase, without a trailing slash.
fn normalize_origin(o: &str) -> String {
    o.trim().trim_end_matches('/').to_ascii_lowercase()
}

/// 403 for a request whose `Origin` is not one of `--http-allow-origin`; for one that is, the
/// CORS answers a browser needs (the preflight, and the headers its page may send and read).
async fn check_origin(State(gate): State<Arc<Gate>>, req: Request, next: Next) -> Response {
    if let Some(origin) = req.headers().get(header::ORIGIN).cloned() {
        let allowed = origin
            .to_str()
            .ok()
            .map(normalize_origin)
            .is_some_and(|o| gate.allowed_origins.contains(&o));
        if allowed {
            let preflight = req.method() == Method::OPTIONS;
            let mut response = if preflight {
                StatusCode::NO_CONTENT.into_response()
            } else {
                next.run(req).await
            };
            let h = response.headers_mut();
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
            h.insert(header::VARY, HeaderValue::from_static("Origin"));
            h.insert(
                header::ACCESS_CONTROL_EXPOSE_HEADERS,
                HeaderValue::from_static("Mcp-Session-Id, WWW-Authenticate"),
            );
            if preflight {
                h.insert(
                    header::ACCESS_CONTROL_ALLOW_METHODS,
                    HeaderValue::from_static("GET, POST, DELETE"),
                );
                h.insert(
                    header::ACCESS_CONTROL_ALLOW_HEADERS,
                    HeaderValue::from_static(
                        "Authorization, Content-Type, Accept, Last-Event-ID, Mcp-Session-Id, \
                         MCP-Protocol-Version, Mcp-Method, Mcp-Name",
                    ),
                );
                h.insert(
                    header::ACCESS_CONTROL_MAX_AGE,
                    HeaderValue::from_static("600"),
                );
            }
            return response;
        }
        tracing::warn!(origin = ?origin, path = %req.uri().path(), "refused a request from a foreign Origin");
        return (
            StatusCode::FORBIDDEN,
            "Forbidden: requests from this Origin are not allowed (the server's operator can \
             allow it with --http-allow-origin)\n",
        )
            .into_response();
    }
    next.run(req).await
}

/// The URL this server is reached at, for the metadata and the 401's pointer to it.
fn base_url(gate: &Gate, headers: &HeaderMap) -> String {
    if let Some(u) = &gate.public_url {
        return u.clone();
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| {
            !h.is_empty()
                && h.len() <= 255
                && h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'))
        })
        .map(str::to_string)
        .unwrap_or_else(|| gate.bound.to_string());
    format!("http://{host}")
}

/// `/mcp` behind a bearer token; the protocol session bound to its principal.
async fn authenticate(State(gate): State<Arc<Gate>>, mut req: Request, next: Next) -> Response {
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    let principal = match gate.auth.authenticate(authorization).await {
        Ok(p) => p,
        Err(e) => return unauthorized(&gate, req.headers(), &e),
    };
    let session = req
        .headers()
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if let Some(id) = &session {
        let owner = lock(&gate.owners).get(id).cloned();
        if owner.is_none() && gate.drain.is_draining() {
            // Opened on another replica (which took the new session this one refused) while
            // the balancer still hashes here: the 503 sends it there again.
            return drain::refusal(None);
        }
        if owner.as_ref() != Some(&principal) {
            if owner.is_some() {
                tracing::warn!(
                    principal = principal.as_str(),
                    "refused another principal's protocol session"
                );
            }
            return session_not_found();
        }
    } else if req.method() == Method::POST {
        let held = lock(&gate.owners)
            .values()
            .filter(|p| **p == principal)
            .count();
        if held >= MAX_PROTOCOL_SESSIONS_PER_PRINCIPAL {
            return (
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "Too Many Requests: {held} protocol sessions of yours are open, the most at \
                     once; close some (DELETE /mcp) or let them expire"
                ),
            )
                .into_response();
        }
    }
    let deleting = req.method() == Method::DELETE;
    // POSTs count as in flight until answered: the drain waits for them.
    let in_flight = (req.method() == Method::POST).then(|| gate.drain.enter());
    if req.method() == Method::POST {
        req = match screen_post(req, &gate).await {
            Ok(req) => req,
            Err(refused) => return refused,
        };
    }
    req.extensions_mut().insert(principal.clone());
    let mut response = next.run(req).await;
    if let Some(guard) = in_flight {
        response = drain::hold_until_sent(response, guard);
    }
    match &session {
        None => {
            if let Some(created) = response
                .headers()
                .get(SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
            {
                lock(&gate.owners).insert(created.to_string(), principal);
            }
        }
        Some(id) if deleting && response.status().is_success() => {
            lock(&gate.owners).remove(id);
        }
        Some(_) => {}
    }
    response
}

/// A POST unchanged, or its refusal: a key named twice, or new work while draining.
async fn screen_post(req: Request, gate: &Gate) -> Result<Request, Response> {
    let req = refuse_duplicate_keys(req, gate.max_body).await?;
    if gate.drain.is_draining() {
        return drain::screen(req, gate.max_body).await;
    }
    Ok(req)
}

/// The request unchanged, or a 400 if its JSON names a key twice in one object (SECURITY.md #296),
/// as on stdio. The body is read whole here, within the cap rmcp then reads it within.
async fn refuse_duplicate_keys(req: Request, max_body: usize) -> Result<Request, Response> {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, max_body).await {
        Ok(b) => b,
        Err(_) => {
            return Err((
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "Payload Too Large: request body exceeds {max_body} bytes (or was cut off)"
                ),
            )
                .into_response());
        }
    };
    if let Some(dup) = crate::dup_keys::duplicate_key(&bytes) {
        let refusal = crate::stdio::refuse_duplicate(&bytes, dup);
        return Err(json_response(
            StatusCode::BAD_REQUEST,
            &serde_json::json!({
                "jsonrpc": "2.0",
                "id": refusal.id,
                "error": {"code": refusal.code, "message": refusal.message},
            }),
        ));
    }
    Ok(Request::from_parts(parts, axum::body::Body::from(bytes)))
}

/// 404 for an `Mcp-Session-Id` this server does not hold (or that is another principal's: the
/// same answer), with a JSON-RPC error that says what happened and what to do.
fn session_not_found() -> Response {
    json_response(
        StatusCode::NOT_FOUND,
        &serde_json::json!({
            "jsonrpc": "2.0",
            "id": null,
            "error": {
                "code": -32001,
                "message": "Session not found: this server holds no protocol session with this \
                            Mcp-Session-Id (it was closed or expired, or the replica that held \
                            it was restarted or lost); start a new one with initialize: its \
                            Python sessions are new",
            },
        }),
    )
}

/// Forgets the owners of protocol sessions rmcp has closed (idle, or the client went away).
async fn prune_owners(gate: Arc<Gate>, sessions: Arc<LocalSessionManager>) {
    use rmcp::transport::streamable_http_server::SessionManager as _;
    let mut tick = tokio::time::interval(Duration::from_secs(30));
    loop {
        tick.tick().await;
        let ids: Vec<String> = lock(&gate.owners).keys().cloned().collect();
        for id in ids {
            let alive = sessions
                .has_session(&Arc::<str>::from(id.as_str()))
                .await
                .unwrap_or(true);
            if !alive {
                lock(&gate.owners).remove(&id);
            }
        }
    }
}

/// 401 with the `WWW-Authenticate` challenge the MCP authorization spec asks for.
fn unauthorized(gate: &Gate, headers: &HeaderMap, error: &AuthError) -> Response {
    let metadata = format!(
        "{}/.well-known/oauth-protected-resource/mcp",
        base_url(gate, headers)
    );
    let (challenge, body) = match error {
        AuthError::Missing => (
            format!("Bearer resource_metadata=\"{metadata}\""),
            serde_json::json!({
                "error": "unauthorized",
                "error_description": "this server needs a bearer token: Authorization: Bearer <token>",
            }),
        ),
        AuthError::Invalid(why) => {
            let why: String = why
                .chars()
                .filter(|c| *c != '"' && *c != '\\' && !c.is_control())
                .collect();
            (
                format!(
                    "Bearer resource_metadata=\"{metadata}\", error=\"invalid_token\", error_description=\"{why}\""
                ),
                serde_json::json!({"error": "invalid_token", "error_description": why}),
            )
        }
    };
    tracing::info!(reason = ?error, "refused a request without a valid token");
    let mut response = json_response(StatusCode::UNAUTHORIZED, &body);
    if let Ok(v) = HeaderValue::from_str(&challenge) {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, v);
    }
    response
}

/// RFC 9728 protected-resource metadata.
async fn resource_metadata(State(gate): State<Arc<Gate>>, headers: HeaderMap) -> Response {
    let base = base_url(&gate, &headers);
    let mut doc = serde_json::json!({
        "resource": format!("{base}/mcp"),
        "bearer_methods_supported": ["header"],
        "resource_name": "ironcell",
    });
    if let Some(issuer) = gate.auth.issuer() {
        doc["authorization_servers"] = serde_json::json!([issuer]);
    }
    json_response(StatusCode::OK, &doc)
}

fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// 200 while accepting work, 503 once draining.
async fn healthz(State(gate): State<Arc<Gate>>) -> Response {
    if gate.drain.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response()
    } else {
        (StatusCode::OK, "ok\n").into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(http: &str) -> ServeArgs {
        ServeArgs {
            http: Some(http.into()),
            ..ServeArgs::default()
        }
    }

    #[tokio::test]
    async fn off_loopback_without_auth_is_refused_naming_the_flags() {
        let e = authenticator(&args("0.0.0.0:1"), false, "0.0.0.0:1")
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("--auth-tokens") && e.contains("--auth-jwks"),
            "{e}"
        );
        let mut a = args("0.0.0.0:1");
        a.auth = Some(AuthNone::None);
        let e = authenticator(&a, false, "0.0.0.0:1")
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("loopback"), "{e}");
        let e = authenticator(&args("127.0.0.1:1"), true, "127.0.0.1:1")
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--auth none"), "{e}");
        let mut a = args("127.0.0.1:1");
        a.auth = Some(AuthNone::None);
        assert!(authenticator(&a, true, "127.0.0.1:1").await.is_ok());
        let mut a = args("127.0.0.1:1");
        a.auth_jwks = Some("/nonexistent".into());
        let e = authenticator(&a, true, "x")
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--auth-issuer"), "{e}");
    }

    #[test]
    fn urls_give_their_host() {
        assert_eq!(
            url_host("https://h.example:8443/x").as_deref(),
            Some("h.example:8443")
        );
        assert_eq!(url_host("http://h").as_deref(), Some("h"));
        assert_eq!(url_host("nope"), None);
    }
}
