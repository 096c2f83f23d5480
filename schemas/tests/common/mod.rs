//! Generators shared by the contract and fold tests.

#![allow(dead_code, unreachable_pub)]

use chrono::{DateTime, TimeZone, Utc};
use jobfold_schemas::event::*;
use jobfold_schemas::{JobEvent, JobState, Payload, Status};
use proptest::prelude::*;
use uuid::Uuid;

pub fn uuid() -> impl Strategy<Value = Uuid> {
    any::<u128>().prop_map(Uuid::from_u128)
}

/// Millisecond timestamps between 1970 and 2100: what timestamp-millis carries.
pub fn timestamp() -> impl Strategy<Value = DateTime<Utc>> {
    (0i64..4_102_444_800_000).prop_map(|ms| Utc.timestamp_millis_opt(ms).unwrap())
}

pub fn text() -> impl Strategy<Value = String> {
    "\\PC{0,24}"
}

pub fn trace() -> impl Strategy<Value = Option<TraceContext>> {
    proptest::option::of(
        (text(), proptest::option::of(text()))
            .prop_map(|(traceparent, tracestate)| TraceContext { traceparent, tracestate }),
    )
}

pub fn error_class() -> impl Strategy<Value = ErrorClass> {
    prop_oneof![
        Just(ErrorClass::Retryable),
        Just(ErrorClass::Permanent),
        Just(ErrorClass::InvalidInput)
    ]
}

pub fn payload() -> impl Strategy<Value = Payload> {
    prop_oneof![
        (
            text(),
            proptest::option::of(text()),
            any::<i32>(),
            proptest::option::of(timestamp()),
            proptest::option::of(timestamp())
        )
            .prop_map(|(input, idempotency_key, max_attempts, deadline, run_at)| {
                Payload::JobRequested(JobRequested {
                    input,
                    idempotency_key,
                    max_attempts,
                    deadline,
                    run_at,
                })
            }),
        (
            any::<i64>(),
            any::<i32>(),
            text(),
            timestamp(),
            proptest::option::of(timestamp()),
            uuid()
        )
            .prop_map(
                |(generation, attempt, lease_owner, lease_until, leased_at, dispatch_event_id)| {
                    Payload::JobLeased(JobLeased {
                        generation,
                        attempt,
                        lease_owner,
                        lease_until,
                        leased_at,
                        dispatch_event_id,
                    })
                }
            ),
        (
            any::<i64>(),
            any::<i32>(),
            text(),
            proptest::option::of((text(), timestamp(), uuid()).prop_map(
                |(lease_owner, leased_at, dispatch_event_id)| LeaseTaken {
                    lease_owner,
                    leased_at,
                    dispatch_event_id,
                }
            ))
        )
            .prop_map(|(generation, attempt, result, lease)| {
                Payload::JobSucceeded(JobSucceeded { generation, attempt, result, lease })
            }),
        (any::<i64>(), any::<i32>(), error_class(), text(), proptest::option::of(any::<bool>()))
            .prop_map(|(generation, attempt, error_class, message, outcome_unknown)| {
                Payload::JobFailed(JobFailed {
                    generation,
                    attempt,
                    error_class,
                    message,
                    outcome_unknown,
                })
            }),
        (any::<i32>(), timestamp()).prop_map(|(attempt, next_attempt_at)| {
            Payload::JobRetryScheduled(JobRetryScheduled { attempt, next_attempt_at })
        }),
        (
            timestamp(),
            prop_oneof![
                Just(DispatchReason::Backoff),
                Just(DispatchReason::LeaseExpired),
                Just(DispatchReason::Stalled)
            ]
        )
            .prop_map(|(due_at, reason)| Payload::RetryDue(RetryDue { due_at, reason })),
        (text(), error_class(), text(), any::<i32>()).prop_map(
            |(reason, error_class, owner, attempts)| {
                Payload::JobQuarantined(JobQuarantined { reason, error_class, owner, attempts })
            }
        ),
        (
            text(),
            proptest::option::of(any::<i64>()),
            proptest::option::of(text()),
            any::<i32>(),
            proptest::option::of(timestamp())
        )
            .prop_map(
                |(requested_by, new_input_version, new_input, max_attempts, deadline)| {
                    Payload::ReplayRequested(ReplayRequested {
                        requested_by,
                        new_input_version,
                        new_input,
                        max_attempts,
                        deadline,
                    })
                }
            ),
        any::<i64>().prop_map(|by_input_version| Payload::JobSuperseded(JobSuperseded {
            by_input_version
        })),
        (text(), text()).prop_map(|(requested_by, reason)| {
            Payload::JobCancelled(JobCancelled { requested_by, reason })
        }),
    ]
}

prop_compose! {
    pub fn job_event()(
        event_id in uuid(),
        job_id in uuid(),
        document_id in text(),
        job_kind in text(),
        input_version in any::<i64>(),
        stream_version in any::<i32>(),
        occurred_at in timestamp(),
        trace in trace(),
        producer in text(),
        payload in payload(),
    ) -> JobEvent {
        JobEvent {
            event_id, job_id, document_id, job_kind, input_version, stream_version,
            occurred_at, trace, producer, payload,
        }
    }
}

