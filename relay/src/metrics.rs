//! The relay's metric names, described once at start.
//!
//! Names follow `jobfold_<thing>_<unit>`; counters end in `_total`. Labels have bounded
//! cardinality (topic, outcome), never a job id.

use jobfold_common::metrics::{Description, Shape};
use metrics::Unit;

/// Outbox rows published and marked by the relay.
pub const RELAY_PUBLISHED_TOTAL: &str = "jobfold_relay_published_total";
/// Deliveries the broker refused or timed out (the rows stay unpublished and are retried).
pub const RELAY_DELIVERY_ERRORS_TOTAL: &str = "jobfold_relay_delivery_errors_total";
/// Unpublished outbox rows that are due.
pub const RELAY_BACKLOG: &str = "jobfold_relay_backlog";
/// Age of the oldest due, unpublished outbox row.
pub const RELAY_OLDEST_UNPUBLISHED_AGE_SECONDS: &str =
    "jobfold_relay_oldest_unpublished_age_seconds";
/// From an outbox row becoming available (its commit, or its due time) to its delivery report.
pub const RELAY_PUBLISH_LATENCY_SECONDS: &str = "jobfold_relay_publish_latency_seconds";
/// 1 while this relay holds the active lock, 0 while it stands by.
pub const RELAY_ACTIVE: &str = "jobfold_relay_active";
/// Published outbox rows deleted after the retention period.
pub const RELAY_PRUNED_TOTAL: &str = "jobfold_relay_pruned_total";
/// Events parked because Kafka refuses them for what they are, and those waiting behind
/// them in their documents.
pub const RELAY_PARKED: &str = "jobfold_relay_parked";
/// Documents whose events are held in the park.
pub const RELAY_PARKED_DOCUMENTS: &str = "jobfold_relay_parked_documents";
/// Events Kafka (or the relay's size check) refused for what they are; each is parked.
pub const RELAY_REFUSED_TOTAL: &str = "jobfold_relay_refused_total";
/// How long the cluster's oldest transaction holding an id has been open: the relay reads
/// only below it, so while it stays open nothing committed after it began is published.
pub const RELAY_HORIZON_AGE_SECONDS: &str = "jobfold_relay_horizon_age_seconds";

/// What each metric above is, for the installed recorder.
const DESCRIPTIONS: &[Description] = &[
    Description::new(
        RELAY_PUBLISHED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Events published and recorded (cursor moved or outbox row marked).",
    ),
    Description::new(
        RELAY_DELIVERY_ERRORS_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Deliveries refused or timed out; the rows are retried.",
    ),
    Description::new(
        RELAY_BACKLOG,
        Shape::Gauge,
        Unit::Count,
        "Events the relay still owes Kafka: after its log cursor, or due in the outbox.",
    ),
    Description::new(
        RELAY_OLDEST_UNPUBLISHED_AGE_SECONDS,
        Shape::Gauge,
        Unit::Seconds,
        "Age of the oldest due, unpublished outbox row.",
    ),
    Description::new(
        RELAY_PUBLISH_LATENCY_SECONDS,
        Shape::Histogram,
        Unit::Seconds,
        "From an outbox row becoming available to its delivery report.",
    ),
    Description::new(
        RELAY_ACTIVE,
        Shape::Gauge,
        Unit::Count,
        "1 while this relay is the active one.",
    ),
    Description::new(
        RELAY_PRUNED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Published outbox rows pruned.",
    ),
    Description::new(
        RELAY_PARKED,
        Shape::Gauge,
        Unit::Count,
        "Events parked: refused by Kafka, or waiting behind a refused event of their document.",
    ),
    Description::new(
        RELAY_PARKED_DOCUMENTS,
        Shape::Gauge,
        Unit::Count,
        "Documents with parked events.",
    ),
    Description::new(
        RELAY_REFUSED_TOTAL,
        Shape::Counter,
        Unit::Count,
        "Events refused for what they are (size, bytes) and parked.",
    ),
    Description::new(
        RELAY_HORIZON_AGE_SECONDS,
        Shape::Gauge,
        Unit::Seconds,
        "Age of the cluster's oldest transaction holding an id; the relay reads below it.",
    ),
];

/// Describes every metric above to the installed recorder.
pub fn describe() {
    jobfold_common::metrics::describe_all(DESCRIPTIONS);
}
