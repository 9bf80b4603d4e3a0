//! The hyper server: accept loop, graceful drain, and the per-request wrapper
//! every endpoint goes through (request id, body limit and content type,
//! panic isolation, security headers).
//!
//! `run(listener, app, shutdown)` is the whole entry point; tests bind
//! `127.0.0.1:0` and pass their own shutdown future.

use crate::api::{ApiError, Code, HttpResponse};
use crate::app::App;
use crate::router;
use bytes::Bytes;
use futures_util::FutureExt;
use http::header::HeaderName;
use http::{HeaderMap, HeaderValue, Method, Request, Uri, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tracing::Instrument;

/// A request as handlers see it: the body already read (and bounded).
///
/// Nothing here is copied out of what hyper parsed except the query pairs
/// (decoded, and empty without a query string): the path is read from the
/// URI, the request id is a header value, the client address is formatted
/// once per connection.
#[derive(Debug)]
pub struct Req {
    pub method: Method,
    pub uri: Uri,
    pub query: Vec<(String, String)>,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub request_id: RequestId,
    /// Whether the caller sent the request id (it then seeds rollout buckets).
    pub caller_request_id: bool,
    pub client_ip: Arc<str>,
    /// When the request arrived (its deadline counts from here).
    pub started: Instant,
}

/// The effective request id: the caller's `X-Request-Id` when it is a UUID
/// (shared with the request's header bytes, not copied), else a fresh v4
/// UUID. Held as a header value because it goes back out as one.
#[derive(Debug, Clone)]
pub struct RequestId(HeaderValue);

impl RequestId {
    /// The caller's id if it is a UUID (`Some(.., true)`), else a new one.
    /// Another spelling of a UUID (`{…}`, `urn:uuid:…`, no hyphens) is
    /// passed on in the hyphenated form, which consumers of the 36-character
    /// form expect (before, it was passed on as sent).
    pub fn of(headers: &HeaderMap) -> (RequestId, bool) {
        let Some(v) = headers.get(X_REQUEST_ID) else {
            return (RequestId::generate(), false);
        };
        match v.to_str().ok().map(|s| (s.len(), uuid::Uuid::parse_str(s))) {
            Some((uuid::fmt::Hyphenated::LENGTH, Ok(_))) => (RequestId(v.clone()), true),
            Some((_, Ok(id))) => (RequestId::hyphenated(id), true),
            _ => (RequestId::generate(), false),
        }
    }

    pub fn generate() -> RequestId {
        RequestId::hyphenated(uuid::Uuid::new_v4())
    }

    fn hyphenated(id: uuid::Uuid) -> RequestId {
        let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
        let text = id.hyphenated().encode_lower(&mut buf);
        RequestId(HeaderValue::from_str(text).expect("a UUID is a valid header value"))
    }

    pub fn as_str(&self) -> &str {
        // Both constructors hold visible ASCII only, so the UTF-8 check
        // (word-at-a-time for ASCII) always passes; `to_str` would re-check
        // every byte for visibility.
        std::str::from_utf8(self.0.as_bytes()).unwrap_or_default()
    }

    pub fn header_value(&self) -> HeaderValue {
        self.0.clone()
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// hyper's HTTP/1.1 read buffer limit (8 KiB + 100 × 4 KiB), the largest
/// request head either protocol takes.
const HTTP2_MAX_HEADER_LIST: u32 = 8192 + 4096 * 100;
/// W3C trace context, forwarded to connector calls.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
const X_CONTENT_TYPE_OPTIONS: HeaderName = HeaderName::from_static("x-content-type-options");
const X_FRAME_OPTIONS: HeaderName = HeaderName::from_static("x-frame-options");
const REFERRER_POLICY: HeaderName = HeaderName::from_static("referrer-policy");

impl Req {
    /// The path as requested (still percent-encoded).
    pub fn path(&self) -> &str {
        self.uri.path()
    }

    pub fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// A 400 when a query parameter the service reads is given more than
    /// once: the admin API and trace reads take one value per parameter,
    /// and which of two a request meant (`dry_run=true&dry_run=false`,
    /// `tag=a&tag=b`) is not for the server to guess. A client's own
    /// parameter (a cache buster `_`) is ignored however often it comes.
    /// The raw query is read again: `query` keeps the last value of each,
    /// as `metadata.query` needs.
    pub fn single_valued_query(&self) -> Result<(), ApiError> {
        // The names the admin and trace handlers read with `query`.
        const READ: &[&str] = &[
            "limit",
            "offset",
            "status",
            "tag",
            "version",
            "dry_run",
            "connectors",
            "resource_id",
            "resource_type",
            "action",
            "channel",
            "mode",
            "channel_type",
            "protocol",
        ];
        let mut seen: Vec<String> = Vec::new();
        let pairs = self.uri.query().unwrap_or_default().split('&');
        for pair in pairs.filter(|p| !p.is_empty()) {
            let key = percent_decode(pair.split_once('=').map_or(pair, |(k, _)| k));
            if !READ.contains(&key.as_str()) {
                continue;
            }
            if seen.contains(&key) {
                return Err(ApiError::bad_request(format!(
                    "query parameter '{key}' is given more than once"
                )));
            }
            seen.push(key);
        }
        Ok(())
    }

    /// A header's value as text; pass a `HeaderName` constant on hot paths
    /// (a `&str` name is parsed on every lookup).
    pub fn header(&self, name: impl http::header::AsHeaderName) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as JSON (400 with the parser's message when it is not).
    pub fn json(&self) -> Result<serde_json::Value, ApiError> {
        if self.body.is_empty() {
            return Err(ApiError::bad_request("request body is required"));
        }
        serde_json::from_slice(&self.body).map_err(|e| {
            // serde_json stops at the 128th level and calls that a
            // "recursion limit": the text may well be JSON, only nested too
            // deep.
            let text = e.to_string();
            match text.strip_prefix("recursion limit exceeded") {
                Some(at) => {
                    ApiError::bad_request(format!("request body nests deeper than 127 levels{at}"))
                }
                None => ApiError::bad_request(format!("malformed JSON: {text}")),
            }
        })
    }
}

/// Answers on `listener` while `starting` runs (storage, migrations, the
/// first engine load), so probes get an answer rather than a connection
/// that hangs: `/healthz` 200 (the process is alive), `/readyz` and
/// `/health` 503 in their usual shapes, anything else 503
/// `SERVICE_UNAVAILABLE` with `Retry-After: 1`. Each connection is closed
/// after its answer, so none outlives start-up.
pub async fn while_starting<T>(listener: &TcpListener, starting: impl Future<Output = T>) -> T {
    tokio::pin!(starting);
    loop {
        tokio::select! {
            biased;
            out = &mut starting => return out,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                        Ok::<_, Infallible>(starting_answer(req.uri().path()))
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .keep_alive(false)
                        .serve_connection(TokioIo::new(stream), service);
                    let _ = tokio::time::timeout(Duration::from_secs(10), conn).await;
                });
            }
        }
    }
}

fn starting_answer(path: &str) -> HttpResponse {
    use serde_json::json;
    let unavailable = http::StatusCode::SERVICE_UNAVAILABLE;
    let mut response = match path {
        "/healthz" => crate::api::json_response(http::StatusCode::OK, &json!({"status": "ok"})),
        "/readyz" => crate::api::json_response(
            unavailable,
            &json!({"status": "not_ready", "checks": {
                "startup": false, "engine": false, "database": false, "synced": false,
                "stopping": false}}),
        ),
        "/health" => crate::api::json_response(
            unavailable,
            &json!({"status": "degraded", "version": crate::app::VERSION, "uptime_seconds": 0,
                    "workflows_loaded": 0,
                    "components": {"database": "starting", "engine": "not_loaded"}}),
        ),
        _ => crate::api::json_response(
            unavailable,
            &json!({"error": {"code": "SERVICE_UNAVAILABLE",
                    "message": "the service is starting; retry shortly"}}),
        ),
    };
    if path != "/healthz" {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// Serves until `shutdown` completes, then lets in-flight requests finish for
/// up to `server.shutdown_drain_secs`.
pub async fn run(listener: TcpListener, app: Arc<App>, shutdown: impl Future<Output = ()>) {
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // Head and body in one buffer, sent with one `write`: answers are small
    // JSON documents, and copying one is cheaper than the kernel's handling
    // of a second `writev` segment (+2.6 % requests/s on the reference
    // workload, docs/benchmarks.md).
    builder.http1().writev(false);
    // HTTP/2 takes request heads as large as HTTP/1.1 does (hyper's read
    // buffer, 400 KiB): at h2's default of 16 KiB a larger head got h2's
    // own bare 431, without the error envelope or any header.
    builder.http2().max_header_list_size(HTTP2_MAX_HEADER_LIST);
    // A connection must start a request within
    // `server.request_read_timeout_secs` of the last one (see `watch`), and
    // a request's body arrive within it (`read_and_route`): a slow or
    // silent client cannot hold a connection, or an in-flight slot, for
    // ever. (hyper's own header timer would arm a timer for every request.)
    let read_timeout = Duration::from_secs(app.config.server.request_read_timeout_secs);
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    // After the signal, `server.shutdown_delay_secs` more of accepting (with
    // `/readyz` at 503) before the listener closes.
    let mut signalled = false;
    let delay = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(delay);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        // Usually EMFILE: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let app = app.clone();
                // Formatted once per connection, shared by its requests.
                let client_ip: Arc<str> = peer.ip().to_string().into();
                let activity = Arc::new(Activity::default());
                let seen = activity.clone();
                let service = hyper::service::service_fn(move |req| {
                    handle(app.clone(), client_ip.clone(), seen.clone(), req)
                });
                let (builder, watcher) = (builder.clone(), graceful.watcher());
                tokio::spawn(async move {
                    let conn = builder.serve_connection_with_upgrades(
                        TokioIo::new(crate::rejections::Io::new(stream)),
                        service,
                    );
                    let conn = watcher.watch(conn.into_owned());
                    if let Err(e) = watch(conn, &activity, read_timeout).await {
                        tracing::debug!(error = %e, "connection closed with error");
                    }
                });
            }
            () = &mut shutdown, if !signalled => {
                signalled = true;
                app.stopping.store(true, Ordering::Release);
                let secs = app.config.server.shutdown_delay_secs;
                if secs == 0 {
                    break;
                }
                tracing::info!(delay_secs = secs, "shutting down; still serving while /readyz says 503");
                delay.as_mut().reset(tokio::time::Instant::now() + Duration::from_secs(secs));
            }
            () = &mut delay, if signalled => break,
        }
    }
    drop(listener);
    crate::sync::stop(&app);
    let drain = Duration::from_secs(app.config.server.shutdown_drain_secs);
    tracing::info!(
        drain_secs = drain.as_secs(),
        "shutting down; draining in-flight requests"
    );
    // In-flight requests and running async traces drain side by side, both
    // within the same period.
    let (http, (), ()) = tokio::join!(
        tokio::time::timeout(drain, graceful.shutdown()),
        crate::queue::shutdown(&app, drain),
        crate::kafka::shutdown(&app, drain),
    );
    if http.is_err() {
        tracing::warn!("drain period ended with requests still in flight");
    }
    // Export the spans still buffered (bounded: a dead collector must not
    // hold the exit). On a thread of its own, not the runtime's blocking
    // pool: the SDK's shutdown blocks until the exporter task on this
    // runtime answers, and a runtime being dropped waits for its blocking
    // tasks, so a flush still pending then held the drop forever (seen in
    // the test suite).
    if app.otel.is_some() {
        let flushing = app.clone();
        let (done, flushed) = tokio::sync::oneshot::channel();
        let spawned = std::thread::Builder::new()
            .name("sluice-otel-flush".into())
            .spawn(move || {
                if let Some(otel) = &flushing.otel {
                    otel.shutdown();
                }
                let _ = done.send(());
            });
        if spawned.is_err()
            || tokio::time::timeout(Duration::from_secs(5), flushed)
                .await
                .is_err()
        {
            tracing::warn!("OpenTelemetry spans not flushed within 5 s");
        }
    }
}

