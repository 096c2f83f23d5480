//! The dispatcher: each document's queue, the process's slots, and a task for a document's
//! next message whenever a slot is free.

#[allow(clippy::wildcard_imports)]
use super::*;

/// A message held for its document's task, and the bytes it counts in its partition.
pub(super) struct Queued {
    pub(super) message: Held,
    pub(super) ticket: Ticket,
    pub(super) bytes: usize,
}

/// What is kept of a dispatch message while it waits: its key and value, and where it is
/// (the topic is the one this processor consumes). rdkafka's `OwnedMessage` would also copy
/// the topic's name and each header, in allocations of their own: about 1.4 KiB a message
/// held, against its value's few hundred bytes.
pub(super) struct Held {
    pub(super) key: Option<Box<[u8]>>,
    pub(super) payload: Option<Box<[u8]>>,
    pub(super) partition: i32,
    pub(super) offset: i64,
}

impl Held {
    pub(super) fn of(message: &impl Message) -> Self {
        Self {
            key: message.key().map(Box::from),
            payload: message.payload().map(Box::from),
            partition: message.partition(),
            offset: message.offset(),
        }
    }

    /// Where it is, on `topic`.
    pub(super) fn at<'a>(&self, topic: &'a str) -> At<'a> {
        At { topic, partition: self.partition, offset: self.offset }
    }

    /// As a dead letter keeps it, on `topic`.
    pub(super) fn raw<'a>(&'a self, topic: &'a str) -> Raw<'a> {
        Raw { at: self.at(topic), key: self.key.as_deref(), payload: self.payload.as_deref() }
    }
}

/// The documents with messages in memory. A document is here from its first message until
/// its queue is empty and no task runs it; it is then either in `ready` (waiting for a slot,
/// as nothing more than its queued messages) or being run by the one task a slot started.
#[derive(Default)]
pub(super) struct Queues {
    /// Per document: the messages no task has taken yet.
    pub(super) waiting: HashMap<Arc<str>, VecDeque<Queued>>,
    /// Documents with a message to run and no task, in the order they became ready.
    pub(super) ready: VecDeque<Arc<str>>,
}

impl Queues {
    /// Holds `queued` for `key`; true if the document just became ready.
    pub(super) fn push(&mut self, key: &str, queued: Queued) -> bool {
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
    pub(super) fn next(&mut self, key: &str) -> Option<Queued> {
        let next = self.waiting.get_mut(key).and_then(VecDeque::pop_front);
        if next.is_none() {
            self.waiting.remove(key);
        }
        next
    }

    /// After its task ran one message: `key` goes to the back of `ready` if more are queued
    /// (so a busy document takes its turn with the others), else it is forgotten. True if it
    /// is ready again.
    pub(super) fn done(&mut self, key: Arc<str>) -> bool {
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
    pub(super) fn take_partitions(&mut self, partitions: &[i32]) -> Vec<Queued> {
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

/// Queues a polled dispatch for its document (`key`), counted in its partition's buffer
/// (which pauses the partition when full).
pub(super) fn queue(shared: &Shared, key: String, held: Held, epoch: u64) {
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

/// A running job's slot: the in-flight gauge follows it.
pub(super) struct Slot {
    pub(super) _permits: (Option<OwnedSemaphorePermit>, OwnedSemaphorePermit),
    pub(super) slots: Arc<Semaphore>,
    pub(super) max: usize,
}

impl Slot {
    /// Waits for a slot of `kind` (if it has its own `concurrency`), then for its kind's
    /// quota ([`crate::quota`]), then for one of the process's slots — the kind's first, so
    /// jobs waiting for their kind or its quota hold none of the process's slots: `held`, a
    /// process slot the caller has, is kept only if neither may make it wait, else given
    /// back first. `Ok(None)` if the shutdown or `revoked` came first.
    pub(super) async fn acquire(
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

/// Starts a task for the next ready document whenever one of the process's slots is free,
/// so that a document waiting for a slot costs only its queued messages, not a task: a
/// burst of many documents is held in little memory.
pub(super) async fn dispatch(shared: Arc<Shared>) {
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
pub(super) async fn run_next(shared: Arc<Shared>, key: Arc<str>, permit: OwnedSemaphorePermit) {
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
