//! Trace storage against real databases (SQLite file, PostgreSQL, MariaDB), one
//! fresh database per test and backend, like `storage::tests`.

use super::super::tests::{TestDb, backend_tests};
use super::*;
use serde_json::json;
use std::collections::HashSet;
use std::time::Duration;

/// Runs `body` on a fresh store of `backend`, drops the database, re-raises a panic.
async fn run<F, Fut>(backend: Backend, body: F)
where
    F: FnOnce(Store) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let db = TestDb::new(backend).await;
    let outcome = tokio::spawn(body(db.store.clone())).await;
    db.cleanup().await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

backend_tests!(
    submit_claim_complete_get_list,
    parallel_claimers_never_share_a_trace,
    failure_dead_letter_retry_and_exhaustion,
    expired_lease_is_reclaimed_and_fences_the_old_run,
    sweep_takes_expired_runs_first_then_the_oldest_pending,
    concurrent_submissions_are_each_stored_once_and_answered,
    storing_once_leaves_a_stored_submission_alone,
    retention_deletes_old_traces_and_their_dead_letters,
);

const LEASE: Duration = Duration::from_secs(300);

fn new_trace(id: &str, channel: &str, created_at: i64) -> NewTrace {
    NewTrace {
        trace_id: id.into(),
        channel: channel.into(),
        mode: "async".into(),
        bucket: Some(42),
        payload: json!({"n": 1}).to_string(),
        metadata: json!({"headers": {"authorization": "******"}}).to_string(),
        created_at,
    }
}

fn outcome(c: &Claimed, data: Option<Json>, errors: Json) -> Outcome {
    Outcome {
        trace_id: c.trace_id.clone(),
        attempt: c.attempt,
        workflow_id: Some("wf".into()),
        workflow_version: Some(3),
        data: data.map(|d| d.to_string()),
        errors,
        duration_ms: 1.5,
    }
}

