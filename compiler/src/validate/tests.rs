//! Tests of the definition validators and of secret masking.

use super::*;
use crate::def::{ChannelDef, ConnectorDef, WorkflowDef};
use serde_json::json;

fn d(field: &str, message: &str) -> Diagnostic {
    Diagnostic::new(field, message)
}

/// Asserts the exact diagnostics, in order.
#[track_caller]
fn check(found: Vec<Diagnostic>, expected: &[(&str, &str)]) {
    let expected: Vec<Diagnostic> = expected.iter().map(|(f, m)| d(f, m)).collect();
    assert_eq!(
        found, expected,
        "\nfound:    {found:#?}\nexpected: {expected:#?}"
    );
}

fn task(id: &str, function: &str, input: Json) -> Json {
    json!({"id": id, "name": id, "function": {"name": function, "input": input}})
}

fn workflow(tasks: Json) -> Json {
    json!({"name": "w", "tasks": tasks})
}

/// The rules added in session 20 apply to new definitions only: a stored
/// one with a plain task's `loop` or a blank task or group name still
/// compiles (an upgrade must not stop serving it).
#[test]
fn newer_rules_spare_stored_definitions() {
    let def = workflow(json!([
        {"id": "a", "name": "", "loop": {"max": 2}, "function": {"name": "log", "input": {"message": "m"}}},
        {"id": "g", "name": " ", "tasks": [{"id": "b", "name": "b", "function": {"name": "log", "input": {"message": "m"}}}]}
    ]));
    check(validate_workflow(&def), &[]);
    assert!(crate::plan::compile_workflow(&def).is_ok());
    check(
        crate::validate::validate_new_workflow(&def),
        &[
            ("tasks[0].name", "must not be empty"),
            (
                "tasks[0].loop",
                "loop is allowed on the workflow and on groups, not on a task (put the task in a group: {\"id\": \"…\", \"loop\": {…}, \"tasks\": [the task]})",
            ),
            ("tasks[1].name", "must not be blank (only whitespace)"),
        ],
    );
    assert!(crate::plan::compile_new_workflow(&def).is_err());
}

/// Problems come in document order: root fields (a JSONLogic `condition`
/// included), then steps depth-first, each step's in the order found.
#[test]
fn problems_come_in_document_order() {
    let def = json!({"name": "w", "condition": {"nosuchop": [1]}, "tasks": [
        {"id": "a", "name": "a", "function": {"name": "nosuchfn"}},
        {"id": "g", "tasks": [
            {"id": "b", "name": "b", "condition": {"nope": 1}, "function": {"name": "log", "input": {"message": "m"}}}
        ]},
        {"id": "c", "name": "c", "condition": {"alsonope": 1}, "function": {"name": "log", "input": {"message": "m"}}}
    ]});
    let fields: Vec<String> = crate::plan::compile_workflow(&def)
        .err()
        .unwrap()
        .into_iter()
        .map(|d| d.field)
        .collect();
    assert_eq!(
        fields,
        [
            "condition",
            "tasks[0].function.name",
            "tasks[1].tasks[0].condition",
            "tasks[2].condition"
        ]
    );
}

fn workflow_with(task: Json) -> Vec<Diagnostic> {
    validate_workflow(&workflow(json!([task])))
}

