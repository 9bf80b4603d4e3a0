//! The published JSON Schemas (draft 2020-12) of workflow, channel and
//! connector definitions, served at `GET /api/v1/schemas/{kind}.json` and
//! printed by `sluice schema <kind>`.
//!
//! The schemas are generated from the declared types in [`crate::def`] (via
//! schemars) and from the function catalogue in [`crate::functions`], so they
//! cannot drift from what the compiler accepts. What schemars cannot see is
//! added here: each function's `input` (chosen by `function.name`), each
//! connector's `config` (chosen by `connector_type`) and the cross-field rules
//! of channels.
//!
//! The rule this module keeps: **the schema is never stricter than the
//! validator.** A definition the schema rejects is rejected by
//! [`crate::validate`] too (the integration tests check a set of bad
//! definitions against both). The schema may be looser: JSONLogic is not
//! compiled by a JSON Schema, and data functions' inputs are only described
//! (the validator warns about them, it does not reject them).

use crate::def::{
    CacheConnector, ChannelDef, ConnectorDef, DbConnector, HttpConnector, KafkaConnector,
    MongoConnector, ObjectStorageConnector, WorkflowDef,
};
use crate::functions::{Constraint, FieldSchema, FieldType, Function, FunctionKind};
use schemars::generate::{SchemaGenerator, SchemaSettings};
use serde_json::{Map, Value as Json, json};

/// Which definition a schema describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DefinitionKind {
    Workflow,
    Channel,
    Connector,
}

impl DefinitionKind {
    pub const ALL: [DefinitionKind; 3] = [
        DefinitionKind::Workflow,
        DefinitionKind::Channel,
        DefinitionKind::Connector,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DefinitionKind::Workflow => "workflow",
            DefinitionKind::Channel => "channel",
            DefinitionKind::Connector => "connector",
        }
    }

    pub fn from_name(name: &str) -> Option<DefinitionKind> {
        DefinitionKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

fn generator() -> SchemaGenerator {
    SchemaSettings::draft2020_12()
        .for_deserialize()
        .into_generator()
}

/// Descriptions come from doc comments, whose rustdoc links
/// (``[`WorkflowDef::id`]``) mean nothing to a schema's reader: written as
/// plain code spans.
pub fn plain_descriptions(schema: &mut Json) {
    match schema {
        Json::Object(m) => {
            for (k, v) in m.iter_mut() {
                match v {
                    Json::String(text) if k == "description" && text.contains("[`") => {
                        *text = text.replace("[`", "`").replace("`]", "`");
                    }
                    other => plain_descriptions(other),
                }
            }
        }
        Json::Array(items) => items.iter_mut().for_each(plain_descriptions),
        _ => {}
    }
}

/// Writes integral floats (`"default": 0.0` of an `f64` field) as integers,
/// as every answer of the service writes numbers: the schema served, printed
/// and committed is then the same document whichever writer wrote it.
fn integral_numbers(v: &mut Json) {
    match v {
        Json::Number(n) if !n.is_i64() && !n.is_u64() => {
            if let Some(f) = n.as_f64()
                && f.fract() == 0.0
                && f.abs() < 9.0e15
            {
                *v = Json::from(f as i64);
            }
        }
        Json::Object(m) => m.values_mut().for_each(integral_numbers),
        Json::Array(items) => items.iter_mut().for_each(integral_numbers),
        _ => {}
    }
}

/// Gives 32-bit and signed 64-bit integer fields the bounds of their
/// type, which the validator enforces (audit 110: `burst: 4294967296` and
/// `priority: 2^63` passed the schema).
fn integer_bounds(v: &mut Json) {
    match v {
        Json::Object(m) => {
            let bounds = match m.get("format").and_then(Json::as_str) {
                Some("uint32") => Some((json!(0), json!(u32::MAX))),
                Some("int32") => Some((json!(i32::MIN), json!(i32::MAX))),
                Some("int64") => Some((json!(i64::MIN), json!(i64::MAX))),
                _ => None,
            };
            if let Some((min, max)) = bounds {
                m.entry("minimum").or_insert(min);
                m.entry("maximum").or_insert(max);
            }
            m.values_mut().for_each(integer_bounds);
        }
        Json::Array(items) => items.iter_mut().for_each(integer_bounds),
        _ => {}
    }
}

/// The JSON Schema of one kind of definition.
pub fn definition_schema(kind: DefinitionKind) -> Json {
    let mut schema = match kind {
        DefinitionKind::Workflow => workflow_schema(),
        DefinitionKind::Channel => channel_schema(),
        DefinitionKind::Connector => connector_schema(),
    };
    strip_null(&mut schema);
    integer_bounds(&mut schema);
    plain_descriptions(&mut schema);
    integral_numbers(&mut schema);
    if let Json::Object(m) = &mut schema {
        // Files may name their schema; the key is ignored by the service.
        if let Some(Json::Object(props)) = m.get_mut("properties") {
            props.insert(
                "$schema".into(),
                // No type: the service ignores the key whatever it holds,
                // and the schema is never stricter than the service.
                json!({"description": "The JSON Schema this file follows (for editors, a string); ignored by Sluice."}),
            );
        }
        let title = format!("Sluice {} definition", kind.name());
        let mut out = Map::new();
        out.insert(
            "$schema".into(),
            json!("https://json-schema.org/draft/2020-12/schema"),
        );
        out.insert("title".into(), Json::String(title));
        for (k, v) in std::mem::take(m) {
            if k != "$schema" && k != "title" {
                out.insert(k, v);
            }
        }
        *m = out;
    }
    schema
}

// ---------------------------------------------------------------- workflows

fn workflow_schema() -> Json {
    let mut schema = generator().into_root_schema_for::<WorkflowDef>().to_value();
    let defs = schema["$defs"]
        .as_object_mut()
        .expect("schemars puts subschemas under $defs");
    defs.insert("FunctionDef".into(), function_def_schema());
    for f in Function::ALL {
        defs.insert(input_def_name(f), input_schema(f));
    }
    // A step with `tasks` is a group (the validator reads it so): a group
    // takes no `function` and no `halt_on`, and a task no `tasks`.
    if let Some(group) = defs.get_mut("GroupDef") {
        group["not"] = json!({"anyOf": [{"required": ["function"]}, {"required": ["halt_on"]}]});
    }
    if let Some(task) = defs.get_mut("TaskDef") {
        task["not"] = json!({"required": ["tasks"]});
    }
    schema
}

fn input_def_name(f: Function) -> String {
    format!("input.{}", f.name())
}

/// `{name, input}` with `input` chosen by `name`.
fn function_def_schema() -> Json {
    let mut names: Vec<&str> = Function::ALL.into_iter().map(Function::name).collect();
    names.push("validate");
    let rules: Vec<Json> = Function::ALL
        .into_iter()
        .map(|f| {
            let mut then = json!({"properties": {"input": {"$ref": format!("#/$defs/{}", input_def_name(f))}}});
            // An absent input is `{}`, which lacks any required field.
            // `channel_call` needs one of two fields, neither required alone.
            if f.checked_at_create()
                && (f.input_schema().iter().any(|x| x.required) || f == Function::ChannelCall)
            {
                then["required"] = json!(["input"]);
            }
            let name = if f == Function::Validation {
                json!({"enum": ["validation", "validate"]})
            } else {
                json!({"const": f.name()})
            };
            json!({"if": {"properties": {"name": name}, "required": ["name"]}, "then": then})
        })
        .collect();
    json!({
        "description": "`{name, input}` of a task: the built-in function to call and its input.",
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "enum": names, "description": "The built-in function (exact, case-sensitive)."},
            "input": {"type": "object", "description": "Function-specific; `{}` when absent."},
        },
        "allOf": rules,
    })
}

