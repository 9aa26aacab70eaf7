//! Who is calling: a principal for every HTTP request, from a bearer token.
//!
//! Two modes, both read from files the operator owns:
//!
//! - **tokens** (`--auth-tokens FILE`): a JSON object mapping each principal's name to
//!   `"sha256:<hex of its token>"`. Tokens are never stored in clear; the file is read again
//!   whenever it changes (size, mtime, ctime or inode), and while it is unreadable or invalid no
//!   token is accepted (fail closed; the reason is logged).
//! - **OAuth 2.1 resource server** (`--auth-jwks`, `--auth-issuer`, `--auth-audience`): a bearer
//!   JWT signed by one of the issuer's public keys, with the right `iss` and `aud`, not expired;
//!   its `sub` is the principal. Only asymmetric algorithms are accepted (RS*, PS*, ES256,
//!   ES384, EdDSA), and each only with a key of its own family: `alg: none` cannot even be
//!   parsed, and an HS256 token "signed" with the public key finds no key to check it with.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use sha2::Digest;

use crate::lock;

/// The longest bearer token read (a JWT with many claims is a few KiB).
const MAX_TOKEN_BYTES: usize = 16 << 10;
/// The longest principal name (a token file's key, a JWT's `sub`).
pub const MAX_PRINCIPAL_CHARS: usize = 256;
/// Clock skew allowed on `exp` and `nbf`.
const LEEWAY_S: u64 = 30;
/// How often a JWKS fetched from a URL is fetched again, and how soon after a token names an
/// unknown key id (the issuer rotated its keys) it may be fetched again.
const JWKS_REFRESH: Duration = Duration::from_secs(600);
const JWKS_REFETCH_ON_UNKNOWN_KID: Duration = Duration::from_secs(30);

/// An authenticated caller: a token file's key, or a JWT's `sub`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Principal(pub Arc<str>);

impl Principal {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Why a request was not authenticated: shown in the 401's `error_description` (short, and
/// never echoing the token).
#[derive(Debug, Clone, PartialEq)]
pub enum AuthError {
    /// No `Authorization: Bearer` header at all.
    Missing,
    /// A token was given and refused.
    Invalid(String),
}

/// The asymmetric signature algorithms accepted, each with the key family that may check it.
const ALLOWED_ALGORITHMS: &[Algorithm] = &[
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
    Algorithm::ES256,
    Algorithm::ES384,
    Algorithm::EdDSA,
];

pub enum Authenticator {
    /// `--auth none` on a loopback address: every request is the one local principal.
    None,
    Tokens(TokenFile),
    Jwt(JwtVerifier),
}

/// The principal every request has under `--auth none`.
pub const LOCAL_PRINCIPAL: &str = "local";

impl Authenticator {
    /// The principal behind an `Authorization` header value (`None`: no header).
    pub async fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Principal, AuthError> {
        if let Authenticator::None = self {
            return Ok(Principal(LOCAL_PRINCIPAL.into()));
        }
        let token = bearer_token(authorization)?;
        match self {
            Authenticator::None => Ok(Principal(LOCAL_PRINCIPAL.into())),
            Authenticator::Tokens(t) => t.principal_for(token),
            Authenticator::Jwt(j) => j.principal_for(token).await,
        }
    }

