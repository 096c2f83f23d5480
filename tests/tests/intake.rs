//! The intake topic: upstream requests become jobs once each; poison becomes dead letters;
//! offsets are committed only for what is done.

use std::time::Duration;

use chrono::Utc;
use jobfold_schemas::{Codec, JobRequest};
use jobfold_tests::harness::{Installation, eventually};
use jobfold_tests::kafka::client_config;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn request(document: &str, version: i64) -> JobRequest {
    JobRequest {
        request_id: Uuid::new_v4(),
        document_id: document.into(),
        job_kind: "index-document".into(),
        input_version: version,
        input: r#"{"text":"from upstream"}"#.into(),
        requested_at: Utc::now(),
        producer: "upstream-test".into(),
        trace: None,
        run_at: None,
    }
}

/// Sum over partitions of the group's committed offsets on `topic`.
fn committed_total(group: &str, topic: &str, partitions: i32) -> i64 {
    let consumer: BaseConsumer = client_config().set("group.id", group).create().unwrap();
    let mut list = TopicPartitionList::new();
    for p in 0..partitions {
        list.add_partition(topic, p);
    }
    let committed =
        consumer.committed_offsets(list, Timeout::After(Duration::from_secs(10))).unwrap();
    committed
        .elements()
        .iter()
        .map(|e| match e.offset() {
            Offset::Offset(o) => o,
            _ => 0,
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_become_jobs_once_and_poison_becomes_dead_letters() {
    let it = Installation::new("intake").await;
    it.create_topics().await;
    let codec =
        Codec::<JobRequest>::connect(it.registry(), &it.config.topics.requests).await.unwrap();
    let producer: FutureProducer =
        client_config().set("enable.idempotence", "true").create().unwrap();
    let topic = it.config.topics.requests.clone();
    let send = |key: String, value: Vec<u8>| {
        let (producer, topic) = (producer.clone(), topic.clone());
        async move { send(&producer, &topic, &key, &value).await }
    };

    let requests: Vec<JobRequest> =
        (0..100).map(|i| request(&format!("doc-{}", i % 10), 1 + i / 10)).collect();
    for r in &requests {
        send(r.document_id.clone(), codec.encode(r).unwrap()).await;
    }
    // An upstream retry: the same request id again.
    send(requests[7].document_id.clone(), codec.encode(&requests[7]).unwrap()).await;
    // Poison: not the wire format at all, and a request whose input is not JSON.
    send("doc-0".into(), b"{\"not\":\"avro\"}".to_vec()).await;
    let bad_input = JobRequest { input: "not json".into(), ..request("doc-1", 99) };
    send("doc-1".into(), codec.encode(&bad_input).unwrap()).await;
    let total_messages = 103;

    let shutdown = CancellationToken::new();
    let processor = tokio::spawn(jobfold_tests::handlers::run(it.config.clone(), shutdown.clone()));
    eventually(Duration::from_secs(60), "100 jobs and 2 dead letters", || async {
        it.count("jobs").await == 100 && it.count("dead_letters").await == 2
    })
    .await;
    shutdown.cancel();
    processor.await.unwrap().unwrap();

    // Each request's job carries its request id as the idempotency key.
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT idempotency_key FROM jobs").fetch_all(&it.pool).await.unwrap();
    for r in &requests {
        assert!(keys.contains(&format!("request:{}", r.request_id)));
    }
    let errors: Vec<String> = sqlx::query_scalar("SELECT error FROM dead_letters ORDER BY error")
        .fetch_all(&it.pool)
        .await
        .unwrap();
    assert!(errors.iter().any(|e| e.contains("bad magic byte")), "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("not JSON")), "{errors:?}");
    let raw: Vec<u8> =
        sqlx::query_scalar("SELECT raw_value FROM dead_letters WHERE error LIKE '%magic%'")
            .fetch_one(&it.pool)
            .await
            .unwrap();
    assert_eq!(raw, b"{\"not\":\"avro\"}", "the dead letter keeps the raw value");

    // Everything handled is committed, so a restart does not see it again.
    assert_eq!(
        committed_total(&it.config.intake.group, &topic, it.config.topics.partitions),
        total_messages
    );
    it.cleanup().await;
}

/// A request Postgres cannot store — U+0000 in its document id, kind or input (valid Avro,
/// valid JSON), a kind no processor has registered, or a row a constraint refuses — is the
/// request's fault: dead-lettered with
/// the reason, and the requests behind it on every partition are accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_postgres_cannot_store_is_dead_lettered_and_the_partition_moves_on() {
    let it = Installation::new("intakenul").await;
    it.create_topics().await;
    // A constraint of this test's own: Postgres refuses this document's row (23514).
    it.refuse_document("forbidden").await;
    let codec =
        Codec::<JobRequest>::connect(it.registry(), &it.config.topics.requests).await.unwrap();
    let producer: FutureProducer =
        client_config().set("enable.idempotence", "true").create().unwrap();
    let topic = it.config.topics.requests.clone();
    let mut sent = 0;
    let mut poison = 0;
    // Fifteen documents spread over the partitions: each partition's first message is bad.
    for d in 0..15 {
        let document = format!("doc-{d}");
        let bad = match d % 5 {
            0 => JobRequest { input: r#"{"text":"a\u0000b"}"#.into(), ..request(&document, 1) },
            1 => JobRequest { job_kind: "index\0document".into(), ..request(&document, 1) },
            2 => JobRequest { document_id: format!("{document}\0"), ..request(&document, 1) },
            // A kind no processor has registered (misspelt).
            3 => JobRequest { job_kind: "index-documnet".into(), ..request(&document, 1) },
            _ => request("forbidden", 1),
        };
        for r in std::iter::once(bad).chain((1..=5).map(|v| request(&document, v))) {
            producer
                .send(
                    FutureRecord::to(&topic).key(&document).payload(&codec.encode(&r).unwrap()),
                    Timeout::Never,
                )
                .await
                .map_err(|(e, _)| e)
                .unwrap();
            sent += 1;
        }
        poison += 1;
    }

    let shutdown = CancellationToken::new();
    let processor = tokio::spawn(jobfold_tests::handlers::run(it.config.clone(), shutdown.clone()));
    eventually(Duration::from_secs(60), "75 jobs and 15 dead letters", || async {
        it.count("jobs").await == 75 && it.count("dead_letters").await == poison
    })
    .await;
    shutdown.cancel();
    processor.await.unwrap().unwrap();
    let errors: Vec<String> =
        sqlx::query_scalar("SELECT error FROM dead_letters").fetch_all(&it.pool).await.unwrap();
    assert_eq!(errors.iter().filter(|e| e.contains("U+0000")).count(), 9, "{errors:?}");
    assert_eq!(errors.iter().filter(|e| e.contains("23514")).count(), 3, "{errors:?}");
    assert_eq!(errors.iter().filter(|e| e.contains("unknown kind")).count(), 3, "{errors:?}");
    assert_eq!(committed_total(&it.config.intake.group, &topic, it.config.topics.partitions), sent);
    it.cleanup().await;
}

/// Produces `requests` to the requests topic, each keyed by its document.
async fn produce(it: &Installation, requests: &[JobRequest]) {
    let codec =
        Codec::<JobRequest>::connect(it.registry(), &it.config.topics.requests).await.unwrap();
    let producer: FutureProducer =
        client_config().set("enable.idempotence", "true").set("linger.ms", "20").create().unwrap();
    let topic = &it.config.topics.requests;
    let sends = requests.iter().map(|r| {
        let (producer, value) = (&producer, codec.encode(r).unwrap());
        async move { send(producer, topic, &r.document_id, &value).await }
    });
    futures::future::join_all(sends).await;
}

/// Produces one message and waits for its delivery.
async fn send(producer: &FutureProducer, topic: &str, key: &str, value: &[u8]) {
    producer
        .send(FutureRecord::to(topic).key(key).payload(value), Timeout::Never)
        .await
        .map_err(|(e, _)| e)
        .unwrap();
}

/// Requests waiting on the topic are accepted many to a transaction: the intake's
/// `jobfold_transaction_jobs{transaction="intake"}` histogram holds fewer transactions than
/// requests, and each request became one job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_are_accepted_many_to_a_transaction() {
    let it = Installation::new("intakebatch").await;
    it.create_topics().await;
    let requests: Vec<JobRequest> =
        (0..500).map(|i| request(&format!("doc-{}", i % 50), 1 + i / 50)).collect();
    produce(&it, &requests).await;
    let env = it.fast_env(&it.config.processor.group);
    let intake = jobfold_tests::harness::Service::start("jobfold-test-processor", &env);
    let histogram = |suffix: &'static str| {
        let intake = &intake;
        async move {
            let text = intake.scrape().await?;
            jobfold_tests::harness::metric_value(
                &text,
                &format!("jobfold_transaction_jobs_{suffix}"),
                &[("transaction", "intake")],
            )
        }
    };
    eventually(Duration::from_secs(60), "the intake to accept all 500 requests", || async {
        histogram("sum").await == Some(500.0)
    })
    .await;
    let transactions = histogram("count").await.unwrap();
    assert!(transactions < 500.0, "{transactions} transactions for 500 requests");
    assert_eq!(it.count("jobs").await, 500);
    // A document's versions were accepted in the order they were produced.
    let out_of_order: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT input_version, lag(input_version) OVER \
         (PARTITION BY document_id ORDER BY job_id) AS before FROM jobs) v \
         WHERE before >= input_version",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(out_of_order, 0);
    println!("500 requests in {transactions} intake transactions");
    it.cleanup().await;
}

/// Killed after a batch's transaction committed and before its offsets were stored, the
/// intake reads those requests again after the restart; their request ids make them
/// duplicates, not second jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_a_batch_commit_and_its_offsets_the_requests_read_again_make_no_second_job()
{
    let it = Installation::new("intakecrash").await;
    it.create_topics().await;
    let requests: Vec<JobRequest> =
        (0..300).map(|i| request(&format!("doc-{}", i % 30), 1 + i / 30)).collect();
    produce(&it, &requests).await;
    let mut env = it.fast_env(&it.config.processor.group);
    env.insert(
        "JOBFOLD_FAILPOINT".into(),
        jobfold_common::failpoint::INTAKE_AFTER_COMMIT_BEFORE_OFFSET.into(),
    );
    let mut crashing = jobfold_tests::harness::Service::start("jobfold-test-processor", &env);
    let status = crashing
        .wait_exit(Duration::from_secs(60))
        .expect("the intake should abort after its first batch");
    assert!(!status.success(), "{}", crashing.log_text());
    let accepted = it.count("jobs").await;
    assert!(accepted >= 1, "the first batch committed nothing");
    assert_eq!(
        committed_total(
            &it.config.intake.group,
            &it.config.topics.requests,
            it.config.topics.partitions
        ),
        0,
        "no offset was committed before the abort"
    );

    env.remove("JOBFOLD_FAILPOINT");
    let survivor = jobfold_tests::harness::Service::start("jobfold-test-processor", &env);
    eventually(Duration::from_secs(60), "the survivor to skip the requests read again", || async {
        survivor.metric("jobfold_intake_duplicates_total").await.unwrap_or(0.0) >= accepted as f64
    })
    .await;
    eventually(Duration::from_secs(60), "every request to be accepted", || async {
        it.count("jobs").await == 300
    })
    .await;
    let keys: i64 = sqlx::query_scalar("SELECT count(DISTINCT idempotency_key) FROM jobs")
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert_eq!(keys, 300);
    assert_eq!(
        survivor.metric("jobfold_intake_duplicates_total").await,
        Some(accepted as f64),
        "exactly the committed batch was read again"
    );
    println!("the first batch accepted {accepted} requests before the abort");
    it.cleanup().await;
}
