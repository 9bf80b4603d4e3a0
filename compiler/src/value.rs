//! The engine's JSON value: a `Copy` tree whose strings and containers live in a
//! per-execution `bumpalo` arena (or borrow from a longer-lived owner such as a
//! compiled plan or the request buffer).
//!
//! Why not `serde_json::Value`? Every string and container of a parsed request
//! would be its own heap allocation, and every write would clone. Here a parsed
//! request costs one arena, reads are pointer copies, and writes are persistent
//! (the spine along the written path is copied into the arena; everything else is
//! shared), which also makes "validation never mutates" true by construction.

use bumpalo::Bump;
use std::fmt::Write as _;

/// A JSON value borrowed for `'a` (the arena or a longer-lived owner).
///
/// `repr(C, u64)`: the tag is a whole word and every payload (a `bool`
/// included) sits at offset 8. With the default layout the tag is one byte
/// and a `bool` sits at offset 1, so code that moves a value of unknown
/// variant copies "bytes 1..24" as misaligned pieces; reading those back
/// right after the tag and payload were stored separately defeats store
/// forwarding and stalls (measured: 40 % of the JSONLogic benchmark's time
/// went to such reloads). The tag keeps its niche: `Option<Value>` and
/// `Result<Value, Fail>` are still 24 bytes.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, u64)]
pub enum Value<'a> {
    #[default]
    Null,
    Bool(bool),
    /// An integer that came in as one (kept exact up to i64).
    Int(i64),
    /// Any other number. Arithmetic always produces `Float`.
    Float(f64),
    Str(&'a str),
    Array(&'a [Value<'a>]),
    /// Members in insertion order. Keys are unique (parsers keep the last one).
    Object(&'a [(&'a str, Value<'a>)]),
}

/// Object-key equality without a call to `memcmp`: keys are short, and for
/// them the call costs more than the comparison. Lengths first, then at most
/// two (overlapping) word loads per side; keys over 16 bytes use `==`.
#[inline(always)]
pub fn key_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n >= 8 {
        if n > 16 {
            return a == b;
        }
        let w = |s: &[u8], i: usize| u64::from_ne_bytes(s[i..i + 8].try_into().unwrap_or([0; 8]));
        return w(a, 0) == w(b, 0) && w(a, n - 8) == w(b, n - 8);
    }
    if n >= 4 {
        let w = |s: &[u8], i: usize| u32::from_ne_bytes(s[i..i + 4].try_into().unwrap_or([0; 4]));
        return w(a, 0) == w(b, 0) && w(a, n - 4) == w(b, n - 4);
    }
    // 0..=3 bytes: the first, middle and last byte cover them all.
    n == 0 || (a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1])
}

