//! `jobfold-processor`: accepts jobs (HTTP API, intake topic) and runs them.
//!
//! Invariant: a Kafka offset is stored only after the Postgres transaction holding what the
//! message caused (an accepted job, a dead letter) has committed.
//!
//! # Layout
//! - [`run`]: starts every part and stops them together.
//! - [`http`]: the HTTP API (`POST /v1/jobs`, `GET /v1/jobs/{id}`, quarantine, metrics,
//!   health); [`status`] holds the read queries it shares with the command line.
//! - gauges: every `processor.gauge_interval`, [`jobfold_common::gauges`] read from Postgres
//!   and published as Prometheus gauges.
//! - [`intake`]: the consumer turning `jobfold.job-requests` messages into accepted jobs.
//! - [`worker`]: the consumer group member that leases, runs and completes jobs; [`lease`]
//!   decides the dispatches waiting at once in one transaction ([`lease::decide()`], pure),
//!   [`complete`] commits the attempts finished at once in one ([`batch`] gathers them),
//!   [`retry`] says when a failed or throttled attempt runs again, [`quota`] holds a kind
//!   to its provider's rate; [`heartbeat`] keeps the leases of running jobs;
//!   [`offsets`] tracks what may be committed, [`buffer`] bounds what a partition holds;
//!   [`store`] holds the transactions and the operator's (replay, cancel);
//!   [`reaper`] dispatches expired leases and stalled jobs again, [`retention`] deletes
//!   what ended long ago; [`supervise`] keeps these background tasks to the worker's life
//!   (one that ends stops the process).
//! - The `jobfold` command line is the `jobfold-cli` crate; it reads through [`status`] and
//!   [`store`] as the HTTP API does.
//! - [`dead_letter`]: poison messages kept with their coordinates and raw bytes.
//! - [`handler`]: the trait users implement and the registry by kind; [`remote`] runs a kind
//!   by calling a URL (handlers in any language).
//! - [`metrics`]: the processor's metric names; [`internal_events`]: what it reports, each
//!   event's log line and metrics in one call, and the errors that say where in Kafka the
//!   message they are about sits.
//!
//! Shutdown: the HTTP server stops accepting connections and finishes requests in flight;
//! the intake finishes the message in flight and commits its stored offsets.

pub mod access;
pub mod batch;
pub mod buffer;
pub mod callback;
pub mod complete;
pub mod console;
pub mod dead_letter;
pub mod handler;
pub mod heartbeat;
pub mod history;
pub mod http;
pub mod intake;
pub mod internal_events;
pub mod lag;
pub mod lease;
pub mod metrics;
pub mod offsets;
pub mod panics;
pub mod pauses;
pub mod periodic;
pub mod presence;
pub mod quota;
pub mod reaper;
pub mod remote;
pub mod retention;
pub mod retry;
pub mod signature;
pub mod status;
pub mod store;
pub mod supervise;
pub mod worker;

use anyhow::Context;
use jobfold_common::accept::Acceptor;
use jobfold_common::config::Config;
use jobfold_common::{db, gauges, kafka};

use crate::metrics as m;
use jobfold_schemas::{Codec, Decoder, JobEvent, JobRequest};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Request bodies may exceed the input limit by this much (the other fields).
pub const BODY_OVERHEAD_BYTES: usize = 4096;

/// Runs the shipped processor until `shutdown` is cancelled or a part fails (which stops the
/// rest): it runs the kinds whose configuration names a URL (`[kinds.<kind>] url`, handlers
/// in any language, [`remote`]). To run handlers written in Rust, embed a [`Processor`].
///
/// # Errors
/// Start-up failed, or a part failed.
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    Processor::builder(config).run(shutdown).await
}

