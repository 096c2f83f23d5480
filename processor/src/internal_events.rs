//! What the processor reports as it runs. Each event writes its log line and moves its
//! metrics in one call (`emit`), with the same fields, so that the two cannot drift apart:
//! a site says what happened, not how it is counted. Metric names are in [`crate::metrics`].

use std::fmt;
use std::time::Duration;

use rdkafka::Message;
use uuid::Uuid;

use crate::metrics as pm;

/// Where a message sits in Kafka: `topic/partition@offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Coordinates {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

impl Coordinates {
    pub fn of(message: &impl Message) -> Self {
        At::of(message).coordinates()
    }
}

/// [`Coordinates`], borrowed.
#[derive(Debug, Clone, Copy)]
pub struct At<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
}

impl<'a> At<'a> {
    pub fn of(message: &'a impl Message) -> Self {
        Self { topic: message.topic(), partition: message.partition(), offset: message.offset() }
    }

    #[must_use]
    pub fn coordinates(self) -> Coordinates {
        Coordinates { topic: self.topic.to_owned(), partition: self.partition, offset: self.offset }
    }
}

impl fmt::Display for Coordinates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}@{}", self.topic, self.partition, self.offset)
    }
}

/// A message that could not be handled this time, with where it sits: the consumer tries it
/// again (its offset is not stored until it is handled).
#[derive(Debug, thiserror::Error)]
#[error("message {at}: {cause:#}")]
pub struct MessageError {
    pub at: Coordinates,
    #[source]
    pub cause: anyhow::Error,
}

impl MessageError {
    pub fn at(message: &impl Message, cause: anyhow::Error) -> Self {
        Self { at: Coordinates::of(message), cause }
    }
}

/// A message will be handled again after `backoff` (`stage`: `dispatch`, the events topic's
/// consumer; `intake`, the requests topic's).
#[derive(Debug)]
pub struct MessageRetried<'a> {
    pub error: &'a MessageError,
    pub stage: &'static str,
    pub backoff: Duration,
}

impl MessageRetried<'_> {
    pub fn emit(self) {
        let at = &self.error.at;
        tracing::warn!(
            error = %format!("{:#}", self.error.cause),
            topic = %at.topic,
            partition = at.partition,
            offset = at.offset,
            stage = self.stage,
            backoff = ?self.backoff,
            "Message will be handled again."
        );
        metrics::counter!(pm::MESSAGE_RETRIES_TOTAL, "stage" => self.stage).increment(1);
    }
}

/// The consumer of `stage` (`dispatch`, `intake`) reported an error instead of a message: it
/// asks again after `backoff`, which doubles while the errors go on.
#[derive(Debug)]
pub struct ConsumerFailed<'a> {
    pub stage: &'static str,
    pub error: &'a rdkafka::error::KafkaError,
    pub backoff: Duration,
}

impl ConsumerFailed<'_> {
    pub fn emit(self) {
        tracing::warn!(
            error = %self.error,
            stage = self.stage,
            backoff = ?self.backoff,
            "Consumer error; asking again after the backoff."
        );
        let code = self
            .error
            .rdkafka_error_code()
            .map_or_else(|| "other".to_owned(), |code| format!("{code:?}"));
        metrics::counter!(pm::CONSUMER_ERRORS_TOTAL, "stage" => self.stage, "code" => code)
            .increment(1);
    }
}

/// How long a consumer waits after an error before it asks again. librdkafka reports what
/// it goes through on its own (all brokers down, a connection refused, a coordinator moved)
/// as consumer errors, a few at each change, queued with the messages: waiting after each
/// would hold every message queued behind them. So the first errors in a row are asked past
/// at once; only a long run of them with no message between (librdkafka failing every call)
/// is paced, from 10 ms doubling to 1 s, back to none after a message.
#[derive(Debug, Default)]
pub struct ErrorBackoff {
    /// Errors since the last message.
    in_a_row: u32,
}

impl ErrorBackoff {
    /// Errors in a row asked past at once.
    const UNPACED: u32 = 100;
    const FIRST: Duration = Duration::from_millis(10);
    const MOST: Duration = Duration::from_secs(1);

    /// The wait after the next error.
    pub fn after_error(&mut self) -> Duration {
        self.in_a_row = self.in_a_row.saturating_add(1);
        match self.in_a_row.checked_sub(Self::UNPACED + 1) {
            None => Duration::ZERO,
            Some(beyond) => Self::FIRST.saturating_mul(1 << beyond.min(16)).min(Self::MOST),
        }
    }

    /// A message arrived.
    pub fn reset(&mut self) {
        self.in_a_row = 0;
    }
}

/// A message was stored in `dead_letters` (undecodable, or refused by the database).
#[derive(Debug)]
pub struct DeadLettered<'a> {
    pub at: Coordinates,
    pub group: &'a str,
    pub error: &'a str,
}

impl DeadLettered<'_> {
    pub fn emit(self) {
        tracing::warn!(
            topic = %self.at.topic,
            partition = self.at.partition,
            offset = self.at.offset,
            group = self.group,
            error = self.error,
            "Message dead-lettered."
        );
        metrics::counter!(pm::DEAD_LETTERS_TOTAL, "topic" => self.at.topic).increment(1);
    }
}

