//! The executor: selects a workflow for a request and runs its plan over the
//! data context.
//!
//! One [`Machine`] holds the state of one execution (context, frame stack,
//! collected errors). It runs steps synchronously until a connector step needs
//! I/O, hands that back as an [`IoRequest`], and is resumed with the result.
//! [`execute`] drives it: a plan of data functions finishes in its first poll,
//! and connector calls are awaited without the machine ever holding the arena
//! across an await (the arena is owned by the `execute` future itself, so the
//! future stays `Send`).

use crate::connectors::{
    CallScope, CalleeError, ConnectorErrorKind, FindRequest, HttpRequest, InvokeRequest, IoRequest,
    IoResult, PublishRequest, Services, SqlRequest,
};
use crate::{json, xml};
use bumpalo::Bump;
use serde_json::Value as Json;
use sluice_compiler::Value;
use sluice_compiler::logic::{Logic, MAX_ARENA_BYTES, truthy};
use sluice_compiler::path::PathSet;
use sluice_compiler::plan::{
    Area, Block, FunctionPlan, Group, LogLevel, Plan, ReadPath, Source, Step, Task, WritePath,
};
use smallvec::SmallVec;
use std::time::Instant;

/// Where the payload is found in the submitted body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadFrom {
    /// The body's `data` member (HTTP requests: `{"data": {...}}`).
    DataMember,
    /// The `data` member when the body is an object that has one, else the
    /// whole body (Kafka messages accept both forms).
    DataMemberOrWhole,
    /// The whole body is the payload (`sluice dry-run`, channel_call).
    Whole,
}

/// Request context, borrowed from the caller. Header names must already be
/// lowercase.
#[derive(Debug, Clone, Copy, Default)]
pub struct Meta<'r> {
    pub headers: &'r [(&'r str, &'r str)],
    pub query: &'r [(&'r str, &'r str)],
    pub path: &'r [(&'r str, &'r str)],
    pub method: &'r str,
    pub channel: &'r str,
    pub request_id: &'r str,
    /// More string members of `metadata` (a Kafka message's `key`, `topic`,
    /// `partition`, `offset`); usually empty.
    pub extra: &'r [(&'r str, &'r str)],
}

/// One request to execute.
#[derive(Debug, Clone, Copy)]
pub struct Input<'r> {
    /// The request body as JSON text (empty means no payload).
    pub body: &'r [u8],
    pub payload_from: PayloadFrom,
    pub meta: Meta<'r>,
    /// The rollout bucket (0..100) of this request, if it has one.
    pub bucket: Option<u8>,
}

/// Knobs for one execution.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Record each task's status and duration (profile and dry-run).
    pub record_tasks: bool,
    /// Serialize `data` pretty-printed.
    pub pretty: bool,
    /// Report connector and composition tasks as skipped instead of calling
    /// them (dry-runs without side effects).
    pub skip_connectors: bool,
    /// Stop with a timeout failure once this instant has passed (checked
    /// between steps, so CPU-bound work is bounded too, not only I/O waits).
    pub deadline: Option<Instant>,
    /// A timer for the deadline (the runtime has none of its own): with it,
    /// a connector call still waiting at the deadline is abandoned and the
    /// execution fails with a timeout naming that task, its workflow
    /// matched and its data as far as it got. Without it, only the checks
    /// between steps apply and the caller must bound the waits itself.
    pub timer: Option<Timer>,
    /// Bytes written into `Execution::data` before the serialized `data`
    /// (the data plane's envelope opening, so the response is built in one
    /// buffer without moving the data). Empty by default.
    pub data_prefix: &'static [u8],
}

/// A future that completes at the given instant (the service passes
/// `tokio::time::sleep_until`).
pub type Timer = fn(Instant) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// The request body could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("request body is not valid JSON: {0}")]
    NotJson(String),
    #[error("request body must be a JSON object")]
    NotObject,
}

/// How a halted execution failed; the service maps this to an HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// A task error (500 TASK_ERROR).
    Task,
    /// A connector call's own timeout (504 TIMEOUT).
    Timeout,
    /// An open circuit breaker (503 SERVICE_UNAVAILABLE).
    CircuitOpen,
    /// A connector call failed otherwise (502 UPSTREAM_ERROR).
    Upstream,
    /// Validation rules failed under `halt_on: failure` (400 BAD_REQUEST).
    Validation,
}

/// The task that halted the workflow.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub kind: FailureKind,
    pub task_id: String,
    /// Where the task is in the definition, e.g. `tasks[2]`.
    pub field: String,
    pub message: String,
    /// For `Validation`: every failed rule's message.
    pub messages: Vec<String>,
}

/// An entry of the response's `errors` array.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ErrorItem {
    pub code: &'static str,
    pub task_id: String,
    pub message: String,
    /// Where the task sits in the definition (`tasks[1]`), for a failure
    /// answer's `details` and a dry run's `errors`; empty when no task is
    /// concerned. Not part of the data plane's `errors` elements.
    #[serde(skip)]
    pub field: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    Executed,
    Skipped,
    Failed,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TaskRecord {
    pub id: String,
    pub status: TaskStatus,
    /// Why a task that was due to run did not (a dry run makes no
    /// connector calls); absent for a task whose condition was false.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
    pub ms: f64,
    /// When the task started (`None`: skipped); for span timestamps.
    #[serde(skip)]
    pub started: Option<Instant>,
}

/// How the workflow ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    /// Every step ran (or a terminal step ended it successfully).
    Completed,
    /// A `filter` with `on_reject: halt` stopped it; still a success.
    Filtered,
    /// A task failure halted it.
    Failed(Failure),
}

/// Which workflow version ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    /// Shared with the plan (no copy per execution).
    pub workflow_id: std::sync::Arc<str>,
    pub version: i64,
}

/// The owned result of one execution.
#[derive(Debug, Clone)]
pub struct Execution {
    /// `None` when no workflow matched the request (nothing ran).
    pub matched: Option<Matched>,
    pub status: Status,
    /// The final `data` as JSON text.
    pub data: Vec<u8>,
    pub errors: Vec<ErrorItem>,
    /// Filled when `Options::record_tasks` is set.
    pub tasks: Vec<TaskRecord>,
    pub workflow_ms: f64,
}

/// Selects and runs a workflow. `candidates` must be ordered by descending
/// priority (the engine snapshot keeps them so); the first whose condition is
/// truthy and whose rollout range accepts the request's bucket runs.
pub async fn execute<'p, I>(
    candidates: I,
    input: Input<'_>,
    services: &Services,
    scope: &CallScope,
    options: &Options,
) -> Result<Execution, InputError>
where
    I: IntoIterator<Item = &'p Plan>,
{
    let arena = Arena::take();
    // The workflow is timed only when its task records are kept (profile,
    // traces, dry-run): two clock reads less per plain request.
    let start = options.record_tasks.then(Instant::now);
    let context = Context::new(&input, &arena)?;
    let mut condition_error = None;
    let Some(plan) = select(
        candidates,
        &context,
        input.bucket,
        &arena,
        &mut condition_error,
    ) else {
        return Ok(Execution {
            matched: None,
            status: Status::Completed,
            data: b"{}".to_vec(),
            // Why a workflow whose condition failed did not match (the
            // first such one): a 404 that says only "no match" hides it.
            errors: condition_error.into_iter().collect(),
            tasks: Vec::new(),
            workflow_ms: 0.0,
        });
    };
    let mut machine = Machine::new(plan, context, input.bucket, options);
    loop {
        match machine.run(&arena) {
            Next::Done => break,
            Next::Io(io) => {
                let result = match (options.deadline, options.timer) {
                    (Some(deadline), Some(timer)) => {
                        // Declared before the call, so dropped after it.
                        let abandoning = Abandoning::default();
                        let mut call = std::pin::pin!(services.perform(scope, io));
                        let mut expired = timer(deadline);
                        // The call first: an answer that is ready when the
                        // deadline also is still counts.
                        let result = std::future::poll_fn(|cx| match call.as_mut().poll(cx) {
                            std::task::Poll::Ready(result) => std::task::Poll::Ready(Some(result)),
                            std::task::Poll::Pending => expired.as_mut().poll(cx).map(|()| None),
                        })
                        .await;
                        if result.is_none() {
                            // The call is dropped at the end of this block
                            // with the flag up.
                            abandoning.raise();
                        }
                        result
                    }
                    _ => Some(services.perform(scope, io).await),
                };
                match result {
                    Some(result) => machine.resume(result, &arena),
                    None => machine.time_out(),
                }
            }
        }
    }
    Ok(machine.finish(start, options))
}

