//! `jobfold bench`: what jobfold does on this machine, next to the machine's own limits,
//! measured in one run against the configured Postgres, Kafka and registry.
//!
//! Everything happens in a database and topics of its own (`jobfold_bench_*`), dropped at
//! the end; the configured database is used only to create it.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use hdrhistogram::Histogram;
use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_common::config::{Config, Sensitive};
use jobfold_processor::metrics as pm;
use jobfold_schemas::{Codec, JobEvent};
use serde_json::json;
use sqlx::PgPool;

use crate::demo::{peak_rss_mib, rss_mib, wait_finished};

mod rows;

/// How long to measure.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub(crate) raw_messages: usize,
    pub(crate) single_accepts: usize,
    pub(crate) concurrent_accepts: usize,
    pub(crate) batched_accepts: usize,
    pub(crate) batch: usize,
    pub(crate) steady_secs: u64,
    pub(crate) e2e_jobs: usize,
    /// Slow jobs: how many, and how long each handler sleeps.
    pub(crate) slow_jobs: usize,
    pub(crate) slow_ms: u64,
    /// Remote jobs held in flight at once (a handler over HTTP/2 that answered 202), and
    /// how long they are held.
    pub(crate) remote_jobs: usize,
    pub(crate) remote_hold: Duration,
    /// Events for the relay to drain: the accepted ones, then copies of them up to this many,
    /// so that its start and end are a small part of the time.
    pub(crate) relay_backlog: usize,
    /// How long the end-to-end burst may wait for the machine to be idle first.
    pub(crate) settle: Duration,
}

impl Sizes {
    pub(crate) fn quick() -> Self {
        Self {
            raw_messages: 200_000,
            single_accepts: 2_000,
            concurrent_accepts: 10_000,
            batched_accepts: 150_000,
            batch: 100,
            steady_secs: 5,
            e2e_jobs: 5_000,
            slow_jobs: 1_000,
            slow_ms: 10_000,
            remote_jobs: 2_000,
            remote_hold: Duration::from_secs(5),
            relay_backlog: 1_000_000,
            settle: Duration::from_secs(60),
        }
    }

    /// Every measurement, too small to mean anything: checks that the bench runs.
    pub(crate) fn smoke() -> Self {
        Self {
            raw_messages: 5_000,
            single_accepts: 100,
            concurrent_accepts: 500,
            batched_accepts: 5_000,
            batch: 100,
            steady_secs: 1,
            e2e_jobs: 300,
            slow_jobs: 20,
            slow_ms: 1_000,
            remote_jobs: 50,
            remote_hold: Duration::from_secs(1),
            relay_backlog: 0,
            // Under the test suite the machine is never idle.
            settle: Duration::ZERO,
        }
    }

    pub(crate) fn full() -> Self {
        Self {
            raw_messages: 2_000_000,
            single_accepts: 10_000,
            concurrent_accepts: 50_000,
            batched_accepts: 1_000_000,
            batch: 100,
            steady_secs: 30,
            e2e_jobs: 50_000,
            slow_jobs: 1_000,
            // The long run's slow jobs hold their leases through sixty heartbeats.
            slow_ms: 60_000,
            remote_jobs: 10_000,
            remote_hold: Duration::from_secs(30),
            relay_backlog: 5_000_000,
            settle: Duration::from_secs(60),
        }
    }
}

/// One row of the results table.
#[derive(Default)]
pub(crate) struct Row {
    what: String,
    rate: Option<f64>,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    /// The figure next to the limit it is bounded by: "37% of raw producer".
    versus: String,
    note: String,
}

impl Row {
    pub(crate) fn new(what: impl Into<String>) -> Self {
        Self { what: what.into(), ..Self::default() }
    }

    pub(crate) fn rate(mut self, rate: f64) -> Self {
        self.rate = Some(rate);
        self
    }

    pub(crate) fn latency(mut self, h: &Histogram<u64>) -> Self {
        self.p50_ms = Some(ms(h, 0.5));
        self.p99_ms = Some(ms(h, 0.99));
        self
    }

    pub(crate) fn versus(mut self, value: f64, limit: f64, name: &str) -> Self {
        self.versus = format!("{:.0}% of {name}", 100.0 * value / limit.max(f64::MIN_POSITIVE));
        self
    }

    pub(crate) fn note(mut self, note: impl Into<String>) -> Self {
        self.note = note.into();
        self
    }
}

fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

pub(crate) fn histogram_of(
    micros: impl IntoIterator<Item = u64>,
) -> anyhow::Result<Histogram<u64>> {
    let mut h = latency_histogram();
    for m in micros {
        h.record(m.max(1))?;
    }
    Ok(h)
}

pub(crate) fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// A conversation to summarize; the stand-in model takes as long as planned for `plan`.
pub(crate) fn conversation(plan: &str) -> serde_json::Value {
    json!({ "messages": [{ "role": "user", "content": format!("{plan}: where is my order?") }] })
}

