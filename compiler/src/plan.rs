//! Compiled plans: what a validated workflow definition becomes.
//!
//! A plan has no strings to look up and no rule JSON to walk: every JSONLogic
//! expression is a compiled [`Logic`], every path is pre-split, every function
//! is a [`FunctionPlan`] variant with its input already checked and compiled.
//! The runtime only executes it.
//!
//! Data functions' inputs are not schema-checked when a workflow is created
//! (the spec says bad input shows at execution). A data task whose input does
//! not compile therefore becomes [`FunctionPlan::Invalid`], which fails when it
//! runs, and the problem is also returned as a warning so `validate` can show it.

use crate::diag::{Diagnostic, RuleRoot};
use crate::functions::{Function, FunctionKind};
use crate::logic::{self, Logic};
use crate::path::{Path, PathSet, Segment};
use crate::validate;
use serde_json::{Map, Value as Json};

/// One compiled workflow version.
#[derive(Debug)]
pub struct Plan {
    pub workflow_id: std::sync::Arc<str>,
    pub name: Box<str>,
    pub version: i64,
    pub priority: i64,
    /// `None` when the workflow always matches (absent or constant-true condition).
    pub condition: Option<Logic>,
    /// The condition reads `data` (or its reads cannot be known) and the
    /// workflow starts with an unconditioned `parse_json` / `parse_xml`
    /// task: the condition is evaluated on the context that task produces
    /// (the spec: only a workflow that does not start with `parse_json`
    /// sees `data` empty). See [`Plan::leading_parse`].
    pub condition_after_parse: bool,
    /// The rollout bucket range `[start, end)` over 0..100.
    pub rollout: Rollout,
    pub continue_on_error: bool,
    pub body: Block,
    /// True when some step calls a connector or another channel.
    pub needs_io: bool,
    /// Which stored definition the plan was compiled from, set by whoever
    /// stores definitions (the service: a digest of the stored text). Part
    /// of response cache keys, so a workflow deleted and created again
    /// under the same id and version is not answered from the old one's
    /// cache. Empty from the compiler.
    pub source_id: Box<str>,
    /// Number of task steps (for sizing per-execution buffers).
    pub task_count: usize,
}

/// A bucket range `[start, end)`. `[0, 100)` accepts every request; an empty or
/// inverted range accepts none; a request with no bucket is accepted by all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rollout {
    pub start: u8,
    pub end: u8,
}

impl Default for Rollout {
    fn default() -> Self {
        Rollout { start: 0, end: 100 }
    }
}

impl Rollout {
    #[inline]
    pub fn accepts(&self, bucket: Option<u8>) -> bool {
        match bucket {
            None => true,
            Some(b) => self.start <= b && b < self.end,
        }
    }
}

/// Steps run in order, optionally repeated by a loop.
#[derive(Debug, Default)]
pub struct Block {
    pub steps: Vec<Step>,
    pub repeat: Option<LoopPlan>,
}

/// `loop: {max, init, increment, counter}`: the block runs `max` times; before
/// each pass the counter path holds `init + pass * increment`.
#[derive(Debug)]
pub struct LoopPlan {
    pub max: u32,
    pub init: f64,
    pub increment: f64,
    pub counter: WritePath,
}

#[derive(Debug)]
pub enum Step {
    Task(Task),
    Group(Group),
}

#[derive(Debug)]
pub struct Group {
    pub id: Box<str>,
    /// Where the group sits in the definition, e.g. `tasks[1]`.
    pub field: Box<str>,
    /// Evaluated once on entry; a false one skips the whole group.
    pub condition: Option<Logic>,
    pub terminal: bool,
    pub body: Block,
}

#[derive(Debug)]
pub struct Task {
    pub id: Box<str>,
    /// Where the task sits in the definition, e.g. `tasks[1].tasks[0]`.
    pub field: Box<str>,
    pub condition: Option<Logic>,
    /// The task's own `continue_on_error`; unset, the workflow's applies
    /// (an explicit `false` makes this task halt under a tolerant workflow).
    pub continue_on_error: Option<bool>,
    pub terminal: bool,
    /// `halt_on: failure`: a failure halts even under `continue_on_error`.
    pub halt_on_failure: bool,
    pub function: FunctionPlan,
}

/// Which top-level area of the context a write path starts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Area {
    Data,
    TempData,
    Metadata,
}

/// A write destination: an area plus a path inside it (empty = the whole area).
#[derive(Debug, Clone)]
pub struct WritePath {
    pub area: Area,
    pub path: Path,
    /// As written by the user, for messages.
    pub text: Box<str>,
}

impl WritePath {
    /// Paths starting with `data`, `temp_data` or `metadata` are rooted at the
    /// context; any other path is relative to `data`, among them an escaped
    /// first segment (`#temp_data.x` is `data["temp_data"].x`).
    pub fn parse(text: &str) -> WritePath {
        let full = Path::parse(text);
        let area = match full.first_key().filter(|_| !text.starts_with('#')) {
            Some("data") => Some(Area::Data),
            Some("temp_data") => Some(Area::TempData),
            Some("metadata") => Some(Area::Metadata),
            _ => None,
        };
        match area {
            Some(area) => WritePath {
                area,
                path: full.tail(),
                text: text.into(),
            },
            None => WritePath {
                area: Area::Data,
                path: full,
                text: text.into(),
            },
        }
    }

    /// A path relative to `data` whatever its first segment (the `target` of
    /// parse_json/parse_xml and `source`/`target` of publish_json/publish_xml).
    pub fn in_data(text: &str) -> WritePath {
        WritePath {
            area: Area::Data,
            path: Path::parse(text),
            text: text.into(),
        }
    }
}

/// A read path rooted at the whole context (`payload`, `data.raw`, ...).
#[derive(Debug, Clone)]
pub struct ReadPath {
    pub path: Path,
    pub text: Box<str>,
}

impl ReadPath {
    pub fn parse(text: &str) -> ReadPath {
        ReadPath {
            path: Path::parse(text),
            text: text.into(),
        }
    }

    /// A path read relative to `data`.
    pub fn in_data(text: &str) -> ReadPath {
        let mut segments = vec![Segment::key("data")];
        segments.extend(Path::parse(text).segments().iter().cloned());
        ReadPath {
            path: Path::from_segments(segments),
            text: text.into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpMethod {
    Get,
    Post,
    Put,
    Patch,
    Delete,
}

impl HttpMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            HttpMethod::Get => "GET",
            HttpMethod::Post => "POST",
            HttpMethod::Put => "PUT",
            HttpMethod::Patch => "PATCH",
            HttpMethod::Delete => "DELETE",
        }
    }
}

/// A value that is either fixed in the definition or computed by JSONLogic.
#[derive(Debug)]
pub enum Source {
    Static(Json),
    Logic(Logic),
}

#[derive(Debug)]
pub struct HttpCallPlan {
    pub connector: Box<str>,
    pub method: HttpMethod,
    pub path: Option<Source>,
    pub headers: Vec<(Box<str>, Box<str>)>,
    pub body: Option<Source>,
    pub response_path: Option<WritePath>,
    pub timeout_ms: u64,
}

#[derive(Debug)]
pub struct SqlPlan {
    pub connector: Box<str>,
    pub query: Box<str>,
    /// Each parameter is JSONLogic (a plain literal evaluates to itself).
    pub params: Vec<Logic>,
    pub output: WritePath,
}

#[derive(Debug)]
pub struct CacheReadPlan {
    pub connector: Box<str>,
    pub key: Source,
    pub output: WritePath,
}

#[derive(Debug)]
pub struct CacheWritePlan {
    pub connector: Box<str>,
    pub key: Source,
    pub value: Source,
    /// `ttl_secs` (any positive number) in whole milliseconds, rounded up.
    pub ttl: Option<std::time::Duration>,
}

#[derive(Debug)]
pub struct MongoReadPlan {
    pub connector: Box<str>,
    pub database: Box<str>,
    pub collection: Box<str>,
    pub filter: Source,
    pub output: WritePath,
}

#[derive(Debug)]
pub struct PublishKafkaPlan {
    pub connector: Box<str>,
    pub topic: Box<str>,
    pub key: Option<Logic>,
    /// `None`: the full data context.
    pub value: Option<Logic>,
}

#[derive(Debug)]
pub struct ChannelCallPlan {
    pub channel: Source,
    /// `None`: the request payload.
    pub data: Option<Source>,
    pub response_path: WritePath,
    pub timeout_ms: Option<u64>,
}

