//! The retry policy: when a failed or throttled attempt runs again, and how the processor's
//! own steps wait before they are tried again.
//!
//! A failed attempt waits an exponential backoff with full jitter, with its kind's
//! `retry_base` and `retry_cap`. A throttled one (a 429: [`crate::quota`]) waits the
//! provider's pause, else `retry_base`, plus up to one `retry_base` of jitter, and spends no
//! attempt.
//!
//! A step that failed for a reason outside the job (the database unreachable while a
//! message is dispatched, a completion committed, an intake batch accepted) is tried again
//! by its task after [`Again`]'s pauses, spending nothing of the job's.

use std::time::Duration;

use crate::handler::HandlerError;
use chrono::{DateTime, Utc};
use jobfold_common::config::Config;
use rand::Rng;
use tokio_util::sync::CancellationToken;

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

/// When the `attempt`-th attempt of a job of `kind` that failed with `error` runs again:
/// at once if its processor gave it back (`released`); when its kind's pause ends if it was
/// throttled; when it asked for if it snoozed; else after the backoff, and no sooner than
/// an outside service's `Retry-After` (bounded before: `max_retry_after`, the kind's
/// `crash_backoff`). Saturates rather than fail: the latest time there is.
pub fn next_attempt_at(
    config: &Config,
    kind: &str,
    attempt: i32,
    error: Option<&HandlerError>,
    released: bool,
) -> DateTime<Utc> {
    let delay = if released {
        Duration::ZERO
    } else if error.is_some_and(|e| e.throttled) {
        // Throttled: its kind's pause (Retry-After, else retry_base), spread over one
        // retry_base so the jobs throttled together do not come back together.
        throttled_delay(config, kind, error.and_then(|e| e.retry_after))
    } else if let Some(e) = error.filter(|e| e.snoozed) {
        // Snoozed: when it asked for, this job alone.
        e.retry_after.unwrap_or_default()
    } else {
        backoff(config, kind, attempt).max(error.and_then(|e| e.retry_after).unwrap_or_default())
    };
    chrono::Duration::from_std(delay)
        .ok()
        .and_then(|d| Utc::now().checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// The pauses between tries of a step that failed for a reason outside the job: 100 ms,
/// doubling up to 10 s.
#[derive(Debug)]
pub struct Again {
    next: Duration,
}

impl Again {
    pub const FIRST: Duration = Duration::from_millis(100);
    pub const LONGEST: Duration = Duration::from_secs(10);

    pub const fn new() -> Self {
        Self { next: Self::FIRST }
    }

    /// The pause the next [`Again::pause`] takes.
    pub const fn next(&self) -> Duration {
        self.next
    }

    /// Waits the next pause, and doubles the one after; false, at once, if `stop` is (or
    /// gets) cancelled first.
    pub async fn pause(&mut self, stop: &CancellationToken) -> bool {
        let pause = self.next;
        self.next = (self.next * 2).min(Self::LONGEST);
        tokio::select! {
            biased;
            () = stop.cancelled() => false,
            () = tokio::time::sleep(pause) => true,
        }
    }
}

impl Default for Again {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pauses_double_up_to_the_longest_and_a_stop_ends_them() {
        let mut again = Again::new();
        // A first pause is waited out.
        assert!(again.pause(&CancellationToken::new()).await);
        let stopped = CancellationToken::new();
        stopped.cancel();
        let mut pauses = Vec::new();
        for _ in 0..8 {
            pauses.push(again.next().as_millis());
            assert!(!again.pause(&stopped).await, "a stopped task does not wait");
        }
        assert_eq!(pauses, [200, 400, 800, 1600, 3200, 6400, 10_000, 10_000]);
    }
}
