//! The job runner: a member of the processors' consumer group on the events topic.
//!
//! Invariant: an event's offset is stored only after the transaction that recorded its
//! effect (the completion, or a lease transaction that ended the job) committed — and only
//! up to the lowest offset of its partition still in flight ([`crate::offsets`]).
//!
//! Concurrency: jobs of different documents run at once, up to `processor.max_in_flight`;
//! one document's events run one after another, in partition order (each document has one
//! queue; a task is started for its next message when a slot is free, and the document
//! goes back in line after it, so a document waiting costs only its queued messages). A
//! slot is held only while a job is leased, running and completing: a message waiting behind its document's running job, for its kind's
//! `concurrency`, or for a retry holds none, so a document with a thousand versions queued
//! takes one slot and the other documents take the rest. What each partition holds in
//! memory is bounded: past `processor.max_buffered` messages or `max_buffered_bytes` it is
//! paused, and resumed when half is left ([`crate::buffer`]).
//!
//! Per dispatch event (`JobRequested`, `RetryDue`, `ReplayRequested`):
//! 1. lease transaction: skip a duplicate (older than the job's `dispatch_version`, or that
//!    dispatch again once its attempt is over); end the job without running it if it is
//!    superseded or out of budget, skip it if it is finished; wait while another worker
//!    holds a live lease; else take the lease (generation + 1, `dispatch_version`).
//! 2. run the handler outside any transaction, extending the lease by heartbeat; a lost
//!    lease cancels it.
//! 3. completion transaction, fenced by the generation: business write, result, state,
//!    events — one commit. A fenced (zombie) completion writes nothing and is counted.
//!
//! Lease and completion transactions are shared: the dispatches (attempts) waiting at the
//! same moment are decided (committed) together, in one transaction ([`crate::lease`],
//! [`crate::complete`]); each one's writes are those it would make alone.
//! 4. store the offset.
//!
//! Rebalance: a revoked partition starts no new work; its running jobs get
//! `processor.revoke_timeout` to finish, then its offsets are committed synchronously and it
//! is released. A new owner resumes from the committed offset and respects live leases. The
//! consumer is polled on a thread of its own ([`consume`]), where the rebalance callbacks run
//! and may block that long: no tokio worker waits on them.
//!
//! Shutdown (the first SIGTERM): consumption stops and nothing new starts; running handlers
//! go on, their tokens untouched, up to `processor.shutdown_timeout`. Then the tokens fire
//! and each run cut short completes as `released`: its attempt given back, the job due again
//! at once, so the partition's next owner runs it without waiting for the lease to run out.
//! The stored offsets are committed and the consumer leaves the group.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use jobfold_common::config::{Config, MAX_ERROR_BYTES};
use jobfold_common::failpoint;
use jobfold_schemas::event::EVENT_KIND;
use jobfold_schemas::{Decoder, JobEvent, Payload};
use rand::Rng;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::{ClientContext, Message, Statistics};
use sqlx::PgPool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::buffer::{Bounds, Buffer};
use crate::complete::{Attempt, Completed, Completer};
use crate::dead_letter::Raw;
use crate::handler::{HandlerError, Handlers, JobContext, PreviousOutcome, panic_message};
use crate::heartbeat::Heartbeats;
use crate::internal_events::{
    At, CompletionFenced, ConsumerFailed, ErrorBackoff, MessageError, MessageRetried,
    PartitionPaused, PartitionsMoved,
};
use crate::lease::{Dispatch, Inline, InlineRun, Leased, Leaser, Request};
use crate::metrics as pm;
use crate::offsets::{Ticket, Tracker};
use crate::store::{Events, JobRow};

mod attempt;
mod consumer;
mod dispatch;
mod orphans;

#[allow(clippy::wildcard_imports)]
use self::{attempt::*, consumer::*, dispatch::*};