/// The consumer group gave this processor `partitions` (`assigned`) or took them from it;
/// it holds `held` now.
#[derive(Debug)]
pub struct PartitionsMoved<'a> {
    pub partitions: &'a [i32],
    pub assigned: bool,
    pub held: usize,
}

impl PartitionsMoved<'_> {
    pub fn emit(self) {
        metrics::gauge!(pm::ASSIGNED_PARTITIONS).set(self.held as f64);
        let (partitions, held) = (self.partitions, self.held);
        if self.assigned {
            // Each rebalance this member takes part in ends in an assignment (empty when
            // nothing moved to it); a static member's restart makes none.
            metrics::counter!(pm::GROUP_REBALANCES_TOTAL).increment(1);
            tracing::info!(?partitions, held, "Partitions assigned.");
        } else {
            tracing::info!(?partitions, held, "Partitions revoked.");
        }
    }
}

/// A partition stopped fetching: it holds its share of buffered messages.
#[derive(Debug)]
pub struct PartitionPaused {
    pub partition: i32,
}

impl PartitionPaused {
    pub fn emit(self) {
        metrics::counter!(pm::PARTITION_PAUSES_TOTAL).increment(1);
        tracing::debug!(partition = self.partition, "Partition paused: its buffer is full.");
    }
}

/// An attempt's completion found another generation holding the job (a zombie's result):
/// nothing was committed.
#[derive(Debug)]
pub struct CompletionFenced {
    pub job_id: Uuid,
    pub generation: i64,
}

impl CompletionFenced {
    pub fn emit(self) {
        metrics::counter!(pm::FENCED_COMPLETIONS_TOTAL).increment(1);
        tracing::warn!(
            job_id = %self.job_id,
            generation = self.generation,
            "Completion fenced: another generation holds the job; result discarded."
        );
    }
}

/// An operator cancelled a job that was `was`.
#[derive(Debug)]
pub struct JobCancelled<'a> {
    pub job_id: Uuid,
    pub was: &'a str,
}

impl JobCancelled<'_> {
    pub fn emit(self) {
        metrics::counter!(pm::CANCELLED_TOTAL, "was" => self.was.to_owned()).increment(1);
        tracing::info!(job_id = %self.job_id, was = self.was, "Job cancelled.");
    }
}

/// An operator replayed `count` quarantined jobs (`how`: `one`, `bulk`).
#[derive(Debug)]
pub struct JobsReplayed {
    pub count: u64,
    pub how: &'static str,
}

impl JobsReplayed {
    pub fn emit(self) {
        metrics::counter!(pm::REPLAYED_TOTAL, "how" => self.how).increment(self.count);
        tracing::info!(count = self.count, how = self.how, "Quarantined jobs replayed.");
    }
}

/// A kind's outside service refused an attempt for its quota (429): the kind pauses for
/// `pause` and its limits are held to `factor`, in every processor.
#[derive(Debug)]
pub struct KindThrottled<'a> {
    pub kind: &'a str,
    /// The kind as a metric label (bounded: configured kinds only).
    pub label: &'a str,
    pub pause: Duration,
    pub factor: Option<f64>,
}

impl KindThrottled<'_> {
    pub fn emit(self) {
        metrics::counter!(pm::THROTTLED_TOTAL, "kind" => self.label.to_owned()).increment(1);
        tracing::info!(
            kind = self.kind,
            pause = ?self.pause,
            factor = self.factor,
            "Kind throttled by its outside service; backing off."
        );
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::Timestamp;
    use rdkafka::message::OwnedMessage;

    use super::*;

    #[test]
    fn a_message_error_says_where_the_message_sits_and_keeps_its_cause() {
        let message = OwnedMessage::new(
            None,
            None,
            "jobfold.job-events".into(),
            Timestamp::NotAvailable,
            3,
            42,
            None,
        );
        let error = MessageError::at(&message, anyhow::anyhow!("connection refused"));
        assert_eq!(
            error.at,
            Coordinates { topic: "jobfold.job-events".into(), partition: 3, offset: 42 }
        );
        assert_eq!(error.to_string(), "message jobfold.job-events/3@42: connection refused");
        let cause = std::error::Error::source(&error).expect("the cause is its source");
        assert_eq!(cause.to_string(), "connection refused");
    }

    #[test]
    fn a_consumer_asks_past_errors_at_once_and_paces_only_a_long_run_of_them() {
        let mut backoff = ErrorBackoff::default();
        let waits: Vec<Duration> = (0..120).map(|_| backoff.after_error()).collect();
        assert!(waits[..100].iter().all(Duration::is_zero), "{waits:?}");
        assert_eq!(waits[100], Duration::from_millis(10));
        assert_eq!(waits[101], Duration::from_millis(20));
        assert!(waits.windows(2).all(|w| w[1] >= w[0]), "{waits:?}");
        assert_eq!(waits[119], Duration::from_secs(1), "at most 1 s: {waits:?}");
        backoff.reset();
        assert_eq!(backoff.after_error(), Duration::ZERO);
    }
}
