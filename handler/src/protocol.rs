//! The messages of handlers over HTTP (docs/processor.md, "Handlers over HTTP"), for a
//! service that answers the processor's calls.
//!
//! Each attempt is one `POST` of a [`Call`] to the kind's URL, with an [`IDEMPOTENCY_KEY`]
//! header (the same for every attempt of the job at its input version), the W3C
//! [`crate::TRACEPARENT`] and, for a kind with a secret, a [`SIGNATURE`]. The answer's
//! status decides the attempt (2xx: its JSON body is the result; 422: invalid input; 429:
//! throttled; 503 with `Retry-After`: snoozed; 202: the handler calls back). After a `202`
//! the handler sends [`Heartbeat`]s to `heartbeat_url` and one [`Complete`] to
//! `complete_url`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::{JobContext, PreviousOutcome};

/// The header carrying [`JobContext::idempotency_key`].
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The header carrying a call's (and a callback's) signature:
/// `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
pub const SIGNATURE: &str = "jobfold-signature";

/// One attempt's request body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Call {
    pub job_id: Uuid,
    pub kind: String,
    pub document_id: String,
    pub input_version: i64,
    /// The job's input, as accepted.
    pub input: Value,
    /// Which attempt this is, from 1.
    pub attempt: i32,
    /// `attempt == max_attempts` is the last try.
    pub max_attempts: i32,
    /// How the attempt before ended: after `ambiguous`, look the idempotency key up before
    /// acting again.
    pub previous_outcome: PreviousOutcome,
    /// The lease generation: every callback names it, and one of another generation is
    /// refused.
    pub generation: i64,
    /// When the job's elapsed-time budget ends, if it has one.
    pub deadline: Option<DateTime<Utc>>,
    /// Where to send [`Heartbeat`]s after answering `202` (present when a processor can take
    /// callbacks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_url: Option<String>,
    /// Where to send the [`Complete`] after answering `202`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub complete_url: Option<String>,
}

impl Call {
    /// The call for `job`'s attempt, without callback URLs.
    pub fn new(job: &JobContext) -> Self {
        Self {
            job_id: job.job_id,
            kind: job.kind.clone(),
            document_id: job.document_id.clone(),
            input_version: job.input_version,
            input: job.input.clone(),
            attempt: job.attempt,
            max_attempts: job.max_attempts,
            previous_outcome: job.previous_outcome,
            generation: job.generation,
            deadline: job.deadline,
            heartbeat_url: None,
            complete_url: None,
        }
    }

    /// The same key as the call's [`IDEMPOTENCY_KEY`] header.
    pub fn idempotency_key(&self) -> String {
        format!("{}:{}", self.job_id, self.input_version)
    }
}

/// A heartbeat's body (`POST heartbeat_url`): the job's kind (whose secret signs it) and the
/// generation it was called with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    pub kind: String,
    pub generation: i64,
    /// Anything the handler wants shown as the job's progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Value>,
}

/// A completion's body (`POST complete_url`): exactly one of `result` and `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Complete {
    pub kind: String,
    pub generation: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<CompleteError>,
}

/// A failed completion: what a synchronous answer would have said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteError {
    /// 408, 422, 429, 4xx, 5xx: read by the protocol's table, as the status of a
    /// synchronous answer would be.
    pub status: u16,
    #[serde(default)]
    pub message: String,
    /// Seconds; cut to the kind's `max_retry_after` as any `Retry-After`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_reads_back_as_sent_and_names_its_fields_as_the_protocol_does() {
        let job = JobContext {
            job_id: Uuid::nil(),
            document_id: "doc-1".into(),
            kind: "render".into(),
            input_version: 3,
            input: serde_json::json!({"text": "hi"}),
            attempt: 2,
            generation: 7,
            trace: None,
            deadline: None,
            max_attempts: 5,
            previous_outcome: PreviousOutcome::Ambiguous,
        };
        let call = Call { complete_url: Some("http://p/complete".into()), ..Call::new(&job) };
        let sent = serde_json::to_value(&call).unwrap();
        assert_eq!(sent["previous_outcome"], "ambiguous");
        assert_eq!(sent["deadline"], Value::Null);
        assert!(sent.get("heartbeat_url").is_none(), "{sent}");
        assert_eq!(serde_json::from_value::<Call>(sent).unwrap(), call);
        assert_eq!(call.idempotency_key(), job.idempotency_key());
    }

    #[test]
    fn a_completion_with_a_field_the_protocol_lacks_is_refused() {
        let body = r#"{"kind":"render","generation":1,"result":{},"status":200}"#;
        let e = serde_json::from_str::<Complete>(body).unwrap_err();
        assert!(e.to_string().contains("unknown field `status`"), "{e}");
    }
}
