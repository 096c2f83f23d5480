//! The processor's HTTP API.
//!
//! - `POST /v1/jobs` accepts a job. An `Idempotency-Key` header makes retries safe: the
//!   first accept answers 201, a retry of the same request 200 with the same job id, the same
//!   key with a different request 409. A body over `accept.max_input_bytes` is refused with
//!   413, an invalid one with 422 naming the field.
//! - `GET /v1/jobs/{id}`: the job as the `jobs` projection holds it.
//! - `POST /v1/jobs/{id}/replay`: runs a quarantined job again with a fresh budget, optionally
//!   with `{"new_input_version": n, "new_input": {...}}`; 202, or 409 if it is not quarantined.
//! - `GET /healthz` (the process runs), `GET /readyz` (Postgres answers).
//!
//! Errors are JSON: `{"error": {"code": "...", "message": "..."}}`.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use jobfold_common::accept::{AcceptError, Acceptor, NewJob};
use jobfold_schemas::event::TraceContext;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// What every handler shares.
#[derive(Debug, Clone)]
pub struct ApiState {
    pub pool: PgPool,
    pub acceptor: Acceptor,
    /// Appends events (replays).
    pub events: crate::store::Events,
    pub policy: jobfold_common::config::Accept,
}

/// The API's routes; request bodies are limited to `max_body` bytes.
pub fn router(state: ApiState, max_body: usize) -> Router {
    Router::new()
        .route("/v1/jobs", post(submit))
        .route("/v1/jobs/{id}", get(job))
        .route("/v1/jobs/{id}/replay", post(replay))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

/// Serves the API on `addr` until `shutdown` is cancelled.
///
/// # Errors
/// The address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(address = %addr, "HTTP API listening.");
    axum::serve(listener, router).with_graceful_shutdown(shutdown.cancelled_owned()).await?;
    Ok(())
}

/// An API error: a status and a JSON body naming what went wrong.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({ "error": { "code": self.code, "message": self.message } });
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<AcceptError> for ApiError {
    fn from(e: AcceptError) -> Self {
        match e {
            AcceptError::Invalid { .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", e.to_string())
            }
            AcceptError::Conflict { .. } => {
                Self::new(StatusCode::CONFLICT, "idempotency_key_reused", e.to_string())
            }
            AcceptError::Encode(_) => {
                tracing::error!(error = %e, "Encoding an event failed.");
                Self::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "encoding the event failed",
                )
            }
            AcceptError::Database(_) => {
                tracing::warn!(error = %e, "Accept failed in the database.");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "the database is unavailable",
                )
            }
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        tracing::warn!(error = %e, "Database query failed.");
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the database is unavailable")
    }
}

/// The body of `POST /v1/jobs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SubmitBody {
    document_id: String,
    kind: String,
    input_version: i64,
    input: serde_json::Value,
}

#[derive(Debug, Serialize)]
struct Submitted {
    job_id: Uuid,
    created: bool,
}

/// The W3C trace context of the request, if it sent one.
fn trace_context(headers: &HeaderMap) -> Option<TraceContext> {
    let traceparent = headers.get("traceparent")?.to_str().ok()?.to_owned();
    let tracestate = headers.get("tracestate").and_then(|v| v.to_str().ok()).map(str::to_owned);
    Some(TraceContext { traceparent, tracestate })
}

async fn submit(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|rejection| {
        let status = rejection.status();
        let code =
            if status == StatusCode::PAYLOAD_TOO_LARGE { "payload_too_large" } else { "bad_body" };
        ApiError::new(status, code, rejection.body_text())
    })?;
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !is_json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the job as Content-Type: application/json",
        ));
    }
    let deserializer = &mut serde_json::Deserializer::from_slice(&body);
    let parsed: SubmitBody = serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = e.path().to_string();
        let message = if path == "." {
            format!("invalid body: {}", e.inner())
        } else {
            format!("invalid field `{path}`: {}", e.inner())
        };
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", message)
    })?;
    let idempotency_key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(v.to_str().map(str::to_owned).map_err(|_| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_field",
                "invalid header `Idempotency-Key`: must be visible ASCII",
            )
        })?),
    };
    let job = NewJob {
        document_id: parsed.document_id,
        kind: parsed.kind,
        input_version: parsed.input_version,
        input: parsed.input,
        idempotency_key,
        trace: trace_context(&headers),
    };
    let accepted = state.acceptor.accept(&state.pool, &job).await?;
    let status = if accepted.created { StatusCode::CREATED } else { StatusCode::OK };
    let location = format!("/v1/jobs/{}", accepted.job_id);
    let body = Submitted { job_id: accepted.job_id, created: accepted.created };
    Ok((status, [(header::LOCATION, location)], axum::Json(body)).into_response())
}

/// A job as the projection holds it.
#[derive(Debug, Serialize, sqlx::FromRow)]
struct JobView {
    job_id: Uuid,
    document_id: String,
    kind: String,
    input_version: i64,
    state: String,
    attempt: i32,
    generation: i64,
    lease_until: Option<DateTime<Utc>>,
    lease_owner: Option<String>,
    next_attempt_at: Option<DateTime<Utc>>,
    accepted_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
    stream_version: i32,
}

async fn job(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<axum::Json<JobView>, ApiError> {
    let not_found = || ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no job {id}"));
    let job_id = Uuid::parse_str(&id).map_err(|_| not_found())?;
    // language=PostgreSQL
    let view: Option<JobView> = sqlx::query_as(
        r#"
        SELECT job_id, document_id, kind, input_version, state::text AS state, attempt,
               generation, lease_until, lease_owner, next_attempt_at, accepted_at,
               finished_at, stream_version
        FROM jobs WHERE job_id = $1
        "#,
    )
    .bind(job_id)
    .fetch_optional(&state.pool)
    .await?;
    view.map(axum::Json).ok_or_else(not_found)
}

async fn replay(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    use crate::store::ReplayError;
    let not_found = || ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no job {id}"));
    let job_id = Uuid::parse_str(&id).map_err(|_| not_found())?;
    let request: crate::store::Replay = if body.is_empty() {
        crate::store::Replay::default()
    } else {
        let deserializer = &mut serde_json::Deserializer::from_slice(&body);
        serde_path_to_error::deserialize(deserializer).map_err(|e| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_field",
                format!("invalid field `{}`: {}", e.path(), e.inner()),
            )
        })?
    };
    let mut tx = state.pool.begin().await?;
    let replayed =
        crate::store::replay(&mut tx, &state.events, &state.policy, job_id, request).await;
    let job = match replayed {
        Ok(job) => job,
        Err(ReplayError::NotFound(_)) => return Err(not_found()),
        Err(e @ ReplayError::NotQuarantined { .. }) => {
            return Err(ApiError::new(StatusCode::CONFLICT, "not_quarantined", e.to_string()));
        }
        Err(e @ (ReplayError::StaleVersion { .. } | ReplayError::InputWithoutVersion)) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_field",
                e.to_string(),
            ));
        }
        Err(ReplayError::Database(e)) => return Err(e.into()),
        Err(ReplayError::Other(e)) => {
            tracing::error!(error = %e, "Replay failed.");
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "replay failed",
            ));
        }
    };
    tx.commit().await?;
    let body =
        json!({ "job_id": job.job_id, "state": "queued", "input_version": job.input_version });
    Ok((StatusCode::ACCEPTED, axum::Json(body)).into_response())
}

async fn ready(State(state): State<ApiState>) -> Result<&'static str, ApiError> {
    sqlx::query("SELECT 1").execute(&state.pool).await?;
    Ok("ready")
}
