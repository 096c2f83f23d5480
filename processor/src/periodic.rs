//! Periodic jobs: `[periodic.<name>]` schedules, each tick one job, accepted by whichever
//! processor holds the group's schedule lease (`periodic_leader`, migration 0018).
//!
//! - **One holder.** Every processor with schedules tries, once a [`LOOK`], to take or renew
//!   the lease for `processor.lease_ttl`; the holder accepts the ticks. A holder that dies is
//!   replaced once its lease runs out; one that stops gives it back at once.
//! - **One job per tick.** Each tick's job is accepted in a transaction that locks its
//!   schedule's row and moves `last_tick` past it, with the tick in the job's idempotency key
//!   (`periodic/<name>/<tick>`): a tick is decided once, and even two holders at once (a
//!   paused one waking) could not accept it twice.
//! - **Late and missed ticks.** A tick passed by less than the schedule's `catch_up` (the
//!   holder died, a deploy) still gets its job, late. Older ones (no processor ran) are
//!   skipped, or with `missed = "run_once"` get one job together, for the newest.
//! - **The jobs.** Document `periodic/<name>`, so a schedule's jobs run one at a time in tick
//!   order; input version the tick in Unix seconds, so it increases tick by tick; input as
//!   configured.
//!
//! A schedule first seen starts at its next tick: nothing before it is made up. A tick whose
//! job accept refuses (its kind unknown, its input invalid) is passed with the error kept in
//! `periodic_schedules.last_error` and logged; the next tick is tried as usual.

use std::time::Duration;

use chrono::{DateTime, Utc};
use jobfold_common::accept::{AcceptError, Acceptor, NewJob};
use jobfold_common::config::{Config, Missed, Periodic};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::metrics as pm;

/// How often a processor looks at the lease and the schedules (sooner when a tick is due).
pub const LOOK: Duration = Duration::from_secs(1);
/// Most ticks one schedule accepts in one look (a long catch-up goes on at the next).
const TICKS_PER_LOOK: usize = 1000;

/// A schedule as `GET /v1/periodic` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScheduleState {
    pub name: String,
    pub kind: String,
    pub cron: String,
    pub time_zone: String,
    pub missed: Missed,
    /// The next tick after now.
    pub next_tick: Option<DateTime<Utc>>,
    /// The newest tick decided (its job accepted, or passed).
    pub last_tick: Option<DateTime<Utc>>,
    pub last_job_id: Option<uuid::Uuid>,
    pub last_error: Option<String>,
    /// The processor holding the schedule lease, while it holds it.
    pub holder: Option<String>,
}

/// The schedules `config` declares, with what Postgres holds of them.
///
/// # Errors
/// The database failed.
pub async fn schedules(config: &Config, pool: &PgPool) -> Result<Vec<ScheduleState>, sqlx::Error> {
    let rows = sqlx::query!(
        "SELECT name, last_tick, last_job_id, last_error FROM periodic_schedules ORDER BY name"
    )
    .fetch_all(pool)
    .await?;
    let holder = sqlx::query_scalar!(
        "SELECT holder FROM periodic_leader WHERE id = 1 AND lease_until > clock_timestamp()"
    )
    .fetch_optional(pool)
    .await?;
    let now = Utc::now();
    Ok(config
        .periodic
        .iter()
        .map(|(name, p)| {
            let row = rows.iter().find(|r| &r.name == name);
            ScheduleState {
                name: name.clone(),
                kind: p.kind.clone(),
                cron: p.cron.clone(),
                time_zone: p.time_zone.clone(),
                missed: p.missed,
                next_tick: next_tick(p, now),
                last_tick: row.map(|r| r.last_tick),
                last_job_id: row.and_then(|r| r.last_job_id),
                last_error: row.and_then(|r| r.last_error.clone()),
                holder: holder.clone(),
            }
        })
        .collect())
}

/// The first tick of `p` after `after`.
fn next_tick(p: &Periodic, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
    let (cron, zone) = (p.schedule().ok()?, p.zone().ok()?);
    let next = cron.find_next_occurrence(&after.with_timezone(&zone), false).ok()?;
    Some(next.with_timezone(&Utc))
}

/// The ticks of `p` after `after` up to `until` (inclusive), at most `limit`.
fn ticks(
    p: &Periodic,
    after: DateTime<Utc>,
    until: DateTime<Utc>,
    limit: usize,
) -> Vec<DateTime<Utc>> {
    let mut ticks = Vec::new();
    let mut at = after;
    while ticks.len() < limit {
        match next_tick(p, at) {
            Some(tick) if tick <= until => {
                ticks.push(tick);
                at = tick;
            }
            _ => break,
        }
    }
    ticks
}

