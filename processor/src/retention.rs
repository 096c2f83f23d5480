//! Retention: deletes what ended jobs leave behind, as `[retention]` says; nothing by default.
//!
//! Each setting is a sweep over the jobs in final states (`succeeded`, `superseded`,
//! `cancelled`) in the order they ended, `(finished_at, job_id)`, from where the sweep last
//! got (`retention_cursor`, one row a sweep, locked while it runs, so processors sweeping at
//! once take turns) to the jobs ended longer ago than its setting:
//! - `job_events`: their events already on Kafka (behind the relay's cursor, and no outbox
//!   row waiting), with their published outbox rows. An event not yet on Kafka stays.
//! - `job_results`: their results (the job row's `result`, emptied).
//! - `jobs`: the jobs, with all their rows, but each document and kind's newest succeeded
//!   version (which supersedes a late older one); sweeping a succeeded version also deletes
//!   the older ended versions of its document and kind, so only that newest one is kept. A
//!   job with an event not yet on Kafka stays.
//!
//! A job that ends again later (a quarantined job replayed) has a new `finished_at`, so the
//! sweeps reach it again.

use std::time::Duration;

use crate::metrics as pm;
use chrono::{DateTime, Utc};
use jobfold_common::config::Config;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Runs every configured sweep every `retention.interval` until shutdown.
pub async fn run(config: Config, pool: PgPool, shutdown: CancellationToken) {
    let sweeps = config.retention.sweeps();
    if sweeps.is_empty() {
        return;
    }
    tracing::info!(?sweeps, "Retention on.");
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(config.retention.interval) => {}
        }
        for &(name, after) in &sweeps {
            // Whole batches mean more is due: go on, until it is done or the shutdown.
            loop {
                if shutdown.is_cancelled() {
                    return;
                }
                match sweep(&pool, name, after, config.retention.batch).await {
                    Ok(swept) if swept < config.retention.batch => break,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %format!("{e:#}"), sweep = name, "Retention sweep failed.");
                        break;
                    }
                }
            }
        }
    }
}