async fn submit_claim_complete_get_list(s: Store) {
    let now = now_micros();
    s.insert_pending(&new_trace("t1", "orders", now))
        .await
        .unwrap();
    s.insert_pending(&new_trace("t2", "billing", now + 1))
        .await
        .unwrap();
    let t = s.get_trace("t1").await.unwrap();
    assert_eq!(
        (t.status, t.attempts, t.data.clone(), t.errors.clone()),
        (TraceStatus::Pending, 0, None, json!([]))
    );
    let j = t.to_json();
    assert_eq!(j["status"], "pending");
    assert!(j["started_at"].is_null() && j["workflow_id"].is_null());

    let c = s.claim_trace("t1", LEASE).await.unwrap().expect("claimed");
    assert_eq!(
        (c.attempt, c.bucket, c.channel.as_str()),
        (1, Some(42), "orders")
    );
    assert_eq!(c.payload, r#"{"n":1}"#);
    assert!(
        s.claim_trace("t1", LEASE).await.unwrap().is_none(),
        "running and leased"
    );
    assert_eq!(
        s.get_trace("t1").await.unwrap().status,
        TraceStatus::Running
    );

    // Key order of the result is kept byte for byte.
    let data: Json = serde_json::from_str(r#"{"z":1,"a":{"y":2,"b":3}}"#).unwrap();
    assert!(
        s.complete_trace(&outcome(&c, Some(data.clone()), json!([])))
            .await
            .unwrap()
    );
    assert!(
        !s.complete_trace(&outcome(&c, None, json!([])))
            .await
            .unwrap(),
        "finished once"
    );
    let t = s.get_trace("t1").await.unwrap();
    assert_eq!(t.status, TraceStatus::Completed);
    assert_eq!(t.data.as_ref().unwrap().to_string(), data.to_string());
    assert_eq!(
        (t.workflow_id.as_deref(), t.workflow_version, t.attempts),
        (Some("wf"), Some(3), 1)
    );
    assert_eq!(t.duration_ms, Some(1.5));
    assert!(t.started_at.is_some() && t.completed_at.is_some());
    assert!(
        s.claim_trace("t1", LEASE).await.unwrap().is_none(),
        "completed"
    );

    // Lists: newest first, filters, paging, total.
    let all = |q: TraceQuery| {
        let s = s.clone();
        async move {
            let (rows, total) = s.list_traces(&q).await.unwrap();
            (
                rows.into_iter().map(|t| t.trace_id).collect::<Vec<_>>(),
                total,
            )
        }
    };
    assert_eq!(
        all(TraceQuery::default()).await,
        (vec!["t2".into(), "t1".into()], 2)
    );
    let q = TraceQuery {
        status: Some(TraceStatus::Completed),
        ..Default::default()
    };
    assert_eq!(all(q).await, (vec!["t1".into()], 1));
    let q = TraceQuery {
        channel: Some("billing".into()),
        ..Default::default()
    };
    assert_eq!(all(q).await, (vec!["t2".into()], 1));
    let q = TraceQuery {
        mode: Some("kafka".into()),
        ..Default::default()
    };
    assert_eq!(all(q).await, (vec![], 0));
    let q = TraceQuery {
        limit: 1,
        offset: 1,
        ..Default::default()
    };
    assert_eq!(all(q).await, (vec!["t1".into()], 2));

    match s.get_trace("nope").await {
        Err(StorageError::NotFound(m)) => assert_eq!(m, "Trace with id 'nope' not found"),
        other => panic!("{other:?}"),
    }
}

async fn parallel_claimers_never_share_a_trace(s: Store) {
    let now = now_micros();
    for i in 0..30 {
        s.insert_pending(&new_trace(&format!("p{i:02}"), "c", now + i))
            .await
            .unwrap();
    }
    // Eight sweepers drain the table concurrently: every trace is taken once.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            while let Some(c) = s.claim_next_trace(LEASE).await.unwrap() {
                mine.push((c.trace_id, c.attempt));
            }
            mine
        }));
    }
    let mut seen = HashSet::new();
    for t in tasks {
        for (id, attempt) in t.await.unwrap() {
            assert_eq!(attempt, 1);
            assert!(seen.insert(id.clone()), "{id} claimed twice");
        }
    }
    assert_eq!(seen.len(), 30);

    // Eight workers race for one id: exactly one wins.
    s.insert_pending(&new_trace("one", "c", now)).await.unwrap();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.claim_trace("one", LEASE).await.unwrap().is_some()
        }));
    }
    let mut wins = 0;
    for t in tasks {
        wins += usize::from(t.await.unwrap());
    }
    assert_eq!(wins, 1);
}