/// What a connection's requests have done, for [`watch`]: how many began
/// (their head was read) and how many are still being answered.
#[derive(Default)]
struct Activity {
    began: std::sync::atomic::AtomicU64,
    running: std::sync::atomic::AtomicU32,
}

/// Counts a request as running until it is answered (or dropped).
struct Running(Arc<Activity>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One request counted against `server.max_in_flight` until it is dropped.
struct InFlight<'a> {
    count: &'a std::sync::atomic::AtomicU64,
    /// How many were in flight before this one.
    before: u64,
}

impl<'a> InFlight<'a> {
    fn enter(count: &'a std::sync::atomic::AtomicU64) -> Self {
        let before = count.fetch_add(1, Ordering::AcqRel);
        InFlight { count, before }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves a connection and closes it when, over a whole `period`, no
/// request began while none was running: a client that sends nothing, or
/// too slowly to complete a request head, or stays idle between requests,
/// is dropped after one to two periods. One timer per connection, checked
/// once a period; requests only bump two counters.
async fn watch<F, E>(conn: F, activity: &Activity, period: Duration) -> Result<(), E>
where
    F: Future<Output = Result<(), E>>,
{
    tokio::pin!(conn);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut began = 0;
    loop {
        tokio::select! {
            biased;
            done = &mut conn => return done,
            _ = tick.tick() => {
                let now = activity.began.load(Ordering::Relaxed);
                if now == began && activity.running.load(Ordering::Relaxed) == 0 {
                    return Ok(());
                }
                began = now;
            }
        }
    }
}

async fn handle(
    app: Arc<App>,
    client_ip: Arc<str>,
    activity: Arc<Activity>,
    req: Request<Incoming>,
) -> Result<HttpResponse, Infallible> {
    activity.began.fetch_add(1, Ordering::Relaxed);
    activity.running.fetch_add(1, Ordering::Relaxed);
    let _running = Running(activity);
    let (request_id, caller_request_id) = RequestId::of(req.headers());
    // Fields are formatted only when a subscriber records the span (it is
    // disabled below `info`).
    let span = tracing::info_span!("request", request_id = %request_id, method = %req.method(), path = %req.uri().path());
    let started = Instant::now();
    let method = req.method().clone();
    // HTTP/1 leaves a HEAD answer's body out itself; over HTTP/2 hyper sent
    // it, which clients refuse as a protocol error.
    let h2_head = method == Method::HEAD && req.version() == http::Version::HTTP_2;
    let http1 = req.version() < http::Version::HTTP_2;
    let route = crate::router::route_label(req.uri().path());
    // Load shedding: past `server.max_in_flight` requests, answer 503 at
    // once (health and metrics stay reachable).
    // The count is taken back when the guard drops: when the answer is
    // ready, or when the client goes away and hyper drops this future
    // mid-request (a counter decremented after the `await` would keep every
    // abandoned request for good, until the service shed everything).
    let counted = (!is_operational(req.uri().path())).then(|| InFlight::enter(&app.in_flight));
    let shed = counted
        .as_ref()
        .is_some_and(|c| c.before >= app.config.server.max_in_flight);
    let mut response = if shed {
        let shed = ApiError::new(
            Code::ServiceUnavailable,
            "the service is at its in-flight request limit; retry shortly",
        )
        .with_retry_after(1)
        .into_response();
        // With the CORS headers of the channel it was meant for, as other
        // refusals before routing: a browser can then read the 503 and its
        // `Retry-After`.
        let (parts, _) = req.into_parts();
        early(&app, &parts, started, shed)
    } else {
        isolate(read_and_route(
            &app,
            client_ip,
            req,
            request_id.clone(),
            caller_request_id,
            started,
        ))
        .instrument(span)
        .await
    };
    if let Some(counted) = counted {
        drop(counted);
        // One yield before the response is written: the worker first runs
        // every other request that is ready, then the answers of that pass go
        // out together. Under load the client is woken once per batch, not
        // once per response (that wake-up, an inter-processor interrupt, cost
        // more kernel time per request than anything else; see
        // docs/benchmarks.md). Unloaded, the yield only costs one poll.
        tokio::task::yield_now().await;
    }
    // A failure on our side or upstream is logged with its request id, at
    // most ten a second (an outage must not flood the log).
    if let Some(f) = response.extensions().get::<crate::api::Failure>()
        && let Some(left_out) = crate::api::failure_log_allowed()
    {
        // `left_out`: failure lines not written since the last one.
        tracing::warn!(request_id = %request_id, method = %method, route = %route,
            channel = %f.channel, code = f.code, task_id = %f.task_id, error = %f.message,
            left_out, "request failed");
    }
    if response.extensions().get::<ClientGone>().is_none() {
        crate::telemetry::record_http(
            &method,
            route,
            response.status(),
            started.elapsed().as_secs_f64(),
        );
    }
    if h2_head {
        // The headers of the GET answer, its length included; no body.
        let len = hyper::body::Body::size_hint(response.body()).exact();
        *response.body_mut() = crate::api::Body::default();
        if let Some(len) = len {
            response
                .headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
    }
    // While stopping (the shutdown delay, then the drain), an HTTP/1.1
    // answer closes its connection: a keep-alive client or load balancer
    // opens its next request elsewhere instead of finding the connection
    // gone when the listener closes. (HTTP/2 is told by the GOAWAY of the
    // graceful shutdown.)
    if http1 && app.stopping.load(Ordering::Relaxed) {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    Ok(finish(response, &request_id))
}

/// Runs a handler so that a panic inside it becomes a 500 `INTERNAL_ERROR`
/// answer (logged) instead of tearing down the connection; the server keeps
/// serving other requests either way. A plain function, not an `async fn`:
/// that would hold the handler's future twice (as its argument and inside
/// the `catch_unwind` built from it), doubling the size of every request's
/// future.
pub fn isolate(handler: impl Future<Output = HttpResponse>) -> impl Future<Output = HttpResponse> {
    AssertUnwindSafe(handler)
        .catch_unwind()
        .map(|outcome| match outcome {
            Ok(response) => response,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!(panic = %what, "handler panicked");
                ApiError::internal("internal error; the request was not completed").into_response()
            }
        })
}

/// A byte a Host value may hold (RFC 9110 7.2, RFC 3986 3.2.2: a
/// registered name's unreserved, percent-encoded and sub-delimiter
/// characters, an IP literal's brackets and colons, and the port's colon);
/// an empty value is allowed. `Host: bad host` was served.
fn is_host_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'-' | b'.'
                | b'_'
                | b'~'
                | b'%'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'['
                | b']'
        )
}

/// Health and metrics stay reachable when the service sheds load.
fn is_operational(path: &str) -> bool {
    matches!(path, "/health" | "/healthz" | "/readyz" | "/metrics")
}

/// Security headers and the request id on every response (header names are
/// constants: no name parsing per response).
fn finish(mut response: HttpResponse, request_id: &RequestId) -> HttpResponse {
    let headers = response.headers_mut();
    // JSON answers start from a prebuilt map (`api::bytes_response`) that
    // already has the security headers and a request id slot.
    if let Some(slot) = headers.get_mut(X_REQUEST_ID) {
        *slot = request_id.header_value();
        return response;
    }
    security_headers(headers);
    headers.insert(X_REQUEST_ID, request_id.header_value());
    response
}

/// The security headers every answer carries (with `Content-Type` and the
/// request id these are the six entries a header map holds before it first
/// grows). A `Content-Security-Policy` already set is kept.
pub(crate) fn security_headers(headers: &mut HeaderMap) {
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    if !headers.contains_key(header::CONTENT_SECURITY_POLICY) {
        headers.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("default-src 'none'; frame-ancestors 'none'"),
        );
    }
}

