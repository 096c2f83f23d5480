//! Handlers in any language: a kind run by calling a URL (`[kinds.<kind>] url`).
//!
//! The protocol (docs/processor.md#handlers-over-http): one `POST` per attempt with the job as
//! JSON, an `Idempotency-Key` (the same for every attempt of the job at its input version) and
//! the W3C `traceparent`. The answer decides the attempt:
//!
//! | answer | attempt |
//! | --- | --- |
//! | 2xx with a JSON body | succeeds; the body is the result |
//! | 422 | invalid input: quarantined, never retried |
//! | 429 | throttled: retried without spending an attempt; the kind backs off (`Retry-After`) |
//! | 503 with `Retry-After` | snoozed: this job alone runs again then, without spending an attempt (up to `max_snoozes`) |
//! | 408, 5xx, a time-out, a refused or broken connection | retryable, not before `Retry-After` |
//! | 3xx | permanent: redirects are not followed, the reason names the `Location` |
//! | 202 | accepted: the handler completes by calling back ([`crate::callback`]) |
//! | any other 4xx, or a 2xx whose body is not JSON | permanent: quarantined |
//!
//! The request carries `attempt`, `max_attempts`, `deadline` and `previous_outcome`
//! (`none`, `failed`, `ambiguous`: whether the last attempt's effects may have happened),
//! and, where the processor runs it, `heartbeat_url` and `complete_url` for a `202`. A time-out
//! or a connection lost after the request was sent fails the attempt as ambiguous; a
//! connection that never opened does not. For a kind with a `secret`, each call is signed
//! (`Jobfold-Signature`, [`crate::signature`]).
//!
//! Every `Retry-After` is cut to the kind's `max_retry_after`. The processor's heartbeats go
//! on while the call runs; a lost lease, shutdown or the kind's `request_timeout` (else its
//! `run_timeout`) drops the call (its connection is closed). The answer is read up to the
//! kind's `max_output_bytes`; only the configured URL ever answers for a job.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::handler::protocol::{self, Call};
use crate::handler::{Handler, HandlerError, JobContext};

/// How much of an error answer's body is kept as the attempt's error.
const ERROR_BODY_BYTES: usize = 2048;

/// Runs a kind by calling `url` with each attempt.
#[derive(Debug, Clone)]
pub struct Remote {
    url: reqwest::Url,
    /// The URL as errors and logs show it: credentials and query values hidden.
    shown: String,
    client: reqwest::Client,
    max_output_bytes: usize,
    /// Where a job's cost is in its input (a JSON pointer), for `cost_per_minute`.
    cost_pointer: Option<String>,
    /// One call's whole time, from connecting to the answer's last byte.
    request_timeout: Option<Duration>,
    /// Signs each call ([`crate::signature`]).
    secret: Option<jobfold_common::config::Sensitive<String>>,
    /// After a `202`: the longest wait between callbacks.
    callback_timeout: Duration,
}

/// How long a connection may take to open, unless the kind says (`connect_timeout`).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

fn client(
    connect_timeout: Duration,
    http2: bool,
    authorities: Vec<reqwest::Certificate>,
) -> reqwest::Result<reqwest::Client> {
    let builder = reqwest::Client::builder().tls_certs_merge(authorities);
    // h2c: every call a stream of one connection (or a few), however many are in flight.
    let builder = if http2 { builder.http2_prior_knowledge() } else { builder };
    builder
        .connect_timeout(connect_timeout)
        // A redirect would have another URL answer for the job (with its body and its
        // Idempotency-Key sent there): never followed, a 3xx is the attempt's answer.
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("jobfold-processor/", env!("CARGO_PKG_VERSION")))
        .build()
}

impl Remote {
    /// A handler calling `url`; answers longer than `max_output_bytes` fail permanently.
    ///
    /// # Errors
    /// `url` does not parse, or the HTTP client cannot be built.
    pub fn new(url: &str, max_output_bytes: usize) -> anyhow::Result<Self> {
        let url: reqwest::Url = url.parse()?;
        Ok(Self {
            shown: jobfold_common::config::redacted(url.as_str()),
            url,
            client: client(CONNECT_TIMEOUT, false, Vec::new())?,
            max_output_bytes,
            cost_pointer: None,
            request_timeout: None,
            secret: None,
            callback_timeout: Duration::from_secs(60),
        })
    }

    /// A handler calling `url` with `kind`'s limits: its `max_output_bytes`,
    /// `connect_timeout` and `request_timeout` (else its `run_timeout`), its `secret`,
    /// `callback_timeout`, `http2` and `ca_file`.
    ///
    /// # Errors
    /// `url` does not parse, `ca_file` does not read as PEM certificates, or the HTTP client
    /// cannot be built.
    pub fn for_kind(
        url: &str,
        kind: &jobfold_common::config::KindSettings,
    ) -> anyhow::Result<Self> {
        let authorities = match &kind.ca_file {
            Some(file) => {
                let pem =
                    std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
                reqwest::Certificate::from_pem_bundle(&pem)
                    .with_context(|| format!("the certificates in {}", file.display()))?
            }
            None => Vec::new(),
        };
        Ok(Self {
            client: client(kind.connect_timeout, kind.http2, authorities)?,
            request_timeout: kind.request_timeout,
            secret: kind.secret.clone(),
            callback_timeout: kind.callback_timeout,
            ..Self::new(url, kind.max_output_bytes)?
        })
    }

