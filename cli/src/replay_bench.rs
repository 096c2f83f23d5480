//! `jobfold bench --replay`: `jobfold replay`'s speed and memory over logs of growing size.
//!
//! For each size, a synthetic log of finished jobs (`JobRequested`, `JobLeased`,
//! `JobSucceeded`, 1,000 jobs interleaved at a time) is written to a scratch `job_events`
//! table and produced to a scratch topic; then `jobfold replay` runs as a child process
//! against each source while its resident memory is sampled every 50 ms. Flat memory shows
//! as the same peak for every size.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use jobfold_common::config::Config;
use jobfold_schemas::event::{JobLeased, JobRequested, JobSucceeded};
use jobfold_schemas::{Codec, JobEvent, Payload};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;
use uuid::Uuid;

/// Jobs whose events are interleaved in the log at a time.
const INTERLEAVE: usize = 1_000;

/// One replay measured.
struct Measured {
    events: usize,
    source: &'static str,
    seconds: f64,
    peak_kib: u64,
    /// Resident memory at 25, 50, 75 and 100 % of the run.
    quartiles_kib: [u64; 4],
}

/// Measures replays of logs with `sizes` events; returns a markdown table.
pub(crate) async fn run(config: Config, sizes: &[usize]) -> anyhow::Result<String> {
    let mut measured = Vec::new();
    for &events in sizes {
        let rows = super::bench::in_scratch(config.clone(), |config| async move {
            let pool = jobfold_common::db::connect_and_migrate(&config, 4).await?;
            jobfold_common::kafka::ensure_topics(
                &config,
                &jobfold_common::kafka::jobfold_topics(&config),
            )
            .await?;
            let written = Instant::now();
            write_log(&config, &pool, events).await?;
            eprintln!(
                "replay bench: wrote {events} events to Postgres and Kafka in {:.1} s",
                written.elapsed().as_secs_f64()
            );
            let mut rows = Vec::new();
            for source in ["postgres", "kafka"] {
                rows.push(replay_child(&config, source, events).await?);
            }
            Ok(rows)
        })
        .await?;
        measured.extend(rows);
    }
    let mut out = String::new();
    writeln!(
        out,
        "| events | source | events/s | peak RSS MiB | RSS at 25 / 50 / 75 / 100 % of the run, MiB |"
    )?;
    writeln!(out, "| ---: | --- | ---: | ---: | --- |")?;
    let mib = |kib: u64| kib as f64 / 1024.0;
    for m in measured {
        let q: Vec<String> = m.quartiles_kib.iter().map(|k| format!("{:.1}", mib(*k))).collect();
        writeln!(
            out,
            "| {} | {} | {:.0} | {:.1} | {} |",
            m.events,
            m.source,
            m.events as f64 / m.seconds,
            mib(m.peak_kib),
            q.join(" / ")
        )?;
    }
    Ok(out)
}

/// Writes `events` events of finished jobs to `job_events` (with their `jobs` rows) and to
/// the events topic, in log order.
async fn write_log(config: &Config, pool: &PgPool, events: usize) -> anyhow::Result<()> {
    let codec = Codec::<JobEvent>::connect(config.registry()?, &config.topics.events).await?;
    let producer: FutureProducer = config.kafka_client().set("linger.ms", "20").create()?;
    let jobs = events.div_ceil(3);
    let mut written = 0;
    let mut first = 0;
    while first < jobs && written < events {
        let chunk: Vec<(Uuid, String)> = (first..jobs.min(first + INTERLEAVE))
            .map(|i| (Uuid::now_v7(), format!("doc-{i}")))
            .collect();
        first += chunk.len();
        insert_jobs(pool, &chunk).await?;
        for step in 1..=3 {
            let mut rows = Vec::with_capacity(chunk.len());
            for (job_id, document) in &chunk {
                if written == events {
                    break;
                }
                let event = synthetic(*job_id, document, step);
                rows.push((
                    event.event_id,
                    *job_id,
                    step,
                    event.payload.kind(),
                    codec.encode(&event)?,
                ));
                written += 1;
            }
            let mut deliveries = Vec::with_capacity(rows.len());
            for ((_, _, _, _, body), (_, document)) in rows.iter().zip(&chunk) {
                let record = FutureRecord::to(&config.topics.events).key(document).payload(body);
                deliveries.push(producer.send_result(record).map_err(|(e, _)| e)?);
            }
            insert_events(pool, &rows).await?;
            for delivery in deliveries {
                delivery.await.context("delivery canceled")?.map_err(|(e, _)| e)?;
            }
        }
    }
    Ok(())
}

