//! `jobfold replay`: the job event log from Kafka and from Postgres, folded with the schemas
//! crate's fold, verified against the projection, exported — after a workload with retries,
//! quarantines, an operator replay, supersession and duplicate deliveries.

use std::time::Duration;

use arrow_array::{Array, Int32Array, StringArray, TimestampMillisecondArray};
use arrow_schema::{DataType, TimeUnit};
use jobfold_cli::analytics::{self, Export, Format, Options, Report, Rows, Source};
use jobfold_schemas::{Decoder, JobEvent, Status};
use jobfold_tests::harness::{Installation, events_on_topic, eventually, index_job as job};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn options(source: Source, verify: bool, export: Option<Export>) -> Options {
    Options { verify, export, ..Options::new(source) }
}

async fn count(it: &Installation, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&it.pool).await.unwrap()
}

async fn replay(it: &Installation, options: &Options) -> Report {
    let decoder = Decoder::<JobEvent>::new(it.registry());
    analytics::replay(&it.config, &it.pool, &decoder, options).await.expect("the replay runs")
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_from_kafka_and_postgres_verifies_reports_and_exports() {
    let mut it = Installation::new("replay").await;
    it.create_topics().await;
    let p = &mut it.config.processor;
    p.retry_base = Duration::from_millis(50);
    p.retry_cap = Duration::from_millis(100);
    p.group = jobfold_tests::kafka::unique_name("processors");
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()));
    let processor = tokio::spawn(jobfold_tests::handlers::run(it.config.clone(), shutdown.clone()));

    // The workload: plain jobs, retries, permanent failures, two versions of one document.
    let acceptor = it.acceptor().await;
    let mut jobs = Vec::new();
    for n in 0..6 {
        jobs.push(job(&format!("doc-{n}"), 1, json!({"text": format!("document {n}")})));
    }
    for n in 0..3 {
        let input = json!({"text": "flaky", "simulate": {"fail_attempts": 1}});
        jobs.push(job(&format!("flaky-{n}"), 1, input));
    }
    for n in 0..2 {
        let input = json!({"text": "bad", "simulate": {"permanent": true}});
        jobs.push(job(&format!("broken-{n}"), 1, input));
    }
    jobs.push(job("versions", 2, json!({"text": "one two"})));
    let accepted = acceptor.accept_batch(&it.pool, &jobs).await.unwrap();
    let settled =
        "SELECT count(*) FROM jobs WHERE state IN ('succeeded', 'superseded', 'quarantined')";
    eventually(Duration::from_secs(90), "every job to settle", || async {
        count(&it, settled).await == accepted.len() as i64
    })
    .await;
    // An older version arriving after a newer one succeeded is superseded.
    acceptor.accept(&it.pool, &job("versions", 1, json!({"text": "one"}))).await.unwrap();
    let total = accepted.len() as i64 + 1;
    eventually(Duration::from_secs(60), "the old version to be superseded", || async {
        count(&it, settled).await == total
    })
    .await;

    // An operator replays one quarantined job with a corrected input.
    let broken = accepted[9].job_id;
    let events = it.events().await;
    let mut tx = it.pool.begin().await.unwrap();
    let request = jobfold_processor::store::Replay {
        requested_by: Some("test".into()),
        new_input_version: Some(2),
        new_input: Some(json!({"text": "fixed"})),
    };
    jobfold_processor::store::replay(&mut tx, &events, &it.config.accept_policy(), broken, request)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    eventually(Duration::from_secs(60), "the replayed job to succeed", || async {
        count(
            &it,
            &format!("SELECT count(*) FROM jobs WHERE job_id = '{broken}' AND state = 'succeeded'"),
        )
        .await
            == 1
    })
    .await;

    // Duplicate deliveries: the relay publishes 5 events again, as after a crash between
    // produce and moving its cursor.
    eventually(Duration::from_secs(30), "everything to be published", || async {
        it.unpublished().await == 0
    })
    .await;
    it.republish_last(5).await;
    assert_eq!(it.unpublished().await, 5);
    let logged = count(&it, "SELECT count(*) FROM job_events").await;
    eventually(Duration::from_secs(60), "the duplicates to be on the topic", || async {
        events_on_topic(&it) == logged + 5
    })
    .await;
    eventually(Duration::from_secs(30), "the processor to skip them", || async {
        it.unpublished().await == 0
    })
    .await;
    shutdown.cancel();
    relay.await.unwrap().unwrap();
    processor.await.unwrap().unwrap();

    let kafka = replay(&it, &options(Source::Kafka, true, None)).await;
    assert!(kafka.is_clean(), "{kafka}");
    assert_eq!(kafka.events, (logged + 5) as u64, "{kafka}");
    assert_eq!(kafka.duplicates, 5, "{kafka}");
    assert_eq!(kafka.jobs, total as u64, "{kafka}");
    assert_eq!(kafka.verified, Some(total as u64), "{kafka}");
    assert_eq!(kafka.states.get(&Status::Quarantined), Some(&1), "{kafka}");
    assert_eq!(kafka.states.get(&Status::Superseded), Some(&1), "{kafka}");
    assert_eq!(kafka.states.get(&Status::Succeeded), Some(&(total as u64 - 2)), "{kafka}");
    assert!(kafka.anomaly_count == 0 && kafka.partial_events == 0, "{kafka}");
    assert_eq!(kafka.attempts.get(&2), Some(&3), "the flaky jobs took two attempts: {kafka}");
    assert!(kafka.time_in_state.contains_key("retry_wait"), "{kafka}");
    let postgres = replay(&it, &options(Source::Postgres, true, None)).await;
    assert!(postgres.is_clean(), "{postgres}");
    assert_eq!((postgres.events, postgres.duplicates), (logged as u64, 0));
    assert_eq!(postgres.states, kafka.states);

    // A projection row changed by hand is reported, from both sources.
    let tampered = accepted[0].job_id;
    sqlx::query("UPDATE jobs SET generation = generation + 7 WHERE job_id = $1")
        .bind(tampered)
        .execute(&it.pool)
        .await
        .unwrap();
    for source in [Source::Kafka, Source::Postgres] {
        let report = replay(&it, &options(source, true, None)).await;
        assert!(!report.is_clean(), "{report}");
        assert_eq!(report.difference_count, 1, "{report}");
        let difference = &report.differences[0];
        assert!(
            difference.contains(&tampered.to_string()) && difference.contains("generation"),
            "{difference}"
        );
    }

    // Parquet, one row per event: the log without its duplicates, with typed columns.
    let dir = std::env::temp_dir().join(format!("jobfold-replay-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("events.parquet");
    let export = Export { path: path.clone(), format: Format::Parquet, rows: Rows::Events };
    replay(&it, &options(Source::Kafka, false, Some(export))).await;
    let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&path).unwrap())
        .unwrap()
        .build()
        .unwrap();
    let batches: Vec<_> = reader.map(Result::unwrap).collect();
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows as i64, logged, "one row per event, duplicates skipped");
    let schema = batches[0].schema();
    assert_eq!(
        schema.field_with_name("occurred_at").unwrap().data_type(),
        &DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into()))
    );
    assert_eq!(schema.field_with_name("stream_version").unwrap().data_type(), &DataType::Int32);
    assert_eq!(schema.field_with_name("offset").unwrap().data_type(), &DataType::Int64);
    let mut ids = std::collections::HashSet::new();
    let mut requested = 0;
    for batch in &batches {
        let column = |name: &str| {
            std::sync::Arc::clone(batch.column(batch.schema().index_of(name).unwrap()))
        };
        let event_ids = column("event_id");
        let event_ids = event_ids.as_any().downcast_ref::<StringArray>().unwrap();
        let types = column("type");
        let types = types.as_any().downcast_ref::<StringArray>().unwrap();
        let versions = column("stream_version");
        let versions = versions.as_any().downcast_ref::<Int32Array>().unwrap();
        let times = column("occurred_at");
        let times = times.as_any().downcast_ref::<TimestampMillisecondArray>().unwrap();
        assert_eq!(times.null_count(), 0);
        for i in 0..batch.num_rows() {
            ids.insert(event_ids.value(i).to_owned());
            if types.value(i) == "JobRequested" {
                assert_eq!(versions.value(i), 1);
                requested += 1;
            }
        }
    }
    assert_eq!(ids.len() as i64, logged, "every event id once");
    assert_eq!(requested, total);

    // Parquet, one row per job; JSON Lines, one line per event.
    let path = dir.join("jobs.parquet");
    let export = Export { path: path.clone(), format: Format::Parquet, rows: Rows::Jobs };
    replay(&it, &options(Source::Postgres, false, Some(export))).await;
    let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&path).unwrap())
        .unwrap()
        .build()
        .unwrap();
    let batch = reader.map(Result::unwrap).next().expect("a batch");
    assert_eq!(batch.num_rows() as i64, total);
    let statuses = std::sync::Arc::clone(batch.column(batch.schema().index_of("status").unwrap()));
    let statuses = statuses.as_any().downcast_ref::<StringArray>().unwrap();
    let quarantined = (0..statuses.len()).filter(|i| statuses.value(*i) == "quarantined").count();
    assert_eq!(quarantined, 1);
    let path = dir.join("events.jsonl");
    let export = Export { path: path.clone(), format: Format::JsonLines, rows: Rows::Events };
    replay(&it, &options(Source::Kafka, false, Some(export))).await;
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len() as i64, logged);
    assert!(lines.iter().all(|l| l["partition"].is_i64() && l["payload"]["type"].is_string()));
    std::fs::remove_dir_all(&dir).unwrap();
    it.cleanup().await;
}

