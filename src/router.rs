//! Top-level dispatch: operational endpoints, the admin plane and the data
//! plane, chosen by the first path segments (a precomputed match, no scan).

use crate::api::{ApiError, HttpResponse};
use crate::app::App;
use crate::server::{Req, decode};
use crate::{admin, auth, data, ops};
use http::Method;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::sync::Arc;

pub async fn route(app: &Arc<App>, req: Req) -> HttpResponse {
    // Decoded once, here. A path without escapes (nearly all) is split
    // straight into borrowed segments; otherwise each segment is decoded
    // and the list borrows the decoded copies.
    let path = req.path();
    let decoded: SmallVec<[Cow<'_, str>; 8]>;
    let seg: SmallVec<[&str; 8]> = if path.as_bytes().contains(&b'%') {
        decoded = path
            .split('/')
            .filter(|s| !s.is_empty())
            .map(decode)
            .collect();
        decoded.iter().map(|s| &**s).collect()
    } else {
        path.split('/').filter(|s| !s.is_empty()).collect()
    };
    // Handlers are awaited boxed: their futures (the admin plane's most of
    // all) are large, and every future above this one would otherwise carry
    // and copy the largest of them on every request.
    let result = match seg.as_slice() {
        ["health"] => get_only(&req).and(Box::pin(ops::health(app)).await),
        ["healthz"] => get_only(&req).and(ops::healthz()),
        ["readyz"] => get_only(&req).and(Box::pin(ops::readyz(app)).await),
        ["metrics"] => match auth::authenticate(&app.config.admin_auth, &req) {
            Ok(_) => get_only(&req).and(ops::metrics(app)),
            Err(e) => Err(e),
        },
        ["api", "v1", "openapi.json"] => get_only(&req).and(crate::api::ok_raw(
            &crate::openapi::document_for(&app.config),
        )),
        ["api", "v1", "schemas", file] => get_only(&req).and(definition_schema(file)),
        ["docs"] => get_only(&req).and(Ok(crate::api::static_asset(
            crate::openapi::DOCS_HTML,
            "text/html; charset=utf-8",
        ))),
        ["docs", "app.js"] => get_only(&req).and(Ok(crate::api::static_asset(
            crate::openapi::DOCS_JS,
            "text/javascript; charset=utf-8",
        ))),
        ["api", "v1", "admin", ..] => match auth::authenticate(&app.config.admin_auth, &req) {
            Ok(who) => Box::pin(admin::dispatch(app, &req, &seg[3..], who)).await,
            Err(e) => Err(e),
        },
        // `/api/v1/data` itself is the root route's (`route_pattern: "/"`).
        ["api", "v1", "data", ..] => Box::pin(data::handle(app, &req, &seg[3..])).await,
        _ => Err(ApiError::not_found(format!(
            "No route matches {} {}",
            req.method,
            req.path()
        ))),
    };
    result.unwrap_or_else(ApiError::into_response)
}

/// `GET /api/v1/schemas/{workflow,channel,connector}.json`: the JSON Schema
/// of a definition kind (public, like the OpenAPI document: it holds no data).
fn definition_schema(file: &str) -> Result<HttpResponse, ApiError> {
    use sluice_compiler::schema::{DefinitionKind, definition_schema};
    match file
        .strip_suffix(".json")
        .and_then(DefinitionKind::from_name)
    {
        Some(kind) => crate::api::ok_raw(&definition_schema(kind)),
        None => Err(ApiError::not_found(format!(
            "No schema named '{file}'; there are workflow.json, channel.json and connector.json"
        ))),
    }
}

fn get_only(req: &Req) -> Result<(), ApiError> {
    if req.method == Method::GET || req.method == Method::HEAD {
        Ok(())
    } else {
        Err(ApiError::method_not_allowed(
            &req.method,
            req.path(),
            "GET, HEAD",
        ))
    }
}

/// A low-cardinality label for a request path: identifiers become `{id}`,
/// data-plane paths one label, unknown paths `unmatched`.
pub fn route_label(path: &str) -> Cow<'static, str> {
    // The data plane first, without splitting (it is most of the traffic).
    if let Some(rest) = path.strip_prefix("/api/v1/data/")
        && !rest.is_empty()
        && !rest.starts_with("traces")
        && !rest.starts_with('/')
    {
        return DATA_PLANE_ROUTE.into();
    }
    let seg: SmallVec<[&str; 8]> = path.split('/').filter(|s| !s.is_empty()).collect();
    match seg.as_slice() {
        ["health"] => "/health".into(),
        ["healthz"] => "/healthz".into(),
        ["readyz"] => "/readyz".into(),
        ["metrics"] => "/metrics".into(),
        ["docs", ..] => "/docs".into(),
        ["api", "v1", "openapi.json"] => "/api/v1/openapi.json".into(),
        ["api", "v1", "schemas", ..] => "/api/v1/schemas".into(),
        ["api", "v1", "data", "traces"] => "/api/v1/data/traces".into(),
        ["api", "v1", "data", "traces", _] => "/api/v1/data/traces/{id}".into(),
        ["api", "v1", "data", "traces", ..] => "unmatched".into(),
        ["api", "v1", "data", ..] => DATA_PLANE_ROUTE.into(),
        ["api", "v1", "admin", rest @ ..] => admin_label(rest).into(),
        _ => "unmatched".into(),
    }
}

