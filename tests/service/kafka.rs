//! Kafka-consuming channels against the Kafka-compatible broker that
//! `scripts/test.sh` starts (`../shared/services/kafka.sh`): traces for every
//! message, metadata from key and headers, per-partition order seen by a
//! recording upstream, the dead-letter topic (failed and non-JSON messages),
//! the in-flight bound, the default consumer group, consumers following
//! pause, archive, reloads and new workflow versions, the explicit final
//! commit, a trace that cannot be stored holding its offset back, and
//! at-least-once delivery across a SIGKILL of the real binary.

use crate::support::{
    Db, Record, TestServer, free_port, kafka_committed, kafka_produce, kafka_producer,
    kafka_reader, kafka_topics, recording_upstream, start_with, unique,
};
use rdkafka::Message as _;
use serde_json::{Value as Json, json};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

const KAFKA: &str = crate::support::KAFKA_BROKERS;

/// Kafka on, against the test broker, with the short session timeout its
/// group joins need.
fn kafka_on(c: &mut sluice::config::Config) {
    c.kafka.enabled = true;
    c.kafka.brokers = KAFKA.into();
    c.kafka.session_timeout_ms = 6000;
}

/// A message with this value (and nothing else).
fn value(v: &[u8]) -> Record<'_> {
    Record {
        value: v,
        ..Record::default()
    }
}