    /// The issuer to name in the protected-resource metadata, if any.
    pub fn issuer(&self) -> Option<&str> {
        match self {
            Authenticator::Jwt(j) => Some(&j.issuer),
            _ => None,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Authenticator::None => "none (loopback only)".into(),
            Authenticator::Tokens(t) => format!("tokens from {}", t.path.display()),
            Authenticator::Jwt(j) => format!(
                "JWTs from issuer {} for audience {} (keys: {})",
                j.issuer, j.audience, j.jwks
            ),
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header.
fn bearer_token(header: Option<&[u8]>) -> Result<&str, AuthError> {
    let Some(value) = header else {
        return Err(AuthError::Missing);
    };
    let value = std::str::from_utf8(value)
        .map_err(|_| AuthError::Invalid("the Authorization header is not text".into()))?;
    let (scheme, token) = value.trim().split_once(' ').unwrap_or((value, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::Invalid(
            "use the Bearer scheme: Authorization: Bearer <token>".into(),
        ));
    }
    let token = token.trim();
    if token.is_empty() {
        return Err(AuthError::Invalid("the bearer token is empty".into()));
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(AuthError::Invalid(format!(
            "the bearer token is longer than {MAX_TOKEN_BYTES} bytes"
        )));
    }
    Ok(token)
}

/// Whether `name` can be a principal: 1 to [`MAX_PRINCIPAL_CHARS`] characters, none of them
/// control characters.
pub fn valid_principal_name(name: &str) -> bool {
    let chars = name.chars().count();
    (1..=MAX_PRINCIPAL_CHARS).contains(&chars) && !name.chars().any(char::is_control)
}

/// What identifies one version of a file: re-read when any of it changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

fn stamp(path: &Path) -> std::io::Result<FileStamp> {
    let m = std::fs::metadata(path)?;
    Ok(FileStamp {
        ino: m.ino(),
        size: m.size(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

/// The largest token or JWKS file read.
const MAX_AUTH_FILE_BYTES: u64 = 4 << 20;

fn read_small_file(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let f =
        std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut bytes = Vec::new();
    f.take(MAX_AUTH_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_AUTH_FILE_BYTES {
        return Err(format!(
            "{} is larger than {MAX_AUTH_FILE_BYTES} bytes",
            path.display()
        ));
    }
    Ok(bytes)
}

/// `--auth-tokens FILE`: principal → `sha256:<hex>`, re-read when it changes.
pub struct TokenFile {
    path: PathBuf,
    loaded: Mutex<LoadedTokens>,
}

struct LoadedTokens {
    stamp: Option<FileStamp>,
    /// sha256 of a token → its principal; or why the file cannot be used.
    table: Result<HashMap<[u8; 32], Principal>, String>,
}

impl TokenFile {
    /// Reads the file once; a file that cannot be used stops `serve` from starting.
    pub fn open(path: &Path) -> Result<TokenFile, String> {
        let stamp = stamp(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let table = parse_token_file(&read_small_file(path)?)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if table.is_empty() {
            tracing::warn!(
                "{} lists no principal: every request will be refused until one is added",
                path.display()
            );
        }
        Ok(TokenFile {
            path: path.to_path_buf(),
            loaded: Mutex::new(LoadedTokens {
                stamp: Some(stamp),
                table: Ok(table),
            }),
        })
    }

    fn principal_for(&self, token: &str) -> Result<Principal, AuthError> {
        let digest: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
        let mut loaded = lock(&self.loaded);
        self.reload_if_changed(&mut loaded);
        match &loaded.table {
            Ok(table) => table
                .get(&digest)
                .cloned()
                .ok_or_else(|| AuthError::Invalid("unknown token".into())),
            Err(_) => Err(AuthError::Invalid(
                "the server's token file is invalid; its operator has been told why".into(),
            )),
        }
    }

    fn reload_if_changed(&self, loaded: &mut LoadedTokens) {
        let now = stamp(&self.path).ok();
        if now == loaded.stamp && now.is_some() {
            return;
        }
        loaded.stamp = now;
        loaded.table = read_small_file(&self.path)
            .and_then(|bytes| parse_token_file(&bytes))
            .map_err(|e| format!("{}: {e}", self.path.display()));
        match &loaded.table {
            Ok(t) => tracing::info!(
                principals = t.len(),
                "token file {} read again",
                self.path.display()
            ),
            Err(e) => tracing::error!(
                "{e}; no token is accepted until the file is fixed (a JSON object of \
                 principal name to \"sha256:<hex of the token>\")"
            ),
        }
    }
}

/// Parses a token file: `{"alice": "sha256:<64 hex>", ...}`.
pub fn parse_token_file(bytes: &[u8]) -> Result<HashMap<[u8; 32], Principal>, String> {
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes).map_err(|e| {
            format!("not a JSON object of principal name to \"sha256:<hex of the token>\" ({e})")
        })?;
    let mut table = HashMap::new();
    for (name, value) in map {
        if !valid_principal_name(&name) {
            return Err(format!(
                "principal name {name:?} must be 1 to {MAX_PRINCIPAL_CHARS} characters without control characters"
            ));
        }
        let hex = value
            .as_str()
            .and_then(|s| s.strip_prefix("sha256:"))
            .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| {
                format!(
                    "the token of {name:?} must be \"sha256:\" and 64 hex digits (the SHA-256 of \
                     the token; e.g. printf %s \"$TOKEN\" | sha256sum); tokens are never stored in clear"
                )
            })?;
        let mut digest = [0u8; 32];
        for (i, byte) in digest.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
        }
        if let Some(other) = table.insert(digest, Principal(name.as_str().into())) {
            return Err(format!(
                "principals {:?} and {name:?} have the same token; give each its own",
                other.as_str()
            ));
        }
    }
    Ok(table)
}

/// Where the issuer's public keys come from.
#[derive(Debug, Clone)]
pub enum JwksSource {
    File(PathBuf),
    Url(String),
}

impl std::fmt::Display for JwksSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JwksSource::File(p) => write!(f, "{}", p.display()),
            JwksSource::Url(u) => write!(f, "{u}"),
        }
    }
}

impl JwksSource {
    /// A URL (`https://`, or `http://` to a loopback address only: keys fetched in clear
    /// could be swapped on the way) or a file path.
    pub fn parse(s: &str) -> Result<JwksSource, String> {
        if s.starts_with("https://") {
            return Ok(JwksSource::Url(s.to_string()));
        }
        if let Some(rest) = s.strip_prefix("http://") {
            let host = rest.split(['/', '?', '#']).next().unwrap_or_default();
            let host = host.rsplit_once(':').map_or(host, |(h, port)| {
                if port.bytes().all(|b| b.is_ascii_digit()) {
                    h
                } else {
                    host
                }
            });
            let loopback = host == "localhost"
                || host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !loopback {
                return Err(format!(
                    "{s}: fetch the issuer's keys over https:// (plain http:// only from a loopback address)"
                ));
            }
            return Ok(JwksSource::Url(s.to_string()));
        }
        Ok(JwksSource::File(PathBuf::from(s)))
    }
}

/// One usable public key of the issuer.
pub struct Key {
    kid: Option<String>,
    /// The algorithm the JWK pins, if it names one.
    alg: Option<Algorithm>,
    /// The algorithms its family can check.
    family: &'static [Algorithm],
    key: DecodingKey,
}

struct Keys {
    keys: Vec<Key>,
    stamp: Option<FileStamp>,
    fetched: Instant,
    /// Why the last (re)load failed, if it did: the keys from before stay in use.
    problem: Option<String>,
}

/// The OAuth 2.1 resource server's check of bearer JWTs.
pub struct JwtVerifier {
    issuer: String,
    audience: String,
    jwks: JwksSource,
    keys: tokio::sync::Mutex<Keys>,
}

const RSA_ALGS: &[Algorithm] = &[
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
];

/// The keys of a JWKS document that can check an allowed algorithm; symmetric keys and
/// unsupported curves are refused (they have no place in a resource server's key set).
pub fn parse_jwks(bytes: &[u8]) -> Result<Vec<Key>, String> {
    let set: JwkSet = serde_json::from_slice(bytes)
        .map_err(|e| format!("not a JWKS document ({{\"keys\": [...]}}): {e}"))?;
    let mut keys = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        let kid = jwk.common.key_id.clone();
        let name = kid.clone().unwrap_or_else(|| format!("#{i}"));
        if matches!(
            jwk.common.public_key_use,
            Some(
                jsonwebtoken::jwk::PublicKeyUse::Encryption
                    | jsonwebtoken::jwk::PublicKeyUse::Other(_)
            )
        ) {
            tracing::warn!("JWKS key {name}: not a signature key (use), skipped");
            continue;
        }
        let family: &'static [Algorithm] = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => RSA_ALGS,
            AlgorithmParameters::EllipticCurve(p) => match p.curve {
                EllipticCurve::P256 => &[Algorithm::ES256],
                EllipticCurve::P384 => &[Algorithm::ES384],
                _ => {
                    tracing::warn!("JWKS key {name}: unsupported curve, skipped");
                    continue;
                }
            },
            AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => {
                &[Algorithm::EdDSA]
            }
            AlgorithmParameters::OctetKey(_) => {
                return Err(format!(
                    "key {name} is a symmetric (oct) key: a resource server checks tokens with \
                     the issuer's public keys only"
                ));
            }
            _ => {
                tracing::warn!("JWKS key {name}: unsupported key type, skipped");
                continue;
            }
        };
        let alg = match jwk.common.key_algorithm {
            None => None,
            Some(a) => match a.to_string().parse::<Algorithm>() {
                Ok(a) if family.contains(&a) => Some(a),
                _ => {
                    tracing::warn!(
                        "JWKS key {name}: its alg {a:?} does not fit its key type, skipped"
                    );
                    continue;
                }
            },
        };
        let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("key {name}: {e}"))?;
        keys.push(Key {
            kid,
            alg,
            family,
            key,
        });
    }
    if keys.is_empty() {
        return Err("it holds no usable public key (RSA, EC P-256/P-384 or Ed25519)".into());
    }
    Ok(keys)
}

/// The claims read from a token; the library checks `exp`, `nbf`, `iss` and `aud` itself.
#[derive(serde::Deserialize)]
struct Claims {
    sub: Option<serde_json::Value>,
}

impl JwtVerifier {
    /// Loads the keys once; keys that cannot be loaded stop `serve` from starting.
    pub async fn open(
        jwks: JwksSource,
        issuer: String,
        audience: String,
    ) -> Result<JwtVerifier, String> {
        let (keys, stamp) = load_jwks(&jwks).await?;
        Ok(JwtVerifier {
            issuer,
            audience,
            jwks,
            keys: tokio::sync::Mutex::new(Keys {
                keys,
                stamp,
                fetched: Instant::now(),
                problem: None,
            }),
        })
    }

