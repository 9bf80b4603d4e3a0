//! Storage layer: one `Store` over SQLite, PostgreSQL or MariaDB/MySQL holding
//! versioned workflows and channels, connectors, the audit log, (SQLite) backups
//! and async traces with their dead-letter queue.
//!
//! Every query body is written once and expanded per backend by the `dispatch!`
//! macro, so each backend gets monomorphic sqlx code without generic trait bounds.
//! SQL is written with `?` placeholders and rewritten to `$n` for PostgreSQL once,
//! when the `Store` is built (see `sql.rs`). Every write and the audit entry that
//! records it share one transaction.

mod audit;
mod backup;
mod connectors;
mod generation;
mod lifecycle;
mod sql;
mod traces;
pub use traces::{
    Claimed, DlqEntry, NewTrace, Outcome, RetryPolicy, Trace, TraceQuery, TraceStatus,
};
// Test helpers (`tests::TestDb`) are visible to other modules' tests.
#[cfg(test)]
pub(crate) mod tests;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sql::Sql;

/// Which database a `Store` talks to; chosen by the scheme of `storage.url`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
    MySql,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
            Backend::MySql => "mysql",
        }
    }
}

/// Errors of the storage layer, one variant per HTTP error class the handlers map
/// them to (404, 409, 400, 500). Messages never contain connection strings.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    BadRequest(String),
    /// A 400 with a problem per field (a stored definition that cannot be
    /// activated).
    #[error("{0}")]
    Invalid(String, Vec<sluice_compiler::diag::Diagnostic>),
    #[error("{0}")]
    Database(String),
    /// The database cannot be reached (no connection within the pool's
    /// acquire timeout, a connection lost): a 503 the caller may retry,
    /// not an internal fault.
    #[error("{0}")]
    Unavailable(String),
    /// More than the database takes in one statement (MariaDB/MySQL's
    /// `max_allowed_packet`): a 413 naming the limit, not an outage to
    /// retry (audit 106: a 20 MB definition was a 503 "retry later").
    #[error("{0}")]
    TooLarge(String),
    /// The backup directory cannot be used (a 500 whose message names the
    /// directory and the reason: the fix is in the configuration, not in
    /// the database).
    #[error("{0}")]
    Backup(String),
}

/// Why `/backups` answers 400 on PostgreSQL and MySQL.
pub const BACKUPS_NEED_SQLITE: &str = "backups are only available with SQLite storage; \
     use the database's own tools (pg_dump, mariadb-dump)";

/// The two versioned resources; they share one lifecycle implementation and differ
/// only in table, labels and the channel-name uniqueness rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Workflow,
    Channel,
}

impl Kind {
    /// Lower-case label used in conflict messages and as audit `resource_type`.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Workflow => "workflow",
            Kind::Channel => "channel",
        }
    }
    /// Capitalised label used in not-found messages ("Workflow with id 'x' not found").
    pub fn title(self) -> &'static str {
        match self {
            Kind::Workflow => "Workflow",
            Kind::Channel => "Channel",
        }
    }
    /// The identifier field of the resource in API JSON.
    pub fn id_field(self) -> &'static str {
        match self {
            Kind::Workflow => "workflow_id",
            Kind::Channel => "channel_id",
        }
    }
    pub(crate) fn not_found(self, id: &str) -> StorageError {
        StorageError::NotFound(format!("{} with id '{id}' not found", self.title()))
    }
}

/// Lifecycle state of one version. `paused` is the engine-schema extra: kept but not routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Draft,
    Active,
    Archived,
    Paused,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Draft => "draft",
            Status::Active => "active",
            Status::Archived => "archived",
            Status::Paused => "paused",
        }
    }
    pub fn parse(s: &str) -> Option<Status> {
        match s {
            "draft" => Some(Status::Draft),
            "active" => Some(Status::Active),
            "archived" => Some(Status::Archived),
            "paused" => Some(Status::Paused),
            _ => None,
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Fields the server manages; they are never stored inside a definition.
/// `rollout` is the engine schema's bucket range: here the range follows
/// `rollout_percentage` (a definition's own range would split traffic
/// behind what the admin API shows).
pub(crate) const SERVER_MANAGED: [&str; 6] = [
    "version",
    "status",
    "rollout_percentage",
    "rollout",
    "created_at",
    "updated_at",
];

/// The check of [`AgainstActive`]: the version a move activates, and the
/// other ids' active versions as stored.
pub type CheckAgainst<'a> =
    dyn Fn(&Record, &[StoredRecord]) -> Result<(), StorageError> + Send + Sync + 'a;

/// A check of the version a status change activates against the other
/// ids' active versions of its kind (`Store::set_status_checked`).
pub struct AgainstActive<'a> {
    /// Whether the version needs the check at all (reading every active
    /// definition is not free).
    pub applies: &'a (dyn Fn(&Record) -> bool + Send + Sync),
    /// The check, given the other ids' active versions as stored.
    pub check: &'a CheckAgainst<'a>,
}

/// A stored row whose definition is still text: an engine reload compares
/// texts (a `memcmp`) and parses only the definitions that changed.
#[derive(Debug, Clone)]
pub struct StoredRecord {
    pub id: String,
    pub version: i64,
    pub status: Status,
    pub rollout_percentage: i64,
    /// The definition as stored (JSON text).
    pub text: Arc<str>,
    pub created_at: String,
    pub updated_at: String,
    /// What identifies this stored state of the row without its text.
    pub stamp: Stamp,
}

/// What identifies one stored state of a definition without reading its
/// text: the row's timestamps (microseconds) and the digest of its
/// definition. Every write of a definition sets `updated_at` and the digest;
/// every status or rollout change sets `updated_at`. A reload reads only
/// stamps and fetches the text of the rows whose stamp differs from what its
/// snapshot was built from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stamp {
    pub created_us: i64,
    pub updated_us: i64,
    /// Hex SHA-256 of the definition text as written; `None` for rows
    /// written before the digest column existed (never matches).
    pub digest: Option<Arc<str>>,
}

