//! Authoring workflows like code: the published JSON Schemas, `sluice test`,
//! `sluice apply`, and the worked examples under `examples/`, each applied to
//! a real server and sent one real request.

use crate::support::{Db, TestServer, kafka_reader, start, start_with};
use serde_json::{Value as Json, json};
use sluice_compiler::plan::compile_workflow;
use sluice_compiler::schema::{DefinitionKind, definition_schema};
use sluice_compiler::validate;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn sluice() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    for (k, _) in std::env::vars() {
        if k.starts_with("SERVICE_") || k == "SLUICE_API_KEY" {
            cmd.env_remove(k);
        }
    }
    cmd
}

fn text(out: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn read_json(path: &Path) -> Json {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The compiler's own verdict on a definition (the admin API's checks).
fn validator_problems(kind: DefinitionKind, def: &Json) -> Vec<String> {
    let problems = match kind {
        DefinitionKind::Workflow => compile_workflow(def).err().unwrap_or_default(),
        DefinitionKind::Channel => validate::validate_channel(def),
        DefinitionKind::Connector => validate::validate_connector(def),
    };
    problems
        .into_iter()
        .map(|d| format!("{}: {}", d.field, d.message))
        .collect()
}

fn schema_errors(kind: DefinitionKind, def: &Json) -> Vec<String> {
    let schema = definition_schema(kind);
    let validator = jsonschema::draft202012::new(&schema).expect("the schema is valid 2020-12");
    validator
        .iter_errors(def)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Every definition file of the examples, with its kind.
fn example_definitions() -> Vec<(DefinitionKind, PathBuf)> {
    let mut out = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(repo("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir() && !p.ends_with("schemas"))
        .collect();
    dirs.sort();
    for dir in dirs {
        for (sub, kind) in [
            ("connectors", DefinitionKind::Connector),
            ("workflows", DefinitionKind::Workflow),
            ("channels", DefinitionKind::Channel),
        ] {
            let Ok(entries) = std::fs::read_dir(dir.join(sub)) else {
                continue;
            };
            for e in entries {
                out.push((kind, e.unwrap().path()));
            }
        }
    }
    out
}

// ---------------------------------------------------------------- schemas

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_are_served_printed_and_committed_alike() {
    let s = start(Db::Sqlite).await;
    for kind in DefinitionKind::ALL {
        let name = kind.name();
        let served = s.get(&format!("/api/v1/schemas/{name}.json")).await;
        assert_eq!(served.status, 200, "{}", served.text);
        assert_eq!(
            served.body["$schema"],
            "https://json-schema.org/draft/2020-12/schema"
        );
        let out = sluice().args(["schema", name]).output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let printed: Json = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            printed, served.body,
            "sluice schema {name} differs from the endpoint"
        );
        // The copies editors use (examples/schemas) are regenerated, not edited.
        let committed = read_json(&repo(&format!("examples/schemas/{name}.json")));
        assert_eq!(
            committed, printed,
            "examples/schemas/{name}.json is stale: run `sluice schema {name} > examples/schemas/{name}.json`"
        );
    }
    // The workflow schema carries the function catalogue's input schemas.
    let wf = s.get("/api/v1/schemas/workflow.json").await.body;
    let functions = s.admin("GET", "/functions", None).await;
    for f in functions.ok(200).as_array().unwrap() {
        let input = &wf["$defs"][format!("input.{}", f["name"].as_str().unwrap())];
        for field in f["fields"].as_array().unwrap() {
            let name = field["name"].as_str().unwrap();
            assert!(
                input["properties"][name].is_object(),
                "input of {} lacks {name}",
                f["name"]
            );
        }
    }
    // The channel schema carries the config_json settings, closed to typos.
    let ch = s.get("/api/v1/schemas/channel.json").await.body;
    let config = &ch["$defs"]["ChannelConfig"];
    assert_eq!(config["additionalProperties"], false);
    for key in sluice_compiler::def::ChannelConfig::KEYS {
        assert!(config["properties"][key].is_object(), "config_json.{key}");
    }
    let r = s.get("/api/v1/schemas/task.json").await;
    r.error(404, "NOT_FOUND");
    let out = sluice().args(["schema", "task"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown kind 'task'"));
}

#[test]
fn every_example_and_the_reference_workload_follow_the_schema() {
    let mut files = example_definitions();
    assert!(files.len() >= 15, "examples found: {files:?}");
    files.push((
        DefinitionKind::Workflow,
        repo("../shared/bench/reference/workflow.json"),
    ));
    files.push((
        DefinitionKind::Channel,
        repo("../shared/bench/reference/channel.json"),
    ));
    for (kind, path) in files {
        let def = read_json(&path);
        assert_eq!(
            schema_errors(kind, &def),
            Vec::<String>::new(),
            "{}",
            path.display()
        );
        assert_eq!(
            validator_problems(kind, &def),
            Vec::<String>::new(),
            "{}",
            path.display()
        );
    }
}

/// Hand-written bad definitions: the schema and the validator both reject
/// each one (the schema is never stricter than the validator, and these are
/// the mistakes it is meant to catch in an editor).
#[test]
fn schema_and_validator_agree_on_bad_definitions() {
    use DefinitionKind::{Channel, Connector, Workflow};
    let task = |f: &str, input: Json| json!({"id": "t", "name": "t", "function": {"name": f, "input": input}});
    let wf = |tasks: Json| json!({"workflow_id": "w", "name": "w", "tasks": tasks});
    let ch = |extra: Json| {
        let mut c = json!({"channel_id": "c", "name": "c", "workflow_id": "w"});
        c.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        c
    };
    let conn =
        |ty: &str, config: Json| json!({"name": "k", "connector_type": ty, "config": config});
    let bad: Vec<(&str, DefinitionKind, Json)> = vec![
        ("no tasks", Workflow, json!({"name": "w"})),
        ("empty tasks", Workflow, wf(json!([]))),
        (
            "no name",
            Workflow,
            json!({"tasks": [task("log", json!({"message": "m"}))]}),
        ),
        (
            "bad id",
            Workflow,
            json!({"workflow_id": "-x", "name": "w", "tasks": [task("log", json!({"message": "m"}))]}),
        ),
        (
            "rollout over 100",
            Workflow,
            json!({"name": "w", "rollout_percentage": 101, "tasks": [task("log", json!({"message": "m"}))]}),
        ),
        (
            "null description",
            Workflow,
            json!({"name": "w", "description": null, "tasks": [task("log", json!({"message": "m"}))]}),
        ),
        (
            "unknown function",
            Workflow,
            wf(json!([task("nope", json!({}))])),
        ),
        (
            "task without function",
            Workflow,
            wf(json!([{"id": "t", "name": "t"}])),
        ),
        (
            "http_call without connector",
            Workflow,
            wf(json!([task("http_call", json!({"path": "/x"}))])),
        ),
        (
            "http_call with a bad method",
            Workflow,
            wf(json!([task(
                "http_call",
                json!({"connector": "c", "method": "FETCH"})
            )])),
        ),
        (
            "http_call with a zero timeout",
            Workflow,
            wf(json!([task(
                "http_call",
                json!({"connector": "c", "timeout_ms": 0})
            )])),
        ),
        (
            "http_call header not a string",
            Workflow,
            wf(json!([task(
                "http_call",
                json!({"connector": "c", "headers": {"x": 1}})
            )])),
        ),
        (
            "db_read without query",
            Workflow,
            wf(json!([task("db_read", json!({"connector": "c"}))])),
        ),
        (
            "db_read with a blank connector",
            Workflow,
            wf(json!([task(
                "db_read",
                json!({"connector": " ", "query": "SELECT 1"})
            )])),
        ),
        (
            "cache_read without key or key_logic",
            Workflow,
            wf(json!([task("cache_read", json!({"connector": "c"}))])),
        ),
        (
            "publish_kafka without topic",
            Workflow,
            wf(json!([task("publish_kafka", json!({"connector": "c"}))])),
        ),
        (
            "connector function without input",
            Workflow,
            wf(json!([{"id": "t", "name": "t", "function": {"name": "mongo_read"}}])),
        ),
        (
            "channel_call with both channel forms",
            Workflow,
            wf(json!([task(
                "channel_call",
                json!({"channel": "a", "channel_logic": "b"})
            )])),
        ),
        (
            "channel_call with neither",
            Workflow,
            wf(json!([task("channel_call", json!({}))])),
        ),
        (
            "channel_call with data and data_logic",
            Workflow,
            wf(json!([task(
                "channel_call",
                json!({"channel": "a", "data": 1, "data_logic": 2})
            )])),
        ),
        (
            "loop without max",
            Workflow,
            json!({"name": "w", "loop": {"init": 0}, "tasks": [task("log", json!({"message": "m"}))]}),
        ),
        (
            "bad halt_on",
            Workflow,
            wf(
                json!([{"id": "t", "name": "t", "halt_on": "always", "function": {"name": "log", "input": {"message": "m"}}}]),
            ),
        ),
        ("channel without workflow", Channel, json!({"name": "c"})),
        (
            "channel name with a space",
            Channel,
            ch(json!({"name": "a b"})),
        ),
        (
            "rest channel without methods",
            Channel,
            ch(json!({"protocol": "rest", "route_pattern": "/x"})),
        ),
        (
            "route without methods",
            Channel,
            ch(json!({"route_pattern": "/x"})),
        ),
        (
            "empty methods",
            Channel,
            ch(json!({"route_pattern": "/x", "methods": []})),
        ),
        (
            "unknown method",
            Channel,
            ch(json!({"route_pattern": "/x", "methods": ["FETCH"]})),
        ),
        (
            "kafka channel without topic",
            Channel,
            ch(json!({"protocol": "kafka"})),
        ),
        (
            "sync kafka channel",
            Channel,
            ch(json!({"protocol": "kafka", "channel_type": "sync", "config_json": {"topic": "t"}})),
        ),
        (
            "config_json typo",
            Channel,
            ch(json!({"config_json": {"timeout": 5}})),
        ),
        (
            "rate limit typo",
            Channel,
            ch(json!({"config_json": {"rate_limit": {"requests_per_second": 1, "brust": 2}}})),
        ),
        (
            "zero timeout",
            Channel,
            ch(json!({"config_json": {"timeout_ms": 0}})),
        ),
        (
            "backpressure without max",
            Channel,
            ch(json!({"config_json": {"backpressure": {}}})),
        ),
        (
            "cors without origins",
            Channel,
            ch(json!({"config_json": {"cors": {"max_age_secs": 5}}})),
        ),
        ("unknown protocol", Channel, ch(json!({"protocol": "grpc"}))),
        (
            "connector without config",
            Connector,
            json!({"name": "k", "connector_type": "http"}),
        ),
        ("unknown connector type", Connector, conn("ftp", json!({}))),
        (
            "http without url",
            Connector,
            conn("http", json!({"timeout_ms": 5})),
        ),
        (
            "config.type differs",
            Connector,
            conn("http", json!({"type": "db", "url": "https://x"})),
        ),
        (
            "db without connection_string",
            Connector,
            conn("db", json!({})),
        ),
        (
            "cache with an unknown backend",
            Connector,
            conn("cache", json!({"backend": "memcached"})),
        ),
        (
            "mongodb without connection_string",
            Connector,
            conn("mongodb", json!({})),
        ),
        ("kafka without brokers", Connector, conn("kafka", json!({}))),
        (
            "too many retries",
            Connector,
            conn(
                "http",
                json!({"url": "https://x", "retry": {"max_retries": 11}}),
            ),
        ),
        (
            "bearer auth without token",
            Connector,
            conn(
                "http",
                json!({"url": "https://x", "auth": {"type": "bearer"}}),
            ),
        ),
        (
            "object storage without bucket",
            Connector,
            conn(
                "object_storage",
                json!({"endpoint": "https://s3", "access_key": "a", "secret_key": "s"}),
            ),
        ),
    ];
    for (what, kind, def) in &bad {
        let by_schema = schema_errors(*kind, def);
        let by_validator = validator_problems(*kind, def);
        assert!(
            !by_schema.is_empty(),
            "{what}: the schema accepts it (validator: {by_validator:?})"
        );
        assert!(
            !by_validator.is_empty(),
            "{what}: the validator accepts it (schema: {by_schema:?})"
        );
    }
}

// ---------------------------------------------------------------- sluice test

fn cases_in(dir: &Path) -> usize {
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            n += cases_in(&path);
        } else {
            let name = path.file_name().unwrap().to_str().unwrap();
            if name.ends_with(".test.yaml") {
                let v: Json =
                    serde_norway::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
                n += v["cases"].as_array().unwrap().len();
            } else if name.ends_with(".test.json") {
                n += read_json(&path)["cases"].as_array().unwrap().len();
            }
        }
    }
    n
}

#[test]
fn sluice_test_passes_every_example() {
    let out = sluice().arg("test").arg(repo("examples")).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let total = cases_in(&repo("examples"));
    assert!(total >= 15, "{total}");
    assert_eq!(
        stdout.lines().last(),
        Some(format!("{total} passed, 0 failed").as_str()),
        "{stdout}"
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count(),
        total
    );
}

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-author-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn sluice_test_reports_failures_with_a_diff_and_exit_1() {
    let dir = temp_dir();
    std::fs::create_dir_all(dir.join("wf")).unwrap();
    std::fs::write(
        dir.join("wf/w.json"),
        json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "get", "name": "get", "function": {"name": "http_call", "input": {
                "connector": "api", "path_logic": {"cat": ["/items/", {"var": "payload.id"}]}, "response_path": "data.item"}}},
            {"id": "save", "name": "save", "function": {"name": "db_write", "input": {
                "connector": "db", "query": "UPDATE items SET seen = true WHERE id = $1", "params": [{"var": "payload.id"}], "output": "temp_data.saved"}}},
            {"id": "out", "name": "out", "function": {"name": "map", "input": {"mappings": [
                {"path": "price", "logic": {"var": "data.item.price"}}]}}}
        ]})
        .to_string(),
    )
    .unwrap();
    let yaml = r#"
