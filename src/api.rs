//! The HTTP edge: the error envelope and JSON responses. This is the one place
//! where errors of every layer (storage, validation, execution, the request
//! itself) become HTTP statuses and `{error: {code, message, details?}}`.

use crate::storage::StorageError;
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::Full;
use serde::Serialize;
use sluice_compiler::diag::Diagnostic;

pub type Body = Full<Bytes>;
pub type HttpResponse = Response<Body>;

/// Stable error codes (the spec's table plus the decisions' additions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    NotFound,
    BadRequest,
    Unauthorized,
    Forbidden,
    Conflict,
    RateLimited,
    Timeout,
    ServiceUnavailable,
    UnsupportedMediaType,
    PayloadTooLarge,
    RequestTimeout,
    MethodNotAllowed,
    UpstreamError,
    TaskError,
    InternalError,
}

impl Code {
    pub const ALL: [Code; 15] = [
        Code::NotFound,
        Code::BadRequest,
        Code::Unauthorized,
        Code::Forbidden,
        Code::Conflict,
        Code::RateLimited,
        Code::Timeout,
        Code::ServiceUnavailable,
        Code::UnsupportedMediaType,
        Code::PayloadTooLarge,
        Code::RequestTimeout,
        Code::MethodNotAllowed,
        Code::UpstreamError,
        Code::TaskError,
        Code::InternalError,
    ];

    /// Whether an error of this code (as written in an `errors` item) is
    /// the caller's: a 4xx, or a failed validation.
    pub fn is_callers(code: &str) -> bool {
        code == "VALIDATION_ERROR"
            || Code::ALL
                .iter()
                .any(|c| c.as_str() == code && c.status().is_client_error())
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Code::NotFound => "NOT_FOUND",
            Code::BadRequest => "BAD_REQUEST",
            Code::Unauthorized => "UNAUTHORIZED",
            Code::Forbidden => "FORBIDDEN",
            Code::Conflict => "CONFLICT",
            Code::RateLimited => "RATE_LIMITED",
            Code::Timeout => "TIMEOUT",
            Code::ServiceUnavailable => "SERVICE_UNAVAILABLE",
            Code::UnsupportedMediaType => "UNSUPPORTED_MEDIA_TYPE",
            Code::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            Code::RequestTimeout => "REQUEST_TIMEOUT",
            Code::MethodNotAllowed => "METHOD_NOT_ALLOWED",
            Code::UpstreamError => "UPSTREAM_ERROR",
            Code::TaskError => "TASK_ERROR",
            Code::InternalError => "INTERNAL_ERROR",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::BadRequest => StatusCode::BAD_REQUEST,
            Code::Unauthorized => StatusCode::UNAUTHORIZED,
            Code::Forbidden => StatusCode::FORBIDDEN,
            Code::Conflict => StatusCode::CONFLICT,
            Code::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            Code::Timeout => StatusCode::GATEWAY_TIMEOUT,
            Code::ServiceUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Code::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Code::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Code::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Code::UpstreamError => StatusCode::BAD_GATEWAY,
            Code::TaskError | Code::InternalError => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// An error answer. `details` is only present for multi-problem errors.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: Code,
    pub message: String,
    pub details: Option<Vec<Diagnostic>>,
    /// Extra members of `error` (e.g. `task_id` for a failed task).
    pub task_id: Option<String>,
    /// `Retry-After` seconds, for 429 and 503.
    pub retry_after: Option<u64>,
    /// The `Allow` header of a 405: the methods the path takes.
    pub allow: Option<std::borrow::Cow<'static, str>>,
}

impl ApiError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            details: None,
            task_id: None,
            retry_after: None,
            allow: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(Code::BadRequest, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::InternalError, message)
    }

    /// Strict validation failed: 400 with every problem in `details`.
    pub fn invalid(what: &str, details: Vec<Diagnostic>) -> Self {
        let n = details.len();
        let message = format!(
            "{what} is invalid: {n} problem{}",
            if n == 1 { "" } else { "s" }
        );
        ApiError {
            details: Some(details),
            ..Self::bad_request(message)
        }
    }

    pub fn with_details(mut self, details: Vec<Diagnostic>) -> Self {
        self.details = Some(details);
        self
    }

    pub fn with_task(mut self, task_id: impl Into<String>) -> Self {
        self.task_id = Some(task_id.into());
        self
    }

    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// 405: `method` is not one of `allow` (a comma-separated list, sent as
    /// the `Allow` header).
    pub fn method_not_allowed(method: &http::Method, path: &str, allow: &'static str) -> Self {
        ApiError {
            allow: Some(allow.into()),
            ..Self::new(
                Code::MethodNotAllowed,
                format!("method {method} is not allowed on {path}; it takes {allow}"),
            )
        }
    }

    /// The envelope as JSON.
    pub fn body(&self) -> serde_json::Value {
        let mut error = serde_json::json!({"code": self.code.as_str(), "message": self.message});
        if let Some(task_id) = &self.task_id {
            error["task_id"] = serde_json::Value::String(task_id.clone());
        }
        if let Some(details) = &self.details {
            error["details"] = serde_json::to_value(details).unwrap_or_default();
        }
        serde_json::json!({ "error": error })
    }

    pub fn into_response(self) -> HttpResponse {
        metrics::counter!(crate::telemetry::names::ERRORS_TOTAL, "type" => self.code.as_str())
            .increment(1);
        // Failures on our side or upstream (500, 502, 504) are logged by
        // the server with the request id (`Failure`); refusals of the
        // caller's request are for the caller, logged at debug.
        let status = self.code.status();
        let failure = matches!(status.as_u16(), 500 | 502 | 504).then(|| Failure {
            code: self.code.as_str(),
            task_id: self.task_id.clone().unwrap_or_default(),
            message: self.message.clone(),
            channel: String::new(),
        });
        if failure.is_none() {
            tracing::debug!(code = self.code.as_str(), error = %self.message, "request refused");
        }
        let mut response = json_response(self.code.status(), &self.body());
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Some(allow) = self.allow {
            let value = match allow {
                std::borrow::Cow::Borrowed(s) => Some(HeaderValue::from_static(s)),
                std::borrow::Cow::Owned(s) => HeaderValue::try_from(s).ok(),
            };
            if let Some(value) = value {
                response.headers_mut().insert(header::ALLOW, value);
            }
        }
        if let Some(failure) = failure {
            response.extensions_mut().insert(failure);
        }
        if self.code == Code::Unauthorized {
            // RFC 9110 §11.6.1: a 401 names the scheme it wants (an API key
            // in `X-API-Key` is also taken; see docs/decisions.md).
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"sluice-admin\""),
            );
        }
        response
    }
}

