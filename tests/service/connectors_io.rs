//! The database, cache, document and Kafka functions end to end: the real
//! service over HTTP, its connectors talking to the real PostgreSQL, MariaDB,
//! SQLite, Redis, MongoDB-compatible and Kafka-compatible servers that
//! `scripts/test.sh` starts (`../shared/services/`). The README's worked
//! example (PostgreSQL, HTTP, Redis) runs in `readme.rs`.

use crate::support::{Db, TestServer, free_port, fresh_database, kafka_reader, start_with, unique};
use rdkafka::Message as _;
use rdkafka::message::Headers as _;
use serde_json::{Value as Json, json};
use std::time::Duration;

const REDIS: &str = "redis://127.0.0.1:6379/";
const MONGO: &str = "mongodb://127.0.0.1:27017/";
const KAFKA: &str = "127.0.0.1:9092";

async fn service(kafka: bool) -> TestServer {
    start_with(Db::Sqlite, |c| {
        c.kafka.enabled = kafka;
        c.kafka.brokers = KAFKA.into();
    })
    .await
}

async fn connector(s: &TestServer, name: &str, config: Json) {
    let ty = config["type"].as_str().unwrap().to_owned();
    s.admin(
        "POST",
        "/connectors",
        Some(json!({"name": name, "connector_type": ty, "config": config})),
    )
    .await
    .ok(201);
}

/// Deploys channel `id` (a REST route `/<id>/{id}`) running `tasks`.
async fn deploy(s: &TestServer, id: &str, tasks: Json) {
    s.deploy(
        json!({"workflow_id": id, "name": id, "tasks": tasks}),
        json!({"channel_id": id, "name": id, "channel_type": "sync", "protocol": "rest",
               "route_pattern": format!("/{id}/{{id}}"), "methods": ["POST"],
               "workflow_id": id, "config_json": {"timeout_ms": 15000}}),
    )
    .await;
}

fn task(id: &str, function: &str, input: Json) -> Json {
    json!({"id": id, "name": id, "function": {"name": function, "input": input}})
}

async fn redis_get(key: &str) -> Option<String> {
    let client = redis::Client::open(REDIS).unwrap();
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("Redis at 127.0.0.1:6379 is required (bash ../shared/services/redis.sh)");
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap()
}

async fn redis_set(key: &str, value: &str) {
    let client = redis::Client::open(REDIS).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("EX")
        .arg(60)
        .query_async::<()>(&mut conn)
        .await
        .unwrap();
}

async fn redis_ttl(key: &str) -> i64 {
    let client = redis::Client::open(REDIS).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("TTL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// `db_write` then `db_read` through the data plane on MariaDB and SQLite
/// (`?` placeholders), params bound from the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_write_then_read_on_mariadb_and_sqlite() {
    for backend in [Db::MySql, Db::Sqlite] {
        let mut db_url = fresh_database(backend).await;
        if backend == Db::Sqlite {
            // A connector never creates a missing SQLite file unless asked.
            db_url.push_str("?mode=rwc");
        }
        let s = service(false).await;
        connector(&s, "db", json!({"type": "db", "connection_string": db_url})).await;
        let ddl = "CREATE TABLE IF NOT EXISTS items (id INTEGER PRIMARY KEY, label VARCHAR(64) NOT NULL, qty INTEGER, price DOUBLE)";
        deploy(
            &s,
            "items",
            json!([
                task("ddl", "db_write", json!({"connector": "db", "query": ddl, "output": "temp_data.ddl"})),
                task("insert", "db_write", json!({"connector": "db",
                    "query": "INSERT INTO items (id, label, qty, price) VALUES (?, ?, ?, ?)",
                    "params": [{"var": "metadata.path.id"}, {"var": "payload.label"}, {"var": "payload.qty"}, 2.5],
                    "output": "written"})),
                task("read", "db_read", json!({"connector": "db",
                    "query": "SELECT id, label, qty, price FROM items WHERE id = ?",
                    "params": [{"var": "metadata.path.id"}], "output": "rows"}))
            ]),
        )
        .await;
        let r = s
            .post(
                "/api/v1/data/items/7",
                json!({"data": {"label": "bolt", "qty": null}}),
            )
            .await;
        assert_eq!(r.status, 200, "{backend:?}: {}", r.text);
        assert_eq!(r.body["data"]["written"], json!({"rows_affected": 1}));
        assert_eq!(
            r.body["data"]["rows"],
            json!([{"id": 7, "label": "bolt", "qty": null, "price": 2.5}]),
            "{backend:?}"
        );
        // Without `output`, the rows replace `data` (its default), so the
        // answer's `data` is the row array.
        deploy(
            &s,
            "labels",
            json!([task("read", "db_read", json!({"connector": "db",
                "query": "SELECT label FROM items WHERE id = ?", "params": [{"var": "metadata.path.id"}]}))]),
        )
        .await;
        let r = s.post("/api/v1/data/labels/7", json!({"data": {}})).await;
        assert_eq!(r.status, 200, "{backend:?}: {}", r.text);
        assert_eq!(r.body["data"], json!([{"label": "bolt"}]), "{backend:?}");
        // The same id again violates the primary key: an upstream error naming it.
        let r = s
            .post(
                "/api/v1/data/items/7",
                json!({"data": {"label": "nut", "qty": 1}}),
            )
            .await;
        let e = r.error(502, "UPSTREAM_ERROR");
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .to_lowercase()
                .contains("duplicate")
                || e["message"].as_str().unwrap().contains("UNIQUE"),
            "{backend:?}: {}",
            r.text
        );
    }
}

