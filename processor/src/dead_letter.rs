//! Poison messages: kept in `dead_letters` with their coordinates and raw bytes, so the
//! partition moves on and nothing is lost.

use crate::internal_events::{At, DeadLettered};
use crate::metrics as m;
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
    message: Raw<'_>,
    error: &str,
) -> Result<(), sqlx::Error> {
    insert(pool, group, message, error).await?;
    stored(group, message, error);
    Ok(())
}

/// Stores a dead letter (once per group, topic, partition and offset) with `executor`, e.g.
/// in a transaction; the caller calls [`stored`] once it committed.
///
/// # Errors
/// The database failed.
pub async fn insert(
    executor: impl sqlx::PgExecutor<'_>,
    group: &str,
    message: Raw<'_>,
    error: &str,
) -> Result<(), sqlx::Error> {
    // The reason may quote the message; Postgres text cannot hold U+0000.
    let error = error.replace('\0', "\u{fffd}");
    sqlx::query!(
        r#"
        INSERT INTO dead_letters (consumer_group, topic, kafka_partition, kafka_offset,
                                  raw_key, raw_value, error)
        VALUES ($1, $2, $3, $4, $5, $6, $7)
        ON CONFLICT ON CONSTRAINT dead_letters_coordinates_key DO NOTHING
        "#,
        group,
        message.at.topic,
        message.at.partition,
        message.at.offset,
        message.key,
        message.payload,
        error.as_str(),
    )
    .execute(executor)
    .await?;
    Ok(())
}

/// Logs and counts a dead letter [`insert`] stored.
pub fn stored(group: &str, message: Raw<'_>, error: &str) {
    DeadLettered { at: message.at.coordinates(), group, error }.emit();
}

/// A message as a dead letter keeps it: where it sits and its raw bytes.
#[derive(Debug, Clone, Copy)]
pub struct Raw<'a> {
    pub at: At<'a>,
    pub key: Option<&'a [u8]>,
    pub payload: Option<&'a [u8]>,
}

impl<'a> Raw<'a> {
    pub fn of(message: &'a impl Message) -> Self {
        Self { at: At::of(message), key: message.key(), payload: message.payload() }
    }
}

/// A dead letter as operators list it (`GET /v1/dead-letters`, `jobfold dead-letters list`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadLetter {
    pub id: i64,
    pub consumer_group: String,
    pub topic: String,
    pub kafka_partition: i32,
    pub kafka_offset: i64,
    pub error: String,
    pub received_at: chrono::DateTime<chrono::Utc>,
    /// Bytes of the raw key and value.
    pub key_bytes: Option<i32>,
    pub value_bytes: Option<i32>,
    /// When it was last sent back to the intake topic, and how often it was.
    pub reinjected_at: Option<chrono::DateTime<chrono::Utc>>,
    pub reinjected_count: i32,
}

/// One dead letter with its raw bytes, as hex and as text.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadLetterDetail {
    #[serde(flatten)]
    pub letter: DeadLetter,
    pub key_hex: Option<String>,
    pub key_text: Option<String>,
    pub value_hex: Option<String>,
    pub value_text: Option<String>,
}

/// Which dead letters to list: a topic's, a page after an id.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterFilter {
    pub topic: Option<String>,
    pub consumer_group: Option<String>,
    /// The page after this id (the previous page's `next`).
    pub after: Option<i64>,
    /// At most this many, oldest first (default 50, at most 1000).
    pub limit: Option<i64>,
}

/// A page of dead letters.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadLetterPage {
    pub dead_letters: Vec<DeadLetter>,
    pub next: Option<i64>,
}

/// `sqlx::query_as!` of [`DeadLetter`]s: `FROM dead_letters` and `$rest`, with its arguments.
macro_rules! select_dead_letters {
    ($rest:literal $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            DeadLetter,
            r#"SELECT id, consumer_group, topic, kafka_partition, kafka_offset, error,
                      received_at, length(raw_key) AS key_bytes, length(raw_value) AS value_bytes,
                      reinjected_at, reinjected_count
               FROM dead_letters "# + $rest
            $(, $arg)*
        )
    };
}

