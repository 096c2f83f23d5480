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

/// librdkafka's read-ahead for the processors (each may be set in `[kafka]`). A fetch
/// brings whole record batches, each decompressed into one buffer that lives as long as any
/// of its messages waits in librdkafka's queue: by default up to 1 MiB of compressed batches
/// a partition and 50 MiB a fetch, several times that once decompressed. Here a fetch brings
/// 1 MiB at most (256 KiB a partition), the next one is sent while fewer than a thousand
/// messages or 2 MiB wait, and 10 ms after the queue was found full (librdkafka waits a
/// second by default, which so small a read-ahead drains long before).
const PREFETCH: &[(&str, &str)] = &[
    ("fetch.max.bytes", "1048576"),
    ("max.partition.fetch.bytes", "262144"),
    ("queued.min.messages", "1000"),
    ("queued.max.messages.kbytes", "2048"),
    ("fetch.queue.backoff.ms", "10"),
];

/// Rebalance callbacks: stop, drain and commit revoked partitions; start assigned ones.
pub struct WorkerContext {
    tracker: Arc<Mutex<Tracker>>,
    buffer: Arc<Mutex<Buffer>>,
    queues: Arc<Mutex<Queues>>,
    revoke_timeout: Duration,
    topic: String,
    /// Partitions whose lag this member reported, so it reports 0 once it lost them.
    lag_reported: Mutex<std::collections::BTreeSet<i32>>,
    /// Set by a graceful stop: revoked partitions go at once, their running jobs finishing
    /// here meanwhile (their completions need Postgres only).
    stopping: Arc<std::sync::atomic::AtomicBool>,
}

impl WorkerContext {
    /// The state the rebalance callbacks share with the worker, empty.
    fn new(config: &Config) -> Self {
        Self {
            tracker: Arc::new(Mutex::new(Tracker::default())),
            buffer: Arc::new(Mutex::new(Buffer::new(Bounds {
                messages: config.processor.max_buffered,
                bytes: config.processor.max_buffered_bytes,
            }))),
            queues: Arc::new(Mutex::new(Queues::default())),
            revoke_timeout: config.processor.revoke_timeout,
            topic: config.topics.events.clone(),
            lag_reported: Mutex::default(),
            stopping: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }
}

impl std::fmt::Debug for WorkerContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerContext").field("revoke_timeout", &self.revoke_timeout).finish()
    }
}

impl ClientContext for WorkerContext {
    /// Publishes [`pm::CONSUMER_LAG`] per partition this member consumes: the high watermark
    /// minus the stored offset, which never passes the lowest offset still in flight.
    fn stats(&self, statistics: Statistics) {
        let Some(topic) = statistics.topics.get(&self.topic) else { return };
        let mut reported = self.lag_reported.lock().expect("lag_reported");
        let mut active = std::collections::BTreeSet::new();
        for partition in topic.partitions.values() {
            if partition.partition < 0 || partition.fetch_state != "active" {
                continue;
            }
            // Nothing stored or committed yet: a restart reads from the log start.
            let position =
                [partition.stored_offset, partition.committed_offset, partition.lo_offset]
                    .into_iter()
                    .find(|o| *o >= 0);
            let (Some(position), true) = (position, partition.hi_offset >= 0) else { continue };
            let lag = (partition.hi_offset - position).max(0);
            metrics::gauge!(pm::CONSUMER_LAG, "topic" => self.topic.clone(), "partition" => partition.partition.to_string())
                .set(lag as f64);
            active.insert(partition.partition);
        }
        for gone in reported.difference(&active) {
            metrics::gauge!(pm::CONSUMER_LAG, "topic" => self.topic.clone(), "partition" => gone.to_string())
                .set(0.0);
        }
        *reported = active;
    }
}

impl ConsumerContext for WorkerContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let partitions: Vec<i32> = list.elements().iter().map(|e| e.partition()).collect();
            self.tracker.lock().expect("tracker").revoke(&partitions);
            // What waits for a slot is let go at once, for redelivery to the next owner.
            let dropped = self.queues.lock().expect("queues").take_partitions(&partitions);
            {
                let mut tracker = self.tracker.lock().expect("tracker");
                let mut buffer = self.buffer.lock().expect("buffer");
                for queued in dropped {
                    tracker.abandon(queued.ticket);
                    buffer.remove(queued.ticket.partition, queued.bytes);
                }
                metrics::gauge!(pm::BUFFERED_MESSAGES).set(buffer.messages() as f64);
            }
            // Running jobs of these partitions may finish (bounded), so their offsets count —
            // unless this processor stops: then its partitions go to the group at once, and
            // whatever of theirs still runs here finishes (or is given back) on its own,
            // while their next owner waits only for those jobs' documents.
            let stopping = self.stopping.load(std::sync::atomic::Ordering::SeqCst);
            let wait = if stopping { Duration::ZERO } else { self.revoke_timeout };
            let deadline = std::time::Instant::now() + wait;
            while self.tracker.lock().expect("tracker").in_flight(&partitions) > 0
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Err(e) = jobfold_common::kafka::commit_stored(consumer) {
                tracing::warn!(error = %e, "Committing offsets on revoke failed.");
            }
            let held = self.tracker.lock().expect("tracker").held();
            PartitionsMoved { partitions: &partitions, assigned: false, held }.emit();
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            let partitions: Vec<i32> = list.elements().iter().map(|e| e.partition()).collect();
            let held = {
                let mut tracker = self.tracker.lock().expect("tracker");
                tracker.assign(&partitions);
                tracker.held()
            };
            // A partition paused under an earlier assignment starts fetching again.
            self.buffer.lock().expect("buffer").assigned(&partitions);
            if let Err(e) = consumer.resume(list) {
                tracing::warn!(error = %e, "Resuming assigned partitions failed.");
            }
            PartitionsMoved { partitions: &partitions, assigned: true, held }.emit();
        }
    }
}

/// A message held for its document's task, and the bytes it counts in its partition.
struct Queued {
    message: Held,
    ticket: Ticket,
    bytes: usize,
}

/// What is kept of a dispatch message while it waits: its key and value, and where it is
/// (the topic is the one this processor consumes). rdkafka's `OwnedMessage` would also copy
/// the topic's name and each header, in allocations of their own: about 1.4 KiB a message
/// held, against its value's few hundred bytes.
struct Held {
    key: Option<Box<[u8]>>,
    payload: Option<Box<[u8]>>,
    partition: i32,
    offset: i64,
}