async fn failure_dead_letter_retry_and_exhaustion(s: Store) {
    let policy = RetryPolicy {
        max_retries: 1,
        base_delay_secs: 1,
    };
    s.insert_pending(&new_trace("f", "c", now_micros()))
        .await
        .unwrap();
    let c = s.claim_trace("f", LEASE).await.unwrap().unwrap();
    let errors = json!([{"code": "TASK_ERROR", "task_id": "boom", "message": "exploded"}]);
    let before = now_micros();
    assert!(
        s.fail_trace(&outcome(&c, None, errors.clone()), policy)
            .await
            .unwrap()
    );
    let t = s.get_trace("f").await.unwrap();
    assert_eq!(
        (t.status, t.attempts, t.errors.clone()),
        (TraceStatus::Failed, 1, errors.clone())
    );
    let d = s.dlq_entry("f").await.unwrap().expect("dead letter");
    assert_eq!((d.state.as_str(), d.attempts), ("waiting", 1));
    assert_eq!(d.last_error, "TASK_ERROR: exploded");
    let next = d.next_retry_at.unwrap();
    assert!(
        next >= before + 1_000_000 && next <= now_micros() + 1_000_000,
        "{next}"
    );
    // Not due yet.
    assert!(s.requeue_due_traces(10, policy).await.unwrap().is_empty());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        s.requeue_due_traces(10, policy).await.unwrap(),
        vec!["f".to_owned()]
    );
    // Waiting again: no run times of the failed attempt (they used to stay
    // until the retry ran), its errors kept until the retry's outcome.
    let t = s.get_trace("f").await.unwrap();
    assert_eq!(
        (
            t.status,
            t.started_at,
            t.completed_at,
            t.duration_ms,
            t.errors.clone()
        ),
        (TraceStatus::Pending, None, None, None, errors.clone())
    );
    assert!(s.dlq_entry("f").await.unwrap().is_none());
    // The retry fails too: the budget (one retry) is spent.
    let c = s.claim_trace("f", LEASE).await.unwrap().unwrap();
    assert_eq!(c.attempt, 2);
    assert!(
        s.fail_trace(&outcome(&c, None, errors.clone()), policy)
            .await
            .unwrap()
    );
    let d = s.dlq_entry("f").await.unwrap().unwrap();
    assert_eq!(
        (d.state.as_str(), d.attempts, d.next_retry_at),
        ("exhausted", 2, None)
    );
    assert!(s.requeue_due_traces(10, policy).await.unwrap().is_empty());
    let t = s.get_trace("f").await.unwrap();
    assert_eq!(
        (t.status, t.attempts, t.errors),
        (TraceStatus::Failed, 2, errors.clone())
    );

    // A retry that succeeds clears its dead letter.
    s.insert_pending(&new_trace("g", "c", now_micros()))
        .await
        .unwrap();
    let c = s.claim_trace("g", LEASE).await.unwrap().unwrap();
    let zero = RetryPolicy {
        max_retries: 3,
        base_delay_secs: 1,
    };
    s.fail_trace(&outcome(&c, None, json!([])), zero)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        s.requeue_due_traces(10, policy).await.unwrap(),
        vec!["g".to_owned()]
    );
    let c = s.claim_trace("g", LEASE).await.unwrap().unwrap();
    assert!(
        s.complete_trace(&outcome(&c, Some(json!({})), json!([])))
            .await
            .unwrap()
    );
    assert!(s.dlq_entry("g").await.unwrap().is_none());
    assert_eq!(s.get_trace("g").await.unwrap().attempts, 2);

    // A dead letter written under a larger budget (three retries) whose
    // runs spend the budget in force now (one retry): exhausted when due,
    // not run again (audit 108: one more run after the limit was lowered
    // across a restart).
    s.insert_pending(&new_trace("h", "c", now_micros()))
        .await
        .unwrap();
    for _ in 0..2 {
        let c = s.claim_trace("h", LEASE).await.unwrap().unwrap();
        s.fail_trace(&outcome(&c, None, errors.clone()), zero)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(2100)).await;
        if c.attempt == 1 {
            assert_eq!(
                s.requeue_due_traces(10, zero).await.unwrap(),
                vec!["h".to_owned()]
            );
        }
    }
    assert!(s.requeue_due_traces(10, policy).await.unwrap().is_empty());
    let d = s.dlq_entry("h").await.unwrap().unwrap();
    assert_eq!(
        (d.state.as_str(), d.attempts, d.next_retry_at),
        ("exhausted", 2, None)
    );
    let t = s.get_trace("h").await.unwrap();
    assert_eq!((t.status, t.attempts), (TraceStatus::Failed, 2));
}

