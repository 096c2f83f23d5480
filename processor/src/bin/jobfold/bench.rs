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
use jobfold_schemas::codec::registry_settings;
use jobfold_schemas::{Codec, JobEvent};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// How long to measure.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub(crate) raw_messages: usize,
    pub(crate) single_accepts: usize,
    pub(crate) concurrent_accepts: usize,
    pub(crate) batched_accepts: usize,
    pub(crate) batch: usize,
    pub(crate) steady_rate: u32,
    pub(crate) steady_secs: u64,
    pub(crate) e2e_jobs: usize,
}

impl Sizes {
    pub(crate) fn quick() -> Self {
        Self {
            raw_messages: 200_000,
            single_accepts: 2_000,
            concurrent_accepts: 10_000,
            batched_accepts: 50_000,
            batch: 100,
            steady_rate: 1_000,
            steady_secs: 5,
            e2e_jobs: 5_000,
        }
    }

    pub(crate) fn full() -> Self {
        Self {
            raw_messages: 2_000_000,
            single_accepts: 10_000,
            concurrent_accepts: 50_000,
            batched_accepts: 1_000_000,
            batch: 100,
            steady_rate: 2_000,
            steady_secs: 30,
            e2e_jobs: 50_000,
        }
    }
}

/// One row of the results table.
struct Row {
    what: String,
    rate: Option<f64>,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    note: String,
}

fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

fn job(i: usize) -> NewJob {
    NewJob {
        document_id: format!("doc-{i}"),
        kind: "index-document".into(),
        input_version: 1 + (i / 1000) as i64,
        input: json!({ "text": "the quick brown fox jumps over the lazy dog" }),
        idempotency_key: Some(format!("bench-{i}")),
        trace: None,
    }
}

/// Runs `measure` against a database and topics of its own, created here and dropped after
/// (the configured database is used only to create it).
pub(crate) async fn in_scratch<T, F, Fut>(mut config: Config, measure: F) -> anyhow::Result<T>
where
    F: FnOnce(Config) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let admin =
        PgPool::connect(config.database_url.expose()).await.context("connecting to Postgres")?;
    let database = format!("jobfold_bench_{suffix}");
    sqlx::query(&format!("CREATE DATABASE {database}")).execute(&admin).await?;
    let result = async {
        let url = config
            .database_url
            .expose()
            .rsplit_once('/')
            .map(|(base, _)| format!("{base}/{database}"));
        config.database_url = Sensitive::new(url.context("the database URL has no database name")?);
        config.topics.events = format!("jobfold-bench-events-{suffix}");
        config.topics.requests = format!("jobfold-bench-requests-{suffix}");
        config.relay.lock_key = i64::from(rand::random::<u32>());
        measure(config).await
    }
    .await;
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .execute(&admin)
        .await;
    result
}

/// Runs the benchmark and returns the results as a markdown table.
pub(crate) async fn run(config: Config, sizes: Sizes) -> anyhow::Result<String> {
    let result = in_scratch(config, |config| async move { measure(&config, sizes).await }).await;
    let rows = result?;

    let mut out = String::new();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    writeln!(out, "| measurement | per second | p50 ms | p99 ms | note |")?;
    writeln!(out, "| --- | ---: | ---: | ---: | --- |")?;
    let num = |v: Option<f64>, digits: usize| {
        v.map(|v| format!("{v:.digits$}")).unwrap_or_else(|| "–".into())
    };
    for row in rows {
        writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            row.what,
            num(row.rate, 0),
            num(row.p50_ms, 2),
            num(row.p99_ms, 2),
            row.note
        )?;
    }
    writeln!(out, "\n{cores} cores; Postgres, Kafka and the registry on the same machine.")?;
    Ok(out)
}