/// The JSON type name used in messages (`expected string, got number`).
pub fn type_name(v: &Value<'_>) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Int(_) | Value::Float(_) => "number",
        Value::Str(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

impl<'a> Value<'a> {
    pub const EMPTY_OBJECT: Value<'static> = Value::Object(&[]);
    pub const EMPTY_ARRAY: Value<'static> = Value::Array(&[]);

    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }

    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Int(i) => Some(i as f64),
            Value::Float(f) => Some(f),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&'a [Value<'a>]> {
        match *self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn as_object(&self) -> Option<&'a [(&'a str, Value<'a>)]> {
        match *self {
            Value::Object(o) => Some(o),
            _ => None,
        }
    }

    /// Member lookup on an object; `None` for a missing key or a non-object.
    #[inline]
    pub fn get(&self, key: &str) -> Option<Value<'a>> {
        match *self {
            Value::Object(members) => members
                .iter()
                .find(|(k, _)| key_eq(k, key))
                .map(|(_, v)| *v),
            _ => None,
        }
    }

    /// Deep-copies a `serde_json::Value` into the arena. Strings borrow from `json`
    /// (which must outlive the arena's use), containers are allocated in `arena`.
    pub fn from_json(json: &'a serde_json::Value, arena: &'a Bump) -> Value<'a> {
        match json {
            serde_json::Value::Null => Value::Null,
            serde_json::Value::Bool(b) => Value::Bool(*b),
            serde_json::Value::Number(n) => number_from_json(n),
            serde_json::Value::String(s) => Value::Str(s.as_str()),
            serde_json::Value::Array(items) => Value::Array(
                arena.alloc_slice_fill_iter(items.iter().map(|i| Value::from_json(i, arena))),
            ),
            serde_json::Value::Object(map) => Value::Object(
                arena.alloc_slice_fill_iter(
                    map.iter()
                        .map(|(k, v)| (k.as_str(), Value::from_json(v, arena))),
                ),
            ),
        }
    }

    /// Deep-copies a `serde_json::Value` into the arena, strings included, for
    /// values (such as connector responses) that do not outlive the arena.
    pub fn copy_json(json: &serde_json::Value, arena: &'a Bump) -> Value<'a> {
        match json {
            serde_json::Value::String(s) => Value::Str(arena.alloc_str(s)),
            serde_json::Value::Array(items) => Value::Array(
                arena.alloc_slice_fill_iter(items.iter().map(|i| Value::copy_json(i, arena))),
            ),
            serde_json::Value::Object(map) => Value::Object(
                arena.alloc_slice_fill_iter(
                    map.iter()
                        .map(|(k, v)| (&*arena.alloc_str(k), Value::copy_json(v, arena))),
                ),
            ),
            serde_json::Value::Null => Value::Null,
            serde_json::Value::Bool(b) => Value::Bool(*b),
            serde_json::Value::Number(n) => number_from_json(n),
        }
    }

    /// Converts to an owned `serde_json::Value` (for connectors and the edges).
    pub fn to_json(&self) -> serde_json::Value {
        match *self {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => serde_json::Value::Bool(b),
            Value::Int(i) => serde_json::Value::from(i),
            Value::Float(f) => float_to_json(f),
            Value::Str(s) => serde_json::Value::String(s.to_owned()),
            Value::Array(items) => {
                serde_json::Value::Array(items.iter().map(|v| v.to_json()).collect())
            }
            Value::Object(members) => serde_json::Value::Object(
                members
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), v.to_json()))
                    .collect(),
            ),
        }
    }

    /// Serializes as compact JSON text.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        write_compact(self, out);
    }

    /// Serializes as JSON text indented by two spaces.
    pub fn write_json_pretty(&self, out: &mut Vec<u8>) {
        write_value(self, out, Some(2), 0);
    }

    /// Compact JSON text as a `String`.
    pub fn to_json_string(&self) -> String {
        let mut out = Vec::with_capacity(64);
        self.write_json(&mut out);
        // The writer only emits valid UTF-8: strings come from `&str`.
        String::from_utf8(out).unwrap_or_default()
    }
}

pub(crate) fn number_from_json(n: &serde_json::Number) -> Value<'static> {
    if let Some(i) = n.as_i64() {
        Value::Int(i)
    } else {
        Value::Float(n.as_f64().unwrap_or(f64::NAN))
    }
}

/// Integral floats become JSON integers, as JavaScript prints them; NaN and
/// infinities (which JSON cannot carry) become null.
pub fn float_to_json(f: f64) -> serde_json::Value {
    if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
        serde_json::Value::from(f as i64)
    } else {
        serde_json::Number::from_f64(f).map_or(serde_json::Value::Null, serde_json::Value::Number)
    }
}

/// Structural equality as JSON (1 == 1.0; object member order ignored).
impl PartialEq for Value<'_> {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Value::Null, Value::Null) => true,
            (Value::Bool(a), Value::Bool(b)) => a == b,
            (Value::Int(a), Value::Int(b)) => a == b,
            (Value::Int(_) | Value::Float(_), Value::Int(_) | Value::Float(_)) => {
                self.as_f64() == other.as_f64()
            }
            (Value::Str(a), Value::Str(b)) => a == b,
            (Value::Array(a), Value::Array(b)) => a == b,
            (Value::Object(a), Value::Object(b)) => {
                a.len() == b.len() && a.iter().all(|(k, v)| other.get(k).is_some_and(|w| w == *v))
            }
            _ => false,
        }
    }
}

