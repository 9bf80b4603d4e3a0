//! OpenTelemetry: the service exports spans over OTLP gRPC to a real OTLP
//! receiver this test runs in-process (the `opentelemetry-proto` service
//! definitions served by tonic). Checks the span tree, names, parent links,
//! attributes, the inbound `traceparent` (HTTP header or Kafka message
//! header) as the root's parent, the outbound `traceparent`/`tracestate` of
//! `http_call`, spans of requests refused before their workflow ran, and that
//! an unsampled request exports nothing and tells its upstreams so.

use crate::support::{
    Db, KAFKA_BROKERS, Record, TestServer, kafka_produce, kafka_producer, kafka_topics,
    recording_upstream, start_with, unique,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Default, Clone)]
struct Receiver {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    AnyValue::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push((service.clone(), span));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

async fn start_receiver() -> (String, Receiver) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let receiver = Receiver::default();
    let svc = TraceServiceServer::new(receiver.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream_incoming(listener))
            .await
            .unwrap();
    });
    (format!("http://{addr}"), receiver)
}

fn tokio_stream_incoming(
    listener: tokio::net::TcpListener,
) -> impl futures_util::stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures_util::stream::unfold(listener, |l| async move {
        let r = l.accept().await.map(|(s, _)| s);
        Some((r, l))
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attr(span: &Span, key: &str) -> Option<AnyValue> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.clone())
}

async fn traced_service(endpoint: String) -> TestServer {
    traced_service_with(endpoint, |_| {}).await
}

async fn traced_service_with(
    endpoint: String,
    adjust: impl FnOnce(&mut sluice::config::Config),
) -> TestServer {
    start_with(Db::Sqlite, move |c| {
        c.tracing.enabled = true;
        c.tracing.otlp_endpoint = endpoint;
        c.tracing.service_name = "sluice-otel-test".into();
        c.tracing.sample_rate = 1.0;
        c.security.allow_private_networks = true;
        adjust(c);
    })
    .await
}

/// Waits until at least `n` spans of trace `trace` (hex) arrived.
async fn wait_spans(receiver: &Receiver, trace: &str, n: usize) -> Vec<Span> {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let spans: Vec<Span> = receiver
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, sp)| hex(&sp.trace_id) == trace)
            .map(|(_, sp)| sp.clone())
            .collect();
        if spans.len() >= n {
            return spans;
        }
        assert!(Instant::now() < until, "spans so far: {spans:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn named<'a>(spans: &'a [Span], name: &str) -> &'a Span {
    spans
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no span {name}: {spans:#?}"))
}

/// OTLP's `STATUS_CODE_ERROR`.
const STATUS_ERROR: i32 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_form_a_tree_under_the_inbound_traceparent() {
    let (endpoint, receiver) = start_receiver().await;
    let (up, rec) = recording_upstream(Duration::ZERO).await;
    let s = traced_service(endpoint).await;
    s.admin(
        "POST",
        "/connectors",
        Some(json!({"name": "up", "connector_type": "http",
            "config": {"type": "http", "url": up, "auth": {"type": "bearer", "token": "s3cret-token"}}})),
    )
    .await
    .ok(201);
    s.deploy(
        json!({"workflow_id": "otel", "name": "otel", "tasks": [
            {"id": "shape", "name": "shape", "function": {"name": "map", "input": {"mappings": [
                {"path": "x", "logic": {"var": "payload.x"}}]}}},
            {"id": "call", "name": "call", "function": {"name": "http_call", "input": {
                "connector": "up", "method": "POST", "path": "/p", "response_path": "up"}}}
        ]}),
        json!({"channel_id": "otel", "name": "otel", "channel_type": "sync", "protocol": "http",
               "workflow_id": "otel"}),
    )
    .await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let r = s
        .send(
            "POST",
            "/api/v1/data/otel",
            Some(json!({"data": {"x": 1}})),
            &[("traceparent", &format!("00-{trace}-{parent}-01"))],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);

    let until = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans: Vec<(String, Span)> = receiver
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, sp)| hex(&sp.trace_id) == trace)
            .cloned()
            .collect();
        if spans.len() >= 4 {
            break spans;
        }
        assert!(Instant::now() < until, "spans so far: {spans:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(spans.len(), 4, "{spans:#?}");
    assert!(spans.iter().all(|(svc, _)| svc == "sluice-otel-test"));
    let by_name = |n: &str| {
        spans
            .iter()
            .map(|(_, s)| s)
            .find(|s| s.name == n)
            .unwrap_or_else(|| panic!("no span {n}: {spans:#?}"))
    };
    let root = by_name("POST otel");
    let shape = by_name("task shape");
    let call = by_name("task call");
    let http = by_name("http_call up");
    // The inbound traceparent is the root's parent; the rest hang below.
    assert_eq!(hex(&root.parent_span_id), parent);
    assert_eq!(shape.parent_span_id, root.span_id);
    assert_eq!(call.parent_span_id, root.span_id);
    assert_eq!(http.parent_span_id, call.span_id);
    // Time nesting.
    assert!(root.start_time_unix_nano <= call.start_time_unix_nano);
    assert!(call.start_time_unix_nano <= http.start_time_unix_nano);
    assert!(http.end_time_unix_nano <= root.end_time_unix_nano);
    // Connector attributes, never secrets.
    assert_eq!(
        attr(http, "sluice.connector"),
        Some(AnyValue::StringValue("up".into()))
    );
    assert_eq!(
        attr(http, "sluice.retry_count"),
        Some(AnyValue::IntValue(0))
    );
    assert_eq!(
        attr(http, "sluice.breaker_state"),
        Some(AnyValue::StringValue("closed".into()))
    );
    assert!(!format!("{spans:?}").contains("s3cret-token"));
    // The outbound request carried the connector call's span.
    let seen: Vec<Option<String>> = rec.requests().into_iter().map(|r| r.traceparent).collect();
    assert_eq!(
        seen,
        [Some(format!("00-{trace}-{}-01", hex(&http.span_id)))]
    );

    // An unsampled caller: nothing exported for its trace.
    let quiet = "5bf92f3577b34da6a3ce929d0e0e4737";
    let r = s
        .send(
            "POST",
            "/api/v1/data/otel",
            Some(json!({"data": {"x": 2}})),
            &[("traceparent", &format!("00-{quiet}-{parent}-00"))],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let exported = receiver
        .spans
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, sp)| hex(&sp.trace_id) == quiet)
        .count();
    assert_eq!(exported, 0);
}

