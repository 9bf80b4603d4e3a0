//! The one call policy every connector call goes through: the circuit breaker
//! of `<channel>:<connector>` and retries of retryable failures with
//! exponential backoff.
//!
//! Breakers live here, outside the engine snapshot, so a reload neither
//! resets nor duplicates them. Each breaker is a small atomic state machine:
//! the request path reads one atomic to be admitted and never takes a lock
//! of its own; the bounded (LRU) map of breakers is a concurrent cache.

use crate::config;
use crate::telemetry::names;
use serde_json::{Value as Json, json};
use sluice_compiler::def::RetryPolicy;
use sluice_runtime::connectors::{CallScope, ConnectorError, ConnectorErrorKind};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const CLOSED: u8 = 0;
const OPEN: u8 = 1;
const HALF_OPEN: u8 = 2;

fn state_name(state: u8) -> &'static str {
    match state {
        OPEN => "open",
        HALF_OPEN => "half_open",
        _ => "closed",
    }
}

/// The delay before retry number `retry` (0-based): `retry_delay_ms`
/// doubled per retry, capped at 60 s.
pub fn backoff(policy: &RetryPolicy, retry: u32) -> Duration {
    let factor = 1u64.checked_shl(retry.min(63)).unwrap_or(u64::MAX);
    let ms = policy
        .retry_delay_ms
        .saturating_mul(factor)
        .min(RetryPolicy::MAX_DELAY_MS);
    Duration::from_millis(ms)
}

/// One breaker. `opened_at` is kept twice: monotonic (for the cooldown, immune
/// to clock changes) and wall-clock (for the admin listing).
pub struct Breaker {
    key: String,
    channel: String,
    connector: String,
    state: AtomicU8,
    failures: AtomicU32,
    /// Milliseconds since [`Breakers::base`] when the breaker last opened.
    opened_mono_ms: AtomicU64,
    /// Unix milliseconds when the breaker last opened (0: never).
    opened_wall_ms: AtomicU64,
}

impl Breaker {
    fn new(channel: &str, connector: &str) -> Breaker {
        Breaker {
            key: format!("{channel}:{connector}"),
            channel: channel.to_owned(),
            connector: connector.to_owned(),
            state: AtomicU8::new(CLOSED),
            failures: AtomicU32::new(0),
            opened_mono_ms: AtomicU64::new(0),
            opened_wall_ms: AtomicU64::new(0),
        }
    }

    /// The stored state (the admin view and spans use [`Breakers::state_now`]).
    #[cfg(test)]
    fn state(&self) -> &'static str {
        state_name(self.state.load(Ordering::Acquire))
    }

    /// The admin view: `{key, channel, connector, state, consecutive_failures, opened_at?}`,
    /// showing `state` (from [`Breakers::state_now`]).
    fn to_json(&self, state: u8) -> Json {
        let mut v = json!({
            "key": self.key,
            "channel": self.channel,
            "connector": self.connector,
            "state": state_name(state),
            "consecutive_failures": self.failures.load(Ordering::Relaxed),
        });
        let wall = self.opened_wall_ms.load(Ordering::Relaxed);
        if state != CLOSED && wall > 0 {
            v["opened_at"] = Json::String(rfc3339_ms(wall));
        }
        v
    }
}

