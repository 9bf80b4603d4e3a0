//! The engine snapshot: every active workflow's compiled plan, the channel
//! table, the REST route table and rollout ranges, built off to the side from
//! storage and swapped in with one `ArcSwap::store`. Start-up is a reload from
//! empty; a reload that fails leaves the previous snapshot serving.
//!
//! Requests load the snapshot once and keep it for their whole life, so a
//! reload never disturbs requests in flight.

use crate::storage::{ActiveRow, Kind, Record, Stamp, Status, StorageError, Store, StoredRecord};
use sluice_compiler::def::ChannelDef;
use sluice_compiler::diag::Diagnostic;
use sluice_compiler::logic::{self, Logic};
use sluice_compiler::plan::{Plan, Rollout, compile_stored_workflow};
use std::collections::HashMap;

/// Maps read on the request path (channel names, route literals): foldhash,
/// several times cheaper than SipHash on short keys. Keys come from the
/// admin API, not from requests, so flooding is not a concern.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// One channel as the data plane serves it.
#[derive(Debug)]
pub struct Channel {
    pub id: String,
    /// The stored definition text this channel was built from (a rebuild
    /// carries an unchanged channel over instead of parsing and building it
    /// again).
    source: Arc<str>,
    pub name: String,
    pub version: i64,
    pub def: ChannelDef,
    /// Candidate plans, by descending priority (then newest version first).
    pub plans: Vec<Arc<Plan>>,
    pub validation: Option<Logic>,
    /// Governance rules (`key_logic`s) compiled once per snapshot; their
    /// state lives in `App::governance`, which outlives snapshots.
    pub rules: crate::governance::Rules,
    pub timeout: Duration,
    pub is_async: bool,
    pub metrics: ChannelMetrics,
    /// The connector-call scope of a request without W3C trace context,
    /// built once (a request that carries `traceparent` builds its own).
    pub scope: sluice_runtime::connectors::CallScope,
}

/// Metric handles registered once per channel when the snapshot is built, so
/// the request path records without a registry lookup.
#[derive(Debug, Clone)]
pub struct ChannelMetrics {
    pub ok: metrics::Counter,
    pub failed: metrics::Counter,
    pub rejected: metrics::Counter,
    pub executions: metrics::Counter,
    pub duration: metrics::Histogram,
}

impl ChannelMetrics {
    fn new(channel: &str) -> Self {
        use crate::telemetry::names;
        let messages = |status: &'static str| metrics::counter!(names::MESSAGES_TOTAL, "channel" => channel.to_owned(), "status" => status);
        ChannelMetrics {
            ok: messages("ok"),
            failed: messages("error"),
            rejected: messages("rejected"),
            executions: metrics::counter!(names::CHANNEL_EXECUTIONS_TOTAL, "channel" => channel.to_owned()),
            duration: metrics::histogram!(names::MESSAGE_DURATION_SECONDS, "channel" => channel.to_owned()),
        }
    }
}

/// One segment of a route pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    Literal(String),
    Param(String),
}

#[derive(Debug)]
struct Route {
    segments: Vec<Seg>,
    methods: Vec<String>,
    priority: i64,
    literals: usize,
    channel: Arc<Channel>,
}

/// REST routes grouped by segment count, each group in match order
/// (priority, then specificity), and indexed by first segment: a request
/// only looks at the routes that start with its first segment or with a
/// parameter, however many channels there are.
#[derive(Debug, Default)]
pub struct RouteTable {
    by_len: FastMap<usize, Group>,
}

#[derive(Debug, Default)]
struct Group {
    routes: Vec<Route>,
    /// Positions in `routes` (ascending) of the routes whose first segment
    /// is this literal.
    by_first: FastMap<String, Vec<usize>>,
    /// Positions of the routes whose first segment is a parameter (or that
    /// have no segment).
    open_first: Vec<usize>,
}

/// A route match: the channel and the path parameters (names borrowed from
/// the table, values from the request's already-decoded segments).
pub struct RouteMatch<'s, 'p> {
    pub channel: &'s Arc<Channel>,
    pub params: smallvec::SmallVec<[(&'s str, &'p str); 4]>,
}

impl RouteTable {
    fn insert(&mut self, route: Route) {
        self.by_len
            .entry(route.segments.len())
            .or_default()
            .routes
            .push(route);
    }

    fn finish(&mut self) {
        for group in self.by_len.values_mut() {
            group.routes.sort_by(|a, b| {
                b.priority
                    .cmp(&a.priority)
                    .then(b.literals.cmp(&a.literals))
            });
            for (i, route) in group.routes.iter().enumerate() {
                match route.segments.first() {
                    Some(Seg::Literal(l)) => group.by_first.entry(l.clone()).or_default().push(i),
                    _ => group.open_first.push(i),
                }
            }
        }
    }

