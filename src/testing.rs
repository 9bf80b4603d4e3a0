//! `sluice test`: workflow test files run offline, through the same compiler
//! and executor as the server.
//!
//! A test file (JSON, or YAML when it ends in `.yaml`/`.yml`) names a
//! workflow definition and lists cases; connectors are replaced by stubs
//! ([`Stubs`]) that implement the runtime's connector traits, answer reads
//! with canned responses or errors and record what writes would have sent.
//! The runtime is not told it is being tested: it sees a [`Services`] like any
//! other. The file format is documented in README.md ("Testing workflows").

use serde::Deserialize;
use serde_json::{Map, Value as Json, json};
use sluice_compiler::plan::{Compiled, compile_new_workflow};
use sluice_runtime::connectors::{
    Cache, CallScope, ChannelInvoker, ConnectorError, ConnectorErrorKind, DocumentStore,
    FindRequest, HttpClient, HttpRequest, InvokeRequest, Invoked, PublishRequest, Publisher,
    Services, SqlClient, SqlRequest,
};
use sluice_runtime::exec::{self, Input, Meta, Options, PayloadFrom};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

/// Suffixes that mark a test file when a directory is searched.
pub const TEST_FILE_SUFFIXES: &[&str] = &[".test.json", ".test.yaml", ".test.yml"];

