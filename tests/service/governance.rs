//! Channel governance and `channel_call` over real HTTP: deduplication, rate
//! limits (per channel, per key, platform), `validation_logic`, backpressure,
//! the response cache, CORS, invalid settings rejected at create and update,
//! and in-process channel calls (payloads, response paths, timeouts, cycles,
//! depth, the callee's own governance).

use crate::support::*;
use serde_json::{Value as Json, json};
use std::time::Duration;

/// A channel routed by name (`POST /api/v1/data/{id}`) with `config`.
fn named(id: &str, workflow: &str, config: Json) -> Json {
    json!({
        "channel_id": id, "name": id, "channel_type": "sync", "protocol": "http",
        "workflow_id": workflow, "config_json": config
    })
}

/// Echoes the payload and stamps the request id: a response that repeats an
/// earlier request id was not produced by a new run.
fn echo(id: &str) -> Json {
    json!({
        "workflow_id": id, "name": id,
        "tasks": [
            {"id": "parse", "name": "parse", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}},
            {"id": "stamp", "name": "stamp", "function": {"name": "map", "input": {"mappings": [
                {"path": "rid", "logic": {"var": "metadata.request_id"}},
                {"path": "channel", "logic": {"var": "metadata.channel"}}
            ]}}}
        ]
    })
}

async fn post_with(s: &TestServer, channel: &str, data: Json, headers: &[(&str, &str)]) -> Resp {
    s.send(
        "POST",
        &format!("/api/v1/data/{channel}"),
        Some(json!({ "data": data })),
        headers,
    )
    .await
}

