//! Async traces and their dead-letter queue: submission (`insert_pending`),
//! exclusive claiming of a run, the outcome of a run (`complete`, `fail`),
//! dead-letter retries, reads for the data plane and retention.
//!
//! How "a trace never runs twice at once" holds:
//! - a claim is one conditional UPDATE (`pending`, or `running` with an expired
//!   lease → `running`, `attempts + 1`) whose rows-affected is checked; the
//!   database serialises concurrent UPDATEs of one row, so exactly one claimer
//!   sees 1. On SQLite and PostgreSQL the claim is that UPDATE alone
//!   (`RETURNING` the claimed row); MariaDB reads the row after it, in the
//!   same transaction.
//!   Claiming "the next due trace" picks a row with `FOR UPDATE SKIP
//!   LOCKED` (PostgreSQL: in the claim's subqueries; MariaDB: in its
//!   transaction) so parallel sweepers take different rows instead of
//!   queueing on one; SQLite has one writer and needs no row lock;
//! - `attempts` doubles as a fencing token: a run records its outcome only
//!   `WHERE status = 'running' AND attempts = <its attempt>`, so a worker whose
//!   lease expired (and whose trace was reclaimed) cannot overwrite the newer run.

use serde_json::{Map, Value as Json};
use sqlx::{ColumnIndex, Decode, Row, Type};

use super::sql::build;
use super::{
    Backend, BeginWrite, Pools, StorageError, Store, dispatch, dispatch_write, execute, fetch_all,
    fetch_one, fetch_optional, now_micros, parse_json, retry, retry_at_most, rfc3339,
};

/// Where a trace is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceStatus {
    Pending,
    Running,
    Completed,
    Failed,
}

impl TraceStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TraceStatus::Pending => "pending",
            TraceStatus::Running => "running",
            TraceStatus::Completed => "completed",
            TraceStatus::Failed => "failed",
        }
    }
    pub fn parse(s: &str) -> Option<TraceStatus> {
        match s {
            "pending" => Some(TraceStatus::Pending),
            "running" => Some(TraceStatus::Running),
            "completed" => Some(TraceStatus::Completed),
            "failed" => Some(TraceStatus::Failed),
            _ => None,
        }
    }
}

/// A submission to store as `pending`. `payload` and `metadata` are JSON text;
/// the caller masks `metadata` (headers) before it gets here.
#[derive(Debug, Clone)]
pub struct NewTrace {
    pub trace_id: String,
    pub channel: String,
    pub mode: String,
    pub bucket: Option<u8>,
    pub payload: String,
    pub metadata: String,
    /// Microseconds since the epoch (the caller's clock, so tests can age traces).
    pub created_at: i64,
}

/// What a worker needs to run a claimed trace.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub trace_id: String,
    pub channel: String,
    /// This run's number (1 for the first); the fencing token for its outcome.
    pub attempt: i64,
    pub bucket: Option<u8>,
    pub payload: String,
    pub metadata: String,
}

/// The outcome of one run, recorded by `complete` or `fail`.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub trace_id: String,
    pub attempt: i64,
    pub workflow_id: Option<String>,
    pub workflow_version: Option<i64>,
    /// The final `data` as JSON text (`None`: nothing ran).
    pub data: Option<String>,
    /// `[{code, task_id, message}]`.
    pub errors: Json,
    pub duration_ms: f64,
}

/// When a failed trace is retried from the dead-letter queue.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Retries after the first run (`queue.dlq_max_retries`).
    pub max_retries: u32,
    /// The first retry's delay; each further retry doubles it (capped).
    pub base_delay_secs: u64,
}

/// Backoff is capped so a long retry budget still retries within the day.
pub const MAX_RETRY_DELAY_SECS: u64 = 3600;

impl RetryPolicy {
    /// The delay before the retry that follows run number `attempts`, or `None`
    /// when the retry budget is spent (`attempts - 1` retries already ran).
    pub fn delay_after(&self, attempts: i64) -> Option<std::time::Duration> {
        let retries_done = u64::try_from(attempts.saturating_sub(1)).unwrap_or(0);
        if retries_done >= u64::from(self.max_retries) {
            return None;
        }
        let factor = 1u64 << retries_done.min(20);
        let secs = self
            .base_delay_secs
            .max(1)
            .saturating_mul(factor)
            .min(MAX_RETRY_DELAY_SECS);
        Some(std::time::Duration::from_secs(secs))
    }
}

/// A dead-letter entry: `waiting` for `next_retry_at`, or `exhausted`.
#[derive(Debug, Clone, PartialEq)]
pub struct DlqEntry {
    pub trace_id: String,
    pub state: String,
    pub attempts: i64,
    pub next_retry_at: Option<i64>,
    pub last_error: String,
}

