//! The processor's transactions: lease, heartbeat, completion, and the event appends they
//! make. Each one reads the job row `FOR UPDATE`, so the transactions of one job follow one
//! another and its events get consecutive stream versions.
//!
//! Invariant: the lease transaction writes the dispatch event's stream version into the job
//! row (`dispatch_version`) in the same commit as the lease it took, or as the end it gave
//! the job without running it. Redelivered after that commit, the event meets that version
//! and the job's state, and is skipped without running anything (see
//! [`crate::lease::decide()`]).

//!
//! - [`events`]: how the transactions append events (encoded, as arrays, one statement).
//! - [`operator`]: what an operator does to jobs: replay a quarantined one, replay many by
//!   filter, cancel.
//! - [`audit`]: the audit trail of those changes: who, what, when.
//!
//! The pure decision of the lease transaction is [`crate::lease::decide()`].

pub mod audit;
pub mod events;
pub mod kinds;
pub mod operator;

pub use events::Events;
pub use operator::*;

use chrono::{DateTime, Duration as ChronoDuration, Utc};
use jobfold_schemas::Payload;
use jobfold_schemas::event::{
    DispatchReason, ErrorClass, JobFailed, JobLeased, JobQuarantined, JobRetryScheduled,
    JobSucceeded, JobSuperseded, LeaseTaken, RetryDue, TraceContext,
};
use jobfold_schemas::fold::Status;
use sqlx::PgConnection;
use uuid::Uuid;

/// The projection row, as the processor needs it (`select_job_rows!` selects it).
#[derive(Debug, Clone)]
pub struct JobRow {
    pub job_id: Uuid,
    pub document_id: String,
    pub kind: String,
    pub payload: serde_json::Value,
    pub input_version: i64,
    /// Moved only by [`Events`] as it appends, through [`Status::after`]: the schemas
    /// crate's state machine, the one the fold uses.
    pub state: Status,
    pub attempt: i32,
    pub generation: i64,
    pub lease_until: Option<DateTime<Utc>>,
    pub lease_owner: Option<String>,
    pub max_attempts: i32,
    pub deadline: Option<DateTime<Utc>>,
    pub stream_version: i32,
    /// The stream version of the dispatch event that leased the newest attempt, or that
    /// ended the job without one (0: none yet). An older dispatch event is a duplicate.
    pub dispatch_version: i32,
    pub accepted_at: DateTime<Utc>,
    /// A scheduled job's first due time.
    pub run_at: Option<DateTime<Utc>>,
    /// How the last failed attempt at this input version ended, if one failed since the
    /// last success: `failed` or `ambiguous` ([`crate::handler::PreviousOutcome`]).
    pub previous_outcome: Option<String>,
    /// This transaction's xid is above that of every earlier writer of this job. Only such a
    /// transaction may append to the job's stream, or the relay, which follows xid order,
    /// could publish the job's events out of order. Set by [`lock_job`] (true when the row was
    /// locked by a transaction that had no xid yet: its xid comes after the lock) and
    /// [`lock_jobs`] (from the job's latest event).
    pub fresh_xid: bool,
}

/// A `job_state` as Postgres sends it, decoded into a [`Status`] (a label that names none
/// is an error of the row, not a panic).
#[derive(Debug, Clone, Copy)]
pub struct StateColumn(Status);

impl sqlx::Type<sqlx::Postgres> for StateColumn {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        sqlx::postgres::PgTypeInfo::with_name("job_state")
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for StateColumn {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        let label = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
        Ok(Self(label.parse()?))
    }
}

impl From<StateColumn> for Status {
    fn from(column: StateColumn) -> Self {
        column.0
    }
}

/// `sqlx::query_as!(JobRow, …)`: a [`JobRow`]'s columns, `fresh_xid` included, then
/// `FROM jobs …` as the given literal goes on, with its arguments: one statement, checked at
/// compile time like any other.
macro_rules! select_job_rows {
    ($rest:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            $crate::store::JobRow,
            r#"SELECT job_id, document_id, kind, payload, input_version,
                      state AS "state: crate::store::StateColumn", attempt, generation,
                      lease_until, lease_owner, max_attempts, deadline, stream_version,
                      dispatch_version, accepted_at, run_at, previous_outcome,
                      pg_current_xact_id_if_assigned() IS NULL AS "fresh_xid!"
               "# + $rest
            $(, $arg)*
        )
    };
}
pub(crate) use select_job_rows;

