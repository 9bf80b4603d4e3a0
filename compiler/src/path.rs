//! Dotted paths, split once at compile time.
//!
//! `a.b.0.#1` is four segments: key `a`, key `b`, `0` (an array index, or the key
//! `"0"` when the container is an object) and the literal key `"1"` (one leading
//! `#` escapes a numeric-looking key). Reads and writes walk the pre-split
//! segments; nothing on the execution path splits a string.

use crate::value::{Value, key_eq};
use bumpalo::Bump;
use smallvec::SmallVec;
use std::fmt;

/// The largest array index a write may create. Writing past the end pads with
/// nulls, so an unbounded index would let one request allocate without limit.
pub const MAX_WRITE_INDEX: usize = 100_000;

/// One segment of a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The object key this segment names (without a leading `#`).
    pub key: Box<str>,
    /// The array index, when the segment is a plain non-negative integer.
    pub index: Option<usize>,
}

impl Segment {
    pub fn new(key: impl Into<Box<str>>, index: Option<usize>) -> Segment {
        Segment {
            key: key.into(),
            index,
        }
    }

    /// The member named by this segment's key. A plain loop returning the
    /// member: `Iterator::find` stayed an out-of-line call per lookup.
    #[inline(always)]
    pub fn member<'v, 'a>(&self, members: &'v [(&'a str, Value<'a>)]) -> Option<&'v Value<'a>> {
        for (k, v) in members {
            if key_eq(k, &self.key) {
                return Some(v);
            }
        }
        None
    }

    /// The index of the member named by this segment's key.
    #[inline(always)]
    pub fn position(&self, members: &[(&str, Value<'_>)]) -> Option<usize> {
        members.iter().position(|(k, _)| key_eq(k, &self.key))
    }
}

/// A pre-split dotted path. The empty path (from `""`) names the root.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Path {
    segments: SmallVec<[Segment; 4]>,
}

/// Why a write could not be applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("cannot write key '{key}' into an array at '{at}'")]
    KeyIntoArray { key: String, at: String },
    #[error("array index {index} at '{at}' is over the limit of {MAX_WRITE_INDEX}")]
    IndexTooLarge { index: String, at: String },
    /// Padding arrays up to their indexes would take the execution's data
    /// past its limit (each index segment pads its own array).
    #[error(
        "array index {index} at '{at}' would take the execution's data over {} MiB",
        crate::logic::MAX_ARENA_BYTES >> 20
    )]
    TooLarge { index: usize, at: String },
}

impl Path {
    /// Splits a dotted path. Never fails: every string is a path.
    ///
    /// A backslash escapes what follows it (JSON Logic's path escaping,
    /// `escaping.json` of the shared suite): `\.` is a dot inside a key
    /// (`hello\.world` is the one key `hello.world`), `\/` a slash and
    /// `\\` a backslash; before anything else it stays a backslash. A
    /// path of dots alone names as many empty keys as it has dots (`.` is
    /// the key `""`, `..` that key's own key `""`).
    pub fn parse(text: &str) -> Path {
        if text.is_empty() {
            return Path::default();
        }
        if !needs_escape_split(text) {
            let segments = text.split('.').map(Segment::parse).collect();
            return Path { segments };
        }
        let segments = split_escaped(text)
            .iter()
            .map(|s| Segment::parse(s))
            .collect();
        Path { segments }
    }

