//! The `db` connector client: one lazily connecting sqlx pool over SQLite,
//! PostgreSQL or MariaDB/MySQL (chosen by the URL scheme) that runs the user's
//! query as written, binds JSON parameters in order and turns rows into JSON
//! objects by each column's type.
//!
//! Type mapping (a cell whose type cannot be rendered is an error naming the
//! column, never a panic):
//!
//! | database type | JSON |
//! |---|---|
//! | integers (any width, signed/unsigned, `YEAR`, `OID`) | number |
//! | `REAL`/`FLOAT`/`DOUBLE` | number; NaN and ±Infinity as the strings `"NaN"`, `"Infinity"`, `"-Infinity"` |
//! | `NUMERIC`/`DECIMAL` | number: an integral value that fits `i64` exactly, otherwise the nearest `f64` (about 15–17 significant digits; JSON numbers here are `f64`, so cast to text in the query when every digit matters); NaN as `"NaN"` |
//! | text types, `ENUM`, `SET`, PostgreSQL enums, `UUID` | string |
//! | `BOOL`, MySQL `TINYINT(1)`/`BOOLEAN`, SQLite columns declared `BOOLEAN` | boolean |
//! | `TIMESTAMPTZ`, MySQL `TIMESTAMP` | RFC 3339 string in UTC (`2026-11-22T10:15:00Z`, fraction only when non-zero) |
//! | `TIMESTAMP` (PostgreSQL), `DATETIME` | RFC 3339 string, the zone-less value taken as UTC |
//! | `DATE` / `TIME` | `YYYY-MM-DD` / `HH:MM:SS[.fraction]` (RFC 3339 full-date / partial-time; PostgreSQL's `24:00:00` as is; MySQL's durations as `[-]HHH:MM:SS`, e.g. `-02:30:00`, `838:59:59`) |
//! | PostgreSQL `infinity` / `-infinity` (`DATE`, `TIMESTAMP`, `TIMESTAMPTZ`) | the strings `"infinity"` / `"-infinity"`; other values beyond year 9999 are an error suggesting a cast to text |
//! | `JSON`/`JSONB` (PostgreSQL, MySQL) | the JSON value itself |
//! | `BYTEA`, SQLite `BLOB` values, MySQL `GEOMETRY` | standard base64 string |
//! | MySQL `BINARY`/`VARBINARY`/`BLOB` | string when the bytes are valid UTF-8, else base64 (see below) |
//! | MySQL `BIT(n)` | number |
//! | PostgreSQL one-dimensional arrays of booleans, integers, floats, text types, `JSON`/`JSONB` | array (NULL elements as null) |
//! | `NULL` | null |
//!
//! SQLite is dynamically typed: a cell is rendered by the value's storage class
//! (INTEGER, REAL, TEXT, BLOB, NULL), so dates stored as text come back as
//! stored. MariaDB's `JSON` is an alias for `LONGTEXT`, and the server does not
//! tell a client without MariaDB's extended metadata that it holds JSON, so it
//! comes back as a string. MySQL marks binary strings and text columns with a
//! binary (`_bin`) collation the same way, and sqlx does not expose the
//! collation that tells them apart, so MySQL binary columns holding valid
//! UTF-8 come back as strings and only other bytes as base64 (cast with
//! `TO_BASE64(col)` or `HEX(col)` in the query for a fixed form). Other PostgreSQL types (other arrays, intervals, ranges,
//! geometric, network types) are an error that suggests casting in the query
//! (`col::text`, `to_jsonb(col)`).
//!
//! Parameters: JSON null, booleans, integers (`i64`; larger `u64` values as
//! `f64` except on MySQL, which takes `u64`), floats and strings bind as the
//! matching SQL type; arrays and objects bind as their JSON text (on
//! PostgreSQL write `CAST($1 AS JSONB)` to store them in a JSONB column). A
//! PostgreSQL null is sent untyped so the server infers its type from context.
//! A PostgreSQL string is sent as `text` (parameters travel in binary form,
//! so the server cannot parse an untyped one as another type): compare or
//! store it in a column of another type with a cast, `WHERE id = $1::int`,
//! `$1::uuid`, `$1::date`, `$1::numeric` (a path parameter is always a
//! string). MySQL and MariaDB convert by themselves.
//!
//! Timeouts: `connect_timeout_ms` bounds waiting for a pooled connection
//! (including connecting); `query_timeout_ms` bounds each query. A query that
//! runs out of time fails with `Timeout`, and its connection is closed rather
//! than returned to the pool, so the next query never waits behind it;
//! PostgreSQL also gets `statement_timeout` and MariaDB `max_statement_time`
//! so the server stops the statement. A `db_write` the client stopped
//! waiting for is not retried: it may still commit.

use base64::Engine as _;
use serde_json::{Map, Number, Value as Json};
use sluice_compiler::def::DbConnector;
use sluice_runtime::connectors::{ConnectorError, ConnectorErrorKind};
use sqlx::mysql::{MySqlArguments, MySqlConnectOptions, MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::postgres::{
    PgArguments, PgConnectOptions, PgPool, PgPoolOptions, PgRow, PgTypeInfo, PgTypeKind,
};
use sqlx::query::Query;
use sqlx::sqlite::{
    SqliteArguments, SqliteConnectOptions, SqlitePool, SqlitePoolOptions, SqliteRow,
};
use sqlx::{Column as _, Row as _, TypeInfo as _, ValueRef as _};
use std::str::FromStr;
use std::time::Duration;

/// Pool size when the connector does not say.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 10;
/// Per-query limit when the connector does not say (the spec's default for
/// connector calls, as for `http_call`).
pub const DEFAULT_QUERY_TIMEOUT_MS: u64 = 30_000;
/// How long a query waits for a pooled connection (and so for connecting)
/// when the connector does not say.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 5_000;

enum Pools {
    Sqlite(SqlitePool),
    Postgres(PgPool),
    MySql(MySqlPool),
}

/// A pool for one `db` connector; cheap to share behind an `Arc`.
pub struct SqlPool {
    pools: Pools,
    query_timeout: Duration,
}

impl std::fmt::Debug for SqlPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the connection string: it may hold a password.
        let backend = match self.pools {
            Pools::Sqlite(_) => "sqlite",
            Pools::Postgres(_) => "postgres",
            Pools::MySql(_) => "mysql",
        };
        f.debug_struct("SqlPool")
            .field("backend", &backend)
            .field("query_timeout", &self.query_timeout)
            .finish()
    }
}

/// Runs `$body` once per backend with `$pool` bound to the concrete pool, so
/// the body is written once and type-checked against each driver (as
/// `storage::dispatch!` does for the store).
macro_rules! dispatch {
    ($self:expr, $pool:ident => $body:expr) => {
        match &$self.pools {
            Pools::Sqlite($pool) => $body,
            Pools::Postgres($pool) => $body,
            Pools::MySql($pool) => $body,
        }
    };
}

/// Acquires a connection, runs `$run` on it under the query timeout, and on a
/// timeout closes that connection instead of pooling it: the server may still
/// be busy with the statement, and a pooled connection would make the next
/// query wait for it. With `refuse`, a result it refuses (`Some(error)`) is
/// an error too, and closes the connection the same way.
macro_rules! timed {
    ($self:expr, $pool:expr, $conn:ident => $run:expr) => {
        timed!($self, $pool, $conn => $run, refuse: |_| None, timeout: timeout_err)
    };
    ($self:expr, $pool:expr, $conn:ident => $run:expr, refuse: $refuse:expr) => {
        timed!($self, $pool, $conn => $run, refuse: $refuse, timeout: timeout_err)
    };
    ($self:expr, $pool:expr, $conn:ident => $run:expr, timeout: $timeout:expr) => {
        timed!($self, $pool, $conn => $run, refuse: |_| None, timeout: $timeout)
    };
    ($self:expr, $pool:expr, $conn:ident => $run:expr, refuse: $refuse:expr, timeout: $timeout:expr) => {{
        let mut $conn = match $pool.acquire().await {
            Ok(conn) => conn,
            Err(e) => return Err(acquire_failed(e, $pool).await),
        };
        match tokio::time::timeout($self.query_timeout, $run).await {
            Ok(Ok(value)) => match $refuse(&value) {
                None => Ok(value),
                Some(e) => {
                    drop($conn.detach());
                    Err(e)
                }
            },
            Ok(Err(e)) => Err(query_err(e, $pool)),
            Err(_) => {
                drop($conn.detach());
                Err($timeout($self.query_timeout))
            }
        }
    }};
}

/// The most rows one `db_read` returns (like `mongo_read`'s documents): a
/// broad query must not hold the whole table in memory.
pub const MAX_ROWS: usize = 10_000;

/// Reads at most `MAX_ROWS + 1` rows (one more tells that there are more);
/// the rest are never fetched.
async fn at_most<R>(
    rows: impl futures_util::Stream<Item = Result<R, sqlx::Error>>,
) -> Result<Vec<R>, sqlx::Error> {
    use futures_util::TryStreamExt;
    let mut rows = std::pin::pin!(rows);
    let mut out = Vec::new();
    while let Some(row) = rows.try_next().await? {
        out.push(row);
        if out.len() > MAX_ROWS {
            break;
        }
    }
    Ok(out)
}

/// Refuses a `db_read` with more than `MAX_ROWS` rows (its statement is
/// abandoned, and `timed!` closes the connection it may still run on).
/// SQLite runs every statement of a text (`SELECT 1; DROP TABLE t` through
/// `db_read` dropped the table), where PostgreSQL and MariaDB refuse one
/// with two. The definition check refuses what both its readings see as
/// two; this reads the text exactly as SQLite does, so a `;` that one of
/// those readings took for part of a string or comment cannot slip by.
fn one_sqlite_statement(query: &str) -> Result<(), ConnectorError> {
    match sluice_compiler::validate::sqlite_statements(query) {
        n if n > 1 => Err(ConnectorError::other(format!(
            "SQLite runs one statement per task; this query holds {n} separated by ';' \
             (run each in a task of its own)"
        ))),
        _ => Ok(()),
    }
}

