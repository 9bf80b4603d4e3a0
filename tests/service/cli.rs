//! The command line, run as the real binary.

use serde_json::{Value as Json, json};
use std::process::Command;

fn sluice() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    // Keep the developer's environment out of the config under test.
    for (k, _) in std::env::vars() {
        if k.starts_with("SERVICE_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

fn temp_file(name: &str, content: &Json) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-cli-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, content.to_string()).unwrap();
    path
}

#[test]
fn logic_prints_the_result_or_fails_with_exit_1() {
    let out = sluice()
        .args([
            "logic",
            "--rule",
            r#"{"+": [1, {"var": "x"}]}"#,
            "--data",
            r#"{"x": 41}"#,
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42");
    let out = sluice()
        .args(["logic", "--rule", r#"{"nope": 1}"#])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown operator 'nope'"));
}

#[test]
fn lint_prints_the_envelope_for_bad_files() {
    let good = temp_file(
        "good.json",
        &json!({"name": "ok", "tasks": [{"id": "a", "name": "a", "function": {"name": "log", "input": {"message": "hi"}}}]}),
    );
    let bad = temp_file(
        "bad.json",
        &json!({"tasks": [{"id": "a", "name": "a", "function": {"name": "http_call", "input": {}}}]}),
    );
    let out = sluice().arg("lint").arg(&good).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = sluice().arg("lint").arg(&good).arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let envelope: Json = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(envelope["error"]["code"], "BAD_REQUEST");
    let fields: Vec<_> = envelope["error"]["details"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["field"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        fields.contains(&"name".to_owned())
            && fields.contains(&"tasks[0].function.input.connector".to_owned()),
        "{fields:?}"
    );
    // The envelope is the API's, nothing added; the file is named on stderr.
    assert_eq!(envelope.as_object().unwrap().len(), 1, "{envelope}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("good.json: ok") && stderr.contains("bad.json: invalid"),
        "{stderr}"
    );
}

/// `sluice dry-run --workflow <workflow> --payload <payload>`.
fn dry_run(workflow: &std::path::Path, payload: &std::path::Path) -> std::process::Output {
    sluice()
        .args(["dry-run", "--workflow"])
        .arg(workflow)
        .arg("--payload")
        .arg(payload)
        .output()
        .unwrap()
}

#[test]
fn dry_run_runs_a_workflow_offline() {
    let wf = temp_file(
        "wf.json",
        &json!({"name": "w", "tasks": [
            {"id": "parse", "name": "p", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}},
            {"id": "call", "name": "c", "function": {"name": "http_call", "input": {"connector": "api"}}},
            {"id": "double", "name": "d", "function": {"name": "map", "input": {"mappings": [{"path": "twice", "logic": {"*": [{"var": "data.in.n"}, 2]}}]}}}
        ]}),
    );
    let payload = temp_file("payload.json", &json!({"n": 21}));
    let out = dry_run(&wf, &payload);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let answer: Json = serde_json::from_slice(&out.stdout).unwrap();
    // The answer of `POST /workflows/{id}/test`, `{data}` wrapper included.
    let answer = &answer["data"];
    assert_eq!(answer["status"], "completed");
    assert_eq!(answer["data"]["twice"], 42);
    let statuses: Vec<_> = answer["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["status"].clone())
        .collect();
    assert_eq!(
        statuses,
        vec![json!("executed"), json!("skipped"), json!("executed")]
    );
    // The connector task says why it did not run; the others say nothing.
    let reasons: Vec<_> = answer["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.get("reason").cloned())
        .collect();
    assert_eq!(
        reasons,
        vec![
            None,
            Some(json!("a test run makes no connector or channel calls")),
            None
        ]
    );

    let failing = temp_file(
        "fail.json",
        &json!({"name": "f", "tasks": [
            {"id": "boom", "name": "b", "function": {"name": "map", "input": {"mappings": [{"path": "x", "logic": {"throw": "no"}}]}}}
        ]}),
    );
    let out = dry_run(&failing, &payload);
    assert_eq!(out.status.code(), Some(1));
    let answer: Json = serde_json::from_slice(&out.stdout).unwrap();
    let answer = &answer["data"];
    assert_eq!(
        (
            answer["status"].as_str(),
            answer["errors"][0]["task_id"].as_str()
        ),
        (Some("failed"), Some("boom"))
    );

    // What `lint` and the admin API refuse in a new definition, the dry run
    // refuses too (it ran a SELECT through db_write).
    let refused = temp_file(
        "refused.json",
        &json!({"name": "r", "tasks": [
            {"id": "w", "name": "w", "function": {"name": "db_write", "input": {"connector": "db", "query": "SELECT 1"}}}
        ]}),
    );
    let out = dry_run(&refused, &payload);
    assert_eq!(out.status.code(), Some(1));
    let answer: Json = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        answer["error"]["details"][0]["field"], "tasks[0].function.input.query",
        "{answer}"
    );
}

#[test]
fn configuration_errors_stop_start_up_naming_the_key() {
    let out = sluice()
        .arg("migrate")
        .env("SERVICE_SERVER__PROT", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("server.prot"));
    // A host that is not one, and a storage URL of a scheme we do not
    // speak, are configuration errors too (not failures to bind or open).
    for (var, value, key) in [
        ("SERVICE_SERVER__HOST", "not..a..host", "'server.host'"),
        ("SERVICE_STORAGE__URL", "foo://bar", "'storage.url'"),
    ] {
        let out = sluice().arg("serve").env(var, value).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{var}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with(&format!("configuration error: invalid value for {key}")),
            "{stderr}"
        );
    }
    let db = std::env::temp_dir().join(format!("sluice-cli-{}.db", uuid::Uuid::new_v4()));
    let out = sluice()
        .arg("migrate")
        .env("SERVICE_STORAGE__URL", format!("sqlite://{}", db.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(db.exists(), "the SQLite file is created on first use");
}

#[test]
fn output_into_a_closed_pipe_ends_quietly_with_status_141() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");
    let mut child = sluice()
        .args(["test", examples])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one line, then close the pipe as `| head -1` would.
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("ok "), "{first}");
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(141), "{stderr}");
}

/// A variable that is not UTF-8 made `std::env::vars` panic (exit 101
/// with a backtrace), ours or not. Others are skipped; one of ours is a
/// configuration error naming it.
#[test]
fn environment_variables_that_are_not_utf8_do_not_crash_start_up() {
    use std::os::unix::ffi::OsStrExt;
    let dir = std::env::temp_dir().join(format!("sluice-cli-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("m.db").display());
    let bad = std::ffi::OsStr::from_bytes(b"\xff\xfe");
    let out = sluice()
        .args(["migrate"])
        .env("SERVICE_STORAGE__URL", &url)
        .env("SOME_OTHER_TOOL", bad)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = sluice()
        .args(["migrate"])
        .env("SERVICE_STORAGE__URL", &url)
        .env("SERVICE_LOGGING__LEVEL", bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("environment variable SERVICE_LOGGING__LEVEL is not valid UTF-8"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `lint` reports each good file on stderr; with stderr a pipe the reader
/// closed (`2>&1 | head -1`), the command ends with status 141 like any
/// other output into a closed pipe, not with a panic (101).
#[test]
fn lint_into_a_closed_pipe_ends_with_141() {
    use std::io::Read as _;
    let good = temp_file(
        "good.json",
        &json!({"name": "ok", "tasks": [{"id": "a", "name": "a", "function": {"name": "log", "input": {"message": "hi"}}}]}),
    );
    // More "ok" lines than a pipe holds.
    let mut child = sluice()
        .arg("lint")
        .args(std::iter::repeat_n(&good, 3000))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let mut first = [0u8; 16];
    stderr.read_exact(&mut first).unwrap();
    drop(stderr);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(141), "{status:?}");
}

/// `lint` reads YAML like `apply` and `test`, knows a channel without a
/// route or an id (or by its `$schema`), and says what
/// `POST /workflows/validate` warns about.
#[test]
fn lint_knows_channels_yaml_and_warnings() {
    let dir = std::env::temp_dir().join(format!("sluice-cli-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let channel = write(
        "ch.json",
        r#"{"name": "hello", "protocol": "http", "workflow_id": "hello"}"#,
    );
    let by_schema = write(
        "named.json",
        r#"{"$schema": "../schemas/channel.json", "name": "hello", "workflow_id": "hello"}"#,
    );
    let yaml = write(
        "wf.yaml",
        "name: greet\ntasks:\n  - id: a\n    name: a\n    function:\n      name: log\n      input:\n        message: hi\n",
    );
    for file in [&channel, &by_schema, &yaml] {
        let out = sluice().arg("lint").arg(file).output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // A channel's problems are reported as a channel's.
    let bad_channel = write(
        "bad.json",
        r#"{"protocol": "http", "workflow_id": "hello"}"#,
    );
    let out = sluice().arg("lint").arg(&bad_channel).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let envelope: Json = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        envelope["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("channel"),
        "{envelope}"
    );
    // A connector holding the mask where its secret goes (copied from an
    // answer) cannot be created: a warning, as only an update could keep
    // the stored secret (audit 110: it passed without a word).
    let masked = write(
        "masked.json",
        r#"{"name": "m", "connector_type": "http", "config": {"url": "https://x.example.com", "auth": {"type": "bearer", "token": "******"}}}"#,
    );
    let out = sluice().arg("lint").arg(&masked).output().unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: config.auth.token: holds the mask '******'"),
        "{stderr}"
    );
    let warned = write(
        "warn.json",
        r#"{"name": "w", "tasks": [{"id": "m", "name": "m", "function": {"name": "map", "input": {"mapings": []}}}]}"#,
    );
    let out = sluice().arg("lint").arg(&warned).output().unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: tasks[0].function.input.mappings: is required"),
        "{stderr}"
    );
    // A minimal channel names its kind by the directory it sits in (as
    // `sluice apply` reads it) or by an editor's schema line; anywhere
    // else it reads as a workflow without tasks.
    let minimal = r#"{"name": "c1", "workflow_id": "w1"}"#;
    std::fs::create_dir_all(dir.join("channels")).unwrap();
    let in_channels = write("channels/c1.json", minimal);
    let modeline = write(
        "c1.yaml",
        "# yaml-language-server: $schema=../schemas/channel.json\nname: c1\nworkflow_id: w1\n",
    );
    for file in [&in_channels, &modeline] {
        let out = sluice().arg("lint").arg(file).output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let loose = write("c1.json", minimal);
    let out = sluice().arg("lint").arg(&loose).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("tasks"));
    // A definition that is not an object: the admin API's message.
    let array = write("arr.json", "[1, 2]");
    let out = sluice().arg("lint").arg(&array).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let envelope: Json = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        envelope["error"],
        json!({"code": "BAD_REQUEST", "message": "a workflow definition must be a JSON object"}),
        "{envelope}"
    );
}

/// `dry-run` checks `--metadata` as the test endpoint checks `metadata`,
/// and names the payload file when it is not JSON.
#[test]
fn dry_run_names_its_files() {
    let wf = temp_file(
        "wf.json",
        &json!({"name": "w", "tasks": [{"id": "a", "name": "a", "function": {"name": "log", "input": {"message": "hi"}}}]}),
    );
    let payload = temp_file("payload.json", &json!({"n": 1}));
    let meta = temp_file("meta.json", &json!([1]));
    let out = sluice()
        .args(["dry-run", "--workflow"])
        .arg(&wf)
        .arg("--payload")
        .arg(&payload)
        .arg("--metadata")
        .arg(&meta)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let envelope: Json = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        envelope["error"]["details"],
        json!([{"field": "metadata", "message": "expected object, got array"}])
    );
    let garbage = payload.with_file_name("garbage.txt");
    std::fs::write(&garbage, "not json").unwrap();
    let out = sluice()
        .args(["dry-run", "--workflow"])
        .arg(&wf)
        .arg("--payload")
        .arg(&garbage)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let envelope: Json = serde_json::from_slice(&out.stdout).unwrap();
    let message = envelope["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!(
            "payload file {} is not valid JSON",
            garbage.display()
        )),
        "{message}"
    );
    // An empty file is refused too (it ran with a null payload).
    let empty = payload.with_file_name("empty.json");
    std::fs::write(&empty, " \n").unwrap();
    let out = sluice()
        .args(["dry-run", "--workflow"])
        .arg(&wf)
        .arg("--payload")
        .arg(&empty)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let envelope: Json = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        envelope["error"]["message"],
        format!(
            "payload file {} is empty: write the payload as JSON ({{}} for an empty object)",
            empty.display()
        )
    );
}

/// `--config` is read by serve and migrate only; given to another command
/// it is refused rather than silently ignored.
#[test]
fn config_is_refused_where_it_would_be_ignored() {
    let out = sluice()
        .args(["--config", "/nonexistent.toml", "logic", "--rule", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "error: --config applies to serve and migrate only"
    );
    // Nor do the other commands offer it in their help.
    let out = sluice().args(["lint", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && !help.contains("--config"), "{help}");
    let out = sluice().args(["migrate", "--help"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("--config"));
    // Before or after the command, once.
    let out = sluice()
        .args(["--config", "/a.toml", "migrate", "--config", "/b.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "error: --config given twice"
    );
    for args in [
        ["--config", "/nonexistent.toml", "migrate"],
        ["migrate", "--config", "/nonexistent.toml"],
    ] {
        let out = sluice().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("cannot read /nonexistent.toml"),
            "{args:?}"
        );
    }
}

/// SQLite serves one process: a second `sluice serve` on the same database
/// file is refused at start (it would serve an engine nobody tells of the
/// first one's changes); once the first has stopped, it starts.
#[test]
fn a_second_serve_on_one_sqlite_file_is_refused() {
    let dir = std::env::temp_dir().join(format!("sluice-lock-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/shared.db", dir.display());
    let serve = |port: u16| {
        sluice()
            .arg("serve")
            .env("SERVICE_SERVER__PORT", port.to_string())
            .env("SERVICE_STORAGE__URL", &url)
            .env("SERVICE_STORAGE__BACKUP_DIR", dir.join("backups"))
            .env("SERVICE_LOGGING__LEVEL", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let ready = |port: u16| {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let up = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok_and(|mut s| {
                use std::io::{Read, Write};
                let _ =
                    s.write_all(b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
                let mut answer = String::new();
                let _ = s.read_to_string(&mut answer);
                answer.starts_with("HTTP/1.1 200")
            });
            if up {
                return;
            }
            assert!(std::time::Instant::now() < until, "port {port} never ready");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    let (p1, p2) = (crate::support::free_port(), crate::support::free_port());
    let mut first = serve(p1);
    ready(p1);
    let second = serve(p2).wait_with_output().unwrap();
    assert_eq!(second.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        stderr.contains("another sluice process is serving the SQLite database"),
        "{stderr}"
    );
    let _ = first.kill();
    let _ = first.wait();
    let mut again = serve(p2);
    ready(p2);
    let _ = again.kill();
    let _ = again.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
