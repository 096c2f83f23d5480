//! The job state machine: [`fold`] and [`JobState::apply`], pure functions of the event log.
//!
//! This is the one definition of what a job's events mean. [`Status::after`] is its table of
//! which event may follow which status: the processor moves each job by it as it appends the
//! job's events (refusing, unwritten, an event it does not allow), `apply` folds with it and
//! checks the rest (generations, attempts, budgets), replay folds the log with `apply`, and
//! the property tests check its invariants. Nothing here panics on bad input: an event that cannot follow the state is an
//! [`FoldError`] naming both.
//!
//! ```text
//! queued ──JobLeased──▶ leased ──JobSucceeded──▶ succeeded
//! queued | retry_wait | leased ──JobSucceeded with its own lease (run in the lease tx)──▶ succeeded
//!   ▲                     │ ├─JobFailed + JobRetryScheduled──▶ retry_wait ──JobLeased──▶ leased
//!   │                     │ ├─JobFailed + JobQuarantined────▶ quarantined
//!   │                     │ └─JobLeased (lease expired: generation + 1)──▶ leased
//!   └──ReplayRequested───── quarantined
//! queued | leased | retry_wait | quarantined ──JobSuperseded──▶ superseded
//! queued | leased | retry_wait | quarantined ──JobCancelled───▶ cancelled
//! queued | retry_wait ──JobQuarantined (budget spent before a lease)──▶ quarantined
//! leased ──JobQuarantined (budget spent, the last attempt's lease ran out)──▶ quarantined
//! RetryDue: a dispatch marker in queued, leased or retry_wait; it changes no state.
//! ```
//!
//! Invariants the tests check: the generation never decreases; a job never leaves
//! `succeeded`; the attempt never passes `max_attempts`; folding a prefix and then the rest
//! equals folding the whole log.

use std::fmt;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::event::{ErrorClass, JobEvent, Payload};

/// Where a job stands; the `job_state` enum of the `jobs` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Status {
    Queued,
    Leased,
    RetryWait,
    Succeeded,
    Quarantined,
    Superseded,
    Cancelled,
}

impl Status {
    /// Every status, in the `job_state` enum's order.
    pub const ALL: [Status; 7] = [
        Self::Queued,
        Self::Leased,
        Self::RetryWait,
        Self::Succeeded,
        Self::Quarantined,
        Self::Superseded,
        Self::Cancelled,
    ];

    /// The `job_state` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Leased => "leased",
            Self::RetryWait => "retry_wait",
            Self::Succeeded => "succeeded",
            Self::Quarantined => "quarantined",
            Self::Superseded => "superseded",
            Self::Cancelled => "cancelled",
        }
    }

    /// Final states: no event follows them (quarantine is not final: it can be replayed).
    pub fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Superseded | Self::Cancelled)
    }

    /// The status after an event with `payload`, or, if the event cannot follow this status,
    /// the statuses it may follow. The one table of which event may follow which status:
    /// [`JobState::apply`] folds with it, and the processor moves its jobs with it as it
    /// appends their events. `apply` checks the rest (generations, attempts, budgets).
    ///
    /// # Errors
    /// The statuses the event may follow (none for `JobRequested`, which only starts a job).
    pub fn after(self, payload: &Payload) -> Result<Status, &'static [Status]> {
        use Status::{Cancelled, Leased, Quarantined, Queued, RetryWait, Succeeded, Superseded};
        const DISPATCHABLE: &[Status] = &[Queued, Leased, RetryWait];
        const LEASED: &[Status] = &[Leased];
        const OPEN: &[Status] = &[Queued, Leased, RetryWait, Quarantined];
        let (allowed, next): (&'static [Status], Option<Status>) = match payload {
            Payload::JobRequested(_) => (&[], None),
            Payload::JobLeased(_) => (DISPATCHABLE, Some(Leased)),
            // A success that took its own lease (its run ended in its lease transaction)
            // follows what a JobLeased may follow.
            Payload::JobSucceeded(s) if s.lease.is_some() => (DISPATCHABLE, Some(Succeeded)),
            Payload::JobSucceeded(_) => (LEASED, Some(Succeeded)),
            // The lease stays until the decision (retry or quarantine) that follows.
            Payload::JobFailed(_) => (LEASED, None),
            Payload::JobRetryScheduled(_) => (LEASED, Some(RetryWait)),
            // A dispatch marker: it changes no status.
            Payload::RetryDue(_) => (DISPATCHABLE, None),
            Payload::JobQuarantined(_) => (DISPATCHABLE, Some(Quarantined)),
            Payload::ReplayRequested(_) => (&[Quarantined], Some(Queued)),
            Payload::JobSuperseded(_) => (OPEN, Some(Superseded)),
            Payload::JobCancelled(_) => (OPEN, Some(Cancelled)),
        };
        if allowed.contains(&self) { Ok(next.unwrap_or(self)) } else { Err(allowed) }
    }
}

