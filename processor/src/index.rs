//! The example handler, `index-document`: tokenizes a document's text and stores its term
//! frequencies in `document_index`, only over an older version of the same document.
//!
//! Input: `{"text": "..."}`. A missing or non-string `text` is invalid input (quarantined,
//! never retried).
//!
//! For demos and fault tests the input may also carry `"simulate"`:
//! `{"fail_attempts": 2}` fails the first two attempts retryably, `{"permanent": true}` fails
//! permanently, `{"sleep_ms": 200}` makes each attempt take that long.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

use crate::handler::{Committed, Handler, HandlerError, JobContext};

/// The job kind this handler runs.
pub const KIND: &str = "index-document";

/// Tokenizes text into lower-case words and counts them.
#[derive(Debug, Default, Clone, Copy)]
pub struct IndexDocument;

/// Appends one row to `index_writes`, the audit of business writes: it has no unique key, so
/// a write committed twice shows as two rows. Call it inside the write's transaction.
///
/// # Errors
/// The statement failed; the transaction should be rolled back.
pub async fn record_write(tx: &mut PgConnection, job: &JobContext) -> Result<(), sqlx::Error> {
    // language=PostgreSQL
    sqlx::query(
        "INSERT INTO index_writes (job_id, document_id, input_version, generation) \
         VALUES ($1, $2, $3, $4)",
    )
    .bind(job.job_id)
    .bind(&job.document_id)
    .bind(job.input_version)
    .bind(job.generation)
    .execute(tx)
    .await?;
    Ok(())
}

/// Lower-case alphanumeric words and how often each occurs.
pub fn term_frequencies(text: &str) -> BTreeMap<String, u64> {
    let mut terms = BTreeMap::new();
    for word in text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()) {
        *terms.entry(word.to_lowercase()).or_insert(0) += 1;
    }
    terms
}

impl Handler for IndexDocument {
    async fn run(
        &self,
        job: &JobContext,
        cancel: CancellationToken,
    ) -> Result<Value, HandlerError> {
        let simulate = job.input.get("simulate").cloned().unwrap_or(Value::Null);
        if let Some(ms) = simulate.get("sleep_ms").and_then(Value::as_u64) {
            tokio::select! {
                _ = cancel.cancelled() => return Err(HandlerError::retryable("cancelled: the lease was lost")),
                _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
            }
        }
        if simulate.get("permanent").and_then(Value::as_bool) == Some(true) {
            return Err(HandlerError::permanent("simulated permanent failure"));
        }
        let fail_attempts = simulate.get("fail_attempts").and_then(Value::as_i64).unwrap_or(0);
        if i64::from(job.attempt) <= fail_attempts {
            return Err(HandlerError::retryable(format!(
                "simulated transient failure (attempt {} of {fail_attempts} failing)",
                job.attempt
            )));
        }
        let text = job
            .input
            .get("text")
            .and_then(Value::as_str)
            .ok_or_else(|| HandlerError::invalid_input("input.text must be a string"))?;
        let terms = term_frequencies(text);
        let words: u64 = terms.values().sum();
        tracing::debug!(words, distinct = terms.len(), "Document indexed.");
        Ok(json!({ "words": words, "distinct": terms.len(), "terms": terms }))
    }

    async fn commit(
        &self,
        tx: &mut PgConnection,
        job: &JobContext,
        output: &Value,
    ) -> Result<Committed, sqlx::Error> {
        // Only over an older (or the same) version: a late, older job never overwrites a newer
        // index. Two jobs of the same version each write once.
        // language=PostgreSQL
        let written = sqlx::query(
            r#"
            INSERT INTO document_index (document_id, version, output, updated_at)
            VALUES ($1, $2, $3, now())
            ON CONFLICT (document_id) DO UPDATE
                SET version = EXCLUDED.version, output = EXCLUDED.output, updated_at = now()
                WHERE document_index.version <= EXCLUDED.version
            "#,
        )
        .bind(&job.document_id)
        .bind(job.input_version)
        .bind(output)
        .execute(&mut *tx)
        .await?;
        if written.rows_affected() == 0 {
            let newer: i64 =
                sqlx::query_scalar("SELECT version FROM document_index WHERE document_id = $1")
                    .bind(&job.document_id)
                    .fetch_one(&mut *tx)
                    .await?;
            return Ok(Committed::Stale { newer_version: newer });
        }
        record_write(tx, job).await?;
        Ok(Committed::Applied)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_lower_case_words() {
        let terms = term_frequencies("The cat, the HAT; the end.");
        assert_eq!(terms["the"], 3);
        assert_eq!(terms["cat"], 1);
        assert_eq!(terms.len(), 4);
        assert!(term_frequencies("  ,;  ").is_empty());
    }
}
