//! Every error of the REST API is an RFC 9457 problem (`application/problem+json`),
//! and every gRPC status becomes one here, and only here.

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use serde::Serialize;
use tonic::{Code, Status};
use utoipa::ToSchema;

use crate::status::{FIELD_METADATA, LEADER_METADATA, REASON_CODE_METADATA};
use rota_client::wire::RETRY_AFTER_METADATA;

pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// An RFC 9457 problem: what went wrong, for programs (`type`, `status`,
/// `field`, `code`) and for people (`title`, `detail`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Problem {
    /// A URI naming the kind of problem (`urn:rota:problem:KIND`).
    #[serde(rename = "type")]
    pub kind: String,
    /// The kind of problem, for people.
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// What went wrong this time, for people.
    pub detail: String,
    /// The input field at fault (`spec.gpus_per_replica`), when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The stable, machine-readable reason (`quota_exhausted`), when there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// How long to wait before trying again, milliseconds (429 and 503).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// The leader's address, when this replica could not reach it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leader: Option<String>,
}

impl Problem {
    pub fn new(status: StatusCode, kind: &str, detail: impl Into<String>) -> Problem {
        Problem {
            kind: format!("urn:rota:problem:{kind}"),
            title: status.canonical_reason().unwrap_or("Error").to_string(),
            status: status.as_u16(),
            detail: detail.into(),
            field: None,
            code: None,
            retry_after_ms: None,
            leader: None,
        }
    }

    /// Bad input in `field`.
    pub fn invalid(field: &str, detail: impl Into<String>) -> Problem {
        Problem { field: Some(field.to_string()), ..Problem::new(StatusCode::BAD_REQUEST, "invalid_argument", detail) }
    }

    pub fn too_large(limit_bytes: usize) -> Problem {
        Problem::new(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", format!("the request body is larger than {limit_bytes} bytes"))
    }

    pub fn not_found(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::NOT_FOUND, "not_found", detail)
    }

    fn http_status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

/// The HTTP status and problem kind of a gRPC code.
pub fn http_of(code: Code) -> (StatusCode, &'static str) {
    match code {
        Code::InvalidArgument | Code::OutOfRange => (StatusCode::BAD_REQUEST, "invalid_argument"),
        Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "unauthenticated"),
        Code::PermissionDenied => (StatusCode::FORBIDDEN, "permission_denied"),
        Code::NotFound => (StatusCode::NOT_FOUND, "not_found"),
        Code::AlreadyExists => (StatusCode::CONFLICT, "already_exists"),
        Code::FailedPrecondition | Code::Aborted => (StatusCode::CONFLICT, "conflict"),
        Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "resource_exhausted"),
        Code::Unavailable | Code::Cancelled => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "deadline_exceeded"),
        Code::Unimplemented => (StatusCode::NOT_IMPLEMENTED, "unimplemented"),
        Code::Ok | Code::Unknown | Code::Internal | Code::DataLoss => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    }
}

/// A field name at the head of a message ("limit: at most 10000"), the way
/// the services name the field of bad input they check themselves.
fn leading_field(message: &str) -> Option<&str> {
    let (head, _) = message.split_once(": ")?;
    let is_field = !head.is_empty()
        && head.len() <= 64
        && head.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'.' || b == b'-');
    is_field.then_some(head)
}

impl From<Status> for Problem {
    fn from(status: Status) -> Problem {
        let (http, kind) = http_of(status.code());
        let metadata = status.metadata();
        let text = |key: &str| metadata.get(key).and_then(|v| v.to_str().ok()).map(str::to_string);
        let field = text(FIELD_METADATA)
            .or_else(|| (status.code() == Code::InvalidArgument).then(|| leading_field(status.message()).map(str::to_string)).flatten());
        Problem {
            field,
            code: text(REASON_CODE_METADATA),
            retry_after_ms: text(RETRY_AFTER_METADATA).and_then(|v| v.parse().ok()),
            leader: text(LEADER_METADATA),
            ..Problem::new(http, kind, status.message())
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.http_status();
        let retry_after_s = self.retry_after_ms.map(|ms| ms.div_ceil(1_000).max(1));
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_CONTENT_TYPE));
        if let Some(seconds) = retry_after_s.and_then(|s| HeaderValue::try_from(s.to_string()).ok()) {
            headers.insert(header::RETRY_AFTER, seconds);
        }
        if status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_http_with_their_field() {
        let mut status = Status::invalid_argument("spec.replicas: must be 1..=4096");
        status.metadata_mut().insert(FIELD_METADATA, "spec.replicas".parse().unwrap());
        let problem = Problem::from(status);
        assert_eq!((problem.status, problem.field.as_deref()), (400, Some("spec.replicas")));
        let problem = Problem::from(Status::invalid_argument("limit: at most 10000"));
        assert_eq!(problem.field.as_deref(), Some("limit"), "a field at the head of the message");
        assert_eq!(Problem::from(Status::invalid_argument("Some text: not a field")).field, None);
        assert_eq!(Problem::from(Status::unauthenticated("no")).status, 401);
        assert_eq!(Problem::from(Status::permission_denied("no")).status, 403);
        assert_eq!(Problem::from(Status::not_found("job 9 not found")).status, 404);
        assert_eq!(Problem::from(Status::already_exists("reused")).status, 409);
        assert_eq!(Problem::from(Status::failed_precondition("state")).status, 409);
        assert_eq!(Problem::from(Status::unavailable("no leader")).status, 503);
        assert_eq!(Problem::from(Status::internal("bug")).status, 500);
        let mut limited = Status::resource_exhausted("too many");
        limited.metadata_mut().insert(RETRY_AFTER_METADATA, "1500".parse().unwrap());
        let problem = Problem::from(limited);
        assert_eq!((problem.status, problem.retry_after_ms), (429, Some(1_500)));
        let response = problem.into_response();
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_CONTENT_TYPE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
    }
}
