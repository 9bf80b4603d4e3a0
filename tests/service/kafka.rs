//! Kafka-consuming channels against the Kafka-compatible broker that
//! `scripts/test.sh` starts (`../shared/services/kafka.sh`): traces for every
//! message, metadata from key and headers, per-partition order, the
//! dead-letter topic (failed and non-JSON messages), and at-least-once
//! delivery across a SIGKILL of the real binary.

use crate::support::{Db, TestServer, free_port, kafka_reader, start_with, unique};
use rdkafka::Message as _;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use serde_json::{Value as Json, json};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const KAFKA: &str = "127.0.0.1:9092";

fn producer() -> FutureProducer {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", KAFKA)
        .set("linger.ms", "0")
        .create()
        .expect("a Kafka producer")
}

async fn produce(
    p: &FutureProducer,
    topic: &str,
    key: Option<&str>,
    value: &[u8],
    headers: &[(&str, &str)],
) {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    let mut record = FutureRecord::to(topic).payload(value).headers(h);
    if let Some(k) = key {
        record = record.key(k);
    }
    p.send(record, Timeout::After(Duration::from_secs(10)))
        .await
        .expect("Kafka at 127.0.0.1:9092 is required (bash ../shared/services/kafka.sh)");
}

/// The workflow of the consuming channel: copies what a message brings into
/// `data`; a payload with `fail: true` fails the `boom` task.
fn workflow(id: &str) -> Json {
    json!({"workflow_id": id, "name": id, "tasks": [
        {"id": "copy", "name": "copy", "function": {"name": "map", "input": {"mappings": [
            {"path": "n", "logic": {"var": "payload.n"}},
            {"path": "msg_key", "logic": {"var": "metadata.key"}},
            {"path": "topic", "logic": {"var": "metadata.topic"}},
            {"path": "partition", "logic": {"var": "metadata.partition"}},
            {"path": "offset", "logic": {"var": "metadata.offset"}},
            {"path": "tp", "logic": {"var": "metadata.headers.traceparent"}},
            {"path": "origin", "logic": {"var": "metadata.headers.x-origin"}}
        ]}}},
        {"id": "boom", "name": "boom", "condition": {"var": "payload.fail"},
         "function": {"name": "http_call", "input": {"connector": "no-such-connector"}}}
    ]})
}

async fn deploy_kafka_channel(s: &TestServer, id: &str, topic: &str, group: &str) {
    s.deploy(
        workflow(id),
        json!({"channel_id": id, "name": id, "channel_type": "async", "protocol": "kafka",
               "workflow_id": id, "config_json": {"topic": topic, "consumer_group": group}}),
    )
    .await;
}

