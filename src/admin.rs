//! The admin plane, `/api/v1/admin/...`: workflows and channels (one
//! versioned-resource implementation for both), connectors, engine, functions,
//! audit logs and backups.
//!
//! Endpoints (paths relative to `/api/v1/admin`):
//! - `workflows`: GET list, POST create; `workflows/import` POST; `workflows/export` GET;
//!   `workflows/validate` POST; `workflows/{id}`: GET, PUT, DELETE; `workflows/{id}/status` PATCH;
//!   `workflows/{id}/versions` GET, POST; `workflows/{id}/rollout` PATCH; `workflows/{id}/test` POST
//! - `channels`: the same lifecycle, plus `channels/import`
//! - `connectors`: GET, POST; `connectors/import`, `connectors/reload` POST;
//!   `connectors/circuit-breakers` GET; `connectors/circuit-breakers/{key}` POST; `connectors/{id}` GET, PUT, DELETE
//! - `engine/status` GET, `engine/reload` POST, `functions` GET, `audit-logs` GET, `backups` GET, POST

use crate::api::{self, ApiError, ApiResult};
use crate::app::App;
use crate::auth::Principal;
use crate::engine::ReloadError;
use crate::server::Req;
use crate::storage::{AgainstActive, Audit, Kind, ListQuery, Status, StorageError, Store};
use http::Method;
use serde_json::{Value as Json, json};
use sluice_compiler::diag::Diagnostic;
use sluice_compiler::plan::{compile_new_workflow, compile_stored_workflow};
use sluice_compiler::validate;
use sluice_runtime::connectors::CallScope;
use sluice_runtime::exec::{self, Input, Meta, Options, PayloadFrom};
use std::path::Path;
use std::sync::Arc;

/// Dispatches an admin request (`segments` are the path after `/api/v1/admin`).
pub async fn dispatch(app: &Arc<App>, req: &Req, segments: &[&str], who: Principal) -> ApiResult {
    // HEAD is answered as GET (hyper sends the head without the body).
    let m = if req.method == Method::HEAD {
        &Method::GET
    } else {
        &req.method
    };
    let not_allowed = |allow: &'static str| -> ApiResult {
        Err(ApiError::method_not_allowed(&req.method, req.path(), allow))
    };
    let only = |allowed: Method| -> Result<Allowed, ApiError> {
        if *m == allowed {
            Ok(Allowed)
        } else {
            Err(ApiError::method_not_allowed(
                &req.method,
                req.path(),
                allow_of(&allowed),
            ))
        }
    };
    // An id in the path that no resource can have (create refuses it)
    // names none: 404 before any lookup. MariaDB's collations ignore
    // trailing spaces, so `DELETE /workflows/x%20` would otherwise delete
    // `x` there.
    if let [kind @ ("workflows" | "channels" | "connectors"), id, ..] = segments
        && !validate::is_identifier(id)
    {
        let title = match *kind {
            "connectors" => "Connector",
            other => kind_of(other).title(),
        };
        return Err(ApiError::not_found(format!(
            "{title} with id '{id}' not found"
        )));
    }
    req.single_valued_query()?;
    match segments {
        [kind @ ("workflows" | "channels")] => {
            let kind = kind_of(kind);
            match *m {
                Method::GET => list(app, req, kind).await,
                Method::POST => create(app, req, kind, who).await,
                _ => not_allowed("GET, HEAD, POST"),
            }
        }
        [kind @ ("workflows" | "channels"), "import"] => {
            only(Method::POST)?
                .then(import(app, req, kind_of(kind), who))
                .await
        }
        ["workflows", "export"] => only(Method::GET)?.then(export(app, req)).await,
        ["workflows", "validate"] => only(Method::POST)?.then(validate_workflow(app, req)).await,
        [kind @ ("workflows" | "channels"), id] => {
            let kind = kind_of(kind);
            match *m {
                Method::GET => get(app, req, kind, id).await,
                Method::PUT => update(app, req, kind, id, who).await,
                Method::DELETE => delete(app, req, kind, id, who).await,
                _ => not_allowed("GET, HEAD, PUT, DELETE"),
            }
        }
        [kind @ ("workflows" | "channels"), id, "status"] => {
            only(Method::PATCH)?
                .then(set_status(app, req, kind_of(kind), id, who))
                .await
        }
        [kind @ ("workflows" | "channels"), id, "versions"] => {
            let kind = kind_of(kind);
            match *m {
                Method::GET => versions(app, req, kind, id).await,
                Method::POST => new_version(app, kind, id, who).await,
                _ => not_allowed("GET, HEAD, POST"),
            }
        }
        ["workflows", id, "rollout"] => only(Method::PATCH)?.then(rollout(app, req, id, who)).await,
        ["workflows", id, "test"] => only(Method::POST)?.then(dry_run(app, req, id)).await,
        ["connectors"] => match *m {
            Method::GET => list_connectors(app, req).await,
            Method::POST => create_connector(app, req, who).await,
            _ => not_allowed("GET, HEAD, POST"),
        },
        ["connectors", "import"] => {
            only(Method::POST)?
                .then(import_connectors(app, req, who))
                .await
        }
        ["connectors", "reload"] => only(Method::POST)?.then(reload_connectors(app, who)).await,
        ["connectors", "circuit-breakers"] => {
            only(Method::GET)?
                .then(async { paged(req, app.connectors.policy.breakers.list()) })
                .await
        }
        ["connectors", "circuit-breakers", key] => {
            only(Method::POST)?.then(reset_breaker(app, key, who)).await
        }
        ["connectors", id] => match *m {
            Method::GET => get_connector(app, id).await,
            Method::PUT => update_connector(app, req, id, who).await,
            Method::DELETE => delete_connector(app, id, who).await,
            _ => not_allowed("GET, HEAD, PUT, DELETE"),
        },
        ["engine", "status"] => only(Method::GET)?.then(engine_status(app)).await,
        ["engine", "reload"] => only(Method::POST)?.then(engine_reload(app, who)).await,
        ["functions"] => {
            only(Method::GET)?
                .then(async { paged(req, catalogue_items()) })
                .await
        }
        ["audit-logs"] => only(Method::GET)?.then(audit_logs(app, req)).await,
        ["backups"] => match *m {
            Method::GET => list_backups(app, req),
            Method::POST => create_backup(app, who).await,
            _ => not_allowed("GET, HEAD, POST"),
        },
        _ => Err(ApiError::not_found(format!(
            "No admin endpoint at {}",
            req.path()
        ))),
    }
}

/// Lets a route say which method it takes in one line.
struct Allowed;

impl Allowed {
    async fn then<F: Future<Output = ApiResult>>(self, f: F) -> ApiResult {
        f.await
    }
}

/// The `Allow` header of a path that takes one method.
fn allow_of(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET, HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        _ => "",
    }
}

fn kind_of(segment: &str) -> Kind {
    if segment == "workflows" {
        Kind::Workflow
    } else {
        Kind::Channel
    }
}

fn audit(who: Principal, action: &str) -> Audit {
    Audit::new(who.as_str(), action)
}

