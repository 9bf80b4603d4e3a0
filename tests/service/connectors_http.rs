//! `http_call` end to end: the real service over HTTP calling a real HTTP
//! server this test starts on 127.0.0.1 (so these tests switch
//! `security.allow_private_networks` on, except the SSRF ones). Covers every
//! input field, auth, trace context, `env://` resolution and masking,
//! retries and backoff, timeouts, circuit breakers and their admin endpoints.

use crate::support::{Db, TestServer, start_with};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use serde_json::{Value as Json, json};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One request the upstream received.
#[derive(Debug, Clone)]
struct Seen {
    uri: String,
    at: Instant,
    /// The request's headers as received.
    headers: serde_json::Map<String, Json>,
}

/// A scripted HTTP server. Paths:
/// `/echo...` answers `{method, uri, headers, body}`; `/text` plain text;
/// `/flaky/<n>/<id>` 503 for the first `n` calls per id, then 200;
/// `/busy/<wait>/<id>` 503 with `Retry-After: <wait>` on the first call per
/// id, then 200;
/// `/status/<code>`; `/slow` answers after 2 s; `/toggle` 503 while
/// `failing` is set, else 200.
struct Upstream {
    base: String,
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    failing: Arc<AtomicBool>,
}

impl Upstream {
    async fn start() -> Upstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let failing: Arc<AtomicBool> = Arc::default();
        let counters: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
        let (s, f) = (seen.clone(), failing.clone());
        tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    return;
                };
                let (s, f, c) = (s.clone(), f.clone(), counters.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req| answer(req, s.clone(), f.clone(), c.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                        .await;
                });
            }
        });
        Upstream {
            base: format!("http://127.0.0.1:{port}"),
            port,
            seen,
            failing,
        }
    }

    /// Requests whose URI starts with `prefix`.
    fn hits(&self, prefix: &str) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.uri.starts_with(prefix))
            .cloned()
            .collect()
    }
}

fn reply(status: u16, body: Json) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

async fn answer(
    req: Request<hyper::body::Incoming>,
    seen: Arc<Mutex<Vec<Seen>>>,
    failing: Arc<AtomicBool>,
    counters: Arc<Mutex<HashMap<String, u32>>>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let at = Instant::now();
    let method = req.method().to_string();
    let uri = req.uri().to_string();
    let headers: serde_json::Map<String, Json> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                Json::String(v.to_str().unwrap_or("").to_owned()),
            )
        })
        .collect();
    let body = req.into_body().collect().await.unwrap().to_bytes();
    seen.lock().unwrap().push(Seen {
        uri: uri.clone(),
        at,
        headers: headers.clone(),
    });
    let segs: Vec<&str> = uri
        .split('?')
        .next()
        .unwrap()
        .trim_start_matches('/')
        .split('/')
        .collect();
    Ok(match segs.as_slice() {
        ["echo", ..] => {
            let body: Json = if body.is_empty() {
                Json::Null
            } else {
                serde_json::from_slice(&body)
                    .unwrap_or_else(|_| Json::String(String::from_utf8_lossy(&body).into()))
            };
            reply(
                200,
                json!({"method": method, "uri": uri, "headers": headers, "body": body}),
            )
        }
        ["text"] => Response::builder()
            .header("content-type", "text/plain")
            .body(Full::new(Bytes::from_static(b"hello")))
            .unwrap(),
        // Said to be JSON, and not readable as such.
        ["badjson"] => Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(br#"{"a": 1e999}"#)))
            .unwrap(),
        ["flaky", n, id] => {
            let n: u32 = n.parse().unwrap();
            let mut c = counters.lock().unwrap();
            let count = c.entry((*id).to_owned()).or_default();
            *count += 1;
            if *count <= n {
                reply(503, json!({"error": "not yet"}))
            } else {
                reply(200, json!({"attempt": *count}))
            }
        }
        ["status", code] => reply(code.parse().unwrap(), json!({"status": code})),
        // 503 with `Retry-After: <wait>` on the first call per id, then 200.
        ["busy", wait, id] => {
            let mut c = counters.lock().unwrap();
            let count = c.entry((*id).to_owned()).or_default();
            *count += 1;
            if *count == 1 {
                let mut r = reply(503, json!({"busy": true}));
                r.headers_mut().insert("retry-after", wait.parse().unwrap());
                r
            } else {
                reply(200, json!({"attempt": *count}))
            }
        }
        ["slow"] => {
            tokio::time::sleep(Duration::from_secs(2)).await;
            reply(200, json!({"slow": true}))
        }
        ["toggle"] => {
            if failing.load(Ordering::SeqCst) {
                reply(503, json!({"failing": true}))
            } else {
                reply(200, json!({"ok": true}))
            }
        }
        _ => reply(404, json!({"error": "no such path"})),
    })
}