fn rfc3339_ms(unix_ms: u64) -> String {
    let nanos = i128::from(unix_ms) * 1_000_000;
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The breakers of the process, LRU-bounded by `engine.circuit_breaker.max_breakers`.
pub struct Breakers {
    enabled: bool,
    threshold: u32,
    recovery: Duration,
    base: Instant,
    map: moka::sync::Cache<String, Arc<Breaker>>,
}

impl Breakers {
    pub fn new(cfg: &config::CircuitBreaker) -> Breakers {
        Breakers {
            enabled: cfg.enabled,
            // 0 would open on success; treat it as "the first failure opens".
            threshold: cfg.failure_threshold.max(1),
            recovery: Duration::from_secs(cfg.recovery_timeout_secs),
            base: Instant::now(),
            map: moka::sync::Cache::builder()
                .max_capacity(cfg.max_breakers.max(1))
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .build(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.base.elapsed().as_millis() as u64
    }

    /// The breaker of `channel:connector`, created closed on first use; `None`
    /// when breakers are disabled.
    fn breaker(&self, channel: &str, connector: &str) -> Option<Arc<Breaker>> {
        if !self.enabled {
            return None;
        }
        let key = format!("{channel}:{connector}");
        let entry = self
            .map
            .entry(key)
            .or_insert_with(|| Arc::new(Breaker::new(channel, connector)));
        if entry.is_fresh() {
            // A new breaker: apply the uses buffered since the last pass and
            // evict now, so the least recently used one goes (moka would
            // otherwise evict later, by the order it had applied by then)
            // and the map never holds more than `max_breakers`.
            self.map.run_pending_tasks();
        }
        Some(entry.into_value())
    }

    /// Every breaker, sorted by key. moka evicts in its maintenance pass,
    /// which runs now, so the list never shows more than `max_breakers`
    /// (before, breakers over the bound stayed listed until a later pass,
    /// hundreds of calls on).
    pub fn list(&self) -> Vec<Json> {
        self.map.run_pending_tasks();
        let mut all: Vec<Arc<Breaker>> = self.map.iter().map(|(_, b)| b).collect();
        all.sort_by(|a, b| a.key.cmp(&b.key));
        all.iter().map(|b| b.to_json(self.state_now(b))).collect()
    }

    /// Whether `b`'s cooldown since it last opened has elapsed.
    fn cooled(&self, b: &Breaker) -> bool {
        let opened = b.opened_mono_ms.load(Ordering::Acquire);
        self.now_ms().saturating_sub(opened) >= self.recovery.as_millis() as u64
    }

    /// The state a call would meet now: an open breaker whose cooldown has
    /// elapsed is half-open (the spec's `open → half-open` on the cooldown),
    /// since its next call is the probe. The stored state moves when that
    /// call arrives; readers see the transition as soon as it is due.
    fn state_now(&self, b: &Breaker) -> u8 {
        match b.state.load(Ordering::Acquire) {
            OPEN if self.cooled(b) => HALF_OPEN,
            state => state,
        }
    }

    /// Forgets every breaker of `connector` (it was deleted: a connector
    /// created later under the same name starts closed, and the listing no
    /// longer shows what cannot be called).
    pub fn forget_connector(&self, connector: &str) {
        self.forget_where(|b| b.connector == connector);
    }

    /// Forgets every breaker of channel `name` (it was deleted: a channel
    /// created later under that name starts with closed breakers, as a
    /// connector does).
    pub fn forget_channel(&self, name: &str) {
        self.forget_where(|b| b.channel == name);
    }

    fn forget_where(&self, forget: impl Fn(&Breaker) -> bool) {
        let keys: Vec<String> = self
            .map
            .iter()
            .filter(|(_, b)| forget(b))
            .map(|(k, _)| (*k).clone())
            .collect();
        for key in keys {
            self.map.invalidate(&key);
        }
    }

    /// Resets one breaker to closed: its admin view before and after, or
    /// `None` for an unknown key.
    pub fn reset(&self, key: &str) -> Option<(Json, Json)> {
        let b = self.map.get(key)?;
        let before = b.to_json(self.state_now(&b));
        b.failures.store(0, Ordering::Relaxed);
        b.opened_wall_ms.store(0, Ordering::Relaxed);
        b.state.store(CLOSED, Ordering::Release);
        Some((before, b.to_json(CLOSED)))
    }

    /// Admits a call, or rejects it (counted) while the breaker is open or
    /// its one half-open probe is in flight.
    fn admit<'a>(&'a self, b: &Arc<Breaker>) -> Result<Permit<'a>, ConnectorError> {
        loop {
            match b.state.load(Ordering::Acquire) {
                CLOSED => return Ok(self.permit(b, false)),
                OPEN => {
                    let cooled = self.cooled(b);
                    // Exactly one caller wins the OPEN → HALF_OPEN exchange and
                    // becomes the probe; the others see HALF_OPEN and are rejected.
                    if cooled
                        && b.state
                            .compare_exchange(OPEN, HALF_OPEN, Ordering::AcqRel, Ordering::Acquire)
                            .is_ok()
                    {
                        return Ok(self.permit(b, true));
                    }
                    if !cooled {
                        return Err(self.reject(b));
                    }
                    // Lost the race: look again (the winner made it half-open).
                }
                _ => return Err(self.reject(b)),
            }
        }
    }

    fn permit<'a>(&'a self, b: &Arc<Breaker>, probe: bool) -> Permit<'a> {
        Permit {
            breakers: self,
            breaker: b.clone(),
            probe,
            done: false,
        }
    }

    fn reject(&self, b: &Breaker) -> ConnectorError {
        metrics::counter!(names::CIRCUIT_BREAKER_REJECTIONS_TOTAL,
            "connector" => b.connector.clone(), "channel" => b.channel.clone())
        .increment(1);
        ConnectorError::new(
            ConnectorErrorKind::CircuitOpen,
            format!(
                "the circuit breaker '{}' is open; connector '{}' is not called until it recovers",
                b.key, b.connector
            ),
        )
    }

    /// Opens `b` with a fresh cooldown and counts the trip. The timestamps
    /// are written before the state so no reader sees OPEN with a stale time.
    fn open(&self, b: &Breaker) {
        b.opened_mono_ms.store(self.now_ms(), Ordering::Release);
        b.opened_wall_ms.store(unix_ms(), Ordering::Relaxed);
        b.state.store(OPEN, Ordering::Release);
        metrics::counter!(names::CIRCUIT_BREAKER_TRIPS_TOTAL,
            "connector" => b.connector.clone(), "channel" => b.channel.clone())
        .increment(1);
        tracing::warn!(breaker = %b.key, "circuit breaker opened");
    }
}

