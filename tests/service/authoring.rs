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

/// The example directories (`examples/<name>/`), in name order.
fn example_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(repo("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    assert_eq!(dirs.len(), 5, "{dirs:?}");
    dirs
}

/// Every definition file under one example (or a copy of one), with its kind.
fn definitions_in(dir: &Path) -> Vec<(DefinitionKind, PathBuf)> {
    let mut out = Vec::new();
    for (sub, kind) in [
        ("connectors", DefinitionKind::Connector),
        ("workflows", DefinitionKind::Workflow),
        ("channels", DefinitionKind::Channel),
    ] {
        let Ok(entries) = std::fs::read_dir(dir.join(sub)) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries.map(|e| e.unwrap().path()).collect();
        files.sort();
        out.extend(files.into_iter().map(|f| (kind, f)));
    }
    out
}

/// Every definition file of the examples, with its kind.
fn example_definitions() -> Vec<(DefinitionKind, PathBuf)> {
    example_dirs()
        .iter()
        .flat_map(|d| definitions_in(d))
        .collect()
}

/// One entry of `GET /functions` against the `input.<name>` of the served
/// workflow schema: each field's JSON type and required flag are the
/// catalogue's, and the compiler's validator agrees with the schema when a
/// required field is left out or a field has the wrong type.
fn check_function_input_schema(wf_schema: &Json, f: &Json) {
    let fname = f["name"].as_str().unwrap();
    let input = &wf_schema["$defs"][format!("input.{fname}")];
    let fields = f["fields"].as_array().unwrap();
    let names: Vec<&str> = fields.iter().map(|x| x["name"].as_str().unwrap()).collect();
    let props = input["properties"].as_object().unwrap();
    let mut in_schema: Vec<&str> = props.keys().map(String::as_str).collect();
    let mut in_catalogue = names.clone();
    in_schema.sort();
    in_catalogue.sort();
    assert_eq!(in_schema, in_catalogue, "fields of {fname}");
    let plain_required: Vec<&str> = input["required"]
        .as_array()
        .map(|r| r.iter().map(|x| x.as_str().unwrap()).collect())
        .unwrap_or_default();
    // `{"anyOf": [{"required": [a]}, {"required": [a_logic]}]}`: one of the two.
    let either_required: Vec<(String, String)> = input["allOf"]
        .as_array()
        .map(|rules| {
            rules
                .iter()
                .map(|r| {
                    let pair = r["anyOf"].as_array().unwrap();
                    (
                        pair[0]["required"][0].as_str().unwrap().to_owned(),
                        pair[1]["required"][0].as_str().unwrap().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let json_type = |ty: &str| match ty {
        "string" | "number" | "integer" | "boolean" | "object" | "array" => Some(ty.to_owned()),
        "any" | "jsonlogic" => None,
        other => panic!("{fname}: unknown catalogue type {other}"),
    };
    for field in fields {
        let name = field["name"].as_str().unwrap();
        let ty = field["type"].as_str().unwrap();
        let prop = &props[name];
        assert_eq!(
            prop["type"].as_str().map(str::to_owned),
            json_type(ty),
            "{fname}.{name}: the schema's type differs from the catalogue's {ty}"
        );
        let required = field["required"].as_bool().unwrap();
        let twin = format!("{name}_logic");
        let schema_required = if names.contains(&twin.as_str()) && required {
            // Required, or computed by its `_logic` twin: one of the two.
            assert!(
                either_required.contains(&(name.to_owned(), twin.clone()))
                    && !plain_required.contains(&name),
                "{fname}.{name}: the schema must ask for {name} or {twin}: {input}"
            );
            true
        } else {
            plain_required.contains(&name)
        };
        assert_eq!(
            schema_required, required,
            "{fname}.{name}: required is {required} in the catalogue: {input}"
        );
        if !required {
            assert!(
                !either_required.iter().any(|(a, _)| a == name),
                "{fname}.{name} is optional but the schema requires it"
            );
        }
    }

    // The same, by behaviour: the smallest valid input, then one field left
    // out or mistyped at a time; the schema and the validator agree.
    let sample = |field: &Json| -> Json {
        if let Some(allowed) = field["constraint"]["one_of"].as_array() {
            return allowed[0].clone();
        }
        match field["type"].as_str().unwrap() {
            "string" => json!("x"),
            "number" | "integer" => json!(5),
            "boolean" => json!(true),
            "object" => json!({}),
            "array" => json!([]),
            _ => json!("x"),
        }
    };
    let mut minimal = serde_json::Map::new();
    for field in fields.iter().filter(|x| x["required"] == true) {
        minimal.insert(field["name"].as_str().unwrap().into(), sample(field));
    }
    if fname == "channel_call" {
        // Exactly one of channel / channel_logic (both optional alone).
        minimal.insert("channel".into(), json!("x"));
    }
    let workflow = |input: &serde_json::Map<String, Json>| {
        json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "t", "name": "t", "function": {"name": fname, "input": input}}]})
    };
    let verdicts = |input: &serde_json::Map<String, Json>| {
        let def = workflow(input);
        (
            schema_errors(DefinitionKind::Workflow, &def),
            validator_problems(DefinitionKind::Workflow, &def),
        )
    };
    let (by_schema, by_validator) = verdicts(&minimal);
    assert!(
        by_schema.is_empty() && by_validator.is_empty(),
        "{fname}: the minimal input {minimal:?} is refused: {by_schema:?} {by_validator:?}"
    );
    for field in fields {
        let name = field["name"].as_str().unwrap();
        if field["required"] == true {
            let mut without = minimal.clone();
            without.remove(name);
            let (by_schema, by_validator) = verdicts(&without);
            assert!(
                !by_schema.is_empty() && !by_validator.is_empty(),
                "{fname} without {name}: schema {by_schema:?}, validator {by_validator:?}"
            );
        }
        let wrong = match field["type"].as_str().unwrap() {
            "string" | "object" | "array" | "boolean" => json!(12),
            "number" | "integer" => json!("12"),
            _ => continue,
        };
        let mut mistyped = minimal.clone();
        mistyped.insert(name.into(), wrong.clone());
        let (by_schema, by_validator) = verdicts(&mistyped);
        assert!(
            !by_schema.is_empty() && !by_validator.is_empty(),
            "{fname}.{name} = {wrong}: schema {by_schema:?}, validator {by_validator:?}"
        );
    }
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
        assert!(
            served
                .headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("application/json")),
            "{:?}",
            served.headers
        );
        if kind == DefinitionKind::Workflow {
            // The workflow schema carries the function catalogue's input
            // schemas: every field, with the catalogue's type and required flag.
            let functions = s.admin("GET", "/functions", None).await;
            let functions = functions.ok(200).as_array().unwrap();
            assert_eq!(
                functions.len(),
                8,
                "the connector and composition functions"
            );
            for f in functions {
                check_function_input_schema(&served.body, f);
            }
        }
        // The copies editors use (examples/*/schemas) are regenerated, not edited.
        for example in example_dirs() {
            let rel = format!(
                "examples/{}/schemas/{name}.json",
                example.file_name().unwrap().to_str().unwrap()
            );
            let committed = read_json(&repo(&rel));
            assert!(
                committed == printed,
                "{rel} is stale: run `sluice schema {name} > {rel}`"
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

/// `cp -r examples/<name> my-project` keeps the editor's schema: every
/// definition's `"$schema"` is a relative path that, resolved from the copied
/// file as an editor does, names a schema inside the copy, current, that
/// accepts the file.
#[test]
fn a_copied_example_resolves_each_schema_reference_inside_the_copy() {
    for example in example_dirs() {
        let name = example.file_name().unwrap().to_str().unwrap().to_owned();
        let copy = example_copy(&name, &[]);
        let root = copy.canonicalize().unwrap();
        let files = definitions_in(&copy);
        assert!(!files.is_empty(), "{name}");
        for (kind, file) in files {
            let def = read_json(&file);
            let reference = def["$schema"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: no \"$schema\"", file.display()));
            // VS Code's JSON language service resolves a `$schema` that
            // starts with `.` against the file; anything else is a URL.
            assert!(
                reference.starts_with("../"),
                "{}: {reference}",
                file.display()
            );
            let target = file.parent().unwrap().join(reference);
            let resolved = target
                .canonicalize()
                .unwrap_or_else(|e| panic!("{}: {reference} -> {e}", file.display()));
            assert!(
                resolved.starts_with(&root),
                "{}: {reference} points outside the copy",
                file.display()
            );
            assert!(
                resolved.ends_with(format!("schemas/{}.json", kind.name())),
                "{}: {reference} is not the {} schema",
                file.display(),
                kind.name()
            );
            let schema = read_json(&resolved);
            assert_eq!(
                schema,
                definition_schema(kind),
                "{} is stale",
                resolved.display()
            );
            let validator = jsonschema::draft202012::new(&schema).unwrap();
            let errors: Vec<String> = validator.iter_errors(&def).map(|e| e.to_string()).collect();
            assert_eq!(errors, Vec::<String>::new(), "{}", file.display());
        }
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
        // Structural rules the schema states since session 30 (audit 110:
        // each passed the schema and failed at create).
        (
            "cors method not a method",
            Channel,
            ch(
                json!({"config_json": {"cors": {"allowed_origins": ["https://a.example"], "allowed_methods": ["FETCH"]}}}),
            ),
        ),
        (
            "route on an http channel",
            Channel,
            ch(json!({"protocol": "http", "route_pattern": "/r", "methods": ["POST"]})),
        ),
        (
            "methods on an http channel",
            Channel,
            ch(json!({"protocol": "http", "methods": ["POST"]})),
        ),
        (
            "route on a kafka channel",
            Channel,
            ch(json!({"protocol": "kafka", "route_pattern": "/r", "config_json": {"topic": "t"}})),
        ),
        (
            "rate limit on a kafka channel",
            Channel,
            ch(
                json!({"protocol": "kafka", "config_json": {"topic": "t", "rate_limit": {"requests_per_second": 1}}}),
            ),
        ),
        (
            "topic on a rest channel",
            Channel,
            ch(
                json!({"protocol": "rest", "route_pattern": "/r", "methods": ["POST"], "config_json": {"topic": "t"}}),
            ),
        ),
        (
            "consumer group on a name-routed channel",
            Channel,
            ch(json!({"config_json": {"consumer_group": "g"}})),
        ),
        (
            "duplicate methods",
            Channel,
            ch(json!({"route_pattern": "/x", "methods": ["POST", "POST"]})),
        ),
        (
            "burst past 32 bits",
            Channel,
            ch(
                json!({"config_json": {"rate_limit": {"requests_per_second": 1, "burst": 4294967296_u64}}}),
            ),
        ),
        (
            "halt_on on a group",
            Workflow,
            wf(
                json!([{"id": "g", "halt_on": "failure", "tasks": [task("log", json!({"message": "m"}))]}]),
            ),
        ),
        (
            "function on a group",
            Workflow,
            wf(
                json!([{"id": "g", "function": {"name": "log", "input": {"message": "m"}},
                       "tasks": [task("log", json!({"message": "m"}))]}]),
            ),
        ),
        (
            "channel_call without input",
            Workflow,
            wf(json!([{"id": "t", "name": "t", "function": {"name": "channel_call"}}])),
        ),
        (
            "redis cache without url",
            Connector,
            conn("cache", json!({"backend": "redis"})),
        ),
        (
            "unknown auth key",
            Connector,
            conn(
                "http",
                json!({"url": "https://x", "auth": {"type": "bearer", "token": "t", "in": "query"}}),
            ),
        ),
        (
            "unknown retry key",
            Connector,
            conn(
                "http",
                json!({"url": "https://x", "retry": {"max_retries": 1, "x": 1}}),
            ),
        ),
        (
            "no brokers",
            Connector,
            conn("kafka", json!({"brokers": []})),
        ),
        // Bounds the validator sets and the schema states (session 19).
        (
            "description too long",
            Workflow,
            json!({"name": "w", "description": "d".repeat(2049), "tasks": [task("log", json!({"message": "m"}))]}),
        ),
        (
            "channel description too long",
            Channel,
            ch(json!({"description": "d".repeat(2049)})),
        ),
        (
            "zero cache ttl",
            Channel,
            ch(json!({"config_json": {"cache": {"ttl_secs": 0}}})),
        ),
        (
            "zero backpressure",
            Channel,
            ch(json!({"config_json": {"backpressure": {"max_concurrent": 0}}})),
        ),
        (
            "zero rate",
            Channel,
            ch(json!({"config_json": {"rate_limit": {"requests_per_second": 0}}})),
        ),
        (
            "route without a leading slash",
            Channel,
            ch(json!({"route_pattern": "x", "methods": ["GET"]})),
        ),
        (
            "zero http timeout",
            Connector,
            conn("http", json!({"url": "https://x", "timeout_ms": 0})),
        ),
        (
            "zero db pool",
            Connector,
            conn(
                "db",
                json!({"connection_string": "sqlite::memory:", "max_connections": 0}),
            ),
        ),
        (
            "zero memory entries",
            Connector,
            conn("cache", json!({"backend": "memory", "max_entries": 0})),
        ),
        (
            "unknown SASL mechanism",
            Connector,
            conn(
                "kafka",
                json!({"brokers": "b:9092", "sasl": {"mechanism": "MD5", "username": "u", "password": "p"}}),
            ),
        ),
    ];
    // The service ignores `$schema` whatever it holds; so does the schema.
    let odd = json!({"$schema": 5, "name": "w", "tasks": [task("log", json!({"message": "m"}))]});
    assert_eq!(schema_errors(Workflow, &odd), Vec::<String>::new());
    assert!(validator_problems(Workflow, &odd).is_empty());
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
    // So is a stub error of a kind that does not exist (a typo must not
    // quietly become an upstream failure).
    std::fs::write(
        dir.join("kind.test.json"),
        r#"{"workflow": "wf/w.json", "connectors": {"api": [{"error": {"kind": "timout", "message": "x"}}]},
            "cases": [{"name": "x", "request": {"data": {"id": 1}}, "expect": {"status": 502}}]}"#,
    )
    .unwrap();
    let out = sluice()
        .arg("test")
        .arg(dir.join("kind.test.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("FAIL") && stdout.contains("timout") && stdout.contains("circuit_open"),
        "{stdout}"
    );
    assert!(stdout.ends_with("0 passed, 1 failed\n"), "{stdout}");
    // And an expected status that is no status (`complete`).
    std::fs::write(
        dir.join("status.test.json"),
        r#"{"workflow": "wf/w.json",
            "cases": [{"name": "x", "request": {"data": {"id": 1}}, "expect": {"status": "complete"}}]}"#,
    )
    .unwrap();
    let out = sluice()
        .arg("test")
        .arg(dir.join("status.test.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("FAIL") && stdout.contains("expect.status must be completed"),
        "{stdout}"
    );
    let empty = temp_dir();
    let out = sluice().arg("test").arg(&empty).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    // A named file that does not exist is a failure beside the others,
    // which still run.
    let out = sluice()
        .arg("test")
        .arg(dir.join("nope.test.yaml"))
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("FAIL") && stdout.contains("nope.test.yaml"),
        "{stdout}"
    );
    assert!(stdout.ends_with("1 passed, 5 failed\n"), "{stdout}");
    // Test files without a case: nothing ran.
    std::fs::write(
        dir.join("none.test.json"),
        r#"{"workflow": "wf/w.json", "cases": []}"#,
    )
    .unwrap();
    let out = sluice()
        .arg("test")
        .arg(dir.join("none.test.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

/// `mongo_read` stubs answer canned documents matched on the call's
/// database, collection and (computed) filter, or an error; a
/// `circuit_open` error is the data plane's 503.
#[test]
fn sluice_test_stubs_mongo_read_and_connector_errors() {
    let dir = temp_dir();
    write_def(
        &dir,
        "workflows/product.json",
        &json!({"workflow_id": "product", "name": "Product lookup", "tasks": [
            {"id": "filter", "name": "Filter", "function": {"name": "map", "input": {"mappings": [
                {"path": "temp_data.filter.sku", "logic": {"var": "payload.sku"}}]}}},
            {"id": "find", "name": "Find", "function": {"name": "mongo_read", "input": {
                "connector": "catalog", "database": "shop", "collection": "products",
                "filter_logic": {"var": "temp_data.filter"}, "output": "temp_data.found"}}},
            {"id": "answer", "name": "Answer", "function": {"name": "map", "input": {"mappings": [
                {"path": "product", "logic": {"var": "temp_data.found.0"}},
                {"path": "matches", "logic": {"length": {"var": "temp_data.found"}}}]}}}
        ]}),
    );
    let yaml = r#"
workflow: workflows/product.json
connectors:
  catalog:
    - match: {database: shop, collection: products, filter: {sku: A-1}}
      response: [{sku: A-1, name: Anvil, price: 12.5}]
    - match: {collection: products, filter: {sku: none}}
      response: []
    - match: {filter: {sku: down}}
      error: {kind: upstream, message: catalog unreachable}
    - match: {filter: {sku: tripped}}
      error: {kind: circuit_open, message: "circuit open for catalog"}
    - match: {filter: {sku: slow}}
      error: {kind: timeout, message: catalog too slow}
cases:
  - name: documents matched on database, collection and filter
    request: {data: {sku: A-1}}
    expect:
      status: 200
      data: {product: {name: Anvil, price: 12.5}, matches: 1}
  - name: no documents
    request: {data: {sku: none}}
    expect: {status: completed, data: {matches: 0}}
  - name: an upstream error is a 502
    request: {data: {sku: down}}
    expect:
      status: 502
      errors: [{code: UPSTREAM_ERROR, task_id: find, message: "mongo_read: catalog unreachable"}]
  - name: an open circuit is a 503
    request: {data: {sku: tripped}}
    expect:
      status: 503
      errors: [{code: SERVICE_UNAVAILABLE, task_id: find}]
  - name: a timeout is a 504
    request: {data: {sku: slow}}
    expect: {status: 504, errors: [{code: TIMEOUT, task_id: find}]}
  - name: a stub for another collection does not answer
    request: {data: {sku: A-1}}
    connectors:
      catalog:
        - match: {collection: orders}
          response: [{sku: A-1}]
    expect: {status: 200}
  - name: an open circuit is not a 502
    request: {data: {sku: tripped}}
    expect: {status: 502}
"#;
    let file = dir.join("product.test.yaml");
    std::fs::write(&file, yaml).unwrap();
    let out = sluice().arg("test").arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.last(), Some(&"5 passed, 2 failed"), "{stdout}");
    for name in [
        "documents matched on database, collection and filter",
        "no documents",
        "an upstream error is a 502",
        "an open circuit is a 503",
        "a timeout is a 504",
    ] {
        assert!(
            lines.contains(&format!("ok   {} :: {name}", file.display()).as_str()),
            "{name}: {stdout}"
        );
    }
    // The failure names the call as the stub saw it (quoted in the errors),
    // prefixed once with the function, like every connector error.
    let call =
        r#"{\"database\":\"shop\",\"collection\":\"products\",\"filter\":{\"sku\":\"A-1\"}}"#;
    assert!(
        stdout.contains(&format!(
            "\"message\":\"mongo_read: no stub answer of connector 'catalog' matches {call}\""
        )),
        "{stdout}"
    );
    assert!(stdout.contains("-  \"status\": 502"), "{stdout}");
    assert!(stdout.contains("+  \"status\": 503"), "{stdout}");
}

// ---------------------------------------------------------------- sluice apply

/// What the server warns of is shown by `apply` too, under the resource
/// (audit 110: a channel naming a workflow that does not exist, and a
/// misspelt key, were applied as a clean success); a file whose `$schema`
/// names another kind than its folder is refused (it was applied as the
/// folder's kind while `lint` checked it as the other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_shows_warnings_and_refuses_a_file_of_another_kind() {
    let s = start(Db::Sqlite).await;
    let dir = temp_dir();
    write_def(
        &dir,
        "channels/ch.json",
        &json!({"channel_id": "ch", "name": "ch", "protocol": "http",
                "workflow_id": "nosuchwf", "validaton_logic": true}),
    );
    for extra in [&["--dry-run"][..], &[]] {
        let out = apply(&s, &dir, extra);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("warning: channel ch: validaton_logic: unknown field"),
            "{extra:?}: {stderr}"
        );
        assert!(
            stderr.contains("warning: channel ch: workflow_id: no workflow 'nosuchwf'"),
            "{extra:?}: {stderr}"
        );
    }
    std::fs::remove_file(dir.join("channels/ch.json")).unwrap();
    write_def(&dir, "channels/wf.json", &greeting_workflow("hello"));
    let out = apply(&s, &dir, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("$schema names a workflow definition, but the file is under channels/"),
        "{}",
        text(&out)
    );
    // A dry run does not warn of what the plan itself creates (audit 112:
    // the connector and workflow made first by the real apply were
    // "missing" in the dry run's import).
    let dir = temp_dir();
    write_def(
        &dir,
        "connectors/kv.json",
        &json!({"name": "kv", "connector_type": "cache", "config": {"backend": "memory"}}),
    );
    write_def(
        &dir,
        "workflows/put.json",
        &json!({"workflow_id": "put", "name": "put", "tasks": [{"id": "w", "name": "w",
            "function": {"name": "cache_write", "input": {"connector": "kv", "key": "k", "value": 1}}}]}),
    );
    write_def(
        &dir,
        "channels/put.json",
        &json!({"channel_id": "put", "name": "put", "protocol": "http", "workflow_id": "put"}),
    );
    for extra in [&["--dry-run"][..], &[]] {
        let out = apply(&s, &dir, extra);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("warning"), "{extra:?}: {stderr}");
    }
}

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

/// One line of `sluice apply`'s output.
fn row(kind: &str, id: &str, action: &str) -> String {
    format!("{kind:<10} {id:<32} {action}")
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
    assert_eq!(
        stdout_of(&out).lines().collect::<Vec<_>>(),
        [
            row("connector", "mem", "create"),
            row("workflow", "greet", "create (v1 active)"),
            row("channel", "greet", "create (v1 active)"),
            "applied: 3 create".into(),
        ],
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

fn greeting_yaml(greeting: &str) -> String {
    format!(
        r#"# yaml-language-server: $schema=../schemas/workflow.json
workflow_id: greet
name: Greet
tasks:
  - id: say
    name: Say
    function:
      name: map
      input:
        mappings:
          - path: greeting
            logic: {{cat: [{greeting}, " ", {{var: payload.name}}]}}
"#
    )
}

/// YAML definition files end to end; a draft made by hand is reused (no
/// extra version); versions archived behind apply's back are reactivated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_reads_yaml_reuses_a_draft_and_reactivates_archived_versions() {
    let s = start(Db::Sqlite).await;
    let dir = temp_dir();
    let write = |rel: &str, text: &str| {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("workflows/greet.yaml", &greeting_yaml("hello"));
    write(
        "channels/greet.yml",
        "name: greet\nworkflow_id: greet\nroute_pattern: /greet\nmethods: [POST]\n",
    );
    write(
        "connectors/mem.yaml",
        "name: mem\nconnector_type: cache\nconfig: {backend: memory, max_entries: 10}\n",
    );
    // A test file beside the definitions is not a definition.
    write(
        "workflows/greet.test.yaml",
        "workflow: greet.yaml\ncases: []\n",
    );
    let out = apply(&s, &dir, &[]);
    assert_eq!(
        stdout_of(&out).lines().collect::<Vec<_>>(),
        [
            row("connector", "mem", "create"),
            row("workflow", "greet", "create (v1 active)"),
            row("channel", "greet", "create (v1 active)"),
            "applied: 3 create".into(),
        ],
        "{}",
        text(&out)
    );
    let r = s
        .post("/api/v1/data/greet", json!({"data": {"name": "Ada"}}))
        .await;
    assert_eq!(r.ok(200)["greeting"], "hello Ada", "{}", r.text);
    let out = apply(&s, &dir, &[]);
    assert_eq!(
        stdout_of(&out).lines().last(),
        Some("applied: 3 unchanged"),
        "{}",
        text(&out)
    );

    // A draft made through the API is reused for the new version.
    let draft = s.admin("POST", "/workflows/greet/versions", None).await;
    assert_eq!(draft.ok(201)["version"], 2, "{}", draft.text);
    assert_eq!(
        versions(&s, "workflows", "greet").await,
        vec![(1, "active".into(), 100), (2, "draft".into(), 100)]
    );
    write("workflows/greet.yaml", &greeting_yaml("hi"));
    let out = apply(&s, &dir, &[]);
    assert_eq!(
        stdout_of(&out).lines().collect::<Vec<_>>(),
        [
            row("connector", "mem", "unchanged"),
            row("workflow", "greet", "new version (v2 active)"),
            row("channel", "greet", "unchanged"),
            "applied: 2 unchanged, 1 new version".into(),
        ],
        "{}",
        text(&out)
    );
    assert_eq!(
        versions(&s, "workflows", "greet").await,
        vec![(1, "archived".into(), 100), (2, "active".into(), 100)]
    );
    let r = s
        .post("/api/v1/data/greet", json!({"data": {"name": "Ada"}}))
        .await;
    assert_eq!(r.ok(200)["greeting"], "hi Ada", "{}", r.text);

    // Archived behind apply's back: the newest versions equal the files, so
    // they are brought back as they are (no new version).
    for kind in ["channels", "workflows"] {
        s.admin(
            "PATCH",
            &format!("/{kind}/greet/status"),
            Some(json!({"status": "archived"})),
        )
        .await
        .ok(200);
    }
    s.post("/api/v1/data/greet", json!({"data": {"name": "Ada"}}))
        .await
        .error(404, "NOT_FOUND");
    let out = apply(&s, &dir, &["--dry-run"]);
    assert_eq!(
        stdout_of(&out).lines().collect::<Vec<_>>(),
        [
            row("connector", "mem", "unchanged"),
            row("workflow", "greet", "reactivate v2"),
            row("channel", "greet", "reactivate v1"),
            "plan: 1 unchanged, 2 reactivate (dry run: nothing was changed)".into(),
        ],
        "{}",
        text(&out)
    );
    let out = apply(&s, &dir, &[]);
    assert_eq!(
        stdout_of(&out).lines().collect::<Vec<_>>(),
        [
            row("connector", "mem", "unchanged"),
            row("workflow", "greet", "reactivate v2 (v2 active)"),
            row("channel", "greet", "reactivate v1 (v1 active)"),
            "applied: 1 unchanged, 2 reactivate".into(),
        ],
        "{}",
        text(&out)
    );
    assert_eq!(
        versions(&s, "workflows", "greet").await,
        vec![(1, "archived".into(), 100), (2, "active".into(), 100)]
    );
    assert_eq!(
        versions(&s, "channels", "greet").await,
        vec![(1, "active".into(), 0)]
    );
    let r = s
        .post("/api/v1/data/greet", json!({"data": {"name": "Ada"}}))
        .await;
    assert_eq!(r.ok(200)["greeting"], "hi Ada", "{}", r.text);
    let out = apply(&s, &dir, &[]);
    assert_eq!(
        stdout_of(&out).lines().last(),
        Some("applied: 3 unchanged"),
        "{}",
        text(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_checks_every_file_before_sending_and_uses_the_api_key() {
    let s = start_with(Db::Sqlite, |c| {
        c.admin_auth.enabled = true;
        c.admin_auth.api_key = "apply-secret-key".into();
        c.admin_auth.read_only_api_key = "apply-read-key".into();
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

    // A directory that is not there is named as missing (audit 71: "not a
    // directory").
    let out = apply(&s, &dir.join("missing"), &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("missing: No such file or directory"),
        "{}",
        text(&out)
    );
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
    // The published schemas stay public with admin auth on, like the OpenAPI
    // document (editors fetch them without credentials; they hold no data).
    for kind in DefinitionKind::ALL {
        let r = s
            .get(&format!("/api/v1/schemas/{}.json", kind.name()))
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.body, definition_schema(kind));
    }
    s.admin("GET", "/functions", None)
        .await
        .error(401, "UNAUTHORIZED");
    // A read-only key can plan (GETs only) but not apply.
    let out = apply(&s, &dir, &["--api-key", "apply-read-key", "--dry-run"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        stdout_of(&out).lines().last(),
        Some("plan: 1 create (dry run: nothing was changed)"),
        "{}",
        text(&out)
    );
    let out = apply(&s, &dir, &["--api-key", "apply-read-key"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("403 FORBIDDEN"),
        "{}",
        text(&out)
    );
    // --api-key: the apply goes through.
    let out = apply(&s, &dir, &["--api-key", "apply-secret-key"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        stdout_of(&out).lines().collect::<Vec<_>>(),
        [
            row("workflow", "greet", "create (v1 active)"),
            "applied: 1 create".into()
        ],
        "{}",
        text(&out)
    );
    let r = s
        .send(
            "GET",
            "/api/v1/admin/workflows/greet",
            None,
            &[("authorization", "Bearer apply-secret-key")],
        )
        .await;
    assert_eq!(r.body["data"]["status"], "active", "{}", r.text);
    assert_eq!(r.body["data"]["version"], 1, "{}", r.text);
    // The $schema key of the file is not stored.
    assert!(r.body["data"].get("$schema").is_none(), "{}", r.text);
    // SLUICE_API_KEY works as well (and a second apply changes nothing).
    let out = sluice()
        .args(["apply", "--server", &s.base])
        .arg(&dir)
        .env("SLUICE_API_KEY", "apply-secret-key")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        stdout_of(&out).lines().last(),
        Some("applied: 1 unchanged"),
        "{}",
        text(&out)
    );
}

/// What only the server can tell (a channel name another channel holds, a
/// masked secret in a new connector) stops apply before it changes
/// anything; a workflow spelling out `rollout` or `channel: "default"` is
/// unchanged on the next run; a closed stdout does not stop it halfway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_asks_the_server_first_settles_and_survives_a_closed_pipe() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        greeter_def("held"),
        json!({"channel_id": "holder", "name": "orders", "workflow_id": "held"}),
    )
    .await;
    let dir = temp_dir();
    write_def(
        &dir,
        "connectors/aaa.json",
        &json!({"name": "aaa", "connector_type": "http",
        "config": {"url": "https://a.example.com"}}),
    );
    write_def(
        &dir,
        "connectors/zzz.json",
        &json!({"name": "zzz", "connector_type": "http",
        "config": {"url": "https://z.example.com", "auth": {"type": "bearer", "token": "******"}}}),
    );
    write_def(&dir, "workflows/greet.json", &greeting_workflow("hello"));
    write_def(
        &dir,
        "channels/other.json",
        &json!({"channel_id": "other", "name": "orders", "workflow_id": "greet"}),
    );
    for extra in [&["--dry-run"][..], &[]] {
        let out = apply(&s, &dir, extra);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("connector zzz: config.auth.token:")
                && stderr.contains("channel other: name: a channel named 'orders' already exists")
                && stderr.contains("nothing was applied"),
            "{stderr}"
        );
    }
    s.admin("GET", "/connectors/aaa", None)
        .await
        .error(404, "NOT_FOUND");
    s.admin("GET", "/workflows/greet", None)
        .await
        .error(404, "NOT_FOUND");

    // Spelled-out defaults settle: the second run changes nothing.
    let dir = temp_dir();
    let mut w = greeting_workflow("hi");
    w["rollout"] = json!({"bucket_start": 0, "bucket_end": 100});
    w["channel"] = json!("default");
    write_def(&dir, "workflows/greet.json", &w);
    let out = apply(&s, &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let out = apply(&s, &dir, &[]);
    assert_eq!(
        stdout_of(&out).lines().last(),
        Some("applied: 1 unchanged"),
        "{}",
        text(&out)
    );

    // stdout closed before the first line: every step still runs, and the
    // exit status says the output was cut.
    let dir = temp_dir();
    for i in 1..=5 {
        write_def(
            &dir,
            &format!("workflows/p{i}.json"),
            &greeter_def(&format!("pipe{i}")),
        );
    }
    let mut child = sluice()
        .args(["apply", "--server", &s.base])
        .arg(&dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    for i in 1..=5 {
        let r = s.admin("GET", &format!("/workflows/pipe{i}"), None).await;
        assert_eq!(r.ok(200)["status"], "active", "pipe{i}: {}", r.text);
    }
}

fn greeter_def(id: &str) -> Json {
    json!({"workflow_id": id, "name": id, "tasks": [
        {"id": "say", "name": "Say", "function": {"name": "map", "input": {"mappings": [
            {"path": "greeting", "logic": "hi"}]}}}]})
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
        &[("postgres://postgres@127.0.0.1:5432/sql_orders", &url)],
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

/// A password in `--server` never reaches the output, even when the call
/// fails and the message names the URL.
#[test]
fn apply_never_prints_the_servers_password() {
    let dir = std::env::temp_dir().join(format!("sluice-apply-{}", uuid::Uuid::new_v4()));
    write_def(
        &dir,
        "workflows/w.json",
        &json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "a", "name": "a", "function": {"name": "log", "input": {"message": "hi"}}}]}),
    );
    let port = crate::support::free_port();
    let out = sluice()
        .args([
            "apply",
            "--server",
            &format!("http://user:PASSWD123@127.0.0.1:{port}"),
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(all.contains("127.0.0.1"), "{all}");
    assert!(!all.contains("PASSWD123"), "{all}");
    // A server that is not Sluice answers 404 for everything: that is not
    // "absent", and nothing is planned.
    let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let other_addr = other.local_addr().unwrap();
    std::thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        for conn in other.incoming() {
            let Ok(mut conn) = conn else { break };
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(
                b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\nconnection: close\r\n\r\nnot found",
            );
        }
    });
    let out = sluice()
        .args([
            "apply",
            "--dry-run",
            "--server",
            &format!("http://{other_addr}"),
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("answered 404 without Sluice's error envelope"),
        "{stderr}"
    );
    // Not a base URL: a usage error naming the option.
    for bad in ["notaurl", "http://127.0.0.1:8080/api/v1", "ftp://x"] {
        let out = sluice()
            .args(["apply", "--server", bad])
            .arg(&dir)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with("error: --server must be the service's base URL"),
            "{stderr}"
        );
    }
}
