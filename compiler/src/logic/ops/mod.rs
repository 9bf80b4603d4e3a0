//! Value semantics shared by the interpreter and the constant folder:
//! truthiness, JavaScript-style numeric coercion and number formatting.

pub(crate) mod compare;
pub(crate) mod string;

use crate::value::Value;

/// JSONLogic truthiness (JavaScript's, except that an empty array is falsy):
/// `null`, `false`, `0`, `""` and `[]` are falsy; `"0"` and `{}` are truthy.
#[inline]
pub fn truthy(v: &Value<'_>) -> bool {
    match *v {
        Value::Null => false,
        Value::Bool(b) => b,
        Value::Int(i) => i != 0,
        Value::Float(f) => f != 0.0 && !f.is_nan(),
        Value::Str(s) => !s.is_empty(),
        Value::Array(items) => !items.is_empty(),
        Value::Object(_) => true,
    }
}

/// [`truthy`] for an owned constant.
pub(crate) fn truthy_json(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => false,
        serde_json::Value::Bool(b) => *b,
        serde_json::Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        serde_json::Value::String(s) => !s.is_empty(),
        serde_json::Value::Array(items) => !items.is_empty(),
        serde_json::Value::Object(_) => true,
    }
}

/// Numeric coercion for arithmetic and ordering: numbers as they are, `null`
/// as 0, booleans as 0/1, strings parsed like JavaScript's `Number()`.
/// `None` (a NaN error) for unparseable strings, arrays and objects — the
/// compat-tables treat `[1] + 1` as NaN rather than JavaScript's coercion.
#[inline]
pub(crate) fn to_number(v: &Value<'_>) -> Option<f64> {
    match *v {
        Value::Int(i) => Some(i as f64),
        Value::Float(f) => Some(f),
        Value::Null => Some(0.0),
        Value::Bool(b) => Some(if b { 1.0 } else { 0.0 }),
        Value::Str(s) => parse_js_number(s),
        Value::Array(_) | Value::Object(_) => None,
    }
}

/// JavaScript's `Number(v)` for any value, NaN included: an array reads as
/// its string form (`[]` is 0, `[1]` and `["1"]` are 1, `[true]` and
/// `[1, 2]` are NaN), an object as NaN. For the operators that take a
/// count or an index the way JavaScript coerces it (`substr`,
/// `missing_some`); arithmetic refuses arrays instead (the compat-tables'
/// `NaN` error).
pub(crate) fn js_number(v: &Value<'_>) -> f64 {
    match *v {
        Value::Array([]) => 0.0,
        Value::Array([one]) => match one {
            Value::Null => 0.0,
            Value::Bool(_) | Value::Object(_) => f64::NAN,
            other => js_number(other),
        },
        Value::Array(_) | Value::Object(_) => f64::NAN,
        _ => to_number(v).unwrap_or(f64::NAN),
    }
}

/// JavaScript's `Number(string)`: surrounding whitespace ignored, empty means
/// 0, decimal with optional sign and exponent, `0x`/`0o`/`0b` integers and
/// `Infinity`. Rust's float parser alone would also accept `inf` and `NaN`.
pub(crate) fn parse_js_number(s: &str) -> Option<f64> {
    let t = s.trim();
    if t.is_empty() {
        return Some(0.0);
    }
    let b = t.as_bytes();
    if b.len() > 2 && b[0] == b'0' {
        let radix = match b[1] {
            b'x' | b'X' => 16,
            b'o' | b'O' => 8,
            b'b' | b'B' => 2,
            _ => 0,
        };
        if radix != 0 {
            let mut acc = 0f64;
            for &c in &b[2..] {
                acc = acc * f64::from(radix) + f64::from((c as char).to_digit(radix)?);
            }
            return Some(acc);
        }
    }
    let unsigned = t.strip_prefix(['+', '-']).unwrap_or(t);
    if unsigned == "Infinity" {
        return Some(if b[0] == b'-' {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        });
    }
    if !b
        .iter()
        .all(|c| c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'E' | b'+' | b'-'))
    {
        return None;
    }
    t.parse().ok()
}
