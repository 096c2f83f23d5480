//! Proof that the test services are the real parts: a Kafka broker serving a consumer group,
//! a schema registry serving Confluent's API, and PostgreSQL with jobfold's migrations.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use apache_avro::types::Value;
use futures::future::try_join_all;
use jobfold_tests::kafka::{client_config, create_topic, unique_name};
use jobfold_tests::services;
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use schema_registry_converter::async_impl::avro::{AvroDecoder, AvroEncoder};
use schema_registry_converter::async_impl::schema_registry::{
    SrSettings, get_schema_by_id, is_compatible_schema, post_schema,
};
use schema_registry_converter::schema_registry_common::{
    SchemaType, SubjectNameStrategy, SuppliedSchema,
};
use tokio::sync::mpsc;

const MESSAGES: usize = 10_000;
const KEYS: usize = 100;
const PARTITIONS: i32 = 6;

/// One received message: which group member got it, and where it came from.
#[derive(Debug)]
struct Received {
    member: usize,
    partition: i32,
    key: String,
    sequence: usize,
}

fn group_member(group: &str, topic: &str) -> Arc<StreamConsumer> {
    let consumer: StreamConsumer = client_config()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    Arc::new(consumer)
}

fn assigned_partitions(consumer: &StreamConsumer) -> BTreeSet<i32> {
    consumer.assignment().expect("assignment").elements().iter().map(|e| e.partition()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_group_shares_partitions_and_keeps_per_key_order() {
    let topic = unique_name("smoke");
    let group = unique_name("smoke-group");
    create_topic(&topic, PARTITIONS).await.unwrap();

    // Two members of one group, each draining its partitions into one channel.
    let members = [group_member(&group, &topic), group_member(&group, &topic)];
    let (tx, mut rx) = mpsc::unbounded_channel();
    for (member, consumer) in members.iter().enumerate() {
        let consumer = Arc::clone(consumer);
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                let message = consumer.recv().await.expect("message");
                let key = String::from_utf8(message.key().unwrap().to_vec()).unwrap();
                let sequence =
                    std::str::from_utf8(message.payload().unwrap()).unwrap().parse().unwrap();
                let received = Received { member, partition: message.partition(), key, sequence };
                if tx.send(received).is_err() {
                    return;
                }
            }
        });
    }
    drop(tx);

    // Produce only once the group is stable: all partitions split between both members.
    let stable = async {
        loop {
            let a = assigned_partitions(&members[0]);
            let b = assigned_partitions(&members[1]);
            if !a.is_empty() && !b.is_empty() && a.len() + b.len() == PARTITIONS as usize {
                assert!(a.is_disjoint(&b), "a partition is assigned to both members");
                return (a, b);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let (a, b) = tokio::time::timeout(Duration::from_secs(60), stable)
        .await
        .expect("the group did not give both members partitions within 60 s");

    let producer: FutureProducer = client_config()
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()
        .unwrap();
    // Sequence numbers count up per key; the payload carries the key's sequence.
    let mut next = vec![0usize; KEYS];
    let records: Vec<(String, String)> = (0..MESSAGES)
        .map(|i| {
            let k = i % KEYS;
            let sequence = next[k];
            next[k] += 1;
            (format!("doc-{k}"), sequence.to_string())
        })
        .collect();
    let deliveries = records.iter().map(|(key, payload)| {
        producer.send(FutureRecord::to(&topic).key(key).payload(payload), Timeout::Never)
    });
    try_join_all(deliveries).await.map_err(|(e, _)| e).expect("every delivery acknowledged");

    let mut received = Vec::with_capacity(MESSAGES);
    while received.len() < MESSAGES {
        let message = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("only {} of {MESSAGES} messages arrived", received.len()))
            .expect("consumers running");
        received.push(message);
    }

    // Both members consumed, each only from its own partitions.
    for (member, partitions) in [(0, &a), (1, &b)] {
        let mine: Vec<&Received> = received.iter().filter(|r| r.member == member).collect();
        assert!(!mine.is_empty(), "member {member} received nothing");
        assert!(mine.iter().all(|r| partitions.contains(&r.partition)));
    }
    // Per-key order: every key's sequence arrives as 0, 1, 2, ... with no gap or repeat.
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for r in &received {
        let expected = seen.entry(&r.key).or_insert(0);
        assert_eq!(r.sequence, *expected, "key {} out of order", r.key);
        *expected += 1;
    }
    assert_eq!(seen.len(), KEYS);
    assert_eq!(seen.values().sum::<usize>(), MESSAGES);
}

const SMOKE_SCHEMA: &str = r#"{
  "type": "record", "name": "Smoke", "namespace": "dev.jobfold.test",
  "fields": [
    {"name": "document_id", "type": "string"},
    {"name": "version", "type": "long"}
  ]
}"#;

