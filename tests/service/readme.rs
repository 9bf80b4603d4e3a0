//! The README's worked examples, run as the README shows them: the console
//! blocks of a section are parsed and every `$` command (psql, the static
//! file API, curl against the admin and data planes, redis-cli) runs in order
//! against the real service and servers, and every output the README shows is
//! compared with what came back. Only the environment is swapped in (the
//! service's address, a fresh PostgreSQL database, the API's port, a Redis
//! database of its own, a Kafka topic and consumer group of its own), so the
//! README's definitions are exactly what is tested and cannot drift from it. A command this runner does not know fails
//! the test, so a README edit cannot silently skip a step.

use crate::support::{Db, TestServer, fresh_database, kafka_topics, start_with, unique};
use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use serde_json::{Value as Json, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const README: &str = include_str!("../../README.md");
const REDIS: &str = "redis://127.0.0.1:6379/";

/// One `$` command of a console block: the command line, its here-document
/// (`<<'EOF'`) and the output the README shows under it.
#[derive(Debug)]
struct Shown {
    line: String,
    stdin: Option<String>,
    output: String,
}

/// The commands of the README section titled `title`, in order.
fn section(title: &str) -> Vec<Shown> {
    let heading = format!("\n## {title}\n");
    let start = README
        .find(&heading)
        .unwrap_or_else(|| panic!("README.md has no section '## {title}'"))
        + heading.len();
    let rest = &README[start..];
    let body = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    let mut shown: Vec<Shown> = Vec::new();
    let mut console = false;
    let mut lines = body.lines();
    while let Some(line) = lines.next() {
        if !console {
            console = line.trim_end() == "```console";
            continue;
        }
        if line.trim_end() == "```" {
            console = false;
        } else if let Some(command) = line.strip_prefix("$ ") {
            let stdin = command.contains("<<'EOF'").then(|| {
                let doc: Vec<&str> = lines.by_ref().take_while(|l| *l != "EOF").collect();
                doc.join("\n")
            });
            shown.push(Shown {
                line: command.to_owned(),
                stdin,
                output: String::new(),
            });
        } else {
            let last = shown
                .last_mut()
                .unwrap_or_else(|| panic!("output before any command: {line}"));
            last.output.push_str(line);
            last.output.push('\n');
        }
    }
    assert!(!shown.is_empty(), "no console commands under '{title}'");
    shown
}

/// Splits a command line into words as a POSIX shell would for these
/// commands: single quotes literal, double quotes with `\` escapes.
fn shell_words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut open) = (Vec::new(), String::new(), false);
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                open = true;
                word.extend(chars.by_ref().take_while(|c| *c != '\''));
            }
            '"' => {
                open = true;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => word.extend(chars.next()),
                        c => word.push(c),
                    }
                }
            }
            c if c.is_whitespace() => {
                if open {
                    words.push(std::mem::take(&mut word));
                    open = false;
                }
            }
            c => {
                open = true;
                word.push(c);
            }
        }
    }
    if open {
        words.push(word);
    }
    words
}

/// The `jq` filters the README uses: `.a.b` paths (`.a.b[]` for each
/// element of an array) and `{k, ...}` objects, joined by `|`; the values it
/// outputs, in order.
fn jq(filter: &str, input: &Json) -> Vec<Json> {
    filter
        .split('|')
        .fold(vec![input.clone()], |values, stage| {
            let stage = stage.trim();
            values
                .into_iter()
                .flat_map(|v| {
                    if let Some(keys) = stage.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                        vec![Json::Object(
                            keys.split(',')
                                .map(|k| match k.split_once(':') {
                                    // `name: [.path[]]` collects, `name: .path` takes.
                                    Some((name, expr)) => {
                                        let expr = expr.trim();
                                        let value = match expr
                                            .strip_prefix('[')
                                            .and_then(|e| e.strip_suffix(']'))
                                        {
                                            Some(inner) => Json::Array(jq(inner, &v)),
                                            None => {
                                                jq(expr, &v).into_iter().next().unwrap_or_default()
                                            }
                                        };
                                        (name.trim().to_owned(), value)
                                    }
                                    None => (
                                        k.trim().to_owned(),
                                        v.get(k.trim()).cloned().unwrap_or_default(),
                                    ),
                                })
                                .collect(),
                        )]
                    } else if let Some((head, tail)) = stage.split_once("[].") {
                        // `.a[].b`: `.b` of each element of `.a`.
                        jq(&format!("{head}[]"), &v)
                            .iter()
                            .flat_map(|x| jq(&format!(".{tail}"), x))
                            .collect()
                    } else if let Some(path) = stage.strip_prefix('.') {
                        let (path, each) = match path.strip_suffix("[]") {
                            Some(p) => (p, true),
                            None => (path, false),
                        };
                        let v = path
                            .split('.')
                            .filter(|k| !k.is_empty())
                            .fold(v, |v, k| v.get(k).cloned().unwrap_or_default());
                        match v {
                            Json::Array(items) if each => items,
                            v => vec![v],
                        }
                    } else {
                        panic!("jq filter '{stage}' is not one this runner knows")
                    }
                })
                .collect()
        })
}

