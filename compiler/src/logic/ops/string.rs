//! String conversions as JavaScript performs them (`String(x)` for `cat`,
//! `in` and `substr`) and the index math of `substr`.

use crate::value::Value;
use std::fmt::{self, Write};

/// Writes `f` as JavaScript's `Number.prototype.toString()` would: integers
/// without a fraction, decimal notation for 1e-7 < |f| < 1e21, exponent
/// notation (`1e+21`, `1.5e-7`) outside it.
pub(crate) fn write_js_number(f: f64, out: &mut impl Write) -> fmt::Result {
    if f.is_nan() {
        return out.write_str("NaN");
    }
    if f.is_infinite() {
        return out.write_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    }
    if f == 0.0 {
        return out.write_char('0');
    }
    // Below 2^53 an integral double is its own shortest digits; above, the
    // shortest digits padded with zeros (`String(1.1e20)` is
    // "110000000000000020000", not the binary value's 110000000000000016384).
    if f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0 {
        return out.write_str(itoa::Buffer::new().format(f as i64));
    }
    // ryu gives the shortest round-trip digits; re-lay them out per the
    // ECMAScript Number::toString algorithm (digits d, point position n).
    let mut ryu_buf = ryu::Buffer::new();
    let text = ryu_buf.format_finite(f.abs());
    let (mantissa, exp) = match text.find(['e', 'E']) {
        Some(i) => (&text[..i], text[i + 1..].parse::<i32>().unwrap_or(0)),
        None => (text, 0),
    };
    let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let mut digits = [0u8; 40];
    let mut k = 0;
    let mut leading = 0i32;
    for &c in int_part.as_bytes().iter().chain(frac_part.as_bytes()) {
        if k == 0 && c == b'0' {
            leading += 1;
            continue;
        }
        if k < digits.len() {
            digits[k] = c;
            k += 1;
        }
    }
    while k > 1 && digits[k - 1] == b'0' {
        k -= 1;
    }
    let digits = std::str::from_utf8(&digits[..k]).unwrap_or("0");
    let n = int_part.len() as i32 + exp - leading;
    let k = k as i32;
    if f < 0.0 {
        out.write_char('-')?;
    }
    if k <= n && n <= 21 {
        out.write_str(digits)?;
        for _ in 0..(n - k) {
            out.write_char('0')?;
        }
    } else if 0 < n && n <= 21 {
        out.write_str(&digits[..n as usize])?;
        out.write_char('.')?;
        out.write_str(&digits[n as usize..])?;
    } else if -6 < n && n <= 0 {
        out.write_str("0.")?;
        for _ in 0..(-n) {
            out.write_char('0')?;
        }
        out.write_str(digits)?;
    } else {
        let e = n - 1;
        out.write_str(&digits[..1])?;
        if k > 1 {
            out.write_char('.')?;
            out.write_str(&digits[1..])?;
        }
        write!(
            out,
            "e{}{}",
            if e < 0 { '-' } else { '+' },
            e.unsigned_abs()
        )?;
    }
    Ok(())
}

/// Writes `v` as JavaScript's `String(v)`, except that `null` at the top level
/// writes `null_text` (`cat` drops nulls, `in` searches for `"null"`). Arrays
/// join their items with `,` (nulls inside as empty), objects are
/// `[object Object]`.
pub(crate) fn write_js_string(v: &Value<'_>, null_text: &str, out: &mut impl Write) -> fmt::Result {
    match *v {
        Value::Null => out.write_str(null_text),
        Value::Bool(b) => out.write_str(if b { "true" } else { "false" }),
        Value::Int(i) => out.write_str(itoa::Buffer::new().format(i)),
        Value::Float(f) => write_js_number(f, out),
        Value::Str(s) => out.write_str(s),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.write_char(',')?;
                }
                write_js_string(item, "", out)?;
            }
            Ok(())
        }
        Value::Object(_) => out.write_str("[object Object]"),
    }
}

/// The byte range of `substr(s, start, len)` as JSONLogic defines it over
/// characters: a negative `start` counts from the end, a negative `len`
/// stops that many characters before the end, everything clamped to the
/// string (so no index math can overflow or allocate).
pub(crate) fn substr_range(s: &str, start: f64, len: Option<f64>) -> (usize, usize) {
    let count = if s.is_ascii() {
        s.len()
    } else {
        s.chars().count()
    };
    let count_f = count as f64;
    let start = if start.is_nan() { 0.0 } else { start.trunc() };
    let from = if start < 0.0 {
        (count_f + start).max(0.0)
    } else {
        start.min(count_f)
    };
    let to = match len {
        None => count_f,
        Some(l) if l.is_nan() => from,
        // As json-logic-js: the rest of the string after `start`, less
        // `-len` characters, truncated after the subtraction
        // (`substr("jsonlogic", 1, -2.9)` is "sonlo").
        Some(l) if l < 0.0 => from + ((count_f - from) + l).trunc().max(0.0),
        Some(l) => (from + l.trunc()).min(count_f),
    };
    let (from, to) = (from as usize, to.max(from) as usize);
    if s.is_ascii() {
        return (from, to);
    }
    let byte_at = |char_index: usize| s.char_indices().nth(char_index).map_or(s.len(), |(b, _)| b);
    (byte_at(from), byte_at(to))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn js(f: f64) -> String {
        let mut s = String::new();
        write_js_number(f, &mut s).unwrap();
        s
    }

    #[test]
    fn numbers_print_like_javascript() {
        assert_eq!(js(12.0), "12");
        assert_eq!(js(-0.5), "-0.5");
        assert_eq!(js(0.000015), "0.000015");
        assert_eq!(js(1.5e-7), "1.5e-7");
        assert_eq!(js(1e21), "1e+21");
        assert_eq!(js(1.25e22), "1.25e+22");
        assert_eq!(js(123456.789), "123456.789");
        assert_eq!(js(0.1 + 0.2), "0.30000000000000004");
    }

    #[test]
    fn substr_clamps() {
        assert_eq!(substr_range("jsonlogic", -5.0, Some(-2.0)), (4, 7));
        assert_eq!(substr_range("test", 10.0, Some(1.0)), (4, 4));
        assert_eq!(substr_range("test", -10.0, Some(1.0)), (0, 1));
        assert_eq!(substr_range("héllo", 1.0, Some(2.0)), (1, 4));
        assert_eq!(substr_range("abc", 1.0, Some(f64::INFINITY)), (1, 3));
        assert_eq!(substr_range("abc", f64::NEG_INFINITY, Some(-1e300)), (0, 0));
    }
}