/// Adds a field with a default: readers on it can still read `SMOKE_SCHEMA` data.
const SMOKE_SCHEMA_V2: &str = r#"{
  "type": "record", "name": "Smoke", "namespace": "dev.jobfold.test",
  "fields": [
    {"name": "document_id", "type": "string"},
    {"name": "version", "type": "long"},
    {"name": "note", "type": ["null", "string"], "default": null}
  ]
}"#;

/// Adds a field without a default: old data cannot be read with it.
const SMOKE_SCHEMA_BREAKING: &str = r#"{
  "type": "record", "name": "Smoke", "namespace": "dev.jobfold.test",
  "fields": [
    {"name": "document_id", "type": "string"},
    {"name": "version", "type": "long"},
    {"name": "required", "type": "string"}
  ]
}"#;

fn avro(schema: &str) -> SuppliedSchema {
    SuppliedSchema::new(None, SchemaType::Avro, schema.to_owned())
}

#[tokio::test]
async fn registry_registers_reads_back_by_id_and_checks_compatibility() {
    let url = services::schema_registry_url();
    services::require_url("the schema registry", &url);
    let settings = SrSettings::new(url);
    let topic = unique_name("registry");
    let subject = format!("{topic}-value");

    // Encoding registers the schema under the topic's value subject and frames the body.
    let encoder = AvroEncoder::new(settings.clone());
    let strategy =
        SubjectNameStrategy::TopicNameStrategyWithSchema(topic.clone(), false, avro(SMOKE_SCHEMA));
    let value = vec![("document_id", Value::String("doc-1".into())), ("version", Value::Long(7))];
    let bytes = encoder.encode(value, strategy).await.unwrap();
    assert_eq!(bytes[0], 0, "Confluent magic byte");
    let id = u32::from_be_bytes(bytes[1..5].try_into().unwrap());

    // The id in the frame resolves to the schema we registered.
    let registered = get_schema_by_id(id, &settings).await.unwrap();
    let expected = apache_avro::Schema::parse_str(SMOKE_SCHEMA).unwrap();
    let actual = apache_avro::Schema::parse_str(&registered.schema).unwrap();
    assert_eq!(actual.canonical_form(), expected.canonical_form());

    // A fresh decoder, with an empty cache, decodes by the id in the frame.
    let decoded = AvroDecoder::new(settings.clone()).decode(Some(&bytes)).await.unwrap();
    assert_eq!(
        decoded.value,
        Value::Record(vec![
            ("document_id".into(), Value::String("doc-1".into())),
            ("version".into(), Value::Long(7)),
        ])
    );

    // Registering the same schema again returns the same id.
    let again = post_schema(&settings, subject.clone(), avro(SMOKE_SCHEMA)).await.unwrap();
    assert_eq!(again.id, id);

    // BACKWARD (the default): a new optional field passes, a new required field does not.
    assert!(is_compatible_schema(&settings, subject.clone(), avro(SMOKE_SCHEMA_V2)).await.unwrap());
    assert!(
        !is_compatible_schema(&settings, subject.clone(), avro(SMOKE_SCHEMA_BREAKING))
            .await
            .unwrap()
    );
    let v2 = post_schema(&settings, subject.clone(), avro(SMOKE_SCHEMA_V2)).await.unwrap();
    assert_ne!(v2.id, id);
    let refused = post_schema(&settings, subject, avro(SMOKE_SCHEMA_BREAKING)).await;
    assert!(refused.is_err(), "an incompatible schema was registered: {refused:?}");
}

