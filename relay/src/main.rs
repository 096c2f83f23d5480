//! `jobfold-relay`: publishes committed outbox rows to Kafka. See the library docs.

use std::path::PathBuf;

use clap::Parser;
use jobfold_common::config::{self, Config};
use jobfold_common::{shutdown, telemetry};

/// Publishes jobfold's committed events from the Postgres outbox to Kafka.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// TOML configuration file; JOBFOLD_* environment variables override it.
    #[arg(long, env = "JOBFOLD_CONFIG")]
    config: Option<PathBuf>,
}

/// mimalloc: under load glibc malloc (allocations freed on librdkafka's threads) cost the relay
/// more than producing; see BENCHMARKS.md.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::no_transparent_huge_pages();
    let args = Args::parse();
    let config = Config::load_or_exit("jobfold-relay", args.config.as_deref());
    telemetry::init_tracing(config.log_json);
    telemetry::install_metrics(config.metrics_addr)?;
    config::exit_on_config_error(
        "jobfold-relay",
        jobfold_relay::run(config, shutdown::on_signal()).await,
    )
}
