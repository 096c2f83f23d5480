//! The relay: every committed event on Kafka at least once, in per-document order, never
//! before its time — across crashes between produce and mark, and with a standby relay.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::Utc;
use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_common::failpoint;
use jobfold_tests::harness::{
    Installation, Published, Service, events_on_topic, eventually, read_events,
};
use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn job(document: &str, version: i64) -> NewJob {
    NewJob {
        document_id: document.into(),
        kind: "index-document".into(),
        input_version: version,
        input: json!({ "text": "some words" }),
        idempotency_key: None,
        trace: None,
        run_at: None,
    }
}

/// Accepts `n` jobs over `documents` documents; returns their event ids.
async fn accept_many(
    it: &Installation,
    acceptor: &Acceptor,
    n: usize,
    documents: usize,
) -> HashSet<Uuid> {
    let mut ids = HashSet::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let jobs: Vec<NewJob> = chunk
            .iter()
            .map(|i| job(&format!("doc-{}", i % documents), 1 + (*i / documents) as i64))
            .collect();
        for accepted in acceptor.accept_batch(&it.pool, &jobs).await.unwrap() {
            ids.insert(accepted.job_id);
        }
    }
    ids
}

fn job_ids(events: &[Published]) -> HashSet<Uuid> {
    events.iter().map(|p| p.event.job_id).collect()
}

async fn unpublished(it: &Installation) -> i64 {
    it.unpublished().await
}