fn retry_after(r: &Resp) -> u64 {
    r.headers
        .get("retry-after")
        .unwrap_or_else(|| panic!("Retry-After missing: {:?}", r.headers))
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

// ------------------------------------------------------------ deduplication

crate::on_both_governance_backends!(
    changed_limits_start_afresh_and_reloads_keep_them,
    changed_limits_start_afresh_and_reloads_keep_them_body
);

/// Rate-limit buckets and deduplication keys belong to the settings that
/// made them: a reload keeps them, but a channel created again under the
/// same name with another limit or window starts afresh (a limit raised
/// from 0.01/s to 100/s still answered `Retry-After: 96`, and a 2 s window
/// refused a key seen under the old 300 s one "within the last 2 s").
async fn changed_limits_start_afresh_and_reloads_keep_them_body(gov: Gov) {
    let s = start_gov(gov, |_| {}).await;
    let unique = uuid::Uuid::new_v4().simple().to_string();
    let name = format!("lim{}", &unique[..8]);
    let channel = |id: &str, config: Json| {
        json!({"channel_id": id, "name": name, "channel_type": "sync", "protocol": "http",
               "workflow_id": "lim", "config_json": config})
    };
    let key = [("idempotency-key", "k-1")];
    s.deploy(
        echo("lim"),
        channel(
            "lim-a",
            json!({"rate_limit": {"requests_per_second": 0.01, "burst": 2},
                   "deduplication": {"window_secs": 300}}),
        ),
    )
    .await;
    assert_eq!(post_with(&s, &name, json!({}), &key).await.status, 200);
    assert_eq!(post_with(&s, &name, json!({}), &[]).await.status, 200);
    post_with(&s, &name, json!({}), &[])
        .await
        .error(429, "RATE_LIMITED");
    // A reload keeps both.
    s.admin("POST", "/engine/reload", None).await.ok(200);
    post_with(&s, &name, json!({}), &[])
        .await
        .error(429, "RATE_LIMITED");

    s.admin("DELETE", "/channels/lim-a", None).await.ok(204);
    s.create_active(
        "channels",
        channel(
            "lim-b",
            json!({"rate_limit": {"requests_per_second": 100, "burst": 5},
                   "deduplication": {"window_secs": 2}}),
        ),
    )
    .await;
    // The new limit's full burst, and the key seen under the old window is
    // new under this one (then a duplicate within it).
    assert_eq!(post_with(&s, &name, json!({}), &key).await.status, 200);
    let r = post_with(&s, &name, json!({}), &key).await;
    r.error(409, "CONFLICT");
    assert!(r.text.contains("within the last 2 s"), "{}", r.text);
    for _ in 0..3 {
        let r = post_with(&s, &name, json!({}), &[]).await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
}

crate::on_both_governance_backends!(
    deduplication_rejects_a_repeat_inside_the_window,
    deduplication_rejects_a_repeat_inside_the_window_body
);

async fn deduplication_rejects_a_repeat_inside_the_window_body(gov: Gov) {
    let s = start_gov(gov, |_| {}).await;
    s.deploy(
        echo("d"),
        named("dd", "d", json!({"deduplication": {"window_secs": 1}})),
    )
    .await;
    let key = [("idempotency-key", "k-1")];
    assert_eq!(post_with(&s, "dd", json!({}), &key).await.status, 200);
    post_with(&s, "dd", json!({}), &key)
        .await
        .error(409, "CONFLICT");
    // Another key, and requests without a key, are not duplicates.
    assert_eq!(
        post_with(&s, "dd", json!({}), &[("idempotency-key", "k-2")])
            .await
            .status,
        200
    );
    for _ in 0..3 {
        assert_eq!(post_with(&s, "dd", json!({}), &[]).await.status, 200);
    }
    // After the window the key is fresh again.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(post_with(&s, "dd", json!({}), &key).await.status, 200);
    // Async submissions are deduplicated the same way.
    let r = s
        .send(
            "POST",
            "/api/v1/data/dd/async",
            Some(json!({"data": {}})),
            &[("idempotency-key", "k-async")],
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);
    s.send(
        "POST",
        "/api/v1/data/dd/async",
        Some(json!({"data": {}})),
        &[("idempotency-key", "k-async")],
    )
    .await
    .error(409, "CONFLICT");
    // A refused async body was not accepted: its key goes back, so the
    // corrected retry is accepted (it used to be told it was a duplicate).
    let key = [("idempotency-key", "k-async-refused")];
    s.send("POST", "/api/v1/data/dd/async", Some(json!([1])), &key)
        .await
        .error(400, "BAD_REQUEST");
    let r = s
        .send(
            "POST",
            "/api/v1/data/dd/async",
            Some(json!({"data": {}})),
            &key,
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text);

    // A request no workflow matched ran nothing: its key goes back, so the
    // corrected retry runs (session 19: it was told it was a duplicate).
    let mut picky = echo("dp");
    picky["condition"] = json!({"==": [{"var": "payload.go"}, true]});
    s.deploy(
        picky,
        named("ddp", "dp", json!({"deduplication": {"window_secs": 60}})),
    )
    .await;
    let key = [("idempotency-key", "k-nomatch")];
    post_with(&s, "ddp", json!({"go": false}), &key)
        .await
        .error(404, "NOT_FOUND");
    assert_eq!(
        post_with(&s, "ddp", json!({"go": true}), &key).await.status,
        200
    );
    post_with(&s, "ddp", json!({"go": true}), &key)
        .await
        .error(409, "CONFLICT");

    // The same through `channel_call` (the callee keys on its payload): a
    // callee that ran nothing gives its key back.
    s.deploy(
        {
            let mut w = echo("ddpk");
            w["condition"] = json!({"==": [{"var": "payload.go"}, true]});
            w
        },
        named(
            "ddpk",
            "ddpk",
            json!({"deduplication": {"key_logic": {"var": "data.k"}, "window_secs": 60}}),
        ),
    )
    .await;
    s.deploy(
        caller(
            "ddcall",
            json!([call_task(
                "call",
                json!({"channel": "ddpk", "data_logic": {"var": "payload"}, "response_path": "out"})
            )]),
        ),
        named("ddcall", "ddcall", json!({})),
    )
    .await;
    post_with(&s, "ddcall", json!({"k": "c-1", "go": false}), &[])
        .await
        .error(500, "TASK_ERROR");
    let r = post_with(&s, "ddcall", json!({"k": "c-1", "go": true}), &[]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = post_with(&s, "ddcall", json!({"k": "c-1", "go": true}), &[]).await;
    r.error(500, "TASK_ERROR");
    assert!(r.text.contains("duplicate"), "{}", r.text);
}

crate::on_both_governance_backends!(
    deduplication_keys_from_key_logic_or_a_custom_header,
    deduplication_keys_from_key_logic_or_a_custom_header_body
);

async fn deduplication_keys_from_key_logic_or_a_custom_header_body(gov: Gov) {
    let s = start_gov(gov, |_| {}).await;
    s.deploy(
        echo("d"),
        named(
            "by-id",
            "d",
            json!({"deduplication": {"key_logic": {"var": "data.order_id"}, "window_secs": 60}}),
        ),
    )
    .await;
    assert_eq!(
        post_with(&s, "by-id", json!({"order_id": 7}), &[])
            .await
            .status,
        200
    );
    post_with(&s, "by-id", json!({"order_id": 7}), &[])
        .await
        .error(409, "CONFLICT");
    assert_eq!(
        post_with(&s, "by-id", json!({"order_id": 8}), &[])
            .await
            .status,
        200
    );
    // No order id and no header: not deduplicated.
    assert_eq!(post_with(&s, "by-id", json!({}), &[]).await.status, 200);
    assert_eq!(post_with(&s, "by-id", json!({}), &[]).await.status, 200);

    s.deploy(
        echo("h"),
        named(
            "by-header",
            "h",
            json!({"deduplication": {"header": "X-Dedup", "window_secs": 60}}),
        ),
    )
    .await;
    let h = [("x-dedup", "abc")];
    assert_eq!(post_with(&s, "by-header", json!({}), &h).await.status, 200);
    post_with(&s, "by-header", json!({}), &h)
        .await
        .error(409, "CONFLICT");
    // The default header is not used when another one is configured.
    let idem = [("idempotency-key", "abc")];
    assert_eq!(
        post_with(&s, "by-header", json!({}), &idem).await.status,
        200
    );
    assert_eq!(
        post_with(&s, "by-header", json!({}), &idem).await.status,
        200
    );
}

// --------------------------------------------------------------- rate limit

crate::on_both_governance_backends!(
    the_channel_rate_limit_answers_429_with_retry_after_past_the_burst,
    the_channel_rate_limit_answers_429_with_retry_after_past_the_burst_body
);

async fn the_channel_rate_limit_answers_429_with_retry_after_past_the_burst_body(gov: Gov) {
    let s = start_gov(gov, |_| {}).await;
    s.deploy(
        echo("r"),
        named(
            "limited",
            "r",
            json!({"rate_limit": {"requests_per_second": 0.2, "burst": 2}}),
        ),
    )
    .await;
    assert_eq!(post_with(&s, "limited", json!({}), &[]).await.status, 200);
    assert_eq!(post_with(&s, "limited", json!({}), &[]).await.status, 200);
    let r = post_with(&s, "limited", json!({}), &[]).await;
    r.error(429, "RATE_LIMITED");
    // One token every 5 s.
    let wait = retry_after(&r);
    assert!((1..=5).contains(&wait), "Retry-After {wait}");
    // A channel without a limit is not affected.
    s.deploy(echo("free"), named("free", "free", json!({})))
        .await;
    for _ in 0..5 {
        assert_eq!(post_with(&s, "free", json!({}), &[]).await.status, 200);
    }
    // Rejections are counted (with a bounded `client` label).
    let metrics = s.get("/metrics").await.text;
    let line = metrics
        .lines()
        .find(|l| l.starts_with("rate_limit_rejections_total{") && l.contains("limited"))
        .unwrap_or_else(|| panic!("no rejection metric in:\n{metrics}"));
    assert!(line.contains("client=\"127.0.0.1\""), "{line}");
}

/// `messages_total`: a refused request (4xx) is `rejected`, on sync and
/// async channels alike; a run that fails (5xx) is `error`. Before, a 429
/// or a duplicate counted as `error`, and a refused async submission not
/// at all.
#[tokio::test]
async fn refused_messages_count_as_rejected() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        echo("counted"),
        named(
            "counted-sync",
            "counted",
            json!({"rate_limit": {"requests_per_second": 0.1, "burst": 1}}),
        ),
    )
    .await;
    let mut refused = named(
        "counted-async",
        "counted",
        json!({"rate_limit": {"requests_per_second": 0.1, "burst": 1}}),
    );
    refused["channel_type"] = json!("async");
    s.admin("POST", "/channels", Some(refused)).await.ok(201);
    s.admin(
        "PATCH",
        "/channels/counted-async/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    assert_eq!(
        post_with(&s, "counted-sync", json!({}), &[]).await.status,
        200
    );
    post_with(&s, "counted-sync", json!({}), &[])
        .await
        .error(429, "RATE_LIMITED");
    assert_eq!(
        post_with(&s, "counted-async", json!({}), &[]).await.status,
        202
    );
    post_with(&s, "counted-async", json!({}), &[])
        .await
        .error(429, "RATE_LIMITED");
    // Refusals before the channel's checks count too (session 18: a 405, a
    // 413 or a 415 for a known channel were in no `messages_total`).
    s.send("GET", "/api/v1/data/counted-sync", None, &[])
        .await
        .error(405, "METHOD_NOT_ALLOWED");
    s.raw(
        "POST",
        "/api/v1/data/counted-sync",
        vec![b' '; (1 << 20) + 1],
        Some("application/json"),
    )
    .await
    .error(413, "PAYLOAD_TOO_LARGE");
    s.raw(
        "POST",
        "/api/v1/data/counted-sync",
        b"{}".to_vec(),
        Some("text/plain"),
    )
    .await
    .error(415, "UNSUPPORTED_MEDIA_TYPE");
    let metrics = s.get("/metrics").await.text;
    for line in [
        "messages_total{channel=\"counted-sync\",status=\"ok\"} 1",
        "messages_total{channel=\"counted-sync\",status=\"rejected\"} 4",
        "messages_total{channel=\"counted-async\",status=\"rejected\"} 1",
    ] {
        assert!(metrics.contains(line), "missing {line} in\n{metrics}");
    }
    assert!(
        !metrics.contains("messages_total{channel=\"counted-sync\",status=\"error\"} 1"),
        "{metrics}"
    );
}

crate::on_both_governance_backends!(
    the_rate_limit_key_logic_isolates_clients,
    the_rate_limit_key_logic_isolates_clients_body
);

async fn the_rate_limit_key_logic_isolates_clients_body(gov: Gov) {
    let s = start_gov(gov, |_| {}).await;
    s.deploy(
        echo("r"),
        named(
            "tenants",
            "r",
            json!({"rate_limit": {"requests_per_second": 0.1, "burst": 1, "key_logic": {"var": "headers.x-tenant"}}}),
        ),
    )
    .await;
    let a = [("x-tenant", "a")];
    let b = [("x-tenant", "b")];
    assert_eq!(post_with(&s, "tenants", json!({}), &a).await.status, 200);
    post_with(&s, "tenants", json!({}), &a)
        .await
        .error(429, "RATE_LIMITED");
    // Same IP, another key: its own bucket.
    assert_eq!(post_with(&s, "tenants", json!({}), &b).await.status, 200);
    post_with(&s, "tenants", json!({}), &b)
        .await
        .error(429, "RATE_LIMITED");
    // The key label is a hash, never the key itself.
    let metrics = s.get("/metrics").await.text;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("rate_limit_rejections_total{") && l.contains("client=\"key:")),
        "{metrics}"
    );
}

crate::on_both_governance_backends!(
    the_platform_rate_limit_applies_to_every_channel_when_enabled,
    the_platform_rate_limit_body
);