/// A consumed Kafka message continues the producer's trace: the message's
/// `traceparent` header is the consumer span's parent, its tasks hang below
/// it, and the `http_call` its workflow makes carries the connector call's
/// span as `traceparent` and the message's `tracestate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_messages_continue_the_producers_trace() {
    let (endpoint, receiver) = start_receiver().await;
    let (up, rec) = recording_upstream(Duration::ZERO).await;
    let topic = unique("sluice-otel");
    let group = unique("sluice-group");
    kafka_topics(&[&topic], 1).await;
    let s = traced_service_with(endpoint, |c| {
        c.kafka.enabled = true;
        c.kafka.brokers = KAFKA_BROKERS.into();
        c.kafka.session_timeout_ms = 6000;
    })
    .await;
    s.http_connector("up", &up).await;
    s.deploy(
        json!({"workflow_id": "consume", "name": "consume", "tasks": [
            {"id": "shape", "name": "shape", "function": {"name": "map", "input": {"mappings": [
                {"path": "x", "logic": {"var": "payload.x"}}]}}},
            {"id": "call", "name": "call", "function": {"name": "http_call", "input": {
                "connector": "up", "method": "POST", "path": "/p"}}}
        ]}),
        json!({"channel_id": "consume", "name": "consume", "channel_type": "async",
               "protocol": "kafka", "workflow_id": "consume",
               "config_json": {"topic": topic, "consumer_group": group}}),
    )
    .await;
    let trace = "6bf92f3577b34da6a3ce929d0e0e4738";
    let parent = "10f067aa0ba902b7";
    kafka_produce(
        &kafka_producer(),
        &topic,
        Record {
            key: Some("k"),
            value: br#"{"data": {"x": 1}}"#,
            headers: &[
                ("traceparent", &format!("00-{trace}-{parent}-01")),
                ("tracestate", "vendor=1,other=2"),
            ],
            ..Record::default()
        },
    )
    .await;

    let spans = wait_spans(&receiver, trace, 4).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let spans = wait_spans(&receiver, trace, spans.len()).await;
    assert_eq!(spans.len(), 4, "{spans:#?}");
    let root = named(&spans, &format!("{topic} process"));
    let shape = named(&spans, "task shape");
    let call = named(&spans, "task call");
    let http = named(&spans, "http_call up");
    // The producer's span is the consumer span's parent.
    assert_eq!(hex(&root.parent_span_id), parent);
    assert_eq!(root.kind, 5, "a consumer span: {root:#?}");
    assert_eq!(
        attr(root, "messaging.destination.name"),
        Some(AnyValue::StringValue(topic.clone()))
    );
    assert_eq!(shape.parent_span_id, root.span_id);
    assert_eq!(call.parent_span_id, root.span_id);
    assert_eq!(http.parent_span_id, call.span_id);
    // The upstream call continues the trace below the connector call, with
    // the message's tracestate.
    let seen = rec.requests();
    assert_eq!(seen.len(), 1, "{seen:#?}");
    assert_eq!(
        seen[0].traceparent.as_deref(),
        Some(format!("00-{trace}-{}-01", hex(&http.span_id)).as_str())
    );
    assert_eq!(seen[0].tracestate.as_deref(), Some("vendor=1,other=2"));
}

