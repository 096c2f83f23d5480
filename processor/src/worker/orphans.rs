//! Partitions the group gives to no member, found and given out again.
//!
//! Under the cooperative protocol a partition that moves is taken from its owner in one
//! rebalance and given to its next owner in a second one, which the owner starts once it has
//! revoked it. A member named by `processor.group_instance_id` (static membership) that dies
//! in between — a handler aborting its process while the revoke waits for its running jobs
//! — never starts that second rebalance, and the process that replaces it under its name is
//! handed its assignment with no rebalance at all: the group is stable, and the partitions
//! that were on their way belong to no one. Their jobs wait until the group next rebalances
//! for some other reason, which may be never. (Kafka's classic protocol has no remedy of its
//! own; the fault campaign hit it within minutes of processors aborting.)
//!
//! So each processor looks at its group every `processor.assignment_check`: the members'
//! assignments as the coordinator holds them ([`assigned`]), against the partitions of the
//! events topic. A partition the stable group leaves to no one for longer than a revocation
//! and a dead member's session may take ([`grace`]) is an orphan: the processor that sees it
//! leaves the group and joins again, so the group rebalances and the leader gives every
//! partition out (`jobfold_group_rejoins_total`, and a WARN naming the partitions).

use std::collections::BTreeSet;
use std::time::Instant;

#[allow(clippy::wildcard_imports)]
use super::*;

/// How long one look at the group (its description and the topic's partitions) may take.
const LOOK_TIMEOUT: Duration = Duration::from_secs(5);

/// What one look at the group found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Look {
    /// The group is stable and leaves these partitions to no member (maybe none).
    Stable { unowned: BTreeSet<i32> },
    /// The group is rebalancing, empty or unknown: nothing to judge.
    Unsettled,
}

/// Looks at the group every `processor.assignment_check` until `shutdown`, and makes it
/// rebalance when a partition stays unowned past [`grace`].
pub(super) async fn watch(shared: Arc<Shared>) {
    let every = shared.config.processor.assignment_check;
    let grace = grace(&shared.config);
    // Since when (and which) partitions have been unowned at every look.
    let mut unowned: Option<(BTreeSet<i32>, Instant)> = None;
    loop {
        // A little jitter, so that the members of a group do not all look (and act) at once.
        let jitter = Duration::from_millis(rand::rng().random_range(0..1_000));
        tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            _ = tokio::time::sleep(every + jitter) => {}
        }
        let consumer = Arc::clone(&shared.consumer);
        let (group, topic) =
            (shared.config.processor.group.clone(), shared.config.topics.events.clone());
        let look = tokio::task::spawn_blocking(move || look(&consumer, &group, &topic)).await;
        let partitions = match look {
            Ok(Ok(Look::Stable { unowned })) if !unowned.is_empty() => unowned,
            Ok(Ok(_)) => {
                unowned = None;
                metrics::gauge!(pm::UNOWNED_PARTITIONS).set(0.0);
                continue;
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "Cannot look at the group's assignment now.");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "The look at the group's assignment panicked.");
                continue;
            }
        };
        metrics::gauge!(pm::UNOWNED_PARTITIONS).set(partitions.len() as f64);
        // Only partitions unowned at every look since the first count.
        let (still, since) = match unowned.take() {
            Some((before, since)) => {
                let still: BTreeSet<i32> = before.intersection(&partitions).copied().collect();
                if still.is_empty() { (partitions, Instant::now()) } else { (still, since) }
            }
            None => (partitions, Instant::now()),
        };
        if since.elapsed() < grace {
            unowned = Some((still, since));
            continue;
        }
        tracing::warn!(
            partitions = ?still,
            for_seconds = since.elapsed().as_secs(),
            group = %shared.config.processor.group,
            "Partitions of the events topic belong to no member of the stable group (a member \
             died while handing them on): this processor leaves the group and joins again, \
             so that it rebalances and every partition is given out."
        );
        metrics::counter!(pm::GROUP_REJOINS).increment(1);
        rejoin(&shared).await;
    }
}

/// librdkafka's `session.timeout.ms` when `[kafka]` does not set it.
const SESSION_TIMEOUT_DEFAULT: Duration = Duration::from_secs(45);

/// How long a partition may stay unowned in a stable group before it counts as orphaned: a
/// revocation's wait (`processor.revoke_timeout`); a dead member's session, which the group
/// waits out before it rebalances by itself (an unnamed member's death heals so, and the
/// check keeps out of its way); and a look.
fn grace(config: &Config) -> Duration {
    let session = config
        .kafka
        .0
        .get("session.timeout.ms")
        .and_then(|ms| ms.parse().ok())
        .map_or(SESSION_TIMEOUT_DEFAULT, Duration::from_millis);
    config.processor.revoke_timeout + session + config.processor.assignment_check
}