/// A static file server standing in for `python3 -m http.server`: it serves
/// the files the README's `echo ... > file` lines wrote, as
/// `application/octet-stream` (what Python sends for a file without an
/// extension), and 404 otherwise.
async fn serve_files(root: String, files: Arc<Mutex<HashMap<String, String>>>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let (root, files) = (root.clone(), files.clone());
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let file = files
                        .lock()
                        .unwrap()
                        .get(&format!("{root}{}", req.uri().path()))
                        .cloned();
                    async move {
                        let (status, body) = match file {
                            Some(text) => (200, text),
                            None => (404, "File not found".to_owned()),
                        };
                        Ok::<_, std::convert::Infallible>(
                            Response::builder()
                                .status(status)
                                .header("content-type", "application/octet-stream")
                                .body(Full::new(Bytes::from(body)))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                    .await;
            });
        }
    });
    port
}

/// What the commands run against, and the README values replaced by this
/// run's (addresses and names only).
struct Run {
    s: TestServer,
    swaps: Vec<(String, String)>,
    /// PostgreSQL database name in the README → this run's URL.
    databases: HashMap<String, String>,
    files: Arc<Mutex<HashMap<String, String>>>,
    /// For `redis-cli` (sections that use it).
    redis: Option<redis::aio::MultiplexedConnection>,
}

impl Run {
    fn swap(&self, text: &str) -> String {
        self.swaps
            .iter()
            .fold(text.to_owned(), |t, (from, to)| t.replace(from, to))
    }

    /// Runs one command; returns what it printed when the README shows
    /// that output, to be compared.
    async fn run(&mut self, shown: &Shown) -> Option<String> {
        let words = shell_words(&self.swap(&shown.line));
        let stdin = shown.stdin.as_deref().map(|s| self.swap(s));
        let arg = |flag: &str| {
            let at = words.iter().position(|w| w == flag)?;
            words.get(at + 1).cloned()
        };
        match words[0].as_str() {
            "psql" => {
                let (db, sql) = (arg("-d").unwrap(), arg("-c").unwrap());
                if let Some(name) = sql.strip_prefix("CREATE DATABASE ") {
                    // A fresh database stands in for the README's.
                    let url = fresh_database(Db::Postgres).await;
                    self.swaps.push((
                        format!("postgres://postgres@127.0.0.1:5432/{name}"),
                        url.clone(),
                    ));
                    self.databases.insert(name.to_owned(), url);
                } else {
                    use sqlx::Connection as _;
                    let url = &self.databases[&db];
                    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
                    sqlx::raw_sql(&sql).execute(&mut conn).await.unwrap();
                }
                None
            }
            "mkdir" => {
                let text = arg("echo").unwrap();
                let file = arg(">").unwrap();
                // echo ends what it writes with a newline.
                self.files.lock().unwrap().insert(file, format!("{text}\n"));
                None
            }
            "(cd" if words.iter().any(|w| w == "http.server") => {
                let port = arg("http.server").unwrap();
                let local = serve_files(words[1].clone(), self.files.clone()).await;
                self.swaps.push((
                    format!("http://127.0.0.1:{port}"),
                    format!("http://127.0.0.1:{local}"),
                ));
                None
            }
            "curl" => Some(self.curl(&words, stdin).await),
            "sleep" => {
                let secs: f64 = words[1].parse().unwrap();
                tokio::time::sleep(std::time::Duration::from_secs_f64(secs)).await;
                None
            }
            "redis-cli" => {
                let at = words
                    .iter()
                    .position(|w| w.eq_ignore_ascii_case("get"))
                    .expect("redis-cli get <key>");
                let value: Option<String> = redis::cmd("GET")
                    .arg(&words[at + 1])
                    .query_async(self.redis.as_mut().expect("a Redis connection"))
                    .await
                    .unwrap();
                Some(value.unwrap_or_else(|| "(nil)".into()))
            }
            other => panic!("the README runs '{other}', which this runner does not know"),
        }
    }

