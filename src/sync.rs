//! Reload propagation across replicas sharing one database.
//!
//! Every admin change moves the stored engine generation on
//! ([`crate::app::App::changed`]). Each replica compares it with the
//! generation it serves and, when storage is ahead, reloads its connector
//! registry and rebuilds its snapshot from storage (the start-up reload
//! path), storing it once. Connector changes move the generation on too.
//! - **PostgreSQL:** `LISTEN sluice_engine`; the bump's `NOTIFY` wakes every
//!   replica at once. After a lost connection (notifications sent meanwhile
//!   are lost) and every [`SAFETY_CHECK`] it checks the row anyway, so a
//!   replica that missed notifications catches up.
//! - **MySQL/MariaDB:** a poll of the single generation row every
//!   `engine.sync_interval_ms` (default 500 ms): one primary-key read.
//! - **SQLite:** one process owns the file; nothing runs.
//!
//! While a replica knows it is behind (or cannot read the generation),
//! `/readyz` answers 503; not when the stored definitions do not build
//! (every replica fails alike: `/health` reports it, and the next change
//! is tried again).

use crate::app::App;
use crate::storage::Backend;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How often a PostgreSQL replica checks the row without a notification.
pub const SAFETY_CHECK: Duration = Duration::from_secs(10);

/// Starts the loop for the store's backend (once).
pub fn start(app: &Arc<App>) {
    let task = match app.store.backend() {
        Backend::Sqlite => return,
        Backend::Postgres => tokio::spawn(listen_loop(app.clone())),
        Backend::MySql => tokio::spawn(poll_loop(app.clone())),
    };
    let mut slot = app
        .sync
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(old) = slot.replace(task.abort_handle()) {
        old.abort();
    }
}

/// Stops the loop (shutdown).
pub fn stop(app: &App) {
    let slot = app
        .sync
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(task) = slot {
        task.abort();
    }
}

/// Reloads if storage holds another generation than this replica serves:
/// a later one (another replica's change), or an earlier one, which only a
/// restored database has (audit 124: replicas serving generation 50 kept
/// serving what a restored dump at 30 no longer held, and ignored every
/// change until the number passed 50 again).
pub async fn catch_up(app: &App) {
    match app.store.engine_generation().await {
        Ok(stored) if stored.max(1) as u64 != app.generation() => {
            // This replica's own change notifies it too, before its own
            // reload is done: wait for that reload, then judge (audit 83:
            // each change reloaded twice on PostgreSQL, counted twice in
            // `engine_reloads_total`).
            app.wait_for_own_changes().await;
            if stored.max(1) as u64 == app.generation() {
                app.behind.store(false, Ordering::Release);
                return;
            }
            // Already tried: nothing newer to load until it moves on.
            if app.unbuildable.load(Ordering::Acquire) == stored.max(1) as u64 {
                app.behind.store(false, Ordering::Release);
                return;
            }
            app.behind.store(true, Ordering::Release);
            // The reload loads the connectors first (unchanged ones keep
            // their clients), then the engine whose workflows call them.
            match app.reload(None).await {
                Ok(r) => {
                    tracing::info!(
                        generation = r.generation,
                        "caught up with another replica's change"
                    );
                    app.behind
                        .store(r.generation < stored as u64, Ordering::Release);
                }
                // The stored definitions do not build (every replica
                // fails alike): the previous engine keeps serving and
                // `/health` says `reload_failed`, but the replica is not
                // behind anything it could load, so `/readyz` stays ready,
                // as on SQLite (audit 70: the whole fleet left rotation).
                Err(e @ crate::engine::ReloadError::Invalid(_)) => {
                    app.unbuildable
                        .store(stored.max(1) as u64, Ordering::Release);
                    app.behind.store(false, Ordering::Release);
                    if app.engine.load().generation == 0 {
                        // Started while they do not build: nothing serves.
                        tracing::warn!(
                            ?e,
                            "the stored definitions do not build; no engine is serving until the next change"
                        );
                    } else {
                        tracing::warn!(
                            ?e,
                            "the stored definitions do not build; the previous engine keeps serving until the next change"
                        );
                    }
                }
                Err(e) => tracing::warn!(?e, "could not catch up; retrying on the next check"),
            }
        }
        Ok(_) => app.behind.store(false, Ordering::Release),
        Err(e) => {
            app.behind.store(true, Ordering::Release);
            tracing::warn!(error = %e, "cannot read the engine generation");
        }
    }
}

async fn poll_loop(app: Arc<App>) {
    let every = Duration::from_millis(app.config.engine.sync_interval_ms);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        catch_up(&app).await;
    }
}

async fn listen_loop(app: Arc<App>) {
    loop {
        let mut listener = match app.store.engine_listener().await {
            Ok(Some(l)) => l,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "cannot LISTEN for engine changes; retrying");
                app.behind.store(true, Ordering::Release);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        // Whatever happened before listening started is read from the row.
        catch_up(&app).await;
        loop {
            match tokio::time::timeout(SAFETY_CHECK, listener.try_recv()).await {
                // A notification, or the periodic check.
                Ok(Ok(Some(_))) | Err(_) => catch_up(&app).await,
                // The connection dropped (notifications may be lost); the
                // next try_recv reconnects.
                Ok(Ok(None)) => catch_up(&app).await,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "engine change listener failed; reconnecting");
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