impl Stamp {
    /// Whether two stamps certainly name the same stored state (a missing
    /// digest never does).
    pub fn same(&self, other: &Stamp) -> bool {
        self.digest.is_some() && self == other
    }

    /// A short name for the stored text this stamp describes, the same on
    /// every replica (and for identical definitions created apart): the
    /// digest's first 16 hex digits, or, for a row written before digests
    /// existed, its creation time. A definition deleted and created again
    /// with other text gets another name.
    pub fn identity(&self) -> String {
        match &self.digest {
            Some(d) => d.get(..16).unwrap_or(d).to_owned(),
            None => format!("c{:x}", self.created_us),
        }
    }

    /// Whether two stamps have the same [`Self::identity`].
    pub fn same_identity(&self, other: &Stamp) -> bool {
        match (&self.digest, &other.digest) {
            (Some(a), Some(b)) => a == b,
            (None, None) => self.created_us == other.created_us,
            _ => false,
        }
    }
}

/// One active row without its definition (`Store::active_rows`).
#[derive(Debug, Clone)]
pub struct ActiveRow {
    pub id: String,
    pub version: i64,
    pub status: Status,
    pub rollout_percentage: i64,
    pub stamp: Stamp,
}

impl ActiveRow {
    /// The row with a definition text already known for its stamp.
    pub fn with_text(self, text: Arc<str>) -> StoredRecord {
        StoredRecord {
            created_at: rfc3339(self.stamp.created_us),
            updated_at: rfc3339(self.stamp.updated_us),
            id: self.id,
            version: self.version,
            status: self.status,
            rollout_percentage: self.rollout_percentage,
            text,
            stamp: self.stamp,
        }
    }
}

/// The digest stored beside a definition: hex SHA-256 of its text.
pub(crate) fn digest(text: &str) -> String {
    use sha2::Digest;
    let hash = sha2::Sha256::digest(text.as_bytes());
    let mut out = String::with_capacity(64);
    for b in hash {
        use std::fmt::Write;
        let _ = write!(out, "{b:02x}");
    }
    out
}

impl StoredRecord {
    pub fn into_record(self) -> Result<Record, StorageError> {
        Ok(Record {
            definition: parse_json(&self.text)?,
            id: self.id,
            version: self.version,
            status: self.status,
            rollout_percentage: self.rollout_percentage,
            created_at: self.created_at,
            updated_at: self.updated_at,
        })
    }

    pub fn parse(&self) -> Result<Record, StorageError> {
        Ok(Record {
            id: self.id.clone(),
            version: self.version,
            status: self.status,
            rollout_percentage: self.rollout_percentage,
            definition: parse_json(&self.text)?,
            created_at: self.created_at.clone(),
            updated_at: self.updated_at.clone(),
        })
    }
}

impl From<&Record> for StoredRecord {
    fn from(r: &Record) -> StoredRecord {
        StoredRecord {
            id: r.id.clone(),
            version: r.version,
            status: r.status,
            rollout_percentage: r.rollout_percentage,
            text: r.definition.to_string().into(),
            created_at: r.created_at.clone(),
            updated_at: r.updated_at.clone(),
            stamp: Stamp::default(),
        }
    }
}

/// One stored version of a workflow or channel, or one connector (version 1, active).
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub id: String,
    pub version: i64,
    pub status: Status,
    pub rollout_percentage: i64,
    /// The user's definition without server-managed fields or the id field.
    pub definition: Json,
    /// RFC 3339 UTC, whole seconds, `Z` suffix.
    pub created_at: String,
    pub updated_at: String,
}

impl Record {
    /// The API shape: id field first, then the definition, then the server-managed
    /// fields (`rollout_percentage` for workflows only).
    pub fn to_json(&self, kind: Kind) -> Json {
        let mut m = Map::new();
        m.insert(kind.id_field().into(), Json::String(self.id.clone()));
        if let Json::Object(def) = &self.definition {
            for (k, v) in def {
                if k != kind.id_field() && !SERVER_MANAGED.contains(&k.as_str()) {
                    m.insert(k.clone(), v.clone());
                }
            }
        }
        // Fields left out take their documented defaults; the answer shows
        // them, as the stored text (and its digest) stays as written.
        let default = |m: &mut Map<String, Json>, key: &str, value: Json| {
            m.entry(key).or_insert(value);
        };
        match kind {
            Kind::Workflow => {
                default(&mut m, "priority", 0.into());
                default(&mut m, "condition", true.into());
                default(&mut m, "tags", Json::Array(Vec::new()));
                default(&mut m, "continue_on_error", false.into());
            }
            Kind::Channel => {
                let (channel_type, protocol) = effective_channel(&m);
                let (channel_type, protocol) = (channel_type.to_owned(), protocol.to_owned());
                default(&mut m, "channel_type", channel_type.into());
                default(&mut m, "protocol", protocol.into());
                default(&mut m, "priority", 0.into());
                if let Json::Object(config) = m
                    .entry("config_json")
                    .or_insert_with(|| Json::Object(Map::new()))
                {
                    config
                        .entry("timeout_ms")
                        .or_insert(DEFAULT_CHANNEL_TIMEOUT_MS.into());
                }
            }
        }
        m.insert("version".into(), self.version.into());
        m.insert("status".into(), self.status.as_str().into());
        if kind == Kind::Workflow {
            m.insert("rollout_percentage".into(), self.rollout_percentage.into());
        }
        m.insert("created_at".into(), self.created_at.clone().into());
        m.insert("updated_at".into(), self.updated_at.clone().into());
        Json::Object(m)
    }