/// A task's function with its input compiled.
#[derive(Debug)]
pub enum FunctionPlan {
    ParseJson {
        source: ReadPath,
        target: WritePath,
    },
    ParseXml {
        source: ReadPath,
        target: WritePath,
    },
    Map {
        mappings: Vec<(WritePath, Logic)>,
        /// Consecutive runs of `mappings` whose rules read nothing the run's
        /// earlier mappings write: each run's rules see the same context and
        /// its writes are applied together (see [`batches`]).
        runs: Vec<MapRun>,
    },
    Filter {
        condition: Logic,
        skip: bool,
    },
    Validation {
        rules: Vec<(Logic, Box<str>)>,
    },
    Log {
        message: Logic,
        level: LogLevel,
        fields: Vec<(Box<str>, Logic)>,
    },
    PublishJson {
        source: ReadPath,
        target: WritePath,
        pretty: bool,
    },
    PublishXml {
        source: ReadPath,
        target: WritePath,
        root: Box<str>,
    },
    HttpCall(HttpCallPlan),
    DbRead(SqlPlan),
    DbWrite(SqlPlan),
    CacheRead(CacheReadPlan),
    CacheWrite(CacheWritePlan),
    MongoRead(MongoReadPlan),
    PublishKafka(PublishKafkaPlan),
    ChannelCall(ChannelCallPlan),
    /// A data function whose input did not compile: fails when it runs.
    Invalid {
        function: &'static str,
        message: Box<str>,
    },
}

impl FunctionPlan {
    /// A data function's JSONLogic rules, each with its field under the
    /// task's `function.input` (`mappings[0].logic`).
    fn data_rules(&self) -> Vec<(String, &Logic)> {
        match self {
            FunctionPlan::Map { mappings, .. } => mappings
                .iter()
                .enumerate()
                .map(|(i, (_, l))| (format!("mappings[{i}].logic"), l))
                .collect(),
            FunctionPlan::Filter { condition, .. } => vec![("condition".into(), condition)],
            FunctionPlan::Validation { rules } => rules
                .iter()
                .enumerate()
                .map(|(i, (l, _))| (format!("rules[{i}].logic"), l))
                .collect(),
            FunctionPlan::Log {
                message, fields, ..
            } => std::iter::once(("message".into(), message))
                .chain(fields.iter().map(|(k, l)| (format!("fields.{k}"), l)))
                .collect(),
            _ => Vec::new(),
        }
    }

    pub fn needs_io(&self) -> bool {
        matches!(
            self,
            FunctionPlan::HttpCall(_)
                | FunctionPlan::DbRead(_)
                | FunctionPlan::DbWrite(_)
                | FunctionPlan::CacheRead(_)
                | FunctionPlan::CacheWrite(_)
                | FunctionPlan::MongoRead(_)
                | FunctionPlan::PublishKafka(_)
                | FunctionPlan::ChannelCall(_)
        )
    }
}

/// A compiled workflow and the warnings found while compiling it.
#[derive(Debug)]
pub struct Compiled {
    pub plan: Plan,
    pub warnings: Vec<Diagnostic>,
}

/// Validates and compiles a workflow definition. Errors are every problem
/// found, each with its field path.
pub fn compile_workflow(def: &Json) -> Result<Compiled, Vec<Diagnostic>> {
    compile_checked(def, validate::validate_workflow(def), true)
}

/// [`compile_workflow`] for the engine, which keeps no warnings: the
/// analyses that only produce warnings (reads outside the context,
/// templates in static inputs, constant rules) are skipped, so a reload
/// of many workflows does not pay for them.
pub fn compile_stored_workflow(def: &Json) -> Result<Compiled, Vec<Diagnostic>> {
    compile_checked(def, validate::validate_workflow(def), false)
}

/// [`compile_workflow`] for a definition being created or changed: also the
/// rules a stored definition may predate ([`validate::validate_new_workflow`]).
pub fn compile_new_workflow(def: &Json) -> Result<Compiled, Vec<Diagnostic>> {
    compile_checked(def, validate::validate_new_workflow(def), true)
}

fn compile_checked(
    def: &Json,
    validated: Vec<Diagnostic>,
    analyse: bool,
) -> Result<Compiled, Vec<Diagnostic>> {
    let mut errors = validated;
    let Some(obj) = def.as_object() else {
        return Err(errors);
    };
    let mut cx = Cx {
        errors: Vec::new(),
        warnings: Vec::new(),
        task_count: 0,
        needs_io: false,
        analyse,
    };
    cx.unknown_keys(obj, WORKFLOW_KEYS, "");
    let condition = cx.condition(obj.get("condition"), "condition");
    let body = match obj.get("tasks").and_then(Json::as_array) {
        Some(steps) => cx.block(steps, obj.get("loop"), "", "loop"),
        None => Block::default(),
    };
    errors.extend(cx.errors);
    if !errors.is_empty() {
        crate::diag::with_misspellings(&mut errors, &cx.warnings);
        dedup(&mut errors);
        document_order(&mut errors);
        return Err(errors);
    }
    let rollout = obj
        .get("rollout")
        .map_or_else(Rollout::default, |r| Rollout {
            start: r
                .get("bucket_start")
                .and_then(Json::as_u64)
                .unwrap_or(0)
                .min(100) as u8,
            end: r
                .get("bucket_end")
                .and_then(Json::as_u64)
                .unwrap_or(100)
                .min(100) as u8,
        });
    let workflow_id = obj
        .get("workflow_id")
        .or_else(|| obj.get("id"))
        .and_then(Json::as_str)
        .unwrap_or_default();
    let condition_after_parse =
        condition.as_ref().is_some_and(reads_data) && leading_parse(&body).is_some();
    let plan = Plan {
        workflow_id: workflow_id.into(),
        name: obj
            .get("name")
            .and_then(Json::as_str)
            .unwrap_or_default()
            .into(),
        version: obj.get("version").and_then(Json::as_i64).unwrap_or(1),
        priority: obj.get("priority").and_then(Json::as_i64).unwrap_or(0),
        condition,
        condition_after_parse,
        rollout,
        continue_on_error: bool_field(obj, "continue_on_error"),
        body,
        needs_io: cx.needs_io,
        task_count: cx.task_count,
        source_id: Box::default(),
    };
    Ok(Compiled {
        plan,
        warnings: cx.warnings,
    })
}

impl Plan {
    /// The workflow's first step when it is a `parse_json` or `parse_xml`
    /// task without a condition (it always runs first, so a workflow
    /// condition may see what it parses).
    pub fn leading_parse(&self) -> Option<&Task> {
        leading_parse(&self.body)
    }
}

fn leading_parse(body: &Block) -> Option<&Task> {
    match body.steps.first()? {
        Step::Task(
            task @ Task {
                condition: None,
                function: FunctionPlan::ParseJson { .. } | FunctionPlan::ParseXml { .. },
                ..
            },
        ) => Some(task),
        _ => None,
    }
}

/// Whether `logic` may read the `data` area (unknown reads count as yes).
fn reads_data(logic: &Logic) -> bool {
    logic.root_reads().is_none_or(|reads| {
        reads
            .iter()
            .any(|r| r.first().is_none_or(|first| &*first.key == "data"))
    })
}

/// The validator and the compiler may both notice one problem; report it once.
/// Diagnostics in document order (docs/decisions.md: root fields, then
/// steps depth-first): the validator's and the compiler's lists are
/// merged, a step's problems staying in the order found. Before, every
/// JSONLogic problem came after every structural one (`condition` after
/// `tasks[0].function.name`).
fn document_order(errors: &mut [Diagnostic]) {
    fn step_indexes(field: &str) -> Option<Vec<usize>> {
        if !field.starts_with("tasks") {
            return None;
        }
        let mut out = Vec::new();
        let mut rest = field;
        while let Some(at) = rest.find("tasks[") {
            rest = &rest[at + "tasks[".len()..];
            let end = rest.find(']')?;
            out.push(rest[..end].parse().ok()?);
            rest = &rest[end..];
        }
        Some(out)
    }
    errors.sort_by_cached_key(|d| step_indexes(&d.field));
}

fn dedup(errors: &mut Vec<Diagnostic>) {
    let mut seen = std::collections::HashSet::new();
    errors.retain(|d| seen.insert((d.field.clone(), d.message.clone())));
}

fn bool_field(obj: &Map<String, Json>, key: &str) -> bool {
    obj.get(key).and_then(Json::as_bool).unwrap_or(false)
}

fn str_field<'j>(obj: &'j Map<String, Json>, key: &str) -> Option<&'j str> {
    obj.get(key).and_then(Json::as_str)
}

/// The text of a rule that is a falsy JSONLogic literal (`null`, `false`,
/// `0`, `""`, `[]`): a condition that can never hold.
fn falsy_literal(rule: &Json) -> Option<String> {
    let falsy = match rule {
        Json::Null => true,
        Json::Bool(b) => !b,
        Json::Number(n) => n.as_f64() == Some(0.0),
        Json::String(s) => s.is_empty(),
        Json::Array(items) => items.is_empty(),
        Json::Object(_) => false,
    };
    falsy.then(|| rule.to_string())
}

fn join(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_owned()
    } else {
        format!("{prefix}.{field}")
    }
}

/// Compilation state: diagnostics collected so far.
struct Cx {
    errors: Vec<Diagnostic>,
    warnings: Vec<Diagnostic>,
    task_count: usize,
    needs_io: bool,
    /// Whether to run the analyses that only produce warnings (see
    /// [`compile_stored_workflow`]).
    analyse: bool,
}

/// An input problem in a data function: a warning now, a failure at run time.
struct InputProblem(String, String);

/// Every input problem of one data function, so a definition's warnings
/// name them all at once rather than the first of each task.
#[derive(Default)]
struct Problems(Vec<InputProblem>);