impl Held {
    fn of(message: &impl Message) -> Self {
        Self {
            key: message.key().map(Box::from),
            payload: message.payload().map(Box::from),
            partition: message.partition(),
            offset: message.offset(),
        }
    }

    /// Where it is, on `topic`.
    fn at<'a>(&self, topic: &'a str) -> At<'a> {
        At { topic, partition: self.partition, offset: self.offset }
    }

    /// As a dead letter keeps it, on `topic`.
    fn raw<'a>(&'a self, topic: &'a str) -> Raw<'a> {
        Raw { at: self.at(topic), key: self.key.as_deref(), payload: self.payload.as_deref() }
    }
}

/// The documents with messages in memory. A document is here from its first message until
/// its queue is empty and no task runs it; it is then either in `ready` (waiting for a slot,
/// as nothing more than its queued messages) or being run by the one task a slot started.
#[derive(Default)]
struct Queues {
    /// Per document: the messages no task has taken yet.
    waiting: HashMap<Arc<str>, VecDeque<Queued>>,
    /// Documents with a message to run and no task, in the order they became ready.
    ready: VecDeque<Arc<str>>,
}

impl Queues {
    /// Holds `queued` for `key`; true if the document just became ready.
    fn push(&mut self, key: &str, queued: Queued) -> bool {
        if let Some(queue) = self.waiting.get_mut(key) {
            queue.push_back(queued);
            return false;
        }
        // Most documents hold one message at a time: no room for more until they do.
        let mut queue = VecDeque::with_capacity(1);
        queue.push_back(queued);
        let key: Arc<str> = key.into();
        self.waiting.insert(Arc::clone(&key), queue);
        self.ready.push_back(key);
        true
    }

    /// The next message of `key`, for the task running it; `None` (and the document
    /// forgotten) if none is left.
    fn next(&mut self, key: &str) -> Option<Queued> {
        let next = self.waiting.get_mut(key).and_then(VecDeque::pop_front);
        if next.is_none() {
            self.waiting.remove(key);
        }
        next
    }

    /// After its task ran one message: `key` goes to the back of `ready` if more are queued
    /// (so a busy document takes its turn with the others), else it is forgotten. True if it
    /// is ready again.
    fn done(&mut self, key: Arc<str>) -> bool {
        match self.waiting.get(&key) {
            Some(queue) if !queue.is_empty() => {
                self.ready.push_back(key);
                true
            }
            _ => {
                self.waiting.remove(&key);
                false
            }
        }
    }

    /// Takes out every queued message of `partitions` (revoked). A document's messages come
    /// from its key's partition, unless the topic's partitions were added to meanwhile: each
    /// message is looked at, so none of a partition still held is let go.
    fn take_partitions(&mut self, partitions: &[i32]) -> Vec<Queued> {
        let mut taken = Vec::new();
        for queue in self.waiting.values_mut() {
            if queue.iter().any(|q| partitions.contains(&q.ticket.partition)) {
                let (gone, kept): (Vec<Queued>, Vec<Queued>) =
                    queue.drain(..).partition(|q| partitions.contains(&q.ticket.partition));
                taken.extend(gone);
                queue.extend(kept);
            }
        }
        taken
    }
}

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

/// A dispatch waiting for another worker's live lease looks again after this, doubling up
/// to [`LOOK_AGAIN_MAX`] (or at the lease's end, if sooner).
const LOOK_AGAIN_MIN: Duration = Duration::from_millis(250);
const LOOK_AGAIN_MAX: Duration = Duration::from_secs(8);

/// How long a stopping processor polls for the group to take its partitions.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(5);

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

