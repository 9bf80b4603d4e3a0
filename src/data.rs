//! The data plane, `/api/v1/data/...`: route resolution, the channel's
//! checks, workflow execution on the live snapshot, and the response.
//!
//! Resolution order (the spec's): a trailing `/async` selects async mode and is
//! stripped; then the REST route table (method + pattern); then a channel whose
//! name is the single remaining segment. The request path takes no lock: it
//! loads the engine snapshot once and keeps it to the end.

use crate::api::{ApiError, Code, HttpResponse, bytes_response};
use crate::app::App;
use crate::engine::{Channel, Snapshot};
use crate::governance::{self, Stage, View};
use crate::server::Req;
use bytes::Bytes;
use http::{Method, StatusCode, header};
use serde_json::{Value as Json, json};
use sluice_compiler::diag::Diagnostic;
use sluice_runtime::connectors::CallScope;
use sluice_runtime::exec::{
    self, Execution, FailureKind, Input, Meta, Options, PayloadFrom, Status,
};
use sluice_runtime::rollout;
use smallvec::SmallVec;
use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

/// A name constant: a `&str` name is parsed on every lookup.
const X_SERVICE_PROFILE: http::HeaderName = http::HeaderName::from_static("x-service-profile");

/// The executor's timer for `Options::deadline` (the runtime has none).
pub(crate) fn deadline_timer(
    at: Instant,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(tokio::time::sleep_until(at.into()))
}

/// How long past its deadline an execution may run before its caller drops
/// it: the executor fails it at the deadline, naming the task that was
/// waiting, unless a step overruns (then the caller's own timeout answers,
/// without the task).
pub(crate) const DEADLINE_GRACE: std::time::Duration = std::time::Duration::from_millis(100);