/// Produces `value` as JSON text with `headers` (no key).
async fn produce_json(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    value: Json,
    headers: &[(&str, &str)],
) {
    let body = value.to_string();
    kafka_produce(
        producer,
        topic,
        Record {
            value: body.as_bytes(),
            headers,
            ..Record::default()
        },
    )
    .await;
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

/// A Kafka channel `id` (workflow `id`) on `topic`; `group: None` leaves
/// `consumer_group` out (the platform's `kafka.group_id` applies).
fn kafka_channel(id: &str, topic: &str, group: Option<&str>) -> Json {
    let mut config = json!({"topic": topic});
    if let Some(g) = group {
        config["consumer_group"] = json!(g);
    }
    json!({"channel_id": id, "name": id, "channel_type": "async", "protocol": "kafka",
           "workflow_id": id, "config_json": config})
}

async fn deploy_kafka_channel(s: &TestServer, id: &str, topic: &str, group: &str) {
    s.deploy(workflow(id), kafka_channel(id, topic, Some(group)))
        .await;
}

/// The workflow of channel `id` reports each message to `upstream` (a
/// [`recording_upstream`]) as `POST /seen/<partition>/<offset>/<key>/<n>`,
/// then copies `n` and the workflow's version tag `v` into `data`.
fn recording_workflow(id: &str, v: i64) -> Json {
    json!({"workflow_id": id, "name": id, "tasks": [
        {"id": "report", "name": "report", "function": {"name": "http_call", "input": {
            "connector": format!("{id}-up"), "method": "POST",
            "path_logic": {"cat": ["/seen/", {"var": "metadata.partition"}, "/", {"var": "metadata.offset"},
                                   "/", {"var": "metadata.key"}, "/", {"var": "payload.n"}]}}}},
        {"id": "copy", "name": "copy", "function": {"name": "map", "input": {"mappings": [
            {"path": "n", "logic": {"var": "payload.n"}},
            {"path": "v", "logic": v}
        ]}}}
    ]})
}

async fn deploy_recording(s: &TestServer, id: &str, upstream: &str, channel: Json) {
    s.http_connector(&format!("{id}-up"), upstream).await;
    s.deploy(recording_workflow(id, 1), channel).await;
}

/// What a recording upstream saw, in arrival order: (partition, offset, key, n).
fn reports(rec: &crate::support::Recorded) -> Vec<(i32, i64, String, i64)> {
    rec.requests()
        .iter()
        .map(|seen| {
            let path = seen.path.as_str();
            let parts: Vec<&str> = path.trim_start_matches("/seen/").split('/').collect();
            assert_eq!(parts.len(), 4, "{path}");
            (
                parts[0].parse().unwrap(),
                parts[1].parse().unwrap(),
                parts[2].to_owned(),
                parts[3].parse().unwrap(),
            )
        })
        .collect()
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

/// Waits until the consumers running are exactly `n`.
async fn wait_running(s: &TestServer, n: usize) {
    let until = Instant::now() + Duration::from_secs(30);
    while s.app.kafka.running().len() != n {
        assert!(
            Instant::now() < until,
            "consumers: {:?}",
            s.app.kafka.running()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `group` has committed `want` on `topic`'s partitions.
async fn wait_committed(group: &str, topic: &str, want: &[Option<i64>]) {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let got = kafka_committed(group, topic, want.len() as i32).await;
        if got == want {
            return;
        }
        assert!(Instant::now() < until, "committed {got:?}, want {want:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The `n`s of the completed traces, each with how many traces it has.
fn completed_counts(t: &[Json]) -> BTreeMap<i64, usize> {
    let mut out = BTreeMap::new();
    for t in t.iter().filter(|t| t["status"] == "completed") {
        *out.entry(t["data"]["n"].as_i64().unwrap()).or_default() += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumes_records_and_dead_letters() {
    let topic = unique("sluice-in");
    let dlq = unique("sluice-dlq");
    let group = unique("sluice-group");
    let dlq_topic = dlq.clone();
    let s = start_with(Db::Sqlite, move |c| {
        kafka_on(c);
        c.kafka.dlq.enabled = true;
        c.kafka.dlq.topic = dlq_topic;
    })
    .await;
    deploy_kafka_channel(&s, "orders-in", &topic, &group).await;

    let p = kafka_producer();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    for n in 0..10 {
        let v = json!({"data": {"n": n}}).to_string();
        kafka_produce(
            &p,
            &topic,
            Record {
                key: Some("k1"),
                value: v.as_bytes(),
                // A repeated name reads as its values joined, as in HTTP.
                headers: &[
                    ("traceparent", traceparent),
                    ("X-Origin", "test"),
                    ("x-origin", "again"),
                ],
                ..Record::default()
            },
        )
        .await;
    }
    // A bare object (no `data` member) is the payload as a whole.
    kafka_produce(&p, &topic, value(br#"{"n": 100}"#)).await;
    // Nested past serde_json's 128 levels (within the 1,024 an HTTP body
    // may nest, and SQLite's store): it runs like any other.
    let deep = format!(
        r#"{{"data": {{"n": 300, "deep": {}{}}}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    kafka_produce(&p, &topic, value(deep.as_bytes())).await;
    // A failing workflow and a value that is not JSON go to the DLQ ...
    let failed_at = kafka_produce(
        &p,
        &topic,
        Record {
            key: Some("bad"),
            value: br#"{"data": {"n": 200, "fail": true}}"#,
            headers: &[("traceparent", traceparent)],
            ..Record::default()
        },
    )
    .await;
    let garbage_at = kafka_produce(
        &p,
        &topic,
        Record {
            key: Some("garbage"),
            value: b"not json {",
            ..Record::default()
        },
    )
    .await;
    // ... and the consumer goes on with the next message.
    kafka_produce(
        &p,
        &topic,
        Record {
            key: Some("k1"),
            value: br#"{"data": {"n": 10}}"#,
            ..Record::default()
        },
    )
    .await;

    let all = wait_traces(
        &s.client,
        &s.base,
        "orders-in",
        Duration::from_secs(60),
        |t| t.len() >= 15,
    )
    .await;
    assert_eq!(all.len(), 15, "{all:#?}");
    assert!(all.iter().all(|t| t["mode"] == "kafka"), "{all:#?}");
    let completed: Vec<&Json> = all.iter().filter(|t| t["status"] == "completed").collect();
    let failed: Vec<&Json> = all.iter().filter(|t| t["status"] == "failed").collect();
    assert_eq!((completed.len(), failed.len()), (13, 2), "{all:#?}");
    assert_eq!(
        completed_counts(&all).into_keys().collect::<Vec<_>>(),
        (0..=10).chain([100, 300]).collect::<Vec<_>>()
    );

    // Metadata from the message.
    let first = completed
        .iter()
        .find(|t| t["data"]["n"] == 0)
        .expect("n = 0");
    let d = &first["data"];
    assert_eq!(d["msg_key"], "k1");
    assert_eq!(d["topic"], json!(topic));
    assert_eq!(d["tp"], traceparent);
    assert_eq!(d["origin"], "test, again");
    assert!(d["partition"].is_string() && d["offset"].is_string(), "{d}");
    let bare = completed
        .iter()
        .find(|t| t["data"]["n"] == 100)
        .expect("bare object");
    assert_eq!(bare["data"]["msg_key"], Json::Null);

    // The failed trace names the task.
    let f = failed
        .iter()
        .find(|t| t["errors"][0]["task_id"] == "boom")
        .expect("failed run");
    assert_eq!(f["errors"][0]["code"], "TASK_ERROR", "{f}");

    // Both dead letters: exactly the documented fields, and the source
    // message's own partition and offset.
    let c = kafka_reader(&[&dlq]).await;
    let mut letters = Vec::new();
    let mut letter_headers = Vec::new();
    while letters.len() < 2 {
        let m = tokio::time::timeout(Duration::from_secs(30), c.recv())
            .await
            .expect("dead letters arrive")
            .unwrap();
        let letter = serde_json::from_slice::<Json>(m.payload().unwrap()).unwrap();
        // The source message's headers go along with its dead letter.
        let mut headers = Vec::new();
        if let Some(h) = m.headers() {
            use rdkafka::message::Headers as _;
            for header in h.iter() {
                let v = header
                    .value
                    .map(|v| String::from_utf8_lossy(v).into_owned());
                headers.push((header.key.to_owned(), v.unwrap_or_default()));
            }
        }
        letter_headers.push((letter["offset"].as_i64(), headers));
        letters.push(letter);
    }
    letters.sort_by_key(|l| l["offset"].as_i64());
    letter_headers.sort_by_key(|(offset, _)| *offset);
    assert_eq!(
        letter_headers[0].1,
        vec![("traceparent".to_owned(), traceparent.to_owned())],
        "the failed message's dead letter keeps its traceparent"
    );
    assert_eq!(letter_headers[1].1, vec![], "the garbage had no headers");
    let keys = |j: &Json| -> BTreeSet<String> { j.as_object().unwrap().keys().cloned().collect() };
    let fields = [
        "trace_id",
        "channel",
        "source_topic",
        "partition",
        "offset",
        "key",
        "error",
        "payload",
        "failed_at",
    ];
    for l in &letters {
        assert_eq!(keys(l), fields.map(String::from).into(), "{l}");
        assert_eq!(
            keys(&l["error"]),
            ["code", "task_id", "message"].map(String::from).into(),
            "{l}"
        );
        assert_eq!(l["source_topic"], json!(topic));
        assert_eq!(l["channel"], "orders-in");
        // The letter names the trace that recorded the failure.
        let trace = l["trace_id"].as_str().unwrap();
        assert!(
            all.iter()
                .any(|t| t["trace_id"] == trace && t["status"] == "failed"),
            "{l}"
        );
        assert!(l["failed_at"].as_str().unwrap().ends_with('Z'), "{l}");
    }
    let (failed_letter, garbage) = (&letters[0], &letters[1]);
    assert_eq!(
        (&failed_letter["partition"], &failed_letter["offset"]),
        (&json!(failed_at.0), &json!(failed_at.1))
    );
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
    assert_eq!(
        (&garbage["partition"], &garbage["offset"]),
        (&json!(garbage_at.0), &json!(garbage_at.1))
    );
    assert_eq!(garbage["key"], "garbage");
    assert_eq!(garbage["payload"], "not json {");
    assert_eq!(garbage["error"]["code"], "BAD_REQUEST");
    assert_eq!(garbage["error"]["task_id"], "");
    assert!(
        garbage["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not JSON")
    );
}

/// A payload nested deeper than the trace store keeps (SQLite's
/// `json_valid` stops at about 1,000 levels; a message may nest 1,024)
/// cannot be recorded as it is: the message is refused with a failed trace
/// that keeps its value as text, and the partition goes on. Before, storing
/// its trace was retried forever and held the partition. Run on worker
/// stacks as large as the service's own.
#[test]
fn a_payload_the_store_cannot_keep_is_refused_not_retried() {
    crate::support::on_service_stacks(a_payload_the_store_cannot_keep_body());
}

async fn a_payload_the_store_cannot_keep_body() {
    let topic = unique("sluice-in");
    let group = unique("sluice-group");
    let s = start_with(Db::Sqlite, kafka_on).await;
    deploy_kafka_channel(&s, "deep-in", &topic, &group).await;
    let p = kafka_producer();
    let deep = format!(
        r#"{{"data": {{"n": 1, "deep": {}{}}}}}"#,
        "[".repeat(1010),
        "]".repeat(1010)
    );
    kafka_produce(&p, &topic, value(deep.as_bytes())).await;
    kafka_produce(&p, &topic, value(br#"{"data": {"n": 2}}"#)).await;
    let all = wait_traces(
        &s.client,
        &s.base,
        "deep-in",
        Duration::from_secs(60),
        |t| t.len() >= 2,
    )
    .await;
    assert_eq!(completed_counts(&all), BTreeMap::from([(2, 1)]), "{all:#?}");
    let refused = all
        .iter()
        .find(|t| t["status"] == "failed")
        .expect("a failed trace");
    assert_eq!(refused["errors"][0]["code"], "BAD_REQUEST", "{refused}");
    let message = refused["errors"][0]["message"].as_str().unwrap();
    assert!(
        message.starts_with("the payload nests deeper than the ")
            && message.contains(" levels the trace store keeps"),
        "{message}"
    );
}

/// Per-partition order, seen from outside: on a 3-partition topic with six
/// keys, every message's workflow reports it to an upstream that records
/// arrival order (each report held 20 ms, so lanes overlap). Per partition
/// the reports arrive in offset order, and per key in production order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_partition_runs_in_offset_order() {
    const KEYS: usize = 6;
    const ROUNDS: i64 = 6;
    let topic = unique("sluice-order");
    let group = unique("sluice-group");
    kafka_topics(&[&topic], 3).await;
    let (up, rec) = recording_upstream(Duration::from_millis(20)).await;
    let s = start_with(Db::Sqlite, |c| {
        kafka_on(c);
        c.security.allow_private_networks = true;
    })
    .await;
    deploy_recording(
        &s,
        "ordered",
        &up,
        kafka_channel("ordered", &topic, Some(&group)),
    )
    .await;

    let p = kafka_producer();
    let mut produced: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
    for n in 0..ROUNDS {
        for k in 0..KEYS {
            let key = format!("k{k}");
            let v = json!({"data": {"n": n}}).to_string();
            let (partition, offset) = kafka_produce(
                &p,
                &topic,
                Record {
                    key: Some(&key),
                    value: v.as_bytes(),
                    ..Record::default()
                },
            )
            .await;
            produced.entry(partition).or_default().push(offset);
        }
    }
    assert!(produced.len() >= 2, "the keys spread: {produced:?}");
    let total = KEYS * ROUNDS as usize;
    wait_traces(
        &s.client,
        &s.base,
        "ordered",
        Duration::from_secs(90),
        |t| t.iter().filter(|t| t["status"] == "completed").count() >= total,
    )
    .await;

    let seen = reports(&rec);
    assert_eq!(seen.len(), total, "each message once: {seen:?}");
    let mut by_partition: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (partition, offset, key, n) in &seen {
        by_partition.entry(*partition).or_default().push(*offset);
        by_key.entry(key.clone()).or_default().push(*n);
    }
    // Arrival order is offset order, partition by partition (and nothing is
    // missing: the produced offsets, in order).
    assert_eq!(by_partition, produced, "arrival order: {seen:?}");
    for (key, ns) in &by_key {
        assert_eq!(ns, &(0..ROUNDS).collect::<Vec<_>>(), "key {key}: {seen:?}");
    }
    assert_eq!(by_key.len(), KEYS);
}

/// `kafka.max_in_flight = 2`: with a slow upstream and messages on all three
/// partitions (whose lanes run side by side), never more than two messages
/// run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_messages_are_bounded_across_partitions() {
    let topic = unique("sluice-bound");
    let group = unique("sluice-group");
    kafka_topics(&[&topic], 3).await;
    let (up, rec) = recording_upstream(Duration::from_millis(250)).await;
    let s = start_with(Db::Sqlite, |c| {
        kafka_on(c);
        c.kafka.max_in_flight = 2;
        c.security.allow_private_networks = true;
    })
    .await;
    deploy_recording(
        &s,
        "bounded",
        &up,
        kafka_channel("bounded", &topic, Some(&group)),
    )
    .await;
    let p = kafka_producer();
    for n in 0..12 {
        let v = json!({"data": {"n": n}}).to_string();
        kafka_produce(
            &p,
            &topic,
            Record {
                partition: Some(n % 3),
                key: Some("k"),
                value: v.as_bytes(),
                ..Record::default()
            },
        )
        .await;
    }
    wait_traces(
        &s.client,
        &s.base,
        "bounded",
        Duration::from_secs(90),
        |t| t.iter().filter(|t| t["status"] == "completed").count() >= 12,
    )
    .await;
    let partitions: BTreeSet<i32> = reports(&rec).iter().map(|r| r.0).collect();
    assert_eq!(partitions, BTreeSet::from([0, 1, 2]));
    let peak = rec.peak();
    assert!((1..=2).contains(&peak), "{peak} messages ran at once");
}

/// A channel without `consumer_group` consumes in `kafka.group_id`: the
/// broker has that group's commits for the topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_consumer_group_is_kafka_group_id() {
    let topic = unique("sluice-default");
    let group = unique("sluice-platform-group");
    let platform_group = group.clone();
    kafka_topics(&[&topic], 1).await;
    let s = start_with(Db::Sqlite, move |c| {
        kafka_on(c);
        c.kafka.group_id = platform_group;
    })
    .await;
    s.deploy(workflow("dflt"), kafka_channel("dflt", &topic, None))
        .await;
    wait_running(&s, 1).await;
    assert_eq!(s.app.kafka.running()[0].group, group);
    let p = kafka_producer();
    for n in 0..3 {
        let v = json!({"data": {"n": n}}).to_string();
        kafka_produce(&p, &topic, value(v.as_bytes())).await;
    }
    wait_traces(&s.client, &s.base, "dflt", Duration::from_secs(60), |t| {
        t.len() == 3
    })
    .await;
    // Committed under the platform's group (within a commit interval).
    wait_committed(&group, &topic, &[Some(3)]).await;
}

/// The consumer follows the channel: pausing and archiving stop
/// consumption, and so does pausing its workflow (audit 84: with no active
/// workflow each message failed "no active workflow" and was committed);
/// messages produced meanwhile are consumed, once, when the channel serves
/// again (the group resumes at its committed offset).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_follow_pause_and_archive() {
    let topic = unique("sluice-life");
    let group = unique("sluice-group");
    let s = start_with(Db::Sqlite, kafka_on).await;
    deploy_kafka_channel(&s, "life", &topic, &group).await;
    let p = kafka_producer();
    kafka_produce(&p, &topic, value(br#"{"data": {"n": 1}}"#)).await;
    wait_traces(&s.client, &s.base, "life", Duration::from_secs(60), |t| {
        t.len() == 1
    })
    .await;
    wait_running(&s, 1).await;

    let mut n = 1;
    for (what, stop, resume) in [
        ("channels", "paused", "active"),
        ("channels", "archived", "active"),
        ("workflows", "paused", "active"),
    ] {
        let status = format!("/{what}/life/status");
        let r = s
            .admin("PATCH", &status, Some(json!({"status": stop})))
            .await;
        assert_eq!(r.status, 200, "{what} {stop}: {}", r.text);
        wait_running(&s, 0).await;
        // Produced while the channel is not active: waits in the topic.
        n += 1;
        let v = json!({"data": {"n": n}}).to_string();
        kafka_produce(&p, &topic, value(v.as_bytes())).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            traces(&s.client, &s.base, "life").await.len(),
            n as usize - 1,
            "consumed while {what} {stop}"
        );
        // Active again (an archived channel's latest version comes back).
        let r = s
            .admin("PATCH", &status, Some(json!({"status": resume})))
            .await;
        assert_eq!(r.status, 200, "{what}: {resume} after {stop}: {}", r.text);
        wait_running(&s, 1).await;
        wait_traces(&s.client, &s.base, "life", Duration::from_secs(60), |t| {
            t.len() >= n as usize
        })
        .await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let all = traces(&s.client, &s.base, "life").await;
    assert_eq!(
        completed_counts(&all),
        (1..=n).map(|n| (n, 1)).collect(),
        "{all:#?}"
    );
}

/// An engine reload and a new workflow version activated while messages are
/// in flight neither restart the consumer nor lose or repeat a message: each
/// runs once (the upstream sees it once, it has one trace), the ones after
/// the activation on the new version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_and_new_versions_lose_and_repeat_nothing() {
    const FIRST: i64 = 20;
    const THEN: i64 = 5;
    let topic = unique("sluice-reload");
    let group = unique("sluice-group");
    kafka_topics(&[&topic], 3).await;
    let (up, rec) = recording_upstream(Duration::from_millis(100)).await;
    let s = start_with(Db::Sqlite, |c| {
        kafka_on(c);
        c.security.allow_private_networks = true;
    })
    .await;
    deploy_recording(&s, "rl", &up, kafka_channel("rl", &topic, Some(&group))).await;
    wait_running(&s, 1).await;
    let consumer = s.app.kafka.running();
    let p = kafka_producer();
    let produce = |n: i64| {
        let p = &p;
        let topic = &topic;
        async move {
            let v = json!({"data": {"n": n}}).to_string();
            let key = format!("k{}", n % 4);
            kafka_produce(
                p,
                topic,
                Record {
                    key: Some(&key),
                    value: v.as_bytes(),
                    ..Record::default()
                },
            )
            .await;
        }
    };
    for n in 0..FIRST {
        produce(n).await;
    }
    // Some have run, most are still in flight (the upstream holds each
    // 100 ms; partitions run side by side).
    wait_traces(&s.client, &s.base, "rl", Duration::from_secs(60), |t| {
        t.len() >= 3
    })
    .await;
    let r = s.admin("POST", "/engine/reload", None).await;
    assert_eq!(r.status, 200, "{}", r.text);
    s.admin("POST", "/workflows/rl/versions", None)
        .await
        .ok(201);
    s.admin("PUT", "/workflows/rl", Some(recording_workflow("rl", 2)))
        .await
        .ok(200);
    s.admin(
        "PATCH",
        "/workflows/rl/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    let mid = traces(&s.client, &s.base, "rl").await.len() as i64;
    assert!(
        mid < FIRST,
        "the change should land mid-stream ({mid} done)"
    );
    for n in FIRST..FIRST + THEN {
        produce(n).await;
    }
    let total = (FIRST + THEN) as usize;
    wait_traces(&s.client, &s.base, "rl", Duration::from_secs(90), |t| {
        t.len() >= total
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let all = traces(&s.client, &s.base, "rl").await;
    assert_eq!(
        completed_counts(&all),
        (0..FIRST + THEN).map(|n| (n, 1)).collect(),
        "{all:#?}"
    );
    let mut upstream_ns: Vec<i64> = reports(&rec).iter().map(|r| r.3).collect();
    upstream_ns.sort_unstable();
    assert_eq!(upstream_ns, (0..FIRST + THEN).collect::<Vec<_>>());
    // Produced after the activation: run on version 2.
    for t in &all {
        if t["data"]["n"].as_i64().unwrap() >= FIRST {
            assert_eq!(t["data"]["v"], 2, "{t}");
            assert_eq!(t["workflow_version"], 2, "{t}");
        }
    }
    assert!(all.iter().any(|t| t["data"]["v"] == 1));
    // The same consumer all along.
    assert_eq!(s.app.kafka.running(), consumer);
}

/// A graceful stop commits what finished, and that commit is the consumer's
/// explicit final one: with periodic commits far off, nothing is committed
/// before the stop and exactly the finished offsets after it. A new consumer
/// in the group then runs only the message produced later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_commits_finished_messages() {
    let topic = unique("sluice-stop");
    let group = unique("sluice-group");
    let config = |c: &mut sluice::config::Config| {
        kafka_on(c);
        c.kafka.commit_interval_ms = 600_000;
    };
    kafka_topics(&[&topic], 1).await;
    let mut first = start_with(Db::Sqlite, config).await;
    deploy_kafka_channel(&first, "stop", &topic, &group).await;
    let p = kafka_producer();
    for n in 0..5 {
        let v = json!({"data": {"n": n}}).to_string();
        kafka_produce(&p, &topic, value(v.as_bytes())).await;
    }
    wait_traces(
        &first.client,
        &first.base,
        "stop",
        Duration::from_secs(60),
        |t| t.len() == 5,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(kafka_committed(&group, &topic, 1).await, [None]);
    first.shutdown().await;
    assert_eq!(kafka_committed(&group, &topic, 1).await, [Some(5)]);

    let second = start_with(Db::Sqlite, config).await;
    deploy_kafka_channel(&second, "stop", &topic, &group).await;
    kafka_produce(&p, &topic, value(br#"{"data": {"n": 5}}"#)).await;
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

/// A trace that cannot be stored holds its message's offset back: while the
/// traces table is gone (renamed away on PostgreSQL) the message is retried,
/// not committed; once the table is back its trace is stored, once, and the
/// offset committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrecorded_trace_is_not_committed() {
    use sqlx::Connection as _;
    let topic = unique("sluice-norecord");
    let group = unique("sluice-group");
    kafka_topics(&[&topic], 1).await;
    let s = start_with(Db::Postgres, kafka_on).await;
    deploy_kafka_channel(&s, "norec", &topic, &group).await;
    let p = kafka_producer();
    kafka_produce(&p, &topic, value(br#"{"data": {"n": 0}}"#)).await;
    wait_traces(&s.client, &s.base, "norec", Duration::from_secs(60), |t| {
        t.len() == 1
    })
    .await;
    wait_committed(&group, &topic, &[Some(1)]).await;

    let mut db = sqlx::PgConnection::connect(&s.app.config.storage.url)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE traces RENAME TO traces_away")
        .execute(&mut db)
        .await
        .unwrap();
    kafka_produce(&p, &topic, value(br#"{"data": {"n": 1}}"#)).await;
    // Several commit intervals: the offset stays where it was.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(kafka_committed(&group, &topic, 1).await, [Some(1)]);
    sqlx::query("ALTER TABLE traces_away RENAME TO traces")
        .execute(&mut db)
        .await
        .unwrap();
    let all = wait_traces(&s.client, &s.base, "norec", Duration::from_secs(60), |t| {
        t.len() >= 2
    })
    .await;
    wait_committed(&group, &topic, &[Some(2)]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let all2 = traces(&s.client, &s.base, "norec").await;
    assert_eq!(all2.len(), 2, "{all:#?}");
    assert_eq!(completed_counts(&all2), BTreeMap::from([(0, 1), (1, 1)]));
}

/// `kafka.topics` in the config file adds topics consumed for a channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_file_topics_are_consumed() {
    let own = unique("sluice-own");
    let extra = unique("sluice-extra");
    let group = unique("sluice-group");
    let extra_topic = extra.clone();
    let s = start_with(Db::Sqlite, move |c| {
        kafka_on(c);
        c.kafka.topics = vec![sluice::config::KafkaTopic {
            topic: extra_topic,
            channel: "cfg".into(),
        }];
    })
    .await;
    deploy_kafka_channel(&s, "cfg", &own, &group).await;
    let p = kafka_producer();
    kafka_produce(
        &p,
        &extra,
        Record {
            key: Some("x"),
            value: br#"{"data": {"n": 7}}"#,
            ..Record::default()
        },
    )
    .await;
    kafka_produce(
        &p,
        &own,
        Record {
            key: Some("o"),
            value: br#"{"data": {"n": 8}}"#,
            ..Record::default()
        },
    )
    .await;
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

    let p = kafka_producer();
    for n in 0..N {
        let key = format!("k{}", n % 3);
        let v = json!({"data": {"n": n}}).to_string();
        kafka_produce(
            &p,
            &topic,
            Record {
                key: Some(&key),
                value: v.as_bytes(),
                ..Record::default()
            },
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

/// A dead letter that cannot be stored holds its partition: the failed
/// message is neither committed nor skipped (the next one waits behind it),
/// the consumer keeps running, and after a graceful stop a consumer of the
/// same group with a working dead-letter topic picks the message up again,
/// dead-letters it, and goes on. Two ways the dead letter fails: its producer
/// cannot be created (a `message.timeout.ms` librdkafka refuses, from an
/// out-of-range `engine.global_http_timeout_secs`), and every publish is
/// refused (a topic name over librdkafka's 512 characters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unstorable_dead_letter_is_not_committed() {
    dead_letter_failure_holds_the_partition(|c| c.engine.global_http_timeout_secs = 3_000_000)
        .await;
    dead_letter_failure_holds_the_partition(|c| c.kafka.dlq.topic = "x".repeat(600)).await;
}

async fn dead_letter_failure_holds_the_partition(
    misconfigure: impl FnOnce(&mut sluice::config::Config),
) {
    let topic = unique("sluice-stuck");
    let group = unique("sluice-group");
    let dlq = unique("sluice-dlq");
    kafka_topics(&[&topic], 1).await;
    let mut first = start_with(Db::Sqlite, |c| {
        kafka_on(c);
        c.kafka.dlq.enabled = true;
        c.kafka.dlq.topic = unique("sluice-dlq");
        misconfigure(c);
    })
    .await;
    deploy_kafka_channel(&first, "stuck", &topic, &group).await;
    let p = kafka_producer();
    for v in [
        br#"{"data": {"n": 0}}"#.as_slice(),
        br#"{"data": {"n": 1, "fail": true}}"#,
        br#"{"data": {"n": 2}}"#,
    ] {
        kafka_produce(&p, &topic, value(v)).await;
    }
    wait_traces(
        &first.client,
        &first.base,
        "stuck",
        Duration::from_secs(60),
        |t| !t.is_empty(),
    )
    .await;
    wait_committed(&group, &topic, &[Some(1)]).await;
    // Retried, not committed, not skipped.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(traces(&first.client, &first.base, "stuck").await.len(), 1);
    assert_eq!(kafka_committed(&group, &topic, 1).await, [Some(1)]);
    assert_eq!(first.app.kafka.running().len(), 1);
    first.shutdown().await;
    assert_eq!(kafka_committed(&group, &topic, 1).await, [Some(1)]);

    let dlq_topic = dlq.clone();
    let second = start_with(Db::Sqlite, move |c| {
        kafka_on(c);
        c.kafka.dlq.enabled = true;
        c.kafka.dlq.topic = dlq_topic;
    })
    .await;
    deploy_kafka_channel(&second, "stuck", &topic, &group).await;
    wait_traces(
        &second.client,
        &second.base,
        "stuck",
        Duration::from_secs(60),
        |t| t.len() >= 2,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t = traces(&second.client, &second.base, "stuck").await;
    assert_eq!(t.len(), 2, "{t:#?}");
    // The failed message, and the one that waited behind it.
    let failed = t.iter().find(|t| t["status"] == "failed").expect("failed");
    assert_eq!(failed["errors"][0]["task_id"], "boom", "{t:#?}");
    assert_eq!(completed_counts(&t), BTreeMap::from([(2, 1)]), "{t:#?}");
    wait_committed(&group, &topic, &[Some(3)]).await;
    let c = kafka_reader(&[&dlq]).await;
    let m = tokio::time::timeout(Duration::from_secs(30), c.recv())
        .await
        .expect("the dead letter arrives")
        .unwrap();
    let letter: Json = serde_json::from_slice(m.payload().unwrap()).unwrap();
    assert_eq!(letter["offset"], 1, "{letter}");
    assert_eq!(letter["payload"], json!({"n": 1, "fail": true}));
}

/// A Kafka message gets a rollout bucket as an HTTP request does (header
/// `x-rollout-key`, then `authorization`, then the message key, else its
/// place in the log), so a canary's share holds for consumed messages too
/// (before, every message ran the newest version); its workflow sees
/// credential headers masked on the first run as on a retry; and a
/// message refused before it runs (not JSON) counts in the channel's
/// `messages_total{status="rejected"}` and `errors_total{BAD_REQUEST}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_follow_the_rollout_see_masked_credentials_and_refusals_count() {
    let s = start_with(Db::Sqlite, kafka_on).await;
    let topic = unique("roll");
    kafka_topics(&[&topic], 1).await;
    let versioned = |v: i64| {
        json!({"workflow_id": "kroll", "name": "kroll", "tasks": [
        {"id": "copy", "name": "copy", "function": {"name": "map", "input": {"mappings": [
            {"path": "n", "logic": {"var": "payload.n"}},
            {"path": "v", "logic": v},
            {"path": "auth", "logic": {"var": "metadata.headers.authorization"}}
        ]}}}]})
    };
    s.deploy(
        versioned(1),
        kafka_channel("kroll", &topic, Some(&unique("g"))),
    )
    .await;
    s.admin("POST", "/workflows/kroll/versions", None)
        .await
        .ok(201);
    s.admin("PUT", "/workflows/kroll", Some(versioned(2)))
        .await
        .ok(200);
    s.admin(
        "PATCH",
        "/workflows/kroll/status",
        Some(json!({"status": "active", "rollout_percentage": 50})),
    )
    .await
    .ok(200);
    wait_running(&s, 1).await;
    let producer = kafka_producer();
    let n = 40;
    for i in 0..n {
        let rollout_key = format!("caller-{i}");
        let headers = [
            ("x-rollout-key", rollout_key.as_str()),
            ("authorization", "Bearer kafka-secret"),
        ];
        produce_json(&producer, &topic, json!({"n": i}), &headers).await;
    }
    let client = reqwest::Client::new();
    let t = wait_traces(&client, &s.base, "kroll", Duration::from_secs(60), |t| {
        t.iter().filter(|t| t["status"] == "completed").count() == n
    })
    .await;
    let on = |v: i64| t.iter().filter(|t| t["data"]["v"] == v).count();
    assert!(
        on(1) >= 8 && on(2) >= 8,
        "v1 {} and v2 {} of {n}",
        on(1),
        on(2)
    );
    // The same caller always lands on the same version.
    for t in &t {
        let i = t["data"]["n"].as_i64().unwrap();
        let bucket = sluice_runtime::rollout::bucket(&format!("caller-{i}"));
        assert_eq!(
            t["workflow_version"],
            json!(if bucket < 50 { 2 } else { 1 }),
            "{t}"
        );
        assert_eq!(t["data"]["auth"], "******", "{t}");
    }
    // Two values that are not JSON: refused, and counted.
    for v in [&b"not json"[..], b"{\"n\": "] {
        kafka_produce(&producer, &topic, value(v)).await;
    }
    wait_traces(&client, &s.base, "kroll", Duration::from_secs(60), |t| {
        t.iter().filter(|t| t["status"] == "failed").count() == 2
    })
    .await;
    let metrics = s.get("/metrics").await.text;
    assert!(
        metrics.contains("messages_total{channel=\"kroll\",status=\"rejected\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "messages_total{{channel=\"kroll\",status=\"ok\"}} {n}"
        )),
        "{metrics}"
    );
    // (At least these two: other tests of this process count there too.)
    let bad_requests = metrics
        .lines()
        .find_map(|l| l.strip_prefix("errors_total{type=\"BAD_REQUEST\"} "))
        .and_then(|n| n.parse::<f64>().ok());
    assert!(bad_requests.is_some_and(|n| n >= 2.0), "{metrics}");
}

/// A Kafka channel's `validation_logic` judges each consumed message over
/// `{data, headers, query, path}` as it judges a request: a refused message
/// is not run, fails its trace with `BAD_REQUEST`, and is not retried.
/// Before, the rule was accepted and never applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_logic_judges_consumed_messages() {
    let s = start_with(Db::Sqlite, kafka_on).await;
    let topic = unique("valid");
    kafka_topics(&[&topic], 1).await;
    let mut channel = kafka_channel("kvalid", &topic, Some(&unique("g")));
    channel["validation_logic"] = json!({"and": [{">": [{"var": "data.n"}, 5]}, {"==": [{"var": "headers.x-origin"}, "ok"]}]});
    s.deploy(workflow("kvalid"), channel).await;
    wait_running(&s, 1).await;
    let producer = kafka_producer();
    for (n, origin) in [(1, "ok"), (9, "ok"), (9, "elsewhere")] {
        produce_json(&producer, &topic, json!({"n": n}), &[("x-origin", origin)]).await;
    }
    let client = reqwest::Client::new();
    let t = wait_traces(&client, &s.base, "kvalid", Duration::from_secs(60), |t| {
        t.len() == 3
            && t.iter()
                .all(|t| t["status"] != "pending" && t["status"] != "running")
    })
    .await;
    let completed: Vec<&Json> = t.iter().filter(|t| t["status"] == "completed").collect();
    assert_eq!(completed.len(), 1, "{t:#?}");
    assert_eq!(completed[0]["data"]["n"], 9);
    for failed in t.iter().filter(|t| t["status"] == "failed") {
        assert_eq!(failed["errors"][0]["code"], "BAD_REQUEST", "{failed}");
        assert!(
            failed["errors"][0]["message"]
                .as_str()
                .unwrap()
                .starts_with("input validation failed"),
            "{failed}"
        );
        assert_eq!(failed["attempts"], 1, "{failed}");
    }
}

/// Creates and activates workflow `id` (one `map` copying the payload).
async fn active_workflow(s: &TestServer, id: &str) {
    s.create_active(
        "workflows",
        json!({"workflow_id": id, "name": id, "tasks": [
            {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [
                {"path": "got", "logic": {"var": "payload"}}]}}}]}),
    )
    .await;
}

/// Two channels consuming one topic in one consumer group would split its
/// partitions, each running part of the messages (audit 73): activating the
/// second is a conflict naming the first. Its own `consumer_group` makes it
/// a consumer of every message; a new version of the same channel replaces
/// the active one and is not in conflict with it.
#[tokio::test]
async fn two_channels_do_not_share_a_topic_in_one_group() {
    let s = crate::support::start(Db::Sqlite).await;
    active_workflow(&s, "kw").await;
    let channel = |id: &str, config: Json| {
        json!({"channel_id": id, "name": id, "channel_type": "async", "protocol": "kafka",
               "workflow_id": "kw", "config_json": config})
    };
    let activate = |id: &str| {
        let path = format!("/channels/{id}/status");
        let s = &s;
        async move {
            s.admin("PATCH", &path, Some(json!({"status": "active"})))
                .await
        }
    };
    for (id, config) in [
        ("k1", json!({"topic": "shared"})),
        ("k2", json!({"topic": "shared"})),
        ("k3", json!({"topic": "shared", "consumer_group": "k3-own"})),
        ("k4", json!({"topic": "other"})),
    ] {
        s.admin("POST", "/channels", Some(channel(id, config)))
            .await
            .ok(201);
    }
    activate("k1").await.ok(200);
    let r = activate("k2").await;
    r.error(409, "CONFLICT");
    assert_eq!(
        r.body["error"]["message"],
        "channel 'k1' already consumes topic 'shared' in consumer group 'sluice': two channels in one group split the topic's partitions, each running part of the messages; give this channel its own config_json.consumer_group",
        "{}",
        r.text
    );
    assert_eq!(
        s.admin("GET", "/channels/k2", None).await.ok(200)["status"],
        "draft"
    );
    activate("k3").await.ok(200);
    activate("k4").await.ok(200);
    // A second version of k1 on the same topic replaces the first.
    s.admin("POST", "/channels/k1/versions", None).await.ok(201);
    activate("k1").await.ok(200);

    // A channel `kafka.topics` sends a topic to (any protocol) is checked
    // for that topic too (audit 74: it was not, and two channels shared
    // the group).
    let s = crate::support::start_with(Db::Sqlite, |c| {
        c.kafka.topics = vec![sluice::config::KafkaTopic {
            topic: "routed".into(),
            channel: "by-config".into(),
        }];
    })
    .await;
    active_workflow(&s, "kw").await;
    s.create_active("channels", channel("on-topic", json!({"topic": "routed"})))
        .await;
    s.admin(
        "POST",
        "/channels",
        Some(
            json!({"channel_id": "by-config", "name": "by-config", "channel_type": "sync",
                    "protocol": "http", "workflow_id": "kw"}),
        ),
    )
    .await
    .ok(201);
    let r = s
        .admin(
            "PATCH",
            "/channels/by-config/status",
            Some(json!({"status": "active"})),
        )
        .await;
    r.error(409, "CONFLICT");
    assert!(
        r.body["error"]["message"].as_str().unwrap().starts_with(
            "channel 'on-topic' already consumes topic 'routed' in consumer group 'sluice'"
        ),
        "{}",
        r.text
    );
}

/// Activations racing each other cannot both pass the one-group check
/// (audit 81: it read the engine, which neither had reached yet, and all
/// of eight racing channels went active): the check reads what storage
/// holds active, serialised with every other channel activation, so
/// exactly one of the racers wins and the others are conflicts naming it.
async fn racing_activations_share_no_group(db: Db) {
    let s = crate::support::start(db).await;
    active_workflow(&s, "kw").await;
    let ids: Vec<String> = (0..6).map(|i| format!("race{i}")).collect();
    for id in &ids {
        s.admin(
            "POST",
            "/channels",
            Some(
                json!({"channel_id": id, "name": id, "channel_type": "async",
                        "protocol": "kafka", "workflow_id": "kw",
                        "config_json": {"topic": "raced"}}),
            ),
        )
        .await
        .ok(201);
    }
    let answers = futures_util::future::join_all(ids.iter().map(|id| {
        let path = format!("/channels/{id}/status");
        let s = &s;
        async move {
            s.admin("PATCH", &path, Some(json!({"status": "active"})))
                .await
        }
    }))
    .await;
    let won: Vec<&String> = ids
        .iter()
        .zip(&answers)
        .filter(|(_, r)| r.status == 200)
        .map(|(id, _)| id)
        .collect();
    assert_eq!(
        won.len(),
        1,
        "{:?}",
        answers.iter().map(|r| &r.text).collect::<Vec<_>>()
    );
    for r in answers.iter().filter(|r| r.status != 200) {
        let message = r.error(409, "CONFLICT")["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            message.starts_with(&format!(
                "channel '{}' already consumes topic 'raced'",
                won[0]
            )),
            "{message}"
        );
    }
    let active = s
        .admin("GET", "/channels?status=active", None)
        .await
        .ok(200)
        .as_array()
        .unwrap()
        .len();
    assert_eq!(active, 1);
}
crate::on_every_backend!(racing_activations, racing_activations_share_no_group);