impl Problems {
    /// The value, or `None` with its problem kept.
    fn take<T>(&mut self, r: Result<T, InputProblem>) -> Option<T> {
        self.within("", r)
    }

    /// [`take`](Self::take) for a field under `at` (`mappings[0]`).
    fn within<T>(&mut self, at: &str, r: Result<T, InputProblem>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(InputProblem(k, m)) => {
                let field = if at.is_empty() {
                    k
                } else {
                    format!("{at}.{k}")
                };
                self.0.push(InputProblem(field, m));
                None
            }
        }
    }

    fn push(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.0.push(InputProblem(field.into(), message.into()));
    }

    /// `Ok(plan)` when nothing was wrong (then every `take` gave a value).
    fn finish<T>(self, plan: impl FnOnce() -> Option<T>) -> Result<T, Vec<InputProblem>> {
        if !self.0.is_empty() {
            return Err(self.0);
        }
        plan().ok_or_else(|| vec![InputProblem(String::new(), "is invalid".into())])
    }
}

impl Cx {
    fn error(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Diagnostic {
            field: field.into(),
            message: message.into(),
        });
    }

    /// Compiles a JSONLogic field whose problems are errors. Absent or
    /// constant-true compiles to `None` ("always").
    fn condition(&mut self, rule: Option<&Json>, field: &str) -> Option<Logic> {
        let rule = rule?;
        if let Some(literal) = falsy_literal(rule) {
            // A JSONLogic literal, and falsy: `null` most likely meant as
            // "none", `[]` or `false` left from an edit.
            self.warnings.push(Diagnostic {
                field: field.into(),
                message: format!(
                    "{literal} is a falsy JSONLogic literal: this never runs (omit the key to always run)"
                ),
            });
        }
        let logic = self.logic(rule, field)?;
        if logic.is_always_true() {
            None
        } else {
            Some(logic)
        }
    }

    fn logic(&mut self, rule: &Json, field: &str) -> Option<Logic> {
        match logic::compile(rule) {
            Ok(l) => {
                if self.analyse {
                    crate::diag::stray_reads(&l, field, RuleRoot::Workflow, &mut self.warnings);
                }
                Some(l)
            }
            Err(e) => {
                self.error(field, format!("invalid JSONLogic: {}", e.message));
                None
            }
        }
    }

    fn block(
        &mut self,
        steps: &[Json],
        repeat: Option<&Json>,
        prefix: &str,
        loop_field: &str,
    ) -> Block {
        let steps = steps
            .iter()
            .enumerate()
            .filter_map(|(i, step)| {
                let field = format!(
                    "{}tasks[{i}]",
                    if prefix.is_empty() {
                        String::new()
                    } else {
                        format!("{prefix}.")
                    }
                );
                self.step(step, &field)
            })
            .collect();
        let repeat = repeat.and_then(|r| self.loop_plan(r, loop_field));
        Block { steps, repeat }
    }

    fn loop_plan(&mut self, def: &Json, field: &str) -> Option<LoopPlan> {
        let obj = def.as_object()?;
        // `{"max": 5, "maxx": 9}` passed without a word (audit 66).
        self.unknown_keys(obj, &["max", "init", "increment", "counter"], field);
        let max = obj.get("max").and_then(Json::as_u64)?;
        let counter = str_field(obj, "counter").unwrap_or("temp_data.loop_index");
        Some(LoopPlan {
            max: max.min(u32::MAX as u64) as u32,
            init: obj.get("init").and_then(Json::as_f64).unwrap_or(0.0),
            increment: obj.get("increment").and_then(Json::as_f64).unwrap_or(1.0),
            counter: WritePath::parse(counter),
        })
    }

    /// A warning for each key of `obj` not in `known`: a misspelt field
    /// (`conditon`, `respone_path`) would otherwise be dropped in silence.
    fn unknown_keys(&mut self, obj: &Map<String, Json>, known: &[&str], field: &str) {
        for key in obj.keys() {
            if !known.contains(&key.as_str()) {
                self.warnings.push(Diagnostic {
                    field: join(field, key),
                    message: format!(
                        "{}; expected one of {}",
                        crate::diag::UNKNOWN_FIELD,
                        known.join(", ")
                    ),
                });
            }
        }
    }

    fn step(&mut self, def: &Json, field: &str) -> Option<Step> {
        let obj = def.as_object()?;
        self.unknown_keys(obj, STEP_KEYS, field);
        if let Some(f) = obj.get("function").and_then(Json::as_object) {
            self.unknown_keys(f, &["name", "input"], &join(field, "function"));
        }
        let id: Box<str> = str_field(obj, "id").unwrap_or_default().into();
        let condition = self.condition(obj.get("condition"), &join(field, "condition"));
        if let Some(children) = obj.get("tasks").and_then(Json::as_array) {
            let body = self.block(children, obj.get("loop"), field, &join(field, "loop"));
            return Some(Step::Group(Group {
                id,
                field: field.into(),
                condition,
                terminal: bool_field(obj, "terminal"),
                body,
            }));
        }
        self.task_count += 1;
        let function = obj.get("function").and_then(Json::as_object);
        let name = function
            .and_then(|f| str_field(f, "name"))
            .unwrap_or_default();
        let empty = Map::new();
        let input = function
            .and_then(|f| f.get("input"))
            .and_then(Json::as_object)
            .unwrap_or(&empty);
        let function = self.function(name, input, &join(field, "function.input"))?;
        self.needs_io |= function.needs_io();
        Some(Step::Task(Task {
            id,
            field: field.into(),
            condition,
            continue_on_error: obj.get("continue_on_error").and_then(Json::as_bool),
            terminal: bool_field(obj, "terminal"),
            halt_on_failure: str_field(obj, "halt_on") == Some("failure"),
            function,
        }))
    }

    fn function(
        &mut self,
        name: &str,
        input: &Map<String, Json>,
        field: &str,
    ) -> Option<FunctionPlan> {
        let function = Function::from_name(name)?;
        if function.kind() == FunctionKind::Data {
            self.unknown_data_keys(function, input, field);
        }
        let data_result = match function {
            Function::ParseJson | Function::ParseXml => {
                let mut p = Problems::default();
                let paths = parse_fn(input, &mut p);
                p.finish(|| {
                    let (source, target) = paths?;
                    Some(if function == Function::ParseJson {
                        FunctionPlan::ParseJson { source, target }
                    } else {
                        FunctionPlan::ParseXml { source, target }
                    })
                })
            }
            Function::Map => map_fn(input),
            Function::Filter => filter_fn(input),
            Function::Validation => validation_fn(input),
            Function::Log => log_fn(input),
            Function::PublishJson => {
                let mut p = Problems::default();
                let paths = publish_fn(input, &mut p);
                let pretty = p.take(match input.get("pretty") {
                    None => Ok(false),
                    Some(Json::Bool(b)) => Ok(*b),
                    Some(other) => Err(InputProblem(
                        "pretty".into(),
                        format!("expected boolean, got {}", json_type(other)),
                    )),
                });
                p.finish(|| {
                    let (source, target) = paths?;
                    Some(FunctionPlan::PublishJson {
                        source,
                        target,
                        pretty: pretty?,
                    })
                })
            }
            Function::PublishXml => {
                let mut p = Problems::default();
                let paths = publish_fn(input, &mut p);
                let root = p.take(match input.get("root_element") {
                    None => Ok("root"),
                    Some(Json::String(s)) if s.is_empty() => Err(InputProblem(
                        "root_element".into(),
                        "must not be empty".into(),
                    )),
                    Some(Json::String(s)) => crate::functions::check_xml_name(s)
                        .map(|()| s.as_str())
                        .map_err(|why| InputProblem("root_element".into(), why)),
                    Some(other) => Err(InputProblem(
                        "root_element".into(),
                        format!("expected string, got {}", json_type(other)),
                    )),
                });
                p.finish(|| {
                    let (source, target) = paths?;
                    Some(FunctionPlan::PublishXml {
                        source,
                        target,
                        root: root?.into(),
                    })
                })
            }
            _ => return self.io_function(function, input, field),
        };
        Some(match data_result {
            Ok(plan) if !self.analyse => plan,
            Ok(plan) => {
                if let FunctionPlan::Validation { rules } = &plan {
                    // Only a string: a constant `false` under a condition is
                    // how a gated task fails with its message (audit 119).
                    for (i, (logic, _)) in rules
                        .iter()
                        .enumerate()
                        .filter(|(_, (l, _))| l.constant().is_some_and(Json::is_string))
                    {
                        crate::diag::constant_rule(
                            logic,
                            &join(field, &format!("rules[{i}].logic")),
                            "run",
                            |_| false,
                            &mut self.warnings,
                        );
                    }
                }
                for (sub, logic) in plan.data_rules() {
                    crate::diag::stray_reads(
                        logic,
                        &join(field, &sub),
                        RuleRoot::Workflow,
                        &mut self.warnings,
                    );
                }
                plan
            }
            Err(problems) => {
                let at = |sub: &str| {
                    if sub.is_empty() {
                        field.to_owned()
                    } else {
                        join(field, sub)
                    }
                };
                for InputProblem(sub, message) in &problems {
                    self.warnings.push(Diagnostic {
                        field: at(sub),
                        message: message.clone(),
                    });
                }
                // At run time the task fails on the first.
                let InputProblem(sub, message) = &problems[0];
                FunctionPlan::Invalid {
                    function: function.name(),
                    message: format!("invalid input at {}: {message}", at(sub)).into(),
                }
            }
        })
    }

    /// A data function's misspelt field (`onReject`, `prety`, a mapping's
    /// `lgoic`) is a warning, as a connector function's is: it would
    /// otherwise be dropped in silence (`filter` then halts by default).
    fn unknown_data_keys(&mut self, function: Function, input: &Map<String, Json>, field: &str) {
        let known: Vec<&str> = function.input_schema().iter().map(|f| f.name).collect();
        self.unknown_keys(input, &known, field);
        // As for a task's condition: a falsy literal most likely meant as
        // "none", and here it halts every run.
        if function == Function::Filter
            && let Some(literal) = input.get("condition").and_then(falsy_literal)
        {
            self.warnings.push(Diagnostic {
                field: join(field, "condition"),
                message: format!("{literal} is a falsy JSONLogic literal: every run is rejected"),
            });
        }
        // Paths under `data` that name a root of the context are most likely
        // meant from the context: `target: "data.order"` writes
        // `data.data.order`.
        let in_data: &[&str] = match function {
            Function::ParseJson | Function::ParseXml => &["target"],
            Function::PublishJson | Function::PublishXml => &["source", "target"],
            _ => &[],
        };
        for key in in_data {
            if let Some(Json::String(path)) = input.get(*key)
                && let Some(root) = ["data", "temp_data", "metadata", "payload"]
                    .into_iter()
                    .find(|r| {
                        path.strip_prefix(r)
                            .is_some_and(|rest| rest.starts_with('.'))
                    })
            {
                self.warnings.push(Diagnostic {
                    field: join(field, key),
                    message: format!(
                        "is a path under data, so this is data.{path}; \
                         drop the leading '{root}.' if it names the context's {root}"
                    ),
                });
            }
        }
        let (list, item_keys): (&str, &[&str]) = match function {
            Function::Map => ("mappings", &["path", "logic"]),
            Function::Validation => ("rules", &["logic", "message"]),
            _ => return,
        };
        if let Some(Json::Array(items)) = input.get(list) {
            for (i, item) in items.iter().enumerate() {
                if let Some(obj) = item.as_object() {
                    self.unknown_keys(obj, item_keys, &format!("{field}.{list}[{i}]"));
                }
            }
        }
    }

    /// Connector and composition functions: the validator has checked the
    /// input's shape; here their JSONLogic is compiled (errors are errors).
    fn io_function(
        &mut self,
        function: Function,
        input: &Map<String, Json>,
        field: &str,
    ) -> Option<FunctionPlan> {
        let known: Vec<&str> = function.input_schema().iter().map(|f| f.name).collect();
        self.unknown_keys(input, &known, field);
        // A static field beside its computed twin (`path` and `path_logic`):
        // the twin wins, as the spec says, but one of them is a mistake.
        // (`channel_call`'s pairs are exactly-one-of rules, errors.)
        if function != Function::ChannelCall {
            for twin in &known {
                if let Some(name) = twin.strip_suffix("_logic")
                    && input.contains_key(name)
                    && input.contains_key(*twin)
                {
                    self.warnings.push(Diagnostic {
                        field: join(field, name),
                        message: format!("ignored: {twin} is given too, and is used instead"),
                    });
                }
            }
        }
        // Static text written as a template (`a:{{payload.sku}}`) is used as
        // written: a cache key shared by every request, a literal path
        // (audit 118). The `_logic` twin computes it.
        for (key, value) in input.iter().filter(|_| self.analyse) {
            if key == "connector" || key.ends_with("_logic") {
                continue;
            }
            // Not `key`: `{user1000}` is a Redis Cluster hash tag.
            let braces = key == "path";
            let found = template_texts(value, braces);
            if found.is_empty() {
                continue;
            }
            let twin = format!("{key}_logic");
            let fix = match key.as_str() {
                _ if known.contains(&twin.as_str()) && value.is_string() => format!(
                    "compute it with {twin}, e.g. {{\"cat\": [\"text\", {{\"var\": \"data.x\"}}]}}"
                ),
                _ if known.contains(&twin.as_str()) => {
                    format!(
                        "compute it with {twin}, e.g. {{\"var\": \"data.x\"}} where a value varies"
                    )
                }
                "query" => "bind values with placeholders and params".to_owned(),
                "params" => "a param is JSONLogic: write {\"var\": \"data.x\"}".to_owned(),
                _ => "static fields are not expanded".to_owned(),
            };
            for (at, text) in found {
                self.warnings.push(Diagnostic {
                    field: join(field, &format!("{key}{at}")),
                    message: format!(
                        "'{}' looks like a template, but it is used as written (the same for every request); {fix}",
                        shorten(text)
                    ),
                });
            }
        }
        let connector: Box<str> = str_field(input, "connector").unwrap_or_default().into();
        let output = |key: &str| WritePath::parse(str_field(input, key).unwrap_or("data"));
        let plan = match function {
            Function::HttpCall => {
                let method = match str_field(input, "method").unwrap_or("GET") {
                    "POST" => HttpMethod::Post,
                    "PUT" => HttpMethod::Put,
                    "PATCH" => HttpMethod::Patch,
                    "DELETE" => HttpMethod::Delete,
                    _ => HttpMethod::Get,
                };
                // Every rule is compiled before any failure returns, so all
                // of a task's JSONLogic errors are reported at once.
                let path = self.source(input, "path", "path_logic", field);
                let body = self.source(input, "body", "body_logic", field);
                let (path, body) = (path?, body?);
                let headers = input
                    .get("headers")
                    .and_then(Json::as_object)
                    .map(|h| {
                        h.iter()
                            .filter_map(|(k, v)| Some((k.as_str().into(), v.as_str()?.into())))
                            .collect()
                    })
                    .unwrap_or_default();
                // Workflows are shown unmasked (they are meant to hold no
                // credentials); a credential header here is worth a warning.
                let headers: Vec<(Box<str>, Box<str>)> = headers;
                for (name, _) in &headers {
                    let name: &str = name;
                    if crate::validate::is_secret_header(name) {
                        self.warnings.push(Diagnostic {
                            field: join(field, &format!("headers.{name}")),
                            message: "looks like a credential: workflows are shown unmasked to every admin reader; put it in the connector's headers or auth, which are masked".into(),
                        });
                    }
                }
                FunctionPlan::HttpCall(HttpCallPlan {
                    connector,
                    method,
                    path,
                    headers,
                    body,
                    response_path: str_field(input, "response_path").map(WritePath::parse),
                    timeout_ms: input
                        .get("timeout_ms")
                        .and_then(Json::as_f64)
                        .map_or(30_000, whole_ms),
                })
            }
            Function::DbRead | Function::DbWrite => {
                let mut params = Vec::new();
                if let Some(items) = input.get("params").and_then(Json::as_array) {
                    for (i, p) in items.iter().enumerate() {
                        params.push(self.logic(p, &join(field, &format!("params[{i}]"))));
                    }
                }
                let params = params.into_iter().collect::<Option<Vec<_>>>()?;
                let sql = SqlPlan {
                    connector,
                    query: str_field(input, "query").unwrap_or_default().into(),
                    params,
                    output: output("output"),
                };
                if function == Function::DbRead {
                    FunctionPlan::DbRead(sql)
                } else {
                    FunctionPlan::DbWrite(sql)
                }
            }
            Function::CacheRead => FunctionPlan::CacheRead(CacheReadPlan {
                connector,
                key: self
                    .source(input, "key", "key_logic", field)?
                    .unwrap_or(Source::Static(Json::Null)),
                output: output("output"),
            }),
            Function::CacheWrite => {
                let value = match input.get("value_logic") {
                    Some(rule) => self
                        .logic(rule, &join(field, "value_logic"))
                        .map(Source::Logic),
                    None => Some(Source::Static(
                        input.get("value").cloned().unwrap_or(Json::Null),
                    )),
                };
                let key = self.source(input, "key", "key_logic", field);
                let (key, value) = (key?, value?);
                FunctionPlan::CacheWrite(CacheWritePlan {
                    connector,
                    key: key.unwrap_or(Source::Static(Json::Null)),
                    value,
                    ttl: input.get("ttl_secs").and_then(Json::as_f64).map(ttl),
                })
            }
            Function::MongoRead => FunctionPlan::MongoRead(MongoReadPlan {
                connector,
                database: str_field(input, "database").unwrap_or_default().into(),
                collection: str_field(input, "collection").unwrap_or_default().into(),
                filter: self
                    .source(input, "filter", "filter_logic", field)?
                    .unwrap_or(Source::Static(Json::Object(Map::new()))),
                output: output("output"),
            }),
            Function::PublishKafka => {
                let key = match input.get("key_logic") {
                    Some(rule) => self.logic(rule, &join(field, "key_logic")).map(Some),
                    None => Some(None),
                };
                let value = match input.get("value_logic") {
                    Some(rule) => self.logic(rule, &join(field, "value_logic")).map(Some),
                    None => Some(None),
                };
                let (key, value) = (key?, value?);
                FunctionPlan::PublishKafka(PublishKafkaPlan {
                    connector,
                    topic: str_field(input, "topic").unwrap_or_default().into(),
                    key,
                    value,
                })
            }
            Function::ChannelCall => {
                let channel = self.source(input, "channel", "channel_logic", field);
                let data = self.source(input, "data", "data_logic", field);
                let (channel, data) = (channel?, data?);
                FunctionPlan::ChannelCall(ChannelCallPlan {
                    channel: channel.unwrap_or(Source::Static(Json::Null)),
                    data,
                    response_path: output("response_path"),
                    timeout_ms: input.get("timeout_ms").and_then(Json::as_f64).map(whole_ms),
                })
            }
            _ => return None,
        };
        Some(plan)
    }

    /// A `field` / `field_logic` pair: the JSONLogic one wins when present.
    /// The outer `None` means a compile error was recorded.
    fn source(
        &mut self,
        input: &Map<String, Json>,
        key: &str,
        logic_key: &str,
        field: &str,
    ) -> Option<Option<Source>> {
        if let Some(rule) = input.get(logic_key) {
            return self
                .logic(rule, &join(field, logic_key))
                .map(|l| Some(Source::Logic(l)));
        }
        Some(input.get(key).cloned().map(Source::Static))
    }
}

