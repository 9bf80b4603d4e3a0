//! Channel governance: the checks a channel runs before its workflow, in the
//! spec's order — deduplication, rate limit (platform and per channel),
//! `validation_logic`, backpressure, response cache — plus CORS.
//!
//! The rules (compiled `key_logic`s) belong to the engine snapshot and are
//! rebuilt on every reload; the *state* (token buckets, dedup windows, cached
//! responses, concurrency counters) lives here, in `App`, keyed by channel
//! name, so a reload neither resets a client's bucket nor forgets a window.
//! Everything on the request path is lock-free (atomics) or sharded (moka,
//! dashmap); there is no global mutex.

use crate::api::{ApiError, Code, HttpResponse};
use crate::engine::Channel;
use bumpalo::Bump;
use bytes::Bytes;
use dashmap::DashMap;
use http::{HeaderValue, StatusCode, header};
use moka::sync::Cache;
use sluice_compiler::Value;
use sluice_compiler::def::ChannelConfig;
use sluice_compiler::diag::Diagnostic;
use sluice_compiler::logic::{self, Logic, truthy};
use sluice_compiler::plan::Plan;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Token buckets kept at most (LRU-ish, TinyLFU); an evicted bucket is full
/// again, which only ever errs on the lenient side.
const MAX_BUCKETS: u64 = 100_000;
/// A bucket idle this long is full anyway for any sane rate, so it can go.
const BUCKET_IDLE: Duration = Duration::from_secs(3600);
/// Dedup keys remembered at most; past this the oldest windows are forgotten.
const MAX_DEDUP_KEYS: u64 = 1_000_000;
/// Bytes of cached responses (keys plus bodies) kept at most.
const MAX_CACHE_BYTES: u64 = 64 * 1024 * 1024;
/// Distinct `client` label values of `rate_limit_rejections_total`; later
/// clients are counted under `other` so a key flood cannot blow up the
/// metrics registry.
const MAX_CLIENT_LABELS: usize = 1000;
/// `Retry-After` of a backpressure rejection: slots free up as soon as a
/// running request ends, so the shortest honest hint.
const BACKPRESSURE_RETRY_SECS: u64 = 1;

/// A channel's governance rules compiled once per snapshot (never per
/// request).
#[derive(Debug, Default)]
pub struct Rules {
    pub rate_key: Option<Logic>,
    pub dedup_key: Option<Logic>,
    pub cache_key: Option<Logic>,
    /// The channel's name and its rate limit's settings, the start of
    /// every rate-limit key: a changed limit (a new version, or a channel
    /// created again under the name) starts with full buckets instead of
    /// paying the old limit's debt (a limit raised from 0.01/s to 100/s
    /// still answered `Retry-After: 96`). A reload that keeps the settings
    /// keeps the buckets.
    pub rate_scope: String,
    /// The same for deduplication: the channel's name and `window_secs`,
    /// so a key seen under another window is not refused under this one
    /// (a 409 claimed "within the last 2 s" for a key seen 3 s before).
    pub dedup_scope: String,
    /// The channel version and its workflows' versions, each with the
    /// identity of its stored text: part of every cache key, so a response
    /// of an older definition is never served after a change, nor after a
    /// definition was deleted and created again under the same id (without
    /// flushing other channels' entries on every reload).
    pub cache_scope: String,
    /// Set when the bound plans split traffic by rollout bucket: for each
    /// bucket (0..100), which set of plans it runs (a small number naming
    /// that set), part of the cache key so a canary caller is never
    /// answered from the other version's cache. `None` (one set for every
    /// bucket, the usual case) costs nothing.
    pub cache_variants: Option<Box<[u8; 100]>>,
}

impl Rules {
    /// Compiles the `key_logic`s of `config` (errors name the field).
    pub fn compile(
        config: &ChannelConfig,
        name: &str,
        version: i64,
        source_id: &str,
        plans: &[Arc<Plan>],
    ) -> Result<Rules, Vec<Diagnostic>> {
        let mut problems = Vec::new();
        let mut one = |rule: Option<&serde_json::Value>, field: &str| {
            rule.and_then(|r| match logic::compile(r) {
                Ok(l) => Some(l),
                Err(e) => {
                    problems.push(Diagnostic {
                        field: format!("config_json.{field}.key_logic"),
                        message: format!("invalid JSONLogic: {}", e.message),
                    });
                    None
                }
            })
        };
        let rate_key = one(
            config
                .rate_limit
                .as_ref()
                .and_then(|r| r.key_logic.as_ref()),
            "rate_limit",
        );
        let dedup_key = one(
            config
                .deduplication
                .as_ref()
                .and_then(|d| d.key_logic.as_ref()),
            "deduplication",
        );
        let cache_key = one(
            config.cache.as_ref().and_then(|c| c.key_logic.as_ref()),
            "cache",
        );
        let mut cache_scope = format!("{name}@{version}:{source_id}");
        for p in plans {
            cache_scope.push_str(&format!(",{}@{}:{}", p.workflow_id, p.version, p.source_id));
        }
        let rate_scope = match &config.rate_limit {
            Some(r) => format!("{name}\0{}/{}", r.requests_per_second, r.effective_burst()),
            None => String::new(),
        };
        let dedup_scope = match &config.deduplication {
            Some(d) => format!("{name}\0{}", d.window_secs),
            None => String::new(),
        };
        if problems.is_empty() {
            Ok(Rules {
                rate_key,
                dedup_key,
                cache_key,
                rate_scope,
                dedup_scope,
                cache_scope,
                cache_variants: rollout_variants(plans),
            })
        } else {
            Err(problems)
        }
    }
}

