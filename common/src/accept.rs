//! Accepting jobs: the job row and its `JobRequested` event, in one transaction.
//!
//! Invariant: a job is accepted exactly when this transaction commits. Before the commit
//! nothing exists — no row, no event, no message (the relay only reads committed events).
//! After it the job cannot be lost: the relay publishes the event at least once.
//!
//! Three ways in end here: [`Acceptor::accept_in`] inside the caller's own transaction
//! (transactional enqueue), [`Acceptor::accept`] with a pool (HTTP), and the intake consumer.
//!
//! Idempotency: a request with an idempotency key that was already accepted returns the
//! existing job (`created: false`) if it asks for the same thing, and
//! [`AcceptError::Conflict`] if the same key comes with a different request.

use chrono::{DateTime, Utc};
use jobfold_schemas::event::{JobRequested, TraceContext};
use jobfold_schemas::{Codec, JobEvent, Payload};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::config::AcceptPolicy;
pub use crate::config::MAX_NAME_BYTES;

/// A job to accept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewJob {
    /// The document the job works on: the Kafka key.
    pub document_id: String,
    /// Which handler runs it.
    pub kind: String,
    /// Version of the input, increasing per document.
    pub input_version: i64,
    /// The handler's input, any JSON.
    pub input: serde_json::Value,
    /// Retries of the same request carry the same key.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Not to be dispatched before this instant (a scheduled job); at once if absent or
    /// no later than now. More than `accept.schedule_tolerance` in the past, or more than
    /// `accept.max_schedule_ahead` ahead, is refused.
    #[serde(default)]
    pub run_at: Option<DateTime<Utc>>,
    /// W3C trace context to continue.
    #[serde(skip)]
    pub trace: Option<TraceContext>,
}

/// The outcome of an accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Accepted {
    pub job_id: Uuid,
    /// False when an earlier request with the same idempotency key created the job.
    pub created: bool,
}

/// Why a job was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    /// A field breaks a rule; nothing was written.
    #[error("invalid field `{field}`: {problem}")]
    Invalid { field: &'static str, problem: String },
    /// The input is larger than `accept.max_input_bytes`; nothing was written.
    #[error("input is {size} bytes, more than the limit of {limit}")]
    TooLarge { size: usize, limit: usize },
    /// Postgres refused the job's data (SQLSTATE class 22, data exception, or 23, integrity
    /// constraint): the request's fault, not an outage; retrying it cannot help.
    #[error("the database refused the job's data ({code}): {message}")]
    Unstorable { code: String, message: String },
    /// No processor has registered a handler for the kind (and `accept.any_kind` is off).
    #[error("unknown kind {kind:?}: no processor has registered a handler for it")]
    UnknownKind { kind: String },
    /// The idempotency key was used before for a different request.
    #[error("idempotency key {key:?} was already used for a different request (job {job_id})")]
    Conflict { key: String, job_id: Uuid },
    /// The event could not be encoded (a bug: the schema and the types disagree).
    #[error(transparent)]
    Encode(#[from] jobfold_schemas::codec::EncodeError),
    /// The database failed; nothing was accepted unless the caller's transaction commits.
    #[error("database: {0}")]
    Database(sqlx::Error),
}

impl From<sqlx::Error> for AcceptError {
    /// A data error about the job's own row is the request's fault
    /// ([`AcceptError::Unstorable`]); anything else is the database's ([`AcceptError::Database`]).
    fn from(e: sqlx::Error) -> Self {
        match crate::db::data_error(&e) {
            Some((code, message)) => Self::Unstorable { code, message },
            None => Self::Database(e),
        }
    }
}

impl AcceptError {
    /// Whether the request itself is at fault: sending it again cannot succeed.
    pub fn is_request_fault(&self) -> bool {
        !matches!(self, Self::Database(_) | Self::Encode(_))
    }

    /// Whether a batch that failed with this may succeed job by job: one job's data refused
    /// (which row, Postgres does not say), a key another transaction holds (the lock wait
    /// timed out: 55P03), or two batches that met on the same keys in different orders
    /// (a deadlock or serialization failure).
    pub fn alone_helps(&self) -> bool {
        match self {
            Self::Database(sqlx::Error::Database(d)) => {
                matches!(d.code().as_deref(), Some("55P03" | "40P01" | "40001"))
            }
            Self::Database(_) | Self::Encode(_) => false,
            _ => true,
        }
    }
}

/// Begins a transaction that accepts a batch: it waits at most a second for a row lock
/// (another transaction inserting the same idempotency key, not committed yet), then fails
/// with 55P03 ([`AcceptError::alone_helps`]), and its jobs are accepted one by one.
pub const BEGIN_BATCH: &str = "BEGIN; SET LOCAL lock_timeout = '1s'";

/// The JSON path of the first string or object key in `value` holding U+0000, which
/// Postgres's `text` and `jsonb` cannot store.
pub fn find_nul(value: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    match value {
        Value::String(s) if s.contains('\0') => Some(String::new()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| find_nul(item).map(|path| format!("[{i}]{path}"))),
        Value::Object(fields) => fields.iter().find_map(|(key, item)| {
            if key.contains('\0') {
                Some(format!(".{}", key.replace('\0', "\\u0000")))
            } else {
                find_nul(item).map(|path| format!(".{key}{path}"))
            }
        }),
        _ => None,
    }
}

/// Accepts jobs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Acceptor {
    codec: Codec<JobEvent>,
    policy: AcceptPolicy,
    /// Kinds found in `job_kinds`: registered once, a kind stays known, so each is looked up
    /// once per process.
    known_kinds: std::sync::Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
    /// Written into each event's `producer` field.
    producer: String,
}

