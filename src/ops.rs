//! Operational endpoints: `/health`, `/healthz`, `/readyz`, and the engine
//! status object shared with `GET /api/v1/admin/engine/status`.

use crate::api::{ApiResult, json_response};
use crate::app::{App, VERSION};
use http::StatusCode;
use serde_json::{Value as Json, json};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The engine status object of the spec, from the live snapshot.
pub fn engine_status(app: &App) -> Json {
    let snapshot = app.engine.load();
    let mut channels: Vec<&String> = snapshot.channels.keys().collect();
    channels.sort();
    json!({
        "version": VERSION,
        "uptime_seconds": app.uptime_seconds(),
        "workflows_count": snapshot.workflows_loaded,
        "active_workflows": snapshot.active_workflows,
        "channels": channels,
        "generation": snapshot.generation,
    })
}

async fn database_ok(app: &App) -> bool {
    let wait = Duration::from_secs(app.config.engine.health_check_timeout_secs.max(1));
    matches!(
        tokio::time::timeout(wait, app.store.ping()).await,
        Ok(Ok(()))
    )
}

/// 200 when the database answers `SELECT 1` and the engine is loaded and
/// current (its last reload built); else 503 with `status: degraded`.
pub async fn health(app: &App) -> ApiResult {
    let database = database_ok(app).await;
    let snapshot = app.engine.load();
    let loaded = snapshot.generation > 0;
    // Loaded, but the stored definitions no longer build: the engine serves
    // an older state than the API reports (a stored definition edited in
    // the database, or rules that changed with an upgrade).
    let stale = app.reload_failed.load(Ordering::Acquire);
    let engine = loaded && !stale;
    let healthy = database && engine;
    let body = json!({
        "status": if healthy { "ok" } else { "degraded" },
        "version": VERSION,
        "uptime_seconds": app.uptime_seconds(),
        "workflows_loaded": snapshot.workflows_loaded,
        "components": {
            "database": if database { "ok" } else { "unavailable" },
            "engine": match (loaded, stale) {
                (false, _) => "not_loaded",
                (true, true) => "reload_failed",
                (true, false) => "ok",
            },
        },
    });
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    Ok(json_response(status, &body))
}

/// Liveness: always 200.
pub fn healthz() -> ApiResult {
    Ok(json_response(StatusCode::OK, &json!({"status": "ok"})))
}

/// Readiness: 200 only when start-up has completed, the engine is loaded and
/// the database answers.
pub async fn readyz(app: &App) -> ApiResult {
    let started = app.ready.load(Ordering::Acquire);
    let engine = app.engine.load().generation > 0;
    let database = database_ok(app).await;
    // Behind the stored generation (another replica's change not loaded yet).
    let synced = !app.behind.load(Ordering::Acquire);
    // Shutting down (still serving during `server.shutdown_delay_secs` and
    // the drain): out of rotation.
    let stopping = app.stopping.load(Ordering::Acquire);
    let ready = started && engine && database && synced && !stopping;
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "checks": {"startup": started, "engine": engine, "database": database,
                   "synced": synced, "stopping": stopping},
    });
    Ok(json_response(
        if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        &body,
    ))
}

/// Prometheus text format, when `metrics.enabled`.
pub fn metrics(app: &App) -> ApiResult {
    let handle = crate::telemetry::metrics_handle().filter(|_| app.config.metrics.enabled);
    let Some(handle) = handle else {
        return Err(crate::api::ApiError::not_found(
            "metrics are disabled (metrics.enabled = false)",
        ));
    };
    metrics::gauge!(crate::telemetry::names::ACTIVE_WORKFLOWS)
        .set(app.engine.load().active_workflows as f64);
    let mut response = http::Response::new(http_body_util::Full::new(bytes::Bytes::from(
        crate::telemetry::render(handle),
    )));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    Ok(response)
}