/// Sends the job's event through the outbox, due at `due` (as a scheduled retry's RetryDue
/// is) instead of from the log at commit; returns the due time.
async fn delay(
    tx: &mut sqlx::PgConnection,
    it: &Installation,
    job_id: Uuid,
    due: &str,
) -> chrono::DateTime<Utc> {
    sqlx::query_scalar(
        "WITH e AS (UPDATE job_events SET delayed = true WHERE job_id = $1 RETURNING seq, key) \
         INSERT INTO outbox (seq, topic, key, available_at) \
         SELECT seq, $2, key, now() + $3::interval FROM e RETURNING available_at",
    )
    .bind(job_id)
    .bind(&it.config.topics.events)
    .bind(due)
    .fetch_one(tx)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_produce_and_mark_repeats_events_but_loses_none() {
    const JOBS: usize = 2_000;
    let it = Installation::new("relaycrash").await;
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let jobs = accept_many(&it, &acceptor, JOBS, 200).await;

    // The relay aborts (like kill -9) after producing its second batch, before marking it.
    let mut env = it.env();
    env.insert("JOBFOLD_RELAY__BATCH_SIZE".into(), "500".into());
    env.insert(
        "JOBFOLD_FAILPOINT".into(),
        format!("{}@2", failpoint::RELAY_AFTER_PRODUCE_BEFORE_MARK),
    );
    let mut crashing = Service::start("jobfold-relay", &env);
    let status = crashing.wait_exit(Duration::from_secs(60)).expect("the relay should abort");
    assert!(!status.success(), "the failpoint did not abort the relay:\n{}", crashing.log_text());
    assert_eq!(unpublished(&it).await, (JOBS - 500) as i64, "exactly the first batch is marked");

    // A new relay publishes the rest, starting again with the unmarked batch.
    env.remove("JOBFOLD_FAILPOINT");
    let _relay = Service::start("jobfold-relay", &env);
    eventually(Duration::from_secs(60), "the log to be published", || async {
        unpublished(&it).await == 0
    })
    .await;

    let on_topic = events_on_topic(&it) as usize;
    let events = read_events(&it, Duration::from_secs(60), |seen| seen.len() >= on_topic).await;
    assert_eq!(job_ids(&events), jobs, "every accepted job's event is on the topic");
    let mut copies: HashMap<Uuid, usize> = HashMap::new();
    for p in &events {
        *copies.entry(p.event.event_id).or_default() += 1;
    }
    // The batch produced but not recorded is published again, and so is (some of) what the
    // pipeline had already sent behind it; nothing else.
    let duplicated = copies.values().filter(|&&n| n > 1).count();
    let at_most = (500 * jobfold_relay::LOG_BATCHES_IN_FLIGHT).min(JOBS - 500);
    assert!((500..=at_most).contains(&duplicated), "{duplicated} events duplicated");
    assert!(copies.values().all(|&n| n <= 2));
    println!("events on the topic: {}, duplicated by the crash: {duplicated}", events.len());
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_relay_takes_over_when_the_active_one_is_killed() {
    let it = Installation::new("relayfailover").await;
    it.create_topics().await;
    let acceptor = it.acceptor().await;

    let mut first = Service::start("jobfold-relay", &it.env());
    eventually(Duration::from_secs(30), "the first relay to become active", || async {
        first.metric("jobfold_relay_active").await == Some(1.0)
    })
    .await;
    let second = Service::start("jobfold-relay", &it.env());
    eventually(Duration::from_secs(30), "the second relay to stand by", || async {
        second.metric("jobfold_relay_active").await == Some(0.0)
    })
    .await;

    let before = accept_many(&it, &acceptor, 300, 30).await;
    eventually(Duration::from_secs(30), "the active relay to publish", || async {
        unpublished(&it).await == 0
    })
    .await;
    assert_eq!(first.metric("jobfold_relay_published_total").await, Some(300.0));
    assert_eq!(
        second.metric("jobfold_relay_published_total").await.unwrap_or(0.0),
        0.0,
        "the standby published"
    );

    first.kill9();
    let killed_at = std::time::Instant::now();
    eventually(Duration::from_secs(30), "the standby to take over", || async {
        second.metric("jobfold_relay_active").await == Some(1.0)
    })
    .await;
    println!("standby active {:?} after kill -9", killed_at.elapsed());
    assert!(
        killed_at.elapsed() < Duration::from_secs(10),
        "takeover took {:?}",
        killed_at.elapsed()
    );

    let after = accept_many(&it, &acceptor, 300, 30).await;
    eventually(Duration::from_secs(30), "the new active relay to publish", || async {
        unpublished(&it).await == 0
    })
    .await;
    let events = read_events(&it, Duration::from_secs(60), |seen| job_ids(seen).len() >= 600).await;
    let all: HashSet<Uuid> = before.union(&after).copied().collect();
    assert_eq!(job_ids(&events), all);
    assert!(second.metric("jobfold_relay_published_total").await.unwrap_or(0.0) >= 300.0);
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_documents_times_twenty_versions_stay_in_order() {
    const DOCUMENTS: usize = 200;
    const VERSIONS: i64 = 20;
    let it = Installation::new("relayorder").await;
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let mut config = it.config.clone();
    // Small batches, so one document's versions cross many batches.
    config.relay.batch_size = 97;
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(config, shutdown.clone()));

    // Eight writers at once, each owning 25 documents and accepting their versions in order,
    // while the relay publishes.
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let acceptor = acceptor.clone();
            let pool = it.pool.clone();
            tokio::spawn(async move {
                for version in 1..=VERSIONS {
                    for d in (w..DOCUMENTS).step_by(8) {
                        acceptor.accept(&pool, &job(&format!("doc-{d}"), version)).await.unwrap();
                    }
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }

    let total = DOCUMENTS * VERSIONS as usize;
    let events = read_events(&it, Duration::from_secs(120), |seen| seen.len() >= total).await;
    assert_eq!(events.len(), total);
    let mut last: HashMap<&str, (i64, i32)> = HashMap::new();
    for p in &events {
        assert_eq!(p.key, p.event.document_id, "keyed by document");
        if let Some((version, partition)) = last.get(p.key.as_str()) {
            assert!(
                p.event.input_version > *version,
                "{}: version {} after {version}",
                p.key,
                p.event.input_version
            );
            assert_eq!(p.partition, *partition, "{} moved partitions", p.key);
        }
        last.insert(&p.key, (p.event.input_version, p.partition));
    }
    assert_eq!(last.len(), DOCUMENTS);
    assert!(last.values().all(|(v, _)| *v == VERSIONS));
    shutdown.cancel();
    relay.await.unwrap().unwrap();
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_event_is_not_published_before_its_time() {
    let it = Installation::new("relaydelay").await;
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()));

    // A row due in three seconds, as a scheduled retry's RetryDue is.
    let mut tx = it.pool.begin().await.unwrap();
    let delayed = acceptor.accept_in(&mut tx, &job("doc-delayed", 1)).await.unwrap();
    let due = delay(&mut tx, &it, delayed.job_id, "3 seconds").await;
    tx.commit().await.unwrap();
    let now = acceptor.accept(&it.pool, &job("doc-now", 1)).await.unwrap();

    let events = read_events(&it, Duration::from_secs(30), |seen| job_ids(seen).len() == 2).await;
    let arrival = |id: Uuid| {
        events.iter().find(|p| p.event.job_id == id).and_then(|p| p.timestamp_ms).unwrap()
    };
    assert!(
        arrival(delayed.job_id) >= due.timestamp_millis(),
        "published {} ms before it was due",
        due.timestamp_millis() - arrival(delayed.job_id)
    );
    assert!(
        arrival(now.job_id) < due.timestamp_millis(),
        "an immediate row waited for a delayed one"
    );
    // ... and not long after: the relay sleeps until the next due row, not a fixed poll.
    assert!(arrival(delayed.job_id) - due.timestamp_millis() < 1_500);
    shutdown.cancel();
    relay.await.unwrap().unwrap();
    it.cleanup().await;
}

#[tokio::test]
async fn invalid_configuration_exits_2_naming_the_key() {
    let it = Installation::new("relayconfig").await;
    let mut env = it.env();
    env.insert("JOBFOLD_RELAY__BATCH_SIZE".into(), "0".into());
    let mut relay = Service::start("jobfold-relay", &env);
    let status = relay.wait_exit(Duration::from_secs(30)).expect("the relay should exit");
    assert_eq!(status.code(), Some(2));
    assert!(relay.log_text().contains("relay.batch_size"), "{}", relay.log_text());

    env.insert("JOBFOLD_RELAY__BATCH_SIZE".into(), "many".into());
    let mut relay = Service::start("jobfold-relay", &env);
    assert_eq!(relay.wait_exit(Duration::from_secs(30)).unwrap().code(), Some(2));
    assert!(relay.log_text().contains("batch_size"), "{}", relay.log_text());
    env.remove("JOBFOLD_RELAY__BATCH_SIZE");

    // A misspelt variable is refused, naming the nearest key, not silently ignored.
    let mut misspelt = env.clone();
    misspelt.insert("JOBFOLD_DATABSE_URL".into(), "postgres://x@127.0.0.1/x".into());
    let mut relay = Service::start("jobfold-relay", &misspelt);
    assert_eq!(relay.wait_exit(Duration::from_secs(30)).unwrap().code(), Some(2));
    let log = relay.log_text();
    assert!(log.contains("JOBFOLD_DATABSE_URL") && log.contains("JOBFOLD_DATABASE_URL"), "{log}");

    // An option librdkafka does not know, or a value it does not take: exit 2 naming it.
    for (option, value, named) in [
        ("JOBFOLD_KAFKA__LINGER_MSS", "5", "linger.mss"),
        ("JOBFOLD_KAFKA__LINGER_MS", "soon", "linger.ms"),
    ] {
        let mut bad = env.clone();
        bad.insert(option.into(), value.into());
        let mut relay = Service::start("jobfold-relay", &bad);
        assert_eq!(relay.wait_exit(Duration::from_secs(30)).unwrap().code(), Some(2));
        let log = relay.log_text();
        assert!(log.contains(named) && log.contains(option), "{log}");
    }

    // Limits under which an accepted job could make an event the topic refuses: exit 2,
    // naming both settings.
    let mut large = env.clone();
    large.insert("JOBFOLD_PROCESSOR__MAX_OUTPUT_BYTES".into(), "2000000".into());
    for binary in ["jobfold-relay", "jobfold-processor"] {
        let mut service = Service::start(binary, &large);
        assert_eq!(service.wait_exit(Duration::from_secs(60)).unwrap().code(), Some(2));
        let log = service.log_text();
        assert!(
            log.contains("processor.max_output_bytes") && log.contains("max.message.bytes"),
            "{binary}: {log}"
        );
    }

    // Topics less durable than configured (a one-replica topic where three are asked for,
    // a topic that lets a replica that fell behind lead): exit 2, naming what differs.
    let mut replicated = env.clone();
    replicated.insert("JOBFOLD_TOPICS__REPLICATION_FACTOR".into(), "3".into());
    replicated.insert("JOBFOLD_TOPICS__MIN_INSYNC_REPLICAS".into(), "2".into());
    for binary in ["jobfold-relay", "jobfold-processor"] {
        let mut service = Service::start(binary, &replicated);
        assert_eq!(service.wait_exit(Duration::from_secs(60)).unwrap().code(), Some(2));
        let log = service.log_text();
        assert!(
            log.contains("topics.replication_factor") && log.contains("1 replica(s)"),
            "{binary}: {log}"
        );
    }
    let admin: AdminClient<DefaultClientContext> = it.config.kafka_client().create().unwrap();
    let unclean = AlterConfig::new(ResourceSpecifier::Topic(&it.config.topics.requests))
        .set("unclean.leader.election.enable", "true");
    let altered = admin.alter_configs(&[unclean], &AdminOptions::new()).await.unwrap();
    assert!(altered.iter().all(Result::is_ok), "{altered:?}");
    let mut relay = Service::start("jobfold-relay", &env);
    assert_eq!(relay.wait_exit(Duration::from_secs(60)).unwrap().code(), Some(2));
    let log = relay.log_text();
    assert!(
        log.contains(&format!("{}'s unclean.leader.election.enable", it.config.topics.requests)),
        "{log}"
    );
    it.cleanup().await;
}

/// The librdkafka options the guarantee rests on cannot be switched off, and options
/// librdkafka refuses together are named both: each exits 2 at start, before anything
/// listens, naming the key and why.
#[tokio::test]
async fn the_guarantees_kafka_settings_are_fixed_and_checked_together() {
    let it = Installation::new("relayfixed").await;
    let env = it.env();
    for (binary, option, value, named) in [
        (
            "jobfold-processor",
            "JOBFOLD_KAFKA__ENABLE_AUTO_OFFSET_STORE",
            "true",
            "enable.auto.offset.store",
        ),
        ("jobfold-processor", "JOBFOLD_KAFKA__ENABLE_AUTO_COMMIT", "false", "enable.auto.commit"),
        (
            "jobfold-processor",
            "JOBFOLD_KAFKA__ISOLATION_LEVEL",
            "read_uncommitted",
            "isolation.level",
        ),
        ("jobfold-relay", "JOBFOLD_KAFKA__ENABLE_IDEMPOTENCE", "false", "enable.idempotence"),
        ("jobfold-relay", "JOBFOLD_KAFKA__ACKS", "1", "acks"),
        (
            "jobfold-relay",
            "JOBFOLD_KAFKA__ENABLE_GAPLESS_GUARANTEE",
            "false",
            "enable.gapless.guarantee",
        ),
    ] {
        let mut bad = env.clone();
        bad.insert(option.into(), value.into());
        let mut service = Service::start(binary, &bad);
        assert_eq!(service.wait_exit(Duration::from_secs(30)).unwrap().code(), Some(2), "{option}");
        let log = service.log_text();
        assert!(
            log.contains(&format!("kafka.{named}"))
                && log.contains(option)
                && log.contains("is fixed at"),
            "{binary} {option}: {log}"
        );
    }
    // librdkafka's rules across options: both keys named, nothing started.
    let mut bad = env.clone();
    bad.insert("JOBFOLD_KAFKA__MESSAGE_MAX_BYTES".into(), "4000000".into());
    bad.insert("JOBFOLD_KAFKA__FETCH_MAX_BYTES".into(), "1048576".into());
    let mut processor = Service::start("jobfold-processor", &bad);
    assert_eq!(processor.wait_exit(Duration::from_secs(30)).unwrap().code(), Some(2));
    let log = processor.log_text();
    assert!(
        log.contains("JOBFOLD_KAFKA__FETCH_MAX_BYTES")
            && log.contains("JOBFOLD_KAFKA__MESSAGE_MAX_BYTES")
            && !log.contains("Starting the processor"),
        "{log}"
    );
    it.cleanup().await;
}

/// The event limit check names the setting that binds, and following its advice works: with
/// the events topic at 4 MiB, a 1.5 MB output limit is refused naming the producer's
/// `message.max.bytes`; raising that as the message says, the processor and the relay run.
#[tokio::test]
async fn the_event_limit_advice_works_when_followed() {
    let it = Installation::new("relayadvice").await;
    let mut topics = jobfold_common::kafka::jobfold_topics(&it.config);
    topics[0].config.push(("max.message.bytes", (4 * 1024 * 1024).to_string()));
    jobfold_common::kafka::ensure_topics(&it.config, &topics).await.unwrap();
    let mut env = it.fast_env(&jobfold_tests::kafka::unique_name("advice"));
    env.insert("JOBFOLD_PROCESSOR__MAX_OUTPUT_BYTES".into(), "1500000".into());
    let mut processor = Service::start("jobfold-processor", &env);
    assert_eq!(processor.wait_exit(Duration::from_secs(60)).unwrap().code(), Some(2));
    let log = processor.log_text();
    assert!(
        log.contains("kafka.message.max.bytes (1000000)")
            && log.contains("raise kafka.message.max.bytes (JOBFOLD_KAFKA__MESSAGE_MAX_BYTES)")
            && !log.contains("raise topic"),
        "{log}"
    );
    env.insert("JOBFOLD_KAFKA__MESSAGE_MAX_BYTES".into(), "4000000".into());
    let mut processor = Service::start("jobfold-processor", &env);
    let mut relay = Service::start("jobfold-relay", &env);
    eventually(
        Duration::from_secs(60),
        "the processor running jobs and the relay relaying",
        || async {
            processor.log_text().contains("Running jobs.")
                && relay.log_text().contains("Starting the relay")
        },
    )
    .await;
    assert!(processor.wait_exit(Duration::ZERO).is_none(), "{}", processor.log_text());
    assert!(relay.wait_exit(Duration::ZERO).is_none(), "{}", relay.log_text());
    processor.kill9();
    relay.kill9();
    it.cleanup().await;
}

/// An unreachable database or broker is reported with its address, the broker's within
/// seconds (the binary goes on trying for a while, as for a broker still starting).
#[tokio::test]
async fn an_unreachable_database_or_broker_is_named() {
    let it = Installation::new("relayunreach").await;
    let port = jobfold_tests::harness::free_port();
    let mut env = it.env();
    env.insert(
        "JOBFOLD_DATABASE_URL".into(),
        format!("postgres://jobfold:secret@127.0.0.1:{port}/jobfold"),
    );
    let mut relay = Service::start("jobfold-relay", &env);
    assert_eq!(relay.wait_exit(Duration::from_secs(30)).unwrap().code(), Some(1));
    let log = relay.log_text();
    assert!(log.contains(&format!("127.0.0.1:{port}/jobfold")), "{log}");
    assert!(!log.contains("secret"), "the password is not shown: {log}");

    let mut env = it.env();
    env.insert("JOBFOLD_KAFKA_BROKERS".into(), format!("127.0.0.1:{port}"));
    let mut relay = Service::start("jobfold-relay", &env);
    eventually(Duration::from_secs(20), "the unreachable broker named in the log", || async {
        relay.log_text().contains(&format!("Kafka does not answer at 127.0.0.1:{port}"))
    })
    .await;
    relay.kill9();
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_rows_are_pruned_after_the_retention_and_the_log_stays() {
    for (prune_after, name) in
        [(Duration::from_secs(1), "relayprune"), (Duration::ZERO, "relaydelete")]
    {
        let it = Installation::new(name).await;
        it.create_topics().await;
        let acceptor = it.acceptor().await;
        let mut config = it.config.clone();
        config.relay.prune_after = prune_after;
        config.relay.prune_interval = Duration::from_millis(200);
        // Accepted events go out from the log; these go through the outbox, as delayed ones.
        let jobs = accept_many(&it, &acceptor, 200, 20).await;
        for job_id in &jobs {
            let mut conn = it.pool.acquire().await.unwrap();
            delay(&mut conn, &it, *job_id, "0 seconds").await;
        }
        let shutdown = CancellationToken::new();
        let relay = tokio::spawn(jobfold_relay::run(config, shutdown.clone()));

        let events =
            read_events(&it, Duration::from_secs(30), |seen| job_ids(seen).len() == 200).await;
        assert_eq!(job_ids(&events), jobs);
        eventually(Duration::from_secs(30), "the outbox to be pruned", || async {
            it.count("outbox").await == 0
        })
        .await;
        assert_eq!(it.count("job_events").await, 200, "the event log is kept");
        shutdown.cancel();
        relay.await.unwrap().unwrap();
        it.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_marks_every_row_it_published() {
    let it = Installation::new("relaystop").await;
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    accept_many(&it, &acceptor, 20_000, 500).await;
    let mut config = it.config.clone();
    // Small batches: the backlog takes long enough to stop in the middle of it.
    config.relay.batch_size = 100;
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(config, shutdown.clone()));
    eventually(Duration::from_secs(30), "the relay to start publishing", || async {
        unpublished(&it).await < 20_000
    })
    .await;
    // Stop mid-backlog: the batches in flight are delivered and marked, then it exits.
    shutdown.cancel();
    relay.await.unwrap().unwrap();
    let marked = 20_000 - unpublished(&it).await;
    assert!(marked < 20_000, "the stop came too late to test anything");
    assert_eq!(events_on_topic(&it), marked, "every published row is marked, and only those");
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_that_commits_after_later_ones_is_published_too() {
    let it = Installation::new("relaylate").await;
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()));
    let before = acceptor.accept(&it.pool, &job("doc-before", 1)).await.unwrap();
    eventually(Duration::from_secs(30), "the first event published", || async {
        events_on_topic(&it) == 1
    })
    .await;

    // `slow` writes its event first (lower seq and xid) but commits after `fast`'s commit
    // and after the relay has read past `fast`'s place in the log: a cursor following seq
    // alone would skip it forever.
    let mut slow_tx = it.pool.begin().await.unwrap();
    let slow = acceptor.accept_in(&mut slow_tx, &job("doc-slow", 1)).await.unwrap();
    let fast = acceptor.accept(&it.pool, &job("doc-fast", 1)).await.unwrap();
    // A pass of the relay after `fast` committed: the first event, rewound over, is
    // published again.
    it.republish_last(1).await;
    eventually(Duration::from_secs(30), "the first event published again", || async {
        events_on_topic(&it) == 2
    })
    .await;
    // While `slow` is open, `fast` waits: it may not pass a transaction that could still
    // commit before it in the log.
    let seen = read_events(&it, Duration::from_secs(30), |seen| seen.len() == 2).await;
    assert_eq!(job_ids(&seen), HashSet::from([before.job_id]), "published past an open one");
    slow_tx.commit().await.unwrap();

    let events = read_events(&it, Duration::from_secs(30), |seen| job_ids(seen).len() == 3).await;
    assert_eq!(job_ids(&events), HashSet::from([before.job_id, slow.job_id, fast.job_id]));
    eventually(Duration::from_secs(10), "the cursor to pass both", || async {
        it.unpublished().await == 0
    })
    .await;
    shutdown.cancel();
    relay.await.unwrap().unwrap();
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_event_does_not_overtake_its_jobs_delayed_one() {
    use jobfold_processor::store;
    use jobfold_schemas::Payload;
    use jobfold_schemas::event::{DispatchReason, RetryDue};

    let it = Installation::new("relayovertake").await;
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let events = it.events().await;
    let accepted = acceptor.accept(&it.pool, &job("doc-overtake", 1)).await.unwrap();
    let retry_due =
        |due_at| Payload::RetryDue(RetryDue { due_at, reason: DispatchReason::Backoff });

    // The job's scheduled retry waits in the outbox for an hour...
    let due_at = Utc::now() + chrono::Duration::hours(1);
    let mut tx = it.pool.begin().await.unwrap();
    let mut waiting = store::lock_job(&mut tx, accepted.job_id).await.unwrap().unwrap();
    events.append(&mut tx, &mut waiting, retry_due(due_at), Some(due_at), None).await.unwrap();
    tx.commit().await.unwrap();
    // ... when the job is quarantined (by a lease transaction finding its budget spent).
    let mut tx = it.pool.begin().await.unwrap();
    let mut job_row = store::lock_job(&mut tx, accepted.job_id).await.unwrap().unwrap();
    let class = jobfold_schemas::event::ErrorClass::Retryable;
    store::quarantine(&mut tx, &events, &mut job_row, class, "budget spent", "ops", None)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()));
    let published = read_events(&it, Duration::from_secs(30), |seen| seen.len() >= 3).await;
    let kinds: Vec<(i32, &str)> =
        published.iter().map(|p| (p.event.stream_version, p.event.payload.kind())).collect();
    assert_eq!(
        kinds,
        [(1, "JobRequested"), (2, "RetryDue"), (3, "JobQuarantined")],
        "the job's events reached Kafka out of stream order (or the delayed one is still held)"
    );
    eventually(Duration::from_secs(10), "the outbox to drain", || async {
        it.unpublished().await == 0
    })
    .await;

    // Nothing of the job waits any more: its next event (a newer version superseding it)
    // goes straight from the log.
    let mut tx = it.pool.begin().await.unwrap();
    let mut job_row = store::lock_job(&mut tx, accepted.job_id).await.unwrap().unwrap();
    store::supersede(&mut tx, &events, &mut job_row, 2, None).await.unwrap();
    tx.commit().await.unwrap();
    let delayed: Vec<bool> = sqlx::query_scalar(
        "SELECT delayed FROM job_events WHERE job_id = $1 ORDER BY stream_version",
    )
    .bind(accepted.job_id)
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert_eq!(delayed, [false, true, true, false]);
    let published = read_events(&it, Duration::from_secs(30), |seen| seen.len() >= 4).await;
    assert_eq!(published.len(), 4);
    assert_eq!(published[3].event.stream_version, 4);

    shutdown.cancel();
    relay.await.unwrap().unwrap();
    it.cleanup().await;
}

/// Each delivery report reaches its own event: in one batch, an event the broker refuses
/// (larger than its topic allows) and one librdkafka refuses to enqueue are refused by their
/// own seqs (to be parked), a later event of the refused document waits behind it unsent,
/// and the rest are delivered — and on the topic. An event over the relay's own limit is
/// refused before it is sent.
#[tokio::test]
async fn every_delivery_report_reaches_its_own_event() {
    use jobfold_relay::publish::{self, Event};
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::{Message, Offset, TopicPartitionList};

    let mut it = Installation::new("reports").await;
    let (open, strict) = (&it.config.topics.events, &it.config.topics.requests);
    let topics = [
        jobfold_common::kafka::TopicSpec {
            name: open,
            partitions: 1,
            replication_factor: 1,
            config: vec![],
        },
        jobfold_common::kafka::TopicSpec {
            name: strict,
            partitions: 1,
            replication_factor: 1,
            config: vec![("max.message.bytes", "4096".to_owned())],
        },
    ];
    jobfold_common::kafka::ensure_topics(&it.config, &topics).await.unwrap();
    // Without the gapless guarantee a refused batch fails alone instead of stopping the
    // producer: this test is about which event each report reaches.
    it.config.kafka.0.insert("enable.gapless.guarantee".into(), "false".into());
    let producer = publish::producer(&it.config).unwrap();

    // Random bytes do not compress: the broker sees more than the topic's 4 KiB.
    let refused_by_broker: Vec<u8> = (0..16 * 1024).map(|_| rand::random::<u8>()).collect();
    let too_large_to_enqueue = vec![0u8; 2 * 1024 * 1024];
    let event = |seq, topic, key, body| Event {
        seq,
        topic,
        key,
        body,
        available_at: Utc::now(),
        traceparent: None,
        tracestate: None,
        kind: "JobRequested",
    };
    let (open, strict) = (it.config.topics.events.as_str(), it.config.topics.requests.as_str());
    let events = [
        event(10, open, "doc-a", b"first".as_slice()),
        event(20, strict, "doc-b", &refused_by_broker),
        event(30, open, "doc-c", b"third".as_slice()),
        event(40, open, "doc-d", &too_large_to_enqueue),
        event(50, open, "doc-d", b"after the refused one".as_slice()),
        event(60, open, "doc-e", b"sixth".as_slice()),
    ];
    let mut blocked = publish::Blocked::default();
    let outcome = tokio::time::timeout(
        Duration::from_secs(60),
        publish::send(&producer, &events, &mut blocked, usize::MAX).await.delivered(&producer),
    )
    .await
    .expect("every report arrives");

    let delivered: Vec<i64> = outcome.delivered.iter().map(|(seq, _)| *seq).collect();
    let refused: Vec<i64> = outcome.refused.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(delivered, [10, 30, 60]);
    assert_eq!(refused, [40], "refused before it was sent");
    // Refused by the broker after it was sent: reported as such, for the relay to judge
    // (sent again once the topic's limit is read anew, parked if refused again).
    let by_broker: Vec<i64> = outcome.refused_by_broker.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(by_broker, [20]);
    assert_eq!(outcome.waiting, [50]);
    assert!(outcome.failed.is_empty() && outcome.held_back.is_empty(), "{outcome:?}");
    assert_eq!(outcome.undelivered(), HashSet::from([20]), "the cursor does not pass it yet");
    assert!(blocked.parked.contains("doc-d"));
    let parking: Vec<(i64, bool)> =
        jobfold_relay::parked::parking(&outcome).iter().map(|p| (p.seq, p.refused)).collect();
    assert_eq!(parking, [(40, true), (50, false)]);

    // Over the relay's limit: refused before it is sent, and its document's next event waits.
    let mut blocked = publish::Blocked::default();
    let big = vec![7u8; 8 * 1024];
    let checked = [
        event(70, open, "doc-f", &big),
        event(80, open, "doc-f", b"small".as_slice()),
        event(90, open, "doc-g", b"small".as_slice()),
    ];
    let outcome =
        publish::send(&producer, &checked, &mut blocked, 4096).await.delivered(&producer).await;
    let delivered: Vec<i64> = outcome.delivered.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(delivered, [90]);
    assert_eq!(outcome.refused.len(), 1);
    assert_eq!(outcome.refused[0].0, 70);
    assert!(outcome.refused[0].1.contains("more than the 4096"), "{:?}", outcome.refused);
    assert_eq!(outcome.waiting, [80]);

    // What was reported delivered is on the topic, and nothing else.
    let consumer: BaseConsumer =
        it.config.kafka_client_with(&[("group.id", "reports")]).create().unwrap();
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(open, 0, Offset::Beginning).unwrap();
    consumer.assign(&assignment).unwrap();
    let (_, high) = consumer.fetch_watermarks(open, 0, Duration::from_secs(10)).unwrap();
    let mut keys = Vec::new();
    while keys.len() < usize::try_from(high).unwrap() {
        if let Some(message) = consumer.poll(Duration::from_secs(10)) {
            let message = message.unwrap();
            keys.push(String::from_utf8(message.key().unwrap().to_vec()).unwrap());
        }
    }
    assert_eq!(keys, ["doc-a", "doc-c", "doc-e", "doc-g"]);
    it.cleanup().await;
}

/// The broker refusing an event while everything runs (the events topic's
/// `max.message.bytes` lowered under the relay, which read it at start) costs that event's
/// document alone: the relay survives the producer's fatal error, reads the limit anew and
/// parks the event as its own size check would; every other document's jobs, and their
/// retries, flow meanwhile; once the limit is raised, `jobfold parked retry` releases it
/// without a restart and its job runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_the_broker_refuses_while_running_is_parked_and_the_rest_flows() {
    use rand::Rng;
    let mut it = Installation::new("refusedlive").await;
    it.fast();
    it.config.accept.max_input_bytes = 300_000;
    // One partition: the refused event has the others' events in flight behind it.
    it.config.topics.partitions = 1;
    it.create_topics().await;
    let pipeline = jobfold_tests::harness::Pipeline::start(&it, true);
    let acceptor = it.acceptor().await;
    let succeeded = |ids: Vec<Uuid>| {
        let it = &it;
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM jobs WHERE job_id = ANY($1) AND state = 'succeeded'",
            )
            .bind(&ids)
            .fetch_one(&it.pool)
            .await
            .unwrap();
            n == ids.len() as i64
        }
    };
    let before = acceptor.accept(&it.pool, &job("doc-before", 1)).await.unwrap().job_id;
    eventually(Duration::from_secs(60), "a job before the change", || succeeded(vec![before]))
        .await;

    set_topic_limit(&it, 64 * 1024).await;
    // Random letters: lz4 cannot bring them under 64 KiB.
    let text: String =
        rand::rng().sample_iter(rand::distr::Alphanumeric).take(250_000).map(char::from).collect();
    let big = NewJob { input: json!({ "text": text }), ..job("doc-big", 1) };
    let mut around: Vec<NewJob> = (0..300).map(|i| job(&format!("doc-around-{i}"), 1)).collect();
    around.insert(150, big);
    let accepted = acceptor.accept_batch(&it.pool, &around).await.unwrap();
    let big = accepted[150].job_id;
    let around: Vec<Uuid> = accepted.iter().map(|a| a.job_id).filter(|id| *id != big).collect();
    let mut others = Vec::new();
    for i in 0..10 {
        let mut other = job(&format!("doc-after-{i}"), 1);
        if i % 2 == 0 {
            // Failing once: its retry goes out through the outbox at its due time.
            other.input = json!({ "text": "some words", "simulate": { "fail_attempts": 1 } });
        }
        others.push(acceptor.accept(&it.pool, &other).await.unwrap().job_id);
    }
    eventually(Duration::from_secs(90), "every other document's jobs and retries", || {
        let all: Vec<Uuid> = others.iter().chain(&around).copied().collect();
        succeeded(all)
    })
    .await;
    let retried: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE job_id = ANY($1) AND attempt = 2")
            .bind(&others)
            .fetch_one(&it.pool)
            .await
            .unwrap();
    assert_eq!(retried, 5, "the retries ran");
    eventually(Duration::from_secs(30), "the refused event parked", || async {
        parked_rows(&it).await.iter().any(|row| row.1)
    })
    .await;
    let rows = parked_rows(&it).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert!(rows[0].3.contains("65536"), "the limit as it is now: {rows:?}");
    assert_eq!(it.state_and_attempt(big).await, ("queued".to_owned(), 0));

    set_topic_limit(&it, 1024 * 1024).await;
    let output = jobfold_tests::harness::jobfold_cli()
        .env("JOBFOLD_DATABASE_URL", it.config.database_url.expose())
        .args(["parked", "retry", "--all"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    eventually(Duration::from_secs(60), "the released job run", || async {
        parked_rows(&it).await.is_empty() && succeeded(vec![big]).await
    })
    .await;
    pipeline.stop().await;
    assert_eq!(jobfold_tests::harness::fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

/// A fatal producer error gives the batches waiting on it up at once: the reports the
/// producer still owes may never come (here no broker listens and messages never time out),
/// so what it holds is purged, the batch takes what was reported and counts the rest as not
/// delivered, to be sent again by a new producer.
#[tokio::test]
async fn a_fatal_producer_error_gives_up_the_batches_waiting_on_it() {
    use jobfold_relay::publish::{self, Event};
    let it = Installation::new("fatal").await;
    let mut nowhere = it.config.clone();
    nowhere.kafka_brokers = format!("127.0.0.1:{}", jobfold_tests::harness::free_port());
    let producer = publish::producer(&nowhere).unwrap();
    let event = |seq, key| Event {
        seq,
        topic: "nowhere",
        key,
        body: b"an event".as_slice(),
        available_at: Utc::now(),
        traceparent: None,
        tracestate: None,
        kind: "JobRequested",
    };
    let events = [event(1, "doc-a"), event(2, "doc-b")];
    let sent =
        publish::send(&producer, &events, &mut publish::Blocked::default(), usize::MAX).await;
    // librdkafka's error callback, as it calls it on a fatal error.
    rdkafka::ClientContext::error(
        rdkafka::producer::Producer::context(&producer).as_ref(),
        rdkafka::error::KafkaError::Global(rdkafka::types::RDKafkaErrorCode::Fatal),
        "a fatal error for the test",
    );
    let outcome = tokio::time::timeout(Duration::from_secs(30), sent.delivered(&producer))
        .await
        .expect("the batch is given up, not waited on for ever");
    assert!(outcome.delivered.is_empty(), "{outcome:?}");
    let failed: Vec<i64> = outcome.failed.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(failed, [1, 2], "sent again by the next producer: {outcome:?}");
    it.cleanup().await;
}

/// Sets the events topic's `max.message.bytes`.
async fn set_topic_limit(it: &Installation, bytes: usize) {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = it.config.kafka_client().create().unwrap();
    let value = bytes.to_string();
    let change = AlterConfig::new(ResourceSpecifier::Topic(&it.config.topics.events))
        .set("max.message.bytes", &value);
    for result in admin.alter_configs(&[change], &AdminOptions::new()).await.unwrap() {
        result.unwrap();
    }
}

async fn parked_rows(it: &Installation) -> Vec<(i64, bool, i32, String)> {
    sqlx::query_as("SELECT seq, refused, attempts, reason FROM relay_parked ORDER BY seq")
        .fetch_all(&it.pool)
        .await
        .unwrap()
}

/// Events after the relay's log cursor (the parked ones are behind it).
async fn after_cursor(it: &Installation) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM job_events e, relay_cursor c \
         WHERE (e.xid, e.seq) > (c.published_xid, c.published_seq)",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap()
}

/// An event Kafka will not take (larger than its topic allows, written under an older,
/// larger input limit) is parked and the cursor moves on: every other document's events
/// reach the topic once, with no re-sends; the refused document's later events wait behind
/// it; a retry without a fix is refused again; the limit raised (no retry, no restart), the
/// relay follows it and sends them all, in order; a dropped event lets the events behind it
/// go; one parked under a lower limit goes out when the next relay becomes active.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_kafka_refuses_is_parked_and_every_other_document_flows() {
    use jobfold_relay::parked::{self, Selection};

    let mut it = Installation::new("parked").await;
    it.config.relay.limit_check_interval = Duration::from_secs(1);
    it.config.accept.max_input_bytes = 16 * 1024;
    it.config.processor.max_output_bytes = 16 * 1024;
    let topics = jobfold_common::kafka::jobfold_topics(&it.config);
    let mut topics: Vec<_> = topics.into_iter().collect();
    topics[0].config.push(("max.message.bytes", (64 * 1024).to_string()));
    jobfold_common::kafka::ensure_topics(&it.config, &topics).await.unwrap();

    let acceptor = it.acceptor().await;
    let mut generous_policy = it.config.accept_policy();
    generous_policy.max_input_bytes = 4 * 1024 * 1024;
    let codec = jobfold_schemas::Codec::<jobfold_schemas::JobEvent>::connect(
        it.registry(),
        &it.config.topics.events,
    )
    .await
    .unwrap();
    let generous = Acceptor::new(codec, generous_policy, "older-config");
    let large = |document: &str, version, bytes| NewJob {
        input: json!({ "text": "x".repeat(bytes) }),
        ..job(document, version)
    };
    generous.accept(&it.pool, &large("doc-big", 1, 100_000)).await.unwrap();
    acceptor.accept(&it.pool, &job("doc-big", 2)).await.unwrap();
    for i in 0..50 {
        acceptor.accept(&it.pool, &job(&format!("doc-{i}"), 1)).await.unwrap();
    }

    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()));
    eventually(Duration::from_secs(30), "the other documents published", || async {
        after_cursor(&it).await == 0 && events_on_topic(&it) == 50
    })
    .await;
    let rows = parked_rows(&it).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(rows[0].1 && rows[0].3.contains("more than the"), "refused: {rows:?}");
    assert!(!rows[1].1, "doc-big v2 waits behind it: {rows:?}");
    // Passes go on (poll and notifications) and nothing is sent again.
    acceptor.accept(&it.pool, &job("doc-big", 3)).await.unwrap();
    acceptor.accept(&it.pool, &job("doc-late", 1)).await.unwrap();
    eventually(Duration::from_secs(30), "doc-late published, doc-big v3 parked", || async {
        events_on_topic(&it) == 51 && parked_rows(&it).await.len() == 3
    })
    .await;
    // A later pass, which publishes one more document, sends nothing of them again.
    acceptor.accept(&it.pool, &job("doc-later", 1)).await.unwrap();
    eventually(Duration::from_secs(30), "doc-later published", || async {
        after_cursor(&it).await == 0 && events_on_topic(&it) >= 52
    })
    .await;
    assert_eq!(events_on_topic(&it), 52, "nothing was sent twice");
    assert_eq!(after_cursor(&it).await, 0, "the cursor moved past the parked events");

    // A retry without a fix is refused again; the document still waits.
    assert_eq!(parked::request_retry(&it.pool, &Selection::All).await.unwrap(), 1);
    eventually(Duration::from_secs(30), "the retry refused again", || async {
        let rows = parked_rows(&it).await;
        rows[0].2 == 2 && rows.len() == 3
    })
    .await;
    assert_eq!(events_on_topic(&it), 52);

    // Raise the topic's limit, and nothing else (no restart, no retry): the relay reads it
    // within relay.limit_check_interval and the document's three events go out, in order.
    set_topic_limit(&it, 1024 * 1024).await;
    eventually(Duration::from_secs(60), "the parked events released", || async {
        parked_rows(&it).await.is_empty() && events_on_topic(&it) == 55
    })
    .await;
    let seen = read_events(&it, Duration::from_secs(30), |seen| seen.len() >= 55).await;
    let big: Vec<i64> =
        seen.iter().filter(|p| p.key == "doc-big").map(|p| p.event.input_version).collect();
    assert_eq!(big, [1, 2, 3], "the document's events in their order");
    let ids: HashSet<Uuid> = seen.iter().map(|p| p.event.event_id).collect();
    assert_eq!(ids.len(), 55, "no event twice on the topic");

    // An event over the producer's limit (1 MB) is refused; dropping it lets the next go.
    generous.accept(&it.pool, &large("doc-drop", 1, 1_100_000)).await.unwrap();
    acceptor.accept(&it.pool, &job("doc-drop", 2)).await.unwrap();
    eventually(Duration::from_secs(30), "doc-drop parked", || async {
        parked_rows(&it).await.len() == 2
    })
    .await;
    let refused = parked_rows(&it).await[0].0;
    let listed = parked::list(&it.pool, 10).await.unwrap();
    assert_eq!(listed[0].seq, refused);
    assert_eq!(listed[0].event, "JobRequested");
    // What an operator sees and does: `jobfold parked list`, then `jobfold parked drop SEQ`.
    let cli = |args: &[&str]| {
        let output = jobfold_tests::harness::jobfold_cli()
            .env("JOBFOLD_DATABASE_URL", it.config.database_url.expose())
            .args(args)
            .output()
            .unwrap();
        assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    };
    let list = cli(&["parked", "list"]);
    assert!(
        list.contains("refused") && list.contains("doc-drop") && list.contains("waiting"),
        "{list}"
    );
    let dropped = cli(&["parked", "drop", &refused.to_string()]);
    assert!(dropped.contains("1 refused event(s) dropped"), "{dropped}");
    eventually(Duration::from_secs(30), "doc-drop v2 published", || async {
        parked_rows(&it).await.is_empty() && events_on_topic(&it) == 56
    })
    .await;
    shutdown.cancel();
    relay.await.unwrap().unwrap();

    // Parked by a relay that read a lower limit, then the limit raised while no relay runs:
    // the next relay to become active sends the event at once (its own reading finds the
    // limit it started with, so only its activation can release it; it looks again in an
    // hour).
    set_topic_limit(&it, 64 * 1024).await;
    let (stop_low, stop_high) = (CancellationToken::new(), CancellationToken::new());
    let low = tokio::spawn(jobfold_relay::run(it.config.clone(), stop_low.clone()));
    generous.accept(&it.pool, &large("doc-restart", 1, 100_000)).await.unwrap();
    eventually(Duration::from_secs(30), "doc-restart parked", || async {
        parked_rows(&it).await.len() == 1
    })
    .await;
    stop_low.cancel();
    low.await.unwrap().unwrap();
    set_topic_limit(&it, 1024 * 1024).await;
    let mut slow_to_look = it.config.clone();
    slow_to_look.relay.limit_check_interval = Duration::from_secs(3600);
    let high = tokio::spawn(jobfold_relay::run(slow_to_look, stop_high.clone()));
    eventually(
        Duration::from_secs(30),
        "doc-restart released by the next active relay",
        || async { parked_rows(&it).await.is_empty() && events_on_topic(&it) == 57 },
    )
    .await;
    stop_high.cancel();
    high.await.unwrap().unwrap();
    it.cleanup().await;
}

