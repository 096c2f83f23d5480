//! `jobfold-processor`: the HTTP API, the intake consumer and the job runner.

use std::path::PathBuf;

use clap::Parser;
use jobfold_common::config::{self, Config};
use jobfold_common::{shutdown, telemetry};

/// Accepts and runs jobfold jobs.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// TOML configuration file; JOBFOLD_* environment variables override it.
    #[arg(long, env = "JOBFOLD_CONFIG")]
    config: Option<PathBuf>,
}

// glibc's allocator in two arenas, not mimalloc: a processor's memory is mostly its jobs in
// flight, and an HTTP call in flight held 43 KiB under mimalloc against 26 KiB under glibc
// (1,000 concurrent reqwest calls, measured), which put a processor running 1,000 slow jobs
// over its 64 MiB (BENCHMARKS.md).
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::at_most_two_malloc_arenas();
    telemetry::no_transparent_huge_pages();
    let args = Args::parse();
    let config = Config::load_or_exit("jobfold-processor", args.config.as_deref());
    telemetry::init_tracing(config.log_json);
    telemetry::install_metrics(config.metrics_addr)?;
    config::exit_on_config_error(
        "jobfold-processor",
        jobfold_processor::run(config, shutdown::on_signal()).await,
    )
}