/// One batch of sweep `name`: up to `batch` jobs ended more than `after` ago, past its
/// cursor; returns how many jobs it passed (0 if another processor holds the sweep).
///
/// # Errors
/// The database failed.
pub async fn sweep(
    pool: &PgPool,
    name: &'static str,
    after: Duration,
    batch: usize,
) -> anyhow::Result<usize> {
    let mut tx = pool.begin().await?;
    let cursor = sqlx::query!(
        "SELECT finished_at, job_id FROM retention_cursor WHERE name = $1 FOR UPDATE SKIP LOCKED",
        name,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(cursor) = cursor else { return Ok(0) };
    let cutoff = Utc::now() - chrono::Duration::from_std(after)?;
    let passed = sqlx::query!(
        r#"
        SELECT job_id, finished_at AS "finished_at!",
               state IN ('succeeded', 'superseded', 'cancelled') AS "ended!"
        FROM jobs
        WHERE finished_at IS NOT NULL AND (finished_at, job_id) > ($1, $2) AND finished_at < $3
        ORDER BY finished_at, job_id
        LIMIT $4
        "#,
        cursor.finished_at,
        cursor.job_id,
        cutoff,
        i64::try_from(batch)?,
    )
    .fetch_all(&mut *tx)
    .await?;
    let Some(last) = passed.last() else { return Ok(0) };
    let (last_job, last_finished) = (last.job_id, last.finished_at);
    let ended: Vec<Uuid> = passed.iter().filter(|p| p.ended).map(|p| p.job_id).collect();
    match name {
        "job_events" => delete_events(&mut tx, &ended).await?,
        "job_results" => delete_results(&mut tx, &ended).await?,
        "jobs" => delete_jobs(&mut tx, &ended, cutoff).await?,
        other => anyhow::bail!("no retention sweep is called {other}"),
    }
    sqlx::query!(
        "UPDATE retention_cursor SET finished_at = $2, job_id = $3, swept_at = now() WHERE name = $1",
        name,
        last_finished,
        last_job,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(passed.len())
}

fn deleted(table: &'static str, rows: u64) {
    metrics::counter!(pm::RETENTION_DELETED_TOTAL, "table" => table).increment(rows);
}

/// The jobs' results, emptied in their rows (which the `jobs` sweep deletes later, or keeps
/// as the newest version of their document).
async fn delete_results(tx: &mut PgConnection, jobs: &[Uuid]) -> sqlx::Result<()> {
    // Locked in job_id order, as the `jobs` sweep and the lease transactions lock them.
    let done = sqlx::query!(
        r#"
        UPDATE jobs SET result = NULL
        WHERE job_id IN (SELECT job_id FROM jobs WHERE job_id = ANY($1) AND result IS NOT NULL
                         ORDER BY job_id FOR UPDATE)
        "#,
        jobs
    )
    .execute(tx)
    .await?;
    deleted("job_results", done.rows_affected());
    Ok(())
}

/// The jobs' events on Kafka, and their published outbox rows.
async fn delete_events(tx: &mut PgConnection, jobs: &[Uuid]) -> sqlx::Result<()> {
    let outbox = sqlx::query!(
        "DELETE FROM outbox o USING job_events e \
         WHERE o.seq = e.seq AND e.job_id = ANY($1) AND o.published_at IS NOT NULL",
        jobs,
    )
    .execute(&mut *tx)
    .await?;
    deleted("outbox", outbox.rows_affected());
    let events = sqlx::query!(
        r#"
        DELETE FROM job_events e USING relay_cursor c
        WHERE e.job_id = ANY($1) AND (e.xid, e.seq) <= (c.published_xid, c.published_seq)
          AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.seq = e.seq)
        "#,
        jobs,
    )
    .execute(&mut *tx)
    .await?;
    deleted("job_events", events.rows_affected());
    Ok(())
}

/// The jobs (but each document and kind's newest succeeded version) and the older ended
/// versions of the succeeded ones, with every row of theirs (the result is in the job's
/// own); a job with an event not yet on Kafka stays.
async fn delete_jobs(
    tx: &mut PgConnection,
    jobs: &[Uuid],
    cutoff: DateTime<Utc>,
) -> anyhow::Result<()> {
    // Locked in job_id order, as the lease transactions lock them.
    let doomed = sqlx::query_scalar!(
        r#"
        WITH passed AS (
            SELECT job_id, document_id, kind, input_version, state FROM jobs WHERE job_id = ANY($1)
        ), doomed AS (
            SELECT p.job_id FROM passed p
            WHERE p.state <> 'succeeded'
               OR EXISTS (SELECT 1 FROM jobs n
                          WHERE n.document_id = p.document_id AND n.kind = p.kind
                            AND n.state = 'succeeded' AND n.input_version > p.input_version)
            UNION
            SELECT o.job_id FROM passed p
            JOIN jobs o ON o.document_id = p.document_id AND o.kind = p.kind
                       AND o.input_version < p.input_version
            WHERE p.state = 'succeeded' AND o.state IN ('succeeded', 'superseded', 'cancelled')
              AND o.finished_at < $2
        )
        SELECT j.job_id FROM jobs j JOIN doomed USING (job_id)
        WHERE NOT EXISTS (
            SELECT 1 FROM job_events e CROSS JOIN relay_cursor c
            WHERE e.job_id = j.job_id
              AND ((e.xid, e.seq) > (c.published_xid, c.published_seq)
                   OR EXISTS (SELECT 1 FROM outbox o WHERE o.seq = e.seq AND o.published_at IS NULL)))
        ORDER BY j.job_id
        FOR UPDATE OF j
        "#,
        jobs,
        cutoff,
    )
    .fetch_all(&mut *tx)
    .await?;
    if doomed.is_empty() {
        return Ok(());
    }
    delete_events(tx, &doomed).await?;
    sqlx::query!("DELETE FROM job_counters WHERE job_id = ANY($1)", &doomed)
        .execute(&mut *tx)
        .await?;
    sqlx::query!("DELETE FROM quarantine WHERE job_id = ANY($1)", &doomed)
        .execute(&mut *tx)
        .await?;
    let done = sqlx::query!("DELETE FROM jobs WHERE job_id = ANY($1)", &doomed).execute(tx).await?;
    deleted("jobs", done.rows_affected());
    Ok(())
}