/// The consumer of `config`'s events topic, in the processors' group, subscribed, with
/// `context`'s rebalance callbacks.
fn subscribe(
    config: &Config,
    context: WorkerContext,
) -> anyhow::Result<BaseConsumer<WorkerContext>> {
    let mut client = config.kafka_client_for(
        jobfold_common::config::KafkaRole::Consumer,
        jobfold_common::kafka::CONSUMER_DEFAULTS,
    );
    client.set("group.id", &config.processor.group);
    if let Some(id) = &config.processor.group_instance_id {
        client.set("group.instance.id", id);
    }
    // What librdkafka fetches ahead is bounded as the buffer is: by default it holds up to
    // 100,000 messages a partition or 64 MiB, which a burst fills (two in three of them
    // events passed over) while the buffer holds its own.
    for (key, value) in PREFETCH {
        if !config.kafka.0.contains_key(*key) {
            client.set(*key, *value);
        }
    }
    // librdkafka wants a fetch to hold the largest message (`fetch.max.bytes` ≥
    // `message.max.bytes`): raising the latter, as the event limit check advises, raises
    // the read-ahead with it.
    if !config.kafka.0.contains_key("fetch.max.bytes")
        && let Some(largest) = config.kafka.0.get("message.max.bytes")
        && largest.parse::<u64>().is_ok_and(|largest| largest > 1_048_576)
    {
        client.set("fetch.max.bytes", largest);
    }
    if !config.kafka.0.contains_key("statistics.interval.ms") {
        let interval = config.processor.gauge_interval.as_millis().to_string();
        client.set("statistics.interval.ms", interval);
    }
    let consumer: BaseConsumer<WorkerContext> = client.create_with_context(context)?;
    consumer.subscribe(&[&config.topics.events])?;
    Ok(consumer)
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
                ConsumerFailed { stage: "dispatch", error: &e, backoff }.emit();
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

/// Queues a polled dispatch for its document (`key`), counted in its partition's buffer
/// (which pauses the partition when full).
fn queue(shared: &Shared, key: String, held: Held, epoch: u64) {
    // A message polled before its partition was revoked (the revoke ran on the consumer's
    // thread since) starts nothing: its next owner reads it again.
    let started =
        shared.tracker.lock().expect("tracker").start_in(held.partition, held.offset, epoch);
    let Some(ticket) = started else {
        return;
    };
    let bytes = held.payload.as_deref().map_or(0, <[u8]>::len) + key.len();
    {
        // Decided and done under the lock: a resume decided meanwhile by a finishing task
        // cannot come before this pause and leave the partition paused for good.
        let mut buffer = shared.buffer.lock().expect("buffer");
        if buffer.add(ticket.partition, bytes) {
            pause_or_resume(shared, &buffer, ticket.partition, true);
        }
        metrics::gauge!(pm::BUFFERED_MESSAGES).set(buffer.messages() as f64);
    }
    let queued = Queued { message: held, ticket, bytes };
    if shared.queues.lock().expect("queues").push(&key, queued) {
        shared.ready.notify_one();
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

/// What the consumer's thread hands the worker, in the order it polled them; a message
/// with the assignment (`epoch`, [`Tracker::epoch`]) its partition was in when polled.
enum Arrival {
    /// A dispatch, for its document's queue.
    Dispatch { key: String, held: Held, epoch: u64 },
    /// An event no processor acts on ([`passed_over`]): done at once.
    PassedOver { partition: i32, offset: i64, epoch: u64 },
    /// The poll failed.
    Failed(KafkaError),
}

/// Arrivals the consumer's thread may hand over before the worker takes them: past it the
/// thread waits (librdkafka's read-ahead and the partitions' buffers bound the rest).
const ARRIVALS: usize = 256;
/// How long one poll of the consumer's thread waits for something before it looks whether
/// to stop.
const POLL_TURN: Duration = Duration::from_millis(100);

/// The consumer's own thread ([`consume`]) and what it hands over.
struct ConsumerThread {
    arrivals: tokio::sync::mpsc::Receiver<Arrival>,
    polling: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<tokio::task::JoinHandle<()>>,
}

impl ConsumerThread {
    /// Starts polling `consumer` on a blocking thread.
    fn start(consumer: Arc<BaseConsumer<WorkerContext>>) -> Self {
        let (arrive, arrivals) = tokio::sync::mpsc::channel(ARRIVALS);
        let polling = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let still = Arc::clone(&polling);
        let thread = tokio::task::spawn_blocking(move || consume(&consumer, &arrive, &still));
        Self { arrivals, polling, thread: Some(thread) }
    }

    /// Ends the thread: at its next turn, or at once if it waits to hand something over.
    async fn stop(&mut self) {
        self.polling.store(false, std::sync::atomic::Ordering::SeqCst);
        self.arrivals.close();
        if let Some(thread) = self.thread.take()
            && let Err(e) = thread.await
        {
            tracing::warn!(error = %e, "The consumer's thread panicked.");
        }
    }
}

/// Polls `consumer` until `polling` is false or the worker stops taking what arrives, on a
/// thread of its own: the rebalance callbacks ([`WorkerContext`]) run inside the poll and
/// block it while a revoked partition's jobs finish and its offsets are committed.
fn consume(
    consumer: &BaseConsumer<WorkerContext>,
    to: &tokio::sync::mpsc::Sender<Arrival>,
    polling: &std::sync::atomic::AtomicBool,
) {
    while polling.load(std::sync::atomic::Ordering::SeqCst) {
        let arrival = match consumer.poll(POLL_TURN) {
            None => continue,
            Some(Err(e)) => Arrival::Failed(e),
            Some(Ok(message)) => {
                // Read after the poll, in which any rebalance ran: the message's assignment.
                let (partition, offset) = (message.partition(), message.offset());
                let epoch = consumer.context().tracker.lock().expect("tracker").epoch(partition);
                if passed_over(&message) {
                    Arrival::PassedOver { partition, offset, epoch }
                } else {
                    let key = message.key().map(String::from_utf8_lossy).unwrap_or_default();
                    Arrival::Dispatch { key: key.into_owned(), held: Held::of(&message), epoch }
                }
            }
        };
        if to.blocking_send(arrival).is_err() {
            return;
        }
    }
}

/// Unsubscribes, and waits until the group took this member's partitions (what arrives
/// meanwhile is left for their next owner), for up to [`LEAVE_TIMEOUT`].
async fn leave_the_group(shared: &Shared, arrivals: &mut tokio::sync::mpsc::Receiver<Arrival>) {
    shared.consumer.unsubscribe();
    let deadline = tokio::time::Instant::now() + LEAVE_TIMEOUT;
    // The revoke runs inside a poll of the consumer's thread, which goes on while what
    // arrives is taken and let go: look in short turns.
    while shared.tracker.lock().expect("tracker").held() > 0 {
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(
                "The group did not take the partitions in time; they move when the consumer closes."
            );
            return;
        }
        let turn = Duration::from_millis(50);
        if let Ok(None) = tokio::time::timeout(turn, arrivals.recv()).await {
            // The thread is gone: nothing arrives, and nothing runs the revoke either.
            tokio::time::sleep(turn).await;
        }
    }
    tracing::info!(
        "Stopping: the partitions went to the rest of the group; running jobs finish here."
    );
}

/// Pauses (or resumes) fetching `partition`, and counts it. Called with the buffer locked,
/// as it decided.
fn pause_or_resume(shared: &Shared, buffer: &Buffer, partition: i32, pause: bool) {
    let mut list = TopicPartitionList::new();
    list.add_partition(&shared.config.topics.events, partition);
    let done = if pause { shared.consumer.pause(&list) } else { shared.consumer.resume(&list) };
    match done {
        Ok(()) if pause => PartitionPaused { partition }.emit(),
        Ok(()) => tracing::debug!(partition, "Partition resumed."),
        // The partition moved meanwhile: the next owner fetches it afresh.
        Err(e) => {
            tracing::debug!(error = %e, partition, pause, "Pause or resume failed.")
        }
    }
    metrics::gauge!(pm::PAUSED_PARTITIONS).set(buffer.paused() as f64);
}

/// A running job's slot: the in-flight gauge follows it.
struct Slot {
    _permits: (Option<OwnedSemaphorePermit>, OwnedSemaphorePermit),
    slots: Arc<Semaphore>,
    max: usize,
}

impl Slot {
    /// Waits for a slot of `kind` (if it has its own `concurrency`), then for its kind's
    /// quota ([`crate::quota`]), then for one of the process's slots — the kind's first, so
    /// jobs waiting for their kind or its quota hold none of the process's slots: `held`, a
    /// process slot the caller has, is kept only if neither may make it wait, else given
    /// back first. `Ok(None)` if the shutdown or `revoked` came first.
    async fn acquire(
        shared: &Shared,
        kind: &str,
        cost: u64,
        revoked: &CancellationToken,
        held: Option<OwnedSemaphorePermit>,
    ) -> anyhow::Result<Option<Self>> {
        let max = shared.config.processor.max_in_flight;
        // Kept, or (the chain failing) dropped: given back before any wait below.
        if let Some(own) = held
            && !shared.kind_slots.contains_key(kind)
            && !shared.quotas.may_wait(kind)
        {
            metrics::gauge!(pm::IN_FLIGHT).set((max - shared.slots.available_permits()) as f64);
            return Ok(Some(Self { _permits: (None, own), slots: Arc::clone(&shared.slots), max }));
        }
        let wait = async {
            let of_kind = match shared.kind_slots.get(kind) {
                Some(slots) => Some(Arc::clone(slots).acquire_owned().await?),
                None => None,
            };
            let admitted = shared.quotas.admit(kind, &shared.handlers.label(kind), cost).await?;
            let own = Arc::clone(&shared.slots).acquire_owned().await?;
            drop(admitted);
            anyhow::Ok((of_kind, own))
        };
        let permits = tokio::select! {
            biased;
            _ = shared.shutdown.cancelled() => return Ok(None),
            _ = revoked.cancelled() => return Ok(None),
            permits = wait => permits?,
        };
        metrics::gauge!(pm::IN_FLIGHT).set((max - shared.slots.available_permits()) as f64);
        Ok(Some(Self { _permits: permits, slots: Arc::clone(&shared.slots), max }))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // This slot's permit is still taken here.
        let running = self.max.saturating_sub(self.slots.available_permits() + 1);
        metrics::gauge!(pm::IN_FLIGHT).set(running as f64);
    }
}

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "host".into())
}

