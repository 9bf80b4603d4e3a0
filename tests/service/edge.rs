//! The HTTP edge: the error envelope for bad requests, security headers,
//! request ids, operational endpoints, and a data-plane request end to end.

use crate::support::*;
use serde_json::json;

#[tokio::test]
async fn bad_requests_get_the_envelope() {
    let s = start_with(Db::Sqlite, |c| c.server.admin_max_payload_size = 1024).await;
    let big = json!({"name": "x".repeat(2000)});
    s.admin("POST", "/workflows", Some(big))
        .await
        .error(413, "PAYLOAD_TOO_LARGE");
    let r = s
        .raw(
            "POST",
            "/api/v1/admin/workflows",
            b"name=x".to_vec(),
            Some("application/x-www-form-urlencoded"),
        )
        .await;
    r.error(415, "UNSUPPORTED_MEDIA_TYPE");
    let r = s
        .raw(
            "POST",
            "/api/v1/admin/workflows",
            b"{\"name\": ".to_vec(),
            Some("application/json"),
        )
        .await;
    assert!(
        r.error(400, "BAD_REQUEST")["message"]
            .as_str()
            .unwrap()
            .starts_with("malformed JSON")
    );
    assert!(
        r.body["error"].get("details").is_none(),
        "single-message errors have no details"
    );
    // Valid JSON past serde_json's 128 levels is named for what it is.
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    let r = s
        .raw(
            "POST",
            "/api/v1/admin/workflows/validate",
            deep.into_bytes(),
            Some("application/json"),
        )
        .await;
    assert_eq!(
        r.error(400, "BAD_REQUEST")["message"],
        "request body nests deeper than 127 levels at line 1 column 128"
    );
    let r = s
        .raw(
            "POST",
            "/api/v1/admin/workflows/validate",
            format!("{}{}", "[".repeat(127), "]".repeat(127)).into_bytes(),
            Some("application/json"),
        )
        .await;
    let message = r.body["error"]["message"].as_str().unwrap_or_default();
    assert!(!message.contains("levels"), "{message}");
    // The data plane says what is wrong with a body and where, in the
    // words of a JSON parser, not simd-json's internal error kinds.
    s.deploy(
        json!({"workflow_id": "echo", "name": "echo", "tasks": [
            {"id": "p", "name": "p", "function": {"name": "parse_json",
             "input": {"source": "payload", "target": "in"}}}]}),
        json!({"channel_id": "echo", "name": "echo", "channel_type": "sync",
               "protocol": "rest", "route_pattern": "/echo", "methods": ["POST"],
               "workflow_id": "echo", "config_json": {"timeout_ms": 1000}}),
    )
    .await;
    for (body, message) in [
        (
            &b"{\"data\": [1 2]}"[..],
            "expected `,` or `]` at line 1 column 13",
        ),
        (
            b"{\"data\": 1} x",
            "trailing characters at line 1 column 13",
        ),
    ] {
        let r = s
            .raw(
                "POST",
                "/api/v1/data/echo",
                body.to_vec(),
                Some("application/json"),
            )
            .await;
        assert_eq!(
            r.error(400, "BAD_REQUEST")["message"],
            format!("request body is not valid JSON: {message}")
        );
    }
    s.get("/api/v1/admin/nothing-here")
        .await
        .error(404, "NOT_FOUND");
    s.call("DELETE", "/api/v1/admin/workflows", None)
        .await
        .error(405, "METHOD_NOT_ALLOWED");
    s.call("PATCH", "/api/v1/admin/engine/status", None)
        .await
        .error(405, "METHOD_NOT_ALLOWED");
    s.get("/nowhere").await.error(404, "NOT_FOUND");
    let no_channel = s.post("/api/v1/data/ghost", json!({"data": {}})).await;
    assert_eq!(
        no_channel.error(404, "NOT_FOUND")["message"],
        "Channel 'ghost' not found"
    );
    let no_route = s.get("/api/v1/data/orders/7").await;
    assert_eq!(
        no_route.error(404, "NOT_FOUND")["message"],
        "No route matches GET /api/v1/data/orders/7"
    );
    // The server is still serving after all of that.
    assert_eq!(s.get("/healthz").await.status, 200);
}

#[tokio::test]
async fn every_response_has_security_headers_and_a_request_id() {
    let s = start(Db::Sqlite).await;
    // JSON answers (prebuilt header map), an error, a static asset and an
    // empty answer (headers added one by one).
    for r in [
        s.get("/health").await,
        s.get("/nowhere").await,
        s.get("/docs").await,
        s.send("DELETE", "/api/v1/admin/workflows/none", None, &[])
            .await,
    ] {
        assert_eq!(r.headers.get_all("x-request-id").iter().count(), 1);
        assert_eq!(r.headers.get_all("x-frame-options").iter().count(), 1);
        assert_eq!(r.headers["x-content-type-options"], "nosniff");
        assert_eq!(r.headers["x-frame-options"], "DENY");
        assert_eq!(r.headers["referrer-policy"], "no-referrer");
        assert!(r.headers.contains_key("content-security-policy"));
        let id = r.headers["x-request-id"].to_str().unwrap();
        assert!(uuid::Uuid::parse_str(id).is_ok(), "{id}");
    }
    let mine = "6f1c2f8e-3b0a-4c3e-9d7e-1a2b3c4d5e6f";
    let r = s
        .send("GET", "/healthz", None, &[("x-request-id", mine)])
        .await;
    assert_eq!(r.headers["x-request-id"], mine);
    let r = s
        .send("GET", "/healthz", None, &[("x-request-id", "not-a-uuid")])
        .await;
    assert_ne!(r.headers["x-request-id"], "not-a-uuid");
}

#[tokio::test]
async fn health_and_readiness() {
    let s = start(Db::Sqlite).await;
    let h = s.get("/health").await;
    assert_eq!(h.status, 200);
    assert_eq!(h.body["status"], "ok");
    assert_eq!(
        h.body["components"],
        json!({"database": "ok", "engine": "ok"})
    );
    assert!(h.body["uptime_seconds"].is_u64() && h.body["version"].is_string());
    assert_eq!(s.get("/readyz").await.status, 200);
    // With the database gone, health degrades and readiness fails.
    s.app.store.close().await;
    let h = s.get("/health").await;
    assert_eq!(
        (h.status, h.body["status"].as_str()),
        (503, Some("degraded"))
    );
    assert_eq!(s.get("/readyz").await.status, 503);
    assert_eq!(s.get("/healthz").await.status, 200);
}

#[tokio::test]
async fn the_reference_workload_runs_end_to_end() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        shared("bench/reference/workflow.json"),
        shared("bench/reference/channel.json"),
    )
    .await;
    let r = s
        .post(
            "/api/v1/data/bench/orders/ord-7f3a9c",
            shared("bench/reference/request.json"),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["status"], "ok");
    assert_eq!(r.body["errors"], json!([]));
    let order = &r.body["data"]["order"];
    let expected = shared("bench/reference/expected.json");
    for (k, want) in expected.as_object().unwrap() {
        match want.as_f64() {
            Some(w) => assert!((order[k].as_f64().unwrap() - w).abs() < 1e-6, "{k}"),
            None if want.is_object() => {
                for (k2, w2) in want.as_object().unwrap() {
                    assert_eq!(&order[k][k2], w2, "{k}.{k2}");
                }
            }
            None => assert_eq!(&order[k], want, "{k}"),
        }
    }
    // Profiling on request.
    let p = s
        .send(
            "POST",
            "/api/v1/data/bench/orders/x?profile=1",
            Some(shared("bench/reference/request.json")),
            &[],
        )
        .await;
    let profile = &p.body["_service"]["profile"];
    assert_eq!(profile["version"], 1);
    assert_eq!(profile["tasks"].as_array().unwrap().len(), 6);
    assert!(profile["workflow_ms"].is_number() && profile["engine_lock_ms"].is_number());
}

