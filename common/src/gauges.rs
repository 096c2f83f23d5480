//! What is unfinished, read from Postgres — the authority — with cheap indexed queries.
//!
//! An empty queue proves nothing: these numbers say how much accepted work has not ended
//! yet (`unfinished` = accepted − (succeeded + quarantined + superseded + cancelled)), how
//! old the oldest waiting job is, which leases expired, what waits for an operator, and what
//! the relay still owes Kafka. The processor publishes them as gauges every
//! `processor.gauge_interval`; `jobfold stats` prints the same [`Snapshot`].
//!
//! Every query reads a partial index or a table that only holds unfinished or problem rows
//! (`jobs_unfinished_idx`, `job_events_relay_idx`, `outbox_unpublished_idx`, `quarantine`, `dead_letters`), so the
//! cost follows the backlog, not the history.

use std::collections::{BTreeMap, BTreeSet};

use sqlx::PgPool;

use crate::metrics as m;

/// The unfinished job states, as the `jobs.state` enum names them.
pub const UNFINISHED_STATES: [&str; 3] = ["queued", "leased", "retry_wait"];

/// One reading of the gauges.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Unfinished jobs per state (`queued`, `leased`, `retry_wait`), every state present.
    pub jobs: BTreeMap<&'static str, i64>,
    /// Seconds since the oldest queued job became due: accepted, or, scheduled, reached its
    /// `run_at` (0 with none).
    pub oldest_queued_age_seconds: f64,
    /// Queued jobs scheduled for later (`run_at` ahead): waiting by design, not stuck.
    pub scheduled: i64,
    /// Leased jobs whose lease ran out (their worker died or stalled); the reaper
    /// dispatches them again after `processor.reaper_grace`.
    pub expired_leases: i64,
    /// Quarantined jobs per owner.
    pub quarantined: BTreeMap<String, i64>,
    /// Messages the intake or the processor could not decode.
    pub dead_letters: i64,
    /// Events the relay parked (Kafka refuses them, or they wait behind one that it refuses).
    pub relay_parked: i64,
    /// Events the relay still owes Kafka (after its cursor, or due in the outbox).
    pub relay_backlog: i64,
    /// Seconds since the oldest due, unpublished outbox row became due (0 with none).
    pub relay_oldest_unpublished_age_seconds: f64,
    /// jobfold's commits waiting for the synchronous standby to have them (its sessions,
    /// `wait_event = 'SyncRep'`), and the longest such wait in seconds: a standby down or
    /// behind holds every commit here.
    pub commits_waiting_for_standby: i64,
    pub longest_standby_wait_seconds: f64,
}

impl Snapshot {
    /// Accepted jobs that have not ended.
    pub fn unfinished(&self) -> i64 {
        self.jobs.values().sum()
    }

    /// Quarantined jobs, all owners.
    pub fn quarantined_total(&self) -> i64 {
        self.quarantined.values().sum()
    }
}