/// A prebuilt header map's request id slot, filled by `finish`.
pub(crate) fn request_id_slot(headers: &mut HeaderMap) {
    headers.insert(X_REQUEST_ID, HeaderValue::from_static(""));
}

async fn read_and_route(
    app: &Arc<App>,
    client_ip: Arc<str>,
    req: Request<Incoming>,
    request_id: RequestId,
    caller_request_id: bool,
    started: Instant,
) -> HttpResponse {
    let (parts, mut body) = req.into_parts();
    // Credentials before anything about the body (the router checks them
    // again with the full request; this costs the data plane nothing).
    let path = parts.uri.path();
    let admin = path.starts_with("/api/v1/admin/") || path == "/api/v1/admin";
    if (admin || path == "/metrics")
        && let Err(e) =
            crate::auth::authenticate_head(&app.config.admin_auth, &parts.method, &parts.headers)
    {
        return e.into_response();
    }
    let limit = if admin {
        app.config.server.admin_max_payload_size
    } else {
        app.config.ingest.max_payload_size
    } as usize;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        drain_refused(&mut body, &parts.headers).await;
        return early(app, &parts, started, too_large(limit));
    }
    // A body announced by its length is judged by its headers before it is
    // read: a client that waits for `100 Continue` is refused without
    // sending it (hyper sends the 100 when the body is first read).
    let announced = declared.is_some_and(|len| len > 0);
    if announced && let Some(refused) = unsupported_body(&parts.headers) {
        drain_refused(&mut body, &parts.headers).await;
        return early(app, &parts, started, refused.into_response());
    }
    // A body that came with its head (nearly all) is read in the first
    // poll, and no timer is made for it; otherwise the rest must arrive
    // within the read timeout, counted from the request's arrival.
    let read = {
        let mut reading = std::pin::pin!(read_body(&mut body, limit));
        let first = std::future::poll_fn(|cx| Poll::Ready(reading.as_mut().poll(cx))).await;
        match first {
            Poll::Ready(read) => read,
            Poll::Pending => {
                let secs = app.config.server.request_read_timeout_secs;
                let deadline = (started + Duration::from_secs(secs)).into();
                match tokio::time::timeout_at(deadline, reading).await {
                    Ok(read) => read,
                    Err(_) => {
                        let late = ApiError::new(
                            Code::RequestTimeout,
                            format!("the request body was not received within {secs} s"),
                        );
                        return early(app, &parts, started, late.into_response());
                    }
                }
            }
        }
    };
    let body = match read {
        Ok(body) => body,
        Err(BodyError::TooLarge) => {
            drain_refused(&mut body, &parts.headers).await;
            return early(app, &parts, started, too_large(limit));
        }
        // The client closed the connection before its body was complete:
        // nothing will read an answer, so none is counted (it showed as a
        // 400 the service never sent in `http_requests_total`, `errors_total`
        // and the channel's `messages_total`; audit 72).
        Err(BodyError::Read(e)) if client_went_away(&e) => {
            // The envelope all the same: a client that only half-closed
            // its side still reads it (audit 74).
            let why = ApiError::bad_request(format!("could not read the request body: {e}"));
            let mut gone = crate::api::json_response(why.code.status(), &why.body());
            gone.extensions_mut().insert(ClientGone);
            return gone;
        }
        Err(BodyError::Read(e)) => {
            let bad = ApiError::bad_request(format!("could not read the request body: {e}"));
            return early(app, &parts, started, bad.into_response());
        }
    };
    // A body without a length (chunked) is judged once read.
    if !announced
        && !body.is_empty()
        && let Some(refused) = unsupported_body(&parts.headers)
    {
        return early(app, &parts, started, refused.into_response());
    }
    // A NUL (`%00`) names nothing Sluice keeps, and PostgreSQL cannot even
    // compare text holding one (its lookups failed with a 500): refused
    // before routing, alike on every database.
    // A percent-escape that decodes to bytes that are not UTF-8 (`%FF`) is
    // refused too: decoded leniently, `/items/%FF` and `/items/%C3` both
    // named the id "\u{FFFD}".
    if let Some(problem) =
        escape_problem(parts.uri.path()).or_else(|| parts.uri.query().and_then(escape_problem))
    {
        return early(
            app,
            &parts,
            started,
            ApiError::bad_request(problem).into_response(),
        );
    }
    let query = parts.uri.query().map(parse_query).unwrap_or_default();
    // Every target is a path but OPTIONS `*` (RFC 9112 3.2; CONNECT's
    // authority form names a tunnel, which Sluice does not make): `GET
    // healthz` was routed with an empty path and answered "No route matches
    // GET " (audits 72, 74).
    let target = parts.uri.path();
    let asterisk = parts.method == http::Method::OPTIONS && target == "*";
    if !(target.starts_with('/') || asterisk) {
        return ApiError::bad_request(format!(
            "the request target '{}' is not a path: it must start with '/'",
            parts.uri
        ))
        .into_response();
    }
    // HTTP/1.1 requires exactly one Host (RFC 9112 3.2: 400 otherwise);
    // HTTP/2 carries `:authority` instead.
    if matches!(
        parts.version,
        http::Version::HTTP_11 | http::Version::HTTP_10 | http::Version::HTTP_09
    ) {
        let mut hosts = parts.headers.get_all(header::HOST).iter();
        let why = match (hosts.next(), hosts.next()) {
            // HTTP/1.0 may leave it out; two, or an invalid one, are
            // refused on every HTTP/1 version.
            (None, _) if parts.version != http::Version::HTTP_11 => None,
            (None, _) => Some("an HTTP/1.1 request needs a Host header"),
            (Some(_), Some(_)) => Some("the request has more than one Host header"),
            (Some(host), None) if !host.as_bytes().iter().all(|&b| is_host_byte(b)) => {
                Some("the Host header is not a host name, an address or a port")
            }
            _ => None,
        };
        if let Some(why) = why {
            return ApiError::bad_request(why).into_response();
        }
    }
    // Behind a trusted load balancer the client is named by
    // `X-Forwarded-For` (`server.trusted_proxies`; empty by default).
    let client_ip = match app.trusted_proxies.client_ip(&client_ip, &parts.headers) {
        Some(forwarded) => forwarded,
        None => client_ip,
    };
    let mut headers = parts.headers;
    if headers.len() != headers.keys_len() {
        combine_repeated(&mut headers);
    }
    // HTTP/2 names the host in `:authority`: `metadata.headers.host` holds
    // it as on HTTP/1.1, so a workflow reads the same either way.
    if parts.version == http::Version::HTTP_2
        && !headers.contains_key(header::HOST)
        && let Some(host) = parts
            .uri
            .authority()
            .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok())
    {
        headers.insert(header::HOST, host);
    }
    let req = Req {
        method: parts.method,
        uri: parts.uri,
        query,
        headers,
        body,
        request_id,
        caller_request_id,
        client_ip,
        started,
    };
    router::route(app, req).await
}

