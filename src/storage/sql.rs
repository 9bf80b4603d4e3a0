//! Every SQL statement of the store, built once per backend when the `Store` is
//! created: templates use `?` placeholders plus a few markers for the spots where
//! dialects differ, and are rewritten to `$1..$n` for PostgreSQL here, not per call.

use super::{Backend, Kind};

/// Expands the dialect markers of a template and converts placeholders.
///
/// Markers: `{json}` a JSON parameter (`CAST(? AS JSON)` on PostgreSQL: JSON,
/// not JSONB, keeps the text as written),
/// `{def}`/`{details}` a JSON column read back as text, `{for_update}` a row lock
/// (nothing on SQLite, whose writers hold the database lock), `{tag}` the
/// "tags array contains ?" test (two parameters: the tag, twice).
pub(super) fn build(backend: Backend, template: &str) -> String {
    let pg = backend == Backend::Postgres;
    let tag = match backend {
        Backend::Sqlite => {
            "(? IS NULL OR EXISTS (SELECT 1 FROM json_each(tags) AS t WHERE t.value = ?))"
        }
        Backend::Postgres => {
            "(? IS NULL OR CAST(tags AS JSONB) @> jsonb_build_array(CAST(? AS TEXT)))"
        }
        Backend::MySql => "(? IS NULL OR JSON_CONTAINS(tags, JSON_QUOTE(?)))",
    };
    let s = template
        .replace("{json}", if pg { "CAST(? AS JSON)" } else { "?" })
        .replace(
            "{def}",
            if pg {
                "CAST(definition AS TEXT)"
            } else {
                "definition"
            },
        )
        .replace(
            "{details}",
            if pg {
                "CAST(details AS TEXT)"
            } else {
                "details"
            },
        )
        .replace(
            "{for_update}",
            if backend == Backend::Sqlite {
                ""
            } else {
                " FOR UPDATE"
            },
        )
        .replace("{tag}", tag);
    if pg { to_dollar(&s) } else { s }
}

/// `?` → `$1, $2, ...`, skipping quoted literals (the templates use `'$.tags'`).
fn to_dollar(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut n = 0;
    let mut in_quote = false;
    for c in sql.chars() {
        match c {
            '\'' => {
                in_quote = !in_quote;
                out.push(c);
            }
            '?' if !in_quote => {
                n += 1;
                out.push('$');
                out.push_str(&n.to_string());
            }
            _ => out.push(c),
        }
    }
    out
}

/// Columns of a `Record` in the order `lifecycle::record_from_row` reads them.
const REC: &str =
    "id, version, status, rollout_percentage, {def} AS definition, created_at, updated_at";

/// Statements of one versioned resource table (`workflows` or `channels`).
pub(crate) struct KindSql {
    pub insert: String,
    pub copy_version: String,
    pub lock: Option<String>,
    pub state: String,
    pub exists: String,
    pub get_latest: String,
    pub get_version: String,
    pub versions: String,
    pub list_page: String,
    pub list_count: String,
    pub update_definition: String,
    pub set_state: String,
    pub delete: String,
    pub active: String,
    /// The active rows without their definitions (`lifecycle::meta_from_row`).
    pub active_meta: String,
    /// One version with its digest, whatever its status (a reload's fetch of
    /// one changed row).
    pub stored_one: String,
    /// Rows written before the digest column existed (filled in by `migrate`).
    pub digest_missing: String,
    pub digest_set: String,
    /// Channel rows whose `channel_type` or `protocol` column is NULL
    /// (written before they held the effective values; filled by `migrate`).
    pub effective_missing: String,
    pub effective_set: String,
    pub name_taken: String,
}

impl KindSql {
    fn new(b: Backend, kind: Kind) -> KindSql {
        let t = match kind {
            Kind::Workflow => "workflows",
            Kind::Channel => "channels",
        };
        let f = |s: &str| build(b, &s.replace("{t}", t).replace("{rec}", REC));
        // One row per id: its newest version among the versions that pass the filters.
        let filtered = "WITH m AS (SELECT id, version, status, rollout_percentage, definition, created_at, updated_at, \
             ROW_NUMBER() OVER (PARTITION BY id ORDER BY version DESC) AS rn FROM {t} \
             WHERE (? IS NULL OR status = ?) AND {tag} AND (? IS NULL OR channel_type = ?) AND (? IS NULL OR protocol = ?)) ";
        KindSql {
            insert: f(
                "INSERT INTO {t} (id, version, status, rollout_percentage, name, channel_type, protocol, definition, digest, tags, created_at, updated_at) \
                       VALUES (?, ?, ?, ?, ?, ?, ?, {json}, ?, ?, ?, ?)",
            ),
            // The new draft copies the stored definition row-to-row: no JSON round trip.
            copy_version: f(
                "INSERT INTO {t} (id, version, status, rollout_percentage, name, channel_type, protocol, definition, digest, tags, created_at, updated_at) \
                             SELECT id, ?, 'draft', 100, name, channel_type, protocol, definition, digest, tags, ?, ? FROM {t} WHERE id = ? AND version = ?",
            ),
            lock: (b != Backend::Sqlite)
                .then(|| f("SELECT version FROM {t} WHERE id = ? ORDER BY version{for_update}")),
            state: f(
                "SELECT version, status, rollout_percentage, created_at, updated_at FROM {t} WHERE id = ? ORDER BY version{for_update}",
            ),
            exists: f("SELECT COUNT(*) FROM {t} WHERE id = ?"),
            get_latest: f("SELECT {rec} FROM {t} WHERE id = ? ORDER BY version DESC LIMIT 1"),
            get_version: f("SELECT {rec} FROM {t} WHERE id = ? AND version = ?"),
            versions: f("SELECT {rec} FROM {t} WHERE id = ? ORDER BY version"),
            list_page: f(&format!(
                "{filtered}SELECT {REC} FROM m WHERE rn = 1 ORDER BY created_at DESC, id DESC LIMIT ? OFFSET ?"
            )),
            list_count: f(&format!("{filtered}SELECT COUNT(*) FROM m WHERE rn = 1")),
            update_definition: f(
                "UPDATE {t} SET definition = {json}, digest = ?, tags = ?, name = ?, channel_type = ?, protocol = ?, updated_at = ? \
                                  WHERE id = ? AND version = ? AND status = 'draft'",
            ),
            set_state: f(
                "UPDATE {t} SET status = ?, rollout_percentage = ?, updated_at = ? WHERE id = ? AND version = ? AND status = ?",
            ),
            delete: f("DELETE FROM {t} WHERE id = ?"),
            active: f("SELECT {rec}, digest FROM {t} WHERE status = 'active' ORDER BY id, version"),
            active_meta: f(
                "SELECT id, version, status, rollout_percentage, created_at, updated_at, digest FROM {t} \
                 WHERE status = 'active' ORDER BY id, version",
            ),
            stored_one: f("SELECT {rec}, digest FROM {t} WHERE id = ? AND version = ?"),
            digest_missing: f(
                "SELECT id, version, {def} AS definition FROM {t} WHERE digest IS NULL",
            ),
            digest_set: f(
                "UPDATE {t} SET digest = ? WHERE id = ? AND version = ? AND digest IS NULL",
            ),
            effective_missing: f("SELECT id, version, {def} AS definition FROM {t} \
                 WHERE channel_type IS NULL OR protocol IS NULL"),
            effective_set: f(
                "UPDATE {t} SET channel_type = ?, protocol = ? WHERE id = ? AND version = ?",
            ),
            name_taken: f("SELECT id FROM {t} WHERE name = ? AND id <> ? LIMIT 1"),
        }
    }
}

