//! Lease transactions, several dispatches to one commit.
//!
//! Each document's task hands its dispatch event to the [`Leaser`] and waits for the
//! decision. A leasing task takes whatever dispatches are waiting (up to [`BATCH`]; up to
//! [`WORKERS`] such transactions at once) and decides them all in one transaction: the jobs
//! locked in `job_id` order, the newest succeeded versions, then every write — `JobLeased`
//! events and job rows in two statements. A lone dispatch is one transaction of its own;
//! under load the batches grow and the statements per job fall.
//!
//! A dispatch that leases its job, or ends it without running it, writes its stream version
//! into the job row (`dispatch_version`) in that commit: that is what makes its redelivery a
//! no-op ([`decide()`]), with no dedupe row to look up or write.
//!
//! Nothing of the guarantee changes with batching: every job is locked before the
//! transaction writes to it, and a job written meanwhile by a later transaction (see
//! [`JobRow::fresh_xid`](crate::store::JobRow::fresh_xid)) is left to the next one, so its
//! events keep their order. If the transaction fails, every dispatch of the batch gets the
//! error and is tried again by its task — except a data error (SQLSTATE class 22 or 23),
//! which is about one dispatch's rows: then each is leased alone, and only that one gets it
//! (its task dead-letters the event rather than retrying it for ever).

use std::collections::HashMap;
use std::sync::Arc;

use crate::metrics as pm;
use chrono::{DateTime, Utc};
use jobfold_common::config::Config;
use jobfold_schemas::event::{ErrorClass, TraceContext};
use sqlx::PgPool;
use uuid::Uuid;

use crate::batch::{self, Batcher};
use crate::complete::{Attempt, Completed};
use crate::handler::{HandlerError, JobContext};
use crate::store::{self, Events, JobRow};
use jobfold_schemas::event::JobLeased;
use tokio::sync::oneshot;

pub mod decide;

pub use decide::{LeaseDecision, decide};

/// Dispatches decided in one transaction, at most.
pub const BATCH: usize = 256;
/// Lease transactions at once, at most.
pub const WORKERS: usize = 3;

/// A dispatch event, as the lease transaction needs it.
#[derive(Debug, Clone)]
pub struct Dispatch {
    pub job_id: Uuid,
    pub event_id: Uuid,
    pub input_version: i64,
    pub stream_version: i32,
    pub trace: Option<TraceContext>,
}

/// A dispatch to lease, and whether its handler may run before the lease commits.
#[derive(Debug)]
pub struct Request {
    pub dispatch: Dispatch,
    /// Offered: a leased job is sent here before its lease commits, and the transaction
    /// waits up to the window for the finished attempt, to commit it with the lease.
    pub inline: Option<Inline>,
}

/// Where a job leased but not yet committed goes to run, and for how long the lease
/// transaction waits for its attempt (its kind's `inline_window`).
#[derive(Debug)]
pub struct Inline {
    pub window: std::time::Duration,
    pub run: oneshot::Sender<InlineRun>,
}

/// A job whose lease its transaction holds, uncommitted: run it and send the finished
/// attempt back. Sent back within the window, lease and outcome commit together; later (or
/// never), the lease commits alone and the attempt completes as any other.
#[derive(Debug)]
pub struct InlineRun {
    pub job: JobRow,
    pub finished: oneshot::Sender<Arc<Attempt>>,
}

/// What the lease transaction made of a dispatch.
#[derive(Debug)]
pub enum Leased {
    /// Leased: run the handler (or, run before the lease committed, complete its attempt).
    Run(Box<JobRow>),
    /// Leased, and a suspect (it was running when a process died): run it isolated — one
    /// such run at a time in the process, recorded before it starts, so a crash it causes
    /// again is counted against it alone.
    Isolated(Box<JobRow>),
    /// Nothing to run: a duplicate, or the job ended (its `dispatch_version` committed).
    Done,
    /// Another worker holds a live lease: try again at this instant.
    WaitUntil(DateTime<Utc>),
    /// Run within the lease transaction: the attempt committed with its lease.
    Completed(Completed),
    /// Sent to run within the lease transaction, but not back within the window: the lease
    /// (the job as sent) committed alone, and the run's attempt completes as any other.
    RunOn,
}