/// What the checks see of one request.
#[derive(Debug, Clone, Copy)]
pub struct View<'r> {
    pub client_ip: &'r str,
    pub method: &'r str,
    /// The path as requested (part of the default cache key).
    pub target: &'r str,
    pub headers: &'r [(&'r str, &'r str)],
    pub query: &'r [(&'r str, &'r str)],
    pub path: &'r [(&'r str, &'r str)],
    pub body: &'r [u8],
    /// A `channel_call`: the body is the payload itself, and the platform
    /// limit (which meters outside clients) was already paid by the caller.
    pub internal: bool,
    /// The request's rollout bucket (which version it runs; see
    /// [`Rules::cache_variants`]).
    pub bucket: Option<u8>,
    /// A profiled request: the cache neither answers nor stores it (its
    /// timings belong to this run).
    pub profile: bool,
}

/// For each rollout bucket, a number naming the set of `plans` whose range
/// accepts it; `None` when every bucket gets the same set.
fn rollout_variants(plans: &[Arc<Plan>]) -> Option<Box<[u8; 100]>> {
    let mut sets: Vec<Vec<bool>> = Vec::new();
    let mut table = Box::new([0u8; 100]);
    for (bucket, slot) in (0u8..100).zip(table.iter_mut()) {
        let set: Vec<bool> = plans
            .iter()
            .map(|p| p.rollout.accepts(Some(bucket)))
            .collect();
        let id = match sets.iter().position(|s| *s == set) {
            Some(id) => id,
            None => {
                sets.push(set);
                sets.len() - 1
            }
        };
        // At most 100 distinct sets: one per bucket.
        *slot = id as u8;
    }
    (sets.len() > 1).then_some(table)
}

/// Which checks run: a sync run (or channel_call) gets all of them; an async
/// submission stops after validation (its concurrency is bounded by the
/// queue's workers, and a 202 is not a response worth caching).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Run,
    Submit,
}

/// A request let through. Holds the backpressure slot until dropped.
#[derive(Debug, Default)]
pub struct Admitted {
    _slot: Option<Slot>,
    /// Where to store a successful response, and for how long.
    store_as: Option<(String, Duration)>,
    /// A cache hit: the stored response; the workflow must not run.
    pub hit: Option<Bytes>,
    /// The deduplication key this request claimed, given back when nothing
    /// ran after all (see [`Governance::give_back`]).
    claimed: Option<String>,
}

impl Admitted {
    /// Whether [`Governance::store`] has anything to do for this request.
    pub fn stores(&self) -> bool {
        self.store_as.is_some()
    }

    /// Whether the request claimed a deduplication key.
    pub fn claims(&self) -> bool {
        self.claimed.is_some()
    }
}

/// One backpressure slot; gives it back on drop (also when the request's
/// future is cancelled).
#[derive(Debug)]
struct Slot(Arc<AtomicU32>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A GCRA token bucket in one atomic: the "theoretical arrival time" in
/// nanoseconds since [`Governance::epoch`]. Equivalent to a token bucket of
/// `burst` tokens refilled at `rate`, updated with a CAS loop (no lock).
#[derive(Debug, Default)]
struct Bucket {
    tat: AtomicU64,
}

impl Bucket {
    /// Takes a token, or says how many nanoseconds until one is available.
    fn take(&self, now: u64, interval: u64, burst: u32) -> Result<(), u64> {
        let tolerance = interval.saturating_mul(u64::from(burst.max(1) - 1));
        let mut tat = self.tat.load(Ordering::Acquire);
        loop {
            let base = tat.max(now);
            let allowed_from = base.saturating_sub(tolerance);
            if now < allowed_from {
                return Err(allowed_from - now);
            }
            match self.tat.compare_exchange_weak(
                tat,
                base.saturating_add(interval),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(current) => tat = current,
            }
        }
    }
}

/// Per-entry lifetimes: a dedup window or a cache TTL, carried by the value.
struct PerEntry;

impl moka::Expiry<String, Duration> for PerEntry {
    fn expire_after_create(&self, _: &String, window: &Duration, _: Instant) -> Option<Duration> {
        Some(*window)
    }
}

#[derive(Clone)]
struct Stored {
    body: Bytes,
    ttl: Duration,
}

impl moka::Expiry<String, Stored> for PerEntry {
    fn expire_after_create(&self, _: &String, v: &Stored, _: Instant) -> Option<Duration> {
        Some(v.ttl)
    }
}

/// The in-memory dedup windows, at most `capacity` keys. The least recently
/// used goes first when full: moka's default policy (TinyLFU) refuses a new
/// key whose frequency is no higher than the keys it would push out, which
/// for once-seen dedup keys is every new key: a full store forgot new
/// requests (their duplicates ran again) and kept the old ones.
fn dedup_store(capacity: u64) -> Cache<String, Duration> {
    Cache::builder()
        .max_capacity(capacity)
        .eviction_policy(moka::policy::EvictionPolicy::lru())
        .expire_after(PerEntry)
        .build()
}

/// Governance state that outlives engine snapshots.
pub struct Governance {
    epoch: Instant,
    platform: crate::config::RateLimit,
    buckets: Cache<String, Arc<Bucket>>,
    seen: Cache<String, Duration>,
    responses: Cache<String, Stored>,
    /// `governance.backend = "redis"`: buckets, dedup windows and cached
    /// responses live there instead of in the caches above.
    shared: Option<Shared>,
    inflight: DashMap<String, Arc<AtomicU32>>,
    client_labels: DashMap<String, ()>,
    client_label_count: AtomicUsize,
}

impl std::fmt::Debug for Governance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Governance")
            .field("shared", &self.shared.is_some())
            .field("buckets", &self.buckets.entry_count())
            .field("dedup_keys", &self.seen.entry_count())
            .field("cached_responses", &self.responses.entry_count())
            .finish()
    }
}