workflow: wf/w.json
connectors:
  api:
    - match: {path: /items/1}
      response: {price: 10}
    - match: {path: /items/2}
      error: {kind: timeout, message: api too slow}
cases:
  - name: passes
    request: {data: {id: 1}}
    expect:
      status: 200
      data: {price: 10}
      writes:
        db: [{query: "UPDATE items SET seen = true WHERE id = $1", params: [1]}]
  - name: wrong price
    request: {data: {id: 1}}
    expect: {data: {price: 11}}
  - name: timeout expected as success
    request: {data: {id: 2}}
    expect: {status: completed}
  - name: wrong write
    request: {data: {id: 1}}
    expect:
      writes: {db: [{params: [2]}]}
  - name: no stub matches
    request: {data: {id: 3}}
    expect: {status: 200}
"#;
    let file = dir.join("w.test.yaml");
    std::fs::write(&file, yaml).unwrap();
    let out = sluice().arg("test").arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.last(), Some(&"1 passed, 4 failed"), "{stdout}");
    assert!(
        lines[0].starts_with("ok ") && lines[0].ends_with(":: passes"),
        "{stdout}"
    );
    // The diff shows the expected and the actual value, marked.
    assert!(stdout.contains("-    \"price\": 11"), "{stdout}");
    assert!(stdout.contains("+    \"price\": 10"), "{stdout}");
    assert!(stdout.contains("-  \"status\": \"completed\""), "{stdout}");
    assert!(stdout.contains("+  \"status\": \"failed\""), "{stdout}");
    assert!(stdout.contains("api too slow"), "{stdout}");
    assert!(stdout.contains("+          1"), "{stdout}");
    assert!(
        stdout.contains("no stub answer of connector 'api' matches"),
        "{stdout}"
    );

    // A broken test file is one failure, named; no test file at all is exit 2.
    std::fs::write(
        dir.join("bad.test.json"),
        r#"{"workflow": "wf/w.json", "cases": [{"nme": "x"}]}"#,
    )
    .unwrap();
    let out = sluice()
        .arg("test")
        .arg(dir.join("bad.test.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("FAIL") && stdout.contains("nme"),
        "{stdout}"
    );
    assert!(stdout.ends_with("0 passed, 1 failed\n"), "{stdout}");
    let empty = temp_dir();
    let out = sluice().arg("test").arg(&empty).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

// ---------------------------------------------------------------- sluice apply

fn apply(s: &TestServer, dir: &Path, extra: &[&str]) -> Output {
    sluice()
        .args(["apply", "--server", &s.base])
        .args(extra)
        .arg(dir)
        .output()
        .unwrap()
}

fn write_def(dir: &Path, rel: &str, def: &Json) {
    let path = dir.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, serde_json::to_string_pretty(def).unwrap()).unwrap();
}

