//! The processor's metric names, described once at start (with the shared ones of
//! [`jobfold_common::metrics`]: the processor publishes the job gauges).
//!
//! Names follow `jobfold_<thing>_<unit>`; counters end in `_total`. Labels have bounded
//! cardinality (topic, partition, kind, outcome), never a job id.

use jobfold_common::metrics::{Description, Shape};
use metrics::Unit;

/// HTTP accepts answered 503 because they were not durable within `accept.commit_timeout`.
pub const ACCEPTS_NOT_DURABLE_TOTAL: &str = "jobfold_accepts_not_durable_total";
/// Messages the intake could not decode, stored in dead_letters.
pub const DEAD_LETTERS_TOTAL: &str = "jobfold_dead_letters_total";
/// Intake requests skipped because their request id was accepted before.
pub const INTAKE_DUPLICATES_TOTAL: &str = "jobfold_intake_duplicates_total";
/// Jobs running in this processor.
pub const IN_FLIGHT: &str = "jobfold_in_flight";
/// Gauge: messages the processor holds in memory (waiting behind their document, or running).
pub const BUFFERED_MESSAGES: &str = "jobfold_buffered_messages";
/// Gauge: partitions paused because they hold their `max_buffered` share.
pub const PAUSED_PARTITIONS: &str = "jobfold_paused_partitions";
/// Counter: times a partition was paused because it held its `max_buffered` share.
pub const PARTITION_PAUSES_TOTAL: &str = "jobfold_partition_pauses_total";
/// Documents whose next job is of a kind this processor has no handler for: they wait
/// (a rolling deploy adding a kind) rather than being quarantined.
pub const WAITING_FOR_HANDLER: &str = "jobfold_waiting_for_handler";
/// Partitions of the events topic this processor holds in its consumer group.
pub const ASSIGNED_PARTITIONS: &str = "jobfold_assigned_partitions";
/// Rebalances of the processors' group this processor took part in.
pub const GROUP_REBALANCES_TOTAL: &str = "jobfold_group_rebalances_total";
/// Gauge: partitions of the events topic the stable group gave to no member, at this
/// processor's last look (`processor.assignment_check`).
pub const UNOWNED_PARTITIONS: &str = "jobfold_group_unowned_partitions";
/// Counter: times this processor left and joined its group again because partitions stayed
/// unowned (a static member died handing them on).
pub const GROUP_REJOINS: &str = "jobfold_group_rejoins_total";
/// Attempts completed, by outcome: succeeded, retry_scheduled, throttled, snoozed, released,
/// quarantined, superseded.
pub const COMPLETED_TOTAL: &str = "jobfold_completed_total";
/// Redelivered dispatch events skipped as duplicates (by their job row), running nothing.
pub const DUPLICATES_SKIPPED_TOTAL: &str = "jobfold_duplicates_skipped_total";
/// Jobs per lease, completion or intake transaction (`transaction` = `lease` |
/// `completion` | `intake` | `http`): work waiting at once shares one transaction.
pub const TRANSACTION_JOBS: &str = "jobfold_transaction_jobs";
/// Completions discarded because another generation held the job (zombie workers).
pub const FENCED_COMPLETIONS_TOTAL: &str = "jobfold_fenced_completions_total";
/// Heartbeat statements: one a beat renews every lease of this processor that is due.
pub const HEARTBEAT_STATEMENTS_TOTAL: &str = "jobfold_heartbeat_statements_total";
/// Gauge: leases this processor holds and keeps alive.
pub const LEASES_HELD: &str = "jobfold_leases_held";
/// How long a lease still had to run when its heartbeat renewed it.
pub const LEASE_MARGIN_SECONDS: &str = "jobfold_lease_margin_seconds";
/// Gauge: the least of those margins at the last heartbeat (near 0: leases about to lapse).
pub const LEASE_MARGIN_MIN_SECONDS: &str = "jobfold_lease_margin_min_seconds";
/// Gauge, by kind: jobs waiting for their kind's quota (rate limit or a 429's pause) in this
/// processor; they hold no slot and have spent no attempt.
pub const QUOTA_WAITING: &str = "jobfold_quota_waiting";
/// Counter, by kind and unit (`requests`, `cost`): quota this processor took.
pub const QUOTA_TAKEN_TOTAL: &str = "jobfold_quota_taken_total";
/// Gauge, by kind: the share of its rate limits in force, 1 unless 429s cut it.
pub const QUOTA_RATE_FACTOR: &str = "jobfold_quota_rate_factor";
/// Gauge, by kind: how long it stays paused by a 429 (its `Retry-After`, cut to the kind's
/// `max_retry_after`), as last read from the table.
pub const QUOTA_PAUSED_SECONDS: &str = "jobfold_quota_paused_seconds";
/// Counter: runs found to have died with their process (a lease transaction's inline runs
/// whose transaction never committed), each counted as an attempt of its job.
pub const CRASHED_RUNS_TOTAL: &str = "jobfold_crashed_runs_total";
/// Counter: dispatches of jobs a death found running before, held for a later lease
/// transaction because another such job of this process was running inside one
/// ([`crate::lease::Wary`]).
pub const CRASHED_KEPT_APART_TOTAL: &str = "jobfold_crashed_kept_apart_total";
/// Counter, by kind and call (`run`, `commit`, `cost`): panics raised in handlers' code, each
/// its job's failure, reported without a backtrace ([`crate::panics`]).
pub const HANDLER_PANICS_TOTAL: &str = "jobfold_handler_panics_total";
/// Gauge, by kind this processor runs: 1 while an operator has it paused (as last read from
/// `kind_pauses`), else 0.
pub const KIND_PAUSED: &str = "jobfold_kind_paused";
/// Counter, by kind: dispatches passed over because their kind was paused (each job waits,
/// its attempt unspent, to be dispatched again on resume).
pub const PAUSED_PASSED_OVER_TOTAL: &str = "jobfold_paused_passed_over_total";
/// Gauge: 1 while this processor holds the periodic schedules' lease.
pub const PERIODIC_HOLDER: &str = "jobfold_periodic_holder";
/// Counter, by schedule: periodic jobs accepted (one per tick).
pub const PERIODIC_JOBS_TOTAL: &str = "jobfold_periodic_jobs_total";
/// Counter, by schedule: ticks whose job accept refused (its kind unknown, its input
/// invalid); each is passed, its error in `periodic_schedules.last_error`.
pub const PERIODIC_REFUSED_TOTAL: &str = "jobfold_periodic_refused_total";
/// Counter: jobs passed over while paused and dispatched again once their kind resumed.
pub const RESUMED_DISPATCHES_TOTAL: &str = "jobfold_resumed_dispatches_total";
/// Counter, by task: background tasks that ended while the processor ran (it then stops,
/// exiting non-zero, so that it is restarted).
pub const TASK_FAILURES_TOTAL: &str = "jobfold_task_failures_total";
/// Counter, by stage (`dispatch`, `intake`) and librdkafka error code: errors a consumer
/// returned instead of a message (each followed by a growing pause).
pub const CONSUMER_ERRORS_TOTAL: &str = "jobfold_consumer_errors_total";
/// Counter, by kind: attempts refused for an outside service's quota (429).
pub const THROTTLED_TOTAL: &str = "jobfold_throttled_total";
/// Handler runs started (compare with completions: the difference is crashes and fencing).
pub const HANDLER_RUNS_TOTAL: &str = "jobfold_handler_runs_total";
/// Handler duration by kind.
pub const HANDLER_DURATION_SECONDS: &str = "jobfold_handler_duration_seconds";
/// Counter: rows deleted by retention, by table.
pub const RETENTION_DELETED_TOTAL: &str = "jobfold_retention_deleted_total";
/// Jobs the reaper dispatched again, by reason (lease_expired, stalled).
pub const REAPER_DISPATCHED_TOTAL: &str = "jobfold_reaper_dispatched_total";
/// Jobs cancelled, by the state they were in.
pub const CANCELLED_TOTAL: &str = "jobfold_cancelled_total";
/// Quarantined jobs replayed, by how (`one`, `bulk`).
pub const REPLAYED_TOTAL: &str = "jobfold_replayed_total";
/// Dead letters acted on, by action (`reinjected`, `deleted`).
pub const DEAD_LETTER_ACTIONS_TOTAL: &str = "jobfold_dead_letter_actions_total";
/// Messages of a partition after the lowest offset still in flight (what a restart would
/// read again), by topic and partition; 0 from members not holding the partition.
pub const CONSUMER_LAG: &str = "jobfold_consumer_lag";
/// From acceptance to the job's end, by kind and outcome.
pub const ACCEPT_TO_COMPLETE_SECONDS: &str = "jobfold_accept_to_complete_seconds";
/// Messages that could not be handled and are handled again, by stage (`dispatch`: the events
/// topic; `intake`: the requests topic).
pub const MESSAGE_RETRIES_TOTAL: &str = "jobfold_message_retries_total";
/// HTTP requests refused before a handler ran, by reason (`host`, `origin`, `token`, `role`,
/// `failures`; `signature`: a handler's callback not signed with its kind's secret;
/// `overloaded`: over `http.max_concurrent_requests`), or cut by `http.request_timeout`
/// (`timeout`).
pub const HTTP_REFUSED_TOTAL: &str = "jobfold_http_refused_total";
/// Callbacks of handlers that answered 202, by route (`heartbeat`, `complete`) and outcome
/// (`written`; `refused`: the job is not leased at that generation; `not_found`).
pub const CALLBACKS_TOTAL: &str = "jobfold_callbacks_total";
/// Client addresses that reached `http.auth_failures_per_minute` (refused for the minute).
pub const AUTH_LOCKOUTS_TOTAL: &str = "jobfold_auth_lockouts_total";
/// Changes made whose audit row could not be written (logged as errors).
pub const AUDIT_FAILED_TOTAL: &str = "jobfold_audit_failed_total";

