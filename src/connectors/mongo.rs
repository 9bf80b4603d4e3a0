//! The `mongodb` connector client: `find` on a collection with a filter given
//! as (extended) JSON, documents returned as relaxed extended JSON.
//!
//! - The filter is MongoDB Extended JSON, canonical or relaxed:
//!   `{"_id": {"$oid": "..."}}`, `{"at": {"$gte": {"$date": "2026-11-22T00:00:00Z"}}}`,
//!   `{"n": {"$numberLong": "5"}}` all work; `null` means "every document".
//! - Documents come back as relaxed extended JSON: ObjectId as
//!   `{"$oid": "hex"}`, dates as `{"$date": "RFC 3339"}` (years 1970–9999;
//!   others `{"$date": {"$numberLong": "ms"}}`), Int32/Int64/Double as plain
//!   numbers (non-finite doubles as `{"$numberDouble": "NaN"}`), Decimal128 as
//!   `{"$numberDecimal": "..."}`, binary as `{"$binary": {...}}`.
//! - At most [`MAX_DOCUMENTS`] documents per call, so one broad filter cannot
//!   exhaust memory: a filter matching more is a task error (not retried)
//!   that says so, never a silently shortened answer a workflow would take
//!   for the whole result. Narrow the filter.
//! - Each call is bounded by [`FIND_TIMEOUT`] (server selection included), a
//!   `Timeout` when it runs out.
//!
//! The client connects lazily (the driver's own pool and monitoring), so a
//! server that is down when the connector is loaded fails the calls, not the
//! load. Only `mongodb+srv://` URLs do DNS look-ups in `connect`.

use mongodb::bson::{Bson, Document};
use mongodb::error::{ErrorKind, RETRYABLE_ERROR};
use mongodb::options::ClientOptions;
use serde_json::Value as Json;
use sluice_compiler::def::MongoConnector;
use sluice_runtime::connectors::{ConnectorError, ConnectorErrorKind};
use std::time::Duration;

/// The most documents one `find` returns.
pub const MAX_DOCUMENTS: usize = 10_000;
/// The limit of one whole `find` call.
pub const FIND_TIMEOUT: Duration = Duration::from_secs(30);
/// Defaults when the URL does not set `serverSelectionTimeoutMS` /
/// `connectTimeoutMS`: the driver's 30 s / 10 s would hold a request long
/// after the server is known to be unreachable.
const SERVER_SELECTION_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// One MongoDB connector's client (a pool inside the driver); cheap to clone.
#[derive(Clone)]
pub struct MongoPool {
    client: mongodb::Client,
    /// The limit of one whole `find` (`query_timeout_ms`, else
    /// [`FIND_TIMEOUT`]).
    find_timeout: Duration,
}

impl std::fmt::Debug for MongoPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the connection string: it may hold a password.
        f.debug_struct("MongoPool").finish_non_exhaustive()
    }
}

impl MongoPool {
    pub async fn connect(cfg: &MongoConnector) -> Result<MongoPool, ConnectorError> {
        let mut opts = ClientOptions::parse(cfg.connection_string.trim())
            .await
            .map_err(|e| {
                // A failed SRV look-up may succeed later; a malformed URL will not.
                let retryable = matches!(*e.kind, ErrorKind::DnsResolve { .. });
                ConnectorError::new(
                    ConnectorErrorKind::Other,
                    format!("invalid mongodb connection_string: {}", e.kind),
                )
                .retryable(retryable)
            })?;
        // The connector's `connect_timeout_ms` bounds both waits for a
        // server; without it the URL's own settings, else our defaults.
        if let Some(ms) = cfg.connect_timeout_ms {
            let d = Duration::from_millis(ms);
            opts.server_selection_timeout = Some(d);
            opts.connect_timeout = Some(d);
        }
        opts.server_selection_timeout
            .get_or_insert(SERVER_SELECTION_TIMEOUT);
        opts.connect_timeout.get_or_insert(CONNECT_TIMEOUT);
        opts.app_name.get_or_insert_with(|| "sluice".to_owned());
        let client = mongodb::Client::with_options(opts).map_err(mongo_err)?;
        Ok(MongoPool {
            client,
            find_timeout: cfg
                .query_timeout_ms
                .map_or(FIND_TIMEOUT, Duration::from_millis),
        })
    }

