//! How much each partition holds in memory, and when to pause and resume fetching it.
//!
//! A message is held from the moment it is received until its document's task is done with
//! it: waiting behind its document's running job, waiting for a slot, or running. A
//! partition holding more than `processor.max_buffered` messages or
//! `processor.max_buffered_bytes` bytes is paused (no more is fetched from it); it resumes
//! once it holds at most half of each. So one busy document can fill its own partition's
//! share, never the process's memory, and the other partitions go on being read — as
//! Confluent's Parallel Consumer bounds the records it holds per partition.
//!
//! A message is always taken in, whatever its size: pausing comes after it, so a single
//! message larger than the byte bound still runs (it was fetched under the topic's own
//! size limit).

use std::collections::HashMap;

/// The bounds, per partition.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub messages: usize,
    pub bytes: usize,
}

#[derive(Debug, Default)]
struct Held {
    messages: usize,
    bytes: usize,
    paused: bool,
}

/// What each partition holds.
#[derive(Debug)]
pub struct Buffer {
    bounds: Bounds,
    partitions: HashMap<i32, Held>,
}

impl Buffer {
    pub fn new(bounds: Bounds) -> Self {
        Self { bounds, partitions: HashMap::new() }
    }

    /// A message of `bytes` from `partition` is held; true if the partition must be paused
    /// now (it went over a bound and was not paused yet).
    pub fn add(&mut self, partition: i32, bytes: usize) -> bool {
        let held = self.partitions.entry(partition).or_default();
        held.messages += 1;
        held.bytes += bytes;
        let over = held.messages > self.bounds.messages || held.bytes > self.bounds.bytes;
        if over && !held.paused {
            held.paused = true;
            return true;
        }
        false
    }

    /// A message of `bytes` from `partition` is let go; true if the partition must be resumed
    /// now (it was paused and holds at most half of each bound).
    pub fn remove(&mut self, partition: i32, bytes: usize) -> bool {
        let Some(held) = self.partitions.get_mut(&partition) else { return false };
        held.messages = held.messages.saturating_sub(1);
        held.bytes = held.bytes.saturating_sub(bytes);
        let drained =
            held.messages <= self.bounds.messages / 2 && held.bytes <= self.bounds.bytes / 2;
        if held.paused && drained {
            held.paused = false;
            return true;
        }
        false
    }

    /// `partitions` were assigned afresh: fetching them starts unpaused (what an earlier
    /// assignment still holds is counted until it is let go).
    pub fn assigned(&mut self, partitions: &[i32]) {
        for p in partitions {
            if let Some(held) = self.partitions.get_mut(p) {
                held.paused = false;
            }
        }
    }

    /// Messages held, over all partitions.
    pub fn messages(&self) -> usize {
        self.partitions.values().map(|h| h.messages).sum()
    }

    /// Partitions paused now.
    pub fn paused(&self) -> usize {
        self.partitions.values().filter(|h| h.paused).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_over_its_bound_pauses_and_resumes_at_half() {
        let mut b = Buffer::new(Bounds { messages: 4, bytes: 1000 });
        for _ in 0..4 {
            assert!(!b.add(0, 10));
        }
        assert!(b.add(0, 10), "the fifth message is over the bound");
        assert!(!b.add(0, 10), "paused once");
        assert!(!b.add(1, 10), "other partitions are not paused");
        assert_eq!((b.messages(), b.paused()), (7, 1));
        for _ in 0..3 {
            assert!(!b.remove(0, 10), "still above half");
        }
        assert!(b.remove(0, 10), "two left: resume");
        assert_eq!(b.paused(), 0);
    }

    #[test]
    fn bytes_bound_too_and_one_large_message_is_always_taken() {
        let mut b = Buffer::new(Bounds { messages: 100, bytes: 1000 });
        assert!(b.add(0, 5000), "one message over the byte bound is taken, then paused");
        assert!(b.remove(0, 5000));
        assert!(!b.add(0, 600));
        assert!(b.add(0, 600));
        assert!(!b.remove(0, 600), "600 bytes is above half of 1000");
        assert!(b.remove(0, 600));
    }

    #[test]
    fn a_new_assignment_starts_unpaused() {
        let mut b = Buffer::new(Bounds { messages: 1, bytes: 1000 });
        b.add(2, 1);
        assert!(b.add(2, 1));
        b.assigned(&[2]);
        assert_eq!(b.paused(), 0);
        assert!(b.add(2, 1), "over again: paused again");
    }
}
