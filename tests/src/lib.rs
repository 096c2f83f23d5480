//! Shared helpers for jobfold's end-to-end tests.
//!
//! Tests talk to real services started natively by `docker/services.sh start` (the README's
//! test command starts them): PostgreSQL, Apache Kafka and a schema registry. Where a service
//! is not reachable a test fails with a message naming that command; it never passes silently.
//!
//! # Layout
//! - [`services`]: where the services listen (from `JOBFOLD_*` variables or the scripts'
//!   defaults) and checks that they answer.
//! - [`harness`]: a private jobfold installation per test (database, topics, groups) and
//!   jobfold's binaries as child processes a test can kill.
//! - [`handlers`]: the fault tests' handler (`index-document` with knobs and an audit of
//!   its writes) and the `jobfold-test-processor` binary's migrations.
//! - [`kafka`]: per-test topics and clients.
//! - [`bad`]: the bad jobs the campaign mixes in.
//! - [`browser`]: a real headless Chromium over WebDriver, for the console's tests.
//! - [`campaign`]: the fault campaign (also the `jobfold-campaign` command), and
//!   [`history`]: the checker of what a run left in Postgres and on the topic;
//!   [`cluster`]: what it asks a three-broker Kafka cluster before striking a broker.
//! - [`pair`]: a Postgres primary with a synchronous standby, and its failovers.
//! - [`proxy`]: a TCP proxy that cuts idle connections (a load balancer's idle time-out).

pub mod bad;
pub mod browser;
pub mod campaign;
pub mod cluster;
pub mod handlers;
pub mod harness;
pub mod history;
pub mod kafka;
pub mod pair;
pub mod proxy;
pub mod services;
pub mod tls;
