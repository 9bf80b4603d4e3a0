//! The built-in function catalogue as data: names, kinds and input schemas.
//!
//! This table is the single source of truth for three consumers: the
//! validator (which schema-checks connector and composition inputs on
//! create/update), `GET /api/v1/admin/functions` (which serves the same table
//! through [`catalogue_json`]), and the plan compiler (which resolves a name
//! to a [`Function`] once, so nothing looks a function up by name at run time).

use serde::Serialize;

/// What a function touches, which decides whether its input is checked at
/// create time: the spec schema-checks connector and composition inputs only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FunctionKind {
    /// Pure transformation of the data context; input errors show at execution.
    Data,
    /// Calls an external system through a named connector.
    Connector,
    /// Invokes another channel in-process (`channel_call`).
    Composition,
}

/// The sixteen built-in functions. A closed enum so that dispatch is a `match`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Function {
    ParseJson,
    ParseXml,
    Map,
    Filter,
    Validation,
    Log,
    PublishJson,
    PublishXml,
    HttpCall,
    DbRead,
    DbWrite,
    CacheRead,
    CacheWrite,
    MongoRead,
    PublishKafka,
    ChannelCall,
}

impl Function {
    /// Every function, in the spec's order.
    pub const ALL: [Function; 16] = [
        Function::ParseJson,
        Function::ParseXml,
        Function::Map,
        Function::Filter,
        Function::Validation,
        Function::Log,
        Function::PublishJson,
        Function::PublishXml,
        Function::HttpCall,
        Function::DbRead,
        Function::DbWrite,
        Function::CacheRead,
        Function::CacheWrite,
        Function::MongoRead,
        Function::PublishKafka,
        Function::ChannelCall,
    ];

    /// Resolves a task's `function.name`. The match is exact and
    /// case-sensitive, as the spec requires; `validate` is the one alias.
    pub fn from_name(name: &str) -> Option<Function> {
        if name == "validate" {
            return Some(Function::Validation);
        }
        Function::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The canonical name (never the alias).
    pub fn name(self) -> &'static str {
        match self {
            Function::ParseJson => "parse_json",
            Function::ParseXml => "parse_xml",
            Function::Map => "map",
            Function::Filter => "filter",
            Function::Validation => "validation",
            Function::Log => "log",
            Function::PublishJson => "publish_json",
            Function::PublishXml => "publish_xml",
            Function::HttpCall => "http_call",
            Function::DbRead => "db_read",
            Function::DbWrite => "db_write",
            Function::CacheRead => "cache_read",
            Function::CacheWrite => "cache_write",
            Function::MongoRead => "mongo_read",
            Function::PublishKafka => "publish_kafka",
            Function::ChannelCall => "channel_call",
        }
    }

    pub fn kind(self) -> FunctionKind {
        match self {
            Function::ParseJson
            | Function::ParseXml
            | Function::Map
            | Function::Filter
            | Function::Validation
            | Function::Log
            | Function::PublishJson
            | Function::PublishXml => FunctionKind::Data,
            Function::HttpCall
            | Function::DbRead
            | Function::DbWrite
            | Function::CacheRead
            | Function::CacheWrite
            | Function::MongoRead
            | Function::PublishKafka => FunctionKind::Connector,
            Function::ChannelCall => FunctionKind::Composition,
        }
    }

    /// Whether the input is schema-checked when a workflow is created or updated.
    pub fn checked_at_create(self) -> bool {
        self.kind() != FunctionKind::Data
    }

    /// The input fields of this function (see [`input_schema`]).
    pub fn input_schema(self) -> &'static [FieldSchema] {
        input_schema(self)
    }
}

/// The JSON type a field accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldType {
    String,
    /// Any JSON number (integer or fractional).
    Number,
    /// A JSON number without a fractional part.
    Integer,
    Boolean,
    Object,
    Array,
    /// Any JSON value, including null.
    Any,
    /// A JSONLogic expression; any JSON value is a valid expression (a plain
    /// literal evaluates to itself), so the type check accepts everything and
    /// the JSONLogic compiler reports what it cannot compile.
    Jsonlogic,
}