/// One stored trace, as the data plane shows it (payload and metadata are
/// never shown).
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub trace_id: String,
    pub channel: String,
    pub mode: String,
    pub status: TraceStatus,
    pub workflow_id: Option<String>,
    pub workflow_version: Option<i64>,
    pub data: Option<Json>,
    pub errors: Json,
    pub created_at: i64,
    pub started_at: Option<i64>,
    pub completed_at: Option<i64>,
    pub duration_ms: Option<f64>,
    pub attempts: i64,
    /// When a failed trace's dead letter is due to run again (`None`: no
    /// retry is scheduled; the failure is final, or retries are off).
    pub next_retry_at: Option<i64>,
}

impl Trace {
    /// The record of decisions.md: `{trace_id, channel, mode, status,
    /// workflow_id, workflow_version, data, errors, created_at, started_at,
    /// completed_at, duration_ms, attempts}` (absent values are `null`),
    /// and `next_retry_at`: when a `failed` trace runs again (its dead
    /// letter is due), `null` when the failure is final.
    pub fn to_json(&self) -> Json {
        let time = |t: Option<i64>| t.map_or(Json::Null, |t| rfc3339(t).into());
        let mut m = Map::new();
        m.insert("trace_id".into(), self.trace_id.clone().into());
        m.insert("channel".into(), self.channel.clone().into());
        m.insert("mode".into(), self.mode.clone().into());
        m.insert("status".into(), self.status.as_str().into());
        m.insert("workflow_id".into(), self.workflow_id.clone().into());
        m.insert("workflow_version".into(), self.workflow_version.into());
        m.insert("data".into(), self.data.clone().unwrap_or(Json::Null));
        m.insert("errors".into(), self.errors.clone());
        m.insert("created_at".into(), time(Some(self.created_at)));
        m.insert("started_at".into(), time(self.started_at));
        m.insert("completed_at".into(), time(self.completed_at));
        m.insert("duration_ms".into(), self.duration_ms.into());
        m.insert("attempts".into(), self.attempts.into());
        let retry = self
            .next_retry_at
            .filter(|_| self.status == TraceStatus::Failed);
        m.insert("next_retry_at".into(), time(retry));
        Json::Object(m)
    }
}

/// Filters and page of `list_traces`.
#[derive(Debug, Clone)]
pub struct TraceQuery {
    pub status: Option<TraceStatus>,
    pub channel: Option<String>,
    pub mode: Option<String>,
    pub limit: i64,
    pub offset: i64,
}

impl Default for TraceQuery {
    fn default() -> Self {
        TraceQuery {
            status: None,
            channel: None,
            mode: None,
            limit: 50,
            offset: 0,
        }
    }
}

/// Columns of a `Trace` in the order `trace_from_row` reads them.
const TRACE: &str = "trace_id, channel, mode, status, workflow_id, workflow_version, data, errors, \
                     created_at, started_at, completed_at, duration_ms, attempts, \
                     (SELECT d.next_retry_at FROM trace_dlq d \
                      WHERE d.trace_id = traces.trace_id AND d.state = 'waiting')";
/// Columns of a `Claimed` in the order `claimed_from_row` reads them.
const CLAIMED: &str = "trace_id, channel, attempts, bucket, payload, metadata";
/// A submission waiting to be stored with others (see `Store::insert_grouped`).
pub(crate) struct QueuedInsert {
    trace: NewTrace,
    done: tokio::sync::oneshot::Sender<Result<(), StorageError>>,
}

/// The most submissions stored by one statement (seven values each).
const INSERT_GROUP: usize = 64;
/// The most payload and metadata bytes a group statement carries (a
/// submission larger than that goes alone); MariaDB's statement limit
/// lowers it.
const INSERT_GROUP_BYTES: usize = 1 << 20;
const INSERT_HEAD: &str = "INSERT INTO traces \
    (trace_id, channel, mode, status, bucket, payload, metadata, errors, attempts, created_at) VALUES ";
const INSERT_ROW: &str = "(?, ?, ?, 'pending', ?, ?, ?, '[]', 0, ?)";
const INSERT_MORE: &str = ", (?, ?, ?, 'pending', ?, ?, ?, '[]', 0, ?)";

/// Expands `$body` with `$pool` bound to the pool submissions are stored
/// through: on SQLite its writer connection, else the pool.
macro_rules! on_writer {
    ($store:expr, $pool:ident => $body:expr) => {{
        match &$store.inner.pools {
            Pools::Sqlite(pool) => {
                let $pool = $store.inner.sqlite_writer.as_ref().unwrap_or(pool);
                $body
            }
            Pools::Postgres($pool) => $body,
            Pools::MySql($pool) => $body,
        }
    }};
}

/// The queue of submissions; a poisoned lock only means a panic elsewhere.
fn queue(m: &std::sync::Mutex<Vec<QueuedInsert>>) -> std::sync::MutexGuard<'_, Vec<QueuedInsert>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a claim sets; binds the start and the lease's end.
const CLAIM_SET: &str = "UPDATE traces SET status = 'running', attempts = attempts + 1, started_at = ?, \
                         lease_until = ?, completed_at = NULL, duration_ms = NULL";
/// A trace a worker may take: waiting, or running under an expired lease.
const CLAIMABLE: &str = "(status = 'pending' OR (status = 'running' AND lease_until < ?))";

