//! Rule JSON → flat `Program`: operator resolution, argument-shape checks,
//! compile-time path splitting, constant folding and the nesting limit.

use super::eval::{self, index_of, key_text};
use super::lit::{Lit, RootConst};
use super::{
    ARITH_STACK, Body, CompileError, Entry, Iter, Logic, MAX_DEPTH, MissingKey, Node, NodeId, Op,
    Operand, Program, Scalar, Slot, Step,
};
use crate::path::{Path, Segment};
use crate::value::Value;
use bumpalo::Bump;
use serde_json::Value as Json;

pub(super) fn compile(rule: &Json) -> Result<Logic, CompileError> {
    let mut c = Compiler {
        prog: Program::default(),
    };
    let root = c.rule(rule, 0)?;
    let constant = c.prog.nodes[root as usize]
        .is_const()
        .then(|| c.node_json(root));
    // Folding leaves nothing behind, but `var` keeps its (tiny) path node;
    // shrink so a long-lived `Logic` holds no spare capacity.
    c.prog.nodes.shrink_to_fit();
    c.prog.args.shrink_to_fit();
    c.prog.consts.shrink_to_fit();
    let scalar = match c.prog.nodes[root as usize] {
        Node::Null => Some(Value::Null),
        Node::Bool(b) => Some(Value::Bool(b)),
        Node::Int(i) => Some(Value::Int(i)),
        Node::Float(f) => Some(Value::Float(f)),
        _ => None,
    };
    let entry = match &c.prog.nodes[root as usize] {
        Node::Str(_) | Node::Json(_) => Entry::Const,
        Node::Var {
            level: 0,
            default: None,
            ..
        } => Entry::Var,
        _ => Entry::Rule,
    };
    let root_const = constant.as_ref().and_then(RootConst::new);
    let accumulates = c.prog.nodes.iter().any(|n| match n {
        Node::Op { op, .. } | Node::Spread { op, .. } => *op == Op::Reduce,
        Node::Iter(it) => it.op == Op::Reduce,
        _ => false,
    });
    Ok(Logic {
        prog: c.prog,
        root,
        constant,
        scalar,
        root_const,
        entry,
        accumulates,
    })
}

/// How an operator takes a non-array argument (`{"op": x}`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// Needs a literal argument array: control flow, comparisons and
    /// iterators decide laziness per position, so `{"if": 5}` or
    /// `{"and": {"var": "xs"}}` are "Invalid Arguments".
    Structural,
    /// One value: `{"!": x}` is `{"!": [x]}` even when `x` is an operation.
    Unary,
    /// Variadic over values: `{"max": {"var": "xs"}}` spreads the array the
    /// operation returns ("logic chaining" in the compat-tables).
    Spread,
}

fn resolve(name: &str) -> Option<(Op, Shape)> {
    use Shape::*;
    Some(match name {
        "if" | "?:" => (Op::If, Structural),
        "and" => (Op::And, Structural),
        "or" => (Op::Or, Structural),
        "!" => (Op::Not, Unary),
        "!!" => (Op::NotNot, Unary),
        "??" => (Op::Coalesce, Spread),
        "try" => (Op::Try, Unary),
        "throw" => (Op::Throw, Unary),
        "==" => (Op::Eq, Structural),
        "===" => (Op::StrictEq, Structural),
        "!=" => (Op::Ne, Structural),
        "!==" => (Op::StrictNe, Structural),
        ">" => (Op::Gt, Structural),
        ">=" => (Op::Ge, Structural),
        "<" => (Op::Lt, Structural),
        "<=" => (Op::Le, Structural),
        "+" => (Op::Add, Spread),
        "-" => (Op::Sub, Spread),
        "*" => (Op::Mul, Spread),
        "/" => (Op::Div, Spread),
        "%" => (Op::Mod, Spread),
        "max" => (Op::Max, Spread),
        "min" => (Op::Min, Spread),
        "map" => (Op::Map, Structural),
        "filter" => (Op::Filter, Structural),
        "reduce" => (Op::Reduce, Structural),
        "all" => (Op::All, Structural),
        "some" => (Op::Some, Structural),
        "none" => (Op::None, Structural),
        "merge" => (Op::Merge, Spread),
        "in" => (Op::In, Spread),
        "cat" => (Op::Cat, Spread),
        "substr" => (Op::Substr, Spread),
        "length" => (Op::Length, Unary),
        "log" => (Op::Log, Unary),
        "var" => (Op::Var, Spread),
        "val" => (Op::Val, Spread),
        "exists" => (Op::Exists, Spread),
        "missing" => (Op::Missing, Spread),
        "missing_some" => (Op::MissingSome, Spread),
        _ => return None,
    })
}