impl FieldType {
    /// The name used in `expected <type>, got <type>` messages.
    pub fn name(self) -> &'static str {
        match self {
            FieldType::String => "string",
            FieldType::Number => "number",
            FieldType::Integer => "integer",
            FieldType::Boolean => "boolean",
            FieldType::Object => "object",
            FieldType::Array => "array",
            FieldType::Any => "any",
            FieldType::Jsonlogic => "jsonlogic",
        }
    }
}

/// An extra rule on a field's value beyond its type. Kept in the table (not
/// coded in the validator) so the served schema tells clients about it too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    None,
    /// The string must be one of these values (exact match).
    OneOf(&'static [&'static str]),
    /// The number must be greater than zero.
    Positive,
    /// An object whose values are all strings (header maps).
    StringMap,
}

impl Constraint {
    fn is_none(&self) -> bool {
        matches!(self, Constraint::None)
    }
}

/// One input field of a built-in function, as in the spec's input table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct FieldSchema {
    pub name: &'static str,
    #[serde(rename = "type")]
    pub ty: FieldType,
    pub required: bool,
    /// The default as the spec words it (`"GET"`, `"30000"`, `"{}"`, ...);
    /// informational, served to clients.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default: Option<&'static str>,
    pub description: &'static str,
    /// Groups fields in the admin UI: `connection`, `request`, `output`, `control`.
    pub category: &'static str,
    #[serde(skip_serializing_if = "Constraint::is_none")]
    pub constraint: Constraint,
}

/// Shorthand constructor so the tables below stay one line per field.
const fn f(
    name: &'static str,
    ty: FieldType,
    required: bool,
    default: Option<&'static str>,
    category: &'static str,
    description: &'static str,
) -> FieldSchema {
    FieldSchema {
        name,
        ty,
        required,
        default,
        description,
        category,
        constraint: Constraint::None,
    }
}

const fn with(mut field: FieldSchema, constraint: Constraint) -> FieldSchema {
    field.constraint = constraint;
    field
}

use FieldType as T;

/// The HTTP methods `http_call` may use.
pub const HTTP_CALL_METHODS: &[&str] = &["GET", "POST", "PUT", "PATCH", "DELETE"];

// The tables below are data, one line per field, in the spec's order; they are
// kept out of rustfmt so that they stay readable as tables.

#[rustfmt::skip]
const PARSE: &[FieldSchema] = &[
    f("source", T::String, true, None, "request", "Dotted context path the raw value is read from, for example `payload`."),
    f("target", T::String, true, None, "output", "Field under `data` receiving the parsed value (`order` is `data.order`)."),
];

#[rustfmt::skip]
const MAP: &[FieldSchema] = &[
    f("mappings", T::Array, true, None, "request", "Ordered items `{path: string (dotted, required), logic: JSONLogic (required)}`."),
];

#[rustfmt::skip]
const FILTER: &[FieldSchema] = &[
    f("condition", T::Jsonlogic, true, None, "control", "The pipeline continues only when this is truthy."),
    with(f("on_reject", T::String, false, Some("halt"), "control", "`halt` stops the workflow; `skip` skips only this task."),
        Constraint::OneOf(&["halt", "skip"])),
];

#[rustfmt::skip]
const VALIDATION: &[FieldSchema] = &[
    f("rules", T::Array, true, None, "request", "Items `{logic: JSONLogic (required), message: string (required)}`; a rule passes only when logic is exactly true."),
];

#[rustfmt::skip]
const LOG: &[FieldSchema] = &[
    f("message", T::Jsonlogic, true, None, "request", "The log message."),
    with(f("level", T::String, false, Some("info"), "control", "Log level."),
        Constraint::OneOf(&["trace", "debug", "info", "warn", "error"])),
    f("fields", T::Object, false, Some("{}"), "request", "Map of field name to JSONLogic."),
];

#[rustfmt::skip]
const PUBLISH_JSON: &[FieldSchema] = &[
    f("source", T::String, true, None, "request", "Field under `data` to serialize."),
    f("target", T::String, true, None, "output", "Field under `data` receiving the string."),
    f("pretty", T::Boolean, false, Some("false"), "control", "Pretty-print the JSON."),
];

