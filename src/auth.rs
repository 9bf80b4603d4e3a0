//! Admin authentication: optional API keys, compared in constant time.
//!
//! With `admin_auth.enabled`, every admin request (and `/metrics`) must carry
//! `Authorization: Bearer <key>` or the key in the `admin_auth.api_key_header`
//! header. `api_key` grants everything; `read_only_api_key` grants GET only.
//! Keys are never logged or echoed.

use crate::api::{ApiError, Code};
use crate::config::AdminAuth;
use crate::server::Req;
use http::Method;
use subtle::ConstantTimeEq;

/// Who made an admin request, as audit entries record it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Principal {
    Anonymous,
    Admin,
    ReadOnly,
}

impl Principal {
    pub fn as_str(self) -> &'static str {
        match self {
            Principal::Anonymous => "anonymous",
            Principal::Admin => "admin",
            Principal::ReadOnly => "read_only",
        }
    }
}

fn same(a: &str, b: &str) -> bool {
    !b.is_empty() && a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// Checks the credentials of an admin request.
pub fn authenticate(config: &AdminAuth, req: &Req) -> Result<Principal, ApiError> {
    authenticate_head(config, &req.method, &req.headers)
}

/// The same check from the request head alone: the server runs it before it
/// reads or judges the body, so an unauthenticated caller gets 401 (and a
/// read-only key 403), never a 413 or 415 about a body it may not send.
pub fn authenticate_head(
    config: &AdminAuth,
    method: &Method,
    headers: &http::HeaderMap,
) -> Result<Principal, ApiError> {
    if !config.enabled {
        return Ok(Principal::Anonymous);
    }
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let authorization = header("authorization");
    // The scheme is case-insensitive (RFC 9110 §11.1).
    let bearer = authorization
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, key)| key.trim());
    let header_key = header(&config.api_key_header.to_ascii_lowercase());
    let Some(key) = bearer.or(header_key) else {
        let bare_bearer = authorization.is_some_and(|v| v.trim().eq_ignore_ascii_case("bearer"));
        let message = if bare_bearer {
            format!(
                "missing credentials: the Bearer token is empty (Authorization: Bearer <key>, or the key in {})",
                config.api_key_header
            )
        } else if authorization.is_some() {
            format!(
                "unsupported credentials: Authorization must use the Bearer scheme \
                 (Authorization: Bearer <key>), or send the key in {}",
                config.api_key_header
            )
        } else {
            format!(
                "missing credentials: send Authorization: Bearer <key>, or the key in {}",
                config.api_key_header
            )
        };
        return Err(ApiError::new(Code::Unauthorized, message));
    };
    let role = |key: &str| {
        if same(key, &config.api_key) {
            Some(Principal::Admin)
        } else if same(key, &config.read_only_api_key) {
            Some(Principal::ReadOnly)
        } else {
            None
        }
    };
    let Some(mut principal) = role(key) else {
        return Err(ApiError::new(Code::Unauthorized, "invalid credentials"));
    };
    // An `Authorization` header that holds no Bearer key (another scheme,
    // an empty token) beside a key header is a wrong credential, not one
    // to pass over: sent alone it is a 401 too.
    if authorization.is_some() && bearer.is_none_or(str::is_empty) {
        return Err(ApiError::new(
            Code::Unauthorized,
            "invalid credentials: Authorization must hold a Bearer key (Authorization: Bearer <key>)",
        ));
    }
    // Both forms sent: each must hold, and the lesser role applies (a wrong
    // key in one was ignored when the other was right).
    if let (Some(_), Some(other)) = (bearer, header_key) {
        match role(other) {
            None => {
                return Err(ApiError::new(
                    Code::Unauthorized,
                    format!(
                        "invalid credentials: the key in {} does not match",
                        config.api_key_header
                    ),
                ));
            }
            Some(Principal::ReadOnly) => principal = Principal::ReadOnly,
            Some(_) => {}
        }
    }
    if principal == Principal::ReadOnly && method != Method::GET && method != Method::HEAD {
        return Err(ApiError::new(
            Code::Forbidden,
            "the read-only key allows GET requests only",
        ));
    }
    Ok(principal)
}
