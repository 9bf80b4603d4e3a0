//! Versioned resources (workflows and channels): create, read, list, update a
//! draft, delete, new versions and the status/rollout lifecycle, one
//! implementation for both kinds.
//!
//! How the rules hold under concurrency:
//! - every change runs in one transaction that first locks the id's rows
//!   (`SELECT ... FOR UPDATE` on PostgreSQL/MariaDB; on SQLite `BEGIN IMMEDIATE`
//!   already holds the database write lock), then reloads them and decides in
//!   Rust from that fresh state (`plan_status`, `plan_rollout`), then writes;
//! - the schema backs the decisions: primary key (id, version), one draft per
//!   id (partial unique index, or MariaDB's generated `draft_of` column), and
//!   every status update names the status it expects (`WHERE ... AND status = ?`);
//! - a lost race (unique violation, deadlock, busy, serialization failure) is
//!   retried; the retry sees the winner's commit and answers with the precise
//!   Conflict, so a race never surfaces as a 500.

use serde_json::{Map, Value as Json, json};
use sqlx::{ColumnIndex, Decode, Row, Type};

use super::{
    ActiveRow, AgainstActive, Audit, BeginWrite, Kind, ListQuery, Record, SERVER_MANAGED, Stamp,
    Status, StorageError, Store, StoredRecord, dispatch, dispatch_write, execute, fetch_all,
    fetch_one, fetch_optional, now_micros, retry, rfc3339,
};

/// The lifecycle-relevant columns of one version, as locked inside a transaction.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct VRow {
    pub version: i64,
    pub status: Status,
    pub rollout: i64,
    pub created_at: i64,
    pub updated_at: i64,
}

/// One status/rollout change the plan asks for (`from` is re-checked by the UPDATE).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Change {
    pub version: i64,
    pub from: Status,
    pub to: Status,
    pub rollout: i64,
}

/// The outcome of a lifecycle decision: the version the caller gets back, the
/// row changes, and the audit action.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan {
    pub target: i64,
    pub changes: Vec<Change>,
    pub action: &'static str,
}

/// A definition ready to store: server-managed and id fields stripped, the
/// columns used for filters and uniqueness extracted.
pub(crate) struct Prepared {
    pub definition: Json,
    pub text: String,
    /// `super::digest(text)`, stored beside it.
    pub digest: String,
    /// The `tags` member's JSON text when it is an array, stored beside the
    /// definition for the list filter (JSON functions of MariaDB stop at 32
    /// levels, so the filter cannot read deep definitions).
    pub tags: Option<String>,
    pub name: String,
    pub channel_type: Option<String>,
    pub protocol: Option<String>,
}

pub(crate) fn prepare(kind: Kind, definition: &Json) -> Result<Prepared, StorageError> {
    let Json::Object(obj) = definition else {
        return Err(StorageError::BadRequest(format!(
            "a {} definition must be a JSON object",
            kind.label()
        )));
    };
    let mut clean = Map::new();
    for (k, v) in obj {
        if k != kind.id_field() && !SERVER_MANAGED.contains(&k.as_str()) {
            clean.insert(k.clone(), v.clone());
        }
    }
    let text_of = |k: &str| clean.get(k).and_then(Json::as_str).map(str::to_owned);
    let name = text_of("name").unwrap_or_default();
    let (channel_type, protocol) = match kind {
        Kind::Channel => {
            let (channel_type, protocol) = super::effective_channel(&clean);
            (Some(channel_type.to_owned()), Some(protocol.to_owned()))
        }
        Kind::Workflow => (None, None),
    };
    let tags = clean
        .get("tags")
        .filter(|t| t.is_array())
        .map(Json::to_string);
    let definition = Json::Object(clean);
    let text = definition.to_string();
    Ok(Prepared {
        definition,
        digest: super::digest(&text),
        text,
        name,
        channel_type,
        protocol,
        tags,
    })
}

/// Reads a `Record` from the `REC` column list (see `sql.rs`).
pub(crate) fn record_from_row<R: Row>(row: &R) -> Result<Record, StorageError>
where
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
{
    stored_from_row(row)?.into_record()
}

/// A row with the definition left as text.
pub(crate) fn stored_from_row<R: Row>(row: &R) -> Result<StoredRecord, StorageError>
where
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
{
    // Text columns are read unchecked: MariaDB reports utf8mb4_bin columns
    // with the BINARY flag, which sqlx's checked String decode rejects.
    let get_s = |i: usize| {
        row.try_get_unchecked::<String, usize>(i)
            .map_err(super::db_err)
    };
    let get_i = |i: usize| row.try_get::<i64, usize>(i).map_err(super::db_err);
    let status = get_s(2)?;
    let (created_us, updated_us) = (get_i(5)?, get_i(6)?);
    Ok(StoredRecord {
        id: get_s(0)?,
        version: get_i(1)?,
        status: parse_status(&status)?,
        rollout_percentage: get_i(3)?,
        text: get_s(4)?.into(),
        created_at: rfc3339(created_us),
        updated_at: rfc3339(updated_us),
        stamp: Stamp {
            created_us,
            updated_us,
            digest: None,
        },
    })
}

