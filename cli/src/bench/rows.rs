//! `limit: a job's Postgres work alone`: what a job's own statements cost Postgres with
//! nothing else running — accepted in batches as the burst's are, then leased and completed
//! in one transaction a batch as the lease transaction commits a short run (lock, the
//! supersede check, one `JobSucceeded` that says its lease, the job row once with its
//! result). No relay, broker or processor: the floor under the end-to-end rows' Postgres
//! share, read as the CPU of the one backend doing it and the WAL it wrote, so a change to
//! the schema or to those statements shows without the pipeline's noise.

use std::time::Instant;

use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_common::config::Config;
use jobfold_processor::store::{self, Events, Success};
use sqlx::PgConnection;

use super::{CpuTime, Row, event_codec, job, register_index_kind};

/// The connection's application name, for finding its backend.
const APPLICATION: &str = "jobfold-bench-rows";
/// The leases' time to live (none of them is ever renewed or read again).
const LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(30);

/// Accepts, then leases and completes, `total` jobs (`batch` a transaction) on one
/// connection of a scratch database of their own.
pub(super) async fn job_rows_alone(
    config: &Config,
    total: usize,
    batch: usize,
) -> anyhow::Result<Row> {
    let pool = jobfold_common::db::connect_and_migrate(config, 2).await?;
    register_index_kind(&pool).await?;
    let codec = event_codec(config).await?;
    let acceptor = Acceptor::new(codec.clone(), config.accept_policy(), "bench");
    let events = Events { codec, topic: config.topics.events.clone(), producer: "bench".into() };
    let mut conn = jobfold_common::db::connect_one(&pool, APPLICATION).await?;
    let backends = super::local_backends(&pool, APPLICATION).await?;

    let wal_before = wal_position(&mut conn).await?;
    let cpu_before = CpuTime::now(&backends);
    let started = Instant::now();
    for first in (0..total).step_by(batch.max(1)) {
        let jobs: Vec<NewJob> = (first..(first + batch).min(total)).map(job).collect();
        accept_then_complete(&mut conn, &acceptor, &events, &jobs).await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_after = CpuTime::now(&backends);
    let wal = (wal_position(&mut conn).await? - wal_before) / total.max(1) as f64;
    pool.close().await;

    let cpu = match (cpu_before, cpu_after) {
        (Some(before), Some(after)) if !backends.is_empty() => {
            let (_, own) = before.per_item_since(&after, total as f64);
            format!("; {:.0} µs of its Postgres backend's CPU a job", own.iter().sum::<f64>())
        }
        _ => String::new(),
    };
    Ok(Row::new("limit: a job's Postgres work alone").rate(total as f64 / elapsed).note(format!(
        "{total} jobs on one connection, nothing else running: accepted {batch} a transaction, \
         then leased and completed {batch} a transaction as a short run commits (lock, supersede \
         check, one JobSucceeded saying its lease, the job row with its result); {wal:.0} B of \
         WAL a job{cpu}"
    )))
}

/// One batch: accepted in a transaction, then leased and completed in the next.
async fn accept_then_complete(
    conn: &mut PgConnection,
    acceptor: &Acceptor,
    events: &Events,
    jobs: &[NewJob],
) -> anyhow::Result<()> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let accepted = acceptor.accept_batch_in(&mut tx, jobs).await?;
    tx.commit().await?;
    let ids: Vec<uuid::Uuid> = accepted.iter().map(|a| a.job_id).collect();

    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let mut rows: Vec<store::JobRow> =
        store::lock_jobs_and_newest(&mut tx, &ids).await?.into_iter().map(|(row, _)| row).collect();
    let now = chrono::Utc::now();
    let result = serde_json::Value::Null;
    let mut successes = Vec::with_capacity(rows.len());
    for row in &mut rows {
        row.dispatch_version = 1;
        let lease = store::lease(row, uuid::Uuid::now_v7(), "bench", LEASE_TTL, now)?;
        successes.push(Success { job: row, result: &result, trace: None, lease: Some(lease) });
    }
    store::succeed_all(&mut tx, events, successes).await?;
    tx.commit().await?;
    Ok(())
}

/// Where Postgres's WAL is now, in bytes.
async fn wal_position(conn: &mut PgConnection) -> anyhow::Result<f64> {
    Ok(sqlx::query_scalar!(
        r#"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 AS "position!""#
    )
    .fetch_one(conn)
    .await?)
}