    pub fn from_segments(segments: impl IntoIterator<Item = Segment>) -> Path {
        Path {
            segments: segments.into_iter().collect(),
        }
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    pub fn is_root(&self) -> bool {
        self.segments.is_empty()
    }

    /// The first segment's key, if any (used to pick the context area).
    pub fn first_key(&self) -> Option<&str> {
        self.segments.first().map(|s| &*s.key)
    }

    /// The path without its first segment.
    pub fn tail(&self) -> Path {
        Path {
            segments: self.segments.iter().skip(1).cloned().collect(),
        }
    }

    /// Reads the value at this path; `None` when any segment is missing.
    #[inline]
    pub fn get<'a>(&self, root: Value<'a>) -> Option<Value<'a>> {
        get_segments(root, &self.segments)
    }

    /// Returns `root` with `value` written at this path, creating intermediate
    /// objects and arrays. The original tree is untouched (persistent update).
    /// New keys are copied into the arena.
    pub fn set<'a>(
        &self,
        root: Value<'a>,
        value: Value<'a>,
        arena: &'a Bump,
    ) -> Result<Value<'a>, PathError> {
        set_segments(root, &self.segments, value, arena, self, 0, |k| {
            &*arena.alloc_str(k)
        })
    }

    /// [`Path::set`] for a path that outlives the arena (a compiled plan's):
    /// new keys borrow from the path instead of being copied.
    pub fn set_borrowed<'a>(
        &'a self,
        root: Value<'a>,
        value: Value<'a>,
        arena: &'a Bump,
    ) -> Result<Value<'a>, PathError> {
        set_segments(root, &self.segments, value, arena, self, 0, |k| k)
    }

    fn prefix_string(&self, depth: usize) -> String {
        let mut out = String::new();
        for (i, s) in self.segments[..depth].iter().enumerate() {
            if i > 0 {
                out.push('.');
            }
            out.push_str(&s.key);
        }
        out
    }
}

/// Whether a path has an empty piece (`a..b`, `a.`; a path of dots alone),
/// escapes read as [`Path::parse`] reads them (`a\\.` is the one key `a.`).
pub fn has_empty_piece(text: &str) -> bool {
    if text.is_empty() {
        return true;
    }
    if needs_escape_split(text) {
        split_escaped(text).iter().any(String::is_empty)
    } else {
        text.split('.').any(str::is_empty)
    }
}

/// Whether `text` must be split by [`split_escaped`] rather than at every
/// dot: it holds a backslash, or is dots alone.
pub(crate) fn needs_escape_split(text: &str) -> bool {
    text.contains('\\') || text.bytes().all(|b| b == b'.')
}

/// The keys of a path with escapes (see [`Path::parse`]).
fn split_escaped(text: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut current = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.peek() {
                Some(&next @ ('.' | '/' | '\\')) => {
                    current.push(next);
                    chars.next();
                }
                _ => current.push('\\'),
            },
            '.' => parts.push(std::mem::take(&mut current)),
            other => current.push(other),
        }
    }
    // A path of dots alone: one key per dot (`.` is `[""]`, not `["", ""]`).
    if parts.len() != text.chars().count() {
        parts.push(current);
    }
    parts
}

impl Segment {
    pub fn parse(text: &str) -> Segment {
        if let Some(rest) = text.strip_prefix('#') {
            return Segment::new(rest, None);
        }
        // A number too large for `usize` is still an index (one no array
        // reaches, and over the write limit), not an object key: which one a
        // segment is must not depend on how many digits it has.
        let index = if !text.is_empty()
            && text.bytes().all(|b| b.is_ascii_digit())
            && (text == "0" || !text.starts_with('0'))
        {
            Some(text.parse().unwrap_or(usize::MAX))
        } else {
            None
        };
        Segment::new(text, index)
    }

    /// A segment that is only ever an object key.
    pub fn key(text: &str) -> Segment {
        Segment::new(text, None)
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.segments.iter().enumerate() {
            if i > 0 {
                f.write_str(".")?;
            }
            if s.index.is_none() && s.key.bytes().all(|b| b.is_ascii_digit()) && !s.key.is_empty() {
                f.write_str("#")?;
            }
            if s.key.contains(['.', '\\']) {
                // Written back as it would be parsed (`hello\.world`).
                for c in s.key.chars() {
                    if c == '.' || c == '\\' {
                        f.write_str("\\")?;
                    }
                    write!(f, "{c}")?;
                }
            } else {
                f.write_str(&s.key)?;
            }
        }
        Ok(())
    }
}