/// How many values the statement takes, as the server counted them when
/// it prepared it (sqlx keeps the prepared statement, so the query's own
/// run does not prepare it again). MySQL's driver binds the values it is
/// given without comparing: one too many was read as garbage (`SELECT ?`
/// with `[42, 7]` answered `2752520`; an `UPDATE` with an extra value
/// matched no row and answered 200).
async fn mysql_placeholders(
    conn: &mut sqlx::MySqlConnection,
    query: &str,
) -> Result<usize, sqlx::Error> {
    use sqlx::{Executor as _, Statement as _};
    let statement = conn.prepare(query).await?;
    Ok(match statement.parameters() {
        Some(sqlx::Either::Right(n)) => n,
        Some(sqlx::Either::Left(types)) => types.len(),
        None => 0,
    })
}

fn placeholder_mismatch(holes: usize, given: usize) -> ConnectorError {
    let plural = |n: usize, one: &'static str, many: &'static str| if n == 1 { one } else { many };
    ConnectorError::other(format!(
        "the query has {holes} {} ('?') but params gives {given} {}; give one value per '?'",
        plural(holes, "placeholder", "placeholders"),
        plural(given, "value", "values"),
    ))
}

fn too_many<R>(rows: &[R]) -> Option<ConnectorError> {
    (rows.len() > MAX_ROWS).then(|| {
        ConnectorError::other(format!(
            "the query returns more than {MAX_ROWS} rows (the most one db_read returns); \
             narrow it or add a LIMIT"
        ))
    })
}

impl SqlPool {
    /// Builds the pool without connecting: a database that is down when the
    /// connector is loaded fails the calls (retryably), not the load.
    pub async fn connect(cfg: &DbConnector) -> Result<SqlPool, ConnectorError> {
        let url = cfg.connection_string.trim();
        let scheme = url
            .split_once(':')
            .map(|(s, _)| s.to_ascii_lowercase())
            .unwrap_or_default();
        let max = cfg
            .max_connections
            .unwrap_or(DEFAULT_MAX_CONNECTIONS)
            .max(1);
        let acquire = Duration::from_millis(
            cfg.connect_timeout_ms
                .unwrap_or(DEFAULT_CONNECT_TIMEOUT_MS)
                .max(1),
        );
        let query_timeout_ms = cfg
            .query_timeout_ms
            .unwrap_or(DEFAULT_QUERY_TIMEOUT_MS)
            .max(1);
        // sqlx's parse errors do not echo the URL; keep it that way.
        let bad_url = |e: sqlx::Error| {
            ConnectorError::other(format!("invalid connection_string for {scheme}: {e}"))
        };
        let pools = match scheme.as_str() {
            "sqlite" => {
                // No create_if_missing: a typo in the path must not silently
                // create an empty database (`?mode=rwc` asks for creation).
                let opts = SqliteConnectOptions::from_str(url)
                    .map_err(bad_url)?
                    .busy_timeout(acquire);
                let memory = url.contains(":memory:") || url.contains("mode=memory");
                let mut pool = SqlitePoolOptions::new().acquire_timeout(acquire);
                // Every connection to `:memory:` is its own database: keep one, forever.
                pool = if memory {
                    pool.max_connections(1)
                        .min_connections(1)
                        .idle_timeout(None)
                        .max_lifetime(None)
                } else {
                    pool.max_connections(max)
                };
                Pools::Sqlite(pool.connect_lazy_with(opts))
            }
            "postgres" | "postgresql" => {
                // The server stops a statement that outlives the timeout too,
                // rather than running on after the client gave up.
                let opts = PgConnectOptions::from_str(url)
                    .map_err(bad_url)?
                    .options([("statement_timeout", query_timeout_ms.to_string())]);
                Pools::Postgres(
                    PgPoolOptions::new()
                        .max_connections(max)
                        .acquire_timeout(acquire)
                        .connect_lazy_with(opts),
                )
            }
            "mysql" | "mariadb" => {
                // sqlx only knows mysql://; MariaDB speaks the same protocol.
                let url = format!("mysql:{}", &url[scheme.len() + 1..]);
                let opts = MySqlConnectOptions::from_str(&url)
                    .map_err(bad_url)?
                    .charset("utf8mb4");
                // MariaDB stops a statement that outlives the timeout too
                // (`max_statement_time`, seconds); MySQL has no such
                // setting for writes and refuses it, which is ignored.
                let limit = format!(
                    "SET SESSION max_statement_time = {}",
                    query_timeout_ms as f64 / 1000.0
                );
                Pools::MySql(
                    MySqlPoolOptions::new()
                        .max_connections(max)
                        .acquire_timeout(acquire)
                        .after_connect(move |conn, _| {
                            let limit = limit.clone();
                            Box::pin(async move {
                                use sqlx::Executor as _;
                                let _ = conn.execute(limit.as_str()).await;
                                Ok(())
                            })
                        })
                        .connect_lazy_with(opts),
                )
            }
            other => {
                return Err(ConnectorError::other(format!(
                    "unsupported connection_string scheme '{other}' (expected sqlite:, postgres:, postgresql:, mysql: or mariadb:)"
                )));
            }
        };
        Ok(SqlPool {
            pools,
            query_timeout: Duration::from_millis(query_timeout_ms),
        })
    }

    /// Runs a query and returns its rows as JSON objects keyed by column name
    /// (a repeated name keeps the last column's value at the first position).
    pub async fn read(&self, query: &str, params: &[Json]) -> Result<Vec<Json>, ConnectorError> {
        match &self.pools {
            Pools::Sqlite(pool) => {
                one_sqlite_statement(query)?;
                let q = params.iter().fold(sqlx::query(query), bind_sqlite);
                let rows =
                    timed!(self, pool, conn => at_most(q.fetch(&mut *conn)), refuse: too_many)?;
                rows.iter().map(|r| row_json(r, sqlite_cell)).collect()
            }
            Pools::Postgres(pool) => {
                let q = params.iter().fold(pg_query(query), bind_pg);
                let rows =
                    timed!(self, pool, conn => at_most(q.fetch(&mut *conn)), refuse: too_many)?;
                rows.iter().map(|r| row_json(r, pg_cell)).collect()
            }
            Pools::MySql(pool) => {
                let q = params.iter().fold(sqlx::query(query), bind_mysql);
                let given = params.len();
                let rows = timed!(self, pool, conn => async {
                    let holes = mysql_placeholders(&mut conn, query).await?;
                    if holes != given {
                        return Ok(Err(holes));
                    }
                    at_most(q.fetch(&mut *conn)).await.map(Ok)
                }, refuse: |r: &Result<Vec<MySqlRow>, usize>| match r {
                    Err(holes) => Some(placeholder_mismatch(*holes, given)),
                    Ok(rows) => too_many(rows),
                })?
                .unwrap_or_default();
                rows.iter().map(|r| row_json(r, mysql_cell)).collect()
            }
        }
    }

    /// Runs a statement and returns the rows it affected.
    pub async fn write(&self, query: &str, params: &[Json]) -> Result<u64, ConnectorError> {
        match &self.pools {
            Pools::Sqlite(pool) => {
                one_sqlite_statement(query)?;
                let q = params.iter().fold(sqlx::query(query), bind_sqlite);
                timed!(self, pool, conn => q.execute(&mut *conn), timeout: write_timeout_err)
                    .map(|r| r.rows_affected())
            }
            Pools::Postgres(pool) => {
                let q = params.iter().fold(pg_query(query), bind_pg);
                timed!(self, pool, conn => q.execute(&mut *conn), timeout: write_timeout_err)
                    .map(|r| r.rows_affected())
            }
            Pools::MySql(pool) => {
                let q = params.iter().fold(sqlx::query(query), bind_mysql);
                let given = params.len();
                let done = timed!(self, pool, conn => async {
                    let holes = mysql_placeholders(&mut conn, query).await?;
                    if holes != given {
                        return Ok(Err(holes));
                    }
                    q.execute(&mut *conn).await.map(Ok)
                }, refuse: |r: &Result<_, usize>| r
                    .as_ref()
                    .err()
                    .map(|holes| placeholder_mismatch(*holes, given)),
                timeout: write_timeout_err)?;
                Ok(done.map_or(0, |r| r.rows_affected()))
            }
        }
    }

    /// Closes the pool, waiting for connections in use to come back (for a
    /// connector that is replaced or deleted, and tests).
    pub async fn close(&self) {
        dispatch!(self, pool => pool.close().await)
    }
}

// ---- parameters -------------------------------------------------------------

type SqliteQuery<'q> = Query<'q, sqlx::Sqlite, SqliteArguments<'q>>;
type PgQuery<'q> = Query<'q, sqlx::Postgres, PgArguments>;
type MySqlQuery<'q> = Query<'q, sqlx::MySql, MySqlArguments>;

fn bind_sqlite<'q>(q: SqliteQuery<'q>, v: &Json) -> SqliteQuery<'q> {
    match v {
        Json::Null => q.bind(None::<i64>),
        Json::Bool(b) => q.bind(*b),
        Json::Number(n) => match n.as_i64() {
            Some(i) => q.bind(i),
            None => q.bind(n.as_f64()),
        },
        Json::String(s) => q.bind(s.clone()),
        other => q.bind(other.to_string()),
    }
}