/// The statements of this module, built once per backend with the store's others.
pub(crate) struct TraceSql {
    insert: String,
    /// `insert` unless the trace is stored already.
    insert_once: String,
    insert_finished: String,
    claim: String,
    /// The oldest running trace whose lease has expired (a crashed run).
    next_expired: String,
    /// The oldest pending trace.
    next_pending: String,
    claimed_row: String,
    /// SQLite and PostgreSQL: `claim` and `claimed_row` in one statement.
    claim_returning: String,
    /// SQLite and PostgreSQL: `next_expired`, `next_pending`, `claim` and
    /// `claimed_row` in one statement.
    claim_next_returning: String,
    complete: String,
    fail: String,
    release: String,
    dlq_delete: String,
    dlq_exhaust: String,
    dlq_insert: String,
    dlq_due: String,
    requeue: String,
    dlq_get: String,
    get: String,
    page: String,
    count: String,
    /// Finished traces created before a cutoff, and their dead letters:
    /// with dead-letter retries on, a failed trace whose retry is still
    /// waiting is not finished (`_waiting`: retries off, it is).
    delete_older: String,
    dlq_delete_older: String,
    delete_older_waiting: String,
    dlq_delete_older_waiting: String,
}

impl TraceSql {
    pub(crate) fn new(b: Backend) -> TraceSql {
        // Parallel sweepers skip rows another one holds instead of queueing on them.
        let skip_locked = if b == Backend::Sqlite {
            ""
        } else {
            " FOR UPDATE SKIP LOCKED"
        };
        let f = |s: &str| build(b, &s.replace("{claimable}", CLAIMABLE));
        let filter = "WHERE (? IS NULL OR status = ?) AND (? IS NULL OR channel = ?) AND (? IS NULL OR mode = ?)";
        TraceSql {
            insert: f(
                "INSERT INTO traces (trace_id, channel, mode, status, bucket, payload, metadata, errors, attempts, created_at) \
                 VALUES (?, ?, ?, 'pending', ?, ?, ?, '[]', 0, ?)",
            ),
            insert_once: f(&format!(
                "{INSERT_HEAD}{INSERT_ROW} {}",
                if b == Backend::MySql {
                    // Not `INSERT IGNORE`, which would also store a value
                    // it had to truncate.
                    "ON DUPLICATE KEY UPDATE trace_id = trace_id"
                } else {
                    "ON CONFLICT (trace_id) DO NOTHING"
                }
            )),
            insert_finished: f(
                "INSERT INTO traces (trace_id, channel, mode, status, bucket, payload, metadata, workflow_id, \
                 workflow_version, data, errors, attempts, created_at, started_at, completed_at, duration_ms) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?)",
            ),
            claim: f(&format!("{CLAIM_SET} WHERE trace_id = ? AND {{claimable}}")),
            // Two statements, not one over `{claimable}`: an `OR` of two
            // statuses cannot walk the `(status, created_at)` index in
            // order, so every claim sorted all pending traces (37 ms each
            // with 27,000 pending on SQLite: a backlog drained at about
            // 30 traces a second). Each of these reads the index from its
            // start. MariaDB runs them in its claim's transaction; the
            // other backends as the two parts of `claim_next_returning`.
            // The expired read is a plain read (the claim's update checks
            // the lease again): on MariaDB a locking read of the `running`
            // range takes gap locks that deadlock with claims moving rows
            // into it.
            // They read the claimed row's columns too, so MariaDB's claim
            // needs no read after its update.
            next_expired: f(&format!(
                "SELECT {CLAIMED} FROM traces WHERE status = 'running' AND lease_until < ? \
                 ORDER BY created_at, trace_id LIMIT 1"
            )),
            next_pending: f(&format!(
                "SELECT {CLAIMED} FROM traces WHERE status = 'pending' \
                 ORDER BY created_at, trace_id LIMIT 1{skip_locked}"
            )),
            claimed_row: f(&format!("SELECT {CLAIMED} FROM traces WHERE trace_id = ?")),
            // Every statement is a round trip (on SQLite to the connection's
            // own thread, on the servers over the network, each waking the
            // server's process), and a transaction of four statements cost
            // four: on SQLite and PostgreSQL a claim is one statement,
            // atomic by itself. (MariaDB has no `UPDATE … RETURNING`.)
            claim_returning: f(&format!(
                "{CLAIM_SET} WHERE trace_id = ? AND {{claimable}} RETURNING {CLAIMED}"
            )),
            // On PostgreSQL the two reads lock the row they return and skip
            // rows another claimer holds (a scalar subquery runs once, and
            // `COALESCE` reads the second only when the first found none).
            claim_next_returning: f(&format!(
                "{CLAIM_SET} WHERE trace_id = COALESCE(\
                 (SELECT trace_id FROM traces WHERE status = 'running' AND lease_until < ? \
                 ORDER BY created_at, trace_id LIMIT 1{skip_locked}), \
                 (SELECT trace_id FROM traces WHERE status = 'pending' \
                 ORDER BY created_at, trace_id LIMIT 1{skip_locked})) \
                 RETURNING {CLAIMED}"
            )),
            complete: f(
                "UPDATE traces SET status = 'completed', workflow_id = ?, workflow_version = ?, data = ?, errors = ?, \
                 completed_at = ?, duration_ms = ?, lease_until = NULL \
                 WHERE trace_id = ? AND status = 'running' AND attempts = ?",
            ),
            fail: f(
                "UPDATE traces SET status = 'failed', workflow_id = ?, workflow_version = ?, data = ?, errors = ?, \
                 completed_at = ?, duration_ms = ?, lease_until = NULL \
                 WHERE trace_id = ? AND status = 'running' AND attempts = ?",
            ),
            // Shutdown hands an unfinished run back: it does not count as an attempt.
            release: f(
                "UPDATE traces SET status = 'pending', attempts = attempts - 1, started_at = NULL, lease_until = NULL \
                 WHERE trace_id = ? AND status = 'running' AND attempts = ?",
            ),
            dlq_delete: f("DELETE FROM trace_dlq WHERE trace_id = ?"),
            dlq_exhaust: f(
                "UPDATE trace_dlq SET state = 'exhausted', next_retry_at = NULL WHERE trace_id = ?",
            ),
            dlq_insert: f(
                "INSERT INTO trace_dlq (trace_id, state, attempts, next_retry_at, last_error, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            ),
            dlq_due: f(&format!(
                "SELECT trace_id, attempts FROM trace_dlq WHERE state = 'waiting' AND next_retry_at <= ? \
                 ORDER BY next_retry_at, trace_id LIMIT ?{skip_locked}"
            )),
            // A retry waits like a new submission (no run times), keeping the
            // failed attempt's `data` and `errors` until the next outcome.
            requeue: f(
                "UPDATE traces SET status = 'pending', lease_until = NULL, started_at = NULL, \
                 completed_at = NULL, duration_ms = NULL WHERE trace_id = ? AND status = 'failed'",
            ),
            dlq_get: f(
                "SELECT trace_id, state, attempts, next_retry_at, last_error FROM trace_dlq WHERE trace_id = ?",
            ),
            get: f(&format!("SELECT {TRACE} FROM traces WHERE trace_id = ?")),
            page: f(&format!(
                "SELECT {TRACE} FROM traces {filter} ORDER BY created_at DESC, trace_id DESC LIMIT ? OFFSET ?"
            )),
            count: f(&format!("SELECT COUNT(*) FROM traces {filter}")),
            delete_older: f(
                "DELETE FROM traces WHERE COALESCE(completed_at, created_at) < ? AND (status = 'completed' OR \
                 (status = 'failed' AND NOT EXISTS (SELECT 1 FROM trace_dlq d \
                 WHERE d.trace_id = traces.trace_id AND d.state = 'waiting')))",
            ),
            dlq_delete_older: f(
                "DELETE FROM trace_dlq WHERE state <> 'waiting' AND trace_id IN \
                 (SELECT trace_id FROM traces WHERE COALESCE(completed_at, created_at) < ? AND status = 'failed')",
            ),
            delete_older_waiting: f(
                "DELETE FROM traces WHERE COALESCE(completed_at, created_at) < ? AND status IN ('completed', 'failed')",
            ),
            dlq_delete_older_waiting: f("DELETE FROM trace_dlq WHERE trace_id IN \
                 (SELECT trace_id FROM traces WHERE COALESCE(completed_at, created_at) < ? AND status = 'failed')"),
        }
    }
}

/// Reads the `TRACE` columns. Text is read unchecked: MariaDB flags
/// utf8mb4_bin text as BINARY (see lifecycle.rs).
fn trace_from_row<R: Row>(row: &R) -> Result<Trace, StorageError>
where
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> f64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
{
    let text = |i: usize| {
        row.try_get_unchecked::<String, usize>(i)
            .map_err(super::db_err)
    };
    let opt_text = |i: usize| {
        row.try_get_unchecked::<Option<String>, usize>(i)
            .map_err(super::db_err)
    };
    let opt_int = |i: usize| row.try_get::<Option<i64>, usize>(i).map_err(super::db_err);
    let status = text(3)?;
    Ok(Trace {
        trace_id: text(0)?,
        channel: text(1)?,
        mode: text(2)?,
        status: TraceStatus::parse(&status)
            .ok_or_else(|| StorageError::Database(format!("unknown trace status '{status}'")))?,
        workflow_id: opt_text(4)?,
        workflow_version: opt_int(5)?,
        // A result may nest as deep as an execution can build.
        data: opt_text(6)?
            .map(|t| {
                sluice_runtime::json::to_serde(t.as_bytes(), sluice_runtime::exec::MAX_NESTING)
                    .map_err(|e| StorageError::Database(format!("stored JSON is invalid: {e}")))
            })
            .transpose()?,
        errors: parse_json(&text(7)?)?,
        created_at: row.try_get(8).map_err(super::db_err)?,
        started_at: opt_int(9)?,
        completed_at: opt_int(10)?,
        duration_ms: row
            .try_get::<Option<f64>, usize>(11)
            .map_err(super::db_err)?,
        attempts: row.try_get(12).map_err(super::db_err)?,
        next_retry_at: opt_int(13)?,
    })
}

/// Reads the `CLAIMED` columns.
fn claimed_from_row<R: Row>(row: &R) -> Result<Claimed, StorageError>
where
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
{
    let text = |i: usize| {
        row.try_get_unchecked::<String, usize>(i)
            .map_err(super::db_err)
    };
    let bucket: Option<i64> = row.try_get(3).map_err(super::db_err)?;
    Ok(Claimed {
        trace_id: text(0)?,
        channel: text(1)?,
        attempt: row.try_get(2).map_err(super::db_err)?,
        bucket: bucket.and_then(|b| u8::try_from(b).ok()),
        payload: text(4)?,
        metadata: text(5)?,
    })
}

fn error_summary(errors: &Json) -> String {
    errors
        .as_array()
        .and_then(|e| e.last())
        .map(|e| {
            let code = e.get("code").and_then(Json::as_str).unwrap_or("ERROR");
            let message = e.get("message").and_then(Json::as_str).unwrap_or("");
            format!("{code}: {message}")
        })
        .unwrap_or_else(|| "failed".into())
}

impl Store {
    /// Stores a submission as `pending` (the caller then hands the id to a worker).
    pub async fn insert_pending(&self, t: &NewTrace) -> Result<(), StorageError> {
        self.fits_one_statement("request", t.payload.len() + t.metadata.len())?;
        let _timer = super::query_timer!();
        self.insert_grouped(t).await
    }