/// Handles a data-plane request (`segments` are the decoded path segments
/// after `/api/v1/data`).
pub async fn handle(
    app: &Arc<App>,
    req: &Req,
    segments: &[&str],
) -> Result<HttpResponse, ApiError> {
    // Trace reads come before channel routing (a channel named "traces" is shadowed).
    if let [first, rest @ ..] = segments
        && *first == "traces"
        && rest.len() <= 1
    {
        return Box::pin(crate::traces::read(app, req, rest)).await;
    }
    // Timed only for a profiled answer (two clock reads saved otherwise).
    let profile = app.config.tracing.profile_enabled
        && (req.header(X_SERVICE_PROFILE) == Some("1") || req.query("profile") == Some("1"));
    let lock_started = profile.then(Instant::now);
    let snapshot = app.engine.load_full();
    let engine_lock_ms = lock_started.map(|t| exec::millis(t.elapsed()));
    let (parts, is_async) = match segments.split_last() {
        Some((&"async", rest)) if !rest.is_empty() => (rest, true),
        _ => (segments, false),
    };
    // A CORS preflight is routed by the method it asks about, and answered
    // by the channel's CORS settings alone (no checks, no workflow).
    if req.method == Method::OPTIONS
        && let Some(asked) = req.header(header::ACCESS_CONTROL_REQUEST_METHOD)
    {
        let method = Method::from_bytes(asked.trim().as_bytes())
            .map_err(|_| ApiError::bad_request("Access-Control-Request-Method is not a method"))?;
        let channel = match resolve(&snapshot, &method, req, parts) {
            Ok((channel, _)) => channel,
            // A name-routed channel asked about a method it does not take:
            // refused like a method its CORS settings do not allow (403).
            Err(e) if e.code == Code::MethodNotAllowed => {
                let channel = match parts {
                    [name] => snapshot.channels.get(*name).ok_or(e)?,
                    _ => return Err(e),
                };
                return Ok(governance::refuse_preflight(
                    channel,
                    "method is not allowed",
                ));
            }
            Err(e) => return Err(e),
        };
        // Reached by name (no route took it): POST is all that path takes.
        let routed = |m: &str| snapshot.routes.find(m, parts).is_some();
        let by_name = matches!(parts, [_])
            && !routed(method.as_str())
            && !(method == Method::HEAD && routed("GET"));
        return Ok(governance::preflight(
            channel,
            req.header(header::ORIGIN),
            method.as_str(),
            by_name,
        ));
    }
    let (channel, params) = match resolve(&snapshot, &req.method, req, parts) {
        Ok(found) => found,
        // A channel called by name with another method: its 405 carries
        // the channel's CORS headers, like its other errors.
        Err(e) if e.code == Code::MethodNotAllowed => {
            let channel = match parts {
                [name] => snapshot.channels.get(*name),
                _ => None,
            };
            if let Some(channel) = channel {
                count_refusal(channel, &e);
                channel
                    .metrics
                    .duration
                    .record(req.started.elapsed().as_secs_f64());
            }
            let mut response = e.into_response();
            if let Some(channel) = channel {
                governance::decorate(channel, &req.headers, &mut response);
            }
            return Ok(response);
        }
        Err(e) => return Err(e),
    };
    let result = if is_async || channel.is_async {
        // The submission's own server span (accepted or refused); the run
        // has its `<channel> process` span later.
        let traced = app.otel.as_ref().and_then(|o| {
            o.begin(
                format!("{} {}", req.method, channel.name),
                opentelemetry::trace::SpanKind::Server,
                req.header("traceparent"),
                req.header("tracestate"),
            )
            .map(|span| (o, span))
        });
        // Boxed, like every rare branch, so the sync path's future stays small.
        let result = Box::pin(crate::traces::submit(app, req, channel, &params)).await;
        if let Some(traced) = traced {
            let answer = result.as_ref().map(|_| StatusCode::ACCEPTED);
            end_span(traced, req, channel, &[], answer);
        }
        // An accepted submission is counted when its trace runs; a refused
        // one now, with its duration, as a sync refusal.
        if let Err(e) = &result {
            count_refusal(channel, e);
            channel
                .metrics
                .duration
                .record(req.started.elapsed().as_secs_f64());
        }
        result
    } else {
        let started = Instant::now();
        let result = run_sync(app, req, channel, &params, engine_lock_ms).await;
        let m = &channel.metrics;
        match &result {
            Ok(_) => m.ok.increment(1),
            Err(e) => count_refusal(channel, e),
        }
        m.duration.record(started.elapsed().as_secs_f64());
        result
    };
    // CORS headers go on errors too, so a browser client can read them.
    let mut response = result.unwrap_or_else(ApiError::into_response);
    // A failure's log line names the channel (the route label is shared),
    // and shows none of the secrets the request carried (an upstream's
    // error text may quote what a task sent it).
    if let Some(f) = response.extensions_mut().get_mut::<crate::api::Failure>() {
        f.channel.clone_from(&channel.name);
        let headers = req
            .headers
            .iter()
            .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)));
        let secrets = request_secrets(headers, &req.query, &req.body);
        f.message = crate::connectors::mask_values(&f.message, &secrets);
    }
    governance::decorate(channel, &req.headers, &mut response);
    Ok(response)
}

/// `messages_total` for a request that did not succeed: `rejected` when
/// the caller's request was refused (a 4xx: invalid, unknown, duplicate,
/// over its rate limit), `error` when the service failed it (a 5xx: a task
/// failed, a timeout, backpressure).
fn count_refusal(channel: &crate::engine::Channel, e: &ApiError) {
    if e.code.status().is_client_error() {
        channel.metrics.rejected.increment(1);
    } else {
        channel.metrics.failed.increment(1);
    }
}

/// Path parameters of a route match: names from the route table, values
/// from the request's decoded segments.
type Params<'s, 'p> = SmallVec<[(&'s str, &'p str); 4]>;