/// What each metric above is, for the installed recorder.
const DESCRIPTIONS: &[Description] = &[
    Description::new(
        DEAD_LETTERS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Undecodable messages dead-lettered.",
    ),
    Description::new(
        ACCEPTS_NOT_DURABLE_TOTAL,
        Shape::Counter,
        Unit::Count,
        "HTTP accepts answered 503, not durable within accept.commit_timeout (their commit goes on).",
    ),
    Description::new(
        HTTP_REFUSED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "HTTP requests refused before a handler ran, by reason.",
    ),
    Description::new(
        CALLBACKS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Callbacks of handlers that answered 202, by route and outcome.",
    ),
    Description::new(
        AUTH_LOCKOUTS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Client addresses refused for a minute after too many failed authentications.",
    ),
    Description::new(
        AUDIT_FAILED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Changes made whose audit row could not be written.",
    ),
    Description::new(
        INTAKE_DUPLICATES_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Intake requests already accepted before.",
    ),
    Description::new(IN_FLIGHT, Shape::Gauge, Unit::Count, "Jobs running in this processor."),
    Description::new(
        BUFFERED_MESSAGES,
        Shape::Gauge,
        Unit::Count,
        "Messages held in memory: waiting behind their document's running job, or running.",
    ),
    Description::new(
        PAUSED_PARTITIONS,
        Shape::Gauge,
        Unit::Count,
        "Partitions paused: their buffer is full.",
    ),
    Description::new(
        PARTITION_PAUSES_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Times a partition was paused because it held its max_buffered share.",
    ),
    Description::new(
        WAITING_FOR_HANDLER,
        Shape::Gauge,
        Unit::Count,
        "Documents whose next job waits for a kind this processor has no handler for.",
    ),
    Description::new(
        ASSIGNED_PARTITIONS,
        Shape::Gauge,
        Unit::Count,
        "Partitions of the events topic this processor holds in its consumer group.",
    ),
    Description::new(
        UNOWNED_PARTITIONS,
        Shape::Gauge,
        Unit::Count,
        "Partitions of the events topic the stable group gave to no member, at this \
         processor's last look.",
    ),
    Description::new(
        GROUP_REJOINS,
        Shape::Counter,
        Unit::Count,
        "Times this processor left and joined its group again so that partitions no member \
         held were given out.",
    ),
    Description::new(
        GROUP_REBALANCES_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Rebalances of the processors' group this processor took part in, each ended by an \
         assignment (empty when nothing moved to it).",
    ),
    Description::new(
        COMPLETED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Attempts completed, by outcome.",
    ),
    Description::new(
        DUPLICATES_SKIPPED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Redelivered dispatch events skipped as duplicates, running nothing.",
    ),
    Description::new(
        TRANSACTION_JOBS,
        Shape::Histogram,
        Unit::Count,
        "Jobs per transaction that shares one among the work waiting at once, by transaction.",
    ),
    Description::new(
        FENCED_COMPLETIONS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Completions discarded: another generation held the job.",
    ),
    Description::new(
        HEARTBEAT_STATEMENTS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Heartbeat statements, each renewing every lease of this processor that was due.",
    ),
    Description::new(
        LEASES_HELD,
        Shape::Gauge,
        Unit::Count,
        "Leases this processor holds and keeps alive.",
    ),
    Description::new(
        LEASE_MARGIN_SECONDS,
        Shape::Histogram,
        Unit::Seconds,
        "How long a lease still had to run when its heartbeat renewed it.",
    ),
    Description::new(
        LEASE_MARGIN_MIN_SECONDS,
        Shape::Gauge,
        Unit::Seconds,
        "The least time a lease renewed by the last heartbeat still had to run.",
    ),
    Description::new(
        QUOTA_WAITING,
        Shape::Gauge,
        Unit::Count,
        "Jobs waiting for their kind's quota in this processor (no slot held, no attempt spent).",
    ),
    Description::new(
        QUOTA_TAKEN_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Quota this processor took, by kind and unit.",
    ),
    Description::new(
        QUOTA_PAUSED_SECONDS,
        Shape::Gauge,
        Unit::Seconds,
        "How long a kind stays paused by its outside service's 429, at most its max_retry_after.",
    ),
    Description::new(
        CRASHED_RUNS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Runs that died with their process before anything of them committed; each counts as an attempt.",
    ),
    Description::new(
        PERIODIC_HOLDER,
        Shape::Gauge,
        Unit::Count,
        "1 while this processor holds the periodic schedules' lease.",
    ),
    Description::new(
        PERIODIC_JOBS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Periodic jobs accepted, one per tick, by schedule.",
    ),
    Description::new(
        PERIODIC_REFUSED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Ticks whose periodic job was refused (kind unknown, input invalid); each is passed.",
    ),
    Description::new(
        KIND_PAUSED,
        Shape::Gauge,
        Unit::Count,
        "1 while an operator has the kind paused.",
    ),
    Description::new(
        PAUSED_PASSED_OVER_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Dispatches passed over because their kind was paused; each job waits for the resume.",
    ),
    Description::new(
        RESUMED_DISPATCHES_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Jobs passed over while their kind was paused, dispatched again after the resume.",
    ),
    Description::new(
        CRASHED_KEPT_APART_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Dispatches of jobs a death found running before, held for a later lease transaction: one such job at a time runs inside one.",
    ),
    Description::new(
        HANDLER_PANICS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Panics raised in handlers' run, commit or cost, by kind and call: each fails its job's attempt, and is logged (one a second at most) without a backtrace.",
    ),
    Description::new(
        TASK_FAILURES_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Background tasks that ended while the processor ran; the processor then stops.",
    ),
    Description::new(
        CONSUMER_ERRORS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Errors a Kafka consumer returned instead of a message, by stage and error code.",
    ),
    Description::new(
        QUOTA_RATE_FACTOR,
        Shape::Gauge,
        Unit::Count,
        "The share of a kind's rate limits in force: 1 unless its outside service answered 429.",
    ),
    Description::new(
        THROTTLED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Attempts refused for an outside service's quota (429), by kind.",
    ),
    Description::new(HANDLER_RUNS_TOTAL, Shape::Counter, Unit::Count, "Handler runs started."),
    Description::new(
        HANDLER_DURATION_SECONDS,
        Shape::Histogram,
        Unit::Seconds,
        "Handler duration by kind.",
    ),
    Description::new(
        RETENTION_DELETED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Rows deleted by retention ([retention]), by table.",
    ),
    Description::new(
        REAPER_DISPATCHED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Jobs dispatched again by the reaper.",
    ),
    Description::new(
        CANCELLED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Jobs cancelled, by the state they were in.",
    ),
    Description::new(
        REPLAYED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Quarantined jobs replayed, one at a time or in bulk.",
    ),
    Description::new(
        DEAD_LETTER_ACTIONS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Dead letters re-injected to the intake topic or deleted.",
    ),
    Description::new(
        CONSUMER_LAG,
        Shape::Gauge,
        Unit::Count,
        "Messages after the lowest offset in flight, by topic and partition.",
    ),
    Description::new(
        ACCEPT_TO_COMPLETE_SECONDS,
        Shape::Histogram,
        Unit::Seconds,
        "From acceptance to the job's end, by kind and outcome.",
    ),
    Description::new(
        MESSAGE_RETRIES_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Messages that could not be handled this time and are handled again, by stage.",
    ),
];

/// Describes every metric above to the installed recorder.
pub fn describe() {
    jobfold_common::metrics::describe();
    jobfold_common::metrics::describe_all(DESCRIPTIONS);
}
