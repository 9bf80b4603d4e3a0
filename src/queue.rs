//! The async trace worker pool: `queue.workers` tasks fed by a bounded channel,
//! plus three background loops (sweep, dead-letter retry, retention).
//!
//! The database is the queue of record; the channel only saves workers a
//! poll. A submission stores a `pending` trace and offers its id to the channel
//! (`try_send`: a full channel drops the hint, never the trace). A worker claims
//! the id in storage before it runs it, so a hint delivered twice, or a trace
//! the sweep took first, never runs twice. The sweep claims whatever storage
//! still holds as claimable (submissions whose hint was dropped, traces left
//! pending by a restart, runs whose lease expired after a crash).
//!
//! Each run uses the engine snapshot current when it starts, the stored
//! payload and the stored (masked) metadata, bounded by the channel's timeout.

use crate::api::Code;
use crate::app::App;
use crate::config;
use crate::storage::{Claimed, Outcome, RetryPolicy, Store};
use serde_json::{Value as Json, json};
use sluice_runtime::connectors::CallScope;
use sluice_runtime::exec::{self, Input, Meta, Options, PayloadFrom, Status};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio::task::{AbortHandle, JoinHandle};

/// How often storage is swept for claimable traces the channel did not carry.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(5);
/// How often traces past `queue.trace_retention_hours` are deleted.
pub const RETENTION_INTERVAL: Duration = Duration::from_secs(3600);
/// Dead letters moved back to pending per storage round trip.
const REQUEUE_BATCH: i64 = 100;

/// One unit of work for a worker. Every claim is made by the worker that
/// runs it, right before the run: a lease taken while the job waited in the
/// channel could run out before a busy pool got to it, and the sweep would
/// claim the trace again (the first run's result then discarded as stale,
/// the upstream called again, over and over under a backlog).
enum Job {
    /// A hint: this trace may be pending; claim it first.
    Claim(String),
    /// From the sweep: claim and run whatever is claimable, one trace after
    /// another, until storage has nothing left.
    Drain,
}

/// The pool's handles; lives in `App`, started by `start` once the app exists.
pub struct Queue {
    tx: mpsc::Sender<Job>,
    rx: Arc<tokio::sync::Mutex<mpsc::Receiver<Job>>>,
    stop: watch::Sender<bool>,
    started: AtomicBool,
    workers: Mutex<Vec<JoinHandle<()>>>,
    loops: Mutex<Vec<AbortHandle>>,
    /// Runs in progress (trace id → attempt), handed back if shutdown cuts them off.
    running: Mutex<HashMap<String, i64>>,
    /// `Drain` jobs queued or being worked (at most one per worker).
    draining: AtomicUsize,
    workers_count: usize,
    /// Wakes the sweep before its interval when a hint was dropped: the
    /// trace waits in storage, and a backlog should not wait up to
    /// `SWEEP_INTERVAL` for idle workers.
    dropped: tokio::sync::Notify,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("started", &self.started.load(Ordering::Relaxed))
            .finish()
    }
}

impl Queue {
    pub fn new(config: &config::Queue) -> Queue {
        // Room for a burst of hints per worker; beyond that the sweep catches up.
        let capacity = (config.workers.max(1) as usize * 64).max(256);
        let (tx, rx) = mpsc::channel(capacity);
        Queue {
            tx,
            rx: Arc::new(tokio::sync::Mutex::new(rx)),
            stop: watch::channel(false).0,
            started: AtomicBool::new(false),
            workers: Mutex::new(Vec::new()),
            loops: Mutex::new(Vec::new()),
            running: Mutex::new(HashMap::new()),
            draining: AtomicUsize::new(0),
            workers_count: config.workers.max(1) as usize,
            dropped: tokio::sync::Notify::new(),
        }
    }

    /// Offers a stored trace to the workers. Never waits: when the channel is
    /// full the trace stays pending in storage and the sweep takes it.
    pub fn notify(&self, trace_id: String) {
        if let Err(e) = self.tx.try_send(Job::Claim(trace_id)) {
            tracing::debug!(error = %e, "trace queue full; the sweep will pick the trace up");
            self.dropped.notify_one();
        }
    }

