//! Storage tests against real databases: every test body runs once per backend
//! (SQLite temp file, PostgreSQL and MariaDB on loopback), each in a fresh
//! database. A server that is not reachable fails the test; it never skips.
//! Start the servers with `bash /work/shared/services/postgres.sh` and
//! `bash /work/shared/services/mariadb.sh`; override the admin URLs with
//! `SLUICE_TEST_POSTGRES_URL` / `SLUICE_TEST_MYSQL_URL`.

use super::lifecycle::{Change, Plan, VRow, plan_rollout, plan_status};
use super::*;
use serde_json::json;
use sqlx::Connection;
use std::path::PathBuf;

const PG_ADMIN: &str = "postgres://postgres@127.0.0.1:5432/test";
const MY_ADMIN: &str = "mysql://root@127.0.0.1:3306/test";

fn admin_url(backend: Backend) -> String {
    let (var, default) = match backend {
        Backend::Postgres => ("SLUICE_TEST_POSTGRES_URL", PG_ADMIN),
        Backend::MySql => ("SLUICE_TEST_MYSQL_URL", MY_ADMIN),
        Backend::Sqlite => return String::new(),
    };
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// `scheme://user@host:port/db` → same server, database `name`.
fn with_database(url: &str, name: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("admin URL has a database path");
    format!("{base}/{name}")
}

/// A fresh, migrated store in its own database; `cleanup` drops it.
pub(crate) struct TestDb {
    pub store: Store,
    backend: Backend,
    name: String,
    dir: PathBuf,
}

impl TestDb {
    pub(crate) async fn new(backend: Backend) -> TestDb {
        let name = format!("sluice_test_{}", uuid::Uuid::new_v4().simple());
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).unwrap();
        let url = match backend {
            Backend::Sqlite => format!("sqlite://{}", dir.join("sluice.db").display()),
            Backend::Postgres => {
                let admin = admin_url(backend);
                let mut c = sqlx::PgConnection::connect(&admin)
                    .await
                    .unwrap_or_else(|e| panic!("PostgreSQL at {admin} is not reachable ({e}); run bash /work/shared/services/postgres.sh"));
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut c)
                    .await
                    .unwrap();
                c.close().await.ok();
                with_database(&admin, &name)
            }
            Backend::MySql => {
                let admin = admin_url(backend);
                let mut c = sqlx::MySqlConnection::connect(&admin)
                    .await
                    .unwrap_or_else(|e| panic!("MariaDB at {admin} is not reachable ({e}); run bash /work/shared/services/mariadb.sh"));
                sqlx::query(&format!(
                    "CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
                ))
                .execute(&mut c)
                .await
                .unwrap();
                c.close().await.ok();
                with_database(&admin, &name).replacen("mysql:", "mariadb:", 1) // exercises the rewrite
            }
        };
        let store = Store::connect(&url, 25).await.expect("connect");
        assert_eq!(store.backend(), backend);
        store.migrate().await.expect("migrate");
        TestDb {
            store,
            backend,
            name,
            dir,
        }
    }

    /// Best effort: a failed drop leaves a `sluice_test_*` database behind, nothing worse.
    pub(crate) async fn cleanup(self) {
        self.store.close().await;
        match self.backend {
            Backend::Sqlite => {}
            Backend::Postgres => {
                if let Ok(mut c) = sqlx::PgConnection::connect(&admin_url(self.backend)).await {
                    let _ = sqlx::query(&format!(
                        "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                        self.name
                    ))
                    .execute(&mut c)
                    .await;
                }
            }
            Backend::MySql => {
                if let Ok(mut c) = sqlx::MySqlConnection::connect(&admin_url(self.backend)).await {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {}", self.name))
                        .execute(&mut c)
                        .await;
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `body` on a fresh store of `backend`, drops the database, then re-raises a panic.
async fn run<F, Fut>(backend: Backend, body: F)
where
    F: FnOnce(Store, PathBuf) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let db = TestDb::new(backend).await;
    let outcome = tokio::spawn(body(db.store.clone(), db.dir.join("backups"))).await;
    db.cleanup().await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// One `#[tokio::test]` per body and backend: `sqlite::x`, `postgres::x`, `mysql::x`.
macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod sqlite { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::run(super::Backend::Sqlite, super::$name).await }
        )* }
        mod postgres { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::run(super::Backend::Postgres, super::$name).await }
        )* }
        mod mysql { $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::run(super::Backend::MySql, super::$name).await }
        )* }
    };
}

// Shared with the other storage test modules (each has its own `run`).
pub(crate) use backend_tests;

backend_tests!(
    migrate_twice_and_ping,
    create_and_get,
    list_filters_pagination_and_total,
    update_only_drafts,
    versions_and_new_version,
    activation_canary_rollout_rollback_archive,
    pause_and_resume,
    channels_names_and_lifecycle,
    delete_removes_all_versions,
    connectors_crud,
    audit_written_with_each_change_only,
    concurrent_new_version_creates_one_draft,
    concurrent_activations_leave_one_active,
    concurrent_channel_names,
    backups,
    digests_follow_definitions,
    reload_after_any_change_equals_a_cold_start,
    a_reload_reads_one_moment_of_storage,
    a_failed_generation_bump_is_retried_until_it_moves,
    reloads_build_at_background_priority_on_their_own_connection,
    channel_filters_see_effective_type_and_protocol,
    definitions_come_back_as_written,
    deep_definitions_are_kept_and_found_by_tag,
);

fn admin(action: &str) -> Audit {
    Audit::new("admin", action)
}

fn wf(name: &str, tags: &[&str]) -> Json {
    json!({"name": name, "tags": tags, "tasks": [{"id": "t1", "name": "parse", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}}]})
}

fn channel(name: &str, ty: &str, protocol: &str) -> Json {
    json!({"name": name, "channel_type": ty, "protocol": protocol, "route_pattern": format!("/{name}"), "methods": ["POST"], "workflow_id": "w", "config_json": {"timeout_ms": 1000}})
}

#[track_caller]
fn assert_conflict<T: std::fmt::Debug>(r: Result<T, StorageError>, msg: &str) {
    match r {
        Err(StorageError::Conflict(m)) => assert_eq!(m, msg),
        other => panic!("expected Conflict({msg:?}), got {other:?}"),
    }
}

#[track_caller]
fn assert_not_found<T: std::fmt::Debug>(r: Result<T, StorageError>, msg: &str) {
    match r {
        Err(StorageError::NotFound(m)) => assert_eq!(m, msg),
        other => panic!("expected NotFound({msg:?}), got {other:?}"),
    }
}

/// (version, status, rollout) of every version, ascending.
async fn states(s: &Store, kind: Kind, id: &str) -> Vec<(i64, Status, i64)> {
    s.versions(kind, id)
        .await
        .unwrap()
        .iter()
        .map(|r| (r.version, r.status, r.rollout_percentage))
        .collect()
}

async fn activate(
    s: &Store,
    id: &str,
    version: Option<i64>,
    rollout: Option<i64>,
) -> Result<Record, StorageError> {
    s.set_status(
        Kind::Workflow,
        id,
        Status::Active,
        version,
        rollout,
        admin("activate"),
    )
    .await
}

async fn migrate_twice_and_ping(s: Store, _: PathBuf) {
    s.migrate().await.unwrap();
    s.ping().await.unwrap();
}

async fn create_and_get(s: Store, _: PathBuf) {
    let mut def = wf("Orders", &["a"]);
    // Server-managed fields and the id field in the body are not stored.
    def["status"] = json!("active");
    def["version"] = json!(7);
    def["workflow_id"] = json!("other");
    let r = s
        .create(Kind::Workflow, "orders", &def, admin("create"))
        .await
        .unwrap();
    assert_eq!(
        (r.id.as_str(), r.version, r.status, r.rollout_percentage),
        ("orders", 1, Status::Draft, 100)
    );
    assert_eq!(r.definition, wf("Orders", &["a"]));
    assert_eq!(r.created_at.len(), "2026-11-22T10:15:00Z".len());
    assert!(r.created_at.ends_with('Z') && r.created_at.as_bytes()[10] == b'T');

    let got = s.get(Kind::Workflow, "orders", None).await.unwrap();
    assert_eq!(got, r);
    assert_eq!(s.get(Kind::Workflow, "orders", Some(1)).await.unwrap(), r);
    assert_not_found(
        s.get(Kind::Workflow, "orders", Some(3)).await,
        "Workflow with id 'orders' not found: it has no version 3",
    );
    assert_not_found(
        s.get(Kind::Workflow, "nope", None).await,
        "Workflow with id 'nope' not found",
    );
    assert_not_found(
        s.get(Kind::Workflow, "nope", Some(1)).await,
        "Workflow with id 'nope' not found",
    );
    // Ids are case-sensitive on every backend.
    assert_not_found(
        s.get(Kind::Workflow, "ORDERS", None).await,
        "Workflow with id 'ORDERS' not found",
    );
    s.create(Kind::Workflow, "ORDERS", &wf("Upper", &[]), admin("create"))
        .await
        .unwrap();

    assert_conflict(
        s.create(Kind::Workflow, "orders", &wf("Again", &[]), admin("create"))
            .await,
        "workflow 'orders' already exists",
    );
    assert!(matches!(
        s.create(Kind::Workflow, "x", &json!([1]), admin("create"))
            .await,
        Err(StorageError::BadRequest(_))
    ));

    let j = got.to_json(Kind::Workflow);
    let keys: Vec<&str> = j.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "workflow_id",
            "name",
            "tags",
            "tasks",
            // Defaults of the fields the definition left out.
            "priority",
            "condition",
            "continue_on_error",
            "version",
            "status",
            "rollout_percentage",
            "created_at",
            "updated_at"
        ]
    );
    assert_eq!(j["status"], "draft");
    // Unicode and nested JSON survive the round trip.
    let def =
        json!({"name": "naïve ✓", "tasks": [{"id": "t", "nested": {"a": [1, 2.5, null, true]}}]});
    s.create(Kind::Workflow, "uni", &def, admin("create"))
        .await
        .unwrap();
    assert_eq!(
        s.get(Kind::Workflow, "uni", None).await.unwrap().definition,
        def
    );
}

