//! What operators read: a job with its event history, and the quarantine. From Postgres,
//! the authority — never from Kafka. The HTTP API and the `jobfold` command line share
//! these queries.

use chrono::{DateTime, Utc};
use jobfold_schemas::fold::Status;
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
    /// A scheduled job's due time: not dispatched before it.
    pub run_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub stream_version: i32,
    pub idempotency_key: Option<String>,
    /// Set while the job is quarantined.
    pub quarantine_reason: Option<String>,
    pub quarantine_owner: Option<String>,
}

/// What a [`JobStatus`] is read with, before its join with `quarantine q`: a macro, so that
/// the one-job statement is one literal.
macro_rules! job_status {
    () => {
        r#"
    SELECT j.job_id, j.document_id, j.kind, j.input_version, j.state::text AS state,
           j.attempt, j.max_attempts, j.generation, j.lease_until, j.lease_owner,
           j.next_attempt_at, j.deadline, j.accepted_at, j.run_at, j.finished_at, j.last_error,
           j.stream_version, j.idempotency_key,
           q.reason AS quarantine_reason, q.owner AS quarantine_owner
    FROM jobs j
"#
    };
}

/// The job, if it exists.
///
/// # Errors
/// The database failed.
pub async fn job(pool: &PgPool, job_id: Uuid) -> Result<Option<JobStatus>, sqlx::Error> {
    sqlx::query_as(concat!(
        job_status!(),
        " LEFT JOIN quarantine q USING (job_id) WHERE j.job_id = $1"
    ))
    .bind(job_id)
    .fetch_optional(pool)
    .await
}

/// Which jobs to list, and which page: `GET /v1/jobs` and `jobfold jobs`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobFilter {
    /// Only jobs in this state.
    #[serde(default, deserialize_with = "state_label")]
    pub state: Option<Status>,
    /// Only this kind.
    pub kind: Option<String>,
    /// Only this document's.
    pub document_id: Option<String>,
    /// Only jobs accepted at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// At most this many (default 50, at most [`JOBS_LIMIT_MAX`]).
    pub limit: Option<i64>,
    /// The page after this job: the previous page's `next`.
    pub after: Option<Uuid>,
    /// `asc`: oldest first (acceptance order), the default; `desc`: newest first.
    pub order: Option<Order>,
}

/// A `job_state` label, refused with the list of states if it names none.
fn state_label<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Status>, D::Error> {
    let label = String::deserialize(d)?;
    label.parse().map(Some).map_err(|_| {
        let states: Vec<&str> = Status::ALL.iter().map(|s| s.as_str()).collect();
        serde::de::Error::custom(format!(
            "`{label}` is not a job state (one of {})",
            states.join(", ")
        ))
    })
}

/// The order of a listing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    #[default]
    Asc,
    Desc,
}

/// One page of jobs.
#[derive(Debug, Clone, Serialize)]
pub struct JobPage {
    pub jobs: Vec<JobStatus>,
    /// Pass as `after` for the next page; `None` on the last one.
    pub next: Option<Uuid>,
}

/// Most jobs one page holds.
pub const JOBS_LIMIT_MAX: i64 = 1000;

/// The smallest UUIDv7 of millisecond `at`: below every job id minted at or after `at`.
///
/// Job ids are UUIDv7 minted right after the accept reads its clock for `accepted_at`, so a
/// job accepted at or after `at` has an id at or above this, and `since` becomes a range of
/// the primary key.
fn first_id_at(at: DateTime<Utc>) -> Uuid {
    let millis = u128::try_from(at.timestamp_millis()).unwrap_or(0);
    Uuid::from_u128(millis << 80)
}

/// A page of jobs matching `filter`, in job id order — acceptance order, as job ids are
/// UUIDv7. Keyset pagination (`after` the last id seen): pages do not shift while jobs are
/// accepted, so every job that existed when the listing began is returned exactly once.
///
/// Each filter is served by an index (docs/operations.md shows the plans): `document_id` by
/// `jobs_document_id_idx`, `kind` by `jobs_kind_idx`, the unfinished states by
/// `jobs_unfinished_idx`, `quarantined` by the quarantine table, `since` and the page by the
/// primary key. `state` is not indexed (an index on it would make every lease a full
/// update); an ended state other than quarantined, alone, walks the primary key.
///
/// # Errors
/// The database failed.
pub async fn jobs(pool: &PgPool, filter: &JobFilter) -> Result<JobPage, sqlx::Error> {
    let limit = filter.limit.unwrap_or(50).clamp(1, JOBS_LIMIT_MAX);
    let jobs: Vec<JobStatus> = jobs_query(filter, "").build_query_as().fetch_all(pool).await?;
    let next = (jobs.len() as i64 == limit).then(|| jobs.last().map(|j| j.job_id)).flatten();
    Ok(JobPage { jobs, next })
}

