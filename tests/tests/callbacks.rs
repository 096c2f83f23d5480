//! Handlers over HTTP that take long, against the shipped processor, real Postgres, Kafka
//! and the registry, with a worker on 127.0.0.1 and a proxy in front of it that cuts a
//! connection idle for a second (a load balancer's idle time-out, scaled down):
//! - a call answered synchronously after 3 s dies at the proxy each attempt, and the next
//!   attempt is told the last one's outcome is `ambiguous`;
//! - the same work answered `202` completes by calling back, its heartbeats' progress shown
//!   by the API while it runs, every call and callback signed with the kind's secret;
//!   unsigned, stale-signed and stale-generation callbacks are refused, and nothing of them
//!   is recorded;
//! - a handler that answers 202 and goes silent fails at `callback_timeout`; one whose job is
//!   cancelled is answered 409 at its next heartbeat;
//! - a provider that applied a first call whose answer was lost is reconciled by the next
//!   attempt (told `ambiguous`), so it holds one effect; a definite failure is told `failed`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use hmac::{Hmac, Mac};
use jobfold_common::accept::NewJob;
use jobfold_tests::harness::{
    Installation, Service, eventually, eventually_some, fold_mismatches, index_job,
};
use serde_json::{Value, json};
use sha2::Sha256;
use uuid::Uuid;

const SECRET: &str = "callbacks-test-secret-0123456789abcdef";

/// Lets the long job's handler go on once the test has seen its progress in the console.
static RELEASE: std::sync::LazyLock<tokio::sync::Semaphore> =
    std::sync::LazyLock::new(|| tokio::sync::Semaphore::new(0));

