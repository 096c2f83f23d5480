//! `summarize-conversation`: asks a model server for a summary of a conversation and keeps
//! the latest one per conversation in `conversation_summaries`.
//!
//! Input: `{"messages": [{"role": "user", "content": "..."}, ...]}` (at least one message,
//! each with a string `content`); the job's document is the conversation. The model server is
//! any OpenAI-compatible chat completions endpoint (llama.cpp's server, vLLM, Ollama): the
//! conversation goes after a system instruction and the summary is the first choice's message.
//!
//! The call carries the job's idempotency key (`Idempotency-Key`, the same for every attempt
//! at one input version) and its `traceparent`. The model is called only while the job has
//! no committed result: a redelivery after the commit is recognised by the processor's dedupe
//! row before this handler is asked again. Errors follow the remote-handler table: 429 and
//! 5xx (with `Retry-After`), time-outs and refused connections are retryable.

use std::time::Duration;

use jobfold_processor::handler::{Committed, Handler, HandlerError, JobContext};
use jobfold_processor::remote;
use serde_json::{Value, json};
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

/// The job kind this handler runs.
pub const KIND: &str = "summarize-conversation";

/// The instruction put before the conversation.
const INSTRUCTION: &str =
    "Summarize this conversation in one or two sentences: who wants what, and what was decided.";

/// Summaries by a model server.
#[derive(Debug, Clone)]
pub struct Summarize {
    url: reqwest::Url,
    model: String,
    client: reqwest::Client,
}

impl Summarize {
    /// Calls the chat completions endpoint at `url` (such as
    /// `http://127.0.0.1:8090/v1/chat/completions`) with `model`; one call may take `timeout`.
    ///
    /// # Errors
    /// `url` does not parse or the client cannot be built.
    pub fn new(url: &str, model: impl Into<String>, timeout: Duration) -> anyhow::Result<Self> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(timeout)
            // Only the model's own URL answers for a job: a redirect is its answer, not
            // followed.
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Self { url: url.parse()?, model: model.into(), client })
    }

    /// The request for `messages`, as the model server takes it.
    fn request(&self, messages: &[Value]) -> Value {
        let mut all = vec![json!({"role": "system", "content": INSTRUCTION})];
        all.extend(messages.iter().map(|m| {
            json!({"role": m.get("role").and_then(Value::as_str).unwrap_or("user"), "content": m["content"]})
        }));
        json!({ "model": self.model, "messages": all, "temperature": 0 })
    }
}

/// The conversation's messages, or why the input is not one.
fn messages(input: &Value) -> Result<&[Value], HandlerError> {
    let messages =
        input.get("messages").and_then(Value::as_array).filter(|m| !m.is_empty()).ok_or_else(
            || HandlerError::invalid_input("input.messages must be a non-empty array"),
        )?;
    for (i, message) in messages.iter().enumerate() {
        if !message.get("content").is_some_and(Value::is_string) {
            return Err(HandlerError::invalid_input(format!(
                "input.messages[{i}].content must be a string"
            )));
        }
    }
    Ok(messages)
}

/// Tokens a summary's answer is counted at, on top of the conversation's.
const ANSWER_TOKENS: u64 = 256;

impl Handler for Summarize {
    /// What a call costs against `cost_per_minute` (a model's tokens a minute): the
    /// conversation at about four characters a token, the instruction and the answer.
    fn cost(&self, input: &Value) -> u64 {
        let characters: usize = input
            .get("messages")
            .and_then(Value::as_array)
            .map_or(0, |m| m.iter().filter_map(|m| m["content"].as_str()).map(str::len).sum());
        ((characters + INSTRUCTION.len()) / 4) as u64 + ANSWER_TOKENS
    }

    async fn run(
        &self,
        job: &JobContext,
        cancel: CancellationToken,
    ) -> Result<Value, HandlerError> {
        // The body is serialized here and its value let go of: only the bytes wait for the
        // answer.
        let mut request = self
            .client
            .post(self.url.clone())
            .header("Idempotency-Key", job.idempotency_key())
            .json(&self.request(messages(&job.input)?));
        if let Some(trace) = &job.trace {
            request = request.header("traceparent", &trace.traceparent);
        }
        let call = async {
            let response = request.send().await.map_err(|e| {
                HandlerError::retryable(format!(
                    "calling the model at {}: {}",
                    self.url,
                    remote::error_chain(&e)
                ))
            })?;
            let status = response.status();
            let retry_after = remote::retry_after(response.headers());
            let text = response.text().await.map_err(|e| {
                HandlerError::retryable(format!(
                    "reading the model's answer: {}",
                    remote::error_chain(&e)
                ))
            })?;
            if !status.is_success() {
                return Err(remote::failure(&self.url, status, retry_after, &text));
            }
            let answer: Value = serde_json::from_str(&text).map_err(|e| {
                HandlerError::retryable(format!("the model's answer is not JSON: {e}"))
            })?;
            let summary = answer
                .pointer("/choices/0/message/content")
                .and_then(Value::as_str)
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .ok_or_else(|| HandlerError::retryable("the model's answer holds no summary"))?;
            let model = answer.get("model").and_then(Value::as_str).unwrap_or(&self.model);
            Ok(json!({ "summary": summary, "model": model }))
        };
        tokio::select! {
            // Dropping the call closes its connection.
            _ = cancel.cancelled() => Err(HandlerError::retryable("cancelled before the model answered")),
            result = call => result,
        }
    }

    async fn commit(
        &self,
        tx: &mut PgConnection,
        job: &JobContext,
        output: &Value,
    ) -> Result<Committed, sqlx::Error> {
        let written = sqlx::query!(
            r#"
            INSERT INTO conversation_summaries (conversation_id, version, summary, model, job_id)
            VALUES ($1, $2, $3, $4, $5)
            ON CONFLICT (conversation_id) DO UPDATE
                SET version = EXCLUDED.version, summary = EXCLUDED.summary,
                    model = EXCLUDED.model, job_id = EXCLUDED.job_id, updated_at = now()
                WHERE conversation_summaries.version <= EXCLUDED.version
            "#,
            &job.document_id,
            job.input_version,
            output["summary"].as_str().unwrap_or_default(),
            output["model"].as_str().unwrap_or_default(),
            job.job_id,
        )
        .execute(&mut *tx)
        .await?;
        let newer = sqlx::query_scalar!(
            "SELECT version FROM conversation_summaries WHERE conversation_id = $1",
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
    fn a_conversation_needs_messages_with_text() {
        assert!(messages(&json!({"messages": [{"role": "user", "content": "hi"}]})).is_ok());
        for bad in [json!({}), json!({"messages": []}), json!({"messages": [{"role": "user"}]})] {
            let refused = messages(&bad).unwrap_err();
            assert_eq!(
                refused.class,
                jobfold_processor::handler::ErrorClass::InvalidInput,
                "{bad}"
            );
        }
    }
}