async fn measure(config: &Config, sizes: Sizes) -> anyhow::Result<Vec<Row>> {
    let pool = jobfold_common::db::connect_and_migrate(config, 32).await?;
    jobfold_common::kafka::ensure_topics(config, &jobfold_common::kafka::jobfold_topics(config))
        .await?;
    let codec = Codec::<JobEvent>::connect(
        registry_settings(&config.schema_registry_url)?,
        &config.topics.events,
    )
    .await?;
    let acceptor = Acceptor::new(codec.clone(), config.accept.clone(), "bench");
    let mut rows = Vec::new();

    // The machine's limit: a raw producer with the relay's settings, same message size.
    // Distinct real event bodies, like the relay's, for the raw producer.
    let bodies: Vec<Vec<u8>> = (0..sizes.raw_messages)
        .map(|i| codec.encode(&sample_event(i)))
        .collect::<Result<_, _>>()?;
    let size = bodies.iter().map(Vec::len).sum::<usize>() / bodies.len().max(1);
    let raw_rate = raw_producer(config, &bodies).await?;
    rows.push(Row {
        what: "raw rdkafka producer (relay settings)".into(),
        rate: Some(raw_rate),
        p50_ms: None,
        p99_ms: None,
        note: format!("{} distinct events of {size} B on average", sizes.raw_messages),
    });

    // Accept, one at a time: latency as a single client sees it.
    let mut h = latency_histogram();
    let started = Instant::now();
    for i in 0..sizes.single_accepts {
        let t = Instant::now();
        acceptor.accept(&pool, &job(i)).await?;
        h.record(t.elapsed().as_micros() as u64)?;
    }
    let rate = sizes.single_accepts as f64 / started.elapsed().as_secs_f64();
    rows.push(Row {
        what: "accept, 1 client".into(),
        rate: Some(rate),
        p50_ms: Some(ms(&h, 0.5)),
        p99_ms: Some(ms(&h, 0.99)),
        note: "one transaction per job".into(),
    });

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
    let mut h = latency_histogram();
    for l in latencies {
        h.record(l)?;
    }
    rows.push(Row {
        what: "accept, 16 clients".into(),
        rate: Some(rate),
        p50_ms: Some(ms(&h, 0.5)),
        p99_ms: Some(ms(&h, 0.99)),
        note: "one transaction per job".into(),
    });

    // Accept in batches: one transaction per batch.
    let offset = offset + sizes.concurrent_accepts;
    let mut h = latency_histogram();
    let started = Instant::now();
    for chunk in (0..sizes.batched_accepts).collect::<Vec<_>>().chunks(sizes.batch) {
        let jobs: Vec<NewJob> = chunk.iter().map(|i| job(offset + i)).collect();
        let t = Instant::now();
        acceptor.accept_batch(&pool, &jobs).await?;
        h.record(t.elapsed().as_micros() as u64)?;
    }
    let rate = sizes.batched_accepts as f64 / started.elapsed().as_secs_f64();
    rows.push(Row {
        what: format!("accept, batches of {}", sizes.batch),
        rate: Some(rate),
        p50_ms: Some(ms(&h, 0.5)),
        p99_ms: Some(ms(&h, 0.99)),
        note: "latency per batch".into(),
    });

    // Relay at full load: drain the backlog everything above left.
    let backlog = unpublished(&pool).await?;
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(config.clone(), shutdown.clone()));
    // Timed from the first published row, so start-up (connect, lock) is not counted.
    let (started, already) = loop {
        let left = unpublished(&pool).await?;
        if left < backlog {
            break (Instant::now(), backlog - left);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    wait_drained(&pool, Duration::from_secs(600)).await?;
    let relay_rate = (backlog - already) as f64 / started.elapsed().as_secs_f64();
    rows.push(Row {
        what: format!("relay, draining a backlog (batches of {})", config.relay.batch_size),
        rate: Some(relay_rate),
        p50_ms: None,
        p99_ms: None,
        note: format!(
            "{backlog} events; {:.0}% of the raw producer",
            100.0 * relay_rate / raw_rate
        ),
    });

    // Relay at a steady load: commit -> publish latency.
    let mark: i64 =
        sqlx::query_scalar("SELECT coalesce(max(seq), 0) FROM outbox").fetch_one(&pool).await?;
    let offset = offset + sizes.batched_accepts;
    let total = sizes.steady_rate as usize * sizes.steady_secs as usize;
    let interval = Duration::from_secs_f64(1.0 / f64::from(sizes.steady_rate));
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut in_flight = Vec::with_capacity(total);
    for i in 0..total {
        ticker.tick().await;
        let acceptor = acceptor.clone();
        let pool = pool.clone();
        in_flight.push(tokio::spawn(async move { acceptor.accept(&pool, &job(offset + i)).await }));
    }
    for task in in_flight {
        task.await??;
    }
    wait_drained(&pool, Duration::from_secs(120)).await?;
    if config.relay.prune_after.is_zero() {
        rows.push(Row {
            what: format!("relay, steady {} accepts/s", sizes.steady_rate),
            rate: None,
            p50_ms: None,
            p99_ms: None,
            note: "not measured: relay.prune_after = 0s deletes rows on publish".into(),
        });
    } else {
        let delays: Vec<f64> = sqlx::query_scalar(
            "SELECT EXTRACT(EPOCH FROM published_at - available_at)::float8 * 1000 \
             FROM outbox WHERE seq > $1",
        )
        .bind(mark)
        .fetch_all(&pool)
        .await?;
        let mut h = latency_histogram();
        for d in &delays {
            h.record((d * 1000.0).max(1.0) as u64)?;
        }
        rows.push(Row {
            what: format!("relay, steady {} accepts/s", sizes.steady_rate),
            rate: None,
            p50_ms: Some(ms(&h, 0.5)),
            p99_ms: Some(ms(&h, 0.99)),
            note: format!("commit -> marked published, {} events", delays.len()),
        });
    }
    // End to end, on a topic of its own so the processor sees only what is measured here.
    let mut e2e = config.clone();
    e2e.topics.events = format!("{}-e2e", config.topics.events);
    e2e.topics.requests = format!("{}-e2e", config.topics.requests);
    e2e.http_addr = "127.0.0.1:0".parse()?;
    e2e.intake.enabled = false;
    e2e.processor.group = format!("jobfold-bench-processors-{}", uuid::Uuid::new_v4().simple());
    // The jobs above stay queued (nobody runs them): keep the reaper off them.
    e2e.processor.stall_after = Duration::from_secs(24 * 3600);
    jobfold_common::kafka::ensure_topics(&e2e, &jobfold_common::kafka::jobfold_topics(&e2e))
        .await?;
    let codec = Codec::<JobEvent>::connect(
        registry_settings(&e2e.schema_registry_url)?,
        &e2e.topics.events,
    )
    .await?;
    let acceptor = Acceptor::new(codec, e2e.accept.clone(), "bench");
    let processor = tokio::spawn(jobfold_processor::run(e2e.clone(), shutdown.clone()));
    let mut offset = offset + total;

    // Throughput: a burst, accepted in batches, until every job succeeded.
    let burst = sizes.e2e_jobs;
    let since: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now()").fetch_one(&pool).await?;
    let started = Instant::now();
    for chunk in (0..burst).collect::<Vec<_>>().chunks(sizes.batch) {
        let jobs: Vec<NewJob> = chunk.iter().map(|i| job(offset + i)).collect();
        acceptor.accept_batch(&pool, &jobs).await?;
    }
    wait_finished_since(&pool, since, burst, Duration::from_secs(900)).await?;
    let rate = burst as f64 / started.elapsed().as_secs_f64();
    let (events_per_job, rows_per_job) = per_job_costs(&pool, since).await?;
    rows.push(Row {
        what: "end to end, trivial handler, burst".into(),
        rate: Some(rate),
        p50_ms: None,
        p99_ms: None,
        note: format!(
            "{burst} jobs accept -> succeeded; per job {events_per_job:.1} Kafka messages, \
             {rows_per_job:.1} rows written"
        ),
    });
    offset += burst;

    // Latency: a steady load well below the burst rate.
    let steady_rate = (rate / 2.0).clamp(10.0, 500.0);
    let steady_jobs = (steady_rate * sizes.steady_secs as f64) as usize;
    let since: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now()").fetch_one(&pool).await?;
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / steady_rate));
    let mut accepts = Vec::with_capacity(steady_jobs);
    for i in 0..steady_jobs {
        ticker.tick().await;
        let acceptor = acceptor.clone();
        let pool = pool.clone();
        accepts.push(tokio::spawn(async move { acceptor.accept(&pool, &job(offset + i)).await }));
    }
    for accept in accepts {
        accept.await??;
    }
    wait_finished_since(&pool, since, steady_jobs, Duration::from_secs(300)).await?;
    let latencies: Vec<f64> = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM finished_at - accepted_at)::float8 * 1000 FROM jobs \
         WHERE accepted_at >= $1",
    )
    .bind(since)
    .fetch_all(&pool)
    .await?;
    let mut h = latency_histogram();
    for l in &latencies {
        h.record((l * 1000.0).max(1.0) as u64)?;
    }
    rows.push(Row {
        what: format!("end to end, steady {steady_rate:.0} jobs/s"),
        rate: None,
        p50_ms: Some(ms(&h, 0.5)),
        p99_ms: Some(ms(&h, 0.99)),
        note: format!("accept -> succeeded, {} jobs", latencies.len()),
    });
    offset += steady_jobs;

    // Slow jobs: how many run at once (10 s handler, 200 documents).
    let slow = 200;
    let jobs: Vec<NewJob> = (0..slow)
        .map(|i| NewJob {
            input: json!({ "text": "slow", "simulate": { "sleep_ms": 10_000 } }),
            ..job(offset + i)
        })
        .collect();
    let since: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now()").fetch_one(&pool).await?;
    let started = Instant::now();
    acceptor.accept_batch(&pool, &jobs).await?;
    let mut peak = 0i64;
    while started.elapsed() < Duration::from_secs(120) {
        let (leased, done): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state = 'leased'), \
                    count(*) FILTER (WHERE state IN ('succeeded', 'superseded', 'quarantined')) \
             FROM jobs WHERE accepted_at >= $1",
        )
        .bind(since)
        .fetch_one(&pool)
        .await?;
        peak = peak.max(leased);
        if done == slow as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    rows.push(Row {
        what: format!("slow jobs, 10 s handler, {} partitions", e2e.topics.partitions),
        rate: Some(slow as f64 / secs),
        p50_ms: None,
        p99_ms: None,
        note: format!("{peak} jobs in flight at the peak; {slow} jobs in {secs:.1} s"),
    });

    shutdown.cancel();
    relay.await??;
    processor.await??;
    pool.close().await;
    Ok(rows)
}