/// `?limit=` (default 50, 1..=1000) and `?offset=` (default 0).
pub(crate) fn paging(req: &Req) -> Result<(i64, i64), ApiError> {
    let limit = match req.query("limit") {
        None => 50,
        Some(v) => match v.parse::<i64>() {
            Ok(n) if (1..=1000).contains(&n) => n,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "limit must be an integer from 1 to 1000, got '{v}'"
                )));
            }
        },
    };
    let offset = match req.query("offset") {
        None => 0,
        Some(v) => match v.parse::<i64>() {
            Ok(n) if n >= 0 => n,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "offset must be an integer from 0 to {}, got '{v}'",
                    i64::MAX
                )));
            }
        },
    };
    Ok((limit, offset))
}

fn status_filter(req: &Req) -> Result<Option<Status>, ApiError> {
    match req.query("status") {
        None => Ok(None),
        Some(s) => Status::parse(s).map(Some).ok_or_else(|| {
            ApiError::bad_request(format!(
                "status must be one of draft, active, archived, paused, got '{s}'"
            ))
        }),
    }
}

/// A list filter that takes one of `allowed`; anything else is a 400 (as a
/// bad `status` is), not an empty page.
fn one_of_filter(req: &Req, name: &str, allowed: &[&str]) -> Result<Option<String>, ApiError> {
    match req.query(name) {
        None => Ok(None),
        Some(v) if allowed.contains(&v) => Ok(Some(v.to_owned())),
        Some(v) => Err(ApiError::bad_request(format!(
            "{name} must be one of {}, got '{v}'",
            allowed.join(", ")
        ))),
    }
}

/// Checks a definition strictly; returns it with its identifier filled in.
/// A definition the database can keep: no NUL character, and no deeper
/// than a JSON validity check on its columns accepts (`Store::json_depth`;
/// every backend now keeps more than an admin body may hold, 127 levels,
/// but a deeper definition would be refused here, not fail in storage with
/// a 500, as MariaDB's 31 levels did before migration 0005).
fn storable(app: &App, def: &Json) -> Result<(), ApiError> {
    fn within(v: &Json, levels: usize) -> bool {
        match v {
            Json::Array(items) => levels > 0 && items.iter().all(|i| within(i, levels - 1)),
            Json::Object(members) => levels > 0 && members.values().all(|m| within(m, levels - 1)),
            _ => true,
        }
    }
    fn holds_nul(v: &Json) -> bool {
        match v {
            Json::String(s) => s.contains('\0'),
            Json::Array(items) => items.iter().any(holds_nul),
            Json::Object(members) => members
                .iter()
                .any(|(k, m)| k.contains('\0') || holds_nul(m)),
            _ => false,
        }
    }
    if holds_nul(def) {
        // PostgreSQL's JSON cannot hold one; refused on every database alike.
        return Err(ApiError::bad_request(
            "the definition holds a NUL character (\\u0000), which storage cannot keep",
        ));
    }
    if let Some(limit) = app.store.json_depth()
        && !within(def, limit)
    {
        return Err(ApiError::bad_request(format!(
            "the definition nests deeper than the {limit} levels this database ({}) keeps in a JSON column",
            app.store.backend().as_str()
        )));
    }
    // MariaDB/MySQL take at most `max_allowed_packet` bytes per statement:
    // a larger definition is refused before it is sent, naming both sizes
    // (audit 106: it was a 503 "retry later" that no retry could pass, and
    // an import's dry run promised it).
    if app.store.definition_limit().is_some() {
        let size = crate::api::to_json_bytes(def).len();
        app.store.fits_one_statement("definition", size)?;
    }
    Ok(())
}

/// A connector definition that would store `******` as a secret (see
/// `validate::masked_leftovers`) is refused, naming where.
fn no_masks(def: &Json) -> Result<(), ApiError> {
    let problems = sluice_compiler::validate::masked_leftovers(def);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid("connector", problems))
    }
}

/// A definition checked for create, update or import: its id, the
/// definition (with the id filled in) and its warnings.
fn checked(
    kind: Kind,
    mut def: Json,
    id_from_path: Option<&str>,
) -> Result<(String, Json, Vec<Diagnostic>), ApiError> {
    let Some(obj) = def.as_object_mut() else {
        return Err(ApiError::bad_request(format!(
            "a {} definition must be a JSON object",
            kind.label()
        )));
    };
    let id_field = kind.id_field();
    // The field the client used: the id field, or the engine schema's `id`.
    let (given_field, given) = match obj.get(id_field) {
        Some(v) => (id_field, Some(v.clone())),
        None if kind == Kind::Workflow => ("id", obj.get("id").cloned()),
        None => (id_field, None),
    };
    // A body id other than the path's is reported with the definition's
    // other problems (it hid them: a fixed id then showed the rest).
    let mut mismatch = None;
    let id = match (id_from_path, given) {
        (Some(path_id), Some(Json::String(body_id))) if body_id != path_id => {
            mismatch = Some(Diagnostic {
                field: given_field.into(),
                message: format!("must equal the id in the path ('{path_id}')"),
            });
            Some(path_id.to_owned())
        }
        // An id of the wrong type (`null` included) is an error the
        // validator reports with the other problems; it is never replaced by
        // a generated one.
        (_, Some(given)) if !given.is_string() => None,
        (Some(path_id), _) => Some(path_id.to_owned()),
        (None, Some(Json::String(s))) => Some(s),
        (None, _) => Some(uuid::Uuid::new_v4().to_string()),
    };
    if let Some(id) = &id {
        obj.insert(id_field.into(), Json::String(id.clone()));
    }
    let (mut problems, warnings) = match kind {
        Kind::Workflow => match compile_new_workflow(&def) {
            Ok(compiled) => (Vec::new(), compiled.warnings),
            Err(problems) => (problems, Vec::new()),
        },
        Kind::Channel => (
            validate::validate_channel(&def),
            validate::channel_warnings(&def),
        ),
    };
    if let Some(mismatch) = mismatch {
        // The id field's own problem is the mismatch (the engine schema's
        // `id` is otherwise told to equal the `workflow_id` filled in from
        // the path).
        problems.retain(|p| p.field != mismatch.field);
        problems.insert(0, mismatch);
    }
    // A channel's misspelt fields among its problems, as a workflow's are
    // (after the mismatch, which may be the only one).
    if kind == Kind::Channel {
        sluice_compiler::diag::with_misspellings(&mut problems, &warnings);
    }
    match id {
        Some(id) if problems.is_empty() => Ok((id, def, warnings)),
        _ => {
            if problems.is_empty() {
                problems.push(Diagnostic {
                    field: id_field.into(),
                    message: "expected string".into(),
                });
            }
            Err(ApiError::invalid(kind.label(), problems))
        }
    }
}

async fn list(app: &App, req: &Req, kind: Kind) -> ApiResult {
    let (limit, offset) = paging(req)?;
    let q = ListQuery {
        status: status_filter(req)?,
        tag: req.query("tag").map(str::to_owned),
        channel_type: one_of_filter(req, "channel_type", &["sync", "async"])?,
        protocol: one_of_filter(req, "protocol", &["rest", "http", "kafka"])?,
        limit,
        offset,
    };
    let (records, total) = app.store.list(kind, &q).await?;
    api::page(
        records.iter().map(|r| r.to_json(kind)).collect(),
        total,
        limit,
        offset,
    )
}

async fn create(app: &App, req: &Req, kind: Kind, who: Principal) -> ApiResult {
    let (id, def, mut warnings) = checked(kind, req.json()?, None)?;
    warnings.extend(reference_warnings(app, kind, &def).await?);
    storable(app, &def)?;
    let record = app
        .store
        .create(kind, &id, &def, audit(who, "create"))
        .await?;
    with_warnings(http::StatusCode::CREATED, record.to_json(kind), &warnings)
}

