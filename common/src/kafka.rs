//! Kafka administration shared by the binaries and the tests.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult};

use rdkafka::types::RDKafkaErrorCode;

use anyhow::Context;

use crate::config::{Config, ConfigError};

/// Defaults of jobfold's consumers (intake, processors) besides the fixed options
/// ([`crate::config::FIXED_KAFKA_OPTIONS`]: offsets are stored by the application after its
/// Postgres commit and committed by the client in the background); `[kafka]` options
/// override these.
pub const CONSUMER_DEFAULTS: &[(&str, &str)] =
    &[("auto.commit.interval.ms", "1000"), ("partition.assignment.strategy", "cooperative-sticky")];

/// librdkafka's read-ahead for jobfold's consumers (each may be set in `[kafka]`). A fetch
/// brings whole record batches, each decompressed into one buffer that lives as long as any
/// of its messages waits in librdkafka's queue: by default up to 1 MiB of compressed batches
/// a partition and 50 MiB a fetch, and up to 100,000 messages or 64 MiB queued a partition,
/// which a backlog fills whatever the consumer's own bounds (an intake behind a slow
/// Postgres, a processor passing over the events it does not act on). Here a fetch brings
/// 1 MiB at most (256 KiB a partition), the next one is sent while fewer than a thousand
/// messages or 2 MiB wait, and 10 ms after the queue was found full (librdkafka waits a
/// second by default, which so small a read-ahead drains long before).
pub const READ_AHEAD: &[(&str, &str)] = &[
    ("fetch.max.bytes", "1048576"),
    ("max.partition.fetch.bytes", "262144"),
    ("queued.min.messages", "1000"),
    ("queued.max.messages.kbytes", "2048"),
    ("fetch.queue.backoff.ms", "10"),
];

/// A consumer's settings: the fixed options, [`CONSUMER_DEFAULTS`] and [`READ_AHEAD`], then
/// `[kafka]`'s. librdkafka wants a fetch to hold the largest message (`fetch.max.bytes` ≥
/// `message.max.bytes`): raising the latter, as the event limit check advises, raises the
/// read-ahead's fetch with it unless `[kafka]` sets that too.
#[must_use]
pub fn consumer_client(config: &Config) -> rdkafka::ClientConfig {
    let defaults: Vec<(&str, &str)> = CONSUMER_DEFAULTS.iter().chain(READ_AHEAD).copied().collect();
    let mut client = config.kafka_client_for(crate::config::KafkaRole::Consumer, &defaults);
    if !config.kafka.0.contains_key("fetch.max.bytes")
        && let Some(largest) = config.kafka.0.get("message.max.bytes")
        && largest.parse::<u64>().is_ok_and(|largest| largest > 1_048_576)
    {
        client.set("fetch.max.bytes", largest);
    }
    client
}

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

/// A client's fatal error, if `error` from its poll is one (the client is dead then: the process must stop
/// and be restarted), told plainly: librdkafka's reason, and for a name another process took
/// over in the group (`FENCED_INSTANCE_ID`), which setting must differ. librdkafka reports a
/// fatal error to the poll under its own code, not `_FATAL`: the client says whether it is.
pub fn fatal_error<C: rdkafka::ClientContext>(
    client: &rdkafka::client::Client<C>,
    error: &KafkaError,
    group_instance_id: Option<&str>,
) -> Option<String> {
    let Some((code, reason)) = client.fatal_error() else {
        return (error.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal))
            .then(|| error.to_string());
    };
    Some(match code {
        RDKafkaErrorCode::FencedInstanceId => format!(
            "the group fenced this processor's name, processor.group_instance_id {:?}: another \
             process joined under it (each processor needs a name of its own), or this one \
             rejoined under it after the coordinator went unanswered past the session \
             time-out (librdkafka fences itself then); stopping, to be started again ({reason})",
            group_instance_id.unwrap_or_default()
        ),
        code => format!("{code:?}: {reason}"),
    })
}

/// The topics the cluster has. An unreachable cluster is reported, naming the brokers, after
/// `METADATA_ATTEMPT`, then asked again up to `BROKERS_AT_START` (a broker still starting).
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

/// One topic as the brokers describe it.
#[derive(Debug, Clone, Default)]
pub struct TopicSettings {
    /// Its configuration (`max.message.bytes`, `min.insync.replicas`, ...); empty where the
    /// broker does not describe configurations.
    pub config: HashMap<String, String>,
    /// Replicas of its least-replicated partition.
    pub replicas: usize,
}