fn shared(file: &str) -> Option<Json> {
    let path = format!(
        "{}/../../shared/bench/reference/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    // The shared directory always sits beside the repository (CI included):
    // a missing file is a failure, not a skip.
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    Some(serde_json::from_str(&text).unwrap())
}

// ---------------------------------------------------------------- workflows

#[test]
fn reference_workflow_and_channel_validate_clean() {
    if let Some(w) = shared("workflow.json") {
        check(validate_workflow(&w), &[]);
        let def: WorkflowDef = serde_json::from_value(w).unwrap();
        assert_eq!(def.id(), Some("bench-order-enrichment"));
    }
    if let Some(c) = shared("channel.json") {
        check(validate_channel(&c), &[]);
        serde_json::from_value::<ChannelDef>(c).unwrap();
    }
}

/// Builds a group chain `levels` deep around one task.
fn nested(levels: usize) -> Json {
    let mut step = task("leaf", "log", json!({"message": "x"}));
    for level in (1..=levels).rev() {
        step = json!({"id": format!("n{level}"), "tasks": [step]});
    }
    step
}

#[test]
fn reports_every_problem_with_exact_paths() {
    let def = json!({
        "workflow_id": "-bad id",
        "priority": "high",
        "tasks": [
            task("a", "http_call", json!({"method": "GET"})),
            task("b", "Foo", json!({})),
            task("c", "http_call", json!({"connector": "api", "method": "FETCH", "timeout_ms": "5"})),
            {"id": "g", "halt_on": "failure", "tasks": [
                {"id": "g2", "tasks": [task("a", "map", json!({}))]}
            ]},
            nested(9),
            {"id": "t", "function": {"name": "cache_write", "input": {"connector": "", "key": 5}}}
        ]
    });
    let deep = format!("tasks[4]{}", ".tasks[0]".repeat(8));
    check(
        validate_workflow(&def),
        &[
            ("workflow_id", ID_RULE),
            ("name", "is required"),
            ("priority", "expected integer, got string"),
            ("tasks[0].function.input.connector", "is required"),
            ("tasks[1].function.name", "unknown function 'Foo'"),
            (
                "tasks[2].function.input.method",
                "must be one of GET, POST, PUT, PATCH, DELETE, got 'FETCH'",
            ),
            (
                "tasks[2].function.input.timeout_ms",
                "expected number, got string",
            ),
            ("tasks[3].halt_on", "halt_on is not allowed on a group"),
            (
                "tasks[3].tasks[0].tasks[0].id",
                "duplicate step id 'a' (first used at tasks[0])",
            ),
            (&deep, "groups nest deeper than 8 levels"),
            ("tasks[5].name", "is required"),
            ("tasks[5].function.input.connector", "must not be empty"),
            (
                "tasks[5].function.input.key",
                "expected string, got integer",
            ),
            ("tasks[5].function.input.value", "is required"),
        ],
    );
}

#[test]
fn depth_eight_is_allowed_and_nine_is_reported_once() {
    check(validate_workflow(&workflow(json!([nested(8)]))), &[]);
    let found = validate_workflow(&workflow(json!([nested(12)])));
    assert_eq!(found.len(), 1, "{found:#?}");
    assert_eq!(found[0].message, "groups nest deeper than 8 levels");
}

#[test]
fn root_must_be_an_object() {
    check(
        validate_workflow(&json!([1])),
        &[("", "expected object, got array")],
    );
    check(
        validate_channel(&json!("x")),
        &[("", "expected object, got string")],
    );
    check(
        validate_connector(&json!(null)),
        &[("", "expected object, got null")],
    );
}

#[test]
fn workflow_top_level_fields() {
    let long = "x".repeat(129);
    let def = json!({
        "workflow_id": long,
        "id": "other",
        "name": "  ",
        "description": "d".repeat(2049),
        "tags": ["a", 1],
        "continue_on_error": "yes",
        "status": "running",
        "version": 0,
        "rollout_percentage": 0,
        "rollout": {"bucket_start": -1, "bucket_end": 101},
        "created_at": 5,
        "tasks": []
    });
    check(
        validate_workflow(&def),
        &[
            ("workflow_id", "must be at most 128 characters"),
            ("name", "must not be blank (only whitespace)"),
            ("description", "must be at most 2048 characters"),
            ("tags[1]", "expected string, got integer"),
            ("continue_on_error", "expected boolean, got string"),
            (
                "status",
                "must be one of draft, active, archived, paused, got 'running'",
            ),
            ("version", "must be at least 1"),
            ("rollout_percentage", "must be between 1 and 100"),
            ("rollout.bucket_start", "must be between 0 and 100"),
            ("rollout.bucket_end", "must be between 0 and 100"),
            ("created_at", "expected string, got integer"),
            ("tasks", "must not be empty"),
        ],
    );
    let name = "n".repeat(256);
    check(
        validate_workflow(&json!({"name": name, "tasks": {}})),
        &[
            ("name", "must be at most 255 characters"),
            ("tasks", "expected array, got object"),
        ],
    );
    check(
        validate_workflow(&json!({"name": "w"})),
        &[("tasks", "is required")],
    );
}

#[test]
fn identifiers_that_name_an_endpoint_are_reserved() {
    for id in ["export", "import", "validate"] {
        let mut w = workflow(json!([task("t", "log", json!({}))]));
        w["workflow_id"] = json!(id);
        let message =
            format!("'{id}' is reserved: /api/v1/admin/workflows/{id} is an endpoint of its own");
        check(validate_workflow(&w), &[("workflow_id", &message)]);
        let mut w = workflow(json!([task("t", "log", json!({}))]));
        w["id"] = json!(id);
        check(validate_workflow(&w), &[("id", &message)]);
    }
    // Only the exact words: paths are case-sensitive, and a longer id is free.
    for id in ["Export", "exports", "import-1"] {
        let mut w = workflow(json!([task("t", "log", json!({}))]));
        w["workflow_id"] = json!(id);
        check(validate_workflow(&w), &[]);
    }
    let channel = |extra: Json| {
        let mut c = json!({"name": "orders", "workflow_id": "w"});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        validate_channel(&c)
    };
    check(
        channel(json!({"channel_id": "import"})),
        &[(
            "channel_id",
            "'import' is reserved: /api/v1/admin/channels/import is an endpoint of its own",
        )],
    );
    check(
        channel(json!({"name": "traces"})),
        &[(
            "name",
            "'traces' is reserved: /api/v1/data/traces is an endpoint of its own",
        )],
    );
    let shadowed =
        "must not be /traces or /traces/{…}: /api/v1/data/traces/{trace_id} reads async traces";
    for pattern in ["/traces", "/traces/{id}", "/traces/x"] {
        check(
            channel(json!({"route_pattern": pattern, "methods": ["GET"]})),
            &[("route_pattern", shadowed)],
        );
    }
    check(
        channel(json!({"route_pattern": "/traces/{a}/{b}", "methods": ["GET"]})),
        &[],
    );
    for (pattern, seg) in [("/../z", ".."), ("/a/./b", "."), ("/a/..", "..")] {
        check(
            channel(json!({"route_pattern": pattern, "methods": ["GET"]})),
            &[(
                "route_pattern",
                &format!("segment '{seg}' cannot be requested: clients resolve '.' and '..'"),
            )],
        );
    }
    check(
        channel(json!({"route_pattern": "/a/.well-known/..x", "methods": ["GET"]})),
        &[],
    );
    for name in ["circuit-breakers", "import", "reload"] {
        let c = json!({"name": name, "connector_type": "http",
                       "config": {"type": "http", "url": "https://example.com"}});
        let message = format!(
            "'{name}' is reserved: /api/v1/admin/connectors/{name} is an endpoint of its own"
        );
        check(validate_connector(&c), &[("name", &message)]);
    }
}

#[test]
fn workflow_id_rules() {
    let ok = ["a", "A1", "9", "a.b-c_d", &"x".repeat(128)];
    for id in ok {
        let mut w = workflow(json!([task("t", "log", json!({}))]));
        w["workflow_id"] = json!(id);
        check(validate_workflow(&w), &[]);
    }
    for id in ["_a", ".a", "a b", "ä", "a/b"] {
        let mut w = workflow(json!([task("t", "log", json!({}))]));
        w["workflow_id"] = json!(id);
        check(validate_workflow(&w), &[("workflow_id", ID_RULE)]);
    }
    let mut w = workflow(json!([task("t", "log", json!({}))]));
    w["workflow_id"] = json!("");
    check(
        validate_workflow(&w),
        &[("workflow_id", "must not be empty")],
    );
    // The engine spelling `id` is accepted, and may repeat workflow_id.
    let mut w = workflow(json!([task("t", "log", json!({}))]));
    w["id"] = json!("wf");
    check(validate_workflow(&w), &[]);
    w["workflow_id"] = json!("wf");
    check(validate_workflow(&w), &[]);
    w["workflow_id"] = json!("wf2");
    check(
        validate_workflow(&w),
        &[("id", "must equal workflow_id when both are given")],
    );
}

#[test]
fn step_structure() {
    let def = workflow(json!([
        "not a step",
        {"name": "no id", "function": {"name": "log"}},
        {"id": "", "name": "x", "function": {"name": "log"}},
        {"id": 5, "name": 6, "function": "log"},
        {"id": "f", "name": "f"},
        {"id": "g", "name": "f", "function": {"input": []}},
        {"id": "h", "name": "h", "function": {"name": "log", "input": []}},
        {"id": "i", "name": "i", "halt_on": "always", "terminal": 1, "continue_on_error": null,
         "function": {"name": "log"}},
        {"id": "grp", "tasks": [], "function": {"name": "log"}, "terminal": "no", "name": 3},
        {"id": "grp2", "tasks": null}
    ]));
    check(
        validate_workflow(&def),
        &[
            ("tasks[0]", "expected object, got string"),
            ("tasks[1].id", "is required"),
            ("tasks[2].id", "must not be empty"),
            ("tasks[3].id", "expected string, got integer"),
            ("tasks[3].name", "expected string, got integer"),
            ("tasks[3].function", "expected object, got string"),
            ("tasks[4].function", "is required"),
            ("tasks[5].function.name", "is required"),
            ("tasks[5].function.input", "expected object, got array"),
            ("tasks[6].function.input", "expected object, got array"),
            ("tasks[7].continue_on_error", "expected boolean, got null"),
            ("tasks[7].terminal", "expected boolean, got integer"),
            (
                "tasks[7].halt_on",
                "must be one of never, failure, got 'always'",
            ),
            ("tasks[8].name", "expected string, got integer"),
            ("tasks[8].terminal", "expected boolean, got string"),
            (
                "tasks[8].function",
                "function is not allowed on a group (a step with tasks is a group)",
            ),
            ("tasks[8].tasks", "must not be empty"),
            ("tasks[9].tasks", "expected array, got null"),
        ],
    );
}

#[test]
fn duplicate_ids_across_tasks_and_groups() {
    let def = workflow(json!([
        {"id": "g", "tasks": [task("x", "log", json!({})), {"id": "g", "tasks": [task("y", "log", json!({}))]}]},
        task("y", "log", json!({})),
        task("x", "log", json!({}))
    ]));
    check(
        validate_workflow(&def),
        &[
            (
                "tasks[0].tasks[1].id",
                "duplicate step id 'g' (first used at tasks[0])",
            ),
            (
                "tasks[1].id",
                "duplicate step id 'y' (first used at tasks[0].tasks[1].tasks[0])",
            ),
            (
                "tasks[2].id",
                "duplicate step id 'x' (first used at tasks[0].tasks[0])",
            ),
        ],
    );
}

#[test]
fn function_names_are_exact() {
    check(
        workflow_with(task("t", "validate", json!({"rules": []}))),
        &[],
    );
    check(
        workflow_with(task("t", "Map", json!({}))),
        &[("tasks[0].function.name", "unknown function 'Map'")],
    );
    check(
        workflow_with(task("t", "", json!({}))),
        &[("tasks[0].function.name", "unknown function ''")],
    );
}

#[test]
fn data_function_inputs_are_not_checked() {
    // Bad input of data functions shows at execution, as the spec says.
    check(
        workflow_with(task("t", "map", json!({"mappings": "nope"}))),
        &[],
    );
    check(
        workflow_with(json!({"id": "t", "name": "t", "function": {"name": "parse_json"}})),
        &[],
    );
}

#[test]
fn engine_extras_are_accepted() {
    let def = json!({
        "id": "wf", "name": "w", "channel": "orders", "status": "paused",
        "rollout": {"bucket_start": 50, "bucket_end": 10},
        "loop": {"max": 3},
        "tasks": [
            {"id": "t", "name": "t", "terminal": true, "halt_on": "failure", "continue_on_error": true,
             "description": "d", "condition": {"==": [1, 1]}, "function": {"name": "log", "input": {"message": "m"}}},
            {"id": "g", "condition": false, "terminal": false, "continue_on_error": true,
             "loop": {"max": 10000, "init": -1.5, "increment": 0.5, "counter": "temp_data.i"},
             "tasks": [task("u", "log", json!({}))]}
        ]
    });
    check(validate_workflow(&def), &[]);
    serde_json::from_value::<WorkflowDef>(def).unwrap();
}

#[test]
fn loop_settings() {
    let with_loop = |l: Json| {
        validate_workflow(&json!({"name": "w", "loop": l, "tasks": [task("t", "log", json!({}))]}))
    };
    check(with_loop(json!({})), &[("loop.max", "is required")]);
    check(
        with_loop(json!([])),
        &[("loop", "expected object, got array")],
    );
    check(
        with_loop(json!({"max": 0})),
        &[("loop.max", "must be between 1 and 10000")],
    );
    check(
        with_loop(json!({"max": 10001})),
        &[("loop.max", "must be between 1 and 10000")],
    );
    check(
        with_loop(json!({"max": 2.5})),
        &[("loop.max", "expected integer, got number")],
    );
    check(
        with_loop(json!({"max": 1, "init": "0", "increment": 0, "counter": "a..b"})),
        &[
            ("loop.init", "expected number, got string"),
            ("loop.increment", "must not be zero"),
            (
                "loop.counter",
                "must be a dotted path without empty segments",
            ),
        ],
    );
    check(
        with_loop(json!({"max": 1, "increment": "1", "counter": "payload.i"})),
        &[
            ("loop.increment", "expected number, got string"),
            (
                "loop.counter",
                "must not write into payload, which is read-only",
            ),
        ],
    );
    check(
        with_loop(json!({"max": 1, "counter": ""})),
        &[("loop.counter", "must not be empty")],
    );
    // On a group the path is the group's.
    let def =
        workflow(json!([{"id": "g", "loop": {"max": -1}, "tasks": [task("t", "log", json!({}))]}]));
    check(
        validate_workflow(&def),
        &[("tasks[0].loop.max", "must be between 1 and 10000")],
    );
}

#[test]
fn http_call_input() {
    check(
        workflow_with(task("t", "http_call", json!({"connector": "api"}))),
        &[],
    );
    let full = json!({
        "connector": "api", "method": "POST", "path": "/x", "path_logic": {"cat": ["/", 1]},
        "headers": {"x-a": "1"}, "body": null, "body_logic": {"var": "data"},
        "response_path": "data.r", "timeout_ms": 1.5
    });
    check(workflow_with(task("t", "http_call", full)), &[]);
    let bad = json!({
        "connector": 1, "method": "get", "path": 3, "headers": {"x-a": 1, "x-b": "ok"},
        "response_path": [], "timeout_ms": 0
    });
    check(
        workflow_with(task("t", "http_call", bad)),
        &[
            (
                "tasks[0].function.input.connector",
                "expected string, got integer",
            ),
            (
                "tasks[0].function.input.method",
                "must be one of GET, POST, PUT, PATCH, DELETE, got 'get'",
            ),
            (
                "tasks[0].function.input.path",
                "expected string, got integer",
            ),
            (
                "tasks[0].function.input.headers.x-a",
                "expected string, got integer",
            ),
            (
                "tasks[0].function.input.response_path",
                "expected string, got array",
            ),
            (
                "tasks[0].function.input.timeout_ms",
                "must be greater than 0",
            ),
        ],
    );
    check(
        workflow_with(task(
            "t",
            "http_call",
            json!({"connector": "a", "headers": []}),
        )),
        &[(
            "tasks[0].function.input.headers",
            "expected object, got array",
        )],
    );
    // Where the answer is written has no empty segment (it wrote under "").
    check(
        workflow_with(task(
            "t",
            "http_call",
            json!({"connector": "a", "response_path": "a..b"}),
        )),
        &[(
            "tasks[0].function.input.response_path",
            "'a..b' has an empty segment (write '#' for an empty key)",
        )],
    );
    check(
        workflow_with(task(
            "t",
            "cache_read",
            json!({"connector": "a", "key": "k", "output": "x."}),
        )),
        &[(
            "tasks[0].function.input.output",
            "'x.' has an empty segment (write '#' for an empty key)",
        )],
    );
    // Static headers are checked as a connector's are (session 19: they
    // failed at run time).
    check(
        workflow_with(task(
            "t",
            "http_call",
            json!({"connector": "a", "headers": {"a b": "v", "x": "line\nbreak", "ok": "fine"}}),
        )),
        &[
            (
                "tasks[0].function.input.headers[\"a b\"]",
                "is not a valid HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)",
            ),
            (
                "tasks[0].function.input.headers.x",
                "is not a valid HTTP header value (visible ASCII, spaces and tabs only)",
            ),
        ],
    );
    // Framing headers are the client's own (audit 101: a `Content-Length`
    // cut the body); refused in new definitions, stored ones still load.
    let framing = workflow(json!([task(
        "t",
        "http_call",
        json!({"connector": "a", "headers": {"content-length": "3", "Host": "h", "x": "ok"}}),
    )]));
    let message = "is written by the HTTP client from the request itself (body length, framing, host, connection); it cannot be set";
    check(
        crate::validate::validate_new_workflow(&framing),
        &[
            ("tasks[0].function.input.headers.content-length", message),
            ("tasks[0].function.input.headers.Host", message),
        ],
    );
    check(validate_workflow(&framing), &[]);
    // An absent input is `{}`, so the required connector is reported.
    check(
        workflow_with(json!({"id": "t", "name": "t", "function": {"name": "http_call"}})),
        &[("tasks[0].function.input.connector", "is required")],
    );
}

#[test]
fn other_connector_inputs() {
    let p = |f: &str| format!("tasks[0].function.input.{f}");
    check(
        workflow_with(task(
            "t",
            "db_read",
            json!({"connector": "db", "query": "SELECT 1", "params": [1], "output": "rows"}),
        )),
        &[],
    );
    check(
        workflow_with(task("t", "db_write", json!({"params": {}, "output": 1}))),
        &[
            (&p("connector"), "is required"),
            (&p("query"), "is required"),
            (&p("params"), "expected array, got object"),
            (&p("output"), "expected string, got integer"),
        ],
    );
    check(
        workflow_with(task(
            "t",
            "cache_read",
            json!({"connector": "c", "key": "k"}),
        )),
        &[],
    );
    check(
        workflow_with(task("t", "cache_read", json!({"connector": "c"}))),
        &[(&p("key"), "is required")],
    );
    check(
        workflow_with(task(
            "t",
            "cache_write",
            json!({"connector": "c", "key": "k", "value": null, "ttl_secs": 60}),
        )),
        &[],
    );
    check(
        workflow_with(task(
            "t",
            "cache_write",
            json!({"connector": "c", "key": "k", "value": 1, "ttl_secs": -1}),
        )),
        &[(&p("ttl_secs"), "must be greater than 0")],
    );
    check(
        workflow_with(task(
            "t",
            "mongo_read",
            json!({"connector": "m", "database": "d", "collection": "c", "filter": {"a": 1}}),
        )),
        &[],
    );
    check(
        workflow_with(task(
            "t",
            "mongo_read",
            json!({"connector": "m", "filter": "x"}),
        )),
        &[
            (&p("database"), "is required"),
            (&p("collection"), "is required"),
            (&p("filter"), "expected object, got string"),
        ],
    );
    check(
        workflow_with(task(
            "t",
            "publish_kafka",
            json!({"connector": "k", "topic": "t", "key_logic": 1}),
        )),
        &[],
    );
    check(
        workflow_with(task(
            "t",
            "publish_kafka",
            json!({"connector": "k", "topic": " "}),
        )),
        &[(&p("topic"), "must not be blank (only whitespace)")],
    );
    // A static topic no broker takes: refused in a new definition; a
    // stored one (checked before the rule) still loads.
    let bad_topic = workflow(json!([task(
        "t",
        "publish_kafka",
        json!({"connector": "k", "topic": "bad topic!"}),
    )]));
    check(
        crate::validate::validate_new_workflow(&bad_topic),
        &[(&p("topic"), crate::validate::KAFKA_TOPIC_RULE)],
    );
    check(validate_workflow(&bad_topic), &[]);

    // The statement fits the function: no write in db_read (unless it
    // returns rows), no read in db_write; comments, case and parentheses
    // do not hide the keyword. Stored definitions still load.
    let sql = |f: &str, q: &str| {
        workflow(json!([task(
            "t",
            f,
            json!({"connector": "db", "query": q}),
        )]))
    };
    for q in [
        "delete from t where id > 5",
        "  -- tidy up\n  DELETE FROM t",
        "/* x */ Update t set a = 1",
        "insert into t values (1)",
        // RETURNING that is no keyword: in a comment, a string, a name.
        "DELETE FROM t -- RETURNING",
        "DELETE FROM t /* returning */",
        "INSERT INTO t VALUES ('RETURNING')",
        "INSERT INTO t VALUES ('it\\'s RETURNING')",
        "UPDATE t SET a = 1 WHERE name = \"returning\"",
        "DELETE FROM t WHERE a = $$ RETURNING $$",
        "DELETE FROM t WHERE a = $x$ RETURNING $x$",
        // Comments of every dialect, nested or not, and a BOM.
        "# note\nDELETE FROM t",
        "/* a /* nested */ b */ DELETE FROM t",
        "/* a /* b */ DELETE FROM t",
        "\u{feff}DELETE FROM t",
        "/*!50000 DELETE FROM t */",
        "/*M!DELETE*/ FROM t WHERE id = 1",
        // Read differently by the dialects: refused unless every reading
        // sees a real RETURNING.
        "DELETE FROM t WHERE '\\' <> ' RETURNING '",
        "DELETE FROM t WHERE \"\\\" RETURNING \" <> ''",
        "DELETE FROM t WHERE a = $é$ RETURNING $é$",
        "DELETE FROM t WHERE id IN (SELECT 1 AS returning)",
        "DELETE FROM t WHERE id IN (SELECT 1 AS [returning])",
    ] {
        let def = sql("db_read", q);
        let found = crate::validate::validate_new_workflow(&def);
        assert_eq!(found.len(), 1, "{q}: {found:?}");
        assert_eq!(found[0].field, p("query"));
        assert!(
            found[0]
                .message
                .starts_with("db_read runs a query that returns rows"),
            "{found:?}"
        );
        check(validate_workflow(&def), &[]);
    }
    for q in [
        "select 1",
        "(SELECT 1) UNION (SELECT 2)",
        "with x as (select 1) select * from x",
        "insert into t values (1) returning id",
        "SHOW TABLES",
        "DELETE FROM t WHERE a = $1 RETURNING *",
        "/* c */ select 'DELETE'",
        "insert into t values ('it''s') returning id",
        "UPDATE t SET a = E'x\\'y' RETURNING a",
    ] {
        check(
            crate::validate::validate_new_workflow(&sql("db_read", q)),
            &[],
        );
    }
    for q in [
        "select count(*) from t",
        " ( select 1 )",
        "EXPLAIN delete from t",
        "values (1)",
        "# c\nSELECT 1",
        "\u{feff}SELECT 1",
        "DESC t",
        "/*M!SELECT*/ 1",
    ] {
        let found = crate::validate::validate_new_workflow(&sql("db_write", q));
        assert_eq!(found.len(), 1, "{q}: {found:?}");
        assert!(
            found[0]
                .message
                .starts_with("db_write runs INSERT, UPDATE or DELETE"),
            "{found:?}"
        );
    }
    for q in [
        "insert into t values (?)",
        "UPDATE t SET a = 1",
        "delete from t",
        "with x as (select 1) insert into t select * from x",
        "CREATE TABLE IF NOT EXISTS t (a int)",
    ] {
        check(
            crate::validate::validate_new_workflow(&sql("db_write", q)),
            &[],
        );
    }

    // One statement per task (SQLite ran them all: a read that dropped a
    // table); a `;` in a string, a comment or at the end is no second one.
    for (f, q) in [
        ("db_read", "SELECT 1; DROP TABLE victim"),
        ("db_read", "SELECT id FROM t WHERE id = ?;\nDELETE FROM t"),
        (
            "db_write",
            "UPDATE t SET a = 1 WHERE id = 2; DELETE FROM t WHERE id = 1",
        ),
        ("db_write", "delete from t;;insert into t values (1);"),
    ] {
        let found = crate::validate::validate_new_workflow(&sql(f, q));
        assert!(
            found.iter().any(|d| d.field == p("query")
                && d.message
                    .starts_with(&format!("{f} runs one statement; this query holds 2"))),
            "{q}: {found:?}"
        );
        // Stored definitions still load.
        check(validate_workflow(&sql(f, q)), &[]);
    }
    for (f, q) in [
        ("db_read", "SELECT 1;"),
        ("db_read", "SELECT ';' AS a; -- ; DELETE"),
        ("db_read", "SELECT 1 /* ; DELETE FROM t */"),
        ("db_read", "SELECT 'it\\'s; ok' AS a"),
        ("db_write", "UPDATE t SET a = $$;x$$ ;  "),
    ] {
        check(crate::validate::validate_new_workflow(&sql(f, q)), &[]);
    }

    // Any text is read without a panic (unclosed quotes and comments,
    // multi-byte characters next to every delimiter).
    let pieces = [
        "'",
        "\"",
        "`",
        "[",
        "]",
        "$",
        "$a$",
        "$é$",
        "\\",
        "/*",
        "*/",
        "/*!",
        "/*M!",
        "--",
        "#",
        "\n",
        "E'",
        "é",
        "DELETE",
        "RETURNING",
        "AS",
        " ",
        "(",
        "$1",
        "\u{feff}",
    ];
    let mut seed = 7u64;
    for _ in 0..2000 {
        let mut q = String::new();
        for _ in 0..8 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            q.push_str(pieces[(seed >> 33) as usize % pieces.len()]);
        }
        for f in ["db_read", "db_write"] {
            let _ = crate::validate::validate_new_workflow(&sql(f, &q));
        }
    }

    // `_logic` twins stand in for required static fields.
    check(
        workflow_with(task(
            "t",
            "cache_write",
            json!({"connector": "c", "key_logic": {"var": "data.k"}, "value_logic": {"var": "data"}}),
        )),
        &[],
    );
    check(
        workflow_with(task(
            "t",
            "cache_read",
            json!({"connector": "c", "value_logic": {"var": "data"}}),
        )),
        &[(&p("key"), "is required")],
    );
    check(
        workflow_with(task(
            "t",
            "mongo_read",
            json!({"connector": "m", "database": "d", "collection": "c", "filter_logic": {"var": "data.f"}}),
        )),
        &[],
    );
}

