//! Provider quotas: per-kind rate limits held by all of a group's processors together, and a
//! kind backing off when its outside service answers 429.
//!
//! - **Limits** (`[kinds.<kind>] rate_per_second`, `cost_per_minute`): two token buckets per
//!   kind in Postgres (`kind_quotas`), shared by every processor. A job takes one request
//!   and its cost ([`crate::handler::Handler::cost`]) *before* its lease: a job waiting for
//!   quota has spent no attempt and holds none of the process's slots. One statement per
//!   job of a limited kind (`take_kind_quota`); kinds without limits cost nothing here.
//! - **Throttling**: an attempt that failed with [`HandlerError::throttled`] (a remote
//!   handler's 429) is retried without spending an attempt, and its kind waits for the
//!   `Retry-After` (else its `retry_base`) in every processor; its limits halve (at most
//!   once a second, down to 1/16) and grow back linearly over [`RECOVERY`]. Processors
//!   learn of each other's pauses by polling the table once a [`POLL`].
//!
//! In one processor, a kind's jobs wait for quota one at a time, in order (a gate): the job
//! at the gate holds it until it also has its process slot, so that quota is never taken
//! far ahead of the work and let out in a burst.
//!
//! [`HandlerError::throttled`]: crate::handler::HandlerError::throttled

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::internal_events::KindThrottled;
use crate::metrics as pm;
use jobfold_common::config::Config;
use sqlx::PgPool;
use tokio::sync::OwnedMutexGuard;
use tokio_util::sync::CancellationToken;

/// How long a kind's limits take to grow back from a halving to the full rate.
pub const RECOVERY: Duration = Duration::from_secs(60);
/// How often a processor reads the pauses and factors the others set.
pub const POLL: Duration = Duration::from_secs(1);
/// The longest a waiting job sleeps before asking again (a pause may end early).
const LONGEST_NAP: Duration = Duration::from_secs(5);

/// A kind's configured limits, per second.
#[derive(Debug, Clone, Copy)]
struct Limit {
    requests_per_second: f64,
    cost_per_second: f64,
    /// A bucket holds a second's requests (at least one) and a minute's cost.
    requests_cap: f64,
    cost_cap: f64,
}

/// The quotas of the kinds one processor runs.
pub struct Quotas {
    pool: PgPool,
    limits: HashMap<String, Limit>,
    /// Per limited kind: the gate its jobs pass one at a time.
    gates: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
    /// Kinds paused by a 429, here or (as last polled) in another processor.
    paused: Mutex<HashMap<String, Instant>>,
    /// Per kind: jobs waiting here, for the gauge.
    waiting: Mutex<HashMap<String, i64>>,
    retry_base: HashMap<String, Duration>,
    default_retry_base: Duration,
    /// The longest pause a kind takes (`max_retry_after`), whatever the table says.
    max_pause: HashMap<String, Duration>,
    default_max_pause: Duration,
}

impl std::fmt::Debug for Quotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quotas").field("limits", &self.limits).finish_non_exhaustive()
    }
}

/// Held from a job's admission until it has its process slot; then dropped.
#[derive(Debug)]
pub struct Admitted {
    _gate: Option<OwnedMutexGuard<()>>,
}

impl Quotas {
    /// The limits of `config`'s kinds; [`Quotas::poll`] keeps the shared pauses current.
    pub fn new(config: &Config, pool: PgPool) -> Arc<Self> {
        let mut limits = HashMap::new();
        for kind in config.kinds.keys() {
            let k = config.kind(kind);
            if k.rate_per_second.is_none() && k.cost_per_minute.is_none() {
                continue;
            }
            let requests_per_second = k.rate_per_second.unwrap_or(0.0);
            let cost_per_minute = k.cost_per_minute.unwrap_or(0.0);
            limits.insert(
                kind.clone(),
                Limit {
                    requests_per_second,
                    cost_per_second: cost_per_minute / 60.0,
                    requests_cap: if requests_per_second > 0.0 {
                        requests_per_second.max(1.0)
                    } else {
                        0.0
                    },
                    cost_cap: cost_per_minute,
                },
            );
        }
        Arc::new(Self {
            pool,
            gates: limits.keys().map(|k| (k.clone(), Arc::default())).collect(),
            limits,
            paused: Mutex::default(),
            waiting: Mutex::default(),
            retry_base: config
                .kinds
                .keys()
                .map(|k| (k.clone(), config.kind(k).retry_base))
                .collect(),
            default_retry_base: config.processor.retry_base,
            max_pause: config
                .kinds
                .keys()
                .map(|k| (k.clone(), config.kind(k).max_retry_after))
                .collect(),
            default_max_pause: config.processor.max_retry_after,
        })
    }

