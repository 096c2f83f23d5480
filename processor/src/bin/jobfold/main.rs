//! `jobfold`: the operator's command line.

mod bench;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_common::config::{Config, EXIT_CONFIG};
use jobfold_common::{db, telemetry};
use jobfold_schemas::codec::registry_settings;
use jobfold_schemas::{Codec, JobEvent};

/// Operate jobfold: migrate the database, submit jobs, measure.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// TOML configuration file; JOBFOLD_* environment variables override it.
    #[arg(long, global = true, env = "JOBFOLD_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply pending database migrations (the services also do at start).
    Migrate,
    /// Accept one job and print its id.
    Submit {
        /// The document the job works on.
        #[arg(long)]
        document: String,
        /// The job kind (selects the handler).
        #[arg(long, default_value = "index-document")]
        kind: String,
        /// The input version.
        #[arg(long, default_value_t = 1)]
        input_version: i64,
        /// The input, as JSON.
        #[arg(long, default_value = "{}")]
        input: String,
        /// Idempotency key: submitting again with it returns the same job.
        #[arg(long)]
        key: Option<String>,
    },
    /// Quarantined jobs: list them, replay one.
    Quarantine {
        #[command(subcommand)]
        command: QuarantineCommand,
    },
    /// Measure accept and relay on this machine next to its raw Kafka producer rate, in a
    /// database and topics of their own; prints a markdown table.
    Bench {
        /// The long run (minutes) instead of the quick one (about a minute).
        #[arg(long)]
        full: bool,
        /// Also write the table to this file.
        #[arg(long)]
        output: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
enum QuarantineCommand {
    /// List quarantined jobs, newest first.
    List {
        /// Only this owner's.
        #[arg(long)]
        owner: Option<String>,
        /// Only this job kind.
        #[arg(long)]
        kind: Option<String>,
        /// Only reasons containing this text.
        #[arg(long)]
        reason: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Run a quarantined job again with a fresh budget.
    Replay {
        job_id: uuid::Uuid,
        /// Run with this new, higher input version.
        #[arg(long)]
        new_input_version: Option<i64>,
        /// The new input (JSON) that goes with the new input version.
        #[arg(long, requires = "new_input_version")]
        input: Option<String>,
        /// Who asks, recorded in the ReplayRequested event.
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let config = match Config::load(args.config.as_deref()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("jobfold: {e}");
            return ExitCode::from(EXIT_CONFIG as u8);
        }
    };
    telemetry::init_tracing(config.log_json);
    match run(config, args.command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("jobfold: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: Config, command: Command) -> anyhow::Result<()> {
    match command {
        Command::Migrate => {
            let pool = db::connect(&config, 1).await.context("connecting to Postgres")?;
            let before: i64 = applied(&pool).await;
            db::MIGRATOR.run(&pool).await.context("applying migrations")?;
            let after: i64 = applied(&pool).await;
            println!("migrations: {} applied now, {after} in total", after - before);
        }
        Command::Submit { document, kind, input_version, input, key } => {
            let input = serde_json::from_str(&input).context("--input is not JSON")?;
            let pool =
                db::connect_and_migrate(&config, 1).await.context("connecting to Postgres")?;
            let settings = registry_settings(&config.schema_registry_url)?;
            let codec = Codec::<JobEvent>::connect(settings, &config.topics.events).await?;
            let acceptor =
                Acceptor::new(codec, config.accept.clone(), &config.topics.events, "jobfold-cli");
            let job = NewJob {
                document_id: document,
                kind,
                input_version,
                input,
                idempotency_key: key,
                trace: None,
            };
            let accepted = acceptor.accept(&pool, &job).await?;
            let what = if accepted.created { "accepted" } else { "already accepted" };
            println!("{} {what}", accepted.job_id);
        }
        Command::Quarantine { command } => quarantine(config, command).await?,
        Command::Bench { full, output } => {
            let sizes = if full { bench::Sizes::full() } else { bench::Sizes::quick() };
            let table = bench::run(config, sizes).await?;
            println!("{table}");
            if let Some(path) = output {
                std::fs::write(&path, &table)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
    }
    Ok(())
}

async fn quarantine(config: Config, command: QuarantineCommand) -> anyhow::Result<()> {
    let pool = db::connect_and_migrate(&config, 2).await.context("connecting to Postgres")?;
    match command {
        QuarantineCommand::List { owner, kind, reason, limit } => {
            type Row = (
                uuid::Uuid,
                String,
                String,
                i64,
                String,
                String,
                i32,
                String,
                chrono::DateTime<chrono::Utc>,
            );
            // language=PostgreSQL
            let rows: Vec<Row> = sqlx::query_as(
                r#"
                SELECT q.job_id, j.kind, j.document_id, q.input_version, q.error_class, q.owner,
                       q.attempts, q.reason, q.quarantined_at
                FROM quarantine q JOIN jobs j USING (job_id)
                WHERE ($1::text IS NULL OR q.owner = $1)
                  AND ($2::text IS NULL OR j.kind = $2)
                  AND ($3::text IS NULL OR q.reason ILIKE '%' || $3 || '%')
                ORDER BY q.quarantined_at DESC
                LIMIT $4
                "#,
            )
            .bind(owner)
            .bind(kind)
            .bind(reason)
            .bind(limit)
            .fetch_all(&pool)
            .await?;
            println!(
                "{:<36}  {:<16}  {:<20}  {:>7}  {:<13}  {:<18}  {:>8}  {:<20}  reason",
                "job", "kind", "document", "version", "class", "owner", "attempts", "since"
            );
            for (job, kind, doc, version, class, owner, attempts, reason, at) in &rows {
                println!(
                    "{job:<36}  {kind:<16.16}  {doc:<20.20}  {version:>7}  {class:<13}  {owner:<18.18}  {attempts:>8}  {:<20}  {reason}",
                    at.format("%Y-%m-%d %H:%M:%S")
                );
            }
            println!("{} quarantined job(s) shown", rows.len());
        }
        QuarantineCommand::Replay { job_id, new_input_version, input, by } => {
            let new_input = input
                .map(|i| serde_json::from_str(&i))
                .transpose()
                .context("--input is not JSON")?;
            let settings = registry_settings(&config.schema_registry_url)?;
            let codec = Codec::<JobEvent>::connect(settings, &config.topics.events).await?;
            let events = jobfold_processor::store::Events {
                codec,
                topic: config.topics.events.clone(),
                producer: "jobfold-cli".into(),
            };
            let request = jobfold_processor::store::Replay {
                requested_by: Some(by),
                new_input_version,
                new_input,
            };
            let mut tx = pool.begin().await?;
            let job =
                jobfold_processor::store::replay(&mut tx, &events, &config.accept, job_id, request)
                    .await?;
            tx.commit().await?;
            println!("{job_id} queued again at input version {}", job.input_version);
        }
    }
    Ok(())
}

/// Migrations applied so far (0 before the first run).
async fn applied(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}
