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
    parse_sized(input, arena).map(|(v, _)| v)
}

/// [`parse`], with a bound on the result's size counted as a tree
/// ([`Value::tree_size_within`]): a `Value` per node of the parser's tape
/// (keys included) and the text's length, which holds every string and
/// key. Known without walking the result.
pub fn parse_sized<'a>(input: &[u8], arena: &'a Bump) -> Result<(Value<'a>, usize), JsonError> {
    let buf: &'a mut [u8] = arena.alloc_slice_copy(input);
    SCRATCH.with(|cell| {
        // Borrowed for this parse only (nothing in it parses again); the
        // buffers stay in place, only the tape's vector is moved out (its
        // lifetime changes) and back.
        let mut slot = cell.borrow_mut();
        let scratch = slot.get_or_insert_with(|| Scratch {
            buffers: Buffers::new(input.len()),
            tape: Tape(Vec::new()),
        });
        let mut tape: Tape<'a> = Tape(std::mem::take(&mut scratch.tape.0)).reset();
        let result = simd_json::fill_tape(buf, &mut scratch.buffers, &mut tape)
            .map_err(|e| explain(input, &e))
            .map(|()| {
                let mut pos = 0;
                let size = tape.0.len() * size_of::<Value>() + input.len();
                (build(&tape.0, &mut pos, arena), size)
            });
        scratch.tape = tape.reset();
        result
    })
}

/// Why `input` is not JSON, for people: simd-json's errors name an internal
/// kind and a byte offset that is often not where the problem is
/// (`InternalError at character 17`), so the error path parses once more
/// with serde_json for its message (`trailing comma at line 1 column 18`).
/// simd-json's own text stays when serde_json would not say more: it
/// accepts the text, or stops at its own nesting limit (128 levels, which
/// simd-json does not have).
#[cold]
#[inline(never)]
fn explain(input: &[u8], simd: &simd_json::Error) -> JsonError {
    if matches!(simd.error(), simd_json::ErrorType::DepthLimitExceeded) {
        return JsonError(format!(
            "nested deeper than 1024 levels (at byte {})",
            simd.index()
        ));
    }
    // Into a tree, not `IgnoredAny`, which takes any number and so cannot
    // say that `1e400` is out of range.
    match serde_json::from_slice::<serde_json::Value>(input) {
        Err(e) if !e.to_string().starts_with("recursion limit exceeded") => {
            JsonError(e.to_string())
        }
        _ => JsonError(simd.to_string()),
    }
}

/// Parses a string already in the arena (or borrowed for `'a`): used by
/// `parse_json` on a string source.
pub fn parse_str<'a>(text: &str, arena: &'a Bump) -> Result<Value<'a>, JsonError> {
    parse(text.as_bytes(), arena)
}

/// [`parse_str`] with [`parse_sized`]'s bound.
pub fn parse_str_sized<'a>(text: &str, arena: &'a Bump) -> Result<(Value<'a>, usize), JsonError> {
    parse_sized(text.as_bytes(), arena)
}

fn build<'a>(nodes: &[Node<'a>], pos: &mut usize, arena: &'a Bump) -> Value<'a> {
    let mut out = Value::Null;
    let node = nodes[*pos];
    *pos += 1;
    element(nodes, pos, arena, node, &mut out);
    out
}

/// Builds the value of `node` (taken from `nodes`, whose next unread node is
/// at `*pos`) straight into its slot: each element is written once, where it
/// lives (returning it and copying it into the parent's slot would reload a
/// just-written value, which stalls). Scalars are converted inline, in the
/// containers' loops; only containers cost a call.
#[inline(always)]
fn element<'a>(
    nodes: &[Node<'a>],
    pos: &mut usize,
    arena: &'a Bump,
    node: Node<'a>,
    out: &mut Value<'a>,
) {
    *out = match node {
        Node::String(s) => Value::Str(s),
        Node::Static(s) => match s {
            StaticNode::Null => Value::Null,
            StaticNode::Bool(b) => Value::Bool(b),
            StaticNode::I64(i) => Value::Int(i),
            StaticNode::U64(u) => i64::try_from(u).map_or(Value::Float(u as f64), Value::Int),
            StaticNode::F64(f) => Value::Float(f),
        },
        Node::Array { len, .. } => return array(nodes, pos, arena, len, out),
        Node::Object { len, .. } => return object(nodes, pos, arena, len, out),
    };
}

#[inline(never)]
fn array<'a>(
    nodes: &[Node<'a>],
    pos: &mut usize,
    arena: &'a Bump,
    len: usize,
    out: &mut Value<'a>,
) {
    let items = arena.alloc_slice_fill_copy(len, Value::Null);
    for item in items.iter_mut() {
        let node = nodes[*pos];
        *pos += 1;
        element(nodes, pos, arena, node, item);
    }
    *out = Value::Array(items);
}

