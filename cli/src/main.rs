//! `jobfold`: the operator's command line.

mod api;
mod bench;
mod demo;
mod failover_bench;
mod model;
mod remote_bench;
mod replay_bench;
mod report;
mod soak;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_common::config::{Config, EXIT_CONFIG};
use jobfold_common::{db, gauges, telemetry};
use jobfold_processor::status::{self, QuarantineFilter};
use jobfold_schemas::{Codec, JobEvent};

/// Operate jobfold: migrate the database, submit jobs, inspect jobs and the unfinished work,
/// fix quarantined jobs, measure.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// TOML configuration file; JOBFOLD_* environment variables override it.
    #[arg(long, global = true, env = "JOBFOLD_CONFIG")]
    config: Option<PathBuf>,
    /// Make the change through this processor's HTTP API (`http://host:8080`) instead of
    /// Postgres: its token, roles, rules and audit trail apply. For submit, status, cancel,
    /// run-now, quarantine replay, kinds pause and resume, dead-letters reinject and delete.
    #[arg(long, global = true, env = "JOBFOLD_API")]
    api: Option<String>,
    /// The API token (`jobfold token` makes one) for --api.
    #[arg(long, global = true, env = "JOBFOLD_TOKEN", hide_env_values = true)]
    token: Option<String>,
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
        /// Not before this time (RFC 3339: 2026-12-24T18:00:00Z).
        #[arg(long, conflicts_with = "delay")]
        run_at: Option<chrono::DateTime<chrono::Utc>>,
        /// Not before this long from now (90s, 15m, 2h).
        #[arg(long, value_parser = humantime::parse_duration)]
        delay: Option<std::time::Duration>,
    },
    /// Cancel an open job: queued, scheduled, waiting to retry and quarantined jobs end at
    /// once; a running one's handler is cancelled within a heartbeat and commits nothing.
    Cancel {
        /// The job; or select open jobs by --kind, --document, --state, --since, --until.
        #[arg(required_unless_present_any = ["kind", "document", "state", "since", "until"])]
        job_id: Option<uuid::Uuid>,
        #[arg(long, conflicts_with = "job_id")]
        kind: Option<String>,
        #[arg(long, conflicts_with = "job_id")]
        document: Option<String>,
        /// queued, leased or retry_wait.
        #[arg(long, conflicts_with = "job_id")]
        state: Option<String>,
        /// Accepted at or after this time (RFC 3339).
        #[arg(long, conflicts_with = "job_id")]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Accepted before this time.
        #[arg(long, conflicts_with = "job_id")]
        until: Option<chrono::DateTime<chrono::Utc>>,
        /// Count what the filter selects; cancel nothing.
        #[arg(long, conflicts_with = "job_id")]
        dry_run: bool,
        /// Jobs cancelled by this command at most.
        #[arg(long, default_value_t = jobfold_processor::store::BULK_LIMIT_MAX)]
        limit: usize,
        /// Why, recorded in the JobCancelled event.
        #[arg(long)]
        reason: Option<String>,
        /// Who asks, recorded in the JobCancelled event.
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
    },
    /// Run a scheduled job, or one waiting to retry, now: it is dispatched at once, no attempt
    /// spent or given.
    RunNow { job_id: uuid::Uuid },
    /// List jobs in acceptance order, filtered, a page at a time (keyset: `--after` the last
    /// id shown).
    Jobs {
        /// queued, leased, retry_wait, succeeded, quarantined, superseded or cancelled.
        #[arg(long)]
        state: Option<jobfold_schemas::fold::Status>,
        #[arg(long)]
        kind: Option<String>,
        #[arg(long)]
        document: Option<String>,
        /// Accepted at or after this time (RFC 3339).
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Only jobs scheduled for later (queued, due in the future).
        #[arg(long)]
        scheduled: bool,
        /// The page after this job id.
        #[arg(long)]
        after: Option<uuid::Uuid>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Newest first.
        #[arg(long)]
        desc: bool,
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
        /// Print how Postgres runs the listing (its plan) instead of the jobs.
        #[arg(long)]
        explain: bool,
    },
    /// Dead letters (messages the intake or the processor could not decode or accept):
    /// list, show, send back to the intake topic, delete.
    DeadLetters {
        #[command(subcommand)]
        command: DeadLetterCommand,
    },
    /// A job as Postgres holds it: state, attempts, lease, last error, quarantine.
    Status {
        job_id: uuid::Uuid,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// A job's event history, in stream order.
    Events {
        job_id: uuid::Uuid,
        /// Print the events as JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The unfinished-work gauges from Postgres: what is queued, leased, waiting to retry,
    /// quarantined, dead-lettered, not yet published.
    Stats {
        /// Also count every job per state (a full scan of `jobs`).
        #[arg(long)]
        totals: bool,
    },
    /// Replay the job event log from Kafka or Postgres: fold it, print a summary, and
    /// optionally verify the projection or export the log.
    Replay {
        /// Where to read the log: the events topic, or the job_events table.
        #[arg(long, value_enum, default_value_t = From::Kafka)]
        from: From,
        /// Only events at or after this time (RFC 3339: 2026-11-29T10:00:00Z).
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Compare the folded log with the jobs projection; exit 1 on any difference.
        #[arg(long)]
        verify: bool,
        /// Write one row per event to this file: JSON Lines, or Parquet if it ends in
        /// `.parquet`.
        #[arg(long)]
        export: Option<PathBuf>,
        /// Export one row per job instead of per event.
        #[arg(long, requires = "export")]
        jobs: bool,
        /// No progress bar.
        #[arg(long)]
        no_progress: bool,
        /// Finished jobs remembered to recognise late duplicates of their events.
        #[arg(long, default_value_t = jobfold_cli::analytics::DEFAULT_DEDUPE_WINDOW)]
        dedupe_window: usize,
    },
    /// The periodic schedules of the configuration (`[periodic.<name>]`): next tick, last
    /// tick and its job, the processor holding them.
    Periodic {
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Make an API token: its secret is printed once, with the `[[http.tokens]]` entry that
    /// holds only its SHA-256.
    Token {
        /// Who will use it (recorded in the audit trail of each change it makes).
        #[arg(long)]
        name: String,
        /// read, submit, operate or admin.
        #[arg(long, value_parser = parse_role)]
        role: jobfold_common::config::Role,
    },
    /// The audit trail: every change made through the API or this command, newest first.
    Audit {
        #[arg(long)]
        actor: Option<String>,
        /// cancel, cancel_matching, replay, replay_matching, run_now, pause_kind,
        /// resume_kind, reinject_dead_letter, delete_dead_letter, retry_parked, drop_parked.
        #[arg(long)]
        action: Option<String>,
        /// A job id, a kind, a dead letter's id.
        #[arg(long)]
        target: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Kinds: list them with their pauses; pause or resume one for the whole group.
    Kinds {
        #[command(subcommand)]
        command: KindCommand,
    },
    /// Quarantined jobs: list them, replay one.
    Quarantine {
        #[command(subcommand)]
        command: QuarantineCommand,
    },
    /// Events the relay parked because Kafka refuses them (too large for the topic, say),
    /// with their documents' later events waiting behind them: list, retry, drop.
    Parked {
        #[command(subcommand)]
        command: ParkedCommand,
    },
    /// Run the whole pipeline here: services, a relay and two processors, a workload, a
    /// processor killed midway, and a summary that checks the run. Ctrl-C stops it all.
    Demo {
        /// A smaller workload, and exit after the summary (for tests).
        #[arg(long)]
        short: bool,
        /// Documents in the workload (1-3 versions each).
        #[arg(long)]
        documents: Option<usize>,
        /// Which Kafka: the configured or native broker (auto), or librdkafka's mock cluster.
        #[arg(long, value_enum, default_value_t = demo::KafkaChoice::Auto)]
        kafka: demo::KafkaChoice,
        /// Exit after the summary instead of running until Ctrl-C.
        #[arg(long)]
        exit: bool,
    },
    /// Capacity from the event log: per kind, over a window, the arrival rate, service time
    /// (p50/p90/p99), retry share, jobs in service (Little's law, and at the peak) and queue
    /// wait; with --wait, the concurrency each kind needs to meet that waiting-time
    /// objective (a simulation driven by the window's own dispatches), next to what is
    /// configured.
    Capacity {
        /// Where to read the log: the events topic, or the job_events table.
        #[arg(long, value_enum, default_value_t = From::Postgres)]
        from: From,
        /// The window's start (RFC 3339); else the log's start.
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// The window's end (RFC 3339); else the log's end.
        #[arg(long)]
        until: Option<chrono::DateTime<chrono::Utc>>,
        /// The waiting-time objective: queue waits at most this long (2s, 500ms) ...
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<std::time::Duration>,
        /// ... at this quantile.
        #[arg(long, default_value_t = 0.99, requires = "wait")]
        quantile: f64,
        /// A margin for a different day: service times lengthened by this many percent for
        /// the answer (0: the window's own times, as measured).
        #[arg(long, default_value_t = 10.0, requires = "wait")]
        headroom: f64,
        /// Also write the figures to this file, as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Also plot arrivals, workers busy, queue waits against the objective and the
        /// simulated wait by number of workers to this SVG.
        #[arg(long)]
        plot: Option<PathBuf>,
    },
    /// Measure this machine's Postgres and Kafka limits, then accept, the relay, end-to-end
    /// processing, slow jobs, recovery after kill -9 and peak memory next to them, in
    /// databases and topics of their own; prints a markdown table.
    Bench {
        /// The long run (minutes) instead of the quick one (under two minutes).
        #[arg(long)]
        full: bool,
        /// Every measurement at a size too small to mean anything (checks the bench runs).
        #[arg(long, hide = true, conflicts_with = "full")]
        smoke: bool,
        /// Also write the table to this file.
        #[arg(long)]
        output: Option<PathBuf>,
        /// Measure `jobfold replay` instead: speed and resident memory over synthetic logs
        /// of these sizes (events), from Postgres and from Kafka.
        #[arg(long, value_delimiter = ',', num_args = 0.., default_missing_value = "100000,1000000")]
        replay: Option<Vec<usize>>,
        /// Measure only long remote jobs: this many held in flight at once in one processor
        /// by a handler over HTTP/2 that answered 202, its memory and the callbacks' rates.
        #[arg(long, conflicts_with = "replay")]
        remote: Option<usize>,
        /// How long `--remote`'s jobs are held in flight.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        remote_hold: std::time::Duration,
        /// Measure only the pause a Postgres failover causes: under a steady load over HTTP,
        /// run this shell command (what moves the primary where the bench runs, e.g.
        /// `docker/postgres.sh failover`), then report how long accepts were unavailable
        /// and accept -> succeeded across it, next to the lease TTL. `database_url` names
        /// the primary and its standby.
        #[arg(long, value_name = "COMMAND", conflicts_with_all = ["replay", "remote", "full"])]
        failover: Option<String>,
    },
    /// Run the pipeline (relay, examples processor) under steady load with retention on, in a
    /// database and topics of its own; sample memory, consumer lag and table sizes; then
    /// check from the events topic that nothing was lost or done twice and that every figure
    /// levelled off. Exits 1 if not.
    Soak {
        /// How long to load.
        #[arg(long, default_value = "30min", value_parser = humantime::parse_duration)]
        duration: std::time::Duration,
        /// How often to sample.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        interval: std::time::Duration,
        /// Jobs a second (default: half the end-to-end rate of a burst measured first).
        #[arg(long)]
        rate: Option<f64>,
        /// Documents the jobs are versions of.
        #[arg(long, default_value_t = 1000)]
        documents: usize,
        /// Also write the report to this file.
        #[arg(long)]
        output: Option<PathBuf>,
    },
}

/// Where `jobfold replay` and `jobfold capacity` read the log.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum From {
    Kafka,
    Postgres,
}

impl From {
    fn source(self) -> jobfold_cli::analytics::Source {
        use jobfold_cli::analytics::Source;
        match self {
            Self::Kafka => Source::Kafka,
            Self::Postgres => Source::Postgres,
        }
    }
}

/// Decodes the job event log's frames, with the configured registry.
fn event_decoder(config: &Config) -> anyhow::Result<jobfold_schemas::Decoder<JobEvent>> {
    Ok(jobfold_schemas::Decoder::new(config.registry()?))
}

impl Command {
    /// The request a `cancel` by filter makes, sent alike to the API (`--api`) and to the
    /// database; `None` for any other command.
    fn into_bulk_cancel(self) -> Option<jobfold_processor::store::BulkCancel> {
        let Self::Cancel {
            job_id: None,
            kind,
            document,
            state,
            since,
            until,
            dry_run,
            limit,
            reason,
            by,
        } = self
        else {
            return None;
        };
        Some(jobfold_processor::store::BulkCancel {
            kind,
            document_id: document,
            state,
            since,
            until,
            dry_run,
            batch_size: None,
            limit: Some(limit),
            requested_by: Some(by),
            reason,
        })
    }
}

impl QuarantineCommand {
    /// The request a `quarantine replay` by filter makes, sent alike to the API (`--api`)
    /// and to the database; `None` for any other command.
    fn into_bulk_replay(self) -> Option<jobfold_processor::store::BulkReplay> {
        let Self::Replay {
            job_id: None,
            owner,
            kind,
            reason,
            since,
            until,
            dry_run,
            batch_size,
            limit,
            by,
            ..
        } = self
        else {
            return None;
        };
        Some(jobfold_processor::store::BulkReplay {
            filter: jobfold_processor::store::BulkFilter { owner, kind, reason, since, until },
            dry_run,
            batch_size: Some(batch_size),
            limit: Some(limit),
            requested_by: Some(by),
        })
    }
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
        /// Quarantined at or after this time (RFC 3339).
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Quarantined before this time.
        #[arg(long)]
        until: Option<chrono::DateTime<chrono::Utc>>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Run a quarantined job again with a fresh budget — one by id, or every one a filter
    /// selects (`--dry-run` first to count them).
    Replay {
        /// The job; or select by --owner, --kind, --reason, --since, --until.
        #[arg(required_unless_present_any = ["owner", "kind", "reason", "since", "until"])]
        job_id: Option<uuid::Uuid>,
        /// Run with this new, higher input version (one job only).
        #[arg(long, requires = "job_id")]
        new_input_version: Option<i64>,
        /// The new input (JSON) that goes with the new input version.
        #[arg(long, requires = "new_input_version")]
        input: Option<String>,
        #[arg(long, conflicts_with = "job_id")]
        owner: Option<String>,
        #[arg(long, conflicts_with = "job_id")]
        kind: Option<String>,
        /// Reasons containing this text.
        #[arg(long, conflicts_with = "job_id")]
        reason: Option<String>,
        #[arg(long, conflicts_with = "job_id")]
        since: Option<chrono::DateTime<chrono::Utc>>,
        #[arg(long, conflicts_with = "job_id")]
        until: Option<chrono::DateTime<chrono::Utc>>,
        /// Count what the filter selects; replay nothing.
        #[arg(long, conflicts_with = "job_id")]
        dry_run: bool,
        /// Jobs replayed per transaction.
        #[arg(long, default_value_t = 100)]
        batch_size: usize,
        /// Jobs replayed by this command at most.
        #[arg(long, default_value_t = jobfold_processor::store::BULK_LIMIT_MAX)]
        limit: usize,
        /// Who asks, recorded in the ReplayRequested event.
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
    },
}

#[derive(Debug, Subcommand)]
enum KindCommand {
    /// Every kind a processor registered or an operator paused: paused or running, by whom,
    /// since when, why, and the jobs waiting for its resume.
    List {
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Pause a kind in every processor (within a second): its jobs wait unleased, their
    /// attempts unspent; what runs finishes.
    Pause {
        kind: String,
        /// Why, recorded with the pause.
        #[arg(long)]
        reason: Option<String>,
        /// Who asks, recorded with the pause.
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
    },
    /// Resume a paused kind: the jobs that waited are dispatched again.
    Resume {
        kind: String,
        /// Why, recorded with the resume.
        #[arg(long)]
        reason: Option<String>,
        /// Who asks, recorded with the resume.
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
    },
}

#[derive(Debug, Subcommand)]
enum DeadLetterCommand {
    /// List dead letters, oldest first.
    List {
        #[arg(long)]
        topic: Option<String>,
        /// The page after this id.
        #[arg(long)]
        after: Option<i64>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// One dead letter: coordinates, error, raw key and value as hex and text.
    Show {
        id: i64,
        #[arg(long)]
        json: bool,
    },
    /// Send an intake dead letter back to the intake topic, after fixing its cause (the
    /// request id keeps it from becoming a second job).
    Reinject { id: i64 },
    /// Delete a dead letter.
    Delete { id: i64 },
}

#[derive(Debug, Subcommand)]
enum ParkedCommand {
    /// List parked events: the refused ones first, then those waiting behind them.
    List {
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Send refused events again, their documents' waiting events behind them (after fixing
    /// the cause: raise the topic's max.message.bytes, restart the relays).
    Retry {
        #[command(flatten)]
        which: ParkedSelection,
    },
    /// Drop refused events: they stay in the job_events log but never reach Kafka; their
    /// documents' waiting events then go out, in order.
    Drop {
        #[command(flatten)]
        which: ParkedSelection,
    },
}

/// Which refused events: one by seq, a document's, or all.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
struct ParkedSelection {
    /// The refused event's seq (from `jobfold parked list`).
    seq: Option<i64>,
    /// Every refused event of this document.
    #[arg(long)]
    document: Option<String>,
    /// Every refused event.
    #[arg(long)]
    all: bool,
}

impl ParkedSelection {
    fn selection(self) -> jobfold_relay::parked::Selection {
        use jobfold_relay::parked::Selection;
        match (self.seq, self.document) {
            (Some(seq), _) => Selection::Seq(seq),
            (None, Some(document)) => Selection::Document(document),
            (None, None) => Selection::All,
        }
    }
}

/// mimalloc, as the relay had while it ran inside the command line (glibc's malloc, its
/// buffers freed on librdkafka's threads, cost it more than producing: BENCHMARKS.md). The
/// services have since moved to glibc's allocator in two arenas, for their resident memory;
/// the command line's runs are short and keep it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    telemetry::init_tracing_at(config.log_json, "warn");
    let done = match args.api.as_deref() {
        None => Box::pin(run(config, args.command)).await,
        Some(url) => match api::Api::new(url, args.token) {
            Ok(api) => Box::pin(api::run(&api, args.command)).await,
            Err(e) => Err(e),
        },
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        // Asked for what cannot be: a usage error, as a bad setting is.
        Err(e) if e.is::<api::Usage>() => {
            eprintln!("jobfold: {e}");
            ExitCode::from(EXIT_CONFIG as u8)
        }
        Err(e) => {
            eprintln!("jobfold: {e:#}");
            ExitCode::FAILURE
        }
    }
}

impl Command {
    /// The command's name, as typed.
    fn name(&self) -> &'static str {
        match self {
            Self::Migrate => "migrate",
            Self::Submit { .. } => "submit",
            Self::Cancel { .. } => "cancel",
            Self::RunNow { .. } => "run-now",
            Self::Jobs { .. } => "jobs",
            Self::DeadLetters { .. } => "dead-letters",
            Self::Status { .. } => "status",
            Self::Events { .. } => "events",
            Self::Stats { .. } => "stats",
            Self::Replay { .. } => "replay",
            Self::Periodic { .. } => "periodic",
            Self::Token { .. } => "token",
            Self::Audit { .. } => "audit",
            Self::Kinds { .. } => "kinds",
            Self::Quarantine { .. } => "quarantine",
            Self::Parked { .. } => "parked",
            Self::Demo { .. } => "demo",
            Self::Capacity { .. } => "capacity",
            Self::Bench { .. } => "bench",
            Self::Soak { .. } => "soak",
        }
    }
}

async fn run(config: Config, command: Command) -> anyhow::Result<()> {
    match command {
        Command::Migrate => {
            let pool = db::connect(&config, 1).await?;
            let before: i64 = applied(&pool).await;
            db::MIGRATOR.run(&pool).await.context("applying migrations")?;
            let after: i64 = applied(&pool).await;
            println!("migrations: {} applied now, {after} in total", after - before);
        }
        Command::Submit { document, kind, input_version, input, key, run_at, delay } => {
            let run_at = match delay {
                Some(delay) => Some(chrono::Utc::now() + chrono::Duration::from_std(delay)?),
                None => run_at,
            };
            let input = serde_json::from_str(&input).context("--input is not JSON")?;
            let pool = db::connect_and_migrate(&config, 1).await?;
            let settings = config.registry()?;
            let codec = Codec::<JobEvent>::connect(settings, &config.topics.events).await?;
            let acceptor = Acceptor::new(codec, config.accept_policy(), "jobfold-cli");
            let job = NewJob {
                document_id: document,
                kind,
                input_version,
                input,
                idempotency_key: key,
                trace: None,
                run_at,
            };
            let accepted = acceptor.accept(&pool, &job).await?;
            report::submitted(accepted.job_id, accepted.created);
        }
        Command::Status { job_id, json } => status(config, job_id, json).await?,
        command @ Command::Cancel { job_id: None, .. } => {
            let pool = db::connect_and_migrate(&config, 1).await?;
            let events = cli_events(&config).await?;
            let request = command.into_bulk_cancel().expect("a cancel by filter");
            let filter = serde_json::json!({
                "kind": request.kind, "document_id": request.document_id, "state": request.state,
                "since": request.since, "until": request.until, "limit": request.limit,
                "reason": request.reason,
            });
            let done = jobfold_processor::store::cancel_matching(&pool, &events, request).await?;
            if !done.dry_run {
                let detail = serde_json::json!({ "request": filter, "done": done });
                audited(&pool, "cancel_matching", None, detail).await?;
            }
            report::bulk_cancelled(&done);
        }
        Command::Cancel { job_id: Some(job_id), reason, by, .. } => {
            let pool = db::connect_and_migrate(&config, 1).await?;
            let events = cli_events(&config).await?;
            let detail = serde_json::json!({ "request": { "reason": reason, "requested_by": by } });
            let request = jobfold_processor::store::Cancel { requested_by: Some(by), reason };
            let mut tx = pool.begin().await?;
            let (_, was) =
                jobfold_processor::store::cancel(&mut tx, &events, job_id, request).await?;
            if was != jobfold_schemas::fold::Status::Cancelled {
                let mut detail = detail;
                detail["was"] = was.as_str().into();
                audited(&mut *tx, "cancel", Some(&job_id.to_string()), detail).await?;
            }
            tx.commit().await?;
            report::cancelled(job_id, was.as_str());
        }
        Command::RunNow { job_id } => {
            use jobfold_processor::store::Waited;
            let pool = db::connect_and_migrate(&config, 1).await?;
            let events = cli_events(&config).await?;
            let mut tx = pool.begin().await?;
            let (_, waited) = jobfold_processor::store::run_now(&mut tx, &events, job_id).await?;
            if waited != Waited::Due {
                let detail = serde_json::json!({ "waited": waited });
                audited(&mut *tx, "run_now", Some(&job_id.to_string()), detail).await?;
            }
            tx.commit().await?;
            report::ran_now(job_id, waited);
        }
        Command::Jobs {
            state,
            kind,
            document,
            since,
            scheduled,
            after,
            limit,
            desc,
            json,
            explain,
        } => {
            let pool = db::connect(&config, 1).await?;
            let filter = status::JobFilter {
                state,
                kind,
                document_id: document,
                since,
                limit: Some(limit),
                after,
                order: Some(if desc { status::Order::Desc } else { status::Order::Asc }),
                scheduled,
            };
            if explain {
                println!("{}", status::jobs_plan(&pool, &filter).await?);
                return Ok(());
            }
            let page = status::jobs(&pool, &filter).await?;
            print_jobs(&page, json)?;
        }
        Command::DeadLetters { command } => dead_letters(config, command).await?,
        Command::Events { job_id, json } => events(config, job_id, json).await?,
        Command::Stats { totals } => stats(config, totals).await?,
        Command::Kinds { command } => kinds(config, command).await?,
        Command::Periodic { json } => Box::pin(periodic(config, json)).await?,
        Command::Token { name, role } => {
            let secret = format!("jf_{}", hex::encode(rand::random::<[u8; 32]>()));
            let digest = jobfold_processor::access::digest_hex(&secret);
            println!("secret (shown once; give it to {name}): {secret}");
            println!();
            println!("[[http.tokens]]");
            println!("name = {}", toml_string(&name));
            println!("role = \"{role}\"");
            println!("sha256 = \"{digest}\"");
        }
        Command::Audit { actor, action, target, limit, json } => {
            use jobfold_processor::store::audit;
            let pool = db::connect(&config, 1).await?;
            let filter =
                audit::AuditFilter { actor, action, target, before: None, limit: Some(limit) };
            let page = audit::list(&pool, &filter).await?;
            if json {
                for entry in &page.entries {
                    println!("{}", serde_json::to_string(entry)?);
                }
                return Ok(());
            }
            println!(
                "{:<19}  {:<20}  {:<7}  {:<3}  {:<20}  {:<36}  request",
                "at", "actor", "role", "via", "action", "target"
            );
            for e in &page.entries {
                println!(
                    "{:<19}  {:<20.20}  {:<7}  {:<3}  {:<20}  {:<36.36}  {}",
                    e.at.format("%Y-%m-%d %H:%M:%S"),
                    e.actor,
                    e.role.as_deref().unwrap_or("-"),
                    e.via,
                    e.action,
                    e.target.as_deref().unwrap_or("-"),
                    e.request_id.as_deref().unwrap_or("-"),
                );
            }
        }
        Command::Quarantine { command } => quarantine(config, command).await?,
        Command::Parked { command } => parked(config, command).await?,
        Command::Replay { from, since, verify, export, jobs, no_progress, dedupe_window } => {
            use jobfold_cli::analytics::{self, Export, Format, Options, Rows};
            let pool = db::connect(&config, 2).await?;
            let decoder = event_decoder(&config)?;
            let options = Options {
                source: from.source(),
                since,
                verify,
                export: export.map(|path| Export {
                    format: Format::from_path(&path),
                    rows: if jobs { Rows::Jobs } else { Rows::Events },
                    path,
                }),
                progress: !no_progress,
                dedupe_window,
            };
            let report = analytics::replay(&config, &pool, &decoder, &options).await?;
            print!("{report}");
            if let Some(export) = &options.export {
                println!("exported to {}", export.path.display());
            }
            if verify && !report.is_clean() {
                anyhow::bail!(
                    "verify failed: {} differences, {} anomalies",
                    report.difference_count,
                    report.anomaly_count
                );
            }
        }
        Command::Capacity { from, since, until, wait, quantile, headroom, json, plot } => {
            use jobfold_cli::capacity::{self, Objective, Options};
            if !(quantile > 0.0 && quantile <= 1.0) {
                eprintln!("jobfold: --quantile must be above 0 and at most 1");
                std::process::exit(EXIT_CONFIG);
            }
            if !(0.0..=1000.0).contains(&headroom) {
                eprintln!("jobfold: --headroom must be a percentage from 0 to 1000");
                std::process::exit(EXIT_CONFIG);
            }
            let pool = db::connect(&config, 2).await?;
            let decoder = event_decoder(&config)?;
            let options = Options {
                source: from.source(),
                since,
                until,
                objective: wait.map(|w| Objective {
                    wait: w.as_secs_f64(),
                    quantile,
                    headroom: headroom / 100.0,
                }),
            };
            let report = capacity::measure(&config, &pool, &decoder, &options).await?;
            print!("{report}");
            if let Some(path) = &json {
                report.write_json(path)?;
                println!("figures written to {}", path.display());
            }
            if let Some(path) = &plot {
                report.write_plot(path)?;
                println!("plot written to {}", path.display());
            }
        }
        Command::Demo { short, documents, kafka, exit } => {
            let documents = documents.unwrap_or(if short { 40 } else { 150 });
            let pace = if short { demo::SHORT_WORKLOAD } else { demo::WORKLOAD };
            demo::run(config, demo::Size { documents, exit: exit || short, pace }, kafka).await?;
        }
        Command::Bench { full, smoke, output, replay, remote, remote_hold, failover } => {
            let table = match (replay, remote, failover) {
                (Some(sizes), _, _) => replay_bench::run(config, &sizes).await?,
                (None, Some(jobs), _) => bench::run_remote(config, jobs, remote_hold).await?,
                (None, None, Some(command)) => {
                    failover_bench::run(config, command, failover_bench::Plan::new(smoke)).await?
                }
                (None, None, None) => {
                    let sizes = match (full, smoke) {
                        (true, _) => bench::Sizes::full(),
                        (_, true) => bench::Sizes::smoke(),
                        _ => bench::Sizes::quick(),
                    };
                    bench::run(config, sizes).await?
                }
            };
            println!("{table}");
            if let Some(path) = output {
                std::fs::write(&path, &table)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        Command::Soak { duration, interval, rate, documents, output } => {
            anyhow::ensure!(documents > 0, "--documents must be at least 1");
            let plan = soak::Plan { duration, interval, rate, documents };
            let (report, passed) = soak::run(config, plan).await?;
            println!("{report}");
            if let Some(path) = output {
                std::fs::write(&path, &report)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            anyhow::ensure!(passed, "the soak failed: see the report");
        }
    }
    Ok(())
}

async fn parked(config: Config, command: ParkedCommand) -> anyhow::Result<()> {
    use jobfold_relay::parked;
    let pool = db::connect_and_migrate(&config, 1).await?;
    match command {
        ParkedCommand::List { limit } => {
            let events = parked::list(&pool, limit).await?;
            if events.is_empty() {
                println!("no parked events");
                return Ok(());
            }
            println!(
                "{:>9}  {:<8}  {:<20}  {:<16}  {:>9}  {:<19}  reason",
                "seq", "state", "document", "event", "bytes", "parked at"
            );
            for e in events {
                let state = match (e.refused, e.retry_requested_at) {
                    (true, Some(_)) => "retrying",
                    (true, None) => "refused",
                    (false, _) => "waiting",
                };
                println!(
                    "{:>9}  {:<8}  {:<20}  {:<16}  {:>9}  {:<19}  {}",
                    e.seq,
                    state,
                    e.key,
                    e.event,
                    e.bytes,
                    e.parked_at.format("%Y-%m-%d %H:%M:%S"),
                    e.reason
                );
            }
        }
        ParkedCommand::Retry { which } => {
            let n = parked::request_retry(&pool, &which.selection()).await?;
            if n == 0 {
                anyhow::bail!("no refused event matches");
            }
            audited(&pool, "retry_parked", None, serde_json::json!({ "events": n })).await?;
            println!("{n} refused event(s) will be sent again, with the events behind them");
        }
        ParkedCommand::Drop { which } => {
            let n = parked::drop_refused(&pool, &which.selection()).await?;
            if n == 0 {
                anyhow::bail!("no refused event matches");
            }
            audited(&pool, "drop_parked", None, serde_json::json!({ "events": n })).await?;
            println!("{n} refused event(s) dropped; the events behind them go out in order");
        }
    }
    Ok(())
}

/// A role's name as `--role` takes it.
fn parse_role(value: &str) -> Result<jobfold_common::config::Role, String> {
    jobfold_common::config::Role::ALL
        .into_iter()
        .find(|r| r.as_str() == value)
        .ok_or_else(|| format!("{value:?} is not a role: read, submit, operate or admin"))
}

/// `value` as a TOML basic string.
fn toml_string(value: &str) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// Records a change this command made in the database directly, as its operating-system
/// user, in the audit trail (in the change's transaction where it has one).
async fn audited<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    action: &str,
    target: Option<&str>,
    detail: serde_json::Value,
) -> anyhow::Result<()> {
    let actor = jobfold_processor::store::audit::Actor::os_user();
    jobfold_processor::store::audit::record(executor, &actor, action, target, detail)
        .await
        .context("recording the change in the audit trail")
}

/// Appends events as the command line (`producer` jobfold-cli).
async fn cli_events(config: &Config) -> anyhow::Result<jobfold_processor::store::Events> {
    let settings = config.registry()?;
    let codec = Codec::<JobEvent>::connect(settings, &config.topics.events).await?;
    Ok(jobfold_processor::store::Events {
        codec,
        topic: config.topics.events.clone(),
        producer: "jobfold-cli".into(),
    })
}

async fn periodic(config: Config, json: bool) -> anyhow::Result<()> {
    let pool = db::connect(&config, 1).await?;
    let schedules = jobfold_processor::periodic::schedules(&config, &pool).await?;
    let at = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string()).unwrap_or_default()
    };
    if !json {
        println!(
            "{:<20}  {:<20}  {:<16}  {:<19}  {:<19}  last job / error",
            "schedule", "kind", "cron", "next tick (UTC)", "last tick (UTC)"
        );
    }
    for s in &schedules {
        if json {
            println!("{}", serde_json::to_string(s)?);
            continue;
        }
        let last = match (&s.last_error, s.last_job_id) {
            (Some(error), _) => error.clone(),
            (None, Some(job_id)) => job_id.to_string(),
            (None, None) => String::new(),
        };
        println!(
            "{:<20.20}  {:<20.20}  {:<16.16}  {:<19}  {:<19}  {last}",
            s.name,
            s.kind,
            s.cron,
            at(s.next_tick),
            at(s.last_tick)
        );
    }
    if !json && schedules.is_empty() {
        println!("no [periodic.<name>] schedules in this configuration");
    }
    Ok(())
}

async fn kinds(config: Config, command: KindCommand) -> anyhow::Result<()> {
    use jobfold_processor::store::kinds::{self, KindControl};
    match command {
        KindCommand::List { json } => {
            let pool = db::connect(&config, 1).await?;
            let (listed, _) =
                jobfold_processor::history::kind_table(&pool, &config, 60, None).await?;
            if json {
                for kind in &listed {
                    println!("{}", serde_json::to_string(kind)?);
                }
                return Ok(());
            }
            print!("{}", kind_lines(&listed));
        }
        KindCommand::Pause { kind, reason, by } => {
            let pool = db::connect_and_migrate(&config, 1).await?;
            let request = KindControl { requested_by: Some(by), reason };
            let said = serde_json::json!({ "reason": request.reason, "requested_by": request.requested_by });
            let changed = kinds::pause(&pool, &kind, request).await?;
            let detail = serde_json::json!({ "request": said, "done": changed });
            audited(&pool, "pause_kind", Some(&kind), detail).await?;
            report::kind_changed(&kind, &changed, true);
        }
        KindCommand::Resume { kind, reason, by } => {
            let pool = db::connect_and_migrate(&config, 1).await?;
            let events = cli_events(&config).await?;
            let request = KindControl { requested_by: Some(by), reason };
            let said = serde_json::json!({ "reason": request.reason, "requested_by": request.requested_by });
            let changed = kinds::resume(&pool, &events, &kind, request).await?;
            let detail = serde_json::json!({ "request": said, "done": changed });
            audited(&pool, "resume_kind", Some(&kind), detail).await?;
            report::kind_changed(&kind, &changed, false);
        }
    }
    Ok(())
}

/// `jobfold kinds list`'s table: each kind's state, open jobs, the last hour's outcomes and
/// times (the upper bound of each one's bucket, in ms), and a pause's since, by and why.
fn kind_lines(kinds: &[serde_json::Value]) -> String {
    use std::fmt::Write;
    let ms = |v: &serde_json::Value| match v.as_i64() {
        None => "–".to_owned(),
        Some(i64::MAX) => "more".to_owned(),
        Some(ms) => ms.to_string(),
    };
    let mut out = format!(
        "{:<24}  {:<7}  {:>6}  {:>7}  {:>5}  {:>9}  {:>6}  {:>6}  {:>11}  {:>11}  {}\n",
        "kind",
        "state",
        "queued",
        "running",
        "retry",
        "done 1h",
        "failed",
        "quar.",
        "wait p50/99",
        "run p50/99",
        "paused since, by, why"
    );
    for k in kinds {
        let (open, ended) = (&k["open"], &k["ended"]);
        let pause = match k["paused"].as_bool() {
            Some(true) => format!(
                "{} {} {} ({} waiting)",
                k["paused_at"].as_str().map_or("", |at| at.get(..19).unwrap_or(at)),
                k["paused_by"].as_str().unwrap_or(""),
                k["reason"].as_str().unwrap_or(""),
                k["waiting"]
            ),
            _ => String::new(),
        };
        let line = format!(
            "{:<24.24}  {:<7}  {:>6}  {:>7}  {:>5}  {:>9}  {:>6}  {:>6}  {:>11}  {:>11}  {}",
            k["kind"].as_str().unwrap_or(""),
            if k["paused"].as_bool() == Some(true) { "paused" } else { "running" },
            open["queued"].as_i64().unwrap_or(0),
            open["leased"].as_i64().unwrap_or(0),
            open["retry_wait"].as_i64().unwrap_or(0),
            ended["succeeded"].as_i64().unwrap_or(0),
            ended["failed"].as_i64().unwrap_or(0),
            ended["quarantined"].as_i64().unwrap_or(0),
            format!("{}/{}", ms(&ended["wait_p50_ms"]), ms(&ended["wait_p99_ms"])),
            format!("{}/{}", ms(&ended["run_p50_ms"]), ms(&ended["run_p99_ms"])),
            pause.trim(),
        );
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

fn print_jobs(page: &status::JobPage, json: bool) -> anyhow::Result<()> {
    if json {
        for job in &page.jobs {
            println!("{}", serde_json::to_string(job)?);
        }
        return Ok(());
    }
    println!(
        "{:<36}  {:<11}  {:<20}  {:<20}  {:>7}  {:>7}  {:<19}  due / last error",
        "job", "state", "kind", "document", "version", "attempt", "accepted"
    );
    for j in &page.jobs {
        let note = match (&j.run_at, &j.last_error) {
            (Some(at), _) if j.state == "queued" => {
                format!("due {}", at.format("%Y-%m-%d %H:%M:%S"))
            }
            (_, Some(error)) => error.chars().take(60).collect(),
            _ => String::new(),
        };
        println!(
            "{:<36}  {:<11}  {:<20.20}  {:<20.20}  {:>7}  {:>7}  {:<19}  {note}",
            j.job_id,
            j.state,
            j.kind,
            j.document_id,
            j.input_version,
            format!("{}/{}", j.attempt, j.max_attempts),
            j.accepted_at.format("%Y-%m-%d %H:%M:%S"),
        );
    }
    match page.next {
        Some(next) => println!("{} job(s); next page: --after {next}", page.jobs.len()),
        None => println!("{} job(s); last page", page.jobs.len()),
    }
    Ok(())
}

async fn dead_letters(config: Config, command: DeadLetterCommand) -> anyhow::Result<()> {
    use jobfold_processor::dead_letter;
    let pool = db::connect_and_migrate(&config, 1).await?;
    match command {
        DeadLetterCommand::List { topic, after, limit } => {
            let filter = dead_letter::DeadLetterFilter {
                topic,
                consumer_group: None,
                after,
                limit: Some(limit),
            };
            let page = dead_letter::list(&pool, &filter).await?;
            println!(
                "{:>7}  {:<24}  {:>9}  {:>10}  {:<19}  {:>10}  error",
                "id", "topic", "partition", "offset", "received", "reinjected"
            );
            for d in &page.dead_letters {
                println!(
                    "{:>7}  {:<24.24}  {:>9}  {:>10}  {:<19}  {:>10}  {}",
                    d.id,
                    d.topic,
                    d.kafka_partition,
                    d.kafka_offset,
                    d.received_at.format("%Y-%m-%d %H:%M:%S"),
                    d.reinjected_count,
                    d.error
                );
            }
            match page.next {
                Some(next) => println!("next page: --after {next}"),
                None => println!("{} dead letter(s) shown", page.dead_letters.len()),
            }
        }
        DeadLetterCommand::Show { id, json } => {
            let Some(d) = dead_letter::show(&pool, id).await? else {
                anyhow::bail!("no dead letter {id}");
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&d)?);
                return Ok(());
            }
            let l = &d.letter;
            let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
            for (name, value) in [
                ("id", l.id.to_string()),
                (
                    "coordinates",
                    format!("{} [{}] @ {}", l.topic, l.kafka_partition, l.kafka_offset),
                ),
                ("group", l.consumer_group.clone()),
                ("received", l.received_at.to_rfc3339()),
                ("error", l.error.clone()),
                ("reinjected", format!("{} time(s)", l.reinjected_count)),
                ("key (hex)", dash(&d.key_hex)),
                ("key (text)", dash(&d.key_text)),
                ("value (hex)", dash(&d.value_hex)),
                ("value (text)", dash(&d.value_text)),
            ] {
                println!("{name:<13} {value}");
            }
        }
        DeadLetterCommand::Reinject { id } => {
            let sent = dead_letter::reinject(&pool, &config, id).await?;
            let detail = serde_json::json!({ "sent": sent });
            audited(&pool, "reinject_dead_letter", Some(&id.to_string()), detail).await?;
            report::reinjected(id, &sent);
        }
        DeadLetterCommand::Delete { id } => {
            anyhow::ensure!(dead_letter::delete(&pool, id).await?, "no dead letter {id}");
            audited(&pool, "delete_dead_letter", Some(&id.to_string()), serde_json::json!({}))
                .await?;
            report::dead_letter_deleted(id);
        }
    }
    Ok(())
}

async fn quarantine(config: Config, command: QuarantineCommand) -> anyhow::Result<()> {
    let pool = db::connect_and_migrate(&config, 2).await?;
    match command {
        QuarantineCommand::List { owner, kind, reason, since, until, limit } => {
            let filter = QuarantineFilter { owner, kind, reason, since, until, limit: Some(limit) };
            let rows = status::quarantined(&pool, &filter).await?;
            println!(
                "{:<36}  {:<16}  {:<20}  {:>7}  {:<13}  {:<18}  {:>8}  {:<20}  reason",
                "job", "kind", "document", "version", "class", "owner", "attempts", "since"
            );
            for q in &rows {
                println!(
                    "{:<36}  {:<16.16}  {:<20.20}  {:>7}  {:<13}  {:<18.18}  {:>8}  {:<20}  {}",
                    q.job_id,
                    q.kind,
                    q.document_id,
                    q.input_version,
                    q.error_class,
                    q.owner,
                    q.attempts,
                    q.quarantined_at.format("%Y-%m-%d %H:%M:%S"),
                    q.reason
                );
            }
            println!("{} quarantined job(s) shown", rows.len());
        }
        command @ QuarantineCommand::Replay { job_id: None, .. } => {
            let events = cli_events(&config).await?;
            let request = command.into_bulk_replay().expect("a replay by filter");
            let said = serde_json::json!({ "filter": request.filter, "limit": request.limit });
            let done = jobfold_processor::store::replay_matching(
                &pool,
                &events,
                &config.accept_policy(),
                request,
            )
            .await?;
            if !done.dry_run {
                let detail = serde_json::json!({ "request": said, "done": done });
                audited(&pool, "replay_matching", None, detail).await?;
            }
            report::bulk_replayed(&done);
        }
        QuarantineCommand::Replay {
            job_id: Some(job_id), new_input_version, input, by, ..
        } => {
            let new_input = input
                .map(|i| serde_json::from_str(&i))
                .transpose()
                .context("--input is not JSON")?;
            let events = cli_events(&config).await?;
            let request = jobfold_processor::store::Replay {
                requested_by: Some(by),
                new_input_version,
                new_input,
            };
            let mut tx = pool.begin().await?;
            let job = jobfold_processor::store::replay(
                &mut tx,
                &events,
                &config.accept_policy(),
                job_id,
                request,
            )
            .await?;
            let detail = serde_json::json!({ "input_version": job.input_version });
            audited(&mut *tx, "replay", Some(&job_id.to_string()), detail).await?;
            tx.commit().await?;
            report::replayed(job_id, job.input_version);
        }
    }
    Ok(())
}

async fn status(config: Config, job_id: uuid::Uuid, json: bool) -> anyhow::Result<()> {
    let pool = db::connect(&config, 1).await?;
    let Some(job) = status::job(&pool, job_id).await? else {
        anyhow::bail!("no job {job_id}");
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&job)?);
        return Ok(());
    }
    let time = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map_or_else(|| "-".to_owned(), |t| t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string())
    };
    let rows: Vec<(&str, String)> = vec![
        ("job", job.job_id.to_string()),
        ("document", job.document_id.clone()),
        ("kind", job.kind.clone()),
        ("input version", job.input_version.to_string()),
        ("state", job.state.clone()),
        ("attempt", format!("{} of {}", job.attempt, job.max_attempts)),
        ("generation", job.generation.to_string()),
        (
            "lease",
            match (&job.lease_owner, job.lease_until) {
                (Some(owner), until) => format!("{owner} until {}", time(until)),
                _ => "-".into(),
            },
        ),
        ("next attempt", time(job.next_attempt_at)),
        ("deadline", time(job.deadline)),
        ("accepted", time(Some(job.accepted_at))),
        ("due", time(job.run_at)),
        ("finished", time(job.finished_at)),
        ("last error", job.last_error.clone().unwrap_or_else(|| "-".into())),
        ("last attempt", job.previous_outcome.clone().unwrap_or_else(|| "-".into())),
        (
            "progress",
            match (&job.progress, job.progress_at) {
                (Some(progress), at) => format!("{progress} at {}", time(at)),
                _ => "-".into(),
            },
        ),
        (
            "quarantine",
            match (&job.quarantine_owner, &job.quarantine_reason) {
                (Some(owner), Some(reason)) => format!("{reason} (owner: {owner})"),
                _ => "-".into(),
            },
        ),
        ("events", job.stream_version.to_string()),
    ];
    for (name, value) in rows {
        println!("{name:<14} {value}");
    }
    Ok(())
}

