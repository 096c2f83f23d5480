//! The boundary to user code, against real Postgres, Kafka and the registry: nothing a
//! handler says or does costs more than its own job.
//!
//! - remote handlers (the shipped processor, a server on 127.0.0.1 as the handlers): a
//!   `Retry-After` of 99999999999 s pauses its kind no longer than `max_retry_after`; a 503
//!   with `Retry-After` snoozes its job without spending an attempt; a 302 or 307 is a
//!   permanent failure naming the `Location`, whose URL is never called; a call that never
//!   answers ends at the kind's `request_timeout`; other kinds' jobs run meanwhile;
//! - Rust handlers: a panic in `commit` or in `cost` is that job's failure, naming it; a
//!   `retry_after` of 3,000 years waits `max_retry_after`; snoozes stop at `max_snoozes`;
//! - a handler's panics are counted and logged without a backtrace, jobfold's own keep it;
//! - a background task that dies stops the processor (exit non-zero), not just itself;
//! - a job that aborts its process is counted as an attempt and a crash each time, and is
//!   quarantined at `max_crashes`, saying so, while the other documents' jobs flow.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_processor::handler::{Committed, Handler, HandlerError, JobContext};
use jobfold_tests::harness::{
    Installation, Pipeline, Service, eventually, fold_mismatches, index_job, metric_value,
};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Calls each route of the stand-in handlers got.
type Calls = Arc<Mutex<HashMap<&'static str, usize>>>;

fn called(calls: &Calls, route: &'static str) -> usize {
    let mut calls = calls.lock().unwrap();
    let n = calls.entry(route).or_default();
    *n += 1;
    *n
}

