//! The service's shared state: configuration, storage, the engine snapshot
//! behind one `ArcSwap`, and what outlives snapshots.

use crate::config::Config;
use crate::engine::{self, ReloadError, Snapshot};
use crate::storage::{Audit, Store};
use crate::telemetry::names;
use arc_swap::ArcSwap;
use sluice_runtime::connectors::Services;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub struct App {
    pub config: Config,
    /// `server.trusted_proxies`, parsed (checked at configuration load).
    pub trusted_proxies: crate::forwarded::TrustedProxies,
    pub store: Store,
    /// The live engine. Requests `load()` it once; reloads `store()` a new one.
    pub engine: ArcSwap<Snapshot>,
    /// Connector implementations; kept across reloads.
    pub services: Services,
    /// The connector registry, clients and circuit breakers behind `services`.
    pub connectors: Arc<crate::connectors::Connectors>,
    pub started: Instant,
    /// Set once start-up (migrations, first reload) has completed.
    pub ready: AtomicBool,
    /// Set when a shutdown signal arrives: `/readyz` answers 503 from then
    /// on (during `server.shutdown_delay_secs` and the drain).
    pub stopping: AtomicBool,
    /// Requests being served now (for `server.max_in_flight` load shedding).
    pub in_flight: AtomicU64,
    /// Async trace workers (started by `crate::start`, stopped by `crate::queue::shutdown`).
    pub queue: crate::queue::Queue,
    /// Channel governance state (buckets, dedup windows, cache, counters);
    /// kept across reloads.
    pub governance: crate::governance::Governance,
    /// `channel_call`'s invoker (in `services.channels` unless the caller
    /// supplied one); `crate::invoke::attach` points it at this app.
    pub invoker: Arc<crate::invoke::Invoker>,
    /// OpenTelemetry exporter (`tracing.enabled`); `None` costs nothing.
    pub otel: Option<crate::otel::Otel>,
    /// Set while this replica knows it serves an older generation than
    /// storage holds (`/readyz` answers 503 meanwhile).
    pub behind: AtomicBool,
    /// Set while the last reload could not build the stored definitions
    /// (the previous engine keeps serving, behind what the API reports):
    /// `/health` is degraded until a reload succeeds.
    pub reload_failed: AtomicBool,
    /// The stored generation whose definitions this replica could not
    /// build (0: none): `crate::sync` does not count it as behind, and
    /// tries again when the generation moves on.
    pub unbuildable: AtomicU64,
    /// The reload-propagation loop (`crate::sync`), stopped at shutdown.
    pub sync: std::sync::Mutex<Option<tokio::task::AbortHandle>>,
    /// Kafka channel consumers (started by `crate::start` when `kafka.enabled`).
    pub kafka: crate::kafka::Consumers,
    generation: AtomicU64,
    /// Reloads are serialized (admin side only; the request path never waits on it).
    reload_lock: tokio::sync::Mutex<()>,
    /// Read-held by each admin change from moving the generation on until
    /// its reload is done; see [`App::wait_for_own_changes`].
    change_gate: tokio::sync::RwLock<()>,
    /// Where reloads are built: a thread at background priority.
    reloader: engine::Reloader,
}

/// What a successful reload reports.
#[derive(Debug, serde::Serialize)]
pub struct ReloadReport {
    pub generation: u64,
    pub workflows: usize,
    pub active_workflows: usize,
    pub channels: usize,
    pub routes: usize,
    /// Workflow versions compiled by this reload; the others' plans were
    /// reused (their definitions did not change).
    pub compiled: usize,
    pub duration_ms: f64,
}