/// What the tasks share.
struct Shared {
    config: Config,
    pool: PgPool,
    consumer: Arc<BaseConsumer<WorkerContext>>,
    decoder: Decoder<JobEvent>,
    events: Events,
    /// The handlers this processor runs, by kind.
    handlers: Handlers,
    /// Documents whose next job waits for a kind this processor has no handler for.
    waiting_for_handler: std::sync::atomic::AtomicI64,
    /// Per kind with a `concurrency` setting: its running jobs' slots.
    kind_slots: HashMap<String, Arc<Semaphore>>,
    /// The process's running jobs' slots, `processor.max_in_flight`.
    slots: Arc<Semaphore>,
    /// What each partition holds, to pause and resume it.
    buffer: Arc<Mutex<Buffer>>,
    /// Leases dispatches, several to a transaction.
    leaser: Leaser,
    /// Commits finished attempts, several to a transaction.
    completer: Completer,
    /// Suspects (jobs that were running when a process died) run one at a time.
    suspects: Semaphore,
    /// This worker's name in leases and run records.
    owner: String,
    /// Where a run may wait for its handler's callback (a `202` over HTTP).
    callbacks: Arc<crate::callback::Scope>,
    /// Keeps every running attempt's lease alive, one statement a beat.
    heartbeats: Heartbeats,
    /// The kinds' rate limits and 429 pauses, shared with the group's other processors.
    quotas: Arc<crate::quota::Quotas>,
    /// The kinds an operator paused, group-wide.
    pauses: Arc<crate::pauses::Pauses>,
    tracker: Arc<Mutex<Tracker>>,
    /// The jobs running here, for this processor's presence row.
    running: Arc<crate::presence::Running>,
    /// The documents with messages in memory, and those waiting for a slot.
    queues: Arc<Mutex<Queues>>,
    /// Wakes the dispatcher when a document became ready.
    ready: tokio::sync::Notify,
    /// The graceful stop: no new work starts; running handlers go on.
    shutdown: CancellationToken,
    /// The hard stop, `processor.shutdown_timeout` after the graceful one (at once when a
    /// background task failed): running handlers' tokens fire, and what they leave unfinished
    /// is given back ([`released`]).
    hard: CancellationToken,
    /// The tasks started as work comes (each document's next message, the batchers, the
    /// callback look): joined when the worker stops, a panic ending it.
    work: crate::supervise::Work,
}

/// How long a handler whose token the hard stop fired may take to return before its run is
/// dropped and its job given back all the same.
const RELEASE_GRACE: Duration = Duration::from_secs(2);

/// Runs jobs until `shutdown`.
///
/// # Errors
/// The consumer could not be created or subscribed.
pub async fn run(
    config: Config,
    pool: PgPool,
    decoder: Decoder<JobEvent>,
    events: Events,
    handlers: Handlers,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // Every background task is supervised: one that ends while the worker runs fails it.
    let mut tasks = crate::supervise::Tasks::default();
    let (shared, stopping) =
        assemble(config, pool, decoder, events, handlers, shutdown, &mut tasks).await?;
    let dispatcher = spawn_background(&shared, &mut tasks);
    let mut consumer = ConsumerThread::start(Arc::clone(&shared.consumer));
    let failed = take_arrivals(&shared, &mut tasks, &mut consumer).await;
    dispatcher.cancel();
    stop(&shared, failed.is_some(), &stopping, &mut consumer).await;
    crate::history::flush(&shared.pool, &shared.owner).await;
    tasks.stop().await;
    // With the background tasks gone, this is the last hold on the worker's state: dropped,
    // the batchers and the callback look end, and the documents' last tasks finish.
    let work = shared.work.clone();
    drop(shared);
    work.join("the worker", crate::supervise::JOIN_TIMEOUT).await;
    failed.map_or(Ok(()), Err)
}

/// A semaphore of each kind's `concurrency` slots, for the kinds that set one.
fn kind_slots(config: &Config) -> HashMap<String, Arc<Semaphore>> {
    config
        .kinds
        .iter()
        .filter_map(|(kind, k)| Some((kind.clone(), Arc::new(Semaphore::new(k.concurrency?)))))
        .collect()
}