/// The remote handlers, on 127.0.0.1: `/huge` answers its first call 429 with a
/// `Retry-After` of 99999999999 s, `/snooze` its first two 503 with `Retry-After: 1`,
/// `/found` and `/temporary` 302 and 307 to `/elsewhere`, `/hangs` never; every other answer
/// (and `/plain`, and `/elsewhere`) is 200 with JSON.
async fn handlers() -> (String, Calls) {
    let calls = Calls::default();
    let ok = |route: &'static str| json!({ "from": route });
    let app = axum::Router::new()
        .route(
            "/huge",
            axum::routing::post({
                let calls = Arc::clone(&calls);
                move || async move {
                    if called(&calls, "huge") == 1 {
                        let header = [("retry-after", "99999999999")];
                        return (StatusCode::TOO_MANY_REQUESTS, header, "later").into_response();
                    }
                    axum::Json(ok("huge")).into_response()
                }
            }),
        )
        .route(
            "/snooze",
            axum::routing::post({
                let calls = Arc::clone(&calls);
                move || async move {
                    if called(&calls, "snooze") <= 2 {
                        let header = [("retry-after", "1")];
                        return (StatusCode::SERVICE_UNAVAILABLE, header, "warming up")
                            .into_response();
                    }
                    axum::Json(ok("snooze")).into_response()
                }
            }),
        )
        .route(
            "/found",
            axum::routing::post(|| async { (StatusCode::FOUND, [("location", "/elsewhere")]) }),
        )
        .route(
            "/temporary",
            axum::routing::post(|| async {
                (StatusCode::TEMPORARY_REDIRECT, [("location", "/elsewhere")])
            }),
        )
        .route(
            "/elsewhere",
            axum::routing::any({
                let calls = Arc::clone(&calls);
                move || async move {
                    called(&calls, "elsewhere");
                    axum::Json(ok("elsewhere"))
                }
            }),
        )
        .route(
            "/hangs",
            axum::routing::post({
                let calls = Arc::clone(&calls);
                move || async move {
                    called(&calls, "hangs");
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    axum::Json(ok("hangs"))
                }
            }),
        )
        .route(
            "/plain",
            axum::routing::post({
                let calls = Arc::clone(&calls);
                move || async move {
                    called(&calls, "plain");
                    axum::Json(ok("plain"))
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, calls)
}

fn job_of(kind: &str, document: &str, input: Value) -> NewJob {
    NewJob { kind: kind.into(), ..index_job(document, 1, input) }
}

async fn state_of(it: &Installation, kind: &str) -> Vec<(String, i32, Option<String>)> {
    sqlx::query_as(
        "SELECT state::text, attempt, last_error FROM jobs WHERE kind = $1 ORDER BY document_id",
    )
    .bind(kind)
    .fetch_all(&it.pool)
    .await
    .unwrap()
}

async fn ended(it: &Installation, kind: &str) -> bool {
    let states = state_of(it, kind).await;
    !states.is_empty()
        && states.iter().all(|(s, _, _)| ["succeeded", "quarantined"].contains(&s.as_str()))
}

async fn quarantine_reason(it: &Installation, kind: &str) -> String {
    sqlx::query_scalar(
        "SELECT q.reason FROM quarantine q JOIN jobs j USING (job_id) WHERE j.kind = $1",
    )
    .bind(kind)
    .fetch_one(&it.pool)
    .await
    .unwrap()
}

/// What remote handlers answer costs only their own job, and never waits past its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_a_remote_handler_answers_costs_only_its_own_job() {
    let mut it = Installation::new("boundary-remote").await;
    // The budgets are the acceptor's to give.
    for (kind, attempts) in [("snooze", 1), ("hangs", 2)] {
        let budget =
            jobfold_common::config::Kind { max_attempts: Some(attempts), ..Default::default() };
        it.config.kinds.insert(kind.into(), budget);
    }
    it.create_topics().await;
    let (url, calls) = handlers().await;
    let kinds = format!(
        r#"
[kinds.huge]
url = "{url}/huge"
max_retry_after = "2s"
[kinds.snooze]
url = "{url}/snooze"
max_attempts = 1
[kinds.found]
url = "{url}/found"
[kinds.temporary]
url = "{url}/temporary"
[kinds.hangs]
url = "{url}/hangs"
request_timeout = "1s"
max_attempts = 2
[kinds.plain]
url = "{url}/plain"
"#
    );
    let group = it.start_group("boundary", &kinds, 1).await;
    let processor = group.processor();
    let acceptor = it.acceptor().await;
    let mut jobs: Vec<NewJob> = ["huge", "snooze", "found", "temporary", "hangs"]
        .into_iter()
        .map(|kind| job_of(kind, &format!("doc-{kind}"), json!({})))
        .collect();
    jobs.extend((0..20).map(|n| job_of("plain", &format!("doc-plain-{n}"), json!({ "n": n }))));
    for job in &jobs {
        acceptor.accept(&it.pool, job).await.unwrap();
    }
    for kind in ["huge", "snooze", "found", "temporary", "hangs", "plain"] {
        eventually(Duration::from_secs(90), &format!("the {kind} jobs to end"), || {
            ended(&it, kind)
        })
        .await;
    }

    // The 429's Retry-After paused the kind for max_retry_after at most, here and in the
    // table the group shares, and the gauge says what the table does.
    assert_eq!(state_of(&it, "huge").await[0].0, "succeeded");
    let paused_for: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM paused_until - throttled_at)::float8 FROM kind_quotas \
         WHERE kind = 'huge'",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert!(paused_for <= 2.5, "paused for {paused_for} s, past max_retry_after (2 s)");
    let scraped = processor.scrape().await.unwrap();
    let gauge = metric_value(&scraped, "jobfold_quota_paused_seconds", &[("kind", "huge")]);
    assert!(gauge.is_some_and(|g| g <= 2.0), "{gauge:?}");

    // Snoozed twice without spending its only attempt, then done.
    let snooze = state_of(&it, "snooze").await;
    assert_eq!((snooze[0].0.as_str(), snooze[0].1), ("succeeded", 1), "{snooze:?}");
    let snoozes: i32 = sqlx::query_scalar(
        "SELECT snoozes FROM job_counters JOIN jobs USING (job_id) WHERE kind = 'snooze'",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(snoozes, 2);

    // A redirect is its job's permanent failure, naming where it pointed; that URL was never
    // called, so nothing of its answer is anyone's result.
    for kind in ["found", "temporary"] {
        assert_eq!(state_of(&it, kind).await[0].0, "quarantined");
        let reason = quarantine_reason(&it, kind).await;
        assert!(reason.contains("redirect") && reason.contains("/elsewhere"), "{reason}");
    }
    assert_eq!(calls.lock().unwrap().get("elsewhere"), None, "a redirect was followed");

    // The call that never answers ended at request_timeout, each attempt.
    let hangs = state_of(&it, "hangs").await;
    assert_eq!((hangs[0].0.as_str(), hangs[0].1), ("quarantined", 2), "{hangs:?}");
    assert_eq!(calls.lock().unwrap()["hangs"], 2);

    assert!(state_of(&it, "plain").await.iter().all(|(s, _, _)| s == "succeeded"));
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

/// `commit` panics for an input with `"commit_panic"`, `cost` for one with `"cost_panic"`;
/// otherwise it succeeds, writing nothing of its own.
#[derive(Debug, Clone, Copy)]
struct Fragile;

impl Handler for Fragile {
    async fn run(&self, job: &JobContext, _: CancellationToken) -> Result<Value, HandlerError> {
        Ok(json!({ "document": job.document_id }))
    }

    fn cost(&self, input: &Value) -> u64 {
        assert!(input.get("cost_panic").is_none(), "a cost that cannot be computed");
        1
    }

    async fn commit(
        &self,
        tx: &mut sqlx::PgConnection,
        job: &JobContext,
        _output: &Value,
    ) -> Result<Committed, sqlx::Error> {
        assert!(job.input.get("commit_panic").is_none(), "a business write that panics");
        let _ = tx;
        Ok(Committed::Applied)
    }
}

async fn accept_all(acceptor: &Acceptor, it: &Installation, jobs: &[NewJob]) {
    for job in jobs {
        acceptor.accept(&it.pool, job).await.unwrap();
    }
}

/// A panic in a handler's `commit` or `cost` is its job's failure, naming the panic: the
/// job ends by its budget, and every other job — of other documents meanwhile, of its own
/// document afterwards — runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panic_in_commit_or_cost_costs_only_its_job() {
    let mut it = Installation::new("boundary-panics").await;
    it.fast();
    let kind = jobfold_common::config::Kind {
        max_attempts: Some(2),
        cost_per_minute: Some(1_000_000.0),
        ..Default::default()
    };
    it.config.kinds.insert("fragile".into(), kind);
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let processor =
        jobfold_processor::Processor::builder(it.config.clone()).handler("fragile", Fragile);
    let pipeline = Pipeline::with_processor(&it, processor).await;
    let mut jobs = vec![
        job_of("fragile", "doc-commit", json!({ "commit_panic": true })),
        job_of("fragile", "doc-cost", json!({ "cost_panic": true })),
    ];
    jobs.extend((0..20).map(|n| job_of("fragile", &format!("doc-{n}"), json!({ "n": n }))));
    accept_all(&acceptor, &it, &jobs).await;
    eventually(Duration::from_secs(90), "every job to end", || ended(&it, "fragile")).await;
    let states = state_of(&it, "fragile").await;
    let quarantined: Vec<_> = states.iter().filter(|(s, _, _)| s == "quarantined").collect();
    assert_eq!(quarantined.len(), 2, "{states:?}");
    let reasons: Vec<String> = sqlx::query_scalar(
        "SELECT q.reason FROM quarantine q JOIN jobs j USING (job_id) ORDER BY j.document_id",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert!(reasons[0].contains("commit panicked: a business write that panics"), "{reasons:?}");
    assert!(reasons[1].contains("cost panicked: a cost that cannot be computed"), "{reasons:?}");
    assert!(reasons.iter().all(|r| r.contains("attempt budget spent (2 attempts)")), "{reasons:?}");

    // Their documents were not left behind: a next version of each runs.
    let next: Vec<NewJob> = ["doc-commit", "doc-cost"]
        .into_iter()
        .map(|d| NewJob { input_version: 2, ..job_of("fragile", d, json!({})) })
        .collect();
    accept_all(&acceptor, &it, &next).await;
    eventually(Duration::from_secs(60), "the next versions to succeed", || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE input_version = 2 AND state = 'succeeded'",
        )
        .fetch_one(&it.pool)
        .await
        .unwrap();
        n == 2
    })
    .await;
    pipeline.stop().await;
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

/// A Rust handler's waits are bounded as a remote one's are: a `retry_after` of 3,000 years
/// waits `max_retry_after`; a job snoozing for a moment is not charged an attempt, one that
/// snoozes on and on spends attempts past `max_snoozes` and ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rust_handlers_waits_are_bounded() {
    let mut it = Installation::new("boundary-waits").await;
    it.fast();
    let kind = jobfold_common::config::Kind {
        max_attempts: Some(2),
        max_retry_after: Some(Duration::from_secs(1)),
        max_snoozes: Some(3),
        ..Default::default()
    };
    it.config.kinds.insert(jobfold_tests::handlers::KIND.into(), kind);
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let processor = jobfold_processor::Processor::builder(it.config.clone())
        .handlers(jobfold_tests::handlers::handlers());
    let pipeline = Pipeline::with_processor(&it, processor).await;
    let now = chrono::Utc::now().timestamp_millis();
    let simulate = |doc: &str, simulate: Value| {
        index_job(doc, 1, json!({ "text": doc, "simulate": simulate }))
    };
    let jobs = [
        simulate("doc-later", json!({ "fail_attempts": 1, "retry_after_secs": 99_999_999_999u64 })),
        simulate("doc-moment", json!({ "snooze_until_ms": now + 300 })),
        simulate("doc-never", json!({ "snooze_until_ms": now + 3_600_000 })),
        simulate("doc-plain", json!({})),
    ];
    accept_all(&acceptor, &it, &jobs).await;
    let kind = jobfold_tests::handlers::KIND;
    eventually(Duration::from_secs(60), "every job to end", || ended(&it, kind)).await;
    pipeline.stop().await;
    let states = state_of(&it, kind).await;
    let by_doc: Vec<(&str, i32)> = states.iter().map(|(s, a, _)| (s.as_str(), *a)).collect();
    // In document order: later, moment, never, plain.
    assert_eq!(
        by_doc,
        [("succeeded", 2), ("succeeded", 1), ("quarantined", 2), ("succeeded", 1)],
        "{states:?}"
    );
    let snoozes: Vec<i32> = sqlx::query_scalar(
        "SELECT coalesce(c.snoozes, 0) FROM jobs j LEFT JOIN job_counters c USING (job_id) \
         ORDER BY j.document_id",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    // The moment's snoozes were free; the never-ready job's first three were, then two more
    // spent its two attempts.
    assert!(snoozes[1] <= 3 && snoozes[2] == 3 + 2, "{snoozes:?}");
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

/// A background task of the worker that dies (here the heartbeat, panicking at a
/// failpoint) stops the processor with a non-zero exit naming it: it never runs on with
/// leases nothing renews.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_task_that_dies_stops_the_processor() {
    let it = Installation::new("boundary-task").await;
    it.create_topics().await;
    let mut env = it.fast_env(&jobfold_tests::kafka::unique_name("boundary-task"));
    env.insert(
        "JOBFOLD_FAILPOINT".into(),
        format!("{}@3:panic", jobfold_common::failpoint::PROCESSOR_HEARTBEAT),
    );
    // jobfold's own panics keep the report Rust's hook gives them, backtrace and all: only a
    // handler's go without one (a_handlers_panics_are_reported_without_a_backtrace).
    env.insert("RUST_BACKTRACE".into(), "1".into());
    let mut processor = Service::start("jobfold-test-processor", &env);
    let status =
        processor.wait_exit(Duration::from_secs(60)).expect("the processor stops on its own");
    let log = processor.log_text();
    assert!(!status.success(), "{log}");
    assert!(log.contains("the heartbeat task panicked"), "{log}");
    assert!(log.contains("stack backtrace:"), "{log}");
    it.cleanup().await;
}

/// A handler's panics — in `run`, `commit` and `cost` — are counted by kind and call and
/// logged as a warning, with no backtrace even under `RUST_BACKTRACE=1`: symbolising one
/// holds a lock every panicking thread of the process waits for, so a kind panicking on
/// every job would slow every job beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_panics_are_reported_without_a_backtrace() {
    let it = Installation::new("boundary-panic-report").await;
    it.create_topics().await;
    let mut env = it.fast_env(&jobfold_tests::kafka::unique_name("boundary-panic-report"));
    env.insert("RUST_BACKTRACE".into(), "1".into());
    env.insert("JOBFOLD_ACCEPT__DEFAULT_MAX_ATTEMPTS".into(), "2".into());
    // A limit no load reaches, so that `cost` is asked.
    env.insert("JOBFOLD_KINDS__INDEX-DOCUMENT__COST_PER_MINUTE".into(), "1000000000".into());
    let _relay = Service::start("jobfold-relay", &env);
    let processor = Service::start("jobfold-test-processor", &env);
    let acceptor = it.acceptor().await;
    let simulate = |doc: &str, simulate: Value| {
        index_job(doc, 1, json!({ "text": doc, "simulate": simulate }))
    };
    let jobs = [
        simulate("doc-commit", json!({ "commit_panic": true })),
        simulate("doc-cost", json!({ "cost_panic": true })),
        simulate("doc-plain", json!({})),
        simulate("doc-run", json!({ "panic": true })),
    ];
    accept_all(&acceptor, &it, &jobs).await;
    let kind = jobfold_tests::handlers::KIND;
    eventually(Duration::from_secs(90), "every job to end", || ended(&it, kind)).await;
    let states: Vec<String> = state_of(&it, kind).await.into_iter().map(|(s, _, _)| s).collect();
    assert_eq!(states, ["quarantined", "quarantined", "succeeded", "quarantined"]);
    for call in ["commit", "cost", "run"] {
        eventually(Duration::from_secs(30), &format!("{call}'s panics to be counted"), || async {
            let text = processor.scrape().await.unwrap_or_default();
            let labels = [("kind", kind), ("call", call)];
            metric_value(&text, "jobfold_handler_panics_total", &labels).unwrap_or(0.0) >= 1.0
        })
        .await;
    }
    let log = processor.log_text();
    assert!(log.contains("A handler panicked"), "{log}");
    assert!(log.contains("simulated panic"), "the panic's message is logged: {log}");
    assert!(!log.contains("stack backtrace"), "a handler's panic took a backtrace: {log}");
    assert!(!log.contains("panicked at"), "Rust's own report was printed too: {log}");
    it.cleanup().await;
}

/// A job whose run aborts its process (a native library's crash, an OOM kill) inside the
/// lease transaction's inline window spends an attempt and counts a crash each time; at
/// `max_crashes` it is quarantined with a reason that says so, and the other documents'
/// jobs — several sharing its lease transactions when it crashed — all succeed, each
/// business write once. One death short of `max_crashes` its next (isolated) run waits
/// `crash_backoff` from when its death was found, not its kind's short retry backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_kills_its_processor_ends_quarantined_and_the_rest_flow() {
    let it = Installation::new("boundary-crash").await;
    it.create_topics().await;
    let mut env = it.fast_env(&jobfold_tests::kafka::unique_name("boundary-crash"));
    env.insert("JOBFOLD_PROCESSOR__MAX_CRASHES".into(), "2".into());
    let crash_backoff = Duration::from_secs(4);
    env.insert("JOBFOLD_PROCESSOR__CRASH_BACKOFF".into(), "4s".into());
    assert_eq!(env["JOBFOLD_PROCESSOR__RETRY_CAP"], "200ms", "the backoff is not the retry's");
    env.insert("JOBFOLD_ACCEPT__DEFAULT_MAX_ATTEMPTS".into(), "10".into());
    let _relay = Service::start("jobfold-relay", &env);
    let acceptor = it.acceptor().await;
    let mut jobs =
        vec![index_job("doc-poison", 1, json!({ "text": "x", "simulate": { "abort": true } }))];
    jobs.extend(
        (0..30).map(|n| index_job(&format!("doc-{n}"), 1, json!({ "text": format!("text {n}") }))),
    );
    accept_all(&acceptor, &it, &jobs).await;

    let quarantined = || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM quarantine")
            .fetch_one(&it.pool)
            .await
            .unwrap();
        n == 1
    };
    let mut processor = Service::start("jobfold-test-processor", &env);
    let mut crashes = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    while !quarantined().await {
        assert!(std::time::Instant::now() < deadline, "the poison job is still not quarantined");
        if let Some(status) = processor.wait_exit(Duration::from_millis(200)) {
            assert!(processor.log_text().contains("simulated crash"), "{status}");
            crashes += 1;
            assert!(crashes <= 2, "the job crashed its processor {crashes} times and still runs");
            processor = Service::start("jobfold-test-processor", &env);
            if crashes == 1 {
                // The new processor finds the death (a crash counted) and fails the attempt,
                // due again no sooner than crash_backoff after.
                let (found, due) = first_crash_and_retry(&it).await;
                assert!(
                    due - found >= chrono::Duration::from_std(crash_backoff).unwrap(),
                    "a suspect is due again {} ms after its death was found",
                    (due - found).num_milliseconds()
                );
            }
        }
    }
    eventually(Duration::from_secs(90), "the other jobs to succeed", || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'succeeded'")
            .fetch_one(&it.pool)
            .await
            .unwrap();
        n == 30
    })
    .await;
    assert_eq!(crashes, 2, "it crashed its processor max_crashes times");
    let reason = quarantine_reason(&it, jobfold_tests::handlers::KIND).await;
    assert!(reason.contains("killed its processor 2 times (max_crashes 2)"), "{reason}");
    let duplicated: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM index_writes GROUP BY job_id, input_version \
         HAVING count(*) > 1) d",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(duplicated, 0, "a business write was committed twice");
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    drop(processor);
    it.cleanup().await;
}

