//! Producing a batch of events and collecting every delivery report.
//!
//! The producer is idempotent (`enable.idempotence`, `acks=all`) with the gapless
//! guarantee: librdkafka retries internally and never delivers a later message of a
//! partition after an earlier one failed — it raises a fatal error instead, and the relay
//! builds a new producer. Message time-outs are not covered by that guarantee, so the relay
//! sets none (`message.timeout.ms=0`): during a broker outage a batch waits, and shutdown
//! gives up on it after `relay.shutdown_timeout`, leaving its rows unpublished. So marking
//! exactly the acknowledged rows keeps per-document order.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use jobfold_common::config::{Config, KafkaRole};
use jobfold_schemas::event::{EVENT_KIND, TRACEPARENT, TRACESTATE};
use rdkafka::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{
    BaseRecord, DeliveryResult, Producer, ProducerContext, PurgeConfig, ThreadedProducer,
};
use rdkafka::util::Timeout;
use tokio::sync::{oneshot, watch};

/// The relay's producer defaults besides the fixed options
/// ([`jobfold_common::config::FIXED_KAFKA_OPTIONS`]: idempotent, `acks=all`, gapless, no
/// message time-out — a timed-out message could leave a gap that a later one skips over);
/// these can be overridden under `[kafka]`.
pub const PRODUCER_DEFAULTS: &[(&str, &str)] = &[("linger.ms", "5"), ("compression.type", "lz4")];

/// The relay's producer: delivery reports are counted per batch by [`Reports`], with no
/// allocation or channel per message.
pub type EventProducer = ThreadedProducer<Reports>;

/// Builds the relay's producer.
///
/// # Errors
/// librdkafka refused the configuration.
pub fn producer(config: &Config) -> Result<EventProducer, KafkaError> {
    config
        .kafka_client_for(KafkaRole::Producer, PRODUCER_DEFAULTS)
        .create_with_context(Reports::default())
}

/// The relay's producer for a topic that takes record batches of up to `max_bytes`: unless
/// `[kafka]` sets them, `message.max.bytes` and `batch.size` are held to it, so librdkafka
/// never gathers small events into a batch the broker refuses whole.
///
/// # Errors
/// librdkafka refused the configuration.
pub fn producer_for(config: &Config, max_bytes: usize) -> Result<EventProducer, KafkaError> {
    let mut client = config.kafka_client_for(KafkaRole::Producer, PRODUCER_DEFAULTS);
    for option in ["message.max.bytes", "batch.size"] {
        if !config.kafka.0.contains_key(option) {
            client.set(option, max_bytes.min(1_000_000).to_string());
        }
    }
    client.create_with_context(Reports::default())
}

/// One event to produce, borrowed from the row read ([`StoredEvent`]): nothing is copied
/// before librdkafka copies it into its queue.
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    pub seq: i64,
    pub topic: &'a str,
    /// The Kafka key: the document id.
    pub key: &'a str,
    /// The event in the Confluent wire format, as stored in job_events.
    pub body: &'a [u8],
    /// When the event became publishable: its commit, or a scheduled retry's due time.
    pub available_at: DateTime<Utc>,
    /// The event's W3C trace context, sent as Kafka headers.
    pub traceparent: Option<&'a str>,
    pub tracestate: Option<&'a str>,
    /// The event's kind (`JobRequested`, …), sent as the `jobfold-event` header.
    pub kind: &'a str,
}

/// An event as a relay read selected it (the log's, the outbox's, the park's): what an
/// [`Event`] borrows.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    pub seq: i64,
    /// The topic the row names (the outbox's and the park's); `None` for the log's, which
    /// go to the events topic.
    pub topic: Option<String>,
    pub key: String,
    pub body: Vec<u8>,
    pub available_at: DateTime<Utc>,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    pub kind: String,
}