fn parse_status(status: &str) -> Result<Status, StorageError> {
    Status::parse(status)
        .ok_or_else(|| StorageError::Database(format!("unknown stored status '{status}'")))
}

/// The digest column (nullable text) at `i`.
fn digest_at<R: Row>(row: &R, i: usize) -> Result<Option<std::sync::Arc<str>>, StorageError>
where
    usize: ColumnIndex<R>,
    for<'r> Option<String>: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(row
        .try_get_unchecked::<Option<String>, usize>(i)
        .map_err(super::db_err)?
        .map(Into::into))
}

/// `stored_from_row` of a row that also carries the digest (`REC, digest`).
fn stored_with_digest<R: Row>(row: &R) -> Result<StoredRecord, StorageError>
where
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<String>: Decode<'r, R::Database> + Type<R::Database>,
{
    let mut stored = stored_from_row(row)?;
    stored.stamp.digest = digest_at(row, 7)?;
    Ok(stored)
}

/// An `ActiveRow` from `KindSql::active_meta`.
fn meta_from_row<R: Row>(row: &R) -> Result<ActiveRow, StorageError>
where
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<String>: Decode<'r, R::Database> + Type<R::Database>,
{
    let get_s = |i: usize| {
        row.try_get_unchecked::<String, usize>(i)
            .map_err(super::db_err)
    };
    let get_i = |i: usize| row.try_get::<i64, usize>(i).map_err(super::db_err);
    Ok(ActiveRow {
        id: get_s(0)?,
        version: get_i(1)?,
        status: parse_status(&get_s(2)?)?,
        rollout_percentage: get_i(3)?,
        stamp: Stamp {
            created_us: get_i(4)?,
            updated_us: get_i(5)?,
            digest: digest_at(row, 6)?,
        },
    })
}

fn vrow_from_row<R: Row>(row: &R) -> Result<VRow, StorageError>
where
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
{
    // Text columns are read unchecked: MariaDB reports utf8mb4_bin columns
    // with the BINARY flag, which sqlx's checked String decode rejects.
    let status: String = row.try_get_unchecked(1).map_err(super::db_err)?;
    Ok(VRow {
        version: row.try_get(0).map_err(super::db_err)?,
        status: Status::parse(&status)
            .ok_or_else(|| StorageError::Database(format!("unknown stored status '{status}'")))?,
        rollout: row.try_get(2).map_err(super::db_err)?,
        created_at: row.try_get(3).map_err(super::db_err)?,
        updated_at: row.try_get(4).map_err(super::db_err)?,
    })
}

fn count_from_row<R: Row>(row: &R) -> Result<i64, StorageError>
where
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    row.try_get(0).map_err(super::db_err)
}

/// Locks the id's rows (server backends: lock first, then re-read, because a
/// PostgreSQL READ COMMITTED statement that waited on a lock does not see rows
/// inserted by the transaction it waited for) and returns them by version.
macro_rules! load_state {
    ($tx:expr, $k:expr, $id:expr) => {{
        if let Some(lock) = &$k.lock {
            fetch_all!(&mut *$tx, lock, $id)?;
        }
        fetch_all!(&mut *$tx, &$k.state, $id)?
            .iter()
            .map(vrow_from_row)
            .collect::<Result<Vec<VRow>, StorageError>>()?
    }};
}

/// Channel names route traffic, so a name may belong to one channel id only.
/// Serialised by the `channel_names` lock row (SQLite: the write lock).
macro_rules! check_channel_name {
    ($tx:expr, $sql:expr, $k:expr, $id:expr, $name:expr) => {{
        if let Some(lock) = &$sql.lock_channel_names {
            fetch_all!(&mut *$tx, lock)?;
        }
        if fetch_optional!(&mut *$tx, &$k.name_taken, $name, $id)?.is_some() {
            return Err(StorageError::Conflict(format!(
                "a channel named '{}' already exists",
                $name
            )));
        }
    }};
}

/// Writes the audit entry inside the transaction of the change it records.
macro_rules! insert_audit {
    ($tx:expr, $sql:expr, $a:expr, $now:expr) => {
        execute!(
            &mut *$tx,
            &$sql.audit_insert,
            &$a.principal,
            &$a.action,
            &$a.resource_type,
            &$a.resource_id,
            $a.version,
            $a.details.to_string(),
            $now
        )
    };
}
pub(crate) use insert_audit;

fn conflict(msg: String) -> StorageError {
    StorageError::Conflict(msg)
}

