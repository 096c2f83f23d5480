//! The processor's transactions: lease, heartbeat, completion, and the event appends they
//! make. Each one reads the job row `FOR UPDATE`, so the transactions of one job follow one
//! another and its events get consecutive stream versions.
//!
//! Invariant: a consumed dispatch event's dedupe row (`consumed_events`) and its partition
//! offset row are written in the same commit as the state change it caused — the completion,
//! or a lease transaction that ends the job without running it. Redelivered after that
//! commit, the event is skipped without running anything.

use chrono::{DateTime, Duration as ChronoDuration, Utc};
use jobfold_schemas::event::{
    DispatchReason, ErrorClass, JobFailed, JobLeased, JobQuarantined, JobRetryScheduled,
    JobSucceeded, JobSuperseded, RetryDue, TraceContext,
};
use jobfold_schemas::fold::Status;
use jobfold_schemas::{Codec, JobEvent, Payload};
use sqlx::PgConnection;
use uuid::Uuid;

/// Where a consumed event came from.
#[derive(Debug, Clone)]
pub struct Consumed {
    pub group: String,
    pub event_id: Uuid,
    /// The job the event is about (its dedupe row goes with the job's other rows).
    pub job_id: Uuid,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

/// The projection row, as the processor needs it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct JobRow {
    pub job_id: Uuid,
    pub document_id: String,
    pub kind: String,
    pub payload: serde_json::Value,
    pub input_version: i64,
    /// Moved only by [`Events`] as it appends, through [`Status::after`]: the schemas
    /// crate's state machine, the one the fold uses.
    #[sqlx(try_from = "String")]
    pub state: Status,
    pub attempt: i32,
    pub generation: i64,
    pub lease_until: Option<DateTime<Utc>>,
    pub lease_owner: Option<String>,
    pub max_attempts: i32,
    pub deadline: Option<DateTime<Utc>>,
    pub stream_version: i32,
    pub accepted_at: DateTime<Utc>,
    /// A scheduled job's first due time.
    #[sqlx(default)]
    pub run_at: Option<DateTime<Utc>>,
    /// This transaction's xid is above that of every earlier writer of this job. Only such a
    /// transaction may append to the job's stream, or the relay, which follows xid order,
    /// could publish the job's events out of order. Set by [`lock_job`] (true when the row was
    /// locked by a transaction that had no xid yet: its xid comes after the lock) and
    /// [`lock_jobs`] (from the job's latest event).
    #[sqlx(default)]
    pub fresh_xid: bool,
}

/// Writes events: encodes them and appends them to `job_events`. A delayed one goes to
/// `outbox` too, which keeps its due time, and so does every later event of its job written
/// before the relay published it (they may not overtake it on Kafka).
#[derive(Debug, Clone)]
pub struct Events {
    pub codec: Codec<JobEvent>,
    pub topic: String,
    /// The `producer` field of appended events.
    pub producer: String,
}

impl Events {
    /// Appends `payload` as the job's next event (publishable at `available_at`, or at
    /// commit) and advances `job.stream_version`.
    ///
    /// # Errors
    /// The database failed, or the event did not encode.
    pub async fn append(
        &self,
        tx: &mut PgConnection,
        job: &mut JobRow,
        payload: Payload,
        available_at: Option<DateTime<Utc>>,
        trace: Option<TraceContext>,
    ) -> anyhow::Result<()> {
        self.write_all(tx, vec![Append { job, payload, available_at, trace }], true).await
    }

    /// Appends `payload` like [`append`](Self::append) but leaves `jobs.stream_version` to
    /// the caller, who writes the job row after it anyway: one row version fewer per
    /// transaction. The caller must set `stream_version = job.stream_version`.
    ///
    /// # Errors
    /// The database failed, or the event did not encode.
    pub async fn append_then_update_job(
        &self,
        tx: &mut PgConnection,
        job: &mut JobRow,
        payload: Payload,
        trace: Option<TraceContext>,
    ) -> anyhow::Result<()> {
        self.write_all(tx, vec![Append { job, payload, available_at: None, trace }], false).await
    }

