//! `jobfold-registry-standin`: a stand-in Confluent-compatible schema registry.
//!
//! Started by `docker/registry.sh` where no real registry can be installed; see
//! `jobfold_tests::registry_standin` for what it implements.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use jobfold_tests::registry_standin::Registry;

/// A stand-in Confluent-compatible schema registry (Avro only), for development and tests.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: SocketAddr,
    /// JSON file the registry is persisted to; in memory only when absent.
    #[arg(long)]
    state_file: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let args = Args::parse();
    let registry = match args.state_file {
        Some(path) => Registry::persistent(path.clone())
            .with_context(|| format!("reading the registry state file {}", path.display()))?,
        None => Registry::in_memory(),
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(address = %args.listen, "Stand-in schema registry listening.");
    axum::serve(listener, registry.router())
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("serving HTTP")
}
