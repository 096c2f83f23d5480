//! Heartbeats: every lease a processor holds is kept alive by one statement a beat.
//!
//! A running attempt registers its lease — job, generation, its kind's heartbeat and lease
//! TTL, and the token that stops its handler — and dropping the [`Registration`] removes it.
//! One task beats every `tick` (the shortest heartbeat of any kind) and extends, in one
//! statement, each lease whose kind's heartbeat has come round, by that kind's TTL. It is
//! fenced by generation and state as a single lease's heartbeat would be: a lease the
//! statement finds lost (another generation leased the job, an operator cancelled it, it
//! ended) fires its token, so the handler stops; a lease whose transaction has not committed
//! yet (a run inside its lease transaction's window) is not lost. A row another transaction holds is not
//! waited for but tried again at the next beat, and a statement that fails is tried again
//! at the next beat: a lease's TTL is at least two heartbeats.
//!
//! So a processor running 1,000 slow jobs renews their leases with one statement a beat, not
//! 1,000, and one job's slow transaction holds up no other job's heartbeat.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::metrics as pm;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::store;

type Key = (Uuid, i64);
type Leases = Mutex<HashMap<Key, Lease>>;

struct Lease {
    interval: Duration,
    ttl: Duration,
    /// When the next renewal is due.
    due: Instant,
    /// When the lease runs out unless renewed (counted from before the statement that
    /// extended it: the safe side).
    expires: Instant,
    lost: CancellationToken,
}

/// The processor's leases and the task that keeps them alive. The task ends once every
/// clone is dropped.
#[derive(Clone)]
pub struct Heartbeats {
    leases: Arc<Leases>,
}

impl std::fmt::Debug for Heartbeats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.leases.lock().map(|l| l.len()).unwrap_or(0);
        f.debug_struct("Heartbeats").field("held", &held).finish()
    }
}

/// A lease kept alive until this is dropped.
#[must_use = "the lease is kept alive only while the registration lives"]
pub struct Registration {
    key: Key,
    leases: Arc<Leases>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").field("job_id", &self.key.0).finish_non_exhaustive()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(mut leases) = self.leases.lock() {
            leases.remove(&self.key);
            metrics::gauge!(pm::LEASES_HELD).set(leases.len() as f64);
        }
    }
}

impl Heartbeats {
    /// The leases, and the beat for their owner to run (the worker supervises it): every
    /// `tick`, one statement renews the leases that are due. The beat ends once every clone
    /// of the leases is dropped.
    pub fn new(pool: PgPool, tick: Duration) -> (Self, impl std::future::Future<Output = ()>) {
        let leases = Arc::new(Leases::default());
        let beat = beat(pool, tick, Arc::downgrade(&leases));
        (Self { leases }, beat)
    }

    /// Keeps the lease of `job_id` at `generation` alive, renewing it by `ttl` every
    /// `interval` from now (it was just leased), until the registration drops; `lost` fires
    /// when the lease is found lost. A lease registered already (a suspect's, kept alive while
    /// it waited for its turn) keeps its renewal times, and `lost` takes over the news of its
    /// loss: the first registration to drop ends it.
    pub fn register(
        &self,
        job_id: Uuid,
        generation: i64,
        interval: Duration,
        ttl: Duration,
        lost: CancellationToken,
    ) -> Registration {
        let now = Instant::now();
        let mut leases = self.leases.lock().expect("the lease table");
        match leases.entry((job_id, generation)) {
            std::collections::hash_map::Entry::Occupied(mut held) => held.get_mut().lost = lost,
            std::collections::hash_map::Entry::Vacant(new) => {
                new.insert(Lease { interval, ttl, due: now + interval, expires: now + ttl, lost });
            }
        }
        metrics::gauge!(pm::LEASES_HELD).set(leases.len() as f64);
        Registration { key: (job_id, generation), leases: Arc::clone(&self.leases) }
    }
}

async fn beat(pool: PgPool, tick: Duration, leases: Weak<Leases>) {
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        jobfold_common::failpoint::hit(jobfold_common::failpoint::Point::ProcessorHeartbeat);
        let Some(leases) = leases.upgrade() else { return };
        let started = Instant::now();
        // Due by the middle of the next tick: each lease is renewed within half a tick of
        // its own interval.
        let due: Vec<(Uuid, i64, Duration)> = {
            let held = leases.lock().expect("the lease table");
            held.iter()
                .filter(|(_, lease)| lease.due <= started + tick / 2)
                .map(|((job_id, generation), lease)| (*job_id, *generation, lease.ttl))
                .collect()
        };
        if due.is_empty() {
            continue;
        }
        let found = store::heartbeat(&pool, &due).await;
        metrics::counter!(pm::HEARTBEAT_STATEMENTS_TOTAL).increment(1);
        let found = match found {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, leases = due.len(), "Heartbeat failed; retrying at the next beat.");
                continue;
            }
        };
        let renewed: HashSet<Key> = found.renewed.into_iter().collect();
        let busy: HashSet<Key> = found.busy.into_iter().collect();
        let mut held = leases.lock().expect("the lease table");
        let mut least: Option<Duration> = None;
        for key in &renewed {
            // A lease whose attempt ended meanwhile is gone from the table: nothing to do.
            if let Some(lease) = held.get_mut(key) {
                let margin = lease.expires.saturating_duration_since(started);
                metrics::histogram!(pm::LEASE_MARGIN_SECONDS).record(margin.as_secs_f64());
                least = Some(least.map_or(margin, |l| l.min(margin)));
                lease.expires = started + lease.ttl;
                lease.due = started + lease.interval;
            }
        }
        if let Some(least) = least {
            metrics::gauge!(pm::LEASE_MARGIN_MIN_SECONDS).set(least.as_secs_f64());
        }
        for (job_id, generation, _) in &due {
            let key = (*job_id, *generation);
            if renewed.contains(&key) || busy.contains(&key) {
                continue;
            }
            if let Some(lease) = held.remove(&key) {
                tracing::warn!(%job_id, generation, "Lease lost: cancelling the handler.");
                lease.lost.cancel();
            }
        }
        metrics::gauge!(pm::LEASES_HELD).set(held.len() as f64);
    }
}