/// `{data}`, and beside it the definition's `warnings` when it has some
/// (what `POST .../validate` would have answered: a misspelt field, a data
/// function's input that will fail when it runs).
fn with_warnings(status: http::StatusCode, data: Json, warnings: &[Diagnostic]) -> ApiResult {
    if warnings.is_empty() {
        return Ok(api::json_response(status, &json!({ "data": data })));
    }
    Ok(api::json_response(
        status,
        &json!({ "data": data, "warnings": warnings }),
    ))
}

/// `?version=N`: a positive integer, or absent (the latest).
fn version_param(req: &Req) -> Result<Option<i64>, ApiError> {
    match req.query("version") {
        None => Ok(None),
        Some(v) => match v.parse::<i64>() {
            Ok(n) if n >= 1 => Ok(Some(n)),
            _ => Err(ApiError::bad_request(format!(
                "version must be a positive integer, got '{v}'"
            ))),
        },
    }
}

async fn get(app: &App, req: &Req, kind: Kind, id: &str) -> ApiResult {
    let version = version_param(req)?;
    let record = app.store.get(kind, id, version).await?;
    api::ok(&record.to_json(kind))
}

async fn update(app: &App, req: &Req, kind: Kind, id: &str, who: Principal) -> ApiResult {
    let (_, def, mut warnings) = checked(kind, req.json()?, Some(id))?;
    warnings.extend(reference_warnings(app, kind, &def).await?);
    storable(app, &def)?;
    let record = app
        .store
        .update_draft(kind, id, &def, audit(who, "update"))
        .await?;
    with_warnings(http::StatusCode::OK, record.to_json(kind), &warnings)
}

async fn delete(app: &App, req: &Req, kind: Kind, id: &str, who: Principal) -> ApiResult {
    // DELETE removes every version (the spec's lifecycle table); a
    // `?version=` meant for one version must not remove the live one.
    if req.query("version").is_some() {
        return Err(ApiError::bad_request(format!(
            "DELETE removes every version of the {label}; it takes no version (archive a version with PATCH /{label}s/{{id}}/status instead)",
            label = kind.label()
        )));
    }
    // A channel's breakers go with it (every name its versions had): one
    // created later under a name starts closed (audit 67: it inherited an
    // open breaker).
    let names: Vec<String> = match kind {
        Kind::Channel => app
            .store
            .versions(kind, id)
            .await
            .unwrap_or_default()
            .iter()
            .filter_map(|r| {
                r.definition
                    .get("name")
                    .and_then(Json::as_str)
                    .map(str::to_owned)
            })
            .collect(),
        Kind::Workflow => Vec::new(),
    };
    app.store.delete(kind, id, audit(who, "delete")).await?;
    for name in &names {
        app.connectors.policy.breakers.forget_channel(name);
    }
    reload_after_change(app, who).await;
    api::no_content()
}

async fn versions(app: &App, req: &Req, kind: Kind, id: &str) -> ApiResult {
    let (limit, offset) = paging(req)?;
    let all = app.store.versions(kind, id).await?;
    let total = all.len() as i64;
    // Newest first, like every list.
    let page = all
        .iter()
        .rev()
        .skip(offset as usize)
        .take(limit as usize)
        .map(|r| r.to_json(kind))
        .collect();
    api::page(page, total, limit, offset)
}

async fn new_version(app: &App, kind: Kind, id: &str, who: Principal) -> ApiResult {
    let record = app
        .store
        .new_version(kind, id, audit(who, "new_version"))
        .await?;
    api::created(&record.to_json(kind))
}

fn percentage(body: &Json, field: &str, required: bool) -> Result<Option<i64>, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request(format!(
            "the body must be a JSON object like {{\"{field}\": 30}}, got {}",
            sluice_compiler::diag::type_name(body)
        )));
    }
    match body.get(field) {
        // `null` is not "absent" (docs/decisions.md).
        Some(Json::Null) => Err(ApiError::invalid(
            "request",
            vec![Diagnostic {
                field: field.into(),
                message: "expected integer, got null".into(),
            }],
        )),
        None if !required => Ok(None),
        None => Err(ApiError::invalid(
            "request",
            vec![Diagnostic {
                field: field.into(),
                message: "is required".into(),
            }],
        )),
        Some(v) => {
            let message = match v.as_i64() {
                Some(n) if (1..=100).contains(&n) => return Ok(Some(n)),
                Some(_) => format!("must be an integer from 1 to 100, got {v}"),
                None if sluice_compiler::diag::is_huge_integer(v) => {
                    format!(
                        "must be an integer from 1 to 100, got {}",
                        sluice_compiler::diag::number_text(v)
                    )
                }
                // The spec's wording for a value of the wrong type.
                None => format!(
                    "expected integer, got {}",
                    sluice_compiler::diag::type_name(v)
                ),
            };
            Err(ApiError::invalid(
                "request",
                vec![Diagnostic {
                    field: field.into(),
                    message,
                }],
            ))
        }
    }
}

