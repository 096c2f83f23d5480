//! Who is running what: each processor's row in `processors` (migration 0020), for the
//! console's Processors page and `GET /v1/processors`.
//!
//! Every [`INTERVAL`] a processor upserts its own row — the partitions it holds, how many
//! jobs run in it and the [`SHOWN`] longest-running of them (kind, document, generation,
//! since when) — in one statement, and deletes rows no processor has written for
//! [`FORGET_AFTER`] (processors killed without a word). A graceful stop deletes its own row.
//! The row is a view for operators: nothing reads it to decide anything.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How often a processor writes its row.
pub const INTERVAL: Duration = Duration::from_secs(3);
/// Running jobs a row names (the longest-running first); the rest are only counted.
pub const SHOWN: usize = 50;
/// A row not written for this long is deleted.
pub const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// A job running in this processor.
#[derive(Debug, Clone, Serialize)]
pub struct RunningJob {
    pub job_id: Uuid,
    pub kind: String,
    pub document_id: String,
    pub generation: i64,
    pub started_at: DateTime<Utc>,
}

/// The jobs running in this processor: each run enters with [`Running::enter`] and leaves
/// when its guard drops (whatever the run did).
#[derive(Debug, Default)]
pub struct Running {
    jobs: Mutex<HashMap<(Uuid, i64), RunningJob>>,
}

/// Keeps a job listed as running until dropped.
#[derive(Debug)]
pub struct Entered {
    running: Arc<Running>,
    key: (Uuid, i64),
}

impl Drop for Entered {
    fn drop(&mut self) {
        if let Ok(mut jobs) = self.running.jobs.lock() {
            jobs.remove(&self.key);
        }
    }
}

impl Running {
    pub fn enter(
        self: &Arc<Self>,
        job_id: Uuid,
        generation: i64,
        kind: &str,
        document_id: &str,
    ) -> Entered {
        let job = RunningJob {
            job_id,
            kind: kind.to_owned(),
            document_id: document_id.to_owned(),
            generation,
            started_at: Utc::now(),
        };
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.insert((job_id, generation), job);
        }
        Entered { running: Arc::clone(self), key: (job_id, generation) }
    }

    /// How many run, and the [`SHOWN`] longest-running.
    pub fn snapshot(&self) -> (usize, Vec<RunningJob>) {
        let Ok(jobs) = self.jobs.lock() else { return (0, Vec::new()) };
        let mut shown: Vec<RunningJob> = jobs.values().cloned().collect();
        shown.sort_by_key(|j| j.started_at);
        shown.truncate(SHOWN);
        (jobs.len(), shown)
    }
}

/// Writes `owner`'s row every [`INTERVAL`] until `shutdown`, then deletes it. A failed
/// write is logged and tried at the next tick: the page shows the row's age.
pub async fn run(
    pool: PgPool,
    owner: String,
    group: String,
    running: Arc<Running>,
    held: impl Fn() -> Vec<i32> + Send,
    shutdown: CancellationToken,
) {
    let started_at = Utc::now();
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        let (in_flight, shown) = running.snapshot();
        let shown = serde_json::to_value(&shown).unwrap_or_default();
        let written = sqlx::query!(
            "WITH gone AS (DELETE FROM processors WHERE seen_at < now() - make_interval(secs => $8)) \
             INSERT INTO processors (owner, group_name, version, started_at, seen_at, partitions, \
                                     in_flight, running) \
             VALUES ($1, $2, $3, $4, now(), $5, $6, $7) \
             ON CONFLICT (owner) DO UPDATE SET seen_at = now(), partitions = $5, \
                 in_flight = $6, running = $7",
            owner,
            group,
            env!("CARGO_PKG_VERSION"),
            started_at,
            &held(),
            i32::try_from(in_flight).unwrap_or(i32::MAX),
            shown,
            FORGET_AFTER.as_secs_f64(),
        )
        .execute(&pool)
        .await;
        if let Err(e) = written {
            tracing::warn!(error = %e, "Writing this processor's presence failed; next try in one interval.");
        }
    }
    if let Err(e) =
        sqlx::query!("DELETE FROM processors WHERE owner = $1", owner).execute(&pool).await
    {
        tracing::warn!(error = %e, "Deleting this processor's presence failed; it is forgotten after an hour.");
    }
}

/// A processor as `GET /v1/processors` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Processor {
    pub owner: String,
    pub group: String,
    pub version: String,
    pub started_at: DateTime<Utc>,
    pub seen_at: DateTime<Utc>,
    /// Seconds since it last wrote its row; past three intervals it is probably gone.
    pub seen_ago_seconds: f64,
    pub alive: bool,
    pub partitions: Vec<i32>,
    pub in_flight: i32,
    pub running: serde_json::Value,
}

/// Every processor that wrote its row in the last [`FORGET_AFTER`], by group and owner.
///
/// # Errors
/// The database failed.
pub async fn list(pool: &PgPool) -> Result<Vec<Processor>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"SELECT owner, group_name, version, started_at, seen_at, partitions, in_flight, running,
                  EXTRACT(EPOCH FROM now() - seen_at)::float8 AS "ago!"
           FROM processors ORDER BY group_name, owner"#
    )
    .fetch_all(pool)
    .await?;
    let alive_within = (INTERVAL * 3).as_secs_f64();
    Ok(rows
        .into_iter()
        .map(|r| Processor {
            owner: r.owner,
            group: r.group_name,
            version: r.version,
            started_at: r.started_at,
            seen_at: r.seen_at,
            seen_ago_seconds: r.ago.max(0.0),
            alive: r.ago <= alive_within,
            partitions: r.partitions,
            in_flight: r.in_flight,
            running: r.running,
        })
        .collect())
}