/// The strings in `value` (each with its place under the field, `""`,
/// `.a.b`, `[0]`) that read like a template another tool would expand:
/// `{{x}}` or `${x}` around a name or a dotted path, and with `braces` (a
/// `path`) a route-style `{name}` before any query string. Nested text
/// (in a `body`, a `data`, a `filter`) counts only when the template names
/// the data context (`{{payload.sku}}`): an upstream may expand its own
/// (`Hi {{name}}` to a mail API).
fn template_texts(value: &Json, braces: bool) -> Vec<(String, &str)> {
    let mut out = Vec::new();
    walk_templates(value, String::new(), braces, false, &mut out);
    out
}

fn walk_templates<'j>(
    value: &'j Json,
    at: String,
    braces: bool,
    nested: bool,
    out: &mut Vec<(String, &'j str)>,
) {
    match value {
        Json::String(text) if looks_like_template(text, braces, nested) => out.push((at, text)),
        Json::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                walk_templates(item, format!("{at}[{i}]"), false, true, out);
            }
        }
        Json::Object(members) => {
            for (k, v) in members {
                walk_templates(v, format!("{at}.{k}"), false, true, out);
            }
        }
        _ => {}
    }
}

/// At most 80 characters of `text` (a warning quotes it).
fn shorten(text: &str) -> String {
    match text.char_indices().nth(80) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// One pass over `text` (its size is bounded only by the admin body
/// limit): after each `{{` or `${`, the characters a name can hold, then
/// the closing marker.
fn looks_like_template(text: &str, braces: bool, nested: bool) -> bool {
    let b = text.as_bytes();
    let name_byte = |c: u8| c.is_ascii_alphanumeric() || b"_.-[] ".contains(&c);
    let names_context = |inner: &str| {
        let inner = inner.trim();
        // A name starts with a letter or `_` (`{{1}}` in a PostgreSQL
        // array literal is none).
        inner
            .bytes()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
            && (!nested
                || ["data.", "payload.", "metadata.", "temp_data."]
                    .iter()
                    .any(|root| inner.starts_with(root)))
    };
    let mut i = 0;
    while i + 1 < b.len() {
        let close: &[u8] = match (b[i], b[i + 1]) {
            (b'{', b'{') => b"}}",
            (b'$', b'{') => b"}",
            _ => {
                i += 1;
                continue;
            }
        };
        let start = i + 2;
        let mut end = start;
        while end < b.len() && name_byte(b[end]) {
            end += 1;
        }
        // Markers and names are ASCII: `start..end` are char boundaries.
        if b[end..].starts_with(close) && names_context(&text[start..end]) {
            return true;
        }
        // `{{{x}}}`: the next position may open the template.
        i += 1;
    }
    // `/prices/{sku}`: a name in braces, as route patterns write parameters
    // (in the path itself, not a query string: `?query={me{name}}`).
    let path = text.split('?').next().unwrap_or_default();
    braces
        && path.split('{').skip(1).any(|rest| {
            rest.split_once('}').is_some_and(|(name, _)| {
                !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            })
        })
}

fn required_str<'j>(input: &'j Map<String, Json>, key: &str) -> Result<&'j str, InputProblem> {
    match input.get(key) {
        None => Err(InputProblem(key.into(), "is required".into())),
        Some(Json::String(s)) => Ok(s),
        Some(other) => Err(InputProblem(
            key.into(),
            format!("expected string, got {}", json_type(other)),
        )),
    }
}