async fn set_status(app: &App, req: &Req, kind: Kind, id: &str, who: Principal) -> ApiResult {
    let body = req.json()?;
    if !body.is_object() {
        return Err(ApiError::bad_request(format!(
            "the body must be a JSON object like {{\"status\": \"active\"}}, got {}",
            sluice_compiler::diag::type_name(&body)
        )));
    }
    // Every problem of the body at once, as a definition's.
    let mut problems = Vec::new();
    let mut problem = |field: &str, message: String| {
        problems.push(Diagnostic {
            field: field.into(),
            message,
        })
    };
    let target = match body.get("status") {
        Some(Json::String(s)) if s == "active" => Some(Status::Active),
        Some(Json::String(s)) if s == "archived" => Some(Status::Archived),
        Some(Json::String(s)) if s == "paused" => Some(Status::Paused),
        Some(Json::String(other)) => {
            problem(
                "status",
                format!("must be one of active, archived, paused, got '{other}'"),
            );
            None
        }
        Some(other) => {
            problem(
                "status",
                format!(
                    "expected string, got {}",
                    sluice_compiler::diag::type_name(other)
                ),
            );
            None
        }
        None => {
            problem("status", "is required".into());
            None
        }
    };
    let rollout = if kind == Kind::Workflow {
        match percentage(&body, "rollout_percentage", false) {
            Ok(Some(_)) if matches!(target, Some(Status::Archived | Status::Paused)) => {
                problem(
                    "rollout_percentage",
                    "applies only when activating (status active)".into(),
                );
                None
            }
            Ok(p) => p,
            Err(e) => {
                for d in e.details.unwrap_or_default() {
                    problem(&d.field, d.message);
                }
                None
            }
        }
    } else {
        if body.get("rollout_percentage").is_some() {
            // A channel's versions do not split traffic: the share would be
            // ignored while the answer said 200.
            problem(
                "rollout_percentage",
                "channels have no rollout: only workflow versions split traffic".into(),
            );
        }
        None
    };
    let version = match body.get("version") {
        None => None,
        Some(v) => match v.as_i64().filter(|n| *n >= 1) {
            Some(n) => Some(n),
            None => {
                problem(
                    "version",
                    if sluice_compiler::diag::is_huge_integer(v) {
                        format!(
                            "must be a positive integer up to {}, got {}",
                            i64::MAX,
                            sluice_compiler::diag::number_text(v)
                        )
                    } else if v.is_i64() {
                        format!("must be a positive integer, got {v}")
                    } else {
                        format!(
                            "expected integer, got {}",
                            sluice_compiler::diag::type_name(v)
                        )
                    },
                );
                None
            }
        },
    };
    // A misspelt key would otherwise change live traffic in a way the
    // caller did not ask for (`rollout_percent` activating at 100 %).
    // (A channel's `rollout_percentage` has its own message above.)
    let known: &[&str] = match kind {
        Kind::Workflow => &["status", "version", "rollout_percentage"],
        Kind::Channel => &["status", "version"],
    };
    for key in body.as_object().into_iter().flat_map(|o| o.keys()) {
        if !known.contains(&key.as_str()) && key != "rollout_percentage" {
            problem(key, unknown_key_message(known));
        }
    }
    let Some(target) = target.filter(|_| problems.is_empty()) else {
        return Err(ApiError::invalid("request", problems));
    };
    // Pausing is not one of the documented audit actions: it is recorded
    // as an `update` whose details carry the new status.
    let action = match target {
        Status::Active => "activate",
        Status::Archived => "archive",
        _ => "update",
    };
    let record = app
        .store
        .set_status_checked(
            kind,
            id,
            target,
            version,
            rollout,
            audit(who, action),
            &|record| activatable(kind, record),
            // Two channels never consume one topic in one consumer group:
            // checked against what storage holds active, serialised with
            // every other channel activation (audit 81: against the engine,
            // racing activations both passed).
            (kind == Kind::Channel).then_some(&AgainstActive {
                applies: &|record| !crate::kafka::consumes(app, &record.definition).is_empty(),
                check: &|record, others| match crate::kafka::shared_group(
                    app,
                    &record.definition,
                    others,
                ) {
                    Some(why) => Err(StorageError::Conflict(why)),
                    None => Ok(()),
                },
            }),
        )
        .await?;
    let mut warnings = Vec::new();
    if kind == Kind::Channel
        && target == Status::Active
        && !app.config.kafka.enabled
        && record.definition.get("protocol").and_then(Json::as_str) == Some("kafka")
    {
        tracing::warn!(
            channel = %id,
            "a Kafka channel was activated but kafka.enabled is false: nothing is consumed until Kafka is enabled"
        );
        // Said to the caller too (audit 118: only the log said it).
        warnings.push(Diagnostic {
            field: "protocol".into(),
            message: KAFKA_OFF_CHANNEL.into(),
        });
    }
    reload_after_change(app, who).await;
    with_warnings(http::StatusCode::OK, record.to_json(kind), &warnings)
}

/// The warning for a Kafka channel on a service without Kafka.
const KAFKA_OFF_CHANNEL: &str = "kafka.enabled is false on this service: nothing is consumed from the topic until it is enabled";

/// The message for a key a small control body (status, rollout) does not
/// take.
fn unknown_key_message(known: &[&str]) -> String {
    format!("unknown field; expected {}", known.join(", "))
}

async fn rollout(app: &App, req: &Req, id: &str, who: Principal) -> ApiResult {
    let body = req.json()?;
    // Every problem at once: the percentage's and any other key.
    let (p, mut problems) = match percentage(&body, "rollout_percentage", true) {
        Ok(p) => (p.unwrap_or(100), Vec::new()),
        Err(e) if e.details.is_none() => return Err(e),
        Err(e) => (100, e.details.unwrap_or_default()),
    };
    problems.extend(
        body.as_object()
            .into_iter()
            .flat_map(|o| o.keys())
            .filter(|k| *k != "rollout_percentage")
            .map(|k| Diagnostic {
                field: k.clone(),
                message: unknown_key_message(&["rollout_percentage"]),
            }),
    );
    if !problems.is_empty() {
        return Err(ApiError::invalid("request", problems));
    }
    let (record, changed) = app
        .store
        .set_rollout(Kind::Workflow, id, p, audit(who, "rollout"))
        .await?;
    if changed {
        reload_after_change(app, who).await;
    }
    api::ok(&record.to_json(Kind::Workflow))
}

/// Whether the engine can serve a stored version: a definition stored by an
/// older release (or edited in the database) may no longer compile, and an
/// active one that does not would fail every reload after it.
fn activatable(kind: Kind, record: &crate::storage::Record) -> Result<(), StorageError> {
    let def = record.to_json(kind);
    let problems = match kind {
        Kind::Workflow => match compile_stored_workflow(&def) {
            Ok(_) => return Ok(()),
            Err(problems) => problems,
        },
        // What the engine needs to load it (as `engine::build_channel`
        // reads it), not the rules for new definitions: an older version
        // stored under laxer rules can still be rolled back to.
        Kind::Channel => match serde_json::from_value::<sluice_compiler::def::ChannelDef>(def) {
            Err(e) => vec![Diagnostic::new("", e.to_string())],
            Ok(c) => match c
                .validation_logic
                .as_ref()
                .map(sluice_compiler::logic::compile)
            {
                Some(Err(e)) => vec![Diagnostic::new(
                    "validation_logic",
                    format!("invalid JSONLogic: {}", e.message),
                )],
                _ => Vec::new(),
            },
        },
    };
    if problems.is_empty() {
        return Ok(());
    }
    Err(StorageError::Invalid(
        format!(
            "{} '{}' version {} cannot be activated: its stored definition is invalid ({} problem{})",
            kind.label(),
            record.id,
            record.version,
            problems.len(),
            if problems.len() == 1 { "" } else { "s" }
        ),
        problems,
    ))
}

/// Lifecycle changes reload the engine (audit-logged). A failed reload leaves
/// the previous engine serving; the change itself is already committed.
async fn reload_after_change(app: &App, who: Principal) {
    if let Err(e) = app.changed(Some(audit(who, "reload"))).await {
        tracing::error!(
            ?e,
            "reload after a lifecycle change failed; the previous engine keeps serving"
        );
    }
}

async fn validate_workflow(app: &App, req: &Req) -> ApiResult {
    let def = req.json()?;
    if !def.is_object() {
        return Err(ApiError::bad_request(
            "a workflow definition must be a JSON object",
        ));
    }
    match compile_new_workflow(&def) {
        Ok(mut compiled) => {
            compiled.warnings.extend(connector_warnings(app, &def));
            api::ok(&json!({"valid": true, "warnings": compiled.warnings}))
        }
        Err(problems) => Err(ApiError::invalid("workflow", problems)),
    }
}

/// Warnings about what a definition names that does not exist (yet): a
/// workflow's connectors, a channel's `workflow_id`.
async fn reference_warnings(
    app: &App,
    kind: Kind,
    def: &Json,
) -> Result<Vec<Diagnostic>, ApiError> {
    if kind == Kind::Workflow {
        return Ok(connector_warnings(app, def));
    }
    let mut out = route_takeovers(app, def);
    if !app.config.kafka.enabled && def.get("protocol").and_then(Json::as_str) == Some("kafka") {
        out.push(Diagnostic {
            field: "protocol".into(),
            message: KAFKA_OFF_CHANNEL.into(),
        });
    }
    let Some(workflow) = def.get("workflow_id").and_then(Json::as_str) else {
        return Ok(out);
    };
    match app.store.get(Kind::Workflow, workflow, None).await {
        Ok(_) => {}
        Err(StorageError::NotFound(_)) => out.push(Diagnostic {
            field: "workflow_id".into(),
            message: format!(
                "no workflow '{workflow}' exists; the channel answers 404 until one is created and activated"
            ),
        }),
        Err(e) => return Err(e.into()),
    }
    Ok(out)
}

