//! Bad jobs the campaign mixes into its workload, at random times, to show each costs only
//! itself: what each one is, the path it takes in, and how it must end.
//!
//! Each bad job has a document of its own (`bad-<kind>-<n>`, or `hot-<n>` for the busy
//! document), so the checker finds it, and the well-behaved jobs are the rest.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jobfold_common::accept::{AcceptError, Acceptor, NewJob};
use jobfold_schemas::{Codec, JobRequest};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};
use uuid::Uuid;

/// What a bad job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BadKind {
    /// A result larger than `processor.max_output_bytes`.
    OversizedResult,
    /// An input holding U+0000, over HTTP, the Rust API and the intake topic.
    NulHttp,
    NulApi,
    NulIntake,
    /// An intake message that is no Confluent frame at all.
    MalformedFrame,
    /// An intake frame naming a schema id the registry does not have.
    UnknownSchema,
    /// A handler that panics on every attempt.
    Panics,
    /// A handler that runs past the kind's `run_timeout`, watching its token.
    Hangs,
    /// The same, deaf to its token.
    IgnoresCancel,
    /// Errors of every class: retryable every time, permanent, invalid input.
    RetryableForever,
    Permanent,
    InvalidInput,
    /// A kind no processor registered, over each path.
    UnknownKindHttp,
    UnknownKindApi,
    UnknownKindIntake,
    /// One document with hundreds of versions accepted at once.
    HotDocument,
    /// A slow job an operator cancels while it runs.
    CancelledRunning,
    /// A job scheduled a few seconds ahead.
    Scheduled,
    /// An HTTP handler answering `429` with `Retry-After: 99999999999` (3,000 years), once.
    ThrottledForAges,
    /// A Rust handler asking for a wait of 3,000 years after its first attempt.
    RetryAfterForAges,
    /// An HTTP handler answering `503` with `Retry-After: 1` more times than the job has
    /// attempts.
    Snoozes,
    /// An HTTP handler answering `302` to another URL.
    Redirects,
    /// A handler whose business write (`commit`) panics.
    CommitPanics,
    /// A handler whose `cost` panics on this input.
    CostPanics,
    /// A handler that aborts its whole process on this input.
    Aborts,
    /// An HTTP handler that never answers.
    NeverAnswers,
    /// A job whose event the broker refuses: the events topic's limit lowered under the
    /// running relays (a fault of the campaign's, not drawn), raised again after it was
    /// parked and retried as an operator would.
    RefusedByBroker,
}

impl BadKind {
    /// Every kind the producer draws from (the hot document comes once, on its own).
    pub const DRAWN: [BadKind; 25] = [
        Self::OversizedResult,
        Self::NulHttp,
        Self::NulApi,
        Self::NulIntake,
        Self::MalformedFrame,
        Self::UnknownSchema,
        Self::Panics,
        Self::Hangs,
        Self::IgnoresCancel,
        Self::RetryableForever,
        Self::Permanent,
        Self::InvalidInput,
        Self::UnknownKindHttp,
        Self::UnknownKindApi,
        Self::UnknownKindIntake,
        Self::CancelledRunning,
        Self::Scheduled,
        Self::ThrottledForAges,
        Self::RetryAfterForAges,
        Self::Snoozes,
        Self::Redirects,
        Self::CommitPanics,
        Self::CostPanics,
        Self::Aborts,
        Self::NeverAnswers,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::OversizedResult => "result over max_output_bytes",
            Self::NulHttp => "U+0000 in the input, HTTP",
            Self::NulApi => "U+0000 in the input, Rust API",
            Self::NulIntake => "U+0000 in the input, intake",
            Self::MalformedFrame => "malformed intake frame",
            Self::UnknownSchema => "intake frame of an unknown schema id",
            Self::Panics => "handler panics",
            Self::Hangs => "handler hangs past run_timeout",
            Self::IgnoresCancel => "handler ignores cancellation",
            Self::RetryableForever => "retryable error every attempt",
            Self::Permanent => "permanent error",
            Self::InvalidInput => "invalid input",
            Self::UnknownKindHttp => "unregistered kind, HTTP",
            Self::UnknownKindApi => "unregistered kind, Rust API",
            Self::UnknownKindIntake => "unregistered kind, intake",
            Self::HotDocument => "one document, hundreds of versions at once",
            Self::CancelledRunning => "cancelled by an operator while it runs",
            Self::Scheduled => "scheduled a few seconds ahead",
            Self::ThrottledForAges => "429 with Retry-After of 3,000 years, HTTP",
            Self::RetryAfterForAges => "Retry-After of 3,000 years, Rust API",
            Self::Snoozes => "503 with Retry-After, more than its attempts",
            Self::Redirects => "HTTP handler redirects elsewhere",
            Self::CommitPanics => "handler's commit panics",
            Self::CostPanics => "handler's cost panics",
            Self::Aborts => "handler aborts its process",
            Self::NeverAnswers => "HTTP handler never answers",
            Self::RefusedByBroker => "event the broker refused, limit lowered while running",
        }
    }
}