async fn the_platform_rate_limit_body(gov: Gov) {
    let s = start_gov(gov, |c| {
        c.rate_limit.enabled = true;
        c.rate_limit.requests_per_second = 1;
        c.rate_limit.burst = 3;
    })
    .await;
    s.deploy(echo("a"), named("pa", "a", json!({}))).await;
    s.deploy(echo("b"), named("pb", "b", json!({}))).await;
    // One bucket per client across channels: three requests, then 429.
    assert_eq!(post_with(&s, "pa", json!({}), &[]).await.status, 200);
    assert_eq!(post_with(&s, "pb", json!({}), &[]).await.status, 200);
    assert_eq!(post_with(&s, "pa", json!({}), &[]).await.status, 200);
    let r = post_with(&s, "pb", json!({}), &[]).await;
    r.error(429, "RATE_LIMITED");
    assert!(retry_after(&r) >= 1);
    // The admin plane is not metered.
    assert_eq!(s.admin("GET", "/channels", None).await.status, 200);

    // Off (the default): no platform limit.
    let off = start_gov(gov, |_| {}).await;
    off.deploy(echo("a"), named("pa", "a", json!({}))).await;
    for _ in 0..6 {
        assert_eq!(post_with(&off, "pa", json!({}), &[]).await.status, 200);
    }
}

// ------------------------------------------------- shared state (Redis)

/// Two servers with one Redis (same key prefix) share dedup windows, rate
/// buckets and cached responses; a server with another prefix does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_backend_shares_state_between_servers() {
    let prefix = unique("sluice-shared");
    let shared = |c: &mut sluice::config::Config| {
        governance(c, Gov::Redis);
        c.governance.key_prefix = prefix.clone();
    };
    let a = start_with(Db::Sqlite, shared).await;
    let b = start_with(Db::Sqlite, shared).await;
    let other = start_gov(Gov::Redis, |_| {}).await;
    for s in [&a, &b, &other] {
        s.deploy(
            echo("sh"),
            named(
                "sh",
                "sh",
                json!({
                    "deduplication": {"window_secs": 60},
                    "rate_limit": {"requests_per_second": 0.01, "burst": 3},
                    "cache": {"ttl_secs": 60, "key_logic": {"var": "data.q"}}
                }),
            ),
        )
        .await;
    }
    // A dedup key used on one server is a duplicate on the other.
    let key = [("idempotency-key", "k-shared")];
    assert_eq!(post_with(&a, "sh", json!({"q": 1}), &key).await.status, 200);
    post_with(&b, "sh", json!({"q": 1}), &key)
        .await
        .error(409, "CONFLICT");
    // The response cached by a is a hit on b (a's request id inside).
    let first = post_with(&a, "sh", json!({"q": 2}), &[]).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let hit = post_with(&b, "sh", json!({"q": 2}), &[]).await;
    assert_eq!(hit.headers["x-cache"], "hit", "{}", hit.text);
    assert_eq!(hit.body, first.body);
    // Burst 3 for the whole fleet: a's two runs and b's cache hit took the
    // tokens (the 409 came before the rate limit and took none): the next
    // request on either server is limited.
    post_with(&b, "sh", json!({"q": 3}), &[])
        .await
        .error(429, "RATE_LIMITED");
    post_with(&a, "sh", json!({"q": 4}), &[])
        .await
        .error(429, "RATE_LIMITED");
    // Another prefix is another fleet: fresh windows and buckets.
    assert_eq!(
        post_with(&other, "sh", json!({"q": 1}), &key).await.status,
        200
    );
}

/// Redis unreachable: dedup and rate limits fail closed (503) unless the
/// channel chose `fail_open`; the cache degrades to a miss; the failures are
/// counted. The server starts and serves regardless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_fails_in_the_direction_the_channel_chose() {
    let port = free_port();
    let s = start_gov(Gov::Redis, |c| {
        c.governance.redis_url = format!("redis://:hunter2@127.0.0.1:{port}/");
        c.governance.timeout_ms = 200;
    })
    .await;
    s.deploy(
        echo("closed"),
        named(
            "closed",
            "closed",
            json!({"deduplication": {}, "rate_limit": {"requests_per_second": 100}}),
        ),
    )
    .await;
    s.deploy(
        echo("open"),
        named(
            "open",
            "open",
            json!({
                "deduplication": {"fail_open": true},
                "rate_limit": {"requests_per_second": 100, "fail_open": true},
                "cache": {"ttl_secs": 60}
            }),
        ),
    )
    .await;
    s.deploy(echo("plain"), named("plain", "plain", json!({})))
        .await;
    let key = [("idempotency-key", "k-1")];
    let r = post_with(&s, "closed", json!({}), &key).await;
    let e = r.error(503, "SERVICE_UNAVAILABLE");
    assert!(
        e["message"].as_str().unwrap().contains("deduplication"),
        "{e}"
    );
    assert!(retry_after(&r) >= 1);
    // Without a dedup key only the rate limit needs Redis.
    let e = post_with(&s, "closed", json!({}), &[]).await;
    let e = e.error(503, "SERVICE_UNAVAILABLE");
    assert!(e["message"].as_str().unwrap().contains("rate limit"), "{e}");
    // fail_open: admitted, twice with the same key (nothing remembered it),
    // and the cache is a miss every time (each answer is a new run).
    let one = post_with(&s, "open", json!({}), &key).await;
    let two = post_with(&s, "open", json!({}), &key).await;
    assert_eq!((one.status, two.status), (200, 200), "{}", two.text);
    assert_ne!(one.body["data"]["rid"], two.body["data"]["rid"]);
    assert_ne!(
        two.headers.get("x-cache").map(|v| v.to_str().unwrap()),
        Some("hit")
    );
    // A channel without governance does not touch Redis at all.
    assert_eq!(post_with(&s, "plain", json!({}), &[]).await.status, 200);
    let metrics = s.get("/metrics").await.text;
    for needle in [
        "operation=\"deduplication\"",
        "operation=\"rate_limit\"",
        "operation=\"cache_read\"",
    ] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("governance_backend_errors_total{") && l.contains(needle)),
            "{needle} not counted:\n{metrics}"
        );
    }
    assert!(!metrics.contains("hunter2"));
}

/// The platform limit failing closed says so: it was reported as the
/// channel's own rate limit on channels that have none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_names_the_platform_limit() {
    let port = free_port();
    let s = start_gov(Gov::Redis, |c| {
        c.governance.redis_url = format!("redis://127.0.0.1:{port}/");
        c.governance.timeout_ms = 200;
        c.rate_limit.enabled = true;
    })
    .await;
    s.deploy(echo("plain"), named("plain", "plain", json!({})))
        .await;
    let r = post_with(&s, "plain", json!({}), &[]).await;
    let e = r.error(503, "SERVICE_UNAVAILABLE");
    assert_eq!(
        e["message"],
        "channel 'plain' cannot check the platform rate limit: the shared governance \
         backend is unreachable; retry shortly"
    );
}

// ------------------------------------------------------------- backpressure

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backpressure_sheds_concurrent_requests_with_503() {
    // I/O-bound slow requests (a CPU-bound one holds a runtime worker, and
    // whether the others are even accepted meanwhile depends on the scheduler).
    let s = start_with(Db::Sqlite, |c| c.security.allow_private_networks = true).await;
    let upstream = slow_upstream(std::time::Duration::from_millis(400)).await;
    deploy_io_slow(
        &s,
        "slow",
        &upstream,
        json!({"timeout_ms": 60000, "backpressure": {"max_concurrent": 1}}),
    )
    .await;
    let items: Vec<u32> = (0..3000).collect();
    let payload = json!({ "items": items });
    let calls = (0..4).map(|_| post_with(&s, "slow", payload.clone(), &[]));
    let answers = futures_util::future::join_all(calls).await;
    let ok = answers.iter().filter(|r| r.status == 200).count();
    let shed: Vec<&Resp> = answers.iter().filter(|r| r.status == 503).collect();
    assert!(ok >= 1, "{answers:?}");
    assert!(!shed.is_empty(), "nothing was shed: {answers:?}");
    for r in &shed {
        r.error(503, "SERVICE_UNAVAILABLE");
        assert!(retry_after(r) >= 1);
    }
    assert_eq!(ok + shed.len(), 4);
    // Slots are given back: the next request runs.
    assert_eq!(
        post_with(&s, "slow", json!({"items": [1, 2]}), &[])
            .await
            .status,
        200
    );
    // Without a limit the same concurrent requests all run.
    deploy_io_slow(&s, "unlimited", &upstream, json!({"timeout_ms": 60000})).await;
    let calls = (0..3).map(|_| post_with(&s, "unlimited", payload.clone(), &[]));
    for r in futures_util::future::join_all(calls).await {
        assert_eq!(r.status, 200, "{}", r.text);
    }
}