/// Served channels whose route and methods a channel's would share (the
/// same segments, parameters by position): one of them never sees those
/// requests, which the answer to the other's create does not otherwise
/// show (audit 118).
fn route_takeovers(app: &App, def: &Json) -> Vec<Diagnostic> {
    let Some(pattern) = def.get("route_pattern").and_then(Json::as_str) else {
        return Vec::new();
    };
    if def
        .get("protocol")
        .and_then(Json::as_str)
        .is_some_and(|p| p != "rest")
    {
        return Vec::new();
    }
    let shape = |p: &str| -> Vec<String> {
        p.split('/')
            .filter(|s| !s.is_empty())
            .map(|s| {
                if s.starts_with('{') && s.ends_with('}') {
                    "{}".to_owned()
                } else {
                    s.to_owned()
                }
            })
            .collect()
    };
    let mine = shape(pattern);
    let text = |k: &str| def.get(k).and_then(Json::as_str);
    let methods: Vec<String> = def
        .get("methods")
        .and_then(Json::as_array)
        .map(|m| {
            m.iter()
                .filter_map(Json::as_str)
                .map(str::to_ascii_uppercase)
                .collect()
        })
        .unwrap_or_default();
    let snapshot = app.engine.load();
    let mut others: Vec<&crate::engine::Channel> = snapshot
        .channels
        .values()
        .map(|c| &**c)
        .filter(|c| {
            Some(c.name.as_str()) != text("name") && Some(c.id.as_str()) != text("channel_id")
        })
        .collect();
    others.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = Vec::new();
    for other in others {
        let Some(theirs) = other
            .def
            .route_pattern
            .as_deref()
            .filter(|_| other.def.protocol() == sluice_compiler::def::Protocol::Rest)
        else {
            continue;
        };
        let shared: Vec<&str> = other
            .def
            .methods
            .iter()
            .map(|m| m.as_str())
            .filter(|m| methods.iter().any(|x| x == m))
            .collect();
        if shape(theirs) != mine || shared.is_empty() {
            continue;
        }
        out.push(Diagnostic {
            field: "route_pattern".into(),
            message: format!(
                "channel '{}' already serves {} {theirs}: each such request goes to one of \
                 the two, by priority, then the channel id first in order",
                other.name,
                shared.join(", ")
            ),
        });
    }
    out
}

/// Warnings about the connectors a workflow's tasks name: one that does
/// not exist (yet: it may be created after the workflow), or one of
/// another type than the function calls. Either fails the task when it
/// runs; the definition itself is valid, so these are warnings.
fn connector_warnings(app: &App, def: &Json) -> Vec<Diagnostic> {
    fn walk(app: &App, steps: &Json, at: &str, out: &mut Vec<Diagnostic>) {
        let Some(steps) = steps.as_array() else {
            return;
        };
        for (i, step) in steps.iter().enumerate() {
            let at = format!("{at}[{i}]");
            if let Some(children) = step.get("tasks") {
                walk(app, children, &format!("{at}.tasks"), out);
                continue;
            }
            let function = step.pointer("/function/name").and_then(Json::as_str);
            if function == Some("publish_kafka") && !app.config.kafka.enabled {
                out.push(Diagnostic {
                    field: format!("{at}.function.name"),
                    message: "kafka.enabled is false on this service: publish_kafka fails on every run until it is enabled".into(),
                });
            }
            let needs = match function {
                Some("http_call") => "http",
                Some("db_read" | "db_write") => "db",
                Some("cache_read" | "cache_write") => "cache",
                Some("mongo_read") => "mongodb",
                Some("publish_kafka") => "kafka",
                _ => continue,
            };
            let Some(name) = step
                .pointer("/function/input/connector")
                .and_then(Json::as_str)
            else {
                continue;
            };
            let message = match app.connectors.type_of(name) {
                None => format!(
                    "no connector named '{name}' exists; the task fails until one is created"
                ),
                Some(t) if t.name() != needs => format!(
                    "connector '{name}' is of type {}; {} needs a connector of type {needs}",
                    t.name(),
                    function.unwrap_or_default()
                ),
                Some(_) => {
                    // The query's placeholders against the connector's
                    // database and the task's params: a mismatch is a
                    // driver error on every run.
                    let input = step.pointer("/function/input");
                    let query = input.and_then(|i| i.get("query")).and_then(Json::as_str);
                    if let (Some(query), Some(dialect)) = (query, app.connectors.sql_dialect(name))
                    {
                        let params = input
                            .and_then(|i| i.get("params"))
                            .and_then(Json::as_array)
                            .map_or(0, Vec::len);
                        if let Some(problem) =
                            sluice_compiler::sql::placeholder_problem(query, params, dialect)
                        {
                            out.push(Diagnostic {
                                field: format!("{at}.function.input.query"),
                                message: format!("{problem} (connector '{name}')"),
                            });
                        }
                    }
                    continue;
                }
            };
            out.push(Diagnostic {
                field: format!("{at}.function.input.connector"),
                message,
            });
        }
    }
    let mut out = Vec::new();
    walk(app, &def["tasks"], "tasks", &mut out);
    out
}

/// The definitions of an import body: a JSON array, or the export's own
/// answer `{"data": [...]}` as it came.
fn import_items(body: Json) -> Result<Vec<Json>, ApiError> {
    match body {
        Json::Array(items) => Ok(items),
        // An export's `{data}`, or a list's `{data, total, limit, offset}`
        // (channels and connectors have no export of their own).
        Json::Object(mut obj)
            if obj
                .keys()
                .all(|k| matches!(k.as_str(), "data" | "total" | "limit" | "offset")) =>
        {
            match obj.remove("data") {
                Some(Json::Array(items)) => Ok(items),
                _ => Err(not_an_import()),
            }
        }
        _ => Err(not_an_import()),
    }
}

fn not_an_import() -> ApiError {
    ApiError::bad_request(
        "import expects a JSON array of definitions (or an export's or a list's {\"data\": [...]})",
    )
}

/// `?dry_run=`: `true` or `false` (`1` and `0` too); anything else is a 400,
/// so a misspelt dry run never writes.
fn dry_run_flag(req: &Req) -> Result<bool, ApiError> {
    bool_flag(req, "dry_run")
}

/// A boolean query parameter: `true` or `false` (`1`, `0` too); absent is
/// false; anything else is a 400 naming it (`?connectors=yes` was read as
/// false without a word).
fn bool_flag(req: &Req, name: &str) -> Result<bool, ApiError> {
    match req.query(name) {
        None | Some("false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "{name} must be true or false (or 1, 0), got '{other}'"
        ))),
    }
}

/// One failed import item.
fn import_failure(index: usize, field: &str, message: impl Into<String>) -> Json {
    json!({"index": index, "details": [{"field": field, "message": message.into()}]})
}

/// The field a lifecycle conflict is about: a channel's name or the id.
fn conflict_field(kind: Kind, message: &str) -> &'static str {
    if kind == Kind::Channel && message.starts_with("a channel named") {
        "name"
    } else {
        kind.id_field()
    }
}