/// A processor to embed in a binary of your own, with the handlers it runs, by kind:
///
/// ```no_run
/// # use jobfold_processor::handler::{Handler, HandlerError, JobContext};
/// # use tokio_util::sync::CancellationToken;
/// struct Shout;
///
/// impl Handler for Shout {
///     async fn run(&self, job: &JobContext, _: CancellationToken) -> Result<serde_json::Value, HandlerError> {
///         Ok(job.input["text"].as_str().unwrap_or_default().to_uppercase().into())
///     }
/// }
///
/// # async fn example(config: jobfold_common::config::Config) -> anyhow::Result<()> {
/// let shutdown = jobfold_common::shutdown::on_signal();
/// jobfold_processor::Processor::builder(config).handler("shout", Shout).run(shutdown).await
/// # }
/// ```
///
/// Kinds whose configuration names a URL (`[kinds.<kind>] url`) are run by calling it
/// ([`remote::Remote`]), unless a handler is registered here for them.
///
/// A job whose kind has no handler here is neither run nor quarantined: its document waits
/// (`jobfold_waiting_for_handler`) until a processor that has the handler takes its partition,
/// as in a rolling deploy that adds a kind.
///
/// Each part can be switched off, so that a service with an HTTP server of its own runs the
/// worker alone: `Processor::builder(config).api(false).intake(false).gauges(false)`.
#[derive(Debug)]
pub struct Processor {
    config: Config,
    handlers: handler::Handlers,
    parts: Parts,
}

/// The parts a [`Processor`] runs besides its handlers.
#[derive(Debug, Clone, Copy)]
struct Parts {
    api: bool,
    gauges: bool,
    intake: bool,
    worker: bool,
}

impl Processor {
    /// A processor with no handlers yet, running every part its configuration turns on: the
    /// HTTP API, the gauges, the worker (`processor.enabled`) and the intake
    /// (`intake.enabled`).
    pub fn builder(config: Config) -> Self {
        let parts = Parts {
            api: true,
            gauges: true,
            intake: config.intake.enabled,
            worker: config.processor.enabled,
        };
        Self { config, handlers: handler::Handlers::new(), parts }
    }

    /// Whether to serve the HTTP API on `http_addr`: accept, reads, operator calls and
    /// callbacks. Off, remote handlers answering `202` call back the API at
    /// `processor.callback_base_url`, which must then be set.
    #[must_use]
    pub fn api(mut self, on: bool) -> Self {
        self.parts.api = on;
        self
    }

    /// Whether to publish the unfinished-work gauges (one read of Postgres each
    /// `processor.gauge_interval`; one processor of a group is enough).
    #[must_use]
    pub fn gauges(mut self, on: bool) -> Self {
        self.parts.gauges = on;
        self
    }

    /// Whether to consume the intake topic (default: `intake.enabled`).
    #[must_use]
    pub fn intake(mut self, on: bool) -> Self {
        self.parts.intake = on;
        self
    }

    /// Whether to run jobs (default: `processor.enabled`); off, the processor only accepts.
    #[must_use]
    pub fn worker(mut self, on: bool) -> Self {
        self.parts.worker = on;
        self
    }

    /// Runs jobs of `kind` with `handler`.
    #[must_use]
    pub fn handler(mut self, kind: impl Into<String>, handler: impl handler::Handler) -> Self {
        self.handlers = self.handlers.with(kind, handler);
        self
    }

    /// Runs every kind of `handlers` too (replacing handlers of the same kinds).
    #[must_use]
    pub fn handlers(mut self, handlers: handler::Handlers) -> Self {
        self.handlers = self.handlers.merged(handlers);
        self
    }

    /// Records this processor's kinds in `job_kinds`, as [`Processor::run`] does at start:
    /// call it first to have jobs of these kinds accepted before the processor runs.
    ///
    /// # Errors
    /// The write failed.
    pub async fn register_kinds(&self, pool: &sqlx::PgPool) -> anyhow::Result<()> {
        let by = format!("jobfold-processor/{}", std::process::id());
        handler::register(&self.resolved()?, pool, &by).await.context("registering the job kinds")
    }

    /// The handlers registered in code, and a [`remote::Remote`] for each configured URL of a
    /// kind without one.
    fn resolved(&self) -> anyhow::Result<handler::Handlers> {
        let mut handlers = self.handlers.clone();
        for (kind, settings) in &self.config.kinds {
            if let Some(url) = &settings.url
                && handlers.get(kind).is_none()
            {
                let remote = remote::Remote::for_kind(url.expose(), &self.config.kind(kind))
                    .with_context(|| format!("the handler of kind {kind} at {url}"))?
                    .with_cost_pointer(settings.cost_pointer.clone());
                handlers = handlers.with(kind.clone(), remote);
            }
        }
        Ok(handlers)
    }

