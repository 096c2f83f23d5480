//! Metric names of what both services report: jobs accepted (by whichever intake), and the
//! gauges over the job tables ([`crate::gauges`]). Each service names its own in its
//! `metrics` module (`jobfold_processor::metrics`, `jobfold_relay::metrics`).
//!
//! Names follow `jobfold_<thing>_<unit>`; counters end in `_total`. Labels have bounded
//! cardinality (topic, partition, outcome), never a job id.

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

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

/// What each metric above is, for the installed recorder.
const DESCRIPTIONS: &[Description] = &[
    Description::new(
        ACCEPTED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Jobs accepted (new jobs, not retries).",
    ),
    Description::new(JOBS, Shape::Gauge, Unit::Count, "Unfinished jobs by state."),
    Description::new(
        UNFINISHED_JOBS,
        Shape::Gauge,
        Unit::Count,
        "Accepted jobs not yet succeeded, quarantined, superseded or cancelled.",
    ),
    Description::new(
        OLDEST_QUEUED_AGE_SECONDS,
        Shape::Gauge,
        Unit::Seconds,
        "Seconds since the oldest queued job became due (accepted, or its run_at passed).",
    ),
    Description::new(
        SCHEDULED_JOBS,
        Shape::Gauge,
        Unit::Count,
        "Queued jobs scheduled for later (run_at ahead).",
    ),
    Description::new(EXPIRED_LEASES, Shape::Gauge, Unit::Count, "Leased jobs whose lease ran out."),
    Description::new(QUARANTINED, Shape::Gauge, Unit::Count, "Quarantined jobs by owner."),
    Description::new(DEAD_LETTERS, Shape::Gauge, Unit::Count, "Rows in dead_letters."),
    Description::new(
        COMMITS_WAITING_FOR_STANDBY,
        Shape::Gauge,
        Unit::Count,
        "Commits of jobfold's sessions waiting for the synchronous standby to have them.",
    ),
    Description::new(
        LONGEST_STANDBY_WAIT_SECONDS,
        Shape::Gauge,
        Unit::Seconds,
        "Seconds the longest commit waiting for the synchronous standby has waited.",
    ),
    Description::new(
        PRIMARY_CHANGES_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Times a pool found the Postgres primary on another host (a failover) and moved.",
    ),
    Description::new(
        PRIMARY_UP,
        Shape::Gauge,
        Unit::Count,
        "1 while a host of database_url accepts writes, 0 while none does.",
    ),
];

/// What a metric measures: a count that only grows, a level, or a distribution.
#[derive(Debug, Clone, Copy)]
pub enum Shape {
    Counter,
    Gauge,
    Histogram,
}

/// One metric's name, shape, unit and help text, as the exporter shows them.
#[derive(Debug)]
pub struct Description {
    name: &'static str,
    shape: Shape,
    unit: Unit,
    help: &'static str,
}

impl Description {
    pub const fn new(name: &'static str, shape: Shape, unit: Unit, help: &'static str) -> Self {
        Self { name, shape, unit, help }
    }
}

/// Describes each of `descriptions` to the installed recorder.
pub fn describe_all(descriptions: &[Description]) {
    for d in descriptions {
        match d.shape {
            Shape::Counter => describe_counter!(d.name, d.unit, d.help),
            Shape::Gauge => describe_gauge!(d.name, d.unit, d.help),
            Shape::Histogram => describe_histogram!(d.name, d.unit, d.help),
        }
    }
}

/// Describes every metric above to the installed recorder.
pub fn describe() {
    describe_all(DESCRIPTIONS);
}