/// One admitted call. Dropping it without an outcome (the call's future was
/// cancelled, e.g. by the channel deadline) counts as a failure for a probe,
/// so a half-open breaker can never stay stuck waiting for a lost probe.
struct Permit<'a> {
    breakers: &'a Breakers,
    breaker: Arc<Breaker>,
    probe: bool,
    done: bool,
}

impl Permit<'_> {
    /// Records the outcome: only failures that say something about the remote
    /// system's health (the retryable ones) count against the breaker; a 4xx
    /// or a misconfiguration means the remote answered or was never asked.
    fn finish(mut self, failed: bool) {
        self.done = true;
        let (breakers, b) = (self.breakers, &self.breaker);
        if !failed {
            // A success admitted before the breaker opened (a slow call
            // answering late) leaves an open breaker's count alone: the
            // listing would show it open with no failures (audit 67).
            if self.probe || b.state.load(Ordering::Acquire) == CLOSED {
                b.failures.store(0, Ordering::Relaxed);
            }
            if self.probe {
                b.state.store(CLOSED, Ordering::Release);
                tracing::info!(breaker = %b.key, "circuit breaker closed after a successful probe");
            }
            return;
        }
        if self.probe {
            b.failures.fetch_add(1, Ordering::AcqRel);
            breakers.open(b);
        } else {
            breakers.failed(b);
        }
    }
}

impl Breakers {
    /// Counts one failure outside a probe; the one that reaches the
    /// threshold while closed trips the breaker.
    fn failed(&self, b: &Arc<Breaker>) {
        let n = b.failures.fetch_add(1, Ordering::AcqRel).saturating_add(1);
        if n >= self.threshold
            && b.state.load(Ordering::Acquire) == CLOSED
            && b.state
                .compare_exchange(CLOSED, HALF_OPEN, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            // Parked in HALF_OPEN (which rejects) while the timestamps are
            // written; `open` then publishes OPEN. One thread trips, once.
            self.open(b);
        }
    }
}

impl Drop for Permit<'_> {
    /// A call dropped without an outcome: abandoned at the execution
    /// deadline, it failed (the remote did not answer in time); dropped
    /// because the client went away or the service is stopping, it says
    /// nothing about the remote, and a probe's slot is given back (the next
    /// call probes).
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let b = &self.breaker;
        if sluice_runtime::exec::abandoned_at_deadline() {
            if self.probe {
                b.failures.fetch_add(1, Ordering::AcqRel);
                self.breakers.open(b);
            } else {
                self.breakers.failed(b);
            }
        } else if self.probe {
            // Still cooled down: the next call is the probe.
            b.state.store(OPEN, Ordering::Release);
        }
    }
}