#[rustfmt::skip]
const PUBLISH_XML: &[FieldSchema] = &[
    f("source", T::String, true, None, "request", "Field under `data` to serialize."),
    f("target", T::String, true, None, "output", "Field under `data` receiving the string."),
    f("root_element", T::String, false, Some("root"), "control", "XML root element name."),
];

#[rustfmt::skip]
const HTTP_CALL: &[FieldSchema] = &[
    f("connector", T::String, true, None, "connection", "HTTP connector name."),
    with(f("method", T::String, false, Some("GET"), "request", "HTTP method."),
        Constraint::OneOf(HTTP_CALL_METHODS)),
    f("path", T::String, false, None, "request", "Appended to the connector's base URL."),
    f("path_logic", T::Jsonlogic, false, None, "request", "Dynamic path, used instead of `path`."),
    with(f("headers", T::Object, false, Some("{}"), "request", "Request headers, string to string."),
        Constraint::StringMap),
    f("body", T::Any, false, None, "request", "Static body, sent as JSON."),
    f("body_logic", T::Jsonlogic, false, None, "request", "Dynamic body, used instead of `body`."),
    f("response_path", T::String, false, None, "output", "Dotted path for the response body; when omitted the body is discarded."),
    with(f("timeout_ms", T::Number, false, Some("30000"), "control", "Per-request timeout in milliseconds."),
        Constraint::Positive),
];

#[rustfmt::skip]
const DB_READ: &[FieldSchema] = &[
    f("connector", T::String, true, None, "connection", "SQL connector name."),
    f("query", T::String, true, None, "request", "SELECT (or a write with RETURNING) with placeholders: `?` for SQLite/MySQL, `$1`, `$2`, ... for PostgreSQL."),
    f("params", T::Array, false, None, "request", "Values bound to the placeholders in order; each item is JSONLogic (a constant, or {\"var\": …})."),
    f("output", T::String, false, Some("data"), "output", "Dotted path for the row array."),
];

#[rustfmt::skip]
const DB_WRITE: &[FieldSchema] = &[
    f("connector", T::String, true, None, "connection", "SQL connector name."),
    f("query", T::String, true, None, "request", "INSERT/UPDATE/DELETE with placeholders: `?` for SQLite/MySQL, `$1`, `$2`, ... for PostgreSQL."),
    f("params", T::Array, false, None, "request", "Values bound to the placeholders in order; each item is JSONLogic (a constant, or {\"var\": …})."),
    f("output", T::String, false, Some("data"), "output", "Dotted path receiving `{rows_affected: N}`."),
];

#[rustfmt::skip]
const CACHE_READ: &[FieldSchema] = &[
    f("connector", T::String, true, None, "connection", "Cache connector name."),
    f("key", T::String, true, None, "request", "Cache key; not needed with `key_logic`."),
    f("key_logic", T::Jsonlogic, false, None, "request", "Computes the key, used instead of `key`."),
    f("output", T::String, false, Some("data"), "output", "Dotted path for the value; a missing key yields null."),
];

#[rustfmt::skip]
const CACHE_WRITE: &[FieldSchema] = &[
    f("connector", T::String, true, None, "connection", "Cache connector name."),
    f("key", T::String, true, None, "request", "Cache key; not needed with `key_logic`."),
    f("key_logic", T::Jsonlogic, false, None, "request", "Computes the key, used instead of `key`."),
    f("value", T::Any, true, None, "request", "Value to store: a string as it is, anything else as its JSON text (cache_read parses JSON text back). Not needed with `value_logic`."),
    f("value_logic", T::Jsonlogic, false, None, "request", "Computes the value, used instead of `value`."),
    with(f("ttl_secs", T::Number, false, None, "control", "Time to live in seconds; no expiry when omitted."),
        Constraint::Positive),
];

#[rustfmt::skip]
const MONGO_READ: &[FieldSchema] = &[
    f("connector", T::String, true, None, "connection", "Document database connector name."),
    f("database", T::String, true, None, "request", "Database name."),
    f("collection", T::String, true, None, "request", "Collection name."),
    f("filter", T::Object, false, Some("{}"), "request", "Find filter document (MongoDB extended JSON)."),
    f("filter_logic", T::Jsonlogic, false, None, "request", "Computes the filter document, used instead of `filter`."),
    f("output", T::String, false, Some("data"), "output", "Dotted path for the document array."),
];

