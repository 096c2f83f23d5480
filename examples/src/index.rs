//! The example handler, `index-document`: tokenizes a document's text and stores its term
//! frequencies in `document_index`, only over an older version of the same document.
//!
//! Input: `{"text": "..."}`. A missing or non-string `text` is invalid input (quarantined,
//! never retried). Output: `{"words": n, "distinct": n, "terms": {"word": count, ...}}`.
//!
//! Its table is in `examples/migrations/100001_document_index.sql`.

use std::collections::BTreeMap;

use serde_json::{Value, json};
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

use jobfold_processor::handler::{Committed, Handler, HandlerError, JobContext};

/// The job kind this handler runs.
pub const KIND: &str = "index-document";

/// Tokenizes text into lower-case words and counts them.
#[derive(Debug, Default, Clone, Copy)]
pub struct IndexDocument;

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
        _cancel: CancellationToken,
    ) -> Result<Value, HandlerError> {
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
        let written = sqlx::query!(
            r#"
            INSERT INTO document_index (document_id, version, output, updated_at)
            VALUES ($1, $2, $3, now())
            ON CONFLICT (document_id) DO UPDATE
                SET version = EXCLUDED.version, output = EXCLUDED.output, updated_at = now()
                WHERE document_index.version <= EXCLUDED.version
            "#,
            &job.document_id,
            job.input_version,
            output,
        )
        .execute(&mut *tx)
        .await?;
        let newer = sqlx::query_scalar!(
            "SELECT version FROM document_index WHERE document_id = $1",
            &job.document_id
        )
        .fetch_one(&mut *tx);
        crate::applied_or_stale(written.rows_affected(), newer).await
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