    /// A connector as stored (secrets NOT masked; the caller masks) plus its timestamps.
    pub fn to_connector_json(&self) -> Json {
        let mut m = match &self.definition {
            Json::Object(def) => def.clone(),
            _ => Map::new(),
        };
        // `config.type` may be left out on input (it must equal
        // `connector_type`); answers always show it.
        if let Some(ty) = m.get("connector_type").cloned()
            && let Some(Json::Object(config)) = m.get_mut("config")
            && !config.contains_key("type")
        {
            let mut with_type = Map::with_capacity(config.len() + 1);
            with_type.insert("type".into(), ty);
            with_type.extend(std::mem::take(config));
            *config = with_type;
        }
        m.insert("created_at".into(), self.created_at.clone().into());
        m.insert("updated_at".into(), self.updated_at.clone().into());
        Json::Object(m)
    }
}

/// A channel's `config_json.timeout_ms` when it gives none.
const DEFAULT_CHANNEL_TIMEOUT_MS: u64 = 30_000;

/// A channel's effective `(channel_type, protocol)`: as given, else `rest`
/// with a `route_pattern` and `http` without, and `async` for `kafka`,
/// `sync` otherwise (as `ChannelDef` reads them). Stored in their columns so
/// the list filters see the defaults too.
pub(crate) fn effective_channel(def: &Map<String, Json>) -> (&str, &str) {
    let protocol = def.get("protocol").and_then(Json::as_str).unwrap_or(
        if def.contains_key("route_pattern") {
            "rest"
        } else {
            "http"
        },
    );
    let channel_type = def
        .get("channel_type")
        .and_then(Json::as_str)
        .unwrap_or(if protocol == "kafka" { "async" } else { "sync" });
    (channel_type, protocol)
}

/// Filters and page of a list call. `limit`/`offset` are taken as given (the HTTP
/// layer validates the 1..=1000 range).
#[derive(Debug, Clone)]
pub struct ListQuery {
    pub status: Option<Status>,
    /// Workflows: keep versions whose `tags` array contains this string.
    pub tag: Option<String>,
    /// Channels: filter on `channel_type`.
    pub channel_type: Option<String>,
    /// Channels: filter on `protocol`.
    pub protocol: Option<String>,
    pub limit: i64,
    pub offset: i64,
}

impl Default for ListQuery {
    fn default() -> Self {
        ListQuery {
            status: None,
            tag: None,
            channel_type: None,
            protocol: None,
            limit: 50,
            offset: 0,
        }
    }
}

/// What the audit entry of a change says. Storage fills `resource_type`,
/// `resource_id` and `version` when they are empty, and merges facts it knows
/// (e.g. which versions were archived) into `details` without overwriting keys.
#[derive(Debug, Clone)]
pub struct Audit {
    /// `anonymous`, `admin` or `read_only`; never the key.
    pub principal: String,
    pub action: String,
    pub resource_type: String,
    pub resource_id: String,
    pub version: Option<i64>,
    pub details: Json,
}

impl Audit {
    /// Convenience constructor with empty resource fields (filled by the store) and no details.
    pub fn new(principal: &str, action: &str) -> Audit {
        Audit {
            principal: principal.into(),
            action: action.into(),
            resource_type: String::new(),
            resource_id: String::new(),
            version: None,
            details: Json::Null,
        }
    }

    /// Fills what the store knows and the caller left out; merges `extra` into `details`.
    pub(crate) fn complete(
        mut self,
        resource_type: &str,
        id: &str,
        version: Option<i64>,
        extra: Json,
    ) -> Audit {
        if self.resource_type.is_empty() {
            self.resource_type = resource_type.into();
        }
        if self.resource_id.is_empty() {
            self.resource_id = id.into();
        }
        if self.version.is_none() {
            self.version = version;
        }
        if let Json::Object(extra) = extra {
            match &mut self.details {
                Json::Object(d) => {
                    for (k, v) in extra {
                        d.entry(k).or_insert(v);
                    }
                }
                Json::Null => self.details = Json::Object(extra),
                // A non-object detail from the caller is kept under "note".
                other => {
                    let mut d = extra;
                    d.insert("note".into(), other.take());
                    self.details = Json::Object(d);
                }
            }
        }
        if self.details.is_null() {
            self.details = Json::Object(Map::new());
        }
        self
    }
}

/// The concrete pools. Matching on this enum (via `dispatch!`) is the only place
/// backend choice happens at run time.
pub(crate) enum Pools {
    Sqlite(SqlitePool),
    Postgres(PgPool),
    MySql(MySqlPool),
}