/// A scheduled job's `JobRequested` waits in the outbox until its time, so Kafka does not
/// have it yet: `--verify` from Kafka counts it as waiting, not as a difference.
#[tokio::test(flavor = "multi_thread")]
async fn verify_from_kafka_counts_scheduled_jobs_as_waiting() {
    let it = Installation::new("replay-scheduled").await;
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let later = jobfold_common::accept::NewJob {
        run_at: Some(chrono::Utc::now() + chrono::Duration::hours(1)),
        ..job("doc-later", 1, json!({"text": "in an hour"}))
    };
    acceptor.accept(&it.pool, &later).await.unwrap();
    acceptor.accept(&it.pool, &job("doc-now", 1, json!({"text": "now"}))).await.unwrap();
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()));
    // Published: all but the scheduled one, which waits in the outbox.
    eventually(Duration::from_secs(30), "the job due now published", || async {
        events_on_topic(&it) == 1 && it.unpublished().await == 1
    })
    .await;
    shutdown.cancel();
    relay.await.unwrap().unwrap();

    let kafka = replay(&it, &options(Source::Kafka, true, None)).await;
    assert!(kafka.is_clean(), "{kafka}");
    assert_eq!(kafka.waiting_for_their_time, 1, "{kafka}");
    assert!(kafka.to_string().contains("waiting for its time"), "{kafka}");
    let postgres = replay(&it, &options(Source::Postgres, true, None)).await;
    assert!(postgres.is_clean(), "{postgres}");
    assert_eq!(postgres.jobs, 2, "Postgres has the whole log: {postgres}");
    it.cleanup().await;
}