/// The relay names the transaction that holds publication back — here one left open in
/// another database of the same Postgres — and publishes again once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_open_in_another_database_is_named_and_waited_for() {
    let it = Installation::new("horizon").await;
    it.create_topics().await;
    let other = Installation::new("horizon-other").await;
    let acceptor = it.acceptor().await;

    // A transaction in the other database that took a transaction id, and stays open.
    let mut holder = other.pool.begin().await.unwrap();
    sqlx::query("CREATE TABLE held (x int)").execute(&mut *holder).await.unwrap();
    let pid: i32 =
        sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *holder).await.unwrap();
    acceptor.accept(&it.pool, &job("doc-1", 1)).await.unwrap();

    // Tests running beside this one open transactions of their own, some older than this
    // one; each ends, and then this one is the oldest.
    let named = std::sync::Mutex::new(None);
    eventually(Duration::from_secs(60), "the open transaction named", || async {
        let mut conn = it.pool.acquire().await.unwrap();
        let holder = jobfold_relay::horizon::holder(&mut conn).await.unwrap();
        let ours = holder.as_ref().is_some_and(|h| h.pid == Some(pid));
        *named.lock().unwrap() = holder;
        ours
    })
    .await;
    let named = named.into_inner().unwrap().expect("a holder");
    assert!(named.database.as_deref().unwrap().ends_with("_horizon_other"), "{named:?}");

    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()));
    // The relay sleeps only after a pass: one that found the event and could not read it.
    eventually(Duration::from_secs(30), "the relay to sleep", || sleeping(&it, None)).await;
    assert_eq!(events_on_topic(&it), 0, "held back below the open transaction");
    holder.rollback().await.unwrap();
    eventually(Duration::from_secs(30), "published once it ended", || async {
        events_on_topic(&it) == 1
    })
    .await;
    shutdown.cancel();
    relay.await.unwrap().unwrap();
    other.cleanup().await;
    it.cleanup().await;
}

