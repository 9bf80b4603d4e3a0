//! JSONLogic: compile a rule once into a flat, immutable program, then evaluate
//! it many times against arena-allocated data.
//!
//! Layout: [`compile`](compile()) (in `compile.rs`) turns the rule JSON into a
//! `Program` — a `Vec<Node>` whose operator nodes reference their arguments as a
//! `u32` range into a shared `args` vector — folding pure constant sub-rules and
//! pre-splitting every constant `var`/`val` path. `eval.rs` walks that array
//! with a small recursive interpreter; `ops/` holds the value semantics
//! (coercion, comparison, strings) shared by the interpreter and the folder.
//!
//! Semantics follow the JSONLogic reference (`tests.json`) and the community
//! compat-tables (including `val`, `??`, `exists`, `try`/`throw`, `preserve`
//! and scoped iterators); see `docs/jsonlogic.md` for the details and the
//! conformance counts.

mod compile;
mod eval;
mod lit;
mod ops;
mod reads;
#[cfg(test)]
mod tests;

use crate::path::Segment;
use crate::value::Value;
use bumpalo::Bump;
use std::fmt;

pub use ops::compare::{loose_eq, strict_eq};
pub(crate) use ops::string::write_js_number;
pub use ops::truthy;
pub(crate) use ops::truthy_json;

/// The deepest nesting (of operators, argument lists and literal containers) a
/// rule may have. Enforced at compile time so evaluation, which recurses once
/// per nesting level, can never overflow the stack.
pub const MAX_DEPTH: usize = 64;

/// The most bytes one evaluation may allocate for operator results (`cat`,
/// `merge`, `map`, …). A rule like `reduce` + `cat [acc, acc]` doubles its
/// output each step; this cap turns that into an error instead of an
/// out-of-memory.
pub const MAX_EVAL_ALLOC: usize = 64 << 20;

/// The most bytes an arena that evaluations allocate into may hold: an
/// evaluation's budget is what is left of it, up to [`MAX_EVAL_ALLOC`]. One
/// execution keeps one arena, so however many rules it runs (a loop, a map
/// of many mappings each doubling the last), its data stays under this.
pub const MAX_ARENA_BYTES: usize = 128 << 20;

/// The deepest value a rule may build: past it, a `reduce` whose
/// accumulator is wrapped once more per element fails. Every walk of a value
/// (stringifying, equality, the JSON writer) recurses once per level, and
/// this keeps such walks far inside a runtime thread's stack.
pub const MAX_VALUE_DEPTH: usize = 4096;

/// How deep the data a rule reads may nest: bodies at most 1,024 levels,
/// the execution context at most 2,048 (`exec::MAX_NESTING`).
pub(crate) const DATA_DEPTH: usize = 2048;

/// The error an evaluation gives when it would pass its budget.
pub(crate) const BUDGET_EXCEEDED: &str =
    "evaluation exceeds its allocation budget (64 MiB per rule, 128 MiB per execution)";

/// A compiled JSONLogic rule. Immutable, `Send + Sync`; evaluate it from any
/// number of threads, each with its own arena.
#[derive(Debug)]
pub struct Logic {
    prog: Program,
    root: NodeId,
    /// The whole rule's value when it folded to a constant.
    constant: Option<serde_json::Value>,
    /// The same, prebuilt, when it is a scalar other than a string: returned
    /// by a plain copy of the whole value (constructing it from the node
    /// would store the tag and a narrow payload separately, and the caller's
    /// copy of the value would then stall on store forwarding).
    scalar: Option<Value<'static>>,
    /// The whole rule's value when it folded to a string, array or object.
    root_const: Option<lit::RootConst>,
    /// What the root is, decided at compile time so an evaluation reaches
    /// its work without reading the root node first.
    entry: Entry,
    /// Whether the rule has a `reduce`, whose accumulator can nest its
    /// result deeper with every element (see [`Logic::may_outgrow_its_data`]).
    accumulates: bool,
}

/// How [`Logic::eval`] starts (when the rule is not a prebuilt scalar).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// A string or JSON constant, read from its node.
    Const,
    /// One plain `var` of the data: a path walk, no evaluator state.
    Var,
    /// Everything else: the interpreter.
    Rule,
}

