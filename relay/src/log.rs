//! Reading the event log itself: events publishable at commit go to Kafka straight from
//! `job_events`, and the relay keeps how far it got in one row (`relay_cursor`).
//!
//! # Why the cursor never skips an event
//! Rows are read in `(xid, seq)` order, and only rows whose transaction id is below
//! `pg_snapshot_xmin(pg_current_snapshot())` — the oldest transaction still running. Every
//! transaction below it has ended, so such a row is committed (or gone with its rollback);
//! every transaction still running or not yet started has an xid at or above it, so any row
//! that commits later sorts after every row read. The cursor can therefore move past what it
//! read without ever passing a row that shows up later.
//!
//! The price: a transaction that stays open holds back publication of everything committed
//! after it began writing (`jobfold_relay_oldest_unpublished_age_seconds` shows it). Keep
//! transactions in this database short, as jobfold's own are.
//!
//! # Why per-document order holds
//! One job's events are appended by transactions that lock its row first, before any other
//! write, so each gets its xid only once the previous one committed: a later event has a
//! higher xid (`JobRow::fresh_xid` in the processor enforces it). A document's jobs are
//! ordered by their input versions, which the processor checks; their first events come from
//! separate accepts.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use crate::publish::Event;

/// A position in the log, in the order the relay reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    /// The writing transaction's id (`xid8`, as a number).
    pub xid: i64,
    pub seq: i64,
}

/// Where the relay stands: every event at or before it was delivered.
///
/// # Errors
/// The connection failed.
pub async fn cursor(conn: &mut PgConnection) -> Result<Position, sqlx::Error> {
    sqlx::query_as!(
        Position,
        r#"SELECT published_xid::text::bigint AS "xid!", published_seq AS seq FROM relay_cursor"#,
    )
    .fetch_one(conn)
    .await
}

/// Whether the log holds committed events past the cursor. Right after a pass, those are
/// events the pass could not read yet: at or above the horizon (`pg_snapshot_xmin`) because
/// an older transaction is still running — in this database or any other of the cluster.
/// That transaction may write no events, so its end notifies nobody: while this holds, the
/// relay must keep looking.
///
/// One probe of `job_events_relay_idx` from the cursor on. (Joined to the cursor plainly,
/// the planner expects a third of the log past it and scans the whole table.)
///
/// # Errors
/// The connection failed.
pub async fn past_cursor(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(
        r#"
        SELECT EXISTS (
            SELECT 1 FROM relay_cursor c, LATERAL (
                SELECT 1 FROM job_events e
                WHERE (e.xid, e.seq) > (c.published_xid, c.published_seq)
                ORDER BY e.xid, e.seq LIMIT 1
            ) after
        ) AS "past!"
        "#,
    )
    .fetch_one(conn)
    .await
}

/// Moves the cursor to `to`: every event at or before it was delivered.
///
/// # Errors
/// The connection failed; the events after the old position are published again.
pub async fn advance(conn: &mut PgConnection, to: Position) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "UPDATE relay_cursor SET published_xid = $1::text::xid8, published_seq = $2, \
         moved_at = now()",
        to.xid.to_string(),
        to.seq,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Moves the cursor back over the last `count` events of the log, so that those publishable at
/// commit are published again (an operator's republish; also how tests make duplicates).
/// Returns the new position.
///
/// # Errors
/// The connection failed.
pub async fn rewind(conn: &mut PgConnection, count: i64) -> Result<Position, sqlx::Error> {
    sqlx::query_as!(
        Position,
        r#"
        WITH target AS (
            SELECT e.xid, e.seq FROM job_events e, relay_cursor c
            WHERE (e.xid, e.seq) <= (c.published_xid, c.published_seq)
            ORDER BY e.xid DESC, e.seq DESC
            OFFSET $1 LIMIT 1
        )
        UPDATE relay_cursor SET published_xid = coalesce((SELECT xid FROM target), '0'),
                                published_seq = coalesce((SELECT seq FROM target), 0),
                                moved_at = now()
        RETURNING published_xid::text::bigint AS "xid!", published_seq AS seq
        "#,
        count,
    )
    .fetch_one(conn)
    .await
}

