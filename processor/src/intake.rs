//! The intake consumer: upstream producers' `JobRequest`s on `jobfold.job-requests` become
//! accepted jobs.
//!
//! Requests are accepted in batches: what the consumer has fetched when a batch starts, up
//! to `intake.max_batch`, in one transaction (one multi-row insert; the request ids'
//! dedupe by `ON CONFLICT`), dead letters included. A lone request is not held back to
//! fill a batch; under load the batches grow by themselves.
//!
//! Invariant: a request's offset is stored only after the transaction that accepted it (or
//! stored its dead letter) committed, with `enable.auto.offset.store=false`; a partition's
//! messages are accepted in offset order. A crash before the store repeats the request,
//! and the request id — the job's idempotency key `request:<id>` — makes the repeat return
//! the job already accepted.
//!
//! Bad input loses nothing and blocks nothing: a message that cannot decode, or a request
//! that is invalid — a bad field, an input over the limit, an unknown kind, a reused request
//! id, a U+0000 Postgres cannot store — is stored in `dead_letters` with its raw key and
//! value, its batch accepted without it, and the partition moves on. A data error Postgres
//! raises about one row (SQLSTATE classes 22 and 23) fails the multi-row insert as a
//! whole: that batch is then accepted one request at a time, so the bad one is
//! dead-lettered alone. Only failures that may heal (registry or database unreachable) are
//! retried with backoff, without moving on.

use crate::dead_letter::Raw;
use crate::internal_events::{ConsumerFailed, ErrorBackoff, MessageError, MessageRetried};
use crate::metrics as m;
use futures::FutureExt;
use jobfold_common::accept::{AcceptError, Acceptor, NewJob};
use jobfold_common::config::Config;
use jobfold_schemas::event::{TRACEPARENT, TRACESTATE, TraceContext};
use jobfold_schemas::{Decoder, JobRequest};
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// What became of one message.
#[derive(Debug, PartialEq, Eq)]
pub enum Handled {
    Accepted,
    /// The request id was accepted before.
    Duplicate,
    DeadLettered,
}

/// What became of a batch's messages.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    pub accepted: usize,
    /// Request ids accepted before.
    pub duplicates: usize,
    pub dead_lettered: usize,
}

