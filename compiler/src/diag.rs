//! Validation diagnostics: `{field, message}` pairs whose `field` is a path
//! mirroring the submitted JSON (`tasks[0].function.input.connector`).
//!
//! These are exactly the elements of the error envelope's `details` array, so
//! the HTTP layer serializes them as they are.

use serde::Serialize;
use std::fmt;

/// One problem found in a definition.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// Where the problem is. The empty string names the document itself (for
    /// example when the body is not a JSON object), because the empty path is
    /// the root in this notation and a client can print it as-is.
    pub field: String,
    pub message: String,
}

/// The message of an unknown-key warning starts with this.
pub const UNKNOWN_FIELD: &str = "unknown field, ignored";

/// A refused definition's problems, with its unknown-field warnings among
/// them: a misspelt field is most likely why a required one is missing
/// (`sql` for `query`, `base_url` for `url`), and the caller would not
/// see it until the next attempt (audit 118). Nothing is added to a
/// definition without problems.
pub fn with_misspellings(problems: &mut Vec<Diagnostic>, warnings: &[Diagnostic]) {
    if problems.is_empty() {
        return;
    }
    for w in warnings {
        if w.message.starts_with(UNKNOWN_FIELD) && !problems.contains(w) {
            problems.push(w.clone());
        }
    }
}

/// What a rule is evaluated against, for [`stray_reads`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleRoot {
    /// A workflow's JSONLogic: the data context.
    Workflow,
    /// A channel's `validation_logic`: the request's data and its parts.
    ChannelValidation,
    /// A channel's `key_logic`: as `validation_logic`, with the client and
    /// the channel.
    ChannelKey,
}

impl RuleRoot {
    fn roots(self) -> &'static [&'static str] {
        match self {
            RuleRoot::Workflow => &["data", "metadata", "temp_data", "payload"],
            RuleRoot::ChannelValidation => &["data", "headers", "query", "path"],
            RuleRoot::ChannelKey => &["data", "headers", "query", "path", "client_ip", "channel"],
        }
    }

    /// The path most likely meant by a stray read, or `None` when what it
    /// names cannot be read here at all.
    fn suggest(self, path: &str) -> Option<String> {
        let (first, rest) = path.split_once('.').unwrap_or((path, ""));
        let second = rest.split('.').next().unwrap_or_default();
        // What a request's metadata holds, and a Kafka message's
        // (`src/kafka.rs`).
        let in_metadata = crate::def::REQUEST_METADATA.contains(&first)
            || matches!(first, "topic" | "partition" | "offset" | "key");
        match self {
            RuleRoot::Workflow if in_metadata => Some(format!("metadata.{path}")),
            RuleRoot::Workflow => Some(format!("data.{path}")),
            // A channel's rules see the request's parts, not a context.
            _ if first == "metadata" && matches!(second, "headers" | "query" | "path") => {
                Some(rest.to_owned())
            }
            _ if matches!(first, "metadata" | "temp_data") => None,
            _ if first == "payload" => Some(format!(
                "data{}",
                path.strip_prefix("payload").unwrap_or("")
            )),
            RuleRoot::ChannelValidation if matches!(first, "client_ip" | "channel") => None,
            _ => Some(format!("data.{path}")),
        }
    }
}

/// A warning when a rule that should judge each request is a constant
/// that refuses every request, or a string (`"data.qty > 0"` is text, not
/// an expression): it gives the same answer every time. `passes` says whether that answer lets requests
/// through (channel `validation_logic` takes any truthy value; a workflow
/// `validation` rule only `true`).
pub fn constant_rule(
    logic: &crate::logic::Logic,
    field: &str,
    each: &str,
    passes: impl Fn(&serde_json::Value) -> bool,
    out: &mut Vec<Diagnostic>,
) {
    // A constant that lets everything through is harmless unless it is a
    // string, which was meant as an expression.
    let Some(value) = logic.constant().filter(|v| v.is_string() || !passes(v)) else {
        return;
    };
    let outcome = match (passes(value), each) {
        (true, _) => format!("every {each} passes"),
        (false, "run") => "every run fails it".to_owned(),
        (false, _) => format!("every {each} is refused"),
    };
    let hint = if value.is_string() {
        " (a string is a constant, not an expression: write JSONLogic such as {\">\": [{\"var\": \"data.qty\"}, 0]})"
    } else {
        ""
    };
    out.push(Diagnostic::new(
        field,
        format!("is a constant ({value}), so {outcome}{hint}"),
    ));
}

