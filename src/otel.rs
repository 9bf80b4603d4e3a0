//! OpenTelemetry spans over OTLP gRPC, when `tracing.enabled`.
//!
//! The tree of one data-plane request or consumed message: a root span,
//! `<METHOD> <channel>` (server span) per data-plane request, `<topic>
//! process` (consumer span) per Kafka message, `<channel> process` per async
//! trace run, whose parent is the inbound `traceparent` when there is a valid
//! one → `task <id>` per task that ran → `<function> <connector>` per
//! connector call (attributes: connector, retry count, breaker state; never a
//! secret). Outbound `http_call` requests and `publish_kafka` messages carry
//! the connector call's span as their `traceparent`. A data-plane request
//! rejected before its workflow runs (governance, a cache hit) still has its
//! root span, with `http.response.status_code` and, when refused, an error
//! status.
//!
//! Spans are built when the request ends, from what was recorded on the way
//! (task start times from the runtime's task records, connector calls from the
//! [`CallLog`] the request's `CallScope` carries), with explicit ids and
//! timestamps. With tracing disabled there is no [`Otel`], no call log, no
//! task recording and no clock read for it: the request path pays nothing.
//! Sampling is parent-based with the ratio `tracing.sample_rate`; an unsampled
//! request records nothing either, and its outbound calls say so: without a
//! valid inbound `traceparent` to forward they carry a fresh one flagged not
//! sampled (`-00`, [`unsampled_traceparent`]), never a sampled one the next
//! service would start recording under.

use crate::config;
use opentelemetry::trace::{
    Span as _, SpanBuilder, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _,
    TraceFlags, TraceId, TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, Tracer};