// ---------------------------------------------------------------- the file

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct TestFile {
    #[serde(rename = "$schema", default)]
    _schema: Option<String>,
    /// Path of the workflow definition, relative to the test file.
    workflow: PathBuf,
    /// Stubs per connector name (or, for `channel_call`, per called channel).
    #[serde(default)]
    connectors: HashMap<String, Vec<StubAnswer>>,
    cases: Vec<Case>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    request: Request,
    /// Replaces the file's stubs of the same names for this case.
    #[serde(default)]
    connectors: HashMap<String, Vec<StubAnswer>>,
    #[serde(default)]
    expect: Expect,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Request {
    #[serde(default)]
    data: Json,
    /// `{headers?, query?, path?, method?, channel?, request_id?}`, as the
    /// data plane passes them.
    #[serde(default)]
    metadata: Json,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct Expect {
    /// `completed`, `filtered`, `failed`, `unmatched`, or the HTTP status the
    /// data plane would answer (200, 400, 404, 500, 502, 503, 504). Any
    /// other word is an error in the test file, as a stub's unknown `kind`
    /// is (a typo such as `complete` must not read as a failed case).
    #[serde(default, deserialize_with = "expected_status")]
    status: Option<Json>,
    /// Subset match against the final `data`.
    data: Option<Json>,
    /// `[{code, task_id, message?}]`, in order, subset match per item.
    errors: Option<Json>,
    /// Per connector name, what writes would have sent, in order.
    writes: Option<Map<String, Json>>,
}

fn expected_status<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Json>, D::Error> {
    let v = Json::deserialize(d)?;
    let ok = match &v {
        Json::String(s) => ["completed", "filtered", "failed", "unmatched"].contains(&s.as_str()),
        Json::Number(n) => n.as_u64().is_some_and(|n| (100..=599).contains(&n)),
        _ => false,
    };
    if ok {
        Ok(Some(v))
    } else {
        Err(serde::de::Error::custom(format!(
            "expect.status must be completed, filtered, failed, unmatched or an HTTP status code, got {v}"
        )))
    }
}

/// One canned answer: used for a call when `match` is a subset of the call.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct StubAnswer {
    #[serde(rename = "match", default)]
    when: Option<Json>,
    #[serde(default)]
    response: Option<Json>,
    #[serde(default)]
    error: Option<StubError>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct StubError {
    /// `upstream` (default), `timeout`, `circuit_open` or `other`; any
    /// other word is an error in the test file (a typo must not quietly
    /// become an upstream failure).
    #[serde(default)]
    kind: StubErrorKind,
    message: String,
}

#[derive(Deserialize, Debug, Clone, Copy, Default)]
#[serde(rename_all = "snake_case")]
enum StubErrorKind {
    #[default]
    Upstream,
    Timeout,
    CircuitOpen,
    Other,
}

impl StubError {
    fn to_error(&self) -> ConnectorError {
        let kind = match self.kind {
            StubErrorKind::Upstream => ConnectorErrorKind::Upstream,
            StubErrorKind::Timeout => ConnectorErrorKind::Timeout,
            StubErrorKind::CircuitOpen => ConnectorErrorKind::CircuitOpen,
            StubErrorKind::Other => ConnectorErrorKind::Other,
        };
        ConnectorError::new(kind, self.message.clone())
    }
}

// ---------------------------------------------------------------- the stubs

/// The connector stubs of one case: canned answers per name and the writes
/// recorded so far.
struct Stubs {
    answers: HashMap<String, Vec<StubAnswer>>,
    writes: Mutex<BTreeMap<String, Vec<Json>>>,
}

impl Stubs {
    /// The first answer of `name` whose `match` is a subset of `call`.
    fn find(&self, name: &str, call: &Json) -> Option<&StubAnswer> {
        self.answers
            .get(name)?
            .iter()
            .find(|a| a.when.as_ref().is_none_or(|m| subset(m, call)))
    }

    /// A read: the matching answer's response (or error); no stub is an error.
    /// (The executor prefixes every connector error with the function's name.)
    fn read(&self, name: &str, call: Json) -> Result<Json, ConnectorError> {
        if !self.answers.contains_key(name) {
            return Err(ConnectorError::other(format!(
                "connector '{name}' has no stub in the test file"
            )));
        }
        match self.find(name, &call) {
            Some(StubAnswer { error: Some(e), .. }) => Err(e.to_error()),
            Some(a) => Ok(a.response.clone().unwrap_or(Json::Null)),
            None => Err(ConnectorError::other(format!(
                "no stub answer of connector '{name}' matches {call}"
            ))),
        }
    }

    /// A write: recorded, then answered by a matching stub answer if there is
    /// one (an error, or a response), else it succeeds.
    fn write(&self, name: &str, call: Json) -> Result<Option<Json>, ConnectorError> {
        let answer = self.find(name, &call).cloned();
        self.writes
            .lock()
            .expect("the stub recorder is never poisoned")
            .entry(name.to_owned())
            .or_default()
            .push(call);
        match answer {
            Some(StubAnswer { error: Some(e), .. }) => Err(e.to_error()),
            Some(a) => Ok(a.response),
            None => Ok(None),
        }
    }
}

#[async_trait::async_trait]
impl HttpClient for Stubs {
    async fn call(&self, _: &CallScope, req: HttpRequest) -> Result<Json, ConnectorError> {
        let headers: Map<String, Json> = req
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), Json::String(v.clone())))
            .collect();
        let call = json!({"method": req.method.as_str(), "path": req.path, "headers": headers, "body": req.body});
        self.read(&req.connector, call)
    }
}

#[async_trait::async_trait]
impl SqlClient for Stubs {
    async fn read(&self, _: &CallScope, req: SqlRequest) -> Result<Vec<Json>, ConnectorError> {
        let call = json!({"query": req.query, "params": req.params});
        match Stubs::read(self, &req.connector, call)? {
            Json::Array(rows) => Ok(rows),
            Json::Null => Ok(Vec::new()),
            other => Err(ConnectorError::other(format!(
                "db_read stub of '{}' must answer an array of rows, got {other}",
                req.connector
            ))),
        }
    }

    async fn write(&self, _: &CallScope, req: SqlRequest) -> Result<u64, ConnectorError> {
        let call = json!({"query": req.query, "params": req.params});
        let response = Stubs::write(self, &req.connector, call)?;
        // `{rows_affected: n}` or a bare number; one row by default.
        Ok(response
            .as_ref()
            .and_then(|r| r.get("rows_affected").unwrap_or(r).as_u64())
            .unwrap_or(1))
    }
}

