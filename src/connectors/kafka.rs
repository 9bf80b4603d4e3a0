//! The `kafka` connector client for `publish_kafka`: one rdkafka
//! `FutureProducer` per connector version, shared by every call.
//!
//! - `bootstrap.servers` from the connector's `brokers`, `client.id` from
//!   `client_id` (default `sluice`). With `sasl`, `SASL_PLAINTEXT` and the
//!   mechanism given; this build of librdkafka has no OpenSSL, so only
//!   `PLAIN` works (SCRAM needs it): the producer build fails with a clear
//!   message otherwise.
//! - A publish waits for the broker's acknowledgement (`acks=all`, the
//!   idempotent producer), so a completed task means the message is stored.
//!   The wait is bounded by `message.timeout.ms` (the platform's
//!   `engine.global_http_timeout_secs`); running out is a retryable
//!   `Timeout`.
//! - Headers carry the W3C trace context (`traceparent`, `tracestate`) of the
//!   calling request.

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::util::Timeout;
use rdkafka::{ClientConfig, ClientContext};
use sluice_compiler::def::KafkaConnector;
use sluice_runtime::connectors::{CallScope, ConnectorError, ConnectorErrorKind, PublishRequest};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One Kafka connector's producer; cheap to share behind the entry.
pub struct KafkaProducer {
    producer: FutureProducer<QuietLog>,
    delivery_timeout: Duration,
}

/// librdkafka's log lines and error reports for one client, at most one
/// every [`QuietLog::EVERY`], the next one saying how many were left out.
/// A broker that stays down makes librdkafka report it about ten times a
/// second for as long as the client lives; before, every report was a log
/// line. Also used for the OpenTelemetry exporter's failures.
#[derive(Debug)]
pub struct QuietLog {
    /// Who the lines are about (a connector, a consumed topic).
    about: String,
    every: Duration,
    started: Instant,
    /// When the last line was written (ms since `started`, plus one; 0 for
    /// never).
    last: AtomicU64,
    left_out: AtomicU64,
    /// Values masked in every line (a connector's values taken from the
    /// environment, its SASL password): librdkafka names brokers it cannot
    /// resolve.
    secrets: Vec<String>,
}

impl QuietLog {
    pub const EVERY: Duration = Duration::from_secs(30);

    pub fn new(about: impl Into<String>) -> QuietLog {
        QuietLog::every(about, QuietLog::EVERY)
    }

    fn every(about: impl Into<String>, every: Duration) -> QuietLog {
        QuietLog {
            about: about.into(),
            every,
            started: Instant::now(),
            last: AtomicU64::new(0),
            left_out: AtomicU64::new(0),
            secrets: Vec::new(),
        }
    }

    /// The same, masking `secrets` in every line.
    pub fn masking(mut self, secrets: Vec<String>) -> QuietLog {
        self.secrets = super::secret_forms(secrets);
        self
    }

    /// `Some(lines left out since the last one)` when a line may be written.
    pub(crate) fn admit(&self) -> Option<u64> {
        let now = self.started.elapsed().as_millis() as u64 + 1;
        let last = self.last.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= self.every.as_millis() as u64;
        if due
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.left_out.swap(0, Ordering::Relaxed));
        }
        self.left_out.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Writes a client log line (errors and warnings only; librdkafka is
    /// set to log no more than errors anyway).
    pub fn log_line(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        if matches!(
            level,
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info | RDKafkaLogLevel::Debug
        ) {
            return;
        }
        if let Some(left_out) = self.admit() {
            let message = super::mask_values(message, &self.secrets);
            tracing::warn!(about = %self.about, left_out, "kafka client: {facility} {message}");
        }
    }

    /// Writes a client error report.
    pub fn error_line(&self, error: &KafkaError, reason: &str) {
        if let Some(left_out) = self.admit() {
            let text = super::mask_values(&format!("{error}: {reason}"), &self.secrets);
            tracing::warn!(about = %self.about, left_out, "kafka client: {text}");
        }
    }
}

impl ClientContext for QuietLog {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.log_line(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.error_line(&error, reason);
    }
}

impl std::fmt::Debug for KafkaProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the SASL password.
        f.debug_struct("KafkaProducer").finish_non_exhaustive()
    }
}

