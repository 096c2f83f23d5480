//! The console's history (migration 0021): per minute, what each processor did with each
//! kind, and the overview's figures, kept for [`KEEP`].
//!
//! A processor counts in memory what its runs and completions did — per minute and kind:
//! runs, how attempts and jobs ended, the wait from acceptance (or due time) to a job's
//! first start, each run's length, the times as histograms over [`BOUNDS_MS`] — and once a
//! minute is over writes it as one row per kind (`kind_minutes`, one statement); a graceful
//! stop writes the minute so far. The first processor to see a minute end also writes the
//! overview's row (`overview_minutes`): the jobs accepted in it, counted on a range of the
//! primary key (job ids are time-ordered), and the gauges as it ended. Rows older than
//! [`KEEP`] are deleted on the way. A page then reads at most a row per minute and kind
//! and processor: its cost follows the hours shown, not the jobs run.
//!
//! What a processor killed with `kill -9` had counted in its last minute is lost with it;
//! a quantile is the upper bound of the histogram bucket it falls in.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use chrono::{DateTime, DurationRound, Utc};
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// Upper bounds (milliseconds) of the time histograms' buckets; a last bucket holds longer.
pub const BOUNDS_MS: [i64; 16] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000, 900_000,
    3_600_000,
];

/// Buckets of a histogram: one per bound and the open one.
pub const BUCKETS: usize = BOUNDS_MS.len() + 1;

/// How long rows are kept.
pub const KEEP: Duration = Duration::from_secs(24 * 3600);

/// What one processor did with one kind in one minute.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Minute {
    runs: i32,
    succeeded: i32,
    failed: i32,
    quarantined: i32,
    superseded: i32,
    cancelled: i32,
    wait: [i32; BUCKETS],
    run: [i32; BUCKETS],
}

/// A minute (its start) and a kind.
type Key = (DateTime<Utc>, String);

/// This process's counts not written yet, by minute and kind.
static COUNTED: LazyLock<Mutex<HashMap<Key, Minute>>> = LazyLock::new(Mutex::default);

/// The bucket `took` falls in.
pub fn bucket(took: Duration) -> usize {
    let ms = i64::try_from(took.as_millis()).unwrap_or(i64::MAX);
    BOUNDS_MS.iter().position(|bound| ms <= *bound).unwrap_or(BOUNDS_MS.len())
}

fn minute_of(at: DateTime<Utc>) -> DateTime<Utc> {
    at.duration_trunc(chrono::TimeDelta::minutes(1)).unwrap_or(at)
}

fn count(kind: &str, change: impl FnOnce(&mut Minute)) {
    if let Ok(mut counted) = COUNTED.lock() {
        change(counted.entry((minute_of(Utc::now()), kind.to_owned())).or_default());
    }
}

/// A run of `kind` that took `took` ended (whatever its outcome).
pub fn ran(kind: &str, took: Duration) {
    count(kind, |m| {
        m.runs += 1;
        m.run[bucket(took)] += 1;
    });
}

/// A job of `kind` started its first attempt `waited` after it was accepted or due.
pub fn started(kind: &str, waited: Duration) {
    count(kind, |m| m.wait[bucket(waited)] += 1);
}

/// An attempt of `kind` was committed with `outcome` (the completion's label).
pub fn ended(kind: &str, outcome: &str) {
    count(kind, |m| match outcome {
        "succeeded" => m.succeeded += 1,
        "retry_scheduled" => m.failed += 1,
        "quarantined" => m.quarantined += 1,
        "superseded" => m.superseded += 1,
        "cancelled" => m.cancelled += 1,
        _ => {}
    });
}

/// Takes the counts of minutes before `before` (all of them with `None`).
fn take(before: Option<DateTime<Utc>>) -> Vec<(Key, Minute)> {
    let Ok(mut counted) = COUNTED.lock() else { return Vec::new() };
    let keys: Vec<_> =
        counted.keys().filter(|(minute, _)| before.is_none_or(|b| *minute < b)).cloned().collect();
    keys.into_iter().filter_map(|key| counted.remove_entry(&key)).collect()
}