/// Dead letters matching `filter`, oldest first, keyset-paged by id.
///
/// # Errors
/// The database failed.
pub async fn list(pool: &PgPool, filter: &DeadLetterFilter) -> Result<DeadLetterPage, sqlx::Error> {
    let limit = filter.limit.unwrap_or(50).clamp(1, 1000);
    let dead_letters = select_dead_letters!(
        "WHERE ($1::text IS NULL OR topic = $1) AND ($2::text IS NULL OR consumer_group = $2) \
           AND id > $3 \
         ORDER BY id LIMIT $4",
        filter.topic.as_deref(),
        filter.consumer_group.as_deref(),
        filter.after.unwrap_or(0),
        limit,
    )
    .fetch_all(pool)
    .await?;
    let next =
        (dead_letters.len() as i64 == limit).then(|| dead_letters.last().map(|d| d.id)).flatten();
    Ok(DeadLetterPage { dead_letters, next })
}

/// One dead letter with its bytes, if it exists.
///
/// # Errors
/// The database failed.
pub async fn show(pool: &PgPool, id: i64) -> Result<Option<DeadLetterDetail>, sqlx::Error> {
    let Some(Stored { letter, raw_key: key, raw_value: value }) = stored_letter(pool, id).await?
    else {
        return Ok(None);
    };
    Ok(Some(DeadLetterDetail {
        letter,
        key_hex: key.as_deref().map(hex::encode),
        key_text: key.as_deref().map(printable),
        value_hex: value.as_deref().map(hex::encode),
        value_text: value.as_deref().map(printable),
    }))
}

/// A dead letter's row, raw bytes included.
struct Stored {
    letter: DeadLetter,
    raw_key: Option<Vec<u8>>,
    raw_value: Option<Vec<u8>>,
}

async fn stored_letter(pool: &PgPool, id: i64) -> Result<Option<Stored>, sqlx::Error> {
    // Two reads: a letter deleted between them is not found.
    let Some(letter) = select_dead_letters!("WHERE id = $1", id).fetch_optional(pool).await? else {
        return Ok(None);
    };
    let raw = sqlx::query!("SELECT raw_key, raw_value FROM dead_letters WHERE id = $1", id)
        .fetch_optional(pool)
        .await?;
    Ok(raw.map(|raw| Stored { letter, raw_key: raw.raw_key, raw_value: raw.raw_value }))
}

/// The bytes as text: UTF-8 where they are, each other byte and each control character
/// but newline and tab as `.` (as a hex dump's text column shows them).
pub fn printable(bytes: &[u8]) -> String {
    let mut text = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            text.push(if c.is_control() && c != '\n' && c != '\t' { '.' } else { c });
        }
        text.extend(std::iter::repeat_n('.', chunk.invalid().len()));
    }
    text
}

/// Deletes a dead letter; false if there was none.
///
/// # Errors
/// The database failed.
pub async fn delete(pool: &PgPool, id: i64) -> Result<bool, sqlx::Error> {
    let gone = sqlx::query!("DELETE FROM dead_letters WHERE id = $1", id).execute(pool).await?;
    if gone.rows_affected() == 1 {
        metrics::counter!(m::DEAD_LETTER_ACTIONS_TOTAL, "action" => "deleted").increment(1);
    }
    Ok(gone.rows_affected() == 1)
}

/// Which dead letters a bulk delete takes: those of a topic, of a consumer group, received
/// before a time (each optional; together, all must hold).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteFilter {
    pub topic: Option<String>,
    pub consumer_group: Option<String>,
    pub before: Option<chrono::DateTime<chrono::Utc>>,
    /// Count them, delete nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// What a bulk delete found and did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Deleted {
    pub matched: i64,
    pub deleted: i64,
    pub dry_run: bool,
}