/// Decides a `PATCH .../status` move from the locked rows (ascending by version).
///
/// Moves listed (anything else is a Conflict naming the move):
/// - draft → active. Rollout p (default 100): at 100 every other active or
///   paused version is archived; at 1..=99 the newest other active version stays
///   active with 100 - p and any older active one is archived (at most two active).
/// - archived → active (rollback): the only active version, at 100%; the other
///   active/paused versions are archived. A rollout other than 100 is a 400.
/// - paused → active: resumes with its rollout when nothing else is active,
///   otherwise it is a rollback as above.
/// - active → archived, paused → archived. Archiving one of two active versions
///   gives the remaining one 100%.
/// - active → paused.
///
/// Without `version`: `active` picks the draft, else (when nothing is active)
/// resumes every paused version, else the most recently archived version;
/// `archived` takes every active and paused version; `paused` every active one.
pub(crate) fn plan_status(
    kind: Kind,
    id: &str,
    rows: &[VRow],
    target: Status,
    version: Option<i64>,
    rollout: Option<i64>,
) -> Result<Plan, StorageError> {
    use Status::*;
    let label = kind.label();
    if let Some(p) = rollout
        && !(1..=100).contains(&p)
    {
        return Err(StorageError::BadRequest(
            "rollout_percentage must be between 1 and 100".into(),
        ));
    }
    let find = |v: i64| {
        rows.iter().find(|r| r.version == v).ok_or_else(|| {
            StorageError::NotFound(format!(
                "{} with id '{id}' not found: it has no version {v}",
                kind.title()
            ))
        })
    };
    let illegal = |r: &VRow, to: Status| {
        conflict(format!(
            "cannot move {label} '{id}' version {} from {} to {to}",
            r.version, r.status
        ))
    };
    let with_status = |s: &[Status]| {
        rows.iter()
            .filter(|r| s.contains(&r.status))
            .collect::<Vec<_>>()
    };
    // Everything except `t` that is serving or paused goes to archived.
    let archive_others = |t: i64, changes: &mut Vec<Change>| {
        for r in rows
            .iter()
            .filter(|r| r.version != t && matches!(r.status, Active | Paused))
        {
            changes.push(Change {
                version: r.version,
                from: r.status,
                to: Archived,
                rollout: r.rollout,
            });
        }
    };
    let mut changes = Vec::new();
    match target {
        Draft => Err(StorageError::BadRequest(
            "a version cannot be moved back to draft; create a new version instead".into(),
        )),
        Active => {
            let t = match version {
                Some(v) => find(v)?,
                None => {
                    if let Some(d) = rows.iter().find(|r| r.status == Draft) {
                        d
                    } else if with_status(&[Active]).is_empty()
                        && !with_status(&[Paused]).is_empty()
                    {
                        // Resumed as a split that adds up: the newest keeps
                        // its share p, the one before it serves 100 - p (none
                        // when p is 100), any older one is archived. Their
                        // stored shares may not add up (each was paused
                        // from a different split). A share asked for is
                        // the newest's (audit 85: it was ignored; it may be
                        // partial, as a first activation may); unasked, a
                        // version resumed alone serves all the traffic
                        // whatever share it was paused with.
                        let paused = with_status(&[Paused]);
                        let n = paused.len();
                        let newest_share = match rollout {
                            Some(p) => p,
                            None if n == 1 => 100,
                            None => paused.last().map_or(100, |r| r.rollout),
                        };
                        for (i, r) in paused.iter().enumerate() {
                            let (to, rollout) = if i + 1 == n {
                                (Active, newest_share)
                            } else if i + 2 == n && newest_share < 100 {
                                (Active, 100 - newest_share)
                            } else {
                                (Archived, r.rollout)
                            };
                            changes.push(Change {
                                version: r.version,
                                from: Paused,
                                to,
                                rollout,
                            });
                        }
                        let target = paused.last().map(|r| r.version).unwrap_or_default();
                        return Ok(Plan {
                            target,
                            changes,
                            action: "activate",
                        });
                    } else if let Some(a) = rows
                        .iter()
                        .filter(|r| r.status == Archived)
                        .max_by_key(|r| (r.updated_at, r.version))
                    {
                        a
                    } else {
                        return Err(conflict(format!(
                            "{label} '{id}' has no draft or archived version to activate"
                        )));
                    }
                }
            };
            match t.status {
                Draft => {
                    let p = rollout.unwrap_or(100);
                    changes.push(Change {
                        version: t.version,
                        from: Draft,
                        to: Active,
                        rollout: p,
                    });
                    if p == 100 {
                        archive_others(t.version, &mut changes);
                    } else if let Some((newest, older)) = with_status(&[Active]).split_last() {
                        // Canary: the newest other active version serves the rest.
                        for r in older {
                            changes.push(Change {
                                version: r.version,
                                from: Active,
                                to: Archived,
                                rollout: r.rollout,
                            });
                        }
                        changes.push(Change {
                            version: newest.version,
                            from: Active,
                            to: Active,
                            rollout: 100 - p,
                        });
                    }
                }
                Active => return Err(illegal(t, Active)),
                // Rollback: an archived version, or a paused one while another serves.
                _ if t.status == Archived || !with_status(&[Active]).is_empty() => {
                    // A move the state table does not list (a partial
                    // rollback), refused for the state the version is in,
                    // not for the body: 409, as the same body activating a
                    // draft is fine (audit 81: it was a 400).
                    if rollout.is_some_and(|p| p != 100) {
                        return Err(StorageError::Conflict(if t.status == Paused {
                            // Audit 85: the message called the paused
                            // version archived.
                            format!(
                                "resuming paused version {} while another version serves is a rollback, which always serves 100% of traffic",
                                t.version
                            )
                        } else {
                            "re-activating an archived version (rollback) always serves 100% of traffic".into()
                        }));
                    }
                    changes.push(Change {
                        version: t.version,
                        from: t.status,
                        to: Active,
                        rollout: 100,
                    });
                    archive_others(t.version, &mut changes);
                }
                // Resume: nothing else serves, so the paused version serves
                // all the traffic unless a share is asked for (as a first
                // activation may be partial); the share it was paused with
                // belonged to a split that no longer serves (audit 85: it
                // kept it, and the rest of the traffic had no workflow).
                _ => {
                    changes.push(Change {
                        version: t.version,
                        from: Paused,
                        to: Active,
                        rollout: rollout.unwrap_or(100),
                    });
                }
            }
            Ok(Plan {
                target: t.version,
                changes,
                action: "activate",
            })
        }
        Archived | Paused => {
            if rollout.is_some() {
                return Err(StorageError::BadRequest(
                    "rollout_percentage applies only when activating".into(),
                ));
            }
            let (from, action): (&[Status], &'static str) = if target == Archived {
                (&[Active, Paused], "archive")
            } else {
                (&[Active], "pause")
            };
            let moved: Vec<&VRow> = match version {
                Some(v) => {
                    let t = find(v)?;
                    if !from.contains(&t.status) {
                        return Err(illegal(t, target));
                    }
                    vec![t]
                }
                None => with_status(from),
            };
            let Some(last) = moved.last() else {
                // Say what there is: "no active version" alone read as if
                // the draft had not been found (audit 68).
                let what = if target == Archived {
                    "active or paused"
                } else {
                    "active"
                };
                // A paused version is what there is to say when pausing
                // (audit 85: the newest, archived, was named instead).
                let paused = with_status(&[Paused]);
                let newest = match paused.last() {
                    Some(p) if target == Paused => Some(*p),
                    _ => rows.iter().max_by_key(|r| r.version),
                };
                return Err(conflict(match newest {
                    Some(n) if n.status == Paused && target == Paused => format!(
                        "{label} '{id}' has no {what} version to {action}; version {} is already paused",
                        n.version
                    ),
                    Some(n) => format!(
                        "{label} '{id}' has no {what} version to {action}; version {} is {}",
                        n.version, n.status
                    ),
                    None => format!("{label} '{id}' has no {what} version to {action}"),
                }));
            };
            for r in &moved {
                changes.push(Change {
                    version: r.version,
                    from: r.status,
                    to: target,
                    rollout: r.rollout,
                });
            }
            // The version left serving alone takes all the traffic back.
            let remaining: Vec<&VRow> = with_status(&[Active])
                .into_iter()
                .filter(|r| !moved.iter().any(|m| m.version == r.version))
                .collect();
            if let [only] = remaining.as_slice()
                && only.rollout != 100
            {
                changes.push(Change {
                    version: only.version,
                    from: Active,
                    to: Active,
                    rollout: 100,
                });
            }
            Ok(Plan {
                target: last.version,
                changes,
                action,
            })
        }
    }
}

