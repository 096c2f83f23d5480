//! The handler API of jobfold: what users implement to run a kind of job, with no server,
//! broker or database client in its dependencies (`Handler::commit`, which is given a
//! Postgres connection, comes with the `postgres` feature). A processor runs these handlers:
//! `jobfold_processor::Processor::builder(config).handler("kind", MyHandler)`.
//!
//! A handler runs in two steps. [`Handler::run`] does the slow work outside any transaction
//! and returns an output or a classified error; it receives a cancellation token that fires
//! when the lease is lost (a heartbeat found another generation) or on shutdown.
//! `Handler::commit` writes the business result inside the completion transaction, after
//! the generation check: a fenced (zombie) worker never reaches it, and the write commits
//! together with the job's state and its event — or not at all.
//!
//! Side effects outside Postgres (payments, e-mail) are not covered by that commit: pass
//! [`JobContext::idempotency_key`] to the outside system, so a repeated run is recognised
//! there.
//!
//! A processor runs several kinds: [`Handlers`] holds one handler per kind, through the
//! object-safe [`ErasedHandler`] that every [`Handler`] is. A panic in `run` is caught and
//! ends the attempt as a retryable failure; the heartbeat stops with the run.
//!
//! Handlers in other languages speak the [`protocol`] over HTTP: its messages are here too,
//! for a Rust service that answers the processor's calls.

pub mod protocol;
mod trace;

pub use trace::{TRACEPARENT, TRACESTATE, TraceContext};

use std::future::Future;

use serde_json::Value;
#[cfg(feature = "postgres")]
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How a handler failure is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// Retried with backoff while the budgets last.
    Retryable,
    /// Quarantined at once.
    Permanent,
    /// The input can never succeed: quarantined at once, never retried.
    InvalidInput,
}

impl ErrorClass {
    /// Every class, in the order of the job event schema's `ErrorClass` symbols.
    pub const ALL: [Self; 3] = [Self::Retryable, Self::Permanent, Self::InvalidInput];

    /// The schema's symbol: `RETRYABLE`, `PERMANENT`, `INVALID_INPUT`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Retryable => "RETRYABLE",
            Self::Permanent => "PERMANENT",
            Self::InvalidInput => "INVALID_INPUT",
        }
    }
}

impl std::fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a handler is given.
#[derive(Debug, Clone)]
pub struct JobContext {
    pub job_id: Uuid,
    pub document_id: String,
    pub kind: String,
    pub input_version: i64,
    /// The job's input, as accepted.
    pub input: Value,
    /// Which attempt this is, from 1.
    pub attempt: i32,
    /// The lease generation; every write is fenced by it.
    pub generation: i64,
    /// The W3C trace context to send with outgoing calls (its parent is this run's span),
    /// if the job was accepted with one.
    pub trace: Option<TraceContext>,
    /// When the job's elapsed-time budget ends, if it has one: no attempt starts after it.
    pub deadline: Option<chrono::DateTime<chrono::Utc>>,
    /// The job's attempt budget: `attempt == max_attempts` is the last try.
    pub max_attempts: i32,
    /// How the attempt before this one ended: a handler calling an outside service looks
    /// its [`JobContext::idempotency_key`] up there after [`PreviousOutcome::Ambiguous`]
    /// before acting again.
    pub previous_outcome: PreviousOutcome,
}

/// How the job's previous attempt ended, as the next attempt is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PreviousOutcome {
    /// No attempt before this one failed (the first attempt, or one after a success).
    #[default]
    None,
    /// It failed with a definite answer: whatever it did was refused or undone by its own
    /// handler, which said so.
    Failed,
    /// Its outcome is unknown: it timed out, lost its connection after the request was
    /// sent, panicked, lost its lease or died with its process. Its side effects may have
    /// happened.
    Ambiguous,
}

impl PreviousOutcome {
    /// As the job row stores it (`jobs.previous_outcome`: null, `failed`, `ambiguous`).
    pub fn from_column(column: Option<&str>) -> Self {
        match column {
            Some("ambiguous") => Self::Ambiguous,
            Some(_) => Self::Failed,
            None => Self::None,
        }
    }

    /// The name the protocol and the job row use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Failed => "failed",
            Self::Ambiguous => "ambiguous",
        }
    }
}