prop_compose! {
    pub fn job_request()(
        request_id in uuid(),
        document_id in text(),
        job_kind in text(),
        input_version in any::<i64>(),
        input in text(),
        requested_at in timestamp(),
        producer in text(),
        trace in trace(),
        run_at in proptest::option::of(timestamp()),
    ) -> JobRequest {
        JobRequest {
            request_id, document_id, job_kind, input_version, input, requested_at, producer, trace,
            run_at,
        }
    }
}

/// Builds legal event streams: a small model of what the processor and operators do,
/// steered by `choices`, so every generated stream is one the system could write.
#[derive(Debug)]
pub struct StreamBuilder {
    pub events: Vec<JobEvent>,
    pub state: JobState,
    clock: DateTime<Utc>,
}

pub const MAX_ATTEMPTS: i32 = 4;

impl StreamBuilder {
    pub fn new(job_id: Uuid, input_version: i64) -> Self {
        let clock = Utc.timestamp_millis_opt(1_700_000_000_000).unwrap();
        let requested = JobEvent {
            event_id: Uuid::new_v4(),
            job_id,
            document_id: "doc-1".into(),
            job_kind: "index-document".into(),
            input_version,
            stream_version: 1,
            occurred_at: clock,
            trace: None,
            producer: "test".into(),
            payload: Payload::JobRequested(JobRequested {
                input: "{}".into(),
                idempotency_key: Some("key-1".into()),
                max_attempts: MAX_ATTEMPTS,
                deadline: None,
                run_at: None,
            }),
        };
        let state = JobState::start(&requested).expect("JobRequested starts a stream");
        Self { events: vec![requested], state, clock }
    }

    /// Appends one event, which must be accepted.
    fn push(&mut self, payload: Payload, input_version: i64) {
        self.clock += chrono::Duration::seconds(1);
        let event = JobEvent {
            event_id: Uuid::new_v4(),
            job_id: self.state.job_id,
            document_id: self.state.document_id.clone(),
            job_kind: self.state.job_kind.clone(),
            input_version,
            stream_version: self.state.stream_version + 1,
            occurred_at: self.clock,
            trace: None,
            producer: "test".into(),
            payload,
        };
        if let Err(e) = self.state.apply(&event) {
            panic!("a legal event was refused: {e}\nstream so far: {:#?}", self.events);
        }
        self.events.push(event);
    }

    fn lease(&mut self) {
        let payload = Payload::JobLeased(JobLeased {
            generation: self.state.generation + 1,
            attempt: self.state.attempt + 1,
            lease_owner: "worker".into(),
            lease_until: self.clock + chrono::Duration::seconds(30),
            leased_at: Some(self.clock),
            dispatch_event_id: Uuid::new_v4(),
        });
        self.push(payload, self.state.input_version);
    }

    /// A run that ended inside its lease transaction: one success that takes its own lease.
    fn succeed_leasing(&mut self) {
        let payload = Payload::JobSucceeded(JobSucceeded {
            generation: self.state.generation + 1,
            attempt: self.state.attempt + 1,
            result: "{}".into(),
            lease: Some(LeaseTaken {
                lease_owner: "worker".into(),
                leased_at: self.clock,
                dispatch_event_id: Uuid::new_v4(),
            }),
        });
        self.push(payload, self.state.input_version);
    }

    fn fail(&mut self, error_class: ErrorClass) {
        let payload = Payload::JobFailed(JobFailed {
            generation: self.state.generation,
            attempt: self.state.attempt,
            error_class,
            message: "boom".into(),
            outcome_unknown: Some(false),
        });
        self.push(payload, self.state.input_version);
    }

    fn quarantine(&mut self, error_class: ErrorClass) {
        let payload = Payload::JobQuarantined(JobQuarantined {
            reason: "test".into(),
            error_class,
            owner: "team".into(),
            attempts: self.state.attempt,
        });
        self.push(payload, self.state.input_version);
    }

    fn cancel(&mut self) {
        let payload = Payload::JobCancelled(JobCancelled {
            requested_by: "op".into(),
            reason: "test".into(),
        });
        self.push(payload, self.state.input_version);
    }