    /// Appends one event to each of several jobs in one statement, like
    /// [`append_then_update_job`](Self::append_then_update_job) for each: the caller writes
    /// every job row after it. One event per job.
    ///
    /// # Errors
    /// The database failed, an event did not encode, or a job appears twice.
    pub async fn append_each_then_update_jobs(
        &self,
        tx: &mut PgConnection,
        appends: Vec<(&mut JobRow, Payload, Option<TraceContext>)>,
    ) -> anyhow::Result<()> {
        let mut seen = std::collections::HashSet::with_capacity(appends.len());
        let appends = appends
            .into_iter()
            .map(|(job, payload, trace)| {
                anyhow::ensure!(seen.insert(job.job_id), "job {} appears twice", job.job_id);
                Ok(Append { job, payload, available_at: None, trace })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        self.write_all(tx, appends, false).await
    }

    /// Appends each event as its job's next (one per job): the one statement behind every
    /// append.
    async fn write_all(
        &self,
        tx: &mut PgConnection,
        appends: Vec<Append<'_>>,
        bump: bool,
    ) -> anyhow::Result<()> {
        if let Some(stale) = appends.iter().find(|a| !a.job.fresh_xid) {
            anyhow::bail!(
                "job {} was not locked by lock_job before any write of this transaction: \
                 its events could reach Kafka out of order",
                stale.job.job_id
            );
        }
        // Every event goes through the state machine first: one it refuses is not written.
        let next: Vec<Status> = appends
            .iter()
            .map(|a| {
                a.job.state.after(&a.payload).map_err(|allowed| {
                    let allowed: Vec<&str> = allowed.iter().map(|s| s.as_str()).collect();
                    anyhow::anyhow!(
                        "job {}: {} cannot follow state {} (allowed only in {})",
                        a.job.job_id,
                        a.payload.kind(),
                        a.job.state,
                        allowed.join(", ")
                    )
                })
            })
            .collect::<anyhow::Result<_>>()?;
        let now = Utc::now();
        let now = DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now);
        let n = appends.len();
        let mut rows = EventRows::with_capacity(n);
        let mut jobs = Vec::with_capacity(n);
        for Append { job, payload, available_at, trace } in appends {
            let event = JobEvent {
                event_id: Uuid::now_v7(),
                job_id: job.job_id,
                document_id: job.document_id.clone(),
                job_kind: job.kind.clone(),
                input_version: job.input_version,
                stream_version: job.stream_version + 1,
                occurred_at: now,
                trace,
                producer: self.producer.clone(),
                payload,
            };
            rows.body.push(self.codec.encode(&event)?);
            rows.event_id.push(event.event_id);
            rows.job_id.push(event.job_id);
            rows.stream_version.push(event.stream_version);
            rows.kind.push(event.payload.kind());
            rows.key.push(event.document_id);
            rows.due.push(available_at);
            let trace = event.trace;
            rows.tracestate.push(trace.as_ref().and_then(|t| t.tracestate.clone()));
            rows.traceparent.push(trace.map(|t| t.traceparent));
            jobs.push(job);
        }
        // An event of a job whose earlier event still waits in the outbox goes through the
        // outbox too, behind it, and the waiting rows become due no later than it: the relay
        // publishes due rows in log order, so the job's events reach Kafka in stream order.
        // This is a statement of its own, after `lock_job`: its snapshot sees every earlier
        // writer of the job committed.
        // language=PostgreSQL
        sqlx::query(
            r#"
            WITH input AS (
                SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::int[], $4::text[], $5::bytea[],
                                     $6::text[], $7::timestamptz[], $8::text[], $9::text[])
                    WITH ORDINALITY
                    AS i(event_id, job_id, stream_version, kind, body, key, due, traceparent,
                         tracestate, n)
            ), waiting AS (
                SELECT o.seq, e.job_id FROM outbox o JOIN job_events e ON e.seq = o.seq
                WHERE o.published_at IS NULL AND o.key = ANY($6) AND e.job_id = ANY($2)
            ), path AS (
                SELECT i.*,
                       i.due IS NOT NULL
                           OR EXISTS (SELECT 1 FROM waiting w WHERE w.job_id = i.job_id) AS outbox,
                       coalesce(i.due, clock_timestamp()) AS publish_at
                FROM input i
            ), event AS (
                INSERT INTO job_events (event_id, job_id, stream_version, kind, body, occurred_at,
                                        key, delayed, traceparent, tracestate)
                SELECT event_id, job_id, stream_version, kind, body, $10, key, outbox,
                       traceparent, tracestate
                FROM path ORDER BY n
                RETURNING seq, job_id, delayed
            ), bump AS (
                UPDATE jobs j SET stream_version = i.stream_version
                FROM input i WHERE j.job_id = i.job_id AND $12
            ), release AS (
                UPDATE outbox SET available_at = least(outbox.available_at, p.publish_at)
                FROM waiting w JOIN path p ON p.job_id = w.job_id
                WHERE outbox.seq = w.seq
            )
            INSERT INTO outbox (seq, topic, key, available_at, traceparent, tracestate)
            SELECT e.seq, $11, p.key, p.publish_at, p.traceparent, p.tracestate
            FROM event e JOIN path p ON p.job_id = e.job_id
            WHERE e.delayed
            "#,
        )
        .bind(&rows.event_id)
        .bind(&rows.job_id)
        .bind(&rows.stream_version)
        .bind(&rows.kind)
        .bind(&rows.body)
        .bind(&rows.key)
        .bind(&rows.due)
        .bind(&rows.traceparent)
        .bind(&rows.tracestate)
        .bind(now)
        .bind(&self.topic)
        .bind(bump)
        .execute(&mut *tx)
        .await?;
        for (job, next) in jobs.into_iter().zip(next) {
            job.stream_version += 1;
            job.state = next;
        }
        Ok(())
    }
}