/// The keys and verdicts of one request, computed before any I/O (the
/// request's arena is not `Send`, so nothing borrowed from it may live
/// across an await on the shared backend).
struct Keys {
    /// Full dedup key, window, fail_open.
    dedup: Option<(String, Duration, bool)>,
    /// Full key of the platform bucket.
    platform: Option<String>,
    /// Full key of the channel bucket, the client it meters and whether
    /// that client is a hashed `key_logic` value.
    rate: Option<(String, String, bool)>,
    /// `validation_logic`'s rejection message, applied in its turn.
    invalid: Option<String>,
    /// An async submission: the checks stop after validation.
    submit: bool,
    /// Full cache key and TTL.
    cache: Option<(String, Duration)>,
}

impl Governance {
    /// Governance state per `config`. The Redis connection is lazy: nothing
    /// is dialled until the first request that needs it, and a Redis that is
    /// down at start-up does not stop the service.
    pub fn new(config: &crate::config::Config) -> Governance {
        let shared = match config.governance.backend {
            crate::config::GovernanceBackend::Memory => None,
            crate::config::GovernanceBackend::Redis => Shared::new(&config.governance),
        };
        Governance {
            epoch: Instant::now(),
            platform: config.rate_limit.clone(),
            buckets: Cache::builder()
                .max_capacity(MAX_BUCKETS)
                .time_to_idle(BUCKET_IDLE)
                .build(),
            seen: dedup_store(MAX_DEDUP_KEYS),
            responses: Cache::builder()
                .max_capacity(MAX_CACHE_BYTES)
                .weigher(|k: &String, v: &Stored| {
                    u32::try_from(k.len() + v.body.len()).unwrap_or(u32::MAX)
                })
                .expire_after(PerEntry)
                .build(),
            shared,
            inflight: DashMap::new(),
            client_labels: DashMap::new(),
            client_label_count: AtomicUsize::new(0),
        }
    }

    /// The checks of [`Governance::admit`] run to completion in place, when
    /// nothing in them can wait: without a shared backend (Redis) they are
    /// synchronous, and their future is then never stored in the caller's
    /// (it is large; every request's future would carry and copy it).
    /// A channel with nothing to check is admitted at once, with or without
    /// a shared backend. `None` with a shared backend: await `admit` instead.
    pub fn admit_in_place(
        &self,
        channel: &Channel,
        view: &View<'_>,
        stage: Stage,
    ) -> Option<Result<Admitted, ApiError>> {
        if self.nothing_to_check(channel) {
            return Some(Ok(Admitted::default()));
        }
        if self.shared.is_some() {
            return None;
        }
        Some(
            futures_util::FutureExt::now_or_never(self.admit(channel, view, stage)).unwrap_or_else(
                || {
                    Err(ApiError::internal(
                        "the channel's checks waited without a shared backend",
                    ))
                },
            ),
        )
    }

    /// True when no check applies to the channel's requests: no platform
    /// limit, and the channel has no deduplication, rate limit, validation
    /// rule, backpressure or enabled cache: every caller (data plane,
    /// `channel_call`, async submissions) is admitted without building keys
    /// that would all be empty.
    fn nothing_to_check(&self, channel: &Channel) -> bool {
        let cfg = &channel.def.config_json;
        !self.platform.enabled
            && cfg.deduplication.is_none()
            && cfg.rate_limit.is_none()
            && channel.validation.is_none()
            && cfg.backpressure.is_none()
            && !cfg.cache.as_ref().is_some_and(|c| c.enabled)
    }

    /// Runs the channel's checks in the spec's order. A rejection by a later
    /// check gives the dedup key back, so a client that retries after a 429
    /// or 503 is not told its retry is a duplicate.
    pub async fn admit(
        &self,
        channel: &Channel,
        view: &View<'_>,
        stage: Stage,
    ) -> Result<Admitted, ApiError> {
        if self.nothing_to_check(channel) {
            return Ok(Admitted::default());
        }
        let keys = self.keys(channel, view, stage)?;

        // 1. Deduplication.
        let mut claimed = None;
        if let Some((key, window, fail_open)) = keys.dedup.as_ref() {
            // Whether the key is new, and whether this request now holds it.
            let (fresh, holds) = match &self.shared {
                None => {
                    let entry = self.seen.entry(key.clone()).or_insert(*window);
                    (entry.is_fresh(), true)
                }
                Some(shared) => match shared.claim(key, *window).await {
                    Ok(fresh) => (fresh, true),
                    Err(e) => {
                        shared.failed("deduplication", *fail_open, &e);
                        if !fail_open {
                            return Err(unavailable(channel, "deduplication"));
                        }
                        // Unchecked, so nothing is held: giving the key
                        // back would delete a claim another request (an
                        // earlier attempt of this client) holds.
                        (true, false)
                    }
                },
            };
            if !fresh {
                return Err(ApiError::new(
                    Code::Conflict,
                    format!(
                        "duplicate request: channel '{}' saw the same deduplication key within the last {} s",
                        channel.name,
                        window.as_secs()
                    ),
                ));
            }
            if holds {
                claimed = Some(key.as_str());
            }
        }
        let mut rest = self.admit_rest(channel, &keys).await;
        match (&mut rest, claimed) {
            (Err(_), Some(key)) => self.release(key).await,
            (Ok(admitted), Some(key)) => admitted.claimed = Some(key.to_owned()),
            _ => {}
        }
        rest
    }