fn slot(path: &[Segment]) -> Slot {
    path.first().map_or(Slot::Whole, |s| eval::slot_of(&s.key))
}

fn invalid(name: &str, why: &str) -> CompileError {
    CompileError::new(format!("Invalid Arguments: '{name}' {why}"))
}

fn too_deep() -> CompileError {
    CompileError::new(format!("rule nests deeper than {MAX_DEPTH} levels"))
}

/// Checks a literal (never compiled, so never depth-checked) for depth.
/// `depth` counts the containers enclosing `v`; recursion stops at the limit.
fn check_literal_depth(v: &Json, depth: usize) -> Result<(), CompileError> {
    let children: Box<dyn Iterator<Item = &Json>> = match v {
        Json::Array(items) => Box::new(items.iter()),
        Json::Object(map) => Box::new(map.values()),
        _ => return Ok(()),
    };
    if depth + 1 > MAX_DEPTH {
        return Err(too_deep());
    }
    for child in children {
        check_literal_depth(child, depth + 1)?;
    }
    Ok(())
}

/// Ops whose value depends only on their arguments, so all-constant
/// arguments fold. Data access reads the scope, `throw` always fails.
fn foldable(op: Op) -> bool {
    !matches!(
        op,
        Op::Var | Op::Val | Op::Exists | Op::Missing | Op::MissingSome | Op::Throw
    )
}

/// Truncation point: nodes are appended in post-order, so everything a
/// sub-rule added sits after its mark and can be dropped once it folds.
#[derive(Clone, Copy)]
struct Mark {
    nodes: usize,
    args: usize,
    consts: usize,
}

struct Compiler {
    prog: Program,
}

impl Compiler {
    fn push(&mut self, node: Node) -> NodeId {
        self.prog.nodes.push(node);
        (self.prog.nodes.len() - 1) as NodeId
    }

    fn mark(&self) -> Mark {
        Mark {
            nodes: self.prog.nodes.len(),
            args: self.prog.args.len(),
            consts: self.prog.consts.len(),
        }
    }

    fn truncate(&mut self, m: Mark) {
        self.prog.nodes.truncate(m.nodes);
        self.prog.args.truncate(m.args);
        self.prog.consts.truncate(m.consts);
    }

    fn is_const(&self, id: NodeId) -> bool {
        self.prog.nodes[id as usize].is_const()
    }

    /// A constant node for `v`: scalars inline, containers in `consts`.
    fn const_node(&mut self, v: &Json) -> NodeId {
        let node = match v {
            Json::Null => Node::Null,
            Json::Bool(b) => Node::Bool(*b),
            Json::Number(n) => match n.as_i64() {
                Some(i) => Node::Int(i),
                None => Node::Float(n.as_f64().unwrap_or(0.0)),
            },
            Json::String(s) => Node::Str(s.as_str().into()),
            Json::Array(_) | Json::Object(_) => {
                self.prog.consts.push(Lit::new(v.clone()));
                Node::Json((self.prog.consts.len() - 1) as u32)
            }
        };
        self.push(node)
    }

    /// The JSON value of a constant node.
    fn node_json(&self, id: NodeId) -> Json {
        match &self.prog.nodes[id as usize] {
            Node::Bool(b) => Json::Bool(*b),
            Node::Int(i) => Json::from(*i),
            Node::Float(f) => crate::value::float_to_json(*f),
            Node::Str(s) => Json::String(s.to_string()),
            Node::Json(i) => self.prog.consts[*i as usize].json().clone(),
            _ => Json::Null,
        }
    }