// ----------------------------------------------------------- response cache

crate::on_both_governance_backends!(
    the_response_cache_serves_hits_without_running_the_workflow,
    the_response_cache_serves_hits_without_running_the_workflow_body
);

async fn the_response_cache_serves_hits_without_running_the_workflow_body(gov: Gov) {
    let s = start_gov(gov, |_| {}).await;
    s.deploy(
        echo("c"),
        named("cached", "c", json!({"cache": {"ttl_secs": 1}})),
    )
    .await;
    let first = post_with(&s, "cached", json!({"q": 1}), &[]).await;
    assert_eq!(first.status, 200, "{}", first.text);
    assert_eq!(first.headers["x-cache"], "miss");
    let hit = post_with(&s, "cached", json!({"q": 1}), &[]).await;
    assert_eq!(hit.status, 200);
    // Same request id inside: the stored answer, no new run.
    assert_eq!(hit.body, first.body);
    assert_eq!(hit.headers["x-cache"], "hit");
    assert_ne!(hit.headers["x-request-id"], first.headers["x-request-id"]);
    // Another body (or query) is another key.
    let other = post_with(&s, "cached", json!({"q": 2}), &[]).await;
    assert_ne!(other.body["data"]["rid"], first.body["data"]["rid"]);
    let query = s
        .send(
            "POST",
            "/api/v1/data/cached?x=1",
            Some(json!({"data": {"q": 1}})),
            &[],
        )
        .await;
    assert_ne!(query.body["data"]["rid"], first.body["data"]["rid"]);
    // Queries that decode alike pair by pair are different keys (they
    // made one key: `?a=1&b=2` was answered `?a=1%26b=2`'s entry).
    let mut rids = Vec::new();
    for target in ["?a=1&b=2", "?a=1%26b=2", "?k%3Dv=1", "?k=v%3D1"] {
        let r = s
            .send(
                "POST",
                &format!("/api/v1/data/cached{target}"),
                Some(json!({"data": {"q": 1}})),
                &[],
            )
            .await;
        assert_eq!(r.headers["x-cache"], "miss", "{target}");
        rids.push(r.body["data"]["rid"].clone());
    }
    rids.dedup();
    assert_eq!(rids.len(), 4);
    // The entry expires with its TTL.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let fresh = post_with(&s, "cached", json!({"q": 1}), &[]).await;
    assert_eq!(fresh.status, 200);
    assert_ne!(fresh.body["data"]["rid"], first.body["data"]["rid"]);
    assert_eq!(fresh.headers["x-cache"], "miss");

    // An answer carrying errors (a task failed under continue_on_error) is
    // not cached: the next request runs again (session 19).
    let mut flaky = echo("cf");
    flaky["continue_on_error"] = json!(true);
    flaky["tasks"].as_array_mut().unwrap().push(json!(
        {"id": "boom", "name": "boom", "function": {"name": "map", "input": {"mappings": [
            {"path": "x", "logic": {"/": [1, 0]}}]}}}
    ));
    s.deploy(
        flaky,
        named("cached-flaky", "cf", json!({"cache": {"ttl_secs": 60}})),
    )
    .await;
    let one = post_with(&s, "cached-flaky", json!({"q": 1}), &[]).await;
    assert_eq!(one.status, 200, "{}", one.text);
    assert_eq!(one.body["errors"][0]["task_id"], "boom", "{}", one.text);
    let two = post_with(&s, "cached-flaky", json!({"q": 1}), &[]).await;
    assert_ne!(
        two.headers.get("x-cache").map(|v| v.to_str().unwrap()),
        Some("hit")
    );
    assert_ne!(two.body["data"]["rid"], one.body["data"]["rid"]);
}