async fn service(allow_private: bool) -> TestServer {
    service_with_threshold(allow_private, 2).await
}

async fn service_with_threshold(allow_private: bool, threshold: u32) -> TestServer {
    start_with(Db::Sqlite, |c| {
        c.security.allow_private_networks = allow_private;
        c.engine.circuit_breaker.failure_threshold = threshold;
        c.engine.circuit_breaker.recovery_timeout_secs = 1;
    })
    .await
}

async fn connector(s: &TestServer, name: &str, config: Json) {
    s.admin(
        "POST",
        "/connectors",
        Some(json!({"name": name, "connector_type": "http", "config": config})),
    )
    .await
    .ok(201);
}

/// Deploys channel `id` (routed by name) running `parse_json` then `tasks`.
async fn deploy(s: &TestServer, id: &str, tasks: Json) {
    let mut all = vec![
        json!({"id": "parse", "name": "Parse", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}}),
    ];
    all.extend(tasks.as_array().unwrap().iter().cloned());
    s.deploy(
        json!({"workflow_id": id, "name": id, "tasks": all}),
        json!({"channel_id": id, "name": id, "channel_type": "sync", "protocol": "http",
               "workflow_id": id, "config_json": {"timeout_ms": 15000}}),
    )
    .await;
}

fn task(id: &str, input: Json) -> Json {
    json!({"id": id, "name": id, "function": {"name": "http_call", "input": input}})
}

async fn run(s: &TestServer, channel: &str, data: Json) -> crate::support::Resp {
    s.post(&format!("/api/v1/data/{channel}"), json!({"data": data}))
        .await
}

const NO_RETRY: &str = r#"{"max_retries": 0, "retry_delay_ms": 10}"#;