fn required_logic(input: &Map<String, Json>, key: &str) -> Result<Logic, InputProblem> {
    let rule = input
        .get(key)
        .ok_or_else(|| InputProblem(key.into(), "is required".into()))?;
    compile_rule(rule, key)
}

fn compile_rule(rule: &Json, key: &str) -> Result<Logic, InputProblem> {
    logic::compile(rule)
        .map_err(|e| InputProblem(key.into(), format!("invalid JSONLogic: {}", e.message)))
}

fn required_array<'j>(input: &'j Map<String, Json>, key: &str) -> Result<&'j [Json], InputProblem> {
    match input.get(key) {
        None => Err(InputProblem(key.into(), "is required".into())),
        Some(Json::Array(items)) => Ok(items),
        Some(other) => Err(InputProblem(
            key.into(),
            format!("expected array, got {}", json_type(other)),
        )),
    }
}

/// JSON type names as messages use them (one vocabulary with the
/// validator's: a whole number is an `integer`).
pub fn json_type(v: &Json) -> &'static str {
    crate::diag::type_name(v)
}

/// `a..b`, `.a` and `a.` name an empty key by accident (a typo); `#`
/// names it on purpose (`a.#.b`). The empty path (the whole area) is not
/// one of them.
pub fn has_empty_segment(path: &str) -> bool {
    !path.is_empty() && crate::path::has_empty_piece(path)
}

/// The message for a write path with an empty segment.
pub fn empty_segment_message(path: &str) -> String {
    format!("'{path}' has an empty segment (write '#' for an empty key)")
}

/// A `target` write path, checked for empty segments.
fn target_path<'i>(input: &'i Map<String, Json>, p: &mut Problems) -> Option<&'i str> {
    let target = p.take(required_str(input, "target"))?;
    if has_empty_segment(target) {
        p.push("target", empty_segment_message(target));
        return None;
    }
    Some(target)
}

fn parse_fn(input: &Map<String, Json>, p: &mut Problems) -> Option<(ReadPath, WritePath)> {
    let source = p.take(required_str(input, "source"));
    let target = target_path(input, p);
    Some((ReadPath::parse(source?), WritePath::in_data(target?)))
}

fn publish_fn(input: &Map<String, Json>, p: &mut Problems) -> Option<(ReadPath, WritePath)> {
    let source = p.take(required_str(input, "source"));
    let target = target_path(input, p);
    Some((ReadPath::in_data(source?), WritePath::in_data(target?)))
}

/// The fields a workflow may have (the spec's, the engine schema's, the
/// server-managed ones an export carries, and `$schema` for editors).
const WORKFLOW_KEYS: &[&str] = &[
    "workflow_id",
    "id",
    "name",
    "description",
    "priority",
    "condition",
    "tasks",
    "tags",
    "continue_on_error",
    "channel",
    "loop",
    "status",
    "version",
    "rollout_percentage",
    "rollout",
    "created_at",
    "updated_at",
    "$schema",
];

/// The fields a task or a group may have.
const STEP_KEYS: &[&str] = &[
    "id",
    "name",
    "description",
    "function",
    "condition",
    "continue_on_error",
    "terminal",
    "halt_on",
    "tasks",
    "loop",
];

/// The most segments a `map` path may have (far deeper than any document
/// a request brings: bodies nest at most 1,024 levels).
pub const MAX_PATH_SEGMENTS: usize = 512;