#[inline(never)]
fn object<'a>(
    nodes: &[Node<'a>],
    pos: &mut usize,
    arena: &'a Bump,
    len: usize,
    out: &mut Value<'a>,
) {
    let members = arena.alloc_slice_fill_copy(len, ("", Value::Null));
    // Duplicate keys are looked for only when a 64-bit filter over the keys
    // (their length and end bytes) has a collision, or in large objects.
    let (mut seen, mut collision) = (0u64, false);
    for member in members.iter_mut() {
        if let Node::String(k) = nodes[*pos] {
            member.0 = k;
            let bit = 1u64 << key_filter_bit(k);
            collision |= seen & bit != 0;
            seen |= bit;
        }
        let node = nodes[*pos + 1];
        *pos += 2;
        element(nodes, pos, arena, node, &mut member.1);
    }
    *out = Value::Object(if collision || len > 16 {
        dedup_keys(members, arena)
    } else {
        members
    });
}

/// JSON allows repeated keys; like serde_json, the last one wins. Small objects
/// are checked pairwise, large ones with a map so a hostile body cannot make
/// this quadratic.
#[cold]
#[inline(never)]
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

/// The key's bit (0..64) in the duplicate filter: its length and first and
/// last bytes, mixed by a multiplication. Equal keys get equal bits.
#[inline(always)]
fn key_filter_bit(k: &str) -> u32 {
    let b = k.as_bytes();
    let (first, last) = match b {
        [] => (0, 0),
        [first, .., last] => (*first, *last),
        [one] => (*one, *one),
    };
    let mixed = (b.len() as u64 | u64::from(first) << 32 | u64::from(last) << 40)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (mixed >> 58) as u32
}

/// The deepest request body the executor parses (simd-json's limit).
pub const MAX_BODY_NESTING: usize = simd_json::DEFAULT_MAX_DEPTH;