thread_local! {
    static ABANDONING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the connector call being dropped now was abandoned at the
/// execution deadline (its remote did not answer in the channel's
/// `timeout_ms`), rather than dropped because the client went away or the
/// service is stopping. A connector's circuit breaker counts the first as a
/// failure, as the call's own timeout would have been, and not the second
/// (that says nothing about the remote). Read from `Drop` implementations:
/// the flag is up only while the executor drops the abandoned call, on this
/// thread; a `channel_call` callee's calls dropped with it see it too.
pub fn abandoned_at_deadline() -> bool {
    ABANDONING.with(std::cell::Cell::get)
}

/// Raises the flag for the drop of the call declared after it, and puts
/// back what it was when dropped itself (an outer execution abandoning a
/// `channel_call` may have raised it already).
#[derive(Default)]
struct Abandoning {
    before: std::cell::Cell<Option<bool>>,
}

impl Abandoning {
    fn raise(&self) {
        self.before.set(Some(ABANDONING.with(|f| f.replace(true))));
    }
}

impl Drop for Abandoning {
    fn drop(&mut self) {
        if let Some(before) = self.before.get() {
            ABANDONING.with(|f| f.set(before));
        }
    }
}

/// An execution's arena, taken from a small per-thread pool and given back
/// reset: a request does not pay for allocating and freeing its 16 KiB
/// (blocks that size skip the allocator's per-thread cache, and with many
/// requests in flight freeing them meant consolidating free lists). An arena
/// that grew past `KEEP_BYTES` (a large body) is freed instead of kept.
struct Arena(Option<Bump>);

const ARENA_BYTES: usize = 16 * 1024;
const KEEP_BYTES: usize = 256 * 1024;
const POOLED_PER_THREAD: usize = 32;

thread_local! {
    static ARENAS: std::cell::RefCell<Vec<Bump>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Arena {
    fn take() -> Arena {
        let pooled = ARENAS.try_with(|p| p.borrow_mut().pop()).ok().flatten();
        Arena(Some(
            pooled.unwrap_or_else(|| Bump::with_capacity(ARENA_BYTES)),
        ))
    }
}

impl std::ops::Deref for Arena {
    type Target = Bump;
    fn deref(&self) -> &Bump {
        self.0.as_ref().expect("an arena is held until drop")
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let Some(mut bump) = self.0.take() else {
            return;
        };
        if bump.allocated_bytes() > KEEP_BYTES {
            return;
        }
        bump.reset();
        // During thread teardown the pool may be gone: the arena is freed.
        let _ = ARENAS.try_with(|p| {
            let mut pool = p.borrow_mut();
            if pool.len() < POOLED_PER_THREAD {
                pool.push(bump);
            }
        });
    }
}

/// What `parse_json` (or, with `is_xml`, `parse_xml`) makes of its source:
/// text is parsed, a missing or null source is null, and `parse_json` takes
/// any other value as it is.
/// What a parse task writes, and a bound on its size counted as a tree when
/// known without walking it (see `Machine::check_nesting`): parsed JSON
/// text, or the request's payload itself.
fn parse_source<'a>(
    source: &ReadPath,
    is_xml: bool,
    root: Value<'a>,
    context: &Context<'a>,
    arena: &'a Bump,
) -> Result<(Value<'a>, Option<usize>), String> {
    match source.path.get(root) {
        None | Some(Value::Null) => Ok((Value::Null, Some(0))),
        Some(Value::Str(text)) if is_xml => xml::parse(text, arena).map(|v| (v, None)),
        Some(Value::Str(text)) => json::parse_str_sized(text, arena)
            .map(|(v, size)| (v, Some(size)))
            .map_err(|e| format!("source '{}' is not valid JSON: {}", source.text, e.0)),
        Some(other) if is_xml => Err(format!(
            "source '{}' must be XML text, got {}",
            source.text,
            sluice_compiler::value::type_name(&other)
        )),
        Some(other) => Ok((
            other,
            same_container(&other, &context.payload).then_some(context.payload_size),
        )),
    }
}

/// Whether `a` and `b` are the same container (one slice), not equal ones.
fn same_container(a: &Value<'_>, b: &Value<'_>) -> bool {
    match (a, b) {
        (Value::Array(x), Value::Array(y)) => std::ptr::eq(*x, *y),
        (Value::Object(x), Value::Object(y)) => std::ptr::eq(*x, *y),
        _ => false,
    }
}

/// The context a workflow condition sees when the workflow starts with a
/// parse task (`Plan::condition_after_parse`): that task's result written
/// where it will be. `None` when the parse would fail (the condition then
/// sees `data` as it is, and the task reports the failure if it runs).
fn after_leading_parse<'a>(
    plan: &'a Plan,
    context: &Context<'a>,
    arena: &'a Bump,
) -> Option<Value<'a>> {
    let (FunctionPlan::ParseJson { source, target } | FunctionPlan::ParseXml { source, target }) =
        &plan.leading_parse()?.function
    else {
        return None;
    };
    let is_xml = matches!(
        plan.leading_parse()?.function,
        FunctionPlan::ParseXml { .. }
    );
    let (value, _) = parse_source(source, is_xml, context.root(arena), context, arena).ok()?;
    let mut parsed = *context;
    let area = parsed.area_mut(target.area);
    *area = target.path.set_borrowed(*area, value, arena).ok()?;
    Some(parsed.root(arena))
}

/// Picks the workflow for a request: first by priority whose condition holds
/// and whose rollout accepts the bucket. No task has run yet, so conditions
/// see `data` empty, except that a workflow starting with `parse_json` /
/// `parse_xml` has its condition see what that task parses (the spec: "when
/// a workflow does not start with parse_json, conditions that reference
/// data.* see an empty context").
fn select<'p: 'a, 'a, I>(
    candidates: I,
    context: &Context<'a>,
    bucket: Option<u8>,
    arena: &'a Bump,
    condition_error: &mut Option<ErrorItem>,
) -> Option<&'p Plan>
where
    I: IntoIterator<Item = &'p Plan>,
{
    let mut root = None;
    candidates.into_iter().find(|plan| {
        if !plan.rollout.accepts(bucket) {
            return false;
        }
        match &plan.condition {
            None => true,
            Some(condition) => {
                let parsed = if plan.condition_after_parse {
                    after_leading_parse(plan, context, arena)
                } else {
                    None
                };
                let at = parsed.unwrap_or_else(|| *root.get_or_insert_with(|| context.root(arena)));
                match condition.eval(at, arena) {
                    Ok(v) => truthy(&v),
                    // A condition that cannot be evaluated does not match
                    // (the next workflow may); the first such error is kept.
                    Err(e) => {
                        if condition_error.is_none() {
                            *condition_error = Some(ErrorItem {
                                code: "TASK_ERROR",
                                task_id: String::new(),
                                field: String::new(),
                                message: format!(
                                    "the condition of workflow '{}' failed: {e}",
                                    plan.workflow_id
                                ),
                            });
                        }
                        false
                    }
                }
            }
        }
    })
}

