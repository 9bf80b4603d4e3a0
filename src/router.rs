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
        ["api", "v1", "admin", first, rest @ ..] if ADMIN_RESOURCES.contains(first) => {
            const WORDS: &[&str] = &[
                "workflows",
                "channels",
                "connectors",
                "import",
                "export",
                "validate",
                "status",
                "versions",
                "rollout",
                "test",
                "reload",
                "circuit-breakers",
                "engine",
                "functions",
                "audit-logs",
                "backups",
            ];
            let mut out = format!("/api/v1/admin/{first}");
            for s in rest {
                out.push('/');
                out.push_str(if WORDS.contains(s) { s } else { "{id}" });
            }
            out.into()
        }
        _ => "unmatched".into(),
    }
}

/// The first segments of the admin plane's routes: an admin path starting
/// otherwise matches no route and is labelled `unmatched`.
const ADMIN_RESOURCES: &[&str] = &[
    "workflows",
    "channels",
    "connectors",
    "engine",
    "functions",
    "audit-logs",
    "backups",
];

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
    }
}
