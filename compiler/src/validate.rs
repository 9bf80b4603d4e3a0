//! Strict validation of workflow, channel and connector definitions, and the
//! secret masking applied to everything shown back to users.
//!
//! The validators walk the raw `serde_json::Value` rather than the serde types
//! in [`crate::def`], because serde stops at the first error while the admin
//! API must report every problem at once with a path mirroring the submitted
//! JSON. A definition with no diagnostics deserializes into the `def` types;
//! the tests hold the two in step.
//!
//! Conventions (recorded in docs/decisions.md):
//! - A problem with the document itself (not a JSON object) has field `""`.
//! - An explicit `null` is not "absent": where a typed value is expected it is
//!   `expected <type>, got null`. JSONLogic and `any` fields accept anything.
//! - Unknown keys are ignored, except inside a channel's `config_json`.
//! - JSONLogic is not compiled here; the logic compiler reports its errors.

use crate::def::{
    ChannelConfig, ChannelDef, ChannelStatus, ConnectorDef, ConnectorType, GroupDef, HaltOn,
    HttpMethod, LoopDef, RetryPolicy, SaslConfig, WorkflowDef, WorkflowStatus,
};
use crate::diag::{Diagnostic, FieldPath, RuleRoot};
use crate::functions::{Constraint, FieldSchema, FieldType, Function};
use serde_json::{Map, Value as Json};
use std::collections::HashMap;

/// Longest identifier (`workflow_id`, `channel_id`, channel and connector names).
pub const MAX_ID_LEN: usize = 128;
/// Longest workflow `name`.
pub const MAX_NAME_LEN: usize = 255;
/// Longest `description`.
pub const MAX_DESCRIPTION_LEN: usize = 2048;

const ID_RULE: &str = "must start with an ASCII letter or digit and contain only ASCII letters, digits, '.', '-', '_'";

/// Collects diagnostics; every check pushes and carries on.
#[derive(Default)]
struct Ctx {
    out: Vec<Diagnostic>,
    /// Also apply the rules added after definitions were first stored
    /// (`validate_new_workflow`): a new definition must follow them, a
    /// stored one still loads without (an upgrade must not stop serving).
    strict: bool,
}

impl Ctx {
    fn push(&mut self, at: &FieldPath, message: impl Into<String>) {
        self.out.push(Diagnostic::new(at.as_str(), message));
    }

    fn required(&mut self, at: &FieldPath) {
        self.out.push(Diagnostic::required(at));
    }

    fn mismatch(&mut self, at: &FieldPath, expected: &str, got: &Json) {
        self.out.push(Diagnostic::type_mismatch(at, expected, got));
    }

    /// The root must be an object; otherwise one diagnostic and `None`.
    fn root<'a>(&mut self, def: &'a Json) -> Option<&'a Map<String, Json>> {
        let obj = def.as_object();
        if obj.is_none() {
            self.mismatch(&FieldPath::root(), "object", def);
        }
        obj
    }

    // Typed accessors. Each returns the value when it is present and of the
    // right type; otherwise it reports (missing only when `required`) and
    // returns `None`, so callers can skip dependent checks.

    fn string<'a>(
        &mut self,
        obj: &'a Map<String, Json>,
        key: &str,
        at: &FieldPath,
        required: bool,
    ) -> Option<&'a str> {
        match obj.get(key) {
            None => {
                if required {
                    self.required(&at.key(key));
                }
                None
            }
            Some(Json::String(s)) => Some(s),
            Some(other) => {
                self.mismatch(&at.key(key), "string", other);
                None
            }
        }
    }

    /// A required string that must not be blank.
    fn nonempty_string<'a>(
        &mut self,
        obj: &'a Map<String, Json>,
        key: &str,
        at: &FieldPath,
        required: bool,
    ) -> Option<&'a str> {
        let s = self.string(obj, key, at, required)?;
        if s.trim().is_empty() {
            self.push(&at.key(key), empty_or_blank(s));
            return None;
        }
        Some(s)
    }

    fn max_len(&mut self, obj: &Map<String, Json>, key: &str, at: &FieldPath, max: usize) {
        if let Some(s) = self.string(obj, key, at, false)
            && s.chars().count() > max
        {
            self.push(&at.key(key), format!("must be at most {max} characters"));
        }
    }

    fn boolean(&mut self, obj: &Map<String, Json>, key: &str, at: &FieldPath) {
        if let Some(v) = obj.get(key)
            && !v.is_boolean()
        {
            self.mismatch(&at.key(key), "boolean", v);
        }
    }

    fn object<'a>(
        &mut self,
        obj: &'a Map<String, Json>,
        key: &str,
        at: &FieldPath,
        required: bool,
    ) -> Option<&'a Map<String, Json>> {
        match obj.get(key) {
            None => {
                if required {
                    self.required(&at.key(key));
                }
                None
            }
            Some(Json::Object(m)) => Some(m),
            Some(other) => {
                self.mismatch(&at.key(key), "object", other);
                None
            }
        }
    }

    /// An integer within `min..=max` (inclusive; `None` means unbounded).
    /// Integers only: `5.0` is a number, not an integer, exactly as the serde
    /// types (`u32`, `u64`, `i64`) see it.
    fn integer(
        &mut self,
        obj: &Map<String, Json>,
        key: &str,
        at: &FieldPath,
        required: bool,
        min: Option<i64>,
        max: Option<i64>,
    ) -> Option<i64> {
        let at = at.key(key);
        let v = match obj.get(key) {
            None => {
                if required {
                    self.required(&at);
                }
                return None;
            }
            Some(v) => v,
        };
        let n = match v.as_i64() {
            Some(n) => n,
            None if crate::diag::is_huge_integer(v) => {
                // Beyond i64: over any upper bound (or under any lower one),
                // and out of range for the serde types otherwise. The
                // message names the range either way.
                let negative = v.as_f64().is_some_and(|f| f < 0.0);
                let msg = match (negative, max) {
                    (false, Some(_)) => range_message(min, max),
                    (false, None) => range_message(min, Some(i64::MAX)),
                    (true, _) => range_message(Some(min.unwrap_or(i64::MIN)), max),
                };
                self.push(&at, msg.unwrap_or_default());
                return None;
            }
            None => {
                self.mismatch(&at, "integer", v);
                return None;
            }
        };
        if min.is_some_and(|m| n < m) || max.is_some_and(|m| n > m) {
            self.push(&at, range_message(min, max).unwrap_or_default());
            return None;
        }
        Some(n)
    }

    fn string_array<'a>(
        &mut self,
        obj: &'a Map<String, Json>,
        key: &str,
        at: &FieldPath,
        required: bool,
    ) -> Option<Vec<&'a str>> {
        let at = at.key(key);
        let items = match obj.get(key) {
            None => {
                if required {
                    self.required(&at);
                }
                return None;
            }
            Some(Json::Array(items)) => items,
            Some(other) => {
                self.mismatch(&at, "array", other);
                return None;
            }
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match item {
                Json::String(s) => out.push(s.as_str()),
                other => self.mismatch(&at.index(i), "string", other),
            }
        }
        Some(out)
    }

    /// A string that must be one of `allowed` (exact match).
    fn one_of<'a>(
        &mut self,
        obj: &'a Map<String, Json>,
        key: &str,
        at: &FieldPath,
        required: bool,
        allowed: &[&str],
    ) -> Option<&'a str> {
        let s = self.string(obj, key, at, required)?;
        if allowed.contains(&s) {
            Some(s)
        } else {
            self.push(&at.key(key), one_of_message(allowed, s));
            None
        }
    }

    /// An identifier field (`workflow_id`, `channel_id`, names of channels and
    /// connectors): 1..=128 characters of `[A-Za-z0-9._-]`, starting with a
    /// letter or digit. It is used in URLs and routing, hence the charset.
    fn identifier<'a>(
        &mut self,
        obj: &'a Map<String, Json>,
        key: &str,
        at: &FieldPath,
        required: bool,
    ) -> Option<&'a str> {
        let s = self.string(obj, key, at, required)?;
        let at = at.key(key);
        if s.is_empty() {
            self.push(&at, "must not be empty");
            return None;
        }
        let mut ok = true;
        if s.chars().count() > MAX_ID_LEN {
            self.push(&at, format!("must be at most {MAX_ID_LEN} characters"));
            ok = false;
        }
        if !is_identifier(s) {
            self.push(&at, ID_RULE);
            ok = false;
        }
        ok.then_some(s)
    }

    /// An identifier that would name a fixed endpoint instead of the resource
    /// (`/api/v1/admin/workflows/export` is the export, so a workflow with
    /// that id could be created but never read or deleted).
    fn not_reserved(&mut self, id: Option<&str>, at: &FieldPath, reserved: &[&str], under: &str) {
        if let Some(id) = id
            && reserved.contains(&id)
        {
            self.push(
                at,
                format!("'{id}' is reserved: {under}{id} is an endpoint of its own"),
            );
        }
    }
}

/// Identifiers taken by fixed paths beside `{id}`: a resource named so could
/// not be reached at its own path.
const RESERVED_WORKFLOW_IDS: &[&str] = &["export", "import", "validate"];
const RESERVED_CHANNEL_IDS: &[&str] = &["import"];
/// `/api/v1/data/traces[/{id}]` reads async traces before channels are routed.
const RESERVED_CHANNEL_NAMES: &[&str] = &["traces"];
const RESERVED_CONNECTOR_NAMES: &[&str] = &["circuit-breakers", "import", "reload"];

fn range_message(min: Option<i64>, max: Option<i64>) -> Option<String> {
    Some(match (min, max) {
        (Some(0), None) => "must not be negative".to_owned(),
        (Some(lo), Some(hi)) => format!("must be between {lo} and {hi}"),
        (Some(lo), None) => format!("must be at least {lo}"),
        (None, Some(hi)) => format!("must be at most {hi}"),
        (None, None) => return None,
    })
}

/// The message for a string with nothing but whitespace in it: "empty"
/// would misread `"  "` (audit 66).
fn empty_or_blank(s: &str) -> &'static str {
    if s.is_empty() {
        "must not be empty"
    } else {
        "must not be blank (only whitespace)"
    }
}

fn one_of_message(allowed: &[&str], got: &str) -> String {
    format!("must be one of {}, got '{got}'", allowed.join(", "))
}

/// `[A-Za-z0-9][A-Za-z0-9._-]*` (ASCII only).
pub fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