    async fn release(&self, key: &str) {
        match &self.shared {
            None => self.seen.invalidate(key),
            Some(shared) => shared.release(key).await,
        }
    }

    /// Gives an admitted request's deduplication key back when nothing ran
    /// after all (no workflow matched, the body was refused): a retry is
    /// then not told it is a duplicate, as after a later check's refusal.
    pub async fn give_back(&self, admitted: &Admitted) {
        if let Some(key) = &admitted.claimed {
            self.release(key).await;
        }
    }

    /// Evaluates every key and the validation rule (pure, in one arena).
    fn keys(&self, channel: &Channel, view: &View<'_>, stage: Stage) -> Result<Keys, ApiError> {
        let arena = Bump::new();
        let rules = &channel.rules;
        let cfg = &channel.def.config_json;
        let needs_context = rules.rate_key.is_some()
            || rules.dedup_key.is_some()
            || rules.cache_key.is_some()
            || channel.validation.is_some();
        let parts = if needs_context {
            Some(Parts::new(view, &channel.name, &arena)?)
        } else {
            None
        };
        let key_of = |rule: &Option<Logic>| -> Option<String> {
            let (rule, parts) = (rule.as_ref()?, parts.as_ref()?);
            eval_key(rule, parts.key_root, &arena)
        };
        let dedup = cfg.deduplication.as_ref().and_then(|d| {
            let key = key_of(&rules.dedup_key).or_else(|| {
                view.headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(&d.header))
                    .map(|(_, v)| (*v).to_owned())
                    .filter(|v| !v.is_empty())
            })?;
            let key = compact_key(key);
            Some((
                format!("{}\0{key}", rules.dedup_scope),
                Duration::from_secs(d.window_secs),
                d.fail_open,
            ))
        });
        let platform = (self.platform.enabled && !view.internal)
            .then(|| format!("\0platform\0{}", view.client_ip));
        let rate = cfg.rate_limit.as_ref().map(|_| {
            let (client, hashed) = match key_of(&rules.rate_key) {
                Some(k) => (compact_key(k), true),
                None => (view.client_ip.to_owned(), false),
            };
            (format!("{}\0{client}", rules.rate_scope), client, hashed)
        });
        let invalid = match (&channel.validation, parts.as_ref()) {
            (Some(rule), Some(parts)) => match rule.eval(parts.validation_root, &arena) {
                Ok(v) if truthy(&v) => None,
                Ok(_) => Some(
                    "input validation failed: the channel's validation_logic rejected the request"
                        .to_owned(),
                ),
                Err(e) => Some(format!("input validation failed: {e}")),
            },
            _ => None,
        };
        let cache = match cfg.cache.as_ref().filter(|c| c.enabled) {
            Some(c) if stage == Stage::Run && !view.profile => {
                // The method is part of every key: a `key_logic` names
                // which requests of one method share an answer (a HEAD's
                // answer, or a GET's, is no answer to a POST).
                let key = compact_key(match key_of(&rules.cache_key) {
                    Some(k) => format!("{} {k}", view.method),
                    None => default_cache_key(view),
                });
                let kind = if view.internal { "call" } else { "http" };
                // The versions this bucket runs; a request without a bucket
                // runs whichever plan comes first, its own variant.
                let variant = match (&rules.cache_variants, view.bucket) {
                    (None, _) => String::new(),
                    (Some(table), Some(b)) => format!("#{}", table[usize::from(b.min(99))]),
                    (Some(_), None) => "#any".to_owned(),
                };
                Some((
                    format!("{}{variant}\0{kind}\0{key}", rules.cache_scope),
                    Duration::from_secs(c.ttl_secs),
                ))
            }
            _ => None,
        };
        Ok(Keys {
            dedup,
            platform,
            rate,
            invalid,
            submit: stage == Stage::Submit,
            cache,
        })
    }

    async fn admit_rest(&self, channel: &Channel, keys: &Keys) -> Result<Admitted, ApiError> {
        let cfg = &channel.def.config_json;

        // 2. Rate limits: the platform's (outside clients only), then the channel's.
        if let Some(key) = &keys.platform {
            let rps = self.platform.requests_per_second.max(1) as f64;
            let burst = u32::try_from(self.platform.burst.max(1)).unwrap_or(u32::MAX);
            let client = &key["\0platform\0".len()..];
            if let Err(wait) = self
                .take(
                    channel,
                    key,
                    rps,
                    burst,
                    self.platform.fail_open,
                    "the platform rate limit",
                )
                .await?
            {
                return Err(self.limited("platform", channel, client, false, wait));
            }
        }
        if let (Some(rl), Some((key, client, hashed))) = (&cfg.rate_limit, &keys.rate)
            && let Err(wait) = self
                .take(
                    channel,
                    key,
                    rl.requests_per_second,
                    rl.effective_burst(),
                    rl.fail_open,
                    "the rate limit",
                )
                .await?
        {
            return Err(self.limited("channel", channel, client, *hashed, wait));
        }

        // 3. validation_logic over {data, headers, query, path}.
        if let Some(message) = &keys.invalid {
            return Err(ApiError::bad_request(message.clone()));
        }
        if keys.submit || (keys.cache.is_none() && cfg.backpressure.is_none()) {
            return Ok(Admitted::default());
        }

        // 4. Backpressure: a per-channel counter of running requests (per
        // replica, like circuit breakers: it bounds this process's work).
        let mut admitted = Admitted::default();
        if let Some(bp) = &cfg.backpressure {
            let counter = match self.inflight.get(&channel.name) {
                Some(c) => c.clone(),
                None => self
                    .inflight
                    .entry(channel.name.clone())
                    .or_default()
                    .clone(),
            };
            let before = counter.fetch_add(1, Ordering::AcqRel);
            let slot = Slot(counter);
            if before >= bp.max_concurrent {
                drop(slot);
                return Err(ApiError::new(
                    Code::ServiceUnavailable,
                    format!(
                        "channel '{}' is at its concurrency limit ({}); retry shortly",
                        channel.name, bp.max_concurrent
                    ),
                )
                .with_retry_after(BACKPRESSURE_RETRY_SECS));
            }
            admitted._slot = Some(slot);
        }

        // 5. Response cache lookup (a backend failure is a miss).
        if let Some((key, ttl)) = &keys.cache {
            let hit = match &self.shared {
                None => self.responses.get(key).map(|s| s.body),
                Some(shared) => match shared.cached(key).await {
                    Ok(hit) => hit,
                    Err(e) => {
                        shared.failed("cache_read", true, &e);
                        None
                    }
                },
            };
            match hit {
                Some(body) => admitted.hit = Some(body),
                None => admitted.store_as = Some((key.clone(), *ttl)),
            }
        }
        Ok(admitted)
    }

    /// Stores a successful response for the cache key the request was
    /// admitted with (a no-op when the channel does not cache). With Redis
    /// the write is awaited (one round trip, bounded by
    /// `governance.timeout_ms`), so the next request on any replica sees it.
    pub async fn store(&self, admitted: &Admitted, body: Bytes) {
        let Some((key, ttl)) = &admitted.store_as else {
            return;
        };
        match &self.shared {
            None => self
                .responses
                .insert(key.clone(), Stored { body, ttl: *ttl }),
            Some(shared) => {
                if let Err(e) = shared.cache(key, &body, *ttl).await {
                    shared.failed("cache_write", true, &e);
                }
            }
        }
    }

    /// Takes a token from the bucket under `key`: `Ok(Ok(()))` admitted,
    /// `Ok(Err(ns))` limited for `ns` more nanoseconds, `Err` when the shared
    /// backend is unreachable and the limit fails closed.
    async fn take(
        &self,
        channel: &Channel,
        key: &str,
        rps: f64,
        burst: u32,
        fail_open: bool,
        check: &str,
    ) -> Result<Result<(), u64>, ApiError> {
        let interval = if rps > 0.0 {
            (1e9 / rps).max(1.0) as u64
        } else {
            u64::MAX
        };
        let Some(shared) = &self.shared else {
            let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let bucket = self.buckets.get_with_by_ref(key, Arc::default);
            return Ok(bucket.take(now, interval, burst));
        };
        match shared.take(key, interval, burst).await {
            Ok(verdict) => Ok(verdict),
            Err(e) => {
                shared.failed("rate_limit", fail_open, &e);
                if fail_open {
                    Ok(Ok(()))
                } else {
                    Err(unavailable(channel, check))
                }
            }
        }
    }

    fn limited(
        &self,
        limit: &'static str,
        channel: &Channel,
        client: &str,
        hashed: bool,
        wait_ns: u64,
    ) -> ApiError {
        let label = self.client_label(client, hashed);
        metrics::counter!(
            crate::telemetry::names::RATE_LIMIT_REJECTIONS_TOTAL,
            "client" => label,
            "channel" => channel.name.clone(),
            "limit" => limit,
        )
        .increment(1);
        let secs = wait_ns.div_ceil(1_000_000_000).max(1);
        let which = if limit == "platform" {
            "the platform rate limit".to_owned()
        } else {
            format!("the rate limit of channel '{}'", channel.name)
        };
        ApiError::new(
            Code::RateLimited,
            format!("too many requests: {which} is exhausted; retry in {secs} s"),
        )
        .with_retry_after(secs)
    }

    /// The `client` label: the client IP, or a short hash of a `key_logic`
    /// key (which may be derived from a credential and must not be exposed);
    /// only the first [`MAX_CLIENT_LABELS`] distinct values get their own
    /// series, later ones are `other`.
    fn client_label(&self, client: &str, hashed: bool) -> String {
        let label = if hashed {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            client.hash(&mut h);
            format!("key:{:08x}", h.finish() as u32)
        } else {
            client.chars().take(64).collect()
        };
        if self.client_labels.contains_key(&label) {
            return label;
        }
        if self.client_label_count.fetch_add(1, Ordering::AcqRel) < MAX_CLIENT_LABELS {
            self.client_labels.insert(label.clone(), ());
            label
        } else {
            self.client_label_count.fetch_sub(1, Ordering::AcqRel);
            "other".to_owned()
        }
    }
}