/// A warning for each read of `logic` outside the roots of what it is
/// evaluated against (`{"var": "order.total"}` in a workflow): such a read
/// is always missing, so the rule silently works on `null`.
pub fn stray_reads(
    logic: &crate::logic::Logic,
    field: &str,
    root: RuleRoot,
    out: &mut Vec<Diagnostic>,
) {
    let roots = root.roots();
    for path in logic.stray_reads(roots) {
        let first = path.split('.').next().unwrap_or_default();
        let what = match root {
            RuleRoot::Workflow => "the data context",
            RuleRoot::ChannelValidation => "what validation_logic reads",
            RuleRoot::ChannelKey => "what key_logic reads",
        };
        let hint = match root.suggest(&path) {
            Some(meant) => format!("did you mean '{meant}'?"),
            None => "it cannot be read here".to_owned(),
        };
        out.push(Diagnostic::new(
            field,
            format!(
                "reads '{path}', which is always missing: '{first}' is not in {what} ({}); {hint}",
                roots.join(", ")
            ),
        ));
    }
}

impl Diagnostic {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            field: field.into(),
            message: message.into(),
        }
    }

    /// `<field>: is required`.
    pub fn required(field: &FieldPath) -> Diagnostic {
        Diagnostic::new(field.as_str(), "is required")
    }

    /// `<field>: expected <expected>, got <type of actual>`.
    pub fn type_mismatch(
        field: &FieldPath,
        expected: &str,
        actual: &serde_json::Value,
    ) -> Diagnostic {
        Diagnostic::new(
            field.as_str(),
            format!("expected {expected}, got {}", type_name(actual)),
        )
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

/// The JSON type name used in messages: `null`, `boolean`, `integer`,
/// `number`, `string`, `array`, `object`. A number without a fractional part
/// is reported as `integer` so that `expected integer, got number` says what
/// is wrong with `1.5`.
pub fn type_name(v: &serde_json::Value) -> &'static str {
    use serde_json::Value as J;
    match v {
        J::Null => "null",
        J::Bool(_) => "boolean",
        J::Number(n) if n.is_i64() || n.is_u64() => "integer",
        J::Number(_) => "number",
        J::String(_) => "string",
        J::Array(_) => "array",
        J::Object(_) => "object",
    }
}

/// An integer beyond `i64` (`9223372036854775808`, or one beyond `u64`,
/// which serde_json reads as a float): out of range, not of the wrong type.
/// A float of such a size written with an exponent counts too (it cannot be
/// told apart once parsed, and is out of range either way).
pub fn is_huge_integer(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Number(n) => {
            n.as_i64().is_none()
                && (n.is_u64()
                    || n.as_f64()
                        .is_some_and(|f| f.fract() == 0.0 && f.abs() >= 9.2e18))
        }
        _ => false,
    }
}

/// A number as the service writes numbers in its answers (an integer
/// beyond u64, which serde_json reads as a float, as `100000000000000000000`
/// or `1.2345678901234568e22`, not Rust's `1e+20`); anything else as JSON.
pub fn number_text(v: &serde_json::Value) -> String {
    match v.as_f64() {
        Some(f) if !v.is_i64() && !v.is_u64() => {
            let mut out = Vec::new();
            crate::value::write_float(f, &mut out);
            String::from_utf8(out).unwrap_or_default()
        }
        _ => v.to_string(),
    }
}

/// A field path under construction. Cheap enough for validation (one small
/// string per visited field), and it renders exactly as `details[].field`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct FieldPath(String);

