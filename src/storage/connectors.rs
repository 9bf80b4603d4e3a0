//! Connectors: named connections to external systems, stored as written
//! (`env://` references and secrets kept verbatim; masking is the caller's job).
//! Not versioned: a connector is returned as a `Record` with version 1, active.

use serde_json::{Value as Json, json};
use sqlx::{ColumnIndex, Decode, Row, Type};

use super::lifecycle::insert_audit;
use super::{
    Audit, BeginWrite, Record, Status, StorageError, Store, dispatch, dispatch_write, execute,
    fetch_all, fetch_one, fetch_optional, now_micros, parse_json, retry, rfc3339, unique_as,
};

fn not_found(name: &str) -> StorageError {
    StorageError::NotFound(format!("Connector with id '{name}' not found"))
}

/// Reads `name, connector_type, definition, created_at, updated_at`.
fn connector_from_row<R: Row>(row: &R) -> Result<Record, StorageError>
where
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
{
    // Text columns are read unchecked: MariaDB reports utf8mb4_bin columns
    // with the BINARY flag, which sqlx's checked String decode rejects.
    let text: String = row.try_get_unchecked(2).map_err(super::db_err)?;
    Ok(Record {
        id: row.try_get_unchecked(0).map_err(super::db_err)?,
        version: 1,
        status: Status::Active,
        rollout_percentage: 100,
        definition: parse_json(&text)?,
        created_at: rfc3339(row.try_get(3).map_err(super::db_err)?),
        updated_at: rfc3339(row.try_get(4).map_err(super::db_err)?),
    })
}

/// The name and type of a connector definition; the type is `connector_type`,
/// else `config.type`.
fn name_and_type(def: &Json) -> Result<(String, String), StorageError> {
    if !def.is_object() {
        return Err(StorageError::BadRequest(
            "a connector definition must be a JSON object".into(),
        ));
    }
    let name = def.get("name").and_then(Json::as_str).unwrap_or_default();
    if name.is_empty() {
        return Err(StorageError::BadRequest(
            "a connector needs a non-empty name".into(),
        ));
    }
    let ty = def
        .get("connector_type")
        .and_then(Json::as_str)
        .or_else(|| def.pointer("/config/type").and_then(Json::as_str))
        .unwrap_or_default();
    Ok((name.to_owned(), ty.to_owned()))
}

impl Store {
    /// Stores a new connector; Conflict if the name exists.
    pub async fn create_connector(&self, def: &Json, audit: Audit) -> Result<Record, StorageError> {
        let (name, ty) = name_and_type(def)?;
        let text = def.to_string();
        let s = self.sql();
        let r: Result<i64, StorageError> = retry(|| async {
            let now = now_micros();
            let mut audit = audit.clone().complete("connector", &name, None, json!({"connector_type": ty}));
            if audit.action.is_empty() {
                audit.action = "create".into();
            }
            dispatch_write!(self, pool => {
                let mut tx = pool.begin_write().await?;
                if fetch_optional!(&mut *tx, &s.connector_get, &name)?.is_some() {
                    return Err(StorageError::Conflict(format!("connector '{name}' already exists")));
                }
                execute!(&mut *tx, &s.connector_insert, &name, &ty, &text, now, now)
                    .map_err(unique_as(|| format!("connector '{name}' already exists")))?;
                insert_audit!(tx, s, audit, now)?;
                tx.commit().await.map_err(super::db_err)?;
            });
            Ok(now)
        })
        .await;
        let now = r?;
        Ok(Record {
            id: name,
            version: 1,
            status: Status::Active,
            rollout_percentage: 100,
            definition: def.clone(),
            created_at: rfc3339(now),
            updated_at: rfc3339(now),
        })
    }