/// A `job_state` label that names no [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a job state")]
pub struct UnknownStatus(pub String);

impl std::str::FromStr for Status {
    type Err = UnknownStatus;

    fn from_str(label: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|s| s.as_str() == label)
            .ok_or_else(|| UnknownStatus(label.to_owned()))
    }
}

impl TryFrom<String> for Status {
    type Error = UnknownStatus;

    fn try_from(label: String) -> Result<Self, Self::Error> {
        label.parse()
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The lease a worker holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub owner: String,
    pub until: DateTime<Utc>,
    /// The dispatching event the lease serves.
    pub dispatch_event_id: Uuid,
}

/// The last failure recorded for the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub generation: i64,
    pub attempt: i32,
    pub class: ErrorClass,
    pub message: String,
    /// Whether its side effects happened is unknown (`JobFailed.outcome_unknown`).
    pub ambiguous: bool,
}

/// Why a job is quarantined and who must act.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantine {
    pub reason: String,
    pub class: ErrorClass,
    pub owner: String,
    pub at: DateTime<Utc>,
}

/// A job as its events define it: the `jobs` projection row, and a little more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobState {
    pub job_id: Uuid,
    pub document_id: String,
    pub job_kind: String,
    /// The input version the job runs with (a replay may raise it).
    pub input_version: i64,
    /// The input as JSON text.
    pub input: String,
    pub idempotency_key: Option<String>,
    pub status: Status,
    /// Attempts started (leases taken) in the current budget.
    pub attempt: i32,
    pub max_attempts: i32,
    pub deadline: Option<DateTime<Utc>>,
    /// A scheduled job's first due time: no lease before it.
    pub run_at: Option<DateTime<Utc>>,
    /// Lease generation: raised by every lease, never lowered.
    pub generation: i64,
    /// Present exactly while `status` is `Leased`.
    pub lease: Option<Lease>,
    /// When the next attempt is due, while `status` is `RetryWait`.
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub accepted_at: DateTime<Utc>,
    /// When a final state or quarantine was reached.
    pub finished_at: Option<DateTime<Utc>>,
    /// The stream version of the last event applied.
    pub stream_version: i32,
    pub last_failure: Option<Failure>,
    /// How the attempt before the next one ended, as that attempt is told: `None` while no
    /// attempt failed at this input version since its last success, else whether the last
    /// failure's outcome is unknown (`jobs.previous_outcome`: null, `failed`, `ambiguous`).
    /// A replay at the same input version keeps it: the effects of an attempt whose outcome
    /// is unknown may have happened under the same idempotency key.
    pub previous_ambiguous: Option<bool>,
    pub quarantine: Option<Quarantine>,
    /// The result JSON, once succeeded.
    pub result: Option<String>,
    /// For `Superseded`: the newer input version that won.
    pub superseded_by: Option<i64>,
}

