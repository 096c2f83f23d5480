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
//! - [`parked`]: events Kafka refuses for what they are, parked with their document's later
//!   events so the cursor moves on for everyone else.
//! - [`horizon`]: which transaction holds publication back, named where operators look.
//! - [`metrics`]: the relay's metric names; [`internal_events`]: what it reports, each
//!   event's log line and metrics in one call.
//!
//! One relay is active per lock key: a Postgres session advisory lock, held by the
//! connection that also claims and marks rows. When the active relay dies its session ends,
//! the lock is released, and a standby takes over within `relay.standby_retry`.
//!
//! Shutdown: the batch in flight is produced, its reports awaited and marked; then the
//! relay exits.

pub mod horizon;
pub mod internal_events;
pub mod log;
pub mod metrics;
pub mod outbox;
pub mod parked;
pub mod publish;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::internal_events::{BatchSettled, BecameActive, StoodDown};
use crate::metrics as m;
use anyhow::Context;
use jobfold_common::config::Config;
use jobfold_common::{db, failpoint, gauges, kafka};
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// The channel `outbox_notify()` signals on, when the relay sleeps.
pub const NOTIFY_CHANNEL: &str = "jobfold_outbox";
/// The advisory lock (two-key form, apart from the leader lock) the active relay holds while
/// it sleeps until notified. A transaction that writes events notifies only if it cannot
/// take this lock shared (migration 0011): a `NOTIFY` serializes the commits that send one,
/// so while the relay is awake, no commit sends one. A writer that took it shared holds it
/// to its commit, so the relay cannot go to sleep before that commit is visible to it.
pub const SLEEP_LOCK: (i32, i32) = (0x6a6f_6266, 1);
/// While writers hold [`SLEEP_LOCK`] and the relay cannot sleep, it looks again after this
/// long, doubling up to [`BUSY_POLL_MAX`] while it finds nothing new.
const BUSY_POLL_MIN: Duration = Duration::from_millis(2);
const BUSY_POLL_MAX: Duration = Duration::from_millis(50);

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
    let pool = db::connect_and_migrate(&config, 2).await?;
    kafka::ensure_topics(&config, &kafka::jobfold_topics(&config))
        .await
        .context("creating the topics")?;
    // The largest event the topic and the producer take: larger ones are parked unsent.
    let max_bytes = kafka::check_topics(&config).await?;
    m::describe();
    tracing::info!(?config, max_event_bytes = max_bytes, "Starting the relay.");
    StoodDown { error: None }.emit();
    let mut producer =
        publish::producer_for(&config, max_bytes).context("creating the producer")?;
    while !shutdown.is_cancelled() {
        let Some(lock) = stand_by(&config, &pool, &shutdown).await else { break };
        BecameActive { lock_key: config.relay.lock_key }.emit();
        let result = relay(&config, &pool, lock, &mut producer, max_bytes, &shutdown).await;
        StoodDown { error: result.as_ref().err() }.emit();
        match result {
            Ok(()) => break,
            Err(_) => tokio::time::sleep(config.relay.standby_retry).await,
        }
    }
    publish::flush(&producer, config.relay.shutdown_timeout);
    tracing::info!("Relay stopped.");
    Ok(())
}