/// Finds the channel of a request on the snapshot: the REST route table,
/// then a channel named by the single remaining segment.
fn resolve<'s, 'p>(
    snapshot: &'s Snapshot,
    method: &Method,
    req: &Req,
    parts: &[&'p str],
) -> Result<(&'s Arc<Channel>, Params<'s, 'p>), ApiError> {
    if let Some(m) = snapshot.routes.find(method.as_str(), parts) {
        return Ok((m.channel, m.params));
    }
    // HEAD where a route takes GET (RFC 9110 9.3.2): the GET is run and
    // hyper leaves the body out.
    if *method == Method::HEAD
        && let Some(m) = snapshot.routes.find("GET", parts)
    {
        return Ok((m.channel, m.params));
    }
    if let [name] = parts {
        return match snapshot.channels.get(*name) {
            Some(channel) if method == Method::POST => Ok((channel, SmallVec::new())),
            Some(_) => {
                let allow = name_path_methods(snapshot, parts);
                // With a route on the same path, the message names all it
                // takes, as `Allow` does (audit 103).
                let message = if allow == "POST" {
                    format!("channel '{name}' is called with POST, not {method}")
                } else {
                    format!(
                        "channel '{name}' is called with POST, not {method} (this path takes {allow})"
                    )
                };
                Err(ApiError {
                    allow: Some(allow),
                    ..ApiError::new(Code::MethodNotAllowed, message)
                })
            }
            None => Err(ApiError::not_found(format!("Channel '{name}' not found"))),
        };
    }
    Err(ApiError::not_found(format!(
        "No route matches {method} {}",
        req.path()
    )))
}

/// What a channel's name path takes: POST, and the methods of any route
/// on the same one-segment path (audit 99: `Allow: POST` on a path a route
/// also served with GET and PUT).
fn name_path_methods(snapshot: &Snapshot, parts: &[&str]) -> std::borrow::Cow<'static, str> {
    let mut methods = snapshot.routes.methods_at(parts);
    if methods.is_empty() {
        return "POST".into();
    }
    methods.push("POST");
    if methods.contains(&"GET") {
        methods.push("HEAD");
    }
    methods.sort_unstable();
    methods.dedup();
    methods.join(", ").into()
}

/// A data-plane answer given before the request reached its channel (413
/// for a body over the limit, 415 for one that is not JSON, 400 for a bad
/// request line): the channel is looked up from the path as routing would,
/// so the refusal counts in its `messages_total` (`rejected`), and a
/// browser on an allowed origin can read these errors like any other (its
/// CORS headers, for a request with an `Origin` header).
pub(crate) fn decorate_early(
    app: &App,
    parts: &http::request::Parts,
    started: Instant,
    response: &mut HttpResponse,
) {
    let Some(rest) = parts
        .uri
        .path()
        .strip_prefix("/api/v1/data")
        .filter(|rest| rest.is_empty() || rest.starts_with('/'))
    else {
        return;
    };
    let decoded: SmallVec<[std::borrow::Cow<'_, str>; 8]> = rest
        .split('/')
        .filter(|s| !s.is_empty())
        .map(crate::server::decode)
        .collect();
    let mut segments: SmallVec<[&str; 8]> = decoded.iter().map(|s| &**s).collect();
    if segments.len() > 1 && segments.last() == Some(&"async") {
        segments.pop();
    }
    let snapshot = app.engine.load();
    let channel = match snapshot.routes.find(parts.method.as_str(), &segments) {
        Some(m) => Some(m.channel),
        None => match segments.as_slice() {
            [name] => snapshot.channels.get(*name),
            _ => None,
        },
    };
    if let Some(channel) = channel {
        if response.status().is_client_error() {
            channel.metrics.rejected.increment(1);
        } else {
            channel.metrics.failed.increment(1);
        }
        // Every message `messages_total` counts has its duration (audit
        // 100: these had none, while later refusals had one).
        channel
            .metrics
            .duration
            .record(started.elapsed().as_secs_f64());
        if parts.headers.contains_key(header::ORIGIN) {
            governance::decorate(channel, &parts.headers, response);
        }
    }
}

/// Header pairs as the data context holds them (see [`header_pairs_into`]).
pub(crate) type HeaderPairs<'r> = SmallVec<[(&'r str, &'r str); 16]>;

/// Lowercase header names (hyper keeps them lowercase) with UTF-8 values;
/// `x-request-id` is the effective request id (the caller's or ours).
/// Filled in place: the list is large, and returning it would copy it.
pub(crate) fn header_pairs_into<'r>(req: &'r Req, pairs: &mut HeaderPairs<'r>) {
    pairs.extend(
        req.headers
            .iter()
            .filter(|(k, _)| k.as_str() != "x-request-id")
            // UTF-8 values too (`to_str` takes visible ASCII only, and
            // dropped a header such as `x-name: café`).
            .filter_map(|(k, v)| Some((k.as_str(), std::str::from_utf8(v.as_bytes()).ok()?))),
    );
    pairs.push(("x-request-id", req.request_id.as_str()));
}