/// Whether a body read failed because the client closed the connection
/// (hyper reports the short body as an end-of-file or reset under a body
/// error), not because what it sent was malformed.
fn client_went_away(e: &hyper::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    e.is_incomplete_message()
        || std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .is_some_and(|io| {
                matches!(
                    io.kind(),
                    UnexpectedEof | ConnectionReset | BrokenPipe | ConnectionAborted
                )
            })
}

/// Marks the answer to a request whose client went away before sending its
/// whole body: written to nobody, so not counted in the metrics.
#[derive(Clone, Copy)]
struct ClientGone;

enum BodyError {
    TooLarge,
    Read(hyper::Error),
}

/// Reads the whole body, at most `limit` bytes. A body that arrives in one
/// frame (the usual case) is kept as hyper's buffer, without a copy or an
/// intermediate list; only a body in several frames is joined.
/// Reads and drops what is left of a refused body (at most 16 MiB, for at
/// most 5 s) before the refusal is sent: most clients send their whole
/// body before they read the answer, and a connection closed with unread
/// data is reset under them, so they never saw the 413. A client that
/// waits for `100 Continue` has sent nothing and is not asked to.
async fn drain_refused(body: &mut Incoming, headers: &HeaderMap) {
    const CAP: usize = 16 << 20;
    let expects = headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects {
        return;
    }
    let read = async {
        let mut n = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                n += data.len();
                if n > CAP {
                    break;
                }
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), read).await;
}

