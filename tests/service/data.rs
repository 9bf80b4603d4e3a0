//! The data plane over real HTTP: routing rules, response shapes, failure
//! statuses, timeouts, profiling, canary rollout, hot reload under load and
//! graceful shutdown.

use crate::support::*;
use serde_json::{Value as Json, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

fn tagging_workflow(id: &str, tag: &str) -> Json {
    json!({
        "workflow_id": id,
        "name": id,
        "tasks": [
            {"id": "parse", "name": "parse", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}},
            {"id": "tag", "name": "tag", "function": {"name": "map", "input": {"mappings": [
                {"path": "by", "logic": tag},
                {"path": "path", "logic": {"var": "metadata.path"}},
                {"path": "query", "logic": {"var": "metadata.query"}},
                {"path": "method", "logic": {"var": "metadata.method"}},
                {"path": "tenant", "logic": {"var": "metadata.headers.x-tenant"}}
            ]}}}
        ]
    })
}

fn rest_channel(id: &str, workflow: &str, pattern: &str, methods: &[&str], priority: i64) -> Json {
    json!({
        "channel_id": id, "name": id, "channel_type": "sync", "protocol": "rest",
        "route_pattern": pattern, "methods": methods, "workflow_id": workflow,
        "priority": priority, "config_json": {"timeout_ms": 5000}
    })
}

