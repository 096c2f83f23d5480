//! What an operator does to jobs, each in the caller's transaction: replay a quarantined job
//! (optionally with a new input version), replay the jobs a filter matches in batches, cancel
//! a job.

use super::*;

/// Why a replay was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("no job {0}")]
    NotFound(Uuid),
    #[error("job {job_id} is {state}, not quarantined: only quarantined jobs are replayed")]
    NotQuarantined { job_id: Uuid, state: String },
    #[error("new input version {new} must be above the job's input version {current}")]
    StaleVersion { new: i64, current: i64 },
    #[error("a new input needs a new input version")]
    InputWithoutVersion,
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// A replay request for a quarantined job.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Replay {
    /// Who asks (operator name, API client).
    #[serde(default)]
    pub requested_by: Option<String>,
    /// Run with this new, higher input version.
    #[serde(default)]
    pub new_input_version: Option<i64>,
    /// The new input that goes with it; the current input if absent.
    #[serde(default)]
    pub new_input: Option<serde_json::Value>,
}

/// Replays a quarantined job in the caller's transaction: a fresh budget, optionally a new
/// input version and input, `ReplayRequested` (which dispatches it).
///
/// # Errors
/// [`ReplayError`]; nothing was written.
pub async fn replay(
    tx: &mut PgConnection,
    events: &Events,
    policy: &jobfold_common::config::AcceptPolicy,
    job_id: Uuid,
    request: Replay,
) -> Result<JobRow, ReplayError> {
    let mut job = lock_job(tx, job_id).await?.ok_or(ReplayError::NotFound(job_id))?;
    replay_locked(tx, events, policy, &mut job, request).await?;
    Ok(job)
}

/// [`replay`] of a job the caller locked (`lock_job` or `lock_jobs`, `fresh_xid` set).
async fn replay_locked(
    tx: &mut PgConnection,
    events: &Events,
    policy: &jobfold_common::config::AcceptPolicy,
    job: &mut JobRow,
    request: Replay,
) -> Result<(), ReplayError> {
    let job_id = job.job_id;
    if job.state != Status::Quarantined {
        return Err(ReplayError::NotQuarantined { job_id, state: job.state.as_str().into() });
    }
    if request.new_input.is_some() && request.new_input_version.is_none() {
        return Err(ReplayError::InputWithoutVersion);
    }
    if let Some(new) = request.new_input_version.filter(|v| *v <= job.input_version) {
        return Err(ReplayError::StaleVersion { new, current: job.input_version });
    }
    let (max_attempts, deadline) = policy.budget(&job.kind);
    let now = Utc::now();
    let deadline = deadline.and_then(|d| ChronoDuration::from_std(d).ok()).map(|d| now + d);
    let deadline = deadline.and_then(|d| DateTime::from_timestamp_millis(d.timestamp_millis()));
    if let Some(version) = request.new_input_version {
        job.input_version = version;
    }
    if let Some(input) = &request.new_input {
        job.payload = input.clone();
    }
    let payload = Payload::ReplayRequested(jobfold_schemas::event::ReplayRequested {
        requested_by: request.requested_by.unwrap_or_else(|| "unknown".into()),
        new_input_version: request.new_input_version,
        new_input: request.new_input.map(|v| v.to_string()),
        max_attempts,
        deadline,
    });
    events.append(tx, job, payload, None, None).await?;
    sqlx::query!(
        r#"
        UPDATE jobs SET state = $6::text::job_state, attempt = 0, max_attempts = $2, deadline = $3,
                        finished_at = NULL, lease_until = NULL, lease_owner = NULL,
                        next_attempt_at = NULL, last_error = NULL,
                        previous_outcome = CASE WHEN input_version = $4 THEN previous_outcome END,
                        input_version = $4, payload = $5
        WHERE job_id = $1
        "#,
        job_id,
        max_attempts,
        deadline,
        job.input_version,
        &job.payload,
        job.state.as_str(),
    )
    .execute(&mut *tx)
    .await?;
    unquarantine(tx, job_id).await?;
    job.attempt = 0;
    Ok(())
}