impl FieldPath {
    /// The document itself; renders as the empty string.
    pub fn root() -> FieldPath {
        FieldPath(String::new())
    }

    /// The member `key` of this object: `a.key`, or `key` at the root. A key
    /// that would make the path ambiguous (empty, or containing `.`, `[`, `]`,
    /// `"` or whitespace) is written JSON-quoted in brackets: `headers["x.y"]`.
    pub fn key(&self, key: &str) -> FieldPath {
        let plain = !key.is_empty()
            && !key
                .chars()
                .any(|c| matches!(c, '.' | '[' | ']' | '"') || c.is_whitespace());
        let mut s = String::with_capacity(self.0.len() + key.len() + 4);
        s.push_str(&self.0);
        if plain {
            if !s.is_empty() {
                s.push('.');
            }
            s.push_str(key);
        } else {
            s.push('[');
            s.push_str(&serde_json::Value::from(key).to_string());
            s.push(']');
        }
        FieldPath(s)
    }

    /// The element `index` of this array: `tasks[3]`.
    pub fn index(&self, index: usize) -> FieldPath {
        FieldPath(format!("{}[{index}]", self.0))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<FieldPath> for String {
    fn from(p: FieldPath) -> String {
        p.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths_render_like_the_spec() {
        let root = FieldPath::root();
        assert_eq!(root.as_str(), "");
        assert!(root.is_root());
        assert_eq!(root.key("name").as_str(), "name");
        assert_eq!(
            root.key("tasks")
                .index(0)
                .key("function")
                .key("input")
                .key("connector")
                .as_str(),
            "tasks[0].function.input.connector"
        );
        assert_eq!(
            root.key("tasks")
                .index(2)
                .key("tasks")
                .index(1)
                .key("id")
                .to_string(),
            "tasks[2].tasks[1].id"
        );
        assert_eq!(
            root.key("config_json")
                .key("rate_limit")
                .key("requests_per_second")
                .as_str(),
            "config_json.rate_limit.requests_per_second"
        );
        assert_eq!(root.index(4).as_str(), "[4]");
    }

    #[test]
    fn ambiguous_keys_are_quoted() {
        let h = FieldPath::root().key("headers");
        assert_eq!(h.key("x-api-key").as_str(), "headers.x-api-key");
        assert_eq!(h.key("x.y").as_str(), r#"headers["x.y"]"#);
        assert_eq!(h.key("").as_str(), r#"headers[""]"#);
        assert_eq!(h.key("a b").as_str(), r#"headers["a b"]"#);
        assert_eq!(FieldPath::root().key("a.b").as_str(), r#"["a.b"]"#);
    }

    #[test]
    fn type_names() {
        assert_eq!(type_name(&json!(null)), "null");
        assert_eq!(type_name(&json!(true)), "boolean");
        assert_eq!(type_name(&json!(3)), "integer");
        assert_eq!(type_name(&json!(-3)), "integer");
        assert_eq!(type_name(&json!(1.5)), "number");
        assert_eq!(type_name(&json!("x")), "string");
        assert_eq!(type_name(&json!([])), "array");
        assert_eq!(type_name(&json!({})), "object");
    }

    #[test]
    fn helpers_and_display() {
        let p = FieldPath::root().key("tasks").index(0).key("name");
        assert_eq!(
            Diagnostic::required(&p),
            Diagnostic::new("tasks[0].name", "is required")
        );
        assert_eq!(
            Diagnostic::type_mismatch(&p, "string", &json!(7)).message,
            "expected string, got integer"
        );
        assert_eq!(
            Diagnostic::required(&p).to_string(),
            "tasks[0].name: is required"
        );
        assert_eq!(
            Diagnostic::new("", "expected object, got array").to_string(),
            "expected object, got array"
        );
        assert_eq!(
            serde_json::to_value(Diagnostic::required(&p)).unwrap(),
            json!({"field": "tasks[0].name", "message": "is required"})
        );
    }
}