#[tokio::test]
async fn metrics_are_served_in_prometheus_format() {
    let s = start(Db::Sqlite).await;
    let mut wf = workflow("metered");
    wf["workflow_id"] = json!("metered");
    s.deploy(wf, channel("metered-ch", "metered")).await;
    let ok = s
        .post("/api/v1/data/metered-ch/1", json!({"data": {"name": "x"}}))
        .await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    // A body that is not a JSON object reaches no workflow: refused, not an
    // execution (audit 97: each counted one).
    for bad in [&b"{\"data\":"[..], b"[1]"] {
        let r = s
            .raw(
                "POST",
                "/api/v1/data/metered-ch/1",
                bad.to_vec(),
                Some("application/json"),
            )
            .await;
        r.error(400, "BAD_REQUEST");
    }
    // Refused before routing (415): counted, and timed like the others.
    let r = s
        .raw(
            "POST",
            "/api/v1/data/metered-ch/1",
            b"x".to_vec(),
            Some("text/plain"),
        )
        .await;
    r.error(415, "UNSUPPORTED_MEDIA_TYPE");
    // Another method on the channel's name path (audit 103: no duration).
    s.call("DELETE", "/api/v1/data/metered-ch", None)
        .await
        .error(405, "METHOD_NOT_ALLOWED");
    // Methods a caller invents do not become label values (each one used to
    // add a series and its 17 buckets).
    let mut refused = 0;
    for invented in ["INVENTEDMETHOD", "ANOTHERINVENTED"] {
        let r = s.call(invented, "/api/v1/data/metered-ch/1", None).await;
        assert!(r.status >= 400, "{}", r.text);
        refused = r.status;
    }
    let r = s.get("/metrics").await;
    assert_eq!(r.status, 200);
    assert!(!r.text.contains("INVENTED"), "{}", r.text);
    let other = format!(
        "http_requests_total{{method=\"other\",path=\"/api/v1/data/{{path}}\",status=\"{refused}\"}}"
    );
    assert!(r.text.contains(&other), "missing {other} in\n{}", r.text);
    assert!(
        r.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    for needle in [
        "messages_total{channel=\"metered-ch\",status=\"ok\"} 1",
        "messages_total{channel=\"metered-ch\",status=\"rejected\"} 4",
        "channel_executions_total{channel=\"metered-ch\"} 1\n",
        "message_duration_seconds_bucket{channel=\"metered-ch\"",
        "http_requests_total{method=\"POST\",path=\"/api/v1/data/{path}\",status=\"200\"}",
        "engine_reloads_total{status=\"success\"}",
        // Shown before any reload fails (audit 108).
        "engine_reloads_total{status=\"failure\"}",
        "active_workflows",
    ] {
        assert!(r.text.contains(needle), "missing {needle} in\n{}", r.text);
    }
    // Every counted message has a duration (audit 100: those refused
    // before routing had none).
    let sample = |prefix: &str| -> f64 {
        r.text
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(
        sample("messages_total{channel=\"metered-ch\""),
        sample("message_duration_seconds_count{channel=\"metered-ch\"}"),
        "{}",
        r.text
    );
    // Every metric the spec lists is exported, with a `TYPE` line (those
    // whose labels only the first event knows have nothing else yet), and
    // every sample of a labelled metric carries labels.
    for (name, _) in sluice::telemetry::names::ALL
        .iter()
        .chain(sluice::telemetry::names::EXTRA)
    {
        assert!(
            r.text
                .lines()
                .any(|l| l.starts_with(&format!("# TYPE {name} "))),
            "metric {name} missing"
        );
    }
    for name in [
        "circuit_breaker_trips_total",
        "circuit_breaker_rejections_total",
        "rate_limit_rejections_total",
        "governance_backend_errors_total",
    ] {
        assert!(
            !r.text.lines().any(|l| l.starts_with(&format!("{name} "))),
            "{name} has a sample without labels:\n{}",
            r.text
        );
    }
    assert_eq!(sluice::telemetry::names::ALL.len(), 13);
    // `errors_total` is shown at zero per error type, never as a sample
    // without its `type` label.
    let errors: Vec<&str> = r
        .text
        .lines()
        .filter(|l| l.starts_with("errors_total"))
        .collect();
    assert!(
        errors.iter().all(|l| l.starts_with("errors_total{type=\"")),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|l| l.starts_with("errors_total{type=\"UPSTREAM_ERROR\"}")),
        "{errors:?}"
    );
}

#[tokio::test]
async fn openapi_and_docs_are_served_offline() {
    let s = start(Db::Sqlite).await;
    let spec = s.get("/api/v1/openapi.json").await;
    assert_eq!(spec.status, 200);
    assert!(spec.body["openapi"].as_str().unwrap().starts_with("3.0"));
    for path in [
        "/api/v1/admin/workflows",
        "/api/v1/admin/workflows/{id}/status",
        "/api/v1/data/{channel}",
        "/health",
    ] {
        assert!(spec.body["paths"].get(path).is_some(), "{path}");
    }
    // Query parameters are described, not only named in summaries.
    let names = |path: &str, method: &str| -> Vec<String> {
        spec.body["paths"][path][method]["parameters"]
            .as_array()
            .map(|ps| {
                ps.iter()
                    .filter(|p| p["in"] == "query")
                    .map(|p| p["name"].as_str().unwrap().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        names("/api/v1/admin/workflows", "get"),
        ["tag", "status", "limit", "offset"]
    );
    assert_eq!(
        names("/api/v1/admin/channels", "get"),
        ["status", "channel_type", "protocol", "limit", "offset"]
    );
    assert_eq!(
        names("/api/v1/data/traces", "get"),
        ["status", "channel", "mode", "limit", "offset"]
    );
    assert_eq!(names("/api/v1/admin/workflows/import", "post"), ["dry_run"]);
    assert_eq!(names("/api/v1/data/{channel}", "post"), ["profile"]);
    // Without admin auth no operation asks for credentials.
    assert!(spec.body["components"].get("securitySchemes").is_none());
    assert!(!spec.text.contains("\"security\""));
    let docs = s.get("/docs").await;
    assert_eq!(docs.status, 200);
    assert!(docs.text.contains("/docs/app.js") && docs.text.contains("openapi.json"));
    let csp = docs.headers["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("http"),
        "{csp}"
    );
    let js = s.get("/docs/app.js").await;
    assert_eq!(js.status, 200);
    assert!(js.text.contains("fetch(\"/api/v1/openapi.json\")"));
}

/// The OpenAPI document and the router agree: every documented operation is
/// served, and every (method, path) the router serves on a documented path is
/// documented.
#[tokio::test]
async fn openapi_lists_exactly_the_routes_the_router_serves() {
    let s = start(Db::Sqlite).await;
    let spec = s.get("/api/v1/openapi.json").await.body;
    let paths = spec["paths"].as_object().unwrap();
    let is_unrouted = |r: &Resp| {
        let message = r.body["error"]["message"].as_str().unwrap_or_default();
        r.status == 405
            || message.starts_with("No admin endpoint")
            || (message.starts_with("No route matches") && !message.contains("/api/v1/data/zz"))
    };
    for (template, ops) in paths {
        let concrete = template
            .replace("{id}", "zz-none")
            .replace("{channel}", "zz-none")
            .replace("{path}", "zz/none");
        // The data plane answers any method on any path (route matching), so
        // only the documented direction is checked there.
        let data_plane = template.starts_with("/api/v1/data/");
        for method in ["get", "post", "put", "patch", "delete"] {
            let body = (method != "get" && method != "delete").then(|| json!({}));
            let r = s.call(&method.to_uppercase(), &concrete, body).await;
            let documented = ops.get(method).is_some();
            if documented {
                assert!(
                    !is_unrouted(&r),
                    "{method} {template} is documented but not served: {}",
                    r.text
                );
            } else if !data_plane {
                assert!(
                    is_unrouted(&r),
                    "{method} {template} is served ({}) but not documented",
                    r.status
                );
            }
        }
    }
}

#[tokio::test]
async fn openapi_schemas_are_complete_and_resolve() {
    let s = start(Db::Sqlite).await;
    let spec = s.get("/api/v1/openapi.json").await.body;
    let schemas = spec["components"]["schemas"].as_object().unwrap();
    // The definition schemas come from the compiler's types.
    assert!(schemas["WorkflowDef"]["properties"].get("tasks").is_some());
    assert!(
        schemas["ChannelDef"]["properties"]
            .get("config_json")
            .is_some()
    );
    assert!(
        schemas["ConnectorDef"]["properties"]
            .get("connector_type")
            .is_some()
    );
    let create = &spec["paths"]["/api/v1/admin/workflows"]["post"];
    assert_eq!(
        create["requestBody"]["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/WorkflowDef"
    );
    // Every operation has a success schema, and every $ref resolves.
    fn refs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    if k == "$ref" {
                        out.push(x.as_str().unwrap().to_owned());
                    } else {
                        refs(x, out);
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&spec, &mut all);
    assert!(all.len() > 50);
    for r in all {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("odd ref {r}"));
        assert!(schemas.contains_key(name), "unresolved {r}");
    }
    for (path, ops) in spec["paths"].as_object().unwrap() {
        for (method, op) in ops.as_object().unwrap() {
            let success = op["responses"]
                .as_object()
                .unwrap()
                .keys()
                .any(|k| k.starts_with('2'));
            assert!(success, "{method} {path} has no success response");
            assert!(op["operationId"].is_string());
        }
    }
}

/// The function catalogue the service answers is what the document
/// describes (audit 71: `constraint` was typed a string, and `http_call`'s
/// `method` has an object).
#[tokio::test]
async fn functions_answer_as_the_document_says() {
    let s = start(Db::Sqlite).await;
    let spec = s.get("/api/v1/openapi.json").await.body;
    let schema = &spec["components"]["schemas"]["FunctionSchema"];
    assert!(!schema.to_string().contains("$ref"), "{schema}");
    let validator = jsonschema::draft4::new(schema).unwrap();
    let functions = s.admin("GET", "/functions", None).await;
    let functions = functions.ok(200).as_array().unwrap();
    assert!(
        functions
            .iter()
            .any(|f| f["fields"].to_string().contains("one_of"))
    );
    for f in functions {
        let errors: Vec<String> = validator.iter_errors(f).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{}: {errors:?}", f["name"]);
    }
}

/// With `metrics.enabled` off, `/metrics` is 404 and the document does not
/// offer it.
#[tokio::test]
async fn disabled_metrics_are_not_in_the_document() {
    let s = crate::support::start_with(Db::Sqlite, |c| c.metrics.enabled = false).await;
    assert_eq!(s.get("/metrics").await.status, 404);
    let spec = s.get("/api/v1/openapi.json").await.body;
    assert!(spec["paths"].get("/metrics").is_none());
    assert!(spec["paths"].get("/health").is_some());
}

/// What the document offers, the server takes: no optional field is
/// `nullable` (the admin API refuses `null` for each), a channel's status
/// may be `paused`, and a channel's status change has no rollout.
#[tokio::test]
async fn openapi_offers_what_the_server_accepts() {
    let s = start(Db::Sqlite).await;
    let spec = s.get("/api/v1/openapi.json").await.body;
    let schemas = &spec["components"]["schemas"];
    // What a client sends (the definitions) offers no null; what the
    // server answers may hold one where it does (a trace not yet run).
    for name in ["WorkflowDef", "ChannelDef", "ConnectorDef", "ChannelConfig"] {
        let text = schemas[name].to_string();
        assert!(!text.contains("nullable"), "{name} still offers null");
        assert!(
            !text.contains("{\"enum\":[null]}"),
            "{name} still offers null"
        );
    }
    assert_eq!(
        schemas["Trace"]["properties"]["workflow_id"]["nullable"],
        true
    );
    // A channel is paused through its status change, never by its
    // definition: the server refuses `status: "paused"` on create (audit
    // 78), so the definition does not offer it; what the server answers
    // (`Channel`) may hold it.
    let offered = schemas["ChannelStatus"]["enum"].as_array().unwrap();
    assert!(
        !offered.contains(&serde_json::json!("paused")),
        "{offered:?}"
    );
    let r = s
        .admin(
            "POST",
            "/channels",
            Some(serde_json::json!({"name": "p", "workflow_id": "w", "status": "paused"})),
        )
        .await;
    assert_eq!(r.error(400, "BAD_REQUEST")["details"][0]["field"], "status");
    let answered = schemas["Channel"]["properties"]["status"]["enum"]
        .as_array()
        .unwrap();
    assert!(
        answered.contains(&serde_json::json!("paused")),
        "{answered:?}"
    );
    for (path, method) in [
        ("/api/v1/admin/channels", "post"),
        ("/api/v1/admin/channels/{id}", "get"),
        ("/api/v1/admin/channels/{id}/status", "patch"),
    ] {
        let ok = spec["paths"][path][method]["responses"]
            .as_object()
            .unwrap()
            .iter()
            .find(|(code, _)| code.starts_with('2'))
            .unwrap()
            .1;
        let data = &ok["content"]["application/json"]["schema"]["properties"]["data"];
        assert_eq!(
            data["$ref"], "#/components/schemas/Channel",
            "{path} {method}"
        );
    }
    // Any request on an asynchronous channel is a submission: the plain
    // data-plane operations declare its 202 too.
    for (path, method) in [
        ("/api/v1/data/{channel}", "post"),
        ("/api/v1/data/{path}", "get"),
        ("/api/v1/data/{path}", "post"),
        ("/api/v1/data/{path}", "delete"),
    ] {
        let accepted = &spec["paths"][path][method]["responses"]["202"];
        assert_eq!(
            accepted["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/TraceAccepted",
            "{path} {method}"
        );
    }
    let body = &spec["paths"]["/api/v1/admin/channels/{id}/status"]["patch"]["requestBody"];
    let change = body["content"]["application/json"]["schema"]["$ref"]
        .as_str()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap();
    assert!(
        schemas[change]["properties"]
            .get("rollout_percentage")
            .is_none()
    );
    // And the server does refuse `null` for an optional field.
    let r = s
        .admin(
            "POST",
            "/workflows",
            Some(serde_json::json!({"name": "n", "description": null,
                "tasks": [{"id": "t", "name": "t", "function": {"name": "log", "input": {}}}]})),
        )
        .await;
    let e = r.error(400, "BAD_REQUEST");
    assert_eq!(e["details"][0]["field"], "description", "{e}");
    // Session 21: route-matched async submission is declared; health and
    // readiness declare their 503 shapes; bounds the server enforces are
    // in the schema; dry-run metadata lists what it takes.
    for method in ["get", "post", "put", "patch", "delete"] {
        let op = &spec["paths"]["/api/v1/data/{path}/async"][method];
        assert!(op["responses"].get("202").is_some(), "{method}: {op}");
    }
    assert!(
        spec["paths"]["/health"]["get"]["responses"]
            .get("503")
            .is_some()
    );
    assert!(
        spec["paths"]["/readyz"]["get"]["responses"]
            .get("503")
            .is_some()
    );
    let dedup = schemas["DedupConfig"].to_string();
    assert!(dedup.contains("\"minimum\":1"), "{dedup}");
    assert_eq!(
        schemas["DryRunRequest"]["properties"]["metadata"]["properties"]["method"]["type"],
        "string"
    );
}

/// A workflow that nests a value deeper on every loop pass (here 2 × 10,000
/// wraps) ends with a task error at the nesting limit; the service answers
/// and keeps serving. Before, the response writer overflowed the worker's
/// stack and the whole process aborted. Run as the real binary, whose
/// runtime threads are the ones that must hold the walk.
#[tokio::test]
async fn values_nested_past_the_limit_fail_the_task_not_the_process() {
    let dir = std::env::temp_dir().join(format!("sluice-deep-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = format!("sqlite://{}/s.db", dir.display());
    install_crypto();
    let r = crate::replicas::replica_with(&db, &[]).await;
    let c = reqwest::Client::new();
    let admin = |method: &str, path: &str, body: serde_json::Value| {
        c.request(
            method.parse().unwrap(),
            format!("{}/api/v1/admin{path}", r.base),
        )
        .json(&body)
        .send()
    };
    let wrap = json!({"id": "m", "name": "m", "function": {"name": "map", "input": {
        "mappings": [{"path": "x", "logic": [{"var": "data.x"}]}]}}});
    let def = json!({"workflow_id": "deep", "name": "deep", "loop": {"max": 10000},
                     "tasks": [{"id": "g", "name": "g", "loop": {"max": 2}, "tasks": [wrap]}]});
    let ch = json!({"channel_id": "deep", "name": "deep", "workflow_id": "deep",
                    "config_json": {"timeout_ms": 60000}});
    for (path, body) in [("/workflows", def), ("/channels", ch)] {
        assert!(
            admin("POST", path, body)
                .await
                .unwrap()
                .status()
                .is_success()
        );
        let status = format!("{path}/deep/status");
        let a = admin("PATCH", &status, json!({"status": "active"}))
            .await
            .unwrap();
        assert!(a.status().is_success());
    }
    let answer = c
        .post(format!("{}/api/v1/data/deep", r.base))
        .json(&json!({"data": {}}))
        .send()
        .await
        .expect("the service answers");
    assert_eq!(answer.status().as_u16(), 500);
    let body: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(body["error"]["code"], "TASK_ERROR", "{body}");
    assert_eq!(body["error"]["task_id"], "m");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("nest deeper than 2048 levels"),
        "{body}"
    );
    let health = c.get(format!("{}/healthz", r.base)).send().await.unwrap();
    assert!(health.status().is_success());

    // A map path thousands of segments long once overflowed the reload
    // thread's stack (the activation, committed, then aborted every start).
    // Now it is an input problem: created with a warning, activated, and
    // failing its task when run.
    let long = vec!["x"; 5000].join(".");
    let def = json!({"workflow_id": "long", "name": "long", "tasks": [
        {"id": "m", "name": "m", "function": {"name": "map", "input": {
            "mappings": [{"path": long, "logic": 1}]}}}]});
    assert!(
        admin("POST", "/workflows", def)
            .await
            .unwrap()
            .status()
            .is_success()
    );
    let a = admin(
        "PATCH",
        "/workflows/long/status",
        json!({"status": "active"}),
    )
    .await
    .expect("the service answers the activation");
    assert!(a.status().is_success());
    let health = c.get(format!("{}/healthz", r.base)).send().await.unwrap();
    assert!(health.status().is_success());
    drop(r);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A request target that is not a path (`GET healthz`, authority form
/// outside CONNECT) is a 400, not a 404 naming an empty path; a client
/// that hangs up in the middle of its body is answered to nobody and
/// counted nowhere (audit 72: a 400 in `http_requests_total`,
/// `errors_total` and the channel's `messages_total`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_targets_and_abandoned_bodies() {
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = start(Db::Sqlite).await;
    s.deploy(
        json!({"workflow_id": "gw", "name": "gw", "tasks": [
            {"id": "p", "name": "p", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}}]}),
        json!({"channel_id": "gone", "name": "gone", "workflow_id": "gw"}),
    )
    .await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    for head in [
        "GET healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\nConnection: close\r\n\r\n",
        "POST example.com:80 HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
    ] {
        let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
        conn.write_all(head.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
        let got = String::from_utf8_lossy(&got);
        assert!(got.starts_with("HTTP/1.1 400"), "{head}: {got}");
        assert!(
            got.contains("must start with '/'") && got.contains(r#""code":"BAD_REQUEST""#),
            "{head}: {got}"
        );
    }
    let before = s.get("/metrics").await.text;
    for _ in 0..3 {
        let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
        conn.write_all(
            b"POST /api/v1/data/gone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"data\":",
        )
        .await
        .unwrap();
        drop(conn);
    }
    // A client that only half-closes still reads the envelope (audit 74:
    // an empty 400), uncounted all the same.
    let mut half = tokio::net::TcpStream::connect(&addr).await.unwrap();
    half.write_all(
        b"POST /api/v1/data/gone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"data\":",
    )
    .await
    .unwrap();
    half.shutdown().await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), half.read_to_end(&mut got))
        .await
        .unwrap()
        .unwrap();
    let got = String::from_utf8_lossy(&got);
    assert!(
        got.starts_with("HTTP/1.1 400") && got.contains(r#""code":"BAD_REQUEST""#),
        "{got}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = s.get("/metrics").await.text;
    let count = |text: &str, series: &str| -> Option<String> {
        text.lines()
            .find(|l| l.starts_with(series))
            .map(|l| l.rsplit(' ').next().unwrap_or_default().to_owned())
    };
    // The channel's own series (the process-wide ones are shared with the
    // tests running beside this one; the server skips all three alike).
    let series = "messages_total{channel=\"gone\",status=\"rejected\"}";
    assert_eq!(
        count(&before, series),
        count(&after, series),
        "{series}\n{after}"
    );
    // The connection's requests still count as usual.
    let r = s.post("/api/v1/data/gone", json!({"data": {}})).await;
    assert_eq!(r.status, 200, "{}", r.text);
}

/// A client that is slow to send its request cannot hold the connection:
/// a silent connection and one with half a head are closed after
/// `server.request_read_timeout_secs`; a body that stops arriving is
/// answered 408 in the error envelope.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off() {
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = start_with(Db::Sqlite, |c| c.server.request_read_timeout_secs = 1).await;
    s.deploy(
        json!({"workflow_id": "xw", "name": "xw", "tasks": [
            {"id": "p", "name": "p", "function": {"name": "parse_json", "input": {"source": "payload", "target": "in"}}}]}),
        json!({"channel_id": "x", "name": "x", "workflow_id": "xw",
            "config_json": {"cors": {"allowed_origins": ["https://app.example"]}}}),
    )
    .await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    let read_all = |mut conn: tokio::net::TcpStream| async move {
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut got))
            .await
            .expect("the server closes the connection")
            .ok();
        String::from_utf8_lossy(&got).into_owned()
    };
    let started = std::time::Instant::now();
    // Nothing sent at all.
    let silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
    // Half a head.
    let mut half = tokio::net::TcpStream::connect(&addr).await.unwrap();
    half.write_all(b"POST /api/v1/data/x HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // A whole head, then part of the body.
    let mut body = tokio::net::TcpStream::connect(&addr).await.unwrap();
    body.write_all(
        b"POST /api/v1/data/x HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"data\":",
    )
    .await
    .unwrap();
    let (silent, half, body) = tokio::join!(read_all(silent), read_all(half), read_all(body));
    assert!(silent.is_empty(), "{silent}");
    assert!(!half.contains("200 OK"), "{half}");
    assert!(body.starts_with("HTTP/1.1 408"), "{body}");
    assert!(body.contains(r#""code":"REQUEST_TIMEOUT""#), "{body}");
    // The channel's CORS headers, as on its other refusals.
    assert!(
        body.to_ascii_lowercase()
            .contains("access-control-allow-origin: https://app.example"),
        "{body}"
    );
    assert!(started.elapsed() < Duration::from_secs(8));
    // The service is fine.
    assert_eq!(s.get("/healthz").await.status, 200);
}

/// Header values in UTF-8 (not only visible ASCII) reach the workflow, and
/// a status change of the wrong shape says precisely what is wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn utf8_headers_and_status_bodies() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        json!({"workflow_id": "hdr", "name": "hdr", "tasks": [
            {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [
                {"path": "name", "logic": {"var": "metadata.headers.x-name"}}]}}}]}),
        json!({"channel_id": "hdr", "name": "hdr", "workflow_id": "hdr"}),
    )
    .await;
    let body = r#"{"data":{}}"#;
    let request = format!(
        "POST /api/v1/data/hdr HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nX-Name: caf\u{e9}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer = exchange(&s, request.as_bytes()).await;
    assert!(answer.contains(r#""name":"café""#), "{answer}");

    for (body, field_message) in [
        (json!({"status": 5}), Some("expected string, got integer")),
        (json!({"status": null}), Some("expected string, got null")),
        (json!({}), Some("is required")),
        (json!([]), None),
    ] {
        let r = s.admin("PATCH", "/workflows/hdr/status", Some(body)).await;
        let e = r.error(400, "BAD_REQUEST");
        match field_message {
            Some(m) => assert_eq!(
                (
                    e["details"][0]["field"].as_str(),
                    e["details"][0]["message"].as_str()
                ),
                (Some("status"), Some(m)),
                "{e}"
            ),
            None => assert!(
                e["message"]
                    .as_str()
                    .unwrap()
                    .contains("must be a JSON object"),
                "{e}"
            ),
        }
    }
}

/// The dry run answers results nested past serde_json's 128 levels (it
/// answered `data: null`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_runs_answer_deep_results() {
    let s = start(Db::Sqlite).await;
    // A payload 100 levels deep written 40 levels down: a result of 141.
    let target = vec!["t"; 40].join(".");
    s.admin(
        "POST",
        "/workflows",
        Some(json!({"workflow_id": "deepdry", "name": "d", "tasks": [
            {"id": "p", "name": "p", "function": {"name": "parse_json", "input": {"source": "payload", "target": target}}}]})),
    )
    .await
    .ok(201);
    let levels = 100;
    let text = format!(
        r#"{{"data": {}1{}}}"#,
        "[".repeat(levels),
        "]".repeat(levels)
    );
    let r = s
        .raw(
            "POST",
            "/api/v1/admin/workflows/deepdry/test",
            text.into_bytes(),
            Some("application/json"),
        )
        .await;
    assert_eq!(r.status, 200, "{}", &r.text[..200.min(r.text.len())]);
    assert!(
        r.text.contains(&format!(r#""t":{}1"#, "[".repeat(levels))),
        "{}",
        &r.text[..300.min(r.text.len())]
    );
}

/// Requests hyper refuses before any service sees them (a malformed head,
/// more header fields than it takes, a target over its URI limit) are
/// answered with the error envelope, the security headers and a request
/// id, like every other answer.
#[tokio::test]
async fn requests_the_http_layer_refuses_get_the_envelope() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = start(Db::Sqlite).await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    let many: String = (0..200).map(|i| format!("x-h{i}: v\r\n")).collect();
    let long = "a".repeat(70_000);
    let counted = |metrics: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with("errors_total{type=\"URI_TOO_LONG\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    };
    // The duration histogram counts them as the counter does (audit 117:
    // only `http_requests_total` did).
    let timed = |metrics: &str| -> f64 {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("http_request_duration_seconds_count{")
                    && l.contains("path=\"unmatched\"")
                    && l.contains("status=\"414\"")
                    && l.contains("method=\"other\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    };
    let metrics = s.get("/metrics").await.text;
    let (before, before_timed) = (counted(&metrics), timed(&metrics));
    for (raw, status, code) in [
        ("GARBAGE\r\n\r\n".to_owned(), 400, "BAD_REQUEST"),
        (
            format!("GET /healthz HTTP/1.1\r\nhost: x\r\n{many}\r\n"),
            431,
            "HEADERS_TOO_LARGE",
        ),
        (
            format!("GET /{long} HTTP/1.1\r\nhost: x\r\n\r\n"),
            414,
            "URI_TOO_LONG",
        ),
    ] {
        let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
        conn.write_all(raw.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            conn.read_to_end(&mut answer),
        )
        .await
        .expect("the connection is closed after the answer")
        .unwrap();
        let answer = String::from_utf8(answer).unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").expect("a whole answer");
        assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{head}");
        let head = head.to_ascii_lowercase();
        for h in [
            "content-type: application/json",
            "x-content-type-options: nosniff",
            "x-frame-options: deny",
            "referrer-policy: no-referrer",
            "content-security-policy: ",
            "x-request-id: ",
            "connection: close",
        ] {
            assert!(head.contains(&format!("\r\n{h}")), "{h} missing: {head}");
        }
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], code, "{body}");
        assert!(body["error"]["message"].is_string(), "{body}");
    }
    // The server goes on serving, and counted them.
    assert_eq!(s.get("/healthz").await.status, 200);
    let metrics = s.get("/metrics").await.text;
    assert_eq!(counted(&metrics), before + 1.0);
    assert_eq!(timed(&metrics), before_timed + 1.0, "{metrics}");
}

/// The admin plane has its own body limit (`server.admin_max_payload_size`,
/// 32 MiB): before, `ingest.max_payload_size` (the data plane's, 1 MiB)
/// applied to it too, so an export over 1 MiB could not be imported back,
/// and a tight data-plane limit refused every definition.
#[tokio::test]
async fn the_admin_plane_has_its_own_body_limit() {
    let s = start_with(Db::Sqlite, |c| c.ingest.max_payload_size = 100).await;
    let mut wf = workflow("big");
    wf["description"] = json!("d".repeat(2_000));
    s.admin("POST", "/workflows", Some(wf)).await.ok(201);
    // An import over the data plane's default 1 MiB too.
    let many: Vec<_> = (0..600)
        .map(|i| {
            let mut wf = workflow(&format!("imp{i}"));
            wf["description"] = json!("d".repeat(2_000));
            wf
        })
        .collect();
    let r = s
        .admin("POST", "/workflows/import?dry_run=true", Some(json!(many)))
        .await;
    assert_eq!(r.ok(200)["created"].as_array().map(Vec::len), Some(600));
    s.deploy(
        workflow("small"),
        json!({"channel_id": "small", "name": "small",
        "workflow_id": "small", "config_json": {}}),
    )
    .await;
    let r = s
        .post(
            "/api/v1/data/small",
            json!({"data": {"x": "y".repeat(200)}}),
        )
        .await;
    assert_eq!(
        r.error(413, "PAYLOAD_TOO_LARGE")["message"],
        "request body exceeds the limit of 100 bytes"
    );
}

/// Sends `request` on a new connection and returns the whole answer.
async fn exchange(s: &TestServer, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = s.base.trim_start_matches("http://").to_owned();
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    conn.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// Session 17's audit of the HTTP layer:
/// - HTTP/1.1 without `Host`, or with two, is a 400 (RFC 9112 3.2; both
///   were served);
/// - a body in a content coding is a 415 (RFC 9110 8.4.1; a gzip body
///   failed as "not JSON", a plain body labelled gzip was taken);
/// - over HTTP/2, `metadata.headers.host` holds `:authority`, as over
///   HTTP/1.1 (it was missing);
/// - a body announced by its length is judged by its headers before it is
///   read, so `Expect: 100-continue` gets the 415 instead of the 100.
#[tokio::test]
async fn host_headers_content_codings_and_h2_hosts() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        json!({"workflow_id": "h", "name": "h", "tasks": [
            {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [
                {"path": "host", "logic": {"var": "metadata.headers.host"}}]}}}]}),
        json!({"channel_id": "h", "name": "h", "workflow_id": "h"}),
    )
    .await;
    for (request, message) in [
        (
            "GET /health HTTP/1.1\r\nConnection: close\r\n\r\n",
            "an HTTP/1.1 request needs a Host header",
        ),
        (
            "GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n",
            "the request has more than one Host header",
        ),
        (
            "GET /health HTTP/1.1\r\nHost: bad host\r\nConnection: close\r\n\r\n",
            "the Host header is not a host name, an address or a port",
        ),
        (
            "GET /health HTTP/1.1\r\nHost: a/b\r\nConnection: close\r\n\r\n",
            "the Host header is not a host name, an address or a port",
        ),
        // One body, one media type, whichever order (audit 94: the first
        // decided).
        (
            "POST /api/v1/data/h HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
            "the request has more than one Content-Type header",
        ),
        (
            "POST /api/v1/admin/workflows/validate HTTP/1.1\r\nHost: a\r\nContent-Type: text/plain\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
            "the request has more than one Content-Type header",
        ),
    ] {
        let answer = exchange(&s, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
        assert!(answer.contains(message), "{answer}");
    }
    // Names, addresses, IP literals, ports and an empty value are hosts.
    for host in [
        "example.com:8080",
        "127.0.0.1",
        "[::1]:80",
        "xn--bcher-kva.example",
        "",
    ] {
        let request = format!("GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let answer = exchange(&s, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 200 "), "{host}: {answer}");
    }
    // HTTP/1.0 needs none, but an invalid one is refused there too.
    let answer = exchange(&s, b"GET /health HTTP/1.0\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.0 200 "), "{answer}");
    let answer = exchange(&s, b"GET /health HTTP/1.0\r\nHost: bad host\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.0 400 "), "{answer}");

    // A client waiting for `100 Continue` with a body that would be refused
    // is refused at once, without the 100 (it then uploaded for nothing).
    let answer = exchange(
        &s,
        b"POST /api/v1/data/h HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: text/plain\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 415 "), "{answer}");

    for (coding, status) in [("gzip", 415), ("identity", 200), ("", 200)] {
        let r = s
            .raw_with(
                "POST",
                "/api/v1/data/h",
                br#"{"data":{}}"#.to_vec(),
                &[
                    ("content-type", "application/json"),
                    ("content-encoding", coding),
                ],
            )
            .await;
        assert_eq!(r.status, status, "{coding}: {}", r.text);
        if status == 415 {
            assert_eq!(
                r.error(415, "UNSUPPORTED_MEDIA_TYPE")["message"],
                "Content-Encoding 'gzip' is not supported: send the body uncompressed"
            );
        }
    }

    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let r = h2
        .post(format!("{}/api/v1/data/h", s.base))
        .json(&json!({"data": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    let body: serde_json::Value = r.json().await.unwrap();
    let authority = s.base.trim_start_matches("http://");
    assert_eq!(body["data"]["host"], authority, "{body}");
    // A head as large as HTTP/1.1 takes (20 KB of header) is served over
    // HTTP/2 too (h2's default 16 KiB list answered a bare 431).
    let big = "a".repeat(20_000);
    let r = h2
        .post(format!("{}/api/v1/data/h", s.base))
        .header("x-big", &big)
        .json(&json!({"data": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // HEAD over HTTP/2: the GET's headers (its length too), no body (hyper
    // sent the body, which clients refuse as a protocol error).
    for path in ["/health", "/api/v1/admin/workflows", "/api/v1/data/nope"] {
        let get = h2.get(format!("{}{path}", s.base)).send().await.unwrap();
        let (status, length) = (get.status(), get.bytes().await.unwrap().len());
        let head = h2
            .head(format!("{}{path}", s.base))
            .send()
            .await
            .unwrap_or_else(|e| panic!("HEAD {path}: {e}"));
        assert_eq!(head.version(), reqwest::Version::HTTP_2);
        assert_eq!(head.status(), status, "{path}");
        assert_eq!(
            head.headers()["content-length"],
            length.to_string().as_str(),
            "{path}"
        );
        assert!(head.bytes().await.unwrap().is_empty(), "{path}");
    }
}

/// Starts the binary in a fresh directory with its stdout in `sluice.log`
/// there, and waits until it is ready: (process, base URL, directory).
async fn serve_logging(
    name: &str,
    env: &[(&str, &str)],
) -> (std::process::Child, String, std::path::PathBuf) {
    use std::process::{Command, Stdio};
    crate::support::install_crypto();
    let dir = std::env::temp_dir().join(crate::support::unique(name));
    std::fs::create_dir_all(&dir).unwrap();
    let port = crate::support::free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("serve")
        .current_dir(&dir)
        .env("SERVICE_SERVER__PORT", port.to_string())
        .envs(env.iter().copied())
        .stdout(std::fs::File::create(dir.join("sluice.log")).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    crate::support::wait_ready(&base).await;
    (child, base, dir)
}

/// sqlx logs an unknown PostgreSQL URL parameter with its value at warn
/// (`key=sslpassword value=…`): the service's filter keeps that module to
/// errors, so a storage URL's secret parameter never reaches the log
/// (audit 122).
#[tokio::test]
async fn storage_url_parameters_are_not_logged() {
    let url = format!(
        "{}?sslmode=disable&sslpassword=KeyPass123",
        fresh_database(Db::Postgres).await
    );
    let (mut child, base, dir) = serve_logging(
        "pgparams",
        &[
            ("SERVICE_STORAGE__URL", url.as_str()),
            ("SERVICE_LOGGING__LEVEL", "debug"),
        ],
    )
    .await;
    let r = reqwest::get(format!("{base}/api/v1/admin/workflows"))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    child.kill().unwrap();
    child.wait().unwrap();
    let log = std::fs::read_to_string(dir.join("sluice.log")).unwrap();
    assert!(log.contains("sluice is serving"), "{log}");
    assert!(!log.contains("KeyPass123"), "{log}");
}

/// On PostgreSQL a replica's own change notifies it too; it reloads once,
/// not once more on the notification (audit 83: every change was reloaded,
/// logged and counted in `engine_reloads_total` twice; audit 106: a
/// connector change was reloaded only on the notification, as "another
/// replica's change").
#[tokio::test]
async fn an_own_change_reloads_once_on_postgres() {
    let url = fresh_database(Db::Postgres).await;
    let (mut child, base, dir) = serve_logging(
        "ownchange",
        &[
            ("SERVICE_STORAGE__URL", url.as_str()),
            ("SERVICE_LOGGING__LEVEL", "info"),
        ],
    )
    .await;
    let log_path = dir.join("sluice.log");
    // Whatever start-up logged is left out.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let skip = std::fs::read_to_string(&log_path).unwrap().len();
    let c = reqwest::Client::new();
    for _ in 0..3 {
        let r = c
            .post(format!("{base}/api/v1/admin/engine/reload"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    }
    // A connector created, then the connectors reloaded: each moves the
    // generation on, and this replica serves the new one at once.
    let generation = |base: String| async move {
        let status: serde_json::Value = reqwest::get(format!("{base}/api/v1/admin/engine/status"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        status["data"]["generation"].as_u64().unwrap()
    };
    let before = generation(base.clone()).await;
    let r = c
        .post(format!("{base}/api/v1/admin/connectors"))
        .json(&json!({"name": "cache", "connector_type": "cache",
                      "config": {"type": "cache", "backend": "memory"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(generation(base.clone()).await, before + 1);
    let r = c
        .post(format!("{base}/api/v1/admin/connectors/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(generation(base.clone()).await, before + 2);
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&log_path).unwrap();
    let log = &log[skip..];
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("engine reloaded"))
            .count(),
        5,
        "{log}"
    );
    assert!(!log.contains("caught up"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Creates workflow `id` with `tasks` and a name-routed channel `id` for it
/// on the server at `base`, and activates both.
async fn deploy_named(base: &str, id: &str, tasks: serde_json::Value) {
    let c = reqwest::Client::new();
    for (method, path, body) in [
        (
            "POST",
            "/workflows".to_owned(),
            json!({"workflow_id": id, "name": id, "tasks": tasks}),
        ),
        (
            "PATCH",
            format!("/workflows/{id}/status"),
            json!({"status": "active"}),
        ),
        (
            "POST",
            "/channels".to_owned(),
            json!({"channel_id": id, "name": id, "channel_type": "sync", "protocol": "http", "workflow_id": id}),
        ),
        (
            "PATCH",
            format!("/channels/{id}/status"),
            json!({"status": "active"}),
        ),
    ] {
        crate::support::admin_call(&c, base, method, &path, body).await;
    }
}

/// Every engine reload is one sample of `engine_reload_duration_seconds`,
/// a failed one too (audit 117: it was counted in `engine_reloads_total`
/// and not timed). In a process of its own, so the counts are exact.
#[tokio::test]
async fn failed_reloads_are_timed() {
    use sqlx::Connection as _;
    let (mut child, base, dir) = serve_logging("reloadtimed", &[]).await;
    deploy_named(
        &base,
        "t",
        json!([{"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": []}}}]),
    )
    .await;
    let url = format!("sqlite://{}", dir.join("sluice.db").display());
    let mut db = sqlx::SqliteConnection::connect(&url).await.unwrap();
    sqlx::query("UPDATE workflows SET definition = ?, digest = NULL WHERE id = 't'")
        .bind(json!({"name": "t", "tasks": 7}).to_string())
        .execute(&mut db)
        .await
        .unwrap();
    let c = reqwest::Client::new();
    let r = c
        .post(format!("{base}/api/v1/admin/engine/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let metrics = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let sample = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {name}:\n{metrics}"))
    };
    let (ok, failed) = (
        sample("engine_reloads_total{status=\"success\"}"),
        sample("engine_reloads_total{status=\"failure\"}"),
    );
    assert_eq!(failed, 1.0, "{metrics}");
    assert_eq!(
        sample("engine_reload_duration_seconds_count"),
        ok + failed,
        "{metrics}"
    );
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A request that fails upstream is logged (warn, with its request id and
/// the error), in plain text when the log is not a terminal.
#[tokio::test]
async fn failed_requests_are_logged_without_colours_off_a_terminal() {
    let (mut child, base, dir) = serve_logging(
        "logged",
        &[
            ("SERVICE_LOGGING__LEVEL", "warn"),
            ("SERVICE_SECURITY__ALLOW_PRIVATE_NETWORKS", "true"),
        ],
    )
    .await;
    let log_path = dir.join("sluice.log");
    let c = reqwest::Client::new();
    let admin = |method: &str, path: &str, body: serde_json::Value| {
        c.request(
            method.parse().unwrap(),
            format!("{base}/api/v1/admin{path}"),
        )
        .json(&body)
        .send()
    };
    admin(
        "POST",
        "/connectors",
        json!({"name": "dead", "connector_type": "http",
        "config": {"type": "http", "url": "http://127.0.0.1:9/", "retry": {"max_retries": 0}}}),
    )
    .await
    .unwrap();
    deploy_named(
        &base,
        "f",
        json!([{"id": "c", "name": "c", "function": {"name": "http_call", "input": {"connector": "dead"}}}]),
    )
    .await;
    let r = c
        .post(format!("{base}/api/v1/data/f"))
        .header("x-request-id", "0b6f7a52-3c1e-4f5a-9d7e-2a1b3c4d5e6f")
        .json(&json!({"data": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    // Request data inside an error message (a channel name from the
    // payload) stays on the failure's line: its line break is escaped.
    deploy_named(
        &base,
        "cc",
        json!([
            {"id": "say", "name": "say", "function": {"name": "log", "input": {"level": "warn", "message": {"var": "payload.n"}}}},
            {"id": "c", "name": "c", "function": {"name": "channel_call", "input": {"channel_logic": {"var": "payload.n"}}}}
        ]),
    )
    .await;
    let r = c
        .post(format!("{base}/api/v1/data/cc"))
        .json(&json!({"data": {"n": "zz\n2026-11-27T00:00:00Z ERROR FORGED line"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
    // A failure quoting the request's secrets (a credential header, the
    // payload's `password`) is logged without them, sync and async (audit
    // 83: the sync line showed them).
    deploy_named(
        &base,
        "sec",
        json!([{"id": "c", "name": "c", "function": {"name": "channel_call", "input": {"channel_logic":
            {"cat": ["to-", {"var": "metadata.headers.authorization"}, "-", {"var": "payload.login.password"}]}}}}]),
    )
    .await;
    for path in ["sec", "sec/async"] {
        let r = c
            .post(format!("{base}/api/v1/data/{path}"))
            .header("authorization", "Bearer hdrSecret77")
            .header("x-request-id", "7e8f9a0b-1c2d-4e3f-8a4b-5c6d7e8f9a0b")
            .json(&json!({"data": {"login": {"password": "paySecret88"}}}))
            .send()
            .await
            .unwrap();
        assert!(
            matches!(r.status().as_u16(), 500 | 202),
            "{path}: {}",
            r.status()
        );
    }
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&log_path).unwrap();
    for what in ["request failed", "trace failed"] {
        assert!(
            log.lines().any(|l| l.contains(what)
                && l.contains("to-******")
                && l.contains("7e8f9a0b-1c2d-4e3f-8a4b-5c6d7e8f9a0b")),
            "{what} quoting the secrets, masked, with the request id:\n{log}"
        );
    }
    for secret in ["hdrSecret77", "paySecret88"] {
        assert!(!log.contains(secret), "{secret} in the log:\n{log}");
    }
    assert!(
        !log.lines().any(|l| l.starts_with("2026-11-27T00:00:00Z")),
        "a forged line:\n{log}"
    );
    for what in ["request failed", "sluice::workflow"] {
        assert!(
            log.lines()
                .any(|l| l.contains(what) && l.contains("zz\\n2026-11-27T00:00:00Z ERROR FORGED")),
            "{what}:\n{log}"
        );
    }
    let line = log
        .lines()
        .find(|l| l.contains("request failed"))
        .unwrap_or_else(|| panic!("no failure logged:\n{log}"));
    assert!(
        line.contains("0b6f7a52-3c1e-4f5a-9d7e-2a1b3c4d5e6f")
            && line.contains("UPSTREAM_ERROR")
            && line.contains("channel=f ")
            && line.contains("Connection refused"),
        "{line}"
    );
    assert!(!log.contains('\u{1b}'), "colour codes in a file:\n{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// In JSON logs a `log` task's message is the text as written: the JSON
/// escapes its line breaks (the runtime's own escaping, for text logs,
/// turned `\n` into a literal backslash-n there).
#[tokio::test]
async fn a_log_message_is_written_as_is_in_json_logs() {
    let (mut child, base, dir) =
        serve_logging("jsonlog", &[("SERVICE_LOGGING__FORMAT", "json")]).await;
    deploy_named(
        &base,
        "l",
        json!([{"id": "say", "name": "say", "function": {"name": "log", "input": {"message": {"var": "payload.m"}}}}]),
    )
    .await;
    let c = reqwest::Client::new();
    let r = c
        .post(format!("{base}/api/v1/data/l"))
        .json(&json!({"data": {"m": "line one\nline two"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The same task in an async run logs under the request's id and the
    // trace's (audit 117: an async run's lines carried neither).
    let r = c
        .post(format!("{base}/api/v1/data/l/async"))
        .header("x-request-id", "5a6b7c8d-1e2f-4a3b-8c4d-5e6f7a8b9c0d")
        .json(&json!({"data": {"m": "in the background"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let trace_id = r.json::<serde_json::Value>().await.unwrap()["trace_id"]
        .as_str()
        .unwrap()
        .to_owned();
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(dir.join("sluice.log")).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("line one"))
        .unwrap_or_else(|| panic!("no log task line:\n{log}"));
    let entry: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(entry["fields"]["message"], "line one\nline two", "{line}");
    let line = log
        .lines()
        .find(|l| l.contains("in the background"))
        .unwrap_or_else(|| panic!("no async log task line:\n{log}"));
    let entry: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(
        (&entry["span"]["request_id"], &entry["span"]["trace_id"]),
        (
            &json!("5a6b7c8d-1e2f-4a3b-8c4d-5e6f7a8b9c0d"),
            &json!(trace_id)
        ),
        "{line}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// While start-up waits on its database, the port answers: `/healthz` 200,
/// `/readyz` and `/health` 503, anything else 503 with `Retry-After`.
/// Before, connections were accepted by the kernel and never answered, so
/// a probe with a short timeout failed instead of seeing "not ready".
#[tokio::test]
async fn probes_are_answered_while_starting() {
    use std::process::{Command, Stdio};
    crate::support::install_crypto();
    // A "database" that accepts connections and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let db_port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((sock, _)) = silent.accept().await {
            open.push(sock);
        }
    });
    let port = crate::support::free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("serve")
        .env("SERVICE_SERVER__PORT", port.to_string())
        .env(
            "SERVICE_STORAGE__URL",
            format!("postgres://postgres@127.0.0.1:{db_port}/x"),
        )
        .env("SERVICE_LOGGING__LEVEL", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let c = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(2))
        .build()
        .unwrap();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let healthz = loop {
        match c.get(format!("{base}/healthz")).send().await {
            Ok(r) => break r,
            Err(e) => {
                assert!(std::time::Instant::now() < until, "no answer: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(healthz.status(), 200);
    let ready = c.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let body: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(body["status"], "not_ready");
    let health = c.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status(), 503);
    let other = c
        .get(format!("{base}/api/v1/admin/workflows"))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 503);
    assert_eq!(other.headers()["retry-after"], "1");
    assert_eq!(other.headers()["x-content-type-options"], "nosniff");
    let body: serde_json::Value = other.json().await.unwrap();
    assert_eq!(body["error"]["code"], "SERVICE_UNAVAILABLE");
    let _ = child.kill();
    let _ = child.wait();
    held.abort();
}

/// A client that sends its whole over-limit body before it reads (most
/// do) gets the 413: the rest of the body is read and dropped first. Before,
/// the connection was closed with the body unread and reset under the
/// client, which saw a broken pipe instead of the answer.
#[tokio::test]
async fn an_oversized_body_sent_whole_still_gets_its_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = start(Db::Sqlite).await;
    let addr = s.base.trim_start_matches("http://").to_owned();
    // Over the 1 MiB limit (413), and under it with a refused type (415).
    for (content_type, size) in [("application/json", 12 << 20), ("text/plain", 1_000_000)] {
        let body = vec![b'x'; size];
        let mut sock = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head = format!(
            "POST /api/v1/data/anything HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        sock.write_all(head.as_bytes()).await.unwrap();
        sock.write_all(&body)
            .await
            .unwrap_or_else(|e| panic!("{content_type}: the body could not be sent whole: {e}"));
        let mut answer = vec![0u8; 512];
        let n = sock.read(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]).into_owned();
        let expected = if content_type == "application/json" {
            "413"
        } else {
            "415"
        };
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {expected}")),
            "{content_type}: {answer}"
        );
    }
}
