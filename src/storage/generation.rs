//! The fleet's engine generation (one row, `engine_generation`): bumped by
//! every admin change that reloads the engine, read by every replica to tell
//! whether it serves the latest definitions. On PostgreSQL the bump also
//! sends `NOTIFY sluice_engine` in the same transaction (delivered on
//! commit), so other replicas reload at once; MySQL/MariaDB replicas poll the
//! row (`engine.sync_interval_ms`).

use super::{BeginWrite, Pools, StorageError, Store, dispatch, execute, fetch_one, retry};
use sqlx::Row;

/// The PostgreSQL channel replicas LISTEN on.
pub const NOTIFY_CHANNEL: &str = "sluice_engine";

impl Store {
    /// The generation the definitions in storage are at.
    pub async fn engine_generation(&self) -> Result<i64, StorageError> {
        dispatch!(self, pool => {
            let row = fetch_one!(pool, "SELECT generation FROM engine_generation WHERE id = 1")?;
            row.try_get::<i64, _>(0).map_err(super::db_err)
        })
    }

    /// Moves the stored generation on by one and returns it; on PostgreSQL
    /// other replicas are notified when the transaction commits.
    pub async fn bump_engine_generation(&self) -> Result<i64, StorageError> {
        retry(|| async {
            dispatch!(self, pool => {
                let mut tx = pool.begin_write().await?;
                execute!(&mut *tx, "UPDATE engine_generation SET generation = generation + 1 WHERE id = 1")?;
                let row = fetch_one!(&mut *tx, "SELECT generation FROM engine_generation WHERE id = 1")?;
                let generation: i64 = row.try_get(0).map_err(super::db_err)?;
                if matches!(self.inner.pools, Pools::Postgres(_)) {
                    execute!(&mut *tx, &format!("NOTIFY {NOTIFY_CHANNEL}, '{generation}'"))?;
                }
                tx.commit().await.map_err(super::db_err)?;
                Ok(generation)
            })
        })
        .await
    }

    /// A listener on [`NOTIFY_CHANNEL`] (PostgreSQL only; `None` elsewhere).
    pub async fn engine_listener(
        &self,
    ) -> Result<Option<sqlx::postgres::PgListener>, StorageError> {
        match &self.inner.pools {
            Pools::Postgres(pool) => {
                let mut l = sqlx::postgres::PgListener::connect_with(pool)
                    .await
                    .map_err(super::db_err)?;
                l.listen(NOTIFY_CHANNEL).await.map_err(super::db_err)?;
                Ok(Some(l))
            }
            _ => Ok(None),
        }
    }
}