#[inline]
pub fn get_segments<'a>(mut current: Value<'a>, segments: &[Segment]) -> Option<Value<'a>> {
    for seg in segments {
        current = match current {
            Value::Object(members) => *seg.member(members)?,
            Value::Array(items) => *items.get(seg.index?)?,
            _ => return None,
        };
    }
    Some(current)
}

/// The persistent write. Containers along the path are copied (one `memcpy`
/// plus the changed slot); `key` turns a segment's key into a key of the
/// written tree.
fn set_segments<'a, 's>(
    current: Value<'a>,
    segments: &'s [Segment],
    value: Value<'a>,
    arena: &'a Bump,
    path: &Path,
    depth: usize,
    key: impl Fn(&'s str) -> &'a str + Copy,
) -> Result<Value<'a>, PathError> {
    let Some((seg, rest)) = segments.split_first() else {
        return Ok(value);
    };
    match current {
        Value::Array(items) => {
            let Some(index) = seg.index else {
                return Err(PathError::KeyIntoArray {
                    key: seg.key.to_string(),
                    at: path.prefix_string(depth),
                });
            };
            check_index(index, path, depth)?;
            let child = items.get(index).copied().unwrap_or(Value::Null);
            let new_child = set_segments(child, rest, value, arena, path, depth + 1, key)?;
            if index < items.len() {
                let out = arena.alloc_slice_copy(items);
                out[index] = new_child;
                return Ok(Value::Array(out));
            }
            check_room(index, arena, path, depth)?;
            let out = arena.alloc_slice_fill_with(index + 1, |i| {
                if i == index {
                    new_child
                } else {
                    items.get(i).copied().unwrap_or(Value::Null)
                }
            });
            Ok(Value::Array(out))
        }
        Value::Object(members) => {
            let pos = seg.position(members);
            let child = pos.map_or(Value::Null, |p| members[p].1);
            let new_child = set_segments(child, rest, value, arena, path, depth + 1, key)?;
            let out = match pos {
                Some(p) => {
                    let out = arena.alloc_slice_copy(members);
                    out[p].1 = new_child;
                    &*out
                }
                None => {
                    let mut out =
                        bumpalo::collections::Vec::with_capacity_in(members.len() + 1, arena);
                    out.extend_from_slice(members);
                    out.push((key(&seg.key), new_child));
                    out.into_bump_slice()
                }
            };
            Ok(Value::Object(out))
        }
        // A missing or scalar intermediate is replaced by a new container whose
        // kind follows the segment: an index creates an array, a key an object.
        _ => match seg.index {
            Some(index) => {
                check_index(index, path, depth)?;
                let new_child =
                    set_segments(Value::Null, rest, value, arena, path, depth + 1, key)?;
                check_room(index, arena, path, depth)?;
                let out = arena.alloc_slice_fill_with(index + 1, |i| {
                    if i == index { new_child } else { Value::Null }
                });
                Ok(Value::Array(out))
            }
            None => {
                let new_child =
                    set_segments(Value::Null, rest, value, arena, path, depth + 1, key)?;
                Ok(Value::Object(
                    arena.alloc_slice_copy(&[(key(&seg.key), new_child)]),
                ))
            }
        },
    }
}

/// Several object-key paths written in one pass (a run of a `map` task's
/// mappings, see `plan::batches`): the paths as a tree, grouped by key at
/// plan build, so each container along them is copied once however many of
/// the paths go through it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathSet {
    children: Children,
}

/// The keys written under one container, in the order of their first write.
type Children = Box<[(Box<str>, Node)]>;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Node {
    /// The end of the path of the value with this index.
    Leaf(usize),
    Inner(Children),
}