/// An event that cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FoldError {
    /// There was no event at all.
    #[error("no events to fold")]
    Empty,
    /// The first event of a stream must be `JobRequested` with stream version 1.
    #[error(
        "job {job_id}: the stream starts with {event} at stream version {stream_version}, not JobRequested at 1"
    )]
    BadStart { job_id: Uuid, event: &'static str, stream_version: i32 },
    /// The event belongs to another job.
    #[error("job {job_id}: event {event_id} belongs to job {other}")]
    WrongJob { job_id: Uuid, event_id: Uuid, other: Uuid },
    /// Stream versions must be gap-free: the next event has the next version.
    #[error("job {job_id}: expected stream version {expected}, event {event_id} has {found}")]
    StreamVersion { job_id: Uuid, event_id: Uuid, expected: i32, found: i32 },
    /// The event is not allowed in the job's state.
    #[error("job {job_id}: {event} cannot follow state {state}: {why}")]
    IllegalTransition { job_id: Uuid, state: Status, event: &'static str, why: String },
}

/// Folds a job's events, in stream order, into its state.
///
/// # Errors
/// [`FoldError`] for an empty log, a bad first event, or an event that cannot follow the
/// state reached before it.
pub fn fold<'a>(events: impl IntoIterator<Item = &'a JobEvent>) -> Result<JobState, FoldError> {
    let mut events = events.into_iter();
    let first = events.next().ok_or(FoldError::Empty)?;
    let mut state = JobState::start(first)?;
    for event in events {
        state.apply(event)?;
    }
    Ok(state)
}

impl JobState {
    /// The state a `JobRequested` event creates.
    ///
    /// # Errors
    /// [`FoldError::BadStart`] if `event` is not `JobRequested` at stream version 1.
    pub fn start(event: &JobEvent) -> Result<Self, FoldError> {
        let Payload::JobRequested(requested) = &event.payload else {
            return Err(FoldError::BadStart {
                job_id: event.job_id,
                event: event.payload.kind(),
                stream_version: event.stream_version,
            });
        };
        if event.stream_version != 1 {
            return Err(FoldError::BadStart {
                job_id: event.job_id,
                event: "JobRequested",
                stream_version: event.stream_version,
            });
        }
        Ok(Self {
            job_id: event.job_id,
            document_id: event.document_id.clone(),
            job_kind: event.job_kind.clone(),
            input_version: event.input_version,
            input: requested.input.clone(),
            idempotency_key: requested.idempotency_key.clone(),
            status: Status::Queued,
            attempt: 0,
            max_attempts: requested.max_attempts,
            deadline: requested.deadline,
            run_at: requested.run_at,
            generation: 0,
            lease: None,
            next_attempt_at: None,
            accepted_at: event.occurred_at,
            finished_at: None,
            stream_version: 1,
            last_failure: None,
            previous_ambiguous: None,
            quarantine: None,
            result: None,
            superseded_by: None,
        })
    }

    /// Applies the next event of the stream.
    ///
    /// On error the state is unchanged.
    ///
    /// # Errors
    /// [`FoldError`] if the event belongs to another job, skips or repeats a stream version,
    /// or is not allowed in the current state.
    pub fn apply(&mut self, event: &JobEvent) -> Result<(), FoldError> {
        if event.job_id != self.job_id {
            return Err(FoldError::WrongJob {
                job_id: self.job_id,
                event_id: event.event_id,
                other: event.job_id,
            });
        }
        if event.stream_version != self.stream_version + 1 {
            return Err(FoldError::StreamVersion {
                job_id: self.job_id,
                event_id: event.event_id,
                expected: self.stream_version + 1,
                found: event.stream_version,
            });
        }
        let mut next = self.clone();
        next.transition(event)?;
        if event.input_version != next.input_version {
            return Err(self.illegal(
                event,
                format!(
                    "the event is for input version {}, the job runs input version {}",
                    event.input_version, next.input_version
                ),
            ));
        }
        next.stream_version = event.stream_version;
        *self = next;
        Ok(())
    }