async fn list_filters_pagination_and_total(s: Store, _: PathBuf) {
    for (i, tags) in [["x", "y"], ["y", "z"], ["x", "q"], ["z", "z"], ["q", "q"]]
        .iter()
        .enumerate()
    {
        s.create(
            Kind::Workflow,
            &format!("w{i}"),
            &wf(&format!("W{i}"), tags),
            admin("create"),
        )
        .await
        .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let all = ListQuery::default();
    let (page, total) = s.list(Kind::Workflow, &all).await.unwrap();
    assert_eq!(total, 5);
    let ids: Vec<&str> = page.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["w4", "w3", "w2", "w1", "w0"], "newest first");

    let (page, total) = s
        .list(
            Kind::Workflow,
            &ListQuery {
                limit: 2,
                offset: 2,
                ..ListQuery::default()
            },
        )
        .await
        .unwrap();
    assert_eq!((page.len(), total), (2, 5));
    assert_eq!(page[0].id, "w2");
    let (page, total) = s
        .list(
            Kind::Workflow,
            &ListQuery {
                limit: 2,
                offset: 10,
                ..ListQuery::default()
            },
        )
        .await
        .unwrap();
    assert_eq!((page.len(), total), (0, 5));

    let tag = |t: &str| ListQuery {
        tag: Some(t.into()),
        ..ListQuery::default()
    };
    let (page, total) = s.list(Kind::Workflow, &tag("x")).await.unwrap();
    assert_eq!(total, 2);
    assert_eq!(
        page.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["w2", "w0"]
    );
    assert_eq!(s.list(Kind::Workflow, &tag("none")).await.unwrap().1, 0);
    // A tag must equal an element, not be a substring of one.
    assert_eq!(s.list(Kind::Workflow, &tag("q\"")).await.unwrap().1, 0);

    // w1: v1 active, v2 draft. Unfiltered → v2; status=active → v1.
    activate(&s, "w1", None, None).await.unwrap();
    s.new_version(Kind::Workflow, "w1", admin("new_version"))
        .await
        .unwrap();
    let active = ListQuery {
        status: Some(Status::Active),
        ..ListQuery::default()
    };
    let (page, total) = s.list(Kind::Workflow, &active).await.unwrap();
    assert_eq!(total, 1);
    assert_eq!((page[0].id.as_str(), page[0].version), ("w1", 1));
    let (page, total) = s.list(Kind::Workflow, &all).await.unwrap();
    assert_eq!(total, 5, "one row per id");
    let w1 = page.iter().find(|r| r.id == "w1").unwrap();
    assert_eq!((w1.version, w1.status), (2, Status::Draft));
    let drafts = ListQuery {
        status: Some(Status::Draft),
        tag: Some("y".into()),
        ..ListQuery::default()
    };
    let (page, total) = s.list(Kind::Workflow, &drafts).await.unwrap();
    assert_eq!(total, 2);
    assert_eq!(
        page.iter()
            .map(|r| (r.id.as_str(), r.version))
            .collect::<Vec<_>>(),
        [("w1", 2), ("w0", 1)]
    );

    // Channels filter on channel_type and protocol.
    s.create(
        Kind::Channel,
        "c1",
        &channel("a", "sync", "rest"),
        admin("create"),
    )
    .await
    .unwrap();
    s.create(
        Kind::Channel,
        "c2",
        &channel("b", "async", "kafka"),
        admin("create"),
    )
    .await
    .unwrap();
    s.create(
        Kind::Channel,
        "c3",
        &channel("c", "sync", "http"),
        admin("create"),
    )
    .await
    .unwrap();
    let q = |ct: Option<&str>, p: Option<&str>| ListQuery {
        channel_type: ct.map(Into::into),
        protocol: p.map(Into::into),
        ..ListQuery::default()
    };
    assert_eq!(s.list(Kind::Channel, &q(None, None)).await.unwrap().1, 3);
    assert_eq!(
        s.list(Kind::Channel, &q(Some("sync"), None))
            .await
            .unwrap()
            .1,
        2
    );
    let (page, total) = s
        .list(Kind::Channel, &q(Some("sync"), Some("rest")))
        .await
        .unwrap();
    assert_eq!((total, page[0].id.as_str()), (1, "c1"));
    assert_eq!(
        s.list(Kind::Channel, &q(None, Some("kafka")))
            .await
            .unwrap()
            .1,
        1
    );
    assert_eq!(
        s.list(Kind::Workflow, &all).await.unwrap().1,
        5,
        "kinds are separate"
    );
}

async fn update_only_drafts(s: Store, _: PathBuf) {
    let r = s
        .create(Kind::Workflow, "u", &wf("One", &[]), admin("create"))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let u = s
        .update_draft(Kind::Workflow, "u", &wf("Two", &["t"]), admin("update"))
        .await
        .unwrap();
    assert_eq!(
        (u.version, u.status, u.created_at.as_str()),
        (1, Status::Draft, r.created_at.as_str())
    );
    assert_ne!(u.updated_at, r.updated_at);
    assert_eq!(s.get(Kind::Workflow, "u", None).await.unwrap(), u);
    assert_eq!(u.definition["name"], "Two");

    activate(&s, "u", None, None).await.unwrap();
    assert_conflict(
        s.update_draft(Kind::Workflow, "u", &wf("Three", &[]), admin("update"))
            .await,
        "only a draft can be updated, and workflow 'u' has none (version 1 is active); \
         POST /api/v1/admin/workflows/u/versions starts one",
    );
    assert_eq!(
        s.get(Kind::Workflow, "u", None).await.unwrap().definition["name"],
        "Two",
        "active is immutable"
    );
    s.set_status(
        Kind::Workflow,
        "u",
        Status::Archived,
        None,
        None,
        admin("archive"),
    )
    .await
    .unwrap();
    assert_conflict(
        s.update_draft(Kind::Workflow, "u", &wf("Three", &[]), admin("update"))
            .await,
        "only a draft can be updated, and workflow 'u' has none (version 1 is archived); \
         activate a version (PATCH /api/v1/admin/workflows/u/status with {\"status\": \"active\"}), \
         then POST /api/v1/admin/workflows/u/versions starts one",
    );
    assert_not_found(
        s.update_draft(Kind::Workflow, "zz", &wf("x", &[]), admin("update"))
            .await,
        "Workflow with id 'zz' not found",
    );
}

async fn versions_and_new_version(s: Store, _: PathBuf) {
    s.create(Kind::Workflow, "v", &wf("V1", &["a"]), admin("create"))
        .await
        .unwrap();
    assert_conflict(
        s.new_version(Kind::Workflow, "v", admin("new_version"))
            .await,
        "workflow 'v' already has a draft (version 1)",
    );
    s.set_status(
        Kind::Workflow,
        "v",
        Status::Active,
        None,
        None,
        admin("activate"),
    )
    .await
    .unwrap();
    let v2 = s
        .new_version(Kind::Workflow, "v", admin("new_version"))
        .await
        .unwrap();
    assert_eq!(
        (v2.version, v2.status, v2.rollout_percentage),
        (2, Status::Draft, 100)
    );
    assert_eq!(
        v2.definition,
        wf("V1", &["a"]),
        "a copy of the active definition"
    );
    assert_conflict(
        s.new_version(Kind::Workflow, "v", admin("new_version"))
            .await,
        "workflow 'v' already has a draft (version 2)",
    );
    s.update_draft(Kind::Workflow, "v", &wf("V2", &[]), admin("update"))
        .await
        .unwrap();
    assert_eq!(
        s.get(Kind::Workflow, "v", Some(1))
            .await
            .unwrap()
            .definition["name"],
        "V1"
    );
    activate(&s, "v", None, None).await.unwrap();
    let v3 = s
        .new_version(Kind::Workflow, "v", admin("new_version"))
        .await
        .unwrap();
    assert_eq!(
        (v3.version, v3.definition["name"].as_str()),
        (3, Some("V2"))
    );
    let versions: Vec<i64> = s
        .versions(Kind::Workflow, "v")
        .await
        .unwrap()
        .iter()
        .map(|r| r.version)
        .collect();
    assert_eq!(versions, [1, 2, 3]);
    assert_eq!(s.get(Kind::Workflow, "v", None).await.unwrap().version, 3);
    assert_not_found(
        s.versions(Kind::Workflow, "none").await,
        "Workflow with id 'none' not found",
    );
    assert_not_found(
        s.new_version(Kind::Workflow, "none", admin("new_version"))
            .await,
        "Workflow with id 'none' not found",
    );

    // Nothing active: no new version.
    s.create(Kind::Workflow, "n", &wf("N", &[]), admin("create"))
        .await
        .unwrap();
    activate(&s, "n", None, None).await.unwrap();
    s.set_status(
        Kind::Workflow,
        "n",
        Status::Archived,
        None,
        None,
        admin("archive"),
    )
    .await
    .unwrap();
    assert_conflict(
        s.new_version(Kind::Workflow, "n", admin("new_version"))
            .await,
        "workflow 'n' has no active version",
    );
}

