//! The interpreter: walks the flat node array recursively (depth is bounded
//! by `MAX_DEPTH` at compile time), keeps iterator scopes as a linked list on
//! the Rust stack, and allocates results only in the caller's arena.

use super::ops::compare::{Rel, loose_eq_checked, relate, strict_eq};
use super::ops::string::{substr_range, write_js_string};
use super::ops::{js_number, to_number, truthy};
use super::{
    ARITH_STACK, BUDGET_EXCEEDED, Body, DATA_DEPTH, EvalError, Iter, MAX_ARENA_BYTES, MAX_DEPTH,
    MAX_EVAL_ALLOC, MAX_VALUE_DEPTH, MissingKey, Node, NodeId, Op, Operand, Program, Scalar, Slot,
    Step,
};
use crate::path::Segment;
use crate::value::{Value, key_eq};
use bumpalo::Bump;
use bumpalo::collections::{String as BString, Vec as BVec};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// Evaluation result. The error's details wait in `Ev::error`: a zero-sized
/// error keeps `R` as small as `Value` (niche-packed), which measurably cuts
/// the copying of results up the recursion.
pub(crate) type R<'a> = Result<Value<'a>, Fail>;

/// An evaluation failed; `Ev::error` holds why.
pub(crate) struct Fail;

pub(super) fn run<'a>(
    prog: &'a Program,
    root: NodeId,
    data: Value<'a>,
    arena: &'a Bump,
) -> Result<Value<'a>, EvalError<'a>> {
    let error = Cell::new(None);
    match run_raw(prog, root, &data, arena, &error) {
        Ok(v) => Ok(v),
        Err(Fail) => Err(take_error(&error)),
    }
}

/// The evaluation proper. Returns the niche-packed `R` (laid out exactly like
/// a `Value`) so the public wrapper, inlined into the caller, converts it
/// without moving a `Value` between differently shaped enums; the error
/// details land in `error`.
pub(super) fn run_raw<'a>(
    prog: &'a Program,
    root: NodeId,
    data: &Value<'a>,
    arena: &'a Bump,
    error: &Cell<Option<EvalError<'a>>>,
) -> R<'a> {
    let ev = Ev {
        prog,
        arena,
        // What the arena has left (see `MAX_ARENA_BYTES`), at most one rule's.
        budget: Cell::new(
            MAX_EVAL_ALLOC.min(MAX_ARENA_BYTES.saturating_sub(arena.allocated_bytes())),
        ),
        error,
        sizes: RefCell::new(None),
        poisoned: Cell::new(false),
    };
    let r = ev.eval(root, &Scope::root(data));
    // A charge that failed where no error could be returned (a reduce
    // pair read whole) fails the evaluation at its end.
    if ev.poisoned.get() {
        return Err(Fail);
    }
    r
}

#[cold]
pub(super) fn take_error<'a>(error: &Cell<Option<EvalError<'a>>>) -> EvalError<'a> {
    error
        .take()
        .unwrap_or(EvalError::InvalidArguments("unknown failure"))
}

/// Evaluates a node whose arguments are all constants (the folder). `None`
/// when it fails: the error must then surface at evaluation time instead.
pub(super) fn fold(prog: &Program, id: NodeId) -> Option<serde_json::Value> {
    let arena = Bump::new();
    run(prog, id, Value::Null, &arena).ok().map(|v| v.to_json())
}

/// The value of a constant node.
pub(super) fn const_value(prog: &Program, id: NodeId) -> Value<'_> {
    match &prog.nodes[id as usize] {
        Node::Bool(b) => Value::Bool(*b),
        Node::Int(i) => Value::Int(*i),
        Node::Float(f) => Value::Float(*f),
        Node::Str(s) => Value::Str(s),
        Node::Json(i) => prog.consts[*i as usize].value(),
        _ => Value::Null,
    }
}

/// What a path piece means as an object key: strings as they are, anything
/// else as JavaScript's `String(x)` (only non-strings allocate).
pub(super) fn key_text<'a>(v: Value<'a>, arena: &'a Bump) -> &'a str {
    match v {
        Value::Str(s) => s,
        other => {
            let mut out = BString::new_in(arena);
            let _ = write_js_string(&other, "null", &mut out);
            out.into_bump_str()
        }
    }
}

/// The array index a key also names: plain non-negative integers only
/// (`"1"` yes, `"01"`, `"-1"`, `"1.5"` no), as `Segment::parse` decides.
#[inline]
pub(super) fn index_of(key: &str) -> Option<usize> {
    let b = key.as_bytes();
    if b.is_empty()
        || b.len() > 18
        || !b.iter().all(u8::is_ascii_digit)
        || (b.len() > 1 && b[0] == b'0')
    {
        return None;
    }
    key.parse().ok()
}

/// `val`'s scope marker `[n]`: how many levels to climb (sign ignored, as the
/// compat-tables use both `[2]` and `[-2]`).
pub(super) fn level_of(marker: &[Value<'_>]) -> u32 {
    match marker.first() {
        Some(v) => to_number(v).map_or(0, |f| f.abs().min(f64::from(u32::MAX)) as u32),
        None => 0,
    }
}

/// What a quantifier (or `filter`) gives for an empty array: `filter` an
/// empty array, `all` and `some` false, `none` true.
#[inline]
fn empty_result(op: Op) -> Value<'static> {
    match op {
        Op::All | Op::Some => Value::Bool(false),
        Op::None => Value::Bool(true),
        _ => Value::EMPTY_ARRAY,
    }
}

/// The data an expression sees. Iterators push the current item (`reduce`
/// its `{current, accumulator}` pair, kept unboxed so it costs nothing
/// unless someone reads the pair as a whole).
#[derive(Clone, Copy)]
enum Frame<'a> {
    Data(Value<'a>),
    Reduce {
        current: Value<'a>,
        accumulator: Value<'a>,
    },
}

/// A scope: its frame, the iteration index when an iterator pushed it, and
/// the enclosing scope. Lives on the Rust stack, so scopes never allocate.
/// The frame is stored flat (`data`, plus `acc` for a `reduce` frame, whose
/// `data` is then `current`) rather than as a `Frame`, and by reference:
/// copying a `Value` into a scope stores it in two pieces (16 + 8 bytes),
/// and reading its payload back (bytes 8..24) straight after spans both
/// stores, which defeats store forwarding (≈ 10 ns per evaluation).
/// The `acc` of scopes that are not `reduce` frames.
static NULL: Value<'static> = Value::Null;

struct Scope<'s, 'a> {
    data: &'s Value<'a>,
    acc: &'s Value<'a>,
    reduce: bool,
    index: Option<usize>,
    parent: Option<&'s Scope<'s, 'a>>,
}

impl<'s, 'a> Scope<'s, 'a> {
    #[inline]
    fn root(data: &'s Value<'a>) -> Self {
        Scope {
            data,
            acc: &NULL,
            reduce: false,
            index: None,
            parent: None,
        }
    }

    #[inline]
    fn child(data: &'s Value<'a>, index: Option<usize>, parent: &'s Scope<'s, 'a>) -> Self {
        Scope {
            data,
            acc: &NULL,
            reduce: false,
            index,
            parent: Some(parent),
        }
    }

    #[inline]
    fn frame(&self) -> Frame<'a> {
        if self.reduce {
            Frame::Reduce {
                current: *self.data,
                accumulator: *self.acc,
            }
        } else {
            Frame::Data(*self.data)
        }
    }
}

/// Where a `val` level lands: a frame, or an iterator's metadata
/// (`{"index": i}`), which counts as its own level as in the compat-tables
/// (`[[1], "index"]` is the index, `[[2], …]` the data around the iterator).
#[derive(Clone, Copy)]
enum Cursor<'a> {
    Frame(Frame<'a>),
    Meta(usize),
}

impl<'a> Scope<'_, 'a> {
    /// Climbs `level` levels: each scope is one level, plus one for an
    /// iterator's metadata. Climbing past the root stays at the root.
    fn at_level(&self, level: u32) -> Cursor<'a> {
        let mut scope = self;
        let mut n = level;
        loop {
            if n == 0 {
                return Cursor::Frame(scope.frame());
            }
            n -= 1;
            if let Some(i) = scope.index {
                if n == 0 {
                    return Cursor::Meta(i);
                }
                n -= 1;
            }
            match scope.parent {
                Some(p) => scope = p,
                None => return Cursor::Frame(scope.frame()),
            }
        }
    }
}