impl Counted {
    fn add(&mut self, handled: Handled) {
        match handled {
            Handled::Accepted => self.accepted += 1,
            Handled::Duplicate => self.duplicates += 1,
            Handled::DeadLettered => self.dead_lettered += 1,
        }
    }
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
    max_batch: usize,
    /// `processor.group_instance_id`, named should another process take it over.
    instance: Option<String>,
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
        // Its read-ahead bounded as the processors' is: by librdkafka's defaults a backlog of
        // requests would be fetched whole while a batch waits for Postgres.
        let mut client = jobfold_common::kafka::consumer_client(config);
        client.set("group.id", &config.intake.group);
        if let Some(id) = &config.processor.group_instance_id {
            client.set("group.instance.id", id);
        }
        let consumer: StreamConsumer = client.create()?;
        consumer.subscribe(&[&config.topics.requests])?;
        Ok(Self {
            consumer,
            decoder,
            acceptor,
            pool,
            group: config.intake.group.clone(),
            max_batch: config.intake.max_batch,
            instance: config.processor.group_instance_id.clone(),
        })
    }

    /// Consumes until `shutdown`, then commits the stored offsets.
    ///
    /// # Errors
    /// The consumer failed in a way that retrying cannot fix.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let mut errors = ErrorBackoff::default();
        let mut batch = Vec::with_capacity(self.max_batch);
        loop {
            let first = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                message = self.consumer.recv() => message,
            };
            // Then whatever else the consumer holds already, without waiting for more.
            let mut failed = None;
            match first {
                Ok(message) => batch.push(message),
                Err(e) => failed = Some(e),
            }
            while failed.is_none() && batch.len() < self.max_batch {
                match self.consumer.recv().now_or_never() {
                    Some(Ok(message)) => batch.push(message),
                    Some(Err(e)) => failed = Some(e),
                    None => break,
                }
            }
            if !batch.is_empty() {
                errors.reset();
                if !self.handle_until_done(&batch, &shutdown).await {
                    return self.commit();
                }
                batch.clear();
            }
            if let Some(e) = failed {
                let backoff = errors.after_error();
                ConsumerFailed {
                    stage: "intake",
                    error: &e,
                    backoff,
                    first: errors.first_of_its_second(),
                }
                .emit();
                // A fatal error leaves the consumer dead: stop, to be restarted.
                let fatal = jobfold_common::kafka::fatal_error(
                    self.consumer.client(),
                    &e,
                    self.instance.as_deref(),
                );
                if let Some(why) = fatal {
                    anyhow::bail!("the intake consumer hit a fatal error: {why}");
                }
                if !backoff.is_zero() {
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        () = tokio::time::sleep(backoff) => {}
                    }
                }
            }
        }
        self.commit()
    }

    /// Accepts `batch` in one transaction, tried again after [`crate::retry::Again`]'s
    /// pauses while it fails, then stores its offsets; false if `shutdown` came first.
    async fn handle_until_done(
        &self,
        batch: &[BorrowedMessage<'_>],
        shutdown: &CancellationToken,
    ) -> bool {
        let mut again = crate::retry::Again::new();
        loop {
            match self.handle_batch(batch).await {
                Ok(handled) => {
                    tracing::debug!(messages = batch.len(), ?handled, "Intake batch handled.");
                    metrics::histogram!(m::TRANSACTION_JOBS, "transaction" => "intake")
                        .record(batch.len() as f64);
                    jobfold_common::failpoint::hit(
                        jobfold_common::failpoint::Point::IntakeAfterCommitBeforeOffset,
                    );
                    for message in batch {
                        // Refused for a partition a rebalance took while the batch was
                        // gathered: its next owner reads the request again and finds it
                        // accepted by its request id.
                        if let Err(e) = self.consumer.store_offset_from_message(message) {
                            tracing::debug!(error = %e, partition = message.partition(), offset = message.offset(), "Storing an intake offset was refused.");
                        }
                    }
                    return true;
                }
                Err((message, e)) => {
                    let error = MessageError::at(&batch[message], e.into());
                    let backoff = again.next();
                    MessageRetried { error: &error, stage: "intake", backoff }.emit();
                    if !again.pause(shutdown).await {
                        return false;
                    }
                }
            }
        }
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

    /// Accepts a batch of messages' requests in one transaction, dead-lettering those that
    /// are bad; what became of each, counted.
    ///
    /// # Errors
    /// [`Transient`], with the index of the message it is about (the first, for the
    /// batch's transaction): the registry or the database could not be reached.
    pub async fn handle_batch(
        &self,
        messages: &[BorrowedMessage<'_>],
    ) -> Result<Counted, (usize, Transient)> {
        let (mut jobs, mut of) = (Vec::with_capacity(messages.len()), Vec::new());
        let mut rejected = Vec::new();
        for (i, message) in messages.iter().enumerate() {
            match self.request(message).await.map_err(|e| (i, e))? {
                Ok(job) => {
                    jobs.push(job);
                    of.push(i);
                }
                Err(why) => rejected.push((i, why)),
            }
        }
        let batch = async {
            let mut tx = self.pool.begin_with(jobfold_common::accept::BEGIN_BATCH).await?;
            let each = self.acceptor.accept_each_in(&mut tx, &jobs).await?;
            Ok::<_, AcceptError>((tx, each))
        };
        let (mut tx, each) = match batch.await {
            Ok(done) => done,
            // Data Postgres refused in some row, or a request id another transaction holds:
            // one at a time finds which, and only that one waits.
            Err(e) if e.alone_helps() => {
                tracing::debug!(error = %e, messages = messages.len(), "An intake batch failed as a whole; its requests are accepted one by one.");
                let mut counted = Counted::default();
                for (i, message) in messages.iter().enumerate() {
                    counted.add(self.handle(message).await.map_err(|e| (i, e))?);
                }
                return Ok(counted);
            }
            Err(e) => return Err((0, Transient(e.to_string()))),
        };
        let mut counted = Counted::default();
        for (i, answer) in of.into_iter().zip(each) {
            match answer {
                Ok(accepted) if accepted.created => counted.accepted += 1,
                Ok(_) => counted.duplicates += 1,
                Err(e) => rejected.push((i, format!("invalid request: {e}"))),
            }
        }
        let transient = |e: sqlx::Error| (0, Transient(format!("storing the dead letters: {e}")));
        for (i, why) in &rejected {
            crate::dead_letter::insert(&mut *tx, &self.group, Raw::of(&messages[*i]), why)
                .await
                .map_err(transient)?;
        }
        tx.commit().await.map_err(|e| (0, Transient(e.to_string())))?;
        for (i, why) in &rejected {
            crate::dead_letter::stored(&self.group, Raw::of(&messages[*i]), why);
        }
        counted.dead_lettered = rejected.len();
        metrics::counter!(m::INTAKE_DUPLICATES_TOTAL).increment(counted.duplicates as u64);
        Ok(counted)
    }

    /// The job a message asks for, or why it cannot be one (to dead-letter it).
    ///
    /// # Errors
    /// [`Transient`]: the registry could not be reached.
    async fn request(
        &self,
        message: &BorrowedMessage<'_>,
    ) -> Result<Result<NewJob, String>, Transient> {
        let Some(payload) = message.payload() else {
            return Ok(Err("message has no value".into()));
        };
        let request = match self.decoder.decode(payload).await {
            Ok(request) => request,
            Err(e) if e.is_retryable() => return Err(Transient(e.to_string())),
            Err(e) => return Ok(Err(format!("undecodable: {e}"))),
        };
        let input = match serde_json::from_str(&request.input) {
            Ok(input) => input,
            Err(e) => return Ok(Err(format!("invalid request: input is not JSON: {e}"))),
        };
        Ok(Ok(NewJob {
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
        }))
    }

    /// Accepts one message's request in a transaction of its own, or dead-letters it.
    ///
    /// # Errors
    /// [`Transient`]: the registry or the database could not be reached.
    pub async fn handle(&self, message: &BorrowedMessage<'_>) -> Result<Handled, Transient> {
        let job = match self.request(message).await? {
            Ok(job) => job,
            Err(why) => return self.dead_letter(message, &why).await,
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