/// The worker's state: its consumer subscribed, the lease and completion batchers, the
/// slots, and its background tasks (heartbeat, quota and pause polls) started in `tasks`.
/// Also the flag its rebalance callbacks read while it stops.
async fn assemble(
    config: Config,
    pool: PgPool,
    decoder: Decoder<JobEvent>,
    events: Events,
    handlers: Handlers,
    shutdown: CancellationToken,
    tasks: &mut crate::supervise::Tasks,
) -> anyhow::Result<(Arc<Shared>, Arc<std::sync::atomic::AtomicBool>)> {
    let context = WorkerContext::new(&config);
    let (tracker, buffer, queues, stopping) = (
        Arc::clone(&context.tracker),
        Arc::clone(&context.buffer),
        Arc::clone(&context.queues),
        Arc::clone(&context.stopping),
    );
    let consumer = subscribe(&config, context)?;
    let owner = format!("{}/{}", hostname(), std::process::id());
    tracing::info!(group = %config.processor.group, %owner, "Running jobs.");
    let work = tasks.work();
    let settings = crate::lease::Settings {
        config: config.clone(),
        pool: pool.clone(),
        events: events.clone(),
        owner: owner.clone(),
        handlers: handlers.clone(),
        wary: crate::lease::Wary::default(),
    };
    let (leaser, completer) = (
        crate::lease::start(settings, &work),
        crate::complete::start(
            config.clone(),
            pool.clone(),
            events.clone(),
            handlers.clone(),
            &work,
        ),
    );
    tracing::info!(kinds = ?handlers, "Handlers registered.");
    let kind_slots = kind_slots(&config);
    let (heartbeats, beat) = Heartbeats::new(pool.clone(), config.shortest_heartbeat());
    tasks.spawn("heartbeat", beat);
    let quotas = crate::quota::Quotas::new(&config, pool.clone());
    tasks.spawn("quota poll", Arc::clone(&quotas).poll(shutdown.clone()));
    // Read before anything is consumed: a processor started while a kind is paused runs none
    // of its jobs.
    let kinds = handlers.kinds().map(str::to_owned).collect();
    let pauses = Arc::new(crate::pauses::Pauses::load(pool.clone(), kinds).await?);
    tasks.spawn("pause poll", Arc::clone(&pauses).poll(shutdown.clone()));
    let callbacks =
        crate::callback::Scope::new(&config, pool.clone(), owner.clone(), &hostname(), &work);
    let shared = Arc::new(Shared {
        slots: Arc::new(Semaphore::new(config.processor.max_in_flight)),
        config,
        callbacks: Arc::new(callbacks),
        pool,
        consumer: Arc::new(consumer),
        decoder,
        events,
        handlers,
        waiting_for_handler: std::sync::atomic::AtomicI64::new(0),
        kind_slots,
        buffer,
        leaser,
        completer,
        suspects: Semaphore::new(1),
        owner,
        heartbeats,
        quotas,
        pauses,
        tracker,
        running: Arc::default(),
        queues,
        ready: tokio::sync::Notify::new(),
        shutdown,
        hard: CancellationToken::new(),
        work,
    });
    Ok((shared, stopping))
}

/// Starts the worker's background tasks under `tasks` (the reaper, retention, presence,
/// history and the dispatcher); returns what stops the dispatcher.
fn spawn_background(
    shared: &Arc<Shared>,
    tasks: &mut crate::supervise::Tasks,
) -> CancellationToken {
    let shutdown = &shared.shutdown;
    let (config, pool) = (&shared.config, &shared.pool);
    tasks.spawn(
        "reaper",
        crate::reaper::run(config.clone(), pool.clone(), shared.events.clone(), shutdown.clone()),
    );
    // Off (the default), retention has nothing to run.
    if !config.retention.sweeps().is_empty() {
        tasks.spawn(
            "retention",
            crate::retention::run(config.clone(), pool.clone(), shutdown.clone()),
        );
    }
    let held = Arc::clone(&shared.tracker);
    tasks.spawn(
        "presence",
        crate::presence::run(
            pool.clone(),
            shared.owner.clone(),
            config.processor.group.clone(),
            Arc::clone(&shared.running),
            move || held.lock().map(|t| t.held_partitions()).unwrap_or_default(),
            shutdown.clone(),
        ),
    );
    tasks.spawn(
        "history",
        crate::history::run(pool.clone(), shared.owner.clone(), shutdown.clone()),
    );
    tasks.spawn("assignment check", orphans::watch(Arc::clone(shared)));
    let dispatcher_stopped = shutdown.child_token();
    let (stop_dispatcher, dispatching) = (dispatcher_stopped.clone(), Arc::clone(shared));
    tasks.spawn("dispatcher", async move {
        tokio::select! {
            _ = stop_dispatcher.cancelled() => {}
            () = dispatch(dispatching) => {}
        }
    });
    dispatcher_stopped
}

