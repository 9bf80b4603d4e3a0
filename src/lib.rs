//! The Sluice service: configuration, the hyper server, the admin and data
//! planes, storage and (later) real connector clients. The `sluice` binary
//! (`main.rs`) is a thin command line over this library, and the integration
//! tests start the same server in-process.

use std::sync::Arc;

pub mod admin;
pub mod api;
pub mod app;
pub mod apply;
pub mod auth;
pub mod cli;
pub mod config;
pub mod connectors;
pub mod data;
pub mod engine;
pub mod forwarded;
pub mod governance;
pub mod invoke;
pub mod kafka;
pub mod openapi;
pub mod ops;
pub mod otel;
pub mod queue;
pub mod rejections;
pub mod router;
pub mod server;
pub mod storage;
pub mod sync;
pub mod telemetry;
pub mod testing;
pub mod traces;

/// Opens storage and applies the migrations.
pub async fn open_store(config: &config::Config) -> Result<storage::Store, String> {
    let store = storage::Store::connect(&config.storage.url, config.storage.max_connections)
        .await
        .map_err(|e| format!("cannot open storage: {e}"))?;
    store
        .migrate()
        .await
        .map_err(|e| format!("migrations failed: {e}"))?;
    Ok(store)
}

/// Everything before the service reports ready: storage, migrations, the
/// first engine load (a reload from empty).
pub async fn start(config: config::Config) -> Result<Arc<app::App>, String> {
    start_with_services(config, Default::default()).await
}

/// [`start`] with some connector implementations supplied by the caller
/// (the others are the real clients): how tests put a misbehaving
/// connector behind the real service.
pub async fn start_with_services(
    config: config::Config,
    services: sluice_runtime::connectors::Services,
) -> Result<Arc<app::App>, String> {
    let store = open_store(&config).await?;
    let otel = otel::Otel::init(&config.tracing)?;
    let mut app = app::App::new(config, store, services);
    app.otel = otel;
    let app = Arc::new(app);
    // The first reload loads the connectors, then the engine.
    invoke::attach(&app);
    match app.reload(None).await {
        Ok(report) => tracing::info!(
            workflows = report.workflows,
            channels = report.channels,
            "engine loaded"
        ),
        Err(e) => tracing::error!(
            ?e,
            "the stored definitions do not compile; serving with an empty engine"
        ),
    }
    match app.store.end_orphaned_leases().await {
        Ok(0) => {}
        Ok(n) => tracing::warn!(
            traces = n,
            "async traces were left running by a stopped process; they run again"
        ),
        Err(e) => tracing::warn!(error = %e, "could not end the leases of orphaned traces"),
    }
    queue::start(&app);
    kafka::start(&app);
    sync::start(&app);
    app.ready.store(true, std::sync::atomic::Ordering::Release);
    Ok(app)
}
