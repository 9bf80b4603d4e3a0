//! The OpenAPI 3.0 description (`GET /api/v1/openapi.json`), built from one
//! table of operations, and the offline documentation UI (`GET /docs`) whose
//! assets are embedded in the binary.

use crate::app::VERSION;
use serde_json::{Map, Value as Json, json};

/// (method, path, tag, summary, request body?, success status)
#[rustfmt::skip]
const OPERATIONS: &[(&str, &str, &str, &str, bool, u16)] = &[
    ("get", "/health", "operations", "Health: database and engine checks (503 when degraded)", false, 200),
    ("get", "/healthz", "operations", "Liveness (always 200)", false, 200),
    ("get", "/readyz", "operations", "Readiness (200 once start-up completed and storage answers)", false, 200),
    ("get", "/metrics", "operations", "Prometheus metrics", false, 200),
    ("get", "/api/v1/openapi.json", "operations", "This OpenAPI document", false, 200),
    ("get", "/api/v1/schemas/workflow.json", "operations", "JSON Schema (2020-12) of workflow definitions, with every function's input", false, 200),
    ("get", "/api/v1/schemas/channel.json", "operations", "JSON Schema (2020-12) of channel definitions, with config_json settings", false, 200),
    ("get", "/api/v1/schemas/connector.json", "operations", "JSON Schema (2020-12) of connector definitions, with each connector type's config", false, 200),
    ("get", "/docs", "operations", "Interactive API documentation (offline)", false, 200),
    ("get", "/api/v1/admin/workflows", "workflows", "List workflows (filters: tag, status; limit, offset)", false, 200),
    ("post", "/api/v1/admin/workflows", "workflows", "Create a workflow (draft version 1)", true, 201),
    ("get", "/api/v1/admin/workflows/{id}", "workflows", "Get a workflow (latest version, or ?version=N)", false, 200),
    ("put", "/api/v1/admin/workflows/{id}", "workflows", "Update the draft", true, 200),
    ("delete", "/api/v1/admin/workflows/{id}", "workflows", "Delete all versions", false, 204),
    ("patch", "/api/v1/admin/workflows/{id}/status", "workflows", "Activate, archive or pause ({status, rollout_percentage?, version?})", true, 200),
    ("get", "/api/v1/admin/workflows/{id}/versions", "workflows", "Version history", false, 200),
    ("post", "/api/v1/admin/workflows/{id}/versions", "workflows", "New draft version from the active one", false, 201),
    ("patch", "/api/v1/admin/workflows/{id}/rollout", "workflows", "Change the canary share ({rollout_percentage})", true, 200),
    ("post", "/api/v1/admin/workflows/{id}/test", "workflows", "Dry-run on a sample payload ({data, metadata?}; ?connectors=true calls connectors)", true, 200),
    ("post", "/api/v1/admin/workflows/import", "workflows", "Bulk import as drafts (?dry_run=true validates only)", true, 200),
    ("get", "/api/v1/admin/workflows/export", "workflows", "Export definitions (filters: tag, status)", false, 200),
    ("post", "/api/v1/admin/workflows/validate", "workflows", "Validate a definition", true, 200),
    ("get", "/api/v1/admin/channels", "channels", "List channels (filters: status, channel_type, protocol)", false, 200),
    ("post", "/api/v1/admin/channels", "channels", "Create a channel (draft)", true, 201),
    ("get", "/api/v1/admin/channels/{id}", "channels", "Get a channel", false, 200),
    ("put", "/api/v1/admin/channels/{id}", "channels", "Update the draft", true, 200),
    ("delete", "/api/v1/admin/channels/{id}", "channels", "Delete all versions", false, 204),
    ("patch", "/api/v1/admin/channels/{id}/status", "channels", "Activate or archive", true, 200),
    ("get", "/api/v1/admin/channels/{id}/versions", "channels", "Version history", false, 200),
    ("post", "/api/v1/admin/channels/{id}/versions", "channels", "New draft version from the active one", false, 201),
    ("post", "/api/v1/admin/channels/import", "channels", "Bulk import as drafts (?dry_run=true validates only)", true, 200),
    ("get", "/api/v1/admin/connectors", "connectors", "List connectors (secrets masked)", false, 200),
    ("post", "/api/v1/admin/connectors", "connectors", "Create a connector", true, 201),
    ("get", "/api/v1/admin/connectors/{id}", "connectors", "Get a connector (secrets masked)", false, 200),
    ("put", "/api/v1/admin/connectors/{id}", "connectors", "Update a connector", true, 200),
    ("delete", "/api/v1/admin/connectors/{id}", "connectors", "Delete a connector", false, 204),
    ("post", "/api/v1/admin/connectors/import", "connectors", "Bulk import (?dry_run=true validates only)", true, 200),
    ("post", "/api/v1/admin/connectors/reload", "connectors", "Reload connectors from the database", false, 200),
    ("get", "/api/v1/admin/connectors/circuit-breakers", "connectors", "List circuit breakers", false, 200),
    ("post", "/api/v1/admin/connectors/circuit-breakers/{id}", "connectors", "Reset one breaker to closed", false, 200),
    ("get", "/api/v1/admin/engine/status", "engine", "Engine status", false, 200),
    ("post", "/api/v1/admin/engine/reload", "engine", "Hot-reload channels and workflows", false, 200),
    ("get", "/api/v1/admin/functions", "engine", "Connector and composition functions with their input schemas", false, 200),
    ("get", "/api/v1/admin/audit-logs", "engine", "Audit log (filters: action, resource_type, resource_id)", false, 200),
    ("post", "/api/v1/admin/backups", "engine", "Create a SQLite backup", false, 201),
    ("get", "/api/v1/admin/backups", "engine", "List backups", false, 200),
    ("post", "/api/v1/data/{channel}", "data", "Process a request on a channel by name", true, 200),
    ("post", "/api/v1/data/{channel}/async", "data", "Submit a request asynchronously (returns a trace id)", true, 202),
    ("get", "/api/v1/data/traces", "data", "List traces (filters: status, channel, mode; limit, offset)", false, 200),
    ("get", "/api/v1/data/traces/{id}", "data", "Poll one trace", false, 200),
    ("get", "/api/v1/data/{path}", "data", "Process a request via REST route matching (a route-matched GET has no body)", false, 200),
    ("post", "/api/v1/data/{path}", "data", "Process a request via REST route matching", true, 200),
    ("put", "/api/v1/data/{path}", "data", "Process a request via REST route matching", true, 200),
    ("patch", "/api/v1/data/{path}", "data", "Process a request via REST route matching", true, 200),
    ("delete", "/api/v1/data/{path}", "data", "Process a request via REST route matching", false, 200),
    ("get", "/api/v1/data/{path}/async", "data", "Submit a route-matched request asynchronously (returns a trace id)", false, 202),
    ("post", "/api/v1/data/{path}/async", "data", "Submit a route-matched request asynchronously (returns a trace id)", true, 202),
    ("put", "/api/v1/data/{path}/async", "data", "Submit a route-matched request asynchronously (returns a trace id)", true, 202),
    ("patch", "/api/v1/data/{path}/async", "data", "Submit a route-matched request asynchronously (returns a trace id)", true, 202),
    ("delete", "/api/v1/data/{path}/async", "data", "Submit a route-matched request asynchronously (returns a trace id)", false, 202),
];