    /// The submissions that queue while a group is being stored are stored
    /// together, in one statement (up to [`INSERT_GROUP`] rows), by
    /// whichever of them gets the write gate first; each is answered when
    /// its row is committed. One at a time, every submission paid a
    /// statement and its commit: on SQLite the pages it touched (the
    /// table's and three indexes', about 16 KiB) written to the write-ahead
    /// log and a round trip to the connection's thread, on the server
    /// backends a round trip that wakes the server's process, and a pool
    /// connection held meanwhile (64 clients submitting kept the workers
    /// waiting for connections). A stream of submissions now pays them once
    /// per group.
    async fn insert_grouped(&self, t: &NewTrace) -> Result<(), StorageError> {
        let (done, mut answer) = tokio::sync::oneshot::channel();
        queue(&self.inner.submissions).push(QueuedInsert {
            trace: t.clone(),
            done,
        });
        // Answered by another submission's group while waiting: no need
        // for the gate any more.
        let gate = &self.inner.write_gate;
        let (_gate, taken) = tokio::select! {
            biased;
            answered = &mut answer => match answered {
                Ok(result) => return result,
                Err(_) => (gate.acquire().await, true),
            },
            permit = gate.acquire() => (permit, false),
        };
        loop {
            let state = if taken {
                Err(tokio::sync::oneshot::error::TryRecvError::Closed)
            } else {
                answer.try_recv()
            };
            match state {
                Ok(result) => return result,
                // Taken by a submission whose request was dropped while it
                // stored the group: stored or not, it is stored once now.
                Err(tokio::sync::oneshot::error::TryRecvError::Closed) => {
                    return self.insert_row(&self.sql().traces.insert_once, t).await;
                }
                // Still queued (behind more than a group of others).
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {}
            }
            let budget = self
                .definition_limit()
                .map_or(INSERT_GROUP_BYTES, |limit| limit.min(INSERT_GROUP_BYTES));
            let group: Vec<QueuedInsert> = {
                let mut queued = queue(&self.inner.submissions);
                let (mut n, mut bytes) = (0, 0);
                for q in queued.iter().take(INSERT_GROUP) {
                    bytes += q.trace.payload.len() + q.trace.metadata.len();
                    if n > 0 && bytes > budget {
                        break;
                    }
                    n += 1;
                }
                queued.drain(..n).collect()
            };
            if group.is_empty() {
                // Only the gate's holder takes from the queue, so a
                // submission not yet answered is still in it.
                return Err(StorageError::Database(
                    "a submission left the write queue unanswered".into(),
                ));
            }
            self.insert_group(group).await;
        }
    }