#[async_trait::async_trait]
impl Cache for Stubs {
    async fn get(
        &self,
        _: &CallScope,
        connector: &str,
        key: &str,
    ) -> Result<Option<String>, ConnectorError> {
        // A null response is a miss; any other value is handed back as its
        // JSON text (a string quoted), which cache_read parses, so the
        // stubbed value is exactly what cache_read gives the workflow.
        Ok(match self.read(connector, json!({"key": key}))? {
            Json::Null => None,
            other => Some(other.to_string()),
        })
    }

    async fn set(
        &self,
        _: &CallScope,
        connector: &str,
        key: &str,
        value: String,
        ttl: Option<std::time::Duration>,
    ) -> Result<(), ConnectorError> {
        // Values are recorded as the runtime would store them, parsed back
        // when they are JSON so expectations can be written as JSON.
        let value = serde_json::from_str::<Json>(&value).unwrap_or(Json::String(value));
        // Whole seconds as an integer (as they are usually written), others
        // as a fraction.
        let ttl_secs = ttl.map(|t| {
            if t.subsec_millis() == 0 {
                json!(t.as_secs())
            } else {
                json!(t.as_secs_f64())
            }
        });
        let call = json!({"key": key, "value": value, "ttl_secs": ttl_secs});
        self.write(connector, call).map(|_| ())
    }
}

#[async_trait::async_trait]
impl DocumentStore for Stubs {
    async fn find(&self, _: &CallScope, req: FindRequest) -> Result<Vec<Json>, ConnectorError> {
        let call =
            json!({"database": req.database, "collection": req.collection, "filter": req.filter});
        match self.read(&req.connector, call)? {
            Json::Array(docs) => Ok(docs),
            Json::Null => Ok(Vec::new()),
            other => Err(ConnectorError::other(format!(
                "mongo_read stub of '{}' must answer an array of documents, got {other}",
                req.connector
            ))),
        }
    }
}

#[async_trait::async_trait]
impl Publisher for Stubs {
    async fn publish(&self, _: &CallScope, req: PublishRequest) -> Result<(), ConnectorError> {
        let value = serde_json::from_slice::<Json>(&req.value)
            .unwrap_or_else(|_| Json::String(String::from_utf8_lossy(&req.value).into_owned()));
        let call = json!({"topic": req.topic, "key": req.key, "value": value});
        self.write(&req.connector, call).map(|_| ())
    }
}

#[async_trait::async_trait]
impl ChannelInvoker for Stubs {
    async fn invoke(&self, _: &CallScope, req: InvokeRequest) -> Result<Invoked, ConnectorError> {
        let call = json!({"channel": req.channel, "data": req.data});
        let data = self.read(&req.channel, call)?;
        Ok(Invoked {
            data,
            errors: Vec::new(),
        })
    }
}

// ---------------------------------------------------------------- matching

/// Whether `expected` is a subset of `actual`: objects by the expected keys,
/// arrays item by item with the same length, numbers by value.
pub fn subset(expected: &Json, actual: &Json) -> bool {
    match (expected, actual) {
        (Json::Object(e), Json::Object(a)) => e
            .iter()
            .all(|(k, ev)| a.get(k).is_some_and(|av| subset(ev, av))),
        (Json::Array(e), Json::Array(a)) => {
            e.len() == a.len() && e.iter().zip(a).all(|(ev, av)| subset(ev, av))
        }
        (Json::Number(e), Json::Number(a)) => e == a || close(e.as_f64(), a.as_f64()),
        _ => expected == actual,
    }
}

/// Numbers compare by value with a relative tolerance of 1e-9, so that
/// `905.502` matches the double arithmetic's `905.5020000000001`.
fn close(e: Option<f64>, a: Option<f64>) -> bool {
    match (e, a) {
        (Some(e), Some(a)) => (e - a).abs() <= 1e-9 * e.abs().max(a.abs()).max(1.0),
        _ => false,
    }
}

/// `actual` cut down to the shape of `expected` (keys `expected` does not
/// name are dropped), so a diff of the two shows only what differs.
fn project(actual: &Json, expected: &Json) -> Json {
    match (actual, expected) {
        (Json::Object(a), Json::Object(e)) => Json::Object(
            e.iter()
                .filter_map(|(k, ev)| Some((k.clone(), project(a.get(k)?, ev))))
                .collect(),
        ),
        (Json::Array(a), Json::Array(e)) => Json::Array(
            a.iter()
                .enumerate()
                .map(|(i, av)| e.get(i).map_or_else(|| av.clone(), |ev| project(av, ev)))
                .collect(),
        ),
        (Json::Number(a), Json::Number(e)) if close(e.as_f64(), a.as_f64()) => expected.clone(),
        _ => actual.clone(),
    }
}

