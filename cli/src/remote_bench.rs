//! `jobfold bench`'s long remote jobs: many jobs of a kind run by a handler over HTTP/2 that
//! answers `202` and completes by calling back, all in flight in one `jobfold-processor` at
//! once — its memory, what keeping their leases costs, and the callbacks' rates.
//!
//! The handler is a stand-in in this process (h2c, one route): it answers each call `202`
//! and keeps its job until told; then sends one heartbeat for each job (the rate callbacks
//! are taken at), waits, and completes them all.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_common::config::Config;
use jobfold_processor::metrics as pm;
use serde_json::{Value, json};
use sqlx::PgPool;

/// The remote kind's name.
pub(crate) const KIND: &str = "remote-slow";

/// Callbacks the stand-in sends at once.
const CALLBACKS_AT_ONCE: usize = 64;

/// Connections the stand-in accepted, counted as each is made.
static CONNECTIONS: AtomicUsize = AtomicUsize::new(0);

#[derive(Clone, Debug)]
struct Counted;

impl
    axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, tokio::net::TcpListener>>
    for Counted
{
    fn connect_info(_: axum::serve::IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        CONNECTIONS.fetch_add(1, Ordering::SeqCst);
        Self
    }
}

/// A call the stand-in answered 202: where and as what to call back.
#[derive(Debug, Clone)]
struct Held {
    heartbeat_url: String,
    complete_url: String,
    kind: String,
    generation: i64,
}

/// The stand-in handler.
struct Standin {
    addr: SocketAddr,
    held: Arc<Mutex<Vec<Held>>>,
    client: reqwest::Client,
}

impl Standin {
    async fn start() -> anyhow::Result<Self> {
        let held: Arc<Mutex<Vec<Held>>> = Arc::default();
        let keep = Arc::clone(&held);
        let app = axum::Router::new().route(
            "/run",
            axum::routing::post(move |axum::Json(call): axum::Json<Value>| {
                let keep = Arc::clone(&keep);
                async move {
                    let field = |name: &str| call[name].as_str().unwrap_or_default().to_owned();
                    keep.lock().unwrap_or_else(|e| e.into_inner()).push(Held {
                        heartbeat_url: field("heartbeat_url"),
                        complete_url: field("complete_url"),
                        kind: field("kind"),
                        generation: call["generation"].as_i64().unwrap_or_default(),
                    });
                    axum::http::StatusCode::ACCEPTED
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            axum::serve(listener, app.into_make_service_with_connect_info::<Counted>()).await
        });
        // Callbacks to the processor's API share a connection too (it answers h2c).
        let client = reqwest::Client::builder().http2_prior_knowledge().build()?;
        Ok(Self { addr, held, client })
    }

    fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Sends one callback for every held job (`heartbeat` or the completion); how many were
    /// answered 200.
    async fn call_back_all(&self, heartbeat: bool) -> usize {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner()).clone();
        futures::stream::iter(held)
            .map(|h| {
                let client = self.client.clone();
                async move {
                    let (url, body) = if heartbeat {
                        let progress = json!({ "kind": h.kind, "generation": h.generation,
                                               "progress": { "done": 0.5 } });
                        (h.heartbeat_url, progress)
                    } else {
                        let done = json!({ "kind": h.kind, "generation": h.generation,
                                           "result": { "ok": true } });
                        (h.complete_url, done)
                    };
                    client
                        .post(url)
                        .json(&body)
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == reqwest::StatusCode::OK)
                }
            })
            .buffer_unordered(CALLBACKS_AT_ONCE)
            .filter(|ok| std::future::ready(*ok))
            .count()
            .await
    }
}

/// What the measurement found.
pub(crate) struct Measured {
    pub(crate) jobs: usize,
    /// From the first accept until every job was in flight (held by the stand-in).
    pub(crate) to_in_flight: Duration,
    /// The processor's resident memory with every job in flight, and its peak.
    pub(crate) rss_mib: f64,
    pub(crate) peak_rss_mib: f64,
    /// Heartbeat statements the processor ran a second while they were held.
    pub(crate) heartbeat_statements_per_sec: f64,
    /// Heartbeat callbacks answered a second, one for each job.
    pub(crate) heartbeats_per_sec: f64,
    /// Completions called back until every job succeeded, a second.
    pub(crate) completions_per_sec: f64,
    /// Connections the processor opened to the handler.
    pub(crate) connections: usize,
}