    /// Stores `group` in one statement and answers each submission; should
    /// the statement fail, each is stored on its own and gets its own
    /// answer. Submissions whose request is gone are left out.
    async fn insert_group(&self, mut group: Vec<QueuedInsert>) {
        group.retain(|q| !q.done.is_closed());
        if group.is_empty() {
            return;
        }
        let mut sql = String::from(INSERT_HEAD);
        for i in 0..group.len() {
            sql.push_str(if i == 0 { INSERT_ROW } else { INSERT_MORE });
        }
        let sql = build(self.inner.backend, &sql);
        // Not tried again: should it fail, the rows are (see below).
        let stored = async {
            on_writer!(self, pool => {
                let mut query = sqlx::query(&sql);
                for q in &group {
                    let t = &q.trace;
                    query = query
                        .bind(&t.trace_id)
                        .bind(&t.channel)
                        .bind(&t.mode)
                        .bind(t.bucket.map(i64::from))
                        .bind(&t.payload)
                        .bind(&t.metadata)
                        .bind(t.created_at);
                }
                query.execute(pool).await.map(drop).map_err(super::db_err)
            })
        }
        .await;
        match stored {
            Ok(()) => {
                for q in group {
                    let _ = q.done.send(Ok(()));
                }
                return;
            }
            // A database that cannot be reached refuses every row alike:
            // one answer for all, rather than a timeout per row while the
            // submissions behind them wait for the gate.
            Err(StorageError::Unavailable(why)) => {
                for q in group {
                    let _ = q.done.send(Err(StorageError::Unavailable(why.clone())));
                }
                return;
            }
            Err(e) => tracing::debug!(error = %e, rows = group.len(),
                "a group of submissions was refused; storing them one by one"),
        }
        // Once each: what refused the group (a duplicate id, a value the
        // database refuses) refuses that row again, and the others are
        // stored; a lost race (a deadlock) is tried again row by row.
        for q in group {
            if q.done.is_closed() {
                continue;
            }
            let result = self.insert_row(&self.sql().traces.insert, &q.trace).await;
            let _ = q.done.send(result);
        }
    }