#[test]
fn channel_call_input() {
    let at = "tasks[0].function.input";
    check(
        workflow_with(task("t", "channel_call", json!({"channel": "orders"}))),
        &[],
    );
    check(
        workflow_with(task(
            "t",
            "channel_call",
            json!({"channel_logic": {"var": "data.c"}, "data_logic": {"var": "data"}}),
        )),
        &[],
    );
    check(
        workflow_with(task("t", "channel_call", json!({}))),
        &[(at, "exactly one of channel, channel_logic is required")],
    );
    check(
        workflow_with(task("t", "channel_call", json!({"channel": " "}))),
        &[(
            "tasks[0].function.input.channel",
            "must not be blank (only whitespace)",
        )],
    );
    check(
        workflow_with(task(
            "t",
            "channel_call",
            json!({"channel": "a", "channel_logic": "b", "data": 1, "data_logic": 2}),
        )),
        &[
            (at, "exactly one of channel, channel_logic is required"),
            (at, "at most one of data, data_logic is allowed"),
        ],
    );
    check(
        workflow_with(task(
            "t",
            "channel_call",
            json!({"channel": 5, "timeout_ms": "x", "response_path": 1}),
        )),
        &[
            (
                "tasks[0].function.input.channel",
                "expected string, got integer",
            ),
            (
                "tasks[0].function.input.response_path",
                "expected string, got integer",
            ),
            (
                "tasks[0].function.input.timeout_ms",
                "expected number, got string",
            ),
        ],
    );
}

#[test]
fn clean_workflows_deserialize() {
    let def = workflow(json!([
        task("a", "http_call", json!({"connector": "api"})),
        {"id": "g", "tasks": [task("b", "channel_call", json!({"channel": "x"}))], "loop": {"max": 2}}
    ]));
    check(validate_workflow(&def), &[]);
    let w: WorkflowDef = serde_json::from_value(def).unwrap();
    assert_eq!(w.tasks.len(), 2);
}

// ----------------------------------------------------------------- channels