/// The shared machinery: breakers plus the retry loop.
pub struct Policy {
    pub breakers: Breakers,
}

impl Policy {
    pub fn new(cfg: &config::CircuitBreaker) -> Policy {
        Policy {
            breakers: Breakers::new(cfg),
        }
    }

    /// Runs `op` under the breaker of `<scope.channel>:<connector>`, retrying
    /// retryable failures up to `retry.max_retries` times with exponential
    /// backoff. The breaker admits the call and counts its outcome once; one
    /// that other calls open during the retries stops them.
    pub async fn call<T, F, Fut>(
        &self,
        scope: &CallScope,
        connector: &str,
        retry: &RetryPolicy,
        op: F,
    ) -> Result<T, ConnectorError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ConnectorError>>,
    {
        self.call_as(scope, "call", connector, retry, op).await
    }

    /// [`Policy::call`] for the named `function`; when the request is traced
    /// (OpenTelemetry), the call is recorded as a span with its retry count
    /// and breaker state.
    pub async fn call_as<T, F, Fut>(
        &self,
        scope: &CallScope,
        function: &'static str,
        connector: &str,
        retry: &RetryPolicy,
        op: F,
    ) -> Result<T, ConnectorError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ConnectorError>>,
    {
        let Some(span) = crate::otel::begin_call(scope, function, connector) else {
            return self.attempts(scope, connector, retry, op).await.0;
        };
        let (result, retries) = self.attempts(scope, connector, retry, op).await;
        let breaker = self
            .breakers
            .breaker(&scope.channel, connector)
            .map_or("disabled", |b| state_name(self.breakers.state_now(&b)));
        span.finish(
            retries,
            breaker,
            result.as_ref().err().map(|e| e.message.as_str()),
        );
        result
    }

    /// Runs `op` under the breaker with retries; also says how many retries.
    /// The breaker admits the call once and counts its outcome once: a call
    /// that failed after all its retries is one failure (the spec's "calls
    /// fail"), so `max_retries` retries are all made while the breaker stays
    /// closed. Before each retry the breaker is looked at again: opened
    /// meanwhile by other calls, it stops the retries.
    async fn attempts<T, F, Fut>(
        &self,
        scope: &CallScope,
        connector: &str,
        retry: &RetryPolicy,
        mut op: F,
    ) -> (Result<T, ConnectorError>, u32)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ConnectorError>>,
    {
        let permit = match self.breakers.breaker(&scope.channel, connector) {
            Some(b) => match self.breakers.admit(&b) {
                Ok(p) => Some(p),
                Err(refused) => return (Err(refused), 0),
            },
            None => None,
        };
        // A timeout counts even where it is not retried (a write that timed
        // out may have happened: it is not repeated, but the remote was too
        // slow all the same); a 4xx or a misconfiguration does not.
        let counts = |e: &ConnectorError| {
            e.retryable || e.kind == sluice_runtime::connectors::ConnectorErrorKind::Timeout
        };
        let mut retries = 0u32;
        loop {
            let e = match op().await {
                Ok(v) => {
                    if let Some(p) = permit {
                        p.finish(false);
                    }
                    return (Ok(v), retries);
                }
                Err(e) => e,
            };
            // The remote's own `Retry-After` is waited out (a retry sooner
            // is one it said it would refuse); one longer than a retry ever
            // waits ends the retries, saying so.
            let asked = e
                .retry_after
                .filter(|wait| *wait > Duration::from_millis(RetryPolicy::MAX_DELAY_MS));
            let would_retry = e.retryable && retries < retry.max_retries;
            if !would_retry || asked.is_some() {
                if let Some(p) = permit {
                    p.finish(counts(&e));
                }
                let mut e = after_retries(e, retries, None);
                if let Some(wait) = asked.filter(|_| would_retry) {
                    e.message.push_str(&format!(
                        "; not retried: it asked to be retried after {} s, longer than the {} s a retry waits at most",
                        wait.as_secs(),
                        RetryPolicy::MAX_DELAY_MS / 1000
                    ));
                }
                return (Err(e), retries);
            }
            let wait = backoff(retry, retries).max(e.retry_after.unwrap_or_default());
            tokio::time::sleep(wait).await;
            // Opened by other calls meanwhile (a probe holds its breaker
            // half-open itself and goes on): the call ends with the failure
            // the retry would have repeated, which says why.
            if let Some(p) = &permit
                && !p.probe
                && p.breaker.state.load(Ordering::Acquire) != CLOSED
            {
                let key = p.breaker.key.clone();
                let _ = self.breakers.reject(&p.breaker);
                if let Some(p) = permit {
                    p.finish(true);
                }
                return (Err(after_retries(e, retries, Some(&key))), retries);
            }
            retries += 1;
        }
    }
}

