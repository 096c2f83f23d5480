//! Kafka administration shared by the binaries and the tests.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult};

use rdkafka::types::RDKafkaErrorCode;

use anyhow::Context;

use crate::config::{Config, ConfigError};

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

/// How long one metadata request may wait for the brokers before the wait is reported.
const METADATA_ATTEMPT: Duration = Duration::from_secs(5);
/// How long a binary waits at start for the brokers to answer before it gives up.
const BROKERS_AT_START: Duration = Duration::from_secs(60);

/// The topics the cluster has. An unreachable cluster is reported, naming the brokers, after
/// [`METADATA_ATTEMPT`], then asked again up to [`BROKERS_AT_START`] (a broker still starting).
///
/// # Errors
/// No broker answered in time, or the configuration is refused.
pub async fn topic_names(config: &Config) -> anyhow::Result<std::collections::HashSet<String>> {
    let client = config.kafka_client();
    let brokers = config.kafka_brokers.clone();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = client.create()?;
        let started = std::time::Instant::now();
        loop {
            match consumer.fetch_metadata(None, METADATA_ATTEMPT) {
                Ok(metadata) => {
                    return Ok(metadata
                        .topics()
                        .iter()
                        .filter(|t| t.error().is_none() && !t.partitions().is_empty())
                        .map(|t| t.name().to_owned())
                        .collect());
                }
                Err(e) if started.elapsed() + METADATA_ATTEMPT < BROKERS_AT_START => {
                    tracing::warn!(brokers = %brokers, error = %e, "Kafka does not answer at {brokers}; trying again.");
                }
                Err(e) => {
                    anyhow::bail!(
                        "Kafka does not answer at {brokers} (kafka_brokers) after {}s: {e}",
                        started.elapsed().as_secs()
                    )
                }
            }
        }
    })
    .await?
}

/// Room for an event's envelope and its Kafka record around the largest input or result:
/// ids, document id, kind and idempotency key (each at most 512 bytes), trace context (also
/// sent as headers), error text (at most [`crate::config::MAX_ERROR_BYTES`]) and record and
/// batch framing.
pub const EVENT_ENVELOPE_BYTES: usize = 16 * 1024;

/// librdkafka's default `message.max.bytes`.
const LIBRDKAFKA_MESSAGE_MAX_BYTES: usize = 1_000_000;

/// The events topic's `max.message.bytes`: the largest record batch the broker takes.
///
/// # Errors
/// The broker cannot be reached or does not describe the topic.
pub async fn max_message_bytes(config: &Config, topic: &str) -> anyhow::Result<usize> {
    use rdkafka::admin::ResourceSpecifier;
    let admin: AdminClient<DefaultClientContext> = config.kafka_client().create()?;
    // A broker answers in milliseconds; one that cannot describe configurations (librdkafka's
    // mock cluster) should not hold the start up for long.
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(5)));
    let described = admin.describe_configs(&[ResourceSpecifier::Topic(topic)], &options).await?;
    let resource = described
        .into_iter()
        .next()
        .context("no answer describing the topic")?
        .map_err(|code| anyhow::anyhow!("describing topic {topic}: {code}"))?;
    let value = resource
        .get("max.message.bytes")
        .and_then(|entry| entry.value.clone())
        .with_context(|| format!("topic {topic} has no max.message.bytes"))?;
    value.parse().with_context(|| format!("topic {topic}: max.message.bytes {value:?}"))
}

/// The largest event the relay may produce to a topic whose `max.message.bytes` is
/// `topic_limit`: the smaller of that and the producer's own `message.max.bytes`.
pub fn event_limit(config: &Config, topic_limit: usize) -> usize {
    let producer = config
        .kafka
        .0
        .get("message.max.bytes")
        .and_then(|v| v.parse().ok())
        .unwrap_or(LIBRDKAFKA_MESSAGE_MAX_BYTES);
    topic_limit.min(producer)
}

