//! The `cache` connector client: text values by key with an optional TTL,
//! either in process (`memory`, a bounded moka cache) or in Redis (a
//! reconnecting connection manager; `SET key value EX ttl` / `GET key`).
//! The text is stored as given: the runtime hands it a string as it is and
//! any other value as its JSON text, and parses what it reads back
//! (`sluice_runtime::connectors`), so both backends behave the same way.
//!
//! The memory backend keeps at most `max_entries` entries (default
//! [`DEFAULT_MAX_ENTRIES`]); past that, the least recently used entry is
//! evicted (moka's LRU policy: its default, TinyLFU, may refuse a new key
//! instead, so a write that succeeded read back as a miss). Each entry
//! carries its own TTL. The
//! memory cache belongs to one connector instance: it is not shared across
//! processes and starts empty on restart.
//!
//! The Redis connection is opened on first use, not by `connect`, so a Redis
//! that is down when the connector is loaded fails the calls (retryably), not
//! the load. The manager reconnects by itself after a dropped connection.

use moka::Expiry;
use redis::AsyncCommands as _;
use sluice_compiler::def::{CacheBackend, CacheConnector};
use sluice_runtime::connectors::{ConnectorError, ConnectorErrorKind};
use std::time::{Duration, Instant};

/// Entries the memory backend keeps when `max_entries` is not given.
pub const DEFAULT_MAX_ENTRIES: u64 = 10_000;
/// Limits of one Redis connect and one Redis command: a cache call should
/// fail fast (and be retried by the policy) rather than hold a request.
const REDIS_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const REDIS_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A memory entry: the value and how long it lives from insertion.
#[derive(Clone)]
struct Entry {
    value: String,
    ttl: Option<Duration>,
}

/// Per-entry TTL: each entry expires after its own `ttl` (none: never);
/// a read does not extend it, an overwrite starts it again.
struct PerEntryTtl;

impl Expiry<String, Entry> for PerEntryTtl {
    fn expire_after_create(&self, _key: &String, value: &Entry, _at: Instant) -> Option<Duration> {
        value.ttl
    }

    fn expire_after_update(
        &self,
        _key: &String,
        value: &Entry,
        _at: Instant,
        _remaining: Option<Duration>,
    ) -> Option<Duration> {
        value.ttl
    }
}

enum Backend {
    Memory(moka::sync::Cache<String, Entry>),
    Redis(redis::aio::ConnectionManager),
}

/// One cache connector's store; share it behind an `Arc`.
pub struct CacheStore {
    backend: Backend,
}

impl std::fmt::Debug for CacheStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the Redis URL: it may hold a password.
        let backend = match &self.backend {
            Backend::Memory(c) => format!("memory ({} entries)", c.entry_count()),
            Backend::Redis(_) => "redis".to_owned(),
        };
        f.debug_struct("CacheStore")
            .field("backend", &backend)
            .finish()
    }
}