impl From<StorageError> for ApiError {
    fn from(e: StorageError) -> Self {
        match e {
            StorageError::NotFound(m) => ApiError::new(Code::NotFound, m),
            StorageError::Conflict(m) => ApiError::new(Code::Conflict, m),
            StorageError::BadRequest(m) => ApiError::new(Code::BadRequest, m),
            StorageError::Invalid(m, details) => {
                ApiError::new(Code::BadRequest, m).with_details(details)
            }
            StorageError::Database(m) => {
                tracing::error!(error = %m, "storage error");
                ApiError::internal("storage error; see the service log")
            }
            StorageError::Unavailable(m) => {
                tracing::error!(error = %m, "storage unavailable");
                let mut e = ApiError::new(
                    Code::ServiceUnavailable,
                    "storage unavailable; retry later (see the service log)",
                );
                e.retry_after = Some(1);
                e
            }
            StorageError::TooLarge(m) => ApiError::new(Code::PayloadTooLarge, m),
            StorageError::Backup(m) => {
                tracing::error!(error = %m, "backup directory unusable");
                ApiError::internal(format!("{m} (storage.backup_dir)"))
            }
        }
    }
}

pub type ApiResult = Result<HttpResponse, ApiError>;

/// A JSON response with the given status.
pub fn json_response<T: Serialize + ?Sized>(status: StatusCode, body: &T) -> HttpResponse {
    bytes_response(status, Bytes::from(to_json_bytes(body)))
}

/// Compact JSON with numbers written as the data plane writes them
/// (JavaScript's `JSON.stringify`): a trace's or a dry run's `data` reads
/// the same as the sync answer would (`18446744073709552000`, `1e21`; audit
/// 66: serde_json wrote `1.8446744073709552e+19`, `1e+21`).
pub fn to_json_bytes<T: Serialize + ?Sized>(body: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, JsNumbers);
    match body.serialize(&mut serializer) {
        Ok(()) => out,
        Err(_) => b"{}".to_vec(),
    }
}