/// The compact writer (every response body goes through it): the indented
/// writer below without its per-member indentation checks.
fn write_compact(v: &Value<'_>, out: &mut Vec<u8>) {
    match *v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Int(i) => out.extend_from_slice(itoa::Buffer::new().format(i).as_bytes()),
        Value::Float(f) => write_float(f, out),
        Value::Str(s) => write_str(s, out),
        Value::Array(items) => {
            let Some((first, rest)) = items.split_first() else {
                out.extend_from_slice(b"[]");
                return;
            };
            out.push(b'[');
            write_compact(first, out);
            for item in rest {
                out.push(b',');
                write_compact(item, out);
            }
            out.push(b']');
        }
        Value::Object(members) => {
            let Some(((k, first), rest)) = members.split_first() else {
                out.extend_from_slice(b"{}");
                return;
            };
            out.push(b'{');
            write_str(k, out);
            out.push(b':');
            write_compact(first, out);
            for (k, item) in rest {
                out.push(b',');
                write_str(k, out);
                out.push(b':');
                write_compact(item, out);
            }
            out.push(b'}');
        }
    }
}

fn write_value(v: &Value<'_>, out: &mut Vec<u8>, indent: Option<usize>, depth: usize) {
    match *v {
        // Scalars print the same either way.
        Value::Null | Value::Bool(_) | Value::Int(_) | Value::Float(_) | Value::Str(_) => {
            write_compact(v, out)
        }
        Value::Array(items) => {
            if items.is_empty() {
                out.extend_from_slice(b"[]");
                return;
            }
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                newline(out, indent, depth + 1);
                write_value(item, out, indent, depth + 1);
            }
            newline(out, indent, depth);
            out.push(b']');
        }
        Value::Object(members) => {
            if members.is_empty() {
                out.extend_from_slice(b"{}");
                return;
            }
            out.push(b'{');
            for (i, (k, item)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                newline(out, indent, depth + 1);
                write_str(k, out);
                out.push(b':');
                if indent.is_some() {
                    out.push(b' ');
                }
                write_value(item, out, indent, depth + 1);
            }
            newline(out, indent, depth);
            out.push(b'}');
        }
    }
}

fn newline(out: &mut Vec<u8>, indent: Option<usize>, depth: usize) {
    if let Some(width) = indent {
        out.push(b'\n');
        out.resize(out.len() + width * depth, b' ');
    }
}

/// Writes a float the way JavaScript's `JSON.stringify` does (shortest
/// round-trip form, integral values without a fraction, non-finite as null).
pub fn write_float(f: f64, out: &mut Vec<u8>) {
    if !f.is_finite() {
        out.extend_from_slice(b"null");
    } else if f.fract() == 0.0 && f.abs() < 1e16 {
        // Exact: every integral float below 1e16 fits an i64.
        out.extend_from_slice(itoa::Buffer::new().format(f as i64).as_bytes());
    } else {
        let mut buf = zmij::Buffer::new();
        let text = buf.format_finite(f).as_bytes();
        // zmij writes a positive exponent as `e+21`; JavaScript (and ryu,
        // which this output matched before) as `e21`. Only magnitudes from
        // 1e16 up have a positive exponent; the search is skipped below.
        let plus = if f.abs() >= 1e16 {
            text.iter().position(|&b| b == b'+')
        } else {
            None
        };
        match plus {
            Some(plus) => {
                out.extend_from_slice(&text[..plus]);
                out.extend_from_slice(&text[plus + 1..]);
            }
            None => out.extend_from_slice(text),
        }
    }
}

/// Formats a number as JavaScript's `String(n)` would, for `cat` and friends.
pub fn format_number(f: f64, out: &mut String) {
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    } else if f.fract() == 0.0 && f.abs() < 1e21 {
        let _ = write!(out, "{}", f as i128);
    } else {
        let mut buf = Vec::new();
        write_float(f, &mut buf);
        out.push_str(std::str::from_utf8(&buf).unwrap_or_default());
    }
}

/// Flags (bit 7 of each byte) the bytes of `w` that must be escaped in a
/// JSON string: control bytes (< 0x20), `"` and `\`; bytes ≥ 0x80 (UTF-8)
/// never match. The lowest flag is exact (borrows only run upwards, so a
/// spurious flag can only sit above a real one), which is all we use.
#[inline(always)]
fn escape_mask(w: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let below = |x: u64, n: u64| x.wrapping_sub(ONES * n) & !x & HIGH;
    below(w, 0x20) | below(w ^ (ONES * b'"' as u64), 1) | below(w ^ (ONES * b'\\' as u64), 1)
}