/// What was stored for an idempotency key, to compare with a retried request.
#[derive(Debug)]
struct Existing {
    job_id: Uuid,
    document_id: String,
    kind: String,
    input_version: i64,
    payload: serde_json::Value,
}

impl Acceptor {
    pub fn new(codec: Codec<JobEvent>, policy: AcceptPolicy, producer: impl Into<String>) -> Self {
        Self { codec, policy, producer: producer.into(), known_kinds: Default::default() }
    }

    /// The kinds among `kinds` no processor has registered, looked up in `job_kinds` (in the
    /// caller's transaction) when not known yet; none when `accept.any_kind` is on.
    async fn unknown_kinds<'k>(
        &self,
        tx: &mut PgConnection,
        kinds: impl Iterator<Item = &'k str>,
    ) -> Result<Vec<&'k str>, AcceptError> {
        if self.policy.any_kind {
            return Ok(Vec::new());
        }
        let unknown: Vec<&str> = {
            let known = self.known_kinds.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut unknown: Vec<&str> = kinds.filter(|k| !known.contains(*k)).collect();
            unknown.sort_unstable();
            unknown.dedup();
            unknown
        };
        if unknown.is_empty() {
            return Ok(unknown);
        }
        let found = sqlx::query_scalar!(
            "SELECT kind FROM job_kinds WHERE kind = ANY($1)",
            &unknown as &[&str]
        )
        .fetch_all(&mut *tx)
        .await?;
        let mut known = self.known_kinds.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        known.extend(found);
        Ok(unknown.into_iter().filter(|k| !known.contains(*k)).collect())
    }

    /// Checks a job against the rules; [`AcceptError::Invalid`] names the first bad field.
    ///
    /// # Errors
    /// [`AcceptError::Invalid`].
    pub fn validate(&self, job: &NewJob) -> Result<(), AcceptError> {
        let invalid = |field, problem: String| Err(AcceptError::Invalid { field, problem });
        let name = |field, value: &str| {
            if value.trim().is_empty() {
                invalid(field, "must not be empty".into())
            } else if value.contains('\0') {
                invalid(field, "must not contain U+0000 (NUL)".into())
            } else if value.len() > MAX_NAME_BYTES {
                invalid(field, format!("must be at most {MAX_NAME_BYTES} bytes"))
            } else {
                Ok(())
            }
        };
        name("document_id", &job.document_id)?;
        name("kind", &job.kind)?;
        if let Some(key) = &job.idempotency_key {
            name("idempotency_key", key)?;
        }
        if job.input_version < 1 {
            return invalid("input_version", "must be at least 1".into());
        }
        let size = serde_json::to_vec(&job.input).map(|v| v.len()).unwrap_or(usize::MAX);
        if size > self.policy.max_input_bytes {
            return Err(AcceptError::TooLarge { size, limit: self.policy.max_input_bytes });
        }
        if let Some(path) = find_nul(&job.input) {
            return Err(AcceptError::Invalid {
                field: "input",
                problem: format!("`input{path}` contains U+0000 (NUL), which cannot be stored"),
            });
        }
        if let Some(run_at) = job.run_at {
            let now = Utc::now();
            let span = crate::config::span;
            let late = (now - run_at).to_std().unwrap_or_default();
            if late > self.policy.schedule_tolerance {
                return invalid(
                    "run_at",
                    format!(
                        "{} is {} in the past, more than accept.schedule_tolerance ({})",
                        run_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                        span(std::time::Duration::from_secs(late.as_secs())),
                        span(self.policy.schedule_tolerance)
                    ),
                );
            }
            let ahead = (run_at - now).to_std().unwrap_or_default();
            if ahead > self.policy.max_schedule_ahead {
                return invalid(
                    "run_at",
                    format!(
                        "{} is more than accept.max_schedule_ahead ({}) ahead",
                        run_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                        span(self.policy.max_schedule_ahead)
                    ),
                );
            }
        }
        Ok(())
    }

    /// When a job accepted at `now` may first run: its `run_at` if that is later (to the
    /// millisecond, as events carry time), else at once (`None`).
    fn due(job: &NewJob, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        job.run_at
            .and_then(|t| DateTime::from_timestamp_millis(t.timestamp_millis()))
            .filter(|t| *t > now)
    }

    /// Accepts `job` inside the caller's transaction: it is accepted if and only if the
    /// caller commits. The relay is woken at that commit.
    ///
    /// # Errors
    /// [`AcceptError`]; on any error the caller should roll back.
    pub async fn accept_in(
        &self,
        tx: &mut PgConnection,
        job: &NewJob,
    ) -> Result<Accepted, AcceptError> {
        self.validate(job)?;
        if !self.unknown_kinds(tx, std::iter::once(job.kind.as_str())).await?.is_empty() {
            return Err(AcceptError::UnknownKind { kind: job.kind.clone() });
        }
        // Millisecond precision, as events carry time: the row and the event agree.
        let now = Utc::now();
        let now = DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now);
        let job_id = Uuid::now_v7();
        let event = self.requested_event(job_id, job, now);
        let body = self.codec.encode(&event)?;
        let (max_attempts, deadline, run_at) = match &event.payload {
            Payload::JobRequested(r) => (r.max_attempts, r.deadline, r.run_at),
            _ => unreachable!("requested_event builds a JobRequested"),
        };
        // A scheduled job's JobRequested goes through the outbox, due at run_at ($14): the
        // relay publishes it then (delayed events' one path), and nothing dispatches it before.
        // The outbox insert is filtered by the event's `delayed` column, not by `$14` itself:
        // a parameter that let the planner drop the insert would make every plan for its
        // values look cheaper than the generic one, and each call would be planned again.
        let inserted = sqlx::query_scalar!(
            r#"
            WITH job AS (
                INSERT INTO jobs (job_id, document_id, kind, payload, input_version,
                                  idempotency_key, accepted_at, stream_version,
                                  max_attempts, deadline, run_at)
                VALUES ($1, $2, $3, $4, $5, $6, $7, 1, $10, $11, $14)
                ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                RETURNING job_id
            ), event AS (
                INSERT INTO job_events (event_id, job_id, stream_version, kind, body, occurred_at,
                                        key, traceparent, tracestate, delayed)
                SELECT $8, job_id, 1, 'JobRequested', $9, $7, $2, $12, $13, $14 IS NOT NULL
                FROM job
                RETURNING seq, delayed
            ), delayed AS (
                INSERT INTO outbox (seq, topic, key, available_at, traceparent, tracestate)
                SELECT seq, $15, $2, $14, $12, $13 FROM event WHERE delayed
            )
            SELECT job_id FROM job
            "#,
            job_id,
            &job.document_id,
            &job.kind,
            &job.input,
            job.input_version,
            job.idempotency_key.as_deref(),
            now,
            event.event_id,
            &body,
            max_attempts,
            deadline,
            job.trace.as_ref().map(|t| t.traceparent.as_str()),
            job.trace.as_ref().and_then(|t| t.tracestate.as_deref()),
            run_at,
            self.codec.topic(),
        )
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(job_id) = inserted {
            metrics::counter!(crate::metrics::ACCEPTED_TOTAL).increment(1);
            return Ok(Accepted { job_id, created: true });
        }
        // The key exists: the same request again returns its job.
        self.existing(tx, job).await
    }

    /// Accepts `job` in a transaction of its own.
    ///
    /// # Errors
    /// [`AcceptError`]; nothing was accepted.
    pub async fn accept(&self, pool: &PgPool, job: &NewJob) -> Result<Accepted, AcceptError> {
        let mut tx = pool.begin().await?;
        let accepted = self.accept_in(&mut tx, job).await?;
        tx.commit().await?;
        Ok(accepted)
    }

    /// Accepts several jobs in one transaction, all or none, with one multi-row statement.
    ///
    /// Per-document order follows the slice: a later job of a document gets a later event.
    ///
    /// # Errors
    /// [`AcceptError`] for the first job that fails; none was accepted.
    pub async fn accept_batch(
        &self,
        pool: &PgPool,
        jobs: &[NewJob],
    ) -> Result<Vec<Accepted>, AcceptError> {
        let mut tx = pool.begin().await?;
        let accepted = self.accept_batch_in(&mut tx, jobs).await?;
        tx.commit().await?;
        Ok(accepted)
    }

    /// [`Acceptor::accept_batch`] inside the caller's transaction.
    ///
    /// # Errors
    /// [`AcceptError`]; the caller should roll back.
    pub async fn accept_batch_in(
        &self,
        tx: &mut PgConnection,
        jobs: &[NewJob],
    ) -> Result<Vec<Accepted>, AcceptError> {
        // The first job's error, if any; the caller rolls back what the others wrote.
        self.accept_each_in(tx, jobs).await?.into_iter().collect()
    }

    /// Accepts each of `jobs` that can be, in one transaction of its own: a job that cannot
    /// — a bad field, an unknown kind, a reused idempotency key — gets its own error and
    /// costs only itself. If the batch fails as a whole for one job's sake
    /// ([`AcceptError::alone_helps`]: data Postgres refuses in one row, a key another
    /// transaction holds), it is rolled back and each job is accepted in a transaction of its
    /// own, in order, so that only that one is refused or waits. Each job of the answer
    /// (`Ok`) is durable when this returns.
    ///
    /// # Errors
    /// [`AcceptError::Database`] (or [`AcceptError::Encode`]): nothing was accepted.
    pub async fn accept_each(
        &self,
        pool: &PgPool,
        jobs: &[NewJob],
    ) -> Result<Vec<Result<Accepted, AcceptError>>, AcceptError> {
        match self.accept_all_at_once(pool, jobs).await {
            Err(e) if e.alone_helps() => {
                tracing::debug!(error = %e, jobs = jobs.len(), "A batch failed as a whole; its jobs are accepted one by one.");
                let mut each = Vec::with_capacity(jobs.len());
                for job in jobs {
                    each.push(match self.accept(pool, job).await {
                        Err(e) if !e.is_request_fault() => return Err(e),
                        answer => answer,
                    });
                }
                Ok(each)
            }
            done => done,
        }
    }

    /// [`Acceptor::accept_each`] in one transaction, without the one-by-one fallback: an
    /// error is the batch's. A row lock held elsewhere — another transaction accepting a job
    /// with the same idempotency key, not committed yet — is waited for at most a second
    /// ([`BEGIN_BATCH`]), so that one key held open cannot hold up the others long.
    ///
    /// # Errors
    /// The batch failed as a whole; nothing was accepted.
    pub async fn accept_all_at_once(
        &self,
        pool: &PgPool,
        jobs: &[NewJob],
    ) -> Result<Vec<Result<Accepted, AcceptError>>, AcceptError> {
        let mut tx = pool.begin_with(BEGIN_BATCH).await?;
        let each = self.accept_each_in(&mut tx, jobs).await?;
        tx.commit().await?;
        Ok(each)
    }

    /// [`Acceptor::accept_each`] inside the caller's transaction, without the one-by-one
    /// fallback: the answer for each job, in order.
    ///
    /// Per-document order follows the slice: a later job of a document gets a later event.
    ///
    /// # Errors
    /// The statement failed as a whole ([`AcceptError::Database`], or
    /// [`AcceptError::Unstorable`] for data Postgres refused in some row); the caller should
    /// roll back.
    pub async fn accept_each_in(
        &self,
        tx: &mut PgConnection,
        jobs: &[NewJob],
    ) -> Result<Vec<Result<Accepted, AcceptError>>, AcceptError> {
        let mut answers: Vec<Option<Result<Accepted, AcceptError>>> =
            jobs.iter().map(|job| self.validate(job).err().map(Err)).collect();
        let unknown = self.unknown_kinds(tx, jobs.iter().map(|j| j.kind.as_str())).await?;
        if !unknown.is_empty() {
            for (job, answer) in jobs.iter().zip(&mut answers) {
                if answer.is_none() && unknown.contains(&job.kind.as_str()) {
                    *answer = Some(Err(AcceptError::UnknownKind { kind: job.kind.clone() }));
                }
            }
        }
        let valid: Vec<usize> = (0..jobs.len()).filter(|i| answers[*i].is_none()).collect();
        if valid.is_empty() {
            return Ok(answers.into_iter().flatten().collect());
        }
        let now = Utc::now();
        let now = DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now);
        let n = valid.len();
        let (mut job_ids, mut event_ids, mut bodies) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut budgets, mut deadlines) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut run_ats = Vec::with_capacity(n);
        let (mut documents, mut kinds, mut inputs, mut versions, mut keys) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut traceparents, mut tracestates) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for job in valid.iter().map(|i| &jobs[*i]) {
            let job_id = Uuid::now_v7();
            let event = self.requested_event(job_id, job, now);
            bodies.push(self.codec.encode(&event)?);
            if let Payload::JobRequested(r) = &event.payload {
                budgets.push(r.max_attempts);
                deadlines.push(r.deadline);
                run_ats.push(r.run_at);
            }
            event_ids.push(event.event_id);
            job_ids.push(job_id);
            documents.push(job.document_id.as_str());
            kinds.push(job.kind.as_str());
            inputs.push(&job.input);
            versions.push(job.input_version);
            keys.push(job.idempotency_key.as_deref());
            traceparents.push(job.trace.as_ref().map(|t| t.traceparent.as_str()));
            tracestates.push(job.trace.as_ref().and_then(|t| t.tracestate.as_deref()));
        }
        // As in accept_in: scheduled jobs' events go through the outbox, due at run_at.
        let inserted = sqlx::query_scalar!(
            r#"
            WITH input AS (
                SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::jsonb[],
                                     $5::bigint[], $6::text[], $7::uuid[], $8::bytea[],
                                     $10::int[], $11::timestamptz[], $12::text[], $13::text[],
                                     $14::timestamptz[])
                    WITH ORDINALITY
                    AS t(job_id, document_id, kind, payload, input_version, idempotency_key,
                         event_id, body, max_attempts, deadline, traceparent, tracestate, run_at,
                         n)
            ), job AS (
                INSERT INTO jobs (job_id, document_id, kind, payload, input_version,
                                  idempotency_key, accepted_at, stream_version,
                                  max_attempts, deadline, run_at)
                SELECT job_id, document_id, kind, payload, input_version, idempotency_key, $9, 1,
                       max_attempts, deadline, run_at
                FROM input ORDER BY n
                ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                RETURNING job_id
            ), event AS (
                INSERT INTO job_events (event_id, job_id, stream_version, kind, body, occurred_at,
                                        key, traceparent, tracestate, delayed)
                SELECT i.event_id, i.job_id, 1, 'JobRequested', i.body, $9,
                       i.document_id, i.traceparent, i.tracestate, i.run_at IS NOT NULL
                FROM input i JOIN job USING (job_id)
                ORDER BY i.n
                RETURNING seq, job_id, delayed
            ), delayed AS (
                INSERT INTO outbox (seq, topic, key, available_at, traceparent, tracestate)
                SELECT e.seq, $15, i.document_id, i.run_at, i.traceparent, i.tracestate
                FROM event e JOIN input i USING (job_id) WHERE e.delayed
            )
            SELECT job_id AS "job_id!" FROM job
            "#,
            &job_ids,
            &documents as &[&str],
            &kinds as &[&str],
            &inputs as &[&serde_json::Value],
            &versions,
            &keys as &[Option<&str>],
            &event_ids,
            &bodies,
            now,
            &budgets,
            &deadlines as &[Option<DateTime<Utc>>],
            &traceparents as &[Option<&str>],
            &tracestates as &[Option<&str>],
            &run_ats as &[Option<DateTime<Utc>>],
            self.codec.topic(),
        )
        .fetch_all(&mut *tx)
        .await?;
        metrics::counter!(crate::metrics::ACCEPTED_TOTAL).increment(inserted.len() as u64);
        // Keys that existed (or repeat within the batch) must each ask for the same job.
        let all_inserted = inserted.len() == n;
        let inserted: std::collections::HashSet<Uuid> = inserted.into_iter().collect();
        for (i, job_id) in valid.into_iter().zip(job_ids) {
            answers[i] = Some(if all_inserted || inserted.contains(&job_id) {
                Ok(Accepted { job_id, created: true })
            } else {
                match self.existing(tx, &jobs[i]).await {
                    Err(AcceptError::Database(e)) => return Err(AcceptError::Database(e)),
                    answer => answer,
                }
            });
        }
        Ok(answers.into_iter().flatten().collect())
    }

    /// The job an earlier request with `job`'s idempotency key created, if it asked the same.
    async fn existing(&self, tx: &mut PgConnection, job: &NewJob) -> Result<Accepted, AcceptError> {
        let key = job.idempotency_key.clone().expect("only a keyed insert can conflict");
        let existing = sqlx::query_as!(
            Existing,
            "SELECT job_id, document_id, kind, input_version, payload \
             FROM jobs WHERE idempotency_key = $1",
            &key,
        )
        .fetch_one(&mut *tx)
        .await?;
        // The due time is not compared: a retry sent later with the same relative delay
        // names a later instant, and is the same request.
        let same = existing.document_id == job.document_id
            && existing.kind == job.kind
            && existing.input_version == job.input_version
            && existing.payload == job.input;
        if same {
            Ok(Accepted { job_id: existing.job_id, created: false })
        } else {
            Err(AcceptError::Conflict { key, job_id: existing.job_id })
        }
    }

    fn requested_event(&self, job_id: Uuid, job: &NewJob, now: DateTime<Utc>) -> JobEvent {
        let (max_attempts, deadline) = self.policy.budget(&job.kind);
        let deadline = deadline.and_then(|d| chrono::Duration::from_std(d).ok()).map(|d| now + d);
        JobEvent {
            event_id: Uuid::now_v7(),
            job_id,
            document_id: job.document_id.clone(),
            job_kind: job.kind.clone(),
            input_version: job.input_version,
            stream_version: 1,
            occurred_at: now,
            trace: job.trace.clone(),
            producer: self.producer.clone(),
            payload: Payload::JobRequested(JobRequested {
                input: job.input.to_string(),
                idempotency_key: job.idempotency_key.clone(),
                max_attempts,
                deadline,
                run_at: Self::due(job, now),
            }),
        }
    }
}