/// The 503 of a check that cannot reach the shared backend and fails closed.
fn unavailable(channel: &Channel, check: &str) -> ApiError {
    ApiError::new(
        Code::ServiceUnavailable,
        format!(
            "channel '{}' cannot check {check}: the shared governance backend is unreachable; retry shortly",
            channel.name
        ),
    )
    .with_retry_after(1)
}

/// A `governance_backend_errors_total` warning is logged at most this often
/// (a Redis outage fails every request; one line per second says enough).
const WARN_EVERY_NANOS: u64 = 1_000_000_000;

/// GCRA in one round trip, on Redis's clock (so replicas with skewed clocks
/// share one timeline). KEYS[1]: the bucket; ARGV: emission interval and
/// tolerance (interval × (burst − 1)), both in µs. Returns 0 when a token was
/// taken, else the µs until one is available. The TAT is stored with a TTL
/// of its distance from now, so idle buckets vanish.
const GCRA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local allowed_from = tat - tolerance
if now < allowed_from then return allowed_from - now end
local new_tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', math.ceil((new_tat - now) / 1000) + 1)
return 0
";

/// The Redis side of governance: one multiplexed connection (the redis
/// crate's `ConnectionManager` reconnects on its own), every call bounded by
/// `governance.timeout_ms`.
struct Shared {
    conn: redis::aio::ConnectionManager,
    prefix: String,
    timeout: Duration,
    gcra: redis::Script,
    epoch: Instant,
    last_warn: AtomicU64,
}