/// Waits until `count` jobs accepted since `since` are finished.
async fn wait_finished_since(
    pool: &PgPool,
    since: chrono::DateTime<chrono::Utc>,
    count: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM jobs \
             WHERE accepted_at >= $1 AND state IN ('succeeded', 'superseded', 'quarantined')",
        )
        .bind(since)
        .fetch_one(pool)
        .await?;
        if done >= count as i64 {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "jobs did not finish: {done} of {count}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Kafka messages (events) and rows written per job accepted since `since`.
async fn per_job_costs(
    pool: &PgPool,
    since: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<(f64, f64)> {
    let (jobs, events, results, dedupe): (i64, i64, i64, i64) = sqlx::query_as(
        r#"
        SELECT (SELECT count(*) FROM jobs WHERE accepted_at >= $1),
               (SELECT count(*) FROM job_events e JOIN jobs j USING (job_id) WHERE j.accepted_at >= $1),
               (SELECT count(*) FROM job_results r JOIN jobs j USING (job_id) WHERE j.accepted_at >= $1),
               (SELECT count(*) FROM consumed_events c WHERE c.consumed_at >= $1)
        "#,
    )
    .bind(since)
    .fetch_one(pool)
    .await?;
    let jobs = jobs.max(1) as f64;
    // Per job: the job row, each event with its outbox row, the result, the dedupe row, the
    // business write (document_index and index_writes).
    let rows =
        1.0 + 2.0 * events as f64 / jobs + results as f64 / jobs + dedupe as f64 / jobs + 2.0;
    Ok((events as f64 / jobs, rows))
}

async fn unpublished(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
        .fetch_one(pool)
        .await?)
}

/// Waits until no outbox row is unpublished; polls cheaply (one index probe), so as not
/// to slow down what it measures.
async fn wait_drained(pool: &PgPool, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let any: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL)")
                .fetch_one(pool)
                .await?;
        if !any {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the relay did not drain the outbox");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
        }),
    }
}

