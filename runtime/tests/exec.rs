//! Executor behaviour, data-driven where it can be: a workflow definition, a
//! request and the expected outcome, run through `compile_workflow` and
//! `execute` exactly as the service will. Connector functions use in-memory
//! fakes of the runtime's traits.

use async_trait::async_trait;
use serde_json::{Value as Json, json};
use sluice_compiler::plan::{Plan, compile_workflow};
use sluice_runtime::connectors::*;
use sluice_runtime::exec::*;
use std::sync::{Arc, Mutex};

fn plan(def: Json) -> Plan {
    match compile_workflow(&def) {
        Ok(c) => c.plan,
        Err(errors) => panic!("definition rejected: {errors:?}"),
    }
}

fn wf(tasks: Json) -> Json {
    json!({"workflow_id": "w", "name": "w", "tasks": tasks})
}

fn task(id: &str, function: &str, input: Json) -> Json {
    json!({"id": id, "name": id, "function": {"name": function, "input": input}})
}

fn parse() -> Json {
    task(
        "parse",
        "parse_json",
        json!({"source": "payload", "target": "in"}),
    )
}

struct Run {
    exec: Execution,
}

impl Run {
    fn data(&self) -> Json {
        serde_json::from_slice(&self.exec.data).unwrap()
    }
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    futures_executor::block_on(f)
}

fn run_with(
    plans: &[&Plan],
    body: Json,
    headers: &[(&str, &str)],
    services: &Services,
    options: &Options,
) -> Run {
    run_with_query(plans, body, headers, &[("page", "2")], services, options)
}

fn run_with_query(
    plans: &[&Plan],
    body: Json,
    headers: &[(&str, &str)],
    query: &[(&str, &str)],
    services: &Services,
    options: &Options,
) -> Run {
    let body = body.to_string();
    let input = Input {
        body: body.as_bytes(),
        payload_from: PayloadFrom::DataMember,
        meta: Meta {
            headers,
            query,
            path: &[("id", "42")],
            method: "POST",
            channel: "orders",
            request_id: "req-1",
            extra: &[],
        },
        bucket: None,
    };
    let scope = CallScope {
        channel: "orders".into(),
        ..Default::default()
    };
    let exec = block_on(execute(
        plans.iter().copied(),
        input,
        services,
        &scope,
        options,
    ))
    .unwrap();
    Run { exec }
}

fn run(p: &Plan, payload: Json) -> Run {
    run_with(
        &[p],
        json!({ "data": payload }),
        &[],
        &Services::default(),
        &Options {
            record_tasks: true,
            ..Default::default()
        },
    )
}

#[test]
fn reference_workload_matches_expected() {
    let shared =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/bench/reference");
    let read = |f: &str| -> Json {
        serde_json::from_str(&std::fs::read_to_string(shared.join(f)).unwrap()).unwrap()
    };
    let p = plan(read("workflow.json"));
    // Its three map tasks' 12 writes go in 5 runs (docs/decisions.md):
    // totals together; pricing as discount, tax, then the other four; flags.
    let runs: Vec<Vec<usize>> = p
        .body
        .steps
        .iter()
        .filter_map(|step| match step {
            sluice_compiler::plan::Step::Task(t) => match &t.function {
                sluice_compiler::plan::FunctionPlan::Map { runs, .. } => {
                    Some(runs.iter().map(|r| r.range.len()).collect())
                }
                _ => None,
            },
            _ => None,
        })
        .collect();
    assert_eq!(runs, vec![vec![4], vec![1, 1, 4], vec![2]]);
    let body = read("request.json").to_string();
    let input = Input {
        body: body.as_bytes(),
        payload_from: PayloadFrom::DataMember,
        meta: Meta {
            headers: &[("x-request-id", "abc")],
            path: &[("order_id", "ord-7f3a9c")],
            ..Meta::default()
        },
        bucket: None,
    };
    let exec = block_on(execute(
        [&p],
        input,
        &Services::default(),
        &CallScope::default(),
        &Options::default(),
    ))
    .unwrap();
    let r = Run { exec };
    assert_eq!(r.exec.status, Status::Completed);
    assert!(r.exec.errors.is_empty(), "{:?}", r.exec.errors);
    let order = r.data()["order"].clone();
    for (key, want) in read("expected.json").as_object().unwrap() {
        let got = &order[key];
        assert!(
            holds(want, got),
            "data.order.{key}: expected {want}, got {got}"
        );
    }
    assert_eq!(order["request_id"], "abc");
    // The workflow's condition excludes requests marked x-bench-skip: 1.
    let input = Input {
        body: body.as_bytes(),
        payload_from: PayloadFrom::DataMember,
        meta: Meta {
            headers: &[("x-bench-skip", "1")],
            ..Meta::default()
        },
        bucket: None,
    };
    let skipped = block_on(execute(
        [&p],
        input,
        &Services::default(),
        &CallScope::default(),
        &Options::default(),
    ))
    .unwrap();
    assert!(skipped.matched.is_none());
}

#[test]
fn map_writes_dotted_paths_and_sees_earlier_writes() {
    let p = plan(wf(json!([
        parse(),
        task(
            "m",
            "map",
            json!({"mappings": [
                {"path": "a.b.0", "logic": {"var": "data.in.x"}},
                {"path": "data.c", "logic": {"*": [{"var": "data.a.b.0"}, 2]}},
                {"path": "temp_data.t", "logic": 5},
                {"path": "d.#1", "logic": {"var": "temp_data.t"}},
                {"path": "meta", "logic": {"cat": [{"var": "metadata.method"}, " ", {"var": "metadata.query.page"}, " ", {"var": "metadata.request_id"}]}}
            ]})
        )
    ])));
    let r = run(&p, json!({"x": 21}));
    assert_eq!(
        r.data(),
        json!({"in": {"x": 21}, "a": {"b": [21]}, "c": 42, "d": {"1": 5}, "meta": "POST 2 req-1"})
    );
}

#[test]
fn filter_halt_returns_data_so_far_and_skip_continues() {
    let halt = plan(wf(json!([
        parse(),
        task(
            "f",
            "filter",
            json!({"condition": {"==": [{"var": "data.in.ok"}, true]}})
        ),
        task(
            "after",
            "map",
            json!({"mappings": [{"path": "ran", "logic": true}]})
        )
    ])));
    let r = run(&halt, json!({"ok": false}));
    assert_eq!(r.exec.status, Status::Filtered);
    assert_eq!(r.data(), json!({"in": {"ok": false}}));
    let r = run(&halt, json!({"ok": true}));
    assert_eq!(r.exec.status, Status::Completed);
    assert_eq!(r.data()["ran"], true);

    let skip = plan(wf(json!([
        task(
            "f",
            "filter",
            json!({"condition": false, "on_reject": "skip"})
        ),
        task(
            "after",
            "map",
            json!({"mappings": [{"path": "ran", "logic": true}]})
        )
    ])));
    let r = run(&skip, json!({}));
    assert_eq!(r.data(), json!({"ran": true}));
    // The rejecting filter stood aside: skipped, and its `terminal` does not
    // end the workflow (a task skipped by its condition does not either).
    let statuses: Vec<_> = r
        .exec
        .tasks
        .iter()
        .map(|t| (t.id.as_str(), t.status))
        .collect();
    assert_eq!(
        statuses,
        vec![("f", TaskStatus::Skipped), ("after", TaskStatus::Executed)]
    );
    let mut terminal = wf(json!([
        task(
            "f",
            "filter",
            json!({"condition": false, "on_reject": "skip"})
        ),
        task(
            "after",
            "map",
            json!({"mappings": [{"path": "ran", "logic": true}]})
        )
    ]));
    terminal["tasks"][0]["terminal"] = json!(true);
    assert_eq!(
        run(&plan(terminal.clone()), json!({})).data(),
        json!({"ran": true})
    );
    // A filter that passes is executed, and a terminal one ends the run.
    terminal["tasks"][0]["function"]["input"]["condition"] = json!(true);
    let r = run(&plan(terminal), json!({}));
    assert_eq!(r.exec.status, Status::Completed);
    assert_eq!(r.data(), json!({}));
}