/// Every trace of `channel` (newest first).
async fn traces(client: &reqwest::Client, base: &str, channel: &str) -> Vec<Json> {
    let r: Json = client
        .get(format!(
            "{base}/api/v1/data/traces?channel={channel}&limit=500"
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["data"].as_array().cloned().unwrap_or_default()
}

/// Waits until `done` holds for the channel's traces.
async fn wait_traces(
    client: &reqwest::Client,
    base: &str,
    channel: &str,
    within: Duration,
    done: impl Fn(&[Json]) -> bool,
) -> Vec<Json> {
    let until = Instant::now() + within;
    loop {
        let t = traces(client, base, channel).await;
        if done(&t) {
            return t;
        }
        assert!(Instant::now() < until, "timed out; traces so far: {t:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumes_records_dead_letters_and_keeps_order() {
    let topic = unique("sluice-in");
    let dlq = unique("sluice-dlq");
    let group = unique("sluice-group");
    let dlq_topic = dlq.clone();
    let s = start_with(Db::Sqlite, move |c| {
        c.kafka.enabled = true;
        c.kafka.brokers = KAFKA.into();
        c.kafka.session_timeout_ms = 6000;
        c.kafka.dlq.enabled = true;
        c.kafka.dlq.topic = dlq_topic;
    })
    .await;
    deploy_kafka_channel(&s, "orders-in", &topic, &group).await;

    let p = producer();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    // One key, one partition: these must run in order.
    for n in 0..10 {
        let value = json!({"data": {"n": n}}).to_string();
        produce(
            &p,
            &topic,
            Some("k1"),
            value.as_bytes(),
            &[("traceparent", traceparent), ("X-Origin", "test")],
        )
        .await;
    }
    // A bare object (no `data` member) is the payload as a whole.
    produce(&p, &topic, None, br#"{"n": 100}"#, &[]).await;
    // A failing workflow and a value that is not JSON go to the DLQ ...
    produce(
        &p,
        &topic,
        Some("bad"),
        br#"{"data": {"n": 200, "fail": true}}"#,
        &[],
    )
    .await;
    produce(&p, &topic, Some("garbage"), b"not json {", &[]).await;
    // ... and the consumer goes on with the next message.
    produce(&p, &topic, Some("k1"), br#"{"data": {"n": 10}}"#, &[]).await;

    let all = wait_traces(
        &s.client,
        &s.base,
        "orders-in",
        Duration::from_secs(60),
        |t| t.len() >= 14,
    )
    .await;
    assert_eq!(all.len(), 14, "{all:#?}");
    assert!(all.iter().all(|t| t["mode"] == "kafka"), "{all:#?}");
    let completed: Vec<&Json> = all.iter().filter(|t| t["status"] == "completed").collect();
    let failed: Vec<&Json> = all.iter().filter(|t| t["status"] == "failed").collect();
    assert_eq!((completed.len(), failed.len()), (12, 2), "{all:#?}");

    // Metadata from the message.
    let first = completed
        .iter()
        .find(|t| t["data"]["n"] == 0)
        .expect("n = 0");
    let d = &first["data"];
    assert_eq!(d["msg_key"], "k1");
    assert_eq!(d["topic"], json!(topic));
    assert_eq!(d["tp"], traceparent);
    assert_eq!(d["origin"], "test");
    assert!(d["partition"].is_string() && d["offset"].is_string(), "{d}");
    let bare = completed
        .iter()
        .find(|t| t["data"]["n"] == 100)
        .expect("bare object");
    assert_eq!(bare["data"]["msg_key"], Json::Null);

    // Per-partition order: the k1 messages ran (were created) in offset order.
    let mut k1: Vec<(String, i64, i64)> = completed
        .iter()
        .filter(|t| t["data"]["msg_key"] == "k1")
        .map(|t| {
            (
                t["created_at"].as_str().unwrap().to_owned(),
                t["data"]["offset"].as_str().unwrap().parse().unwrap(),
                t["data"]["n"].as_i64().unwrap(),
            )
        })
        .collect();
    k1.sort();
    let ns: Vec<i64> = k1.iter().map(|x| x.2).collect();
    assert_eq!(ns, (0..=10).collect::<Vec<_>>(), "{k1:?}");
    assert!(k1.windows(2).all(|w| w[0].1 < w[1].1), "{k1:?}");

    // The failed trace names the task.
    let f = failed
        .iter()
        .find(|t| t["errors"][0]["task_id"] == "boom")
        .expect("failed run");
    assert_eq!(f["errors"][0]["code"], "TASK_ERROR", "{f}");

    // Both dead letters, with the documented fields.
    let c = kafka_reader(&[&dlq]).await;
    let mut letters = Vec::new();
    while letters.len() < 2 {
        let m = tokio::time::timeout(Duration::from_secs(30), c.recv())
            .await
            .expect("dead letters arrive")
            .unwrap();
        letters.push(serde_json::from_slice::<Json>(m.payload().unwrap()).unwrap());
    }
    letters.sort_by_key(|l| l["offset"].as_i64());
    let (failed_letter, garbage) = (&letters[0], &letters[1]);
    assert_eq!(failed_letter["source_topic"], json!(topic));
    assert_eq!(failed_letter["key"], "bad");
    assert_eq!(failed_letter["payload"], json!({"n": 200, "fail": true}));
    assert_eq!(failed_letter["error"]["task_id"], "boom");
    assert_eq!(failed_letter["error"]["code"], "TASK_ERROR");
    assert!(
        failed_letter["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no-such-connector")
    );
    assert!(failed_letter["partition"].is_i64() && failed_letter["offset"].is_i64());
    assert!(failed_letter["failed_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(garbage["key"], "garbage");
    assert_eq!(garbage["payload"], "not json {");
    assert_eq!(garbage["error"]["code"], "BAD_REQUEST");
    assert!(
        garbage["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not JSON")
    );
}

/// The consumer follows the channel: archiving it stops consumption; a
/// message produced meanwhile is consumed once the channel is active again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_follow_channel_lifecycle() {
    let topic = unique("sluice-life");
    let group = unique("sluice-group");
    let s = start_with(Db::Sqlite, |c| {
        c.kafka.enabled = true;
        c.kafka.brokers = KAFKA.into();
        c.kafka.session_timeout_ms = 6000;
    })
    .await;
    deploy_kafka_channel(&s, "life", &topic, &group).await;
    let p = producer();
    produce(&p, &topic, None, br#"{"data": {"n": 1}}"#, &[]).await;
    wait_traces(&s.client, &s.base, "life", Duration::from_secs(60), |t| {
        t.len() == 1
    })
    .await;
    assert_eq!(s.app.kafka.running().len(), 1);

    // Pausing stops the consumer; a message produced meanwhile waits.
    let r = s
        .admin(
            "PATCH",
            "/channels/life/status",
            Some(json!({"status": "paused"})),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let until = Instant::now() + Duration::from_secs(30);
    while !s.app.kafka.running().is_empty() {
        assert!(Instant::now() < until, "consumer still running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    produce(&p, &topic, None, br#"{"data": {"n": 2}}"#, &[]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(traces(&s.client, &s.base, "life").await.len(), 1);
    // Active again: the same group resumes after the committed offset, so
    // the waiting message runs and the first one does not run again.
    let r = s
        .admin(
            "PATCH",
            "/channels/life/status",
            Some(json!({"status": "active"})),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let t = wait_traces(&s.client, &s.base, "life", Duration::from_secs(60), |t| {
        t.len() >= 2
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t2 = traces(&s.client, &s.base, "life").await;
    assert_eq!(t2.len(), 2, "{t2:#?}");
    assert_eq!(t[0]["data"]["n"], 2);
}

/// A graceful stop commits what finished: a new consumer in the same group
/// starts after it and runs only the message produced later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_commits_finished_messages() {
    let topic = unique("sluice-stop");
    let group = unique("sluice-group");
    let config = |c: &mut sluice::config::Config| {
        c.kafka.enabled = true;
        c.kafka.brokers = KAFKA.into();
        c.kafka.session_timeout_ms = 6000;
    };
    let mut first = start_with(Db::Sqlite, config).await;
    deploy_kafka_channel(&first, "stop", &topic, &group).await;
    let p = producer();
    for n in 0..5 {
        produce(
            &p,
            &topic,
            None,
            json!({"data": {"n": n}}).to_string().as_bytes(),
            &[],
        )
        .await;
    }
    wait_traces(
        &first.client,
        &first.base,
        "stop",
        Duration::from_secs(60),
        |t| t.len() == 5,
    )
    .await;
    first.shutdown().await;

    let second = start_with(Db::Sqlite, config).await;
    deploy_kafka_channel(&second, "stop", &topic, &group).await;
    produce(&p, &topic, None, br#"{"data": {"n": 5}}"#, &[]).await;
    let t = wait_traces(
        &second.client,
        &second.base,
        "stop",
        Duration::from_secs(60),
        |t| !t.is_empty(),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t2 = traces(&second.client, &second.base, "stop").await;
    assert_eq!(t2.len(), 1, "{t2:#?}");
    assert_eq!(t[0]["data"]["n"], 5);
}

/// `kafka.topics` in the config file adds topics consumed for a channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_file_topics_are_consumed() {
    let own = unique("sluice-own");
    let extra = unique("sluice-extra");
    let group = unique("sluice-group");
    let extra_topic = extra.clone();
    let s = start_with(Db::Sqlite, move |c| {
        c.kafka.enabled = true;
        c.kafka.brokers = KAFKA.into();
        c.kafka.session_timeout_ms = 6000;
        c.kafka.topics = vec![sluice::config::KafkaTopic {
            topic: extra_topic,
            channel: "cfg".into(),
        }];
    })
    .await;
    deploy_kafka_channel(&s, "cfg", &own, &group).await;
    let p = producer();
    produce(&p, &extra, Some("x"), br#"{"data": {"n": 7}}"#, &[]).await;
    produce(&p, &own, Some("o"), br#"{"data": {"n": 8}}"#, &[]).await;
    let t = wait_traces(&s.client, &s.base, "cfg", Duration::from_secs(60), |t| {
        t.len() >= 2
    })
    .await;
    let mut topics: Vec<String> = t
        .iter()
        .map(|t| t["data"]["topic"].as_str().unwrap().to_owned())
        .collect();
    topics.sort();
    let mut want = vec![own.clone(), extra.clone()];
    want.sort();
    assert_eq!(topics, want);
    assert_eq!(s.app.kafka.running().len(), 2);
}

fn spawn_service(port: u16, db: &str) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("serve")
        .env("SERVICE_SERVER__PORT", port.to_string())
        .env("SERVICE_STORAGE__URL", db)
        .env("SERVICE_KAFKA__ENABLED", "true")
        .env("SERVICE_KAFKA__BROKERS", KAFKA)
        .env("SERVICE_KAFKA__SESSION_TIMEOUT_MS", "6000")
        .env("SERVICE_SECURITY__ALLOW_PRIVATE_NETWORKS", "true")
        .env("SERVICE_LOGGING__LEVEL", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("the sluice binary starts")
}

async fn wait_healthy(client: &reqwest::Client, base: &str) {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = client.get(format!("{base}/health")).send().await
            && r.status().is_success()
        {
            return;
        }
        assert!(Instant::now() < until, "service did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// SIGKILL mid-stream, restart on the same database: every message is
/// processed at least once, none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_across_sigkill() {
    const N: i64 = 40;
    let topic = unique("sluice-kill");
    let group = unique("sluice-group");
    let dir = std::env::temp_dir().join("sluice-tests");
    std::fs::create_dir_all(&dir).unwrap();
    let db = format!(
        "sqlite://{}",
        dir.join(format!("{}.db", unique("kill"))).display()
    );
    sluice::connectors::http::install_crypto_provider();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    // Each message waits on a slow upstream so the kill lands mid-stream.
    let upstream = crate::support::slow_upstream(Duration::from_millis(50)).await;

    let mut child = spawn_service(port, &db);
    wait_healthy(&client, &base).await;
    let admin = |method: &str, path: &str, body: Json| {
        client
            .request(
                method.parse().unwrap(),
                format!("{base}/api/v1/admin{path}"),
            )
            .json(&body)
            .send()
    };
    let ok = |r: reqwest::Response| {
        assert!(r.status().is_success(), "{}", r.status());
    };
    ok(admin("POST", "/connectors", json!({"name": "slow", "connector_type": "http",
        "config": {"type": "http", "url": upstream, "retry": {"max_retries": 0, "retry_delay_ms": 10}}})).await.unwrap());
    ok(admin("POST", "/workflows", json!({"workflow_id": "kill", "name": "kill", "tasks": [
        {"id": "wait", "name": "wait", "function": {"name": "http_call", "input": {"connector": "slow", "method": "POST", "path": "/x"}}},
        {"id": "copy", "name": "copy", "function": {"name": "map", "input": {"mappings": [
            {"path": "n", "logic": {"var": "payload.n"}}]}}}
    ]})).await.unwrap());
    ok(admin(
        "PATCH",
        "/workflows/kill/status",
        json!({"status": "active"}),
    )
    .await
    .unwrap());
    ok(admin("POST", "/channels", json!({"channel_id": "kill", "name": "kill", "channel_type": "async",
        "protocol": "kafka", "workflow_id": "kill", "config_json": {"topic": topic, "consumer_group": group}})).await.unwrap());
    ok(admin(
        "PATCH",
        "/channels/kill/status",
        json!({"status": "active"}),
    )
    .await
    .unwrap());

    let p = producer();
    for n in 0..N {
        let key = format!("k{}", n % 3);
        produce(
            &p,
            &topic,
            Some(&key),
            json!({"data": {"n": n}}).to_string().as_bytes(),
            &[],
        )
        .await;
    }
    let completed_ns = |t: &[Json]| -> BTreeSet<i64> {
        t.iter()
            .filter(|t| t["status"] == "completed")
            .filter_map(|t| t["data"]["n"].as_i64())
            .collect()
    };
    let before = wait_traces(&client, &base, "kill", Duration::from_secs(60), |t| {
        completed_ns(t).len() >= 5
    })
    .await;
    assert!(
        completed_ns(&before).len() < N as usize,
        "the kill should land mid-stream"
    );
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    let mut child = spawn_service(port, &db);
    wait_healthy(&client, &base).await;
    let all = wait_traces(&client, &base, "kill", Duration::from_secs(90), |t| {
        completed_ns(t).len() == N as usize
    })
    .await;
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(completed_ns(&all), (0..N).collect::<BTreeSet<_>>());
    assert!(all.iter().all(|t| t["mode"] == "kafka"));
}