/// Reads the gauges.
///
/// # Errors
/// The database failed.
pub async fn read(pool: &PgPool) -> Result<Snapshot, sqlx::Error> {
    let mut snapshot = Snapshot::default();
    let states = sqlx::query!(
        r#"
        SELECT state::text AS "state!", count(*) AS "count!",
               EXTRACT(EPOCH FROM now() - min(coalesce(run_at, accepted_at))
                                          FILTER (WHERE coalesce(run_at, accepted_at) <= now())
                      )::float8 AS oldest,
               count(*) FILTER (WHERE lease_until < now()) AS "expired!",
               count(*) FILTER (WHERE run_at > now()) AS "scheduled!"
        FROM jobs
        WHERE finished_at IS NULL
        GROUP BY state
        "#,
    )
    .fetch_all(pool)
    .await?;
    snapshot.jobs = UNFINISHED_STATES.iter().map(|s| (*s, 0)).collect();
    for row in states {
        let (state, count, oldest) = (row.state, row.count, row.oldest);
        let (expired, scheduled) = (row.expired, row.scheduled);
        if let Some(slot) = snapshot.jobs.iter_mut().find(|(s, _)| **s == state) {
            *slot.1 = count;
        }
        match state.as_str() {
            "queued" => {
                snapshot.oldest_queued_age_seconds = oldest.unwrap_or(0.0).max(0.0);
                snapshot.scheduled = scheduled;
            }
            "leased" => snapshot.expired_leases = expired,
            _ => {}
        }
    }
    let owners =
        sqlx::query!(r#"SELECT owner, count(*) AS "count!" FROM quarantine GROUP BY owner"#)
            .fetch_all(pool)
            .await?;
    snapshot.quarantined = owners.into_iter().map(|row| (row.owner, row.count)).collect();
    snapshot.dead_letters = sqlx::query_scalar!(r#"SELECT count(*) AS "count!" FROM dead_letters"#)
        .fetch_one(pool)
        .await?;
    snapshot.relay_parked = relay_parked(pool).await?.0;
    let (backlog, age) = relay_backlog(pool).await?;
    snapshot.relay_backlog = backlog;
    snapshot.relay_oldest_unpublished_age_seconds = age;
    (snapshot.commits_waiting_for_standby, snapshot.longest_standby_wait_seconds) =
        standby_waits(pool).await?;
    Ok(snapshot)
}

/// Commits of sessions of jobfold's role that wait for the synchronous standby, and the
/// longest wait in seconds (a role sees its own sessions' wait events without privileges).
///
/// # Errors
/// The database failed.
pub async fn standby_waits(pool: &PgPool) -> Result<(i64, f64), sqlx::Error> {
    let row = sqlx::query!(
        r#"SELECT count(*) AS "waiting!",
                  coalesce(EXTRACT(EPOCH FROM now() - min(query_start)), 0)::float8 AS "longest!"
           FROM pg_stat_activity
           WHERE wait_event = 'SyncRep' AND usename = current_user"#
    )
    .fetch_one(pool)
    .await?;
    Ok((row.waiting, row.longest.max(0.0)))
}

/// Events the relay still owes Kafka — after its cursor in the log, or due and unpublished in
/// the outbox: how many (counted up to a million), and the age of the oldest in seconds.
///
/// # Errors
/// The database failed.
pub async fn relay_backlog<'c, E>(executor: E) -> Result<(i64, f64), sqlx::Error>
where
    E: sqlx::PgExecutor<'c>,
{
    let owed = sqlx::query!(
        r#"
        SELECT count(*) AS "count!", EXTRACT(EPOCH FROM now() - min(since))::float8 AS age
        FROM (
            (SELECT since FROM relay_cursor c, LATERAL (
                 SELECT e.occurred_at AS since FROM job_events e
                 WHERE (e.xid, e.seq) > (c.published_xid, c.published_seq) AND NOT e.delayed
                 ORDER BY e.xid, e.seq LIMIT 1000000
             ) after)
            UNION ALL
            SELECT available_at FROM outbox WHERE published_at IS NULL AND available_at <= now()
        ) owed
        "#,
    )
    .fetch_one(executor)
    .await?;
    Ok((owed.count, owed.age.unwrap_or(0.0).max(0.0)))
}

/// Events in the relay's park (refused by Kafka, or waiting behind a refused event of their
/// document), and the documents they hold back.
///
/// # Errors
/// The database failed.
pub async fn relay_parked<'c, E>(executor: E) -> Result<(i64, i64), sqlx::Error>
where
    E: sqlx::PgExecutor<'c>,
{
    let parked = sqlx::query!(
        r#"SELECT count(*) AS "events!", count(DISTINCT key) AS "documents!" FROM relay_parked"#
    )
    .fetch_one(executor)
    .await?;
    Ok((parked.events, parked.documents))
}

/// Events the relay has not published yet, due or not: after its log cursor, unpublished
/// in the outbox, or parked. Counts them all: for checks and tools, not for a scrape.
///
/// # Errors
/// The database failed.
pub async fn unpublished<'c, E>(executor: E) -> Result<i64, sqlx::Error>
where
    E: sqlx::PgExecutor<'c>,
{
    sqlx::query_scalar!(
        r#"
        SELECT (SELECT count(*) FROM relay_cursor c, LATERAL (
                    SELECT 1 FROM job_events e
                    WHERE (e.xid, e.seq) > (c.published_xid, c.published_seq) AND NOT e.delayed
                    ORDER BY e.xid, e.seq
                ) after)
             + (SELECT count(*) FROM outbox WHERE published_at IS NULL)
             + (SELECT count(*) FROM relay_parked) AS "count!"
        "#,
    )
    .fetch_one(executor)
    .await
}

/// Every job per state, finished ones included: a full scan of `jobs`, for operators
/// (`jobfold stats --totals`) and checks, not for a scrape.
///
/// # Errors
/// The database failed.
pub async fn totals(pool: &PgPool) -> Result<BTreeMap<String, i64>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"SELECT state::text AS "state!", count(*) AS "count!" FROM jobs GROUP BY state"#
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|row| (row.state, row.count)).collect())
}

/// Publishes snapshots as Prometheus gauges. Owners seen before and now absent are set to
/// 0, so a resolved quarantine does not linger at its last value.
#[derive(Debug, Default)]
pub struct Publisher {
    owners: BTreeSet<String>,
}

impl Publisher {
    /// Sets every gauge from `snapshot` (the relay's backlog gauges are the relay's own).
    pub fn publish(&mut self, snapshot: &Snapshot) {
        for (state, count) in &snapshot.jobs {
            metrics::gauge!(m::JOBS, "state" => *state).set(*count as f64);
        }
        metrics::gauge!(m::UNFINISHED_JOBS).set(snapshot.unfinished() as f64);
        metrics::gauge!(m::OLDEST_QUEUED_AGE_SECONDS).set(snapshot.oldest_queued_age_seconds);
        metrics::gauge!(m::SCHEDULED_JOBS).set(snapshot.scheduled as f64);
        metrics::gauge!(m::EXPIRED_LEASES).set(snapshot.expired_leases as f64);
        for owner in &self.owners {
            if !snapshot.quarantined.contains_key(owner) {
                metrics::gauge!(m::QUARANTINED, "owner" => owner.clone()).set(0.0);
            }
        }
        for (owner, count) in &snapshot.quarantined {
            metrics::gauge!(m::QUARANTINED, "owner" => owner.clone()).set(*count as f64);
            self.owners.insert(owner.clone());
        }
        metrics::gauge!(m::DEAD_LETTERS).set(snapshot.dead_letters as f64);
        metrics::gauge!(m::COMMITS_WAITING_FOR_STANDBY)
            .set(snapshot.commits_waiting_for_standby as f64);
        metrics::gauge!(m::LONGEST_STANDBY_WAIT_SECONDS).set(snapshot.longest_standby_wait_seconds);
    }
}
