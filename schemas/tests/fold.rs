//! The state machine: examples of each transition and property tests of its invariants.

mod common;

use common::{
    MAX_ATTEMPTS, StreamBuilder, job_event, legal_stream, proptest_config, succeeded_stream,
};
use jobfold_schemas::event::*;
use jobfold_schemas::{FoldError, JobEvent, JobState, Payload, Status, fold::fold};
use proptest::prelude::*;
use uuid::Uuid;

fn builder() -> StreamBuilder {
    StreamBuilder::new(Uuid::new_v4(), 3)
}

/// The next event of `state`'s stream carrying `payload`.
fn next(state: &JobState, payload: Payload) -> JobEvent {
    JobEvent {
        event_id: Uuid::new_v4(),
        job_id: state.job_id,
        document_id: state.document_id.clone(),
        job_kind: state.job_kind.clone(),
        input_version: state.input_version,
        stream_version: state.stream_version + 1,
        occurred_at: chrono::Utc::now(),
        trace: None,
        producer: "test".into(),
        payload,
    }
}

fn leased(generation: i64, attempt: i32) -> Payload {
    Payload::JobLeased(JobLeased {
        generation,
        attempt,
        lease_owner: "w".into(),
        lease_until: chrono::Utc::now(),
        leased_at: None,
        dispatch_event_id: Uuid::new_v4(),
    })
}

fn succeeded(generation: i64, attempt: i32) -> Payload {
    Payload::JobSucceeded(JobSucceeded { generation, attempt, result: "{}".into(), lease: None })
}

/// A success that takes its own lease: its run ended inside its lease transaction.
fn succeeded_leasing(generation: i64, attempt: i32) -> Payload {
    Payload::JobSucceeded(JobSucceeded {
        generation,
        attempt,
        result: "{}".into(),
        lease: Some(LeaseTaken {
            lease_owner: "w".into(),
            leased_at: chrono::Utc::now(),
            dispatch_event_id: Uuid::new_v4(),
        }),
    })
}

#[test]
fn a_run_inside_its_lease_transaction_succeeds_in_one_event() {
    let mut b = builder();
    let before = b.state.clone();
    // Without a lease of its own, a success cannot follow a queued job.
    let err = b.state.apply(&next(&b.state, succeeded(1, 1))).unwrap_err();
    assert!(
        matches!(
            &err,
            FoldError::IllegalTransition { state: Status::Queued, event: "JobSucceeded", .. }
        ),
        "{err}"
    );
    // With one, it must be the next lease: generation and attempt each one up.
    for (generation, attempt) in [(0, 1), (2, 1), (1, 0), (1, 2)] {
        let err = b.state.apply(&next(&b.state, succeeded_leasing(generation, attempt)));
        assert!(err.is_err(), "generation {generation}, attempt {attempt} was taken");
        assert_eq!(b.state, before, "a refused event leaves the state unchanged");
    }
    b.state.apply(&next(&b.state, succeeded_leasing(1, 1))).unwrap();
    assert_eq!((b.state.status, b.state.generation, b.state.attempt), (Status::Succeeded, 1, 1));
    assert!(b.state.lease.is_none() && b.state.finished_at.is_some());
    assert_eq!(b.state.stream_version, 2);
    assert_eq!(b.state.result.as_deref(), Some("{}"));
}

#[test]
fn a_success_taking_its_own_lease_fences_the_lease_it_replaced() {
    // Leased, the lease expired, and a run inside the next lease transaction succeeded: the
    // first lease's own success comes too late.
    let mut b = builder();
    b.step(0); // lease: generation 1
    b.state.apply(&next(&b.state, succeeded_leasing(2, 2))).unwrap();
    assert_eq!((b.state.status, b.state.generation), (Status::Succeeded, 2));
    let zombie = b.state.clone().apply(&next(&b.state, succeeded(1, 1))).unwrap_err();
    assert!(matches!(zombie, FoldError::IllegalTransition { state: Status::Succeeded, .. }));
    // And one past the budget is refused, as a JobLeased past it is.
    let mut spent = builder();
    for _ in 0..MAX_ATTEMPTS - 1 {
        spent.step(0); // lease
        spent.step(2); // retryable failure, retry scheduled
    }
    spent.step(0); // the last attempt, its lease expiring
    assert_eq!((spent.state.status, spent.state.attempt), (Status::Leased, MAX_ATTEMPTS));
    let g = spent.state.generation;
    let err = spent.state.apply(&next(&spent.state, succeeded_leasing(g + 1, MAX_ATTEMPTS + 1)));
    assert!(
        matches!(&err, Err(FoldError::IllegalTransition { why, .. }) if why.contains("budget")),
        "{err:?}"
    );
}

