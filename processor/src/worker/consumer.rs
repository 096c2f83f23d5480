//! The worker's consumer: its own thread polls the events topic and hands over what
//! arrives; the rebalance callbacks run there, on that thread, where they may block.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Rebalance callbacks: stop, drain and commit revoked partitions; start assigned ones.
pub(super) struct WorkerContext {
    pub(super) tracker: Arc<Mutex<Tracker>>,
    pub(super) buffer: Arc<Mutex<Buffer>>,
    pub(super) queues: Arc<Mutex<Queues>>,
    pub(super) revoke_timeout: Duration,
    pub(super) topic: String,
    /// Partitions whose lag this member reported, so it reports 0 once it lost them.
    pub(super) lag_reported: Mutex<std::collections::BTreeSet<i32>>,
    /// Set by a graceful stop: revoked partitions go at once, their running jobs finishing
    /// here meanwhile (their completions need Postgres only).
    pub(super) stopping: Arc<std::sync::atomic::AtomicBool>,
}

impl WorkerContext {
    /// The state the rebalance callbacks share with the worker, empty.
    pub(super) fn new(config: &Config) -> Self {
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

/// How long a stopping processor polls for the group to take its partitions.
pub(super) const LEAVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The consumer of `config`'s events topic, in the processors' group, subscribed, with
/// `context`'s rebalance callbacks.
pub(super) fn subscribe(
    config: &Config,
    context: WorkerContext,
) -> anyhow::Result<BaseConsumer<WorkerContext>> {
    let mut client = jobfold_common::kafka::consumer_client(config);
    client.set("group.id", &config.processor.group);
    if let Some(id) = &config.processor.group_instance_id {
        client.set("group.instance.id", id);
    }
    if !config.kafka.0.contains_key("statistics.interval.ms") {
        let interval = config.processor.gauge_interval.as_millis().to_string();
        client.set("statistics.interval.ms", interval);
    }
    let consumer: BaseConsumer<WorkerContext> = client.create_with_context(context)?;
    consumer.subscribe(&[&config.topics.events])?;
    Ok(consumer)
}

/// What the consumer's thread hands the worker, in the order it polled them; a message
/// with the assignment (`epoch`, [`Tracker::epoch`]) its partition was in when polled.
pub(super) enum Arrival {
    /// A dispatch, for its document's queue.
    Dispatch { key: String, held: Held, epoch: u64 },
    /// An event no processor acts on ([`passed_over`]): done at once.
    PassedOver { partition: i32, offset: i64, epoch: u64 },
    /// The poll failed.
    Failed(KafkaError),
}

/// Arrivals the consumer's thread may hand over before the worker takes them: past it the
/// thread waits (librdkafka's read-ahead and the partitions' buffers bound the rest).
pub(super) const ARRIVALS: usize = 256;

/// How long one poll of the consumer's thread waits for something before it looks whether
/// to stop.
pub(super) const POLL_TURN: Duration = Duration::from_millis(100);

/// The consumer's own thread ([`consume`]) and what it hands over.
pub(super) struct ConsumerThread {
    pub(super) arrivals: tokio::sync::mpsc::Receiver<Arrival>,
    pub(super) polling: Arc<std::sync::atomic::AtomicBool>,
    pub(super) thread: Option<tokio::task::JoinHandle<()>>,
}

impl ConsumerThread {
    /// Starts polling `consumer` on a blocking thread.
    pub(super) fn start(consumer: Arc<BaseConsumer<WorkerContext>>) -> Self {
        let (arrive, arrivals) = tokio::sync::mpsc::channel(ARRIVALS);
        let polling = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let still = Arc::clone(&polling);
        let thread = tokio::task::spawn_blocking(move || consume(&consumer, &arrive, &still));
        Self { arrivals, polling, thread: Some(thread) }
    }

    /// Ends the thread: at its next turn, or at once if it waits to hand something over.
    pub(super) async fn stop(&mut self) {
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
pub(super) fn consume(
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
pub(super) async fn leave_the_group(
    shared: &Shared,
    arrivals: &mut tokio::sync::mpsc::Receiver<Arrival>,
) {
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
pub(super) fn pause_or_resume(shared: &Shared, buffer: &Buffer, partition: i32, pause: bool) {
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

/// Whether `message` is an event of a kind processors do not act on, as its `jobfold-event`
/// header names it (`JobLeased`, `JobSucceeded`, …): the second of a job's two events when
/// it ran inside its lease transaction, passed over without being copied or decoded. An event without the header is decoded and decided
/// as before.
pub(super) fn passed_over(message: &impl Message) -> bool {
    use rdkafka::message::Headers;
    message
        .headers()
        .and_then(|headers| headers.iter().find(|h| h.key == EVENT_KIND))
        .and_then(|header| header.value)
        .is_some_and(|kind| !Payload::is_dispatch_kind(kind))
}

/// Stores `offset` of `partition` for the next commit; a partition that moved meanwhile
/// keeps what its new owner stores.
pub(super) fn store_offset(shared: &Shared, topic: &str, partition: i32, offset: i64) {
    if let Err(e) = shared.consumer.store_offset(topic, partition, offset) {
        tracing::debug!(error = %e, partition, offset, "Offset not stored (the partition moved).");
    }
}