/// [`claim`]'s statement, as a constant for the hot path and as a `sqlx::query!` that the
/// compiler checks against the schema like every other: `claim_checked` (never run) binds
/// the parameters [`claim`] binds and reads each column as the type [`Batch`] reads it by
/// position (borrowed: `&str` for `String`, `&[u8]` for `Vec<u8>`). One literal feeds both,
/// so the two cannot differ.
macro_rules! claim_statement {
    ($sql:literal) => {
        /// The statement itself (the relay runs it unprepared by the compiler, see above).
        pub const CLAIM: &str = $sql;

        #[allow(dead_code, clippy::type_complexity)]
        async fn claim_checked(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
            let rows =
                sqlx::query!($sql, None::<String>, None::<i64>, 0_i64).fetch_all(conn).await?;
            for r in rows {
                let _columns: (
                    i64,
                    String,
                    Vec<u8>,
                    DateTime<Utc>,
                    Option<String>,
                    Option<String>,
                    String,
                    i64,
                    bool,
                ) = (
                    r.seq,
                    r.key,
                    r.body,
                    r.available_at,
                    r.traceparent,
                    r.tracestate,
                    r.kind,
                    r.xid,
                    r.delayed,
                );
            }
            Ok(())
        }
    };
}

// An xid8 is sent as a 64-bit integer: read as one (a cast to text and back costs Postgres
// more than the rest of the row). Without a position (`$1` and `$2` null) the read starts at
// the cursor, read in the same statement: a pass's first read is one statement, not two.
claim_statement!(
    r#"
    SELECT e.seq,
           coalesce(e.key, (SELECT j.document_id FROM jobs j WHERE j.job_id = e.job_id))
               AS "key!",
           CASE WHEN e.delayed THEN ''::bytea ELSE e.body END AS "body!",
           e.occurred_at AS available_at, e.traceparent, e.tracestate, e.kind,
           e.xid AS "xid: i64", e.delayed
    FROM job_events e
    WHERE (e.xid, e.seq) > (coalesce($1::text::xid8, (SELECT published_xid FROM relay_cursor)),
                            coalesce($2, (SELECT published_seq FROM relay_cursor)))
      AND e.xid < pg_snapshot_xmin(pg_current_snapshot())
    ORDER BY e.xid, e.seq
    LIMIT $3
    "#
);

/// Up to `limit` events after `after` whose transactions have ended, in cursor order. A
/// delayed event is in the batch without its body: the outbox sends it when it is due, and the
/// cursor moves past it like any other. An event's `available_at` is when it occurred.
///
/// # Errors
/// The connection failed.
pub async fn claim(
    conn: &mut PgConnection,
    after: Position,
    limit: u32,
) -> Result<Batch, sqlx::Error> {
    claim_by(conn, CLAIM, Some(after), limit).await
}

/// [`claim`] after the cursor as it stands, read by the same statement.
///
/// # Errors
/// The connection failed.
pub async fn claim_after_cursor(conn: &mut PgConnection, limit: u32) -> Result<Batch, sqlx::Error> {
    claim_by(conn, CLAIM, None, limit).await
}

/// [`claim`] with `statement` in place of [`CLAIM`] (after the cursor without `after`): what
/// shows that a statement whose columns moved is refused before its rows are read by
/// position.
///
/// # Errors
/// The connection failed, or the columns are not [`COLUMNS`].
#[doc(hidden)]
pub async fn claim_by(
    conn: &mut PgConnection,
    statement: &str,
    after: Option<Position>,
    limit: u32,
) -> Result<Batch, sqlx::Error> {
    let rows = sqlx::query(statement)
        .bind(after.map(|at| at.xid.to_string()))
        .bind(after.map(|at| at.seq))
        .bind(i64::from(limit))
        .fetch_all(conn)
        .await?;
    // Every row of a result has the same columns: checked once, on the first.
    if let Some(first) = rows.first() {
        check_columns(first)?;
    }
    Ok(Batch { rows })
}

