//! `jobfold-test-processor`: `jobfold-processor` with the fault tests' handler
//! ([`jobfold_tests::handlers`]) as `index-document`, for the tests and the fault campaign
//! to start, kill and restart as a process.

use std::path::PathBuf;

use clap::Parser;
use jobfold_common::config::{self, Config};
use jobfold_common::{db, shutdown, telemetry};

/// Runs the fault tests' handler.
#[derive(Debug, Parser)]
struct Args {
    #[arg(long, env = "JOBFOLD_CONFIG")]
    config: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::no_transparent_huge_pages();
    let args = Args::parse();
    let config = Config::load_or_exit("jobfold-test-processor", args.config.as_deref());
    telemetry::init_tracing(config.log_json);
    telemetry::install_metrics(config.metrics_addr)?;
    let run = async {
        let pool = db::connect(&config, 1).await?;
        jobfold_tests::handlers::migrate(&pool).await?;
        pool.close().await;
        jobfold_processor::Processor::builder(config)
            .handlers(jobfold_tests::handlers::handlers())
            .run(shutdown::on_signal())
            .await
    };
    config::exit_on_config_error("jobfold-test-processor", run.await)
}