/// What the lease transactions need to know.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: Config,
    pub pool: PgPool,
    pub events: Events,
    /// This worker's name in leases.
    pub owner: String,
    /// The kinds run here (for metric labels).
    pub handlers: crate::handler::Handlers,
    /// Held by the one lease transaction of this process whose inline runs include a job a
    /// death found running before (see [`Wary`]).
    pub wary: Wary,
}

/// One job at a time, in this process, that a death found running before and that is not a
/// suspect yet may run inside a lease transaction's window, where its process's death is
/// counted against every job of the transaction.
///
/// A job that aborts its process dies the first time with whatever its lease transaction ran
/// (up to [`BATCH`] jobs), and all of them are charged one crash. Retried together — their
/// retries fall due together, their dispatches come in together — they would die with it a
/// second time, all one death short of `max_crashes` and each a suspect, run one at a time
/// while holding its document's turn. Kept apart, the next death charges again only the
/// one that killed, and the jobs beside it at that moment are charged their first crash. The
/// others wait (a few milliseconds each: the transaction holding the turn ends within its
/// window); their runs, once started, go on side by side.
#[derive(Debug, Clone)]
pub struct Wary(Arc<tokio::sync::Semaphore>);

impl Default for Wary {
    fn default() -> Self {
        Self(Arc::new(tokio::sync::Semaphore::new(1)))
    }
}

impl Wary {
    fn try_take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        Arc::clone(&self.0).try_acquire_owned().ok()
    }
}

/// Leases dispatches, several to a transaction.
pub type Leaser = Batcher<Request, Leased>;

/// Starts the leasing tasks in `work`; they end when every clone of the returned [`Leaser`]
/// is dropped.
pub fn start(settings: Settings, work: &crate::supervise::Work) -> Leaser {
    Batcher::start("lease", BATCH, WORKERS, work, move |requests: Vec<Request>| {
        let settings = settings.clone();
        async move {
            let (dispatches, offers): (Vec<Dispatch>, Vec<Option<Inline>>) =
                requests.into_iter().map(|r| (r.dispatch, r.inline)).unzip();
            if offers.iter().all(Option::is_none) {
                return lease_plain(&settings, dispatches).await;
            }
            match lease_batch(&settings, &dispatches, offers).await {
                Ok(decided) => decided.into_iter().map(Ok).collect(),
                // Whatever failed (a handler's business write, a result Postgres refuses,
                // the database), nothing of the batch is written: its leases are taken
                // again on their own, and the attempts already run complete after them as
                // any other, where a refused one is told apart and quarantined.
                Err(e) => {
                    tracing::debug!(
                        error = %format!("{e:#}"),
                        "A lease transaction with runs in it failed; leasing its dispatches alone."
                    );
                    lease_plain(&settings, dispatches).await
                }
            }
        }
    })
}

/// Leases `dispatches` in one transaction, none run in it; if it fails, the error for each
/// (a data error found by leasing each alone, so it reaches only the one it is about).
async fn lease_plain(
    settings: &Settings,
    dispatches: Vec<Dispatch>,
) -> Vec<anyhow::Result<Leased>> {
    let n = dispatches.len();
    let none = || (0..n).map(|_| None).collect();
    match lease_batch(settings, &dispatches, none()).await {
        Ok(decided) => decided.into_iter().map(Ok).collect(),
        // Alone: the error itself, its cause kept (a data error is told by it).
        Err(e) if n == 1 => vec![Err(e)],
        Err(e) if jobfold_common::db::data_error_in(&e).is_some() => {
            let mut answers = Vec::with_capacity(n);
            for dispatch in dispatches {
                let alone =
                    lease_batch(settings, std::slice::from_ref(&dispatch), vec![None]).await;
                answers.push(alone.map(|mut decided| decided.remove(0)));
            }
            answers
        }
        Err(e) => batch::each_failed(n, &e),
    }
}

/// One transaction for the whole batch; the decisions in the batch's order. Should it fail
/// after its inline runs were recorded, the record is deleted (the process lives: nothing
/// crashed).
async fn lease_batch(
    settings: &Settings,
    dispatches: &[Dispatch],
    offers: Vec<Option<Inline>>,
) -> anyhow::Result<Vec<Leased>> {
    let mut recorded = None;
    let decided = lease_batch_recorded(settings, dispatches, offers, &mut recorded).await;
    if let (Err(_), Some(run_id)) = (&decided, recorded)
        && let Err(e) = store::inline_runs_end(&settings.pool, run_id).await
    {
        tracing::warn!(error = %e, %run_id, "Deleting the record of a failed lease transaction's runs failed; their next lease counts them as crashed.");
    }
    decided
}