async fn run_sync(
    app: &Arc<App>,
    req: &Req,
    channel: &Arc<Channel>,
    params: &[(&str, &str)],
    engine_lock_ms: Option<f64>,
) -> Result<HttpResponse, ApiError> {
    let mut headers = HeaderPairs::new();
    header_pairs_into(req, &mut headers);
    // W3C trace context, read from the pairs already built (no second
    // lookup in the header map).
    let header = |name: &str| headers.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    let (traceparent, tracestate) = (header("traceparent"), header("tracestate"));
    let query: SmallVec<[(&str, &str); 8]> = req
        .query
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let caller_id = req.caller_request_id.then_some(req.request_id.as_str());
    let bucket = rollout::bucket_for(&headers, caller_id, Some(&req.client_ip));
    let view = View {
        client_ip: &req.client_ip,
        method: req.method.as_str(),
        target: req.path(),
        headers: &headers,
        query: &query,
        path: params,
        body: &req.body,
        internal: false,
        bucket,
        profile: engine_lock_ms.is_some(),
    };
    // OpenTelemetry (only when enabled and sampled): the request's span,
    // begun before the channel's checks so that a request they refuse (or
    // the cache answers) has its span too.
    let traced = app.otel.as_ref().and_then(|o| {
        o.begin(
            format!("{} {}", req.method, channel.name),
            opentelemetry::trace::SpanKind::Server,
            traceparent,
            tracestate,
        )
        .map(|span| (o, span))
    });
    let admission = match app.governance.admit_in_place(channel, &view, Stage::Run) {
        Some(done) => done,
        None => Box::pin(app.governance.admit(channel, &view, Stage::Run)).await,
    };
    let admitted = match admission {
        Ok(admitted) => admitted,
        Err(e) => {
            if let Some(traced) = traced {
                end_span(traced, req, channel, &[], Err(&e));
            }
            return Err(e);
        }
    };
    if let Some(hit) = &admitted.hit {
        if let Some((otel, mut span)) = traced {
            span.attribute("sluice.cache", "hit");
            end_span((otel, span), req, channel, &[], Ok(StatusCode::OK));
        }
        let mut response = bytes_response(StatusCode::OK, hit.clone());
        response
            .headers_mut()
            .insert("x-cache", http::HeaderValue::from_static("hit"));
        return Ok(response);
    }
    let input = Input {
        body: &req.body,
        payload_from: PayloadFrom::DataMember,
        meta: Meta {
            headers: &headers,
            query: &query,
            path: params,
            method: req.method.as_str(),
            channel: &channel.name,
            request_id: req.request_id.as_str(),
            extra: &[],
        },
        bucket,
    };
    // OpenTelemetry on but this request not sampled: outbound calls say so.
    let unsampled = match (&traced, &app.otel) {
        (None, Some(_)) => crate::otel::unsampled_traceparent(traceparent),
        _ => None,
    };
    let (traceparent, tracestate) = match &unsampled {
        Some(fresh) => (Some(fresh.as_str()), None),
        None => (traceparent, tracestate),
    };
    // The channel's timeout counts from the request's arrival (no clock
    // read here).
    let deadline = req.started + channel.timeout;
    let options = Options {
        record_tasks: engine_lock_ms.is_some() || traced.is_some(),
        deadline: Some(deadline),
        timer: Some(deadline_timer),
        data_prefix: ENVELOPE_OPEN,
        ..Options::default()
    };
    // W3C trace context from the caller is forwarded to connector calls;
    // without it (and without a span to report to) the channel's prebuilt
    // scope serves: no per-request copies.
    let owned_scope;
    let scope = match (traceparent, tracestate, &traced) {
        (None, None, None) => &channel.scope,
        (parent, state, traced) => {
            owned_scope = CallScope {
                traceparent: parent.map(str::to_owned),
                tracestate: state.map(str::to_owned),
                observer: traced.as_ref().map(|(_, span)| span.observer()),
                ..channel.scope.clone()
            };
            &owned_scope
        }
    };
    // Boxed: the execution future is large, and boxing it once keeps every
    // future above it small (they are moved as they are built and awaited).
    let mut run = Box::pin(exec::execute(
        channel.plans.iter().map(|p| &**p),
        input,
        &app.services,
        scope,
        &options,
    ));
    // A workflow without connector calls finishes in its first poll: no
    // timer is armed for it (the executor checks `deadline` between steps).
    let first = std::future::poll_fn(|cx| Poll::Ready(run.as_mut().poll(cx))).await;
    let execution = match first {
        Poll::Ready(result) => result.map_err(|e| ApiError::bad_request(e.to_string())),
        // The executor ends a connector wait at the deadline itself (naming
        // the task); this only bounds a step that overruns it.
        Poll::Pending => {
            match tokio::time::timeout_at((deadline + DEADLINE_GRACE).into(), run).await {
                Ok(result) => result.map_err(|e| ApiError::bad_request(e.to_string())),
                Err(_) => Err(ApiError::new(
                    Code::Timeout,
                    format!(
                        "channel '{}' did not finish within {} ms",
                        channel.name,
                        channel.timeout.as_millis()
                    ),
                )),
            }
        }
    };
    // Nothing ran (no workflow matched, or the body was refused): the
    // deduplication key goes back, as after a later check's refusal.
    let refused = matches!(&execution, Err(e) if e.code == Code::BadRequest);
    let ran_nothing = refused || execution.as_ref().is_ok_and(|e| e.matched.is_none());
    // A body that is not a JSON object never reached a workflow: not an
    // execution (audit 97), as a 413 or 415 before it is not.
    if !refused {
        channel.metrics.executions.increment(1);
    }
    if ran_nothing && admitted.claims() {
        Box::pin(app.governance.give_back(&admitted)).await;
    }
    // Only a clean answer is cached: one whose `errors` holds something (a
    // task that failed under `continue_on_error`, perhaps for a moment)
    // would be served for the whole TTL.
    let clean = execution.as_ref().is_ok_and(|e| e.errors.is_empty());
    // An open breaker's 503 says when to come back: at the latest when its
    // cooldown has run out (a half-open probe may close it then).
    let breaker_retry = app
        .config
        .engine
        .circuit_breaker
        .recovery_timeout_secs
        .max(1);
    let body = match traced {
        None => respond(channel, execution?, engine_lock_ms, breaker_retry)?,
        Some(traced) => {
            // The task records outlive the execution `respond` consumes.
            let tasks = execution
                .as_ref()
                .map(|e| e.tasks.clone())
                .unwrap_or_default();
            let answer = execution.and_then(|e| respond(channel, e, engine_lock_ms, breaker_retry));
            end_span(
                traced,
                req,
                channel,
                &tasks,
                answer.as_ref().map(|_| StatusCode::OK),
            );
            answer?
        }
    };
    // A profiled answer is not cached: its timings belong to this run only.
    if engine_lock_ms.is_none() && admitted.stores() && clean {
        Box::pin(app.governance.store(&admitted, body.clone())).await;
        // A cacheable request the cache did not answer says so.
        let mut response = bytes_response(StatusCode::OK, body);
        response
            .headers_mut()
            .insert("x-cache", http::HeaderValue::from_static("miss"));
        return Ok(response);
    }
    Ok(bytes_response(StatusCode::OK, body))
}