/// Compiles a JSONLogic rule.
pub fn compile(rule: &serde_json::Value) -> Result<Logic, CompileError> {
    compile::compile(rule)
}

impl Logic {
    /// Evaluates the rule against `data`. The result borrows from `self`
    /// (string constants) and from `arena` (anything computed).
    ///
    /// Small on purpose: a rule that folded to a constant is answered here,
    /// inlined into the caller; everything else goes to [`Self::eval_rule`].
    #[inline(always)]
    pub fn eval<'a>(
        &'a self,
        data: Value<'a>,
        arena: &'a Bump,
    ) -> Result<Value<'a>, EvalError<'a>> {
        if let Some(v) = self.scalar {
            return Ok(v);
        }
        match self.entry {
            Entry::Rule => {
                let error = std::cell::Cell::new(None);
                match self.eval_rule(&data, arena, &error) {
                    Ok(v) => Ok(v),
                    Err(eval::Fail) => Err(eval::take_error(&error)),
                }
            }
            Entry::Var => Ok(self.eval_var(&data)),
            Entry::Const => Ok(match &self.root_const {
                Some(c) => c.value(),
                None => eval::const_value(&self.prog, self.root),
            }),
        }
    }

    /// Takes the data by reference: a by-value `Value` argument is a fresh
    /// copy the callee owns, and reading its payload right after the caller
    /// stored it in pieces stalls on store forwarding. Returns the
    /// niche-packed `R` (laid out like a `Value`), so the interpreter writes
    /// its result straight into the caller's slot; the error details wait
    /// in `error`.
    #[inline(never)]
    fn eval_rule<'a>(
        &'a self,
        data: &Value<'a>,
        arena: &'a Bump,
        error: &std::cell::Cell<Option<EvalError<'a>>>,
    ) -> eval::R<'a> {
        eval::run_raw(&self.prog, self.root, data, arena, error)
    }

    /// One plain `var` needs no evaluator state at all.
    #[inline(never)]
    fn eval_var<'a>(&'a self, data: &Value<'a>) -> Value<'a> {
        match &self.prog.nodes[self.root as usize] {
            Node::Var { path, .. } => eval::get_path(*data, path).unwrap_or(Value::Null),
            _ => Value::Null,
        }
    }

    /// Whether a result can nest deeper than the deepest data the rule read
    /// plus [`MAX_DEPTH`] (the rule's own nesting). Only `reduce` can: its
    /// accumulator may be wrapped once more per element.
    pub fn may_outgrow_its_data(&self) -> bool {
        self.accumulates
    }

    /// The rule's value when it does not depend on the data (it folded to a
    /// constant at compile time).
    pub fn constant(&self) -> Option<&serde_json::Value> {
        self.constant.as_ref()
    }

    /// True when the rule folded to a constant that is truthy (for example a
    /// missing condition written as `true`): callers may skip evaluation.
    pub fn is_always_true(&self) -> bool {
        self.constant.as_ref().is_some_and(ops::truthy_json)
    }
}

/// A rule that cannot be compiled (unknown operator, malformed arguments,
/// nesting too deep).
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
#[error("{message}")]
pub struct CompileError {
    pub message: String,
}

impl CompileError {
    pub(crate) fn new(message: impl Into<String>) -> CompileError {
        CompileError {
            message: message.into(),
        }
    }
}

/// Why an evaluation failed. These are the three error classes of the
/// compat-tables: `NaN`, `Invalid Arguments`, and a value raised by `throw`.
#[derive(Debug, Clone)]
pub enum EvalError<'a> {
    /// A numeric operation had a non-numeric operand or a non-finite result
    /// (`{"+": ["abc"]}`, `{"/": [1, 0]}`, `{">": [1, "A"]}`).
    NaN,
    /// An operator got arguments it cannot work with (`{"-": []}` through a
    /// dynamic argument list, `all` over a non-array, the allocation budget).
    InvalidArguments(&'static str),
    /// The value passed to `throw` (a string such as `"Not an admin"`, or an
    /// object such as `{"type": "…"}`).
    Thrown(Value<'a>),
}

impl EvalError<'_> {
    /// The error's `type` as the compat-tables name it: `"NaN"`,
    /// `"Invalid Arguments"`, or the thrown string / the thrown object's
    /// `type` member (`None` for a thrown value without one).
    pub fn error_type(&self) -> Option<&str> {
        match self {
            EvalError::NaN => Some("NaN"),
            EvalError::InvalidArguments(_) => Some("Invalid Arguments"),
            EvalError::Thrown(Value::Str(s)) => Some(s),
            EvalError::Thrown(v) => v.get("type").and_then(|t| t.as_str()),
        }
    }

    /// The error as the JSON object a `try` handler sees: `{"type": "NaN"}`,
    /// `{"type": "Invalid Arguments"}`, `{"type": "<thrown string>"}`, or the
    /// thrown value itself when it is not a string.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            EvalError::Thrown(v) if !matches!(v, Value::Str(_)) => v.to_json(),
            _ => serde_json::json!({ "type": self.error_type().unwrap_or_default() }),
        }
    }
}

