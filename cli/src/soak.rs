//! `jobfold soak`: the whole pipeline under steady load for a long time, retention on, to
//! show that nothing grows without bound and nothing is lost or done twice.
//!
//! In a database and topics of its own (as the bench): a relay and a `jobfold-examples`
//! processor (index-document, and one job in ten a summarize-conversation against the
//! stand-in model), retention windows scaled to the run. First a burst measures the
//! end-to-end rate; then jobs arrive at half of it (or `--rate`) over a fixed set of
//! documents, each job a new version of its document. Every `--interval` it samples the
//! processor's and relay's resident memory, the consumer lag and the tables' rows and size.
//! At the end it drains, replays the events topic (the log of record) with `--verify`, and
//! checks the business tables:
//! - lost: a job accepted and not ended `succeeded` or `superseded` in the log, or a
//!   document whose business row is not at its newest version;
//! - duplicate effects: a job with a second result in the log (the fold refuses it);
//! - flat: after the first third (the warm-up), each figure's peak in the last third is at
//!   most 1.25 × its peak in the middle third (a figure growing steadily from the start
//!   reaches 1.5).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context;
use jobfold_cli::analytics;
use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_common::config::Config;
use jobfold_schemas::Status;
use serde_json::json;
use sqlx::PgPool;

/// What to run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    pub(crate) duration: Duration,
    pub(crate) interval: Duration,
    /// Jobs a second; none: half the burst's end-to-end rate.
    pub(crate) rate: Option<f64>,
    pub(crate) documents: usize,
}

/// What is sampled, as rows are reported: three tables, and the results kept (in `jobs`).
const TABLES: [&str; 4] = ["jobs", "job_events", "results", "outbox"];

/// How many figures a sample has: the two processes' memory, the lag, and each table's rows.
#[derive(Debug, Clone)]
struct Sample {
    at: Duration,
    accepted: usize,
    unfinished: i64,
    processor_rss_mib: f64,
    relay_rss_mib: f64,
    lag: f64,
    /// Messages the processor holds in memory (`jobfold_buffered_messages`).
    buffered: f64,
    rows: [i64; TABLES.len()],
    database_mib: f64,
}

/// Runs the soak; returns the report (markdown) and whether it passed.
pub(crate) async fn run(config: Config, plan: Plan) -> anyhow::Result<(String, bool)> {
    crate::bench::in_scratch(config, |config| soak(config, plan)).await
}

/// Document and version of job `i`: one of `documents` documents, each job the next version
/// of its document; one in ten is a summary, and one summary in five is refused once by the
/// model (503, `Retry-After: 1`) and retried.
fn job(i: usize, documents: usize) -> NewJob {
    let summary = i % 10 == 9;
    let plan = if i % 50 == 49 { "flaky" } else { "soak" };
    NewJob {
        document_id: format!("doc-{}", i % documents),
        kind: if summary { "summarize-conversation" } else { "index-document" }.into(),
        input_version: (i / documents) as i64 + 1,
        input: if summary {
            crate::bench::conversation(plan)
        } else {
            json!({ "text": format!("the quick brown fox, version {}", i / documents + 1) })
        },
        idempotency_key: Some(format!("soak-{i}")),
        trace: None,
        run_at: None,
    }
}