/// When the one job with a crash counted had its death found, and when its next attempt is
/// due, once its failed attempt is recorded.
async fn first_crash_and_retry(
    it: &Installation,
) -> (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) {
    let query = || async {
        sqlx::query_as::<_, (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)>(
            "SELECT c.last_crash_at, j.next_attempt_at FROM job_counters c JOIN jobs j USING \
             (job_id) WHERE c.crashes = 1 AND j.state = 'retry_wait'",
        )
        .fetch_optional(&it.pool)
        .await
        .unwrap()
    };
    eventually(Duration::from_secs(60), "the death to be found and its attempt failed", || async {
        query().await.is_some()
    })
    .await;
    query().await.unwrap()
}

/// A suspect whose isolated run returns (here, failing as handlers do) survived its run: its
/// count of crashes starts again, so deaths it only happened to be running beside (another
/// job's abort, a kill from outside) do not add up to its quarantine over its retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_whose_run_returns_is_charged_no_more() {
    let mut it = Installation::new("boundary-survived").await;
    it.fast();
    it.create_topics().await;
    // It was running when processes died twice, one death short of `max_crashes` (3): a
    // suspect, run isolated.
    let failing = json!({ "text": "x", "simulate": { "fail_attempts": 1 } });
    let job = accept_crashed(&it, &["doc-bystander"], &failing, 2).await[0];
    let pipeline = Pipeline::start(&it, true);
    eventually(Duration::from_secs(60), "the bystander to succeed", || async {
        it.state_and_attempt(job).await.0 == "succeeded"
    })
    .await;
    let crashes: i32 = sqlx::query_scalar("SELECT crashes FROM job_counters WHERE job_id = $1")
        .bind(job)
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert_eq!(crashes, 0, "its isolated runs returned: no crash is held against it");
    assert_eq!(it.state_and_attempt(job).await.1, 2, "one failed attempt, then success");
    pipeline.stop().await;
    it.cleanup().await;
}