/// `[A-Za-z_][A-Za-z0-9_]*`: a valid name after `env://`.
pub fn is_env_var_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The prefix that makes a connector string an environment reference.
pub const ENV_PREFIX: &str = "env://";

/// Whether `s` is an `env://VAR` reference (well-formed or not).
pub fn is_env_ref(s: &str) -> bool {
    s.starts_with(ENV_PREFIX)
}

// ---------------------------------------------------------------- workflows

/// Validates a workflow definition; empty means valid.
pub fn validate_workflow(def: &Json) -> Vec<Diagnostic> {
    workflow_problems(def, false)
}

/// [`validate_workflow`] with the rules a stored definition may predate
/// (session 20: a plain task's `loop`, a blank task or group name, a static
/// `publish_kafka.topic` no broker takes). The admin API's create, update,
/// import and validate and `sluice lint` apply them; engine loads do not, so
/// a definition stored before them keeps being served as it was.
pub fn validate_new_workflow(def: &Json) -> Vec<Diagnostic> {
    workflow_problems(def, true)
}

fn workflow_problems(def: &Json, strict: bool) -> Vec<Diagnostic> {
    let mut c = Ctx {
        strict,
        ..Ctx::default()
    };
    let Some(obj) = c.root(def) else { return c.out };
    let root = FieldPath::root();
    no_nul(&mut c, def, &root);

    let workflow_id = c.identifier(obj, "workflow_id", &root, false);
    let id = c.identifier(obj, "id", &root, false);
    let admin = "/api/v1/admin/workflows/";
    c.not_reserved(
        workflow_id,
        &root.key("workflow_id"),
        RESERVED_WORKFLOW_IDS,
        admin,
    );
    c.not_reserved(id, &root.key("id"), RESERVED_WORKFLOW_IDS, admin);
    if let (Some(a), Some(b)) = (workflow_id, id)
        && a != b
    {
        c.push(
            &root.key("id"),
            "must equal workflow_id when both are given",
        );
    }

    if let Some(name) = c.nonempty_string(obj, "name", &root, true)
        && name.chars().count() > MAX_NAME_LEN
    {
        c.push(
            &root.key("name"),
            format!("must be at most {MAX_NAME_LEN} characters"),
        );
    }
    c.max_len(obj, "description", &root, MAX_DESCRIPTION_LEN);
    c.integer(obj, "priority", &root, false, None, None);
    // `condition` is JSONLogic: any JSON value.
    c.string_array(obj, "tags", &root, false);
    c.boolean(obj, "continue_on_error", &root);
    c.nonempty_string(obj, "channel", &root, false);
    c.one_of(obj, "status", &root, false, WorkflowStatus::NAMES);
    c.integer(obj, "version", &root, false, Some(1), None);
    c.integer(obj, "rollout_percentage", &root, false, Some(1), Some(100));
    if let Some(r) = c.object(obj, "rollout", &root, false) {
        let at = root.key("rollout");
        // An empty or inverted range is legal (it accepts nothing), per spec.
        c.integer(r, "bucket_start", &at, false, Some(0), Some(100));
        c.integer(r, "bucket_end", &at, false, Some(0), Some(100));
    }
    check_loop(&mut c, obj, &root);
    c.string(obj, "created_at", &root, false);
    c.string(obj, "updated_at", &root, false);

    let mut walker = StepWalker {
        c: &mut c,
        seen: HashMap::new(),
    };
    match obj.get("tasks") {
        None => walker.c.required(&root.key("tasks")),
        Some(tasks) => walker.steps(tasks, &root.key("tasks"), 0, false),
    }
    c.out
}

/// `loop: {max, init?, increment?, counter?}` on a workflow or a group.
fn check_loop(c: &mut Ctx, obj: &Map<String, Json>, at: &FieldPath) {
    let Some(l) = c.object(obj, "loop", at, false) else {
        return;
    };
    let at = at.key("loop");
    c.integer(
        l,
        "max",
        &at,
        true,
        Some(1),
        Some(i64::from(LoopDef::MAX_ITERATIONS)),
    );
    if let Some(v) = l.get("init")
        && !v.is_number()
    {
        c.mismatch(&at.key("init"), "number", v);
    }
    match l.get("increment") {
        Some(v) if !v.is_number() => c.mismatch(&at.key("increment"), "number", v),
        Some(v) if v.as_f64() == Some(0.0) => c.push(&at.key("increment"), "must not be zero"),
        _ => {}
    }
    if let Some(counter) = c.nonempty_string(l, "counter", &at, false) {
        check_write_path(c, counter, &at.key("counter"));
    }
}

/// A dotted write path: no empty segments, and never into the read-only
/// `payload`.
fn check_write_path(c: &mut Ctx, path: &str, at: &FieldPath) {
    if crate::path::has_empty_piece(path) {
        c.push(at, "must be a dotted path without empty segments");
    } else if path == "payload" || path.starts_with("payload.") {
        c.push(at, "must not write into payload, which is read-only");
    }
}

/// Walks steps depth-first, remembering where each id was first used.
struct StepWalker<'c> {
    c: &'c mut Ctx,
    seen: HashMap<String, FieldPath>,
}

impl StepWalker<'_> {
    /// `tasks` is the value of a `tasks` key (top level or in a group at
    /// `depth`); `too_deep` is set once the depth error was reported on this
    /// branch, so one over-deep branch gives one diagnostic.
    fn steps(&mut self, tasks: &Json, at: &FieldPath, depth: usize, too_deep: bool) {
        let Some(items) = tasks.as_array() else {
            self.c.mismatch(at, "array", tasks);
            return;
        };
        if items.is_empty() {
            self.c.push(at, "must not be empty");
        }
        for (i, step) in items.iter().enumerate() {
            let at = at.index(i);
            let Some(obj) = step.as_object() else {
                self.c.mismatch(&at, "object", step);
                continue;
            };
            if obj.contains_key("tasks") {
                self.group(obj, &at, depth + 1, too_deep);
            } else {
                self.task(obj, &at);
            }
        }
    }

    fn step_id(&mut self, obj: &Map<String, Json>, at: &FieldPath) {
        let Some(id) = self.c.nonempty_string(obj, "id", at, true) else {
            return;
        };
        match self.seen.get(id) {
            Some(first) => {
                let msg = format!("duplicate step id '{id}' (first used at {first})");
                self.c.push(&at.key("id"), msg);
            }
            None => {
                self.seen.insert(id.to_owned(), at.clone());
            }
        }
    }

    fn group(&mut self, obj: &Map<String, Json>, at: &FieldPath, depth: usize, too_deep: bool) {
        let mut too_deep = too_deep;
        if depth > GroupDef::MAX_DEPTH && !too_deep {
            self.c.push(
                at,
                format!("groups nest deeper than {} levels", GroupDef::MAX_DEPTH),
            );
            too_deep = true;
        }
        self.step_id(obj, at);
        if self.c.strict {
            self.c.nonempty_string(obj, "name", at, false);
        } else {
            self.c.string(obj, "name", at, false);
        }
        self.c.string(obj, "description", at, false);
        self.c.boolean(obj, "terminal", at);
        self.c.boolean(obj, "continue_on_error", at);
        if obj.contains_key("halt_on") {
            self.c
                .push(&at.key("halt_on"), "halt_on is not allowed on a group");
        }
        if obj.contains_key("function") {
            self.c.push(
                &at.key("function"),
                "function is not allowed on a group (a step with tasks is a group)",
            );
        }
        check_loop(self.c, obj, at);
        self.steps(&obj["tasks"], &at.key("tasks"), depth, too_deep);
    }

    fn task(&mut self, obj: &Map<String, Json>, at: &FieldPath) {
        self.step_id(obj, at);
        if self.c.strict {
            self.c.nonempty_string(obj, "name", at, true);
        } else {
            self.c.string(obj, "name", at, true);
        }
        self.c.string(obj, "description", at, false);
        self.c.boolean(obj, "continue_on_error", at);
        self.c.boolean(obj, "terminal", at);
        self.c.one_of(obj, "halt_on", at, false, HaltOn::NAMES);
        // A task runs once per pass of what holds it; before session 20 a
        // task's own `loop` was kept and did nothing.
        if self.c.strict && obj.contains_key("loop") {
            self.c.push(
                &at.key("loop"),
                "loop is allowed on the workflow and on groups, not on a task (put the task in a group: {\"id\": \"…\", \"loop\": {…}, \"tasks\": [the task]})",
            );
        }
        let Some(func) = self.c.object(obj, "function", at, true) else {
            return;
        };
        let at = at.key("function");
        let function = match self.c.string(func, "name", &at, true) {
            Some(name) => {
                let f = Function::from_name(name);
                if f.is_none() {
                    self.c
                        .push(&at.key("name"), format!("unknown function '{name}'"));
                }
                f
            }
            None => None,
        };
        let empty = Map::new();
        let input = match func.get("input") {
            None => &empty,
            Some(Json::Object(m)) => m,
            Some(other) => {
                self.c.mismatch(&at.key("input"), "object", other);
                return;
            }
        };
        if let Some(f) = function
            && f.checked_at_create()
        {
            check_input(self.c, f, input, &at.key("input"));
        }
    }
}

