//! Which paths of the data a compiled rule can read, found at compile time.
//!
//! Used by the plan builder to tell whether one `map` mapping may see the
//! writes of the mappings before it (see `plan::MapBatch`). The answer is
//! conservative: any operator whose reads are only known at evaluation time
//! (a computed `var` path, `val` climbing out of an iterator, `try`, whose
//! fallback reads the error as its scope) makes the whole rule "unknown".

use super::{Logic, Node, NodeId, Op, Program};
use crate::path::Segment;

impl Logic {
    /// Every path of the evaluation root this rule may read, each one
    /// standing for itself and everything below it (the empty path is the
    /// whole root). `None` when that cannot be known before evaluation.
    pub fn root_reads(&self) -> Option<Vec<&[Segment]>> {
        let mut reads = Vec::new();
        collect(&self.prog, self.root, 0, &mut reads)?;
        Some(reads)
    }

    /// The paths this rule reads from its evaluation root whose first key is
    /// none of `roots`, dotted, each once, in the order they appear. Such a
    /// read always finds nothing (`null`, or `var`'s default): most likely a
    /// path written without its root (`order.total` for `data.order.total`).
    /// Empty when the reads cannot be known before evaluation.
    pub fn stray_reads(&self, roots: &[&str]) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for path in self.root_reads().unwrap_or_default() {
            let Some(first) = path.first() else { continue };
            if roots.contains(&&*first.key) {
                continue;
            }
            let dotted = path.iter().map(|s| &*s.key).collect::<Vec<_>>().join(".");
            // `""` reads the whole root.
            if !dotted.is_empty() && !out.contains(&dotted) {
                out.push(dotted);
            }
        }
        out
    }
}

/// Walks `id` at iterator depth `depth` (0 = the root scope).
fn collect<'p>(
    prog: &'p Program,
    id: NodeId,
    depth: u32,
    reads: &mut Vec<&'p [Segment]>,
) -> Option<()> {
    match &prog.nodes[id as usize] {
        Node::Null
        | Node::Bool(_)
        | Node::Int(_)
        | Node::Float(_)
        | Node::Str(_)
        | Node::Json(_) => Some(()),
        Node::Var {
            level,
            path,
            default,
            ..
        } => {
            match (depth, *level) {
                // The root scope; climbing past the root stays there.
                (0, _) => reads.push(path),
                // The iterator's element, itself read from a collection
                // whose own read is already noted.
                (_, 0) => {}
                // A climb out of an iterator: where it lands is not tracked.
                _ => return None,
            }
            match default {
                Some(d) => collect(prog, *d, depth, reads),
                None => Some(()),
            }
        }
        Node::Exists { path } => {
            if depth == 0 {
                reads.push(path);
            }
            Some(())
        }
        Node::Missing { keys, need } => {
            if depth == 0 {
                reads.extend(keys.iter().map(|k| &*k.path));
            }
            match need {
                Some(n) => collect(prog, *n, depth, reads),
                None => Some(()),
            }
        }
        Node::InStrs { needle, .. } => collect(prog, *needle, depth, reads),
        Node::Op { op, start, len } => {
            if !plain(*op) {
                return None;
            }
            let args = &prog.args[*start as usize..(*start + *len) as usize];
            for &arg in args {
                collect(prog, arg, depth, reads)?;
            }
            Some(())
        }
        Node::Spread { op, arg } => {
            if !plain(*op) {
                return None;
            }
            collect(prog, *arg, depth, reads)
        }
        Node::Iter(iter) => {
            collect(prog, iter.coll, depth, reads)?;
            if let Some(init) = iter.init {
                collect(prog, init, depth, reads)?;
            }
            // Every body shape keeps its node, so the walk reads the body
            // itself; the shapes only read the element (or `reduce`'s frame).
            collect(prog, iter.body, depth + 1, reads)
        }
    }
}

/// Operators that evaluate their arguments in the caller's scope and read
/// nothing else.
fn plain(op: Op) -> bool {
    match op {
        Op::If
        | Op::And
        | Op::Or
        | Op::Not
        | Op::NotNot
        | Op::Coalesce
        | Op::Throw
        | Op::Eq
        | Op::StrictEq
        | Op::Ne
        | Op::StrictNe
        | Op::Gt
        | Op::Ge
        | Op::Lt
        | Op::Le
        | Op::Add
        | Op::Sub
        | Op::Mul
        | Op::Div
        | Op::Mod
        | Op::Max
        | Op::Min
        | Op::Merge
        | Op::In
        | Op::Cat
        | Op::Substr
        | Op::Length
        | Op::Log
        | Op::Array => true,
        // Scoped (`try`'s fallback, the iterators when not compiled into
        // `Node::Iter`) or reading a path known only at evaluation time.
        Op::Try
        | Op::Map
        | Op::Filter
        | Op::Reduce
        | Op::All
        | Op::Some
        | Op::None
        | Op::Var
        | Op::Val
        | Op::Exists
        | Op::Missing
        | Op::MissingSome => false,
    }
}