async fn events(config: Config, job_id: uuid::Uuid, json: bool) -> anyhow::Result<()> {
    let pool = db::connect(&config, 1).await?;
    let decoder = jobfold_schemas::Decoder::<JobEvent>::new(config.registry()?);
    let Some(entries) = status::events(&pool, &decoder, job_id).await? else {
        anyhow::bail!("no job {job_id}");
    };
    if json {
        for entry in &entries {
            println!("{}", serde_json::to_string(entry)?);
        }
        return Ok(());
    }
    println!(
        "{:>7}  {:>3}  {:<23}  {:<17}  {:<9}  details",
        "seq", "v", "at", "event", "published"
    );
    for entry in &entries {
        let mut details = entry.event["payload"].clone();
        if let Some(fields) = details.as_object_mut() {
            fields.remove("type");
            // Inputs and results can be long; `--json` shows them whole.
            for long in ["input", "result", "new_input"] {
                if let Some(serde_json::Value::String(text)) = fields.get_mut(long)
                    && text.len() > 60
                {
                    text.truncate(text.floor_char_boundary(57));
                    text.push_str("...");
                }
            }
        }
        println!(
            "{:>7}  {:>3}  {:<23}  {:<17}  {:<9}  {details}",
            entry.seq,
            entry.stream_version,
            entry.occurred_at.format("%Y-%m-%d %H:%M:%S%.3f"),
            entry.kind,
            if entry.published { "yes" } else { "waiting" },
        );
    }
    Ok(())
}