/// Starts a task for the next ready document whenever one of the process's slots is free,
/// so that a document waiting for a slot costs only its queued messages, not a task: a
/// burst of many documents is held in little memory.
async fn dispatch(shared: Arc<Shared>) {
    loop {
        while shared.queues.lock().expect("queues").ready.is_empty() {
            shared.ready.notified().await;
        }
        let Ok(permit) = Arc::clone(&shared.slots).acquire_owned().await else { return };
        let Some(key) = shared.queues.lock().expect("queues").ready.pop_front() else {
            continue;
        };
        shared.work.spawn("document", run_next(Arc::clone(&shared), key, permit));
    }
}

/// Runs the next message of `key`'s document in the slot `permit`, then puts the document
/// back in line if more of its messages are queued.
async fn run_next(shared: Arc<Shared>, key: Arc<str>, permit: OwnedSemaphorePermit) {
    let Some(queued) = shared.queues.lock().expect("queues").next(&key) else { return };
    let ticket = queued.ticket;
    // After shutdown or revoke, queued messages are left for redelivery.
    let current = !shared.shutdown.is_cancelled()
        && shared.tracker.lock().expect("tracker").is_current(&ticket);
    // Boxed: allocated while a message is handled, not for as long as its queue lives. A
    // panic on the way (user code is contained where it is called; this is the last net) is
    // this message's alone: it is set aside as a dead letter naming it, and its document's
    // and partition's bookkeeping below goes on as for any message.
    let finished = current && {
        let handled = Box::pin(handle(&shared, &queued.message, &ticket, Some(permit)));
        match std::panic::AssertUnwindSafe(handled).catch_unwind().await {
            Ok(finished) => finished,
            Err(panic) => Box::pin(set_aside_panic(&shared, &queued.message, panic)).await,
        }
    };
    let store = {
        let mut tracker = shared.tracker.lock().expect("tracker");
        if finished {
            tracker.finish(ticket)
        } else {
            tracker.abandon(ticket);
            None
        }
    };
    if let Some(offset) = store {
        store_offset(&shared, &shared.config.topics.events, ticket.partition, offset);
    }
    {
        let mut buffer = shared.buffer.lock().expect("buffer");
        if buffer.remove(ticket.partition, queued.bytes) {
            pause_or_resume(&shared, &buffer, ticket.partition, false);
        }
        metrics::gauge!(pm::BUFFERED_MESSAGES).set(buffer.messages() as f64);
    }
    drop(queued);
    if shared.queues.lock().expect("queues").done(key) {
        shared.ready.notify_one();
    }
}

/// Whether `message` is an event of a kind processors do not act on, as its `jobfold-event`
/// header names it (`JobLeased`, `JobSucceeded`, …): two of a job's three events, passed
/// over without being copied or decoded. An event without the header is decoded and decided
/// as before.
fn passed_over(message: &impl Message) -> bool {
    use rdkafka::message::Headers;
    message
        .headers()
        .and_then(|headers| headers.iter().find(|h| h.key == EVENT_KIND))
        .and_then(|header| header.value)
        .is_some_and(|kind| !Payload::is_dispatch_kind(kind))
}

/// Stores `offset` of `partition` for the next commit; a partition that moved meanwhile
/// keeps what its new owner stores.
fn store_offset(shared: &Shared, topic: &str, partition: i32, offset: i64) {
    if let Err(e) = shared.consumer.store_offset(topic, partition, offset) {
        tracing::debug!(error = %e, partition, offset, "Offset not stored (the partition moved).");
    }
}