/// Decides a `PATCH .../rollout`: the newest active version gets `p`; at 100 the
/// older active version is archived, below 100 it serves the remaining 100 - p.
pub(crate) fn plan_rollout(
    kind: Kind,
    id: &str,
    rows: &[VRow],
    p: i64,
) -> Result<Plan, StorageError> {
    if !(1..=100).contains(&p) {
        return Err(StorageError::BadRequest(
            "rollout_percentage must be between 1 and 100".into(),
        ));
    }
    let actives: Vec<&VRow> = rows.iter().filter(|r| r.status == Status::Active).collect();
    let Some((newest, older)) = actives.split_last() else {
        return Err(conflict(format!(
            "{} '{id}' has no active version",
            kind.label()
        )));
    };
    // The only active version serving everything has no other version to
    // take the rest: lowering its share would send that part nowhere. (A
    // version activated partly on purpose keeps its share adjustable.)
    if older.is_empty() && newest.rollout == 100 && p < 100 {
        return Err(conflict(format!(
            "{} '{id}' version {} is the only active version: no other version would serve the remaining {}%; activate a new version with rollout_percentage to start a canary",
            kind.label(),
            newest.version,
            100 - p
        )));
    }
    let mut changes = vec![Change {
        version: newest.version,
        from: Status::Active,
        to: Status::Active,
        rollout: p,
    }];
    for (i, r) in older.iter().rev().enumerate() {
        if p == 100 || i > 0 {
            changes.push(Change {
                version: r.version,
                from: Status::Active,
                to: Status::Archived,
                rollout: r.rollout,
            });
        } else {
            changes.push(Change {
                version: r.version,
                from: Status::Active,
                to: Status::Active,
                rollout: 100 - p,
            });
        }
    }
    // A share a version already has is no change: asked again (a retried
    // call, a pipeline applying its state), nothing is written, audited or
    // reloaded (audit 68).
    changes.retain(|c| {
        c.from != c.to
            || rows
                .iter()
                .all(|r| r.version != c.version || r.rollout != c.rollout)
    });
    Ok(Plan {
        target: newest.version,
        changes,
        action: "rollout",
    })
}

/// The audit entry's `changes`; a channel has no rollout share to report.
fn changes_json(kind: Kind, plan: &Plan) -> Json {
    Json::Array(
        plan.changes
            .iter()
            .map(|c| {
                let mut change = json!({"version": c.version, "from": c.from, "to": c.to});
                if kind == Kind::Workflow {
                    change["rollout_percentage"] = c.rollout.into();
                }
                change
            })
            .collect(),
    )
}

