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
use http::{HeaderMap, HeaderValue, Method, Request, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::net::TcpListener;
use tracing::Instrument;

/// A request as handlers see it: the body already read (and bounded).
#[derive(Debug)]
pub struct Req {
    pub method: Method,
    pub path: String,
    pub query: Vec<(String, String)>,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub request_id: String,
    /// Whether the caller sent the request id (it then seeds rollout buckets).
    pub caller_request_id: bool,
    pub client_ip: String,
}

impl Req {
    pub fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as JSON (400 with the parser's message when it is not).
    pub fn json(&self) -> Result<serde_json::Value, ApiError> {
        if self.body.is_empty() {
            return Err(ApiError::bad_request("request body is required"));
        }
        serde_json::from_slice(&self.body)
            .map_err(|e| ApiError::bad_request(format!("malformed JSON: {e}")))
    }
}

/// Serves until `shutdown` completes, then lets in-flight requests finish for
/// up to `server.shutdown_drain_secs`.
pub async fn run(listener: TcpListener, app: Arc<App>, shutdown: impl Future<Output = ()>) {
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    tokio::pin!(shutdown);
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
                let service = hyper::service::service_fn(move |req| handle(app.clone(), peer, req));
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                let conn = graceful.watch(conn.into_owned());
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "connection closed with error");
                    }
                });
            }
            () = &mut shutdown => break,
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
    // hold the exit).
    if app.otel.is_some() {
        let flushing = app.clone();
        let flush = tokio::task::spawn_blocking(move || {
            if let Some(otel) = &flushing.otel {
                otel.shutdown();
            }
        });
        if tokio::time::timeout(Duration::from_secs(5), flush)
            .await
            .is_err()
        {
            tracing::warn!("OpenTelemetry spans not flushed within 5 s");
        }
    }
}

async fn handle(
    app: Arc<App>,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Result<HttpResponse, Infallible> {
    let (request_id, caller_request_id) = match req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
    {
        Some(v) if uuid::Uuid::parse_str(v).is_ok() => (v.to_owned(), true),
        _ => (uuid::Uuid::new_v4().to_string(), false),
    };
    let span = tracing::info_span!("request", request_id = %request_id, method = %req.method(), path = %req.uri().path());
    let started = std::time::Instant::now();
    let method = req.method().clone();
    let route = crate::router::route_label(req.uri().path());
    // Load shedding: past `server.max_in_flight` requests, answer 503 at
    // once (health and metrics stay reachable).
    let counted = !is_operational(req.uri().path());
    let shed =
        counted && app.in_flight.fetch_add(1, Ordering::AcqRel) >= app.config.server.max_in_flight;
    let response = if shed {
        ApiError::new(
            Code::ServiceUnavailable,
            "the service is at its in-flight request limit; retry shortly",
        )
        .with_retry_after(1)
        .into_response()
    } else {
        isolate(read_and_route(
            &app,
            peer,
            req,
            request_id.clone(),
            caller_request_id,
        ))
        .instrument(span)
        .await
    };
    if counted {
        app.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
    crate::telemetry::record_http(
        &method,
        route,
        response.status(),
        started.elapsed().as_secs_f64(),
    );
    Ok(finish(response, &request_id))
}

/// Runs a handler so that a panic inside it becomes a 500 `INTERNAL_ERROR`
/// answer (logged) instead of tearing down the connection; the server keeps
/// serving other requests either way.
pub async fn isolate(handler: impl Future<Output = HttpResponse>) -> HttpResponse {
    match AssertUnwindSafe(handler).catch_unwind().await {
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
    }
}

/// Health and metrics stay reachable when the service sheds load.
fn is_operational(path: &str) -> bool {
    matches!(path, "/health" | "/healthz" | "/readyz" | "/metrics")
}

/// Security headers and the request id on every response.
fn finish(mut response: HttpResponse, request_id: &str) -> HttpResponse {
    let headers = response.headers_mut();
    headers.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    headers.insert("x-frame-options", HeaderValue::from_static("DENY"));
    headers.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    if !headers.contains_key(header::CONTENT_SECURITY_POLICY) {
        headers.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("default-src 'none'; frame-ancestors 'none'"),
        );
    }
    if let Ok(v) = HeaderValue::from_str(request_id) {
        headers.insert("x-request-id", v);
    }
    response
}

async fn read_and_route(
    app: &Arc<App>,
    peer: SocketAddr,
    req: Request<Incoming>,
    request_id: String,
    caller_request_id: bool,
) -> HttpResponse {
    let (parts, body) = req.into_parts();
    let limit = app.config.ingest.max_payload_size as usize;
    if let Some(len) = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        && len > limit as u64
    {
        return too_large(limit);
    }
    let body = match Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            return too_large(limit);
        }
        Err(e) => {
            return ApiError::bad_request(format!("could not read the request body: {e}"))
                .into_response();
        }
    };
    if !body.is_empty() && !is_json(&parts.headers) {
        return ApiError::new(
            Code::UnsupportedMediaType,
            "request body must be JSON (Content-Type: application/json)",
        )
        .into_response();
    }
    let query = parts.uri.query().map(parse_query).unwrap_or_default();
    let req = Req {
        method: parts.method,
        path: parts.uri.path().to_owned(),
        query,
        headers: parts.headers,
        body,
        request_id,
        caller_request_id,
        client_ip: peer.ip().to_string(),
    };
    router::route(app, req).await
}

fn too_large(limit: usize) -> HttpResponse {
    ApiError::new(
        Code::PayloadTooLarge,
        format!("request body exceeds the limit of {limit} bytes"),
    )
    .into_response()
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mime = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// Decodes `a=1&b=x%20y` (percent-decoding, `+` as space).
pub fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
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
    String::from_utf8_lossy(&out).into_owned()
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
    }
}
