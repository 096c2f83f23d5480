//! Long jobs over HTTP: a handler answers `202 Accepted` and completes by calling back.
//!
//! The job stays leased to the processor that made the call, whose own heartbeats keep the
//! lease, as for any running attempt. The handler calls
//! - `POST /v1/jobs/{id}/heartbeat` (`kind`, `generation`, optional `progress`) at least
//!   every `callback_timeout`: the attempt is still being worked on;
//! - `POST /v1/jobs/{id}/complete` (`kind`, `generation`, then `result`, or `error` with the
//!   `status` a synchronous answer would have had, its `message` and `retry_after`).
//!
//! Either call may reach any processor of the group. Each is one statement: it locks the
//! job row for a key share (so it waits for a lease transaction still open, and sees what
//! it committed), and writes the `async_attempts` row only while the job is leased at that
//! generation; otherwise it answers 409 with the job's state and generation, so a handler
//! whose lease was lost, cancelled or ended stops. The callback never writes the job: the
//! processor holding the lease finds the outcome (at once when the callback reached it,
//! else at its next look, every [`POLL`]) and commits it with its own generation check,
//! exactly as it commits a synchronous answer. A handler that stops calling back for
//! `callback_timeout` fails its attempt as one whose outcome is unknown.
//!
//! For a kind with a `secret`, both calls must be signed with it ([`crate::signature`]).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::handler::{HandlerError, JobContext};

/// How often a processor looks for the outcome of an attempt it waits for, when the
/// callback reached another processor (one reaching it wakes the wait at once), and checks
/// the handler's last heartbeat.
pub const POLL: Duration = Duration::from_secs(1);

/// The longest `progress` a heartbeat may carry, as JSON.
pub const MAX_PROGRESS_BYTES: usize = 16 * 1024;

tokio::task_local! {
    /// Where the attempt being run may wait for a callback: set by the worker around each
    /// run, so [`crate::remote::Remote`] can take a `202`.
    pub(crate) static SCOPE: Scope;
}

/// What waiting for a callback needs from the processor running the attempt.
#[derive(Debug, Clone)]
pub struct Scope {
    pub pool: PgPool,
    /// The processor's lease owner name.
    pub owner: String,
    /// Where handlers reach this processor's API, without a trailing `/`.
    pub base_url: Arc<str>,
}

impl Scope {
    /// The scope of a processor with `config`, its pool and lease owner name.
    pub fn new(config: &jobfold_common::config::Config, pool: PgPool, owner: String) -> Self {
        let base = config.processor.callback_base_url.clone().unwrap_or_else(|| {
            let addr = config.http_addr;
            if addr.ip().is_unspecified() {
                format!("http://{}:{}", crate::worker::hostname(), addr.port())
            } else {
                format!("http://{addr}")
            }
        });
        Self { pool, owner, base_url: base.trim_end_matches('/').into() }
    }

    /// The heartbeat and completion URLs of `job_id`.
    pub fn urls(&self, job_id: Uuid) -> (String, String) {
        let base = &self.base_url;
        (format!("{base}/v1/jobs/{job_id}/heartbeat"), format!("{base}/v1/jobs/{job_id}/complete"))
    }
}

/// Attempts waiting in this process, by job: a callback that reaches this process wakes its
/// wait at once.
static WAITING: LazyLock<Mutex<HashMap<Uuid, Arc<Notify>>>> = LazyLock::new(Default::default);

/// Removes a wait from [`WAITING`] when it ends, however it ends.
struct Waiting(Uuid);

impl Waiting {
    fn register(job_id: Uuid) -> (Self, Arc<Notify>) {
        let notify = Arc::new(Notify::new());
        WAITING.lock().unwrap_or_else(|e| e.into_inner()).insert(job_id, Arc::clone(&notify));
        (Self(job_id), notify)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.0);
    }
}

/// Wakes the wait of `job_id` if it is in this process.
fn wake(job_id: Uuid) {
    if let Some(notify) = WAITING.lock().unwrap_or_else(|e| e.into_inner()).get(&job_id) {
        notify.notify_one();
    }
}