/// Whether a relay holds `SLEEP_LOCK` (asleep: writers notify it) — with `since` (seconds
/// since the epoch), one whose connection has started a statement since then as well. With a
/// poll interval of an hour, an asleep relay's connection runs a statement only once woken,
/// and the first it runs gives the lock up: held again, it has woken, made a pass, and slept.
async fn sleeping(it: &Installation, since: Option<f64>) -> bool {
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
         WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND l.granted \
         AND l.classid = $1::int::oid AND l.objid = $2::int::oid \
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND ($3::float8 IS NULL OR extract(epoch FROM a.query_start) > $3)",
    )
    .bind(jobfold_relay::SLEEP_LOCK.0)
    .bind(jobfold_relay::SLEEP_LOCK.1)
    .bind(since)
    .fetch_one(&it.pool)
    .await
    .unwrap();
    held == 1
}

/// The first notification `listener` receives: `NOTIFY`s are delivered in commit order, so a
/// marker sent after a commit arrives first exactly when that commit sent none.
async fn first_notification_after(
    it: &Installation,
    listener: &mut sqlx::postgres::PgListener,
) -> String {
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(jobfold_relay::NOTIFY_CHANNEL)
        .execute(&it.pool)
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(30), listener.recv()).await;
    let first = first.expect("no notification at all").unwrap().payload().to_owned();
    // Whatever came before the marker is read, so the next call starts clean.
    if first != "marker" {
        while listener.recv().await.unwrap().payload() != "marker" {}
    }
    first
}