/// serde_json's compact output, floats aside.
struct JsNumbers;

impl serde_json::ser::Formatter for JsNumbers {
    fn write_f64<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        value: f64,
    ) -> std::io::Result<()> {
        let mut text = Vec::with_capacity(32);
        sluice_compiler::value::write_float(value, &mut text);
        writer.write_all(&text)
    }
}

/// A response whose body is already JSON text.
pub fn bytes_response(status: StatusCode, body: Bytes) -> HttpResponse {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    *response.headers_mut() = JSON_HEADERS.clone();
    response
}

/// The headers of a JSON answer, built once: the content type, the security
/// headers and the request id slot that `server::finish` fills in. Cloning
/// the map costs one allocation pair; inserting the six headers one by one
/// hashed every name on every answer.
static JSON_HEADERS: std::sync::LazyLock<http::HeaderMap> = std::sync::LazyLock::new(|| {
    let mut headers = http::HeaderMap::with_capacity(6);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    crate::server::security_headers(&mut headers);
    crate::server::request_id_slot(&mut headers);
    headers
});

/// `{data: ...}` with 200.
pub fn ok<T: Serialize + ?Sized>(data: &T) -> ApiResult {
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({ "data": data }),
    ))
}

/// `{data: ...}` with 201.
pub fn created<T: Serialize + ?Sized>(data: &T) -> ApiResult {
    Ok(json_response(
        StatusCode::CREATED,
        &serde_json::json!({ "data": data }),
    ))
}

/// 204 with no body.
pub fn no_content() -> ApiResult {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = StatusCode::NO_CONTENT;
    Ok(response)
}

/// A list page: `{data, total, limit, offset}`.
pub fn page(data: Vec<serde_json::Value>, total: i64, limit: i64, offset: i64) -> ApiResult {
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({"data": data, "total": total, "limit": limit, "offset": offset}),
    ))
}

/// A JSON document as is (no `{data}` wrapper), with 200.
pub fn ok_raw(body: &serde_json::Value) -> ApiResult {
    Ok(json_response(StatusCode::OK, body))
}

/// An embedded documentation asset, with the relaxed CSP the docs page needs
/// for its own script (nothing else is relaxed).
pub fn static_asset(text: &'static str, content_type: &'static str) -> HttpResponse {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(crate::openapi::DOCS_CSP),
    );
    response
}

/// What a failed answer (500, 502, 504) says, for the server's log line
/// (`server::handle`, which knows the request id).
#[derive(Debug, Clone)]
pub struct Failure {
    pub code: &'static str,
    pub task_id: String,
    pub message: String,
    /// The data-plane channel that failed (empty elsewhere).
    pub channel: String,
}

/// At most ten failure lines a second (the second and the count so far,
/// packed in one atomic). `Some(left_out)` when this line may be written:
/// how many were left out since the last one written.
pub(crate) fn failure_log_allowed() -> Option<u64> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static WINDOW: AtomicU64 = AtomicU64::new(0);
    static LEFT_OUT: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let second = START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs();
    let mut current = WINDOW.load(Ordering::Relaxed);
    loop {
        let (at, count) = (current >> 8, current & 0xff);
        let next = if at == second {
            if count >= 10 {
                LEFT_OUT.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            current + 1
        } else {
            (second << 8) | 1
        };
        match WINDOW.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(LEFT_OUT.swap(0, Ordering::Relaxed)),
            Err(seen) => current = seen,
        }
    }
}

#[cfg(test)]
mod tests {
    /// Admin and trace answers write numbers as the data plane does.
    #[test]
    fn answers_write_numbers_like_the_data_plane() {
        let body = serde_json::json!({"big": 18446744073709551616.0_f64, "a": 1.1e20 * 1.0,
            "d": 1e21, "small": 0.1, "i": -5, "u": u64::MAX, "x": [1.5, -0.0]});
        let text = String::from_utf8(super::to_json_bytes(&body)).unwrap();
        assert_eq!(
            text,
            r#"{"big":18446744073709552000,"a":110000000000000000000,"d":1e21,"small":0.1,"i":-5,"u":18446744073709551615,"x":[1.5,0]}"#
        );
    }
}