impl CacheStore {
    pub async fn connect(cfg: &CacheConnector) -> Result<CacheStore, ConnectorError> {
        let backend = match cfg.backend {
            CacheBackend::Memory => {
                let max = cfg.max_entries.unwrap_or(DEFAULT_MAX_ENTRIES).max(1);
                Backend::Memory(
                    moka::sync::Cache::builder()
                        .max_capacity(max)
                        .eviction_policy(moka::policy::EvictionPolicy::lru())
                        .expire_after(PerEntryTtl)
                        .build(),
                )
            }
            CacheBackend::Redis => {
                let url = cfg.url.as_deref().map(str::trim).unwrap_or_default();
                if url.is_empty() {
                    return Err(ConnectorError::other("a redis cache needs a url"));
                }
                // redis's parse errors do not echo the URL.
                let client = redis::Client::open(url)
                    .map_err(|e| ConnectorError::other(format!("invalid redis url: {e}")))?;
                // One reconnect attempt inside the manager: retries with
                // back-off are the connector policy's job, and two layers of
                // them would multiply the wait.
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(REDIS_CONNECT_TIMEOUT))
                    .set_response_timeout(Some(REDIS_RESPONSE_TIMEOUT))
                    .set_number_of_retries(1);
                let manager = redis::aio::ConnectionManager::new_lazy_with_config(client, config)
                    .map_err(redis_err)?;
                Backend::Redis(manager)
            }
        };
        Ok(CacheStore { backend })
    }

    /// The value under `key`; `None` when it is missing or expired.
    pub async fn get(&self, key: &str) -> Result<Option<String>, ConnectorError> {
        match &self.backend {
            Backend::Memory(c) => Ok(c.get(key).map(|e| e.value)),
            Backend::Redis(m) => {
                // The manager is a cheap handle over one multiplexed connection.
                let mut conn = m.clone();
                let bytes: Option<Vec<u8>> = conn.get(key).await.map_err(redis_err)?;
                // A value that is not text (written by another client) is
                // this key's problem, not the server's: not retried, and not
                // counted by the breaker (before, the client's conversion
                // error was taken for a network failure).
                bytes
                    .map(|b| {
                        String::from_utf8(b).map_err(|_| {
                            ConnectorError::new(
                                ConnectorErrorKind::Upstream,
                                format!(
                                    "redis: the value of key '{key}' is not UTF-8 text (cache_read reads text and JSON)"
                                ),
                            )
                        })
                    })
                    .transpose()
            }
        }
    }

    /// Stores `value` under `key`, replacing what was there; with `ttl` it
    /// expires after that long, to the millisecond (`SET PX`; below 1 ms is
    /// taken as 1 ms: Redis rejects a zero, and "expire at once" is not a
    /// useful write).
    pub async fn set(
        &self,
        key: &str,
        value: String,
        ttl: Option<Duration>,
    ) -> Result<(), ConnectorError> {
        let ttl = ttl.map(|t| t.max(Duration::from_millis(1)));
        match &self.backend {
            Backend::Memory(c) => {
                c.insert(key.to_owned(), Entry { value, ttl });
                // Evict now, not at moka's next maintenance pass: past
                // `max_entries` the least recently used entry is gone as
                // soon as the write returns (audit 67: three entries of a
                // two-entry cache read back until the next write).
                c.run_pending_tasks();
                Ok(())
            }
            Backend::Redis(m) => {
                let mut conn = m.clone();
                match ttl {
                    Some(t) => {
                        let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX);
                        conn.pset_ex::<_, _, ()>(key, value, ms).await
                    }
                    None => conn.set::<_, _, ()>(key, value).await,
                }
                .map_err(redis_err)
            }
        }
    }
}

/// Network failures, timeouts, dropped connections and the server's own
/// "try again" answers (LOADING, BUSY, TRYAGAIN ...) are retryable; a command
/// the server rejects, refused credentials (the client would reconnect with
/// the same ones) or a bad configuration are not.
fn redis_err(e: redis::RedisError) -> ConnectorError {
    use redis::RetryMethod;
    let message = format!("redis: {e}");
    if e.is_timeout() {
        return ConnectorError::new(ConnectorErrorKind::Timeout, message);
    }
    let refused_login = e.kind() == redis::ErrorKind::AuthenticationFailed;
    let retryable = !refused_login
        && (e.is_io_error()
            || e.is_connection_refusal()
            || e.is_connection_dropped()
            || matches!(
                e.retry_method(),
                RetryMethod::Reconnect | RetryMethod::RetryImmediately | RetryMethod::WaitAndRetry
            ));
    let kind = match e.kind() {
        redis::ErrorKind::InvalidClientConfig => ConnectorErrorKind::Other,
        _ => ConnectorErrorKind::Upstream,
    };
    ConnectorError::new(kind, message).retryable(retryable)
}

/// Memory tests run in process; Redis tests against the server of
/// `../shared/services/redis.sh` (127.0.0.1:6379, started by
/// `scripts/test.sh`), each under its own key prefix. A Redis that is not
/// reachable fails the test.
#[cfg(test)]
mod tests {
    use super::*;

    const REDIS_URL: &str = "redis://127.0.0.1:6379/";

    fn memory(max_entries: Option<u64>) -> CacheConnector {
        CacheConnector {
            backend: CacheBackend::Memory,
            url: None,
            max_entries,
            retry: Default::default(),
        }
    }

    fn redis_cfg(url: &str) -> CacheConnector {
        CacheConnector {
            backend: CacheBackend::Redis,
            url: Some(url.to_owned()),
            max_entries: None,
            retry: Default::default(),
        }
    }

    fn prefix() -> String {
        format!("sluice_c_{}:", uuid::Uuid::new_v4().simple())
    }