/// One event to append.
struct Append<'a> {
    job: &'a mut JobRow,
    payload: Payload,
    available_at: Option<DateTime<Utc>>,
    trace: Option<TraceContext>,
}

/// Events as columns, bound as arrays.
#[derive(Default)]
struct EventRows {
    event_id: Vec<Uuid>,
    job_id: Vec<Uuid>,
    stream_version: Vec<i32>,
    kind: Vec<&'static str>,
    body: Vec<Vec<u8>>,
    key: Vec<String>,
    due: Vec<Option<DateTime<Utc>>>,
    traceparent: Vec<Option<String>>,
    tracestate: Vec<Option<String>>,
}

impl EventRows {
    fn with_capacity(n: usize) -> Self {
        Self {
            event_id: Vec::with_capacity(n),
            job_id: Vec::with_capacity(n),
            stream_version: Vec::with_capacity(n),
            kind: Vec::with_capacity(n),
            body: Vec::with_capacity(n),
            key: Vec::with_capacity(n),
            due: Vec::with_capacity(n),
            traceparent: Vec::with_capacity(n),
            tracestate: Vec::with_capacity(n),
        }
    }
}

/// The columns of a [`JobRow`], `fresh_xid` included, as a `SELECT … FROM jobs` lists them.
pub const JOB_COLUMNS: &str = "job_id, document_id, kind, payload, input_version, \
    state::text AS state, attempt, generation, lease_until, lease_owner, max_attempts, \
    deadline, stream_version, accepted_at, run_at, \
    pg_current_xact_id_if_assigned() IS NULL AS fresh_xid";

