//! Parked events: those Kafka refuses for what they are, kept out of the way.
//!
//! Invariant: an event the relay cannot produce never holds its cursor for other documents,
//! and never loses its place in its own document. An event refused for its own sake (larger
//! than the topic takes, bytes the broker rejects: [`crate::publish::is_message_fault`]) is
//! parked here *in the same transaction* that moves the cursor past it, so a crash between
//! the two sends it again rather than losing it. From then on its document's later events are
//! parked behind it (not sent), in log order, until an operator retries or drops it; then
//! they go out in that order ([`releasable`]), before any newer event of the document.
//!
//! Every other document's events flow at full speed and nothing is sent twice.
//!
//! One exception to the order, documented in docs/relay.md: an event the *broker* refuses in
//! its delivery report was sent with later events already on their way; those of its
//! document sent in the same window (at most [`crate::LOG_BATCHES_IN_FLIGHT`] batches) are
//! on Kafka ahead of it. The relay refuses oversized events itself, before sending, so the
//! usual cause never reaches the broker.

use std::collections::HashSet;

use sqlx::PgConnection;

use crate::publish::{Outcome, StoredEvent};

/// An event to park.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parking {
    pub seq: i64,
    /// Kafka refused it; otherwise it waits behind a refused event of its document.
    pub refused: bool,
    pub reason: String,
}

/// Why an event waits in the park without being refused itself.
pub const WAITING: &str = "waits behind a parked event of its document";

/// The documents with parked events: their new events are parked behind them.
///
/// # Errors
/// The connection failed.
pub async fn keys(conn: &mut PgConnection) -> Result<HashSet<String>, sqlx::Error> {
    let keys: Vec<String> =
        sqlx::query_scalar!("SELECT DISTINCT key FROM relay_parked").fetch_all(conn).await?;
    Ok(keys.into_iter().collect())
}

/// Parks `events` for `topic` (their keys are read from the log); returns their keys.
/// Parking an event twice (a pass repeated after a crash) keeps the first row.
///
/// # Errors
/// The connection failed.
pub async fn park(
    conn: &mut PgConnection,
    topic: &str,
    events: &[Parking],
) -> Result<Vec<String>, sqlx::Error> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    let refused: Vec<bool> = events.iter().map(|e| e.refused).collect();
    let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    sqlx::query_scalar!(
        r#"
        INSERT INTO relay_parked (seq, topic, key, refused, reason)
        SELECT p.seq, $4,
               coalesce(e.key, (SELECT j.document_id FROM jobs j WHERE j.job_id = e.job_id)),
               p.refused, p.reason
        FROM unnest($1::bigint[], $2::boolean[], $3::text[]) AS p(seq, refused, reason)
        JOIN job_events e USING (seq)
        ORDER BY p.seq
        ON CONFLICT (seq) DO NOTHING
        RETURNING key
        "#,
        &seqs,
        &refused,
        &reasons as &[&str],
        topic,
    )
    .fetch_all(conn)
    .await
}

/// Up to `limit` parked events that may go out now, in log order: every parked event of a
/// document none of whose refused events still waits for an operator — a refused event
/// that was dropped, or one whose retry was asked for (it goes first), each for the topic it
/// names.
///
/// # Errors
/// The connection failed.
pub async fn releasable(
    conn: &mut PgConnection,
    limit: u32,
) -> Result<Vec<StoredEvent>, sqlx::Error> {
    // The first seven columns are the ones `log::event` reads, the topic in the eighth
    // (`log::events_with_topic`).
    sqlx::query_as!(
        StoredEvent,
        r#"
        SELECT p.seq, p.topic AS "topic?", p.key, e.body, p.parked_at AS available_at,
               e.traceparent, e.tracestate, e.kind
        FROM relay_parked p
        JOIN job_events e USING (seq)
        WHERE NOT EXISTS (SELECT 1 FROM relay_parked r
                          WHERE r.key = p.key AND r.refused AND r.retry_requested_at IS NULL)
        ORDER BY p.seq
        LIMIT $1
        "#,
        i64::from(limit),
    )
    .fetch_all(conn)
    .await
}