/// A function's `input` from the catalogue. Connector and composition
/// functions are checked strictly (as the validator does when a workflow is
/// created); data functions' fields are described only, since their inputs
/// are checked when they run.
fn input_schema(f: Function) -> Json {
    let strict = f.checked_at_create();
    let mut props = Map::new();
    let mut required = Vec::new();
    let mut either = Vec::new();
    for field in f.input_schema() {
        props.insert(field.name.into(), field_schema(field, strict));
        if strict && field.required {
            // A required field with a `<name>_logic` twin may be computed instead.
            let twin = format!("{}_logic", field.name);
            if f.input_schema().iter().any(|t| t.name == twin) {
                either.push(json!({"anyOf": [{"required": [field.name]}, {"required": [twin]}]}));
            } else {
                required.push(field.name);
            }
        }
    }
    let kind = match f.kind() {
        FunctionKind::Data => "data function; its input is checked when the task runs",
        FunctionKind::Connector => "connector function",
        FunctionKind::Composition => "composition function",
    };
    let mut schema = json!({
        "description": format!("Input of `{}` ({kind}).", f.name()),
        "type": "object",
        "properties": props,
    });
    if !required.is_empty() {
        schema["required"] = json!(required);
    }
    if !either.is_empty() {
        schema["allOf"] = Json::Array(either);
    }
    if f == Function::ChannelCall {
        schema["oneOf"] = json!([{"required": ["channel"]}, {"required": ["channel_logic"]}]);
        schema["not"] = json!({"required": ["data", "data_logic"]});
    }
    schema
}

