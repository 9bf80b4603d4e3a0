//! OpenTelemetry: the service exports spans over OTLP gRPC to a real OTLP
//! receiver this test runs in-process (the `opentelemetry-proto` service
//! definitions served by tonic). Checks the span tree, names, parent links,
//! attributes, the inbound `traceparent` as the root's parent, the outbound
//! `traceparent` of `http_call`, and that an unsampled request exports nothing.

use crate::support::{Db, TestServer, start_with};
use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
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

/// An upstream that records the `traceparent` of each request.
async fn upstream() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let s = seen.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let s = s.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let tp = req
                        .headers()
                        .get("traceparent")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    s.lock().unwrap().push(tp);
                    async {
                        Ok::<_, std::convert::Infallible>(
                            Response::builder()
                                .header("content-type", "application/json")
                                .body(Full::new(Bytes::from_static(b"{\"ok\":true}")))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                    .await;
            });
        }
    });
    (format!("http://{addr}"), seen)
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
    start_with(Db::Sqlite, move |c| {
        c.tracing.enabled = true;
        c.tracing.otlp_endpoint = endpoint;
        c.tracing.service_name = "sluice-otel-test".into();
        c.tracing.sample_rate = 1.0;
        c.security.allow_private_networks = true;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_form_a_tree_under_the_inbound_traceparent() {
    let (endpoint, receiver) = start_receiver().await;
    let (up, seen) = upstream().await;
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
    assert_eq!(
        seen.lock().unwrap().as_slice(),
        [format!("00-{trace}-{}-01", hex(&http.span_id))]
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