fn channel(extra: Json) -> Json {
    let mut c = json!({"name": "orders", "workflow_id": "wf"});
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

#[test]
fn minimal_channels() {
    // Name-routed: protocol defaults to http.
    check(validate_channel(&channel(json!({}))), &[]);
    check(
        validate_channel(&channel(
            json!({"protocol": "rest", "route_pattern": "/", "methods": ["GET", "HEAD", "OPTIONS"]}),
        )),
        &[],
    );
    check(
        validate_channel(&channel(
            json!({"protocol": "kafka", "config_json": {"topic": "t", "consumer_group": "g"}}),
        )),
        &[],
    );
    check(
        validate_channel(&channel(
            json!({"protocol": "kafka", "channel_type": "async"}),
        )),
        &[("config_json.topic", "is required")],
    );
}

/// An async channel's `backpressure` and `cache` would be stored and never
/// used: each is a warning naming why (a sync channel's are not).
#[test]
fn async_channels_warn_of_settings_they_cannot_use() {
    let channel = |channel_type: &str| {
        json!({"channel_id": "c", "name": "c", "channel_type": channel_type, "protocol": "http",
               "workflow_id": "w", "config_json": {"backpressure": {"max_concurrent": 1},
               "cache": {"enabled": true, "ttl_secs": 5}}})
    };
    let fields = |def: &Json| -> Vec<String> {
        channel_warnings(def).into_iter().map(|d| d.field).collect()
    };
    assert_eq!(
        fields(&channel("async")),
        ["config_json.backpressure", "config_json.cache"]
    );
    assert!(fields(&channel("sync")).is_empty());
    assert!(validate_channel(&channel("async")).is_empty());
}

/// Route syntax of other frameworks and the data plane's own prefix are
/// matched literally: warned of (audit 113), and still valid.
#[test]
fn literal_route_segments_that_look_like_parameters_are_warned_of() {
    let warned = |route: &str| -> Vec<String> {
        let c = json!({"channel_id": "c", "name": "c", "workflow_id": "w", "protocol": "rest",
                       "route_pattern": route, "methods": ["POST"]});
        assert!(validate_channel(&c).is_empty(), "{route}");
        channel_warnings(&c)
            .into_iter()
            .map(|d| d.message)
            .collect()
    };
    assert_eq!(
        warned("/orders/:id"),
        ["segment ':id' is matched literally; write a path parameter as {name}"]
    );
    assert_eq!(warned("/orders/<id>").len(), 1);
    assert!(
        warned("/api/v1/data/orders/{id}")[0].starts_with("routes are relative to /api/v1/data")
    );
    assert!(warned("/orders/{id}").is_empty());
}

/// A channel rule's read outside what it is evaluated against (a
/// workflow's `payload` or `metadata.headers` spelling) is warned of.
#[test]
fn channel_rule_reads_outside_their_roots_are_warned_of() {
    let c = json!({"channel_id": "c", "name": "c", "workflow_id": "w", "protocol": "rest",
        "route_pattern": "/o/{id}", "methods": ["POST"],
        "validation_logic": {"and": [{"var": "payload.amount"}, {"var": "data.id"}, {"var": "path.id"}]},
        "config_json": {"rate_limit": {"requests_per_second": 5,
            "key_logic": {"cat": [{"var": "metadata.headers.x-tenant"}, {"var": "client_ip"}]}}}});
    assert!(validate_channel(&c).is_empty());
    // What a channel's rules cannot read at all is said so, not "meant".
    let other = json!({"channel_id": "c", "name": "c", "workflow_id": "w", "protocol": "http",
        "validation_logic": {"and": [{"var": "metadata.method"}, {"var": "temp_data.x"}, {"var": "client_ip"}]}});
    let messages: Vec<String> = channel_warnings(&other)
        .into_iter()
        .map(|d| d.message)
        .collect();
    assert_eq!(messages.len(), 3, "{messages:?}");
    assert!(
        messages
            .iter()
            .all(|m| m.ends_with("; it cannot be read here")),
        "{messages:?}"
    );
    let warned: Vec<(String, String)> = channel_warnings(&c)
        .into_iter()
        .map(|d| (d.field, d.message))
        .collect();
    assert_eq!(
        warned,
        [
            (
                "validation_logic".to_owned(),
                "reads 'payload.amount', which is always missing: 'payload' is not in what \
                 validation_logic reads (data, headers, query, path); did you mean 'data.amount'?"
                    .to_owned()
            ),
            (
                "config_json.rate_limit.key_logic".to_owned(),
                "reads 'metadata.headers.x-tenant', which is always missing: 'metadata' is not in \
                 what key_logic reads (data, headers, query, path, client_ip, channel); did you mean \
                 'headers.x-tenant'?"
                    .to_owned()
            )
        ]
    );
}

/// A channel `validation_logic` that reads nothing is a constant: the same
/// answer for every request (audit 118: a string rule let everything pass).
#[test]
fn a_constant_channel_validation_is_warned_of() {
    let warned = |rule: Json| -> Vec<String> {
        let c = json!({"channel_id": "c", "name": "c", "workflow_id": "w", "protocol": "http",
                       "validation_logic": rule});
        channel_warnings(&c)
            .into_iter()
            .map(|d| format!("{}: {}", d.field, d.message))
            .collect()
    };
    assert_eq!(
        warned(json!("data.qty > 0")),
        [
            "validation_logic: is a constant (\"data.qty > 0\"), so every request passes (a string \
          is a constant, not an expression: write JSONLogic such as {\">\": [{\"var\": \"data.qty\"}, 0]})"
        ]
    );
    assert_eq!(
        warned(json!({"==": [1, 2]})),
        ["validation_logic: is a constant (false), so every request is refused"]
    );
    assert!(warned(json!({">": [{"var": "data.qty"}, 0]})).is_empty());
}

/// CORS methods that allow none of the channel's methods are warned of
/// (every preflight would be refused); HEAD counts for GET.
#[test]
fn cors_methods_the_channel_never_serves_are_warned_of() {
    let channel = |route: Option<&str>, methods: Json, allowed: Json| {
        let mut c = json!({"channel_id": "c", "name": "c", "workflow_id": "w", "protocol": "rest",
               "config_json": {"cors": {"allowed_origins": ["https://a.example"], "allowed_methods": allowed}}});
        if let Some(route) = route {
            c["route_pattern"] = json!(route);
            c["methods"] = methods;
        }
        channel_warnings(&c)
    };
    let w = channel(Some("/x"), json!(["GET"]), json!(["POST"]));
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!(w[0].field, "config_json.cors.allowed_methods");
    assert_eq!(
        w[0].message,
        "allows none of the methods the channel serves (GET): every preflight is refused"
    );
    assert_eq!(channel(Some("/x"), json!(["GET"]), json!([])).len(), 1);
    // By name a channel serves POST.
    assert_eq!(channel(None, json!(null), json!(["GET"])).len(), 1);
    for (methods, allowed) in [
        (json!(["GET", "POST"]), json!(["post"])),
        (json!(["GET"]), json!(["HEAD"])),
    ] {
        assert!(channel(Some("/x"), methods, allowed).is_empty());
    }
    assert!(channel(None, json!(null), json!(["POST", "GET"])).is_empty());
    // No origin at all is warned of too.
    let w = channel_warnings(&json!({"channel_id": "c", "name": "c", "workflow_id": "w",
        "protocol": "http", "config_json": {"cors": {"allowed_origins": []}}}));
    assert_eq!(
        w.iter().map(|d| d.field.as_str()).collect::<Vec<_>>(),
        ["config_json.cors.allowed_origins"]
    );
}

#[test]
fn channel_top_level_fields() {
    let c = json!({
        "channel_id": "bad id",
        "name": "",
        "channel_type": "stream",
        "protocol": "grpc",
        "status": "paused",
        "version": "1",
        "priority": 1.5,
        "description": 5
    });
    check(
        validate_channel(&c),
        &[
            ("channel_id", ID_RULE),
            ("name", "must not be empty"),
            ("channel_type", "must be one of sync, async, got 'stream'"),
            ("protocol", "must be one of rest, http, kafka, got 'grpc'"),
            ("workflow_id", "is required"),
            (
                "status",
                "must be one of draft, active, archived, got 'paused'",
            ),
            ("version", "expected integer, got string"),
            ("description", "expected string, got integer"),
            ("priority", "expected integer, got number"),
        ],
    );
    check(
        validate_channel(&json!({})),
        &[("name", "is required"), ("workflow_id", "is required")],
    );
}

#[test]
fn rest_channels_need_route_and_methods() {
    check(
        validate_channel(&channel(json!({"protocol": "rest"}))),
        &[("route_pattern", "is required"), ("methods", "is required")],
    );
    // A route_pattern implies rest.
    check(
        validate_channel(&channel(json!({"route_pattern": "/a"}))),
        &[("methods", "is required")],
    );
    check(
        validate_channel(&channel(json!({"route_pattern": "/a", "methods": []}))),
        &[("methods", "must not be empty")],
    );
    check(
        validate_channel(&channel(
            json!({"route_pattern": "/a", "methods": ["GET", "POST", "GET"]}),
        )),
        &[("methods[2]", "duplicate method 'GET' (first at methods[0])")],
    );
    check(
        validate_channel(&channel(
            json!({"route_pattern": "/a", "methods": ["get", 1, "TRACE"]}),
        )),
        &[
            (
                "methods[0]",
                "must be one of GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS, got 'get'",
            ),
            ("methods[1]", "expected string, got integer"),
            (
                "methods[2]",
                "must be one of GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS, got 'TRACE'",
            ),
        ],
    );
    check(
        validate_channel(&channel(
            json!({"protocol": "kafka", "channel_type": "sync", "config_json": {"topic": "t"}}),
        )),
        &[("channel_type", "must be async for a kafka channel")],
    );
}

#[test]
fn route_patterns() {
    let route =
        |p: &str| validate_channel(&channel(json!({"route_pattern": p, "methods": ["GET"]})));
    for ok in [
        "/",
        "/orders",
        "/orders/{order_id}",
        "/a/{x}/b/{y_2}",
        "/v1.0/items-list",
    ] {
        check(route(ok), &[]);
    }
    let bad = [
        ("orders", "must start with '/'"),
        (
            "/a//b",
            "must not contain empty segments ('//' or a trailing '/')",
        ),
        (
            "/a/",
            "must not contain empty segments ('//' or a trailing '/')",
        ),
        (
            "/a/{id}/b/{id}",
            "path parameter 'id' is used more than once",
        ),
        (
            "/a/async",
            "must not end in '/async', which selects async mode",
        ),
        (
            "/a?x=1",
            "segment 'a?x=1' must not contain '?', '#' or whitespace",
        ),
    ];
    for (p, msg) in bad {
        check(route(p), &[("route_pattern", msg)]);
    }
    for seg in ["{id", "id}", "x{id}", "{}", "{1a}", "{a-b}", "{{a}}"] {
        let found = route(&format!("/a/{seg}"));
        assert_eq!(found.len(), 1, "{seg}: {found:#?}");
        assert!(
            found[0].message.contains("is not a well-formed parameter"),
            "{seg}: {found:#?}"
        );
    }
}

#[test]
fn channel_validation_logic_must_compile() {
    let with = |rule: Json| validate_channel(&channel(json!({"validation_logic": rule})));
    check(with(json!({"!!": [{"var": "data.id"}]})), &[]);
    // Absent, like a missing field (what the engine makes of `null`).
    check(with(Json::Null), &[]);
    check(
        with(json!({"and": [{"var": "data.id"}, {"no_such_op": [1]}]})),
        &[(
            "validation_logic",
            "invalid JSONLogic: unknown operator 'no_such_op'",
        )],
    );
}

#[test]
fn channel_config_json() {
    let cfg = |c: Json| validate_channel(&channel(json!({"config_json": c})));
    check(
        cfg(json!({
            "timeout_ms": 5000,
            "rate_limit": {"requests_per_second": 0.5, "burst": 1, "key_logic": {"var": "client_ip"}, "fail_open": true},
            "deduplication": {"key_logic": {"var": "data.id"}, "header": "x-idem", "window_secs": 1},
            "cache": {"enabled": false, "ttl_secs": 1, "key_logic": null},
            "backpressure": {"max_concurrent": 1},
            "cors": {"allowed_origins": ["https://a.example"], "allowed_methods": ["GET"], "allowed_headers": ["x-a"], "max_age_secs": 0}
        })),
        &[],
    );
    // One request a day is the slowest rate; below it, a typo (1e-300
    // once overflowed the bucket's Retry-After).
    check(
        cfg(json!({"rate_limit": {"requests_per_second": 1.0 / 86_400.0}})),
        &[],
    );
    check(
        cfg(json!({"rate_limit": {"requests_per_second": 1e-300}})),
        &[(
            "config_json.rate_limit.requests_per_second",
            "must be at least 1/86400 (one request a day)",
        )],
    );
    check(
        cfg(json!({
            "timeout_ms": 0,
            "timeout": 5,
            "rate_limit": {"requests_per_second": 0, "burst": 0, "per": "ip"},
            "deduplication": {"header": "", "window_secs": 0, "fail_open": "no"},
            "cache": {"enabled": "yes", "ttl_secs": -5},
            "backpressure": {},
            "cors": {"allowed_origins": "*", "allowed_methods": ["FETCH"], "max_age_secs": -1},
            "topic": 3
        })),
        &[
            (
                "config_json.timeout",
                "unknown field; expected one of timeout_ms, rate_limit, deduplication, cache, backpressure, cors, topic, consumer_group",
            ),
            ("config_json.timeout_ms", "must be at least 1"),
            (
                "config_json.rate_limit.per",
                "unknown field; expected one of requests_per_second, burst, key_logic, fail_open",
            ),
            (
                "config_json.rate_limit.requests_per_second",
                "must be greater than 0",
            ),
            (
                "config_json.rate_limit.burst",
                "must be between 1 and 4294967295",
            ),
            ("config_json.deduplication.header", "must not be empty"),
            (
                "config_json.deduplication.window_secs",
                "must be between 1 and 31536000",
            ),
            (
                "config_json.deduplication.fail_open",
                "expected boolean, got string",
            ),
            ("config_json.cache.enabled", "expected boolean, got string"),
            (
                "config_json.cache.ttl_secs",
                "must be between 1 and 31536000",
            ),
            ("config_json.backpressure.max_concurrent", "is required"),
            (
                "config_json.cors.allowed_origins",
                "expected array, got string",
            ),
            (
                "config_json.cors.allowed_methods[0]",
                "must be one of GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS, got 'FETCH'",
            ),
            ("config_json.cors.max_age_secs", "must not be negative"),
            ("config_json.topic", "expected string, got integer"),
            ("config_json.topic", "applies only to a kafka channel"),
        ],
    );
    // A window or TTL past a year is refused (the shared backend failed
    // every keyed request past about 292,000 years); a year is taken.
    check(
        cfg(json!({
            "deduplication": {"window_secs": 9223372036854775807i64},
            "cache": {"ttl_secs": 31536001},
        })),
        &[
            (
                "config_json.deduplication.window_secs",
                "must be between 1 and 31536000",
            ),
            (
                "config_json.cache.ttl_secs",
                "must be between 1 and 31536000",
            ),
        ],
    );
    check(
        cfg(json!({
            "deduplication": {"window_secs": 31536000},
            "cache": {"ttl_secs": 31536000},
        })),
        &[],
    );
    // What a kafka channel would accept and never use is refused.
    let kafka = |extra: Json| {
        let mut c = json!({"channel_id": "k", "name": "k", "workflow_id": "w", "protocol": "kafka",
                           "config_json": {"topic": "t", "consumer_group": "g", "timeout_ms": 5}});
        for (k, v) in extra.as_object().unwrap() {
            if k == "config_json" {
                for (ck, cv) in v.as_object().unwrap() {
                    c["config_json"][ck] = cv.clone();
                }
            } else {
                c[k] = v.clone();
            }
        }
        validate_channel(&c)
    };
    check(kafka(json!({})), &[]);
    // An explicit http channel is routed by name: a route would never match.
    check(
        validate_channel(&json!({"name": "h", "workflow_id": "w", "protocol": "http",
                                  "route_pattern": "/h", "methods": ["GET"]})),
        &[
            (
                "route_pattern",
                "does not apply to an http channel (routed by name; use protocol rest for a route)",
            ),
            (
                "methods",
                "does not apply to an http channel (routed by name; use protocol rest for a route)",
            ),
        ],
    );
    // A deduplication header no request can carry.
    check(
        cfg(json!({"deduplication": {"header": "bad header"}})),
        &[(
            "config_json.deduplication.header",
            "is not a valid HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)",
        )],
    );
    let unused = "does not apply to a kafka channel (consumed messages are not throttled, deduplicated, cached or answered)";
    check(
        kafka(json!({"route_pattern": "/x", "methods": ["POST"],
                     "config_json": {"rate_limit": {"requests_per_second": 1}, "cache": {}}})),
        &[
            (
                "route_pattern",
                "does not apply to a kafka channel (it consumes config_json.topic)",
            ),
            (
                "methods",
                "does not apply to a kafka channel (it consumes config_json.topic)",
            ),
            ("config_json.rate_limit", unused),
            ("config_json.cache", unused),
        ],
    );
    check(
        cfg(json!([])),
        &[("config_json", "expected object, got array")],
    );
    // key_logic must compile; origins are '*' or scheme://host[:port].
    let found = cfg(json!({
        "rate_limit": {"requests_per_second": 1, "key_logic": {"no_such_op": [1]}},
        "deduplication": {"key_logic": {"no_such_op": 1}},
        "cache": {"key_logic": {"cat": [{"no_such_op": 1}]}},
        "cors": {"allowed_origins": ["*", "https://a.example:8443", "a.example", "https://a.example/x"]}
    }));
    let got: Vec<(&str, bool)> = found
        .iter()
        .map(|d| {
            (
                d.field.as_str(),
                d.message.starts_with("invalid JSONLogic")
                    || d.message.starts_with("must be '*' or an origin"),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("config_json.rate_limit.key_logic", true),
            ("config_json.deduplication.key_logic", true),
            ("config_json.cache.key_logic", true),
            ("config_json.cors.allowed_origins[2]", true),
            ("config_json.cors.allowed_origins[3]", true),
        ],
        "{found:#?}"
    );
    // Origins a browser never sends, and header names that are no tokens.
    let found = cfg(json!({"cors": {
        "allowed_origins": ["https://a.com:443", "http://a.com:80", "https://a.com:", "https://u@a.com",
                            "https://a.com:99999", "https://a.com:0", "http://a.com:080",
                            "http://[::1]:8080", "capacitor://localhost", "https://a.com:8443"],
        "allowed_headers": ["x-ok", "x\r\ny: z", "", "bad header", "x-é"]}}));
    let fields: Vec<&str> = found.iter().map(|d| d.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "config_json.cors.allowed_origins[0]",
            "config_json.cors.allowed_origins[1]",
            "config_json.cors.allowed_origins[2]",
            "config_json.cors.allowed_origins[3]",
            "config_json.cors.allowed_origins[4]",
            "config_json.cors.allowed_origins[5]",
            "config_json.cors.allowed_origins[6]",
            "config_json.cors.allowed_headers[1]",
            "config_json.cors.allowed_headers[2]",
            "config_json.cors.allowed_headers[3]",
            "config_json.cors.allowed_headers[4]",
        ],
        "{found:#?}"
    );
    assert!(
        found[0].message.contains("default port"),
        "{}",
        found[0].message
    );
    check(
        cfg(json!({"rate_limit": {}, "cors": {}, "timeout_ms": "5"})),
        &[
            ("config_json.timeout_ms", "expected integer, got string"),
            ("config_json.rate_limit.requests_per_second", "is required"),
            ("config_json.cors.allowed_origins", "is required"),
        ],
    );
}

#[test]
fn clean_channels_deserialize() {
    let c = channel(json!({
        "route_pattern": "/o/{id}", "methods": ["POST"], "priority": 3,
        "config_json": {"rate_limit": {"requests_per_second": 3}, "backpressure": {"max_concurrent": 2}}
    }));
    check(validate_channel(&c), &[]);
    let def: ChannelDef = serde_json::from_value(c).unwrap();
    assert_eq!(def.priority, 3);
}

// --------------------------------------------------------------- connectors

fn connector(ty: &str, config: Json) -> Json {
    json!({"name": "conn", "connector_type": ty, "config": config})
}

#[test]
fn valid_connectors_of_every_type() {
    let cases = [
        (
            "http",
            json!({"type": "http", "url": "https://api.example.com/v1", "auth": {"type": "bearer", "token": "env://API_TOKEN"},
                        "headers": {"x-a": "b"}, "timeout_ms": 1000, "retry": {"max_retries": 0, "retry_delay_ms": 0}}),
        ),
        (
            "http",
            json!({"url": "http://user@host:8080", "auth": {"type": "basic", "username": "u", "password": "p"}}),
        ),
        (
            "http",
            json!({"url": "env://BASE_URL", "auth": {"type": "api_key", "header": "X-Key", "key": "k"}}),
        ),
        (
            "db",
            json!({"type": "db", "connection_string": "postgres://u:p@h/db", "max_connections": 4, "query_timeout_ms": 10, "connect_timeout_ms": 10}),
        ),
        ("db", json!({"connection_string": "sqlite::memory:"})),
        ("db", json!({"connection_string": "MariaDB://h/db"})),
        ("db", json!({"connection_string": "env://DATABASE_URL"})),
        ("cache", json!({"backend": "memory", "max_entries": 100})),
        (
            "cache",
            json!({"backend": "redis", "url": "rediss://r:6380"}),
        ),
        (
            "mongodb",
            json!({"connection_string": "mongodb+srv://cluster/x"}),
        ),
        (
            "kafka",
            json!({"brokers": ["a:9092", "b:9093"], "client_id": "c", "sasl": {"mechanism": "SCRAM-SHA-512", "username": "u", "password": "p"}}),
        ),
        ("kafka", json!({"brokers": "a:9092, b:9093"})),
        ("kafka", json!({"brokers": "env://KAFKA_BROKERS"})),
        (
            "object_storage",
            json!({"endpoint": "https://s3.example.com", "bucket": "b", "region": "eu", "access_key": "a", "secret_key": "env://S3_SECRET"}),
        ),
    ];
    for (ty, config) in cases {
        let def = connector(ty, config);
        check(validate_connector(&def), &[]);
        let parsed: ConnectorDef = serde_json::from_value(def.clone()).unwrap();
        parsed.typed().unwrap_or_else(|e| panic!("{def}: {e}"));
    }
}

#[test]
fn connector_top_level() {
    check(
        validate_connector(&json!({})),
        &[
            ("name", "is required"),
            ("connector_type", "is required"),
            ("config", "is required"),
        ],
    );
    check(
        validate_connector(&json!({"name": "a b", "connector_type": "sql", "config": []})),
        &[
            ("name", ID_RULE),
            (
                "connector_type",
                "must be one of http, db, cache, mongodb, kafka, object_storage, got 'sql'",
            ),
            ("config", "expected object, got array"),
        ],
    );
    check(
        validate_connector(&connector(
            "http",
            json!({"type": "db", "url": "https://x"}),
        )),
        &[("config.type", "must equal connector_type ('http')")],
    );
    // Without connector_type, config.type still selects the per-type checks.
    check(
        validate_connector(&json!({"name": "c", "config": {"type": "db"}})),
        &[
            ("connector_type", "is required"),
            ("config.connection_string", "is required"),
        ],
    );
}

#[test]
fn http_connector_rules() {
    check(
        validate_connector(&connector("http", json!({}))),
        &[("config.url", "is required")],
    );
    // Audit 101: a fragment swallowed every task's path and query; a
    // space was refused as if the URL had no host; framing headers were
    // sent as given; unknown auth keys were stored and ignored.
    check(
        validate_connector(&connector("http", json!({"url": "http://x/v 1"}))),
        &[(
            "config.url",
            "must not contain whitespace (write a space as %20)",
        )],
    );
    for url in ["http://x/v1#top", "http://x/v1/#", "http://x/v1?a=1#f"] {
        check(
            validate_connector(&connector("http", json!({"url": url}))),
            &[(
                "config.url",
                "must not hold a fragment ('#…'): a request never carries one (write '#' in a path as %23)",
            )],
        );
    }
    let framing = "is written by the HTTP client from the request itself (body length, framing, host, connection); it cannot be set";
    check(
        validate_connector(&connector(
            "http",
            json!({"url": "https://x",
                   "auth": {"type": "api_key", "header": "Host", "key": "k", "in": "query"},
                   "headers": {"Content-Length": "3", "x-fine": "v", "Transfer-Encoding": "chunked"}}),
        )),
        &[
            ("config.auth.header", framing),
            (
                "config.auth.in",
                "unknown field; expected one of type, header, key",
            ),
            ("config.headers.Content-Length", framing),
            ("config.headers.Transfer-Encoding", framing),
        ],
    );
    check(
        validate_connector(&connector(
            "http",
            json!({"url": "https://x", "auth": {"type": "bearer", "token": "t", "extra": 1}}),
        )),
        &[(
            "config.auth.extra",
            "unknown field; expected one of type, token",
        )],
    );
    for bad in [
        "ftp://x",
        "https://",
        "api.example.com",
        "http://a b",
        "http://:80/x",
        // What the HTTP client would refuse on every call.
        "http://host:99999/",
        "http://[::1/x",
        "http://exa%mple.com/",
    ] {
        check(
            validate_connector(&connector("http", json!({"url": bad}))),
            &[(
                "config.url",
                "must be an http:// or https:// URL with a host",
            )],
        );
    }
    check(
        validate_connector(&connector(
            "http",
            json!({"url": "https://x", "auth": {"type": "oauth"}}),
        )),
        &[(
            "config.auth.type",
            "must be one of bearer, basic, api_key, got 'oauth'",
        )],
    );
    check(
        validate_connector(&connector(
            "http",
            json!({"url": "https://x", "auth": {"type": "bearer"}}),
        )),
        &[("config.auth.token", "is required")],
    );
    check(
        validate_connector(&connector(
            "http",
            json!({"url": "https://x", "auth": {"type": "basic", "username": ""}}),
        )),
        &[
            ("config.auth.username", "must not be empty"),
            ("config.auth.password", "is required"),
        ],
    );
    check(
        validate_connector(&connector(
            "http",
            json!({"url": "https://x", "auth": {"type": "api_key", "key": 1}, "headers": {"a": 1}, "timeout_ms": 0}),
        )),
        &[
            ("config.auth.header", "is required"),
            ("config.auth.key", "expected string, got integer"),
            ("config.headers.a", "expected string, got integer"),
            ("config.timeout_ms", "must be at least 1"),
        ],
    );
    // Header names and values the client could not send fail at create,
    // not on every call.
    check(
        validate_connector(&connector(
            "http",
            json!({"url": "https://x",
                   "auth": {"type": "api_key", "header": "x key", "key": "a\nb"},
                   "headers": {"x-ok": "fine\tvalue", "bad:name": "v", "x-b": "line\r\nbreak"}}),
        )),
        &[
            (
                "config.auth.header",
                "is not a valid HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)",
            ),
            (
                "config.auth.key",
                "is not a valid HTTP header value (visible ASCII, spaces and tabs only)",
            ),
            (
                "config.headers.bad:name",
                "is not a valid HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)",
            ),
            (
                "config.headers.x-b",
                "is not a valid HTTP header value (visible ASCII, spaces and tabs only)",
            ),
        ],
    );
    check(
        validate_connector(&connector(
            "http",
            json!({"url": "https://x", "auth": {"type": "basic", "username": "a:b", "password": "p"}}),
        )),
        &[("config.auth.username", "must not contain ':'")],
    );
    check(
        validate_connector(&connector(
            "http",
            json!({"url": "https://x", "auth": {"type": "bearer", "token": "env://API_TOKEN"},
                   "headers": {"x-k": "env://X_KEY"}}),
        )),
        &[],
    );
}

#[test]
fn other_connector_rules() {
    let check_cfg = |ty: &str, cfg: Json, expected: &[(&str, &str)]| {
        check(validate_connector(&connector(ty, cfg)), expected);
    };
    let db_schemes = "must start with one of sqlite:, postgres:, postgresql:, mysql:, mariadb:";
    check_cfg(
        "db",
        json!({"connection_string": "oracle://x"}),
        &[("config.connection_string", db_schemes)],
    );
    check_cfg(
        "db",
        json!({"connection_string": "nocolon"}),
        &[("config.connection_string", db_schemes)],
    );
    check_cfg(
        "db",
        json!({"connection_string": "sqlite:x.db", "max_connections": 0, "query_timeout_ms": "1"}),
        &[
            ("config.max_connections", "must be between 1 and 1000"),
            ("config.query_timeout_ms", "expected integer, got string"),
        ],
    );
    // A pool sized past what a process can hold, and a statement timeout
    // past PostgreSQL's 32-bit limit, are refused; their limits are taken.
    check_cfg(
        "db",
        json!({"connection_string": "postgres://h/db", "max_connections": 4294967295u64,
               "query_timeout_ms": 2147483648u64, "connect_timeout_ms": 2147483648u64}),
        &[
            ("config.max_connections", "must be between 1 and 1000"),
            (
                "config.query_timeout_ms",
                "must be between 1 and 2147483647",
            ),
            (
                "config.connect_timeout_ms",
                "must be between 1 and 2147483647",
            ),
        ],
    );
    check_cfg(
        "db",
        json!({"connection_string": "postgres://h/db", "max_connections": 1000,
               "query_timeout_ms": 2147483647}),
        &[],
    );
    check_cfg("cache", json!({}), &[("config.backend", "is required")]);
    check_cfg(
        "cache",
        json!({"backend": "memcached"}),
        &[(
            "config.backend",
            "must be one of memory, redis, got 'memcached'",
        )],
    );
    check_cfg(
        "cache",
        json!({"backend": "redis"}),
        &[("config.url", "is required")],
    );
    // The client has no "no certificate check" mode: refused, not failed
    // on every call.
    check_cfg(
        "cache",
        json!({"backend": "redis", "url": "rediss://r:6380/0#insecure"}),
        &[(
            "config.url",
            "#insecure (TLS without a certificate check) is not supported; \
             use a certificate the system trusts",
        )],
    );
    check_cfg(
        "cache",
        json!({"backend": "redis", "url": "http://r"}),
        &[("config.url", "must start with one of redis:, rediss:")],
    );
    check_cfg(
        "mongodb",
        json!({"connection_string": "postgres://x"}),
        &[(
            "config.connection_string",
            "must start with one of mongodb:, mongodb+srv:",
        )],
    );
    check_cfg("kafka", json!({}), &[("config.brokers", "is required")]);
    check_cfg(
        "kafka",
        json!({"brokers": []}),
        &[("config.brokers", "must not be empty")],
    );
    check_cfg(
        "kafka",
        json!({"brokers": 9092}),
        &[("config.brokers", "expected array or string, got integer")],
    );
    check_cfg(
        "kafka",
        json!({"brokers": ["a:9092", "b", 3]}),
        &[
            ("config.brokers[2]", "expected string, got integer"),
            ("config.brokers[1]", "broker 'b' must be host:port"),
        ],
    );
    // A URL is not a broker (audit 113: stored, then every publish waited
    // for the channel's timeout).
    check_cfg(
        "kafka",
        json!({"brokers": ["kafka://127.0.0.1:9092"]}),
        &[(
            "config.brokers[0]",
            "broker 'kafka://127.0.0.1:9092' must be host:port, without a scheme",
        )],
    );
    // Credentials in one are not quoted back (audit 122).
    check_cfg(
        "kafka",
        json!({"brokers": ["SASL_SSL://svc:Pa55w0rd@kafka-1:9092", "u:pw@k:1"]}),
        &[
            (
                "config.brokers[0]",
                "broker 'SASL_SSL://******@kafka-1:9092' must be host:port, without a scheme (credentials go in sasl)",
            ),
            (
                "config.brokers[1]",
                "broker '******@k:1' must be host:port (credentials go in sasl)",
            ),
        ],
    );
    check_cfg(
        "kafka",
        json!({"brokers": "a:1,,b:x"}),
        &[
            ("config.brokers", "broker '' must be host:port"),
            ("config.brokers", "broker 'b:x' must be host:port"),
        ],
    );
    check_cfg(
        "kafka",
        json!({"brokers": "a:1", "sasl": {"mechanism": "plain"}}),
        &[
            (
                "config.sasl.mechanism",
                "must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, got 'plain'",
            ),
            ("config.sasl.username", "is required"),
            ("config.sasl.password", "is required"),
        ],
    );
    check_cfg(
        "object_storage",
        json!({"endpoint": "s3.amazonaws.com"}),
        &[
            (
                "config.endpoint",
                "must be an http:// or https:// URL with a host",
            ),
            ("config.bucket", "is required"),
            ("config.access_key", "is required"),
            ("config.secret_key", "is required"),
        ],
    );
}

#[test]
fn retry_settings() {
    let with_retry = |r: Json| {
        validate_connector(&connector(
            "cache",
            json!({"backend": "memory", "retry": r}),
        ))
    };
    check(with_retry(json!({})), &[]);
    check(
        with_retry(json!({"max_retries": 10, "retry_delay_ms": 60000})),
        &[],
    );
    check(
        with_retry(json!({"max_retries": 11, "retry_delay_ms": -1})),
        &[
            ("config.retry.max_retries", "must be between 0 and 10"),
            ("config.retry.retry_delay_ms", "must not be negative"),
        ],
    );
    check(
        with_retry(json!({"max_retry": 5})),
        &[(
            "config.retry.max_retry",
            "unknown field; expected one of max_retries, retry_delay_ms",
        )],
    );
    check(
        with_retry(json!({"max_retries": 1.5, "retry_delay_ms": "100"})),
        &[
            ("config.retry.max_retries", "expected integer, got number"),
            (
                "config.retry.retry_delay_ms",
                "expected integer, got string",
            ),
        ],
    );
    check(
        with_retry(json!(3)),
        &[("config.retry", "expected object, got integer")],
    );
}

#[test]
fn env_references() {
    assert!(is_env_var_name("API_TOKEN") && is_env_var_name("_x1") && !is_env_var_name("1X"));
    assert!(!is_env_var_name("") && !is_env_var_name("A-B"));
    let msg = "must be env://NAME with NAME matching [A-Za-z_][A-Za-z0-9_]*";
    check(
        validate_connector(&connector(
            "http",
            json!({"url": "env://", "auth": {"type": "bearer", "token": "env://BAD-NAME"}, "headers": {"x": "env://1"}}),
        )),
        &[
            ("config.url", msg),
            ("config.auth.token", msg),
            ("config.headers.x", msg),
        ],
    );
    // Enumerated discriminators cannot be deferred to the environment.
    check(
        validate_connector(&connector("cache", json!({"backend": "env://BACKEND"}))),
        &[(
            "config.backend",
            "must be one of memory, redis, got 'env://BACKEND'",
        )],
    );
}

/// Integers beyond i64 (beyond u64 too, which serde_json reads as floats)
/// are out of range, and the message names the range (audit 66: "is out of
/// range", or "expected integer, got number" beyond u64).
#[test]
fn numbers_beyond_i64_are_out_of_range() {
    let def: Json = serde_json::from_str(
        r#"{"name": "w", "priority": 18446744073709551615, "version": 99999999999999999999999,
            "rollout_percentage": 18446744073709551616, "tasks": [{"id": "t", "name": "t",
            "function": {"name": "log", "input": {}}}]}"#,
    )
    .unwrap();
    check(
        validate_workflow(&def),
        &[
            ("priority", "must be at most 9223372036854775807"),
            ("version", "must be between 1 and 9223372036854775807"),
            ("rollout_percentage", "must be between 1 and 100"),
        ],
    );
    let def: Json = serde_json::from_str(
        r#"{"name": "w", "priority": -99999999999999999999, "tasks": [{"id": "t", "name": "t",
            "function": {"name": "log", "input": {}}}]}"#,
    )
    .unwrap();
    check(
        validate_workflow(&def),
        &[("priority", "must be at least -9223372036854775808")],
    );
    // A fraction stays a type error.
    let def = json!({"name": "w", "priority": 1.5, "tasks": [task("t", "log", json!({}))]});
    check(
        validate_workflow(&def),
        &[("priority", "expected integer, got number")],
    );
}