    /// Compiles `r`; `depth` counts the containers enclosing it.
    fn rule(&mut self, r: &Json, depth: usize) -> Result<NodeId, CompileError> {
        match r {
            Json::Array(items) => {
                if depth + 1 > MAX_DEPTH {
                    return Err(too_deep());
                }
                let mark = self.mark();
                let ids = items
                    .iter()
                    .map(|item| self.rule(item, depth + 1))
                    .collect::<Result<Vec<_>, _>>()?;
                if ids.iter().all(|&id| self.is_const(id)) {
                    let folded = Json::Array(ids.iter().map(|&id| self.node_json(id)).collect());
                    self.truncate(mark);
                    return Ok(self.const_node(&folded));
                }
                Ok(self.op_node(Op::Array, &ids))
            }
            Json::Object(map) if map.len() == 1 => {
                if depth + 1 > MAX_DEPTH {
                    return Err(too_deep());
                }
                let (name, arg) = map.iter().next().expect("one member");
                self.operation(name, arg, depth + 1)
            }
            // Objects that are not a single-key operation are data literals,
            // as in the reference implementation (`{"!!": [{}]}` is true).
            Json::Object(_) => {
                check_literal_depth(r, depth)?;
                Ok(self.const_node(r))
            }
            _ => Ok(self.const_node(r)),
        }
    }

    fn op_node(&mut self, op: Op, ids: &[NodeId]) -> NodeId {
        let start = self.prog.args.len() as u32;
        self.prog.args.extend_from_slice(ids);
        self.push(Node::Op {
            op,
            start,
            len: ids.len() as u32,
        })
    }

    /// Compiles `{name: arg}`; `depth` counts the containers enclosing `arg`.
    fn operation(&mut self, name: &str, arg: &Json, depth: usize) -> Result<NodeId, CompileError> {
        if name == "preserve" {
            // The argument is returned as written, never evaluated.
            check_literal_depth(arg, depth)?;
            return Ok(self.const_node(arg));
        }
        let Some((op, shape)) = resolve(name) else {
            return Err(CompileError::new(format!("unknown operator '{name}'")));
        };
        let mark = self.mark();
        let ids = match arg {
            Json::Array(items) => {
                if depth + 1 > MAX_DEPTH {
                    return Err(too_deep());
                }
                items
                    .iter()
                    .map(|item| self.rule(item, depth + 1))
                    .collect::<Result<Vec<_>, _>>()?
            }
            _ if shape == Shape::Structural => {
                return Err(invalid(name, "needs an array of arguments"));
            }
            Json::Object(m) if m.len() == 1 && shape == Shape::Spread => {
                let id = self.rule(arg, depth)?;
                if !self.is_const(id) {
                    return Ok(self.push(Node::Spread { op, arg: id }));
                }
                // The chained operation folded: spread its value now.
                match self.node_json(id) {
                    Json::Array(items) => {
                        self.truncate(mark);
                        items.iter().map(|item| self.const_node(item)).collect()
                    }
                    _ => vec![id],
                }
            }
            _ => vec![self.rule(arg, depth)?],
        };
        let items = arg.as_array().map(Vec::as_slice).unwrap_or_default();
        self.check_arity(name, op, &ids, items)?;
        let id = match op {
            Op::Var | Op::Val | Op::Exists => self.data_access(op, &ids),
            Op::Missing | Op::MissingSome => self.missing(op, &ids),
            Op::In => self.in_strings(&ids),
            Op::Map | Op::Filter | Op::Reduce | Op::All | Op::Some | Op::None => {
                Some(self.iter_node(op, &ids))
            }
            _ => None,
        };
        let id = match id {
            Some(id) => id,
            None => self.op_node(op, &ids),
        };
        if foldable(op)
            && ids.iter().all(|&a| self.is_const(a))
            && let Some(value) = eval::fold(&self.prog, id)
        {
            self.truncate(mark);
            return Ok(self.const_node(&value));
        }
        Ok(id)
    }