/// Takes the relay's sleep lock on `conn`, as a sleeping relay holds it.
async fn try_sleep_lock(conn: &mut sqlx::PgConnection) -> bool {
    let (k1, k2) = jobfold_relay::SLEEP_LOCK;
    sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
        .bind(k1)
        .bind(k2)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// A commit that writes events notifies only while the relay sleeps (holds the sleep lock):
/// a `NOTIFY` serializes the commits that send one, so an awake relay is not sent any.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_notifies_only_while_the_relay_sleeps() {
    let it = Installation::new("relaynotify").await;
    let acceptor = it.acceptor().await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&it.pool).await.unwrap();
    listener.listen(jobfold_relay::NOTIFY_CHANNEL).await.unwrap();

    // No one sleeps: the accept's commit sends nothing, the marker arrives first.
    acceptor.accept(&it.pool, &job("doc-awake", 1)).await.unwrap();
    assert_eq!(first_notification_after(&it, &mut listener).await, "marker");

    // A session sleeping as the relay does: the accept's commit notifies.
    let mut sleeper = it.pool.acquire().await.unwrap();
    let (k1, k2) = jobfold_relay::SLEEP_LOCK;
    assert!(try_sleep_lock(&mut sleeper).await);
    acceptor.accept(&it.pool, &job("doc-asleep", 1)).await.unwrap();
    assert_eq!(first_notification_after(&it, &mut listener).await, "");

    // A writer that saw the relay awake holds the lock shared until it commits: the relay
    // cannot go to sleep past a commit it has not read.
    sqlx::query("SELECT pg_advisory_unlock($1, $2)")
        .bind(k1)
        .bind(k2)
        .execute(&mut *sleeper)
        .await
        .unwrap();
    let mut writer = it.pool.begin().await.unwrap();
    acceptor.accept_in(&mut writer, &job("doc-open", 1)).await.unwrap();
    assert!(
        !try_sleep_lock(&mut sleeper).await,
        "the sleep lock was taken while a writer was open"
    );
    writer.commit().await.unwrap();
    drop(sleeper);
    it.cleanup().await;
}

