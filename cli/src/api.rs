//! `--api URL`: the command line's changes made through a processor's HTTP API instead of
//! Postgres — the API's token, roles, audit trail and rules apply, and the operator needs
//! no database credentials. A command with no API form says so and exits 2.

use anyhow::Context;
use jobfold_processor::store::kinds::{KindChanged, KindControl};
use jobfold_processor::store::{BulkCancelled, BulkReplayed, Cancel, Replay, Waited};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::{Command, DeadLetterCommand, KindCommand, QuarantineCommand, report};

/// Longest answer body read from the API (a job's status with its error texts is far less).
const ANSWER_MAX: usize = 4 << 20;
/// How long one call may take, connecting included.
const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// A processor's API, and the token to call it with.
#[derive(Debug)]
pub(crate) struct Api {
    base: reqwest::Url,
    token: Option<String>,
    http: reqwest::Client,
}

/// A usage error (`--api` with a command that has no API form, or a bad URL): the command
/// exits 2, as for a bad setting.
#[derive(Debug)]
pub(crate) struct Usage(pub(crate) String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// `jobfold <command>` has no API form.
fn no_api_form(command: &str) -> anyhow::Error {
    Usage(format!(
        "--api: `jobfold {command}` has no API form (it works on Postgres or Kafka directly); \
         run it without --api and JOBFOLD_API"
    ))
    .into()
}

impl Api {
    /// The API at `url` (`http://host:port`, or https).
    ///
    /// # Errors
    /// [`Usage`]: `url` is not an http(s) URL.
    pub(crate) fn new(url: &str, token: Option<String>) -> anyhow::Result<Self> {
        let base = reqwest::Url::parse(url.trim_end_matches('/'))
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
            .ok_or_else(|| Usage(format!("--api: {url:?} is not an http:// or https:// URL")))?;
        let http = reqwest::Client::builder()
            .timeout(CALL_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Self { base, token: token.filter(|t| !t.is_empty()), http })
    }

    /// The API's URL of the path of `segments`, each one escaped (a `/` in a kind's name
    /// stays in its segment).
    fn url(&self, segments: &[&str]) -> anyhow::Result<reqwest::Url> {
        let mut url = self.base.clone();
        url.path_segments_mut()
            .map_err(|()| anyhow::anyhow!("--api: {} cannot take a path", self.base))?
            .pop_if_empty()
            .extend(segments);
        Ok(url)
    }

    /// Calls `method` on the path of `segments` (each one escaped) with `body` (JSON) and
    /// decodes the answer; a refusal is an error with the API's status, code and message.
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        segments: &[&str],
        body: Option<serde_json::Value>,
        key: Option<&str>,
    ) -> anyhow::Result<T> {
        let url = self.url(segments)?;
        let path = url.path().to_owned();
        let mut request = self.http.request(method.clone(), url.clone());
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let mut answer = request.send().await.with_context(|| format!("calling {method} {url}"))?;
        let status = answer.status();
        let mut bytes = Vec::new();
        while let Some(chunk) = answer.chunk().await.with_context(|| format!("reading {url}"))? {
            anyhow::ensure!(
                bytes.len() + chunk.len() <= ANSWER_MAX,
                "{method} {url}: the answer is over {ANSWER_MAX} bytes"
            );
            bytes.extend_from_slice(&chunk);
        }
        if !status.is_success() {
            anyhow::bail!("{method} {path}: {}", refusal(status, &bytes));
        }
        let bytes = if bytes.is_empty() { b"null".to_vec() } else { bytes };
        serde_json::from_slice(&bytes).with_context(|| format!("{method} {path}: an odd answer"))
    }
}

/// What the API said when it refused: `401 unauthorized: a token is required`.
fn refusal(status: StatusCode, body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Refused {
        error: Error,
    }
    #[derive(Deserialize)]
    struct Error {
        code: String,
        message: String,
    }
    match serde_json::from_slice::<Refused>(body) {
        Ok(Refused { error }) => format!("{status} {}: {}", error.code, error.message),
        Err(_) => {
            let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
            format!("{status}: {}", text.trim())
        }
    }
}

/// What an answer about one job says of it.
#[derive(Debug, Deserialize)]
struct JobAnswer {
    job_id: uuid::Uuid,
    #[serde(default)]
    created: Option<bool>,
    #[serde(default)]
    was: Option<String>,
    #[serde(default)]
    waited: Option<Waited>,
    #[serde(default)]
    input_version: Option<i64>,
}

