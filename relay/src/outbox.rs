//! The relay's queries on the outbox (its backlog gauge query is
//! [`jobfold_common::gauges::relay_backlog`], shared with `jobfold stats`). Each takes the connection that holds the active
//! lock: if that connection dies, the relay stops marking rows and stands by again.

use sqlx::PgConnection;

use crate::publish::StoredEvent;

/// The oldest `limit` unpublished rows that are due and come after `after_seq`, in log order,
/// among those the log cursor has passed, each for the topic it names.
///
/// Log order keeps per-document order: events of one job are written by transactions that
/// follow one another, so a later event always has a higher seq and commits later. And a
/// delayed event waits for the cursor to pass its own place in the log, so the events its
/// transaction (and those before) wrote to the log go out first.
///
/// # Errors
/// The connection failed.
pub async fn claim(
    conn: &mut PgConnection,
    after_seq: i64,
    limit: u32,
) -> Result<Vec<StoredEvent>, sqlx::Error> {
    sqlx::query_as!(
        StoredEvent,
        r#"
        SELECT o.seq, o.topic AS "topic?", o.key, e.body, o.available_at, o.traceparent,
               o.tracestate, e.kind
        FROM outbox o
        JOIN job_events e USING (seq)
        CROSS JOIN relay_cursor c
        WHERE o.published_at IS NULL AND o.available_at <= now() AND o.seq > $1
          AND (e.xid, e.seq) <= (c.published_xid, c.published_seq)
        ORDER BY o.seq
        LIMIT $2
        "#,
        after_seq,
        i64::from(limit),
    )
    .fetch_all(conn)
    .await
}

/// Marks rows whose delivery the broker acknowledged; with `delete`, deletes them instead
/// (`relay.prune_after = "0s"`: no published history in the outbox, half the database work).
///
/// # Errors
/// The connection failed; the rows stay unpublished and will be published again.
pub async fn mark_published(
    conn: &mut PgConnection,
    seqs: &[i64],
    delete: bool,
) -> Result<u64, sqlx::Error> {
    if seqs.is_empty() {
        return Ok(0);
    }
    if delete {
        let done =
            sqlx::query!("DELETE FROM outbox WHERE seq = ANY($1)", seqs).execute(conn).await?;
        return Ok(done.rows_affected());
    }
    let done = sqlx::query!(
        "UPDATE outbox SET published_at = now() WHERE seq = ANY($1) AND published_at IS NULL",
        seqs,
    )
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Deletes up to `limit` rows published more than `older_than_secs` ago; returns how many.
///
/// # Errors
/// The connection failed.
pub async fn prune(
    conn: &mut PgConnection,
    older_than_secs: f64,
    limit: i64,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query!(
        r#"
        DELETE FROM outbox WHERE seq IN (
            SELECT seq FROM outbox
            WHERE published_at < now() - make_interval(secs => $1)
            ORDER BY published_at
            LIMIT $2
        )
        "#,
        older_than_secs,
        limit,
    )
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}