fn diff(expected: &Json, actual: &Json) -> String {
    let e = serde_json::to_string_pretty(expected).unwrap_or_default();
    let a = serde_json::to_string_pretty(actual).unwrap_or_default();
    let mut out = String::from("      --- expected\n      +++ actual\n");
    for change in similar::TextDiff::from_lines(&e, &a).iter_all_changes() {
        let sign = match change.tag() {
            similar::ChangeTag::Delete => '-',
            similar::ChangeTag::Insert => '+',
            similar::ChangeTag::Equal => ' ',
        };
        out.push_str(&format!("      {sign}{}", change.value()));
        if !change.value().ends_with('\n') {
            out.push('\n');
        }
    }
    out
}

// ---------------------------------------------------------------- running

/// What one case produced, in the terms `expect` uses.
struct Outcome {
    status: &'static str,
    http_status: u16,
    data: Json,
    errors: Json,
    writes: BTreeMap<String, Vec<Json>>,
}

fn run_case(
    runtime: &tokio::runtime::Runtime,
    compiled: &Compiled,
    file_stubs: &HashMap<String, Vec<StubAnswer>>,
    case: &Case,
) -> Result<Outcome, String> {
    let mut answers = file_stubs.clone();
    answers.extend(case.connectors.clone());
    let stubs = Arc::new(Stubs {
        answers,
        writes: Mutex::new(BTreeMap::new()),
    });
    let services = Services {
        http: Some(stubs.clone()),
        sql: Some(stubs.clone()),
        cache: Some(stubs.clone()),
        documents: Some(stubs.clone()),
        publisher: Some(stubs.clone()),
        channels: Some(stubs.clone()),
    };
    let meta = &case.request.metadata;
    let pairs = |area| crate::data::metadata_pairs(meta, area);
    let (headers, query, path) = (pairs("headers"), pairs("query"), pairs("path"));
    use crate::data::borrow_pairs;
    let (h, q, p) = (
        borrow_pairs(&headers),
        borrow_pairs(&query),
        borrow_pairs(&path),
    );
    let body = serde_json::to_vec(&case.request.data).unwrap_or_default();
    let input = Input {
        body: &body,
        payload_from: PayloadFrom::Whole,
        meta: Meta {
            headers: &h,
            query: &q,
            path: &p,
            method: crate::data::metadata_str(meta, "method").unwrap_or("POST"),
            channel: crate::data::metadata_str(meta, "channel").unwrap_or(""),
            request_id: crate::data::metadata_str(meta, "request_id").unwrap_or("sluice-test"),
            extra: &[],
        },
        bucket: None,
    };
    let scope = CallScope::default();
    let options = Options::default();
    let execution = runtime
        .block_on(exec::execute(
            [&compiled.plan],
            input,
            &services,
            &scope,
            &options,
        ))
        .map_err(|e| format!("the request was refused: {e}"))?;
    let answer = crate::data::dry_run_answer(&execution);
    let http_status = match &execution.status {
        _ if execution.matched.is_none() => 404,
        exec::Status::Failed(f) => crate::data::failure_code(f.kind).status().as_u16(),
        _ => 200,
    };
    let status = match answer["status"].as_str() {
        _ if execution.matched.is_none() => "unmatched",
        Some("completed") => "completed",
        Some("filtered") => "filtered",
        _ => "failed",
    };
    let writes = stubs
        .writes
        .lock()
        .expect("the stub recorder is never poisoned")
        .clone();
    Ok(Outcome {
        status,
        http_status,
        data: answer["data"].clone(),
        errors: answer["errors"].clone(),
        writes,
    })
}