/// One span per data-plane request, also when the channel's checks refuse it
/// before its workflow runs (validation 400, rate limit 429) or its cache
/// answers it: each has `http.response.status_code`, the refused ones an
/// error status and `sluice.error_code`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_refused_before_their_workflow_have_spans() {
    let (endpoint, receiver) = start_receiver().await;
    let s = traced_service(endpoint).await;
    let wf = |id: &str| {
        json!({"workflow_id": id, "name": id, "tasks": [
            {"id": "shape", "name": "shape", "function": {"name": "map", "input": {"mappings": [
                {"path": "x", "logic": {"var": "payload.x"}}]}}}
        ]})
    };
    let channel = |id: &str, extra: serde_json::Value| {
        let mut c = json!({"channel_id": id, "name": id, "channel_type": "sync",
                           "protocol": "http", "workflow_id": id});
        c.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        c
    };
    s.deploy(
        wf("checked"),
        channel(
            "checked",
            json!({"validation_logic": {"!!": [{"var": "data.x"}]}}),
        ),
    )
    .await;
    s.deploy(
        wf("limited"),
        channel(
            "limited",
            json!({"config_json": {"rate_limit": {"requests_per_second": 0.1, "burst": 1}}}),
        ),
    )
    .await;
    s.deploy(
        wf("cached"),
        channel(
            "cached",
            json!({"config_json": {"cache": {"ttl_secs": 60}}}),
        ),
    )
    .await;

    // Each request its own trace (the caller's), so its spans are told apart.
    let send = |channel: &'static str, n: u8, body: serde_json::Value| {
        let trace = format!("7bf92f3577b34da6a3ce929d0e0e47{n:02x}");
        let s = &s;
        async move {
            let r = s
                .send(
                    "POST",
                    &format!("/api/v1/data/{channel}"),
                    Some(body),
                    &[("traceparent", &format!("00-{trace}-20f067aa0ba902b7-01"))],
                )
                .await;
            (r.status, trace)
        }
    };
    let expect = [
        // ((answered status, trace), expected status, error code)
        (
            send("checked", 1, json!({"data": {}})).await,
            400,
            Some("BAD_REQUEST"),
        ),
        (
            send("limited", 2, json!({"data": {"x": 1}})).await,
            200,
            None,
        ),
        (
            send("limited", 3, json!({"data": {"x": 1}})).await,
            429,
            Some("RATE_LIMITED"),
        ),
        (
            send("cached", 4, json!({"data": {"x": 1}})).await,
            200,
            None,
        ),
        (
            send("cached", 5, json!({"data": {"x": 1}})).await,
            200,
            None,
        ),
    ];
    for (i, ((status, trace), want_status, code)) in expect.iter().enumerate() {
        assert_eq!(status, want_status, "request {i}");
        let spans = wait_spans(&receiver, trace, 1).await;
        let root = spans
            .iter()
            .find(|s| s.name.starts_with("POST "))
            .unwrap_or_else(|| panic!("request {i}: {spans:#?}"));
        assert_eq!(hex(&root.parent_span_id), "20f067aa0ba902b7");
        assert_eq!(
            attr(root, "http.response.status_code"),
            Some(AnyValue::IntValue(i64::from(*want_status))),
            "request {i}: {root:#?}"
        );
        let status = root.status.clone().unwrap_or_default();
        match code {
            Some(code) => {
                assert_eq!(status.code, STATUS_ERROR, "request {i}: {root:#?}");
                assert_eq!(
                    attr(root, "sluice.error_code"),
                    Some(AnyValue::StringValue((*code).into())),
                    "request {i}"
                );
                // Refused before the workflow: no task ran.
                assert_eq!(spans.len(), 1, "request {i}: {spans:#?}");
            }
            None => assert_ne!(status.code, STATUS_ERROR, "request {i}: {root:#?}"),
        }
    }
    // The second cached request was the cache's: its span says so, and no
    // task ran for it.
    let hit = wait_spans(&receiver, &expect[4].0.1, 1).await;
    assert_eq!(hit.len(), 1, "{hit:#?}");
    assert_eq!(
        attr(&hit[0], "sluice.cache"),
        Some(AnyValue::StringValue("hit".into()))
    );
}