/// The bytes of `b` (fewer than eight) as a little-endian word padded with
/// spaces, from at most two overlapping loads (no byte loop, no `memcpy`).
#[inline(always)]
fn load_partial(b: &[u8]) -> u64 {
    const SPACES: u64 = u64::from_le_bytes([b' '; 8]);
    let n = b.len();
    let w = if n >= 4 {
        let lo = u32::from_le_bytes(b[..4].try_into().unwrap_or_default());
        let hi = u32::from_le_bytes(b[n - 4..].try_into().unwrap_or_default());
        u64::from(lo) | (u64::from(hi) << (8 * (n - 4)))
    } else if n >= 2 {
        let lo = u16::from_le_bytes(b[..2].try_into().unwrap_or_default());
        let hi = u16::from_le_bytes(b[n - 2..].try_into().unwrap_or_default());
        u64::from(lo) | (u64::from(hi) << (8 * (n - 2)))
    } else if n == 1 {
        u64::from(b[0])
    } else {
        0
    };
    w | SPACES.checked_shl(8 * n as u32).unwrap_or(0)
}

/// Writes `s` as a JSON string, eight bytes at a time: each step loads a
/// word (the tail padded with spaces), appends all eight bytes (a fixed-size
/// store, no `memcpy` call) and trims what does not belong: the padding, or
/// everything from the first byte that needs an escape, which is written
/// next.
fn write_str(s: &str, out: &mut Vec<u8>) {
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 10);
    out.push(b'"');
    let mut i = 0;
    while i < bytes.len() {
        let (w, n) = match bytes.get(i..i + 8) {
            Some(chunk) => (u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8])), 8),
            None => (load_partial(&bytes[i..]), bytes.len() - i),
        };
        let mask = escape_mask(w);
        // Bytes of this word that are copied as they are.
        let keep = if mask == 0 {
            n
        } else {
            (mask.trailing_zeros() / 8) as usize
        };
        let len = out.len();
        out.extend_from_slice(&w.to_le_bytes());
        out.truncate(len + keep);
        if keep < n {
            write_escape(bytes[i + keep], out);
            i += keep + 1;
        } else {
            i += n;
        }
    }
    out.push(b'"');
}

