//! Producing a batch of outbox rows and collecting every delivery report.
//!
//! The producer is idempotent (`enable.idempotence`, `acks=all`) with the gapless
//! guarantee: librdkafka retries internally and never delivers a later message of a
//! partition after an earlier one failed — it raises a fatal error instead, and the relay
//! builds a new producer. Message time-outs are not covered by that guarantee, so the relay
//! sets none (`message.timeout.ms=0`): during a broker outage a batch waits, and shutdown
//! gives up on it after `relay.shutdown_timeout`, leaving its rows unpublished. So marking
//! exactly the acknowledged rows keeps per-document order.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use jobfold_common::config::Config;
use jobfold_schemas::event::{TRACEPARENT, TRACESTATE};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;

use crate::outbox::OutboxRow;

/// The relay's producer defaults; every one can be overridden under `[kafka]`.
pub const PRODUCER_DEFAULTS: &[(&str, &str)] = &[
    ("enable.idempotence", "true"),
    ("acks", "all"),
    ("enable.gapless.guarantee", "true"),
    ("linger.ms", "5"),
    ("compression.type", "lz4"),
    // Infinite: a timed-out message could leave a gap that a later message skips over.
    ("message.timeout.ms", "0"),
];

/// Builds the relay's producer.
///
/// # Errors
/// librdkafka refused the configuration.
pub fn producer(config: &Config) -> Result<FutureProducer, KafkaError> {
    config.kafka_client_with(PRODUCER_DEFAULTS).create()
}

/// What happened to one batch.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Acknowledged by the broker: (seq, when the row became available).
    pub delivered: Vec<(i64, DateTime<Utc>)>,
    /// Not delivered: (seq, why). These rows stay unpublished.
    pub failed: Vec<(i64, KafkaError)>,
    /// Not sent because an earlier row of the same document failed to enqueue: sending them
    /// would put them on the topic ahead of it.
    pub held_back: usize,
}

/// A batch handed to the producer, its delivery reports still to come.
pub struct Sent {
    pending: Vec<(i64, DateTime<Utc>, DeliveryFuture)>,
    outcome: Outcome,
}

impl std::fmt::Debug for Sent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sent").field("pending", &self.pending.len()).finish_non_exhaustive()
    }
}

/// Enqueues `rows` in order, without waiting for delivery.
///
/// `blocked` holds the documents with a row that could not be enqueued in this pass: their
/// later rows are held back, or they would reach the topic ahead of it. The caller keeps it
/// across the batches of one pass.
pub async fn send(
    producer: &FutureProducer,
    rows: &[OutboxRow],
    blocked: &mut HashSet<String>,
) -> Sent {
    let mut sent = Sent { pending: Vec::with_capacity(rows.len()), outcome: Outcome::default() };
    for row in rows {
        if blocked.contains(row.key.as_str()) {
            sent.outcome.held_back += 1;
            continue;
        }
        let mut record = FutureRecord::to(&row.topic).key(&row.key).payload(&row.body);
        if let Some(headers) = trace_headers(row) {
            record = record.headers(headers);
        }
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    sent.pending.push((row.seq, row.available_at, delivery));
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    // The local queue is full: let deliveries drain, then try again.
                    record = back;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((e, _)) => {
                    tracing::error!(
                        seq = row.seq,
                        topic = %row.topic,
                        document_id = %row.key,
                        error = %e,
                        "Outbox row cannot be produced; later events of its document wait behind it."
                    );
                    blocked.insert(row.key.clone());
                    sent.outcome.failed.push((row.seq, e));
                    break;
                }
            }
        }
    }
    sent
}

/// The row's W3C trace context as Kafka headers (`traceparent`, `tracestate`), if it has one:
/// consumers and tracing tools read it without decoding the event.
fn trace_headers(row: &OutboxRow) -> Option<OwnedHeaders> {
    let traceparent = row.traceparent.as_deref()?;
    let headers = OwnedHeaders::new_with_capacity(2)
        .insert(Header { key: TRACEPARENT, value: Some(traceparent) });
    Some(match row.tracestate.as_deref() {
        Some(state) => headers.insert(Header { key: TRACESTATE, value: Some(state) }),
        None => headers,
    })
}

impl Sent {
    /// Waits for every delivery report of the batch.
    pub async fn delivered(self) -> Outcome {
        let mut outcome = self.outcome;
        for (seq, available_at, delivery) in self.pending {
            match delivery.await {
                Ok(Ok(_)) => outcome.delivered.push((seq, available_at)),
                Ok(Err((e, _))) => outcome.failed.push((seq, e)),
                Err(_canceled) => outcome.failed.push((seq, KafkaError::Canceled)),
            }
        }
        outcome
    }
}

/// Produces `rows` in order and waits for every delivery report.
pub async fn publish(producer: &FutureProducer, rows: &[OutboxRow]) -> Outcome {
    send(producer, rows, &mut HashSet::new()).await.delivered().await
}

/// Whether the producer hit a fatal error (e.g. the gapless guarantee) and must be rebuilt.
pub fn is_fatal(producer: &FutureProducer) -> bool {
    producer.client().fatal_error().is_some()
}

/// Waits up to `timeout` for queued messages to be delivered, on shutdown.
pub fn flush(producer: &FutureProducer, timeout: Duration) {
    if let Err(e) = producer.flush(Timeout::After(timeout)) {
        tracing::warn!(error = %e, "Producer flush on shutdown did not complete.");
    }
}