fn field_schema(field: &FieldSchema, strict: bool) -> Json {
    let mut s = Map::new();
    let mut description = field.description.to_owned();
    if let Some(d) = field.default {
        description.push_str(&format!(" Default: {d}."));
    }
    if !strict {
        // Described with its type in words, not enforced (see input_schema).
        description.push_str(&format!(" Type: {}.", field.ty.name()));
        s.insert("description".into(), Json::String(description));
        if let Constraint::OneOf(allowed) = field.constraint {
            s.insert("examples".into(), json!(allowed));
        }
        return Json::Object(s);
    }
    s.insert("description".into(), Json::String(description));
    let ty = match field.ty {
        FieldType::String => Some("string"),
        FieldType::Number => Some("number"),
        FieldType::Integer => Some("integer"),
        FieldType::Boolean => Some("boolean"),
        FieldType::Object => Some("object"),
        FieldType::Array => Some("array"),
        FieldType::Any | FieldType::Jsonlogic => None,
    };
    if let Some(ty) = ty {
        s.insert("type".into(), json!(ty));
    }
    if field.required && field.ty == FieldType::String {
        // The validator rejects a blank required string.
        s.insert("pattern".into(), json!("\\S"));
    }
    match field.constraint {
        Constraint::None => {}
        Constraint::OneOf(allowed) => {
            s.insert("enum".into(), json!(allowed));
        }
        Constraint::Positive => {
            s.insert("exclusiveMinimum".into(), json!(0));
        }
        Constraint::StringMap => {
            s.insert("additionalProperties".into(), json!({"type": "string"}));
        }
    }
    Json::Object(s)
}

// ----------------------------------------------------------------- channels

fn channel_schema() -> Json {
    let mut schema = generator().into_root_schema_for::<ChannelDef>().to_value();
    schema["allOf"] = json!([
        {
            "description": "A rest channel needs a route and its methods.",
            "if": {"properties": {"protocol": {"const": "rest"}}, "required": ["protocol"]},
            "then": {"required": ["route_pattern", "methods"]},
        },
        {
            "description": "A route_pattern without a protocol makes a rest channel.",
            "if": {"required": ["route_pattern"], "not": {"required": ["protocol"]}},
            "then": {"required": ["methods"]},
        },
        {
            "description": "A kafka channel consumes config_json.topic, asynchronously.",
            "if": {"properties": {"protocol": {"const": "kafka"}}, "required": ["protocol"]},
            "then": {
                "required": ["config_json"],
                "properties": {
                    "config_json": {
                        "required": ["topic"],
                        "not": {"anyOf": [
                            {"required": ["rate_limit"]}, {"required": ["deduplication"]},
                            {"required": ["cache"]}, {"required": ["cors"]},
                            {"required": ["backpressure"]},
                        ]},
                    },
                    "channel_type": {"const": "async"},
                },
                "not": {"anyOf": [{"required": ["route_pattern"]}, {"required": ["methods"]}]},
            },
        },
        {
            "description": "An http channel is routed by its name: no route_pattern, no methods.",
            "if": {"properties": {"protocol": {"const": "http"}}, "required": ["protocol"]},
            "then": {"not": {"anyOf": [{"required": ["route_pattern"]}, {"required": ["methods"]}]}},
        },
        {
            "description": "config_json.topic and consumer_group apply only to a kafka channel.",
            "if": {"not": {"properties": {"protocol": {"const": "kafka"}}, "required": ["protocol"]}},
            "then": {"properties": {"config_json": {
                "not": {"anyOf": [{"required": ["topic"]}, {"required": ["consumer_group"]}]},
            }}},
        },
    ]);
    // Each method once (the validator names a repeated one).
    schema["properties"]["methods"]["uniqueItems"] = json!(true);
    // CORS methods are methods (the validator's list).
    if let Some(allowed) = schema.pointer_mut("/$defs/CorsConfig/properties/allowed_methods/items")
    {
        *allowed = json!({"$ref": "#/$defs/HttpMethod"});
    }
    schema
}

// --------------------------------------------------------------- connectors