/// Waits until this process holds the active lock; `None` on shutdown.
async fn stand_by(
    config: &Config,
    pool: &PgPool,
    shutdown: &CancellationToken,
) -> Option<PgConnection> {
    let mut announced = false;
    loop {
        match try_lock(config, pool).await {
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

/// A connection holding the advisory lock, or `None` if another session holds it. It goes
/// where the pool's go: the primary (advisory locks are not replicated, and a standby would
/// grant one as readily, so a standby's connection is refused).
async fn try_lock(config: &Config, pool: &PgPool) -> Result<Option<PgConnection>, sqlx::Error> {
    let mut conn = db::connect_one(pool, "jobfold-relay").await?;
    let locked = sqlx::query_scalar!(
        r#"SELECT pg_try_advisory_lock($1) AS "locked!""#,
        config.relay.lock_key
    )
    .fetch_one(&mut conn)
    .await?;
    Ok(locked.then_some(conn))
}

/// Relays while holding the lock on `conn`. `Ok` on shutdown; `Err` when the lock's
/// connection (or the listener) fails.
async fn relay(
    config: &Config,
    pool: &PgPool,
    conn: PgConnection,
    producer: &mut publish::EventProducer,
    max_bytes: usize,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(NOTIFY_CHANNEL).await?;
    // The backlog gauges come from a task of their own: a pass that waits on Kafka (a broker
    // outage, fewer replicas in sync than min.insync.replicas) must still show the backlog
    // and its age growing, for the alert to fire.
    let _gauges = AbortOnDropHandle::new(tokio::spawn(publish_gauges(pool.clone())));
    // The events topic's limit, read again on a task of its own (a broker slow to describe
    // the topic must not hold a pass up) and followed between passes.
    let (limit_read, mut limit) = tokio::sync::watch::channel(max_bytes);
    limit.mark_unchanged();
    let _limits =
        AbortOnDropHandle::new(tokio::spawn(read_limit_every(config.clone(), limit_read)));
    let mut horizon_at = Instant::now() - GAUGE_INTERVAL;
    let mut prune_at = Instant::now();
    let mut horizon = horizon::Watch::default();
    let mut active = Active {
        config,
        conn,
        producer,
        shutdown,
        max_bytes,
        recheck_limit: false,
        refused_once: std::collections::HashSet::new(),
        moved: false,
    };
    // Events parked under a lower limit than this relay's (by a relay that read it before
    // the topic's limit was raised) go out now.
    active.retry_fitting().await?;
    // Whether this connection holds SLEEP_LOCK (writers notify), the busy poll interval, and
    // what the last look after a pass found (nothing yet: the first pass looks everywhere).
    let mut asleep = false;
    let mut busy_poll = BUSY_POLL_MIN;
    let mut seen = Look::everything();
    loop {
        // Parked events an operator released, then the log, then due delayed rows the log
        // cursor has passed. A document with a parked event has its later events parked
        // behind it; one whose event could not be enqueued holds back its later events for
        // the rest of the pass. The parked events and the outbox are read only when the look
        // after the last pass found some (or one of the outbox's came due since): this relay
        // alone parks events and passes the outbox's, and it looks after every pass.
        let mut blocked = publish::Blocked::default();
        if limit.has_changed().unwrap_or(false) {
            let now = *limit.borrow_and_update();
            active.follow_limit(now).await?;
        }
        if active.recheck_limit {
            active.refresh_limit().await?;
        }
        active.moved = false;
        let drain_outbox = seen.outbox_due();
        let stop = (seen.parked && active.release(&mut blocked).await?)
            || active.drain_log(&mut blocked).await?
            || (drain_outbox && active.drain(&mut blocked).await?);
        if stop {
            return Ok(());
        }
        let conn = &mut active.conn;
        if horizon_at.elapsed() >= GAUGE_INTERVAL {
            horizon.check(&mut *conn, config.relay.horizon_warn_after).await?;
            horizon_at = Instant::now();
        }
        if prune_at.elapsed() >= config.relay.prune_interval && !config.relay.prune_after.is_zero()
        {
            prune(config, conn).await?;
            prune_at = Instant::now();
        }
        // Sleep until notified, the next delayed row is due, or the poll interval passes.
        seen = Look::after_pass(conn, !asleep).await?;
        let mut wait = config.relay.poll_interval;
        if let Some(due) = seen.next_due {
            wait = wait.min(due.saturating_duration_since(Instant::now()));
        }
        // Due rows the log cursor passed in this pass, the outbox not read after it: at once.
        if seen.due && !drain_outbox {
            wait = Duration::ZERO;
        }
        if !asleep {
            if seen.slept {
                // Every writer that saw the relay awake has committed: one more pass reads
                // what they wrote, and from now on writers notify.
                asleep = true;
                continue;
            }
            // Writers are in flight and will not notify: look again shortly, sooner while
            // the passes find work.
            busy_poll =
                if active.moved { BUSY_POLL_MIN } else { (busy_poll * 2).min(BUSY_POLL_MAX) };
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(wait.min(busy_poll)) => {}
            }
            continue;
        }
        // Asleep, but with events an older transaction holds back (see `log::past_cursor`):
        // its end sends no notification, so look again shortly as well.
        if seen.past_cursor {
            wait = wait.min(busy_poll);
            busy_poll = (busy_poll * 2).min(BUSY_POLL_MAX);
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(()),
            notification = listener.recv() => {
                notification?;
                // Awake: writers stop notifying. Notifications already here are spent.
                while listener.next_buffered().is_some() {}
                wake(&mut active.conn).await?;
                asleep = false;
                busy_poll = BUSY_POLL_MIN;
            }
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// What the relay finds after a pass, in one statement (each pass would otherwise read the
/// parked events' keys, the outbox's due rows and its next due time, the cursor and the
/// sleep lock one statement each, though under load there is rarely any of the first three).
#[derive(Debug, Clone, Copy)]
struct Look {
    /// There are parked events: the next pass releases those an operator asked for and
    /// parks the later events of their documents.
    parked: bool,
    /// Delayed events are due and the log cursor has passed them.
    due: bool,
    /// When the next delayed event becomes due, if one is waiting.
    next_due: Option<Instant>,
    /// This relay took [`SLEEP_LOCK`] (only tried while awake).
    slept: bool,
    /// Committed events wait past the cursor (only asked while asleep: see
    /// [`log::past_cursor`]).
    past_cursor: bool,
}

impl Look {
    /// Before the first pass: every kind of work may be waiting.
    fn everything() -> Self {
        Self { parked: true, due: true, next_due: None, slept: false, past_cursor: false }
    }

    /// Whether the next pass reads the outbox: rows were due after the last pass, or one
    /// has come due since.
    fn outbox_due(&self) -> bool {
        self.due || self.next_due.is_some_and(|at| at <= Instant::now())
    }

    /// Looks, and with `sleep` tries to take [`SLEEP_LOCK`] in the same statement.
    async fn after_pass(conn: &mut PgConnection, sleep: bool) -> Result<Self, sqlx::Error> {
        let row = sqlx::query!(
            r#"
            SELECT EXISTS (SELECT 1 FROM relay_parked) AS "parked!",
                   EXISTS (
                       SELECT 1 FROM outbox o
                       JOIN job_events e USING (seq)
                       CROSS JOIN relay_cursor c
                       WHERE o.published_at IS NULL AND o.available_at <= now()
                         AND (e.xid, e.seq) <= (c.published_xid, c.published_seq)
                   ) AS "due!",
                   (SELECT EXTRACT(EPOCH FROM min(available_at) - now())::float8
                    FROM outbox
                    WHERE published_at IS NULL AND available_at > now()) AS next_due,
                   CASE WHEN $1 THEN pg_try_advisory_lock($2, $3) ELSE false END AS "slept!",
                   CASE WHEN $1 THEN false ELSE EXISTS (
                       SELECT 1 FROM relay_cursor c, LATERAL (
                           SELECT 1 FROM job_events e
                           WHERE (e.xid, e.seq) > (c.published_xid, c.published_seq)
                           ORDER BY e.xid, e.seq LIMIT 1
                       ) after
                   ) END AS "past_cursor!"
            "#,
            sleep,
            SLEEP_LOCK.0,
            SLEEP_LOCK.1,
        )
        .fetch_one(conn)
        .await?;
        let next_due = row
            .next_due
            .map(|secs| Instant::now() + Duration::from_secs_f64(secs.clamp(0.0, 86_400.0)));
        Ok(Self {
            parked: row.parked,
            due: row.due,
            next_due,
            slept: row.slept,
            past_cursor: row.past_cursor,
        })
    }
}

/// Refreshes the backlog and park gauges every [`GAUGE_INTERVAL`] while this relay is
/// active, whatever its pass is waiting for; a failed reading is skipped.
async fn publish_gauges(pool: PgPool) {
    loop {
        match gauges::relay_backlog(&pool).await {
            Ok((count, age)) => {
                ::metrics::gauge!(m::RELAY_BACKLOG).set(count as f64);
                ::metrics::gauge!(m::RELAY_OLDEST_UNPUBLISHED_AGE_SECONDS).set(age);
            }
            Err(e) => tracing::debug!(error = %e, "Cannot read the relay's backlog."),
        }
        if let Ok((parked, documents)) = gauges::relay_parked(&pool).await {
            ::metrics::gauge!(m::RELAY_PARKED).set(parked as f64);
            ::metrics::gauge!(m::RELAY_PARKED_DOCUMENTS).set(documents as f64);
        }
        tokio::time::sleep(GAUGE_INTERVAL).await;
    }
}

/// Reads the events topic's limit every `relay.limit_check_interval` while this relay is
/// active, the first time at once, and hands each reading to the pass loop (which follows
/// it only if it differs from the limit it holds); a failed reading is skipped.
async fn read_limit_every(config: Config, limit: tokio::sync::watch::Sender<usize>) {
    loop {
        match tokio::time::timeout(LIMIT_CHECK, kafka::current_event_limit(&config)).await {
            Ok(Ok(now)) => {
                limit.send_replace(now);
            }
            Ok(Err(e)) => tracing::debug!(error = %format!("{e:#}"),
                "Cannot read the events topic's limit; looking again later."),
            Err(_) => tracing::debug!("The brokers did not describe the events topic in time."),
        }
        tokio::time::sleep(config.relay.limit_check_interval).await;
    }
}

/// Releases [`SLEEP_LOCK`]: writers stop notifying.
async fn wake(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query_scalar!("SELECT pg_advisory_unlock($1, $2)", SLEEP_LOCK.0, SLEEP_LOCK.1)
        .fetch_one(conn)
        .await?;
    Ok(())
}

/// The active relay: the connection holding the lock, the producer, and the largest event
/// the topic and the producer take.
struct Active<'a> {
    config: &'a Config,
    conn: PgConnection,
    producer: &'a mut publish::EventProducer,
    shutdown: &'a CancellationToken,
    max_bytes: usize,
    /// The broker refused an event the relay's limit let through, or the producer hit a
    /// fatal error: read the topic's limit again before the next pass.
    recheck_limit: bool,
    /// Events the broker refused once, to be parked if it refuses them again.
    refused_once: std::collections::HashSet<i64>,
    /// The pass moved the log cursor (the busy poll starts short again). Not merely read
    /// events: a pass that reads rows it cannot send (delayed rows of a parked document, a
    /// batch the broker did not take) must back off like one that found nothing.
    moved: bool,
}

/// How long reading the events topic's limit while running may take before the relay goes
/// on with the limit it has.
const LIMIT_CHECK: Duration = Duration::from_secs(10);

impl Active<'_> {
    /// Waits for a sent batch's reports ([`delivered`]) and judges what the broker refused
    /// for what it is: an event refused for the first time is sent again after the topic's
    /// limit is read anew (the relay's own check then parks it unsent if it is over the
    /// limit, and events refused only because they were batched with it go through); one
    /// refused again is parked.
    async fn delivered(&mut self, sent: publish::Sent) -> Option<publish::Outcome> {
        let mut outcome = delivered(self.config, self.shutdown, self.producer, sent).await?;
        for (seq, error) in std::mem::take(&mut outcome.refused_by_broker) {
            self.recheck_limit = true;
            if self.refused_once.insert(seq) {
                tracing::warn!(seq, error = %error,
                    "The broker refused an event; it is sent again once the topic's limit is read anew.");
                outcome.failed.push((seq, error));
            } else {
                tracing::error!(
                    seq,
                    error = %error,
                    "Event parked: the broker refused it again. Its document's later events wait \
                     behind it; see `jobfold parked list`."
                );
                self.refused_once.remove(&seq);
                outcome.refused.push((seq, format!("the broker refused it: {error}")));
            }
        }
        Some(outcome)
    }

    /// Reads the events topic's `max.message.bytes` again and follows it
    /// ([`Active::follow_limit`]); if the brokers do not answer, keeps the limit it has.
    /// Called between passes, with nothing in flight.
    async fn refresh_limit(&mut self) -> anyhow::Result<()> {
        self.recheck_limit = false;
        match tokio::time::timeout(LIMIT_CHECK, kafka::current_event_limit(self.config)).await {
            Ok(Ok(limit)) => self.follow_limit(limit).await?,
            Ok(Err(e)) => tracing::warn!(error = %format!("{e:#}"), max_bytes = self.max_bytes,
                "Cannot read the events topic's limit; keeping the one the relay has."),
            Err(_) => tracing::warn!(
                max_bytes = self.max_bytes,
                "The brokers did not describe the events topic in time; keeping the limit the relay has."
            ),
        }
        Ok(())
    }

    /// Holds events to `limit`, the largest event the topic and the producer take as just
    /// read, if it differs from the one the relay has: with a producer built for it, and, if
    /// it was raised, with the parked events that fit it now sent again
    /// ([`Active::retry_fitting`]) — a limit lowered for a while and raised again needs no
    /// operator for what was parked meanwhile. Called between passes, with nothing in flight.
    async fn follow_limit(&mut self, limit: usize) -> anyhow::Result<()> {
        if limit == self.max_bytes {
            return Ok(());
        }
        tracing::info!(
            before = self.max_bytes,
            now = limit,
            "The events topic's limit changed; events are held to the new one."
        );
        match publish::producer_for(self.config, limit) {
            Ok(producer) => {
                *self.producer = producer;
                let raised = limit > self.max_bytes;
                self.max_bytes = limit;
                if raised {
                    self.retry_fitting().await?;
                }
            }
            Err(e) => tracing::warn!(error = %e, "Cannot build a producer for the new limit."),
        }
        Ok(())
    }

    /// Releases the parked events that fit the relay's limit ([`parked::retry_fitting`]).
    async fn retry_fitting(&mut self) -> anyhow::Result<()> {
        let released = parked::retry_fitting(&mut self.conn, self.max_bytes).await?;
        if released > 0 {
            tracing::info!(
                released,
                max_event_bytes = self.max_bytes,
                "Parked events that fit the events topic's limit now are sent again, their \
                 documents' waiting events behind them."
            );
        }
        Ok(())
    }

    /// Sends the parked events an operator released (a retry asked for, or the refused
    /// event of their document dropped), in log order, batch by batch; then loads the
    /// documents still parked into `blocked`. Returns true if shutdown was requested.
    async fn release(&mut self, blocked: &mut publish::Blocked) -> anyhow::Result<bool> {
        blocked.parked = parked::keys(&mut self.conn).await?;
        if blocked.parked.is_empty() {
            return Ok(false);
        }
        let mut limit_read = false;
        loop {
            if self.shutdown.is_cancelled() {
                return Ok(true);
            }
            let rows = parked::releasable(&mut self.conn, self.config.relay.batch_size).await?;
            if rows.is_empty() {
                break;
            }
            // An operator asked for a retry, likely after raising the topic's limit.
            if !limit_read {
                self.refresh_limit().await?;
                limit_read = true;
            }
            let full = rows.len() == self.config.relay.batch_size as usize;
            let events = publish::events(&rows, &self.config.topics.events);
            // What is refused again blocks its document's later rows for this batch only:
            // they stay parked behind it.
            let mut again = publish::Blocked::default();
            let sent = publish::send(self.producer, &events, &mut again, self.max_bytes).await;
            let Some(outcome) = self.delivered(sent).await else {
                return Ok(true);
            };
            let seqs: Vec<i64> = outcome.delivered.iter().map(|(seq, _)| *seq).collect();
            parked::settle(&mut self.conn, &seqs, &outcome.refused).await?;
            tracing::info!(
                released = seqs.len(),
                refused_again = outcome.refused.len(),
                "Released parked events."
            );
            let recorded = seqs.len() as u64;
            if !settle(self, &outcome, recorded).await? || !outcome.refused.is_empty() || !full {
                break;
            }
        }
        blocked.parked = parked::keys(&mut self.conn).await?;
        Ok(false)
    }

    /// One pass over the due outbox rows, batch by batch, until fewer than a full batch
    /// remain. Returns true if shutdown was requested (after finishing the batches in
    /// flight).
    ///
    /// Pipelined: batch N+1 is claimed and enqueued while batch N's delivery reports arrive,
    /// and N is marked once they all have. Rows are claimed after a cursor, so rows sent but
    /// not yet marked are not claimed twice; rows that failed (below the cursor) are tried in
    /// the next pass.
    async fn drain(&mut self, blocked: &mut publish::Blocked) -> anyhow::Result<bool> {
        let mut cursor = 0;
        let mut in_flight: Option<publish::Sent> = None;
        loop {
            let claim_started = Instant::now();
            let rows = if self.shutdown.is_cancelled() {
                Vec::new()
            } else {
                outbox::claim(&mut self.conn, cursor, self.config.relay.batch_size).await?
            };
            tracing::debug!(rows = rows.len(), cursor, elapsed = ?claim_started.elapsed(), "Claimed.");
            let full = rows.len() == self.config.relay.batch_size as usize;
            let sent = if rows.is_empty() {
                None
            } else {
                let events = publish::events(&rows, &self.config.topics.events);
                cursor = events.last().map_or(cursor, |e| e.seq);
                Some(publish::send(self.producer, &events, blocked, self.max_bytes).await)
            };
            if let Some(previous) = in_flight.take()
                && !self.complete(previous).await?
            {
                // Mark what the batch behind it delivered, then end the pass.
                if let Some(current) = sent {
                    self.complete(current).await?;
                }
                return Ok(self.shutdown.is_cancelled());
            }
            in_flight = sent;
            if !full {
                if let Some(last) = in_flight.take() {
                    self.complete(last).await?;
                }
                return Ok(self.shutdown.is_cancelled());
            }
        }
    }

    /// One pass over the log after the cursor, batch by batch, until fewer than a full batch
    /// remain. Returns true if shutdown was requested (after finishing the batches in
    /// flight).
    ///
    /// Each batch is read while the one before is handed to the producer, and up to
    /// [`LOG_BATCHES_IN_FLIGHT`] batches are produced ahead of their delivery reports; the
    /// cursor follows the reports, batch by batch, in order. Refused events and those
    /// waiting behind them are parked in the transaction that moves the cursor past them.
    /// On a failure that may pass, the cursor stops just before the first event not
    /// delivered, and the pass ends: the next pass sends everything after it again (what was
    /// delivered after it becomes a duplicate).
    async fn drain_log(&mut self, blocked: &mut publish::Blocked) -> anyhow::Result<bool> {
        let mut in_flight: VecDeque<(Vec<log::Position>, publish::Sent)> = VecDeque::new();
        let size = self.config.relay.batch_size;
        let topic = &self.config.topics.events;
        let mut batch = if self.shutdown.is_cancelled() {
            log::Batch::default()
        } else {
            log::claim_after_cursor(&mut self.conn, size).await?
        };
        loop {
            let full = batch.len() == size as usize;
            let mut next = log::Batch::default();
            let positions = batch.positions()?;
            if let Some(last) = positions.last() {
                let read = *last;
                // Delayed events are not among them: the outbox sends those.
                let events = batch.events(topic)?;
                // Postgres reads the next batch while this one is handed to the producer.
                let conn = &mut self.conn;
                let shutdown = self.shutdown;
                let claim_next = async {
                    if full && !shutdown.is_cancelled() {
                        log::claim(conn, read, size).await
                    } else {
                        Ok(log::Batch::default())
                    }
                };
                let started = Instant::now();
                let (claimed, sent) = tokio::join!(
                    claim_next,
                    publish::send(self.producer, &events, blocked, self.max_bytes)
                );
                next = claimed?;
                tracing::debug!(sent = events.len(), read = next.len(), elapsed = ?started.elapsed(), "Sent a batch, read the next.");
                in_flight.push_back((positions, sent));
            }
            while in_flight.len() > LOG_BATCHES_IN_FLIGHT || (!full && !in_flight.is_empty()) {
                let (positions, sent) = in_flight.pop_front().expect("checked: not empty");
                let Some(outcome) = self.delivered(sent).await else {
                    return Ok(self.shutdown.is_cancelled());
                };
                failpoint::hit(failpoint::Point::RelayAfterProduceBeforeMark);
                // The cursor stops just before the first event that neither reached Kafka
                // nor was parked.
                let undelivered = outcome.undelivered();
                let prefix = if undelivered.is_empty() {
                    positions.len()
                } else {
                    positions.iter().take_while(|p| !undelivered.contains(&p.seq)).count()
                };
                // What to park among the events the cursor passes (the rest are read again).
                let mut parking = parked::parking(&outcome);
                if !parking.is_empty() && prefix < positions.len() {
                    let passed: std::collections::HashSet<i64> =
                        positions[..prefix].iter().map(|at| at.seq).collect();
                    parking.retain(|p| passed.contains(&p.seq));
                }
                self.moved |= prefix > 0;
                if prefix > 0 && parking.is_empty() {
                    log::advance(&mut self.conn, positions[prefix - 1]).await?;
                } else if prefix > 0 {
                    let mut tx = self.conn.begin().await?;
                    let keys = parked::park(&mut tx, topic, &parking).await?;
                    log::advance(&mut tx, positions[prefix - 1]).await?;
                    tx.commit().await?;
                    blocked.parked.extend(keys);
                }
                let recorded = outcome.delivered.len().min(prefix) as u64;
                if !settle(self, &outcome, recorded).await? {
                    return Ok(self.shutdown.is_cancelled());
                }
            }
            if !full {
                return Ok(self.shutdown.is_cancelled());
            }
            batch = next;
        }
    }

    /// Waits for a sent outbox batch's delivery reports and marks what was delivered or
    /// parked (parking it in the same transaction). Returns false if the batch had failures
    /// that may pass (the pass should end; the rows are tried again later) or shutdown gave
    /// up on it.
    async fn complete(&mut self, sent: publish::Sent) -> anyhow::Result<bool> {
        let Some(outcome) = self.delivered(sent).await else {
            return Ok(false);
        };
        failpoint::hit(failpoint::Point::RelayAfterProduceBeforeMark);
        let parking = parked::parking(&outcome);
        let mut seqs: Vec<i64> = outcome.delivered.iter().map(|(seq, _)| *seq).collect();
        let delivered = seqs.len();
        seqs.extend(parking.iter().map(|p| p.seq));
        let mark_started = Instant::now();
        let delete = self.config.relay.prune_after.is_zero();
        let mut tx = self.conn.begin().await?;
        let keys = parked::park(&mut tx, &self.config.topics.events, &parking).await?;
        let marked = outbox::mark_published(&mut tx, &seqs, delete).await?;
        tx.commit().await?;
        tracing::debug!(marked, parked = keys.len(), elapsed = ?mark_started.elapsed(), "Marked.");
        let recorded = marked.min(delivered as u64);
        settle(self, &outcome, recorded).await
    }
}

/// Waits for a sent batch's delivery reports, through broker outages; on shutdown it gets
/// `relay.shutdown_timeout` more, then is abandoned (`None`: nothing recorded, so it is
/// published again later).
async fn delivered(
    config: &Config,
    shutdown: &CancellationToken,
    producer: &publish::EventProducer,
    sent: publish::Sent,
) -> Option<publish::Outcome> {
    let give_up = async {
        shutdown.cancelled().await;
        tokio::time::sleep(config.relay.shutdown_timeout).await;
    };
    tokio::select! {
        outcome = sent.delivered(producer) => Some(outcome),
        _ = give_up => {
            tracing::warn!("Shutdown: abandoning a batch still waiting for delivery reports.");
            None
        }
    }
}

/// Counts a batch whose delivered part was recorded (`recorded` events) and its parked
/// events. Returns false if anything was neither delivered nor parked: then the pass should
/// end, after a pause (and a new producer if the old one hit a fatal error).
async fn settle(
    active: &mut Active<'_>,
    outcome: &publish::Outcome,
    recorded: u64,
) -> anyhow::Result<bool> {
    BatchSettled { outcome, recorded }.emit();
    if outcome.failed.is_empty() && outcome.held_back.is_empty() {
        return Ok(true);
    }
    if publish::is_fatal(active.producer) {
        tracing::warn!("The producer hit a fatal error; building a new one.");
        *active.producer = publish::producer_for(active.config, active.max_bytes)?;
        // The usual cause is an event the broker refused, whose own report the purge that
        // follows the error may replace (it then reads as not delivered, not as refused):
        // the topic's limit is read again all the same, so that the relay's own check parks
        // an event over it instead of sending it, and its batch, again and again.
        active.recheck_limit = true;
    }
    tokio::time::sleep(FAILURE_BACKOFF).await;
    Ok(false)
}

async fn prune(config: &Config, conn: &mut PgConnection) -> anyhow::Result<()> {
    let older_than = config.relay.prune_after.as_secs_f64();
    loop {
        let pruned = outbox::prune(conn, older_than, PRUNE_CHUNK).await?;
        ::metrics::counter!(m::RELAY_PRUNED_TOTAL).increment(pruned);
        if pruned < PRUNE_CHUNK as u64 {
            return Ok(());
        }
    }
}
