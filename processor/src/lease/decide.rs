//! The lease transaction's decision for a dispatch event: pure, so each rule has a unit test.

use chrono::{DateTime, Utc};
use jobfold_schemas::fold::Status;

use crate::store::JobRow;

/// What the lease transaction decided for a dispatch event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseDecision {
    /// Nothing to run: the event was consumed before (redelivered, or published twice).
    Duplicate,
    /// Nothing to run: the job is done, quarantined, or the event is stale.
    Skip(&'static str),
    /// Another worker holds a live lease: try again at this instant.
    Wait(DateTime<Utc>),
    /// A newer input version of the document already succeeded.
    Supersede(i64),
    /// A budget is spent before this attempt could start.
    Quarantine(String),
    /// Take the lease.
    Lease,
}

/// Decides what a dispatch event means for the job as it stands. Pure: the tests call it.
///
/// A job's dispatch events come through one partition in stream order, so one older than
/// the dispatch that leased the newest attempt (`job.dispatch_version`) was consumed before,
/// or made stale by that one: a duplicate. That dispatch itself, come again, is a duplicate
/// when the job's state says its attempt is over; while the attempt's lease is live it
/// waits, and an expired one it takes over (the processor died before completing).
pub fn decide(
    job: &JobRow,
    event_input_version: i64,
    event_stream_version: i32,
    newest_succeeded: Option<i64>,
    now: DateTime<Utc>,
) -> LeaseDecision {
    if event_stream_version < job.dispatch_version {
        return LeaseDecision::Duplicate;
    }
    match by_state(job, event_input_version, event_stream_version, newest_succeeded, now) {
        LeaseDecision::Skip(_) if event_stream_version == job.dispatch_version => {
            LeaseDecision::Duplicate
        }
        decision => decision,
    }
}

/// What the job's state makes of a dispatch event not older than its `dispatch_version`.
fn by_state(
    job: &JobRow,
    event_input_version: i64,
    event_stream_version: i32,
    newest_succeeded: Option<i64>,
    now: DateTime<Utc>,
) -> LeaseDecision {
    if job.state.is_final() {
        return LeaseDecision::Skip("the job is finished");
    }
    if job.state == Status::Quarantined {
        return LeaseDecision::Skip("the job is quarantined");
    }
    if event_input_version != job.input_version {
        return LeaseDecision::Skip("the event is for another input version");
    }
    // A job waiting for its scheduled retry moves on that retry's RetryDue, its newest event:
    // an older dispatch read late (a stalled job's re-dispatch) would cut the backoff short.
    if job.state == Status::RetryWait && event_stream_version < job.stream_version {
        return LeaseDecision::Skip("the job waits for its scheduled retry");
    }
    if let Some(newer) = newest_succeeded.filter(|v| *v > job.input_version) {
        return LeaseDecision::Supersede(newer);
    }
    if job.state == Status::Leased && job.lease_until.is_some_and(|until| until > now) {
        return LeaseDecision::Wait(job.lease_until.expect("checked"));
    }
    // A scheduled job's JobRequested is published at its due time; one read a little early
    // (the relay's clock and this one differ) waits for it.
    if job.state == Status::Queued && job.run_at.is_some_and(|at| at > now) {
        return LeaseDecision::Wait(job.run_at.expect("checked"));
    }
    if job.attempt >= job.max_attempts {
        return LeaseDecision::Quarantine(format!(
            "attempt budget spent: {} of {} attempts made",
            job.attempt, job.max_attempts
        ));
    }
    if job.deadline.is_some_and(|d| d <= now) {
        return LeaseDecision::Quarantine("time budget spent before the next attempt".into());
    }
    LeaseDecision::Lease
}

/// Whether a job whose runs died with their processes `crashes` times (fewer than its kind's
/// `max_crashes`) runs isolated — alone in its process, recorded alone — rather than beside
/// the others.
///
/// Only the run whose death would end it: one death short of `max_crashes`. A run that dies
/// then is charged to this job alone, so the death that quarantines a job is always its own;
/// one that returns clears its count. Earlier deaths are shared with whatever ran beside it,
/// as any attempt under a process that dies is. Isolating every job a death touched (a lease
/// transaction runs up to [`super::BATCH`] jobs) made each kill, from outside or by one bad
/// job, queue all of them for one run at a time, each holding its document's turn; after one
/// death they run side by side again.
#[must_use]
pub fn runs_isolated(crashes: i32, max_crashes: i32) -> bool {
    crashes > 0 && crashes >= max_crashes - 1
}

#[cfg(test)]
mod tests {
    use chrono::Duration as ChronoDuration;
    use uuid::Uuid;

    use super::*;

    fn job(state: &str) -> JobRow {
        JobRow {
            job_id: Uuid::nil(),
            document_id: "d".into(),
            kind: "k".into(),
            payload: serde_json::json!({}),
            input_version: 3,
            state: state.parse().expect("a job state"),
            attempt: 1,
            generation: 1,
            lease_until: None,
            lease_owner: None,
            max_attempts: 3,
            deadline: None,
            stream_version: 2,
            dispatch_version: 0,
            accepted_at: Utc::now(),
            run_at: None,
            previous_outcome: None,
            fresh_xid: true,
        }
    }

    #[test]
    fn finished_and_quarantined_jobs_are_skipped() {
        let now = Utc::now();
        for state in ["succeeded", "superseded", "cancelled", "quarantined"] {
            assert!(
                matches!(decide(&job(state), 3, 2, None, now), LeaseDecision::Skip(_)),
                "{state}"
            );
        }
    }

