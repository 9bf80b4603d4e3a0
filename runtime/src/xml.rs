//! XML to and from the engine's values, for `parse_xml` and `publish_xml`.
//!
//! The mapping (recorded in docs/decisions.md): the document becomes an object
//! with one member named after the root element. An element with neither
//! attributes nor child elements becomes its text (a string; `null` when empty);
//! otherwise an object whose attributes are `@name` members, child elements are
//! members named after them (repeated children become an array, in order) and
//! non-blank text is the `#text` member. Values are never type-guessed: `<n>1</n>`
//! gives the string `"1"`, so a round trip cannot change data.

use bumpalo::Bump;
use quick_xml::Reader;
use quick_xml::events::Event;
use sluice_compiler::Value;
use std::collections::HashMap;

/// Nesting deeper than this is refused rather than risking the stack.
const MAX_XML_DEPTH: usize = 256;

/// Parses XML text into a value in the arena.
pub fn parse<'a>(text: &str, arena: &'a Bump) -> Result<Value<'a>, String> {
    // A character XML 1.0 does not allow makes the document not well-formed
    // (publish_xml refuses to write one); quick-xml passes it through.
    if let Some(at) = text.find(forbidden) {
        let c = text[at..].chars().next().unwrap_or_default();
        return Err(format!(
            "invalid XML at byte {at}: the character U+{:04X} is not allowed in XML 1.0",
            u32::from(c)
        ));
    }
    let mut reader = Reader::from_str(text);
    reader.config_mut().trim_text(false);
    let mut stack: Vec<Element<'a>> = Vec::new();
    let mut root: Option<(&'a str, Value<'a>)> = None;
    loop {
        let event = reader
            .read_event()
            .map_err(|e| format!("invalid XML at byte {}: {e}", reader.error_position()))?;
        match event {
            Event::Start(ref start) | Event::Empty(ref start) => {
                let is_empty = matches!(event, Event::Empty(_));
                let name = arena.alloc_str(&String::from_utf8_lossy(start.name().as_ref()));
                let mut element = Element::new(name);
                for attr in start.attributes() {
                    let attr = attr.map_err(|e| format!("invalid XML attribute: {e}"))?;
                    let key = format!("@{}", String::from_utf8_lossy(attr.key.as_ref()));
                    let raw = std::str::from_utf8(&attr.value)
                        .map_err(|e| format!("invalid XML attribute: {e}"))?;
                    // A parser reads each literal tab, line feed and carriage
                    // return (a CR LF pair as one) of a value as a space, and
                    // what a reference names as it is (XML 1.0, 3.3.3).
                    let raw = normalize_line_ends(raw);
                    let raw = if raw.contains(['\t', '\n']) {
                        raw.replace(['\t', '\n'], " ").into()
                    } else {
                        raw
                    };
                    let value = quick_xml::escape::unescape(&raw)
                        .map_err(|e| format!("invalid XML: {e}"))?;
                    if let Some(c) = value.chars().find(|&c| forbidden(c)) {
                        return Err(forbidden_reference(c));
                    }
                    element.members.push((
                        arena.alloc_str(&key),
                        Member::One(Value::Str(arena.alloc_str(&value))),
                    ));
                    element.has_structure = true;
                }
                if stack.len() >= MAX_XML_DEPTH {
                    return Err(format!("XML nests deeper than {MAX_XML_DEPTH} levels"));
                }
                if is_empty {
                    let value = element.finish(arena);
                    attach(&mut stack, &mut root, name, value)?;
                } else {
                    stack.push(element);
                }
            }
            Event::End(_) => {
                let element = stack.pop().ok_or("unbalanced XML end tag")?;
                let name = element.name;
                let value = element.finish(arena);
                attach(&mut stack, &mut root, name, value)?;
            }
            Event::Text(t) => {
                let raw = t.decode().map_err(|e| format!("invalid XML text: {e}"))?;
                if let Some(top) = stack.last_mut() {
                    top.text.push_str(&normalize_line_ends(&raw));
                } else if !raw.trim().is_empty() {
                    return Err("text outside the root element".into());
                }
            }
            Event::CData(c) => {
                let raw = c.decode().map_err(|e| format!("invalid XML CDATA: {e}"))?;
                if let Some(top) = stack.last_mut() {
                    top.text.push_str(&normalize_line_ends(&raw));
                }
            }
            Event::GeneralRef(r) => {
                let resolved = match r
                    .resolve_char_ref()
                    .map_err(|e| format!("invalid XML: {e}"))?
                {
                    Some(c) if forbidden(c) => return Err(forbidden_reference(c)),
                    Some(c) => c.to_string(),
                    None => {
                        let name = r.decode().map_err(|e| format!("invalid XML: {e}"))?;
                        quick_xml::escape::unescape(&format!("&{name};"))
                            .map_err(|e| format!("invalid XML entity: {e}"))?
                            .into_owned()
                    }
                };
                if let Some(top) = stack.last_mut() {
                    top.text.push_str(&resolved);
                }
            }
            Event::Eof => break,
            Event::Decl(_) | Event::Comment(_) | Event::PI(_) | Event::DocType(_) => {}
        }
    }
    if !stack.is_empty() {
        return Err("XML ended before every element was closed".into());
    }
    let (name, value) = root.ok_or("XML has no root element")?;
    Ok(Value::Object(arena.alloc_slice_copy(&[(name, value)])))
}