struct Inner {
    pools: Pools,
    backend: Backend,
    /// All statements for this backend, placeholders already converted.
    sql: Sql,
    /// Serialises backups of this store so two never pick the same file name.
    backup_lock: tokio::sync::Mutex<()>,
    /// SQLite's writes, one at a time and in order (see [`dispatch_write!`]);
    /// on the server backends only grouped submissions take it (one group
    /// stored at a time, see `Store::insert_grouped`).
    write_gate: tokio::sync::Semaphore,
    /// SQLite (a file): the one connection writes go through. A connection
    /// whose last transaction saw an older database re-reads the pages it
    /// caches; writes spread over the pool's connections each began that
    /// way (a tenth of a busy writer's time in `pread`).
    sqlite_writer: Option<sqlx::SqlitePool>,
    /// Submissions waiting for the write gate, stored together.
    submissions: std::sync::Mutex<Vec<traces::QueuedInsert>>,
    /// The URL this store connected to, for [`Store::twin`]; `None` for an
    /// in-memory SQLite database (another connection would be another,
    /// empty database). Never logged: it may hold a password.
    url: Option<String>,
    /// How deep the JSON columns guarded by the database's own validity
    /// check may nest (SQLite about 1,000 levels); `None` when nothing below
    /// [`JSON_DEPTH_PROBE`] is refused (PostgreSQL and MariaDB/MySQL keep
    /// the text unchecked). Measured at connect.
    json_depth: Option<usize>,
    /// The most bytes one statement may carry (MariaDB/MySQL's
    /// `max_allowed_packet`, read at connect); `None` elsewhere.
    max_packet: Option<usize>,
}

/// What a statement storing a definition carries besides its text (the
/// statement, ids, names, timestamps), with a wide margin.
const PACKET_ROOM: usize = 64 * 1024;

/// The deepest nesting [`Store::json_depth`] looks for: the executor's own
/// limit on a context.
pub const JSON_DEPTH_PROBE: usize = 2048;

/// The nesting the JSON validity checks of the trace columns accept, found
/// by asking the database (a binary search over nested arrays, a dozen
/// queries at connect): SQLite's `json_valid` about 1,000 levels, MySQL's
/// 100. PostgreSQL's and MariaDB's columns are unchecked text (MariaDB's
/// check refused 32 levels until migration 0005): no limit. When the probe
/// itself fails the known limit is assumed.
async fn json_depth_of(pools: &Pools) -> Option<usize> {
    async fn valid(pools: &Pools, depth: usize) -> Result<bool, sqlx::Error> {
        let text = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        Ok(match pools {
            Pools::Sqlite(p) => {
                sqlx::query_scalar::<_, i64>("SELECT json_valid(?)")
                    .bind(text)
                    .fetch_one(p)
                    .await?
                    == 1
            }
            Pools::MySql(p) => {
                sqlx::query_scalar::<_, i64>("SELECT CAST(COALESCE(JSON_VALID(?), 0) AS SIGNED)")
                    .bind(text)
                    .fetch_one(p)
                    .await?
                    == 1
            }
            Pools::Postgres(_) => true,
        })
    }
    let fallback = match pools {
        Pools::Sqlite(_) => Some(1000),
        // MariaDB's checks went with migration 0005 (`MODIFY` drops a
        // column's CHECK there); MySQL 8 keeps them as table constraints,
        // so its limit (100 levels) still holds.
        Pools::MySql(p) => {
            let version: Option<String> = sqlx::query_scalar("SELECT VERSION()")
                .fetch_one(p)
                .await
                .ok();
            if version.is_none_or(|v| v.contains("MariaDB")) {
                return None;
            }
            Some(100)
        }
        Pools::Postgres(_) => return None,
    };
    let search = async {
        if valid(pools, JSON_DEPTH_PROBE).await? {
            return Ok::<_, sqlx::Error>(None);
        }
        // valid(lo) holds, valid(hi) does not.
        let (mut lo, mut hi) = (1, JSON_DEPTH_PROBE);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if valid(pools, mid).await? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok(Some(lo))
    };
    search.await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "could not measure the database's JSON nesting limit; assuming the usual one");
        fallback
    })
}

/// Handle to the database; cheap to clone (an `Arc`).
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.inner.backend)
            .finish()
    }
}

/// The `QueryTimer` of the `Store` method it is expanded in (its name read
/// once, from the type name of a fn item declared there).
macro_rules! query_timer {
    () => {{
        fn __op() {}
        static OP: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
        $crate::storage::QueryTimer::start(
            *OP.get_or_init(|| $crate::storage::op_name(std::any::type_name_of_val(&__op))),
        )
    }};
}
pub(crate) use query_timer;

/// Expands `$body` once per backend with `$pool` bound to the concrete pool, so
/// the body is written once and type-checked against each driver.
///
/// Every expansion is also timed into `db_query_duration_seconds{operation}`,
/// the operation being the enclosing `Store` method's name (a low-cardinality
/// label that needs no call site to spell it). The timer records on drop, so
/// early returns and `?` are timed too.
macro_rules! dispatch {
    ($store:expr, $pool:ident => $body:expr) => {{
        let _timer = $crate::storage::query_timer!();
        match &$store.inner.pools {
            $crate::storage::Pools::Sqlite($pool) => $body,
            $crate::storage::Pools::Postgres($pool) => $body,
            $crate::storage::Pools::MySql($pool) => $body,
        }
    }};
}
pub(crate) use dispatch;