impl App {
    pub fn new(config: Config, store: Store, mut services: Services) -> App {
        if config.metrics.enabled {
            crate::telemetry::metrics_handle();
        }
        let invoker = Arc::new(crate::invoke::Invoker::default());
        if services.channels.is_none() {
            services.channels = Some(invoker.clone());
        }
        let connectors = Arc::new(crate::connectors::Connectors::new(&config));
        let services = connectors.fill(services);
        // Checked by `Config::validate`; a configuration built in code
        // that skipped it trusts nobody rather than failing here.
        let trusted_proxies =
            crate::forwarded::TrustedProxies::parse(&config.server.trusted_proxies)
                .unwrap_or_default();
        App {
            trusted_proxies,
            connectors,
            queue: crate::queue::Queue::new(&config.queue),
            governance: crate::governance::Governance::new(&config),
            invoker,
            kafka: crate::kafka::Consumers::default(),
            otel: None,
            behind: AtomicBool::new(false),
            reload_failed: AtomicBool::new(false),
            unbuildable: AtomicU64::new(0),
            sync: std::sync::Mutex::new(None),
            config,
            store,
            engine: ArcSwap::from_pointee(Snapshot::default()),
            services,
            started: Instant::now(),
            ready: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            in_flight: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            reload_lock: tokio::sync::Mutex::new(()),
            change_gate: tokio::sync::RwLock::new(()),
            reloader: engine::Reloader::default(),
        }
    }

    /// An admin change: moves the stored generation on (notifying the other
    /// replicas on PostgreSQL) and reloads this replica.
    pub async fn changed(&self, audit: Option<Audit>) -> Result<ReloadReport, ReloadError> {
        // Held across the bump and the reload: this replica's own
        // notification waits for them (`wait_for_own_changes`).
        let _changing = self.change_gate.read().await;
        self.store.bump_engine_generation_or_later().await;
        self.reload(audit).await
    }

    /// After a connector change (create, update, delete, import, reload):
    /// the registry reloads (a changed connector gets a new client on its
    /// next call), the stored generation moves on (the other replicas pick
    /// the change up) and this replica's engine is rebuilt at that
    /// generation, as after any other change, so `/engine/status` reports
    /// it on every backend and this replica's own notification finds
    /// nothing left to do (audit 106: SQLite kept serving the old number
    /// while storage moved on, and PostgreSQL and MariaDB reloaded a
    /// second time as if another replica had changed something). Returns
    /// the registry's size; a registry that does not load is a storage
    /// error (the previous registry and engine keep serving).
    pub async fn connectors_changed(&self) -> Result<usize, crate::storage::StorageError> {
        let _changing = self.change_gate.read().await;
        self.store.bump_engine_generation_or_later().await;
        // `reload` reloads the registry first (a failure is a storage
        // error; the previous engine and registry keep serving).
        // Definitions that do not build are the engine's problem, not the
        // connectors'.
        match self.reload(None).await {
            Err(ReloadError::Storage(e)) => Err(e),
            _ => Ok(self.connectors.loaded()),
        }
    }

    /// Returns once the admin changes this replica is making (moving the
    /// generation on, then reloading) have reloaded.
    pub async fn wait_for_own_changes(&self) {
        drop(self.change_gate.write().await);
    }

