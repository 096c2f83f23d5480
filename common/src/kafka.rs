//! Kafka administration shared by the binaries and the tests.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::types::RDKafkaErrorCode;

use crate::config::Config;

/// Defaults of jobfold's consumers (intake, processors); `[kafka]` options override them.
///
/// Offsets are stored by the application after its Postgres commit
/// (`enable.auto.offset.store=false`) and committed by the client in the background.
pub const CONSUMER_DEFAULTS: &[(&str, &str)] = &[
    ("enable.auto.commit", "true"),
    ("auto.commit.interval.ms", "1000"),
    ("enable.auto.offset.store", "false"),
    ("auto.offset.reset", "earliest"),
    ("partition.assignment.strategy", "cooperative-sticky"),
];

/// Commits the stored offsets now; nothing stored since the last commit is not an error.
///
/// # Errors
/// The commit failed.
pub fn commit_stored<C: ConsumerContext, K: Consumer<C>>(consumer: &K) -> KafkaResult<()> {
    match consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// A topic to create if missing.
#[derive(Debug, Clone)]
pub struct TopicSpec<'a> {
    pub name: &'a str,
    pub partitions: i32,
    pub replication_factor: i32,
    /// Topic-level configuration, e.g. `("retention.ms", "-1")`.
    pub config: Vec<(&'a str, String)>,
}

/// jobfold's two topics as configured: the event log (kept forever by default) and intake.
pub fn jobfold_topics(config: &Config) -> Vec<TopicSpec<'_>> {
    let t = &config.topics;
    vec![
        TopicSpec {
            name: &t.events,
            partitions: t.partitions,
            replication_factor: t.replication_factor,
            config: vec![("retention.ms", t.events_retention_ms.to_string())],
        },
        TopicSpec {
            name: &t.requests,
            partitions: t.partitions,
            replication_factor: t.replication_factor,
            config: vec![],
        },
    ]
}

/// Creates each topic that does not exist yet; existing topics are left as they are.
///
/// # Errors
/// The broker is unreachable or refuses a topic.
pub async fn ensure_topics(config: &Config, topics: &[TopicSpec<'_>]) -> anyhow::Result<()> {
    // Look first: where topics exist, no CreateTopics request is made at all (a principal
    // without the right to create topics, or a broker without the API, still runs).
    let names: Vec<String> = topics.iter().map(|t| t.name.to_owned()).collect();
    let client = config.kafka_client();
    let missing: Vec<String> = tokio::task::spawn_blocking(move || -> KafkaResult<Vec<String>> {
        let consumer: BaseConsumer = client.create()?;
        let metadata = consumer.fetch_metadata(None, Duration::from_secs(30))?;
        let existing: std::collections::HashSet<&str> = metadata
            .topics()
            .iter()
            .filter(|t| t.error().is_none() && !t.partitions().is_empty())
            .map(|t| t.name())
            .collect();
        Ok(names.into_iter().filter(|n| !existing.contains(n.as_str())).collect())
    })
    .await??;
    if missing.is_empty() {
        return Ok(());
    }
    let admin: AdminClient<DefaultClientContext> = config.kafka_client().create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .filter(|t| missing.iter().any(|m| m == t.name))
        .map(|t| {
            let mut topic =
                NewTopic::new(t.name, t.partitions, TopicReplication::Fixed(t.replication_factor));
            for (key, value) in &t.config {
                topic = topic.set(key, value);
            }
            topic
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for result in admin.create_topics(&new, &options).await? {
        match result {
            Ok(name) => tracing::info!(topic = %name, "Created topic."),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => anyhow::bail!("creating topic {name}: {code}"),
        }
    }
    Ok(())
}