async fn activation_canary_rollout_rollback_archive(s: Store, _: PathBuf) {
    use Status::*;
    let k = Kind::Workflow;
    s.create(k, "a", &wf("A", &[]), admin("create"))
        .await
        .unwrap();
    assert_conflict(
        s.set_status(k, "a", Archived, Some(1), None, admin("archive"))
            .await,
        "cannot move workflow 'a' version 1 from draft to archived",
    );
    assert_conflict(
        s.set_status(k, "a", Archived, None, None, admin("archive"))
            .await,
        "workflow 'a' has no active or paused version to archive; version 1 is draft",
    );
    assert_conflict(
        s.set_rollout(k, "a", 50, admin("rollout")).await,
        "workflow 'a' has no active version",
    );
    assert_not_found(
        activate(&s, "a", Some(9), None).await,
        "Workflow with id 'a' not found: it has no version 9",
    );
    assert_not_found(
        activate(&s, "zz", None, None).await,
        "Workflow with id 'zz' not found",
    );
    assert!(matches!(
        activate(&s, "a", None, Some(0)).await,
        Err(StorageError::BadRequest(_))
    ));
    assert!(matches!(
        activate(&s, "a", None, Some(101)).await,
        Err(StorageError::BadRequest(_))
    ));
    assert!(matches!(
        s.set_rollout(k, "a", 0, admin("rollout")).await,
        Err(StorageError::BadRequest(_))
    ));

    let r = activate(&s, "a", None, None).await.unwrap();
    assert_eq!(
        (r.version, r.status, r.rollout_percentage),
        (1, Active, 100)
    );
    assert_conflict(
        activate(&s, "a", Some(1), None).await,
        "cannot move workflow 'a' version 1 from active to active",
    );
    assert_conflict(
        activate(&s, "a", None, None).await,
        "workflow 'a' has no draft or archived version to activate",
    );

    // Canary: v2 at 30%, v1 keeps 70%.
    s.new_version(k, "a", admin("new_version")).await.unwrap();
    let r = activate(&s, "a", None, Some(30)).await.unwrap();
    assert_eq!((r.version, r.status, r.rollout_percentage), (2, Active, 30));
    assert_eq!(states(&s, k, "a").await, [(1, Active, 70), (2, Active, 30)]);
    let engine: Vec<(String, i64)> = s
        .active(k)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.id, r.version))
        .collect();
    assert_eq!(engine, [("a".to_owned(), 1), ("a".to_owned(), 2)]);
    // Rollout below 100 moves the split; 100 archives the older version.
    let (r, changed) = s.set_rollout(k, "a", 60, admin("rollout")).await.unwrap();
    assert_eq!((r.version, r.rollout_percentage, changed), (2, 60, true));
    assert_eq!(states(&s, k, "a").await, [(1, Active, 40), (2, Active, 60)]);
    // The same split again changes nothing and records nothing (audit 68).
    let audits = s.list_audit(None, None, None, 1000, 0).await.unwrap().1;
    let (r, changed) = s.set_rollout(k, "a", 60, admin("rollout")).await.unwrap();
    assert_eq!((r.version, r.rollout_percentage, changed), (2, 60, false));
    assert_eq!(states(&s, k, "a").await, [(1, Active, 40), (2, Active, 60)]);
    assert_eq!(
        s.list_audit(None, None, None, 1000, 0).await.unwrap().1,
        audits
    );
    s.set_rollout(k, "a", 100, admin("rollout")).await.unwrap();
    assert_eq!(
        states(&s, k, "a").await,
        [(1, Archived, 70 - 30), (2, Active, 100)]
    );

    // Two canaries: activating v4 while v2 and v3 are active archives v2.
    s.new_version(k, "a", admin("new_version")).await.unwrap();
    activate(&s, "a", Some(3), Some(20)).await.unwrap();
    assert_eq!(
        states(&s, k, "a").await[1..],
        [(2, Active, 80), (3, Active, 20)]
    );
    s.new_version(k, "a", admin("new_version")).await.unwrap();
    activate(&s, "a", None, Some(10)).await.unwrap();
    assert_eq!(
        states(&s, k, "a").await[1..],
        [(2, Archived, 80), (3, Active, 90), (4, Active, 10)]
    );

    // Archiving the canary gives the other version all the traffic back.
    let r = s
        .set_status(k, "a", Archived, Some(4), None, admin("archive"))
        .await
        .unwrap();
    assert_eq!((r.version, r.status), (4, Archived));
    assert_eq!(
        states(&s, k, "a").await[2..],
        [(3, Active, 100), (4, Archived, 10)]
    );

    // Rollback: archived v1 becomes the only active version at 100%.
    assert!(matches!(
        activate(&s, "a", Some(1), Some(50)).await,
        Err(StorageError::Conflict(m)) if m.contains("always serves 100%")
    ));
    let r = activate(&s, "a", Some(1), None).await.unwrap();
    assert_eq!(
        (r.version, r.status, r.rollout_percentage),
        (1, Active, 100)
    );
    assert_eq!(
        states(&s, k, "a")
            .await
            .iter()
            .map(|s| s.1)
            .collect::<Vec<_>>(),
        [Active, Archived, Archived, Archived]
    );
    // Without a version and without a draft: the most recently archived one (v3, archived by the rollback).
    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    let r = activate(&s, "a", None, None).await.unwrap();
    assert_eq!((r.version, r.rollout_percentage), (3, 100));
    assert_eq!(
        states(&s, k, "a")
            .await
            .iter()
            .map(|s| s.1)
            .collect::<Vec<_>>(),
        [Archived, Archived, Active, Archived]
    );
    // Archive without a version: every active version; then nothing is active.
    let r = s
        .set_status(k, "a", Archived, None, None, admin("archive"))
        .await
        .unwrap();
    assert_eq!((r.version, r.status), (3, Archived));
    assert!(s.active(k).await.unwrap().is_empty());
    assert_conflict(
        s.set_status(k, "a", Archived, Some(3), None, admin("archive"))
            .await,
        "cannot move workflow 'a' version 3 from archived to archived",
    );
    assert!(matches!(
        s.set_status(k, "a", Draft, Some(3), None, admin("x")).await,
        Err(StorageError::BadRequest(_))
    ));

    // A first activation may already be partial.
    s.create(k, "p", &wf("P", &[]), admin("create"))
        .await
        .unwrap();
    let r = activate(&s, "p", None, Some(25)).await.unwrap();
    assert_eq!((r.status, r.rollout_percentage), (Active, 25));
}

async fn pause_and_resume(s: Store, _: PathBuf) {
    use Status::*;
    let k = Kind::Workflow;
    s.create(k, "p", &wf("P", &[]), admin("create"))
        .await
        .unwrap();
    assert_conflict(
        s.set_status(k, "p", Paused, None, None, admin("pause"))
            .await,
        "workflow 'p' has no active version to pause; version 1 is draft",
    );
    assert_conflict(
        s.set_status(k, "p", Paused, Some(1), None, admin("pause"))
            .await,
        "cannot move workflow 'p' version 1 from draft to paused",
    );
    activate(&s, "p", None, None).await.unwrap();
    let r = s
        .set_status(k, "p", Paused, None, None, admin("pause"))
        .await
        .unwrap();
    assert_eq!(r.status, Paused);
    assert!(
        s.active(k).await.unwrap().is_empty(),
        "paused is not served"
    );
    // Resume without a version (no draft): the paused version comes back.
    let r = activate(&s, "p", None, None).await.unwrap();
    assert_eq!(
        (r.version, r.status, r.rollout_percentage),
        (1, Active, 100)
    );
    s.set_status(k, "p", Paused, Some(1), None, admin("pause"))
        .await
        .unwrap();
    let r = s
        .set_status(k, "p", Archived, Some(1), None, admin("archive"))
        .await
        .unwrap();
    assert_eq!(r.status, Archived);
}

async fn channels_names_and_lifecycle(s: Store, _: PathBuf) {
    use Status::*;
    let k = Kind::Channel;
    let r = s
        .create(k, "c1", &channel("orders", "sync", "rest"), admin("create"))
        .await
        .unwrap();
    let j = r.to_json(k);
    assert_eq!(j["channel_id"], "c1");
    assert!(j.get("rollout_percentage").is_none() && j.get("workflow_id") == Some(&json!("w")));
    assert_conflict(
        s.create(k, "c2", &channel("orders", "sync", "rest"), admin("create"))
            .await,
        "a channel named 'orders' already exists",
    );
    assert_conflict(
        s.create(k, "c1", &channel("other", "sync", "rest"), admin("create"))
            .await,
        "channel 'c1' already exists",
    );
    // Workflows and channels are separate namespaces; workflow names need not be unique.
    s.create(Kind::Workflow, "c1", &wf("orders", &[]), admin("create"))
        .await
        .unwrap();
    s.create(Kind::Workflow, "c2", &wf("orders", &[]), admin("create"))
        .await
        .unwrap();

    s.create(
        k,
        "c2",
        &channel("billing", "sync", "rest"),
        admin("create"),
    )
    .await
    .unwrap();
    assert_conflict(
        s.update_draft(k, "c2", &channel("orders", "sync", "rest"), admin("update"))
            .await,
        "a channel named 'orders' already exists",
    );
    // Renaming its own draft to its own name is fine.
    s.update_draft(
        k,
        "c1",
        &channel("orders", "async", "kafka"),
        admin("update"),
    )
    .await
    .unwrap();

    // Same lifecycle as workflows.
    s.set_status(k, "c1", Active, None, None, admin("activate"))
        .await
        .unwrap();
    let v2 = s.new_version(k, "c1", admin("new_version")).await.unwrap();
    assert_eq!(
        (v2.version, v2.definition["name"].as_str()),
        (2, Some("orders"))
    );
    s.set_status(k, "c1", Active, None, None, admin("activate"))
        .await
        .unwrap();
    assert_eq!(
        states(&s, k, "c1").await,
        [(1, Archived, 100), (2, Active, 100)]
    );
    // A channel has no rollout share, and its audit entry reports none.
    let (entries, _) = s
        .list_audit(Some("activate"), Some("channel"), Some("c1"), 1, 0)
        .await
        .unwrap();
    assert_eq!(
        entries[0]["details"]["changes"],
        json!([{"version": 2, "from": "draft", "to": "active"},
               {"version": 1, "from": "active", "to": "archived"}])
    );
    assert!(entries[0]["details"].get("rollout_percentage").is_none());
    assert_conflict(
        s.update_draft(k, "c1", &channel("x", "sync", "rest"), admin("update"))
            .await,
        "only a draft can be updated, and channel 'c1' has none (version 2 is active); \
         POST /api/v1/admin/channels/c1/versions starts one",
    );
    // After a rollback the latest version is archived: the message names
    // the one that serves (audit 116: it named the archived one).
    s.set_status(k, "c1", Active, None, None, admin("activate"))
        .await
        .unwrap();
    assert_eq!(
        states(&s, k, "c1").await,
        [(1, Active, 100), (2, Archived, 100)]
    );
    assert_conflict(
        s.update_draft(k, "c1", &channel("x", "sync", "rest"), admin("update"))
            .await,
        "only a draft can be updated, and channel 'c1' has none (version 1 is active); \
         POST /api/v1/admin/channels/c1/versions starts one",
    );
    assert_not_found(
        s.get(k, "nope", None).await,
        "Channel with id 'nope' not found",
    );
    // After deleting c1 its name is free again.
    s.delete(k, "c1", admin("delete")).await.unwrap();
    s.update_draft(k, "c2", &channel("orders", "sync", "rest"), admin("update"))
        .await
        .unwrap();
}