    /// A job's cost is the unsigned integer at `pointer` in its input (`/usage/tokens`), or 1
    /// where there is none: `[kinds.<kind>] cost_pointer`.
    #[must_use]
    pub fn with_cost_pointer(mut self, pointer: Option<String>) -> Self {
        self.cost_pointer = pointer;
        self
    }

    /// The request's body: everything the remote handler is given, and where it calls back
    /// (`scope`: run by a processor).
    fn body(job: &JobContext, scope: Option<&crate::callback::Scope>) -> Call {
        let mut call = Call::new(job);
        if let Some(scope) = scope {
            let (heartbeat, complete) = scope.urls(job.job_id);
            call.heartbeat_url = Some(heartbeat);
            call.complete_url = Some(complete);
        }
        call
    }

    /// The attempt's error for a call that failed before an answer: ambiguous unless the
    /// connection never opened (the request was not sent).
    fn unanswered(&self, e: reqwest::Error, doing: &str) -> HandlerError {
        let sent = !e.is_connect();
        let error = HandlerError::retryable(format!(
            "{doing} {}: {}",
            self.shown,
            error_chain(&e.without_url())
        ));
        if sent { error.ambiguous() } else { error }
    }

    /// Calls the handler with `job`, telling it where to call back if `scope` (run by a
    /// processor): its answer.
    async fn call(
        &self,
        job: &JobContext,
        scope: Option<&crate::callback::Scope>,
    ) -> Result<Answer, HandlerError> {
        let body = serde_json::to_vec(&Self::body(job, scope))
            .map_err(|e| HandlerError::permanent(format!("the request does not encode: {e}")))?;
        let mut request = self
            .client
            .post(self.url.clone())
            .header(protocol::IDEMPOTENCY_KEY, job.idempotency_key())
            .header(reqwest::header::CONTENT_TYPE, "application/json");
        if let Some(secret) = &self.secret {
            request = request.header(
                crate::signature::HEADER,
                crate::signature::sign_now(secret.expose().as_bytes(), &body),
            );
        }
        let mut request = request.body(body);
        if let Some(limit) = self.request_timeout {
            request = request.timeout(limit);
        }
        if let Some(trace) = &job.trace {
            request = request.header("traceparent", &trace.traceparent);
            if let Some(state) = &trace.tracestate {
                request = request.header("tracestate", state);
            }
        }
        let mut response = request.send().await.map_err(|e| self.unanswered(e, "calling"))?;
        let status = response.status();
        if status == reqwest::StatusCode::ACCEPTED {
            return Ok(Answer::Accepted);
        }
        let retry_after = retry_after(response.headers());
        if status.is_redirection() {
            let location = response
                .headers()
                .get(reqwest::header::LOCATION)
                .map(|l| String::from_utf8_lossy(l.as_bytes()).chars().take(512).collect())
                .unwrap_or_else(|| "nowhere".to_owned());
            return Err(HandlerError::permanent(format!(
                "{} answered {status}, a redirect to {location:?}: redirects are not followed, \
                 the result must come from the configured URL",
                self.shown
            )));
        }
        let limit = if status.is_success() { self.max_output_bytes } else { ERROR_BODY_BYTES };
        let mut body = Vec::new();
        let mut cut = false;
        loop {
            let chunk =
                response.chunk().await.map_err(|e| self.unanswered(e, "reading the answer of"))?;
            let Some(chunk) = chunk else { break };
            body.extend_from_slice(&chunk);
            if body.len() > limit {
                cut = true;
                body.truncate(limit);
                break;
            }
        }
        if status.is_success() {
            if cut {
                return Err(HandlerError::permanent(format!(
                    "{} answered with more than max_output_bytes ({limit} bytes)",
                    self.shown
                )));
            }
            return serde_json::from_slice(&body).map(Answer::Result).map_err(|e| {
                HandlerError::permanent(format!(
                    "{} answered {status} with a body that is not JSON: {e}",
                    self.shown
                ))
            });
        }
        Err(failure(&self.url, status, retry_after, &String::from_utf8_lossy(&body)))
    }

    /// The attempt's end as the handler called it back: as a synchronous answer with its
    /// status would have been.
    fn completed(&self, outcome: crate::callback::Outcome) -> Result<Value, HandlerError> {
        let status = reqwest::StatusCode::from_u16(outcome.status)
            .unwrap_or(reqwest::StatusCode::INTERNAL_SERVER_ERROR);
        if status.is_success() {
            let result = outcome.result.unwrap_or(Value::Null);
            let size = serde_json::to_vec(&result).map_or(usize::MAX, |b| b.len());
            if size > self.max_output_bytes {
                return Err(HandlerError::permanent(format!(
                    "{} completed with a result of {size} bytes, more than max_output_bytes ({})",
                    self.shown, self.max_output_bytes
                )));
            }
            return Ok(result);
        }
        let message = format!("(completed) {}", outcome.error.unwrap_or_default());
        Err(failure(&self.url, status, outcome.retry_after.map(Duration::from_secs), &message))
    }
}