/// While two versions split traffic, a cached answer is served only to
/// callers whose bucket runs the version that produced it (before, a canary
/// caller got the stable version's cached answer with `x-cache: hit`). A
/// profiled request by header skips the cache like `?profile=1` (before, the
/// header was ignored on a hit).
#[tokio::test]
async fn the_response_cache_follows_the_rollout_and_skips_profiles() {
    let s = start(Db::Sqlite).await;
    let version = |tag: &str| {
        let mut wf = echo("rc");
        wf["tasks"][1]["function"]["input"]["mappings"]
            .as_array_mut()
            .unwrap()
            .push(json!({"path": "by", "logic": tag}));
        wf
    };
    s.deploy(
        version("v1"),
        named("rolled", "rc", json!({"cache": {"ttl_secs": 60}})),
    )
    .await;
    s.admin("POST", "/workflows/rc/versions", None)
        .await
        .ok(201);
    s.admin("PUT", "/workflows/rc", Some(version("v2")))
        .await
        .ok(200);
    s.admin(
        "PATCH",
        "/workflows/rc/status",
        Some(json!({"status": "active", "rollout_percentage": 50})),
    )
    .await
    .ok(200);
    // Callers on each side of the split (by a first, distinct body each).
    let (mut on_v1, mut on_v2) = (None, None);
    for i in 0..200 {
        let key = format!("caller-{i}");
        let r = post_with(
            &s,
            "rolled",
            json!({"probe": i}),
            &[("x-rollout-key", &key)],
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let side = if r.body["data"]["by"] == "v1" {
            &mut on_v1
        } else {
            &mut on_v2
        };
        side.get_or_insert(key);
        if on_v1.is_some() && on_v2.is_some() {
            break;
        }
    }
    let (k1, k2) = (on_v1.expect("a v1 caller"), on_v2.expect("a v2 caller"));
    let same = json!({"same": 1});
    for (first, second) in [(&k1, &k2), (&k2, &k1)] {
        let body = json!({"same": first});
        let a = post_with(&s, "rolled", body.clone(), &[("x-rollout-key", first)]).await;
        let b = post_with(&s, "rolled", body.clone(), &[("x-rollout-key", second)]).await;
        assert_ne!(
            a.body["data"]["by"], b.body["data"]["by"],
            "{} / {}",
            a.text, b.text
        );
        assert_eq!(b.headers["x-cache"], "miss");
        // Each side is a hit for its own callers.
        let again = post_with(&s, "rolled", body, &[("x-rollout-key", second)]).await;
        assert_eq!(again.headers["x-cache"], "hit");
        assert_eq!(again.body, b.body);
    }
    // Profiled by header: run, not answered from the cache, not stored.
    let cached = post_with(&s, "rolled", same.clone(), &[("x-rollout-key", &k1)]).await;
    assert_eq!(cached.headers["x-cache"], "miss");
    let profiled = post_with(
        &s,
        "rolled",
        same.clone(),
        &[("x-rollout-key", &k1), ("x-service-profile", "1")],
    )
    .await;
    assert_eq!(profiled.status, 200, "{}", profiled.text);
    assert!(
        profiled.headers.get("x-cache").is_none(),
        "{:?}",
        profiled.headers
    );
    assert!(
        profiled.body["_service"]["profile"].is_object(),
        "{}",
        profiled.text
    );
    assert_ne!(profiled.body["data"]["rid"], cached.body["data"]["rid"]);
    let after = post_with(&s, "rolled", same, &[("x-rollout-key", &k1)]).await;
    assert_eq!(after.headers["x-cache"], "hit");
    assert_eq!(after.body, cached.body);
}

/// A workflow and channel deleted and created again under the same ids
/// start at version 1 again: the cache must not answer from the deleted
/// definitions' entries (before, the old answer came back as a hit).
#[tokio::test]
async fn the_response_cache_forgets_deleted_definitions() {
    let s = start(Db::Sqlite).await;
    let tagged = |tag: &str| {
        let mut wf = echo("again");
        wf["tasks"][1]["function"]["input"]["mappings"]
            .as_array_mut()
            .unwrap()
            .push(json!({"path": "val", "logic": tag}));
        wf
    };
    let channel = named("again-ch", "again", json!({"cache": {"ttl_secs": 60}}));
    s.deploy(tagged("OLD"), channel.clone()).await;
    let old = post_with(&s, "again-ch", json!({"same": 1}), &[]).await;
    assert_eq!(old.body["data"]["val"], "OLD", "{}", old.text);
    for path in ["/channels/again-ch", "/workflows/again"] {
        let r = s.admin("DELETE", path, None).await;
        assert_eq!(r.status, 204, "{path}: {}", r.text);
    }
    s.deploy(tagged("NEW"), channel).await;
    let new = post_with(&s, "again-ch", json!({"same": 1}), &[]).await;
    assert_eq!(new.body["data"]["val"], "NEW", "{}", new.text);
    assert_eq!(new.headers["x-cache"], "miss");
}

#[tokio::test]
async fn the_cache_key_logic_and_failures_are_not_cached() {
    let s = start(Db::Sqlite).await;
    let wf = json!({
        "workflow_id": "k", "name": "k",
        "tasks": [
            {"id": "stamp", "name": "stamp", "function": {"name": "map", "input": {"mappings": [
                {"path": "rid", "logic": {"var": "metadata.request_id"}}
            ]}}},
            {"id": "boom", "name": "boom", "condition": {"==": [{"var": "payload.fail"}, true]},
             "function": {"name": "parse_json", "input": {"source": "payload.fail_text", "target": "x"}}}
        ]
    });
    s.deploy(
        wf,
        named(
            "keyed",
            "k",
            json!({"cache": {"ttl_secs": 60, "key_logic": {"var": "data.user"}}}),
        ),
    )
    .await;
    let a = post_with(&s, "keyed", json!({"user": "u1", "noise": 1}), &[]).await;
    let b = post_with(&s, "keyed", json!({"user": "u1", "noise": 2}), &[]).await;
    assert_eq!(a.body["data"]["rid"], b.body["data"]["rid"]);
    let c = post_with(&s, "keyed", json!({"user": "u2"}), &[]).await;
    assert_ne!(a.body["data"]["rid"], c.body["data"]["rid"]);
    // A failed run is never stored.
    let bad = json!({"user": "u3", "fail": true, "fail_text": "{nope"});
    let f1 = post_with(&s, "keyed", bad.clone(), &[]).await;
    assert_eq!(f1.status, 500, "{}", f1.text);
    let f2 = post_with(&s, "keyed", bad, &[]).await;
    assert_eq!(f2.status, 500);
    assert!(f2.headers.get("x-cache").is_none());
    // A disabled cache stores nothing.
    s.deploy(
        echo("off"),
        named("uncached", "off", json!({"cache": {"enabled": false}})),
    )
    .await;
    let x = post_with(&s, "uncached", json!({}), &[]).await;
    let y = post_with(&s, "uncached", json!({}), &[]).await;
    assert_ne!(x.body["data"]["rid"], y.body["data"]["rid"]);
    // Not cacheable at all: no x-cache either way.
    assert!(y.headers.get("x-cache").is_none());
}

// --------------------------------------------------------------------- CORS

#[tokio::test]
async fn cors_allows_listed_origins_and_answers_preflights() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        echo("w"),
        json!({
            "channel_id": "cors", "name": "cors", "channel_type": "sync", "protocol": "rest",
            "route_pattern": "/cors/{id}", "methods": ["POST"], "workflow_id": "w",
            "config_json": {"cors": {
                "allowed_origins": ["https://app.example"],
                "allowed_headers": ["content-type", "x-tenant"],
                "max_age_secs": 600
            }}
        }),
    )
    .await;
    s.deploy(echo("w2"), named("nocors", "w2", json!({}))).await;
    let good = [("origin", "https://app.example")];
    let evil = [("origin", "https://evil.example")];

    let r = s
        .send(
            "POST",
            "/api/v1/data/cors/1",
            Some(json!({"data": {}})),
            &good,
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.headers["access-control-allow-origin"],
        "https://app.example"
    );
    assert!(r.headers["vary"].to_str().unwrap().contains("Origin"));
    // A disallowed origin gets the answer but no CORS headers.
    let r = s
        .send(
            "POST",
            "/api/v1/data/cors/1",
            Some(json!({"data": {}})),
            &evil,
        )
        .await;
    assert_eq!(r.status, 200);
    assert!(r.headers.get("access-control-allow-origin").is_none());
    // ... and, like every answer of a CORS channel, says it varies by
    // origin, so a shared cache keeps the two answers apart.
    assert_eq!(r.headers["vary"], "Origin");
    let r = s
        .send(
            "POST",
            "/api/v1/data/cors/1",
            Some(json!({"data": {}})),
            &[],
        )
        .await;
    assert_eq!(r.headers["vary"], "Origin");

    // Preflight.
    let pre = s
        .send(
            "OPTIONS",
            "/api/v1/data/cors/1",
            None,
            &[
                ("origin", "https://app.example"),
                ("access-control-request-method", "POST"),
                ("access-control-request-headers", "content-type"),
            ],
        )
        .await;
    assert_eq!(pre.status, 204, "{}", pre.text);
    let h = &pre.headers;
    assert_eq!(h["access-control-allow-origin"], "https://app.example");
    assert_eq!(h["access-control-allow-methods"], "POST");
    assert_eq!(h["access-control-allow-headers"], "content-type, x-tenant");
    assert_eq!(h["access-control-max-age"], "600");
    let denied = preflight(&s, "https://evil.example", "POST", "/api/v1/data/cors/1").await;
    denied.error(403, "FORBIDDEN");
    assert!(denied.headers.get("access-control-allow-origin").is_none());
    assert_eq!(denied.headers["vary"], "Origin");
    assert_eq!(pre.headers["vary"], "Origin");
    // Refusals given before the channel runs (415 not JSON, 413 too
    // large) carry the CORS headers too, so the browser can read them.
    let not_json = s
        .raw_with(
            "POST",
            "/api/v1/data/cors/1",
            b"x".to_vec(),
            &[("content-type", "text/plain"), good[0]],
        )
        .await;
    not_json.error(415, "UNSUPPORTED_MEDIA_TYPE");
    assert_eq!(
        not_json.headers["access-control-allow-origin"],
        "https://app.example"
    );
    assert_eq!(not_json.headers["vary"], "Origin");
    let huge = s
        .raw_with(
            "POST",
            "/api/v1/data/cors/1",
            vec![b' '; 1_048_577],
            &[("content-type", "application/json"), good[0]],
        )
        .await;
    huge.error(413, "PAYLOAD_TOO_LARGE");
    assert_eq!(
        huge.headers["access-control-allow-origin"],
        "https://app.example"
    );
    // A disallowed origin still gets none.
    let evil_415 = s
        .raw_with(
            "POST",
            "/api/v1/data/cors/1",
            b"x".to_vec(),
            &[("content-type", "text/plain"), evil[0]],
        )
        .await;
    assert!(
        evil_415
            .headers
            .get("access-control-allow-origin")
            .is_none()
    );
    // A method the route does not serve: no route for it (the message
    // names the method asked about).
    let none = preflight(&s, "https://app.example", "DELETE", "/api/v1/data/cors/1").await;
    let e = none.error(404, "NOT_FOUND");
    assert_eq!(e["message"], "No route matches DELETE /api/v1/data/cors/1");
    // A name-routed channel takes POST only: a preflight for another method
    // is refused (403), even when its CORS settings list that method.
    s.deploy(
        echo("w3"),
        named(
            "byname",
            "w3",
            json!({"cors": {"allowed_origins": ["https://app.example"],
                            "allowed_methods": ["POST", "DELETE"]}}),
        ),
    )
    .await;
    let ok = preflight(&s, "https://app.example", "POST", "/api/v1/data/byname").await;
    assert_eq!(ok.status, 204, "{}", ok.text);
    // Without `allowed_headers`: the headers the service invites callers
    // to send (a browser asking for x-request-id was refused).
    assert_eq!(
        ok.headers["access-control-allow-headers"],
        "content-type, x-request-id, traceparent, tracestate, x-service-profile, idempotency-key"
    );
    let refused = preflight(&s, "https://app.example", "DELETE", "/api/v1/data/byname").await;
    refused.error(403, "FORBIDDEN");
    assert_eq!(refused.headers["vary"], "Origin");
    // A channel without CORS settings refuses every preflight.
    preflight(&s, "https://app.example", "POST", "/api/v1/data/nocors")
        .await
        .error(403, "FORBIDDEN");
    let r = s
        .send(
            "POST",
            "/api/v1/data/nocors",
            Some(json!({"data": {}})),
            &good,
        )
        .await;
    assert!(r.headers.get("access-control-allow-origin").is_none());
}