    /// Finds the route for `method` and `path` (the decoded segments after
    /// `/api/v1/data`).
    pub fn find<'s, 'p>(
        &'s self,
        method: &str,
        segments: &[&'p str],
    ) -> Option<RouteMatch<'s, 'p>> {
        let group = self.by_len.get(&segments.len())?;
        let literal: &[usize] = segments
            .first()
            .and_then(|first| group.by_first.get(*first))
            .map_or(&[], Vec::as_slice);
        // Both lists ascend: merge them to keep the group's match order.
        let (mut a, mut b) = (
            literal.iter().peekable(),
            group.open_first.iter().peekable(),
        );
        let candidates = std::iter::from_fn(|| match (a.peek(), b.peek()) {
            (Some(x), Some(y)) if x < y => a.next(),
            (Some(_), Some(_)) | (None, Some(_)) => b.next(),
            (Some(_), None) => a.next(),
            (None, None) => None,
        });
        candidates.map(|&i| &group.routes[i]).find_map(|route| {
            if !route.methods.iter().any(|m| m == method) {
                return None;
            }
            let mut params = smallvec::SmallVec::new();
            for (seg, part) in route.segments.iter().zip(segments) {
                match seg {
                    Seg::Literal(l) if l == part => {}
                    Seg::Literal(_) => return None,
                    Seg::Param(name) => params.push((name.as_str(), *part)),
                }
            }
            Some(RouteMatch {
                channel: &route.channel,
                params,
            })
        })
    }

    /// Every method some route takes on `segments` (for `Allow`).
    pub fn methods_at(&self, segments: &[&str]) -> Vec<&str> {
        let Some(group) = self.by_len.get(&segments.len()) else {
            return Vec::new();
        };
        group
            .routes
            .iter()
            .filter(|route| {
                route
                    .segments
                    .iter()
                    .zip(segments)
                    .all(|(seg, part)| match seg {
                        Seg::Literal(l) => l == part,
                        Seg::Param(_) => true,
                    })
            })
            .flat_map(|route| route.methods.iter().map(String::as_str))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.by_len.values().map(|g| g.routes.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_len.is_empty()
    }
}

/// Everything the data plane needs, immutable.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub generation: u64,
    pub built_at: Option<SystemTime>,
    /// What it serves (read through `Deref`): shared with the next snapshot
    /// when a reload finds every stored row unchanged.
    tables: Arc<Tables>,
}

/// The tables of a snapshot: everything built from the stored rows.
#[derive(Debug, Default)]
pub struct Tables {
    /// Channels by name.
    pub channels: FastMap<String, Arc<Channel>>,
    pub routes: RouteTable,
    /// Distinct workflow ids with at least one active version.
    pub active_workflows: usize,
    /// Compiled active workflow versions.
    pub workflows_loaded: usize,
    /// Every plan of this snapshot by workflow id and version, with the
    /// definition it was compiled from: the next build reuses a plan whose
    /// definition is unchanged instead of compiling it again.
    compiled: HashMap<(String, i64), CompiledPlan>,
    /// Every stored channel of this snapshot by id, with the text it was
    /// read as and its stamp: the next reload reuses the text of a channel
    /// whose stamp is unchanged instead of reading it again.
    channel_texts: HashMap<String, StoredText>,
}

impl std::ops::Deref for Snapshot {
    type Target = Tables;

    fn deref(&self) -> &Tables {
        &self.tables
    }
}

#[derive(Debug)]
struct StoredText {
    version: i64,
    stamp: Stamp,
    text: Arc<str>,
}

#[derive(Debug)]
struct CompiledPlan {
    /// The stored definition text and the server-managed fields the plan was
    /// compiled with (shared with the next snapshot, never copied).
    text: Arc<str>,
    status: Status,
    rollout_percentage: i64,
    updated_at: String,
    /// The stored row's stamp (a reload reads the text again only when it
    /// differs).
    stamp: Stamp,
    range: Rollout,
    /// The engine-schema `channel` label, if any.
    label: Option<String>,
    plan: Arc<Plan>,
}

impl CompiledPlan {
    fn compiled_from(&self, record: &StoredRecord, range: &Rollout) -> bool {
        self.status == record.status
            && self.rollout_percentage == record.rollout_percentage
            && self.range == *range
            && self.updated_at == record.updated_at
            && self.stamp.updated_us == record.stamp.updated_us
            // The plan's `source_id` (a digest filled in later is a new one).
            && self.stamp.same_identity(&record.stamp)
            && (Arc::ptr_eq(&self.text, &record.text) || *self.text == *record.text)
    }
}

impl Snapshot {
    /// Whether this snapshot serves the very tables of `other` (a reload
    /// that found nothing changed).
    #[doc(hidden)]
    pub fn shares_tables_with(&self, other: &Snapshot) -> bool {
        Arc::ptr_eq(&self.tables, &other.tables)
    }