/// The query parameters of an operation, as the handlers read them.
fn query_params(method: &str, path: &str) -> Vec<Json> {
    let q = |name: &str, schema: Json, description: &str| json!({"name": name, "in": "query", "required": false, "schema": schema, "description": description});
    let string = || json!({"type": "string"});
    let one_of = |values: &[&str]| json!({"type": "string", "enum": values});
    let paging = || {
        vec![
            q(
                "limit",
                json!({"type": "integer", "minimum": 1, "maximum": 1000, "default": 50}),
                "Page size",
            ),
            q(
                "offset",
                json!({"type": "integer", "minimum": 0, "default": 0}),
                "Items to skip",
            ),
        ]
    };
    let statuses = ["draft", "active", "archived", "paused"];
    let mut out = Vec::new();
    match (method, path) {
        ("get", "/api/v1/admin/workflows") => {
            out.push(q("tag", string(), "Only workflows with this tag"));
            out.push(q("status", one_of(&statuses), "Only this status"));
            out.extend(paging());
        }
        ("get", "/api/v1/admin/workflows/export") => {
            out.push(q("tag", string(), "Only workflows with this tag"));
            out.push(q("status", one_of(&statuses), "Only this status"));
        }
        ("get", "/api/v1/admin/channels") => {
            out.push(q("status", one_of(&statuses), "Only this status"));
            out.push(q(
                "channel_type",
                one_of(&["sync", "async"]),
                "Only this type",
            ));
            out.push(q(
                "protocol",
                one_of(&["rest", "http", "kafka"]),
                "Only this protocol",
            ));
            out.extend(paging());
        }
        ("get", "/api/v1/admin/audit-logs") => {
            out.push(q(
                "action",
                one_of(crate::admin::AUDIT_ACTIONS),
                "Only this action",
            ));
            out.push(q(
                "resource_type",
                one_of(crate::admin::AUDIT_RESOURCE_TYPES),
                "Only this resource type",
            ));
            out.push(q(
                "resource_id",
                string(),
                "Only entries about this resource",
            ));
            out.extend(paging());
        }
        ("get", "/api/v1/data/traces") => {
            out.push(q(
                "status",
                one_of(&["pending", "running", "completed", "failed"]),
                "Only this status",
            ));
            out.push(q("channel", string(), "Only this channel"));
            out.push(q("mode", one_of(&["async", "kafka"]), "Only this mode"));
            out.extend(paging());
        }
        (
            "get",
            "/api/v1/admin/connectors"
            | "/api/v1/admin/connectors/circuit-breakers"
            | "/api/v1/admin/functions"
            | "/api/v1/admin/backups"
            | "/api/v1/admin/workflows/{id}/versions"
            | "/api/v1/admin/channels/{id}/versions",
        ) => out.extend(paging()),
        ("get", "/api/v1/admin/workflows/{id}" | "/api/v1/admin/channels/{id}") => {
            out.push(q(
                "version",
                json!({"type": "integer", "minimum": 1}),
                "This version instead of the latest",
            ));
        }
        ("post", "/api/v1/admin/workflows/{id}/test") => {
            out.push(q(
                "version",
                json!({"type": "integer", "minimum": 1}),
                "Run this version instead of the latest",
            ));
            out.push(q(
                "connectors",
                json!({"type": "boolean", "default": false}),
                "Call connectors (else they are skipped)",
            ));
        }
        ("post", p) if p.ends_with("/import") => {
            out.push(q(
                "dry_run",
                json!({"type": "boolean", "default": false}),
                "Validate and report, store nothing",
            ));
        }
        (_, p) if p.starts_with("/api/v1/data/") && !p.starts_with("/api/v1/data/traces") => {
            out.push(q(
                "profile",
                one_of(&["1"]),
                "Add per-task timings in _service.profile",
            ));
        }
        _ => {}
    }
    out
}