/// A PostgreSQL statement that is not cached. A JSON null binds untyped (the
/// server infers the column's type), and a statement cached from that call
/// keeps the inferred type: a later integer's `INT8` bytes would then be read
/// as a `FLOAT8` (1 stored as 5e-324). Unnamed statements are parsed with
/// each call's own types.
fn pg_query(query: &str) -> PgQuery<'_> {
    sqlx::query(query).persistent(false)
}

fn bind_pg<'q>(q: PgQuery<'q>, v: &Json) -> PgQuery<'q> {
    match v {
        Json::Null => q.bind(UntypedNull),
        Json::Bool(b) => q.bind(*b),
        Json::Number(n) => match n.as_i64() {
            Some(i) => q.bind(i),
            None => q.bind(n.as_f64()),
        },
        Json::String(s) => q.bind(s.clone()),
        other => q.bind(other.to_string()),
    }
}

fn bind_mysql<'q>(q: MySqlQuery<'q>, v: &Json) -> MySqlQuery<'q> {
    match v {
        Json::Null => q.bind(None::<i64>),
        Json::Bool(b) => q.bind(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                q.bind(i)
            } else if let Some(u) = n.as_u64() {
                q.bind(u)
            } else {
                q.bind(n.as_f64())
            }
        }
        Json::String(s) => q.bind(s.clone()),
        other => q.bind(other.to_string()),
    }
}

/// A PostgreSQL NULL parameter of unspecified type (OID 0): the server infers
/// the type from where `$n` is used, so `INSERT INTO t (int_col) VALUES ($1)`
/// works, where a NULL typed as TEXT would be rejected.
struct UntypedNull;

impl sqlx::Type<sqlx::Postgres> for UntypedNull {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(sqlx::postgres::types::Oid(0))
    }
}

impl sqlx::Encode<'_, sqlx::Postgres> for UntypedNull {
    fn encode_by_ref(
        &self,
        _buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        Ok(sqlx::encode::IsNull::Yes)
    }
}

// ---- rows -------------------------------------------------------------------

type CellResult = Result<Json, String>;

/// One row as a JSON object; a cell that cannot be decoded fails the read with
/// the column's name and type.
fn row_json<R: sqlx::Row>(
    row: &R,
    cell: fn(&R, usize, &str) -> CellResult,
) -> Result<Json, ConnectorError> {
    let mut obj = Map::with_capacity(row.len());
    for (i, col) in row.columns().iter().enumerate() {
        let ty = col.type_info().name().to_owned();
        // The database answered; reading its answer failed here (a type
        // with no JSON form): a task error, not an upstream one (audit 67).
        let v = cell(row, i, &ty).map_err(|e| {
            ConnectorError::new(
                ConnectorErrorKind::Other,
                format!("column '{}' (type {ty}): {e}", col.name()),
            )
        })?;
        obj.insert(col.name().to_owned(), v);
    }
    Ok(Json::Object(obj))
}

fn de<T>(r: Result<T, sqlx::Error>) -> Result<T, String> {
    r.map_err(|e| e.to_string())
}

fn sqlite_cell(row: &SqliteRow, i: usize, declared: &str) -> CellResult {
    let raw = de(row.try_get_raw(i))?;
    if raw.is_null() {
        return Ok(Json::Null);
    }
    // The value's storage class decides; the declared type only adds booleans.
    let class = raw.type_info().name().to_owned();
    Ok(match class.as_str() {
        "INTEGER" | "BOOLEAN" if declared.eq_ignore_ascii_case("BOOLEAN") => {
            Json::Bool(de(row.try_get_unchecked::<i64, _>(i))? != 0)
        }
        "INTEGER" | "BOOLEAN" => Json::from(de(row.try_get_unchecked::<i64, _>(i))?),
        "REAL" => float(de(row.try_get_unchecked::<f64, _>(i))?),
        "BLOB" => base64_json(&de(row.try_get_unchecked::<Vec<u8>, _>(i))?),
        // TEXT, and whatever else SQLite reports (DATETIME, NUMERIC ...)
        // for a value it stored as text.
        _ => match row.try_get_unchecked::<String, _>(i) {
            Ok(s) => Json::String(s),
            Err(_) => base64_json(&de(row.try_get_unchecked::<Vec<u8>, _>(i))?),
        },
    })
}

fn pg_cell(row: &PgRow, i: usize, _name: &str) -> CellResult {
    let raw = de(row.try_get_raw(i))?;
    if raw.is_null() {
        return Ok(Json::Null);
    }
    let info = raw.type_info().into_owned();
    // A domain decodes as its base type.
    let base = match info.kind() {
        PgTypeKind::Domain(b) => b.clone(),
        _ => info.clone(),
    };
    let text = || de(row.try_get_unchecked::<String, _>(i)).map(Json::String);
    Ok(match base.name() {
        "BOOL" => Json::Bool(de(row.try_get::<bool, _>(i))?),
        "INT2" => Json::from(de(row.try_get_unchecked::<i16, _>(i))?),
        "INT4" => Json::from(de(row.try_get_unchecked::<i32, _>(i))?),
        "INT8" => Json::from(de(row.try_get_unchecked::<i64, _>(i))?),
        "OID" => Json::from(de(row.try_get_unchecked::<sqlx::postgres::types::Oid, _>(i))?.0),
        "FLOAT4" => float32(de(row.try_get_unchecked::<f32, _>(i))?),
        "FLOAT8" => float(de(row.try_get_unchecked::<f64, _>(i))?),
        "NUMERIC" => {
            let bytes = de(row.try_get_unchecked::<&[u8], _>(i))?;
            match pg_numeric_text(bytes)? {
                Some(t) => decimal_json(&t)?,
                None => Json::String("NaN".into()),
            }
        }
        "TEXT" | "VARCHAR" | "BPCHAR" | "NAME" | "CHAR" | "\"CHAR\"" | "CITEXT" | "UNKNOWN"
        | "XML" => text()?,
        "UUID" => {
            let bytes = de(row.try_get_unchecked::<&[u8], _>(i))?;
            let id = uuid::Uuid::from_slice(bytes).map_err(|e| e.to_string())?;
            Json::String(id.to_string())
        }
        "JSON" | "JSONB" => de(row.try_get::<sqlx::types::Json<Json>, _>(i))?.0,
        "BYTEA" => base64_json(de(row.try_get_unchecked::<&[u8], _>(i))?),
        // PostgreSQL's `infinity` and `-infinity` (the extremes of the
        // binary form) come back as PostgreSQL writes them; sqlx would
        // refuse them (timestamps) or panic on them (dates).
        "TIMESTAMPTZ" | "TIMESTAMP" => pg_timestamp(de(row.try_get_unchecked::<i64, _>(i))?)?,
        "DATE" => pg_date(de(row.try_get_unchecked::<i32, _>(i))?)?,
        "TIME" => pg_time(de(row.try_get_unchecked::<i64, _>(i))?)?,
        "VOID" => Json::Null,
        _ if matches!(base.kind(), PgTypeKind::Enum(_)) => text()?,
        _ if matches!(base.kind(), PgTypeKind::Array(_)) => pg_array(row, i, &base)?,
        other => {
            return Err(format!(
                "PostgreSQL type {other} has no JSON mapping; cast it in the query (for example CAST(col AS TEXT) or to_jsonb(col))"
            ));
        }
    })
}

/// A one-dimensional array of a common element type, as a JSON array (NULL
/// elements as null). Other element types, and arrays of more dimensions,
/// are refused with the cast to use.
fn pg_array(row: &PgRow, i: usize, ty: &sqlx::postgres::PgTypeInfo) -> CellResult {
    let PgTypeKind::Array(element) = ty.kind() else {
        return Err(format!("PostgreSQL type {} is not an array", ty.name()));
    };
    fn list<T, F>(row: &PgRow, i: usize, f: F) -> CellResult
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
        Vec<Option<T>>: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
        F: Fn(T) -> Json,
    {
        // sqlx reads one dimension starting at 1 (`'[2:3]={7,8}'` and
        // `ARRAY[[1,2]]` fail): the error says how to get them anyway.
        let items = row
            .try_get_unchecked::<Vec<Option<T>>, _>(i)
            .map_err(|e| format!("{e}; cast it in the query (for example to_jsonb(col))"))?;
        Ok(Json::Array(
            items
                .into_iter()
                .map(|v| v.map_or(Json::Null, &f))
                .collect(),
        ))
    }
    match element.name() {
        "BOOL" => list::<bool, _>(row, i, Json::Bool),
        "INT2" => list::<i16, _>(row, i, Json::from),
        "INT4" => list::<i32, _>(row, i, Json::from),
        "INT8" => list::<i64, _>(row, i, Json::from),
        "FLOAT4" => list::<f32, _>(row, i, float32),
        "FLOAT8" => list::<f64, _>(row, i, float),
        "TEXT" | "VARCHAR" | "BPCHAR" | "NAME" | "CITEXT" | "CHAR" | "\"CHAR\"" => {
            list::<String, _>(row, i, Json::String)
        }
        "JSON" | "JSONB" => list::<sqlx::types::Json<Json>, _>(row, i, |j| j.0),
        other => Err(format!(
            "PostgreSQL type {other}[] has no JSON mapping; cast it in the query (for example to_jsonb(col))"
        )),
    }
}