    /// Argument counts and shapes that are wrong whatever the data. `items`
    /// is the literal argument array (empty for a single argument).
    fn check_arity(
        &self,
        name: &str,
        op: Op,
        ids: &[NodeId],
        items: &[Json],
    ) -> Result<(), CompileError> {
        let n = ids.len();
        match op {
            _ if op.is_comparison() && n < 2 => Err(invalid(name, "needs at least two arguments")),
            Op::Sub | Op::Div if n == 0 => Err(invalid(name, "needs at least one argument")),
            Op::Mod if n < 2 => Err(invalid(name, "needs at least two arguments")),
            Op::MissingSome if n < 2 => Err(invalid(name, "needs [count, keys]")),
            Op::Map | Op::Filter | Op::Reduce | Op::All | Op::Some | Op::None => {
                if n < 2 {
                    return Err(invalid(name, "needs [collection, rule]"));
                }
                // A literal scalar can never be a collection, and map/filter
                // with a null rule have nothing to compute (compat-tables).
                if !matches!(items[0], Json::Array(_) | Json::Object(_)) {
                    return Err(invalid(
                        name,
                        "needs an array or an operation as its collection",
                    ));
                }
                if matches!(op, Op::Map | Op::Filter) && items[1].is_null() {
                    return Err(invalid(name, "needs a rule"));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The constant value of argument nodes, as arena values (so path
    /// interpretation is shared with evaluation).
    fn const_values(&self, ids: &[NodeId]) -> Vec<Value<'_>> {
        ids.iter()
            .map(|&id| eval::const_value(&self.prog, id))
            .collect()
    }

    /// `var` / `val` / `exists` whose path is constant: split it now.
    fn data_access(&mut self, op: Op, ids: &[NodeId]) -> Option<NodeId> {
        let arena = Bump::new();
        let node = match op {
            Op::Var => {
                // `{"var": []}` reads the whole data, like a null path.
                let path = match ids.first() {
                    None => Value::Null,
                    Some(&id) if self.is_const(id) => eval::const_value(&self.prog, id),
                    Some(_) => return None,
                };
                let segments: Box<[Segment]> = match path {
                    Value::Null => Box::default(),
                    other => Path::parse(key_text(other, &arena)).segments().into(),
                };
                Node::Var {
                    level: 0,
                    slot: slot(&segments),
                    path: segments,
                    default: ids.get(1).copied(),
                }
            }
            Op::Val | Op::Exists => {
                if !ids.iter().all(|&id| self.is_const(id)) {
                    return None;
                }
                let values = self.const_values(ids);
                let (level, rest) = match values.as_slice() {
                    [Value::Array(marker), rest @ ..] if op == Op::Val => {
                        (eval::level_of(marker), rest)
                    }
                    [Value::Null] => (0, &[][..]),
                    all => (0, all),
                };
                let path: Box<[Segment]> = rest
                    .iter()
                    .map(|v| {
                        let key = key_text(*v, &arena);
                        Segment::new(key, index_of(key))
                    })
                    .collect();
                if op == Op::Exists {
                    Node::Exists { path }
                } else {
                    Node::Var {
                        level,
                        slot: slot(&path),
                        path,
                        default: None,
                    }
                }
            }
            _ => return None,
        };
        Some(self.push(node))
    }

    /// `missing` / `missing_some` over constant string keys: pre-split them.
    fn missing(&mut self, op: Op, ids: &[NodeId]) -> Option<NodeId> {
        let (need, key_ids) = match op {
            Op::MissingSome => (Some(*ids.first()?), ids.get(1..2)?),
            _ => (None, ids),
        };
        let keys: Vec<Json> = match key_ids {
            // `missing` takes its keys from a leading array, else all args.
            [first, ..] if matches!(self.prog.nodes[*first as usize], Node::Json(_)) => {
                match self.node_json(*first) {
                    Json::Array(items) => items,
                    _ => return None,
                }
            }
            all if all.iter().all(|&id| self.is_const(id)) => {
                all.iter().map(|&id| self.node_json(id)).collect()
            }
            _ => return None,
        };
        let keys = keys
            .iter()
            .map(|k| {
                let text = k.as_str()?;
                Some(MissingKey {
                    text: text.into(),
                    path: Path::parse(text).segments().into(),
                })
            })
            .collect::<Option<Box<[_]>>>()?;
        Some(self.push(Node::Missing { keys, need }))
    }

    /// An iterator: `ids` is `[collection, body, init?]` (arity checked).
    fn iter_node(&mut self, op: Op, ids: &[NodeId]) -> NodeId {
        let (coll, body) = (ids[0], ids[1]);
        let reduce = op == Op::Reduce;
        let shape = match &self.prog.nodes[body as usize] {
            Node::Op {
                op: body_op,
                start,
                len: 2,
            } => {
                let args = &self.prog.args[*start as usize..*start as usize + 2];
                let arithmetic = matches!(body_op, Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Mod);
                let operands = if arithmetic || body_op.is_comparison() {
                    self.operand(args[0], reduce)
                        .zip(self.operand(args[1], reduce))
                } else {
                    None
                };
                match operands {
                    // A test of the element against a constant: the
                    // predicate loop (`filter` and the quantifiers only;
                    // `map` wants the value).
                    Some((Operand::Item(path), Operand::Const(konst)))
                        if matches!(op, Op::Filter | Op::All | Op::Some | Op::None)
                            && body_op.is_comparison() =>
                    {
                        Body::Pred {
                            op: *body_op,
                            path,
                            konst,
                        }
                    }
                    Some((a, b)) => Body::Two(*body_op, a, b),
                    None => match self.arith_program(body, reduce) {
                        Some(steps) => Body::Arith(steps),
                        None => Body::Call {
                            op: *body_op,
                            start: *start,
                        },
                    },
                }
            }
            _ => self.operand(body, reduce).map_or(Body::General, Body::One),
        };
        self.push(Node::Iter(Box::new(Iter {
            op,
            coll,
            body,
            init: if reduce { ids.get(2).copied() } else { None },
            shape,
        })))
    }

    /// `id` as a [`Body::Arith`] program, when it is nested two-argument
    /// arithmetic whose leaves are [`Self::operand`]s and whose stack stays
    /// within [`ARITH_STACK`].
    fn arith_program(&self, id: NodeId, reduce: bool) -> Option<Box<[Step]>> {
        let mut steps = Vec::new();
        let depth = self.arith_steps(id, reduce, &mut steps, 0)?;
        (depth <= ARITH_STACK).then(|| steps.into_boxed_slice())
    }

    /// Appends the postfix steps of `id`; returns the stack depth they need
    /// when `below` numbers are already on the stack.
    fn arith_steps(
        &self,
        id: NodeId,
        reduce: bool,
        steps: &mut Vec<Step>,
        below: usize,
    ) -> Option<usize> {
        if below >= ARITH_STACK {
            return None;
        }
        if let Node::Op { op, start, len: 2 } = self.prog.nodes[id as usize]
            && matches!(op, Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Mod)
        {
            let (a, b) = (
                self.prog.args[start as usize],
                self.prog.args[start as usize + 1],
            );
            let left = self.arith_steps(a, reduce, steps, below)?;
            let right = self.arith_steps(b, reduce, steps, below + 1)?;
            steps.push(Step::Apply(op));
            return Some(left.max(right));
        }
        steps.push(Step::Load(self.operand(id, reduce)?));
        Some(below + 1)
    }

    /// A body operand that needs no scope: a plain `var` read of the
    /// element (in `reduce`, of `current` / `accumulator`) or a scalar.
    fn operand(&self, id: NodeId, reduce: bool) -> Option<Operand> {
        Some(match &self.prog.nodes[id as usize] {
            Node::Var {
                level: 0,
                path,
                default: None,
                slot,
            } => match (reduce, slot) {
                (false, _) => Operand::Item(path.clone()),
                (true, Slot::Current) => Operand::Item(path[1..].into()),
                (true, Slot::Accumulator) => Operand::Acc(path[1..].into()),
                (true, Slot::Other) => Operand::Const(Scalar::Null),
                (true, Slot::Whole) => return None,
            },
            Node::Null => Operand::Const(Scalar::Null),
            Node::Bool(b) => Operand::Const(Scalar::Bool(*b)),
            Node::Int(i) => Operand::Const(Scalar::Int(*i)),
            Node::Float(f) => Operand::Const(Scalar::Float(*f)),
            Node::Str(s) => Operand::Const(Scalar::Str(s.clone())),
            _ => return None,
        })
    }

    /// `in` against a constant array of strings (the common "one of" test).
    fn in_strings(&mut self, ids: &[NodeId]) -> Option<NodeId> {
        let [needle, hay] = *ids else { return None };
        if self.is_const(needle) || !matches!(self.prog.nodes[hay as usize], Node::Json(_)) {
            return None;
        }
        let Json::Array(items) = self.node_json(hay) else {
            return None;
        };
        let mut set = items
            .iter()
            .map(|i| i.as_str().map(Box::<str>::from))
            .collect::<Option<Vec<_>>>()?;
        set.sort_unstable();
        set.dedup();
        Some(self.push(Node::InStrs {
            needle,
            set: set.into(),
        }))
    }
}