impl Store {
    /// Creates version 1 as a draft. Conflict if the id exists, or (channels) if
    /// another channel id uses the same `name`.
    pub async fn create(
        &self,
        kind: Kind,
        id: &str,
        definition: &Json,
        audit: Audit,
    ) -> Result<Record, StorageError> {
        if id.is_empty() {
            return Err(StorageError::BadRequest(format!(
                "{} must not be empty",
                kind.id_field()
            )));
        }
        let p = prepare(kind, definition)?;
        retry(|| self.create_once(kind, id, &p, audit.clone())).await
    }

    async fn create_once(
        &self,
        kind: Kind,
        id: &str,
        p: &Prepared,
        audit: Audit,
    ) -> Result<Record, StorageError> {
        let s = self.sql();
        let k = s.kind(kind);
        let now = now_micros();
        let mut audit = audit.complete(kind.label(), id, Some(1), json!({"name": p.name}));
        if audit.action.is_empty() {
            audit.action = "create".into();
        }
        dispatch_write!(self, pool => {
            let mut tx = pool.begin_write().await?;
            if kind == Kind::Channel {
                check_channel_name!(tx, s, k, id, &p.name);
            }
            let n = count_from_row(&fetch_one!(&mut *tx, &k.exists, id)?)?;
            if n > 0 {
                return Err(conflict(format!("{} '{id}' already exists", kind.label())));
            }
            execute!(&mut *tx, &k.insert, id, 1_i64, Status::Draft.as_str(), 100_i64, &p.name,
                     p.channel_type.as_deref(), p.protocol.as_deref(), &p.text, &p.digest, p.tags.as_deref(), now, now)?;
            insert_audit!(tx, s, audit, now)?;
            tx.commit().await.map_err(super::db_err)?;
        });
        Ok(Record {
            id: id.into(),
            version: 1,
            status: Status::Draft,
            rollout_percentage: 100,
            definition: p.definition.clone(),
            created_at: rfc3339(now),
            updated_at: rfc3339(now),
        })
    }

    /// One row per id (its newest version among the versions matching the
    /// filters), newest first by `created_at` then id (both descending), plus
    /// the total number of such rows.
    pub async fn list(
        &self,
        kind: Kind,
        q: &ListQuery,
    ) -> Result<(Vec<Record>, i64), StorageError> {
        let k = self.sql().kind(kind);
        let status = q.status.map(Status::as_str);
        let (tag, ct, proto) = (
            q.tag.as_deref(),
            q.channel_type.as_deref(),
            q.protocol.as_deref(),
        );
        dispatch!(self, pool => {
            let total = count_from_row(&fetch_one!(pool, &k.list_count, status, status, tag, tag, ct, ct, proto, proto)?)?;
            let rows = fetch_all!(pool, &k.list_page, status, status, tag, tag, ct, ct, proto, proto, q.limit, q.offset)?;
            let records = rows.iter().map(record_from_row).collect::<Result<Vec<_>, _>>()?;
            Ok((records, total))
        })
    }

    /// One version; the latest when `version` is `None`.
    pub async fn get(
        &self,
        kind: Kind,
        id: &str,
        version: Option<i64>,
    ) -> Result<Record, StorageError> {
        let k = self.sql().kind(kind);
        dispatch!(self, pool => {
            let row = match version {
                None => fetch_optional!(pool, &k.get_latest, id)?,
                Some(v) => fetch_optional!(pool, &k.get_version, id, v)?,
            };
            match (row, version) {
                (Some(row), _) => record_from_row(&row),
                (None, Some(v)) if count_from_row(&fetch_one!(pool, &k.exists, id)?)? > 0 => Err(StorageError::NotFound(
                    format!("{} with id '{id}' not found: it has no version {v}", kind.title()),
                )),
                (None, _) => Err(kind.not_found(id)),
            }
        })
    }

    /// Replaces the definition of the draft. Conflict when the latest version is
    /// not a draft (active versions are immutable).
    pub async fn update_draft(
        &self,
        kind: Kind,
        id: &str,
        definition: &Json,
        audit: Audit,
    ) -> Result<Record, StorageError> {
        let p = prepare(kind, definition)?;
        retry(|| self.update_draft_once(kind, id, &p, audit.clone())).await
    }