/// Takes what the consumer's thread polls until the shutdown, a background task's end or a
/// fatal consumer error; the error that stops the worker, if one does.
async fn take_arrivals(
    shared: &Shared,
    tasks: &mut crate::supervise::Tasks,
    consumer: &mut ConsumerThread,
) -> Option<anyhow::Error> {
    let shutdown = &shared.shutdown;
    let mut errors = ErrorBackoff::default();
    loop {
        let arrival = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return None,
            ended = tasks.ended() => {
                // Stopping already (the cancel came while this select was being polled).
                if shutdown.is_cancelled() {
                    return None;
                }
                tracing::error!(error = %ended, "A background task of the worker ended; the processor stops.");
                shutdown.cancel();
                return Some(ended);
            }
            arrival = consumer.arrivals.recv() => arrival,
        };
        match arrival {
            Some(Arrival::Dispatch { key, held, epoch }) => {
                errors.reset();
                queue(shared, key, held, epoch);
            }
            Some(Arrival::PassedOver { partition, offset, epoch }) => {
                errors.reset();
                // Done at once: nothing to decode, queue or run. Its offset counts as
                // finished, so the stored offset trails only the dispatches still in flight.
                let done = {
                    let mut tracker = shared.tracker.lock().expect("tracker");
                    tracker
                        .start_in(partition, offset, epoch)
                        .and_then(|ticket| tracker.finish(ticket))
                };
                if let Some(offset) = done {
                    store_offset(shared, &shared.config.topics.events, partition, offset);
                }
            }
            Some(Arrival::Failed(e)) => {
                let backoff = errors.after_error();
                ConsumerFailed {
                    stage: "dispatch",
                    error: &e,
                    backoff,
                    first: errors.first_of_its_second(),
                }
                .emit();
                // A fatal error leaves the consumer dead: stop, to be restarted.
                let fatal = jobfold_common::kafka::fatal_error(
                    shared.consumer.client(),
                    &e,
                    shared.config.processor.group_instance_id.as_deref(),
                );
                if let Some(why) = fatal {
                    shutdown.cancel();
                    return Some(anyhow::anyhow!("the dispatch consumer hit a fatal error: {why}"));
                }
                if !backoff.is_zero() {
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        () = tokio::time::sleep(backoff) => {}
                    }
                }
            }
            None => {
                shutdown.cancel();
                return Some(anyhow::anyhow!("the consumer's thread ended"));
            }
        }
    }
}