/// Accepts one job for each of `documents` with `input`, each counted as running when
/// `crashes` processes died (as a lease transaction finding their runs' records counts them).
async fn accept_crashed(
    it: &Installation,
    documents: &[&str],
    input: &Value,
    crashes: i32,
) -> Vec<Uuid> {
    let acceptor = it.acceptor().await;
    let mut jobs = Vec::new();
    for document in documents {
        let job =
            acceptor.accept(&it.pool, &index_job(document, 1, input.clone())).await.unwrap().job_id;
        sqlx::query(
            "INSERT INTO job_counters (job_id, crashes, last_crash_owner, last_crash_at) \
             VALUES ($1, $2, 'a process that died', now())",
        )
        .bind(job)
        .bind(crashes)
        .execute(&it.pool)
        .await
        .unwrap();
        jobs.push(job);
    }
    jobs
}

async fn all_succeeded(it: &Installation, jobs: &[Uuid]) -> bool {
    for job in jobs {
        if it.state_and_attempt(*job).await.0 != "succeeded" {
            return false;
        }
    }
    true
}

/// Jobs a process's death found running (one lease transaction runs up to 256) are charged
/// the attempt and run again side by side, not one at a time: only a job one death short of
/// `max_crashes` runs isolated. Here two such bystanders of one death (3 allowed) can each
/// succeed only if the other runs at the same time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jobs_a_death_touched_run_again_side_by_side() {
    let mut it = Installation::new("boundary-bystanders").await;
    it.fast();
    it.create_topics().await;
    assert_eq!(it.config.processor.max_crashes, 3);
    let dir = std::env::temp_dir().join(jobfold_tests::kafka::unique_name("bystanders"));
    let meet = json!({ "text": "x", "simulate": { "meet": { "dir": dir, "of": 2 } } });
    // Running, with others, when a process died once.
    let jobs = accept_crashed(&it, &["doc-bystander-a", "doc-bystander-b"], &meet, 1).await;
    let pipeline = Pipeline::start(&it, true);
    eventually(Duration::from_secs(120), "both bystanders to succeed", || {
        all_succeeded(&it, &jobs)
    })
    .await;
    pipeline.stop().await;
    for job in &jobs {
        assert_eq!(
            it.state_and_attempt(*job).await.1,
            1,
            "a bystander ran alone and met no one (one failed attempt)"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    it.cleanup().await;
}

/// Suspects queue for the one isolated run a process makes at a time, their leases kept alive
/// meanwhile: two slow suspects in one processor, each running longer than a lease's TTL,
/// both succeed at their first attempt, and the reaper finds neither lease lapsed (no
/// `RetryDue` for either: the one waiting its turn was never dispatched again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suspects_waiting_their_turn_keep_their_leases() {
    let mut it = Installation::new("boundary-suspects").await;
    it.fast();
    it.create_topics().await;
    let slow = json!({ "text": "x", "simulate": { "sleep_ms": 8_000 } });
    // One death short of `max_crashes` (3): suspects.
    let jobs = accept_crashed(&it, &["doc-suspect-a", "doc-suspect-b"], &slow, 2).await;
    assert!(it.config.processor.lease_ttl < Duration::from_secs(8), "each runs past a TTL");
    let pipeline = Pipeline::start(&it, true);
    eventually(Duration::from_secs(90), "both suspects to succeed", || all_succeeded(&it, &jobs))
        .await;
    pipeline.stop().await;
    for job in &jobs {
        assert_eq!(it.state_and_attempt(*job).await.1, 1, "one attempt each");
    }
    let redispatched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM job_events WHERE kind = 'RetryDue' AND job_id = ANY($1)",
    )
    .bind(&jobs)
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(redispatched, 0, "a waiting suspect's lease lapsed and the reaper dispatched it");
    it.cleanup().await;
}

