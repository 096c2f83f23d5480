//! Which offsets of each assigned partition are done, so that the stored offset trails the
//! lowest one still in flight.
//!
//! Jobs of different documents in one partition finish out of order. Storing offset `n`
//! means "everything up to `n` is done", so the tracker stores only up to the lowest
//! unfinished offset minus one. Later offsets already finished are redelivered after a
//! crash, and their jobs' rows make that a no-op (`dispatch_version` and state).

use std::collections::{BTreeSet, HashMap};

use tokio_util::sync::CancellationToken;

/// One partition's progress.
#[derive(Debug, Default)]
struct Partition {
    /// Started and not finished.
    in_flight: BTreeSet<i64>,
    /// The highest offset finished.
    highest_done: Option<i64>,
    /// The offset last handed out for storing; starts just below the first message started
    /// in this assignment, so nothing below where consumption resumed is stored.
    stored: Option<i64>,
    /// Revoked: no new work is started; finishing old work stores nothing.
    revoked: bool,
    /// Bumped on every assignment, so work from an earlier assignment is told apart.
    epoch: u64,
    /// Fires when this assignment is revoked: work waiting for a slot gives up at once.
    revoked_token: CancellationToken,
}

/// A started message: where it is, and under which assignment it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub partition: i32,
    pub offset: i64,
    epoch: u64,
}

/// Progress of every partition this consumer was assigned.
#[derive(Debug, Default)]
pub struct Tracker {
    partitions: HashMap<i32, Partition>,
}

impl Tracker {
    /// `partitions` were (re)assigned: start them afresh.
    pub fn assign(&mut self, partitions: &[i32]) {
        for &p in partitions {
            let state = self.partitions.entry(p).or_default();
            let epoch = state.epoch + 1;
            *state = Partition { epoch, ..Partition::default() };
        }
    }

    /// `partitions` are being revoked: start nothing new from them.
    pub fn revoke(&mut self, partitions: &[i32]) {
        for p in partitions {
            if let Some(state) = self.partitions.get_mut(p) {
                state.revoked = true;
                state.revoked_token.cancel();
            }
        }
    }

    /// How many partitions this consumer holds (assigned and not revoked).
    pub fn held(&self) -> usize {
        self.partitions.values().filter(|p| !p.revoked).count()
    }

    /// The partitions this consumer holds, in order.
    pub fn held_partitions(&self) -> Vec<i32> {
        let mut held: Vec<i32> =
            self.partitions.iter().filter(|(_, p)| !p.revoked).map(|(n, _)| *n).collect();
        held.sort_unstable();
        held
    }

    /// Messages still running on `partitions`.
    pub fn in_flight(&self, partitions: &[i32]) -> usize {
        partitions.iter().filter_map(|p| self.partitions.get(p)).map(|s| s.in_flight.len()).sum()
    }

    /// The assignment `partition` is in now: a message polled under it is started with
    /// [`Tracker::start_in`].
    pub fn epoch(&self, partition: i32) -> u64 {
        self.partitions.get(&partition).map_or(0, |s| s.epoch)
    }

    /// Records a message as started; `None` if its partition is revoked (drop the message).
    pub fn start(&mut self, partition: i32, offset: i64) -> Option<Ticket> {
        let epoch = self.epoch(partition);
        self.start_in(partition, offset, epoch)
    }

    /// Records a message polled under assignment `epoch` ([`Tracker::epoch`]) as started;
    /// `None` if its partition was revoked since (drop the message: the partition's owner
    /// reads it again from the committed offset).
    pub fn start_in(&mut self, partition: i32, offset: i64, epoch: u64) -> Option<Ticket> {
        let state = self.partitions.entry(partition).or_default();
        if state.revoked || state.epoch != epoch {
            return None;
        }
        if state.stored.is_none() && state.in_flight.is_empty() && state.highest_done.is_none() {
            state.stored = Some(offset - 1);
        }
        state.in_flight.insert(offset);
        Some(Ticket { partition, offset, epoch: state.epoch })
    }

    /// Whether work under `ticket` may still start (its partition was not revoked since).
    pub fn is_current(&self, ticket: &Ticket) -> bool {
        self.partitions
            .get(&ticket.partition)
            .is_some_and(|s| s.epoch == ticket.epoch && !s.revoked)
    }