type SharedResult<T> = Result<T, String>;

impl Shared {
    fn new(cfg: &crate::config::GovernanceCfg) -> Option<Shared> {
        // The URL was checked when the configuration was loaded; a
        // `rediss://` one needs the process's TLS provider.
        crate::connectors::http::install_crypto_provider();
        let client = redis::Client::open(cfg.redis_url.trim()).ok()?;
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1);
        let conn = redis::aio::ConnectionManager::new_lazy_with_config(client, config).ok()?;
        Some(Shared {
            conn,
            prefix: cfg.key_prefix.clone(),
            timeout,
            gcra: redis::Script::new(GCRA),
            epoch: Instant::now(),
            last_warn: AtomicU64::new(0),
        })
    }

    async fn run<T>(
        &self,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> SharedResult<T> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} ms", self.timeout.as_millis())),
        }
    }

    fn key(&self, kind: &str, key: &str) -> String {
        format!("{}:{kind}:{key}", self.prefix)
    }

    /// `SET NX PX`: true when the key was new (the request is not a duplicate).
    async fn claim(&self, key: &str, window: Duration) -> SharedResult<bool> {
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.key("dedup", key))
            .arg(1)
            .arg("NX")
            .arg("PX")
            .arg(u64::try_from(window.as_millis()).unwrap_or(u64::MAX));
        let set: Option<String> = self.run(cmd.query_async(&mut conn)).await?;
        Ok(set.is_some())
    }

    /// Gives a dedup key back (best effort: at worst the window stays).
    async fn release(&self, key: &str) {
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("DEL");
        cmd.arg(self.key("dedup", key));
        if let Err(e) = self.run(cmd.query_async::<i64>(&mut conn)).await {
            self.failed("deduplication_release", true, &e);
        }
    }

    /// One GCRA step; the verdict as in `Bucket::take` (nanoseconds).
    async fn take(&self, key: &str, interval_ns: u64, burst: u32) -> SharedResult<Result<(), u64>> {
        let interval = (interval_ns / 1000).max(1);
        let tolerance = interval.saturating_mul(u64::from(burst.max(1) - 1));
        let mut conn = self.conn.clone();
        let mut call = self.gcra.key(self.key("rate", key));
        call.arg(interval).arg(tolerance);
        let wait_us: i64 = self.run(call.invoke_async(&mut conn)).await?;
        Ok(match u64::try_from(wait_us) {
            Ok(0) | Err(_) => Ok(()),
            Ok(us) => Err(us.saturating_mul(1000)),
        })
    }

    async fn cached(&self, key: &str) -> SharedResult<Option<Bytes>> {
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.key("cache", key));
        let body: Option<Vec<u8>> = self.run(cmd.query_async(&mut conn)).await?;
        Ok(body.map(Bytes::from))
    }

    async fn cache(&self, key: &str, body: &[u8], ttl: Duration) -> SharedResult<()> {
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.key("cache", key))
            .arg(body)
            .arg("PX")
            .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
        self.run(cmd.query_async::<()>(&mut conn)).await
    }

    /// Counts a backend failure and logs it (at most once a second).
    fn failed(&self, operation: &'static str, fail_open: bool, error: &str) {
        let direction = if fail_open { "open" } else { "closed" };
        metrics::counter!(
            crate::telemetry::names::GOVERNANCE_BACKEND_ERRORS_TOTAL,
            "operation" => operation,
            "direction" => direction,
        )
        .increment(1);
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let last = self.last_warn.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= WARN_EVERY_NANOS)
            && self
                .last_warn
                .compare_exchange(last, now.max(1), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                operation,
                direction,
                error,
                "governance backend (redis) unreachable; the check fails {direction}"
            );
        }
    }
}

/// A consumed Kafka message through the channel's `validation_logic`, over
/// `{data, headers, query: {}, path: {}}` as a request's: the refusal's
/// message, or `None` when it passes (or the channel has no rule).
pub fn validate_message(
    channel: &Channel,
    data: &serde_json::Value,
    headers: &serde_json::Map<String, serde_json::Value>,
) -> Option<String> {
    let rule = channel.validation.as_ref()?;
    let arena = Bump::new();
    let root = serde_json::json!({"data": data, "headers": headers, "query": {}, "path": {}});
    let root = Value::copy_json(&root, &arena);
    match rule.eval(root, &arena) {
        Ok(v) if truthy(&v) => None,
        Ok(_) => Some(
            "input validation failed: the channel's validation_logic rejected the message"
                .to_owned(),
        ),
        Err(e) => Some(format!("input validation failed: {e}")),
    }
}