/// Schema-checks a connector or composition function's `input` against the
/// catalogue, then applies the cross-field rules the table cannot express.
fn check_input(c: &mut Ctx, f: Function, input: &Map<String, Json>, at: &FieldPath) {
    for field in f.input_schema() {
        let fat = at.key(field.name);
        match input.get(field.name) {
            // A required field with a `<name>_logic` twin may be computed instead.
            None if field.required && !has_logic_twin(f, field.name, input) => c.required(&fat),
            None => {}
            Some(v) => check_field(c, field, v, &fat),
        }
    }
    // Where a connector's answer is written: a path with an empty segment
    // would write under the key "" (as a `map` path would).
    for key in ["output", "response_path"] {
        if let Some(Json::String(path)) = input.get(key)
            && crate::plan::has_empty_segment(path)
        {
            c.push(&at.key(key), crate::plan::empty_segment_message(path));
        }
    }
    // Static headers are sent as they are: a name or value no HTTP
    // request can carry is refused here, as in a connector's headers.
    if f == Function::HttpCall
        && let Some(Json::Object(headers)) = input.get("headers")
    {
        let hat = at.key("headers");
        let strict = c.strict;
        for (k, v) in headers {
            check_header_name(c, k, &hat.key(k));
            if strict {
                check_not_framing(c, k, &hat.key(k));
            }
            if let Some(v) = v.as_str() {
                check_header_value(c, v, &hat.key(k));
            }
        }
    }
    // A static topic is checked as a Kafka channel's is (it failed only at
    // run time, with a 502 from the broker).
    if f == Function::PublishKafka
        && c.strict
        && let Some(Json::String(topic)) = input.get("topic")
        && !topic.trim().is_empty()
        && !is_kafka_topic(topic)
    {
        c.push(&at.key("topic"), KAFKA_TOPIC_RULE);
    }
    // The statement fits the function (spec: db_read runs SELECT, db_write
    // INSERT/UPDATE/DELETE): a DELETE in db_read ran and answered `[]`, and a
    // SELECT in db_write answered the previous statement's row count on
    // SQLite. A write that returns rows (`… RETURNING`) is a read too.
    if matches!(f, Function::DbRead | Function::DbWrite)
        && c.strict
        && let Some(Json::String(query)) = input.get("query")
    {
        const WRITES: &[&str] = &[
            "INSERT", "UPDATE", "DELETE", "REPLACE", "MERGE", "UPSERT", "CREATE", "DROP", "ALTER",
            "TRUNCATE", "GRANT", "REVOKE",
        ];
        const READS: &[&str] = &[
            "SELECT", "SHOW", "EXPLAIN", "DESCRIBE", "DESC", "VALUES", "TABLE",
        ];
        // Read as MySQL/MariaDB and as PostgreSQL/SQLite read it (comments,
        // escapes and quoting differ): the first keyword of either reading
        // counts, and RETURNING counts only when both readings see it as a
        // keyword (not `AS returning`). This is a guard against mistakes (a
        // DELETE put in db_read), not a boundary: whoever writes workflows
        // can run any statement through db_write, and the database grant
        // decides.
        let readings = [
            sql_words(query, Dialect::MySql),
            sql_words(query, Dialect::Postgres),
        ];
        let firsts = [first_word(&readings[0]), first_word(&readings[1])];
        // One statement per task: SQLite ran every statement of
        // `SELECT 1; DROP TABLE t` (a read that wrote), where PostgreSQL and
        // MariaDB refuse the text at run time. Counted when both readings
        // see more than one (a `;` inside a string of either dialect does not
        // count); a trailing `;` is no second statement.
        let counts = [statements(&readings[0]), statements(&readings[1])];
        if counts.iter().all(|&n| n > 1) {
            c.push(
                &at.key("query"),
                format!(
                    "{} runs one statement; this query holds {} separated by ';' \
                     (run each in a task of its own)",
                    f.name(),
                    counts[0].min(counts[1])
                ),
            );
        }
        let returns = |words: &[String]| {
            words
                .iter()
                .enumerate()
                .any(|(i, w)| w == "RETURNING" && (i == 0 || words[i - 1] != "AS"))
        };
        if f == Function::DbRead
            && let Some(kw) = firsts
                .iter()
                .flatten()
                .find(|w| WRITES.contains(&w.as_str()))
            && !readings.iter().all(|r| returns(r))
        {
            c.push(
                &at.key("query"),
                format!(
                    "db_read runs a query that returns rows (SELECT, or a write with RETURNING); \
                     a {kw} belongs in db_write"
                ),
            );
        }
        if f == Function::DbWrite
            && let Some(kw) = firsts
                .iter()
                .flatten()
                .find(|w| READS.contains(&w.as_str()))
        {
            c.push(
                &at.key("query"),
                format!(
                    "db_write runs INSERT, UPDATE or DELETE and answers rows_affected; \
                     a {kw} belongs in db_read"
                ),
            );
        }
    }
    if f == Function::ChannelCall {
        let has = |k: &str| input.contains_key(k);
        if has("channel") == has("channel_logic") {
            c.push(at, "exactly one of channel, channel_logic is required");
        }
        if has("data") && has("data_logic") {
            c.push(at, "at most one of data, data_logic is allowed");
        }
    }
}

/// The longest deduplication window and cache TTL, one year: Redis takes
/// them in milliseconds as a 64-bit count, and past about 292,000 years
/// every keyed request failed on the shared backend (503) while the memory
/// backend took them.
pub const MAX_GOVERNANCE_SECS: i64 = 31_536_000;

/// Why a `rediss://…#insecure` URL is refused (cache connectors and
/// `governance.redis_url`): the Redis client is built without that mode.
pub const REDIS_INSECURE: &str = "#insecure (TLS without a certificate check) is not supported; use a certificate the system trusts";

/// The most connections a `db` connector's pool may open (and the
/// service's own storage pool, `storage.max_connections`).
pub const DB_MAX_CONNECTIONS: i64 = 1000;

/// How an SQL text is read by [`sql_words`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dialect {
    /// MySQL and MariaDB: `#` comments, flat `/* */` comments whose
    /// `/*! … */` and `/*M! … */` forms are code, backslash escapes in
    /// quoted strings.
    MySql,
    /// PostgreSQL: nested `/* */` comments, no backslash escapes (but in
    /// `E'…'`), dollar-quoted strings.
    Postgres,
    /// SQLite: flat `/* */` comments, no backslash escapes, no dollar
    /// quotes (`$a` is a parameter), no `#` comments.
    Sqlite,
}

/// How many statements SQLite reads in `query` (runs of words between
/// `;`). SQLite is the one backend that runs every statement of a text:
/// its connector refuses more than one at run time, read exactly as SQLite
/// reads it (the definition check reads MySQL's and PostgreSQL's way, and
/// a text read differently by the dialects could pass it).
pub fn sqlite_statements(query: &str) -> usize {
    statements(&sql_words(query, Dialect::Sqlite))
}

/// The words of an SQL statement that are keywords or names, upper-cased, in
/// order, as `dialect` reads it: what is left after comments (`--`, and the
/// dialect's own), string literals, quoted names (`"…"`, `` `…` ``,
/// `[…]`) and dollar-quoted strings.
fn sql_words(sql: &str, dialect: Dialect) -> Vec<String> {
    let mysql = dialect == Dialect::MySql;
    let sqlite = dialect == Dialect::Sqlite;
    let b = sql.as_bytes();
    let mut words = Vec::new();
    let mut i = 0;
    // Skips to just after the first `end` at or after `from` (or the end).
    let past = |from: usize, end: &[u8]| {
        b[from..]
            .windows(end.len())
            .position(|w| w == end)
            .map_or(b.len(), |p| from + p + end.len())
    };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        match c {
            b'-' if next == Some(b'-') => i = past(i, b"\n"),
            b'#' if mysql => i = past(i, b"\n"),
            b'/' if next == Some(b'*') => {
                let rest = &b[i + 2..];
                if mysql && (rest.starts_with(b"!") || rest.starts_with(b"M!")) {
                    // `/*!50000 DELETE … */`: MySQL and MariaDB run it.
                    i += if rest.starts_with(b"!") { 3 } else { 4 };
                    while i < b.len() && b[i].is_ascii_digit() {
                        i += 1;
                    }
                } else if mysql || sqlite {
                    i = past(i + 2, b"*/");
                } else {
                    let mut depth = 0usize;
                    while i < b.len() {
                        if b[i..].starts_with(b"/*") {
                            depth += 1;
                            i += 2;
                        } else if b[i..].starts_with(b"*/") {
                            depth -= 1;
                            i += 2;
                            if depth == 0 {
                                break;
                            }
                        } else {
                            i += 1;
                        }
                    }
                }
            }
            b'\'' | b'"' | b'`' | b'[' => {
                let close = if c == b'[' { b']' } else { c };
                // Backslash escapes: MySQL's strings, PostgreSQL's E'…'.
                let escapes = c != b'['
                    && c != b'`'
                    && (mysql
                        || (c == b'\''
                            && !sqlite
                            && i > 0
                            && b[i - 1].eq_ignore_ascii_case(&b'e')
                            && !(i > 1 && (b[i - 2].is_ascii_alphanumeric() || b[i - 2] == b'_'))));
                i += 1;
                while i < b.len() {
                    if escapes && b[i] == b'\\' {
                        i += 2;
                    } else if b[i] == close {
                        i += 1;
                        // A doubled quote is one quote inside the text.
                        if close == b']' || b.get(i) != Some(&close) {
                            break;
                        }
                        i += 1;
                    } else {
                        i += 1;
                    }
                }
            }
            b'$' if !mysql && !sqlite => {
                // `$tag$ … $tag$` (tag empty or a name, any letters; `$1`
                // is a parameter).
                let tag_end = b[i + 1..]
                    .iter()
                    .position(|&t| !(t.is_ascii_alphanumeric() || t == b'_' || t >= 0x80))
                    .map(|p| i + 1 + p);
                match tag_end {
                    Some(e) if b[e] == b'$' && !b.get(i + 1).is_some_and(u8::is_ascii_digit) => {
                        let tag = &b[i..=e];
                        i = past(e + 1, tag);
                    }
                    _ => i += 1,
                }
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'$')
                {
                    i += 1;
                }
                words.push(sql[start..i].to_ascii_uppercase());
            }
            b';' => {
                words.push(";".to_owned());
                i += 1;
            }
            _ => i += 1,
        }
    }
    words
}

/// The first keyword of a statement text read by [`sql_words`].
fn first_word(words: &[String]) -> Option<&String> {
    words.iter().find(|w| *w != ";")
}

/// How many statements [`sql_words`] read: runs of words between `;`.
fn statements(words: &[String]) -> usize {
    words
        .split(|w| w == ";")
        .filter(|run| !run.is_empty())
        .count()
}

fn has_logic_twin(f: Function, name: &str, input: &Map<String, Json>) -> bool {
    f.input_schema()
        .iter()
        .any(|t| t.name.strip_suffix("_logic") == Some(name) && input.contains_key(t.name))
}

fn check_field(c: &mut Ctx, field: &FieldSchema, v: &Json, at: &FieldPath) {
    let ok = match field.ty {
        FieldType::String => v.is_string(),
        FieldType::Number => v.is_number(),
        FieldType::Integer => v.is_i64() || v.is_u64(),
        FieldType::Boolean => v.is_boolean(),
        FieldType::Object => v.is_object(),
        FieldType::Array => v.is_array(),
        FieldType::Any | FieldType::Jsonlogic => true,
    };
    if !ok {
        c.mismatch(at, field.ty.name(), v);
        return;
    }
    // A required string names something (a connector, a query, a key);
    // an empty one can never work. So does `channel_call.channel`, which is
    // optional only because `channel_logic` may stand in for it.
    if (field.required || field.name == "channel")
        && let Some(s) = v.as_str().filter(|s| s.trim().is_empty())
    {
        c.push(at, empty_or_blank(s));
    }
    match field.constraint {
        Constraint::None => {}
        Constraint::OneOf(allowed) => {
            if let Some(s) = v.as_str()
                && !allowed.contains(&s)
            {
                c.push(at, one_of_message(allowed, s));
            }
        }
        Constraint::Positive => {
            if v.as_f64().is_some_and(|n| n <= 0.0) {
                c.push(at, "must be greater than 0");
            }
        }
        Constraint::StringMap => {
            if let Some(m) = v.as_object() {
                for (k, item) in m {
                    if !item.is_string() {
                        c.mismatch(&at.key(k), "string", item);
                    }
                }
            }
        }
    }
}