/// Messages per second a producer with the relay's settings delivers to a topic of the
/// same partitions, keyed like the relay's, with `bodies` as values.
async fn raw_producer(config: &Config, bodies: &[Vec<u8>]) -> anyhow::Result<f64> {
    let producer: FutureProducer =
        config.kafka_client_with(jobfold_relay::publish::PRODUCER_DEFAULTS).create()?;
    // Warm up (metadata, connections, producer id) before timing, as the relay is.
    producer
        .send(
            FutureRecord::to(&config.topics.requests).key("warm-up").payload(&[0u8][..]),
            Timeout::Never,
        )
        .await
        .map_err(|(e, _)| e)?;
    let keys: Vec<String> = (0..1000).map(|i| format!("doc-{i}")).collect();
    let messages = bodies.len();
    let started = Instant::now();
    let mut pending = std::collections::VecDeque::with_capacity(messages);
    for i in 0..messages {
        let mut record = FutureRecord::to(&config.topics.requests)
            .key(&keys[i % keys.len()])
            .payload(&bodies[i]);
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    pending.push_back(delivery);
                    break;
                }
                Err((_, back)) => {
                    // Queue full: let deliveries drain, as the relay does.
                    record = back;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }
    for delivery in pending {
        delivery.await.map_err(|_| anyhow::anyhow!("delivery canceled"))?.map_err(|(e, _)| e)?;
    }
    let _ = rdkafka::producer::Producer::flush(&producer, Timeout::After(Duration::from_secs(30)));
    Ok(messages as f64 / started.elapsed().as_secs_f64())
}