/// A run record left by a process that died stays only while one of its jobs may still be
/// leased: once they all ended (or are gone), the reaper's sweep deletes it; a young record
/// (a live lease transaction's window) and one naming a job still open are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_runs_that_died_go_once_their_jobs_end() {
    let it = Installation::new("boundary-sweep").await;
    let acceptor = it.acceptor().await;
    let open = acceptor
        .accept(&it.pool, &index_job("doc-open", 1, json!({ "text": "x" })))
        .await
        .unwrap()
        .job_id;
    let ended = acceptor
        .accept(&it.pool, &index_job("doc-ended", 1, json!({ "text": "x" })))
        .await
        .unwrap()
        .job_id;
    sqlx::query("UPDATE jobs SET state = 'cancelled', finished_at = now() WHERE job_id = $1")
        .bind(ended)
        .execute(&it.pool)
        .await
        .unwrap();
    let (gone, young) = (Uuid::now_v7(), Uuid::now_v7());
    for (run_ids, age) in [
        (vec![ended, gone], "2 minutes"),
        (vec![open, ended], "2 minutes"),
        (vec![young], "1 second"),
    ] {
        sqlx::query(
            "INSERT INTO inline_runs (run_id, job_ids, owner, started_at) \
             VALUES ($1, $2, 'a process that died', now() - $3::interval)",
        )
        .bind(Uuid::now_v7())
        .bind(&run_ids)
        .bind(age)
        .execute(&it.pool)
        .await
        .unwrap();
    }
    assert_eq!(jobfold_processor::store::sweep_inline_runs(&it.pool).await.unwrap(), 1);
    let left: Vec<Vec<Uuid>> =
        sqlx::query_scalar("SELECT job_ids FROM inline_runs ORDER BY started_at")
            .fetch_all(&it.pool)
            .await
            .unwrap();
    assert_eq!(left, vec![vec![open, ended], vec![young]]);
    it.cleanup().await;
}
