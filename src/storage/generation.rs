//! The fleet's engine generation (one row, `engine_generation`): bumped by
//! every admin change that reloads the engine, read by every replica to tell
//! whether it serves the latest definitions. On PostgreSQL the bump also
//! sends `NOTIFY sluice_engine` in the same transaction (delivered on
//! commit), so other replicas reload at once; MySQL/MariaDB replicas poll the
//! row (`engine.sync_interval_ms`).

use super::{
    BeginWrite, Pools, StorageError, Store, dispatch, dispatch_write, execute, fetch_one, retry,
};
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
            dispatch_write!(self, pool => {
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

    /// [`Self::bump_engine_generation`] after a committed change; when
    /// storage refuses even after its retries, again in the background
    /// (1 s, doubling to 30 s) until the generation moves. The other
    /// replicas learn of the change only from the generation: before, a
    /// failed bump left them serving the previous definitions for good,
    /// all reporting the same generation. Returns the first failure (the
    /// caller logs nothing more).
    pub async fn bump_engine_generation_or_later(&self) -> Option<StorageError> {
        let e = self.bump_engine_generation().await.err()?;
        tracing::warn!(
            error = %e,
            "could not move the engine generation on; trying again in the background \
             (other replicas serve the previous definitions until it moves)"
        );
        let store = self.clone();
        tokio::spawn(async move {
            let mut wait = std::time::Duration::from_secs(1);
            loop {
                tokio::time::sleep(wait).await;
                match store.bump_engine_generation().await {
                    Ok(generation) => {
                        tracing::info!(
                            generation,
                            "engine generation moved on; other replicas catch up"
                        );
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "still cannot move the engine generation on");
                        wait = (wait * 2).min(std::time::Duration::from_secs(30));
                    }
                }
            }
        });
        Some(e)
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