/// How a bad job must end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Refused at accept: no job exists for its document.
    Refused,
    /// Set aside by the intake in `dead_letters` (keyed by its document); no job.
    DeadLettered,
    /// Quarantined, its reason containing this text.
    Quarantined(&'static str),
    /// Every one of its `versions` versions ended and the newest is indexed (a version whose
    /// attempts the faults spent, quarantined, ended as a well-behaved job would).
    AllEnded { versions: i64 },
    /// Replayed by an operator with a valid input: succeeded at `version`.
    Replayed { version: i64 },
    /// Cancelled while it ran (answered 200): `cancelled`, nothing committed for it.
    Cancelled,
    /// A cancel whose answer never came: cancelled with nothing committed, or ended as if
    /// no cancel had been sent.
    CancelUnanswered,
    /// The cancel came too late (answered 409): the job ended otherwise, not cancelled.
    EndedBeforeCancel,
    /// Succeeded, and no lease of it began before this time.
    RanAt(chrono::DateTime<chrono::Utc>),
    /// Succeeded (a wait it asked for was cut to `max_retry_after`, or its snoozes spent no
    /// attempt).
    Succeeded,
}

/// One bad job, as submitted.
#[derive(Debug, Clone)]
pub struct Bad {
    pub kind: BadKind,
    pub document: String,
    pub job_id: Option<Uuid>,
    pub expect: Expect,
    pub submitted_at: chrono::DateTime<chrono::Utc>,
}

/// Every bad job of a run.
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    pub bad: Vec<Bad>,
    /// Operator replays issued (of quarantined permanent failures, with a valid input).
    pub replays: u64,
    /// Bad jobs that got only "try again later" for [`GIVE_UP_AFTER`]: what should be the
    /// request's own fault, taken for an outage.
    pub unanswered: Vec<String>,
    /// Calls [`RemoteBad`]'s `/elsewhere` got: redirects followed.
    pub redirects_followed: u64,
}

/// How long a bad job is submitted again while the answer is an outage (a 5xx, a database
/// error): far longer than a Postgres restart.
pub const GIVE_UP_AFTER: Duration = Duration::from_secs(60);

/// A document belongs to a bad job.
pub fn is_bad_document(document: &str) -> bool {
    document.starts_with("bad-") || document.starts_with("hot-")
}

/// What the bad producer needs.
pub struct Producer {
    pub seed: u64,
    /// Bad jobs a second, on average.
    pub rate: f64,
    pub hot_versions: usize,
    pub pool: sqlx::PgPool,
    pub acceptor: Acceptor,
    pub requests: Codec<JobRequest>,
    pub kafka: FutureProducer,
    pub requests_topic: String,
    /// HTTP ports of the processors running now.
    pub ports: Arc<Mutex<Vec<u16>>>,
    pub ledger: Arc<Mutex<Ledger>>,
    /// Set when the busy document is to come (in the campaign's quiet stretch).
    pub hot: Arc<AtomicBool>,
    pub stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("seed", &self.seed)
            .field("rate", &self.rate)
            .field("hot_versions", &self.hot_versions)
            .finish_non_exhaustive()
    }
}

const SIMULATED: &str = "index-document";

/// The kind the campaign runs over HTTP, answered by [`RemoteBad`].
pub const REMOTE: &str = "remote-bad";

/// How many `503`s a [`BadKind::Snoozes`] job gets: more than its attempts (5), so that only
/// snoozes that spend none let it succeed.
const BUSY_ANSWERS: u32 = 6;

