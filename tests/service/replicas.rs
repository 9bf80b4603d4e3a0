//! Scale-out: several `sluice serve` processes sharing one database. An
//! activation through one replica reaches the others (PostgreSQL: LISTEN/
//! NOTIFY; MariaDB: a poll of the generation row), and every replica reports
//! the same generation.

use crate::support::{Db, free_port, fresh_database};
use serde_json::{Value as Json, json};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) struct Replica {
    pub(crate) base: String,
    child: Child,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn replica(db: &str) -> Replica {
    replica_with(db, &[]).await
}

pub(crate) async fn replica_with(db: &str, env: &[(&str, &str)]) -> Replica {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("serve")
        // Defaults a test's `env` may override.
        .env("SERVICE_ENGINE__SYNC_INTERVAL_MS", "100")
        .envs(env.iter().copied())
        .env("SERVICE_SERVER__PORT", port.to_string())
        .env("SERVICE_STORAGE__URL", db)
        .env("SERVICE_STORAGE__MAX_CONNECTIONS", "4")
        .env("SERVICE_LOGGING__LEVEL", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("the sluice binary starts");
    let r = Replica {
        base: format!("http://127.0.0.1:{port}"),
        child,
    };
    crate::support::wait_ready(&r.base).await;
    r
}

/// An active async channel `work` whose workflow calls the `upstream` once
/// (`POST /w`, no retries) and then copies `payload.n` to `n`.
async fn deploy_slow_work(c: &reqwest::Client, base: &str, upstream: &str, timeout_ms: u64) {
    admin(c, base, "POST", "/connectors", json!({"name": "slow", "connector_type": "http",
        "config": {"type": "http", "url": upstream, "retry": {"max_retries": 0, "retry_delay_ms": 10}}})).await;
    admin(c, base, "POST", "/workflows", json!({"workflow_id": "work", "name": "work", "tasks": [
        {"id": "call", "name": "call", "function": {"name": "http_call", "input": {"connector": "slow", "method": "POST", "path": "/w"}}},
        {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [{"path": "n", "logic": {"var": "payload.n"}}]}}}
    ]})).await;
    admin(
        c,
        base,
        "PATCH",
        "/workflows/work/status",
        json!({"status": "active"}),
    )
    .await;
    admin(
        c,
        base,
        "POST",
        "/channels",
        json!({"channel_id": "work", "name": "work",
        "channel_type": "async", "protocol": "http", "workflow_id": "work",
        "config_json": {"timeout_ms": timeout_ms}}),
    )
    .await;
    admin(
        c,
        base,
        "PATCH",
        "/channels/work/status",
        json!({"status": "active"}),
    )
    .await;
}

async fn admin(c: &reqwest::Client, base: &str, method: &str, path: &str, body: Json) -> Json {
    crate::support::admin_call(c, base, method, path, body).await
}

