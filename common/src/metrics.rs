//! Metric names of what both services report: jobs accepted (by whichever intake), and the
//! gauges over the job tables ([`crate::gauges`]). Each service names its own in its
//! `metrics` module (`jobfold_processor::metrics`, `jobfold_relay::metrics`).
//!
//! Names follow `jobfold_<thing>_<unit>`; counters end in `_total`. Labels have bounded
//! cardinality (topic, partition, outcome), never a job id.

use metrics::{Unit, describe_counter, describe_gauge};

/// Jobs accepted (new jobs only, not idempotent retries).
pub const ACCEPTED_TOTAL: &str = "jobfold_accepted_total";
/// Unfinished jobs by state (`queued`, `leased`, `retry_wait`), read from Postgres.
pub const JOBS: &str = "jobfold_jobs";
/// Accepted jobs not yet ended: accepted − (succeeded + quarantined + superseded).
pub const UNFINISHED_JOBS: &str = "jobfold_unfinished_jobs";
/// Seconds since the oldest queued job became due.
pub const OLDEST_QUEUED_AGE_SECONDS: &str = "jobfold_oldest_queued_age_seconds";
/// Queued jobs scheduled for later (their `run_at` ahead).
pub const SCHEDULED_JOBS: &str = "jobfold_scheduled_jobs";
/// Leased jobs whose lease ran out.
pub const EXPIRED_LEASES: &str = "jobfold_expired_leases";
/// Quarantined jobs waiting for an operator, by owner.
pub const QUARANTINED: &str = "jobfold_quarantined";
/// Rows in `dead_letters`.
pub const DEAD_LETTERS: &str = "jobfold_dead_letters";

/// Commits of jobfold's sessions waiting for the synchronous standby.
pub const COMMITS_WAITING_FOR_STANDBY: &str = "jobfold_commits_waiting_for_standby";
/// Seconds the longest of them has waited.
pub const LONGEST_STANDBY_WAIT_SECONDS: &str = "jobfold_longest_standby_wait_seconds";

/// Times a pool found the Postgres primary on another host and moved there.
pub const PRIMARY_CHANGES_TOTAL: &str = "jobfold_database_primary_changes_total";
/// With several hosts in `database_url`: 1 while one accepts writes, 0 while none does.
pub const PRIMARY_UP: &str = "jobfold_database_primary_up";

/// Describes every metric above to the installed recorder.
pub fn describe() {
    describe_counter!(ACCEPTED_TOTAL, Unit::Count, "Jobs accepted (new jobs, not retries).");
    describe_gauge!(JOBS, Unit::Count, "Unfinished jobs by state.");
    describe_gauge!(
        UNFINISHED_JOBS,
        Unit::Count,
        "Accepted jobs not yet succeeded, quarantined, superseded or cancelled."
    );
    describe_gauge!(
        OLDEST_QUEUED_AGE_SECONDS,
        Unit::Seconds,
        "Seconds since the oldest queued job became due (accepted, or its run_at passed)."
    );
    describe_gauge!(SCHEDULED_JOBS, Unit::Count, "Queued jobs scheduled for later (run_at ahead).");
    describe_gauge!(EXPIRED_LEASES, Unit::Count, "Leased jobs whose lease ran out.");
    describe_gauge!(QUARANTINED, Unit::Count, "Quarantined jobs by owner.");
    describe_gauge!(DEAD_LETTERS, Unit::Count, "Rows in dead_letters.");
    describe_gauge!(
        COMMITS_WAITING_FOR_STANDBY,
        Unit::Count,
        "Commits of jobfold's sessions waiting for the synchronous standby to have them."
    );
    describe_gauge!(
        LONGEST_STANDBY_WAIT_SECONDS,
        Unit::Seconds,
        "Seconds the longest commit waiting for the synchronous standby has waited."
    );
    describe_counter!(
        PRIMARY_CHANGES_TOTAL,
        Unit::Count,
        "Times a pool found the Postgres primary on another host (a failover) and moved."
    );
    describe_gauge!(
        PRIMARY_UP,
        Unit::Count,
        "1 while a host of database_url accepts writes, 0 while none does."
    );
}
