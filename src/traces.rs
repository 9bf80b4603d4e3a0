//! Data-plane async submission and trace reads: `POST .../async` (and channels
//! of type async) store a pending trace and answer 202 at once;
//! `GET /api/v1/data/traces[/{id}]` read the trace records. The run itself
//! happens in `queue`.

use crate::api::{self, ApiError, ApiResult};
use crate::app::App;
use crate::engine::Channel;
use crate::server::Req;
use crate::storage::{NewTrace, TraceQuery, TraceStatus};
use http::{Method, StatusCode};
use serde_json::{Map, Value as Json, json};
use sluice_runtime::exec::InputError;
use sluice_runtime::rollout;
use std::sync::Arc;

/// `mode` of traces submitted over HTTP.
pub const MODE_ASYNC: &str = "async";

/// Stores the request as a pending trace and answers `202 {trace_id, status}`.
/// The channel's checks up to validation run now, so a rejected request is
/// answered here rather than becoming a failed trace later.
pub async fn submit(
    app: &Arc<App>,
    req: &Req,
    channel: &Arc<Channel>,
    params: &[(&str, &str)],
) -> ApiResult {
    // A channel without an active workflow has nothing to run: refused now,
    // as a sync request is, rather than accepted and failed (and retried)
    // as a trace.
    if channel.plans.is_empty() {
        return Err(ApiError::not_found(crate::data::unmatched_message(
            channel, None,
        )));
    }
    let mut headers = crate::data::HeaderPairs::new();
    crate::data::header_pairs_into(req, &mut headers);
    let query: Vec<(&str, &str)> = req
        .query
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    // Dedup, rate limits and validation run now (backpressure and the
    // response cache belong to the run; see `governance::Stage`).
    let admitted = app
        .governance
        .admit(
            channel,
            &crate::governance::View {
                client_ip: &req.client_ip,
                method: req.method.as_str(),
                target: req.path(),
                headers: &headers,
                query: &query,
                path: params,
                body: &req.body,
                internal: false,
                // The submit stage has no response cache.
                bucket: None,
                profile: false,
            },
            crate::governance::Stage::Submit,
        )
        .await?;
    let stored = store_submission(app, req, channel, &headers, &query, params).await;
    // Nothing was accepted (the body was refused, the trace store failed):
    // the deduplication key goes back, so the client's retry runs instead
    // of being told it is a duplicate of work that does not exist.
    if stored.is_err() && admitted.claims() {
        app.governance.give_back(&admitted).await;
    }
    stored
}

/// The rest of an async submission, once the channel's checks admitted it:
/// the payload is checked and the pending trace stored.
async fn store_submission(
    app: &Arc<App>,
    req: &Req,
    channel: &Channel,
    headers: &[(&str, &str)],
    query: &[(&str, &str)],
    path: &[(&str, &str)],
) -> ApiResult {
    // The payload is the body's `data` member, as on the sync path; no body
    // (a route-matched GET) is a null payload.
    // The payload is stored: it may nest only as deep as the database's
    // JSON check accepts (the body is one level more).
    if let Some(limit) = app.store.json_depth()
        && !sluice_runtime::json::nests_within(&req.body, limit + 1)
    {
        return Err(ApiError::bad_request(format!(
            "the payload nests deeper than the {limit} levels the trace store keeps \
             (async requests are stored; a sync request may nest 1024 levels)"
        )));
    }
    let payload = if req.body.iter().all(u8::is_ascii_whitespace) {
        Json::Null
    } else {
        // Nested as deep as a sync request may be (serde_json alone stops
        // at 128 levels).
        match sluice_runtime::json::to_serde(&req.body, sluice_runtime::json::MAX_BODY_NESTING) {
            Ok(Json::Object(mut body)) => body.remove("data").unwrap_or(Json::Null),
            Ok(_) => return Err(ApiError::bad_request(InputError::NotObject.to_string())),
            Err(e) => {
                return Err(ApiError::bad_request(InputError::NotJson(e).to_string()));
            }
        }
    };
    let caller_id = req.caller_request_id.then_some(req.request_id.as_str());
    // Fixed now: its inputs (authorization, client IP) are not stored.
    let bucket = rollout::bucket_for(headers, caller_id, Some(&req.client_ip));
    let object = |pairs: &[(&str, &str)]| {
        Json::Object(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Json::String((*v).to_owned())))
                .collect::<Map<_, _>>(),
        )
    };
    let mut metadata = json!({
        "headers": object(headers),
        "query": object(query),
        "path": object(path),
        "method": req.method.as_str(),
        "channel": channel.name,
        "request_id": req.request_id.as_str(),
    });
    // Header values named like credentials (and secret-named keys anywhere)
    // are masked before they are stored: a trace never holds them.
    sluice_compiler::validate::mask_secrets(&mut metadata);
    let trace_id = uuid::Uuid::new_v4().to_string();
    app.store
        .insert_pending(&NewTrace {
            trace_id: trace_id.clone(),
            channel: channel.name.clone(),
            mode: MODE_ASYNC.into(),
            bucket,
            payload: payload.to_string(),
            metadata: metadata.to_string(),
            created_at: now_micros(),
        })
        .await?;
    app.queue.notify(trace_id.clone());
    Ok(api::json_response(
        StatusCode::ACCEPTED,
        &json!({"trace_id": trace_id, "status": "pending"}),
    ))
}

/// `GET /api/v1/data/traces` (`rest` empty) and `GET /api/v1/data/traces/{id}`.
pub async fn read(app: &Arc<App>, req: &Req, rest: &[&str]) -> ApiResult {
    if req.method != Method::GET && req.method != Method::HEAD {
        return Err(ApiError::method_not_allowed(
            &req.method,
            req.path(),
            "GET, HEAD",
        ));
    }
    req.single_valued_query()?;
    if let [id] = rest {
        // Trace ids are UUIDs, written lowercase; a UUID read back in
        // uppercase names the same trace (RFC 9562).
        let id = id.to_ascii_lowercase();
        let trace = retries_shown(app, app.store.get_trace(&id).await?);
        return api::ok(&trace.to_json());
    }
    let (limit, offset) = crate::admin::paging(req)?;
    let status = match req.query("status") {
        None => None,
        Some(s) => Some(TraceStatus::parse(s).ok_or_else(|| {
            ApiError::bad_request(format!(
                "status must be one of pending, running, completed, failed, got '{s}'"
            ))
        })?),
    };
    let q = TraceQuery {
        status,
        channel: req.query("channel").map(str::to_owned),
        mode: match req.query("mode") {
            None => None,
            Some(m @ (MODE_ASYNC | "kafka")) => Some(m.to_owned()),
            Some(m) => {
                return Err(ApiError::bad_request(format!(
                    "mode must be one of async, kafka, got '{m}'"
                )));
            }
        },
        limit,
        offset,
    };
    let (traces, total) = app.store.list_traces(&q).await?;
    api::page(
        traces
            .into_iter()
            .map(|t| retries_shown(app, t).to_json())
            .collect(),
        total,
        limit,
        offset,
    )
}

fn now_micros() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// A trace as shown: with `queue.dlq_retry_enabled = false` no dead letter
/// runs again, so none is said to be due.
fn retries_shown(app: &App, mut trace: crate::storage::Trace) -> crate::storage::Trace {
    if !app.config.queue.dlq_retry_enabled {
        trace.next_retry_at = None;
    }
    trace
}