    async fn update_draft_once(
        &self,
        kind: Kind,
        id: &str,
        p: &Prepared,
        audit: Audit,
    ) -> Result<Record, StorageError> {
        let s = self.sql();
        let k = s.kind(kind);
        let now = now_micros();
        dispatch_write!(self, pool => {
            let mut tx = pool.begin_write().await?;
            if kind == Kind::Channel {
                // Before the id lock: every name-changing transaction takes the
                // name lock first, so the two locks are always taken in one order.
                if let Some(lock) = &s.lock_channel_names {
                    fetch_all!(&mut *tx, lock)?;
                }
            }
            let rows = load_state!(tx, k, id);
            let Some(latest) = rows.last() else { return Err(kind.not_found(id)) };
            if latest.status != Status::Draft {
                // Named by the version that serves (an archived later one
                // is not what the caller meant to edit), and how to start
                // a draft.
                let shown = rows
                    .iter()
                    .rev()
                    .find(|r| matches!(r.status, Status::Active | Status::Paused))
                    .unwrap_or(latest);
                // A draft starts from the active version: with none, one
                // must serve first (audit 119: the advice led to a 409).
                let base = format!("/api/v1/admin/{}s/{id}", kind.label());
                let how = match shown.status {
                    Status::Active => format!("POST {base}/versions starts one"),
                    Status::Paused => format!(
                        "resume it (PATCH {base}/status with {{\"status\": \"active\"}}), then POST {base}/versions starts one"
                    ),
                    _ => format!(
                        "activate a version (PATCH {base}/status with {{\"status\": \"active\"}}), then POST {base}/versions starts one"
                    ),
                };
                return Err(conflict(format!(
                    "only a draft can be updated, and {} '{id}' has none (version {} is {}); {how}",
                    kind.label(), shown.version, shown.status
                )));
            }
            if kind == Kind::Channel {
                check_channel_name!(tx, s, k, id, &p.name);
            }
            let n = execute!(&mut *tx, &k.update_definition, &p.text, &p.digest, p.tags.as_deref(), &p.name, p.channel_type.as_deref(),
                             p.protocol.as_deref(), now, id, latest.version)?;
            if n != 1 {
                return Err(conflict(format!("only a draft can be updated; {} '{id}' changed concurrently", kind.label())));
            }
            let mut audit = audit.complete(kind.label(), id, Some(latest.version), json!({"name": p.name}));
            if audit.action.is_empty() {
                audit.action = "update".into();
            }
            insert_audit!(tx, s, audit, now)?;
            tx.commit().await.map_err(super::db_err)?;
            Ok(Record {
                id: id.into(),
                version: latest.version,
                status: Status::Draft,
                rollout_percentage: latest.rollout,
                definition: p.definition.clone(),
                created_at: rfc3339(latest.created_at),
                updated_at: rfc3339(now),
            })
        })
    }

    /// Deletes every version of the id.
    pub async fn delete(&self, kind: Kind, id: &str, audit: Audit) -> Result<(), StorageError> {
        retry(|| self.delete_once(kind, id, audit.clone())).await
    }

    async fn delete_once(&self, kind: Kind, id: &str, audit: Audit) -> Result<(), StorageError> {
        let s = self.sql();
        let k = s.kind(kind);
        let now = now_micros();
        dispatch_write!(self, pool => {
            let mut tx = pool.begin_write().await?;
            let rows = load_state!(tx, k, id);
            if rows.is_empty() {
                return Err(kind.not_found(id));
            }
            execute!(&mut *tx, &k.delete, id)?;
            let versions: Vec<i64> = rows.iter().map(|r| r.version).collect();
            let mut audit = audit.complete(kind.label(), id, None, json!({"versions": versions}));
            if audit.action.is_empty() {
                audit.action = "delete".into();
            }
            insert_audit!(tx, s, audit, now)?;
            tx.commit().await.map_err(super::db_err)?;
            Ok(())
        })
    }

    /// Whether a channel other than `id` is named `name` (what `create`
    /// would refuse; a dry-run import asks without writing).
    pub async fn channel_name_taken(&self, name: &str, id: &str) -> Result<bool, StorageError> {
        let k = self.sql().kind(Kind::Channel);
        Ok(dispatch!(self, pool => {
            fetch_optional!(pool, &k.name_taken, name, id)?.is_some()
        }))
    }

    /// Every version, ascending. NotFound if the id has none.
    pub async fn versions(&self, kind: Kind, id: &str) -> Result<Vec<Record>, StorageError> {
        let k = self.sql().kind(kind);
        let records = dispatch!(self, pool => {
            fetch_all!(pool, &k.versions, id)?.iter().map(record_from_row).collect::<Result<Vec<_>, _>>()?
        });
        if records.is_empty() {
            return Err(kind.not_found(id));
        }
        Ok(records)
    }

    /// Copies the newest active version into a new draft (version max + 1).
    /// Conflict when a draft exists or nothing is active.
    pub async fn new_version(
        &self,
        kind: Kind,
        id: &str,
        audit: Audit,
    ) -> Result<Record, StorageError> {
        retry(|| self.new_version_once(kind, id, audit.clone())).await
    }

    async fn new_version_once(
        &self,
        kind: Kind,
        id: &str,
        audit: Audit,
    ) -> Result<Record, StorageError> {
        let s = self.sql();
        let k = s.kind(kind);
        let now = now_micros();
        dispatch_write!(self, pool => {
            let mut tx = pool.begin_write().await?;
            let rows = load_state!(tx, k, id);
            if rows.is_empty() {
                return Err(kind.not_found(id));
            }
            if let Some(d) = rows.iter().find(|r| r.status == Status::Draft) {
                return Err(conflict(format!("{} '{id}' already has a draft (version {})", kind.label(), d.version)));
            }
            let Some(source) = rows.iter().rev().find(|r| r.status == Status::Active) else {
                return Err(conflict(format!("{} '{id}' has no active version", kind.label())));
            };
            let next = rows.iter().map(|r| r.version).max().unwrap_or(0) + 1;
            execute!(&mut *tx, &k.copy_version, next, now, now, id, source.version)?;
            let record = record_from_row(&fetch_one!(&mut *tx, &k.get_version, id, next)?)?;
            let mut audit = audit.complete(kind.label(), id, Some(next), json!({"from_version": source.version}));
            if audit.action.is_empty() {
                audit.action = "new_version".into();
            }
            insert_audit!(tx, s, audit, now)?;
            tx.commit().await.map_err(super::db_err)?;
            Ok(record)
        })
    }

