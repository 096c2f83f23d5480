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
    /// The first error of its second ([`ErrorBackoff::first_of_its_second`]): logged as a
    /// warning; the rest of that second's at debug level (all are counted), so an outage's
    /// hundreds of errors cost a few lines.
    pub first: bool,
}

impl ConsumerFailed<'_> {
    pub fn emit(self) {
        if self.first {
            tracing::warn!(
                error = %self.error,
                stage = self.stage,
                backoff = ?self.backoff,
                "Consumer error; asking again after the backoff."
            );
        } else {
            tracing::debug!(
                error = %self.error,
                stage = self.stage,
                backoff = ?self.backoff,
                "Consumer error; asking again after the backoff."
            );
        }
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
/// as consumer errors, queued with the messages: a broker down for a few seconds leaves
/// hundreds of them ahead of the messages fetched once it is back. A wait after each error
/// holds every message queued behind them (paced up to 1 s an error, a 15 s outage held a
/// processor's partitions for minutes). So errors are asked past at once up to a budget a
/// second ([`ErrorBackoff::PER_SECOND`]); one past it waits for the rest of its second. A
/// backlog drains at the budget's pace (300 errors: 2 s), and a call that fails at once for
/// ever is asked at most that many times a second.
#[derive(Debug, Default)]
pub struct ErrorBackoff {
    /// When the current second of errors began, and the errors in it so far.
    second: Option<(std::time::Instant, u32)>,
}

impl ErrorBackoff {
    /// Errors asked past at once in a second.
    pub const PER_SECOND: u32 = 100;
    const SECOND: Duration = Duration::from_secs(1);

    /// The wait after the next error.
    pub fn after_error(&mut self) -> Duration {
        self.after_error_at(std::time::Instant::now())
    }

    /// The wait after an error at `now`.
    fn after_error_at(&mut self, now: std::time::Instant) -> Duration {
        match &mut self.second {
            Some((began, count)) if now.duration_since(*began) < Self::SECOND => {
                *count += 1;
                if *count > Self::PER_SECOND {
                    Self::SECOND - now.duration_since(*began)
                } else {
                    Duration::ZERO
                }
            }
            _ => {
                self.second = Some((now, 1));
                Duration::ZERO
            }
        }
    }

    /// Whether the last error was the first of its second.
    pub fn first_of_its_second(&self) -> bool {
        matches!(self.second, Some((_, 1)))
    }

    /// A message arrived: librdkafka is working again, the next error starts a second.
    pub fn reset(&mut self) {
        self.second = None;
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

    /// An outage's backlog of errors, all queued at once ahead of the messages, is asked
    /// past at the budget's pace: 300 of them wait 2 s in all, not minutes.
    #[test]
    fn a_backlog_of_errors_waits_a_second_per_budget_not_one_per_error() {
        let mut errors = ErrorBackoff::default();
        let mut now = std::time::Instant::now();
        let mut waited = Duration::ZERO;
        for _ in 0..300 {
            let wait = errors.after_error_at(now);
            waited += wait;
            now += wait;
        }
        assert_eq!(waited, Duration::from_secs(2));
    }

    /// A call that fails at once, for ever, is asked at most the budget's times a second.
    #[test]
    fn errors_that_never_stop_are_asked_past_at_the_budgets_pace() {
        let mut errors = ErrorBackoff::default();
        let start = std::time::Instant::now();
        let (mut now, mut asked) = (start, 0u32);
        while now < start + Duration::from_secs(10) {
            asked += 1;
            now += errors.after_error_at(now) + Duration::from_micros(1);
        }
        assert!(asked <= 10 * ErrorBackoff::PER_SECOND + 10, "{asked} in 10 s");
        assert!(asked >= 10 * ErrorBackoff::PER_SECOND, "{asked} in 10 s");
    }

    /// The first error of each second is the one logged as a warning; a message starts
    /// the count again.
    #[test]
    fn the_first_error_of_each_second_is_told() {
        let mut errors = ErrorBackoff::default();
        let now = std::time::Instant::now();
        errors.after_error_at(now);
        assert!(errors.first_of_its_second());
        errors.after_error_at(now + Duration::from_millis(10));
        assert!(!errors.first_of_its_second());
        errors.after_error_at(now + Duration::from_millis(1_100));
        assert!(errors.first_of_its_second());
        errors.reset();
        errors.after_error_at(now + Duration::from_millis(1_200));
        assert!(errors.first_of_its_second());
    }

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
}