/// `db_write` then `db_read` through the data plane on PostgreSQL (`$n`
/// placeholders; a path parameter is text, so the query casts it): params
/// bound from the request, and rows typed as the
/// columns are (integers, text, booleans, double, NULL, JSONB, timestamps in
/// RFC 3339).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_write_then_read_on_postgres() {
    use sqlx::Connection as _;
    let db_url = fresh_database(Db::Postgres).await;
    let mut db = sqlx::PgConnection::connect(&db_url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, item TEXT NOT NULL, paid BOOLEAN NOT NULL,
                              total DOUBLE PRECISION, extra JSONB, placed TIMESTAMPTZ NOT NULL)",
    )
    .execute(&mut db)
    .await
    .unwrap();
    let s = service(false).await;
    connector(&s, "pg", json!({"type": "db", "connection_string": db_url})).await;
    deploy(
        &s,
        "orders",
        json!([
            task("insert", "db_write", json!({"connector": "pg",
                "query": "INSERT INTO orders (id, item, paid, total, extra, placed) VALUES ($1::bigint, $2, $3, $4, CAST($5 AS JSONB), $6::timestamptz)",
                "params": [{"var": "metadata.path.id"}, {"var": "payload.item"}, {"var": "payload.paid"},
                           {"var": "payload.total"}, {"var": "payload.extra"}, {"var": "payload.placed"}],
                "output": "written"})),
            task("pay", "db_write", json!({"connector": "pg",
                "query": "UPDATE orders SET paid = NOT paid WHERE id = $1::bigint OR item = $2",
                "params": [{"var": "metadata.path.id"}, "never-matches"], "output": "updated"})),
            task("read", "db_read", json!({"connector": "pg",
                "query": "SELECT id, item, paid, total, extra, placed FROM orders WHERE id = $1::bigint",
                "params": [{"var": "metadata.path.id"}], "output": "rows"}))
        ]),
    )
    .await;
    let r = s
        .post(
            "/api/v1/data/orders/41",
            json!({"data": {"item": "lamp", "paid": false, "total": null,
                            "extra": {"gift": true}, "placed": "2026-11-22T10:15:00+01:00"}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"]["written"], json!({"rows_affected": 1}));
    assert_eq!(r.body["data"]["updated"], json!({"rows_affected": 1}));
    assert_eq!(
        r.body["data"]["rows"],
        json!([{"id": 41, "item": "lamp", "paid": true, "total": null,
                "extra": {"gift": true}, "placed": "2026-11-22T09:15:00Z"}])
    );
    // The row really is in PostgreSQL.
    let (item, paid): (String, bool) =
        sqlx::query_as("SELECT item, paid FROM orders WHERE id = 41")
            .fetch_one(&mut db)
            .await
            .unwrap();
    assert_eq!((item.as_str(), paid), ("lamp", true));
    // A constraint violation is an upstream error naming it, not retried.
    let r = s
        .post(
            "/api/v1/data/orders/41",
            json!({"data": {"item": "again", "paid": true, "total": 1.5, "extra": null,
                            "placed": "2026-11-22T10:15:00Z"}}),
        )
        .await;
    let m = r.error(502, "UPSTREAM_ERROR")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(m.contains("duplicate key"), "{m}");
    assert!(!m.contains("after"), "not retried: {m}");
    // Named by connector: a workflow may use several databases.
    assert!(
        m.contains("db_write: connector 'pg': database error: "),
        "{m}"
    );
}

/// The circuit breaker guards every connector, not only HTTP: a `db`
/// connector whose server is down fails with 502 until `failure_threshold`
/// failures in a row open its breaker, then answers 503 without trying, and
/// the breaker is listed by the admin API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_db_connector_that_is_down_opens_its_breaker() {
    let s = start_with(Db::Sqlite, |c| {
        c.engine.circuit_breaker.failure_threshold = 2;
        c.engine.circuit_breaker.recovery_timeout_secs = 60;
    })
    .await;
    let down = format!("postgres://postgres@127.0.0.1:{}/nothing", free_port());
    connector(
        &s,
        "down",
        json!({"type": "db", "connection_string": down, "connect_timeout_ms": 2000,
               "retry": {"max_retries": 0, "retry_delay_ms": 10}}),
    )
    .await;
    deploy(
        &s,
        "reads",
        json!([task(
            "q",
            "db_read",
            json!({"connector": "down", "query": "SELECT 1"})
        )]),
    )
    .await;
    for _ in 0..2 {
        let r = s.post("/api/v1/data/reads/1", json!({"data": {}})).await;
        let m = r.error(502, "UPSTREAM_ERROR")["message"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(m.contains("db_read: connector 'down': "), "{m}");
    }
    let r = s.post("/api/v1/data/reads/1", json!({"data": {}})).await;
    let m = r.error(503, "SERVICE_UNAVAILABLE")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(m.contains("circuit breaker 'reads:down' is open"), "{m}");

    let r = s.admin("GET", "/connectors/circuit-breakers", None).await;
    let b = &r.ok(200)[0];
    assert_eq!(
        (
            &b["key"],
            &b["channel"],
            &b["connector"],
            &b["state"],
            &b["consecutive_failures"]
        ),
        (
            &json!("reads:down"),
            &json!("reads"),
            &json!("down"),
            &json!("open"),
            &json!(2)
        ),
        "{}",
        r.text
    );
    assert!(b["opened_at"].is_string(), "{b}");
}

/// Connector clients live across reloads: a value written to a memory
/// cache is still there after an engine reload and a connector reload (the
/// same store serves), and gone after a PUT that changes the connector
/// (a new store is built for the new version).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_cache_clients_survive_reloads_and_are_rebuilt_on_change() {
    let s = service(false).await;
    let cache = |max: u64| json!({"type": "cache", "backend": "memory", "max_entries": max});
    connector(&s, "mem", cache(100)).await;
    deploy(
        &s,
        "put",
        json!([task(
            "w",
            "cache_write",
            json!({"connector": "mem", "key": "k",
            "value_logic": {"var": "payload.v"}})
        )]),
    )
    .await;
    deploy(
        &s,
        "get",
        json!([task(
            "r",
            "cache_read",
            json!({"connector": "mem", "key": "k", "output": "v"})
        )]),
    )
    .await;
    let get = || async {
        let r = s.post("/api/v1/data/get/1", json!({"data": {}})).await;
        assert_eq!(r.status, 200, "{}", r.text);
        r.body["data"]["v"].clone()
    };
    let r = s
        .post("/api/v1/data/put/1", json!({"data": {"v": "kept"}}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(get().await, "kept");

    s.admin("POST", "/engine/reload", None).await.ok(200);
    assert_eq!(get().await, "kept", "after an engine reload");
    s.admin("POST", "/connectors/reload", None).await.ok(200);
    assert_eq!(get().await, "kept", "after a connector reload");
    // A workflow change reloads the engine too; the store stays.
    s.admin(
        "PATCH",
        "/workflows/get/status",
        Some(json!({"status": "paused"})),
    )
    .await
    .ok(200);
    s.admin(
        "PATCH",
        "/workflows/get/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    assert_eq!(get().await, "kept", "after a lifecycle reload");

    s.admin(
        "PUT",
        "/connectors/mem",
        Some(json!({"name": "mem", "connector_type": "cache", "config": cache(101)})),
    )
    .await
    .ok(200);
    assert_eq!(
        get().await,
        Json::Null,
        "a changed connector gets a new store"
    );
}

/// A computed cache key must be text that is not empty: an empty one is a
/// task error like a `null` one (a static `key: ""` is refused at create),
/// and nothing is written under `""`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_computed_cache_key_must_not_be_empty() {
    let s = service(false).await;
    connector(
        &s,
        "mem",
        json!({"type": "cache", "backend": "memory", "max_entries": 10}),
    )
    .await;
    for function in ["cache_write", "cache_read"] {
        let name = function.replace('_', "-");
        deploy(
            &s,
            &name,
            json!([task(
                "k",
                function,
                if function == "cache_write" {
                    json!({"connector": "mem", "key_logic": {"var": "payload.k"}, "value": 1})
                } else {
                    json!({"connector": "mem", "key_logic": {"var": "payload.k"}})
                }
            )]),
        )
        .await;
        for (k, why) in [
            (
                json!(""),
                "key_logic evaluated to an empty string; a cache key must not be empty",
            ),
            (json!(null), "key_logic evaluated to null"),
            (
                json!("  "),
                "key_logic evaluated to blank text (only whitespace); a cache key must not be blank",
            ),
        ] {
            let r = s
                .post(&format!("/api/v1/data/{name}/1"), json!({"data": {"k": k}}))
                .await;
            assert_eq!(r.status, 500, "{function} {k}: {}", r.text);
            assert_eq!(r.body["error"]["code"], "TASK_ERROR", "{}", r.text);
            let message = r.body["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(why), "{function} {k}: {message}");
        }
    }
}

/// `cache_read`'s `output` defaults to `data`, which it replaces whole with
/// what the key holds, whatever that is: a miss is `null` (the spec:
/// "missing key yields null"), a plain string a string. Before, the rule
/// that `data` stays a document refused both with a 500 on every call. A
/// later task may write into `data` again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_read_with_the_default_output_replaces_data_whatever_the_key_holds() {
    let s = service(false).await;
    connector(
        &s,
        "memd",
        json!({"type": "cache", "backend": "memory", "max_entries": 100}),
    )
    .await;
    deploy(
        &s,
        "cdef",
        json!([
            task(
                "w",
                "cache_write",
                json!({"connector": "memd", "key": "text", "value": "plain"})
            ),
            task(
                "r",
                "cache_read",
                json!({"connector": "memd", "key_logic": {"var": "metadata.path.id"}})
            )
        ]),
    )
    .await;
    let r = s
        .post("/api/v1/data/cdef/nope", json!({"data": {"a": 1}}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"], Json::Null, "{}", r.text);
    assert_eq!(r.body["errors"], json!([]), "{}", r.text);
    let r = s
        .post("/api/v1/data/cdef/text", json!({"data": {"a": 1}}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"], "plain", "{}", r.text);
    deploy(
        &s,
        "cdef2",
        json!([
            task(
                "r",
                "cache_read",
                json!({"connector": "memd", "key": "never-written"})
            ),
            task(
                "m",
                "map",
                json!({"mappings": [{"path": "found", "logic": {"!=": [{"var": "data"}, null]}}]})
            )
        ]),
    )
    .await;
    let r = s.post("/api/v1/data/cdef2/1", json!({"data": {}})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"], json!({"found": false}), "{}", r.text);
}

/// Values of every JSON type, some of them strings that look like JSON.
fn cache_samples() -> Json {
    json!([
        "text", "{\"a\": 1}", "[1]", "42", "true", "null", "", "\"quoted\"",
        42, -2.5, true, false, null, {"a": [1, 2], "b": {"c": "d"}}, [1, "x", null], [], {}
    ])
}

/// What `cache_read` gives back for each of [`cache_samples`]: every
/// non-string exactly; a string as it is unless it is JSON text, which reads
/// back as the value it spells (strings are stored raw, so `"42"` and `42`
/// are the same text).
fn cache_samples_read_back() -> Json {
    json!([
        "text", {"a": 1}, [1], 42, true, null, "", "quoted",
        42, -2.5, true, false, null, {"a": [1, 2], "b": {"c": "d"}}, [1, "x", null], [], {}
    ])
}

/// `cache_write` then `cache_read` through the data plane, on the memory
/// backend and against the real Redis: strings are stored as they are and
/// other values as JSON text (what another client of the key finds), every
/// non-string comes back exactly, a plain string comes back as written, and
/// a missing key is null.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_values_on_memory_and_redis_strings_raw_others_json() {
    let s = service(false).await;
    connector(
        &s,
        "mem",
        json!({"type": "cache", "backend": "memory", "max_entries": 100}),
    )
    .await;
    connector(
        &s,
        "red",
        json!({"type": "cache", "backend": "redis", "url": REDIS}),
    )
    .await;
    let samples = cache_samples();
    let n = samples.as_array().unwrap().len();
    for backend in ["mem", "red"] {
        let prefix = unique("rt");
        let key = |i: Json| json!({"cat": [&prefix, ":", {"var": "metadata.path.id"}, ":", i]});
        let mut tasks = vec![task(
            "miss",
            "cache_read",
            json!({"connector": backend,
            "key_logic": key(json!("never")), "output": "missing"}),
        )];
        for i in 0..n {
            tasks.push(task(
                &format!("w{i}"),
                "cache_write",
                json!({"connector": backend,
                "key_logic": key(json!(i)), "value_logic": {"var": format!("payload.values.{i}")}}),
            ));
        }
        // Static values are stored the same way as computed ones.
        tasks.push(task(
            "ws",
            "cache_write",
            json!({"connector": backend,
            "key_logic": key(json!("static")), "value": "{\"a\": 1}", "ttl_secs": 60}),
        ));
        for i in 0..n {
            tasks.push(task(
                &format!("r{i}"),
                "cache_read",
                json!({"connector": backend,
                "key_logic": key(json!(i)), "output": format!("back.{i}")}),
            ));
        }
        tasks.push(task(
            "rs",
            "cache_read",
            json!({"connector": backend,
            "key_logic": key(json!("static")), "output": "static"}),
        ));
        tasks.push(task(
            "rf",
            "cache_read",
            json!({"connector": backend,
            "key_logic": key(json!("foreign")), "output": "foreign"}),
        ));
        let channel = format!("rt-{backend}");
        deploy(&s, &channel, Json::Array(tasks)).await;
        if backend == "red" {
            // Another client's plain text (not JSON) under the key read last.
            redis_set(&format!("{prefix}:1:foreign"), "plain text").await;
        }

        let r = s
            .post(
                &format!("/api/v1/data/{channel}/1"),
                json!({"data": {"values": samples}}),
            )
            .await;
        assert_eq!(r.status, 200, "{backend}: {}", r.text);
        let d = &r.body["data"];
        assert_eq!(d["missing"], Json::Null, "{backend}");
        assert_eq!(
            d["back"],
            cache_samples_read_back(),
            "{backend}: {}",
            r.text
        );
        assert_eq!(d["static"], json!({"a": 1}), "{backend}");
        if backend == "red" {
            assert_eq!(d["foreign"], "plain text");
            // What other clients of the same key find: strings as written,
            // anything else as JSON text.
            for (i, stored) in [
                (0, "text"),
                (1, "{\"a\": 1}"),
                (3, "42"),
                (6, ""),
                (7, "\"quoted\""),
                (8, "42"),
                (10, "true"),
                (12, "null"),
                (13, "{\"a\":[1,2],\"b\":{\"c\":\"d\"}}"),
            ] {
                assert_eq!(
                    redis_get(&format!("{prefix}:1:{i}")).await.as_deref(),
                    Some(stored),
                    "sample {i}"
                );
            }
            let ttl = redis_ttl(&format!("{prefix}:1:static")).await;
            assert!((1..=60).contains(&ttl), "ttl {ttl}");
        } else {
            assert_eq!(d["foreign"], Json::Null);
        }
    }
}

/// `mongo_read` against documents seeded with the official driver:
/// ObjectId and dates in relaxed extended JSON, the filter applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mongo_read_through_the_data_plane() {
    use mongodb::bson::{DateTime, doc, oid::ObjectId};
    let dbname = unique("sluice_t");
    let client = mongodb::Client::with_uri_str(MONGO).await.unwrap();
    let coll = client
        .database(&dbname)
        .collection::<mongodb::bson::Document>("orders");
    let id = ObjectId::new();
    let at = DateTime::from_millis(1_764_000_000_000);
    coll.insert_many([
        doc! {"_id": id, "tag": "x", "n": 1, "at": at},
        doc! {"_id": ObjectId::new(), "tag": "y", "n": 2, "at": at},
    ])
    .await
    .expect("MongoDB at 127.0.0.1:27017 is required (bash ../shared/services/mongodb.sh)");

    let s = service(false).await;
    connector(
        &s,
        "docs",
        json!({"type": "mongodb", "connection_string": MONGO}),
    )
    .await;
    deploy(
        &s,
        "orders",
        json!([task(
            "find",
            "mongo_read",
            json!({"connector": "docs", "database": dbname,
            "collection": "orders", "filter": {"tag": "x"}, "output": "found"})
        )]),
    )
    .await;
    let r = s.post("/api/v1/data/orders/1", json!({"data": {}})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.body["data"]["found"],
        json!([{"_id": {"$oid": id.to_hex()}, "tag": "x", "n": 1,
                "at": {"$date": "2025-11-24T16:00:00Z"}}])
    );
    // The connector's connection string is masked in admin answers.
    let r = s.admin("GET", "/connectors/docs", None).await;
    assert_eq!(r.ok(200)["config"]["connection_string"], "******");
    client.database(&dbname).drop().await.unwrap();
}

/// `publish_kafka`: the message is read back from the broker with its key,
/// the full data context as value by default (its credential headers
/// masked) and the request's trace context in headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_kafka_is_consumed_back() {
    let topic = unique("sluice-orders");
    let s = service(true).await;
    connector(
        &s,
        "bus",
        json!({"type": "kafka", "brokers": [KAFKA], "client_id": "sluice-test"}),
    )
    .await;
    deploy(
        &s,
        "emit",
        json!([
            task(
                "shape",
                "map",
                json!({"mappings": [
                {"path": "order.id", "logic": {"var": "metadata.path.id"}},
                {"path": "order.total", "logic": {"var": "payload.total"}}]})
            ),
            task(
                "send",
                "publish_kafka",
                json!({"connector": "bus", "topic": topic,
                "key_logic": {"cat": ["order-", {"var": "metadata.path.id"}]}})
            ),
            task(
                "send_total",
                "publish_kafka",
                json!({"connector": "bus", "topic": topic,
                "value_logic": {"var": "data.order.total"}})
            )
        ]),
    )
    .await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = s
        .send(
            "POST",
            "/api/v1/data/emit/55",
            Some(json!({"data": {"total": 12.5}})),
            &[
                ("traceparent", traceparent),
                ("tracestate", "vendor=1"),
                ("authorization", "Bearer s3cret"),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);

    let consumer = kafka_reader(&[&topic]).await;
    let mut got = Vec::new();
    while got.len() < 2 {
        let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
            .await
            .expect("messages arrive within 30 s")
            .unwrap();
        let headers: Vec<(String, String)> = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        got.push((
            m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            serde_json::from_slice::<Json>(m.payload().unwrap()).unwrap(),
            headers,
        ));
    }
    // Two partitions may hand them over in either order.
    got.sort_by_key(|m| m.0.is_none());
    assert_eq!(got[0].0.as_deref(), Some("order-55"));
    let context = &got[0].1;
    assert_eq!(
        context["data"],
        json!({"order": {"id": "55", "total": 12.5}})
    );
    assert_eq!(context["temp_data"], json!({}));
    // The whole context, `payload` included (audit 102).
    assert_eq!(context["payload"], json!({"total": 12.5}));
    assert_eq!(context["metadata"]["path"], json!({"id": "55"}));
    assert_eq!(context["metadata"]["method"], "POST");
    assert_eq!(context["metadata"]["headers"]["authorization"], "******");
    assert_eq!(context["metadata"]["headers"]["tracestate"], "vendor=1");
    assert!(!context.to_string().contains("s3cret"), "{context}");
    assert!(
        got[0]
            .2
            .contains(&("traceparent".into(), traceparent.into())),
        "{:?}",
        got[0].2
    );
    assert!(
        got[0].2.contains(&("tracestate".into(), "vendor=1".into())),
        "{:?}",
        got[0].2
    );
    assert_eq!(got[1].0, None);
    assert_eq!(got[1].1, json!(12.5));
}

/// Without `kafka.enabled` a publish is a task error that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_kafka_requires_kafka_enabled() {
    let s = service(false).await;
    connector(&s, "bus", json!({"type": "kafka", "brokers": KAFKA})).await;
    deploy(
        &s,
        "emit",
        json!([task(
            "send",
            "publish_kafka",
            json!({"connector": "bus", "topic": "t"})
        )]),
    )
    .await;
    let r = s.post("/api/v1/data/emit/1", json!({"data": {}})).await;
    let e = r.error(500, "TASK_ERROR");
    assert!(
        e["message"].as_str().unwrap().contains("kafka.enabled"),
        "{}",
        r.text
    );
}