    /// `apply` by value, for folds written as expressions.
    ///
    /// # Errors
    /// As [`JobState::apply`].
    pub fn applied(mut self, event: &JobEvent) -> Result<Self, FoldError> {
        self.apply(event)?;
        Ok(self)
    }

    fn illegal(&self, event: &JobEvent, why: impl Into<String>) -> FoldError {
        FoldError::IllegalTransition {
            job_id: self.job_id,
            state: self.status,
            event: event.payload.kind(),
            why: why.into(),
        }
    }

    /// The status after `event` ([`Status::after`]), or why it cannot follow this one.
    fn next_status(&self, event: &JobEvent) -> Result<Status, FoldError> {
        if matches!(event.payload, Payload::JobRequested(_)) {
            return Err(self.illegal(event, "a job is requested once, at stream version 1"));
        }
        self.status.after(&event.payload).map_err(|allowed| {
            let names: Vec<&str> = allowed.iter().map(|s| s.as_str()).collect();
            self.illegal(event, format!("allowed only in {}", names.join(", ")))
        })
    }

    /// Requires `generation` to be the current lease's.
    fn require_generation(&self, event: &JobEvent, generation: i64) -> Result<(), FoldError> {
        if generation == self.generation {
            Ok(())
        } else {
            Err(self.illegal(
                event,
                format!(
                    "generation {generation} is not the current generation {}",
                    self.generation
                ),
            ))
        }
    }

    /// Takes the next lease: `generation` and `attempt` one above the current ones, the
    /// attempt within the budget. The status is the caller's to set.
    fn take_lease(
        &mut self,
        event: &JobEvent,
        generation: i64,
        attempt: i32,
    ) -> Result<(), FoldError> {
        if generation != self.generation + 1 {
            return Err(self.illegal(
                event,
                format!("generation {generation} does not follow generation {}", self.generation),
            ));
        }
        if attempt != self.attempt + 1 {
            return Err(self.illegal(
                event,
                format!("attempt {attempt} does not follow attempt {}", self.attempt),
            ));
        }
        if attempt > self.max_attempts {
            return Err(self.illegal(
                event,
                format!("attempt {attempt} exceeds the budget of {} attempts", self.max_attempts),
            ));
        }
        self.generation = generation;
        self.attempt = attempt;
        self.next_attempt_at = None;
        Ok(())
    }

    fn finish(&mut self, status: Status, at: DateTime<Utc>) {
        self.status = status;
        self.lease = None;
        self.next_attempt_at = None;
        self.finished_at = Some(at);
    }