/// What a handler reported as its attempt's end, as a synchronous answer would have.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Outcome {
    /// 200 with `result`, or the status a failure would have been answered with.
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// Waits, after the handler answered `202` for `job`, for its completion: the outcome it
/// called back with. Bounded by `callback_timeout` between callbacks and by `cancel` (a lost
/// lease, the processor's stop; the run's own time-out drops the wait).
///
/// # Errors
/// Retryable and ambiguous: no callback within `callback_timeout`, cancelled, or the
/// database failed for longer than `callback_timeout`.
pub async fn wait(
    scope: &Scope,
    job: &JobContext,
    callback_timeout: Duration,
    cancel: &CancellationToken,
) -> Result<Outcome, HandlerError> {
    let (_waiting, notify) = Waiting::register(job.job_id);
    // A callback that came before this (a fast handler) wrote the row for this generation
    // already: it is kept.
    let mut recorded = false;
    let mut failing_since: Option<std::time::Instant> = None;
    loop {
        let looked = if recorded {
            look(scope, job, callback_timeout).await
        } else {
            record(scope, job).await.map(|()| {
                recorded = true;
                Looked::Waiting
            })
        };
        match looked {
            Ok(Looked::Done(outcome)) => return Ok(outcome),
            Ok(Looked::Waiting) => failing_since = None,
            Ok(Looked::Silent) => {
                return Err(HandlerError::retryable(format!(
                    "the handler answered 202 and then did not call back for {callback_timeout:?} \
                     (callback_timeout): its outcome is unknown"
                ))
                .ambiguous());
            }
            Ok(Looked::Replaced) => {
                return Err(HandlerError::retryable(
                    "another attempt of the job replaced this one's callback record",
                )
                .ambiguous());
            }
            Err(e) => {
                let since = *failing_since.get_or_insert_with(std::time::Instant::now);
                tracing::warn!(job_id = %job.job_id, error = %e, "Reading a job's callback failed; trying again.");
                if since.elapsed() > callback_timeout {
                    return Err(HandlerError::retryable(format!(
                        "waiting for the handler's callback: the database failed for longer \
                         than callback_timeout: {e}"
                    ))
                    .ambiguous());
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => {
                return Err(HandlerError::retryable(
                    "cancelled while the handler worked on it: the lease was lost, the job \
                     cancelled or the processor is stopping",
                )
                .ambiguous());
            }
            () = notify.notified() => {}
            () = tokio::time::sleep(POLL) => {}
        }
    }
}

enum Looked {
    Done(Outcome),
    Waiting,
    /// No callback for longer than the time-out.
    Silent,
    /// The row is another generation's.
    Replaced,
}

/// Records that `job`'s attempt answered 202: its row, unless a callback of the same
/// generation wrote it first.
async fn record(scope: &Scope, job: &JobContext) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "INSERT INTO async_attempts (job_id, generation, owner) VALUES ($1, $2, $3) \
         ON CONFLICT ON CONSTRAINT async_attempts_pkey DO UPDATE \
         SET generation = EXCLUDED.generation, owner = EXCLUDED.owner, accepted_at = now(), \
             beat_at = now(), progress = NULL, outcome = NULL, completed_at = NULL \
         WHERE async_attempts.generation < EXCLUDED.generation",
        job.job_id,
        job.generation,
        scope.owner,
    )
    .execute(&scope.pool)
    .await?;
    Ok(())
}

async fn look(
    scope: &Scope,
    job: &JobContext,
    callback_timeout: Duration,
) -> Result<Looked, sqlx::Error> {
    let timeout = sqlx::postgres::types::PgInterval::try_from(callback_timeout)
        .unwrap_or(sqlx::postgres::types::PgInterval { months: 0, days: 1, microseconds: 0 });
    let row = sqlx::query!(
        r#"SELECT generation, outcome, clock_timestamp() - beat_at > $2 AS "silent!"
           FROM async_attempts WHERE job_id = $1"#,
        job.job_id,
        timeout,
    )
    .fetch_optional(&scope.pool)
    .await?;
    let Some(row) = row.filter(|r| r.generation == job.generation) else {
        return Ok(Looked::Replaced);
    };
    if let Some(outcome) = row.outcome {
        return Ok(match serde_json::from_value(outcome) {
            Ok(outcome) => Looked::Done(outcome),
            // Written by this module only, checked before it was: not expected.
            Err(e) => Looked::Done(Outcome {
                status: 500,
                result: None,
                error: Some(format!("the recorded completion does not read: {e}")),
                retry_after: None,
            }),
        });
    }
    Ok(if row.silent { Looked::Silent } else { Looked::Waiting })
}

/// A callback's body: the job's kind (the secret that signs it is that kind's) and the
/// generation it was called with.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    pub kind: String,
    pub generation: i64,
    #[serde(default)]
    pub progress: Option<Value>,
}

/// `POST /v1/jobs/{id}/complete`'s body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Complete {
    pub kind: String,
    pub generation: i64,
    #[serde(default)]
    pub result: Option<Value>,
    #[serde(default)]
    pub error: Option<CompleteError>,
}