/// Runs the schedules of `config` while this processor holds the lease, until `shutdown`;
/// then gives the lease back. Failures are logged and tried again at the next look.
pub async fn run(
    config: Config,
    pool: PgPool,
    acceptor: Acceptor,
    owner: String,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let ttl = config.processor.lease_ttl;
    let mut held = false;
    loop {
        match hold(&pool, &owner, ttl).await {
            Ok(now_held) => {
                if now_held != held {
                    if now_held {
                        tracing::info!(owner, "Holding the periodic schedules' lease.");
                    } else {
                        tracing::info!("Another processor holds the periodic schedules' lease.");
                    }
                    metrics::gauge!(pm::PERIODIC_HOLDER).set(if now_held { 1.0 } else { 0.0 });
                }
                held = now_held;
            }
            Err(e) => tracing::warn!(error = %e, "Taking the periodic schedules' lease failed."),
        }
        if held {
            for (name, p) in &config.periodic {
                if let Err(e) = Box::pin(run_schedule(&pool, &acceptor, name, p)).await {
                    tracing::warn!(schedule = name, error = %format!("{e:#}"), "A periodic schedule's look failed.");
                }
            }
        }
        // Until the next tick of any schedule, at most a LOOK.
        let now = Utc::now();
        let soonest = config.periodic.values().filter_map(|p| next_tick(p, now)).min();
        let wait = soonest
            .and_then(|t| (t - now).to_std().ok())
            .map_or(LOOK, |w| w.min(LOOK))
            .max(Duration::from_millis(5));
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    if held {
        let given = sqlx::query!("DELETE FROM periodic_leader WHERE id = 1 AND holder = $1", owner)
            .execute(&pool)
            .await;
        if let Err(e) = given {
            tracing::warn!(error = %e, "Giving back the periodic schedules' lease failed; it runs out.");
        }
        metrics::gauge!(pm::PERIODIC_HOLDER).set(0.0);
    }
    Ok(())
}

/// Takes or renews the lease for `ttl`; whether this processor holds it.
async fn hold(pool: &PgPool, owner: &str, ttl: Duration) -> Result<bool, sqlx::Error> {
    let held = sqlx::query_scalar!(
        "INSERT INTO periodic_leader (id, holder, lease_until) \
         VALUES (1, $1, clock_timestamp() + make_interval(secs => $2)) \
         ON CONFLICT (id) DO UPDATE SET holder = excluded.holder, \
             lease_until = excluded.lease_until, \
             since = CASE WHEN periodic_leader.holder = excluded.holder \
                          THEN periodic_leader.since ELSE clock_timestamp() END \
         WHERE periodic_leader.holder = excluded.holder \
            OR periodic_leader.lease_until < clock_timestamp() \
         RETURNING holder",
        owner,
        ttl.as_secs_f64(),
    )
    .fetch_optional(pool)
    .await?;
    Ok(held.is_some())
}

/// Accepts the due ticks of one schedule, each in a transaction of its own.
async fn run_schedule(
    pool: &PgPool,
    acceptor: &Acceptor,
    name: &str,
    p: &Periodic,
) -> anyhow::Result<()> {
    let now = Utc::now();
    // A schedule first seen starts here: its next tick is the first it runs.
    sqlx::query!(
        "INSERT INTO periodic_schedules (name, last_tick) VALUES ($1, $2) \
         ON CONFLICT (name) DO NOTHING",
        name,
        now,
    )
    .execute(pool)
    .await?;
    loop {
        let mut tx = pool.begin().await?;
        let last = sqlx::query_scalar!(
            "SELECT last_tick FROM periodic_schedules WHERE name = $1 FOR UPDATE",
            name
        )
        .fetch_one(&mut *tx)
        .await?;
        let now = Utc::now();
        let due = ticks(p, last, now, TICKS_PER_LOOK);
        let Some(&newest) = due.last() else { return Ok(()) };
        let Some(tick) = tick_to_run(name, p, due, now)? else {
            // Only missed ticks, skipped: the schedule moves past them.
            sqlx::query!(
                "UPDATE periodic_schedules SET last_tick = $2, updated_at = clock_timestamp() \
                 WHERE name = $1",
                name,
                newest,
            )
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            continue;
        };
        let accepted = match acceptor.accept_in(&mut tx, &tick_job(name, p, tick)).await {
            Ok(accepted) => Ok(accepted.job_id),
            // The tick has its job already (accepted by a holder whose input differed).
            Err(AcceptError::Conflict { job_id, .. }) => Ok(job_id),
            Err(e) => Err(e),
        };
        match accepted {
            Ok(job_id) => {
                sqlx::query!(
                    "UPDATE periodic_schedules SET last_tick = $2, last_job_id = $3, \
                     last_error = NULL, updated_at = clock_timestamp() WHERE name = $1",
                    name,
                    tick,
                    job_id,
                )
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                metrics::counter!(pm::PERIODIC_JOBS_TOTAL, "schedule" => name.to_owned())
                    .increment(1);
            }
            Err(e) if e.is_request_fault() => {
                // The job's fault, not the database's: the tick is passed, the error kept.
                drop(tx);
                pass_refused(pool, name, tick, &e).await?;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Passes schedule `name`'s `tick`, whose job was refused for what it is (`error`): the
/// refusal kept in the schedule's row, logged and counted.
async fn pass_refused(
    pool: &PgPool,
    name: &str,
    tick: DateTime<Utc>,
    refused: &AcceptError,
) -> anyhow::Result<()> {
    let error = format!("tick {}: {refused}", tick.to_rfc3339());
    tracing::error!(schedule = name, error, "A periodic job was refused; its tick is passed.");
    sqlx::query!(
        "UPDATE periodic_schedules SET last_tick = $2, last_error = $3, \
         updated_at = clock_timestamp() WHERE name = $1",
        name,
        tick,
        error,
    )
    .execute(pool)
    .await?;
    metrics::counter!(pm::PERIODIC_REFUSED_TOTAL, "schedule" => name.to_owned()).increment(1);
    Ok(())
}

/// Of the `due` ticks (oldest first), the one to run now: the newest of those missed by
/// more than `catch_up` for `missed = "run_once"`, else the oldest still within it (the
/// missed ones before it skipped, and logged); `None` when every due tick was missed and
/// is skipped.
fn tick_to_run(
    name: &str,
    p: &Periodic,
    due: Vec<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> anyhow::Result<Option<DateTime<Utc>>> {
    let catch_up = chrono::Duration::from_std(p.catch_up)?;
    // The oldest tick still due: a late one; before it, missed ones.
    let (missed, late): (Vec<_>, Vec<_>) = due.into_iter().partition(|t| now - *t > catch_up);
    if let (Some(&newest_missed), Missed::RunOnce) = (missed.last(), p.missed) {
        return Ok(Some(newest_missed));
    }
    if !missed.is_empty() {
        tracing::warn!(
            schedule = name,
            skipped = missed.len(),
            "Ticks missed by more than catch_up are skipped."
        );
    }
    Ok(late.first().copied())
}

/// The job of schedule `name`'s `tick`: document `periodic/<name>`, its input version the
/// tick's time, and an idempotency key naming both, so a tick makes one job whoever
/// accepts it.
fn tick_job(name: &str, p: &Periodic, tick: DateTime<Utc>) -> NewJob {
    NewJob {
        document_id: format!("periodic/{name}"),
        kind: p.kind.clone(),
        input_version: tick.timestamp(),
        input: p.input.clone().unwrap_or_else(|| serde_json::json!({})),
        idempotency_key: Some(format!("periodic/{name}/{}", tick.to_rfc3339())),
        trace: None,
        run_at: None,
    }
}

/// Every tick of `p` over a day from `from` in its zone, for the tests of the arithmetic.
#[cfg(test)]
fn day_of_ticks(p: &Periodic, from: DateTime<Utc>) -> Vec<DateTime<Utc>> {
    ticks(p, from, from + chrono::Duration::days(1), 100_000)
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone as _;

    use super::*;

    fn schedule(cron: &str, zone: &str) -> Periodic {
        Periodic {
            kind: "k".into(),
            cron: cron.into(),
            time_zone: zone.into(),
            input: None,
            catch_up: Duration::from_secs(60),
            missed: Missed::Skip,
        }
    }

    #[test]
    fn ticks_follow_the_pattern_in_its_zone() {
        let start = Utc.with_ymd_and_hms(2026, 3, 28, 12, 0, 0).unwrap();
        // Every second: 86,400 a day, strictly after the start.
        let every = day_of_ticks(&schedule("* * * * * *", "UTC"), start);
        assert_eq!(every.len(), 86_400);
        assert_eq!(every[0], start + chrono::Duration::seconds(1));
        // 09:00 in Paris across the spring change (29 March): 07:00 UTC after it.
        let nine = schedule("0 9 * * *", "Europe/Paris");
        let two = ticks(&nine, start, start + chrono::Duration::days(2), 10);
        let utc = |d, h| Utc.with_ymd_and_hms(2026, 3, d, h, 0, 0).unwrap();
        assert_eq!(two, [utc(29, 7), utc(30, 7)]);
        // At most `limit`, and none after `until`.
        assert!(ticks(&schedule("* * * * * *", "UTC"), start, start, 10).is_empty());
        assert_eq!(
            ticks(&schedule("* * * * * *", "UTC"), start, start + chrono::Duration::hours(1), 7)
                .len(),
            7
        );
    }
}
