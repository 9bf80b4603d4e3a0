//! Service configuration: built-in defaults, then an optional TOML file
//! (`--config <path>`, else `./sluice.toml` if present), then environment
//! overrides `SERVICE_<SECTION>__<KEY>` (nested: `SERVICE_ENGINE__CIRCUIT_BREAKER__ENABLED`).
//!
//! The overrides are derived from the configuration structure itself: the
//! defaults are serialized to a TOML tree, and an environment variable is
//! accepted only where that tree has a leaf, parsed as that leaf's type. An
//! unknown key or a bad value, in the file or the environment, stops start-up
//! with a message naming the key.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub server: Server,
    pub storage: Storage,
    pub ingest: Ingest,
    pub metrics: Metrics,
    pub logging: Logging,
    pub tracing: Tracing,
    pub engine: Engine,
    pub queue: Queue,
    pub kafka: Kafka,
    pub rate_limit: RateLimit,
    pub governance: GovernanceCfg,
    pub security: Security,
    pub admin_auth: AdminAuth,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Server {
    pub host: String,
    pub port: u16,
    /// How long in-flight requests may finish after a shutdown signal.
    pub shutdown_drain_secs: u64,
    /// How long the service keeps accepting requests after a shutdown
    /// signal, with `/readyz` answering 503, before it closes its listener
    /// and drains (0: at once). Gives a load balancer time to take the
    /// replica out of rotation.
    pub shutdown_delay_secs: u64,
    /// Requests served at once; more are shed with 503.
    pub max_in_flight: u64,
    /// How long a client may take to send a request's head (then the
    /// connection is closed) and, separately, its body (then 408).
    pub request_read_timeout_secs: u64,
    /// The largest admin request body, in bytes (larger: 413). Apart from
    /// `ingest.max_payload_size`, which is the data plane's: an import of
    /// a large export, or a tight data-plane limit, must not lock the
    /// admin plane out.
    pub admin_max_payload_size: u64,
    /// Load balancers and proxies (addresses or CIDR networks) whose
    /// `X-Forwarded-For` names the client (`crate::forwarded`). Empty: the
    /// TCP peer is the client.
    pub trusted_proxies: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Storage {
    /// `sqlite://file`, `postgres://...` or `mysql://...`; the scheme picks the backend.
    pub url: String,
    pub max_connections: u32,
    pub backup_dir: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Ingest {
    /// The largest request body accepted, in bytes (larger: 413).
    pub max_payload_size: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Metrics {
    pub enabled: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Pretty,
    Json,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Logging {
    pub level: LogLevel,
    pub format: LogFormat,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Tracing {
    pub enabled: bool,
    pub otlp_endpoint: String,
    pub service_name: String,
    pub sample_rate: f64,
    /// Gates `X-Service-Profile: 1` / `?profile=1` entirely.
    pub profile_enabled: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CircuitBreaker {
    pub enabled: bool,
    /// Consecutive failures that open the breaker (the fifth failure in a row for 5).
    pub failure_threshold: u32,
    pub recovery_timeout_secs: u64,
    /// Breakers kept; the least recently used is evicted beyond this.
    pub max_breakers: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Engine {
    pub circuit_breaker: CircuitBreaker,
    pub global_http_timeout_secs: u64,
    pub health_check_timeout_secs: u64,
    pub reload_timeout_secs: u64,
    pub max_channel_call_depth: u32,
    /// How often a MySQL/MariaDB replica polls the stored engine generation
    /// (PostgreSQL replicas are notified; SQLite is single-process).
    pub sync_interval_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Queue {
    pub workers: u32,
    pub dlq_retry_enabled: bool,
    pub dlq_max_retries: u32,
    pub dlq_poll_interval_secs: u64,
    pub trace_retention_hours: u64,
    /// How long a claimed async trace belongs to its replica before another
    /// may reclaim it (a replica that died mid-run). Never shorter than the
    /// longest channel timeout plus 5 s, so a live run is never run twice.
    pub lease_secs: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaDlq {
    pub enabled: bool,
    pub topic: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaTopic {
    pub topic: String,
    pub channel: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Kafka {
    pub enabled: bool,
    pub brokers: String,
    pub group_id: String,
    pub dlq: KafkaDlq,
    /// Topics consumed in addition to those of Kafka channels in the database.
    pub topics: Vec<KafkaTopic>,
    /// The consumer group session timeout (librdkafka's `session.timeout.ms`):
    /// how long a dead consumer keeps its partitions; group joins take about
    /// half of it on some brokers.
    pub session_timeout_ms: u64,
    /// Messages one consumer holds at once (fetched, queued or running);
    /// fetching pauses while it is full.
    pub max_in_flight: usize,
    /// How often a consumer commits the offsets of finished messages (it
    /// also commits them when it stops and before giving partitions away).
    pub commit_interval_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RateLimit {
    pub enabled: bool,
    pub requests_per_second: u64,
    pub burst: u64,
    /// With `governance.backend = "redis"`: admit requests while Redis is
    /// unreachable (default: refuse them with 503).
    pub fail_open: bool,
}

/// Where channel governance keeps its state: `memory` (per process) or
/// `redis` (shared by every replica: rate-limit buckets, deduplication
/// windows, the response cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GovernanceBackend {
    Memory,
    Redis,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GovernanceCfg {
    pub backend: GovernanceBackend,
    /// `redis://[user:password@]host:port[/db]` (or `rediss://`); required
    /// with the redis backend. Never logged.
    pub redis_url: String,
    /// Prefix of every key Sluice writes to Redis (`<prefix>:rate:…`,
    /// `:dedup:`, `:cache:`), so several fleets can share one Redis.
    pub key_prefix: String,
    /// Longest wait for one Redis round trip; past it the backend counts as
    /// unreachable for that request (and the check fails open or closed).
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Security {
    /// Lets `http_call` reach loopback, private and link-local addresses.
    pub allow_private_networks: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminAuth {
    pub enabled: bool,
    /// Full access. Empty means unset.
    pub api_key: String,
    /// GET-only access. Empty means unset.
    pub read_only_api_key: String,
    /// The header carrying a key, besides `Authorization: Bearer`.
    pub api_key_header: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            server: Server {
                host: "127.0.0.1".into(),
                port: 8080,
                shutdown_drain_secs: 30,
                shutdown_delay_secs: 0,
                request_read_timeout_secs: 30,
                max_in_flight: 10_000,
                admin_max_payload_size: 32 << 20,
                trusted_proxies: Vec::new(),
            },
            storage: Storage {
                url: "sqlite://sluice.db".into(),
                max_connections: 16,
                backup_dir: "./backups".into(),
            },
            ingest: Ingest {
                max_payload_size: 1_048_576,
            },
            metrics: Metrics { enabled: true },
            logging: Logging {
                level: LogLevel::Info,
                format: LogFormat::Pretty,
            },
            tracing: Tracing {
                enabled: false,
                otlp_endpoint: "http://127.0.0.1:4317".into(),
                service_name: "sluice".into(),
                sample_rate: 1.0,
                profile_enabled: true,
            },
            engine: Engine {
                circuit_breaker: CircuitBreaker {
                    enabled: true,
                    failure_threshold: 5,
                    recovery_timeout_secs: 30,
                    max_breakers: 10_000,
                },
                global_http_timeout_secs: 30,
                health_check_timeout_secs: 2,
                reload_timeout_secs: 10,
                max_channel_call_depth: 8,
                sync_interval_ms: 500,
            },
            queue: Queue {
                workers: 4,
                dlq_retry_enabled: true,
                dlq_max_retries: 5,
                dlq_poll_interval_secs: 30,
                trace_retention_hours: 72,
                lease_secs: 300,
            },
            kafka: Kafka {
                enabled: false,
                brokers: "127.0.0.1:9092".into(),
                group_id: "sluice".into(),
                dlq: KafkaDlq {
                    enabled: false,
                    topic: "sluice-dlq".into(),
                },
                topics: Vec::new(),
                session_timeout_ms: 45_000,
                max_in_flight: 256,
                commit_interval_ms: 1000,
            },
            rate_limit: RateLimit {
                enabled: false,
                requests_per_second: 1000,
                burst: 2000,
                fail_open: false,
            },
            governance: GovernanceCfg {
                backend: GovernanceBackend::Memory,
                redis_url: String::new(),
                key_prefix: "sluice".into(),
                timeout_ms: 250,
            },
            security: Security {
                allow_private_networks: false,
            },
            admin_auth: AdminAuth {
                enabled: false,
                api_key: String::new(),
                read_only_api_key: String::new(),
                api_key_header: "X-API-Key".into(),
            },
        }
    }
}

macro_rules! default_impl {
    ($($t:ty => $field:ident),* $(,)?) => {
        $(impl Default for $t {
            fn default() -> Self {
                Config::default().$field
            }
        })*
    };
}

default_impl!(Server => server, Storage => storage, Ingest => ingest, Metrics => metrics,
    Logging => logging, Tracing => tracing, Engine => engine, Queue => queue, Kafka => kafka,
    RateLimit => rate_limit, GovernanceCfg => governance, Security => security,
    AdminAuth => admin_auth);

impl Default for CircuitBreaker {
    fn default() -> Self {
        Engine::default().circuit_breaker
    }
}

impl Default for KafkaDlq {
    fn default() -> Self {
        Kafka::default().dlq
    }
}

/// Why the configuration could not be loaded. Every message names the key.
#[derive(Debug, thiserror::Error)]
#[error("configuration error: {0}")]
pub struct ConfigError(pub String);

const ENV_PREFIX: &str = "SERVICE_";

/// The most Kafka messages a consumer may hold fetched and unfinished.
pub const KAFKA_MAX_IN_FLIGHT: usize = 1_000_000;

impl Config {
    /// Loads defaults, then the file, then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        // `std::env::vars` panics on a variable that is not UTF-8, ours or
        // not: others are skipped, one of ours is an error naming it.
        let mut env = Vec::new();
        for (name, value) in std::env::vars_os() {
            let Some(name) = name.to_str() else { continue };
            if !name.starts_with(ENV_PREFIX) {
                continue;
            }
            match value.into_string() {
                Ok(value) => env.push((name.to_owned(), value)),
                Err(_) => {
                    return Err(ConfigError(format!(
                        "environment variable {name} is not valid UTF-8"
                    )));
                }
            }
        }
        Self::load_from(file, env)
    }

    /// As [`Config::load`], with the environment given (for tests).
    pub fn load_from(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let defaults = toml::Table::try_from(Config::default())
            .map_err(|e| ConfigError(format!("defaults do not serialize: {e}")))?;
        let mut merged = defaults.clone();
        let path = match file {
            Some(p) => Some(p.to_path_buf()),
            None => Some(PathBuf::from("sluice.toml")).filter(|p| p.exists()),
        };
        if let Some(path) = path {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
            // toml's own message quotes the offending line, which may hold
            // a secret (`api_key = "…` unterminated): the place and the
            // reason only.
            let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
                let at = e.span().map_or(String::new(), |span| {
                    let before = &text[..span.start.min(text.len())];
                    let line = before.matches('\n').count() + 1;
                    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                    format!(" at line {line} column {column}")
                });
                ConfigError(format!(
                    "{} is not valid TOML{at}: {}",
                    path.display(),
                    e.message()
                ))
            })?;
            merge(&mut merged, table);
        }
        let mut overrides: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with(ENV_PREFIX) && k.contains("__"))
            .collect();
        overrides.sort();
        // Names are read in any case: two spellings of one key would leave
        // the choice to the environment's order.
        let mut spelled: Vec<(String, &str)> = overrides
            .iter()
            .map(|(k, _)| (k.to_ascii_uppercase(), k.as_str()))
            .collect();
        spelled.sort();
        if let Some(pair) = spelled.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(ConfigError(format!(
                "environment variables {} and {} set the same key; keep one",
                pair[0].1, pair[1].1
            )));
        }
        for (name, raw) in &overrides {
            apply_env(&defaults, &mut merged, name, raw)?;
        }
        // Where a key's value came from, for the messages below.
        let from = |key: &str| {
            overrides
                .iter()
                .find(|(name, _)| env_key(name) == key)
                .map(|(name, _)| format!(" (from {name})"))
                .unwrap_or_default()
        };
        // Level and format names in any case (`DEBUG`, `Json`).
        if let Some(toml::Value::Table(logging)) = merged.get_mut("logging") {
            for key in ["level", "format"] {
                if let Some(toml::Value::String(v)) = logging.get_mut(key) {
                    *v = v.to_ascii_lowercase();
                }
            }
        }
        let mut config: Config = serde_path_to_error::deserialize(toml::Value::Table(merged))
            .map_err(|e| {
                let key = e.path().to_string();
                // serde quotes the value (`invalid type: integer `1234`,
                // expected a string`); not for a secret.
                let last = key.rsplit('.').next().unwrap_or(&key);
                if ["key", "password", "token", "secret", "url"]
                    .iter()
                    .any(|s| last.contains(s))
                {
                    // The reason without the quoted value.
                    let reason = e.inner().to_string();
                    let reason = reason.lines().next().unwrap_or_default();
                    let mut parts = reason.split('`');
                    let mut kept = parts.next().unwrap_or_default().trim_end().to_owned();
                    while let (Some(_quoted), Some(after)) = (parts.next(), parts.next()) {
                        kept.push_str(after);
                    }
                    ConfigError(format!("invalid value for '{key}': {kept}"))
                } else {
                    // toml appends where it was (`in `server``) on lines
                    // of its own; the key already says it.
                    let reason = e.inner().to_string();
                    let reason = reason.lines().next().unwrap_or_default();
                    match reason.strip_prefix("unknown field `") {
                        Some(rest) => {
                            let expected = rest
                                .split_once("expected ")
                                .map(|(_, e)| e.replace('`', ""))
                                .unwrap_or_default();
                            ConfigError(format!(
                                "unknown configuration key '{key}' (expected {expected})"
                            ))
                        }
                        None => ConfigError(format!(
                            "invalid value for '{key}'{}: {}",
                            from(&key),
                            unsigned_range(reason).unwrap_or_else(|| reason.to_owned())
                        )),
                    }
                }
            })?;
        config.normalize();
        config.check()?;
        Ok(config)
    }

    /// Surrounding whitespace is no part of a URL or a key (a secret read
    /// from a file often ends in a line break): the storage URL kept it
    /// in its file name, and a key with it could never match a header
    /// (HTTP strips it), so every admin call was refused. The storage URL's
    /// scheme is read in any case, as URL schemes are.
    fn normalize(&mut self) {
        for value in [
            &mut self.storage.url,
            &mut self.admin_auth.api_key,
            &mut self.admin_auth.read_only_api_key,
        ] {
            let trimmed = value.trim();
            if trimmed.len() != value.len() {
                *value = trimmed.to_owned();
            }
        }
        if let Some((scheme, _)) = self.storage.url.split_once(':')
            && scheme.bytes().any(|b| b.is_ascii_uppercase())
        {
            let lower = scheme.to_ascii_lowercase();
            self.storage.url.replace_range(..scheme.len(), &lower);
        }
    }

    /// Rules the types cannot express.
    fn check(&self) -> Result<(), ConfigError> {
        let fail =
            |key: &str, why: &str| Err(ConfigError(format!("invalid value for '{key}': {why}")));
        if !(0.0..=1.0).contains(&self.tracing.sample_rate) {
            return fail("tracing.sample_rate", "must be between 0.0 and 1.0");
        }
        // Checked with tracing off too (session 22): a typo would otherwise
        // show only on the day tracing is switched on. The scheme is the one
        // exception: an https:// endpoint (which this build cannot use)
        // named by a shared environment is refused only when tracing is on.
        let endpoint = self.tracing.otlp_endpoint.as_str();
        let scheme = endpoint
            .split_once("://")
            .map(|(s, _)| s.to_ascii_lowercase());
        let authority = endpoint.split_once("://").map_or("", |(_, rest)| {
            rest.split(['/', '?', '#']).next().unwrap_or("")
        });
        // `http::Uri` takes any digits as a port (`c:99999`).
        let port_ok = endpoint.parse::<http::Uri>().is_ok_and(|u| {
            u.authority().is_some_and(|a| {
                let host_port = a.as_str().rsplit_once('@').map_or(a.as_str(), |(_, h)| h);
                let (host, port) = match host_port.strip_prefix('[') {
                    Some(v6) => v6
                        .split_once(']')
                        .map_or(("", None), |(h, p)| (h, p.strip_prefix(':'))),
                    None => match host_port.rsplit_once(':') {
                        Some((h, p)) => (h, Some(p)),
                        None => (host_port, None),
                    },
                };
                !host.is_empty() && port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0))
            })
        });
        let well_formed =
            matches!(scheme.as_deref(), Some("http" | "https")) && port_ok && !authority.is_empty();
        if !well_formed || (self.tracing.enabled && scheme.as_deref() != Some("http")) {
            return fail(
                "tracing.otlp_endpoint",
                "must be an http:// URL with a host and a port in 1-65535 (OTLP over gRPC without TLS; send to a local collector or agent that forwards over TLS)",
            );
        }
        if self.tracing.service_name.trim().is_empty() {
            return fail("tracing.service_name", "must not be empty");
        }
        if let Err(why) = check_host(&self.server.host) {
            return fail("server.host", &why);
        }
        if let Err(why) = crate::forwarded::TrustedProxies::parse(&self.server.trusted_proxies) {
            return fail("server.trusted_proxies", &why);
        }
        if let Err(why) = check_storage_scheme(&self.storage.url) {
            return fail("storage.url", &why);
        }
        if self.storage.backup_dir.trim().is_empty() {
            return fail(
                "storage.backup_dir",
                "must not be empty (the directory backups are written to and listed from)",
            );
        }
        if self.ingest.max_payload_size == 0 {
            return fail("ingest.max_payload_size", "must be at least 1");
        }
        if self.server.admin_max_payload_size == 0 {
            return fail("server.admin_max_payload_size", "must be at least 1");
        }
        // Settings where 0 would stop the feature without saying so (no
        // queue worker, a bucket that never admits, a breaker open from the
        // start): refused, never quietly raised to 1.
        let at_least_one = [
            ("queue.workers", u64::from(self.queue.workers)),
            (
                "queue.dlq_poll_interval_secs",
                self.queue.dlq_poll_interval_secs,
            ),
            (
                "rate_limit.requests_per_second",
                self.rate_limit.requests_per_second,
            ),
            ("rate_limit.burst", self.rate_limit.burst),
            (
                "engine.circuit_breaker.failure_threshold",
                u64::from(self.engine.circuit_breaker.failure_threshold),
            ),
            (
                "engine.circuit_breaker.max_breakers",
                self.engine.circuit_breaker.max_breakers,
            ),
            (
                "engine.global_http_timeout_secs",
                self.engine.global_http_timeout_secs,
            ),
            // 0 would fail every channel_call, every health probe and every
            // reload.
            (
                "engine.max_channel_call_depth",
                u64::from(self.engine.max_channel_call_depth),
            ),
            (
                "engine.health_check_timeout_secs",
                self.engine.health_check_timeout_secs,
            ),
            (
                "engine.reload_timeout_secs",
                self.engine.reload_timeout_secs,
            ),
            (
                "server.request_read_timeout_secs",
                self.server.request_read_timeout_secs,
            ),
            // 0 would poll storage in a busy loop.
            ("engine.sync_interval_ms", self.engine.sync_interval_ms),
        ];
        if let Some((key, _)) = at_least_one.iter().find(|(_, v)| *v == 0) {
            return fail(key, "must be at least 1");
        }
        // Periods are added to clock readings (a deadline, the next sweep):
        // a year bounds them far below where that overflows, and any wait
        // longer than that is a typo.
        const YEAR_SECS: u64 = 365 * 24 * 3600;
        let periods = [
            (
                "server.shutdown_drain_secs",
                self.server.shutdown_drain_secs,
            ),
            (
                "server.shutdown_delay_secs",
                self.server.shutdown_delay_secs,
            ),
            (
                "server.request_read_timeout_secs",
                self.server.request_read_timeout_secs,
            ),
            (
                "engine.circuit_breaker.recovery_timeout_secs",
                self.engine.circuit_breaker.recovery_timeout_secs,
            ),
            (
                "engine.global_http_timeout_secs",
                self.engine.global_http_timeout_secs,
            ),
            (
                "engine.health_check_timeout_secs",
                self.engine.health_check_timeout_secs,
            ),
            (
                "engine.reload_timeout_secs",
                self.engine.reload_timeout_secs,
            ),
            (
                "engine.sync_interval_ms",
                self.engine.sync_interval_ms / 1000,
            ),
            (
                "queue.dlq_poll_interval_secs",
                self.queue.dlq_poll_interval_secs,
            ),
            (
                "queue.trace_retention_hours",
                self.queue.trace_retention_hours.saturating_mul(3600),
            ),
            ("queue.lease_secs", self.queue.lease_secs),
            ("governance.timeout_ms", self.governance.timeout_ms / 1000),
            (
                "kafka.session_timeout_ms",
                self.kafka.session_timeout_ms / 1000,
            ),
            (
                "kafka.commit_interval_ms",
                self.kafka.commit_interval_ms / 1000,
            ),
        ];
        if let Some((key, _)) = periods.iter().find(|(_, secs)| *secs > YEAR_SECS) {
            return fail(key, "must be at most one year");
        }
        if self.kafka.brokers.trim().is_empty() {
            return fail("kafka.brokers", "must not be empty");
        }
        // Every Kafka channel without its own `consumer_group` joins this
        // one; empty, its consumers could not be created and retried
        // forever with /health ok (audit 71). A channel's own empty
        // `consumer_group` is refused the same way.
        if self.kafka.group_id.trim().is_empty() {
            return fail("kafka.group_id", "must not be empty");
        }
        if self.kafka.dlq.enabled && self.kafka.dlq.topic.trim().is_empty() {
            return fail(
                "kafka.dlq.topic",
                "must not be empty when kafka.dlq.enabled is true",
            );
        }
        // Checked whether Kafka is on or not (session 22; before, only when
        // on): a bad broker or topic would show as a consumer retrying
        // forever, with /readyz still ok, or only on the day Kafka is
        // switched on.
        {
            use sluice_compiler::validate::{KAFKA_TOPIC_RULE, is_host_port, is_kafka_topic};
            if let Some(bad) = self
                .kafka
                .brokers
                .split(',')
                .map(str::trim)
                .find(|b| !is_host_port(b))
            {
                let bad = sluice_compiler::validate::broker_shown(bad);
                return fail(
                    "kafka.brokers",
                    &format!("broker '{bad}' must be host:port (brokers separated by commas)"),
                );
            }
            if !is_kafka_topic(&self.kafka.dlq.topic) {
                return fail("kafka.dlq.topic", KAFKA_TOPIC_RULE);
            }
            for (i, t) in self.kafka.topics.iter().enumerate() {
                if !is_kafka_topic(&t.topic) {
                    return fail(&format!("kafka.topics[{i}].topic"), KAFKA_TOPIC_RULE);
                }
                if !sluice_compiler::validate::is_identifier(&t.channel) {
                    return fail(
                        &format!("kafka.topics[{i}].channel"),
                        "must name a channel (letters, digits, '.', '_', '-')",
                    );
                }
            }
        }
        // Each worker is a task polling storage; a million of them only
        // exhausts memory.
        if self.queue.workers > 1024 {
            return fail("queue.workers", "must be at most 1024");
        }
        // The pool sets aside a slot per allowed connection when it is
        // built: 4294967295 asked for 200 GB (as a `db` connector's
        // `max_connections`, capped alike).
        let most = sluice_compiler::validate::DB_MAX_CONNECTIONS;
        if self.storage.max_connections == 0 || i64::from(self.storage.max_connections) > most {
            return fail(
                "storage.max_connections",
                &format!("must be between 1 and {most}"),
            );
        }
        if self.server.max_in_flight == 0 {
            return fail("server.max_in_flight", "must be at least 1");
        }
        // Permits of a semaphore, each a fetched message held in memory
        // (tokio refuses more than usize::MAX >> 3 permits with a panic).
        if self.kafka.max_in_flight == 0 || self.kafka.max_in_flight > KAFKA_MAX_IN_FLIGHT {
            return fail(
                "kafka.max_in_flight",
                &format!("must be between 1 and {KAFKA_MAX_IN_FLIGHT}"),
            );
        }
        if self.kafka.commit_interval_ms == 0 {
            return fail("kafka.commit_interval_ms", "must be at least 1");
        }
        if self.kafka.session_timeout_ms < 1000 {
            return fail("kafka.session_timeout_ms", "must be at least 1000");
        }
        let url = self.governance.redis_url.trim();
        if self.governance.backend == GovernanceBackend::Redis && url.is_empty() {
            return fail(
                "governance.redis_url",
                "governance.backend is \"redis\" but no URL is set",
            );
        }
        // Checked whenever it is set, the Redis backend on or not (a typo
        // must not wait for the day it is switched on; session 27, audit
        // 82). The redis crate's parse errors do not echo the URL (which
        // may hold a password).
        if !url.is_empty()
            && let Err(e) = redis::Client::open(url)
        {
            return fail("governance.redis_url", &e.to_string());
        }
        if url.to_ascii_lowercase().ends_with("#insecure") {
            return fail(
                "governance.redis_url",
                sluice_compiler::validate::REDIS_INSECURE,
            );
        }
        if self.governance.timeout_ms == 0 {
            return fail("governance.timeout_ms", "must be at least 1");
        }
        if self.admin_auth.enabled
            && self.admin_auth.api_key.is_empty()
            && self.admin_auth.read_only_api_key.is_empty()
        {
            return fail(
                "admin_auth.api_key",
                "admin_auth.enabled is true but no key is set",
            );
        }
        // A key no client can present locks its role out: the check reads
        // header values as printable ASCII (surrounding whitespace is
        // trimmed by `normalize`).
        for (field, key) in [
            ("admin_auth.api_key", &self.admin_auth.api_key),
            (
                "admin_auth.read_only_api_key",
                &self.admin_auth.read_only_api_key,
            ),
        ] {
            if key.is_empty() {
                continue;
            }
            // A tab inside a value travels (RFC 9110 5.5) and reads back.
            if !key.bytes().all(|b| (0x20..0x7f).contains(&b) || b == b'\t') {
                return fail(
                    field,
                    "holds a character other than printable ASCII (or a tab), which no client could send in a header",
                );
            }
        }
        // One key for both roles would make the read-only key an admin key.
        if !self.admin_auth.api_key.is_empty()
            && self.admin_auth.api_key == self.admin_auth.read_only_api_key
        {
            return fail(
                "admin_auth.read_only_api_key",
                "is the same as admin_auth.api_key; give each role its own key",
            );
        }
        if http::HeaderName::from_bytes(self.admin_auth.api_key_header.as_bytes()).is_err() {
            return fail("admin_auth.api_key_header", "is not a valid header name");
        }
        Ok(())
    }
}

/// `server.host`: an IP address or a host name (letters, digits and `-` in
/// dot-separated labels), so a typo is a configuration error naming the
/// key, not a failed bind. A name that does not resolve still fails at
/// bind.
fn check_host(host: &str) -> Result<(), String> {
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    let name = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty() {
        Err("must not be empty (an IP address such as 127.0.0.1 or 0.0.0.0, or a host name)".into())
    } else if name.len() <= 253 && name.split('.').all(label_ok) {
        Ok(())
    } else {
        Err("must be an IP address (such as 127.0.0.1, 0.0.0.0 or ::1, without brackets or port) or a host name".into())
    }
}

/// `storage.url`'s scheme is one the service speaks. The scheme is quoted
/// back only when it looks like one (a URL without a scheme may start with
/// a password).
fn check_storage_scheme(url: &str) -> Result<(), String> {
    const EXPECTED: &str = "expected sqlite:, postgres:, postgresql:, mysql: or mariadb:";
    let scheme = url.split_once(':').map(|(s, _)| s).unwrap_or_default();
    let known = ["sqlite", "postgres", "postgresql", "mysql", "mariadb"];
    if scheme.eq_ignore_ascii_case("sqlite") {
        // As the storage layer reads it (`storage::Store::open`), checked
        // here so the mistake is a configuration error (exit 2).
        let path = url["sqlite:".len()..].trim_start_matches('/');
        if path.is_empty() || path.starts_with('?') {
            return Err(
                "names no database file (sqlite://path/to/file.db, or sqlite::memory:)".into(),
            );
        }
        use std::str::FromStr as _;
        return sqlx::sqlite::SqliteConnectOptions::from_str(url)
            .map(|_| ())
            .map_err(|e| format!("is not a valid URL: {e}"));
    }
    if known.iter().any(|k| k.eq_ignore_ascii_case(scheme)) {
        // Parsed as the storage layer will, so a bad port or option is a
        // configuration error (exit 2), not a failure to open storage.
        // sqlx's messages name the part, never the password.
        use std::str::FromStr as _;
        let url = url.to_owned();
        let parsed =
            if scheme.eq_ignore_ascii_case("mysql") || scheme.eq_ignore_ascii_case("mariadb") {
                let url = format!("mysql{}", &url[scheme.len()..]);
                match sqlx::mysql::MySqlConnectOptions::from_str(&url) {
                    // Without one, the migrations failed with a misleading
                    // message about their lock.
                    Ok(o) if o.get_database().is_none_or(str::is_empty) => {
                        return Err("names no database (mysql://user@host:3306/dbname)".into());
                    }
                    other => other.map(|_| ()),
                }
            } else {
                sqlx::postgres::PgConnectOptions::from_str(&url).map(|_| ())
            };
        return parsed.map_err(|e| format!("is not a valid URL: {e}"));
    }
    let looks_like_scheme = !scheme.is_empty()
        && scheme.len() <= 16
        && scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'));
    if looks_like_scheme {
        Err(format!("unsupported scheme '{scheme}' ({EXPECTED})"))
    } else {
        Err(format!("has no scheme ({EXPECTED})"))
    }
}

/// Deep-merges `over` into `base` (tables merge, anything else replaces).
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// The dotted key a `SERVICE_<SECTION>__<KEY>` variable sets.
fn env_key(name: &str) -> String {
    name[ENV_PREFIX.len()..]
        .split("__")
        .map(str::to_ascii_lowercase)
        .collect::<Vec<_>>()
        .join(".")
}

/// serde's `invalid value: integer `-1`, expected u64` as the range it
/// means (`must be at least 0, got -1`).
fn unsigned_range(reason: &str) -> Option<String> {
    let rest = reason.strip_prefix("invalid value: integer `")?;
    let (n, ty) = rest.split_once("`, expected ")?;
    let n: i128 = n.parse().ok()?;
    let max: u64 = match ty {
        "u8" => u8::MAX.into(),
        "u16" => u16::MAX.into(),
        "u32" => u32::MAX.into(),
        "u64" | "usize" => u64::MAX,
        _ => return None,
    };
    // The key's own range may be narrower (its check names it).
    Some(if n < 0 {
        format!("must not be negative, got {n}")
    } else {
        format!("{n} is too large for this key (more than {max})")
    })
}

/// Applies one `SERVICE_<SECTION>__<KEY>` variable where the defaults have a
/// leaf at that path, parsed as that leaf's type.
fn apply_env(
    defaults: &toml::Table,
    merged: &mut toml::Table,
    name: &str,
    raw: &str,
) -> Result<(), ConfigError> {
    let dotted = env_key(name);
    let path: Vec<&str> = dotted.split('.').collect();
    let unknown = || {
        ConfigError(format!(
            "unknown configuration key '{dotted}' (from environment variable {name})"
        ))
    };
    let mut node = defaults;
    for seg in &path[..path.len() - 1] {
        node = node
            .get(*seg)
            .and_then(toml::Value::as_table)
            .ok_or_else(unknown)?;
    }
    let leaf = node.get(path[path.len() - 1]).ok_or_else(unknown)?;
    let bad = |why: &str| ConfigError(format!("invalid value for '{dotted}' (from {name}): {why}"));
    let value = match leaf {
        toml::Value::Boolean(_) => match raw.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => toml::Value::Boolean(true),
            "false" | "0" | "no" | "off" => toml::Value::Boolean(false),
            _ => {
                return Err(bad(
                    "expected a boolean (true or false; 1/0, yes/no and on/off are accepted too)",
                ));
            }
        },
        toml::Value::Integer(_) => {
            let raw = raw.trim();
            toml::Value::Integer(raw.parse().map_err(|_| {
                // Digits beyond i64 are an integer all the same.
                let (negative, digits) = match raw.as_bytes().first() {
                    Some(b'-') => (true, &raw[1..]),
                    Some(b'+') => (false, &raw[1..]),
                    _ => (false, raw),
                };
                if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
                    bad(&format!(
                        "{raw} is too {} for this key",
                        if negative { "small" } else { "large" }
                    ))
                } else {
                    bad("expected an integer")
                }
            })?)
        }
        toml::Value::Float(_) => {
            toml::Value::Float(raw.trim().parse().map_err(|_| bad("expected a number"))?)
        }
        toml::Value::String(_) => toml::Value::String(raw.to_owned()),
        toml::Value::Array(_) if !raw.trim_start().starts_with('[') => {
            // A list of strings may also be given plainly, comma-separated:
            // `SERVICE_SERVER__TRUSTED_PROXIES=10.0.0.0/8,127.0.0.1`.
            toml::Value::Array(
                raw.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| toml::Value::String(s.to_owned()))
                    .collect(),
            )
        }
        toml::Value::Array(_) => {
            // Arrays (kafka.topics) are given inline, as TOML: `[{topic = "t", channel = "c"}]`.
            // A bracketed IPv6 address alone (`[::1]`) is not TOML: a plain list of one.
            let doc: toml::Table = match format!("v = {raw}").parse() {
                Ok(doc) => doc,
                Err(_) if !raw.contains(['"', '\'', '{', '=']) => {
                    let mut doc = toml::Table::new();
                    doc.insert(
                        "v".into(),
                        toml::Value::Array(vec![toml::Value::String(raw.trim().to_owned())]),
                    );
                    doc
                }
                Err(e) => return Err(bad(&format!("expected a TOML array: {e}"))),
            };
            doc.get("v")
                .cloned()
                .ok_or_else(|| bad("expected a TOML array"))?
        }
        toml::Value::Table(t) => {
            // A section, not a key: name the variables that set its keys.
            let keys: Vec<String> = t
                .keys()
                .map(|k| format!("{name}__{}", k.to_ascii_uppercase()))
                .collect();
            return Err(ConfigError(format!(
                "'{dotted}' is a section, not a key (from environment variable {name}); set its keys instead: {}",
                keys.join(", ")
            )));
        }
        toml::Value::Datetime(_) => toml::Value::String(raw.to_owned()),
    };
    let mut node = merged;
    for seg in &path[..path.len() - 1] {
        node = node
            .entry(seg.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(unknown)?;
    }
    node.insert(path[path.len() - 1].to_owned(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn load(toml_text: Option<&str>, vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let dir = std::env::temp_dir().join(format!("sluice-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = toml_text.map(|t| {
            let p = dir.join("sluice.toml");
            std::fs::write(&p, t).unwrap();
            p
        });
        let cfg = Config::load_from(
            Some(file.as_deref().unwrap_or(&dir.join("none.toml"))).filter(|p| p.exists()),
            env(vars),
        );
        let _ = std::fs::remove_dir_all(&dir);
        cfg
    }

    #[test]
    fn defaults_match_the_decisions() {
        let c = load(None, &[]).unwrap();
        assert_eq!((c.server.host.as_str(), c.server.port), ("127.0.0.1", 8080));
        assert_eq!(c.storage.url, "sqlite://sluice.db");
        assert_eq!(c.ingest.max_payload_size, 1_048_576);
        assert_eq!(c.engine.circuit_breaker.failure_threshold, 5);
        assert_eq!(c.engine.max_channel_call_depth, 8);
        assert_eq!(c.kafka.dlq.topic, "sluice-dlq");
        assert!(c.tracing.profile_enabled && !c.admin_auth.enabled);
    }

    #[test]
    fn file_then_environment() {
        let c = load(
            Some("[server]\nport = 9000\n[engine.circuit_breaker]\nenabled = false\n"),
            &[
                ("SERVICE_SERVER__PORT", "9100"),
                ("SERVICE_ENGINE__CIRCUIT_BREAKER__FAILURE_THRESHOLD", "7"),
                ("SERVICE_LOGGING__FORMAT", "json"),
            ],
        )
        .unwrap();
        assert_eq!(c.server.port, 9100);
        assert!(!c.engine.circuit_breaker.enabled);
        assert_eq!(c.engine.circuit_breaker.failure_threshold, 7);
        assert_eq!(c.logging.format, LogFormat::Json);
        let e = load(
            None,
            &[("SERVICE_STORAGE__URL", "mysql://root@127.0.0.1:3306/")],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("names no database"), "{e}");
    }

    #[test]
    fn every_key_has_an_environment_override() {
        // Walk the defaults and override each leaf: the mechanism is derived,
        // so no key can be forgotten.
        fn leaves(prefix: &str, t: &toml::Table, out: &mut Vec<(String, toml::Value)>) {
            for (k, v) in t {
                let name = if prefix.is_empty() {
                    k.to_uppercase()
                } else {
                    format!("{prefix}__{}", k.to_uppercase())
                };
                match v {
                    toml::Value::Table(inner) => leaves(&name, inner, out),
                    other => out.push((name, other.clone())),
                }
            }
        }
        let mut all = Vec::new();
        leaves(
            "",
            &toml::Table::try_from(Config::default()).unwrap(),
            &mut all,
        );
        assert!(all.len() >= 40, "only {} keys", all.len());
        for (name, value) in all {
            let raw = match value {
                toml::Value::Boolean(b) => (!b).to_string(),
                toml::Value::Integer(i) => (i + 1).to_string(),
                toml::Value::Float(_) => "0.5".into(),
                toml::Value::String(s) if name.ends_with("LEVEL") => {
                    if s == "info" {
                        "debug".into()
                    } else {
                        "info".into()
                    }
                }
                toml::Value::String(s) if name.ends_with("FORMAT") => {
                    if s == "json" {
                        "pretty".into()
                    } else {
                        "json".into()
                    }
                }
                toml::Value::String(s) if name.ends_with("API_KEY_HEADER") => format!("x-{s}"),
                toml::Value::String(_) if name == "GOVERNANCE__BACKEND" => "redis".into(),
                toml::Value::String(_) if name == "KAFKA__BROKERS" => "k1:9092".into(),
                toml::Value::String(_) if name == "GOVERNANCE__REDIS_URL" => {
                    "redis://10.0.0.1:6379/".into()
                }
                toml::Value::String(_) if name == "TRACING__OTLP_ENDPOINT" => {
                    "http://collector:4317".into()
                }
                toml::Value::String(s) => format!("{s}x"),
                toml::Value::Array(_) if name.ends_with("TRUSTED_PROXIES") => {
                    "10.0.0.0/8, 127.0.0.1".into()
                }
                toml::Value::Array(_) => "[{topic = \"t\", channel = \"c\"}]".into(),
                other => panic!("unexpected leaf {other:?}"),
            };
            let var = format!("SERVICE_{name}");
            let extra = [
                ("SERVICE_ADMIN_AUTH__API_KEY", "k"),
                ("SERVICE_GOVERNANCE__REDIS_URL", "redis://127.0.0.1:6379/"),
            ];
            let mut vars = vec![(var.as_str(), raw.as_str())];
            vars.extend(extra.iter().filter(|(k, _)| *k != var));
            let cfg = load(None, &vars).unwrap_or_else(|e| panic!("{var}={raw}: {e}"));
            let tree = toml::Table::try_from(cfg).unwrap();
            let default_tree = toml::Table::try_from(Config::default()).unwrap();
            assert_ne!(tree, default_tree, "{var} had no effect");
        }
    }

    #[test]
    fn a_sqlite_url_must_name_a_file() {
        for url in ["sqlite://", "sqlite:", "sqlite:///?mode=rwc"] {
            let e = load(None, &[("SERVICE_STORAGE__URL", url)])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("storage.url") && e.contains("names no database file"),
                "{url}: {e}"
            );
        }
        for url in [
            "sqlite://x.db",
            "sqlite::memory:",
            "sqlite:///tmp/a.db?mode=rwc",
        ] {
            assert!(
                load(None, &[("SERVICE_STORAGE__URL", url)]).is_ok(),
                "{url}"
            );
        }
    }

    /// A storage URL that will not parse is a configuration error (exit 2)
    /// naming the key, without the password; whitespace around the URL and
    /// the keys is dropped, the scheme is read in any case, and so are log
    /// level and format names; an empty backup directory is refused.
    #[test]
    fn values_are_normalised_and_bad_urls_refused_at_load() {
        for url in [
            "postgres://u:hunter2@127.0.0.1:notaport/db",
            "postgres://u:hunter2@127.0.0.1/db?sslmode=bogus",
            "sqlite://x.db?mode=bogus",
        ] {
            let e = load(None, &[("SERVICE_STORAGE__URL", url)])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("storage.url") && e.contains("is not a valid URL"),
                "{url}: {e}"
            );
            assert!(!e.contains("hunter2"), "{e}");
        }
        let c = load(
            None,
            &[
                ("SERVICE_STORAGE__URL", "SQLITE://ws.db\n"),
                ("SERVICE_ADMIN_AUTH__API_KEY", " abc123 \n"),
                ("SERVICE_LOGGING__LEVEL", "DEBUG"),
                ("SERVICE_LOGGING__FORMAT", "Json"),
            ],
        )
        .unwrap();
        assert_eq!(c.storage.url, "sqlite://ws.db");
        assert_eq!(c.admin_auth.api_key, "abc123");
        assert_eq!(c.logging.level, LogLevel::Debug);
        assert_eq!(c.logging.format, LogFormat::Json);
        let e = load(None, &[("SERVICE_STORAGE__BACKUP_DIR", " ")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("storage.backup_dir"), "{e}");
    }

    #[test]
    fn trusted_proxies_are_checked_and_take_plain_lists() {
        let c = load(
            None,
            &[("SERVICE_SERVER__TRUSTED_PROXIES", "10.0.0.0/8, ::1")],
        )
        .unwrap();
        assert_eq!(c.server.trusted_proxies, ["10.0.0.0/8", "::1"]);
        let c = load(
            None,
            &[("SERVICE_SERVER__TRUSTED_PROXIES", "[\"127.0.0.1\"]")],
        )
        .unwrap();
        assert_eq!(c.server.trusted_proxies, ["127.0.0.1"]);
        let c = load(None, &[("SERVICE_SERVER__TRUSTED_PROXIES", "[::1]")]).unwrap();
        assert_eq!(c.server.trusted_proxies, ["[::1]"]);
        let e = load(
            Some("[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"lb\"]\n"),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("server.trusted_proxies") && e.contains("'lb'"),
            "{e}"
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let e = load(Some("[server]\nprot = 1\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("prot"), "{e}");
        let e = load(Some("[server]\nport = \"x\"\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("server.port"), "{e}");
        let e = load(None, &[("SERVICE_SERVER__PROT", "1")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("server.prot") && e.contains("SERVICE_SERVER__PROT"),
            "{e}"
        );
        let e = load(None, &[("SERVICE_METRICS__ENABLED", "maybe")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("metrics.enabled"), "{e}");
        let e = load(None, &[("SERVICE_LOGGING__LEVEL", "loud")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("logging.level"), "{e}");
        let e = load(None, &[("SERVICE_TRACING__SAMPLE_RATE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("tracing.sample_rate"), "{e}");
        // Variables without a section separator are not ours (e.g. SERVICE_NAME).
        assert!(load(None, &[("SERVICE_NAME", "x")]).is_ok());
        let e = load(None, &[("SERVICE_GOVERNANCE__BACKEND", "redis")])
            .unwrap_err()
            .0;
        assert!(e.contains("'governance.redis_url'"), "{e}");
        let e = load(
            Some("[governance]\nbackend = \"redis\"\nredis_url = \"http://u:secret@h\"\n"),
            &[],
        )
        .unwrap_err()
        .0;
        assert!(
            e.contains("'governance.redis_url'") && !e.contains("secret"),
            "{e}"
        );
        // Checked with the memory backend too.
        let e = load(
            None,
            &[("SERVICE_GOVERNANCE__REDIS_URL", "redis://:x@127.0.0.1:bad/")],
        )
        .unwrap_err()
        .0;
        assert!(
            e.contains("'governance.redis_url'") && !e.contains(":x@"),
            "{e}"
        );
        let e = load(Some("[governance]\nbackend = \"etcd\"\n"), &[])
            .unwrap_err()
            .0;
        assert!(e.contains("backend"), "{e}");
    }

    #[test]
    fn unknown_keys_sections_hosts_and_storage_schemes_are_named() {
        let e = load(Some("[server]\nbogus = 1\n"), &[]).unwrap_err().0;
        assert!(
            e.starts_with("unknown configuration key 'server.bogus' (expected one of host, port")
                && !e.contains('\n'),
            "{e}"
        );
        let e = load(None, &[("SERVICE_KAFKA__DLQ", "x")]).unwrap_err().0;
        assert!(
            e.starts_with("'kafka.dlq' is a section, not a key")
                && e.contains("SERVICE_KAFKA__DLQ__ENABLED"),
            "{e}"
        );
        let e = load(None, &[("SERVICE_METRICS__ENABLED", "maybe")])
            .unwrap_err()
            .0;
        assert!(e.contains("1/0, yes/no and on/off"), "{e}");
        for host in ["not..a..host", "[::1]", "127.0.0.1:80", "", "-x", "a b"] {
            let e = load(None, &[("SERVICE_SERVER__HOST", host)]).unwrap_err().0;
            assert!(
                e.starts_with("invalid value for 'server.host'"),
                "{host}: {e}"
            );
        }
        for host in [
            "127.0.0.1",
            "0.0.0.0",
            "::1",
            "::",
            "localhost",
            "api-1.example.com.",
        ] {
            let c = load(None, &[("SERVICE_SERVER__HOST", host)]).unwrap();
            assert_eq!(c.server.host, host);
        }
        let e = load(None, &[("SERVICE_STORAGE__URL", "foo://bar")])
            .unwrap_err()
            .0;
        assert_eq!(
            e,
            "invalid value for 'storage.url': unsupported scheme 'foo' (expected sqlite:, postgres:, postgresql:, mysql: or mariadb:)"
        );
        // A URL without a scheme may begin with a password: not quoted.
        let e = load(None, &[("SERVICE_STORAGE__URL", "s3cr3t@#host:5432")])
            .unwrap_err()
            .0;
        assert!(e.contains("has no scheme") && !e.contains("s3cr3t"), "{e}");
        for url in ["sqlite::memory:", "POSTGRES://h/db", "mariadb://h/db"] {
            assert!(
                load(None, &[("SERVICE_STORAGE__URL", url)]).is_ok(),
                "{url}"
            );
        }
    }

    #[test]
    fn kafka_brokers_and_topics_are_checked_whether_kafka_is_on_or_not() {
        let on = ("SERVICE_KAFKA__ENABLED", "true");
        for (var, value, message) in [
            (
                "SERVICE_KAFKA__BROKERS",
                "nohostport",
                "invalid value for 'kafka.brokers': broker 'nohostport' must be host:port (brokers separated by commas)",
            ),
            (
                "SERVICE_KAFKA__BROKERS",
                "a:9092,h:0",
                "invalid value for 'kafka.brokers': broker 'h:0' must be host:port (brokers separated by commas)",
            ),
            (
                "SERVICE_KAFKA__BROKERS",
                "SASL_SSL://svc:Pa55w0rd@kafka-1:9092",
                "invalid value for 'kafka.brokers': broker 'SASL_SSL://******@kafka-1:9092' must be host:port (brokers separated by commas)",
            ),
            (
                "SERVICE_KAFKA__TOPICS",
                "[{topic = \"\", channel = \"kz\"}]",
                "invalid value for 'kafka.topics[0].topic': must be a Kafka topic name",
            ),
            (
                "SERVICE_KAFKA__TOPICS",
                "[{topic = \"t\", channel = \"\"}]",
                "invalid value for 'kafka.topics[0].channel': must name a channel",
            ),
        ] {
            let e = load(None, &[on, (var, value)]).unwrap_err().0;
            assert!(e.starts_with(message), "{var}={value}: {e}");
            // The same with Kafka off (session 22): the typo shows now.
            let e = load(None, &[(var, value)]).unwrap_err().0;
            assert!(e.starts_with(message), "off, {var}={value}: {e}");
        }
        let e = load(
            None,
            &[
                on,
                ("SERVICE_KAFKA__DLQ__ENABLED", "true"),
                ("SERVICE_KAFKA__DLQ__TOPIC", "bad topic!"),
            ],
        )
        .unwrap_err()
        .0;
        assert!(
            e.starts_with("invalid value for 'kafka.dlq.topic': must be a Kafka topic name"),
            "{e}"
        );
        assert!(load(None, &[on, ("SERVICE_KAFKA__BROKERS", "k1:9092, k2:9093")]).is_ok());
    }

    #[test]
    fn zero_where_it_would_disable_a_feature_is_refused() {
        for var in [
            "SERVICE_QUEUE__WORKERS",
            "SERVICE_QUEUE__DLQ_POLL_INTERVAL_SECS",
            "SERVICE_RATE_LIMIT__REQUESTS_PER_SECOND",
            "SERVICE_RATE_LIMIT__BURST",
            "SERVICE_ENGINE__CIRCUIT_BREAKER__FAILURE_THRESHOLD",
            "SERVICE_ENGINE__CIRCUIT_BREAKER__MAX_BREAKERS",
            "SERVICE_ENGINE__GLOBAL_HTTP_TIMEOUT_SECS",
            "SERVICE_ENGINE__MAX_CHANNEL_CALL_DEPTH",
            "SERVICE_ENGINE__HEALTH_CHECK_TIMEOUT_SECS",
            "SERVICE_ENGINE__RELOAD_TIMEOUT_SECS",
            "SERVICE_SERVER__REQUEST_READ_TIMEOUT_SECS",
            "SERVICE_SERVER__MAX_IN_FLIGHT",
            "SERVICE_SERVER__ADMIN_MAX_PAYLOAD_SIZE",
            "SERVICE_ENGINE__SYNC_INTERVAL_MS",
        ] {
            let e = load(None, &[(var, "0")]).unwrap_err().0;
            let key = var["SERVICE_".len()..]
                .to_ascii_lowercase()
                .replace("__", ".");
            assert_eq!(
                e,
                format!("invalid value for '{key}': must be at least 1"),
                "{var}"
            );
            assert!(load(None, &[(var, "1")]).is_ok(), "{var}");
        }
    }

    /// The OTLP endpoint is plain http:// (the exporter is built without
    /// TLS: an https:// one failed at start with advice about build
    /// features), and spans need a service name.
    #[test]
    fn tracing_endpoint_and_service_name_are_checked() {
        let https = (
            "SERVICE_TRACING__OTLP_ENDPOINT",
            "https://otel.example.com:4317",
        );
        let on = ("SERVICE_TRACING__ENABLED", "true");
        // Not used with tracing off: not refused either.
        assert!(load(None, &[https]).is_ok());
        for fine in [
            "http://[::1]:4317",
            "http://[::1]",
            "http://collector",
            "http://u@c:4317",
        ] {
            assert!(
                load(None, &[("SERVICE_TRACING__OTLP_ENDPOINT", fine)]).is_ok(),
                "{fine}"
            );
        }
        assert!(
            load(
                None,
                &[on, ("SERVICE_TRACING__OTLP_ENDPOINT", "HTTP://c:4317")]
            )
            .is_ok()
        );
        let e = load(None, &[on, https]).unwrap_err().0;
        assert!(
            e.starts_with("invalid value for 'tracing.otlp_endpoint': must be an http:// URL"),
            "{e}"
        );
        let e = load(None, &[on, ("SERVICE_TRACING__SERVICE_NAME", " ")])
            .unwrap_err()
            .0;
        assert_eq!(
            e,
            "invalid value for 'tracing.service_name': must not be empty"
        );
        // A value that is no URL at all, or an empty name, is refused with
        // tracing off too: the typo shows now, not when tracing is enabled.
        for endpoint in [
            "notaurl",
            "http://",
            "ftp://c:4317",
            "http://c:4317 x",
            "http://c:99999",
            "http://c:0",
            "http://[::1]:99999",
            "http://:4317",
            "http://@:4317",
        ] {
            let e = load(None, &[("SERVICE_TRACING__OTLP_ENDPOINT", endpoint)])
                .unwrap_err()
                .0;
            assert!(
                e.starts_with("invalid value for 'tracing.otlp_endpoint'"),
                "{endpoint}: {e}"
            );
        }
        let e = load(None, &[("SERVICE_TRACING__SERVICE_NAME", "")])
            .unwrap_err()
            .0;
        assert_eq!(
            e,
            "invalid value for 'tracing.service_name': must not be empty"
        );
    }

    /// One key for both admin roles is refused: the read-only key would
    /// then be an admin key. The message does not quote it.
    #[test]
    fn the_two_admin_keys_differ() {
        let e = load(
            None,
            &[
                ("SERVICE_ADMIN_AUTH__ENABLED", "true"),
                ("SERVICE_ADMIN_AUTH__API_KEY", "SAMEKEY12345"),
                ("SERVICE_ADMIN_AUTH__READ_ONLY_API_KEY", "SAMEKEY12345"),
            ],
        )
        .unwrap_err()
        .0;
        assert_eq!(
            e,
            "invalid value for 'admin_auth.read_only_api_key': is the same as admin_auth.api_key; give each role its own key"
        );
        assert!(
            load(
                None,
                &[
                    ("SERVICE_ADMIN_AUTH__ENABLED", "true"),
                    ("SERVICE_ADMIN_AUTH__API_KEY", "ADMINKEY1234"),
                    ("SERVICE_ADMIN_AUTH__READ_ONLY_API_KEY", "READKEY12345"),
                ],
            )
            .is_ok()
        );
    }

    /// Numbers out of a key's range name the range and where the value came
    /// from (audit 94: `expected an integer` for digits beyond i64; serde's
    /// `invalid value: integer `-1`, expected u64` without the variable).
    #[test]
    fn out_of_range_numbers_name_the_range() {
        for (name, value, message) in [
            (
                "SERVICE_QUEUE__DLQ_MAX_RETRIES",
                "99999999999999999999",
                "invalid value for 'queue.dlq_max_retries' (from SERVICE_QUEUE__DLQ_MAX_RETRIES): 99999999999999999999 is too large for this key",
            ),
            (
                "SERVICE_QUEUE__DLQ_MAX_RETRIES",
                "+99999999999999999999",
                "invalid value for 'queue.dlq_max_retries' (from SERVICE_QUEUE__DLQ_MAX_RETRIES): +99999999999999999999 is too large for this key",
            ),
            (
                "SERVICE_QUEUE__DLQ_MAX_RETRIES",
                "-99999999999999999999",
                "invalid value for 'queue.dlq_max_retries' (from SERVICE_QUEUE__DLQ_MAX_RETRIES): -99999999999999999999 is too small for this key",
            ),
            (
                "SERVICE_INGEST__MAX_PAYLOAD_SIZE",
                "-1",
                "invalid value for 'ingest.max_payload_size' (from SERVICE_INGEST__MAX_PAYLOAD_SIZE): must not be negative, got -1",
            ),
            (
                "SERVICE_STORAGE__MAX_CONNECTIONS",
                "4294967296",
                "invalid value for 'storage.max_connections' (from SERVICE_STORAGE__MAX_CONNECTIONS): 4294967296 is too large for this key (more than 4294967295)",
            ),
            (
                "SERVICE_INGEST__MAX_PAYLOAD_SIZE",
                "12x",
                "invalid value for 'ingest.max_payload_size' (from SERVICE_INGEST__MAX_PAYLOAD_SIZE): expected an integer",
            ),
        ] {
            assert_eq!(load(None, &[(name, value)]).unwrap_err().0, message);
        }
        // From a file: no variable to name.
        let e = load(Some("[ingest]\nmax_payload_size = -1\n"), &[])
            .unwrap_err()
            .0;
        assert_eq!(
            e,
            "invalid value for 'ingest.max_payload_size': must not be negative, got -1"
        );
    }

    /// A key a client could not send stops start-up, naming the
    /// key, never its value.
    #[test]
    fn keys_no_client_can_send_are_refused() {
        // In a file (a TOML escape gives the control character).
        for (key, value) in [
            ("api_key", "ADMIN\\u0001KEY1234"),
            ("read_only_api_key", "READ\u{e9}KEY1234"),
        ] {
            let toml = format!("[admin_auth]\nenabled = true\n{key} = \"{value}\"\n");
            let e = load(Some(&toml), &[]).unwrap_err().0;
            assert!(
                e.starts_with(&format!("invalid value for 'admin_auth.{key}': "))
                    && e.contains("printable ASCII"),
                "{key}={value:?}: {e}"
            );
            assert!(!e.contains("KEY1234"), "{e}");
        }
        // Spaces and tabs inside a key are sent as they are.
        assert!(
            load(
                Some("[admin_auth]\nenabled = true\napi_key = \"ADMIN\\tKEY1234\"\n"),
                &[]
            )
            .is_ok()
        );
        assert!(
            load(
                None,
                &[
                    ("SERVICE_ADMIN_AUTH__ENABLED", "true"),
                    ("SERVICE_ADMIN_AUTH__API_KEY", "ADMIN KEY 1234"),
                ],
            )
            .is_ok()
        );
    }

    /// Errors about a secret's value name the key and the reason, never the
    /// value; a TOML syntax error gives the place, not the line's text.
    #[test]
    fn configuration_errors_never_quote_a_secret() {
        let e = load(Some("[admin_auth]\napi_key = 12345678\n"), &[])
            .unwrap_err()
            .0;
        assert_eq!(
            e,
            "invalid value for 'admin_auth.api_key': invalid type: integer, expected a string"
        );
        let dir = std::env::temp_dir().join(format!("sluice-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("sluice.toml");
        std::fs::write(&file, "[admin_auth]\napi_key = \"TOPSECRET123\n").unwrap();
        let e = Config::load_from(Some(&file), Vec::new()).unwrap_err().0;
        assert!(!e.contains("TOPSECRET123"), "{e}");
        assert!(e.contains("is not valid TOML at line 2 column"), "{e}");
    }

    /// Periods are added to clock readings; one near u64::MAX overflowed
    /// there and every connection panicked. A year is the bound.
    #[test]
    fn periods_and_worker_counts_have_an_upper_bound() {
        for (var, too_long, longest) in [
            (
                "SERVICE_SERVER__REQUEST_READ_TIMEOUT_SECS",
                "9223372036854775807",
                "31536000",
            ),
            (
                "SERVICE_SERVER__SHUTDOWN_DRAIN_SECS",
                "31536001",
                "31536000",
            ),
            ("SERVICE_QUEUE__TRACE_RETENTION_HOURS", "8761", "8760"),
            (
                "SERVICE_KAFKA__COMMIT_INTERVAL_MS",
                "31537000000",
                "31536000000",
            ),
        ] {
            let e = load(None, &[(var, too_long)]).unwrap_err().0;
            let key = var["SERVICE_".len()..]
                .to_ascii_lowercase()
                .replace("__", ".");
            assert_eq!(
                e,
                format!("invalid value for '{key}': must be at most one year")
            );
            assert!(load(None, &[(var, longest)]).is_ok(), "{var}");
        }
        let e = load(None, &[("SERVICE_QUEUE__WORKERS", "1025")])
            .unwrap_err()
            .0;
        assert_eq!(e, "invalid value for 'queue.workers': must be at most 1024");
        let e = load(
            None,
            &[("SERVICE_KAFKA__MAX_IN_FLIGHT", "2305843009213693952")],
        )
        .unwrap_err()
        .0;
        assert_eq!(
            e,
            "invalid value for 'kafka.max_in_flight': must be between 1 and 1000000"
        );
        assert!(load(None, &[("SERVICE_KAFKA__MAX_IN_FLIGHT", "1000000")]).is_ok());
        let e = load(
            None,
            &[(
                "SERVICE_GOVERNANCE__REDIS_URL",
                "rediss://127.0.0.1:6379/#insecure",
            )],
        )
        .unwrap_err()
        .0;
        assert!(
            e.contains("#insecure (TLS without a certificate check) is not supported"),
            "{e}"
        );
        // Two spellings of one key are refused, not settled by their order.
        let e = load(
            None,
            &[("SERVICE_server__port", "1"), ("SERVICE_SERVER__PORT", "2")],
        )
        .unwrap_err()
        .0;
        assert_eq!(
            e,
            "environment variables SERVICE_SERVER__PORT and SERVICE_server__port set the same key; keep one"
        );
        // A pool this large could not be built (it ended the process).
        for n in ["0", "1001", "4294967295"] {
            let e = load(None, &[("SERVICE_STORAGE__MAX_CONNECTIONS", n)])
                .unwrap_err()
                .0;
            assert_eq!(
                e, "invalid value for 'storage.max_connections': must be between 1 and 1000",
                "{n}"
            );
        }
        assert!(load(None, &[("SERVICE_STORAGE__MAX_CONNECTIONS", "1000")]).is_ok());
        // Switched on with nothing to talk to.
        let e = load(
            None,
            &[
                ("SERVICE_KAFKA__ENABLED", "true"),
                ("SERVICE_KAFKA__BROKERS", " "),
            ],
        )
        .unwrap_err()
        .0;
        assert_eq!(e, "invalid value for 'kafka.brokers': must not be empty");
        let e = load(None, &[("SERVICE_KAFKA__GROUP_ID", "")])
            .unwrap_err()
            .0;
        assert_eq!(e, "invalid value for 'kafka.group_id': must not be empty");
        let e = load(
            None,
            &[
                ("SERVICE_KAFKA__DLQ__ENABLED", "true"),
                ("SERVICE_KAFKA__DLQ__TOPIC", ""),
            ],
        )
        .unwrap_err()
        .0;
        assert_eq!(
            e,
            "invalid value for 'kafka.dlq.topic': must not be empty when kafka.dlq.enabled is true"
        );
    }
}