async fn delete_removes_all_versions(s: Store, _: PathBuf) {
    let k = Kind::Workflow;
    s.create(k, "d", &wf("D", &[]), admin("create"))
        .await
        .unwrap();
    activate(&s, "d", None, None).await.unwrap();
    s.new_version(k, "d", admin("new_version")).await.unwrap();
    s.create(k, "keep", &wf("K", &[]), admin("create"))
        .await
        .unwrap();
    s.delete(k, "d", admin("delete")).await.unwrap();
    assert_not_found(s.get(k, "d", None).await, "Workflow with id 'd' not found");
    assert_not_found(
        s.get(k, "d", Some(1)).await,
        "Workflow with id 'd' not found",
    );
    assert_not_found(s.versions(k, "d").await, "Workflow with id 'd' not found");
    assert_not_found(
        s.delete(k, "d", admin("delete")).await,
        "Workflow with id 'd' not found",
    );
    assert_eq!(s.list(k, &ListQuery::default()).await.unwrap().1, 1);
    // The id can be created again, from version 1.
    let r = s
        .create(k, "d", &wf("D again", &[]), admin("create"))
        .await
        .unwrap();
    assert_eq!(r.version, 1);
    let (entries, _) = s
        .list_audit(Some("delete"), None, None, 10, 0)
        .await
        .unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0]["details"]["versions"], json!([1, 2]));
}

async fn connectors_crud(s: Store, _: PathBuf) {
    let def = json!({"name": "api", "connector_type": "http", "config": {"type": "http", "url": "https://example.com", "auth": {"type": "bearer", "token": "env://API_TOKEN"}}});
    let r = s.create_connector(&def, admin("create")).await.unwrap();
    assert_eq!(
        (r.id.as_str(), r.version, r.status),
        ("api", 1, Status::Active)
    );
    assert_eq!(r.definition, def, "stored as given, env:// kept");
    assert_eq!(s.get_connector("api").await.unwrap(), r);
    let j = r.to_connector_json();
    assert_eq!(j["config"]["auth"]["token"], "env://API_TOKEN");
    assert!(j["created_at"].is_string());
    assert_conflict(
        s.create_connector(&def, admin("create")).await,
        "connector 'api' already exists",
    );
    assert!(matches!(
        s.create_connector(&json!({"connector_type": "http"}), admin("create"))
            .await,
        Err(StorageError::BadRequest(_))
    ));

    for n in ["b", "c", "d"] {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        s.create_connector(&json!({"name": n, "connector_type": "cache", "config": {"type": "cache", "backend": "memory"}}), admin("create"))
            .await
            .unwrap();
    }
    let (page, total) = s.list_connectors(2, 0).await.unwrap();
    assert_eq!(total, 4);
    assert_eq!(
        page.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["d", "c"]
    );
    let (page, _) = s.list_connectors(2, 2).await.unwrap();
    assert_eq!(
        page.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["b", "api"]
    );

    let mut new = def.clone();
    new["config"]["url"] = json!("https://example.org");
    let u = s
        .update_connector("api", &new, admin("update"), None)
        .await
        .unwrap();
    assert_eq!(u.definition, new);
    assert_eq!(s.get_connector("api").await.unwrap().definition, new);
    // An update made from a definition that is no longer stored (its
    // masked secrets put back from it) is a conflict, not a revert.
    let mut later = new.clone();
    later["config"]["timeout_ms"] = json!(5);
    assert!(matches!(
        s.update_connector("api", &later, admin("update"), Some(&def))
            .await,
        Err(StorageError::Conflict(_))
    ));
    assert_eq!(s.get_connector("api").await.unwrap().definition, new);
    s.update_connector("api", &later, admin("update"), Some(&new))
        .await
        .unwrap();
    s.update_connector("api", &new, admin("update"), Some(&later))
        .await
        .unwrap();
    let mut renamed = new.clone();
    renamed["name"] = json!("other");
    assert!(matches!(
        s.update_connector("api", &renamed, admin("update"), None)
            .await,
        Err(StorageError::BadRequest(_))
    ));
    assert_not_found(
        s.update_connector(
            "zz",
            &json!({"connector_type": "http"}),
            admin("update"),
            Some(&json!({})),
        )
        .await,
        "Connector with id 'zz' not found",
    );

    s.delete_connector("b", admin("delete")).await.unwrap();
    assert_not_found(
        s.get_connector("b").await,
        "Connector with id 'b' not found",
    );
    assert_not_found(
        s.delete_connector("b", admin("delete")).await,
        "Connector with id 'b' not found",
    );
    let all: Vec<String> = s
        .all_connectors()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(all, ["api", "c", "d"]);
}

async fn audit_written_with_each_change_only(s: Store, _: PathBuf) {
    let k = Kind::Workflow;
    let a = |action: &str| Audit {
        principal: "admin".into(),
        action: action.into(),
        resource_type: "workflow".into(),
        resource_id: "au".into(),
        version: None,
        details: json!({"request_id": "r1"}),
    };
    s.create(k, "au", &wf("A", &[]), a("create")).await.unwrap();
    s.update_draft(k, "au", &wf("B", &[]), a("update"))
        .await
        .unwrap();
    s.set_status(k, "au", Status::Active, None, None, a("activate"))
        .await
        .unwrap();
    s.new_version(k, "au", a("new_version")).await.unwrap();
    s.set_status(k, "au", Status::Active, None, Some(40), a("activate"))
        .await
        .unwrap();
    s.set_rollout(k, "au", 100, a("rollout")).await.unwrap();
    s.set_status(k, "au", Status::Archived, None, None, a("archive"))
        .await
        .unwrap();

    let (entries, total) = s.list_audit(None, None, None, 50, 0).await.unwrap();
    assert_eq!(total, 7);
    let summary: Vec<(&str, i64)> = entries
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap(),
                e["version"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("archive", 2),
            ("rollout", 2),
            ("activate", 2),
            ("new_version", 2),
            ("activate", 1),
            ("update", 1),
            ("create", 1)
        ],
        "newest first, with the version each change produced"
    );
    let e = &entries[1];
    assert_eq!(
        (
            e["principal"].as_str(),
            e["resource_type"].as_str(),
            e["resource_id"].as_str()
        ),
        (Some("admin"), Some("workflow"), Some("au"))
    );
    assert_eq!(e["details"]["request_id"], "r1", "caller details kept");
    assert_eq!(
        e["details"]["archived_versions"],
        json!([1]),
        "store facts merged"
    );
    assert!(e["created_at"].as_str().unwrap().ends_with('Z'));
    assert!(entries[0]["id"].as_i64().unwrap() > entries[1]["id"].as_i64().unwrap());
    assert_eq!(
        e["details"]["changes"],
        json!([{"version": 2, "from": "active", "to": "active", "rollout_percentage": 100},
               {"version": 1, "from": "active", "to": "archived", "rollout_percentage": 60}])
    );

    // Failed changes leave no entry.
    assert!(s.create(k, "au", &wf("A", &[]), a("create")).await.is_err());
    assert!(
        s.update_draft(k, "au", &wf("C", &[]), a("update"))
            .await
            .is_err()
    );
    assert!(
        s.set_status(k, "au", Status::Archived, None, None, a("archive"))
            .await
            .is_err()
    );
    assert!(s.set_rollout(k, "au", 50, a("rollout")).await.is_err());
    assert!(s.delete(k, "missing", a("delete")).await.is_err());
    assert!(
        s.create_connector(&json!({"name": ""}), a("create"))
            .await
            .is_err()
    );
    assert_eq!(s.list_audit(None, None, None, 50, 0).await.unwrap().1, 7);

    // Filters, paging, standalone entries, other resource types.
    s.audit(Audit {
        principal: "anonymous".into(),
        action: "reload".into(),
        resource_type: "engine".into(),
        resource_id: "engine".into(),
        version: None,
        details: Json::Null,
    })
    .await
    .unwrap();
    s.create_connector(&json!({"name": "cx", "connector_type": "http", "config": {"type": "http", "url": "https://e.com"}}), Audit::new("admin", "create"))
        .await
        .unwrap();
    s.create(
        Kind::Channel,
        "ch",
        &channel("ch", "sync", "rest"),
        Audit::new("read_only", "import"),
    )
    .await
    .unwrap();
    let (e, total) = s
        .list_audit(Some("reload"), None, None, 10, 0)
        .await
        .unwrap();
    assert_eq!(total, 1);
    assert_eq!(
        (e[0]["resource_type"].as_str(), e[0]["details"].clone()),
        (Some("engine"), json!({}))
    );
    assert!(e[0].get("version").is_none(), "version omitted when absent");
    let (e, total) = s
        .list_audit(Some("create"), Some("connector"), None, 10, 0)
        .await
        .unwrap();
    assert_eq!((total, e[0]["resource_id"].as_str()), (1, Some("cx")));
    let (e, total) = s.list_audit(None, None, Some("cx"), 10, 0).await.unwrap();
    assert!(
        total >= 1 && e.iter().all(|a| a["resource_id"] == "cx"),
        "{e:?}"
    );
    assert_eq!(
        s.list_audit(None, None, Some("nothing-here"), 10, 0)
            .await
            .unwrap()
            .1,
        0
    );
    let (e, _) = s
        .list_audit(None, Some("channel"), None, 10, 0)
        .await
        .unwrap();
    assert_eq!(
        (
            e[0]["action"].as_str(),
            e[0]["principal"].as_str(),
            e[0]["version"].as_i64()
        ),
        (Some("import"), Some("read_only"), Some(1))
    );
    assert_eq!(
        s.list_audit(Some("create"), None, None, 10, 0)
            .await
            .unwrap()
            .1,
        2
    );
    let (page, total) = s.list_audit(None, None, None, 3, 3).await.unwrap();
    assert_eq!((page.len(), total), (3, 10));
}