/// Refuses limits under which an accepted job or a handler's result could make an event the
/// events topic refuses: `accept.max_input_bytes`, `processor.max_output_bytes` and each
/// kind's `max_output_bytes`, each with
/// [`EVENT_ENVELOPE_BYTES`], must fit the topic's `max.message.bytes` and the producer's
/// `message.max.bytes`.
///
/// # Errors
/// [`ConfigError::Named`], naming both settings; binaries exit with status 2.
pub fn check_event_limits(config: &Config, topic_limit: usize) -> Result<(), ConfigError> {
    let topic = &config.topics.events;
    let limit = event_limit(config, topic_limit);
    let limit_name = if limit < topic_limit {
        format!("kafka.message.max.bytes ({limit})")
    } else {
        format!("the max.message.bytes of topic {topic} ({topic_limit})")
    };
    let kinds = config.kinds.iter().filter_map(|(kind, k)| {
        Some((format!("kinds.{kind}.max_output_bytes"), k.max_output_bytes?))
    });
    let limits = [
        ("accept.max_input_bytes".to_owned(), config.accept.max_input_bytes),
        ("processor.max_output_bytes".to_owned(), config.processor.max_output_bytes),
    ];
    for (key, value) in limits.into_iter().chain(kinds) {
        if value + EVENT_ENVELOPE_BYTES > limit {
            return Err(ConfigError::Named {
                key: format!("key `{key}`"),
                problem: format!(
                    "{value} bytes plus {EVENT_ENVELOPE_BYTES} of event envelope do not fit \
                     {limit_name}: an event could be refused by Kafka; lower {key} or raise \
                     the topic's max.message.bytes"
                ),
            });
        }
    }
    Ok(())
}

/// Reads the events topic's limit and checks the configured sizes against it
/// ([`check_event_limits`]); returns the largest event the relay may produce. Where the
/// broker does not describe topic configurations, the producer's limit stands alone.
///
/// # Errors
/// [`ConfigError`].
pub async fn checked_event_limit(config: &Config) -> anyhow::Result<usize> {
    let topic = &config.topics.events;
    let topic_limit = match max_message_bytes(config, topic).await {
        Ok(limit) => limit,
        // A broker that does not describe topic configurations (no DescribeConfigs right,
        // librdkafka's mock cluster): the producer's own limit is the one checked, and the
        // relay still parks what is over it.
        Err(e) => {
            tracing::warn!(
                topic = %topic,
                error = %format!("{e:#}"),
                "Cannot read the topic's max.message.bytes; checking sizes against the \
                 producer's message.max.bytes alone."
            );
            usize::MAX
        }
    };
    check_event_limits(config, topic_limit)?;
    Ok(event_limit(config, topic_limit))
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

/// Deletes `topics`; one already gone is not an error. The broker removes the partitions'
/// files in the background.
///
/// # Errors
/// The broker is unreachable or refuses the request.
pub async fn delete_topics(config: &Config, topics: &[&str]) -> anyhow::Result<()> {
    if topics.is_empty() {
        return Ok(());
    }
    let admin: AdminClient<DefaultClientContext> = config.kafka_client().create()?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    // A few hundred topics a request keeps each one small.
    for chunk in topics.chunks(200) {
        for result in admin.delete_topics(chunk, &options).await? {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
                Err((name, code)) => anyhow::bail!("deleting topic {name}: {code}"),
            }
        }
    }
    Ok(())
}

/// Creates each topic that does not exist yet; existing topics are left as they are.
///
/// # Errors
/// The broker is unreachable or refuses a topic.
pub async fn ensure_topics(config: &Config, topics: &[TopicSpec<'_>]) -> anyhow::Result<()> {
    // Look first: where topics exist, no CreateTopics request is made at all (a principal
    // without the right to create topics, or a broker without the API, still runs).
    let names: Vec<String> = topics.iter().map(|t| t.name.to_owned()).collect();
    let existing = topic_names(config).await?;
    let missing: Vec<String> = names.into_iter().filter(|n| !existing.contains(n)).collect();
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