/// How Postgres runs [`jobs`] for `filter` (`EXPLAIN`): which index serves it
/// (`jobfold jobs --explain`).
///
/// # Errors
/// The database failed.
pub async fn jobs_plan(pool: &PgPool, filter: &JobFilter) -> Result<String, sqlx::Error> {
    let lines: Vec<String> =
        jobs_query(filter, "EXPLAIN ").build_query_scalar().fetch_all(pool).await?;
    Ok(lines.join("\n"))
}

/// The statement behind [`jobs`], after `prefix`.
fn jobs_query<'a>(filter: &'a JobFilter, prefix: &str) -> sqlx::QueryBuilder<'a, sqlx::Postgres> {
    let limit = filter.limit.unwrap_or(50).clamp(1, JOBS_LIMIT_MAX);
    let order = filter.order.unwrap_or_default();
    // A quarantined job has its quarantine row: joined, not left-joined, so the page can be
    // read in the quarantine table's job id order.
    let join = if filter.state == Some(Status::Quarantined) { "JOIN" } else { "LEFT JOIN" };
    let mut query = sqlx::QueryBuilder::new(format!(
        "{prefix}{} {join} quarantine q USING (job_id) WHERE true",
        job_status!()
    ));
    // (The join alone selects the quarantined: a job has a quarantine row exactly while it
    // is quarantined. Its state tested too, the planner would take the two for independent,
    // expect a handful of rows, and read them all.)
    if let Some(state) = filter.state.filter(|s| *s != Status::Quarantined) {
        query.push(" AND j.state = ").push_bind(state.as_str()).push("::job_state");
        if matches!(state, Status::Queued | Status::Leased | Status::RetryWait) {
            query.push(" AND j.finished_at IS NULL");
        }
    }
    if let Some(kind) = &filter.kind {
        query.push(" AND j.kind = ").push_bind(kind);
    }
    if let Some(document) = &filter.document_id {
        query.push(" AND j.document_id = ").push_bind(document);
    }
    // To the millisecond, as acceptance times are kept.
    if let Some(since) =
        filter.since.and_then(|t| DateTime::from_timestamp_millis(t.timestamp_millis()))
    {
        query.push(" AND j.job_id >= ").push_bind(first_id_at(since));
        query.push(" AND j.accepted_at >= ").push_bind(since);
    }
    if let Some(after) = filter.after {
        query.push(if order == Order::Asc { " AND j.job_id > " } else { " AND j.job_id < " });
        query.push_bind(after);
    }
    query.push(if order == Order::Asc { " ORDER BY j.job_id" } else { " ORDER BY j.job_id DESC" });
    query.push(" LIMIT ").push_bind(limit);
    query
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
    /// Only jobs quarantined at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only jobs quarantined before this time.
    pub until: Option<DateTime<Utc>>,
    /// At most this many, newest first (default 50, at most 1000).
    pub limit: Option<i64>,
}

/// The quarantine rows (`q`, joined to `j`) a [`QuarantineFilter`] selects: `$1` owner, `$2`
/// kind, `$3` reason text, `$4` since, `$5` until. Listing and bulk replay share
/// it: a macro, so that each statement is one literal.
macro_rules! quarantine_match {
    () => {
        r#"
    ($1::text IS NULL OR q.owner = $1)
    AND ($2::text IS NULL OR j.kind = $2)
    AND ($3::text IS NULL OR q.reason ILIKE '%' || $3 || '%')
    AND ($4::timestamptz IS NULL OR q.quarantined_at >= $4)
    AND ($5::timestamptz IS NULL OR q.quarantined_at < $5)
"#
    };
}
pub(crate) use quarantine_match;

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
    sqlx::query_as(concat!(
        "SELECT q.job_id, j.kind, j.document_id, q.input_version, q.error_class, q.owner, \
                q.attempts, q.reason, q.quarantined_at \
         FROM quarantine q JOIN jobs j USING (job_id) WHERE ",
        quarantine_match!(),
        " ORDER BY q.quarantined_at DESC LIMIT $6"
    ))
    .bind(&filter.owner)
    .bind(&filter.kind)
    .bind(&filter.reason)
    .bind(filter.since)
    .bind(filter.until)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// How far back [`Overview::rates`] look.
pub const RATE_WINDOW_SECONDS: u32 = 10;