async fn preflight(s: &TestServer, origin: &str, method: &str, path: &str) -> Resp {
    s.send(
        "OPTIONS",
        path,
        None,
        &[
            ("origin", origin),
            ("access-control-request-method", method),
        ],
    )
    .await
}

// --------------------------------------------------------- validation_logic

/// A REST channel whose `validation_logic` reads all four inputs: the body's
/// `data`, a header, a query parameter and a path parameter.
fn validated_channel() -> Json {
    json!({
        "channel_id": "checked", "name": "checked", "channel_type": "sync", "protocol": "rest",
        "route_pattern": "/orders/{order_id}/lines", "methods": ["POST"], "workflow_id": "v",
        "validation_logic": {"and": [
            {">": [{"var": "data.qty"}, 0]},
            {"==": [{"var": "headers.x-tenant"}, "acme"]},
            {"==": [{"var": "query.mode"}, "strict"]},
            {"==": [{"var": "path.order_id"}, "A-17"]}
        ]}
    })
}

async fn order_line(s: &TestServer, order: &str, mode: &str, tenant: &str, qty: i64) -> Resp {
    s.send(
        "POST",
        &format!("/api/v1/data/orders/{order}/lines?mode={mode}"),
        Some(json!({"data": {"qty": qty}})),
        &[("x-tenant", tenant)],
    )
    .await
}

#[tokio::test]
async fn validation_logic_reads_data_headers_query_and_path() {
    let s = start(Db::Sqlite).await;
    s.deploy(echo("v"), validated_channel()).await;
    let r = order_line(&s, "A-17", "strict", "acme", 2).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"]["in"], json!({"qty": 2}));
    let rid = r.body["data"]["rid"].clone();

    // Each input alone can reject: the spec's envelope, nothing more.
    let rejection = json!({"error": {"code": "BAD_REQUEST",
        "message": "input validation failed: the channel's validation_logic rejected the request"}});
    for (what, r) in [
        ("data", order_line(&s, "A-17", "strict", "acme", 0).await),
        (
            "headers",
            order_line(&s, "A-17", "strict", "other", 2).await,
        ),
        ("query", order_line(&s, "A-17", "loose", "acme", 2).await),
        ("path", order_line(&s, "B-1", "strict", "acme", 2).await),
    ] {
        assert_eq!(r.status, 400, "{what}: {}", r.text);
        assert_eq!(r.body, rejection, "{what}");
    }
    // The rule still passes afterwards (a rejection leaves nothing behind),
    // and that answer is a new run.
    let r = order_line(&s, "A-17", "strict", "acme", 5).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_ne!(r.body["data"]["rid"], rid);
    // A body that is no JSON is refused in the same words as on a channel
    // without checks (it said "malformed JSON" here).
    let bad = s
        .raw(
            "POST",
            "/api/v1/data/orders/A-17/lines?mode=strict",
            b"{\"data\": ".to_vec(),
            Some("application/json"),
        )
        .await;
    let message = bad.error(400, "BAD_REQUEST")["message"].clone();
    assert!(
        message
            .as_str()
            .unwrap()
            .starts_with("request body is not valid JSON"),
        "{message}"
    );
}

/// An invalid `validation_logic` or governance setting is refused when a
/// channel is created and when a draft is updated, with every problem at its
/// field; a refused update leaves the draft as it was.
#[tokio::test]
async fn invalid_channel_rules_are_rejected_at_create_and_update() {
    let s = start(Db::Sqlite).await;
    let expected = json!([{"field": "validation_logic",
        "message": "invalid JSONLogic: unknown operator 'no_such_op'"}]);
    let mut bad = validated_channel();
    bad["validation_logic"] = json!({"and": [{"var": "data.qty"}, {"no_such_op": [1]}]});
    let r = s.admin("POST", "/channels", Some(bad.clone())).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.body["error"]["details"], expected, "{}", r.text);
    s.admin("GET", "/channels/checked", None)
        .await
        .error(404, "NOT_FOUND");

    // A valid draft, then updates that would break it.
    s.admin("POST", "/channels", Some(validated_channel()))
        .await
        .ok(201);
    let r = s.admin("PUT", "/channels/checked", Some(bad)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.body["error"]["details"], expected, "{}", r.text);

    let mut bad = validated_channel();
    bad["config_json"] = json!({
        "rate_limit": {"requests_per_second": -1, "key_logic": {"no_such_op": 1}},
        "deduplication": {"window_secs": 0},
        "backpressure": {"max_concurrent": 0},
        "cors": {"allowed_origins": ["app.example"]},
        "cache": {"ttl_secs": 60, "scope": "global"}
    });
    let r = s.admin("PUT", "/channels/checked", Some(bad)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(
        r.detail_fields(),
        [
            "config_json.rate_limit.requests_per_second",
            "config_json.rate_limit.key_logic",
            "config_json.deduplication.window_secs",
            "config_json.cache.scope",
            "config_json.backpressure.max_concurrent",
            "config_json.cors.allowed_origins[0]",
        ],
        "{}",
        r.text
    );

    // The draft is unchanged: still version 1 with its original rule.
    let r = s.admin("GET", "/channels/checked", None).await;
    let d = r.ok(200);
    assert_eq!(d["version"], 1);
    assert_eq!(
        d["validation_logic"],
        validated_channel()["validation_logic"]
    );
    assert!(d["config_json"].get("rate_limit").is_none(), "{}", r.text);
}

// ---------------------------------------------------------- invalid configs

#[tokio::test]
async fn invalid_governance_settings_are_rejected_with_details() {
    let s = start(Db::Sqlite).await;
    let bad = named(
        "bad",
        "w",
        json!({
            "rate_limit": {"requests_per_second": 0, "key_logic": {"no_such_op": [1]}},
            "deduplication": {"window_secs": 0, "key_logic": {"no_such_op": 1}},
            "cache": {"ttl_secs": 0, "key_logic": {"no_such_op": 1}},
            "backpressure": {"max_concurrent": 0},
            "cors": {"allowed_origins": ["app.example"], "allowed_methods": ["FETCH"]}
        }),
    );
    let r = s.admin("POST", "/channels", Some(bad)).await;
    r.error(400, "BAD_REQUEST");
    let fields = r.detail_fields();
    for f in [
        "config_json.rate_limit.requests_per_second",
        "config_json.rate_limit.key_logic",
        "config_json.deduplication.window_secs",
        "config_json.deduplication.key_logic",
        "config_json.cache.ttl_secs",
        "config_json.cache.key_logic",
        "config_json.backpressure.max_concurrent",
        "config_json.cors.allowed_origins[0]",
        "config_json.cors.allowed_methods[0]",
    ] {
        assert!(fields.iter().any(|x| x == f), "{f} missing in {fields:?}");
    }
    // Unknown keys are not silently ignored either.
    let r = s
        .admin(
            "POST",
            "/channels",
            Some(named(
                "bad2",
                "w",
                json!({"rate_limit": {"requests_per_second": 1, "per": "ip"}}),
            )),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["config_json.rate_limit.per"]);
}

