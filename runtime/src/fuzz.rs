//! Fuzz target bodies for the runtime's own parsers and writers. The `fuzz/`
//! crate's targets are one-line wrappers over these, and
//! `tests/fuzz_seeds.rs` runs them over the checked-in seed corpus so CI
//! exercises them on stable Rust.
//!
//! Each body must return normally for every input.

use crate::{json, xml};
use bumpalo::Bump;
use serde_json::Value as Json;

/// Arbitrary bytes as a request body: what the arena parser accepts,
/// serde_json accepts as the same document, and the engine's JSON writer
/// writes back as text that parses to that document again (the writer's
/// word-at-a-time stores, escapes and number formatting). The value also
/// goes through `publish_xml`'s writer, whose output `parse_xml` must read.
pub fn json_body(bytes: &[u8]) {
    let arena = Bump::new();
    let Ok(value) = json::parse(bytes, &arena) else {
        return;
    };
    let written = value.to_json_string();
    let back: Json = serde_json::from_str(&written)
        .unwrap_or_else(|e| panic!("the writer's text is not JSON ({e}): {written}"));
    match serde_json::from_slice::<Json>(bytes) {
        Ok(original) => assert!(
            same(&original, &back),
            "round trip changed the document: {written}"
        ),
        // serde_json stops at 128 levels; the body parser allows more.
        Err(e) => assert!(
            e.to_string().starts_with("recursion limit exceeded"),
            "accepted what serde_json refuses ({e})"
        ),
    }
    // Writing is stable: the written text reads back to the same text.
    let again = json::parse(written.as_bytes(), &arena).expect("written text parses");
    assert_eq!(again.to_json_string(), written);
    if let Ok(doc) = xml::to_xml(&value, "root") {
        xml::parse(&doc, &arena)
            .unwrap_or_else(|e| panic!("publish_xml wrote what parse_xml refuses ({e}): {doc}"));
    }
}

/// Arbitrary text as an XML document for `parse_xml`: it parses or says
/// why, and what it parses to is written back as XML that parses again.
pub fn xml_document(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let arena = Bump::new();
    let Ok(value) = xml::parse(text, &arena) else {
        return;
    };
    // The document is one member named after the root element.
    if let sluice_compiler::Value::Object([(name, inner)]) = value
        && let Ok(doc) = xml::to_xml(inner, name)
    {
        xml::parse(&doc, &arena)
            .unwrap_or_else(|e| panic!("publish_xml wrote what parse_xml refuses ({e}): {doc}"));
    }
}

/// Equal documents, numbers compared by value (the writer prints `1.0` as
/// `1`, as JavaScript does).
fn same(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Number(x), Json::Number(y)) => match (x.as_i64(), y.as_i64()) {
            (Some(x), Some(y)) => x == y,
            _ => x.as_f64() == y.as_f64(),
        },
        (Json::Array(x), Json::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
        }
        (Json::Object(x), Json::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}