/// `path::get_segments`, inlined here. Walks by reference and copies the
/// found value once: carrying `current` as a value kept it in a stack slot
/// rewritten at every step (as a 16-byte and an 8-byte store), and the
/// final copy out of that slot read across both stores, which defeats store
/// forwarding.
#[inline(always)]
pub(super) fn get_path<'a>(current: Value<'a>, segments: &[Segment]) -> Option<Value<'a>> {
    let Some((first, rest)) = segments.split_first() else {
        return Some(current);
    };
    let mut at = step_ref(current, first)?;
    for seg in rest {
        at = step_ref(*at, seg)?;
    }
    Some(*at)
}

/// One path step, by reference into the container.
#[inline(always)]
fn step_ref<'a>(v: Value<'a>, seg: &Segment) -> Option<&'a Value<'a>> {
    match v {
        Value::Object(members) => seg.member(members),
        Value::Array(items) => items.get(seg.index?),
        _ => None,
    }
}

/// An object member by key. A plain loop: `Iterator::find` stayed an
/// out-of-line call per lookup (≈ 45 instructions for a one-member object).
#[inline(always)]
fn member<'a>(members: &'a [(&'a str, Value<'a>)], key: &str) -> Option<&'a Value<'a>> {
    for (k, v) in members {
        if key_eq(k, key) {
            return Some(v);
        }
    }
    None
}

/// [`get_path`] by reference: the value a path names inside `current`.
#[inline(always)]
fn path_ref<'s, 'a: 's>(current: &'s Value<'a>, segments: &[Segment]) -> Option<&'s Value<'a>> {
    let mut at = current;
    for seg in segments {
        at = step_ref(*at, seg)?;
    }
    Some(at)
}

/// `missing`'s test on a looked-up value: absent, `null` or `""`.
#[inline(always)]
fn is_missing_ref(v: Option<&Value<'_>>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Str(s)) => s.is_empty(),
        Some(_) => false,
    }
}

/// A number's value as `f64` (anything else reads as 0; callers check).
#[inline(always)]
fn num_of(v: &Value<'_>) -> f64 {
    match *v {
        Value::Int(i) => i as f64,
        Value::Float(f) => f,
        _ => 0.0,
    }
}

/// Which `reduce` member a path starts with (see `Node::Var::slot`).
#[inline]
pub(super) fn slot_of(first_key: &str) -> Slot {
    match first_key {
        "current" => Slot::Current,
        "accumulator" => Slot::Accumulator,
        _ => Slot::Other,
    }
}

/// One step into an object (by key) or array (by index).
#[inline]
fn step<'a>(v: Value<'a>, key: &str, index: Option<usize>) -> Option<Value<'a>> {
    match v {
        Value::Object(members) => member(members, key).copied(),
        Value::Array(items) => items.get(index?).copied(),
        _ => None,
    }
}

#[inline]
fn first_step<'a>(c: Cursor<'a>, key: &str, index: Option<usize>) -> Option<Value<'a>> {
    match c {
        Cursor::Frame(Frame::Data(v)) => step(v, key, index),
        Cursor::Frame(Frame::Reduce {
            current,
            accumulator,
        }) => match key {
            "current" => Some(current),
            "accumulator" => Some(accumulator),
            _ => None,
        },
        Cursor::Meta(i) => (key == "index").then_some(Value::Int(i as i64)),
    }
}

/// Walks a dotted path that was only known at evaluation time (pieces as
/// `Segment::parse` reads them, without allocating).
fn walk_dotted<'a>(ev: &Ev<'a, '_>, c: Cursor<'a>, path: &str) -> Option<Value<'a>> {
    if path.is_empty() {
        return Some(ev.whole(c));
    }
    // Escapes (`hello\.world`) and paths of dots alone are split as
    // `Path::parse` splits a constant path (rare: parsed here).
    if crate::path::needs_escape_split(path) {
        let parsed = crate::path::Path::parse(path);
        let (first, rest) = parsed.segments().split_first()?;
        let v = match c {
            Cursor::Frame(Frame::Data(v)) => step(v, &first.key, first.index)?,
            other => first_step(other, &first.key, first.index)?,
        };
        return crate::path::get_segments(v, rest);
    }
    // A piece is a plain key when it starts with `#`; only an array step
    // needs its index, so it is parsed only then. The walk goes by
    // reference and copies the found value once. Pieces are cut by a plain
    // byte scan (`str::split` is an out-of-line searcher per piece).
    let (first, mut rest) = split_piece(path);
    let (k, plain) = plain_key(first);
    let mut at = match c {
        Cursor::Frame(Frame::Data(v)) => piece_ref(v, k, plain)?,
        other => {
            let index = if plain { None } else { index_of(k) };
            let mut v = first_step(other, k, index)?;
            while let Some(r) = rest {
                let (piece, next) = split_piece(r);
                let (k, plain) = plain_key(piece);
                v = *piece_ref(v, k, plain)?;
                rest = next;
            }
            return Some(v);
        }
    };
    while let Some(r) = rest {
        let (piece, next) = split_piece(r);
        let (k, plain) = plain_key(piece);
        at = piece_ref(*at, k, plain)?;
        rest = next;
    }
    Some(*at)
}

/// The first piece of a dotted path and what follows its dot (`None` after
/// the last piece): the pieces `str::split('.')` would give.
#[inline(always)]
fn split_piece(path: &str) -> (&str, Option<&str>) {
    match path.bytes().position(|b| b == b'.') {
        Some(i) => (&path[..i], Some(&path[i + 1..])),
        None => (path, None),
    }
}

/// A piece's key, and whether a leading `#` made it a plain key.
#[inline(always)]
fn plain_key(piece: &str) -> (&str, bool) {
    match piece.strip_prefix('#') {
        Some(rest) => (rest, true),
        None => (piece, false),
    }
}

/// One step of [`walk_dotted`], by reference into the container.
#[inline(always)]
fn piece_ref<'a>(v: Value<'a>, key: &str, plain: bool) -> Option<&'a Value<'a>> {
    match v {
        Value::Object(members) => member(members, key),
        Value::Array(items) if !plain => items.get(index_of(key)?),
        _ => None,
    }
}

static NAN_ERROR: [(&str, Value<'static>); 1] = [("type", Value::Str("NaN"))];
static INVALID_ERROR: [(&str, Value<'static>); 1] = [("type", Value::Str("Invalid Arguments"))];

/// An operator's arguments: unevaluated nodes, or the already-evaluated items
/// of a spread (`{"max": {"var": "xs"}}`).
#[derive(Clone, Copy)]
enum Args<'a> {
    Nodes(&'a [NodeId]),
    Values(&'a [Value<'a>]),
}

impl Args<'_> {
    #[inline]
    fn len(&self) -> usize {
        match self {
            Args::Nodes(n) => n.len(),
            Args::Values(v) => v.len(),
        }
    }
}

impl Operand {
    /// The operand's value for one element (`acc`: `reduce`'s accumulator).
    #[inline(always)]
    fn read<'a>(&'a self, item: Value<'a>, acc: Value<'a>) -> Value<'a> {
        let (base, path) = match self {
            Operand::Item(path) => (item, path),
            Operand::Acc(path) => (acc, path),
            Operand::Const(c) => return c.value(),
        };
        if path.is_empty() {
            return base;
        }
        get_path(base, path).unwrap_or(Value::Null)
    }
}

struct Ev<'a, 'e> {
    prog: &'a Program,
    arena: &'a Bump,
    /// Bytes operators may still allocate (see `MAX_EVAL_ALLOC`).
    budget: Cell<usize>,
    /// The pending error while a `Fail` unwinds.
    error: &'e Cell<Option<EvalError<'a>>>,
    /// Tree sizes of the containers measured so far (by address and
    /// length), so a value shared by many is walked once; made on first use.
    sizes: RefCell<Option<HashMap<(usize, usize), usize>>>,
    /// A charge failed where its `Fail` could not be returned: the
    /// evaluation fails when it ends.
    poisoned: Cell<bool>,
}