impl StoredEvent {
    /// The event to produce, to its own topic or else to `topic`.
    pub fn event<'a>(&'a self, topic: &'a str) -> Event<'a> {
        Event {
            seq: self.seq,
            topic: self.topic.as_deref().unwrap_or(topic),
            key: &self.key,
            body: &self.body,
            available_at: self.available_at,
            traceparent: self.traceparent.as_deref(),
            tracestate: self.tracestate.as_deref(),
            kind: &self.kind,
        }
    }
}

/// The events of `rows`, each to its own topic or else to `topic`.
pub fn events<'a>(rows: &'a [StoredEvent], topic: &'a str) -> Vec<Event<'a>> {
    rows.iter().map(|row| row.event(topic)).collect()
}

/// What happened to one batch.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Acknowledged by the broker: (seq, when the row became available).
    pub delivered: Vec<(i64, DateTime<Utc>)>,
    /// Refused for what the event is ([`is_message_fault`], or larger than the relay may
    /// send): (seq, why). Sending it again cannot help: it is parked.
    pub refused: Vec<(i64, String)>,
    /// Not sent because an earlier event of the same document is parked (or was refused in
    /// this batch): parked behind it, in order.
    pub waiting: Vec<i64>,
    /// Not delivered for a reason that may pass (the producer was rebuilt, the cluster
    /// refused): (seq, why). These rows stay unpublished and are sent again.
    pub failed: Vec<(i64, KafkaError)>,
    /// Not sent because an earlier event of the same document failed to enqueue: sending
    /// them would put them on the topic ahead of it.
    pub held_back: Vec<i64>,
    /// Sent, and refused by the broker for what they are (after the relay's own limit let
    /// them through: the topic's may have been lowered since it was read, and events
    /// batched with a refused one are refused with it). The relay decides: sent again once
    /// the limit is read anew, parked if refused again ([`Outcome::refused`]).
    pub refused_by_broker: Vec<(i64, KafkaError)>,
}

impl Outcome {
    /// The seqs of the batch's events that neither reached Kafka nor were parked: the
    /// cursor must not pass them.
    pub fn undelivered(&self) -> HashSet<i64> {
        self.failed
            .iter()
            .chain(&self.refused_by_broker)
            .map(|(seq, _)| *seq)
            .chain(self.held_back.iter().copied())
            .collect()
    }
}

/// Documents whose events must not be sent now, kept by the caller across the batches of a
/// pass.
#[derive(Debug, Default)]
pub struct Blocked {
    /// Documents with a parked event: their later events are parked behind it.
    pub parked: HashSet<String>,
    /// Documents with an event that failed to enqueue in this pass for a reason that may
    /// pass: their later events are held back (sent in a later pass).
    pub held: HashSet<String>,
}

/// Whether Kafka refused the message for what it is — its size or its bytes — so that
/// sending it again is bound to fail the same way: it is parked instead of holding back the
/// cursor. Errors of the cluster or the connection are not: they are tried again.
pub fn is_message_fault(error: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        error.rdkafka_error_code(),
        Some(
            C::MessageSizeTooLarge
                | C::InvalidMessageSize
                | C::InvalidMessage
                | C::InvalidRecord
                | C::MessageBatchTooLarge
                | C::InvalidTimestamp
                | C::InvalidArgument
        )
    )
}

/// Bytes a record adds to its key, value and headers in a record batch, at most: the batch
/// header (61 bytes), the record's own varints, and room for header names.
pub const RECORD_OVERHEAD_BYTES: usize = 128;

/// How many bytes `event` takes in a record batch, at most (before compression).
pub fn record_size(event: &Event<'_>) -> usize {
    RECORD_OVERHEAD_BYTES
        + event.key.len()
        + event.body.len()
        + event.kind.len()
        + event.traceparent.map_or(0, str::len)
        + event.tracestate.map_or(0, str::len)
}