/// Handles one message to the end, starting in the process's slot `permit`. False if it
/// was left unfinished (shutdown or revoke): its offset must not be stored. While it waits
/// to try again (no handler here, another worker's live lease, an error) it holds no slot.
async fn handle(
    shared: &Shared,
    message: &Held,
    ticket: &Ticket,
    mut permit: Option<OwnedSemaphorePermit>,
) -> bool {
    let mut again = crate::retry::Again::new();
    let mut look_again = LOOK_AGAIN_MIN;
    let mut announced = false;
    loop {
        let step = try_handle(shared, message, ticket, &mut permit).await;
        if !matches!(step, Ok(Step::Done | Step::Interrupted)) {
            permit = None;
        }
        match step {
            Ok(Step::Done) => return true,
            Ok(Step::Interrupted) => return false,
            Ok(Step::NoHandler(kind)) => {
                if !wait_for_handler(shared, message, &kind, &mut announced).await {
                    return false;
                }
            }
            Ok(Step::WaitUntil(until)) => {
                let wait = look_again_in(shared, until, &mut look_again);
                tokio::select! {
                    _ = shared.shutdown.cancelled() => return false,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            Err(e) if jobfold_common::db::data_error_in(&e).is_some() => {
                // Postgres refuses what this event would write (a data error about its own
                // rows, found alone): the event's fault, so it is set aside, not retried for
                // ever with the partition behind it.
                let (code, refused) = jobfold_common::db::data_error_in(&e).expect("checked");
                let reason =
                    format!("the database refused what this event causes ({code}): {refused}");
                match set_aside(shared, message, &reason).await {
                    Ok(()) => return true,
                    Err(e) => {
                        tracing::warn!(error = %e, "Storing the dead letter failed; retrying.")
                    }
                }
                if !again.pause(&shared.shutdown).await {
                    return false;
                }
            }
            Err(e) => {
                let at = message.at(&shared.config.topics.events).coordinates();
                let error = MessageError { at, cause: e };
                MessageRetried { error: &error, stage: "dispatch", backoff: again.next() }.emit();
                if !again.pause(&shared.shutdown).await {
                    return false;
                }
            }
        }
    }
}

/// Waits a while for a processor with a handler for `kind` (counted in
/// `jobfold_waiting_for_handler`, announced once a message); false if stopped meanwhile.
async fn wait_for_handler(
    shared: &Shared,
    message: &Held,
    kind: &str,
    announced: &mut bool,
) -> bool {
    use std::sync::atomic::Ordering;
    let waiting = shared.waiting_for_handler.fetch_add(1, Ordering::Relaxed) + 1;
    metrics::gauge!(pm::WAITING_FOR_HANDLER).set(waiting as f64);
    if !*announced {
        tracing::warn!(
            kind = %kind,
            partition = message.partition,
            offset = message.offset,
            "No handler for this kind here; the job waits for a processor that has one."
        );
        *announced = true;
    }
    let stopped = tokio::select! {
        _ = shared.shutdown.cancelled() => true,
        _ = tokio::time::sleep(NO_HANDLER_RETRY) => false,
    };
    let waiting = shared.waiting_for_handler.fetch_sub(1, Ordering::Relaxed) - 1;
    metrics::gauge!(pm::WAITING_FOR_HANDLER).set(waiting as f64);
    !stopped
}

/// How long to wait before looking again at a job another worker's live lease holds until
/// `until`. That lease ends at its completion, which may come long before `until` (a
/// stopping processor finishing the jobs of the partitions it handed over): looked at again
/// sooner at first (`look_again`, doubled each time), and never later than a lease's TTL.
fn look_again_in(shared: &Shared, until: DateTime<Utc>, look_again: &mut Duration) -> Duration {
    let wait = ((until - Utc::now()).to_std().unwrap_or_default() + Duration::from_millis(50))
        .min(*look_again);
    *look_again = (*look_again * 2).min(LOOK_AGAIN_MAX);
    let longest_ttl =
        shared.config.processor.lease_ttl.max(
            shared.config.kinds.values().filter_map(|k| k.lease_ttl).max().unwrap_or_default(),
        );
    wait.min(longest_ttl)
}

enum Step {
    Done,
    WaitUntil(DateTime<Utc>),
    /// No handler here for this kind: look again later.
    NoHandler(String),
    /// Shutdown interrupted the attempt: leave the message for redelivery.
    Interrupted,
}

/// How often a job of a kind without a handler here is looked at again.
const NO_HANDLER_RETRY: Duration = Duration::from_secs(5);

async fn try_handle(
    shared: &Shared,
    message: &Held,
    ticket: &Ticket,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> anyhow::Result<Step> {
    let Some(payload) = message.payload.as_deref() else {
        set_aside(shared, message, "message has no value").await?;
        return Ok(Step::Done);
    };
    // Boxed, as are the slot's wait and the attempt below: a document's task lives as long
    // as its queue, so it keeps only what all three have in common inline.
    let event = match Box::pin(shared.decoder.decode(payload)).await {
        Ok(event) => event,
        Err(e) if e.is_retryable() => return Err(e.into()),
        Err(e) => {
            let error = format!("undecodable: {e}");
            set_aside(shared, message, &error).await?;
            return Ok(Step::Done);
        }
    };
    if !event.payload.is_dispatch() {
        return Ok(Step::Done);
    }
    // A kind this processor has no handler for (a rolling deploy adding one): not this
    // job's fault, so it is neither leased nor quarantined; its document waits here, visibly,
    // until a processor that has the handler takes the partition.
    let Some(handler) = shared.handlers.get(&event.job_kind).cloned() else {
        return Ok(Step::NoHandler(event.job_kind));
    };
    // A paused kind's job is passed over, noted to be dispatched again on resume: it is not
    // leased, spends no attempt, and holds neither a slot nor its document's turn.
    if shared.pauses.holds(&event.job_kind)
        && Box::pin(crate::store::kinds::pass_over(&shared.pool, event.job_id, &event.job_kind))
            .await?
    {
        let label = shared.handlers.label(&event.job_kind);
        metrics::counter!(pm::PAUSED_PASSED_OVER_TOTAL, "kind" => label).increment(1);
        tracing::debug!(job_id = %event.job_id, kind = event.job_kind, "Passed over: its kind is paused.");
        return Ok(Step::Done);
    }
    // A slot (the kind's, then the process's) from here to the completion; a revoke or the
    // shutdown while waiting leaves the message for redelivery.
    let revoked = shared.tracker.lock().expect("tracker").revoked(ticket);
    let (cost, handler) = if shared.quotas.costs(&event.job_kind) {
        match Box::pin(cost_of(shared, event.job_id, handler.as_ref())).await? {
            Ok(cost) => (cost, handler),
            // The handler's `cost` panicked on this input: the job's failure, not the
            // document's or the partition's. It is leased and its attempt fails, naming the
            // panic, without running (its quota is not taken).
            Err(panic) => {
                (0, Arc::new(Fails(format!("the handler's cost panicked: {panic}"))) as _)
            }
        }
    } else {
        (1, handler)
    };
    let held = permit.take();
    let Some(_slot) =
        Box::pin(Slot::acquire(shared, &event.job_kind, cost, &revoked, held)).await?
    else {
        return Ok(Step::Interrupted);
    };
    // The attempt's state (lease, run, completion) is allocated once it runs: a document's
    // task waiting for a slot or behind another job stays small, so what the buffer holds
    // costs little memory each.
    Box::pin(attempt(shared, &event, handler)).await
}

/// After a panic handling `message`: it is stored as a dead letter naming the panic (true),
/// or, if that fails too, left for redelivery (false).
async fn set_aside_panic(
    shared: &Shared,
    message: &Held,
    panic: Box<dyn std::any::Any + Send>,
) -> bool {
    let reason = format!("handling it panicked: {}", panic_message(panic.as_ref()));
    tracing::error!(partition = message.partition, offset = message.offset, %reason, "A message's handling panicked; it is set aside.");
    match set_aside(shared, message, &reason).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "Storing the dead letter failed; the message is left for redelivery.");
            false
        }
    }
}

/// Stores `message` in `dead_letters` with `reason`. Boxed: a rare path whose future would
/// otherwise be part of every document's task.
async fn set_aside(shared: &Shared, message: &Held, reason: &str) -> anyhow::Result<()> {
    Ok(Box::pin(crate::dead_letter::store(
        &shared.pool,
        &shared.config.processor.group,
        message.raw(&shared.config.topics.events),
        reason,
    ))
    .await?)
}