async fn read_body(body: &mut Incoming, limit: usize) -> Result<Bytes, BodyError> {
    let mut first: Option<Bytes> = None;
    let mut joined: Option<bytes::BytesMut> = None;
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(BodyError::Read)?.into_data() else {
            continue; // trailers
        };
        len += data.len();
        if len > limit {
            return Err(BodyError::TooLarge);
        }
        match (&mut joined, first.take()) {
            (Some(buf), _) => buf.extend_from_slice(&data),
            (None, None) => first = Some(data),
            (None, Some(head)) => {
                let mut buf = bytes::BytesMut::with_capacity(len);
                buf.extend_from_slice(&head);
                buf.extend_from_slice(&data);
                joined = Some(buf);
            }
        }
    }
    Ok(match joined {
        Some(buf) => buf.freeze(),
        None => first.unwrap_or_default(),
    })
}

/// An answer given before routing, with the CORS headers of the data-plane
/// channel it was meant for (see `data::decorate_early`).
fn early(
    app: &App,
    parts: &http::request::Parts,
    started: Instant,
    mut response: HttpResponse,
) -> HttpResponse {
    crate::data::decorate_early(app, parts, started, &mut response);
    response
}

fn too_large(limit: usize) -> HttpResponse {
    ApiError::new(
        Code::PayloadTooLarge,
        format!("request body exceeds the limit of {limit} bytes"),
    )
    .into_response()
}