    /// Everything this snapshot serves, as text (channels, their definitions
    /// and plans, routes in match order, plans with the definitions they were
    /// compiled from), without the generation and build time: a reload and a
    /// cold start over the same storage must give the same text.
    #[doc(hidden)]
    pub fn fingerprint(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "active_workflows {} loaded {}",
            self.active_workflows, self.workflows_loaded
        );
        let mut names: Vec<&String> = self.channels.keys().collect();
        names.sort();
        for name in names {
            let c = &self.channels[name];
            let _ = writeln!(
                out,
                "channel {name} id {} v{} timeout {:?} async {} source {}\n  def {:?}\n  validation {:?}",
                c.id, c.version, c.timeout, c.is_async, c.source, c.def, c.validation
            );
            for plan in &c.plans {
                let _ = writeln!(out, "  plan {plan:?}");
            }
        }
        let mut lens: Vec<&usize> = self.routes.by_len.keys().collect();
        lens.sort();
        for len in lens {
            for r in &self.routes.by_len[len].routes {
                let _ = writeln!(
                    out,
                    "route {:?} {:?} p{} -> {}",
                    r.segments, r.methods, r.priority, r.channel.name
                );
            }
        }
        let mut keys: Vec<&(String, i64)> = self.compiled.keys().collect();
        keys.sort();
        for key in keys {
            let c = &self.compiled[key];
            let _ = writeln!(
                out,
                "compiled {key:?} {:?} {} {} {:?} {:?} {}\n  {:?}",
                c.status, c.rollout_percentage, c.updated_at, c.range, c.label, c.text, c.plan
            );
        }
        out
    }
}

/// Why a reload failed: every definition that did not compile.
#[derive(Debug)]
pub enum ReloadError {
    Storage(StorageError),
    Invalid(Vec<Diagnostic>),
}

/// The outcome of a successful build.
pub struct Built {
    pub snapshot: Snapshot,
    pub elapsed: Duration,
    /// Workflow versions compiled by this build (the others were reused).
    pub compiled: usize,
}

/// Builds a snapshot from storage. Fails (building nothing) if any active
/// definition does not compile. Plans of `previous` whose definitions did
/// not change are reused.
///
/// The CPU part (compiling, indexing) runs on a thread of its own, not on a
/// runtime worker: requests keep being served while a large engine builds.
/// The service calls this through [`Reloader`], which runs the reading at
/// background priority too.
pub async fn build(
    store: &Store,
    generation: u64,
    previous: Arc<Snapshot>,
) -> Result<Built, ReloadError> {
    build_on(store, generation, previous, Assemble::OnItsOwnThread).await
}

/// Where [`build`] compiles and indexes.
#[derive(Clone, Copy)]
enum Assemble {
    /// On a thread started for it: the caller is a request worker.
    OnItsOwnThread,
    /// Right here: the caller is the reload thread, at background priority
    /// already.
    Here,
}

async fn build_on(
    store: &Store,
    generation: u64,
    previous: Arc<Snapshot>,
    at: Assemble,
) -> Result<Built, ReloadError> {
    let started = Instant::now();
    // First the active rows without their definitions; then the text of
    // only the rows whose stamp differs from what `previous` was built from.
    let workflows = read_active(store, Kind::Workflow, |row| {
        previous
            .compiled
            .get(&(row.id.clone(), row.version))
            .filter(|c| c.stamp.same(&row.stamp))
            .map(|c| c.text.clone())
    })
    .await
    .map_err(ReloadError::Storage)?;
    let channels = read_active(store, Kind::Channel, |row| {
        previous
            .channel_texts
            .get(&row.id)
            .filter(|c| c.version == row.version && c.stamp.same(&row.stamp))
            .map(|c| c.text.clone())
    })
    .await
    .map_err(ReloadError::Storage)?;
    // Every active row is one the previous snapshot was built from, with the
    // same stamp, and there is no other: its tables serve on, shared, under
    // the new generation (nothing to compile, index or free).
    if all_known(&workflows, previous.compiled.len())
        && all_known(&channels, previous.channel_texts.len())
    {
        let snapshot = Snapshot {
            generation,
            built_at: Some(SystemTime::now()),
            tables: previous.tables.clone(),
        };
        return Ok(Built {
            snapshot,
            elapsed: started.elapsed(),
            compiled: 0,
        });
    }
    let assemble_rows = move || {
        let workflows: Vec<StoredRecord> = workflows.into_iter().map(Row::into_stored).collect();
        let channels: Vec<StoredRecord> = channels.into_iter().map(Row::into_stored).collect();
        assemble(&workflows, &channels, generation, &previous)
    };
    let (snapshot, compiled) = match at {
        Assemble::Here => assemble_rows()?,
        Assemble::OnItsOwnThread => {
            let (tx, rx) = tokio::sync::oneshot::channel();
            std::thread::Builder::new()
                .name("sluice-reload".into())
                .stack_size(THREAD_STACK_BYTES)
                .spawn(move || {
                    background_priority();
                    let _ = tx.send(assemble_rows());
                })
                .map_err(|e| {
                    ReloadError::Storage(StorageError::Database(format!(
                        "cannot start the reload thread: {e}"
                    )))
                })?;
            rx.await.map_err(|_| {
                ReloadError::Storage(StorageError::Database("the reload thread panicked".into()))
            })??
        }
    };
    Ok(Built {
        snapshot,
        elapsed: started.elapsed(),
        compiled,
    })
}

/// The stack of every thread that walks definitions or data (runtime
/// workers, the reload thread): room for a context nested to the
/// executor's limit (`MAX_NESTING`, 2,048 levels) with frames to spare. The
/// release writer needs well under 0.5 MiB for it; an unoptimised build
/// keeps every inlined local in its own slot and needs over 16 MiB. Only the
/// pages a thread touches are committed.
pub const THREAD_STACK_BYTES: usize = if cfg!(debug_assertions) {
    64 << 20
} else {
    8 << 20
};

