//! The traits through which connector and composition functions reach the
//! outside world. The runtime knows nothing of sockets, drivers or HTTP: the
//! service crate implements these with real clients (with retries, timeouts
//! and circuit breakers), and tests or `sluice test` may plug in fakes.
//!
//! Requests and responses are owned `serde_json` values: a connector call
//! crosses an await and usually a thread, and its cost is the I/O, not the copy.

use async_trait::async_trait;
use serde_json::Value as Json;
use sluice_compiler::plan::HttpMethod;
use std::fmt;
use std::sync::Arc;

/// How a connector call failed; decides the HTTP status of a halted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectorErrorKind {
    /// The call's own timeout ran out.
    Timeout,
    /// The circuit breaker for this channel and connector is open.
    CircuitOpen,
    /// The remote system answered with an error or could not be reached
    /// (after retries).
    Upstream,
    /// Anything else: unknown connector, misconfiguration, bad input.
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectorError {
    pub kind: ConnectorErrorKind,
    pub message: String,
    /// Whether trying again may succeed (network errors, timeouts, 5xx, 429,
    /// 408). Only retryable failures are retried.
    pub retryable: bool,
    /// How long the remote asked to be left alone before a retry (an HTTP
    /// `Retry-After` on a 429 or 503).
    pub retry_after: Option<std::time::Duration>,
}

impl ConnectorError {
    /// A failure of `kind`; timeouts are retryable by default, others not.
    pub fn new(kind: ConnectorErrorKind, message: impl Into<String>) -> Self {
        ConnectorError {
            kind,
            message: message.into(),
            retryable: kind == ConnectorErrorKind::Timeout,
            retry_after: None,
        }
    }

    /// The wait the remote asked for before a retry.
    pub fn retry_after(mut self, wait: Option<std::time::Duration>) -> Self {
        self.retry_after = wait;
        self
    }

    /// Marks the failure as retryable (or not).
    pub fn retryable(mut self, retryable: bool) -> Self {
        self.retryable = retryable;
        self
    }

    pub fn other(message: impl Into<String>) -> Self {
        Self::new(ConnectorErrorKind::Other, message)
    }

    /// The failure with the connector it came from named first (`connector
    /// 'orders-db': database error: …`), unless its message names it
    /// already: with several connectors of one kind in a workflow, a
    /// driver's message alone does not say which one failed.
    pub fn naming(mut self, connector: &str) -> Self {
        let name = format!("connector '{connector}'");
        if !self.message.contains(&name) {
            self.message = format!("{name}: {}", self.message);
        }
        self
    }
}

impl fmt::Display for ConnectorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConnectorError {}