    /// Stores one submission with `sql` (`insert` or `insert_once`). On
    /// SQLite once: the gate is held, and nothing else writes meanwhile.
    async fn insert_row(&self, sql: &str, t: &NewTrace) -> Result<(), StorageError> {
        let tries = if self.inner.backend == Backend::Sqlite {
            1
        } else {
            5
        };
        retry_at_most(tries, || async {
            on_writer!(self, pool => {
                execute!(
                    pool,
                    sql,
                    &t.trace_id,
                    &t.channel,
                    &t.mode,
                    t.bucket.map(i64::from),
                    &t.payload,
                    &t.metadata,
                    t.created_at
                )
                .map(drop)
            })
        })
        .await
    }

    /// Claims `trace_id` for a run if it is pending (or running under an expired
    /// lease): `running`, `attempts + 1`, leased for `lease`. `None` when another
    /// worker has it or it is finished or gone.
    pub async fn claim_trace(
        &self,
        trace_id: &str,
        lease: std::time::Duration,
    ) -> Result<Option<Claimed>, StorageError> {
        let s = &self.sql().traces;
        retry(|| async {
            let now = now_micros();
            let until = lease_end(now, lease);
            dispatch_write!(self, pool => {
                if self.inner.backend != Backend::MySql {
                    let row = fetch_optional!(pool, &s.claim_returning, now, until, trace_id, now)?;
                    return row.map(|row| claimed_from_row(&row)).transpose();
                }
                // MariaDB: the claim and the read of the claimed row in one
                // transaction, so a claim whose row could not be read is
                // undone rather than left running under a lease nobody holds.
                let mut tx = pool.begin_write().await?;
                if execute!(&mut *tx, &s.claim, now, until, trace_id, now)? != 1 {
                    return Ok(None);
                }
                let claimed = claimed_from_row(&fetch_one!(&mut *tx, &s.claimed_row, trace_id)?)?;
                tx.commit().await.map_err(super::db_err)?;
                Ok(Some(claimed))
            })
        })
        .await
    }

    /// Claims the oldest claimable trace, if any (the sweep after a restart or
    /// a full queue). Rows another transaction holds are skipped.
    pub async fn claim_next_trace(
        &self,
        lease: std::time::Duration,
    ) -> Result<Option<Claimed>, StorageError> {
        let s = &self.sql().traces;
        retry(|| async {
            let now = now_micros();
            let until = lease_end(now, lease);
            dispatch_write!(self, pool => {
                if self.inner.backend != Backend::MySql {
                    let row = fetch_optional!(pool, &s.claim_next_returning, now, until, now)?;
                    return row.map(|row| claimed_from_row(&row)).transpose();
                }
                let mut tx = pool.begin_write().await?;
                // Runs a crash left behind first: they are older than what
                // is pending behind them.
                let row = match fetch_optional!(&mut *tx, &s.next_expired, now)? {
                    Some(row) => row,
                    None => match fetch_optional!(&mut *tx, &s.next_pending)? {
                        Some(row) => row,
                        None => return Ok(None),
                    },
                };
                let mut claimed = claimed_from_row(&row)?;
                if execute!(&mut *tx, &s.claim, now, until, &claimed.trace_id, now)? != 1 {
                    // Another sweeper took it (parallel drains read the same
                    // oldest expired run): look again in a new transaction,
                    // rather than end this drain with work left.
                    return Err(super::lost_race());
                }
                // The update counted the row as it was read: a pending row
                // is locked since, and an expired one was still claimable
                // (a claim in between would have moved its lease; one
                // handed back by a shutdown gives its attempt back).
                claimed.attempt += 1;
                tx.commit().await.map_err(super::db_err)?;
                Ok(Some(claimed))
            })
        })
        .await
    }