/// All statements for one backend.
pub(crate) struct Sql {
    pub workflow: KindSql,
    pub channel: KindSql,
    /// Locks the `channel_names` row (PostgreSQL/MariaDB); `None` on SQLite.
    pub lock_channel_names: Option<String>,
    pub connector_insert: String,
    pub connector_get: String,
    /// `connector_get` locking the row (PostgreSQL/MariaDB; SQLite's write
    /// transactions lock the database).
    pub connector_get_locked: String,
    pub connector_page: String,
    pub connector_count: String,
    pub connector_all: String,
    pub connector_update: String,
    pub connector_delete: String,
    pub audit_insert: String,
    pub audit_page: String,
    pub audit_count: String,
    pub backup: String,
    pub traces: super::traces::TraceSql,
}

impl Sql {
    pub(crate) fn new(b: Backend) -> Sql {
        let f = |s: &str| build(b, s);
        let conn = "name, connector_type, {def} AS definition, created_at, updated_at";
        let audit_filter = "WHERE (? IS NULL OR action = ?) AND (? IS NULL OR resource_type = ?) \
                            AND (? IS NULL OR resource_id = ?)";
        Sql {
            workflow: KindSql::new(b, Kind::Workflow),
            channel: KindSql::new(b, Kind::Channel),
            lock_channel_names: (b != Backend::Sqlite).then(|| {
                f("SELECT name FROM storage_locks WHERE name = 'channel_names'{for_update}")
            }),
            connector_insert: f(
                "INSERT INTO connectors (name, connector_type, definition, created_at, updated_at) VALUES (?, ?, {json}, ?, ?)",
            ),
            connector_get: f(&format!("SELECT {conn} FROM connectors WHERE name = ?")),
            connector_get_locked: f(&format!(
                "SELECT {conn} FROM connectors WHERE name = ?{{for_update}}"
            )),
            connector_page: f(&format!(
                "SELECT {conn} FROM connectors ORDER BY created_at DESC, name DESC LIMIT ? OFFSET ?"
            )),
            connector_count: f("SELECT COUNT(*) FROM connectors"),
            connector_all: f(&format!("SELECT {conn} FROM connectors ORDER BY name")),
            connector_update: f(
                "UPDATE connectors SET connector_type = ?, definition = {json}, updated_at = ? WHERE name = ?",
            ),
            connector_delete: f("DELETE FROM connectors WHERE name = ?"),
            audit_insert: f(
                "INSERT INTO audit_log (principal, action, resource_type, resource_id, version, details, created_at) \
                             VALUES (?, ?, ?, ?, ?, {json}, ?)",
            ),
            audit_page: f(&format!(
                "SELECT id, principal, action, resource_type, resource_id, version, {{details}} AS details, created_at \
                 FROM audit_log {audit_filter} ORDER BY id DESC LIMIT ? OFFSET ?"
            )),
            audit_count: f(&format!("SELECT COUNT(*) FROM audit_log {audit_filter}")),
            backup: f("VACUUM INTO ?"),
            traces: super::traces::TraceSql::new(b),
        }
    }

    pub(crate) fn kind(&self, kind: Kind) -> &KindSql {
        match kind {
            Kind::Workflow => &self.workflow,
            Kind::Channel => &self.channel,
        }
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn placeholders_become_numbered_outside_quotes() {
        assert_eq!(
            to_dollar("a = ? AND b = '?' AND c = ?"),
            "a = $1 AND b = '?' AND c = $2"
        );
        let s = build(Backend::Postgres, "SELECT 1 WHERE {tag} AND x = ?");
        assert!(
            s.contains("$1 IS NULL") && s.contains("CAST($2 AS TEXT)") && s.ends_with("x = $3"),
            "{s}"
        );
        assert!(!build(Backend::MySql, "x = ?").contains('$'));
    }
}
