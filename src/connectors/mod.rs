//! Real connector clients: the registry of connector definitions loaded from
//! storage, the clients built from them (once per connector version), and the
//! shared call policy (retries, circuit breakers) every connector call goes
//! through. Implements the runtime's connector traits.
//!
//! The registry is one `ArcSwap` of name → [`Entry`]; a call loads it without
//! a lock. An entry keeps its built client in a `OnceCell`, and a reload
//! carries an entry over unchanged when the connector's version stamp is the
//! same, so clients and pools survive reloads and are rebuilt only for a
//! connector that changed. `env://VAR` strings are resolved when a client is
//! built, never stored resolved anywhere else.

pub mod cache;
pub mod http;
pub mod kafka;
pub mod mongo;
pub mod policy;
pub mod sql;
pub mod ssrf;

use crate::config::Config;
use crate::storage::{StorageError, Store};
use arc_swap::ArcSwap;
use async_trait::async_trait;
use serde_json::Value as Json;
use sluice_compiler::def::{ConnectorConfig, ConnectorDef, ConnectorType, RetryPolicy};
use sluice_runtime::connectors::{
    Cache, CallScope, ConnectorError, DocumentStore, FindRequest, HttpClient, HttpRequest,
    PublishRequest, Publisher, Services, SqlClient, SqlRequest,
};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

/// A connector's client, built on first use.
enum Built {
    Http(http::HttpConn),
    Sql(sql::SqlPool),
    Cache(cache::CacheStore),
    Mongo(mongo::MongoPool),
    Kafka(kafka::KafkaProducer),
}

/// One connector version: its definition (with `env://` references as
/// written) and, once built, its client.
struct Entry {
    name: String,
    /// Hash of the stored definition and `updated_at`: a different stamp is
    /// a different version (timestamps alone have one-second resolution).
    stamp: u64,
    /// The typed view of the unresolved config, or why it does not parse.
    typed: Result<ConnectorConfig, String>,
    def: ConnectorDef,
    built: tokio::sync::OnceCell<Built>,
}

impl Entry {
    fn retry(&self) -> RetryPolicy {
        match &self.typed {
            Ok(ConnectorConfig::Http(c)) => c.retry,
            Ok(ConnectorConfig::Db(c)) => c.retry,
            Ok(ConnectorConfig::Cache(c)) => c.retry,
            Ok(ConnectorConfig::Mongodb(c)) => c.retry,
            Ok(ConnectorConfig::Kafka(c)) => c.retry,
            Ok(ConnectorConfig::ObjectStorage(c)) => c.retry,
            Err(_) => RetryPolicy::default(),
        }
    }

    /// The typed config with every `env://VAR` string replaced by the
    /// variable's value. Errors name the variable, never a value.
    /// The typed config, and the values taken from the environment (none
    /// of which may appear in an answer, error or log line).
    fn resolved(&self) -> Result<(ConnectorConfig, Vec<String>), ConnectorError> {
        if let Err(e) = &self.typed {
            return Err(ConnectorError::other(format!(
                "connector '{}' has an invalid config: {e}",
                self.name
            )));
        }
        let mut def = self.def.clone();
        let mut from_env = Vec::new();
        def.config = resolve_env(&def.config, &self.name, &mut from_env)?;
        // Only strings changed and they were strings before, so this parses
        // as the unresolved config did; a failure here says nothing secret.
        let typed = def.typed().map_err(|_| {
            ConnectorError::other(format!(
                "connector '{}': a value taken from the environment does not fit its field",
                self.name
            ))
        })?;
        Ok((typed, from_env))
    }
}