/// Puts counts back that could not be written, to be added to what comes next.
fn put_back(rows: Vec<(Key, Minute)>) {
    let Ok(mut counted) = COUNTED.lock() else { return };
    for (key, m) in rows {
        let into = counted.entry(key).or_default();
        into.runs += m.runs;
        into.succeeded += m.succeeded;
        into.failed += m.failed;
        into.quarantined += m.quarantined;
        into.superseded += m.superseded;
        into.cancelled += m.cancelled;
        for i in 0..BUCKETS {
            into.wait[i] += m.wait[i];
            into.run[i] += m.run[i];
        }
    }
}

/// Writes `rows` as `owner`'s, adding to a row already written for the same minute and kind
/// (a stop's partial minute, then its end).
async fn write(pool: &PgPool, owner: &str, rows: &[(Key, Minute)]) -> Result<(), sqlx::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let column = |f: fn(&Minute) -> i32| rows.iter().map(|(_, m)| f(m)).collect::<Vec<i32>>();
    // Each histogram as text: Postgres takes no array of arrays through a parameter.
    let histogram = |h: &[i32; BUCKETS]| {
        format!("{{{}}}", h.iter().map(i32::to_string).collect::<Vec<_>>().join(","))
    };
    let minutes: Vec<DateTime<Utc>> = rows.iter().map(|((m, _), _)| *m).collect();
    let kinds: Vec<String> = rows.iter().map(|((_, k), _)| k.clone()).collect();
    let waits: Vec<String> = rows.iter().map(|(_, m)| histogram(&m.wait)).collect();
    let runs: Vec<String> = rows.iter().map(|(_, m)| histogram(&m.run)).collect();
    sqlx::query!(
        r#"
        INSERT INTO kind_minutes AS k (minute, kind, owner, runs, succeeded, failed, quarantined,
                                       superseded, cancelled, wait_ms, run_ms)
        SELECT minute, kind, $3, runs, succeeded, failed, quarantined, superseded, cancelled,
               wait::integer[], run::integer[]
        FROM unnest($1::timestamptz[], $2::text[], $4::int[], $5::int[], $6::int[], $7::int[],
                    $8::int[], $9::int[], $10::text[], $11::text[])
             AS r(minute, kind, runs, succeeded, failed, quarantined, superseded, cancelled,
                  wait, run)
        ON CONFLICT (minute, kind, owner) DO UPDATE SET
            runs = k.runs + excluded.runs,
            succeeded = k.succeeded + excluded.succeeded,
            failed = k.failed + excluded.failed,
            quarantined = k.quarantined + excluded.quarantined,
            superseded = k.superseded + excluded.superseded,
            cancelled = k.cancelled + excluded.cancelled,
            wait_ms = ARRAY(SELECT a + b FROM unnest(k.wait_ms, excluded.wait_ms)
                                WITH ORDINALITY AS t(a, b, i) ORDER BY i),
            run_ms = ARRAY(SELECT a + b FROM unnest(k.run_ms, excluded.run_ms)
                               WITH ORDINALITY AS t(a, b, i) ORDER BY i)
        "#,
        &minutes,
        &kinds,
        owner,
        &column(|m| m.runs),
        &column(|m| m.succeeded),
        &column(|m| m.failed),
        &column(|m| m.quarantined),
        &column(|m| m.superseded),
        &column(|m| m.cancelled),
        &waits,
        &runs,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The overview's row for the minute starting at `minute`, unless a processor wrote it.
pub async fn write_overview(pool: &PgPool, minute: DateTime<Utc>) -> anyhow::Result<()> {
    let written =
        sqlx::query_scalar!("SELECT 1 AS \"one!\" FROM overview_minutes WHERE minute = $1", minute)
            .fetch_optional(pool)
            .await?;
    if written.is_some() {
        return Ok(());
    }
    let (from, to) = (
        crate::status::first_id_at(minute),
        crate::status::first_id_at(minute + chrono::TimeDelta::minutes(1)),
    );
    let accepted = sqlx::query_scalar!(
        "SELECT count(*) AS \"n!\" FROM jobs WHERE job_id >= $1 AND job_id < $2",
        from,
        to
    )
    .fetch_one(pool)
    .await?;
    let gauges = jobfold_common::gauges::read(pool).await?;
    sqlx::query!(
        "INSERT INTO overview_minutes (minute, accepted, unfinished, quarantined, relay_backlog) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (minute) DO NOTHING",
        minute,
        accepted,
        gauges.unfinished(),
        gauges.quarantined_total(),
        gauges.relay_backlog,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Deletes rows older than [`KEEP`].
async fn forget(pool: &PgPool) -> Result<(), sqlx::Error> {
    let keep = KEEP.as_secs_f64();
    sqlx::query!("DELETE FROM kind_minutes WHERE minute < now() - make_interval(secs => $1)", keep)
        .execute(pool)
        .await?;
    sqlx::query!(
        "DELETE FROM overview_minutes WHERE minute < now() - make_interval(secs => $1)",
        keep
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Writes what this process counted as `owner`'s, each minute once it is over, until
/// `shutdown` (the stop writes the minute so far with [`flush`], once its runs ended). A
/// failed write is logged and its counts kept for the next minute's.
pub async fn run(pool: PgPool, owner: String, shutdown: CancellationToken) {
    loop {
        let now = Utc::now();
        let next = minute_of(now) + chrono::TimeDelta::minutes(1);
        // A second past the minute: runs that ended in it have counted.
        let wait = (next - now).to_std().unwrap_or_default() + Duration::from_secs(1);
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
        let rows = take(Some(next));
        if let Err(e) = write(&pool, &owner, &rows).await {
            tracing::warn!(error = %e, "Writing this processor's minute of history failed; kept for the next.");
            put_back(rows);
        }
        if let Err(e) = write_overview(&pool, next - chrono::TimeDelta::minutes(1)).await {
            tracing::warn!(error = %format!("{e:#}"), "Writing the overview's minute of history failed.");
        }
        if let Err(e) = forget(&pool).await {
            tracing::warn!(error = %e, "Deleting old history failed.");
        }
    }
}

/// Writes everything this process counted and has not written, as `owner`'s: a graceful
/// stop's last minute.
pub async fn flush(pool: &PgPool, owner: &str) {
    let rows = take(None);
    if let Err(e) = write(pool, owner, &rows).await {
        tracing::warn!(error = %e, "Writing this processor's last minute of history failed.");
    }
}

/// A kind's figures over the minutes read: what ended, and the times' quantiles.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KindFigures {
    pub runs: i64,
    pub succeeded: i64,
    pub failed: i64,
    pub quarantined: i64,
    pub superseded: i64,
    pub cancelled: i64,
    /// Acceptance (or due time) to first start, p50 and p99, in milliseconds: the upper bound
    /// of the bucket each falls in (`None`: no job started; `i64::MAX`: over the last bound).
    pub wait_p50_ms: Option<i64>,
    pub wait_p99_ms: Option<i64>,
    pub run_p50_ms: Option<i64>,
    pub run_p99_ms: Option<i64>,
}

/// The upper bound (ms) of the bucket holding quantile `q` of `histogram`.
pub fn quantile(histogram: &[i64], q: f64) -> Option<i64> {
    let total: i64 = histogram.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = ((q * total as f64).ceil() as i64).max(1);
    let mut seen = 0;
    for (i, n) in histogram.iter().enumerate() {
        seen += n;
        if seen >= rank {
            return Some(BOUNDS_MS.get(i).copied().unwrap_or(i64::MAX));
        }
    }
    None
}

/// One minute of one kind (all processors), for a kind's page.
#[derive(Debug, Clone, Serialize)]
pub struct KindPoint {
    pub minute: DateTime<Utc>,
    pub runs: i64,
    pub succeeded: i64,
    pub failed: i64,
    pub quarantined: i64,
}

/// Each kind's figures over the last `minutes`, and for `series_of` its minutes.
///
/// # Errors
/// The database failed.
pub async fn kinds(
    pool: &PgPool,
    minutes: i64,
    series_of: Option<&str>,
) -> Result<(HashMap<String, KindFigures>, Vec<KindPoint>), sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT minute AS "minute!", kind AS "kind!", runs::bigint AS "runs!",
               succeeded::bigint AS "succeeded!", failed::bigint AS "failed!",
               quarantined::bigint AS "quarantined!", superseded::bigint AS "superseded!",
               cancelled::bigint AS "cancelled!", wait_ms AS "wait_ms!", run_ms AS "run_ms!"
        FROM kind_minutes
        WHERE minute >= date_trunc('minute', now()) - make_interval(mins => $1::int)
        ORDER BY minute
        "#,
        i32::try_from(minutes).unwrap_or(60),
    )
    .fetch_all(pool)
    .await?;
    let mut figures: HashMap<String, (KindFigures, [i64; BUCKETS], [i64; BUCKETS])> =
        HashMap::new();
    let mut series: Vec<KindPoint> = Vec::new();
    for row in rows {
        let (f, wait, run) = figures.entry(row.kind.clone()).or_default();
        f.runs += row.runs;
        f.succeeded += row.succeeded;
        f.failed += row.failed;
        f.quarantined += row.quarantined;
        f.superseded += row.superseded;
        f.cancelled += row.cancelled;
        for (i, n) in row.wait_ms.iter().take(BUCKETS).enumerate() {
            wait[i] += i64::from(*n);
        }
        for (i, n) in row.run_ms.iter().take(BUCKETS).enumerate() {
            run[i] += i64::from(*n);
        }
        if series_of == Some(row.kind.as_str()) {
            match series.last_mut() {
                Some(p) if p.minute == row.minute => {
                    p.runs += row.runs;
                    p.succeeded += row.succeeded;
                    p.failed += row.failed;
                    p.quarantined += row.quarantined;
                }
                _ => series.push(KindPoint {
                    minute: row.minute,
                    runs: row.runs,
                    succeeded: row.succeeded,
                    failed: row.failed,
                    quarantined: row.quarantined,
                }),
            }
        }
    }
    let figures = figures
        .into_iter()
        .map(|(kind, (mut f, wait, run))| {
            f.wait_p50_ms = quantile(&wait, 0.5);
            f.wait_p99_ms = quantile(&wait, 0.99);
            f.run_p50_ms = quantile(&run, 0.5);
            f.run_p99_ms = quantile(&run, 0.99);
            (kind, f)
        })
        .collect();
    Ok((figures, series))
}

/// A kind's unfinished jobs by state (as the gauges count them: one scan of the unfinished
/// jobs), `scheduled` of the queued ones not due yet.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Open {
    pub queued: i64,
    pub scheduled: i64,
    pub leased: i64,
    pub retry_wait: i64,
}

/// Each kind's unfinished jobs by state.
///
/// # Errors
/// The database failed.
pub async fn open_by_kind(pool: &PgPool) -> Result<HashMap<String, Open>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT kind, state::text AS "state!", count(*) AS "count!",
               count(*) FILTER (WHERE run_at > now()) AS "scheduled!"
        FROM jobs WHERE finished_at IS NULL
        GROUP BY kind, state
        "#,
    )
    .fetch_all(pool)
    .await?;
    let mut open: HashMap<String, Open> = HashMap::new();
    for row in rows {
        let o = open.entry(row.kind).or_default();
        match row.state.as_str() {
            "queued" => {
                o.queued = row.count;
                o.scheduled = row.scheduled;
            }
            "leased" => o.leased = row.count,
            "retry_wait" => o.retry_wait = row.count,
            _ => {}
        }
    }
    Ok(open)
}