#[test]
fn requested_then_leased_then_succeeded() {
    let mut b = builder();
    assert_eq!(b.state.status, Status::Queued);
    b.step(0); // lease
    assert_eq!((b.state.status, b.state.generation, b.state.attempt), (Status::Leased, 1, 1));
    assert!(b.state.lease.is_some());
    b.step(0); // succeed
    assert_eq!(b.state.status, Status::Succeeded);
    assert!(b.state.lease.is_none() && b.state.finished_at.is_some());
    assert_eq!(b.state, fold(&b.events).unwrap());
}

#[test]
fn an_empty_log_and_a_bad_start_are_errors() {
    assert_eq!(fold(std::iter::empty()), Err(FoldError::Empty));
    let b = builder();
    let leased_first = JobEvent { stream_version: 1, ..next(&b.state, leased(1, 1)) };
    assert!(matches!(
        JobState::start(&leased_first),
        Err(FoldError::BadStart { event: "JobLeased", .. })
    ));
}

#[test]
fn a_stale_generation_cannot_complete() {
    let mut b = builder();
    b.step(0); // lease: generation 1
    b.step(5); // lease expired, leased again: generation 2
    assert_eq!(b.state.generation, 2);
    let zombie = next(&b.state, succeeded(1, 1));
    let before = b.state.clone();
    let err = b.state.apply(&zombie).unwrap_err();
    assert!(
        matches!(&err, FoldError::IllegalTransition { state: Status::Leased, event: "JobSucceeded", why, .. } if why.contains("generation 1")),
        "{err}"
    );
    assert_eq!(b.state, before, "a refused event leaves the state unchanged");
}

#[test]
fn a_succeeded_job_takes_no_further_event() {
    let mut b = builder();
    b.step(0);
    b.step(0);
    for payload in [leased(2, 2), succeeded(1, 1)] {
        let err = b.state.clone().apply(&next(&b.state, payload)).unwrap_err();
        assert!(matches!(err, FoldError::IllegalTransition { state: Status::Succeeded, .. }));
    }
}

#[test]
fn retries_stop_at_the_attempt_budget() {
    let mut b = builder();
    for _ in 0..MAX_ATTEMPTS - 1 {
        b.step(0); // lease
        b.step(2); // retryable failure, retry scheduled
        assert_eq!(b.state.status, Status::RetryWait);
    }
    b.step(0); // the last attempt
    assert_eq!((b.state.status, b.state.attempt), (Status::Leased, MAX_ATTEMPTS));

    // The lease expiring cannot buy an attempt past the budget.
    let over = next(&b.state, leased(b.state.generation + 1, MAX_ATTEMPTS + 1));
    let err = b.state.clone().apply(&over).unwrap_err();
    assert!(err.to_string().contains("budget"), "{err}");

    // Nor can a retryable failure schedule a retry.
    let failed = next(
        &b.state,
        Payload::JobFailed(JobFailed {
            generation: b.state.generation,
            attempt: b.state.attempt,
            error_class: ErrorClass::Retryable,
            message: "x".into(),
            outcome_unknown: None,
        }),
    );
    let mut failed = b.state.clone().applied(&failed).unwrap();
    let retry = next(
        &failed,
        Payload::JobRetryScheduled(JobRetryScheduled {
            attempt: failed.attempt,
            next_attempt_at: chrono::Utc::now(),
        }),
    );
    let err = failed.apply(&retry).unwrap_err();
    assert!(err.to_string().contains("budget"), "{err}");

    // The model quarantines instead.
    b.step(2);
    assert_eq!(b.state.status, Status::Quarantined);
}

