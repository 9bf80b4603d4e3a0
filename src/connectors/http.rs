//! `http_call`'s client: one reqwest client per HTTP connector version
//! (rustls with the ring provider), with the connector's headers and auth
//! prepared once, the SSRF guard wired into DNS resolution and redirects, and
//! one attempt per [`HttpConn::send`] (the retries and the breaker are the
//! caller's, in `policy`).

use super::ssrf;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value as Json;
use sluice_compiler::def::{HttpAuth, HttpConnector};
use sluice_compiler::validate::{is_secret_header, is_secret_query_param};
use sluice_runtime::connectors::{CallScope, ConnectorError, ConnectorErrorKind, HttpRequest};
use std::sync::{Arc, Once};
use std::time::Duration;

/// Process-wide settings of HTTP connectors (from the service config).
#[derive(Debug, Clone, Copy)]
pub struct HttpSettings {
    /// `security.allow_private_networks`: switches the SSRF guard off.
    pub allow_private_networks: bool,
    /// `engine.global_http_timeout_secs`: a connector's default call timeout.
    pub default_timeout: Duration,
}

/// An HTTP connector ready to call: built from a config whose `env://`
/// strings are already resolved. Secrets live only in marked-sensitive
/// header values and are never formatted into messages.
pub struct HttpConn {
    name: String,
    client: reqwest::Client,
    base: String,
    /// The base URL parsed once (`keeps_base` compares every call's URL
    /// with it); `None` when it does not parse (every call then fails).
    base_url: Option<reqwest::Url>,
    headers: HeaderMap,
    timeout: Duration,
    guarded: bool,
    /// The base URL's host when the URL came from the environment
    /// (`env://`): an SSRF refusal of it gives the reason, not the host.
    env_host: Option<String>,
    /// The connector's credentials as sent (token, password, key, the
    /// values of credential headers, the URL's password and secret query
    /// values; at least 4 characters, longest first): masked by value in
    /// the upstream's error text an error message quotes, since an
    /// upstream may echo what it was sent ("denied for Bearer …").
    secrets: Vec<String>,
    /// The client that follows redirects within the origin only: `client`
    /// itself for a connector with credentials; used too for a call whose
    /// task adds a credential header.
    strict: reqwest::Client,
}

/// rustls needs one process-wide crypto provider; ring is the one sqlx
/// already links, so no second (aws-lc) implementation is built. Called at
/// start-up too: any reqwest client in the process (tests' included) panics
/// on build without a provider, since reqwest is built without its own.
pub fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err means another provider was installed first, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

fn config_error(connector: &str, what: impl std::fmt::Display) -> ConnectorError {
    ConnectorError::other(format!("connector '{connector}': {what}"))
}

fn header_name(connector: &str, name: &str) -> Result<HeaderName, ConnectorError> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| config_error(connector, format!("'{name}' is not a valid header name")))
}

/// A header value that may hold a secret: marked sensitive (kept out of
/// debug output and HPACK tables) and never echoed in an error.
fn secret_value(connector: &str, header: &str, v: &str) -> Result<HeaderValue, ConnectorError> {
    let mut value = HeaderValue::from_str(v).map_err(|_| {
        config_error(
            connector,
            format!("the value of header '{header}' is not a valid header value"),
        )
    })?;
    value.set_sensitive(true);
    Ok(value)
}