async fn concurrent_new_version_creates_one_draft(s: Store, _: PathBuf) {
    let k = Kind::Workflow;
    s.create(k, "race", &wf("R", &[]), admin("create"))
        .await
        .unwrap();
    activate(&s, "race", None, None).await.unwrap();
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move { s.new_version(k, "race", admin("new_version")).await })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(r) => {
                ok += 1;
                assert_eq!(r.version, 2);
            }
            Err(e) => assert_eq!(
                e.to_string_conflict().to_string(),
                "workflow 'race' already has a draft (version 2)"
            ),
        }
    }
    assert_eq!(ok, 1);
    assert_eq!(
        states(&s, k, "race").await,
        [(1, Status::Active, 100), (2, Status::Draft, 100)]
    );
    assert_eq!(
        s.list_audit(Some("new_version"), None, None, 50, 0)
            .await
            .unwrap()
            .1,
        1
    );
}

/// Race losers must get a Conflict (never a 500); returns it for message checks.
trait ConflictMessage {
    fn to_string_conflict(self) -> StorageError;
}
impl ConflictMessage for StorageError {
    fn to_string_conflict(self) -> StorageError {
        match self {
            StorageError::Conflict(m) => StorageError::Conflict(m),
            other => panic!("expected a Conflict, got {other:?}"),
        }
    }
}

async fn concurrent_activations_leave_one_active(s: Store, _: PathBuf) {
    let k = Kind::Workflow;
    s.create(k, "act", &wf("A", &[]), admin("create"))
        .await
        .unwrap();
    activate(&s, "act", None, None).await.unwrap();
    s.new_version(k, "act", admin("new_version")).await.unwrap();

    // 20 activations of the draft by number: one wins, the rest find it active.
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move { activate(&s, "act", Some(2), None).await })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => ok += 1,
            Err(e) => assert_eq!(
                e.to_string_conflict().to_string(),
                "cannot move workflow 'act' version 2 from active to active"
            ),
        }
    }
    assert_eq!(ok, 1);
    assert_eq!(
        states(&s, k, "act").await,
        [(1, Status::Archived, 100), (2, Status::Active, 100)]
    );

    // 20 mixed activations (draft, rollbacks, canaries) racing: whatever order
    // they land in, the end state is valid.
    s.new_version(k, "act", admin("new_version")).await.unwrap();
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move {
                match i % 4 {
                    0 => activate(&s, "act", None, None).await,
                    1 => activate(&s, "act", Some(1), None).await,
                    2 => activate(&s, "act", Some(3), Some(30)).await,
                    _ => activate(&s, "act", Some(2), None).await,
                }
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await.unwrap() {
            // A canary share for a version that a rollback archived
            // meanwhile is a conflict (a partial rollback is not a listed move).
            Err(StorageError::Conflict(m)) if i % 4 == 2 && m.contains("always serves 100%") => {}
            Err(e) => {
                e.to_string_conflict();
            }
            Ok(_) => {}
        }
    }
    let st = states(&s, k, "act").await;
    let active: Vec<_> = st.iter().filter(|r| r.1 == Status::Active).collect();
    assert!(!active.is_empty() && active.len() <= 2, "{st:?}");
    assert_eq!(
        active.iter().map(|r| r.2).sum::<i64>(),
        100,
        "active shares add up to 100: {st:?}"
    );
    assert!(st.iter().filter(|r| r.1 == Status::Draft).count() <= 1);

    // Parallel rollbacks to different versions: exactly one active at 100%.
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move { activate(&s, "act", Some(1 + i % 3), None).await })
        })
        .collect();
    for t in tasks {
        if let Err(e) = t.await.unwrap() {
            e.to_string_conflict();
        }
    }
    s.set_rollout(k, "act", 100, admin("rollout"))
        .await
        .unwrap();
    let st = states(&s, k, "act").await;
    let active: Vec<_> = st.iter().filter(|r| r.1 == Status::Active).collect();
    assert_eq!(active.len(), 1, "{st:?}");
    assert_eq!(active[0].2, 100);
}

async fn concurrent_channel_names(s: Store, _: PathBuf) {
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move {
                s.create(
                    Kind::Channel,
                    &format!("ch{i}"),
                    &channel("same", "sync", "rest"),
                    admin("create"),
                )
                .await
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => ok += 1,
            Err(e) => assert_eq!(
                e.to_string_conflict().to_string(),
                "a channel named 'same' already exists"
            ),
        }
    }
    assert_eq!(ok, 1);
    assert_eq!(
        s.list(Kind::Channel, &ListQuery::default())
            .await
            .unwrap()
            .1,
        1
    );
}

async fn backups(s: Store, dir: PathBuf) {
    if s.backend() != Backend::Sqlite {
        match s.backup(&dir).await {
            Err(StorageError::BadRequest(m)) => assert_eq!(
                m,
                "backups are only available with SQLite storage; use the database's own tools (pg_dump, mariadb-dump)"
            ),
            other => panic!("expected BadRequest, got {other:?}"),
        }
        assert!(!dir.exists(), "nothing written");
        return;
    }
    assert!(
        Store::list_backups(&dir).unwrap().is_empty(),
        "absent directory: no backups"
    );
    s.create(Kind::Workflow, "b", &wf("B", &[]), admin("create"))
        .await
        .unwrap();
    let first = s.backup(&dir).await.unwrap();
    let second = s.backup(&dir).await.unwrap();
    let name = |j: &Json| j["filename"].as_str().unwrap().to_owned();
    // It holds the connectors' secrets: the owner's only.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.join(name(&first)))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        // So is the directory it created (others could replace a backup).
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{mode:o}");
    }
    assert_ne!(
        name(&first),
        name(&second),
        "the second backup waits for the next second"
    );
    for b in [&first, &second] {
        let n = name(b);
        assert!(
            n.starts_with("sluice_backup_")
                && n.ends_with("Z.db")
                && n.len() == "sluice_backup_20261122T101500Z.db".len(),
            "{n}"
        );
        assert!(b["size_bytes"].as_u64().unwrap() > 0);
        let stamp = &n["sluice_backup_".len()..n.len() - 3];
        let c = b["created_at"].as_str().unwrap();
        assert_eq!(c.replace(['-', ':'], ""), stamp);
    }
    std::fs::write(dir.join("unrelated.txt"), "x").unwrap();
    let list = Store::list_backups(&dir).unwrap();
    assert_eq!(
        list,
        [second.clone(), first.clone()],
        "newest first, other files ignored"
    );

    // The backup is a working database with the data.
    let copy = Store::connect(&format!("sqlite://{}", dir.join(name(&first)).display()), 1)
        .await
        .unwrap();
    copy.migrate().await.unwrap();
    assert_eq!(
        copy.get(Kind::Workflow, "b", None)
            .await
            .unwrap()
            .definition["name"],
        "B"
    );
    copy.close().await;

    // Files already named for every coming second: a 409 after a few
    // seconds, not a wait without end.
    let taken = dir.join("taken");
    std::fs::create_dir_all(&taken).unwrap();
    let now = time::OffsetDateTime::now_utc();
    for ahead in 0..30 {
        let at = now + time::Duration::seconds(ahead);
        let stamp = at
            .format(time::macros::format_description!(
                "[year][month][day]T[hour][minute][second]Z"
            ))
            .unwrap();
        std::fs::write(taken.join(format!("sluice_backup_{stamp}.db")), "").unwrap();
    }
    match s.backup(&taken).await {
        Err(StorageError::Conflict(m)) => assert!(m.contains("already exist"), "{m}"),
        other => panic!("expected Conflict, got {other:?}"),
    }
}