/// Builds snapshots on a thread of its own (`sluice-reload`), at background
/// priority ([`background_priority`]), with its own current-thread runtime
/// and its own database connection ([`Store::twin`]): a reload's reading
/// of stamps and definitions, decoding and comparing them, compiling and
/// indexing all run on time the request workers leave idle. (Reading on the
/// shared pool put about 3 ms of normal-priority work per reload of 1,000
/// workflows on the request core, the SQLite worker's and a request
/// worker's, and requests queued behind it; docs/benchmarks.md.)
///
/// Started on the first reload. An in-memory SQLite database has no second
/// connection: its reloads build on the caller's runtime, as does any reload
/// when the thread cannot be started or cannot open its connection.
#[derive(Default)]
pub struct Reloader {
    jobs: std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedSender<Job>>>,
}

struct Job {
    generation: u64,
    previous: Arc<Snapshot>,
    reply: tokio::sync::oneshot::Sender<Outcome>,
}

enum Outcome {
    Built(Result<Built, ReloadError>),
    /// The thread could not open its connection: the caller builds on its
    /// own runtime and the shared pool (as an in-memory database does).
    NoConnection(StorageError, Arc<Snapshot>),
}

impl Reloader {
    /// [`build`] on the reload thread (see the type's documentation).
    pub async fn build(
        &self,
        store: &Store,
        generation: u64,
        previous: Arc<Snapshot>,
    ) -> Result<Built, ReloadError> {
        let Some(jobs) = self.sender(store) else {
            return build(store, generation, previous).await;
        };
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = Job {
            generation,
            previous,
            reply,
        };
        if let Err(tokio::sync::mpsc::error::SendError(job)) = jobs.send(job) {
            return build(store, generation, job.previous).await;
        }
        match answer.await {
            Ok(Outcome::Built(built)) => built,
            Ok(Outcome::NoConnection(e, previous)) => {
                tracing::warn!(error = %e, "the reload thread cannot open its database connection; reloading on a request worker");
                build(store, generation, previous).await
            }
            Err(_) => Err(ReloadError::Storage(StorageError::Database(
                "the reload thread stopped".into(),
            ))),
        }
    }

    fn sender(&self, store: &Store) -> Option<tokio::sync::mpsc::UnboundedSender<Job>> {
        if !store.has_twin() {
            return None;
        }
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        if jobs.as_ref().is_none_or(|tx| tx.is_closed()) {
            *jobs = reload_thread(store.clone())
                .map_err(|e| tracing::warn!(error = %e, "cannot start the reload thread; reloading on a request worker"))
                .ok();
        }
        jobs.clone()
    }
}

/// The reload thread: serves jobs until every sender is gone (the `App` is
/// dropped). Its connection is opened on the first job; when that fails
/// (the database refuses one more connection, say), the job goes back to the
/// caller, and the next job tries again.
fn reload_thread(shared: Store) -> std::io::Result<tokio::sync::mpsc::UnboundedSender<Job>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("sluice-reload".into())
        .stack_size(THREAD_STACK_BYTES)
        .spawn(move || {
            background_priority();
            runtime.block_on(async move {
                let mut own: Option<Store> = None;
                while let Some(job) = rx.recv().await {
                    if own.is_none() {
                        match shared.twin().await {
                            Some(Ok(store)) => own = Some(store),
                            Some(Err(e)) => {
                                let _ = job.reply.send(Outcome::NoConnection(e, job.previous));
                                continue;
                            }
                            None => {}
                        }
                    }
                    let store = own.as_ref().unwrap_or(&shared);
                    let built = build_on(store, job.generation, job.previous, Assemble::Here).await;
                    let _ = job.reply.send(Outcome::Built(built));
                }
                if let Some(store) = own {
                    store.close().await;
                }
            });
        })?;
    Ok(tx)
}

/// Whether `rows` are exactly the `before` rows of the previous snapshot:
/// as many, each known by its stamp (rows have distinct keys, so each
/// matched a different one).
fn all_known(rows: &[Row], before: usize) -> bool {
    rows.len() == before && rows.iter().all(|r| matches!(r, Row::Known(..)))
}

/// Above this many rows with an unknown or changed stamp, a reload reads
/// every active definition in one query instead of one query per row (a
/// start-up, or a mass change such as an import).
const FETCH_ONE_BY_ONE: usize = 64;

/// One active row of a reload: its text known from the previous snapshot
/// (the stamp is unchanged), or read now.
enum Row {
    Known(ActiveRow, Arc<str>),
    Read(StoredRecord),
}

impl Row {
    /// Off the request runtime: formats the timestamps of known rows.
    fn into_stored(self) -> StoredRecord {
        match self {
            Row::Known(row, text) => row.with_text(text),
            Row::Read(stored) => stored,
        }
    }
}

/// How often a reload lists a kind's active rows again when a change
/// landed between the listing and the reading of its texts, before it reads
/// every active definition in one statement.
const READ_ATTEMPTS: usize = 3;