/// The slowest rate a `rate_limit` may have: one request a day.
pub const MIN_REQUESTS_PER_SECOND: f64 = 1.0 / 86_400.0;

// ----------------------------------------------------------------- channels

/// Validates a channel definition; empty means valid.
/// The fields a channel may have (the spec's, the server-managed ones an
/// export carries, and `$schema` for editors).
const CHANNEL_KEYS: &[&str] = &[
    "channel_id",
    "name",
    "description",
    "channel_type",
    "protocol",
    "route_pattern",
    "methods",
    "workflow_id",
    "config_json",
    "validation_logic",
    "priority",
    "status",
    "version",
    "created_at",
    "updated_at",
    "$schema",
];

/// An `unknown field, ignored` warning for each key of `obj` at `at` that
/// is not in `known`.
fn unknown_key_warnings(
    at: &FieldPath,
    obj: &Map<String, Json>,
    known: &[&str],
) -> Vec<Diagnostic> {
    obj.keys()
        .filter(|k| !known.contains(&k.as_str()))
        .map(|k| {
            Diagnostic::new(
                at.key(k).as_str(),
                format!(
                    "{}; expected one of {}",
                    crate::diag::UNKNOWN_FIELD,
                    known.join(", ")
                ),
            )
        })
        .collect()
}

/// A channel's warnings: each top-level key it does not have (a misspelt
/// `validaton_logic` would otherwise be stored and do nothing), as a
/// workflow's unknown keys are warned of. (Inside `config_json` an unknown
/// key is an error.)
pub fn channel_warnings(def: &Json) -> Vec<Diagnostic> {
    let Some(obj) = def.as_object() else {
        return Vec::new();
    };
    let mut out = unknown_key_warnings(&FieldPath::root(), obj, CHANNEL_KEYS);
    // Reads outside what the rules are evaluated against (`payload.x`, or
    // `metadata.headers.x` as a workflow writes it) are always missing.
    let config = obj.get("config_json");
    let rules = [(
        obj.get("validation_logic"),
        "validation_logic".to_owned(),
        RuleRoot::ChannelValidation,
    )]
    .into_iter()
    .chain(
        ["rate_limit", "deduplication", "cache"]
            .into_iter()
            .map(|part| {
                (
                    config
                        .and_then(|c| c.get(part))
                        .and_then(|p| p.get("key_logic")),
                    format!("config_json.{part}.key_logic"),
                    RuleRoot::ChannelKey,
                )
            }),
    );
    for (rule, field, root) in rules {
        if let Some(logic) = rule
            .filter(|r| !r.is_null())
            .and_then(|r| crate::logic::compile(r).ok())
        {
            crate::diag::stray_reads(&logic, &field, root, &mut out);
            if root == RuleRoot::ChannelValidation {
                crate::diag::constant_rule(
                    &logic,
                    &field,
                    "request",
                    crate::logic::truthy_json,
                    &mut out,
                );
            }
        }
    }
    // Other frameworks' parameter syntax, or the data plane's own prefix,
    // are matched as literal text: the route never matches what was meant
    // (audit 113: `/orders/:id` answered "No route matches" without a hint).
    if let Some(pattern) = obj.get("route_pattern").and_then(Json::as_str) {
        if pattern.starts_with("/api/v1/data/") || pattern == "/api/v1/data" {
            out.push(Diagnostic::new(
                "route_pattern",
                "routes are relative to /api/v1/data (this one matches /api/v1/data/api/v1/data/…); \
                 leave the prefix out",
            ));
        }
        for segment in pattern.split('/') {
            let literal = segment.starts_with(':')
                || (segment.starts_with('<') && segment.ends_with('>'))
                || segment.contains('*');
            if literal {
                out.push(Diagnostic::new(
                    "route_pattern",
                    format!(
                        "segment '{segment}' is matched literally; write a path parameter as {{name}}"
                    ),
                ));
            }
        }
    }
    // CORS methods that allow none of the methods the channel serves: every
    // preflight would be refused (403), which looks like a browser problem.
    if let Some(Json::Array(allowed)) = obj
        .get("config_json")
        .and_then(|c| c.get("cors"))
        .and_then(|c| c.get("allowed_methods"))
    {
        let routed = obj.get("route_pattern").is_some_and(|r| !r.is_null());
        let served: Vec<&str> = match obj.get("methods") {
            Some(Json::Array(m)) if routed && !m.is_empty() => {
                m.iter().filter_map(Json::as_str).collect()
            }
            _ if routed => Vec::new(),
            // Called by name: POST alone.
            _ => vec!["POST"],
        };
        let serves = |m: &str| {
            served.iter().any(|s| {
                s.eq_ignore_ascii_case(m)
                    || (m.eq_ignore_ascii_case("HEAD") && s.eq_ignore_ascii_case("GET"))
            })
        };
        let any = allowed.iter().filter_map(Json::as_str).any(serves);
        if !served.is_empty() && !any {
            out.push(Diagnostic::new(
                "config_json.cors.allowed_methods",
                format!(
                    "allows none of the methods the channel serves ({}): every preflight is refused",
                    served.join(", ")
                ),
            ));
        }
    }
    // No origin at all: every browser request from another origin is
    // refused, which reads as a browser problem (audit 115).
    if let Some(Json::Array(origins)) = obj
        .get("config_json")
        .and_then(|c| c.get("cors"))
        .and_then(|c| c.get("allowed_origins"))
        && origins.is_empty()
    {
        out.push(Diagnostic::new(
            "config_json.cors.allowed_origins",
            "allows no origin: every cross-origin request and preflight is refused \
             (list the origins, or \"*\" for any)",
        ));
    }
    // Settings an async channel accepts and cannot use (a Kafka channel's
    // are errors; these stay warnings so stored channels keep loading).
    if obj.get("channel_type").and_then(Json::as_str) == Some("async")
        && let Some(Json::Object(cfg)) = obj.get("config_json")
    {
        if cfg.contains_key("backpressure") {
            out.push(Diagnostic::new(
                "config_json.backpressure",
                "ignored: an async channel's runs are bounded by queue.workers; \
                 backpressure sheds a sync channel's requests",
            ));
        }
        if cfg.contains_key("cache") {
            out.push(Diagnostic::new(
                "config_json.cache",
                "ignored: an async channel answers 202 with a new trace id, which is never cached",
            ));
        }
    }
    out
}

pub fn validate_channel(def: &Json) -> Vec<Diagnostic> {
    let mut c = Ctx::default();
    let Some(obj) = c.root(def) else { return c.out };
    let root = FieldPath::root();
    no_nul(&mut c, def, &root);

    let id = c.identifier(obj, "channel_id", &root, false);
    c.not_reserved(
        id,
        &root.key("channel_id"),
        RESERVED_CHANNEL_IDS,
        "/api/v1/admin/channels/",
    );
    // The name routes traffic (`/api/v1/data/{name}`), so it follows the
    // identifier rules.
    let name = c.identifier(obj, "name", &root, true);
    c.not_reserved(
        name,
        &root.key("name"),
        RESERVED_CHANNEL_NAMES,
        "/api/v1/data/",
    );
    let channel_type = c.one_of(obj, "channel_type", &root, false, &["sync", "async"]);
    let protocol = c.one_of(obj, "protocol", &root, false, &["rest", "http", "kafka"]);
    let has_route = obj.contains_key("route_pattern");
    let protocol = protocol.or(if obj.contains_key("protocol") {
        None // invalid, already reported; skip protocol-specific checks
    } else if has_route {
        Some("rest")
    } else {
        Some("http")
    });

    // route_pattern and methods are checked whenever present; required for rest.
    let rest = protocol == Some("rest");
    if let Some(pattern) = c.string(obj, "route_pattern", &root, rest) {
        check_route_pattern(&mut c, pattern, &root.key("route_pattern"));
    }
    // Each item's type and name are judged together, so the problems come
    // in the items' order.
    let at = root.key("methods");
    match obj.get("methods") {
        None if rest => c.required(&at),
        None => {}
        Some(Json::Array(items)) => {
            if items.is_empty() {
                c.push(&at, "must not be empty");
            }
            for (i, m) in items.iter().enumerate() {
                match m {
                    Json::String(s) if HttpMethod::NAMES.contains(&s.as_str()) => {
                        if let Some(first) = items[..i].iter().position(|x| x == m) {
                            c.push(
                                &at.index(i),
                                format!("duplicate method '{s}' (first at methods[{first}])"),
                            );
                        }
                    }
                    Json::String(s) => c.push(&at.index(i), one_of_message(HttpMethod::NAMES, s)),
                    other => c.mismatch(&at.index(i), "string", other),
                }
            }
        }
        Some(other) => c.mismatch(&at, "array", other),
    }
    if protocol == Some("kafka") {
        for key in ["route_pattern", "methods"] {
            if obj.contains_key(key) {
                c.push(
                    &root.key(key),
                    "does not apply to a kafka channel (it consumes config_json.topic)",
                );
            }
        }
    }
    // An `http` channel is routed by its name only: a route given to one
    // would be stored and never match.
    if protocol == Some("http") && obj.contains_key("protocol") {
        for key in ["route_pattern", "methods"] {
            if obj.contains_key(key) {
                c.push(
                    &root.key(key),
                    "does not apply to an http channel (routed by name; use protocol rest for a route)",
                );
            }
        }
    }
    if protocol == Some("kafka") && channel_type == Some("sync") {
        c.push(
            &root.key("channel_type"),
            "must be async for a kafka channel",
        );
    }

    c.identifier(obj, "workflow_id", &root, true);
    c.one_of(obj, "status", &root, false, ChannelStatus::NAMES);
    c.integer(obj, "version", &root, false, Some(1), None);
    c.max_len(obj, "description", &root, MAX_DESCRIPTION_LEN);
    c.integer(obj, "priority", &root, false, None, None);
    c.string(obj, "created_at", &root, false);
    c.string(obj, "updated_at", &root, false);
    logic(&mut c, obj, "validation_logic", &root);

    let config = c.object(obj, "config_json", &root, false);
    let at = root.key("config_json");
    match config {
        Some(cfg) => check_channel_config(&mut c, cfg, &at, protocol == Some("kafka")),
        None if protocol == Some("kafka") => c.required(&at.key("topic")),
        None => {}
    }
    c.out
}

