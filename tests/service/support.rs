//! Test support: a fresh database per test on each backend, the real server
//! started in-process on `127.0.0.1:0`, and a small HTTP client.
//!
//! PostgreSQL and MariaDB must be running (`scripts/test.sh` starts them with
//! `../shared/services/`); a test fails, never skips, when one is missing.

use reqwest::Method;
use serde_json::{Value as Json, json};
use sluice::app::App;
use sluice::config::Config;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Db {
    Sqlite,
    Postgres,
    MySql,
}

const PG_ADMIN: &str = "postgres://postgres@127.0.0.1:5432/test";
const MY_ADMIN: &str = "mysql://root@127.0.0.1:3306/test";

/// A name nobody else uses (databases, topics, groups, keys).
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// A URL for a database nobody else uses.
pub async fn fresh_database(db: Db) -> String {
    use sqlx::Connection;
    match db {
        Db::Sqlite => {
            let dir = std::env::temp_dir().join("sluice-tests");
            std::fs::create_dir_all(&dir).unwrap();
            format!(
                "sqlite://{}",
                dir.join(format!("{}.db", unique("t"))).display()
            )
        }
        Db::Postgres => {
            let name = unique("sluice_t");
            let mut conn = sqlx::PgConnection::connect(PG_ADMIN)
                .await
                .unwrap_or_else(|e| panic!("PostgreSQL at {PG_ADMIN} is required (bash ../shared/services/postgres.sh): {e}"));
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&mut conn)
                .await
                .unwrap();
            format!("postgres://postgres@127.0.0.1:5432/{name}")
        }
        Db::MySql => {
            let name = unique("sluice_t");
            let mut conn = sqlx::MySqlConnection::connect(MY_ADMIN)
                .await
                .unwrap_or_else(|e| panic!("MariaDB at {MY_ADMIN} is required (bash ../shared/services/mariadb.sh): {e}"));
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&mut conn)
                .await
                .unwrap();
            format!("mysql://root@127.0.0.1:3306/{name}")
        }
    }
}

/// A loopback port free right now (for a spawned `sluice serve`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Installs the TLS crypto provider reqwest needs (start-up does it too;
/// tests that only spawn the binary call this first).
/// An admin call on a binary started by the test (not a [`TestServer`]):
/// asserts success and answers the body (null when there is none).
pub async fn admin_call(
    c: &reqwest::Client,
    base: &str,
    method: &str,
    path: &str,
    body: Json,
) -> Json {
    let r = c
        .request(
            method.parse().unwrap(),
            format!("{base}/api/v1/admin{path}"),
        )
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let body: Json = r.json().await.unwrap_or(Json::Null);
    assert!(status.is_success(), "{method} {path}: {status} {body}");
    body
}