/// Records what became of released events: the delivered ones leave the park; the ones
/// refused again stay, refused with the new reason, their retry request spent (so their
/// document waits for an operator again).
///
/// # Errors
/// The connection failed; the events stay parked and are released again.
pub async fn settle(
    conn: &mut PgConnection,
    delivered: &[i64],
    refused: &[(i64, String)],
) -> Result<(), sqlx::Error> {
    if !delivered.is_empty() {
        sqlx::query!("DELETE FROM relay_parked WHERE seq = ANY($1)", delivered)
            .execute(&mut *conn)
            .await?;
    }
    if !refused.is_empty() {
        let seqs: Vec<i64> = refused.iter().map(|(seq, _)| *seq).collect();
        let reasons: Vec<&str> = refused.iter().map(|(_, reason)| reason.as_str()).collect();
        sqlx::query!(
            r#"
            UPDATE relay_parked p
            SET refused = true, reason = r.reason, retry_requested_at = NULL,
                attempts = p.attempts + 1
            FROM unnest($1::bigint[], $2::text[]) AS r(seq, reason)
            WHERE p.seq = r.seq
            "#,
            &seqs,
            &reasons as &[&str],
        )
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// A parked event, as operators see it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParkedEvent {
    pub seq: i64,
    pub topic: String,
    /// The document id.
    pub key: String,
    pub job_id: uuid::Uuid,
    /// The event type (`JobSucceeded`, ...).
    pub event: String,
    /// The event's size in the log.
    pub bytes: i32,
    pub refused: bool,
    pub reason: String,
    pub parked_at: chrono::DateTime<chrono::Utc>,
    pub retry_requested_at: Option<chrono::DateTime<chrono::Utc>>,
    pub attempts: i32,
}

/// The parked events, refused ones first, then in log order; at most `limit`.
///
/// # Errors
/// The connection failed.
pub async fn list<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    limit: i64,
) -> Result<Vec<ParkedEvent>, sqlx::Error> {
    sqlx::query_as!(
        ParkedEvent,
        r#"
        SELECT p.seq, p.topic, p.key, e.job_id AS "job_id!", e.kind AS event,
               length(e.body) AS "bytes!",
               p.refused, p.reason, p.parked_at, p.retry_requested_at, p.attempts
        FROM relay_parked p JOIN job_events e USING (seq)
        ORDER BY p.refused DESC, p.seq
        LIMIT $1
        "#,
        limit,
    )
    .fetch_all(executor)
    .await
}

/// Which refused events an operator acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// One event, by its seq.
    Seq(i64),
    /// Every refused event of one document.
    Document(String),
    /// Every refused event.
    All,
}

/// Runs `$statement` (an UPDATE or DELETE of `relay_parked`) on the refused events
/// `$selection` names; evaluates to how many it touched.
macro_rules! on_selected {
    ($executor:expr, $selection:expr, $statement:literal) => {{
        let (seq, key) = $selection.bounds();
        let done = sqlx::query!(
            $statement
                + " WHERE refused AND ($1::bigint IS NULL OR seq = $1) \
                    AND ($2::text IS NULL OR key = $2)",
            seq,
            key,
        )
        .execute($executor)
        .await?;
        Ok(done.rows_affected())
    }};
}

/// Asks the active relay to send the selected refused events again, with their documents'
/// waiting events behind them, in order, after the cause was fixed (events that fit a raised
/// `max.message.bytes` the relay sends again by itself: [`retry_fitting`]). Returns how
/// many refused events were selected. The relay is woken at once.
///
/// # Errors
/// The connection failed.
pub async fn request_retry<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    selection: &Selection,
) -> Result<u64, sqlx::Error> {
    on_selected!(executor, selection, "UPDATE relay_parked SET retry_requested_at = now()")
}

/// Asks for a retry of every refused event that takes at most `max_bytes` in a record batch
/// (as [`crate::publish::record_size`] counts it) and waits for an operator: refused under a
/// lower limit than the one the relay holds now (read at start, or a raised limit it read
/// since), it would be sent as it is. Their documents' waiting events go out behind them,
/// in order ([`releasable`]). Returns how many refused events it released.
///
/// An event the broker refused for another reason than its size, and that fits, is sent
/// once more and parked again if refused again: this runs once a relay becomes active and
/// once each time it learns of a higher limit, never in a loop.
///
/// # Errors
/// The connection failed.
pub async fn retry_fitting(conn: &mut PgConnection, max_bytes: usize) -> Result<u64, sqlx::Error> {
    let max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
    let overhead = crate::publish::RECORD_OVERHEAD_BYTES as i64;
    let done = sqlx::query!(
        r#"
        UPDATE relay_parked p SET retry_requested_at = now()
        FROM job_events e
        WHERE e.seq = p.seq AND p.refused AND p.retry_requested_at IS NULL
          AND $2::bigint + octet_length(p.key) + octet_length(e.body) + octet_length(e.kind)
              + coalesce(octet_length(e.traceparent), 0) + coalesce(octet_length(e.tracestate), 0)
              <= $1::bigint
        "#,
        max_bytes,
        overhead,
    )
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Drops the selected refused events: they stay in `job_events` (the log of record) but
/// never reach Kafka. Their documents' waiting events then go out, in order. Returns how
/// many were dropped.
///
/// # Errors
/// The connection failed.
pub async fn drop_refused<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    selection: &Selection,
) -> Result<u64, sqlx::Error> {
    on_selected!(executor, selection, "DELETE FROM relay_parked")
}

impl Selection {
    /// The seq and the document the selection is bound to (`None`: any).
    fn bounds(&self) -> (Option<i64>, Option<&str>) {
        match self {
            Selection::Seq(seq) => (Some(*seq), None),
            Selection::Document(key) => (None, Some(key.as_str())),
            Selection::All => (None, None),
        }
    }
}

/// The events of a batch to park: the refused ones, and the ones waiting behind a parked
/// event.
pub fn parking(outcome: &Outcome) -> Vec<Parking> {
    let refused = outcome.refused.iter().map(|(seq, reason)| Parking {
        seq: *seq,
        refused: true,
        reason: reason.clone(),
    });
    let waiting = outcome.waiting.iter().map(|seq| Parking {
        seq: *seq,
        refused: false,
        reason: WAITING.to_owned(),
    });
    refused.chain(waiting).collect()
}