/// A failed completion: what a synchronous answer would have said.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteError {
    /// 408, 422, 429, 4xx, 5xx: read by the protocol's table, as the status of a
    /// synchronous answer would be.
    pub status: u16,
    #[serde(default)]
    pub message: String,
    /// Seconds; cut to the kind's `max_retry_after` as any `Retry-After`.
    #[serde(default)]
    pub retry_after: Option<u64>,
}

impl Complete {
    /// The outcome to record; `Err` says what is wrong with the body.
    ///
    /// # Errors
    /// Neither or both of `result` and `error`, or an error status outside 400–599.
    pub fn outcome(self) -> Result<Outcome, String> {
        match (self.result, self.error) {
            (Some(result), None) => {
                Ok(Outcome { status: 200, result: Some(result), error: None, retry_after: None })
            }
            (None, Some(e)) if (400..=599).contains(&e.status) => Ok(Outcome {
                status: e.status,
                result: None,
                error: Some(e.message.chars().take(4096).collect()),
                retry_after: e.retry_after,
            }),
            (None, Some(e)) => Err(format!("error.status {} is not a 4xx or 5xx", e.status)),
            _ => Err("give either result or error".into()),
        }
    }
}

/// What a callback found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fenced {
    /// Written: the job is leased at this generation.
    Written,
    /// Not written: the job is in `state` at `generation`.
    Refused { state: String, generation: i64 },
    /// No job of this id and kind.
    NotFound,
}

/// A heartbeat (`outcome` none) or a completion, for `job_id` at `generation`: one
/// statement, fenced by the job row. A completion repeated with the same outcome is
/// written again (an idempotent retry); one with another outcome is refused.
///
/// # Errors
/// The database failed.
pub async fn call_back(
    pool: &PgPool,
    job_id: Uuid,
    kind: &str,
    generation: i64,
    progress: Option<&Value>,
    outcome: Option<&Outcome>,
) -> Result<Fenced, sqlx::Error> {
    let outcome = outcome.map(|o| serde_json::to_value(o).unwrap_or(Value::Null));
    let row = sqlx::query!(
        r#"
        WITH j AS (SELECT job_id, generation, state::text AS state, kind, lease_owner
                   FROM jobs WHERE job_id = $1 FOR KEY SHARE),
        w AS (
            INSERT INTO async_attempts AS a (job_id, generation, owner, progress, outcome,
                                             completed_at)
            SELECT j.job_id, j.generation, j.lease_owner, $4, $5,
                   CASE WHEN $5::jsonb IS NULL THEN NULL ELSE now() END
            FROM j WHERE j.generation = $2 AND j.state = 'leased' AND j.kind = $3
            ON CONFLICT ON CONSTRAINT async_attempts_pkey DO UPDATE
            SET generation = EXCLUDED.generation, owner = EXCLUDED.owner, beat_at = now(),
                progress = CASE WHEN a.generation < EXCLUDED.generation THEN EXCLUDED.progress
                                ELSE coalesce(EXCLUDED.progress, a.progress) END,
                outcome = CASE WHEN a.generation < EXCLUDED.generation THEN EXCLUDED.outcome
                               ELSE coalesce(EXCLUDED.outcome, a.outcome) END,
                completed_at = CASE WHEN a.generation < EXCLUDED.generation
                                    THEN EXCLUDED.completed_at
                                    ELSE coalesce(a.completed_at, EXCLUDED.completed_at) END
            WHERE a.generation < EXCLUDED.generation
               OR (a.generation = EXCLUDED.generation
                   AND (a.outcome IS NULL OR EXCLUDED.outcome IS NULL
                        OR a.outcome = EXCLUDED.outcome))
            RETURNING a.job_id
        )
        SELECT j.generation, j.state AS "state!", j.kind,
               EXISTS (SELECT 1 FROM w) AS "written!"
        FROM j
        "#,
        job_id,
        generation,
        kind,
        progress,
        outcome,
    )
    .fetch_optional(pool)
    .await?;
    let Some(row) = row.filter(|r| r.kind == kind) else {
        return Ok(Fenced::NotFound);
    };
    if row.written {
        wake(job_id);
        Ok(Fenced::Written)
    } else {
        Ok(Fenced::Refused { state: row.state, generation: row.generation })
    }
}

/// Deletes the callback records of attempts that ended: their job is no longer leased at
/// their generation, and nothing called back for a minute. How many went.
///
/// # Errors
/// The database failed.
pub async fn forget_ended(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let done = sqlx::query!(
        "DELETE FROM async_attempts a \
         WHERE a.beat_at < now() - interval '1 minute' \
           AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.job_id = a.job_id \
                           AND j.generation = a.generation AND j.state = 'leased')"
    )
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}