#[tokio::test]
async fn memory_sqlite_and_bad_urls() {
    let s = Store::connect("sqlite::memory:", 8).await.unwrap();
    s.migrate().await.unwrap();
    s.create(Kind::Workflow, "m", &wf("M", &[]), admin("create"))
        .await
        .unwrap();
    // Still there through the (single) pooled connection.
    assert_eq!(s.get(Kind::Workflow, "m", None).await.unwrap().version, 1);
    // A backup of memory would be another, empty database: refused, and no
    // file is written (before: 201 and an empty file).
    let dir = std::env::temp_dir().join(format!("sluice-mem-backup-{}", std::process::id()));
    match s.backup(&dir).await {
        Err(StorageError::BadRequest(m)) => assert!(m.contains("in memory"), "{m}"),
        other => panic!("expected BadRequest, got {other:?}"),
    }
    assert!(!dir.exists());
    assert!(matches!(
        Store::connect("redis://127.0.0.1/", 1).await,
        Err(StorageError::BadRequest(_))
    ));
    // The cause, at once: not the pool's "timed out" after ten seconds.
    let started = std::time::Instant::now();
    for url in [
        "postgres://u:supersecret@127.0.0.1:1/db",
        "mysql://u:supersecret@127.0.0.1:1/db",
    ] {
        match Store::connect(url, 1).await {
            Err(StorageError::Database(m)) => {
                assert!(!m.contains("supersecret"), "{m}");
                assert!(m.to_lowercase().contains("refused"), "{m}");
            }
            other => panic!("expected a connection error, got {other:?}"),
        }
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    // No file: each pooled connection would get its own empty database.
    for url in ["sqlite://", "sqlite:", "sqlite://?mode=rwc"] {
        match Store::connect(url, 1).await {
            Err(StorageError::BadRequest(m)) => {
                assert!(m.contains("names no database file"), "{m}")
            }
            other => panic!("{url}: expected a bad request, got {other:?}"),
        }
    }
}

fn v(version: i64, status: Status, rollout: i64, updated_at: i64) -> VRow {
    VRow {
        version,
        status,
        rollout,
        created_at: 0,
        updated_at,
    }
}

#[test]
fn plans_follow_the_state_table() {
    use Status::*;
    let k = Kind::Workflow;
    // Draft at 100 archives active and paused versions.
    let rows = [
        v(1, Paused, 100, 1),
        v(2, Active, 100, 2),
        v(3, Draft, 100, 3),
    ];
    let p = plan_status(k, "w", &rows, Active, None, None).unwrap();
    assert_eq!(p.target, 3);
    assert_eq!(
        p.changes,
        [
            Change {
                version: 3,
                from: Draft,
                to: Active,
                rollout: 100
            },
            Change {
                version: 1,
                from: Paused,
                to: Archived,
                rollout: 100
            },
            Change {
                version: 2,
                from: Active,
                to: Archived,
                rollout: 100
            },
        ]
    );
    // Resuming paused versions whose shares were paused from different
    // splits (v1 at 100 before the canary, v2 the canary at 30): a split
    // that adds up, the newest keeping its share; anything older archived.
    let rows = [
        v(1, Paused, 100, 1),
        v(2, Paused, 100, 2),
        v(3, Paused, 30, 3),
    ];
    let resumed = |rows: &[VRow]| -> Vec<(i64, Status, i64)> {
        let p = plan_status(k, "w", rows, Active, None, None).unwrap();
        p.changes
            .iter()
            .map(|c| (c.version, c.to, c.rollout))
            .collect()
    };
    assert_eq!(
        resumed(&rows),
        [(1, Archived, 100), (2, Active, 70), (3, Active, 30)]
    );
    let rows = [v(1, Paused, 40, 1), v(2, Paused, 100, 2)];
    assert_eq!(resumed(&rows), [(1, Archived, 40), (2, Active, 100)]);
    // A share asked for is applied to the newest, the one before it
    // serving the rest (audit 85: it was ignored).
    let split = [v(1, Paused, 70, 1), v(2, Paused, 30, 2)];
    let asked = |rows: &[VRow], version: Option<i64>, p: Option<i64>| -> Vec<(i64, Status, i64)> {
        plan_status(k, "w", rows, Active, version, p)
            .unwrap()
            .changes
            .iter()
            .map(|c| (c.version, c.to, c.rollout))
            .collect()
    };
    assert_eq!(
        asked(&split, None, Some(90)),
        [(1, Active, 10), (2, Active, 90)]
    );
    // One version of a paused split resumed by `version` serves all the
    // traffic (it kept its share, and the rest had no workflow), unless a
    // share is asked for; a lone paused version likewise.
    assert_eq!(asked(&split, Some(1), None), [(1, Active, 100)]);
    assert_eq!(asked(&split, Some(2), Some(40)), [(2, Active, 40)]);
    assert_eq!(
        asked(&[v(1, Paused, 30, 1)], None, None),
        [(1, Active, 100)]
    );
    assert_eq!(
        asked(&[v(1, Paused, 100, 1)], None, Some(50)),
        [(1, Active, 50)]
    );
    // A partial rollback of a paused version names its state.
    let e = plan_status(
        k,
        "w",
        &[v(1, Active, 100, 1), v(2, Paused, 100, 2)],
        Active,
        Some(2),
        Some(40),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("resuming paused version 2 while another version serves"),
        "{e}"
    );
    // Nothing to pause: the paused version is named, not the newest.
    let e = plan_status(
        k,
        "w",
        &[
            v(1, Paused, 100, 1),
            v(2, Archived, 100, 2),
            v(3, Archived, 100, 3),
        ],
        Paused,
        None,
        None,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .ends_with("has no active version to pause; version 1 is already paused"),
        "{e}"
    );
    // Resuming a paused version while another is active is a rollback.
    let rows = [v(1, Paused, 100, 1), v(2, Active, 100, 2)];
    let p = plan_status(k, "w", &rows, Active, Some(1), None).unwrap();
    assert_eq!(
        p.changes[1],
        Change {
            version: 2,
            from: Active,
            to: Archived,
            rollout: 100
        }
    );
    // Most recently archived wins when there is no draft.
    let rows = [
        v(1, Archived, 100, 9),
        v(2, Archived, 100, 5),
        v(3, Active, 100, 1),
    ];
    assert_eq!(
        plan_status(k, "w", &rows, Active, None, None)
            .unwrap()
            .target,
        1
    );
    // Rollout with two active: newest gets p, the other 100 - p.
    let rows = [v(1, Active, 50, 1), v(2, Active, 50, 1)];
    let p: Plan = plan_rollout(k, "w", &rows, 75).unwrap();
    assert_eq!(
        p.changes[1],
        Change {
            version: 1,
            from: Active,
            to: Active,
            rollout: 25
        }
    );
}

// ---- reloads read only changed definitions (stamps and digests) ----

fn flow(target: &str, priority: i64) -> Json {
    json!({"name": target, "priority": priority, "tasks": [{"id": "t", "name": "t", "function": {"name": "map", "input": {"mappings": [
        {"path": target, "logic": {"var": "payload.x"}}
    ]}}}]})
}

fn rest_channel(name: &str, route: &str, workflow_id: &str) -> Json {
    json!({"name": name, "channel_type": "sync", "protocol": "rest", "route_pattern": route,
           "methods": ["POST"], "workflow_id": workflow_id, "config_json": {"timeout_ms": 1000}})
}

async fn stamp_of(s: &Store, kind: Kind, id: &str, version: i64) -> Stamp {
    s.stored(kind, id, version).await.unwrap().unwrap().stamp
}

/// Runs one statement on the store's own pool (a hand edit of the database).
async fn raw(s: &Store, sqlite_and_mysql: &str, postgres: &str) {
    match &s.inner.pools {
        Pools::Sqlite(p) => sqlx::query(sqlite_and_mysql).execute(p).await.map(drop),
        Pools::MySql(p) => sqlx::query(sqlite_and_mysql).execute(p).await.map(drop),
        Pools::Postgres(p) => sqlx::query(postgres).execute(p).await.map(drop),
    }
    .unwrap();
}

async fn digests_follow_definitions(s: Store, _: PathBuf) {
    let k = Kind::Workflow;
    s.create(k, "a", &flow("data.a", 1), admin("create"))
        .await
        .unwrap();
    let v1 = stamp_of(&s, k, "a", 1).await;
    assert_eq!(
        v1.digest.as_deref(),
        Some(digest(&flow("data.a", 1).to_string()).as_str())
    );
    // An update of the draft changes the digest and updated_at.
    s.update_draft(k, "a", &flow("data.b", 1), admin("update"))
        .await
        .unwrap();
    let updated = stamp_of(&s, k, "a", 1).await;
    assert_ne!(updated.digest, v1.digest);
    assert!(updated.updated_us > v1.updated_us);
    assert_eq!(updated.created_us, v1.created_us);
    // Activation: same digest, new updated_at; the meta row says the same.
    activate(&s, "a", None, None).await.unwrap();
    let active = stamp_of(&s, k, "a", 1).await;
    assert_eq!(active.digest, updated.digest);
    assert!(active.updated_us > updated.updated_us);
    let rows = s.active_rows(k).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].id.as_str(), rows[0].version), ("a", 1));
    assert_eq!(rows[0].stamp, active);
    assert_eq!(s.active(k).await.unwrap()[0].stamp, active);
    // A new version copies the definition and its digest.
    s.new_version(k, "a", admin("new_version")).await.unwrap();
    assert_eq!(stamp_of(&s, k, "a", 2).await.digest, active.digest);
    // Rows without a digest (written before the column existed) get one
    // from `migrate`, of their stored text.
    raw(
        &s,
        "UPDATE workflows SET digest = NULL",
        "UPDATE workflows SET digest = NULL",
    )
    .await;
    assert_eq!(stamp_of(&s, k, "a", 1).await.digest, None);
    assert!(!s.active_rows(k).await.unwrap()[0].stamp.same(&active));
    s.migrate().await.unwrap();
    let stored = s.stored(k, "a", 1).await.unwrap().unwrap();
    assert_eq!(
        stored.stamp.digest.as_deref(),
        Some(digest(&stored.text).as_str())
    );
    assert!(s.stored(k, "missing", 1).await.unwrap().is_none());
}

/// Builds the engine from `s` twice, from `warm` (reusing what did not
/// change) and from nothing (a cold start), and checks that both serve the
/// same; `warm` becomes the new snapshot. Returns how many workflow
/// versions the warm build compiled.
async fn reload_and_compare(
    s: &Store,
    warm: &mut Arc<crate::engine::Snapshot>,
    step: &str,
) -> usize {
    let built = crate::engine::build(s, 1, warm.clone())
        .await
        .unwrap_or_else(|e| panic!("{step}: {e:?}"));
    let cold = crate::engine::build(s, 1, Arc::default())
        .await
        .unwrap_or_else(|e| panic!("{step} (cold): {e:?}"));
    assert_eq!(
        built.snapshot.fingerprint(),
        cold.snapshot.fingerprint(),
        "after {step}, the reload differs from a cold start"
    );
    let compiled = built.compiled;
    *warm = Arc::new(built.snapshot);
    // Nothing changed since: the next reload serves the same tables, shared,
    // under its own generation; unless a row has no digest (a hand edit),
    // which is read again by every reload.
    let again = crate::engine::build(s, 2, warm.clone())
        .await
        .unwrap_or_else(|e| panic!("{step} (again): {e:?}"));
    let mut undigested = false;
    for kind in [Kind::Workflow, Kind::Channel] {
        let rows = s.active_rows(kind).await.unwrap();
        undigested |= rows.iter().any(|r| r.stamp.digest.is_none());
    }
    assert_eq!(
        again.snapshot.shares_tables_with(warm),
        !undigested,
        "after {step}, a reload with nothing changed (digests missing: {undigested})"
    );
    assert_eq!(again.snapshot.fingerprint(), warm.fingerprint());
    assert_eq!(again.snapshot.generation, 2);
    compiled
}

/// Workflow `a` and channel `ca` (route `/ca/{id}`, serving `a`), both active.
async fn active_flow_and_channel(s: &Store) {
    let (w, c) = (Kind::Workflow, Kind::Channel);
    s.create(w, "a", &flow("data.a", 1), admin("create"))
        .await
        .unwrap();
    s.create(
        c,
        "ca",
        &rest_channel("ca", "/ca/{id}", "a"),
        admin("create"),
    )
    .await
    .unwrap();
    s.set_status(w, "a", Status::Active, None, None, admin("status"))
        .await
        .unwrap();
    s.set_status(c, "ca", Status::Active, None, None, admin("status"))
        .await
        .unwrap();
}