    /// Fires when `ticket`'s assignment is revoked (or already has been).
    pub fn revoked(&self, ticket: &Ticket) -> CancellationToken {
        match self.partitions.get(&ticket.partition) {
            Some(s) if s.epoch == ticket.epoch => s.revoked_token.clone(),
            _ => {
                let gone = CancellationToken::new();
                gone.cancel();
                gone
            }
        }
    }

    /// Records a message as finished; returns the offset to store, if it advanced.
    pub fn finish(&mut self, ticket: Ticket) -> Option<i64> {
        let state = self.partitions.get_mut(&ticket.partition)?;
        if state.epoch != ticket.epoch {
            return None;
        }
        state.in_flight.remove(&ticket.offset);
        state.highest_done = state.highest_done.max(Some(ticket.offset));
        let done_through = match state.in_flight.first() {
            Some(lowest) => lowest - 1,
            None => state.highest_done?,
        };
        if state.revoked || state.stored.is_some_and(|s| s >= done_through) || done_through < 0 {
            return None;
        }
        state.stored = Some(done_through);
        Some(done_through)
    }

    /// Forgets a message that will not finish (dropped on revoke or shutdown): nothing at or
    /// after it is stored in this assignment, so it is redelivered.
    pub fn abandon(&mut self, ticket: Ticket) {
        if let Some(state) = self.partitions.get_mut(&ticket.partition)
            && state.epoch == ticket.epoch
        {
            state.revoked = true;
            state.revoked_token.cancel();
            state.in_flight.remove(&ticket.offset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_polled_under_an_earlier_assignment_starts_nothing() {
        let mut t = Tracker::default();
        t.assign(&[0]);
        let polled = t.epoch(0);
        t.revoke(&[0]);
        assert_eq!(t.start_in(0, 5, polled), None, "revoked since it was polled");
        t.assign(&[0]);
        assert_eq!(t.start_in(0, 5, polled), None, "assigned again since it was polled");
        assert!(t.start_in(0, 5, t.epoch(0)).is_some(), "polled under this assignment");
    }

    #[test]
    fn the_stored_offset_trails_the_lowest_unfinished() {
        let mut t = Tracker::default();
        t.assign(&[0]);
        let a = t.start(0, 10).unwrap();
        let b = t.start(0, 11).unwrap();
        let c = t.start(0, 12).unwrap();
        assert_eq!(t.finish(c), None, "10 and 11 still run");
        assert_eq!(t.finish(b), None, "10 is still running");
        assert_eq!(t.finish(a), Some(12), "10, 11, 12 all done");
        let d = t.start(0, 13).unwrap();
        assert_eq!(t.finish(d), Some(13));
    }

    #[test]
    fn a_revoked_partition_starts_nothing_and_stores_nothing() {
        let mut t = Tracker::default();
        t.assign(&[1]);
        let a = t.start(1, 5).unwrap();
        let revoked = t.revoked(&a);
        assert!(!revoked.is_cancelled());
        t.revoke(&[1]);
        assert!(revoked.is_cancelled(), "work waiting for a slot hears of the revoke");
        assert!(t.start(1, 6).is_none());
        assert!(!t.is_current(&a));
        assert_eq!(t.in_flight(&[1]), 1);
        assert_eq!(t.finish(a), None);
        assert_eq!(t.in_flight(&[1]), 0);
    }

    #[test]
    fn an_abandoned_message_stops_storing_and_does_not_hold_up_a_revoke() {
        let mut t = Tracker::default();
        t.assign(&[3]);
        let a = t.start(3, 1).unwrap();
        let b = t.start(3, 2).unwrap();
        t.abandon(a);
        assert_eq!(t.finish(b), None, "nothing after an abandoned offset is stored");
        assert_eq!(t.in_flight(&[3]), 0);
    }

    #[test]
    fn work_from_an_earlier_assignment_is_ignored() {
        let mut t = Tracker::default();
        t.assign(&[2]);
        let old = t.start(2, 5).unwrap();
        t.revoke(&[2]);
        t.assign(&[2]);
        let new = t.start(2, 7).unwrap();
        assert!(t.revoked(&old).is_cancelled());
        assert!(!t.revoked(&new).is_cancelled());
        assert_eq!(t.finish(old), None);
        assert_eq!(t.finish(new), Some(7));
    }
}