fn map_fn(input: &Map<String, Json>) -> Result<FunctionPlan, Vec<InputProblem>> {
    let mut p = Problems::default();
    let items = p
        .take(required_array(input, "mappings"))
        .unwrap_or_default();
    let mut mappings = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("mappings[{i}]");
        let Some(obj) = item.as_object() else {
            p.push(at, format!("expected object, got {}", json_type(item)));
            continue;
        };
        let path = p.within(&at, required_str(obj, "path"));
        let logic = p.within(&at, required_logic(obj, "logic"));
        let Some(path) = path else { continue };
        if has_empty_segment(path) {
            p.push(format!("{at}.path"), empty_segment_message(path));
            continue;
        }
        let path = WritePath::parse(path);
        // Runs of mappings become a tree of their paths (`PathSet`), built
        // and dropped recursively: a path's length is bounded like the
        // nesting of the data it writes into.
        let segments = path.path.segments().len();
        if segments > MAX_PATH_SEGMENTS {
            p.push(
                format!("{at}.path"),
                format!("has {segments} segments; a path has at most {MAX_PATH_SEGMENTS}"),
            );
            continue;
        }
        if let Some(logic) = logic {
            mappings.push((path, logic));
        }
    }
    if !p.0.is_empty() {
        return Err(p.0);
    }
    let runs = batches(&mappings)
        .into_iter()
        .flat_map(|range| {
            let paths: Vec<&Path> = mappings[range.clone()]
                .iter()
                .map(|(w, _)| &w.path)
                .collect();
            match (range.len(), PathSet::new(&paths)) {
                (1, _) => vec![MapRun { range, paths: None }],
                (_, Some(set)) => vec![MapRun {
                    range,
                    paths: Some(set),
                }],
                // Not reached: `batches` only joins paths a set takes.
                (_, None) => range
                    .map(|i| MapRun {
                        range: i..i + 1,
                        paths: None,
                    })
                    .collect(),
            }
        })
        .collect();
    Ok(FunctionPlan::Map { mappings, runs })
}

/// A run of a `map` task's mappings (see [`batches`]).
#[derive(Debug)]
pub struct MapRun {
    pub range: std::ops::Range<usize>,
    /// The run's paths, for a run of more than one mapping.
    pub paths: Option<PathSet>,
}

impl Area {
    /// The area's key in the evaluation root.
    pub fn key(self) -> &'static str {
        match self {
            Area::Data => "data",
            Area::TempData => "temp_data",
            Area::Metadata => "metadata",
        }
    }
}

/// Splits a `map` task's mappings into runs whose writes may be applied
/// together. A mapping joins the run before it when
/// - its path and every path of the run are object-key paths (no array
///   index segment: a key written into an array is an error, which the
///   sequential writes report) in the same area, none a prefix of another
///   (so no two writes touch the same slot), and
/// - its rule's reads are known at compile time and none of them is a prefix
///   of, or lies under, a path the run writes (so it reads the same values
///   before and after those writes).
///
/// Running a run's rules first and then writing gives exactly the context,
/// key order included, that the mappings one by one would have given.
pub fn batches(mappings: &[(WritePath, Logic)]) -> Vec<std::ops::Range<usize>> {
    fn keyed(w: &WritePath) -> bool {
        !w.path.is_root() && w.path.segments().iter().all(|s| s.index.is_none())
    }
    fn prefix(a: &[Segment], b: &[Segment]) -> bool {
        a.len() <= b.len() && a.iter().zip(b).all(|(x, y)| x.key == y.key)
    }
    // A read of the root (`data.order.items`) against a write in an area.
    fn overlaps(read: &[Segment], write: &WritePath) -> bool {
        let Some((first, rest)) = read.split_first() else {
            return true;
        };
        &*first.key == write.area.key()
            && (prefix(rest, write.path.segments()) || prefix(write.path.segments(), rest))
    }
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (j, (path, logic)) in mappings.iter().enumerate() {
        if let Some(run) = out.last_mut() {
            let members = &mappings[run.clone()];
            let joins = keyed(path)
                && members.iter().all(|(w, _)| {
                    keyed(w)
                        && w.area == path.area
                        && !prefix(w.path.segments(), path.path.segments())
                        && !prefix(path.path.segments(), w.path.segments())
                })
                && logic.root_reads().is_some_and(|reads| {
                    reads
                        .iter()
                        .all(|r| members.iter().all(|(w, _)| !overlaps(r, w)))
                });
            if joins {
                run.end = j + 1;
                continue;
            }
        }
        out.push(j..j + 1);
    }
    out
}

/// A positive number of seconds as whole milliseconds, rounded up (so the
/// smallest TTL is 1 ms, never "expire at once"); capped at about 31,700
/// years so the conversion cannot overflow.
/// A task's `timeout_ms` (validated greater than 0) in whole milliseconds,
/// rounded up: `0.5` is 1 ms, not a deadline that has already passed.
fn whole_ms(ms: f64) -> u64 {
    ms.ceil() as u64
}

fn ttl(secs: f64) -> std::time::Duration {
    let ms = (secs * 1000.0).ceil().clamp(1.0, 1e15);
    std::time::Duration::from_millis(ms as u64)
}

fn filter_fn(input: &Map<String, Json>) -> Result<FunctionPlan, Vec<InputProblem>> {
    let mut p = Problems::default();
    let condition = p.take(required_logic(input, "condition"));
    let skip = p.take(match input.get("on_reject") {
        None => Ok(false),
        Some(Json::String(s)) if s == "halt" => Ok(false),
        Some(Json::String(s)) if s == "skip" => Ok(true),
        Some(Json::String(s)) => Err(InputProblem(
            "on_reject".into(),
            format!("must be one of halt, skip, got '{s}'"),
        )),
        Some(other) => Err(InputProblem(
            "on_reject".into(),
            format!("expected string, got {}", json_type(other)),
        )),
    });
    p.finish(|| {
        Some(FunctionPlan::Filter {
            condition: condition?,
            skip: skip?,
        })
    })
}

fn validation_fn(input: &Map<String, Json>) -> Result<FunctionPlan, Vec<InputProblem>> {
    let mut p = Problems::default();
    let items = p.take(required_array(input, "rules")).unwrap_or_default();
    let mut rules = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("rules[{i}]");
        let Some(obj) = item.as_object() else {
            p.push(at, format!("expected object, got {}", json_type(item)));
            continue;
        };
        let logic = p.within(&at, required_logic(obj, "logic"));
        let message = p.within(&at, required_str(obj, "message"));
        if let (Some(logic), Some(message)) = (logic, message) {
            rules.push((logic, message.into()));
        }
    }
    p.finish(|| Some(FunctionPlan::Validation { rules }))
}

