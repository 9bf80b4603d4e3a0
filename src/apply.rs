//! `sluice apply`: makes a running Sluice match a directory of definitions,
//! through the public admin API only.
//!
//! The directory holds `connectors/`, `workflows/` and `channels/` (JSON or
//! YAML files, searched recursively; other files are ignored). Each resource
//! is compared with what the server has, both sides normalised through the
//! compiler's definition types (server-managed fields, unknown keys and
//! `$schema` dropped, defaults filled in), and gets one action:
//!
//! - `create`: POST, then activate (workflows and channels);
//! - `new version`: a draft (the existing one, or `POST .../versions`), PUT
//!   with the file's content, then activate (`--rollout <pct>` for a canary);
//!   a changed connector is PUT (connectors have no versions);
//! - `reactivate`: the newest version equals the file but nothing is active;
//! - `rollout`: unchanged content, but `--rollout` asks for another share;
//! - `unchanged`: nothing is sent, so nothing is reloaded;
//! - `archive` (with `--prune`): active workflows and channels the directory
//!   no longer has. Connectors are never pruned (see docs/decisions.md).
//!
//! Order: connectors, workflows, channels (what is referenced exists first);
//! archives last, channels before workflows.

use serde_json::{Value as Json, json};
use sluice_compiler::def::{ChannelDef, ConnectorDef, WorkflowDef};
use sluice_compiler::plan::compile_new_workflow;
use sluice_compiler::validate;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The command's options.
#[derive(Debug, Clone)]
pub struct ApplyOptions {
    pub server: String,
    pub api_key: Option<String>,
    pub dir: PathBuf,
    pub prune: bool,
    pub dry_run: bool,
    /// Share of traffic for new versions of existing workflows.
    pub rollout: Option<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Connector,
    Workflow,
    Channel,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Connector => "connector",
            Kind::Workflow => "workflow",
            Kind::Channel => "channel",
        }
    }

    fn collection(self) -> &'static str {
        match self {
            Kind::Connector => "connectors",
            Kind::Workflow => "workflows",
            Kind::Channel => "channels",
        }
    }
}

/// One local definition.
struct Local {
    kind: Kind,
    id: String,
    file: PathBuf,
    /// What is sent (the file without `$schema`, with its identifier).
    body: Json,
}

#[derive(Debug, Clone, PartialEq)]
enum Action {
    Create,
    /// `draft` is the existing draft's version, if there is one.
    NewVersion {
        draft: Option<u64>,
    },
    Reactivate {
        version: u64,
    },
    Rollout {
        from: u64,
        to: u8,
    },
    Unchanged,
    Archive,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Create => f.write_str("create"),
            Action::NewVersion { .. } => f.write_str("new version"),
            Action::Reactivate { version } => write!(f, "reactivate v{version}"),
            Action::Rollout { from, to } => write!(f, "rollout {from}% -> {to}%"),
            Action::Unchanged => f.write_str("unchanged"),
            Action::Archive => f.write_str("archive"),
        }
    }
}

struct Step {
    kind: Kind,
    id: String,
    action: Action,
    body: Option<Json>,
}

// ---------------------------------------------------------------- reading the directory

/// Definition files: JSON or YAML, but not workflow test files.
fn is_definition(name: &str) -> bool {
    [".json", ".yaml", ".yml"].iter().any(|s| name.ends_with(s))
        && !crate::testing::TEST_FILE_SUFFIXES
            .iter()
            .any(|s| name.ends_with(s))
}