async fn import(app: &App, req: &Req, kind: Kind, who: Principal) -> ApiResult {
    let items = import_items(req.json()?)?;
    let dry_run = dry_run_flag(req)?;
    let mut created = Vec::new();
    let mut failed = Vec::new();
    // The same warnings create answers, per item (`index` as in `failed`).
    let mut warned = Vec::new();
    // A dry run answers what the import would: the same checks, and the
    // conflicts with stored resources and with earlier items of the batch.
    let mut seen_ids = std::collections::HashSet::new();
    let mut seen_names = std::collections::HashSet::new();
    for (index, item) in items.into_iter().enumerate() {
        let (id, def) = match checked(kind, item, None)
            .and_then(|(id, def, w)| storable(app, &def).map(|()| (id, def, w)))
        {
            Ok((id, def, mut warnings)) => {
                // Storage failing here stops the import as a create's
                // failure does, naming what was imported before it.
                let references = reference_warnings(app, kind, &def)
                    .await
                    .map_err(|e| import_interrupted(e, &created))?;
                warnings.extend(references);
                if !warnings.is_empty() {
                    warned.push(json!({"index": index, "details": warnings}));
                }
                (id, def)
            }
            Err(e) => {
                let details = e.details.unwrap_or_else(|| {
                    vec![Diagnostic {
                        field: String::new(),
                        message: e.message,
                    }]
                });
                failed.push(json!({"index": index, "details": details}));
                continue;
            }
        };
        if dry_run {
            let name = def.get("name").and_then(Json::as_str).unwrap_or_default();
            let exists = match app.store.get(kind, &id, None).await {
                Ok(_) => true,
                Err(crate::storage::StorageError::NotFound(_)) => false,
                Err(e) => return Err(e.into()),
            };
            if exists || !seen_ids.insert(id.clone()) {
                let message = format!("{} '{id}' already exists", kind.label());
                failed.push(import_failure(index, kind.id_field(), message));
            } else if kind == Kind::Channel
                && (!seen_names.insert(name.to_owned())
                    || app.store.channel_name_taken(name, &id).await?)
            {
                let message = format!("a channel named '{name}' already exists");
                failed.push(import_failure(index, "name", message));
            } else {
                created.push(Json::String(id));
            }
            continue;
        }
        match app
            .store
            .create(kind, &id, &def, audit(who, "import"))
            .await
        {
            Ok(_) => created.push(Json::String(id)),
            Err(e) => {
                let e = ApiError::from(e);
                if e.code.status().is_server_error() {
                    return Err(import_interrupted(e, &created));
                }
                let field = conflict_field(kind, &e.message);
                failed.push(import_failure(index, field, e.message));
            }
        }
    }
    import_answer(created, failed, warned, dry_run)
}

/// An import that storage stopped (unavailable, or failing on its side):
/// the whole request answers that error, as a dry run and every other
/// admin request do, so a client retries it instead of reading a
/// definition problem into `failed` under a 200 (audit 106). What was
/// imported before stays (each item is its own change) and is named, so
/// the retry's conflicts for those items are expected.
fn import_interrupted(mut e: ApiError, created: &[Json]) -> ApiError {
    if !created.is_empty() {
        let ids: Vec<&str> = created.iter().filter_map(Json::as_str).collect();
        e.message = format!(
            "{}; imported before the failure: {}",
            e.message,
            ids.join(", ")
        );
    }
    e
}

/// An import's answer (workflows, channels and connectors alike), with
/// warnings only for the items that were (or would be) created.
fn import_answer(
    created: Vec<Json>,
    failed: Vec<Json>,
    mut warned: Vec<Json>,
    dry_run: bool,
) -> ApiResult {
    warned.retain(|w| !failed.iter().any(|f| f["index"] == w["index"]));
    api::ok(&json!({
        "created": created,
        "failed": failed,
        "warnings": warned,
        "dry_run": dry_run,
    }))
}

/// Every workflow the filters match, read by one statement: pages of the
/// list (sorted by each id's newest version, which a change moves) could
/// skip a workflow changed while they were read and show another twice
/// (audit 124), and the export is a backup.
async fn export(app: &App, req: &Req) -> ApiResult {
    let q = ListQuery {
        status: status_filter(req)?,
        tag: req.query("tag").map(str::to_owned),
        limit: i64::MAX,
        offset: 0,
        ..ListQuery::default()
    };
    let (records, _) = app.store.list(Kind::Workflow, &q).await?;
    let out: Vec<Json> = records.iter().map(|r| r.to_json(Kind::Workflow)).collect();
    api::ok(&out)
}

async fn dry_run(app: &App, req: &Req, id: &str) -> ApiResult {
    let body = req.json()?;
    if !body.is_object() {
        return Err(ApiError::bad_request(
            "the body must be a JSON object {\"data\": …, \"metadata\"?: {…}}",
        ));
    }
    let meta = body.get("metadata").unwrap_or(&Json::Null);
    // A misspelt `data` would run the workflow on no payload and answer
    // success (audit 80), as a misspelt status key would change traffic.
    let mut problems: Vec<Diagnostic> = body
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys())
        .filter(|k| !matches!(k.as_str(), "data" | "metadata"))
        .map(|k| Diagnostic {
            field: k.clone(),
            message: unknown_key_message(&["data", "metadata"]),
        })
        .collect();
    problems.extend(crate::data::metadata_problems(meta));
    if !problems.is_empty() {
        return Err(ApiError::invalid("request", problems));
    }
    let meta_str = |k: &str| crate::data::metadata_str(meta, k);
    // A version that is not one used to run the latest instead.
    let version = version_param(req)?;
    let record = app.store.get(Kind::Workflow, id, version).await?;
    let compiled = compile_stored_workflow(&record.to_json(Kind::Workflow))
        .map_err(|p| ApiError::invalid("workflow", p))?;
    let payload = body.get("data").cloned().unwrap_or(Json::Null);
    let meta_json = body.get("metadata").cloned().unwrap_or(Json::Null);
    let pairs = |area| crate::data::metadata_pairs(&meta_json, area);
    let (headers, query, path) = (pairs("headers"), pairs("query"), pairs("path"));
    use crate::data::borrow_pairs;
    let (h, q, p) = (
        borrow_pairs(&headers),
        borrow_pairs(&query),
        borrow_pairs(&path),
    );
    let payload_text = serde_json::to_vec(&payload).unwrap_or_default();
    let input = Input {
        body: &payload_text,
        payload_from: PayloadFrom::Whole,
        meta: Meta {
            headers: &h,
            query: &q,
            path: &p,
            method: meta_str("method").unwrap_or("POST"),
            channel: meta_str("channel").unwrap_or(""),
            request_id: meta_str("request_id").unwrap_or(req.request_id.as_str()),
            extra: &[],
        },
        bucket: None,
    };
    // Without ?connectors=true, connector tasks are reported as skipped so a
    // dry-run has no side effects on the connectors' targets.
    let options = Options {
        record_tasks: true,
        skip_connectors: !bool_flag(req, "connectors")?,
        ..Options::default()
    };
    let scope = CallScope::default();
    let result = exec::execute([&compiled.plan], input, &app.services, &scope, &options)
        .await
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    api::ok(&crate::data::dry_run_answer(&result))
}