/// The claim's columns, in the statement's order, with their Postgres types: [`Batch`]
/// reads each by its position here ([`SEQ`], [`KEY`], ...).
pub const COLUMNS: [(&str, &str); 9] = [
    ("seq", "INT8"),
    ("key!", "TEXT"),
    ("body!", "BYTEA"),
    ("available_at", "TIMESTAMPTZ"),
    ("traceparent", "TEXT"),
    ("tracestate", "TEXT"),
    ("kind", "TEXT"),
    ("xid: i64", "xid8"),
    ("delayed", "BOOL"),
];
const SEQ: usize = 0;
const KEY: usize = 1;
const BODY: usize = 2;
const AVAILABLE_AT: usize = 3;
const TRACEPARENT: usize = 4;
const TRACESTATE: usize = 5;
const KIND: usize = 6;
const XID: usize = 7;
const DELAYED: usize = 8;

/// Whether `row`'s columns are [`COLUMNS`], by name and type at each position: the reads by
/// position are unchecked, so a statement whose columns were reordered (two of one type
/// swapped, say, which the compile-time check of names lets through) is refused here
/// instead of read into the wrong fields.
///
/// # Errors
/// A column is not the one its position is read as.
pub fn check_columns(row: &PgRow) -> Result<(), sqlx::Error> {
    use sqlx::{Column, TypeInfo};
    let found: Vec<(&str, &str)> =
        row.columns().iter().map(|c| (c.name(), c.type_info().name())).collect();
    if found != COLUMNS {
        return Err(sqlx::Error::Protocol(format!(
            "the relay's log read returned the columns {found:?}, not {COLUMNS:?}"
        )));
    }
    Ok(())
}

/// Events read from the log, kept as Postgres sent them: the relay produces straight from
/// them (nothing is copied before librdkafka copies it). Columns are read by position, in
/// the statement's order, with the types `claim_checked` holds them to; [`claim`] checks the
/// batch's columns by name and type once ([`check_columns`]), not per row
/// (`try_get_unchecked`): at thousands of rows a batch, a check per row cost more than the
/// decoding.
#[derive(Debug, Default)]
pub struct Batch {
    rows: Vec<PgRow>,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Each event's place in the log, in cursor order.
    ///
    /// # Errors
    /// A row could not be decoded.
    pub fn positions(&self) -> Result<Vec<Position>, sqlx::Error> {
        self.rows
            .iter()
            .map(|row| {
                Ok(Position { xid: row.try_get_unchecked(XID)?, seq: row.try_get_unchecked(SEQ)? })
            })
            .collect()
    }

    /// The events to publish at commit (all but the delayed ones), for `topic`, in cursor
    /// order.
    ///
    /// # Errors
    /// A row could not be decoded.
    pub fn events<'a>(&'a self, topic: &'a str) -> Result<Vec<Event<'a>>, sqlx::Error> {
        let mut events = Vec::with_capacity(self.rows.len());
        for row in &self.rows {
            if row.try_get_unchecked::<bool, _>(DELAYED)? {
                continue;
            }
            events.push(Event {
                seq: row.try_get_unchecked(SEQ)?,
                topic,
                key: row.try_get_unchecked(KEY)?,
                body: row.try_get_unchecked(BODY)?,
                available_at: row.try_get_unchecked(AVAILABLE_AT)?,
                traceparent: row.try_get_unchecked(TRACEPARENT)?,
                tracestate: row.try_get_unchecked(TRACESTATE)?,
                kind: row.try_get_unchecked(KIND)?,
            });
        }
        Ok(events)
    }
}