/// Checks a case's outcome; `Err` carries the diff to print.
fn check(expect: &Expect, out: &Outcome) -> Result<(), String> {
    let mut expected = Map::new();
    let mut actual = Map::new();
    if let Some(status) = &expect.status {
        expected.insert("status".into(), status.clone());
        let got = if status.is_number() {
            json!(out.http_status)
        } else {
            json!(out.status)
        };
        actual.insert("status".into(), got);
    }
    if let Some(data) = &expect.data {
        expected.insert("data".into(), data.clone());
        actual.insert("data".into(), project(&out.data, data));
    }
    if let Some(errors) = &expect.errors {
        expected.insert("errors".into(), errors.clone());
        actual.insert("errors".into(), project(&out.errors, errors));
    }
    if let Some(writes) = &expect.writes {
        let got: Map<String, Json> = writes
            .iter()
            .map(|(name, e)| {
                let a = Json::Array(out.writes.get(name).cloned().unwrap_or_default());
                (name.clone(), project(&a, e))
            })
            .collect();
        expected.insert("writes".into(), Json::Object(writes.clone()));
        actual.insert("writes".into(), Json::Object(got));
    }
    let (expected, actual) = (Json::Object(expected), Json::Object(actual));
    if subset(&expected, &actual) {
        return Ok(());
    }
    // When the run failed unexpectedly, the error says why.
    let mut text = diff(&expected, &actual);
    if out.status == "failed" && expect.errors.is_none() {
        text.push_str(&format!("      errors: {}\n", out.errors));
    }
    Err(text)
}

/// A test file, read and parsed (YAML by extension, JSON otherwise).
fn load(path: &Path) -> Result<TestFile, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read it: {e}"))?;
    let yaml = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    );
    let file: TestFile = if yaml {
        let value: serde_norway::Value =
            serde_norway::from_str(&text).map_err(|e| format!("not valid YAML: {e}"))?;
        serde_path_to_error::deserialize(value).map_err(|e| format!("not a test file: {e}"))?
    } else {
        let de = &mut serde_json::Deserializer::from_str(&text);
        serde_path_to_error::deserialize(de).map_err(|e| format!("not a test file: {e}"))?
    };
    // A case's metadata is checked as the test endpoint checks a dry run's.
    for (i, case) in file.cases.iter().enumerate() {
        if let Some(p) = crate::data::metadata_problems(&case.request.metadata).first() {
            return Err(format!(
                "not a test file: cases[{i}].request.{}: {}",
                p.field, p.message
            ));
        }
    }
    Ok(file)
}

/// Files under `dir` (recursively, in name order) whose name `keep` accepts.
pub(crate) fn files_under(
    dir: &Path,
    keep: &dyn Fn(&str) -> bool,
    out: &mut Vec<PathBuf>,
) -> Result<(), String> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            files_under(&path, keep, out)?;
        } else if path.file_name().and_then(|n| n.to_str()).is_some_and(keep) {
            out.push(path);
        }
    }
    Ok(())
}

/// Test files named by the arguments: files as given, directories searched
/// recursively for the [`TEST_FILE_SUFFIXES`], in name order.
fn collect(paths: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    let is_test = |name: &str| TEST_FILE_SUFFIXES.iter().any(|s| name.ends_with(s));
    let mut out = Vec::new();
    for path in paths {
        if path.is_dir() {
            files_under(path, &is_test, &mut out)?;
        } else {
            // A named file that cannot be read is a failed case when it is
            // loaded (the others still run), as one that does not parse.
            out.push(path.clone());
        }
    }
    Ok(out)
}