impl fmt::Display for EvalError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvalError::NaN => f.write_str(
                "NaN: a numeric operation got a non-number or produced a non-finite result",
            ),
            EvalError::InvalidArguments(why) => write!(f, "Invalid Arguments: {why}"),
            EvalError::Thrown(Value::Str(s)) => write!(f, "thrown: {s}"),
            EvalError::Thrown(v) => write!(f, "thrown: {}", v.to_json_string()),
        }
    }
}

impl std::error::Error for EvalError<'_> {}

/// Index of a node in `Program::nodes`.
pub(crate) type NodeId = u32;

/// The compiled rule: nodes in post-order (children before parents), so a
/// folded sub-rule can be dropped by truncating the vectors.
#[derive(Debug, Default)]
pub(crate) struct Program {
    pub(crate) nodes: Vec<Node>,
    /// Argument lists of `Node::Op`, as node ids.
    pub(crate) args: Vec<NodeId>,
    /// Array and object constants, prebuilt so evaluation borrows them.
    pub(crate) consts: Vec<lit::Lit>,
}

/// The operators, a closed set: dispatch is a `match`, never a name lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    If,
    And,
    Or,
    Not,
    NotNot,
    Coalesce,
    Try,
    Throw,
    Eq,
    StrictEq,
    Ne,
    StrictNe,
    Gt,
    Ge,
    Lt,
    Le,
    Add,
    Sub,
    Mul,
    Div,
    Mod,
    Max,
    Min,
    Map,
    Filter,
    Reduce,
    All,
    Some,
    None,
    Merge,
    In,
    Cat,
    Substr,
    Length,
    Log,
    /// `var` whose path is only known at evaluation time.
    Var,
    /// `val` whose path is only known at evaluation time.
    Val,
    /// `exists` whose path is only known at evaluation time.
    Exists,
    Missing,
    MissingSome,
    /// A rule array (`[1, {"var": "x"}]`): evaluates each element.
    Array,
}

impl Op {
    /// The two-sided tests: (strict) equality and the orderings.
    pub(crate) fn is_comparison(self) -> bool {
        matches!(
            self,
            Op::Eq | Op::Ne | Op::StrictEq | Op::StrictNe | Op::Lt | Op::Le | Op::Gt | Op::Ge
        )
    }
}

/// One compiled node.
#[derive(Debug)]
pub(crate) enum Node {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// Borrowed by results for free (`Value::Str` of `&'a self`).
    Str(Box<str>),
    /// An array or object constant: index into `Program::consts`.
    Json(u32),
    /// An operator applied to the argument nodes `args[start..start + len]`.
    Op {
        op: Op,
        start: u32,
        len: u32,
    },
    /// An operator whose argument list is the value of one node (`{"max":
    /// {"var": "xs"}}`): an array result is the list, anything else one item.
    Spread {
        op: Op,
        arg: NodeId,
    },
    /// `var`/`val` with a constant path, split at compile time. `level` is how
    /// many scopes to climb (`val`'s `[[n], …]`); `default` is `var`'s
    /// fallback for a missing path.
    Var {
        level: u32,
        path: Box<[Segment]>,
        default: Option<NodeId>,
        /// The path's first key as a `reduce` frame member, resolved here so
        /// reading `current.x` / `accumulator` compares no strings.
        slot: Slot,
    },
    /// `exists` with a constant path.
    Exists {
        path: Box<[Segment]>,
    },
    /// `missing` (`need == None`) or `missing_some` with constant string keys.
    Missing {
        keys: Box<[MissingKey]>,
        need: Option<NodeId>,
    },
    /// `in` against a constant array of strings: sorted for binary search.
    InStrs {
        needle: NodeId,
        set: Box<[Box<str>]>,
    },
    /// `map`, `filter`, `reduce`, `all`, `some` or `none`, with its body
    /// classified at compile time.
    Iter(Box<Iter>),
}