    #[test]
    fn a_newer_succeeded_version_supersedes() {
        let now = Utc::now();
        assert_eq!(decide(&job("queued"), 3, 2, Some(4), now), LeaseDecision::Supersede(4));
        assert_eq!(decide(&job("queued"), 3, 2, Some(3), now), LeaseDecision::Lease);
        assert_eq!(decide(&job("queued"), 3, 2, Some(2), now), LeaseDecision::Lease);
    }

    #[test]
    fn a_live_lease_is_waited_for_and_an_expired_one_taken_over() {
        let now = Utc::now();
        let mut leased = job("leased");
        leased.lease_until = Some(now + ChronoDuration::seconds(5));
        assert_eq!(
            decide(&leased, 3, 2, None, now),
            LeaseDecision::Wait(leased.lease_until.unwrap())
        );
        leased.lease_until = Some(now - ChronoDuration::seconds(1));
        assert_eq!(decide(&leased, 3, 2, None, now), LeaseDecision::Lease);
    }

    #[test]
    fn spent_budgets_quarantine_before_a_lease() {
        let now = Utc::now();
        let mut spent = job("retry_wait");
        spent.attempt = 3;
        assert!(matches!(decide(&spent, 3, 2, None, now), LeaseDecision::Quarantine(_)));
        let mut late = job("retry_wait");
        late.deadline = Some(now - ChronoDuration::seconds(1));
        assert!(matches!(decide(&late, 3, 2, None, now), LeaseDecision::Quarantine(_)));
    }

    #[test]
    fn a_scheduled_job_waits_for_its_time() {
        let now = Utc::now();
        let mut scheduled = job("queued");
        scheduled.run_at = Some(now + ChronoDuration::seconds(3));
        assert_eq!(
            decide(&scheduled, 3, 1, None, now),
            LeaseDecision::Wait(scheduled.run_at.unwrap())
        );
        scheduled.run_at = Some(now - ChronoDuration::milliseconds(1));
        assert_eq!(decide(&scheduled, 3, 1, None, now), LeaseDecision::Lease);
    }

    #[test]
    fn a_stale_input_version_is_skipped() {
        assert!(matches!(decide(&job("queued"), 2, 2, None, Utc::now()), LeaseDecision::Skip(_)));
    }

    #[test]
    fn a_job_waiting_for_its_retry_moves_only_on_its_retry_due() {
        let now = Utc::now();
        let waiting = job("retry_wait");
        // An older dispatch read late neither starts the retry early nor finishes the job.
        assert_eq!(
            decide(&waiting, 3, 1, None, now),
            LeaseDecision::Skip("the job waits for its scheduled retry")
        );
        assert_eq!(
            decide(&waiting, 3, 1, Some(4), now),
            LeaseDecision::Skip("the job waits for its scheduled retry")
        );
        // Its RetryDue, the newest event of its stream, does.
        assert_eq!(decide(&waiting, 3, 2, None, now), LeaseDecision::Lease);
        assert_eq!(decide(&waiting, 3, 2, Some(4), now), LeaseDecision::Supersede(4));
        // A queued job leases on any dispatch of its input version.
        assert_eq!(decide(&job("queued"), 3, 1, None, now), LeaseDecision::Lease);
    }

    #[test]
    fn a_dispatch_older_than_the_one_that_leased_the_newest_attempt_is_a_duplicate() {
        let now = Utc::now();
        // Attempt 2 was leased by the RetryDue at version 5; the JobRequested at version 1
        // comes again (a rewind, a rebalance): whatever the job's state, nothing runs.
        for state in ["leased", "queued", "retry_wait", "succeeded", "quarantined"] {
            let mut leased = job(state);
            leased.dispatch_version = 5;
            leased.stream_version = 6;
            assert_eq!(decide(&leased, 3, 1, None, now), LeaseDecision::Duplicate, "{state}");
        }
    }

    #[test]
    fn the_dispatch_that_leased_comes_again_a_duplicate_once_its_attempt_is_over() {
        let now = Utc::now();
        let mut done = job("succeeded");
        done.dispatch_version = 2;
        done.stream_version = 4;
        assert_eq!(decide(&done, 3, 2, None, now), LeaseDecision::Duplicate);
        let mut retrying = job("retry_wait");
        retrying.dispatch_version = 2;
        retrying.stream_version = 5;
        assert_eq!(decide(&retrying, 3, 2, None, now), LeaseDecision::Duplicate);
        // Its attempt still running: the live lease is waited for, an expired one taken over
        // (the processor that held it died before completing).
        let mut running = job("leased");
        running.dispatch_version = 2;
        running.stream_version = 3;
        running.lease_until = Some(now + ChronoDuration::seconds(5));
        assert_eq!(
            decide(&running, 3, 2, None, now),
            LeaseDecision::Wait(running.lease_until.unwrap())
        );
        running.lease_until = Some(now - ChronoDuration::seconds(1));
        assert_eq!(decide(&running, 3, 2, None, now), LeaseDecision::Lease);
        // A newer dispatch is not a duplicate: a replayed job's ReplayRequested leases it.
        let mut replayed = job("queued");
        replayed.dispatch_version = 2;
        replayed.stream_version = 7;
        assert_eq!(decide(&replayed, 3, 7, None, now), LeaseDecision::Lease);
    }

    #[test]
    fn only_the_run_whose_death_would_end_a_job_runs_isolated() {
        assert!(!runs_isolated(0, 3), "no death: no suspect");
        assert!(!runs_isolated(1, 3), "one shared death of three runs beside the others");
        assert!(runs_isolated(2, 3), "the third death would end it: alone");
        assert!(runs_isolated(1, 2));
        assert!(runs_isolated(1, 1));
        assert!(!runs_isolated(3, 5) && runs_isolated(4, 5));
    }
}