/// How `topics` are set up on the cluster: one metadata request and one DescribeConfigs.
/// Where the broker does not describe configurations (no DescribeConfigs right, librdkafka's
/// mock cluster) the settings come back empty and that is logged.
///
/// # Errors
/// The brokers cannot be reached, or a topic is missing.
pub async fn describe_topics(
    config: &Config,
    topics: &[&str],
) -> anyhow::Result<HashMap<String, TopicSettings>> {
    use rdkafka::admin::ResourceSpecifier;
    let client = config.kafka_client();
    let names: Vec<String> = topics.iter().map(|t| (*t).to_owned()).collect();
    let mut described = tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = client.create()?;
        let metadata = consumer.fetch_metadata(None, BROKERS_AT_START)?;
        let mut found = HashMap::new();
        for name in names {
            let topic = metadata
                .topics()
                .iter()
                .find(|t| t.name() == name && t.error().is_none())
                .with_context(|| format!("the cluster has no topic {name}"))?;
            let replicas = topic.partitions().iter().map(|p| p.replicas().len()).min();
            found.insert(
                name,
                TopicSettings { config: HashMap::new(), replicas: replicas.unwrap_or(0) },
            );
        }
        anyhow::Ok(found)
    })
    .await??;
    let admin: AdminClient<DefaultClientContext> = config.kafka_client().create()?;
    // A broker answers in milliseconds; one that cannot describe configurations should not
    // hold the start up for long.
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(5)));
    let resources: Vec<_> = topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    match admin.describe_configs(&resources, &options).await {
        Ok(answers) => {
            for (topic, answer) in topics.iter().zip(answers) {
                match answer {
                    Ok(resource) => {
                        let settings = described.get_mut(*topic).expect("described above");
                        settings.config = resource
                            .entries
                            .into_iter()
                            .filter_map(|e| Some((e.name, e.value?)))
                            .collect();
                    }
                    Err(code) => tracing::warn!(topic = %topic, error = %code,
                        "Cannot read the topic's configuration; its settings are not checked."),
                }
            }
        }
        Err(e) => tracing::warn!(error = %e,
            "Cannot read the topics' configuration; their settings are not checked."),
    }
    Ok(described)
}

/// Refuses a topic on which a published event could be lost with one broker: fewer
/// replicas than `topics.replication_factor`, a `min.insync.replicas` below
/// `topics.min_insync_replicas` (or above the replicas, which the broker bounds it to), or
/// unclean leader election on (a replica that fell behind made leader drops what the others
/// acknowledged). Settings the broker did not describe are not checked.
///
/// # Errors
/// [`ConfigError::Named`], naming the key or the topic's setting; binaries exit with status 2.
pub fn check_durability(
    config: &Config,
    topic: &str,
    settings: &TopicSettings,
) -> Result<(), ConfigError> {
    let wanted = usize::try_from(config.topics.replication_factor).unwrap_or(1);
    if settings.replicas < wanted {
        return Err(ConfigError::Named {
            key: "key `topics.replication_factor`".into(),
            problem: format!(
                "topic {topic} has {} replica(s) of a partition, fewer than the {wanted} configured: \
                 losing one broker could lose published events; add replicas \
                 (kafka-reassign-partitions) or lower topics.replication_factor",
                settings.replicas
            ),
        });
    }
    if let Some(value) = settings.config.get("min.insync.replicas") {
        let isr: usize = value.parse().map_err(|_| ConfigError::Named {
            key: format!("topic {topic}'s min.insync.replicas"),
            problem: format!("{value:?} is not a number"),
        })?;
        let wanted = usize::try_from(config.topics.min_insync_replicas).unwrap_or(1);
        if isr < wanted {
            return Err(ConfigError::Named {
                key: "key `topics.min_insync_replicas`".into(),
                problem: format!(
                    "topic {topic} has min.insync.replicas={isr}, below the {wanted} configured: an \
                     event acknowledged by fewer replicas is lost with them; set the topic's \
                     min.insync.replicas to {wanted} (kafka-configs --alter)"
                ),
            });
        }
        if isr > settings.replicas {
            return Err(ConfigError::Named {
                key: format!("topic {topic}'s min.insync.replicas"),
                problem: format!(
                    "{isr} is more than its {} replica(s): the broker holds it to the replica \
                     count, so an event counts as written with fewer copies than it says",
                    settings.replicas
                ),
            });
        }
    }
    if settings.config.get("unclean.leader.election.enable").is_some_and(|v| v == "true") {
        return Err(ConfigError::Named {
            key: format!("topic {topic}'s unclean.leader.election.enable"),
            problem: "is true: a replica that fell behind could become leader and drop events the \
                      others acknowledged; set it false"
                .into(),
        });
    }
    Ok(())
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
    let producer_limit = event_limit(config, usize::MAX);
    let kinds = config.kinds.iter().filter_map(|(kind, k)| {
        Some((format!("kinds.{kind}.max_output_bytes"), k.max_output_bytes?))
    });
    let limits = [
        ("accept.max_input_bytes".to_owned(), config.accept.max_input_bytes),
        ("processor.max_output_bytes".to_owned(), config.processor.max_output_bytes),
    ];
    for (key, value) in limits.into_iter().chain(kinds) {
        let needed = value.saturating_add(EVENT_ENVELOPE_BYTES);
        // Each limit the event would pass, named with the setting that raises it.
        let mut binding = Vec::new();
        let mut raise = Vec::new();
        if needed > producer_limit {
            binding.push(format!("kafka.message.max.bytes ({producer_limit})"));
            raise.push(format!(
                "raise kafka.message.max.bytes (JOBFOLD_KAFKA__MESSAGE_MAX_BYTES) to {needed} or more"
            ));
        }
        if needed > topic_limit {
            binding.push(format!("the max.message.bytes of topic {topic} ({topic_limit})"));
            raise.push(format!(
                "raise topic {topic}'s max.message.bytes to {needed} or more (kafka-configs --alter)"
            ));
        }
        if !binding.is_empty() {
            return Err(ConfigError::Named {
                key: format!("key `{key}`"),
                problem: format!(
                    "{value} bytes plus {EVENT_ENVELOPE_BYTES} of event envelope do not fit {}: an \
                     event could be refused by Kafka; lower {key}, or {}",
                    binding.join(" nor "),
                    raise.join(" and ")
                ),
            });
        }
    }
    Ok(())
}

