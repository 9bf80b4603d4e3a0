//! The admin plane over real HTTP, on SQLite, PostgreSQL and MariaDB.

use crate::on_every_backend;
use crate::support::*;
use serde_json::{Value as Json, json};

async fn workflow_lifecycle(db: Db) {
    let s = start(db).await;
    let created = s
        .admin("POST", "/workflows", Some(workflow("orders")))
        .await;
    let data = created.ok(201);
    assert_eq!(
        (data["version"].as_i64(), data["status"].as_str()),
        (Some(1), Some("draft"))
    );
    assert_eq!(data["rollout_percentage"], 100);
    assert!(data["created_at"].as_str().unwrap().ends_with('Z'));

    // Creating the same id again conflicts.
    s.admin("POST", "/workflows", Some(workflow("orders")))
        .await
        .error(409, "CONFLICT");

    // Drafts are editable.
    let mut edited = workflow("orders");
    edited["name"] = json!("renamed");
    assert_eq!(
        s.admin("PUT", "/workflows/orders", Some(edited.clone()))
            .await
            .ok(200)["name"],
        "renamed"
    );

    // A body id other than the path's is reported with every other
    // problem of the definition, each at its field.
    let mut wrong = workflow("other");
    wrong["name"] = json!("");
    let r = s.admin("PUT", "/workflows/orders", Some(wrong)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), vec!["workflow_id", "name"], "{}", r.text);
    assert_eq!(
        r.body["error"]["details"][0]["message"],
        "must equal the id in the path ('orders')"
    );

    // Activate; the active version is immutable.
    let active = s
        .admin(
            "PATCH",
            "/workflows/orders/status",
            Some(json!({"status": "active"})),
        )
        .await;
    assert_eq!(active.ok(200)["status"], "active");
    s.admin("PUT", "/workflows/orders", Some(edited.clone()))
        .await
        .error(409, "CONFLICT");
    s.admin(
        "PATCH",
        "/workflows/orders/status",
        Some(json!({"status": "active"})),
    )
    .await
    .error(409, "CONFLICT");

    // A new version is a draft copy; only one draft at a time.
    let v2 = s.admin("POST", "/workflows/orders/versions", None).await;
    assert_eq!(
        (
            v2.ok(201)["version"].as_i64(),
            v2.ok(201)["status"].as_str()
        ),
        (Some(2), Some("draft"))
    );
    s.admin("POST", "/workflows/orders/versions", None)
        .await
        .error(409, "CONFLICT");

    // Canary: v2 at 30% next to v1, then raised to 100% archives v1.
    let canary = s
        .admin(
            "PATCH",
            "/workflows/orders/status",
            Some(json!({"status": "active", "rollout_percentage": 30})),
        )
        .await;
    assert_eq!(canary.ok(200)["rollout_percentage"], 30);
    let versions = s.admin("GET", "/workflows/orders/versions", None).await;
    let statuses: Vec<_> = versions
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["status"].clone())
        .collect();
    assert_eq!(statuses, vec![json!("active"), json!("active")]);
    assert_eq!(versions.body["total"], 2);
    s.admin(
        "PATCH",
        "/workflows/orders/rollout",
        Some(json!({"rollout_percentage": 100})),
    )
    .await
    .ok(200);
    let versions = s.admin("GET", "/workflows/orders/versions", None).await;
    let statuses: Vec<_> = versions
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["status"].clone())
        .collect();
    // Newest first: v2 (active), then v1 (archived).
    assert_eq!(statuses, vec![json!("active"), json!("archived")]);

    // A partial rollback is a move the state table does not list: a
    // conflict with v1's state (archived), not a bad body (audit 81).
    let partial = s
        .admin(
            "PATCH",
            "/workflows/orders/status",
            Some(json!({"status": "active", "version": 1, "rollout_percentage": 30})),
        )
        .await;
    assert!(
        partial.error(409, "CONFLICT")["message"]
            .as_str()
            .unwrap()
            .contains("(rollback) always serves 100% of traffic"),
        "{}",
        partial.text
    );
    // Rollback: re-activating v1 makes it the only active version.
    let back = s
        .admin(
            "PATCH",
            "/workflows/orders/status",
            Some(json!({"status": "active", "version": 1})),
        )
        .await;
    assert_eq!(back.ok(200)["version"], 1);
    let versions = s.admin("GET", "/workflows/orders/versions", None).await;
    let statuses: Vec<_> = versions
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["status"].clone())
        .collect();
    // v2 archived, v1 active again.
    assert_eq!(statuses, vec![json!("archived"), json!("active")]);

    // Bad rollout values.
    let bad = s
        .admin(
            "PATCH",
            "/workflows/orders/rollout",
            Some(json!({"rollout_percentage": 0})),
        )
        .await;
    bad.error(400, "BAD_REQUEST");
    assert_eq!(bad.detail_fields(), vec!["rollout_percentage"]);

    // Archive, then delete everything.
    s.admin(
        "PATCH",
        "/workflows/orders/status",
        Some(json!({"status": "archived"})),
    )
    .await
    .ok(200);
    let deleted = s.admin("DELETE", "/workflows/orders", None).await;
    assert_eq!(deleted.status, 204);
    assert!(deleted.text.is_empty());
    let gone = s.admin("GET", "/workflows/orders", None).await;
    assert_eq!(
        gone.error(404, "NOT_FOUND")["message"],
        "Workflow with id 'orders' not found"
    );
    s.admin("DELETE", "/workflows/orders", None)
        .await
        .error(404, "NOT_FOUND");
}
on_every_backend!(
    workflow_lifecycle_follows_the_state_table,
    workflow_lifecycle
);

async fn lists_filter_and_page(db: Db) {
    let s = start(db).await;
    for i in 0..5 {
        let mut w = workflow(&format!("w{i}"));
        w["tags"] = json!([if i % 2 == 0 { "even" } else { "odd" }]);
        s.admin("POST", "/workflows", Some(w)).await.ok(201);
    }
    s.admin(
        "PATCH",
        "/workflows/w0/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    let all = s.admin("GET", "/workflows", None).await;
    assert_eq!(
        (
            all.body["total"].as_i64(),
            all.body["limit"].as_i64(),
            all.body["offset"].as_i64()
        ),
        (Some(5), Some(50), Some(0))
    );
    let even = s.admin("GET", "/workflows?tag=even", None).await;
    assert_eq!(even.body["total"], 3);
    let active = s.admin("GET", "/workflows?status=active", None).await;
    let ids: Vec<_> = active
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["workflow_id"].clone())
        .collect();
    assert_eq!(ids, vec![json!("w0")]);
    let page = s.admin("GET", "/workflows?limit=2&offset=1", None).await;
    assert_eq!(page.ok(200).as_array().unwrap().len(), 2);
    assert_eq!(page.body["total"], 5);
    s.admin("GET", "/workflows?limit=0", None)
        .await
        .error(400, "BAD_REQUEST");
    s.admin("GET", "/workflows?limit=1001", None)
        .await
        .error(400, "BAD_REQUEST");
    s.admin("GET", "/workflows?offset=-1", None)
        .await
        .error(400, "BAD_REQUEST");
    s.admin("GET", "/workflows?status=bogus", None)
        .await
        .error(400, "BAD_REQUEST");

    // Export gives definitions that import accepts unchanged (as new ids here).
    let exported = s.admin("GET", "/workflows/export?tag=odd", None).await;
    let defs = exported.ok(200).as_array().unwrap().clone();
    assert_eq!(defs.len(), 2);
    let dry = s
        .admin(
            "POST",
            "/workflows/import?dry_run=true",
            Some(Json::Array(defs.clone())),
        )
        .await;
    // A dry run reports the conflicts the import would meet.
    assert_eq!(dry.ok(200)["created"], json!([]));
    assert_eq!(dry.body["data"]["failed"].as_array().unwrap().len(), 2);
    // Re-importing the same ids conflicts per item; renamed ones are created.
    let mut renamed = defs.clone();
    for d in &mut renamed {
        let id = format!("{}-copy", d["workflow_id"].as_str().unwrap());
        d["workflow_id"] = json!(id);
    }
    renamed.push(json!({"name": ""}));
    let imported = s
        .admin("POST", "/workflows/import", Some(Json::Array(renamed)))
        .await;
    let data = imported.ok(200);
    assert_eq!(data["created"].as_array().unwrap().len(), 2);
    assert_eq!(data["failed"][0]["index"], 2);
    assert!(!data["failed"][0]["details"].as_array().unwrap().is_empty());
    assert_eq!(s.admin("GET", "/workflows", None).await.body["total"], 7);
}
on_every_backend!(lists_filter_page_export_and_import, lists_filter_and_page);

async fn validation_errors(db: Db) {
    let s = start(db).await;
    let bad = json!({
        "workflow_id": "-bad",
        "tasks": [
            {"id": "a", "name": "a", "function": {"name": "http_call", "input": {"method": "FETCH"}}},
            {"id": "a", "name": "b", "function": {"name": "Map", "input": {}}}
        ]
    });
    let resp = s.admin("POST", "/workflows", Some(bad.clone())).await;
    resp.error(400, "BAD_REQUEST");
    let fields = resp.detail_fields();
    for expected in [
        "workflow_id",
        "name",
        "tasks[0].function.input.connector",
        "tasks[0].function.input.method",
        "tasks[1].id",
        "tasks[1].function.name",
    ] {
        assert!(
            fields.iter().any(|f| f == expected),
            "{expected} missing from {fields:?}"
        );
    }
    let messages = resp.body["error"]["details"].as_array().unwrap();
    assert!(messages.iter().any(
        |d| d["field"] == "tasks[0].function.input.connector" && d["message"] == "is required"
    ));

    // The validate endpoint answers the same way, and 200 with warnings when valid.
    let v = s.admin("POST", "/workflows/validate", Some(bad)).await;
    v.error(400, "BAD_REQUEST");
    let ok = s
        .admin("POST", "/workflows/validate", Some(workflow("fine")))
        .await;
    assert_eq!(ok.ok(200)["valid"], true);
    assert!(ok.ok(200)["warnings"].as_array().unwrap().is_empty());
    let mut warned = workflow("warned");
    warned["tasks"][1]["function"]["input"] = json!({"mappings": 5});
    let w = s.admin("POST", "/workflows/validate", Some(warned)).await;
    assert_eq!(
        w.ok(200)["warnings"][0]["field"],
        "tasks[1].function.input.mappings"
    );
    // A credential header in an http_call is worth a warning: workflows
    // are shown unmasked (session 17).
    let mut creds = workflow("creds");
    creds["tasks"][1] = json!({"id": "call", "name": "call", "function": {"name": "http_call",
        "input": {"connector": "api", "path": "/x",
                  "headers": {"Authorization": "Bearer T0KEN", "Accept": "application/json"}}}});
    let w = s.admin("POST", "/workflows/validate", Some(creds)).await;
    let warnings = w.ok(200)["warnings"].as_array().unwrap().clone();
    // The credential, then the connector that does not exist (yet).
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert_eq!(warnings[1]["field"], "tasks[1].function.input.connector");
    assert_eq!(
        warnings[0]["field"],
        "tasks[1].function.input.headers.Authorization"
    );
    assert!(
        warnings[0]["message"]
            .as_str()
            .unwrap()
            .starts_with("looks like a credential")
    );

    // A JSONLogic error in a condition is a validation error with its path.
    let mut cond = workflow("cond");
    cond["condition"] = json!({"no_such_op": [1]});
    let c = s.admin("POST", "/workflows", Some(cond)).await;
    c.error(400, "BAD_REQUEST");
    assert_eq!(c.detail_fields(), vec!["condition"]);

    // Nothing was stored.
    assert_eq!(s.admin("GET", "/workflows", None).await.body["total"], 0);
}
on_every_backend!(
    create_reports_every_problem_with_its_path,
    validation_errors
);

