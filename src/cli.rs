//! Implementations of the command-line tools that need no server:
//! `logic`, `lint`, `dry-run` and `schema` (`test` is in `testing.rs`,
//! `apply` in `apply.rs`).

/// Writes command output to stdout. A closed pipe (`sluice test | head`)
/// ends the process quietly with status 141, as a command killed by SIGPIPE
/// would (`println!` panics there instead); other write errors are reported.
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        crate::errln!("error: cannot write to stdout: {e}");
        std::process::exit(1);
    }
}

/// `println!` through [`write_stdout`].
#[macro_export]
macro_rules! outln {
    () => { $crate::cli::write_stdout(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// Writes a message to stderr, ending the process like [`write_stdout`]
/// when stderr is a closed pipe (`sluice lint *.json 2>&1 | head`), where
/// `eprintln!` would panic.
pub fn write_stderr(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    if let Err(e) = std::io::stderr().lock().write_fmt(args)
        && e.kind() == std::io::ErrorKind::BrokenPipe
    {
        std::process::exit(141);
    }
}

/// `eprintln!` through [`write_stderr`].
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => { $crate::cli::write_stderr(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` through [`write_stdout`].
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::cli::write_stdout(format_args!($($arg)*)) };
}

use crate::api::ApiError;
use bumpalo::Bump;
use serde_json::Value as Json;
use sluice_compiler::plan::compile_new_workflow;
use sluice_compiler::{Value, logic, validate};
use sluice_runtime::connectors::{CallScope, Services};
use sluice_runtime::exec::{self, Input, Meta, Options, PayloadFrom};
use std::path::Path;
use std::process::ExitCode;

fn read_json(path: &Path) -> Result<Json, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| {
        // serde_json stops at the 128th level (as on the admin API).
        let text = e.to_string();
        match text.strip_prefix("recursion limit exceeded") {
            Some(at) => format!("{} nests deeper than 127 levels{at}", path.display()),
            None => format!("{} is not valid JSON: {text}", path.display()),
        }
    })
}

/// Reads a definition file: YAML when it ends in `.yaml`/`.yml`, JSON
/// otherwise.
pub fn read_definition(path: &Path) -> Result<Json, String> {
    let yaml = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    );
    if !yaml {
        return read_json(path);
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_norway::from_str(&text).map_err(|e| format!("{} is not valid YAML: {e}", path.display()))
}

/// `sluice schema <kind>`: the JSON Schema of a definition kind.
pub fn schema(kind: &str) -> Result<String, String> {
    use sluice_compiler::schema::{DefinitionKind, definition_schema};
    let kind = DefinitionKind::from_name(kind)
        .ok_or_else(|| format!("unknown kind '{kind}'; expected workflow, channel or connector"))?;
    Ok(serde_json::to_string_pretty(&definition_schema(kind)).unwrap_or_default())
}

/// The kind a file's place or editor line names, when its content names
/// none: a `# yaml-language-server: $schema=…/channel.json` line, else the
/// directory it sits in (`channels/`, as `sluice apply` reads them).
fn kind_hint(path: &Path) -> Option<&'static str> {
    let by_schema = |name: &str| match name.rsplit('/').next().unwrap_or(name).trim() {
        "connector.json" => Some("connector"),
        "channel.json" => Some("channel"),
        "workflow.json" => Some("workflow"),
        _ => None,
    };
    let yaml = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    );
    if yaml && let Ok(text) = std::fs::read_to_string(path) {
        let named = text
            .lines()
            .take_while(|l| l.trim_start().starts_with('#') || l.trim().is_empty())
            .find_map(|l| l.split_once("$schema=").map(|(_, s)| s.to_owned()));
        if let Some(kind) = named.as_deref().and_then(by_schema) {
            return Some(kind);
        }
    }
    match path.parent()?.file_name()?.to_str()? {
        "connectors" => Some("connector"),
        "channels" => Some("channel"),
        "workflows" => Some("workflow"),
        _ => None,
    }
}

/// Which kind of definition a file holds: the kind its `$schema` names
/// (`../schemas/channel.json`), else `hint` (see [`kind_hint`]), else by
/// its distinctive fields. Returns the kind, its problems and (workflows)
/// its warnings.
fn problems_of(
    def: &Json,
    hint: Option<&'static str>,
) -> (
    &'static str,
    Vec<sluice_compiler::diag::Diagnostic>,
    Vec<sluice_compiler::diag::Diagnostic>,
) {
    let named = def
        .get("$schema")
        .and_then(Json::as_str)
        .map(|s| s.rsplit('/').next().unwrap_or(s));
    let has = |keys: &[&str]| keys.iter().any(|k| def.get(*k).is_some());
    let kind = match named {
        Some("connector.json") => "connector",
        Some("channel.json") => "channel",
        Some("workflow.json") => "workflow",
        _ if hint.is_some() => hint.unwrap_or("workflow"),
        _ if has(&["connector_type"]) || has(&["config"]) && !has(&["tasks"]) => "connector",
        // Fields only a channel has (a channel needs neither a route nor
        // an id: `{name, protocol: http, workflow_id}` is one).
        _ if !has(&["tasks"])
            && has(&[
                "channel_type",
                "route_pattern",
                "channel_id",
                "protocol",
                "methods",
                "config_json",
                "validation_logic",
            ]) =>
        {
            "channel"
        }
        _ => "workflow",
    };
    match kind {
        "connector" => {
            // A mask where a secret goes (a definition copied from an API
            // answer) can only be an update's "keep the stored one": the
            // file cannot create its connector. A warning, as lint cannot
            // know which it will be (audit 110: it passed without a word).
            let mut warnings = validate::connector_warnings(def);
            warnings.extend(validate::masked_leftovers(def));
            (kind, validate::validate_connector(def), warnings)
        }
        "channel" => (
            kind,
            validate::validate_channel(def),
            validate::channel_warnings(def),
        ),
        _ => match compile_new_workflow(def) {
            Ok(compiled) => (kind, Vec::new(), compiled.warnings),
            Err(problems) => (kind, problems, Vec::new()),
        },
    }
}

/// `sluice lint <file>...`: prints the error envelope for each bad file
/// (its name on stderr: `file: invalid`, or `file: ok`); exit 1 if any is bad.
pub fn lint(files: &[std::path::PathBuf]) -> ExitCode {
    let mut bad = 0;
    for file in files {
        let envelope = match read_definition(file) {
            Err(message) => Some(ApiError::bad_request(message).body()),
            Ok(def) if !def.is_object() => {
                // As the admin API answers a body that is not an object.
                let kind = kind_hint(file).unwrap_or("workflow");
                Some(
                    ApiError::bad_request(format!("a {kind} definition must be a JSON object"))
                        .body(),
                )
            }
            Ok(def) => {
                let (kind, problems, warnings) = problems_of(&def, kind_hint(file));
                // What `POST /workflows/validate` answers as warnings
                // (data-function inputs, checked again when they run).
                for w in &warnings {
                    crate::errln!("{}: warning: {}: {}", file.display(), w.field, w.message);
                }
                (!problems.is_empty()).then(|| ApiError::invalid(kind, problems).body())
            }
        };
        match envelope {
            Some(body) => {
                bad += 1;
                // The envelope exactly as the admin API answers it (the
                // spec's "same envelope"); which file, on stderr like `ok`.
                crate::errln!("{}: invalid", file.display());
                crate::outln!(
                    "{}",
                    serde_json::to_string_pretty(&body).unwrap_or_default()
                );
            }
            None => crate::errln!("{}: ok", file.display()),
        }
    }
    if bad > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// `sluice dry-run`: runs a workflow definition offline on a payload (no
/// connectors are configured: connector tasks fail with a clear message).
pub fn dry_run(workflow: &Path, payload: &Path, metadata: Option<&Path>) -> ExitCode {
    match dry_run_answer(workflow, payload, metadata) {
        Ok((answer, failed)) => {
            // The answer of `POST /workflows/{id}/test`, wrapper included.
            let answer = serde_json::json!({ "data": answer });
            crate::outln!(
                "{}",
                serde_json::to_string_pretty(&answer).unwrap_or_default()
            );
            if failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(envelope) => {
            crate::outln!(
                "{}",
                serde_json::to_string_pretty(&envelope).unwrap_or_default()
            );
            ExitCode::FAILURE
        }
    }
}

fn dry_run_answer(
    workflow: &Path,
    payload: &Path,
    metadata: Option<&Path>,
) -> Result<(Json, bool), Json> {
    let def = read_definition(workflow).map_err(|m| ApiError::bad_request(m).body())?;
    if !def.is_object() {
        return Err(ApiError::bad_request("a workflow definition must be a JSON object").body());
    }
    let compiled =
        compile_new_workflow(&def).map_err(|p| ApiError::invalid("workflow", p).body())?;
    let payload_text = std::fs::read(payload).map_err(|e| {
        ApiError::bad_request(format!("cannot read {}: {e}", payload.display())).body()
    })?;
    // An empty file is no payload (it ran as `null`); `{}` is an empty one.
    if payload_text.trim_ascii().is_empty() {
        return Err(ApiError::bad_request(format!(
            "payload file {} is empty: write the payload as JSON ({{}} for an empty object)",
            payload.display()
        ))
        .body());
    }
    let meta = match metadata {
        Some(p) => read_definition(p).map_err(|m| ApiError::bad_request(m).body())?,
        None => Json::Null,
    };
    // As `POST /workflows/{id}/test` checks its `metadata`.
    let problems = crate::data::metadata_problems(&meta);
    if !problems.is_empty() {
        return Err(ApiError::invalid("request", problems).body());
    }
    let pairs = |area| crate::data::metadata_pairs(&meta, area);
    let (headers, query, path) = (pairs("headers"), pairs("query"), pairs("path"));
    use crate::data::borrow_pairs;
    let (h, q, p) = (
        borrow_pairs(&headers),
        borrow_pairs(&query),
        borrow_pairs(&path),
    );
    let input = Input {
        body: &payload_text,
        payload_from: PayloadFrom::Whole,
        meta: Meta {
            headers: &h,
            query: &q,
            path: &p,
            method: crate::data::metadata_str(&meta, "method").unwrap_or("POST"),
            channel: crate::data::metadata_str(&meta, "channel").unwrap_or(""),
            request_id: crate::data::metadata_str(&meta, "request_id").unwrap_or("dry-run"),
            extra: &[],
        },
        bucket: None,
    };
    let services = Services::default();
    let scope = CallScope::default();
    // Offline: connector tasks are reported as skipped.
    let options = Options {
        record_tasks: true,
        skip_connectors: true,
        ..Options::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ApiError::internal(e.to_string()).body())?;
    let execution = runtime
        .block_on(exec::execute(
            [&compiled.plan],
            input,
            &services,
            &scope,
            &options,
        ))
        // The payload file stands where an API request has its body.
        .map_err(|e| {
            let message = e.to_string().replacen(
                "request body",
                &format!("payload file {}", payload.display()),
                1,
            );
            ApiError::bad_request(message).body()
        })?;
    let failed = matches!(execution.status, exec::Status::Failed(_));
    Ok((crate::data::dry_run_answer(&execution), failed))
}

/// `sluice logic`: compile `rule`, evaluate it against `data`, return the
/// result as JSON text.
pub fn logic(rule: &str, data: &str) -> Result<String, String> {
    let rule: serde_json::Value =
        serde_json::from_str(rule).map_err(|e| format!("--rule is not valid JSON: {e}"))?;
    let data: serde_json::Value =
        serde_json::from_str(data).map_err(|e| format!("--data is not valid JSON: {e}"))?;
    let compiled = logic::compile(&rule).map_err(|e| format!("invalid rule: {}", e.message))?;
    let arena = Bump::new();
    let value = compiled
        .eval(Value::from_json(&data, &arena), &arena)
        .map_err(|e| format!("evaluation failed: {e}"))?;
    Ok(value.to_json_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluates_a_rule() {
        assert_eq!(
            logic(r#"{"+": [1, {"var": "a"}]}"#, r#"{"a": 2}"#).unwrap(),
            "3"
        );
        assert_eq!(logic(r#"{"cat": ["a", "b"]}"#, "{}").unwrap(), "\"ab\"");
    }

    #[test]
    fn reports_bad_input() {
        assert!(
            logic("{", "{}")
                .unwrap_err()
                .contains("--rule is not valid JSON")
        );
        assert!(
            logic("{}", "[")
                .unwrap_err()
                .contains("--data is not valid JSON")
        );
        assert!(
            logic(r#"{"nope": []}"#, "{}")
                .unwrap_err()
                .starts_with("invalid rule")
        );
    }
}
