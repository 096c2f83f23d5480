//! `jobfold-cli`: the `jobfold` command line, and the two commands that read the event log
//! as a library (the tests drive them directly).
//!
//! - [`analytics`]: `jobfold replay` — the event log from Kafka or Postgres, folded,
//!   verified against the projection, exported as JSON Lines or Parquet.
//! - [`capacity`]: `jobfold capacity` — per kind, arrivals, service times and queue waits
//!   from the log, and the least concurrency meeting a waiting-time objective.
//!
//! The binary (`src/main.rs`) adds the operator's commands over the processor's
//! [`jobfold_processor::status`] queries and store, the newcomer's `demo`, `bench` and `soak`.

pub mod analytics;
pub mod capacity;