#[cfg(test)]
mod tests {
    use crate::logic::compile;
    use serde_json::json;

    fn reads(rule: serde_json::Value) -> Option<Vec<String>> {
        let logic = compile(&rule).unwrap();
        logic.root_reads().map(|rs| {
            rs.iter()
                .map(|segs| segs.iter().map(|s| &*s.key).collect::<Vec<_>>().join("."))
                .collect()
        })
    }

    #[test]
    fn stray_reads_are_those_outside_the_roots() {
        let stray =
            |rule: serde_json::Value| compile(&rule).unwrap().stray_reads(&["data", "metadata"]);
        assert_eq!(
            stray(
                json!({"if": [{"var": "order.total"}, {"var": "data.x"}, {"var": ["order.total", 0]}]})
            ),
            vec!["order.total".to_owned()]
        );
        assert_eq!(
            stray(
                json!({"and": [{"missing": ["total"]}, {"var": "metadata.headers.x"}, {"var": ""}]})
            ),
            vec!["total".to_owned()]
        );
        // An iterator's body reads the element, not the root.
        assert!(
            stray(json!({"all": [{"var": "data.items"}, {">": [{"var": "price"}, 0]}]})).is_empty()
        );
        assert!(
            stray(json!({"reduce": [{"var": "data.items"}, {"+": [{"var": "accumulator"}, {"var": "current.qty"}]}, 0]}))
                .is_empty()
        );
        assert_eq!(
            stray(json!({"map": [{"var": "items"}, {"var": "x"}]})),
            vec!["items".to_owned()]
        );
        // Reads known only at evaluation time: nothing is claimed.
        assert!(stray(json!({"var": {"cat": [{"var": "data.p"}, ".x"]}})).is_empty());
    }

    #[test]
    fn plain_reads_are_listed() {
        assert_eq!(
            reads(json!({"cat": [{"var": "data.a.b"}, " ", {"var": ["data.c", 1]}]})),
            Some(vec!["data.a.b".into(), "data.c".into()])
        );
        assert_eq!(reads(json!({"+": [1, 2]})), Some(vec![]));
        assert_eq!(reads(json!({"var": ""})), Some(vec!["".into()]));
        assert_eq!(
            reads(json!({"missing": ["data.x", "data.y"]})),
            Some(vec!["data.x".into(), "data.y".into()])
        );
        assert_eq!(
            reads(json!({"in": [{"var": "data.k"}, ["a", "b"]]})),
            Some(vec!["data.k".into()])
        );
    }

    #[test]
    fn iterator_bodies_read_their_element_not_the_root() {
        assert_eq!(
            reads(json!({"reduce": [
                {"var": "data.items"},
                {"+": [{"var": "accumulator"}, {"*": [{"var": "current.price"}, {"var": "current.qty"}]}]},
                {"var": "data.start"}
            ]})),
            Some(vec!["data.items".into(), "data.start".into()])
        );
        assert_eq!(
            reads(json!({"map": [{"var": "data.xs"}, {"cat": [{"var": "name"}, "!"]}]})),
            Some(vec!["data.xs".into()])
        );
        assert_eq!(
            reads(json!({"all": [{"var": "data.items"}, {">=": [{"var": "qty"}, 1]}]})),
            Some(vec!["data.items".into()])
        );
    }

    #[test]
    fn reads_known_only_at_evaluation_are_unknown() {
        assert_eq!(
            reads(json!({"var": {"cat": ["data.", {"var": "k"}]}})),
            None
        );
        assert_eq!(
            reads(json!({"map": [{"var": "data.xs"}, {"val": [[2], "data", "y"]}]})),
            None
        );
        assert_eq!(
            reads(json!({"try": [{"throw": "x"}, {"var": "type"}]})),
            None
        );
        assert_eq!(
            reads(json!({"missing": {"merge": ["a", {"var": "k"}]}})),
            None
        );
    }
}