impl PathSet {
    /// `None` unless every path is a non-empty object-key path (no array
    /// index segment) and none is a prefix of another.
    pub fn new(paths: &[&Path]) -> Option<PathSet> {
        /// A path (what is left of it) and the index of its value.
        type Tail<'p> = (&'p [Segment], usize);
        fn build(paths: &[Tail<'_>]) -> Option<Children> {
            let mut children: Vec<(Box<str>, Vec<Tail<'_>>)> = Vec::new();
            for &(segments, index) in paths {
                let (first, rest) = segments.split_first()?;
                if first.index.is_some() {
                    return None;
                }
                match children.iter_mut().find(|(k, _)| *k == first.key) {
                    Some((_, under)) => under.push((rest, index)),
                    None => children.push((first.key.clone(), vec![(rest, index)])),
                }
            }
            children
                .into_iter()
                .map(|(key, under)| {
                    let node = match under.as_slice() {
                        [([], index)] => Node::Leaf(*index),
                        // One path ends here and another goes on: a prefix.
                        _ if under.iter().any(|(rest, _)| rest.is_empty()) => return None,
                        _ => Node::Inner(build(&under)?),
                    };
                    Some((key, node))
                })
                .collect()
        }
        let indexed: Vec<Tail<'_>> = paths
            .iter()
            .enumerate()
            .map(|(i, p)| (p.segments(), i))
            .collect();
        Some(PathSet {
            children: build(&indexed)?,
        })
    }

    /// Writes `values[i]` at the `i`th path given to [`PathSet::new`]: the
    /// result, key order included, is what writing them one by one in that
    /// order gives. `None` when an array stands where one of the keys would
    /// go: the caller then writes one by one, which reports the error
    /// exactly as a single write does.
    pub fn set<'a>(
        &'a self,
        root: Value<'a>,
        values: &[Value<'a>],
        arena: &'a Bump,
    ) -> Option<Value<'a>> {
        set_tree(root, &self.children, values, arena)
    }
}

fn set_tree<'a>(
    current: Value<'a>,
    children: &'a [(Box<str>, Node)],
    values: &[Value<'a>],
    arena: &'a Bump,
) -> Option<Value<'a>> {
    let members: &[(&'a str, Value<'a>)] = match current {
        Value::Object(members) => members,
        Value::Array(_) => return None,
        // A missing or scalar container becomes an object, as in one write.
        _ => &[],
    };
    let mut out =
        bumpalo::collections::Vec::with_capacity_in(members.len() + children.len(), arena);
    out.extend_from_slice(members);
    for (key, node) in children {
        let pos = members.iter().position(|(k, _)| key_eq(k, key));
        let new_child = match node {
            Node::Leaf(i) => *values.get(*i)?,
            Node::Inner(under) => {
                let child = pos.map_or(Value::Null, |p| members[p].1);
                set_tree(child, under, values, arena)?
            }
        };
        match pos {
            Some(p) => out[p].1 = new_child,
            None => out.push((&**key, new_child)),
        }
    }
    Some(Value::Object(out.into_bump_slice()))
}

fn check_index(index: usize, path: &Path, depth: usize) -> Result<(), PathError> {
    if index > MAX_WRITE_INDEX {
        return Err(PathError::IndexTooLarge {
            // The segment's own digits (an index beyond `usize` is saturated).
            index: path.segments[depth].key.to_string(),
            at: path.prefix_string(depth + 1),
        });
    }
    Ok(())
}