/// An element being read: its members are gathered here and copied into
/// the arena once, when it ends, so a child repeated n times costs O(n)
/// (growing an arena array on every repeat kept each old copy: O(n²) bytes).
struct Element<'a> {
    name: &'a str,
    members: Vec<(&'a str, Member<'a>)>,
    /// Where each child name is in `members`, once there are more than
    /// [`INDEX_FROM`] (a scan is cheaper for the usual handful).
    index: Option<HashMap<&'a str, usize>>,
    text: String,
    has_structure: bool,
}

/// A member so far: one child (or attribute), or a repeated child's items.
enum Member<'a> {
    One(Value<'a>),
    Many(Vec<Value<'a>>),
}

/// Members from which an element looks child names up in a map.
const INDEX_FROM: usize = 16;

impl<'a> Element<'a> {
    fn new(name: &'a str) -> Self {
        Element {
            name,
            members: Vec::new(),
            index: None,
            text: String::new(),
            has_structure: false,
        }
    }

    /// Adds a child element: a repeated name turns its member into an
    /// array, in document order.
    fn add_child(&mut self, name: &'a str, value: Value<'a>) {
        self.has_structure = true;
        let at = match &mut self.index {
            Some(index) => index.get(name).copied(),
            None => self.members.iter().position(|(k, _)| *k == name),
        };
        match at {
            Some(at) => {
                let slot = &mut self.members[at].1;
                match slot {
                    Member::Many(items) => items.push(value),
                    Member::One(first) => {
                        let first = *first;
                        *slot = Member::Many(vec![first, value]);
                    }
                }
            }
            None => {
                if let Some(index) = &mut self.index {
                    index.insert(name, self.members.len());
                }
                self.members.push((name, Member::One(value)));
                if self.index.is_none() && self.members.len() > INDEX_FROM {
                    // Attributes (`@name`) never share a child's name.
                    let index = self
                        .members
                        .iter()
                        .enumerate()
                        .map(|(i, (k, _))| (*k, i))
                        .collect();
                    self.index = Some(index);
                }
            }
        }
    }

    fn finish(self, arena: &'a Bump) -> Value<'a> {
        // XML's whitespace only (a no-break space is data).
        let text = self
            .text
            .trim_matches(|c| matches!(c, ' ' | '\t' | '\n' | '\r'));
        if !self.has_structure {
            return if text.is_empty() {
                Value::Null
            } else {
                Value::Str(arena.alloc_str(text))
            };
        }
        let text = (!text.is_empty()).then(|| ("#text", Value::Str(arena.alloc_str(text))));
        let mut out = bumpalo::collections::Vec::with_capacity_in(
            self.members.len() + usize::from(text.is_some()),
            arena,
        );
        out.extend(self.members.into_iter().map(|(k, m)| match m {
            Member::One(v) => (k, v),
            Member::Many(items) => (k, Value::Array(arena.alloc_slice_copy(&items))),
        }));
        out.extend(text);
        Value::Object(out.into_bump_slice())
    }
}

fn attach<'a>(
    stack: &mut [Element<'a>],
    root: &mut Option<(&'a str, Value<'a>)>,
    name: &'a str,
    value: Value<'a>,
) -> Result<(), String> {
    let Some(parent) = stack.last_mut() else {
        if root.is_some() {
            return Err("XML has more than one root element".into());
        }
        *root = Some((name, value));
        return Ok(());
    };
    parent.add_child(name, value);
    Ok(())
}

/// Serializes `value` as an XML document under `root`.
pub fn to_xml(value: &Value<'_>, root: &str) -> Result<String, String> {
    sluice_compiler::functions::check_xml_name(root)?;
    // Its items would each be a root element: not a document (`parse_xml`
    // refuses the text it would make).
    if let Value::Array(_) = value {
        return Err(format!(
            "an XML document has one root element, and the source is an array: \
             publish an object such as {{\"item\": [...]}} (its items become \
             repeated <item> elements under <{root}>)"
        ));
    }
    let mut out = String::with_capacity(128);
    write_element(root, value, &mut out, 0)?;
    Ok(out)
}

fn write_element(
    name: &str,
    value: &Value<'_>,
    out: &mut String,
    depth: usize,
) -> Result<(), String> {
    if depth > MAX_XML_DEPTH {
        return Err(format!("value nests deeper than {MAX_XML_DEPTH} levels"));
    }
    match value {
        Value::Array(items) => {
            for item in *items {
                // Repeated elements flatten one level; a second would be
                // merged into the first, and could not be read back.
                if let Value::Array(_) = item {
                    return Err(format!(
                        "'{name}' holds an array inside an array, which has no XML form: \
                         wrap each inner array in an object ({{\"item\": [...]}})"
                    ));
                }
                write_element(name, item, out, depth + 1)?;
            }
        }
        Value::Object(members) => {
            sluice_compiler::functions::check_xml_name(name)?;
            out.push('<');
            out.push_str(name);
            for (k, v) in members.iter() {
                if let Some(attr) = k.strip_prefix('@') {
                    sluice_compiler::functions::check_xml_name(attr).map_err(|_| {
                        format!("key '{k}': '{attr}' is not a valid XML attribute name")
                    })?;
                    out.push(' ');
                    out.push_str(attr);
                    out.push_str("=\"");
                    push_scalar(attr, v, out, true)?;
                    out.push('"');
                }
            }
            out.push('>');
            for (k, v) in members.iter() {
                if *k == "#text" {
                    push_scalar(name, v, out, false)?;
                } else if !k.starts_with('@') {
                    write_element(k, v, out, depth + 1)?;
                }
            }
            out.push_str("</");
            out.push_str(name);
            out.push('>');
        }
        Value::Null => {
            sluice_compiler::functions::check_xml_name(name)?;
            out.push('<');
            out.push_str(name);
            out.push_str("/>");
        }
        scalar => {
            sluice_compiler::functions::check_xml_name(name)?;
            out.push('<');
            out.push_str(name);
            out.push('>');
            push_scalar(name, scalar, out, false)?;
            out.push_str("</");
            out.push_str(name);
            out.push('>');
        }
    }
    Ok(())
}

/// Writes a scalar's text, escaped. A character XML 1.0 cannot carry at
/// all (a control character other than tab, line feed and carriage
/// return, or U+FFFE/U+FFFF), even as a character reference, is an error
/// naming the element or attribute: the document would not parse.
fn push_scalar(name: &str, v: &Value<'_>, out: &mut String, attribute: bool) -> Result<(), String> {
    let text: std::borrow::Cow<'_, str> = match v {
        Value::Null => "".into(),
        Value::Bool(b) => if *b { "true" } else { "false" }.into(),
        Value::Str(s) => (*s).into(),
        Value::Int(_) | Value::Float(_) | Value::Array(_) | Value::Object(_) => {
            v.to_json_string().into()
        }
    };
    if let Some(c) = text.chars().find(|&c| forbidden(c)) {
        return Err(format!(
            "'{name}' holds the character U+{:04X}, which XML 1.0 cannot carry",
            u32::from(c)
        ));
    }
    push_escaped(&text, out, attribute);
    Ok(())
}

/// A document's line ends as a parser reads them: CR LF and a lone CR are
/// each one line feed (XML 1.0, 2.11). Character references are not line
/// ends: `&#13;` stays a carriage return.
fn normalize_line_ends(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\r') {
        text.replace("\r\n", "\n").replace('\r', "\n").into()
    } else {
        text.into()
    }
}