    /// The dead-letter policy the configuration asks for: the first retry
    /// after one poll interval, doubling per retry (capped).
    pub fn retry_policy(config: &config::Queue) -> RetryPolicy {
        RetryPolicy {
            max_retries: config.dlq_max_retries,
            base_delay_secs: config.dlq_poll_interval_secs.max(1),
        }
    }
}

/// Spawns the workers and the background loops (once; later calls do nothing).
pub fn start(app: &Arc<App>) {
    let q = &app.queue;
    if q.started.swap(true, Ordering::AcqRel) {
        return;
    }
    let cfg = &app.config.queue;
    let mut workers = lock(&q.workers);
    for _ in 0..cfg.workers.max(1) {
        workers.push(tokio::spawn(worker(
            app.clone(),
            q.rx.clone(),
            q.stop.subscribe(),
        )));
    }
    let mut loops = lock(&q.loops);
    loops.push(tokio::spawn(sweep_loop(app.clone())).abort_handle());
    if cfg.dlq_retry_enabled {
        let every = Duration::from_secs(cfg.dlq_poll_interval_secs.max(1));
        loops.push(tokio::spawn(dlq_loop(app.clone(), every)).abort_handle());
    }
    if cfg.trace_retention_hours > 0 {
        loops.push(tokio::spawn(retention_loop(app.clone())).abort_handle());
    }
}

/// Stops taking work, lets running traces finish for up to `drain`, then
/// cuts off what is left and hands those runs (and claimed jobs still queued)
/// back to `pending`, so the next start runs them without spending an attempt.
pub async fn shutdown(app: &App, drain: Duration) {
    let q = &app.queue;
    let _ = q.stop.send(true);
    for l in std::mem::take(&mut *lock(&q.loops)) {
        l.abort();
    }
    let mut workers = std::mem::take(&mut *lock(&q.workers));
    if tokio::time::timeout(drain, futures_util::future::join_all(workers.iter_mut()))
        .await
        .is_err()
    {
        tracing::warn!(
            "drain period ended with async traces still running; they go back to pending"
        );
        workers.iter().for_each(JoinHandle::abort);
        // An abort takes effect at the task's next poll: a worker running on
        // another thread may still record a claim it just made. Its end is
        // awaited (briefly) before the cut-off runs are read, so none is left
        // `running` until its lease runs out. Workers the first wait saw
        // end are not awaited again (a finished handle polled twice
        // panics: session 23, the service then exited 101 with its cut-off
        // runs still `running`).
        workers.retain(|w| !w.is_finished());
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            futures_util::future::join_all(workers),
        )
        .await;
    }
    // Queued jobs hold no claim (workers claim when they start a run): only
    // the runs cut off go back.
    let cut_off = std::mem::take(&mut *lock(&q.running));
    for (id, attempt) in cut_off {
        if let Err(e) = app.store.release_trace(&id, attempt).await {
            tracing::warn!(trace_id = %id, error = %e, "could not hand an unfinished trace back");
        }
    }
}

async fn worker(
    app: Arc<App>,
    rx: Arc<tokio::sync::Mutex<mpsc::Receiver<Job>>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let job = {
            let mut rx = rx.lock().await;
            tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => None,
                job = rx.recv() => job,
            }
        };
        let Some(job) = job else { break };
        match job {
            Job::Claim(id) => match app.store.claim_trace(&id, lease(&app)).await {
                Ok(Some(c)) => run_claimed(&app, c).await,
                // Taken by another worker or instance, finished, or deleted.
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(trace_id = %id, error = %e, "could not claim a trace; the sweep retries it");
                }
            },
            Job::Drain => {
                while !*stop.borrow() {
                    match app.store.claim_next_trace(lease(&app)).await {
                        Ok(Some(c)) => run_claimed(&app, c).await,
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!(error = %e, "trace sweep failed");
                            break;
                        }
                    }
                }
                app.queue.draining.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