/// Delivery reports of the relay's producer, tallied per batch.
///
/// Each message carries `(batch << 32) | index` as its delivery opaque (a plain number, no
/// allocation); the report callback, on librdkafka's polling thread, finds the batch's tally
/// and keeps the failures; once the batch is sealed (all enqueued) and its last report
/// arrived, the batch gets its answer.
///
/// A fatal error of the producer (the gapless guarantee broken by a refused event, ...)
/// is signalled at once: reports it still owes may never come, so a batch waiting for them
/// takes what has arrived and gives up on the rest ([`Sent::delivered`]).
#[derive(Debug)]
pub struct Reports {
    tallies: Mutex<HashMap<u32, Tally>>,
    /// The number of the next batch.
    next_batch: AtomicU32,
    /// Set once librdkafka reports a fatal error.
    fatal: watch::Sender<bool>,
}

impl Default for Reports {
    fn default() -> Self {
        Self {
            tallies: Mutex::default(),
            next_batch: AtomicU32::new(0),
            fatal: watch::Sender::new(false),
        }
    }
}

#[derive(Debug)]
struct Tally {
    /// Reports to come: enqueued messages (added when the batch is sealed) minus reports.
    outstanding: i64,
    sealed: bool,
    /// (index in the batch, why).
    failed: Vec<(usize, KafkaError)>,
    /// Indexes reported delivered: what a batch given up on keeps.
    delivered: Vec<usize>,
    done: oneshot::Sender<Vec<(usize, KafkaError)>>,
}

const _: () = assert!(usize::BITS >= 64, "the delivery opaque holds a batch and an index");

/// What a batch given up on was told: the indexes reported delivered, and the failures.
type Reported = (Vec<usize>, Vec<(usize, KafkaError)>);

impl ClientContext for Reports {
    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) {
            tracing::error!(%reason, "The relay's producer hit a fatal error; a new one is built.");
            self.fatal.send_replace(true);
        } else {
            tracing::warn!(error = %error, %reason, "librdkafka reported an error.");
        }
    }
}

impl ProducerContext for Reports {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, opaque: usize) {
        let (batch, index) = ((opaque >> 32) as u32, opaque & 0xffff_ffff);
        let mut tallies = self.tallies.lock().expect("no panic while holding the tallies");
        let Some(tally) = tallies.get_mut(&batch) else { return };
        match result {
            Err((e, _)) => tally.failed.push((index, e.clone())),
            Ok(_) => tally.delivered.push(index),
        }
        tally.outstanding -= 1;
        Reports::answer_if_done(&mut tallies, batch);
    }
}

impl Reports {
    /// Numbers a new batch and starts tallying it: its reports may arrive while it is still
    /// being enqueued.
    fn open(&self) -> (u32, oneshot::Receiver<Vec<(usize, KafkaError)>>) {
        let batch = self.next_batch.fetch_add(1, Ordering::Relaxed);
        let (done, reports) = oneshot::channel();
        let tally = Tally {
            outstanding: 0,
            sealed: false,
            failed: Vec::new(),
            delivered: Vec::new(),
            done,
        };
        self.tallies.lock().expect("no panic while holding the tallies").insert(batch, tally);
        (batch, reports)
    }

    /// Stops tallying `batch`: the reports it has (delivered indexes, failures), if it was
    /// still waiting.
    fn abandon(&self, batch: u32) -> Option<Reported> {
        let mut tallies = self.tallies.lock().expect("no panic while holding the tallies");
        tallies.remove(&batch).map(|tally| (tally.delivered, tally.failed))
    }

    /// All `enqueued` messages of `batch` are in the producer's queue.
    fn seal(&self, batch: u32, enqueued: usize) {
        let mut tallies = self.tallies.lock().expect("no panic while holding the tallies");
        if let Some(tally) = tallies.get_mut(&batch) {
            tally.outstanding += i64::try_from(enqueued).expect("a batch fits in i64");
            tally.sealed = true;
        }
        Reports::answer_if_done(&mut tallies, batch);
    }

    fn answer_if_done(tallies: &mut HashMap<u32, Tally>, batch: u32) {
        if tallies.get(&batch).is_some_and(|t| t.sealed && t.outstanding == 0)
            && let Some(tally) = tallies.remove(&batch)
        {
            // The batch may have been abandoned on shutdown: nobody to tell.
            let _ = tally.done.send(tally.failed);
        }
    }
}