/// [`dispatch!`] for an operation that writes. On SQLite it first takes
/// the store's write gate, so the process's connections queue for the
/// database's one writer in order: left to SQLite, a writer that finds the
/// lock taken sleeps in its busy handler (1 ms, then longer) while newer
/// writers overtake it. Under a stream of async submissions the workers'
/// claims and outcomes starved behind the inserts (about 100 traces a
/// second finished while 2,900 a second were accepted).
macro_rules! dispatch_write {
    ($store:expr, $pool:ident => $body:expr) => {{
        let _timer = $crate::storage::query_timer!();
        match &$store.inner.pools {
            $crate::storage::Pools::Sqlite($pool) => {
                // The semaphore is never closed.
                let _gate = $store.inner.write_gate.acquire().await;
                let $pool = $store.inner.sqlite_writer.as_ref().unwrap_or($pool);
                $body
            }
            $crate::storage::Pools::Postgres($pool) => $body,
            $crate::storage::Pools::MySql($pool) => $body,
        }
    }};
}
pub(crate) use dispatch_write;

/// The method a `dispatch!` sits in, from the type name of a fn item declared
/// there (`sluice::storage::audit::<impl ..>::list_audit::{{closure}}::__op` →
/// `list_audit`): the last path segment that is not a closure.
pub(crate) fn op_name(type_name: &'static str) -> &'static str {
    type_name
        .rsplit("::")
        .skip(1)
        .find(|s| !s.starts_with('{') && !s.is_empty())
        .unwrap_or("unknown")
}

/// Records the time until it is dropped into `db_query_duration_seconds`.
pub(crate) struct QueryTimer {
    operation: &'static str,
    started: std::time::Instant,
}

impl QueryTimer {
    pub(crate) fn start(operation: &'static str) -> QueryTimer {
        QueryTimer {
            operation,
            started: std::time::Instant::now(),
        }
    }
}

impl Drop for QueryTimer {
    fn drop(&mut self) {
        // Looked up per call rather than cached: a handle taken before the
        // recorder is installed (start-up) would stay a no-op forever.
        metrics::histogram!(
            crate::telemetry::names::DB_QUERY_DURATION_SECONDS,
            "operation" => self.operation
        )
        .record(self.started.elapsed().as_secs_f64());
    }
}

/// `sqlx::query(sql).bind(a)...` on an executor; returns all rows.
macro_rules! fetch_all {
    ($ex:expr, $sql:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query($sql)$(.bind($arg))*.fetch_all($ex).await.map_err($crate::storage::db_err)
    };
}
/// Same, at most one row.
macro_rules! fetch_optional {
    ($ex:expr, $sql:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query($sql)$(.bind($arg))*.fetch_optional($ex).await.map_err($crate::storage::db_err)
    };
}
/// Same, exactly one row.
macro_rules! fetch_one {
    ($ex:expr, $sql:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query($sql)$(.bind($arg))*.fetch_one($ex).await.map_err($crate::storage::db_err)
    };
}
/// Same, a statement; returns rows affected.
macro_rules! execute {
    ($ex:expr, $sql:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query($sql)$(.bind($arg))*.execute($ex).await.map(|r| r.rows_affected()).map_err($crate::storage::db_err)
    };
}
pub(crate) use {execute, fetch_all, fetch_one, fetch_optional};

/// Begins a write transaction. SQLite takes the write lock up front
/// (`BEGIN IMMEDIATE`) so read-then-write transactions never fail to upgrade;
/// the server backends rely on row locks taken inside the transaction.
pub(crate) trait BeginWrite {
    type Db: sqlx::Database;
    fn begin_write(
        &self,
    ) -> impl std::future::Future<
        Output = Result<sqlx::Transaction<'static, Self::Db>, StorageError>,
    > + Send;
}

impl BeginWrite for SqlitePool {
    type Db = sqlx::Sqlite;
    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>, StorageError> {
        self.begin_with("BEGIN IMMEDIATE").await.map_err(db_err)
    }
}
impl BeginWrite for PgPool {
    type Db = sqlx::Postgres;
    async fn begin_write(
        &self,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StorageError> {
        self.begin().await.map_err(db_err)
    }
}
impl BeginWrite for MySqlPool {
    type Db = sqlx::MySql;
    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, sqlx::MySql>, StorageError> {
        self.begin().await.map_err(db_err)
    }
}

/// Is this a lost race the caller may simply retry (deadlock, serialization
/// failure, lock timeout, SQLite busy)?
pub(crate) fn is_transient(e: &StorageError) -> bool {
    matches!(e, StorageError::Conflict(m) if m.starts_with(TRANSIENT_PREFIX))
}
const TRANSIENT_PREFIX: &str = "concurrent change";

/// A race lost to another writer, which [`retry`] runs again.
pub(crate) fn lost_race() -> StorageError {
    StorageError::Conflict(format!("{TRANSIENT_PREFIX} took the row first; retry"))
}

/// Maps a driver error: unique violations and lost races become `Conflict`
/// (409, never 500); the rest `Database`. Operations that know a better message
/// for a unique violation map it themselves with `unique_as`.
pub(crate) fn db_err(e: sqlx::Error) -> StorageError {
    if matches!(
        e,
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_)
    ) {
        return StorageError::Unavailable(format!("database unavailable: {e}"));
    }
    if let sqlx::Error::Database(d) = &e {
        if d.is_unique_violation() {
            return StorageError::Conflict(format!(
                "{TRANSIENT_PREFIX} conflicted with this request; retry"
            ));
        }
        let code = d.code().map(|c| c.into_owned()).unwrap_or_default();
        let mysql_number = d
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|m| m.number());
        // MariaDB/MySQL's ER_NET_PACKET_TOO_LARGE (SQLSTATE 08S01, which
        // would read as a lost connection below): the statement is larger
        // than the server takes, and sending it again cannot work.
        if mysql_number == Some(1153) {
            return StorageError::TooLarge(format!(
                "the data is larger than the database takes in one statement ({}); \
                 raise the server's max_allowed_packet or send less",
                d.message()
            ));
        }
        let transient = matches!(code.as_str(), "40001" | "40P01" | "55P03")
            || matches!(mysql_number, Some(1205 | 1213))
            // SQLite: SQLITE_BUSY and SQLITE_LOCKED with their extended codes.
            || matches!(code.as_str(), "5" | "6" | "261" | "262" | "517" | "773");
        if transient {
            return StorageError::Conflict(format!(
                "{TRANSIENT_PREFIX} conflicted with this request; retry"
            ));
        }
        // A server that refuses connections is as unavailable as one that
        // cannot be reached (audit 76): connection exceptions (class 08,
        // MariaDB's "too many connections" 08004 among them), a shutting
        // down or starting server (57P01-57P03), too many connections
        // (53300), a database closed to connections (55000 "is not
        // currently accepting connections"), MariaDB's shutdown (1053); and,
        // on connecting, a database that is not there (3D000, MariaDB 1049)
        // or a login refused (28000, 28P01, MariaDB 1045) (audit 83: both
        // were a 500 while /health said the database was unavailable).
        let refusing = code.starts_with("08")
            || matches!(
                code.as_str(),
                "57P01" | "57P02" | "57P03" | "53300" | "3D000" | "28000" | "28P01"
            )
            || (code == "55000" && d.message().contains("accepting connections"))
            || matches!(mysql_number, Some(1040 | 1053 | 1049 | 1045));
        if refusing {
            return StorageError::Unavailable(format!("database unavailable: {}", d.message()));
        }
        return StorageError::Database(format!("database error: {}", d.message()));
    }
    StorageError::Database(format!("database error: {e}"))
}