/// [`lease_batch`], leaving in `recorded` the id of its inline runs' record once written.
async fn lease_batch_recorded(
    settings: &Settings,
    dispatches: &[Dispatch],
    mut offers: Vec<Option<Inline>>,
    recorded: &mut Option<Uuid>,
) -> anyhow::Result<Vec<Leased>> {
    let mut tx = settings.pool.begin().await?;
    let job_ids: Vec<Uuid> = dispatches.iter().map(|d| d.job_id).collect();
    let jobs: HashMap<Uuid, (JobRow, Option<i64>)> = store::lock_jobs_and_newest(&mut tx, &job_ids)
        .await?
        .into_iter()
        .map(|(job, newest)| (job.job_id, (job, newest)))
        .collect();

    let now = Utc::now();
    let (mut decided, to_lease, ended) =
        decide_all(settings, &mut tx, dispatches, jobs, now).await?;
    let Crashes { to_lease, died, isolated, wary } =
        sort_out_crashes(settings, &mut tx, &offers, to_lease, &mut decided, now).await?;
    // A crashed run's attempt: leased in memory and completed as failed with the others
    // completed in this transaction.
    let died = attempts_that_died(settings, dispatches, died, now)?;
    // Jobs whose handlers may run in this transaction are leased in memory and sent to
    // run; the others' leases are written now.
    let (inline, plain): (Vec<_>, Vec<_>) =
        to_lease.into_iter().partition(|(i, _)| offers[*i].is_some() && !isolated.contains(i));
    let mut plain = plain;
    let leases = plain
        .iter_mut()
        .map(|(i, job)| (job, dispatches[*i].event_id, dispatches[*i].trace.clone()))
        .collect();
    let ttl = |kind: &str| settings.config.kind(kind).lease_ttl;
    store::take_leases(&mut tx, &settings.events, leases, &settings.owner, ttl).await?;
    if !inline.is_empty() {
        // Recorded in a commit of its own before they start: should this process die while
        // they run, the record outlives this transaction and tells whoever leases them next.
        let run_id = Uuid::new_v4();
        let ids: Vec<Uuid> = inline.iter().map(|(_, job)| job.job_id).collect();
        store::inline_runs_begin(&settings.pool, run_id, &ids, &settings.owner).await?;
        *recorded = Some(run_id);
    }
    let (finished, mut pending) =
        run_inline(settings, dispatches, &mut offers, inline, now, &mut decided)?.wait().await;
    let mut finished: Vec<Finished> =
        finished.into_iter().map(|(i, attempt, lease)| (i, attempt, Some(lease))).collect();
    finished.extend(died);
    let leases = pending
        .iter_mut()
        .map(|(i, job, lease)| (job, lease.clone(), dispatches[*i].trace.clone()))
        .collect();
    store::write_leases(&mut tx, &settings.events, leases).await?;
    let (indices, completed) = complete_finished(settings, &mut tx, finished).await?;
    if let Some(run_id) = *recorded {
        store::inline_runs_end(&mut *tx, run_id).await?;
    }
    tx.commit().await?;
    drop(wary);
    for (job, outcome) in &ended {
        crate::complete::count(job, outcome, &settings.handlers);
    }
    for (i, job) in plain {
        decided[i] = if isolated.contains(&i) {
            Leased::Isolated(Box::new(job))
        } else {
            Leased::Run(Box::new(job))
        };
    }
    for (i, _, _) in pending {
        decided[i] = Leased::RunOn;
    }
    for (i, done) in indices.into_iter().zip(completed) {
        decided[i] = Leased::Completed(done);
    }
    Ok(decided)
}