/// `/orders/{order_id}`: starts with `/`, no empty segments (the bare `/` is
/// fine), every `{param}` is a whole segment with a unique name of
/// `[A-Za-z_][A-Za-z0-9_]*`, and the last segment is not `async` (that suffix
/// selects async mode and would make the route unreachable).
fn check_route_pattern(c: &mut Ctx, pattern: &str, at: &FieldPath) {
    let Some(rest) = pattern.strip_prefix('/') else {
        c.push(at, "must start with '/'");
        return;
    };
    if rest.is_empty() {
        return;
    }
    let mut params: Vec<&str> = Vec::new();
    let segments: Vec<&str> = rest.split('/').collect();
    if segments[0] == "traces" && segments.len() <= 2 {
        c.push(
            at,
            "must not be /traces or /traces/{…}: /api/v1/data/traces/{trace_id} reads async traces",
        );
    }
    for seg in &segments {
        if seg.is_empty() {
            c.push(
                at,
                "must not contain empty segments ('//' or a trailing '/')",
            );
            return;
        }
        if *seg == "." || *seg == ".." {
            // Clients and proxies resolve dot segments before sending
            // (RFC 3986 5.2.4), so no request could reach such a route.
            c.push(
                at,
                format!("segment '{seg}' cannot be requested: clients resolve '.' and '..'"),
            );
            continue;
        }
        if seg.contains('%') {
            // Requests are matched after percent-decoding, so `/x%20y`
            // was reached only by `/x%2520y`.
            c.push(
                at,
                format!(
                    "segment '{seg}' must not contain '%': requests are matched after percent-decoding; write the character itself"
                ),
            );
            continue;
        }
        if seg.contains(['?', '#']) || seg.chars().any(char::is_whitespace) {
            c.push(
                at,
                format!("segment '{seg}' must not contain '?', '#' or whitespace"),
            );
            continue;
        }
        if !seg.contains(['{', '}']) {
            continue;
        }
        let name = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}'));
        match name {
            // Parameter names follow the same rule as variable names.
            Some(name) if is_env_var_name(name) => {
                if params.contains(&name) {
                    c.push(at, format!("path parameter '{name}' is used more than once"));
                } else {
                    params.push(name);
                }
            }
            _ => c.push(
                at,
                format!(
                    "segment '{seg}' is not a well-formed parameter; write {{name}} as a whole segment, name of letters, digits and '_'"
                ),
            ),
        }
    }
    if segments.last() == Some(&"async") {
        c.push(at, "must not end in '/async', which selects async mode");
    }
}

fn check_channel_config(c: &mut Ctx, cfg: &Map<String, Json>, at: &FieldPath, kafka: bool) {
    unknown_keys(c, cfg, at, ChannelConfig::KEYS);
    c.integer(cfg, "timeout_ms", at, false, Some(1), None);

    if let Some(rl) = c.object(cfg, "rate_limit", at, false) {
        let at = at.key("rate_limit");
        unknown_keys(c, rl, &at, crate::def::RateLimitConfig::KEYS);
        match rl.get("requests_per_second") {
            None => c.required(&at.key("requests_per_second")),
            Some(v) if !v.is_number() => c.mismatch(&at.key("requests_per_second"), "number", v),
            Some(v) if v.as_f64().is_some_and(|n| n <= 0.0) => {
                c.push(&at.key("requests_per_second"), "must be greater than 0")
            }
            // Slower than one request a day is a typo (and the bucket's
            // arithmetic, in nanoseconds per token, would overflow).
            Some(v) if v.as_f64().is_some_and(|n| n < MIN_REQUESTS_PER_SECOND) => c.push(
                &at.key("requests_per_second"),
                "must be at least 1/86400 (one request a day)",
            ),
            Some(_) => {}
        }
        c.integer(rl, "burst", &at, false, Some(1), Some(i64::from(u32::MAX)));
        c.boolean(rl, "fail_open", &at);
        logic(c, rl, "key_logic", &at);
    }
    if let Some(d) = c.object(cfg, "deduplication", at, false) {
        let at = at.key("deduplication");
        unknown_keys(c, d, &at, crate::def::DedupConfig::KEYS);
        if let Some(header) = c.nonempty_string(d, "header", &at, false) {
            check_header_name(c, header, &at.key("header"));
        }
        c.integer(
            d,
            "window_secs",
            &at,
            false,
            Some(1),
            Some(MAX_GOVERNANCE_SECS),
        );
        c.boolean(d, "fail_open", &at);
        logic(c, d, "key_logic", &at);
    }
    if let Some(k) = c.object(cfg, "cache", at, false) {
        let at = at.key("cache");
        unknown_keys(c, k, &at, crate::def::CacheConfig::KEYS);
        c.boolean(k, "enabled", &at);
        c.integer(
            k,
            "ttl_secs",
            &at,
            false,
            Some(1),
            Some(MAX_GOVERNANCE_SECS),
        );
        logic(c, k, "key_logic", &at);
    }
    if let Some(b) = c.object(cfg, "backpressure", at, false) {
        let at = at.key("backpressure");
        unknown_keys(c, b, &at, crate::def::BackpressureConfig::KEYS);
        c.integer(
            b,
            "max_concurrent",
            &at,
            true,
            Some(1),
            Some(i64::from(u32::MAX)),
        );
    }
    if let Some(cors) = c.object(cfg, "cors", at, false) {
        let at = at.key("cors");
        unknown_keys(c, cors, &at, crate::def::CorsConfig::KEYS);
        if let Some(origins) = c.string_array(cors, "allowed_origins", &at, true) {
            for (i, o) in origins.iter().enumerate() {
                if let Err(why) = check_origin(o) {
                    c.push(&at.key("allowed_origins").index(i), why);
                }
            }
        }
        if let Some(methods) = c.string_array(cors, "allowed_methods", &at, false) {
            for (i, m) in methods.iter().enumerate() {
                if !HttpMethod::NAMES.contains(m) {
                    c.push(
                        &at.key("allowed_methods").index(i),
                        one_of_message(HttpMethod::NAMES, m),
                    );
                }
            }
        }
        if let Some(headers) = c.string_array(cors, "allowed_headers", &at, false) {
            for (i, h) in headers.iter().enumerate() {
                check_header_name(c, h, &at.key("allowed_headers").index(i));
            }
        }
        c.integer(cors, "max_age_secs", &at, false, Some(0), None);
    }
    if let Some(topic) = c.nonempty_string(cfg, "topic", at, kafka)
        && !is_kafka_topic(topic)
    {
        c.push(&at.key("topic"), KAFKA_TOPIC_RULE);
    }
    c.nonempty_string(cfg, "consumer_group", at, false);
    // Settings that would be accepted and never used (an invalid
    // `config_json` is never silently ignored).
    if kafka {
        for key in [
            "rate_limit",
            "deduplication",
            "cache",
            "cors",
            "backpressure",
        ] {
            if cfg.contains_key(key) {
                c.push(
                    &at.key(key),
                    "does not apply to a kafka channel (consumed messages are not throttled, deduplicated, cached or answered)",
                );
            }
        }
    } else {
        for key in ["topic", "consumer_group"] {
            if cfg.contains_key(key) {
                c.push(&at.key(key), "applies only to a kafka channel");
            }
        }
    }
}

/// A channel's rules (`validation_logic`, each `key_logic`) must compile as
/// JSONLogic: they are compiled once per engine snapshot and must not fail
/// there. `null` means "absent".
fn logic(c: &mut Ctx, obj: &Map<String, Json>, key: &str, at: &FieldPath) {
    if let Some(rule) = obj.get(key).filter(|r| !r.is_null())
        && let Err(e) = crate::logic::compile(rule)
    {
        c.push(&at.key(key), format!("invalid JSONLogic: {}", e.message));
    }
}

/// `*`, or `scheme://host[:port]` as a browser sends it in `Origin`.
/// `*`, or an origin as a browser sends it in `Origin` (origins are
/// compared as text, so one a browser never sends would never match):
/// `scheme://host[:port]`, no path, no user, and no port a browser leaves
/// out (the scheme's default) or could not send (empty, 0, past 65535,
/// leading zeros).
fn check_origin(o: &str) -> Result<(), &'static str> {
    const SHAPE: &str = "must be '*' or an origin such as https://app.example.com (scheme, host, optional port; no path)";
    if o == "*" {
        return Ok(());
    }
    let Some((scheme, rest)) = o.split_once("://") else {
        return Err(SHAPE);
    };
    if scheme.is_empty()
        || !scheme
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || "+-.".contains(ch))
        || rest.is_empty()
        || rest.contains(['/', '?', '#', ' '])
    {
        return Err(SHAPE);
    }
    if rest.contains('@') {
        return Err("must not hold a user name: browsers send an origin as scheme://host[:port]");
    }
    // The port follows the last ':' outside an IPv6 literal's brackets.
    let port = match rest.rfind(':') {
        Some(i) if !rest[i..].contains(']') => Some(&rest[i + 1..]),
        _ => None,
    };
    let Some(port) = port else {
        return Ok(());
    };
    let valid = !port.is_empty()
        && port.bytes().all(|b| b.is_ascii_digit())
        && !port.starts_with('0')
        && port.parse::<u32>().is_ok_and(|p| (1..=65535).contains(&p));
    if !valid {
        return Err("has a port no browser sends: 1 to 65535, without leading zeros");
    }
    let default = match scheme.to_ascii_lowercase().as_str() {
        "http" | "ws" => "80",
        "https" | "wss" => "443",
        _ => "",
    };
    if port == default {
        return Err(
            "names the scheme's default port, which browsers leave out of Origin: write it without the port",
        );
    }
    Ok(())
}