async fn engine_status(c: &reqwest::Client, base: &str) -> Json {
    let r: Json = c
        .get(format!("{base}/api/v1/admin/engine/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["data"].clone()
}

async fn generation(c: &reqwest::Client, base: &str) -> i64 {
    engine_status(c, base).await["generation"].as_i64().unwrap()
}

async fn activation_reaches_every_replica(db: Db) {
    crate::support::install_crypto();
    let url = fresh_database(db).await;
    // The first replica migrates; the others start on the migrated database.
    let first = replica(&url).await;
    let (second, third) = (replica(&url).await, replica(&url).await);
    let c = reqwest::Client::new();
    admin(
        &c,
        &first.base,
        "POST",
        "/workflows",
        json!({"workflow_id": "fleet", "name": "fleet", "tasks": [
        {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [
            {"path": "ok", "logic": true}]}}}]}),
    )
    .await;
    admin(
        &c,
        &first.base,
        "PATCH",
        "/workflows/fleet/status",
        json!({"status": "active"}),
    )
    .await;
    admin(
        &c,
        &first.base,
        "POST",
        "/channels",
        json!({"channel_id": "fleet", "name": "fleet",
        "channel_type": "sync", "protocol": "http", "workflow_id": "fleet"}),
    )
    .await;
    // The activation through replica 1, timed from its answer.
    admin(
        &c,
        &first.base,
        "PATCH",
        "/channels/fleet/status",
        json!({"status": "active"}),
    )
    .await;
    let activated = Instant::now();
    let mut took = Vec::new();
    for r in [&second, &third] {
        loop {
            let served = c
                .post(format!("{}/api/v1/data/fleet", r.base))
                .json(&json!({"data": {}}))
                .send()
                .await
                .unwrap()
                .status()
                .is_success();
            if served {
                took.push(activated.elapsed());
                break;
            }
            assert!(
                activated.elapsed() < Duration::from_secs(5),
                "{} never served the channel",
                r.base
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    eprintln!("{db:?}: activation reached replicas 2 and 3 after {took:?}");
    // 1 s is the target; the bound is generous for a loaded CI machine.
    assert!(took.iter().all(|t| *t < Duration::from_secs(3)), "{took:?}");
    // Every replica serves (and reports) the same generation.
    let g1 = generation(&c, &first.base).await;
    let until = Instant::now() + Duration::from_secs(3);
    loop {
        let (g2, g3) = (
            generation(&c, &second.base).await,
            generation(&c, &third.base).await,
        );
        if g2 == g1 && g3 == g1 {
            break;
        }
        assert!(Instant::now() < until, "generations {g1} {g2} {g3}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A replica started later serves the current definitions at once.
    let late = replica(&url).await;
    assert_eq!(generation(&c, &late.base).await, g1);

    // Stored definitions that no longer build (edited in the database, as
    // an upgrade's stricter rules could leave them): every replica keeps
    // serving the previous engine, `/health` says `reload_failed`, and
    // `/readyz` stays ready, as on SQLite (audit 70: every replica counted
    // itself behind the generation it could not build, and the whole
    // fleet answered 503).
    let broken = json!({"name": "fleet", "tasks": 7}).to_string();
    let update = "UPDATE workflows SET definition = {}, digest = NULL WHERE id = 'fleet'";
    match db {
        Db::Postgres => {
            use sqlx::Connection;
            let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
            sqlx::query(&update.replace("{}", "$1::jsonb"))
                .bind(&broken)
                .execute(&mut conn)
                .await
                .unwrap();
        }
        _ => {
            use sqlx::Connection;
            let mut conn = sqlx::MySqlConnection::connect(&url).await.unwrap();
            sqlx::query(&update.replace("{}", "?"))
                .bind(&broken)
                .execute(&mut conn)
                .await
                .unwrap();
        }
    }
    let reload = c
        .post(format!("{}/api/v1/admin/engine/reload", first.base))
        .send()
        .await
        .unwrap();
    assert_eq!(reload.status(), 409);
    for r in [&first, &second, &third, &late] {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let health = c.get(format!("{}/health", r.base)).send().await.unwrap();
            let status = health.status();
            let body: Json = health.json().await.unwrap();
            let ready = c.get(format!("{}/readyz", r.base)).send().await.unwrap();
            if status == 503 && body["components"]["engine"] == "reload_failed" {
                // Seen by this replica's own catch-up: ready, and serving.
                tokio::time::sleep(Duration::from_millis(300)).await;
                let ready = c.get(format!("{}/readyz", r.base)).send().await.unwrap();
                assert_eq!(ready.status(), 200, "{}", r.base);
                let served = c
                    .post(format!("{}/api/v1/data/fleet", r.base))
                    .json(&json!({"data": {}}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(served.status(), 200, "{}", r.base);
                break;
            }
            assert!(
                Instant::now() < until,
                "{}: health {status} {body}, readyz {}",
                r.base,
                ready.status()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activation_reaches_every_replica_postgres() {
    activation_reaches_every_replica(Db::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activation_reaches_every_replica_mariadb() {
    activation_reaches_every_replica(Db::MySql).await;
}

/// 300 async submissions spread over three replicas each complete exactly
/// once (one completed trace each, none lost), although one replica is
/// killed with SIGKILL mid-run: its claimed traces are reclaimed by the
/// others when their lease (`queue.lease_secs`) runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_work_survives_a_killed_replica() {
    crate::support::install_crypto();
    let url = fresh_database(Db::Postgres).await;
    let upstream = crate::support::slow_upstream(Duration::from_millis(200)).await;
    let env = [
        ("SERVICE_QUEUE__LEASE_SECS", "2"),
        ("SERVICE_SECURITY__ALLOW_PRIVATE_NETWORKS", "true"),
    ];
    let first = replica_with(&url, &env).await;
    let mut others = vec![
        replica_with(&url, &env).await,
        replica_with(&url, &env).await,
    ];
    let c = reqwest::Client::new();
    deploy_slow_work(&c, &first.base, &upstream, 1000).await;
    let bases: Vec<String> = std::iter::once(first.base.clone())
        .chain(others.iter().map(|r| r.base.clone()))
        .collect();
    // Every replica serves the channel before the first submission (a fixed
    // wait was too short on a loaded machine).
    settle(&c, &bases).await;
    for n in 0..300 {
        let base = &bases[n % 3];
        let r = c
            .post(format!("{base}/api/v1/data/work"))
            .json(&json!({"data": {"n": n}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 202, "{}", r.text().await.unwrap());
    }
    // Kill replica 2 while it has work claimed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = others.remove(0);
    drop(killed); // SIGKILL

    let count = |status: &'static str| {
        let c = c.clone();
        let base = first.base.clone();
        async move {
            let r: Json = c
                .get(format!(
                    "{base}/api/v1/data/traces?channel=work&status={status}&limit=1"
                ))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            r["total"].as_i64().unwrap()
        }
    };
    let until = Instant::now() + Duration::from_secs(40);
    loop {
        if count("completed").await == 300 {
            break;
        }
        assert!(
            Instant::now() < until,
            "completed {} of 300 (failed {}, pending {}, running {})",
            count("completed").await,
            count("failed").await,
            count("pending").await,
            count("running").await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(count("failed").await, 0);
    assert_eq!(count("pending").await + count("running").await, 0);
    // Exactly one completed trace per submission: every n once.
    let r: Json = c
        .get(format!(
            "{}/api/v1/data/traces?channel=work&status=completed&limit=500",
            first.base
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    // The killed replica's runs were reclaimed: some trace needed a second attempt.
    let reruns = r["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["attempts"].as_i64() > Some(1))
        .count();
    assert!(reruns > 0, "no trace was reclaimed from the killed replica");
    let mut ns: Vec<i64> = r["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["data"]["n"].as_i64().unwrap())
        .collect();
    ns.sort();
    assert_eq!(ns, (0..300).collect::<Vec<i64>>());
}

/// A replica that has not caught up with a new async channel yet (MariaDB
/// replicas poll the generation; this one only every minute) still runs the
/// traces it claims: it catches up first. Before, it failed them as
/// `Channel '…' not found`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_behind_catches_up_before_running_a_trace() {
    crate::support::install_crypto();
    let url = fresh_database(Db::MySql).await;
    let upstream = crate::support::slow_upstream(Duration::from_millis(300)).await;
    let allow = ("SERVICE_SECURITY__ALLOW_PRIVATE_NETWORKS", "true");
    // The killed replica's claim lapses after the lease (raised to the
    // channel's timeout + 5 s).
    let lease = ("SERVICE_QUEUE__LEASE_SECS", "2");
    let first = replica_with(&url, &[allow, lease, ("SERVICE_QUEUE__WORKERS", "1")]).await;
    let behind = replica_with(
        &url,
        &[allow, lease, ("SERVICE_ENGINE__SYNC_INTERVAL_MS", "60000")],
    )
    .await;
    let c = reqwest::Client::new();
    admin(&c, &first.base, "POST", "/connectors", json!({"name": "slow", "connector_type": "http",
        "config": {"type": "http", "url": upstream, "retry": {"max_retries": 0, "retry_delay_ms": 10}}})).await;
    deploy_on(
        &c,
        &first.base,
        json!({"workflow_id": "late", "name": "late", "tasks": [
            {"id": "call", "name": "call", "function": {"name": "http_call", "input": {"connector": "slow", "method": "POST", "path": "/w"}}},
            {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [{"path": "n", "logic": {"var": "payload.n"}}]}}}
        ]}),
        json!({"channel_id": "late", "name": "late", "channel_type": "async", "protocol": "http",
               "workflow_id": "late", "config_json": {"timeout_ms": 1000}}),
    )
    .await;
    let ahead = generation(&c, &first.base).await;
    assert!(generation(&c, &behind.base).await < ahead);
    for n in 0..6 {
        let r = c
            .post(format!("{}/api/v1/data/late", first.base))
            .json(&json!({"data": {"n": n}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 202, "{}", r.text().await.unwrap());
    }
    // The first replica (one worker, 300 ms a trace) goes away: the one
    // behind claims what is left on its next sweep.
    drop(first);
    let base = behind.base.clone();
    let traces = || {
        let (c, base) = (c.clone(), base.clone());
        async move {
            let r: Json = c
                .get(format!("{base}/api/v1/data/traces?channel=late&limit=10"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            r["data"].as_array().cloned().unwrap_or_default()
        }
    };
    let until = Instant::now() + Duration::from_secs(40);
    loop {
        let all = traces().await;
        let failed: Vec<&Json> = all.iter().filter(|t| t["status"] == "failed").collect();
        assert!(failed.is_empty(), "{failed:?}");
        if all.len() == 6 && all.iter().all(|t| t["status"] == "completed") {
            break;
        }
        assert!(Instant::now() < until, "{all:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // It caught up on the way.
    assert!(generation(&c, &behind.base).await >= ahead);
}

/// Replicas started together on a fresh MariaDB database migrate it one
/// at a time. Before, sqlx's migration lock (`GET_LOCK(name, -1)`) did not
/// wait on MariaDB, and two of three `sluice migrate` runs usually failed
/// ("migration 1 is partially applied", duplicate keys).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_started_together_migrate_one_at_a_time() {
    for _ in 0..3 {
        let url = fresh_database(Db::MySql).await;
        let runs: Vec<Child> = (0..3)
            .map(|_| {
                Command::new(env!("CARGO_BIN_EXE_sluice"))
                    .arg("migrate")
                    .env("SERVICE_STORAGE__URL", &url)
                    .env("SERVICE_LOGGING__LEVEL", "warn")
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("the sluice binary starts")
            })
            .collect();
        for run in runs {
            let out = run.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// A SQLite backup copied over the database file of a stopped service is
/// what the service serves when it starts again. Before, a clean stop left
/// the data in the write-ahead log (the `.db` a 4 KB stub), and the old
/// log, still beside the file, was replayed over the copied backup: the
/// restore silently did nothing. `sluice migrate` leaves one file too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_sqlite_backup_is_what_the_service_serves() {
    sluice::connectors::http::install_crypto_provider();
    let dir = std::env::temp_dir().join(format!("sluice-restore-{}", free_port()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let live = dir.join("live.db");
    let url = format!("sqlite://{}", live.display());
    let backups = dir.join("bk");
    let env = [("SERVICE_STORAGE__BACKUP_DIR", backups.to_str().unwrap())];
    let c = reqwest::Client::new();
    let wf = |id: &str| {
        json!({"workflow_id": id, "name": id, "tasks": [{"id": "m", "name": "m",
            "function": {"name": "map", "input": {"mappings": [{"path": "data.x", "logic": 1}]}}}]})
    };
    let ids = |body: Json| -> Vec<String> {
        let mut ids: Vec<String> = body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["workflow_id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    };

    let mut r = replica_with(&url, &env).await;
    admin(&c, &r.base, "POST", "/workflows", wf("before")).await;
    let backup = admin(&c, &r.base, "POST", "/backups", Json::Null).await;
    let file = backups.join(backup["data"]["filename"].as_str().unwrap());
    admin(&c, &r.base, "POST", "/workflows", wf("after")).await;
    // A clean stop (SIGTERM) leaves everything in the database file.
    let term = Command::new("kill")
        .args(["-TERM", &r.child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    assert!(r.child.wait().unwrap().success());
    let wal = dir.join("live.db-wal");
    assert!(
        std::fs::metadata(&wal).map_or(true, |m| m.len() == 0),
        "the write-ahead log still holds data after a clean stop"
    );
    drop(r);

    // Restore: the backup copied over the file, nothing else touched.
    std::fs::copy(&file, &live).unwrap();
    let r = replica_with(&url, &env).await;
    let listed = admin(&c, &r.base, "GET", "/workflows", Json::Null).await;
    assert_eq!(ids(listed), ["before"]);
    drop(r);

    // `sluice migrate` on a fresh file leaves the schema in the file.
    let fresh = dir.join("fresh.db");
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("migrate")
        .env(
            "SERVICE_STORAGE__URL",
            format!("sqlite://{}", fresh.display()),
        )
        .env("SERVICE_LOGGING__LEVEL", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::metadata(dir.join("fresh.db-wal")).map_or(true, |m| m.len() == 0),
        "migrate left its work in the write-ahead log"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------------- shared governance (Redis)

/// Creates and activates `workflow`, then `channel`, through `base`.
async fn deploy_on(c: &reqwest::Client, base: &str, workflow: Json, channel: Json) {
    let wf = workflow["workflow_id"].as_str().unwrap().to_owned();
    let ch = channel["channel_id"].as_str().unwrap().to_owned();
    admin(c, base, "POST", "/workflows", workflow).await;
    let status = json!({"status": "active"});
    admin(
        c,
        base,
        "PATCH",
        &format!("/workflows/{wf}/status"),
        status.clone(),
    )
    .await;
    admin(c, base, "POST", "/channels", channel).await;
    admin(c, base, "PATCH", &format!("/channels/{ch}/status"), status).await;
}

/// Waits until every replica serves the generation of the first.
async fn settle(c: &reqwest::Client, bases: &[String]) {
    let want = generation(c, &bases[0]).await;
    let until = Instant::now() + Duration::from_secs(10);
    for base in &bases[1..] {
        while generation(c, base).await < want {
            assert!(
                Instant::now() < until,
                "{base} stays behind generation {want}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Three replicas on one PostgreSQL database and one Redis (own key prefix).
async fn governed_fleet(extra: &[(&str, &str)]) -> (Vec<Replica>, Vec<String>) {
    crate::support::install_crypto();
    let url = fresh_database(Db::Postgres).await;
    let prefix = crate::support::unique("fleet");
    let mut env = vec![
        ("SERVICE_GOVERNANCE__BACKEND", "redis"),
        ("SERVICE_GOVERNANCE__REDIS_URL", crate::support::REDIS_URL),
        ("SERVICE_GOVERNANCE__KEY_PREFIX", prefix.as_str()),
    ];
    env.extend_from_slice(extra);
    let mut replicas = vec![replica_with(&url, &env).await];
    replicas.push(replica_with(&url, &env).await);
    replicas.push(replica_with(&url, &env).await);
    let bases = replicas.iter().map(|r| r.base.clone()).collect();
    (replicas, bases)
}

fn stamp_workflow(id: &str) -> Json {
    json!({"workflow_id": id, "name": id, "tasks": [
        {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [
            {"path": "n", "logic": {"var": "payload.n"}}
        ]}}}
    ]})
}

/// A limit of 50 requests/s holds for the fleet: hammering three replicas
/// for about three seconds admits about burst + 50/s × elapsed, not three
/// times that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_holds_for_the_whole_fleet() {
    let (_replicas, bases) = governed_fleet(&[]).await;
    let c = reqwest::Client::new();
    deploy_on(
        &c,
        &bases[0],
        stamp_workflow("limited"),
        json!({"channel_id": "limited", "name": "limited", "channel_type": "sync", "protocol": "http",
            "workflow_id": "limited", "config_json": {"rate_limit": {"requests_per_second": 50, "burst": 50}}}),
    )
    .await;
    settle(&c, &bases).await;
    let started = Instant::now();
    let run_for = Duration::from_secs(3);
    // Four callers per replica, each sending as fast as it is answered.
    let callers = (0..12).map(|i| {
        let (c, base) = (c.clone(), bases[i % 3].clone());
        async move {
            let (mut ok, mut limited, mut last) = (0u32, 0u32, started);
            while started.elapsed() < run_for {
                let r = c
                    .post(format!("{base}/api/v1/data/limited"))
                    .json(&json!({"data": {"n": i}}))
                    .send()
                    .await
                    .unwrap();
                last = Instant::now();
                match r.status().as_u16() {
                    200 => ok += 1,
                    429 => limited += 1,
                    other => panic!("unexpected {other}: {}", r.text().await.unwrap()),
                }
            }
            (ok, limited, last)
        }
    });
    let results = futures_util::future::join_all(callers).await;
    let admitted: u32 = results.iter().map(|r| r.0).sum();
    let limited: u32 = results.iter().map(|r| r.1).sum();
    let elapsed = results
        .iter()
        .map(|r| r.2.duration_since(started))
        .max()
        .unwrap()
        .as_secs_f64();
    let expected = 50.0 + 50.0 * elapsed;
    eprintln!(
        "fleet rate limit: {admitted} admitted, {limited} limited in {elapsed:.2} s (expected about {expected:.0})"
    );
    assert!(
        limited > admitted,
        "the callers did not outrun the limit: {admitted} admitted, {limited} limited"
    );
    assert!(
        f64::from(admitted) <= expected * 1.1 + 5.0 && f64::from(admitted) >= expected * 0.75,
        "{admitted} admitted in {elapsed:.2} s across three replicas; a fleet-wide 50/s with burst 50 admits about {expected:.0}"
    );
}

/// A deduplication key used on one replica is a duplicate on the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedup_key_is_seen_by_every_replica() {
    let (_replicas, bases) = governed_fleet(&[]).await;
    let c = reqwest::Client::new();
    deploy_on(
        &c,
        &bases[0],
        stamp_workflow("orders"),
        json!({"channel_id": "orders", "name": "orders", "channel_type": "sync", "protocol": "http",
            "workflow_id": "orders", "config_json": {"deduplication": {"window_secs": 60}}}),
    )
    .await;
    settle(&c, &bases).await;
    let post = |base: &String, key: &str| {
        c.post(format!("{base}/api/v1/data/orders"))
            .header("idempotency-key", key)
            .json(&json!({"data": {"n": 1}}))
            .send()
    };
    assert_eq!(post(&bases[0], "order-1").await.unwrap().status(), 200);
    for base in &bases[1..] {
        let r = post(base, "order-1").await.unwrap();
        assert_eq!(r.status(), 409, "{base}");
        let body: Json = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "CONFLICT");
    }
    // Another key is fresh, wherever it arrives first.
    assert_eq!(post(&bases[2], "order-2").await.unwrap().status(), 200);
    assert_eq!(post(&bases[0], "order-2").await.unwrap().status(), 409);
}

// ------------------------------------------------ Kafka across replicas

/// `messages_total{channel, status="ok"}` of one replica.
async fn processed(c: &reqwest::Client, base: &str, channel: &str) -> u64 {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with("messages_total{")
                && l.contains(&format!("channel=\"{channel}\""))
                && l.contains("status=\"ok\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Replicas consume one 3-partition topic in one consumer group: one replica
/// starts alone and takes every partition, two more join while messages keep
/// coming (rebalances: what finished is committed, what was only fetched is
/// left to the new owner), and in the end every message has run exactly once
/// and the partitions are split between the three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_partitions_are_split_and_each_message_runs_once() {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    crate::support::install_crypto();
    let topic = crate::support::unique("fleet-events");
    let group = crate::support::unique("fleet-group");
    crate::support::kafka_topics(&[&topic], 3).await;
    let url = fresh_database(Db::Postgres).await;
    let env = [
        ("SERVICE_KAFKA__ENABLED", "true"),
        ("SERVICE_KAFKA__BROKERS", crate::support::KAFKA_BROKERS),
        ("SERVICE_KAFKA__SESSION_TIMEOUT_MS", "6000"),
    ];
    let first = replica_with(&url, &env).await;
    let c = reqwest::Client::new();
    deploy_on(
        &c,
        &first.base,
        stamp_workflow("events"),
        json!({"channel_id": "events", "name": "events", "channel_type": "async", "protocol": "kafka",
            "workflow_id": "events", "config_json": {"topic": topic, "consumer_group": group}}),
    )
    .await;
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", crate::support::KAFKA_BROKERS)
        .create()
        .unwrap();
    let produce = |range: std::ops::Range<u32>, pause: Duration| {
        let (producer, topic) = (producer.clone(), topic.clone());
        async move {
            for n in range {
                let value = json!({"data": {"n": n}}).to_string();
                let key = format!("k{n}");
                producer
                    .send(
                        FutureRecord::to(&topic)
                            .key(&key)
                            .payload(&value)
                            .partition((n % 3) as i32),
                        Duration::from_secs(10),
                    )
                    .await
                    .map_err(|(e, _)| e)
                    .unwrap();
                tokio::time::sleep(pause).await;
            }
        }
    };
    // The first replica alone: it owns all three partitions.
    produce(0..60, Duration::ZERO).await;
    let until = Instant::now() + Duration::from_secs(30);
    while processed(&c, &first.base, "events").await < 60 {
        assert!(Instant::now() < until, "the first replica does not consume");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Two more join while messages keep arriving (about 4 s of traffic
    // across their joins and the rebalances).
    let (second, third, ()) = tokio::join!(
        replica_with(&url, &env),
        replica_with(&url, &env),
        produce(60..160, Duration::from_millis(40)),
    );
    // Settled: a last wave.
    tokio::time::sleep(Duration::from_secs(8)).await;
    produce(160..220, Duration::ZERO).await;

    let total = 220;
    let until = Instant::now() + Duration::from_secs(60);
    let mut counts: std::collections::BTreeMap<i64, usize>;
    loop {
        let traces: Json = c
            .get(format!(
                "{}/api/v1/data/traces?channel=events&mode=kafka&limit=1000",
                second.base
            ))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        counts = Default::default();
        for t in traces["data"].as_array().unwrap() {
            assert_eq!(t["status"], "completed", "{t}");
            *counts.entry(t["data"]["n"].as_i64().unwrap()).or_default() += 1;
        }
        if counts.len() == total || Instant::now() > until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(counts.len(), total, "messages never processed");
    let repeated: Vec<_> = counts.iter().filter(|(_, k)| **k > 1).collect();
    assert!(
        repeated.is_empty(),
        "processed more than once: {repeated:?}"
    );
    let mut per_replica = Vec::new();
    for r in [&first, &second, &third] {
        per_replica.push(processed(&c, &r.base, "events").await);
    }
    eprintln!("kafka messages per replica: {per_replica:?}");
    assert_eq!(
        per_replica.iter().sum::<u64>(),
        total as u64,
        "{per_replica:?}"
    );
    assert!(
        per_replica[1] > 0 && per_replica[2] > 0,
        "the joining replicas got no partition: {per_replica:?}"
    );
}

/// SQLite is served by one process: traces a killed `serve` left `running`
/// are nobody's, and the next start runs them at once instead of waiting
/// out their lease (`queue.lease_secs`, here an hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_on_sqlite_runs_what_a_killed_process_left_running() {
    crate::support::install_crypto();
    let url = fresh_database(Db::Sqlite).await;
    let upstream = crate::support::slow_upstream(Duration::from_secs(3)).await;
    let env = [
        ("SERVICE_QUEUE__LEASE_SECS", "3600"),
        ("SERVICE_SECURITY__ALLOW_PRIVATE_NETWORKS", "true"),
    ];
    let first = replica_with(&url, &env).await;
    let c = reqwest::Client::new();
    let base = first.base.clone();
    deploy_slow_work(&c, &base, &upstream, 10000).await;
    let r: Json = c
        .post(format!("{base}/api/v1/data/work"))
        .json(&json!({"data": {}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = r["trace_id"].as_str().unwrap().to_owned();
    let trace = |base: String| {
        let (c, id) = (c.clone(), id.clone());
        async move {
            c.get(format!("{base}/api/v1/data/traces/{id}"))
                .send()
                .await
                .unwrap()
                .json::<Json>()
                .await
                .unwrap()["data"]
                .clone()
        }
    };
    let until = Instant::now() + Duration::from_secs(10);
    while trace(base.clone()).await["status"] != "running" {
        assert!(Instant::now() < until, "never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(first); // SIGKILL mid-run
    let second = replica_with(&url, &env).await;
    let until = Instant::now() + Duration::from_secs(20);
    let done = loop {
        let t = trace(second.base.clone()).await;
        if t["status"] == "completed" {
            break t;
        }
        assert!(Instant::now() < until, "still waiting for its lease: {t}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(done["attempts"], 2, "{done}");
}

/// A replica whose own change overtakes another replica's connector change
/// (before its poll or notification catches up) loads that connector with
/// it: the reload that serves a generation reloads the connector registry
/// too (audit 111: the replica's generation moved past the change and it
/// answered "connector not found" until the next connector change). The
/// second replica polls rarely here, so only its own change can load it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_own_change_loads_a_connector_another_replica_made() {
    crate::support::install_crypto();
    let url = fresh_database(Db::MySql).await;
    let a = replica(&url).await;
    let b = replica_with(&url, &[("SERVICE_ENGINE__SYNC_INTERVAL_MS", "600000")]).await;
    let c = reqwest::Client::new();
    admin(
        &c,
        &b.base,
        "POST",
        "/workflows",
        json!({"workflow_id": "put", "name": "put", "tasks": [
        {"id": "w", "name": "w", "function": {"name": "cache_write",
         "input": {"connector": "kv", "key": "k", "value": "v"}}}]}),
    )
    .await;
    admin(
        &c,
        &b.base,
        "POST",
        "/channels",
        json!({"channel_id": "put", "name": "put",
        "channel_type": "sync", "protocol": "http", "workflow_id": "put"}),
    )
    .await;
    // The connector through the first replica; the second does not poll.
    admin(
        &c,
        &a.base,
        "POST",
        "/connectors",
        json!({"name": "kv", "connector_type": "cache",
        "config": {"type": "cache", "backend": "memory"}}),
    )
    .await;
    for path in ["/workflows/put/status", "/channels/put/status"] {
        admin(&c, &b.base, "PATCH", path, json!({"status": "active"})).await;
    }
    let r = c
        .post(format!("{}/api/v1/data/put", b.base))
        .json(&json!({"data": {}}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    // The first replica (polling every 100 ms) catches up with the second's
    // changes: both then serve one generation.
    let until = Instant::now() + Duration::from_secs(10);
    while generation(&c, &a.base).await != generation(&c, &b.base).await {
        assert!(Instant::now() < until, "the replicas never agreed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Circuit breakers of a connector changed, or of a channel deleted,
/// through one replica are forgotten on every replica as it catches up
/// (audit 111: only the replica that answered forgot them, and the others
/// kept refusing a fixed connector with 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breakers_are_forgotten_on_every_replica() {
    crate::support::install_crypto();
    let url = fresh_database(Db::Postgres).await;
    let env = [("SERVICE_SECURITY__ALLOW_PRIVATE_NETWORKS", "true")];
    let a = replica_with(&url, &env).await;
    let b = replica_with(&url, &env).await;
    let c = reqwest::Client::new();
    // Nothing listens there: every call fails at once.
    let dead = format!("http://127.0.0.1:{}", crate::support::free_port());
    let connector = |path: &str| {
        json!({"name": "down", "connector_type": "http", "config": {"type": "http",
               "url": format!("{dead}{path}"), "retry": {"max_retries": 0, "retry_delay_ms": 10}}})
    };
    admin(&c, &a.base, "POST", "/connectors", connector("")).await;
    admin(
        &c,
        &a.base,
        "POST",
        "/workflows",
        json!({"workflow_id": "bk", "name": "bk", "tasks": [
        {"id": "call", "name": "call", "function": {"name": "http_call",
         "input": {"connector": "down", "method": "GET", "path": "/x"}}}]}),
    )
    .await;
    admin(
        &c,
        &a.base,
        "PATCH",
        "/workflows/bk/status",
        json!({"status": "active"}),
    )
    .await;
    admin(
        &c,
        &a.base,
        "POST",
        "/channels",
        json!({"channel_id": "bk", "name": "bk",
        "channel_type": "sync", "protocol": "http", "workflow_id": "bk"}),
    )
    .await;
    admin(
        &c,
        &a.base,
        "PATCH",
        "/channels/bk/status",
        json!({"status": "active"}),
    )
    .await;
    let caught_up = |c: reqwest::Client, a: String, b: String| async move {
        let until = Instant::now() + Duration::from_secs(10);
        while generation(&c, &a).await != generation(&c, &b).await {
            assert!(Instant::now() < until, "the second replica never caught up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let open_on_b = |c: reqwest::Client, b: String| async move {
        for _ in 0..5 {
            let r = c
                .post(format!("{b}/api/v1/data/bk"))
                .json(&json!({"data": {}}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 502, "{}", r.text().await.unwrap());
        }
        let listed = admin(&c, &b, "GET", "/connectors/circuit-breakers", Json::Null).await;
        assert_eq!(listed["data"][0]["state"], "open", "{listed}");
    };
    let breakers_on_b = |c: reqwest::Client, b: String| async move {
        admin(&c, &b, "GET", "/connectors/circuit-breakers", Json::Null).await["data"].clone()
    };
    caught_up(c.clone(), a.base.clone(), b.base.clone()).await;
    open_on_b(c.clone(), b.base.clone()).await;
    // The connector changed through the first replica.
    admin(&c, &a.base, "PUT", "/connectors/down", connector("/v2")).await;
    caught_up(c.clone(), a.base.clone(), b.base.clone()).await;
    assert_eq!(breakers_on_b(c.clone(), b.base.clone()).await, json!([]));
    // Open again, then the channel deleted through the first replica.
    open_on_b(c.clone(), b.base.clone()).await;
    let r = c
        .delete(format!("{}/api/v1/admin/channels/bk", a.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    caught_up(c.clone(), a.base.clone(), b.base.clone()).await;
    assert_eq!(breakers_on_b(c.clone(), b.base.clone()).await, json!([]));
}

/// Creates and activates workflow `id`, one mapping.
async fn activate_mapping(c: &reqwest::Client, base: &str, id: &str) {
    admin(
        c,
        base,
        "POST",
        "/workflows",
        json!({"workflow_id": id, "name": id,
        "tasks": [{"id": "m", "name": "m", "function": {"name": "map",
            "input": {"mappings": [{"path": "x", "logic": 1}]}}}]}),
    )
    .await;
    let path = format!("/workflows/{id}/status");
    admin(c, base, "PATCH", &path, json!({"status": "active"})).await;
}

/// A restored database holds an earlier generation than the fleet serves:
/// a running replica reloads to what it holds, and later changes reach it
/// (audit 124: it kept serving the definitions the dump no longer held and
/// ignored every change until the number passed the old one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_reloads_what_a_restored_database_holds() {
    use sqlx::Connection;
    crate::support::install_crypto();
    let url = fresh_database(Db::MySql).await;
    let r = replica(&url).await;
    let c = reqwest::Client::new();
    activate_mapping(&c, &r.base, "gone").await;
    let served = generation(&c, &r.base).await;
    assert!(served > 1, "{served}");
    // The "restore": the rows the dump did not have, and its generation.
    let mut db = sqlx::MySqlConnection::connect(&url).await.unwrap();
    sqlx::query("DELETE FROM workflows WHERE id = 'gone'")
        .execute(&mut db)
        .await
        .unwrap();
    sqlx::query("UPDATE engine_generation SET generation = 1")
        .execute(&mut db)
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = engine_status(&c, &r.base).await;
        if s["generation"] == 1 {
            assert_eq!(s["active_workflows"], 0, "{s}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never reloaded: {s}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // A change from there reaches it as any change does.
    activate_mapping(&c, &r.base, "next").await;
    let s = engine_status(&c, &r.base).await;
    assert_eq!(s["active_workflows"], 1, "{s}");
    assert!(s["generation"].as_i64().unwrap() > 1, "{s}");
}