/// Who is calling: the channel (breakers are keyed `<channel>:<connector>`)
/// and the W3C trace context to propagate.
#[derive(Debug, Clone, Default)]
pub struct CallScope {
    pub channel: String,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// Channels already on the `channel_call` stack, outermost first.
    pub chain: Vec<String>,
    /// Whatever the caller wants connector implementations to see (the
    /// service puts its per-request span recorder here); opaque to the
    /// runtime, `None` by default.
    pub observer: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

#[derive(Debug, Clone)]
pub struct HttpRequest {
    pub connector: String,
    pub method: HttpMethod,
    /// Appended to the connector's base URL.
    pub path: Option<String>,
    pub headers: Vec<(String, String)>,
    pub body: Option<Json>,
    pub timeout_ms: u64,
    /// Whether the answer's body is kept (`response_path` given); without
    /// it the body is discarded, so a body that does not parse is no
    /// failure.
    pub keep_body: bool,
}

#[derive(Debug, Clone)]
pub struct SqlRequest {
    pub connector: String,
    pub query: String,
    pub params: Vec<Json>,
}

#[derive(Debug, Clone)]
pub struct FindRequest {
    pub connector: String,
    pub database: String,
    pub collection: String,
    pub filter: Json,
}

#[derive(Debug, Clone)]
pub struct PublishRequest {
    pub connector: String,
    pub topic: String,
    pub key: Option<String>,
    /// The message value as JSON text.
    pub value: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct InvokeRequest {
    pub channel: String,
    /// The payload the called channel's workflow sees.
    pub data: Json,
    pub timeout_ms: Option<u64>,
    /// The calling request's rollout bucket: the callee's workflow is
    /// chosen for the same caller as the caller's was (a canary at 30%
    /// sees the same 30% of callers through a `channel_call`).
    pub bucket: Option<u8>,
    /// The calling request's id: the callee runs under the same one (its
    /// `metadata.request_id`), so one request's log lines share it.
    pub request_id: Option<String>,
}

#[async_trait]
pub trait HttpClient: Send + Sync {
    /// Returns the response body (JSON when it parses, else a string).
    async fn call(&self, scope: &CallScope, req: HttpRequest) -> Result<Json, ConnectorError>;
}

#[async_trait]
pub trait SqlClient: Send + Sync {
    /// Runs a SELECT; rows as JSON objects.
    async fn read(&self, scope: &CallScope, req: SqlRequest) -> Result<Vec<Json>, ConnectorError>;
    /// Runs INSERT/UPDATE/DELETE; the number of rows affected.
    async fn write(&self, scope: &CallScope, req: SqlRequest) -> Result<u64, ConnectorError>;
}

#[async_trait]
pub trait Cache: Send + Sync {
    async fn get(
        &self,
        scope: &CallScope,
        connector: &str,
        key: &str,
    ) -> Result<Option<String>, ConnectorError>;
    async fn set(
        &self,
        scope: &CallScope,
        connector: &str,
        key: &str,
        value: String,
        ttl: Option<std::time::Duration>,
    ) -> Result<(), ConnectorError>;
}

#[async_trait]
pub trait DocumentStore: Send + Sync {
    async fn find(&self, scope: &CallScope, req: FindRequest) -> Result<Vec<Json>, ConnectorError>;
}

#[async_trait]
pub trait Publisher: Send + Sync {
    async fn publish(&self, scope: &CallScope, req: PublishRequest) -> Result<(), ConnectorError>;
}

/// What a called channel answered: its `data`, and the errors its run
/// collected without failing (failed validation rules, tasks passed over
/// under `continue_on_error`), which the caller reports as its own.
#[derive(Debug, Clone, Default)]
pub struct Invoked {
    pub data: Json,
    pub errors: Vec<CalleeError>,
}

/// One of the errors a called channel's answer carried.
#[derive(Debug, Clone)]
pub struct CalleeError {
    pub code: String,
    pub task_id: String,
    pub message: String,
}

#[async_trait]
pub trait ChannelInvoker: Send + Sync {
    /// Runs another channel's workflow in-process and returns its answer.
    async fn invoke(
        &self,
        scope: &CallScope,
        req: InvokeRequest,
    ) -> Result<Invoked, ConnectorError>;
}

/// The connector implementations a runtime may use. A function whose service
/// is absent fails with a task error saying so.
#[derive(Clone, Default)]
pub struct Services {
    pub http: Option<Arc<dyn HttpClient>>,
    pub sql: Option<Arc<dyn SqlClient>>,
    pub cache: Option<Arc<dyn Cache>>,
    pub documents: Option<Arc<dyn DocumentStore>>,
    pub publisher: Option<Arc<dyn Publisher>>,
    pub channels: Option<Arc<dyn ChannelInvoker>>,
}

impl fmt::Debug for Services {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Services")
            .field("http", &self.http.is_some())
            .field("sql", &self.sql.is_some())
            .field("cache", &self.cache.is_some())
            .field("documents", &self.documents.is_some())
            .field("publisher", &self.publisher.is_some())
            .field("channels", &self.channels.is_some())
            .finish()
    }
}

/// One pending connector call, produced by the executor and answered by
/// [`Services::perform`].
#[derive(Debug)]
pub enum IoRequest {
    Http(HttpRequest),
    SqlRead(SqlRequest),
    SqlWrite(SqlRequest),
    CacheGet {
        connector: String,
        key: String,
    },
    CacheSet {
        connector: String,
        key: String,
        value: String,
        ttl: Option<std::time::Duration>,
    },
    Find(FindRequest),
    Publish(PublishRequest),
    Invoke(InvokeRequest),
}

/// What a connector call produced: the value to store (if any), and for a
/// `channel_call` the errors the called channel's answer carried (named
/// after the channel).
#[derive(Debug, Default)]
pub struct IoOutput {
    pub value: Option<Json>,
    pub callee: Option<(String, Vec<CalleeError>)>,
}

impl From<Option<Json>> for IoOutput {
    fn from(value: Option<Json>) -> Self {
        IoOutput {
            value,
            callee: None,
        }
    }
}

pub type IoResult = Result<IoOutput, ConnectorError>;

fn missing(what: &str) -> ConnectorError {
    ConnectorError::other(format!("no {what} is configured in this process"))
}

impl Services {
    /// Performs one connector call.
    pub async fn perform(&self, scope: &CallScope, io: IoRequest) -> IoResult {
        if let IoRequest::Invoke(req) = io {
            let channels = self
                .channels
                .as_ref()
                .ok_or_else(|| missing("channel invoker"))?;
            let channel = req.channel.clone();
            let answer = channels.invoke(scope, req).await?;
            return Ok(IoOutput {
                value: Some(answer.data),
                callee: Some((channel, answer.errors)),
            });
        }
        self.perform_value(scope, io).await.map(IoOutput::from)
    }