/// A throttled attempt (an outside service's 429) is given back: its retry carries one
/// attempt less, the next lease repeats its number, and even the last attempt's throttling
/// schedules a retry. Giving back more than the one attempt is refused.
#[test]
fn a_throttled_attempt_is_given_back() {
    let mut b = builder();
    for _ in 0..MAX_ATTEMPTS - 1 {
        b.step(0);
        b.step(2);
    }
    b.step(0); // the last attempt
    assert_eq!(b.state.attempt, MAX_ATTEMPTS);
    let throttled = next(
        &b.state,
        Payload::JobFailed(JobFailed {
            generation: b.state.generation,
            attempt: b.state.attempt,
            error_class: ErrorClass::Retryable,
            message: "429 Too Many Requests".into(),
            outcome_unknown: None,
        }),
    );
    let failed = b.state.clone().applied(&throttled).unwrap();
    let retry = |attempt| {
        next(
            &failed,
            Payload::JobRetryScheduled(JobRetryScheduled {
                attempt,
                next_attempt_at: chrono::Utc::now(),
            }),
        )
    };
    let err = failed.clone().apply(&retry(MAX_ATTEMPTS - 2)).unwrap_err();
    assert!(err.to_string().contains("nor the one before"), "{err}");
    let waiting = failed.clone().applied(&retry(MAX_ATTEMPTS - 1)).unwrap();
    assert_eq!((waiting.status, waiting.attempt), (Status::RetryWait, MAX_ATTEMPTS - 1));
    let again = next(&waiting, leased(waiting.generation + 1, MAX_ATTEMPTS));
    let again = waiting.applied(&again).unwrap();
    assert_eq!((again.status, again.attempt), (Status::Leased, MAX_ATTEMPTS));
}

/// The last attempt died with its process: no JobFailed, the lease ran out, and the lease
/// transaction quarantines the job. Short of its budget, the same is refused.
#[test]
fn a_last_attempt_that_died_with_its_process_is_quarantined() {
    let quarantined = |state: &JobState| {
        next(
            state,
            Payload::JobQuarantined(JobQuarantined {
                reason: "attempt budget spent".into(),
                error_class: ErrorClass::Retryable,
                owner: "ops".into(),
                attempts: state.attempt,
            }),
        )
    };
    let mut b = builder();
    b.step(0); // the first attempt, which dies
    assert!(b.state.clone().apply(&quarantined(&b.state)).is_err(), "quarantined with budget left");

    for _ in 0..MAX_ATTEMPTS - 1 {
        let generation = b.state.generation;
        let again = next(&b.state, leased(generation + 1, b.state.attempt + 1));
        b.state.apply(&again).unwrap();
    }
    assert_eq!((b.state.status, b.state.attempt), (Status::Leased, MAX_ATTEMPTS));
    let end = b.state.clone().applied(&quarantined(&b.state)).unwrap();
    assert_eq!(end.status, Status::Quarantined);
}

#[test]
fn invalid_input_is_quarantined_without_retry() {
    let mut b = builder();
    b.step(0); // lease
    b.step(12); // choice % 8 == 4, % 16 >= 8: InvalidInput, quarantined
    assert_eq!(b.state.status, Status::Quarantined);
    assert_eq!(b.state.quarantine.as_ref().unwrap().class, ErrorClass::InvalidInput);
    // A retry after an invalid-input failure is refused.
    let mut leased_again = builder();
    leased_again.step(0);
    let mut s = leased_again.state.clone();
    s.apply(&next(
        &s.clone(),
        Payload::JobFailed(JobFailed {
            generation: s.generation,
            attempt: s.attempt,
            error_class: ErrorClass::InvalidInput,
            message: "bad".into(),
            outcome_unknown: None,
        }),
    ))
    .unwrap();
    let retry = next(
        &s,
        Payload::JobRetryScheduled(JobRetryScheduled {
            attempt: s.attempt,
            next_attempt_at: chrono::Utc::now(),
        }),
    );
    assert!(s.clone().apply(&retry).is_err());
}

#[test]
fn replay_with_a_new_input_version_gives_a_fresh_budget() {
    let mut b = builder();
    b.step(0);
    b.step(4); // permanent failure, quarantined
    let generation = b.state.generation;
    b.step(1); // replay with input version 4
    assert_eq!((b.state.status, b.state.input_version, b.state.attempt), (Status::Queued, 4, 0));
    assert_eq!(b.state.generation, generation, "the generation keeps counting");
    b.step(0);
    assert_eq!(b.state.generation, generation + 1);
}

#[test]
fn an_older_input_version_is_superseded() {
    let b = builder();
    let by_same = next(&b.state, Payload::JobSuperseded(JobSuperseded { by_input_version: 3 }));
    assert!(b.state.clone().apply(&by_same).is_err());
    let by_newer = next(&b.state, Payload::JobSuperseded(JobSuperseded { by_input_version: 4 }));
    let s = b.state.applied(&by_newer).unwrap();
    assert_eq!((s.status, s.superseded_by), (Status::Superseded, Some(4)));
}

