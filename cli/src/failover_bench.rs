//! `jobfold bench --failover COMMAND`: the pause a Postgres failover causes, as callers and
//! jobs see it, next to the lease TTL.
//!
//! A relay and a processor run against the configured primary and its standby (libpq's
//! multi-host `database_url`), in a database and topics of their own. Trivial jobs are
//! submitted over `POST /v1/jobs` at a steady rate, each sent when due however many still
//! wait, every refused or failed request retried with its idempotency key until
//! acknowledged, as upstream services do. After a baseline, `COMMAND` runs in a shell — whatever moves the
//! primary where the bench runs (`docker/postgres.sh failover`, `patronictl failover`,
//! `pg_autoctl perform failover`) — and the load goes on after it. Then every acknowledged
//! job must have succeeded, once, and the processor must have moved to another primary.
//!
//! Reported: the longest time no request was acknowledged (accepts unavailable) and where it
//! fell; accept → succeeded at p50/p99 for the jobs first submitted across the failover next
//! to those before it, from the first attempt of a submission (what its caller waited); the
//! leases that expired meanwhile; each against the processors' lease TTL.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, TimeDelta, Utc};
use jobfold_common::accept::NewJob;
use jobfold_common::config::Config;
use jobfold_common::pg_hosts::Hosts;
use tokio::sync::Mutex;

use crate::bench::{Row, histogram_of, ms, table};

/// How the load and its timing are sized.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    /// Load before the command runs.
    pub(crate) before: Duration,
    /// Load after the command ended.
    pub(crate) after: Duration,
    /// Submissions a second.
    pub(crate) rate: f64,
}

impl Plan {
    pub(crate) fn new(smoke: bool) -> Self {
        let secs = Duration::from_secs;
        if smoke {
            Self { before: secs(3), after: secs(5), rate: 40.0 }
        } else {
            Self { before: secs(10), after: secs(20), rate: 100.0 }
        }
    }
}

/// A submission: its first attempt, its acknowledgement.
#[derive(Debug, Clone, Copy)]
struct Submitted {
    first: DateTime<Utc>,
    acknowledged: DateTime<Utc>,
}

/// What the callers saw.
#[derive(Debug, Default)]
struct Seen {
    /// By idempotency key.
    submitted: Vec<(String, Submitted)>,
    /// Answers 503 (`not_durable_yet`, no primary), and requests that failed outright.
    refused: usize,
    failed: usize,
}

/// When the command ran, and what came of it.
struct Measured {
    command: String,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    seen: Seen,
    finished: HashMap<String, DateTime<Utc>>,
    dispatched_again: i64,
}

/// Runs the measurement in a database and topics of its own; the table.
///
/// # Errors
/// `database_url` names one host, the command failed, the primary did not move, or an
/// acknowledged job did not succeed.
pub(crate) async fn run(config: Config, command: String, plan: Plan) -> anyhow::Result<String> {
    let hosts = Hosts::parse(config.database_url.expose())
        .map_err(|problem| anyhow::anyhow!("database_url: {problem}"))?;
    anyhow::ensure!(
        hosts.urls.len() >= 2,
        "--failover needs database_url to name the primary and its standby, in libpq's \
         multi-host form (postgres://…@h1,h2/jobfold?target_session_attrs=read-write)"
    );
    let started = std::time::Instant::now();
    let measured = crate::bench::in_scratch(config.clone(), |config| async move {
        measure(&config, command, plan).await
    })
    .await?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    Ok(format!(
        "{}\n{cores} cores; Postgres, Kafka and the registry on the same machine; {:.0} s in all.\n",
        table(rows(&config, &measured, plan.rate)),
        started.elapsed().as_secs_f64()
    ))
}