/// An iterator operation.
#[derive(Debug)]
pub(crate) struct Iter {
    pub(crate) op: Op,
    pub(crate) coll: NodeId,
    pub(crate) body: NodeId,
    /// `reduce`'s initial accumulator.
    pub(crate) init: Option<NodeId>,
    pub(crate) shape: Body,
}

/// How an iterator body uses its element, decided at compile time so the
/// per-element loop needs neither a scope nor a node dispatch when it can.
#[derive(Debug)]
pub(crate) enum Body {
    /// A read of the element (in `reduce`: of `current` / `accumulator`) or
    /// a scalar constant.
    One(Operand),
    /// A two-argument arithmetic or comparison operator over two such reads.
    Two(Op, Operand, Operand),
    /// A comparison of a read of the element against a scalar constant
    /// (`{">=": [{"var": "qty"}, 1]}`) as the test of `filter`, `all`,
    /// `some` or `none`: evaluated by a small loop of its own (see
    /// `Ev::quantify`), without the general iterator's set-up.
    Pred {
        op: Op,
        path: Box<[Segment]>,
        konst: Scalar,
    },
    /// Nested two-argument arithmetic over such reads and constants
    /// (`{"+": [{"var": "accumulator"}, {"*": [{"var": "current.price"},
    /// {"var": "current.qty"}]}]}`), as a postfix program run on a small
    /// stack of numbers: no scope, no node dispatch, no `Value` between the
    /// steps. Each step coerces and checks like the operator it replaces.
    Arith(Box<[Step]>),
    /// Any other two-argument operator: called directly per element with a
    /// scope, skipping the node dispatch. `start` indexes its argument list.
    Call { op: Op, start: u32 },
    /// Anything else: evaluated per element in a scope.
    General,
}

/// One step of a [`Body::Arith`] program.
#[derive(Debug)]
pub(crate) enum Step {
    /// Push the operand, coerced to a number.
    Load(Operand),
    /// Pop two numbers, push the result of `+ - * / %` (finite, or NaN error).
    Apply(Op),
}

/// The most numbers a [`Body::Arith`] program keeps at once.
pub(crate) const ARITH_STACK: usize = 8;

/// An operand of a [`Body`].
#[derive(Debug)]
pub(crate) enum Operand {
    /// A path into the element (`reduce`: into `current`).
    Item(Box<[Segment]>),
    /// A path into `reduce`'s accumulator.
    Acc(Box<[Segment]>),
    Const(Scalar),
}

/// A scalar constant.
#[derive(Debug)]
pub(crate) enum Scalar {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Box<str>),
}

impl Scalar {
    #[inline(always)]
    pub(crate) fn value(&self) -> Value<'_> {
        match self {
            Scalar::Null => Value::Null,
            Scalar::Bool(b) => Value::Bool(*b),
            Scalar::Int(i) => Value::Int(*i),
            Scalar::Float(f) => Value::Float(*f),
            Scalar::Str(s) => Value::Str(s),
        }
    }
}

/// What a `var` path's first segment names in a `reduce` frame
/// (`{current, accumulator}`); irrelevant in other frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// The empty path: the whole frame.
    Whole,
    Current,
    Accumulator,
    /// Any other key: absent in a `reduce` frame.
    Other,
}

/// A `missing` key: the text reported back and its pre-split path.
#[derive(Debug)]
pub(crate) struct MissingKey {
    pub(crate) text: Box<str>,
    pub(crate) path: Box<[Segment]>,
}

impl Node {
    pub(crate) fn is_const(&self) -> bool {
        matches!(
            self,
            Node::Null
                | Node::Bool(_)
                | Node::Int(_)
                | Node::Float(_)
                | Node::Str(_)
                | Node::Json(_)
        )
    }
}

#[cfg(test)]
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Logic>();
};