// ---------------------------------------------------------------- connectors

fn masked(mut v: Json) -> Json {
    validate::mask_secrets(&mut v);
    v
}

fn checked_connector(def: Json, name_from_path: Option<&str>) -> Result<Json, ApiError> {
    if !def.is_object() {
        return Err(ApiError::bad_request(
            "a connector definition must be a JSON object",
        ));
    }
    // Reported with the definition's other problems, as for workflows.
    let mismatch = match (name_from_path, def.get("name").and_then(Json::as_str)) {
        (Some(path), Some(name)) if path != name => Some(Diagnostic {
            field: "name".into(),
            message: format!("must equal the name in the path ('{path}')"),
        }),
        _ => None,
    };
    let mut def = def;
    // The path names the connector when the body leaves `name` out; a
    // `name` of the wrong type (`5`, `null`) is reported as the field
    // error it is, not replaced.
    if let (Some(path), Some(obj)) = (name_from_path, def.as_object_mut())
        && !obj.contains_key("name")
    {
        obj.insert("name".into(), Json::String(path.to_owned()));
    }
    let mut problems = validate::validate_connector(&def);
    if !problems.is_empty() {
        // A field that holds the mask is named for that (`no_masks`), not
        // for the shape the mask lacks: a `connection_string` of `******`
        // (copied from an answer) said "must start with one of sqlite:, …".
        let masks = validate::masked_leftovers(&def);
        problems.retain(|p| !masks.iter().any(|m| m.field == p.field));
        problems.splice(0..0, masks);
    }
    if let Some(mismatch) = mismatch {
        problems.insert(0, mismatch);
    }
    sluice_compiler::diag::with_misspellings(&mut problems, &validate::connector_warnings(&def));
    if problems.is_empty() {
        Ok(def)
    } else {
        Err(ApiError::invalid("connector", problems))
    }
}

async fn list_connectors(app: &App, req: &Req) -> ApiResult {
    let (limit, offset) = paging(req)?;
    let (records, total) = app.store.list_connectors(limit, offset).await?;
    api::page(
        records
            .iter()
            .map(|r| masked(r.to_connector_json()))
            .collect(),
        total,
        limit,
        offset,
    )
}

async fn create_connector(app: &App, req: &Req, who: Principal) -> ApiResult {
    let def = checked_connector(req.json()?, None)?;
    storable(app, &def)?;
    no_masks(&def)?;
    let record = app
        .store
        .create_connector(&def, audit(who, "create"))
        .await?;
    connectors_changed(app).await;
    with_warnings(
        http::StatusCode::CREATED,
        masked(record.to_connector_json()),
        &connector_def_warnings(app, &def),
    )
}

/// A connector's warnings: the keys its type does not read, and an HTTP
/// connector whose URL is a literal address the SSRF guard refuses (every
/// call would fail while `security.allow_private_networks` is false; a host
/// name is only judged when it is resolved, at call time).
fn connector_def_warnings(app: &App, def: &Json) -> Vec<Diagnostic> {
    let mut out = validate::connector_warnings(def);
    if !app.config.security.allow_private_networks
        && def.get("connector_type").and_then(Json::as_str) == Some("http")
        && let Some(url) = def.pointer("/config/url").and_then(Json::as_str)
        // An `env://` reference is resolved when the connector is built;
        // its value is not checked (nor shown) here.
        && !url.starts_with("env://")
        && let Ok(url) = reqwest::Url::parse(url)
        && let Err(refused) = crate::connectors::ssrf::check_url(&url)
    {
        out.push(Diagnostic::new(
            "config.url",
            format!("{refused}: every call fails while security.allow_private_networks is false"),
        ));
    }
    out
}

async fn get_connector(app: &App, name: &str) -> ApiResult {
    api::ok(&masked(
        app.store.get_connector(name).await?.to_connector_json(),
    ))
}