    fn transition(&mut self, event: &JobEvent) -> Result<(), FoldError> {
        use Status::{Cancelled, Leased, Quarantined, Queued, RetryWait, Succeeded, Superseded};
        let at = event.occurred_at;
        let next = self.next_status(event)?;
        match &event.payload {
            Payload::JobRequested(_) => unreachable!("refused by next_status"),
            Payload::JobLeased(leased) => {
                self.take_lease(event, leased.generation, leased.attempt)?;
                self.status = Leased;
                self.lease = Some(Lease {
                    owner: leased.lease_owner.clone(),
                    until: leased.lease_until,
                    dispatch_event_id: leased.dispatch_event_id,
                });
            }
            Payload::JobSucceeded(succeeded) => {
                if succeeded.lease.is_some() {
                    self.take_lease(event, succeeded.generation, succeeded.attempt)?;
                }
                self.require_generation(event, succeeded.generation)?;
                self.result = Some(succeeded.result.clone());
                self.previous_ambiguous = None;
                self.finish(Succeeded, at);
            }
            Payload::JobFailed(failed) => {
                self.require_generation(event, failed.generation)?;
                if failed.attempt != self.attempt {
                    return Err(self.illegal(
                        event,
                        format!(
                            "attempt {} is not the current attempt {}",
                            failed.attempt, self.attempt
                        ),
                    ));
                }
                // The lease stays until the decision (retry or quarantine) that follows.
                self.last_failure = Some(Failure {
                    generation: failed.generation,
                    attempt: failed.attempt,
                    class: failed.error_class,
                    message: failed.message.clone(),
                    ambiguous: failed.outcome_unknown.unwrap_or(false),
                });
                self.previous_ambiguous = Some(failed.outcome_unknown.unwrap_or(false));
            }
            Payload::JobRetryScheduled(retry) => {
                let failed_now = self.last_failure.as_ref().is_some_and(|f| {
                    f.generation == self.generation && f.class == ErrorClass::Retryable
                });
                if !failed_now {
                    return Err(self.illegal(
                        event,
                        "a retry follows a retryable JobFailed of the current lease",
                    ));
                }
                // The attempt count the retry leaves: the current one, or one less when the
                // failed attempt was throttled (an outside service's 429) and given back.
                if retry.attempt != self.attempt && retry.attempt != self.attempt - 1 {
                    return Err(self.illegal(
                        event,
                        format!(
                            "attempt {} is neither the current attempt {} nor the one before",
                            retry.attempt, self.attempt
                        ),
                    ));
                }
                if retry.attempt >= self.max_attempts {
                    return Err(self.illegal(
                        event,
                        format!("the budget of {} attempts is spent", self.max_attempts),
                    ));
                }
                self.attempt = retry.attempt;
                self.status = RetryWait;
                self.lease = None;
                self.next_attempt_at = Some(retry.next_attempt_at);
            }
            Payload::RetryDue(_) => {}
            Payload::JobQuarantined(quarantined) => {
                // A leased job is quarantined after its lease's JobFailed, or, with no
                // failure, once its budget is spent: its last attempt died with its process
                // and the lease ran out (the lease transaction quarantines it then).
                let failed_now =
                    self.last_failure.as_ref().is_some_and(|f| f.generation == self.generation);
                let budget_spent = self.attempt >= self.max_attempts
                    || self.deadline.is_some_and(|deadline| deadline <= at);
                if self.status == Leased && !failed_now && !budget_spent {
                    return Err(self.illegal(
                        event,
                        "a leased job is quarantined after a JobFailed of the current lease, \
                         or once its budget is spent",
                    ));
                }
                self.quarantine = Some(Quarantine {
                    reason: quarantined.reason.clone(),
                    class: quarantined.error_class,
                    owner: quarantined.owner.clone(),
                    at,
                });
                self.finish(Quarantined, at);
            }
            Payload::ReplayRequested(replay) => {
                if let Some(version) = replay.new_input_version {
                    if version <= self.input_version {
                        return Err(self.illegal(
                            event,
                            format!(
                                "new input version {version} is not above the current {}",
                                self.input_version
                            ),
                        ));
                    }
                    self.input_version = version;
                    // A new input version has a new idempotency key: nothing to reconcile.
                    self.previous_ambiguous = None;
                    if let Some(input) = &replay.new_input {
                        self.input = input.clone();
                    }
                } else if replay.new_input.is_some() {
                    return Err(self.illegal(event, "a new input needs a new input version"));
                }
                // A fresh budget; the generation keeps counting so old leases stay fenced.
                self.status = Queued;
                self.attempt = 0;
                self.max_attempts = replay.max_attempts;
                self.deadline = replay.deadline;
                self.finished_at = None;
                self.quarantine = None;
                self.last_failure = None;
            }
            Payload::JobSuperseded(superseded) => {
                if superseded.by_input_version <= self.input_version {
                    return Err(self.illegal(
                        event,
                        format!(
                            "input version {} does not supersede {}",
                            superseded.by_input_version, self.input_version
                        ),
                    ));
                }
                self.superseded_by = Some(superseded.by_input_version);
                self.finish(Superseded, at);
            }
            Payload::JobCancelled(_) => {
                self.finish(Cancelled, at);
            }
        }
        debug_assert_eq!(self.status, next, "Status::after and the fold agree");
        self.status = next;
        Ok(())
    }
}