/// Runs a trace this worker just claimed (recorded as running, so shutdown
/// can hand it back).
async fn run_claimed(app: &App, claimed: Claimed) {
    let id = claimed.trace_id.clone();
    lock(&app.queue.running).insert(id.clone(), claimed.attempt);
    // A run's own panic is a failed trace (`execute_guarded`); one outside
    // it (recording the outcome) leaves the trace to its lease and the
    // sweep, and the worker serving.
    let guarded = std::panic::AssertUnwindSafe(run(app, claimed));
    if futures_util::FutureExt::catch_unwind(guarded)
        .await
        .is_err()
    {
        tracing::error!(trace_id = %id, "recording a trace panicked; its lease expires and the sweep reruns it");
    }
    lock(&app.queue.running).remove(&id);
}

/// A poisoned lock only means a panic elsewhere; the maps stay usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The lease of one run: `queue.lease_secs`, but always longer than any
/// channel's timeout (a run ends by its timeout before its lease does, so a
/// live run is never reclaimed and run twice).
fn lease(app: &App) -> Duration {
    let longest = app
        .engine
        .load()
        .channels
        .values()
        .map(|c| c.timeout)
        .max()
        .unwrap_or_default();
    Duration::from_secs(app.config.queue.lease_secs).max(longest + Duration::from_secs(5))
}

fn error_item(code: &str, task_id: &str, message: &str) -> Json {
    json!({"code": code, "task_id": task_id, "message": message})
}

/// Adds a trace-level error (no task) to an outcome's `errors`.
fn push_error(errors: &mut Json, code: &str, message: &str) {
    let item = error_item(code, "", message);
    match errors {
        Json::Array(items) => items.push(item),
        other => *other = json!([item]),
    }
}

/// Counts a finished run in its channel's metrics, and a failed one in
/// `errors_total` by the code that failed it (an async run has no error
/// answer, which is what counts a sync failure there).
pub(crate) fn count_run(
    channel: &crate::engine::Channel,
    outcome: &Outcome,
    ok: bool,
    started: Instant,
) {
    let m = &channel.metrics;
    if ok {
        m.ok.increment(1)
    } else {
        // As on the sync path: `rejected` when the message was the
        // caller's problem (not JSON, no matching workflow, a failed
        // validation), `error` when the service failed it.
        if Code::is_callers(last_code(outcome)) {
            m.rejected.increment(1);
        } else {
            m.failed.increment(1);
        }
        count_failure(outcome);
    }
    m.duration.record(started.elapsed().as_secs_f64());
}

/// The code of a failed run's last error, the one that ended it.
fn last_code(outcome: &Outcome) -> &str {
    outcome
        .errors
        .as_array()
        .and_then(|items| items.last())
        .and_then(|item| item["code"].as_str())
        .unwrap_or(Code::InternalError.as_str())
}

/// `errors_total{type}` for a failed run: the code of its last error, the
/// one that ended it (earlier ones were collected and passed over).
pub(crate) fn count_failure(outcome: &Outcome) {
    // A halting validation's rules are `VALIDATION_ERROR` entries; the
    // failure is counted as the sync answer's code, `BAD_REQUEST`.
    let code = match last_code(outcome) {
        "VALIDATION_ERROR" => Code::BadRequest.as_str(),
        other => other,
    };
    metrics::counter!(crate::telemetry::names::ERRORS_TOTAL, "type" => code.to_owned())
        .increment(1);
}

/// A result nested deeper than the database's JSON check accepts is not
/// stored (the trace says why) rather than failing the write.
pub(crate) fn drop_unstorable_result(app: &App, outcome: &mut Outcome) {
    if let (Some(limit), Some(data)) = (app.store.json_depth(), &outcome.data)
        && !sluice_runtime::json::nests_within(data.as_bytes(), limit)
    {
        outcome.data = None;
        push_error(
            &mut outcome.errors,
            Code::InternalError.as_str(),
            &format!(
                "the result nests deeper than the {limit} levels the trace store keeps; it was not stored"
            ),
        );
    }
}

/// The most runs of one trace: its first and `queue.dlq_max_retries`
/// retries, and at least two, so a run cut off by a crash runs once more
/// even with no retries. Runs that ended without an outcome (a crash, a
/// lapsed lease) count: a trace whose run takes the process down stops
/// after that many restarts.
pub(crate) fn most_runs(config: &config::Queue) -> i64 {
    (i64::from(config.dlq_max_retries) + 1).max(2)
}