    /// Whether jobs of `kind` have a cost to compute before their admission.
    pub fn costs(&self, kind: &str) -> bool {
        self.limits.get(kind).is_some_and(|l| l.cost_per_second > 0.0)
    }

    /// Whether [`Quotas::admit`] may make a job of `kind` wait: its kind is limited, or
    /// paused now.
    pub fn may_wait(&self, kind: &str) -> bool {
        self.limits.contains_key(kind) || self.paused.lock().expect("paused").contains_key(kind)
    }

    /// Waits until a job of `kind` costing `cost` may start: its kind not paused, and
    /// (for a limited kind) a request and `cost` taken from the shared buckets. Dropping
    /// the future gives up the wait, having taken nothing.
    ///
    /// # Errors
    /// The database failed.
    pub async fn admit(&self, kind: &str, label: &str, cost: u64) -> anyhow::Result<Admitted> {
        let limited = self.limits.contains_key(kind);
        if !limited && !self.paused.lock().expect("paused").contains_key(kind) {
            return Ok(Admitted { _gate: None });
        }
        let _waiting = Waiting::new(self, label);
        let gate = match self.gates.get(kind) {
            Some(gate) => Some(Arc::clone(gate).lock_owned().await),
            None => None,
        };
        loop {
            let paused = self.paused.lock().expect("paused").get(kind).copied();
            if let Some(until) = paused.filter(|until| *until > Instant::now()) {
                tokio::time::sleep_until(until.into()).await;
                continue;
            }
            let Some(limit) = self.limits.get(kind) else { break };
            // A job costing more than the bucket holds waits for a full bucket.
            let cost =
                if limit.cost_per_second > 0.0 { (cost as f64).min(limit.cost_cap) } else { 0.0 };
            let requests = if limit.requests_per_second > 0.0 { 1.0 } else { 0.0 };
            let wait = sqlx::query_scalar!(
                r#"SELECT take_kind_quota($1, $2, $3, $4, $5, $6, $7, $8) AS "wait!""#,
                kind,
                requests,
                cost,
                limit.requests_cap,
                limit.requests_per_second,
                limit.cost_cap,
                limit.cost_per_second,
                RECOVERY.as_secs_f64(),
            )
            .fetch_one(&self.pool)
            .await?;
            if wait <= 0.0 {
                if requests > 0.0 {
                    metrics::counter!(pm::QUOTA_TAKEN_TOTAL, "kind" => label.to_owned(), "unit" => "requests").increment(1);
                }
                if cost > 0.0 {
                    metrics::counter!(pm::QUOTA_TAKEN_TOTAL, "kind" => label.to_owned(), "unit" => "cost")
                        .increment(cost as u64);
                }
                break;
            }
            tokio::time::sleep(seconds(wait).min(LONGEST_NAP)).await;
        }
        Ok(Admitted { _gate: gate })
    }

    /// An attempt of `kind` was throttled: it waits `retry_after` (else the kind's
    /// `retry_base`) here at once and, through the table, in every processor; its limits
    /// halve. Returns the pause.
    pub async fn throttled(
        &self,
        kind: &str,
        label: &str,
        retry_after: Option<Duration>,
    ) -> Duration {
        let pause = retry_after
            .unwrap_or_else(|| {
                self.retry_base.get(kind).copied().unwrap_or(self.default_retry_base)
            })
            .min(self.max_pause(kind));
        self.pause(kind, pause);
        let factor = sqlx::query_scalar!(
            r#"SELECT throttle_kind($1, $2, $3) AS "factor!""#,
            kind,
            pause.as_secs_f64(),
            RECOVERY.as_secs_f64(),
        )
        .fetch_one(&self.pool)
        .await;
        // This processor still backs off; the others find out from their own 429s.
        let factor = factor
            .inspect_err(
                |e| tracing::warn!(kind, error = %e, "Recording the throttled kind failed."),
            )
            .ok();
        KindThrottled { kind, label, pause, factor }.emit();
        pause
    }

    /// The longest pause of `kind`: its `max_retry_after`.
    fn max_pause(&self, kind: &str) -> Duration {
        self.max_pause.get(kind).copied().unwrap_or(self.default_max_pause)
    }

