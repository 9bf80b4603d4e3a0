//! Logging: tracing with the configured level and format. Each request runs
//! in a span carrying its request id, so every line it logs names it.

use crate::config::{LogFormat, LogLevel, Logging};
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber (once; later calls are ignored).
pub fn init(logging: &Logging) {
    let level = match logging.level {
        LogLevel::Trace => "trace",
        LogLevel::Debug => "debug",
        LogLevel::Info => "info",
        LogLevel::Warn => "warn",
        LogLevel::Error => "error",
    };
    let filter = EnvFilter::new(filter_directives(level));
    // Colours only for a terminal: `sluice serve > log` gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(true)
        .with_ansi(ansi);
    let _ = match logging.format {
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
        // Every field is written on one line: a value that holds a line
        // break or another control character (request data inside an error
        // message, a path, a header) is written with escapes, so it cannot
        // start a line that reads like one of ours. JSON lines escape them
        // as JSON does.
        LogFormat::Pretty => {
            use tracing_subscriber::field::MakeExt;
            let fields = tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
                let raw = format!("{value:?}");
                let text = escape_controls(&raw);
                if field.name() == "message" {
                    write!(w, "{text}")
                } else {
                    write!(w, "{}={text}", field.name())
                }
            })
            .delimited(" ");
            builder.fmt_fields(fields).try_init()
        }
    };
}

/// Library crates log at warn unless asked; ours at the configured level.
/// sqlx's PostgreSQL options module only at error: it logs an unknown URL
/// parameter with its value (`sslpassword=…`) and a malformed pgpass line
/// whole, password included.
fn filter_directives(level: &str) -> String {
    format!(
        "warn,sqlx_postgres::options=error,sluice={level},sluice_runtime={level},sluice::workflow={level}"
    )
}

/// `text` with its control characters (tab aside) and the Unicode line and
/// paragraph separators written as escapes (`\n`, `\r`, `\u{1b}`).
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    let escaped = |c: char| (c.is_control() && c != '\t') || c == '\u{2028}' || c == '\u{2029}';
    if !text.chars().any(escaped) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if escaped(c) => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Metric names: the one list (the spec's set). Label keys are given where
/// each metric is recorded.
pub mod names {
    pub const MESSAGES_TOTAL: &str = "messages_total";
    pub const MESSAGE_DURATION_SECONDS: &str = "message_duration_seconds";
    pub const ACTIVE_WORKFLOWS: &str = "active_workflows";
    pub const ERRORS_TOTAL: &str = "errors_total";
    pub const HTTP_REQUESTS_TOTAL: &str = "http_requests_total";
    pub const HTTP_REQUEST_DURATION_SECONDS: &str = "http_request_duration_seconds";
    pub const DB_QUERY_DURATION_SECONDS: &str = "db_query_duration_seconds";
    pub const ENGINE_RELOADS_TOTAL: &str = "engine_reloads_total";
    pub const ENGINE_RELOAD_DURATION_SECONDS: &str = "engine_reload_duration_seconds";
    pub const CIRCUIT_BREAKER_TRIPS_TOTAL: &str = "circuit_breaker_trips_total";
    pub const CIRCUIT_BREAKER_REJECTIONS_TOTAL: &str = "circuit_breaker_rejections_total";
    pub const CHANNEL_EXECUTIONS_TOTAL: &str = "channel_executions_total";
    pub const RATE_LIMIT_REJECTIONS_TOTAL: &str = "rate_limit_rejections_total";
    pub const GOVERNANCE_BACKEND_ERRORS_TOTAL: &str = "governance_backend_errors_total";

    /// Ours beyond the spec's set.
    pub const EXTRA: &[(&str, &str)] = &[(
        GOVERNANCE_BACKEND_ERRORS_TOTAL,
        "Shared governance backend (Redis) calls that failed, by operation and the direction taken",
    )];

    /// The spec's metrics, for describing them once at start-up.
    pub const ALL: &[(&str, &str)] = &[
        (
            MESSAGES_TOTAL,
            "Data-plane messages processed, by channel and outcome",
        ),
        (
            MESSAGE_DURATION_SECONDS,
            "Time to process one data-plane message, by channel",
        ),
        (
            ACTIVE_WORKFLOWS,
            "Workflow ids with an active version in the live engine",
        ),
        (ERRORS_TOTAL, "Errors by type"),
        (
            HTTP_REQUESTS_TOTAL,
            "HTTP requests by method, route and status",
        ),
        (
            HTTP_REQUEST_DURATION_SECONDS,
            "HTTP request duration by method, route and status",
        ),
        (
            DB_QUERY_DURATION_SECONDS,
            "Storage query duration by operation",
        ),
        (ENGINE_RELOADS_TOTAL, "Engine reloads by outcome"),
        (ENGINE_RELOAD_DURATION_SECONDS, "Engine reload duration"),
        (
            CIRCUIT_BREAKER_TRIPS_TOTAL,
            "Circuit breakers opened, by connector and channel",
        ),
        (
            CIRCUIT_BREAKER_REJECTIONS_TOTAL,
            "Calls rejected by an open breaker, by connector and channel",
        ),
        (CHANNEL_EXECUTIONS_TOTAL, "Workflow executions by channel"),
        (
            RATE_LIMIT_REJECTIONS_TOTAL,
            "Requests rejected by a rate limit, by client",
        ),
    ];
}

static PROMETHEUS: std::sync::OnceLock<Option<metrics_exporter_prometheus::PrometheusHandle>> =
    std::sync::OnceLock::new();

/// Installs the Prometheus recorder once per process (the first caller's
/// choice holds). Returns the handle that renders `/metrics`.
pub fn metrics_handle() -> Option<&'static metrics_exporter_prometheus::PrometheusHandle> {
    PROMETHEUS
        .get_or_init(|| {
            use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
            const BUCKETS: &[f64] = &[
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0,
            ];
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
                .ok()?
                .install_recorder()
                .map_err(|e| tracing::warn!(error = %e, "metrics recorder not installed"))
                .ok()?;
            for (name, help) in names::ALL.iter().chain(names::EXTRA) {
                metrics::describe_counter!(*name, *help);
            }
            // `errors_total` is shown at zero once per error code from the
            // start (every sample carries its `type`), so dashboards and
            // alerts see it before it fires. The counters whose labels are
            // only known at their first event are announced by `render`.
            for code in crate::api::Code::ALL {
                metrics::counter!(names::ERRORS_TOTAL, "type" => code.as_str()).increment(0);
            }
            // And the codes that are not API error codes: the HTTP layer's
            // own refusals (`rejections.rs`) and failed span exports
            // (audit 117: they appeared only when they first happened).
            for code in ["URI_TOO_LONG", "HEADERS_TOO_LARGE", "OTEL_EXPORT"] {
                metrics::counter!(names::ERRORS_TOTAL, "type" => code).increment(0);
            }
            // Both outcomes of a reload likewise (audit 108: the failure
            // series appeared only with the first failure, so an alert on
            // its rate had nothing to compare against).
            for status in ["success", "failure"] {
                metrics::counter!(names::ENGINE_RELOADS_TOTAL, "status" => status).increment(0);
            }
            // Histograms keep raw samples until upkeep folds them into buckets.
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(std::time::Duration::from_secs(5));
                        upkeep.run_upkeep();
                    }
                })
                .ok()?;
            Some(handle)
        })
        .as_ref()
}