/// The active rows of `kind` with their texts, as storage held them at one
/// moment: the listing is one statement, and every text read after it must
/// still have the stamp the listing gave (else it is listed again). Before,
/// a row read one by one was taken as it was then: a reload that straddled
/// a version change could combine the listing's state with the change's and
/// serve a set of versions storage never held (a canary's old version
/// already archived, its new one not yet listed: no workflow at all).
async fn read_active(
    store: &Store,
    kind: Kind,
    known: impl Fn(&ActiveRow) -> Option<Arc<str>>,
) -> Result<Vec<Row>, StorageError> {
    for _ in 0..READ_ATTEMPTS {
        let rows = store.active_rows(kind).await?;
        if let Some(rows) = resolve(store, kind, rows, &known).await? {
            return Ok(rows);
        }
    }
    // Changes keep landing between listing and reading: one statement.
    let all = store.active(kind).await?;
    Ok(all.into_iter().map(Row::Read).collect())
}

/// What [`resolve`] makes of a listing taken earlier, and what
/// [`read_active`] reads now, as `(id, version)` pairs (no text known).
#[cfg(test)]
pub(crate) async fn listed_and_current(
    store: &Store,
    kind: Kind,
    listed: Vec<ActiveRow>,
) -> Result<(Option<Vec<(String, i64)>>, Vec<(String, i64)>), StorageError> {
    let ids = |rows: Vec<Row>| -> Vec<(String, i64)> {
        rows.into_iter()
            .map(|r| {
                let s = r.into_stored();
                (s.id, s.version)
            })
            .collect()
    };
    let then = resolve(store, kind, listed, &|_: &ActiveRow| None).await?;
    let now = read_active(store, kind, |_| None).await?;
    Ok((then.map(ids), ids(now)))
}

/// The listed `rows` with their texts: `known` gives the text of a row
/// whose stamp is unchanged; the others are read from storage, one by one
/// if they are few, else all active definitions at once (one statement).
/// `None` when a row read one by one is no longer as listed.
async fn resolve(
    store: &Store,
    kind: Kind,
    rows: Vec<ActiveRow>,
    known: &impl Fn(&ActiveRow) -> Option<Arc<str>>,
) -> Result<Option<Vec<Row>>, StorageError> {
    // Compared in slices with a yield between them (when this runs on a
    // request worker; see `Store::active_rows`).
    let mut sorted: Vec<Result<Row, ActiveRow>> = Vec::with_capacity(rows.len());
    for (i, row) in rows.into_iter().enumerate() {
        sorted.push(match known(&row) {
            Some(text) => Ok(Row::Known(row, text)),
            None => Err(row),
        });
        if i % 256 == 255 {
            tokio::task::yield_now().await;
        }
    }
    let rows = sorted;
    if rows.iter().filter(|r| r.is_err()).count() > FETCH_ONE_BY_ONE {
        let all = store.active(kind).await?;
        return Ok(Some(all.into_iter().map(Row::Read).collect()));
    }
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        match row {
            Ok(known) => out.push(known),
            Err(row) => match store.stored(kind, &row.id, row.version).await? {
                Some(stored) if stored.status == Status::Active && stored.stamp == row.stamp => {
                    out.push(Row::Read(stored));
                }
                // Changed (or no longer active) since the listing.
                _ => return Ok(None),
            },
        }
    }
    Ok(Some(out))
}

/// Puts the calling thread in the lowest CPU scheduling class (Linux
/// `SCHED_IDLE`): a reload's CPU work (compiling, indexing, freeing the old
/// snapshot) then runs on time the request workers leave idle instead of
/// taking time slices from them on a busy core. A no-op elsewhere or if the
/// kernel refuses.
#[allow(unsafe_code)] // one libc call; argued below
pub fn background_priority() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; `param` is initialised and
        // outlives the call, which only reads it. Lowering a thread's own
        // policy needs no privilege and affects nothing else.
        let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    }
}

