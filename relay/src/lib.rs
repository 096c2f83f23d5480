//! `jobfold-relay`: moves committed events to Kafka.
//!
//! Invariant: an event reaches Kafka only after its transaction committed (the relay reads
//! committed rows only), at least once (the cursor moves past an event, or its outbox row is
//! marked, only after its delivery report arrived; a crash in between publishes it again — a
//! duplicate, never a loss), keyed by document id, in per-document order (events go out in
//! log order through an idempotent, gapless producer).
//!
//! # Layout
//! - [`run`]: stand by until this relay holds the active lock, then relay until shutdown.
//! - [`log`]: events publishable at commit, read from `job_events` after a cursor.
//! - [`outbox`]: delayed events (a scheduled retry), published when due: claim, mark, prune.
//! - [`publish`]: producing a batch and collecting its delivery reports.
//!
//! One relay is active per lock key: a Postgres session advisory lock, held by the
//! connection that also claims and marks rows. When the active relay dies its session ends,
//! the lock is released, and a standby takes over within `relay.standby_retry`.
//!
//! Shutdown: the batch in flight is produced, its reports awaited and marked; then the
//! relay exits.

pub mod log;
pub mod outbox;
pub mod publish;

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use anyhow::Context;
use jobfold_common::config::Config;
use jobfold_common::metrics as m;
use jobfold_common::{db, failpoint, gauges, kafka};
use sqlx::postgres::{PgConnectOptions, PgListener};
use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

/// The channel `outbox_notify()` signals on every outbox insert.
pub const NOTIFY_CHANNEL: &str = "jobfold_outbox";

/// How often the backlog gauges are refreshed.
const GAUGE_INTERVAL: Duration = Duration::from_secs(2);
/// Pause after a batch with delivery failures, before the rows are tried again.
const FAILURE_BACKOFF: Duration = Duration::from_millis(500);
/// Rows deleted per prune statement.
const PRUNE_CHUNK: i64 = 10_000;
/// Log batches produced and awaiting their delivery reports at once.
pub const LOG_BATCHES_IN_FLIGHT: usize = 4;

/// Runs the relay until `shutdown` is cancelled.
///
/// # Errors
/// Start-up failed: the database, the broker or the topics could not be set up. Later
/// failures (a lost connection, a broker outage) are logged and retried.
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let pool = db::connect_and_migrate(&config, 2).await.context("connecting to Postgres")?;
    kafka::ensure_topics(&config, &kafka::jobfold_topics(&config))
        .await
        .context("creating the topics")?;
    m::describe();
    tracing::info!(?config, "Starting the relay.");
    metrics::gauge!(m::RELAY_ACTIVE).set(0.0);
    let mut producer = publish::producer(&config).context("creating the producer")?;
    while !shutdown.is_cancelled() {
        let Some(lock) = stand_by(&config, &shutdown).await else { break };
        tracing::info!(lock_key = config.relay.lock_key, "Active: relaying the outbox.");
        metrics::gauge!(m::RELAY_ACTIVE).set(1.0);
        let result = relay(&config, &pool, lock, &mut producer, &shutdown).await;
        metrics::gauge!(m::RELAY_ACTIVE).set(0.0);
        match result {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "Relaying stopped; standing by again.");
                tokio::time::sleep(config.relay.standby_retry).await;
            }
        }
    }
    publish::flush(&producer, config.relay.shutdown_timeout);
    tracing::info!("Relay stopped.");
    Ok(())
}

/// Waits until this process holds the active lock; `None` on shutdown.
async fn stand_by(config: &Config, shutdown: &CancellationToken) -> Option<PgConnection> {
    let mut announced = false;
    loop {
        match try_lock(config).await {
            Ok(Some(conn)) => return Some(conn),
            Ok(None) if !announced => {
                tracing::info!("Another relay is active; standing by.");
                announced = true;
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "Cannot reach Postgres to take the relay lock."),
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(config.relay.standby_retry) => {}
        }
    }
}

/// A connection holding the advisory lock, or `None` if another session holds it.
async fn try_lock(config: &Config) -> Result<Option<PgConnection>, sqlx::Error> {
    let options: PgConnectOptions = config.database_url.expose().parse()?;
    let mut conn = PgConnection::connect_with(&options.application_name("jobfold-relay")).await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(config.relay.lock_key)
        .fetch_one(&mut conn)
        .await?;
    Ok(locked.then_some(conn))
}