    /// Takes one step chosen by `choice` among the moves legal now; false once final.
    pub fn step(&mut self, choice: u8) -> bool {
        let v = self.state.input_version;
        let can_lease = self.state.attempt < MAX_ATTEMPTS;
        match self.state.status {
            Status::Queued | Status::RetryWait => match choice % 6 {
                0 if can_lease && choice % 12 >= 6 => self.succeed_leasing(),
                0 | 1 if can_lease => self.lease(),
                0..=2 => self.quarantine(ErrorClass::Retryable),
                3 => self.push(
                    Payload::RetryDue(RetryDue {
                        due_at: self.clock,
                        reason: DispatchReason::Stalled,
                    }),
                    v,
                ),
                4 => {
                    self.push(Payload::JobSuperseded(JobSuperseded { by_input_version: v + 1 }), v)
                }
                _ => self.cancel(),
            },
            Status::Leased => match choice % 8 {
                0 | 1 => self.push(
                    Payload::JobSucceeded(JobSucceeded {
                        generation: self.state.generation,
                        attempt: self.state.attempt,
                        result: "{}".into(),
                        lease: None,
                    }),
                    v,
                ),
                2 | 3 if can_lease => {
                    self.fail(ErrorClass::Retryable);
                    let next_attempt_at = self.clock + chrono::Duration::seconds(5);
                    self.push(
                        Payload::JobRetryScheduled(JobRetryScheduled {
                            attempt: self.state.attempt,
                            next_attempt_at,
                        }),
                        v,
                    );
                }
                2 | 3 => {
                    self.fail(ErrorClass::Retryable);
                    self.quarantine(ErrorClass::Retryable);
                }
                4 => {
                    let class = if choice % 16 < 8 {
                        ErrorClass::Permanent
                    } else {
                        ErrorClass::InvalidInput
                    };
                    self.fail(class);
                    self.quarantine(class);
                }
                5 if can_lease => {
                    // The lease expired: the reaper dispatches, another worker leases.
                    self.push(
                        Payload::RetryDue(RetryDue {
                            due_at: self.clock,
                            reason: DispatchReason::LeaseExpired,
                        }),
                        v,
                    );
                    if choice % 16 < 8 { self.lease() } else { self.succeed_leasing() }
                }
                6 => {
                    self.push(Payload::JobSuperseded(JobSuperseded { by_input_version: v + 2 }), v)
                }
                _ => self.cancel(),
            },
            Status::Quarantined => match choice % 4 {
                0 => self.push(
                    Payload::ReplayRequested(ReplayRequested {
                        requested_by: "op".into(),
                        new_input_version: None,
                        new_input: None,
                        max_attempts: MAX_ATTEMPTS,
                        deadline: None,
                    }),
                    v,
                ),
                1 => self.push(
                    Payload::ReplayRequested(ReplayRequested {
                        requested_by: "op".into(),
                        new_input_version: Some(v + 1),
                        new_input: Some("{\"fixed\":true}".into()),
                        max_attempts: MAX_ATTEMPTS,
                        deadline: None,
                    }),
                    v + 1,
                ),
                2 => {
                    self.push(Payload::JobSuperseded(JobSuperseded { by_input_version: v + 1 }), v)
                }
                _ => self.cancel(),
            },
            Status::Succeeded | Status::Superseded | Status::Cancelled => return false,
        }
        true
    }
}

impl StreamBuilder {
    /// Steers the job to success where it still can: replays a quarantined job, leases a
    /// waiting one, completes a leased one. False if the job ended otherwise.
    pub fn finish_successfully(&mut self) -> bool {
        for _ in 0..4 {
            match self.state.status {
                Status::Succeeded => return true,
                Status::Superseded | Status::Cancelled => return false,
                Status::Quarantined => self.step(0),
                Status::Queued | Status::RetryWait if self.state.attempt < MAX_ATTEMPTS => {
                    self.step(0)
                }
                Status::Queued | Status::RetryWait => return false,
                Status::Leased => self.step(0),
            };
        }
        self.state.status == Status::Succeeded
    }
}

/// A builder after the random steps `choices` pick, stopping at a final state.
pub fn walk(job_id: Uuid, input_version: i64, choices: &[u8]) -> StreamBuilder {
    let mut builder = StreamBuilder::new(job_id, input_version);
    for &choice in choices {
        if !builder.step(choice) || builder.state.status.is_final() {
            break;
        }
    }
    builder
}

/// A legal stream that ends in `succeeded`, after up to `max_steps` random steps.
pub fn succeeded_stream(max_steps: usize) -> impl Strategy<Value = Vec<JobEvent>> {
    (uuid(), 1i64..1000, proptest::collection::vec(any::<u8>(), 0..max_steps)).prop_map(
        |(job_id, input_version, choices)| {
            let mut builder = walk(job_id, input_version, &choices);
            if !builder.finish_successfully() {
                // Ended otherwise (superseded, cancelled, budget spent): start over plainly.
                builder = StreamBuilder::new(job_id, input_version);
                builder.step(0);
                builder.step(0);
            }
            builder.events
        },
    )
}

/// Proptest settings for these tests: failures persisted beside the test source
/// (`*.proptest-regressions`, committed) and replayed first on every run.
pub fn proptest_config(cases: u32) -> proptest::test_runner::Config {
    proptest::test_runner::Config {
        cases,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..proptest::test_runner::Config::default()
    }
}

/// A legal stream of up to `max_steps` steps after JobRequested.
pub fn legal_stream(max_steps: usize) -> impl Strategy<Value = Vec<JobEvent>> {
    (uuid(), 1i64..1000, proptest::collection::vec(any::<u8>(), 0..max_steps))
        .prop_map(|(job_id, input_version, choices)| walk(job_id, input_version, &choices).events)
}
