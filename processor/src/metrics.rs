//! The processor's metric names, described once at start (with the shared ones of
//! [`jobfold_common::metrics`]: the processor publishes the job gauges).
//!
//! Names follow `jobfold_<thing>_<unit>`; counters end in `_total`. Labels have bounded
//! cardinality (topic, partition, kind, outcome), never a job id.

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

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

/// Describes every metric above to the installed recorder.
pub fn describe() {
    jobfold_common::metrics::describe();
    describe_counter!(DEAD_LETTERS_TOTAL, Unit::Count, "Undecodable messages dead-lettered.");
    describe_counter!(
        ACCEPTS_NOT_DURABLE_TOTAL,
        Unit::Count,
        "HTTP accepts answered 503, not durable within accept.commit_timeout (their commit goes on)."
    );
    describe_counter!(
        HTTP_REFUSED_TOTAL,
        Unit::Count,
        "HTTP requests refused before a handler ran, by reason."
    );
    describe_counter!(
        CALLBACKS_TOTAL,
        Unit::Count,
        "Callbacks of handlers that answered 202, by route and outcome."
    );
    describe_counter!(
        AUTH_LOCKOUTS_TOTAL,
        Unit::Count,
        "Client addresses refused for a minute after too many failed authentications."
    );
    describe_counter!(
        AUDIT_FAILED_TOTAL,
        Unit::Count,
        "Changes made whose audit row could not be written."
    );
    describe_counter!(
        INTAKE_DUPLICATES_TOTAL,
        Unit::Count,
        "Intake requests already accepted before."
    );
    describe_gauge!(IN_FLIGHT, Unit::Count, "Jobs running in this processor.");
    describe_gauge!(
        BUFFERED_MESSAGES,
        Unit::Count,
        "Messages held in memory: waiting behind their document's running job, or running."
    );
    describe_gauge!(PAUSED_PARTITIONS, Unit::Count, "Partitions paused: their buffer is full.");
    describe_counter!(
        PARTITION_PAUSES_TOTAL,
        Unit::Count,
        "Times a partition was paused because it held its max_buffered share."
    );
    describe_gauge!(
        WAITING_FOR_HANDLER,
        Unit::Count,
        "Documents whose next job waits for a kind this processor has no handler for."
    );
    describe_gauge!(
        ASSIGNED_PARTITIONS,
        Unit::Count,
        "Partitions of the events topic this processor holds in its consumer group."
    );
    describe_counter!(
        GROUP_REBALANCES_TOTAL,
        Unit::Count,
        "Rebalances of the processors' group this processor took part in, each ended by an \
         assignment (empty when nothing moved to it)."
    );
    describe_counter!(COMPLETED_TOTAL, Unit::Count, "Attempts completed, by outcome.");
    describe_counter!(
        DUPLICATES_SKIPPED_TOTAL,
        Unit::Count,
        "Redelivered dispatch events skipped as duplicates, running nothing."
    );
    describe_histogram!(
        TRANSACTION_JOBS,
        Unit::Count,
        "Jobs per transaction that shares one among the work waiting at once, by transaction."
    );
    describe_counter!(
        FENCED_COMPLETIONS_TOTAL,
        Unit::Count,
        "Completions discarded: another generation held the job."
    );
    describe_counter!(
        HEARTBEAT_STATEMENTS_TOTAL,
        Unit::Count,
        "Heartbeat statements, each renewing every lease of this processor that was due."
    );
    describe_gauge!(LEASES_HELD, Unit::Count, "Leases this processor holds and keeps alive.");
    describe_histogram!(
        LEASE_MARGIN_SECONDS,
        Unit::Seconds,
        "How long a lease still had to run when its heartbeat renewed it."
    );
    describe_gauge!(
        LEASE_MARGIN_MIN_SECONDS,
        Unit::Seconds,
        "The least time a lease renewed by the last heartbeat still had to run."
    );
    describe_gauge!(
        QUOTA_WAITING,
        Unit::Count,
        "Jobs waiting for their kind's quota in this processor (no slot held, no attempt spent)."
    );
    describe_counter!(
        QUOTA_TAKEN_TOTAL,
        Unit::Count,
        "Quota this processor took, by kind and unit."
    );
    describe_gauge!(
        QUOTA_PAUSED_SECONDS,
        Unit::Seconds,
        "How long a kind stays paused by its outside service's 429, at most its max_retry_after."
    );
    describe_counter!(
        CRASHED_RUNS_TOTAL,
        Unit::Count,
        "Runs that died with their process before anything of them committed; each counts as an attempt."
    );
    describe_gauge!(
        PERIODIC_HOLDER,
        Unit::Count,
        "1 while this processor holds the periodic schedules' lease."
    );
    describe_counter!(
        PERIODIC_JOBS_TOTAL,
        Unit::Count,
        "Periodic jobs accepted, one per tick, by schedule."
    );
    describe_counter!(
        PERIODIC_REFUSED_TOTAL,
        Unit::Count,
        "Ticks whose periodic job was refused (kind unknown, input invalid); each is passed."
    );
    describe_gauge!(KIND_PAUSED, Unit::Count, "1 while an operator has the kind paused.");
    describe_counter!(
        PAUSED_PASSED_OVER_TOTAL,
        Unit::Count,
        "Dispatches passed over because their kind was paused; each job waits for the resume."
    );
    describe_counter!(
        RESUMED_DISPATCHES_TOTAL,
        Unit::Count,
        "Jobs passed over while their kind was paused, dispatched again after the resume."
    );
    describe_counter!(
        CRASHED_KEPT_APART_TOTAL,
        Unit::Count,
        "Dispatches of jobs a death found running before, held for a later lease transaction: one such job at a time runs inside one."
    );
    describe_counter!(
        TASK_FAILURES_TOTAL,
        Unit::Count,
        "Background tasks that ended while the processor ran; the processor then stops."
    );
    describe_counter!(
        CONSUMER_ERRORS_TOTAL,
        Unit::Count,
        "Errors a Kafka consumer returned instead of a message, by stage and error code."
    );
    describe_gauge!(
        QUOTA_RATE_FACTOR,
        Unit::Count,
        "The share of a kind's rate limits in force: 1 unless its outside service answered 429."
    );
    describe_counter!(
        THROTTLED_TOTAL,
        Unit::Count,
        "Attempts refused for an outside service's quota (429), by kind."
    );
    describe_counter!(HANDLER_RUNS_TOTAL, Unit::Count, "Handler runs started.");
    describe_histogram!(HANDLER_DURATION_SECONDS, Unit::Seconds, "Handler duration by kind.");
    describe_counter!(
        RETENTION_DELETED_TOTAL,
        Unit::Count,
        "Rows deleted by retention ([retention]), by table."
    );
    describe_counter!(REAPER_DISPATCHED_TOTAL, Unit::Count, "Jobs dispatched again by the reaper.");
    describe_counter!(CANCELLED_TOTAL, Unit::Count, "Jobs cancelled, by the state they were in.");
    describe_counter!(
        REPLAYED_TOTAL,
        Unit::Count,
        "Quarantined jobs replayed, one at a time or in bulk."
    );
    describe_counter!(
        DEAD_LETTER_ACTIONS_TOTAL,
        Unit::Count,
        "Dead letters re-injected to the intake topic or deleted."
    );
    describe_gauge!(
        CONSUMER_LAG,
        Unit::Count,
        "Messages after the lowest offset in flight, by topic and partition."
    );
    describe_histogram!(
        ACCEPT_TO_COMPLETE_SECONDS,
        Unit::Seconds,
        "From acceptance to the job's end, by kind and outcome."
    );
    describe_counter!(
        MESSAGE_RETRIES_TOTAL,
        Unit::Count,
        "Messages that could not be handled this time and are handled again, by stage."
    );
}