/// A call's failure, saying how many retries were made before it and, with
/// `opened`, that the named breaker opened before the next one.
fn after_retries(mut e: ConnectorError, retries: u32, opened: Option<&str>) -> ConnectorError {
    let made = match retries {
        0 => None,
        1 => Some("after 1 retry".to_owned()),
        n => Some(format!("after {n} retries")),
    };
    let note = match (made, opened) {
        (None, None) => return e,
        (Some(made), None) => made,
        (None, Some(key)) => format!("then the circuit breaker '{key}' opened"),
        (Some(made), Some(key)) => format!("{made}; then the circuit breaker '{key}' opened"),
    };
    e.message = format!("{} ({note})", e.message);
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn cfg(threshold: u32, recovery_secs: u64) -> config::CircuitBreaker {
        config::CircuitBreaker {
            enabled: true,
            failure_threshold: threshold,
            recovery_timeout_secs: recovery_secs,
            max_breakers: 100,
        }
    }

    fn scope() -> CallScope {
        CallScope {
            channel: "ch".into(),
            ..CallScope::default()
        }
    }

    fn upstream() -> ConnectorError {
        ConnectorError::new(ConnectorErrorKind::Upstream, "boom").retryable(true)
    }

    const NO_RETRY: RetryPolicy = RetryPolicy {
        max_retries: 0,
        retry_delay_ms: 1,
    };

    #[test]
    fn backoff_doubles_and_caps_at_sixty_seconds() {
        let p = RetryPolicy {
            max_retries: 10,
            retry_delay_ms: 100,
        };
        let ms: Vec<u128> = (0..4).map(|i| backoff(&p, i).as_millis()).collect();
        assert_eq!(ms, [100, 200, 400, 800]);
        assert_eq!(backoff(&p, 20), Duration::from_secs(60));
        assert_eq!(backoff(&p, 200), Duration::from_secs(60));
    }

    #[tokio::test]
    async fn retries_only_retryable_failures() {
        let policy = Policy::new(&cfg(100, 30));
        let p = RetryPolicy {
            max_retries: 3,
            retry_delay_ms: 1,
        };
        let n = AtomicUsize::new(0);
        let r: Result<(), _> = policy
            .call(&scope(), "c", &p, || async {
                n.fetch_add(1, Ordering::Relaxed);
                Err(upstream())
            })
            .await;
        assert_eq!(n.load(Ordering::Relaxed), 4);
        assert!(r.unwrap_err().message.ends_with("(after 3 retries)"));

        let n = AtomicUsize::new(0);
        let r: Result<(), _> = policy
            .call(&scope(), "c", &p, || async {
                n.fetch_add(1, Ordering::Relaxed);
                Err(ConnectorError::new(ConnectorErrorKind::Upstream, "400"))
            })
            .await;
        assert_eq!(n.load(Ordering::Relaxed), 1);
        assert_eq!(r.unwrap_err().message, "400");

        let n = AtomicUsize::new(0);
        let r = policy
            .call(&scope(), "c", &p, || async {
                if n.fetch_add(1, Ordering::Relaxed) < 2 {
                    Err(upstream())
                } else {
                    Ok(7)
                }
            })
            .await;
        assert_eq!(r.unwrap(), 7);
    }

    /// A call is one failure for its breaker however many retries it made
    /// (audit 69: each attempt counted, so with the defaults the second
    /// failing request opened the breaker, and `max_retries: 6` made 4).
    #[tokio::test]
    async fn a_call_counts_once_whatever_its_retries() {
        let policy = Policy::new(&cfg(2, 30));
        let p = RetryPolicy {
            max_retries: 6,
            retry_delay_ms: 1,
        };
        let n = AtomicUsize::new(0);
        let fail = || async {
            n.fetch_add(1, Ordering::Relaxed);
            Err::<(), _>(upstream())
        };
        let e = policy.call(&scope(), "c", &p, fail).await.unwrap_err();
        assert_eq!(n.load(Ordering::Relaxed), 7, "every retry is made");
        assert_eq!(e.message, "boom (after 6 retries)");
        let listed = &policy.breakers.list()[0];
        assert_eq!(
            (listed["state"].as_str(), &listed["consecutive_failures"]),
            (Some("closed"), &json!(1))
        );
        // The second failing call in a row opens it (threshold 2).
        let e = policy.call(&scope(), "c", &p, fail).await.unwrap_err();
        assert_eq!(e.message, "boom (after 6 retries)");
        assert_eq!(n.load(Ordering::Relaxed), 14);
        assert_eq!(policy.breakers.list()[0]["state"], "open");
        let e = policy.call(&scope(), "c", &p, fail).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::CircuitOpen);
        assert_eq!(n.load(Ordering::Relaxed), 14);
    }

    /// A breaker that other calls open during one call's retries stops
    /// them; the call ends with the failure the retry would have repeated
    /// (and says so), not the breaker's refusal: the caller learns the
    /// cause. The next call is refused as open.
    #[tokio::test]
    async fn a_breaker_opening_during_retries_keeps_the_cause() {
        let policy = Policy::new(&cfg(1, 30));
        let b = policy.breakers.breaker("ch", "c").unwrap();
        let p = RetryPolicy {
            max_retries: 5,
            retry_delay_ms: 1,
        };
        let n = AtomicUsize::new(0);
        let e = policy
            .call(&scope(), "c", &p, || async {
                // The second attempt fails while another call's failure
                // opens the breaker.
                if n.fetch_add(1, Ordering::Relaxed) == 1 {
                    policy.breakers.admit(&b).unwrap().finish(true);
                }
                Err::<(), _>(upstream())
            })
            .await
            .unwrap_err();
        assert_eq!(n.load(Ordering::Relaxed), 2);
        assert_eq!(e.kind, ConnectorErrorKind::Upstream, "{e:?}");
        assert_eq!(
            e.message,
            "boom (after 1 retry; then the circuit breaker 'ch:c' opened)"
        );
        let e = policy
            .call(&scope(), "c", &p, || async { Ok(()) })
            .await
            .unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::CircuitOpen);
    }

    #[tokio::test]
    async fn breaker_opens_at_the_threshold_probes_once_and_closes() {
        let policy = Policy::new(&cfg(3, 0));
        let fail = || async { Err::<(), _>(upstream()) };
        for _ in 0..2 {
            policy
                .call(&scope(), "c", &NO_RETRY, fail)
                .await
                .unwrap_err();
        }
        let key = "ch:c";
        assert_eq!(policy.breakers.list()[0]["state"], "closed");
        assert_eq!(policy.breakers.list()[0]["consecutive_failures"], 2);
        // The third failure in a row opens it.
        policy
            .call(&scope(), "c", &NO_RETRY, fail)
            .await
            .unwrap_err();
        let b = policy.breakers.map.get(key).unwrap();
        assert_eq!(b.state(), "open");
        assert!(policy.breakers.list()[0]["opened_at"].is_string());
        // Its cooldown (0 s here) has passed: the listing shows it half-open,
        // as the next call will be the probe.
        assert_eq!(policy.breakers.list()[0]["state"], "half_open");

        // Cooldown 0: the next call is the one probe; while it is in flight
        // everything else is rejected as open.
        let probe = policy.breakers.admit(&b).unwrap();
        assert!(probe.probe);
        let e = policy.breakers.admit(&b).err().unwrap();
        assert_eq!(e.kind, ConnectorErrorKind::CircuitOpen);
        probe.finish(true);
        assert_eq!(b.state(), "open");
        // A successful probe closes it.
        policy
            .call(&scope(), "c", &NO_RETRY, || async { Ok(()) })
            .await
            .unwrap();
        assert_eq!(b.state(), "closed");
        assert_eq!(policy.breakers.list()[0]["consecutive_failures"], 0);
    }

    /// A success admitted before the breaker opened leaves the open
    /// breaker's count as it was (audit 67: listed open with 0 failures).
    #[tokio::test]
    async fn late_successes_leave_an_open_breaker_alone() {
        let policy = Policy::new(&cfg(2, 3600));
        let b = policy.breakers.breaker("ch", "c").unwrap();
        let late = policy.breakers.admit(&b).unwrap();
        for _ in 0..2 {
            policy.breakers.admit(&b).unwrap().finish(true);
        }
        assert_eq!(b.state(), "open");
        late.finish(false);
        let listed = &policy.breakers.list()[0];
        assert_eq!(
            (listed["state"].as_str(), &listed["consecutive_failures"]),
            (Some("open"), &json!(2))
        );
    }

    /// A call dropped outside the executor's deadline (the client went
    /// away) counts nothing, and a probe dropped so gives its slot back.
    #[tokio::test]
    async fn calls_dropped_by_the_client_count_nothing() {
        let policy = Policy::new(&cfg(1, 0));
        let b = policy.breakers.breaker("ch", "c").unwrap();
        drop(policy.breakers.admit(&b).unwrap());
        assert_eq!(policy.breakers.list()[0]["consecutive_failures"], 0);
        policy.breakers.admit(&b).unwrap().finish(true);
        let probe = policy.breakers.admit(&b).unwrap();
        assert!(probe.probe);
        drop(probe);
        // Not re-opened with a fresh cooldown: the next call probes.
        assert!(policy.breakers.admit(&b).unwrap().probe);
    }

    #[tokio::test]
    async fn an_open_breaker_rejects_until_its_cooldown_and_reset_closes_it() {
        let policy = Policy::new(&cfg(1, 3600));
        let n = AtomicUsize::new(0);
        let op = || async {
            n.fetch_add(1, Ordering::Relaxed);
            Err::<(), _>(upstream())
        };
        let p = RetryPolicy {
            max_retries: 5,
            retry_delay_ms: 1,
        };
        // The first failing call (after its retries) opens it.
        let e = policy.call(&scope(), "c", &p, op).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Upstream);
        assert_eq!(e.message, "boom (after 5 retries)");
        assert_eq!(n.load(Ordering::Relaxed), 6);
        let e = policy.call(&scope(), "c", &p, op).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::CircuitOpen);
        assert_eq!(n.load(Ordering::Relaxed), 6);
        // Still cooling down: listed as open.
        assert_eq!(policy.breakers.list()[0]["state"], "open");
        assert_eq!(policy.breakers.reset("nope:c"), None);
        let (before, after) = policy.breakers.reset("ch:c").unwrap();
        assert_eq!(
            (before["state"].as_str(), after["state"].as_str()),
            (Some("open"), Some("closed"))
        );
        policy
            .call(&scope(), "c", &NO_RETRY, || async { Ok(()) })
            .await
            .unwrap();
    }

    /// A timeout that is not retried (a write's) still counts; an answer
    /// the remote gave (a 4xx) does not.
    #[tokio::test]
    async fn timeouts_count_even_when_not_retried() {
        let policy = Policy::new(&cfg(3, 30));
        let timeout = || ConnectorError::new(ConnectorErrorKind::Timeout, "slow").retryable(false);
        let refused = || ConnectorError::new(ConnectorErrorKind::Upstream, "400");
        for _ in 0..5 {
            let _: Result<(), _> = policy
                .call(&scope(), "refusing", &NO_RETRY, || async { Err(refused()) })
                .await;
        }
        let r: Result<(), _> = policy
            .call(&scope(), "refusing", &NO_RETRY, || async { Err(refused()) })
            .await;
        assert_eq!(r.unwrap_err().message, "400");
        for _ in 0..3 {
            let _: Result<(), _> = policy
                .call(&scope(), "slow", &NO_RETRY, || async { Err(timeout()) })
                .await;
        }
        let r: Result<(), _> = policy
            .call(&scope(), "slow", &NO_RETRY, || async { Err(timeout()) })
            .await;
        assert_eq!(r.unwrap_err().kind, ConnectorErrorKind::CircuitOpen);
    }

    #[tokio::test]
    async fn disabled_breakers_never_reject() {
        let mut c = cfg(1, 3600);
        c.enabled = false;
        let policy = Policy::new(&c);
        for _ in 0..3 {
            let e = policy
                .call(&scope(), "c", &NO_RETRY, || async {
                    Err::<(), _>(upstream())
                })
                .await
                .unwrap_err();
            assert_eq!(e.kind, ConnectorErrorKind::Upstream);
        }
        assert!(policy.breakers.list().is_empty());
    }

    /// With room for two, touching "a" after "b" was created makes "b" the
    /// least recently used, so creating "c" evicts "b". moka applies recency
    /// in its maintenance pass, from a bounded read buffer that drops reads
    /// when it is full: under heavy concurrent use the order is approximate.
    /// Creating a breaker runs that pass, so calls one at a time get exact
    /// LRU, and the map never holds more than `max_breakers`.
    #[test]
    fn the_listing_holds_at_most_max_breakers() {
        let mut c = cfg(1, 1);
        c.max_breakers = 2;
        let b = Breakers::new(&c);
        for i in 0..12 {
            b.breaker(&format!("channel-{i}"), "up");
        }
        assert_eq!(b.list().len(), 2);
        let listed: Vec<String> = b
            .list()
            .iter()
            .map(|j| j["key"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert!(listed.iter().all(|k| k.ends_with(":up")), "{listed:?}");
    }

    /// Calls one at a time, no listing in between (session 18: the third
    /// breaker did not evict the first until a later pass, which then
    /// evicted the most recently used one).
    #[test]
    fn creating_a_breaker_evicts_the_least_recently_used_at_once() {
        let mut c = cfg(1, 1);
        c.max_breakers = 2;
        let b = Breakers::new(&c);
        let first = b.breaker("x1", "dead").unwrap();
        b.breaker("x2", "dead");
        b.breaker("x3", "dead");
        assert_eq!(b.map.entry_count(), 2);
        // "x1" was evicted when "x3" came: its next call gets a new breaker.
        assert!(!Arc::ptr_eq(&first, &b.breaker("x1", "dead").unwrap()));
        // Which evicted "x2", the least recently used, not "x3".
        let keep = b.breaker("x3", "dead").unwrap();
        b.breaker("x4", "dead");
        assert!(Arc::ptr_eq(&keep, &b.breaker("x3", "dead").unwrap()));
        let mut keys: Vec<String> = b.map.iter().map(|(k, _)| (*k).clone()).collect();
        keys.sort();
        assert_eq!(keys, ["x3:dead", "x4:dead"]);
    }

    #[test]
    fn breakers_evict_the_least_recently_used() {
        let mut c = cfg(1, 1);
        c.max_breakers = 2;
        let b = Breakers::new(&c);
        let keys = |b: &Breakers| {
            b.map.run_pending_tasks();
            let mut k: Vec<String> = b.map.iter().map(|(k, _)| (*k).clone()).collect();
            k.sort();
            k
        };
        b.breaker("a", "x");
        assert_eq!(keys(&b), ["a:x"]);
        b.breaker("b", "x");
        assert_eq!(keys(&b), ["a:x", "b:x"]);
        // A breaker is used on every call: that use is what counts.
        let a = b.breaker("a", "x").unwrap();
        b.map.run_pending_tasks();
        b.breaker("c", "x");
        assert_eq!(keys(&b), ["a:x", "c:x"]);
        // The survivor is the same breaker, state and all, not a new one.
        assert!(Arc::ptr_eq(&a, &b.breaker("a", "x").unwrap()));
        // And now "c" was used before "a": "d" evicts "c".
        b.map.run_pending_tasks();
        b.breaker("d", "x");
        assert_eq!(keys(&b), ["a:x", "d:x"]);
    }
}