/// Ends a data-plane request's span: its tasks, the status code it was
/// answered with, and an error status when it was refused or failed.
fn end_span(
    (otel, mut span): (&crate::otel::Otel, crate::otel::RequestSpan),
    req: &Req,
    channel: &Channel,
    tasks: &[exec::TaskRecord],
    answer: Result<StatusCode, &ApiError>,
) {
    span.attribute("sluice.channel", channel.name.clone());
    span.attribute("sluice.request_id", req.request_id.as_str().to_owned());
    let status = answer.unwrap_or_else(|e| e.code.status());
    span.attribute("http.response.status_code", i64::from(status.as_u16()));
    if let Err(e) = answer {
        span.attribute("sluice.error_code", e.code.as_str());
    }
    otel.finish(span, tasks, answer.err().map(|e| e.message.as_str()));
}

/// The 404 of a request no workflow matched; names the first workflow
/// whose condition failed to evaluate, if one did, and says when the
/// channel's workflow has no active version at all (audit 113: a workflow
/// left as a draft read the same as conditions that do not hold).
pub(crate) fn unmatched_message(channel: &Channel, execution: Option<&Execution>) -> String {
    let name = &channel.name;
    if channel.plans.is_empty() {
        return format!(
            "No active workflow of channel '{name}' matches the request: workflow '{}' has no active version",
            channel.def.workflow_id
        );
    }
    match execution.and_then(|e| e.errors.first()) {
        Some(e) => format!(
            "No active workflow of channel '{name}' matches the request ({})",
            e.message
        ),
        None => format!("No active workflow of channel '{name}' matches the request"),
    }
}