/// Waits (30 s at most) until the binary started at `base` is ready.
pub async fn wait_ready(base: &str) {
    let client = reqwest::Client::new();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !client
        .get(format!("{base}/readyz"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(
            std::time::Instant::now() < until,
            "{base} did not become ready"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

pub fn install_crypto() {
    sluice::connectors::http::install_crypto_provider();
}

/// A running server and a client for it.
pub struct TestServer {
    pub base: String,
    pub app: Arc<App>,
    pub client: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    running: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Starts the real server on a fresh database.
pub async fn start(db: Db) -> TestServer {
    start_with(db, |_| {}).await
}

pub async fn start_with(db: Db, adjust: impl FnOnce(&mut Config)) -> TestServer {
    start_with_services(db, adjust, Default::default()).await
}

/// The real server with some connector implementations supplied by the
/// test (a misbehaving one); the others are the real clients.
pub async fn start_with_services(
    db: Db,
    adjust: impl FnOnce(&mut Config),
    services: sluice_runtime::connectors::Services,
) -> TestServer {
    let mut config = Config::default();
    config.storage.url = fresh_database(db).await;
    config.storage.max_connections = 8;
    config.storage.backup_dir = std::env::temp_dir()
        .join("sluice-tests")
        .join(unique("backups"))
        .display()
        .to_string();
    config.server.shutdown_drain_secs = 1;
    adjust(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = sluice::start_with_services(config, services)
        .await
        .expect("service starts");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(sluice::server::run(listener, app.clone(), async {
        let _ = rx.await;
    }));
    TestServer {
        base: format!("http://{addr}"),
        app,
        client: reqwest::Client::new(),
        stop: Some(tx),
        running: Some(running),
    }
}

/// One response, read whole.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Json,
    pub text: String,
}

impl Resp {
    /// Asserts the error envelope: status, code, and that `message` is a string.
    #[track_caller]
    pub fn error(&self, status: u16, code: &str) -> &Json {
        assert_eq!(self.status, status, "body: {}", self.text);
        assert_eq!(self.body["error"]["code"], code, "body: {}", self.text);
        assert!(
            self.body["error"]["message"].is_string(),
            "body: {}",
            self.text
        );
        &self.body["error"]
    }

    #[track_caller]
    pub fn ok(&self, status: u16) -> &Json {
        assert_eq!(self.status, status, "body: {}", self.text);
        &self.body["data"]
    }

    /// The `field`s of `error.details`.
    pub fn detail_fields(&self) -> Vec<String> {
        self.body["error"]["details"]
            .as_array()
            .map(|d| {
                d.iter()
                    .map(|x| x["field"].as_str().unwrap_or_default().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl TestServer {
    /// Signals shutdown and waits until the server has drained and returned.
    pub async fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(running) = self.running.take() {
            running.await.unwrap();
        }
    }

    pub async fn call(&self, method: &str, path: &str, body: Option<Json>) -> Resp {
        self.send(method, path, body, &[]).await
    }

    pub async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<Json>,
        headers: &[(&str, &str)],
    ) -> Resp {
        let mut req = self.client.request(
            Method::from_bytes(method.as_bytes()).unwrap(),
            format!("{}{path}", self.base),
        );
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(body) = body {
            req = req
                .header("content-type", "application/json")
                .body(body.to_string());
        }
        let resp = req.send().await.expect("request reaches the server");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Json::Null);
        Resp {
            status,
            headers,
            body,
            text,
        }
    }

    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        body: Vec<u8>,
        content_type: Option<&str>,
    ) -> Resp {
        let headers: Vec<(&str, &str)> = content_type
            .map(|ct| ("content-type", ct))
            .into_iter()
            .collect();
        self.raw_with(method, path, body, &headers).await
    }

    /// A request with the body as given and exactly these headers.
    pub async fn raw_with(
        &self,
        method: &str,
        path: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Resp {
        let mut req = self.client.request(
            Method::from_bytes(method.as_bytes()).unwrap(),
            format!("{}{path}", self.base),
        );
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.body(body).send().await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Json::Null);
        Resp {
            status,
            headers,
            body,
            text,
        }
    }

    pub async fn get(&self, path: &str) -> Resp {
        self.call("GET", path, None).await
    }

    pub async fn post(&self, path: &str, body: Json) -> Resp {
        self.call("POST", path, Some(body)).await
    }

    pub async fn admin(&self, method: &str, path: &str, body: Option<Json>) -> Resp {
        self.call(method, &format!("/api/v1/admin{path}"), body)
            .await
    }

    /// Creates an `http` connector to `url` without retries.
    pub async fn http_connector(&self, name: &str, url: &str) {
        self.admin(
            "POST",
            "/connectors",
            Some(json!({"name": name, "connector_type": "http",
                "config": {"type": "http", "url": url, "retry": {"max_retries": 0, "retry_delay_ms": 10}}})),
        )
        .await
        .ok(201);
    }

    /// Creates and activates a workflow and a channel.
    pub async fn deploy(&self, workflow: Json, channel: Json) {
        self.create_active("workflows", workflow).await;
        self.create_active("channels", channel).await;
    }

    /// Creates a workflow or channel (`collection`: `workflows`,
    /// `channels`) and activates it.
    pub async fn create_active(&self, collection: &str, def: Json) {
        let id_field = if collection == "workflows" {
            "workflow_id"
        } else {
            "channel_id"
        };
        let id = def[id_field].as_str().unwrap().to_owned();
        self.admin("POST", &format!("/{collection}"), Some(def))
            .await
            .ok(201);
        self.admin(
            "PATCH",
            &format!("/{collection}/{id}/status"),
            Some(json!({"status": "active"})),
        )
        .await
        .ok(200);
    }
}

pub fn shared(rel: &str) -> Json {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared")
        .join(rel);
    serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

pub fn workflow(id: &str) -> Json {
    json!({
        "workflow_id": id,
        "name": format!("workflow {id}"),
        "tags": ["test"],
        "tasks": [
            {"id": "parse", "name": "Parse", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}},
            {"id": "greet", "name": "Greet", "function": {"name": "map", "input": {"mappings": [
                {"path": "greeting", "logic": {"cat": ["hello ", {"var": "data.in.name"}]}}
            ]}}}
        ]
    })
}

pub fn channel(id: &str, workflow_id: &str) -> Json {
    json!({
        "channel_id": id,
        "name": id,
        "channel_type": "sync",
        "protocol": "rest",
        "route_pattern": format!("/{id}/{{item}}"),
        "methods": ["POST"],
        "workflow_id": workflow_id,
        "config_json": {"timeout_ms": 5000}
    })
}

/// Runs an async test body once per backend, as three `#[tokio::test]`s.
#[macro_export]
macro_rules! on_every_backend {
    ($name:ident, $body:path) => {
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                $body($crate::support::Db::Sqlite).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                $body($crate::support::Db::Postgres).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mariadb() {
                $body($crate::support::Db::MySql).await
            }
        }
    };
}

/// Where governance keeps its state in a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gov {
    Memory,
    Redis,
}

/// The test Redis (../shared/services/redis.sh).
pub const REDIS_URL: &str = "redis://127.0.0.1:6379/";

/// Points `c` at `gov`; with Redis, under a key prefix of its own so runs
/// and parallel tests never share buckets or windows.
pub fn governance(c: &mut Config, gov: Gov) {
    if gov == Gov::Redis {
        c.governance.backend = sluice::config::GovernanceBackend::Redis;
        c.governance.redis_url = REDIS_URL.into();
        c.governance.key_prefix = unique("sluice-test");
    }
}

/// A SQLite-backed server with governance state in `gov`.
pub async fn start_gov(gov: Gov, adjust: impl FnOnce(&mut Config)) -> TestServer {
    start_with(Db::Sqlite, |c| {
        governance(c, gov);
        adjust(c);
    })
    .await
}

/// Runs an async test body once per governance backend.
#[macro_export]
macro_rules! on_both_governance_backends {
    ($name:ident, $body:path) => {
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                $body($crate::support::Gov::Memory).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                $body($crate::support::Gov::Redis).await
            }
        }
    };
}

/// A local upstream that answers every request after `delay`: an I/O-bound
/// slow request (a CPU-bound one would hold a runtime worker and make what
/// the test observes depend on the scheduler).
pub async fn slow_upstream(delay: std::time::Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                let mut seen = Vec::new();
                // Read the request head and whatever body its length announces.
                loop {
                    let n = stream.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&seen).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if seen.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                tokio::time::sleep(delay).await;
                let body = "{\"ok\":true}";
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}")
}

/// Deploys channel `id` whose workflow calls the slow upstream.
pub async fn deploy_io_slow(s: &TestServer, id: &str, upstream: &str, config_json: Json) {
    s.http_connector(&format!("{id}-up"), upstream).await;
    let wf = json!({"workflow_id": id, "name": id, "tasks": [
        {"id": "call", "name": "call", "function": {"name": "http_call", "input": {
            "connector": format!("{id}-up"), "method": "POST", "path": "/slow", "response_path": "upstream"}}}
    ]});
    s.deploy(
        wf,
        json!({
            "channel_id": id, "name": id, "channel_type": "sync", "protocol": "rest",
            "route_pattern": format!("/{id}"), "methods": ["POST"], "workflow_id": id,
            "config_json": config_json
        }),
    )
    .await;
}

/// The test broker (../shared/services/kafka.sh).
pub const KAFKA_BROKERS: &str = "127.0.0.1:9092";

/// Creates `topics` (with `partitions` each) unless they exist, so consumers
/// that subscribe before anything was produced see them at once instead of
/// after librdkafka's next metadata refresh.
pub async fn kafka_topics(topics: &[&str], partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", KAFKA_BROKERS)
        .create()
        .expect("kafka admin client");
    let new: Vec<NewTopic> = topics
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(1)))
        .collect();
    let results = admin
        .create_topics(&new, &AdminOptions::new())
        .await
        .expect("create topics");
    for r in results {
        if let Err((topic, code)) = r {
            assert_eq!(
                code,
                rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists,
                "creating {topic}"
            );
        }
    }
}

