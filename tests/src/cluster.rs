//! What the campaign asks a three-broker Kafka cluster before it strikes a broker: which
//! node leads the busiest partition, which one coordinates a consumer group, and whether
//! every replica has caught up again.
//!
//! Node ids are the `docker/kafka.sh` node numbers (1–3). The active controller is asked of
//! the quorum by `docker/kafka.sh controller`.

use std::time::Duration;

use jobfold_common::config::Config;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::metadata::Metadata;

/// `__consumer_offsets`: where a group's coordinator is the leader of one partition.
const OFFSETS_TOPIC: &str = "__consumer_offsets";

async fn with_metadata<T: Send + 'static>(
    config: &Config,
    read: impl FnOnce(&BaseConsumer, &Metadata) -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    let client = config.kafka_client();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = client.create()?;
        let metadata = consumer.fetch_metadata(None, Duration::from_secs(10))?;
        read(&consumer, &metadata)
    })
    .await?
}

/// The node leading the partition of `topic` that has taken the most records.
///
/// # Errors
/// The cluster did not answer, or no partition has a leader.
pub async fn busiest_partition_leader(config: &Config, topic: &str) -> anyhow::Result<i32> {
    let topic = topic.to_owned();
    with_metadata(config, move |consumer, metadata| {
        let partitions = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .map(|t| t.partitions().iter().map(|p| (p.id(), p.leader())).collect::<Vec<_>>())
            .unwrap_or_default();
        let mut busiest = None;
        for (id, leader) in partitions.into_iter().filter(|(_, leader)| *leader >= 0) {
            let (_, high) =
                consumer.fetch_watermarks(&topic, id, Duration::from_secs(5)).unwrap_or((0, 0));
            if busiest.is_none_or(|(most, _)| high > most) {
                busiest = Some((high, leader));
            }
        }
        busiest.map(|(_, leader)| leader).ok_or_else(|| anyhow::anyhow!("{topic}: no leader"))
    })
    .await
}

/// The partition of `__consumer_offsets` that holds `group`'s offsets, as the broker picks
/// it: the group id's Java `hashCode`, made non-negative, modulo the partition count.
pub fn offsets_partition(group: &str, partitions: i32) -> i32 {
    let hash =
        group.encode_utf16().fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)));
    // Kafka's Utils.abs: Integer.MIN_VALUE becomes 0.
    let abs = if hash == i32::MIN { 0 } else { hash.abs() };
    abs % partitions.max(1)
}

/// The node coordinating consumer group `group`.
///
/// # Errors
/// The cluster did not answer, or the offsets partition has no leader.
pub async fn coordinator(config: &Config, group: &str) -> anyhow::Result<i32> {
    let group = group.to_owned();
    with_metadata(config, move |_, metadata| {
        let offsets = metadata
            .topics()
            .iter()
            .find(|t| t.name() == OFFSETS_TOPIC)
            .ok_or_else(|| anyhow::anyhow!("no {OFFSETS_TOPIC} yet"))?;
        let wanted = offsets_partition(&group, offsets.partitions().len() as i32);
        offsets
            .partitions()
            .iter()
            .find(|p| p.id() == wanted && p.leader() >= 0)
            .map(|p| p.leader())
            .ok_or_else(|| anyhow::anyhow!("{OFFSETS_TOPIC} partition {wanted}: no leader"))
    })
    .await
}

/// Every partition of every topic has all its replicas in sync (after a broker came back).
///
/// # Errors
/// The cluster did not answer.
pub async fn fully_replicated(config: &Config) -> anyhow::Result<bool> {
    with_metadata(config, |_, metadata| {
        Ok(metadata.brokers().len() >= 3
            && metadata.topics().iter().all(|t| {
                t.partitions()
                    .iter()
                    .all(|p| p.leader() >= 0 && p.isr().len() == p.replicas().len())
            }))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_groups_offsets_partition_is_the_brokers() {
        // Kafka 4.1.1 with 10 offsets partitions put group "cg-test-x" on partition 6 (its
        // coordinator, by kafka-consumer-groups --describe --state, led partition 6);
        // Java's "cg-test-x".hashCode() is 977261446.
        assert_eq!(offsets_partition("cg-test-x", 10), 6);
        assert_eq!(offsets_partition("jobfold-processor", 10), 464_632_515 % 10);
        // A hash that overflows to a negative number is made positive, not wrapped.
        let negative = "jobfold-processor-group-with-a-longer-name";
        assert!((0..10).contains(&offsets_partition(negative, 10)));
        assert_eq!(offsets_partition("", 10), 0);
    }
}
