//! Completion transactions, several finished attempts to one commit.
//!
//! Each job's task hands its finished attempt to the [`Completer`] and waits. A completing
//! task takes whatever attempts are waiting (up to [`BATCH`]; up to [`WORKERS`] such
//! transactions at once) and commits them in one transaction: the jobs locked in `job_id`
//! order, the generation fence of each, the handlers' business writes in that order, then the
//! successes in three statements for them all (results, events, job rows) and the rarer
//! outcomes one by one.
//!
//! What each attempt commits is what it committed alone: a fenced attempt writes nothing,
//! an unfenced one writes its business result, its state and its events in the same commit
//! (its dispatch event's version is in the job row since its lease, see [`crate::lease`]). If the batch fails (a handler's business write failing, say), its
//! attempts are completed again one transaction each, so one bad attempt fails alone.

use std::collections::HashMap;
use std::sync::Arc;

use crate::metrics as pm;
use chrono::Utc;
use jobfold_common::config::Config;
use jobfold_schemas::event::TraceContext;
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::batch::Batcher;
use crate::handler::{Committed, ErrorClass, HandlerError, Handlers, JobContext};
use crate::store::{self, Events, JobRow, Outcome};

/// Attempts committed in one transaction, at most.
pub const BATCH: usize = 64;
/// Completion transactions at once, at most.
pub const WORKERS: usize = 2;

/// A finished attempt, to be committed.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// The job as this attempt leased it: its generation is the fence.
    pub job: JobRow,
    pub context: JobContext,
    pub result: Result<Value, HandlerError>,
    /// The dispatch event's trace context, for the events written.
    pub trace: Option<TraceContext>,
    /// Cut short by its processor's stop, not by the job: the attempt is given back and the
    /// job is due again at once (outcome `released`).
    pub released: bool,
}

/// What became of an attempt.
#[derive(Debug)]
pub enum Completed {
    /// Committed with this outcome (`succeeded`, `retry_scheduled`, `quarantined`,
    /// `superseded`); the job as it now stands.
    Committed { job: Box<JobRow>, outcome: &'static str },
    /// Another generation holds the job: nothing was written.
    Fenced,
}

/// Commits finished attempts, several to a transaction.
pub type Completer = Batcher<Arc<Attempt>, Completed>;

/// Starts the completing tasks in `work`; they end when every clone of the returned
/// [`Completer`] is dropped.
pub fn start(
    config: Config,
    pool: PgPool,
    events: Events,
    handlers: Handlers,
    work: &crate::supervise::Work,
) -> Completer {
    Batcher::start("completion", BATCH, WORKERS, work, move |attempts: Vec<Arc<Attempt>>| {
        let (config, pool, events, handlers) =
            (config.clone(), pool.clone(), events.clone(), handlers.clone());
        async move { complete_all(&config, &pool, &events, &handlers, &attempts).await }
    })
}

/// Commits `attempts` in one transaction; if it fails, each in a transaction of its own.
/// What became of each, in their order.
pub async fn complete_all(
    config: &Config,
    pool: &PgPool,
    events: &Events,
    handlers: &Handlers,
    attempts: &[Arc<Attempt>],
) -> Vec<anyhow::Result<Completed>> {
    let batch = Batch { config, pool, events, handlers };
    if attempts.len() == 1 {
        return vec![batch.complete_alone(&attempts[0]).await];
    }
    match batch.complete(attempts).await {
        Ok(done) => done.into_iter().map(Ok).collect(),
        Err(e) => {
            tracing::debug!(
                error = %format!("{e:#}"),
                attempts = attempts.len(),
                "A completion batch failed; completing its attempts one by one."
            );
            let mut answers = Vec::with_capacity(attempts.len());
            for attempt in attempts {
                answers.push(batch.complete_alone(attempt).await);
            }
            answers
        }
    }
}

/// What a completion needs of the processor.
pub(crate) struct Batch<'a> {
    pub(crate) config: &'a Config,
    pub(crate) pool: &'a PgPool,
    pub(crate) events: &'a Events,
    pub(crate) handlers: &'a Handlers,
}