/// Why a request body with these headers is refused (415, or 400 for two
/// content types), if it is: a
/// content coding (none is decoded, RFC 9110 8.4.1; before, a gzip body
/// failed as "not valid JSON" and a plain one labelled gzip was taken), or
/// a content type other than JSON.
fn unsupported_body(headers: &HeaderMap) -> Option<ApiError> {
    // A body has one media type (RFC 9110 8.3): with two, whichever came
    // first decided between 200 and 415 (audit 94). A 400, as for two Host
    // headers; the lengths are stored, so only a repeated header looks.
    if headers.len() != headers.keys_len()
        && headers
            .get_all(header::CONTENT_TYPE)
            .iter()
            .nth(1)
            .is_some()
    {
        return Some(ApiError::bad_request(
            "the request has more than one Content-Type header",
        ));
    }
    if let Some(coding) = headers.get(header::CONTENT_ENCODING)
        && let coding = coding.as_bytes().trim_ascii()
        && !coding.is_empty()
        && !coding.eq_ignore_ascii_case(b"identity")
    {
        return Some(ApiError::new(
            Code::UnsupportedMediaType,
            format!(
                "Content-Encoding '{}' is not supported: send the body uncompressed",
                String::from_utf8_lossy(coding)
            ),
        ));
    }
    (!is_json(headers)).then(|| {
        ApiError::new(
            Code::UnsupportedMediaType,
            "request body must be JSON (Content-Type: application/json)",
        )
    })
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return false;
    };
    // The usual spelling needs no parsing.
    if value.as_bytes() == b"application/json" {
        return true;
    }
    let Ok(ct) = value.to_str() else {
        return false;
    };
    let mime = ct.split(';').next().unwrap_or("").trim().as_bytes();
    let prefix = b"application/";
    let Some(sub) = mime
        .get(..prefix.len())
        .filter(|p| p.eq_ignore_ascii_case(prefix))
        .map(|_| &mime[prefix.len()..])
    else {
        return false;
    };
    sub.eq_ignore_ascii_case(b"json")
        || (sub.len() >= 5 && sub[sub.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// What is wrong with the percent-escapes of a request target's path or
/// query, if anything: a NUL (`%00`), or bytes that are not UTF-8.
fn escape_problem(s: &str) -> Option<&'static str> {
    if !s.contains('%') {
        return None;
    }
    let bytes = decode_bytes(s, false);
    if bytes.contains(&0) {
        return Some("the request target holds a NUL character (%00)");
    }
    if std::str::from_utf8(&bytes).is_err() {
        return Some("the request target holds a percent-escape that is not UTF-8 (such as %FF)");
    }
    None
}

/// Decodes `a=1&b=x%20y` (percent-decoding, `+` as space).
/// The decoded pairs of a query string. A repeated name keeps its last
/// value at its first position, as a repeated key of a JSON body does, so
/// `metadata.query` never holds one name twice.
pub fn parse_query(q: &str) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for pair in q.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (k, v) = (percent_decode(k), percent_decode(v));
        match pairs.iter_mut().find(|(seen, _)| *seen == k) {
            Some((_, value)) => *value = v,
            None => pairs.push((k, v)),
        }
    }
    pairs
}

