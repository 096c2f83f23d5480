//! Logs (tracing) and metrics (Prometheus) set up the same way in every binary.

use std::net::SocketAddr;

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};
use tracing_subscriber::EnvFilter;

/// Buckets for every `*_seconds` histogram: 1 ms to 5 min.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

/// Logs to stderr, as text or JSON lines, filtered by `RUST_LOG` (default `info`).
pub fn init_tracing(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // A second init (tests starting several services in one process) keeps the first.
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}

/// Serves Prometheus metrics at `http://<addr>/metrics` and installs the global recorder.
///
/// # Errors
/// The address cannot be bound, or a recorder is already installed.
pub fn install_metrics(addr: SocketAddr) -> Result<(), BuildError> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?
        .install()
}
