//! Event appends: each event encoded with the registry's codec and appended to
//! `job_events` (and `outbox` when delayed), the events of a transaction as arrays in one
//! statement.

use chrono::{DateTime, Utc};
use jobfold_schemas::event::TraceContext;
use jobfold_schemas::fold::Status;
use jobfold_schemas::{Codec, JobEvent, Payload};
use sqlx::PgConnection;
use uuid::Uuid;

use super::JobRow;

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

/// The statement that appends a transaction's events (`$1`–`$9` the [`EventRows`] as arrays,
/// `$10` when they occurred, `$11` the topic), with `$more` (a literal) as a further CTE
/// after the insert. An event of a job whose earlier event still waits in the outbox goes
/// through the outbox too, behind it, and the waiting rows become due no later than it: the
/// relay publishes due rows in log order, so the job's events reach Kafka in stream order.
///
/// Two texts, not a flag: with a parameter deciding whether `jobs` is updated, every custom
/// plan pruned the update and looked cheaper than the generic plan, so each call was planned
/// again (380 µs, more than it ran).
macro_rules! append {
    ($more:literal, $rows:expr, $now:expr, $topic:expr) => {
        sqlx::query!(
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
        RETURNING seq, job_id, stream_version, delayed
"# + $more + r#"), release AS (
        UPDATE outbox SET available_at = least(outbox.available_at, p.publish_at)
        FROM waiting w JOIN path p ON p.job_id = w.job_id
        WHERE outbox.seq = w.seq
    )
    INSERT INTO outbox (seq, topic, key, available_at, traceparent, tracestate)
    SELECT e.seq, $11, p.key, p.publish_at, p.traceparent, p.tracestate
    FROM event e JOIN path p ON p.job_id = e.job_id AND p.stream_version = e.stream_version
    WHERE e.delayed
    "#,
            &$rows.event_id,
            &$rows.job_id,
            &$rows.stream_version,
            &$rows.kind as &[&str],
            &$rows.body,
            &$rows.key,
            &$rows.due as &[Option<DateTime<Utc>>],
            &$rows.traceparent as &[Option<String>],
            &$rows.tracestate as &[Option<String>],
            $now,
            $topic,
        )
    };
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
        self.write_all(tx, vec![Append { job, payloads: vec![payload], available_at, trace }], true)
            .await
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
        let append = Append { job, payloads: vec![payload], available_at: None, trace };
        self.write_all(tx, vec![append], false).await
    }

    /// Appends events to each of several jobs in one statement, like
    /// [`append_then_update_job`](Self::append_then_update_job) for each: the caller writes
    /// every job row after it. Each job's events follow one another in its stream, in the
    /// order given (a lease and its success, committed together).
    ///
    /// # Errors
    /// The database failed, an event did not encode, or a job appears twice.
    pub async fn append_each_then_update_jobs(
        &self,
        tx: &mut PgConnection,
        appends: Vec<(&mut JobRow, Vec<Payload>, Option<TraceContext>)>,
    ) -> anyhow::Result<()> {
        let mut seen = std::collections::HashSet::with_capacity(appends.len());
        let appends = appends
            .into_iter()
            .map(|(job, payloads, trace)| {
                anyhow::ensure!(seen.insert(job.job_id), "job {} appears twice", job.job_id);
                Ok(Append { job, payloads, available_at: None, trace })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        self.write_all(tx, appends, false).await
    }

    /// Appends each job's events as its next ones: the one statement behind every append.
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
        let next = states_after(&appends)?;
        let now = Utc::now();
        let now = DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now);
        let n = appends.iter().map(|a| a.payloads.len()).sum();
        let mut rows = EventRows::with_capacity(n);
        let mut jobs = Vec::with_capacity(appends.len());
        for Append { job, payloads, available_at, trace } in appends {
            let count = payloads.len() as i32;
            for (k, payload) in (1..).zip(payloads) {
                let event = JobEvent {
                    event_id: Uuid::now_v7(),
                    job_id: job.job_id,
                    document_id: job.document_id.clone(),
                    job_kind: job.kind.clone(),
                    input_version: job.input_version,
                    stream_version: job.stream_version + k,
                    occurred_at: now,
                    trace: trace.clone(),
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
            }
            jobs.push((job, count));
        }
        // A statement of its own, after `lock_job`: its snapshot sees every earlier writer of
        // the job committed (see `append!` for the outbox).
        let now_at = now;
        let done = if bump {
            append!(
                r#"), bump AS (
                    UPDATE jobs j SET stream_version = i.stream_version
                    FROM input i WHERE j.job_id = i.job_id
                "#,
                rows,
                now_at,
                &self.topic
            )
            .execute(&mut *tx)
            .await
        } else {
            append!("", rows, now_at, &self.topic).execute(&mut *tx).await
        };
        done?;
        for ((job, count), next) in jobs.into_iter().zip(next) {
            job.stream_version += count;
            job.state = next;
        }
        Ok(())
    }
}

/// Each job's state after its events, in the order of `appends`; an error naming the first
/// event the state machine refuses.
fn states_after(appends: &[Append<'_>]) -> anyhow::Result<Vec<Status>> {
    appends
        .iter()
        .map(|a| {
            a.payloads.iter().try_fold(a.job.state, |state, payload| {
                state.after(payload).map_err(|allowed| {
                    let allowed: Vec<&str> = allowed.iter().map(|s| s.as_str()).collect();
                    anyhow::anyhow!(
                        "job {}: {} cannot follow state {} (allowed only in {})",
                        a.job.job_id,
                        payload.kind(),
                        state,
                        allowed.join(", ")
                    )
                })
            })
        })
        .collect()
}

/// A job's events to append, in stream order.
struct Append<'a> {
    job: &'a mut JobRow,
    payloads: Vec<Payload>,
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