/// A change is committed before the generation moves; if storage refuses
/// the bump, it is tried again in the background until it moves (before,
/// the other replicas never learnt of the change).
async fn a_failed_generation_bump_is_retried_until_it_moves(s: Store, _: PathBuf) {
    let before = s.engine_generation().await.unwrap();
    raw(
        &s,
        "ALTER TABLE engine_generation RENAME TO engine_generation_hidden",
        "ALTER TABLE engine_generation RENAME TO engine_generation_hidden",
    )
    .await;
    assert!(s.bump_engine_generation_or_later().await.is_some());
    raw(
        &s,
        "ALTER TABLE engine_generation_hidden RENAME TO engine_generation",
        "ALTER TABLE engine_generation_hidden RENAME TO engine_generation",
    )
    .await;
    assert_eq!(s.engine_generation().await.unwrap(), before);
    // The first retry comes after a second.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.engine_generation().await.unwrap() == before {
        assert!(
            std::time::Instant::now() < deadline,
            "the generation never moved"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(s.engine_generation().await.unwrap(), before + 1);
}

/// A reload lists the active rows, then reads the texts it does not know.
/// A change that lands in between must not be mixed into the listing: the
/// reload lists again. Before, a canary's old version (listed) could be
/// read after the rollout to 100 % had archived it and dropped, while the
/// new version was not listed: a replica served no workflow at all.
async fn a_reload_reads_one_moment_of_storage(s: Store, _: PathBuf) {
    let w = Kind::Workflow;
    let v = |pairs: &[(&str, i64)]| -> Vec<(String, i64)> {
        pairs.iter().map(|(id, v)| ((*id).to_owned(), *v)).collect()
    };
    active_flow_and_channel(&s).await;
    s.new_version(w, "a", admin("new_version")).await.unwrap();
    s.update_draft(w, "a", &flow("data.a2", 1), admin("update"))
        .await
        .unwrap();
    let before_canary = s.active_rows(w).await.unwrap();
    s.set_status(w, "a", Status::Active, None, Some(30), admin("status"))
        .await
        .unwrap();
    // Version 1 is still active, but no longer as listed (its share moved).
    let (then, now) = crate::engine::listed_and_current(&s, w, before_canary)
        .await
        .unwrap();
    assert_eq!((then, now), (None, v(&[("a", 1), ("a", 2)])));
    let before_rollout = s.active_rows(w).await.unwrap();
    s.set_rollout(w, "a", 100, admin("rollout")).await.unwrap();
    let (then, now) = crate::engine::listed_and_current(&s, w, before_rollout)
        .await
        .unwrap();
    assert_eq!((then, now), (None, v(&[("a", 2)])));
    // Nothing changed since the listing: it stands.
    let listed = s.active_rows(w).await.unwrap();
    let (then, _) = crate::engine::listed_and_current(&s, w, listed)
        .await
        .unwrap();
    assert_eq!(then, Some(v(&[("a", 2)])));
}

async fn reload_after_any_change_equals_a_cold_start(s: Store, _: PathBuf) {
    let (w, c) = (Kind::Workflow, Kind::Channel);
    let mut warm = Arc::default();
    let status = |kind, id: &'static str, to, version, rollout| {
        let s = s.clone();
        async move {
            s.set_status(kind, id, to, version, rollout, admin("status"))
                .await
                .unwrap();
        }
    };
    active_flow_and_channel(&s).await;
    assert_eq!(reload_and_compare(&s, &mut warm, "activation").await, 1);
    let fingerprint = warm.fingerprint();
    assert!(fingerprint.contains("data.a"), "{fingerprint}");
    assert_eq!(reload_and_compare(&s, &mut warm, "no change").await, 0);

    // A new version edited and activated as a canary, then at 100%.
    s.new_version(w, "a", admin("new_version")).await.unwrap();
    s.update_draft(w, "a", &flow("data.a2", 1), admin("update"))
        .await
        .unwrap();
    status(w, "a", Status::Active, None, Some(30)).await;
    assert_eq!(reload_and_compare(&s, &mut warm, "canary").await, 2);
    s.set_rollout(w, "a", 100, admin("rollout")).await.unwrap();
    reload_and_compare(&s, &mut warm, "rollout 100").await;
    assert!(warm.fingerprint().contains("data.a2"));
    // Rollback to version 1.
    status(w, "a", Status::Active, Some(1), None).await;
    reload_and_compare(&s, &mut warm, "rollback").await;
    // Paused and resumed.
    status(w, "a", Status::Paused, None, None).await;
    reload_and_compare(&s, &mut warm, "pause").await;
    status(w, "a", Status::Active, None, None).await;
    reload_and_compare(&s, &mut warm, "resume").await;

    // Deleted while active and created again under the same id and version
    // with another definition.
    s.delete(w, "a", admin("delete")).await.unwrap();
    reload_and_compare(&s, &mut warm, "delete").await;
    s.create(w, "a", &flow("data.again", 1), admin("create"))
        .await
        .unwrap();
    status(w, "a", Status::Active, None, None).await;
    reload_and_compare(&s, &mut warm, "re-create").await;
    assert!(warm.fingerprint().contains("data.again"));

    // The channel: a new version with another route.
    s.new_version(c, "ca", admin("new_version")).await.unwrap();
    s.update_draft(
        c,
        "ca",
        &rest_channel("ca", "/ca2/{id}", "a"),
        admin("update"),
    )
    .await
    .unwrap();
    status(c, "ca", Status::Active, None, None).await;
    assert_eq!(
        reload_and_compare(&s, &mut warm, "channel version").await,
        0
    );
    assert!(warm.routes.find("POST", &["ca2", "x"]).is_some());
    // Channel deleted and created again (same id and version, other route).
    s.delete(c, "ca", admin("delete")).await.unwrap();
    s.create(
        c,
        "ca",
        &rest_channel("ca", "/ca3/{id}", "a"),
        admin("create"),
    )
    .await
    .unwrap();
    status(c, "ca", Status::Active, None, None).await;
    reload_and_compare(&s, &mut warm, "channel re-create").await;
    assert!(warm.routes.find("POST", &["ca3", "x"]).is_some());

    // A hand edit of the database that clears the digest is read again.
    raw(
        &s,
        r#"UPDATE workflows SET definition = '{"name":"hand","priority":1,"tasks":[{"id":"t","name":"t","function":{"name":"map","input":{"mappings":[{"path":"data.hand","logic":{"var":"payload.x"}}]}}}]}', digest = NULL WHERE id = 'a'"#,
        r#"UPDATE workflows SET definition = CAST('{"name":"hand","priority":1,"tasks":[{"id":"t","name":"t","function":{"name":"map","input":{"mappings":[{"path":"data.hand","logic":{"var":"payload.x"}}]}}}]}' AS JSON), digest = NULL WHERE id = 'a'"#,
    )
    .await;
    assert_eq!(reload_and_compare(&s, &mut warm, "hand edit").await, 1);
    assert!(warm.fingerprint().contains("hand"));

    // Many changes at once (more than are read one by one): read whole.
    for i in 0..70 {
        let id = format!("m{i:02}");
        s.create(w, &id, &flow(&format!("data.m{i}"), 1), admin("create"))
            .await
            .unwrap();
        s.set_status(w, &id, Status::Active, None, None, admin("status"))
            .await
            .unwrap();
    }
    assert_eq!(reload_and_compare(&s, &mut warm, "70 new").await, 70);
    // Digests cleared and filled in again: the texts are read again, and
    // the plans whose identity (part of cache keys, `Stamp::identity`)
    // changed are compiled again: the hand-edited row's, which had no
    // digest before (every backend gives back the text as it was written,
    // so the backfill digests what the writes digested). The reload still
    // equals a cold start, and the next one compiles nothing.
    raw(
        &s,
        "UPDATE workflows SET digest = NULL",
        "UPDATE workflows SET digest = NULL",
    )
    .await;
    s.migrate().await.unwrap();
    let recompiled = reload_and_compare(&s, &mut warm, "backfill").await;
    assert_eq!(recompiled, 1, "only the hand-edited row is new");
    assert_eq!(reload_and_compare(&s, &mut warm, "steady").await, 0);
}

/// The `channel_type` and `protocol` columns hold the effective values, so
/// the list filters find channels that left them to their defaults; rows
/// written before (NULL columns) are filled in by `migrate`.
async fn channel_filters_see_effective_type_and_protocol(s: Store, _: PathBuf) {
    let c = Kind::Channel;
    let defs = [
        (
            "r",
            json!({"name": "r", "workflow_id": "w", "route_pattern": "/r", "methods": ["GET"]}),
        ),
        ("n", json!({"name": "n", "workflow_id": "w"})),
        (
            "k",
            json!({"name": "k", "workflow_id": "w", "protocol": "kafka", "config_json": {"topic": "t"}}),
        ),
    ];
    for (id, def) in &defs {
        s.create(c, id, def, admin("create")).await.unwrap();
    }
    let ids = |q: ListQuery| {
        let s = &s;
        async move {
            let (records, _) = s.list(c, &q).await.unwrap();
            let mut ids: Vec<String> = records.into_iter().map(|r| r.id).collect();
            ids.sort();
            ids
        }
    };
    let by = |protocol: Option<&str>, channel_type: Option<&str>| ListQuery {
        protocol: protocol.map(str::to_owned),
        channel_type: channel_type.map(str::to_owned),
        limit: 100,
        ..ListQuery::default()
    };
    let check = || async {
        assert_eq!(ids(by(Some("rest"), None)).await, ["r"]);
        assert_eq!(ids(by(Some("http"), None)).await, ["n"]);
        assert_eq!(ids(by(Some("kafka"), Some("async"))).await, ["k"]);
        assert_eq!(ids(by(None, Some("sync"))).await, ["n", "r"]);
    };
    check().await;
    // As an older version wrote them: NULL where the definition said nothing.
    raw(
        &s,
        "UPDATE channels SET channel_type = NULL, protocol = NULL",
        "UPDATE channels SET channel_type = NULL, protocol = NULL",
    )
    .await;
    assert_eq!(ids(by(Some("rest"), None)).await, Vec::<String>::new());
    s.migrate().await.unwrap();
    check().await;
}