/// The opening of a successful answer, written ahead of the data.
const ENVELOPE_OPEN: &[u8] = b"{\"status\":\"ok\",\"data\":";

fn respond(
    channel: &Channel,
    execution: Execution,
    engine_lock_ms: Option<f64>,
    breaker_retry_secs: u64,
) -> Result<Bytes, ApiError> {
    if execution.matched.is_none() {
        return Err(ApiError::not_found(unmatched_message(
            channel,
            Some(&execution),
        )));
    }
    if let Status::Failed(f) = &execution.status {
        let code = failure_code(f.kind);
        // What went wrong before the halt (collected under
        // `continue_on_error`, failed validation rules) comes first, in
        // order, then the halting failure: an answer that named only the
        // last problem hid the rest (the async trace and the dry run list
        // them all).
        let earlier = execution.errors.iter().map(|e| Diagnostic {
            field: if e.field.is_empty() {
                "tasks".to_owned()
            } else {
                e.field.clone()
            },
            message: e.message.clone(),
        });
        let halting: Vec<Diagnostic> = if f.messages.is_empty() {
            vec![Diagnostic {
                field: f.field.clone(),
                message: f.message.clone(),
            }]
        } else {
            f.messages
                .iter()
                .map(|m| Diagnostic {
                    field: f.field.clone(),
                    message: m.clone(),
                })
                .collect()
        };
        let details = earlier.chain(halting).collect();
        let message = format!("task '{}' failed: {}", f.task_id, f.message);
        let error = ApiError::new(code, message)
            .with_details(details)
            .with_task(f.task_id.clone());
        return Err(if code == Code::ServiceUnavailable {
            error.with_retry_after(breaker_retry_secs)
        } else {
            error
        });
    }
    // The envelope goes around the serialized data in its own buffer: its
    // opening was written before the data (`Options::data_prefix`).
    let mut out = execution.data;
    out.extend_from_slice(b",\"errors\":");
    if execution.errors.is_empty() {
        out.extend_from_slice(b"[]");
    } else {
        serde_json::to_writer(&mut out, &execution.errors).unwrap_or_default();
    }
    if let Some(lock_ms) = engine_lock_ms {
        let profile = json!({"_service": {"profile": {
            "version": execution.matched.as_ref().map_or(0, |m| m.version),
            "engine_lock_ms": lock_ms,
            "workflow_ms": execution.workflow_ms,
            "tasks": execution.tasks.iter().map(|t| json!({"id": t.id, "ms": t.ms})).collect::<Vec<_>>(),
        }}});
        out.extend_from_slice(b",\"_service\":");
        serde_json::to_writer(&mut out, &profile["_service"]).unwrap_or_default();
    }
    out.push(b'}');
    Ok(Bytes::from(out))
}