    /// Records a successful run. `false` when the run no longer owns the trace
    /// (its lease expired and another run took over); nothing is written then.
    pub async fn complete_trace(&self, o: &Outcome) -> Result<bool, StorageError> {
        let s = &self.sql().traces;
        let errors = o.errors.to_string();
        retry(|| async {
            let now = now_micros();
            dispatch_write!(self, pool => {
                if o.attempt == 1 {
                    // A first run has no dead letter: one is written only
                    // when an attempt fails, and the trace runs again only
                    // after a requeue that deletes it (as attempt 2 on).
                    let n = execute!(pool, &s.complete, &o.workflow_id, o.workflow_version, &o.data, &errors,
                        now, o.duration_ms, &o.trace_id, o.attempt)?;
                    return Ok(n == 1);
                }
                let mut tx = pool.begin_write().await?;
                let n = execute!(&mut *tx, &s.complete, &o.workflow_id, o.workflow_version, &o.data, &errors,
                    now, o.duration_ms, &o.trace_id, o.attempt)?;
                if n == 1 {
                    // A retry that succeeded leaves no dead letter behind.
                    execute!(&mut *tx, &s.dlq_delete, &o.trace_id)?;
                }
                tx.commit().await.map_err(super::db_err)?;
                Ok(n == 1)
            })
        })
        .await
    }

    /// Records a failed run and its dead letter: `waiting` with `next_retry_at`
    /// from `policy`, or `exhausted` once the retries are spent (the trace stays
    /// `failed` with these errors). `false` when the run no longer owns the trace.
    pub async fn fail_trace(&self, o: &Outcome, policy: RetryPolicy) -> Result<bool, StorageError> {
        let s = &self.sql().traces;
        let errors = o.errors.to_string();
        let last_error = error_summary(&o.errors);
        retry(|| async {
            let now = now_micros();
            let (state, next) = match policy.delay_after(o.attempt) {
                Some(d) => ("waiting", Some(lease_end(now, d))),
                None => ("exhausted", None),
            };
            dispatch_write!(self, pool => {
                let mut tx = pool.begin_write().await?;
                let n = execute!(&mut *tx, &s.fail, &o.workflow_id, o.workflow_version, &o.data, &errors,
                    now, o.duration_ms, &o.trace_id, o.attempt)?;
                if n == 1 {
                    execute!(&mut *tx, &s.dlq_delete, &o.trace_id)?;
                    execute!(&mut *tx, &s.dlq_insert, &o.trace_id, state, o.attempt, next, &last_error, now)?;
                }
                tx.commit().await.map_err(super::db_err)?;
                Ok(n == 1)
            })
        })
        .await
    }

    /// Stores a run that happened outside the queue (a consumed Kafka
    /// message) in its final state, as attempt 1, started at `started_at`. A
    /// failure with `dead_letter` also gets a dead-letter entry, so it is
    /// retried like a failed async trace.
    pub async fn insert_finished_trace(
        &self,
        t: &NewTrace,
        o: &Outcome,
        ok: bool,
        started_at: i64,
        dead_letter: Option<RetryPolicy>,
    ) -> Result<(), StorageError> {
        let s = &self.sql().traces;
        let errors = o.errors.to_string();
        let last_error = error_summary(&o.errors);
        let status = if ok { "completed" } else { "failed" };
        let bucket = t.bucket.map(i64::from);
        retry(|| async {
            let now = now_micros();
            let dlq = dead_letter
                .filter(|_| !ok)
                .map(|policy| match policy.delay_after(1) {
                    Some(d) => ("waiting", Some(lease_end(now, d))),
                    None => ("exhausted", None),
                });
            dispatch_write!(self, pool => {
                let mut tx = pool.begin_write().await?;
                execute!(&mut *tx, &s.insert_finished, &t.trace_id, &t.channel, &t.mode, status, bucket,
                    &t.payload, &t.metadata, &o.workflow_id, o.workflow_version, &o.data, &errors,
                    t.created_at, started_at, now, o.duration_ms)?;
                if let Some((state, next)) = dlq {
                    execute!(&mut *tx, &s.dlq_insert, &t.trace_id, state, 1i64, next, &last_error, now)?;
                }
                tx.commit().await.map_err(super::db_err)?;
            });
            Ok(())
        })
        .await
    }

    /// Hands an unfinished run back (shutdown): `pending` again, and the run
    /// does not count as an attempt.
    pub async fn release_trace(&self, trace_id: &str, attempt: i64) -> Result<(), StorageError> {
        let s = &self.sql().traces;
        retry(|| async {
            dispatch_write!(self, pool => {
                execute!(pool, &s.release, trace_id, attempt)?;
            });
            Ok(())
        })
        .await
    }

    /// Traces left `running` by a process that is gone, on a store no other
    /// process serves (SQLite: `serve` holds the file's lock, so nothing
    /// else can be running them): their leases end now and the first sweep
    /// runs them again, as it would once the lease ran out (the lost run
    /// counts as an attempt, as a lapsed lease's does). Returns how many.
    /// The server backends wait for the leases: another replica may hold them.
    pub async fn end_orphaned_leases(&self) -> Result<u64, StorageError> {
        if self.backend() != Backend::Sqlite {
            return Ok(0);
        }
        let ended;
        dispatch_write!(self, pool => {
            ended = execute!(
                pool,
                "UPDATE traces SET lease_until = 0 WHERE status = 'running'"
            )?;
        });
        Ok(ended)
    }