    /// The generation this replica serves.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    pub fn uptime_seconds(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// Rebuilds the engine from storage and swaps it in; on failure the
    /// current snapshot keeps serving. `audit` records who asked (start-up
    /// passes `None`).
    pub async fn reload(&self, audit: Option<Audit>) -> Result<ReloadReport, ReloadError> {
        let _guard = tokio::time::timeout(
            std::time::Duration::from_secs(self.config.engine.reload_timeout_secs),
            self.reload_lock.lock(),
        )
        .await
        .map_err(|_| {
            ReloadError::Storage(crate::storage::StorageError::Conflict(
                "another reload is still running".into(),
            ))
        })?;
        // A failed reload is timed too, from here to its failure (audit 117:
        // it was counted in `engine_reloads_total` but not timed).
        let started = std::time::Instant::now();
        let failed = || {
            metrics::counter!(names::ENGINE_RELOADS_TOTAL, "status" => "failure").increment(1);
            metrics::histogram!(names::ENGINE_RELOAD_DURATION_SECONDS)
                .record(started.elapsed().as_secs_f64());
        };
        // The generation is the stored one, read before the definitions: the
        // snapshot holds at least what that generation describes, and every
        // replica serving the same definitions reports the same number.
        let generation = match self.store.engine_generation().await {
            Ok(g) => g.max(1) as u64,
            Err(e) => {
                failed();
                tracing::warn!(error = %e, "engine reload failed; the previous engine keeps serving");
                return Err(ReloadError::Storage(e));
            }
        };
        // The connector registry first (unchanged connectors keep their
        // clients). Read after the generation, it holds every connector
        // change that generation counts (a change is committed before it
        // moves the generation on), so whatever made this reload, a replica
        // serving a generation calls the connectors it describes (audit
        // 111: a replica whose own change overtook another replica's
        // connector change never loaded that connector, while its
        // generation said it was current).
        // A registry that did not load fails the reload: the generation
        // stays where it was, so the next check (or change) loads it again,
        // instead of reporting a generation whose connectors this replica
        // does not hold (audit 124: a rotated password or a deleted
        // connector stayed in use while the generation said current).
        if let Err(e) = self.connectors.reload(&self.store).await {
            failed();
            tracing::warn!(error = %e, "could not reload the connectors; the previous engine and connectors keep serving");
            return Err(ReloadError::Storage(e));
        }
        let built = self
            .reloader
            .build(&self.store, generation, self.engine.load_full())
            .await;
        let built = match built {
            Ok(b) => b,
            Err(e) => {
                failed();
                // Definitions that do not build (not a busy or lost database,
                // which the database check and the next reload cover).
                if matches!(e, ReloadError::Invalid(_)) {
                    self.reload_failed.store(true, Ordering::Release);
                }
                if self.engine.load().generation == 0 {
                    // At start-up there is no previous engine to keep.
                    tracing::warn!(?e, "engine load failed; no engine is serving");
                } else {
                    tracing::warn!(
                        ?e,
                        "engine reload failed; the previous engine keeps serving"
                    );
                }
                return Err(e);
            }
        };
        let report = ReloadReport {
            generation,
            workflows: built.snapshot.workflows_loaded,
            active_workflows: built.snapshot.active_workflows,
            channels: built.snapshot.channels.len(),
            routes: built.snapshot.routes.len(),
            compiled: built.compiled,
            duration_ms: sluice_runtime::exec::millis(built.elapsed),
        };
        metrics::counter!(names::ENGINE_RELOADS_TOTAL, "status" => "success").increment(1);
        metrics::histogram!(names::ENGINE_RELOAD_DURATION_SECONDS)
            .record(built.elapsed.as_secs_f64());
        metrics::gauge!(names::ACTIVE_WORKFLOWS).set(built.snapshot.active_workflows as f64);
        let old = self.engine.swap(Arc::new(built.snapshot));
        // A channel no longer served (deleted, paused, renamed) forgets its
        // circuit breakers on every replica, which all reload: one created
        // or resumed under that name starts closed (audit 111: only the
        // replica that answered the delete forgot them).
        {
            let now = self.engine.load();
            for name in old.channels.keys() {
                if !now.channels.contains_key(name) {
                    self.connectors.policy.breakers.forget_channel(name);
                }
            }
        }
        self.reload_failed.store(false, Ordering::Release);
        // Freeing a large engine takes a while: on a thread of its own at
        // background priority, not on a runtime worker.
        let _ = std::thread::Builder::new()
            .name("sluice-free".into())
            .spawn(move || {
                engine::background_priority();
                drop(old);
            });
        self.generation.store(generation, Ordering::Relaxed);
        self.kafka.engine_changed();
        tracing::info!(
            generation,
            workflows = report.workflows,
            channels = report.channels,
            "engine reloaded"
        );
        if let Some(mut audit) = audit {
            audit.resource_type = "engine".into();
            audit.resource_id = "engine".into();
            audit.details = serde_json::to_value(&report).unwrap_or_default();
            if let Err(e) = self.store.audit(audit).await {
                tracing::error!(error = %e, "could not write the reload audit entry");
            }
        }
        Ok(report)
    }
}