/// With a poll interval far longer than the test, events still reach Kafka at once: awake
/// among writers (one is open as the relay starts, so it cannot go to sleep), the relay
/// polls; asleep, it is notified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_awake_finds_every_commit_and_asleep_is_woken() {
    let mut it = Installation::new("relaywake").await;
    it.config.relay.poll_interval = Duration::from_secs(3600);
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    // A writer open before the relay starts holds the sleep lock shared: its commit, and
    // the one made meanwhile, send no notification.
    let mut open = it.pool.begin().await.unwrap();
    acceptor.accept_in(&mut open, &job("doc-open", 1)).await.unwrap();
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()));
    acceptor.accept(&it.pool, &job("doc-meanwhile", 1)).await.unwrap();
    open.commit().await.unwrap();
    let mut expected = 2;
    eventually(Duration::from_secs(30), "the awake relay to publish", || async {
        events_on_topic(&it) == expected
    })
    .await;

    let asleep = || sleeping(&it, None);
    for round in 0..3 {
        eventually(Duration::from_secs(30), "the relay to sleep", asleep).await;
        acceptor.accept(&it.pool, &job(&format!("doc-{round}"), 1)).await.unwrap();
        expected += 1;
        eventually(Duration::from_secs(30), "the notified relay to publish", || async {
            events_on_topic(&it) == expected
        })
        .await;
    }

    // A transaction that writes no events but holds the horizon as the relay is woken (here
    // in this database; in any database of the cluster alike): the woken relay cannot read
    // the event yet, and the holder's end notifies nobody. The relay must not sleep past it.
    eventually(Duration::from_secs(30), "the relay to sleep", asleep).await;
    let mut holder = it.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()").execute(&mut *holder).await.unwrap();
    acceptor.accept(&it.pool, &job("doc-held", 1)).await.unwrap();
    let committed: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(&it.pool)
        .await
        .unwrap();
    // The notified relay wakes, finds nothing it may read, and takes the lock again.
    eventually(Duration::from_secs(30), "the woken relay to sleep again", || {
        sleeping(&it, Some(committed))
    })
    .await;
    assert_eq!(events_on_topic(&it), expected, "an event passed the horizon its holder held");
    holder.rollback().await.unwrap();
    expected += 1;
    eventually(Duration::from_secs(30), "the relay to publish once the horizon moved", || async {
        events_on_topic(&it) == expected
    })
    .await;
    shutdown.cancel();
    relay.await.unwrap().unwrap();
    it.cleanup().await;
}