/// Whether the JSON text's arrays and objects nest at most `max` levels (a
/// byte scan that skips strings; the text's validity is not checked).
pub fn nests_within(text: &[u8], max: usize) -> bool {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &b in text {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return false;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    true
}

/// Parses JSON text into a `serde_json::Value` nested up to `max` levels.
/// serde_json's own limit (128) is lifted only after the scan has bounded
/// the depth, so the recursive parse (and the value's drop) stays within a
/// runtime thread's stack. Used where the sync path's limits must hold too:
/// async submissions (`MAX_BODY_NESTING`, as simd-json gives sync requests)
/// and stored trace data (`exec::MAX_NESTING`, what an execution can build).
pub fn to_serde(text: &[u8], max: usize) -> Result<serde_json::Value, String> {
    if !nests_within(text, max) {
        return Err(format!("JSON nests deeper than {max} levels"));
    }
    let mut de = serde_json::Deserializer::from_slice(text);
    de.disable_recursion_limit();
    let value = serde::Deserialize::deserialize(&mut de).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    Ok(value)
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

    /// Objects of every size up to 20 (both sides of the pairwise/map
    /// switch at 16) with one key repeated from every position to every
    /// later one: the last value wins, at the place of the last occurrence,
    /// as a plain scan says.
    #[test]
    fn duplicates_are_found_in_objects_of_every_size() {
        for n in 1..=20usize {
            for from in 0..n {
                for to in from + 1..=n {
                    let mut keys: Vec<String> = (0..n).map(|i| format!("key{i}")).collect();
                    keys.insert(to, keys[from].clone());
                    let text = format!(
                        "{{{}}}",
                        keys.iter()
                            .enumerate()
                            .map(|(i, k)| format!("\"{k}\": {i}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                    let expected: Vec<(&str, i64)> = keys
                        .iter()
                        .enumerate()
                        .filter(|(i, k)| !keys[i + 1..].contains(k))
                        .map(|(i, k)| (k.as_str(), i as i64))
                        .collect();
                    let arena = Bump::new();
                    let v = parse(text.as_bytes(), &arena).unwrap();
                    let got: Vec<(&str, i64)> = v
                        .as_object()
                        .unwrap()
                        .iter()
                        .map(|(k, v)| match v {
                            Value::Int(i) => (*k, *i),
                            _ => panic!("{v:?}"),
                        })
                        .collect();
                    assert_eq!(got, expected, "{text}");
                }
            }
        }
    }

    /// Keys that share the duplicate filter's inputs (length, first and last
    /// byte) but differ are all kept; equal keys of every length are found.
    #[test]
    fn keys_alike_at_the_ends_are_not_duplicates() {
        let arena = Bump::new();
        let v = parse(br#"{"axb": 1, "ayb": 2, "azb": 3, "a": 4, "": 5}"#, &arena).unwrap();
        assert_eq!(v.as_object().unwrap().len(), 5);
        for len in 0..40 {
            let k = "q".repeat(len);
            let text = format!(r#"{{"{k}": 1, "other": 2, "{k}": 3}}"#);
            let v = parse(text.as_bytes(), &arena).unwrap();
            assert_eq!(v.to_json(), json!({"other": 2, k: 3}), "{text}");
        }
    }

    /// Nested containers of every kind under objects and arrays.
    #[test]
    fn nested_values_come_out_whole() {
        let arena = Bump::new();
        let text = br#"[{"a": [[], {}, [1, [2, {"b": null}]]], "c": {"d": {"e": [true, false]}}}, "s", -0.5, [{}]]"#;
        let v = parse(text, &arena).unwrap();
        let expected: serde_json::Value = serde_json::from_slice(text).unwrap();
        assert_eq!(v.to_json(), expected);
        assert_eq!(v.to_json_string(), expected.to_string());
    }

    #[test]
    fn reports_bad_json() {
        let arena = Bump::new();
        assert!(parse(b"{\"a\": ", &arena).is_err());
        assert!(parse(b"", &arena).is_err());
        // The scratch buffers survive an error and parse the next input.
        assert_eq!(parse(b"[1]", &arena).unwrap().to_json(), json!([1]));
    }

    #[test]
    fn serde_parse_is_bounded_by_a_scan_not_by_128() {
        let nested = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
        let deep = to_serde(nested(500).as_bytes(), 1024).unwrap();
        let mut v = &deep;
        let mut depth = 0;
        while let Some(inner) = v.get(0) {
            depth += 1;
            v = inner;
        }
        assert_eq!(depth, 500);
        assert_eq!(
            to_serde(nested(1025).as_bytes(), 1024).unwrap_err(),
            "JSON nests deeper than 1024 levels"
        );
        // Brackets inside strings do not count; escaped quotes stay inside.
        let text = format!(r#"{{"a": "{}\"[[", "b": [[1]]}}"#, "[".repeat(2000));
        assert!(nests_within(text.as_bytes(), 3));
        assert!(!nests_within(text.as_bytes(), 2));
        assert!(to_serde(b"[1] x", 10).is_err());
    }
}

#[cfg(test)]
mod messages {
    use super::*;

    fn error(text: &str) -> String {
        parse(text.as_bytes(), &Bump::new()).unwrap_err().0
    }

    /// Errors name the problem and where it is, as serde_json does, not
    /// simd-json's internal kind and offset.
    #[test]
    fn errors_say_what_and_where() {
        for (text, message) in [
            (r#"{"a": 1,}"#, "trailing comma at line 1 column 9"),
            (r#"{"a": [1 2]}"#, "expected `,` or `]` at line 1 column 10"),
            (r#"{"a": tru}"#, "expected ident at line 1 column 10"),
            (
                "{\"a\": \"abc",
                "EOF while parsing a string at line 1 column 10",
            ),
            (r#"{"a": "\x"}"#, "invalid escape at line 1 column 9"),
            (r#"{"a": 1} x"#, "trailing characters at line 1 column 10"),
            ("{\n  \"a\": 01\n}", "invalid number at line 2 column 9"),
        ] {
            assert_eq!(error(text), message, "{text}");
        }
    }

    /// Integers beyond 64 bits are valid JSON: they are read as doubles, as
    /// JavaScript and serde_json read them (they were refused with
    /// simd-json's "InvalidNumber"); a double beyond the range is refused
    /// with serde_json's account.
    #[test]
    fn integers_beyond_64_bits_are_doubles() {
        let arena = Bump::new();
        for (text, want) in [
            ("12345678901234567890123", 1.2345678901234568e22),
            ("-9223372036854775809", -9.223372036854776e18),
            ("18446744073709551616", 1.8446744073709552e19),
        ] {
            match parse(text.as_bytes(), &arena) {
                Ok(Value::Float(f)) => assert_eq!(f, want, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        assert_eq!(error("[1e400]"), "number out of range at line 1 column 6");
    }

    #[test]
    fn deep_text_is_named_as_such() {
        let deep = format!("{}{}", "[".repeat(2000), "]".repeat(2000));
        assert_eq!(
            error(&deep),
            "nested deeper than 1024 levels (at byte 1024)"
        );
        // Deeper than serde_json's 128 levels but within simd-json's: the
        // message comes from simd-json, not serde_json's recursion limit.
        let broken = format!("{}1 2{}", "[".repeat(200), "]".repeat(200));
        let e = error(&broken);
        assert!(!e.contains("recursion limit"), "{e}");
    }
}