/// The label of an admin path (after `/api/v1/admin/`): one per route of
/// the admin plane (`src/admin.rs`), identifiers as `{id}`; any other path
/// is `unmatched`, however deep (a label built segment by segment gave
/// every depth of a wrong path its own series).
fn admin_label(segments: &[&str]) -> &'static str {
    match segments {
        ["workflows"] => "/api/v1/admin/workflows",
        ["channels"] => "/api/v1/admin/channels",
        ["workflows", "import"] => "/api/v1/admin/workflows/import",
        ["channels", "import"] => "/api/v1/admin/channels/import",
        ["workflows", "export"] => "/api/v1/admin/workflows/export",
        ["workflows", "validate"] => "/api/v1/admin/workflows/validate",
        ["workflows", _] => "/api/v1/admin/workflows/{id}",
        ["channels", _] => "/api/v1/admin/channels/{id}",
        ["workflows", _, "status"] => "/api/v1/admin/workflows/{id}/status",
        ["channels", _, "status"] => "/api/v1/admin/channels/{id}/status",
        ["workflows", _, "versions"] => "/api/v1/admin/workflows/{id}/versions",
        ["channels", _, "versions"] => "/api/v1/admin/channels/{id}/versions",
        ["workflows", _, "rollout"] => "/api/v1/admin/workflows/{id}/rollout",
        ["workflows", _, "test"] => "/api/v1/admin/workflows/{id}/test",
        ["connectors"] => "/api/v1/admin/connectors",
        ["connectors", "import"] => "/api/v1/admin/connectors/import",
        ["connectors", "reload"] => "/api/v1/admin/connectors/reload",
        ["connectors", "circuit-breakers"] => "/api/v1/admin/connectors/circuit-breakers",
        ["connectors", "circuit-breakers", _] => "/api/v1/admin/connectors/circuit-breakers/{id}",
        ["connectors", _] => "/api/v1/admin/connectors/{id}",
        ["engine", "status"] => "/api/v1/admin/engine/status",
        ["engine", "reload"] => "/api/v1/admin/engine/reload",
        ["functions"] => "/api/v1/admin/functions",
        ["audit-logs"] => "/api/v1/admin/audit-logs",
        ["backups"] => "/api/v1/admin/backups",
        _ => "unmatched",
    }
}

/// The one route label of every data-plane request.
pub const DATA_PLANE_ROUTE: &str = "/api/v1/data/{path}";

#[cfg(test)]
mod tests {
    use super::route_label;

    #[test]
    fn labels_have_low_cardinality() {
        assert_eq!(
            route_label("/api/v1/admin/workflows/abc/status"),
            "/api/v1/admin/workflows/{id}/status"
        );
        assert_eq!(
            route_label("/api/v1/admin/workflows/import"),
            "/api/v1/admin/workflows/import"
        );
        assert_eq!(route_label("/api/v1/data/orders/7"), "/api/v1/data/{path}");
        assert_eq!(route_label("/api/v1/data//orders"), "/api/v1/data/{path}");
        assert_eq!(route_label("/api/v1/data/traces"), "/api/v1/data/traces");
        assert_eq!(
            route_label("/api/v1/data/traces/x"),
            "/api/v1/data/traces/{id}"
        );
        assert_eq!(route_label("/api/v1/data/traces/x/y"), "unmatched");
        assert_eq!(route_label("/api/v1/admin/nope/123"), "unmatched");
        assert_eq!(route_label("/api/v1/admin"), "unmatched");
        assert_eq!(
            route_label("/api/v1/admin/connectors/circuit-breakers/a:b"),
            "/api/v1/admin/connectors/circuit-breakers/{id}"
        );
        assert_eq!(route_label("/api/v1/data/tracesx"), "/api/v1/data/{path}");
        assert_eq!(route_label("/api/v1/data"), "/api/v1/data/{path}");
        assert_eq!(route_label("/health"), "/health");
        assert_eq!(route_label("/x/y"), "unmatched");
        // A wrong admin path is one series however deep it goes.
        for path in [
            "/api/v1/admin/workflows/a/b/c",
            "/api/v1/admin/workflows/a/b/c/d/e/f/g/h",
            "/api/v1/admin/backups/x",
            "/api/v1/admin/audit-logs/x/y",
            "/api/v1/admin/engine/x/y",
            "/api/v1/admin/functions/x",
            "/api/v1/admin/connectors/circuit-breakers/a/b",
            "/api/v1/admin/channels/a/rollout",
        ] {
            assert_eq!(route_label(path), "unmatched", "{path}");
        }
        assert_eq!(
            route_label("/api/v1/admin/channels/c/versions"),
            "/api/v1/admin/channels/{id}/versions"
        );
        assert_eq!(
            route_label("/api/v1/admin/workflows/w/test"),
            "/api/v1/admin/workflows/{id}/test"
        );
        assert_eq!(
            route_label("/api/v1/admin/engine/status"),
            "/api/v1/admin/engine/status"
        );
    }
}