    async fn principal_for(&self, token: &str) -> Result<Principal, AuthError> {
        let header = jsonwebtoken::decode_header(token).map_err(|e| {
            AuthError::Invalid(format!("not a signed JWT with an accepted algorithm ({e})"))
        })?;
        if !ALLOWED_ALGORITHMS.contains(&header.alg) {
            return Err(AuthError::Invalid(format!(
                "algorithm {:?} is not accepted; sign with an asymmetric one (RS256, ES256, EdDSA, ...)",
                header.alg
            )));
        }
        let mut validation = Validation::new(header.alg);
        validation.algorithms = vec![header.alg];
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[&self.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.leeway = LEEWAY_S;
        validation.validate_nbf = true;
        let mut keys = self.keys.lock().await;
        self.refresh(&mut keys, header.kid.as_deref()).await;
        let candidates: Vec<&Key> = keys
            .keys
            .iter()
            .filter(|k| header.kid.is_none() || k.kid == header.kid)
            .filter(|k| k.family.contains(&header.alg) && k.alg.is_none_or(|a| a == header.alg))
            .collect();
        if candidates.is_empty() {
            return Err(AuthError::Invalid(match &header.kid {
                Some(kid) => format!("no key {kid:?} of the issuer checks {:?}", header.alg),
                None => format!("no key of the issuer checks {:?}", header.alg),
            }));
        }
        let mut last = String::new();
        for key in candidates {
            match jsonwebtoken::decode::<Claims>(token, &key.key, &validation) {
                Ok(data) => {
                    let sub = match data.claims.sub {
                        Some(serde_json::Value::String(s)) if valid_principal_name(&s) => s,
                        _ => {
                            return Err(AuthError::Invalid(
                                "the token's sub must be a string of 1 to 256 characters".into(),
                            ));
                        }
                    };
                    return Ok(Principal(sub.into()));
                }
                Err(e) => {
                    use jsonwebtoken::errors::ErrorKind;
                    last = match e.kind() {
                        ErrorKind::ExpiredSignature => "the token has expired".into(),
                        ErrorKind::InvalidAudience => "the token is for another audience".into(),
                        ErrorKind::InvalidIssuer => "the token is from another issuer".into(),
                        ErrorKind::ImmatureSignature => "the token is not valid yet (nbf)".into(),
                        ErrorKind::InvalidSignature => "the signature does not verify".into(),
                        ErrorKind::MissingRequiredClaim(c) => format!("the token has no {c} claim"),
                        other => format!("the token is invalid ({other:?})"),
                    };
                    // Claims are checked after the signature: a wrong claim is final.
                    if !matches!(e.kind(), ErrorKind::InvalidSignature) {
                        break;
                    }
                }
            }
        }
        Err(AuthError::Invalid(last))
    }

    /// Reloads the keys if their file changed, or if fetched from a URL: every
    /// [`JWKS_REFRESH`], or sooner when a token names a key id not in the set (rotation).
    async fn refresh(&self, keys: &mut Keys, kid: Option<&str>) {
        let due = match &self.jwks {
            JwksSource::File(path) => {
                let now = stamp(path).ok();
                now.is_none() || now != keys.stamp
            }
            JwksSource::Url(_) => {
                let unknown_kid =
                    kid.is_some_and(|kid| !keys.keys.iter().any(|k| k.kid.as_deref() == Some(kid)));
                let age = keys.fetched.elapsed();
                age > JWKS_REFRESH || (unknown_kid && age > JWKS_REFETCH_ON_UNKNOWN_KID)
            }
        };
        if !due {
            return;
        }
        keys.fetched = Instant::now();
        match load_jwks(&self.jwks).await {
            Ok((fresh, stamp)) => {
                tracing::info!(keys = fresh.len(), "issuer keys loaded from {}", self.jwks);
                keys.keys = fresh;
                keys.stamp = stamp;
                keys.problem = None;
            }
            Err(e) => {
                if let JwksSource::File(path) = &self.jwks {
                    keys.stamp = stamp(path).ok();
                }
                if keys.problem.as_deref() != Some(&e) {
                    tracing::error!(
                        "issuer keys from {}: {e}; the keys read before stay in use",
                        self.jwks
                    );
                }
                keys.problem = Some(e);
            }
        }
    }
}

async fn load_jwks(source: &JwksSource) -> Result<(Vec<Key>, Option<FileStamp>), String> {
    let (bytes, stamp) = match source {
        JwksSource::File(path) => {
            let stamp = stamp(path).ok();
            (read_small_file(path)?, stamp)
        }
        JwksSource::Url(url) => (super::fetch::get(url, MAX_AUTH_FILE_BYTES).await?, None),
    };
    let keys = parse_jwks(&bytes).map_err(|e| format!("{source}: {e}"))?;
    Ok((keys, stamp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_files_hold_hashes_only() {
        let hex: String = sha2::Sha256::digest(b"s3cret")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let hash = format!("sha256:{hex}");
        let t = parse_token_file(format!(r#"{{"alice": "{hash}"}}"#).as_bytes()).unwrap();
        assert_eq!(t.len(), 1);
        for bad in [
            r#"{"alice": "s3cret"}"#,
            r#"{"alice": "sha256:abc"}"#,
            r#"{"": "sha256:0000000000000000000000000000000000000000000000000000000000000000"}"#,
            r#"["alice"]"#,
        ] {
            assert!(parse_token_file(bad.as_bytes()).is_err(), "{bad}");
        }
        let same = format!(r#"{{"a": "{hash}", "b": "{hash}"}}"#);
        assert!(
            parse_token_file(same.as_bytes())
                .unwrap_err()
                .contains("same token")
        );
    }

    #[test]
    fn bearer_tokens_are_read_from_the_header() {
        assert_eq!(bearer_token(Some(b"Bearer abc")), Ok("abc"));
        assert_eq!(bearer_token(Some(b"bearer  abc ")), Ok("abc"));
        assert_eq!(bearer_token(None), Err(AuthError::Missing));
        assert!(bearer_token(Some(b"Basic abc")).is_err());
        assert!(bearer_token(Some(b"Bearer ")).is_err());
    }

    #[test]
    fn jwks_urls_are_https_or_loopback() {
        assert!(matches!(
            JwksSource::parse("https://idp.example/jwks"),
            Ok(JwksSource::Url(_))
        ));
        assert!(matches!(
            JwksSource::parse("http://127.0.0.1:9/k"),
            Ok(JwksSource::Url(_))
        ));
        assert!(matches!(
            JwksSource::parse("http://[::1]:9/k"),
            Ok(JwksSource::Url(_))
        ));
        assert!(matches!(
            JwksSource::parse("http://localhost/k"),
            Ok(JwksSource::Url(_))
        ));
        assert!(JwksSource::parse("http://idp.example/jwks").is_err());
        assert!(JwksSource::parse("http://127.0.0.1.evil.example/jwks").is_err());
        assert!(matches!(
            JwksSource::parse("/etc/jwks.json"),
            Ok(JwksSource::File(_))
        ));
    }

    #[test]
    fn a_symmetric_key_in_the_jwks_is_refused() {
        let jwks = br#"{"keys":[{"kty":"oct","k":"c2VjcmV0","kid":"h"}]}"#;
        assert!(parse_jwks(jwks).is_err());
    }
}