/// A consumer of `topics` in a group of its own, reading from the start,
/// with the short session timeout the stand-in broker needs (README of
/// ../shared/services) and a fast metadata refresh.
pub async fn kafka_reader(topics: &[&str]) -> rdkafka::consumer::StreamConsumer {
    use rdkafka::consumer::Consumer as _;
    kafka_topics(topics, 1).await;
    let c: rdkafka::consumer::StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", KAFKA_BROKERS)
        .set("group.id", unique("test-reader"))
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("enable.auto.commit", "false")
        .set("topic.metadata.refresh.interval.ms", "1000")
        .create()
        .expect("kafka consumer");
    c.subscribe(topics).expect("subscribe");
    c
}

/// A producer for the test broker (no batching wait).
pub fn kafka_producer() -> rdkafka::producer::FutureProducer {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", KAFKA_BROKERS)
        .set("linger.ms", "0")
        .create()
        .expect("a Kafka producer")
}

/// One message to produce: a partition of its own choosing (else the key's),
/// key, value and headers.
#[derive(Default, Clone, Copy)]
pub struct Record<'a> {
    pub partition: Option<i32>,
    pub key: Option<&'a str>,
    pub value: &'a [u8],
    pub headers: &'a [(&'a str, &'a str)],
}

/// Produces `r` to `topic` and waits for the broker: its (partition, offset).
pub async fn kafka_produce(
    p: &rdkafka::producer::FutureProducer,
    topic: &str,
    r: Record<'_>,
) -> (i32, i64) {
    use rdkafka::message::{Header, OwnedHeaders};
    let mut h = OwnedHeaders::new();
    for (k, v) in r.headers {
        h = h.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    let mut record = rdkafka::producer::FutureRecord::to(topic)
        .payload(r.value)
        .headers(h);
    if let Some(k) = r.key {
        record = record.key(k);
    }
    if let Some(partition) = r.partition {
        record = record.partition(partition);
    }
    let delivery = p
        .send(
            record,
            rdkafka::util::Timeout::After(std::time::Duration::from_secs(10)),
        )
        .await
        .expect("Kafka at 127.0.0.1:9092 is required (bash ../shared/services/kafka.sh)");
    (delivery.partition, delivery.offset)
}

/// The offsets `group` has committed on partitions `0..partitions` of
/// `topic` (`None`: nothing committed), asked of the broker directly.
pub async fn kafka_committed(group: &str, topic: &str, partitions: i32) -> Vec<Option<i64>> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let (group, topic) = (group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", KAFKA_BROKERS)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("kafka consumer");
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        let committed = c
            .committed_offsets(tpl, std::time::Duration::from_secs(10))
            .expect("committed offsets");
        (0..partitions)
            .map(
                |p| match committed.find_partition(&topic, p).map(|e| e.offset()) {
                    Some(rdkafka::Offset::Offset(n)) => Some(n),
                    _ => None,
                },
            )
            .collect()
    })
    .await
    .unwrap()
}