impl<'a> Ev<'a, '_> {
    #[cold]
    #[inline(never)]
    fn fail(&self, e: EvalError<'a>) -> Fail {
        self.error.set(Some(e));
        Fail
    }

    fn take_error(&self) -> EvalError<'a> {
        take_error(self.error)
    }

    #[inline]
    fn number(&self, f: f64) -> R<'a> {
        if f.is_finite() {
            Ok(Value::Float(f))
        } else {
            Err(self.fail(EvalError::NaN))
        }
    }

    /// What operators may still allocate: the rule's budget, and no more
    /// than the arena has left (see `MAX_ARENA_BYTES`). Read only by
    /// operators that allocate, so rules that do not pay nothing for it.
    #[inline]
    fn room(&self) -> usize {
        let arena_left = MAX_ARENA_BYTES.saturating_sub(self.arena.allocated_bytes());
        self.budget.get().min(arena_left)
    }

    fn charge(&self, bytes: usize) -> Result<(), Fail> {
        let room = self.room();
        // Nothing left is a failure even for an empty result: the arena is
        // past its limit.
        if bytes > room || room == 0 {
            return Err(self.fail(EvalError::InvalidArguments(BUDGET_EXCEEDED)));
        }
        self.budget.set(self.budget.get() - bytes);
        Ok(())
    }

    /// The whole value at a cursor (materializes reduce pairs and
    /// metadata). A reduce pair holds the current item and the
    /// accumulator, existing values, and is charged as an array of them
    /// is (see [`Self::charge_held`]); a charge that fails poisons the
    /// evaluation, which then fails.
    fn whole(&self, c: Cursor<'a>) -> Value<'a> {
        match c {
            Cursor::Frame(Frame::Data(v)) => v,
            Cursor::Frame(Frame::Reduce {
                current,
                accumulator,
            }) => {
                if self.charge(2 * size_of::<(&str, Value)>()).is_err()
                    || self.charge_held(&[current, accumulator]).is_err()
                {
                    self.poisoned.set(true);
                    return Value::Null;
                }
                Value::Object(
                    self.arena
                        .alloc_slice_copy(&[("current", current), ("accumulator", accumulator)]),
                )
            }
            Cursor::Meta(i) => Value::Object(
                self.arena
                    .alloc_slice_copy(&[("index", Value::Int(i as i64))]),
            ),
        }
    }

    /// The size of `v` counted as a tree (see [`Value::tree_size_within`]),
    /// when at most `max`. A container measured once in this evaluation is
    /// not walked again, so values shared by many (a catalog placed in
    /// every element of a `map`) cost their walk once.
    fn tree_size(&self, v: &Value<'a>, max: usize) -> Option<usize> {
        let key = match *v {
            Value::Array(items) => (items.as_ptr() as usize, items.len()),
            Value::Object(members) => (members.as_ptr() as usize, members.len()),
            Value::Str(s) => {
                return (size_of::<Value>() + s.len() <= max).then(|| size_of::<Value>() + s.len());
            }
            _ => return (size_of::<Value>() <= max).then_some(size_of::<Value>()),
        };
        if let Some(n) = self.sizes.borrow().as_ref().and_then(|m| m.get(&key)) {
            return (*n <= max).then_some(*n);
        }
        let mut total = size_of::<Value>();
        match *v {
            Value::Array(items) => {
                for item in items {
                    total += self.tree_size(item, max.checked_sub(total)?)?;
                }
            }
            Value::Object(members) => {
                for (k, item) in members {
                    total += k.len();
                    total += self.tree_size(item, max.checked_sub(total)?)?;
                }
            }
            _ => {}
        }
        if total > max {
            return None;
        }
        self.sizes
            .borrow_mut()
            .get_or_insert_with(HashMap::new)
            .insert(key, total);
        Some(total)
    }

    /// Charges what the parts of a new container hold beyond their slots,
    /// counted as trees (see [`Value::tree_size_within`]): every part but
    /// the largest (a part is an element; for `merge` an argument, whose
    /// elements it takes). Elements are shared, not copied, so without
    /// this `[x, x]` cost two slots while writing out `x` twice, and a
    /// rule (or a `reduce`) doing so at every step built in kilobytes a
    /// value that takes years to write out. The largest part goes free:
    /// what it holds was paid for when it was built (by the arena or an
    /// earlier charge), so whatever a rule builds stays within those, and
    /// wrapping or appending to a value (`[acc]`, `merge` of the
    /// accumulator and one item) costs only what is added. Scalars and
    /// strings alone take no walk.
    fn charge_held(&self, parts: &[Value<'a>]) -> Result<(), Fail> {
        let big = parts
            .iter()
            .filter(|v| matches!(v, Value::Array(_) | Value::Object(_) | Value::Str(_)))
            .count();
        if big < 2 {
            return Ok(());
        }
        let room = self.room();
        let (mut sum, mut largest, mut beyond) = (0usize, 0usize, 0usize);
        for v in parts {
            if !matches!(v, Value::Array(_) | Value::Object(_) | Value::Str(_)) {
                continue;
            }
            match self.tree_size(v, room) {
                Some(n) => {
                    sum += n;
                    largest = largest.max(n);
                }
                None => beyond += 1,
            }
        }
        match beyond {
            0 => self.charge(sum - largest),
            // The one beyond the room is the largest.
            1 => self.charge(sum),
            _ => Err(self.fail(EvalError::InvalidArguments(BUDGET_EXCEEDED))),
        }
    }

    /// The dispatcher. Thin on purpose: every arm with work of its own
    /// calls out, so this frame saves no registers and the calls become
    /// jumps (a node costs its own work, not a second prologue).
    fn eval(&self, id: NodeId, scope: &Scope<'_, 'a>) -> R<'a> {
        let prog: &'a Program = self.prog;
        let node = &prog.nodes[id as usize];
        match node {
            Node::Var { .. } => self.var_node(node, scope),
            Node::Op { .. } => self.op_node(node, scope),
            Node::Null => Ok(Value::Null),
            Node::Bool(b) => Ok(Value::Bool(*b)),
            Node::Int(i) => Ok(Value::Int(*i)),
            Node::Float(f) => Ok(Value::Float(*f)),
            Node::Str(s) => Ok(Value::Str(s)),
            Node::Json(i) => Ok(prog.consts[*i as usize].value()),
            Node::Spread { .. } => self.spread_node(node, scope),
            Node::Exists { path } => self.exists_node(path, scope),
            Node::Missing { .. } => self.missing_node(node, scope),
            Node::Iter(it) => match &it.shape {
                Body::Pred { .. } => self.quantify(it, scope),
                _ => self.iterate(it, scope),
            },
            Node::InStrs { .. } => self.in_strs(node, scope),
        }
    }

    #[inline(never)]
    fn var_node(&self, node: &'a Node, scope: &Scope<'_, 'a>) -> R<'a> {
        let Node::Var {
            level,
            path,
            default,
            slot,
        } = node
        else {
            return Ok(Value::Null);
        };
        let found = if *level == 0 {
            self.lookup_slot(scope, *slot, path)
        } else {
            self.lookup(scope.at_level(*level), path)
        };
        match found {
            Some(v) => Ok(v),
            None => match default {
                Some(d) => self.eval(*d, scope),
                None => Ok(Value::Null),
            },
        }
    }

    #[inline(never)]
    fn op_node(&self, node: &'a Node, scope: &Scope<'_, 'a>) -> R<'a> {
        let Node::Op { op, start, len } = *node else {
            return Ok(Value::Null);
        };
        let prog: &'a Program = self.prog;
        let args = &prog.args[start as usize..(start + len) as usize];
        if let [a, b] = *args
            && matches!(
                op,
                Op::Add
                    | Op::Sub
                    | Op::Mul
                    | Op::Div
                    | Op::Mod
                    | Op::Lt
                    | Op::Le
                    | Op::Gt
                    | Op::Ge
                    | Op::Eq
                    | Op::Ne
                    | Op::StrictEq
                    | Op::StrictNe
            )
        {
            return self.binary(op, a, b, args, scope);
        }
        if op == Op::Array {
            return self.array(args, scope);
        }
        self.op(op, Args::Nodes(args), scope)
    }

    #[inline(never)]
    fn spread_node(&self, node: &'a Node, scope: &Scope<'_, 'a>) -> R<'a> {
        let Node::Spread { op, arg } = *node else {
            return Ok(Value::Null);
        };
        let prog: &'a Program = self.prog;
        // `{"missing": {"merge": [...]}}` checks the merged keys without
        // building the merged array.
        if op == Op::Missing
            && let Node::Op {
                op: Op::Merge,
                start,
                len,
            } = prog.nodes[arg as usize]
            && let Some(r) =
                self.missing_merge(&prog.args[start as usize..(start + len) as usize], scope)
        {
            return r;
        }
        let values = match self.eval(arg, scope)? {
            Value::Array(items) => items,
            other => std::slice::from_ref(self.arena.alloc(other)),
        };
        self.op(op, Args::Values(values), scope)
    }

    #[inline(never)]
    fn exists_node(&self, path: &'a [Segment], scope: &Scope<'_, 'a>) -> R<'a> {
        Ok(Value::Bool(self.lookup_scope(scope, path).is_some()))
    }

    #[inline(never)]
    fn missing_node(&self, node: &'a Node, scope: &Scope<'_, 'a>) -> R<'a> {
        let Node::Missing { keys, need } = node else {
            return Ok(Value::Null);
        };
        self.missing_const(keys, *need, scope)
    }

    #[inline(never)]
    fn in_strs(&self, node: &'a Node, scope: &Scope<'_, 'a>) -> R<'a> {
        let Node::InStrs { needle, set } = node else {
            return Ok(Value::Null);
        };
        let found = match self.eval(*needle, scope)? {
            Value::Str(s) if set.len() <= 8 => set.iter().any(|k| **k == *s),
            Value::Str(s) => set.binary_search_by(|k| (**k).cmp(s)).is_ok(),
            _ => false,
        };
        Ok(Value::Bool(found))
    }

    /// The current frame, read in place (`exists`, `missing`).
    #[inline]
    fn lookup_scope(&self, scope: &Scope<'_, 'a>, path: &[Segment]) -> Option<Value<'a>> {
        if !scope.reduce {
            return get_path(*scope.data, path);
        }
        let slot = match path.first() {
            Some(first) => slot_of(&first.key),
            None => Slot::Whole,
        };
        self.lookup_slot(scope, slot, path)
    }

    /// The hot `var` path: the current frame, read in place, with the
    /// `reduce` member the path starts with resolved at compile time.
    #[inline(always)]
    fn lookup_slot(
        &self,
        scope: &Scope<'_, 'a>,
        slot: Slot,
        path: &[Segment],
    ) -> Option<Value<'a>> {
        if !scope.reduce {
            return get_path(*scope.data, path);
        }
        match slot {
            Slot::Current => get_path(*scope.data, &path[1..]),
            Slot::Accumulator => get_path(*scope.acc, &path[1..]),
            Slot::Whole => Some(self.whole(Cursor::Frame(scope.frame()))),
            Slot::Other => None,
        }
    }

    #[inline]
    fn lookup(&self, cursor: Cursor<'a>, path: &[Segment]) -> Option<Value<'a>> {
        match path.split_first() {
            None => Some(self.whole(cursor)),
            Some((first, rest)) => get_path(first_step(cursor, &first.key, first.index)?, rest),
        }
    }

    /// Argument `i`, evaluated (`null` past the end, as JavaScript's
    /// `undefined` would be for these operators).
    #[inline]
    fn arg(&self, args: Args<'a>, i: usize, scope: &Scope<'_, 'a>) -> R<'a> {
        match args {
            Args::Nodes(n) => match n.get(i) {
                Some(&id) => self.eval(id, scope),
                None => Ok(Value::Null),
            },
            Args::Values(v) => Ok(v.get(i).copied().unwrap_or(Value::Null)),
        }
    }

    #[inline]
    fn num_arg(&self, args: Args<'a>, i: usize, scope: &Scope<'_, 'a>) -> Result<f64, Fail> {
        to_number(&self.arg(args, i, scope)?).ok_or_else(|| self.fail(EvalError::NaN))
    }

    fn op(&self, op: Op, args: Args<'a>, scope: &Scope<'_, 'a>) -> R<'a> {
        let n = args.len();
        match op {
            Op::If => {
                let mut i = 0;
                while i + 1 < n {
                    if truthy(&self.arg(args, i, scope)?) {
                        return self.arg(args, i + 1, scope);
                    }
                    i += 2;
                }
                self.arg(args, i, scope)
            }
            Op::And | Op::Or => {
                let want = op == Op::Or;
                let mut last = Value::Bool(false);
                for i in 0..n {
                    last = self.arg(args, i, scope)?;
                    if truthy(&last) == want {
                        break;
                    }
                }
                Ok(last)
            }
            Op::Not => Ok(Value::Bool(!truthy(&self.arg(args, 0, scope)?))),
            Op::NotNot => Ok(Value::Bool(truthy(&self.arg(args, 0, scope)?))),
            Op::Coalesce => {
                for i in 0..n {
                    let v = self.arg(args, i, scope)?;
                    if !v.is_null() {
                        return Ok(v);
                    }
                }
                Ok(Value::Null)
            }
            Op::Try => self.try_(args, scope),
            Op::Throw => {
                let thrown = self.arg(args, 0, scope)?;
                Err(self.fail(EvalError::Thrown(thrown)))
            }
            Op::Eq | Op::Ne | Op::StrictEq | Op::StrictNe | Op::Lt | Op::Le | Op::Gt | Op::Ge => {
                self.compare(op, args, scope)
            }
            Op::Add => {
                if let Args::Nodes(&[a, b]) = args {
                    let x = to_number(&self.eval(a, scope)?)
                        .ok_or_else(|| self.fail(EvalError::NaN))?;
                    let y = to_number(&self.eval(b, scope)?)
                        .ok_or_else(|| self.fail(EvalError::NaN))?;
                    return self.number(x + y);
                }
                let mut sum = 0.0;
                for i in 0..n {
                    sum += self.num_arg(args, i, scope)?;
                }
                self.number(sum)
            }
            Op::Mul => {
                if let Args::Nodes(&[a, b]) = args {
                    let x = to_number(&self.eval(a, scope)?)
                        .ok_or_else(|| self.fail(EvalError::NaN))?;
                    let y = to_number(&self.eval(b, scope)?)
                        .ok_or_else(|| self.fail(EvalError::NaN))?;
                    return self.number(x * y);
                }
                let mut product = 1.0;
                for i in 0..n {
                    product *= self.num_arg(args, i, scope)?;
                }
                self.number(product)
            }
            Op::Sub => {
                if n == 0 {
                    return Err(self.fail(EvalError::InvalidArguments(
                        "'-' needs at least one argument",
                    )));
                }
                let first = self.num_arg(args, 0, scope)?;
                if n == 1 {
                    return self.number(-first);
                }
                let mut acc = first;
                for i in 1..n {
                    acc -= self.num_arg(args, i, scope)?;
                }
                self.number(acc)
            }
            Op::Div => {
                if n == 0 {
                    return Err(self.fail(EvalError::InvalidArguments(
                        "'/' needs at least one argument",
                    )));
                }
                let first = self.num_arg(args, 0, scope)?;
                if n == 1 {
                    return self.number(1.0 / first);
                }
                let mut acc = first;
                for i in 1..n {
                    acc /= self.num_arg(args, i, scope)?;
                }
                self.number(acc)
            }
            Op::Mod => {
                if n < 2 {
                    return Err(self.fail(EvalError::InvalidArguments(
                        "'%' needs at least two arguments",
                    )));
                }
                let mut acc = self.num_arg(args, 0, scope)?;
                for i in 1..n {
                    acc %= self.num_arg(args, i, scope)?;
                }
                self.number(acc)
            }
            Op::Max | Op::Min => {
                let mut best: Option<(f64, Value<'a>)> = None;
                for i in 0..n {
                    let v = self.arg(args, i, scope)?;
                    let f = to_number(&v).ok_or_else(|| self.fail(EvalError::NaN))?;
                    let better = match best {
                        None => true,
                        Some((b, _)) => (op == Op::Max && f > b) || (op == Op::Min && f < b),
                    };
                    if better {
                        let v = if matches!(v, Value::Int(_) | Value::Float(_)) {
                            v
                        } else {
                            Value::Float(f)
                        };
                        best = Some((f, v));
                    }
                }
                Ok(best.map_or(Value::Null, |(_, v)| v))
            }
            // Iterators compile to `Node::Iter`; they never get here.
            Op::Map | Op::Filter | Op::Reduce | Op::All | Op::Some | Op::None => Err(self.fail(
                EvalError::InvalidArguments("iterators need [collection, rule]"),
            )),
            Op::Merge => {
                // One array argument is its own result: no copy.
                if let Args::Nodes(&[one]) = args {
                    return match self.eval(one, scope)? {
                        v @ Value::Array(_) => Ok(v),
                        other => Ok(Value::Array(std::slice::from_ref(self.arena.alloc(other)))),
                    };
                }
                let mut out = BVec::new_in(self.arena);
                let mut parts: smallvec::SmallVec<[Value<'a>; 4]> = smallvec::SmallVec::new();
                for i in 0..n {
                    let part = self.arg(args, i, scope)?;
                    match part {
                        Value::Array(items) => out.extend_from_slice(items),
                        other => out.push(other),
                    }
                    parts.push(part);
                }
                self.charge(out.len() * size_of::<Value>())?;
                self.charge_held(&parts)?;
                Ok(Value::Array(out.into_bump_slice()))
            }
            Op::In => {
                let needle = self.arg(args, 0, scope)?;
                Ok(Value::Bool(match self.arg(args, 1, scope)? {
                    Value::Str(hay) => match needle {
                        Value::Str(s) => hay.contains(s),
                        other => hay.contains(key_text(other, self.arena)),
                    },
                    Value::Array(items) => items.iter().any(|item| strict_eq(&needle, item)),
                    _ => false,
                }))
            }
            Op::Cat => {
                // The arguments first, then the text written once into room
                // for all of it: grown in the arena, the text would leave each
                // smaller copy behind (a doubling `cat` chain kept about three
                // times its result).
                let mut values: smallvec::SmallVec<[Value<'a>; 8]> = smallvec::SmallVec::new();
                let mut room = 0usize;
                for i in 0..n {
                    let v = self.arg(args, i, scope)?;
                    // One string argument is its own result: no copy.
                    if n == 1 && matches!(v, Value::Str(_)) {
                        return Ok(v);
                    }
                    room = room.saturating_add(match v {
                        Value::Str(s) => s.len(),
                        _ => 24,
                    });
                    values.push(v);
                }
                let limit = self.room();
                if room > limit {
                    return Err(self.fail(EvalError::InvalidArguments(BUDGET_EXCEEDED)));
                }
                let mut out = BString::with_capacity_in(room, self.arena);
                for v in &values {
                    let _ = write_js_string(v, "", &mut out);
                    if out.len() > limit {
                        return Err(self.fail(EvalError::InvalidArguments(BUDGET_EXCEEDED)));
                    }
                }
                self.charge(out.len())?;
                Ok(Value::Str(out.into_bump_str()))
            }
            Op::Substr => {
                let s = key_text(self.arg(args, 0, scope)?, self.arena);
                // Coerced as JavaScript's `substr` does: NaN starts at 0
                // and takes nothing.
                let start = js_number(&self.arg(args, 1, scope)?);
                let len = if n > 2 {
                    match self.arg(args, 2, scope)? {
                        Value::Null => None,
                        v => Some(js_number(&v)),
                    }
                } else {
                    None
                };
                let (from, to) = substr_range(s, start, len);
                Ok(Value::Str(s.get(from..to).unwrap_or_default()))
            }
            Op::Length => match self.arg(args, 0, scope)? {
                Value::Str(s) => Ok(Value::Int(s.chars().count() as i64)),
                Value::Array(items) => Ok(Value::Int(items.len() as i64)),
                _ => Err(self.fail(EvalError::InvalidArguments(
                    "'length' needs a string or an array",
                ))),
            },
            Op::Log => self.arg(args, 0, scope),
            Op::Array => {
                self.charge(n * size_of::<Value>())?;
                let out = self.arena.alloc_slice_fill_copy(n, Value::Null);
                match args {
                    // Constants and plain reads are stored without a call: a
                    // value returned through memory and copied on as a block
                    // would straddle the callee's stores.
                    Args::Nodes(ids) => {
                        for (slot, &id) in out.iter_mut().zip(ids) {
                            *slot = self.operand(id, scope)?;
                        }
                    }
                    Args::Values(values) => out.copy_from_slice(values),
                }
                self.charge_held(out)?;
                Ok(Value::Array(out))
            }
            Op::Var => self.var_dynamic(args, scope),
            Op::Val | Op::Exists => self.val_dynamic(op, args, scope),
            Op::Missing | Op::MissingSome => self.missing_dynamic(op, args, scope),
        }
    }

    /// A rule array (`[1, {"var": "x"}, 3]`), kept out of [`Self::op`],
    /// whose prologue costs more than filling a short array. Constants and
    /// plain reads are stored without a call: a value returned through
    /// memory and copied on as a block would straddle the callee's stores.
    #[inline(never)]
    fn array(&self, ids: &'a [NodeId], scope: &Scope<'_, 'a>) -> R<'a> {
        self.charge(ids.len() * size_of::<Value>())?;
        let out = self.arena.alloc_slice_fill_copy(ids.len(), Value::Null);
        for (slot, &id) in out.iter_mut().zip(ids) {
            *slot = self.operand(id, scope)?;
        }
        self.charge_held(out)?;
        Ok(Value::Array(out))
    }

    /// Two-argument operators, the common case, without the generic
    /// argument plumbing.
    #[inline]
    fn binary(
        &self,
        op: Op,
        a: NodeId,
        b: NodeId,
        args: &'a [NodeId],
        scope: &Scope<'_, 'a>,
    ) -> R<'a> {
        let rel = match op {
            Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Mod => {
                let x = self.num_operand(a, scope)?;
                let y = self.num_operand(b, scope)?;
                return self.number(match op {
                    Op::Add => x + y,
                    Op::Sub => x - y,
                    Op::Mul => x * y,
                    Op::Div => x / y,
                    _ => x % y,
                });
            }
            Op::Lt => Rel::Lt,
            Op::Le => Rel::Le,
            Op::Gt => Rel::Gt,
            Op::Ge => Rel::Ge,
            Op::StrictEq | Op::StrictNe => {
                let (x, y) = (self.operand(a, scope)?, self.operand(b, scope)?);
                return Ok(Value::Bool(strict_eq(&x, &y) == (op == Op::StrictEq)));
            }
            Op::Eq | Op::Ne => {
                let (x, y) = (self.operand(a, scope)?, self.operand(b, scope)?);
                let eq = match (x, y) {
                    (Value::Str(p), Value::Str(q)) => key_eq(p, q),
                    (Value::Int(p), Value::Int(q)) => p == q,
                    _ => loose_eq_checked(&x, &y).map_err(|()| self.fail(EvalError::NaN))?,
                };
                return Ok(Value::Bool(eq == (op == Op::Eq)));
            }
            _ => return self.op(op, Args::Nodes(args), scope),
        };
        let (x, y) = (self.operand(a, scope)?, self.operand(b, scope)?);
        let holds = match (x, y) {
            (Value::Int(p), Value::Int(q)) => match rel {
                Rel::Lt => p < q,
                Rel::Le => p <= q,
                Rel::Gt => p > q,
                Rel::Ge => p >= q,
            },
            _ => relate(&x, &y, rel).map_err(|()| self.fail(EvalError::NaN))?,
        };
        Ok(Value::Bool(holds))
    }

    /// An operand of a hot operator: `var` reads and scalar constants are
    /// handled here, without a call into the interpreter.
    #[inline(always)]
    fn operand(&self, id: NodeId, scope: &Scope<'_, 'a>) -> R<'a> {
        match &self.prog.nodes[id as usize] {
            Node::Var {
                level: 0,
                path,
                default: None,
                slot,
            } => Ok(self.lookup_slot(scope, *slot, path).unwrap_or(Value::Null)),
            Node::Int(i) => Ok(Value::Int(*i)),
            Node::Float(f) => Ok(Value::Float(*f)),
            Node::Str(s) => Ok(Value::Str(s)),
            _ => self.eval(id, scope),
        }
    }

    /// [`Self::operand`] coerced to a number (NaN error when it is not one).
    #[inline(always)]
    fn num_operand(&self, id: NodeId, scope: &Scope<'_, 'a>) -> Result<f64, Fail> {
        let v = match &self.prog.nodes[id as usize] {
            Node::Int(i) => return Ok(*i as f64),
            Node::Float(f) => return Ok(*f),
            Node::Var {
                level: 0,
                path,
                default: None,
                slot,
            } => self.lookup_slot(scope, *slot, path).unwrap_or(Value::Null),
            _ => self.eval(id, scope)?,
        };
        match v {
            Value::Int(i) => Ok(i as f64),
            Value::Float(f) => Ok(f),
            other => to_number(&other).ok_or_else(|| self.fail(EvalError::NaN)),
        }
    }

    fn compare(&self, op: Op, args: Args<'a>, scope: &Scope<'_, 'a>) -> R<'a> {
        let n = args.len();
        if n < 2 {
            return Err(self.fail(EvalError::InvalidArguments(
                "comparisons need at least two arguments",
            )));
        }
        // Chains compare neighbours and stop at the first false, without
        // evaluating the rest (`{"<": [3, 2, {"throw": …}]}` is false).
        let mut prev = self.arg(args, 0, scope)?;
        for i in 1..n {
            let cur = self.arg(args, i, scope)?;
            let holds = match op {
                Op::Eq => loose_eq_checked(&prev, &cur).map_err(|()| self.fail(EvalError::NaN))?,
                Op::Ne => !loose_eq_checked(&prev, &cur).map_err(|()| self.fail(EvalError::NaN))?,
                Op::StrictEq => strict_eq(&prev, &cur),
                Op::StrictNe => !strict_eq(&prev, &cur),
                Op::Lt => relate(&prev, &cur, Rel::Lt).map_err(|()| self.fail(EvalError::NaN))?,
                Op::Le => relate(&prev, &cur, Rel::Le).map_err(|()| self.fail(EvalError::NaN))?,
                Op::Gt => relate(&prev, &cur, Rel::Gt).map_err(|()| self.fail(EvalError::NaN))?,
                _ => relate(&prev, &cur, Rel::Ge).map_err(|()| self.fail(EvalError::NaN))?,
            };
            if !holds {
                return Ok(Value::Bool(false));
            }
            prev = cur;
        }
        Ok(Value::Bool(true))
    }

    /// `try`: the first argument that evaluates without error wins; each
    /// later argument sees the previous error as its data (`{"type": …}`);
    /// the last error propagates.
    #[inline(never)]
    fn try_(&self, args: Args<'a>, scope: &Scope<'_, 'a>) -> R<'a> {
        let n = args.len();
        let mut error: Option<EvalError<'a>> = None;
        for i in 0..n {
            let (handler, handler_data);
            let s = match &error {
                None => scope,
                Some(e) => {
                    handler_data = self.error_value(e);
                    handler = Scope::child(&handler_data, None, scope);
                    &handler
                }
            };
            match self.arg(args, i, s) {
                Ok(v) => return Ok(v),
                Err(Fail) => error = Some(self.take_error()),
            }
        }
        match error {
            Some(e) => Err(self.fail(e)),
            None => Ok(Value::Null),
        }
    }

    #[inline(never)]
    fn error_value(&self, e: &EvalError<'a>) -> Value<'a> {
        match *e {
            EvalError::NaN => Value::Object(&NAN_ERROR),
            EvalError::InvalidArguments(_) => Value::Object(&INVALID_ERROR),
            EvalError::Thrown(Value::Str(s)) => {
                Value::Object(self.arena.alloc_slice_copy(&[("type", Value::Str(s))]))
            }
            EvalError::Thrown(v) => v,
        }
    }

    /// An iterator. Bodies classified as [`Body::One`] / [`Body::Two`] run
    /// per element as direct reads plus one operator, with no scope; the
    /// others get a scope per element.
    #[inline(never)]
    fn iterate(&self, it: &'a Iter, scope: &Scope<'_, 'a>) -> R<'a> {
        let op = it.op;
        let items = match self.operand(it.coll, scope)? {
            Value::Array(items) => items,
            // map/filter/reduce treat anything else (a missing value) as
            // empty; the quantifiers refuse it (compat-tables).
            _ if matches!(op, Op::All | Op::Some | Op::None) => {
                return Err(self.fail(EvalError::InvalidArguments("all/some/none need an array")));
            }
            _ => &[],
        };
        let reduce = op == Op::Reduce;
        let init = match it.init {
            Some(init) => self.eval(init, scope)?,
            None => Value::Null,
        };
        match &it.shape {
            Body::One(a) => self.drive(
                op,
                items,
                init,
                #[inline(always)]
                |_, item, acc| Ok(a.read(*item, *acc)),
                #[inline(always)]
                |_, item| Ok(truthy(&a.read(*item, Value::Null))),
            ),
            Body::Two(body_op, a, b) => {
                let body_op = *body_op;
                self.drive(
                    op,
                    items,
                    init,
                    #[inline(always)]
                    |_, item, acc| self.apply(body_op, a.read(*item, *acc), b.read(*item, *acc)),
                    #[inline(always)]
                    |_, item| {
                        self.holds(
                            body_op,
                            a.read(*item, Value::Null),
                            b.read(*item, Value::Null),
                        )
                    },
                )
            }
            Body::Arith(steps) => self.drive(
                op,
                items,
                init,
                #[inline(always)]
                |_, item, acc| Ok(Value::Float(self.run_arith(steps, *item, *acc)?)),
                #[inline(always)]
                |_, item| {
                    Ok(truthy(&Value::Float(self.run_arith(
                        steps,
                        *item,
                        Value::Null,
                    )?)))
                },
            ),
            Body::Call { op: body_op, start } => {
                let prog: &'a Program = self.prog;
                let args = &prog.args[*start as usize..*start as usize + 2];
                let (x, y) = (args[0], args[1]);
                let body_op = *body_op;
                let call = |i: usize, item: &'a Value<'a>, acc: &Value<'a>| {
                    let s = Scope {
                        data: item,
                        acc,
                        reduce,
                        index: Some(i),
                        parent: Some(scope),
                    };
                    self.binary(body_op, x, y, args, &s)
                };
                self.drive(op, items, init, call, |i, item| {
                    call(i, item, &NULL).map(|v| truthy(&v))
                })
            }
            // `eval` sends these to `quantify` directly; kept correct here.
            Body::Pred { .. } => self.quantify(it, scope),
            Body::General => {
                let body = it.body;
                let call = |i: usize, item: &'a Value<'a>, acc: &Value<'a>| {
                    let s = Scope {
                        data: item,
                        acc,
                        reduce,
                        index: Some(i),
                        parent: Some(scope),
                    };
                    self.eval(body, &s)
                };
                self.drive(op, items, init, call, |i, item| {
                    call(i, item, &NULL).map(|v| truthy(&v))
                })
            }
        }
    }

    /// `filter`, `all`, `some` or `none` over a [`Body::Pred`] test: the
    /// element (or a path into it) compared with a constant. Kept apart from
    /// [`Self::iterate`], whose set-up for its many body shapes costs more
    /// than the whole loop over a short array.
    #[inline(never)]
    fn quantify(&self, it: &'a Iter, scope: &Scope<'_, 'a>) -> R<'a> {
        let Body::Pred {
            op: cmp,
            ref path,
            ref konst,
        } = it.shape
        else {
            return Ok(Value::Null);
        };
        let (op, coll, path, konst): (Op, NodeId, &'a [Segment], &'a Scalar) =
            (it.op, it.coll, path, konst);
        let items = match self.operand(coll, scope)? {
            Value::Array(items) => items,
            _ if op == Op::Filter => &[],
            _ => {
                return Err(self.fail(EvalError::InvalidArguments("all/some/none need an array")));
            }
        };
        if items.is_empty() {
            return Ok(empty_result(op));
        }
        let k = konst.value();
        if op == Op::Filter {
            // What is reserved is what the arena loses, kept or not.
            self.charge(size_of_val(items))?;
            let mut out = BVec::with_capacity_in(items.len(), self.arena);
            for item in items {
                if self.pred_holds(cmp, path, &k, item)? {
                    out.push(*item);
                }
            }
            return Ok(Value::Array(out.into_bump_slice()));
        }
        // `all` stops at the first failing element, `some` / `none` at the
        // first passing one.
        let stop = op != Op::All;
        let mut hit = false;
        for item in items {
            if self.pred_holds(cmp, path, &k, item)? == stop {
                hit = true;
                break;
            }
        }
        Ok(Value::Bool(match op {
            Op::All => !hit && !items.is_empty(),
            Op::Some => hit,
            _ => !hit,
        }))
    }

    /// One element's [`Body::Pred`] test. Reads by reference and compares
    /// integers inline; everything else takes [`Self::compare2`] out of line.
    #[inline(always)]
    fn pred_holds(
        &self,
        cmp: Op,
        path: &[Segment],
        k: &Value<'a>,
        item: &'a Value<'a>,
    ) -> Result<bool, Fail> {
        let mut x = item;
        for seg in path {
            x = match step_ref(*x, seg) {
                Some(v) => v,
                None => &NULL,
            };
        }
        match (x, k) {
            (Value::Int(p), Value::Int(q)) => Ok(match cmp {
                Op::Lt => p < q,
                Op::Le => p <= q,
                Op::Gt => p > q,
                Op::Ge => p >= q,
                Op::Eq | Op::StrictEq => p == q,
                _ => p != q,
            }),
            (Value::Int(_) | Value::Float(_), Value::Int(_) | Value::Float(_))
                if matches!(cmp, Op::Lt | Op::Le | Op::Gt | Op::Ge) =>
            {
                let (p, q) = (num_of(x), num_of(k));
                Ok(match cmp {
                    Op::Lt => p < q,
                    Op::Le => p <= q,
                    Op::Gt => p > q,
                    _ => p >= q,
                })
            }
            _ => self.compare_slow(cmp, *x, *k),
        }
    }

    #[inline(never)]
    fn compare_slow(&self, op: Op, x: Value<'a>, y: Value<'a>) -> Result<bool, Fail> {
        self.compare2(op, x, y)
    }

    /// The loops of the six iterators over one body: `value` computes the
    /// body's value (`map`, `reduce`), `test` its truthiness (`filter` and
    /// the quantifiers, which can skip building a value).
    #[inline(always)]
    fn drive<V, T>(
        &self,
        op: Op,
        items: &'a [Value<'a>],
        init: Value<'a>,
        value: V,
        test: T,
    ) -> R<'a>
    where
        V: Fn(usize, &'a Value<'a>, &Value<'a>) -> R<'a>,
        T: Fn(usize, &'a Value<'a>) -> Result<bool, Fail>,
    {
        match op {
            Op::Map => {
                self.charge(size_of_val(items))?;
                let out = self.arena.alloc_slice_fill_copy(items.len(), Value::Null);
                for (i, (slot, item)) in out.iter_mut().zip(items).enumerate() {
                    *slot = value(i, item, &NULL)?;
                }
                self.charge_held(out)?;
                Ok(Value::Array(out))
            }
            Op::Filter => {
                // What is reserved is what the arena loses, kept or not.
                self.charge(size_of_val(items))?;
                let mut out = BVec::with_capacity_in(items.len(), self.arena);
                for (i, item) in items.iter().enumerate() {
                    if test(i, item)? {
                        out.push(*item);
                    }
                }
                Ok(Value::Array(out.into_bump_slice()))
            }
            Op::Reduce => {
                let mut acc = init;
                // The one way a rule nests values deeper than its data and
                // its own nesting: an accumulator wrapped once more per
                // element (`[{"var": "accumulator"}]`). Everything that
                // walks values recursively (stringifying, equality, the
                // writer) must stay within the stack, so a container
                // accumulator keeps a bound on its depth (one step adds at
                // most the rule's nesting to it or to data it reads) and is
                // measured once the bound passes the limit.
                let mut bound = DATA_DEPTH;
                for (i, item) in items.iter().enumerate() {
                    acc = value(i, item, &acc)?;
                    if matches!(acc, Value::Array(_) | Value::Object(_)) {
                        bound += MAX_DEPTH;
                        if bound > MAX_VALUE_DEPTH {
                            match acc.depth_within(MAX_VALUE_DEPTH) {
                                Some(depth) => bound = depth.max(DATA_DEPTH),
                                None => {
                                    return Err(self.fail(EvalError::InvalidArguments(
                                        "reduce: the accumulator would nest deeper than 4096 levels",
                                    )));
                                }
                            }
                        }
                    }
                }
                Ok(acc)
            }
            Op::All => {
                for (i, item) in items.iter().enumerate() {
                    if !test(i, item)? {
                        return Ok(Value::Bool(false));
                    }
                }
                Ok(Value::Bool(!items.is_empty()))
            }
            _ => {
                // some / none
                let mut any = false;
                for (i, item) in items.iter().enumerate() {
                    if test(i, item)? {
                        any = true;
                        break;
                    }
                }
                Ok(Value::Bool(any == (op == Op::Some)))
            }
        }
    }

    #[inline(always)]
    fn num_value(&self, v: Value<'a>) -> Result<f64, Fail> {
        match v {
            Value::Int(i) => Ok(i as f64),
            Value::Float(f) => Ok(f),
            other => to_number(&other).ok_or_else(|| self.fail(EvalError::NaN)),
        }
    }

    /// One element's [`Body::Arith`] program: the value the nested
    /// operators would give, each step coercing its operands like
    /// [`Self::binary`] and failing on a non-finite result.
    fn run_arith(&self, steps: &'a [Step], item: Value<'a>, acc: Value<'a>) -> Result<f64, Fail> {
        let mut stack = [0.0f64; ARITH_STACK];
        let mut n = 0;
        for step in steps {
            match step {
                Step::Load(operand) => {
                    let x = self.num_value(operand.read(item, acc))?;
                    *stack.get_mut(n).ok_or(Fail)? = x;
                    n += 1;
                }
                Step::Apply(op) => {
                    let (Some(&x), Some(&y)) =
                        (stack.get(n.wrapping_sub(2)), stack.get(n.wrapping_sub(1)))
                    else {
                        return Err(Fail);
                    };
                    let r = match op {
                        Op::Add => x + y,
                        Op::Sub => x - y,
                        Op::Mul => x * y,
                        Op::Div => x / y,
                        _ => x % y,
                    };
                    if !r.is_finite() {
                        return Err(self.fail(EvalError::NaN));
                    }
                    n -= 1;
                    stack[n - 1] = r;
                }
            }
        }
        Ok(stack[0])
    }

    /// A two-argument operator of [`Body::Two`] on evaluated operands (the
    /// same semantics as [`Self::binary`]).
    #[inline(always)]
    fn apply(&self, op: Op, x: Value<'a>, y: Value<'a>) -> R<'a> {
        match op {
            Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Mod => self.arith(op, x, y),
            _ => self.compare2(op, x, y).map(Value::Bool),
        }
    }

    /// [`Self::apply`]'s truthiness, without building the value.
    #[inline(always)]
    fn holds(&self, op: Op, x: Value<'a>, y: Value<'a>) -> Result<bool, Fail> {
        match op {
            Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Mod => {
                self.arith(op, x, y).map(|v| truthy(&v))
            }
            _ => self.compare2(op, x, y),
        }
    }

    #[inline(always)]
    fn arith(&self, op: Op, x: Value<'a>, y: Value<'a>) -> R<'a> {
        let (p, q) = (self.num_value(x)?, self.num_value(y)?);
        self.number(match op {
            Op::Add => p + q,
            Op::Sub => p - q,
            Op::Mul => p * q,
            Op::Div => p / q,
            _ => p % q,
        })
    }

    /// A comparison of two evaluated operands.
    #[inline(always)]
    fn compare2(&self, op: Op, x: Value<'a>, y: Value<'a>) -> Result<bool, Fail> {
        let rel = match op {
            Op::StrictEq => return Ok(strict_eq(&x, &y)),
            Op::StrictNe => return Ok(!strict_eq(&x, &y)),
            Op::Eq | Op::Ne => {
                let eq = match (x, y) {
                    (Value::Str(p), Value::Str(q)) => key_eq(p, q),
                    (Value::Int(p), Value::Int(q)) => p == q,
                    _ => loose_eq_checked(&x, &y).map_err(|()| self.fail(EvalError::NaN))?,
                };
                return Ok(eq == (op == Op::Eq));
            }
            Op::Lt => Rel::Lt,
            Op::Le => Rel::Le,
            Op::Gt => Rel::Gt,
            _ => Rel::Ge,
        };
        match (x, y) {
            (Value::Int(p), Value::Int(q)) => Ok(match rel {
                Rel::Lt => p < q,
                Rel::Le => p <= q,
                Rel::Gt => p > q,
                Rel::Ge => p >= q,
            }),
            _ => relate(&x, &y, rel).map_err(|()| self.fail(EvalError::NaN)),
        }
    }

    /// `var` with a path computed at evaluation time: `[path, default]`.
    #[inline(never)]
    fn var_dynamic(&self, args: Args<'a>, scope: &Scope<'_, 'a>) -> R<'a> {
        let cursor = Cursor::Frame(scope.frame());
        let found = match self.arg(args, 0, scope)? {
            Value::Null => Some(self.whole(cursor)),
            path => walk_dotted(self, cursor, key_text(path, self.arena)),
        };
        match found {
            Some(v) => Ok(v),
            None => self.arg(args, 1, scope),
        }
    }

    /// `val` / `exists` with pieces computed at evaluation time.
    #[inline(never)]
    fn val_dynamic(&self, op: Op, args: Args<'a>, scope: &Scope<'_, 'a>) -> R<'a> {
        let n = args.len();
        let mut cursor = Cursor::Frame(scope.frame());
        let mut pending = if n > 0 {
            Some(self.arg(args, 0, scope)?)
        } else {
            None
        };
        match pending {
            Some(Value::Array(marker)) if op == Op::Val => {
                cursor = scope.at_level(level_of(marker));
                pending = None;
            }
            Some(Value::Null) if n == 1 => pending = None,
            _ => {}
        }
        let mut i = 1;
        // `None` until the first piece steps off the cursor.
        let mut at: Option<Value<'a>> = None;
        loop {
            let piece = match pending.take() {
                Some(p) => p,
                None if i < n => {
                    i += 1;
                    self.arg(args, i - 1, scope)?
                }
                None => break,
            };
            let key = key_text(piece, self.arena);
            let next = match at {
                None => first_step(cursor, key, index_of(key)),
                Some(v) => step(v, key, index_of(key)),
            };
            match next {
                Some(v) => at = Some(v),
                None => {
                    return Ok(if op == Op::Exists {
                        Value::Bool(false)
                    } else {
                        Value::Null
                    });
                }
            }
        }
        Ok(match op {
            Op::Exists => Value::Bool(true),
            _ => at.unwrap_or_else(|| self.whole(cursor)),
        })
    }

    /// A key is missing when its value is absent, `null` or `""`.
    fn is_missing(v: Option<Value<'_>>) -> bool {
        matches!(v, None | Some(Value::Null) | Some(Value::Str("")))
    }

    /// `missing` / `missing_some` over constant keys. The missing keys are
    /// noted in a bit mask (up to 64 keys) and the result is allocated once,
    /// at its exact size, after the scan. Inlined into its one caller,
    /// [`Self::missing_node`].
    #[inline(always)]
    fn missing_const(
        &self,
        keys: &'a [MissingKey],
        need: Option<NodeId>,
        scope: &Scope<'_, 'a>,
    ) -> R<'a> {
        let need = match need {
            // A count that is not a number (NaN) is never reached.
            Some(id) => Some(js_number(&self.operand(id, scope)?)),
            None => None,
        };
        if scope.reduce || keys.len() > 64 {
            return Ok(self.missing_const_slow(keys, need, scope));
        }
        // Outside `reduce` the frame is plain data: read it in place.
        let data = scope.data;
        let mut mask = 0u64;
        match need {
            None => {
                for (i, key) in keys.iter().enumerate() {
                    mask |= u64::from(is_missing_ref(path_ref(data, &key.path))) << i;
                }
            }
            Some(need) => {
                let mut found = 0.0;
                for (i, key) in keys.iter().enumerate() {
                    if is_missing_ref(path_ref(data, &key.path)) {
                        mask |= 1 << i;
                    } else {
                        // `missing_some` is satisfied: the rest cannot
                        // change that.
                        found += 1.0;
                        if found >= need {
                            return Ok(Value::EMPTY_ARRAY);
                        }
                    }
                }
                if found >= need {
                    return Ok(Value::EMPTY_ARRAY);
                }
            }
        }
        if mask == 0 {
            return Ok(Value::EMPTY_ARRAY);
        }
        let out = self
            .arena
            .alloc_slice_fill_copy(mask.count_ones() as usize, Value::Null);
        for slot in out.iter_mut() {
            *slot = Value::Str(&keys[mask.trailing_zeros() as usize].text);
            mask &= mask - 1;
        }
        Ok(Value::Array(out))
    }

    /// [`Self::missing_const`] inside `reduce` (whose frame is read through
    /// its slots) or for more keys than its mask holds.
    #[cold]
    #[inline(never)]
    fn missing_const_slow(
        &self,
        keys: &'a [MissingKey],
        need: Option<f64>,
        scope: &Scope<'_, 'a>,
    ) -> Value<'a> {
        let mut out = None;
        let mut found = 0usize;
        for (i, key) in keys.iter().enumerate() {
            if Self::is_missing(self.lookup_scope(scope, &key.path)) {
                self.push_missing(&mut out, keys.len() - i, Value::Str(&key.text));
            } else if let Some(need) = need {
                found += 1;
                if found as f64 >= need {
                    return Value::EMPTY_ARRAY;
                }
            }
        }
        self.missing_result(out, keys.len(), need)
    }

    /// `missing` over a computed `merge`: each part's keys (an array's
    /// items, or the part itself) are checked as they come. `None` when the
    /// merged list would start with an array, which `missing` reads as its
    /// key list, or is empty: the caller then takes the general path.
    #[inline(never)]
    fn missing_merge(&self, parts: &'a [NodeId], scope: &Scope<'_, 'a>) -> Option<R<'a>> {
        let cursor = Cursor::Frame(scope.frame());
        let mut out: Option<BVec<'a, Value<'a>>> = None;
        let mut first = true;
        for &id in parts {
            let part = match self.eval(id, scope) {
                Ok(v) => v,
                Err(fail) => return Some(Err(fail)),
            };
            let keys = match &part {
                Value::Array(items) => *items,
                other => std::slice::from_ref(other),
            };
            for key in keys {
                if first {
                    if matches!(key, Value::Array(_)) {
                        return None;
                    }
                    first = false;
                }
                let found = match key {
                    Value::Null => Some(self.whole(cursor)),
                    k => walk_dotted(self, cursor, key_text(*k, self.arena)),
                };
                if Self::is_missing(found) {
                    out.get_or_insert_with(|| BVec::with_capacity_in(4, self.arena))
                        .push(*key);
                }
            }
        }
        if first {
            // Nothing merged: `missing` with no keys reads `null` as its one
            // key; the general path has that rule.
            return None;
        }
        Some(Ok(self.missing_result(out, 0, None)))
    }

    /// Collects a missing key; the list is allocated on the first one, sized
    /// for the `left` keys still to check.
    #[inline]
    fn push_missing(&self, out: &mut Option<BVec<'a, Value<'a>>>, left: usize, key: Value<'a>) {
        out.get_or_insert_with(|| BVec::with_capacity_in(left, self.arena))
            .push(key);
    }

    fn missing_result(
        &self,
        missing: Option<BVec<'a, Value<'a>>>,
        total: usize,
        need: Option<f64>,
    ) -> Value<'a> {
        let Some(missing) = missing else {
            return Value::EMPTY_ARRAY;
        };
        if let Some(need) = need
            && (total - missing.len()) as f64 >= need
        {
            return Value::EMPTY_ARRAY;
        }
        Value::Array(missing.into_bump_slice())
    }

    #[inline(never)]
    fn missing_dynamic(&self, op: Op, args: Args<'a>, scope: &Scope<'_, 'a>) -> R<'a> {
        let (need, keys): (Option<f64>, &'a [Value<'a>]) = if op == Op::MissingSome {
            let need = js_number(&self.arg(args, 0, scope)?);
            match self.arg(args, 1, scope)? {
                Value::Array(items) => (Some(need), items),
                other => (Some(need), std::slice::from_ref(self.arena.alloc(other))),
            }
        } else {
            match self.arg(args, 0, scope)? {
                Value::Array(items) => (None, items),
                first => {
                    let mut all = BVec::with_capacity_in(args.len(), self.arena);
                    all.push(first);
                    for i in 1..args.len() {
                        all.push(self.arg(args, i, scope)?);
                    }
                    (None, all.into_bump_slice())
                }
            }
        };
        let cursor = Cursor::Frame(scope.frame());
        let mut out = None;
        for (i, key) in keys.iter().enumerate() {
            let found = match key {
                Value::Null => Some(self.whole(cursor)),
                k => walk_dotted(self, cursor, key_text(*k, self.arena)),
            };
            if Self::is_missing(found) {
                self.push_missing(&mut out, keys.len() - i, *key);
            }
        }
        Ok(self.missing_result(out, keys.len(), need))
    }
}