#[test]
fn validation_collects_messages_and_never_mutates() {
    let p = plan(wf(json!([
        parse(),
        task(
            "v",
            "validation",
            json!({"rules": [
                {"logic": {"!!": [{"var": "data.in.email"}]}, "message": "email is required"},
                {"logic": {">": [{"var": "data.in.n"}, 0]}, "message": "n must be positive"},
                {"logic": 1, "message": "only exactly true passes"}
            ]})
        ),
        task(
            "after",
            "map",
            json!({"mappings": [{"path": "ran", "logic": true}]})
        )
    ])));
    let r = run(&p, json!({"n": 3}));
    assert_eq!(r.exec.status, Status::Completed);
    let messages: Vec<_> = r
        .exec
        .errors
        .iter()
        .map(|e| (e.code, e.task_id.as_str(), e.message.as_str()))
        .collect();
    assert_eq!(
        messages,
        vec![
            ("VALIDATION_ERROR", "v", "email is required"),
            ("VALIDATION_ERROR", "v", "only exactly true passes")
        ]
    );
    assert_eq!(r.data(), json!({"in": {"n": 3}, "ran": true}));
}

#[test]
fn validation_halt_on_failure_stops_with_every_message() {
    let mut v = task(
        "v",
        "validate",
        json!({"rules": [
            {"logic": false, "message": "a"}, {"logic": false, "message": "b"}
        ]}),
    );
    v["halt_on"] = json!("failure");
    let p = plan(wf(json!([
        v,
        task(
            "after",
            "map",
            json!({"mappings": [{"path": "ran", "logic": true}]})
        )
    ])));
    let r = run(&p, json!({}));
    let Status::Failed(f) = &r.exec.status else {
        panic!("{:?}", r.exec.status)
    };
    assert_eq!(f.kind, FailureKind::Validation);
    assert_eq!(f.messages, vec!["a", "b"]);
    assert_eq!((f.task_id.as_str(), f.field.as_str()), ("v", "tasks[0]"));
    assert_eq!(r.data(), json!({}));
}

#[test]
fn a_failing_task_halts_by_default_and_is_collected_under_continue_on_error() {
    let tasks = json!([
        task(
            "bad",
            "parse_json",
            json!({"source": "payload.text", "target": "x"})
        ),
        task(
            "after",
            "map",
            json!({"mappings": [{"path": "ran", "logic": true}]})
        )
    ]);
    let p = plan(wf(tasks.clone()));
    let r = run(&p, json!({"text": "{not json"}));
    let Status::Failed(f) = &r.exec.status else {
        panic!()
    };
    assert_eq!(
        (f.kind, f.task_id.as_str(), f.field.as_str()),
        (FailureKind::Task, "bad", "tasks[0]")
    );
    assert!(
        f.message
            .starts_with("parse_json: source 'payload.text' is not valid JSON"),
        "{}",
        f.message
    );

    let mut def = wf(tasks);
    def["continue_on_error"] = json!(true);
    let r = run(&plan(def), json!({"text": "{not json"}));
    assert_eq!(r.exec.status, Status::Completed);
    assert_eq!(r.exec.errors.len(), 1);
    assert_eq!(
        (r.exec.errors[0].code, r.exec.errors[0].task_id.as_str()),
        ("TASK_ERROR", "bad")
    );
    assert_eq!(r.data(), json!({"ran": true}));
}

/// A task's explicit `continue_on_error: false` halts under a tolerant
/// workflow; a group condition that fails to evaluate is collected like a
/// task's under the workflow's `continue_on_error` (its tasks skipped), and
/// halts without it.
#[test]
fn continue_on_error_reaches_group_conditions_and_a_task_can_opt_out() {
    let after = task(
        "after",
        "map",
        json!({"mappings": [{"path": "ran", "logic": true}]}),
    );
    let mut strict = task(
        "strict",
        "map",
        json!({"mappings": [{"path": "x", "logic": {"throw": "boom"}}]}),
    );
    strict["continue_on_error"] = json!(false);
    let mut def = wf(json!([strict, after.clone()]));
    def["continue_on_error"] = json!(true);
    let r = run(&plan(def), json!({}));
    assert!(
        matches!(r.exec.status, Status::Failed(_)),
        "{:?}",
        r.exec.status
    );

    let group = json!({"id": "g", "name": "g", "condition": {"<": [{"var": "data.a"}, "abc"]},
        "tasks": [task("inner", "map", json!({"mappings": [{"path": "inner", "logic": 1}]}))]});
    let mut def = wf(json!([group.clone(), after.clone()]));
    def["continue_on_error"] = json!(true);
    let r = run(&plan(def), json!({"a": 1}));
    assert_eq!(r.exec.status, Status::Completed);
    assert_eq!(
        (r.exec.errors[0].code, r.exec.errors[0].task_id.as_str()),
        ("TASK_ERROR", "g")
    );
    assert!(
        r.exec.errors[0]
            .message
            .starts_with("group condition failed")
    );
    assert_eq!(r.data(), json!({"ran": true}));

    let r = run(&plan(wf(json!([group, after]))), json!({"a": 1}));
    let Status::Failed(f) = &r.exec.status else {
        panic!("{:?}", r.exec.status)
    };
    assert_eq!((f.task_id.as_str(), f.field.as_str()), ("g", "tasks[0]"));
}

#[test]
fn halt_on_failure_wins_over_continue_on_error() {
    let mut bad = task(
        "bad",
        "map",
        json!({"mappings": [{"path": "x", "logic": {"throw": "boom"}}]}),
    );
    bad["continue_on_error"] = json!(true);
    let p = plan(wf(json!([
        bad.clone(),
        task(
            "after",
            "map",
            json!({"mappings": [{"path": "ran", "logic": true}]})
        )
    ])));
    let r = run(&p, json!({}));
    assert_eq!(
        r.exec.status,
        Status::Completed,
        "task-level continue_on_error tolerates"
    );
    assert_eq!(r.exec.errors.len(), 1);
    bad["halt_on"] = json!("failure");
    let p = plan(wf(json!([
        bad,
        task(
            "after",
            "map",
            json!({"mappings": [{"path": "ran", "logic": true}]})
        )
    ])));
    assert!(matches!(run(&p, json!({})).exec.status, Status::Failed(_)));
}

#[test]
fn data_function_input_problems_show_at_execution() {
    let compiled =
        compile_workflow(&wf(json!([task("m", "map", json!({"mappings": "nope"}))]))).unwrap();
    assert_eq!(compiled.warnings.len(), 1);
    assert_eq!(
        compiled.warnings[0].field,
        "tasks[0].function.input.mappings"
    );
    let r = run(&compiled.plan, json!({}));
    let Status::Failed(f) = &r.exec.status else {
        panic!()
    };
    assert!(
        f.message.contains("expected array, got string"),
        "{}",
        f.message
    );
    // Every typed input is checked, publish_json's `pretty` flag included.
    for (function, input, field, message) in [
        (
            "publish_json",
            json!({"source": "x", "target": "y", "pretty": "yes"}),
            "pretty",
            "expected boolean, got string",
        ),
        (
            "publish_json",
            json!({"source": "x", "target": "y", "pretty": null}),
            "pretty",
            "expected boolean, got null",
        ),
        (
            "publish_xml",
            json!({"source": "x", "target": "y", "root_element": 5}),
            "root_element",
            "expected string, got integer",
        ),
        (
            "publish_xml",
            json!({"source": "x", "target": "y", "root_element": ""}),
            "root_element",
            "must not be empty",
        ),
        (
            "publish_xml",
            json!({"source": "x", "target": "y", "root_element": "1 bad"}),
            "root_element",
            "'1 bad' is not a valid XML element name",
        ),
    ] {
        let compiled = compile_workflow(&wf(json!([task("t", function, input)]))).unwrap();
        assert_eq!(compiled.warnings.len(), 1, "{function}");
        assert_eq!(
            compiled.warnings[0].field,
            format!("tasks[0].function.input.{field}")
        );
        let r = run(&compiled.plan, json!({}));
        let Status::Failed(f) = &r.exec.status else {
            panic!("{function}: {:?}", r.exec.status)
        };
        assert!(f.message.contains(message), "{}", f.message);
    }
}