impl HttpConn {
    /// `from_env`: the values the config took from the environment, masked
    /// like credentials wherever they would show.
    pub fn build(
        name: &str,
        cfg: &HttpConnector,
        settings: &HttpSettings,
        from_env: &[String],
    ) -> Result<HttpConn, ConnectorError> {
        install_crypto_provider();
        let url = reqwest::Url::parse(&cfg.url)
            .map_err(|e| config_error(name, format!("url is not a valid URL ({e})")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(config_error(name, "url must be http:// or https://"));
        }
        // What the definition check refuses in a written URL, for one read
        // from the environment (audit 103: `env://` with `…/#x` sent every
        // call to the base URL).
        if cfg.url.contains('#') {
            return Err(config_error(
                name,
                "url must not hold a fragment ('#…'): a request never carries one",
            ));
        }
        if cfg.url.contains(char::is_whitespace) {
            return Err(config_error(name, "url must not contain whitespace"));
        }
        let mut headers = HeaderMap::new();
        let mut secrets: Vec<String> = Vec::new();
        for (k, v) in &cfg.headers {
            headers.insert(header_name(name, k)?, secret_value(name, k, v)?);
            if is_secret_header(k) {
                secrets.push(v.clone());
                // `Bearer <token>`: the token alone too.
                if let Some((_, last)) = v.rsplit_once(' ') {
                    secrets.push(last.to_owned());
                }
            }
        }
        match &cfg.auth {
            None => {}
            Some(HttpAuth::Bearer { token }) => {
                let v = secret_value(name, "authorization", &format!("Bearer {token}"))?;
                headers.insert(reqwest::header::AUTHORIZATION, v);
                secrets.push(token.clone());
            }
            Some(HttpAuth::Basic { username, password }) => {
                let encoded = base64(&format!("{username}:{password}"));
                let v = secret_value(name, "authorization", &format!("Basic {encoded}"))?;
                headers.insert(reqwest::header::AUTHORIZATION, v);
                secrets.extend([password.clone(), encoded]);
            }
            Some(HttpAuth::ApiKey { header, key }) => {
                headers.insert(header_name(name, header)?, secret_value(name, header, key)?);
                secrets.push(key.clone());
            }
        }
        if let Some(password) = url.password() {
            let user = crate::server::decode(url.username());
            let decoded = crate::server::decode(password);
            // The client sends a URL's user and password as Basic auth, so
            // an echo of the request shows them base64-encoded.
            secrets.push(base64(&format!("{user}:{decoded}")));
            secrets.push(password.to_owned());
            secrets.push(decoded.into_owned());
        } else if !url.username().is_empty() {
            // A user alone is an API key sent as Basic auth
            // (`https://sk_live_…@api.example.com`), masked like a password.
            let user = crate::server::decode(url.username());
            secrets.push(base64(&format!("{user}:")));
            secrets.push(url.username().to_owned());
            secrets.push(user.into_owned());
        }
        // Secret query values as sent (percent-encoded) and decoded.
        for pair in url.query().unwrap_or_default().split('&') {
            if let Some((k, raw)) = pair.split_once('=')
                && is_secret_query_param(&crate::server::decode(k))
            {
                secrets.push(raw.to_owned());
                secrets.push(crate::server::decode(&raw.replace('+', " ")).into_owned());
            }
        }
        // A connector with credentials follows redirects within its origin
        // only (see `ssrf::redirect_policy`); so does a call whose task
        // adds a credential header (`strict`).
        let keep_origin = !secrets.is_empty();
        // What came from the environment is masked whatever its field: a
        // URL's path and query alone too (a webhook URL's secret part,
        // echoed as the request line).
        for value in from_env {
            secrets.push(value.clone());
            if let Ok(u) = reqwest::Url::parse(value) {
                if u.path().len() > 1 {
                    secrets.push(u.path().to_owned());
                }
                if let Some(q) = u.query() {
                    secrets.push(q.to_owned());
                }
            }
        }
        let secrets = super::secret_forms(secrets);
        let env_host = from_env
            .contains(&cfg.url)
            .then(|| {
                url.host_str()
                    .map(|h| h.trim_matches(['[', ']']).to_owned())
            })
            .flatten();
        let timeout = cfg
            .timeout_ms
            .map_or(settings.default_timeout, Duration::from_millis);
        let guarded = !settings.allow_private_networks;
        // No proxy: a proxy would resolve the target itself, past the guard.
        // No `Referer` on redirects: it would carry the base URL (and its
        // query, which may hold a key) to the next host.
        let build = |keep_origin: bool| {
            let mut builder = reqwest::Client::builder()
                .no_proxy()
                .connect_timeout(timeout)
                .timeout(timeout)
                .referer(false)
                .redirect(ssrf::redirect_policy(guarded, keep_origin))
                .user_agent(concat!("sluice/", env!("CARGO_PKG_VERSION")));
            if guarded {
                builder = builder.dns_resolver(Arc::new(ssrf::GuardedResolver));
            }
            builder
                .build()
                .map_err(|e| config_error(name, format!("cannot build an HTTP client ({e})")))
        };
        let strict = build(true)?;
        let client = if keep_origin {
            strict.clone()
        } else {
            build(false)?
        };
        Ok(HttpConn {
            name: name.to_owned(),
            client,
            // As configured: without a task path the base is called as it
            // stands (`/hook/` and `/hook` may be different endpoints).
            base: cfg.url.clone(),
            base_url: reqwest::Url::parse(cfg.url.trim_end_matches('/')).ok(),
            headers,
            timeout,
            guarded,
            env_host,
            secrets,
            strict,
        })
    }

    /// `text` with every credential of the connector (and `more`, the
    /// task's own credential header values) replaced by `******`.
    fn scrub(&self, text: String, more: &[String]) -> String {
        let text = super::mask_values(&text, &self.secrets);
        super::mask_values(&text, more)
    }

    /// [`Self::scrub`] over every string and key of an answer.
    fn scrub_json(&self, value: &mut Json, more: &[String]) {
        let hit = |t: &str| {
            self.secrets
                .iter()
                .chain(more)
                .any(|s| t.contains(s.as_str()))
        };
        match value {
            Json::String(t) if hit(t) => *t = self.scrub(std::mem::take(t), more),
            Json::Array(items) => items.iter_mut().for_each(|v| self.scrub_json(v, more)),
            Json::Object(members) if members.keys().any(|k| hit(k)) => {
                let old = std::mem::take(members);
                for (k, mut v) in old {
                    self.scrub_json(&mut v, more);
                    members.insert(self.scrub(k, more), v);
                }
            }
            Json::Object(members) => members.values_mut().for_each(|v| self.scrub_json(v, more)),
            _ => {}
        }
    }

    /// The URL of a call: `path` appended to the base URL's path with
    /// exactly one slash between them; a query of the base URL (a key
    /// passed as `?api_key=…`) stays a query, joined with the path's own
    /// (before, the path was appended inside it: `/api?api_key=K/x`).
    fn url(&self, path: Option<&str>) -> String {
        let (base, base_query) = match self.base.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (self.base.as_str(), None),
        };
        // A `#` in the task's path is data (an id such as `A#1`), never a
        // fragment (a request sends none): kept as `%23`. Read as a
        // fragment it cut the path there and dropped the base URL's query,
        // where credentials often are.
        let escaped;
        let path = match path {
            Some(p) if p.contains('#') => {
                escaped = p.replace('#', "%23");
                Some(escaped.as_str())
            }
            other => other,
        };
        let (path, query) = match path {
            None => ("", None),
            Some(p) => match p.split_once('?') {
                Some((p, q)) => (p, Some(q)),
                None => (p, None),
            },
        };
        let mut url = String::with_capacity(self.base.len() + path.len() + 16);
        if path.is_empty() {
            // The base as configured (`/hook/` and `/hook` may differ).
            url.push_str(base);
        } else {
            url.push_str(base.trim_end_matches('/'));
            url.push('/');
            url.push_str(path.trim_start_matches('/'));
        }
        let queries = [base_query, query];
        for (i, q) in queries
            .iter()
            .flatten()
            .filter(|q| !q.is_empty())
            .enumerate()
        {
            url.push(if i == 0 { '?' } else { '&' });
            url.push_str(q);
        }
        url
    }