use sluice_runtime::connectors::CallScope;
use sluice_runtime::exec::{TaskRecord, TaskStatus};
use std::str::FromStr as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// The OTLP exporter, with its failures made visible: a warning at most
/// every 30 s (saying how many were left out) and `errors_total{type=
/// "OTEL_EXPORT"}` per failed batch. The SDK reports them nowhere without
/// its own logging feature, so a collector that was down or refused the
/// spans lost them without a word.
#[derive(Debug)]
struct Reporting<E> {
    inner: E,
    log: crate::connectors::kafka::QuietLog,
}

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter
    for Reporting<E>
{
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        if let Err(e) = &result {
            metrics::counter!(crate::telemetry::names::ERRORS_TOTAL, "type" => "OTEL_EXPORT")
                .increment(1);
            if let Some(left_out) = self.log.admit() {
                tracing::warn!(spans, left_out, error = %e, "could not export spans to tracing.otlp_endpoint");
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The exporter pipeline; one per process.
pub struct Otel {
    provider: SdkTracerProvider,
    tracer: Tracer,
    ratio: f64,
}

impl std::fmt::Debug for Otel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Otel").field("ratio", &self.ratio).finish()
    }
}

impl Otel {
    /// `None` when tracing is disabled. Must run inside the tokio runtime
    /// (the batch exporter runs on it).
    pub fn init(cfg: &config::Tracing) -> Result<Option<Otel>, String> {
        if !cfg.enabled {
            return Ok(None);
        }
        use opentelemetry_otlp::WithExportConfig as _;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(cfg.otlp_endpoint.clone())
            .with_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| {
                format!("cannot build the OTLP exporter for tracing.otlp_endpoint: {e}")
            })?;
        let batch = opentelemetry_sdk::trace::BatchConfigBuilder::default()
            .with_scheduled_delay(Duration::from_millis(500))
            .build();
        let exporter = Reporting {
            inner: exporter,
            log: crate::connectors::kafka::QuietLog::new("tracing.otlp_endpoint"),
        };
        let processor =
            opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
                exporter,
                opentelemetry_sdk::runtime::Tokio,
            )
            .with_batch_config(batch)
            .build();
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(cfg.service_name.clone())
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                cfg.sample_rate,
            ))))
            .with_resource(resource)
            .with_id_generator(PresetIds)
            .build();
        let tracer = provider.tracer("sluice");
        Ok(Some(Otel {
            provider,
            tracer,
            ratio: cfg.sample_rate,
        }))
    }

    /// Starts recording one request or message. `traceparent`/`tracestate`
    /// are the inbound ones (header or Kafka header), if any.
    pub fn begin(
        &self,
        name: String,
        kind: SpanKind,
        traceparent: Option<&str>,
        tracestate: Option<&str>,
    ) -> Option<RequestSpan> {
        let parent = traceparent.and_then(|t| parse_traceparent(t, tracestate));
        let trace_id = parent
            .as_ref()
            .map_or_else(|| TraceId::from_bytes(rand_bytes()), SpanContext::trace_id);
        // Parent-based: follow the caller's decision, else the ratio on the
        // trace id (as the SDK's sampler decides it).
        let sampled = match &parent {
            Some(p) => p.is_sampled(),
            None => sampled_by_ratio(trace_id, self.ratio),
        };
        if !sampled {
            return None;
        }
        let span_id = SpanId::from_bytes(rand_span_bytes());
        let state = parent
            .as_ref()
            .map(|p| p.trace_state().clone())
            .unwrap_or_default();
        Some(RequestSpan {
            name,
            kind,
            parent,
            log: Arc::new(CallLog {
                trace_id,
                span_id,
                state,
                current: Mutex::new(None),
                calls: Mutex::new(Vec::new()),
            }),
            start: SystemTime::now(),
            start_instant: Instant::now(),
            attributes: Vec::new(),
        })
    }

    /// Emits the spans of a finished request.
    pub fn finish(&self, req: RequestSpan, tasks: &[TaskRecord], error: Option<&str>) {
        let end = SystemTime::now();
        let at = |i: Instant| req.start + i.saturating_duration_since(req.start_instant);
        let log = &req.log;
        let parent_cx = match &req.parent {
            Some(p) => Context::new().with_remote_span_context(p.clone()),
            None => Context::new(),
        };
        let b = SpanBuilder::from_name(req.name.clone())
            .with_kind(req.kind.clone())
            .with_start_time(req.start)
            .with_attributes(req.attributes.clone());
        let mut root = self.build(b, &parent_cx, log.trace_id, log.span_id);
        if let Some(e) = error {
            root.set_status(Status::error(e.to_owned()));
        }
        let root_cx = Context::new().with_remote_span_context(log.context());

        // Task spans, and which task each connector call belongs to (calls
        // are sequential within one execution: the task whose interval holds
        // the call's start).
        let calls = std::mem::take(&mut *lock(&log.calls));
        let mut task_spans: Vec<(Instant, Instant, SpanContext)> = Vec::new();
        for t in tasks {
            let Some(started) = t.started else { continue };
            let ended = started + Duration::from_secs_f64(t.ms / 1000.0);
            let id = SpanId::from_bytes(rand_span_bytes());
            let b = SpanBuilder::from_name(format!("task {}", t.id))
                .with_kind(SpanKind::Internal)
                .with_start_time(at(started))
                .with_attributes(vec![KeyValue::new("sluice.task_id", t.id.clone())]);
            let mut span = self.build(b, &root_cx, log.trace_id, id);
            if t.status == TaskStatus::Failed {
                span.set_status(Status::error("task failed"));
            }
            span.end_with_timestamp(at(ended));
            task_spans.push((started, ended, log.child_context(id)));
        }
        for c in calls {
            let parent = task_spans
                .iter()
                .find(|(s, e, _)| *s <= c.started && c.started <= *e)
                .map_or_else(|| log.context(), |(_, _, cx)| cx.clone());
            let b = SpanBuilder::from_name(format!("{} {}", c.function, c.connector))
                .with_kind(SpanKind::Client)
                .with_start_time(at(c.started))
                .with_attributes(vec![
                    KeyValue::new("sluice.connector", c.connector),
                    KeyValue::new("sluice.function", c.function),
                    KeyValue::new("sluice.retry_count", i64::from(c.retries)),
                    KeyValue::new("sluice.breaker_state", c.breaker),
                ]);
            let parent_cx = Context::new().with_remote_span_context(parent);
            let mut span = self.build(b, &parent_cx, log.trace_id, c.span_id);
            if let Some(e) = c.error {
                span.set_status(Status::error(e));
            }
            span.end_with_timestamp(at(c.ended));
        }
        root.end_with_timestamp(end);
    }

    /// Builds a span with the ids chosen when the request was recorded (the
    /// SDK asks its id generator, which hands out these on this thread).
    fn build(
        &self,
        b: SpanBuilder,
        cx: &Context,
        trace: TraceId,
        span: SpanId,
    ) -> opentelemetry_sdk::trace::Span {
        PRESET.with(|p| p.set(Some((trace, span))));
        let built = self.tracer.build_with_context(b, cx);
        PRESET.with(|p| p.set(None));
        built
    }

    /// Flushes what is buffered (shutdown).
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "OpenTelemetry shutdown");
        }
    }
}

/// A request being recorded.
pub struct RequestSpan {
    name: String,
    kind: SpanKind,
    parent: Option<SpanContext>,
    log: Arc<CallLog>,
    start: SystemTime,
    start_instant: Instant,
    attributes: Vec<KeyValue>,
}

impl RequestSpan {
    pub fn attribute(&mut self, key: &'static str, value: impl Into<opentelemetry::Value>) {
        self.attributes.push(KeyValue::new(key, value));
    }

    /// The recorder to put in the request's `CallScope::observer`.
    pub fn observer(&self) -> Arc<dyn std::any::Any + Send + Sync> {
        self.log.clone()
    }