#[tokio::test]
async fn migrations_apply_and_constraints_hold() {
    let url = services::database_url();
    services::require_url("PostgreSQL", &url);
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    // A database of its own, so the test sees a fresh schema whatever ran before.
    let name = format!(
        "{}smoke_{}",
        jobfold_tests::harness::SCRATCH_DATABASE,
        uuid::Uuid::new_v4().simple()
    );
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let (base, _) = url.rsplit_once('/').unwrap();
    let pool = sqlx::PgPool::connect(&format!("{base}/{name}")).await.unwrap();

    jobfold_common::MIGRATOR.run(&pool).await.unwrap();
    // Running again is a no-op, as every service start does.
    jobfold_common::MIGRATOR.run(&pool).await.unwrap();

    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = 'public' AND table_name <> '_sqlx_migrations' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        tables,
        [
            "async_attempts",
            "audit_log",
            "dead_letters",
            "inline_runs",
            "job_counters",
            "job_events",
            "job_kinds",
            "jobs",
            "kind_minutes",
            "kind_pause_log",
            "kind_pauses",
            "kind_quotas",
            "outbox",
            "overview_minutes",
            "paused_dispatches",
            "periodic_leader",
            "periodic_schedules",
            "processors",
            "quarantine",
            "relay_cursor",
            "relay_parked",
            "retention_cursor",
        ]
    );

    // The idempotency key is unique, and the violation names its constraint.
    let insert = "INSERT INTO jobs (job_id, document_id, kind, payload, input_version, idempotency_key, max_attempts) \
                  VALUES ($1, 'doc-1', 'index', '{}', 1, 'request-1', 3)";
    sqlx::query(insert).bind(uuid::Uuid::new_v4()).execute(&pool).await.unwrap();
    let duplicate = sqlx::query(insert).bind(uuid::Uuid::new_v4()).execute(&pool).await;
    let constraint = match duplicate {
        Err(sqlx::Error::Database(e)) => e.constraint().map(str::to_owned),
        other => panic!("a duplicate idempotency key was accepted: {other:?}"),
    };
    assert_eq!(constraint.as_deref(), Some("jobs_idempotency_key_key"));
    // A job without a key is not in that index, and many of them never conflict.
    let keyless = "INSERT INTO jobs (job_id, document_id, kind, payload, input_version, max_attempts) \
                   VALUES ($1, 'doc-1', 'index', '{}', 1, 3)";
    for _ in 0..2 {
        sqlx::query(keyless).bind(uuid::Uuid::new_v4()).execute(&pool).await.unwrap();
    }

    // Every job writes its row twice (the completion is not heap-only; its result goes in it)
    // and two or three events, and each write pays an entry in every index it qualifies for:
    // the indexes of the two hot tables are these, each read by something named in
    // docs/processor.md ("What a job's rows cost"). One more is a cost on every job.
    let indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT indexname::text, indexdef FROM pg_indexes \
         WHERE schemaname = 'public' AND tablename IN ('jobs', 'job_events') ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let names: Vec<&str> = indexes.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "job_events_pkey",
            "job_events_relay_idx",
            "job_events_stream_version_key",
            "jobs_document_kind_idx",
            "jobs_finished_idx",
            "jobs_idempotency_key_key",
            "jobs_kind_idx",
            "jobs_pkey",
            "jobs_unfinished_idx",
        ]
    );
    let partial = |name: &str| {
        indexes.iter().find(|(n, _)| n == name).is_some_and(|(_, def)| def.contains(" WHERE "))
    };
    assert!(partial("jobs_idempotency_key_key"), "{indexes:?}");

    pool.close().await;
    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)")).execute(&admin).await.unwrap();
}
