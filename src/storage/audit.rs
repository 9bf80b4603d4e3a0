//! The audit log: standalone entries (reload, breaker reset, backup, import
//! bookkeeping) and the paged listing. Entries recording a change are written by
//! the change itself, inside its transaction (`lifecycle::insert_audit!`).

use serde_json::{Map, Value as Json};
use sqlx::Row;

use super::lifecycle::insert_audit;
use super::{
    Audit, BeginWrite, StorageError, Store, dispatch, dispatch_write, execute, fetch_all,
    fetch_one, now_micros, parse_json, retry, rfc3339,
};

impl Store {
    /// Writes one entry on its own (for events that change no stored row).
    pub async fn audit(&self, audit: Audit) -> Result<(), StorageError> {
        let s = self.sql();
        let mut audit = audit;
        if audit.details.is_null() {
            audit.details = Json::Object(Map::new());
        }
        retry(|| async {
            let now = now_micros();
            dispatch_write!(self, pool => {
                let mut tx = pool.begin_write().await?;
                insert_audit!(tx, s, audit, now)?;
                tx.commit().await.map_err(super::db_err)?;
                Ok(())
            })
        })
        .await
    }

    /// A page of entries, newest first, optionally filtered, and the total:
    /// `{id, principal, action, resource_type, resource_id, version?, details, created_at}`.
    pub async fn list_audit(
        &self,
        action: Option<&str>,
        resource_type: Option<&str>,
        resource_id: Option<&str>,
        limit: i64,
        offset: i64,
    ) -> Result<(Vec<Json>, i64), StorageError> {
        let s = self.sql();
        dispatch!(self, pool => {
            let total: i64 = fetch_one!(pool, &s.audit_count, action, action, resource_type, resource_type, resource_id, resource_id)?
                .try_get(0).map_err(super::db_err)?;
            let rows = fetch_all!(pool, &s.audit_page, action, action, resource_type, resource_type, resource_id, resource_id, limit, offset)?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                // Unchecked: MariaDB flags utf8mb4_bin text as BINARY (see lifecycle.rs).
                let get_s = |i: usize| row.try_get_unchecked::<String, usize>(i).map_err(super::db_err);
                let mut m = Map::new();
                m.insert("id".into(), row.try_get::<i64, usize>(0).map_err(super::db_err)?.into());
                m.insert("principal".into(), get_s(1)?.into());
                m.insert("action".into(), get_s(2)?.into());
                m.insert("resource_type".into(), get_s(3)?.into());
                m.insert("resource_id".into(), get_s(4)?.into());
                if let Some(v) = row.try_get::<Option<i64>, usize>(5).map_err(super::db_err)? {
                    m.insert("version".into(), v.into());
                }
                m.insert("details".into(), parse_json(&get_s(6)?)?);
                m.insert("created_at".into(), rfc3339(row.try_get::<i64, usize>(7).map_err(super::db_err)?).into());
                out.push(Json::Object(m));
            }
            Ok((out, total))
        })
    }
}