#[rustfmt::skip]
const PUBLISH_KAFKA: &[FieldSchema] = &[
    f("connector", T::String, true, None, "connection", "Kafka connector name."),
    f("topic", T::String, true, None, "request", "Topic to publish to."),
    f("key_logic", T::Jsonlogic, false, None, "request", "Derives the message key."),
    f("value_logic", T::Jsonlogic, false, Some("full data context"), "request", "Derives the message value."),
];

#[rustfmt::skip]
const CHANNEL_CALL: &[FieldSchema] = &[
    f("channel", T::String, false, None, "request", "Static target channel name; exactly one of channel / channel_logic."),
    f("channel_logic", T::Jsonlogic, false, None, "request", "Resolves to the channel name; exactly one of channel / channel_logic."),
    f("data", T::Any, false, Some("request payload"), "request", "Payload for the called channel; at most one of data / data_logic."),
    f("data_logic", T::Jsonlogic, false, None, "request", "Dynamic payload; at most one of data / data_logic."),
    f("response_path", T::String, false, Some("data"), "output", "Where the called channel's response is stored."),
    with(f("timeout_ms", T::Number, false, Some("from config"), "control", "Timeout for the call in milliseconds."),
        Constraint::Positive),
];

/// The input fields of a function, from the spec's input table.
pub fn input_schema(f: Function) -> &'static [FieldSchema] {
    match f {
        Function::ParseJson | Function::ParseXml => PARSE,
        Function::Map => MAP,
        Function::Filter => FILTER,
        Function::Validation => VALIDATION,
        Function::Log => LOG,
        Function::PublishJson => PUBLISH_JSON,
        Function::PublishXml => PUBLISH_XML,
        Function::HttpCall => HTTP_CALL,
        Function::DbRead => DB_READ,
        Function::DbWrite => DB_WRITE,
        Function::CacheRead => CACHE_READ,
        Function::CacheWrite => CACHE_WRITE,
        Function::MongoRead => MONGO_READ,
        Function::PublishKafka => PUBLISH_KAFKA,
        Function::ChannelCall => CHANNEL_CALL,
    }
}

/// One entry of the served catalogue.
#[derive(Serialize)]
struct CatalogueEntry {
    name: &'static str,
    kind: FunctionKind,
    fields: &'static [FieldSchema],
}

/// The body of `GET /api/v1/admin/functions`: every connector and composition
/// function with its input schema, `[{name, kind, fields: [...]}]`. Data
/// functions are not listed, as the spec says.
pub fn catalogue_json() -> serde_json::Value {
    let entries: Vec<CatalogueEntry> = Function::ALL
        .into_iter()
        .filter(|f| f.checked_at_create())
        .map(|f| CatalogueEntry {
            name: f.name(),
            kind: f.kind(),
            fields: input_schema(f),
        })
        .collect();
    let mut out =
        serde_json::to_value(entries).expect("the catalogue is plain data and always serializes");
    // Defaults in the field's own JSON type (`30000`, `false`, `{}`), where
    // they are values; the spec's words (`"from config"`) stay text.
    for field in out
        .as_array_mut()
        .into_iter()
        .flatten()
        .filter_map(|e| e["fields"].as_array_mut())
        .flatten()
    {
        let typed = match (field["type"].as_str(), field["default"].as_str()) {
            (Some("number" | "integer"), Some(d)) => d.parse::<u64>().ok().map(Into::into),
            (Some("boolean"), Some(d)) => d.parse::<bool>().ok().map(Into::into),
            (Some("object"), Some("{}")) => Some(serde_json::json!({})),
            _ => None,
        };
        if let Some(typed) = typed {
            field["default"] = typed;
        }
    }
    out
}