async fn soak(mut config: Config, plan: Plan) -> anyhow::Result<(String, bool)> {
    // Windows scaled to the run: the two row kinds after an eighth of it, the jobs after
    // a quarter, so the last two thirds run with every sweep at work.
    let window = (plan.duration / 8).max(Duration::from_secs(10));
    let r = &mut config.retention;
    r.job_events_after = Some(window);
    r.job_results_after = Some(window);
    r.jobs_after = Some((plan.duration / 4).max(window * 2));
    r.interval = (window / 4).min(Duration::from_secs(30));
    config.processor.group = format!("jobfold-soak-{}", uuid::Uuid::new_v4().simple());
    config.validate()?;
    // The examples processor migrates its own tables as it starts.
    let pool = jobfold_common::db::connect_and_migrate(&config, 8).await?;
    jobfold_common::kafka::ensure_topics(&config, &jobfold_common::kafka::jobfold_topics(&config))
        .await?;
    let codec = crate::bench::event_codec(&config).await?;
    let acceptor = Acceptor::new(codec, config.accept_policy(), "soak");
    let logs = std::env::temp_dir().join(format!("jobfold-soak-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&logs)?;
    let bin = std::env::current_exe()?.parent().context("the binary's directory")?.to_path_buf();
    let mut relay = crate::demo::spawn(&config, &bin.join("jobfold-relay"), "relay", &logs, &[])?;
    let model = crate::model::Model::start(crate::model::Behaviour {
        latency: Duration::from_millis(50),
        fail_first: 0,
    })
    .await?;
    model.plan(
        "flaky",
        crate::model::Behaviour { latency: Duration::from_millis(50), fail_first: 1 },
    );
    let args = ["--model-url".to_owned(), model.url.clone()];
    let mut processor =
        crate::demo::spawn(&config, &bin.join("jobfold-examples"), "processor", &logs, &args)?;
    crate::demo::wait_ready(processor.http).await?;
    let processor_pid = processor.child.id().context("the processor's pid")?;
    let relay_pid = relay.child.id().context("the relay's pid")?;

    // The burst: the end-to-end rate this machine has now.
    let burst = 2_000;
    let started = Instant::now();
    for chunk in (0..burst).collect::<Vec<_>>().chunks(100) {
        let jobs: Vec<NewJob> = chunk.iter().map(|&i| job(i, plan.documents)).collect();
        acceptor.accept_batch(&pool, &jobs).await?;
    }
    wait_ended(&pool, Duration::from_secs(600)).await?;
    let burst_rate = burst as f64 / started.elapsed().as_secs_f64();
    let rate = plan.rate.unwrap_or(burst_rate / 2.0).max(1.0);
    println!(
        "soak: burst {burst_rate:.0} jobs/s; {rate:.0} jobs/s for {} s, sampling every {} s",
        plan.duration.as_secs(),
        plan.interval.as_secs()
    );

    // The load, while sampling.
    let documents = plan.documents;
    let make = move |i: usize| job(i, documents);
    let load = {
        let (acceptor, pool) = (acceptor.clone(), pool.clone());
        let secs = plan.duration.as_secs();
        tokio::spawn(async move {
            crate::bench::paced(&acceptor, &pool, burst, rate, secs, &make).await
        })
    };
    let soak_started = Instant::now();
    let mut samples = Vec::new();
    let mut ticker = tokio::time::interval(plan.interval);
    ticker.tick().await;
    while !load.is_finished() {
        ticker.tick().await;
        let at = soak_started.elapsed();
        let accepted = burst + (rate * at.as_secs_f64().min(plan.duration.as_secs_f64())) as usize;
        let sample =
            sample(&pool, at, accepted, processor_pid, relay_pid, processor.metrics).await?;
        println!("{}", sample_row(&sample));
        samples.push(sample);
    }
    let submitted = burst + load.await??;

    // Drain: every job ended, every event on Kafka.
    wait_ended(&pool, Duration::from_secs(600)).await?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while jobfold_common::gauges::unpublished(&pool).await? > 0 {
        anyhow::ensure!(Instant::now() < deadline, "the relay did not drain");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Stopped before the replay, so the projection it is compared with stands still.
    processor.child.start_kill()?;
    relay.child.start_kill()?;
    processor.child.wait().await?;
    relay.child.wait().await?;
    let deleted =
        sqlx::query_scalar!(r#"SELECT count(*) AS "count!" FROM jobs"#).fetch_one(&pool).await?;
    let deleted = submitted as i64 - deleted;

    // The log of record, folded and compared with what is left of the projection.
    let decoder = jobfold_schemas::Decoder::new(config.registry()?);
    let mut options = analytics::Options::new(analytics::Source::Kafka);
    options.verify = true;
    let report = analytics::replay(&config, &pool, &decoder, &options).await?;
    let count = |status: Status| report.states.get(&status).copied().unwrap_or(0);
    let ended = count(Status::Succeeded) + count(Status::Superseded);
    let lost_in_log = submitted as u64 - ended.min(submitted as u64);
    let stale = business_rows_behind(&pool, submitted, plan.documents).await?;
    let duplicate_effects = report.anomaly_count;
    pool.close().await;

    let mut out = String::new();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    writeln!(
        out,
        "Soak: {} s at {rate:.0} jobs/s (half the burst's {burst_rate:.0} jobs/s), {} documents, \
         one job in ten a summary (50 ms stand-in model); retention: events and \
         results after {} s, jobs after {} s, swept every {} s. {cores} cores; Postgres, Kafka \
         and the registry on the same machine.\n",
        plan.duration.as_secs(),
        plan.documents,
        window.as_secs(),
        config.retention.jobs_after.unwrap_or_default().as_secs(),
        config.retention.interval.as_secs()
    )?;
    writeln!(out, "| {} |", header().join(" | "))?;
    writeln!(out, "|{}", " ---: |".repeat(header().len()))?;
    let step = samples.len().div_ceil(12).max(1);
    for (i, s) in samples.iter().enumerate() {
        if i % step == 0 || i + 1 == samples.len() {
            writeln!(out, "{}", sample_row(s))?;
        }
    }
    let flat = flatness(&samples, rate, plan.duration >= Duration::from_secs(600));
    writeln!(out)?;
    for (figure, middle, last, ok) in &flat {
        writeln!(
            out,
            "- {figure}: peak {middle:.1} in the middle third, {last:.1} in the last: {}",
            if *ok { "flat" } else { "GROWING" }
        )?;
    }
    writeln!(
        out,
        "- {submitted} jobs accepted; in the log {} succeeded, {} superseded, {} quarantined; \
         lost: {}; duplicate effects: {duplicate_effects}; {deleted} jobs deleted by retention \
         (verify: {} differences, {} ended jobs no longer in the projection)",
        count(Status::Succeeded),
        count(Status::Superseded),
        count(Status::Quarantined),
        lost_in_log + stale,
        report.difference_count,
        report.deleted_by_retention,
    )?;
    let passed = lost_in_log == 0
        && stale == 0
        && duplicate_effects == 0
        && report.is_clean()
        && deleted > 0
        && flat.iter().all(|f| f.3);
    writeln!(out, "- {}", if passed { "PASSED" } else { "FAILED" })?;
    Ok((out, passed))
}

fn header() -> Vec<String> {
    let mut h = vec![
        "s".to_owned(),
        "accepted".into(),
        "unfinished".into(),
        "lag".into(),
        "buffered".into(),
        "processor RSS MiB".into(),
        "relay RSS MiB".into(),
    ];
    h.extend(TABLES.iter().map(|t| format!("{t} rows")));
    h.push("database MiB".into());
    h
}

fn sample_row(s: &Sample) -> String {
    let mut cells = vec![
        s.at.as_secs().to_string(),
        s.accepted.to_string(),
        s.unfinished.to_string(),
        format!("{:.0}", s.lag),
        format!("{:.0}", s.buffered),
        format!("{:.1}", s.processor_rss_mib),
        format!("{:.1}", s.relay_rss_mib),
    ];
    cells.extend(s.rows.iter().map(i64::to_string));
    cells.push(format!("{:.1}", s.database_mib));
    format!("| {} |", cells.join(" | "))
}

/// Each figure's peak in the middle and last thirds, and whether the last stays within
/// 1.25 × the middle (the lag within two seconds of load, too: it moves by the batch). The
/// database's size counts only in a long run (`size_too`): its files grow until vacuum's
/// free space is reused, which takes minutes.
fn flatness(samples: &[Sample], rate: f64, size_too: bool) -> Vec<(String, f64, f64, bool)> {
    let third = samples.len() / 3;
    if third == 0 {
        return vec![("samples".into(), 0.0, samples.len() as f64, false)];
    }
    let of = |f: &dyn Fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<f64>>();
    let mut series = vec![
        ("processor RSS MiB".to_owned(), of(&|s| s.processor_rss_mib), 0.0),
        ("relay RSS MiB".to_owned(), of(&|s| s.relay_rss_mib), 0.0),
        ("consumer lag".to_owned(), of(&|s| s.lag), 2.0 * rate),
    ];
    for (i, table) in TABLES.iter().enumerate() {
        series.push((format!("{table} rows"), of(&|s| s.rows[i] as f64), 0.0));
    }
    series.push(("database MiB".to_owned(), of(&|s| s.database_mib), 0.0));
    let peak = |values: &[f64]| values.iter().copied().fold(0.0, f64::max);
    series
        .into_iter()
        .map(|(name, values, slack)| {
            let (m, l) = (peak(&values[third..2 * third]), peak(&values[2 * third..]));
            let checked = size_too || name != "database MiB";
            (name, m, l, !checked || l <= 1.25 * m + slack)
        })
        .collect()
}

async fn sample(
    pool: &PgPool,
    at: Duration,
    accepted: usize,
    processor_pid: u32,
    relay_pid: u32,
    metrics_port: u16,
) -> anyhow::Result<Sample> {
    // Each of TABLES, in its order.
    let counted = sqlx::query!(
        r#"
        SELECT (SELECT count(*) FROM jobs) AS "jobs!",
               (SELECT count(*) FROM job_events) AS "job_events!",
               (SELECT count(*) FROM jobs WHERE result IS NOT NULL) AS "results!",
               (SELECT count(*) FROM outbox) AS "outbox!",
               (SELECT count(*) FROM jobs WHERE finished_at IS NULL AND state <> 'quarantined')
                   AS "unfinished!",
               pg_database_size(current_database()) AS "bytes!"
        "#
    )
    .fetch_one(pool)
    .await?;
    let rows = [counted.jobs, counted.job_events, counted.results, counted.outbox];
    let (unfinished, bytes) = (counted.unfinished, counted.bytes);
    Ok(Sample {
        at,
        accepted,
        unfinished,
        processor_rss_mib: rss_mib(processor_pid)?,
        relay_rss_mib: rss_mib(relay_pid)?,
        lag: crate::demo::metric_sum(metrics_port, "jobfold_consumer_lag", "")
            .await
            .unwrap_or(f64::NAN),
        buffered: crate::demo::metric_sum(metrics_port, "jobfold_buffered_messages", "")
            .await
            .unwrap_or(f64::NAN),
        rows,
        database_mib: bytes as f64 / 1048576.0,
    })
}

/// Resident memory now (VmRSS).
fn rss_mib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("VmRSS missing from /proc status")?;
    Ok(kib / 1024.0)
}

async fn wait_ended(pool: &PgPool, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = sqlx::query_scalar!(
            r#"SELECT count(*) AS "count!" FROM jobs WHERE finished_at IS NULL"#
        )
        .fetch_one(pool)
        .await?;
        if left == 0 {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "{left} jobs did not end");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Documents whose business row (the index, the summary) is not at the newest version
/// submitted for them: their newest job's effect is missing.
async fn business_rows_behind(
    pool: &PgPool,
    submitted: usize,
    documents: usize,
) -> anyhow::Result<u64> {
    let mut newest: HashMap<(bool, String), i64> = HashMap::new();
    for i in 0..submitted {
        let j = job(i, documents);
        let summary = j.kind == "summarize-conversation";
        let v = newest.entry((summary, j.document_id)).or_default();
        *v = (*v).max(j.input_version);
    }
    let index =
        sqlx::query!("SELECT document_id, version FROM document_index").fetch_all(pool).await?;
    let summaries = sqlx::query!("SELECT conversation_id, version FROM conversation_summaries")
        .fetch_all(pool)
        .await?;
    let have: HashMap<(bool, String), i64> = index
        .into_iter()
        .map(|r| ((false, r.document_id), r.version))
        .chain(summaries.into_iter().map(|r| ((true, r.conversation_id), r.version)))
        .collect();
    Ok(newest.iter().filter(|(key, version)| have.get(*key) != Some(version)).count() as u64)
}