    async fn curl(&self, words: &[String], stdin: Option<String>) -> String {
        let (mut method, mut path, mut body, mut filter) = (None, None, None, None);
        let mut headers = Vec::new();
        let mut it = words[1..].iter();
        while let Some(w) = it.next() {
            match w.as_str() {
                "-s" => {}
                "-X" => method = it.next().cloned(),
                "-H" => headers.push(it.next().unwrap().clone()),
                "-d" => {
                    let d = it.next().unwrap();
                    body = Some(if d == "@-" {
                        stdin.clone().expect("-d @- reads the here-document")
                    } else {
                        d.clone()
                    });
                }
                "|" => {
                    assert_eq!(it.next().map(String::as_str), Some("jq"));
                    filter = it.rfind(|a| *a != "-c").cloned();
                    break;
                }
                w if w.starts_with("<<") => {}
                w if w.starts_with("localhost:8080/") => {
                    path = Some(w["localhost:8080".len()..].to_owned());
                }
                other => panic!("curl argument '{other}' is not one this runner knows"),
            }
        }
        // curl's default method: POST with a body, else GET.
        let method = method.unwrap_or_else(|| if body.is_some() { "POST" } else { "GET" }.into());
        let mut req = self.s.client.request(
            reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
            format!("{}{}", self.s.base, path.expect("a localhost:8080 URL")),
        );
        for h in headers {
            let (k, v) = h.split_once(':').unwrap();
            req = req.header(k.trim(), v.trim());
        }
        if let Some(body) = body {
            req = req.body(body);
        }
        let text = req.send().await.unwrap().text().await.unwrap();
        match filter {
            None => text,
            // As `jq -c` prints them: one value per line.
            Some(f) => jq(&f, &serde_json::from_str(&text).unwrap())
                .iter()
                .map(Json::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// "Quick start", command by command on a fresh service (audit 113: the
/// engine status it shows kept an old generation after connector changes
/// began to move it). Only `uptime_seconds` is not compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_start() {
    let mut run = fresh_run().await;
    let compared = compare_section(&mut run, "Quick start").await;
    assert!(compared >= 10);
}

/// "Async requests and canary rollouts", after the quick start on the same
/// service, as the README tells: the async trace, the canary's split by
/// rollout key, the rollout to 100 % and the rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_requests_and_canary_rollouts() {
    let mut run = fresh_run().await;
    compare_section(&mut run, "Quick start").await;
    let compared = compare_section(&mut run, "Async requests and canary rollouts").await;
    assert!(compared >= 10);
}

/// "Channel governance", after the quick start on the same service: a
/// channel version with a keyed rate limit and idempotency keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_governance() {
    let mut run = fresh_run().await;
    compare_section(&mut run, "Quick start").await;
    let compared = compare_section(&mut run, "Channel governance").await;
    assert!(compared >= 8);
}

async fn fresh_run() -> Run {
    Run {
        s: start_with(Db::Sqlite, |_| {}).await,
        swaps: Vec::new(),
        databases: HashMap::new(),
        files: Arc::default(),
        redis: None,
    }
}

/// Runs the section's commands in order and compares every output the
/// README shows (JSON values, `uptime_seconds` set aside); returns how many
/// were compared. A `GET` (no `-X`, no body) whose output differs is
/// polled for up to 10 s: what it reads may still be on its way (an async
/// run after the README's `sleep`, on a loaded machine).
async fn compare_section(run: &mut Run, title: &str) -> usize {
    let commands = section(title);
    let mut compared = 0;
    for shown in &commands {
        let parse = |text: &str, context: &str| -> Vec<Json> {
            serde_json::Deserializer::from_str(text)
                .into_iter::<Json>()
                .map(|v| {
                    let mut v = v.unwrap_or_else(|e| panic!("{e}: {context}"));
                    for at in ["/uptime_seconds", "/data/uptime_seconds"] {
                        if let Some(u) = v.pointer_mut(at) {
                            *u = json!(0);
                        }
                    }
                    v
                })
                .collect()
        };
        let read_only = !shown.line.contains(" -X ") && !shown.line.contains(" -d ");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let Some(got) = run.run(shown).await else {
                break;
            };
            let context = format!("$ {}\nREADME: {}\ngot:    {got}", shown.line, shown.output);
            let (got, want) = (
                parse(&got, &context),
                parse(shown.output.trim_end(), &context),
            );
            if got != want && read_only && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                continue;
            }
            assert_eq!(got, want, "{context}");
            compared += 1;
            break;
        }
    }
    compared
}