/// The pure part of a build (no I/O): compile (reusing the plans of
/// `previous` whose definitions are unchanged) and index. Returns the
/// snapshot and how many workflow versions were compiled.
pub fn assemble(
    workflows: &[StoredRecord],
    channels: &[StoredRecord],
    generation: u64,
    previous: &Snapshot,
) -> Result<(Snapshot, usize), ReloadError> {
    let mut problems = Vec::new();
    let ranges = rollout_ranges(workflows);
    // Plans by workflow id and by the engine-schema `channel` label.
    let mut by_id: HashMap<&str, Vec<Arc<Plan>>> = HashMap::new();
    let mut by_label: HashMap<String, Vec<Arc<Plan>>> = HashMap::new();
    let mut compiled_plans = HashMap::with_capacity(workflows.len());
    let mut compiled_count = 0;
    for (stored, range) in workflows.iter().zip(&ranges) {
        let key = (stored.id.clone(), stored.version);
        let reused = previous
            .compiled
            .get(&key)
            .filter(|c| c.compiled_from(stored, range))
            .map(|c| (c.plan.clone(), c.label.clone()));
        let (plan, label) = match reused {
            Some(reused) => reused,
            None => {
                let record = match stored.parse() {
                    Ok(r) => r,
                    Err(e) => {
                        problems.push(Diagnostic {
                            field: format!("workflows['{}'].v{}", stored.id, stored.version),
                            message: e.to_string(),
                        });
                        continue;
                    }
                };
                let mut def = record.to_json(Kind::Workflow);
                // The range always follows the versions' percentages (a
                // definition stored with a range of its own, before `rollout`
                // became server-managed, does not keep it).
                if let Some(obj) = def.as_object_mut() {
                    obj.insert(
                        "rollout".into(),
                        serde_json::json!({"bucket_start": range.start, "bucket_end": range.end}),
                    );
                }
                match compile_stored_workflow(&def) {
                    Ok(mut compiled) => {
                        compiled_count += 1;
                        compiled.plan.source_id = stored.stamp.identity().into();
                        let label = record
                            .definition
                            .get("channel")
                            .and_then(|c| c.as_str())
                            .map(str::to_owned);
                        (Arc::new(compiled.plan), label)
                    }
                    Err(errors) => {
                        problems.extend(errors.into_iter().map(|d| Diagnostic {
                            field: format!(
                                "workflows['{}'].v{}.{}",
                                stored.id, stored.version, d.field
                            ),
                            message: d.message,
                        }));
                        continue;
                    }
                }
            }
        };
        if let Some(label) = &label {
            by_label
                .entry(label.clone())
                .or_default()
                .push(plan.clone());
        }
        by_id
            .entry(stored.id.as_str())
            .or_default()
            .push(plan.clone());
        compiled_plans.insert(
            key,
            CompiledPlan {
                text: stored.text.clone(),
                status: stored.status,
                rollout_percentage: stored.rollout_percentage,
                updated_at: stored.updated_at.clone(),
                stamp: stored.stamp.clone(),
                range: *range,
                label,
                plan,
            },
        );
    }
    let mut tables = Tables {
        active_workflows: by_id.len(),
        workflows_loaded: by_id.values().map(Vec::len).sum(),
        compiled: compiled_plans,
        ..Tables::default()
    };
    // The previous snapshot's channels by id: an unchanged stored channel is
    // recognised before its text is parsed.
    let previous_by_id: HashMap<&str, &Arc<Channel>> = previous
        .channels
        .values()
        .map(|c| (c.id.as_str(), c))
        .collect();
    for stored in channels {
        tables.channel_texts.insert(
            stored.id.clone(),
            StoredText {
                version: stored.version,
                stamp: stored.stamp.clone(),
                text: stored.text.clone(),
            },
        );
        let before = previous_by_id.get(stored.id.as_str()).filter(|c| {
            c.version == stored.version
                && (Arc::ptr_eq(&c.source, &stored.text) || *c.source == *stored.text)
                // Its cache scope names the stored text (see `Stamp::identity`).
                && previous
                    .channel_texts
                    .get(&stored.id)
                    .is_some_and(|t| t.stamp.same_identity(&stored.stamp))
        });
        // Parsed only when the text changed.
        let record = match before {
            Some(_) => None,
            None => match stored.parse() {
                Ok(r) => Some(r),
                Err(e) => {
                    problems.push(Diagnostic {
                        field: format!("channels['{}']", stored.id),
                        message: e.to_string(),
                    });
                    continue;
                }
            },
        };
        // The plans this channel serves (by its workflow_id, then by the
        // workflows' `channel` label), most preferred first.
        let (workflow_id, name) = match (&record, before) {
            (Some(r), _) => (
                r.definition.get("workflow_id").and_then(|w| w.as_str()),
                r.definition.get("name").and_then(|n| n.as_str()),
            ),
            (None, Some(c)) => (Some(c.def.workflow_id.as_str()), Some(c.name.as_str())),
            (None, None) => unreachable!("either parsed or carried over"),
        };
        let mut plans: Vec<Arc<Plan>> = workflow_id
            .and_then(|w| by_id.get(w))
            .cloned()
            .unwrap_or_default();
        for plan in name.and_then(|n| by_label.get(n)).into_iter().flatten() {
            if !plans.iter().any(|p| Arc::ptr_eq(p, plan)) {
                plans.push(plan.clone());
            }
        }
        plans.sort_by(|a, b| b.priority.cmp(&a.priority).then(b.version.cmp(&a.version)));
        // An unchanged channel serving the same plans is carried over whole.
        let unchanged = before.filter(|c| {
            c.plans.len() == plans.len()
                && c.plans.iter().zip(&plans).all(|(a, b)| Arc::ptr_eq(a, b))
        });
        let channel = match (unchanged, record) {
            (Some(channel), _) => Arc::clone(channel),
            (None, record) => {
                let record = match record {
                    Some(r) => r,
                    None => match stored.parse() {
                        Ok(r) => r,
                        Err(e) => {
                            problems.push(Diagnostic {
                                field: format!("channels['{}']", stored.id),
                                message: e.to_string(),
                            });
                            continue;
                        }
                    },
                };
                match build_channel(
                    &record,
                    stored.text.clone(),
                    &stored.stamp.identity(),
                    plans,
                    previous,
                ) {
                    Ok(channel) => channel,
                    Err(mut errors) => {
                        problems.append(&mut errors);
                        continue;
                    }
                }
            }
        };
        if let (Some(pattern), sluice_compiler::def::Protocol::Rest) =
            (&channel.def.route_pattern, channel.def.protocol())
        {
            let segments: Vec<Seg> = pattern
                .split('/')
                .filter(|s| !s.is_empty())
                .map(
                    |s| match s.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                        Some(name) => Seg::Param(name.to_owned()),
                        None => Seg::Literal(s.to_owned()),
                    },
                )
                .collect();
            let literals = segments
                .iter()
                .filter(|s| matches!(s, Seg::Literal(_)))
                .count();
            tables.routes.insert(Route {
                segments,
                methods: channel
                    .def
                    .methods
                    .iter()
                    .map(|m| m.as_str().to_owned())
                    .collect(),
                priority: channel.def.priority,
                literals,
                channel: channel.clone(),
            });
        }
        tables.channels.insert(channel.name.clone(), channel);
    }
    tables.routes.finish();
    if problems.is_empty() {
        let snapshot = Snapshot {
            generation,
            built_at: Some(SystemTime::now()),
            tables: Arc::new(tables),
        };
        Ok((snapshot, compiled_count))
    } else {
        Err(ReloadError::Invalid(problems))
    }
}