#[test]
fn stream_versions_are_gap_free_and_per_job() {
    let mut b = builder();
    let mut skip = next(&b.state, leased(1, 1));
    skip.stream_version += 1;
    assert!(matches!(
        b.state.clone().apply(&skip),
        Err(FoldError::StreamVersion { expected: 2, found: 3, .. })
    ));
    let other = JobEvent { job_id: Uuid::new_v4(), ..next(&b.state, leased(1, 1)) };
    assert!(matches!(b.state.apply(&other), Err(FoldError::WrongJob { .. })));
}

proptest! {
    #![proptest_config(proptest_config(512))]

    #[test]
    fn legal_streams_keep_the_invariants(events in legal_stream(40)) {
        // The generator must reach every state, or the invariants are checked on too little.
        prop_assert!(!events.is_empty());
        let mut state = JobState::start(&events[0]).unwrap();
        let mut was_succeeded = false;
        for event in &events[1..] {
            let before = state.clone();
            state.apply(event).unwrap();
            prop_assert!(state.generation >= before.generation, "generation decreased");
            prop_assert!(state.attempt <= state.max_attempts, "attempt past its budget");
            prop_assert!(!was_succeeded, "an event followed success");
            prop_assert_eq!(state.lease.is_some(), state.status == Status::Leased);
            prop_assert_eq!(
                state.finished_at.is_some(),
                state.status.is_final() || state.status == Status::Quarantined
            );
            was_succeeded = state.status == Status::Succeeded;
        }
    }

    #[test]
    fn folding_a_prefix_then_the_rest_equals_folding_all(
        events in legal_stream(40),
        split in any::<prop::sample::Index>(),
    ) {
        let split = split.index(events.len()) + 1;
        let mut state = fold(&events[..split]).unwrap();
        for event in &events[split..] {
            state.apply(event).unwrap();
        }
        prop_assert_eq!(state, fold(&events).unwrap());
    }

    #[test]
    fn a_succeeded_version_never_goes_back_to_leased(events in succeeded_stream(40)) {
        let state = fold(&events).unwrap();
        prop_assert_eq!(state.status, Status::Succeeded);
        // Every well-formed next move of a live job is refused once it succeeded.
        let (g, a, v) = (state.generation, state.attempt, state.input_version);
        let candidates = [
            leased(g + 1, a + 1),
            succeeded(g, a),
            Payload::JobFailed(JobFailed {
                generation: g,
                attempt: a,
                error_class: ErrorClass::Retryable,
                message: "x".into(),
                outcome_unknown: None,
            }),
            Payload::RetryDue(RetryDue {
                due_at: chrono::Utc::now(),
                reason: DispatchReason::LeaseExpired,
            }),
            Payload::JobQuarantined(JobQuarantined {
                reason: "x".into(),
                error_class: ErrorClass::Permanent,
                owner: "o".into(),
                attempts: a,
            }),
            Payload::ReplayRequested(ReplayRequested {
                requested_by: "op".into(),
                new_input_version: None,
                new_input: None,
                max_attempts: MAX_ATTEMPTS,
                deadline: None,
            }),
            Payload::JobSuperseded(JobSuperseded { by_input_version: v + 1 }),
            Payload::JobCancelled(JobCancelled { requested_by: "op".into(), reason: "x".into() }),
        ];
        for payload in candidates {
            let kind = payload.kind();
            prop_assert!(state.clone().apply(&next(&state, payload)).is_err(), "{} accepted", kind);
        }
    }

    #[test]
    fn arbitrary_events_never_panic_and_refusals_change_nothing(
        events in legal_stream(20),
        noise in proptest::collection::vec(job_event(), 1..20),
    ) {
        let mut state = fold(&events).unwrap();
        for mut event in noise {
            // Half of the noise lands on this job's next stream version, to reach the
            // transition checks rather than the stream checks.
            if event.stream_version % 2 == 0 {
                event.job_id = state.job_id;
                event.stream_version = state.stream_version + 1;
                event.input_version = state.input_version;
            }
            let before = state.clone();
            if state.apply(&event).is_err() {
                prop_assert_eq!(&state, &before);
            }
        }
    }
}

/// The stream generator is only as good as its reach: every status must be produced.
#[test]
fn the_generator_reaches_every_status() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = legal_stream(40);
    let mut seen = std::collections::BTreeSet::new();
    let mut longest = 0;
    for _ in 0..500 {
        let events = strategy.new_tree(&mut runner).unwrap().current();
        longest = longest.max(events.len());
        let mut state = JobState::start(&events[0]).unwrap();
        seen.insert(state.status);
        for event in &events[1..] {
            state.apply(event).unwrap();
            seen.insert(state.status);
        }
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), Status::ALL.to_vec());
    assert!(longest >= 10, "streams stay short: the longest has {longest} events");
}