impl JobContext {
    /// A key that is the same for every attempt of this job at this input version: give it
    /// to outside systems so they apply a repeated request once.
    pub fn idempotency_key(&self) -> String {
        format!("{}:{}", self.job_id, self.input_version)
    }
}

/// A failed attempt, classed by what should happen next.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{class}: {message}")]
pub struct HandlerError {
    pub class: ErrorClass,
    pub message: String,
    /// For a retryable failure: wait at least this long before the next attempt (an
    /// outside service's `Retry-After`), even when the backoff is shorter.
    pub retry_after: Option<std::time::Duration>,
    /// The outside service refused for its quota (HTTP 429): the attempt is not counted
    /// against the job's budget, and the whole kind backs off (the processor's `quota`).
    pub throttled: bool,
    /// Not now, this job only ([`HandlerError::snooze`]): it runs again after
    /// `retry_after` without spending an attempt, up to the kind's `max_snoozes`.
    pub snoozed: bool,
    /// Whether the attempt's side effects happened is not known ([`HandlerError::ambiguous`]):
    /// the next attempt is told so ([`PreviousOutcome::Ambiguous`]).
    pub ambiguous: bool,
}

impl HandlerError {
    /// May succeed later: retried with backoff while the budgets last.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Retryable,
            message: message.into(),
            retry_after: None,
            throttled: false,
            snoozed: false,
            ambiguous: false,
        }
    }

    /// Will not succeed: quarantined at once.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Permanent,
            message: message.into(),
            retry_after: None,
            throttled: false,
            snoozed: false,
            ambiguous: false,
        }
    }

    /// Refused for the outside service's quota (HTTP 429): retried without spending an
    /// attempt of the job's budget (its time budget still runs), and every processor holds
    /// the kind back — it waits `retry_after` (else the kind's `retry_base`) and its rate
    /// limits halve, growing back over a minute.
    pub fn throttled(message: impl Into<String>) -> Self {
        Self { throttled: true, ..Self::retryable(message) }
    }

    /// Defers this job alone (an outside service's `503` with `Retry-After`, a resource
    /// not ready yet): it runs again after `delay` without spending an attempt and without
    /// holding back the kind. Bounded: `delay` is cut to the kind's `max_retry_after`, a job
    /// snoozed more than `max_snoozes` times spends an attempt each further time, and the
    /// job's deadline still holds.
    pub fn snooze(message: impl Into<String>, delay: std::time::Duration) -> Self {
        Self { snoozed: true, retry_after: Some(delay), ..Self::retryable(message) }
    }

    /// The attempt may have had its effects (a call timed out or lost its connection after
    /// the request was sent): the next attempt's [`JobContext::previous_outcome`] is
    /// [`PreviousOutcome::Ambiguous`], so it can reconcile first.
    #[must_use]
    pub fn ambiguous(mut self) -> Self {
        self.ambiguous = true;
        self
    }

    /// The next attempt waits at least `delay` (the backoff, if longer, wins); cut to the
    /// kind's `max_retry_after`.
    #[must_use]
    pub fn retry_after(mut self, delay: std::time::Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// The input itself is wrong: quarantined at once, never retried.
    pub fn invalid_input(message: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::InvalidInput,
            message: message.into(),
            retry_after: None,
            throttled: false,
            snoozed: false,
            ambiguous: false,
        }
    }
}

/// The text of a panic's payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// What the business write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Committed {
    /// Written.
    Applied,
    /// Not written: the business output already holds this newer input version. The job
    /// ends superseded.
    Stale { newer_version: i64 },
}

/// A kind of job. Implementations are shared by every worker task: `&self` only.
pub trait Handler: Send + Sync + 'static {
    /// Does the work, outside any transaction. Stop early when `cancel` fires: the lease is
    /// gone and nothing this attempt returns will be committed.
    fn run(
        &self,
        job: &JobContext,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<Value, HandlerError>> + Send;

    /// What a job of this input costs against its kind's `cost_per_minute` quota (a model's
    /// tokens, say), taken before its attempt starts. Only asked for kinds with that limit;
    /// a cost above the limit's minute counts as the whole minute. The default: 1.
    fn cost(&self, input: &Value) -> u64 {
        let _ = input;
        1
    }

    /// Writes the business result in the completion transaction (already fenced by the
    /// generation check). The default writes nothing: the result is stored in the job row (`jobs.result`).
    #[cfg(feature = "postgres")]
    fn commit(
        &self,
        tx: &mut PgConnection,
        job: &JobContext,
        output: &Value,
    ) -> impl Future<Output = Result<Committed, sqlx::Error>> + Send {
        let _ = (tx, job, output);
        async { Ok(Committed::Applied) }
    }
}