fn synthetic(job_id: Uuid, document: &str, step: i32) -> JobEvent {
    let payload = match step {
        1 => Payload::JobRequested(JobRequested {
            input: r#"{"text":"a synthetic document of a few words"}"#.into(),
            idempotency_key: None,
            max_attempts: 5,
            deadline: None,
            run_at: None,
        }),
        2 => Payload::JobLeased(JobLeased {
            generation: 1,
            attempt: 1,
            lease_owner: "bench/1".into(),
            lease_until: Utc::now() + chrono::Duration::seconds(30),
            leased_at: Some(Utc::now()),
            dispatch_event_id: Uuid::now_v7(),
        }),
        _ => Payload::JobSucceeded(JobSucceeded {
            generation: 1,
            attempt: 1,
            result: r#"{"words":6}"#.into(),
            lease: None,
        }),
    };
    JobEvent {
        event_id: Uuid::now_v7(),
        job_id,
        document_id: document.to_owned(),
        job_kind: "index-document".into(),
        input_version: 1,
        stream_version: step,
        occurred_at: Utc::now(),
        trace: None,
        producer: "bench".into(),
        payload,
    }
}

async fn insert_jobs(pool: &PgPool, jobs: &[(Uuid, String)]) -> anyhow::Result<()> {
    let ids: Vec<Uuid> = jobs.iter().map(|j| j.0).collect();
    let documents: Vec<&str> = jobs.iter().map(|j| j.1.as_str()).collect();
    sqlx::query!(
        r#"
        INSERT INTO jobs (job_id, document_id, kind, payload, input_version, state, attempt,
                          generation, finished_at, max_attempts, stream_version)
        SELECT id, doc, 'index-document', '{}', 1, 'succeeded', 1, 1, now(), 5, 3
        FROM unnest($1::uuid[], $2::text[]) AS t(id, doc)
        "#,
        &ids,
        &documents as &[&str],
    )
    .execute(pool)
    .await?;
    Ok(())
}

type EventRow = (Uuid, Uuid, i32, &'static str, Vec<u8>);

async fn insert_events(pool: &PgPool, rows: &[EventRow]) -> anyhow::Result<()> {
    let event_ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
    let job_ids: Vec<Uuid> = rows.iter().map(|r| r.1).collect();
    let versions: Vec<i32> = rows.iter().map(|r| r.2).collect();
    let kinds: Vec<&str> = rows.iter().map(|r| r.3).collect();
    let bodies: Vec<&[u8]> = rows.iter().map(|r| r.4.as_slice()).collect();
    sqlx::query!(
        r#"
        INSERT INTO job_events (event_id, job_id, stream_version, kind, body)
        SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::int[], $4::text[], $5::bytea[])
        "#,
        &event_ids,
        &job_ids,
        &versions,
        &kinds as &[&str],
        &bodies as &[&[u8]],
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Runs `jobfold replay --from <source>` on the scratch log as a child process, sampling
/// its resident memory.
async fn replay_child(
    config: &Config,
    source: &'static str,
    events: usize,
) -> anyhow::Result<Measured> {
    let mut command = tokio::process::Command::new(std::env::current_exe()?);
    command
        .args(["replay", "--from", source, "--no-progress"])
        .env("JOBFOLD_DATABASE_URL", config.database_url.expose())
        .env("JOBFOLD_KAFKA_BROKERS", &config.kafka_brokers)
        .env("JOBFOLD_SCHEMA_REGISTRY_URL", config.schema_registry_url.expose())
        .env("JOBFOLD_TOPICS__EVENTS", &config.topics.events)
        .env("JOBFOLD_TOPICS__REQUESTS", &config.topics.requests)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    let started = Instant::now();
    let child = command.spawn().context("starting jobfold replay")?;
    let pid = child.id().context("the child has a pid")?;
    let output = tokio::spawn(child.wait_with_output());
    let mut samples: Vec<u64> = Vec::new();
    while !output.is_finished() {
        if let Some(kib) = resident_kib(pid) {
            samples.push(kib);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let output = output.await??;
    let seconds = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        output.status.success(),
        "jobfold replay --from {source} failed: {}",
        String::from_utf8_lossy(&output.stdout)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    anyhow::ensure!(
        stdout.contains(&format!("replayed {events} events")),
        "jobfold replay --from {source} did not read {events} events: {stdout}"
    );
    let at = |q: f64| {
        samples.get(((samples.len() as f64 * q) as usize).min(samples.len().saturating_sub(1)))
    };
    Ok(Measured {
        events,
        source,
        seconds,
        peak_kib: samples.iter().copied().max().unwrap_or(0),
        quartiles_kib: [0.25, 0.5, 0.75, 1.0].map(|q| at(q).copied().unwrap_or(0)),
    })
}

/// `VmRSS` of a process, from /proc (Linux).
fn resident_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}