fn mysql_cell(row: &MySqlRow, i: usize, name: &str) -> CellResult {
    let raw = de(row.try_get_raw(i))?;
    if raw.is_null() {
        return Ok(Json::Null);
    }
    // The type checks sqlx does on `try_get` do not know every MySQL column
    // type (SET, BIT, binary-collated text); the name decides instead.
    let text = || de(row.try_get_unchecked::<String, _>(i));
    let bytes = || de(row.try_get_unchecked::<Vec<u8>, _>(i));
    Ok(match name {
        "BOOLEAN" => Json::Bool(de(row.try_get_unchecked::<i64, _>(i))? != 0),
        "TINYINT" | "SMALLINT" | "INT" | "MEDIUMINT" | "BIGINT" | "YEAR" => {
            Json::from(de(row.try_get_unchecked::<i64, _>(i))?)
        }
        "TINYINT UNSIGNED" | "SMALLINT UNSIGNED" | "INT UNSIGNED" | "MEDIUMINT UNSIGNED"
        | "BIGINT UNSIGNED" => Json::from(de(row.try_get_unchecked::<u64, _>(i))?),
        "FLOAT" => float32(de(row.try_get_unchecked::<f32, _>(i))?),
        "DOUBLE" => float(de(row.try_get_unchecked::<f64, _>(i))?),
        "DECIMAL" => decimal_json(&text()?)?,
        "JSON" => {
            let s = text()?;
            serde_json::from_str(&s).map_err(|e| format!("invalid JSON from the server: {e}"))?
        }
        "TIMESTAMP" => offset_dt(de(row.try_get::<time::OffsetDateTime, _>(i))?)?,
        "DATETIME" => offset_dt(de(row.try_get::<time::PrimitiveDateTime, _>(i))?.assume_utc())?,
        "DATE" => date(de(row.try_get::<time::Date, _>(i))?)?,
        // TIME spans -838:59:59..838:59:59 in MySQL (a duration as much
        // as a time of day: TIMEDIFF, SEC_TO_TIME); all of it is read.
        "TIME" => mysql_time(&de(row.try_get::<sqlx::mysql::types::MySqlTime, _>(i))?),
        "BIT" => {
            let b = bytes()?;
            if b.len() > 8 {
                return Err("BIT value wider than 64 bits".into());
            }
            Json::from(b.iter().fold(0u64, |acc, x| (acc << 8) | u64::from(*x)))
        }
        "NULL" => Json::Null,
        "GEOMETRY" => base64_json(&bytes()?),
        // MySQL flags binary strings and text with a `_bin` collation (and
        // MariaDB's JSON, which is utf8mb4_bin LONGTEXT) alike, and sqlx does
        // not expose the collation that tells them apart: valid UTF-8 reads
        // as text, anything else as base64.
        "BINARY" | "VARBINARY" | "TINYBLOB" | "BLOB" | "MEDIUMBLOB" | "LONGBLOB" => {
            let b = bytes()?;
            match String::from_utf8(b) {
                Ok(s) => Json::String(s),
                Err(e) => base64_json(e.as_bytes()),
            }
        }
        // CHAR, VARCHAR, the TEXT family, ENUM, SET and anything newer.
        _ => match text() {
            Ok(s) => Json::String(s),
            Err(_) => base64_json(&bytes()?),
        },
    })
}

fn float(f: f64) -> Json {
    match Number::from_f64(f) {
        Some(n) => Json::Number(n),
        None if f.is_nan() => Json::String("NaN".into()),
        None if f > 0.0 => Json::String("Infinity".into()),
        None => Json::String("-Infinity".into()),
    }
}

/// Through the shortest decimal text, so a REAL 0.1 reads 0.1, not
/// 0.10000000149011612.
fn float32(f: f32) -> Json {
    float(f.to_string().parse::<f64>().unwrap_or(f64::from(f)))
}

/// Decimal text (`-12.50`, `42`) → an exact integer when it is integral and
/// fits `i64`, otherwise the nearest `f64`.
fn decimal_json(text: &str) -> CellResult {
    let t = text.trim();
    let integral = match t.split_once('.') {
        None => Some(t),
        Some((int, frac)) if frac.bytes().all(|b| b == b'0') => Some(int),
        Some(_) => None,
    };
    if let Some(int) = integral
        && let Ok(i) = int.parse::<i64>()
    {
        return Ok(Json::from(i));
    }
    let f: f64 = t
        .parse()
        .map_err(|_| format!("cannot read decimal '{t}'"))?;
    Ok(float(f))
}

/// PostgreSQL's binary NUMERIC (base-10000 digit groups) as decimal text;
/// `None` for NaN. Written here because sqlx only decodes NUMERIC into the
/// optional bigdecimal/rust_decimal types, and text keeps every digit until
/// the caller decides on the JSON number.
fn pg_numeric_text(b: &[u8]) -> Result<Option<String>, String> {
    let word = |at: usize| -> Result<u16, String> {
        b.get(at..at + 2)
            .map(|w| u16::from_be_bytes([w[0], w[1]]))
            .ok_or_else(|| "truncated NUMERIC".to_owned())
    };
    let ndigits = usize::from(word(0)?);
    let weight = i32::from(word(2)? as i16);
    let sign = word(4)?;
    let dscale = usize::from(word(6)?);
    match sign {
        0x0000 | 0x4000 => {}
        0xC000 => return Ok(None),
        0xD000 => return Ok(Some("inf".into())),
        0xF000 => return Ok(Some("-inf".into())),
        other => return Err(format!("invalid NUMERIC sign {other:#06x}")),
    }
    let digits: Vec<u16> = (0..ndigits)
        .map(|k| word(8 + 2 * k))
        .collect::<Result<_, _>>()?;
    // Digit group `k` is worth 10000^(weight - k).
    let group = |k: i32| -> u16 {
        if k < 0 {
            0
        } else {
            digits.get(k as usize).copied().unwrap_or(0)
        }
    };
    let mut out = String::new();
    if sign == 0x4000 {
        out.push('-');
    }
    if weight < 0 {
        out.push('0');
    } else {
        out.push_str(&group(0).to_string());
        for k in 1..=weight {
            out.push_str(&format!("{:04}", group(k)));
        }
    }
    if dscale > 0 {
        let mut frac = String::new();
        let mut k = weight + 1;
        while frac.len() < dscale {
            frac.push_str(&format!("{:04}", group(k)));
            k += 1;
        }
        frac.truncate(dscale);
        out.push('.');
        out.push_str(&frac);
    }
    Ok(Some(out))
}

fn base64_json(b: &[u8]) -> Json {
    Json::String(base64::engine::general_purpose::STANDARD.encode(b))
}

fn offset_dt(t: time::OffsetDateTime) -> CellResult {
    t.to_offset(time::UtcOffset::UTC)
        .format(&time::format_description::well_known::Rfc3339)
        .map(Json::String)
        .map_err(|_| {
            "timestamp out of range: RFC 3339 has years 0000 to 9999 (cast it to text in the query)"
                .to_owned()
        })
}

fn date(d: time::Date) -> CellResult {
    // RFC 3339's full-date has four digits; later years are no date a
    // reader of the answer can parse (the `time` crate wrote `+10000-…`).
    if d.year() > 9999 {
        return Err(
            "date out of range: RFC 3339 has years up to 9999 (cast it to text in the query)"
                .into(),
        );
    }
    d.format(time::macros::format_description!("[year]-[month]-[day]"))
        .map(Json::String)
        .map_err(|e| format!("date out of range: {e}"))
}

/// A PostgreSQL `TIMESTAMP` or `TIMESTAMPTZ` in its binary form:
/// microseconds since 2000-01-01 00:00 UTC (a `TIMESTAMP` is taken as UTC),
/// the extremes meaning `infinity` and `-infinity`.
fn pg_timestamp(micros: i64) -> CellResult {
    match micros {
        i64::MAX => Ok(Json::String("infinity".into())),
        i64::MIN => Ok(Json::String("-infinity".into())),
        _ => time::macros::datetime!(2000-01-01 0:00 UTC)
            .checked_add(time::Duration::microseconds(micros))
            .ok_or_else(|| "timestamp out of range (cast it to text in the query)".to_owned())
            .and_then(offset_dt),
    }
}

/// A PostgreSQL `DATE` in its binary form: days since 2000-01-01, the
/// extremes meaning `infinity` and `-infinity`. Dates beyond what the
/// `time` crate holds (years past ±9999; PostgreSQL goes to 5874897) are
/// an error naming the column, never a panic.
fn pg_date(days: i32) -> CellResult {
    const EPOCH_JULIAN_DAY: i64 = 2_451_545;
    match days {
        i32::MAX => Ok(Json::String("infinity".into())),
        i32::MIN => Ok(Json::String("-infinity".into())),
        _ => {
            let out_of_range = || {
                "date out of range: RFC 3339 has years up to 9999 (cast it to text in the query)"
                    .to_owned()
            };
            let julian =
                i32::try_from(EPOCH_JULIAN_DAY + i64::from(days)).map_err(|_| out_of_range())?;
            let d = time::Date::from_julian_day(julian).map_err(|_| out_of_range())?;
            date(d)
        }
    }
}

/// A PostgreSQL `TIME` in its binary form: microseconds since midnight,
/// `24:00:00` included (PostgreSQL allows it; `time::Time` does not).
fn pg_time(micros: i64) -> CellResult {
    const DAY: i64 = 86_400_000_000;
    if micros == DAY {
        return Ok(Json::String("24:00:00".into()));
    }
    if !(0..DAY).contains(&micros) {
        return Err(format!("time of day out of range ({micros} µs)"));
    }
    let t = time::Time::MIDNIGHT + time::Duration::microseconds(micros);
    time_of_day(t)
}

/// A MySQL/MariaDB `TIME`: `[-]HH:MM:SS[.fraction]`, hours past 23 (up
/// to 838) and negative values as the server writes them; within a day the
/// same text as a time of day.
fn mysql_time(t: &sqlx::mysql::types::MySqlTime) -> Json {
    // `sign()`, not `MySqlTime::is_negative`, which in sqlx 0.8.6 answers
    // `is_positive`.
    let sign = if t.sign().is_negative() { "-" } else { "" };
    let mut out = format!(
        "{sign}{:02}:{:02}:{:02}",
        t.hours(),
        t.minutes(),
        t.seconds()
    );
    if t.microseconds() != 0 {
        let fraction = format!("{:06}", t.microseconds());
        out.push('.');
        out.push_str(fraction.trim_end_matches('0'));
    }
    Json::String(out)
}

