//! The reaper: jobs whose lease expired more than `processor.reaper_grace` ago (the worker
//! died or hangs) and jobs still queued `processor.stall_after` after acceptance are
//! dispatched again, with a `RetryDue` event (a scheduled job: `stall_after` past its due
//! time).
//!
//! Every processor runs it; `FOR UPDATE SKIP LOCKED` and `next_attempt_at` (set to the next
//! look, re-checked under the lock) keep them from dispatching the same job twice in one round. A second dispatch would
//! be harmless anyway: the lease transaction skips what is already running or done.
//!
//! A queued job of a paused kind is not stalled: it waits for the resume. Each round
//! dispatches jobs passed over while their kind was paused that a resume left (its request
//! cut short), up to a batch ([`crate::store::kinds::dispatch_passed_over`]).
//!
//! Each round also deletes the records of inline runs that died with their process and whose
//! jobs have all ended since ([`crate::store::sweep_inline_runs`]).
//!
//! A job the reaper dispatched is not looked at again for `processor.stall_after`: its
//! dispatch waits its turn in its partition (behind a backlog, or until the group moves a
//! frozen member's partitions). Looking sooner only adds events to that backlog — under load
//! a re-dispatch every grace period feeds on itself.

use crate::metrics as m;
use chrono::{DateTime, Utc};
use jobfold_common::config::Config;
use jobfold_schemas::Payload;
use jobfold_schemas::event::{DispatchReason, RetryDue};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use jobfold_schemas::fold::Status;

use crate::store::{Events, select_job_rows};

/// Jobs re-dispatched per round, at most.
const ROUND: i64 = 500;

/// Runs the reaper every `processor.reaper_interval` until shutdown.
pub async fn run(config: Config, pool: PgPool, events: Events, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(config.processor.reaper_interval) => {}
        }
        match reap(&config, &pool, &events).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(dispatched = n, "Reaper dispatched jobs again."),
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "Reaper round failed."),
        }
        match crate::store::kinds::dispatch_passed_over(&pool, &events, None).await {
            Ok(batch) if batch.taken == 0 => {}
            Ok(batch) => tracing::info!(
                taken = batch.taken,
                dispatched = batch.dispatched,
                "Jobs passed over while their kind was paused, dispatched again after its resume."
            ),
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "Dispatching resumed jobs failed."),
        }
        match crate::store::sweep_inline_runs(&pool).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                deleted = n,
                "Records of runs that died with their process, whose jobs have ended since, deleted."
            ),
            Err(e) => tracing::warn!(error = %e, "Sweeping records of inline runs failed."),
        }
        match crate::callback::forget_ended(&pool).await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(deleted = n, "Callback records of ended attempts deleted."),
            Err(e) => tracing::warn!(error = %e, "Deleting callback records failed."),
        }
    }
}

/// One round: dispatches expired leases and stalled jobs again; returns how many.
///
/// Candidates are found without locks; each is then re-checked, locked and dispatched in a
/// transaction of its own that locks it first (see [`crate::store::JobRow::fresh_xid`]).
///
/// # Errors
/// The database failed.
pub async fn reap(config: &Config, pool: &PgPool, events: &Events) -> anyhow::Result<u64> {
    // Which jobs the reaper dispatches: `$1` is the grace, `$2` stall_after, in seconds.
    // `dispatch` checks the same under the lock.
    let candidates = sqlx::query_scalar!(
        r#"
        SELECT job_id FROM jobs
        WHERE finished_at IS NULL
          AND ((state = 'leased' AND lease_until < now() - make_interval(secs => $1))
            OR (state = 'queued'
                AND coalesce(run_at, accepted_at) < now() - make_interval(secs => $2)
                AND NOT EXISTS (SELECT 1 FROM kind_pauses p WHERE p.kind = jobs.kind)))
          AND coalesce(next_attempt_at, '-infinity') < now()
        ORDER BY accepted_at LIMIT $3
        "#,
        config.processor.reaper_grace.as_secs_f64(),
        config.processor.stall_after.as_secs_f64(),
        ROUND,
    )
    .fetch_all(pool)
    .await?;
    let mut dispatched = 0;
    for job_id in candidates {
        dispatched += u64::from(dispatch(config, pool, events, job_id).await?);
    }
    Ok(dispatched)
}

/// Dispatches one job again if it is still due and no one else holds it.
async fn dispatch(
    config: &Config,
    pool: &PgPool,
    events: &Events,
    job_id: uuid::Uuid,
) -> anyhow::Result<bool> {
    let mut tx = pool.begin().await?;
    // Still due, as `reap` found it ($1 the grace, $2 stall_after, in seconds).
    let locked = select_job_rows!(
        r#"
        FROM jobs
        WHERE job_id = $3
          AND finished_at IS NULL
          AND ((state = 'leased' AND lease_until < now() - make_interval(secs => $1))
            OR (state = 'queued'
                AND coalesce(run_at, accepted_at) < now() - make_interval(secs => $2)
                AND NOT EXISTS (SELECT 1 FROM kind_pauses p WHERE p.kind = jobs.kind)))
          AND coalesce(next_attempt_at, '-infinity') < now()
        FOR UPDATE SKIP LOCKED
        "#,
        config.processor.reaper_grace.as_secs_f64(),
        config.processor.stall_after.as_secs_f64(),
        job_id,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(mut job) = locked else {
        return Ok(false);
    };
    let (why, label) = if job.state == Status::Leased {
        (DispatchReason::LeaseExpired, "lease_expired")
    } else {
        (DispatchReason::Stalled, "stalled")
    };
    let next_look: DateTime<Utc> =
        Utc::now() + chrono::Duration::from_std(config.processor.stall_after)?;
    let due = Payload::RetryDue(RetryDue { due_at: Utc::now(), reason: why });
    events.append(&mut tx, &mut job, due, None, None).await?;
    sqlx::query!("UPDATE jobs SET next_attempt_at = $2 WHERE job_id = $1", job.job_id, next_look)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    metrics::counter!(m::REAPER_DISPATCHED_TOTAL, "reason" => label).increment(1);
    Ok(true)
}
