//! Data-driven JSONLogic conformance: runs the reference `tests.json` and
//! every compat-tables suite listed in `index.json` from the shared test-data
//! directory (`SLUICE_SHARED_DIR`, default `<repo>/../shared`), prints the
//! counts and every failure, and asserts the agreed thresholds.

use bumpalo::Bump;
use serde_json::Value as Json;
use sluice_compiler::Value;
use sluice_compiler::logic::{self, EvalError};
use std::path::PathBuf;

/// compat-tables cases known to fail, as (file, description, reason). Every
/// failure must be listed here; keep it empty when everything passes.
const KNOWN_FAILURES: &[(&str, &str, &str)] = &[];

/// At least this many compat-tables cases must pass.
const COMPAT_MIN_PASS: usize = 1120;

fn shared_dir() -> PathBuf {
    match std::env::var_os("SLUICE_SHARED_DIR") {
        Some(dir) => PathBuf::from(dir).join("jsonlogic"),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/jsonlogic"),
    }
}

fn load(path: &PathBuf) -> Json {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!(
            "cannot read {} (set SLUICE_SHARED_DIR): {e}",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// JSON equality with numbers compared numerically (`1 == 1.0`).
fn same(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Number(x), Json::Number(y)) => x.as_f64() == y.as_f64(),
        (Json::Array(x), Json::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(p, q))
        }
        (Json::Object(x), Json::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

/// What a case produced: a value, an evaluation error, or a compile error.
enum Outcome {
    Value(Json),
    Error(String),
    CompileError(String),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Value(v) => write!(f, "{v}"),
            Outcome::Error(e) => write!(f, "error: {e}"),
            Outcome::CompileError(e) => write!(f, "compile error: {e}"),
        }
    }
}

fn run(rule: &Json, data: &Json) -> (Outcome, Option<String>) {
    let logic = match logic::compile(rule) {
        Ok(l) => l,
        Err(e) => {
            return (
                Outcome::CompileError(e.message),
                Some("Invalid Arguments".into()),
            );
        }
    };
    let arena = Bump::new();
    let data = Value::from_json(data, &arena);
    match logic.eval(data, &arena) {
        Ok(v) => (Outcome::Value(v.to_json()), None),
        Err(e) => {
            let kind = error_matches(&e);
            (Outcome::Error(e.to_string()), kind)
        }
    }
}

/// The compat-tables' error type an evaluation error stands for: `NaN`,
/// `Invalid Arguments`, or the thrown string / the thrown object's `type`.
fn error_matches(e: &EvalError<'_>) -> Option<String> {
    e.error_type().map(str::to_owned)
}

#[test]
fn reference_tests_json() {
    let cases = load(&shared_dir().join("tests.json"));
    let (mut total, mut passed) = (0, 0);
    let mut section = String::new();
    for case in cases.as_array().expect("tests.json is an array") {
        let Some(parts) = case.as_array() else {
            section = case.as_str().unwrap_or_default().to_owned();
            continue;
        };
        total += 1;
        let (rule, data, expected) = (&parts[0], &parts[1], &parts[2]);
        match run(rule, data) {
            (Outcome::Value(got), _) if same(&got, expected) => passed += 1,
            (got, _) => println!(
                "FAIL tests.json [{section}] rule {rule} data {data}: expected {expected}, got {got}"
            ),
        }
    }
    println!("jsonlogic tests.json: {passed}/{total} passed");
    assert_eq!(total, 277, "tests.json should hold 277 cases");
    assert_eq!(passed, total);
}

#[test]
fn compat_tables() {
    let dir = shared_dir().join("compat-tables");
    let index = load(&dir.join("index.json"));
    let (mut total, mut passed) = (0, 0);
    let mut unexpected = Vec::new();
    let mut known_hit = Vec::new();
    for file in index.as_array().expect("index.json is an array") {
        let file = file.as_str().expect("index entries are file names");
        let cases = load(&dir.join(file));
        for case in cases.as_array().expect("suite files are arrays") {
            if case.is_string() {
                continue;
            }
            total += 1;
            let description = case["description"].as_str().unwrap_or_default();
            let rule = &case["rule"];
            let data = case.get("data").unwrap_or(&Json::Null);
            let (got, got_type) = run(rule, data);
            let ok = match (case.get("result"), case.get("error")) {
                (Some(expected), None) => matches!(&got, Outcome::Value(v) if same(v, expected)),
                (_, Some(error)) => {
                    let want = error["type"].as_str();
                    !matches!(got, Outcome::Value(_))
                        && want.is_some()
                        && got_type.as_deref() == want
                }
                _ => false,
            };
            if ok {
                passed += 1;
                continue;
            }
            let expected = case
                .get("result")
                .or(case.get("error"))
                .cloned()
                .unwrap_or_default();
            println!(
                "FAIL {file} \"{description}\": rule {rule} data {data}: expected {expected}, got {got}"
            );
            match KNOWN_FAILURES
                .iter()
                .find(|(f, d, _)| *f == file && *d == description)
            {
                Some(known) => known_hit.push(known),
                None => unexpected.push(format!("{file}: {description}")),
            }
        }
    }
    println!("compat-tables: {passed}/{total} passed");
    for (file, description, reason) in &known_hit {
        println!("  known failure {file} \"{description}\": {reason}");
    }
    assert_eq!(
        total, 1138,
        "the compat-tables index should list 1,138 cases"
    );
    assert!(
        unexpected.is_empty(),
        "failures not in KNOWN_FAILURES: {unexpected:#?}"
    );
    assert!(
        passed >= COMPAT_MIN_PASS,
        "only {passed}/{total} compat-tables cases pass"
    );
}

/// The shared suite's `escaping.json` (json-logic's path escaping: `\.`,
/// `\/`, `\\`, paths of dots alone): every case must pass.
#[test]
fn escaping() {
    let cases = load(&shared_dir().join("escaping.json"));
    let (mut total, mut passed) = (0, 0);
    for case in cases.as_array().expect("escaping.json is an array") {
        if case.is_string() {
            continue;
        }
        total += 1;
        let (rule, data) = (&case["rule"], case.get("data").unwrap_or(&Json::Null));
        let expected = &case["result"];
        match run(rule, data) {
            (Outcome::Value(got), _) if same(&got, expected) => passed += 1,
            (got, _) => println!(
                "FAIL escaping.json \"{}\": rule {rule} data {data}: expected {expected}, got {got}",
                case["description"]
            ),
        }
    }
    println!("escaping.json: {passed}/{total} passed");
    assert_eq!(total, 13, "escaping.json should hold 13 cases");
    assert_eq!(passed, total);
}