/// Whether the arena has room for an array padded up to `index`: a write
/// with many index segments (`x.100000.100000…`) pads one array per
/// segment, and the context's limit is checked only before the write.
fn check_room(index: usize, arena: &Bump, path: &Path, depth: usize) -> Result<(), PathError> {
    let bytes = (index + 1) * std::mem::size_of::<Value>();
    if arena.allocated_bytes().saturating_add(bytes) > crate::logic::MAX_ARENA_BYTES {
        return Err(PathError::TooLarge {
            index,
            at: path.prefix_string(depth + 1),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// JSON Logic's path escaping (the shared `escaping.json`): `\\.` a dot
    /// in a key, `\\/` a slash, `\\\\` a backslash; dots alone name empty keys.
    #[test]
    fn backslashes_escape_dots_slashes_and_themselves() {
        let keys = |t: &str| -> Vec<String> {
            Path::parse(t)
                .segments()
                .iter()
                .map(|s| s.key.to_string())
                .collect()
        };
        assert_eq!(keys("."), [""]);
        assert_eq!(keys(".."), ["", ""]);
        assert_eq!(keys("hello\\.world"), ["hello.world"]);
        assert_eq!(keys("..\\.key."), ["", "", ".key", ""]);
        assert_eq!(keys("\\.."), [".", ""]);
        assert_eq!(keys("\\\\.Hello"), ["\\", "Hello"]);
        assert_eq!(keys("\\/"), ["/"]);
        assert_eq!(keys("a\\b"), ["a\\b"]);
        assert_eq!(keys("a.b"), ["a", "b"]);
        // Written back as parsed.
        for t in ["hello\\.world", "a.\\\\.b", "x.#1"] {
            assert_eq!(Path::parse(t).to_string(), t);
        }
        assert!(has_empty_piece("a..b") && has_empty_piece("a.") && has_empty_piece(""));
        assert!(!has_empty_piece("a\\.") && !has_empty_piece("\\.") && !has_empty_piece("#"));
    }
    use serde_json::json;

    fn write(root: serde_json::Value, path: &str, value: serde_json::Value) -> serde_json::Value {
        let arena = Bump::new();
        let r = Value::from_json(&root, &arena);
        let v = Value::from_json(&value, &arena);
        Path::parse(path).set(r, v, &arena).unwrap().to_json()
    }

    /// `PathSet::set` against the same writes one by one: every ordered choice
    /// of up to three paths (none a prefix of another) from a pool covering
    /// existing keys, new keys, scalars in the way, and an array in the way.
    #[test]
    fn a_path_set_writes_like_one_by_one() {
        let arena = Bump::new();
        let root_json = json!({"a": {"b": 1, "c": [1, 2], "s": "x"}, "d": 5, "e": {}});
        let root = Value::from_json(&root_json, &arena);
        let pool: Vec<Path> = [
            "a.b", "a.x", "a.y.z", "a.y.w", "a.s.t", "d.e", "n.m", "e", "a.c.k", "#0.q", "a",
        ]
        .iter()
        .map(|p| Path::parse(p))
        .collect();
        let prefix = |a: &Path, b: &Path| {
            let (a, b) = (a.segments(), b.segments());
            a.len() <= b.len() && a.iter().zip(b).all(|(x, y)| x.key == y.key)
        };
        let mut checked = 0;
        let mut picks: Vec<Vec<usize>> = Vec::new();
        for i in 0..pool.len() {
            picks.push(vec![i]);
            for j in 0..pool.len() {
                picks.push(vec![i, j]);
                for k in 0..pool.len() {
                    picks.push(vec![i, j, k]);
                }
            }
        }
        for pick in picks {
            let paths: Vec<&Path> = pick.iter().map(|&i| &pool[i]).collect();
            let disjoint = paths.iter().enumerate().all(|(x, p)| {
                paths
                    .iter()
                    .enumerate()
                    .all(|(y, q)| x == y || !prefix(p, q))
            });
            if !disjoint {
                assert!(PathSet::new(&paths).is_none(), "{pick:?}");
                continue;
            }
            let values: Vec<Value<'_>> = (0..paths.len())
                .map(|n| Value::Int(n as i64 + 10))
                .collect();
            let mut one_by_one = Ok(root);
            for (p, v) in paths.iter().zip(&values) {
                one_by_one = one_by_one.and_then(|r| p.set(r, *v, &arena));
            }
            let set = PathSet::new(&paths).expect("key paths, none a prefix of another");
            match set.set(root, &values, &arena) {
                Some(all) => {
                    let expected = one_by_one.unwrap().to_json();
                    assert_eq!(all.to_json(), expected, "{pick:?}");
                    // Key order too (serde_json's map would hide it).
                    assert_eq!(all.to_json_string(), expected.to_string(), "{pick:?}");
                }
                None => assert!(
                    one_by_one.is_err(),
                    "{pick:?}: the set gave up but one by one worked"
                ),
            }
            checked += 1;
        }
        assert!(checked > 300, "{checked}");
        // Index segments and the empty path are refused.
        assert!(PathSet::new(&[&Path::parse("x.0")]).is_none());
        assert!(PathSet::new(&[&Path::parse("")]).is_none());
        assert!(PathSet::new(&[&Path::parse("#0")]).is_some());
    }

    /// Lookups and writes of one path over objects of changing shapes (the
    /// key elsewhere, absent, past the end of a shorter object).
    #[test]
    fn lookups_follow_the_key_wherever_it_is() {
        let arena = Bump::new();
        let path = Path::parse("o.a");
        let shapes = [
            (json!({"o": {"a": 1, "b": 2}}), Some(json!(1))),
            (
                json!({"o": {"x": 0, "y": 0, "b": 3, "a": 4}}),
                Some(json!(4)),
            ),
            (json!({"o": {"a": 5}}), Some(json!(5))),
            (json!({"o": {"c": 5}}), None),
            (json!({"o": {}}), None),
            (json!({"z": 1, "o": {"b": 7, "a": 6}}), Some(json!(6))),
            // Larger objects, the key moving between them.
            (
                json!({"o": {"k1": 0, "k2": 0, "k3": 0, "k4": 0, "k5": 0, "k6": 0, "k7": 0, "k8": 0, "a": 10}}),
                Some(json!(10)),
            ),
            (
                json!({"o": {"k1": 0, "k2": 0, "k3": 0, "k4": 0, "k5": 0, "k6": 0, "k7": 0, "k8": 0, "a": 11}}),
                Some(json!(11)),
            ),
            (
                json!({"o": {"a": 12, "k1": 0, "k2": 0, "k3": 0, "k4": 0, "k5": 0, "k6": 0, "k7": 0, "k8": 0}}),
                Some(json!(12)),
            ),
            (
                json!({"o": {"k1": 0, "k2": 0, "k3": 0, "k4": 0, "k5": 0, "k6": 0, "k7": 0, "k8": 0, "k9": 0}}),
                None,
            ),
            (
                json!({"o": {"k1": 0, "k2": 0, "k3": 0, "k4": 0, "k5": 0, "k6": 0, "k7": 0, "k8": 0, "a": 13}}),
                Some(json!(13)),
            ),
        ];
        for _ in 0..2 {
            for (data, want) in &shapes {
                let v = Value::from_json(data, &arena);
                assert_eq!(path.get(v).map(|v| v.to_json()), *want, "{data}");
                let written = path.set(v, Value::Int(9), &arena).unwrap().to_json();
                let mut expected = data.clone();
                expected["o"]["a"] = json!(9);
                assert_eq!(written, expected, "{data}");
            }
        }
    }

    #[test]
    fn splits_and_escapes() {
        let p = Path::parse("a.0.#1.b");
        let s = p.segments();
        assert_eq!(s.len(), 4);
        assert_eq!(s[1].index, Some(0));
        assert_eq!(&*s[2].key, "1");
        assert_eq!(s[2].index, None);
        assert_eq!(p.to_string(), "a.0.#1.b");
        assert!(Path::parse("").is_root());
        assert_eq!(Path::parse("01").segments()[0].index, None);
    }

    #[test]
    fn reads_objects_and_arrays() {
        let arena = Bump::new();
        let src = json!({"a": [{"b": 1}, {"0": "zero"}]});
        let v = Value::from_json(&src, &arena);
        assert_eq!(Path::parse("a.0.b").get(v).unwrap().to_json(), json!(1));
        assert_eq!(
            Path::parse("a.1.0").get(v).unwrap().to_json(),
            json!("zero")
        );
        assert_eq!(
            Path::parse("a.1.#0").get(v).unwrap().to_json(),
            json!("zero")
        );
        assert!(Path::parse("a.5").get(v).is_none());
        assert!(Path::parse("a.x").get(v).is_none());
    }

    #[test]
    fn writes_create_intermediates() {
        assert_eq!(
            write(json!({}), "a.b.c", json!(1)),
            json!({"a": {"b": {"c": 1}}})
        );
        assert_eq!(
            write(json!({}), "a.2", json!(true)),
            json!({"a": [null, null, true]})
        );
        assert_eq!(
            write(json!({}), "a.#2", json!(true)),
            json!({"a": {"2": true}})
        );
        assert_eq!(
            write(json!({"a": {"0": 1}}), "a.0", json!(2)),
            json!({"a": {"0": 2}})
        );
        assert_eq!(
            write(json!({"a": 5}), "a.b", json!(2)),
            json!({"a": {"b": 2}})
        );
        assert_eq!(
            write(json!({"x": 1, "a": [1]}), "a.1", json!(2)),
            json!({"x": 1, "a": [1, 2]})
        );
        assert_eq!(write(json!({"x": 1}), "", json!(2)), json!(2));
    }

    #[test]
    fn writes_are_persistent() {
        let arena = Bump::new();
        let src = json!({"a": {"b": 1}});
        let before = Value::from_json(&src, &arena);
        let after = Path::parse("a.b")
            .set(before, Value::Int(2), &arena)
            .unwrap();
        assert_eq!(before.to_json(), json!({"a": {"b": 1}}));
        assert_eq!(after.to_json(), json!({"a": {"b": 2}}));
    }

    #[test]
    fn bad_writes_are_errors() {
        let arena = Bump::new();
        let src = json!({"a": [1]});
        let v = Value::from_json(&src, &arena);
        let err = Path::parse("a.x").set(v, Value::Null, &arena).unwrap_err();
        assert_eq!(err.to_string(), "cannot write key 'x' into an array at 'a'");
        let err = Path::parse("a.999999999")
            .set(v, Value::Null, &arena)
            .unwrap_err();
        assert!(matches!(err, PathError::IndexTooLarge { .. }));
        // However many digits: an index, not a key (audit 69).
        let err = Path::parse("b.99999999999999999999")
            .set(v, Value::Int(1), &arena)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "array index 99999999999999999999 at 'b.99999999999999999999' is over the limit of 100000"
        );
        assert_eq!(Path::parse("a.99999999999999999999").get(v), None);
    }

    #[test]
    fn padding_stops_at_the_execution_limit() {
        // Each segment pads an array of 100,001 values (2.4 MB): 512 of
        // them would take 1.2 GB, 64 of them 154 MB. The write stops
        // before the limit.
        let arena = Bump::new();
        let text = format!("x{}", ".100000".repeat(64));
        let err = Path::parse(&text)
            .set(Value::Null, Value::Int(1), &arena)
            .unwrap_err();
        assert!(
            matches!(err, PathError::TooLarge { index: 100_000, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("over 128 MiB"), "{err}");
        // Chunks double, so the arena may reserve up to twice the limit.
        assert!(arena.allocated_bytes() <= 2 * crate::logic::MAX_ARENA_BYTES);
        // One padded array is within the limit.
        let arena = Bump::new();
        let v = Path::parse("x.100000")
            .set(Value::Null, Value::Int(1), &arena)
            .unwrap();
        assert_eq!(
            v.get("x").and_then(|x| x.as_array()).map(|a| a.len()),
            Some(100_001)
        );
    }
}