#[tokio::test]
async fn routing_follows_the_resolution_rules() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        tagging_workflow("generic", "generic"),
        rest_channel(
            "by-id",
            "generic",
            "/orders/{order_id}",
            &["POST", "GET"],
            0,
        ),
    )
    .await;
    s.deploy(
        tagging_workflow("special", "special"),
        rest_channel("special", "special", "/orders/special", &["POST"], 0),
    )
    .await;
    s.deploy(
        tagging_workflow("urgent", "urgent"),
        rest_channel("urgent", "urgent", "/orders/{any}/items", &["PUT"], 5),
    )
    .await;
    s.deploy(
        tagging_workflow("named", "named"),
        json!({
            "channel_id": "plain", "name": "plain", "channel_type": "sync", "protocol": "http",
            "workflow_id": "named", "config_json": {}
        }),
    )
    .await;

    // Path parameters and metadata.
    let r = s
        .send(
            "POST",
            "/api/v1/data/orders/o-1?x=1&y=two",
            Some(json!({"data": {"a": 1}})),
            &[("x-tenant", "acme")],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let d = &r.body["data"];
    assert_eq!(
        (d["by"].as_str(), d["method"].as_str(), d["tenant"].as_str()),
        (Some("generic"), Some("POST"), Some("acme"))
    );
    assert_eq!(d["path"], json!({"order_id": "o-1"}));
    assert_eq!(d["query"], json!({"x": "1", "y": "two"}));
    assert_eq!(d["in"], json!({"a": 1}));
    // A name sent twice is one member: the query's last value, the
    // header's values combined (read from the raw text, since a JSON
    // parser would hide a repeated key).
    let r = s
        .send(
            "POST",
            "/api/v1/data/orders/o-1?x=1&y=two&x=3",
            Some(json!({"data": {}})),
            &[("x-tenant", "acme"), ("x-tenant", "beta")],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(
        r.text.contains(r#""query":{"x":"3","y":"two"}"#),
        "{}",
        r.text
    );
    assert!(r.text.contains(r#""tenant":"acme, beta""#), "{}", r.text);
    // A more specific pattern (more literal segments) wins at equal priority.
    assert_eq!(
        s.post("/api/v1/data/orders/special", json!({"data": {}}))
            .await
            .body["data"]["by"],
        "special"
    );
    // Path parameters are percent-decoded; a `+` in a path stays a plus
    // (only in the query string is it a space).
    let r = s
        .send(
            "POST",
            "/api/v1/data/orders/a+b%2Fc%20d?q=x+y",
            Some(json!({"data": {}})),
            &[],
        )
        .await;
    assert_eq!(r.body["data"]["path"], json!({"order_id": "a+b/c d"}));
    assert_eq!(r.body["data"]["query"], json!({"q": "x y"}));
    // A GET on a route has no body.
    let g = s.get("/api/v1/data/orders/o-2").await;
    assert_eq!((g.status, g.body["data"]["in"].clone()), (200, Json::Null));
    // Methods are part of the match.
    let wrong = s.call("DELETE", "/api/v1/data/orders/o-1", None).await;
    assert_eq!(
        wrong.error(404, "NOT_FOUND")["message"],
        "No route matches DELETE /api/v1/data/orders/o-1"
    );
    assert_eq!(
        s.call(
            "PUT",
            "/api/v1/data/orders/x/items",
            Some(json!({"data": {}}))
        )
        .await
        .body["data"]["by"],
        "urgent"
    );
    // Name-based routing for a single segment.
    assert_eq!(
        s.post("/api/v1/data/plain", json!({"data": {}})).await.body["data"]["by"],
        "named"
    );
    s.get("/api/v1/data/plain")
        .await
        .error(405, "METHOD_NOT_ALLOWED");
    // A draft channel is not routed.
    s.admin(
        "POST",
        "/channels",
        Some(rest_channel(
            "draft-only",
            "generic",
            "/drafts/{x}",
            &["POST"],
            0,
        )),
    )
    .await
    .ok(201);
    s.post("/api/v1/data/drafts/1", json!({"data": {}}))
        .await
        .error(404, "NOT_FOUND");
    // Bodies must be JSON objects.
    let bad = s
        .raw(
            "POST",
            "/api/v1/data/plain",
            b"[1,2]".to_vec(),
            Some("application/json"),
        )
        .await;
    bad.error(400, "BAD_REQUEST");
}

#[tokio::test]
async fn failures_map_to_statuses_and_errors_are_collected() {
    let s = start(Db::Sqlite).await;
    let wf = json!({
        "workflow_id": "f", "name": "f",
        "tasks": [
            {"id": "parse", "name": "parse", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}},
            {"id": "check", "name": "check", "function": {"name": "validation", "input": {"rules": [
                {"logic": {"!!": [{"var": "data.in.email"}]}, "message": "email is required"}
            ]}}},
            {"id": "gate", "name": "gate", "function": {"name": "filter", "input": {"condition": {"!": [{"var": "data.in.stop"}]}}}},
            {"id": "boom", "name": "boom", "function": {"name": "map", "input": {"mappings": [
                {"path": "x", "logic": {"if": [{"var": "data.in.fail"}, {"throw": "exploded"}, 1]}}
            ]}}}
        ]
    });
    s.deploy(wf, rest_channel("f", "f", "/f", &["POST"], 0))
        .await;
    // Validation failures are reported but do not halt.
    let r = s.post("/api/v1/data/f", json!({"data": {}})).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.body["errors"],
        json!([{"code": "VALIDATION_ERROR", "task_id": "check", "message": "email is required"}])
    );
    assert_eq!(r.body["data"]["x"], 1);
    // A filter halt is a success with the data so far.
    let r = s
        .post(
            "/api/v1/data/f",
            json!({"data": {"email": "a@b", "stop": true}}),
        )
        .await;
    assert_eq!((r.status, r.body["status"].as_str()), (200, Some("ok")));
    assert!(r.body["data"].get("x").is_none());
    // A task error halts with 500 TASK_ERROR naming the task.
    let r = s
        .post(
            "/api/v1/data/f",
            json!({"data": {"email": "a@b", "fail": true}}),
        )
        .await;
    let e = r.error(500, "TASK_ERROR");
    assert_eq!(e["task_id"], "boom");
    assert_eq!(e["details"][0]["field"], "tasks[3]");
    assert!(
        e["details"][0]["message"]
            .as_str()
            .unwrap()
            .contains("exploded")
    );

    // halt_on: failure on validation → 400 with the messages.
    let mut strict = tagging_workflow("strict", "s");
    strict["tasks"] = json!([{"id": "v", "name": "v", "halt_on": "failure", "function": {"name": "validate", "input": {"rules": [
        {"logic": false, "message": "first"}, {"logic": false, "message": "second"}
    ]}}}]);
    s.deploy(
        strict,
        rest_channel("strict", "strict", "/strict", &["POST"], 0),
    )
    .await;
    let r = s.post("/api/v1/data/strict", json!({"data": {}})).await;
    let e = r.error(400, "BAD_REQUEST");
    let messages: Vec<_> = e["details"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["message"].clone())
        .collect();
    assert_eq!(messages, vec![json!("first"), json!("second")]);
    // A dry run lists the same messages, one error each.
    let dry = s
        .admin("POST", "/workflows/strict/test", Some(json!({"data": {}})))
        .await;
    let messages: Vec<_> = dry.ok(200)["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["code"].clone(), d["message"].clone()))
        .collect();
    assert_eq!(
        messages,
        [
            (json!("VALIDATION_ERROR"), json!("first")),
            (json!("VALIDATION_ERROR"), json!("second"))
        ],
        "{}",
        dry.text
    );

    // A halting failure's answer lists what went wrong before it too, each
    // under its task's place; a dry run names every entry's place, and the
    // async trace codes failed rules VALIDATION_ERROR whether they halted
    // or not.
    let r = s
        .post("/api/v1/data/f", json!({"data": {"fail": true}}))
        .await;
    let e = r.error(500, "TASK_ERROR");
    assert_eq!(
        e["details"][0],
        json!({"field": "tasks[1]", "message": "email is required"})
    );
    assert_eq!(e["details"][1]["field"], "tasks[3]");
    assert_eq!(e["details"].as_array().unwrap().len(), 2);
    let mut two = tagging_workflow("two", "two");
    two["tasks"] = json!([
        {"id": "v1", "name": "v1", "function": {"name": "validation", "input": {"rules": [{"logic": false, "message": "first"}]}}},
        {"id": "v2", "name": "v2", "halt_on": "failure", "function": {"name": "validation", "input": {"rules": [{"logic": false, "message": "second"}]}}}
    ]);
    s.deploy(two, rest_channel("two", "two", "/two", &["POST"], 0))
        .await;
    let r = s.post("/api/v1/data/two", json!({"data": {}})).await;
    let e = r.error(400, "BAD_REQUEST");
    assert_eq!(
        e["details"],
        json!([{"field": "tasks[0]", "message": "first"}, {"field": "tasks[1]", "message": "second"}])
    );
    let dry = s
        .admin("POST", "/workflows/two/test", Some(json!({"data": {}})))
        .await;
    assert_eq!(
        dry.ok(200)["errors"],
        json!([
            {"code": "VALIDATION_ERROR", "task_id": "v1", "field": "tasks[0]", "message": "first"},
            {"code": "VALIDATION_ERROR", "task_id": "v2", "field": "tasks[1]", "message": "second"}
        ])
    );
    let r = s.post("/api/v1/data/two/async", json!({"data": {}})).await;
    assert_eq!(r.status, 202, "{}", r.text);
    let id = r.body["trace_id"].as_str().unwrap().to_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let trace = loop {
        let t = s.get(&format!("/api/v1/data/traces/{id}")).await;
        if t.body["data"]["status"] == "failed" {
            break t.body["data"].clone();
        }
        assert!(std::time::Instant::now() < deadline, "{}", t.text);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(
        trace["errors"],
        json!([
            {"code": "VALIDATION_ERROR", "task_id": "v1", "message": "first"},
            {"code": "VALIDATION_ERROR", "task_id": "v2", "message": "second"}
        ])
    );

    // continue_on_error collects TASK_ERROR entries with 200.
    let mut tolerant = tagging_workflow("tolerant", "t");
    tolerant["continue_on_error"] = json!(true);
    tolerant["tasks"] = json!([
        {"id": "bad", "name": "bad", "function": {"name": "parse_json", "input": {"source": "payload.text", "target": "t"}}},
        {"id": "after", "name": "after", "function": {"name": "map", "input": {"mappings": [{"path": "ran", "logic": true}]}}}
    ]);
    s.deploy(
        tolerant,
        rest_channel("tolerant", "tolerant", "/tolerant", &["POST"], 0),
    )
    .await;
    let r = s
        .post("/api/v1/data/tolerant", json!({"data": {"text": "{nope"}}))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["data"]["ran"], true);
    assert_eq!(r.body["errors"][0]["code"], "TASK_ERROR");
    assert_eq!(r.body["errors"][0]["task_id"], "bad");

    // No matching workflow: 404.
    let mut picky = tagging_workflow("picky", "p");
    picky["condition"] = json!({"==": [{"var": "metadata.headers.x-vip"}, "yes"]});
    s.deploy(
        picky,
        rest_channel("picky", "picky", "/picky", &["POST"], 0),
    )
    .await;
    s.post("/api/v1/data/picky", json!({"data": {}}))
        .await
        .error(404, "NOT_FOUND");
    let vip = s
        .send(
            "POST",
            "/api/v1/data/picky",
            Some(json!({"data": {}})),
            &[("x-vip", "yes")],
        )
        .await;
    assert_eq!(vip.status, 200);

    // tagging_workflow starts with parse_json, so its condition sees the
    // parsed payload (`data.in`).
    let mut by_body = tagging_workflow("by-body", "body");
    by_body["condition"] = json!({"==": [{"var": "data.in.kind"}, "vip"]});
    s.deploy(
        by_body,
        rest_channel("by-body", "by-body", "/by-body", &["POST"], 0),
    )
    .await;
    let r = s
        .post("/api/v1/data/by-body", json!({"data": {"kind": "vip"}}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"]["by"], "body");
    let plain = s
        .post("/api/v1/data/by-body", json!({"data": {"kind": "plain"}}))
        .await;
    assert_eq!(
        plain.error(404, "NOT_FOUND")["message"],
        "No active workflow of channel 'by-body' matches the request"
    );
    // A condition that cannot be evaluated does not match either, and the
    // 404 says why (JSONLogic's `1 == "abc"` is a NaN error).
    let numeric = s
        .post("/api/v1/data/by-body", json!({"data": {"kind": 1}}))
        .await;
    let e = numeric.error(404, "NOT_FOUND");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .starts_with("No active workflow of channel 'by-body' matches the request (the condition of workflow 'by-body' failed: NaN"),
        "{e}"
    );
}

/// A workflow that burns CPU: `passes` loop passes, each summing a range.
fn slow_workflow(id: &str, passes: u32) -> Json {
    json!({
        "workflow_id": id, "name": id,
        "loop": {"max": passes, "counter": "temp_data.i"},
        "tasks": [{"id": "spin", "name": "spin", "function": {"name": "map", "input": {"mappings": [
            {"path": "sum", "logic": {"reduce": [{"var": "payload.items"}, {"+": [{"var": "accumulator"}, {"var": "current"}]}, 0]}}
        ]}}}]
    })
}

fn items(n: usize) -> Json {
    json!({"data": {"items": (0..n).collect::<Vec<_>>()}})
}

#[tokio::test]
async fn the_channel_timeout_gives_504() {
    let s = start(Db::Sqlite).await;
    let mut ch = rest_channel("slow", "slow", "/slow", &["POST"], 0);
    ch["config_json"]["timeout_ms"] = json!(20);
    s.deploy(slow_workflow("slow", 10_000), ch).await;
    let r = s.post("/api/v1/data/slow", items(2000)).await;
    let e = r.error(504, "TIMEOUT");
    assert_eq!(e["task_id"], "spin");
    // The server is fine afterwards.
    assert_eq!(s.get("/healthz").await.status, 200);
}

#[tokio::test]
async fn the_profile_block_is_opt_in_and_gated() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        tagging_workflow("p", "p"),
        rest_channel("p", "p", "/p", &["POST"], 0),
    )
    .await;
    let plain = s.post("/api/v1/data/p", json!({"data": {}})).await;
    assert!(plain.body.get("_service").is_none());
    let header = s
        .send(
            "POST",
            "/api/v1/data/p",
            Some(json!({"data": {}})),
            &[("x-service-profile", "1")],
        )
        .await;
    let profile = &header.body["_service"]["profile"];
    let ids: Vec<_> = profile["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].clone())
        .collect();
    assert_eq!(ids, vec![json!("parse"), json!("tag")]);
    assert!(profile["tasks"][0]["ms"].is_number());

    let gated = start_with(Db::Sqlite, |c| c.tracing.profile_enabled = false).await;
    gated
        .deploy(
            tagging_workflow("p", "p"),
            rest_channel("p", "p", "/p", &["POST"], 0),
        )
        .await;
    let r = gated
        .send(
            "POST",
            "/api/v1/data/p?profile=1",
            Some(json!({"data": {}})),
            &[("x-service-profile", "1")],
        )
        .await;
    assert_eq!(r.status, 200);
    assert!(r.body.get("_service").is_none());
}

#[tokio::test]
async fn canary_rollout_splits_traffic_and_callers_stick() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        tagging_workflow("canary", "v1"),
        rest_channel("canary", "canary", "/canary", &["POST"], 0),
    )
    .await;
    s.admin("POST", "/workflows/canary/versions", None)
        .await
        .ok(201);
    s.admin(
        "PUT",
        "/workflows/canary",
        Some(tagging_workflow("canary", "v2")),
    )
    .await
    .ok(200);
    s.admin(
        "PATCH",
        "/workflows/canary/status",
        Some(json!({"status": "active", "rollout_percentage": 30})),
    )
    .await
    .ok(200);
    let mut v2 = 0;
    for i in 0..1000 {
        let key = format!("caller-{i}");
        let r = s
            .send(
                "POST",
                "/api/v1/data/canary",
                Some(json!({"data": {}})),
                &[("x-rollout-key", &key)],
            )
            .await;
        assert_eq!(r.status, 200);
        if r.body["data"]["by"] == "v2" {
            v2 += 1;
        }
    }
    assert!((250..=350).contains(&v2), "{v2} of 1000 on the 30% canary");
    // The same caller always lands on the same version.
    for i in 0..20 {
        let key = format!("sticky-{i}");
        let first = s
            .send(
                "POST",
                "/api/v1/data/canary",
                Some(json!({"data": {}})),
                &[("x-rollout-key", &key)],
            )
            .await;
        for _ in 0..5 {
            let again = s
                .send(
                    "POST",
                    "/api/v1/data/canary",
                    Some(json!({"data": {}})),
                    &[("x-rollout-key", &key)],
                )
                .await;
            assert_eq!(again.body["data"]["by"], first.body["data"]["by"]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hot_reload_under_load_drops_nothing() {
    let s = Arc::new(start(Db::Sqlite).await);
    s.deploy(
        tagging_workflow("live", "v1"),
        rest_channel("live", "live", "/live/{client}", &["POST"], 0),
    )
    .await;
    s.admin("POST", "/workflows/live/versions", None)
        .await
        .ok(201);
    s.admin(
        "PUT",
        "/workflows/live",
        Some(tagging_workflow("live", "v2")),
    )
    .await
    .ok(200);
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for c in 0..8 {
        let (s, stop, served) = (s.clone(), stop.clone(), served.clone());
        clients.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let r = s
                    .post(&format!("/api/v1/data/live/{c}"), json!({"data": {"n": c}}))
                    .await;
                let by = r.body["data"]["by"].as_str().unwrap_or_default().to_owned();
                // Each response comes whole from one version: its tag and
                // its echo of the request agree.
                if r.status != 200 || !(by == "v1" || by == "v2") || r.body["data"]["in"]["n"] != c
                {
                    failures.push(r.text);
                }
                served.fetch_add(1, Ordering::Relaxed);
            }
            failures
        }));
    }
    // 50 activations and rollbacks while the clients run.
    for i in 0..50 {
        let version = if i % 2 == 0 { 2 } else { 1 };
        let r = s
            .admin(
                "PATCH",
                "/workflows/live/status",
                Some(json!({"status": "active", "version": version})),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    stop.store(true, Ordering::Relaxed);
    let mut failures = Vec::new();
    for c in clients {
        failures.extend(c.await.unwrap());
    }
    assert!(
        failures.is_empty(),
        "{} failed requests, e.g. {:?}",
        failures.len(),
        failures.first()
    );
    assert!(
        served.load(Ordering::Relaxed) > 50,
        "clients ran during the reloads"
    );
    let gen_now = s.admin("GET", "/engine/status", None).await.ok(200)["generation"]
        .as_u64()
        .unwrap();
    assert!(gen_now >= 50);
}

/// With `server.shutdown_delay_secs`, a stopping service keeps answering
/// while `/readyz` says 503 (`stopping`), so a load balancer takes it out
/// before connections are refused; then it closes and returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_delay_keeps_serving_with_readiness_off() {
    let mut s = start_with(Db::Sqlite, |c| c.server.shutdown_delay_secs = 2).await;
    let (base, client) = (s.base.clone(), s.client.clone());
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let started = std::time::Instant::now();
    let stopping = tokio::spawn(async move {
        s.shutdown().await;
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // A new connection is still accepted and served; readiness is off.
    let fresh = reqwest::Client::new();
    let ready = fresh.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let body: Json = ready.json().await.unwrap();
    assert_eq!(body["checks"]["stopping"], true, "{body}");
    let health = fresh.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    // Answers close their connection meanwhile: the client that kept one
    // alive from before is told so, and its next request opens a new one.
    for _ in 0..2 {
        let kept = client.get(format!("{base}/healthz")).send().await.unwrap();
        assert_eq!(kept.status(), 200);
        assert_eq!(
            kept.headers().get("connection").map(|v| v.as_bytes()),
            Some(&b"close"[..])
        );
    }
    // And the server does close it after the answer (the read ends).
    let addr = base.trim_start_matches("http://").to_owned();
    let mut raw = tokio::net::TcpStream::connect(&addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    raw.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(1),
        raw.read_to_end(&mut answer),
    )
    .await
    .expect("the connection stayed open after the answer")
    .unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    stopping.await.unwrap();
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(2),
        "closed before the delay: {:?}",
        started.elapsed()
    );
    assert!(
        reqwest::Client::new()
            .get(format!("{base}/healthz"))
            .send()
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_an_in_flight_request() {
    let mut s = start_with(Db::Sqlite, |c| {
        c.server.shutdown_drain_secs = 30;
        c.security.allow_private_networks = true;
    })
    .await;
    let upstream = slow_upstream(std::time::Duration::from_millis(600)).await;
    deploy_io_slow(&s, "slowish", &upstream, json!({"timeout_ms": 30000})).await;
    let client = s.client.clone();
    let url = format!("{}/api/v1/data/slowish", s.base);
    let in_flight = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let r = client
            .post(url)
            .header("content-type", "application/json")
            .body(items(3000).to_string())
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), started.elapsed())
    });
    // Let the request reach the server, then ask it to stop.
    if !try_wait_in_flight(&s).await {
        let (status, took) = in_flight.await.unwrap();
        panic!("never saw it in flight: status {status} after {took:?}");
    }
    s.shutdown().await;
    // It was in flight when shutdown began (wait_in_flight saw it).
    let (status, _took) = in_flight.await.unwrap();
    assert_eq!(
        status, 200,
        "the in-flight request completed during the drain"
    );
    // New connections are refused after shutdown.
    assert!(
        s.client
            .get(format!("{}/healthz", s.base))
            .send()
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_is_shed_past_max_in_flight() {
    let s = start_with(Db::Sqlite, |c| {
        c.server.max_in_flight = 1;
        c.security.allow_private_networks = true;
    })
    .await;
    let upstream = slow_upstream(std::time::Duration::from_millis(600)).await;
    deploy_io_slow(
        &s,
        "hog",
        &upstream,
        json!({"timeout_ms": 30000, "cors": {"allowed_origins": ["https://app.example"]}}),
    )
    .await;
    let client = s.client.clone();
    let url = format!("{}/api/v1/data/hog", s.base);
    let first = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let status = client
            .post(url)
            .header("content-type", "application/json")
            .body(items(3000).to_string())
            .send()
            .await
            .unwrap()
            .status();
        (status, started.elapsed())
    });
    wait_in_flight(&s).await;
    let shed = s
        .send(
            "POST",
            "/api/v1/data/hog",
            Some(items(1)),
            &[("origin", "https://app.example")],
        )
        .await;
    shed.error(503, "SERVICE_UNAVAILABLE");
    assert_eq!(shed.headers["retry-after"], "1");
    // A browser on the channel's origin can read it (and its Retry-After).
    assert_eq!(
        shed.headers["access-control-allow-origin"],
        "https://app.example"
    );
    assert_eq!(s.get("/health").await.status, 200, "health is never shed");
    let (status, _took) = first.await.unwrap();
    assert_eq!(status, 200);
}

/// A client that gives up mid-request (its timeout, a closed tab) no
/// longer counts against `server.max_in_flight`: the count used to be
/// taken back only after the handler finished, so a dropped request kept
/// its place for good and the service ended up shedding everything.
#[tokio::test]
async fn an_abandoned_request_leaves_the_in_flight_count() {
    let s = start_with(Db::Sqlite, |c| {
        c.server.max_in_flight = 1;
        c.security.allow_private_networks = true;
    })
    .await;
    let upstream = slow_upstream(std::time::Duration::from_millis(1500)).await;
    deploy_io_slow(&s, "hog", &upstream, json!({"timeout_ms": 30000})).await;
    for attempt in 0..3 {
        let gave_up = s
            .client
            .post(format!("{}/api/v1/data/hog", s.base))
            .header("content-type", "application/json")
            .body(items(1).to_string())
            .timeout(std::time::Duration::from_millis(300))
            .send()
            .await;
        assert!(gave_up.is_err(), "attempt {attempt}: {gave_up:?}");
        // Its place comes back without waiting for its upstream call
        // (1.5 s).
        let freed = in_flight_within(&s, std::time::Duration::from_secs(1), |n| n == 0).await;
        assert!(
            freed,
            "attempt {attempt}: the abandoned request still counts as in flight"
        );
    }
    let r = s.post("/api/v1/data/hog", items(1)).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Waits (up to 10 s) until the server is serving at least one request. It
/// watches from a blocking thread: while a CPU-bound workflow occupies a
/// runtime worker, tokio timers may not fire, so an async poll loop could
/// sleep through the whole request.
async fn try_wait_in_flight(s: &TestServer) -> bool {
    in_flight_within(s, std::time::Duration::from_secs(10), |n| n >= 1).await
}

/// Whether the server's in-flight count meets `ok` within `limit`, watched
/// from a blocking thread (see [`try_wait_in_flight`]).
async fn in_flight_within(s: &TestServer, limit: std::time::Duration, ok: fn(u64) -> bool) -> bool {
    let app = s.app.clone();
    tokio::task::spawn_blocking(move || {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < limit {
            if ok(app.in_flight.load(Ordering::Acquire)) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        false
    })
    .await
    .unwrap()
}

/// Waits until the server is serving at least one request (the slow one).
async fn wait_in_flight(s: &TestServer) {
    assert!(
        try_wait_in_flight(s).await,
        "the slow request never reached the server"
    );
}

/// Session 17's audit of the HTTP layer:
/// - a channel on `/` (the data plane's root) is reached at `/api/v1/data`
///   and `/api/v1/data/` (every such request used to answer 404);
/// - a route pattern holding `%` is refused (requests are matched after
///   decoding, so `/x%20y` was reached only by `/x%2520y`);
/// - a channel called by name with another method answers 405 with the
///   channel's CORS headers, like its other errors;
/// - a trace id read in uppercase names the same trace;
/// - HEAD is served wherever a route takes GET (it was 404).
#[tokio::test]
async fn root_routes_percent_patterns_cors_on_405_and_trace_id_case() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        tagging_workflow("rooted", "root"),
        rest_channel("root", "rooted", "/", &["POST", "GET"], 0),
    )
    .await;
    for path in ["/api/v1/data", "/api/v1/data/"] {
        let r = s.post(path, json!({"data": {}})).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text);
        assert_eq!(r.body["data"]["by"], "root", "{path}");
        let r = s.get(path).await;
        assert_eq!(r.status, 200, "GET {path}: {}", r.text);
        // HEAD where the route takes GET: the GET's head, without a body.
        let r = s.raw("HEAD", path, vec![], None).await;
        assert_eq!(r.status, 200, "HEAD {path}");
        assert!(r.text.is_empty());
        let length: usize = r.headers["content-length"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(length > 0);
    }

    let bad = rest_channel("pct", "rooted", "/x%20y", &["POST"], 0);
    let r = s.admin("POST", "/channels", Some(bad)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.body["error"]["details"][0]["field"], "route_pattern");
    assert!(
        r.body["error"]["details"][0]["message"]
            .as_str()
            .unwrap()
            .contains("must not contain '%'"),
        "{}",
        r.text
    );

    s.deploy(
        tagging_workflow("corsy", "cors"),
        json!({"channel_id": "corsy", "name": "corsy", "channel_type": "sync", "protocol": "http",
               "workflow_id": "corsy",
               "config_json": {"cors": {"allowed_origins": ["https://a.example"],
                                        "allowed_methods": ["GET", "POST", "PUT"]}}}),
    )
    .await;
    let r = s
        .raw_with(
            "GET",
            "/api/v1/data/corsy",
            vec![],
            &[("origin", "https://a.example")],
        )
        .await;
    assert_eq!(r.status, 405, "{}", r.text);
    assert_eq!(r.headers["allow"], "POST");
    assert_eq!(
        r.headers["access-control-allow-origin"], "https://a.example",
        "{:?}",
        r.headers
    );
    assert_eq!(r.headers["vary"], "Origin");
    // A preflight on the name path offers POST alone, what the path takes
    // (it listed the channel's CORS methods).
    let r = s
        .raw_with(
            "OPTIONS",
            "/api/v1/data/corsy",
            vec![],
            &[
                ("origin", "https://a.example"),
                ("access-control-request-method", "POST"),
            ],
        )
        .await;
    assert_eq!(r.status, 204, "{}", r.text);
    assert_eq!(r.headers["access-control-allow-methods"], "POST");
    // A route on the same one-segment path adds its methods to `Allow`
    // (audit 99: `Allow: POST` where the route served GET and PUT).
    s.deploy(
        tagging_workflow("corsy-route", "route"),
        json!({"channel_id": "corsy-route", "name": "corsy-route", "channel_type": "sync",
               "protocol": "rest", "route_pattern": "/corsy", "methods": ["GET", "PUT"],
               "workflow_id": "corsy-route"}),
    )
    .await;
    let r = s.call("DELETE", "/api/v1/data/corsy", None).await;
    r.error(405, "METHOD_NOT_ALLOWED");
    assert_eq!(r.headers["allow"], "GET, HEAD, POST, PUT");
    assert_eq!(
        r.body["error"]["message"],
        "channel 'corsy' is called with POST, not DELETE (this path takes GET, HEAD, POST, PUT)"
    );
    assert_eq!(s.call("GET", "/api/v1/data/corsy", None).await.status, 200);

    s.deploy(
        tagging_workflow("later", "later"),
        json!({"channel_id": "later", "name": "later", "channel_type": "async", "protocol": "http",
               "workflow_id": "later", "config_json": {}}),
    )
    .await;
    let r = s.post("/api/v1/data/later", json!({"data": {}})).await;
    assert_eq!(r.status, 202, "{}", r.text);
    let id = r.body["trace_id"].as_str().unwrap().to_owned();
    let upper = s
        .get(&format!("/api/v1/data/traces/{}", id.to_ascii_uppercase()))
        .await;
    assert_eq!(upper.status, 200, "{}", upper.text);
    assert_eq!(upper.body["data"]["trace_id"], id.as_str());
}