/// Reads the job row and locks it until the transaction ends. Call it before any other
/// write of the transaction if the transaction appends events (see [`JobRow::fresh_xid`]).
///
/// # Errors
/// The database failed.
pub async fn lock_job(tx: &mut PgConnection, job_id: Uuid) -> Result<Option<JobRow>, sqlx::Error> {
    // language=PostgreSQL
    sqlx::query_as(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = $1 FOR UPDATE"))
        .bind(job_id)
        .fetch_optional(tx)
        .await
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
    // language=PostgreSQL
    let mut jobs: Vec<JobRow> = sqlx::query_as(&format!(
        "SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = ANY($1) ORDER BY job_id FOR UPDATE"
    ))
    .bind(job_ids)
    .fetch_all(&mut *tx)
    .await?;
    // language=PostgreSQL
    let late: Vec<Uuid> = sqlx::query_scalar(
        r#"
        SELECT j.job_id FROM unnest($1::uuid[]) AS j(job_id)
        WHERE (SELECT e.xid FROM job_events e WHERE e.job_id = j.job_id
               ORDER BY e.stream_version DESC LIMIT 1) > pg_current_xact_id()
        "#,
    )
    .bind(jobs.iter().map(|j| j.job_id).collect::<Vec<_>>())
    .fetch_all(&mut *tx)
    .await?;
    for job in &mut jobs {
        job.fresh_xid = !late.contains(&job.job_id);
    }
    Ok(jobs)
}

/// Which of `event_ids` this group already consumed (their dedupe rows exist).
///
/// # Errors
/// The database failed.
pub async fn consumed_among(
    tx: &mut PgConnection,
    group: &str,
    event_ids: &[Uuid],
) -> Result<std::collections::HashSet<Uuid>, sqlx::Error> {
    // Planned anew each time, not prepared once: a plan cached while the table was nearly
    // empty scans it whole, and keeps doing so as it grows by thousands of rows a second
    // until an ANALYZE (autovacuum's, a minute later) replaces it — measured, that scan was
    // a quarter of a core in a fresh installation's first burst.
    // language=PostgreSQL
    let ids: Vec<Uuid> = sqlx::query_scalar(
        "SELECT event_id FROM consumed_events WHERE consumer_group = $1 AND event_id = ANY($2)",
    )
    .persistent(false)
    .bind(group)
    .bind(event_ids)
    .fetch_all(tx)
    .await?;
    Ok(ids.into_iter().collect())
}

/// Writes the events' dedupe rows, in the caller's transaction, in one statement.
///
/// # Errors
/// The database failed.
pub async fn record_all_consumed(
    tx: &mut PgConnection,
    consumed: &[Consumed],
) -> Result<(), sqlx::Error> {
    if consumed.is_empty() {
        return Ok(());
    }
    let column = |f: fn(&Consumed) -> String| consumed.iter().map(f).collect::<Vec<_>>();
    let event_ids: Vec<Uuid> = consumed.iter().map(|c| c.event_id).collect();
    let job_ids: Vec<Uuid> = consumed.iter().map(|c| c.job_id).collect();
    let partitions: Vec<i32> = consumed.iter().map(|c| c.partition).collect();
    let offsets: Vec<i64> = consumed.iter().map(|c| c.offset).collect();
    // language=PostgreSQL
    sqlx::query(
        r#"
        INSERT INTO consumed_events (consumer_group, event_id, topic, kafka_partition,
                                     kafka_offset, job_id)
        SELECT * FROM unnest($1::text[], $2::uuid[], $3::text[], $4::int[], $5::bigint[],
                             $6::uuid[])
        ON CONFLICT ON CONSTRAINT consumed_events_pkey DO NOTHING
        "#,
    )
    .bind(column(|c| c.group.clone()))
    .bind(event_ids)
    .bind(column(|c| c.topic.clone()))
    .bind(partitions)
    .bind(offsets)
    .bind(job_ids)
    .execute(tx)
    .await?;
    Ok(())
}

/// For each `(document_id, kind)` pair, the newest input version already succeeded, if any
/// — in one statement, in the pairs' order.
///
/// # Errors
/// The database failed.
pub async fn newest_succeeded_each(
    tx: &mut PgConnection,
    pairs: &[(&str, &str)],
) -> Result<Vec<Option<i64>>, sqlx::Error> {
    let documents: Vec<&str> = pairs.iter().map(|p| p.0).collect();
    let kinds: Vec<&str> = pairs.iter().map(|p| p.1).collect();
    // language=PostgreSQL
    sqlx::query_scalar(
        r#"
        SELECT (SELECT max(j.input_version) FROM jobs j
                WHERE j.document_id = p.document_id AND j.kind = p.kind AND j.state = 'succeeded')
        FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS p(document_id, kind, n)
        ORDER BY p.n
        "#,
    )
    .bind(documents)
    .bind(kinds)
    .fetch_all(tx)
    .await
}

/// What the lease transaction decided for a dispatch event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseDecision {
    /// Nothing to run: the job is done, quarantined, or the event is stale.
    Skip(&'static str),
    /// Another worker holds a live lease: try again at this instant.
    Wait(DateTime<Utc>),
    /// A newer input version of the document already succeeded.
    Supersede(i64),
    /// A budget is spent before this attempt could start.
    Quarantine(String),
    /// Take the lease.
    Lease,
}

/// Decides what a dispatch event means for the job as it stands. Pure: the tests call it.
pub fn decide(
    job: &JobRow,
    event_input_version: i64,
    event_stream_version: i32,
    newest_succeeded: Option<i64>,
    now: DateTime<Utc>,
) -> LeaseDecision {
    if job.state.is_final() {
        return LeaseDecision::Skip("the job is finished");
    }
    if job.state == Status::Quarantined {
        return LeaseDecision::Skip("the job is quarantined");
    }
    if event_input_version != job.input_version {
        return LeaseDecision::Skip("the event is for another input version");
    }
    // A job waiting for its scheduled retry moves on that retry's RetryDue, its newest event:
    // an older dispatch read late (a stalled job's re-dispatch) would cut the backoff short.
    if job.state == Status::RetryWait && event_stream_version < job.stream_version {
        return LeaseDecision::Skip("the job waits for its scheduled retry");
    }
    if let Some(newer) = newest_succeeded.filter(|v| *v > job.input_version) {
        return LeaseDecision::Supersede(newer);
    }
    if job.state == Status::Leased && job.lease_until.is_some_and(|until| until > now) {
        return LeaseDecision::Wait(job.lease_until.expect("checked"));
    }
    // A scheduled job's JobRequested is published at its due time; one read a little early
    // (the relay's clock and this one differ) waits for it.
    if job.state == Status::Queued && job.run_at.is_some_and(|at| at > now) {
        return LeaseDecision::Wait(job.run_at.expect("checked"));
    }
    if job.attempt >= job.max_attempts {
        return LeaseDecision::Quarantine(format!(
            "attempt budget spent: {} of {} attempts made",
            job.attempt, job.max_attempts
        ));
    }
    if job.deadline.is_some_and(|d| d <= now) {
        return LeaseDecision::Quarantine("time budget spent before the next attempt".into());
    }
    LeaseDecision::Lease
}

/// Takes the lease of each job (with its dispatch event's id and trace) in the caller's
/// transaction: generation + 1, attempt + 1, `JobLeased` — two statements for them all.
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
    if leases.is_empty() {
        return Ok(());
    }
    let now = Utc::now();
    let n = leases.len();
    let mut untils = Vec::with_capacity(n);
    let (mut job_ids, mut generations, mut attempts, mut versions) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let mut appends = Vec::with_capacity(n);
    for (job, dispatch_event_id, trace) in leases {
        // Each kind's own lease time.
        let until = now + ChronoDuration::from_std(ttl(&job.kind))?;
        untils.push(until);
        job.generation += 1;
        job.attempt += 1;
        job.lease_until = Some(until);
        job.lease_owner = Some(owner.to_owned());
        job_ids.push(job.job_id);
        generations.push(job.generation);
        attempts.push(job.attempt);
        versions.push(job.stream_version + 1);
        let payload = Payload::JobLeased(JobLeased {
            generation: job.generation,
            attempt: job.attempt,
            lease_owner: owner.to_owned(),
            lease_until: until,
            dispatch_event_id,
        });
        appends.push((job, payload, trace));
    }
    let states = states_of(&appends);
    events.append_each_then_update_jobs(tx, appends).await?;
    // language=PostgreSQL
    sqlx::query(
        r#"
        UPDATE jobs j SET state = l.state::job_state, generation = l.generation,
                          attempt = l.attempt, lease_until = l.lease_until, lease_owner = $6,
                          next_attempt_at = NULL, stream_version = l.stream_version
        FROM unnest($1::uuid[], $2::bigint[], $3::int[], $4::int[], $5::timestamptz[],
                    $7::text[])
            AS l(job_id, generation, attempt, stream_version, lease_until, state)
        WHERE j.job_id = l.job_id
        "#,
    )
    .bind(job_ids)
    .bind(generations)
    .bind(attempts)
    .bind(versions)
    .bind(untils)
    .bind(owner)
    .bind(states?)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What one heartbeat statement found of the leases it was given.
#[derive(Debug, Default)]
pub struct Renewed {
    /// Extended by their TTL from now.
    pub renewed: Vec<(Uuid, i64)>,
    /// Still held by their generation, but their row was locked by another transaction (a
    /// completion, a cancel, a lease by another generation not yet committed): not renewed
    /// this time, tried again at the next beat rather than waited for.
    pub busy: Vec<(Uuid, i64)>,
}

/// Extends each of `leases` (job, generation, TTL) whose generation still holds the job
/// leased, in one statement; a lease neither renewed nor busy is lost (another generation
/// took the job, or it was cancelled or ended).
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
    // Rows another transaction holds are skipped, not waited for: one job's slow completion
    // must not hold every other lease's heartbeat.
    // language=PostgreSQL
    let renewed: Vec<(Uuid, i64)> = sqlx::query_as(
        "WITH held AS ( \
             SELECT j.job_id, w.ttl FROM jobs j \
             JOIN unnest($1::uuid[], $2::bigint[], $3::float8[]) AS w(job_id, generation, ttl) \
               ON j.job_id = w.job_id AND j.generation = w.generation \
             WHERE j.state = 'leased' \
             FOR UPDATE OF j SKIP LOCKED) \
         UPDATE jobs j SET lease_until = now() + make_interval(secs => held.ttl) \
         FROM held WHERE j.job_id = held.job_id \
         RETURNING j.job_id, j.generation",
    )
    .bind(&ids)
    .bind(&generations)
    .bind(&ttls)
    .fetch_all(pool)
    .await?;
    if renewed.len() == leases.len() {
        return Ok(Renewed { renewed, busy: Vec::new() });
    }
    // The rest: still held (locked just now), or lost. A plain read does not wait for locks.
    let done: std::collections::HashSet<&(Uuid, i64)> = renewed.iter().collect();
    let missing: Vec<(Uuid, i64)> =
        leases.iter().map(|l| (l.0, l.1)).filter(|l| !done.contains(l)).collect();
    let (ids, generations): (Vec<Uuid>, Vec<i64>) = missing.iter().copied().unzip();
    // language=PostgreSQL
    let busy: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT j.job_id, j.generation FROM jobs j \
         JOIN unnest($1::uuid[], $2::bigint[]) AS w(job_id, generation) \
           ON j.job_id = w.job_id AND j.generation = w.generation \
         WHERE j.state = 'leased'",
    )
    .bind(&ids)
    .bind(&generations)
    .fetch_all(pool)
    .await?;
    Ok(Renewed { renewed, busy })
}