/// Records that a processor runs index-document, as one deployed would: the accept
/// measurements run without processors.
async fn register_index_kind(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    sqlx::query!(
        "INSERT INTO job_kinds (kind, registered_by) VALUES ('index-document', 'jobfold bench') \
         ON CONFLICT (kind) DO NOTHING",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The trivial job the end-to-end bursts run: `jobfold-examples`' `noop`, which does nothing
/// and writes nothing, as the peers' benchmark jobs do.
pub(crate) const TRIVIAL_KIND: &str = "noop";

pub(crate) fn job(i: usize) -> NewJob {
    NewJob {
        document_id: format!("doc-{i}"),
        kind: "index-document".into(),
        input_version: 1 + (i / 1000) as i64,
        input: json!({ "text": "the quick brown fox jumps over the lazy dog" }),
        idempotency_key: Some(format!("bench-{i}")),
        trace: None,
        run_at: None,
    }
}

/// `jobfold bench --remote N`: the long remote jobs' measurement alone
/// ([`crate::remote_bench`]), in a database and topics of its own, with a relay; a short
/// report.
pub(crate) async fn run_remote(
    config: Config,
    jobs: usize,
    hold: Duration,
) -> anyhow::Result<String> {
    in_scratch(config, |config| async move {
        let pool = jobfold_common::db::connect_and_migrate(&config, 16).await?;
        jobfold_common::kafka::ensure_topics(
            &config,
            &jobfold_common::kafka::jobfold_topics(&config),
        )
        .await?;
        let mut config = config.clone();
        config.processor.group = format!("jobfold-bench-remote-{}", uuid::Uuid::new_v4().simple());
        let acceptor = Acceptor::new(event_codec(&config).await?, config.accept_policy(), "bench");
        let logs = std::env::temp_dir()
            .join(format!("jobfold-bench-remote-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&logs)?;
        let bin =
            std::env::current_exe()?.parent().context("the binary's directory")?.to_path_buf();
        let _relay = crate::demo::spawn(&config, &bin.join("jobfold-relay"), "relay", &logs, &[])?;
        let batch = (0..jobs)
            .map(|i| NewJob { kind: crate::remote_bench::KIND.into(), ..job(i) })
            .collect();
        let m =
            crate::remote_bench::measure(&config, &pool, &acceptor, (&bin, &logs), 0, batch, hold)
                .await?;
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        Ok(format!(
            "| measurement | figure |\n| --- | --- |\n\
             | remote jobs in flight, {} held {} s over HTTP/2 (202, callbacks) | {} |\n\
             | processor RSS | {} |\n\n{cores} cores; Postgres, Kafka and the registry on the \
             same machine; logs in {}",
            m.jobs,
            hold.as_secs(),
            m.note(),
            m.rss_note(),
            logs.display()
        ))
    })
    .await
}

/// Runs `measure` against a database and topics of its own, created here and dropped after
/// (the configured database is used only to create it).
pub(crate) async fn in_scratch<T, F, Fut>(mut config: Config, measure: F) -> anyhow::Result<T>
where
    F: FnOnce(Config) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let admin = jobfold_common::db::connect(&config, 1).await?;
    let database = format!("jobfold_bench_{suffix}");
    jobfold_common::db::create_database(&admin, &database).await?;
    let result = async {
        let url = jobfold_common::pg_hosts::with_database(config.database_url.expose(), &database)
            .map_err(|problem| anyhow::anyhow!("database_url: {problem}"))?;
        config.database_url = Sensitive::new(url);
        config.topics.events = format!("jobfold-bench-events-{suffix}");
        config.topics.requests = format!("jobfold-bench-requests-{suffix}");
        config.relay.lock_key = i64::from(rand::random::<u32>());
        let topics = [config.topics.events.clone(), config.topics.requests.clone()];
        let measured = measure(config.clone()).await;
        let names = topics.each_ref().map(String::as_str);
        if let Err(e) = jobfold_common::kafka::delete_topics(&config, &names).await {
            tracing::warn!("leaving the benchmark's topics: {e:#}");
        }
        measured
    }
    .await;
    let _ = jobfold_common::db::drop_database(&admin, &database).await;
    result
}

/// Runs the benchmark and returns the results as a markdown table.
pub(crate) async fn run(config: Config, sizes: Sizes) -> anyhow::Result<String> {
    let started = Instant::now();
    let (mut rows, limits) = in_scratch(config.clone(), |config| async move {
        let mut rows = Vec::new();
        let limits = measure_limits(&config, sizes, &mut rows).await?;
        measure_accept_and_relay(&config, sizes, &limits, &mut rows).await?;
        Ok((rows, limits))
    })
    .await?;
    // A job's statements alone, in a database of their own: nothing else in the tables.
    let alone = in_scratch(config.clone(), |config| async move {
        rows::job_rows_alone(&config, sizes.batched_accepts / 3, sizes.batch).await
    })
    .await?;
    let at = rows.iter().position(|r| !r.what.starts_with("limit:")).unwrap_or(rows.len());
    rows.insert(at, alone);
    // Processing in a database and topics of its own: only its jobs are counted.
    let more = in_scratch(config, |config| async move {
        let mut more = Vec::new();
        measure_processing(&config, sizes, &limits, &mut more).await?;
        Ok(more)
    })
    .await?;
    rows.extend(more);

    let mut out = table(rows);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    writeln!(
        out,
        "\n{cores} cores; Postgres, Kafka and the registry on the same machine; {:.0} s in all.",
        started.elapsed().as_secs_f64()
    )?;
    Ok(out)
}

/// `rows` as a markdown table.
pub(crate) fn table(rows: Vec<Row>) -> String {
    let num = |v: Option<f64>, digits: usize| {
        v.map(|v| format!("{v:.digits$}")).unwrap_or_else(|| "–".into())
    };
    let mut out = String::from(
        "| measurement | per second | p50 ms | p99 ms | vs. limit | note |\n\
         | --- | ---: | ---: | ---: | --- | --- |\n",
    );
    for row in rows {
        out += &format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            row.what,
            num(row.rate, 0),
            num(row.p50_ms, 2),
            num(row.p99_ms, 2),
            row.versus,
            row.note
        );
    }
    out
}

/// The machine's own limits, measured first in the same run.
struct Limits {
    commit_1: f64,
    commit_16: f64,
    rows: f64,
    producer: f64,
    /// CPU per message of the raw producer (µs): the machine's, the producing process's.
    producer_cpu: Option<(f64, f64)>,
}

async fn measure_limits(
    config: &Config,
    sizes: Sizes,
    rows: &mut Vec<Row>,
) -> anyhow::Result<Limits> {
    let pool = jobfold_common::db::connect_and_migrate(config, 32).await?;
    register_index_kind(&pool).await?;
    sqlx::raw_sql(include_str!("../sql/bench.sql")).execute(&pool).await?;
    jobfold_common::kafka::ensure_topics(config, &jobfold_common::kafka::jobfold_topics(config))
        .await?;
    let codec = event_codec(config).await?;
    let bodies: Vec<Vec<u8>> = (0..sizes.raw_messages)
        .map(|i| codec.encode(&sample_event(i)))
        .collect::<Result<_, _>>()?;
    let size = bodies.iter().map(Vec::len).sum::<usize>() / bodies.len().max(1);

    let commit_1 = pg_commits(&pool, 1, sizes.single_accepts, size).await?;
    rows.push(Row::new("limit: Postgres commits, 1 client").rate(commit_1).note(format!(
        "one single-row INSERT per transaction ({size} B), synchronous_commit as configured"
    )));
    let commit_16 = pg_commits(&pool, 16, sizes.concurrent_accepts, size).await?;
    rows.push(
        Row::new("limit: Postgres commits, 16 clients")
            .rate(commit_16)
            .note("the same, 16 connections at once"),
    );
    let multi = pg_rows(&pool, sizes.batched_accepts * 2, 1000, size).await?;
    rows.push(
        Row::new("limit: Postgres multi-row insert")
            .rate(multi)
            .note(format!("rows/s, INSERT … SELECT FROM unnest of 1000 rows of {size} B")),
    );
    // The best of two runs: the first also warms the broker up, as the relay finds it later.
    let (first, second) =
        (raw_producer(config, &bodies).await?, raw_producer(config, &bodies).await?);
    let (producer, producer_cpu) = if first.0 >= second.0 { first } else { second };
    rows.push(Row::new("limit: raw rdkafka producer").rate(producer).note(format!(
        "{} distinct events of {size} B from memory, keyed by 1000 documents, through the \
         relay's producer code and settings; best of 2 runs{}",
        sizes.raw_messages,
        producer_cpu.map_or(String::new(), |(machine, own)| format!(
            "; CPU per event: {machine:.2} µs on the machine, {own:.2} µs of it producing"
        ))
    )));
    let consumer = raw_consumer(config, &config.topics.requests, 2 * sizes.raw_messages).await?;
    rows.push(
        Row::new("limit: raw rdkafka consumer")
            .rate(consumer)
            .note("the same messages read back, all partitions assigned"),
    );
    pool.close().await;
    Ok(Limits { commit_1, commit_16, rows: multi, producer, producer_cpu })
}

async fn measure_accept_and_relay(
    config: &Config,
    sizes: Sizes,
    limits: &Limits,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let pool = jobfold_common::db::connect_and_migrate(config, 32).await?;
    register_index_kind(&pool).await?;
    let codec = event_codec(config).await?;
    let acceptor = Acceptor::new(codec.clone(), config.accept_policy(), "bench");

    // Accept, one at a time: latency as a single client sees it.
    let mut h = latency_histogram();
    let started = Instant::now();
    for i in 0..sizes.single_accepts {
        let t = Instant::now();
        acceptor.accept(&pool, &job(i)).await?;
        h.record(t.elapsed().as_micros() as u64)?;
    }
    let rate = sizes.single_accepts as f64 / started.elapsed().as_secs_f64();
    rows.push(
        Row::new("accept, 1 client")
            .rate(rate)
            .latency(&h)
            .versus(rate, limits.commit_1, "commits, 1 client")
            .note("one transaction per job: job row + event"),
    );

    // Accept, 16 clients at once.
    let offset = sizes.single_accepts;
    let started = Instant::now();
    let latencies: Vec<u64> = futures::stream::iter(0..sizes.concurrent_accepts)
        .map(|i| {
            let acceptor = acceptor.clone();
            let pool = pool.clone();
            async move {
                let t = Instant::now();
                acceptor
                    .accept(&pool, &job(offset + i))
                    .await
                    .map(|_| t.elapsed().as_micros() as u64)
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    let rate = sizes.concurrent_accepts as f64 / started.elapsed().as_secs_f64();
    rows.push(
        Row::new("accept, 16 clients")
            .rate(rate)
            .latency(&histogram_of(latencies)?)
            .versus(rate, limits.commit_16, "commits, 16 clients")
            .note("one transaction per job"),
    );

    // Accept below saturation: the same single accepts arriving at half that rate, each
    // timed from when it was due (open loop: a slow one does not delay the next).
    let offset = offset + sizes.concurrent_accepts;
    let half = rate / 2.0;
    let (h, accepted) = paced_singles(&acceptor, &pool, offset, half, sizes.steady_secs).await?;
    rows.push(
        Row::new(format!("accept, half that rate ({half:.0} jobs/s)"))
            .rate(half)
            .latency(&h)
            .note(format!("{accepted} single accepts arriving one by one, timed from when due")),
    );

    // Accept in batches: one transaction per batch.
    let offset = offset + accepted;
    let mut h = latency_histogram();
    let started = Instant::now();
    for chunk in (0..sizes.batched_accepts).collect::<Vec<_>>().chunks(sizes.batch) {
        let jobs: Vec<NewJob> = chunk.iter().map(|i| job(offset + i)).collect();
        let t = Instant::now();
        acceptor.accept_batch(&pool, &jobs).await?;
        h.record(t.elapsed().as_micros() as u64)?;
    }
    let rate = sizes.batched_accepts as f64 / started.elapsed().as_secs_f64();
    rows.push(
        Row::new(format!("accept, batches of {}", sizes.batch))
            .rate(rate)
            .latency(&h)
            .versus(2.0 * rate, limits.rows, "multi-row insert (2 rows per job)")
            .note("latency per batch"),
    );

    // The relay, a process of its own, drains the backlog everything above left.
    let logs =
        std::env::temp_dir().join(format!("jobfold-bench-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&logs)?;
    let bin = std::env::current_exe()?.parent().context("the binary's directory")?.to_path_buf();
    copy_backlog(&pool, sizes.relay_backlog).await?;
    let backlog = jobfold_common::gauges::unpublished(&pool).await?;
    let start_position = cursor(&pool).await?;
    let mut relay = crate::demo::spawn(config, &bin.join("jobfold-relay"), "relay", &logs, &[])?;
    let relay_pid = relay.child.id().context("the relay's pid")?;
    // Timed from the first move of the cursor, so start-up (connect, lock) is not counted;
    // what the first batch published is left out of the count.
    let deadline = Instant::now() + Duration::from_secs(120);
    let timed_from = loop {
        let position = cursor(&pool).await?;
        if position != start_position {
            break position;
        }
        anyhow::ensure!(Instant::now() < deadline, "the relay did not start publishing");
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let mut cpu_of = vec![relay_pid];
    cpu_of.extend(local_backends(&pool, "jobfold-relay").await?);
    let (started, cpu) = (Instant::now(), CpuTime::now(&cpu_of));
    wait_drained(&pool, Duration::from_secs(600)).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu.zip(CpuTime::now(&cpu_of));
    let timed = sqlx::query_scalar!(
        r#"SELECT count(*) AS "count!" FROM job_events WHERE (xid, seq) > ($1::text::xid8, $2)"#,
        timed_from.0.to_string(),
        timed_from.1,
    )
    .fetch_one(&pool)
    .await?;
    let relay_rate = timed as f64 / elapsed;
    // Where each event's CPU went, next to the raw producer's.
    let cpu_note = cpu.map_or(String::new(), |(before, after)| {
        let (machine, processes) = before.per_item_since(&after, timed as f64);
        let relay = processes[0];
        let mut note = format!(
            "; CPU per event: {machine:.2} µs on the machine, {relay:.2} µs of it in the relay"
        );
        // The backend's share only where Postgres runs on this machine.
        if processes.len() > 1 {
            let postgres: f64 = processes[1..].iter().sum();
            write!(note, " and {postgres:.2} µs in its Postgres backend").expect("to a String");
            if let Some((raw, _)) = limits.producer_cpu {
                // With every core busy, rates go as the inverse of the machine's CPU per event:
                // even if reading cost the relay nothing, its backend's share caps it here.
                write!(
                    note,
                    " (the raw producer: {raw:.2} µs; with Postgres's share added to it, at most \
                     {:.0}% of the raw producer's rate)",
                    100.0 * raw / (raw + postgres)
                )
                .expect("to a String");
            }
        }
        note
    });
    // What reading the same backlog costs alone: the relay's own query and decoding, nothing
    // produced. Reading and producing share the machine's cores, so their costs add up.
    let read_rate = log_read(config, &pool, start_position).await?;
    let together = 1.0 / (1.0 / read_rate + 1.0 / limits.producer);
    rows.push(Row::new("limit: the relay's log read alone").rate(read_rate).note(format!(
        "the same {backlog} events read in batches of {} with the relay's query, \
                 nothing produced; with the raw producer on the same cores: {together:.0}/s",
        config.relay.batch_size
    )));
    rows.push(
        Row::new(format!("relay, draining a backlog (batches of {})", config.relay.batch_size))
            .rate(relay_rate)
            .versus(relay_rate, limits.producer, "raw producer")
            .note(format!(
                "{backlog} events (the accepted ones and copies); {:.0}% of reading and producing \
                 them one after the other ({together:.0}/s){cpu_note}",
                100.0 * relay_rate / together
            )),
    );

    // The relay under accept load: as much as 4 batch clients give, then half of that.
    let decoder = codec.decoder().clone();
    let mut offset = offset + sizes.batched_accepts;
    let since = chrono::Utc::now();
    let accepted = saturate(&acceptor, &pool, offset, 4, sizes.batch, sizes.steady_secs).await?;
    offset += accepted;
    wait_drained(&pool, Duration::from_secs(120)).await?;
    let full_rate = accepted as f64 / sizes.steady_secs as f64;
    let h = topic_latencies(config, &decoder, since).await?;
    rows.push(
        Row::new("relay, full accept load (4 batch clients)")
            .rate(full_rate)
            .latency(&h)
            .versus(full_rate, limits.producer, "raw producer")
            .note(format!("commit -> on Kafka (record timestamp), {} events", h.len())),
    );
    let half = (full_rate / 2.0).max(10.0);
    let since = chrono::Utc::now();
    paced(&acceptor, &pool, offset, half, sizes.steady_secs, &job).await?;
    wait_drained(&pool, Duration::from_secs(120)).await?;
    let h = topic_latencies(config, &decoder, since).await?;
    rows.push(
        Row::new(format!("relay, half load ({half:.0} events/s)"))
            .rate(half)
            .latency(&h)
            .note(format!("commit -> on Kafka, {} events", h.len())),
    );
    let rss = peak_rss_mib(relay_pid)?;
    rows.push(
        Row::new("relay peak RSS")
            .versus(rss, 64.0, "64 MiB")
            .note(format!("{rss:.1} MiB (VmHWM) after the three relay runs")),
    );
    relay.child.start_kill()?;
    relay.child.wait().await?;
    pool.close().await;
    Ok(())
}

async fn measure_processing(
    config: &Config,
    sizes: Sizes,
    limits: &Limits,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let pool = jobfold_common::db::connect_and_migrate(config, 16).await?;
    jobfold_common::kafka::ensure_topics(config, &jobfold_common::kafka::jobfold_topics(config))
        .await?;
    let mut config = config.clone();
    config.processor.group = format!("jobfold-bench-processors-{}", uuid::Uuid::new_v4().simple());
    // Room for every slow job at once, as a deployment of slow jobs would set it.
    config.processor.max_in_flight = config.processor.max_in_flight.max(sizes.slow_jobs + 24);
    let config = &config;
    let codec = event_codec(config).await?;
    let acceptor = Acceptor::new(codec, config.accept_policy(), "bench");
    let logs =
        std::env::temp_dir().join(format!("jobfold-bench-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&logs)?;
    let bin = std::env::current_exe()?.parent().context("the binary's directory")?.to_path_buf();
    let mut relay = crate::demo::spawn(config, &bin.join("jobfold-relay"), "relay", &logs, &[])?;
    // The processors run the example jobs: index-document as the trivial handler, and
    // summarize-conversation against a stand-in model as the slow one.
    let model = crate::model::Model::start(crate::model::Behaviour {
        latency: Duration::from_millis(sizes.slow_ms),
        fail_first: 0,
    })
    .await?;
    model.plan(
        "recovery",
        crate::model::Behaviour { latency: Duration::from_secs(3), fail_first: 0 },
    );
    let args = ["--model-url".to_owned(), model.url.clone()];
    let (mut a, a_pid) = examples(config, &bin, "processor-a", &logs, &args).await?;
    let mut offset = 0;

    // Slow jobs, first, in the fresh processor: how many run at once (10 s handler, a
    // document each), its memory meanwhile, and what keeping their leases alive costs:
    // heartbeat statements a second, and the least time a lease had left when renewed (read
    // from the processor, sampled as the jobs run).
    let slow = sizes.slow_jobs;
    let jobs: Vec<NewJob> = (0..slow)
        .map(|i| NewJob {
            kind: "summarize-conversation".into(),
            input: conversation("slow"),
            ..job(offset + i)
        })
        .collect();
    let beats = |port| crate::demo::metric_sum(port, pm::HEARTBEAT_STATEMENTS_TOTAL, "");
    let beats_before = beats(a.metrics).await.unwrap_or(0.0);
    let started = Instant::now();
    acceptor.accept_batch(&pool, &jobs).await?;
    offset += slow;
    let (mut peak, mut least_margin, mut slow_rss) = (0i64, f64::INFINITY, 0f64);
    loop {
        slow_rss = slow_rss.max(rss_mib(a_pid)?);
        let counted = sqlx::query!(
            r#"SELECT count(*) FILTER (WHERE state = 'leased') AS "leased!",
                      count(*) AS "unfinished!"
               FROM jobs WHERE finished_at IS NULL"#,
        )
        .fetch_one(&pool)
        .await?;
        let (leased, unfinished) = (counted.leased, counted.unfinished);
        peak = peak.max(leased);
        if let Some(margin) =
            crate::demo::metric_sum(a.metrics, pm::LEASE_MARGIN_MIN_SECONDS, "").await
            && leased > 0
            && margin > 0.0
        {
            least_margin = least_margin.min(margin);
        }
        if unfinished == 0 {
            break;
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(300), "slow jobs did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    let statements = beats(a.metrics).await.unwrap_or(0.0) - beats_before;
    // A lease that lapsed under its running job shows as a second generation.
    let expired = sqlx::query_scalar!(
        r#"SELECT count(*) AS "count!" FROM jobs
           WHERE kind = 'summarize-conversation' AND generation > 1"#,
    )
    .fetch_one(&pool)
    .await?;
    rows.push(
        Row::new(format!(
            "slow jobs, {} s handler, {} partitions",
            sizes.slow_ms / 1000,
            config.topics.partitions
        ))
        .rate(slow as f64 / secs)
        .versus(peak as f64, config.processor.max_in_flight as f64, "processor.max_in_flight")
        .note(format!(
            "{peak} jobs in flight at the peak; {slow} jobs in {secs:.1} s; their leases kept by \
             {:.1} heartbeat statements/s (one per beat for all of them, heartbeat {} s, lease \
             TTL {} s), least margin left at a renewal {}, {expired} leased again",
            statements / secs,
            crate::demo::HEARTBEAT.as_secs_f64(),
            crate::demo::LEASE_TTL.as_secs_f64(),
            if least_margin.is_finite() { format!("{least_margin:.2} s") } else { "–".into() },
        )),
    );
    rows.push(
        Row::new(format!("processor RSS, {peak} slow jobs in flight"))
            .versus(slow_rss, 64.0, "64 MiB")
            .note(format!(
                "{slow_rss:.1} MiB at most (VmRSS, sampled every 100 ms while they ran; the \
                 slow jobs are the fresh processor's first work)"
            )),
    );

    // The bursts run in a fresh processor: what the slow jobs' thousand HTTP calls left
    // allocated (glibc keeps what was freed) is measured above, not counted again here.
    let slow_peak = peak_rss_mib(a_pid)?;
    std::process::Command::new("kill").args(["-TERM", &a_pid.to_string()]).status()?;
    a.child.wait().await?;

    // Long remote jobs, all in flight at once in the shipped processor: a handler over
    // HTTP/2 that answered 202 holds each until it calls back.
    let remote_jobs: Vec<NewJob> = (0..sizes.remote_jobs)
        .map(|i| NewJob { kind: crate::remote_bench::KIND.into(), ..job(offset + i) })
        .collect();
    let remote = crate::remote_bench::measure(
        config,
        &pool,
        &acceptor,
        (&bin, &logs),
        offset,
        remote_jobs,
        sizes.remote_hold,
    )
    .await?;
    offset += remote.jobs;
    rows.push(
        Row::new(format!(
            "remote jobs in flight, {} held over HTTP/2 (202, callbacks)",
            remote.jobs
        ))
        .rate(remote.completions_per_sec)
        .note(remote.note()),
    );
    rows.push(
        Row::new(format!("processor RSS, {} remote jobs in flight", remote.jobs))
            .versus(remote.rss_mib, 128.0, "128 MiB")
            .note(remote.rss_note()),
    );
    let stopped = Instant::now();
    let (a, a_pid) = examples(config, &bin, "processor-a2", &logs, &args).await?;
    // Its partitions assigned before the burst starts.
    while crate::demo::metric_sum(a.metrics, pm::ASSIGNED_PARTITIONS, "").await.unwrap_or(0.0)
        < config.topics.partitions as f64
    {
        anyhow::ensure!(stopped.elapsed() < Duration::from_secs(60), "no partitions assigned");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Throughput: a burst of trivial jobs (what the peers' benchmarks run), accepted in
    // batches, until every job succeeded.
    let relay_pid = relay.child.id().context("the relay's pid")?;
    let requests = Upstream::new(config).await?;
    let run = Runner {
        acceptor: &acceptor,
        pool: &pool,
        sizes,
        relay_pid,
        processor: &a,
        requests: &requests,
    };
    let trivial_job = |i| NewJob { kind: TRIVIAL_KIND.into(), ..job(i) };
    let trivial = run.burst(offset, Door::InProcess, &trivial_job).await?;
    offset += sizes.e2e_jobs;
    let burst_rate = trivial.rate;
    rows.push(trivial.row(
        "end to end, trivial handler, burst",
        &format!("noop: does nothing, accepted in-process in batches of {}", sizes.batch),
        limits,
    ));
    let rss = peak_rss_mib(a_pid)?;
    rows.push(
        Row::new(format!("processor peak RSS, {}-job trivial burst", sizes.e2e_jobs))
            .versus(rss, 64.0, "64 MiB")
            .note(format!(
                "{rss:.1} MiB (VmHWM) at the burst's end; {} slots (processor.max_in_flight)",
                config.processor.max_in_flight
            )),
    );
    // The same burst through the doors upstream services use.
    for (door, name, how) in [
        (Door::Intake, "through the intake topic", "Avro JobRequests produced at once"),
        (
            Door::Http { clients: 24 },
            "over HTTP, 24 clients",
            "POST /v1/jobs, 24 keep-alive clients",
        ),
        (
            Door::HttpBatch { size: 1000, clients: 2 },
            "over HTTP in batches of 1,000",
            "POST /v1/jobs/batch, 1,000 jobs each, 2 clients",
        ),
    ] {
        let burst = run.burst(offset, door, &trivial_job).await?;
        offset += sizes.e2e_jobs;
        rows.push(burst.accept_row(&format!("accept {name}"), how, limits));
        rows.push(
            burst
                .row(&format!("end to end, trivial handler, burst {name}"), "noop", limits)
                .versus(burst.rate, burst_rate, "the in-process burst"),
        );
        if let Door::Http { .. } = door {
            // The same requests one by one at half that rate, each timed from when it was
            // due (open loop), with the processor running them.
            let half = (burst.accept_rate / 2.0).max(10.0);
            let url = format!("http://127.0.0.1:{}/v1/jobs", a.http);
            let (h, sent) = paced_http(&url, offset, half, sizes.steady_secs, &trivial_job).await?;
            offset += sent;
            wait_finished(&pool, offset, Duration::from_secs(300)).await?;
            rows.push(
                Row::new(format!("accept over HTTP, half that rate ({half:.0} jobs/s)"))
                    .rate(half)
                    .latency(&h)
                    .note(format!("{sent} POST /v1/jobs arriving one by one, timed from when due")),
            );
        }
    }
    let rss = peak_rss_mib(a_pid)?;
    rows.push(
        Row::new("processor peak RSS, after the doors' bursts").versus(rss, 64.0, "64 MiB").note(
            format!(
                "{rss:.1} MiB (VmHWM) once the same processor also took {} jobs each through \
                 the intake topic, HTTP and the batch endpoint",
                sizes.e2e_jobs
            ),
        ),
    );

    // Latency: a steady load at half the burst rate.
    let steady_rate = (burst_rate / 2.0).max(10.0);
    let since = sqlx::query_scalar!(r#"SELECT now() AS "now!""#).fetch_one(&pool).await?;
    let steady =
        paced(&acceptor, &pool, offset, steady_rate, sizes.steady_secs, &trivial_job).await?;
    offset += steady;
    wait_finished(&pool, offset, Duration::from_secs(300)).await?;
    let latencies = sqlx::query_scalar!(
        r#"SELECT EXTRACT(EPOCH FROM finished_at - accepted_at)::float8 * 1e6 AS "micros!"
           FROM jobs WHERE accepted_at >= date_trunc('milliseconds', $1::timestamptz)"#,
        since,
    )
    .fetch_all(&pool)
    .await?;
    let h = histogram_of(latencies.iter().map(|l| *l as u64))?;
    rows.push(
        Row::new(format!("end to end, steady {steady_rate:.0} jobs/s"))
            .latency(&h)
            .note(format!("accept -> succeeded, {} jobs", latencies.len())),
    );

    // The same burst of index-document jobs: a handler with a business write of its own
    // (one upsert a job in the completion transaction) and a result of a few hundred bytes.
    let indexing = run.burst(offset, Door::InProcess, &job).await?;
    offset += sizes.e2e_jobs;
    rows.push(indexing.row(
        "end to end, index-document burst",
        "index-document: tokenizes and upserts its document's index",
        limits,
    ));

    let rss = peak_rss_mib(a_pid)?;
    rows.push(Row::new("processor peak RSS").versus(rss, 64.0, "64 MiB").note(format!(
        "{rss:.1} MiB (VmHWM) after the {n}-job bursts and the steady run, in a processor \
         started for them; the one that ran the slow jobs first peaked at {slow_peak:.1} MiB",
        n = sizes.e2e_jobs,
    )));
    let rss = peak_rss_mib(relay_pid)?;
    rows.push(
        Row::new("relay peak RSS, end to end").versus(rss, 64.0, "64 MiB").note(format!(
            "{rss:.1} MiB (VmHWM) after the slow jobs, the bursts and the steady run"
        )),
    );

    // Recovery: kill -9 one of two processors while both run jobs.
    let (mut b, b_pid) = examples(config, &bin, "processor-b", &logs, &args).await?;
    let recovery_job = |i: usize| NewJob {
        kind: "summarize-conversation".into(),
        input: conversation("recovery"),
        ..job(offset + i)
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    let owner = format!("%/{b_pid}");
    // Until the group gave b partitions, everything goes to a: submit in rounds.
    let mut submitted = 0;
    let victims: Vec<uuid::Uuid> = loop {
        let jobs: Vec<NewJob> = (submitted..submitted + 20).map(recovery_job).collect();
        acceptor.accept_batch(&pool, &jobs).await?;
        submitted += jobs.len();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let held = sqlx::query_scalar!(
            "SELECT job_id FROM jobs WHERE state = 'leased' AND lease_owner LIKE $1",
            &owner,
        )
        .fetch_all(&pool)
        .await?;
        if held.len() >= 5 {
            break held;
        }
        anyhow::ensure!(Instant::now() < deadline, "processor-b never leased a job");
    };
    offset += submitted;
    let killed = Instant::now();
    std::process::Command::new("kill").args(["-KILL", &b_pid.to_string()]).status()?;
    b.child.wait().await?;
    loop {
        let left = sqlx::query_scalar!(
            r#"SELECT count(*) AS "count!" FROM jobs WHERE job_id = ANY($1) AND state <> 'succeeded'"#,
            &victims,
        )
        .fetch_one(&pool)
        .await?;
        if left == 0 {
            break;
        }
        anyhow::ensure!(killed.elapsed() < Duration::from_secs(300), "the survivor did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let recovery = killed.elapsed().as_secs_f64();
    let bound = crate::demo::LEASE_TTL.as_secs_f64() + 6.0 + 5.0;
    rows.push(
        Row::new("recovery after kill -9 of 1 of 2 processors")
            .versus(recovery, bound, "lease TTL + session timeout + 5 s")
            .note(format!(
                "{recovery:.1} s until the survivor finished the {} jobs the dead one held \
                 (lease TTL {} s, session timeout 6 s, 3 s handler)",
                victims.len(),
                crate::demo::LEASE_TTL.as_secs()
            )),
    );
    wait_finished(&pool, offset, Duration::from_secs(300)).await?;

    // A deploy: both of two processors stopped gracefully in turn (SIGTERM) and replaced,
    // under a steady load of trivial jobs with 3-second conversation jobs among them.
    let (b, _) = examples(config, &bin, "processor-b2", &logs, &args).await?;
    tokio::time::sleep(Duration::from_secs(5)).await; // the group settles on two members
    let mixed = |i: usize| {
        if i.is_multiple_of(40) {
            NewJob {
                kind: "summarize-conversation".into(),
                input: conversation("deploy"),
                ..job(i)
            }
        } else {
            NewJob { kind: TRIVIAL_KIND.into(), ..job(i) }
        }
    };
    // A baseline first, then the deploy, the load running on through it.
    let baseline = sizes.steady_secs.clamp(2, 8);
    let (rate, secs) = (200.0, baseline + 20);
    let since = sqlx::query_scalar!(r#"SELECT now() AS "now!""#).fetch_one(&pool).await?;
    let deploy = async {
        tokio::time::sleep(Duration::from_secs(baseline)).await;
        let from = sqlx::query_scalar!(r#"SELECT now() AS "now!""#).fetch_one(&pool).await?;
        let mut replaced = Vec::new();
        for (old, name) in [(a, "processor-a3"), (b, "processor-b3")] {
            graceful_stop(old).await?;
            replaced.push(examples(config, &bin, name, &logs, &args).await?.0);
        }
        let to = sqlx::query_scalar!(r#"SELECT now() AS "now!""#).fetch_one(&pool).await?;
        anyhow::Ok((from, to, replaced))
    };
    let (sent, deployed) =
        tokio::join!(paced(&acceptor, &pool, offset, rate, secs, &mixed), deploy);
    let ((from, to, replaced), sent) = (deployed?, sent?);
    offset += sent;
    wait_finished(&pool, offset, Duration::from_secs(300)).await?;
    // Trivial jobs' accept -> end: before the deploy, and accepted while it ran.
    let spans = sqlx::query!(
        r#"SELECT accepted_at < $2 AS "before!",
                  EXTRACT(EPOCH FROM finished_at - accepted_at)::float8 * 1e6 AS "micros!"
           FROM jobs WHERE kind = $4 AND accepted_at >= date_trunc('milliseconds', $1::timestamptz)
             AND accepted_at < $3"#,
        since,
        from,
        to,
        TRIVIAL_KIND,
    )
    .fetch_all(&pool)
    .await?;
    let before = histogram_of(spans.iter().filter(|s| s.before).map(|s| s.micros as u64))?;
    let during = histogram_of(spans.iter().filter(|s| !s.before).map(|s| s.micros as u64))?;
    let released = sqlx::query_scalar!(
        r#"SELECT count(*) AS "count!" FROM jobs
           WHERE accepted_at >= $1 AND last_error LIKE 'released:%'"#,
        since,
    )
    .fetch_one(&pool)
    .await?;
    let added = (ms(&during, 0.99) - ms(&before, 0.99)).max(0.0) / 1e3;
    rows.push(
        Row::new("rolling restart of 2 of 2 processors (SIGTERM each, replaced)")
            .latency(&during)
            .versus(added, 1.0, "1 s added at p99")
            .note(format!(
                "{rate:.0} jobs/s for {secs} s, one in 40 a 3 s conversation job; trivial jobs \
                 accepted during the {:.1} s deploy: p99 {:.0} ms, longest {:.0} ms, against \
                 p99 {:.0} ms before it (added {added:.2} s); {} jobs given back at a stop",
                (to - from).as_seconds_f64(),
                ms(&during, 0.99),
                during.max() as f64 / 1e3,
                ms(&before, 0.99),
                released,
            )),
    );

    for mut process in replaced {
        process.child.start_kill()?;
        process.child.wait().await?;
    }
    relay.child.start_kill()?;
    relay.child.wait().await?;
    pool.close().await;
    Ok(())
}

/// Starts `jobfold-examples` (beside this binary in `bin`) as `name`, logging to `logs`, and
/// waits until it is ready; the process and its pid.
/// Sends a processor SIGTERM and waits for it to exit (its graceful stop, bounded by its
/// `processor.shutdown_timeout`).
async fn graceful_stop(mut process: crate::demo::Process) -> anyhow::Result<()> {
    let pid = process.child.id().context("the processor's pid")?;
    std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
    let status = tokio::time::timeout(Duration::from_secs(120), process.child.wait())
        .await
        .context("the processor did not stop")??;
    anyhow::ensure!(status.success(), "the processor stopped with {status}");
    Ok(())
}

pub(crate) async fn examples(
    config: &Config,
    bin: &std::path::Path,
    name: &'static str,
    logs: &std::path::Path,
    args: &[String],
) -> anyhow::Result<(crate::demo::Process, u32)> {
    let process = crate::demo::spawn(config, &bin.join("jobfold-examples"), name, logs, args)?;
    crate::demo::wait_ready(process.http).await?;
    let pid = process.child.id().context("the processor's pid")?;
    Ok((process, pid))
}

/// What an end-to-end burst runs against: the bench's client, the processing database, the
/// relay and the one processor.
struct Runner<'a> {
    acceptor: &'a Acceptor,
    pool: &'a PgPool,
    sizes: Sizes,
    relay_pid: u32,
    processor: &'a crate::demo::Process,
    /// Writes `JobRequest`s to the intake topic as an upstream producer would.
    requests: &'a Upstream,
}

/// How a burst's jobs come in.
#[derive(Debug, Clone, Copy)]
enum Door {
    /// `Acceptor::accept_batch` in this process, `sizes.batch` jobs a transaction.
    InProcess,
    /// Confluent-framed Avro `JobRequest`s on the intake topic, all serialized before the
    /// clock starts, then produced at once.
    Intake,
    /// `POST /v1/jobs`, one job a request, from this many keep-alive clients.
    Http { clients: usize },
    /// `POST /v1/jobs/batch`, `size` jobs a request, from this many clients.
    HttpBatch { size: usize, clients: usize },
}

/// An upstream service's producer on the intake topic: the registry's framing, idempotent,
/// `acks=all`.
struct Upstream {
    producer: rdkafka::producer::FutureProducer,
    codec: Codec<jobfold_schemas::JobRequest>,
    topic: String,
}

impl Upstream {
    async fn new(config: &Config) -> anyhow::Result<Self> {
        let producer = config
            .kafka_client_for(
                jobfold_common::config::KafkaRole::Producer,
                &[("enable.idempotence", "true"), ("acks", "all"), ("linger.ms", "5")],
            )
            .create()?;
        let codec = Codec::connect(config.registry()?, &config.topics.requests).await?;
        Ok(Self { producer, codec, topic: config.topics.requests.clone() })
    }

    /// The request for `job`, encoded, with its key.
    fn encode(&self, job: &NewJob, i: usize) -> anyhow::Result<(String, Vec<u8>)> {
        let request = jobfold_schemas::JobRequest {
            request_id: uuid::Uuid::now_v7(),
            document_id: job.document_id.clone(),
            job_kind: job.kind.clone(),
            input_version: job.input_version,
            input: job.input.to_string(),
            requested_at: chrono::Utc::now(),
            producer: format!("jobfold bench/{i}"),
            trace: None,
            run_at: None,
        };
        Ok((job.document_id.clone(), self.codec.encode(&request)?))
    }

    /// Produces every request and waits for each delivery report.
    async fn produce(&self, requests: &[(String, Vec<u8>)]) -> anyhow::Result<()> {
        let sends = requests.iter().map(|(key, value)| {
            self.producer.send(
                rdkafka::producer::FutureRecord::to(&self.topic).key(key).payload(value),
                rdkafka::util::Timeout::Never,
            )
        });
        for delivered in futures::future::join_all(sends).await {
            delivered.map_err(|(e, _)| e)?;
        }
        Ok(())
    }
}

/// One burst's figures.
struct Burst {
    jobs: usize,
    rate: f64,
    /// Jobs a second from the first submit until the last was accepted.
    accept_rate: f64,
    /// Each request's time to its answer (the HTTP doors).
    latency: Option<Histogram<u64>>,
    /// Accept transactions per job.
    accept_commits: f64,
    /// CPU per job by component, and how long the machine took to be idle first.
    cpu: String,
    /// Per job: rows written, events logged (each a Kafka message), lease and completion
    /// commits.
    writes: f64,
    messages: f64,
    commits: f64,
}

impl Runner<'_> {
    /// Submits `sizes.e2e_jobs` jobs made by `make` (from `offset`, the jobs accepted so far,
    /// every one of them finished) through `door`, and waits until all succeeded: the end
    /// read from the processor's counter, so that waiting loads neither Postgres nor the
    /// processor's hot path. When the last was accepted is read from the processor's accept
    /// counter (its API and intake accept; the in-process door's end is its last commit).
    /// Its costs per job are read over the burst alone.
    async fn burst(
        &self,
        offset: usize,
        door: Door,
        make: &(dyn Fn(usize) -> NewJob + Sync),
    ) -> anyhow::Result<Burst> {
        let jobs = self.sizes.e2e_jobs;
        let made: Vec<NewJob> = (offset..offset + jobs).map(make).collect();
        // What an outside client sends, made before the clock starts.
        let requests = match door {
            Door::Intake => made
                .iter()
                .zip(offset..)
                .map(|(job, i)| self.requests.encode(job, i))
                .collect::<anyhow::Result<Vec<_>>>()?,
            _ => Vec::new(),
        };
        let bodies: Vec<(String, Vec<u8>)> = match door {
            Door::Http { .. } => made
                .iter()
                .map(|job| Ok((job.idempotency_key.clone().unwrap_or_default(), http_body(job)?)))
                .collect::<anyhow::Result<_>>()?,
            Door::HttpBatch { size, .. } => made
                .chunks(size)
                .map(|chunk| {
                    let jobs: Vec<serde_json::Value> = chunk
                        .iter()
                        .map(|job| {
                            let mut body =
                                serde_json::from_slice::<serde_json::Value>(&http_body(job)?)?;
                            body["idempotency_key"] = json!(job.idempotency_key);
                            Ok(body)
                        })
                        .collect::<anyhow::Result<_>>()?;
                    Ok((String::new(), serde_json::to_vec(&json!({ "jobs": jobs }))?))
                })
                .collect::<anyhow::Result<_>>()?,
            _ => Vec::new(),
        };
        let before = per_job_costs(self.pool).await?;
        let counted = succeeded(self.processor.metrics).await;
        let accepted_before = accepted(self.processor.metrics).await;
        let settled = settle(self.sizes.settle).await;
        let pid = self.processor.child.id().context("the processor's pid")?;
        let cpu = CpuByComponent::now(self.relay_pid, pid);
        let started = Instant::now();
        // When the processor counted the last accept.
        let metrics = self.processor.metrics;
        let all_accepted = tokio::spawn(async move {
            while accepted(metrics).await < accepted_before + jobs {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            started.elapsed()
        });
        let mut latencies = Vec::new();
        let mut accepted_in = None;
        match door {
            Door::InProcess => {
                for chunk in made.chunks(self.sizes.batch) {
                    self.acceptor.accept_batch(self.pool, chunk).await?;
                }
                accepted_in = Some(started.elapsed());
            }
            Door::Intake => self.requests.produce(&requests).await?,
            Door::Http { clients } | Door::HttpBatch { clients, .. } => {
                let path = if matches!(door, Door::Http { .. }) { "jobs" } else { "jobs/batch" };
                let url = format!("http://127.0.0.1:{}/v1/{path}", self.processor.http);
                let client = reqwest::Client::new();
                latencies = futures::stream::iter(bodies)
                    .map(|(key, body)| {
                        let (client, url) = (client.clone(), url.clone());
                        async move {
                            let t = Instant::now();
                            let mut request = client
                                .post(url)
                                .header("content-type", "application/json")
                                .body(body);
                            if !key.is_empty() {
                                request = request.header("idempotency-key", key);
                            }
                            let answer = request.send().await?;
                            let status = answer.status();
                            let text = answer.text().await?;
                            anyhow::ensure!(
                                status.is_success() && !text.contains("\"error\""),
                                "{status}: {text}"
                            );
                            Ok(t.elapsed().as_micros() as u64)
                        }
                    })
                    .buffer_unordered(clients)
                    .collect::<Vec<anyhow::Result<u64>>>()
                    .await
                    .into_iter()
                    .collect::<anyhow::Result<_>>()?;
            }
        }
        wait_succeeded(self.processor.metrics, counted + jobs, Duration::from_secs(900)).await?;
        let rate = jobs as f64 / started.elapsed().as_secs_f64();
        let cpu = cpu.zip(CpuByComponent::now(self.relay_pid, pid));
        let accepted_in = match accepted_in {
            Some(t) => {
                all_accepted.abort();
                t
            }
            None => all_accepted.await?,
        };
        wait_finished(self.pool, offset + jobs, Duration::from_secs(60)).await?;
        let after = per_job_costs(self.pool).await?;
        let mut note = String::new();
        if let Some((before, after)) = cpu {
            note = format!("; CPU per job: {}", before.per_job(&after, jobs as f64));
            if let Some(waited) = settled {
                write!(
                    note,
                    " (started once the machine was idle, after {:.0} s)",
                    waited.as_secs_f64()
                )?;
            }
        }
        let per = |a: f64, b: f64| (b - a) / jobs as f64;
        Ok(Burst {
            jobs,
            rate,
            accept_rate: jobs as f64 / accepted_in.as_secs_f64(),
            latency: if latencies.is_empty() { None } else { Some(histogram_of(latencies)?) },
            cpu: note,
            writes: per(before.0, after.0),
            messages: per(before.1, after.1),
            commits: per(before.2, after.2),
            accept_commits: per(before.3, after.3),
        })
    }
}

/// A job as `POST /v1/jobs` takes it (its key goes in the header).
pub(crate) fn http_body(job: &NewJob) -> anyhow::Result<Vec<u8>> {
    Ok(serde_json::to_vec(&json!({
        "document_id": job.document_id,
        "kind": job.kind,
        "input_version": job.input_version,
        "input": job.input,
    }))?)
}

impl Burst {
    /// The table's row: the rate next to the 16-client commit limit at the commits a job
    /// took, and what a job cost.
    fn row(&self, name: &str, handler: &str, limits: &Limits) -> Row {
        let Self { jobs, rate, writes, messages, commits, accept_commits, .. } = *self;
        // Lease and completion transactions are shared by the jobs waiting at once.
        Row::new(name)
            .rate(rate)
            .versus(
                commits * rate,
                limits.commit_16,
                &format!("16-client commits at {commits:.2} processor commits/job"),
            )
            .note(format!(
                "{jobs} jobs accept -> succeeded, 1 processor, {handler}; per job \
                 {messages:.1} Kafka messages ({:.1}% of the raw producer), {writes:.1} rows \
                 written ({:.1}% of multi-row insert), {accept_commits:.3} accept and \
                 {commits:.2} lease and completion commits{}",
                100.0 * rate * messages / limits.producer,
                100.0 * rate * writes / limits.rows,
                self.cpu,
            ))
    }

    /// The row of its accepts: how fast the door took the jobs in (while they ran).
    fn accept_row(&self, name: &str, how: &str, limits: &Limits) -> Row {
        let mut row = Row::new(name)
            .rate(self.accept_rate)
            .versus(2.0 * self.accept_rate, limits.rows, "multi-row insert (2 rows per job)")
            .note(format!(
                "{} jobs, first submit -> last accepted, {how}, the processor running them \
             meanwhile; {:.3} accept commits/job",
                self.jobs, self.accept_commits
            ));
        if let Some(h) = &self.latency {
            row = row.latency(h);
        }
        row
    }
}

/// Processor `port`'s `jobfold_accepted_total`: jobs its API and intake accepted.
async fn accepted(port: u16) -> usize {
    let done = crate::demo::metric_sum(port, jobfold_common::metrics::ACCEPTED_TOTAL, "").await;
    done.unwrap_or(0.0) as usize
}

/// Waits until the machine is idle — less than a tenth of its cores busy over a second —
/// so that what an earlier measurement left (the broker deleting the topics it dropped) does
/// not land in the next; how long it took, or `None` if it was not idle within `at_most` or
/// `/proc` cannot be read.
async fn settle(at_most: Duration) -> Option<Duration> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    let started = Instant::now();
    while started.elapsed() < at_most {
        let before = CpuTime::now(&[])?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = CpuTime::now(&[])?;
        if after.machine - before.machine < 0.1 * cores {
            return Some(started.elapsed());
        }
    }
    None
}

/// Processor `port`'s `jobfold_completed_total{outcome="succeeded"}`: jobs it saw succeed.
async fn succeeded(port: u16) -> usize {
    let done =
        crate::demo::metric_sum(port, jobfold_processor::metrics::COMPLETED_TOTAL, "\"succeeded\"")
            .await;
    done.unwrap_or(0.0) as usize
}

/// Waits until processor `port` saw `count` jobs succeed, looking every 50 ms.
async fn wait_succeeded(port: u16, count: usize, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let done = succeeded(port).await;
        if done >= count {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "jobs did not succeed: {done} of {count}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Rows written (inserted, updated, deleted) in this database, events logged, the
/// transactions that leased or completed jobs, and those that accepted them. Postgres
/// reports row counts a little after the fact: read until they stop changing.
async fn per_job_costs(pool: &PgPool) -> anyhow::Result<(f64, f64, f64, f64)> {
    let read = || async {
        let r = sqlx::query!(
            r#"SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::float8 AS "rows!",
                      (SELECT count(*) FROM job_events)::float8 AS "events!",
                      (SELECT count(DISTINCT xid) FROM job_events
                       WHERE kind IN ('JobLeased', 'JobSucceeded', 'JobFailed'))::float8
                          AS "commits!",
                      (SELECT count(DISTINCT xid) FROM job_events
                       WHERE kind = 'JobRequested')::float8 AS "accepts!"
               FROM pg_stat_user_tables"#,
        )
        .fetch_one(pool)
        .await?;
        Ok::<_, sqlx::Error>((r.rows, r.events, r.commits, r.accepts))
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = read().await?;
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = read().await?;
        if now == last || Instant::now() > deadline {
            return Ok(now);
        }
        last = now;
    }
}

/// Events/s of the relay's log query alone, from `from` to the end of the log.
async fn log_read(config: &Config, pool: &PgPool, from: (i64, i64)) -> anyhow::Result<f64> {
    let mut conn = pool.acquire().await?;
    let mut after = jobfold_relay::log::Position { xid: from.0, seq: from.1 };
    let (mut read, started) = (0usize, Instant::now());
    loop {
        let batch = jobfold_relay::log::claim(&mut conn, after, config.relay.batch_size).await?;
        // Decoded as the relay decodes them.
        let positions = batch.positions()?;
        let Some(last) = positions.last() else { break };
        after = *last;
        read += batch.events(&config.topics.events)?.len();
    }
    Ok(read as f64 / started.elapsed().as_secs_f64())
}

/// Copies the accepted events (each a job's first) as later events of the same jobs until
/// the log holds at least `events`: rows of the same size and keys for the relay to drain.
async fn copy_backlog(pool: &PgPool, events: usize) -> anyhow::Result<()> {
    let accepted = sqlx::query_scalar!(r#"SELECT count(*) AS "count!" FROM job_events"#)
        .fetch_one(pool)
        .await?;
    let copies = (events as u64).div_ceil(accepted.max(1) as u64).saturating_sub(1);
    sqlx::query!(
        "INSERT INTO job_events (event_id, job_id, stream_version, kind, body, key) \
         SELECT gen_random_uuid(), job_id, stream_version + copy, kind, body, key \
         FROM job_events, generate_series(1, $1) AS copy WHERE stream_version = 1",
        i32::try_from(copies)?,
    )
    .execute(pool)
    .await?;
    sqlx::query!("ANALYZE job_events").execute(pool).await?;
    Ok(())
}

/// Where the relay's cursor stands.
async fn cursor(pool: &PgPool) -> anyhow::Result<(i64, i64)> {
    let position = jobfold_relay::log::cursor(&mut *pool.acquire().await?).await?;
    Ok((position.xid, position.seq))
}

/// Waits until the relay owes nothing; polls cheaply (two index probes), so as not to slow
/// down what it measures.
async fn wait_drained(pool: &PgPool, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut conn = pool.acquire().await?;
        let owed = jobfold_relay::log::past_cursor(&mut conn).await?
            || sqlx::query_scalar!(
                r#"SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL) AS "owed!""#
            )
            .fetch_one(&mut *conn)
            .await?;
        drop(conn);
        if !owed {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the relay did not drain the log");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `clients` accepting batches back to back for `secs`; returns how many jobs they accepted.
async fn saturate(
    acceptor: &Acceptor,
    pool: &PgPool,
    offset: usize,
    clients: usize,
    batch: usize,
    secs: u64,
) -> anyhow::Result<usize> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = Arc::new(AtomicUsize::new(0));
    let until = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (acceptor, pool, next) = (acceptor.clone(), pool.clone(), Arc::clone(&next));
            tokio::spawn(async move {
                while Instant::now() < until {
                    let first = next.fetch_add(batch, Ordering::Relaxed);
                    let jobs: Vec<NewJob> =
                        (first..first + batch).map(|i| job(offset + i)).collect();
                    acceptor.accept_batch(&pool, &jobs).await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(next.load(Ordering::Relaxed))
}

/// Accepts `rate` jobs per second for `secs` (job `i` is `make(offset + i)`), in small
/// batches every 10 ms (single accepts when the rate is low); returns how many.
pub(crate) async fn paced(
    acceptor: &Acceptor,
    pool: &PgPool,
    offset: usize,
    rate: f64,
    secs: u64,
    make: &(dyn Fn(usize) -> NewJob + Sync),
) -> anyhow::Result<usize> {
    let tick = Duration::from_millis(10);
    let per_tick = rate * tick.as_secs_f64();
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let (mut owed, mut sent) = (0.0, 0usize);
    let mut tasks = tokio::task::JoinSet::new();
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        ticker.tick().await;
        owed += per_tick;
        let n = owed.floor() as usize;
        if n == 0 {
            continue;
        }
        owed -= n as f64;
        let jobs: Vec<NewJob> = (sent..sent + n).map(|i| make(offset + i)).collect();
        sent += n;
        // Those done are let go as it goes: a long run holds only what is still running.
        while let Some(done) = tasks.try_join_next() {
            done??;
        }
        let (acceptor, pool) = (acceptor.clone(), pool.clone());
        tasks.spawn(async move {
            if let [one] = jobs.as_slice() {
                acceptor.accept(&pool, one).await.map(|_| ())
            } else {
                acceptor.accept_batch(&pool, &jobs).await.map(|_| ())
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(sent)
}

/// Single accepts (one transaction each) arriving at `rate` a second for `secs`, each
/// started when due however many are still running; returns their latencies, timed from
/// when each was due, and how many there were.
async fn paced_singles(
    acceptor: &Acceptor,
    pool: &PgPool,
    offset: usize,
    rate: f64,
    secs: u64,
) -> anyhow::Result<(Histogram<u64>, usize)> {
    let started = tokio::time::Instant::now();
    let count = (rate * secs as f64) as usize;
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        let due = started + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due).await;
        let (acceptor, pool, job) = (acceptor.clone(), pool.clone(), job(offset + i));
        tasks.push(tokio::spawn(async move {
            acceptor.accept(&pool, &job).await.map(|_| due.elapsed().as_micros() as u64)
        }));
    }
    let mut latencies = Vec::with_capacity(count);
    for task in tasks {
        latencies.push(task.await??);
    }
    Ok((histogram_of(latencies)?, count))
}

/// `POST /v1/jobs` requests (one job each, made by `make`) arriving at `rate` a second for
/// `secs`, each sent when due however many are still running; their latencies, timed from
/// when each was due, and how many there were.
async fn paced_http(
    url: &str,
    offset: usize,
    rate: f64,
    secs: u64,
    make: &(dyn Fn(usize) -> NewJob + Sync),
) -> anyhow::Result<(Histogram<u64>, usize)> {
    let client = reqwest::Client::new();
    let started = tokio::time::Instant::now();
    let count = (rate * secs as f64) as usize;
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        let due = started + Duration::from_secs_f64(i as f64 / rate);
        let job = make(offset + i);
        let body = http_body(&job)?;
        tokio::time::sleep_until(due).await;
        let request = client
            .post(url)
            .header("content-type", "application/json")
            .header("idempotency-key", job.idempotency_key.unwrap_or_default())
            .body(body);
        tasks.push(tokio::spawn(async move {
            let answer = request.send().await?;
            anyhow::ensure!(answer.status().is_success(), "{}", answer.status());
            Ok(due.elapsed().as_micros() as u64)
        }));
    }
    let mut latencies = Vec::with_capacity(count);
    for task in tasks {
        latencies.push(task.await??);
    }
    Ok((histogram_of(latencies)?, count))
}

/// Commit -> on Kafka for every event on the events topic that occurred at or after
/// `since`: the record's timestamp (set when the relay produced it) minus the event's time
/// (set just before its transaction committed), in microseconds.
async fn topic_latencies(
    config: &Config,
    decoder: &jobfold_schemas::codec::Decoder<JobEvent>,
    since: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<Histogram<u64>> {
    use rdkafka::Message as _;
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let consumer: BaseConsumer = config
        .kafka_client_with(&[("group.id", "jobfold-bench-reader"), ("enable.auto.commit", "false")])
        .create()?;
    let topic = &config.topics.events;
    // From the first record stamped a second before `since`, to the end as it is now.
    let mut wanted = rdkafka::TopicPartitionList::new();
    for p in 0..config.topics.partitions {
        wanted.add_partition_offset(
            topic,
            p,
            rdkafka::Offset::Offset(since.timestamp_millis() - 1000),
        )?;
    }
    let starts = consumer.offsets_for_times(wanted, Duration::from_secs(10))?;
    let mut assignment = rdkafka::TopicPartitionList::new();
    let mut ends = std::collections::HashMap::new();
    let mut remaining = 0i64;
    for p in 0..config.topics.partitions {
        let (_, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10))?;
        let from = match starts.find_partition(topic, p).map(|e| e.offset()) {
            Some(rdkafka::Offset::Offset(o)) => o,
            _ => high,
        };
        remaining += high - from;
        ends.insert(p, high);
        assignment.add_partition_offset(topic, p, rdkafka::Offset::Offset(from))?;
    }
    consumer.assign(&assignment)?;
    let mut h = latency_histogram();
    let deadline = Instant::now() + Duration::from_secs(120);
    while remaining > 0 {
        anyhow::ensure!(Instant::now() < deadline, "could not read the events topic back");
        let Some(message) = consumer.poll(Duration::from_millis(100)) else { continue };
        let message = message?;
        if message.offset() >= ends[&message.partition()] {
            continue;
        }
        remaining -= 1;
        let (Some(body), Some(at)) = (message.payload(), message.timestamp().to_millis()) else {
            continue;
        };
        let event = decoder.decode(body).await?;
        if event.occurred_at >= since {
            h.record(((at - event.occurred_at.timestamp_millis()).max(0) * 1000).max(1) as u64)?;
        }
    }
    Ok(h)
}

/// CPU seconds used so far, from `/proc` (Linux; `None` elsewhere): by the whole machine
/// (all cores, busy time) and by each of `pids`.
#[derive(Debug, Clone)]
struct CpuTime {
    machine: f64,
    processes: Vec<f64>,
}

/// Clock ticks per second in `/proc`: `USER_HZ`, 100 on every Linux architecture that matters.
const USER_HZ: f64 = 100.0;

impl CpuTime {
    fn now(pids: &[u32]) -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let ticks: Vec<f64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .filter_map(|t| t.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal …: busy is all but idle and iowait.
        let busy = ticks.iter().take(8).sum::<f64>() - ticks.get(3)? - ticks.get(4)?;
        let processes = pids.iter().map(|pid| process_cpu(*pid)).collect::<Option<Vec<f64>>>()?;
        Some(CpuTime { machine: busy / USER_HZ, processes })
    }

    /// Microseconds of CPU per item since `self`: the machine's, then each process's.
    fn per_item_since(&self, later: &CpuTime, items: f64) -> (f64, Vec<f64>) {
        let per = |a: f64, b: f64| (b - a) * 1e6 / items.max(1.0);
        let processes = self.processes.iter().zip(&later.processes).map(|(a, b)| per(*a, *b));
        (per(self.machine, later.machine), processes.collect())
    }
}

/// CPU seconds process `pid` used so far (user and system), from `/proc`.
fn process_cpu(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): utime is the 12th.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let (user, system): (f64, f64) = (fields.get(11)?.parse().ok()?, fields.get(12)?.parse().ok()?);
    Some((user + system) / USER_HZ)
}

/// CPU seconds used so far on this machine, by component: every Postgres process (backends,
/// WAL writer, checkpointer), the Kafka broker, the relay, the processor and this command; the
/// rest of the machine's busy time is "other".
#[derive(Debug, Clone)]
struct CpuByComponent {
    machine: f64,
    components: std::collections::BTreeMap<&'static str, f64>,
}

impl CpuByComponent {
    fn now(relay: u32, processor: u32) -> Option<Self> {
        let machine = CpuTime::now(&[])?.machine;
        let own = std::process::id();
        let mut components = std::collections::BTreeMap::new();
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let component = if pid == relay {
                "relay"
            } else if pid == processor {
                "processor"
            } else if pid == own {
                "bench client"
            } else {
                let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
                let cmdline = String::from_utf8_lossy(&cmdline);
                if cmdline.starts_with("postgres") || cmdline.contains("bin/postgres") {
                    "Postgres"
                } else if cmdline.contains("kafka.Kafka") {
                    "Kafka"
                } else {
                    continue;
                }
            };
            if let Some(cpu) = process_cpu(pid) {
                *components.entry(component).or_default() += cpu;
            }
        }
        Some(Self { machine, components })
    }

    /// Microseconds of CPU per job since `self`, the machine's then each component's, e.g.
    /// "738 µs on the machine (Postgres 462, processor 143, ...)". A process that ended in
    /// between (a Postgres backend) leaves its time to "other".
    fn per_job(&self, later: &Self, jobs: f64) -> String {
        let per = |a: f64, b: f64| (b - a).max(0.0) * 1e6 / jobs.max(1.0);
        let mut parts: Vec<(f64, &str)> = later
            .components
            .iter()
            .map(|(name, b)| (per(self.components.get(name).copied().unwrap_or(0.0), *b), *name))
            .collect();
        let machine = per(self.machine, later.machine);
        let known: f64 = parts.iter().map(|(us, _)| us).sum();
        parts.sort_by(|a, b| b.0.total_cmp(&a.0));
        parts.push(((machine - known).max(0.0), "other"));
        let parts: Vec<String> = parts.iter().map(|(us, name)| format!("{name} {us:.0}")).collect();
        format!("{machine:.0} µs on the machine ({})", parts.join(", "))
    }
}

/// The Postgres backends serving `application` — on this machine, so their CPU can be read
/// from `/proc`; empty if the database runs elsewhere.
async fn local_backends(pool: &PgPool, application: &str) -> anyhow::Result<Vec<u32>> {
    let pids = sqlx::query_scalar!(
        "SELECT pid FROM pg_stat_activity \
         WHERE application_name = $1 AND datname = current_database()",
        application
    )
    .fetch_all(pool)
    .await?;
    Ok(pids
        .into_iter()
        .flatten()
        .filter_map(|pid| u32::try_from(pid).ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).starts_with("postgres"))
        })
        .collect())
}

/// Single-row insert transactions per second, `clients` at once, `total` in all.
async fn pg_commits(
    pool: &PgPool,
    clients: usize,
    total: usize,
    size: usize,
) -> anyhow::Result<f64> {
    let value = vec![7u8; size];
    let started = Instant::now();
    futures::stream::iter(0..total)
        .map(|_| {
            let (pool, value) = (pool.clone(), value.clone());
            async move {
                sqlx::query!("INSERT INTO bench_commits (v) VALUES ($1)", &value[..])
                    .execute(&pool)
                    .await
            }
        })
        .buffer_unordered(clients)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

/// Rows per second inserted `batch` at a time with one multi-row statement each.
async fn pg_rows(pool: &PgPool, total: usize, batch: usize, size: usize) -> anyhow::Result<f64> {
    let values: Vec<Vec<u8>> = vec![vec![7u8; size]; batch];
    let statements = total.div_ceil(batch);
    let started = Instant::now();
    for _ in 0..statements {
        sqlx::query!("INSERT INTO bench_rows (v) SELECT * FROM unnest($1::bytea[])", &values)
            .execute(pool)
            .await?;
    }
    Ok((statements * batch) as f64 / started.elapsed().as_secs_f64())
}

/// Messages per second a consumer reads `count` messages back from `topic`, assigned every
/// partition from the beginning (no group join).
async fn raw_consumer(config: &Config, topic: &str, count: usize) -> anyhow::Result<f64> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let consumer: BaseConsumer = config
        .kafka_client_with(&[("group.id", "jobfold-bench-raw"), ("enable.auto.commit", "false")])
        .create()?;
    let mut assignment = rdkafka::TopicPartitionList::new();
    for p in 0..config.topics.partitions {
        assignment.add_partition_offset(topic, p, rdkafka::Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let mut seen = 0usize;
    let mut started = None;
    let deadline = Instant::now() + Duration::from_secs(300);
    while seen < count {
        anyhow::ensure!(Instant::now() < deadline, "read {seen} of {count} messages back");
        if let Some(message) = consumer.poll(Duration::from_millis(100)) {
            message?;
            started.get_or_insert_with(Instant::now);
            seen += 1;
        }
    }
    Ok(seen as f64 / started.map_or(1.0, |s| s.elapsed().as_secs_f64()))
}

/// The event codec for `config`'s events topic, registered with its registry.
pub(crate) async fn event_codec(config: &Config) -> anyhow::Result<Codec<JobEvent>> {
    Ok(Codec::<JobEvent>::connect(config.registry()?, &config.topics.events).await?)
}

/// A `JobRequested` event like the ones accept writes, for the raw producer.
fn sample_event(i: usize) -> JobEvent {
    let job = job(i);
    JobEvent {
        event_id: uuid::Uuid::now_v7(),
        job_id: uuid::Uuid::now_v7(),
        document_id: job.document_id,
        job_kind: job.kind,
        input_version: job.input_version,
        stream_version: 1,
        occurred_at: chrono::Utc::now(),
        trace: None,
        producer: "bench".into(),
        payload: jobfold_schemas::Payload::JobRequested(jobfold_schemas::event::JobRequested {
            input: job.input.to_string(),
            idempotency_key: job.idempotency_key,
            max_attempts: 5,
            deadline: None,
            run_at: None,
        }),
    }
}

/// Messages per second a producer with the relay's settings delivers to a topic of the
/// same partitions, keyed like the relay's, with `bodies` as values.
/// The producer's rate, and the CPU per message it took: the machine's and this process's
/// (µs), if `/proc` tells.
async fn raw_producer(
    config: &Config,
    bodies: &[Vec<u8>],
) -> anyhow::Result<(f64, Option<(f64, f64)>)> {
    use jobfold_relay::publish::{self, Event};
    fn event<'a>(i: usize, topic: &'a str, keys: &'a [String], body: &'a [u8]) -> Event<'a> {
        let (traceparent, tracestate) = (None, None);
        let key = &keys[i % keys.len()];
        Event {
            seq: i as i64,
            topic,
            key,
            body,
            available_at: chrono::Utc::now(),
            traceparent,
            tracestate,
            kind: "JobRequested",
        }
    }
    let producer = publish::producer(config)?;
    let topic = &config.topics.requests;
    let keys: Vec<String> = (0..1000).map(|i| format!("doc-{i}")).collect();
    // Warm up (metadata, connections, producer id) before timing, as the relay is.
    let warm_up = [event(0, topic, &keys, &[0u8])];
    let outcome = publish::send(&producer, &warm_up, &mut publish::Blocked::default(), usize::MAX)
        .await
        .delivered(&producer)
        .await;
    if let Some((_, e)) = outcome.failed.into_iter().next() {
        return Err(e.into());
    }
    let events: Vec<Event<'_>> =
        bodies.iter().enumerate().map(|(i, body)| event(i, topic, &keys, body)).collect();
    let (started, cpu) = (Instant::now(), CpuTime::now(&[std::process::id()]));
    let outcome = publish::send(&producer, &events, &mut publish::Blocked::default(), usize::MAX)
        .await
        .delivered(&producer)
        .await;
    if let Some((_, e)) = outcome.failed.into_iter().next() {
        return Err(e.into());
    }
    let rate = bodies.len() as f64 / started.elapsed().as_secs_f64();
    let cpu = cpu.zip(CpuTime::now(&[std::process::id()])).map(|(before, after)| {
        let (machine, own) = before.per_item_since(&after, bodies.len() as f64);
        (machine, own[0])
    });
    Ok((rate, cpu))
}