// ------------------------------------------------------------- channel_call

fn call_task(id: &str, input: Json) -> Json {
    json!({"id": id, "name": id, "function": {"name": "channel_call", "input": input}})
}

fn caller(id: &str, tasks: Json) -> Json {
    let mut all = vec![
        json!({"id": "parse", "name": "parse", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}}),
    ];
    all.extend(tasks.as_array().unwrap().iter().cloned());
    json!({"workflow_id": id, "name": id, "tasks": all})
}

/// Prices its payload: `{total: qty * price, seen: payload}`.
fn pricing() -> Json {
    json!({
        "workflow_id": "pricing", "name": "pricing",
        "tasks": [{"id": "price", "name": "price", "function": {"name": "map", "input": {"mappings": [
            {"path": "total", "logic": {"*": [{"var": "payload.qty"}, {"var": "payload.price"}]}},
            {"path": "seen", "logic": {"var": "payload"}},
            {"path": "channel", "logic": {"var": "metadata.channel"}},
            {"path": "request", "logic": {"var": "metadata.request_id"}},
            {"path": "request_header", "logic": {"var": "metadata.headers.x-request-id"}}
        ]}}}]
    })
}

#[tokio::test]
async fn channel_call_runs_the_callee_in_process() {
    let s = start(Db::Sqlite).await;
    s.deploy(pricing(), named("pricing", "pricing", json!({})))
        .await;
    // Defaults: the caller's payload, the answer replaces `data`.
    s.deploy(
        caller(
            "plain",
            json!([call_task("call", json!({"channel": "pricing"}))]),
        ),
        named("plain", "plain", json!({})),
    )
    .await;
    let id = "7b1d2c3e-4f5a-4b6c-8d7e-9f0a1b2c3d4e";
    let r = post_with(
        &s,
        "plain",
        json!({"qty": 3, "price": 5}),
        &[("x-request-id", id)],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"]["total"], 15);
    assert_eq!(r.body["data"]["channel"], "pricing");
    assert_eq!(r.body["data"]["seen"], json!({"qty": 3, "price": 5}));
    // The callee runs under the caller's request id.
    assert_eq!(r.body["data"]["request"], id, "{}", r.text);
    assert_eq!(r.body["data"]["request_header"], id, "{}", r.text);

    // data_logic, channel_logic and response_path.
    s.deploy(
        caller(
            "shaped",
            json!([call_task(
                "call",
                json!({
                    "channel_logic": {"var": "data.in.target"},
                    "data_logic": {"var": "data.in.order"},
                    "response_path": "quote"
                })
            )]),
        ),
        named("shaped", "shaped", json!({})),
    )
    .await;
    let r = post_with(
        &s,
        "shaped",
        json!({"target": "pricing", "order": {"qty": 4, "price": 2}}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"]["quote"]["total"], 8);
    assert_eq!(
        r.body["data"]["quote"]["seen"],
        json!({"qty": 4, "price": 2})
    );
    // The caller's own data is kept next to the answer.
    assert_eq!(r.body["data"]["in"]["target"], "pricing");

    // Static data.
    s.deploy(
        caller(
            "fixed",
            json!([call_task(
                "call",
                json!({"channel": "pricing", "data": {"qty": 2, "price": 10}, "response_path": "temp_data.q"}),
            ), {"id": "copy", "name": "copy", "function": {"name": "map", "input": {"mappings": [
                {"path": "total", "logic": {"var": "temp_data.q.total"}}
            ]}}}]),
        ),
        named("fixed", "fixed", json!({})),
    )
    .await;
    let r = post_with(&s, "fixed", json!({}), &[]).await;
    assert_eq!(r.body["data"]["total"], 20, "{}", r.text);

    // The errors the callee's answer carried are the caller's too, on the
    // calling task, naming the channel and its task (session 18: dropped).
    s.deploy(
        json!({"workflow_id": "strict", "name": "strict", "tasks": [
            {"id": "check", "name": "check", "function": {"name": "validation", "input": {"rules": [
                {"logic": {">": [{"var": "payload.qty"}, 0]}, "message": "qty must be positive"}
            ]}}}
        ]}),
        named("strict", "strict", json!({})),
    )
    .await;
    s.deploy(
        caller(
            "checked",
            json!([call_task(
                "call",
                json!({"channel": "strict", "response_path": "r"})
            )]),
        ),
        named("checked", "checked", json!({})),
    )
    .await;
    let r = post_with(&s, "checked", json!({"qty": 0}), &[]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.body["errors"],
        json!([{"code": "VALIDATION_ERROR", "task_id": "call",
                "message": "channel 'strict', task 'check': qty must be positive"}]),
        "{}",
        r.text
    );
    let r = post_with(&s, "checked", json!({"qty": 2}), &[]).await;
    assert_eq!(r.body["errors"], json!([]), "{}", r.text);

    // An unknown callee is a task error naming it.
    s.deploy(
        caller(
            "lost",
            json!([call_task("call", json!({"channel": "nowhere"}))]),
        ),
        named("lost", "lost", json!({})),
    )
    .await;
    let r = post_with(&s, "lost", json!({}), &[]).await;
    let e = r.error(500, "TASK_ERROR");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("'nowhere' not found"),
        "{e}"
    );
}

#[tokio::test]
async fn channel_call_cycles_and_depth_are_task_errors_naming_the_chain() {
    let s = start_with(Db::Sqlite, |c| c.engine.max_channel_call_depth = 2).await;
    // ping -> pong -> ping
    s.deploy(
        caller(
            "ping",
            json!([call_task("call", json!({"channel": "pong"}))]),
        ),
        named("ping", "ping", json!({})),
    )
    .await;
    s.deploy(
        caller(
            "pong",
            json!([call_task("call", json!({"channel": "ping"}))]),
        ),
        named("pong", "pong", json!({})),
    )
    .await;
    let r = post_with(&s, "ping", json!({}), &[]).await;
    let e = r.error(500, "TASK_ERROR");
    let message = e["message"].as_str().unwrap();
    assert!(message.contains("cycle"), "{message}");
    assert!(message.contains("ping -> pong -> ping"), "{message}");
    assert_eq!(e["task_id"], "call");
    // Each task says its function's name once.
    assert!(!message.contains("channel_call: channel_call"), "{message}");

    // A name computed from the data is quoted in part: a 100 KB name does
    // not become a message of hundreds of KB.
    s.deploy(
        caller(
            "anyname",
            json!([call_task(
                "call",
                json!({"channel_logic": {"var": "data.in.to"}})
            )]),
        ),
        named("anyname", "anyname", json!({})),
    )
    .await;
    let long = "n".repeat(100_000);
    let r = post_with(&s, "anyname", json!({ "to": long }), &[]).await;
    let message = r.error(500, "TASK_ERROR")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    let quoted = format!("{}… (100000 bytes)", "n".repeat(64));
    assert_eq!(
        message,
        format!(
            "task 'call' failed: channel_call: channel '{quoted}' not found (anyname -> {quoted})"
        )
    );

    // c1 -> c2 -> c3 -> leaf is depth 3, over the limit of 2.
    s.deploy(echo("leaf"), named("leaf", "leaf", json!({})))
        .await;
    for (from, to) in [("c3", "leaf"), ("c2", "c3"), ("c1", "c2")] {
        s.deploy(
            caller(from, json!([call_task("call", json!({"channel": to}))])),
            named(from, from, json!({})),
        )
        .await;
    }
    let r = post_with(&s, "c1", json!({}), &[]).await;
    let message = r.error(500, "TASK_ERROR")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("max_channel_call_depth"), "{message}");
    assert!(message.contains("c1 -> c2 -> c3 -> leaf"), "{message}");
    // The chain is named once, not again at each level it came up through,
    // and neither is a prefix per level.
    assert_eq!(message.matches("c1 -> c2").count(), 1, "{message}");
    assert_eq!(message.matches("channel_call: ").count(), 1, "{message}");
    // Depth 2 is fine.
    let r = post_with(&s, "c2", json!({"x": 1}), &[]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"]["channel"], "leaf");
}

#[tokio::test]
async fn channel_call_applies_the_callees_governance() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        pricing(),
        json!({
            "channel_id": "guarded", "name": "guarded", "channel_type": "sync", "protocol": "http",
            "workflow_id": "pricing",
            "validation_logic": {"!!": [{"var": "data.qty"}]},
            "config_json": {"rate_limit": {"requests_per_second": 0.1, "burst": 2}}
        }),
    )
    .await;
    s.deploy(
        caller(
            "front",
            json!([call_task("call", json!({"channel": "guarded"}))]),
        ),
        named("front", "front", json!({})),
    )
    .await;
    // The callee's validation_logic rejects a payload without qty.
    let r = post_with(&s, "front", json!({"price": 1}), &[]).await;
    let m = r.error(500, "TASK_ERROR")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(m.contains("400 BAD_REQUEST"), "{m}");
    // Its rate limit (burst 2; the refused call above took a token, as rate
    // limiting runs before validation) lets one more call through, then
    // refuses.
    let r = post_with(&s, "front", json!({"qty": 1, "price": 1}), &[]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = post_with(&s, "front", json!({"qty": 1, "price": 1}), &[]).await;
    let m = r.error(500, "TASK_ERROR")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(m.contains("429 RATE_LIMITED"), "{m}");
    assert!(m.contains("front -> guarded"), "{m}");
}

/// A `channel_call` with `timeout_ms` gives up on a slow callee: 504
/// `TIMEOUT` (the documented status of a timed-out task) naming the chain,
/// well before the callee's own (longer) channel timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_call_timeout_ms_bounds_a_slow_callee() {
    let s = start_with(Db::Sqlite, |c| c.security.allow_private_networks = true).await;
    let upstream = slow_upstream(Duration::from_secs(3)).await;
    deploy_io_slow(&s, "slowpoke", &upstream, json!({"timeout_ms": 10000})).await;
    s.deploy(
        caller(
            "front",
            json!([call_task(
                "call",
                json!({"channel": "slowpoke", "timeout_ms": 200})
            )]),
        ),
        named("front", "front", json!({})),
    )
    .await;
    let started = std::time::Instant::now();
    let r = post_with(&s, "front", json!({}), &[]).await;
    let elapsed = started.elapsed();
    let e = r.error(504, "TIMEOUT");
    assert_eq!(e["task_id"], "call", "{}", r.text);
    let m = e["message"].as_str().unwrap();
    assert!(
        m.contains("channel_call: channel 'slowpoke' did not finish"),
        "{m}"
    );
    assert!(m.contains("200 ms"), "{m}");
    assert!(m.contains("(front -> slowpoke)"), "{m}");
    assert!(elapsed < Duration::from_millis(2000), "{elapsed:?}");

    // A callee that fails on its own (its upstream is gone) is named with
    // the chain too, and keeps its kind (502 from an upstream failure).
    let closed = format!("http://127.0.0.1:{}", free_port());
    deploy_io_slow(&s, "gone", &closed, json!({})).await;
    s.deploy(
        caller(
            "front2",
            json!([call_task("call", json!({"channel": "gone"}))]),
        ),
        named("front2", "front2", json!({})),
    )
    .await;
    let r = post_with(&s, "front2", json!({}), &[]).await;
    let m = r.error(502, "UPSTREAM_ERROR")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        m.starts_with("task 'call' failed: channel_call: channel 'gone': task 'call' failed: http_call: connector 'gone-up': POST /slow: cannot connect"),
        "{m}"
    );
    assert!(m.ends_with("(front2 -> gone)"), "{m}");
    assert!(!m.contains("127.0.0.1"), "never the base URL: {m}");
}