/// What a call was answered.
enum Answer {
    /// Its result.
    Result(Value),
    /// `202 Accepted`: the handler completes by calling back.
    Accepted,
}

/// The attempt's failure for an answer that is not a success, by the protocol's table:
/// 422 invalid input; 429 throttled; 503 with a `retry_after` snoozed; 408 and 5xx retryable
/// (not before `retry_after`); any other status (3xx included) permanent. `body` is kept in the message, trimmed. For handlers that call HTTP
/// services themselves, too.
pub fn failure(
    url: &reqwest::Url,
    status: reqwest::StatusCode,
    retry_after: Option<Duration>,
    body: &str,
) -> HandlerError {
    let mut cut = body.trim();
    if cut.len() > ERROR_BODY_BYTES {
        let mut end = ERROR_BODY_BYTES;
        while !cut.is_char_boundary(end) {
            end -= 1;
        }
        cut = &cut[..end];
    }
    let message =
        format!("{} answered {status}: {cut}", jobfold_common::config::redacted(url.as_str()));
    match status.as_u16() {
        422 => HandlerError::invalid_input(message),
        503 if retry_after.is_some() => {
            HandlerError::snooze(message, retry_after.unwrap_or_default())
        }
        408 | 429 | 500..=599 => {
            let error = if status.as_u16() == 429 {
                HandlerError::throttled(message)
            } else {
                HandlerError::retryable(message)
            };
            match retry_after {
                Some(delay) => error.retry_after(delay),
                None => error,
            }
        }
        _ => HandlerError::permanent(message),
    }
}

impl Handler for Remote {
    fn cost(&self, input: &Value) -> u64 {
        self.cost_pointer
            .as_deref()
            .and_then(|p| input.pointer(p))
            .and_then(Value::as_u64)
            .unwrap_or(1)
    }

    async fn run(
        &self,
        job: &JobContext,
        cancel: CancellationToken,
    ) -> Result<Value, HandlerError> {
        let scope = crate::callback::SCOPE.try_with(Arc::clone).ok();
        let answered = async {
            // The call is boxed: what it holds (the request, its answer) is let go of once
            // it is answered, before a wait for callbacks that may last hours.
            match (Box::pin(self.call(job, scope.as_deref())).await?, scope.as_deref()) {
                (Answer::Result(result), _) => Ok(result),
                (Answer::Accepted, Some(scope)) => {
                    let outcome =
                        crate::callback::wait(scope, job, self.callback_timeout, &cancel).await?;
                    self.completed(outcome)
                }
                (Answer::Accepted, None) => Err(HandlerError::permanent(format!(
                    "{} answered 202 Accepted, but this handler is not run by a processor that \
                     takes callbacks",
                    self.shown
                ))),
            }
        };
        tokio::select! {
            // Dropping the call closes its connection: the remote side sees the abort.
            _ = cancel.cancelled() => Err(HandlerError::retryable("cancelled: the lease was lost or the processor is stopping").ambiguous()),
            result = answered => result,
        }
    }
}

/// `Retry-After` as a delay: seconds, or an HTTP date. Any value is taken (a number too large
/// for a `u64` as the largest): the processor cuts it to the kind's `max_retry_after`.
pub fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let value = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX)));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    (at.with_timezone(&chrono::Utc) - chrono::Utc::now()).to_std().ok()
}

/// An error with its causes ("error sending request: connection refused").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(reqwest::header::RETRY_AFTER, "7".parse().unwrap());
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(7)));
        let later = (chrono::Utc::now() + chrono::Duration::seconds(90)).to_rfc2822();
        headers.insert(reqwest::header::RETRY_AFTER, later.parse().unwrap());
        let delay = retry_after(&headers).unwrap();
        assert!(delay > Duration::from_secs(80) && delay <= Duration::from_secs(90), "{delay:?}");
        headers.insert(reqwest::header::RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(retry_after(&headers), None);
        headers.insert(reqwest::header::RETRY_AFTER, "99999999999999999999999".parse().unwrap());
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(u64::MAX)));
    }

    #[test]
    fn a_redirect_is_permanent_and_a_503_with_retry_after_snoozes() {
        let url: reqwest::Url = "http://127.0.0.1:1/run".parse().unwrap();
        let snooze = failure(
            &url,
            reqwest::StatusCode::SERVICE_UNAVAILABLE,
            Some(Duration::from_secs(3)),
            "",
        );
        assert!(snooze.snoozed && !snooze.throttled, "{snooze:?}");
        assert_eq!(snooze.retry_after, Some(Duration::from_secs(3)));
        let plain = failure(&url, reqwest::StatusCode::SERVICE_UNAVAILABLE, None, "");
        assert!(!plain.snoozed && plain.class == crate::handler::ErrorClass::Retryable);
        let moved = failure(&url, reqwest::StatusCode::FOUND, None, "");
        assert_eq!(moved.class, crate::handler::ErrorClass::Permanent);
    }
}