// ------------------------------------------------------------------ masking

#[test]
fn masks_secret_keys_at_any_depth() {
    let mut v = json!({
        "name": "api",
        "config": {
            "url": "https://x",
            "auth": {"type": "bearer", "token": "env://API_TOKEN"},
            "nested": [{"Password": "p", "api_key": 5, "secret": {"a": 1}, "key": null}],
            "connection_string": "postgres://u:p@h/db",
            "secret_key": "s", "access_key": "a", "client_secret": "c",
            "keys": "not masked", "key_logic": {"var": "x"}, "token_url": "https://t"
        }
    });
    mask_secrets(&mut v);
    assert_eq!(
        v,
        json!({
            "name": "api",
            "config": {
                "url": "https://x",
                "auth": {"type": "bearer", "token": "******"},
                "nested": [{"Password": "******", "api_key": "******", "secret": "******", "key": null}],
                "connection_string": "******",
                "secret_key": "******", "access_key": "******", "client_secret": "******",
                "keys": "not masked", "key_logic": {"var": "x"}, "token_url": "https://t"
            }
        })
    );
}

#[test]
fn masks_secret_keys_in_any_word_spelling() {
    let mut v = json!({
        "apiKey": "a", "API-KEY": "b", "x-api-key": "c", "clientSecret": "d",
        "accessToken": "e", "refresh-token": "f", "connectionString": "g",
        "privateKey": "h", "passwd": "i", "ssl_passphrase": "j", "secretAccessKey": "k",
        "partitionKey": "kept", "tokenUrl": "kept", "max_tokens": 5, "keyspace": "kept"
    });
    mask_secrets(&mut v);
    assert_eq!(
        v,
        json!({
            "apiKey": "******", "API-KEY": "******", "x-api-key": "******", "clientSecret": "******",
            "accessToken": "******", "refresh-token": "******", "connectionString": "******",
            "privateKey": "******", "passwd": "******", "ssl_passphrase": "******",
            "secretAccessKey": "******",
            "partitionKey": "kept", "tokenUrl": "kept", "max_tokens": 5, "keyspace": "kept"
        })
    );
}