/// Marks the job superseded by `newer` and appends `JobSuperseded`.
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
    // language=PostgreSQL
    sqlx::query(
        "UPDATE jobs SET state = $2::job_state, finished_at = now(), lease_until = NULL, \
         lease_owner = NULL, next_attempt_at = NULL WHERE job_id = $1",
    )
    .bind(job.job_id)
    .bind(job.state.as_str())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Quarantines the job: state, `JobQuarantined`, and the quarantine row.
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
    // language=PostgreSQL
    sqlx::query(
        "UPDATE jobs SET state = $3::job_state, finished_at = now(), lease_until = NULL, \
         lease_owner = NULL, next_attempt_at = NULL, last_error = $2 WHERE job_id = $1",
    )
    .bind(job.job_id)
    .bind(reason)
    .bind(job.state.as_str())
    .execute(&mut *tx)
    .await?;
    // language=PostgreSQL
    sqlx::query(
        r#"
        INSERT INTO quarantine (job_id, reason, error_class, input_version, last_attempt_at,
                                attempts, owner)
        VALUES ($1, $2, $3, $4, now(), $5, $6)
        ON CONFLICT ON CONSTRAINT quarantine_pkey DO UPDATE
            SET reason = EXCLUDED.reason, error_class = EXCLUDED.error_class,
                input_version = EXCLUDED.input_version, last_attempt_at = EXCLUDED.last_attempt_at,
                attempts = EXCLUDED.attempts, owner = EXCLUDED.owner, quarantined_at = now()
        "#,
    )
    .bind(job.job_id)
    .bind(reason)
    .bind(class.as_str())
    .bind(job.input_version)
    .bind(job.attempt)
    .bind(owner)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Commits the success of each attempt (its fence checked by the caller in this
/// transaction): result rows, `JobSucceeded` events, job rows — three statements for them all.
///
/// # Errors
/// The database failed, an event did not encode, or a job appears twice.
pub async fn succeed_all(
    tx: &mut PgConnection,
    events: &Events,
    successes: Vec<(&mut JobRow, serde_json::Value, Option<TraceContext>)>,
) -> anyhow::Result<()> {
    if successes.is_empty() {
        return Ok(());
    }
    let n = successes.len();
    let (mut job_ids, mut input_versions, mut generations, mut results, mut versions) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let mut appends = Vec::with_capacity(n);
    for (job, result, trace) in successes {
        job_ids.push(job.job_id);
        input_versions.push(job.input_version);
        generations.push(job.generation);
        versions.push(job.stream_version + 1);
        let payload = Payload::JobSucceeded(JobSucceeded {
            generation: job.generation,
            attempt: job.attempt,
            result: result.to_string(),
        });
        results.push(result);
        appends.push((job, payload, trace));
    }
    // language=PostgreSQL
    sqlx::query(
        "INSERT INTO job_results (job_id, input_version, generation, result) \
         SELECT * FROM unnest($1::uuid[], $2::bigint[], $3::bigint[], $4::jsonb[])",
    )
    .bind(&job_ids)
    .bind(input_versions)
    .bind(generations)
    .bind(results)
    .execute(&mut *tx)
    .await?;
    let states = states_of(&appends);
    events.append_each_then_update_jobs(tx, appends).await?;
    // language=PostgreSQL
    sqlx::query(
        r#"
        UPDATE jobs j SET state = s.state::job_state, finished_at = now(), lease_until = NULL,
                          lease_owner = NULL, last_error = NULL, stream_version = s.stream_version
        FROM unnest($1::uuid[], $2::int[], $3::text[]) AS s(job_id, stream_version, state)
        WHERE j.job_id = s.job_id
        "#,
    )
    .bind(job_ids)
    .bind(versions)
    .bind(states?)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The state each job will have after its append, for the statement that writes the job rows
/// after it: `job.state.after(payload)`, refused as the append would refuse it.
fn states_of(
    appends: &[(&mut JobRow, Payload, Option<TraceContext>)],
) -> anyhow::Result<Vec<&'static str>> {
    appends
        .iter()
        .map(|(job, payload, _)| {
            job.state.after(payload).map(Status::as_str).map_err(|_| {
                anyhow::anyhow!(
                    "job {}: {} cannot follow {}",
                    job.job_id,
                    payload.kind(),
                    job.state
                )
            })
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
    /// back to the job's budget when it is retried.
    Failed {
        class: ErrorClass,
        message: String,
        throttled: bool,
    },
}

/// Completes an attempt whose fence (state `leased`, same generation) was checked by the
/// caller in this transaction: result row, state, events; a retryable failure with budget
/// left schedules a `RetryDue` at `retry_at`. A throttled one gives its attempt back first:
/// its `JobRetryScheduled` carries the attempt count before it, and so does the job.
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
            succeed_all(tx, events, vec![(job, result, trace)]).await?;
            Ok("succeeded")
        }
        Outcome::Superseded { newer } => {
            supersede(tx, events, job, newer, trace).await?;
            Ok("superseded")
        }
        Outcome::Failed { class, message, throttled } => {
            let failed = Payload::JobFailed(JobFailed {
                generation: job.generation,
                attempt: job.attempt,
                error_class: class,
                message: message.clone(),
            });
            events.append(tx, job, failed, None, trace.clone()).await?;
            let refunded = throttled && class == ErrorClass::Retryable;
            if refunded {
                job.attempt -= 1;
            }
            let budget_left = job.attempt < job.max_attempts;
            let in_time = job.deadline.is_none_or(|d| retry_at < d);
            if class == ErrorClass::Retryable && budget_left && in_time {
                let scheduled = Payload::JobRetryScheduled(JobRetryScheduled {
                    attempt: job.attempt,
                    next_attempt_at: retry_at,
                });
                events.append(tx, job, scheduled, None, trace.clone()).await?;
                let due = Payload::RetryDue(RetryDue {
                    due_at: retry_at,
                    reason: DispatchReason::Backoff,
                });
                events.append(tx, job, due, Some(retry_at), trace).await?;
                // language=PostgreSQL
                sqlx::query(
                    "UPDATE jobs SET state = $4::job_state, lease_until = NULL, attempt = $5, \
                     lease_owner = NULL, next_attempt_at = $2, last_error = $3 WHERE job_id = $1",
                )
                .bind(job.job_id)
                .bind(retry_at)
                .bind(&message)
                .bind(job.state.as_str())
                .bind(job.attempt)
                .execute(&mut *tx)
                .await?;
                return Ok(if refunded { "throttled" } else { "retry_scheduled" });
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

#[cfg(test)]
mod tests {
    use super::*;

    fn job(state: &str) -> JobRow {
        JobRow {
            job_id: Uuid::nil(),
            document_id: "d".into(),
            kind: "k".into(),
            payload: serde_json::json!({}),
            input_version: 3,
            state: state.parse().expect("a job state"),
            attempt: 1,
            generation: 1,
            lease_until: None,
            lease_owner: None,
            max_attempts: 3,
            deadline: None,
            stream_version: 2,
            accepted_at: Utc::now(),
            run_at: None,
            fresh_xid: true,
        }
    }

    #[test]
    fn finished_and_quarantined_jobs_are_skipped() {
        let now = Utc::now();
        for state in ["succeeded", "superseded", "cancelled", "quarantined"] {
            assert!(
                matches!(decide(&job(state), 3, 2, None, now), LeaseDecision::Skip(_)),
                "{state}"
            );
        }
    }

    #[test]
    fn a_newer_succeeded_version_supersedes() {
        let now = Utc::now();
        assert_eq!(decide(&job("queued"), 3, 2, Some(4), now), LeaseDecision::Supersede(4));
        assert_eq!(decide(&job("queued"), 3, 2, Some(3), now), LeaseDecision::Lease);
        assert_eq!(decide(&job("queued"), 3, 2, Some(2), now), LeaseDecision::Lease);
    }

    #[test]
    fn a_live_lease_is_waited_for_and_an_expired_one_taken_over() {
        let now = Utc::now();
        let mut leased = job("leased");
        leased.lease_until = Some(now + ChronoDuration::seconds(5));
        assert_eq!(
            decide(&leased, 3, 2, None, now),
            LeaseDecision::Wait(leased.lease_until.unwrap())
        );
        leased.lease_until = Some(now - ChronoDuration::seconds(1));
        assert_eq!(decide(&leased, 3, 2, None, now), LeaseDecision::Lease);
    }

    #[test]
    fn spent_budgets_quarantine_before_a_lease() {
        let now = Utc::now();
        let mut spent = job("retry_wait");
        spent.attempt = 3;
        assert!(matches!(decide(&spent, 3, 2, None, now), LeaseDecision::Quarantine(_)));
        let mut late = job("retry_wait");
        late.deadline = Some(now - ChronoDuration::seconds(1));
        assert!(matches!(decide(&late, 3, 2, None, now), LeaseDecision::Quarantine(_)));
    }

    #[test]
    fn a_scheduled_job_waits_for_its_time() {
        let now = Utc::now();
        let mut scheduled = job("queued");
        scheduled.run_at = Some(now + ChronoDuration::seconds(3));
        assert_eq!(
            decide(&scheduled, 3, 1, None, now),
            LeaseDecision::Wait(scheduled.run_at.unwrap())
        );
        scheduled.run_at = Some(now - ChronoDuration::milliseconds(1));
        assert_eq!(decide(&scheduled, 3, 1, None, now), LeaseDecision::Lease);
    }

    #[test]
    fn a_stale_input_version_is_skipped() {
        assert!(matches!(decide(&job("queued"), 2, 2, None, Utc::now()), LeaseDecision::Skip(_)));
    }

    #[test]
    fn a_job_waiting_for_its_retry_moves_only_on_its_retry_due() {
        let now = Utc::now();
        let waiting = job("retry_wait");
        // An older dispatch read late neither starts the retry early nor finishes the job.
        assert_eq!(
            decide(&waiting, 3, 1, None, now),
            LeaseDecision::Skip("the job waits for its scheduled retry")
        );
        assert_eq!(
            decide(&waiting, 3, 1, Some(4), now),
            LeaseDecision::Skip("the job waits for its scheduled retry")
        );
        // Its RetryDue, the newest event of its stream, does.
        assert_eq!(decide(&waiting, 3, 2, None, now), LeaseDecision::Lease);
        assert_eq!(decide(&waiting, 3, 2, Some(4), now), LeaseDecision::Supersede(4));
        // A queued job leases on any dispatch of its input version.
        assert_eq!(decide(&job("queued"), 3, 1, None, now), LeaseDecision::Lease);
    }
}

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
#[derive(Debug, Clone, Default, serde::Deserialize)]
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
    // language=PostgreSQL
    sqlx::query(
        r#"
        UPDATE jobs SET state = $6::job_state, attempt = 0, max_attempts = $2, deadline = $3,
                        finished_at = NULL, lease_until = NULL, lease_owner = NULL,
                        next_attempt_at = NULL, last_error = NULL,
                        input_version = $4, payload = $5
        WHERE job_id = $1
        "#,
    )
    .bind(job_id)
    .bind(max_attempts)
    .bind(deadline)
    .bind(job.input_version)
    .bind(&job.payload)
    .bind(job.state.as_str())
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM quarantine WHERE job_id = $1").bind(job_id).execute(&mut *tx).await?;
    job.attempt = 0;
    Ok(())
}

/// A replay of every quarantined job a filter selects.
#[derive(Debug, Clone, Default, serde::Deserialize)]
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
#[derive(Debug, Clone, Default, serde::Deserialize)]
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
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
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
    use jobfold_common::metrics as m;
    let f = &request.filter;
    let count_sql = format!(
        "SELECT count(*) FROM quarantine q JOIN jobs j USING (job_id) WHERE {}",
        crate::status::QUARANTINE_MATCH
    );
    let count = || {
        sqlx::query_scalar::<_, i64>(&count_sql)
            .bind(f.owner.clone())
            .bind(f.kind.clone())
            .bind(f.reason.clone())
            .bind(f.since)
            .bind(f.until)
            .fetch_one(pool)
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
        // language=PostgreSQL
        let ids: Vec<Uuid> = sqlx::query_scalar(&format!(
            "SELECT q.job_id FROM quarantine q JOIN jobs j USING (job_id) \
             WHERE {} AND q.job_id > $6 ORDER BY q.job_id LIMIT $7",
            crate::status::QUARANTINE_MATCH
        ))
        .bind(&f.owner)
        .bind(&f.kind)
        .bind(&f.reason)
        .bind(f.since)
        .bind(f.until)
        .bind(after)
        .bind(i64::try_from(take).unwrap_or(i64::MAX))
        .fetch_all(pool)
        .await?;
        let Some(last) = ids.last() else { break };
        after = *last;
        let mut tx = pool.begin().await?;
        let mut locked = lock_jobs(&mut tx, &ids).await?;
        // A job written meanwhile by a later transaction cannot be appended to in this one
        // (see JobRow::fresh_xid): it gets a transaction of its own after this one.
        let mut alone = Vec::new();
        let mut replayed = 0;
        for job in &mut locked {
            if !job.fresh_xid {
                alone.push(job.job_id);
                continue;
            }
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
    metrics::counter!(m::REPLAYED_TOTAL, "how" => "bulk").increment(done.replayed);
    done.remaining = count().await?;
    Ok(done)
}

/// Why a cancel was refused.
#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    #[error("no job {0}")]
    NotFound(Uuid),
    /// Only an open job (queued, leased, waiting to retry, quarantined) can be cancelled.
    #[error("job {job_id} already ended: {state}")]
    Ended { job_id: Uuid, state: Status },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// A cancel request.
#[derive(Debug, Clone, Default, serde::Deserialize)]
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
    if job.state.is_final() {
        return Err(CancelError::Ended { job_id, state: job.state });
    }
    let was = job.state;
    let payload = Payload::JobCancelled(jobfold_schemas::event::JobCancelled {
        requested_by: request.requested_by.unwrap_or_else(|| "unknown".into()),
        reason: request.reason.unwrap_or_default().replace('\0', "\u{fffd}"),
    });
    events.append(tx, &mut job, payload, None, None).await?;
    // language=PostgreSQL
    sqlx::query(
        "UPDATE jobs SET state = $2::job_state, finished_at = now(), lease_until = NULL, \
         lease_owner = NULL, next_attempt_at = NULL WHERE job_id = $1",
    )
    .bind(job_id)
    .bind(job.state.as_str())
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM quarantine WHERE job_id = $1").bind(job_id).execute(&mut *tx).await?;
    Ok((job, was))
}