/// A workflow that answers which version of it ran.
fn tagged(id: &str, tag: &str) -> Json {
    json!({
        "workflow_id": id, "name": id,
        "tasks": [{"id": "tag", "name": "tag", "function": {"name": "map", "input": {"mappings": [
            {"path": "version", "logic": tag}
        ]}}}]
    })
}

#[tokio::test]
async fn channel_call_chooses_the_callee_version_by_the_callers_rollout_bucket() {
    let s = start(Db::Sqlite).await;
    // The callee: v1 everywhere, then v2 as a 50% canary.
    s.deploy(tagged("tiered", "v1"), named("tiered", "tiered", json!({})))
        .await;
    s.admin("POST", "/workflows/tiered/versions", None)
        .await
        .ok(201);
    s.admin("PUT", "/workflows/tiered", Some(tagged("tiered", "v2")))
        .await
        .ok(200);
    s.admin(
        "PATCH",
        "/workflows/tiered/status",
        Some(json!({"status": "active", "rollout_percentage": 50})),
    )
    .await
    .ok(200);
    s.deploy(
        caller(
            "front",
            json!([call_task("call", json!({"channel": "tiered"}))]),
        ),
        named("front", "front", json!({})),
    )
    .await;
    // For every caller, the version reached through the call is the one
    // the callee's own endpoint gives the same caller.
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..30 {
        let key = format!("caller-{i}");
        let headers = [("x-rollout-key", key.as_str())];
        let direct = post_with(&s, "tiered", json!({}), &headers).await;
        let via = post_with(&s, "front", json!({}), &headers).await;
        let version = direct.ok(200)["version"].clone();
        assert_eq!(via.ok(200)["version"], version, "{key}: {}", via.text);
        seen.insert(version.as_str().unwrap().to_owned());
    }
    assert_eq!(seen.len(), 2, "both versions serve: {seen:?}");
}

/// `server.trusted_proxies`: behind a trusted load balancer each client
/// named by `X-Forwarded-For` gets its own rate-limit bucket; the entry a
/// client wrote itself (left of the rightmost untrusted one) is not
/// believed, and without the setting the header changes nothing.
#[tokio::test]
async fn trusted_proxies_name_the_client_from_x_forwarded_for() {
    let limited = || {
        named(
            "behind-lb",
            "lb",
            json!({"rate_limit": {"requests_per_second": 0.1, "burst": 1}}),
        )
    };
    let s = start_with(Db::Sqlite, |c| {
        c.server.trusted_proxies = vec!["127.0.0.1".into(), "10.0.0.0/8".into()];
    })
    .await;
    s.deploy(echo("lb"), limited()).await;
    let from = |chain: &'static str| [("x-forwarded-for", chain)];
    let one = from("203.0.113.1, 10.0.0.7");
    assert_eq!(
        post_with(&s, "behind-lb", json!({}), &one).await.status,
        200
    );
    post_with(&s, "behind-lb", json!({}), &one)
        .await
        .error(429, "RATE_LIMITED");
    // Another client through the same balancer: its own bucket.
    let two = from("203.0.113.2");
    assert_eq!(
        post_with(&s, "behind-lb", json!({}), &two).await.status,
        200
    );
    // A client claiming to be 203.0.113.1 from 203.0.113.3 is 203.0.113.3.
    let spoofed = from("203.0.113.1, 203.0.113.3");
    assert_eq!(
        post_with(&s, "behind-lb", json!({}), &spoofed).await.status,
        200
    );
    let metrics = s.get("/metrics").await.text;
    let line = metrics
        .lines()
        .find(|l| l.starts_with("rate_limit_rejections_total{") && l.contains("behind-lb"))
        .unwrap_or_else(|| panic!("no rejection metric in:\n{metrics}"));
    assert!(line.contains("client=\"203.0.113.1\""), "{line}");

    // Without the setting the peer is the client, whatever the header says.
    let plain = start(Db::Sqlite).await;
    plain.deploy(echo("lb"), limited()).await;
    assert_eq!(
        post_with(&plain, "behind-lb", json!({}), &one).await.status,
        200
    );
    post_with(&plain, "behind-lb", json!({}), &two)
        .await
        .error(429, "RATE_LIMITED");
}