#[test]
fn masks_sensitive_header_values() {
    let mut v = json!({
        "headers": {"Authorization": "Bearer x", "x-api-key": "k", "X-Auth-Token": "t",
                    "x-client-secret": "s", "content-type": "application/json", "accept": "*/*"},
        "metadata": {"headers": {"proxy-authorization": "Basic y", "x-tenant": "t1",
                                 "cookie": "session=abc", "Set-Cookie": "sid=1"}},
        "list": [{"headers": {"keycloak-session": "z"}}],
        "not_headers": {"authorization": "kept"}
    });
    mask_secrets(&mut v);
    assert_eq!(
        v,
        json!({
            "headers": {"Authorization": "******", "x-api-key": "******", "X-Auth-Token": "******",
                        "x-client-secret": "******", "content-type": "application/json", "accept": "*/*"},
            "metadata": {"headers": {"proxy-authorization": "******", "x-tenant": "t1",
                                     "cookie": "******", "Set-Cookie": "******"}},
            "list": [{"headers": {"keycloak-session": "******"}}],
            "not_headers": {"authorization": "kept"}
        })
    );
}

#[test]
fn masking_leaves_scalars_and_clean_documents_alone() {
    for mut v in [
        json!("token"),
        json!(1),
        json!(null),
        json!([1, "a"]),
        json!({"a": {"b": [1]}}),
    ] {
        let before = v.clone();
        mask_secrets(&mut v);
        assert_eq!(v, before);
    }
}