    /// Whether `url` (parsed, so `..` and `%2E%2E` segments are resolved)
    /// is still under the base URL: the path is appended to the base, and
    /// a computed path (`path_logic` over request data) must not reach the
    /// upstream's other endpoints.
    fn keeps_base(&self, url: &reqwest::Url) -> bool {
        let Some(base) = &self.base_url else {
            return true;
        };
        let base_path = base.path().trim_end_matches('/');
        let path = url.path();
        url.origin() == base.origin()
            && (base_path.is_empty()
                || path == base_path
                || path
                    .strip_prefix(base_path)
                    .is_some_and(|rest| rest.starts_with('/')))
    }

    /// One attempt of `req`.
    pub async fn send(&self, scope: &CallScope, req: &HttpRequest) -> Result<Json, ConnectorError> {
        let method = req.method.as_str();
        // Messages name the connector, method and the task's path, never the
        // (possibly env-resolved, credential-bearing) base URL.
        let what = format!(
            "connector '{}': {method} {}",
            self.name,
            req.path.as_deref().unwrap_or("/")
        );
        let url = reqwest::Url::parse(&self.url(req.path.as_deref()))
            .map_err(|e| ConnectorError::other(format!("{what}: not a valid URL ({e})")))?;
        if !self.keeps_base(&url) {
            return Err(ConnectorError::other(format!(
                "{what}: the path leaves the connector's base URL ('..' segments)"
            )));
        }
        if self.guarded {
            ssrf::check_url(&url).map_err(|r| {
                ConnectorError::other(format!("{what}: {}", r.hiding(self.env_host.as_deref())))
            })?;
        }
        // Connector headers (and auth) first, then the task's; a task header
        // replaces a connector header of the same name.
        let mut headers = self.headers.clone();
        for (k, v) in &req.headers {
            let name = HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
                ConnectorError::other(format!("{what}: '{k}' is not a valid header name"))
            })?;
            let value = HeaderValue::from_str(v).map_err(|_| {
                ConnectorError::other(format!("{what}: header '{k}' has an invalid value"))
            })?;
            headers.insert(name, value);
        }
        // Definitions stored before these were refused may still hold one;
        // the client writes them from the request itself.
        for name in sluice_compiler::validate::FRAMING_HEADERS {
            headers.remove(*name);
        }
        // Sluice decodes no content coding: asked for none, an upstream
        // that compresses anyway gets a clear 502 below, not a parse error
        // or binary text in the data (audit 101).
        headers
            .entry(http::header::ACCEPT_ENCODING)
            .or_insert(HeaderValue::from_static("identity"));
        inject_trace_context(&mut headers, scope);
        // The tighter of the task's timeout_ms and the connector's timeout.
        let timeout = self
            .timeout
            .min(Duration::from_millis(req.timeout_ms.max(1)));
        let method = reqwest::Method::from_bytes(method.as_bytes())
            .map_err(|_| ConnectorError::other(format!("{what}: invalid method")))?;
        // A credential header the task adds: kept to the origin too, and
        // masked in error text like the connector's own.
        let task_secrets = super::secret_forms(
            req.headers
                .iter()
                .filter(|(k, _)| is_secret_header(k))
                .flat_map(|(_, v)| {
                    [
                        v.clone(),
                        v.rsplit(' ').next().unwrap_or_default().to_owned(),
                    ]
                }),
        );
        let client = if task_secrets.is_empty() {
            &self.client
        } else {
            &self.strict
        };
        let mut builder = client
            .request(method, url)
            .headers(headers)
            .timeout(timeout);
        if let Some(body) = &req.body {
            builder = builder.json(body);
        }
        let response = builder
            .send()
            .await
            .map_err(|e| transport_error(&what, timeout, e, self.env_host.as_deref()))?;
        let status = response.status();
        // Only a body that is read matters: a failed status keeps its own
        // retry decision, a discarded body its success (audit 103).
        let coding = response
            .headers()
            .get(http::header::CONTENT_ENCODING)
            .map(|v| v.as_bytes().trim_ascii())
            .filter(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity"))
            .map(|c| String::from_utf8_lossy(c).into_owned());
        let declared_json = response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json_type);
        let code = status.as_u16();
        // How long a 429 or 503 asks us to wait: a retry waits at least
        // that (see `policy::Policy::call`).
        let wait = if code == 429 || code == 503 {
            retry_after(response.headers())
        } else {
            None
        };
        let bytes = read_capped(response, &what, timeout).await?;
        if status.is_success() {
            if let Some(coding) = coding.filter(|_| req.keep_body && !bytes.is_empty()) {
                return Err(ConnectorError::new(
                    ConnectorErrorKind::Upstream,
                    format!(
                        "{what} answered HTTP {} with a body in Content-Encoding '{coding}', which Sluice does not decode (it asks for identity)",
                        status.as_u16()
                    ),
                ));
            }
            // A body that is discarded (no `response_path`) need not parse.
            let mut body = parse_body(&bytes, declared_json && req.keep_body).map_err(|why| {
                ConnectorError::new(
                    ConnectorErrorKind::Upstream,
                    format!(
                        "{what} answered HTTP {} with a JSON body that does not parse: {why}",
                        status.as_u16()
                    ),
                )
            })?;
            // An upstream that echoes what it was sent (an echo service, a
            // debug endpoint, a "you are ..." answer) must not bring the
            // connector's credentials into the workflow's data, and from
            // there into answers, traces and logs: a resolved `env://`
            // value never appears anywhere.
            if !self.secrets.is_empty() || !task_secrets.is_empty() {
                self.scrub_json(&mut body, &task_secrets);
            }
            return Ok(body);
        }
        // Retryable: the server is overloaded or failing (5xx), asks us to
        // slow down (429), or timed out reading our request (408). Any other
        // 4xx will fail the same way again.
        let retryable = status.is_server_error() || code == 429 || code == 408;
        Err(ConnectorError::new(
            ConnectorErrorKind::Upstream,
            format!(
                "{what} answered HTTP {code}{}",
                // Masked whole, then cut: a secret across the cut is masked.
                snippet(&self.scrub(String::from_utf8_lossy(&bytes).into_owned(), &task_secrets))
            ),
        )
        .retryable(retryable)
        .retry_after(wait))
    }
}