    /// Documents of `database.collection` matching `filter`, in the server's
    /// natural order; more than [`MAX_DOCUMENTS`] is an error.
    pub async fn find(
        &self,
        database: &str,
        collection: &str,
        filter: Json,
    ) -> Result<Vec<Json>, ConnectorError> {
        let filter = filter_doc(filter)?;
        match tokio::time::timeout(
            self.find_timeout,
            self.find_inner(database, collection, filter),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(ConnectorError::new(
                ConnectorErrorKind::Timeout,
                format!(
                    "mongodb find timed out after {} ms",
                    self.find_timeout.as_millis()
                ),
            )),
        }
    }

    async fn find_inner(
        &self,
        database: &str,
        collection: &str,
        filter: Document,
    ) -> Result<Vec<Json>, ConnectorError> {
        let coll = self
            .client
            .database(database)
            .collection::<Document>(collection);
        // One more than the cap, to know whether there are more.
        let mut cursor = coll
            .find(filter)
            .limit(MAX_DOCUMENTS as i64 + 1)
            .await
            .map_err(mongo_err)?;
        let mut out = Vec::new();
        while cursor.advance().await.map_err(mongo_err)? {
            if out.len() == MAX_DOCUMENTS {
                return Err(ConnectorError::other(format!(
                    "more than {MAX_DOCUMENTS} documents of {database}.{collection} \
                     match the filter (the most one call returns); narrow the filter"
                )));
            }
            let doc = cursor.deserialize_current().map_err(mongo_err)?;
            out.push(Bson::Document(doc).into_relaxed_extjson());
        }
        Ok(out)
    }
}

/// The filter as a BSON document; extended JSON (`$oid`, `$date`,
/// `$numberLong` ...) becomes the BSON type it names.
fn filter_doc(filter: Json) -> Result<Document, ConnectorError> {
    match filter {
        Json::Null => Ok(Document::new()),
        Json::Object(m) => Document::try_from(m)
            .map_err(|e| ConnectorError::other(format!("invalid mongo filter: {e}"))),
        other => Err(ConnectorError::other(format!(
            "mongo filter must be an object, not {}",
            match other {
                Json::Array(_) => "an array",
                Json::String(_) => "a string",
                Json::Number(_) => "a number",
                _ => "a boolean",
            }
        ))),
    }
}

/// Server codes that mean "the server or the network, not your query":
/// HostUnreachable, HostNotFound, NetworkTimeout, ShutdownInProgress,
/// PrimarySteppedDown, ExceededTimeLimit, SocketException, NotWritablePrimary,
/// InterruptedAtShutdown, InterruptedDueToReplStateChange,
/// NotPrimaryNoSecondaryOk, NotPrimaryOrSecondary, ReadConcernMajorityNotAvailableYet.
const RETRYABLE_CODES: [i32; 13] = [
    6, 7, 89, 91, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436, 134,
];
/// MaxTimeMSExpired.
const TIMEOUT_CODE: i32 = 50;

/// Unreachable servers (server selection, I/O, a cleared pool) and the codes
/// above are retryable; a rejected filter (`$badOperator`, code 2) is not.
fn mongo_err(e: mongodb::error::Error) -> ConnectorError {
    let labelled = e.contains_label(RETRYABLE_ERROR);
    let (kind, retryable) = match &*e.kind {
        // No server was found within the connect timeout: refused (the
        // driver keeps trying until the timeout) is an upstream failure;
        // no answer at all is the connector's own timeout running out (504).
        ErrorKind::ServerSelection { message, .. } if !message.contains("refused") => {
            (ConnectorErrorKind::Timeout, true)
        }
        ErrorKind::ServerSelection { .. }
        | ErrorKind::Io(_)
        | ErrorKind::ConnectionPoolCleared { .. }
        | ErrorKind::DnsResolve { .. } => (ConnectorErrorKind::Upstream, true),
        ErrorKind::Command(c) if c.code == TIMEOUT_CODE => (ConnectorErrorKind::Timeout, true),
        ErrorKind::Command(c) => (
            ConnectorErrorKind::Upstream,
            labelled || RETRYABLE_CODES.contains(&c.code),
        ),
        ErrorKind::InvalidArgument { .. } | ErrorKind::InvalidTlsConfig { .. } => {
            (ConnectorErrorKind::Other, false)
        }
        _ => (ConnectorErrorKind::Upstream, labelled),
    };
    // The kind's text, not the error's: the latter lists labels and source
    // chains that add noise and nothing the caller can act on. Server
    // selection and name resolution name the servers of the connection
    // string, which may come from `env://` or hold a masked secret: their
    // text stops before it (audit 77).
    let text = match &*e.kind {
        ErrorKind::ServerSelection { message, .. } => {
            let head = message.split(". Topology").next().unwrap_or_default();
            let why = if message.contains("refused") {
                "the connection was refused"
            } else {
                "no server answered within the connect timeout"
            };
            format!("{}: {why}", head.trim_end_matches('.'))
        }
        ErrorKind::DnsResolve { .. } => "the server's host name did not resolve".to_string(),
        other => other.to_string(),
    };
    ConnectorError::new(kind, format!("mongodb: {text}")).retryable(retryable)
}