/// `sluice test <file-or-dir>...`: one line per case, a diff under each
/// failure, `N passed, N failed` last; exit 1 on any failure (a named file
/// that cannot be read or parsed counts as one), 2 when there is nothing to
/// run (no test file, or no case in them).
pub fn run(paths: &[PathBuf]) -> ExitCode {
    let files = match collect(paths) {
        Ok(files) if files.is_empty() => {
            crate::errln!(
                "error: no test files found (they end in .test.json, .test.yaml or .test.yml)"
            );
            return ExitCode::from(2);
        }
        Ok(files) => files,
        Err(e) => {
            crate::errln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            crate::errln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (mut passed, mut failed) = (0usize, 0usize);
    for file in &files {
        let shown = file.display();
        let loaded = load(file).and_then(|t| {
            let wf_path = file.parent().unwrap_or(Path::new(".")).join(&t.workflow);
            let def = crate::cli::read_definition(&wf_path)?;
            let compiled = compile_new_workflow(&def).map_err(|problems| {
                let list: Vec<String> = problems
                    .iter()
                    .map(|d| format!("{}: {}", d.field, d.message))
                    .collect();
                format!(
                    "workflow {} does not compile: {}",
                    wf_path.display(),
                    list.join("; ")
                )
            })?;
            Ok((t, compiled))
        });
        let (test, compiled) = match loaded {
            Ok(ok) => ok,
            Err(e) => {
                failed += 1;
                crate::outln!("FAIL {shown}: {e}");
                continue;
            }
        };
        for case in &test.cases {
            let result = run_case(&runtime, &compiled, &test.connectors, case)
                .and_then(|out| check(&case.expect, &out));
            match result {
                Ok(()) => {
                    passed += 1;
                    crate::outln!("ok   {shown} :: {}", case.name);
                }
                Err(why) => {
                    failed += 1;
                    crate::outln!("FAIL {shown} :: {}", case.name);
                    crate::out!("{why}");
                    if !why.ends_with('\n') {
                        crate::outln!();
                    }
                }
            }
        }
    }
    crate::outln!("{passed} passed, {failed} failed");
    if failed > 0 {
        ExitCode::FAILURE
    } else if passed == 0 {
        // Test files without a single case: nothing was run.
        crate::errln!("error: the test files hold no cases");
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subset_matches_by_expected_keys_and_numbers_by_value() {
        let actual = json!({"a": 1, "b": {"c": [1, 2.0], "d": "x"}});
        assert!(subset(&json!({"b": {"c": [1.0, 2]}}), &actual));
        assert!(subset(&json!({}), &actual));
        assert!(!subset(&json!({"b": {"c": [1]}}), &actual));
        assert!(!subset(&json!({"z": null}), &actual));
        assert!(!subset(&json!({"a": "1"}), &actual));
        assert!(subset(&json!(905.502), &json!(905.502_000_000_000_1)));
        assert!(!subset(&json!(905.502), &json!(905.503)));
    }

    #[test]
    fn projection_keeps_only_what_is_expected() {
        let actual = json!({"a": 1, "b": {"c": 2, "d": 3}, "list": [{"x": 1, "y": 2}, {"x": 5}]});
        let expected = json!({"b": {"c": 9}, "list": [{"x": 1}]});
        assert_eq!(
            project(&actual, &expected),
            json!({"b": {"c": 2}, "list": [{"x": 1}, {"x": 5}]})
        );
    }

    /// A stubbed cache answer reaches the workflow as the same JSON value,
    /// whatever its type: the stub hands back its JSON text.
    #[test]
    fn cache_stubs_answer_in_the_stored_form() {
        let values = [
            json!("5"),
            json!("abc"),
            json!("{\"a\":1}"),
            json!(5),
            json!(true),
            json!({"a": [1]}),
        ];
        let answers = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                serde_json::from_value(json!({"match": {"key": format!("k{i}")}, "response": v}))
                    .unwrap()
            })
            .collect();
        let stubs = Stubs {
            answers: HashMap::from([("c".to_string(), answers)]),
            writes: Mutex::default(),
        };
        let scope = CallScope::default();
        for (i, v) in values.iter().enumerate() {
            let text = futures_executor(stubs.get(&scope, "c", &format!("k{i}")))
                .unwrap()
                .unwrap();
            assert_eq!(serde_json::from_str::<Json>(&text).unwrap(), *v, "{text}");
        }
    }

    fn futures_executor<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn diff_marks_expected_and_actual_lines() {
        let d = diff(&json!({"a": 1}), &json!({"a": 2}));
        assert!(d.contains("-  \"a\": 1"), "{d}");
        assert!(d.contains("+  \"a\": 2"), "{d}");
    }
}