/// Every input problem of a data function is a warning, not only the first
/// (session 18: `parse_json {}` warned about `source` alone); the run fails
/// on the first.
#[test]
fn every_input_problem_of_a_data_function_is_a_warning() {
    for (function, input, fields) in [
        ("parse_json", json!({}), vec!["source", "target"]),
        (
            "map",
            json!({"mappings": [{"path": "a"}, {"logic": 1}, 5, {"path": "a..b", "logic": 1}]}),
            vec![
                "mappings[0].logic",
                "mappings[1].path",
                "mappings[2]",
                "mappings[3].path",
            ],
        ),
        (
            "validation",
            json!({"rules": [{"logic": true}, {"message": "x"}]}),
            vec!["rules[0].message", "rules[1].logic"],
        ),
        (
            "filter",
            json!({"on_reject": "drop"}),
            vec!["condition", "on_reject"],
        ),
        (
            "log",
            json!({"level": "loud", "fields": {"a": {"nope": 1}}}),
            vec!["message", "level", "fields.a"],
        ),
        (
            "publish_xml",
            json!({"root_element": ""}),
            vec!["source", "target", "root_element"],
        ),
    ] {
        let compiled = compile_workflow(&wf(json!([task("t", function, input)]))).unwrap();
        let got: Vec<&str> = compiled
            .warnings
            .iter()
            .map(|w| w.field.trim_start_matches("tasks[0].function.input."))
            .collect();
        assert_eq!(got, fields, "{function}");
        let r = run(&compiled.plan, json!({}));
        let Status::Failed(f) = &r.exec.status else {
            panic!("{function}: {:?}", r.exec.status)
        };
        assert!(f.message.contains(fields[0]), "{function}: {}", f.message);
    }
}

#[test]
fn conditions_skip_tasks_and_groups_evaluate_once() {
    let p = plan(wf(json!([
        parse(),
        {"id": "skipped", "name": "s", "condition": {"==": [{"var": "data.in.kind"}, "b"]},
         "function": {"name": "map", "input": {"mappings": [{"path": "s", "logic": true}]}}},
        {"id": "g", "condition": {"==": [{"var": "data.in.kind"}, "a"]}, "tasks": [
            task("g1", "map", json!({"mappings": [{"path": "in.kind", "logic": "changed"}]})),
            task("g2", "map", json!({"mappings": [{"path": "g2", "logic": {"var": "data.in.kind"}}]}))
        ]},
        {"id": "h", "condition": {"==": [{"var": "data.in.kind"}, "a"]}, "tasks": [
            task("h1", "map", json!({"mappings": [{"path": "h1", "logic": true}]}))
        ]}
    ])));
    let r = run(&p, json!({"kind": "a"}));
    // g's condition was evaluated once on entry: g2 still ran after g1
    // changed the field; h's condition saw the change and skipped h.
    assert_eq!(
        r.data(),
        json!({"in": {"kind": "changed"}, "g2": "changed"})
    );
    let statuses: Vec<_> = r
        .exec
        .tasks
        .iter()
        .map(|t| (t.id.as_str(), t.status))
        .collect();
    assert_eq!(
        statuses,
        vec![
            ("parse", TaskStatus::Executed),
            ("skipped", TaskStatus::Skipped),
            ("g1", TaskStatus::Executed),
            ("g2", TaskStatus::Executed),
            ("h1", TaskStatus::Skipped)
        ]
    );
}

#[test]
fn terminal_steps_end_the_workflow() {
    let mut t = task("t", "map", json!({"mappings": [{"path": "a", "logic": 1}]}));
    t["terminal"] = json!(true);
    let p = plan(wf(json!([
        t,
        task(
            "after",
            "map",
            json!({"mappings": [{"path": "b", "logic": 1}]})
        )
    ])));
    assert_eq!(run(&p, json!({})).data(), json!({"a": 1}));

    let p = plan(wf(json!([
        {"id": "g", "terminal": true, "tasks": [task("g1", "map", json!({"mappings": [{"path": "a", "logic": 1}]}))]},
        task("after", "map", json!({"mappings": [{"path": "b", "logic": 1}]}))
    ])));
    assert_eq!(run(&p, json!({})).data(), json!({"a": 1}));
}

#[test]
fn loops_repeat_with_a_counter() {
    let mut def = wf(json!([task(
        "acc",
        "map",
        json!({"mappings": [
            {"path": "sum", "logic": {"+": [{"var": "data.sum"}, {"var": "temp_data.i"}]}}
        ]})
    )]));
    def["loop"] = json!({"max": 4, "init": 10, "increment": 5, "counter": "temp_data.i"});
    // 10 + 15 + 20 + 25
    assert_eq!(run(&plan(def), json!({})).data(), json!({"sum": 70}));

    let p = plan(wf(json!([
        {"id": "g", "loop": {"max": 3}, "tasks": [
            task("push", "map", json!({"mappings": [{"path": "items.#x", "logic": {"var": "temp_data.loop_index"}}]})),
            task("count", "map", json!({"mappings": [{"path": "n", "logic": {"+": [{"var": "data.n"}, 1]}}]}))
        ]}
    ])));
    assert_eq!(
        run(&p, json!({})).data(),
        json!({"items": {"x": 2}, "n": 3})
    );
}