/// Relays while holding the lock on `conn`. `Ok` on shutdown; `Err` when the lock's
/// connection (or the listener) fails.
async fn relay(
    config: &Config,
    pool: &PgPool,
    mut conn: PgConnection,
    producer: &mut publish::EventProducer,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(NOTIFY_CHANNEL).await?;
    let mut gauges_at = Instant::now() - GAUGE_INTERVAL;
    let mut prune_at = Instant::now();
    loop {
        // The log, then due delayed rows the log cursor has passed. A document whose event
        // could not be produced holds back its later events for the rest of the pass.
        let mut blocked = HashSet::new();
        let stop = drain_log(config, &mut conn, producer, shutdown, &mut blocked).await?
            || drain(config, &mut conn, producer, shutdown, &mut blocked).await?;
        if stop {
            return Ok(());
        }
        if gauges_at.elapsed() >= GAUGE_INTERVAL {
            let (count, age) = gauges::relay_backlog(&mut conn).await?;
            metrics::gauge!(m::RELAY_BACKLOG).set(count as f64);
            metrics::gauge!(m::RELAY_OLDEST_UNPUBLISHED_AGE_SECONDS).set(age);
            gauges_at = Instant::now();
        }
        if prune_at.elapsed() >= config.relay.prune_interval && !config.relay.prune_after.is_zero()
        {
            prune(config, &mut conn).await?;
            prune_at = Instant::now();
        }
        // Sleep until notified, the next delayed row is due, or the poll interval passes.
        let mut wait = config.relay.poll_interval;
        if let Some(due) = outbox::seconds_to_next_due(&mut conn).await? {
            wait = wait.min(Duration::from_secs_f64(due.max(0.0)));
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(()),
            notification = listener.recv() => { notification?; }
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// One pass over the due outbox rows, batch by batch, until fewer than a full batch remain.
/// Returns true if shutdown was requested (after finishing the batches in flight).
///
/// Pipelined: batch N+1 is claimed and enqueued while batch N's delivery reports arrive,
/// and N is marked once they all have. Rows are claimed after a cursor, so rows sent but
/// not yet marked are not claimed twice; rows that failed (below the cursor) are tried in
/// the next pass.
async fn drain(
    config: &Config,
    conn: &mut PgConnection,
    producer: &mut publish::EventProducer,
    shutdown: &CancellationToken,
    blocked: &mut HashSet<String>,
) -> anyhow::Result<bool> {
    let mut cursor = 0;
    let mut in_flight: Option<publish::Sent> = None;
    loop {
        let claim_started = Instant::now();
        let rows = if shutdown.is_cancelled() {
            Vec::new()
        } else {
            outbox::claim(conn, cursor, config.relay.batch_size).await?
        };
        tracing::debug!(rows = rows.len(), cursor, elapsed = ?claim_started.elapsed(), "Claimed.");
        let full = rows.len() == config.relay.batch_size as usize;
        let sent = if rows.is_empty() {
            None
        } else {
            let events = outbox::events(&rows)?;
            cursor = events.last().map_or(cursor, |e| e.seq);
            Some(publish::send(producer, &events, blocked).await)
        };
        if let Some(previous) = in_flight.take()
            && !complete(config, conn, producer, shutdown, previous).await?
        {
            // Mark what the batch behind it delivered, then end the pass.
            if let Some(current) = sent {
                complete(config, conn, producer, shutdown, current).await?;
            }
            return Ok(shutdown.is_cancelled());
        }
        in_flight = sent;
        if !full {
            if let Some(last) = in_flight.take() {
                complete(config, conn, producer, shutdown, last).await?;
            }
            return Ok(shutdown.is_cancelled());
        }
    }
}

/// One pass over the log after the cursor, batch by batch, until fewer than a full batch
/// remain. Returns true if shutdown was requested (after finishing the batches in flight).
///
/// Each batch is read while the one before is handed to the producer, and up to
/// [`LOG_BATCHES_IN_FLIGHT`] batches are produced ahead of their delivery reports; the cursor
/// follows the reports, batch by batch, in order. On a failure it stops just before the
/// first event not delivered, and the pass ends: the next pass sends everything after it
/// again (what was delivered after it becomes a duplicate).
async fn drain_log(
    config: &Config,
    conn: &mut PgConnection,
    producer: &mut publish::EventProducer,
    shutdown: &CancellationToken,
    blocked: &mut HashSet<String>,
) -> anyhow::Result<bool> {
    let mut read = log::cursor(conn).await?;
    let mut in_flight: VecDeque<(Vec<log::Position>, publish::Sent)> = VecDeque::new();
    let size = config.relay.batch_size;
    let topic = &config.topics.events;
    let mut batch = if shutdown.is_cancelled() {
        log::Batch::default()
    } else {
        log::claim(conn, read, size).await?
    };
    loop {
        let full = batch.len() == size as usize;
        let mut next = log::Batch::default();
        let positions = batch.positions()?;
        if let Some(last) = positions.last() {
            read = *last;
            // Delayed events are not among them: the outbox sends those.
            let events = batch.events(topic)?;
            // Postgres reads the next batch while this one is handed to the producer.
            let claim_next = async {
                if full && !shutdown.is_cancelled() {
                    log::claim(conn, read, size).await
                } else {
                    Ok(log::Batch::default())
                }
            };
            let started = Instant::now();
            let (claimed, sent) =
                tokio::join!(claim_next, publish::send(producer, &events, blocked));
            next = claimed?;
            tracing::debug!(sent = events.len(), read = next.len(), elapsed = ?started.elapsed(), "Sent a batch, read the next.");
            in_flight.push_back((positions, sent));
        }
        while in_flight.len() > LOG_BATCHES_IN_FLIGHT || (!full && !in_flight.is_empty()) {
            let (positions, sent) = in_flight.pop_front().expect("checked: not empty");
            let Some(outcome) = delivered(config, shutdown, sent).await else {
                return Ok(shutdown.is_cancelled());
            };
            failpoint::hit(failpoint::RELAY_AFTER_PRODUCE_BEFORE_MARK);
            // The cursor stops just before the first event that did not reach Kafka.
            let undelivered = outcome.undelivered();
            let prefix = if undelivered.is_empty() {
                positions.len()
            } else {
                positions.iter().take_while(|p| !undelivered.contains(&p.seq)).count()
            };
            if prefix > 0 {
                log::advance(conn, positions[prefix - 1]).await?;
            }
            let recorded = outcome.delivered.len().min(prefix) as u64;
            if !settle(config, producer, &outcome, recorded).await? {
                return Ok(shutdown.is_cancelled());
            }
        }
        if !full {
            return Ok(shutdown.is_cancelled());
        }
        batch = next;
    }
}

/// Waits for a sent outbox batch's delivery reports and marks what was delivered. Returns
/// false if the batch had failures (the pass should end; the rows are tried again later) or
/// shutdown gave up on it.
async fn complete(
    config: &Config,
    conn: &mut PgConnection,
    producer: &mut publish::EventProducer,
    shutdown: &CancellationToken,
    sent: publish::Sent,
) -> anyhow::Result<bool> {
    let Some(outcome) = delivered(config, shutdown, sent).await else {
        return Ok(false);
    };
    failpoint::hit(failpoint::RELAY_AFTER_PRODUCE_BEFORE_MARK);
    let seqs: Vec<i64> = outcome.delivered.iter().map(|(seq, _)| *seq).collect();
    let mark_started = Instant::now();
    let delete = config.relay.prune_after.is_zero();
    let marked = outbox::mark_published(conn, &seqs, delete).await?;
    tracing::debug!(marked, elapsed = ?mark_started.elapsed(), "Marked.");
    settle(config, producer, &outcome, marked).await
}

/// Waits for a sent batch's delivery reports, through broker outages; on shutdown it gets
/// `relay.shutdown_timeout` more, then is abandoned (`None`: nothing recorded, so it is
/// published again later).
async fn delivered(
    config: &Config,
    shutdown: &CancellationToken,
    sent: publish::Sent,
) -> Option<publish::Outcome> {
    let give_up = async {
        shutdown.cancelled().await;
        tokio::time::sleep(config.relay.shutdown_timeout).await;
    };
    tokio::select! {
        outcome = sent.delivered() => Some(outcome),
        _ = give_up => {
            tracing::warn!("Shutdown: abandoning a batch still waiting for delivery reports.");
            None
        }
    }
}

/// Counts a batch whose delivered part was recorded (`recorded` events). Returns false if
/// anything was not delivered: then the pass should end, after a pause (and a new producer
/// if the old one hit a fatal error).
async fn settle(
    config: &Config,
    producer: &mut publish::EventProducer,
    outcome: &publish::Outcome,
    recorded: u64,
) -> anyhow::Result<bool> {
    metrics::counter!(m::RELAY_PUBLISHED_TOTAL).increment(recorded);
    let now = chrono::Utc::now();
    let latency = metrics::histogram!(m::RELAY_PUBLISH_LATENCY_SECONDS);
    for (_, available_at) in &outcome.delivered {
        latency.record((now - *available_at).as_seconds_f64().max(0.0));
    }
    if outcome.failed.is_empty() && outcome.held_back.is_empty() {
        return Ok(true);
    }
    metrics::counter!(m::RELAY_DELIVERY_ERRORS_TOTAL).increment(outcome.failed.len() as u64);
    if let Some((seq, error)) = outcome.failed.first() {
        tracing::warn!(
            failed = outcome.failed.len(),
            held_back = outcome.held_back.len(),
            first_seq = seq,
            error = %error,
            "Some events were not delivered; they are tried again."
        );
    }
    if publish::is_fatal(producer) {
        tracing::warn!("The producer hit a fatal error; building a new one.");
        *producer = publish::producer(config)?;
    }
    tokio::time::sleep(FAILURE_BACKOFF).await;
    Ok(false)
}

async fn prune(config: &Config, conn: &mut PgConnection) -> anyhow::Result<()> {
    let older_than = config.relay.prune_after.as_secs_f64();
    loop {
        let pruned = outbox::prune(conn, older_than, PRUNE_CHUNK).await?;
        metrics::counter!(m::RELAY_PRUNED_TOTAL).increment(pruned);
        if pruned < PRUNE_CHUNK as u64 {
            return Ok(());
        }
    }
}
