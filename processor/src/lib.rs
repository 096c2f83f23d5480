//! `jobfold-processor`: the consumer group that leases, runs and completes jobs.
//!
//! Invariant: a Kafka offset is stored only after the Postgres transaction holding the
//! result, the dedupe row and the partition offset row has committed.