#[test]
fn publish_and_parse_round_trip_json_and_xml() {
    let p = plan(wf(json!([
        parse(),
        task(
            "pj",
            "publish_json",
            json!({"source": "in", "target": "json_text"})
        ),
        task(
            "pp",
            "publish_json",
            json!({"source": "in", "target": "pretty", "pretty": true})
        ),
        task(
            "px",
            "publish_xml",
            json!({"source": "in", "target": "xml_text", "root_element": "order"})
        ),
        task(
            "back",
            "parse_xml",
            json!({"source": "data.xml_text", "target": "from_xml"})
        ),
        task(
            "again",
            "parse_json",
            json!({"source": "data.json_text", "target": "from_json"})
        )
    ])));
    let r = run(&p, json!({"id": "o-1", "qty": 2}));
    let d = r.data();
    assert_eq!(d["json_text"], r#"{"id":"o-1","qty":2}"#);
    assert_eq!(d["pretty"], "{\n  \"id\": \"o-1\",\n  \"qty\": 2\n}");
    assert_eq!(d["xml_text"], "<order><id>o-1</id><qty>2</qty></order>");
    assert_eq!(d["from_xml"], json!({"order": {"id": "o-1", "qty": "2"}}));
    assert_eq!(d["from_json"], json!({"id": "o-1", "qty": 2}));
}

#[test]
fn selection_by_priority_condition_and_rollout() {
    let mut high = wf(json!([task(
        "m",
        "map",
        json!({"mappings": [{"path": "by", "logic": "high"}]})
    )]));
    high["workflow_id"] = json!("high");
    high["priority"] = json!(10);
    high["condition"] = json!({"==": [{"var": "metadata.headers.x-tier"}, "gold"]});
    let mut low = wf(json!([task(
        "m",
        "map",
        json!({"mappings": [{"path": "by", "logic": "low"}]})
    )]));
    low["workflow_id"] = json!("low");
    let (high, low) = (plan(high), plan(low));
    let options = Options::default();
    let gold = run_with(
        &[&high, &low],
        json!({"data": {}}),
        &[("x-tier", "gold")],
        &Services::default(),
        &options,
    );
    assert_eq!(gold.data()["by"], "high");
    assert_eq!(&*gold.exec.matched.as_ref().unwrap().workflow_id, "high");
    let plain = run_with(
        &[&high, &low],
        json!({"data": {}}),
        &[],
        &Services::default(),
        &options,
    );
    assert_eq!(plain.data()["by"], "low");

    // A workflow whose rollout range excludes the bucket is passed over.
    let mut canary = wf(json!([task(
        "m",
        "map",
        json!({"mappings": [{"path": "by", "logic": "canary"}]})
    )]));
    canary["rollout"] = json!({"bucket_start": 0, "bucket_end": 10});
    let canary = plan(canary);
    let body = json!({"data": {}}).to_string();
    let scope = CallScope::default();
    let pick = |bucket| {
        let input = Input {
            body: body.as_bytes(),
            payload_from: PayloadFrom::DataMember,
            meta: Meta::default(),
            bucket,
        };
        let e = block_on(execute(
            [&canary, &low],
            input,
            &Services::default(),
            &scope,
            &options,
        ))
        .unwrap();
        serde_json::from_slice::<Json>(&e.data).unwrap()["by"].clone()
    };
    assert_eq!(pick(Some(5)), "canary");
    assert_eq!(pick(Some(50)), "low");
    assert_eq!(pick(None), "canary");

    // No match: nothing runs.
    let only_gold = run_with(
        &[&high],
        json!({"data": {}}),
        &[],
        &Services::default(),
        &options,
    );
    assert!(only_gold.exec.matched.is_none());
}

/// A workflow that starts with `parse_json` has its condition see what that
/// task parses; one that does not (or whose first parse is conditional)
/// sees `data` empty.
#[test]
fn conditions_see_data_parsed_by_a_leading_parse_task() {
    let by = |name: &str| {
        task(
            "m",
            "map",
            json!({"mappings": [{"path": "by", "logic": name}]}),
        )
    };
    let vip = json!({"==": [{"var": "data.in.kind"}, "vip"]});
    let mut parsed = wf(json!([parse(), by("parsed")]));
    parsed["workflow_id"] = json!("parsed");
    parsed["priority"] = json!(10);
    parsed["condition"] = vip.clone();
    // The same condition without a leading parse: `data` is empty.
    let mut unparsed = wf(json!([by("unparsed"), parse()]));
    unparsed["workflow_id"] = json!("unparsed");
    unparsed["priority"] = json!(5);
    unparsed["condition"] = json!({"!": [{"var": "data.in"}]});
    // A leading parse that has its own condition may not run: not applied.
    let mut conditional = wf(json!([
        {"id": "parse", "name": "parse", "condition": {"==": [{"var": "metadata.method"}, "POST"]},
         "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}},
        by("conditional")
    ]));
    conditional["workflow_id"] = json!("conditional");
    conditional["priority"] = json!(7);
    conditional["condition"] = vip.clone();
    let mut low = wf(json!([by("low")]));
    low["workflow_id"] = json!("low");
    let plans = [parsed, conditional, unparsed, low].map(plan);
    let refs: Vec<&Plan> = plans.iter().collect();
    let go = |payload: Json| {
        let r = run_with(
            &refs,
            json!({ "data": payload }),
            &[],
            &Services::default(),
            &Options::default(),
        );
        r.data()["by"].clone()
    };
    assert_eq!(go(json!({"kind": "vip"})), "parsed");
    // Not vip: the parsed one does not match; the next sees no data.in.
    assert_eq!(go(json!({"kind": "plain"})), "unparsed");
    // The parsed workflow ran its own parse too: its answer holds `in`.
    let r = run_with(
        &refs,
        json!({"data": {"kind": "vip"}}),
        &[],
        &Services::default(),
        &Options::default(),
    );
    assert_eq!(r.data()["in"], json!({"kind": "vip"}));
    assert!(plans[0].condition_after_parse);
    // The conditional parse is not applied first: its workflow sees no data.
    assert!(!plans[1].condition_after_parse);
    let r = run_with(
        &[&plans[1], &plans[3]],
        json!({"data": {"kind": "vip"}}),
        &[],
        &Services::default(),
        &Options::default(),
    );
    assert_eq!(r.data()["by"], "low");
    // A condition that reads only metadata needs no parse first.
    let mut meta_only = wf(json!([parse()]));
    meta_only["condition"] = json!({"==": [{"var": "metadata.method"}, "POST"]});
    assert!(!plan(meta_only).condition_after_parse);
    // A parse_xml of a text payload works the same way.
    let mut xml = wf(json!([
        task(
            "px",
            "parse_xml",
            json!({"source": "payload", "target": "doc"})
        ),
        by("xml")
    ]));
    xml["condition"] = json!({"==": [{"var": "data.doc.order.kind"}, "vip"]});
    let xml = plan(xml);
    let r = run_with(
        &[&xml],
        json!({"data": "<order><kind>vip</kind></order>"}),
        &[],
        &Services::default(),
        &Options::default(),
    );
    assert_eq!(r.data()["by"], "xml");
}

#[test]
fn bad_bodies_are_input_errors() {
    let p = plan(wf(json!([parse()])));
    let scope = CallScope::default();
    let go = |body: &[u8]| {
        let input = Input {
            body,
            payload_from: PayloadFrom::DataMember,
            meta: Meta::default(),
            bucket: None,
        };
        block_on(execute(
            [&p],
            input,
            &Services::default(),
            &scope,
            &Options::default(),
        ))
    };
    assert!(matches!(go(b"{nope"), Err(InputError::NotJson(_))));
    assert!(matches!(go(b"[1]"), Err(InputError::NotObject)));
    // An empty body (a GET) is a null payload.
    let e = go(b"").unwrap();
    assert_eq!(
        serde_json::from_slice::<Json>(&e.data).unwrap(),
        json!({"in": null})
    );
}

/// An HTTP fake that records requests and answers from a script.
struct FakeHttp {
    seen: Mutex<Vec<HttpRequest>>,
    answer: Result<Json, ConnectorError>,
}

/// Runs `p` on `{"data": payload}` with `services`; the run must fail.
fn failure(p: &Plan, payload: Json, services: &Services) -> Failure {
    let r = run_with(
        &[p],
        json!({ "data": payload }),
        &[],
        services,
        &Options::default(),
    );
    match r.exec.status {
        Status::Failed(f) => f,
        other => panic!("expected a failure, got {other:?}"),
    }
}

/// An HTTP fake answering `answer`, and services that hold it.
fn fake_http(answer: Result<Json, ConnectorError>) -> (Arc<FakeHttp>, Services) {
    let http = Arc::new(FakeHttp {
        seen: Mutex::new(Vec::new()),
        answer,
    });
    let services = Services {
        http: Some(http.clone()),
        ..Default::default()
    };
    (http, services)
}

#[async_trait]
impl HttpClient for FakeHttp {
    async fn call(&self, scope: &CallScope, req: HttpRequest) -> Result<Json, ConnectorError> {
        assert_eq!(scope.channel, "orders");
        self.seen.lock().unwrap().push(req);
        self.answer.clone()
    }
}

#[test]
fn connector_calls_go_through_the_traits() {
    let p = plan(wf(json!([
        parse(),
        task(
            "call",
            "http_call",
            json!({
                "connector": "api", "method": "POST",
                "path_logic": {"cat": ["/customers/", {"var": "data.in.id"}]},
                "body_logic": {"var": "data.in"},
                "headers": {"x-a": "1"},
                "response_path": "customer"
            })
        ),
        task(
            "after",
            "map",
            json!({"mappings": [{"path": "name", "logic": {"var": "data.customer.name"}}]})
        )
    ])));
    let (http, services) = fake_http(Ok(json!({"name": "Ada"})));
    let r = run_with(
        &[&p],
        json!({"data": {"id": 7}}),
        &[],
        &services,
        &Options::default(),
    );
    assert_eq!(r.exec.status, Status::Completed);
    assert_eq!(r.data()["name"], "Ada");
    let seen = http.seen.lock().unwrap();
    assert_eq!(seen[0].path.as_deref(), Some("/customers/7"));
    assert_eq!(seen[0].body, Some(json!({"id": 7})));
    assert_eq!(seen[0].headers, vec![("x-a".to_string(), "1".to_string())]);
    assert_eq!(seen[0].timeout_ms, 30_000);
}

/// A rule of a connector's input that fails to evaluate names its field,
/// so a task with both `path_logic` and `body_logic` says which one.
#[test]
fn failing_input_rules_name_their_field() {
    let nan = json!({"/": [1, 0]});
    let cases = [
        (
            "http_call",
            json!({"connector": "api", "path_logic": "/x", "body_logic": nan}),
            "http_call: body_logic: ",
        ),
        (
            "http_call",
            json!({"connector": "api", "path_logic": nan}),
            "http_call: path_logic: ",
        ),
        ("filter", json!({"condition": nan}), "filter: condition: "),
        ("log", json!({"message": nan}), "log: message: "),
    ];
    // A path that is not text is refused before anything is sent.
    let p = plan(wf(json!([task(
        "t",
        "http_call",
        json!({"connector": "api", "path_logic": {"var": "data"}})
    )])));
    let (http, services) = fake_http(Ok(Json::Null));
    let f = failure(&p, json!({"a": 1}), &services);
    assert_eq!(
        f.message,
        "http_call: path_logic evaluated to an object; expected a string"
    );
    assert!(http.seen.lock().unwrap().is_empty());
    for (function, input, prefix) in cases {
        let p = plan(wf(json!([task("t", function, input)])));
        let (http, services) = fake_http(Ok(Json::Null));
        let f = failure(&p, json!({}), &services);
        assert!(f.message.starts_with(prefix), "{function}: {}", f.message);
        assert!(f.message.contains("NaN"), "{}", f.message);
        assert!(http.seen.lock().unwrap().is_empty(), "nothing was sent");
    }
}

#[test]
fn connector_failures_are_classified() {
    let p = plan(wf(json!([task(
        "call",
        "http_call",
        json!({"connector": "api"})
    )])));
    for (kind, want) in [
        (ConnectorErrorKind::Timeout, FailureKind::Timeout),
        (ConnectorErrorKind::CircuitOpen, FailureKind::CircuitOpen),
        (ConnectorErrorKind::Upstream, FailureKind::Upstream),
        (ConnectorErrorKind::Other, FailureKind::Task),
    ] {
        let (_, services) = fake_http(Err(ConnectorError::new(kind, "nope")));
        let f = failure(&p, json!({}), &services);
        assert_eq!(f.kind, want);
        assert_eq!(f.message, "http_call: nope");
    }
    // Without a configured client the task fails with a clear message.
    let f = failure(&p, json!({}), &Services::default());
    assert!(
        f.message.contains("no HTTP client is configured"),
        "{}",
        f.message
    );
}

struct FakeSql;

#[async_trait]
impl SqlClient for FakeSql {
    async fn read(&self, _: &CallScope, req: SqlRequest) -> Result<Vec<Json>, ConnectorError> {
        Ok(vec![json!({"query": req.query, "params": req.params})])
    }
    async fn write(&self, _: &CallScope, req: SqlRequest) -> Result<u64, ConnectorError> {
        Ok(req.params.len() as u64)
    }
}

#[test]
fn sql_params_are_jsonlogic_and_outputs_follow_the_path_rules() {
    let p = plan(wf(json!([
        parse(),
        task(
            "r",
            "db_read",
            json!({"connector": "db", "query": "select ?", "params": [{"var": "data.in.id"}, "lit"], "output": "rows"})
        ),
        task(
            "w",
            "db_write",
            json!({"connector": "db", "query": "update", "params": [1, 2, 3], "output": "temp_data.w"})
        ),
        task(
            "copy",
            "map",
            json!({"mappings": [{"path": "written", "logic": {"var": "temp_data.w.rows_affected"}}]})
        )
    ])));
    let services = Services {
        sql: Some(Arc::new(FakeSql)),
        ..Default::default()
    };
    let r = run_with(
        &[&p],
        json!({"data": {"id": 5}}),
        &[],
        &services,
        &Options::default(),
    );
    assert_eq!(
        r.data()["rows"],
        json!([{"query": "select ?", "params": [5, "lit"]}])
    );
    assert_eq!(r.data()["written"], 3);
}

#[test]
fn the_execute_future_is_send() {
    fn assert_send<T: Send>(_: &T) {}
    let p = plan(wf(json!([parse()])));
    let services = Services::default();
    let scope = CallScope::default();
    let options = Options::default();
    let input = Input {
        body: b"{}",
        payload_from: PayloadFrom::DataMember,
        meta: Meta::default(),
        bucket: None,
    };
    let fut = execute([&p], input, &services, &scope, &options);
    assert_send(&fut);
    block_on(fut).unwrap();
}

/// `got` holds what `want` lists: objects by subset, numbers to 1e-6.
fn holds(want: &serde_json::Value, got: &serde_json::Value) -> bool {
    match (want, got) {
        (serde_json::Value::Object(w), serde_json::Value::Object(g)) => w
            .iter()
            .all(|(k, v)| g.get(k).is_some_and(|gv| holds(v, gv))),
        (serde_json::Value::Number(w), serde_json::Value::Number(g)) => {
            (w.as_f64().unwrap() - g.as_f64().unwrap()).abs() < 1e-6
        }
        _ => want == got,
    }
}

#[test]
fn a_passed_deadline_stops_cpu_bound_work_and_connector_calls() {
    let past = Some(std::time::Instant::now() - std::time::Duration::from_millis(1));
    // A long loop of data steps: the clock is read every few steps, so the
    // execution stops long before the loop's 10,000 passes.
    let mut def = wf(json!([task(
        "count",
        "map",
        json!({"mappings": [{"path": "n", "logic": {"+": [{"var": "data.n"}, 1]}}]})
    )]));
    def["loop"] = json!({"max": 10000});
    let r = run_with(
        &[&plan(def)],
        json!({"data": {}}),
        &[],
        &Services::default(),
        &Options {
            deadline: past,
            ..Default::default()
        },
    );
    let Status::Failed(f) = &r.exec.status else {
        panic!("expected a timeout, got {:?}", r.exec.status)
    };
    assert_eq!(f.kind, FailureKind::Timeout);
    assert!(r.data()["n"].as_i64().unwrap_or(0) < 100, "{}", r.data());

    // A connector call is never started past the deadline, even as the
    // first step.
    let (http, services) = fake_http(Ok(json!({})));
    let p = plan(wf(json!([task(
        "call",
        "http_call",
        json!({"connector": "api"})
    )])));
    let r = run_with(
        &[&p],
        json!({"data": {}}),
        &[],
        &services,
        &Options {
            deadline: past,
            ..Default::default()
        },
    );
    let Status::Failed(f) = &r.exec.status else {
        panic!("expected a timeout, got {:?}", r.exec.status)
    };
    assert_eq!(f.kind, FailureKind::Timeout);
    assert_eq!(f.task_id, "call");
    assert!(http.seen.lock().unwrap().is_empty());

    // Without a deadline the same loop runs to the end.
    let mut def = wf(json!([task(
        "count",
        "map",
        json!({"mappings": [{"path": "n", "logic": {"+": [{"var": "data.n"}, 1]}}]})
    )]));
    def["loop"] = json!({"max": 100});
    assert_eq!(run(&plan(def), json!({})).data(), json!({"n": 100}));
}

#[test]
fn pooled_arenas_carry_nothing_from_one_execution_to_the_next() {
    // One thread, so every run after the first reuses a pooled arena: small
    // and large payloads alternate (a large one grows its arena past what
    // the pool keeps), and each answer holds exactly its own input.
    let p = plan(json!({
        "workflow_id": "echo", "name": "echo",
        "tasks": [
            {"id": "parse", "name": "parse", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}},
            {"id": "len", "name": "len", "function": {"name": "map", "input": {"mappings": [
                {"path": "n", "logic": {"var": "data.in.n"}}
            ]}}}
        ]
    }));
    for i in 0..40u64 {
        let filler = "x".repeat(if i % 10 == 9 {
            400_000
        } else {
            (i as usize) * 7
        });
        let r = run(&p, json!({"n": i, "filler": filler}));
        assert_eq!(r.exec.status, Status::Completed);
        let data = r.data();
        assert_eq!(data["n"], i);
        assert_eq!(data["in"]["filler"].as_str().unwrap().len(), filler.len());
    }
}

#[test]
fn mappings_run_together_write_like_one_by_one() {
    // 0..3 share a run (their rules read only `data.in`); 3 reads what 0
    // wrote and starts the next one. Key order is that of one-by-one writes.
    let p = plan(wf(json!([
        parse(),
        task(
            "m",
            "map",
            json!({"mappings": [
                {"path": "x.b", "logic": {"var": "data.in.v"}},
                {"path": "y", "logic": {"+": [{"var": "data.in.v"}, 1]}},
                {"path": "x.a", "logic": {"cat": ["k", {"var": "data.in.v"}]}},
                {"path": "in.v", "logic": {"*": [{"var": "data.x.b"}, 10]}}
            ]})
        )
    ])));
    let r = run(&p, json!({"v": 2}));
    assert_eq!(
        r.data().to_string(),
        json!({"in": {"v": 20}, "x": {"b": 2, "a": "k2"}, "y": 3}).to_string()
    );

    // A rule failing inside a run: the mappings before it are written, the
    // ones after are not, and the error names the failing mapping.
    let mut failing = wf(json!([
        parse(),
        task(
            "m",
            "map",
            json!({"mappings": [
                {"path": "a", "logic": 1},
                {"path": "b", "logic": {"throw": "boom"}},
                {"path": "c", "logic": 3}
            ]})
        )
    ]));
    failing["tasks"][1]["continue_on_error"] = json!(true);
    let r = run(&plan(failing), json!({}));
    assert_eq!(r.data(), json!({"in": {}, "a": 1}));
    assert_eq!(r.exec.errors.len(), 1);
    assert!(
        r.exec.errors[0].message.contains("mappings[1]"),
        "{:?}",
        r.exec.errors[0]
    );

    // An array where a run writes a key: the writes go one by one and the
    // error is the one-write error.
    let mut blocked = wf(json!([
        parse(),
        task(
            "m",
            "map",
            json!({"mappings": [
                {"path": "n", "logic": 1},
                {"path": "in.list.k", "logic": 2}
            ]})
        )
    ]));
    blocked["tasks"][1]["continue_on_error"] = json!(true);
    let r = run(&plan(blocked), json!({"list": [1]}));
    assert_eq!(r.exec.errors.len(), 1);
    assert_eq!(r.data(), json!({"in": {"list": [1]}, "n": 1}));
    assert!(
        r.exec.errors[0]
            .message
            .contains("cannot write 'in.list.k'"),
        "{:?}",
        r.exec.errors[0]
    );
}

/// A `log` task's fields reach the log masked like API answers: a secret-named
/// key at any depth, a secret-looking header, a URL password.
#[test]
fn log_fields_are_masked() {
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .finish();
    let p = plan(wf(json!([task(
        "l",
        "log",
        json!({"message": "visible", "level": "warn", "fields": {
            "token": {"var": "metadata.headers.authorization"},
            "hdrs": {"var": "metadata.headers"},
            "nested": {"password": "pw-123", "db": "postgres://u:hunter2@h/d"},
            "plain": "kept",
            // Under names that do not look secret: masked by value.
            "tok": {"var": "metadata.headers.authorization"},
            "cred": {"substr": [{"var": "metadata.headers.authorization"}, 7]},
            "cookie_copy": {"cat": ["c=", {"var": "metadata.headers.cookie"}]}
        }})
    )])));
    // The message itself holds a credential.
    let m = plan(wf(json!([task(
        "l",
        "log",
        json!({"message": {"cat": ["auth is ", {"var": "metadata.headers.authorization"}]}, "level": "warn"})
    )])));
    let q = plan(wf(json!([task(
        "l",
        "log",
        json!({"message": {"cat": ["sig is ", {"var": "metadata.query.sig"}]}, "level": "warn",
               "fields": {"q": {"var": "metadata.query.api_key"}}})
    )])));
    tracing::subscriber::with_default(subscriber, || {
        run_with(
            &[&p],
            json!({}),
            &[
                ("authorization", "Bearer s3cr3t"),
                ("x-api-key", "k3y"),
                ("cookie", "session=c00kie-value"),
            ],
            &Services::default(),
            &Options::default(),
        );
        run_with(
            &[&m],
            json!({}),
            &[("authorization", "Bearer s3cr3t")],
            &Services::default(),
            &Options::default(),
        );
        // A credential in the query (audit 122: logged as it was).
        run_with_query(
            &[&q],
            json!({}),
            &[],
            &[("sig", "S1gnatur3"), ("api_key", "qk-123456")],
            &Services::default(),
            &Options::default(),
        );
    });
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(text.contains("visible"), "{text}");
    assert!(text.contains("kept"), "{text}");
    assert!(text.contains("******"), "{text}");
    assert!(text.contains("auth is ******"), "{text}");
    assert!(text.contains("sig is ******"), "{text}");
    for secret in [
        "s3cr3t",
        "k3y",
        "pw-123",
        "hunter2",
        "c00kie-value",
        "S1gnatur3",
        "qk-123456",
    ] {
        assert!(!text.contains(secret), "{secret} leaked: {text}");
    }
}

/// Values share what they are made of, so writes could build an answer of
/// petabytes in a few kilobytes of arena (audit 121): each mapping an array
/// of 16 reads of the one before, or `data` written into itself again and
/// again. Both end with a task error, quickly.
#[test]
fn values_made_of_copies_of_themselves_stay_bounded() {
    let mut mappings = vec![json!({"path": "a0", "logic": "xxxxxxxxxxxxxxxx"})];
    for i in 1..=12 {
        let prev = json!({"var": format!("data.a{}", i - 1)});
        mappings.push(json!({"path": format!("a{i}"), "logic": vec![prev; 16]}));
    }
    let p = plan(wf(json!([task(
        "bomb",
        "map",
        json!({ "mappings": mappings })
    )])));
    let f = failure(&p, json!({}), &Services::default());
    assert_eq!(f.task_id, "bomb");
    assert!(f.message.contains("allocation budget"), "{}", f.message);

    let mappings: Vec<Json> = (0..40)
        .map(|i| json!({"path": format!("b{i}"), "logic": {"var": "data"}}))
        .collect();
    let p = plan(wf(json!([task(
        "double",
        "map",
        json!({ "mappings": mappings })
    )])));
    let f = failure(&p, json!({}), &Services::default());
    assert!(
        f.message.contains("would store more than 256 MiB"),
        "{}",
        f.message
    );
    // A few copies are fine: the answer holds them whole.
    let mappings: Vec<Json> = (0..3)
        .map(|i| json!({"path": format!("b{i}"), "logic": {"var": "data"}}))
        .collect();
    let p = plan(wf(json!([task(
        "copy",
        "map",
        json!({ "mappings": mappings })
    )])));
    let r = run(&p, json!({}));
    assert_eq!(
        r.data(),
        json!({"b0": {}, "b1": {"b0": {}}, "b2": {"b0": {}, "b1": {"b0": {}}}})
    );
}

/// A loop that wraps a value in one more array per pass stops with a task
/// error at the nesting limit: the context never nests deeper than
/// `MAX_NESTING`, so nothing that walks it (the response writer first) can
/// overflow the stack. Both write paths are covered: a mapping alone and a
/// run of independent mappings.
#[test]
fn values_never_nest_deeper_than_the_limit() {
    // The limit is sized for release builds (well under 0.5 MiB of stack
    // at 2,048 levels); an unoptimised build's frames are over 40 times
    // larger (the service gives such builds 64 MiB worker stacks).
    std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(nesting_limit)
        .unwrap()
        .join()
        .unwrap();
}

fn nesting_limit() {
    // A map path longer than MAX_PATH_SEGMENTS is an input problem (a
    // warning at create, a task error at run), never a deep recursion.
    let long = vec!["x"; 5000].join(".");
    let compiled = compile_workflow(&wf(json!([task(
        "deep",
        "map",
        json!({"mappings": [{"path": long, "logic": 1}]})
    )])))
    .unwrap();
    assert_eq!(
        compiled.warnings[0].field,
        "tasks[0].function.input.mappings[0].path"
    );
    let r = run(&compiled.plan, json!({}));
    let Status::Failed(f) = &r.exec.status else {
        panic!("{:?}", r.exec.status)
    };
    assert!(
        f.message.contains("a path has at most 512"),
        "{}",
        f.message
    );
    // A scalar written at a path deeper than the limit is refused too, and
    // one within it counts toward the depth later writes are checked on.
    let target = vec!["a"; 3000].join(".");
    let r = run(
        &plan(wf(json!([task(
            "p",
            "parse_json",
            json!({"source": "payload", "target": target})
        )]))),
        json!(1),
    );
    let Status::Failed(f) = &r.exec.status else {
        panic!("{:?}", r.exec.status)
    };
    assert!(
        f.message
            .contains("the path would nest deeper than 2048 levels"),
        "{}",
        f.message
    );
    let target = vec!["a"; 2000].join(".");
    let r = run(
        &plan(wf(json!([
            task(
                "p",
                "parse_json",
                json!({"source": "payload", "target": target})
            ),
            task(
                "copy",
                "map",
                json!({"mappings": [{"path": "b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b.b", "logic": {"var": "data.a"}}]})
            )
        ]))),
        json!(1),
    );
    let Status::Failed(f) = &r.exec.status else {
        panic!("{:?}", r.exec.status)
    };
    assert_eq!(f.task_id, "copy");
    assert!(f.message.contains("nest deeper than 2048"), "{}", f.message);
    for mappings in [
        json!([{"path": "x", "logic": [{"var": "data.x"}]}]),
        json!([{"path": "x", "logic": [{"var": "data.x"}]}, {"path": "y", "logic": 1}]),
    ] {
        let mut def = wf(json!([task("wrap", "map", json!({"mappings": mappings}))]));
        def["loop"] = json!({"max": 10000});
        let r = run(&plan(def), json!({}));
        let Status::Failed(f) = &r.exec.status else {
            panic!("expected a task error, got {:?}", r.exec.status)
        };
        assert_eq!(f.task_id, "wrap");
        assert_eq!(
            f.message,
            "cannot write 'x': the value would nest deeper than 2048 levels"
        );
        // The data as it was before the refused write: `{"x": [[…[null]…]]}`,
        // nested as deep as the limit allows (the response writer got
        // through it).
        let text = std::str::from_utf8(&r.exec.data).unwrap();
        let depth = text.bytes().filter(|&b| b == b'[').count();
        assert!(text.starts_with("{\"x\":[[["), "{}", &text[..40]);
        assert_eq!(depth, MAX_NESTING - 2);
    }
    // One `reduce` can nest its result once more per element, in a single
    // write: such results are always measured.
    let def = wf(json!([task(
        "acc",
        "map",
        json!({"mappings": [{"path": "x", "logic":
        {"reduce": [{"var": "payload.items"}, [{"var": "accumulator"}], null]}}]})
    )]));
    let p = plan(def);
    let items = |n: usize| json!({"data": {"items": vec![0; n]}});
    let deep = run_with(
        &[&p],
        items(3000),
        &[],
        &Services::default(),
        &Options::default(),
    );
    let Status::Failed(f) = &deep.exec.status else {
        panic!("expected a task error, got {:?}", deep.exec.status)
    };
    assert_eq!(f.task_id, "acc");
    assert!(
        f.message.contains("nest deeper than 2048 levels"),
        "{}",
        f.message
    );
    let fine = run_with(
        &[&p],
        items(100),
        &[],
        &Services::default(),
        &Options::default(),
    );
    assert_eq!(fine.exec.status, Status::Completed);
}

/// A map whose mappings double a string: 1 KiB becomes 8 MiB in 13 steps,
/// within one rule's budget (64 MiB) each time.
fn doublings(to: &str) -> Json {
    let mut mappings: Vec<Json> = vec![json!({"path": to, "logic": {"var": "data.in.text"}})];
    for _ in 0..13 {
        mappings.push(json!({"path": to, "logic": {"cat": [{"var": to}, {"var": to}]}}));
    }
    task("grow", "map", json!({ "mappings": mappings }))
}

#[test]
fn an_execution_cannot_grow_its_data_past_the_arena_limit() {
    let text = "x".repeat(1024);
    // Each copy of the 8 MiB string is within one rule's budget; together
    // they would hold hundreds of MiB.
    let copies: Vec<Json> = (0..32)
        .map(|i| json!({"path": format!("data.c{i}"), "logic": {"cat": [{"var": "data.s"}, "!"]}}))
        .collect();
    let p = plan(wf(json!([
        parse(),
        doublings("data.s"),
        task("copies", "map", json!({ "mappings": copies }))
    ])));
    let r = run(&p, json!({ "text": text }));
    let Status::Failed(f) = &r.exec.status else {
        panic!("completed with {} bytes of data", r.exec.data.len())
    };
    // The rule that passes the limit fails, and what the mappings before
    // it computed is written as far as the limit lets it.
    assert_eq!(f.task_id, "copies");
    assert!(
        f.message.contains("128 MiB per execution")
            || f.message
                .contains("the execution's data would exceed 128 MiB"),
        "{}",
        f.message
    );

    // Growth that is not an evaluation (publish_json's text) is held at the
    // write.
    let publishes: Vec<Json> = (0..32)
        .map(|i| {
            task(
                &format!("publish{i}"),
                "publish_json",
                json!({"source": "s", "target": format!("p{i}")}),
            )
        })
        .collect();
    let mut tasks = vec![parse(), doublings("data.s")];
    tasks.extend(publishes);
    let r = run(&plan(wf(Json::Array(tasks))), json!({ "text": text }));
    let Status::Failed(f) = &r.exec.status else {
        panic!("completed with {} bytes of data", r.exec.data.len())
    };
    assert!(f.task_id.starts_with("publish"), "{}", f.task_id);
    assert!(
        f.message
            .contains("the execution's data would exceed 128 MiB"),
        "{}",
        f.message
    );
}

/// `data` is what a sync request answers as `{status, data: <object>,
/// errors}`: a task may replace it whole only with an object or an array
/// (the rows `db_read` writes to `data` by default). Before, a mapping to
/// `data` (or `""`) of a scalar made the answer's `data` that scalar.
#[test]
fn data_replaced_whole_stays_an_object() {
    for path in ["data", ""] {
        let mut w = wf(json!([task(
            "m",
            "map",
            json!({"mappings": [{"path": path, "logic": 5}]})
        )]));
        w["tasks"][0]["continue_on_error"] = json!(true);
        let r = run(&plan(w), json!({}));
        assert_eq!(r.exec.errors.len(), 1, "{path}");
        assert!(
            r.exec.errors[0]
                .message
                .contains("data is an object or an array, and the value is number"),
            "{:?}",
            r.exec.errors[0]
        );
        assert!(r.data().is_object());
    }
    // An object may replace it.
    let w = wf(json!([task(
        "m",
        "map",
        json!({"mappings": [{"path": "data", "logic": {"preserve": {"a": 1}}}]})
    )]));
    let r = run(&plan(w), json!({}));
    assert!(r.exec.errors.is_empty(), "{:?}", r.exec.errors);
    // So may an array.
    let w = wf(json!([task(
        "m",
        "map",
        json!({"mappings": [{"path": "data", "logic": {"preserve": [{"id": 1}]}}]})
    )]));
    let r = run(&plan(w), json!({}));
    assert!(r.exec.errors.is_empty(), "{:?}", r.exec.errors);
    assert_eq!(r.data(), json!([{"id": 1}]));
}

/// `metadata` (headers, query, path parameters) replaced whole stays an
/// object, or later conditions read `null` from it (audit 69); `temp_data`
/// is scratch and may hold anything.
#[test]
fn metadata_replaced_whole_stays_an_object() {
    for (logic, ok) in [
        (json!(5), false),
        (json!({"preserve": [1]}), false),
        (json!({"preserve": {"a": 1}}), true),
    ] {
        let mut w = wf(json!([task(
            "m",
            "map",
            json!({"mappings": [{"path": "metadata", "logic": logic}, {"path": "temp_data", "logic": 5}]})
        )]));
        w["tasks"][0]["continue_on_error"] = json!(true);
        let r = run(&plan(w), json!({}));
        if ok {
            assert!(r.exec.errors.is_empty(), "{:?}", r.exec.errors);
        } else {
            assert_eq!(r.exec.errors.len(), 1, "{logic}");
            assert!(
                r.exec.errors[0]
                    .message
                    .starts_with("cannot write 'metadata': metadata is an object"),
                "{:?}",
                r.exec.errors[0]
            );
        }
    }
}

/// A map path with an empty segment (`a..b`, `.a`, `a.`) is an input
/// problem (a warning at create, a task error at run): it used to write
/// under the key `""`. `#` names an empty key on purpose.
#[test]
fn map_paths_have_no_empty_segments() {
    for path in ["in.a..b", ".x", "x."] {
        let compiled = compile_workflow(&wf(json!([task(
            "m",
            "map",
            json!({"mappings": [{"path": path, "logic": 1}]})
        )])))
        .unwrap();
        assert_eq!(
            compiled.warnings[0].field, "tasks[0].function.input.mappings[0].path",
            "{path}"
        );
        assert!(
            compiled.warnings[0]
                .message
                .contains("has an empty segment"),
            "{}",
            compiled.warnings[0].message
        );
        let r = run(&compiled.plan, json!({}));
        assert!(matches!(r.exec.status, Status::Failed(_)), "{path}");
    }
    let r = run(
        &plan(wf(json!([task(
            "m",
            "map",
            json!({"mappings": [{"path": "a.#.b", "logic": 1}]})
        )]))),
        json!({}),
    );
    assert_eq!(r.data(), json!({"a": {"": {"b": 1}}}));
    // So is a parse_json or publish_json target with one (session 19).
    for function in ["parse_json", "publish_json"] {
        let compiled = compile_workflow(&wf(json!([task(
            "p",
            function,
            json!({"source": "payload", "target": "x..y"})
        )])))
        .unwrap();
        assert_eq!(
            compiled.warnings[0].field, "tasks[0].function.input.target",
            "{function}"
        );
        let r = run(&compiled.plan, json!({}));
        assert!(matches!(r.exec.status, Status::Failed(_)), "{function}");
    }
}

/// `filter.on_reject` of the wrong type says so in the spec's words.
#[test]
fn filter_on_reject_problems_are_precise() {
    for (value, message) in [
        (json!(null), "expected string, got null"),
        (json!(5), "expected string, got integer"),
        (json!("drop"), "must be one of halt, skip, got 'drop'"),
    ] {
        let compiled = compile_workflow(&wf(json!([task(
            "f",
            "filter",
            json!({"condition": true, "on_reject": value})
        )])))
        .unwrap();
        assert_eq!(
            compiled.warnings[0].field,
            "tasks[0].function.input.on_reject"
        );
        assert_eq!(compiled.warnings[0].message, message);
    }
}

/// Every JSONLogic error of a connector or composition task is reported at
/// once, each at its field (session 19: the first one hid the others).
#[test]
fn every_rule_error_of_a_connector_task_is_reported() {
    let bad = json!({"no_such_op": 1});
    for (function, input, fields) in [
        (
            "http_call",
            json!({"connector": "c", "path_logic": bad, "body_logic": bad}),
            vec!["path_logic", "body_logic"],
        ),
        (
            "cache_write",
            json!({"connector": "c", "key_logic": bad, "value_logic": bad}),
            vec!["value_logic", "key_logic"],
        ),
        (
            "publish_kafka",
            json!({"connector": "c", "topic": "t", "key_logic": bad, "value_logic": bad}),
            vec!["key_logic", "value_logic"],
        ),
        (
            "db_read",
            json!({"connector": "c", "query": "SELECT 1", "params": [bad, 1, bad]}),
            vec!["params[0]", "params[2]"],
        ),
        (
            "channel_call",
            json!({"channel_logic": bad, "data_logic": bad}),
            vec!["channel_logic", "data_logic"],
        ),
    ] {
        let problems = compile_workflow(&wf(json!([task("t", function, input)]))).unwrap_err();
        let got: Vec<&str> = problems.iter().map(|d| d.field.as_str()).collect();
        let want: Vec<String> = fields
            .iter()
            .map(|f| format!("tasks[0].function.input.{f}"))
            .collect();
        assert_eq!(got, want, "{function}: {problems:?}");
    }
}

/// A misspelt field of a task, its `function` or a connector function's
/// `input` is a warning naming it (it would be dropped in silence: a task
/// with `conditon` runs always, an `http_call` with `respone_path`
/// discards the answer); the workflow still compiles and runs.
#[test]
fn misspelt_fields_are_warned_about() {
    let mut t = task(
        "h",
        "http_call",
        json!({"connector": "c", "respone_path": "x"}),
    );
    t["conditon"] = json!(false);
    t["function"]["inptu"] = json!({});
    let compiled = compile_workflow(&wf(json!([t]))).unwrap();
    let fields: Vec<&str> = compiled.warnings.iter().map(|w| w.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "tasks[0].conditon",
            "tasks[0].function.inptu",
            "tasks[0].function.input.respone_path"
        ],
        "{:?}",
        compiled.warnings
    );
    assert!(
        compiled.warnings[0]
            .message
            .starts_with("unknown field, ignored; expected one of id, name"),
        "{}",
        compiled.warnings[0].message
    );
    // Known fields draw none.
    let clean = compile_workflow(&wf(json!([task(
        "h",
        "http_call",
        json!({"connector": "c", "response_path": "x", "method": "POST", "timeout_ms": 5})
    )])))
    .unwrap();
    assert!(clean.warnings.is_empty(), "{:?}", clean.warnings);
}
