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

/// How often a processor looks for the outcomes of the attempts it waits for, when the
/// callback reached another processor (one reaching it wakes the wait at once), and checks
/// their handlers' last heartbeats: one statement for all of them.
pub const POLL: Duration = Duration::from_secs(1);

/// The attempts one look reads at most in one statement.
const LOOK_CHUNK: usize = 5_000;

/// The longest `progress` a heartbeat may carry, as JSON.
pub const MAX_PROGRESS_BYTES: usize = 16 * 1024;

tokio::task_local! {
    /// Where the attempt being run may wait for a callback: set by the worker around each
    /// run, so [`crate::remote::Remote`] can take a `202`.
    pub(crate) static SCOPE: Arc<Scope>;
}

/// What waiting for a callback needs from the processor running the attempt.
#[derive(Debug, Clone)]
pub struct Scope {
    pub pool: PgPool,
    /// The processor's lease owner name.
    pub owner: String,
    /// Where handlers reach this processor's API, without a trailing `/`.
    pub base_url: Arc<str>,
    waiters: Arc<Waiters>,
}

impl Scope {
    /// The scope of a processor with `config`, its pool and lease owner name, on the host
    /// named `host`; starts the task that looks for the outcomes of its waits in `work` (it
    /// ends within a [`POLL`] of the last clone's drop).
    pub fn new(
        config: &jobfold_common::config::Config,
        pool: PgPool,
        owner: String,
        host: &str,
        work: &crate::supervise::Work,
    ) -> Self {
        let base = config.processor.callback_base_url.clone().unwrap_or_else(|| {
            let addr = config.http_addr;
            if addr.ip().is_unspecified() {
                format!("http://{host}:{}", addr.port())
            } else {
                format!("http://{addr}")
            }
        });
        let waiters = Arc::new(Waiters { pool: pool.clone(), waiting: Mutex::default() });
        work.spawn("callback look", look_for_outcomes(Arc::downgrade(&waiters)));
        Self { pool, owner, base_url: base.trim_end_matches('/').into(), waiters }
    }

    /// The heartbeat and completion URLs of `job_id`.
    pub fn urls(&self, job_id: Uuid) -> (String, String) {
        let base = &self.base_url;
        (format!("{base}/v1/jobs/{job_id}/heartbeat"), format!("{base}/v1/jobs/{job_id}/complete"))
    }
}

/// The attempts a processor waits for, by job: what the look that reads them all needs, and
/// where it sends what it found.
#[derive(Debug)]
struct Waiters {
    pool: PgPool,
    waiting: Mutex<HashMap<Uuid, Waiter>>,
}

#[derive(Debug)]
struct Waiter {
    generation: i64,
    timeout: Duration,
    /// Woken when the look found this attempt's end; the same one a callback reaching this
    /// process wakes ([`WAITING`]).
    notify: Arc<Notify>,
    /// What the look found, taken by the wait it wakes.
    found: Option<Looked>,
}

/// A wait's entry in [`Waiters`], removed when the wait ends however it ends.
struct Entry {
    waiters: Arc<Waiters>,
    job_id: Uuid,
}

impl Entry {
    /// What the look found since the wait last took it.
    fn take(&self) -> Option<Looked> {
        let mut waiting = self.waiters.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.get_mut(&self.job_id).and_then(|w| w.found.take())
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.waiters.waiting.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.job_id);
    }
}

impl Waiters {
    fn add(self: &Arc<Self>, job: &JobContext, timeout: Duration, notify: Arc<Notify>) -> Entry {
        let waiter = Waiter { generation: job.generation, timeout, notify, found: None };
        self.waiting.lock().unwrap_or_else(|e| e.into_inner()).insert(job.job_id, waiter);
        Entry { waiters: Arc::clone(self), job_id: job.job_id }
    }
}