fn integer_schema() -> Json {
    json!({"type": "integer"})
}

fn schema_ref(name: &str) -> Json {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

/// `{data: <schema>}`
fn data_of(schema: Json) -> Json {
    json!({"type": "object", "required": ["data"], "properties": {"data": schema}})
}

/// `{data: <schema>}`, and for a workflow or a channel the definition's
/// `warnings` when it has some (create and update).
fn data_with_warnings(kind: &str, schema: Json) -> Json {
    let mut out = data_of(schema);
    if kind == "workflows" || kind == "channels" {
        out["properties"]["warnings"] = json!({"type": "array", "items": {
            "type": "object", "required": ["field", "message"],
            "properties": {"field": {"type": "string"}, "message": {"type": "string"}}}});
    }
    out
}

/// `{data: [<schema>], total, limit, offset}`
fn page_of(item: Json) -> Json {
    json!({"type": "object", "required": ["data", "total", "limit", "offset"], "properties": {
        "data": {"type": "array", "items": item},
        "total": {"type": "integer"}, "limit": {"type": "integer"}, "offset": {"type": "integer"},
    }})
}

/// Request and success-response schemas of one operation, derived from its
/// method and path so that every route gets them from one place.
fn schemas_for(method: &str, path: &str) -> (Option<Json>, Json) {
    let seg: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let def = |kind: &str| match kind {
        "workflows" => schema_ref("WorkflowDef"),
        "channels" => schema_ref("ChannelDef"),
        _ => schema_ref("ConnectorDef"),
    };
    // What the server answers: a channel's status may be `paused`.
    let answer = |kind: &str| match kind {
        "channels" => schema_ref("Channel"),
        other => def(other),
    };
    match (method, seg.as_slice()) {
        ("get", ["health"]) => (None, schema_ref("Health")),
        ("get", ["healthz"]) => (
            None,
            json!({"type": "object", "properties": {"status": {"type": "string"}}}),
        ),
        ("get", ["readyz"]) => (None, schema_ref("Readiness")),
        ("get", ["metrics" | "docs"]) => (None, json!({"type": "string"})),
        ("get", ["api", "v1", "openapi.json"]) => (None, json!({"type": "object"})),
        ("get", ["api", "v1", "admin", "connectors", "circuit-breakers"]) => {
            (None, page_of(schema_ref("CircuitBreaker")))
        }
        (_, ["api", "v1", "admin", "connectors", "circuit-breakers", _]) => {
            (None, data_of(schema_ref("CircuitBreaker")))
        }
        ("post", ["api", "v1", "admin", "connectors", "reload"]) => {
            (None, data_of(json!({"type": "object"})))
        }
        ("post", ["api", "v1", "admin", kind, "import"]) => (
            Some(json!({"type": "array", "items": def(kind)})),
            data_of(schema_ref("ImportResult")),
        ),
        ("get", ["api", "v1", "admin", kind, "export"]) => (
            None,
            data_of(json!({"type": "array", "items": answer(kind)})),
        ),
        ("post", ["api", "v1", "admin", kind, "validate"]) => {
            (Some(def(kind)), data_of(schema_ref("ValidateResult")))
        }
        ("post", ["api", "v1", "admin", _, _, "test"]) => (
            Some(schema_ref("DryRunRequest")),
            data_of(schema_ref("DryRunResult")),
        ),
        ("patch", ["api", "v1", "admin", "channels", _, "status"]) => (
            Some(schema_ref("ChannelStatusChange")),
            data_of(answer("channels")),
        ),
        ("patch", ["api", "v1", "admin", kind, _, "status"]) => {
            (Some(schema_ref("StatusChange")), data_of(answer(kind)))
        }
        ("patch", ["api", "v1", "admin", kind, _, "rollout"]) => {
            (Some(schema_ref("RolloutChange")), data_of(answer(kind)))
        }
        ("get", ["api", "v1", "admin", kind, _, "versions"]) => (None, page_of(answer(kind))),
        ("post", ["api", "v1", "admin", kind, _, "versions"]) => (None, data_of(answer(kind))),
        (
            "get",
            [
                "api",
                "v1",
                "admin",
                kind @ ("workflows" | "channels" | "connectors"),
            ],
        ) => (None, page_of(answer(kind))),
        (
            "post",
            [
                "api",
                "v1",
                "admin",
                kind @ ("workflows" | "channels" | "connectors"),
            ],
        ) => (Some(def(kind)), data_with_warnings(kind, answer(kind))),
        (
            "get",
            [
                "api",
                "v1",
                "admin",
                kind @ ("workflows" | "channels" | "connectors"),
                _,
            ],
        ) => (None, data_of(answer(kind))),
        ("put", ["api", "v1", "admin", kind, _]) => {
            (Some(def(kind)), data_with_warnings(kind, answer(kind)))
        }
        ("delete", _) if seg.get(2) == Some(&"admin") => (None, json!({})),
        ("get", ["api", "v1", "admin", "engine", "status"]) => {
            (None, data_of(schema_ref("EngineStatus")))
        }
        ("post", ["api", "v1", "admin", "engine", "reload"]) => {
            (None, data_of(schema_ref("ReloadReport")))
        }
        ("get", ["api", "v1", "admin", "functions"]) => {
            (None, page_of(schema_ref("FunctionSchema")))
        }
        ("get", ["api", "v1", "admin", "audit-logs"]) => (None, page_of(schema_ref("AuditEntry"))),
        ("post", ["api", "v1", "admin", "backups"]) => (None, data_of(schema_ref("Backup"))),
        ("get", ["api", "v1", "admin", "backups"]) => (None, page_of(schema_ref("Backup"))),
        ("get", ["api", "v1", "data", "traces"]) => (None, page_of(schema_ref("Trace"))),
        ("get", ["api", "v1", "data", "traces", _]) => (None, schema_ref("Trace")),
        ("get" | "delete", ["api", "v1", "data", _, "async"]) => {
            (None, schema_ref("TraceAccepted"))
        }
        (_, ["api", "v1", "data", _, "async"]) => {
            (Some(schema_ref("DataRequest")), schema_ref("TraceAccepted"))
        }
        ("get" | "delete", ["api", "v1", "data", ..]) => (None, schema_ref("DataResponse")),
        (_, ["api", "v1", "data", ..]) => {
            (Some(schema_ref("DataRequest")), schema_ref("DataResponse"))
        }
        _ => (None, json!({"type": "object"})),
    }
}

/// Hand-written component schemas (the definitions come from the compiler's
/// types through schemars).
fn fixed_schemas() -> Json {
    let string = json!({"type": "string"});
    let integer = json!({"type": "integer"});
    let diagnostic = json!({"type": "object", "required": ["field", "message"], "properties": {"field": string, "message": string}});
    let task_error = json!({"type": "object", "required": ["code", "task_id", "message"], "properties": {"code": string, "task_id": string, "message": string}});
    // A function field's rule: a name, or the allowed values (audit 71: typed
    // a string, and `http_call.method` answers `{"one_of": [...]}`).
    let constraint = json!({
        "description": "A rule beyond the type: a name (`positive`, `string_map`) or the allowed values (`{\"one_of\": [\"GET\", ...]}`).",
        "oneOf": [
            {"type": "string"},
            {"type": "object", "required": ["one_of"], "properties": {"one_of": {"type": "array", "items": {"type": "string"}}}}
        ]
    });
    json!({
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["code", "message"],
            "properties": {"code": string, "message": string, "task_id": string, "details": {"type": "array", "items": diagnostic}},
        }}},
        "Diagnostic": diagnostic,
        "Health": {"type": "object", "required": ["status", "version", "uptime_seconds", "workflows_loaded", "components"], "properties": {
            "status": {"type": "string", "enum": ["ok", "degraded"]}, "version": string, "uptime_seconds": integer,
            "workflows_loaded": integer,
            "components": {"type": "object", "properties": {"database": string, "engine": string}},
        }},
        "EngineStatus": {"type": "object", "required": ["version", "uptime_seconds", "workflows_count", "active_workflows", "channels"], "properties": {
            "version": string, "uptime_seconds": integer, "workflows_count": integer, "active_workflows": integer,
            "channels": {"type": "array", "items": string}, "generation": integer,
        }},
        "ReloadReport": {"type": "object", "properties": {
            "generation": integer, "workflows": integer, "active_workflows": integer, "channels": integer,
            "routes": integer, "duration_ms": {"type": "number"},
            "compiled": {"type": "integer", "description": "Workflow versions compiled by this reload (the others were reused)."},
        }},
        "Readiness": {"type": "object", "required": ["status", "checks"], "properties": {
            "status": {"type": "string", "enum": ["ready", "not_ready"]},
            "checks": {"type": "object", "properties": {
                "startup": {"type": "boolean"}, "engine": {"type": "boolean"},
                "database": {"type": "boolean"}, "synced": {"type": "boolean"},
                "stopping": {"type": "boolean"},
            }},
        }},
        "StatusChange": {"type": "object", "required": ["status"], "additionalProperties": false, "properties": {
            "status": {"type": "string", "enum": ["active", "archived", "paused"]},
            "rollout_percentage": {"type": "integer", "minimum": 1, "maximum": 100},
            "version": {"type": "integer", "minimum": 1},
        }},
        "ChannelStatusChange": {"type": "object", "required": ["status"], "additionalProperties": false, "properties": {
            "status": {"type": "string", "enum": ["active", "archived", "paused"]},
            "version": {"type": "integer", "minimum": 1},
        }},
        "RolloutChange": {"type": "object", "required": ["rollout_percentage"], "additionalProperties": false, "properties": {
            "rollout_percentage": {"type": "integer", "minimum": 1, "maximum": 100},
        }},
        "ImportResult": {"type": "object", "properties": {
            "created": {"type": "array", "items": string},
            "failed": {"type": "array", "items": {"type": "object", "properties": {"index": integer, "details": {"type": "array", "items": diagnostic}}}},
            "warnings": {"type": "array", "description": "Warnings of the items created (or that a dry run would create), as create answers them; absent for connectors.", "items": {"type": "object", "properties": {"index": integer, "details": {"type": "array", "items": diagnostic}}}},
            "dry_run": {"type": "boolean"},
        }},
        "ValidateResult": {"type": "object", "properties": {"valid": {"type": "boolean"}, "warnings": {"type": "array", "items": diagnostic}}},
        "DryRunRequest": {"type": "object", "additionalProperties": false, "properties": {
            "data": {"description": "The payload (what parse_json reads as `payload`)."},
            "metadata": {"type": "object", "additionalProperties": false, "properties": {
                "headers": {"type": "object"}, "query": {"type": "object"}, "path": {"type": "object"},
                "method": {"type": "string", "description": "Default POST."},
                "channel": {"type": "string", "description": "Default empty."},
                "request_id": {"type": "string", "description": "Default: this request's id."},
            }},
        }},
        "DryRunResult": {"type": "object", "properties": {
            "matched": {"type": "boolean"}, "status": {"type": "string", "enum": ["completed", "filtered", "failed"]},
            "data": {}, "errors": {"type": "array", "items": task_error},
            "tasks": {"type": "array", "items": {"type": "object", "properties": {
                "id": string, "status": {"type": "string", "enum": ["executed", "skipped", "failed"]}, "ms": {"type": "number"},
            }}},
            "ms": {"type": "number"},
        }},
        "FunctionSchema": {"type": "object", "properties": {"name": string, "kind": string, "fields": {"type": "array", "items": {"type": "object", "properties": {
            "name": string, "type": string, "required": {"type": "boolean"}, "description": string, "category": string,
            "default": {"description": "The value taken when the field is absent."},
            "constraint": constraint,
        }}}}},
        "AuditEntry": {"type": "object", "properties": {
            "id": integer, "principal": string, "action": string, "resource_type": string, "resource_id": string,
            "version": integer, "details": {"type": "object"}, "created_at": string,
        }},
        "Backup": {"type": "object", "properties": {"filename": string, "size_bytes": integer, "created_at": string}},
        "CircuitBreaker": {"type": "object", "properties": {
            "key": string, "state": {"type": "string", "enum": ["closed", "open", "half_open"]},
            "channel": string, "connector": string, "consecutive_failures": integer,
            "opened_at": {"type": "string", "description": "When it last opened (RFC 3339); absent if never."},
        }},
        "DataRequest": {"type": "object", "properties": {"data": {"description": "The payload."}}},
        "DataResponse": {"type": "object", "required": ["status", "data", "errors"], "properties": {
            "status": {"type": "string", "enum": ["ok"]}, "data": {}, "errors": {"type": "array", "items": task_error},
            "_service": {"type": "object", "description": "Debug output (profile), only when requested."},
        }},
        "TraceAccepted": {"type": "object", "required": ["trace_id", "status"], "properties": {"trace_id": string, "status": {"type": "string", "enum": ["pending"]}}},
        "Trace": {"type": "object", "properties": {
            "trace_id": string, "channel": string, "mode": string,
            "status": {"type": "string", "enum": ["pending", "running", "completed", "failed"]},
            // Null until the trace has run (or when no workflow matched).
            "workflow_id": {"type": "string", "nullable": true},
            "workflow_version": {"type": "integer", "nullable": true},
            "data": {"nullable": true}, "errors": {"type": "array", "items": task_error},
            "created_at": string, "started_at": {"type": "string", "nullable": true},
            "completed_at": {"type": "string", "nullable": true},
            "duration_ms": {"type": "number", "nullable": true}, "attempts": integer,
            // A failed trace's next run (its dead letter is due then); null
            // when the failure is final.
            "next_retry_at": {"type": "string", "nullable": true},
        }},
    })
}