/// A `Retry-After` header's wait: delay-seconds, or an HTTP date (a date
/// already past is no wait). `None` when absent or unreadable.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at =
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc2822).ok()?;
    let left = at - time::OffsetDateTime::now_utc();
    Some(Duration::try_from(left).unwrap_or(Duration::ZERO))
}

/// The largest response body an `http_call` reads (16 MiB): a larger one
/// fails the call once the limit is passed, without reading the rest.
/// Before, the whole body was read first (an upstream answering 200 MB grew
/// the service by 500 MB, and the execution then refused the result).
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// Reads a response body of at most [`MAX_RESPONSE_BYTES`] (refused at once
/// when its `Content-Length` says more).
async fn read_capped(
    mut response: reqwest::Response,
    what: &str,
    timeout: Duration,
) -> Result<bytes::Bytes, ConnectorError> {
    // The upstream's answer: a 502, as for any answer that cannot be used
    // (audit 101: it was a 500).
    let too_large = || {
        ConnectorError::new(
            ConnectorErrorKind::Upstream,
            format!(
                "{what}: the response body is larger than {} MiB",
                MAX_RESPONSE_BYTES >> 20
            ),
        )
    };
    if response
        .content_length()
        .is_some_and(|n| n > MAX_RESPONSE_BYTES as u64)
    {
        return Err(too_large());
    }
    let mut body = bytes::BytesMut::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| transport_error(what, timeout, e, None))?
    {
        if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// Standard base64 (RFC 4648, padded): how Basic auth sends `user:password`.
fn base64(text: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// The response body as JSON when it parses, else as a string; an empty body
/// is `null`. A body whose `Content-Type` says JSON and that does not parse
/// (a number beyond a double, nesting deeper than 128 levels, a cut-off
/// document) is an error: kept as text, the workflow would read `null`
/// from it without a word.
fn parse_body(bytes: &[u8], declared_json: bool) -> Result<Json, String> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Json::Null);
    }
    match serde_json::from_slice(bytes) {
        Ok(json) => Ok(json),
        Err(e) if declared_json => Err(e.to_string()),
        Err(_) => Ok(Json::String(String::from_utf8_lossy(bytes).into_owned())),
    }
}

/// `application/json` and the `+json` types (`application/problem+json`),
/// parameters and case aside.
fn is_json_type(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence
            .rsplit_once('+')
            .is_some_and(|(_, suffix)| suffix.eq_ignore_ascii_case("json"))
}

/// Secrets worth masking by value: at least 6 characters (shorter ones
/// match ordinary words: a `X-Idempotency-Key: json` masked "invalid json"),
/// longest first, each once.
/// The start of an error body, for the task error message.
fn snippet(text: &str) -> String {
    const MAX: usize = 200;
    let text = text.trim();
    if text.is_empty() {
        return String::new();
    }
    let cut: String = text.chars().take(MAX).collect();
    let more = if cut.len() < text.len() { "…" } else { "" };
    format!(": {cut}{more}")
}

/// Maps a reqwest failure: the SSRF guard's refusal is final; a timeout is
/// `Timeout`; everything else on the wire (connect, reset, truncated body)
/// is an upstream failure worth retrying. reqwest's message would end with
/// "for url (...)", the full URL: it is dropped, as messages never carry
/// the base URL (it may hold credentials); a refusal of `env_host` (the
/// base URL's host, taken from the environment) does not name it.
fn transport_error(
    what: &str,
    timeout: Duration,
    e: reqwest::Error,
    env_host: Option<&str>,
) -> ConnectorError {
    let e = &e.without_url();
    if let Some(refused) = ssrf::find_refused(e) {
        return ConnectorError::other(format!("{what}: {}", refused.hiding(env_host)));
    }
    if e.is_timeout() {
        return ConnectorError::new(
            ConnectorErrorKind::Timeout,
            format!("{what} timed out after {} ms", timeout.as_millis()),
        );
    }
    if e.is_builder() {
        return ConnectorError::other(format!("{what}: {e}"));
    }
    if e.is_redirect() {
        return ConnectorError::new(
            ConnectorErrorKind::Upstream,
            format!("{what}: {}", chain(e)),
        );
    }
    let kind = if e.is_connect() {
        "cannot connect"
    } else {
        "request failed"
    };
    ConnectorError::new(
        ConnectorErrorKind::Upstream,
        format!("{what}: {kind} ({})", chain(e)),
    )
    .retryable(true)
}

/// An error and its sources on one line (reqwest's own message is terse).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cur = s.source();
    }
    out
}

/// W3C trace context: the connector call's span when the request is traced
/// (OpenTelemetry on and sampled); else the caller's `traceparent`/`tracestate`
/// when the scope has a valid one; else a fresh sampled `traceparent` (and no
/// state) so the receiver can still correlate its logs with this call.
pub(crate) fn trace_context(scope: &CallScope) -> (String, Option<String>) {
    // A traced request (OpenTelemetry): the connector call's own span.
    if let Some(traced) = crate::otel::outbound_context(scope) {
        return traced;
    }
    match scope
        .traceparent
        .as_deref()
        .and_then(crate::otel::forwardable_traceparent)
    {
        Some(t) => (t, scope.tracestate.clone()),
        None => (new_traceparent(), None),
    }
}

fn inject_trace_context(headers: &mut HeaderMap, scope: &CallScope) {
    let (traceparent, tracestate) = trace_context(scope);
    if let Ok(v) = HeaderValue::from_str(&traceparent) {
        headers.insert("traceparent", v);
    }
    if let Some(state) = tracestate
        && let Ok(v) = HeaderValue::from_str(&state)
    {
        headers.insert("tracestate", v);
    }
}