fn time_of_day(t: time::Time) -> CellResult {
    let r = if t.nanosecond() == 0 {
        t.format(time::macros::format_description!(
            "[hour]:[minute]:[second]"
        ))
    } else {
        t.format(time::macros::format_description!(
            "[hour]:[minute]:[second].[subsecond]"
        ))
    };
    r.map(Json::String).map_err(|e| e.to_string())
}

// ---- errors -----------------------------------------------------------------

/// A pool wait that ran out with no connection open means the database could
/// not be reached at all (sqlx keeps retrying a refused connect until the
/// acquire timeout): an upstream failure, retryable. With connections open,
/// they were all busy: a timeout.
fn acquire_err(e: sqlx::Error, open: u32, cause: Option<&str>) -> ConnectorError {
    match e {
        sqlx::Error::PoolTimedOut if open == 0 => match cause {
            Some(why) => ConnectorError::new(
                ConnectorErrorKind::Upstream,
                format!(
                    "cannot connect to the database: {why} (no connection within connect_timeout_ms)"
                ),
            ),
            // Nothing refused the connection: the server did not answer in
            // time, so the connector's own timeout ran out (504, as for
            // every connector timeout).
            None => ConnectorError::new(
                ConnectorErrorKind::Timeout,
                "cannot connect to the database: no answer within connect_timeout_ms",
            ),
        }
        .retryable(true),
        e => sql_err(e),
    }
}

/// As [`acquire_err`]; when no connection could be opened at all, one
/// direct attempt (at most half a second) finds out why, so the message
/// says "Connection refused" rather than only that time ran out. sqlx's
/// connect errors carry no URL.
async fn acquire_failed<DB: sqlx::Database>(
    e: sqlx::Error,
    pool: &sqlx::Pool<DB>,
) -> ConnectorError {
    let open = pool.size();
    if !matches!(e, sqlx::Error::PoolTimedOut) || open > 0 {
        return acquire_err(e, open, None);
    }
    use sqlx::ConnectOptions as _;
    let attempt =
        tokio::time::timeout(Duration::from_millis(500), pool.connect_options().connect()).await;
    let cause = match attempt {
        Ok(Err(sqlx::Error::Io(io))) => Some(io.to_string()),
        Ok(Err(other)) => Some(other.to_string()),
        _ => None,
    };
    acquire_err(e, open, cause.as_deref())
}

fn timeout_err(d: Duration) -> ConnectorError {
    ConnectorError::new(
        ConnectorErrorKind::Timeout,
        format!("query timed out after {} ms", d.as_millis()),
    )
}

/// A write the client stopped waiting for may still commit on the server
/// (MySQL and MariaDB run on after the client gives up, and even a server
/// limit can lose the race), so it is not retried: a retry could write
/// twice. A statement the server itself cancelled is retried as before
/// (`sql_err`).
fn write_timeout_err(d: Duration) -> ConnectorError {
    ConnectorError::new(
        ConnectorErrorKind::Timeout,
        format!(
            "query timed out after {} ms; not retried, as the statement may still complete on the server",
            d.as_millis()
        ),
    )
    .retryable(false)
}

/// Classifies an error from running a statement on a connection the pool
/// handed out. On SQLite a `Protocol` error is about the query's text, found
/// before the library sees it (a NUL byte, a `$name`, `:name` or `@name`
/// parameter): the same text fails the same way every time, so it is the
/// database refusing the query, not an unreachable database to retry (on
/// the network drivers it is a broken connection, as [`sql_err`] says).
fn query_err<DB: sqlx::Database>(e: sqlx::Error, _pool: &sqlx::Pool<DB>) -> ConnectorError {
    match e {
        sqlx::Error::Protocol(why) if DB::NAME == "SQLite" => {
            // sqlx appends where in its source it raised this
            // (`… :name (sqlx_sqlite::arguments:99)`): not for the client.
            let why = match why.rsplit_once(" (sqlx_") {
                Some((head, tail)) if tail.ends_with(')') => head,
                _ => why.as_str(),
            };
            ConnectorError::new(
                ConnectorErrorKind::Upstream,
                format!("database error: {why}"),
            )
        }
        e => sql_err(e),
    }
}

/// Classifies a driver error. Network and connect failures, pool waits,
/// lost races (deadlock, serialization failure, lock wait, busy) and server
/// overload are retryable; a server-side statement timeout is a `Timeout`;
/// a query the database rejects (syntax, constraint, type) is not retryable
/// and keeps the database's own message. Messages never carry the URL.
fn sql_err(e: sqlx::Error) -> ConnectorError {
    use ConnectorErrorKind::{Other, Timeout, Upstream};
    match e {
        sqlx::Error::Database(d) => {
            let code = d.code().map(|c| c.into_owned()).unwrap_or_default();
            let mysql_number = d
                .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                .map(|m| m.number());
            let mut msg = format!("database error: {}", d.message());
            // SQLITE_CANTOPEN: a connector's file is not created when
            // missing (a typo would give an empty database).
            if code == "14" {
                msg.push_str(
                    " (a SQLite connector opens an existing file; add ?mode=rwc to the connection_string to create it)",
                );
            }
            // PostgreSQL counting the params against the placeholders: the
            // task's own mistake, as MariaDB's count before the query is
            // (`placeholder_mismatch`), so the same kind of failure on both
            // (audit 118: a 502 here, a 500 there).
            // (The server's message text: with a non-English `lc_messages`
            // this stays the 502 below.)
            if code == "08P01" && d.message().starts_with("bind message supplies") {
                msg.push_str("; give one value per placeholder ($1, $2, …)");
                return ConnectorError::new(Other, msg);
            }
            // 57014 query_canceled (statement_timeout); MariaDB 1969
            // max_statement_time; MySQL 3024 max_execution_time.
            if code == "57014" || matches!(mysql_number, Some(1969 | 3024)) {
                return ConnectorError::new(Timeout, msg);
            }
            let retryable = match mysql_number {
                // Lock wait, deadlock, too many connections, server gone/shutting down.
                Some(n) => matches!(n, 1205 | 1213 | 1040 | 1053 | 2006 | 2013),
                None => {
                    // SQLSTATE classes 08 connection (but 08P01, a protocol
                    // violation: the statement's parameters do not match
                    // its placeholders, which a retry repeats), 53
                    // resources, 57P0x shutdown/cannot connect now;
                    // 40001/40P01 lost races; SQLite busy/locked (with
                    // extended codes).
                    (code.starts_with("08") && code != "08P01")
                        || code.starts_with("53")
                        || matches!(
                            code.as_str(),
                            "40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03"
                        )
                        || matches!(code.as_str(), "5" | "6" | "261" | "262" | "517" | "773")
                }
            };
            ConnectorError::new(Upstream, msg).retryable(retryable)
        }
        sqlx::Error::PoolTimedOut => ConnectorError::new(
            Timeout,
            "timed out waiting for a database connection (connect_timeout_ms)",
        ),
        e @ (sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::PoolClosed) => {
            ConnectorError::new(Upstream, format!("database unreachable: {e}")).retryable(true)
        }
        e @ sqlx::Error::Configuration(_) => {
            ConnectorError::new(Other, format!("database configuration: {e}"))
        }
        e => ConnectorError::new(Upstream, format!("database error: {e}")),
    }
}