fn no_retry() -> Json {
    serde_json::from_str(NO_RETRY).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_input_field_auth_env_and_masking() {
    let up = Upstream::start().await;
    let s = service(true).await;
    // Cargo sets CARGO_PKG_NAME for the test process; setting a variable
    // here would need `unsafe`, which the crate forbids.
    let env_value = std::env::var("CARGO_PKG_NAME").expect("run under cargo test");
    connector(
        &s,
        "echo",
        json!({"type": "http", "url": format!("{}/", up.base),
               "auth": {"type": "bearer", "token": "env://CARGO_PKG_NAME"},
               "headers": {"x-conn": "c", "x-both": "conn", "x-env": "env://CARGO_PKG_NAME"}}),
    )
    .await;
    connector(
        &s,
        "basic",
        json!({"type": "http", "url": up.base, "auth": {"type": "basic", "username": "ann", "password": "s3cret"}}),
    )
    .await;
    connector(
        &s,
        "apikey",
        json!({"type": "http", "url": up.base, "auth": {"type": "api_key", "header": "x-api-key", "key": "k-123"}}),
    )
    .await;

    // Admin answers show references as written and secrets masked; the
    // resolved value appears nowhere.
    let r = s.admin("GET", "/connectors/echo", None).await;
    let c = r.ok(200);
    assert_eq!(c["config"]["auth"]["token"], "******");
    assert_eq!(c["config"]["headers"]["x-env"], "env://CARGO_PKG_NAME");
    let r = s.admin("GET", "/connectors/basic", None).await;
    assert_eq!(r.ok(200)["config"]["auth"]["password"], "******");
    assert!(!r.text.contains("s3cret"));
    let r = s.admin("GET", "/connectors", None).await;
    assert!(
        !r.text.contains("k-123") && !r.text.contains("s3cret"),
        "{}",
        r.text
    );

    deploy(
        &s,
        "fields",
        json!([
            task("post", json!({"connector": "echo", "method": "POST",
                "path_logic": {"cat": ["/echo/", {"var": "data.in.id"}]},
                "headers": {"x-task": "t", "x-both": "task"},
                "body_logic": {"var": "data.in"}, "response_path": "post", "timeout_ms": 5000})),
            task("put", json!({"connector": "basic", "method": "PUT", "path": "echo/static?q=1",
                "body": {"fixed": true, "n": [1, 2]}, "response_path": "put"})),
            task("del", json!({"connector": "apikey", "method": "DELETE", "path": "/echo/k", "response_path": "temp_data.del"})),
            task("text", json!({"connector": "echo", "path": "/text", "response_path": "text"})),
            task("discard", json!({"connector": "echo", "method": "PATCH", "path": "/echo/discarded"})),
            // A body discarded need not parse.
            task("discard_bad", json!({"connector": "echo", "path": "/badjson"})),
            {"id": "copy", "name": "copy", "function": {"name": "map", "input": {"mappings": [
                {"path": "del", "logic": {"var": "temp_data.del"}}]}}}
        ]),
    )
    .await;
    let r = run(&s, "fields", json!({"id": 42, "name": "x"})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let d = &r.body["data"];

    let post = &d["post"];
    assert_eq!(post["method"], "POST");
    assert_eq!(post["uri"], "/echo/42");
    assert_eq!(post["body"], json!({"id": 42, "name": "x"}));
    // What was sent: the resolved reference. What came back into the
    // workflow's data from an upstream echoing it: masked (a resolved
    // `env://` value never appears anywhere).
    let sent = &up.hits("/echo/42")[0].headers;
    assert_eq!(sent["authorization"], json!(format!("Bearer {env_value}")));
    assert_eq!(sent["x-env"], json!(env_value));
    let h = &post["headers"];
    assert_eq!(h["authorization"], "Bearer ******");
    assert_eq!(h["x-env"], "******");
    // (Everywhere in that answer: the user agent `sluice/…` too, since the
    // test's secret is the package name.)
    assert!(!post.to_string().contains(&env_value), "{post}");
    assert_eq!(
        (
            h["x-conn"].as_str(),
            h["x-task"].as_str(),
            h["x-both"].as_str()
        ),
        (Some("c"), Some("t"), Some("task"))
    );
    assert_eq!(h["content-type"], "application/json");
    // A fresh W3C traceparent (version 00, sampled) when the request has none.
    let tp = h["traceparent"].as_str().unwrap();
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(
        (parts[0], parts[1].len(), parts[2].len(), parts[3]),
        ("00", 32, 16, "01")
    );

    let put = &d["put"];
    assert_eq!(
        (put["method"].as_str(), put["uri"].as_str()),
        (Some("PUT"), Some("/echo/static?q=1"))
    );
    assert_eq!(put["body"], json!({"fixed": true, "n": [1, 2]}));
    // base64("ann:s3cret"), sent; masked in the echo.
    assert_eq!(
        up.hits("/echo/static")[0].headers["authorization"],
        "Basic YW5uOnMzY3JldA=="
    );
    assert_eq!(put["headers"]["authorization"], "Basic ******");

    assert_eq!(d["del"]["method"], "DELETE");
    assert_eq!(d["del"]["headers"]["x-api-key"], "k-123");
    assert!(d["del"]["headers"].get("authorization").is_none());
    // Not JSON: stored as a string.
    assert_eq!(d["text"], "hello");
    // No response_path: the call is made, the body discarded.
    assert_eq!(up.hits("/echo/discarded").len(), 1);
    assert!(
        d.get("discard").is_none() && !r.text.contains("discarded"),
        "{}",
        r.text
    );
    assert!(up.hits("/text")[0].uri == "/text");
    assert_eq!(up.hits("/badjson").len(), 1);
    // Kept, a body said to be JSON that does not parse is an upstream
    // failure naming the parser's reason (it was kept as text).
    deploy(
        &s,
        "badjson",
        json!([task(
            "b",
            json!({"connector": "echo", "path": "/badjson", "response_path": "b"})
        )]),
    )
    .await;
    let m = run(&s, "badjson", json!({}))
        .await
        .error(502, "UPSTREAM_ERROR")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        m.contains("with a JSON body that does not parse: number out of range"),
        "{m}"
    );

    // A missing variable is a task error naming it (a value never appears).
    connector(
        &s,
        "unset",
        json!({"type": "http", "url": up.base, "auth": {"type": "bearer", "token": "env://SLUICE_TEST_SURELY_UNSET"}}),
    )
    .await;
    deploy(
        &s,
        "unset",
        json!([task("c", json!({"connector": "unset", "path": "/echo"}))]),
    )
    .await;
    let r = run(&s, "unset", json!({})).await;
    let e = r.error(500, "TASK_ERROR");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("environment variable 'SLUICE_TEST_SURELY_UNSET' is not set"),
        "{}",
        r.text
    );
    // The caller's trace context is forwarded to the upstream call.
    let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let traced = s
        .send(
            "POST",
            "/api/v1/data/fields",
            Some(json!({"data": {"id": 7, "name": "t"}})),
            &[("traceparent", incoming), ("tracestate", "vendor=1")],
        )
        .await;
    assert_eq!(traced.status, 200, "{}", traced.text);
    let h = &traced.body["data"]["post"]["headers"];
    assert_eq!(h["traceparent"], incoming);
    assert_eq!(h["tracestate"], "vendor=1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_backoff_and_no_retry_on_client_errors() {
    let up = Upstream::start().await;
    // A high breaker threshold keeps the breaker out of this test.
    let s = service_with_threshold(true, 1000).await;
    connector(
        &s,
        "up",
        json!({"type": "http", "url": up.base, "retry": {"max_retries": 3, "retry_delay_ms": 50}}),
    )
    .await;
    let call = |id: &str, path_logic: Json| {
        task(
            id,
            json!({"connector": "up", "path_logic": path_logic, "response_path": "r"}),
        )
    };
    deploy(
        &s,
        "retry",
        json!([call("c", json!({"var": "data.in.path"}))]),
    )
    .await;

    // Fails twice, then succeeds on the third attempt.
    let r = run(&s, "retry", json!({"path": "/flaky/2/a"})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"]["r"], json!({"attempt": 3}));
    assert_eq!(up.hits("/flaky/2/a").len(), 3);

    // Backoff doubles: 50, 100, 200 ms between the four attempts.
    let r = run(&s, "retry", json!({"path": "/flaky/3/b"})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let at: Vec<Instant> = up.hits("/flaky/3/b").iter().map(|h| h.at).collect();
    assert_eq!(at.len(), 4);
    let gaps: Vec<u128> = at.windows(2).map(|w| (w[1] - w[0]).as_millis()).collect();
    for (gap, nominal) in gaps.iter().zip([50u128, 100, 200]) {
        assert!(*gap >= nominal, "gaps {gaps:?}");
    }
    assert!(gaps[2] < 2000, "gaps {gaps:?}");
    assert!(gaps[2] > gaps[0], "gaps {gaps:?}");

    // 4xx other than 408/429: no retry, 502 UPSTREAM_ERROR.
    let r = run(&s, "retry", json!({"path": "/status/400"})).await;
    let e = r.error(502, "UPSTREAM_ERROR");
    assert!(
        e["message"].as_str().unwrap().contains("HTTP 400"),
        "{}",
        r.text
    );
    assert_eq!(up.hits("/status/400").len(), 1);
    let r = run(&s, "retry", json!({"path": "/status/404"})).await;
    r.error(502, "UPSTREAM_ERROR");
    assert_eq!(up.hits("/status/404").len(), 1);

    // 5xx, 429 and 408 are retried up to max_retries.
    for code in ["500", "429", "408"] {
        let path = format!("/status/{code}");
        let r = run(&s, "retry", json!({"path": path})).await;
        let e = r.error(502, "UPSTREAM_ERROR");
        assert!(
            e["message"].as_str().unwrap().contains("after 3 retries"),
            "{}",
            r.text
        );
        assert_eq!(up.hits(&path).len(), 4, "{code}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_are_504() {
    let up = Upstream::start().await;
    let s = service(true).await;
    connector(
        &s,
        "up",
        json!({"type": "http", "url": up.base, "retry": no_retry()}),
    )
    .await;
    connector(
        &s,
        "tight",
        json!({"type": "http", "url": up.base, "timeout_ms": 200, "retry": no_retry()}),
    )
    .await;
    deploy(
        &s,
        "slow",
        json!([task(
            "c",
            json!({"connector": "up", "path": "/slow", "timeout_ms": 200})
        )]),
    )
    .await;
    let started = Instant::now();
    let r = run(&s, "slow", json!({})).await;
    let e = r.error(504, "TIMEOUT");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("timed out after 200 ms"),
        "{}",
        r.text
    );
    assert!(started.elapsed() < Duration::from_millis(1500));
    // The connector's own timeout bounds a task that sets none.
    deploy(
        &s,
        "tight",
        json!([task("c", json!({"connector": "tight", "path": "/slow"}))]),
    )
    .await;
    run(&s, "tight", json!({})).await.error(504, "TIMEOUT");
}

/// A timeout is retryable: with `max_retries: 1` the slow upstream is asked
/// twice, each attempt gets the full timeout, and the answer is the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_call_is_retried_then_answers_504() {
    let up = Upstream::start().await;
    let s = service_with_threshold(true, 10).await;
    connector(
        &s,
        "up",
        json!({"type": "http", "url": up.base, "retry": {"max_retries": 1, "retry_delay_ms": 50}}),
    )
    .await;
    deploy(
        &s,
        "slow",
        json!([task(
            "c",
            json!({"connector": "up", "path": "/slow", "timeout_ms": 200})
        )]),
    )
    .await;
    let started = Instant::now();
    let r = run(&s, "slow", json!({})).await;
    let elapsed = started.elapsed();
    let e = r.error(504, "TIMEOUT");
    assert_eq!(
        e["message"],
        "task 'c' failed: http_call: connector 'up': GET /slow timed out after 200 ms (after 1 retry)",
        "{}",
        r.text
    );
    let hits = up.hits("/slow");
    assert_eq!(hits.len(), 2, "{hits:?}");
    // The retry starts after the first attempt's full timeout (and the
    // backoff); the whole call takes two timeouts, not the upstream's 2 s.
    let gap = hits[1].at - hits[0].at;
    assert!(gap >= Duration::from_millis(200), "{gap:?}");
    assert!(elapsed < Duration::from_millis(1500), "{elapsed:?}");
}

/// A failed connection names the connector, method and path, never the
/// base URL: it may carry credentials (here a user, a password and a key in
/// the query), and reqwest's own message would print it whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_errors_never_show_the_base_url() {
    let s = service(true).await;
    let port = crate::support::free_port();
    connector(
        &s,
        "gone",
        json!({"type": "http", "url": format!("http://user:hunter2@127.0.0.1:{port}/v1?api_key=k3y"),
               "retry": no_retry()}),
    )
    .await;
    deploy(
        &s,
        "gone",
        json!([task("c", json!({"connector": "gone", "path": "/things"}))]),
    )
    .await;
    let r = run(&s, "gone", json!({})).await;
    let m = r.error(502, "UPSTREAM_ERROR")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        m.starts_with(
            "task 'c' failed: http_call: connector 'gone': GET /things: cannot connect ("
        ),
        "{m}"
    );
    for secret in ["hunter2", "user", "k3y", "127.0.0.1", &port.to_string()] {
        assert!(!m.contains(secret), "{secret} in {m}");
    }
}

/// A remote that never answers within the channel's `timeout_ms`, with the
/// connector's own timeout not below it (the defaults are both 30 s): each
/// call the deadline abandons counts for the breaker, which opens (audit
/// 67: it stayed closed, and every request waited out the deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_the_channel_deadline_abandons_open_the_breaker() {
    let upstream = crate::support::slow_upstream(Duration::from_secs(5)).await;
    let s = service(true).await;
    connector(&s, "hang", json!({"url": upstream, "retry": no_retry()})).await;
    let tasks = json!([
        {"id": "parse", "name": "Parse", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}},
        task("c", json!({"connector": "hang", "path": "/x"}))
    ]);
    s.deploy(
        json!({"workflow_id": "hang", "name": "hang", "tasks": tasks}),
        json!({"channel_id": "hang", "name": "hang", "channel_type": "sync", "protocol": "http",
               "workflow_id": "hang", "config_json": {"timeout_ms": 200}}),
    )
    .await;
    // failure_threshold = 2.
    for _ in 0..2 {
        run(&s, "hang", json!({})).await.error(504, "TIMEOUT");
    }
    let r = s.admin("GET", "/connectors/circuit-breakers", None).await;
    assert_eq!(
        (
            r.ok(200)[0]["state"].as_str(),
            &r.ok(200)[0]["consecutive_failures"]
        ),
        (Some("open"), &json!(2)),
        "{}",
        r.text
    );
    run(&s, "hang", json!({}))
        .await
        .error(503, "SERVICE_UNAVAILABLE");
    // A caller's deadline that abandons a `channel_call` abandons the
    // callee's connector call too: it counts for the callee's breaker (as
    // it did not, audit 70).
    s.deploy(
        json!({"workflow_id": "caller", "name": "caller", "tasks": [
            {"id": "c", "name": "c", "function": {"name": "channel_call", "input": {"channel": "inner"}}}]}),
        json!({"channel_id": "caller", "name": "caller", "channel_type": "sync", "protocol": "http",
               "workflow_id": "caller", "config_json": {"timeout_ms": 200}}),
    )
    .await;
    s.deploy(
        json!({"workflow_id": "inner", "name": "inner", "tasks": tasks}),
        json!({"channel_id": "inner", "name": "inner", "channel_type": "sync", "protocol": "http",
               "workflow_id": "inner", "config_json": {"timeout_ms": 5000}}),
    )
    .await;
    run(&s, "caller", json!({})).await.error(504, "TIMEOUT");
    let r = s.admin("GET", "/connectors/circuit-breakers", None).await;
    let inner = r
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["key"] == "inner:hang")
        .cloned()
        .unwrap_or_else(|| panic!("{}", r.text));
    assert_eq!(inner["consecutive_failures"], 1, "{inner}");
    // Deleting the channel forgets its breakers: one created again under
    // the same name starts closed (it inherited the open one).
    let channel = json!({"channel_id": "hang", "name": "hang", "channel_type": "sync",
        "protocol": "http", "workflow_id": "hang", "config_json": {"timeout_ms": 200}});
    assert_eq!(s.admin("DELETE", "/channels/hang", None).await.status, 204);
    let r = s.admin("GET", "/connectors/circuit-breakers", None).await;
    let keys: Vec<&str> = r
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["inner:hang"]);
    s.admin("POST", "/channels", Some(channel)).await.ok(201);
    s.admin(
        "PATCH",
        "/channels/hang/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    run(&s, "hang", json!({})).await.error(504, "TIMEOUT");
}

