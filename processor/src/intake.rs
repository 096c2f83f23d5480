//! The intake consumer: upstream producers' `JobRequest`s on `jobfold.job-requests` become
//! accepted jobs.
//!
//! Invariant: a request's offset is stored only after its accept transaction committed (or
//! its dead letter row did), with `enable.auto.offset.store=false`; messages are handled in
//! offset order, one partition at a time per consumer. A crash before the store repeats
//! the request, and the request id — the job's idempotency key `request:<id>` — makes the
//! repeat return the job already accepted.
//!
//! Bad input loses nothing and blocks nothing: a message that cannot decode, or a request
//! that is invalid — a bad field, an input over the limit, a U+0000 Postgres cannot store,
//! any data error Postgres raises about the request's row (SQLSTATE classes 22 and 23) — is
//! stored in `dead_letters` with its raw key and value, and the partition moves on. Only
//! failures that may heal (registry or database unreachable) are retried with backoff,
//! without moving on.

use std::time::Duration;

use crate::dead_letter::Raw;
use crate::internal_events::{ConsumerFailed, ErrorBackoff, MessageError, MessageRetried};
use crate::metrics as m;
use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_common::config::Config;
use jobfold_schemas::event::{TRACEPARENT, TRACESTATE, TraceContext};
use jobfold_schemas::{Decoder, JobRequest};
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// What became of one message.
#[derive(Debug, PartialEq, Eq)]
pub enum Handled {
    Accepted,
    /// The request id was accepted before.
    Duplicate,
    DeadLettered,
}

/// A failure that may heal: the message is tried again, the offset not stored.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Transient(String);

/// The intake: consumer, decoder, acceptor.
pub struct Intake {
    consumer: StreamConsumer,
    decoder: Decoder<JobRequest>,
    acceptor: Acceptor,
    pool: PgPool,
    group: String,
}

impl std::fmt::Debug for Intake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Intake").field("group", &self.group).finish_non_exhaustive()
    }
}

impl Intake {
    /// Subscribes to the requests topic in the configured group.
    ///
    /// # Errors
    /// librdkafka refused the configuration or the subscription.
    pub fn new(
        config: &Config,
        decoder: Decoder<JobRequest>,
        acceptor: Acceptor,
        pool: PgPool,
    ) -> anyhow::Result<Self> {
        let consumer: StreamConsumer = config
            .kafka_client_for(
                jobfold_common::config::KafkaRole::Consumer,
                jobfold_common::kafka::CONSUMER_DEFAULTS,
            )
            .set("group.id", &config.intake.group)
            .create()?;
        consumer.subscribe(&[&config.topics.requests])?;
        Ok(Self { consumer, decoder, acceptor, pool, group: config.intake.group.clone() })
    }

    /// Consumes until `shutdown`, then commits the stored offsets.
    ///
    /// # Errors
    /// The consumer failed in a way that retrying cannot fix.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let mut errors = ErrorBackoff::default();
        loop {
            let message = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                message = self.consumer.recv() => message,
            };
            let message = match message {
                Ok(message) => {
                    errors.reset();
                    message
                }
                Err(e) => {
                    let backoff = errors.after_error();
                    ConsumerFailed { stage: "intake", error: &e, backoff }.emit();
                    // A fatal error leaves the consumer dead: stop, to be restarted.
                    if e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::Fatal) {
                        anyhow::bail!("the intake consumer hit a fatal error: {e}");
                    }
                    if !backoff.is_zero() {
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            () = tokio::time::sleep(backoff) => {}
                        }
                    }
                    continue;
                }
            };
            let mut backoff = RETRY_MIN;
            loop {
                match self.handle(&message).await {
                    Ok(handled) => {
                        tracing::debug!(
                            ?handled,
                            offset = message.offset(),
                            "Intake message handled."
                        );
                        self.consumer.store_offset_from_message(&message)?;
                        break;
                    }
                    Err(e) => {
                        let error = MessageError::at(&message, e.into());
                        MessageRetried { error: &error, stage: "intake", backoff }.emit();
                        tokio::select! {
                            biased;
                            _ = shutdown.cancelled() => return self.commit(),
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(RETRY_MAX);
                    }
                }
            }
        }
        self.commit()
    }

    /// Commits the stored offsets at shutdown. A failure (the group moved on: an
    /// `IllegalGeneration` after a rebalance) is logged, not returned: the requests after the
    /// last committed offset are read again by the partitions' next owner and skipped by
    /// their request ids, so it must not turn a clean stop into a failed one.
    fn commit(&self) -> anyhow::Result<()> {
        if let Err(e) = jobfold_common::kafka::commit_stored(&self.consumer) {
            tracing::warn!(error = %e, "Committing intake offsets on shutdown failed; they are read again.");
        }
        Ok(())
    }

    /// Accepts one message's request, or dead-letters it.
    ///
    /// # Errors
    /// [`Transient`]: the registry or the database could not be reached.
    pub async fn handle(&self, message: &BorrowedMessage<'_>) -> Result<Handled, Transient> {
        let Some(payload) = message.payload() else {
            return self.dead_letter(message, "message has no value").await;
        };
        let request = match self.decoder.decode(payload).await {
            Ok(request) => request,
            Err(e) if e.is_retryable() => return Err(Transient(e.to_string())),
            Err(e) => return self.dead_letter(message, &format!("undecodable: {e}")).await,
        };
        let input = match serde_json::from_str(&request.input) {
            Ok(input) => input,
            Err(e) => {
                return self
                    .dead_letter(message, &format!("invalid request: input is not JSON: {e}"))
                    .await;
            }
        };
        let job = NewJob {
            document_id: request.document_id,
            kind: request.job_kind,
            input_version: request.input_version,
            input,
            // Do not change: the request id is the intake's dedupe key.
            idempotency_key: Some(format!("request:{}", request.request_id)),
            // The request's own trace context, else the message's W3C headers.
            trace: request
                .trace
                .and_then(|t| TraceContext::from_headers(&t.traceparent, t.tracestate.as_deref()))
                .or_else(|| header_trace(message)),
            run_at: request.run_at,
        };
        match self.acceptor.accept(&self.pool, &job).await {
            Ok(accepted) if accepted.created => Ok(Handled::Accepted),
            Ok(_) => {
                metrics::counter!(m::INTAKE_DUPLICATES_TOTAL).increment(1);
                Ok(Handled::Duplicate)
            }
            // The request's own fault (a bad field, too large, data Postgres refuses, a
            // reused key): dead-lettered, and the partition moves on.
            Err(e) if e.is_request_fault() => {
                self.dead_letter(message, &format!("invalid request: {e}")).await
            }
            Err(e) => Err(Transient(e.to_string())),
        }
    }

    async fn dead_letter(
        &self,
        message: &BorrowedMessage<'_>,
        error: &str,
    ) -> Result<Handled, Transient> {
        crate::dead_letter::store(&self.pool, &self.group, Raw::of(message), error)
            .await
            .map_err(|e| Transient(format!("storing the dead letter: {e}")))?;
        Ok(Handled::DeadLettered)
    }
}

/// The W3C trace context in the message's `traceparent` / `tracestate` headers, if valid.
fn header_trace(message: &BorrowedMessage<'_>) -> Option<TraceContext> {
    let headers = message.headers()?;
    let text = |name: &str| {
        headers
            .iter()
            .find(|h| h.key == name)
            .and_then(|h| h.value)
            .and_then(|v| std::str::from_utf8(v).ok())
    };
    TraceContext::from_headers(text(TRACEPARENT)?, text(TRACESTATE))
}