/// A batch handed to the producer, its delivery reports still to come.
pub struct Sent {
    batch: u32,
    /// (seq, available_at) of each enqueued event, in the order of their indexes.
    enqueued: Vec<(i64, DateTime<Utc>)>,
    reports: oneshot::Receiver<Vec<(usize, KafkaError)>>,
    /// Whether the producer hit a fatal error.
    fatal: watch::Receiver<bool>,
    outcome: Outcome,
}

impl std::fmt::Debug for Sent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sent").field("enqueued", &self.enqueued.len()).finish_non_exhaustive()
    }
}

/// Enqueues `events` in order, without waiting for delivery.
///
/// An event larger than `max_bytes` (the most the topic and the producer take, see
/// [`record_size`]) is refused without being sent, as is one librdkafka refuses to enqueue
/// for what it is; its document joins `blocked.parked`. An event of a document in
/// `blocked.parked` is not sent but waits ([`Outcome::waiting`]); one of a document in
/// `blocked.held` (an enqueue failure that may pass) is held back.
pub async fn send(
    producer: &EventProducer,
    events: &[Event<'_>],
    blocked: &mut Blocked,
    max_bytes: usize,
) -> Sent {
    let (batch, reports) = producer.context().open();
    let mut sent = Sent {
        batch,
        enqueued: Vec::with_capacity(events.len()),
        reports,
        fatal: producer.context().fatal.subscribe(),
        outcome: Outcome::default(),
    };
    for event in events {
        if !blocked.parked.is_empty() && blocked.parked.contains(event.key) {
            sent.outcome.waiting.push(event.seq);
            continue;
        }
        if !blocked.held.is_empty() && blocked.held.contains(event.key) {
            sent.outcome.held_back.push(event.seq);
            continue;
        }
        let size = record_size(event);
        if size > max_bytes {
            let reason = format!(
                "the event takes {size} bytes, more than the {max_bytes} its topic {} and the \
                 producer take (max.message.bytes, message.max.bytes)",
                event.topic
            );
            refuse(&mut sent.outcome, blocked, event, reason);
            continue;
        }
        let opaque = (batch as usize) << 32 | sent.enqueued.len();
        let mut record =
            BaseRecord::with_opaque_to(event.topic, opaque).key(event.key).payload(event.body);
        record = record.headers(headers(event));
        loop {
            match producer.send(record) {
                Ok(()) => {
                    sent.enqueued.push((event.seq, event.available_at));
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    // The local queue is full: let deliveries drain, then try again.
                    record = back;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((e, _)) if is_message_fault(&e) => {
                    refuse(&mut sent.outcome, blocked, event, format!("Kafka refused it: {e}"));
                    break;
                }
                Err((e, _)) => {
                    tracing::warn!(
                        seq = event.seq,
                        topic = %event.topic,
                        document_id = %event.key,
                        error = %e,
                        "Event cannot be enqueued now; later events of its document wait behind it."
                    );
                    blocked.held.insert(event.key.to_owned());
                    sent.outcome.failed.push((event.seq, e));
                    break;
                }
            }
        }
    }
    producer.context().seal(batch, sent.enqueued.len());
    sent
}

/// Records `event` as refused for `reason`: it is parked, and so are its document's later
/// events.
fn refuse(outcome: &mut Outcome, blocked: &mut Blocked, event: &Event<'_>, reason: String) {
    tracing::error!(
        seq = event.seq,
        topic = %event.topic,
        document_id = %event.key,
        reason = %reason,
        "Event parked: Kafka will not take it. Its document's later events wait behind it; \
         see `jobfold parked list`."
    );
    blocked.parked.insert(event.key.to_owned());
    outcome.refused.push((event.seq, reason));
}

/// The event's kind (`jobfold-event`) and W3C trace context (`traceparent`, `tracestate`, if
/// it has one) as Kafka headers: consumers and tracing tools read them without decoding the
/// event, and processors pass over the kinds they do not act on.
fn headers(event: &Event<'_>) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(3)
        .insert(Header { key: EVENT_KIND, value: Some(event.kind) });
    if let Some(traceparent) = event.traceparent {
        headers = headers.insert(Header { key: TRACEPARENT, value: Some(traceparent) });
    }
    if let Some(state) = event.tracestate.filter(|_| event.traceparent.is_some()) {
        headers = headers.insert(Header { key: TRACESTATE, value: Some(state) });
    }
    headers
}

/// How long a batch still waits for its reports once the producer hit a fatal error (the
/// refused event's own report comes right after the error).
const FATAL_GRACE: Duration = Duration::from_secs(2);

impl Sent {
    /// Waits for every delivery report of the batch, through broker outages. If `producer`
    /// hits a fatal error meanwhile, what it still holds is purged and the batch waits
    /// [`FATAL_GRACE`] more at most: what was reported by then counts (a refused event is
    /// parked), everything else failed and is sent again by a new producer.
    pub async fn delivered(self, producer: &EventProducer) -> Outcome {
        let Sent { batch, enqueued, mut reports, mut fatal, outcome } = self;
        let answer = tokio::select! {
            answer = &mut reports => Some(answer),
            Ok(_) = fatal.wait_for(|fatal| *fatal) => None,
        };
        let answer = match answer {
            Some(answer) => answer,
            None => {
                producer.purge(PurgeConfig::default().queue().inflight());
                match tokio::time::timeout(FATAL_GRACE, &mut reports).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        let (delivered, failed) =
                            producer.context().abandon(batch).unwrap_or_default();
                        return settled(outcome, enqueued, failed, Some(&delivered));
                    }
                }
            }
        };
        match answer {
            Ok(failed) => settled(outcome, enqueued, failed, None),
            // The producer was dropped (rebuilt after a fatal error) with the batch queued.
            Err(_) => settled(outcome, enqueued, Vec::new(), Some(&[])),
        }
    }
}