/// Replaces `env://VAR` strings (whole strings only) at any depth; the
/// values put in are added to `from_env`.
fn resolve_env(
    v: &Json,
    connector: &str,
    from_env: &mut Vec<String>,
) -> Result<Json, ConnectorError> {
    Ok(match v {
        Json::String(s) => match s.strip_prefix("env://") {
            None => v.clone(),
            Some(var) => {
                let value = std::env::var(var).map_err(|e| {
                    let why = match e {
                        std::env::VarError::NotPresent => "is not set",
                        std::env::VarError::NotUnicode(_) => "is not valid UTF-8",
                    };
                    ConnectorError::other(format!(
                        "connector '{connector}': environment variable '{var}' {why}"
                    ))
                })?;
                from_env.push(value.clone());
                Json::String(value)
            }
        },
        Json::Array(items) => Json::Array(
            items
                .iter()
                .map(|i| resolve_env(i, connector, from_env))
                .collect::<Result<_, _>>()?,
        ),
        Json::Object(m) => Json::Object(
            m.iter()
                .map(|(k, i)| Ok((k.clone(), resolve_env(i, connector, from_env)?)))
                .collect::<Result<_, ConnectorError>>()?,
        ),
        _ => v.clone(),
    })
}

/// The forms in which a secret can come back in an upstream's answer or a
/// client's error text: as it is, JSON-escaped (an answer quoting it in a
/// JSON string), and, for a URL taken from the environment, its path and
/// query alone (an echo of the request line). Values shorter than six
/// characters are left out (masking them would mask ordinary text), and
/// the longest come first, so a longer form is masked before a part of it.
pub(crate) fn secret_forms(values: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    for v in values {
        if let Ok(text) = serde_json::to_string(&v) {
            let escaped = &text[1..text.len() - 1];
            if escaped != v {
                out.push(escaped.to_owned());
            }
        }
        out.push(v);
    }
    out.retain(|s| s.chars().count() >= 6);
    out.sort_by_key(|s| std::cmp::Reverse(s.len()));
    out.dedup();
    out
}

/// `text` with every one of `secrets` (longest first) replaced by the mask.
pub(crate) fn mask_values(text: &str, secrets: &[String]) -> String {
    let mut text = std::borrow::Cow::Borrowed(text);
    for s in secrets {
        if text.contains(s.as_str()) {
            text =
                std::borrow::Cow::Owned(text.replace(s.as_str(), sluice_compiler::validate::MASK));
        }
    }
    text.into_owned()
}

/// The process's connectors: registry, built clients and the call policy.
pub struct Connectors {
    entries: ArcSwap<HashMap<String, Arc<Entry>>>,
    pub policy: policy::Policy,
    http: http::HttpSettings,
    /// `kafka.enabled`: without it `publish_kafka` is a task error.
    kafka_enabled: bool,
    /// Reloads are serialized so two cannot interleave their swaps.
    reload_lock: tokio::sync::Mutex<()>,
}

impl Connectors {
    /// An empty registry (filled by [`Connectors::reload`]).
    pub fn new(config: &Config) -> Connectors {
        http::install_crypto_provider();
        Connectors {
            entries: ArcSwap::from_pointee(HashMap::new()),
            policy: policy::Policy::new(&config.engine.circuit_breaker),
            http: http::HttpSettings {
                allow_private_networks: config.security.allow_private_networks,
                default_timeout: Duration::from_secs(config.engine.global_http_timeout_secs.max(1)),
            },
            kafka_enabled: config.kafka.enabled,
            reload_lock: tokio::sync::Mutex::new(()),
        }
    }

    /// `services` with this registry filling every connector slot it
    /// implements that the caller left empty.
    pub fn fill(self: &Arc<Self>, mut services: Services) -> Services {
        if services.http.is_none() {
            services.http = Some(self.clone());
        }
        if services.sql.is_none() {
            services.sql = Some(self.clone());
        }
        if services.cache.is_none() {
            services.cache = Some(self.clone());
        }
        if services.documents.is_none() {
            services.documents = Some(self.clone());
        }
        if services.publisher.is_none() && self.kafka_enabled {
            services.publisher = Some(self.clone());
        }
        services
    }