/// Runs `command` through `api`.
///
/// # Errors
/// The API refused or could not be reached; [`Usage`] for a command without an API form.
pub(crate) async fn run(api: &Api, command: Command) -> anyhow::Result<()> {
    match command {
        Command::Submit { document, kind, input_version, input, key, run_at, delay } => {
            let input: serde_json::Value =
                serde_json::from_str(&input).context("--input is not JSON")?;
            let delay = delay.map(|d| humantime::format_duration(d).to_string());
            let body = serde_json::json!({
                "document_id": document, "kind": kind, "input_version": input_version,
                "input": input, "run_at": run_at, "delay": delay,
            });
            let answer: JobAnswer =
                api.call(Method::POST, &["v1", "jobs"], Some(body), key.as_deref()).await?;
            report::submitted(answer.job_id, answer.created.unwrap_or(true));
        }
        Command::Status { job_id, .. } => {
            let id = job_id.to_string();
            let job: serde_json::Value =
                api.call(Method::GET, &["v1", "jobs", &id], None, None).await?;
            println!("{}", serde_json::to_string_pretty(&job)?);
        }
        Command::Cancel { job_id: Some(job_id), reason, by, .. } => {
            let id = job_id.to_string();
            let request = Cancel { requested_by: Some(by), reason };
            let body = serde_json::to_value(request)?;
            let answer: JobAnswer =
                api.call(Method::POST, &["v1", "jobs", &id, "cancel"], Some(body), None).await?;
            report::cancelled(job_id, answer.was.as_deref().unwrap_or("open"));
        }
        command @ Command::Cancel { job_id: None, .. } => {
            let request = command.into_bulk_cancel().expect("a cancel by filter");
            let body = serde_json::to_value(request)?;
            let done: BulkCancelled =
                api.call(Method::POST, &["v1", "jobs", "cancel"], Some(body), None).await?;
            report::bulk_cancelled(&done);
        }
        Command::RunNow { job_id } => {
            let id = job_id.to_string();
            let answer: JobAnswer =
                api.call(Method::POST, &["v1", "jobs", &id, "run-now"], None, None).await?;
            report::ran_now(job_id, answer.waited.unwrap_or(Waited::Due));
        }
        Command::Quarantine { command } => quarantine(api, command).await?,
        Command::Kinds { command } => kinds(api, command).await?,
        Command::DeadLetters { command } => dead_letters(api, command).await?,
        other => return Err(no_api_form(other.name())),
    }
    Ok(())
}

async fn quarantine(api: &Api, command: QuarantineCommand) -> anyhow::Result<()> {
    match command {
        QuarantineCommand::Replay {
            job_id: Some(job_id), new_input_version, input, by, ..
        } => {
            let new_input = input
                .map(|i| serde_json::from_str(&i))
                .transpose()
                .context("--input is not JSON")?;
            let (id, request) = (
                job_id.to_string(),
                Replay { requested_by: Some(by), new_input_version, new_input },
            );
            let body = serde_json::to_value(request)?;
            let answer: JobAnswer =
                api.call(Method::POST, &["v1", "jobs", &id, "replay"], Some(body), None).await?;
            report::replayed(job_id, answer.input_version.unwrap_or_default());
        }
        command @ QuarantineCommand::Replay { job_id: None, .. } => {
            let request = command.into_bulk_replay().expect("a replay by filter");
            let body = serde_json::to_value(request)?;
            let done: BulkReplayed =
                api.call(Method::POST, &["v1", "quarantine", "replay"], Some(body), None).await?;
            report::bulk_replayed(&done);
        }
        QuarantineCommand::List { .. } => return Err(no_api_form("quarantine list")),
    }
    Ok(())
}

async fn kinds(api: &Api, command: KindCommand) -> anyhow::Result<()> {
    let (kind, pause, request) = match command {
        KindCommand::Pause { kind, reason, by } => {
            (kind, true, KindControl { requested_by: Some(by), reason })
        }
        KindCommand::Resume { kind, reason, by } => {
            (kind, false, KindControl { requested_by: Some(by), reason })
        }
        KindCommand::List { .. } => return Err(no_api_form("kinds list")),
    };
    let path = ["v1", "kinds", &kind, if pause { "pause" } else { "resume" }];
    let changed: KindChanged =
        api.call(Method::POST, &path, Some(serde_json::to_value(request)?), None).await?;
    report::kind_changed(&kind, &changed, pause);
    Ok(())
}

async fn dead_letters(api: &Api, command: DeadLetterCommand) -> anyhow::Result<()> {
    match command {
        DeadLetterCommand::Reinject { id } => {
            let path = ["v1", "dead-letters", &id.to_string(), "reinject"];
            let sent: jobfold_processor::dead_letter::Reinjected =
                api.call(Method::POST, &path, None, None).await?;
            report::reinjected(id, &sent);
        }
        DeadLetterCommand::Delete { id } => {
            let path = ["v1", "dead-letters", &id.to_string()];
            let _: serde_json::Value = api.call(Method::DELETE, &path, None, None).await?;
            report::dead_letter_deleted(id);
        }
        DeadLetterCommand::List { .. } => return Err(no_api_form("dead-letters list")),
        DeadLetterCommand::Show { .. } => return Err(no_api_form("dead-letters show")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_http_urls_with_a_host_are_taken() {
        for bad in ["localhost:8080", "ftp://host/", "http://", "not a url"] {
            let e = Api::new(bad, None).unwrap_err().to_string();
            assert!(e.starts_with("--api: "), "{bad}: {e}");
        }
        assert!(Api::new("http://127.0.0.1:8080/", Some("t".into())).is_ok());
    }

    #[test]
    fn a_refusal_reads_as_the_api_said_it() {
        let body = br#"{"error":{"code":"unauthorized","message":"a token is required"}}"#;
        assert_eq!(
            refusal(StatusCode::UNAUTHORIZED, body),
            "401 Unauthorized unauthorized: a token is required"
        );
        assert_eq!(refusal(StatusCode::BAD_GATEWAY, b"<html>"), "502 Bad Gateway: <html>");
    }

    #[test]
    fn each_segment_is_escaped_into_one() {
        for base in ["http://127.0.0.1:1/base/", "http://127.0.0.1:1/base"] {
            let url = Api::new(base, None).unwrap().url(&["v1", "kinds", "a/b c"]).unwrap();
            assert_eq!(url.as_str(), "http://127.0.0.1:1/base/v1/kinds/a%2Fb%20c", "{base}");
        }
        let url = Api::new("http://127.0.0.1:1", None).unwrap().url(&["v1", "jobs"]).unwrap();
        assert_eq!(url.as_str(), "http://127.0.0.1:1/v1/jobs");
    }
}