/// One look: the group's state and its members' assignments, against the topic's
/// partitions. Blocking (librdkafka's calls wait for the broker).
fn look(
    consumer: &BaseConsumer<WorkerContext>,
    group: &str,
    topic: &str,
) -> Result<Look, KafkaError> {
    let groups = consumer.fetch_group_list(Some(group), LOOK_TIMEOUT)?;
    let Some(info) = groups.groups().iter().find(|g| g.name() == group) else {
        return Ok(Look::Unsettled);
    };
    if info.state() != "Stable" || info.members().is_empty() {
        return Ok(Look::Unsettled);
    }
    let mut owned = BTreeSet::new();
    for member in info.members() {
        let Some(partitions) = member.assignment().and_then(|bytes| assigned(bytes, topic)) else {
            // An assignment this processor cannot read: judge nothing.
            return Ok(Look::Unsettled);
        };
        owned.extend(partitions);
    }
    let metadata = consumer.fetch_metadata(Some(topic), LOOK_TIMEOUT)?;
    let Some(described) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(Look::Unsettled);
    };
    let unowned =
        described.partitions().iter().map(|p| p.id()).filter(|p| !owned.contains(p)).collect();
    Ok(Look::Stable { unowned })
}

/// Leaves the group (the revoke runs on the consumer's thread, as on any rebalance), waits
/// until this processor holds no partition (for up to [`LEAVE_TIMEOUT`]), and joins again.
async fn rejoin(shared: &Shared) {
    if shared.shutdown.is_cancelled() {
        return;
    }
    shared.consumer.unsubscribe();
    let deadline = tokio::time::Instant::now() + LEAVE_TIMEOUT;
    while shared.tracker.lock().expect("tracker").held() > 0
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A stop begun meanwhile leaves the group for good.
    if shared.shutdown.is_cancelled() {
        return;
    }
    if let Err(e) = shared.consumer.subscribe(&[&shared.config.topics.events]) {
        tracing::error!(error = %e, "Joining the group again failed; the processor stops.");
        shared.shutdown.cancel();
    }
}

/// The partitions of `topic` in a member's assignment as the consumer protocol encodes it
/// (`ConsumerProtocolAssignment`: a version, then each topic's name and partitions, then
/// user data); `None` if the bytes are not that.
pub(super) fn assigned(bytes: &[u8], topic: &str) -> Option<Vec<i32>> {
    let mut at = Reader(bytes);
    let _version = at.i16()?;
    let mut partitions = Vec::new();
    for _ in 0..at.count()? {
        let name_len = usize::try_from(at.i16()?).ok()?;
        let name = at.take(name_len)?;
        let matches = name == topic.as_bytes();
        for _ in 0..at.count()? {
            let partition = at.i32()?;
            if matches {
                partitions.push(partition);
            }
        }
    }
    Some(partitions)
}

/// Big-endian reads off the front of a byte slice.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn i16(&mut self) -> Option<i16> {
        Some(i16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    /// An array's length: at least 0 (a null array is empty), at most what the bytes left
    /// could hold.
    fn count(&mut self) -> Option<usize> {
        let n = usize::try_from(self.i32()?.max(0)).ok()?;
        (n <= self.0.len()).then_some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::assigned;

    fn encode(topics: &[(&str, &[i32])]) -> Vec<u8> {
        let mut out = 1_i16.to_be_bytes().to_vec();
        out.extend((topics.len() as i32).to_be_bytes());
        for (name, partitions) in topics {
            out.extend((name.len() as i16).to_be_bytes());
            out.extend(name.as_bytes());
            out.extend((partitions.len() as i32).to_be_bytes());
            for p in *partitions {
                out.extend(p.to_be_bytes());
            }
        }
        out.extend((-1_i32).to_be_bytes());
        out
    }

    #[test]
    fn a_members_assignment_reads_as_the_consumer_protocol_writes_it() {
        let bytes = encode(&[("other", &[0, 1]), ("jobfold.job-events", &[4, 5])]);
        assert_eq!(assigned(&bytes, "jobfold.job-events"), Some(vec![4, 5]));
        assert_eq!(assigned(&encode(&[]), "jobfold.job-events"), Some(vec![]));
        // Cut short or made up, it is not read as anything.
        assert_eq!(assigned(&bytes[..bytes.len() - 9], "jobfold.job-events"), None);
        assert_eq!(assigned(&[0, 1, 0x7f, 0xff, 0xff, 0xff], "t"), None);
    }
}