    async fn perform_value(
        &self,
        scope: &CallScope,
        io: IoRequest,
    ) -> Result<Option<Json>, ConnectorError> {
        match io {
            IoRequest::Http(req) => {
                let client = self.http.as_ref().ok_or_else(|| missing("HTTP client"))?;
                client.call(scope, req).await.map(Some)
            }
            IoRequest::SqlRead(req) => {
                let client = self.sql.as_ref().ok_or_else(|| missing("SQL client"))?;
                client
                    .read(scope, req)
                    .await
                    .map(|rows| Some(Json::Array(rows)))
            }
            IoRequest::SqlWrite(req) => {
                let client = self.sql.as_ref().ok_or_else(|| missing("SQL client"))?;
                let n = client.write(scope, req).await?;
                Ok(Some(serde_json::json!({ "rows_affected": n })))
            }
            IoRequest::CacheGet { connector, key } => {
                let cache = self.cache.as_ref().ok_or_else(|| missing("cache"))?;
                let text = cache.get(scope, &connector, &key).await?;
                Ok(Some(text.map_or(Json::Null, cached_value)))
            }
            IoRequest::CacheSet {
                connector,
                key,
                value,
                ttl,
            } => {
                let cache = self.cache.as_ref().ok_or_else(|| missing("cache"))?;
                cache.set(scope, &connector, &key, value, ttl).await?;
                Ok(None)
            }
            IoRequest::Find(req) => {
                let store = self
                    .documents
                    .as_ref()
                    .ok_or_else(|| missing("document store"))?;
                store
                    .find(scope, req)
                    .await
                    .map(|docs| Some(Json::Array(docs)))
            }
            IoRequest::Publish(req) => {
                let publisher = self.publisher.as_ref().ok_or_else(|| {
                    ConnectorError::other(
                        "Kafka is not enabled on this service (set kafka.enabled = true)",
                    )
                })?;
                publisher.publish(scope, req).await?;
                Ok(None)
            }
            IoRequest::Invoke(_) => Err(ConnectorError::other("a channel call is performed above")),
        }
    }
}

/// `cache_write` stores a string as it is and any other value as its JSON
/// text, so `cache_read` parses what it finds: text that is JSON comes back
/// as that value (a number, boolean, object, array; a quoted string), any
/// other text as a string. A string that is itself JSON text (`"42"`,
/// `"{\"a\":1}"`) therefore reads back as the value it spells.
fn cached_value(text: String) -> Json {
    serde_json::from_str(&text).unwrap_or(Json::String(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_names_its_connector_once() {
        let e = ConnectorError::new(ConnectorErrorKind::Upstream, "database error: boom")
            .retryable(true)
            .naming("orders");
        assert_eq!(e.message, "connector 'orders': database error: boom");
        assert!(e.retryable && e.kind == ConnectorErrorKind::Upstream);
        // A message that names it already stays as it is.
        let e = ConnectorError::other("connector 'orders' not found").naming("orders");
        assert_eq!(e.message, "connector 'orders' not found");
        // Another connector named in the message does not count.
        let e = ConnectorError::other("connector 'old': gone").naming("orders");
        assert_eq!(e.message, "connector 'orders': connector 'old': gone");
    }
}