/// The HTTP handler of [`REMOTE`], in the campaign's own process (which no fault strikes):
/// by the input's `"answer"` it throttles the kind with a `Retry-After` of 3,000 years once,
/// answers `503` with `Retry-After: 1` [`BUSY_ANSWERS`] times, redirects to `/elsewhere`, or
/// never answers; else it answers `200`. `/elsewhere` counts each call it gets: any is a
/// redirect followed.
#[derive(Debug, Clone)]
pub struct RemoteBad {
    pub url: String,
    calls: Arc<Mutex<std::collections::HashMap<String, u32>>>,
    pub followed: Arc<std::sync::atomic::AtomicU64>,
}

impl RemoteBad {
    /// Serves on a free port of 127.0.0.1 until the process ends.
    ///
    /// # Errors
    /// No port could be bound.
    pub async fn start() -> anyhow::Result<Self> {
        use axum::http::{StatusCode, header};
        use axum::response::IntoResponse;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let this = Self { url: url.clone(), calls: Arc::default(), followed: Arc::default() };
        let calls = Arc::clone(&this.calls);
        let followed = Arc::clone(&this.followed);
        let elsewhere = format!("{url}/elsewhere");
        let answer = move |axum::Json(job): axum::Json<Value>| {
            let calls = Arc::clone(&calls);
            let elsewhere = elsewhere.clone();
            async move {
                let document = job["document_id"].as_str().unwrap_or_default().to_owned();
                let n = {
                    let mut calls = calls.lock().expect("calls");
                    let n = calls.entry(document).or_default();
                    *n += 1;
                    *n
                };
                match job["input"]["answer"].as_str() {
                    Some("throttle") if n == 1 => {
                        let header = [(header::RETRY_AFTER, "99999999999")];
                        (StatusCode::TOO_MANY_REQUESTS, header, "slow down").into_response()
                    }
                    Some("busy") if n <= BUSY_ANSWERS => {
                        let header = [(header::RETRY_AFTER, "1")];
                        (StatusCode::SERVICE_UNAVAILABLE, header, "busy").into_response()
                    }
                    Some("redirect") => {
                        (StatusCode::FOUND, [(header::LOCATION, elsewhere)]).into_response()
                    }
                    Some("silent") => std::future::pending().await,
                    _ => axum::Json(json!({ "answered": n })).into_response(),
                }
            }
        };
        let elsewhere = move || {
            let followed = Arc::clone(&followed);
            async move {
                followed.fetch_add(1, Ordering::SeqCst);
                axum::Json(json!({ "from": "elsewhere" }))
            }
        };
        let app = axum::Router::new()
            .route("/", axum::routing::post(answer))
            .route("/elsewhere", axum::routing::any(elsewhere));
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(this)
    }
}