/// The librdkafka settings shared by producers and consumers of a
/// connector or of the platform's `kafka.*` block.
pub fn client_config(
    brokers: &str,
    client_id: Option<&str>,
    sasl: Option<(&str, &str, &str)>,
) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("client.id", client_id.unwrap_or("sluice"))
        // librdkafka logs through its own callback; keep it quiet but for errors.
        .set("log_level", "3");
    if let Some((mechanism, username, password)) = sasl {
        c.set("security.protocol", "SASL_PLAINTEXT")
            .set("sasl.mechanisms", mechanism)
            .set("sasl.username", username)
            .set("sasl.password", password);
    }
    c
}

impl KafkaProducer {
    pub fn build(
        name: &str,
        cfg: &KafkaConnector,
        delivery_timeout: Duration,
        from_env: &[String],
    ) -> Result<KafkaProducer, ConnectorError> {
        let brokers = cfg.brokers.list().join(",");
        let sasl = cfg.sasl.as_ref().map(|s| {
            (
                s.mechanism.as_str(),
                s.username.as_str(),
                s.password.as_str(),
            )
        });
        // A broker list from the environment is masked whole and host by host.
        let mut secrets: Vec<String> = from_env
            .iter()
            .flat_map(|v| std::iter::once(v.clone()).chain(v.split(',').map(str::to_owned)))
            .collect();
        secrets.extend(cfg.sasl.as_ref().map(|s| s.password.clone()));
        let log = QuietLog::new(format!("connector '{name}'")).masking(secrets.clone());
        let producer = producer_config(&brokers, cfg.client_id.as_deref(), sasl, delivery_timeout)
            .create_with_context::<_, FutureProducer<QuietLog>>(log)
            .map_err(|e| {
                // librdkafka names the property, never its value; masked
                // all the same.
                let message = format!("connector '{name}': cannot create a Kafka producer: {e}");
                ConnectorError::other(super::mask_values(&message, &super::secret_forms(secrets)))
            })?;
        Ok(KafkaProducer {
            producer,
            delivery_timeout,
        })
    }

    /// Publishes one message and waits for the broker's acknowledgement.
    pub async fn publish(
        &self,
        scope: &CallScope,
        req: &PublishRequest,
    ) -> Result<(), ConnectorError> {
        let (traceparent, tracestate) = super::http::trace_context(scope);
        let mut headers = OwnedHeaders::new().insert(Header {
            key: "traceparent",
            value: Some(traceparent.as_bytes()),
        });
        if let Some(state) = &tracestate {
            headers = headers.insert(Header {
                key: "tracestate",
                value: Some(state.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(&req.topic)
            .payload(&req.value)
            .headers(headers);
        if let Some(key) = &req.key {
            record = record.key(key);
        }
        match self
            .producer
            .send(record, Timeout::After(self.delivery_timeout))
            .await
        {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(publish_error(&req.topic, &e)),
        }
    }

    /// Waits (bounded) for queued messages; used when the process stops.
    pub fn flush(&self, within: Duration) {
        let _ = self.producer.flush(Timeout::After(within));
    }
}

/// A producer's settings: acknowledged by every in-sync replica, idempotent
/// (no duplicates from librdkafka's own retries), bounded delivery time.
pub fn producer_config(
    brokers: &str,
    client_id: Option<&str>,
    sasl: Option<(&str, &str, &str)>,
    delivery_timeout: Duration,
) -> ClientConfig {
    let mut c = client_config(brokers, client_id, sasl);
    c.set("acks", "all")
        .set("enable.idempotence", "true")
        .set(
            "message.timeout.ms",
            delivery_timeout.as_millis().max(1).to_string(),
        )
        .set("linger.ms", "1");
    c
}

fn publish_error(topic: &str, e: &KafkaError) -> ConnectorError {
    let code = e.rdkafka_error_code();
    let (kind, retryable) = match code {
        Some(RDKafkaErrorCode::MessageTimedOut) | Some(RDKafkaErrorCode::RequestTimedOut) => {
            (ConnectorErrorKind::Timeout, true)
        }
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::InvalidTopic
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::InvalidMessage,
        ) => (ConnectorErrorKind::Upstream, false),
        _ => (ConnectorErrorKind::Upstream, true),
    };
    ConnectorError::new(kind, format!("publishing to topic '{topic}' failed: {e}"))
        .retryable(retryable)
}

#[cfg(test)]
mod quiet_log_tests {
    use super::*;

    #[test]
    fn client_lines_are_throttled_and_count_what_was_left_out() {
        let q = QuietLog::every("connector 'k'", Duration::from_millis(50));
        assert_eq!(q.admit(), Some(0));
        for _ in 0..10 {
            assert_eq!(q.admit(), None);
        }
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(q.admit(), Some(10));
        assert_eq!(q.admit(), None);
    }
}
