//! Fuzz target bodies. The `fuzz/` crate's targets are one-line wrappers over
//! these, and `tests/fuzz_seeds.rs` runs them over the checked-in seed corpus
//! so CI exercises them on stable Rust.
//!
//! Each body must return normally for every input: no panic, no stack
//! overflow (nesting is bounded by serde_json's recursion limit, the group
//! depth limit and `logic::MAX_DEPTH`), no unbounded work.

use crate::Value;
use crate::logic;
use crate::plan::{compile_new_workflow, compile_workflow};
use bumpalo::Bump;

/// Arbitrary bytes as a workflow definition: parse, validate, compile, both
/// as a stored definition and as a new one (which adds the checks a stored
/// definition may predate).
pub fn workflow_definition(bytes: &[u8]) {
    let Ok(def) = serde_json::from_slice::<serde_json::Value>(bytes) else {
        return;
    };
    let stored = compile_workflow(&def);
    let new = compile_new_workflow(&def);
    // A definition accepted as new is accepted as stored.
    assert!(
        new.is_err() || stored.is_ok(),
        "new accepted, stored refused"
    );
    for compiled in [stored, new] {
        match compiled {
            Ok(compiled) => {
                // A compiled plan is internally consistent with its definition.
                assert!(
                    !compiled.plan.body.steps.is_empty() || compiled.plan.body.repeat.is_some()
                );
            }
            Err(errors) => assert!(
                !errors.is_empty(),
                "a rejected definition names its problems"
            ),
        }
    }
}

/// Arbitrary text as the statement of a `db_read` and of a `db_write` task
/// in a new definition: the statement-kind check reads it as MySQL and as
/// PostgreSQL (comments, quotes, dollar quotes, escapes) and must finish on
/// anything.
pub fn sql_statement(bytes: &[u8]) {
    let Ok(query) = std::str::from_utf8(bytes) else {
        return;
    };
    let task = |id: &str, function: &str| {
        serde_json::json!({
            "id": id,
            "name": id,
            "function": {"name": function, "input": {"connector": "db", "query": query}}
        })
    };
    let def = serde_json::json!({
        "workflow_id": "fuzz-sql",
        "name": "fuzz",
        "tasks": [task("read", "db_read"), task("write", "db_write")]
    });
    if let Err(errors) = compile_new_workflow(&def) {
        // Only the statement can be wrong, and only in the query field.
        for e in &errors {
            assert!(
                e.field.ends_with(".function.input.query"),
                "unexpected error {e:?}"
            );
        }
    }
}

/// Arbitrary bytes as a JSONLogic rule and data: `[rule, data]` (or a bare
/// rule with null data): compile and evaluate.
pub fn logic_rule(bytes: &[u8]) {
    let Ok(input) = serde_json::from_slice::<serde_json::Value>(bytes) else {
        return;
    };
    let (rule, data) = match &input {
        serde_json::Value::Array(pair) if pair.len() == 2 => (&pair[0], &pair[1]),
        other => (other, &serde_json::Value::Null),
    };
    let Ok(compiled) = logic::compile(rule) else {
        return;
    };
    let arena = Bump::new();
    let data = Value::from_json(data, &arena);
    if let Ok(result) = compiled.eval(data, &arena) {
        // Whatever it returns serializes to JSON that parses back.
        let text = result.to_json_string();
        assert!(
            serde_json::from_str::<serde_json::Value>(&text).is_ok(),
            "unparsable result {text}"
        );
    }
}