/// Whether `name` can be an XML element or attribute name as `publish_xml`
/// writes it (a letter or `_`, then letters, digits, `_`, `-`, `.`, `:`);
/// checked when a plan is compiled (`root_element`) and when a key is written.
pub fn check_xml_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let ok = chars.next().is_some_and(|c| c.is_alphabetic() || c == '_')
        && chars.all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'));
    if ok {
        Ok(())
    } else {
        Err(format!("'{name}' is not a valid XML element name"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_round_trip_and_are_case_sensitive() {
        for f in Function::ALL {
            assert_eq!(Function::from_name(f.name()), Some(f));
        }
        assert_eq!(Function::from_name("validate"), Some(Function::Validation));
        assert_eq!(Function::from_name("HTTP_CALL"), None);
        assert_eq!(Function::from_name("Map"), None);
        assert_eq!(Function::from_name(""), None);
        assert_eq!(Function::from_name(" map"), None);
    }

    #[test]
    fn kinds_match_the_spec() {
        let count = |k| Function::ALL.iter().filter(|f| f.kind() == k).count();
        assert_eq!(count(FunctionKind::Data), 8);
        assert_eq!(count(FunctionKind::Connector), 7);
        assert_eq!(count(FunctionKind::Composition), 1);
        assert_eq!(Function::ChannelCall.kind(), FunctionKind::Composition);
        assert!(!Function::Map.checked_at_create());
        assert!(Function::HttpCall.checked_at_create());
    }

    #[test]
    fn every_function_has_a_schema_with_unique_field_names() {
        for f in Function::ALL {
            let fields = input_schema(f);
            assert!(!fields.is_empty(), "{f:?}");
            for (i, a) in fields.iter().enumerate() {
                assert!(!a.description.is_empty());
                assert!(["connection", "request", "output", "control"].contains(&a.category));
                assert!(
                    fields[i + 1..].iter().all(|b| b.name != a.name),
                    "{f:?}.{}",
                    a.name
                );
            }
        }
    }

    #[test]
    fn required_fields_follow_the_spec_table() {
        let required = |f: Function| -> Vec<&str> {
            input_schema(f)
                .iter()
                .filter(|s| s.required)
                .map(|s| s.name)
                .collect()
        };
        assert_eq!(required(Function::HttpCall), ["connector"]);
        assert_eq!(required(Function::DbRead), ["connector", "query"]);
        assert_eq!(required(Function::DbWrite), ["connector", "query"]);
        assert_eq!(required(Function::CacheRead), ["connector", "key"]);
        assert_eq!(
            required(Function::CacheWrite),
            ["connector", "key", "value"]
        );
        assert_eq!(
            required(Function::MongoRead),
            ["connector", "database", "collection"]
        );
        assert_eq!(required(Function::PublishKafka), ["connector", "topic"]);
        // channel / channel_logic is an exactly-one-of rule, coded in the validator.
        assert!(required(Function::ChannelCall).is_empty());
    }

    #[test]
    fn catalogue_lists_connector_and_composition_functions_only() {
        let cat = catalogue_json();
        let names: Vec<&str> = cat
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "http_call",
                "db_read",
                "db_write",
                "cache_read",
                "cache_write",
                "mongo_read",
                "publish_kafka",
                "channel_call"
            ]
        );
        let http = &cat[0];
        assert_eq!(http["kind"], "connector");
        assert_eq!(
            http["fields"][0],
            json!({
                "name": "connector",
                "type": "string",
                "required": true,
                "description": "HTTP connector name.",
                "category": "connection"
            })
        );
        assert_eq!(http["fields"][1]["default"], "GET");
        assert_eq!(
            http["fields"][1]["constraint"],
            json!({"one_of": ["GET", "POST", "PUT", "PATCH", "DELETE"]})
        );
        assert_eq!(http["fields"][4]["constraint"], "string_map");
        // Defaults in their field's type; words stay words.
        assert_eq!(http["fields"][4]["default"], json!({}));
        let field = |entry: &serde_json::Value, name: &str| {
            entry["fields"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["name"] == name)
                .unwrap()
                .clone()
        };
        assert_eq!(field(http, "timeout_ms")["default"], 30000);
        assert_eq!(field(&cat[7], "timeout_ms")["default"], "from config");
        assert_eq!(cat[7]["kind"], "composition");
    }
}