/// Every [`POLL`], reads the rows of all the attempts waited for (a statement per
/// [`LOOK_CHUNK`]) and tells each wait what was found, until the [`Waiters`] are gone.
async fn look_for_outcomes(waiters: std::sync::Weak<Waiters>) {
    loop {
        tokio::time::sleep(POLL).await;
        let Some(waiters) = waiters.upgrade() else { return };
        let asked: Vec<(Uuid, i64, f64)> = {
            let waiting = waiters.waiting.lock().unwrap_or_else(|e| e.into_inner());
            waiting.iter().map(|(id, w)| (*id, w.generation, w.timeout.as_secs_f64())).collect()
        };
        for chunk in asked.chunks(LOOK_CHUNK) {
            let ids: Vec<Uuid> = chunk.iter().map(|a| a.0).collect();
            let generations: Vec<i64> = chunk.iter().map(|a| a.1).collect();
            let timeouts: Vec<f64> = chunk.iter().map(|a| a.2).collect();
            // Only the attempts whose wait ends come back: completed, silent, or replaced.
            let rows = async {
                let mut conn = waiters.pool.acquire().await?;
                let rows = sqlx::query!(
                    r#"SELECT w.job_id AS "job_id!", a.generation AS "generation?",
                              a.outcome AS "outcome?",
                              coalesce(clock_timestamp() - a.beat_at
                                       > w.timeout * interval '1 second', false) AS "silent!"
                       FROM unnest($1::uuid[], $2::bigint[], $3::float8[])
                            AS w(job_id, generation, timeout)
                       LEFT JOIN async_attempts a ON a.job_id = w.job_id
                       WHERE a.job_id IS NULL OR a.generation <> w.generation
                          OR a.outcome IS NOT NULL
                          OR clock_timestamp() - a.beat_at > w.timeout * interval '1 second'"#,
                    &ids,
                    &generations,
                    &timeouts,
                )
                .fetch_all(&mut *conn)
                .await;
                // The arrays sent grew the connection's buffers: given back to the pool at
                // their usual size, not this look's.
                sqlx::Connection::shrink_buffers(&mut *conn);
                rows
            }
            .await;
            let rows = match rows {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!(error = %e, "Reading the callbacks of waiting attempts failed; next look in a second.");
                    continue;
                }
            };
            let mut waiting = waiters.waiting.lock().unwrap_or_else(|e| e.into_inner());
            for row in rows {
                let Some(waiter) = waiting.get_mut(&row.job_id) else { continue };
                let looked = match row.generation {
                    Some(g) if g == waiter.generation => verdict(row.outcome, row.silent),
                    _ => Looked::Replaced,
                };
                if !matches!(looked, Looked::Waiting) {
                    waiter.found = Some(looked);
                    waiter.notify.notify_one();
                }
            }
        }
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
/// Retryable and ambiguous: no callback within `callback_timeout`, cancelled, another
/// attempt's record in its place, or its record not written.
pub async fn wait(
    scope: &Scope,
    job: &JobContext,
    callback_timeout: Duration,
    cancel: &CancellationToken,
) -> Result<Outcome, HandlerError> {
    let (_waiting, notify) = Waiting::register(job.job_id);
    // A callback that came before this (a fast handler) wrote the row for this generation
    // already: it is kept.
    record(scope, job).await.map_err(|e| {
        HandlerError::retryable(format!("the handler answered 202, and recording that failed: {e}"))
            .ambiguous()
    })?;
    let entry = scope.waiters.add(job, callback_timeout, Arc::clone(&notify));
    loop {
        tokio::select! {
            () = cancel.cancelled() => {
                return Err(HandlerError::retryable(
                    "cancelled while the handler worked on it: the lease was lost, the job \
                     cancelled or the processor is stopping",
                )
                .ambiguous());
            }
            // The group's look found the end, or a callback reached this process.
            () = notify.notified() => {}
        }
        // What the group's look found; else a callback reached this process: look at once.
        // Boxed, as it is rare next to the wait, which stays small (many thousands may wait
        // in one process).
        let looked = match entry.take() {
            Some(found) => found,
            None => match Box::pin(look(scope, job, callback_timeout)).await {
                Ok(looked) => looked,
                Err(e) => {
                    tracing::warn!(job_id = %job.job_id, error = %e, "Reading a job's callback failed; the next look is the group's.");
                    Looked::Waiting
                }
            },
        };
        match looked {
            Looked::Waiting => {}
            Looked::Done(outcome) => return Ok(outcome),
            Looked::Silent => {
                return Err(HandlerError::retryable(format!(
                    "the handler answered 202 and then did not call back for {callback_timeout:?} \
                     (callback_timeout): its outcome is unknown"
                ))
                .ambiguous());
            }
            Looked::Replaced => {
                return Err(HandlerError::retryable(
                    "another attempt of the job replaced this one's callback record",
                )
                .ambiguous());
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Looked {
    Done(Outcome),
    Waiting,
    /// No callback for longer than the time-out.
    Silent,
    /// The row is another generation's.
    Replaced,
}

/// What a row of this attempt says: its outcome, or that its handler is silent, or neither.
fn verdict(outcome: Option<Value>, silent: bool) -> Looked {
    if let Some(outcome) = outcome {
        return Looked::Done(serde_json::from_value(outcome).unwrap_or_else(|e| Outcome {
            // Written by this module only, checked before it was: not expected.
            status: 500,
            result: None,
            error: Some(format!("the recorded completion does not read: {e}")),
            retry_after: None,
        }));
    }
    if silent { Looked::Silent } else { Looked::Waiting }
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

/// This attempt's row, read alone (a callback reached this process).
async fn look(
    scope: &Scope,
    job: &JobContext,
    callback_timeout: Duration,
) -> Result<Looked, sqlx::Error> {
    let row = sqlx::query!(
        r#"SELECT generation, outcome,
                  clock_timestamp() - beat_at > $2 * interval '1 second' AS "silent!"
           FROM async_attempts WHERE job_id = $1"#,
        job.job_id,
        callback_timeout.as_secs_f64(),
    )
    .fetch_optional(&scope.pool)
    .await?;
    Ok(match row.filter(|r| r.generation == job.generation) {
        Some(row) => verdict(row.outcome, row.silent),
        None => Looked::Replaced,
    })
}

pub use jobfold_handler::protocol::{Complete, CompleteError, Heartbeat};

/// The outcome a completion's body records; `Err` says what is wrong with it.
///
/// # Errors
/// Neither or both of `result` and `error`, or an error status outside 400–599.
pub fn outcome_of(complete: Complete) -> Result<Outcome, String> {
    match (complete.result, complete.error) {
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