/// "Worked example: PostgreSQL → HTTP API → Redis", command by command; then
/// what the prose promises: the quote is cached for five minutes, and a
/// later request is answered from Redis without reading the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worked_example_postgres_http_redis() {
    let s = start_with(Db::Sqlite, |c| {
        // SERVICE_SECURITY__ALLOW_PRIVATE_NETWORKS=true, as the README says.
        c.security.allow_private_networks = true;
    })
    .await;
    // A Redis database of this run's own (1-15; the other tests use 0), so a
    // concurrent run elsewhere cannot hand it a cached quote.
    let redis_db = 1 + uuid::Uuid::new_v4().as_u128() % 15;
    let redis_url = format!("{REDIS}{redis_db}");
    let mut redis = redis::Client::open(redis_url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("Redis at 127.0.0.1:6379 is required (bash ../shared/services/redis.sh)");
    redis::cmd("DEL")
        .arg("quote:1")
        .query_async::<()>(&mut redis)
        .await
        .unwrap();
    let mut run = Run {
        s,
        swaps: vec![(REDIS.to_owned(), redis_url)],
        databases: HashMap::new(),
        files: Arc::default(),
        redis: Some(redis),
    };

    let commands = section("Worked example: PostgreSQL → HTTP API → Redis");
    let mut compared = 0;
    for shown in &commands {
        let Some(got) = run.run(shown).await else {
            continue;
        };
        let expected = run.swap(shown.output.trim_end());
        let context = format!("$ {}\nREADME: {expected}\ngot:    {got}", shown.line);
        if shown.line.starts_with("redis-cli") {
            assert_eq!(got, expected, "{context}");
        } else {
            let want: Json =
                serde_json::from_str(&expected).unwrap_or_else(|e| panic!("{e}: {context}"));
            let got: Json = serde_json::from_str(&got).unwrap_or_else(|e| panic!("{e}: {context}"));
            assert_eq!(got, want, "{context}");
        }
        compared += 1;
    }
    // 3 connectors, workflow create + activate, channel create + activate,
    // two data-plane requests, redis-cli.
    assert_eq!(compared, 10, "{commands:#?}");

    // "caches the quote in Redis for five minutes".
    let ttl: i64 = redis::cmd("TTL")
        .arg("quote:1")
        .query_async(run.redis.as_mut().unwrap())
        .await
        .unwrap();
    assert!((1..=300).contains(&ttl), "ttl {ttl}");
    // "the next request for the same customer is answered from the cache":
    // with the row changed behind its back, the answer is still the cached one.
    {
        use sqlx::Connection as _;
        let mut conn = sqlx::PgConnection::connect(&run.databases["shop"])
            .await
            .unwrap();
        sqlx::query("UPDATE customers SET name = 'Changed' WHERE id = 1")
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let r = run
        .s
        .post(
            "/api/v1/data/quotes",
            json!({"data": {"customer_id": 1, "price": 100}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["data"]["from_cache"], true, "{}", r.text);
    assert_eq!(r.body["data"]["quote"]["customer"], "Ada", "{}", r.text);
}

/// "Kafka channels end to end", command by command, against the test broker
/// with the README's settings (`SERVICE_KAFKA__ENABLED=true`,
/// `SERVICE_KAFKA__SESSION_TIMEOUT_MS=6000`), on a topic and consumer group
/// of this run's own. Reading the trace is retried while the message is on
/// its way (the README says "a few seconds later"); every other command
/// must print what the README shows at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_channels_end_to_end() {
    let s = start_with(Db::Sqlite, |c| {
        c.kafka.enabled = true;
        c.kafka.session_timeout_ms = 6000;
    })
    .await;
    let (topic, group) = (unique("shipments"), unique("shipping"));
    kafka_topics(&[&topic], 3).await;
    let mut run = Run {
        s,
        swaps: vec![
            ("\"shipments\"".into(), format!("\"{topic}\"")),
            ("\"shipping\"".into(), format!("\"{group}\"")),
        ],
        databases: HashMap::new(),
        files: Arc::default(),
        redis: None,
    };
    let commands = section("Kafka channels end to end");
    for shown in &commands {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let got = run.run(shown).await.expect("a command with output");
            let expected = run.swap(shown.output.trim_end());
            let lines = |text: &str| -> Vec<Json> {
                text.lines()
                    .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
                    .collect()
            };
            if lines(&got) == lines(&expected) {
                break;
            }
            assert!(
                shown.line.contains("/data/traces") && std::time::Instant::now() < until,
                "$ {}\nREADME: {expected}\ngot:    {got}",
                shown.line
            );
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    }
    // Connector; workflow, channel (created, activated) twice over; the
    // request; the trace.
    assert_eq!(commands.len(), 11, "{commands:#?}");
}
