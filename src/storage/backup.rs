//! Backups of SQLite storage: `VACUUM INTO` a timestamped file in the backup
//! directory, and the listing of that directory. The server backends answer
//! BadRequest: their own dump tools do this better than the service could.

use serde_json::{Value as Json, json};
use std::path::Path;
use std::time::Duration;

use super::{Backend, StorageError, Store, dispatch, execute};

const PREFIX: &str = "sluice_backup_";
const SUFFIX: &str = ".db";

/// `20261122T101500Z` → `2026-11-22T10:15:00Z`, or `None` if the stamp is malformed.
fn stamp_to_rfc3339(stamp: &str) -> Option<String> {
    let b = stamp.as_bytes();
    let digits =
        |r: std::ops::Range<usize>| b.get(r).is_some_and(|s| s.iter().all(u8::is_ascii_digit));
    if b.len() != 16 || !digits(0..8) || b[8] != b'T' || !digits(9..15) || b[15] != b'Z' {
        return None;
    }
    // A real date and time (a file copied in by hand as `…20991301…` was
    // listed with `created_at: 2099-13-01…` and sorted as the newest).
    let n = |r: std::ops::Range<usize>| stamp[r].parse::<u16>().ok();
    let month = time::Month::try_from(u8::try_from(n(4..6)?).ok()?).ok()?;
    time::Date::from_calendar_date(i32::from(n(0..4)?), month, u8::try_from(n(6..8)?).ok()?)
        .ok()?;
    time::Time::from_hms(
        u8::try_from(n(9..11)?).ok()?,
        u8::try_from(n(11..13)?).ok()?,
        u8::try_from(n(13..15)?).ok()?,
    )
    .ok()?;
    Some(format!(
        "{}-{}-{}T{}:{}:{}Z",
        &stamp[0..4],
        &stamp[4..6],
        &stamp[6..8],
        &stamp[9..11],
        &stamp[11..13],
        &stamp[13..15]
    ))
}

fn io_err(what: &str, e: std::io::Error) -> StorageError {
    StorageError::Backup(format!("{what}: {e}"))
}

impl Store {
    /// Writes `sluice_backup_YYYYMMDDTHHMMSSZ.db` into `dir` (created if missing)
    /// and returns `{filename, size_bytes, created_at}`. If a backup with this
    /// second's name exists, waits for the next second instead of overwriting.
    pub async fn backup(&self, dir: &Path) -> Result<Json, StorageError> {
        if self.backend() != Backend::Sqlite {
            return Err(StorageError::BadRequest(super::BACKUPS_NEED_SQLITE.into()));
        }
        if self.inner.url.is_none() {
            // `VACUUM INTO` ran on a connection of its own, another (empty)
            // in-memory database: the answer was 201 and the file empty.
            return Err(StorageError::BadRequest(
                "backups need a database file; this service keeps its storage in memory (sqlite::memory:)"
                    .into(),
            ));
        }
        // Directories created here are the owner's only, like the files
        // (before, they followed the umask: others could replace a backup).
        let mut mkdir = std::fs::DirBuilder::new();
        mkdir.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut mkdir, 0o700);
        mkdir.create(dir).map_err(|e| {
            io_err(
                &format!("cannot create the backup directory {}", dir.display()),
                e,
            )
        })?;
        // One backup at a time per store, so two callers cannot pick the same name.
        let _guard = self.inner.backup_lock.lock().await;
        let mut waited = 0;
        let (filename, path, created_at) = loop {
            let now = time::OffsetDateTime::now_utc();
            let stamp = now
                .format(time::macros::format_description!(
                    "[year][month][day]T[hour][minute][second]Z"
                ))
                .map_err(|e| {
                    StorageError::Database(format!("cannot format the backup time: {e}"))
                })?;
            let filename = format!("{PREFIX}{stamp}{SUFFIX}");
            let path = dir.join(&filename);
            if !path.exists() {
                break (filename, path, stamp_to_rfc3339(&stamp).unwrap_or_default());
            }
            // Files named for the coming seconds (copied in, or left by a
            // clock set back): give up after a few rather than wait on.
            waited += 1;
            if waited > 5 {
                return Err(StorageError::Conflict(format!(
                    "backup files named for this and the next 5 seconds already exist in the backup directory (last tried: {filename})"
                )));
            }
            // Sleep to just past the next whole second.
            let nanos = u64::from(now.nanosecond());
            tokio::time::sleep(Duration::from_nanos(1_000_000_000 - nanos + 1_000_000)).await;
        };
        let target = path
            .to_str()
            .ok_or_else(|| {
                StorageError::BadRequest("the backup directory path is not valid UTF-8".into())
            })?
            .to_owned();
        // The file holds every connector's secrets: readable by the owner
        // only. It is created empty with that mode first (`VACUUM INTO`
        // writes into an empty file), so it is never readable by others,
        // whatever the umask (before, it was created world-readable).
        {
            let mut open = std::fs::OpenOptions::new();
            open.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
            open.open(&path)
                .map_err(|e| io_err("cannot create the backup file", e))?;
        }
        let s = self.sql();
        dispatch!(self, pool => {
            execute!(pool, &s.backup, &target)?;
        });
        let size = std::fs::metadata(&path)
            .map_err(|e| io_err("cannot read the backup file", e))?
            .len();
        Ok(json!({"filename": filename, "size_bytes": size, "created_at": created_at}))
    }

    /// The backups in `dir`, newest first; an absent directory has none.
    pub fn list_backups(dir: &Path) -> Result<Vec<Json>, StorageError> {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(io_err(
                    &format!("cannot read the backup directory {}", dir.display()),
                    e,
                ));
            }
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| {
                io_err(
                    &format!("cannot read the backup directory {}", dir.display()),
                    e,
                )
            })?;
            let Ok(filename) = entry.file_name().into_string() else {
                continue;
            };
            let Some(stamp) = filename
                .strip_prefix(PREFIX)
                .and_then(|r| r.strip_suffix(SUFFIX))
            else {
                continue;
            };
            let Some(created_at) = stamp_to_rfc3339(stamp) else {
                continue;
            };
            let meta = entry
                .metadata()
                .map_err(|e| io_err("cannot read a backup file", e))?;
            if !meta.is_file() {
                continue;
            }
            out.push((filename, meta.len(), created_at));
        }
        // The stamp sorts chronologically, so name order is time order.
        out.sort_by(|a, b| b.0.cmp(&a.0));
        Ok(out
            .into_iter()
            .map(|(filename, size, created_at)| json!({"filename": filename, "size_bytes": size, "created_at": created_at}))
            .collect())
    }
}

#[cfg(test)]
mod unit {
    #[test]
    fn stamps() {
        assert_eq!(
            super::stamp_to_rfc3339("20261122T101500Z").as_deref(),
            Some("2026-11-22T10:15:00Z")
        );
        assert_eq!(super::stamp_to_rfc3339("2026112T101500Z"), None);
        assert_eq!(super::stamp_to_rfc3339("20261122X101500Z"), None);
        // Not a date or time (audit 98).
        for stamp in [
            "20991301T000000Z",
            "20260230T000000Z",
            "20261122T246000Z",
            "20261122T105960Z",
        ] {
            assert_eq!(super::stamp_to_rfc3339(stamp), None, "{stamp}");
        }
        assert_eq!(
            super::stamp_to_rfc3339("20240229T235959Z").as_deref(),
            Some("2024-02-29T23:59:59Z")
        );
    }
}