/// Folds a header sent more than once into one value, joined as RFC 9110
/// §5.3 combines field lines (`, `; `; ` for `cookie`, RFC 6265), so that
/// `metadata.headers` never holds one name twice. Only called when some
/// name repeats (the map counts values and names apart).
fn combine_repeated(headers: &mut http::HeaderMap) {
    let repeated: Vec<http::HeaderName> = headers
        .keys()
        .filter(|k| headers.get_all(*k).iter().nth(1).is_some())
        .cloned()
        .collect();
    for name in repeated {
        let sep: &[u8] = if name == http::header::COOKIE {
            b"; "
        } else {
            b", "
        };
        let mut joined = Vec::new();
        for (i, v) in headers.get_all(&name).iter().enumerate() {
            if i > 0 {
                joined.extend_from_slice(sep);
            }
            joined.extend_from_slice(v.as_bytes());
        }
        if let Ok(v) = http::HeaderValue::from_bytes(&joined) {
            headers.insert(name, v);
        }
    }
}

pub fn percent_decode(s: &str) -> String {
    decode_with(s, true).into_owned()
}

/// Percent-decodes a path segment, borrowing `s` when there is nothing to
/// decode (the common case: no allocation). Unlike a query string, a `+` in
/// a path is a plus sign, not a space.
pub fn decode(s: &str) -> std::borrow::Cow<'_, str> {
    decode_with(s, false)
}