/// What the console's overview shows (`GET /v1/overview`): the unfinished-work gauges, as
/// the processors publish them, and the rates of the last [`RATE_WINDOW_SECONDS`].
#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    /// When Postgres was read.
    pub at: DateTime<Utc>,
    /// Accepted jobs that have not ended.
    pub unfinished: i64,
    /// Unfinished jobs per state (`queued`, `leased`, `retry_wait`).
    pub jobs: std::collections::BTreeMap<&'static str, i64>,
    pub scheduled: i64,
    pub oldest_queued_age_seconds: f64,
    pub expired_leases: i64,
    /// Quarantined jobs per owner.
    pub quarantined: std::collections::BTreeMap<String, i64>,
    pub quarantined_total: i64,
    pub dead_letters: i64,
    pub relay_parked: i64,
    pub relay_backlog: i64,
    pub relay_oldest_unpublished_age_seconds: f64,
    pub rates: Rates,
}

/// Jobs a second over the last [`Rates::window_seconds`].
#[derive(Debug, Clone, Serialize)]
pub struct Rates {
    pub window_seconds: u32,
    pub accepted_per_second: f64,
    pub succeeded_per_second: f64,
    pub quarantined_per_second: f64,
}

/// Reads the overview: [`jobfold_common::gauges::read`] and the recent rates. Accepted jobs
/// are counted by a range of the primary key alone, ended ones by `jobs_finished_idx`: the
/// cost follows the window's jobs, not the history.
///
/// A job's id and its `accepted_at` are read from the same clock at the same moment, so
/// the ids from `first_id_at(t)` on are exactly the jobs accepted since `t`, and the
/// count reads only the index (no margin for another clock, which made it read 70 s of ids
/// for a 10 s window: 50–65 ms against 11–14 ms with 1,000,000 jobs at 3,000 a second).
///
/// # Errors
/// The database failed.
pub async fn overview(pool: &PgPool) -> Result<Overview, sqlx::Error> {
    let gauges = jobfold_common::gauges::read(pool).await?;
    let window = i64::from(RATE_WINDOW_SECONDS);
    let from_id = first_id_at(Utc::now() - chrono::Duration::seconds(window));
    // language=PostgreSQL
    let (at, accepted, succeeded, quarantined): (DateTime<Utc>, i64, i64, i64) = sqlx::query_as(
        r#"
        SELECT now(),
               (SELECT count(*) FROM jobs WHERE job_id >= $1),
               count(*) FILTER (WHERE state = 'succeeded'),
               count(*) FILTER (WHERE state = 'quarantined')
        FROM jobs
        WHERE finished_at >= now() - make_interval(secs => $2)
        "#,
    )
    .bind(from_id)
    .bind(window as f64)
    .fetch_one(pool)
    .await?;
    let per_second = |n: i64| n as f64 / window as f64;
    Ok(Overview {
        at,
        unfinished: gauges.unfinished(),
        quarantined_total: gauges.quarantined_total(),
        jobs: gauges.jobs,
        scheduled: gauges.scheduled,
        oldest_queued_age_seconds: gauges.oldest_queued_age_seconds,
        expired_leases: gauges.expired_leases,
        quarantined: gauges.quarantined,
        dead_letters: gauges.dead_letters,
        relay_parked: gauges.relay_parked,
        relay_backlog: gauges.relay_backlog,
        relay_oldest_unpublished_age_seconds: gauges.relay_oldest_unpublished_age_seconds,
        rates: Rates {
            window_seconds: RATE_WINDOW_SECONDS,
            accepted_per_second: per_second(accepted),
            succeeded_per_second: per_second(succeeded),
            quarantined_per_second: per_second(quarantined),
        },
    })
}

/// A job's input as accepted (or as replaced by a replay); `None` if there is no such job.
///
/// # Errors
/// The database failed.
pub async fn input(pool: &PgPool, job_id: Uuid) -> Result<Option<serde_json::Value>, sqlx::Error> {
    // language=PostgreSQL
    sqlx::query_scalar("SELECT payload FROM jobs WHERE job_id = $1")
        .bind(job_id)
        .fetch_optional(pool)
        .await
}

/// A job's committed result at its current input version: `None` if there is no such job,
/// `Some(None)` if it has no result (yet).
///
/// # Errors
/// The database failed.
pub async fn result(
    pool: &PgPool,
    job_id: Uuid,
) -> Result<Option<Option<serde_json::Value>>, sqlx::Error> {
    // language=PostgreSQL
    sqlx::query_scalar(
        r#"
        SELECT r.result
        FROM jobs j LEFT JOIN job_results r ON r.job_id = j.job_id AND r.input_version = j.input_version
        WHERE j.job_id = $1
        "#,
    )
    .bind(job_id)
    .fetch_optional(pool)
    .await
}
