//! OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::engine::EngineError;
use crate::service::SubmitError;

/// An error answered to the client.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What is wrong, for a person.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<String>,
    /// A short machine-readable code.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// A 404 `invalid_request_error` about `param` (OpenAI's answer to an unknown model).
    pub fn not_found(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            ..ApiError::invalid(param, message)
        }
    }

    /// Sets the code.
    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// A 500 `server_error`.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match &e {
            SubmitError::Engine(EngineError::TooLong { .. }) => {
                ApiError::invalid(Some("prompt"), e.to_string()).code("context_length_exceeded")
            }
            SubmitError::Engine(EngineError::NoReplyTokens) => {
                ApiError::invalid(Some("max_tokens"), e.to_string())
            }
            SubmitError::Engine(EngineError::EmptyPrompt) => {
                ApiError::invalid(Some("prompt"), e.to_string()).code("empty_prompt")
            }
            SubmitError::Engine(EngineError::BadToken(..)) => {
                ApiError::invalid(Some("prompt"), e.to_string()).code("invalid_token_id")
            }
            SubmitError::Engine(EngineError::QueueFull(_)) => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: e.to_string(),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            SubmitError::Engine(EngineError::Backend(_)) | SubmitError::Stopped => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: e.to_string(),
                kind: "server_error",
                param: None,
                code: Some("engine_unavailable"),
            },
        }
    }
}

/// The `Retry-After` of a 429 (the engine's queue is full), seconds: a slot frees as soon as one reply ends.
pub const RETRY_AFTER_S: u32 = 1;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        }
        r
    }
}
