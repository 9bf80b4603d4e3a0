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

    /// The bytes this value holds counted as a tree: a [`Value`] per
    /// element plus the text of its strings and keys, when that is at most
    /// `max`; `None` when more (the walk stops there). Values share what
    /// they are made of (`[x, x]` holds `x` twice in one slot's room), so
    /// this can be far more than the arena holds; what walks a value
    /// (writing it out, comparing, stringifying) costs this, and places
    /// that put existing values into new ones charge it (an execution's
    /// writes, a rule's arrays) so that nothing can double its size at
    /// every step for the price of a few slots.
    pub fn tree_size_within(&self, max: usize) -> Option<usize> {
        fn walk(v: &Value<'_>, left: &mut usize) -> bool {
            let own = size_of::<Value>()
                + match *v {
                    Value::Str(s) => s.len(),
                    _ => 0,
                };
            let Some(rest) = left.checked_sub(own) else {
                return false;
            };
            *left = rest;
            match *v {
                Value::Array(items) => items.iter().all(|item| walk(item, left)),
                Value::Object(members) => {
                    members
                        .iter()
                        .all(|(k, item)| match left.checked_sub(k.len()) {
                            Some(rest) => {
                                *left = rest;
                                walk(item, left)
                            }
                            None => false,
                        })
                }
                _ => true,
            }
        }
        let mut left = max;
        walk(self, &mut left).then(|| max - left)
    }

    /// Whether containers nest more than `limit` levels in this value (a
    /// scalar has depth 0, `[]` and `[1]` depth 1). It stops descending at
    /// `limit`, so it never recurses deeper than that itself.
    pub fn nests_deeper_than(&self, limit: usize) -> bool {
        match *self {
            Value::Array(items) => {
                limit == 0 || items.iter().any(|v| v.nests_deeper_than(limit - 1))
            }
            Value::Object(members) => {
                limit == 0 || members.iter().any(|(_, v)| v.nests_deeper_than(limit - 1))
            }
            _ => false,
        }
    }

    /// How deep the value nests (a scalar 0, `[]` 1), when that is at most
    /// `limit`; `None` when deeper (the walk goes no deeper than `limit`).
    pub fn depth_within(&self, limit: usize) -> Option<usize> {
        let children: &mut dyn Iterator<Item = &Value<'_>> = match self {
            Value::Array(items) => &mut items.iter(),
            Value::Object(members) => &mut members.iter().map(|(_, v)| v),
            _ => return Some(0),
        };
        if limit == 0 {
            return None;
        }
        let mut deepest = 0;
        for child in children {
            deepest = deepest.max(child.depth_within(limit - 1)?);
        }
        Some(deepest + 1)
    }

    /// Serializes as compact JSON text.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        write_compact(self, out);
    }

    /// Serializes as JSON text indented by two spaces.
    pub fn write_json_pretty(&self, out: &mut Vec<u8>) {
        write_pretty(self, out);
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

/// The compact writer (every response body goes through it).
fn write_compact(v: &Value<'_>, out: &mut Vec<u8>) {
    let mut w = Writer::new(out);
    w.value(v);
    w.finish(out);
}

/// The indented writer (two spaces), for humans.
fn write_pretty(v: &Value<'_>, out: &mut Vec<u8>) {
    let mut w = Writer::new(out);
    w.pretty(v, 0);
    w.finish(out);
}

/// Writes a float the way JavaScript's `JSON.stringify` does (shortest
/// round-trip form, integral values without a fraction, non-finite as null).
pub fn write_float(f: f64, out: &mut Vec<u8>) {
    let mut w = Writer::new(out);
    w.float(f);
    w.finish(out);
}

/// Formats a number as JavaScript's `String(n)` would, for `cat` and friends.
pub fn format_number(f: f64, out: &mut String) {
    let _ = crate::logic::write_js_number(f, out);
}

/// A little-endian word of up to eight ASCII bytes, for fixed-size stores.
const fn word(b: &[u8]) -> u64 {
    let mut w = 0;
    let mut i = 0;
    while i < b.len() {
        w |= (b[i] as u64) << (8 * i);
        i += 1;
    }
    w
}

/// A string's opening or closing: up to eight bytes stored as one word, and
/// how many of them belong to the text.
#[derive(Clone, Copy)]
struct Edge(u64, usize);

const QUOTE: Edge = Edge(word(b"\""), 1);
const QUOTE_COMMA: Edge = Edge(word(b"\","), 2);
const QUOTE_COLON: Edge = Edge(word(b"\":"), 2);
const QUOTE_COLON_SPACE: Edge = Edge(word(b"\": "), 3);

/// Writes JSON text at a cursor into a byte buffer that is kept longer than
/// the text: zero-filled up to its capacity (one `memset` per document), so
/// each string or scalar checks the room once and is then written with
/// whole-word stores, some of them past the end of what it keeps (the next
/// write overwrites those bytes). `finish` cuts the buffer back to the text.
/// Safe Rust cannot store into a `Vec`'s spare capacity, hence the zero fill
/// instead of `push` and `extend_from_slice`, which check and grow the
/// vector on every call.
///
/// The writer owns the vector while it writes (taken from the caller and
/// handed back by `finish`): behind a `&mut Vec` its pointer, length and the
/// cursor would be reloaded after every store into the text, which might
/// alias them as far as the compiler knows.
struct Writer {
    buf: Vec<u8>,
    /// The end of the text; `buf[pos..]` is room.
    pos: usize,
}

impl Writer {
    fn new(out: &mut Vec<u8>) -> Self {
        let mut buf = std::mem::take(out);
        let pos = buf.len();
        // At most 4 KiB of a large spare capacity are filled up front.
        let len = buf.capacity().clamp(pos + 64, pos + 4096);
        buf.resize(len, 0);
        Writer { buf, pos }
    }

    fn finish(mut self, out: &mut Vec<u8>) {
        self.buf.truncate(self.pos);
        *out = self.buf;
    }

    /// Makes room for `n` bytes at the cursor.
    #[inline(always)]
    fn reserve(&mut self, n: usize) {
        if n > self.buf.len() - self.pos {
            self.grow(n);
        }
    }

    #[cold]
    #[inline(never)]
    fn grow(&mut self, n: usize) {
        let len = (self.buf.len() * 2).max(self.pos + n);
        self.buf.resize(len, 0);
        let cap = self.buf.capacity();
        self.buf.resize(cap, 0);
    }

    /// Stores the eight bytes of `w` at the cursor and keeps the first `n`.
    /// Needs room for eight.
    #[inline(always)]
    fn word(&mut self, w: u64, n: usize) {
        store(&mut self.buf, self.pos, w);
        self.pos += n;
    }

    #[inline(always)]
    fn byte(&mut self, b: u8) {
        self.reserve(1);
        self.buf[self.pos] = b;
        self.pos += 1;
    }

    /// Copies `b` to the cursor. Needs room for `max(b.len(), 8)` bytes.
    #[inline(always)]
    fn copy(&mut self, b: &[u8]) {
        let (n, p) = (b.len(), self.pos);
        if n < 8 {
            store(&mut self.buf, p, load_partial(b));
        } else if n <= 16 {
            // Two overlapping words cover 8..=16 bytes.
            store(&mut self.buf, p + n - 8, load(b, n - 8));
            store(&mut self.buf, p, load(b, 0));
        } else {
            self.buf[p..p + n].copy_from_slice(b);
        }
        self.pos = p + n;
    }

    fn value(&mut self, v: &Value<'_>) {
        self.item(v);
        // Every element ends with a comma (see `item`); the document does not.
        self.pos -= 1;
    }

    /// A value followed by a comma (the comma goes with the value's own
    /// stores and room check); a container turns its last element's comma
    /// into its closing bracket. Scalars are written in the containers'
    /// loops (a call per scalar cost more than the scalar itself).
    #[inline(always)]
    fn item(&mut self, v: &Value<'_>) {
        match *v {
            Value::Array(items) => self.array(items),
            Value::Object(members) => self.object(members),
            _ => self.scalar(v),
        }
    }

    #[inline(never)]
    fn array(&mut self, items: &[Value<'_>]) {
        if items.is_empty() {
            self.literal(word(b"[],"), 3);
            return;
        }
        self.byte(b'[');
        for item in items {
            self.item(item);
        }
        self.close(b']');
    }

    #[inline(never)]
    fn object(&mut self, members: &[(&str, Value<'_>)]) {
        if members.is_empty() {
            self.literal(word(b"{},"), 3);
            return;
        }
        self.byte(b'{');
        for (k, item) in members {
            self.string(k.as_bytes(), QUOTE, QUOTE_COLON);
            self.item(item);
        }
        self.close(b'}');
    }

    /// Replaces the last element's comma by `bracket`, and adds the
    /// container's own comma.
    #[inline(always)]
    fn close(&mut self, bracket: u8) {
        self.reserve(8);
        self.pos -= 1;
        self.word(u64::from(bracket) | u64::from(b',') << 8, 2);
    }

    /// A scalar and its comma.
    #[inline(always)]
    fn scalar(&mut self, v: &Value<'_>) {
        match *v {
            Value::Null => self.literal(word(b"null,"), 5),
            Value::Bool(true) => self.literal(word(b"true,"), 5),
            Value::Bool(false) => self.literal(word(b"false,"), 6),
            Value::Int(i) => {
                self.reserve(32);
                if (0..100).contains(&i) {
                    // Counts and small codes: the digits from a division.
                    let (tens, ones) = ((i / 10) as u8, (i % 10) as u8);
                    let w = if tens == 0 {
                        u64::from(b'0' + ones) | u64::from(b',') << 8
                    } else {
                        word(&[b'0' + tens, b'0' + ones, b','])
                    };
                    self.word(w, 2 + usize::from(tens != 0));
                } else {
                    self.copy(itoa::Buffer::new().format(i).as_bytes());
                    self.word(u64::from(b','), 1);
                }
            }
            Value::Float(f) => {
                self.float(f);
                // `float` leaves room for more than its longest text.
                self.word(u64::from(b','), 1);
            }
            Value::Str(s) => self.string(s.as_bytes(), QUOTE, QUOTE_COMMA),
            Value::Array(items) => self.array(items),
            Value::Object(members) => self.object(members),
        }
    }

    fn pretty(&mut self, v: &Value<'_>, depth: usize) {
        match *v {
            Value::Array(items) if !items.is_empty() => {
                self.byte(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.byte(b',');
                    }
                    self.newline(depth + 1);
                    self.pretty(item, depth + 1);
                }
                self.newline(depth);
                self.byte(b']');
            }
            Value::Object(members) if !members.is_empty() => {
                self.byte(b'{');
                for (i, (k, item)) in members.iter().enumerate() {
                    if i > 0 {
                        self.byte(b',');
                    }
                    self.newline(depth + 1);
                    self.string(k.as_bytes(), QUOTE, QUOTE_COLON_SPACE);
                    self.pretty(item, depth + 1);
                }
                self.newline(depth);
                self.byte(b'}');
            }
            // Scalars and empty containers print the same either way.
            _ => self.value(v),
        }
    }

    fn newline(&mut self, depth: usize) {
        let n = 1 + 2 * depth;
        self.reserve(n);
        let line = &mut self.buf[self.pos..self.pos + n];
        line.fill(b' ');
        line[0] = b'\n';
        self.pos += n;
    }

    #[inline(always)]
    fn literal(&mut self, w: u64, n: usize) {
        self.reserve(8);
        self.word(w, n);
    }

    #[inline(never)]
    fn float(&mut self, f: f64) {
        // The longest text is 24 bytes (`-1.7976931348623157e-308`), written
        // in pieces with whole-word stores.
        self.reserve(48);
        if !f.is_finite() {
            self.word(word(b"null"), 4);
        } else if f.abs() < 1e16 && (f as i64) as f64 == f {
            // Integral: below 1e16 the cast truncates exactly, and the float
            // is integral when truncating keeps it (`fract` would call libm's
            // `trunc` on baseline x86-64).
            self.copy(itoa::Buffer::new().format(f as i64).as_bytes());
        } else if let Some((m, k)) = short_decimal(f) {
            if f < 0.0 {
                self.word(word(b"-"), 1);
            }
            let scale = [1, 10, 100, 1000][k as usize];
            self.copy(itoa::Buffer::new().format(m / scale).as_bytes());
            // The point and the k fraction digits (zero-padded) in one word.
            let (mut frac, mut w) = (m % scale, 0);
            for _ in 0..k {
                w = (w << 8) | u64::from(b'0' + (frac % 10) as u8);
                frac /= 10;
            }
            self.word((w << 8) | u64::from(b'.'), k as usize + 1);
        } else if f.abs() < 1e21 && f.abs() >= 1e16 {
            // Integral (every double from 2^53 up is): JavaScript writes the
            // shortest digits padded with zeros up to 1e21, not an exponent.
            self.large_integral(f);
        } else {
            let mut buf = zmij::Buffer::new();
            let text = buf.format_finite(f).as_bytes();
            // zmij writes a positive exponent as `e+21`; JavaScript (and ryu,
            // which this output matched before) as `e21`. Only magnitudes from
            // 1e21 up reach here with a positive exponent; the search is
            // skipped below.
            let plus = if f.abs() >= 1e21 {
                text.iter().position(|&b| b == b'+')
            } else {
                None
            };
            match plus {
                Some(plus) => {
                    self.copy(&text[..plus]);
                    self.copy(&text[plus + 1..]);
                }
                None => self.copy(text),
            }
        }
    }

    /// A double from 1e16 up to 1e21 as JavaScript's `String(n)` writes it
    /// (`1e16` is `10000000000000000`). Rare: out of line, through the
    /// engine's own number text. Needs the room `float` reserves.
    #[cold]
    #[inline(never)]
    fn large_integral(&mut self, f: f64) {
        struct Digits([u8; 32], usize);
        impl std::fmt::Write for Digits {
            fn write_str(&mut self, s: &str) -> std::fmt::Result {
                let end = self.1 + s.len();
                self.0
                    .get_mut(self.1..end)
                    .ok_or(std::fmt::Error)?
                    .copy_from_slice(s.as_bytes());
                self.1 = end;
                Ok(())
            }
        }
        let mut text = Digits([0; 32], 0);
        // At most 22 bytes (a sign and 21 digits).
        let _ = crate::logic::write_js_number(f, &mut text);
        self.copy(&text.0[..text.1]);
    }

    /// Writes `open`, the bytes of a string with JSON escapes, and `close`.
    /// Plain runs go eight bytes at a time: each step loads a word (the tail
    /// padded with spaces), stores all eight bytes at the cursor and keeps
    /// those that belong, up to the first byte that needs an escape.
    #[inline(always)]
    fn string(&mut self, bytes: &[u8], open: Edge, close: Edge) {
        // open (stored as a word), the text, up to eight bytes of overshoot
        // and close (stored as a word).
        let n = bytes.len();
        self.reserve(n + 24);
        if n <= 16 && self.short_string(bytes, open, close) {
            return;
        }
        self.word(open.0, open.1);
        let mut i = self.plain(bytes, 0);
        while i < bytes.len() {
            self.escape(bytes[i]);
            i += 1;
            self.reserve(bytes.len() - i + 24);
            i = self.plain(bytes, i);
        }
        self.word(close.0, close.1);
    }

    /// The common case of a string of at most 16 bytes without escapes,
    /// without a loop: one or two words checked and stored with the edges.
    /// Returns false (having written nothing) when the string needs an
    /// escape. Needs the room `string` reserves.
    #[inline(always)]
    fn short_string(&mut self, bytes: &[u8], open: Edge, close: Edge) -> bool {
        let (n, p) = (bytes.len(), self.pos);
        let room = &mut self.buf[p..p + n + 24];
        let at = open.1;
        if n < 8 {
            let w = load_partial(bytes);
            if escape_mask(w) != 0 {
                return false;
            }
            store(room, 0, open.0);
            store(room, at, w);
        } else {
            let (lo, hi) = (load(bytes, 0), load(bytes, n - 8));
            if escape_mask(lo) | escape_mask(hi) != 0 {
                return false;
            }
            store(room, 0, open.0);
            store(room, at + n - 8, hi);
            store(room, at, lo);
        }
        store(room, at + n, close.0);
        self.pos = p + at + n + close.1;
        true
    }

    /// Copies `bytes[i..]` up to the first byte that needs an escape and
    /// returns its index (or the length). Needs room for the run plus eight.
    #[inline(always)]
    fn plain(&mut self, bytes: &[u8], mut i: usize) -> usize {
        let mut pos = self.pos;
        while i < bytes.len() {
            let rest = &bytes[i..];
            let (w, n) = match rest.get(..8) {
                Some(chunk) => (load(chunk, 0), 8),
                None => (load_partial(rest), rest.len()),
            };
            store(&mut self.buf, pos, w);
            let mask = escape_mask(w);
            if mask != 0 {
                // The padding never matches, so the flagged byte is real.
                let keep = (mask.trailing_zeros() / 8) as usize;
                self.pos = pos + keep;
                return i + keep;
            }
            pos += n;
            i += n;
        }
        self.pos = pos;
        i
    }

    #[cold]
    #[inline(never)]
    fn escape(&mut self, b: u8) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        self.reserve(8);
        match b {
            b'"' => self.word(word(b"\\\""), 2),
            b'\\' => self.word(word(b"\\\\"), 2),
            b'\n' => self.word(word(b"\\n"), 2),
            b'\r' => self.word(word(b"\\r"), 2),
            b'\t' => self.word(word(b"\\t"), 2),
            0x08 => self.word(word(b"\\b"), 2),
            0x0c => self.word(word(b"\\f"), 2),
            _ => {
                let hex = [HEX[(b >> 4) as usize], HEX[(b & 0xf) as usize]];
                self.word(word(b"\\u00") | (word(&hex) << 32), 6);
            }
        }
    }
}

/// Floats with one to three decimals below 1e9 in magnitude (prices,
/// rates): `(m, k)` such that `|f|` is the double nearest to `m / 10^k`, with
/// the smallest such `k`. Then `m / 10^k` written out is what the
/// shortest-digits search prints: a shorter decimal in `f`'s rounding
/// interval would have fewer decimals `k' < k` and would have been found at
/// `k'` (below 1e9 an ulp is under 1.2e-7, so `round(|f| * 10^k')` lands on
/// it), and the interval holds at most one decimal with `k` places (an ulp is
/// far below 10^-k). Integral floats are handled before.
#[inline(always)]
fn short_decimal(f: f64) -> Option<(u64, u32)> {
    let a = f.abs();
    if !(1e-3..1e9).contains(&a) {
        return None;
    }
    for (k, scale) in [(1, 10.0), (2, 100.0), (3, 1000.0)] {
        // Rounds half up (`f64::round` is a libm call on x86-64); below
        // 1e12 the sum is exact enough, and the check decides anyway.
        let m = (a * scale + 0.5) as i64;
        if m as f64 / scale == a {
            return Some((m as u64, k));
        }
    }
    None
}

/// Stores the eight bytes of `w` (little-endian) at `buf[at..at + 8]`.
#[inline(always)]
fn store(buf: &mut [u8], at: usize, w: u64) {
    buf[at..at + 8].copy_from_slice(&w.to_le_bytes());
}

/// The little-endian word at `b[at..at + 8]`.
#[inline(always)]
fn load(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
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

/// Writes `s` as a JSON string (quotes included).
#[cfg(test)]
fn write_str(s: &str, out: &mut Vec<u8>) {
    let mut w = Writer::new(out);
    w.string(s.as_bytes(), QUOTE, QUOTE);
    w.finish(out);
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
            (1e16, "10000000000000000"),
            (-1e16, "-10000000000000000"),
            (1.2345678901234568e17, "123456789012345680"),
            (1.1e20, "110000000000000000000"),
            (9.999999999999999e20, "999999999999999900000"),
            (1e21, "1e21"),
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

    /// Strings of every length up to 40 with one special character (an
    /// escape, a control byte, multi-byte UTF-8) at every offset, alone, as
    /// an object key (compact and indented) and twice in a row: the short
    /// path (up to 16 bytes), the word loop and the resumption after an
    /// escape all against serde_json.
    #[test]
    fn strings_match_serde_json_at_every_length_up_to_40() {
        let specials = [
            '"', '\\', '\n', '\r', '\t', '\u{0}', '\u{1}', '\u{8}', '\u{b}', '\u{c}', '\u{1f}',
            ' ', '\u{7f}', 'é', '€', '😀',
        ];
        let alphabet: Vec<char> = ('a'..='z').chain('A'..='Z').collect();
        for len in 0..=40 {
            let plain: String = alphabet.iter().cycle().take(len).collect();
            check_string(&plain);
            for at in 0..=len {
                for special in specials {
                    let mut s = plain.clone();
                    s.insert(at, special);
                    check_string(&s);
                    s.insert(at, special);
                    check_string(&s);
                }
            }
        }
        // Only escapes, and escapes at both ends.
        for n in 0..40 {
            check_string(&"\"".repeat(n));
            check_string(&"\u{1}".repeat(n));
            check_string(&format!("\n{}\n", "x".repeat(n)));
        }
    }

    fn check_string(s: &str) {
        let mut out = Vec::new();
        Value::Str(s).write_json(&mut out);
        assert_eq!(out, serde_json::to_vec(s).unwrap(), "{s:?}");
        let members = [(s, Value::Int(1)), ("k", Value::Str(s))];
        let object = Value::Object(&members);
        let json = json!({s: 1, "k": s});
        let mut out = Vec::new();
        object.write_json(&mut out);
        assert_eq!(out, serde_json::to_vec(&json).unwrap(), "{s:?}");
        let mut out = Vec::new();
        object.write_json_pretty(&mut out);
        assert_eq!(out, serde_json::to_vec_pretty(&json).unwrap(), "{s:?}");
    }

    /// The shortest round-trip text of a non-integral float the general
    /// way (zmij, `e+` as `e`), to check the short-decimal path against.
    fn general_float(f: f64) -> String {
        let mut buf = zmij::Buffer::new();
        buf.format_finite(f).replace("e+", "e")
    }

    fn written_float(f: f64) -> String {
        let mut out = Vec::new();
        write_float(f, &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn short_decimals_print_like_the_shortest_digits_search() {
        let mut checked = 0;
        let mut check = |f: f64| {
            if f.is_finite() && f.fract() != 0.0 {
                assert_eq!(written_float(f), general_float(f), "{f:e}");
                checked += 1;
            }
        };
        // Every decimal with up to three places below 100, and around the
        // magnitudes where the path starts and stops.
        for m in 0..100_000u32 {
            for scale in [10.0, 100.0, 1000.0] {
                let f = f64::from(m) / scale;
                check(f);
                check(-f);
                if m % 7 == 0 {
                    for base in [1e-3, 1e6, 1e8, 999_999_999.0, 1e9, 1e12] {
                        check(base + f);
                        check(base - f);
                    }
                }
            }
        }
        // Neighbours of short decimals (not short themselves), sums that
        // are not the decimal they look like, and pseudo-random doubles.
        for m in 1..20_000u32 {
            let f = f64::from(m) / 100.0;
            check(f64::from_bits(f.to_bits() + 1));
            check(f64::from_bits(f.to_bits() - 1));
            check(f * 3.0 + 0.1);
        }
        check(0.1 + 0.2);
        check(794.3000000000001);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..50_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            check(f64::from_bits(x));
            // Random values in the fast path's range.
            check((x >> 11) as f64 / (1u64 << 53) as f64 * 1e9);
            check(((x >> 20) % 1_000_000_000) as f64 / [10.0, 100.0, 1000.0][(x % 3) as usize]);
        }
        assert!(checked > 700_000, "{checked}");
    }

    /// Integers (the two-digit path and itoa's) and every other scalar and
    /// empty container as elements of arrays and objects, first, inner and
    /// last, nested: each with its comma, the last one's turned into the
    /// bracket.
    #[test]
    fn scalars_and_empty_containers_in_every_place() {
        let mut ints: Vec<i64> = (-1000..1000).collect();
        ints.extend([i64::MIN, i64::MAX, 1 << 53, -(1 << 53)]);
        let mut scalars: Vec<serde_json::Value> = ints.iter().map(|&i| json!(i)).collect();
        scalars.extend([
            json!(null),
            json!(true),
            json!(false),
            json!(0.5),
            json!(-12.25),
        ]);
        scalars.extend([
            json!(""),
            json!("x"),
            json!([]),
            json!({}),
            json!([[]]),
            json!({"": {}}),
        ]);
        let arena = Bump::new();
        for (i, x) in scalars.iter().enumerate() {
            let y = &scalars[(i * 7 + 3) % scalars.len()];
            for src in [
                x.clone(),
                json!([x]),
                json!([x, y]),
                json!([y, x, y]),
                json!({"k": x}),
                json!({"k": x, "l": y}),
                json!({"a": [x, {"b": x}], "c": [[x], y]}),
            ] {
                let v = Value::from_json(&src, &arena);
                assert_eq!(v.to_json_string(), src.to_string());
                let mut pretty = Vec::new();
                v.write_json_pretty(&mut pretty);
                assert_eq!(pretty, serde_json::to_vec_pretty(&src).unwrap(), "{src}");
            }
        }
    }

    /// Output that outgrows the buffer, into buffers with content before it
    /// and with small, no and large spare capacity.
    #[test]
    fn long_output_grows_the_buffer() {
        let arena = Bump::new();
        let item = json!({"name": "x\"y".repeat(30), "n": [1.5, -2, null, true, "é".repeat(50)]});
        let src = serde_json::Value::Array(vec![item; 200]);
        let v = Value::from_json(&src, &arena);
        let compact = serde_json::to_vec(&src).unwrap();
        let pretty = serde_json::to_vec_pretty(&src).unwrap();
        for capacity in [0, 1, 64, 1000, 1 << 20] {
            let mut out = Vec::with_capacity(capacity);
            out.extend_from_slice(b"prefix");
            v.write_json(&mut out);
            assert_eq!(&out[..6], b"prefix");
            assert_eq!(out[6..], compact[..]);
            let mut out = Vec::with_capacity(capacity);
            out.extend_from_slice(b"prefix");
            v.write_json_pretty(&mut out);
            assert_eq!(&out[..6], b"prefix");
            assert_eq!(out[6..], pretty[..]);
        }
        let mut out = Vec::new();
        write_float(0.1, &mut out);
        write_float(-12.5, &mut out);
        assert_eq!(out, b"0.1-12.5");
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