async fn channels(db: Db) {
    let s = start(db).await;
    let created = s
        .admin("POST", "/channels", Some(channel("orders", "wf")))
        .await;
    assert_eq!(created.ok(201)["status"], "draft");
    let mut same_name = channel("other-id", "wf");
    same_name["name"] = json!("orders");
    s.admin("POST", "/channels", Some(same_name))
        .await
        .error(409, "CONFLICT");
    let mut kafka = channel("events", "wf");
    kafka["channel_type"] = json!("async");
    kafka["protocol"] = json!("kafka");
    kafka["config_json"] = json!({"topic": "events"});
    kafka.as_object_mut().unwrap().remove("route_pattern");
    kafka.as_object_mut().unwrap().remove("methods");
    s.admin("POST", "/channels", Some(kafka)).await.ok(201);
    let rest = s.admin("GET", "/channels?protocol=rest", None).await;
    assert_eq!(rest.body["total"], 1);
    let asyncs = s.admin("GET", "/channels?channel_type=async", None).await;
    assert_eq!(asyncs.ok(200)[0]["channel_id"], "events");
    // A filter value no channel can have is a 400, like a bad status.
    for q in ["protocol=grpc", "channel_type=batch", "status=bogus"] {
        s.admin("GET", &format!("/channels?{q}"), None)
            .await
            .error(400, "BAD_REQUEST");
    }

    let mut bad = channel("bad", "wf");
    bad["config_json"] =
        json!({"timeout_ms": -1, "rate_limit": {"requests_per_second": 0}, "surprise": 1});
    let resp = s.admin("POST", "/channels", Some(bad)).await;
    resp.error(400, "BAD_REQUEST");
    let fields = resp.detail_fields();
    assert!(
        fields.iter().any(|f| f == "config_json.timeout_ms"),
        "{fields:?}"
    );
    assert!(
        fields
            .iter()
            .any(|f| f == "config_json.rate_limit.requests_per_second"),
        "{fields:?}"
    );
    assert!(
        fields.iter().any(|f| f.starts_with("config_json.surprise")),
        "{fields:?}"
    );

    // A channel takes no rollout share: refused, not ignored.
    let shared = s
        .admin(
            "PATCH",
            "/channels/orders/status",
            Some(json!({"status": "active", "rollout_percentage": 50})),
        )
        .await;
    assert_eq!(
        shared.error(400, "BAD_REQUEST")["details"][0]["field"],
        "rollout_percentage"
    );
    s.admin(
        "PATCH",
        "/channels/orders/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    let status = s.admin("GET", "/engine/status", None).await;
    assert_eq!(status.ok(200)["channels"], json!(["orders"]));
    s.admin("POST", "/channels/orders/versions", None)
        .await
        .ok(201);
    s.admin("DELETE", "/channels/orders", None).await;
    assert_eq!(
        s.admin("GET", "/engine/status", None).await.ok(200)["channels"],
        json!([])
    );
    let gone = s.admin("GET", "/channels/orders", None).await;
    assert_eq!(
        gone.error(404, "NOT_FOUND")["message"],
        "Channel with id 'orders' not found"
    );
}
on_every_backend!(channels_share_the_lifecycle_and_names_are_unique, channels);

async fn connectors(db: Db) {
    let s = start(db).await;
    let def = json!({
        "name": "billing",
        "connector_type": "http",
        "config": {"type": "http", "url": "https://billing.example.com/api",
                   "auth": {"type": "bearer", "token": "s3cr3t-token"},
                   "headers": {"x-api-key": "k-123", "accept": "application/json"},
                   "retry": {"max_retries": 2, "retry_delay_ms": 50}}
    });
    let generation = |status: &Json| status["generation"].as_u64().unwrap();
    let before = generation(s.admin("GET", "/engine/status", None).await.ok(200));
    let created = s.admin("POST", "/connectors", Some(def.clone())).await;
    // The change moves the served generation on, on every backend (audit
    // 106: SQLite kept reporting the old one).
    assert_eq!(
        generation(s.admin("GET", "/engine/status", None).await.ok(200)),
        before + 1
    );
    let data = created.ok(201);
    assert_eq!(data["config"]["auth"]["token"], "******");
    assert_eq!(data["config"]["headers"]["x-api-key"], "******");
    assert_eq!(data["config"]["headers"]["accept"], "application/json");
    assert!(!created.text.contains("s3cr3t"));
    s.admin("POST", "/connectors", Some(def.clone()))
        .await
        .error(409, "CONFLICT");
    let listed = s.admin("GET", "/connectors", None).await;
    assert!(!listed.text.contains("s3cr3t") && !listed.text.contains("k-123"));
    assert_eq!(listed.body["total"], 1);

    let db_def = json!({"name": "orders-db", "connector_type": "db",
        "config": {"type": "db", "connection_string": "env://ORDERS_DB_URL", "query_timeout_ms": 500}});
    let got = s.admin("POST", "/connectors", Some(db_def)).await;
    // Masked anyway (the field is secret-named); never the resolved value.
    assert_eq!(got.ok(201)["config"]["connection_string"], "******");

    // Query credentials in any word spelling (`apiKey`, `access-token`).
    let maps = json!({"name": "maps", "connector_type": "http",
        "config": {"type": "http", "url": "https://maps.example.com/v1?apiKey=q-4567&region=eu&access-token=t-8910"}});
    let got = s.admin("POST", "/connectors", Some(maps)).await;
    assert_eq!(
        got.ok(201)["config"]["url"],
        "https://maps.example.com/v1?apiKey=******&region=eu&access-token=******"
    );

    // A name of the wrong type is a field error on PUT too (the path's
    // name used to replace it); left out, the path names it.
    for name in [json!(5), Json::Null] {
        let mut typed = def.clone();
        typed["name"] = name.clone();
        let r = s.admin("PUT", "/connectors/billing", Some(typed)).await;
        r.error(400, "BAD_REQUEST");
        assert_eq!(r.detail_fields(), vec!["name"], "{name}");
    }
    // Another name is reported with the other problems, not alone.
    let mut other = def.clone();
    other["name"] = json!("billing-2");
    other["config"]["url"] = json!("ftp://x");
    let r = s.admin("PUT", "/connectors/billing", Some(other)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), vec!["name", "config.url"], "{}", r.text);
    let mut updated = def.clone();
    updated["config"]["url"] = json!("https://billing2.example.com");
    updated.as_object_mut().unwrap().remove("name");
    let u = s.admin("PUT", "/connectors/billing", Some(updated)).await;
    assert_eq!(u.ok(200)["config"]["url"], "https://billing2.example.com");
    assert_eq!(
        s.admin("GET", "/connectors/billing", None).await.ok(200)["config"]["auth"]["token"],
        "******"
    );

    let bad = s
        .admin(
            "POST",
            "/connectors",
            Some(json!({"name": "x", "connector_type": "http", "config": {"type": "http"}})),
        )
        .await;
    bad.error(400, "BAD_REQUEST");
    assert!(
        bad.detail_fields().iter().any(|f| f == "config.url"),
        "{:?}",
        bad.detail_fields()
    );

    let imported = s
        .admin("POST", "/connectors/import?dry_run=true", Some(json!([{"name": "c1", "connector_type": "cache", "config": {"type": "cache", "backend": "memory"}}])))
        .await;
    assert_eq!(imported.ok(200)["created"], json!(["c1"]));
    s.admin("GET", "/connectors/c1", None)
        .await
        .error(404, "NOT_FOUND");
    assert_eq!(
        s.admin("DELETE", "/connectors/billing", None).await.status,
        204
    );
    let gone = s.admin("GET", "/connectors/billing", None).await;
    assert_eq!(
        gone.error(404, "NOT_FOUND")["message"],
        "Connector with id 'billing' not found"
    );
}
on_every_backend!(connectors_validate_and_mask_secrets, connectors);

async fn audit_and_backups(db: Db) {
    let s = start(db).await;
    s.admin("POST", "/workflows", Some(workflow("a")))
        .await
        .ok(201);
    s.admin(
        "PATCH",
        "/workflows/a/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    // A failed change writes no audit entry.
    s.admin("PUT", "/workflows/a", Some(workflow("a")))
        .await
        .error(409, "CONFLICT");
    let log = s
        .admin("GET", "/audit-logs?resource_type=workflow", None)
        .await;
    let actions: Vec<_> = log
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].clone())
        .collect();
    assert_eq!(actions, vec![json!("activate"), json!("create")]);
    let entry = &log.ok(200)[0];
    assert_eq!(
        (entry["principal"].as_str(), entry["resource_id"].as_str()),
        (Some("anonymous"), Some("a"))
    );
    let reloads = s.admin("GET", "/audit-logs?action=reload", None).await;
    assert_eq!(reloads.ok(200)[0]["resource_type"], "engine");
    // Pausing is recorded as an update (the documented actions have no
    // `pause`), its details naming the new status.
    s.admin(
        "PATCH",
        "/workflows/a/status",
        Some(json!({"status": "paused"})),
    )
    .await
    .ok(200);
    let last = s
        .admin("GET", "/audit-logs?resource_type=workflow&limit=1", None)
        .await;
    let last = &last.ok(200)[0];
    assert_eq!(
        (&last["action"], &last["details"]["status"]),
        (&json!("update"), &json!("paused"))
    );
    // A connector reload is audited too.
    s.admin("POST", "/connectors/reload", None).await.ok(200);
    let reloads = s
        .admin("GET", "/audit-logs?action=reload&limit=1", None)
        .await;
    // `resource_type: engine` as for every reload (shared decisions); the
    // id names the connectors (audit 98).
    assert_eq!(
        (
            &reloads.ok(200)[0]["resource_type"],
            &reloads.ok(200)[0]["resource_id"],
            &reloads.ok(200)[0]["details"]["connectors"]
        ),
        (&json!("engine"), &json!("connectors"), &json!(0))
    );
    // With the generation it made, as an engine reload's entry has.
    let status = s.admin("GET", "/engine/status", None).await;
    assert_eq!(
        reloads.ok(200)[0]["details"]["generation"],
        status.ok(200)["generation"]
    );
    // The closed filters refuse what no entry can hold, as `status` does;
    // `resource_id` narrows to one resource.
    for (query, message) in [
        (
            "action=bogus",
            "action must be one of create, update, delete",
        ),
        ("action=create%20", "action must be one of"),
        (
            "resource_type=bogus",
            "resource_type must be one of workflow, channel",
        ),
        // No entry has it since connector reloads became `engine` ones
        // (audit 116: it was accepted and matched nothing).
        (
            "resource_type=connectors",
            "resource_type must be one of workflow, channel, connector, engine",
        ),
    ] {
        let r = s.admin("GET", &format!("/audit-logs?{query}"), None).await;
        let e = r.error(400, "BAD_REQUEST");
        assert!(
            e["message"].as_str().unwrap().starts_with(message),
            "{query}: {e}"
        );
    }
    let by_id = s
        .admin("GET", "/audit-logs?resource_id=connectors", None)
        .await;
    let entries = by_id.ok(200);
    assert!(
        !entries.as_array().unwrap().is_empty()
            && entries
                .as_array()
                .unwrap()
                .iter()
                .all(|e| e["resource_id"] == "connectors"),
        "{entries}"
    );
    let spaced = s
        .admin("GET", "/audit-logs?resource_id=connectors%20", None)
        .await;
    assert_eq!(spaced.ok(200), &json!([]));

    let backup = s.admin("POST", "/backups", None).await;
    match db {
        Db::Sqlite => {
            let entry = backup.ok(201);
            let name = entry["filename"].as_str().unwrap();
            assert!(
                name.starts_with("sluice_backup_") && name.ends_with("Z.db"),
                "{name}"
            );
            assert!(entry["size_bytes"].as_u64().unwrap() > 0);
            let listed = s.admin("GET", "/backups", None).await;
            assert_eq!(listed.ok(200)[0]["filename"], name);
            // A list like every other: paged, with its total.
            assert_eq!(
                (&listed.body["total"], &listed.body["limit"]),
                (&json!(1), &json!(50))
            );
            let past = s.admin("GET", "/backups?offset=1", None).await;
            assert_eq!(past.ok(200), &json!([]));
            s.admin("GET", "/backups?limit=0", None)
                .await
                .error(400, "BAD_REQUEST");
            let logged = s.admin("GET", "/audit-logs?action=backup", None).await;
            assert_eq!(logged.ok(200)[0]["resource_id"], name);
        }
        _ => {
            // Creating and listing alike: "the endpoint answers 400".
            let created = backup.error(400, "BAD_REQUEST")["message"].clone();
            let listed = s.admin("GET", "/backups", None).await;
            assert_eq!(listed.error(400, "BAD_REQUEST")["message"], created);
        }
    }
}
on_every_backend!(audit_entries_and_backups, audit_and_backups);

/// A backup directory that cannot be used is named in the 500, with the
/// setting to fix (it said "storage error; see the service log").
#[tokio::test]
async fn an_unusable_backup_directory_is_named() {
    let s = start_with(Db::Sqlite, |c| {
        c.storage.backup_dir = "/dev/null/backups".into();
    })
    .await;
    for method in ["POST", "GET"] {
        let r = s.admin(method, "/backups", None).await;
        let message = r.error(500, "INTERNAL_ERROR")["message"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            message.contains("/dev/null/backups") && message.contains("storage.backup_dir"),
            "{method}: {message}"
        );
    }
}

async fn concurrent_lifecycle(db: Db) {
    let s = start(db).await;
    s.admin("POST", "/workflows", Some(workflow("race")))
        .await
        .ok(201);
    s.admin(
        "PATCH",
        "/workflows/race/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    let attempts: Vec<_> = (0..20)
        .map(|_| s.admin("POST", "/workflows/race/versions", None))
        .collect();
    let results = futures_util::future::join_all(attempts).await;
    let created = results.iter().filter(|r| r.status == 201).count();
    assert_eq!(
        created,
        1,
        "{:?}",
        results
            .iter()
            .map(|r| (r.status, r.text.clone()))
            .collect::<Vec<_>>()
    );
    assert!(
        results.iter().all(|r| r.status == 201 || r.status == 409),
        "only conflicts besides the one draft"
    );
    let versions = s.admin("GET", "/workflows/race/versions", None).await;
    let drafts = versions
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["status"] == "draft")
        .count();
    assert_eq!(drafts, 1);

    // Parallel activations of the draft: exactly one active version at 100%.
    let attempts: Vec<_> = (0..10)
        .map(|_| {
            s.admin(
                "PATCH",
                "/workflows/race/status",
                Some(json!({"status": "active"})),
            )
        })
        .collect();
    let results = futures_util::future::join_all(attempts).await;
    assert!(
        results.iter().all(|r| r.status == 200 || r.status == 409),
        "{:?}",
        results.iter().map(|r| &r.text).collect::<Vec<_>>()
    );
    let versions = s.admin("GET", "/workflows/race/versions", None).await;
    let active: Vec<_> = versions
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["status"] == "active")
        .cloned()
        .collect();
    assert_eq!(active.len(), 1, "{active:?}");
    assert_eq!(active[0]["rollout_percentage"], 100);
}
on_every_backend!(
    concurrent_lifecycle_requests_keep_the_rules,
    concurrent_lifecycle
);