fn new_traceparent() -> String {
    let trace = uuid::Uuid::new_v4().simple().to_string();
    let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
    format!("00-{trace}-{span}-01")
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_compiler::plan::HttpMethod;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let wait = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                reqwest::header::RETRY_AFTER,
                HeaderValue::from_str(v).unwrap(),
            );
            retry_after(&h)
        };
        assert_eq!(wait("5"), Some(Duration::from_secs(5)));
        assert_eq!(wait(" 0 "), Some(Duration::ZERO));
        // A date already past asks for no wait; one ahead for the time left.
        assert_eq!(wait("Wed, 21 Oct 2015 07:28:00 GMT"), Some(Duration::ZERO));
        let ahead = time::OffsetDateTime::now_utc() + time::Duration::seconds(90);
        let text = ahead
            .format(&time::format_description::well_known::Rfc2822)
            .unwrap();
        let left = wait(&text).unwrap();
        assert!(
            left > Duration::from_secs(80) && left <= Duration::from_secs(90),
            "{left:?}"
        );
        assert_eq!(wait("soon"), None);
        assert_eq!(wait("-3"), None);
        assert_eq!(retry_after(&HeaderMap::new()), None);
    }

    fn settings(allow: bool) -> HttpSettings {
        HttpSettings {
            allow_private_networks: allow,
            default_timeout: Duration::from_secs(5),
        }
    }

    fn conn(url: &str, allow: bool) -> HttpConn {
        let cfg: HttpConnector = serde_json::from_value(serde_json::json!({"url": url})).unwrap();
        HttpConn::build("api", &cfg, &settings(allow), &[]).unwrap()
    }

    fn get(path: &str) -> HttpRequest {
        HttpRequest {
            connector: "api".into(),
            method: HttpMethod::Get,
            path: Some(path.into()),
            headers: vec![],
            body: None,
            timeout_ms: 2000,
            keep_body: true,
        }
    }

    /// Answers one request with `reply` and hands back what it received.
    async fn one_shot(
        reply: impl AsRef<[u8]> + Send + 'static,
    ) -> (String, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 8192];
            let n = sock.read(&mut buf).await.unwrap();
            sock.write_all(reply.as_ref()).await.unwrap();
            String::from_utf8_lossy(&buf[..n]).into_owned()
        });
        (format!("http://{addr}"), task)
    }

    fn conn_with(config: serde_json::Value) -> HttpConn {
        let cfg: HttpConnector = serde_json::from_value(config).unwrap();
        HttpConn::build("api", &cfg, &settings(true), &[]).unwrap()
    }

    /// An upstream that echoes the credentials it was sent in an error
    /// body ("denied for Bearer …") does not get them into the task error,
    /// which reaches data-plane callers and stored traces: each of the
    /// connector's credentials is masked by value.
    #[tokio::test]
    async fn credentials_echoed_in_an_error_body_are_masked() {
        let body = r#"{"error":"denied for Bearer TOKENzq81 with key KEYzq77 and pw P%40SSzq, P@SSzq, secret QKEYzq"}"#;
        let reply: &'static str = Box::leak(
            format!(
                "HTTP/1.1 401 Unauthorized\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_boxed_str(),
        );
        let (base, server) = one_shot(reply).await;
        let url = base.replace("http://", "http://user:P%40SSzq@") + "/v1?api_key=QKEYzq";
        let c = conn_with(serde_json::json!({"url": url,
            "auth": {"type": "bearer", "token": "TOKENzq81"},
            "headers": {"X-Api-Key": "KEYzq77", "Accept": "application/json"}}));
        let e = c.send(&CallScope::default(), &get("/x")).await.unwrap_err();
        let sent = server.await.unwrap();
        assert!(
            sent.contains("TOKENzq81") && sent.contains("KEYzq77"),
            "{sent}"
        );
        for secret in ["TOKENzq81", "KEYzq77", "P%40SSzq", "P@SSzq", "QKEYzq"] {
            assert!(!e.message.contains(secret), "{secret}: {}", e.message);
        }
        assert!(
            e.message
                .contains("denied for Bearer ****** with key ******"),
            "{}",
            e.message
        );
    }

    /// An upstream that echoes the request it received (request line and
    /// headers) in a 200 answer shows none of the connector's secrets in
    /// the forms it was sent them: a URL's user and password as Basic
    /// auth (base64), a percent-encoded query key as written, and any
    /// value taken from the environment, a URL's path included.
    #[tokio::test]
    async fn encoded_and_environment_secrets_are_masked_in_an_echo() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 8192];
            let n = sock.read(&mut buf).await.unwrap();
            let got = String::from_utf8_lossy(&buf[..n]).into_owned();
            let body = serde_json::json!({"echo": got}).to_string();
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            sock.write_all(reply.as_bytes()).await.unwrap();
            got
        });
        // As if `url` and the `X-Tenant` header came from `env://` values.
        let url = format!(
            "http://alice:plainpw99@{addr}/hook/T0001/webhooksecretXYZ?api_key=Sekr%2Ft%2Bv%3Dal99"
        );
        let cfg: HttpConnector = serde_json::from_value(serde_json::json!({"url": url,
            "headers": {"X-Tenant": "tenant-value-from-env"}}))
        .unwrap();
        let from_env = [url.clone(), "tenant-value-from-env".to_owned()];
        let c = HttpConn::build("api", &cfg, &settings(true), &from_env).unwrap();
        let mut req = get("");
        req.path = None;
        let answer = c.send(&CallScope::default(), &req).await.unwrap();
        let sent = server.await.unwrap();
        let basic = base64("alice:plainpw99");
        for secret in [
            basic.as_str(),
            "Sekr%2Ft%2Bv%3Dal99",
            "tenant-value-from-env",
            "/hook/T0001/webhooksecretXYZ",
        ] {
            assert!(sent.contains(secret), "not sent: {secret} in {sent}");
            assert!(!answer.to_string().contains(secret), "{secret}: {answer}");
        }
        assert!(
            answer["echo"].as_str().unwrap().contains("Basic ******"),
            "{answer}"
        );
    }

    /// Listens on a port and reports the first request it receives (or
    /// nothing within `wait`).
    async fn recorder(wait: Duration) -> (u16, tokio::task::JoinHandle<Option<String>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let (mut sock, _) = tokio::time::timeout(wait, listener.accept())
                .await
                .ok()?
                .ok()?;
            let mut buf = vec![0u8; 8192];
            let n = sock.read(&mut buf).await.ok()?;
            let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
            let _ = sock.write_all(reply).await;
            Some(String::from_utf8_lossy(&buf[..n]).into_owned())
        });
        (port, task)
    }

    fn redirect_to(port: u16) -> &'static str {
        Box::leak(
            format!(
                "HTTP/1.1 302 Found\r\nlocation: http://localhost:{port}/landed\r\ncontent-length: 0\r\n\r\n"
            )
            .into_boxed_str(),
        )
    }

    /// A connector holding credentials does not follow a redirect to
    /// another origin: reqwest drops `Authorization` there, but not an
    /// `X-Api-Key` or a custom token header, which reached the new host.
    /// One without credentials follows it, and no hop carries a `Referer`
    /// (it would hand the base URL, query included, to the next host).
    #[tokio::test]
    async fn credentials_do_not_follow_a_redirect_to_another_origin() {
        let (port, landed) = recorder(Duration::from_millis(500)).await;
        let (base, _first) = one_shot(redirect_to(port)).await;
        let c = conn_with(serde_json::json!({"url": base,
            "auth": {"type": "api_key", "header": "X-Api-Key", "key": "KEYzq08"}}));
        let e = c.send(&CallScope::default(), &get("/r")).await.unwrap_err();
        assert!(
            e.message.contains(&format!(
                "redirected to another origin (http://localhost:{port}); the connector's credentials are not sent there"
            )),
            "{}",
            e.message
        );
        assert!(!e.retryable);
        assert_eq!(landed.await.unwrap(), None, "the other origin was called");

        let (port, landed) = recorder(Duration::from_secs(5)).await;
        let (base, _first) = one_shot(redirect_to(port)).await;
        let c = conn_with(serde_json::json!({"url": format!("{base}/api?page=2")}));
        c.send(&CallScope::default(), &get("/r")).await.unwrap();
        let landed = landed.await.unwrap().expect("followed");
        assert!(landed.starts_with("GET /landed "), "{landed}");
        assert!(!landed.to_ascii_lowercase().contains("referer"), "{landed}");
    }

    /// A credential header the task adds keeps the call to the origin too
    /// (the connector itself holds none), and its value is masked in the
    /// error text; a secret across the 200-character cut is masked whole;
    /// values under 6 characters are left alone (they match ordinary words).
    #[tokio::test]
    async fn task_credentials_stay_with_the_origin_and_are_masked() {
        let (port, landed) = recorder(Duration::from_millis(500)).await;
        let (base, _first) = one_shot(redirect_to(port)).await;
        let c = conn_with(serde_json::json!({"url": base}));
        let mut req = get("/r");
        req.headers = vec![("X-Api-Key".into(), "TASKKEYzq1".into())];
        let e = c.send(&CallScope::default(), &req).await.unwrap_err();
        assert!(
            e.message.contains("redirected to another origin"),
            "{}",
            e.message
        );
        assert_eq!(landed.await.unwrap(), None);

        let body = format!(
            r#"{{"pad":"{}","token":"TASKKEYzq1 LONGTOKENzq2","idem":"json"}}"#,
            "p".repeat(170)
        );
        let reply: &'static str = Box::leak(
            format!(
                "HTTP/1.1 400 Bad Request\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_boxed_str(),
        );
        let (base, _server) = one_shot(reply).await;
        let c = conn_with(serde_json::json!({"url": base,
            "auth": {"type": "bearer", "token": "LONGTOKENzq2"}}));
        let mut req = get("/x");
        req.headers = vec![
            ("X-Api-Key".into(), "TASKKEYzq1".into()),
            ("X-Idempotency-Key".into(), "json".into()),
        ];
        let e = c.send(&CallScope::default(), &req).await.unwrap_err();
        assert!(!e.message.contains("TASKKEY"), "{}", e.message);
        assert!(!e.message.contains("LONGTOK"), "{}", e.message);
        assert!(e.message.contains(r#""token":"******"#), "{}", e.message);
    }

    /// A path (computed from request data by `path_logic`) cannot climb out
    /// of the base URL with `..` segments, encoded or not: before,
    /// `../../../admin/users` reached `/admin/users` on the upstream.
    #[tokio::test]
    async fn paths_cannot_leave_the_base_url() {
        let c = conn("http://example.com/api/v1/customers", false);
        for path in [
            "../../../admin/users",
            "%2E%2E/%2E%2E/%2E%2E/admin",
            "42/../../orders",
            "..",
        ] {
            let e = c.send(&CallScope::default(), &get(path)).await.unwrap_err();
            assert!(
                e.message.contains("leaves the connector's base URL"),
                "{path}: {}",
                e.message
            );
            assert!(!e.retryable);
        }
        for path in ["42", "42/orders/../notes", "?q=1", "a..b"] {
            let url = reqwest::Url::parse(&c.url(Some(path))).unwrap();
            assert!(c.keeps_base(&url), "{path}");
        }
        let root = conn("http://example.com", false);
        let url = reqwest::Url::parse(&root.url(Some("../x"))).unwrap();
        assert!(root.keeps_base(&url));
    }

    /// A response body over the limit fails the call without being read
    /// whole, with or without a `Content-Length`.
    #[tokio::test]
    async fn response_bodies_are_read_up_to_the_limit() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        for announced in [true, false] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let server = tokio::spawn(async move {
                let (mut sock, _) = listener.accept().await.unwrap();
                let mut buf = vec![0u8; 8192];
                let _ = sock.read(&mut buf).await.unwrap();
                let size = MAX_RESPONSE_BYTES + 1;
                let head = if announced {
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {size}\r\n\r\n")
                } else {
                    "HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n".to_owned()
                };
                sock.write_all(head.as_bytes()).await.unwrap();
                let block = vec![b'x'; 1 << 16];
                let mut sent = 0;
                while sent < size {
                    let n = block.len().min(size - sent);
                    if sock.write_all(&block[..n]).await.is_err() {
                        return sent;
                    }
                    sent += n;
                }
                sent
            });
            let c = conn(&format!("http://{addr}"), true);
            let e = c
                .send(&CallScope::default(), &get("big"))
                .await
                .unwrap_err();
            assert!(e.message.contains("larger than 16 MiB"), "{}", e.message);
            assert!(!e.retryable);
            // The upstream's doing: a 502 (audit 101: a 500).
            assert_eq!(e.kind, ConnectorErrorKind::Upstream);
            // With a Content-Length nothing past the head was wanted; the
            // server may still have pushed some into the socket buffers.
            let _ = server.await;
        }
    }

    /// The request asks for no content coding and carries no framing header
    /// a definition gave; an encoded answer is a clear upstream failure
    /// (audit 101: gzip failed as unparsable JSON, or became binary text).
    #[tokio::test]
    async fn no_content_coding_and_no_given_framing_headers() {
        const GZIP_200: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\ncontent-length: 2\r\nconnection: close\r\n\r\n\x1f\x8b";
        let (url, server) = one_shot(GZIP_200).await;
        let c = conn(&url, true);
        let mut req = get("x");
        req.headers = vec![
            ("Content-Length".to_owned(), "3".to_owned()),
            ("Connection".to_owned(), "upgrade".to_owned()),
        ];
        let e = c.send(&CallScope::default(), &req).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Upstream);
        assert!(
            e.message
                .contains("with a body in Content-Encoding 'gzip', which Sluice does not decode"),
            "{}",
            e.message
        );
        let head = server.await.unwrap().to_ascii_lowercase();
        assert!(head.contains("accept-encoding: identity\r\n"), "{head}");
        assert!(!head.contains("content-length: 3"), "{head}");
        assert!(!head.contains("connection: upgrade"), "{head}");
        // A body that is discarded is not read as anything (audit 103).
        let (url, server) = one_shot(GZIP_200).await;
        let mut req = get("x");
        req.keep_body = false;
        assert!(
            conn(&url, true)
                .send(&CallScope::default(), &req)
                .await
                .is_ok()
        );
        let _ = server.await;
        // A failed status keeps its retry decision.
        let (url, server) = one_shot(b"HTTP/1.1 503 Service Unavailable\r\ncontent-encoding: gzip\r\ncontent-length: 2\r\nconnection: close\r\n\r\n\x1f\x8b").await;
        let e = conn(&url, true)
            .send(&CallScope::default(), &get("x"))
            .await
            .unwrap_err();
        assert!(e.retryable, "{e:?}");
        assert!(e.message.contains("answered HTTP 503"), "{}", e.message);
        let _ = server.await;
    }

    /// A URL read from the environment is held to the rules a written one
    /// meets at create (audit 103: a fragment from `env://` sent every call
    /// to the base URL).
    #[test]
    fn a_resolved_url_holds_no_fragment_or_whitespace() {
        for (url, says) in [
            ("http://example.com/#x", "must not hold a fragment"),
            ("http://example.com/v1?a=1#", "must not hold a fragment"),
            ("http://example.com/a b", "must not contain whitespace"),
        ] {
            let cfg: HttpConnector =
                serde_json::from_value(serde_json::json!({"url": url})).unwrap();
            let e = HttpConn::build("api", &cfg, &settings(true), &[])
                .err()
                .unwrap();
            assert!(e.message.contains(says), "{url}: {}", e.message);
        }
    }

    #[test]
    fn paths_join_the_base_url_with_one_slash() {
        let c = conn("http://example.com/api/", true);
        assert_eq!(c.url(None), "http://example.com/api/");
        assert_eq!(c.url(Some("")), "http://example.com/api/");
        assert_eq!(c.url(Some("/x")), "http://example.com/api/x");
        assert_eq!(c.url(Some("x?a=1")), "http://example.com/api/x?a=1");
        assert_eq!(c.url(Some("?a=1")), "http://example.com/api/?a=1");
        // Without the slash, none is added.
        let c = conn("http://example.com/api", true);
        assert_eq!(c.url(None), "http://example.com/api");
        assert_eq!(c.url(Some("?a=1")), "http://example.com/api?a=1");
        assert_eq!(c.url(Some("x")), "http://example.com/api/x");
        // A base URL with a query keeps it a query.
        let c = conn("http://example.com/api/?api_key=K", true);
        assert_eq!(c.url(None), "http://example.com/api/?api_key=K");
        assert_eq!(c.url(Some("")), "http://example.com/api/?api_key=K");
        assert_eq!(c.url(Some("/x")), "http://example.com/api/x?api_key=K");
        assert_eq!(
            c.url(Some("x?a=1")),
            "http://example.com/api/x?api_key=K&a=1"
        );
        assert_eq!(c.url(Some("?a=1")), "http://example.com/api/?api_key=K&a=1");
        // `#` is data, not a fragment: the base's query stays.
        assert_eq!(
            c.url(Some("/orders/A#1?x=#2")),
            "http://example.com/api/orders/A%231?api_key=K&x=%232"
        );
        let url = reqwest::Url::parse(&c.url(Some("#frag"))).unwrap();
        assert_eq!(
            (url.path(), url.query()),
            ("/api/%23frag", Some("api_key=K"))
        );
    }

    #[test]
    fn base64_matches_rfc_4648() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("user:pa ss", "dXNlcjpwYSBzcw=="),
        ] {
            assert_eq!(base64(plain), encoded);
        }
    }

    #[test]
    fn bodies_parse_as_json_else_string() {
        for declared in [false, true] {
            assert_eq!(
                parse_body(b"{\"a\":1}", declared),
                Ok(serde_json::json!({"a": 1}))
            );
            assert_eq!(parse_body(b" ", declared), Ok(Json::Null));
        }
        assert_eq!(
            parse_body(b"plain", false),
            Ok(Json::String("plain".into()))
        );
        // Said to be JSON and not: an error, not a string the workflow
        // reads `null` from (audit 69).
        let err = parse_body(b"{\"a\":1e400}", true).unwrap_err();
        assert!(err.contains("number out of range"), "{err}");
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let err = parse_body(deep.as_bytes(), true).unwrap_err();
        assert!(err.contains("recursion limit"), "{err}");
        assert_eq!(
            parse_body(b"{\"a\":1e400}", false),
            Ok(Json::String("{\"a\":1e400}".into()))
        );
        for (t, json) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("application/problem+json", true),
            ("text/plain", false),
            ("application/jsonl", false),
        ] {
            assert_eq!(is_json_type(t), json, "{t}");
        }
    }

    #[test]
    fn fresh_traceparents_are_valid() {
        let t = new_traceparent();
        assert_eq!(crate::otel::forwardable_traceparent(&t), Some(t));
    }

    #[tokio::test]
    async fn the_scope_trace_context_is_forwarded() {
        let (base, server) = one_shot("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
        let c = conn(&base, true);
        let scope = CallScope {
            channel: "ch".into(),
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            tracestate: Some("vendor=1".into()),
            chain: vec![],
            observer: None,
        };
        let body = c.send(&scope, &get("/t")).await.unwrap();
        assert_eq!(body, Json::String("ok".into()));
        let seen = server.await.unwrap().to_ascii_lowercase();
        assert!(seen.starts_with("get /t http/1.1"), "{seen}");
        assert!(
            seen.contains("traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            "{seen}"
        );
        assert!(seen.contains("tracestate: vendor=1"), "{seen}");
    }

    #[tokio::test]
    async fn statuses_map_to_kinds_and_retryability() {
        for (status, retryable) in [
            (500, true),
            (503, true),
            (429, true),
            (408, true),
            (400, false),
            (404, false),
        ] {
            let reply: &'static str = Box::leak(
                format!("HTTP/1.1 {status} X\r\ncontent-length: 4\r\n\r\nnope").into_boxed_str(),
            );
            let (base, _server) = one_shot(reply).await;
            let e = conn(&base, true)
                .send(&CallScope::default(), &get("/s"))
                .await
                .unwrap_err();
            assert_eq!(e.kind, ConnectorErrorKind::Upstream, "{status}");
            assert_eq!(e.retryable, retryable, "{status}");
            assert!(
                e.message.contains(&format!("HTTP {status}: nope")),
                "{}",
                e.message
            );
        }
    }

    #[tokio::test]
    async fn guarded_calls_to_private_addresses_are_refused() {
        let (base, _server) = one_shot("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
        let e = conn(&base, false)
            .send(&CallScope::default(), &get("/x"))
            .await
            .unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Other);
        assert!(!e.retryable);
        assert!(e.message.contains("loopback"), "{}", e.message);
        let port = base.rsplit(':').next().unwrap();
        let e = conn(&format!("http://localhost:{port}"), false)
            .send(&CallScope::default(), &get("/x"))
            .await
            .unwrap_err();
        assert!(!e.retryable);
        assert!(e.message.contains("host 'localhost'"), "{}", e.message);
    }

    /// A base URL taken from the environment never shows, its host
    /// included: the guard's refusal gives the reason alone, for a literal
    /// address (the URL check) and a name (the resolver) alike. The same
    /// URLs written in the definition are named as before.
    #[tokio::test]
    async fn a_refused_host_from_the_environment_is_not_named() {
        for (url, shown, why) in [
            ("http://10.9.8.7:1234/p", "10.9.8.7", "private (RFC 1918)"),
            ("http://localhost:9/secretpath", "localhost", "loopback"),
            ("http://[::1]:9/p", "::1", "loopback"),
        ] {
            let cfg: HttpConnector =
                serde_json::from_value(serde_json::json!({"url": url})).unwrap();
            let from_env = [url.to_owned()];
            let c = HttpConn::build("api", &cfg, &settings(false), &from_env).unwrap();
            let e = c.send(&CallScope::default(), &get("/x")).await.unwrap_err();
            assert!(!e.message.contains(shown), "{url}: {}", e.message);
            assert!(
                e.message.contains(&format!(
                    "refused to call the connector's host (taken from the environment): {why} addresses are blocked"
                )),
                "{url}: {}",
                e.message
            );
            let e = conn(url, false)
                .send(&CallScope::default(), &get("/x"))
                .await
                .unwrap_err();
            assert!(e.message.contains(shown), "{url}: {}", e.message);
        }
    }

    #[tokio::test]
    async fn guarded_redirects_to_private_addresses_are_refused() {
        // The first hop is allowed here (the guard's URL check would refuse
        // 127.0.0.1 before any request); the redirect policy refuses the hop
        // to a private address before it is requested.
        let (base, _server) = one_shot(
            "HTTP/1.1 302 Found\r\nlocation: http://10.0.0.1/inner\r\ncontent-length: 0\r\n\r\n",
        )
        .await;
        let mut c = conn(&base, true);
        c.client = reqwest::Client::builder()
            .no_proxy()
            .redirect(ssrf::redirect_policy(true, false))
            .build()
            .unwrap();
        let e = c.send(&CallScope::default(), &get("/r")).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Other);
        assert!(!e.retryable);
        assert!(
            e.message.contains("address 10.0.0.1: private (RFC 1918)"),
            "{}",
            e.message
        );
    }

    #[tokio::test]
    async fn connect_failures_are_retryable_upstream_errors() {
        // Bind then drop: nothing listens on the port any more.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let e = conn(&format!("http://127.0.0.1:{port}"), true)
            .send(&CallScope::default(), &get("/x"))
            .await
            .unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Upstream);
        assert!(e.retryable, "{}", e.message);
    }
}