/// Counters whose labels name connectors, channels and clients, so none of
/// their series exists before the first event.
const ANNOUNCED: [(&str, &str); 9] = [
    (names::CIRCUIT_BREAKER_TRIPS_TOTAL, "counter"),
    (names::CIRCUIT_BREAKER_REJECTIONS_TOTAL, "counter"),
    (names::RATE_LIMIT_REJECTIONS_TOTAL, "counter"),
    (names::GOVERNANCE_BACKEND_ERRORS_TOTAL, "counter"),
    // Until the first request has been answered (a scrape is counted
    // after its own answer).
    (names::HTTP_REQUESTS_TOTAL, "counter"),
    (names::HTTP_REQUEST_DURATION_SECONDS, "histogram"),
    // Until a channel has served.
    (names::MESSAGES_TOTAL, "counter"),
    (names::MESSAGE_DURATION_SECONDS, "histogram"),
    (names::CHANNEL_EXECUTIONS_TOTAL, "counter"),
];

/// The `/metrics` text. A counter of [`ANNOUNCED`] that has no series yet is
/// announced by its `# HELP` and `# TYPE` lines alone (valid exposition
/// format, a family without samples): a scrape shows every metric of the
/// spec from the start, and every sample carries the labels the spec lists
/// (a zero sample without labels, the earlier way, sat beside the labelled
/// series for good).
pub fn render(handle: &metrics_exporter_prometheus::PrometheusHandle) -> String {
    let mut text = handle.render();
    for (name, kind) in ANNOUNCED {
        let has_series = text.lines().any(|l| {
            l.strip_prefix(name).is_some_and(|rest| {
                rest.starts_with('{') || rest.starts_with(' ') || rest.starts_with("_bucket")
            })
        });
        if !has_series {
            let help = names::ALL
                .iter()
                .chain(names::EXTRA)
                .find(|(n, _)| *n == name)
                .map_or("", |(_, h)| h);
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        }
    }
    text
}