/// The `key_logic` and `validation_logic` inputs of one request, built once
/// in the request's arena.
struct Parts<'a> {
    key_root: Value<'a>,
    validation_root: Value<'a>,
}

impl<'a> Parts<'a> {
    fn new(view: &View<'_>, channel: &str, arena: &'a Bump) -> Result<Parts<'a>, ApiError> {
        let data = if view.body.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            let parsed = sluice_runtime::json::parse(view.body, arena)
                // Worded as the run's own refusal of the body, so a channel
                // with checks answers a bad body as one without them does.
                .map_err(|e| {
                    ApiError::bad_request(
                        sluice_runtime::exec::InputError::NotJson(e.0).to_string(),
                    )
                })?;
            if view.internal {
                parsed
            } else {
                parsed.get("data").unwrap_or(Value::Null)
            }
        };
        let pairs = |items: &[(&str, &str)]| {
            Value::Object(
                arena.alloc_slice_fill_iter(
                    items
                        .iter()
                        .map(|(k, v)| (&*arena.alloc_str(k), Value::Str(arena.alloc_str(v)))),
                ),
            )
        };
        let (headers, query, path) = (pairs(view.headers), pairs(view.query), pairs(view.path));
        Ok(Parts {
            key_root: Value::Object(arena.alloc_slice_copy(&[
                ("client_ip", Value::Str(arena.alloc_str(view.client_ip))),
                ("channel", Value::Str(arena.alloc_str(channel))),
                ("headers", headers),
                ("query", query),
                ("path", path),
                ("data", data),
            ])),
            validation_root: Value::Object(arena.alloc_slice_copy(&[
                ("data", data),
                ("headers", headers),
                ("query", query),
                ("path", path),
            ])),
        })
    }
}

/// Keys longer than this are kept as their SHA-256 digest.
const MAX_KEY_BYTES: usize = 128;

/// A key as the governance stores keep it: as it is when short, else its
/// SHA-256 digest (hex), so a caller who controls a key (a body member, a
/// header, the body itself for the cache) cannot make each entry of a
/// bounded store megabytes large. A cryptographic digest, so that no one
/// can craft a request whose key collides with another caller's.
fn compact_key(key: String) -> String {
    if key.len() <= MAX_KEY_BYTES {
        return key;
    }
    format!("sha256:{}", crate::storage::digest(&key))
}

/// A `key_logic` result as a key: strings as they are, other values as JSON
/// text; null, an empty string or an evaluation error mean "no key" (the
/// check then falls back to its default key).
fn eval_key(rule: &Logic, root: Value<'_>, arena: &Bump) -> Option<String> {
    match rule.eval(root, arena).ok()? {
        Value::Null => None,
        Value::Str("") => None,
        Value::Str(s) => Some(s.to_owned()),
        other => {
            let mut out = Vec::new();
            other.write_json(&mut out);
            String::from_utf8(out).ok()
        }
    }
}

/// The default cache key: method, path, query and body. The decoded query
/// names and values are escaped where they hold the key's own separators
/// (`%`, `&`, `=`, a line feed), so two different queries never make one
/// key: `?a=1&b=2` and `?a=1%26b=2` did.
fn default_cache_key(view: &View<'_>) -> String {
    fn push_escaped(key: &mut String, text: &str) {
        for c in text.chars() {
            match c {
                '%' => key.push_str("%25"),
                '&' => key.push_str("%26"),
                '=' => key.push_str("%3D"),
                '\n' => key.push_str("%0A"),
                c => key.push(c),
            }
        }
    }
    let mut key = String::with_capacity(view.target.len() + view.body.len() + 32);
    key.push_str(view.method);
    key.push(' ');
    key.push_str(view.target);
    key.push('?');
    for (i, (k, v)) in view.query.iter().enumerate() {
        if i > 0 {
            key.push('&');
        }
        push_escaped(&mut key, k);
        key.push('=');
        push_escaped(&mut key, v);
    }
    key.push('\n');
    key.push_str(&String::from_utf8_lossy(view.body));
    key
}

// ------------------------------------------------------------------ CORS

/// Whether `origin` is on the channel's allowlist (`*` allows any).
fn origin_allowed(channel: &Channel, origin: &str) -> bool {
    channel.def.config_json.cors.as_ref().is_some_and(|c| {
        c.allowed_origins
            .iter()
            .any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
    })
}

/// Adds the CORS headers of an allowed origin to a data-plane response; a
/// disallowed (or absent) origin gets none, and the browser blocks it. Every
/// answer of a channel with CORS settings carries `Vary: Origin`, allowed or
/// not, so a shared cache never hands one origin's answer to another. The
/// `Origin` header is looked up only for a channel with CORS settings.
pub fn decorate(channel: &Channel, request: &http::HeaderMap, response: &mut HttpResponse) {
    if channel.def.config_json.cors.is_none() {
        return;
    }
    let headers = response.headers_mut();
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
    let origin = request.get(header::ORIGIN).and_then(|v| v.to_str().ok());
    let Some(origin) = origin.filter(|o| origin_allowed(channel, o)) else {
        return;
    };
    let Ok(value) = HeaderValue::from_str(origin) else {
        return;
    };
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, value);
    headers.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("x-request-id, retry-after, x-cache"),
    );
}