/// A job's cost against its kind's `cost_per_minute`, from its input; `Err` with the panic's
/// message if the handler's `cost` panicked.
async fn cost_of(
    shared: &Shared,
    job_id: uuid::Uuid,
    handler: &dyn crate::handler::ErasedHandler,
) -> anyhow::Result<Result<u64, String>> {
    let input = crate::status::input(&shared.pool, job_id).await?;
    let Some(input) = input else { return Ok(Ok(1)) };
    Ok(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.cost_of(&input)))
        .map_err(|panic| panic_message(panic.as_ref())))
}

/// Stands in for a handler that cannot be run on this job: every attempt fails retryably
/// with the reason, so the job ends by its budget, quarantined with it.
struct Fails(String);

impl crate::handler::Handler for Fails {
    async fn run(
        &self,
        _job: &JobContext,
        _cancel: CancellationToken,
    ) -> Result<serde_json::Value, HandlerError> {
        Err(HandlerError::retryable(self.0.clone()))
    }
}

/// Leases, runs and completes the dispatch `event` (its slot held by the caller).
///
/// A kind with an `inline_window` is offered to run before its lease commits: the lease
/// transaction sends the job here, waits for the attempt up to the window and commits the
/// two together; past the window it commits the lease alone and the attempt completes on
/// its own, as any other.
async fn attempt(
    shared: &Shared,
    event: &JobEvent,
    handler: std::sync::Arc<dyn crate::handler::ErasedHandler>,
) -> anyhow::Result<Step> {
    // Each phase (lease, run, completion) is boxed: the attempt keeps inline only what they
    // share, and a run that lasts keeps only its own state, not the lease's or the
    // completion's (ten thousand long remote jobs in flight in one process).
    // 1. Lease (in a transaction with the other dispatches waiting at the time), run before
    //    it commits when the transaction sends the job to run.
    let Some((leased, ran)) = Box::pin(lease(shared, event, &handler)).await? else {
        return Ok(Step::Interrupted);
    };
    let job = match leased {
        Leased::Completed(done) => {
            let generation = ran.map_or(0, |a| a.job.generation);
            return Ok(completed(shared, event.job_id, generation, done));
        }
        Leased::Done => return Ok(Step::Done),
        Leased::WaitUntil(until) => return Ok(Step::WaitUntil(until)),
        Leased::Run(job) => Some((job, false)),
        Leased::Isolated(job) => Some((job, true)),
        Leased::RunOn => None,
    };
    // 2. The lease committed alone. An attempt already run under it completes; otherwise
    //    (no run yet, or one under another generation) the handler runs now.
    let attempt = match (ran, job) {
        (Some(attempt), None) => attempt,
        (Some(attempt), Some((job, _))) if attempt.job.generation == job.generation => attempt,
        (_, None) => anyhow::bail!("a lease committed for a run this task did not make"),
        (_, Some((job, isolated))) => {
            failpoint::hit(failpoint::Point::ProcessorAfterLeaseCommit);
            let ran = if isolated {
                match Box::pin(run_isolated(shared, event, &handler, job)).await? {
                    Ok(ran) => ran,
                    // Lost while it waited its turn (an operator cancelled the job): as a
                    // fenced completion, nothing of this event is left to do.
                    Err(LeaseLost) => return Ok(Step::Done),
                }
            } else {
                Box::pin(run_handler(shared, event, &handler, job)).await?
            };
            match ran {
                Some(attempt) => Arc::new(attempt),
                None => return Ok(Step::Interrupted),
            }
        }
    };
    // 3. Complete, fenced by the generation.
    Box::pin(complete(shared, attempt)).await
}

/// An attempt's lease, in a transaction with the other dispatches waiting at the time. A
/// kind with an `inline_window` may be sent to run before the lease commits: then the
/// attempt run is returned too; `None` if the processor's stop cut that run short.
async fn lease(
    shared: &Shared,
    event: &JobEvent,
    handler: &std::sync::Arc<dyn crate::handler::ErasedHandler>,
) -> anyhow::Result<Option<(Leased, Option<Arc<Attempt>>)>> {
    let dispatch = Dispatch {
        job_id: event.job_id,
        event_id: event.event_id,
        input_version: event.input_version,
        stream_version: event.stream_version,
        trace: event.trace.clone(),
    };
    let window = shared.config.kind(&event.job_kind).inline_window;
    let (inline, mut offered) = if window.is_zero() {
        (None, None)
    } else {
        let (run, offered) = tokio::sync::oneshot::channel();
        (Some(Inline { window, run }), Some(offered))
    };
    // Boxed: raced against the offer of an inline run, then, after that run, awaited again.
    let mut leased = Box::pin(shared.leaser.submit(Request { dispatch, inline }));
    let offer = async {
        match offered.as_mut() {
            Some(offered) => offered.await.ok(),
            None => None,
        }
    };
    let first = tokio::select! {
        biased;
        Some(run) = offer => Ok(run),
        leased = &mut leased => Err(leased),
    };
    let InlineRun { job, finished } = match first {
        Err(leased) => return Ok(Some((leased?, None))),
        Ok(run) => run,
    };
    // Run before the lease commits; the lease transaction waits for the attempt.
    let mut run = Box::pin(run_handler(shared, event, handler, Box::new(job)));
    // Once the lease transaction stops waiting (its window closed and the lease committed
    // alone), the way back is let go of: a long run keeps only what any run keeps.
    let mut finished = Some(finished);
    let ran = loop {
        let Some(back) = finished.as_mut() else { break run.await? };
        let closed = tokio::select! {
            ran = &mut run => break ran?,
            () = back.closed() => true,
        };
        if closed {
            finished = None;
        }
    };
    let Some(attempt) = ran else { return Ok(None) };
    // Kept: should the lease transaction fail, the lease is taken again alone and this
    // attempt completes after it.
    let attempt = Arc::new(attempt);
    if let Some(back) = finished {
        let _ = back.send(Arc::clone(&attempt));
    }
    Ok(Some((leased.await?, Some(attempt))))
}

/// Completes `attempt`, fenced by its generation, in a transaction with the other attempts
/// finished at the time. A completion that fails (the database unreachable) is tried again
/// with the same generation: the handler does not run again for it.
async fn complete(shared: &Shared, attempt: Arc<Attempt>) -> anyhow::Result<Step> {
    let job_id = attempt.job.job_id;
    let generation = attempt.job.generation;
    let mut again = crate::retry::Again::new();
    let done = loop {
        match Box::pin(shared.completer.submit(Arc::clone(&attempt))).await {
            Ok(done) => break done,
            // About this attempt's own rows: its event is set aside by the caller.
            Err(e) if jobfold_common::db::data_error_in(&e).is_some() => return Err(e),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), %job_id, generation, "Completion failed; trying it again.");
                if !again.pause(&shared.hard).await {
                    return Ok(Step::Interrupted);
                }
            }
        }
    };
    Ok(completed(shared, job_id, generation, done))
}