#[tokio::test]
async fn functions_lists_connector_and_composition_functions_only() {
    let s = start(Db::Sqlite).await;
    let f = s.admin("GET", "/functions", None).await;
    let names: Vec<_> = f
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names.len(), 8, "{names:?}");
    // Paged like every list.
    assert_eq!(
        (&f.body["total"], &f.body["limit"], &f.body["offset"]),
        (&json!(8), &json!(50), &json!(0))
    );
    let second = s.admin("GET", "/functions?limit=1&offset=1", None).await;
    assert_eq!(second.ok(200)[0]["name"], json!(names[1]));
    s.admin("GET", "/functions?limit=0", None)
        .await
        .error(400, "BAD_REQUEST");
    for n in [
        "http_call",
        "db_read",
        "db_write",
        "cache_read",
        "cache_write",
        "mongo_read",
        "publish_kafka",
        "channel_call",
    ] {
        assert!(names.iter().any(|x| x == n), "{n}");
    }
    let http = f
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "http_call")
        .unwrap()
        .clone();
    let connector = http["fields"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "connector")
        .unwrap()
        .clone();
    assert_eq!(
        (connector["required"].as_bool(), connector["type"].as_str()),
        (Some(true), Some("string"))
    );
    assert!(connector["description"].is_string() && connector["category"].is_string());
}

#[tokio::test]
async fn engine_status_and_reload() {
    let s = start(Db::Sqlite).await;
    s.deploy(workflow("w"), channel("c", "w")).await;
    let status = s.admin("GET", "/engine/status", None).await;
    let data = status.ok(200);
    assert_eq!(
        (
            data["workflows_count"].as_i64(),
            data["active_workflows"].as_i64()
        ),
        (Some(1), Some(1))
    );
    assert!(data["uptime_seconds"].is_u64() && data["version"].is_string());
    let reload = s.admin("POST", "/engine/reload", None).await;
    assert_eq!(reload.ok(200)["channels"], 1);
}

#[tokio::test]
async fn admin_auth_keys_and_roles() {
    let s = start_with(Db::Sqlite, |c| {
        c.admin_auth.enabled = true;
        c.admin_auth.api_key = "full-key".into();
        c.admin_auth.read_only_api_key = "ro-key".into();
    })
    .await;
    let missing = s.send("GET", "/api/v1/admin/workflows", None, &[]).await;
    missing.error(401, "UNAUTHORIZED");
    // RFC 9110: a 401 names the scheme it wants.
    assert_eq!(
        missing.headers["www-authenticate"],
        "Bearer realm=\"sluice-admin\""
    );
    s.send(
        "GET",
        "/api/v1/admin/workflows",
        None,
        &[("authorization", "Bearer nope")],
    )
    .await
    .error(401, "UNAUTHORIZED");
    s.send(
        "GET",
        "/api/v1/admin/workflows",
        None,
        &[("authorization", "Bearer ro-key")],
    )
    .await
    .ok(200);
    // The scheme is case-insensitive; another scheme is named as the problem.
    s.send(
        "GET",
        "/api/v1/admin/workflows",
        None,
        &[("authorization", "BEARER ro-key")],
    )
    .await
    .ok(200);
    let basic = s
        .send(
            "GET",
            "/api/v1/admin/workflows",
            None,
            &[("authorization", "Basic full-key")],
        )
        .await;
    assert!(
        basic.error(401, "UNAUTHORIZED")["message"]
            .as_str()
            .unwrap()
            .contains("must use the Bearer scheme"),
        "{}",
        basic.text
    );
    // A Bearer scheme with no token says so.
    let empty = s
        .send(
            "GET",
            "/api/v1/admin/workflows",
            None,
            &[("authorization", "Bearer ")],
        )
        .await;
    assert!(
        empty.error(401, "UNAUTHORIZED")["message"]
            .as_str()
            .unwrap()
            .contains("the Bearer token is empty"),
        "{}",
        empty.text
    );
    // The OpenAPI document (public) says which operations want a key.
    let spec = s.get("/api/v1/openapi.json").await.body;
    assert_eq!(
        spec["paths"]["/api/v1/admin/workflows"]["post"]["security"],
        json!([{"bearer": []}, {"apiKey": []}])
    );
    assert!(spec["paths"]["/metrics"]["get"]["security"].is_array());
    assert!(spec["paths"]["/health"]["get"].get("security").is_none());
    assert_eq!(
        spec["components"]["securitySchemes"]["apiKey"]["name"],
        "X-API-Key"
    );
    s.send(
        "POST",
        "/api/v1/admin/workflows",
        Some(workflow("x")),
        &[("authorization", "Bearer ro-key")],
    )
    .await
    .error(403, "FORBIDDEN");
    s.send(
        "POST",
        "/api/v1/admin/workflows",
        Some(workflow("x")),
        &[("x-api-key", "full-key")],
    )
    .await
    .ok(201);
    // Both forms at once: each must hold (a wrong key in either was
    // ignored when the other was right), and the lesser role applies.
    for headers in [
        [("x-api-key", "wrong"), ("authorization", "Bearer full-key")],
        [("x-api-key", "full-key"), ("authorization", "Bearer wrong")],
        [("x-api-key", "full-key"), ("authorization", "Bearer ")],
        [
            ("x-api-key", "full-key"),
            ("authorization", "Basic Zm9vOmJhcg=="),
        ],
        [("x-api-key", "full-key"), ("authorization", "ro-key")],
    ] {
        s.send("GET", "/api/v1/admin/workflows", None, &headers)
            .await
            .error(401, "UNAUTHORIZED");
    }
    s.send(
        "POST",
        "/api/v1/admin/engine/reload",
        None,
        &[
            ("x-api-key", "ro-key"),
            ("authorization", "Bearer full-key"),
        ],
    )
    .await
    .error(403, "FORBIDDEN");
    let log = s
        .send(
            "GET",
            "/api/v1/admin/audit-logs?action=create",
            None,
            &[("authorization", "Bearer full-key")],
        )
        .await;
    assert_eq!(log.ok(200)[0]["principal"], "admin");
    assert!(!log.text.contains("full-key"));
    // Credentials are judged before the body: no 415 or 413 for a caller who
    // may not send one.
    let form = s
        .raw(
            "POST",
            "/api/v1/admin/workflows",
            b"x=1".to_vec(),
            Some("text/plain"),
        )
        .await;
    form.error(401, "UNAUTHORIZED");
    let huge = s
        .raw(
            "POST",
            "/api/v1/admin/workflows",
            vec![b' '; 2 << 20],
            Some("application/json"),
        )
        .await;
    huge.error(401, "UNAUTHORIZED");
    let r = s
        .send(
            "POST",
            "/api/v1/admin/engine/reload",
            None,
            &[("authorization", "Bearer ro-key")],
        )
        .await;
    r.error(403, "FORBIDDEN");
    // The data plane and health endpoints are not protected.
    assert_eq!(s.get("/healthz").await.status, 200);
}

/// A workflow answering `{greeting: "<word> <payload.name>"}`.
fn greeter(id: &str, word: &str) -> Json {
    json!({"workflow_id": id, "name": format!("greeter {id}"), "tasks": [
        {"id": "greet", "name": "Greet", "function": {"name": "map", "input": {"mappings": [
            {"path": "greeting", "logic": {"cat": [word, " ", {"var": "payload.name"}]}}]}}}]})
}

async fn greeting(s: &TestServer) -> Json {
    let r = s
        .post("/api/v1/data/rc/1", json!({"data": {"name": "Ada"}}))
        .await;
    r.ok(200)["greeting"].clone()
}