/// Every string (and key) holding a NUL character, at its path: no
/// database the service stores definitions in can keep one, so validate,
/// lint, create and update name each the same way.
fn no_nul(c: &mut Ctx, v: &Json, at: &FieldPath) {
    const WHY: &str = "must not hold a NUL character (\\u0000), which storage cannot keep";
    match v {
        Json::String(s) if s.contains('\0') => c.push(at, WHY),
        Json::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                no_nul(c, item, &at.index(i));
            }
        }
        Json::Object(members) => {
            for (k, item) in members {
                let here = at.key(k);
                if k.contains('\0') {
                    c.push(&here, "the key must not hold a NUL character (\\u0000), which storage cannot keep");
                }
                no_nul(c, item, &here);
            }
        }
        _ => {}
    }
}

fn unknown_keys(c: &mut Ctx, obj: &Map<String, Json>, at: &FieldPath, known: &[&str]) {
    for k in obj.keys() {
        if !known.contains(&k.as_str()) {
            c.push(
                &at.key(k),
                format!("unknown field; expected one of {}", known.join(", ")),
            );
        }
    }
}

// --------------------------------------------------------------- connectors

/// The top-level keys of a connector definition.
const CONNECTOR_KEYS: &[&str] = &[
    "name",
    "connector_type",
    "config",
    "description",
    "created_at",
    "updated_at",
    "$schema",
];

/// The `config` keys each connector type reads (`type` and `retry` are
/// every type's).
fn connector_config_keys(kind: ConnectorType) -> &'static [&'static str] {
    match kind {
        ConnectorType::Http => &["type", "retry", "url", "auth", "headers", "timeout_ms"],
        ConnectorType::Db => &[
            "type",
            "retry",
            "connection_string",
            "max_connections",
            "query_timeout_ms",
            "connect_timeout_ms",
        ],
        ConnectorType::Cache => &["type", "retry", "backend", "url", "max_entries"],
        ConnectorType::Mongodb => &[
            "type",
            "retry",
            "connection_string",
            "query_timeout_ms",
            "connect_timeout_ms",
        ],
        ConnectorType::Kafka => &["type", "retry", "brokers", "client_id", "sasl"],
        ConnectorType::ObjectStorage => &[
            "type",
            "retry",
            "endpoint",
            "bucket",
            "region",
            "access_key",
            "secret_key",
        ],
    }
}

/// A connector's warnings: each key at the top or in `config` that its
/// type does not read (a misspelt `query_timeout` was stored and the
/// default 30 s used without a word), as a workflow's and a channel's
/// unknown keys are warned of. Warnings, not errors: connectors stored
/// with such keys keep loading.
pub fn connector_warnings(def: &Json) -> Vec<Diagnostic> {
    let Some(obj) = def.as_object() else {
        return Vec::new();
    };
    let root = FieldPath::root();
    let mut out = unknown_key_warnings(&root, obj, CONNECTOR_KEYS);
    let kind = obj
        .get("connector_type")
        .and_then(Json::as_str)
        .and_then(ConnectorType::from_name);
    if let (Some(kind), Some(Json::Object(cfg))) = (kind, obj.get("config")) {
        out.extend(unknown_key_warnings(
            &root.key("config"),
            cfg,
            connector_config_keys(kind),
        ));
    }
    out
}

/// Validates a connector definition; empty means valid.
pub fn validate_connector(def: &Json) -> Vec<Diagnostic> {
    let mut c = Ctx::default();
    let Some(obj) = c.root(def) else { return c.out };
    let root = FieldPath::root();
    no_nul(&mut c, def, &root);

    // The name is the connector's identifier (`/connectors/{id}`).
    let name = c.identifier(obj, "name", &root, true);
    c.not_reserved(
        name,
        &root.key("name"),
        RESERVED_CONNECTOR_NAMES,
        "/api/v1/admin/connectors/",
    );
    let declared = c
        .one_of(obj, "connector_type", &root, true, ConnectorType::NAMES)
        .and_then(ConnectorType::from_name);
    c.max_len(obj, "description", &root, MAX_DESCRIPTION_LEN);
    c.string(obj, "created_at", &root, false);
    c.string(obj, "updated_at", &root, false);

    let Some(cfg) = c.object(obj, "config", &root, true) else {
        return c.out;
    };
    let at = root.key("config");
    check_env_refs(&mut c, &obj["config"], &at);

    let mut kind = declared;
    if let Some(t) = c.one_of(cfg, "type", &at, false, ConnectorType::NAMES) {
        if let Some(d) = declared
            && d.name() != t
        {
            c.push(
                &at.key("type"),
                format!("must equal connector_type ('{}')", d.name()),
            );
        }
        kind = kind.or(ConnectorType::from_name(t));
    }

    if let Some(kind) = kind {
        match kind {
            ConnectorType::Http => check_http_connector(&mut c, cfg, &at),
            ConnectorType::Db => {
                if let Some(s) = c.nonempty_string(cfg, "connection_string", &at, true) {
                    let schemes = ["sqlite", "postgres", "postgresql", "mysql", "mariadb"];
                    let at = at.key("connection_string");
                    if check_scheme(&mut c, s, &schemes, &at) && !s.starts_with("sqlite:") {
                        check_server_url(&mut c, s, &at, ServerUrl::Sql);
                    }
                }
                // The pool sets aside a slot per allowed connection when it
                // is built: 4294967295 asked for 200 GB and ended the process.
                c.integer(
                    cfg,
                    "max_connections",
                    &at,
                    false,
                    Some(1),
                    Some(DB_MAX_CONNECTIONS),
                );
                // PostgreSQL's `statement_timeout` is a 32-bit count of
                // milliseconds (24.8 days): above it every query failed.
                c.integer(
                    cfg,
                    "query_timeout_ms",
                    &at,
                    false,
                    Some(1),
                    Some(i64::from(i32::MAX)),
                );
                // SQLite's busy timeout is a 32-bit count too (above it every
                // query failed on a panicking driver thread).
                c.integer(
                    cfg,
                    "connect_timeout_ms",
                    &at,
                    false,
                    Some(1),
                    Some(i64::from(i32::MAX)),
                );
            }
            ConnectorType::Cache => {
                let backend = c.one_of(cfg, "backend", &at, true, &["memory", "redis"]);
                let redis = backend == Some("redis");
                if let Some(url) = c.nonempty_string(cfg, "url", &at, redis)
                    && redis
                {
                    let at = at.key("url");
                    if check_scheme(&mut c, url, &["redis", "rediss"], &at) {
                        check_server_url(&mut c, url, &at, ServerUrl::Redis);
                    }
                }
                c.integer(cfg, "max_entries", &at, false, Some(1), None);
            }
            ConnectorType::Mongodb => {
                if let Some(s) = c.nonempty_string(cfg, "connection_string", &at, true) {
                    let schemes = ["mongodb", "mongodb+srv"];
                    let at = at.key("connection_string");
                    if check_scheme(&mut c, s, &schemes, &at) {
                        check_mongodb_hosts(&mut c, s, &at);
                    }
                }
                c.integer(cfg, "query_timeout_ms", &at, false, Some(1), None);
                c.integer(cfg, "connect_timeout_ms", &at, false, Some(1), None);
            }
            ConnectorType::Kafka => check_kafka_connector(&mut c, cfg, &at),
            ConnectorType::ObjectStorage => {
                if let Some(url) = c.nonempty_string(cfg, "endpoint", &at, true) {
                    check_http_url(&mut c, url, &at.key("endpoint"));
                }
                c.nonempty_string(cfg, "bucket", &at, true);
                c.string(cfg, "region", &at, false);
                c.nonempty_string(cfg, "access_key", &at, true);
                c.nonempty_string(cfg, "secret_key", &at, true);
            }
        }
    }

    // `retry` applies to every connector type.
    if let Some(r) = c.object(cfg, "retry", &at, false) {
        let at = at.key("retry");
        // A misspelt `max_retry` was stored and the default 3 retries ran.
        unknown_keys(&mut c, r, &at, &["max_retries", "retry_delay_ms"]);
        let max = i64::from(RetryPolicy::MAX_RETRIES_LIMIT);
        c.integer(r, "max_retries", &at, false, Some(0), Some(max));
        c.integer(r, "retry_delay_ms", &at, false, Some(0), None);
    }
    c.out
}

fn check_http_connector(c: &mut Ctx, cfg: &Map<String, Json>, at: &FieldPath) {
    if let Some(url) = c.nonempty_string(cfg, "url", at, true) {
        check_http_url(c, url, &at.key("url"));
    }
    if let Some(auth) = c.object(cfg, "auth", at, false) {
        let at = at.key("auth");
        let required: &[&str] =
            match c.one_of(auth, "type", &at, true, &["bearer", "basic", "api_key"]) {
                Some("bearer") => &["token"],
                Some("basic") => &["username", "password"],
                Some("api_key") => &["header", "key"],
                _ => &[],
            };
        for k in required {
            let Some(v) = c.nonempty_string(auth, k, &at, true) else {
                continue;
            };
            let field = at.key(k);
            match *k {
                "header" => {
                    check_header_name(c, v, &field);
                    check_not_framing(c, v, &field);
                }
                // Sent as header values (`Bearer <token>`, `<header>: <key>`).
                "token" | "key" => check_header_value(c, v, &field),
                // RFC 7617: the user-id ends at the first colon.
                "username" if !is_env_ref(v) && v.contains(':') => {
                    c.push(&field, "must not contain ':'")
                }
                _ => {}
            }
        }
        // An unknown key is refused, as in `retry`: a credential is sent
        // only as the type says (audit 101: `in: "query"` was stored, and
        // the key still went out as a header).
        if !required.is_empty() {
            let known: Vec<&str> = std::iter::once("type")
                .chain(required.iter().copied())
                .collect();
            unknown_keys(c, auth, &at, &known);
        }
    }
    if let Some(h) = c.object(cfg, "headers", at, false) {
        let at = at.key("headers");
        for (k, v) in h {
            check_header_name(c, k, &at.key(k));
            check_not_framing(c, k, &at.key(k));
            match v.as_str() {
                Some(v) => check_header_value(c, v, &at.key(k)),
                None => c.mismatch(&at.key(k), "string", v),
            }
        }
    }
    c.integer(cfg, "timeout_ms", at, false, Some(1), None);
}

/// An HTTP header name (RFC 9110 token): letters, digits and
/// ``!#$%&'*+-.^_`|~``.
fn check_header_name(c: &mut Ctx, name: &str, at: &FieldPath) {
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || !name.bytes().all(tchar) {
        c.push(
            at,
            "is not a valid HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)",
        );
    }
}