/// One minute of the overview.
#[derive(Debug, Clone, Serialize)]
pub struct OverviewPoint {
    pub minute: DateTime<Utc>,
    pub accepted: i64,
    pub succeeded: i64,
    pub failed: i64,
    pub quarantined: i64,
    pub unfinished: Option<i64>,
    pub relay_backlog: Option<i64>,
}

/// The overview's minutes over the last `minutes`, oldest first: jobs accepted, attempts
/// ended (all kinds, all processors), the gauges as each minute ended.
///
/// # Errors
/// The database failed.
pub async fn overview(pool: &PgPool, minutes: i64) -> Result<Vec<OverviewPoint>, sqlx::Error> {
    sqlx::query_as!(
        OverviewPoint,
        r#"
        WITH k AS (
            SELECT minute, sum(succeeded)::bigint AS succeeded, sum(failed)::bigint AS failed,
                   sum(quarantined)::bigint AS quarantined
            FROM kind_minutes
            WHERE minute >= date_trunc('minute', now()) - make_interval(mins => $1::int)
            GROUP BY minute
        ), o AS (
            SELECT * FROM overview_minutes
            WHERE minute >= date_trunc('minute', now()) - make_interval(mins => $1::int)
        )
        SELECT coalesce(o.minute, k.minute) AS "minute!",
               coalesce(o.accepted, 0) AS "accepted!",
               coalesce(k.succeeded, 0) AS "succeeded!",
               coalesce(k.failed, 0) AS "failed!",
               coalesce(k.quarantined, 0) AS "quarantined!",
               o.unfinished AS "unfinished?",
               o.relay_backlog AS "relay_backlog?"
        FROM o FULL JOIN k ON k.minute = o.minute
        ORDER BY 1
        "#,
        i32::try_from(minutes).unwrap_or(60),
    )
    .fetch_all(pool)
    .await
}