/// The batch's outcome from its reports: `failed` by index, and `delivered` the indexes
/// reported delivered, or `None` when every report arrived (all not failed were delivered).
/// An event with no report failed: it is sent again.
fn settled(
    mut outcome: Outcome,
    enqueued: Vec<(i64, DateTime<Utc>)>,
    mut failed: Vec<(usize, KafkaError)>,
    delivered: Option<&[usize]>,
) -> Outcome {
    if failed.is_empty() && delivered.is_none() {
        outcome.delivered = enqueued;
        return outcome;
    }
    failed.sort_unstable_by_key(|(index, _)| *index);
    let mut failed = failed.into_iter().peekable();
    let delivered: Option<HashSet<usize>> = delivered.map(|d| d.iter().copied().collect());
    for (index, (seq, available_at)) in enqueued.into_iter().enumerate() {
        match failed.next_if(|(at, _)| *at == index) {
            Some((_, e)) if is_message_fault(&e) => outcome.refused_by_broker.push((seq, e)),
            Some((_, e)) => outcome.failed.push((seq, e)),
            None if delivered.as_ref().is_none_or(|d| d.contains(&index)) => {
                outcome.delivered.push((seq, available_at));
            }
            None => {
                outcome.failed.push((seq, KafkaError::MessageProduction(RDKafkaErrorCode::Fatal)))
            }
        }
    }
    outcome
}

/// Whether the producer hit a fatal error (e.g. the gapless guarantee) and must be rebuilt.
pub fn is_fatal(producer: &EventProducer) -> bool {
    producer.client().fatal_error().is_some()
}

/// Waits up to `timeout` for queued messages to be delivered, on shutdown.
pub fn flush(producer: &EventProducer, timeout: Duration) {
    if let Err(e) = producer.flush(Timeout::After(timeout)) {
        tracing::warn!(error = %e, "Producer flush on shutdown did not complete.");
    }
}