/// Reloads read only the definitions whose stamp (timestamps, digest)
/// changed: every admin path that changes what is served must still be
/// served right after it, and an explicit reload must change nothing.
async fn reloads_follow_every_admin_change(db: Db) {
    let s = start(db).await;
    s.deploy(greeter("rw", "hello"), channel("rc", "rw")).await;
    assert_eq!(greeting(&s).await, "hello Ada");
    // A new version, edited, activated.
    s.admin("POST", "/workflows/rw/versions", None)
        .await
        .ok(201);
    s.admin("PUT", "/workflows/rw", Some(greeter("rw", "bye")))
        .await
        .ok(200);
    assert_eq!(greeting(&s).await, "hello Ada", "a draft is not served");
    let status = |body: Json| s.admin("PATCH", "/workflows/rw/status", Some(body));
    status(json!({"status": "active"})).await.ok(200);
    assert_eq!(greeting(&s).await, "bye Ada");
    // Rollback to version 1.
    status(json!({"status": "active", "version": 1}))
        .await
        .ok(200);
    assert_eq!(greeting(&s).await, "hello Ada");
    // Deleted while active, imported again under the same id (version 1
    // again, another definition), activated.
    assert_eq!(s.admin("DELETE", "/workflows/rw", None).await.status, 204);
    let imported = s
        .admin(
            "POST",
            "/workflows/import",
            Some(json!([greeter("rw", "again")])),
        )
        .await;
    assert_eq!(imported.ok(200)["created"], json!(["rw"]));
    status(json!({"status": "active"})).await.ok(200);
    assert_eq!(greeting(&s).await, "again Ada");
    // An explicit reload compiles nothing and serves the same.
    let reload = s.admin("POST", "/engine/reload", None).await;
    assert_eq!(reload.ok(200)["compiled"], 0);
    assert_eq!(greeting(&s).await, "again Ada");
    // The channel: a new version routed elsewhere.
    s.admin("POST", "/channels/rc/versions", None).await.ok(201);
    let mut moved = channel("rc", "rw");
    moved["route_pattern"] = json!("/moved/{item}");
    s.admin("PUT", "/channels/rc", Some(moved)).await.ok(200);
    s.admin(
        "PATCH",
        "/channels/rc/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    let r = s
        .post("/api/v1/data/moved/1", json!({"data": {"name": "Ada"}}))
        .await;
    assert_eq!(r.ok(200)["greeting"], "again Ada");
    let r = s
        .post("/api/v1/data/rc/1", json!({"data": {"name": "Ada"}}))
        .await;
    assert_eq!(r.status, 404, "{}", r.text);
}

on_every_backend!(
    reloads_follow_every_admin_change_on_every_backend,
    reloads_follow_every_admin_change
);

/// An id of the wrong type is reported like every other field error, never
/// replaced by a generated one; ids that name an endpoint are refused.
#[tokio::test]
async fn ids_are_checked_not_replaced() {
    let s = start(Db::Sqlite).await;
    for bad in [json!(5), json!(null), json!(["x"])] {
        let mut w = workflow("ignored");
        w["workflow_id"] = bad.clone();
        let r = s.admin("POST", "/workflows", Some(w.clone())).await;
        r.error(400, "BAD_REQUEST");
        assert_eq!(r.detail_fields(), ["workflow_id"], "{}", r.text);
        let r = s.admin("POST", "/workflows/import", Some(json!([w]))).await;
        assert_eq!(r.ok(200)["created"], json!([]), "{}", r.text);
        assert_eq!(
            r.body["data"]["failed"][0]["details"][0]["field"],
            "workflow_id"
        );
        let mut c = channel("ignored", "w");
        c["channel_id"] = bad;
        let r = s.admin("POST", "/channels", Some(c)).await;
        r.error(400, "BAD_REQUEST");
        assert_eq!(r.detail_fields(), ["channel_id"], "{}", r.text);
    }
    assert_eq!(s.admin("GET", "/workflows", None).await.ok(200), &json!([]));
    // PUT with a wrong-typed id in the body is refused too.
    s.admin("POST", "/workflows", Some(workflow("d")))
        .await
        .ok(201);
    let mut w = workflow("d");
    w["workflow_id"] = json!(5);
    let r = s.admin("PUT", "/workflows/d", Some(w)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["workflow_id"]);
    // A different id given in the engine schema's spelling is reported
    // where the client wrote it.
    let mut w = workflow("d");
    w.as_object_mut().unwrap().remove("workflow_id");
    w["id"] = json!("zzz");
    let r = s.admin("PUT", "/workflows/d", Some(w)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["id"], "{}", r.text);

    for id in ["export", "import", "validate"] {
        let r = s.admin("POST", "/workflows", Some(workflow(id))).await;
        r.error(400, "BAD_REQUEST");
        assert_eq!(r.detail_fields(), ["workflow_id"], "{}", r.text);
    }
    let r = s
        .admin("POST", "/channels", Some(channel("import", "d")))
        .await;
    assert_eq!(r.detail_fields(), ["channel_id"], "{}", r.text);
    for name in ["import", "reload", "circuit-breakers"] {
        let def = json!({"name": name, "connector_type": "http",
                         "config": {"type": "http", "url": "https://example.com"}});
        let r = s.admin("POST", "/connectors", Some(def)).await;
        r.error(400, "BAD_REQUEST");
        assert_eq!(r.detail_fields(), ["name"], "{}", r.text);
    }
}

/// A dry-run import answers what the import would, conflicts included, and
/// writes nothing; `dry_run` takes only a boolean; an export's own answer is
/// accepted as an import body.
#[tokio::test]
async fn dry_run_imports_predict_the_import() {
    let s = start(Db::Sqlite).await;
    s.admin("POST", "/workflows", Some(workflow("taken")))
        .await
        .ok(201);
    let batch = json!([workflow("taken"), workflow("fresh"), workflow("fresh")]);
    let dry = s
        .admin(
            "POST",
            "/workflows/import?dry_run=true",
            Some(batch.clone()),
        )
        .await;
    let dry = dry.ok(200).clone();
    assert_eq!(dry["dry_run"], true);
    assert_eq!(dry["created"], json!(["fresh"]));
    let failed: Vec<_> = dry["failed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["index"].clone())
        .collect();
    assert_eq!(failed, [json!(0), json!(2)]);
    assert_eq!(
        dry["failed"][0]["details"][0]["message"],
        "workflow 'taken' already exists"
    );
    assert_eq!(s.admin("GET", "/workflows", None).await.body["total"], 1);
    let real = s
        .admin("POST", "/workflows/import", Some(batch.clone()))
        .await;
    let real = real.ok(200).clone();
    assert_eq!(
        (
            real["created"].clone(),
            real["failed"].as_array().unwrap().len()
        ),
        (dry["created"].clone(), 2)
    );
    assert_eq!(real["dry_run"], false);

    for bad in ["1x", "yes", "TRUE", "true&dry_run=false"] {
        s.admin(
            "POST",
            &format!("/workflows/import?dry_run={bad}"),
            Some(json!([workflow("other")])),
        )
        .await
        .error(400, "BAD_REQUEST");
    }
    // A repeated parameter is refused by name, on lists and trace reads too;
    // one the service does not read (a client's cache buster) is ignored.
    s.admin("GET", "/workflows?_=1&_=2", None).await.ok(200);
    for (path, name) in [
        ("/api/v1/admin/workflows?tag=a&limit=5&tag=b", "tag"),
        (
            "/api/v1/data/traces?status=failed&status=completed",
            "status",
        ),
        (
            "/api/v1/data/traces/00000000-0000-4000-8000-000000000000?mode=a&m%6Fde=b",
            "mode",
        ),
    ] {
        let r = s.call("GET", path, None).await;
        assert_eq!(
            r.error(400, "BAD_REQUEST")["message"],
            format!("query parameter '{name}' is given more than once")
        );
    }
    let one = s
        .admin(
            "POST",
            "/workflows/import?dry_run=1",
            Some(json!([workflow("other")])),
        )
        .await;
    assert_eq!(one.ok(200)["created"], json!(["other"]));
    s.admin("GET", "/workflows/other", None)
        .await
        .error(404, "NOT_FOUND");

    // Channels: an existing name is a conflict on `name`, dry or not.
    s.admin("POST", "/channels", Some(channel("c1", "taken")))
        .await
        .ok(201);
    let mut same_name = channel("c2", "taken");
    same_name["name"] = json!("c1");
    for path in ["/channels/import?dry_run=true", "/channels/import"] {
        let r = s
            .admin("POST", path, Some(json!([same_name.clone()])))
            .await;
        let failed = &r.ok(200)["failed"][0]["details"][0];
        assert_eq!(failed["field"], "name", "{path}: {}", r.text);
        assert_eq!(failed["message"], "a channel named 'c1' already exists");
    }

    // Connectors: an existing name and a repeat inside the batch.
    let conn = |name: &str| {
        json!({"name": name, "connector_type": "http",
                                   "config": {"type": "http", "url": "https://example.com"}})
    };
    s.admin("POST", "/connectors", Some(conn("api")))
        .await
        .ok(201);
    let r = s
        .admin(
            "POST",
            "/connectors/import?dry_run=true",
            Some(json!([conn("api"), conn("b"), conn("b")])),
        )
        .await;
    assert_eq!(r.ok(200)["created"], json!(["b"]));
    assert_eq!(r.body["data"]["failed"].as_array().unwrap().len(), 2);
    // Keys a connector's type does not read are warnings, on create,
    // update and import (audit 67: a misspelt `query_timeout` was stored
    // and the default used without a word).
    let typo = json!({"name": "slow", "connector_type": "db", "comment": "x", "$schema": "../schemas/connector.json",
        "config": {"type": "db", "connection_string": "sqlite::memory:", "query_timeout": 500}});
    let expected = json!([
        {"field": "comment", "message": "unknown field, ignored; expected one of name, connector_type, config, description, created_at, updated_at, $schema"},
        {"field": "config.query_timeout", "message": "unknown field, ignored; expected one of type, retry, connection_string, max_connections, query_timeout_ms, connect_timeout_ms"}
    ]);
    let r = s.admin("POST", "/connectors", Some(typo.clone())).await;
    r.ok(201);
    assert_eq!(r.body["warnings"], expected, "{}", r.text);
    let r = s.admin("PUT", "/connectors/slow", Some(typo.clone())).await;
    r.ok(200);
    assert_eq!(r.body["warnings"], expected, "{}", r.text);
    let mut other = typo.clone();
    other["name"] = json!("slow2");
    let r = s
        .admin(
            "POST",
            "/connectors/import?dry_run=true",
            Some(json!([conn("c"), other])),
        )
        .await;
    assert_eq!(
        r.ok(200)["warnings"],
        json!([{"index": 1, "details": expected}]),
        "{}",
        r.text
    );
    let r = s.admin("POST", "/connectors", Some(conn("clean"))).await;
    r.ok(201);
    assert!(r.body.get("warnings").is_none(), "{}", r.text);
    // A literal address the SSRF guard refuses: every call would fail.
    let local = json!({"name": "local", "connector_type": "http",
        "config": {"type": "http", "url": "http://127.0.0.1:9/"}});
    let r = s.admin("POST", "/connectors", Some(local)).await;
    r.ok(201);
    assert_eq!(r.body["warnings"][0]["field"], "config.url", "{}", r.text);
    assert!(
        r.body["warnings"][0]["message"]
            .as_str()
            .unwrap()
            .ends_with("every call fails while security.allow_private_networks is false"),
        "{}",
        r.text
    );
    // An `env://` URL is resolved when the connector is built: nothing to
    // judge here (it warned "refused to call a env: URL").
    let from_env = json!({"name": "from-env", "connector_type": "http",
        "config": {"type": "http", "url": "env://SLUICE_TEST_UNSET_URL"}});
    let r = s.admin("POST", "/connectors", Some(from_env)).await;
    r.ok(201);
    assert!(r.body.get("warnings").is_none(), "{}", r.text);
    s.admin("GET", "/connectors/b", None)
        .await
        .error(404, "NOT_FOUND");

    // The export's answer, as it came, imports into a fresh service.
    let exported = s.admin("GET", "/workflows/export", None).await;
    exported.ok(200);
    let other = start(Db::Sqlite).await;
    let r = other
        .admin("POST", "/workflows/import", Some(exported.body.clone()))
        .await;
    let mut created: Vec<String> = r.ok(200)["created"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    created.sort();
    assert_eq!(created, ["fresh", "taken"]);
}

/// Answers show the documented defaults of fields left out, the list filters
/// see the same effective values, and version history is newest first.
async fn defaults_and_history(db: Db) {
    let s = start(db).await;
    let w = json!({"workflow_id": "bare", "name": "bare",
                   "tasks": [{"id": "a", "name": "a", "function": {"name": "log", "input": {"message": "m"}}}]});
    let got = s.admin("POST", "/workflows", Some(w)).await;
    let data = got.ok(201);
    assert_eq!(
        (
            &data["priority"],
            &data["tags"],
            &data["continue_on_error"],
            &data["condition"]
        ),
        (&json!(0), &json!([]), &json!(false), &json!(true))
    );
    // Named by route pattern: rest; by name only: http. Both sync.
    let rest = json!({"channel_id": "r", "name": "r", "workflow_id": "bare",
                      "route_pattern": "/r/{id}", "methods": ["GET"]});
    let named = json!({"channel_id": "n", "name": "n", "workflow_id": "bare"});
    let r = s.admin("POST", "/channels", Some(rest)).await;
    let data = r.ok(201);
    assert_eq!(
        (&data["protocol"], &data["channel_type"]),
        (&json!("rest"), &json!("sync"))
    );
    assert_eq!(data["config_json"]["timeout_ms"], 30000);
    let n = s.admin("POST", "/channels", Some(named)).await;
    assert_eq!(n.ok(201)["protocol"], "http");
    let ids = |r: &Resp| -> Vec<String> {
        r.body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["channel_id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        ids(&s.admin("GET", "/channels?protocol=rest", None).await),
        ["r"]
    );
    assert_eq!(
        ids(&s.admin("GET", "/channels?protocol=http", None).await),
        ["n"]
    );
    assert_eq!(
        ids(&s.admin("GET", "/channels?channel_type=sync", None).await).len(),
        2
    );

    // Version history: newest first, paged.
    s.admin(
        "PATCH",
        "/workflows/bare/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    s.admin("POST", "/workflows/bare/versions", None)
        .await
        .ok(201);
    let v = s.admin("GET", "/workflows/bare/versions", None).await;
    let versions: Vec<_> = v
        .ok(200)
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["version"].clone())
        .collect();
    assert_eq!(versions, [json!(2), json!(1)]);
    assert_eq!(
        s.admin("GET", "/workflows/bare/versions?limit=1", None)
            .await
            .ok(200)[0]["version"],
        2
    );
}

on_every_backend!(
    answers_show_defaults_and_history_is_newest_first,
    defaults_and_history
);

/// A 405 says which methods the path takes, HEAD included wherever GET is
/// (HEAD reads like GET; until session 17 `Allow` left it out).
#[tokio::test]
async fn method_not_allowed_names_the_allowed_methods() {
    let s = start(Db::Sqlite).await;
    for (method, path, allow) in [
        ("DELETE", "/api/v1/admin/workflows", "GET, HEAD, POST"),
        (
            "PATCH",
            "/api/v1/admin/workflows/x",
            "GET, HEAD, PUT, DELETE",
        ),
        ("GET", "/api/v1/admin/workflows/import", "POST"),
        ("POST", "/api/v1/admin/engine/status", "GET, HEAD"),
        ("PUT", "/api/v1/data/traces", "GET, HEAD"),
    ] {
        let r = s.call(method, path, None).await;
        r.error(405, "METHOD_NOT_ALLOWED");
        assert_eq!(
            r.headers.get("allow").and_then(|v| v.to_str().ok()),
            Some(allow),
            "{method} {path}"
        );
    }
    let head = s.call("HEAD", "/api/v1/admin/workflows", None).await;
    assert_eq!(head.status, 200);
}

/// `config.type` may be left out; answers show it equal to `connector_type`
/// (config's other members after it, in their order), and the answer sent
/// back is accepted as it is.
#[tokio::test]
async fn connector_config_type_is_shown_when_left_out() {
    let s = start(Db::Sqlite).await;
    let def = json!({"name": "plain", "connector_type": "cache",
        "config": {"backend": "memory", "max_entries": 10}});
    let created = s.admin("POST", "/connectors", Some(def)).await;
    assert_eq!(
        created.ok(201)["config"],
        json!({"type": "cache", "backend": "memory", "max_entries": 10})
    );
    let shown = s
        .admin("GET", "/connectors/plain", None)
        .await
        .ok(200)
        .clone();
    assert_eq!(
        serde_json::to_string(&shown["config"]).unwrap(),
        r#"{"type":"cache","backend":"memory","max_entries":10}"#
    );
    s.admin("PUT", "/connectors/plain", Some(shown))
        .await
        .ok(200);
    let listed = s.admin("GET", "/connectors", None).await;
    assert_eq!(listed.ok(200)[0]["config"]["type"], "cache");
}

/// A definition read back (secrets shown as `******`) and sent back with
/// another change keeps the stored secrets; a new secret replaces them.
#[tokio::test]
async fn connector_round_trip_keeps_masked_secrets() {
    let s = start(Db::Sqlite).await;
    let def = json!({"name": "billing", "connector_type": "http",
        "config": {"type": "http", "url": "https://billing.example.com",
                   "auth": {"type": "bearer", "token": "s3cr3t"},
                   "headers": {"x-api-key": "k-1"}}});
    s.admin("POST", "/connectors", Some(def)).await.ok(201);
    let mut shown = s
        .admin("GET", "/connectors/billing", None)
        .await
        .ok(200)
        .clone();
    assert_eq!(shown["config"]["auth"]["token"], "******");
    shown["config"]["url"] = json!("https://billing2.example.com");
    s.admin("PUT", "/connectors/billing", Some(shown.clone()))
        .await
        .ok(200);
    let export = s.admin("GET", "/connectors", None).await;
    assert!(export.text.contains("billing2"));
    // What is stored is the original secret (read from the database).
    let stored = s
        .app
        .store
        .get_connector("billing")
        .await
        .unwrap()
        .definition;
    assert_eq!(stored["config"]["auth"]["token"], "s3cr3t");
    assert_eq!(stored["config"]["headers"]["x-api-key"], "k-1");
    // A header name sent back in another case still finds its secret.
    let mut recased = shown.clone();
    recased["config"]["headers"] = json!({"X-Api-Key": "******"});
    s.admin("PUT", "/connectors/billing", Some(recased))
        .await
        .ok(200);
    let stored = s
        .app
        .store
        .get_connector("billing")
        .await
        .unwrap()
        .definition;
    assert_eq!(stored["config"]["headers"]["X-Api-Key"], "k-1");
    shown["config"]["auth"]["token"] = json!("n3w");
    s.admin("PUT", "/connectors/billing", Some(shown))
        .await
        .ok(200);
    let stored = s
        .app
        .store
        .get_connector("billing")
        .await
        .unwrap()
        .definition;
    assert_eq!(stored["config"]["auth"]["token"], "n3w");
}

/// A masked value that cannot be put back (a URL whose path changed around
/// its `******` password; a `******` token on create) is refused, naming
/// the field. Before, the mask itself was stored and sent as the password.
#[tokio::test]
async fn a_mask_left_in_a_definition_is_refused() {
    let s = start(Db::Sqlite).await;
    let def = json!({"name": "urlpw", "connector_type": "http",
        "config": {"type": "http", "url": "http://u:URLPW@api.example.com/v1/"}});
    s.admin("POST", "/connectors", Some(def)).await.ok(201);
    let mut shown = s
        .admin("GET", "/connectors/urlpw", None)
        .await
        .ok(200)
        .clone();
    assert_eq!(
        shown["config"]["url"],
        "http://u:******@api.example.com/v1/"
    );
    shown["config"]["url"] = json!("http://u:******@api.example.com/v2/");
    let r = s.admin("PUT", "/connectors/urlpw", Some(shown)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["config.url"]);
    let stored = s.app.store.get_connector("urlpw").await.unwrap().definition;
    assert_eq!(
        stored["config"]["url"],
        "http://u:URLPW@api.example.com/v1/"
    );
    let copied = json!({"name": "copied", "connector_type": "http",
        "config": {"type": "http", "url": "https://x.example.com",
                   "auth": {"type": "bearer", "token": "******"}}});
    let r = s.admin("POST", "/connectors", Some(copied)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["config.auth.token"]);
    // A masked connection string is named as a mask, not as a bad scheme,
    // beside the definition's other problems.
    for ty in ["db", "mongodb"] {
        let config = json!({"connection_string": "******", "pool_size": -1});
        let copied = json!({"name": "cs", "connector_type": ty, "config": config});
        let r = s.admin("POST", "/connectors", Some(copied)).await;
        let e = r.error(400, "BAD_REQUEST");
        let details = e["details"].as_array().unwrap();
        assert_eq!(details[0]["field"], "config.connection_string", "{e}");
        assert!(
            details[0]["message"]
                .as_str()
                .unwrap()
                .starts_with("holds the mask"),
            "{e}"
        );
        assert_eq!(
            details
                .iter()
                .filter(|d| d["field"] == "config.connection_string")
                .count(),
            1,
            "{e}"
        );
    }

    // A value that only holds the mask ("keep the scheme and the secret")
    // cannot be put back either: it was stored and sent as `Bearer ******`.
    let def = json!({"name": "hdr", "connector_type": "http",
        "config": {"type": "http", "url": "https://x.example.com",
                   "headers": {"Authorization": "Bearer REAL"}}});
    s.admin("POST", "/connectors", Some(def)).await.ok(201);
    let mut shown = s
        .admin("GET", "/connectors/hdr", None)
        .await
        .ok(200)
        .clone();
    assert_eq!(shown["config"]["headers"]["Authorization"], "******");
    shown["config"]["headers"]["Authorization"] = json!("Bearer ******");
    let r = s.admin("PUT", "/connectors/hdr", Some(shown)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["config.headers.Authorization"]);
    let stored = s.app.store.get_connector("hdr").await.unwrap().definition;
    assert_eq!(stored["config"]["headers"]["Authorization"], "Bearer REAL");
    let padded = json!({"name": "padded", "connector_type": "http",
        "config": {"type": "http", "url": "http://u:x******@x.example.com",
                   "auth": {"type": "bearer", "token": "****** "}}});
    let r = s.admin("POST", "/connectors", Some(padded)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["config.url", "config.auth.token"]);

    // A key in the URL's query is masked like its password: GET shows
    // `******`, PUT of the answer keeps the key, a changed URL around the
    // mask is refused (session 17: `?api_key=…` was shown in clear).
    let def = json!({"name": "qk", "connector_type": "http",
        "config": {"type": "http", "url": "https://x.example.com/v1?api_key=QKEY99&page=2"}});
    s.admin("POST", "/connectors", Some(def)).await.ok(201);
    let mut shown = s.admin("GET", "/connectors/qk", None).await.ok(200).clone();
    assert_eq!(
        shown["config"]["url"],
        "https://x.example.com/v1?api_key=******&page=2"
    );
    s.admin("PUT", "/connectors/qk", Some(shown.clone()))
        .await
        .ok(200);
    let stored = s.app.store.get_connector("qk").await.unwrap().definition;
    assert_eq!(
        stored["config"]["url"],
        "https://x.example.com/v1?api_key=QKEY99&page=2"
    );
    shown["config"]["url"] = json!("https://x.example.com/v2?api_key=******&page=2");
    let r = s.admin("PUT", "/connectors/qk", Some(shown)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["config.url"]);
}

/// `?version=` is a positive integer on reads and test runs alike: a test
/// run given a version that is not one used to run the latest instead, and
/// `0` or `-1` answered 404 where `abc` answered 400.
#[tokio::test]
async fn version_parameters_are_checked() {
    let s = start(Db::Sqlite).await;
    s.admin("POST", "/workflows", Some(workflow("vp")))
        .await
        .ok(201);
    for v in ["abc", "0", "-1", "1.5"] {
        let r = s
            .admin("GET", &format!("/workflows/vp?version={v}"), None)
            .await;
        assert_eq!(
            r.error(400, "BAD_REQUEST")["message"],
            format!("version must be a positive integer, got '{v}'")
        );
        let r = s
            .admin(
                "POST",
                &format!("/workflows/vp/test?version={v}"),
                Some(json!({"data": {}})),
            )
            .await;
        r.error(400, "BAD_REQUEST");
    }
    s.admin("GET", "/workflows/vp?version=1", None)
        .await
        .ok(200);
    s.admin("GET", "/workflows/vp?version=2", None)
        .await
        .error(404, "NOT_FOUND");
}

/// The dry-run body is an object with an optional object `metadata`.
#[tokio::test]
async fn dry_run_body_is_checked() {
    let s = start(Db::Sqlite).await;
    s.admin("POST", "/workflows", Some(workflow("w")))
        .await
        .ok(201);
    s.admin("POST", "/workflows/w/test", Some(json!([])))
        .await
        .error(400, "BAD_REQUEST");
    let r = s
        .admin(
            "POST",
            "/workflows/w/test",
            Some(json!({"data": {}, "metadata": 5})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["metadata"]);
    s.admin("POST", "/workflows/w/test", Some(json!({"data": {}})))
        .await
        .ok(200);
    // A misspelt `data` is named, not run on no payload (audit 80).
    let r = s
        .admin(
            "POST",
            "/workflows/w/test",
            Some(json!({"dat": {"x": 1}, "metdata": {}})),
        )
        .await;
    let e = r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["dat", "metdata"], "{}", r.text);
    assert_eq!(
        e["details"][0]["message"],
        "unknown field; expected data, metadata"
    );
    // The OpenAPI document says so.
    let spec = s.get("/api/v1/openapi.json").await.body;
    assert_eq!(
        spec["components"]["schemas"]["DryRunRequest"]["additionalProperties"],
        false
    );
    // `method`, `channel` and `request_id` are taken as a request's; other
    // keys and other types are refused.
    let r = s
        .admin(
            "POST",
            "/workflows/w/test",
            Some(json!({"data": {}, "metadata": {"extra": 5, "method": 7}})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(
        r.detail_fields(),
        ["metadata.extra", "metadata.method"],
        "{}",
        r.text
    );
    s.admin(
        "POST",
        "/workflows",
        Some(json!({"workflow_id": "meta", "name": "meta", "tasks": [
            {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [
                {"path": "seen", "logic": {"cat": [{"var": "metadata.method"}, " ",
                    {"var": "metadata.channel"}, " ", {"var": "metadata.request_id"}]}}]}}}]})),
    )
    .await
    .ok(201);
    let r = s
        .admin(
            "POST",
            "/workflows/meta/test",
            Some(json!({"data": {}, "metadata": {"method": "GET", "channel": "orders", "request_id": "r-1"}})),
        )
        .await;
    assert_eq!(r.ok(200)["data"]["seen"], "GET orders r-1", "{}", r.text);
    // The three maps are objects of text (numbers and booleans taken as
    // their text); audit 71: `[1]`, `null` were dropped, `{"b": 1}` became
    // JSON text.
    let r = s
        .admin(
            "POST",
            "/workflows/w/test",
            Some(json!({"data": {}, "metadata": {"headers": [1], "query": "x", "path": null}})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(
        r.detail_fields(),
        ["metadata.headers", "metadata.query", "metadata.path"],
        "{}",
        r.text
    );
    let r = s
        .admin(
            "POST",
            "/workflows/w/test",
            Some(json!({"data": {}, "metadata": {"headers": {"a": {"b": 1}, "ok": "1"}, "query": {"n": [1]}}})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(
        r.detail_fields(),
        ["metadata.headers.a", "metadata.query.n"],
        "{}",
        r.text
    );
    s.admin(
        "POST",
        "/workflows",
        Some(json!({"workflow_id": "maps", "name": "maps", "tasks": [
            {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [
                {"path": "seen", "logic": {"cat": [{"var": "metadata.query.page"}, " ",
                    {"var": "metadata.headers.x-flag"}, " ", {"var": "metadata.query.big"}]}}]}}}]})),
    )
    .await
    .ok(201);
    let r = s
        .admin(
            "POST",
            "/workflows/maps/test",
            Some(json!({"data": {}, "metadata": {"query": {"page": 2, "big": 1e2}, "headers": {"X-Flag": true}}})),
        )
        .await;
    // Numbers as JavaScript writes them (audit 74: `1e2` was "100.0").
    assert_eq!(r.ok(200)["data"]["seen"], "2 true 100", "{}", r.text);
}

/// Traffic between versions follows `rollout_percentage` alone: an engine
/// schema `rollout` range in a definition is server-managed like the
/// percentage (not stored, not shown, no effect). Before, `{0, 0}` made a
/// workflow the admin API showed at 100 % serve nothing.
#[tokio::test]
async fn a_definitions_rollout_range_does_not_split_traffic() {
    let s = start(Db::Sqlite).await;
    s.deploy(
        json!({"workflow_id": "rb", "name": "rb", "rollout": {"bucket_start": 0, "bucket_end": 0},
               "tasks": [{"id": "m", "name": "m", "function": {"name": "map",
                          "input": {"mappings": [{"path": "v", "logic": "R"}]}}}]}),
        json!({"channel_id": "crb", "name": "crb", "workflow_id": "rb"}),
    )
    .await;
    let shown = s.admin("GET", "/workflows/rb", None).await;
    let data = shown.ok(200);
    assert_eq!(data["rollout_percentage"], 100);
    assert!(data.get("rollout").is_none(), "{data}");
    for key in ["a", "b", "c", "d", "e"] {
        let r = s
            .send(
                "POST",
                "/api/v1/data/crb",
                Some(json!({"data": {}})),
                &[("x-rollout-key", key)],
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.body["data"]["v"], "R");
    }
}

/// In a status or rollout change, `null` is a value of the wrong type, not
/// an absent field, and a body that is not an object says so.
#[tokio::test]
async fn lifecycle_bodies_treat_null_as_a_value() {
    let s = start(Db::Sqlite).await;
    s.admin("POST", "/workflows", Some(workflow("nul")))
        .await
        .ok(201);
    for (body, field, message) in [
        (
            json!({"status": "active", "rollout_percentage": null}),
            "rollout_percentage",
            "expected integer, got null",
        ),
        (
            json!({"status": "active", "version": null}),
            "version",
            "expected integer, got null",
        ),
        (
            json!({"status": "active", "version": "2"}),
            "version",
            "expected integer, got string",
        ),
        (
            json!({"status": "active", "version": 0}),
            "version",
            "must be a positive integer, got 0",
        ),
        (
            json!({"status": "active", "rollout_percentage": "50"}),
            "rollout_percentage",
            "expected integer, got string",
        ),
        (
            json!({"status": "active", "rollout_percentage": 50.0}),
            "rollout_percentage",
            "expected integer, got number",
        ),
        (
            json!({"status": "active", "rollout_percentage": 150}),
            "rollout_percentage",
            "must be an integer from 1 to 100, got 150",
        ),
        // Beyond i64 (audit 66: "expected integer, got integer").
        (
            json!({"status": "active", "rollout_percentage": 9223372036854775808u64}),
            "rollout_percentage",
            "must be an integer from 1 to 100, got 9223372036854775808",
        ),
        (
            json!({"status": "active", "version": 9223372036854775808u64}),
            "version",
            "must be a positive integer up to 9223372036854775807, got 9223372036854775808",
        ),
        // Beyond u64 serde_json reads a float: written as the service writes
        // numbers (audit 94: `got 1e+20`, `got 1.2345678901234568e+22`).
        (
            json!({"status": "active", "rollout_percentage": 1e20}),
            "rollout_percentage",
            "must be an integer from 1 to 100, got 100000000000000000000",
        ),
        (
            json!({"status": "active", "version": 1.2345678901234568e22}),
            "version",
            "must be a positive integer up to 9223372036854775807, got 1.2345678901234568e22",
        ),
    ] {
        let r = s.admin("PATCH", "/workflows/nul/status", Some(body)).await;
        r.error(400, "BAD_REQUEST");
        assert_eq!(
            r.body["error"]["details"],
            json!([{"field": field, "message": message}])
        );
    }
    // Every problem of a status body at once (session 19: the first only).
    let r = s
        .admin(
            "PATCH",
            "/workflows/nul/status",
            Some(json!({"status": "bogus", "rollout_percentage": "5", "version": "x"})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(
        r.body["error"]["details"],
        json!([
            {"field": "status", "message": "must be one of active, archived, paused, got 'bogus'"},
            {"field": "rollout_percentage", "message": "expected integer, got string"},
            {"field": "version", "message": "expected integer, got string"}
        ])
    );
    let r = s
        .admin(
            "PATCH",
            "/workflows/nul/rollout",
            Some(json!({"rollout_percentage": null})),
        )
        .await;
    assert_eq!(
        r.body["error"]["details"],
        json!([{"field": "rollout_percentage", "message": "expected integer, got null"}])
    );
    let r = s
        .admin("PATCH", "/workflows/nul/rollout", Some(json!([])))
        .await;
    assert_eq!(
        r.error(400, "BAD_REQUEST")["message"],
        "the body must be a JSON object like {\"rollout_percentage\": 30}, got array"
    );
}

/// MariaDB keeps definitions as deep as an admin body may be (127 levels),
/// as the other databases do: its JSON columns are text since migration
/// 0005 (their `JSON_VALID` check refused 32 levels, so an else-if ladder of
/// a dozen `if`s could not be stored there), and the `?tag=` filter reads a
/// column of its own (MariaDB's `JSON_EXTRACT` stops at 32 levels too, and
/// missed deeper definitions).
#[tokio::test]
async fn mariadb_keeps_deep_definitions_and_finds_them_by_tag() {
    let nested = |id: &str, levels: usize| {
        let mut message = json!("x");
        for _ in 0..levels {
            message = json!([message]);
        }
        json!({"workflow_id": id, "name": id, "tasks": [
            {"id": "l", "name": "l", "function": {"name": "log", "input": {"message": message}}}
        ], "tags": ["deep"]})
    };
    let s = start(Db::MySql).await;
    // The definition object, `tasks`, the task, `function` and `input` are
    // five levels: 100 more is far past the old 31.
    let created = s
        .admin("POST", "/workflows", Some(nested("deep", 100)))
        .await;
    let created = created.ok(201);
    let got = s.admin("GET", "/workflows/deep", None).await;
    let got = got.ok(200);
    assert_eq!(got["tasks"], created["tasks"]);
    assert_eq!(got["tasks"], nested("deep", 100)["tasks"]);
    let listed = s.admin("GET", "/workflows?tag=deep", None).await;
    let listed = listed.ok(200);
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["workflow_id"], "deep");
    let none = s.admin("GET", "/workflows?tag=other", None).await;
    assert_eq!(*none.ok(200), json!([]));
    let dry = s
        .admin(
            "POST",
            "/workflows/import?dry_run=true",
            Some(json!([nested("a", 20), nested("b", 110)])),
        )
        .await;
    let dry = dry.ok(200);
    assert_eq!(dry["created"], json!(["a", "b"]), "{dry}");
    // Activated, it runs: the engine reads the deep text back.
    s.admin(
        "PATCH",
        "/workflows/deep/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
}

/// A NUL character names nothing Sluice keeps, and PostgreSQL cannot even
/// compare text that holds one: `%00` in a request target and `\u0000` in
/// a definition are refused as bad input on every database (PostgreSQL
/// answered them with a 500).
#[tokio::test]
async fn nul_characters_are_refused_alike_on_every_database() {
    for db in [Db::Postgres, Db::Sqlite] {
        let s = start(db).await;
        for path in [
            "/api/v1/admin/workflows/%00",
            "/api/v1/admin/workflows?tag=a%00b",
            "/api/v1/admin/audit-logs?action=%00",
            "/api/v1/data/traces/%00",
        ] {
            let r = s.get(path).await;
            assert_eq!(
                r.error(400, "BAD_REQUEST")["message"],
                "the request target holds a NUL character (%00)",
                "{path}"
            );
        }
        // Escapes that are not UTF-8 are refused too (decoded leniently,
        // `%FF` and `%C3` both named "\u{FFFD}"); valid ones pass.
        for path in [
            "/api/v1/data/items/%FF",
            "/api/v1/data/items/%C3",
            "/api/v1/data/items/x?q=%FF",
            "/api/v1/admin/workflows/%E2%82",
        ] {
            let r = s.get(path).await;
            assert_eq!(
                r.error(400, "BAD_REQUEST")["message"],
                "the request target holds a percent-escape that is not UTF-8 (such as %FF)",
                "{path}"
            );
        }
        s.get("/api/v1/admin/workflows/caf%C3%A9%EF%BF%BD")
            .await
            .error(404, "NOT_FOUND");
        // Each NUL is a field error, named where it is, by validate and
        // create alike (and with any other problem of the definition).
        let mut wf = workflow("nul");
        wf["name"] = json!("a\u{0}b");
        wf["tags"] = json!(["ok", "x\u{0}"]);
        wf["priority"] = json!("high");
        let why = "must not hold a NUL character (\\u0000), which storage cannot keep";
        for path in ["/workflows/validate", "/workflows"] {
            let r = s.admin("POST", path, Some(wf.clone())).await;
            let e = r.error(400, "BAD_REQUEST");
            assert_eq!(
                e["details"],
                json!([
                    {"field": "name", "message": why},
                    {"field": "tags[1]", "message": why},
                    {"field": "priority", "message": "expected integer, got string"}
                ]),
                "{path}: {e}"
            );
        }
        // Without the NUL it is kept.
        s.admin("POST", "/workflows", Some(workflow("nul")))
            .await
            .ok(201);
    }
}

/// An id in the path that no resource can have names none, on every
/// database: MariaDB's collations ignore trailing spaces, so
/// `DELETE /workflows/g%20` deleted workflow `g` there (and audited `'g '`).
async fn ids_no_resource_can_have_name_none(db: Db) {
    let s = start(db).await;
    s.admin("POST", "/workflows", Some(greeter("g", "hi")))
        .await
        .ok(201);
    s.admin(
        "POST",
        "/channels",
        Some(json!({"channel_id": "c", "name": "c", "workflow_id": "g"})),
    )
    .await
    .ok(201);
    s.admin(
        "POST",
        "/connectors",
        Some(json!({"name": "k", "connector_type": "http", "config": {"url": "https://example.com"}})),
    )
    .await
    .ok(201);
    for (method, path, body, message) in [
        (
            "DELETE",
            "/workflows/g%20",
            None,
            "Workflow with id 'g ' not found",
        ),
        (
            "GET",
            "/workflows/g%20%20",
            None,
            "Workflow with id 'g  ' not found",
        ),
        (
            "PATCH",
            "/workflows/g%20/status",
            Some(json!({"status": "active"})),
            "Workflow with id 'g ' not found",
        ),
        (
            "GET",
            "/workflows/g%20/versions",
            None,
            "Workflow with id 'g ' not found",
        ),
        (
            "DELETE",
            "/channels/c%20",
            None,
            "Channel with id 'c ' not found",
        ),
        (
            "GET",
            "/channels/c%09",
            None,
            "Channel with id 'c\t' not found",
        ),
        (
            "DELETE",
            "/connectors/k%20",
            None,
            "Connector with id 'k ' not found",
        ),
        (
            "GET",
            "/connectors/k%20",
            None,
            "Connector with id 'k ' not found",
        ),
    ] {
        let r = s.admin(method, path, body).await;
        assert_eq!(
            r.error(404, "NOT_FOUND")["message"],
            message,
            "{method} {path}"
        );
    }
    // Nothing was touched.
    let w = s.admin("GET", "/workflows/g", None).await;
    assert_eq!(w.ok(200)["status"], "draft", "{}", w.text);
    s.admin("GET", "/channels/c", None).await.ok(200);
    s.admin("GET", "/connectors/k", None).await.ok(200);
}
on_every_backend!(
    ids_with_trailing_spaces_name_nothing,
    ids_no_resource_can_have_name_none
);

/// Create and update answer a definition's warnings beside `data` (what
/// validate would say), and nothing extra when there are none.
#[tokio::test]
async fn create_and_update_answer_the_definitions_warnings() {
    let s = start(Db::Sqlite).await;
    let def = json!({"workflow_id": "warned", "name": "w", "continue_on_eror": true, "tasks": [
        {"id": "t", "name": "t", "conditon": true,
         "function": {"name": "map", "input": {"mappings": [{"path": "x", "logic": 1}]}}}]});
    let r = s.admin("POST", "/workflows", Some(def.clone())).await;
    r.ok(201);
    let fields: Vec<&str> = r.body["warnings"]
        .as_array()
        .unwrap_or_else(|| panic!("no warnings in {}", r.text))
        .iter()
        .map(|w| w["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        ["continue_on_eror", "tasks[0].conditon"],
        "{}",
        r.text
    );
    let r = s.admin("PUT", "/workflows/warned", Some(def)).await;
    r.ok(200);
    assert_eq!(r.body["warnings"][1]["field"], "tasks[0].conditon");
    // A channel's unknown top-level key too (`validaton_logic` would be
    // stored and do nothing).
    let r = s
        .admin(
            "POST",
            "/channels",
            Some(
                json!({"channel_id": "warned", "name": "warned", "protocol": "http",
                "workflow_id": "warned", "validaton_logic": {"var": "data.ok"}}),
            ),
        )
        .await;
    r.ok(201);
    assert_eq!(
        r.body["warnings"][0]["field"], "validaton_logic",
        "{}",
        r.text
    );
    // A channel naming a workflow that does not exist: stored, and warned.
    let r = s
        .admin(
            "POST",
            "/channels",
            Some(json!({"channel_id": "orphan", "name": "orphan", "workflow_id": "nowhere"})),
        )
        .await;
    r.ok(201);
    assert_eq!(r.body["warnings"][0]["field"], "workflow_id", "{}", r.text);
    assert!(
        r.body["warnings"][0]["message"]
            .as_str()
            .unwrap()
            .starts_with("no workflow 'nowhere' exists"),
        "{}",
        r.text
    );
    let clean = json!({"workflow_id": "clean", "name": "c", "tasks": [
        {"id": "t", "name": "t", "function": {"name": "log", "input": {"message": "m"}}}]});
    let r = s.admin("POST", "/workflows", Some(clean.clone())).await;
    r.ok(201);
    assert!(r.body.get("warnings").is_none(), "{}", r.text);

    // Import answers the same warnings per item, by index, for what it
    // creates (a dry run for what it would); a failed item has none.
    let misspelt = json!({"workflow_id": "imported", "name": "i", "descripton": "x",
        "tasks": [{"id": "t", "name": "t",
         "function": {"name": "http_call", "input": {"connector": "nowhere"}}}]});
    let batch = json!([clean, misspelt, {"workflow_id": "broken", "nmae": "b"}]);
    for dry in [true, false] {
        let r = s
            .admin(
                "POST",
                &format!("/workflows/import?dry_run={dry}"),
                Some(batch.clone()),
            )
            .await;
        let data = r.ok(200);
        assert_eq!(data["created"], json!(["imported"]), "{}", r.text);
        let warned = data["warnings"].as_array().unwrap();
        assert_eq!(warned.len(), 1, "{}", r.text);
        assert_eq!(warned[0]["index"], 1);
        let fields: Vec<&str> = warned[0]["details"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["field"].as_str().unwrap())
            .collect();
        assert_eq!(
            fields,
            ["descripton", "tasks[0].function.input.connector"],
            "{}",
            r.text
        );
    }
}

/// A task's own `loop` is refused (it used to be kept and ignored), and a
/// task name must not be empty.
#[tokio::test]
async fn a_task_cannot_loop_or_be_nameless() {
    let s = start(Db::Sqlite).await;
    let r = s
        .admin(
            "POST",
            "/workflows",
            Some(json!({"name": "w", "tasks": [
                {"id": "a", "name": "", "loop": {"max": 3},
                 "function": {"name": "log", "input": {}}}]})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["tasks[0].name", "tasks[0].loop"]);
}

/// `#` escapes the area names in write paths: `#temp_data.x` is
/// `data["temp_data"].x` (shared decisions), in `map` and in a connector's
/// `response_path`.
#[tokio::test]
async fn an_escaped_area_name_is_a_key_of_data() {
    let s = start(Db::Sqlite).await;
    let wf = json!({"workflow_id": "esc", "name": "esc", "tasks": [
    {"id": "m", "name": "m", "function": {"name": "map", "input": {"mappings": [
        {"path": "#temp_data.x", "logic": 1},
        {"path": "#metadata", "logic": "m"},
        {"path": "#data", "logic": true},
        {"path": "temp_data.y", "logic": 2},
        {"path": "seen", "logic": {"var": "temp_data"}}
    ]}}}]});
    let ch = json!({"channel_id": "esc", "name": "esc", "channel_type": "sync",
        "protocol": "http", "workflow_id": "esc"});
    s.deploy(wf, ch).await;
    let r = s.post("/api/v1/data/esc", json!({"data": {}})).await;
    assert_eq!(
        r.ok(200).clone(),
        json!({"temp_data": {"x": 1}, "metadata": "m", "data": true, "seen": {"y": 2}}),
        "{}",
        r.text
    );
}

/// Validate, create and update warn about a connector that does not exist
/// or is of another type than the function needs (the task would fail
/// when it runs); a group's tasks are checked too.
#[tokio::test]
async fn connectors_named_by_tasks_are_checked_against_the_registry() {
    let s = start(Db::Sqlite).await;
    s.admin(
        "POST",
        "/connectors",
        Some(json!({"name": "kv", "connector_type": "cache", "config": {"type": "cache", "backend": "memory"}})),
    )
    .await
    .ok(201);
    let def = json!({"workflow_id": "refs", "name": "refs", "tasks": [
        {"id": "a", "name": "a", "function": {"name": "cache_read", "input": {"connector": "kv", "key": "k"}}},
        {"id": "g", "tasks": [
            {"id": "b", "name": "b", "function": {"name": "http_call", "input": {"connector": "kv"}}},
            {"id": "c", "name": "c", "function": {"name": "db_read", "input": {"connector": "nowhere", "query": "SELECT 1"}}}
        ]}
    ]});
    let expect = |body: &Json| {
        let got: Vec<(String, String)> = body["warnings"]
            .as_array()
            .unwrap_or_else(|| panic!("no warnings: {body}"))
            .iter()
            .map(|w| {
                (
                    w["field"].as_str().unwrap().to_owned(),
                    w["message"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "tasks[1].tasks[0].function.input.connector".to_owned(),
                    "connector 'kv' is of type cache; http_call needs a connector of type http"
                        .to_owned()
                ),
                (
                    "tasks[1].tasks[1].function.input.connector".to_owned(),
                    "no connector named 'nowhere' exists; the task fails until one is created"
                        .to_owned()
                )
            ],
            "{body}"
        );
    };
    let r = s
        .admin("POST", "/workflows/validate", Some(def.clone()))
        .await;
    expect(r.ok(200));
    let r = s.admin("POST", "/workflows", Some(def.clone())).await;
    r.ok(201);
    expect(&r.body);
    let r = s.admin("PUT", "/workflows/refs", Some(def)).await;
    r.ok(200);
    expect(&r.body);
}

/// A stored version that no longer compiles (written by an older release,
/// or edited in the database) is not activated: the move is undone and
/// answered 400 with the definition's problems, and the engine keeps
/// reloading. Before, the move was committed, answered 200, and every
/// reload after it failed.
#[tokio::test]
async fn a_stored_version_that_does_not_compile_is_not_activated() {
    use sqlx::Connection as _;
    let s = start(Db::Sqlite).await;
    s.admin("POST", "/workflows", Some(workflow("stale")))
        .await
        .ok(201);
    let mut db = sqlx::SqliteConnection::connect(&s.app.config.storage.url)
        .await
        .unwrap();
    sqlx::query("UPDATE workflows SET definition = ? WHERE id = 'stale'")
        .bind(
            json!({"name": "stale", "tasks": [
                {"id": "a", "name": "a", "function": {"name": "no_such_function", "input": {}}}]})
            .to_string(),
        )
        .execute(&mut db)
        .await
        .unwrap();
    let r = s
        .admin(
            "PATCH",
            "/workflows/stale/status",
            Some(json!({"status": "active"})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["tasks[0].function.name"], "{}", r.text);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("workflow 'stale' version 1 cannot be activated"),
        "{}",
        r.text
    );
    assert_eq!(
        s.admin("GET", "/workflows/stale", None).await.ok(200)["status"],
        "draft"
    );
    // Nothing was recorded, and the next change reloads as usual.
    let audit = s.admin("GET", "/audit-logs?action=activate", None).await;
    assert_eq!(audit.body["total"], 0, "{}", audit.text);
    s.admin("POST", "/workflows", Some(workflow("fresh")))
        .await
        .ok(201);
    s.admin(
        "PATCH",
        "/workflows/fresh/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    let reload = s.admin("POST", "/engine/reload", None).await;
    reload.ok(200);
    // An active definition edited in the database: the reload is refused
    // as a conflict of state (the request is fine), with the problems.
    sqlx::query("UPDATE workflows SET definition = ?, digest = NULL WHERE id = 'fresh'")
        .bind(json!({"name": "fresh", "tasks": 7}).to_string())
        .execute(&mut db)
        .await
        .unwrap();
    let reload = s.admin("POST", "/engine/reload", None).await;
    reload.error(409, "CONFLICT");
    assert!(
        reload.detail_fields()[0].starts_with("workflows['fresh']"),
        "{}",
        reload.text
    );
    // The engine now serves an older state than storage holds: `/health`
    // says so until a reload builds again (audit 68; it said `ok`).
    let h = s.get("/health").await;
    assert_eq!(
        (h.status, h.body["status"].as_str()),
        (503, Some("degraded"))
    );
    assert_eq!(
        h.body["components"],
        json!({"database": "ok", "engine": "reload_failed"})
    );
    sqlx::query("UPDATE workflows SET definition = ?, digest = NULL WHERE id = 'fresh'")
        .bind(workflow("fresh").to_string())
        .execute(&mut db)
        .await
        .unwrap();
    s.admin("POST", "/engine/reload", None).await.ok(200);
    let h = s.get("/health").await;
    assert_eq!(
        (h.status, h.body["components"]["engine"].as_str()),
        (200, Some("ok"))
    );
}

/// Lifecycle bodies and parameters that would change live traffic in a way
/// the caller did not ask for are refused: a misspelt key in a status or
/// rollout body, a rollout that leaves part of the traffic to no version,
/// `DELETE ?version=` (which would remove every version), and a rollout
/// share on a move that is not an activation (reported with the body's
/// other problems).
#[tokio::test]
async fn lifecycle_changes_refuse_what_they_would_not_do() {
    let s = start(Db::Sqlite).await;
    s.admin("POST", "/workflows", Some(workflow("lc")))
        .await
        .ok(201);
    // `rollout_percent` used to be ignored: the draft went live at 100 %.
    let r = s
        .admin(
            "PATCH",
            "/workflows/lc/status",
            Some(json!({"status": "active", "rollout_percent": 10})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(r.detail_fields(), ["rollout_percent"], "{}", r.text);
    assert_eq!(
        s.admin("GET", "/workflows/lc", None).await.ok(200)["status"],
        "draft"
    );
    s.admin(
        "PATCH",
        "/workflows/lc/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);

    // The only active version, serving everything: nothing would take the rest.
    let r = s
        .admin(
            "PATCH",
            "/workflows/lc/rollout",
            Some(json!({"rollout_percentage": 50})),
        )
        .await;
    r.error(409, "CONFLICT");
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("only active version"),
        "{}",
        r.text
    );
    // Every problem of a rollout body at once.
    let r = s
        .admin(
            "PATCH",
            "/workflows/lc/rollout",
            Some(json!({"rollout_percentage": 0, "version": 1})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(
        r.detail_fields(),
        ["rollout_percentage", "version"],
        "{}",
        r.text
    );
    // A canary's share can be moved either way.
    s.admin("POST", "/workflows/lc/versions", None)
        .await
        .ok(201);
    s.admin(
        "PATCH",
        "/workflows/lc/status",
        Some(json!({"status": "active", "rollout_percentage": 10})),
    )
    .await
    .ok(200);
    for p in [40, 20] {
        let r = s
            .admin(
                "PATCH",
                "/workflows/lc/rollout",
                Some(json!({"rollout_percentage": p})),
            )
            .await;
        assert_eq!(r.ok(200)["rollout_percentage"], p, "{}", r.text);
    }

    // Archiving takes no share; reported with the body's other problems.
    let r = s
        .admin(
            "PATCH",
            "/workflows/lc/status",
            Some(json!({"status": "archived", "rollout_percentage": 50, "version": "x"})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(
        r.detail_fields(),
        ["rollout_percentage", "version"],
        "{}",
        r.text
    );

    // DELETE removes every version, so a version is refused, not ignored.
    s.admin("DELETE", "/workflows/lc?version=2", None)
        .await
        .error(400, "BAD_REQUEST");
    s.admin("GET", "/workflows/lc/versions", None).await.ok(200);

    // Pausing is recorded as `update`: `pause` is no audit action to filter on.
    s.admin("GET", "/audit-logs?action=pause", None)
        .await
        .error(400, "BAD_REQUEST");
}

/// A list answer (`{data, total, limit, offset}`) is accepted as an import
/// body, as an export's `{data}` is: channels and connectors have no export.
#[tokio::test]
async fn a_list_answer_imports_unchanged() {
    let s = start(Db::Sqlite).await;
    s.admin("POST", "/workflows", Some(workflow("wf")))
        .await
        .ok(201);
    s.admin(
        "POST",
        "/channels",
        Some(json!({"channel_id": "listed", "name": "listed", "workflow_id": "wf"})),
    )
    .await
    .ok(201);
    let listed = s.admin("GET", "/channels?limit=5", None).await;
    listed.ok(200);
    s.admin("DELETE", "/channels/listed", None).await;
    let r = s
        .admin("POST", "/channels/import", Some(listed.body.clone()))
        .await;
    assert_eq!(r.ok(200)["created"], json!(["listed"]), "{}", r.text);
    // Anything else beside `data` is still refused.
    s.admin(
        "POST",
        "/channels/import",
        Some(json!({"data": [], "items": []})),
    )
    .await
    .error(400, "BAD_REQUEST");
}

/// A database that refuses connections (closed to them by its
/// administrator) is unavailable too: 503 with `Retry-After`, as when it
/// cannot be reached, and a 200 again once it accepts them (audit 76).
#[tokio::test]
async fn a_database_refusing_connections_is_a_503() {
    use sqlx::Connection;
    let mut url = String::new();
    let s = start_with(Db::Postgres, |c| url = c.storage.url.clone()).await;
    s.admin("GET", "/workflows", None).await.ok(200);
    let name = url.rsplit('/').next().unwrap().to_string();
    let mut admin = sqlx::PgConnection::connect("postgres://postgres@127.0.0.1:5432/test")
        .await
        .unwrap();
    sqlx::query(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false"))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
        .bind(&name)
        .execute(&mut admin)
        .await
        .unwrap();
    let r = s.admin("GET", "/workflows", None).await;
    let e = r.error(503, "SERVICE_UNAVAILABLE");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("storage unavailable"),
        "{e}"
    );
    assert!(r.headers.contains_key("retry-after"), "{:?}", r.headers);
    // An import the database stops is that 503 too, not a 200 listing
    // every item as failed on its id (audit 106).
    let wf = json!([{"workflow_id": "w", "name": "w", "tasks": [{"id": "t", "name": "t",
        "function": {"name": "filter", "input": {"condition": true}}}]}]);
    let conn = json!([{"name": "c", "connector_type": "cache",
                       "config": {"type": "cache", "backend": "memory"}}]);
    for (path, body) in [("/workflows/import", wf), ("/connectors/import", conn)] {
        let r = s.admin("POST", path, Some(body)).await;
        r.error(503, "SERVICE_UNAVAILABLE");
        assert!(
            r.headers.contains_key("retry-after"),
            "{path}: {:?}",
            r.headers
        );
    }
    sqlx::query(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS true"))
        .execute(&mut admin)
        .await
        .unwrap();
    s.admin("GET", "/workflows", None).await.ok(200);
    // A database that is not there (renamed away: 3D000 on connecting) is
    // unavailable as well (audit 83: a 500), and serves again once back.
    let off = format!("{name}_off");
    let mut renamed = false;
    for _ in 0..20 {
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
            .bind(&name)
            .execute(&mut admin)
            .await
            .unwrap();
        if sqlx::query(&format!("ALTER DATABASE {name} RENAME TO {off}"))
            .execute(&mut admin)
            .await
            .is_ok()
        {
            renamed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(renamed, "could not rename {name}");
    let r = s.admin("GET", "/workflows", None).await;
    r.error(503, "SERVICE_UNAVAILABLE");
    assert!(r.headers.contains_key("retry-after"), "{:?}", r.headers);
    sqlx::query(&format!("ALTER DATABASE {off} RENAME TO {name}"))
        .execute(&mut admin)
        .await
        .unwrap();
    s.admin("GET", "/workflows", None).await.ok(200);
}

/// A database that cannot be reached is a 503 with `Retry-After` (the
/// caller may retry; nothing was accepted), not a 500 "internal error".
/// The PostgreSQL storage goes through a TCP proxy the test then cuts.
#[tokio::test]
async fn an_unreachable_database_is_a_503() {
    use tokio::io::copy_bidirectional;
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_addr = proxy.local_addr().unwrap();
    let (cut, _) = tokio::sync::watch::channel(false);
    let cut_rx = cut.subscribe();
    let forwarding = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = proxy.accept().await {
            let mut cut = cut_rx.clone();
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect("127.0.0.1:5432").await
                else {
                    return;
                };
                tokio::select! {
                    _ = copy_bidirectional(&mut inbound, &mut outbound) => {}
                    _ = cut.wait_for(|c| *c) => {}
                }
            });
        }
    });
    let s = start_with(Db::Postgres, |c| {
        c.storage.url = c
            .storage
            .url
            .replace("127.0.0.1:5432", &proxy_addr.to_string());
    })
    .await;
    s.admin("GET", "/workflows", None).await.ok(200);
    // The database goes away: open connections drop, new ones are refused.
    forwarding.abort();
    let _ = forwarding.await;
    cut.send(true).unwrap();
    let r = s.admin("GET", "/workflows", None).await;
    let e = r.error(503, "SERVICE_UNAVAILABLE");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("storage unavailable"),
        "{e}"
    );
    assert!(r.headers.contains_key("retry-after"), "{:?}", r.headers);
}

/// MariaDB takes at most `max_allowed_packet` bytes in one statement (16 MiB
/// on the test server, its default): a larger definition, still inside the
/// admin body limit, is a 413 naming that limit on create and in an import
/// (whose dry run says so too), not a 503 "retry later" no retry could pass;
/// and the service goes on storing (audit 106).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definition_over_mariadbs_packet_limit_is_a_413() {
    let s = start(Db::MySql).await;
    let task = |i: usize| {
        json!({"id": format!("t{i}"), "name": "t", "function": {"name": "map", "input":
            {"mappings": [{"path": "data.x", "logic": "x".repeat(9000)}]}}})
    };
    let big = json!({"workflow_id": "big", "name": "big",
                     "tasks": (0..2000).map(task).collect::<Vec<_>>()});
    let refused = s.admin("POST", "/workflows", Some(big.clone())).await;
    let message = refused.error(413, "PAYLOAD_TOO_LARGE")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("max_allowed_packet"), "{message}");
    for dry_run in ["true", "false"] {
        let small = json!({"workflow_id": format!("small-{dry_run}"), "name": "s",
                           "tasks": [task(0)]});
        let r = s
            .admin(
                "POST",
                &format!("/workflows/import?dry_run={dry_run}"),
                Some(json!([small, big])),
            )
            .await;
        let data = r.ok(200);
        assert_eq!(
            data["created"],
            json!([format!("small-{dry_run}")]),
            "{data}"
        );
        assert_eq!(data["failed"][0]["index"], 1, "{data}");
        let said = data["failed"][0]["details"][0]["message"].as_str().unwrap();
        assert!(said.contains("max_allowed_packet"), "{said}");
    }
    // Storage goes on working.
    s.admin("GET", "/workflows/small-false", None).await.ok(200);
}

/// An async submission whose payload the operator allowed past MariaDB's
/// `max_allowed_packet` is a 413, not a 503 to retry (audit 106): the
/// server refuses such a statement (error 1153, SQLSTATE 08S01) and may
/// close the connection while it is still being sent, which reads as a
/// lost connection, so the size is judged before sending (a first version
/// that only mapped error 1153 passed alone and failed under CI's load).
/// The next submission is stored as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_over_mariadbs_packet_limit_is_a_413() {
    let s = start_with(Db::MySql, |c| c.ingest.max_payload_size = 24 << 20).await;
    s.deploy(
        json!({"workflow_id": "later", "name": "later", "tasks": [{"id": "t", "name": "t",
               "function": {"name": "filter", "input": {"condition": true}}}]}),
        json!({"channel_id": "later", "name": "later", "channel_type": "async",
               "protocol": "http", "workflow_id": "later", "config_json": {}}),
    )
    .await;
    let big = json!({"data": {"blob": "x".repeat(17 << 20)}});
    let r = s.post("/api/v1/data/later", big).await;
    let message = r.error(413, "PAYLOAD_TOO_LARGE")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("max_allowed_packet"), "{message}");
    assert!(!r.headers.contains_key("retry-after"), "{:?}", r.headers);
    let r = s.post("/api/v1/data/later", json!({"data": {}})).await;
    assert_eq!(r.status, 202, "{}", r.text);
}

/// A db task's query is checked against its connector's database when a
/// workflow is validated or saved: the placeholder style (`?` on
/// PostgreSQL, `$1` on MariaDB) and the number of params. Warnings: the
/// definition is valid, and the connector may change before it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_placeholders_are_checked_against_the_connector() {
    let s = start(Db::Sqlite).await;
    for (name, url) in [
        ("pg", "postgres://postgres@127.0.0.1:5432/test"),
        ("maria", "mariadb://root@127.0.0.1:3306/test"),
        ("lite", "sqlite::memory:"),
        ("hidden", "env://SLUICE_TEST_UNSET_DB_URL"),
    ] {
        s.admin(
            "POST",
            "/connectors",
            Some(json!({"name": name, "connector_type": "db",
                        "config": {"type": "db", "connection_string": url}})),
        )
        .await
        .ok(201);
    }
    let warned = |connector: &str, query: &str, params: Json| {
        let mut w = workflow("q");
        w["tasks"][1] = json!({"id": "read", "name": "read", "function": {"name": "db_read",
            "input": {"connector": connector, "query": query, "params": params}}});
        let s = &s;
        async move {
            let r = s.admin("POST", "/workflows/validate", Some(w)).await;
            r.ok(200)["warnings"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| {
                    format!(
                        "{}: {}",
                        w["field"].as_str().unwrap(),
                        w["message"].as_str().unwrap()
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    let id = json!([{"var": "data.id"}]);
    assert_eq!(
        warned("pg", "SELECT * FROM t WHERE id = ?", id.clone()).await,
        [
            "tasks[1].function.input.query: PostgreSQL placeholders are $1, $2, …; this query has \
          none for the 1 value of params ('?' is the MySQL and SQLite style) (connector 'pg')"
        ]
    );
    assert!(
        warned("pg", "SELECT * FROM t WHERE id = $1", id.clone())
            .await
            .is_empty()
    );
    assert_eq!(
        warned("maria", "SELECT * FROM t WHERE id = $1", id.clone()).await,
        [
            "tasks[1].function.input.query: MySQL and MariaDB placeholders are '?'; $1 is the \
          PostgreSQL style (connector 'maria')"
        ]
    );
    assert_eq!(
        warned("lite", "SELECT * FROM t WHERE a = ? AND b = ?", id.clone()).await,
        [
            "tasks[1].function.input.query: the query has 2 '?' placeholders, but params gives \
          1 value (connector 'lite')"
        ]
    );
    assert!(
        warned("lite", "SELECT '?' FROM t WHERE a = ?", id.clone())
            .await
            .is_empty()
    );
    // A connection string from the environment: the database is not known.
    assert!(
        warned("hidden", "SELECT * FROM t WHERE id = ?", json!([]))
            .await
            .is_empty()
    );
    // Saving answers the same warning.
    let mut w = workflow("saved");
    w["tasks"][1] = json!({"id": "read", "name": "read", "function": {"name": "db_read",
        "input": {"connector": "pg", "query": "SELECT $1, $2", "params": [1]}}});
    let r = s.admin("POST", "/workflows", Some(w)).await;
    r.ok(201);
    assert_eq!(
        r.body["warnings"][0]["message"],
        "the query's placeholders go up to $2, but params gives 1 value (connector 'pg')",
        "{}",
        r.text
    );
}

/// On a service without Kafka, what needs it says so to the API caller
/// (audit 118: only the log did): a workflow publishing to Kafka and a
/// Kafka channel are created, and the channel activated, with a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_work_on_a_service_without_kafka_is_warned_of() {
    let s = start(Db::Sqlite).await;
    let mut wf = workflow("pub");
    wf["tasks"][1] = json!({"id": "send", "name": "send", "function": {"name": "publish_kafka",
        "input": {"connector": "bus", "topic": "orders"}}});
    let r = s.admin("POST", "/workflows", Some(wf)).await;
    r.ok(201);
    let fields: Vec<&str> = r.body["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        [
            "tasks[1].function.name",
            "tasks[1].function.input.connector"
        ],
        "{}",
        r.text
    );
    assert!(
        r.body["warnings"][0]["message"]
            .as_str()
            .unwrap()
            .starts_with("kafka.enabled is false on this service"),
        "{}",
        r.text
    );
    s.admin(
        "PATCH",
        "/workflows/pub/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    let r = s
        .admin(
            "POST",
            "/channels",
            Some(json!({"channel_id": "in", "name": "in", "channel_type": "async",
                        "protocol": "kafka", "workflow_id": "pub", "config_json": {"topic": "orders"}})),
        )
        .await;
    r.ok(201);
    assert_eq!(r.body["warnings"][0]["field"], "protocol", "{}", r.text);
    let r = s
        .admin(
            "PATCH",
            "/channels/in/status",
            Some(json!({"status": "active"})),
        )
        .await;
    assert_eq!(r.ok(200)["status"], "active");
    assert_eq!(
        r.body["warnings"][0]["message"],
        "kafka.enabled is false on this service: nothing is consumed from the topic until it is enabled",
        "{}",
        r.text
    );
    // An HTTP channel's activation answers no warnings.
    s.admin("POST", "/channels", Some(channel("web", "pub")))
        .await
        .ok(201);
    let r = s
        .admin(
            "PATCH",
            "/channels/web/status",
            Some(json!({"status": "active"})),
        )
        .await;
    r.ok(200);
    assert!(r.body.get("warnings").is_none(), "{}", r.text);
}

/// A refused connector or channel names its misspelt fields among its
/// problems (audit 118: `base_url` for `url` answered only `config.url: is
/// required`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_definitions_name_their_misspelt_fields() {
    let s = start(Db::Sqlite).await;
    let r = s
        .admin(
            "POST",
            "/connectors",
            Some(json!({"name": "api", "connector_type": "http",
                        "config": {"type": "http", "base_url": "https://api.example.com"}})),
        )
        .await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(
        r.detail_fields(),
        ["config.url", "config.base_url"],
        "{}",
        r.text
    );
    let mut c = channel("c", "w");
    c.as_object_mut().unwrap().remove("workflow_id");
    c["workflowId"] = json!("w");
    let r = s.admin("POST", "/channels", Some(c)).await;
    r.error(400, "BAD_REQUEST");
    assert_eq!(
        r.detail_fields(),
        ["workflow_id", "workflowId"],
        "{}",
        r.text
    );
}

/// A channel whose route and methods a served channel already has is
/// warned of, naming it (audit 118: three channels on `POST /x` were
/// created and activated without a word).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_another_channel_serves_is_warned_of() {
    let s = start(Db::Sqlite).await;
    s.admin("POST", "/workflows", Some(workflow("w")))
        .await
        .ok(201);
    let route = |id: &str, pattern: &str, methods: Json| {
        json!({"channel_id": id, "name": id, "channel_type": "sync", "protocol": "rest",
               "route_pattern": pattern, "methods": methods, "workflow_id": "w"})
    };
    s.admin(
        "POST",
        "/channels",
        Some(route("first", "/dup/{id}", json!(["POST", "PUT"]))),
    )
    .await
    .ok(201);
    s.admin(
        "PATCH",
        "/channels/first/status",
        Some(json!({"status": "active"})),
    )
    .await
    .ok(200);
    let r = s
        .admin(
            "POST",
            "/channels",
            Some(route("second", "/dup/{key}", json!(["POST"]))),
        )
        .await;
    r.ok(201);
    assert_eq!(
        r.body["warnings"],
        json!([{"field": "route_pattern", "message":
            "channel 'first' already serves POST /dup/{id}: each such request goes to one of the two, by priority, then the channel id first in order"}]),
        "{}",
        r.text
    );
    // Another method, another shape, or the channel's own next version:
    // nothing to say.
    for (id, pattern, methods) in [
        ("third", "/dup/{id}", json!(["GET"])),
        ("fourth", "/dup/{id}/x", json!(["POST"])),
    ] {
        let r = s
            .admin("POST", "/channels", Some(route(id, pattern, methods)))
            .await;
        r.ok(201);
        assert!(r.body.get("warnings").is_none(), "{id}: {}", r.text);
    }
    s.admin("POST", "/channels/first/versions", None)
        .await
        .ok(201);
    let mut next = route("first", "/dup/{id}", json!(["POST"]));
    next.as_object_mut().unwrap().remove("channel_id");
    let r = s.admin("PUT", "/channels/first", Some(next)).await;
    r.ok(200);
    assert!(r.body.get("warnings").is_none(), "{}", r.text);
}

/// A connector registry that does not load fails the reload: the answer
/// says so and the served generation stays, so the next reload loads it
/// (audit 124: the failure was logged, the answer was 200 and the
/// generation moved on, while the replica kept the old connectors).
#[tokio::test]
async fn a_connector_registry_that_does_not_load_fails_the_reload() {
    use sqlx::Connection as _;
    let s = start(Db::Sqlite).await;
    s.admin(
        "POST",
        "/connectors",
        Some(json!({"name": "api", "connector_type": "http",
            "config": {"url": "https://api.example.com"}})),
    )
    .await
    .ok(201);
    let before = s.get("/api/v1/admin/engine/status").await.ok(200)["generation"].clone();
    let mut db = sqlx::SqliteConnection::connect(&s.app.config.storage.url)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE connectors RENAME TO connectors_away")
        .execute(&mut db)
        .await
        .unwrap();
    let r = s.admin("POST", "/connectors/reload", None).await;
    assert!(r.status >= 500, "{} {}", r.status, r.text);
    let after = s.get("/api/v1/admin/engine/status").await.ok(200)["generation"].clone();
    assert_eq!(before, after);
    sqlx::query("ALTER TABLE connectors_away RENAME TO connectors")
        .execute(&mut db)
        .await
        .unwrap();
    let r = s.admin("POST", "/connectors/reload", None).await;
    assert_eq!(r.ok(200)["connectors"], 1, "{}", r.text);
    let now = s.get("/api/v1/admin/engine/status").await.ok(200)["generation"].clone();
    assert!(now.as_i64() > before.as_i64(), "{before} {now}");
}