    /// A Redis value that is not UTF-8 fails the read without a retry (so
    /// the breaker does not count it), and the store stays usable.
    #[tokio::test]
    async fn redis_binary_value_is_not_retryable() {
        let store = CacheStore::connect(&redis_cfg(REDIS_URL)).await.unwrap();
        let p = prefix();
        let client = redis::Client::open(REDIS_URL).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::AsyncCommands::set(
            &mut conn,
            format!("{p}bin"),
            vec![0xde_u8, 0xad, 0xbe, 0xef],
        )
        .await
        .unwrap();
        let e = store.get(&format!("{p}bin")).await.unwrap_err();
        assert!(!e.retryable, "{e:?}");
        assert!(e.message.contains("is not UTF-8 text"), "{}", e.message);
        basics(&store, &p).await;
        let _: () = redis::AsyncCommands::del(&mut conn, format!("{p}bin"))
            .await
            .unwrap();
    }

    /// `rediss://` speaks TLS (it was accepted at create, then every call
    /// failed with "the feature is not enabled"): the first bytes a call
    /// sends are a TLS handshake record (0x16, version 3.x), read here by a
    /// listener that then hangs up.
    #[tokio::test]
    async fn rediss_urls_speak_tls() {
        use tokio::io::AsyncReadExt;
        crate::connectors::http::install_crypto_provider();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let first = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut head = [0u8; 3];
            socket.read_exact(&mut head).await.unwrap();
            head
        });
        let store = CacheStore::connect(&redis_cfg(&format!("rediss://127.0.0.1:{port}/")))
            .await
            .unwrap();
        let e = store.get("k").await.unwrap_err();
        assert!(!e.message.contains("not enabled"), "{}", e.message);
        let head = first.await.unwrap();
        assert_eq!((head[0], head[1]), (0x16, 0x03), "{head:?}");
    }

    /// Get/set/overwrite/missing, the same for both backends.
    async fn basics(store: &CacheStore, p: &str) {
        assert_eq!(store.get(&format!("{p}missing")).await.unwrap(), None);
        store.set(&format!("{p}a"), "1".into(), None).await.unwrap();
        assert_eq!(
            store.get(&format!("{p}a")).await.unwrap().as_deref(),
            Some("1")
        );
        store
            .set(
                &format!("{p}a"),
                "{\"x\":2}".into(),
                Some(Duration::from_secs(60)),
            )
            .await
            .unwrap();
        assert_eq!(
            store.get(&format!("{p}a")).await.unwrap().as_deref(),
            Some("{\"x\":2}")
        );
        store
            .set(&format!("{p}empty"), String::new(), None)
            .await
            .unwrap();
        assert_eq!(
            store.get(&format!("{p}empty")).await.unwrap().as_deref(),
            Some("")
        );
    }

    /// An entry with a 1 s TTL is there at once and gone after it, and one
    /// with 300 ms is gone well before a second (TTLs are not whole seconds).
    async fn ttl_expires(store: &CacheStore, p: &str) {
        let k = format!("{p}ttl");
        let short = format!("{p}short");
        let forever = format!("{p}forever");
        store
            .set(&k, "v".into(), Some(Duration::from_secs(1)))
            .await
            .unwrap();
        store
            .set(&short, "v".into(), Some(Duration::from_millis(300)))
            .await
            .unwrap();
        store.set(&forever, "v".into(), None).await.unwrap();
        assert_eq!(store.get(&k).await.unwrap().as_deref(), Some("v"));
        assert_eq!(store.get(&short).await.unwrap().as_deref(), Some("v"));
        tokio::time::sleep(Duration::from_millis(650)).await;
        assert_eq!(store.get(&short).await.unwrap(), None);
        assert_eq!(store.get(&k).await.unwrap().as_deref(), Some("v"));
        tokio::time::sleep(Duration::from_millis(650)).await;
        assert_eq!(store.get(&k).await.unwrap(), None);
        assert_eq!(store.get(&forever).await.unwrap().as_deref(), Some("v"));
    }

    #[tokio::test]
    async fn memory_get_set_and_ttl() {
        let store = CacheStore::connect(&memory(None)).await.unwrap();
        basics(&store, "").await;
        ttl_expires(&store, "").await;
    }

    /// The least recently used entry is evicted by the write that passes
    /// `max_entries`, not later.
    #[tokio::test]
    async fn memory_evicts_with_the_write_that_passes_max_entries() {
        let store = CacheStore::connect(&memory(Some(2))).await.unwrap();
        for key in ["x1", "x2", "x3"] {
            store.set(key, key.into(), None).await.unwrap();
        }
        assert_eq!(store.get("x1").await.unwrap(), None);
        assert_eq!(store.get("x2").await.unwrap().as_deref(), Some("x2"));
        assert_eq!(store.get("x3").await.unwrap().as_deref(), Some("x3"));
    }

    #[tokio::test]
    async fn memory_is_bounded_by_max_entries() {
        let store = CacheStore::connect(&memory(Some(10))).await.unwrap();
        for i in 0..200 {
            store
                .set(&format!("k{i}"), i.to_string(), None)
                .await
                .unwrap();
        }
        let Backend::Memory(c) = &store.backend else {
            unreachable!()
        };
        // moka evicts in its maintenance pass; run it before counting.
        c.run_pending_tasks();
        assert!(c.entry_count() <= 10, "{} entries", c.entry_count());
        let mut present = 0;
        for i in 0..200 {
            if store.get(&format!("k{i}")).await.unwrap().is_some() {
                present += 1;
            }
        }
        assert!((1..=10).contains(&present), "{present} entries readable");
        // The newest writes are the ones kept.
        for i in 195..200 {
            assert_eq!(
                store.get(&format!("k{i}")).await.unwrap(),
                Some(i.to_string()),
                "k{i}"
            );
        }
    }

    #[tokio::test]
    async fn redis_get_set_and_ttl() {
        let store = CacheStore::connect(&redis_cfg(REDIS_URL)).await.unwrap();
        let p = prefix();
        // Fails (does not skip) without a server: run bash ../shared/services/redis.sh.
        basics(&store, &p).await;
        ttl_expires(&store, &p).await;
        // The TTL really is set on the server side.
        let mut c = redis::Client::open(REDIS_URL)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        store
            .set(
                &format!("{p}t"),
                "v".into(),
                Some(Duration::from_millis(99_500)),
            )
            .await
            .unwrap();
        let ttl: i64 = c.pttl(format!("{p}t")).await.unwrap();
        assert!((90_000..=99_500).contains(&ttl), "pttl {ttl}");
        let _: () = redis::cmd("DEL")
            .arg(format!("{p}a"))
            .arg(format!("{p}empty"))
            .arg(format!("{p}forever"))
            .arg(format!("{p}t"))
            .query_async(&mut c)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn redis_refused_is_retryable_and_config_errors_are_not() {
        let store = CacheStore::connect(&redis_cfg("redis://127.0.0.1:1/"))
            .await
            .expect("lazy: no connection yet");
        let started = Instant::now();
        let e = store.get("k").await.unwrap_err();
        assert!(e.retryable, "{e:?}");
        assert_ne!(e.kind, ConnectorErrorKind::Other, "{e:?}");
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "{:?}",
            started.elapsed()
        );
        let e = store.set("k", "v".into(), None).await.unwrap_err();
        assert!(e.retryable, "{e:?}");

        let e = CacheStore::connect(&redis_cfg("http://nope"))
            .await
            .unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Other);
        assert!(!e.retryable);
        let mut no_url = redis_cfg("");
        no_url.url = None;
        assert!(CacheStore::connect(&no_url).await.is_err());
    }

    #[tokio::test]
    async fn redis_refused_login_is_not_retryable() {
        // The test server has no password: any password is refused.
        let store = CacheStore::connect(&redis_cfg("redis://:wrong@127.0.0.1:6379/0"))
            .await
            .expect("lazy: no connection yet");
        let e = store.get("k").await.unwrap_err();
        assert!(!e.retryable, "{e:?}");
        assert!(e.message.contains("redis:"), "{e:?}");
    }

    #[tokio::test]
    async fn redis_wrong_type_is_not_retryable() {
        let store = CacheStore::connect(&redis_cfg(REDIS_URL)).await.unwrap();
        let p = prefix();
        let mut c = redis::Client::open(REDIS_URL)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: () = c.rpush(format!("{p}list"), "x").await.unwrap();
        // GET on a list: the server answers WRONGTYPE; retrying cannot help.
        let e = store.get(&format!("{p}list")).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Upstream);
        assert!(!e.retryable, "{e:?}");
        assert!(e.message.contains("WRONGTYPE"), "{}", e.message);
        let _: () = c.del(format!("{p}list")).await.unwrap();
    }
}