fn connector_schema() -> Json {
    let mut generator = generator();
    let mut schema = generator.root_schema_for::<ConnectorDef>().to_value();
    let configs = [
        ("http", generator.subschema_for::<HttpConnector>()),
        ("db", generator.subschema_for::<DbConnector>()),
        ("cache", generator.subschema_for::<CacheConnector>()),
        ("mongodb", generator.subschema_for::<MongoConnector>()),
        ("kafka", generator.subschema_for::<KafkaConnector>()),
        (
            "object_storage",
            generator.subschema_for::<ObjectStorageConnector>(),
        ),
    ];
    let rules: Vec<Json> = configs
        .iter()
        .map(|(name, config)| {
            json!({
                "if": {"properties": {"connector_type": {"const": name}}, "required": ["connector_type"]},
                "then": {"properties": {"config": {"allOf": [
                    config.as_value(),
                    {"properties": {"type": {"const": name}}},
                ]}}},
            })
        })
        .collect();
    let defs: Map<String, Json> = generator.take_definitions(true);
    let all = schema.as_object_mut().expect("a root schema is an object");
    let target = all
        .entry("$defs")
        .or_insert_with(|| Json::Object(Map::new()));
    if let Json::Object(t) = target {
        t.extend(defs);
    }
    schema["properties"]["config"] = json!({
        "type": "object",
        "description": "Connection settings for `connector_type`; any string may be `env://VAR`, resolved when the connector is built.",
        "properties": {"type": {"type": "string", "description": "Optional; must equal connector_type."}},
    });
    schema["allOf"] = Json::Array(rules);
    // What the validator refuses and a schema can say: unknown keys in
    // `auth` and `retry`, a redis cache without its URL, no brokers
    // (audit 110).
    if let Some(defs) = schema["$defs"].as_object_mut() {
        if let Some(Json::Array(variants)) =
            defs.get_mut("HttpAuth").and_then(|a| a.get_mut("oneOf"))
        {
            for v in variants {
                v["additionalProperties"] = json!(false);
            }
        }
        if let Some(retry) = defs.get_mut("RetryPolicy") {
            retry["additionalProperties"] = json!(false);
        }
        if let Some(Json::Array(forms)) = defs.get_mut("Brokers").and_then(|b| b.get_mut("anyOf")) {
            for form in forms.iter_mut().filter(|f| f["type"] == "array") {
                form["minItems"] = json!(1);
            }
        }
        if let Some(cache) = defs.get_mut("CacheConnector") {
            cache["if"] =
                json!({"properties": {"backend": {"const": "redis"}}, "required": ["backend"]});
            cache["then"] = json!({"required": ["url"]});
        }
    }
    schema
}

/// `Option<T>` fields come out of schemars as "T or null"; the validator
/// treats an explicit `null` as a type error wherever a typed value is
/// expected, so the schema must not admit it either.
fn strip_null(v: &mut Json) {
    match v {
        Json::Object(m) => {
            if let Some(Json::Array(types)) = m.get_mut("type") {
                types.retain(|t| t != "null");
                if types.len() == 1 {
                    let only = types.remove(0);
                    m.insert("type".into(), only);
                }
            }
            for key in ["anyOf", "oneOf"] {
                if let Some(Json::Array(options)) = m.get_mut(key) {
                    options.retain(|o| o != &json!({"type": "null"}));
                    if options.len() == 1 && key == "anyOf" {
                        let only = options.remove(0);
                        m.remove(key);
                        if let Json::Object(inner) = only {
                            for (k, v) in inner {
                                m.entry(k).or_insert(v);
                            }
                        }
                    }
                }
            }
            if let Some(Json::Array(values)) = m.get_mut("enum") {
                values.retain(|x| !x.is_null());
            }
            m.values_mut().for_each(strip_null);
        }
        Json::Array(items) => items.iter_mut().for_each(strip_null),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No rustdoc link syntax reaches a schema's descriptions.
    #[test]
    fn descriptions_hold_no_rustdoc_links() {
        for kind in [
            DefinitionKind::Workflow,
            DefinitionKind::Channel,
            DefinitionKind::Connector,
        ] {
            let text = definition_schema(kind).to_string();
            assert!(!text.contains("[`"), "{}", kind.name());
        }
    }

    #[test]
    fn every_kind_has_a_2020_12_schema_that_allows_a_schema_key() {
        for kind in DefinitionKind::ALL {
            let s = definition_schema(kind);
            assert_eq!(s["$schema"], "https://json-schema.org/draft/2020-12/schema");
            assert_eq!(s["type"], "object", "{}", kind.name());
            assert!(s["properties"]["$schema"].is_object());
            assert_eq!(DefinitionKind::from_name(kind.name()), Some(kind));
        }
    }

    #[test]
    fn workflow_schema_carries_every_function_input() {
        let s = definition_schema(DefinitionKind::Workflow);
        for f in Function::ALL {
            let input = &s["$defs"][input_def_name(f)];
            for field in f.input_schema() {
                assert!(
                    input["properties"][field.name].is_object(),
                    "{}",
                    field.name
                );
            }
        }
        let http = &s["$defs"]["input.http_call"];
        assert_eq!(http["required"], json!(["connector"]));
        assert_eq!(http["properties"]["method"]["enum"][0], "GET");
        // Data functions are described, not enforced.
        assert!(s["$defs"]["input.map"].get("required").is_none());
    }

    #[test]
    fn no_typed_field_admits_null() {
        let text = definition_schema(DefinitionKind::Channel).to_string();
        assert!(!text.contains("\"null\""), "{text}");
        let text = definition_schema(DefinitionKind::Workflow).to_string();
        assert!(!text.contains("\"null\""), "{text}");
    }
}