/// A suspect's lease was lost while it waited for its isolated run: it did not run.
struct LeaseLost;

/// Runs a suspect `job` (it was running when a process died), its lease committed: one such
/// run at a time in this process, recorded as started in a commit of its own and the record
/// deleted once the run returns. Should this run kill the process too, the record it leaves
/// names this job alone, whatever else ran beside it ([`crate::store::crashed_runs`]).
///
/// While it waits for its turn its lease is kept alive by heartbeats: suspects queued behind
/// a slow one would otherwise see their leases lapse, be leased again by the reaper's
/// dispatch (an attempt spent each) and later take the one turn only to be fenced.
async fn run_isolated(
    shared: &Shared,
    event: &JobEvent,
    handler: &std::sync::Arc<dyn crate::handler::ErasedHandler>,
    job: Box<JobRow>,
) -> anyhow::Result<Result<Option<Attempt>, LeaseLost>> {
    let kind = shared.config.kind(&job.kind);
    let lost = shared.hard.child_token();
    let waiting = shared.heartbeats.register(
        job.job_id,
        job.generation,
        kind.heartbeat,
        kind.lease_ttl,
        lost.clone(),
    );
    let _alone = tokio::select! {
        _ = lost.cancelled() => {
            if shared.hard.is_cancelled() {
                // Stopped before its turn came: given back, as a run cut short is.
                let mut job = *job;
                let context = context_of(&mut job, None);
                return Ok(Ok(Some(released(&shared.owner, job, context, event.trace.clone()))));
            }
            tracing::info!(job_id = %job.job_id, generation = job.generation, "A suspect's lease was lost while it waited for its isolated run.");
            return Ok(Err(LeaseLost));
        }
        permit = shared.suspects.acquire() => permit?,
    };
    // The run registers the lease again, taking it over with its renewal times as they are;
    // the run's registration ends it, this one's drop after that finds nothing left.
    let _waiting = waiting;
    let (run_id, job_id) = (uuid::Uuid::new_v4(), job.job_id);
    tracing::info!(%job_id, generation = job.generation, "A suspect runs isolated: should its process die now, the death is charged to it alone.");
    crate::store::inline_runs_begin(&shared.pool, run_id, &[job_id], &shared.owner).await?;
    let ran = run_handler(shared, event, handler, job).await;
    // The run returned (whatever it made of the job): it did not take the process down, so
    // its crashes so far are not counted against it any more.
    let mut again = crate::retry::Again::new();
    while let Err(e) = crate::store::isolated_run_survived(&shared.pool, run_id, job_id).await {
        tracing::warn!(error = %e, "Deleting an isolated run's record failed; trying again.");
        if !again.pause(&shared.shutdown).await {
            break;
        }
    }
    ran.map(Ok)
}

/// Counts what became of an attempt; its offset may be stored.
fn completed(shared: &Shared, job_id: uuid::Uuid, generation: i64, done: Completed) -> Step {
    match done {
        Completed::Fenced => {
            CompletionFenced { job_id, generation }.emit();
            return Step::Done;
        }
        Completed::Committed { job, outcome } => {
            crate::complete::count(&job, outcome, &shared.handlers);
            tracing::debug!(job_id = %job.job_id, outcome, "Attempt completed.");
        }
    }
    failpoint::hit(failpoint::Point::ProcessorAfterCompletionBeforeOffset);
    Step::Done
}

/// Runs the handler on `job`, leased (its lease committed, or held by a lease transaction
/// waiting for this run), with heartbeats: the finished attempt, or `None` when the shutdown
/// cut it short (not the job's fault: no attempt is spent).
async fn run_handler(
    shared: &Shared,
    event: &JobEvent,
    handler: &std::sync::Arc<dyn crate::handler::ErasedHandler>,
    mut job: Box<JobRow>,
) -> anyhow::Result<Option<Attempt>> {
    let (span, context) = job_span(event, &mut job);
    // Run, with heartbeats. The handler's token fires when the lease is lost or at the
    // processor's hard stop; the heartbeat stops with the run, whatever the handler does
    // (returns, panics), as the lease's registration drops.
    let kind = RunLimits::of(&shared.config, &job.kind);
    let _listed = shared.running.enter(job.job_id, job.generation, &job.kind, &job.document_id);
    let cancel = shared.hard.child_token();
    let lease = shared.heartbeats.register(
        job.job_id,
        job.generation,
        kind.heartbeat,
        kind.lease_ttl,
        cancel.clone(),
    );
    let started = std::time::Instant::now();
    if job.attempt == 1 {
        let due = job.run_at.map_or(job.accepted_at, |at| at.max(job.accepted_at));
        crate::history::started(&job.kind, (Utc::now() - due).to_std().unwrap_or_default());
    }
    let result =
        run_contained(shared, handler, &context, &kind, &cancel).instrument(span.clone()).await;
    metrics::histogram!(pm::HANDLER_DURATION_SECONDS, "kind" => shared.handlers.label(&job.kind))
        .record(started.elapsed().as_secs_f64());
    crate::history::ran(&job.kind, started.elapsed());
    metrics::counter!(pm::HANDLER_RUNS_TOTAL).increment(1);
    failpoint::hit(failpoint::Point::ProcessorInHandler);
    drop(lease);
    // Fit to commit, and no wait an outside answer asks for past the kind's max_retry_after.
    let result = bounded(result, kind.max_output_bytes).map_err(|mut e| {
        e.retry_after = e.retry_after.map(|d| d.min(kind.max_retry_after));
        e
    });
    if let Err(e) = &result
        && e.throttled
    {
        // The kind backs off at once, here and in the group's other processors.
        let label = shared.handlers.label(&job.kind);
        Box::pin(shared.quotas.throttled(&job.kind, &label, e.retry_after)).await;
    }
    if result.is_err() && shared.hard.is_cancelled() {
        // Cut short by the stop, not the job's fault: its lease is given back with its
        // attempt, and the job is due again at once for whichever processor takes it.
        tracing::info!(job_id = %job.job_id, "The stop cancelled the handler; the job is given back.");
        return Ok(Some(released(&shared.owner, *job, context, event.trace.clone())));
    }

    Ok(Some(Attempt { job: *job, context, result, trace: event.trace.clone(), released: false }))
}