#[test]
fn masks_passwords_in_urls() {
    let mut v = json!({"config": {
        "url": "redis://user:pw123@127.0.0.1:6379/0",
        "list": ["https://bob:s%40cret@example.com/a?b=c@d", "postgres://only-user@host/db"],
        "plain": "https://example.com/x@y",
        "done": "redis://:******@h:1/"
    }});
    mask_secrets(&mut v);
    assert_eq!(
        v,
        json!({"config": {
            "url": "redis://user:******@127.0.0.1:6379/0",
            "list": ["https://bob:******@example.com/a?b=c@d", "postgres://only-user@host/db"],
            "plain": "https://example.com/x@y",
            "done": "redis://:******@h:1/"
        }})
    );
    let mut pw_only = json!("redis://:secret@h:6379");
    mask_secrets(&mut pw_only);
    assert_eq!(pw_only, "redis://:******@h:6379");
}

// ------------------------------------------------------------ parse helpers

#[test]
fn parse_helpers_validate_then_deserialize() {
    let w = parse_workflow(&workflow(json!([task("t", "log", json!({}))]))).unwrap();
    assert_eq!(w.tasks[0].id(), "t");
    let errs = parse_workflow(&json!({"tasks": []})).unwrap_err();
    assert_eq!(errs.len(), 2, "{errs:#?}");

    let c = parse_channel(&channel(json!({"route_pattern": "/a", "methods": ["GET"]}))).unwrap();
    assert_eq!(c.methods.len(), 1);
    assert!(parse_channel(&json!({"name": "x"})).is_err());

    let k = parse_connector(&connector("kafka", json!({"brokers": ["a:1"]}))).unwrap();
    assert!(k.typed().is_ok());
    assert_eq!(
        parse_connector(&connector("kafka", json!({}))).unwrap_err(),
        vec![d("config.brokers", "is required")]
    );
}

// ------------------------------------------------- validator/serde agreement