/// The jobs to lease, sorted by what the records of runs that died say of them.
struct Crashes {
    /// Still to lease.
    to_lease: Vec<(usize, JobRow)>,
    /// Their runs died: each is an attempt that failed.
    died: Vec<(usize, JobRow, store::Crashed)>,
    /// Suspects: leased first, then run isolated.
    isolated: std::collections::HashSet<usize>,
    /// This process's one inline run of a job that died beside others before, if one of
    /// these took it; held until the transaction ends.
    wary: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Sorts `to_lease` by the records of runs that died (see [`Crashes`]); a job that died
/// beside others before, offered to run inline while another such job of this process is,
/// waits for the next transaction instead (`decided`).
async fn sort_out_crashes(
    settings: &Settings,
    tx: &mut sqlx::PgConnection,
    offers: &[Option<Inline>],
    to_lease: Vec<(usize, JobRow)>,
    decided: &mut [Leased],
    now: DateTime<Utc>,
) -> anyhow::Result<Crashes> {
    let mut died = Vec::new();
    let mut isolated = std::collections::HashSet::new();
    // Of the jobs to lease (no live lease holds them: their runs, if any, are dead), those
    // that were running when a process died: each run found dead counts as an attempt that
    // failed (so a job that kills its process cannot crash-loop the group), and at the
    // kind's max_crashes the job is quarantined, saying so. A job one death short of it runs
    // isolated (see `decide::runs_isolated`); one with fewer runs beside the others.
    let leasing: Vec<Uuid> = to_lease.iter().map(|(_, job)| job.job_id).collect();
    let crashed = store::crashed_runs(&mut *tx, &leasing).await?;
    // Held until this transaction ends: its inline runs' record goes with its commit.
    let mut wary = None;
    let kept_apart = || {
        metrics::counter!(pm::CRASHED_KEPT_APART_TOTAL).increment(1);
        Leased::WaitUntil(now)
    };
    let to_lease: Vec<(usize, JobRow)> = if crashed.is_empty() {
        to_lease
    } else {
        let mut kept = Vec::with_capacity(to_lease.len());
        for (i, job) in to_lease {
            let max = settings.config.kind(&job.kind).max_crashes;
            match crashed.get(&job.job_id) {
                Some(crash) if crash.just_found || crash.crashes >= max => {
                    died.push((i, job, crash.clone()));
                }
                // A suspect: its lease commits first and it runs isolated, so that the crash
                // that would end it is told apart from the jobs that ran beside it.
                Some(crash) if decide::runs_isolated(crash.crashes, max) => {
                    isolated.insert(i);
                    kept.push((i, job));
                }
                // Died beside others before: inline only while no other such job of this
                // process is (see `Wary`); else it waits for the next transaction.
                Some(_) if offers[i].is_some() && wary.is_none() => {
                    wary = settings.wary.try_take();
                    if wary.is_some() {
                        kept.push((i, job));
                    } else {
                        decided[i] = kept_apart();
                    }
                }
                Some(_) if offers[i].is_some() => decided[i] = kept_apart(),
                Some(_) | None => kept.push((i, job)),
            }
        }
        kept
    };
    Ok(Crashes { to_lease, died, isolated, wary })
}

/// Decides each of `dispatches` against its job, locked by `tx`, with the newest version of
/// its document and kind that succeeded (`jobs`): what becomes of each now (`Done` standing
/// for those to lease until they are), the jobs to lease with their dispatch's index, and
/// the jobs `tx` ended (superseded, quarantined) with how.
async fn decide_all(
    settings: &Settings,
    tx: &mut sqlx::PgConnection,
    dispatches: &[Dispatch],
    mut jobs: HashMap<Uuid, (JobRow, Option<i64>)>,
    now: DateTime<Utc>,
) -> anyhow::Result<(Vec<Leased>, Vec<(usize, JobRow)>, Vec<(JobRow, &'static str)>)> {
    let mut decided = Vec::with_capacity(dispatches.len());
    let mut to_lease = Vec::new();
    let mut ended = Vec::new();
    let mut seen = std::collections::HashSet::with_capacity(dispatches.len());
    for (i, dispatch) in dispatches.iter().enumerate() {
        // One document's dispatches are handled one after another, so a job comes once per
        // batch; should it come twice, the second waits for the next transaction.
        if !seen.insert(dispatch.job_id) {
            decided.push(Leased::WaitUntil(now));
            continue;
        }
        let Some((mut job, newer)) = jobs.remove(&dispatch.job_id) else {
            tracing::warn!(job_id = %dispatch.job_id, "Event for an unknown job skipped.");
            decided.push(Leased::Done);
            continue;
        };
        if !job.fresh_xid {
            // Written meanwhile by a transaction that started after this one: decided in the
            // next transaction, whose xid comes after it.
            decided.push(Leased::WaitUntil(now));
            continue;
        }
        let trace = dispatch.trace.clone();
        match decide(&job, dispatch.input_version, dispatch.stream_version, newer, now) {
            LeaseDecision::Wait(until) => decided.push(Leased::WaitUntil(until)),
            LeaseDecision::Duplicate => {
                metrics::counter!(pm::DUPLICATES_SKIPPED_TOTAL).increment(1);
                tracing::debug!(event_id = %dispatch.event_id, "Duplicate event skipped.");
                decided.push(Leased::Done);
            }
            LeaseDecision::Skip(why) => {
                tracing::debug!(job_id = %job.job_id, why, "Dispatch event skipped.");
                decided.push(Leased::Done);
            }
            LeaseDecision::Supersede(newer) => {
                job.dispatch_version = dispatch.stream_version;
                store::supersede(&mut *tx, &settings.events, &mut job, newer, trace).await?;
                ended.push((job, "superseded"));
                decided.push(Leased::Done);
            }
            LeaseDecision::Quarantine(reason) => {
                let owner = settings.config.quarantine_owner(&job.kind);
                job.dispatch_version = dispatch.stream_version;
                store::quarantine(
                    &mut *tx,
                    &settings.events,
                    &mut job,
                    ErrorClass::Retryable,
                    &reason,
                    &owner,
                    trace,
                )
                .await?;
                ended.push((job, "quarantined"));
                decided.push(Leased::Done);
            }
            LeaseDecision::Lease => {
                job.dispatch_version = dispatch.stream_version;
                to_lease.push((i, job));
                decided.push(Leased::Done); // replaced below by the leased row
            }
        }
    }
    Ok((decided, to_lease, ended))
}

/// An attempt that ended in a lease transaction: its dispatch's index, and its lease if not
/// written yet (a success says it itself, any other outcome writes a `JobLeased` first).
type Finished = (usize, Arc<Attempt>, Option<JobLeased>);

/// The attempts of the jobs in `died` (their runs died with their process), failed as
/// [`crashed_attempt`]s, each with the lease to write before it if its run had no
/// committed lease (it ran in a lease transaction that died).
fn attempts_that_died(
    settings: &Settings,
    dispatches: &[Dispatch],
    died: Vec<(usize, JobRow, store::Crashed)>,
    now: DateTime<Utc>,
) -> anyhow::Result<Vec<Finished>> {
    died.into_iter()
        .map(|(i, mut job, crash)| {
            // Its committed lease, expired (an isolated run), is the attempt that died; a
            // run in a dead lease transaction had none, so it gets one here.
            let lease = if job.state == jobfold_schemas::fold::Status::Leased {
                None
            } else {
                let ttl = settings.config.kind(&job.kind).lease_ttl;
                Some(store::lease(&mut job, dispatches[i].event_id, &settings.owner, ttl, now)?)
            };
            Ok((
                i,
                crashed_attempt(&settings.config, job, &crash, dispatches[i].trace.clone()),
                lease,
            ))
        })
        .collect()
}

/// Completes in `tx` the attempts that ended in it (run inline, or found dead): the index
/// of each one's dispatch, and what became of it once `tx` commits.
async fn complete_finished(
    settings: &Settings,
    tx: &mut sqlx::PgConnection,
    finished: Vec<Finished>,
) -> anyhow::Result<(Vec<usize>, Vec<crate::complete::Completed>)> {
    let mut indices = Vec::with_capacity(finished.len());
    let completed = if finished.is_empty() {
        Vec::new()
    } else {
        let (mut current, mut unwritten) = (HashMap::new(), HashMap::new());
        let attempts: Vec<Arc<Attempt>> = finished
            .into_iter()
            .map(|(i, attempt, lease)| {
                indices.push(i);
                current.insert(attempt.job.job_id, attempt.job.clone());
                if let Some(lease) = lease {
                    unwritten.insert(attempt.job.job_id, lease);
                }
                attempt
            })
            .collect();
        let batch = crate::complete::Batch {
            config: &settings.config,
            pool: &settings.pool,
            events: &settings.events,
            handlers: &settings.handlers,
        };
        batch.complete_locked(tx, current, &attempts, unwritten).await?
    };
    Ok((indices, completed))
}

/// The attempt of `job` (leased in memory) whose run died with its process: a retryable
/// failure naming the crash, or, at its kind's `max_crashes`, a permanent one saying so.
fn crashed_attempt(
    config: &Config,
    job: JobRow,
    crash: &store::Crashed,
    trace: Option<TraceContext>,
) -> Arc<Attempt> {
    metrics::counter!(pm::CRASHED_RUNS_TOTAL).increment(1);
    let max = config.kind(&job.kind).max_crashes;
    let what =
        format!("the process running it ({}) died before its attempt committed", crash.owner);
    tracing::warn!(job_id = %job.job_id, crashes = crash.crashes, max_crashes = max, owner = %crash.owner, "A job's run died with its process; counted as an attempt.");
    let result = if crash.crashes >= max {
        Err(HandlerError::permanent(format!(
            "its run killed its processor {} times (max_crashes {max}); last: {what}",
            crash.crashes
        ))
        .ambiguous())
    } else {
        let failed = HandlerError::retryable(format!(
            "{what} (crash {} of max_crashes {max})",
            crash.crashes
        ))
        .ambiguous();
        // One death short of max_crashes, its next run is isolated and, if it kills again,
        // its last: it waits crash_backoff first, so its partition's other documents move on
        // between its deaths instead of every new owner dying on it within seconds.
        if decide::runs_isolated(crash.crashes, max) {
            Err(failed.retry_after(config.kind(&job.kind).crash_backoff))
        } else {
            Err(failed)
        }
    };
    let context = JobContext {
        job_id: job.job_id,
        document_id: job.document_id.clone(),
        kind: job.kind.clone(),
        input_version: job.input_version,
        input: serde_json::Value::Null,
        attempt: job.attempt,
        generation: job.generation,
        trace: None,
        deadline: job.deadline,
        max_attempts: job.max_attempts,
        previous_outcome: crate::handler::PreviousOutcome::from_column(
            job.previous_outcome.as_deref(),
        ),
    };
    Arc::new(Attempt { job, context, result, trace, released: false })
}

/// The jobs of a lease transaction running before it commits.
struct Running {
    runs: Vec<Run>,
}

/// A job of the batch running before its lease commits.
struct Run {
    /// Its index in the batch.
    index: usize,
    /// The job, leased in memory.
    job: JobRow,
    /// Its `JobLeased`, not written yet.
    lease: JobLeased,
    /// Where its attempt comes back.
    attempt: oneshot::Receiver<Arc<Attempt>>,
    /// Until when it is waited for.
    until: tokio::time::Instant,
}

/// Leases each of `inline` in memory and sends it to its task to run. A task that is gone
/// (its message given up: shutdown, revoke) gets nothing written: its job stays as it was.
fn run_inline(
    settings: &Settings,
    dispatches: &[Dispatch],
    offers: &mut [Option<Inline>],
    inline: Vec<(usize, JobRow)>,
    now: DateTime<Utc>,
    decided: &mut [Leased],
) -> anyhow::Result<Running> {
    let started = tokio::time::Instant::now();
    let mut runs = Vec::with_capacity(inline.len());
    for (i, mut job) in inline {
        let Some(offer) = offers[i].take() else { continue };
        let ttl = settings.config.kind(&job.kind).lease_ttl;
        let lease = store::lease(&mut job, dispatches[i].event_id, &settings.owner, ttl, now)?;
        let (finished, attempt) = oneshot::channel();
        // The input goes to the run; what stays here to write the lease needs none of it.
        let payload = std::mem::take(&mut job.payload);
        if offer.run.send(InlineRun { job: JobRow { payload, ..job.clone() }, finished }).is_err() {
            decided[i] = Leased::WaitUntil(now);
            continue;
        }
        runs.push(Run { index: i, job, lease, attempt, until: started + offer.window });
    }
    Ok(Running { runs })
}

impl Running {
    /// Waits for each run until its window closes: the attempts finished in time (index,
    /// attempt, unwritten `JobLeased`), and the jobs still running (index, job, `JobLeased`),
    /// whose leases are written to commit alone. A run given up by its task is neither.
    async fn wait(
        self,
    ) -> (Vec<(usize, Arc<Attempt>, JobLeased)>, Vec<(usize, JobRow, JobLeased)>) {
        let (mut finished, mut pending) = (Vec::new(), Vec::new());
        for Run { index, job, lease, attempt, until } in self.runs {
            match tokio::time::timeout_at(until, attempt).await {
                Ok(Ok(attempt)) => finished.push((index, attempt, lease)),
                Ok(Err(_)) => {}
                Err(_) => pending.push((index, job, lease)),
            }
        }
        (finished, pending)
    }
}