/// Runs one claimed trace and records its outcome.
async fn run(app: &App, c: Claimed) {
    let started = Instant::now();
    let mut snapshot = app.engine.load_full();
    // The replica that accepted the trace served its channel; this one may
    // not have caught up with it yet (its next check is up to
    // `engine.sync_interval_ms` away): catch up before calling it unknown.
    if snapshot
        .channels
        .get(&c.channel)
        .is_none_or(|channel| channel.plans.is_empty())
    {
        crate::sync::catch_up(app).await;
        snapshot = app.engine.load_full();
    }
    let mut outcome = Outcome {
        trace_id: c.trace_id.clone(),
        attempt: c.attempt,
        workflow_id: None,
        workflow_version: None,
        data: None,
        errors: Json::Array(Vec::new()),
        duration_ms: 0.0,
    };
    let most = most_runs(&app.config.queue);
    let ok = match snapshot.channels.get(&c.channel) {
        // Only runs that ended without an outcome get here (a failed run's
        // dead letter stops within the budget, and a run handed back at
        // shutdown gives its attempt back): cut off by a crash or a lapsed
        // lease, and a trace that takes the process down would otherwise do
        // so again at every restart.
        _ if c.attempt > most => {
            outcome.errors = json!([error_item(
                Code::InternalError.as_str(),
                "",
                &format!(
                    "not run again: this would be its run {}, and a trace runs at most \
                     {most} times (runs cut off by a crash or a lapsed lease count)",
                    c.attempt
                )
            )]);
            count_failure(&outcome);
            false
        }
        None => {
            outcome.errors = json!([error_item(
                Code::NotFound.as_str(),
                "",
                &format!("Channel '{}' not found", c.channel)
            )]);
            count_failure(&outcome);
            false
        }
        Some(channel) => {
            let ok = execute_guarded(app, channel, &c, &mut outcome).await;
            count_run(channel, &outcome, ok, started);
            ok
        }
    };
    outcome.duration_ms = exec::millis(started.elapsed());
    drop_unstorable_result(app, &mut outcome);
    let policy = Queue::retry_policy(&app.config.queue);
    let mut recorded = if ok {
        app.store.complete_trace(&outcome).await
    } else {
        app.store.fail_trace(&outcome, policy).await
    };
    if let Err(e) = &recorded {
        // The outcome could not be written as it is: record the failure
        // without the result, so the trace ends (through the dead-letter
        // retries) instead of running again each time its lease expires.
        tracing::error!(trace_id = %c.trace_id, error = %e, "could not record a trace outcome; recording it as failed without its result");
        outcome.data = None;
        push_error(
            &mut outcome.errors,
            Code::InternalError.as_str(),
            "the outcome could not be stored; see the service log",
        );
        recorded = app.store.fail_trace(&outcome, policy).await;
    }
    match recorded {
        Ok(true) if !ok => log_failure(&outcome, &c),
        Ok(true) => {
            tracing::debug!(trace_id = %c.trace_id, attempt = c.attempt, ok, "trace finished")
        }
        Ok(false) => tracing::info!(
            trace_id = %c.trace_id,
            attempt = c.attempt,
            "trace outcome discarded: the run lost its lease to a newer one"
        ),
        // The trace stays running until its lease expires; the sweep then reruns it.
        Err(e) => {
            tracing::error!(trace_id = %c.trace_id, error = %e, "could not record a trace outcome")
        }
    }
}

/// Members of stored metadata the runtime's `Meta` has fields for; any other
/// string member (a Kafka message's `key`, `topic`, ...) is passed as extra.
const META_FIELDS: &[&str] = &crate::data::METADATA_FIELDS;

/// Logs a failed run with its first error (async traces and Kafka
/// messages), at most ten failure lines a second.
pub(crate) fn log_failure(outcome: &Outcome, c: &Claimed) {
    let Some(left_out) = crate::api::failure_log_allowed() else {
        return;
    };
    let first = outcome.errors.as_array().and_then(|e| e.first());
    let field = |k: &str| first.and_then(|e| e[k].as_str()).unwrap_or("").to_owned();
    tracing::warn!(request_id = %request_id_of(c), trace_id = %c.trace_id, channel = %c.channel, attempt = c.attempt,
        code = %field("code"), task_id = %field("task_id"), error = %field("message"),
        left_out, "trace failed");
}