/// Headers the HTTP client writes itself from the request (its body's
/// length and framing, the target's host, the connection's handling): one
/// given by a definition was sent as well (audit 101: `Content-Length: 3`
/// cut a JSON body to `{"o`, and reported success).
pub const FRAMING_HEADERS: &[&str] = &[
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

fn check_not_framing(c: &mut Ctx, name: &str, at: &FieldPath) {
    if FRAMING_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(name)) {
        c.push(
            at,
            "is written by the HTTP client from the request itself (body length, framing, host, connection); it cannot be set",
        );
    }
}

/// An HTTP header value as the client sends it: visible ASCII, spaces and
/// tabs (no line breaks or other control characters). `env://` references
/// are checked when they are read.
fn check_header_value(c: &mut Ctx, value: &str, at: &FieldPath) {
    if is_env_ref(value) {
        return;
    }
    if !value
        .bytes()
        .all(|b| b == b'\t' || (0x20..0x7f).contains(&b))
    {
        c.push(
            at,
            "is not a valid HTTP header value (visible ASCII, spaces and tabs only)",
        );
    }
}

fn check_kafka_connector(c: &mut Ctx, cfg: &Map<String, Json>, at: &FieldPath) {
    let bat = at.key("brokers");
    let brokers: Vec<(FieldPath, &str)> = match cfg.get("brokers") {
        None => {
            c.required(&bat);
            Vec::new()
        }
        Some(Json::Array(items)) => {
            if items.is_empty() {
                c.push(&bat, "must not be empty");
            }
            let mut out = Vec::new();
            for (i, item) in items.iter().enumerate() {
                match item.as_str() {
                    Some(s) => out.push((bat.index(i), s)),
                    None => c.mismatch(&bat.index(i), "string", item),
                }
            }
            out
        }
        Some(Json::String(s)) if is_env_ref(s) => Vec::new(),
        Some(Json::String(s)) => {
            if s.trim().is_empty() {
                c.push(&bat, "must not be empty");
            }
            s.split(',').map(|b| (bat.clone(), b.trim())).collect()
        }
        Some(other) => {
            c.mismatch(&bat, "array or string", other);
            Vec::new()
        }
    };
    for (at, b) in brokers {
        if !is_env_ref(b) && !is_host_port(b) {
            let scheme = if b.contains("://") {
                ", without a scheme"
            } else {
                ""
            };
            let sasl = if b.contains('@') {
                " (credentials go in sasl)"
            } else {
                ""
            };
            let b = broker_shown(b);
            c.push(&at, format!("broker '{b}' must be host:port{scheme}{sasl}"));
        }
    }
    c.nonempty_string(cfg, "client_id", at, false);
    if let Some(sasl) = c.object(cfg, "sasl", at, false) {
        let at = at.key("sasl");
        c.one_of(sasl, "mechanism", &at, true, SaslConfig::MECHANISMS);
        c.nonempty_string(sasl, "username", &at, true);
        c.nonempty_string(sasl, "password", &at, true);
    }
}

/// A broker address as an error message may quote it: whatever stands
/// before an `@` (`SASL_SSL://svc:Pa55w0rd@kafka-1:9092`) is credentials,
/// shown as `******`.
pub fn broker_shown(b: &str) -> std::borrow::Cow<'_, str> {
    match b.rfind('@') {
        Some(at) => {
            let start = b.find("://").map_or(0, |i| i + 3).min(at);
            format!("{}{MASK}{}", &b[..start], &b[at..]).into()
        }
        None => b.into(),
    }
}

/// `host:port` with a port from 1 to 65535 (a Kafka broker address).
pub fn is_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        // A host holds no '/': `kafka://h:9092` is a URL, which the Kafka
        // client reads as no broker at all (audit 113: every publish then
        // waited for the channel's timeout).
        Some((host, port)) => {
            !host.is_empty()
                && !host.contains(char::is_whitespace)
                && !host.contains('/')
                // Nor credentials (`user:pw@host`): they go in `sasl`.
                && !host.contains('@')
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        }
        None => false,
    }
}

pub const KAFKA_TOPIC_RULE: &str =
    "must be a Kafka topic name: 1 to 249 letters, digits, '.', '_' or '-' (not '.' or '..')";

/// A name Kafka accepts for a topic: 1 to 249 of `[A-Za-z0-9._-]`, not
/// `.` or `..`.
pub fn is_kafka_topic(s: &str) -> bool {
    (1..=249).contains(&s.len())
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// `http://` or `https://` followed by a host. An `env://` reference is
/// checked when it is resolved, not here. Private-address (SSRF) checks happen
/// at call time, after DNS resolution, where `security.allow_private_networks`
/// is known.
fn check_http_url(c: &mut Ctx, url: &str, at: &FieldPath) {
    if is_env_ref(url) {
        return;
    }
    // Parsed as the HTTP client will parse it (the `url` crate, WHATWG
    // rules): a port out of range, a malformed IPv6 address or a character
    // a host cannot have fails here rather than on every call.
    let ok = url::Url::parse(url).is_ok_and(|u| {
        matches!(u.scheme(), "http" | "https") && u.host_str().is_some_and(|h| !h.is_empty())
    });
    // Written as it is meant: the parser also takes `https:host`,
    // `https:///host` and backslashes for slashes, forms nothing else
    // reads alike (the masking of answers looked for `://` and showed
    // such a URL's password).
    let plain = url.split_once(':').is_some_and(|(_, rest)| {
        rest.strip_prefix("//")
            .is_some_and(|host| !host.starts_with(['/', '\\']))
    });
    if !ok {
        c.push(at, "must be an http:// or https:// URL with a host");
    } else if !plain {
        c.push(
            at,
            "must be written scheme://host… (http://host or https://host, two slashes)",
        );
    } else if url.contains('\\') {
        c.push(at, "must not contain a backslash (write it as %5C)");
    } else if url.contains(char::is_whitespace) {
        c.push(at, "must not contain whitespace (write a space as %20)");
    } else if url.contains('#') {
        // A request never carries a fragment, and a task's path and query
        // joined after one were lost (audit 101: every call went to the
        // base URL).
        c.push(
            at,
            "must not hold a fragment ('#…'): a request never carries one (write '#' in a path as %23)",
        );
    }
}

/// The URL scheme (text before the first `:`) must be one of `schemes`.
/// True when it is (and the string is not an `env://` reference, checked
/// when resolved).
fn check_scheme(c: &mut Ctx, s: &str, schemes: &[&str], at: &FieldPath) -> bool {
    if is_env_ref(s) {
        return false;
    }
    let scheme = s
        .split_once(':')
        .map(|(scheme, _)| scheme.to_ascii_lowercase());
    if !scheme.is_some_and(|sc| schemes.contains(&sc.as_str())) {
        let list: Vec<String> = schemes.iter().map(|s| format!("{s}:")).collect();
        c.push(at, format!("must start with one of {}", list.join(", ")));
        return false;
    }
    true
}

#[derive(Clone, Copy, PartialEq)]
enum ServerUrl {
    Sql,
    Redis,
}

/// A database server's URL, parsed as the drivers parse it (the `url`
/// crate): a host, a port from 1 to 65535, and for Redis a database number
/// as the path. Wrong ones used to be stored and then fail every call
/// (`invalid port number`). Messages never quote the URL: it may hold a
/// password.
fn check_server_url(c: &mut Ctx, s: &str, at: &FieldPath, kind: ServerUrl) {
    let u = match url::Url::parse(s) {
        Ok(u) => u,
        Err(e) => {
            c.push(at, format!("is not a valid URL ({e})"));
            return;
        }
    };
    // PostgreSQL and MySQL may name a socket instead of a host.
    let socket = u.query_pairs().any(|(k, _)| k == "host" || k == "socket");
    if u.host_str().is_none_or(str::is_empty) && !socket {
        c.push(at, "has no host");
    }
    if u.port() == Some(0) {
        c.push(at, "has port 0 (a port is 1 to 65535)");
    }
    if kind == ServerUrl::Redis {
        if u.fragment()
            .is_some_and(|f| f.eq_ignore_ascii_case("insecure"))
        {
            c.push(at, REDIS_INSECURE);
        }
        let db = u.path().trim_start_matches('/');
        if !db.is_empty() && db.parse::<u32>().is_err() {
            c.push(
                at,
                "the path must be a database number (redis://host:6379/0)",
            );
        }
    }
}

/// The hosts of a MongoDB connection string (`mongodb://[user:pass@]h1[:p1],h2[:p2]/...`;
/// `mongodb+srv://` names one host and no port): each with a name and a
/// port from 1 to 65535.
fn check_mongodb_hosts(c: &mut Ctx, s: &str, at: &FieldPath) {
    let srv = s.to_ascii_lowercase().starts_with("mongodb+srv:");
    let rest = s.split_once("://").map_or("", |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if hosts.is_empty() {
        c.push(at, "has no host");
        return;
    }
    let list: Vec<&str> = hosts.split(',').collect();
    if srv && (list.len() != 1 || list[0].contains(':')) {
        c.push(at, "a mongodb+srv:// URL names one host and no port");
        return;
    }
    for host in list {
        let (name, port) = match host.rsplit_once(':') {
            // `[::1]:27017`: the colon after the bracket.
            Some((name, port)) if !port.contains(']') => (name, Some(port)),
            _ => (host, None),
        };
        if name.is_empty() {
            c.push(at, "has a host without a name");
        } else if let Some(port) = port
            && !port.parse::<u16>().is_ok_and(|p| p > 0)
        {
            c.push(at, "has a port that is not 1 to 65535");
        }
    }
}

/// Every `env://` string in a connector's config must name a valid variable.
fn check_env_refs(c: &mut Ctx, v: &Json, at: &FieldPath) {
    match v {
        Json::String(s) => {
            if let Some(var) = s.strip_prefix(ENV_PREFIX)
                && !is_env_var_name(var)
            {
                c.push(
                    at,
                    "must be env://NAME with NAME matching [A-Za-z_][A-Za-z0-9_]*",
                );
            }
        }
        Json::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                check_env_refs(c, item, &at.index(i));
            }
        }
        Json::Object(m) => {
            for (k, item) in m {
                check_env_refs(c, item, &at.key(k));
            }
        }
        _ => {}
    }
}

// ------------------------------------------------------------ parse helpers

/// Validates, then deserializes: what create/update/import/lint need.
/// `Err` carries every diagnostic. Should serde still reject a definition the
/// validator passed (a gap in the validator), its message is reported at the
/// root instead of panicking.
pub fn parse_workflow(def: &Json) -> Result<WorkflowDef, Vec<Diagnostic>> {
    parse(def, validate_workflow)
}