/// OpenTelemetry on, a request the ratio leaves out and no inbound
/// `traceparent`: nothing is exported, and the upstream is told "not sampled"
/// (`-00`), never handed a fresh sampled trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsampled_requests_tell_upstreams_not_sampled() {
    let (endpoint, receiver) = start_receiver().await;
    let (up, rec) = recording_upstream(Duration::ZERO).await;
    let s = traced_service_with(endpoint, |c| c.tracing.sample_rate = 0.0).await;
    s.admin(
        "POST",
        "/connectors",
        Some(
            json!({"name": "up", "connector_type": "http", "config": {"type": "http", "url": up}}),
        ),
    )
    .await
    .ok(201);
    s.deploy(
        json!({"workflow_id": "quiet", "name": "quiet", "tasks": [
            {"id": "call", "name": "call", "function": {"name": "http_call", "input": {
                "connector": "up", "method": "POST", "path": "/p"}}}
        ]}),
        json!({"channel_id": "quiet", "name": "quiet", "channel_type": "sync", "protocol": "http",
               "workflow_id": "quiet"}),
    )
    .await;
    for _ in 0..3 {
        let r = s.post("/api/v1/data/quiet", json!({"data": {}})).await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    let seen = rec.requests();
    assert_eq!(seen.len(), 3);
    let parents: std::collections::BTreeSet<String> = seen
        .iter()
        .map(|r| r.traceparent.clone().expect("a traceparent"))
        .collect();
    assert_eq!(parents.len(), 3, "a fresh one each time: {parents:?}");
    for tp in &parents {
        assert!(tp.starts_with("00-") && tp.ends_with("-00"), "{tp}");
        assert_eq!(tp.len(), 55, "{tp}");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(receiver.spans.lock().unwrap().is_empty());
}

/// Spans that cannot be exported (no collector at `tracing.otlp_endpoint`)
/// are counted in `errors_total{type="OTEL_EXPORT"}` and logged at most
/// every 30 s. Before, the SDK dropped them without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_exports_are_counted() {
    let closed = crate::support::free_port();
    let s = traced_service(format!("http://127.0.0.1:{closed}")).await;
    s.deploy(
        json!({"workflow_id": "lost", "name": "lost", "tasks": [
            {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [
                {"path": "x", "logic": 1}]}}}]}),
        json!({"channel_id": "lost", "name": "lost", "workflow_id": "lost"}),
    )
    .await;
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let r = s.post("/api/v1/data/lost", json!({"data": {}})).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let metrics = s.get("/metrics").await.text;
        if metrics
            .lines()
            .any(|l| l.starts_with("errors_total{type=\"OTEL_EXPORT\"}"))
        {
            break;
        }
        assert!(
            Instant::now() < until,
            "no export failure counted:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An async submission has its own server span, accepted (202) or refused
/// (400 by the channel's validation), under the inbound `traceparent`; the
/// run's `<channel> process` span follows in the same trace. Before, a
/// submission had no span, and a refused one left no trace at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_submissions_have_their_span() {
    let (endpoint, receiver) = start_receiver().await;
    let s = traced_service(endpoint).await;
    s.deploy(
        json!({"workflow_id": "later", "name": "later", "tasks": [
            {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [
                {"path": "x", "logic": 1}]}}}]}),
        json!({"channel_id": "later", "name": "later", "channel_type": "async", "protocol": "http",
               "workflow_id": "later",
               "validation_logic": {"==": [{"var": "data.ok"}, true]}}),
    )
    .await;
    let parent = "00f067aa0ba902b7";
    for (trace, ok, status) in [
        ("6bf92f3577b34da6a3ce929d0e0e4738", true, 202),
        ("7bf92f3577b34da6a3ce929d0e0e4739", false, 400),
    ] {
        let r = s
            .send(
                "POST",
                "/api/v1/data/later",
                Some(json!({"data": {"ok": ok}})),
                &[("traceparent", &format!("00-{trace}-{parent}-01"))],
            )
            .await;
        assert_eq!(r.status, status, "{}", r.text);
        let spans = wait_spans(&receiver, trace, if ok { 2 } else { 1 }).await;
        let root = named(&spans, "POST later");
        assert_eq!(hex(&root.parent_span_id), parent);
        assert_eq!(
            attr(root, "http.response.status_code"),
            Some(AnyValue::IntValue(i64::from(status)))
        );
        if ok {
            named(&spans, "later process");
        } else {
            assert_eq!(
                attr(root, "sluice.error_code"),
                Some(AnyValue::StringValue("BAD_REQUEST".into()))
            );
        }
    }
}