/// Compiles one channel of a snapshot (its checks, rules and handles).
fn build_channel(
    record: &Record,
    source: Arc<str>,
    source_id: &str,
    plans: Vec<Arc<Plan>>,
    previous: &Snapshot,
) -> Result<Arc<Channel>, Vec<Diagnostic>> {
    let json = record.to_json(Kind::Channel);
    let def: ChannelDef = match serde_json::from_value(json) {
        Ok(d) => d,
        Err(e) => {
            return Err(vec![Diagnostic {
                field: format!("channels['{}']", record.id),
                message: e.to_string(),
            }]);
        }
    };
    let validation = match def.validation_logic.as_ref().map(logic::compile) {
        Some(Ok(l)) => Some(l),
        Some(Err(e)) => {
            return Err(vec![Diagnostic {
                field: format!("channels['{}'].validation_logic", record.id),
                message: format!("invalid JSONLogic: {}", e.message),
            }]);
        }
        None => None,
    };
    let rules = match crate::governance::Rules::compile(
        &def.config_json,
        &def.name,
        record.version,
        source_id,
        &plans,
    ) {
        Ok(r) => r,
        Err(errors) => {
            return Err(errors
                .into_iter()
                .map(|d| Diagnostic {
                    field: format!("channels['{}'].{}", record.id, d.field),
                    message: d.message,
                })
                .collect());
        }
    };
    Ok(Arc::new(Channel {
        id: record.id.clone(),
        source,
        name: def.name.clone(),
        version: record.version,
        timeout: Duration::from_millis(def.config_json.timeout_ms),
        is_async: def.channel_type() == sluice_compiler::def::ChannelType::Async,
        // Registered once per channel name, then carried over.
        metrics: previous
            .channels
            .get(&def.name)
            .map_or_else(|| ChannelMetrics::new(&def.name), |c| c.metrics.clone()),
        scope: sluice_runtime::connectors::CallScope {
            channel: def.name.clone(),
            traceparent: None,
            tracestate: None,
            chain: vec![def.name.clone()],
            observer: None,
        },
        validation,
        rules,
        plans,
        def,
    }))
}