/// Every kind with its pause, its open jobs by state, what ended over the last `minutes` and
/// its times, its provider throttle and its limits as `config` has them: the Kinds API's and
/// `jobfold kinds list`'s rows (and, for `series_of`, that kind's minutes).
///
/// # Errors
/// The database failed.
pub async fn kind_table(
    pool: &PgPool,
    config: &jobfold_common::config::Config,
    minutes: i64,
    series_of: Option<&str>,
) -> Result<(Vec<serde_json::Value>, Vec<KindPoint>), sqlx::Error> {
    use serde_json::json;
    let pauses = crate::store::kinds::kinds(pool).await?;
    let open = open_by_kind(pool).await?;
    let (mut figures, series) = kinds(pool, minutes, series_of).await?;
    let throttles = crate::quota::throttles(pool).await?;
    let mut names: std::collections::BTreeSet<String> =
        pauses.iter().map(|k| k.kind.clone()).collect();
    names.extend(open.keys().cloned());
    names.extend(figures.keys().cloned());
    let kinds = names
        .into_iter()
        .map(|name| {
            let pause = pauses.iter().find(|k| k.kind == name);
            let config = config.kind(&name);
            let mut kind = serde_json::to_value(pause).unwrap_or_default();
            if kind.is_null() {
                kind = json!({ "kind": name, "paused": false, "waiting": 0 });
            }
            kind["open"] = json!(open.get(&name).cloned().unwrap_or_default());
            kind["ended"] = json!(figures.remove(&name).unwrap_or_default());
            kind["throttle"] = json!(throttles.get(&name));
            kind["limits"] = json!({
                "concurrency": config.concurrency,
                "rate_per_second": config.rate_per_second,
                "cost_per_minute": config.cost_per_minute,
                "max_attempts": config.max_attempts,
                "run_timeout_seconds": config.run_timeout.map(|t| t.as_secs_f64()),
            });
            kind
        })
        .collect();
    Ok((kinds, series))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_fall_in_the_bucket_their_bound_closes() {
        assert_eq!(bucket(Duration::ZERO), 0);
        assert_eq!(bucket(Duration::from_millis(5)), 0);
        assert_eq!(bucket(Duration::from_millis(6)), 1);
        assert_eq!(bucket(Duration::from_millis(200)), 5, "≤ 250 ms");
        assert_eq!(bucket(Duration::from_secs(7200)), BOUNDS_MS.len(), "the open bucket");
    }

    #[test]
    fn a_quantile_is_the_bound_of_its_bucket() {
        let mut h = [0_i64; BUCKETS];
        assert_eq!(quantile(&h, 0.5), None);
        h[bucket(Duration::from_millis(40))] = 98;
        h[bucket(Duration::from_secs(3))] = 2;
        assert_eq!(quantile(&h, 0.5), Some(50));
        assert_eq!(quantile(&h, 0.98), Some(50));
        assert_eq!(quantile(&h, 0.99), Some(5_000));
        h[BOUNDS_MS.len()] = 1_000;
        assert_eq!(quantile(&h, 0.99), Some(i64::MAX));
    }
}