/// Status codes the data plane answers; their metric handles are registered
/// once, so recording a data-plane request takes no registry lookup (and no
/// lock). Other routes and statuses go through the registry.
const DATA_STATUSES: [u16; 14] = [
    200, 202, 204, 400, 404, 405, 409, 413, 415, 429, 500, 502, 503, 504,
];
const DATA_METHODS: [&str; 5] = ["GET", "POST", "PUT", "PATCH", "DELETE"];

type HttpHandles = (metrics::Counter, metrics::Histogram);

static DATA_PLANE_HANDLES: std::sync::OnceLock<Vec<HttpHandles>> = std::sync::OnceLock::new();

fn data_plane_handles() -> &'static [HttpHandles] {
    DATA_PLANE_HANDLES.get_or_init(|| {
        let mut out = Vec::with_capacity(DATA_METHODS.len() * DATA_STATUSES.len());
        for method in DATA_METHODS {
            for status in DATA_STATUSES {
                let labels = [
                    ("method", method.to_owned()),
                    ("path", crate::router::DATA_PLANE_ROUTE.to_owned()),
                    ("status", status.to_string()),
                ];
                out.push((
                    metrics::counter!(names::HTTP_REQUESTS_TOTAL, &labels),
                    metrics::histogram!(names::HTTP_REQUEST_DURATION_SECONDS, &labels),
                ));
            }
        }
        out
    })
}

/// The `method` label: the nine methods of RFC 9110 by name, any other
/// (a caller may send any token as a method, of any length) as `other`, so
/// callers cannot add label values.
fn method_label(method: &http::Method) -> &'static str {
    match method.as_str() {
        "GET" => "GET",
        "POST" => "POST",
        "PUT" => "PUT",
        "PATCH" => "PATCH",
        "DELETE" => "DELETE",
        "HEAD" => "HEAD",
        "OPTIONS" => "OPTIONS",
        "TRACE" => "TRACE",
        "CONNECT" => "CONNECT",
        _ => "other",
    }
}

/// Records one HTTP request in `http_requests_total` and
/// `http_request_duration_seconds`.
pub fn record_http(
    method: &http::Method,
    route: std::borrow::Cow<'static, str>,
    status: http::StatusCode,
    secs: f64,
) {
    if route == crate::router::DATA_PLANE_ROUTE
        && let Some(m) = DATA_METHODS.iter().position(|m| *m == method.as_str())
        && let Some(s) = DATA_STATUSES.iter().position(|s| *s == status.as_u16())
    {
        let (counter, histogram) = &data_plane_handles()[m * DATA_STATUSES.len() + s];
        counter.increment(1);
        histogram.record(secs);
        return;
    }
    let labels = [
        ("method", method_label(method).to_owned()),
        ("path", route.into_owned()),
        ("status", status.as_str().to_owned()),
    ];
    metrics::counter!(names::HTTP_REQUESTS_TOTAL, &labels).increment(1);
    metrics::histogram!(names::HTTP_REQUEST_DURATION_SECONDS, &labels).record(secs);
}

#[cfg(test)]
mod escape_tests {
    /// A value written into a text log line stays one line (request data
    /// cannot start a line that reads like one of ours); tabs stay.
    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(super::escape_controls("plain\ttext"), "plain\ttext");
        assert_eq!(
            super::escape_controls(
                "hello\n2026-11-27T00:00:00Z ERROR sluice: FORGED\r\u{1b}[31m\u{2028}"
            ),
            "hello\\n2026-11-27T00:00:00Z ERROR sluice: FORGED\\r\\u{1b}[31m\\u{2028}"
        );
    }
}

#[cfg(test)]
mod render_tests {
    use super::*;

    /// Before any request the HTTP families are announced with their types
    /// (an `absent()` alert does not fire at start-up); once they have
    /// series the announcement is not repeated.
    #[test]
    fn http_families_are_announced_until_their_first_sample() {
        use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &[0.1, 1.0])
            .unwrap()
            .build_recorder();
        let handle = recorder.handle();
        let text = render(&handle);
        assert!(
            text.contains("# TYPE http_requests_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE http_request_duration_seconds histogram\n"),
            "{text}"
        );
        metrics::with_local_recorder(&recorder, || {
            let labels = [("method", "GET"), ("path", "/healthz"), ("status", "200")];
            metrics::counter!(names::HTTP_REQUESTS_TOTAL, &labels).increment(1);
            metrics::histogram!(names::HTTP_REQUEST_DURATION_SECONDS, &labels).record(0.01);
        });
        let text = render(&handle);
        for name in ["http_requests_total", "http_request_duration_seconds"] {
            let types = text
                .lines()
                .filter(|l| l.starts_with(&format!("# TYPE {name} ")))
                .count();
            assert_eq!(types, 1, "{name}:\n{text}");
        }
    }
}