async fn update_connector(app: &App, req: &Req, name: &str, who: Principal) -> ApiResult {
    let mut def = req.json()?;
    // A definition read back from the API carries `******` for its secrets;
    // sending it back (after editing something else) keeps the stored ones.
    // What a secret was put back from must still be stored when the update
    // is written (checked in its transaction).
    let mut expected = None;
    match app.store.get_connector(name).await {
        Ok(record) => {
            let shown = masked(record.definition.clone());
            let sent = def.clone();
            restore_masked(&mut def, &record.definition, &shown);
            if def != sent {
                expected = Some(record.definition);
            }
        }
        Err(crate::storage::StorageError::NotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    let def = checked_connector(def, Some(name))?;
    storable(app, &def)?;
    no_masks(&def)?;
    let record = app
        .store
        .update_connector(name, &def, audit(who, "update"), expected.as_ref())
        .await?;
    // A changed connector (a fixed URL, new credentials) starts with closed
    // breakers: the failures they counted were the old definition's.
    app.connectors.policy.breakers.forget_connector(name);
    connectors_changed(app).await;
    with_warnings(
        http::StatusCode::OK,
        masked(record.to_connector_json()),
        &connector_def_warnings(app, &def),
    )
}

/// Wherever `new` holds exactly what the API showed for the stored value
/// (`shown`, the stored definition masked) and masking had changed it, puts
/// the stored value back. A secret written out anew is taken as written.
fn restore_masked(new: &mut Json, stored: &Json, shown: &Json) {
    if new == shown && shown != stored {
        *new = stored.clone();
        return;
    }
    match (new, stored, shown) {
        (Json::Object(new), Json::Object(stored), Json::Object(shown)) => {
            for (key, value) in new.iter_mut() {
                // A header's name may come back in another case (`x-api-key`
                // for `X-Api-Key`): names are case-insensitive, so the
                // stored one is found either way.
                let stored_key = if stored.contains_key(key) {
                    Some(key.as_str())
                } else {
                    stored
                        .keys()
                        .find(|k| k.eq_ignore_ascii_case(key))
                        .map(String::as_str)
                };
                if let Some(k) = stored_key
                    && let (Some(stored), Some(shown)) = (stored.get(k), shown.get(k))
                {
                    restore_masked(value, stored, shown);
                }
            }
        }
        (Json::Array(new), Json::Array(stored), Json::Array(shown)) => {
            for ((value, stored), shown) in new.iter_mut().zip(stored).zip(shown) {
                restore_masked(value, stored, shown);
            }
        }
        _ => {}
    }
}

async fn delete_connector(app: &App, name: &str, who: Principal) -> ApiResult {
    app.store
        .delete_connector(name, audit(who, "delete"))
        .await?;
    app.connectors.policy.breakers.forget_connector(name);
    connectors_changed(app).await;
    api::no_content()
}

async fn import_connectors(app: &App, req: &Req, who: Principal) -> ApiResult {
    let items = import_items(req.json()?)?;
    let dry_run = dry_run_flag(req)?;
    let (mut created, mut failed, mut warned) = (Vec::new(), Vec::new(), Vec::new());
    let mut seen = std::collections::HashSet::new();
    for (index, item) in items.into_iter().enumerate() {
        let def = match checked_connector(item, None)
            .and_then(|def| storable(app, &def).map(|()| def))
            .and_then(|def| no_masks(&def).map(|()| def))
        {
            Ok(def) => {
                let warnings = connector_def_warnings(app, &def);
                if !warnings.is_empty() {
                    warned.push(json!({"index": index, "details": warnings}));
                }
                def
            }
            Err(e) => {
                // Problems at the root (not an object, too deep) at `field: ""`.
                let details = e.details.unwrap_or_else(|| {
                    vec![Diagnostic {
                        field: String::new(),
                        message: e.message,
                    }]
                });
                failed.push(json!({"index": index, "details": details}));
                continue;
            }
        };
        let name = def
            .get("name")
            .and_then(Json::as_str)
            .unwrap_or_default()
            .to_owned();
        if dry_run {
            let exists = match app.store.get_connector(&name).await {
                Ok(_) => true,
                Err(crate::storage::StorageError::NotFound(_)) => false,
                Err(e) => return Err(e.into()),
            };
            if exists || !seen.insert(name.clone()) {
                let message = format!("connector '{name}' already exists");
                failed.push(import_failure(index, "name", message));
            } else {
                created.push(Json::String(name));
            }
            continue;
        }
        match app.store.create_connector(&def, audit(who, "import")).await {
            Ok(_) => created.push(Json::String(name)),
            Err(e) => {
                let e = ApiError::from(e);
                if e.code.status().is_server_error() {
                    if !created.is_empty() {
                        connectors_changed(app).await;
                    }
                    return Err(import_interrupted(e, &created));
                }
                failed.push(import_failure(index, "name", e.message));
            }
        }
    }
    if !dry_run && !created.is_empty() {
        connectors_changed(app).await;
    }
    import_answer(created, failed, warned, dry_run)
}

async fn reload_connectors(app: &App, who: Principal) -> ApiResult {
    // The other replicas reload theirs (and their engines) too.
    let n = app.connectors_changed().await?;
    let report = json!({"connectors": n});
    // The shared decisions give every `reload` `resource_type: engine`;
    // the id says what was reloaded. The generation it made is recorded
    // as an engine reload's is.
    let mut entry = audit(who, "reload");
    entry.resource_type = "engine".into();
    entry.resource_id = "connectors".into();
    entry.details = json!({"connectors": n, "generation": app.engine.load().generation});
    if let Err(e) = app.store.audit(entry).await {
        tracing::error!(error = %e, "could not write the connector reload audit entry");
    }
    api::ok(&report)
}

/// After a connector change: see [`App::connectors_changed`].
async fn connectors_changed(app: &App) {
    let _ = app.connectors_changed().await;
}

async fn reset_breaker(app: &App, key: &str, who: Principal) -> ApiResult {
    let Some((before, breaker)) = app.connectors.policy.breakers.reset(key) else {
        return Err(ApiError::not_found(format!(
            "Circuit breaker with key '{key}' not found"
        )));
    };
    let mut entry = audit(who, "breaker_reset");
    entry.resource_type = "circuit_breaker".into();
    entry.resource_id = key.to_owned();
    // What the reset undid: the state, the failure count, when it opened.
    let mut previous = before;
    if let Some(fields) = previous.as_object_mut() {
        fields.retain(|k, _| matches!(k.as_str(), "state" | "consecutive_failures" | "opened_at"));
    }
    entry.details = json!({"previous": previous});
    app.store.audit(entry).await?;
    api::ok(&breaker)
}

// ---------------------------------------------------------------- engine, audit, backups

async fn engine_status(app: &App) -> ApiResult {
    api::ok(&crate::ops::engine_status(app))
}

async fn engine_reload(app: &App, who: Principal) -> ApiResult {
    match app.changed(Some(audit(who, "reload"))).await {
        Ok(report) => api::ok(&report),
        Err(ReloadError::Storage(e)) => Err(e.into()),
        // The request is fine; what is stored cannot be served (edited in
        // the database, or from an older release): a conflict of state.
        Err(ReloadError::Invalid(problems)) => Err(ApiError::new(
            api::Code::Conflict,
            format!(
                "the stored definitions cannot be loaded ({} problem{}); the previous engine keeps serving",
                problems.len(),
                if problems.len() == 1 { "" } else { "s" }
            ),
        )
        .with_details(problems)),
    }
}

/// The actions an audit entry may record (shared decisions). Pausing is an
/// `update` whose details carry the new status.
pub(crate) const AUDIT_ACTIONS: &[&str] = &[
    "create",
    "update",
    "delete",
    "activate",
    "archive",
    "rollout",
    "new_version",
    "import",
    "reload",
    "breaker_reset",
    "backup",
];

/// What an audit entry may be about.
pub(crate) const AUDIT_RESOURCE_TYPES: &[&str] = &[
    "workflow",
    "channel",
    "connector",
    "engine",
    "circuit_breaker",
    "backup",
];

/// `?action=`, `?resource_type=` (closed sets: anything else is a 400, as
/// a bad `status` is) and `?resource_id=`.
async fn audit_logs(app: &App, req: &Req) -> ApiResult {
    let (limit, offset) = paging(req)?;
    let action = one_of_filter(req, "action", AUDIT_ACTIONS)?;
    let resource_type = one_of_filter(req, "resource_type", AUDIT_RESOURCE_TYPES)?;
    let resource_id = req.query("resource_id");
    // MariaDB's collations ignore trailing spaces: `x ` would find `x`'s
    // entries, and no id ends with a space.
    if resource_id.is_some_and(|id| id.trim_end() != id) {
        return api::page(Vec::new(), 0, limit, offset);
    }
    let (entries, total) = app
        .store
        .list_audit(
            action.as_deref(),
            resource_type.as_deref(),
            resource_id,
            limit,
            offset,
        )
        .await?;
    api::page(entries, total, limit, offset)
}

fn list_backups(app: &App, req: &Req) -> ApiResult {
    // The page is checked before the directory is read: a bad `limit` is
    // the caller's 400 whatever state the directory is in.
    paging(req)?;
    // The shared decisions' "the endpoint answers 400" on PostgreSQL and
    // MySQL: listing files this store never writes would answer an empty
    // (or a stale SQLite-era) list where creating one is refused.
    if app.store.backend() != crate::storage::Backend::Sqlite {
        return Err(crate::storage::StorageError::BadRequest(
            crate::storage::BACKUPS_NEED_SQLITE.into(),
        )
        .into());
    }
    paged(
        req,
        Store::list_backups(Path::new(&app.config.storage.backup_dir))?,
    )
}

/// A list held in memory, answered as a page of the list shape.
fn paged(req: &Req, all: Vec<Json>) -> ApiResult {
    let (limit, offset) = paging(req)?;
    let total = all.len() as i64;
    let page = all
        .into_iter()
        .skip(offset as usize)
        .take(limit as usize)
        .collect();
    api::page(page, total, limit, offset)
}

/// The function catalogue's entries, in catalogue order.
fn catalogue_items() -> Vec<Json> {
    match sluice_compiler::functions::catalogue_json() {
        Json::Array(items) => items,
        other => vec![other],
    }
}

async fn create_backup(app: &App, who: Principal) -> ApiResult {
    let entry = app
        .store
        .backup(Path::new(&app.config.storage.backup_dir))
        .await?;
    let mut a = audit(who, "backup");
    a.resource_type = "backup".into();
    a.resource_id = entry
        .get("filename")
        .and_then(Json::as_str)
        .unwrap_or_default()
        .to_owned();
    a.details = entry.clone();
    if let Err(e) = app.store.audit(a).await {
        tracing::error!(error = %e, "could not write the backup audit entry");
    }
    api::created(&entry)
}