/// Names of this process's threads in the `SCHED_IDLE` class (Linux).
fn idle_threads() -> Vec<String> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue; // the thread ended meanwhile
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        // Field 41 of proc(5), the scheduling policy (5 = SCHED_IDLE).
        if fields.get(38) == Some(&"5") {
            out.push(stat[open + 1..close].to_owned());
        }
    }
    out
}

async fn reloads_build_at_background_priority_on_their_own_connection(s: Store, _: PathBuf) {
    let c = Kind::Channel;
    active_flow_and_channel(&s).await;
    assert!(
        s.has_twin(),
        "a database on disk or a server has a second connection"
    );
    let reloader = crate::engine::Reloader::default();
    let built = reloader.build(&s, 1, Arc::default()).await.unwrap();
    let inline = crate::engine::build(&s, 1, Arc::default()).await.unwrap();
    assert_eq!(built.snapshot.fingerprint(), inline.snapshot.fingerprint());
    assert_eq!(built.snapshot.workflows_loaded, 1);
    assert!(built.snapshot.channels.contains_key("ca"));
    // The thread that built it, and (SQLite) the worker of its own
    // connection, run at background priority.
    let idle = idle_threads();
    assert!(idle.iter().any(|t| t == "sluice-reload"), "{idle:?}");
    if s.backend() == Backend::Sqlite {
        assert!(
            idle.iter().any(|t| t.starts_with("sqlx-sqlite")),
            "{idle:?}"
        );
    }
    // A second reload reuses the thread and sees a change made meanwhile.
    s.set_status(c, "ca", Status::Paused, None, None, admin("status"))
        .await
        .unwrap();
    let again = reloader
        .build(&s, 2, Arc::new(built.snapshot))
        .await
        .unwrap();
    assert!(again.snapshot.channels.is_empty());
    assert_eq!(again.snapshot.generation, 2);
}

/// A new SQLite database file holds connector secrets: the owner's only
/// (it used to be created world-readable, with its `-wal` and `-shm`).
#[cfg(unix)]
#[tokio::test]
async fn a_new_sqlite_database_is_the_owners_only() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(format!("sluice-mode-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("s.db");
    let s = Store::connect(&format!("sqlite://{}", file.display()), 2)
        .await
        .unwrap();
    s.migrate().await.unwrap();
    for name in ["s.db", "s.db-wal", "s.db-shm"] {
        let mode = std::fs::metadata(dir.join(name))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{name}: {mode:o}");
    }
    s.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// An in-memory SQLite database has no second connection: its reloads
/// build on the caller's runtime, and see what the store holds.
#[tokio::test]
async fn in_memory_reloads_build_inline() {
    let s = Store::connect("sqlite::memory:", 4).await.unwrap();
    s.migrate().await.unwrap();
    assert!(!s.has_twin());
    assert!(s.twin().await.is_none());
    s.create(Kind::Workflow, "a", &flow("data.a", 1), admin("create"))
        .await
        .unwrap();
    activate(&s, "a", None, None).await.unwrap();
    let built = crate::engine::Reloader::default()
        .build(&s, 1, Arc::default())
        .await
        .unwrap();
    assert_eq!(built.snapshot.workflows_loaded, 1);
}

/// When the reload thread cannot open its own connection, the reload is
/// built on the shared pool instead of failing, and the next one tries the
/// connection again.
#[tokio::test]
async fn a_reload_without_its_own_connection_uses_the_shared_pool() {
    let dir = std::env::temp_dir().join(format!(
        "sluice_test_twin_{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("s.db").display());
    let s = Store::connect(&url, 4).await.unwrap();
    s.migrate().await.unwrap();
    s.create(Kind::Workflow, "a", &flow("data.a", 1), admin("create"))
        .await
        .unwrap();
    activate(&s, "a", None, None).await.unwrap();
    // The same pool, but a second connection would go where none can open.
    let Pools::Sqlite(pool) = &s.inner.pools else {
        unreachable!()
    };
    let unreachable = Store {
        inner: Arc::new(Inner {
            pools: Pools::Sqlite(pool.clone()),
            backend: Backend::Sqlite,
            sql: Sql::new(Backend::Sqlite),
            backup_lock: tokio::sync::Mutex::new(()),
            write_gate: tokio::sync::Semaphore::new(1),
            sqlite_writer: None,
            submissions: std::sync::Mutex::new(Vec::new()),
            url: Some(format!(
                "sqlite://{}",
                dir.join("missing/dir/s.db").display()
            )),
            json_depth: s.json_depth(),
            max_packet: None,
        }),
    };
    assert!(matches!(unreachable.twin().await, Some(Err(_))));
    let reloader = crate::engine::Reloader::default();
    for generation in [1, 2] {
        let built = reloader
            .build(&unreachable, generation, Arc::default())
            .await
            .unwrap();
        assert_eq!(built.snapshot.workflows_loaded, 1);
        assert_eq!(built.snapshot.generation, generation);
    }
    s.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// What was written comes back as written, text for text: members in the
/// order given (not sorted), `-0.0` kept, on every backend and through
/// every read (get, list, versions, the engine's rows, connectors, audit
/// details). PostgreSQL's JSONB sorted members and dropped the sign.
async fn definitions_come_back_as_written(s: Store, _: PathBuf) {
    let text = |v: &Json| serde_json::to_string(v).unwrap();
    let w = Kind::Workflow;
    let def: Json = serde_json::from_str(
        r#"{"tasks":[{"name":"m","id":"t1","function":{"name":"map","input":{"mappings":[{"path":"data.out","logic":{"zeta":1,"alpha":{"var":"data.x"},"mid":-0.0}}]}}}],"name":"Orders","tags":["z","a"],"description":"d"}"#,
    )
    .unwrap();
    let r = s.create(w, "o", &def, admin("create")).await.unwrap();
    assert_eq!(text(&r.definition), text(&def));
    let got = s.get(w, "o", None).await.unwrap();
    assert_eq!(text(&got.definition), text(&def), "get");
    let (page, _) = s
        .list(
            w,
            &ListQuery {
                tag: Some("z".into()),
                ..ListQuery::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(page.len(), 1, "the tag filter still finds it");
    assert_eq!(text(&page[0].definition), text(&def), "list");
    s.set_status(w, "o", Status::Active, None, None, admin("status"))
        .await
        .unwrap();
    let active = s.active(w).await.unwrap();
    assert_eq!(active.len(), 1);
    assert_eq!(&*active[0].text, text(&def).as_str(), "engine rows");
    s.new_version(w, "o", admin("new_version")).await.unwrap();
    let versions = s.versions(w, "o").await.unwrap();
    assert!(
        versions.iter().all(|v| text(&v.definition) == text(&def)),
        "versions"
    );

    let conn: Json = serde_json::from_str(
        r#"{"name":"api","connector_type":"http","config":{"url":"https://example.com","type":"http","headers":{"X-B":"1","X-A":"2"}}}"#,
    )
    .unwrap();
    s.create_connector(&conn, admin("create")).await.unwrap();
    assert_eq!(
        text(&s.get_connector("api").await.unwrap().definition),
        text(&conn)
    );

    let mut entry = admin("custom");
    entry.details = serde_json::from_str(r#"{"z":1,"a":-0.0}"#).unwrap();
    s.audit(entry).await.unwrap();
    let (entries, _) = s
        .list_audit(Some("custom"), None, None, 10, 0)
        .await
        .unwrap();
    assert_eq!(text(&entries[0]["details"]), r#"{"z":1,"a":-0.0}"#);
}

/// A definition nested 100 levels is kept on every backend (MariaDB's
/// `JSON_VALID` check refused 32 until migration 0005), and the `tag`
/// filter finds it through the `tags` column, which follows updates and is
/// copied to new versions (MariaDB's `JSON_EXTRACT` on the definition
/// stopped at 32 levels and missed it).
async fn deep_definitions_are_kept_and_found_by_tag(s: Store, _: PathBuf) {
    let w = Kind::Workflow;
    let deep = |tags: &[&str]| {
        let mut v = json!("x");
        for _ in 0..100 {
            v = json!([v]);
        }
        let mut def = wf("Deep", tags);
        def["tasks"][0]["function"]["input"]["deep"] = v;
        def
    };
    let ids = |tag: &str| {
        let q = ListQuery {
            tag: Some(tag.into()),
            ..ListQuery::default()
        };
        let s = s.clone();
        async move {
            let (page, total) = s.list(w, &q).await.unwrap();
            assert_eq!(total as usize, page.len());
            page.into_iter().map(|r| r.id).collect::<Vec<_>>()
        }
    };
    s.create(w, "d", &deep(&["deep", "x"]), admin("create"))
        .await
        .unwrap();
    s.create(w, "flat", &wf("Flat", &["x"]), admin("create"))
        .await
        .unwrap();
    assert_eq!(
        s.get(w, "d", None).await.unwrap().definition,
        deep(&["deep", "x"])
    );
    assert_eq!(ids("deep").await, ["d"]);
    assert_eq!(ids("x").await.len(), 2);
    assert!(ids("none").await.is_empty());
    s.update_draft(w, "d", &deep(&["other"]), admin("update"))
        .await
        .unwrap();
    assert!(ids("deep").await.is_empty(), "the column follows an update");
    assert_eq!(ids("other").await, ["d"]);
    s.set_status(w, "d", Status::Active, None, None, admin("status"))
        .await
        .unwrap();
    s.new_version(w, "d", admin("new_version")).await.unwrap();
    assert_eq!(ids("other").await, ["d"], "copied to the new version");
    // Tags that are not an array match nothing, and break nothing.
    let mut odd = wf("Odd", &[]);
    odd["tags"] = json!("deep");
    s.create(w, "odd", &odd, admin("create")).await.unwrap();
    assert!(ids("deep").await.is_empty());
}
