//! What operators read: a job with its event history, and the quarantine. From Postgres,
//! the authority — never from Kafka. The HTTP API and the `jobfold` command line share
//! these queries.

use chrono::{DateTime, Utc};
use jobfold_schemas::{Decoder, JobEvent};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

/// A job as the projection holds it, with why it stopped if it is quarantined.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct JobStatus {
    pub job_id: Uuid,
    pub document_id: String,
    pub kind: String,
    pub input_version: i64,
    pub state: String,
    pub attempt: i32,
    pub max_attempts: i32,
    pub generation: i64,
    pub lease_until: Option<DateTime<Utc>>,
    pub lease_owner: Option<String>,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub deadline: Option<DateTime<Utc>>,
    pub accepted_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub stream_version: i32,
    pub idempotency_key: Option<String>,
    /// Set while the job is quarantined.
    pub quarantine_reason: Option<String>,
    pub quarantine_owner: Option<String>,
}

/// The job, if it exists.
///
/// # Errors
/// The database failed.
pub async fn job(pool: &PgPool, job_id: Uuid) -> Result<Option<JobStatus>, sqlx::Error> {
    // language=PostgreSQL
    sqlx::query_as(
        r#"
        SELECT j.job_id, j.document_id, j.kind, j.input_version, j.state::text AS state,
               j.attempt, j.max_attempts, j.generation, j.lease_until, j.lease_owner,
               j.next_attempt_at, j.deadline, j.accepted_at, j.finished_at, j.last_error,
               j.stream_version, j.idempotency_key,
               q.reason AS quarantine_reason, q.owner AS quarantine_owner
        FROM jobs j LEFT JOIN quarantine q USING (job_id)
        WHERE j.job_id = $1
        "#,
    )
    .bind(job_id)
    .fetch_optional(pool)
    .await
}

/// One event of a job's history.
#[derive(Debug, Clone, Serialize)]
pub struct EventEntry {
    /// Position in the whole log.
    pub seq: i64,
    pub stream_version: i32,
    pub kind: String,
    pub occurred_at: DateTime<Utc>,
    /// When the relay published it, for a delayed event (a scheduled retry's `RetryDue`, sent
    /// through the outbox) until its outbox row is pruned; `None` otherwise.
    pub published_at: Option<DateTime<Utc>>,
    pub published: bool,
    /// The whole event, as [`JobEvent::to_json`] writes it.
    pub event: serde_json::Value,
}

/// The job's events in stream order; `None` if there is no such job.
///
/// # Errors
/// The database failed, or an event does not decode (the registry is unreachable).
pub async fn events(
    pool: &PgPool,
    decoder: &Decoder<JobEvent>,
    job_id: Uuid,
) -> anyhow::Result<Option<Vec<EventEntry>>> {
    // language=PostgreSQL
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM jobs WHERE job_id = $1)")
        .bind(job_id)
        .fetch_one(pool)
        .await?;
    if !exists {
        return Ok(None);
    }
    type Row = (i64, i32, String, DateTime<Utc>, Vec<u8>, Option<DateTime<Utc>>, bool);
    // language=PostgreSQL
    let rows: Vec<Row> = sqlx::query_as(
        r#"
        SELECT e.seq, e.stream_version, e.kind, e.occurred_at, e.body, o.published_at,
               CASE WHEN e.delayed THEN o.seq IS NULL OR o.published_at IS NOT NULL
                    ELSE (e.xid, e.seq) <= (c.published_xid, c.published_seq)
               END AS published
        FROM job_events e LEFT JOIN outbox o USING (seq) CROSS JOIN relay_cursor c
        WHERE e.job_id = $1
        ORDER BY e.stream_version
        "#,
    )
    .bind(job_id)
    .fetch_all(pool)
    .await?;
    let mut entries = Vec::with_capacity(rows.len());
    for (seq, stream_version, kind, occurred_at, body, published_at, published) in rows {
        let event = decoder.decode(&body).await?;
        entries.push(EventEntry {
            seq,
            stream_version,
            kind,
            occurred_at,
            published_at,
            published,
            event: event.to_json(),
        });
    }
    Ok(Some(entries))
}

/// Which quarantined jobs to list.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuarantineFilter {
    /// Only this owner's.
    pub owner: Option<String>,
    /// Only this job kind.
    pub kind: Option<String>,
    /// Only reasons containing this text (case-insensitive).
    pub reason: Option<String>,
    /// At most this many, newest first (default 50, at most 1000).
    pub limit: Option<i64>,
}

/// A quarantined job, waiting for its owner.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Quarantined {
    pub job_id: Uuid,
    pub kind: String,
    pub document_id: String,
    pub input_version: i64,
    pub error_class: String,
    pub owner: String,
    pub attempts: i32,
    pub reason: String,
    pub quarantined_at: DateTime<Utc>,
}

/// Most rows one listing returns.
pub const QUARANTINE_LIMIT_MAX: i64 = 1000;

/// Quarantined jobs matching `filter`, newest first.
///
/// # Errors
/// The database failed.
pub async fn quarantined(
    pool: &PgPool,
    filter: &QuarantineFilter,
) -> Result<Vec<Quarantined>, sqlx::Error> {
    let limit = filter.limit.unwrap_or(50).clamp(1, QUARANTINE_LIMIT_MAX);
    // language=PostgreSQL
    sqlx::query_as(
        r#"
        SELECT q.job_id, j.kind, j.document_id, q.input_version, q.error_class, q.owner,
               q.attempts, q.reason, q.quarantined_at
        FROM quarantine q JOIN jobs j USING (job_id)
        WHERE ($1::text IS NULL OR q.owner = $1)
          AND ($2::text IS NULL OR j.kind = $2)
          AND ($3::text IS NULL OR q.reason ILIKE '%' || $3 || '%')
        ORDER BY q.quarantined_at DESC
        LIMIT $4
        "#,
    )
    .bind(&filter.owner)
    .bind(&filter.kind)
    .bind(&filter.reason)
    .bind(limit)
    .fetch_all(pool)
    .await
}