/// Against the MongoDB-compatible server of `../shared/services/mongodb.sh`
/// (127.0.0.1:27017, started by `scripts/test.sh`), each test in its own
/// database, dropped at the end. A server that is not reachable fails the test.
#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::{DateTime, doc, oid::ObjectId};
    use serde_json::json;

    const URL: &str = "mongodb://127.0.0.1:27017/";

    fn cfg(url: &str) -> MongoConnector {
        MongoConnector {
            connection_string: url.to_owned(),
            connect_timeout_ms: None,
            query_timeout_ms: None,
            retry: Default::default(),
        }
    }

    fn db_name() -> String {
        format!("sluice_c_{}", uuid::Uuid::new_v4().simple())
    }

    #[tokio::test]
    async fn find_with_filter_renders_relaxed_extended_json() {
        let pool = MongoPool::connect(&cfg(URL)).await.unwrap();
        let db = db_name();
        let coll = pool.client.database(&db).collection::<Document>("orders");
        let id = ObjectId::parse_str("6740a1b2c3d4e5f601234567").unwrap();
        let at = DateTime::parse_rfc3339_str("2026-11-22T10:15:00Z").unwrap();
        coll.insert_many([
            doc! {"_id": id, "tag": "x", "n": 1_i32, "big": 5_000_000_000_i64, "price": 2.5, "at": at, "items": ["a", {"k": true}], "none": null},
            doc! {"_id": ObjectId::new(), "tag": "x", "n": 2_i32},
            doc! {"_id": ObjectId::new(), "tag": "y", "n": 3_i32},
        ])
        .await
        .expect("insert (is the server up? bash ../shared/services/mongodb.sh)");

        let got = pool
            .find(&db, "orders", json!({"tag": "x", "n": {"$lt": 2}}))
            .await
            .unwrap();
        assert_eq!(
            got,
            vec![json!({
                "_id": {"$oid": "6740a1b2c3d4e5f601234567"}, "tag": "x", "n": 1, "big": 5_000_000_000_i64,
                "price": 2.5, "at": {"$date": "2026-11-22T10:15:00Z"}, "items": ["a", {"k": true}], "none": null
            })]
        );
        // Extended JSON in the filter: ObjectId and date.
        let got = pool
            .find(
                &db,
                "orders",
                json!({"_id": {"$oid": "6740a1b2c3d4e5f601234567"}}),
            )
            .await
            .unwrap();
        assert_eq!(got.len(), 1);
        let got = pool
            .find(
                &db,
                "orders",
                json!({"at": {"$gte": {"$date": "2026-11-01T00:00:00Z"}}}),
            )
            .await
            .unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(
            pool.find(&db, "orders", json!({"tag": "x"}))
                .await
                .unwrap()
                .len(),
            2
        );
        assert_eq!(pool.find(&db, "orders", Json::Null).await.unwrap().len(), 3);
        assert_eq!(pool.find(&db, "orders", json!({})).await.unwrap().len(), 3);
        assert!(
            pool.find(&db, "orders", json!({"tag": "z"}))
                .await
                .unwrap()
                .is_empty()
        );
        assert!(
            pool.find(&db, "nothing_here", json!({}))
                .await
                .unwrap()
                .is_empty()
        );

        let e = pool.find(&db, "orders", json!(["x"])).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Other);
        assert!(!e.retryable);
        // The server rejects an unknown operator: not retryable, its message kept.
        let e = pool
            .find(&db, "orders", json!({"n": {"$bogus": 1}}))
            .await
            .unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Upstream, "{e:?}");
        assert!(!e.retryable, "{e:?}");
        assert!(e.message.contains("$bogus"), "{}", e.message);

        pool.client.database(&db).drop().await.unwrap();
    }

    #[tokio::test]
    async fn more_than_the_cap_is_an_error_not_a_short_answer() {
        let pool = MongoPool::connect(&cfg(URL)).await.unwrap();
        let db = db_name();
        let coll = pool.client.database(&db).collection::<Document>("many");
        let docs: Vec<Document> = (0..MAX_DOCUMENTS as i32).map(|i| doc! {"i": i}).collect();
        coll.insert_many(docs).await.unwrap();
        // Exactly the cap: all of them.
        let got = pool.find(&db, "many", json!({})).await.unwrap();
        assert_eq!(got.len(), MAX_DOCUMENTS);
        // One more: an error that says what to do; a narrower filter works.
        coll.insert_one(doc! {"i": -1}).await.unwrap();
        let e = pool.find(&db, "many", json!({})).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Other);
        assert!(!e.retryable);
        assert_eq!(
            e.message,
            format!(
                "more than 10000 documents of {db}.many match the filter \
                 (the most one call returns); narrow the filter"
            )
        );
        let got = pool
            .find(&db, "many", json!({"i": {"$lt": 0}}))
            .await
            .unwrap();
        assert_eq!(got.len(), 1);
        pool.client.database(&db).drop().await.unwrap();
    }

    #[tokio::test]
    async fn unreachable_server_is_retryable_and_bad_url_is_not() {
        let pool = MongoPool::connect(&cfg(
            "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=300&connectTimeoutMS=300",
        ))
        .await
        .expect("lazy: no connection yet");
        let e = pool.find("x", "y", json!({})).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Upstream, "{e:?}");
        assert!(e.retryable, "{e:?}");
        // The address (perhaps from `env://`) is not in the message.
        assert!(!e.message.contains("127.0.0.1"), "{e:?}");
        assert!(e.message.contains("refused"), "{e:?}");

        let e = MongoPool::connect(&cfg("mongo://nope")).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Other);
        assert!(!e.retryable);
    }

    /// The connector's `connect_timeout_ms` bounds the wait for a server
    /// (it was accepted and ignored: 5 s), and `query_timeout_ms` a whole
    /// query.
    #[tokio::test]
    async fn the_connectors_timeouts_apply() {
        let mut c = cfg("mongodb://127.0.0.1:1/");
        c.connect_timeout_ms = Some(300);
        let pool = MongoPool::connect(&c).await.unwrap();
        let started = std::time::Instant::now();
        let e = pool.find("x", "y", json!({})).await.unwrap_err();
        // Refused: an upstream failure, not a timeout.
        assert_eq!(e.kind, ConnectorErrorKind::Upstream, "{e:?}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        // A server that accepts and never answers: the query's own limit
        // ends the wait.
        let (port, held) = crate::connectors::silent_server().await;
        // Connecting to it runs out of the connector's connect timeout:
        // a timeout (504), not an upstream failure.
        let mut c = cfg(&format!("mongodb://127.0.0.1:{port}/"));
        c.connect_timeout_ms = Some(300);
        let pool = MongoPool::connect(&c).await.unwrap();
        let e = pool.find("x", "y", json!({})).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Timeout, "{e:?}");
        let mut c = cfg(&format!("mongodb://127.0.0.1:{port}/"));
        c.query_timeout_ms = Some(300);
        let pool = MongoPool::connect(&c).await.unwrap();
        let started = std::time::Instant::now();
        let e = pool.find("x", "y", json!({})).await.unwrap_err();
        assert_eq!(e.kind, ConnectorErrorKind::Timeout, "{e:?}");
        assert!(e.message.contains("after 300 ms"), "{}", e.message);
        assert!(started.elapsed() < Duration::from_secs(2));
        held.abort();
    }
}