    /// [`Self::set_status_checked`] with no check: the storage tests' form.
    #[cfg(test)]
    pub async fn set_status(
        &self,
        kind: Kind,
        id: &str,
        target: Status,
        version: Option<i64>,
        rollout: Option<i64>,
        audit: Audit,
    ) -> Result<Record, StorageError> {
        self.set_status_checked(kind, id, target, version, rollout, audit, &|_| Ok(()), None)
            .await
    }

    /// Moves a version to `target` (see `plan_status` for the listed moves and
    /// how the version is chosen when `version` is `None`), with `check` run
    /// on the version the move activates (as it is stored), inside the
    /// transaction: its error undoes the move. Returns the target version as
    /// stored afterwards. `against`, when given, checks the version the
    /// move activates against the other ids' active versions, read in the
    /// same transaction after a lock that serialises every such move (the
    /// `channel_names` lock row; SQLite's write lock), so two racing
    /// activations cannot both pass it, on one service or across replicas.
    #[allow(clippy::too_many_arguments)]
    pub async fn set_status_checked(
        &self,
        kind: Kind,
        id: &str,
        target: Status,
        version: Option<i64>,
        rollout: Option<i64>,
        audit: Audit,
        check: &(dyn Fn(&Record) -> Result<(), StorageError> + Send + Sync),
        against: Option<&AgainstActive<'_>>,
    ) -> Result<Record, StorageError> {
        retry(|| {
            self.apply_plan_once(kind, id, audit.clone(), check, against, move |rows| {
                plan_status(kind, id, rows, target, version, rollout)
            })
        })
        .await
    }

    /// Sets the share of the newest active version (1..=100); at 100 the older
    /// active version is archived. Conflict when nothing is active. Returns
    /// the newest active version and whether anything changed (asking for
    /// the shares the versions have writes nothing).
    pub async fn set_rollout(
        &self,
        kind: Kind,
        id: &str,
        percentage: i64,
        audit: Audit,
    ) -> Result<(Record, bool), StorageError> {
        if !(1..=100).contains(&percentage) {
            return Err(StorageError::BadRequest(
                "rollout_percentage must be between 1 and 100".into(),
            ));
        }
        let unchanged = std::sync::atomic::AtomicBool::new(false);
        let record = retry(|| {
            self.apply_plan_once(kind, id, audit.clone(), &|_| Ok(()), None, |rows| {
                let plan = plan_rollout(kind, id, rows, percentage)?;
                unchanged.store(
                    plan.changes.is_empty(),
                    std::sync::atomic::Ordering::Relaxed,
                );
                Ok(plan)
            })
        })
        .await?;
        Ok((
            record,
            !unchanged.load(std::sync::atomic::Ordering::Relaxed),
        ))
    }

    async fn apply_plan_once<F>(
        &self,
        kind: Kind,
        id: &str,
        audit: Audit,
        check: &(dyn Fn(&Record) -> Result<(), StorageError> + Send + Sync),
        against: Option<&AgainstActive<'_>>,
        decide: F,
    ) -> Result<Record, StorageError>
    where
        F: FnOnce(&[VRow]) -> Result<Plan, StorageError>,
    {
        let s = self.sql();
        let k = s.kind(kind);
        let now = now_micros();
        dispatch_write!(self, pool => {
            let mut tx = pool.begin_write().await?;
            // Taken first: on MariaDB the transaction's snapshot is fixed
            // by its first plain read, which must come after the lock for
            // the check below to see the moves committed before it.
            if against.is_some()
                && let Some(lock) = &s.lock_channel_names
            {
                fetch_all!(&mut *tx, lock)?;
            }
            let rows = load_state!(tx, k, id);
            if rows.is_empty() {
                return Err(kind.not_found(id));
            }
            let plan = decide(&rows)?;
            if plan.changes.is_empty() {
                // Nothing to write: the version as it is, no audit entry.
                return record_from_row(&fetch_one!(&mut *tx, &k.get_version, id, plan.target)?);
            }
            for c in &plan.changes {
                let n = execute!(&mut *tx, &k.set_state, c.to.as_str(), c.rollout, now, id, c.version, c.from.as_str())?;
                if n != 1 {
                    // The row is locked, so this means the schema and the plan disagree.
                    return Err(StorageError::Database(format!(
                        "{} '{id}' version {} was not in state {}", kind.label(), c.version, c.from
                    )));
                }
            }
            let record = record_from_row(&fetch_one!(&mut *tx, &k.get_version, id, plan.target)?)?;
            if plan.changes.iter().any(|c| c.version == plan.target && c.to == Status::Active) {
                check(&record)?;
                if let Some(against) = against
                    && (against.applies)(&record)
                {
                    let others = fetch_all!(&mut *tx, &k.active)?
                        .iter()
                        .map(stored_with_digest)
                        .filter(|r| r.as_ref().map_or(true, |r| r.id != id))
                        .collect::<Result<Vec<_>, _>>()?;
                    (against.check)(&record, &others)?;
                }
            }
            let archived: Vec<i64> = plan.changes.iter()
                .filter(|c| c.to == Status::Archived && c.version != plan.target)
                .map(|c| c.version).collect();
            let mut details = json!({"status": record.status, "changes": changes_json(kind, &plan)});
            if kind == Kind::Workflow {
                details["rollout_percentage"] = record.rollout_percentage.into();
            }
            if !archived.is_empty() {
                details["archived_versions"] = json!(archived);
            }
            let mut audit = audit.complete(kind.label(), id, Some(plan.target), details);
            if audit.action.is_empty() {
                audit.action = plan.action.into();
            }
            insert_audit!(tx, s, audit, now)?;
            tx.commit().await.map_err(super::db_err)?;
            Ok(record)
        })
    }

