//! What jobfold's binaries and upstream services share.
//!
//! # Layout
//! - [`config`]: the one typed configuration (defaults, file, `JOBFOLD_*` variables).
//! - [`accept`]: accepting jobs — job row, `JobRequested` event and outbox row in one
//!   transaction, inside the caller's transaction or a new one.
//! - [`db`]: connecting to Postgres (following a failover among the URL's hosts,
//!   [`pg_hosts`]) and running the embedded migrations ([`MIGRATOR`]).
//! - [`kafka`]: creating jobfold's topics.
//! - [`shutdown`]: the root cancellation token, cancelled by SIGINT/SIGTERM.
//! - [`telemetry`], [`metrics`]: logs and Prometheus metrics; [`gauges`]: the unfinished-work
//!   gauges read from Postgres.
//! - [`failpoint`]: named crash points for fault-injection tests.

pub mod accept;
pub mod config;
pub mod db;
pub mod failpoint;
pub mod gauges;
pub mod kafka;
pub mod metrics;
pub mod pg_hosts;
pub mod shutdown;
pub mod telemetry;

pub use db::MIGRATOR;