/// Canary ranges: for each workflow id, the newest active version gets
/// `[0, p)` and an older active version the rest `[p, 100)`. Linear in the
/// number of rows (it used to look each id's newest row up by a scan).
fn rollout_ranges(workflows: &[StoredRecord]) -> Vec<Rollout> {
    let mut newest: HashMap<&str, i64> = HashMap::new();
    let mut count: HashMap<&str, usize> = HashMap::new();
    for r in workflows.iter().filter(|r| r.status == Status::Active) {
        let e = newest.entry(r.id.as_str()).or_insert(r.version);
        *e = (*e).max(r.version);
        *count.entry(r.id.as_str()).or_default() += 1;
    }
    // The newest version's percentage (the first row with that id and version).
    let mut percentage: HashMap<&str, i64> = HashMap::new();
    for r in workflows {
        if newest.get(r.id.as_str()) == Some(&r.version) {
            percentage
                .entry(r.id.as_str())
                .or_insert(r.rollout_percentage);
        }
    }
    workflows
        .iter()
        .map(|r| {
            let p = percentage
                .get(r.id.as_str())
                .copied()
                .unwrap_or(100)
                .clamp(0, 100) as u8;
            if r.version == newest[r.id.as_str()] {
                Rollout { start: 0, end: p }
            } else if count[r.id.as_str()] > 1 {
                Rollout { start: p, end: 100 }
            } else {
                Rollout::default()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(records: &[Record]) -> Vec<StoredRecord> {
        records.iter().map(StoredRecord::from).collect()
    }

    fn workflow(id: &str, version: i64, tasks: serde_json::Value) -> Record {
        Record {
            id: id.into(),
            version,
            status: Status::Active,
            rollout_percentage: 100,
            definition: json!({"name": id, "priority": 1, "tasks": tasks}),
            created_at: "2026-01-01T00:00:00Z".into(),
            updated_at: "2026-01-01T00:00:00Z".into(),
        }
    }

    fn channel(name: &str, workflow_id: &str) -> Record {
        Record {
            id: name.into(),
            version: 1,
            status: Status::Active,
            rollout_percentage: 100,
            definition: json!({
                "name": name, "channel_type": "sync", "protocol": "rest",
                "route_pattern": format!("/{name}/{{id}}"), "methods": ["POST"],
                "workflow_id": workflow_id, "config_json": {"timeout_ms": 1000}
            }),
            created_at: "2026-01-01T00:00:00Z".into(),
            updated_at: "2026-01-01T00:00:00Z".into(),
        }
    }

    fn tasks(target: &str) -> serde_json::Value {
        json!([{"id": "t", "name": "t", "function": {"name": "map", "input": {"mappings": [
            {"path": target, "logic": {"var": "payload.x"}}
        ]}}}])
    }

    #[test]
    fn a_rebuild_reuses_the_plans_of_unchanged_definitions() {
        let workflows = vec![
            workflow("a", 1, tasks("data.a")),
            workflow("b", 1, tasks("data.b")),
        ];
        let channels = vec![channel("ca", "a"), channel("cb", "b")];
        let (first, compiled) = assemble(
            &stored(&workflows),
            &stored(&channels),
            1,
            &Snapshot::default(),
        )
        .unwrap();
        assert_eq!(compiled, 2);
        let (second, compiled) =
            assemble(&stored(&workflows), &stored(&channels), 2, &first).unwrap();
        assert_eq!(compiled, 0, "nothing changed, nothing compiled");
        assert!(Arc::ptr_eq(&first.channels["ca"], &second.channels["ca"]));
        for name in ["ca", "cb"] {
            assert!(Arc::ptr_eq(
                &first.channels[name].plans[0],
                &second.channels[name].plans[0]
            ));
        }
        // A changed definition under the same id and version is compiled again.
        let changed = vec![
            workflow("a", 1, tasks("data.changed")),
            workflow("b", 1, tasks("data.b")),
        ];
        let (third, compiled) =
            assemble(&stored(&changed), &stored(&channels), 3, &second).unwrap();
        assert_eq!(compiled, 1);
        assert!(!Arc::ptr_eq(
            &second.channels["ca"].plans[0],
            &third.channels["ca"].plans[0]
        ));
        assert!(Arc::ptr_eq(
            &second.channels["cb"].plans[0],
            &third.channels["cb"].plans[0]
        ));
        // The channel of the changed plan is rebuilt; the other carried over.
        assert!(!Arc::ptr_eq(&second.channels["ca"], &third.channels["ca"]));
        assert!(Arc::ptr_eq(&second.channels["cb"], &third.channels["cb"]));
        // A new version is a new plan.
        let newer = vec![
            workflow("a", 2, tasks("data.changed")),
            workflow("b", 1, tasks("data.b")),
        ];
        let (_, compiled) = assemble(&stored(&newer), &stored(&channels), 4, &third).unwrap();
        assert_eq!(compiled, 1);
    }

    #[test]
    fn routes_match_decoded_segments_once() {
        let workflows = vec![workflow("a", 1, tasks("data.a"))];
        let channels = vec![channel("ca", "a")];
        let (snapshot, _) = assemble(
            &stored(&workflows),
            &stored(&channels),
            1,
            &Snapshot::default(),
        )
        .unwrap();
        // The router decoded `%2541` to `%41`; the table must not decode again.
        let m = snapshot.routes.find("POST", &["ca", "%41"]).unwrap();
        assert_eq!(m.params.as_slice(), &[("id", "%41")]);
        assert_eq!(m.channel.name, "ca");
        assert!(snapshot.routes.find("GET", &["ca", "x"]).is_none());
        assert!(snapshot.routes.find("POST", &["cb", "x"]).is_none());
    }

    #[test]
    fn literal_and_parameter_first_routes_keep_their_order() {
        let workflows = vec![workflow("a", 1, tasks("data.a"))];
        let mut channels = Vec::new();
        for (name, pattern, priority) in [
            ("lit-low", "/orders/{id}", 1),
            ("param-mid", "/{kind}/{id}", 5),
            ("lit-high", "/orders/{id}", 9),
            ("other", "/users/{id}", 9),
        ] {
            let mut c = channel(name, "a");
            c.definition["route_pattern"] = json!(pattern);
            c.definition["priority"] = json!(priority);
            channels.push(c);
        }
        let (snapshot, _) = assemble(
            &stored(&workflows),
            &stored(&channels),
            1,
            &Snapshot::default(),
        )
        .unwrap();
        let name = |parts: &[&str]| {
            snapshot
                .routes
                .find("POST", parts)
                .map(|m| m.channel.name.clone())
        };
        assert_eq!(name(&["orders", "1"]).as_deref(), Some("lit-high"));
        assert_eq!(name(&["users", "1"]).as_deref(), Some("other"));
        assert_eq!(name(&["things", "1"]).as_deref(), Some("param-mid"));
        assert_eq!(snapshot.routes.len(), 4);
    }
}