/// One request a [`recording_upstream`] received.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

/// What a [`recording_upstream`] saw: requests in arrival order and how many
/// were open at once.
#[derive(Debug, Default)]
pub struct Recorded {
    pub requests: std::sync::Mutex<Vec<Seen>>,
    open: std::sync::atomic::AtomicUsize,
    pub peak: std::sync::atomic::AtomicUsize,
}

impl Recorded {
    pub fn requests(&self) -> Vec<Seen> {
        self.requests.lock().unwrap().clone()
    }

    pub fn peak(&self) -> usize {
        self.peak.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A local HTTP upstream that records each request (path and trace
/// headers) as it arrives, holds it `delay` (counting the requests open at
/// once) and answers `{"ok": true}`.
pub async fn recording_upstream(delay: std::time::Duration) -> (String, Arc<Recorded>) {
    use http_body_util::BodyExt as _;
    use std::sync::atomic::Ordering;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let recorded: Arc<Recorded> = Arc::default();
    let rec = recorded.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let rec = rec.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let rec = rec.clone();
                        async move {
                            let header = |n: &str| {
                                req.headers()
                                    .get(n)
                                    .and_then(|v| v.to_str().ok())
                                    .map(str::to_owned)
                            };
                            let (traceparent, tracestate) =
                                (header("traceparent"), header("tracestate"));
                            let path = req.uri().path().to_owned();
                            // Read whole before the request counts as open.
                            let _ = req.into_body().collect().await;
                            let now = rec.open.fetch_add(1, Ordering::SeqCst) + 1;
                            rec.peak.fetch_max(now, Ordering::SeqCst);
                            rec.requests.lock().unwrap().push(Seen {
                                path,
                                traceparent,
                                tracestate,
                            });
                            tokio::time::sleep(delay).await;
                            rec.open.fetch_sub(1, Ordering::SeqCst);
                            Ok::<_, std::convert::Infallible>(
                                hyper::Response::builder()
                                    .header("content-type", "application/json")
                                    .body(http_body_util::Full::new(bytes::Bytes::from_static(
                                        b"{\"ok\":true}",
                                    )))
                                    .unwrap(),
                            )
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                    .await;
            });
        }
    });
    (format!("http://{addr}"), recorded)
}

/// Runs `body` on worker stacks as large as the service's own: deep values
/// need them (an unoptimised build's frames are about 40 times larger than
/// a release build's).
pub fn on_service_stacks(body: impl std::future::Future<Output = ()>) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_stack_size(sluice::engine::THREAD_STACK_BYTES)
        .enable_all()
        .build()
        .unwrap()
        .block_on(body);
}