/// Deletes the dead letters `filter` selects (counts them with `dry_run`), in one statement.
///
/// # Errors
/// The database failed.
pub async fn delete_matching(pool: &PgPool, filter: &DeleteFilter) -> Result<Deleted, sqlx::Error> {
    let (topic, group, before) =
        (filter.topic.as_deref(), filter.consumer_group.as_deref(), filter.before);
    if filter.dry_run {
        let matched = sqlx::query_scalar!(
            r#"SELECT count(*) AS "n!" FROM dead_letters
               WHERE ($1::text IS NULL OR topic = $1) AND ($2::text IS NULL OR consumer_group = $2)
                 AND ($3::timestamptz IS NULL OR received_at < $3)"#,
            topic,
            group,
            before,
        )
        .fetch_one(pool)
        .await?;
        return Ok(Deleted { matched, deleted: 0, dry_run: true });
    }
    let gone = sqlx::query!(
        "DELETE FROM dead_letters \
         WHERE ($1::text IS NULL OR topic = $1) AND ($2::text IS NULL OR consumer_group = $2) \
           AND ($3::timestamptz IS NULL OR received_at < $3)",
        topic,
        group,
        before,
    )
    .execute(pool)
    .await?;
    let deleted = i64::try_from(gone.rows_affected()).unwrap_or(i64::MAX);
    metrics::counter!(m::DEAD_LETTER_ACTIONS_TOTAL, "action" => "deleted")
        .increment(gone.rows_affected());
    Ok(Deleted { matched: deleted, deleted, dry_run: false })
}

/// Why a re-inject was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReinjectError {
    #[error("no dead letter {0}")]
    NotFound(i64),
    /// Only the intake's dead letters go back: an events-topic message is the relay's copy
    /// of the log, not a producer's request.
    #[error("dead letter {id} came from topic {topic}, not the intake topic {intake}")]
    NotIntake { id: i64, topic: String, intake: String },
    #[error("dead letter {0} has no value to send")]
    NoValue(i64),
    #[error("producing to Kafka: {0}")]
    Kafka(String),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Where a re-injected message went.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Reinjected {
    pub id: i64,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

/// Sends a dead letter's raw key and value back to the intake topic (after its cause was
/// fixed: the kind registered, the producer's schema in this registry), with
/// `acks=all`, idempotent, and records when. The intake accepts it like any request; its
/// request id keeps a second re-inject, or one of a request accepted meanwhile, from
/// making a second job.
///
/// # Errors
/// [`ReinjectError`].
pub async fn reinject(
    pool: &PgPool,
    config: &jobfold_common::config::Config,
    id: i64,
) -> Result<Reinjected, ReinjectError> {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let Stored { letter, raw_key: key, raw_value: value } =
        stored_letter(pool, id).await?.ok_or(ReinjectError::NotFound(id))?;
    let topic = letter.topic;
    let intake = &config.topics.requests;
    if &topic != intake {
        return Err(ReinjectError::NotIntake { id, topic, intake: intake.clone() });
    }
    let value = value.ok_or(ReinjectError::NoValue(id))?;
    let producer: FutureProducer = config
        .kafka_client()
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .map_err(|e| ReinjectError::Kafka(e.to_string()))?;
    let mut record = FutureRecord::<[u8], [u8]>::to(intake).payload(&value);
    if let Some(key) = key.as_deref() {
        record = record.key(key);
    }
    let delivered = producer
        .send(record, std::time::Duration::from_secs(30))
        .await
        .map_err(|(e, _)| ReinjectError::Kafka(e.to_string()))?;
    sqlx::query!(
        "UPDATE dead_letters SET reinjected_at = now(), reinjected_count = reinjected_count + 1 \
         WHERE id = $1",
        id,
    )
    .execute(pool)
    .await?;
    metrics::counter!(m::DEAD_LETTER_ACTIONS_TOTAL, "action" => "reinjected").increment(1);
    Ok(Reinjected {
        id,
        topic: intake.clone(),
        partition: delivered.partition,
        offset: delivered.offset,
    })
}