    /// Loads every connector from storage; unchanged connectors keep their
    /// built clients. Returns how many are loaded.
    pub async fn reload(&self, store: &Store) -> Result<usize, StorageError> {
        let _guard = self.reload_lock.lock().await;
        let records = store.all_connectors().await?;
        let old = self.entries.load();
        let mut next = HashMap::with_capacity(records.len());
        let (mut kept, mut rebuilt) = (0usize, 0usize);
        for r in records {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            r.definition.to_string().hash(&mut hasher);
            r.updated_at.hash(&mut hasher);
            let stamp = hasher.finish();
            if let Some(e) = old.get(&r.id).filter(|e| e.stamp == stamp) {
                next.insert(r.id.clone(), e.clone());
                kept += 1;
                continue;
            }
            let def: ConnectorDef = match serde_json::from_value(r.definition.clone()) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(connector = %r.id, error = %e, "stored connector does not parse; calls to it fail");
                    continue;
                }
            };
            let typed = def.typed().map_err(|e| e.to_string());
            next.insert(
                r.id.clone(),
                Arc::new(Entry {
                    name: r.id.clone(),
                    stamp,
                    typed,
                    def,
                    built: tokio::sync::OnceCell::new(),
                }),
            );
            rebuilt += 1;
        }
        // A connector deleted or changed (a fixed URL, new credentials)
        // forgets its circuit breakers, here where every replica reloads
        // (audit 111: only the replica that answered the change forgot
        // them): the failures they counted were the old definition's, and
        // one created again under the name starts closed.
        for (name, entry) in old.iter() {
            if next.get(name).is_none_or(|e| e.stamp != entry.stamp) {
                self.policy.breakers.forget_connector(name);
            }
        }
        let n = next.len();
        self.entries.store(Arc::new(next));
        tracing::info!(connectors = n, kept, rebuilt, "connectors reloaded");
        Ok(n)
    }

    /// How many connectors are loaded.
    pub fn loaded(&self) -> usize {
        self.entries.load().len()
    }

    /// The type of the stored connector named `name` (`None`: no such
    /// connector is loaded).
    pub fn type_of(&self, name: &str) -> Option<sluice_compiler::def::ConnectorType> {
        self.entries.load().get(name).map(|e| e.def.connector_type)
    }

    /// The SQL dialect of the database connector `name`, when its
    /// connection string says it (not for an `env://` reference).
    pub fn sql_dialect(&self, name: &str) -> Option<sluice_compiler::sql::Dialect> {
        match &self.entries.load().get(name)?.typed {
            Ok(ConnectorConfig::Db(db)) => sluice_compiler::sql::Dialect::of(&db.connection_string),
            _ => None,
        }
    }

    fn entry(&self, name: &str) -> Result<Arc<Entry>, ConnectorError> {
        self.entries
            .load()
            .get(name)
            .cloned()
            .ok_or_else(|| ConnectorError::other(format!("connector '{name}' not found")))
    }

    /// The entry of `name` if it is a connector of type `ty`.
    fn entry_of(&self, name: &str, ty: ConnectorType) -> Result<Arc<Entry>, ConnectorError> {
        let entry = self.entry(name)?;
        if entry.def.connector_type != ty {
            return Err(wrong_type(&entry, ty.name()));
        }
        Ok(entry)
    }

    /// The entry's client, built on first use (a failed build is retried by
    /// the next call, not cached).
    async fn built<'e>(&self, entry: &'e Entry) -> Result<&'e Built, ConnectorError> {
        entry
            .built
            .get_or_try_init(|| async {
                let (config, from_env) = entry.resolved()?;
                Ok(match config {
                    ConnectorConfig::Http(cfg) => Built::Http(http::HttpConn::build(
                        &entry.name,
                        &cfg,
                        &self.http,
                        &from_env,
                    )?),
                    ConnectorConfig::Db(cfg) => Built::Sql(sql::SqlPool::connect(&cfg).await?),
                    ConnectorConfig::Cache(cfg) => {
                        Built::Cache(cache::CacheStore::connect(&cfg).await?)
                    }
                    ConnectorConfig::Mongodb(cfg) => {
                        Built::Mongo(mongo::MongoPool::connect(&cfg).await?)
                    }
                    ConnectorConfig::Kafka(cfg) => Built::Kafka(kafka::KafkaProducer::build(
                        &entry.name,
                        &cfg,
                        self.http.default_timeout,
                        &from_env,
                    )?),
                    ConnectorConfig::ObjectStorage(_) => {
                        return Err(ConnectorError::other(format!(
                            "connector '{}' ({}) has no client in this process",
                            entry.name,
                            entry.def.connector_type.name()
                        )));
                    }
                })
            })
            .await
    }
}