/// Checks jobfold's topics as the cluster has them: each one's durability
/// ([`check_durability`]), and the configured sizes against the events topic's
/// `max.message.bytes` ([`check_event_limits`]). Returns the largest event the relay may
/// produce; where the broker does not describe topic configurations, the producer's limit
/// stands alone (and the relay still parks what is over it).
///
/// # Errors
/// [`ConfigError`], or the brokers cannot be reached.
pub async fn check_topics(config: &Config) -> anyhow::Result<usize> {
    let t = &config.topics;
    let described = describe_topics(config, &[&t.events, &t.requests]).await?;
    for topic in [&t.events, &t.requests] {
        check_durability(config, topic, &described[topic.as_str()])?;
    }
    let topic_limit = match described[t.events.as_str()].config.get("max.message.bytes") {
        Some(value) => value
            .parse()
            .with_context(|| format!("topic {}: max.message.bytes {value:?}", t.events))?,
        None => usize::MAX,
    };
    check_event_limits(config, topic_limit)?;
    Ok(event_limit(config, topic_limit))
}

/// The largest event the relay may produce now ([`event_limit`] with the events topic's
/// `max.message.bytes` as the brokers describe it at this moment): read again after the
/// broker refused an event for its size, and before parked events are released, so that a
/// limit lowered or raised while running is followed without a restart.
///
/// # Errors
/// The brokers did not answer, or the topic's setting is not a number.
pub async fn current_event_limit(config: &Config) -> anyhow::Result<usize> {
    let topic = config.topics.events.as_str();
    let described = describe_topics(config, &[topic]).await?;
    let topic_limit = match described[topic].config.get("max.message.bytes") {
        Some(value) => {
            value.parse().with_context(|| format!("topic {topic}: max.message.bytes {value:?}"))?
        }
        None => usize::MAX,
    };
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

/// jobfold's two topics as configured: the event log (kept forever by default) and intake,
/// each written to `topics.min_insync_replicas` replicas before a write counts, and never led
/// by a replica that fell behind.
pub fn jobfold_topics(config: &Config) -> Vec<TopicSpec<'_>> {
    let t = &config.topics;
    vec![
        TopicSpec {
            name: &t.events,
            partitions: t.partitions,
            replication_factor: t.replication_factor,
            config: vec![
                ("retention.ms", t.events_retention_ms.to_string()),
                ("min.insync.replicas", t.min_insync_replicas.to_string()),
                ("unclean.leader.election.enable", "false".into()),
            ],
        },
        TopicSpec {
            name: &t.requests,
            partitions: t.partitions,
            replication_factor: t.replication_factor,
            config: vec![
                ("min.insync.replicas", t.min_insync_replicas.to_string()),
                ("unclean.leader.election.enable", "false".into()),
            ],
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
    wait_for_leaders(config, missing).await
}

/// How long a topic just created may take to reach every broker's metadata.
const TOPIC_PROPAGATION: Duration = Duration::from_secs(30);

/// Waits until every one of `topics` is in the metadata with a leader for each partition:
/// the controller accepts a CreateTopics before the brokers know of the topic, and a
/// describe or produce in that window finds no topic.
async fn wait_for_leaders(config: &Config, topics: Vec<String>) -> anyhow::Result<()> {
    let client = config.kafka_client();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = client.create()?;
        let started = std::time::Instant::now();
        loop {
            let metadata = consumer.fetch_metadata(None, METADATA_ATTEMPT)?;
            let waiting: Vec<&String> = topics
                .iter()
                .filter(|name| {
                    !metadata.topics().iter().any(|t| {
                        t.name() == name.as_str()
                            && t.error().is_none()
                            && !t.partitions().is_empty()
                            && t.partitions().iter().all(|p| p.error().is_none() && p.leader() >= 0)
                    })
                })
                .collect();
            if waiting.is_empty() {
                return Ok(());
            }
            anyhow::ensure!(
                started.elapsed() < TOPIC_PROPAGATION,
                "topics {waiting:?} were created but have no leaders after {}s",
                TOPIC_PROPAGATION.as_secs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(rf: i32, isr: i32) -> Config {
        let mut config = Config::load(None).expect("the defaults load");
        config.topics.replication_factor = rf;
        config.topics.min_insync_replicas = isr;
        config
    }

    fn topic(replicas: usize, settings: &[(&str, &str)]) -> TopicSettings {
        TopicSettings {
            config: settings.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            replicas,
        }
    }

    fn refused(config: &Config, settings: &TopicSettings) -> String {
        check_durability(config, "events", settings).expect_err("refused").to_string()
    }

    /// Both consumers (the intake's and the processors') read ahead a bounded amount, which
    /// `[kafka]` may change; a fetch still holds the largest message `[kafka]` allows.
    #[test]
    fn a_consumer_reads_ahead_a_bounded_amount_unless_kafka_says_otherwise() {
        let config = Config::load(None).expect("the defaults load");
        let client = consumer_client(&config);
        for (key, value) in READ_AHEAD {
            assert_eq!(client.get(key), Some(*value), "{key}");
        }
        let mut config = Config::load(None).expect("the defaults load");
        config.kafka.0.insert("queued.max.messages.kbytes".into(), "16384".into());
        config.kafka.0.insert("message.max.bytes".into(), "4000000".into());
        let client = consumer_client(&config);
        assert_eq!(client.get("queued.max.messages.kbytes"), Some("16384"));
        assert_eq!(client.get("fetch.max.bytes"), Some("4000000"), "a fetch holds the largest");
        assert_eq!(client.get("max.partition.fetch.bytes"), Some("262144"));
        config.kafka.0.insert("fetch.max.bytes".into(), "8000000".into());
        assert_eq!(consumer_client(&config).get("fetch.max.bytes"), Some("8000000"));
    }

    #[test]
    fn a_topic_as_durable_as_configured_passes() {
        let settings = [("min.insync.replicas", "2"), ("unclean.leader.election.enable", "false")];
        assert!(check_durability(&cluster(3, 2), "events", &topic(3, &settings)).is_ok());
        // More than asked for is fine; settings the broker did not describe are not checked.
        let more = [("min.insync.replicas", "3")];
        assert!(check_durability(&cluster(3, 2), "events", &topic(5, &more)).is_ok());
        assert!(check_durability(&cluster(1, 1), "events", &topic(1, &[])).is_ok());
    }

    #[test]
    fn a_topic_less_durable_than_configured_is_refused_naming_the_key() {
        let isr2 = [("min.insync.replicas", "2")];
        let e = refused(&cluster(3, 2), &topic(1, &isr2));
        assert!(e.contains("topics.replication_factor") && e.contains("1 replica"), "{e}");
        let e = refused(&cluster(3, 2), &topic(3, &[("min.insync.replicas", "1")]));
        assert!(e.contains("topics.min_insync_replicas") && e.contains("=1"), "{e}");
        let e = refused(&cluster(1, 1), &topic(1, &isr2));
        assert!(e.contains("min.insync.replicas") && e.contains("replica count"), "{e}");
        let unclean = [("min.insync.replicas", "2"), ("unclean.leader.election.enable", "true")];
        let e = refused(&cluster(3, 2), &topic(3, &unclean));
        assert!(e.contains("unclean.leader.election.enable"), "{e}");
        let e = refused(&cluster(3, 2), &topic(3, &[("min.insync.replicas", "two")]));
        assert!(e.contains("not a number"), "{e}");
    }

    #[test]
    fn min_insync_replicas_above_the_replication_factor_is_invalid() {
        let e = cluster(1, 2).validate().expect_err("invalid").to_string();
        assert!(e.contains("topics.min_insync_replicas"), "{e}");
    }
}