/// jobfold's sessions run without JIT: the backlog gauge, estimated at a million rows, was
/// compiled on each reading (about 50 ms) whatever the backlog held. The cluster's own
/// setting stays on for other sessions.
#[tokio::test]
async fn jobfold_sessions_do_not_compile_statements() {
    let it = Installation::new("nojit").await;
    let jit: String = sqlx::query_scalar("SHOW jit").fetch_one(&it.pool).await.unwrap();
    assert_eq!(jit, "off", "a session from db::connect runs with JIT");
    let admin = sqlx::PgPool::connect(&jobfold_tests::services::database_url()).await.unwrap();
    let cluster: String = sqlx::query_scalar("SHOW jit").fetch_one(&admin).await.unwrap();
    assert_eq!(
        cluster, "on",
        "the test cluster runs Postgres's default; the check above means nothing otherwise"
    );
    admin.close().await;
    it.cleanup().await;
}

/// The relay reads the log's rows by position without a check per row; a statement whose
/// columns were reordered (two of one type swapped) is refused once a batch, not read into
/// the wrong fields.
#[tokio::test]
async fn a_log_read_with_its_columns_reordered_is_refused() {
    use jobfold_relay::log;
    let it = Installation::new("relaycolumns").await;
    it.acceptor().await.accept(&it.pool, &job("doc-columns", 1)).await.unwrap();
    let read = |sql: String| {
        let pool = it.pool.clone();
        async move {
            sqlx::query(&sql)
                .bind("0")
                .bind(0_i64)
                .bind(10_i64)
                .fetch_all(&pool)
                .await
                .unwrap()
                .remove(0)
        }
    };
    // Without the horizon: another test's open transaction may hold it below the event.
    let claim = log::CLAIM.replace("AND e.xid < pg_snapshot_xmin(pg_current_snapshot())", "");
    assert_ne!(claim, log::CLAIM);
    log::check_columns(&read(claim.clone()).await).unwrap();
    let swapped = claim.replace("e.traceparent, e.tracestate", "e.tracestate, e.traceparent");
    assert_ne!(swapped, claim);
    let refused = log::check_columns(&read(swapped.clone()).await).unwrap_err().to_string();
    assert!(refused.contains("\"tracestate\", \"TEXT\"), (\"traceparent\""), "{refused}");
    // The relay's read checks what it reads: the statement as it sends it, with its
    // columns moved, is refused rather than read into the wrong fields.
    let mut conn = it.pool.acquire().await.unwrap();
    let start = Some(log::Position { xid: 0, seq: 0 });
    let read = log::claim_by(&mut conn, &claim, start, 10).await.unwrap();
    assert!(!read.is_empty(), "the event is read");
    let refused = log::claim_by(&mut conn, &swapped, start, 10).await.unwrap_err().to_string();
    assert!(refused.contains("not [(\"seq\""), "{refused}");
    drop(conn);
    it.cleanup().await;
}