/// Stops the worker. Graceful (unless a background task `failed`: the heartbeat, say, and
/// leases may no longer be renewed): nothing new starts, the partitions go to the rest of
/// the group at once, and running handlers go on, their tokens untouched, up to
/// `shutdown_timeout`. Then hard: the tokens fire, and each run cut short is completed as
/// released (its attempt given back, due again at once), so another processor takes it
/// without waiting for the lease to run out. Last, the stored offsets are committed and the
/// consumer's thread ends.
async fn stop(
    shared: &Shared,
    failed: bool,
    stopping: &std::sync::atomic::AtomicBool,
    consumer: &mut ConsumerThread,
) {
    let all = shared.config.processor.max_in_flight as u32;
    if !failed {
        stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        leave_the_group(shared, &mut consumer.arrivals).await;
        let finished = tokio::time::timeout(
            shared.config.processor.shutdown_timeout,
            shared.slots.acquire_many(all),
        )
        .await;
        if finished.is_err() {
            tracing::info!(
                timeout = ?shared.config.processor.shutdown_timeout,
                "Shutdown: handlers still running are cancelled; their jobs are given back."
            );
        }
    }
    shared.hard.cancel();
    let released = tokio::time::timeout(
        RELEASE_GRACE + shared.config.processor.revoke_timeout,
        shared.slots.acquire_many(all),
    )
    .await;
    if released.is_err() {
        tracing::warn!("Shutdown: jobs still running are left to their lease expiry.");
    }
    if let Err(e) = jobfold_common::kafka::commit_stored(&*shared.consumer) {
        tracing::warn!(error = %e, "Committing offsets on shutdown failed.");
    }
    consumer.stop().await;
}

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "host".into())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::handler::ErrorClass;

    fn queued(tracker: &mut Tracker, partition: i32, offset: i64) -> Queued {
        let message = Held { key: None, payload: None, partition, offset };
        Queued { message, ticket: tracker.start(partition, offset).unwrap(), bytes: 1 }
    }

    /// A document is ready once (while no task runs it), runs one message at a time, goes
    /// back in line behind the others while it has more, and is forgotten once it has none.
    #[test]
    fn a_document_is_in_line_once_and_run_by_one_task_at_a_time() {
        let mut tracker = Tracker::default();
        tracker.assign(&[0, 1]);
        let mut queues = Queues::default();
        assert!(queues.push("busy", queued(&mut tracker, 0, 0)));
        assert!(!queues.push("busy", queued(&mut tracker, 0, 1)), "already in line");
        assert!(queues.push("quiet", queued(&mut tracker, 1, 0)));
        let ready =
            |queues: &Queues| queues.ready.iter().map(|k| k.to_string()).collect::<Vec<_>>();
        assert_eq!(ready(&queues), ["busy", "quiet"]);

        // The dispatcher starts busy's task: its first message is taken.
        let key = queues.ready.pop_front().unwrap();
        assert_eq!(queues.next(&key).unwrap().ticket.offset, 0);
        // A message arriving while it runs waits behind it, without a second turn in line.
        assert!(!queues.push("busy", queued(&mut tracker, 0, 2)));
        assert_eq!(ready(&queues), ["quiet"]);
        // Done with one message, busy has two more: back in line, behind quiet.
        assert!(queues.done(key));
        assert_eq!(ready(&queues), ["quiet", "busy"]);

        let quiet = queues.ready.pop_front().unwrap();
        assert_eq!(queues.next(&quiet).unwrap().ticket.partition, 1);
        assert!(!queues.done(quiet), "nothing more: forgotten");
        assert!(!queues.waiting.contains_key("quiet"));
        assert!(queues.push("quiet", queued(&mut tracker, 1, 1)), "a new message: in line again");
    }

    /// On revoke, what waits in the revoked partitions is taken out, and nothing else.
    #[test]
    fn a_revoke_takes_out_only_the_revoked_partitions_messages() {
        let mut tracker = Tracker::default();
        tracker.assign(&[0, 1]);
        let mut queues = Queues::default();
        queues.push("a", queued(&mut tracker, 0, 0));
        queues.push("a", queued(&mut tracker, 0, 1));
        queues.push("b", queued(&mut tracker, 1, 0));
        // A document whose key moved partition (partitions added): one message of each.
        queues.push("c", queued(&mut tracker, 0, 2));
        queues.push("c", queued(&mut tracker, 1, 1));

        let mut taken: Vec<(i32, i64)> = queues
            .take_partitions(&[0])
            .iter()
            .map(|q| (q.ticket.partition, q.ticket.offset))
            .collect();
        taken.sort_unstable();
        assert_eq!(taken, [(0, 0), (0, 1), (0, 2)]);
        assert!(queues.waiting["a"].is_empty());
        assert_eq!(queues.waiting["b"].len(), 1);
        assert_eq!(queues.waiting["c"][0].ticket.partition, 1);
        // a, emptied while in line, is forgotten when its turn comes.
        assert!(queues.next("a").is_none());
        assert!(!queues.waiting.contains_key("a"));
    }

    #[test]
    fn a_result_over_the_limit_or_holding_nul_becomes_a_permanent_failure() {
        let ok = bounded(Ok(json!({ "terms": ["a", "b"] })), 100);
        assert_eq!(ok, Ok(json!({ "terms": ["a", "b"] })));

        let large = bounded(Ok(json!("x".repeat(200))), 100).unwrap_err();
        assert_eq!(large.class, ErrorClass::Permanent);
        assert!(large.message.contains("202 bytes") && large.message.contains("(100:"));

        let nul = bounded(Ok(json!({ "a": ["ok", "x\u{0}"] })), 100).unwrap_err();
        assert_eq!(nul.class, ErrorClass::Permanent);
        assert!(nul.message.contains("`.a[1]`"), "{}", nul.message);
    }

    #[test]
    fn an_error_text_is_cut_and_cleared_of_nul() {
        let long = bounded(Err(HandlerError::retryable("é".repeat(MAX_ERROR_BYTES))), 100);
        let long = long.unwrap_err();
        assert_eq!(long.class, ErrorClass::Retryable);
        assert!(long.message.len() <= MAX_ERROR_BYTES && long.message.ends_with("..."));
        let nul = bounded(Err(HandlerError::permanent("a\u{0}b")), 100).unwrap_err();
        assert_eq!(nul.message, "a\u{fffd}b");
    }
}