/// Against real databases: a SQLite temp file, and a fresh database on the
/// PostgreSQL and MariaDB servers of `../shared/services` (started by
/// `scripts/test.sh`). A server that is not reachable fails the test.
#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use sqlx::Connection as _;

    const PG_ADMIN: &str = "postgres://postgres@127.0.0.1:5432/test";
    const MY_ADMIN: &str = "mysql://root@127.0.0.1:3306/test";

    fn cfg(url: &str) -> DbConnector {
        DbConnector {
            connection_string: url.to_owned(),
            max_connections: Some(4),
            query_timeout_ms: Some(5_000),
            connect_timeout_ms: Some(2_000),
            retry: Default::default(),
        }
    }

    #[derive(Clone, Copy, PartialEq)]
    enum Server {
        Postgres,
        MySql,
    }

    /// Creates a fresh database, runs `body` with a pool on it, drops the
    /// database, then re-raises the body's panic.
    async fn with_db<F, Fut>(server: Server, query_timeout_ms: u64, body: F)
    where
        F: FnOnce(SqlPool) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let name = format!("sluice_c_{}", uuid::Uuid::new_v4().simple());
        let url = match server {
            Server::Postgres => {
                let mut c = sqlx::PgConnection::connect(PG_ADMIN).await.unwrap_or_else(|e| {
                    panic!("PostgreSQL at {PG_ADMIN} is not reachable ({e}); run bash ../shared/services/postgres.sh")
                });
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut c)
                    .await
                    .unwrap();
                c.close().await.ok();
                format!("postgres://postgres@127.0.0.1:5432/{name}")
            }
            Server::MySql => {
                let mut c = sqlx::MySqlConnection::connect(MY_ADMIN).await.unwrap_or_else(|e| {
                    panic!("MariaDB at {MY_ADMIN} is not reachable ({e}); run bash ../shared/services/mariadb.sh")
                });
                sqlx::query(&format!("CREATE DATABASE {name} CHARACTER SET utf8mb4"))
                    .execute(&mut c)
                    .await
                    .unwrap();
                c.close().await.ok();
                // mariadb: exercises the scheme rewrite.
                format!("mariadb://root@127.0.0.1:3306/{name}")
            }
        };
        let mut c = cfg(&url);
        c.query_timeout_ms = Some(query_timeout_ms);
        let pool = SqlPool::connect(&c).await.expect("connect");
        let outcome = tokio::spawn(body(pool)).await;
        match server {
            Server::Postgres => {
                if let Ok(mut c) = sqlx::PgConnection::connect(PG_ADMIN).await {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut c)
                        .await;
                }
            }
            Server::MySql => {
                if let Ok(mut c) = sqlx::MySqlConnection::connect(MY_ADMIN).await {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
                        .execute(&mut c)
                        .await;
                }
            }
        }
        if let Err(e) = outcome {
            std::panic::resume_unwind(e.into_panic());
        }
    }

    fn sqlite_url() -> (std::path::PathBuf, String) {
        let dir = std::env::temp_dir().join(format!("sluice_c_{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.join("c.db").display());
        (dir, url)
    }

    /// A second statement is refused before SQLite sees the text, however
    /// the other dialects would read it (audit 93's bypasses of the
    /// definition check); one statement, a trailing `;` and a `;` inside a
    /// string or comment run.
    #[tokio::test]
    async fn sqlite_runs_one_statement_per_call() {
        let (dir, url) = sqlite_url();
        let pool = SqlPool::connect(&cfg(&url)).await.unwrap();
        pool.write("CREATE TABLE t (a TEXT)", &[]).await.unwrap();
        for q in [
            "SELECT 'a\\'; DROP TABLE t; --'",
            "SELECT \"a\\\"; DROP TABLE t; --\"",
            "SELECT 1 /* /* */; DROP TABLE t; /* */",
            "SELECT 1; DROP TABLE t",
        ] {
            let e = pool.read(q, &[]).await.unwrap_err();
            assert!(
                e.message
                    .starts_with("SQLite runs one statement per task; this query holds 2"),
                "{q}: {}",
                e.message
            );
            let e = pool.write(q, &[]).await.unwrap_err();
            assert!(e.message.starts_with("SQLite runs one statement"), "{q}");
        }
        // The table is still there.
        let rows = pool
            .read("SELECT name FROM sqlite_master WHERE name = 't';", &[])
            .await
            .unwrap();
        assert_eq!(rows, vec![json!({"name": "t"})]);
        for q in [
            "SELECT ';' AS a -- ; DROP TABLE t",
            "SELECT 1 /* ; DROP TABLE t */ AS a;",
            "SELECT \"a;b\" FROM (SELECT 1 AS \"a;b\")",
        ] {
            assert_eq!(pool.read(q, &[]).await.unwrap().len(), 1, "{q}");
        }
        pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A named parameter form sqlx does not bind, or a NUL byte, is the
    /// query's fault: a database error, not
    /// "unreachable", and not retried.
    #[tokio::test]
    async fn sqlite_query_text_errors_are_not_retried() {
        let (dir, url) = sqlite_url();
        let pool = SqlPool::connect(&cfg(&url)).await.unwrap();
        for (q, says) in [
            ("SELECT :name", "unsupported SQL parameter format: :name"),
            ("SELECT $abc", "non-integer names"),
            ("SELECT 1 AS \"a\0b\"", "unrecognized token"),
        ] {
            let e = pool.read(q, &[json!(1)]).await.unwrap_err();
            assert!(!e.message.contains("sqlx"), "{q}: {}", e.message);
            assert!(
                e.message.starts_with("database error: ") && e.message.contains(says),
                "{q}: {}",
                e.message
            );
            assert!(!e.retryable, "{q}: retried");
            assert_eq!(e.kind, ConnectorErrorKind::Upstream, "{q}");
        }
        // The pool still serves.
        assert_eq!(
            pool.read("SELECT 1 AS a", &[]).await.unwrap(),
            vec![json!({"a": 1})]
        );
        pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn sqlite_types_params_and_rows_affected() {
        let (dir, url) = sqlite_url();
        let pool = SqlPool::connect(&cfg(&url)).await.unwrap();
        pool.write(
            "CREATE TABLE t (id INTEGER PRIMARY KEY, f REAL, d NUMERIC, s TEXT, n TEXT, b BOOLEAN, ts DATETIME, j TEXT, bin BLOB)",
            &[],
        )
        .await
        .unwrap();
        let n = pool
            .write(
                "INSERT INTO t (id, f, d, s, n, b, ts, j, bin) VALUES (?, ?, ?, ?, ?, ?, ?, ?, X'00FF10')",
                &[
                    json!(1),
                    json!(1.5),
                    json!(12.25),
                    json!("héllo"),
                    Json::Null,
                    json!(true),
                    json!("2026-11-22T10:15:00Z"),
                    json!({"a": [1, 2]}),
                ],
            )
            .await
            .unwrap();
        assert_eq!(n, 1);
        pool.write(
            "INSERT INTO t (id, s, b) VALUES (2, 'x', 0), (3, 'x', 1)",
            &[],
        )
        .await
        .unwrap();
        assert_eq!(
            pool.write("UPDATE t SET f = ? WHERE s = ?", &[json!(0.5), json!("x")])
                .await
                .unwrap(),
            2
        );

        let rows = pool
            .read("SELECT * FROM t WHERE id = ?", &[json!(1)])
            .await
            .unwrap();
        assert_eq!(
            rows,
            vec![json!({
                "id": 1, "f": 1.5, "d": 12.25, "s": "héllo", "n": null, "b": true,
                "ts": "2026-11-22T10:15:00Z", "j": "{\"a\":[1,2]}", "bin": "AP8Q"
            })]
        );
        // No timestamp type in SQLite: a DATETIME cell comes back as stored
        // (SQLite's own text form is not rewritten to RFC 3339, a unix time
        // stays a number); the query converts (docs/decisions.md).
        pool.write(
            "INSERT INTO t (id, ts) VALUES (4, '2026-11-22 10:15:00'), (5, 1795342500)",
            &[],
        )
        .await
        .unwrap();
        let rows = pool
            .read(
                "SELECT ts, strftime('%Y-%m-%dT%H:%M:%SZ', ts) AS iso FROM t WHERE id = 4
                 UNION ALL
                 SELECT ts, strftime('%Y-%m-%dT%H:%M:%SZ', ts, 'unixepoch') FROM t WHERE id = 5",
                &[],
            )
            .await
            .unwrap();
        assert_eq!(
            rows,
            vec![
                json!({"ts": "2026-11-22 10:15:00", "iso": "2026-11-22T10:15:00Z"}),
                json!({"ts": 1_795_342_500, "iso": "2026-11-22T10:15:00Z"}),
            ]
        );
        // Parameters bind in order: the second `?` is the string.
        let rows = pool
            .read(
                "SELECT id, b FROM t WHERE id >= ? AND s = ? ORDER BY id",
                &[json!(3), json!("x")],
            )
            .await
            .unwrap();
        assert_eq!(rows, vec![json!({"id": 3, "b": true})]);
        let rows = pool
            .read(
                "SELECT 1 + 1 AS two, 'a' || ? AS s, ? IS NULL AS is_null",
                &[json!("b"), Json::Null],
            )
            .await
            .unwrap();
        assert_eq!(rows, vec![json!({"two": 2, "s": "ab", "is_null": 1})]);

        let e = pool.read("SELEC 1", &[]).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Upstream);
        assert!(!e.retryable);
        assert!(e.message.contains("syntax error"), "{}", e.message);
        let e = pool
            .write("INSERT INTO t (id) VALUES (1)", &[])
            .await
            .unwrap_err();
        assert!(!e.retryable);
        assert!(e.message.contains("UNIQUE"), "{}", e.message);
        pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn sqlite_missing_file_and_bad_scheme_fail_cleanly() {
        let dir = std::env::temp_dir().join(format!("sluice_c_{}", uuid::Uuid::new_v4().simple()));
        // No `mode=rwc`: a missing file is an error, not a new empty database.
        let pool = SqlPool::connect(&cfg(&format!("sqlite://{}/none.db", dir.display())))
            .await
            .unwrap();
        let e = pool.read("SELECT 1", &[]).await.unwrap_err();
        // Says how to have it created (audit 69: "unable to open database
        // file" alone).
        assert!(
            e.message.contains("unable to open database file")
                && e.message
                    .ends_with("add ?mode=rwc to the connection_string to create it)"),
            "{}",
            e.message
        );
        let e = SqlPool::connect(&cfg("oracle://x")).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Other);
        assert!(e.message.contains("oracle"), "{}", e.message);
    }

    #[tokio::test]
    async fn postgres_types_params_and_rows_affected() {
        with_db(Server::Postgres, 5_000, |pool| async move {
            pool.write(
                "CREATE TABLE t (id INT4 PRIMARY KEY, big INT8, small INT2, f FLOAT8, r REAL, d NUMERIC(12,2), s TEXT,
                 n INT4, b BOOL, tz TIMESTAMPTZ, ts TIMESTAMP, day DATE, j JSONB, js JSON, bin BYTEA, u UUID)",
                &[],
            )
            .await
            .unwrap();
            let n = pool
                .write(
                    "INSERT INTO t VALUES ($1, $2, 7, $3, 0.1, $4, $5, $6, $7, $8::timestamptz, '2026-11-22 10:15:00.5', '2026-11-22',
                     CAST($9 AS JSONB), '[1,\"x\"]', '\\x00ff10', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11')",
                    &[
                        json!(1),
                        json!(9_007_199_254_740_993_i64),
                        json!(2.5),
                        json!(1234.5),
                        json!("héllo"),
                        Json::Null,
                        json!(true),
                        json!("2026-11-22T12:15:00+02:00"),
                        json!({"k": [1, null]}),
                    ],
                )
                .await
                .unwrap();
            assert_eq!(n, 1);
            let rows = pool.read("SELECT * FROM t", &[]).await.unwrap();
            assert_eq!(
                rows,
                vec![json!({
                    "id": 1, "big": 9_007_199_254_740_993_i64, "small": 7, "f": 2.5, "r": 0.1, "d": 1234.5,
                    "s": "héllo", "n": null, "b": true, "tz": "2026-11-22T10:15:00Z",
                    "ts": "2026-11-22T10:15:00.5Z", "day": "2026-11-22", "j": {"k": [1, null]},
                    "js": [1, "x"], "bin": "AP8Q", "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
                })]
            );
            // PostgreSQL's infinities and 24:00 come back as it writes them;
            // before, an infinite DATE panicked the handler.
            let rows = pool
                .read(
                    "SELECT 'infinity'::date AS d, '-infinity'::date AS nd, 'infinity'::timestamp AS ts,
                     '-infinity'::timestamptz AS ntz, '24:00:00'::time AS t, '1999-12-31'::date AS before,
                     '0001-01-01 00:00:00.000001'::timestamp AS early, '23:59:59.25'::time AS late",
                    &[],
                )
                .await
                .unwrap();
            assert_eq!(
                rows,
                vec![json!({"d": "infinity", "nd": "-infinity", "ts": "infinity", "ntz": "-infinity",
                    "t": "24:00:00", "before": "1999-12-31", "early": "0001-01-01T00:00:00.000001Z",
                    "late": "23:59:59.25"})]
            );
            for far in [
                "'5874897-12-31'::date",
                "'10000-01-01'::date",
                "'10000-01-01'::timestamptz",
            ] {
                let e = pool
                    .read(&format!("SELECT {far} AS far"), &[])
                    .await
                    .unwrap_err();
                assert!(
                    e.message.contains("out of range") && e.message.contains("cast it to text"),
                    "{far}: {}",
                    e.message
                );
            }
            // NUMERIC precision: integral values exact, others the nearest f64.
            let rows = pool
                .read(
                    "SELECT 12345678901234567.00::numeric AS i, 0.001::numeric AS small, -1.50::numeric AS neg,
                     123456789012345678901234567890.5::numeric AS huge, 'NaN'::numeric AS nan, 0::numeric AS zero,
                     10000.0001::numeric AS mixed, '12:30:01.25'::time AS t, pg_sleep(0) AS v",
                    &[],
                )
                .await
                .unwrap();
            assert_eq!(
                rows,
                vec![json!({
                    "i": 12345678901234567_i64, "small": 0.001, "neg": -1.5, "huge": 1.2345678901234568e29,
                    "nan": "NaN", "zero": 0, "mixed": 10000.0001, "t": "12:30:01.25", "v": null
                })]
            );
            // Order of parameters, and a text-typed equality.
            pool.write("INSERT INTO t (id, s) VALUES (2, 'x'), (3, 'x'), (4, 'y')", &[]).await.unwrap();
            let rows = pool
                .read("SELECT id FROM t WHERE s = $2 AND id > $1 ORDER BY id", &[json!(2), json!("x")])
                .await
                .unwrap();
            assert_eq!(rows, vec![json!({"id": 3})]);
            assert_eq!(pool.write("UPDATE t SET n = $1 WHERE s = $2", &[json!(5), json!("x")]).await.unwrap(), 2);
            assert_eq!(pool.write("DELETE FROM t WHERE id > 100", &[]).await.unwrap(), 0);
            // One-dimensional arrays of the common types are JSON arrays
            // (null elements as null).
            let rows = pool
                .read(
                    "SELECT ARRAY[1,NULL,3]::int4[] AS i, ARRAY['a','b']::text[] AS t, ARRAY[true]::bool[] AS b, \
                     ARRAY[1.5]::float8[] AS f, ARRAY[9000000000]::int8[] AS l, '{}'::text[] AS e, \
                     ARRAY['{\"k\": 1}']::jsonb[] AS j, ARRAY['x']::varchar[] AS v, \
                     ARRAY['ab'::char(2)] AS c, ARRAY['q'::\"char\"] AS qc, 'q'::\"char\" AS sc",
                    &[],
                )
                .await
                .unwrap();
            assert_eq!(
                rows,
                vec![json!({"i": [1, null, 3], "t": ["a", "b"], "b": [true], "f": [1.5], "l": [9000000000_i64], "e": [], "j": [{"k": 1}], "v": ["x"], "c": ["ab"], "qc": ["q"], "sc": "q"})]
            );
            // Other types, and arrays of other elements or of two
            // dimensions, are an error naming the column, not a panic.
            for q in [
                "SELECT interval '1 day' AS arr",
                "SELECT ARRAY[interval '1 day'] AS arr",
                "SELECT ARRAY[[1,2],[3,4]] AS arr",
            ] {
                let e = pool.read(q, &[]).await.unwrap_err();
                assert!(e.message.contains("'arr'"), "{q}: {}", e.message);
                assert!(e.message.contains("to_jsonb(col)"), "{q}: {}", e.message);
                assert!(!e.retryable);
                assert_eq!(e.kind, ConnectorErrorKind::Other, "{q}");
            }

            let e = pool.read("SELEC 1", &[]).await.unwrap_err();
            assert_eq!(e.kind, ConnectorErrorKind::Upstream);
            assert!(!e.retryable);
            assert!(e.message.contains("syntax error"), "{}", e.message);
            let e = pool.write("INSERT INTO t (id) VALUES ($1)", &[json!(1)]).await.unwrap_err();
            assert!(!e.retryable);
            assert!(e.message.contains("duplicate key"), "{}", e.message);
            // Too few parameters for the placeholders: the server's protocol
            // violation (08P01) is the task's fault, not retried, and a task
            // failure as MariaDB's count before the query is.
            let e = pool.read("SELECT $1::int AS a", &[]).await.unwrap_err();
            assert_eq!(e.kind, ConnectorErrorKind::Other);
            assert!(!e.retryable, "{e:?}");
            assert!(
                e.message.starts_with("database error: bind message supplies 0 parameters")
                    && e.message.ends_with("give one value per placeholder ($1, $2, …)"),
                "{}",
                e.message
            );
            // The same statement with null, then numbers: each binds as what
            // it is (a statement cached from the null call read 1 as 5e-324).
            for (id, v) in [(100, Json::Null), (101, json!(1)), (102, json!(2.5))] {
                pool.write("INSERT INTO t (id, f) VALUES ($1, $2)", &[json!(id), v])
                    .await
                    .unwrap();
            }
            let rows = pool
                .read("SELECT f FROM t WHERE id >= $1 ORDER BY id", &[json!(100)])
                .await
                .unwrap();
            assert_eq!(rows, vec![json!({"f": null}), json!({"f": 1.0}), json!({"f": 2.5})]);
            pool.close().await;
        })
        .await;
    }

    /// A query with more rows than MAX_ROWS (`endless`) stops at
    /// MAX_ROWS + 1 rows with an error, not when memory runs out; one of
    /// exactly MAX_ROWS (`exact`) is answered, and the pool serves on.
    async fn rows_are_capped(pool: SqlPool, endless: &str, exact: &str) {
        let e = pool.read(endless, &[]).await.unwrap_err();
        assert!(e.message.contains("more than 10000 rows"), "{e:?}");
        assert!(!e.retryable);
        assert_eq!(pool.read(exact, &[]).await.unwrap().len(), MAX_ROWS);
        assert_eq!(
            pool.read("SELECT 1 AS one", &[]).await.unwrap(),
            vec![json!({"one": 1})]
        );
    }

    #[tokio::test]
    async fn db_read_rows_are_capped_on_every_backend() {
        // A recursive CTE counting for ever, and one counting to MAX_ROWS.
        let endless =
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c";
        let exact = format!(
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {MAX_ROWS}) SELECT x FROM c"
        );
        let (dir, url) = sqlite_url();
        rows_are_capped(SqlPool::connect(&cfg(&url)).await.unwrap(), endless, &exact).await;
        let _ = std::fs::remove_dir_all(&dir);
        let exact_pg = exact.clone();
        with_db(Server::Postgres, 10_000, |pool| async move {
            rows_are_capped(pool, endless, &exact_pg).await;
        })
        .await;
        // MariaDB ends a recursive CTE at max_recursive_iterations (1,000):
        // its sequence tables instead.
        with_db(Server::MySql, 10_000, |pool| async move {
            rows_are_capped(
                pool,
                "SELECT seq AS x FROM seq_1_to_1000000",
                "SELECT seq AS x FROM seq_1_to_10000",
            )
            .await;
        })
        .await;
    }

    #[tokio::test]
    async fn postgres_query_timeout_then_pool_still_serves() {
        with_db(Server::Postgres, 100, |pool| async move {
            let started = std::time::Instant::now();
            let e = pool.read("SELECT pg_sleep(2)", &[]).await.unwrap_err();
            assert_eq!(e.kind, ConnectorErrorKind::Timeout, "{e:?}");
            assert!(e.retryable);
            assert!(
                started.elapsed() < Duration::from_millis(1500),
                "{:?}",
                started.elapsed()
            );
            assert_eq!(
                pool.read("SELECT 1 AS one", &[]).await.unwrap(),
                vec![json!({"one": 1})]
            );
            pool.close().await;
        })
        .await;
    }

    #[tokio::test]
    async fn mysql_types_params_and_rows_affected() {
        with_db(Server::MySql, 5_000, |pool| async move {
            pool.write(
                "CREATE TABLE t (id INT PRIMARY KEY, flag TINYINT(1), tiny TINYINT, big BIGINT UNSIGNED, f DOUBLE, r FLOAT,
                 d DECIMAL(12,2), s VARCHAR(20), sb VARCHAR(20) COLLATE utf8mb4_bin, txt TEXT, n INT, dt DATETIME(3),
                 ts TIMESTAMP NULL, day DATE, j JSON, bin VARBINARY(8), e ENUM('a','b'), bits BIT(10))",
                &[],
            )
            .await
            .unwrap();
            let n = pool
                .write(
                    "INSERT INTO t VALUES (?, ?, -3, ?, ?, 0.1, ?, ?, ?, 'long text', ?, '2026-11-22 10:15:00.250',
                     '2026-11-22 10:15:00', '2026-11-22', ?, X'00FF10', 'b', b'1000000001')",
                    &[
                        json!(1),
                        json!(true),
                        json!(u64::MAX),
                        json!(2.5),
                        json!(1234.5),
                        json!("héllo"),
                        json!("Bin"),
                        Json::Null,
                        json!({"k": [1, null]}),
                    ],
                )
                .await
                .unwrap();
            assert_eq!(n, 1);
            let rows = pool.read("SELECT * FROM t", &[]).await.unwrap();
            assert_eq!(
                rows,
                vec![json!({
                    "id": 1, "flag": true, "tiny": -3, "big": u64::MAX, "f": 2.5, "r": 0.1, "d": 1234.5,
                    "s": "héllo", "sb": "Bin", "txt": "long text", "n": null, "dt": "2026-11-22T10:15:00.25Z",
                    "ts": "2026-11-22T10:15:00Z", "day": "2026-11-22",
                    // MariaDB's JSON is LONGTEXT on the wire: the text comes back.
                    "j": "{\"k\":[1,null]}", "bin": "AP8Q", "e": "b", "bits": 513
                })]
            );
            // Binary that is valid UTF-8 cannot be told from `_bin` text.
            let rows = pool.read("SELECT X'616263' AS ascii, X'FF' AS raw", &[]).await.unwrap();
            assert_eq!(rows, vec![json!({"ascii": "abc", "raw": "/w=="})]);
            let rows = pool
                .read("SELECT 12345678901234567.00 AS i, CAST(0.001 AS DECIMAL(5,3)) AS small, NULL AS nothing, 1 = 1 AS yes", &[])
                .await
                .unwrap();
            assert_eq!(rows, vec![json!({"i": 12345678901234567_i64, "small": 0.001, "nothing": null, "yes": 1})]);
            // TIME is a duration as much as a time of day: past 24 hours,
            // negative, with a fraction.
            let rows = pool
                .read("SELECT SEC_TO_TIME(90000) AS longer, TIMEDIFF('2024-01-01 10:00', '2024-01-01 12:30') AS back,
                       CAST('-838:59:59' AS TIME) AS least, CAST('07:08:09.25' AS TIME(2)) AS frac, CAST('00:00:00' AS TIME) AS zero", &[])
                .await
                .unwrap();
            assert_eq!(rows, vec![json!({"longer": "25:00:00", "back": "-02:30:00", "least": "-838:59:59",
                "frac": "07:08:09.25", "zero": "00:00:00"})]);
            pool.write("INSERT INTO t (id, s) VALUES (2, 'x'), (3, 'x'), (4, 'y')", &[]).await.unwrap();
            let rows = pool
                .read("SELECT id FROM t WHERE id > ? AND s = ? ORDER BY id", &[json!(2), json!("x")])
                .await
                .unwrap();
            assert_eq!(rows, vec![json!({"id": 3})]);
            assert_eq!(pool.write("UPDATE t SET n = ? WHERE s = ?", &[json!(5), json!("x")]).await.unwrap(), 2);

            let e = pool.read("SELEC 1", &[]).await.unwrap_err();
            assert_eq!(e.kind, ConnectorErrorKind::Upstream);
            assert!(!e.retryable);
            assert!(e.message.contains("SQL syntax"), "{}", e.message);
            let e = pool.write("INSERT INTO t (id) VALUES (?)", &[json!(1)]).await.unwrap_err();
            assert!(!e.retryable);
            assert!(e.message.contains("Duplicate entry"), "{}", e.message);
            // One value per `?` (audit 95: an extra one was bound as
            // garbage, and an UPDATE with one matched nothing).
            let e = pool.read("SELECT ? AS a", &[json!(42), json!(7)]).await.unwrap_err();
            assert_eq!(
                e.message,
                "the query has 1 placeholder ('?') but params gives 2 values; give one value per '?'"
            );
            assert!(!e.retryable);
            let e = pool
                .write("UPDATE t SET n = ? WHERE id = ?", &[json!(6), json!(2), json!("x")])
                .await
                .unwrap_err();
            assert!(e.message.starts_with("the query has 2 placeholders ('?') but params gives 3 values"), "{}", e.message);
            let e = pool.write("UPDATE t SET n = ? WHERE id = ?", &[json!(6)]).await.unwrap_err();
            assert!(e.message.starts_with("the query has 2 placeholders ('?') but params gives 1 value;"), "{}", e.message);
            // The server's own count (audit 100: a reading of the text
            // took a comment for code past the server's version, and
            // `5--?` for a comment).
            let rows = pool.read("SELECT '?' AS q, ? AS a -- ?", &[json!(42)]).await.unwrap();
            assert_eq!(rows, vec![json!({"q": "?", "a": 42})]);
            let e = pool
                .read("SELECT ? AS a /*!99999 , ? */", &[json!(42), json!(7)])
                .await
                .unwrap_err();
            assert!(e.message.starts_with("the query has 1 placeholder ('?') but params gives 2"), "{}", e.message);
            let rows = pool.read("SELECT 5--? AS a", &[json!(1)]).await.unwrap();
            assert_eq!(rows, vec![json!({"a": 6})]);
            // The pool still serves after a refusal.
            assert_eq!(pool.read("SELECT ? AS a", &[json!(1)]).await.unwrap(), vec![json!({"a": 1})]);
            pool.close().await;
        })
        .await;
    }

    #[tokio::test]
    async fn mysql_query_timeout_then_pool_still_serves() {
        with_db(Server::MySql, 100, |pool| async move {
            let started = std::time::Instant::now();
            let e = pool.read("SELECT SLEEP(2)", &[]).await.unwrap_err();
            assert_eq!(e.kind, ConnectorErrorKind::Timeout, "{e:?}");
            assert!(e.retryable);
            assert!(
                started.elapsed() < Duration::from_millis(1500),
                "{:?}",
                started.elapsed()
            );
            assert_eq!(
                pool.read("SELECT 1 AS one", &[]).await.unwrap(),
                vec![json!({"one": 1})]
            );
            pool.close().await;
        })
        .await;
    }

    /// A write that outlives the timeout is not retried (the client cannot
    /// know whether it committed), and MariaDB stops it itself
    /// (`max_statement_time`): before, the statement ran on after the client
    /// gave up, and each retry wrote another row.
    #[tokio::test]
    async fn a_timed_out_write_is_not_retried_and_the_server_stops_it() {
        for server in [Server::MySql, Server::Postgres] {
            with_db(server, 300, move |pool| async move {
                pool.write("CREATE TABLE w (v VARCHAR(40))", &[])
                    .await
                    .unwrap();
                let slow = match server {
                    Server::MySql => "INSERT INTO w (v) SELECT CONCAT(?, SLEEP(1))",
                    Server::Postgres => "INSERT INTO w (v) SELECT $1 || pg_sleep(1)::text",
                };
                let e = pool.write(slow, &[json!("once")]).await.unwrap_err();
                assert_eq!(e.kind, ConnectorErrorKind::Timeout, "{e:?}");
                // Either the server stopped it first and said so (then a
                // retry is safe), or the client gave up first (then not).
                let server_said =
                    e.message.contains("interrupted") || e.message.contains("canceling statement");
                assert_eq!(e.retryable, server_said, "{e:?}");
                if !server_said {
                    assert!(e.message.contains("not retried"), "{}", e.message);
                }
                // Long after the statement would have finished: nothing.
                tokio::time::sleep(Duration::from_millis(1500)).await;
                let rows = pool.read("SELECT COUNT(*) AS n FROM w", &[]).await.unwrap();
                assert_eq!(rows, vec![json!({"n": 0})]);
                pool.close().await;
            })
            .await;
        }
    }

    #[tokio::test]
    async fn connection_refused_is_retryable() {
        // Port 1 on loopback: nothing listens there.
        for url in [
            "postgres://postgres@127.0.0.1:1/test",
            "mysql://root@127.0.0.1:1/test",
        ] {
            let mut c = cfg(url);
            c.connect_timeout_ms = Some(300);
            let pool = SqlPool::connect(&c).await.expect("lazy: no connection yet");
            let e = pool.read("SELECT 1", &[]).await.unwrap_err();
            assert!(e.retryable, "{url}: {e:?}");
            assert_eq!(e.kind, ConnectorErrorKind::Upstream, "{url}: {e:?}");
            // The cause, not only that time ran out.
            assert!(
                e.message.starts_with("cannot connect to the database: ")
                    && e.message.contains("refused"),
                "{url}: {}",
                e.message
            );
            assert!(
                !e.message.contains("127.0.0.1:1"),
                "no URL in messages: {}",
                e.message
            );
        }
    }

    /// A server that accepts the connection and never answers: the
    /// connector's own connect timeout ran out, a `Timeout` (504).
    #[tokio::test]
    async fn a_silent_server_is_a_connect_timeout() {
        let (port, held) = crate::connectors::silent_server().await;
        for url in [
            format!("postgres://postgres@127.0.0.1:{port}/test"),
            format!("mysql://root@127.0.0.1:{port}/test"),
        ] {
            let mut c = cfg(&url);
            c.connect_timeout_ms = Some(300);
            let pool = SqlPool::connect(&c).await.expect("lazy: no connection yet");
            let e = pool.read("SELECT 1", &[]).await.unwrap_err();
            assert_eq!(e.kind, ConnectorErrorKind::Timeout, "{url}: {e:?}");
            assert!(e.retryable, "{url}: {e:?}");
        }
        held.abort();
    }
}