impl Measured {
    /// What the row of the jobs in flight says.
    pub(crate) fn note(&self) -> String {
        format!(
            "all {} in flight in one processor {:.1} s after the first accept, over {} \
             connection(s) to the handler; their leases kept by {:.1} heartbeat statements/s (one \
             a beat for all); {:.0} heartbeat callbacks/s answered, then {:.0} completions/s \
             (one statement each, {CALLBACKS_AT_ONCE} at once)",
            self.jobs,
            self.to_in_flight.as_secs_f64(),
            self.connections,
            self.heartbeat_statements_per_sec,
            self.heartbeats_per_sec,
            self.completions_per_sec,
        )
    }

    /// What the memory row says.
    pub(crate) fn rss_note(&self) -> String {
        format!(
            "{:.1} MiB while all were held (VmRSS), {:.1} MiB at most (VmHWM)",
            self.rss_mib, self.peak_rss_mib
        )
    }
}

/// Runs `batch` (jobs of [`KIND`]) in one processor (the `jobfold-processor` in `bin`, logging
/// to `logs`, in `config`'s database, topics and group), all in flight at once, held
/// `hold`; `offset` jobs were accepted in the database before.
pub(crate) async fn measure(
    config: &Config,
    pool: &PgPool,
    acceptor: &Acceptor,
    (bin, logs): (&std::path::Path, &std::path::Path),
    offset: usize,
    batch: Vec<NewJob>,
    hold: Duration,
) -> anyhow::Result<Measured> {
    let jobs = batch.len();
    let standin = Standin::start().await?;
    let file = logs.join("remote.toml");
    std::fs::write(
        &file,
        format!(
            "[kinds.{KIND}]\nurl = \"http://{}/run\"\nhttp2 = true\ninline_window = \"0s\"\n\
             callback_timeout = \"600s\"\nrun_timeout = \"30min\"\n",
            standin.addr
        ),
    )?;
    let mut config = config.clone();
    config.processor.max_in_flight = config.processor.max_in_flight.max(jobs + 24);
    let args = ["--config".to_owned(), file.display().to_string()];
    let mut process = crate::demo::spawn(
        &config,
        &bin.join("jobfold-processor"),
        "processor-remote",
        logs,
        &args,
    )?;
    crate::demo::wait_ready(process.http).await?;
    let pid = process.child.id().context("the remote processor's pid")?;
    let started = Instant::now();
    while crate::demo::metric_sum(process.metrics, pm::ASSIGNED_PARTITIONS, "").await.unwrap_or(0.0)
        < config.topics.partitions as f64
    {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(60), "no partitions assigned");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let started = Instant::now();
    for chunk in batch.chunks(1000) {
        acceptor.accept_batch(pool, chunk).await?;
    }
    let mut rss = 0f64;
    while standin.held() < jobs {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "{} of {jobs} remote jobs in flight after 600 s",
            standin.held()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let to_in_flight = started.elapsed();

    let beats = |port| crate::demo::metric_sum(port, pm::HEARTBEAT_STATEMENTS_TOTAL, "");
    let heartbeats_started = Instant::now();
    let answered = standin.call_back_all(true).await;
    let heartbeat_secs = heartbeats_started.elapsed().as_secs_f64();
    anyhow::ensure!(answered == jobs, "{answered} of {jobs} heartbeats answered 200");
    let (beats_before, held_since) = (beats(process.metrics).await.unwrap_or(0.0), Instant::now());
    while held_since.elapsed() < hold {
        rss = rss.max(crate::demo::rss_mib(pid)?);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let statements = beats(process.metrics).await.unwrap_or(0.0) - beats_before;
    let statements_per_sec = statements / held_since.elapsed().as_secs_f64();

    let completing = Instant::now();
    let completed = standin.call_back_all(false).await;
    anyhow::ensure!(completed == jobs, "{completed} of {jobs} completions answered 200");
    crate::demo::wait_finished(pool, offset + jobs, Duration::from_secs(600)).await?;
    let completions_per_sec = jobs as f64 / completing.elapsed().as_secs_f64();
    let peak_rss_mib = crate::demo::peak_rss_mib(pid)?;
    std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
    process.child.wait().await?;
    Ok(Measured {
        jobs,
        to_in_flight,
        rss_mib: rss,
        peak_rss_mib,
        heartbeat_statements_per_sec: statements_per_sec,
        heartbeats_per_sec: jobs as f64 / heartbeat_secs,
        completions_per_sec,
        connections: CONNECTIONS.load(Ordering::SeqCst),
    })
}