fn wrong_type(entry: &Entry, wanted: &str) -> ConnectorError {
    ConnectorError::other(format!(
        "connector '{}' is a {} connector, not {wanted}",
        entry.name,
        entry.def.connector_type.name()
    ))
}

fn mismatch(entry: &Entry) -> ConnectorError {
    ConnectorError::other(format!(
        "connector '{}' changed type while in use; try again",
        entry.name
    ))
}

#[async_trait]
impl HttpClient for Connectors {
    async fn call(&self, scope: &CallScope, req: HttpRequest) -> Result<Json, ConnectorError> {
        let entry = self.entry_of(&req.connector, ConnectorType::Http)?;
        let (entry, req) = (&entry, &req);
        self.policy
            .call_as(
                scope,
                "http_call",
                &req.connector,
                &entry.retry(),
                || async move {
                    match self.built(entry).await? {
                        Built::Http(c) => c.send(scope, req).await,
                        _ => Err(mismatch(entry)),
                    }
                },
            )
            .await
    }
}

#[async_trait]
impl Publisher for Connectors {
    async fn publish(&self, scope: &CallScope, req: PublishRequest) -> Result<(), ConnectorError> {
        let entry = self.entry_of(&req.connector, ConnectorType::Kafka)?;
        let (entry, req) = (&entry, &req);
        self.policy
            .call_as(
                scope,
                "publish_kafka",
                &req.connector,
                &entry.retry(),
                || async move {
                    match self.built(entry).await? {
                        Built::Kafka(p) => p.publish(scope, req).await,
                        _ => Err(mismatch(entry)),
                    }
                },
            )
            .await
            .map_err(|e| e.naming(&req.connector))
    }
}

#[async_trait]
impl SqlClient for Connectors {
    async fn read(&self, scope: &CallScope, req: SqlRequest) -> Result<Vec<Json>, ConnectorError> {
        let entry = self.entry_of(&req.connector, ConnectorType::Db)?;
        let (entry, req) = (&entry, &req);
        self.policy
            .call_as(
                scope,
                "db_read",
                &req.connector,
                &entry.retry(),
                || async move {
                    match self.built(entry).await? {
                        Built::Sql(p) => p.read(&req.query, &req.params).await,
                        _ => Err(mismatch(entry)),
                    }
                },
            )
            .await
            .map_err(|e| e.naming(&req.connector))
    }

    async fn write(&self, scope: &CallScope, req: SqlRequest) -> Result<u64, ConnectorError> {
        let entry = self.entry_of(&req.connector, ConnectorType::Db)?;
        let (entry, req) = (&entry, &req);
        self.policy
            .call_as(
                scope,
                "db_write",
                &req.connector,
                &entry.retry(),
                || async move {
                    match self.built(entry).await? {
                        Built::Sql(p) => p.write(&req.query, &req.params).await,
                        _ => Err(mismatch(entry)),
                    }
                },
            )
            .await
            .map_err(|e| e.naming(&req.connector))
    }
}

