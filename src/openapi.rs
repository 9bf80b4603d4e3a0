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
    ("get", "/api/v1/admin/audit-logs", "engine", "Audit log (filters: action, resource_type)", false, 200),
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
];

/// The OpenAPI document.
pub fn document() -> Json {
    let mut paths = Map::new();
    for (method, path, tag, summary, body, status) in OPERATIONS {
        let mut op = json!({
            "tags": [tag],
            "summary": summary,
            "responses": {
                status.to_string(): {"description": "Success", "content": {"application/json": {"schema": {"type": "object"}}}},
                "default": {"description": "Error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            },
        });
        if *status == 204 {
            op["responses"]["204"] = json!({"description": "No content"});
        }
        let params: Vec<Json> = path
            .split('/')
            .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
            .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        if !params.is_empty() {
            op["parameters"] = Json::Array(params);
        }
        if *body {
            op["requestBody"] = json!({"required": true, "content": {"application/json": {"schema": {"type": "object"}}}});
        }
        let entry = paths.entry(path.to_string()).or_insert_with(|| json!({}));
        entry[*method] = op;
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
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {
                        "type": "object",
                        "required": ["code", "message"],
                        "properties": {
                            "code": {"type": "string"},
                            "message": {"type": "string"},
                            "details": {"type": "array", "items": {
                                "type": "object",
                                "properties": {"field": {"type": "string"}, "message": {"type": "string"}},
                            }},
                        },
                    }},
                },
            },
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
            },
        },
    })
}

pub const DOCS_HTML: &str = include_str!("docs/index.html");
pub const DOCS_JS: &str = include_str!("docs/app.js");
pub const DOCS_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'";