/// The handler's span, continuing the job's W3C trace (its own span id, the accepting
/// request's span as parent), and the job's context for the handler, whose `trace` the
/// handler sends onward. The span is made once its fields are known: a log layer formats
/// them when it is made and on every record.
fn job_span(event: &JobEvent, job: &mut JobRow) -> (tracing::Span, JobContext) {
    let span_id = event.trace.as_ref().map(|_| format!("{:016x}", rand::rng().random::<u64>() | 1));
    let ids = event.trace.as_ref().and_then(|trace| trace.ids());
    let span = tracing::info_span!(
        "job",
        job_id = %event.job_id,
        document_id = %event.document_id,
        event = event.payload.kind(),
        attempt = job.attempt,
        generation = job.generation,
        trace_id = ids.map(|(trace_id, _)| trace_id),
        span_id = ids.and(span_id.as_deref()),
        parent_span_id = ids.map(|(_, parent_id)| parent_id),
    );
    let handler_trace =
        event.trace.as_ref().zip(span_id.as_deref()).and_then(|(trace, id)| trace.child(id));
    (span, context_of(job, handler_trace))
}

/// Runs `handler` on `context`, contained: a panic, a run past the kind's `run_timeout` and
/// the processor's hard stop each end the run as a retryable failure that says so.
async fn run_contained(
    shared: &Shared,
    handler: &std::sync::Arc<dyn crate::handler::ErasedHandler>,
    context: &JobContext,
    kind: &RunLimits,
    cancel: &CancellationToken,
) -> Result<serde_json::Value, HandlerError> {
    let run = crate::callback::SCOPE.scope(
        Arc::clone(&shared.callbacks),
        std::panic::AssertUnwindSafe(handler.run_boxed(context, cancel.clone())).catch_unwind(),
    );
    // Past the kind's run time-out the token fires and the run is dropped: a handler that
    // hangs, or ignores its token, costs its own attempt, not a slot for ever. Without one,
    // the time-out is too far to come.
    let timed = tokio::time::timeout(kind.run_timeout.unwrap_or(Duration::MAX), run);
    // At the hard stop the token fires; a handler deaf to it is dropped after a grace.
    let stopped = async {
        shared.hard.cancelled().await;
        tokio::time::sleep(RELEASE_GRACE).await;
    };
    let ran = tokio::select! {
        ran = timed => Some(ran.ok()),
        () = stopped => None,
    };
    match ran {
        None => Err(HandlerError::retryable("cut short by its processor's stop").ambiguous()),
        Some(Some(Ok(result))) => result,
        // A panic costs its own attempt: a retryable failure naming it. What it did before
        // is not known.
        Some(Some(Err(panic))) => Err(HandlerError::retryable(format!(
            "the handler panicked: {}",
            panic_message(panic.as_ref())
        ))
        .ambiguous()),
        Some(None) => {
            cancel.cancel();
            Err(HandlerError::retryable(format!(
                "the handler ran past its run_timeout ({:?}) and was cancelled",
                kind.run_timeout.unwrap_or_default()
            ))
            .ambiguous())
        }
    }
}

/// What a run needs of its kind's settings: kept while it runs instead of all of them.
struct RunLimits {
    heartbeat: Duration,
    lease_ttl: Duration,
    run_timeout: Option<Duration>,
    max_output_bytes: usize,
    max_retry_after: Duration,
}

impl RunLimits {
    fn of(config: &Config, kind: &str) -> Self {
        let k = config.kind(kind);
        Self {
            heartbeat: k.heartbeat,
            lease_ttl: k.lease_ttl,
            run_timeout: k.run_timeout,
            max_output_bytes: k.max_output_bytes,
            max_retry_after: k.max_retry_after,
        }
    }
}

/// What a handler is told of `job`, leased. The job row's copy of the input is not needed
/// again: the context's is the only one.
fn context_of(job: &mut JobRow, trace: Option<jobfold_schemas::event::TraceContext>) -> JobContext {
    JobContext {
        trace,
        job_id: job.job_id,
        document_id: job.document_id.clone(),
        kind: job.kind.clone(),
        input_version: job.input_version,
        input: std::mem::take(&mut job.payload),
        attempt: job.attempt,
        generation: job.generation,
        deadline: job.deadline,
        max_attempts: job.max_attempts,
        previous_outcome: PreviousOutcome::from_column(job.previous_outcome.as_deref()),
    }
}

/// The attempt of a run the processor's stop cut short: given back ([`Attempt::released`]),
/// naming the process.
fn released(
    owner: &str,
    job: JobRow,
    context: JobContext,
    trace: Option<jobfold_schemas::event::TraceContext>,
) -> Attempt {
    let message = format!("released: its processor ({owner}) stopped before the run ended");
    Attempt { job, context, result: Err(HandlerError::retryable(message)), trace, released: true }
}

/// What a handler returned, made fit to commit and publish: a result larger than
/// `max_output_bytes` (its `JobSucceeded` event would be too large for the topic) or holding
/// U+0000 (Postgres cannot store it) becomes a permanent failure naming why; an error's text
/// is cut to [`MAX_ERROR_BYTES`] and cleared of U+0000. So whatever a handler returns costs
/// only its own job.
pub fn bounded(
    result: Result<serde_json::Value, HandlerError>,
    max_output_bytes: usize,
) -> Result<serde_json::Value, HandlerError> {
    match result {
        Ok(output) => {
            let size = serde_json::to_vec(&output).map_or(usize::MAX, |v| v.len());
            if size > max_output_bytes {
                return Err(HandlerError::permanent(format!(
                    "the result is {size} bytes, more than its max_output_bytes \
                     ({max_output_bytes}: processor.max_output_bytes, or the kind's own)"
                )));
            }
            if let Some(path) = jobfold_common::accept::find_nul(&output) {
                return Err(HandlerError::permanent(format!(
                    "the result's `{}` contains U+0000 (NUL), which Postgres cannot store",
                    if path.is_empty() { "." } else { &path }
                )));
            }
            Ok(output)
        }
        Err(mut e) => {
            if e.message.contains('\0') {
                e.message = e.message.replace('\0', "\u{fffd}");
            }
            if e.message.len() > MAX_ERROR_BYTES {
                let mut cut = MAX_ERROR_BYTES - 3;
                while !e.message.is_char_boundary(cut) {
                    cut -= 1;
                }
                e.message.truncate(cut);
                e.message.push_str("...");
            }
            Err(e)
        }
    }
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
