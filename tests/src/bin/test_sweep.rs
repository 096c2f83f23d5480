//! `jobfold-test-sweep`: removes the scratch databases and topics that tests and benchmarks
//! leave on the shared services.
//!
//! A passing test drops its own; a failing or killed one cannot, and over many runs the
//! broker's leftover partitions slow its start past the test command's readiness wait.
//! `docker/test.sh` runs this after the tests. Only names the tests and `jobfold bench`
//! make are touched: databases starting `jobfold_test_` or `jobfold_bench_`, topics
//! starting `jobfold-test-` or `jobfold-bench-`.

use anyhow::Context;
use jobfold_common::config::Config;
use jobfold_tests::{harness::SCRATCH_DATABASE, services};
use sqlx::PgPool;

const DATABASES: [&str; 2] = [SCRATCH_DATABASE, "jobfold_bench_"];
const TOPICS: [&str; 2] = ["jobfold-test-", "jobfold-bench-"];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let admin =
        PgPool::connect(&services::database_url()).await.context("connecting to Postgres")?;
    let mut dropped = 0;
    for prefix in DATABASES {
        let names: Vec<String> =
            sqlx::query_scalar("SELECT datname FROM pg_database WHERE starts_with(datname, $1)")
                .bind(prefix)
                .fetch_all(&admin)
                .await?;
        for name in names {
            jobfold_common::db::drop_database(&admin, &name)
                .await
                .with_context(|| format!("dropping database {name}"))?;
            dropped += 1;
        }
    }
    let mut config = Config::load(None).context("the compiled-in defaults load")?;
    config.kafka_brokers = services::kafka_brokers();
    let topics = jobfold_common::kafka::topic_names(&config).await?;
    let names: Vec<&str> = topics
        .iter()
        .map(String::as_str)
        .filter(|name| TOPICS.iter().any(|prefix| name.starts_with(prefix)))
        .collect();
    jobfold_common::kafka::delete_topics(&config, &names).await?;
    println!("removed {dropped} scratch databases and {} scratch topics", names.len());
    Ok(())
}