async fn measure(config: &Config, command: String, plan: Plan) -> anyhow::Result<Measured> {
    let pool = jobfold_common::db::connect_and_migrate(config, 4).await?;
    jobfold_common::kafka::ensure_topics(config, &jobfold_common::kafka::jobfold_topics(config))
        .await?;
    let mut config = config.clone();
    config.processor.group = format!("jobfold-bench-failover-{}", uuid::Uuid::new_v4().simple());
    let config = &config;
    let logs = std::env::temp_dir()
        .join(format!("jobfold-bench-failover-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&logs)?;
    let bin = std::env::current_exe()?.parent().context("the binary's directory")?.to_path_buf();
    let _relay = crate::demo::spawn(config, &bin.join("jobfold-relay"), "relay", &logs, &[])?;
    let (processor, _) = crate::bench::examples(config, &bin, "processor", &logs, &[]).await?;
    let changes =
        |port| crate::demo::metric_sum(port, jobfold_common::metrics::PRIMARY_CHANGES_TOTAL, "");
    let moved_before = changes(processor.metrics).await.unwrap_or(0.0);

    // The load; the command once the baseline is in; the load on after it.
    let url = format!("http://127.0.0.1:{}/v1/jobs", processor.http);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(load(url, plan.rate, Arc::clone(&seen), Arc::clone(&stop)));
    tokio::time::sleep(plan.before).await;
    let from = Utc::now();
    let output = tokio::process::Command::new("sh")
        .args(["-c", &command])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {command:?}"))?;
    let to = Utc::now();
    anyhow::ensure!(
        output.status.success(),
        "{command:?} failed ({}): {}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    tokio::time::sleep(plan.after).await;
    stop.store(true, Ordering::SeqCst);
    load.await??;
    let seen = std::mem::take(&mut *seen.lock().await);

    // Every acknowledged job succeeded, and there is one job per submission.
    let keys: Vec<String> = seen.submitted.iter().map(|(key, _)| key.clone()).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let finished = loop {
        let finished = sqlx::query!(
            r#"SELECT idempotency_key AS "key!", finished_at AS "finished_at!"
               FROM jobs WHERE idempotency_key = ANY($1) AND state = 'succeeded'"#,
            &keys,
        )
        .fetch_all(&pool)
        .await?;
        if finished.len() == keys.len() {
            break finished;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "{} of {} acknowledged jobs succeeded within 120 s of the load's end (logs in {})",
            finished.len(),
            keys.len(),
            logs.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let jobs: i64 =
        sqlx::query_scalar!(r#"SELECT count(*) AS "n!" FROM jobs"#).fetch_one(&pool).await?;
    anyhow::ensure!(
        jobs == keys.len() as i64,
        "{jobs} jobs for {} acknowledged submissions",
        keys.len()
    );
    let moved = changes(processor.metrics).await.unwrap_or(0.0) - moved_before;
    anyhow::ensure!(
        moved >= 1.0,
        "the processor never moved to another primary: {command:?} did not fail Postgres over"
    );
    let dispatched_again =
        sqlx::query_scalar!(r#"SELECT count(*) AS "n!" FROM job_events WHERE kind = 'RetryDue'"#)
            .fetch_one(&pool)
            .await?;
    pool.close().await;
    let finished = finished.into_iter().map(|r| (r.key, r.finished_at)).collect();
    Ok(Measured { command, from, to, seen, finished, dispatched_again })
}

/// The table's rows.
fn rows(config: &Config, m: &Measured, rate: f64) -> Vec<Row> {
    let secs = |d: TimeDelta| d.as_seconds_f64();
    let ttl = crate::demo::LEASE_TTL.as_secs_f64();
    // The longest stretch without an acknowledgement, and where it began.
    let mut acks: Vec<DateTime<Utc>> =
        m.seen.submitted.iter().map(|(_, s)| s.acknowledged).collect();
    acks.sort();
    let (gap, gap_from) = acks
        .windows(2)
        .map(|w| (secs(w[1] - w[0]), w[0]))
        .fold((0.0, m.from), |best, next| if next.0 > best.0 { next } else { best });
    // Accept -> succeeded from a submission's first attempt: before the command, and across
    // it (first sent while it ran, or within the unavailable stretch should that end later).
    let across_until = m.to.max(gap_from + TimeDelta::milliseconds((gap * 1e3) as i64));
    let spans = |keep: &dyn Fn(DateTime<Utc>) -> bool| {
        histogram_of(m.seen.submitted.iter().filter(|(_, s)| keep(s.first)).filter_map(
            |(key, s)| Some((secs(*m.finished.get(key)? - s.first) * 1e6).max(0.0) as u64),
        ))
    };
    let before = spans(&|first| first < m.from);
    let across = spans(&|first| first >= m.from && first < across_until);
    let mut rows = vec![
        Row::new("Postgres failover: accepts unavailable").versus(gap, ttl, "lease TTL").note(
            format!(
                "`{}` took {:.2} s; longest {gap:.2} s without an acknowledgement, from \
                 {:+.2} s after it started; {} answers 503 (not durable yet, no primary) and {} \
                 failed requests, each retried with its idempotency key; {} jobs acknowledged \
                 at {rate:.0} a second, every one succeeded",
                m.command,
                secs(m.to - m.from),
                secs(gap_from - m.from),
                m.seen.refused,
                m.seen.failed,
                m.seen.submitted.len(),
            ),
        ),
    ];
    let across_row = Row::new("Postgres failover: accept -> succeeded across it");
    rows.push(match (before, across) {
        (Ok(before), Ok(across)) if !across.is_empty() => {
            let added = (ms(&across, 0.99) - ms(&before, 0.99)).max(0.0) / 1e3;
            across_row.latency(&across).versus(ms(&across, 0.99) / 1e3, ttl, "lease TTL").note(
                format!(
                    "{} jobs first submitted while the command ran or accepts were unavailable, \
                     timed from their first attempt: p99 {:.0} ms, longest {:.0} ms, against \
                     p99 {:.0} ms before it ({added:.2} s added); jobs dispatched again by the \
                     reaper: {} (lease TTL {ttl:.0} s, primary checked every {} ms)",
                    across.len(),
                    ms(&across, 0.99),
                    across.max() as f64 / 1e3,
                    ms(&before, 0.99),
                    m.dispatched_again,
                    config.database.primary_check.as_millis()
                ),
            )
        }
        _ => across_row.note("no job was first submitted across the failover"),
    });
    rows
}

/// Submissions arriving at `rate` a second until `stop`, each sent when due however many
/// still wait (upstream callers do not queue behind one another), each retried with its
/// idempotency key until acknowledged.
async fn load(
    url: String,
    rate: f64,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
    let started = tokio::time::Instant::now();
    let mut submissions = tokio::task::JoinSet::new();
    for i in 0usize.. {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / rate)).await;
        submissions.spawn(submit(http.clone(), url.clone(), i, Arc::clone(&seen)));
    }
    while let Some(submitted) = submissions.join_next().await {
        submitted??;
    }
    Ok(())
}

/// Submission `i`, until acknowledged.
async fn submit(
    http: reqwest::Client,
    url: String,
    i: usize,
    seen: Arc<Mutex<Seen>>,
) -> anyhow::Result<()> {
    let job = NewJob { kind: crate::bench::TRIVIAL_KIND.into(), ..crate::bench::job(i) };
    let key = format!("failover-{i}");
    let body = crate::bench::http_body(&job)?;
    let first = Utc::now();
    let mut backoff = Duration::from_millis(50);
    loop {
        let answer = http
            .post(&url)
            .header("content-type", "application/json")
            .header("idempotency-key", &key)
            .body(body.clone())
            .send()
            .await;
        match answer {
            Ok(a) if a.status().is_success() => break,
            Ok(a) if a.status().is_server_error() => seen.lock().await.refused += 1,
            Ok(a) => anyhow::bail!("job {key} refused: {} {}", a.status(), a.text().await?),
            Err(_) => seen.lock().await.failed += 1,
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
    let acknowledged = Utc::now();
    seen.lock().await.submitted.push((key, Submitted { first, acknowledged }));
    Ok(())
}