/// The document for this configuration: [`document`], without `/metrics`
/// when `metrics.enabled` is off (it answers 404 then).
pub fn document_for(config: &crate::config::Config) -> Json {
    let mut doc = document(&config.admin_auth);
    if !config.metrics.enabled
        && let Some(paths) = doc.get_mut("paths").and_then(Json::as_object_mut)
    {
        paths.remove("/metrics");
    }
    doc
}

/// Removes every `nullable: true` under `schema`.
fn not_nullable(schema: &mut Json) {
    match schema {
        Json::Object(members) => {
            members.remove("nullable");
            members.values_mut().for_each(not_nullable);
            // An optional reference: `anyOf: [{$ref}, {enum: [null]}]`.
            if let Some(Json::Array(options)) = members.get_mut("anyOf") {
                options.retain(|o| *o != json!({"enum": [null]}));
                if options.len() == 1 {
                    let only = options.pop();
                    members.remove("anyOf");
                    members.insert("allOf".into(), Json::Array(only.into_iter().collect()));
                }
            }
        }
        Json::Array(items) => items.iter_mut().for_each(not_nullable),
        _ => {}
    }
}

/// The OpenAPI document.
/// The document, with the credentials the admin plane asks for under
/// `auth`: when it is enabled, every admin operation and `/metrics` require
/// a key (`Authorization: Bearer` or the configured header); when it is
/// not, none does, and no scheme is declared.
pub fn document(auth: &crate::config::AdminAuth) -> Json {
    use sluice_compiler::def::{ChannelDef, ConnectorDef, WorkflowDef};
    let mut generator = schemars::generate::SchemaSettings::openapi3().into_generator();
    generator.subschema_for::<WorkflowDef>();
    generator.subschema_for::<ChannelDef>();
    generator.subschema_for::<ConnectorDef>();
    let mut schemas: Map<String, Json> = generator.take_definitions(true).into_iter().collect();
    // An optional field is one to leave out: the admin API refuses `null`
    // for it ("expected string, got null"), so the document must not offer
    // it (generated clients send unset fields as `null` where it does).
    for schema in schemas.values_mut() {
        not_nullable(schema);
        sluice_compiler::schema::plain_descriptions(schema);
    }
    // Channels are paused through `PATCH .../status` (engine schema) and
    // show it, though a definition never sets it: what the server answers
    // is `Channel` (a `ChannelDef` whose status may be `paused`), what it
    // accepts is `ChannelDef`.
    if let Some(mut channel) = schemas.get("ChannelDef").cloned() {
        channel["properties"]["status"] = json!({"type": "string",
            "enum": ["draft", "active", "archived", "paused"]});
        schemas.insert("Channel".to_string(), channel);
    }
    if let Json::Object(fixed) = fixed_schemas() {
        schemas.extend(fixed);
    }
    let mut paths = Map::new();
    for (method, path, tag, summary, _, status) in OPERATIONS {
        let (request, response) = schemas_for(method, path);
        let content_type = match *path {
            "/metrics" => "text/plain",
            "/docs" => "text/html",
            _ => "application/json",
        };
        let mut op = json!({
            "tags": [tag],
            "summary": summary,
            "operationId": format!("{method}{}", path.replace(['/', '{', '}', '.', '-'], "_")),
            "responses": {
                status.to_string(): {"description": "Success", "content": {content_type: {"schema": response}}},
                "default": {"description": "Error", "content": {"application/json": {"schema": schema_ref("Error")}}},
            },
        });
        if *status == 204 {
            op["responses"]["204"] = json!({"description": "No content"});
        }
        let mut params: Vec<Json> = path
            .split('/')
            .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
            .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        params.extend(query_params(method, path));
        if !params.is_empty() {
            op["parameters"] = Json::Array(params);
        }
        if auth.enabled && (path.starts_with("/api/v1/admin/") || *path == "/metrics") {
            op["security"] = json!([{"bearer": []}, {"apiKey": []}]);
            op["responses"]["401"] = json!({"description": "Missing or invalid credentials",
                "content": {"application/json": {"schema": schema_ref("Error")}}});
            if *method != "get" {
                op["responses"]["403"] = json!({"description": "A read-only key on an operation that changes state",
                    "content": {"application/json": {"schema": schema_ref("Error")}}});
            }
        }
        // A data-plane body may be empty (no payload); an import body is
        // an array or an export's or a list's `{data: [...]}`.
        let request = match request {
            Some(r) if path.ends_with("/import") => Some(json!({"oneOf": [r, {
                "type": "object", "required": ["data"],
                "properties": {"data": r, "total": integer_schema(), "limit": integer_schema(), "offset": integer_schema()},
            }]})),
            other => other,
        };
        if let Some(request) = request {
            let required = !path.starts_with("/api/v1/data/");
            op["requestBody"] =
                json!({"required": required, "content": {"application/json": {"schema": request}}});
        }
        // A channel of `channel_type: async` answers any request on it as
        // a submission, so the plain data-plane operations can answer 202
        // too (docs/decisions.md).
        if path.starts_with("/api/v1/data/")
            && *status == 200
            && !path.starts_with("/api/v1/data/traces")
        {
            op["responses"]["202"] = json!({"description": "Accepted: the channel is asynchronous; poll the trace",
                "content": {"application/json": {"schema": schema_ref("TraceAccepted")}}});
        }
        // Health and readiness answer 503 in their own shapes, not errors.
        match *path {
            "/health" => {
                op["responses"]["503"] = json!({"description": "Degraded",
                    "content": {"application/json": {"schema": schema_ref("Health")}}});
            }
            "/readyz" => {
                op["responses"]["503"] = json!({"description": "Not ready",
                    "content": {"application/json": {"schema": schema_ref("Readiness")}}});
            }
            _ => {}
        }
        let entry = paths.entry(path.to_string()).or_insert_with(|| json!({}));
        entry[*method] = op;
    }
    let mut components = json!({"schemas": schemas});
    if auth.enabled {
        components["securitySchemes"] = json!({
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": auth.api_key_header},
        });
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "Sluice",
            "version": VERSION,
            "description": "Runs business logic declared as JSON: channels, workflows and connectors.",
        },
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": components,
    })
}

pub const DOCS_HTML: &str = include_str!("docs/index.html");
pub const DOCS_JS: &str = include_str!("docs/app.js");
pub const DOCS_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'";