/// Reads and validates every definition of the directory; all problems of
/// all files are reported together, before anything is sent.
fn read_locals(dir: &Path) -> Result<Vec<Local>, Vec<String>> {
    if !dir.is_dir() {
        // A path that is not there says so, as `sluice test` does.
        let why = match std::fs::metadata(dir) {
            Err(e) => e.to_string(),
            Ok(_) => "not a directory".to_owned(),
        };
        return Err(vec![format!("{}: {why}", dir.display())]);
    }
    let mut locals = Vec::new();
    let mut problems = Vec::new();
    for kind in [Kind::Connector, Kind::Workflow, Kind::Channel] {
        let sub = dir.join(kind.collection());
        if !sub.is_dir() {
            continue;
        }
        let mut files = Vec::new();
        if let Err(e) = crate::testing::files_under(&sub, &is_definition, &mut files) {
            problems.push(e);
            continue;
        }
        for file in files {
            match local(kind, &file) {
                Ok(l) => locals.push(l),
                Err(e) => problems.push(format!("{}: {e}", file.display())),
            }
        }
    }
    for (i, a) in locals.iter().enumerate() {
        if let Some(b) = locals[..i]
            .iter()
            .find(|b| b.kind == a.kind && b.id == a.id)
        {
            problems.push(format!(
                "{}: {} '{}' is also defined in {}",
                a.file.display(),
                a.kind.label(),
                a.id,
                b.file.display()
            ));
        }
    }
    if problems.is_empty() {
        Ok(locals)
    } else {
        Err(problems)
    }
}

fn local(kind: Kind, file: &Path) -> Result<Local, String> {
    let mut body = crate::cli::read_definition(file)?;
    let Some(obj) = body.as_object_mut() else {
        return Err("a definition must be a JSON object".into());
    };
    // A file whose `$schema` names another kind than its folder would be
    // linted as one kind and applied as another (audit 110: a workflow
    // under `channels/` became a channel).
    if let Some(named) = obj.get("$schema").and_then(Json::as_str)
        && let Some(other) = [Kind::Connector, Kind::Workflow, Kind::Channel]
            .into_iter()
            .find(|k| named.rsplit('/').next() == Some(&format!("{}.json", k.label())))
        && other != kind
    {
        return Err(format!(
            "$schema names a {} definition, but the file is under {}/, where apply reads {}s",
            other.label(),
            kind.collection(),
            kind.label()
        ));
    }
    obj.remove("$schema");
    let id = match kind {
        Kind::Connector => obj.get("name").and_then(Json::as_str).map(str::to_owned),
        Kind::Workflow => obj
            .get("workflow_id")
            .or_else(|| obj.get("id"))
            .and_then(Json::as_str)
            .map(str::to_owned),
        // A channel without channel_id is identified by its name.
        Kind::Channel => obj
            .get("channel_id")
            .or_else(|| obj.get("name"))
            .and_then(Json::as_str)
            .map(str::to_owned),
    };
    let Some(id) = id else {
        let field = match kind {
            Kind::Connector => "name",
            Kind::Workflow => "workflow_id",
            Kind::Channel => "channel_id (or name)",
        };
        return Err(format!(
            "{field} is required: apply matches resources by it"
        ));
    };
    if kind == Kind::Channel {
        obj.insert("channel_id".into(), Json::String(id.clone()));
    }
    let problems = match kind {
        Kind::Connector => validate::validate_connector(&body),
        Kind::Workflow => compile_new_workflow(&body).err().unwrap_or_default(),
        Kind::Channel => validate::validate_channel(&body),
    };
    if !problems.is_empty() {
        let list: Vec<String> = problems
            .iter()
            .map(|d| format!("{}: {}", d.field, d.message))
            .collect();
        return Err(format!("invalid {}: {}", kind.label(), list.join("; ")));
    }
    Ok(Local {
        kind,
        id,
        file: file.to_owned(),
        body,
    })
}

// ---------------------------------------------------------------- comparing

/// A definition in comparable form: parsed through the declared type (unknown
/// keys dropped, defaults filled), effective values made explicit, and the
/// server-managed fields removed.
fn normalized(kind: Kind, def: &Json) -> Option<Json> {
    let mut v = match kind {
        Kind::Workflow => {
            let mut w: WorkflowDef = serde_json::from_value(def.clone()).ok()?;
            w.normalize();
            // The service keeps no `rollout` range of a definition's own
            // (it derives one from the versions' shares): comparing it
            // would make every apply a new version.
            w.rollout = None;
            // `default` is the label a workflow without one has.
            if w.channel.as_deref() == Some(WorkflowDef::DEFAULT_CHANNEL) {
                w.channel = None;
            }
            serde_json::to_value(w).ok()?
        }
        Kind::Channel => {
            let mut c: ChannelDef = serde_json::from_value(def.clone()).ok()?;
            c.protocol = Some(c.protocol());
            c.channel_type = Some(c.channel_type());
            serde_json::to_value(c).ok()?
        }
        Kind::Connector => {
            let mut c: ConnectorDef = serde_json::from_value(def.clone()).ok()?;
            // The server masks secrets in what it returns; masking the local
            // side too compares everything except the secret values.
            validate::mask_secrets(&mut c.config);
            if let Some(cfg) = c.config.as_object_mut() {
                cfg.remove("type");
            }
            serde_json::to_value(c).ok()?
        }
    };
    if let Some(obj) = v.as_object_mut() {
        for key in [
            "status",
            "version",
            "rollout_percentage",
            "created_at",
            "updated_at",
        ] {
            obj.remove(key);
        }
    }
    Some(v)
}