/// The code of a halting failure's entries in an `errors` array (async
/// traces, dry runs): failed validation rules are `VALIDATION_ERROR` there,
/// as when they do not halt, while the answer's envelope says `BAD_REQUEST`.
pub(crate) fn failure_item_code(kind: FailureKind) -> &'static str {
    match kind {
        FailureKind::Validation => "VALIDATION_ERROR",
        other => failure_code(other).as_str(),
    }
}

/// The error code of a halted workflow's answer.
pub(crate) fn failure_code(kind: FailureKind) -> Code {
    match kind {
        FailureKind::Task => Code::TaskError,
        FailureKind::Timeout => Code::Timeout,
        FailureKind::CircuitOpen => Code::ServiceUnavailable,
        FailureKind::Upstream => Code::UpstreamError,
        FailureKind::Validation => Code::BadRequest,
    }
}

/// The answer of `POST /workflows/{id}/test` (and `sluice dry-run`).
pub fn dry_run_answer(e: &Execution) -> Json {
    // As deep as an execution can build (serde_json alone stops at 128
    // levels, and the dry run answered `data: null`).
    let data: Json = sluice_runtime::json::to_serde(&e.data, sluice_runtime::exec::MAX_NESTING)
        .unwrap_or(Json::Null);
    let (status, mut errors) = match &e.status {
        Status::Completed => ("completed", Vec::new()),
        Status::Filtered => ("filtered", Vec::new()),
        Status::Failed(f) => {
            let code = failure_item_code(f.kind);
            // A halting validation lists each failed rule, as the data
            // plane's `details` and an async trace's `errors` do.
            let item = |message: &str| json!({"code": code, "task_id": f.task_id, "field": f.field, "message": message});
            let items = if f.messages.is_empty() {
                vec![item(&f.message)]
            } else {
                f.messages.iter().map(|m| item(m)).collect()
            };
            ("failed", items)
        }
    };
    // Every entry names its task's place, as the halting one does.
    errors.splice(
        0..0,
        e.errors.iter().map(|i| {
            let mut item = json!({"code": i.code, "task_id": i.task_id, "message": i.message});
            if !i.field.is_empty() {
                item["field"] = json!(i.field);
            }
            item
        }),
    );
    json!({
        "matched": e.matched.is_some(),
        "status": status,
        "data": data,
        "errors": errors,
        "tasks": e.tasks,
        "ms": e.workflow_ms,
    })
}

/// The members of a request's metadata the runtime's `Meta` has fields
/// for: the three maps, then the three strings.
pub(crate) const METADATA_FIELDS: [&str; 6] = sluice_compiler::def::REQUEST_METADATA;