/// Every leaf and every container of `v`, each replaced in turn by each of
/// `probes`, and every object member removed in turn.
fn mutations(v: &Json) -> Vec<Json> {
    let probes = [
        json!(null),
        json!(0),
        json!(-1),
        json!(1),
        json!(300),
        json!(1.5),
        json!(u64::MAX),
        json!(""),
        json!("x"),
        json!(true),
        json!([]),
        json!(["x"]),
        json!({}),
    ];
    let mut out = Vec::new();
    fn walk(root: &Json, at: &mut Vec<Json>, v: &Json, probes: &[Json], out: &mut Vec<Json>) {
        let set = |value: Option<&Json>, at: &[Json]| {
            let mut copy = root.clone();
            let mut slot = &mut copy;
            for (i, step) in at.iter().enumerate() {
                if i + 1 == at.len() && value.is_none() {
                    if let Some(m) = slot.as_object_mut() {
                        m.shift_remove(step.as_str().unwrap());
                    }
                    return copy;
                }
                slot = match step {
                    Json::String(k) => slot.get_mut(k.as_str()).unwrap(),
                    Json::Number(n) => slot.get_mut(n.as_u64().unwrap() as usize).unwrap(),
                    _ => unreachable!(),
                };
            }
            *slot = value.unwrap().clone();
            copy
        };
        if !at.is_empty() {
            for p in probes {
                out.push(set(Some(p), at));
            }
            if at.last().unwrap().is_string() {
                out.push(set(None, at));
            }
        }
        match v {
            Json::Object(m) => {
                for (k, item) in m {
                    at.push(json!(k));
                    walk(root, at, item, probes, out);
                    at.pop();
                }
            }
            Json::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    at.push(json!(i));
                    walk(root, at, item, probes, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }
    walk(v, &mut Vec::new(), v, &probes, &mut out);
    out
}

#[test]
fn whatever_validates_also_deserializes() {
    let wf = json!({
        "workflow_id": "w", "name": "n", "description": "d", "priority": 1, "tags": ["a"],
        "continue_on_error": false, "channel": "c", "status": "draft", "version": 1,
        "rollout_percentage": 50, "rollout": {"bucket_start": 0, "bucket_end": 50},
        "loop": {"max": 2, "init": 0, "increment": 1, "counter": "temp_data.i"},
        "created_at": "t", "updated_at": "t",
        "tasks": [
            {"id": "a", "name": "a", "description": "d", "continue_on_error": true, "terminal": false,
             "halt_on": "never", "function": {"name": "http_call", "input": {"connector": "c", "method": "GET", "timeout_ms": 5}}},
            {"id": "g", "name": "g", "terminal": true, "continue_on_error": false, "loop": {"max": 1},
             "tasks": [{"id": "b", "name": "b", "function": {"name": "channel_call", "input": {"channel": "x"}}}]}
        ]
    });
    let ch = json!({
        "channel_id": "c", "name": "n", "channel_type": "sync", "protocol": "rest",
        "route_pattern": "/a/{b}", "methods": ["GET"], "workflow_id": "w", "status": "draft",
        "version": 1, "description": "d", "priority": 0, "created_at": "t", "updated_at": "t",
        "config_json": {
            "timeout_ms": 10,
            "rate_limit": {"requests_per_second": 1, "burst": 1},
            "deduplication": {"header": "h", "window_secs": 1},
            "cache": {"enabled": true, "ttl_secs": 1},
            "backpressure": {"max_concurrent": 1},
            "cors": {"allowed_origins": ["x"], "allowed_methods": ["GET"], "allowed_headers": ["x"], "max_age_secs": 1},
            "topic": "t", "consumer_group": "g"
        }
    });
    let connectors = [
        connector(
            "http",
            json!({"type": "http", "url": "https://x", "auth": {"type": "basic", "username": "u", "password": "p"},
                                 "headers": {"a": "b"}, "timeout_ms": 1, "retry": {"max_retries": 1, "retry_delay_ms": 1}}),
        ),
        connector(
            "db",
            json!({"connection_string": "sqlite:x", "max_connections": 1, "query_timeout_ms": 1, "connect_timeout_ms": 1}),
        ),
        connector(
            "cache",
            json!({"backend": "redis", "url": "redis://r", "max_entries": 1}),
        ),
        connector("mongodb", json!({"connection_string": "mongodb://m"})),
        connector(
            "kafka",
            json!({"brokers": ["a:1"], "client_id": "c", "sasl": {"mechanism": "PLAIN", "username": "u", "password": "p"}}),
        ),
        connector(
            "object_storage",
            json!({"endpoint": "https://s", "bucket": "b", "region": "r", "access_key": "a", "secret_key": "s"}),
        ),
    ];

    let mut checked = 0;
    for m in mutations(&wf) {
        if validate_workflow(&m).is_empty() {
            serde_json::from_value::<WorkflowDef>(m.clone()).unwrap_or_else(|e| panic!("{m}: {e}"));
            checked += 1;
        }
    }
    for m in mutations(&ch) {
        if validate_channel(&m).is_empty() {
            serde_json::from_value::<ChannelDef>(m.clone()).unwrap_or_else(|e| panic!("{m}: {e}"));
            checked += 1;
        }
    }
    for c in &connectors {
        for m in mutations(c) {
            if validate_connector(&m).is_empty() {
                let def: ConnectorDef =
                    serde_json::from_value(m.clone()).unwrap_or_else(|e| panic!("{m}: {e}"));
                def.typed().unwrap_or_else(|e| panic!("{m}: {e}"));
                checked += 1;
            }
        }
    }
    assert!(checked > 100, "only {checked} mutations validated clean");
}

/// Database, Redis and MongoDB URLs are parsed as their drivers parse them:
/// a host and a port from 1 to 65535 (and a Redis database number) are
/// checked at create, where they used to fail every call. The messages
/// never quote the URL (it may hold a password).
#[test]
fn server_urls_are_checked_at_create() {
    let field = |ty: &str| {
        if ty == "cache" {
            "config.url"
        } else {
            "config.connection_string"
        }
    };
    let cases: &[(&str, &str, &str)] = &[
        ("db", "postgres://", "has no host"),
        (
            "db",
            "postgres://u:secret@h:notaport/test",
            "is not a valid URL (invalid port number)",
        ),
        (
            "db",
            "mysql://root@127.0.0.1:70000/test",
            "is not a valid URL (invalid port number)",
        ),
        (
            "db",
            "mariadb://root@h:0/test",
            "has port 0 (a port is 1 to 65535)",
        ),
        ("mongodb", "mongodb://", "has no host"),
        (
            "mongodb",
            "mongodb://u:secret@h:99999/",
            "has a port that is not 1 to 65535",
        ),
        (
            "mongodb",
            "mongodb://a:1,:2/db",
            "has a host without a name",
        ),
        (
            "mongodb",
            "mongodb+srv://h:27017/",
            "a mongodb+srv:// URL names one host and no port",
        ),
    ];
    for (ty, url, message) in cases {
        let config = json!({"connection_string": url});
        let out = validate_connector(&connector(ty, config));
        check(out.clone(), &[(field(ty), message)]);
        assert!(!format!("{out:?}").contains("secret"), "{out:?}");
    }
    for (url, message) in [
        ("redis://", "has no host"),
        (
            "redis://h:99999",
            "is not a valid URL (invalid port number)",
        ),
        (
            "redis://h:6379/abc",
            "the path must be a database number (redis://host:6379/0)",
        ),
    ] {
        let out = validate_connector(&connector("cache", json!({"backend": "redis", "url": url})));
        check(out, &[("config.url", message)]);
    }
    check(
        validate_connector(&connector("kafka", json!({"brokers": "h:0"}))),
        &[("config.brokers", "broker 'h:0' must be host:port")],
    );
    // What the drivers take.
    for (ty, config) in [
        (
            "db",
            json!({"connection_string": "postgres://u:p@127.0.0.1:5432/db?sslmode=disable"}),
        ),
        (
            "db",
            json!({"connection_string": "postgres:///db?host=/var/run/postgresql"}),
        ),
        (
            "db",
            json!({"connection_string": "mariadb://root@localhost/test"}),
        ),
        ("db", json!({"connection_string": "sqlite://data.db"})),
        (
            "mongodb",
            json!({"connection_string": "mongodb://u:p@a:27017,b,[::1]:27018/db?replicaSet=r"}),
        ),
        (
            "mongodb",
            json!({"connection_string": "mongodb+srv://cluster.example.com/db"}),
        ),
        (
            "cache",
            json!({"backend": "redis", "url": "redis://:pw@h:6379/2"}),
        ),
        ("cache", json!({"backend": "redis", "url": "rediss://h"})),
    ] {
        check(validate_connector(&connector(ty, config.clone())), &[]);
    }
}

/// An HTTP URL's user alone is a key sent as Basic auth (Stripe's
/// `https://sk_live_…@api.stripe.com`), masked like a password; a
/// database's user alone is a name. A query name is read decoded
/// (`api%5Fkey` is `api_key`). Forms the URL parser takes but nothing
/// else reads alike (`https:///u:p@host`, backslashes) are refused, so the
/// masking never meets them (audit 122).
#[test]
fn url_users_encoded_names_and_odd_forms() {
    for (url, want) in [
        (
            "https://sk_live_abc123:@api.stripe.com/v1",
            Some("https://******:@api.stripe.com/v1"),
        ),
        (
            "https://ghp_Token123@api.github.com",
            Some("https://******@api.github.com"),
        ),
        (
            "HTTP://key@h.example.com/x@y",
            Some("HTTP://******@h.example.com/x@y"),
        ),
        (
            "https://u:p@h.example.com",
            Some("https://u:******@h.example.com"),
        ),
        ("postgres://sluice@db/sluice", None),
        ("redis://default@cache:6379", None),
        ("https://******@api.github.com", None),
        (
            "https://api.example.com/v1?api%5Fkey=S3cret&page=2",
            Some("https://api.example.com/v1?api%5Fkey=******&page=2"),
        ),
    ] {
        assert_eq!(mask_url_credentials(url).as_deref(), want, "{url}");
    }
    let left = json!({"config": {"url": "https://******@api.github.com/v2"}});
    assert_eq!(masked_leftovers(&left).len(), 1);
    for url in [
        "https:///svc:S3cretPw@api.example.com/v1",
        "https:svc:S3cretPw@api.example.com/v1",
        "https:\\\\svc:S3cretPw@api.example.com/v1",
        "https://api.example.com\\v1",
        // The first `:` is the scheme's, whatever follows (review 125).
        "https:u:p@api.example.com/?r=http://x",
    ] {
        let def = json!({"name": "crm", "connector_type": "http", "config": {"url": url}});
        let errors = validate_connector(&def);
        assert_eq!(errors.len(), 1, "{url}: {errors:?}");
        assert_eq!(errors[0].field, "config.url", "{url}");
        assert!(
            errors[0].message.contains("two slashes") || errors[0].message.contains("backslash"),
            "{url}: {}",
            errors[0].message
        );
    }
}

/// Query parameters whose names say credential are masked in URLs, like
/// a URL's password (session 17: `?api_key=…` was shown in clear), and a
/// mask left in one is a leftover.
#[test]
fn url_query_credentials_are_masked() {
    assert_eq!(
        mask_url_credentials("https://api.example.com/v1?api_key=QK1&page=2&access_token=T0K#frag")
            .as_deref(),
        Some("https://api.example.com/v1?api_key=******&page=2&access_token=******#frag")
    );
    assert_eq!(
        mask_url_credentials("redis://u:pw@h:6379/0?token=abc").as_deref(),
        Some("redis://u:******@h:6379/0?token=******")
    );
    assert_eq!(
        mask_url_credentials("https://api.example.com/v1?page=2&key="),
        None
    );
    assert_eq!(mask_url_credentials("not a url?token=x"), None);
    assert_eq!(
        mask_url_credentials("https://x.example.com/?api_key=******"),
        None
    );
    let mut v = json!({"config": {"url": "https://x.example.com/?api_key=K&q=1"}});
    mask_secrets(&mut v);
    assert_eq!(
        v["config"]["url"],
        "https://x.example.com/?api_key=******&q=1"
    );
    let left = json!({"config": {"url": "https://x.example.com/v2?api_key=******"}});
    let found = masked_leftovers(&left);
    assert_eq!(found.len(), 1);
    // The message does not offer the mask as a way out on create or import.
    assert!(
        found[0].message.starts_with("holds the mask '******' instead of a secret: send the secret itself (answers never carry it;"),
        "{}",
        found[0].message
    );
    // Names that only contain "key" or "token" are ordinary (a search
    // link in a result stays whole).
    for plain in [
        "https://shop.example.com/search?keyword=boots&page=2",
        "https://api.example.com/items?monkey=1&tokens_left=3",
    ] {
        assert_eq!(mask_url_credentials(plain), None, "{plain}");
    }
    // Signed and keyed URLs (SAS, presigned S3, Azure Functions).
    assert_eq!(
        mask_url_credentials(
            "https://a.example.com/f?sv=2022&sig=S1GN&X-Amz-Signature=AB12&code=FNKEY&pwd=PW&auth=AU"
        )
        .as_deref(),
        Some(
            "https://a.example.com/f?sv=2022&sig=******&X-Amz-Signature=******&code=******&pwd=******&auth=******"
        )
    );
}
