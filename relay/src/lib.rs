//! `jobfold-relay`: moves committed outbox rows to Kafka.
//!
//! Invariant: an event reaches Kafka only after its transaction committed, at least once,
//! keyed by document id, in per-document order; a row is marked published only after its
//! delivery report arrived.