    /// This span as a W3C `traceparent`.
    pub fn traceparent(&self) -> String {
        self.log.traceparent(self.log.span_id)
    }
}

/// Connector calls of one request, recorded by the call policy.
pub struct CallLog {
    trace_id: TraceId,
    span_id: SpanId,
    state: TraceState,
    /// The connector call in progress (calls of one execution are sequential).
    current: Mutex<Option<SpanId>>,
    calls: Mutex<Vec<CallRecord>>,
}

struct CallRecord {
    span_id: SpanId,
    function: &'static str,
    connector: String,
    started: Instant,
    ended: Instant,
    retries: u32,
    breaker: &'static str,
    error: Option<String>,
}

impl CallLog {
    fn context(&self) -> SpanContext {
        self.child_context(self.span_id)
    }

    fn child_context(&self, id: SpanId) -> SpanContext {
        SpanContext::new(
            self.trace_id,
            id,
            TraceFlags::SAMPLED,
            true,
            self.state.clone(),
        )
    }

    fn traceparent(&self, span: SpanId) -> String {
        format!("00-{}-{}-01", self.trace_id, span)
    }
}

/// The `traceparent` an untraced request's outbound calls carry while
/// OpenTelemetry is on: `None` when the inbound one is valid (forwarded as it
/// is, with its own sampled flag); else a fresh trace flagged not sampled, so
/// the next service follows this one's decision instead of starting a sampled
/// trace of its own.
pub fn unsampled_traceparent(inbound: Option<&str>) -> Option<String> {
    if inbound.and_then(|t| parse_traceparent(t, None)).is_some() {
        return None;
    }
    Some(format!(
        "00-{}-{}-00",
        TraceId::from_bytes(rand_bytes()),
        SpanId::from_bytes(rand_span_bytes())
    ))
}

/// The caller's `traceparent` as it is forwarded to a connector when this
/// request is not traced: version 00 as it came, a later version as the
/// version-00 form of its first four fields (W3C: a parser reads a newer
/// version's known fields), `None` when it is not valid (a new trace
/// starts instead).
pub fn forwardable_traceparent(t: &str) -> Option<String> {
    let t = t.trim();
    parse_traceparent(t, None)?;
    match t.get(..3) {
        Some("00-") => Some(t.to_owned()),
        // Parsed: 2 + 1 + 32 + 1 + 16 + 1 + 2 ASCII bytes lead.
        _ => t.get(2..55).map(|rest| format!("00{rest}")),
    }
}

/// The request's call log, if the scope carries one.
pub fn call_log(scope: &CallScope) -> Option<&CallLog> {
    scope.observer.as_ref()?.downcast_ref::<CallLog>()
}

/// The `traceparent`/`tracestate` an outbound call carries when the request
/// is traced: the connector call's span (or the request's).
pub fn outbound_context(scope: &CallScope) -> Option<(String, Option<String>)> {
    let log = call_log(scope)?;
    let span = lock(&log.current).unwrap_or(log.span_id);
    let state = log.state.header();
    Some((log.traceparent(span), (!state.is_empty()).then_some(state)))
}

/// A connector call being recorded; `finish` stores it.
pub struct CallSpan<'a> {
    log: &'a CallLog,
    span_id: SpanId,
    function: &'static str,
    connector: String,
    started: Instant,
}

/// Starts recording a connector call if the request is traced.
pub fn begin_call<'a>(
    scope: &'a CallScope,
    function: &'static str,
    connector: &str,
) -> Option<CallSpan<'a>> {
    let log = call_log(scope)?;
    let span_id = SpanId::from_bytes(rand_span_bytes());
    *lock(&log.current) = Some(span_id);
    Some(CallSpan {
        log,
        span_id,
        function,
        connector: connector.to_owned(),
        started: Instant::now(),
    })
}

impl CallSpan<'_> {
    pub fn finish(self, retries: u32, breaker: &'static str, error: Option<&str>) {
        *lock(&self.log.current) = None;
        lock(&self.log.calls).push(CallRecord {
            span_id: self.span_id,
            function: self.function,
            connector: self.connector,
            started: self.started,
            ended: Instant::now(),
            retries,
            breaker,
            error: error.map(str::to_owned),
        });
    }
}

thread_local! {
    /// The ids the next span built on this thread gets (see `Otel::build`).
    static PRESET: std::cell::Cell<Option<(TraceId, SpanId)>> = const { std::cell::Cell::new(None) };
}

/// Hands the SDK the preset ids of `Otel::build`; random ones otherwise.
#[derive(Debug)]
struct PresetIds;

impl opentelemetry_sdk::trace::IdGenerator for PresetIds {
    fn new_trace_id(&self) -> TraceId {
        PRESET
            .with(|p| p.get())
            .map_or_else(|| TraceId::from_bytes(rand_bytes()), |(t, _)| t)
    }