/// A replay of every quarantined job a filter selects.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct BulkReplay {
    #[serde(flatten)]
    pub filter: BulkFilter,
    /// Count what matches; replay nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Jobs replayed per transaction (default 100, at most [`BULK_BATCH_MAX`]).
    #[serde(default)]
    pub batch_size: Option<usize>,
    /// Jobs replayed by this request at most (default and at most [`BULK_LIMIT_MAX`]);
    /// `remaining` in the answer says what is left for the next.
    #[serde(default)]
    pub limit: Option<usize>,
    /// Who asks, recorded in each `ReplayRequested`.
    #[serde(default)]
    pub requested_by: Option<String>,
}

/// Which quarantined jobs a [`BulkReplay`] selects: as `GET /v1/quarantine` filters them.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct BulkFilter {
    pub owner: Option<String>,
    pub kind: Option<String>,
    /// Reasons containing this text (case-insensitive).
    pub reason: Option<String>,
    /// Quarantined at or after.
    pub since: Option<DateTime<Utc>>,
    /// Quarantined before.
    pub until: Option<DateTime<Utc>>,
}

/// Most jobs one transaction of a bulk replay replays.
pub const BULK_BATCH_MAX: usize = 1000;
/// Most jobs one bulk replay request replays.
pub const BULK_LIMIT_MAX: usize = 10_000;

/// What a bulk replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BulkReplayed {
    pub dry_run: bool,
    /// Quarantined jobs the filter matched when the request began.
    pub matched: i64,
    /// Jobs replayed (each exactly once: its `ReplayRequested` and its quarantine row's
    /// removal commit together, under the job's lock).
    pub replayed: u64,
    /// Transactions it took.
    pub batches: u32,
    /// Matching jobs still quarantined afterwards (over `limit`, or quarantined meanwhile).
    pub remaining: i64,
}

