//! Equality and ordering with the coercions of JavaScript's `==` / `<`, as
//! tightened by the compat-tables: comparing a number with a non-numeric
//! string, or a collection with a scalar, is a NaN error instead of `false`.

use super::{parse_js_number, to_number};
use crate::value::Value;
use std::cmp::Ordering;

/// Loose (`==`) equality. `Err(())` means the compat-tables' NaN error.
///
/// Table (symmetric): same types compare directly (numbers numerically);
/// number/string parses the string; number/bool and string/bool compare as
/// numbers; `null` equals `0` and `false` (the tables require `null == 0`)
/// and no string; two arrays or two objects are equal when structurally
/// equal; every other collection comparison is an error, except against
/// `null`, which is simply unequal.
pub(crate) fn loose_eq_checked(a: &Value<'_>, b: &Value<'_>) -> Result<bool, ()> {
    use Value::*;
    Ok(match (*a, *b) {
        (Null, Null) => true,
        (Bool(x), Bool(y)) => x == y,
        (Str(x), Str(y)) => x == y,
        (Int(x), Int(y)) => x == y,
        (Int(_) | Float(_), Int(_) | Float(_)) => a.as_f64() == b.as_f64(),
        (Int(_) | Float(_) | Bool(_), Str(s)) | (Str(s), Int(_) | Float(_) | Bool(_)) => {
            let n = if matches!(a, Str(_)) { b } else { a };
            parse_js_number(s).ok_or(())? == to_number(n).ok_or(())?
        }
        (Int(_) | Float(_), Bool(_)) | (Bool(_), Int(_) | Float(_)) => to_number(a) == to_number(b),
        (Null, Int(_) | Float(_) | Bool(_)) | (Int(_) | Float(_) | Bool(_), Null) => {
            to_number(a) == to_number(b)
        }
        (Null, _) | (_, Null) => false,
        (Array(_), Array(_)) | (Object(_), Object(_)) if a == b => true,
        _ => return Err(()),
    })
}

/// JavaScript-style `==` as a plain predicate: the cases the operator reports
/// as a NaN error (e.g. `1 == "A"`) are simply unequal, as NaN is in JavaScript.
pub fn loose_eq(a: &Value<'_>, b: &Value<'_>) -> bool {
    loose_eq_checked(a, b).unwrap_or(false)
}

/// Strict (`===`) equality: same JSON type and equal value; numbers compare
/// numerically (`1 === 1.0`), containers structurally.
pub fn strict_eq(a: &Value<'_>, b: &Value<'_>) -> bool {
    match (a, b) {
        (Value::Str(x), Value::Str(y)) => x == y,
        (Value::Int(x), Value::Int(y)) => x == y,
        _ => a == b,
    }
}

/// The ordering operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rel {
    Lt,
    Le,
    Gt,
    Ge,
}

impl Rel {
    #[inline]
    fn holds(self, ord: Option<Ordering>) -> bool {
        match ord {
            None => false,
            Some(o) => match self {
                Rel::Lt => o == Ordering::Less,
                Rel::Le => o != Ordering::Greater,
                Rel::Gt => o == Ordering::Greater,
                Rel::Ge => o != Ordering::Less,
            },
        }
    }
}

/// `a <rel> b`. Two strings compare as JavaScript does (UTF-16 code units);
/// otherwise both sides are coerced to numbers, and a collection or an
/// unparseable string is a NaN error (`Err(())`).
#[inline]
pub(crate) fn relate(a: &Value<'_>, b: &Value<'_>, rel: Rel) -> Result<bool, ()> {
    let ord = match (*a, *b) {
        (Value::Int(x), Value::Int(y)) => Some(x.cmp(&y)),
        (Value::Str(x), Value::Str(y)) => Some(js_str_cmp(x, y)),
        _ => {
            let x = to_number(a).ok_or(())?;
            let y = to_number(b).ok_or(())?;
            x.partial_cmp(&y)
        }
    };
    Ok(rel.holds(ord))
}

/// JavaScript orders strings by UTF-16 code units. Byte order agrees unless
/// both strings reach a differing non-ASCII pair, so only then re-encode.
fn js_str_cmp(a: &str, b: &str) -> Ordering {
    if a.is_ascii() || b.is_ascii() {
        a.cmp(b)
    } else {
        a.encode_utf16().cmp(b.encode_utf16())
    }
}