impl Producer {
    /// Submits bad jobs at random times until `stop`; the hot document once, early.
    ///
    /// # Errors
    /// A frame could not be encoded.
    pub async fn run(self) -> anyhow::Result<()> {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 4);
        let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
        let mut n = 0u64;
        let mut hot_sent = false;
        let mut deck: Vec<BadKind> = Vec::new();
        if self.rate <= 0.0 {
            return Ok(());
        }
        while !self.stop.load(Ordering::SeqCst) {
            let wait = Duration::from_secs_f64(rng.random_range(0.2..1.8) / self.rate);
            let until = std::time::Instant::now() + wait;
            while !self.stop.load(Ordering::SeqCst) && std::time::Instant::now() < until {
                if !hot_sent && self.hot.load(Ordering::SeqCst) {
                    hot_sent = true;
                    n += 1;
                    self.hot_document(n).await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            n += 1;
            // Now and then an operator replays a quarantined permanent failure, fixed.
            if rng.random_bool(0.1) && self.replay_one(&client).await {
                continue;
            }
            // Dealt from a shuffled deck, so a run of n×15 bad jobs has n of each kind.
            if deck.is_empty() {
                deck = BadKind::DRAWN.to_vec();
                deck.shuffle(&mut rng);
            }
            let kind = deck.pop().expect("dealt from a full deck");
            self.submit(kind, n, &client).await?;
        }
        Ok(())
    }

    /// Adds a bad job to the ledger; its index there.
    fn record(
        &self,
        kind: BadKind,
        document: String,
        job_id: Option<Uuid>,
        expect: Expect,
    ) -> usize {
        let bad = Bad { kind, document, job_id, expect, submitted_at: chrono::Utc::now() };
        let mut ledger = self.ledger.lock().expect("ledger");
        ledger.bad.push(bad);
        ledger.bad.len() - 1
    }

    /// Once the job runs, an operator cancels it over HTTP (retrying until a processor
    /// answers); the answer decides what the ledger expects of it.
    fn cancel_when_running(
        &self,
        index: usize,
        job_id: Uuid,
        client: reqwest::Client,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (pool, ports, ledger, stop) = (
            self.pool.clone(),
            Arc::clone(&self.ports),
            Arc::clone(&self.ledger),
            Arc::clone(&self.stop),
        );
        async move {
            let since = std::time::Instant::now();
            // Until it runs (a fault may delay it), or it ended.
            while !stop.load(Ordering::SeqCst) && since.elapsed() < GIVE_UP_AFTER {
                let state: Option<String> =
                    sqlx::query_scalar("SELECT state::text FROM jobs WHERE job_id = $1")
                        .bind(job_id)
                        .fetch_optional(&pool)
                        .await
                        .ok()
                        .flatten();
                if matches!(state.as_deref(), Some("leased" | "succeeded" | "quarantined")) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            while !stop.load(Ordering::SeqCst) && since.elapsed() < GIVE_UP_AFTER {
                let Some(port) = ports.lock().expect("ports").first().copied() else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                let answer = client
                    .post(format!("http://127.0.0.1:{port}/v1/jobs/{job_id}/cancel"))
                    .header("content-type", "application/json")
                    .body(json!({ "requested_by": "campaign operator" }).to_string())
                    .send()
                    .await;
                let expect = match answer.map(|a| a.status().as_u16()) {
                    Ok(200) => Expect::Cancelled,
                    Ok(409) => Expect::EndedBeforeCancel,
                    // No answer (a processor down, Postgres restarting): try again.
                    _ => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                ledger.lock().expect("ledger").bad[index].expect = expect;
                return;
            }
        }
    }

    async fn submit(&self, kind: BadKind, n: u64, client: &reqwest::Client) -> anyhow::Result<()> {
        let document = format!("bad-{kind:?}-{n}").to_lowercase();
        let text = json!(format!("bad job {n}"));
        let quarantined = |input: Value, why: &'static str| (input, Expect::Quarantined(why));
        let (input, expect) = match kind {
            BadKind::OversizedResult => quarantined(
                json!({ "text": text, "simulate": { "output_bytes": 100_000 } }),
                "max_output_bytes",
            ),
            BadKind::Panics => {
                quarantined(json!({ "text": text, "simulate": { "panic": true } }), "panicked")
            }
            BadKind::Hangs => quarantined(
                json!({ "text": text, "simulate": { "sleep_ms": 60_000 } }),
                "run_timeout",
            ),
            BadKind::IgnoresCancel => quarantined(
                json!({ "text": text, "simulate": { "hang_ms": 60_000 } }),
                "run_timeout",
            ),
            BadKind::RetryableForever => quarantined(
                json!({ "text": text, "simulate": { "fail_attempts": 99 } }),
                "attempt budget spent",
            ),
            BadKind::Permanent => quarantined(
                json!({ "text": text, "simulate": { "permanent": true } }),
                "permanent failure",
            ),
            BadKind::InvalidInput => quarantined(json!({ "title": text }), "invalid input"),
            BadKind::NulHttp | BadKind::NulApi | BadKind::NulIntake => {
                (json!({ "text": "before\u{0}after" }), Expect::Refused)
            }
            BadKind::UnknownKindHttp | BadKind::UnknownKindApi | BadKind::UnknownKindIntake => {
                (json!({ "text": text }), Expect::Refused)
            }
            BadKind::MalformedFrame | BadKind::UnknownSchema => (Value::Null, Expect::DeadLettered),
            // Well under the kind's run_timeout: without the cancel it succeeds.
            BadKind::CancelledRunning => (
                json!({ "text": text, "simulate": { "sleep_ms": 4_000 } }),
                Expect::CancelUnanswered,
            ),
            BadKind::Scheduled => (json!({ "text": text }), Expect::Refused),
            BadKind::ThrottledForAges => (json!({ "answer": "throttle" }), Expect::Succeeded),
            BadKind::RetryAfterForAges => (
                json!({ "text": text,
                        "simulate": { "fail_attempts": 1, "retry_after_secs": 99_999_999_999u64 } }),
                Expect::Succeeded,
            ),
            BadKind::Snoozes => (json!({ "answer": "busy" }), Expect::Succeeded),
            BadKind::Redirects => {
                quarantined(json!({ "answer": "redirect" }), "redirects are not followed")
            }
            BadKind::CommitPanics => quarantined(
                json!({ "text": text, "simulate": { "commit_panic": true } }),
                "commit panicked",
            ),
            BadKind::CostPanics => quarantined(
                json!({ "text": text, "simulate": { "cost_panic": true } }),
                "cost panicked",
            ),
            BadKind::Aborts => quarantined(
                json!({ "text": text, "simulate": { "abort": true } }),
                "killed its processor",
            ),
            BadKind::NeverAnswers => quarantined(json!({ "answer": "silent" }), "timed out"),
            BadKind::HotDocument => unreachable!("sent by hot_document"),
            BadKind::RefusedByBroker => {
                unreachable!("submitted by the fault that lowers the limit")
            }
        };
        let job_kind = match kind {
            BadKind::UnknownKindHttp | BadKind::UnknownKindApi | BadKind::UnknownKindIntake => {
                "no-such-kind"
            }
            BadKind::ThrottledForAges
            | BadKind::Snoozes
            | BadKind::Redirects
            | BadKind::NeverAnswers => REMOTE,
            _ => SIMULATED,
        };
        match kind {
            BadKind::NulHttp | BadKind::UnknownKindHttp => {
                let body = json!({ "document_id": document, "kind": job_kind,
                                   "input_version": 1, "input": input });
                // Recorded whatever the answer: a job made of it is a finding.
                if self.http_answered(client, &document, &body.to_string()).await {
                    self.record(kind, document, None, Expect::Refused);
                }
            }
            BadKind::NulIntake | BadKind::UnknownKindIntake => {
                let request = JobRequest {
                    request_id: Uuid::now_v7(),
                    document_id: document.clone(),
                    job_kind: job_kind.into(),
                    input_version: 1,
                    input: input.to_string(),
                    requested_at: chrono::Utc::now(),
                    producer: "campaign-bad".into(),
                    trace: None,
                    run_at: None,
                };
                let frame = self.requests.encode(&request)?;
                if self.send_raw(&document, &frame).await {
                    self.record(kind, document, None, Expect::DeadLettered);
                }
            }
            BadKind::MalformedFrame => {
                if self.send_raw(&document, b"this is not a Confluent frame").await {
                    self.record(kind, document, None, expect);
                }
            }
            BadKind::UnknownSchema => {
                // Magic byte 0, schema id 999999, then bytes of no schema.
                let mut frame = vec![0u8];
                frame.extend_from_slice(&999_999u32.to_be_bytes());
                frame.extend_from_slice(b"\x02\x04junk");
                if self.send_raw(&document, &frame).await {
                    self.record(kind, document, None, expect);
                }
            }
            _ => {
                let run_at = (kind == BadKind::Scheduled).then(|| {
                    let at = chrono::Utc::now() + chrono::Duration::seconds(5);
                    chrono::DateTime::from_timestamp_millis(at.timestamp_millis()).unwrap_or(at)
                });
                let job = NewJob {
                    document_id: document.clone(),
                    kind: job_kind.into(),
                    input_version: 1,
                    input,
                    idempotency_key: Some(format!("bad-{n}")),
                    trace: None,
                    run_at,
                };
                let expect = run_at.map_or(expect, Expect::RanAt);
                if let Some(job_id) = self.accept(&job).await {
                    let index = self.record(kind, document, job_id, expect);
                    if let (BadKind::CancelledRunning, Some(job_id)) = (kind, job_id) {
                        tokio::spawn(self.cancel_when_running(index, job_id, client.clone()));
                    }
                }
            }
        }
        Ok(())
    }

    /// Accepts through the Rust API, retrying what may heal; `Some(None)` if refused as it
    /// must be, `None` if it never got an answer before the stop.
    async fn accept(&self, job: &NewJob) -> Option<Option<Uuid>> {
        let since = std::time::Instant::now();
        loop {
            match self.acceptor.accept(&self.pool, job).await {
                Ok(accepted) => return Some(Some(accepted.job_id)),
                Err(
                    AcceptError::Invalid { .. }
                    | AcceptError::TooLarge { .. }
                    | AcceptError::Unstorable { .. }
                    | AcceptError::UnknownKind { .. },
                ) => return Some(None),
                Err(_) if self.stop.load(Ordering::SeqCst) => return None,
                Err(e) if since.elapsed() > GIVE_UP_AFTER => {
                    self.unanswered(&job.document_id, &format!("accept: {e}"));
                    return None;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    fn unanswered(&self, document: &str, last: &str) {
        let text = format!(
            "bad job {document} got only \"try again\" for {} s, last: {last}",
            GIVE_UP_AFTER.as_secs()
        );
        self.ledger.lock().expect("ledger").unanswered.push(text);
    }

    /// Posts `body` until a processor answers (anything but a 5xx); false if stopped first,
    /// or answered only 5xx for [`GIVE_UP_AFTER`] (recorded).
    async fn http_answered(&self, client: &reqwest::Client, document: &str, body: &str) -> bool {
        let since = std::time::Instant::now();
        let mut last = String::from("no processor listening");
        while !self.stop.load(Ordering::SeqCst) {
            let port = self.ports.lock().expect("ports").first().copied();
            if let Some(port) = port {
                match client
                    .post(format!("http://127.0.0.1:{port}/v1/jobs"))
                    .header("content-type", "application/json")
                    .body(body.to_owned())
                    .send()
                    .await
                {
                    Ok(answer) if !answer.status().is_server_error() => return true,
                    // A refused connection is a processor down, not an answer.
                    Ok(answer) => {
                        last = format!(
                            "{} {}",
                            answer.status(),
                            answer.text().await.unwrap_or_default()
                        )
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            if since.elapsed() > GIVE_UP_AFTER {
                self.unanswered(document, &last);
                return false;
            }
            self.ports.lock().expect("ports").rotate_left(1);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    }

    /// Produces `frame` to the requests topic until the broker acknowledges it.
    async fn send_raw(&self, key: &str, frame: &[u8]) -> bool {
        while !self.stop.load(Ordering::SeqCst) {
            let record = FutureRecord::to(&self.requests_topic).key(key).payload(frame);
            if self.kafka.send(record, Duration::from_secs(5)).await.is_ok() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    }

    /// The busy document: `hot_versions` versions of one document in one transaction.
    async fn hot_document(&self, n: u64) {
        let document = format!("hot-{n}");
        let jobs: Vec<NewJob> = (1..=self.hot_versions as i64)
            .map(|v| NewJob {
                document_id: document.clone(),
                kind: SIMULATED.into(),
                input_version: v,
                input: json!({ "text": format!("hot version {v}"), "simulate": { "sleep_ms": 150 } }),
                idempotency_key: Some(format!("hot-{n}-{v}")),
                trace: None,
                run_at: None,
            })
            .collect();
        loop {
            match self.acceptor.accept_batch(&self.pool, &jobs).await {
                Ok(_) => break,
                Err(_) if self.stop.load(Ordering::SeqCst) => return,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        let expect = Expect::AllEnded { versions: self.hot_versions as i64 };
        self.record(BadKind::HotDocument, document, None, expect);
    }

    /// Replays one quarantined permanent failure with a valid input and a new version, as an
    /// operator would; true if one was replayed.
    async fn replay_one(&self, client: &reqwest::Client) -> bool {
        let candidates: Vec<(usize, Uuid)> = {
            let ledger = self.ledger.lock().expect("ledger");
            ledger
                .bad
                .iter()
                .enumerate()
                .filter(|(_, b)| b.expect == Expect::Quarantined("permanent failure"))
                .filter_map(|(i, b)| Some((i, b.job_id?)))
                .collect()
        };
        for (i, job_id) in candidates {
            let state: Option<String> =
                sqlx::query_scalar("SELECT state::text FROM jobs WHERE job_id = $1")
                    .bind(job_id)
                    .fetch_optional(&self.pool)
                    .await
                    .ok()
                    .flatten();
            if state.as_deref() != Some("quarantined") {
                continue;
            }
            let Some(port) = self.ports.lock().expect("ports").first().copied() else {
                return false;
            };
            let body = json!({ "new_input_version": 2, "new_input": { "text": "fixed by an operator" },
                               "requested_by": "campaign operator" });
            let answer = client
                .post(format!("http://127.0.0.1:{port}/v1/jobs/{job_id}/replay"))
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await;
            // Only an answer counts: a replay lost with its connection may or may not have
            // committed, and the checker then accepts either end.
            if answer.is_ok_and(|a| a.status().is_success()) {
                let mut ledger = self.ledger.lock().expect("ledger");
                ledger.bad[i].expect = Expect::Replayed { version: 2 };
                ledger.replays += 1;
                return true;
            }
            return false;
        }
        false
    }
}