#[cold]
fn write_escape(b: u8, out: &mut Vec<u8>) {
    let short: &[u8] = match b {
        b'"' => b"\\\"",
        b'\\' => b"\\\\",
        b'\n' => b"\\n",
        b'\r' => b"\\r",
        b'\t' => b"\\t",
        0x08 => b"\\b",
        0x0c => b"\\f",
        _ => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[(b >> 4) as usize],
                HEX[(b & 0xf) as usize],
            ]);
            return;
        }
    };
    out.extend_from_slice(short);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strings_are_escaped_in_every_position() {
        // Each special byte at every offset of a string longer than one
        // eight-byte chunk, against serde_json's escaping.
        for special in [
            '"', '\\', '\n', '\r', '\t', '\u{8}', '\u{c}', '\u{0}', '\u{1f}', 'é', '\u{7f}',
        ] {
            for at in 0..20 {
                let mut text: String = "abcdefghijklmnopqrs".into();
                text.insert(at, special);
                let mut out = Vec::new();
                Value::Str(&text).write_json(&mut out);
                let back: String = serde_json::from_slice(&out).unwrap();
                assert_eq!(back, text);
                assert_eq!(out, serde_json::to_vec(&text).unwrap(), "{text:?}");
            }
        }
    }

    #[test]
    fn key_eq_matches_str_eq() {
        let keys = [
            "",
            "a",
            "b",
            "ab",
            "ba",
            "abc",
            "abd",
            "xbc",
            "abcd",
            "abce",
            "abcde",
            "abcdf",
            "bbcde",
            "abcdefg",
            "abcdefh",
            "abcdefgh",
            "abcdefgi",
            "bbcdefgh",
            "abcdefghi",
            "abcdefghijklmnop",
            "abcdefghijklmnoq",
            "abcdefghijklmnopq",
            "abcdefghijklmnopr",
            "é",
            "ée",
        ];
        for a in keys {
            for b in keys {
                assert_eq!(key_eq(a, b), a == b, "{a:?} vs {b:?}");
            }
        }
    }

    #[test]
    fn value_stays_three_words() {
        assert_eq!(size_of::<Value>(), 24);
        assert_eq!(size_of::<Option<Value>>(), 24);
    }

    #[test]
    fn round_trips_through_serde_json() {
        let arena = Bump::new();
        let src = json!({"a": [1, 2.5, "x\n\"y\"", null, true], "b": {"c": -3}, "d": "\u{1}é"});
        let v = Value::from_json(&src, &arena);
        assert_eq!(v.to_json(), src);
        let text = v.to_json_string();
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, src);
    }

    #[test]
    fn floats_print_like_javascript() {
        let mut out = Vec::new();
        Value::Float(20.0).write_json(&mut out);
        out.push(b' ');
        Value::Float(905.502).write_json(&mut out);
        out.push(b' ');
        Value::Float(f64::NAN).write_json(&mut out);
        assert_eq!(String::from_utf8(out).unwrap(), "20 905.502 null");
    }

    #[test]
    fn exponents_print_like_javascript() {
        let cases = [
            (1e16, "1e16"),
            (1.2345678901234568e17, "1.2345678901234568e17"),
            (1.7976931348623157e308, "1.7976931348623157e308"),
            (-3.0009e23, "-3.0009e23"),
            (1e-7, "1e-7"),
            (2.5e-5, "0.000025"),
            (-5e-324, "-5e-324"),
            (9007199254740993.0, "9007199254740992"),
            (0.1, "0.1"),
            (150.917, "150.917"),
        ];
        for (f, text) in cases {
            let mut out = Vec::new();
            write_float(f, &mut out);
            assert_eq!(String::from_utf8(out).unwrap(), text, "{f:e}");
            // serde_json reads every form back to the same number.
            assert_eq!(serde_json::from_str::<f64>(text).unwrap(), f, "{text}");
        }
    }

    #[test]
    fn strings_are_escaped_like_serde_json_at_every_length_and_position() {
        for len in 0..24 {
            let plain: String = "abcdéfghijklmnopqrstuvwxyz".chars().take(len).collect();
            let mut out = Vec::new();
            write_str(&plain, &mut out);
            assert_eq!(out, serde_json::to_vec(&plain).unwrap());
            for at in 0..=plain.chars().count() {
                for special in ['"', '\\', '\n', '\u{1}', '\u{1f}', '\t'] {
                    let mut s: String = plain.chars().take(at).collect();
                    s.push(special);
                    s.extend(plain.chars().skip(at));
                    let mut out = Vec::new();
                    write_str(&s, &mut out);
                    assert_eq!(out, serde_json::to_vec(&s).unwrap(), "{s:?}");
                }
            }
        }
    }

    #[test]
    fn compact_and_pretty_output_hold_the_same_json() {
        let arena = Bump::new();
        let src = json!({"a": [1, 2.5, "x\"y\n", null, true, [], {}], "b": {"c": {"d": [false]}}, "": -1.5e300});
        let v = Value::from_json(&src, &arena);
        let (mut compact, mut pretty) = (Vec::new(), Vec::new());
        v.write_json(&mut compact);
        v.write_json_pretty(&mut pretty);
        let compact: serde_json::Value = serde_json::from_slice(&compact).unwrap();
        let pretty: serde_json::Value = serde_json::from_slice(&pretty).unwrap();
        assert_eq!(compact, src);
        assert_eq!(pretty, src);
    }

    #[test]
    fn pretty_output_is_indented() {
        let arena = Bump::new();
        let src = json!({"a": [1], "b": {}});
        let mut out = Vec::new();
        Value::from_json(&src, &arena).write_json_pretty(&mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\n  \"a\": [\n    1\n  ],\n  \"b\": {}\n}"
        );
    }

    #[test]
    fn equality_ignores_member_order_and_number_kind() {
        let arena = Bump::new();
        let a = json!({"x": 1, "y": [true]});
        let b = json!({"y": [true], "x": 1.0});
        assert_eq!(Value::from_json(&a, &arena), Value::from_json(&b, &arena));
    }
}
