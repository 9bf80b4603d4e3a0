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

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::util::Timeout;
use sluice_compiler::def::KafkaConnector;
use sluice_runtime::connectors::{CallScope, ConnectorError, ConnectorErrorKind, PublishRequest};
use std::time::Duration;

/// One Kafka connector's producer; cheap to share behind the entry.
pub struct KafkaProducer {
    producer: FutureProducer,
    delivery_timeout: Duration,
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
    ) -> Result<KafkaProducer, ConnectorError> {
        let brokers = cfg.brokers.list().join(",");
        let sasl = cfg.sasl.as_ref().map(|s| {
            (
                s.mechanism.as_str(),
                s.username.as_str(),
                s.password.as_str(),
            )
        });
        let producer = producer_config(&brokers, cfg.client_id.as_deref(), sasl, delivery_timeout)
            .create::<FutureProducer>()
            .map_err(|e| {
                // librdkafka names the property, never its value.
                ConnectorError::other(format!(
                    "connector '{name}': cannot create a Kafka producer: {e}"
                ))
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