/// The request id a trace's run logs under: its request's, kept in the
/// stored metadata (a Kafka message's is its trace id).
fn request_id_of(c: &Claimed) -> String {
    #[derive(serde::Deserialize)]
    struct Stored {
        #[serde(default)]
        request_id: String,
    }
    serde_json::from_str::<Stored>(&c.metadata)
        .map(|m| m.request_id)
        .unwrap_or_default()
}

/// [`execute`], with a panic in the run turned into a failed run (an
/// `INTERNAL_ERROR`, dead-lettered like any failure): a panicking run must
/// never take its async worker or Kafka lane with it. (An async worker that
/// died left its trace `running` for good and the pool one worker short;
/// four such traces stopped the queue.)
pub(crate) async fn execute_guarded(
    app: &App,
    channel: &crate::engine::Channel,
    c: &Claimed,
    outcome: &mut Outcome,
) -> bool {
    // The run's log lines (a `log` task's, a connector's) carry the
    // request id and the trace id, as a request's lines carry its id
    // (spec: the request id is propagated through logs).
    let span = tracing::info_span!("trace", request_id = %request_id_of(c), trace_id = %c.trace_id);
    let run = std::panic::AssertUnwindSafe(tracing::Instrument::instrument(
        execute(app, channel, c, &mut *outcome),
        span,
    ));
    match futures_util::FutureExt::catch_unwind(run).await {
        Ok(ok) => {
            // An error text may quote a secret of the payload (an upstream
            // echoing what a task sent it): masked before it is stored or
            // logged. (The stored headers are masked already.)
            // The stored query holds what only the query rule calls secret
            // (`?sig=…`, `?code=…`), as the run needs it: masked here as a
            // sync request's failure is (audit 122).
            if let Some(errors) = outcome.errors.as_array_mut()
                && !errors.is_empty()
            {
                let meta: Json = serde_json::from_str(&c.metadata).unwrap_or(Json::Null);
                let query = crate::data::metadata_pairs(&meta, "query");
                let secrets =
                    crate::data::request_secrets(std::iter::empty(), &query, c.payload.as_bytes());
                for e in errors {
                    if let Some(Json::String(m)) = e.get_mut("message") {
                        *m = crate::connectors::mask_values(m, &secrets);
                    }
                }
            }
            ok
        }
        Err(_) => {
            tracing::error!(trace_id = %c.trace_id, channel = %c.channel, "a trace's run panicked");
            outcome.data = None;
            outcome.errors = json!([error_item(
                Code::InternalError.as_str(),
                "",
                "the run panicked"
            )]);
            false
        }
    }
}