/// Replays the quarantined jobs `request` selects, `batch_size` to a transaction, in job id
/// order; or, with `dry_run`, only counts them.
///
/// A job replayed or cancelled by someone else meanwhile is no longer quarantined when its
/// batch locks it, and is left alone; so two bulk replays at once replay each job once.
///
/// # Errors
/// The database failed, or an event did not encode; batches committed before stay.
pub async fn replay_matching(
    pool: &sqlx::PgPool,
    events: &Events,
    policy: &jobfold_common::config::AcceptPolicy,
    request: BulkReplay,
) -> anyhow::Result<BulkReplayed> {
    let f = &request.filter;
    let count = || {
        quarantine_match!(query_scalar!([] r#"SELECT count(*) AS "count!""#, "", f)).fetch_one(pool)
    };
    let matched = count().await?;
    let mut done = BulkReplayed { dry_run: request.dry_run, matched, ..Default::default() };
    if request.dry_run {
        done.remaining = matched;
        return Ok(done);
    }
    let batch = request.batch_size.unwrap_or(100).clamp(1, BULK_BATCH_MAX);
    let limit = request.limit.unwrap_or(BULK_LIMIT_MAX).clamp(1, BULK_LIMIT_MAX);
    let by = request.requested_by.clone().unwrap_or_else(|| "unknown".into());
    let mut after = Uuid::nil();
    while (done.replayed as usize) < limit {
        let take = batch.min(limit - done.replayed as usize);
        let ids = quarantine_match!(query_scalar!(
            [] "SELECT q.job_id",
            "AND q.job_id > $6 ORDER BY q.job_id LIMIT $7",
            f,
            after,
            i64::try_from(take).unwrap_or(i64::MAX),
        ))
        .fetch_all(pool)
        .await?;
        let Some(last) = ids.last() else { break };
        after = *last;
        let (mut tx, mut fresh, alone) = lock_page(pool, &ids).await?;
        let mut replayed = 0;
        for job in &mut fresh {
            let request = Replay { requested_by: Some(by.clone()), ..Default::default() };
            match replay_locked(&mut tx, events, policy, job, request).await {
                Ok(()) => replayed += 1,
                Err(ReplayError::NotQuarantined { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        tx.commit().await?;
        done.batches += 1;
        done.replayed += replayed;
        for job_id in alone {
            let mut tx = pool.begin().await?;
            let request = Replay { requested_by: Some(by.clone()), ..Default::default() };
            match replay(&mut tx, events, policy, job_id, request).await {
                Ok(_) => {
                    tx.commit().await?;
                    done.replayed += 1;
                    done.batches += 1;
                }
                Err(ReplayError::NotQuarantined { .. } | ReplayError::NotFound(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    crate::internal_events::JobsReplayed { count: done.replayed, how: "bulk" }.emit();
    done.remaining = count().await?;
    Ok(done)
}

/// A page of a bulk operation: `ids` locked in a transaction of their own, split into the
/// jobs it may append to and those a later transaction wrote meanwhile (see
/// [`JobRow::fresh_xid`]), each of which then needs a transaction of its own.
async fn lock_page(
    pool: &sqlx::PgPool,
    ids: &[Uuid],
) -> Result<(sqlx::Transaction<'static, sqlx::Postgres>, Vec<JobRow>, Vec<Uuid>), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let (fresh, late): (Vec<_>, Vec<_>) =
        lock_jobs(&mut tx, ids).await?.into_iter().partition(|job| job.fresh_xid);
    Ok((tx, fresh, late.into_iter().map(|job| job.job_id).collect()))
}

/// Why a cancel was refused.
#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    #[error("no job {0}")]
    NotFound(Uuid),
    /// Only an open job (queued, leased, waiting to retry, quarantined) can be cancelled; one
    /// already cancelled is no error (see [`cancel`]).
    #[error("job {job_id} already ended: {state}")]
    Ended { job_id: Uuid, state: Status },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// A cancel request.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Cancel {
    /// Who asks (operator name, API client).
    #[serde(default)]
    pub requested_by: Option<String>,
    /// Why, for the event log.
    #[serde(default)]
    pub reason: Option<String>,
}

/// Cancels an open job in the caller's transaction: `JobCancelled`, state `cancelled`, its
/// quarantine row (if any) gone. Returns the job and the state it was in.
///
/// Cancelling a job that is already cancelled writes nothing and returns it as it is, `was`
/// `cancelled`: a cancel retried because its answer was lost gets the same answer.
///
/// A queued or retry-waiting job's pending dispatch is then skipped when it arrives (the
/// job is finished). A running job's heartbeat finds the job no longer leased and fires the
/// handler's cancellation token, and its completion, fenced on state `leased` and the
/// generation, commits nothing whatever the handler returns.
///
/// # Errors
/// [`CancelError`]; nothing was written.
pub async fn cancel(
    tx: &mut PgConnection,
    events: &Events,
    job_id: Uuid,
    request: Cancel,
) -> Result<(JobRow, Status), CancelError> {
    let mut job = lock_job(tx, job_id).await?.ok_or(CancelError::NotFound(job_id))?;
    let was = cancel_locked(tx, events, &mut job, request).await?;
    Ok((job, was))
}

/// [`cancel`] of a job the caller locked (`lock_job` or `lock_jobs`, `fresh_xid` set);
/// returns the state it was in.
async fn cancel_locked(
    tx: &mut PgConnection,
    events: &Events,
    job: &mut JobRow,
    request: Cancel,
) -> Result<Status, CancelError> {
    let job_id = job.job_id;
    if job.state == Status::Cancelled {
        return Ok(Status::Cancelled);
    }
    if job.state.is_final() {
        return Err(CancelError::Ended { job_id, state: job.state });
    }
    let was = job.state;
    let payload = Payload::JobCancelled(jobfold_schemas::event::JobCancelled {
        requested_by: request.requested_by.unwrap_or_else(|| "unknown".into()),
        reason: request.reason.unwrap_or_default().replace('\0', "\u{fffd}"),
    });
    events.append(tx, job, payload, None, None).await?;
    sqlx::query!(
        "UPDATE jobs SET state = $2::text::job_state, finished_at = now(), lease_until = NULL, \
         lease_owner = NULL, next_attempt_at = NULL WHERE job_id = $1",
        job_id,
        job.state.as_str(),
    )
    .execute(&mut *tx)
    .await?;
    unquarantine(tx, job_id).await?;
    Ok(was)
}

/// A cancel of every open job (queued, running or waiting to retry) a filter selects: a
/// bad deploy's jobs, say. At least one filter is required.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct BulkCancel {
    pub kind: Option<String>,
    pub document_id: Option<String>,
    /// `queued`, `leased` or `retry_wait`; any of them if absent.
    pub state: Option<String>,
    /// Accepted at or after.
    pub since: Option<DateTime<Utc>>,
    /// Accepted before.
    pub until: Option<DateTime<Utc>>,
    /// Count what matches; cancel nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Jobs cancelled per transaction (default 100, at most [`BULK_BATCH_MAX`]).
    #[serde(default)]
    pub batch_size: Option<usize>,
    /// Jobs cancelled by this request at most (default and at most [`BULK_LIMIT_MAX`]);
    /// `remaining` in the answer says what is left for the next.
    #[serde(default)]
    pub limit: Option<usize>,
    /// Who asks and why, recorded in each `JobCancelled`.
    #[serde(default)]
    pub requested_by: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
}

/// What a bulk cancel did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BulkCancelled {
    pub dry_run: bool,
    /// Open jobs the filter matched when the request began.
    pub matched: i64,
    /// Jobs cancelled (each once: its `JobCancelled` and its state commit together, under
    /// the job's lock).
    pub cancelled: u64,
    /// Transactions it took.
    pub batches: u32,
    /// Matching jobs still open afterwards (over `limit`, or accepted meanwhile).
    pub remaining: i64,
}

/// Why a bulk cancel was refused before it began.
#[derive(Debug, thiserror::Error)]
pub enum BulkCancelError {
    #[error("a filter is required (kind, document_id, state, since or until)")]
    NoFilter,
    #[error("state must be queued, leased or retry_wait, not {0:?}")]
    State(String),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// `sqlx::$macro!` over the open jobs a [`BulkCancel`] selects: `$head`, then `FROM jobs WHERE`
/// the filter (`$1` kind, `$2` document, `$3` state, `$4` since, `$5` until), then `$tail`,
/// with further arguments from `$6` on.
macro_rules! open_match {
    ($macro:ident!([$($out:path)?] $head:literal, $tail:literal, $f:expr $(, $arg:expr)* $(,)?)) => {
        sqlx::$macro!(
            $($out,)?
            $head + "
            FROM jobs
            WHERE finished_at IS NULL
              AND ($1::text IS NULL OR kind = $1)
              AND ($2::text IS NULL OR document_id = $2)
              AND ($3::text IS NULL OR state::text = $3)
              AND ($4::timestamptz IS NULL OR accepted_at >= $4)
              AND ($5::timestamptz IS NULL OR accepted_at < $5)
            " + $tail,
            $f.kind.as_deref(),
            $f.document_id.as_deref(),
            $f.state.as_deref(),
            $f.since,
            $f.until
            $(, $arg)*
        )
    };
}

/// A bulk cancel must select by something, and a state it names must be an open one.
fn check_filter(f: &BulkCancel) -> Result<(), BulkCancelError> {
    if f.kind.is_none()
        && f.document_id.is_none()
        && f.state.is_none()
        && f.since.is_none()
        && f.until.is_none()
    {
        return Err(BulkCancelError::NoFilter);
    }
    if let Some(state) = &f.state
        && !matches!(state.as_str(), "queued" | "leased" | "retry_wait")
    {
        return Err(BulkCancelError::State(state.chars().take(40).collect()));
    }
    Ok(())
}

/// Cancels the open jobs `request` selects, `batch_size` to a transaction, in job id order;
/// or, with `dry_run`, only counts them. A job that ended meanwhile is left as it is.
///
/// # Errors
/// [`BulkCancelError`]; batches committed before stay.
pub async fn cancel_matching(
    pool: &sqlx::PgPool,
    events: &Events,
    request: BulkCancel,
) -> Result<BulkCancelled, BulkCancelError> {
    let f = &request;
    check_filter(f)?;
    let count =
        || open_match!(query_scalar!([] r#"SELECT count(*) AS "count!""#, "", f)).fetch_one(pool);
    let matched = count().await?;
    let mut done = BulkCancelled { dry_run: f.dry_run, matched, ..Default::default() };
    if f.dry_run {
        done.remaining = matched;
        return Ok(done);
    }
    let batch = f.batch_size.unwrap_or(100).clamp(1, BULK_BATCH_MAX);
    let limit = f.limit.unwrap_or(BULK_LIMIT_MAX).clamp(1, BULK_LIMIT_MAX);
    let asked = || Cancel {
        requested_by: Some(f.requested_by.clone().unwrap_or_else(|| "unknown".into())),
        reason: f.reason.clone(),
    };
    let mut after = Uuid::nil();
    while (done.cancelled as usize) < limit {
        let take = batch.min(limit - done.cancelled as usize);
        let ids = open_match!(query_scalar!(
            [] "SELECT job_id",
            "AND job_id > $6 ORDER BY job_id LIMIT $7",
            f,
            after,
            i64::try_from(take).unwrap_or(i64::MAX),
        ))
        .fetch_all(pool)
        .await?;
        let Some(last) = ids.last() else { break };
        after = *last;
        let (mut tx, mut fresh, alone) = lock_page(pool, &ids).await?;
        let mut cancelled = Vec::new();
        for job in &mut fresh {
            if job.state.is_final() {
                continue;
            }
            match cancel_locked(&mut tx, events, job, asked()).await {
                Ok(was) => cancelled.push((job.job_id, was)),
                Err(CancelError::Database(e)) => return Err(e.into()),
                Err(CancelError::Other(e)) => return Err(e.into()),
                Err(CancelError::NotFound(_) | CancelError::Ended { .. }) => {}
            }
        }
        tx.commit().await?;
        done.batches += 1;
        for job_id in alone {
            let mut tx = pool.begin().await?;
            match cancel(&mut tx, events, job_id, asked()).await {
                Ok((_, was)) if was != Status::Cancelled => {
                    tx.commit().await?;
                    done.batches += 1;
                    cancelled.push((job_id, was));
                }
                Ok(_) | Err(CancelError::NotFound(_) | CancelError::Ended { .. }) => {}
                Err(CancelError::Database(e)) => return Err(e.into()),
                Err(CancelError::Other(e)) => return Err(e.into()),
            }
        }
        done.cancelled += cancelled.len() as u64;
        for (job_id, was) in cancelled {
            crate::internal_events::JobCancelled { job_id, was: was.as_str() }.emit();
        }
    }
    done.remaining = count().await?;
    Ok(done)
}

/// Removes the job's quarantine row, if any: it is quarantined no more, and its snoozes and
/// crashes are counted afresh.
async fn unquarantine(tx: &mut PgConnection, job_id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query!("DELETE FROM quarantine WHERE job_id = $1", job_id).execute(&mut *tx).await?;
    sqlx::query!("DELETE FROM job_counters WHERE job_id = $1", job_id).execute(&mut *tx).await?;
    Ok(())
}

/// Why a run-now was refused.
#[derive(Debug, thiserror::Error)]
pub enum RunNowError {
    #[error("no job {0}")]
    NotFound(Uuid),
    /// Only a job that waits for a time — scheduled, or waiting to retry — is brought forward.
    #[error("job {job_id} is {state}: only a scheduled job or one waiting to retry runs now")]
    NotWaiting { job_id: Uuid, state: Status },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// What a run-now found the job waiting for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Waited {
    /// A scheduled job, due later (`run_at`).
    Scheduled,
    /// A retry, due later.
    Retry,
    /// Nothing: a queued job already due, whose dispatch is on its way; nothing was written.
    Due,
}

/// Brings a scheduled job, or one waiting to retry, forward to now, in the caller's
/// transaction: its due time becomes now (`run_at`, or the retry's `next_attempt_at`) and a
/// `RetryDue` due now dispatches it. The dispatch waiting for the old time is passed over when
/// it comes (the job ran, or waits for this newer dispatch). No attempt is spent or given.
///
/// # Errors
/// [`RunNowError`]; nothing was written.
pub async fn run_now(
    tx: &mut PgConnection,
    events: &Events,
    job_id: Uuid,
) -> Result<(JobRow, Waited), RunNowError> {
    let mut job = lock_job(tx, job_id).await?.ok_or(RunNowError::NotFound(job_id))?;
    let now = Utc::now();
    let (waited, reason) = match job.state {
        Status::Queued if job.run_at.is_some_and(|at| at > now) => {
            (Waited::Scheduled, DispatchReason::Stalled)
        }
        Status::Queued => return Ok((job, Waited::Due)),
        Status::RetryWait => (Waited::Retry, DispatchReason::Backoff),
        state => return Err(RunNowError::NotWaiting { job_id, state }),
    };
    let due = Payload::RetryDue(jobfold_schemas::event::RetryDue { due_at: now, reason });
    events.append(tx, &mut job, due, None, None).await?;
    sqlx::query!(
        "UPDATE jobs SET run_at = CASE WHEN state = 'queued' THEN $2 ELSE run_at END, \
         next_attempt_at = $2 WHERE job_id = $1",
        job_id,
        now,
    )
    .execute(&mut *tx)
    .await?;
    if waited == Waited::Scheduled {
        job.run_at = Some(now);
    }
    Ok((job, waited))
}