fn log_fn(input: &Map<String, Json>) -> Result<FunctionPlan, Vec<InputProblem>> {
    let mut p = Problems::default();
    let message = p.take(required_logic(input, "message"));
    let level = p.take(match input.get("level").map(|l| l.as_str()) {
        None | Some(Some("info")) => Ok(LogLevel::Info),
        Some(Some("trace")) => Ok(LogLevel::Trace),
        Some(Some("debug")) => Ok(LogLevel::Debug),
        Some(Some("warn")) => Ok(LogLevel::Warn),
        Some(Some("error")) => Ok(LogLevel::Error),
        Some(Some(s)) => Err(InputProblem(
            "level".into(),
            format!("must be one of trace, debug, info, warn, error, got '{s}'"),
        )),
        // Not text at all: the type is the mistake (as for every other
        // enumerated field; `null` is not "absent").
        Some(None) => Err(InputProblem(
            "level".into(),
            format!(
                "expected string, got {}",
                json_type(input.get("level").unwrap_or(&Json::Null))
            ),
        )),
    });
    let mut fields = Vec::new();
    match input.get("fields") {
        None => {}
        Some(Json::Object(map)) => {
            for (name, rule) in map {
                if let Some(rule) = p.take(compile_rule(rule, &format!("fields.{name}"))) {
                    fields.push((name.as_str().into(), rule));
                }
            }
        }
        Some(other) => p.push(
            "fields",
            format!("expected object, got {}", json_type(other)),
        ),
    }
    p.finish(|| {
        Some(FunctionPlan::Log {
            message: message?,
            level: level?,
            fields,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn runs(mappings: &[(&str, Json)]) -> Vec<std::ops::Range<usize>> {
        let compiled: Vec<(WritePath, Logic)> = mappings
            .iter()
            .map(|(p, l)| (WritePath::parse(p), logic::compile(l).unwrap()))
            .collect();
        batches(&compiled)
    }

    /// A fractional `timeout_ms` rounds up: `0.5` passed validation
    /// ("greater than 0") and was cut to a 0 ms deadline (every call a 504).
    #[test]
    fn fractional_timeouts_round_up() {
        let def = json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "a", "name": "a", "function": {"name": "channel_call",
             "input": {"channel": "c", "timeout_ms": 0.5}}},
            {"id": "b", "name": "b", "function": {"name": "http_call",
             "input": {"connector": "h", "timeout_ms": 2.25}}}]});
        let compiled = compile_workflow(&def).unwrap();
        let timeouts: Vec<Option<u64>> = compiled
            .plan
            .body
            .steps
            .iter()
            .map(|step| match step {
                Step::Task(t) => match &t.function {
                    FunctionPlan::ChannelCall(c) => c.timeout_ms,
                    FunctionPlan::HttpCall(h) => Some(h.timeout_ms),
                    _ => None,
                },
                Step::Group(_) => None,
            })
            .collect();
        assert_eq!(timeouts, [Some(1), Some(3)]);
    }

    /// `log.level` names a level; a value that is not text at all says its
    /// type, as every enumerated field does (`null` is not "absent").
    #[test]
    fn log_level_problems_name_the_value_or_its_type() {
        for (level, want) in [
            (
                json!("loud"),
                "must be one of trace, debug, info, warn, error, got 'loud'",
            ),
            (json!(5), "expected string, got integer"),
            (json!(null), "expected string, got null"),
            (json!(["warn"]), "expected string, got array"),
        ] {
            let def = json!({"workflow_id": "w", "name": "w", "tasks": [
                {"id": "a", "name": "a",
                 "function": {"name": "log", "input": {"message": "m", "level": level}}}]});
            let compiled = compile_workflow(&def).unwrap();
            let found: Vec<(&str, &str)> = compiled
                .warnings
                .iter()
                .map(|w| (w.field.as_str(), w.message.as_str()))
                .collect();
            assert_eq!(found, [("tasks[0].function.input.level", want)], "{level}");
        }
    }

    /// `"condition": null` is a valid rule (a falsy literal) that is most
    /// likely meant as "no condition": a warning, on the workflow and on a
    /// task, and nothing for an absent condition.
    #[test]
    fn a_null_condition_is_a_warning() {
        let def = json!({"workflow_id": "w", "name": "w", "condition": null, "tasks": [
            {"id": "a", "name": "a", "condition": null,
             "function": {"name": "log", "input": {"message": "m"}}},
            {"id": "b", "name": "b", "function": {"name": "log", "input": {"message": "m"}}}]});
        let compiled = compile_workflow(&def).unwrap();
        let fields: Vec<&str> = compiled.warnings.iter().map(|w| w.field.as_str()).collect();
        assert_eq!(fields, ["condition", "tasks[0].condition"]);
        assert!(compiled.warnings[0].message.contains("never runs"));
        // A filter's null condition rejects every run (audit 69).
        let def = json!({"workflow_id": "w", "name": "w", "condition": [], "tasks": [
            {"id": "f", "name": "f", "function": {"name": "filter", "input": {"condition": null}}}]});
        let compiled = compile_workflow(&def).unwrap();
        let fields: Vec<&str> = compiled.warnings.iter().map(|w| w.field.as_str()).collect();
        assert_eq!(fields, ["condition", "tasks[0].function.input.condition"]);
        assert!(compiled.warnings[0].message.starts_with("[] is a falsy"));
        assert!(
            compiled.warnings[1]
                .message
                .contains("every run is rejected")
        );
        // A loop's misspelt key too.
        let def = json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "g", "name": "g", "loop": {"max": 2, "inc": 2}, "tasks": [
                {"id": "a", "name": "a", "function": {"name": "log", "input": {"message": "m"}}}]}]});
        let compiled = compile_workflow(&def).unwrap();
        let fields: Vec<&str> = compiled.warnings.iter().map(|w| w.field.as_str()).collect();
        assert_eq!(fields, ["tasks[0].loop.inc"]);
    }

    /// A read outside the data context's roots (`order.total` for
    /// `data.order.total`) is always missing: warned of wherever JSONLogic
    /// is, with the path most likely meant. Reads of an iterator's element
    /// and of the roots are not.
    #[test]
    fn reads_outside_the_context_are_warned_of() {
        let def = json!({"workflow_id": "w", "name": "w",
            "condition": {"==": [{"var": "headers.x-mode"}, "a"]},
            "tasks": [
            {"id": "m", "name": "m", "condition": {"var": "temp_data.go"},
             "function": {"name": "map", "input": {"mappings": [
                {"path": "data.total", "logic": {"reduce": [{"var": "data.items"},
                    {"+": [{"var": "accumulator"}, {"var": "current.qty"}]}, 0]}},
                {"path": "data.tier", "logic": {"if": [{">": [{"var": "order.total"}, 10]}, "a", "b"]}}]}}},
            {"id": "v", "name": "v", "function": {"name": "validation", "input": {"rules": [
                {"logic": {"all": [{"var": "data.items"}, {">": [{"var": "price"}, 0]}]}, "message": "p"},
                {"logic": {"!!": [{"var": "payload.id"}]}, "message": "id"},
                {"logic": {"!!": [{"var": "email"}]}, "message": "e"}]}}},
            {"id": "h", "name": "h", "function": {"name": "http_call", "input": {
                "connector": "api", "body_logic": {"cat": [{"var": "customer.id"}, {"var": "metadata.path.id"}]}}}},
            {"id": "l", "name": "l", "function": {"name": "log", "input": {"message": {"cat": [{"var": "method"}, {"var": "topic"}]}}}}]});
        let compiled = compile_workflow(&def).unwrap();
        let warned: Vec<(&str, &str)> = compiled
            .warnings
            .iter()
            .map(|w| (w.field.as_str(), w.message.as_str()))
            .collect();
        assert_eq!(
            warned.iter().map(|w| w.0).collect::<Vec<_>>(),
            [
                "condition",
                "tasks[0].function.input.mappings[1].logic",
                "tasks[1].function.input.rules[2].logic",
                "tasks[2].function.input.body_logic",
                "tasks[3].function.input.message",
                "tasks[3].function.input.message",
            ],
            "{warned:?}"
        );
        assert_eq!(
            warned[0].1,
            "reads 'headers.x-mode', which is always missing: 'headers' is not in the data context \
             (data, metadata, temp_data, payload); did you mean 'metadata.headers.x-mode'?"
        );
        assert!(
            warned[1].1.ends_with("did you mean 'data.order.total'?"),
            "{}",
            warned[1].1
        );
        assert!(warned[2].1.starts_with("reads 'email',"), "{}", warned[2].1);
        assert!(
            warned[3].1.starts_with("reads 'customer.id',"),
            "{}",
            warned[3].1
        );
        assert!(
            warned[4].1.ends_with("did you mean 'metadata.method'?"),
            "{}",
            warned[4].1
        );
        // A Kafka message's metadata too.
        assert!(
            warned[5].1.ends_with("did you mean 'metadata.topic'?"),
            "{}",
            warned[5].1
        );
    }

    /// A refused workflow's misspelt fields are among its problems: most
    /// likely why a required field is missing.
    #[test]
    fn a_refused_workflow_names_its_misspelt_fields() {
        let def = json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "q", "name": "q", "function": {"name": "db_read",
                "input": {"connector": "db", "sql": "SELECT 1"}}}]});
        let problems = compile_workflow(&def).unwrap_err();
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "tasks[0].function.input.query",
                "tasks[0].function.input.sql"
            ],
            "{problems:?}"
        );
        assert!(
            problems[1]
                .message
                .starts_with("unknown field, ignored; expected one of connector, query")
        );
        // Without an error the misspelling stays a warning.
        let def = json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "q", "name": "q", "function": {"name": "db_read",
                "input": {"connector": "db", "query": "SELECT 1", "sql": "x"}}}]});
        assert_eq!(compile_workflow(&def).unwrap().warnings.len(), 1);
    }

    /// A `validation` rule that is a string is text, not an expression: it
    /// fails every run.
    #[test]
    fn constant_validation_rules_are_warned_of() {
        let def = json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "v", "name": "v", "function": {"name": "validation", "input": {"rules": [
                {"logic": "data.qty > 0", "message": "qty"},
                {"logic": {">": [{"var": "data.qty"}, 0]}, "message": "ok"},
                {"logic": true, "message": "always"},
                {"logic": {"==": [1, 2]}, "message": "never"}]}}}]});
        let compiled = compile_workflow(&def).unwrap();
        let warned: Vec<String> = compiled
            .warnings
            .iter()
            .map(|w| format!("{}: {}", w.field, w.message))
            .collect();
        // A constant `false` is how a task gated by its condition fails
        // with its message: not warned of in a workflow.
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(
            warned[0].starts_with(
                "tasks[0].function.input.rules[0].logic: is a constant (\"data.qty > 0\"), so every run fails it (a string"
            ),
            "{warned:?}"
        );
    }

    /// Static connector inputs written as templates are used as written:
    /// warned of at their field, with the `_logic` twin to use.
    #[test]
    fn static_templates_are_warned_of() {
        let def = json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "c", "name": "c", "function": {"name": "cache_read",
                "input": {"connector": "r", "key": "price:{{payload.sku}}"}}},
            {"id": "h", "name": "h", "function": {"name": "http_call", "input": {
                "connector": "api", "path": "/prices/{sku}",
                "headers": {"X-Sku": "${data.sku}", "Accept": "application/json"},
                "body": {"items": [{"sku": "{{payload.sku}}"}], "note": "a {b} c"}}}},
            {"id": "ok", "name": "ok", "function": {"name": "cache_write", "input": {
                "connector": "r", "key": "fixed", "value": "{\"json\": 1}"}}}]});
        let compiled = compile_workflow(&def).unwrap();
        let warned: Vec<(&str, &str)> = compiled
            .warnings
            .iter()
            .map(|w| (w.field.as_str(), w.message.as_str()))
            .collect();
        assert_eq!(
            warned.iter().map(|w| w.0).collect::<Vec<_>>(),
            [
                "tasks[0].function.input.key",
                "tasks[1].function.input.path",
                "tasks[1].function.input.headers.X-Sku",
                "tasks[1].function.input.body.items[0].sku",
            ],
            "{warned:?}"
        );
        assert!(
            warned[0].1.starts_with(
                "'price:{{payload.sku}}' looks like a template, but it is used as written \
                 (the same for every request); compute it with key_logic"
            ),
            "{}",
            warned[0].1
        );
        assert!(
            warned[2].1.ends_with("static fields are not expanded"),
            "{}",
            warned[2].1
        );
        // Legitimate static text (audit 119): Redis Cluster hash tags, a
        // PostgreSQL array literal, a GraphQL query string, an upstream's
        // own template.
        let def = json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "c", "name": "c", "function": {"name": "cache_read",
                "input": {"connector": "r", "key": "{user1000}.following"}}},
            {"id": "d", "name": "d", "function": {"name": "db_read", "input": {"connector": "db",
                "query": "SELECT * FROM t WHERE m = '{{1,2},{3,4}}'::int[]"}}},
            {"id": "h", "name": "h", "function": {"name": "http_call", "input": {
                "connector": "api", "path": "/graphql?query={me{name}}",
                "body": {"subject": "Hi {{name}}"}}}}]});
        let compiled = compile_workflow(&def).unwrap();
        assert!(compiled.warnings.is_empty(), "{:?}", compiled.warnings);
        // One pass (review: a run of `{` was quadratic), triple mustache,
        // non-ASCII text.
        assert!(!looks_like_template(&"{".repeat(1 << 20), true, false));
        assert!(!looks_like_template(&"${".repeat(1 << 19), true, false));
        assert!(looks_like_template("{{{payload.sku}}}", false, true));
        assert!(!looks_like_template("é{{é}}${é", true, false));
        assert!(looks_like_template("é{{ name }}", false, false));
        // The engine's compile skips these analyses.
        assert!(compile_stored_workflow(&def).unwrap().warnings.is_empty());
        let templated = json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "c", "name": "c", "function": {"name": "cache_read",
                "input": {"connector": "r", "key": "k:{{payload.sku}}"}}}]});
        assert_eq!(compile_workflow(&templated).unwrap().warnings.len(), 1);
        assert!(
            compile_stored_workflow(&templated)
                .unwrap()
                .warnings
                .is_empty()
        );
    }

    /// A data function's misspelt field, a mapping's or rule's, and a
    /// static field beside its `_logic` twin are warnings with their paths.
    #[test]
    fn misspelt_data_inputs_and_doubled_twins_are_warnings() {
        let def = json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "f", "name": "f", "function": {"name": "filter",
             "input": {"condition": {"var": "data.ok"}, "onReject": "skip"}}},
            {"id": "m", "name": "m", "function": {"name": "map",
             "input": {"mappings": [{"path": "a", "logic": 1}, {"path": "b", "logic": 1, "lgoic": 2}]}}},
            {"id": "v", "name": "v", "function": {"name": "validation",
             "input": {"rules": [{"logic": true, "message": "m", "halt": true}]}}},
            {"id": "p", "name": "p", "function": {"name": "publish_json",
             "input": {"source": "a", "target": "b", "prety": true}}},
            {"id": "h", "name": "h", "function": {"name": "http_call",
             "input": {"connector": "c", "path": "/x", "path_logic": "/y",
                       "body": 1, "body_logic": 2}}},
            {"id": "k", "name": "k", "function": {"name": "cache_read",
             "input": {"connector": "c", "key": "a", "key_logic": "b"}}},
            {"id": "j", "name": "j", "function": {"name": "parse_json",
             "input": {"source": "payload", "target": "data.order"}}},
            {"id": "q", "name": "q", "function": {"name": "publish_json",
             "input": {"source": "order", "target": "database.text"}}}]});
        let compiled = compile_workflow(&def).unwrap();
        let warnings: Vec<(&str, &str)> = compiled
            .warnings
            .iter()
            .map(|w| (w.field.as_str(), w.message.as_str()))
            .collect();
        assert_eq!(
            warnings.iter().map(|w| w.0).collect::<Vec<_>>(),
            [
                "tasks[0].function.input.onReject",
                "tasks[1].function.input.mappings[1].lgoic",
                "tasks[2].function.input.rules[0].halt",
                "tasks[3].function.input.prety",
                "tasks[4].function.input.path",
                "tasks[4].function.input.body",
                "tasks[5].function.input.key",
                "tasks[6].function.input.target",
            ],
            "{warnings:?}"
        );
        assert_eq!(
            warnings[0].1,
            "unknown field, ignored; expected one of condition, on_reject"
        );
        assert_eq!(
            warnings[4].1,
            "ignored: path_logic is given too, and is used instead"
        );
        assert_eq!(
            warnings[7].1,
            "is a path under data, so this is data.data.order; \
             drop the leading 'data.' if it names the context's data"
        );
    }

    /// `cache_write.ttl_secs` is any positive number of seconds, kept to the
    /// millisecond (rounded up, at least 1 ms).
    #[test]
    fn cache_ttls_keep_fractions_of_a_second() {
        let ttl_of = |t: Json| {
            let def = json!({"workflow_id": "w", "name": "w", "tasks": [
                {"id": "c", "name": "c", "function": {"name": "cache_write", "input":
                    {"connector": "c", "key": "k", "value": 1, "ttl_secs": t}}}]});
            let plan = compile_workflow(&def).unwrap().plan;
            let Some(Step::Task(task)) = plan.body.steps.first() else {
                panic!()
            };
            let FunctionPlan::CacheWrite(p) = &task.function else {
                panic!()
            };
            p.ttl.map(|d| d.as_millis())
        };
        assert_eq!(ttl_of(json!(60)), Some(60_000));
        assert_eq!(ttl_of(json!(1.5)), Some(1_500));
        assert_eq!(ttl_of(json!(0.0001)), Some(1));
        assert_eq!(ttl_of(json!(2.0004)), Some(2_001));
    }

    /// A leading `#` escapes the area names too (shared decisions: "one
    /// leading `#` makes the rest a literal object key").
    #[test]
    fn an_escaped_first_segment_is_a_key_of_data() {
        for (text, area, path) in [
            ("temp_data.x", Area::TempData, "x"),
            ("#temp_data.x", Area::Data, "temp_data.x"),
            ("#metadata", Area::Data, "metadata"),
            ("#data", Area::Data, "data"),
            ("data.x", Area::Data, "x"),
            ("#0", Area::Data, "#0"),
        ] {
            let w = WritePath::parse(text);
            assert_eq!(
                (w.area, w.path.to_string()),
                (area, path.to_owned()),
                "{text}"
            );
        }
    }

    #[test]
    fn independent_mappings_share_a_run() {
        // The reference workload's "totals" task: four rules reading what
        // none of the four writes.
        assert_eq!(
            runs(&[
                (
                    "data.order.subtotal",
                    json!({"reduce": [{"var": "data.order.items"}, {"+": [{"var": "accumulator"}, {"var": "current.qty"}]}, 0]})
                ),
                (
                    "data.order.item_count",
                    json!({"var": "data.order.items.length"})
                ),
                (
                    "data.order.customer.full_name",
                    json!({"cat": [{"var": "data.order.customer.first_name"}, " ", {"var": "data.order.customer.last_name"}]})
                ),
                (
                    "data.order.customer.tier",
                    json!({"if": [{">=": [{"var": "data.order.customer.lifetime_value"}, 1000]}, "gold", "bronze"]})
                ),
            ]),
            vec![0..4]
        );
        // A read of a sibling of a written key does not depend on it; paths
        // without an area are in `data`.
        assert_eq!(
            runs(&[
                ("a.b", json!(1)),
                ("c", json!({"var": "data.a.c"})),
                ("temp_data.t", json!(2)),
                ("temp_data.u", json!({"var": "data.a.c"}))
            ]),
            vec![0..2, 2..4]
        );
    }

    #[test]
    fn a_mapping_that_may_see_an_earlier_write_starts_a_new_run() {
        let cases: Vec<Vec<(&str, Json)>> = vec![
            // Reads the written value, its container or the whole context.
            vec![("a", json!(1)), ("b", json!({"var": "data.a"}))],
            vec![("a.b", json!(1)), ("c", json!({"var": "data.a"}))],
            vec![("a.b", json!(1)), ("c", json!({"var": "data.a.b.x"}))],
            vec![("a", json!(1)), ("c", json!({"var": ""}))],
            vec![("a", json!(1)), ("c", json!({"var": "data"}))],
            vec![("a", json!(1)), ("c", json!({"missing": ["data.a"]}))],
            // Reads known only at evaluation time.
            vec![
                ("a", json!(1)),
                ("b", json!({"var": {"cat": ["data.", {"var": "data.k"}]}})),
            ],
            // One path under (or equal to) another.
            vec![("a.b", json!(1)), ("a", json!(2))],
            vec![("a", json!(1)), ("a", json!(2))],
            // An array index, the whole area, another area.
            vec![("a.0", json!(1)), ("b", json!(2))],
            vec![("b", json!(2)), ("a.0", json!(1))],
            vec![("data", json!({})), ("b", json!(2))],
            vec![("a", json!(1)), ("temp_data.b", json!(2))],
        ];
        for case in cases {
            assert_eq!(runs(&case), vec![0..1, 1..2], "{case:?}");
        }
    }
}