/// Maps a unique violation to `msg` (e.g. "workflow 'x' already exists").
pub(crate) fn unique_as(msg: impl FnOnce() -> String) -> impl FnOnce(StorageError) -> StorageError {
    move |e| match e {
        StorageError::Conflict(m) if m.starts_with(TRANSIENT_PREFIX) => {
            StorageError::Conflict(msg())
        }
        other => other,
    }
}

/// Runs `op` again when it lost a race (deadlock, busy, serialization failure);
/// unique violations are answered by the lifecycle checks on the next attempt,
/// which then produce the precise Conflict message.
pub(crate) async fn retry<T, F, Fut>(op: F) -> Result<T, StorageError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StorageError>>,
{
    retry_at_most(5, op).await
}

/// [`retry`], running `op` at most `tries` times.
pub(crate) async fn retry_at_most<T, F, Fut>(tries: u32, mut op: F) -> Result<T, StorageError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StorageError>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Err(e) if is_transient(&e) && attempt + 1 < tries => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(5 * u64::from(attempt))).await;
            }
            other => return other,
        }
    }
}

/// Microseconds since the Unix epoch, the stored timestamp unit.
pub(crate) fn now_micros() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Renders stored microseconds as RFC 3339 UTC with whole seconds (`2026-11-22T10:15:00Z`).
pub(crate) fn rfc3339(micros: i64) -> String {
    let secs = micros.div_euclid(1_000_000);
    match time::OffsetDateTime::from_unix_timestamp(secs) {
        Ok(t) => t
            .format(time::macros::format_description!(
                "[year]-[month]-[day]T[hour]:[minute]:[second]Z"
            ))
            .unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Parses definition text read from the database (one serde_json parse per row).
pub(crate) fn parse_json(text: &str) -> Result<Json, StorageError> {
    serde_json::from_str(text)
        .map_err(|e| StorageError::Database(format!("stored JSON is invalid: {e}")))
}

static MIGRATOR_SQLITE: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");
static MIGRATOR_POSTGRES: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");
static MIGRATOR_MYSQL: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/mysql");

impl Store {
    /// Opens a pool for `url`: `sqlite://path` (created if missing, WAL, foreign
    /// keys on) or `sqlite::memory:`, `postgres://`/`postgresql://`,
    /// `mysql://`/`mariadb://`. Connects eagerly so a bad URL fails at start-up.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Store, StorageError> {
        let scheme = url
            .split_once(':')
            .map(|(s, _)| s.to_ascii_lowercase())
            .unwrap_or_default();
        let max = max_connections.max(1);
        // How long a request waits for a pooled connection (and connect() for the server).
        let acquire = Duration::from_secs(10);
        let connect_err = |b: &str, e: sqlx::Error| {
            // sqlx errors do not echo the URL; keep it that way (it may hold a password).
            StorageError::Database(format!("cannot connect to {b} storage: {e}"))
        };
        let mut shareable = true;
        let mut sqlite_writer = None;
        let (pools, backend) = match scheme.as_str() {
            "sqlite" => {
                // `sqlite://` with no path: sqlx opens a private in-memory
                // database per connection, so migrations and queries would
                // each see a different one.
                let path = url["sqlite:".len()..].trim_start_matches('/');
                if path.is_empty() || path.starts_with('?') {
                    return Err(StorageError::BadRequest(
                        "invalid storage.url: it names no database file (sqlite://path/to/file.db, or sqlite::memory:)".into(),
                    ));
                }
                let memory = url.contains(":memory:") || url.contains("mode=memory");
                shareable = !memory;
                let opts = SqliteConnectOptions::from_str(url)
                    .map_err(|e| StorageError::BadRequest(format!("invalid storage.url: {e}")))?;
                // A new database file holds connector secrets: created
                // readable by the owner only (SQLite gives its `-wal` and
                // `-shm` files the database's mode).
                #[cfg(unix)]
                if !memory && !opts.get_filename().exists() {
                    use std::os::unix::fs::OpenOptionsExt as _;
                    let _ = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(opts.get_filename());
                }
                let opts = opts
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Normal)
                    .foreign_keys(true)
                    // Writers queue on BEGIN IMMEDIATE; wait rather than fail.
                    .busy_timeout(Duration::from_secs(10));
                let mut pool = SqlitePoolOptions::new().acquire_timeout(acquire);
                // Each connection to `:memory:` is its own database: keep exactly one, forever.
                pool = if memory {
                    pool.max_connections(1)
                        .min_connections(1)
                        .idle_timeout(None)
                        .max_lifetime(None)
                } else {
                    pool.max_connections(max)
                };
                let p = pool
                    .connect_with(opts.clone())
                    .await
                    .map_err(|e| connect_err("SQLite", e))?;
                if !memory {
                    // Opened at the first write (a reload's read-only twin
                    // never opens it); not pinged before each use (a local
                    // file's connection, and the ping is a round trip to its
                    // thread).
                    sqlite_writer = Some(
                        SqlitePoolOptions::new()
                            .acquire_timeout(acquire)
                            .max_connections(1)
                            .test_before_acquire(false)
                            .connect_lazy_with(opts),
                    );
                }
                (Pools::Sqlite(p), Backend::Sqlite)
            }
            "postgres" | "postgresql" => {
                let opts = PgConnectOptions::from_str(url)
                    .map_err(|e| StorageError::BadRequest(format!("invalid storage.url: {e}")))?;
                probe(&opts, "PostgreSQL", acquire).await?;
                let p = PgPoolOptions::new()
                    .max_connections(max)
                    .acquire_timeout(acquire)
                    .connect_with(opts)
                    .await
                    .map_err(|e| connect_err("PostgreSQL", e))?;
                (Pools::Postgres(p), Backend::Postgres)
            }
            "mysql" | "mariadb" => {
                // sqlx only knows the mysql:// scheme; MariaDB speaks the same protocol.
                let url = format!("mysql:{}", &url[scheme.len() + 1..]);
                let opts = MySqlConnectOptions::from_str(&url)
                    .map_err(|e| StorageError::BadRequest(format!("invalid storage.url: {e}")))?
                    .charset("utf8mb4");
                probe(&opts, "MySQL", acquire).await?;
                let p = MySqlPoolOptions::new()
                    .max_connections(max)
                    .acquire_timeout(acquire)
                    .connect_with(opts)
                    .await
                    .map_err(|e| connect_err("MariaDB/MySQL", e))?;
                (Pools::MySql(p), Backend::MySql)
            }
            other => {
                return Err(StorageError::BadRequest(format!(
                    "unsupported storage.url scheme '{other}' (expected sqlite:, postgres:, postgresql:, mysql: or mariadb:)"
                )));
            }
        };
        let json_depth = json_depth_of(&pools).await;
        let max_packet = match &pools {
            Pools::MySql(p) => sqlx::query_scalar::<_, u64>("SELECT @@max_allowed_packet")
                .fetch_one(p)
                .await
                .ok()
                .and_then(|n| usize::try_from(n).ok()),
            _ => None,
        };
        Ok(Store {
            inner: Arc::new(Inner {
                pools,
                backend,
                sql: Sql::new(backend),
                backup_lock: tokio::sync::Mutex::new(()),
                write_gate: tokio::sync::Semaphore::new(1),
                sqlite_writer,
                submissions: std::sync::Mutex::new(Vec::new()),
                url: shareable.then(|| url.to_owned()),
                json_depth,
                max_packet,
            }),
        })
    }

    /// The largest definition (its JSON text, in bytes) one statement can
    /// store: MariaDB/MySQL's `max_allowed_packet` less room for the
    /// statement's other values; `None` when the database sets no such
    /// limit below what an admin body may hold.
    pub fn definition_limit(&self) -> Option<usize> {
        self.inner.max_packet.map(|n| n.saturating_sub(PACKET_ROOM))
    }

    /// `TooLarge` (a 413 naming both sizes) when `size` bytes of `what`
    /// would pass [`Self::definition_limit`]: judged before sending, since
    /// the server may close the connection while such a statement is still
    /// being sent, which reads as a lost connection (a 503).
    pub fn fits_one_statement(&self, what: &str, size: usize) -> Result<(), StorageError> {
        match self.definition_limit() {
            Some(limit) if size > limit => Err(StorageError::TooLarge(format!(
                "the {what} is {size} bytes as stored; this database ({}) stores at most {limit} \
                 in one statement (its max_allowed_packet less room for the rest); \
                 raise max_allowed_packet on the server or send less",
                self.backend().as_str()
            ))),
            _ => Ok(()),
        }
    }

    /// How deep stored JSON (trace payloads and results) may nest on this
    /// database; `None` when it keeps anything the executor can build.
    pub fn json_depth(&self) -> Option<usize> {
        self.inner.json_depth
    }

    /// A second store on the same database with one connection of its own,
    /// for work that runs on its own thread and runtime (the engine reload,
    /// at background priority: the connection, and on SQLite its worker
    /// thread, belong to the thread that opens it). `None` when the
    /// database is in-memory SQLite, which only this store's connection
    /// sees. Must be called on a Tokio runtime, like [`Store::connect`].
    pub async fn twin(&self) -> Option<Result<Store, StorageError>> {
        let url = self.inner.url.as_deref()?;
        Some(Store::connect(url, 1).await)
    }

    /// Whether [`Store::twin`] can open a second connection.
    pub fn has_twin(&self) -> bool {
        self.inner.url.is_some()
    }

    /// Applies the embedded migrations of this backend (idempotent).
    pub async fn migrate(&self) -> Result<(), StorageError> {
        let r = match &self.inner.pools {
            Pools::Sqlite(p) => MIGRATOR_SQLITE.run(p).await,
            Pools::Postgres(p) => MIGRATOR_POSTGRES.run(p).await,
            Pools::MySql(p) => return self.migrate_mysql(p).await,
        };
        r.map_err(|e| StorageError::Database(format!("migration failed: {e}")))?;
        // Rows written before 0004 get their digest once, and channels their
        // effective type and protocol.
        self.backfill().await
    }

    /// MySQL/MariaDB migrations under a lock of our own. sqlx's takes
    /// `GET_LOCK(name, -1)`, which MariaDB answers with NULL at once instead
    /// of waiting, so replicas started together ran the same migrations at
    /// once and failed ("migration 1 is partially applied", duplicate keys).
    /// `GET_LOCK` with a positive wait works on both; the migrations run on
    /// the connection that holds it, and closing it releases it.
    async fn migrate_mysql(&self, pool: &sqlx::MySqlPool) -> Result<(), StorageError> {
        const WAIT_SECS: i64 = 300;
        let mut conn = pool.acquire().await.map_err(db_err)?;
        let got: Option<i64> =
            sqlx::query_scalar("SELECT GET_LOCK(CONCAT('sluice_migrate:', DATABASE()), ?)")
                .bind(WAIT_SECS)
                .fetch_one(&mut *conn)
                .await
                .map_err(db_err)?;
        if got != Some(1) {
            return Err(StorageError::Database(format!(
                "migration failed: another process kept the migration lock for {WAIT_SECS} s"
            )));
        }
        // `run_direct`: `run(&mut *conn)` is not `Send` (sqlx's `Acquire` bound).
        let r = MIGRATOR_MYSQL.run_direct(&mut *conn).await;
        let released = sqlx::query("SELECT RELEASE_LOCK(CONCAT('sluice_migrate:', DATABASE()))")
            .execute(&mut *conn)
            .await;
        if released.is_err() {
            // The lock goes with the connection.
            drop(conn.detach());
        } else {
            drop(conn);
        }
        r.map_err(|e| StorageError::Database(format!("migration failed: {e}")))?;
        // Rows written before 0004 get their digest once, and channels their
        // effective type and protocol.
        self.backfill().await
    }

    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// `SELECT 1`, for /health and /readyz.
    pub async fn ping(&self) -> Result<(), StorageError> {
        dispatch!(self, pool => {
            fetch_one!(pool, "SELECT 1")?;
        });
        Ok(())
    }

    /// Closes the pool (waits for connections to be returned). For shutdown and tests.
    pub async fn close(&self) {
        if let Some(writer) = &self.inner.sqlite_writer {
            writer.close().await;
        }
        dispatch!(self, pool => pool.close().await)
    }

    /// Ends the process's use of storage: on SQLite, first moves everything
    /// in the write-ahead log into the database file and empties the log
    /// (`wal_checkpoint(TRUNCATE)`), so the stopped service leaves one
    /// complete file. Before, the data stayed in `-wal` (the `.db` itself a
    /// 4 KB stub), and a backup copied over the file was overlaid at the
    /// next start by the old log: the restore silently did nothing.
    ///
    /// The pool is closed first (no write can follow), then the checkpoint
    /// runs on a connection of its own; a checkpoint that could not finish
    /// (another process still reading) is logged.
    pub async fn shutdown(&self) {
        self.close().await;
        let (Pools::Sqlite(_), Some(url)) = (&self.inner.pools, &self.inner.url) else {
            return;
        };
        use sqlx::Connection as _;
        let done = async {
            let mut conn = sqlx::SqliteConnection::connect(url).await?;
            let (busy, _, _): (i64, i64, i64) = sqlx::query_as("PRAGMA wal_checkpoint(TRUNCATE)")
                .fetch_one(&mut conn)
                .await?;
            conn.close().await?;
            Ok::<_, sqlx::Error>(busy == 0)
        };
        match done.await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                "the SQLite write-ahead log could not be emptied at shutdown (the database is in use)"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "could not checkpoint the SQLite write-ahead log at shutdown");
            }
        }
    }

    pub(crate) fn sql(&self) -> &Sql {
        &self.inner.sql
    }
}

/// Opens one connection before the pool is built: when the server cannot
/// be reached, the pool only reports that it timed out waiting, while a
/// direct connection says why (refused, unknown host, bad password).
async fn probe<O>(opts: &O, backend: &str, wait: Duration) -> Result<(), StorageError>
where
    O: sqlx::ConnectOptions,
    O::Connection: Sized,
{
    use sqlx::Connection as _;
    match tokio::time::timeout(wait, opts.connect()).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        // sqlx errors do not echo the URL (it may hold a password).
        Ok(Err(e)) => Err(StorageError::Database(format!(
            "cannot connect to {backend} storage: {e}"
        ))),
        Err(_) => Err(StorageError::Database(format!(
            "cannot connect to {backend} storage: no answer within {} s",
            wait.as_secs()
        ))),
    }
}