fn decode_with(s: &str, plus_is_space: bool) -> std::borrow::Cow<'_, str> {
    if !s.bytes().any(|b| b == b'%' || (plus_is_space && b == b'+')) {
        return std::borrow::Cow::Borrowed(s);
    }
    std::borrow::Cow::Owned(match String::from_utf8(decode_bytes(s, plus_is_space)) {
        Ok(text) => text,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    })
}

/// The bytes `%XX` escapes (and `+`, when `plus_is_space`) stand for.
fn decode_bytes(s: &str, plus_is_space: bool) -> Vec<u8> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' if plus_is_space => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h * 16 + l);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    out
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_handler_answers_500() {
        let response = isolate(async { panic!("boom") }).await;
        assert_eq!(response.status(), http::StatusCode::INTERNAL_SERVER_ERROR);
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["error"]["code"], "INTERNAL_ERROR");
        let fine = isolate(async { ApiError::not_found("x").into_response() }).await;
        assert_eq!(fine.status(), http::StatusCode::NOT_FOUND);
    }

    #[test]
    fn json_content_types() {
        let with = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            is_json(&h)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with(" application/problem+json "));
        assert!(!with("text/json"));
        assert!(!with("application/jsonx"));
        assert!(!with("application/xml"));
        assert!(!is_json(&HeaderMap::new()));
    }

    #[test]
    fn request_ids_are_the_callers_uuid_or_fresh() {
        let mut h = HeaderMap::new();
        let (fresh, caller) = RequestId::of(&h);
        assert!(!caller);
        assert!(uuid::Uuid::parse_str(fresh.as_str()).is_ok());
        assert_ne!(fresh.as_str(), RequestId::generate().as_str());
        h.insert(
            X_REQUEST_ID,
            HeaderValue::from_static("0b6c3f0e-8d8e-4c5e-9a57-2f1f6d1f7c11"),
        );
        let (id, caller) = RequestId::of(&h);
        assert!(caller);
        assert_eq!(id.as_str(), "0b6c3f0e-8d8e-4c5e-9a57-2f1f6d1f7c11");
        h.insert(X_REQUEST_ID, HeaderValue::from_static("not-a-uuid"));
        assert!(!RequestId::of(&h).1);
        // Other spellings of a UUID go on hyphenated.
        for other in [
            "{0B6C3F0E-8D8E-4C5E-9A57-2F1F6D1F7C11}",
            "urn:uuid:0b6c3f0e-8d8e-4c5e-9a57-2f1f6d1f7c11",
            "0b6c3f0e8d8e4c5e9a572f1f6d1f7c11",
        ] {
            h.insert(X_REQUEST_ID, HeaderValue::from_static(other));
            let (id, caller) = RequestId::of(&h);
            assert!(caller, "{other}");
            assert_eq!(id.as_str(), "0b6c3f0e-8d8e-4c5e-9a57-2f1f6d1f7c11");
        }
    }

    #[test]
    fn decoding_borrows_when_there_is_nothing_to_decode() {
        assert!(matches!(
            decode("ord-7f3a9c"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(decode("a%20b"), "a b");
        // In a path, `+` is a plus sign (only a query string means a space).
        assert_eq!(decode("a+b"), "a+b");
        assert_eq!(decode("a%2Bb+c"), "a+b+c");
    }

    #[test]
    fn query_strings_decode() {
        assert_eq!(
            parse_query("a=1&b=x%20y+z&c&d=%zz&e=%41"),
            vec![
                ("a".into(), "1".into()),
                ("b".into(), "x y z".into()),
                ("c".into(), "".into()),
                ("d".into(), "%zz".into()),
                ("e".into(), "A".into())
            ]
        );
        assert_eq!(percent_decode("%"), "%");
        assert_eq!(percent_decode("%4"), "%4");
        // A repeated name: its last value, where it first appeared.
        assert_eq!(
            parse_query("a=2&b=x&a=1&a%3D=3&a=0"),
            vec![
                ("a".into(), "0".into()),
                ("b".into(), "x".into()),
                ("a=".into(), "3".into())
            ]
        );
    }

    #[test]
    fn repeated_headers_are_combined() {
        let mut h = http::HeaderMap::new();
        h.append("x-t", http::HeaderValue::from_static("one"));
        h.append("accept", http::HeaderValue::from_static("a/b"));
        h.append("x-t", http::HeaderValue::from_static("two"));
        h.append("cookie", http::HeaderValue::from_static("a=1"));
        h.append("cookie", http::HeaderValue::from_static("b=2"));
        assert_ne!(h.len(), h.keys_len());
        combine_repeated(&mut h);
        assert_eq!(h.len(), h.keys_len());
        assert_eq!(h["x-t"], "one, two");
        assert_eq!(h["cookie"], "a=1; b=2");
        assert_eq!(h["accept"], "a/b");
    }
}