    /// A page of connectors, newest first (created_at, then name), and the total.
    pub async fn list_connectors(
        &self,
        limit: i64,
        offset: i64,
    ) -> Result<(Vec<Record>, i64), StorageError> {
        let s = self.sql();
        dispatch!(self, pool => {
            let total: i64 = fetch_one!(pool, &s.connector_count)?.try_get(0).map_err(super::db_err)?;
            let rows = fetch_all!(pool, &s.connector_page, limit, offset)?;
            Ok((rows.iter().map(connector_from_row).collect::<Result<Vec<_>, _>>()?, total))
        })
    }

    pub async fn get_connector(&self, name: &str) -> Result<Record, StorageError> {
        let s = self.sql();
        dispatch!(self, pool => {
            match fetch_optional!(pool, &s.connector_get, name)? {
                Some(row) => connector_from_row(&row),
                None => Err(not_found(name)),
            }
        })
    }

    /// Replaces a connector's definition. The name is the identity: a body naming
    /// another connector is a 400 (a body without `name` gets the path's name).
    /// `expected`: the stored definition the new one was made from (its
    /// masked secrets put back from it); when the row holds another by
    /// now, the update is a conflict rather than putting back secrets a
    /// concurrent update replaced (audit 124: a rotated password reverted).
    pub async fn update_connector(
        &self,
        name: &str,
        def: &Json,
        audit: Audit,
        expected: Option<&Json>,
    ) -> Result<Record, StorageError> {
        let mut def = def.clone();
        if let Json::Object(m) = &mut def {
            m.entry("name").or_insert_with(|| Json::String(name.into()));
        }
        let (body_name, ty) = name_and_type(&def)?;
        if body_name != name {
            return Err(StorageError::BadRequest(format!(
                "connector name cannot be changed (path '{name}', body '{body_name}')"
            )));
        }
        let text = def.to_string();
        let s = self.sql();
        retry(|| async {
            let now = now_micros();
            let mut audit =
                audit
                    .clone()
                    .complete("connector", name, None, json!({"connector_type": ty}));
            if audit.action.is_empty() {
                audit.action = "update".into();
            }
            dispatch_write!(self, pool => {
                let mut tx = pool.begin_write().await?;
                if let Some(expected) = expected {
                    let Some(row) = fetch_optional!(&mut *tx, &s.connector_get_locked, name)? else {
                        return Err(not_found(name));
                    };
                    if connector_from_row(&row)?.definition != *expected {
                        return Err(StorageError::Conflict(format!(
                            "connector '{name}' was changed by another request while this \
                             update was made; read it again and send the update anew"
                        )));
                    }
                }
                if execute!(&mut *tx, &s.connector_update, &ty, &text, now, name)? == 0 {
                    return Err(not_found(name));
                }
                let record = connector_from_row(&fetch_one!(&mut *tx, &s.connector_get, name)?)?;
                insert_audit!(tx, s, audit, now)?;
                tx.commit().await.map_err(super::db_err)?;
                Ok(record)
            })
        })
        .await
    }

    pub async fn delete_connector(&self, name: &str, audit: Audit) -> Result<(), StorageError> {
        let s = self.sql();
        retry(|| async {
            let now = now_micros();
            let mut audit = audit.clone().complete("connector", name, None, json!({}));
            if audit.action.is_empty() {
                audit.action = "delete".into();
            }
            dispatch_write!(self, pool => {
                let mut tx = pool.begin_write().await?;
                if execute!(&mut *tx, &s.connector_delete, name)? == 0 {
                    return Err(not_found(name));
                }
                insert_audit!(tx, s, audit, now)?;
                tx.commit().await.map_err(super::db_err)?;
                Ok(())
            })
        })
        .await
    }

    /// Every connector, by name, for building the runtime's connector set.
    pub async fn all_connectors(&self) -> Result<Vec<Record>, StorageError> {
        let s = self.sql();
        dispatch!(self, pool => {
            fetch_all!(pool, &s.connector_all)?.iter().map(connector_from_row).collect()
        })
    }
}