/// Executes the trace on `channel`; fills `outcome` and says whether it succeeded.
pub(crate) async fn execute(
    app: &App,
    channel: &crate::engine::Channel,
    c: &Claimed,
    outcome: &mut Outcome,
) -> bool {
    let meta: Json = serde_json::from_str(&c.metadata).unwrap_or(Json::Null);
    let headers = crate::data::metadata_pairs(&meta, "headers");
    let query = crate::data::metadata_pairs(&meta, "query");
    let path = crate::data::metadata_pairs(&meta, "path");
    let (headers, query, path) = (
        crate::data::borrow_pairs(&headers),
        crate::data::borrow_pairs(&query),
        crate::data::borrow_pairs(&path),
    );
    let text = |k: &str| meta.get(k).and_then(Json::as_str).unwrap_or_default();
    let extra: Vec<(&str, &str)> = meta
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| !META_FIELDS.contains(&k.as_str()))
                .filter_map(|(k, v)| Some((k.as_str(), v.as_str()?)))
                .collect()
        })
        .unwrap_or_default();
    let input = Input {
        body: c.payload.as_bytes(),
        payload_from: PayloadFrom::Whole,
        meta: Meta {
            headers: &headers,
            query: &query,
            path: &path,
            method: text("method"),
            channel: &channel.name,
            request_id: text("request_id"),
            extra: &extra,
        },
        bucket: c.bucket,
    };
    let options = Options {
        deadline: Some(Instant::now() + channel.timeout),
        timer: Some(crate::data::deadline_timer),
        ..Options::default()
    };
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_owned())
    };
    let scope = CallScope {
        channel: channel.name.clone(),
        traceparent: header("traceparent"),
        tracestate: header("tracestate"),
        chain: vec![channel.name.clone()],
        observer: None,
    };
    // OpenTelemetry: one consumer span per async trace or Kafka message.
    let topic = meta.get("topic").and_then(Json::as_str);
    let traced = app.otel.as_ref().and_then(|o| {
        let name = match topic {
            Some(t) => format!("{t} process"),
            None => format!("{} process", channel.name),
        };
        o.begin(
            name,
            opentelemetry::trace::SpanKind::Consumer,
            scope.traceparent.as_deref(),
            scope.tracestate.as_deref(),
        )
        .map(|span| (o, span))
    });
    let mut scope = scope;
    let mut options = options;
    if let Some((_, span)) = &traced {
        scope.observer = Some(span.observer());
        options.record_tasks = true;
    } else if app.otel.is_some()
        && let Some(fresh) = crate::otel::unsampled_traceparent(scope.traceparent.as_deref())
    {
        // Not sampled: outbound calls say so (a fresh `-00` parent).
        scope.traceparent = Some(fresh);
        scope.tracestate = None;
    }
    channel.metrics.executions.increment(1);
    let run = exec::execute(
        channel.plans.iter().map(|p| &**p),
        input,
        &app.services,
        &scope,
        &options,
    );
    let result = tokio::time::timeout(channel.timeout + crate::data::DEADLINE_GRACE, run).await;
    if let Some((otel, mut span)) = traced {
        span.attribute("sluice.channel", channel.name.clone());
        span.attribute("sluice.trace_id", c.trace_id.clone());
        if let Some(t) = topic {
            span.attribute("messaging.destination.name", t.to_owned());
        }
        let (tasks, error) = match &result {
            Ok(Ok(e)) => (
                e.tasks.as_slice(),
                match &e.status {
                    Status::Failed(f) => {
                        Some(format!("task '{}' failed: {}", f.task_id, f.message))
                    }
                    _ => None,
                },
            ),
            Ok(Err(e)) => (&[][..], Some(e.to_string())),
            Err(_) => (&[][..], Some("timed out".to_owned())),
        };
        otel.finish(span, tasks, error.as_deref());
    }
    let execution = match result {
        Err(_) => {
            let message = format!(
                "channel '{}' did not finish within {} ms",
                channel.name,
                channel.timeout.as_millis()
            );
            outcome.errors = json!([error_item(Code::Timeout.as_str(), "", &message)]);
            return false;
        }
        Ok(Err(e)) => {
            outcome.errors = json!([error_item(Code::BadRequest.as_str(), "", &e.to_string())]);
            return false;
        }
        Ok(Ok(execution)) => execution,
    };
    let Some(matched) = &execution.matched else {
        let message = crate::data::unmatched_message(channel, Some(&execution));
        outcome.errors = json!([error_item(Code::NotFound.as_str(), "", &message)]);
        return false;
    };
    outcome.workflow_id = Some(matched.workflow_id.to_string());
    outcome.workflow_version = Some(matched.version);
    // Secrets never reach a stored trace (decisions.md, Masking).
    // As deep as an execution can build (serde_json alone stops at 128
    // levels, and the result was lost).
    outcome.data = sluice_runtime::json::to_serde(&execution.data, exec::MAX_NESTING)
        .ok()
        .map(|mut d| {
            sluice_compiler::validate::mask_secrets(&mut d);
            d.to_string()
        });
    let mut errors: Vec<Json> = execution
        .errors
        .iter()
        .map(|i| error_item(i.code, &i.task_id, &i.message))
        .collect();
    let ok = match &execution.status {
        Status::Completed | Status::Filtered => true,
        Status::Failed(f) => {
            let code = crate::data::failure_item_code(f.kind);
            if f.messages.is_empty() {
                errors.push(error_item(code, &f.task_id, &f.message));
            } else {
                errors.extend(f.messages.iter().map(|m| error_item(code, &f.task_id, m)));
            }
            false
        }
    };
    outcome.errors = Json::Array(errors);
    ok
}