fn forbidden_reference(c: char) -> String {
    format!(
        "invalid XML: a character reference names U+{:04X}, which XML 1.0 does not allow",
        u32::from(c)
    )
}

/// A character XML 1.0 cannot carry at all: a control character other
/// than tab, line feed and carriage return, or U+FFFE/U+FFFF.
fn forbidden(c: char) -> bool {
    matches!(c, '\0'..='\x08' | '\x0B' | '\x0C' | '\x0E'..='\x1F' | '\u{FFFE}' | '\u{FFFF}')
}

/// Escapes text for element content or a (double-quoted) attribute value,
/// so that a conforming parser reads back exactly `text`: a parser turns a
/// literal carriage return into a line feed everywhere, and a literal tab
/// or line feed in an attribute value into a space (XML 1.0, 2.11 and
/// 3.3.3), so those are written as character references (audit 95: a
/// `title` holding a line break was read back with a space).
fn push_escaped(text: &str, out: &mut String, attribute: bool) {
    let mut plain = 0;
    for (i, b) in text.bytes().enumerate() {
        let escaped = match b {
            b'&' => "&amp;",
            b'<' => "&lt;",
            b'>' => "&gt;",
            b'\r' => "&#13;",
            b'"' if attribute => "&quot;",
            b'\'' if attribute => "&apos;",
            b'\t' if attribute => "&#9;",
            b'\n' if attribute => "&#10;",
            _ => continue,
        };
        out.push_str(&text[plain..i]);
        out.push_str(escaped);
        plain = i + 1;
    }
    out.push_str(&text[plain..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_json(text: &str) -> serde_json::Value {
        let arena = Bump::new();
        parse(text, &arena).unwrap().to_json()
    }

    #[test]
    fn maps_elements_attributes_and_repeats() {
        let got = parse_json(
            r#"<?xml version="1.0"?><order id="7"><item>a &amp; b</item><item>c</item><note/><total>9.5</total></order>"#,
        );
        assert_eq!(
            got,
            json!({"order": {"@id": "7", "item": ["a & b", "c"], "note": null, "total": "9.5"}})
        );
    }

    #[test]
    fn repeated_children_cost_memory_in_proportion() {
        // Each repeat used to copy the array so far into the arena: 5,000
        // repeats took about 300 MB.
        let n = 5_000;
        let text = format!("<r>{}</r>", "<a>x</a>".repeat(n));
        let arena = Bump::new();
        let v = parse(&text, &arena).unwrap();
        assert!(
            arena.allocated_bytes() < 64 * n,
            "{}",
            arena.allocated_bytes()
        );
        let items = v.get("r").and_then(|r| r.get("a")).unwrap();
        assert_eq!(items.as_array().map(|a| a.len()), Some(n));
    }

    #[test]
    fn many_child_names_keep_document_order_and_group_repeats() {
        // Past 16 members the names are looked up in a map.
        let mut text = String::from("<r k=\"v\">");
        for i in 0..40 {
            text.push_str(&format!("<c{i}>{i}</c{i}>"));
        }
        text.push_str("<c3>again</c3><c39>last</c39><c3>third</c3></r>");
        let got = parse_json(&text);
        let r = got["r"].as_object().unwrap();
        let names: Vec<&str> = r.keys().map(String::as_str).collect();
        assert_eq!(names.len(), 41);
        assert_eq!((names[0], names[1], names[40]), ("@k", "c0", "c39"));
        assert_eq!(r["c3"], json!(["3", "again", "third"]));
        assert_eq!(r["c39"], json!(["39", "last"]));
        assert_eq!(r["c20"], json!("20"));
    }

    #[test]
    fn mixed_text_goes_to_hash_text() {
        assert_eq!(
            parse_json("<a x=\"1\">hi</a>"),
            json!({"a": {"@x": "1", "#text": "hi"}})
        );
        assert_eq!(parse_json("<a><![CDATA[<b>]]></a>"), json!({"a": "<b>"}));
    }

    #[test]
    fn rejects_bad_xml() {
        let arena = Bump::new();
        assert!(parse("<a><b></a>", &arena).is_err());
        assert!(parse("", &arena).is_err());
        assert!(parse("<a/><b/>", &arena).is_err());
        // A character XML 1.0 does not allow (audit 95: it was taken), as
        // it is or named by a reference (audit 100).
        assert_eq!(
            parse("<r>\u{1}</r>", &arena).unwrap_err(),
            "invalid XML at byte 3: the character U+0001 is not allowed in XML 1.0"
        );
        for doc in [
            "<r>&#1;</r>",
            "<r>&#x1;</r>",
            "<r a='&#1;'/>",
            "<r>&#xFFFE;</r>",
        ] {
            let e = parse(doc, &arena).unwrap_err();
            assert!(
                e.starts_with("invalid XML: a character reference names U+"),
                "{doc}: {e}"
            );
        }
    }

    /// Line ends and attribute whitespace as every parser reads them (XML
    /// 1.0, 2.11, 3.3.3); references keep what they name; only XML's
    /// whitespace is trimmed.
    #[test]
    fn reads_line_ends_and_attribute_whitespace_as_xml_does() {
        assert_eq!(parse_json("<r>a\r\nb\rc</r>"), json!({"r": "a\nb\nc"}));
        assert_eq!(
            parse_json("<r><![CDATA[a\r\nb]]></r>"),
            json!({"r": "a\nb"})
        );
        assert_eq!(
            parse_json("<r a='x\ty\nz\r\nw' b='&#9;&#10;&#13;'/>"),
            json!({"r": {"@a": "x y z w", "@b": "\t\n\r"}})
        );
        assert_eq!(parse_json("<r>a&#13;&#10;b</r>"), json!({"r": "a\r\nb"}));
        assert_eq!(
            parse_json("<r>\u{a0}x\u{a0}</r>"),
            json!({"r": "\u{a0}x\u{a0}"})
        );
        assert_eq!(parse_json("<r>\u{3000}</r>"), json!({"r": "\u{3000}"}));
    }

    #[test]
    fn writes_xml() {
        let arena = Bump::new();
        let src = json!({"@id": "7", "item": ["a & b", "c"], "n": 1.5, "none": null});
        let v = Value::from_json(&src, &arena);
        assert_eq!(
            to_xml(&v, "order").unwrap(),
            r#"<order id="7"><item>a &amp; b</item><item>c</item><n>1.5</n><none/></order>"#
        );
        assert!(to_xml(&v, "1bad").is_err());
        // A bare `@` key names an attribute, and says so (audit 69).
        let attr = json!({"@": 1});
        assert_eq!(
            to_xml(&Value::from_json(&attr, &arena), "order").unwrap_err(),
            "key '@': '' is not a valid XML attribute name"
        );
        // What publish_xml writes, parse_xml reads back to the same strings.
        let back = parse(&to_xml(&v, "order").unwrap(), &arena)
            .unwrap()
            .to_json();
        assert_eq!(back["order"]["item"], json!(["a & b", "c"]));
    }

    /// An array at the top would make one root element per item: not a
    /// document (it was written as `<root>1</root><root>2</root>`).
    #[test]
    fn a_top_level_array_is_refused() {
        let arena = Bump::new();
        let list = json!([1, 2]);
        let v = Value::from_json(&list, &arena);
        let e = to_xml(&v, "root").unwrap_err();
        assert!(e.contains("one root element"), "{e}");
        let object = json!({"item": [1, 2]});
        let wrapped = Value::from_json(&object, &arena);
        assert_eq!(
            to_xml(&wrapped, "root").unwrap(),
            "<root><item>1</item><item>2</item></root>"
        );
    }

    /// What XML cannot carry is refused, naming where, rather than written
    /// into a document other parsers reject (a control character) or that
    /// reads back as something else (an array inside an array, flattened).
    #[test]
    fn what_xml_cannot_carry_is_refused() {
        let arena = Bump::new();
        let ctl = json!({"ctl": "a\u{1}b"});
        let e = to_xml(&Value::from_json(&ctl, &arena), "root").unwrap_err();
        assert_eq!(
            e,
            "'ctl' holds the character U+0001, which XML 1.0 cannot carry"
        );
        let attr = json!({"@id": "x\u{1F}"});
        let e = to_xml(&Value::from_json(&attr, &arena), "root").unwrap_err();
        assert!(e.starts_with("'id' holds the character U+001F"), "{e}");
        let nested = json!({"arr": [1, [2, 3]]});
        let e = to_xml(&Value::from_json(&nested, &arena), "root").unwrap_err();
        assert!(e.starts_with("'arr' holds an array inside an array"), "{e}");
        // Tab, line feed and carriage return are characters XML keeps;
        // written so that a parser's normalisation gives them back (a
        // literal CR reads as LF, a literal tab or LF in an attribute as a
        // space).
        let ok = json!({"t": {"@title": "l1\nl2\tt\r'\"", "#text": "a\r\nb\tc<&>'\""}});
        let xml = to_xml(&Value::from_json(&ok, &arena), "root").unwrap();
        assert_eq!(
            xml,
            "<root><t title=\"l1&#10;l2&#9;t&#13;&apos;&quot;\">a&#13;\nb\tc&lt;&amp;&gt;'\"</t></root>"
        );
        assert_eq!(parse_json(&xml), json!({"root": ok}));
    }
}
