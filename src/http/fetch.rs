//! Fetching the issuer's JWKS from a URL (`--auth-jwks https://…`): one GET, a size cap, a
//! timeout, no redirects off HTTPS.

use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(10);

/// The body of `url`, at most `max` bytes.
pub async fn get(url: &str, max: u64) -> Result<Vec<u8>, String> {
    // rustls's process-wide provider: ring (installing twice is harmless). ring has no
    // post-quantum key exchange, hence the deprecation; a public key set needs integrity, which
    // the server's certificate gives, not long-term secrecy.
    #[allow(deprecated)]
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .timeout(TIMEOUT)
        .redirect(reqwest::redirect::Policy::limited(3))
        .https_only(url.starts_with("https://"))
        .build()
        .map_err(|e| format!("cannot make an HTTP client: {e}"))?;
    let mut response = client
        .get(url)
        .header("accept", "application/json")
        .send()
        .await
        .map_err(|e| format!("fetching {url}: {e}"))?;
    if !response.status().is_success() {
        return Err(format!("fetching {url}: HTTP {}", response.status()));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("reading {url}: {e}"))?
    {
        body.extend_from_slice(&chunk);
        if body.len() as u64 > max {
            return Err(format!("{url} is larger than {max} bytes"));
        }
    }
    Ok(body)
}