impl Batch<'_> {
    /// One attempt in a transaction of its own. If Postgres refuses what the attempt writes
    /// (a data error, class 22 or 23), that is the job's fault, not an outage: the attempt
    /// is completed again as a permanent failure naming the error, so the job is
    /// quarantined with the reason instead of being retried for ever.
    async fn complete_alone(&self, attempt: &Arc<Attempt>) -> anyhow::Result<Completed> {
        let first = self.complete(std::slice::from_ref(attempt)).await;
        let e = match first {
            Ok(mut done) => return Ok(done.remove(0)),
            Err(e) => e,
        };
        if let Some(panicked) = e.downcast_ref::<CommitPanicked>() {
            // The handler's business write panicked: this job's failure, naming it (the
            // transaction it ran in is gone, and the rest of its batch was completed alone).
            tracing::warn!(job_id = %attempt.job.job_id, panic = %panicked.0, "The business write panicked; the attempt fails.");
            let failed = Arc::new(Attempt {
                result: Err(HandlerError::retryable(format!(
                    "the handler's commit panicked: {}",
                    panicked.0
                ))),
                ..Attempt::clone(attempt)
            });
            return self.complete(std::slice::from_ref(&failed)).await.map(|mut d| d.remove(0));
        }
        let Some((code, message)) = jobfold_common::db::data_error_in(&e) else { return Err(e) };
        if attempt.result.as_ref().is_err_and(|e| e.class == ErrorClass::Permanent) {
            // Already a permanent failure, and still refused: not the result's fault.
            return Err(e);
        }
        tracing::warn!(
            job_id = %attempt.job.job_id,
            code = %code,
            error = %message,
            "Postgres refuses the attempt's result; the job is quarantined."
        );
        let refused = Arc::new(Attempt {
            result: Err(HandlerError::permanent(format!(
                "the result cannot be stored: Postgres refused it ({code}): {message}"
            ))),
            ..Attempt::clone(attempt)
        });
        self.complete(std::slice::from_ref(&refused)).await.map(|mut done| done.remove(0))
    }

    /// The business write of `attempt`'s handler; a panic in it is a [`CommitPanicked`].
    async fn commit(
        &self,
        tx: &mut sqlx::PgConnection,
        attempt: &Attempt,
        output: &Value,
    ) -> anyhow::Result<Committed> {
        let kind = &attempt.context.kind;
        let handler = self
            .handlers
            .get(kind)
            .ok_or_else(|| anyhow::anyhow!("no handler for kind {kind:?} in this processor"))?;
        use futures::FutureExt;
        let write = std::panic::AssertUnwindSafe(crate::panics::User::new(
            crate::panics::Call::new(kind, "commit"),
            handler.commit_boxed(tx, &attempt.context, output),
        ));
        match write.catch_unwind().await {
            Ok(committed) => Ok(committed?),
            Err(panic) => Err(CommitPanicked(crate::handler::panic_message(panic.as_ref())).into()),
        }
    }

    /// One transaction for `attempts`; what became of each, in their order.
    async fn complete(&self, attempts: &[Arc<Attempt>]) -> anyhow::Result<Vec<Completed>> {
        let job_ids: Vec<Uuid> = attempts.iter().map(|a| a.job.job_id).collect();
        // One document's attempts finish one after another, so a job comes once per batch;
        // should it come twice, the batch fails and each attempt is completed alone.
        let distinct: std::collections::HashSet<&Uuid> = job_ids.iter().collect();
        anyhow::ensure!(distinct.len() == job_ids.len(), "a job appears twice in one batch");
        let mut tx = self.pool.begin().await?;
        let current: HashMap<Uuid, JobRow> = store::lock_jobs(&mut tx, &job_ids)
            .await?
            .into_iter()
            .map(|job| (job.job_id, job))
            .collect();
        // A job written meanwhile by a transaction that started after this one cannot get
        // its events here (they could reach Kafka ahead of that one's): each alone, then.
        anyhow::ensure!(
            current.values().all(|job| job.fresh_xid),
            "a job of the batch was written by a later transaction"
        );
        let answers = self.complete_locked(&mut tx, current, attempts, HashMap::new()).await?;
        tx.commit().await?;
        Ok(answers)
    }

    /// Writes `attempts` in `tx`, where `current` holds their jobs as they stand, locked by
    /// it; what became of each, in their order, once `tx` commits. An attempt whose lease
    /// `tx` took and has not written yet has its `JobLeased` in `unwritten`: a success
    /// says it in its own event ([`JobSucceeded::lease`](jobfold_schemas::event::JobSucceeded::lease)),
    /// any other outcome writes it before its own.
    pub(crate) async fn complete_locked(
        &self,
        tx: &mut sqlx::PgConnection,
        mut current: HashMap<Uuid, JobRow>,
        attempts: &[Arc<Attempt>],
        mut unwritten: HashMap<Uuid, jobfold_schemas::event::JobLeased>,
    ) -> anyhow::Result<Vec<Completed>> {
        let mut answers: Vec<Option<Completed>> = attempts.iter().map(|_| None).collect();
        let mut successes = Vec::new();
        // Business writes in lock order, so two batches touching the same rows wait on each
        // other in one direction only.
        let mut order: Vec<usize> = (0..attempts.len()).collect();
        order.sort_by_key(|&i| attempts[i].job.job_id);
        for i in order {
            let attempt = &attempts[i];
            let lease = unwritten.remove(&attempt.job.job_id);
            let Some(mut job) = current.remove(&attempt.job.job_id).filter(|job| {
                (lease.is_some() || job.state == jobfold_schemas::fold::Status::Leased)
                    && job.generation == attempt.job.generation
            }) else {
                answers[i] = Some(Completed::Fenced);
                continue;
            };
            let outcome = match &attempt.result {
                Ok(output) => match self.commit(tx, attempt, output).await? {
                    Committed::Applied => {
                        successes.push((i, job, output, lease));
                        continue;
                    }
                    Committed::Stale { newer_version } => {
                        Outcome::Superseded { newer: newer_version }
                    }
                },
                Err(e) => Outcome::Failed {
                    class: e.class,
                    message: e.message.clone(),
                    throttled: e.throttled,
                    snooze: e.snoozed.then(|| self.config.kind(&job.kind).max_snoozes),
                    released: attempt.released,
                    ambiguous: e.ambiguous || attempt.released,
                },
            };
            if let Some(lease) = lease {
                store::write_leases(
                    tx,
                    self.events,
                    vec![(&mut job, lease, attempt.trace.clone())],
                )
                .await?;
            }
            let error = attempt.result.as_ref().err();
            let retry_at = crate::retry::next_attempt_at(
                self.config,
                &job.kind,
                job.attempt,
                error,
                attempt.released,
            );
            let owner = self.config.quarantine_owner(&job.kind);
            let trace = attempt.trace.clone();
            let what = store::complete(tx, self.events, &mut job, outcome, retry_at, &owner, trace)
                .await?;
            answers[i] = Some(Completed::Committed { job: Box::new(job), outcome: what });
        }
        let succeeding = successes
            .iter_mut()
            .map(|(i, job, result, lease)| store::Success {
                job,
                result,
                trace: attempts[*i].trace.clone(),
                lease: lease.take(),
            })
            .collect();
        store::succeed_all(tx, self.events, succeeding).await?;
        for (i, job, _, _) in successes {
            answers[i] = Some(Completed::Committed { job: Box::new(job), outcome: "succeeded" });
        }
        Ok(answers.into_iter().map(|a| a.expect("every attempt is answered")).collect())
    }
}

/// The handler's `commit` panicked, with this message.
#[derive(Debug, thiserror::Error)]
#[error("the handler's commit panicked: {0}")]
pub struct CommitPanicked(pub String);

/// Counts a committed outcome; an ended job also records its acceptance-to-end time.
pub(crate) fn count(job: &JobRow, outcome: &'static str, handlers: &Handlers) {
    metrics::counter!(pm::COMPLETED_TOTAL, "outcome" => outcome).increment(1);
    crate::history::ended(&handlers.label(&job.kind), outcome);
    if !matches!(outcome, "retry_scheduled" | "throttled" | "snoozed" | "released") {
        let took = (Utc::now() - job.accepted_at).to_std().unwrap_or_default();
        let kind = handlers.label(&job.kind);
        metrics::histogram!(pm::ACCEPT_TO_COMPLETE_SECONDS, "kind" => kind, "outcome" => outcome)
            .record(took.as_secs_f64());
    }
}