/// Submissions stored together (those that wait for the write gate are
/// grouped): each is stored once and answered for itself, a duplicate id
/// with a conflict while the rest of its group is stored.
async fn concurrent_submissions_are_each_stored_once_and_answered(s: Store) {
    let now = now_micros();
    for i in 0..20 {
        s.insert_pending(&new_trace(&format!("dup{i}"), "g", now))
            .await
            .unwrap();
    }
    // The write gate is held until every submission waits for it, so they
    // are stored in groups of 64 with the duplicates among them.
    let gate = s.inner.write_gate.acquire().await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..220 {
        let s = s.clone();
        // Every eleventh repeats a stored id.
        let id = if i % 11 == 0 {
            format!("dup{}", i / 11)
        } else {
            format!("new{i}")
        };
        tasks.push(tokio::spawn(async move {
            let r = s.insert_pending(&new_trace(&id, "g", now + 1)).await;
            (id, r)
        }));
    }
    while queue(&s.inner.submissions).len() < 220 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(gate);
    let (mut stored, mut refused) = (0, 0);
    for t in tasks {
        let (id, r) = t.await.unwrap();
        if id.starts_with("dup") {
            assert!(matches!(r, Err(StorageError::Conflict(_))), "{id}: {r:?}");
            refused += 1;
        } else {
            r.unwrap_or_else(|e| panic!("{id}: {e}"));
            assert_eq!(s.get_trace(&id).await.unwrap().status, TraceStatus::Pending);
            stored += 1;
        }
    }
    assert_eq!((stored, refused), (200, 20));
    let all = s
        .list_traces(&TraceQuery {
            channel: Some("g".into()),
            ..TraceQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(all.1, 220);
}

/// The statement a submission stores itself with when the group that took
/// it was abandoned (it may or may not be stored): a second time changes
/// nothing and is no error, on every backend's dialect.
async fn storing_once_leaves_a_stored_submission_alone(s: Store) {
    let t = new_trace("once", "g", now_micros());
    let once = &s.sql().traces.insert_once;
    s.insert_row(once, &t).await.unwrap();
    let mut again = t.clone();
    again.payload = r#"{"other": true}"#.into();
    s.insert_row(once, &again).await.unwrap();
    let claimed = s.claim_trace("once", LEASE).await.unwrap().unwrap();
    assert_eq!(claimed.payload, t.payload);
    assert!(matches!(
        s.insert_row(&s.sql().traces.insert, &t).await,
        Err(StorageError::Conflict(_))
    ));
}

async fn sweep_takes_expired_runs_first_then_the_oldest_pending(s: Store) {
    let t0 = now_micros() - 1_000_000;
    // Submitted out of order; `b` and `a` share a creation time (the id
    // breaks the tie).
    for (id, at) in [("c", t0 + 20), ("b", t0 + 10), ("a", t0 + 10), ("done", t0)] {
        s.insert_pending(&new_trace(id, "q", at)).await.unwrap();
    }
    let done = s.claim_trace("done", LEASE).await.unwrap().unwrap();
    assert!(
        s.complete_trace(&outcome(&done, None, json!([])))
            .await
            .unwrap()
    );
    // `c`, the newest, was claimed and its worker crashed (the lease ran out).
    let crashed = s.claim_trace("c", Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(crashed.attempt, 1);
    // One live run is not claimable.
    s.insert_pending(&new_trace("live", "q", t0 - 5))
        .await
        .unwrap();
    s.claim_trace("live", LEASE).await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut order = Vec::new();
    while let Some(c) = s.claim_next_trace(LEASE).await.unwrap() {
        assert_eq!(c.channel, "q");
        assert_eq!(c.payload, json!({"n": 1}).to_string());
        order.push((c.trace_id, c.attempt));
    }
    assert_eq!(
        order,
        [
            ("c".to_owned(), 2),
            ("a".to_owned(), 1),
            ("b".to_owned(), 1)
        ]
    );
    let done = s.get_trace("done").await.unwrap();
    assert_eq!((done.status, done.attempts), (TraceStatus::Completed, 1));
}

async fn expired_lease_is_reclaimed_and_fences_the_old_run(s: Store) {
    s.insert_pending(&new_trace("l", "c", now_micros()))
        .await
        .unwrap();
    let old = s.claim_trace("l", Duration::ZERO).await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    // The lease ran out (a crashed worker): the sweep takes it again.
    let new = s.claim_next_trace(LEASE).await.unwrap().expect("reclaimed");
    assert_eq!((new.trace_id.as_str(), new.attempt), ("l", 2));
    assert!(s.claim_next_trace(LEASE).await.unwrap().is_none());
    // The old run finishing late changes nothing.
    assert!(
        !s.complete_trace(&outcome(&old, Some(json!({"old": true})), json!([])))
            .await
            .unwrap()
    );
    assert!(
        !s.fail_trace(
            &outcome(&old, None, json!([])),
            RetryPolicy {
                max_retries: 5,
                base_delay_secs: 1
            }
        )
        .await
        .unwrap()
    );
    assert!(
        s.complete_trace(&outcome(&new, Some(json!({"new": true})), json!([])))
            .await
            .unwrap()
    );
    assert_eq!(
        s.get_trace("l").await.unwrap().data,
        Some(json!({"new": true}))
    );
    assert!(s.dlq_entry("l").await.unwrap().is_none());

    // Shutdown hands a run back without spending an attempt.
    s.insert_pending(&new_trace("r", "c", now_micros()))
        .await
        .unwrap();
    let c = s.claim_trace("r", LEASE).await.unwrap().unwrap();
    s.release_trace("r", c.attempt).await.unwrap();
    let t = s.get_trace("r").await.unwrap();
    assert_eq!(
        (t.status, t.attempts, t.started_at),
        (TraceStatus::Pending, 0, None)
    );
    assert_eq!(s.claim_trace("r", LEASE).await.unwrap().unwrap().attempt, 1);
}

async fn retention_deletes_old_traces_and_their_dead_letters(s: Store) {
    let now = now_micros();
    let hour = 3_600_000_000;
    let policy = RetryPolicy {
        max_retries: 5,
        base_delay_secs: 1,
    };
    for id in ["failed", "done", "pending", "running"] {
        s.insert_pending(&new_trace(id, "c", now - 2 * hour))
            .await
            .unwrap();
    }
    s.insert_pending(&new_trace("new", "c", now)).await.unwrap();
    let c = s.claim_trace("failed", LEASE).await.unwrap().unwrap();
    s.fail_trace(&outcome(&c, None, json!([])), policy)
        .await
        .unwrap();
    let c = s.claim_trace("done", LEASE).await.unwrap().unwrap();
    s.complete_trace(&outcome(&c, Some(json!({})), json!([])))
        .await
        .unwrap();
    s.claim_trace("running", LEASE).await.unwrap().unwrap();
    assert!(s.dlq_entry("failed").await.unwrap().is_some());
    // Retention counts from the end of a run: the two finished ones ended
    // just now (a trace run after a long outage keeps its result).
    assert_eq!(s.delete_traces_before(now - hour, true).await.unwrap(), 0);
    assert_eq!(s.delete_traces_before(now - hour, false).await.unwrap(), 0);
    // Only the finished trace goes: the failed one's retry is waiting, and
    // pending and running work was accepted (audit 123).
    let later = now_micros() + hour;
    assert_eq!(s.delete_traces_before(later, true).await.unwrap(), 1);
    assert!(matches!(
        s.get_trace("done").await,
        Err(StorageError::NotFound(_))
    ));
    for id in ["failed", "pending", "running", "new"] {
        assert!(s.get_trace(id).await.is_ok(), "{id}");
    }
    assert!(s.dlq_entry("failed").await.unwrap().is_some());
    // With retries off, a waiting dead letter is final: the trace goes too.
    assert_eq!(s.delete_traces_before(later, false).await.unwrap(), 1);
    assert!(matches!(
        s.get_trace("failed").await,
        Err(StorageError::NotFound(_))
    ));
    assert!(s.dlq_entry("failed").await.unwrap().is_none());
    assert_eq!(
        s.get_trace("pending").await.unwrap().status,
        TraceStatus::Pending
    );
    assert_eq!(s.delete_traces_before(later, true).await.unwrap(), 0);
    assert_eq!(s.delete_traces_before(later, false).await.unwrap(), 0);
}

#[test]
fn backoff_doubles_from_the_base_until_the_budget_is_spent() {
    let p = RetryPolicy {
        max_retries: 5,
        base_delay_secs: 30,
    };
    let delays: Vec<_> = (1..=6)
        .map(|a| p.delay_after(a).map(|d| d.as_secs()))
        .collect();
    assert_eq!(
        delays,
        vec![Some(30), Some(60), Some(120), Some(240), Some(480), None]
    );
    let capped = RetryPolicy {
        max_retries: 40,
        base_delay_secs: 30,
    };
    assert_eq!(
        capped.delay_after(30),
        Some(Duration::from_secs(MAX_RETRY_DELAY_SECS))
    );
    assert_eq!(
        RetryPolicy {
            max_retries: 0,
            base_delay_secs: 1
        }
        .delay_after(1),
        None
    );
}

#[test]
fn operation_labels_name_the_store_method() {
    use super::super::op_name;
    assert_eq!(
        op_name(
            "sluice::storage::traces::<impl sluice::storage::Store>::get_trace::{{closure}}::__op"
        ),
        "get_trace"
    );
    assert_eq!(
        op_name("sluice::storage::Store::ping::{{closure}}::{{closure}}::__op"),
        "ping"
    );
}

/// The sweep's claim on SQLite reads the `(status, created_at)` index from
/// its start. One query over `status = 'pending' OR (status = 'running' …)`
/// sorted every pending trace on each claim (a temporary B-tree): 37 ms
/// per claim with 27,000 pending, so a backlog drained at about 30 traces
/// a second.
#[tokio::test]
async fn sqlite_claims_walk_the_claim_index() {
    let db = TestDb::new(Backend::Sqlite).await;
    let s = db.store.clone();
    let crate::storage::Pools::Sqlite(pool) = &s.inner.pools else {
        unreachable!("a SQLite test database")
    };
    let sql = &s.sql().traces;
    // The statement SQLite (and PostgreSQL) claims with, and its two parts
    // as MariaDB runs them.
    for (statement, binds) in [
        (&sql.claim_next_returning, 3),
        (&sql.next_expired, 1),
        (&sql.next_pending, 0),
    ] {
        let explain = format!("EXPLAIN QUERY PLAN {statement}");
        let mut query = sqlx::query(&explain);
        for _ in 0..binds {
            query = query.bind(now_micros());
        }
        let plan: Vec<String> = query
            .fetch_all(pool)
            .await
            .unwrap()
            .iter()
            .map(|row| row.get::<String, _>(3))
            .collect();
        assert!(
            plan.iter()
                .any(|step| step.contains("USING INDEX traces_claim (status=?)")),
            "{statement}: {plan:?}"
        );
        if binds == 3 {
            // The claimed row is found by its key, each part reads the index.
            let parts = plan.iter().filter(|s| s.contains("traces_claim")).count();
            assert_eq!(parts, 2, "{statement}: {plan:?}");
            assert!(
                plan.iter().any(|step| step.contains("(trace_id=?)")),
                "{statement}: {plan:?}"
            );
        }
        assert!(
            !plan
                .iter()
                .any(|step| step.contains("MULTI-INDEX") || step == "USE TEMP B-TREE FOR ORDER BY"),
            "{statement}: {plan:?}"
        );
    }
    db.cleanup().await;
}

/// The sweep's claim on PostgreSQL reads the partial indexes of pending and
/// running traces (migration 0007) whatever the statistics say. Here they
/// were taken while a backlog of 3,000 was pending and most of it has
/// finished since: over `traces_claim` alone the planner walked
/// `traces_created` and filtered on the status, past every finished trace
/// (17 ms per claim at the end of a 17,000-trace drain).
#[tokio::test]
async fn postgres_claims_read_the_claimable_indexes_with_stale_statistics() {
    let db = TestDb::new(Backend::Postgres).await;
    let s = db.store.clone();
    let crate::storage::Pools::Postgres(pool) = &s.inner.pools else {
        unreachable!("a PostgreSQL test database")
    };
    for statement in [
        "INSERT INTO traces (trace_id, channel, mode, status, payload, metadata, errors, attempts, created_at) \
         SELECT 't' || g, 'c', 'async', 'pending', '{}', '{}', '[]', 0, g FROM generate_series(1, 3000) g",
        "ANALYZE traces",
        "UPDATE traces SET status = 'completed' WHERE created_at <= 2990",
    ] {
        sqlx::query(statement).execute(pool).await.unwrap();
    }
    let explain = format!("EXPLAIN {}", s.sql().traces.claim_next_returning);
    let plan: Vec<String> = sqlx::query(&explain)
        .bind(now_micros())
        .bind(now_micros())
        .bind(now_micros())
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|row| row.get::<String, _>(0))
        .collect();
    let uses = |index: &str| plan.iter().any(|step| step.contains(index));
    assert!(
        uses("traces_pending") && uses("traces_running"),
        "{plan:#?}"
    );
    assert!(!uses("traces_created"), "{plan:#?}");
    // And the claim takes the oldest pending trace.
    let claimed = s.claim_next_trace(LEASE).await.unwrap().unwrap();
    assert_eq!(claimed.trace_id, "t2991");
    db.cleanup().await;
}