/// Answers a preflight (`OPTIONS` with `Access-Control-Request-Method`) for
/// a resolved channel: 204 with the allowances, or 403 when the channel does
/// not allow the origin or the method.
pub fn preflight(
    channel: &Channel,
    origin: Option<&str>,
    method: &str,
    by_name: bool,
) -> HttpResponse {
    let cors = channel.def.config_json.cors.as_ref();
    let (Some(cors), Some(origin)) = (cors, origin) else {
        return refuse_preflight(channel, "CORS is not enabled for this origin");
    };
    if !origin_allowed(channel, origin) {
        return refuse_preflight(channel, "origin is not allowed");
    }
    let methods: Vec<String> = match &cors.allowed_methods {
        // Called by name, a channel takes POST alone, whatever else its
        // route (or its CORS settings) would allow.
        Some(m) if by_name => m
            .iter()
            .filter(|m| m.eq_ignore_ascii_case("POST"))
            .cloned()
            .collect(),
        _ if by_name => vec!["POST".to_owned()],
        Some(m) => m.clone(),
        None if channel.def.route_pattern.is_some() => channel
            .def
            .methods
            .iter()
            .map(|m| m.as_str().to_owned())
            .collect(),
        None => vec!["POST".to_owned()],
    };
    if !methods.iter().any(|m| m.eq_ignore_ascii_case(method)) {
        return refuse_preflight(channel, "method is not allowed");
    }
    let mut response = crate::api::no_content().unwrap_or_else(ApiError::into_response);
    // Unset: the headers a caller of this service is invited to send (the
    // request id, trace context, the profile switch, the dedup key header).
    let allowed_headers = cors.allowed_headers.as_ref().map_or_else(
        || {
            let mut list = String::from(
                "content-type, x-request-id, traceparent, tracestate, x-service-profile",
            );
            let dedup = channel.def.config_json.deduplication.as_ref();
            list.push_str(", ");
            list.push_str(dedup.map_or("idempotency-key", |d| d.header.as_str()));
            list
        },
        |h| h.join(", "),
    );
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(origin) {
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
    if let Ok(v) = HeaderValue::from_str(&methods.join(", ")) {
        headers.insert(header::ACCESS_CONTROL_ALLOW_METHODS, v);
    }
    if let Ok(v) = HeaderValue::from_str(&allowed_headers) {
        headers.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, v);
    }
    if let Some(age) = cors.max_age_secs {
        headers.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from(age));
    }
    response
}

/// A refused preflight: 403 naming the channel and why, with `Vary: Origin`.
pub fn refuse_preflight(channel: &Channel, why: &str) -> HttpResponse {
    let mut response = ApiError::new(
        Code::Forbidden,
        format!(
            "CORS preflight refused by channel '{}': {why}",
            channel.name
        ),
    )
    .into_response();
    *response.status_mut() = StatusCode::FORBIDDEN;
    // The refusal depends on the origin as much as an allowance does.
    response
        .headers_mut()
        .append(header::VARY, HeaderValue::from_static("Origin"));
    response
}

#[cfg(test)]
mod tests {
    use super::Bucket;

    #[test]
    fn long_keys_are_kept_as_their_digest() {
        let short = "u-42".to_owned();
        assert_eq!(super::compact_key(short.clone()), short);
        let at_limit = "k".repeat(super::MAX_KEY_BYTES);
        assert_eq!(super::compact_key(at_limit.clone()), at_limit);
        let (a, b) = (
            "a".repeat(1 << 20),
            format!("{}b", "a".repeat((1 << 20) - 1)),
        );
        let (ka, kb) = (super::compact_key(a.clone()), super::compact_key(b));
        assert!(ka.starts_with("sha256:") && ka.len() == 7 + 64, "{ka}");
        assert_ne!(ka, kb);
        // Stable: the same key (on any replica) gives the same digest.
        assert_eq!(ka, super::compact_key(a));
    }

    /// A full dedup store keeps each new key (forgetting the least recently
    /// used), so a duplicate of a recent request is still caught.
    #[test]
    fn a_full_dedup_store_keeps_new_keys() {
        let seen = super::dedup_store(50);
        let window = std::time::Duration::from_secs(300);
        for i in 0..50 {
            seen.insert(format!("old-{i}"), window);
        }
        seen.run_pending_tasks();
        for i in 0..200 {
            let key = format!("new-{i}");
            assert!(seen.entry(key.clone()).or_insert(window).is_fresh());
            seen.run_pending_tasks();
            assert!(seen.contains_key(&key), "new key {i} was not kept");
            assert!(!seen.entry(key).or_insert(window).is_fresh());
        }
        assert!(seen.entry_count() <= 50, "{}", seen.entry_count());
    }

    #[test]
    fn the_bucket_allows_the_burst_then_refills_at_the_rate() {
        let b = Bucket::default();
        let sec = 1_000_000_000;
        // burst 2 at 1 per second, starting at t = 10 s.
        assert!(b.take(10 * sec, sec, 2).is_ok());
        assert!(b.take(10 * sec, sec, 2).is_ok());
        assert_eq!(b.take(10 * sec, sec, 2), Err(sec));
        assert!(b.take(11 * sec, sec, 2).is_ok());
        assert!(b.take(11 * sec, sec, 2).is_err());
        // Long idle: full again, but never more than the burst.
        assert!(b.take(100 * sec, sec, 2).is_ok());
        assert!(b.take(100 * sec, sec, 2).is_ok());
        assert!(b.take(100 * sec, sec, 2).is_err());
    }
}