    fn new_span_id(&self) -> SpanId {
        PRESET
            .with(|p| p.get())
            .map_or_else(|| SpanId::from_bytes(rand_span_bytes()), |(_, s)| s)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A valid W3C `traceparent` (version 00 layout) as a remote span context.
fn parse_traceparent(t: &str, state: Option<&str>) -> Option<SpanContext> {
    let mut parts = t.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    // W3C: lowercase hex only; version `ff` is invalid; version 00 has
    // exactly four fields, and a later version is read by its first four
    // (whatever follows them is for parsers of that version).
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    if !hex(version, 2) || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    if !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let state = state
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
        true,
        state,
    ))
}

/// The SDK's `TraceIdRatioBased` rule: the low 63 bits of the trace id
/// against the ratio.
fn sampled_by_ratio(trace_id: TraceId, ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    if ratio <= 0.0 {
        return false;
    }
    let bytes = trace_id.to_bytes();
    let low = u64::from_be_bytes(bytes[8..16].try_into().expect("8 bytes")) >> 1;
    let bound = (ratio * (1u64 << 63) as f64) as u64;
    low < bound
}

/// 16 uniformly random bytes (a v4 UUID fixes the version and variant bits
/// of its bytes 6 and 8, which must not bias the ratio sampler).
fn rand_bytes() -> [u8; 16] {
    let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut out = [0u8; 16];
    out[..6].copy_from_slice(&a[..6]);
    out[6..13].copy_from_slice(&a[9..16]);
    out[13..].copy_from_slice(&b[..3]);
    out
}

fn rand_span_bytes() -> [u8; 8] {
    let b = rand_bytes();
    let mut out = [0u8; 8];
    out.copy_from_slice(&b[..8]);
    if out == [0; 8] {
        out[7] = 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_parse_or_are_refused() {
        let c = parse_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("a=1"),
        )
        .unwrap();
        assert_eq!(c.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(c.span_id().to_string(), "00f067aa0ba902b7");
        assert!(c.is_sampled() && c.is_remote());
        assert_eq!(c.trace_state().header(), "a=1");
        let unsampled = parse_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            None,
        )
        .unwrap();
        assert!(!unsampled.is_sampled());
        for bad in [
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad, None).is_none(), "{bad}");
            assert_eq!(forwardable_traceparent(bad), None, "{bad}");
        }
        // A later version is read by its first four fields and forwarded
        // as version 00 (before, it was dropped and a new trace started).
        let future = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next";
        assert!(parse_traceparent(future, None).is_some());
        assert_eq!(
            forwardable_traceparent(future).as_deref(),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        let v00 = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03";
        assert_eq!(forwardable_traceparent(v00).as_deref(), Some(v00));
    }

    /// OpenTelemetry on, a root the ratio leaves out: its outbound calls
    /// carry a `-00` traceparent (not the fresh sampled one a service without
    /// OpenTelemetry sends), and a valid inbound one is forwarded unchanged.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn unsampled_roots_send_not_sampled_downstream() {
        let cfg = config::Tracing {
            enabled: true,
            otlp_endpoint: "http://127.0.0.1:9".into(),
            sample_rate: 0.0,
            ..config::Config::default().tracing
        };
        let otel = Otel::init(&cfg).unwrap().unwrap();
        assert!(
            otel.begin("POST c".into(), SpanKind::Server, None, None)
                .is_none()
        );
        let tp = unsampled_traceparent(None).unwrap();
        let parsed = parse_traceparent(&tp, None).unwrap();
        assert!(tp.ends_with("-00") && !parsed.is_sampled(), "{tp}");
        assert_ne!(unsampled_traceparent(None), Some(tp.clone()));
        assert!(
            unsampled_traceparent(Some("garbage"))
                .unwrap()
                .ends_with("-00")
        );
        let inbound = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert_eq!(unsampled_traceparent(Some(inbound)), None);
        // What `http_call` and `publish_kafka` put in their headers.
        let scope = CallScope {
            channel: "c".into(),
            traceparent: Some(tp.clone()),
            tracestate: None,
            chain: vec![],
            observer: None,
        };
        assert_eq!(crate::connectors::http::trace_context(&scope), (tp, None));
        // Off the runtime, as the server does: the exporter runs on it.
        tokio::task::spawn_blocking(move || otel.shutdown())
            .await
            .unwrap();
    }

    #[test]
    fn ratio_sampling_is_deterministic_per_trace() {
        let id = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        assert!(sampled_by_ratio(id, 1.0));
        assert!(!sampled_by_ratio(id, 0.0));
        let kept = (0..10_000)
            .filter(|_| sampled_by_ratio(TraceId::from_bytes(rand_bytes()), 0.25))
            .count();
        assert!((2_000..3_000).contains(&kept), "{kept}");
    }
}
