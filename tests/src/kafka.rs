//! Per-test Kafka topics and clients.
//!
//! Every test gets its own topic and consumer group (random names), so tests run in
//! parallel against one broker without seeing each other's messages.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;

use crate::services;

/// A unique name with a readable prefix: `jobfold-test-<prefix>-<uuid>`.
pub fn unique_name(prefix: &str) -> String {
    format!("jobfold-test-{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Client settings pointing at the test broker.
pub fn client_config() -> ClientConfig {
    services::require("Kafka", services::kafka_brokers().split(',').next().unwrap_or_default());
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", services::kafka_brokers());
    config
}

/// Creates `topic` with `partitions` partitions and waits until the broker reports it.
///
/// # Errors
/// The broker refused the topic (an existing topic is not an error).
pub async fn create_topic(topic: &str, partitions: i32) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = client_config().create()?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = admin
        .create_topics(&[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))], &options)
        .await?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => anyhow::bail!("creating topic {name}: {code}"),
        }
    }
    Ok(())
}