    /// Pauses `kind` here for `pause` from now, cut to its `max_retry_after` (a pause
    /// already longer stays).
    fn pause(&self, kind: &str, pause: Duration) {
        let pause = pause.min(self.max_pause(kind));
        let now = Instant::now();
        // Saturating: a century stands for "longer than anything can wait".
        let Some(until) = now
            .checked_add(pause)
            .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        else {
            return;
        };
        let mut paused = self.paused.lock().expect("paused");
        let at = paused.entry(kind.to_owned()).or_insert(until);
        *at = (*at).max(until);
    }

    /// Reads the pauses and factors in force, once a [`POLL`], until `shutdown`.
    pub async fn poll(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(POLL) => {}
            }
            let rows = sqlx::query!(
                r#"SELECT kind,
                          greatest(0, extract(epoch FROM paused_until - clock_timestamp()))::float8
                              AS "paused_for!",
                          kind_quota_factor(q, clock_timestamp(), $1) AS "factor!"
                   FROM kind_quotas q"#,
                RECOVERY.as_secs_f64(),
            )
            .fetch_all(&self.pool)
            .await;
            let rows = match rows {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::debug!(error = %e, "Reading the kinds' quotas failed.");
                    continue;
                }
            };
            let now = Instant::now();
            for row in rows {
                let (kind, pause, factor) = (row.kind, seconds(row.paused_for), row.factor);
                if !pause.is_zero() {
                    self.pause(&kind, pause);
                }
                if self.retry_base.contains_key(&kind) || self.limits.contains_key(&kind) {
                    let paused = pause.min(self.max_pause(&kind));
                    metrics::gauge!(pm::QUOTA_PAUSED_SECONDS, "kind" => kind.clone())
                        .set(paused.as_secs_f64());
                    metrics::gauge!(pm::QUOTA_RATE_FACTOR, "kind" => kind).set(factor);
                }
            }
            self.paused.lock().expect("paused").retain(|_, until| *until > now);
        }
    }
}

/// Counts a job as waiting for quota while it lives.
struct Waiting<'a> {
    quotas: &'a Quotas,
    label: String,
}

impl<'a> Waiting<'a> {
    fn new(quotas: &'a Quotas, label: &str) -> Self {
        let waiting = Self { quotas, label: label.to_owned() };
        waiting.add(1);
        waiting
    }

    fn add(&self, delta: i64) {
        let mut waiting = self.quotas.waiting.lock().expect("waiting");
        let count = waiting.entry(self.label.clone()).or_default();
        *count += delta;
        metrics::gauge!(pm::QUOTA_WAITING, "kind" => self.label.clone()).set(*count as f64);
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.add(-1);
    }
}

/// `secs` (from Postgres) as a duration: negative, NaN or none is zero, too large the largest.
fn seconds(secs: f64) -> Duration {
    if secs.is_nan() || secs <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_from_the_table_never_panic() {
        assert_eq!(seconds(f64::NAN), Duration::ZERO);
        assert_eq!(seconds(-3.0), Duration::ZERO);
        assert_eq!(seconds(1.5), Duration::from_millis(1500));
        assert_eq!(seconds(1e300), Duration::MAX);
        assert_eq!(seconds(f64::INFINITY), Duration::MAX);
    }
}

/// A kind's throttle as the processors share it: paused after a provider's 429 until when
/// (if still ahead), the factor its rates run at now (1: full, grown back since the last
/// throttle), how often it was throttled and when last.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Throttle {
    pub paused_until: Option<chrono::DateTime<chrono::Utc>>,
    pub factor: f64,
    pub throttles: i64,
    pub throttled_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Every kind's throttle that has a quota row.
///
/// # Errors
/// The database failed.
pub async fn throttles(
    pool: &PgPool,
) -> Result<std::collections::HashMap<String, Throttle>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"SELECT kind,
                  CASE WHEN paused_until > clock_timestamp() THEN paused_until END AS paused_until,
                  kind_quota_factor(q, clock_timestamp(), $1) AS "factor!",
                  throttles,
                  CASE WHEN throttles > 0 THEN throttled_at END AS throttled_at
           FROM kind_quotas q"#,
        RECOVERY.as_secs_f64(),
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let throttle = Throttle {
                paused_until: r.paused_until,
                factor: r.factor,
                throttles: r.throttles,
                throttled_at: r.throttled_at,
            };
            (r.kind, throttle)
        })
        .collect())
}