/// What a dry run's (or a test case's) `metadata` may hold: what a
/// request's does (shared decisions), the three maps and `method`,
/// `channel`, `request_id` as strings (defaults POST, none, the run's own
/// id); the maps' values strings, numbers or booleans. Anything else is a
/// problem, not dropped: a misspelt key would run the workflow on other
/// metadata than the writer meant. `null` is none.
pub fn metadata_problems(meta: &Json) -> Vec<Diagnostic> {
    let root = sluice_compiler::diag::FieldPath::root().key("metadata");
    let Some(members) = meta.as_object() else {
        return if meta.is_null() {
            Vec::new()
        } else {
            vec![Diagnostic::type_mismatch(&root, "object", meta)]
        };
    };
    let mut problems = Vec::new();
    for (k, v) in members {
        let at = root.key(k);
        if !METADATA_FIELDS.contains(&k.as_str()) {
            problems.push(Diagnostic::new(
                at,
                format!("unknown field; expected {}", METADATA_FIELDS.join(", ")),
            ));
        } else if METADATA_FIELDS[3..].contains(&k.as_str()) {
            if !v.is_string() {
                problems.push(Diagnostic::type_mismatch(&at, "string", v));
            }
        } else if let Some(pairs) = v.as_object() {
            // A request's header, query and path values are text: numbers
            // and booleans are taken as their text, containers and null
            // are refused (they were dropped or written as JSON text).
            for (name, value) in pairs {
                if !(value.is_string() || value.is_number() || value.is_boolean()) {
                    problems.push(Diagnostic::type_mismatch(&at.key(name), "string", value));
                }
            }
        } else {
            problems.push(Diagnostic::type_mismatch(&at, "object", v));
        }
    }
    problems
}

/// A string member of a dry run's `metadata` (`method`, `channel`, `request_id`).
pub fn metadata_str<'m>(meta: &'m Json, key: &str) -> Option<&'m str> {
    meta.get(key).and_then(Json::as_str)
}

/// `{headers, query, path}` of a dry-run's `metadata` as owned pairs (header
/// names lowercased; numbers and booleans as their text, see
/// [`metadata_problems`]).
pub fn metadata_pairs(meta: &Json, area: &str) -> Vec<(String, String)> {
    meta.get(area)
        .and_then(Json::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let k = if area == "headers" {
                        k.to_ascii_lowercase()
                    } else {
                        k.clone()
                    };
                    // Numbers as JavaScript writes them (`1e2` is "100").
                    let text = match v {
                        Json::String(s) => s.clone(),
                        Json::Number(_) => String::from_utf8(crate::api::to_json_bytes(v))
                            .unwrap_or_else(|_| v.to_string()),
                        _ => v.to_string(),
                    };
                    (k, text)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Borrows owned pairs the way `exec::Meta` takes them.
pub fn borrow_pairs(pairs: &[(String, String)]) -> Vec<(&str, &str)> {
    pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// The secrets a request carries, as the texts to mask wherever they are
/// quoted (failure log lines, stored trace errors; decisions.md, Masking):
/// the values of credential headers (whole, and the credential after its
/// scheme: `Bearer <token>`), of secret query parameters, and the string
/// values of secret-named keys anywhere in the JSON body. In the forms
/// [`crate::connectors::secret_forms`] gives (escaped too; none shorter than
/// six characters).
pub(crate) fn request_secrets<'h>(
    headers: impl Iterator<Item = (&'h str, &'h str)>,
    query: &[(String, String)],
    body: &[u8],
) -> Vec<String> {
    use sluice_compiler::validate::{is_secret_header, is_secret_key, is_secret_query_param};
    let mut values = Vec::new();
    for (name, value) in headers {
        if is_secret_header(name) {
            values.push(value.to_owned());
            if let Some((_, credential)) = value.trim().split_once(' ') {
                values.push(credential.trim().to_owned());
            }
        }
    }
    for (name, value) in query {
        if is_secret_query_param(name) {
            values.push(value.clone());
        }
    }
    fn walk(v: &Json, secret: bool, out: &mut Vec<String>) {
        match v {
            Json::String(s) if secret => out.push(s.clone()),
            Json::Array(items) => items.iter().for_each(|i| walk(i, secret, out)),
            Json::Object(m) => m
                .iter()
                .for_each(|(k, i)| walk(i, secret || is_secret_key(k), out)),
            _ => {}
        }
    }
    if let Ok(body) = serde_json::from_slice::<Json>(body) {
        walk(&body, false, &mut values);
    }
    crate::connectors::secret_forms(values)
}
