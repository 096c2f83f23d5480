//! The retry policy: when a failed or throttled attempt runs again.
//!
//! A failed attempt waits an exponential backoff with full jitter, with its kind's
//! `retry_base` and `retry_cap`. A throttled one (a 429: [`crate::quota`]) waits the
//! provider's pause, else `retry_base`, plus up to one `retry_base` of jitter, and spends no
//! attempt.

use std::time::Duration;

use jobfold_common::config::Config;
use rand::Rng;

/// Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^(attempt-1))],
/// with `kind`'s retry base and cap.
pub fn backoff(config: &Config, kind: &str, attempt: i32) -> Duration {
    let k = config.kind(kind);
    let exp = u32::try_from(attempt.saturating_sub(1)).unwrap_or(0).min(30);
    let ceiling = k.retry_base.saturating_mul(1 << exp).min(k.retry_cap);
    let millis = u64::try_from(ceiling.as_millis()).unwrap_or(u64::MAX);
    Duration::from_millis(rand::rng().random_range(0..=millis))
}

/// When a throttled job of `kind` runs again: after the pause (`retry_after`, else the
/// kind's `retry_base`) plus up to one `retry_base` of jitter.
pub fn throttled_delay(config: &Config, kind: &str, retry_after: Option<Duration>) -> Duration {
    let base = config.kind(kind).retry_base;
    let millis = u64::try_from(base.as_millis()).unwrap_or(u64::MAX);
    retry_after
        .unwrap_or(base)
        .saturating_add(Duration::from_millis(rand::rng().random_range(0..=millis)))
}
