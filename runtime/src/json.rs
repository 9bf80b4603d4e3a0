//! Zero-copy JSON parsing into the arena: simd-json builds a tape over a mutable
//! copy of the input that lives in the arena, and the tape is turned into a
//! `Value` whose strings point into that copy. The parser's scratch buffers and
//! tape are kept per thread and reused, so a parse costs no heap allocation
//! beyond the arena once a thread has warmed up.

use bumpalo::Bump;
use simd_json::{Buffers, Node, StaticNode, Tape};
use sluice_compiler::Value;
use sluice_compiler::value::key_eq;
use std::cell::RefCell;
use std::collections::HashMap;

/// Why a text is not JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON: {0}")]
pub struct JsonError(pub String);

struct Scratch {
    buffers: Buffers,
    tape: Tape<'static>,
}

thread_local! {
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

/// Parses `input` into the arena. The input is copied once into the arena (the
/// parser unescapes strings in place); every string of the result borrows from
/// that copy.
pub fn parse<'a>(input: &[u8], arena: &'a Bump) -> Result<Value<'a>, JsonError> {
    let buf: &'a mut [u8] = arena.alloc_slice_copy(input);
    let mut scratch = SCRATCH
        .with(|s| s.borrow_mut().take())
        .unwrap_or_else(|| Scratch {
            buffers: Buffers::new(input.len()),
            tape: Tape::null(),
        });
    let mut tape: Tape<'a> = scratch.tape.reset();
    let result = simd_json::fill_tape(buf, &mut scratch.buffers, &mut tape)
        .map_err(|e| JsonError(e.to_string()))
        .map(|()| {
            let mut pos = 0;
            build(&tape.0, &mut pos, arena)
        });
    let tape: Tape<'static> = tape.reset();
    SCRATCH.with(|s| {
        *s.borrow_mut() = Some(Scratch {
            buffers: scratch.buffers,
            tape,
        })
    });
    result
}

/// Parses a string already in the arena (or borrowed for `'a`): used by
/// `parse_json` on a string source.
pub fn parse_str<'a>(text: &str, arena: &'a Bump) -> Result<Value<'a>, JsonError> {
    parse(text.as_bytes(), arena)
}

fn build<'a>(nodes: &[Node<'a>], pos: &mut usize, arena: &'a Bump) -> Value<'a> {
    let mut out = Value::Null;
    build_into(nodes, pos, arena, &mut out);
    out
}

/// Builds the value at `nodes[*pos]` straight into its slot: each element is
/// written once, where it lives (returning it and copying it into the
/// parent's slot would reload a just-written value, which stalls).
fn build_into<'a>(nodes: &[Node<'a>], pos: &mut usize, arena: &'a Bump, out: &mut Value<'a>) {
    let node = nodes[*pos];
    *pos += 1;
    *out = match node {
        Node::String(s) => Value::Str(s),
        Node::Static(s) => match s {
            StaticNode::Null => Value::Null,
            StaticNode::Bool(b) => Value::Bool(b),
            StaticNode::I64(i) => Value::Int(i),
            StaticNode::U64(u) => i64::try_from(u).map_or(Value::Float(u as f64), Value::Int),
            StaticNode::F64(f) => Value::Float(f),
        },
        Node::Array { len, .. } => {
            let items = arena.alloc_slice_fill_copy(len, Value::Null);
            for item in items.iter_mut() {
                build_into(nodes, pos, arena, item);
            }
            Value::Array(items)
        }
        Node::Object { len, .. } => {
            let members = arena.alloc_slice_fill_copy(len, ("", Value::Null));
            for member in members.iter_mut() {
                if let Node::String(k) = nodes[*pos] {
                    member.0 = k;
                }
                *pos += 1;
                build_into(nodes, pos, arena, &mut member.1);
            }
            Value::Object(dedup_keys(members, arena))
        }
    };
}

/// JSON allows repeated keys; like serde_json, the last one wins. Small objects
/// are checked pairwise, large ones with a map so a hostile body cannot make
/// this quadratic.
fn dedup_keys<'a>(
    members: &'a mut [(&'a str, Value<'a>)],
    arena: &'a Bump,
) -> &'a [(&'a str, Value<'a>)] {
    let has_dup = if members.len() <= 16 {
        members
            .iter()
            .enumerate()
            .any(|(i, (k, _))| members[..i].iter().any(|(j, _)| key_eq(j, k)))
    } else {
        let mut seen = HashMap::with_capacity(members.len());
        members.iter().any(|(k, _)| seen.insert(*k, ()).is_some())
    };
    if !has_dup {
        return members;
    }
    let mut last: HashMap<&str, usize> = HashMap::with_capacity(members.len());
    for (i, (k, _)) in members.iter().enumerate() {
        last.insert(k, i);
    }
    let kept = members
        .iter()
        .enumerate()
        .filter(|(i, (k, _))| last[k] == *i)
        .map(|(_, m)| *m);
    let mut out = bumpalo::collections::Vec::with_capacity_in(last.len(), arena);
    out.extend(kept);
    out.into_bump_slice()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_into_the_arena() {
        let arena = Bump::new();
        let text = br#"{"a": [1, -2, 3.5, "x\"y", null, true], "b": {"c": 18446744073709551615}}"#;
        let v = parse(text, &arena).unwrap();
        assert_eq!(
            v.to_json(),
            json!({"a": [1, -2, 3.5, "x\"y", null, true], "b": {"c": 18446744073709551615.0}})
        );
    }

    #[test]
    fn last_duplicate_key_wins() {
        let arena = Bump::new();
        let v = parse(br#"{"a": 1, "b": 2, "a": 3}"#, &arena).unwrap();
        assert_eq!(v.to_json(), json!({"b": 2, "a": 3}));
    }

    #[test]
    fn reports_bad_json() {
        let arena = Bump::new();
        assert!(parse(b"{\"a\": ", &arena).is_err());
        assert!(parse(b"", &arena).is_err());
        // The scratch buffers survive an error and parse the next input.
        assert_eq!(parse(b"[1]", &arena).unwrap().to_json(), json!([1]));
    }
}