async fn generation(s: &TestServer) -> u64 {
    s.admin("GET", "/engine/status", None).await.ok(200)["generation"]
        .as_u64()
        .unwrap()
}

async fn versions(s: &TestServer, kind: &str, id: &str) -> Vec<(u64, String, u64)> {
    let r = s
        .admin("GET", &format!("/{kind}/{id}/versions"), None)
        .await;
    let mut v: Vec<(u64, String, u64)> = r
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["version"].as_u64().unwrap(),
                r["status"].as_str().unwrap().to_owned(),
                r["rollout_percentage"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    v.sort();
    v
}

fn greeting_workflow(greeting: &str) -> Json {
    json!({"$schema": "../schemas/workflow.json", "workflow_id": "greet", "name": "Greet", "tasks": [
        {"id": "say", "name": "Say", "function": {"name": "map", "input": {"mappings": [
            {"path": "greeting", "logic": {"cat": [greeting, " ", {"var": "payload.name"}]}}]}}}]})
}

fn stdout_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_creates_changes_leaves_alone_and_prunes() {
    let s = start(Db::Sqlite).await;
    let dir = temp_dir();
    write_def(&dir, "workflows/greet.json", &greeting_workflow("hello"));
    write_def(
        &dir,
        "channels/greet.json",
        &json!({"name": "greet", "workflow_id": "greet", "route_pattern": "/greet", "methods": ["POST"]}),
    );
    write_def(
        &dir,
        "connectors/mem.json",
        &json!({"name": "mem", "connector_type": "cache", "config": {"backend": "memory", "max_entries": 10}}),
    );

    // --dry-run: the plan, and nothing changes.
    let g0 = generation(&s).await;
    let out = apply(&s, &dir, &["--dry-run"]);
    assert!(out.status.success(), "{}", text(&out));
    let plan = stdout_of(&out);
    assert!(
        plan.contains("connector  mem") && plan.contains("create"),
        "{plan}"
    );
    assert!(plan.contains("workflow   greet"), "{plan}");
    assert!(plan.contains("(dry run: nothing was changed)"), "{plan}");
    s.admin("GET", "/workflows/greet", None)
        .await
        .error(404, "NOT_FOUND");
    s.admin("GET", "/connectors/mem", None)
        .await
        .error(404, "NOT_FOUND");
    assert_eq!(generation(&s).await, g0);

    // Create: everything exists and serves.
    let out = apply(&s, &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        stdout_of(&out).contains("applied: 1 create") || stdout_of(&out).contains("3 create"),
        "{}",
        text(&out)
    );
    assert_eq!(
        versions(&s, "workflows", "greet").await,
        vec![(1, "active".into(), 100)]
    );
    assert_eq!(
        versions(&s, "channels", "greet").await,
        vec![(1, "active".into(), 0)]
    );
    s.admin("GET", "/connectors/mem", None).await.ok(200);
    let r = s
        .post("/api/v1/data/greet", json!({"data": {"name": "Ada"}}))
        .await;
    assert_eq!(r.ok(200)["greeting"], "hello Ada", "{}", r.text);

    // Unchanged: a second apply sends nothing (no version, no reload).
    let g1 = generation(&s).await;
    let out = apply(&s, &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        stdout_of(&out).contains("applied: 3 unchanged"),
        "{}",
        text(&out)
    );
    assert_eq!(generation(&s).await, g1);
    assert_eq!(versions(&s, "workflows", "greet").await.len(), 1);
    let audit = s.admin("GET", "/audit-logs?limit=1000", None).await;
    let audit_total = audit.body["total"].as_u64().unwrap();

    // Change: a new version, activated, serving.
    write_def(&dir, "workflows/greet.json", &greeting_workflow("hi"));
    write_def(
        &dir,
        "connectors/mem.json",
        &json!({"name": "mem", "connector_type": "cache", "config": {"backend": "memory", "max_entries": 20}}),
    );
    let out = apply(&s, &dir, &["--dry-run"]);
    let plan = stdout_of(&out);
    assert!(
        plan.contains("new version") && plan.contains("update") && plan.contains("unchanged"),
        "{plan}"
    );
    assert_eq!(
        versions(&s, "workflows", "greet").await.len(),
        1,
        "dry run changed nothing"
    );
    let out = apply(&s, &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        versions(&s, "workflows", "greet").await,
        vec![(1, "archived".into(), 100), (2, "active".into(), 100)]
    );
    let r = s
        .post("/api/v1/data/greet", json!({"data": {"name": "Ada"}}))
        .await;
    assert_eq!(r.ok(200)["greeting"], "hi Ada");
    let c = s.admin("GET", "/connectors/mem", None).await;
    assert_eq!(c.ok(200)["config"]["max_entries"], 20);
    assert!(
        s.admin("GET", "/audit-logs?limit=1000", None).await.body["total"]
            .as_u64()
            .unwrap()
            > audit_total
    );

    // Twice is once.
    let g2 = generation(&s).await;
    let out = apply(&s, &dir, &[]);
    assert!(
        stdout_of(&out).contains("applied: 3 unchanged"),
        "{}",
        text(&out)
    );
    assert_eq!(generation(&s).await, g2);

    // --rollout: a canary of the next version.
    write_def(&dir, "workflows/greet.json", &greeting_workflow("hey"));
    let out = apply(&s, &dir, &["--rollout", "30"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        stdout_of(&out).contains("v3 active at 30%"),
        "{}",
        text(&out)
    );
    assert_eq!(
        versions(&s, "workflows", "greet").await,
        vec![
            (1, "archived".into(), 100),
            (2, "active".into(), 70),
            (3, "active".into(), 30)
        ]
    );
    // Promoting the canary: same content, another share.
    let out = apply(&s, &dir, &["--rollout", "100"]);
    assert!(
        stdout_of(&out).contains("rollout 30% -> 100%"),
        "{}",
        text(&out)
    );
    assert_eq!(
        versions(&s, "workflows", "greet").await,
        vec![
            (1, "archived".into(), 100),
            (2, "archived".into(), 70),
            (3, "active".into(), 100)
        ]
    );

    // --prune: what the directory no longer has is archived (not deleted).
    s.deploy(
        crate::support::workflow("stray"),
        crate::support::channel("stray", "stray"),
    )
    .await;
    let out = apply(&s, &dir, &["--prune", "--dry-run"]);
    let plan = stdout_of(&out);
    assert!(
        plan.contains("channel    stray") && plan.contains("archive"),
        "{plan}"
    );
    assert_eq!(versions(&s, "workflows", "stray").await[0].1, "active");
    let out = apply(&s, &dir, &["--prune"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        versions(&s, "workflows", "stray").await,
        vec![(1, "archived".into(), 100)]
    );
    assert_eq!(
        versions(&s, "channels", "stray").await,
        vec![(1, "archived".into(), 0)]
    );
    assert_eq!(versions(&s, "workflows", "greet").await[2].1, "active");
    // Nothing left to prune the second time.
    let out = apply(&s, &dir, &["--prune"]);
    assert!(
        stdout_of(&out).contains("applied: 3 unchanged"),
        "{}",
        text(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_checks_every_file_before_sending_and_uses_the_api_key() {
    let s = start_with(Db::Sqlite, |c| {
        c.admin_auth.enabled = true;
        c.admin_auth.api_key = "apply-secret-key".into();
    })
    .await;
    let dir = temp_dir();
    write_def(&dir, "workflows/good.json", &greeting_workflow("hello"));
    write_def(
        &dir,
        "workflows/bad.json",
        &json!({"workflow_id": "bad", "name": "bad", "tasks": [{"id": "t", "name": "t", "function": {"name": "http_call", "input": {}}}]}),
    );
    write_def(
        &dir,
        "channels/nameless.json",
        &json!({"workflow_id": "good"}),
    );
    let out = apply(&s, &dir, &["--api-key", "apply-secret-key"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.json")
            && stderr.contains("tasks[0].function.input.connector: is required"),
        "{stderr}"
    );
    assert!(
        stderr.contains("nameless.json") && stderr.contains("channel_id (or name) is required"),
        "{stderr}"
    );
    assert!(stderr.contains("nothing was applied"), "{stderr}");
    let r = s
        .send(
            "GET",
            "/api/v1/admin/workflows/greet",
            None,
            &[("authorization", "Bearer apply-secret-key")],
        )
        .await;
    r.error(404, "NOT_FOUND");

    std::fs::remove_file(dir.join("workflows/bad.json")).unwrap();
    std::fs::remove_file(dir.join("channels/nameless.json")).unwrap();
    // Without the key the server refuses, and apply says so with exit 1.
    let out = apply(&s, &dir, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("401 UNAUTHORIZED"),
        "{}",
        text(&out)
    );
    let out = sluice()
        .args(["apply", "--server", &s.base])
        .arg(&dir)
        .env("SLUICE_API_KEY", "apply-secret-key")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let r = s
        .send(
            "GET",
            "/api/v1/admin/workflows/greet",
            None,
            &[("authorization", "Bearer apply-secret-key")],
        )
        .await;
    assert_eq!(r.body["data"]["status"], "active", "{}", r.text);
    // The $schema key of the file is not stored.
    assert!(r.body["data"].get("$schema").is_none(), "{}", r.text);
}

// ---------------------------------------------------------------- the worked examples

/// A copy of an example with some strings replaced (addresses of the test's
/// own servers).
fn example_copy(name: &str, replace: &[(&str, &str)]) -> PathBuf {
    fn copy(from: &Path, to: &Path, replace: &[(&str, &str)]) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let path = e.unwrap().path();
            let target = to.join(path.file_name().unwrap());
            if path.is_dir() {
                copy(&path, &target, replace);
            } else {
                let mut text = std::fs::read_to_string(&path).unwrap();
                for (a, b) in replace {
                    text = text.replace(a, b);
                }
                std::fs::write(target, text).unwrap();
            }
        }
    }
    let to = temp_dir().join(name);
    copy(&repo(&format!("examples/{name}")), &to, replace);
    to
}

fn applied(s: &TestServer, dir: &Path, extra: &[&str]) {
    let out = apply(s, dir, extra);
    assert!(out.status.success(), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_order_enrichment_serves_the_reference_request() {
    let s = start(Db::Sqlite).await;
    applied(&s, &repo("examples/order-enrichment"), &[]);
    let request = crate::support::shared("bench/reference/request.json");
    let expected = crate::support::shared("bench/reference/expected.json");
    let r = s.post("/api/v1/data/orders/ord-7f3a9c", request).await;
    let order = &r.ok(200)["order"];
    assert_eq!(order["order_ref"], "ord-7f3a9c");
    assert_eq!(order["customer"]["tier"], expected["customer"]["tier"]);
    let total = order["total"].as_f64().unwrap();
    assert!(
        (total - expected["total"].as_f64().unwrap()).abs() < 1e-6,
        "{total}"
    );
}

/// A local customers API counting its calls.
async fn customers_api() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counter = calls.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = stream.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).into_owned();
                let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
                counter.fetch_add(1, Ordering::SeqCst);
                let id = path.rsplit('/').next().unwrap_or("");
                let body =
                    json!({"id": id, "name": format!("customer {id}"), "tier": "gold"}).to_string();
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    });
    (format!("http://{addr}"), calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_cached_enrichment_calls_the_api_once_then_reads_redis() {
    use std::sync::atomic::Ordering;
    let s = start_with(Db::Sqlite, |c| c.security.allow_private_networks = true).await;
    let (api, calls) = customers_api().await;
    let dir = example_copy("cached-enrichment", &[("http://127.0.0.1:9000", &api)]);
    applied(&s, &dir, &[]);
    let id = uuid::Uuid::new_v4().simple().to_string();
    let first = s
        .post(
            "/api/v1/data/customers",
            json!({"data": {"customer_id": id}}),
        )
        .await;
    assert_eq!(first.ok(200)["from_cache"], false, "{}", first.text);
    assert_eq!(
        first.body["data"]["customer"]["name"],
        format!("customer {id}")
    );
    let second = s
        .post(
            "/api/v1/data/customers",
            json!({"data": {"customer_id": id}}),
        )
        .await;
    assert_eq!(second.ok(200)["from_cache"], true, "{}", second.text);
    assert_eq!(
        second.body["data"]["customer"],
        first.body["data"]["customer"]
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_sql_orders_writes_and_reads_postgres() {
    use sqlx::Connection;
    let url = crate::support::fresh_database(Db::Postgres).await;
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(&std::fs::read_to_string(repo("examples/sql-orders/schema.sql")).unwrap())
        .execute(&mut conn)
        .await
        .unwrap();
    let s = start(Db::Sqlite).await;
    let dir = example_copy(
        "sql-orders",
        &[("postgres://postgres@127.0.0.1:5432/shop", &url)],
    );
    applied(&s, &dir, &[]);
    for (order, amount) in [("o-1", 10.5), ("o-2", 4.25)] {
        let r = s
            .post(
                "/api/v1/data/shop/orders",
                json!({"data": {"order_id": order, "customer_id": 7, "amount": amount}}),
            )
            .await;
        assert_eq!(r.ok(200)["recorded"], true, "{}", r.text);
    }
    let r = s
        .post(
            "/api/v1/data/shop/orders",
            json!({"data": {"order_id": "o-3", "customer_id": 7, "amount": 1.25}}),
        )
        .await;
    assert_eq!(r.ok(200)["customer"]["orders"], 3, "{}", r.text);
    assert_eq!(r.body["data"]["customer"]["total"].as_f64(), Some(16.0)); // 10.5 + 4.25 + 1.25
    let r = s
        .post(
            "/api/v1/data/shop/orders",
            json!({"data": {"customer_id": 7, "amount": -1}}),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM example_orders")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 3, "the invalid order was not written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_composition_calls_pricing_and_rolls_out_a_canary() {
    let s = start(Db::Sqlite).await;
    let dir = example_copy("composition-canary", &[]);
    applied(&s, &dir, &[]);
    let basket = json!({"data": {"customer": "c-1", "basket": {"items": [{"sku": "a", "price": 60, "qty": 2}]}}});
    let r = s.post("/api/v1/data/checkout", basket.clone()).await;
    assert_eq!(r.ok(200)["total"], 108, "{}", r.text);
    assert_eq!(r.body["data"]["free_shipping"], true);

    // The canary of the README: free shipping from 100 instead of 50, for
    // half of the callers (the bucket follows `x-rollout-key`).
    let checkout = dir.join("workflows/checkout.json");
    let edited = std::fs::read_to_string(&checkout)
        .unwrap()
        .replace("50\n", "100\n");
    std::fs::write(&checkout, edited).unwrap();
    let out = apply(&s, &dir, &["--rollout", "50"]);
    assert!(
        stdout_of(&out).contains("v2 active at 50%"),
        "{}",
        text(&out)
    );
    assert!(
        stdout_of(&out).contains("1 new version, 3 unchanged"),
        "{}",
        text(&out)
    );
    assert_eq!(
        versions(&s, "workflows", "checkout").await,
        vec![(1, "active".into(), 50), (2, "active".into(), 50)]
    );
    let small = json!({"data": {"customer": "c-2", "basket": {"items": [{"sku": "b", "price": 30, "qty": 2}]}}});
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..40 {
        let key = format!("user-{i}");
        let r = s
            .send(
                "POST",
                "/api/v1/data/checkout",
                Some(small.clone()),
                &[("x-rollout-key", &key)],
            )
            .await;
        assert_eq!(r.ok(200)["total"], 60, "{}", r.text);
        seen.insert(r.body["data"]["free_shipping"].as_bool().unwrap());
    }
    assert_eq!(seen.len(), 2, "both versions serve: {seen:?}");
    // Promoting the canary archives the old version.
    let out = apply(&s, &dir, &["--rollout", "100"]);
    assert!(
        stdout_of(&out).contains("rollout 50% -> 100%"),
        "{}",
        text(&out)
    );
    let r = s.post("/api/v1/data/checkout", small).await;
    assert_eq!(r.ok(200)["free_shipping"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_kafka_dead_letter_consumes_and_routes_bad_events() {
    use rdkafka::Message as _;
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let s = start_with(Db::Sqlite, |c| {
        c.kafka.enabled = true;
        c.kafka.brokers = "127.0.0.1:9092".into();
        c.kafka.session_timeout_ms = 6000;
    })
    .await;
    applied(&s, &repo("examples/kafka-dead-letter"), &[]);
    let order = format!("o-{}", uuid::Uuid::new_v4().simple());
    let consumer = kafka_reader(&["orders.dead-letter"]).await;
    // One real event on the channel's topic: the channel consumes it.
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", "127.0.0.1:9092")
        .create()
        .unwrap();
    let event = json!({"order_id": order, "amount": 0}).to_string();
    producer
        .send(
            FutureRecord::to("orders.incoming")
                .key(&order)
                .payload(&event),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    loop {
        // Until the topic exists the consumer reports it unknown; keep reading.
        let Ok(m) = tokio::time::timeout(Duration::from_secs(60), consumer.recv())
            .await
            .expect("the dead letter arrives within 60 s")
        else {
            continue;
        };
        let value: Json =
            serde_json::from_slice(m.payload().unwrap_or_default()).unwrap_or(Json::Null);
        if value["event"]["order_id"] == order {
            assert_eq!(value["reason"], "amount must be positive");
            break;
        }
    }
    // The run leaves a kafka trace saying where the event went (recorded
    // when the run ends, which may be just after the publish).
    let mut last = String::new();
    for _ in 0..100 {
        let traces = s
            .get("/api/v1/data/traces?channel=order-events&mode=kafka&limit=1000")
            .await;
        let found = traces.ok(200).as_array().unwrap().iter().any(|t| {
            t["status"] == "completed"
                && t["data"]["order_id"] == order.as_str()
                && t["data"]["routed_to"] == "orders.dead-letter"
        });
        if found {
            return;
        }
        last = traces.text;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no completed kafka trace for {order}: {last}");
}