/// The four areas of the data context.
#[derive(Debug, Clone, Copy)]
struct Context<'a> {
    data: Value<'a>,
    metadata: Value<'a>,
    temp_data: Value<'a>,
    payload: Value<'a>,
    /// A bound on `payload`'s size counted as a tree (`json::parse_sized`).
    payload_size: usize,
}

impl<'a> Context<'a> {
    fn new(input: &Input<'a>, arena: &'a Bump) -> Result<Context<'a>, InputError> {
        let body = trim_ascii(input.body);
        let mut payload_size = 0;
        let payload = if body.is_empty() {
            Value::Null
        } else {
            let (parsed, size) =
                json::parse_sized(body, arena).map_err(|e| InputError::NotJson(e.0))?;
            payload_size = size;
            match input.payload_from {
                PayloadFrom::Whole => parsed,
                PayloadFrom::DataMember => match parsed {
                    Value::Object(_) => parsed.get("data").unwrap_or(Value::Null),
                    _ => return Err(InputError::NotObject),
                },
                PayloadFrom::DataMemberOrWhole => parsed.get("data").unwrap_or(parsed),
            }
        };
        Ok(Context {
            data: Value::EMPTY_OBJECT,
            metadata: metadata(&input.meta, arena),
            temp_data: Value::EMPTY_OBJECT,
            payload,
            payload_size,
        })
    }

    /// The context as the object JSONLogic reads.
    fn root(&self, arena: &'a Bump) -> Value<'a> {
        Value::Object(arena.alloc_slice_copy(&[
            ("data", self.data),
            ("metadata", self.metadata),
            ("temp_data", self.temp_data),
            ("payload", self.payload),
        ]))
    }

    fn area_mut(&mut self, area: Area) -> &mut Value<'a> {
        match area {
            Area::Data => &mut self.data,
            Area::TempData => &mut self.temp_data,
            Area::Metadata => &mut self.metadata,
        }
    }
}

fn trim_ascii(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &bytes[start..end]
}

fn pairs<'a>(items: &[(&'a str, &'a str)], arena: &'a Bump) -> Value<'a> {
    Value::Object(arena.alloc_slice_fill_iter(items.iter().map(|(k, v)| (*k, Value::Str(v)))))
}

fn metadata<'a>(meta: &Meta<'a>, arena: &'a Bump) -> Value<'a> {
    let fixed = [
        ("headers", pairs(meta.headers, arena)),
        ("query", pairs(meta.query, arena)),
        ("path", pairs(meta.path, arena)),
        ("method", Value::Str(meta.method)),
        ("channel", Value::Str(meta.channel)),
        ("request_id", Value::Str(meta.request_id)),
    ];
    if meta.extra.is_empty() {
        return Value::Object(arena.alloc_slice_copy(&fixed));
    }
    let mut all =
        bumpalo::collections::Vec::with_capacity_in(fixed.len() + meta.extra.len(), arena);
    all.extend(fixed);
    all.extend(meta.extra.iter().map(|(k, v)| (*k, Value::Str(v))));
    Value::Object(all.into_bump_slice())
}

/// What the machine needs next.
pub enum Next {
    Done,
    Io(IoRequest),
}

/// A block being executed: which step is next and which pass of its loop.
struct Frame<'p> {
    block: &'p Block,
    next: usize,
    pass: u32,
    /// The group this block belongs to (`None` for the workflow's own steps).
    group: Option<&'p Group>,
    /// `errors.len()` on entry, to tell whether the group failed.
    errors_on_entry: usize,
}

/// A task error before it is classified by the task's error policy.
struct TaskError {
    kind: FailureKind,
    message: String,
}

impl TaskError {
    fn task(message: impl Into<String>) -> TaskError {
        TaskError {
            kind: FailureKind::Task,
            message: message.into(),
        }
    }
}

/// What a task's outcome means for the pipeline.
enum Flow {
    Continue,
    /// The task stood aside (a `filter` rejecting with `on_reject: skip`):
    /// the workflow goes on, the task counts as skipped, and its
    /// `terminal` does not apply.
    Skipped,
    Stop(Status),
}