#[async_trait]
impl Cache for Connectors {
    async fn get(
        &self,
        scope: &CallScope,
        connector: &str,
        key: &str,
    ) -> Result<Option<String>, ConnectorError> {
        let entry = self.entry_of(connector, ConnectorType::Cache)?;
        let entry = &entry;
        self.policy
            .call_as(
                scope,
                "cache_read",
                connector,
                &entry.retry(),
                || async move {
                    match self.built(entry).await? {
                        Built::Cache(c) => c.get(key).await,
                        _ => Err(mismatch(entry)),
                    }
                },
            )
            .await
            .map_err(|e| e.naming(connector))
    }

    async fn set(
        &self,
        scope: &CallScope,
        connector: &str,
        key: &str,
        value: String,
        ttl: Option<std::time::Duration>,
    ) -> Result<(), ConnectorError> {
        let entry = self.entry_of(connector, ConnectorType::Cache)?;
        let (entry, value) = (&entry, &value);
        self.policy
            .call_as(
                scope,
                "cache_write",
                connector,
                &entry.retry(),
                || async move {
                    match self.built(entry).await? {
                        Built::Cache(c) => c.set(key, value.clone(), ttl).await,
                        _ => Err(mismatch(entry)),
                    }
                },
            )
            .await
            .map_err(|e| e.naming(connector))
    }
}

#[async_trait]
impl DocumentStore for Connectors {
    async fn find(&self, scope: &CallScope, req: FindRequest) -> Result<Vec<Json>, ConnectorError> {
        let entry = self.entry_of(&req.connector, ConnectorType::Mongodb)?;
        let (entry, req) = (&entry, &req);
        self.policy
            .call_as(
                scope,
                "mongo_read",
                &req.connector,
                &entry.retry(),
                || async move {
                    match self.built(entry).await? {
                        Built::Mongo(m) => {
                            m.find(&req.database, &req.collection, req.filter.clone())
                                .await
                        }
                        _ => Err(mismatch(entry)),
                    }
                },
            )
            .await
            .map_err(|e| e.naming(&req.connector))
    }
}

/// A TCP server that accepts connections and never answers (a database or
/// broker that hangs), for the connectors' timeout tests: its port, and
/// the task holding the connections (abort it when done).
#[cfg(test)]
pub(crate) async fn silent_server() -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            open.push(sock);
        }
    });
    (port, held)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn env_references_resolve_and_missing_ones_name_the_variable() {
        // Setting a variable needs `unsafe` in edition 2024 (and the crate
        // forbids it), so the test reads one every environment has.
        let path = std::env::var("PATH").unwrap();
        let v = json!({"a": "env://PATH", "b": ["env://PATH", 1], "c": "plain env://PATH"});
        let mut from_env = Vec::new();
        let r = resolve_env(&v, "c1", &mut from_env).unwrap();
        assert_eq!(r["a"], json!(path));
        assert_eq!(r["b"][0], json!(path));
        assert_eq!(r["c"], "plain env://PATH");
        // Every value put in is remembered, to be masked wherever it shows.
        assert_eq!(from_env, [path.clone(), path]);
        let e = resolve_env(
            &json!({"t": "env://SLUICE_SURELY_UNSET_VAR_1"}),
            "c1",
            &mut from_env,
        )
        .unwrap_err();
        assert_eq!(
            e.message,
            "connector 'c1': environment variable 'SLUICE_SURELY_UNSET_VAR_1' is not set"
        );
        assert!(!e.retryable);
    }

    #[test]
    fn secrets_are_masked_in_their_escaped_forms_too() {
        let forms = secret_forms(["tok\"quote\\slash99".to_owned(), "short".to_owned()]);
        assert_eq!(forms, ["tok\\\"quote\\\\slash99", "tok\"quote\\slash99"]);
        let text = "denied: Bearer tok\\\"quote\\\\slash99 (raw tok\"quote\\slash99), short";
        assert_eq!(
            mask_values(text, &forms),
            "denied: Bearer ****** (raw ******), short"
        );
    }
}