// ---------------------------------------------------------------- the API client

struct Api {
    client: reqwest::Client,
    base: String,
    api_key: Option<String>,
    /// The `warnings` of the answers since they were last taken
    /// (`field: message`), printed under the step that drew them.
    warnings: std::sync::Mutex<Vec<String>>,
}

/// A failed call: what was asked and what the server said.
struct ApiFailure(String);

/// `field: message` of a `{field, message}` the server answered (the
/// message alone for the definition as a whole).
fn diagnostic_line(d: &Json) -> String {
    let field = d["field"].as_str().unwrap_or_default();
    let message = d["message"].as_str().unwrap_or_default();
    if field.is_empty() {
        message.to_owned()
    } else {
        format!("{field}: {message}")
    }
}

impl Api {
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Json>,
    ) -> Result<(u16, Json), ApiFailure> {
        let url = format!("{}/api/v1/admin{path}", self.base);
        let method = reqwest::Method::from_bytes(method.as_bytes())
            .map_err(|e| ApiFailure(e.to_string()))?;
        let mut req = self.client.request(method.clone(), &url);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        if let Some(body) = body {
            req = req
                .header("content-type", "application/json")
                .body(body.to_string());
        }
        // A password in `--server` is never printed.
        let shown =
            sluice_compiler::validate::mask_url_password(&url).unwrap_or_else(|| url.clone());
        let resp = req
            .send()
            .await
            .map_err(|e| ApiFailure(format!("{method} {shown}: {e}")))?;
        let status = resp.status().as_u16();
        let text = resp
            .text()
            .await
            .map_err(|e| ApiFailure(format!("{method} {shown}: {e}")))?;
        let json: Json = serde_json::from_str(&text).unwrap_or(Json::Null);
        Ok((status, json))
    }

    /// A call that must succeed; the error envelope's message otherwise.
    async fn ok(&self, method: &str, path: &str, body: Option<&Json>) -> Result<Json, ApiFailure> {
        let (status, json) = self.call(method, path, body).await?;
        if (200..300).contains(&status) {
            let drawn = json["warnings"].as_array().into_iter().flatten();
            self.warnings
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(drawn.map(diagnostic_line));
            return Ok(json.get("data").cloned().unwrap_or(Json::Null));
        }
        let error = &json["error"];
        let mut message = format!(
            "{method} /api/v1/admin{path}: {status} {}: {}",
            error["code"].as_str().unwrap_or("?"),
            error["message"].as_str().unwrap_or("(no error message)")
        );
        if let Some(details) = error["details"].as_array() {
            for d in details {
                message.push_str(&format!(
                    "\n    {}: {}",
                    d["field"].as_str().unwrap_or(""),
                    d["message"].as_str().unwrap_or("")
                ));
            }
        }
        Err(ApiFailure(message))
    }

    /// All versions of a workflow or channel; `None` when it does not exist.
    async fn versions(&self, kind: Kind, id: &str) -> Result<Option<Vec<Json>>, ApiFailure> {
        let path = format!("/{}/{}/versions?limit=1000", kind.collection(), enc(id));
        let (status, json) = self.call("GET", &path, None).await?;
        if status == 404 {
            return self.absent(&json).map(|()| None);
        }
        if status != 200 {
            return self.ok("GET", &path, None).await.map(|_| None);
        }
        Ok(Some(json["data"].as_array().cloned().unwrap_or_default()))
    }

    /// A 404 means "absent" only when it is Sluice's own (`NOT_FOUND` in
    /// the error envelope): any other server answers 404 for every path,
    /// and a plan against it would create everything.
    fn absent(&self, answer: &Json) -> Result<(), ApiFailure> {
        if answer["error"]["code"] == "NOT_FOUND" {
            return Ok(());
        }
        let shown = sluice_compiler::validate::mask_url_password(&self.base)
            .unwrap_or_else(|| self.base.clone());
        Err(ApiFailure(format!(
            "{shown} answered 404 without Sluice's error envelope: is --server a Sluice service?"
        )))
    }

    /// Every id of `kind` with a version in `status`.
    async fn ids_with_status(&self, kind: Kind, status: &str) -> Result<Vec<String>, ApiFailure> {
        let mut out = Vec::new();
        let mut offset = 0;
        loop {
            let path = format!(
                "/{}?status={status}&limit=1000&offset={offset}",
                kind.collection()
            );
            let (code, json) = self.call("GET", &path, None).await?;
            if code != 200 {
                self.ok("GET", &path, None).await?;
            }
            let page = json["data"].as_array().cloned().unwrap_or_default();
            let field = if kind == Kind::Workflow {
                "workflow_id"
            } else {
                "channel_id"
            };
            out.extend(
                page.iter()
                    .filter_map(|r| r[field].as_str().map(str::to_owned)),
            );
            offset += page.len();
            if page.is_empty() || offset as u64 >= json["total"].as_u64().unwrap_or(0) {
                break;
            }
        }
        Ok(out)
    }
}