async fn stats(config: Config, totals: bool) -> anyhow::Result<()> {
    let pool = db::connect(&config, 2).await?;
    let snapshot = gauges::read(&pool).await?;
    let mut rows: Vec<(String, String)> =
        vec![("unfinished (accepted, not ended)".into(), snapshot.unfinished().to_string())];
    for (state, count) in &snapshot.jobs {
        rows.push((format!("  {state}"), count.to_string()));
    }
    rows.extend([
        ("  of them scheduled for later".into(), snapshot.scheduled.to_string()),
        (
            "oldest queued age (since due)".into(),
            format!("{:.1} s", snapshot.oldest_queued_age_seconds),
        ),
        ("expired leases".into(), snapshot.expired_leases.to_string()),
        ("quarantined".into(), snapshot.quarantined_total().to_string()),
    ]);
    for (owner, count) in &snapshot.quarantined {
        rows.push((format!("  owner {owner}"), count.to_string()));
    }
    rows.extend([
        ("dead letters".into(), snapshot.dead_letters.to_string()),
        ("relay backlog".into(), snapshot.relay_backlog.to_string()),
        ("parked events (jobfold parked list)".into(), snapshot.relay_parked.to_string()),
        (
            "oldest unpublished age".into(),
            format!("{:.1} s", snapshot.relay_oldest_unpublished_age_seconds),
        ),
        (
            "commits waiting for the standby".into(),
            format!(
                "{} (longest {:.1} s)",
                snapshot.commits_waiting_for_standby, snapshot.longest_standby_wait_seconds
            ),
        ),
    ]);
    if totals {
        let counts = gauges::totals(&pool).await?;
        let accepted: i64 = counts.values().sum();
        rows.push(("accepted (all time)".into(), accepted.to_string()));
        for (state, count) in &counts {
            rows.push((format!("  {state}"), count.to_string()));
        }
    }
    let width = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    for (name, value) in rows {
        println!("{name:<width$}  {value:>10}");
    }
    Ok(())
}

/// Migrations applied so far (0 before the first run).
async fn applied(pool: &sqlx::PgPool) -> i64 {
    use sqlx::migrate::Migrate;
    let Ok(mut conn) = pool.acquire().await else { return 0 };
    conn.list_applied_migrations().await.map_or(0, |applied| applied.len() as i64)
}