    /// Every active version of every id (ascending by id, version), for the engine.
    /// Every active version of `kind`, definitions as text (the engine
    /// reload parses only what changed).
    pub async fn active(&self, kind: Kind) -> Result<Vec<StoredRecord>, StorageError> {
        let k = self.sql().kind(kind);
        dispatch!(self, pool => {
            fetch_all!(pool, &k.active)?.iter().map(stored_with_digest).collect()
        })
    }

    /// Every active version of `kind` without its definition (ascending by
    /// id, version): what a reload reads first.
    ///
    /// Streamed, with a yield every `REFILL_ROWS` rows: a reload on a
    /// request worker (an in-memory database's; see `engine::Reloader`)
    /// decoding thousands of rows in one go would hold the requests queued
    /// behind it for milliseconds.
    pub async fn active_rows(&self, kind: Kind) -> Result<Vec<ActiveRow>, StorageError> {
        use futures_util::TryStreamExt as _;
        const REFILL_ROWS: usize = 64;
        let k = self.sql().kind(kind);
        dispatch!(self, pool => {
            let mut stream = sqlx::query(&k.active_meta).fetch(pool);
            let mut out = Vec::new();
            while let Some(row) = stream.try_next().await.map_err(super::db_err)? {
                out.push(meta_from_row(&row)?);
                if out.len() % REFILL_ROWS == 0 {
                    tokio::task::yield_now().await;
                }
            }
            Ok(out)
        })
    }

    /// One version with its definition text and stamp, whatever its status.
    pub async fn stored(
        &self,
        kind: Kind,
        id: &str,
        version: i64,
    ) -> Result<Option<StoredRecord>, StorageError> {
        let k = self.sql().kind(kind);
        dispatch!(self, pool => {
            fetch_optional!(pool, &k.stored_one, id, version)?
                .as_ref()
                .map(stored_with_digest)
                .transpose()
        })
    }

    /// Fills in the digest of rows written before the digest column existed
    /// (run by `migrate`; a no-op once every row has one). The digest is of
    /// the text as read back, which names the stored definition as well as
    /// the text written does: equal digests mean equal definitions.
    pub(crate) async fn backfill(&self) -> Result<(), StorageError> {
        self.backfill_digests().await?;
        self.backfill_channel_defaults().await
    }

    /// Channels written before their `channel_type` and `protocol` columns
    /// held the effective values (a definition without them stored NULL, so
    /// `?protocol=rest` missed a channel routed as REST by default). Run by
    /// `migrate`; a no-op once every row has both.
    async fn backfill_channel_defaults(&self) -> Result<(), StorageError> {
        let k = self.sql().kind(Kind::Channel);
        dispatch_write!(self, pool => {
            let rows = fetch_all!(pool, &k.effective_missing)?;
            for row in &rows {
                let get_s = |i: usize| row.try_get_unchecked::<String, usize>(i).map_err(super::db_err);
                let id = get_s(0)?;
                let version = row.try_get::<i64, usize>(1).map_err(super::db_err)?;
                let def: Json = serde_json::from_str(&get_s(2)?).unwrap_or(Json::Null);
                let empty = serde_json::Map::new();
                let (channel_type, protocol) =
                    super::effective_channel(def.as_object().unwrap_or(&empty));
                execute!(pool, &k.effective_set, channel_type, protocol, &id, version)?;
            }
        });
        Ok(())
    }

    pub(crate) async fn backfill_digests(&self) -> Result<(), StorageError> {
        for kind in [Kind::Workflow, Kind::Channel] {
            let k = self.sql().kind(kind);
            dispatch_write!(self, pool => {
                let rows = fetch_all!(pool, &k.digest_missing)?;
                for row in &rows {
                    let get_s = |i: usize| row.try_get_unchecked::<String, usize>(i).map_err(super::db_err);
                    let id = get_s(0)?;
                    let version = row.try_get::<i64, usize>(1).map_err(super::db_err)?;
                    let digest = super::digest(&get_s(2)?);
                    execute!(pool, &k.digest_set, &digest, &id, version)?;
                }
            });
        }
        Ok(())
    }
}
