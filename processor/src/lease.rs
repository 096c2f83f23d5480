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

use crate::metrics as pm;
use chrono::{DateTime, Utc};
use jobfold_common::config::Config;
use jobfold_schemas::event::{ErrorClass, TraceContext};
use sqlx::PgPool;
use uuid::Uuid;

use crate::batch::{self, Batcher};
use crate::store::{self, Events, JobRow};

pub mod decide;

pub use decide::{LeaseDecision, decide};

/// Dispatches decided in one transaction, at most.
pub const BATCH: usize = 64;
/// Lease transactions at once, at most.
pub const WORKERS: usize = 2;

/// A dispatch event, as the lease transaction needs it.
#[derive(Debug, Clone)]
pub struct Dispatch {
    pub job_id: Uuid,
    pub event_id: Uuid,
    pub input_version: i64,
    pub stream_version: i32,
    pub trace: Option<TraceContext>,
}

/// What the lease transaction made of a dispatch.
#[derive(Debug)]
pub enum Leased {
    /// Leased: run the handler.
    Run(Box<JobRow>),
    /// Nothing to run: a duplicate, or the job ended (its `dispatch_version` committed).
    Done,
    /// Another worker holds a live lease: try again at this instant.
    WaitUntil(DateTime<Utc>),
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
}

/// Leases dispatches, several to a transaction.
pub type Leaser = Batcher<Dispatch, Leased>;

/// Starts the leasing task; it ends when every clone of the returned [`Leaser`] is dropped.
pub fn start(settings: Settings) -> Leaser {
    Batcher::start("lease", BATCH, WORKERS, move |dispatches: Vec<Dispatch>| {
        let settings = settings.clone();
        async move {
            let n = dispatches.len();
            let each = (n > 1).then(|| dispatches.clone());
            match lease_batch(&settings, dispatches).await {
                Ok(decided) => decided.into_iter().map(Ok).collect(),
                // Alone: the error itself, its cause kept (a data error is told by it).
                Err(e) if n == 1 => vec![Err(e)],
                // A data error is about one dispatch's rows: find it by leasing each alone,
                // so the error reaches only the one it is about.
                Err(e) if jobfold_common::db::data_error_in(&e).is_some() && each.is_some() => {
                    let mut answers = Vec::with_capacity(n);
                    for dispatch in each.expect("checked") {
                        let alone = lease_batch(&settings, vec![dispatch]).await;
                        answers.push(alone.map(|mut decided| decided.remove(0)));
                    }
                    answers
                }
                Err(e) => batch::each_failed(n, &e),
            }
        }
    })
}

/// One transaction for the whole batch; the decisions in the batch's order.
async fn lease_batch(
    settings: &Settings,
    dispatches: Vec<Dispatch>,
) -> anyhow::Result<Vec<Leased>> {
    let mut tx = settings.pool.begin().await?;
    let job_ids: Vec<Uuid> = dispatches.iter().map(|d| d.job_id).collect();
    let locked = store::lock_jobs(&mut tx, &job_ids).await?;
    let pairs: Vec<(&str, &str)> =
        locked.iter().map(|j| (j.document_id.as_str(), j.kind.as_str())).collect();
    let newest = store::newest_succeeded_each(&mut tx, &pairs).await?;
    let mut jobs: HashMap<Uuid, (JobRow, Option<i64>)> =
        locked.into_iter().zip(newest).map(|(job, newest)| (job.job_id, (job, newest))).collect();

    let now = Utc::now();
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
                store::supersede(&mut tx, &settings.events, &mut job, newer, trace).await?;
                ended.push((job, "superseded"));
                decided.push(Leased::Done);
            }
            LeaseDecision::Quarantine(reason) => {
                let owner = settings.config.quarantine_owner(&job.kind);
                job.dispatch_version = dispatch.stream_version;
                store::quarantine(
                    &mut tx,
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
    let leases = to_lease
        .iter_mut()
        .map(|(i, job)| (job, dispatches[*i].event_id, dispatches[*i].trace.clone()))
        .collect();
    let ttl = |kind: &str| settings.config.kind(kind).lease_ttl;
    store::take_leases(&mut tx, &settings.events, leases, &settings.owner, ttl).await?;
    tx.commit().await?;
    for (job, outcome) in &ended {
        crate::complete::count(job, outcome, &settings.handlers);
    }
    for (i, job) in to_lease {
        decided[i] = Leased::Run(Box::new(job));
    }
    Ok(decided)
}