/// Sets idle workers draining what storage holds as claimable (traces the
/// channel did not carry, leases that ran out): at most one `Drain` job per
/// worker is queued or running at a time, and each claims just before it runs.
async fn sweep_loop(app: Arc<App>) {
    let mut every = tokio::time::interval(SWEEP_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let q = &app.queue;
    loop {
        let woken = tokio::select! {
            _ = every.tick() => false,
            () = q.dropped.notified() => true,
        };
        while q.draining.load(Ordering::Acquire) < q.workers_count {
            q.draining.fetch_add(1, Ordering::AcqRel);
            let sent = if woken {
                // Hints were dropped: the channel is full of work, and the
                // drains go behind it, so workers turn to storage as soon
                // as they are through the hints.
                q.tx.send(Job::Drain).await.is_ok()
            } else {
                q.tx.try_send(Job::Drain).is_ok()
            };
            if !sent {
                // The channel is full of hints: the workers have work.
                q.draining.fetch_sub(1, Ordering::AcqRel);
                break;
            }
        }
    }
}

/// Moves due dead letters back to pending and offers them to the workers.
async fn dlq_loop(app: Arc<App>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        loop {
            match app
                .store
                .requeue_due_traces(REQUEUE_BATCH, Queue::retry_policy(&app.config.queue))
                .await
            {
                Ok(ids) => {
                    let full = ids.len() as i64 == REQUEUE_BATCH;
                    for id in ids {
                        tracing::info!(trace_id = %id, "retrying a failed trace from the dead-letter queue");
                        app.queue.notify(id);
                    }
                    if !full {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "dead-letter poll failed");
                    break;
                }
            }
        }
    }
}

async fn retention_loop(app: Arc<App>) {
    let mut tick = tokio::time::interval(RETENTION_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = delete_expired(&app.store, &app.config.queue).await {
            tracing::warn!(error = %e, "trace retention pass failed");
        }
    }
}

/// One retention pass: deletes finished traces created more than
/// `queue.trace_retention_hours` ago (0 keeps traces forever); work still to
/// run stays. Returns how many went.
pub async fn delete_expired(
    store: &Store,
    config: &config::Queue,
) -> Result<u64, crate::storage::StorageError> {
    if config.trace_retention_hours == 0 {
        return Ok(0);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let keep = Duration::from_secs(config.trace_retention_hours.saturating_mul(3600));
    let cutoff = i64::try_from(now.saturating_sub(keep).as_micros()).unwrap_or(i64::MAX);
    let n = store
        .delete_traces_before(cutoff, config.dlq_retry_enabled)
        .await?;
    if n > 0 {
        tracing::info!(deleted = n, "old traces deleted");
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failed async run counts in `errors_total` by the code that ended it.
    #[test]
    fn a_failed_run_counts_its_last_code() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let outcome = |errors: Json| Outcome {
            trace_id: "t".into(),
            attempt: 1,
            workflow_id: None,
            workflow_version: None,
            data: None,
            errors,
            duration_ms: 0.0,
        };
        metrics::with_local_recorder(&recorder, || {
            count_failure(&outcome(json!([
                {"code": "VALIDATION_ERROR", "task_id": "a", "message": "x"},
                {"code": "TIMEOUT", "task_id": "b", "message": "y"}
            ])));
            count_failure(&outcome(json!([])));
            // A halting validation counts as its sync answer would.
            count_failure(&outcome(json!([
                {"code": "VALIDATION_ERROR", "task_id": "v", "message": "z"}
            ])));
        });
        let text = handle.render();
        assert!(
            text.contains("errors_total{type=\"BAD_REQUEST\"} 1"),
            "{text}"
        );
        assert!(text.contains("errors_total{type=\"TIMEOUT\"} 1"), "{text}");
        assert!(
            text.contains("errors_total{type=\"INTERNAL_ERROR\"} 1"),
            "{text}"
        );
        assert!(!text.contains("VALIDATION_ERROR"), "{text}");
    }
}
