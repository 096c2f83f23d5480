//! What the relay reports as it runs. Each event writes its log line and moves its metrics in
//! one call (`emit`), with the same fields, so that the two cannot drift apart. Metric names
//! are in [`crate::metrics`].

use crate::metrics as m;
use crate::publish::Outcome;

/// This relay took the active lock: it relays until it loses it or shuts down.
#[derive(Debug)]
pub struct BecameActive {
    pub lock_key: i64,
}

impl BecameActive {
    pub fn emit(self) {
        tracing::info!(lock_key = self.lock_key, "Active: relaying the outbox.");
        metrics::gauge!(m::RELAY_ACTIVE).set(1.0);
    }
}

/// This relay stopped relaying (`error`: why, if it failed) and stands by.
#[derive(Debug)]
pub struct StoodDown<'a> {
    pub error: Option<&'a anyhow::Error>,
}

impl StoodDown<'_> {
    pub fn emit(self) {
        metrics::gauge!(m::RELAY_ACTIVE).set(0.0);
        if let Some(e) = self.error {
            tracing::warn!(error = %format!("{e:#}"), "Relaying stopped; standing by again.");
        }
    }
}

/// A batch's delivery reports came in and its delivered events were recorded (`recorded`):
/// how many went out, how long each took from becoming available, what Kafka refused (parked)
/// and what failed for a reason that may pass (sent again).
#[derive(Debug)]
pub struct BatchSettled<'a> {
    pub outcome: &'a Outcome,
    pub recorded: u64,
}

impl BatchSettled<'_> {
    pub fn emit(self) {
        let outcome = self.outcome;
        metrics::counter!(m::RELAY_PUBLISHED_TOTAL).increment(self.recorded);
        let now = chrono::Utc::now();
        let latency = metrics::histogram!(m::RELAY_PUBLISH_LATENCY_SECONDS);
        for (_, available_at) in &outcome.delivered {
            latency.record((now - *available_at).as_seconds_f64().max(0.0));
        }
        if !outcome.refused.is_empty() {
            metrics::counter!(m::RELAY_REFUSED_TOTAL).increment(outcome.refused.len() as u64);
        }
        if let Some((seq, error)) = outcome.failed.first() {
            metrics::counter!(m::RELAY_DELIVERY_ERRORS_TOTAL)
                .increment(outcome.failed.len() as u64);
            tracing::warn!(
                failed = outcome.failed.len(),
                held_back = outcome.held_back.len(),
                first_seq = seq,
                error = %error,
                "Some events were not delivered; they are tried again."
            );
        }
    }
}