/// A boxed future, as [`ErasedHandler`] returns.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The object-safe form of [`Handler`], so that handlers of different kinds sit in one
/// [`Handlers`] registry. Every [`Handler`] is one; implement [`Handler`], not this.
pub trait ErasedHandler: Send + Sync + 'static {
    /// [`Handler::run`], boxed.
    fn run_boxed<'a>(
        &'a self,
        job: &'a JobContext,
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<Value, HandlerError>>;

    /// [`Handler::cost`].
    fn cost_of(&self, input: &Value) -> u64;

    /// [`Handler::commit`], boxed.
    #[cfg(feature = "postgres")]
    fn commit_boxed<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        job: &'a JobContext,
        output: &'a Value,
    ) -> BoxFuture<'a, Result<Committed, sqlx::Error>>;
}

impl<H: Handler> ErasedHandler for H {
    fn run_boxed<'a>(
        &'a self,
        job: &'a JobContext,
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<Value, HandlerError>> {
        Box::pin(self.run(job, cancel))
    }

    fn cost_of(&self, input: &Value) -> u64 {
        self.cost(input)
    }

    #[cfg(feature = "postgres")]
    fn commit_boxed<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        job: &'a JobContext,
        output: &'a Value,
    ) -> BoxFuture<'a, Result<Committed, sqlx::Error>> {
        Box::pin(self.commit(tx, job, output))
    }
}

/// The handlers a processor runs, by job kind. Cheap to clone.
///
/// ```
/// # use jobfold_handler::{Handler, HandlerError, Handlers, JobContext};
/// # use tokio_util::sync::CancellationToken;
/// struct Render;
///
/// impl Handler for Render {
///     async fn run(&self, job: &JobContext, _: CancellationToken) -> Result<serde_json::Value, HandlerError> {
///         Ok(job.input.clone())
///     }
/// }
///
/// let handlers = Handlers::new().with("render", Render);
/// assert!(handlers.get("render").is_some());
/// ```
#[derive(Clone, Default)]
pub struct Handlers {
    by_kind: std::collections::BTreeMap<String, std::sync::Arc<dyn ErasedHandler>>,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.by_kind.keys()).finish()
    }
}

impl Handlers {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `handler` for jobs of `kind`; a later registration of the same kind
    /// replaces it.
    #[must_use]
    pub fn with(mut self, kind: impl Into<String>, handler: impl Handler) -> Self {
        self.by_kind.insert(kind.into(), std::sync::Arc::new(handler));
        self
    }

    /// These handlers and `other`'s; `other`'s win for a kind both have.
    #[must_use]
    pub fn merged(mut self, other: Self) -> Self {
        self.by_kind.extend(other.by_kind);
        self
    }

    /// The handler of `kind`, if one is registered.
    pub fn get(&self, kind: &str) -> Option<&std::sync::Arc<dyn ErasedHandler>> {
        self.by_kind.get(kind)
    }

    /// The registered kinds, in order.
    pub fn kinds(&self) -> impl Iterator<Item = &str> {
        self.by_kind.keys().map(String::as_str)
    }

    /// `kind` as a metric label: itself if registered here, else [`OTHER_KIND`] — so the
    /// label's values are bounded by the handlers, whatever kinds callers send.
    pub fn label(&self, kind: &str) -> String {
        if self.by_kind.contains_key(kind) { kind.to_owned() } else { OTHER_KIND.to_owned() }
    }
}

/// The `kind` label of every kind without a handler in this process.
pub const OTHER_KIND: &str = "other";

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;

    impl Handler for Nothing {
        async fn run(
            &self,
            _job: &JobContext,
            _cancel: CancellationToken,
        ) -> Result<serde_json::Value, HandlerError> {
            Ok(serde_json::Value::Null)
        }
    }

    #[test]
    fn only_kinds_with_a_handler_become_label_values() {
        let handlers = Handlers::new().with("index-document", Nothing);
        assert_eq!(handlers.label("index-document"), "index-document");
        for sent in ["index-documnet", "", &"x".repeat(500)] {
            assert_eq!(handlers.label(sent), OTHER_KIND, "{sent:?}");
        }
    }
}
