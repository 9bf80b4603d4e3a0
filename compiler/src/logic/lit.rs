//! Array and object constants, built once at compile time as `Value` trees
//! that evaluation returns by borrowing (no per-evaluation copy into the
//! arena).
//!
//! A `Value<'a>` borrows its slices, so the prebuilt tree is
//! self-referential: each container level is a [`self_cell`] whose owner is
//! the literal's JSON (string bytes) plus the prebuilt cells of its nested
//! containers, and whose dependent is the level's element slice ("spine").
//! Owner and dependent are `Send + Sync`, so `Logic` stays shareable; no
//! `unsafe` is needed here. Nested levels clone their sub-JSON once, at
//! compile time (literals are small and depth is capped by `MAX_DEPTH`).

use crate::value::{Value, number_from_json};
use self_cell::self_cell;
use serde_json::Value as Json;
use std::fmt;

struct Owner {
    json: Json,
    /// Prebuilt cells for the nested containers, in element order.
    children: Box<[Lit]>,
}

enum Spine<'a> {
    Array(Box<[Value<'a>]>),
    Object(Box<[(&'a str, Value<'a>)]>),
}

self_cell!(
    struct Cell {
        owner: Owner,
        #[covariant]
        dependent: Spine,
    }
);

/// A prebuilt array or object constant.
pub(crate) struct Lit(Cell);

fn is_container(v: &&Json) -> bool {
    matches!(v, Json::Array(_) | Json::Object(_))
}

impl Lit {
    /// Prebuilds `json` (an array or object; anything else becomes `[]`).
    pub(crate) fn new(json: Json) -> Lit {
        let children: Box<[Lit]> = match &json {
            Json::Array(items) => items
                .iter()
                .filter(is_container)
                .map(|c| Lit::new(c.clone()))
                .collect(),
            Json::Object(map) => map
                .values()
                .filter(is_container)
                .map(|c| Lit::new(c.clone()))
                .collect(),
            _ => Box::default(),
        };
        Lit(Cell::new(Owner { json, children }, build))
    }

    /// The constant as written.
    pub(crate) fn json(&self) -> &Json {
        &self.0.borrow_owner().json
    }

    /// The constant as a `Value` borrowed from `self`.
    #[inline]
    pub(crate) fn value(&self) -> Value<'_> {
        match self.0.borrow_dependent() {
            Spine::Array(items) => Value::Array(items),
            Spine::Object(members) => Value::Object(members),
        }
    }
}

fn build(owner: &Owner) -> Spine<'_> {
    let mut children = owner.children.iter();
    match &owner.json {
        Json::Array(items) => {
            Spine::Array(items.iter().map(|v| element(v, &mut children)).collect())
        }
        Json::Object(map) => Spine::Object(
            map.iter()
                .map(|(k, v)| (k.as_str(), element(v, &mut children)))
                .collect(),
        ),
        _ => Spine::Array(Box::default()),
    }
}

/// One element: scalars borrow from the JSON, containers are the next
/// prebuilt child.
fn element<'a>(v: &'a Json, children: &mut std::slice::Iter<'a, Lit>) -> Value<'a> {
    match v {
        Json::Null => Value::Null,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => number_from_json(n),
        Json::String(s) => Value::Str(s.as_str()),
        Json::Array(_) | Json::Object(_) => children.next().map_or(Value::Null, Lit::value),
    }
}

/// What a rule that folded to a string, array or object constant answers:
/// its `Value`, prebuilt once, so an evaluation is one copy (no node read).
pub(crate) struct RootConst(RootCell);

enum RootOwner {
    Str(Box<str>),
    Lit(Lit),
}

self_cell!(
    struct RootCell {
        owner: RootOwner,
        #[covariant]
        dependent: Value,
    }
);

impl RootConst {
    /// The prebuilt value of a string, array or object constant; `None` for
    /// anything else (scalars are kept unboxed by `Logic`).
    pub(crate) fn new(json: &Json) -> Option<RootConst> {
        let owner = match json {
            Json::String(s) => RootOwner::Str(s.as_str().into()),
            Json::Array(_) | Json::Object(_) => RootOwner::Lit(Lit::new(json.clone())),
            _ => return None,
        };
        Some(RootConst(RootCell::new(owner, |owner| match owner {
            RootOwner::Str(s) => Value::Str(s),
            RootOwner::Lit(lit) => lit.value(),
        })))
    }

    #[inline(always)]
    pub(crate) fn value(&self) -> Value<'_> {
        *self.0.borrow_dependent()
    }
}

impl fmt::Debug for RootConst {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RootConst").field(&self.value()).finish()
    }
}

impl fmt::Debug for Lit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Lit").field(self.json()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_constants_are_prebuilt() {
        for json in [
            serde_json::json!("text"),
            serde_json::json!([1, "a", {"b": [null]}]),
            serde_json::json!({}),
        ] {
            assert_eq!(RootConst::new(&json).unwrap().value().to_json(), json);
        }
        assert!(RootConst::new(&serde_json::json!(1)).is_none());
    }

    #[test]
    fn prebuilt_value_matches_json() {
        let json = serde_json::json!({"a": [1, 2.5, "x", [null, {"b": true}]], "c": {}, "d": []});
        let lit = Lit::new(json.clone());
        assert_eq!(lit.value().to_json(), json);
        const fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Lit>();
        assert_send_sync::<RootConst>();
    }
}