/// `t=<now>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`, computed here, not by the product.
fn sign(at: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(format!("{at}.").as_bytes());
    mac.update(body);
    format!("t={at},v1={}", hex::encode(mac.finalize().into_bytes()))
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// Whether `headers` carry a valid signature of `body`.
fn signed(headers: &HeaderMap, body: &[u8]) -> bool {
    let Some(header) = headers.get("jobfold-signature").and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let at = header.split(',').find_map(|p| p.strip_prefix("t=")).and_then(|t| t.parse().ok());
    at.is_some_and(|at: i64| (now() - at).abs() < 60 && sign(at, body) == header)
}

/// What the worker saw and did.
#[derive(Default)]
struct Seen {
    /// Each call: the route and its body.
    calls: Vec<(&'static str, Value)>,
    /// Calls whose signature did not verify.
    unsigned: usize,
    /// Each callback's answer: route, status, body.
    answers: Vec<(&'static str, u16, Value)>,
    /// The provider's effects by idempotency key.
    effects: HashMap<String, u32>,
}

type Shared = Arc<Mutex<Seen>>;

/// POSTs a signed callback of `job` (a call's body) to `url`.
async fn call_back(client: &reqwest::Client, url: &str, job: &Value, extra: Value) -> (u16, Value) {
    let mut body = json!({ "kind": job["kind"], "generation": job["generation"] });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let body = body.to_string();
    let answer = client
        .post(url)
        .header("content-type", "application/json")
        .header("jobfold-signature", sign(now(), body.as_bytes()))
        .body(body)
        .send()
        .await
        .unwrap();
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap_or(Value::Null))
}

fn record(seen: &Shared, route: &'static str, headers: &HeaderMap, body: &[u8]) -> Value {
    let job: Value = serde_json::from_slice(body).unwrap();
    let mut seen = seen.lock().unwrap();
    if !signed(headers, body) {
        seen.unsigned += 1;
    }
    seen.calls.push((route, job.clone()));
    job
}

async fn worker(seen: Shared) -> SocketAddr {
    let client = reqwest::Client::new();
    let route = |name: &'static str| {
        let (seen, client) = (Arc::clone(&seen), client.clone());
        axum::routing::post(move |headers: HeaderMap, body: axum::body::Bytes| {
            let (seen, client) = (Arc::clone(&seen), client.clone());
            async move { handle(name, &seen, &client, &headers, &body).await }
        })
    };
    let app = axum::Router::new()
        .route("/slow-sync", route("slow-sync"))
        .route("/long", route("long"))
        .route("/silent", route("silent"))
        .route("/cancel-me", route("cancel-me"))
        .route("/pay", route("pay"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn handle(
    name: &'static str,
    seen: &Shared,
    client: &reqwest::Client,
    headers: &HeaderMap,
    body: &[u8],
) -> axum::response::Response {
    let job = record(seen, name, headers, body);
    match name {
        // Three seconds without a byte: the proxy cuts the connection after one.
        "slow-sync" => {
            tokio::time::sleep(Duration::from_secs(3)).await;
            axum::Json(json!({ "late": true })).into_response()
        }
        "long" => {
            let (seen, client) = (Arc::clone(seen), client.clone());
            tokio::spawn(async move {
                let beat = job["heartbeat_url"].as_str().unwrap().to_owned();
                for step in 1..=8 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if step == 3 {
                        // Held until the console showed the progress reported so far.
                        let _ = RELEASE.acquire().await;
                    }
                    let (status, answer) =
                        call_back(&client, &beat, &job, json!({ "progress": { "step": step } }))
                            .await;
                    seen.lock().unwrap().answers.push(("heartbeat", status, answer));
                }
                let done = job["complete_url"].as_str().unwrap();
                let result = json!({ "result": { "converted": job["document_id"] } });
                let (status, answer) = call_back(&client, done, &job, result).await;
                seen.lock().unwrap().answers.push(("complete", status, answer));
            });
            StatusCode::ACCEPTED.into_response()
        }
        "silent" => StatusCode::ACCEPTED.into_response(),
        "cancel-me" => {
            let (seen, client) = (Arc::clone(seen), client.clone());
            tokio::spawn(async move {
                let beat = job["heartbeat_url"].as_str().unwrap().to_owned();
                loop {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    let (status, answer) = call_back(&client, &beat, &job, json!({})).await;
                    seen.lock().unwrap().answers.push(("cancel-me", status, answer));
                    if status != 200 {
                        return;
                    }
                }
            });
            StatusCode::ACCEPTED.into_response()
        }
        "pay" => {
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            // The reconcile: after an attempt whose outcome is unknown, ask the provider.
            if job["previous_outcome"] == "ambiguous"
                && seen.lock().unwrap().effects.get(&key).is_some_and(|n| *n > 0)
            {
                return axum::Json(json!({ "charged": key, "reconciled": true })).into_response();
            }
            if job["input"]["fail_first"] == true && job["attempt"] == 1 {
                return (StatusCode::INTERNAL_SERVER_ERROR, "provider down").into_response();
            }
            // The provider applies every charge it gets (no dedupe of its own).
            let first = {
                let mut seen = seen.lock().unwrap();
                let n = seen.effects.entry(key.clone()).or_default();
                *n += 1;
                *n == 1
            };
            if first && job["input"]["lose_answer"] == true {
                // Applied, but the answer comes after the kind's request_timeout.
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            axum::Json(json!({ "charged": key, "reconciled": false })).into_response()
        }
        _ => unreachable!(),
    }
}

fn job_of(kind: &str, document: &str, input: Value) -> NewJob {
    NewJob { kind: kind.into(), ..index_job(document, 1, input) }
}

async fn job_row(it: &Installation, job_id: Uuid) -> (String, i32, Option<String>) {
    sqlx::query_as("SELECT state::text, attempt, last_error FROM jobs WHERE job_id = $1")
        .bind(job_id)
        .fetch_one(&it.pool)
        .await
        .unwrap()
}

async fn ended(it: &Installation, job_id: Uuid) -> bool {
    let state = job_row(it, job_id).await.0;
    ["succeeded", "quarantined", "cancelled"].contains(&state.as_str())
}

fn calls_of(seen: &Shared, route: &str) -> Vec<Value> {
    let seen = seen.lock().unwrap();
    seen.calls.iter().filter(|(r, _)| *r == route).map(|(_, body)| body.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_jobs_complete_by_calling_back_signed_and_fenced() {
    let mut it = Installation::new("callbacks").await;
    for (kind, attempts) in [("slow-sync", 2), ("silent", 1), ("pay", 3)] {
        let budget =
            jobfold_common::config::Kind { max_attempts: Some(attempts), ..Default::default() };
        it.config.kinds.insert(kind.into(), budget);
    }
    it.create_topics().await;
    let seen = Shared::default();
    let target = worker(Arc::clone(&seen)).await;
    let (proxy, cut) = jobfold_tests::proxy::idle_proxy(target, Duration::from_secs(1)).await;
    let kinds = format!(
        r#"
[kinds.slow-sync]
url = "http://{proxy}/slow-sync"
secret = "{SECRET}"
max_attempts = 2
[kinds.long]
url = "http://{proxy}/long"
secret = "{SECRET}"
[kinds.silent]
url = "http://{proxy}/silent"
secret = "{SECRET}"
callback_timeout = "2s"
max_attempts = 1
[kinds.cancel-me]
url = "http://{proxy}/cancel-me"
secret = "{SECRET}"
[kinds.pay]
url = "http://{target}/pay"
secret = "{SECRET}"
request_timeout = "1s"
max_attempts = 3
"#
    );
    let group = it.start_group("callbacks", &kinds, 1).await;
    let (api, processor) = (|path: String| group.api(&path), group.processor());
    let acceptor = it.acceptor().await;
    let mut ids = HashMap::new();
    for (name, job) in [
        ("slow-sync", job_of("slow-sync", "doc-slow", json!({}))),
        ("long", job_of("long", "doc-long", json!({}))),
        ("silent", job_of("silent", "doc-silent", json!({}))),
        ("cancel-me", job_of("cancel-me", "doc-cancel", json!({}))),
        ("lost-answer", job_of("pay", "doc-pay-lost", json!({ "lose_answer": true }))),
        ("failed-first", job_of("pay", "doc-pay-failed", json!({ "fail_first": true }))),
    ] {
        ids.insert(name, acceptor.accept(&it.pool, &job).await.unwrap().job_id);
    }
    let client = reqwest::Client::new();

    // While the long job runs, the API shows what its heartbeats reported.
    let long = ids["long"];
    let progress = eventually_some(Duration::from_secs(60), "the long job's progress", || {
        let (client, url) = (client.clone(), api(format!("/v1/jobs/{long}")));
        async move {
            let job: Value = client.get(url).send().await.ok()?.json().await.ok()?;
            (job["state"] == "leased" && !job["progress"].is_null()).then_some(job)
        }
    })
    .await;
    assert!(progress["progress"]["step"].as_i64().is_some(), "{progress}");
    assert!(progress["progress_at"].is_string(), "{progress}");
    // The console's job page shows it too, in a real browser.
    let browser = jobfold_tests::browser::Browser::start(1280, 900).await;
    browser.goto(&api(format!("/ui/#/jobs/{long}"))).await;
    let shown = browser
        .until(
            "the progress on the job page",
            "const p = document.querySelector('[data-field=progress]'); return p && p.textContent;",
        )
        .await;
    assert!(shown.as_str().unwrap().starts_with(r#"{"step":"#), "{shown}");
    RELEASE.add_permits(1);

    // Callbacks the processor refuses, while the long job is leased: each is answered with
    // its reason, and none is recorded (its progress stays what the handler reported).
    let call = calls_of(&seen, "long").pop().expect("the long job's call");
    let beat = call["heartbeat_url"].as_str().unwrap().to_owned();
    let refused_before = processor_refusals(processor).await;
    let body = json!({ "kind": "long", "generation": call["generation"], "progress": "forged" })
        .to_string();
    let unsigned = client
        .post(&beat)
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(unsigned.status(), 401);
    let stale = client
        .post(&beat)
        .header("content-type", "application/json")
        .header("jobfold-signature", sign(now() - 600, body.as_bytes()))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(stale.status(), 401);
    let said: Value = stale.json().await.unwrap();
    assert!(said["error"]["message"].as_str().unwrap().contains("600 s away"), "{said}");
    let wrong = json!({ "kind": "long", "generation": 99, "progress": "forged" }).to_string();
    let fenced = client
        .post(&beat)
        .header("content-type", "application/json")
        .header("jobfold-signature", sign(now(), wrong.as_bytes()))
        .body(wrong)
        .send()
        .await
        .unwrap();
    assert_eq!(fenced.status(), 409);
    let said: Value = fenced.json().await.unwrap();
    assert_eq!(said["error"]["generation"], call["generation"], "{said}");
    assert_eq!(processor_refusals(processor).await - refused_before, 2.0);
    let forged: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM async_attempts WHERE progress = '\"forged\"'::jsonb",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(forged, 0, "a refused callback was recorded");

    // Cancel the job whose handler heartbeats: its next heartbeat is answered 409.
    let cancel_me = ids["cancel-me"];
    eventually(Duration::from_secs(60), "the cancel-me handler's first heartbeat", || async {
        seen.lock().unwrap().answers.iter().any(|(r, s, _)| *r == "cancel-me" && *s == 200)
    })
    .await;
    let cancelled = client
        .post(api(format!("/v1/jobs/{cancel_me}/cancel")))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), 200);
    let stopped = eventually_some(Duration::from_secs(30), "the 409 to the cancelled job", || {
        let seen = Arc::clone(&seen);
        async move {
            let seen = seen.lock().unwrap();
            seen.answers.iter().find(|(r, s, _)| *r == "cancel-me" && *s != 200).cloned()
        }
    })
    .await;
    assert_eq!((stopped.1, stopped.2["error"]["state"].as_str()), (409, Some("cancelled")));

    for (name, id) in &ids {
        eventually(Duration::from_secs(90), &format!("the {name} job to end"), || ended(&it, *id))
            .await;
    }

    // The synchronous call died at the proxy, each attempt, after it was sent: the second
    // attempt was told so.
    let (state, attempts, error) = job_row(&it, ids["slow-sync"]).await;
    assert_eq!((state.as_str(), attempts), ("quarantined", 2), "{error:?}");
    assert!(cut.cut() >= 2, "the proxy cut {} connections", cut.cut());
    let slow = calls_of(&seen, "slow-sync");
    let told: Vec<&Value> = slow.iter().map(|c| &c["previous_outcome"]).collect();
    assert_eq!(told, [&json!("none"), &json!("ambiguous")]);
    assert!(slow.iter().all(|c| c["max_attempts"] == 2 && c["attempt"].is_i64()), "{slow:?}");

    // The same length of work answered 202 completed through the same proxy, with the
    // result it called back with; every heartbeat and the completion were accepted.
    let (state, attempts, _) = job_row(&it, long).await;
    assert_eq!((state.as_str(), attempts), ("succeeded", 1));
    let result: Value = client
        .get(api(format!("/v1/jobs/{long}/result")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(result["converted"], "doc-long", "{result}");
    {
        let seen = seen.lock().unwrap();
        let long_answers: Vec<u16> = seen
            .answers
            .iter()
            .filter(|(r, _, _)| *r == "heartbeat" || *r == "complete")
            .map(|(_, s, _)| *s)
            .collect();
        assert_eq!(long_answers, [200; 9], "{:?}", seen.answers);
        assert_eq!(seen.unsigned, 0, "a call to the worker was not signed");
    }
    // A heartbeat after the end is told the job ended.
    let (status, said) = call_back(&client, &beat, &call, json!({})).await;
    assert_eq!((status, said["error"]["state"].as_str()), (409, Some("succeeded")), "{said}");

    // The silent handler's attempt ended at callback_timeout, outcome unknown.
    let (state, _, error) = job_row(&it, ids["silent"]).await;
    assert_eq!(state, "quarantined");
    assert!(error.as_deref().unwrap_or_default().contains("did not call back"), "{error:?}");

    // The provider applied the first charge, whose answer was lost: the second attempt,
    // told `ambiguous`, found it there and charged nothing. One effect.
    let lost = ids["lost-answer"];
    let (state, attempts, _) = job_row(&it, lost).await;
    assert_eq!((state.as_str(), attempts), ("succeeded", 2));
    let key = format!("{lost}:1");
    assert_eq!(seen.lock().unwrap().effects.get(&key), Some(&1));
    let result: Value = client
        .get(api(format!("/v1/jobs/{lost}/result")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(result["reconciled"], true, "{result}");
    let pays = calls_of(&seen, "pay");
    let told_of = |document: &str| -> Vec<Value> {
        pays.iter()
            .filter(|c| c["document_id"] == document)
            .map(|c| c["previous_outcome"].clone())
            .collect()
    };
    assert_eq!(told_of("doc-pay-lost"), [json!("none"), json!("ambiguous")]);
    assert_eq!(told_of("doc-pay-failed"), [json!("none"), json!("failed")]);

    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

/// The processor's refusals of callbacks for their signature.
async fn processor_refusals(processor: &Service) -> f64 {
    let scraped = processor.scrape().await.unwrap_or_default();
    jobfold_tests::harness::metric_value(
        &scraped,
        "jobfold_http_refused_total",
        &[("reason", "signature")],
    )
    .unwrap_or(0.0)
}

/// A handler that takes a second a call and counts the calls in flight at once.
fn slow_handler(in_flight: Arc<Mutex<(usize, usize)>>) -> axum::Router {
    axum::Router::new().route(
        "/slow",
        axum::routing::post(move || {
            let in_flight = Arc::clone(&in_flight);
            async move {
                {
                    let mut n = in_flight.lock().unwrap();
                    n.0 += 1;
                    n.1 = n.1.max(n.0);
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                in_flight.lock().unwrap().0 -= 1;
                axum::Json(json!({ "ok": true }))
            }
        }),
    )
}

/// [`slow_handler`] in plain text: HTTP/1.1 and, to a client with prior knowledge, HTTP/2
/// (h2c), as axum serves.
async fn serve_plain(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Calls in flight together to a kind with `http2 = true` share one connection (streams of
/// it): in plain text (h2c), and over TLS, HTTP/2 agreed by ALPN with a handler whose
/// certificate an authority of its own signed (trusted by the kind's `ca_file`). The same
/// calls to a kind without it each take one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_to_an_http2_handler_share_a_connection() {
    let it = Installation::new("callbacks-h2").await;
    it.create_topics().await;
    let (h2_in_flight, h1_in_flight, tls_in_flight) =
        (Arc::default(), Arc::default(), Arc::default());
    let idle = Duration::from_secs(60);
    let plain =
        |in_flight: &Arc<Mutex<(usize, usize)>>| serve_plain(slow_handler(Arc::clone(in_flight)));
    let (h2, h2_counts) = jobfold_tests::proxy::idle_proxy(plain(&h2_in_flight).await, idle).await;
    let (h1, h1_counts) = jobfold_tests::proxy::idle_proxy(plain(&h1_in_flight).await, idle).await;
    let served = jobfold_tests::tls::serve(slow_handler(Arc::clone(&tls_in_flight))).await;
    let (tls, tls_counts) = jobfold_tests::proxy::idle_proxy(served.addr, idle).await;
    let kinds = format!(
        "[kinds.h2]\nurl = \"http://{h2}/slow\"\nhttp2 = true\n\
         [kinds.h1]\nurl = \"http://{h1}/slow\"\n\
         [kinds.tls]\nurl = \"https://localhost:{port}/slow\"\nca_file = \"{ca}\"\nhttp2 = true\n",
        port = tls.port(),
        ca = served.ca_file.display(),
    );
    let _group = it.start_group("callbacks-h2", &kinds, 1).await;
    let acceptor = it.acceptor().await;
    let mut ids = Vec::new();
    for n in 0..30 {
        for kind in ["h2", "h1", "tls"] {
            let job = job_of(kind, &format!("doc-{kind}-{n}"), json!({}));
            ids.push(acceptor.accept(&it.pool, &job).await.unwrap().job_id);
        }
    }
    for id in &ids {
        eventually(Duration::from_secs(90), "every job to end", || ended(&it, *id)).await;
    }
    for id in &ids {
        assert_eq!(job_row(&it, *id).await.0, "succeeded");
    }
    let peak = |n: &Arc<Mutex<(usize, usize)>>| n.lock().unwrap().1;
    // Every kind had many calls in flight at once: the comparison is between equals.
    assert!(
        [&h2_in_flight, &h1_in_flight, &tls_in_flight].iter().all(|n| peak(n) >= 10),
        "{h2_in_flight:?} {h1_in_flight:?} {tls_in_flight:?}"
    );
    assert_eq!(h2_counts.accepted(), 1, "the h2c kind's calls opened more than one connection");
    assert_eq!(tls_counts.accepted(), 1, "the https kind's calls did not share a connection");
    assert!(
        h1_counts.accepted() >= peak(&h1_in_flight),
        "HTTP/1.1 calls in flight together each hold a connection: {} for {}",
        h1_counts.accepted(),
        peak(&h1_in_flight)
    );
    it.cleanup().await;
}
