//! Consumer lag per partition for a whole consumer group, read from Kafka: the group's
//! committed offset against the partition's end. A member's own `jobfold_consumer_lag` gauge
//! covers only the partitions it holds; the console and `GET /v1/overview` need every
//! partition, whoever holds it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jobfold_common::config::Config;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;

/// One partition's lag for one consumer group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PartitionLag {
    pub group: String,
    pub topic: String,
    pub partition: i32,
    /// The group's committed offset; `None` before it committed one.
    pub committed: Option<i64>,
    /// The partition's end (high watermark).
    pub end: i64,
    /// `end − committed` (from the log start when nothing is committed).
    pub lag: i64,
}

/// How long one reading is served again: the console polls every few seconds from any
/// number of browsers, and each reading asks the brokers for every partition.
const FRESH_FOR: Duration = Duration::from_secs(2);
/// How long the brokers may take to answer one question.
const BROKER_WAIT: Duration = Duration::from_secs(3);

/// Reads the lag of the processors' group on the events topic and of the intake's group on
/// the requests topic, through one client per group made on first use. One reading at a
/// time asks the brokers; a request that comes meanwhile gets the last reading.
#[derive(Clone)]
pub struct LagReader {
    config: Arc<Config>,
    /// The processors' group's client and the intake's (each asks for its own group's
    /// committed offsets); held while the brokers are asked.
    clients: Arc<Mutex<Option<[BaseConsumer; 2]>>>,
    last: Arc<Mutex<Option<Reading>>>,
}

/// A reading of every partition's lag, and when it was taken.
type Reading = (Instant, Vec<PartitionLag>);

impl std::fmt::Debug for LagReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LagReader").finish_non_exhaustive()
    }
}

impl LagReader {
    pub fn new(config: Arc<Config>) -> Self {
        Self { config, clients: Arc::default(), last: Arc::default() }
    }

    /// Every partition of both topics, in group, topic and partition order: read now, or the
    /// last reading if it is under 2 s old or another reading is under way.
    ///
    /// # Errors
    /// Kafka did not answer in time, or the client could not be made.
    pub async fn read(&self) -> anyhow::Result<Vec<PartitionLag>> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.read_blocking()).await?
    }

    fn last(&self, fresh_for: Option<Duration>) -> Option<Vec<PartitionLag>> {
        let last = self.last.lock().expect("last lag reading");
        let (at, lag) = last.as_ref()?;
        fresh_for.is_none_or(|fresh_for| at.elapsed() < fresh_for).then(|| lag.clone())
    }

    fn read_blocking(&self) -> anyhow::Result<Vec<PartitionLag>> {
        if let Some(lag) = self.last(Some(FRESH_FOR)) {
            return Ok(lag);
        }
        let Ok(mut clients) = self.clients.try_lock() else {
            // Another request is asking the brokers (slow while Kafka is down): not a queue
            // of readings behind it.
            return self
                .last(None)
                .ok_or_else(|| anyhow::anyhow!("Kafka has not answered the first reading yet"));
        };
        if clients.is_none() {
            let client = |group: &str| -> anyhow::Result<BaseConsumer> {
                let mut client = self.config.kafka_client();
                // Never joins the group: it only asks for its committed offsets.
                client.set("group.id", group).set("enable.auto.commit", "false");
                Ok(client.create()?)
            };
            *clients =
                Some([client(&self.config.processor.group)?, client(&self.config.intake.group)?]);
        }
        let [processors, intake] = clients.as_ref().expect("made above");
        let mut lag =
            group_lag(processors, &self.config.processor.group, &self.config.topics.events)?;
        lag.extend(group_lag(intake, &self.config.intake.group, &self.config.topics.requests)?);
        *self.last.lock().expect("last lag reading") = Some((Instant::now(), lag.clone()));
        Ok(lag)
    }
}

fn group_lag(
    consumer: &BaseConsumer,
    group: &str,
    topic: &str,
) -> anyhow::Result<Vec<PartitionLag>> {
    let metadata = consumer.fetch_metadata(Some(topic), BROKER_WAIT)?;
    let Some(described) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(Vec::new());
    };
    let mut partitions = TopicPartitionList::new();
    for p in described.partitions() {
        partitions.add_partition(topic, p.id());
    }
    let committed = consumer.committed_offsets(partitions, BROKER_WAIT)?;
    let mut lag = Vec::new();
    for element in committed.elements() {
        let (low, end) = consumer.fetch_watermarks(topic, element.partition(), BROKER_WAIT)?;
        let committed = match element.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        };
        lag.push(PartitionLag {
            group: group.to_owned(),
            topic: topic.to_owned(),
            partition: element.partition(),
            committed,
            end,
            lag: (end - committed.unwrap_or(low)).max(0),
        });
    }
    lag.sort_by_key(|l| l.partition);
    Ok(lag)
}