/// Percent-encodes an identifier for a path segment (identifiers are
/// `[A-Za-z0-9._-]`, so this only matters for names the validator rejects).
fn enc(id: &str) -> String {
    id.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"._-".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn version_of(record: &Json) -> u64 {
    record["version"].as_u64().unwrap_or(0)
}

// ---------------------------------------------------------------- planning

async fn plan(api: &Api, locals: &[Local], opts: &ApplyOptions) -> Result<Vec<Step>, ApiFailure> {
    let mut steps = Vec::new();
    for l in locals {
        let want = normalized(l.kind, &l.body);
        let action = if l.kind == Kind::Connector {
            let (status, json) = api
                .call("GET", &format!("/connectors/{}", enc(&l.id)), None)
                .await?;
            match status {
                404 => {
                    api.absent(&json)?;
                    Action::Create
                }
                200 if normalized(l.kind, &json["data"]) == want => Action::Unchanged,
                200 => Action::NewVersion { draft: None },
                _ => {
                    api.ok("GET", &format!("/connectors/{}", enc(&l.id)), None)
                        .await?;
                    Action::Unchanged
                }
            }
        } else {
            match api.versions(l.kind, &l.id).await? {
                None => Action::Create,
                Some(versions) => decide(l.kind, &versions, want.as_ref(), opts.rollout),
            }
        };
        steps.push(Step {
            kind: l.kind,
            id: l.id.clone(),
            action,
            body: Some(l.body.clone()),
        });
    }
    if opts.prune {
        for kind in [Kind::Channel, Kind::Workflow] {
            let mut serving = api.ids_with_status(kind, "active").await?;
            serving.extend(api.ids_with_status(kind, "paused").await?);
            serving.sort();
            serving.dedup();
            for id in serving {
                if !locals.iter().any(|l| l.kind == kind && l.id == id) {
                    steps.push(Step {
                        kind,
                        id,
                        action: Action::Archive,
                        body: None,
                    });
                }
            }
        }
    }
    Ok(steps)
}

/// The action for a workflow or channel that exists, from its versions.
fn decide(kind: Kind, versions: &[Json], want: Option<&Json>, rollout: Option<u8>) -> Action {
    let newest_with = |status: &str| {
        versions
            .iter()
            .filter(|r| r["status"] == status)
            .max_by_key(|r| version_of(r))
    };
    let same = |r: &Json| normalized(kind, r).as_ref() == want;
    let draft = newest_with("draft").map(version_of);
    if let Some(active) = newest_with("active") {
        if same(active) {
            let current = active["rollout_percentage"].as_u64().unwrap_or(100);
            // `--rollout` moves a canary in progress (promotes it at 100); a
            // version already serving everything is left alone.
            return match rollout {
                Some(p) if kind == Kind::Workflow && current < 100 && u64::from(p) != current => {
                    Action::Rollout {
                        from: current,
                        to: p,
                    }
                }
                _ => Action::Unchanged,
            };
        }
        return Action::NewVersion { draft };
    }
    // Nothing active: a paused or archived newest version equal to the file
    // is brought back; anything else gets a new version.
    let newest_kept = versions
        .iter()
        .filter(|r| r["status"] != "draft")
        .max_by_key(|r| version_of(r));
    match newest_kept {
        Some(r) if same(r) => Action::Reactivate {
            version: version_of(r),
        },
        _ => Action::NewVersion { draft },
    }
}

// ---------------------------------------------------------------- executing

/// The server's dry-run import of every resource the plan creates, per
/// kind: the problems it finds, as `kind id: field: message` lines.
/// What the server's dry-run import says of the creations: their problems
/// and (`kind id: field: message`) their warnings.
async fn preflight(api: &Api, steps: &[Step]) -> Result<(Vec<String>, Vec<String>), ApiFailure> {
    let (mut problems, mut warnings) = (Vec::new(), Vec::new());
    for kind in [Kind::Connector, Kind::Workflow, Kind::Channel] {
        let created: Vec<&Step> = steps
            .iter()
            .filter(|s| s.kind == kind && matches!(s.action, Action::Create))
            .collect();
        if created.is_empty() {
            continue;
        }
        let bodies = Json::Array(created.iter().filter_map(|s| s.body.clone()).collect());
        let path = format!("/{}/import?dry_run=true", kind.collection());
        // A read-only key may plan (`--dry-run`) but not post, not even a
        // dry run: the check is skipped, and a real apply fails at its
        // first change as before.
        let (status, answer) = api.call("POST", &path, Some(&bodies)).await?;
        if status == 403 {
            return Ok((problems, warnings));
        }
        if !(200..300).contains(&status) {
            // Asked again for the formatted error.
            api.ok("POST", &path, Some(&bodies)).await?;
        }
        let report = &answer["data"];
        // Each `{field, message}` of the report's `key` list, with the id
        // of the creation its `index` names.
        let each = |key: &str| {
            report[key]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|item| {
                    let id = item["index"]
                        .as_u64()
                        .and_then(|i| created.get(i as usize))
                        .map_or("?", |s| s.id.as_str());
                    item["details"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(move |d| (id, d))
                })
        };
        for (id, d) in each("warnings") {
            if !made_by_the_plan(steps, d) {
                warnings.push(format!("{} {id}: {}", kind.label(), diagnostic_line(d)));
            }
        }
        for (id, d) in each("failed") {
            problems.push(format!("{} {id}: {}", kind.label(), diagnostic_line(d)));
        }
    }
    Ok((problems, warnings))
}

/// Whether a dry-run warning is about a connector or workflow missing on
/// the server that the plan itself creates or keeps (the real apply makes
/// it first, so it would not warn; audit 112: `--dry-run` warned of them).
fn made_by_the_plan(steps: &[Step], d: &Json) -> bool {
    let field = d["field"].as_str().unwrap_or_default();
    let message = d["message"].as_str().unwrap_or_default();
    let (kind, said) = if field.ends_with("input.connector") {
        (Kind::Connector, "no connector named '")
    } else if field == "workflow_id" {
        (Kind::Workflow, "no workflow '")
    } else {
        return false;
    };
    steps.iter().any(|s| {
        s.kind == kind
            && !matches!(s.action, Action::Archive)
            && message.starts_with(&format!("{said}{}'", s.id))
    })
}

async fn execute(api: &Api, step: &Step, rollout: Option<u8>) -> Result<String, ApiFailure> {
    let coll = step.kind.collection();
    let id = enc(&step.id);
    let body = step.body.as_ref();
    let activate = |version: Option<u64>, pct: Option<u8>| {
        let mut b = json!({"status": "active"});
        if let Some(v) = version {
            b["version"] = json!(v);
        }
        if let Some(p) = pct {
            b["rollout_percentage"] = json!(p);
        }
        b
    };
    match (&step.action, step.kind) {
        (Action::Unchanged, _) => Ok(String::new()),
        (Action::Create, Kind::Connector) => {
            api.ok("POST", "/connectors", body).await?;
            Ok(String::new())
        }
        (Action::NewVersion { .. }, Kind::Connector) => {
            api.ok("PUT", &format!("/connectors/{id}"), body).await?;
            Ok("updated".into())
        }
        (Action::Create, _) => {
            let created = api.ok("POST", &format!("/{coll}"), body).await?;
            let v = version_of(&created);
            api.ok(
                "PATCH",
                &format!("/{coll}/{id}/status"),
                Some(&activate(Some(v), None)),
            )
            .await?;
            Ok(format!("v{v} active"))
        }
        (Action::NewVersion { draft }, _) => {
            if draft.is_none() {
                api.ok("POST", &format!("/{coll}/{id}/versions"), None)
                    .await?;
            }
            let saved = api.ok("PUT", &format!("/{coll}/{id}"), body).await?;
            let v = version_of(&saved);
            let pct = rollout.filter(|_| step.kind == Kind::Workflow);
            api.ok(
                "PATCH",
                &format!("/{coll}/{id}/status"),
                Some(&activate(Some(v), pct)),
            )
            .await?;
            Ok(match pct {
                Some(p) if p < 100 => format!("v{v} active at {p}%"),
                _ => format!("v{v} active"),
            })
        }
        (Action::Reactivate { version }, _) => {
            api.ok(
                "PATCH",
                &format!("/{coll}/{id}/status"),
                Some(&activate(Some(*version), None)),
            )
            .await?;
            Ok(format!("v{version} active"))
        }
        (Action::Rollout { to, .. }, _) => {
            api.ok(
                "PATCH",
                &format!("/{coll}/{id}/rollout"),
                Some(&json!({"rollout_percentage": to})),
            )
            .await?;
            Ok(String::new())
        }
        (Action::Archive, _) => {
            api.ok(
                "PATCH",
                &format!("/{coll}/{id}/status"),
                Some(&json!({"status": "archived"})),
            )
            .await?;
            Ok(String::new())
        }
    }
}

/// `sluice apply`: prints one line per resource and a summary; exit 1 on a
/// failure (what was done before it stays done), 2 on unusable input.
pub fn run(opts: &ApplyOptions) -> ExitCode {
    let locals = match read_locals(&opts.dir) {
        Ok(l) => l,
        Err(problems) => {
            for p in problems {
                crate::errln!("error: {p}");
            }
            crate::errln!("nothing was applied");
            return ExitCode::from(2);
        }
    };
    if let Some(p) = opts.rollout
        && !(1..=100).contains(&p)
    {
        crate::errln!("error: --rollout must be from 1 to 100, got {p}");
        return ExitCode::from(2);
    }
    // `--server` is the service's base URL (`http://host:port`), nothing
    // else: a bad one is a usage error, not a failed call.
    let base_ok = reqwest::Url::parse(&opts.server).is_ok_and(|u| {
        matches!(u.scheme(), "http" | "https")
            && u.host_str().is_some()
            && matches!(u.path(), "" | "/")
    });
    if !base_ok {
        let shown = sluice_compiler::validate::mask_url_password(&opts.server)
            .unwrap_or_else(|| opts.server.clone());
        crate::errln!(
            "error: --server must be the service's base URL, like http://127.0.0.1:8080, got '{shown}'"
        );
        return ExitCode::from(2);
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = match reqwest::Client::builder()
        .no_proxy()
        .timeout(std::time::Duration::from_secs(60))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            crate::errln!("error: cannot build the HTTP client: {e}");
            return ExitCode::FAILURE;
        }
    };
    let api = Api {
        client,
        base: opts.server.trim_end_matches('/').to_owned(),
        api_key: opts.api_key.clone(),
        warnings: std::sync::Mutex::default(),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            crate::errln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let steps = match plan(&api, &locals, opts).await {
            Ok(s) => s,
            Err(ApiFailure(e)) => {
                crate::errln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        // What the server alone can tell (a name another channel holds, a
        // masked secret in a new connector) is asked before anything is
        // changed: the creations go through its dry-run import first.
        match preflight(&api, &steps).await {
            Ok((problems, warnings)) if problems.is_empty() => {
                // A real apply prints each step's own warnings as it goes.
                if opts.dry_run {
                    for w in warnings {
                        crate::errln!("warning: {w}");
                    }
                }
            }
            Ok((problems, _)) => {
                for p in problems {
                    crate::errln!("error: {p}");
                }
                crate::errln!("nothing was applied");
                return ExitCode::FAILURE;
            }
            Err(ApiFailure(e)) => {
                crate::errln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
        // A closed stdout (`sluice apply … | head -1`) must not stop the
        // apply halfway: the lines are dropped, every step still runs, and
        // the exit status says the output was cut (141, as SIGPIPE would).
        let mut out = Out::default();
        let mut counts: Vec<(String, usize)> = Vec::new();
        for step in &steps {
            let label = match &step.action {
                Action::NewVersion { .. } if step.kind == Kind::Connector => "update".to_owned(),
                Action::Reactivate { .. } => "reactivate".to_owned(),
                Action::Rollout { .. } => "rollout".to_owned(),
                other => other.to_string(),
            };
            let shown = if step.kind == Kind::Connector
                && matches!(step.action, Action::NewVersion { .. })
            {
                "update".to_owned()
            } else {
                step.action.to_string()
            };
            let outcome = if opts.dry_run {
                Ok(String::new())
            } else {
                execute(&api, step, opts.rollout).await
            };
            // What the server warned of (a connector or workflow that does
            // not exist, a misspelt key it ignored) is shown, as `lint` and
            // the API show it (audit 110: apply reported a clean success).
            let warned = std::mem::take(
                &mut *api
                    .warnings
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
            for w in warned {
                crate::errln!("warning: {} {}: {w}", step.kind.label(), step.id);
            }
            match outcome {
                Ok(note) if note.is_empty() => out.line(format_args!(
                    "{:<10} {:<32} {shown}",
                    step.kind.label(),
                    step.id
                )),
                Ok(note) => out.line(format_args!(
                    "{:<10} {:<32} {shown} ({note})",
                    step.kind.label(),
                    step.id
                )),
                Err(ApiFailure(e)) => {
                    out.line(format_args!(
                        "{:<10} {:<32} {shown} FAILED",
                        step.kind.label(),
                        step.id
                    ));
                    crate::errln!("error: {e}");
                    crate::errln!("stopped; the steps above this one were applied");
                    return ExitCode::FAILURE;
                }
            }
            match counts.iter_mut().find(|(l, _)| *l == label) {
                Some((_, n)) => *n += 1,
                None => counts.push((label, 1)),
            }
        }
        let summary: Vec<String> = counts.iter().map(|(l, n)| format!("{n} {l}")).collect();
        let summary = if summary.is_empty() {
            "nothing to do".to_owned()
        } else {
            summary.join(", ")
        };
        if opts.dry_run {
            out.line(format_args!(
                "plan: {summary} (dry run: nothing was changed)"
            ));
        } else {
            out.line(format_args!("applied: {summary}"));
        }
        if out.broken {
            ExitCode::from(141)
        } else {
            ExitCode::SUCCESS
        }
    })
}

/// stdout for `apply`'s lines; remembers a closed pipe instead of ending
/// the process.
#[derive(Default)]
struct Out {
    broken: bool,
}

impl Out {
    fn line(&mut self, args: std::fmt::Arguments<'_>) {
        use std::io::Write as _;
        if self.broken {
            return;
        }
        let mut stdout = std::io::stdout().lock();
        if stdout
            .write_fmt(format_args!("{args}\n"))
            .and_then(|()| stdout.flush())
            .is_err()
        {
            self.broken = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wf(tasks_msg: &str) -> Json {
        json!({"workflow_id": "w", "name": "w", "tasks": [
            {"id": "a", "name": "a", "function": {"name": "log", "input": {"message": tasks_msg}}}]})
    }

    #[test]
    fn normalisation_ignores_server_fields_schema_key_and_defaults() {
        let local = {
            let mut v = wf("hi");
            v["$schema"] = json!("../schemas/workflow.json");
            v
        };
        let mut server = wf("hi");
        server["status"] = json!("active");
        server["version"] = json!(3);
        server["rollout_percentage"] = json!(50);
        server["created_at"] = json!("2026-01-01T00:00:00Z");
        server["priority"] = json!(0);
        server["tags"] = json!([]);
        assert_eq!(
            normalized(Kind::Workflow, &local),
            normalized(Kind::Workflow, &server)
        );
        // A `rollout` range is not kept by the service, and `channel:
        // "default"` is what no label means.
        let mut spelled = wf("hi");
        spelled["rollout"] = json!({"bucket_start": 0, "bucket_end": 100});
        spelled["channel"] = json!("default");
        assert_eq!(
            normalized(Kind::Workflow, &spelled),
            normalized(Kind::Workflow, &server)
        );
        let mut other = wf("hi");
        other["channel"] = json!("orders");
        assert_ne!(
            normalized(Kind::Workflow, &other),
            normalized(Kind::Workflow, &server)
        );
        assert_ne!(
            normalized(Kind::Workflow, &wf("hi")),
            normalized(Kind::Workflow, &wf("hello"))
        );
    }

    #[test]
    fn channel_defaults_are_made_explicit() {
        let a = json!({"channel_id": "c", "name": "c", "workflow_id": "w", "route_pattern": "/c", "methods": ["POST"]});
        let mut b = a.clone();
        b["protocol"] = json!("rest");
        b["channel_type"] = json!("sync");
        b["config_json"] = json!({"timeout_ms": 30000});
        assert_eq!(normalized(Kind::Channel, &a), normalized(Kind::Channel, &b));
    }

    #[test]
    fn connector_secrets_are_not_compared_but_the_rest_is() {
        let local = json!({"name": "db", "connector_type": "db", "config": {"type": "db", "connection_string": "postgres://u:p@h/db", "max_connections": 4}});
        let server = json!({"name": "db", "connector_type": "db", "config": {"connection_string": "******", "max_connections": 4}, "updated_at": "x"});
        assert_eq!(
            normalized(Kind::Connector, &local),
            normalized(Kind::Connector, &server)
        );
        let mut other = local.clone();
        other["config"]["max_connections"] = json!(8);
        assert_ne!(
            normalized(Kind::Connector, &other),
            normalized(Kind::Connector, &server)
        );
    }

    #[test]
    fn decisions_follow_the_versions() {
        let want = normalized(Kind::Workflow, &wf("new"));
        let record = |msg: &str, version: u64, status: &str| {
            let mut r = wf(msg);
            r["version"] = json!(version);
            r["status"] = json!(status);
            r["rollout_percentage"] = json!(100);
            r
        };
        let same_active = [record("new", 1, "active")];
        assert_eq!(
            decide(Kind::Workflow, &same_active, want.as_ref(), None),
            Action::Unchanged
        );
        assert_eq!(
            decide(Kind::Workflow, &same_active, want.as_ref(), Some(20)),
            Action::Unchanged
        );
        let mut canary = record("new", 2, "active");
        canary["rollout_percentage"] = json!(20);
        let in_progress = [record("old", 1, "active"), canary];
        assert_eq!(
            decide(Kind::Workflow, &in_progress, want.as_ref(), Some(100)),
            Action::Rollout { from: 20, to: 100 }
        );
        assert_eq!(
            decide(Kind::Workflow, &in_progress, want.as_ref(), None),
            Action::Unchanged
        );
        let changed = [record("old", 1, "active"), record("x", 2, "draft")];
        assert_eq!(
            decide(Kind::Workflow, &changed, want.as_ref(), None),
            Action::NewVersion { draft: Some(2) }
        );
        let archived = [record("new", 1, "archived")];
        assert_eq!(
            decide(Kind::Workflow, &archived, want.as_ref(), None),
            Action::Reactivate { version: 1 }
        );
    }
}