/// `sqlx::$macro!` over the quarantine rows (`q`, joined to `j`) a filter selects (a
/// [`crate::status::QuarantineFilter`] or a [`BulkFilter`]): `$head`, then
/// `FROM quarantine q JOIN jobs j USING (job_id) WHERE` the filter (`$1` owner, `$2` kind,
/// `$3` reason text, taken literally, `%` and `_` included, `$4` since, `$5` until), then
/// `$tail`, with further arguments from `$6` on. Listing, grouping and bulk replay share it.
macro_rules! quarantine_match {
    ($macro:ident!([$($out:path)?] $head:literal, $tail:literal, $f:expr $(, $arg:expr)* $(,)?)) => {
        sqlx::$macro!(
            $($out,)?
            $head + r#"
            FROM quarantine q JOIN jobs j USING (job_id)
            WHERE ($1::text IS NULL OR q.owner = $1)
              AND ($2::text IS NULL OR j.kind = $2)
              AND ($3::text IS NULL OR q.reason ILIKE '%' || replace(replace(replace($3, '\', '\\'), '%', '\%'), '_', '\_') || '%')
              AND ($4::timestamptz IS NULL OR q.quarantined_at >= $4)
              AND ($5::timestamptz IS NULL OR q.quarantined_at < $5)
            "# + $tail,
            $f.owner.as_deref(),
            $f.kind.as_deref(),
            $f.reason.as_deref(),
            $f.since,
            $f.until
            $(, $arg)*
        )
    };
}
pub(crate) use quarantine_match;

/// Reads the job row and locks it until the transaction ends. Call it before any other
/// write of the transaction if the transaction appends events (see [`JobRow::fresh_xid`]).
///
/// # Errors
/// The database failed.
pub async fn lock_job(tx: &mut PgConnection, job_id: Uuid) -> Result<Option<JobRow>, sqlx::Error> {
    select_job_rows!("FROM jobs WHERE job_id = $1 FOR UPDATE", job_id).fetch_optional(tx).await
}

/// [`lock_job`] for several jobs, locked in `job_id` order (so two such transactions never
/// wait on each other in a cycle). Missing jobs are left out.
///
/// Locking the first row gives the transaction its xid, so a later row it had to wait for
/// may have been written by a transaction with a higher xid. Such a job's `fresh_xid` is
/// false (its latest event's xid is above this transaction's): appending to it is refused,
/// and the caller leaves it to a transaction of its own.
///
/// # Errors
/// The database failed.
pub async fn lock_jobs(
    tx: &mut PgConnection,
    job_ids: &[Uuid],
) -> Result<Vec<JobRow>, sqlx::Error> {
    let mut jobs =
        select_job_rows!("FROM jobs WHERE job_id = ANY($1) ORDER BY job_id FOR UPDATE", job_ids)
            .fetch_all(&mut *tx)
            .await?;
    let locked: Vec<Uuid> = jobs.iter().map(|j| j.job_id).collect();
    let late = sqlx::query_scalar!(
        r#"
        SELECT j.job_id AS "job_id!" FROM unnest($1::uuid[]) AS j(job_id)
        WHERE (SELECT e.xid FROM job_events e WHERE e.job_id = j.job_id
               ORDER BY e.stream_version DESC LIMIT 1) > pg_current_xact_id()
        "#,
        &locked,
    )
    .fetch_all(&mut *tx)
    .await?;
    for job in &mut jobs {
        job.fresh_xid = !late.contains(&job.job_id);
    }
    Ok(jobs)
}

/// [`lock_jobs`] with, for each job locked, the newest input version of its document and
/// kind already succeeded, as a lease transaction needs them: the check of each job's latest
/// event and the newest versions are one statement.
///
/// # Errors
/// The database failed.
pub async fn lock_jobs_and_newest(
    tx: &mut PgConnection,
    job_ids: &[Uuid],
) -> Result<Vec<(JobRow, Option<i64>)>, sqlx::Error> {
    let jobs =
        select_job_rows!("FROM jobs WHERE job_id = ANY($1) ORDER BY job_id FOR UPDATE", job_ids)
            .fetch_all(&mut *tx)
            .await?;
    let locked: Vec<Uuid> = jobs.iter().map(|j| j.job_id).collect();
    let documents: Vec<&str> = jobs.iter().map(|j| j.document_id.as_str()).collect();
    let kinds: Vec<&str> = jobs.iter().map(|j| j.kind.as_str()).collect();
    // One value a job: null if it is late (see `lock_jobs`), else the newest version
    // succeeded, 0 for none (versions are positive).
    let checked = sqlx::query_scalar!(
        r#"
        SELECT CASE
                   WHEN (SELECT e.xid FROM job_events e WHERE e.job_id = p.job_id
                         ORDER BY e.stream_version DESC LIMIT 1) > pg_current_xact_id()
                   THEN NULL
                   ELSE coalesce((SELECT max(j.input_version) FROM jobs j
                                  WHERE j.document_id = p.document_id AND j.kind = p.kind
                                    AND j.state = 'succeeded'), 0)
               END
        FROM unnest($1::uuid[], $2::text[], $3::text[]) WITH ORDINALITY
            AS p(job_id, document_id, kind, n)
        ORDER BY p.n
        "#,
        &locked,
        &documents as &[&str],
        &kinds as &[&str],
    )
    // The newest versions by `jobs_document_kind_idx`, planned for each call with its
    // arguments: a plan that walks more than one document's jobs per pair (a plan prepared
    // while `jobs` was small, or one trusting stale statistics about a new kind) cost 23 ms a
    // call at 50,000 jobs.
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    Ok(jobs
        .into_iter()
        .zip(checked)
        .map(|(mut job, checked)| {
            job.fresh_xid = checked.is_some();
            (job, checked.filter(|&newest| newest > 0))
        })
        .collect())
}

/// Takes the lease of each job (with its dispatch event's id and trace) in the caller's
/// transaction: generation + 1, attempt + 1, `JobLeased`, and each job's `dispatch_version`
/// as the caller set it — two statements for them all.
///
/// # Errors
/// The database failed, or an event did not encode.
pub async fn take_leases(
    tx: &mut PgConnection,
    events: &Events,
    leases: Vec<(&mut JobRow, Uuid, Option<TraceContext>)>,
    owner: &str,
    ttl: impl Fn(&str) -> std::time::Duration,
) -> anyhow::Result<()> {
    let now = Utc::now();
    let leased = leases
        .into_iter()
        .map(|(job, dispatch_event_id, trace)| {
            let leased = lease(job, dispatch_event_id, owner, ttl(&job.kind), now)?;
            Ok((job, leased, trace))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    write_leases(tx, events, leased).await
}

/// Takes the lease of `job` in memory only — generation + 1, attempt + 1, lease owner and
/// time — and returns its `JobLeased`, for [`write_leases`] or [`succeed_all`] to write.
///
/// # Errors
/// The lease time is out of range.
pub fn lease(
    job: &mut JobRow,
    dispatch_event_id: Uuid,
    owner: &str,
    ttl: std::time::Duration,
    now: DateTime<Utc>,
) -> anyhow::Result<JobLeased> {
    let until = now + ChronoDuration::from_std(ttl)?;
    job.generation += 1;
    job.attempt += 1;
    job.lease_until = Some(until);
    job.lease_owner = Some(owner.to_owned());
    Ok(JobLeased {
        generation: job.generation,
        attempt: job.attempt,
        lease_owner: owner.to_owned(),
        lease_until: until,
        leased_at: Some(now),
        dispatch_event_id,
    })
}

/// Writes leases taken by [`lease`]: their `JobLeased` events and job rows, two statements
/// for them all.
///
/// # Errors
/// The database failed, or an event did not encode.
pub async fn write_leases(
    tx: &mut PgConnection,
    events: &Events,
    leases: Vec<(&mut JobRow, JobLeased, Option<TraceContext>)>,
) -> anyhow::Result<()> {
    if leases.is_empty() {
        return Ok(());
    }
    let n = leases.len();
    let (mut job_ids, mut generations, mut attempts, mut versions, mut dispatched) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut untils, mut owners) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut appends = Vec::with_capacity(n);
    for (job, leased, trace) in leases {
        job_ids.push(job.job_id);
        generations.push(job.generation);
        attempts.push(job.attempt);
        versions.push(job.stream_version + 1);
        dispatched.push(job.dispatch_version);
        untils.push(job.lease_until);
        owners.push(job.lease_owner.clone());
        appends.push((job, vec![Payload::JobLeased(leased)], trace));
    }
    let states = states_of(&appends)?;
    events.append_each_then_update_jobs(tx, appends).await?;
    sqlx::query!(
        r#"
        UPDATE jobs j SET state = l.state::job_state, generation = l.generation,
                          attempt = l.attempt, lease_until = l.lease_until,
                          lease_owner = l.lease_owner, next_attempt_at = NULL,
                          stream_version = l.stream_version,
                          dispatch_version = l.dispatch_version
        FROM unnest($1::uuid[], $2::bigint[], $3::int[], $4::int[], $5::timestamptz[],
                    $6::text[], $7::text[], $8::int[])
            AS l(job_id, generation, attempt, stream_version, lease_until, lease_owner, state,
                 dispatch_version)
        WHERE j.job_id = l.job_id
        "#,
        &job_ids,
        &generations,
        &attempts,
        &versions,
        &untils as &[Option<DateTime<Utc>>],
        &owners as &[Option<String>],
        &states as &[&str],
        &dispatched,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What one heartbeat statement found of the leases it was given.
#[derive(Debug, Default)]
pub struct Renewed {
    /// Extended by their TTL from now.
    pub renewed: Vec<(Uuid, i64)>,
    /// Not renewed this time, tried again at the next beat rather than waited for: still held
    /// by their generation, but their row was locked by another transaction (a completion, a
    /// cancel, a lease by another generation not yet committed); or their own lease is not
    /// committed yet (a run inside its lease transaction's window, or one whose lease
    /// transaction failed and is being taken again): the row still shows an earlier
    /// generation of an open job.
    pub busy: Vec<(Uuid, i64)>,
}

/// Extends each of `leases` (job, generation, TTL) whose generation still holds the job
/// leased, in one statement; a lease neither renewed nor busy is lost (another generation
/// took the job, or it was cancelled or ended). A lease whose generation the row does not
/// show yet is busy, not lost: taking it for lost would cancel a run its lease transaction
/// is about to commit, and that run's error would then be charged as an attempt.
///
/// # Errors
/// The database failed.
pub async fn heartbeat(
    pool: &sqlx::PgPool,
    leases: &[(Uuid, i64, std::time::Duration)],
) -> Result<Renewed, sqlx::Error> {
    let ids: Vec<Uuid> = leases.iter().map(|l| l.0).collect();
    let generations: Vec<i64> = leases.iter().map(|l| l.1).collect();
    let ttls: Vec<f64> = leases.iter().map(|l| l.2.as_secs_f64()).collect();
    let mut conn = pool.acquire().await?;
    let renewed = renew(&mut conn, leases, (&ids, &generations, &ttls)).await;
    // The arrays sent (a process may hold many thousands of leases) grew the connection's
    // buffers: given back to the pool at their usual size.
    sqlx::Connection::shrink_buffers(&mut *conn);
    renewed
}

async fn renew(
    conn: &mut sqlx::PgConnection,
    leases: &[(Uuid, i64, std::time::Duration)],
    (ids, generations, ttls): (&[Uuid], &[i64], &[f64]),
) -> Result<Renewed, sqlx::Error> {
    // Rows another transaction holds are skipped, not waited for: one job's slow completion
    // must not hold every other lease's heartbeat.
    let renewed = sqlx::query!(
        "WITH held AS ( \
             SELECT j.job_id, w.ttl FROM jobs j \
             JOIN unnest($1::uuid[], $2::bigint[], $3::float8[]) AS w(job_id, generation, ttl) \
               ON j.job_id = w.job_id AND j.generation = w.generation \
             WHERE j.state = 'leased' \
             FOR UPDATE OF j SKIP LOCKED) \
         UPDATE jobs j SET lease_until = now() + make_interval(secs => held.ttl) \
         FROM held WHERE j.job_id = held.job_id \
         RETURNING j.job_id, j.generation",
        ids,
        generations,
        ttls,
    )
    .fetch_all(&mut *conn)
    .await?;
    let renewed: Vec<(Uuid, i64)> = renewed.into_iter().map(|r| (r.job_id, r.generation)).collect();
    if renewed.len() == leases.len() {
        return Ok(Renewed { renewed, busy: Vec::new() });
    }
    // The rest: still held (locked just now), not committed yet, or lost. A plain read does
    // not wait for locks.
    let done: std::collections::HashSet<&(Uuid, i64)> = renewed.iter().collect();
    let missing: Vec<(Uuid, i64)> =
        leases.iter().map(|l| (l.0, l.1)).filter(|l| !done.contains(l)).collect();
    let (ids, generations): (Vec<Uuid>, Vec<i64>) = missing.iter().copied().unzip();
    let busy = sqlx::query!(
        "SELECT j.job_id, w.generation AS \"generation!\" FROM jobs j \
         JOIN unnest($1::uuid[], $2::bigint[]) AS w(job_id, generation) \
           ON j.job_id = w.job_id \
         WHERE (j.generation = w.generation AND j.state = 'leased') \
            OR (j.generation < w.generation AND j.state IN ('queued', 'leased', 'retry_wait'))",
        &ids,
        &generations,
    )
    .fetch_all(&mut *conn)
    .await?;
    let busy = busy.into_iter().map(|r| (r.job_id, r.generation)).collect();
    Ok(Renewed { renewed, busy })
}

/// Marks the job superseded by `newer` and appends `JobSuperseded`; writes
/// `job.dispatch_version` as the caller left it.
///
/// # Errors
/// The database failed, or the event did not encode.
pub async fn supersede(
    tx: &mut PgConnection,
    events: &Events,
    job: &mut JobRow,
    newer: i64,
    trace: Option<TraceContext>,
) -> anyhow::Result<()> {
    let payload = Payload::JobSuperseded(JobSuperseded { by_input_version: newer });
    events.append(tx, job, payload, None, trace).await?;
    sqlx::query!(
        "UPDATE jobs SET state = $2::text::job_state, finished_at = now(), lease_until = NULL, \
         lease_owner = NULL, next_attempt_at = NULL, dispatch_version = $3 WHERE job_id = $1",
        job.job_id,
        job.state.as_str(),
        job.dispatch_version,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Quarantines the job: state, `JobQuarantined`, and the quarantine row; writes
/// `job.dispatch_version` as the caller left it.
///
/// # Errors
/// The database failed, or the event did not encode.
pub async fn quarantine(
    tx: &mut PgConnection,
    events: &Events,
    job: &mut JobRow,
    class: ErrorClass,
    reason: &str,
    owner: &str,
    trace: Option<TraceContext>,
) -> anyhow::Result<()> {
    let payload = Payload::JobQuarantined(JobQuarantined {
        reason: reason.to_owned(),
        error_class: class,
        owner: owner.to_owned(),
        attempts: job.attempt,
    });
    events.append(tx, job, payload, None, trace).await?;
    sqlx::query!(
        "UPDATE jobs SET state = $3::text::job_state, finished_at = now(), lease_until = NULL, \
         lease_owner = NULL, next_attempt_at = NULL, last_error = $2, dispatch_version = $4, \
         previous_outcome = $5 WHERE job_id = $1",
        job.job_id,
        reason,
        job.state.as_str(),
        job.dispatch_version,
        job.previous_outcome.as_deref(),
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query!(
        r#"
        INSERT INTO quarantine (job_id, reason, error_class, input_version, last_attempt_at,
                                attempts, owner)
        VALUES ($1, $2, $3, $4, now(), $5, $6)
        ON CONFLICT ON CONSTRAINT quarantine_pkey DO UPDATE
            SET reason = EXCLUDED.reason, error_class = EXCLUDED.error_class,
                input_version = EXCLUDED.input_version, last_attempt_at = EXCLUDED.last_attempt_at,
                attempts = EXCLUDED.attempts, owner = EXCLUDED.owner, quarantined_at = now()
        "#,
        job.job_id,
        reason,
        class.as_str(),
        job.input_version,
        job.attempt,
        owner,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A finished attempt to commit as a success.
#[derive(Debug)]
pub struct Success<'a> {
    pub job: &'a mut JobRow,
    pub result: &'a serde_json::Value,
    pub trace: Option<TraceContext>,
    /// The attempt's `JobLeased` when its lease is not written yet (see [`lease`]): the
    /// success says it itself ([`JobSucceeded::lease`]), one event instead of two.
    pub lease: Option<JobLeased>,
}

/// Commits the success of each attempt (its fence checked by the caller in this
/// transaction, or its lease taken in it and written here): the events, then the job rows
/// with their results — two statements for them all.
///
/// # Errors
/// The database failed, an event did not encode, or a job appears twice.
pub async fn succeed_all(
    tx: &mut PgConnection,
    events: &Events,
    successes: Vec<Success<'_>>,
) -> anyhow::Result<()> {
    if successes.is_empty() {
        return Ok(());
    }
    let n = successes.len();
    let (mut job_ids, mut generations, mut results, mut versions) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut attempts, mut dispatched) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut appends = Vec::with_capacity(n);
    for Success { job, result, trace, lease } in successes {
        job_ids.push(job.job_id);
        generations.push(job.generation);
        attempts.push(job.attempt);
        dispatched.push(job.dispatch_version);
        // Serialized once, for the event and the job row.
        let result = result.to_string();
        results.push(result.clone());
        // A lease taken in this transaction is said by the success itself: one event, not a
        // JobLeased before it.
        let lease = lease.map(|leased| LeaseTaken {
            lease_owner: leased.lease_owner,
            leased_at: leased.leased_at.unwrap_or_else(Utc::now),
            dispatch_event_id: leased.dispatch_event_id,
        });
        let succeeded = Payload::JobSucceeded(JobSucceeded {
            generation: job.generation,
            attempt: job.attempt,
            result,
            lease,
        });
        versions.push(job.stream_version + 1);
        appends.push((job, vec![succeeded], trace));
    }
    let states = states_of(&appends)?;
    events.append_each_then_update_jobs(tx, appends).await?;
    sqlx::query!(
        r#"
        UPDATE jobs j SET state = s.state::job_state, finished_at = now(), lease_until = NULL,
                          lease_owner = NULL, last_error = NULL, next_attempt_at = NULL,
                          previous_outcome = NULL, stream_version = s.stream_version, generation = s.generation,
                          attempt = s.attempt, dispatch_version = s.dispatch_version,
                          result = s.result
        FROM unnest($1::uuid[], $2::int[], $3::text[], $4::bigint[], $5::int[], $6::int[],
                    $7::text[]::jsonb[])
            AS s(job_id, stream_version, state, generation, attempt, dispatch_version, result)
        WHERE j.job_id = s.job_id
        "#,
        &job_ids,
        &versions,
        &states as &[&str],
        &generations,
        &attempts,
        &dispatched,
        &results,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The state each job will have after its appends, for the statement that writes the job
/// rows after them: `job.state.after(payload)` for each, refused as the append would refuse
/// it.
fn states_of(
    appends: &[(&mut JobRow, Vec<Payload>, Option<TraceContext>)],
) -> anyhow::Result<Vec<&'static str>> {
    appends
        .iter()
        .map(|(job, payloads, _)| {
            payloads
                .iter()
                .try_fold(job.state, |state, payload| {
                    state.after(payload).map_err(|_| {
                        anyhow::anyhow!(
                            "job {}: {} cannot follow {}",
                            job.job_id,
                            payload.kind(),
                            state
                        )
                    })
                })
                .map(Status::as_str)
        })
        .collect()
}

/// What an attempt produced, to be committed.
#[derive(Debug, Clone)]
pub enum Outcome {
    Succeeded {
        result: serde_json::Value,
    },
    Superseded {
        newer: i64,
    },
    /// `throttled`: refused for an outside service's quota (429), so the attempt is given
    /// back to the job's budget when it is retried. `snooze`: deferred, this job alone
    /// ([`crate::handler::HandlerError::snooze`]), with the kind's `max_snoozes`: the attempt
    /// is given back while the job's snoozes are within it. `released`: cut short by its
    /// processor's stop, the attempt given back. `ambiguous`: whether its effects happened
    /// is unknown (`JobFailed.outcome_unknown`), as the next attempt is told.
    Failed {
        class: ErrorClass,
        message: String,
        throttled: bool,
        snooze: Option<i32>,
        released: bool,
        ambiguous: bool,
    },
}

/// Schedules `job`'s next attempt at `retry_at` after a failure with `message`: the
/// `JobRetryScheduled` event, the `RetryDue` the relay publishes when it is due, and the
/// row waiting in `retry_wait`.
async fn schedule_retry(
    tx: &mut PgConnection,
    events: &Events,
    job: &mut JobRow,
    retry_at: DateTime<Utc>,
    message: &str,
    trace: Option<TraceContext>,
) -> anyhow::Result<()> {
    let scheduled = Payload::JobRetryScheduled(JobRetryScheduled {
        attempt: job.attempt,
        next_attempt_at: retry_at,
    });
    events.append(tx, job, scheduled, None, trace.clone()).await?;
    let due = Payload::RetryDue(RetryDue { due_at: retry_at, reason: DispatchReason::Backoff });
    events.append(tx, job, due, Some(retry_at), trace).await?;
    sqlx::query!(
        "UPDATE jobs SET state = $4::text::job_state, lease_until = NULL, \
         attempt = $5, lease_owner = NULL, next_attempt_at = $2, last_error = $3, \
         previous_outcome = $6 WHERE job_id = $1",
        job.job_id,
        retry_at,
        message,
        job.state.as_str(),
        job.attempt,
        job.previous_outcome.as_deref(),
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Completes an attempt whose fence (state `leased`, same generation) was checked by the
/// caller in this transaction: result row, state, events; a retryable failure with budget
/// left schedules a `RetryDue` at `retry_at`. A throttled one, one snoozed within its
/// `max_snoozes`, or one its processor's stop cut short (released), gives its attempt back first: its `JobRetryScheduled` carries the attempt
/// count before it, and so does the job.
///
/// # Errors
/// The database failed, or an event did not encode.
#[allow(clippy::too_many_arguments)]
pub async fn complete(
    tx: &mut PgConnection,
    events: &Events,
    job: &mut JobRow,
    outcome: Outcome,
    retry_at: DateTime<Utc>,
    owner_of_quarantine: &str,
    trace: Option<TraceContext>,
) -> anyhow::Result<&'static str> {
    match outcome {
        Outcome::Succeeded { result } => {
            succeed_all(tx, events, vec![Success { job, result: &result, trace, lease: None }])
                .await?;
            Ok("succeeded")
        }
        Outcome::Superseded { newer } => {
            supersede(tx, events, job, newer, trace).await?;
            Ok("superseded")
        }
        Outcome::Failed { class, message, throttled, snooze, released, ambiguous } => {
            let failed = Payload::JobFailed(JobFailed {
                generation: job.generation,
                attempt: job.attempt,
                error_class: class,
                message: message.clone(),
                outcome_unknown: Some(ambiguous),
            });
            job.previous_outcome = Some(if ambiguous { "ambiguous" } else { "failed" }.to_owned());
            events.append(tx, job, failed, None, trace.clone()).await?;
            let snoozed = match snooze {
                Some(max) if class == ErrorClass::Retryable && !throttled => {
                    take_snooze(tx, job.job_id).await? <= max
                }
                _ => false,
            };
            let refunded = (throttled || snoozed || released) && class == ErrorClass::Retryable;
            if refunded {
                job.attempt -= 1;
            }
            let budget_left = job.attempt < job.max_attempts;
            let in_time = job.deadline.is_none_or(|d| retry_at < d);
            if class == ErrorClass::Retryable && budget_left && in_time {
                schedule_retry(tx, events, job, retry_at, &message, trace).await?;
                return Ok(match (throttled, snoozed, released) {
                    (true, _, _) => "throttled",
                    (false, true, _) => "snoozed",
                    (false, false, true) => "released",
                    (false, false, false) => "retry_scheduled",
                });
            }
            let reason = match class {
                ErrorClass::Retryable if !budget_left => {
                    format!(
                        "attempt budget spent ({} attempts); last error: {message}",
                        job.attempt
                    )
                }
                ErrorClass::Retryable => format!("time budget spent; last error: {message}"),
                ErrorClass::Permanent => format!("permanent failure: {message}"),
                ErrorClass::InvalidInput => format!("invalid input: {message}"),
            };
            quarantine(tx, events, job, class, &reason, owner_of_quarantine, trace).await?;
            Ok("quarantined")
        }
    }
}

/// Counts a snooze of `job_id` (a row of `job_counters` at its first); how many it has had,
/// this one included.
///
/// # Errors
/// The database failed.
pub async fn take_snooze(tx: &mut PgConnection, job_id: Uuid) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar!(
        "INSERT INTO job_counters (job_id, snoozes) VALUES ($1, 1) \
         ON CONFLICT ON CONSTRAINT job_counters_pkey \
         DO UPDATE SET snoozes = job_counters.snoozes + 1 RETURNING snoozes",
        job_id,
    )
    .fetch_one(tx)
    .await
}

/// Records, in a commit of its own, that `owner` is about to run `job_ids` before their
/// leases commit (a lease transaction's inline window); [`inline_runs_end`] in that
/// transaction deletes the record, which a process that dies first leaves behind.
///
/// # Errors
/// The database failed.
pub async fn inline_runs_begin(
    pool: &sqlx::PgPool,
    run_id: Uuid,
    job_ids: &[Uuid],
    owner: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "INSERT INTO inline_runs (run_id, job_ids, owner) VALUES ($1, $2, $3)",
        run_id,
        job_ids,
        owner,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Deletes the record of inline runs `run_id`: in their lease transaction (their leases and
/// attempts commit with it), or on its own once that transaction failed in a live process.
///
/// # Errors
/// The database failed.
pub async fn inline_runs_end<'c, E>(executor: E, run_id: Uuid) -> Result<(), sqlx::Error>
where
    E: sqlx::PgExecutor<'c>,
{
    sqlx::query!("DELETE FROM inline_runs WHERE run_id = $1", run_id).execute(executor).await?;
    Ok(())
}

/// Deletes the record of the isolated run `run_id` of suspect `job_id`, which returned: its
/// process survived the job's run, so its count of crashes starts again. A job is
/// quarantined for crashes only after killing its processor `max_crashes` times in a row,
/// and a job that was merely running beside another's crash (or an outside kill) once or
/// twice runs as any other again.
///
/// # Errors
/// The database failed.
pub async fn isolated_run_survived(
    pool: &sqlx::PgPool,
    run_id: Uuid,
    job_id: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        r#"
        WITH ended AS (DELETE FROM inline_runs WHERE run_id = $1)
        UPDATE job_counters SET crashes = 0 WHERE job_id = $2 AND crashes > 0
        "#,
        run_id,
        job_id,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Deletes the records of inline runs whose jobs have all ended (or are gone) since: a
/// process that died left them, and no lease of those jobs will ever take them out. A live
/// lease transaction's record is never among them (its jobs are locked, not ended). Returns
/// how many were deleted.
///
/// # Errors
/// The database failed.
pub async fn sweep_inline_runs(pool: &sqlx::PgPool) -> Result<u64, sqlx::Error> {
    let done = sqlx::query!(
        "DELETE FROM inline_runs r WHERE started_at < now() - interval '1 minute' \
         AND NOT EXISTS (SELECT 1 FROM jobs j \
                         WHERE j.job_id = ANY(r.job_ids) AND j.finished_at IS NULL)"
    )
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// A job that was running when a process died.
#[derive(Debug, Clone)]
pub struct Crashed {
    /// Processes that died while it ran, the one just found included.
    pub crashes: i32,
    /// The last of them.
    pub owner: String,
    /// A run of it that died was found just now (else it is only a suspect, from before).
    pub just_found: bool,
}

/// Of `job_ids`, locked by this transaction and about to be leased, those that were running
/// when a process died: a run recorded as started and never ended (see
/// [`inline_runs_begin`]) is counted in `job_counters` and taken out of its record, in this
/// transaction (`just_found`); the others with crashes counted before are suspects. Only
/// jobs no live lease holds may be asked about: a record of a live lease transaction is
/// never seen (that one holds the jobs' row locks until it commits, and deletes its record
/// in the same commit), and an isolated run's (one job, recorded after its lease committed,
/// deleted once the run returns) is alive while its lease is.
///
/// # Errors
/// The database failed.
pub async fn crashed_runs(
    tx: &mut PgConnection,
    job_ids: &[Uuid],
) -> Result<std::collections::HashMap<Uuid, Crashed>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        WITH stale AS (
            SELECT r.run_id, r.owner, j.job_id
            FROM inline_runs r CROSS JOIN LATERAL unnest(r.job_ids) AS j(job_id)
            WHERE r.job_ids && $1::uuid[] AND j.job_id = ANY($1)
        ), trimmed AS (
            UPDATE inline_runs r
            SET job_ids = ARRAY(SELECT x FROM unnest(r.job_ids) AS x WHERE x <> ALL($1))
            WHERE r.run_id IN (SELECT run_id FROM stale)
        )
        , counted AS (
            INSERT INTO job_counters AS c (job_id, crashes, last_crash_owner, last_crash_at)
            SELECT job_id, count(*)::int, max(owner), now() FROM stale GROUP BY job_id
            ON CONFLICT ON CONSTRAINT job_counters_pkey DO UPDATE
                SET crashes = c.crashes + EXCLUDED.crashes,
                    last_crash_owner = EXCLUDED.last_crash_owner,
                    last_crash_at = EXCLUDED.last_crash_at
            RETURNING job_id, crashes, last_crash_owner
        )
        SELECT job_id AS "job_id!", crashes AS "crashes!", last_crash_owner AS "owner!",
               true AS "just_found!"
        FROM counted
        UNION ALL
        SELECT job_id, crashes, coalesce(last_crash_owner, ''), false
        FROM job_counters
        WHERE job_id = ANY($1) AND crashes > 0 AND job_id NOT IN (SELECT job_id FROM stale)
        "#,
        job_ids,
    )
    .fetch_all(&mut *tx)
    .await?;
    if rows.iter().any(|r| r.just_found) {
        sqlx::query!("DELETE FROM inline_runs WHERE cardinality(job_ids) = 0")
            .execute(&mut *tx)
            .await?;
    }
    Ok(rows
        .into_iter()
        .map(|r| {
            let crashed = Crashed { crashes: r.crashes, owner: r.owner, just_found: r.just_found };
            (r.job_id, crashed)
        })
        .collect())
}