/// The state of one execution.
struct Machine<'a> {
    plan: &'a Plan,
    ctx: Context<'a>,
    /// The context object for JSONLogic, rebuilt lazily after writes.
    root: Option<Value<'a>>,
    frames: SmallVec<[Frame<'a>; 4]>,
    errors: Vec<ErrorItem>,
    status: Option<Status>,
    record_tasks: bool,
    tasks: Vec<TaskRecord>,
    /// The connector task waiting for its I/O, and when it started (only
    /// timed when tasks are recorded).
    pending: Option<(&'a Task, Option<Instant>)>,
    task_started: Option<Instant>,
    /// Steps run since the deadline was last checked.
    steps_unchecked: u32,
    skip_connectors: bool,
    deadline: Option<Instant>,
    /// The task most recently started (named by a timeout failure).
    current: Option<&'a Task>,
    /// The request's rollout bucket, passed on to `channel_call`.
    bucket: Option<u8>,
    /// An upper bound on how deep the context nests (see `check_nesting`).
    depth_bound: usize,
    /// A connector's answer is being stored (see `check_nesting`).
    answer_write: bool,
    /// What the execution's writes have stored, counted as trees (see
    /// `check_nesting` and [`MAX_WRITTEN_BYTES`]).
    written: usize,
}

/// The most an execution's writes may store, each value counted as a tree
/// ([`Value::tree_size_within`]): a text's bytes, a container's elements
/// and their text. Values share what they are made of, so without this a
/// few writes of `data` into itself (each doubling what the answer writes
/// out) would make an answer of petabytes from an arena of kilobytes.
pub const MAX_WRITTEN_BYTES: usize = 256 << 20;

/// The deepest the execution context may nest. Every value in it passed
/// [`check_nesting`] when it was written (a request body nests at most
/// 1,024 levels, simd-json's limit), so whatever walks the context
/// recursively (the JSON writer, equality, string conversion, traces) stays
/// well within a thread's stack. A loop that wraps a value in one more array
/// per pass ends with a task error here instead of overflowing the stack.
pub const MAX_NESTING: usize = 2048;

/// A bound on how deep the context of a fresh execution nests: the request
/// body at most 1,024 levels (simd-json's limit) under the context's own.
const INPUT_NESTING: usize = 1030;

impl<'a> Machine<'a> {
    fn new(plan: &'a Plan, ctx: Context<'a>, bucket: Option<u8>, options: &Options) -> Self {
        let record_tasks = options.record_tasks;
        let mut frames = SmallVec::new();
        frames.push(Frame {
            block: &plan.body,
            next: 0,
            pass: 0,
            group: None,
            errors_on_entry: 0,
        });
        Machine {
            plan,
            ctx,
            root: None,
            frames,
            errors: Vec::new(),
            status: None,
            record_tasks,
            tasks: if record_tasks {
                Vec::with_capacity(plan.task_count)
            } else {
                Vec::new()
            },
            pending: None,
            task_started: None,
            steps_unchecked: 0,
            skip_connectors: options.skip_connectors,
            deadline: options.deadline,
            current: None,
            bucket,
            depth_bound: INPUT_NESTING,
            answer_write: false,
            written: 0,
        }
    }

    fn root(&mut self, arena: &'a Bump) -> Value<'a> {
        match self.root {
            Some(root) => root,
            None => {
                let root = self.ctx.root(arena);
                self.root = Some(root);
                root
            }
        }
    }

    /// Refuses a write that would make the context nest deeper than
    /// [`MAX_NESTING`]. Scalars cost one comparison. A container that is
    /// made of data already in the context (or of a connector's answer,
    /// which its JSON parser bounds to 128 levels) plus at most a rule's own
    /// nesting passes on the bound alone while that stays under the limit
    /// (the reference workload's writes all do); otherwise, or when the
    /// value comes from a `reduce` (`may_outgrow`), it is walked, only as
    /// deep as the limit.
    fn check_nesting(
        &mut self,
        target: &WritePath,
        value: &Value<'_>,
        may_outgrow: bool,
        known_size: Option<usize>,
    ) -> Result<(), TaskError> {
        // `data` is what a sync request answers, `{status, data: <object>,
        // errors}`: replaced whole by a task's own computation, it stays a
        // document. An array is one (`db_read` and `mongo_read` write their
        // rows to `data` by default); a scalar or `null` is not. A
        // connector's answer is exempt (`write_answer`): the spec's
        // defaults write it to `data` whatever it is (`cache_read`'s miss
        // is null).
        if !self.answer_write
            && target.path.segments().is_empty()
            && target.area == sluice_compiler::plan::Area::Data
            && !matches!(value, Value::Object(_) | Value::Array(_))
        {
            return Err(TaskError::task(format!(
                "cannot write '{}': data is an object or an array, and the value is {}",
                target.text,
                sluice_compiler::value::type_name(value)
            )));
        }
        // `metadata` is the request's context (`headers`, `query`, `path`,
        // ...), read by later conditions: replaced whole, it stays an object.
        if target.path.segments().is_empty()
            && target.area == sluice_compiler::plan::Area::Metadata
            && !matches!(value, Value::Object(_))
        {
            return Err(TaskError::task(format!(
                "cannot write '{}': metadata is an object, and the value is {}",
                target.text,
                sluice_compiler::value::type_name(value)
            )));
        }
        // The area itself and each segment of the path are a level above it.
        let levels = 1 + target.path.segments().len();
        let size = match *value {
            Value::Str(s) => s.len(),
            _ if known_size.is_some() => known_size.unwrap_or_default(),
            Value::Array(_) | Value::Object(_) => value
                .tree_size_within(MAX_WRITTEN_BYTES - self.written)
                .unwrap_or(usize::MAX),
            _ => 0,
        };
        if size > MAX_WRITTEN_BYTES - self.written {
            return Err(written_too_much(target));
        }
        self.written += size;
        if !matches!(value, Value::Array(_) | Value::Object(_)) {
            // A scalar nests as deep as its path: that bounds the context too.
            if levels > MAX_NESTING {
                return Err(TaskError::task(format!(
                    "cannot write '{}': the path would nest deeper than {MAX_NESTING} levels",
                    target.text
                )));
            }
            self.depth_bound = self.depth_bound.max(levels);
            return Ok(());
        }
        if !may_outgrow {
            let estimate = levels + self.depth_bound + sluice_compiler::logic::MAX_DEPTH;
            if estimate <= MAX_NESTING {
                self.depth_bound = self.depth_bound.max(estimate);
                return Ok(());
            }
        }
        if value.nests_deeper_than(MAX_NESTING.saturating_sub(levels)) {
            return Err(TaskError::task(format!(
                "cannot write '{}': the value would nest deeper than {MAX_NESTING} levels",
                target.text
            )));
        }
        // Within the limit, which bounds the context from now on.
        self.depth_bound = MAX_NESTING;
        Ok(())
    }

    fn write(
        &mut self,
        target: &'a WritePath,
        value: Value<'a>,
        arena: &'a Bump,
        may_outgrow: bool,
    ) -> Result<(), TaskError> {
        self.write_sized(target, value, arena, may_outgrow, None)
    }

    /// [`Self::write`], with a bound on the value's size counted as a tree
    /// when one is known without walking it (a parse task's result).
    fn write_sized(
        &mut self,
        target: &'a WritePath,
        value: Value<'a>,
        arena: &'a Bump,
        may_outgrow: bool,
        known_size: Option<usize>,
    ) -> Result<(), TaskError> {
        self.check_nesting(target, &value, may_outgrow, known_size)?;
        check_room(target, arena)?;
        let area = self.ctx.area_mut(target.area);
        *area = target
            .path
            .set_borrowed(*area, value, arena)
            .map_err(|e| TaskError::task(format!("cannot write '{}': {e}", target.text)))?;
        self.root = None;
        Ok(())
    }

    /// Writes a run of a `map` task's values (see `plan::batches`): one
    /// copy of each container along the paths. Should an array stand in
    /// the way, the writes go one by one, which reports it.
    fn write_run(
        &mut self,
        run: &'a [(WritePath, Logic)],
        set: &'a PathSet,
        values: &[Value<'a>],
        arena: &'a Bump,
    ) -> Result<(), TaskError> {
        let Some((first, _)) = run.first() else {
            return Ok(());
        };
        // What the checks charge is charged again by the writes one by one
        // should the run fall back to them.
        let written = self.written;
        for ((path, logic), value) in run.iter().zip(values) {
            self.check_nesting(path, value, logic.may_outgrow_its_data(), None)?;
        }
        check_room(first, arena)?;
        let area = self.ctx.area_mut(first.area);
        match set.set(*area, values, arena) {
            Some(written) => {
                *area = written;
                self.root = None;
                Ok(())
            }
            None => {
                self.written = written;
                for ((path, logic), value) in run.iter().zip(values) {
                    self.write(path, *value, arena, logic.may_outgrow_its_data())?;
                }
                Ok(())
            }
        }
    }

    fn eval(&mut self, logic: &'a Logic, arena: &'a Bump) -> Result<Value<'a>, String> {
        let root = self.root(arena);
        logic.eval(root, arena).map_err(|e| e.to_string())
    }

    fn condition_holds(
        &mut self,
        condition: &'a Option<Logic>,
        arena: &'a Bump,
    ) -> Result<bool, String> {
        match condition {
            None => Ok(true),
            Some(logic) => self.eval(logic, arena).map(|v| truthy(&v)),
        }
    }

    /// Runs steps until the workflow ends or a connector call is needed.
    fn run(&mut self, arena: &'a Bump) -> Next {
        while self.status.is_none() {
            if self.deadline_passed() {
                self.status = Some(Status::Failed(self.timeout_failure()));
                break;
            }
            let Some(frame) = self.frames.last_mut() else {
                self.status = Some(Status::Completed);
                break;
            };
            let block = frame.block;
            if frame.next == 0
                && frame.pass == 0
                && let Some(repeat) = &block.repeat
            {
                // First entry into a looping block: set the counter for pass 0.
                if repeat.max == 0 {
                    frame.next = block.steps.len();
                } else {
                    let counter = Value::Float(repeat.init);
                    if let Err(e) = self.write(&repeat.counter, counter, arena, false) {
                        self.status = Some(Status::Failed(self.loop_failure(e)));
                        break;
                    }
                }
            }
            let frame = self.frames.last_mut().expect("frame exists");
            if frame.next >= block.steps.len() {
                if let Some(repeat) = &block.repeat {
                    frame.pass += 1;
                    if frame.pass < repeat.max {
                        frame.next = 0;
                        let counter =
                            Value::Float(repeat.init + f64::from(frame.pass) * repeat.increment);
                        if let Err(e) = self.write(&repeat.counter, counter, arena, false) {
                            self.status = Some(Status::Failed(self.loop_failure(e)));
                        }
                        continue;
                    }
                }
                let frame = self.frames.pop().expect("frame exists");
                if let Some(group) = frame.group
                    && group.terminal
                    && self.errors.len() == frame.errors_on_entry
                {
                    self.status = Some(Status::Completed);
                }
                continue;
            }
            let step = &block.steps[frame.next];
            frame.next += 1;
            match step {
                Step::Group(group) => match self.condition_holds(&group.condition, arena) {
                    Ok(true) => {
                        let errors_on_entry = self.errors.len();
                        self.frames.push(Frame {
                            block: &group.body,
                            next: 0,
                            pass: 0,
                            group: Some(group),
                            errors_on_entry,
                        });
                    }
                    Ok(false) => self.record_skipped_group(group),
                    Err(message) => {
                        // The group's tasks did not run; under the
                        // workflow's `continue_on_error` the error is
                        // collected and the pipeline goes on, as for a
                        // task's condition (a group has no setting of its
                        // own).
                        self.record_skipped_group(group);
                        let message = format!("group condition failed: {message}");
                        if self.plan.continue_on_error {
                            self.errors.push(ErrorItem {
                                code: "TASK_ERROR",
                                task_id: group.id.to_string(),
                                field: group.field.to_string(),
                                message,
                            });
                        } else {
                            self.status = Some(Status::Failed(Failure {
                                kind: FailureKind::Task,
                                task_id: group.id.to_string(),
                                field: group.field.to_string(),
                                message,
                                messages: Vec::new(),
                            }));
                        }
                    }
                },
                Step::Task(task) => {
                    if let Some(io) = self.start_task(task, arena) {
                        return Next::Io(io);
                    }
                }
            }
        }
        Next::Done
    }

    /// Whether the deadline has passed, reading the clock only every
    /// `DEADLINE_EVERY` steps: a step is bounded work, so this still stops
    /// CPU-bound executions promptly, without a clock read per step. A
    /// connector step checks on its own (see `start_task`).
    fn deadline_passed(&mut self) -> bool {
        const DEADLINE_EVERY: u32 = 16;
        let Some(deadline) = self.deadline else {
            return false;
        };
        self.steps_unchecked += 1;
        if self.steps_unchecked < DEADLINE_EVERY {
            return false;
        }
        self.steps_unchecked = 0;
        Instant::now() >= deadline
    }

    /// The deadline passed while a connector call was waiting: the
    /// execution fails naming the task that made it.
    fn time_out(&mut self) {
        if let Some((task, started)) = self.pending.take() {
            self.task_started = started;
            self.record(task, TaskStatus::Failed);
        }
        self.status = Some(Status::Failed(self.timeout_failure()));
    }

    fn timeout_failure(&self) -> Failure {
        let (task_id, field) = self
            .current
            .map(|t| (t.id.to_string(), t.field.to_string()))
            .unwrap_or_else(|| (self.plan.workflow_id.to_string(), String::new()));
        Failure {
            kind: FailureKind::Timeout,
            task_id,
            field,
            message: "the execution deadline (the channel's timeout_ms) passed".into(),
            messages: Vec::new(),
        }
    }

    fn loop_failure(&self, e: TaskError) -> Failure {
        Failure {
            kind: FailureKind::Task,
            task_id: self.plan.workflow_id.to_string(),
            field: "loop.counter".into(),
            message: e.message,
            messages: Vec::new(),
        }
    }

    fn record_skipped_group(&mut self, group: &Group) {
        if self.record_tasks {
            fn walk(block: &Block, out: &mut Vec<TaskRecord>) {
                for step in &block.steps {
                    match step {
                        Step::Task(t) => out.push(TaskRecord {
                            reason: None,
                            id: t.id.to_string(),
                            status: TaskStatus::Skipped,
                            ms: 0.0,
                            started: None,
                        }),
                        Step::Group(g) => walk(&g.body, out),
                    }
                }
            }
            walk(&group.body, &mut self.tasks);
        }
    }

    /// Runs a task; returns the I/O it needs, if it is a connector task.
    fn start_task(&mut self, task: &'a Task, arena: &'a Bump) -> Option<IoRequest> {
        let started = self.record_tasks.then(Instant::now);
        self.task_started = started;
        self.current = Some(task);
        match self.condition_holds(&task.condition, arena) {
            Ok(true) if self.skip_connectors && task.function.needs_io() => {
                self.record(task, TaskStatus::Skipped);
                if let Some(last) = self.tasks.last_mut() {
                    last.reason = Some("a test run makes no connector or channel calls");
                }
                return None;
            }
            Ok(true) => {}
            Ok(false) => {
                self.record(task, TaskStatus::Skipped);
                return None;
            }
            Err(message) => {
                let flow = self.task_failed(
                    task,
                    TaskError::task(format!("condition failed: {message}")),
                );
                self.apply(flow);
                return None;
            }
        }
        match self.run_function(task, arena) {
            Ok(Step2::Done(Flow::Skipped)) => {
                self.record(task, TaskStatus::Skipped);
                if let Some(last) = self.tasks.last_mut() {
                    last.reason = Some("the filter rejected with on_reject: skip");
                }
                None
            }
            Ok(Step2::Done(flow)) => {
                let flow = match flow {
                    Flow::Continue if task.terminal => Flow::Stop(Status::Completed),
                    other => other,
                };
                self.record(task, TaskStatus::Executed);
                self.apply(flow);
                None
            }
            Ok(Step2::Io(io)) => {
                // Never start a connector call past the deadline.
                if let Some(deadline) = self.deadline {
                    self.steps_unchecked = 0;
                    if Instant::now() >= deadline {
                        self.status = Some(Status::Failed(self.timeout_failure()));
                        return None;
                    }
                }
                self.pending = Some((task, started));
                Some(io)
            }
            Ok(Step2::Validated(failed)) => {
                self.validated(task, failed);
                None
            }
            Err(e) => {
                let flow = self.task_failed(task, e);
                self.apply(flow);
                None
            }
        }
    }

    /// Feeds a connector call's result back to the task that asked for it.
    fn resume(&mut self, result: IoResult, arena: &'a Bump) {
        let Some((task, started)) = self.pending.take() else {
            return;
        };
        self.task_started = started;
        let outcome = match result {
            Ok(out) => {
                if let Some((channel, errors)) = out.callee {
                    self.callee_errors(task, &channel, errors);
                }
                self.store_io_result(task, out.value, arena)
            }
            Err(e) => Err(TaskError {
                kind: match e.kind {
                    ConnectorErrorKind::Timeout => FailureKind::Timeout,
                    ConnectorErrorKind::CircuitOpen => FailureKind::CircuitOpen,
                    ConnectorErrorKind::Upstream => FailureKind::Upstream,
                    ConnectorErrorKind::Other => FailureKind::Task,
                },
                message: format!("{}: {}", function_name(&task.function), e.message),
            }),
        };
        match outcome {
            Ok(()) => {
                self.record(task, TaskStatus::Executed);
                if task.terminal {
                    self.apply(Flow::Stop(Status::Completed));
                }
            }
            Err(e) => {
                let flow = self.task_failed(task, e);
                self.apply(flow);
            }
        }
    }

    /// The errors a called channel's answer carried become the caller's,
    /// on the `channel_call` task, naming the channel and its task.
    fn callee_errors(&mut self, task: &Task, channel: &str, errors: Vec<CalleeError>) {
        for e in errors {
            self.errors.push(ErrorItem {
                code: if e.code == "VALIDATION_ERROR" {
                    "VALIDATION_ERROR"
                } else {
                    "TASK_ERROR"
                },
                task_id: task.id.to_string(),
                field: task.field.to_string(),
                message: format!("channel '{channel}', task '{}': {}", e.task_id, e.message),
            });
        }
    }

    fn store_io_result(
        &mut self,
        task: &'a Task,
        value: Option<Json>,
        arena: &'a Bump,
    ) -> Result<(), TaskError> {
        let target = match &task.function {
            FunctionPlan::HttpCall(p) => p.response_path.as_ref(),
            FunctionPlan::DbRead(p) | FunctionPlan::DbWrite(p) => Some(&p.output),
            FunctionPlan::CacheRead(p) => Some(&p.output),
            FunctionPlan::MongoRead(p) => Some(&p.output),
            FunctionPlan::ChannelCall(p) => Some(&p.response_path),
            _ => None,
        };
        match (target, value) {
            (Some(target), Some(value)) => {
                let v = Value::copy_json(&value, arena);
                self.answer_write = true;
                let written = self.write(target, v, arena, false);
                self.answer_write = false;
                written
            }
            _ => Ok(()),
        }
    }

    fn apply(&mut self, flow: Flow) {
        if let Flow::Stop(status) = flow {
            self.status = Some(status);
        }
    }

    fn record(&mut self, task: &Task, status: TaskStatus) {
        if self.record_tasks {
            let ms = self.task_started.map_or(0.0, |s| millis(s.elapsed()));
            self.tasks.push(TaskRecord {
                id: task.id.to_string(),
                status,
                reason: None,
                ms,
                started: self.task_started.filter(|_| status != TaskStatus::Skipped),
            });
        }
    }

    /// Applies the error policy: halt (the default, and always with
    /// `halt_on: failure`) or collect and continue.
    fn task_failed(&mut self, task: &Task, e: TaskError) -> Flow {
        self.record(task, TaskStatus::Failed);
        let tolerate = task
            .continue_on_error
            .unwrap_or(self.plan.continue_on_error);
        if task.halt_on_failure || !tolerate {
            return Flow::Stop(Status::Failed(Failure {
                kind: e.kind,
                task_id: task.id.to_string(),
                field: task.field.to_string(),
                message: e.message,
                messages: Vec::new(),
            }));
        }
        self.errors.push(ErrorItem {
            code: "TASK_ERROR",
            task_id: task.id.to_string(),
            field: task.field.to_string(),
            message: e.message,
        });
        Flow::Continue
    }

    /// Failed validation rules are reported, and halt only under
    /// `halt_on: failure`.
    fn validated(&mut self, task: &Task, failed: Vec<String>) {
        if failed.is_empty() {
            self.record(task, TaskStatus::Executed);
            if task.terminal {
                self.apply(Flow::Stop(Status::Completed));
            }
            return;
        }
        self.record(task, TaskStatus::Failed);
        if task.halt_on_failure {
            self.status = Some(Status::Failed(Failure {
                kind: FailureKind::Validation,
                task_id: task.id.to_string(),
                field: task.field.to_string(),
                message: failed.join("; "),
                messages: failed,
            }));
            return;
        }
        for message in failed {
            self.errors.push(ErrorItem {
                code: "VALIDATION_ERROR",
                task_id: task.id.to_string(),
                field: task.field.to_string(),
                message,
            });
        }
    }

    fn run_function(&mut self, task: &'a Task, arena: &'a Bump) -> Result<Step2, TaskError> {
        let name = function_name(&task.function);
        let fail = |m: String| TaskError::task(format!("{name}: {m}"));
        match &task.function {
            FunctionPlan::ParseJson { source, target }
            | FunctionPlan::ParseXml { source, target } => {
                let is_xml = matches!(task.function, FunctionPlan::ParseXml { .. });
                let root = self.root(arena);
                let (value, size) =
                    parse_source(source, is_xml, root, &self.ctx, arena).map_err(fail)?;
                self.write_sized(target, value, arena, false, size)?;
                Ok(Step2::Done(Flow::Continue))
            }
            FunctionPlan::Map { mappings, runs } => {
                for run in runs {
                    let Some(set) = &run.paths else {
                        for i in run.range.clone() {
                            let (path, logic) = &mappings[i];
                            let value = self
                                .eval(logic, arena)
                                .map_err(|m| fail(format!("mappings[{i}]: {m}")))?;
                            self.write(path, value, arena, logic.may_outgrow_its_data())?;
                        }
                        continue;
                    };
                    // The run's rules read nothing it writes (checked when the
                    // plan was built): evaluate them all, then write once.
                    let mut values: SmallVec<[Value<'a>; 8]> = SmallVec::new();
                    for i in run.range.clone() {
                        match self.eval(&mappings[i].1, arena) {
                            Ok(value) => values.push(value),
                            Err(m) => {
                                // What the mappings before it wrote stays
                                // written, as one by one.
                                let done = &mappings[run.range.start..i];
                                for ((path, logic), value) in done.iter().zip(&values) {
                                    self.write(path, *value, arena, logic.may_outgrow_its_data())?;
                                }
                                return Err(fail(format!("mappings[{i}]: {m}")));
                            }
                        }
                    }
                    self.write_run(&mappings[run.range.clone()], set, &values, arena)?;
                }
                Ok(Step2::Done(Flow::Continue))
            }
            FunctionPlan::Filter { condition, skip } => {
                let pass = self
                    .eval(condition, arena)
                    .map_err(|m| fail(format!("condition: {m}")))?;
                if truthy(&pass) {
                    Ok(Step2::Done(Flow::Continue))
                } else if *skip {
                    Ok(Step2::Done(Flow::Skipped))
                } else {
                    Ok(Step2::Done(Flow::Stop(Status::Filtered)))
                }
            }
            FunctionPlan::Validation { rules } => {
                let mut failed = Vec::new();
                for (logic, message) in rules {
                    let ok = matches!(self.eval(logic, arena), Ok(Value::Bool(true)));
                    if !ok {
                        failed.push(message.to_string());
                    }
                }
                Ok(Step2::Validated(failed))
            }
            FunctionPlan::Log {
                message,
                level,
                fields,
            } => {
                let text = self
                    .eval(message, arena)
                    .map_err(|m| fail(format!("message: {m}")))?;
                let mut text = display(&text);
                let mut extra = Vec::with_capacity(fields.len());
                for (k, logic) in fields {
                    let v = self
                        .eval(logic, arena)
                        .map_err(|m| fail(format!("fields.{k}: {m}")))?;
                    extra.push((k.as_ref(), v));
                }
                // Secrets never reach the log: the fields are masked as API
                // answers are (secret-named keys at any depth, secret-looking
                // header values, URL passwords).
                let mut fields_json = Value::Object(arena.alloc_slice_copy(&extra)).to_json();
                sluice_compiler::validate::mask_secrets_everywhere(&mut fields_json);
                // Nor the request's credentials under any other name: the
                // values of its credential headers (and the part after an
                // `Authorization` scheme) are masked wherever the message or
                // the fields hold them.
                let mut fields_text = fields_json.to_string();
                for secret in self.secret_header_values() {
                    for s in [&mut text, &mut fields_text] {
                        if s.contains(secret) {
                            *s = s.replace(secret, sluice_compiler::validate::MASK);
                        }
                    }
                }
                let fields_json = fields_text;
                // The message goes out as written: the log formatter keeps
                // every line one line (text logs escape control characters,
                // JSON logs escape as JSON does).
                let workflow = &*self.plan.workflow_id;
                let task_id = &*task.id;
                match level {
                    LogLevel::Trace => {
                        tracing::trace!(target: "sluice::workflow", workflow, task_id, fields = %fields_json, "{text}")
                    }
                    LogLevel::Debug => {
                        tracing::debug!(target: "sluice::workflow", workflow, task_id, fields = %fields_json, "{text}")
                    }
                    LogLevel::Info => {
                        tracing::info!(target: "sluice::workflow", workflow, task_id, fields = %fields_json, "{text}")
                    }
                    LogLevel::Warn => {
                        tracing::warn!(target: "sluice::workflow", workflow, task_id, fields = %fields_json, "{text}")
                    }
                    LogLevel::Error => {
                        tracing::error!(target: "sluice::workflow", workflow, task_id, fields = %fields_json, "{text}")
                    }
                }
                Ok(Step2::Done(Flow::Continue))
            }
            FunctionPlan::PublishJson {
                source,
                target,
                pretty,
            } => {
                let value = self
                    .read_data(source, arena)
                    .ok_or_else(|| fail(format!("source '{}' not found in data", source.text)))?;
                let mut out = Vec::new();
                if *pretty {
                    value.write_json_pretty(&mut out)
                } else {
                    value.write_json(&mut out)
                }
                let text = arena.alloc_str(std::str::from_utf8(&out).unwrap_or_default());
                self.write(target, Value::Str(text), arena, false)?;
                Ok(Step2::Done(Flow::Continue))
            }
            FunctionPlan::PublishXml {
                source,
                target,
                root,
            } => {
                let value = self
                    .read_data(source, arena)
                    .ok_or_else(|| fail(format!("source '{}' not found in data", source.text)))?;
                let text = xml::to_xml(&value, root).map_err(fail)?;
                self.write(target, Value::Str(arena.alloc_str(&text)), arena, false)?;
                Ok(Step2::Done(Flow::Continue))
            }
            FunctionPlan::Invalid { message, .. } => Err(TaskError::task(message.to_string())),
            io => self.io_request(io, arena).map(Step2::Io).map_err(fail),
        }
    }

    /// The values of the request's credential headers
    /// (`validate::is_secret_header`), and of an `Authorization`-style
    /// value the credential after its scheme, longest first; none shorter
    /// than 4 bytes (masking those would garble a log line, not protect it).
    /// The values of the query parameters whose names say credential
    /// (`validate::is_secret_query_param`: `?api_key=`, `?sig=`) too.
    fn secret_header_values(&self) -> Vec<&'a str> {
        let Value::Object(meta) = self.ctx.metadata else {
            return Vec::new();
        };
        let area = |name: &str| match meta.iter().find(|(k, _)| *k == name) {
            Some((_, Value::Object(members))) => *members,
            _ => &[],
        };
        let mut out = Vec::new();
        for (name, value) in area("headers") {
            if let Value::Str(v) = value
                && sluice_compiler::validate::is_secret_header(name)
            {
                out.push(*v);
                if let Some((_, credential)) = v.split_once(' ') {
                    out.push(credential.trim());
                }
            }
        }
        for (name, value) in area("query") {
            if let Value::Str(v) = value
                && sluice_compiler::validate::is_secret_query_param(name)
            {
                out.push(*v);
            }
        }
        out.retain(|v| v.len() >= 4);
        out.sort_by_key(|v| std::cmp::Reverse(v.len()));
        out
    }

    fn read_data(&mut self, source: &ReadPath, arena: &'a Bump) -> Option<Value<'a>> {
        let root = self.root(arena);
        source.path.get(root)
    }

    /// Evaluates a connector input's rule; an error names the input field
    /// (`body_logic: NaN: …`), as `map`'s name their mapping.
    fn eval_field(
        &mut self,
        logic: &'a Logic,
        arena: &'a Bump,
        field: &str,
    ) -> Result<Value<'a>, String> {
        self.eval(logic, arena).map_err(|m| format!("{field}: {m}"))
    }

    /// A static input or its `<field>_logic` rule's value.
    fn source(&mut self, source: &'a Source, arena: &'a Bump, field: &str) -> Result<Json, String> {
        match source {
            Source::Static(v) => Ok(v.clone()),
            Source::Logic(l) => self.eval_field(l, arena, field).map(|v| v.to_json()),
        }
    }

    /// A cache key: text, and not empty (a static `key` is checked at
    /// create; a computed one here, as a `null` is).
    fn cache_key(&mut self, source: &'a Source, arena: &'a Bump) -> Result<String, String> {
        let key = self.source_string(source, arena, "key_logic")?;
        if key.is_empty() {
            return Err(
                "key_logic evaluated to an empty string; a cache key must not be empty".into(),
            );
        }
        if key.trim().is_empty() {
            return Err(
                "key_logic evaluated to blank text (only whitespace); a cache key must not be blank"
                    .into(),
            );
        }
        Ok(key)
    }

    fn source_string(
        &mut self,
        source: &'a Source,
        arena: &'a Bump,
        field: &str,
    ) -> Result<String, String> {
        match source {
            Source::Static(Json::String(s)) => Ok(s.clone()),
            Source::Static(other) => Ok(display_json(other)),
            Source::Logic(l) => match self.eval_field(l, arena, field)? {
                Value::Str(s) => Ok(s.to_owned()),
                Value::Null => Err(format!("{field} evaluated to null")),
                // A path, key or channel name is text: a container here is
                // a mistake (it was sent as its JSON text, `/%7B%22a%22:1%7D`).
                Value::Array(_) => Err(format!("{field} evaluated to an array; expected a string")),
                Value::Object(_) => {
                    Err(format!("{field} evaluated to an object; expected a string"))
                }
                other => Ok(display(&other)),
            },
        }
    }

    /// Builds a connector call from a task's compiled input.
    fn io_request(
        &mut self,
        function: &'a FunctionPlan,
        arena: &'a Bump,
    ) -> Result<IoRequest, String> {
        Ok(match function {
            FunctionPlan::HttpCall(p) => {
                let path = match &p.path {
                    None => None,
                    Some(s) => Some(self.source_string(s, arena, "path_logic")?),
                };
                let body = match &p.body {
                    None => None,
                    Some(s) => Some(self.source(s, arena, "body_logic")?),
                };
                IoRequest::Http(HttpRequest {
                    connector: p.connector.to_string(),
                    method: p.method,
                    path,
                    headers: p
                        .headers
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                    body,
                    timeout_ms: p.timeout_ms,
                    keep_body: p.response_path.is_some(),
                })
            }
            FunctionPlan::DbRead(p) | FunctionPlan::DbWrite(p) => {
                let mut params = Vec::with_capacity(p.params.len());
                for (i, logic) in p.params.iter().enumerate() {
                    params.push(
                        self.eval(logic, arena)
                            .map_err(|m| format!("params[{i}]: {m}"))?
                            .to_json(),
                    );
                }
                let req = SqlRequest {
                    connector: p.connector.to_string(),
                    query: p.query.to_string(),
                    params,
                };
                if matches!(function, FunctionPlan::DbRead(_)) {
                    IoRequest::SqlRead(req)
                } else {
                    IoRequest::SqlWrite(req)
                }
            }
            FunctionPlan::CacheRead(p) => IoRequest::CacheGet {
                connector: p.connector.to_string(),
                key: self.cache_key(&p.key, arena)?,
            },
            FunctionPlan::CacheWrite(p) => {
                // A string as it is, anything else as its JSON text (the
                // spec: "Non-strings are JSON-serialized");
                // `connectors::cached_value` reads it back.
                let value = match &p.value {
                    Source::Static(Json::String(s)) => s.clone(),
                    Source::Static(v) => v.to_string(),
                    Source::Logic(l) => match self.eval_field(l, arena, "value_logic")? {
                        Value::Str(s) => s.to_owned(),
                        other => other.to_json_string(),
                    },
                };
                IoRequest::CacheSet {
                    connector: p.connector.to_string(),
                    key: self.cache_key(&p.key, arena)?,
                    value,
                    ttl: p.ttl,
                }
            }
            FunctionPlan::MongoRead(p) => IoRequest::Find(FindRequest {
                connector: p.connector.to_string(),
                database: p.database.to_string(),
                collection: p.collection.to_string(),
                filter: self.source(&p.filter, arena, "filter_logic")?,
            }),
            FunctionPlan::PublishKafka(p) => {
                let key = match &p.key {
                    None => None,
                    Some(l) => match self.eval_field(l, arena, "key_logic")? {
                        Value::Null => None,
                        Value::Str(s) => Some(s.to_owned()),
                        other => Some(display(&other)),
                    },
                };
                let mut bytes = Vec::with_capacity(256);
                match &p.value {
                    Some(l) => self
                        .eval_field(l, arena, "value_logic")?
                        .write_json(&mut bytes),
                    // The spec's default: the full data context. Its
                    // metadata is masked (credential headers, secret-named
                    // keys) before it leaves the service.
                    None => {
                        let mut metadata = self.ctx.metadata.to_json();
                        sluice_compiler::validate::mask_secrets(&mut metadata);
                        // The whole context as the shared decisions give it,
                        // `payload` included (audit 102: it was left out).
                        let context = serde_json::json!({
                            "data": self.ctx.data.to_json(),
                            "metadata": metadata,
                            "temp_data": self.ctx.temp_data.to_json(),
                            "payload": self.ctx.payload.to_json(),
                        });
                        bytes = context.to_string().into_bytes();
                    }
                }
                IoRequest::Publish(PublishRequest {
                    connector: p.connector.to_string(),
                    topic: p.topic.to_string(),
                    key,
                    value: bytes,
                })
            }
            FunctionPlan::ChannelCall(p) => {
                let channel = self.source_string(&p.channel, arena, "channel_logic")?;
                let data = match &p.data {
                    Some(s) => self.source(s, arena, "data_logic")?,
                    None => self.ctx.payload.to_json(),
                };
                let request_id = match self.ctx.metadata {
                    Value::Object(members) => members.iter().find_map(|(k, v)| match v {
                        Value::Str(id) if *k == "request_id" && !id.is_empty() => {
                            Some((*id).to_owned())
                        }
                        _ => None,
                    }),
                    _ => None,
                };
                IoRequest::Invoke(InvokeRequest {
                    channel,
                    data,
                    timeout_ms: p.timeout_ms,
                    bucket: self.bucket,
                    request_id,
                })
            }
            _ => return Err("not a connector function".into()),
        })
    }

    fn finish(self, start: Option<Instant>, options: &Options) -> Execution {
        // Room for a typical response (growing a 512-byte buffer reallocated
        // it on most requests) while staying within the allocator's
        // per-thread cache (blocks up to about 1 KiB).
        let mut data = Vec::with_capacity(1024);
        data.extend_from_slice(options.data_prefix);
        if options.pretty {
            self.ctx.data.write_json_pretty(&mut data)
        } else {
            self.ctx.data.write_json(&mut data)
        }
        Execution {
            matched: Some(Matched {
                workflow_id: self.plan.workflow_id.clone(),
                version: self.plan.version,
            }),
            status: self.status.unwrap_or(Status::Completed),
            data,
            errors: self.errors,
            tasks: self.tasks,
            workflow_ms: start.map_or(0.0, |s| millis(s.elapsed())),
        }
    }
}

/// The result of running a task's function synchronously.
enum Step2 {
    Done(Flow),
    Io(IoRequest),
    Validated(Vec<String>),
}

/// A write keeps the execution's data under [`MAX_ARENA_BYTES`]: every
/// value the context holds lives in the execution's arena, and evaluations
/// are held to what the arena has left, but a task can grow it otherwise
/// (`publish_json` of a large value, a loop of such writes).
#[inline(always)]
fn check_room(target: &WritePath, arena: &Bump) -> Result<(), TaskError> {
    if arena.allocated_bytes() > MAX_ARENA_BYTES {
        return Err(too_large(target));
    }
    Ok(())
}

#[cold]
#[inline(never)]
fn written_too_much(target: &WritePath) -> TaskError {
    TaskError::task(format!(
        "cannot write '{}': the execution's writes would store more than {} MiB \
         (each value counted whole, a part it holds twice counted twice)",
        target.text,
        MAX_WRITTEN_BYTES >> 20
    ))
}

#[cold]
fn too_large(target: &WritePath) -> TaskError {
    TaskError::task(format!(
        "cannot write '{}': the execution's data would exceed {} MiB",
        target.text,
        MAX_ARENA_BYTES >> 20
    ))
}

fn function_name(f: &FunctionPlan) -> &'static str {
    match f {
        FunctionPlan::ParseJson { .. } => "parse_json",
        FunctionPlan::ParseXml { .. } => "parse_xml",
        FunctionPlan::Map { .. } => "map",
        FunctionPlan::Filter { .. } => "filter",
        FunctionPlan::Validation { .. } => "validation",
        FunctionPlan::Log { .. } => "log",
        FunctionPlan::PublishJson { .. } => "publish_json",
        FunctionPlan::PublishXml { .. } => "publish_xml",
        FunctionPlan::HttpCall(_) => "http_call",
        FunctionPlan::DbRead(_) => "db_read",
        FunctionPlan::DbWrite(_) => "db_write",
        FunctionPlan::CacheRead(_) => "cache_read",
        FunctionPlan::CacheWrite(_) => "cache_write",
        FunctionPlan::MongoRead(_) => "mongo_read",
        FunctionPlan::PublishKafka(_) => "publish_kafka",
        FunctionPlan::ChannelCall(_) => "channel_call",
        FunctionPlan::Invalid { function, .. } => function,
    }
}

/// Text form of a value for messages and keys: strings as they are,
/// everything else as JSON.
fn display(v: &Value<'_>) -> String {
    match v {
        Value::Str(s) => (*s).to_owned(),
        other => other.to_json_string(),
    }
}

fn display_json(v: &Json) -> String {
    match v {
        Json::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A duration in milliseconds at microsecond resolution: timings read as
/// written (`0.05`, not the `0.049999999999999996` that seconds times 1,000
/// gives in binary floating point).
pub fn millis(d: std::time::Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

#[cfg(test)]
mod millis_tests {
    #[test]
    fn timings_read_as_written() {
        let ms = super::millis(std::time::Duration::from_micros(50));
        assert_eq!(serde_json::json!(ms).to_string(), "0.05");
        assert_eq!(
            super::millis(std::time::Duration::from_nanos(1_234_567)),
            1.234
        );
    }
}