/// A call is one failure for its breaker, its retries included: with
/// `max_retries: 3` and threshold 2, the first failing request makes all
/// four attempts and leaves the breaker closed; the second opens it (audit
/// 69: each attempt counted, and the first request already opened it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_call_counts_once_for_its_breaker_whatever_its_retries() {
    let up = Upstream::start().await;
    let s = service(true).await;
    connector(
        &s,
        "up",
        json!({"type": "http", "url": up.base, "retry": {"max_retries": 3, "retry_delay_ms": 5}}),
    )
    .await;
    deploy(
        &s,
        "once",
        json!([task(
            "c",
            json!({"connector": "up", "path": "/toggle", "response_path": "r"})
        )]),
    )
    .await;
    up.failing.store(true, Ordering::SeqCst);
    let r = run(&s, "once", json!({})).await;
    let e = r.error(502, "UPSTREAM_ERROR");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .ends_with("(after 3 retries)"),
        "{}",
        r.text
    );
    assert_eq!(up.hits("/toggle").len(), 4);
    let breakers = s.admin("GET", "/connectors/circuit-breakers", None).await;
    assert_eq!(
        (
            breakers.ok(200)[0]["state"].as_str(),
            &breakers.ok(200)[0]["consecutive_failures"]
        ),
        (Some("closed"), &json!(1)),
        "{}",
        breakers.text
    );
    run(&s, "once", json!({}))
        .await
        .error(502, "UPSTREAM_ERROR");
    assert_eq!(up.hits("/toggle").len(), 8);
    run(&s, "once", json!({}))
        .await
        .error(503, "SERVICE_UNAVAILABLE");
    assert_eq!(up.hits("/toggle").len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn circuit_breaker_opens_probes_and_closes() {
    let up = Upstream::start().await;
    let s = service(true).await;
    connector(
        &s,
        "up",
        json!({"type": "http", "url": up.base, "retry": no_retry()}),
    )
    .await;
    deploy(
        &s,
        "brk",
        json!([task(
            "c",
            json!({"connector": "up", "path": "/toggle", "response_path": "r"})
        )]),
    )
    .await;
    let hits = || up.hits("/toggle").len();

    assert_eq!(
        s.admin("GET", "/connectors/circuit-breakers", None)
            .await
            .ok(200),
        &json!([])
    );
    up.failing.store(true, Ordering::SeqCst);
    // failure_threshold = 2: the second failure in a row opens it.
    run(&s, "brk", json!({})).await.error(502, "UPSTREAM_ERROR");
    run(&s, "brk", json!({})).await.error(502, "UPSTREAM_ERROR");
    let r = run(&s, "brk", json!({})).await;
    r.error(503, "SERVICE_UNAVAILABLE");
    // When to come back: at the latest when the cooldown has run out.
    assert_eq!(
        r.headers["retry-after"],
        s.app
            .config
            .engine
            .circuit_breaker
            .recovery_timeout_secs
            .max(1)
            .to_string(),
        "{}",
        r.text
    );
    assert_eq!(hits(), 2, "an open breaker does not call the upstream");
    let r = s.admin("GET", "/connectors/circuit-breakers", None).await;
    let b = &r.ok(200)[0];
    // The list shape of every list: paged, with its total.
    assert_eq!(
        (&r.body["total"], &r.body["limit"], &r.body["offset"]),
        (&json!(1), &json!(50), &json!(0))
    );
    s.admin("GET", "/connectors/circuit-breakers?limit=1001", None)
        .await
        .error(400, "BAD_REQUEST");
    assert_eq!(
        (
            b["key"].as_str(),
            b["channel"].as_str(),
            b["connector"].as_str(),
            b["state"].as_str()
        ),
        (Some("brk:up"), Some("brk"), Some("up"), Some("open"))
    );
    assert_eq!(b["consecutive_failures"], 2);
    assert!(b["opened_at"].as_str().unwrap().ends_with('Z'), "{b}");

    // After the cooldown one probe goes through; it fails, so the breaker
    // re-opens with a fresh cooldown.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // The cooldown is over: the listing shows the breaker half-open (its
    // next call is the probe), without waiting for that call.
    let r = s.admin("GET", "/connectors/circuit-breakers", None).await;
    assert_eq!(r.ok(200)[0]["state"], "half_open", "{}", r.text);
    run(&s, "brk", json!({})).await.error(502, "UPSTREAM_ERROR");
    assert_eq!(hits(), 3);
    run(&s, "brk", json!({}))
        .await
        .error(503, "SERVICE_UNAVAILABLE");
    assert_eq!(hits(), 3);

    // Next cooldown: the upstream has recovered, the probe succeeds and closes it.
    up.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = run(&s, "brk", json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = s.admin("GET", "/connectors/circuit-breakers", None).await;
    assert_eq!(r.ok(200)[0]["state"], "closed");
    assert_eq!(r.ok(200)[0]["consecutive_failures"], 0);
    assert_eq!(run(&s, "brk", json!({})).await.status, 200);

    // Admin reset: open it again, reset, and calls go through at once.
    up.failing.store(true, Ordering::SeqCst);
    run(&s, "brk", json!({})).await;
    run(&s, "brk", json!({})).await;
    run(&s, "brk", json!({}))
        .await
        .error(503, "SERVICE_UNAVAILABLE");
    up.failing.store(false, Ordering::SeqCst);
    let r = s
        .admin("POST", "/connectors/circuit-breakers/brk:up", None)
        .await;
    assert_eq!(r.ok(200)["state"], "closed");
    assert_eq!(run(&s, "brk", json!({})).await.status, 200);
    s.admin("POST", "/connectors/circuit-breakers/nope:up", None)
        .await
        .error(404, "NOT_FOUND");
    let r = s
        .admin("GET", "/audit-logs?action=breaker_reset", None)
        .await;
    assert_eq!(r.body["data"][0]["resource_id"], "brk:up", "{}", r.text);
    // The entry says what the reset undid.
    let previous = &r.body["data"][0]["details"]["previous"];
    assert_eq!(previous["state"], "open", "{}", r.text);
    assert!(previous["opened_at"].is_string(), "{}", r.text);

    // The breaker survives an engine reload and a connector reload.
    s.admin("POST", "/engine/reload", None).await.ok(200);
    s.admin("POST", "/connectors/reload", None).await.ok(200);
    assert_eq!(
        s.admin("GET", "/connectors/circuit-breakers", None)
            .await
            .ok(200)[0]["key"],
        "brk:up"
    );

    let metrics = s.get("/metrics").await.text;
    for name in [
        "circuit_breaker_trips_total",
        "circuit_breaker_rejections_total",
    ] {
        assert!(
            metrics.lines().any(|l| l.starts_with(name)
                && l.contains("connector=\"up\"")
                && l.contains("channel=\"brk\"")),
            "{name} missing"
        );
    }

    // Changing the connector (here: its retry policy) closes its breakers:
    // their failures were the old definition's.
    up.failing.store(true, Ordering::SeqCst);
    run(&s, "brk", json!({})).await;
    run(&s, "brk", json!({})).await;
    run(&s, "brk", json!({}))
        .await
        .error(503, "SERVICE_UNAVAILABLE");
    up.failing.store(false, Ordering::SeqCst);
    let mut changed = s.admin("GET", "/connectors/up", None).await.ok(200).clone();
    changed["config"]["retry"] = json!({"max_retries": 0, "retry_delay_ms": 5});
    s.admin("PUT", "/connectors/up", Some(changed))
        .await
        .ok(200);
    let r = s.admin("GET", "/connectors/circuit-breakers", None).await;
    assert_eq!(r.ok(200), &json!([]), "{}", r.text);
    assert_eq!(run(&s, "brk", json!({})).await.status, 200);

    // Deleting the connector forgets its breakers.
    s.admin("DELETE", "/connectors/up", None).await;
    let r = s.admin("GET", "/connectors/circuit-breakers", None).await;
    assert_eq!(r.ok(200), &json!([]), "{}", r.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connector_changes_take_effect_without_a_restart() {
    let up = Upstream::start().await;
    let other = Upstream::start().await;
    let s = service(true).await;
    connector(
        &s,
        "up",
        json!({"type": "http", "url": up.base, "retry": no_retry()}),
    )
    .await;
    deploy(
        &s,
        "chg",
        json!([task(
            "c",
            json!({"connector": "up", "path": "/echo/x", "response_path": "r"})
        )]),
    )
    .await;
    assert_eq!(run(&s, "chg", json!({})).await.status, 200);
    assert_eq!((up.hits("/echo").len(), other.hits("/echo").len()), (1, 0));
    s.admin(
        "PUT",
        "/connectors/up",
        Some(json!({"name": "up", "connector_type": "http", "config": {"type": "http", "url": other.base}})),
    )
    .await
    .ok(200);
    assert_eq!(run(&s, "chg", json!({})).await.status, 200);
    assert_eq!((up.hits("/echo").len(), other.hits("/echo").len()), (1, 1));
    s.admin("DELETE", "/connectors/up", None).await;
    let r = run(&s, "chg", json!({})).await;
    let e = r.error(500, "TASK_ERROR");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("connector 'up' not found"),
        "{}",
        r.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssrf_guard_refuses_private_addresses_by_default() {
    let up = Upstream::start().await;
    let s = service(false).await;
    let retry = json!({"max_retries": 3, "retry_delay_ms": 10});
    connector(
        &s,
        "literal",
        json!({"type": "http", "url": up.base, "retry": retry}),
    )
    .await;
    connector(
        &s,
        "named",
        json!({"type": "http", "url": format!("http://localhost:{}", up.port), "retry": retry}),
    )
    .await;
    connector(
        &s,
        "mapped",
        json!({"type": "http", "url": format!("http://[::ffff:127.0.0.1]:{}", up.port)}),
    )
    .await;
    for (name, expect) in [
        ("literal", "address 127.0.0.1: loopback"),
        ("named", "host 'localhost' (resolves to"),
        ("mapped", "loopback"),
    ] {
        deploy(
            &s,
            name,
            json!([task("c", json!({"connector": name, "path": "/echo"}))]),
        )
        .await;
        let r = run(&s, name, json!({})).await;
        let e = r.error(500, "TASK_ERROR");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(expect), "{name}: {msg}");
        assert!(msg.contains("allow_private_networks"), "{msg}");
        assert!(!msg.contains("after"), "refusals are not retried: {msg}");
    }
    assert!(up.hits("/").is_empty(), "nothing reached the upstream");
}

/// The channel's `timeout_ms` running out while a connector call waits
/// answers 504 naming the task (`error.task_id`, `details` at its place in
/// the definition), like a deadline passed between steps; an async run's
/// trace keeps its workflow and the failing task too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_channel_deadline_during_a_call_names_the_task() {
    let up = Upstream::start().await;
    let s = service_with_threshold(true, 10).await;
    connector(
        &s,
        "up",
        json!({"type": "http", "url": up.base, "retry": no_retry()}),
    )
    .await;
    let tasks = json!([
        {"id": "parse", "name": "Parse", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}},
        task("c", json!({"connector": "up", "path": "/slow"}))
    ]);
    s.deploy(
        json!({"workflow_id": "cto", "name": "cto", "tasks": tasks}),
        json!({"channel_id": "cto", "name": "cto", "protocol": "http",
               "workflow_id": "cto", "config_json": {"timeout_ms": 300}}),
    )
    .await;
    let started = Instant::now();
    let r = run(&s, "cto", json!({})).await;
    assert!(started.elapsed() < Duration::from_millis(1500));
    let e = r.error(504, "TIMEOUT");
    assert_eq!(e["task_id"], "c", "{}", r.text);
    assert_eq!(e["details"][0]["field"], "tasks[1]", "{}", r.text);

    let submitted = s.post("/api/v1/data/cto/async", json!({"data": {}})).await;
    let id = submitted.body["trace_id"].as_str().unwrap().to_owned();
    let until = Instant::now() + Duration::from_secs(10);
    let trace = loop {
        let t = s.get(&format!("/api/v1/data/traces/{id}")).await;
        if t.body["data"]["status"] == "failed" || Instant::now() > until {
            break t.body["data"].clone();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(trace["status"], "failed", "{trace}");
    assert_eq!(trace["workflow_id"], "cto", "{trace}");
    assert_eq!(trace["errors"][0]["code"], "TIMEOUT", "{trace}");
    assert_eq!(trace["errors"][0]["task_id"], "c", "{trace}");
}

/// An upstream's `Retry-After` on a 503 is waited out before the retry, even
/// when the connector's own backoff is shorter; one longer than a retry
/// ever waits (60 s) ends the retries, and the error says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_wait_out_the_upstreams_retry_after() {
    let up = Upstream::start().await;
    let s = service_with_threshold(true, 1000).await;
    connector(
        &s,
        "up",
        json!({"type": "http", "url": up.base, "retry": {"max_retries": 2, "retry_delay_ms": 10}}),
    )
    .await;
    deploy(
        &s,
        "busy",
        json!([task(
            "c",
            json!({"connector": "up", "path_logic": {"var": "data.in.path"}, "response_path": "r"})
        )]),
    )
    .await;
    let r = run(&s, "busy", json!({"path": "/busy/1/a"})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"]["r"], json!({"attempt": 2}));
    let at: Vec<Instant> = up.hits("/busy/1/a").iter().map(|h| h.at).collect();
    assert_eq!(at.len(), 2);
    assert!(
        at[1] - at[0] >= Duration::from_millis(1000),
        "retried after {:?}",
        at[1] - at[0]
    );

    let r = run(&s, "busy", json!({"path": "/busy/120/b"})).await;
    let e = r.error(502, "UPSTREAM_ERROR");
    assert!(
        e["message"].as_str().unwrap().ends_with(
            "; not retried: it asked to be retried after 120 s, longer than the 60 s a retry waits at most"
        ),
        "{}",
        r.text
    );
    assert_eq!(up.hits("/busy/120/b").len(), 1);
}