    /// Runs until `shutdown` is cancelled or a part fails (which stops the rest).
    ///
    /// # Errors
    /// Start-up failed, or a part failed.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let handlers = self.resolved()?;
        if self.parts.worker && !self.parts.api && self.config.processor.callback_base_url.is_none()
        {
            // A remote handler answering 202 would be told to call back an address nobody serves.
            return Err(jobfold_common::config::ConfigError::Invalid {
                key: "processor.callback_base_url",
                problem: "must name a processor's API when this one serves none".into(),
            }
            .into());
        }
        // A handler's panics are its jobs' failures, reported without a backtrace.
        panics::install();
        serve(self.config, handlers, self.parts, shutdown).await
    }
}

async fn serve(
    config: Config,
    handlers: handler::Handlers,
    run: Parts,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let pool = db::connect_and_migrate(&config, config.processor.db_connections).await?;
    kafka::ensure_topics(&config, &kafka::jobfold_topics(&config))
        .await
        .context("creating the topics")?;
    // A result or input the topic could refuse would stall its document on the relay.
    kafka::check_topics(&config).await?;
    m::describe();
    tracing::info!(?config, "Starting the processor.");
    let settings = config.registry().context("configuring the schema registry client")?;
    let codec = Codec::<JobEvent>::connect(settings.clone(), &config.topics.events)
        .await
        .context("registering the job event schema")?;
    let producer = format!("jobfold-processor/{}", std::process::id());
    if run.worker {
        handler::register(&handlers, &pool, &producer)
            .await
            .context("registering the job kinds")?;
        tracing::info!(kinds = ?handlers, "Running these job kinds.");
    }
    let acceptor = Acceptor::new(codec.clone(), config.accept_policy(), producer.clone());

    let events =
        store::Events { codec: codec.clone(), topic: config.topics.events.clone(), producer };
    let mut parts = JoinSet::new();
    if run.gauges {
        parts.spawn(publish_gauges(
            pool.clone(),
            config.processor.gauge_interval,
            shutdown.clone(),
        ));
    }
    if run.api {
        let state =
            http::ApiState::new(pool.clone(), acceptor.clone(), events.clone(), config.clone());
        let (addr, max_body) =
            (config.http_addr, config.accept.max_input_bytes + BODY_OVERHEAD_BYTES);
        parts.spawn(serve_api(state, addr, max_body, shutdown.clone()));
    }
    if run.worker {
        parts.spawn(worker::run(
            config.clone(),
            pool.clone(),
            codec.decoder().clone(),
            events,
            handlers,
            shutdown.clone(),
        ));
    }
    if !config.periodic.is_empty() {
        let owner = format!("{}/{}", worker::hostname(), std::process::id());
        parts.spawn(periodic::run(
            config.clone(),
            pool.clone(),
            acceptor.clone(),
            owner,
            shutdown.clone(),
        ));
    }
    if run.intake {
        let intake =
            intake::Intake::new(&config, Decoder::<JobRequest>::new(settings), acceptor, pool)?;
        parts.spawn(intake.run(shutdown.clone()));
    }
    let mut result = Ok(());
    while let Some(done) = parts.join_next().await {
        let outcome = done.context("a processor task panicked").and_then(|r| r);
        if let Err(e) = outcome {
            tracing::error!(error = %format!("{e:#}"), "A processor part failed; stopping.");
            shutdown.cancel();
            result = Err(e);
        }
    }
    result
}

/// Serves the API with `state` until `shutdown`; then waits (bounded) for what it started:
/// the accepts still committing, and then the group commit's tasks.
async fn serve_api(
    state: http::ApiState,
    addr: std::net::SocketAddr,
    max_body: usize,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let work = state.work();
    // The router, and the state in it, are dropped when the server ends.
    let served = http::serve(addr, http::router(state, max_body), shutdown).await;
    work.join("the HTTP API", supervise::JOIN_TIMEOUT).await;
    served
}

/// Reads the unfinished-work gauges from Postgres every `interval` and publishes them. A
/// failed read is logged and retried at the next tick; it never stops the processor.
async fn publish_gauges(
    pool: sqlx::PgPool,
    interval: std::time::Duration,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut publisher = gauges::Publisher::default();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        match gauges::read(&pool).await {
            Ok(snapshot) => publisher.publish(&snapshot),
            Err(e) => {
                tracing::warn!(error = %e, "Reading the gauges failed; next try in one interval.")
            }
        }
    }
}