    /// Moves up to `limit` dead letters whose retry is due back to `pending` and
    /// returns their ids (the entry is removed; a new failure writes a new one).
    /// A due entry whose runs already spend `policy`'s budget (it was written
    /// under a larger `queue.dlq_max_retries`) becomes `exhausted` instead:
    /// a trace runs at most `1 + dlq_max_retries` times under the limit in
    /// force (audit 108: lowering it across a restart allowed one run more).
    pub async fn requeue_due_traces(
        &self,
        limit: i64,
        policy: RetryPolicy,
    ) -> Result<Vec<String>, StorageError> {
        let s = &self.sql().traces;
        retry(|| async {
            let now = now_micros();
            dispatch_write!(self, pool => {
                let mut tx = pool.begin_write().await?;
                let rows = fetch_all!(&mut *tx, &s.dlq_due, now, limit)?;
                let mut ids = Vec::with_capacity(rows.len());
                for row in &rows {
                    let id: String = row.try_get_unchecked(0).map_err(super::db_err)?;
                    let attempts: i64 = row.try_get_unchecked(1).map_err(super::db_err)?;
                    if policy.delay_after(attempts).is_none() {
                        execute!(&mut *tx, &s.dlq_exhaust, &id)?;
                        continue;
                    }
                    execute!(&mut *tx, &s.dlq_delete, &id)?;
                    if execute!(&mut *tx, &s.requeue, &id)? == 1 {
                        ids.push(id);
                    }
                }
                tx.commit().await.map_err(super::db_err)?;
                Ok(ids)
            })
        })
        .await
    }

    /// The dead-letter entry of a trace, if it has one.
    pub async fn dlq_entry(&self, trace_id: &str) -> Result<Option<DlqEntry>, StorageError> {
        let s = &self.sql().traces;
        dispatch!(self, pool => {
            let Some(row) = fetch_optional!(pool, &s.dlq_get, trace_id)? else {
                return Ok(None);
            };
            let text = |i: usize| row.try_get_unchecked::<String, usize>(i).map_err(super::db_err);
            Ok(Some(DlqEntry {
                trace_id: text(0)?,
                state: text(1)?,
                attempts: row.try_get(2).map_err(super::db_err)?,
                next_retry_at: row.try_get(3).map_err(super::db_err)?,
                last_error: text(4)?,
            }))
        })
    }

    /// One trace; NotFound with the spec's message form.
    pub async fn get_trace(&self, trace_id: &str) -> Result<Trace, StorageError> {
        let s = &self.sql().traces;
        dispatch!(self, pool => {
            match fetch_optional!(pool, &s.get, trace_id)? {
                Some(row) => trace_from_row(&row),
                None => Err(StorageError::NotFound(format!("Trace with id '{trace_id}' not found"))),
            }
        })
    }

    /// A page of traces, newest first (created_at, then id), and the total.
    pub async fn list_traces(&self, q: &TraceQuery) -> Result<(Vec<Trace>, i64), StorageError> {
        let s = &self.sql().traces;
        let status = q.status.map(TraceStatus::as_str);
        let (channel, mode) = (q.channel.as_deref(), q.mode.as_deref());
        dispatch!(self, pool => {
            let total: i64 = fetch_one!(pool, &s.count, status, status, channel, channel, mode, mode)?
                .try_get(0).map_err(super::db_err)?;
            let rows = fetch_all!(pool, &s.page, status, status, channel, channel, mode, mode, q.limit, q.offset)?;
            Ok((rows.iter().map(trace_from_row).collect::<Result<Vec<_>, _>>()?, total))
        })
    }

    /// Deletes traces finished before `cutoff` (microseconds), with
    /// their dead letters; returns how many traces went. A trace still to
    /// run (pending, running, or failed with a dead-letter retry waiting
    /// while `retries` are on) stays, however old: the service answered
    /// 202 for it (audit 123: a restart after a long outage deleted
    /// accepted work before it ran).
    pub async fn delete_traces_before(
        &self,
        cutoff: i64,
        retries: bool,
    ) -> Result<u64, StorageError> {
        let s = &self.sql().traces;
        let (dlq, traces) = if retries {
            (&s.dlq_delete_older, &s.delete_older)
        } else {
            (&s.dlq_delete_older_waiting, &s.delete_older_waiting)
        };
        retry(|| async {
            dispatch_write!(self, pool => {
                let mut tx = pool.begin_write().await?;
                // Explicit rather than relying on ON DELETE CASCADE alone, which
                // SQLite applies only while foreign keys are switched on.
                execute!(&mut *tx, dlq, cutoff)?;
                let n = execute!(&mut *tx, traces, cutoff)?;
                tx.commit().await.map_err(super::db_err)?;
                Ok(n)
            })
        })
        .await
    }
}

fn lease_end(now: i64, d: std::time::Duration) -> i64 {
    now.saturating_add(i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests;
