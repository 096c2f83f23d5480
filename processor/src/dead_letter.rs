//! Poison messages: kept in `dead_letters` with their coordinates and raw bytes, so the
//! partition moves on and nothing is lost.

use jobfold_common::metrics as m;
use rdkafka::Message;
use sqlx::PgPool;

/// Logs, stores (once per group, topic, partition and offset) and counts a message that
/// cannot be handled.
///
/// # Errors
/// The database failed; the caller must not move past the message.
pub async fn store(
    pool: &PgPool,
    group: &str,
    message: &impl Message,
    error: &str,
) -> Result<(), sqlx::Error> {
    // The reason may quote the message; Postgres text cannot hold U+0000.
    let error = error.replace('\0', "\u{fffd}");
    let error = error.as_str();
    tracing::warn!(
        topic = message.topic(),
        partition = message.partition(),
        offset = message.offset(),
        group,
        error,
        "Dead-lettering a message."
    );
    // language=PostgreSQL
    sqlx::query(
        r#"
        INSERT INTO dead_letters (consumer_group, topic, kafka_partition, kafka_offset,
                                  raw_key, raw_value, error)
        VALUES ($1, $2, $3, $4, $5, $6, $7)
        ON CONFLICT ON CONSTRAINT dead_letters_coordinates_key DO NOTHING
        "#,
    )
    .bind(group)
    .bind(message.topic())
    .bind(message.partition())
    .bind(message.offset())
    .bind(message.key())
    .bind(message.payload())
    .bind(error)
    .execute(pool)
    .await?;
    metrics::counter!(m::DEAD_LETTERS_TOTAL, "topic" => message.topic().to_owned()).increment(1);
    Ok(())
}