/// As [`parse_workflow`], for channels.
pub fn parse_channel(def: &Json) -> Result<ChannelDef, Vec<Diagnostic>> {
    parse(def, validate_channel)
}

/// As [`parse_workflow`], for connectors. The typed view of `config` is
/// checked too, so [`ConnectorDef::typed`] succeeds on the result.
pub fn parse_connector(def: &Json) -> Result<ConnectorDef, Vec<Diagnostic>> {
    let c: ConnectorDef = parse(def, validate_connector)?;
    c.typed()
        .map_err(|e| vec![Diagnostic::new("config", e.to_string())])?;
    Ok(c)
}

fn parse<T: serde::de::DeserializeOwned>(
    def: &Json,
    validate: fn(&Json) -> Vec<Diagnostic>,
) -> Result<T, Vec<Diagnostic>> {
    let diags = validate(def);
    if !diags.is_empty() {
        return Err(diags);
    }
    T::deserialize(def).map_err(|e| vec![Diagnostic::new("", e.to_string())])
}

// ------------------------------------------------------------------ masking

/// What a masked value shows.
pub const MASK: &str = "******";

/// Keys whose values are secrets at any depth. Compared after
/// [`key_words`]: case-insensitively, and without `_` and `-`, so `apiKey`,
/// `api-key` and `API_KEY` are all `api_key`.
const SECRET_KEYS: &[&str] = &[
    "token",
    "password",
    "key",
    "secret",
    "apikey",
    "connectionstring",
    "passwd",
];
/// Also secrets: the object-storage credentials and the common spellings of
/// the listed names with a prefix (`client_secret`, `refreshToken`,
/// `x-api-key`, ...), compared the same way.
const SECRET_SUFFIXES: &[&str] = &[
    "token",
    "password",
    "passwd",
    "passphrase",
    "secret",
    "secretkey",
    "accesskey",
    "privatekey",
    "apikey",
];
/// A header value is masked when its name contains one of these (`cookie`
/// covers `Cookie` and `Set-Cookie`: a session cookie is a credential).
const SECRET_HEADER_PARTS: &[&str] = &["authorization", "token", "secret", "key", "cookie"];

pub fn is_secret_key(k: &str) -> bool {
    let k = key_words(k);
    SECRET_KEYS.contains(&k.as_str()) || SECRET_SUFFIXES.iter().any(|s| k.ends_with(s))
}

/// Whether a URL query parameter of this name carries a credential: the
/// key rule, plus the names signed and keyed URLs use (`sig` and
/// `X-Amz-Signature` of a presigned or SAS URL, Azure Functions' `code`,
/// `pwd`, `pass`, `auth`).
pub fn is_secret_query_param(name: &str) -> bool {
    let k = key_words(name);
    is_secret_key(name)
        || matches!(k.as_str(), "sig" | "code" | "pwd" | "pass" | "auth")
        || k.ends_with("signature")
}

/// A key as the secret rule compares it: lowercase, without the `_` and `-`
/// that separate its words.
fn key_words(k: &str) -> String {
    k.bytes()
        .filter(|b| !matches!(b, b'_' | b'-'))
        .map(|b| char::from(b.to_ascii_lowercase()))
        .collect()
}

/// Whether a header of this name carries a credential (its value is
/// masked): the name contains `authorization`, `token`, `secret`, `key` or
/// `cookie`.
pub fn is_secret_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    SECRET_HEADER_PARTS.iter().any(|p| name.contains(p))
}

/// [`mask_secrets`], with the header rule applied to every object, not only
/// under `headers`: for values whose origin is unknown, such as the fields a
/// workflow's `log` task writes (`{"h": {"var": "metadata.headers"}}`).
pub fn mask_secrets_everywhere(v: &mut Json) {
    mask(v, true);
}

/// Replaces secrets with `******` in place, at any depth: the value of every
/// key named `token`, `password`, `key`, `secret`, `api_key` or
/// `connection_string` (and the variants in `SECRET_SUFFIXES`), and, inside any
/// object under a `headers` key, every value whose header name contains
/// `authorization`, `token`, `secret`, `key` or `cookie`. Any non-null value is masked,
/// whatever its type, so a structured secret does not leak either; `null`
/// stays `null` because it hides nothing.
pub fn mask_secrets(v: &mut Json) {
    mask(v, false);
}

fn mask(v: &mut Json, headers_everywhere: bool) {
    match v {
        Json::Object(m) => {
            for (k, item) in m.iter_mut() {
                if is_secret_key(k) || (headers_everywhere && is_secret_header(k)) {
                    if !item.is_null() {
                        *item = Json::String(MASK.to_owned());
                    }
                    continue;
                }
                if !headers_everywhere
                    && k.eq_ignore_ascii_case("headers")
                    && let Json::Object(headers) = item
                {
                    for (name, value) in headers.iter_mut() {
                        if is_secret_header(name) && !value.is_null() {
                            *value = Json::String(MASK.to_owned());
                        }
                    }
                }
                mask(item, headers_everywhere);
            }
        }
        Json::Array(items) => items.iter_mut().for_each(|i| mask(i, headers_everywhere)),
        Json::String(text) => {
            if let Some(masked) = mask_url_credentials(text) {
                *text = masked;
            }
        }
        _ => {}
    }
}

/// Where a definition holds the mask itself as a secret: a secret key's
/// value, or a URL's password, that is or holds `******` (only an exact
/// `******` is put back from the stored definition). That happens when
/// a definition copied from an answer changed around a masked value (a URL
/// whose path changed keeps its `******` password), which would otherwise
/// be stored, and sent, literally.
pub fn masked_leftovers(v: &Json) -> Vec<Diagnostic> {
    fn walk(v: &Json, path: &str, secret: bool, out: &mut Vec<Diagnostic>) {
        // Said for create and import too, where nothing stored can stand
        // in for the mask (audit 85: "or the value exactly as the answer
        // showed it" read as an option there, after an import of a listing).
        let message = "holds the mask '******' instead of a secret: send the secret itself \
                       (answers never carry it; only an update that leaves a value exactly \
                       as the answer showed it keeps the stored secret)";
        match v {
            Json::Object(m) => {
                for (k, item) in m {
                    let at = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    let secret = is_secret_key(k)
                        || (path.rsplit('.').next() == Some("headers") && is_secret_header(k));
                    walk(item, &at, secret, out);
                }
            }
            Json::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    walk(item, &format!("{path}[{i}]"), secret, out);
                }
            }
            // Contains, not equals: `"Bearer ******"` (the scheme kept,
            // the secret "kept" too) was stored and sent as it stood.
            Json::String(text)
                if (secret && text.contains(MASK))
                    || url_password(text).is_some_and(|p| p.contains(MASK))
                    || url_query_secrets(text)
                        .into_iter()
                        .any(|r| text[r].contains(MASK)) =>
            {
                out.push(Diagnostic::new(path, message));
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, "", false, &mut out);
    out
}

/// Where the credential of `scheme://user:password@host...` is in `text`:
/// the password; for an HTTP URL without one, the user, which is how
/// APIs take a key as Basic auth (`https://sk_live_…@api.example.com`,
/// `https://TOKEN:@host`). A database's or Redis's user alone is a name,
/// not a credential, and stays shown.
fn url_secret_range(text: &str) -> Option<std::ops::Range<usize>> {
    let start = text.find("://")? + 3;
    let rest = &text[start..];
    let authority_end = rest.find(['/', '?', '#', '\\']).unwrap_or(rest.len());
    let at = rest[..authority_end].rfind('@')?;
    let range = match rest[..at].find(':') {
        Some(colon) if colon + 1 < at => colon + 1..at,
        user_only => {
            let scheme = &text[..start - 3];
            if !(scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https")) {
                return None;
            }
            0..user_only.unwrap_or(at)
        }
    };
    (!range.is_empty()).then(|| start + range.start..start + range.end)
}

/// The credential of `scheme://user:password@host...`, if any (see
/// [`url_secret_range`]).
fn url_password(text: &str) -> Option<&str> {
    url_secret_range(text).map(|r| &text[r])
}

/// `scheme://user:password@host...` with the password masked (a Redis or
/// HTTP URL may carry credentials in any field; an HTTP URL's user when
/// it has no password); `None` when there is none.
pub fn mask_url_password(text: &str) -> Option<String> {
    let r = url_secret_range(text)?;
    if &text[r.clone()] == MASK {
        return None;
    }
    Some(format!("{}{MASK}{}", &text[..r.start], &text[r.end..]))
}

/// The values of a URL's query parameters whose names say credential by
/// the key rule (`?api_key=…`, `&token=…`, `access_token`, `password`; not
/// the header rule's substrings, which took `?keyword=` for a key), with
/// their byte ranges in `text`.
fn url_query_secrets(text: &str) -> Vec<std::ops::Range<usize>> {
    let Some(scheme_end) = text.find("://") else {
        return Vec::new();
    };
    let Some(q) = text[scheme_end..].find('?').map(|i| scheme_end + i + 1) else {
        return Vec::new();
    };
    let end = text[q..].find('#').map_or(text.len(), |i| q + i);
    let mut out = Vec::new();
    let mut at = q;
    for pair in text[q..end].split('&') {
        // The name as the server reads it: `api%5Fkey` is `api_key`.
        if let Some((name, value)) = pair.split_once('=')
            && !value.is_empty()
            && url::form_urlencoded::parse(name.as_bytes())
                .next()
                .is_some_and(|(decoded, _)| is_secret_query_param(&decoded))
        {
            let start = at + name.len() + 1;
            out.push(start..start + value.len());
        }
        at += pair.len() + 1;
    }
    out
}

/// A URL with its credentials masked: the password of
/// `scheme://user:password@host` and the values of query parameters whose
/// names say credential (`?api_key=…`); `None` when there are none.
pub fn mask_url_credentials(text: &str) -> Option<String> {
    let masked = mask_url_password(text);
    let base = masked.as_deref().unwrap_or(text);
    let ranges = url_query_secrets(base);
    let ranges: Vec<_> = ranges
        .into_iter()
        .filter(|r| &base[r.clone()] != MASK)
        .collect();
    if ranges.is_empty() {
        return masked;
    }
    let mut out = String::with_capacity(base.len());
    let mut last = 0;
    for r in ranges {
        out.push_str(&base[last..r.start]);
        out.push_str(MASK);
        last = r.end;
    }
    out.push_str(&base[last..]);
    Some(out)
}

#[cfg(test)]
mod tests;
