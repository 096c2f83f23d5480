//! What operators see: the gauges after a known workload, the status API and its errors,
//! the bearer token, the W3C trace reaching the handler's span, and secrets kept out of
//! logs and metrics — against real Postgres, Kafka and the registry.

use std::collections::HashMap;
use std::time::Duration;

use jobfold_tests::harness::{
    Installation, Service, eventually, eventually_some, free_port, metric_value,
};
use jobfold_tests::kafka::unique_name;
use jobfold_tests::services;
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Headers;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};
use uuid::Uuid;

const TOKEN: &str = "test-token-3b9d8f0c1a2e4d5b";

/// A processor process of `it` with fast timings, its HTTP API on a port of its own.
fn processor_env(it: &Installation, group: &str) -> (HashMap<String, String>, u16) {
    let mut env = it.env();
    let http = free_port();
    for (k, v) in [
        ("JOBFOLD_PROCESSOR__LEASE_TTL", "2s".to_owned()),
        ("JOBFOLD_PROCESSOR__HEARTBEAT", "500ms".to_owned()),
        ("JOBFOLD_PROCESSOR__GAUGE_INTERVAL", "200ms".to_owned()),
        ("JOBFOLD_PROCESSOR__GROUP", group.to_owned()),
        ("JOBFOLD_HTTP_ADDR", format!("127.0.0.1:{http}")),
        ("JOBFOLD_KAFKA__SESSION_TIMEOUT_MS", "6000".to_owned()),
    ] {
        env.insert(k.into(), v);
    }
    (env, http)
}

async fn post_job(http: u16, body: Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{http}/v1/jobs"))
        .header("content-type", "application/json")
        .body(body.to_string());
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    request.send().await.expect("the HTTP API answers")
}

/// Waits for this test's processor to answer ready on `http`: a 200 carrying the request id
/// every jobfold answer has, not any answer. (The port was free when it was drawn; another
/// test's server that took it since would otherwise pass for the processor.)
async fn wait_http(http: u16) {
    eventually(Duration::from_secs(60), "the HTTP API to answer", || async move {
        reqwest::get(format!("http://127.0.0.1:{http}/readyz")).await.is_ok_and(|r| {
            r.status() == reqwest::StatusCode::OK && r.headers().contains_key("x-request-id")
        })
    })
    .await;
}

/// A message on the requests topic that is not Avro: the intake dead-letters it.
async fn send_poison(it: &Installation) {
    let producer: FutureProducer = jobfold_tests::kafka::client_config().create().unwrap();
    producer
        .send(
            FutureRecord::to(&it.config.topics.requests).key("poison").payload(&b"not avro"[..]),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
}

async fn state_count(it: &Installation, state: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state::text = $1")
        .bind(state)
        .fetch_one(&it.pool)
        .await
        .unwrap()
}

/// 3 permanent failures, 1 poison intake message and 2 jobs whose worker froze: a
/// processor that runs no jobs itself scrapes 3 quarantined, 1 dead letter, 2 expired
/// leases and 2 unfinished jobs; the working processor reports lag and latency.
#[tokio::test(flavor = "multi_thread")]
async fn a_scrape_after_a_known_workload_shows_the_gauges() {
    let it = Installation::new("gauges").await;
    it.create_topics().await;
    let group = unique_name("processors");
    let (mut env, http) = processor_env(&it, &group);
    // Leases stay expired: nobody reaps them during the test.
    env.insert("JOBFOLD_PROCESSOR__REAPER_GRACE".into(), "1h".into());
    let _relay = Service::start("jobfold-relay", &env);
    let worker = Service::start("jobfold-test-processor", &env);
    wait_http(http).await;

    for n in 0..3 {
        let body = json!({"document_id": format!("bad-{n}"), "kind": "index-document",
                          "input_version": 1, "input": {"text": "x", "simulate": {"permanent": true}}});
        assert_eq!(post_job(http, body, &[]).await.status(), 201);
    }
    send_poison(&it).await;
    eventually(Duration::from_secs(60), "3 quarantined jobs and 1 dead letter", || async {
        state_count(&it, "quarantined").await == 3 && it.count("dead_letters").await == 1
    })
    .await;

    // The working member reports the lag of its partitions and the latency of what ended.
    let scraped = eventually_some(Duration::from_secs(30), "consumer lag 0 everywhere", || async {
        let scraped = worker.scrape().await?;
        let topic = it.config.topics.events.as_str();
        let caught_up = (0..it.config.topics.partitions).all(|p| {
            let labels = [("topic", topic), ("partition", &p.to_string())];
            metric_value(&scraped, "jobfold_consumer_lag", &labels) == Some(0.0)
        });
        caught_up.then_some(scraped)
    })
    .await;
    let ended = [("kind", "index-document"), ("outcome", "quarantined")];
    assert_eq!(
        metric_value(&scraped, "jobfold_accept_to_complete_seconds_count", &ended),
        Some(3.0)
    );

    // Two slow jobs, then the worker freezes mid-run: its leases run out.
    for n in 0..2 {
        let body = json!({"document_id": format!("slow-{n}"), "kind": "index-document",
                          "input_version": 1, "input": {"text": "x", "simulate": {"sleep_ms": 60_000}}});
        assert_eq!(post_job(http, body, &[]).await.status(), 201);
    }
    eventually(Duration::from_secs(60), "2 leased jobs", || async {
        state_count(&it, "leased").await == 2
    })
    .await;
    worker.signal("STOP");

    // A processor that only serves (no worker, no reaper) reports what Postgres holds.
    let (mut observer_env, observer_http) = processor_env(&it, &unique_name("observer"));
    observer_env.insert("JOBFOLD_PROCESSOR__ENABLED".into(), "false".into());
    observer_env.insert("JOBFOLD_INTAKE__ENABLED".into(), "false".into());
    let observer = Service::start("jobfold-test-processor", &observer_env);
    wait_http(observer_http).await;
    let owner = it.config.processor.default_owner.clone();
    let text = eventually_some(Duration::from_secs(30), "the gauges to show it", || async {
        let text = observer.scrape().await?;
        (metric_value(&text, "jobfold_expired_leases", &[]) == Some(2.0)).then_some(text)
    })
    .await;
    assert_eq!(
        metric_value(&text, "jobfold_quarantined", &[("owner", &owner)]),
        Some(3.0),
        "{text}"
    );
    assert_eq!(metric_value(&text, "jobfold_dead_letters", &[]), Some(1.0), "{text}");
    assert_eq!(metric_value(&text, "jobfold_unfinished_jobs", &[]), Some(2.0), "{text}");
    assert_eq!(metric_value(&text, "jobfold_jobs", &[("state", "leased")]), Some(2.0), "{text}");
    assert_eq!(metric_value(&text, "jobfold_jobs", &[("state", "queued")]), Some(0.0), "{text}");
    assert_eq!(metric_value(&text, "jobfold_oldest_queued_age_seconds", &[]), Some(0.0), "{text}");

    // The API serves the same registry at /metrics, and the CLI's snapshot agrees.
    let api_text = reqwest::get(format!("http://127.0.0.1:{observer_http}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(metric_value(&api_text, "jobfold_expired_leases", &[]), Some(2.0));
    let snapshot = jobfold_common::gauges::read(&it.pool).await.unwrap();
    assert_eq!(snapshot.unfinished(), 2);
    assert_eq!(snapshot.quarantined_total(), 3);
    // Resumed only now: its next heartbeats renew the leases, and a gauge read after them
    // finds none expired.
    worker.signal("CONT");
    drop(worker);
    it.cleanup().await;
}

/// The API's answers: 404 for an unknown job, 422 for a bad body, 400 for a bad query, 401
/// on a request without the token (reads too, but for the probes); the event history
/// decodes.
#[tokio::test(flavor = "multi_thread")]
async fn the_api_answers_404_422_and_401() {
    let mut it = Installation::new("api").await;
    it.config.api_token = Some(jobfold_common::config::Sensitive::new(TOKEN.to_owned()));
    let app = jobfold_processor::http::router(it.api_state().await, 64 * 1024);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let base = format!("http://127.0.0.1:{http}");
    let bearer = format!("Bearer {TOKEN}");
    let anyone = reqwest::Client::new();
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("authorization", bearer.parse().unwrap());
    let client = reqwest::Client::builder().default_headers(headers).build().unwrap();
    let good = json!({"document_id": "doc", "kind": "index-document", "input_version": 1,
                      "input": {"text": "hello"}});

    let response = post_job(http, good.clone(), &[]).await;
    assert_eq!(response.status(), 401);
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["code"], "unauthorized");
    let wrong = post_job(http, good.clone(), &[("authorization", "Bearer not-the-token-at-all")]);
    assert_eq!(wrong.await.status(), 401);
    let replay = anyone.post(format!("{base}/v1/jobs/{}/replay", Uuid::now_v7())).send();
    assert_eq!(replay.await.unwrap().status(), 401, "replay is mutating too");
    assert_eq!(it.count("jobs").await, 0, "nothing accepted without the token");

    let bad = json!({"document_id": "doc", "kind": "index-document", "input_version": "one",
                     "input": {}});
    let response = post_job(http, bad, &[("authorization", &bearer)]).await;
    assert_eq!(response.status(), 422);
    let error: Value = response.json().await.unwrap();
    assert!(error["error"]["message"].as_str().unwrap().contains("input_version"), "{error}");

    let response = post_job(http, good, &[("authorization", &bearer)]).await;
    assert_eq!(response.status(), 201);
    let job_id = response.json::<Value>().await.unwrap()["job_id"].as_str().unwrap().to_owned();

    for path in [
        format!("/v1/jobs/{}", Uuid::now_v7()),
        "/v1/jobs/not-a-uuid".into(),
        format!("/v1/jobs/{}/events", Uuid::now_v7()),
    ] {
        let response = client.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(response.status(), 404, "{path}");
        assert_eq!(response.json::<Value>().await.unwrap()["error"]["code"], "not_found");
    }
    // Reads of job data need the token too; the probes do not.
    for path in [
        format!("/v1/jobs/{job_id}"),
        format!("/v1/jobs/{job_id}/input"),
        "/v1/overview".into(),
        "/v1/dead-letters".into(),
        "/v1/audit".into(),
    ] {
        let response = anyone.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(response.status(), 401, "{path} without the token");
    }
    for path in ["/healthz", "/readyz"] {
        let response = anyone.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(response.status(), 200, "{path}");
    }
    let job: Value =
        client.get(format!("{base}/v1/jobs/{job_id}")).send().await.unwrap().json().await.unwrap();
    assert_eq!(job["state"], "queued");
    assert_eq!(job["max_attempts"], it.config.accept.default_max_attempts);
    let events: Value = client
        .get(format!("{base}/v1/jobs/{job_id}/events"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(events.as_array().unwrap().len(), 1, "{events}");
    assert_eq!(events[0]["kind"], "JobRequested");
    assert_eq!(events[0]["event"]["payload"]["type"], "JobRequested");
    assert_eq!(events[0]["event"]["job_id"], job_id.as_str());
    assert_eq!(events[0]["published"], false, "no relay runs here");

    let response = client.get(format!("{base}/v1/quarantine?limit=many")).send().await.unwrap();
    assert_eq!(response.status(), 400);
    let response = client.get(format!("{base}/v1/quarantine?owner=nobody")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.json::<Value>().await.unwrap(), json!([]));
    it.cleanup().await;
}

/// A consumer error is counted, by stage and code, and costs nothing else: the requests
/// topic deleted under a running processor makes its intake consumer report the topic
/// missing (librdkafka's error in place of a message). The processor counts it in
/// `jobfold_consumer_errors_total{stage="intake"}`, stays up, and runs a job accepted
/// afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_error_is_counted_and_the_rest_runs_on() {
    let it = Installation::new("consumer-errors").await;
    it.create_topics().await;
    let (env, http) = processor_env(&it, &unique_name("processors"));
    let _relay = Service::start("jobfold-relay", &env);
    let mut worker = Service::start("jobfold-test-processor", &env);
    wait_http(http).await;
    // The intake consumer reads its topic (a poison message reaches `dead_letters`) before
    // the topic goes.
    send_poison(&it).await;
    eventually(Duration::from_secs(60), "the intake to read its topic", || async {
        it.count("dead_letters").await == 1
    })
    .await;
    let before = worker.scrape().await.unwrap_or_default();
    assert_eq!(
        metric_value(&before, "jobfold_consumer_errors_total", &[("stage", "intake")]),
        None,
        "no consumer error yet: {before}"
    );

    jobfold_common::kafka::delete_topics(&it.config, &[it.config.topics.requests.as_str()])
        .await
        .unwrap();
    let (count, text) =
        eventually_some(Duration::from_secs(90), "the intake's consumer error counted", || async {
            let text = worker.scrape().await?;
            let count =
                metric_value(&text, "jobfold_consumer_errors_total", &[("stage", "intake")])?;
            (count > 0.0).then_some((count, text))
        })
        .await;
    let code = text
        .lines()
        .find(|l| l.starts_with("jobfold_consumer_errors_total{") && l.contains("stage=\"intake\""))
        .and_then(|l| l.split("code=\"").nth(1))
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_default()
        .to_owned();
    assert!(!code.is_empty() && code != "other", "counted by librdkafka's code: {text}");

    // The processor is still up, and a job accepted now runs.
    let body = json!({"document_id": "after", "kind": "index-document", "input_version": 1,
                      "input": {"text": "still running"}});
    assert_eq!(post_job(http, body, &[]).await.status(), 201);
    eventually(Duration::from_secs(60), "the job accepted after the error to succeed", || async {
        state_count(&it, "succeeded").await == 1
    })
    .await;
    assert!(
        worker.wait_exit(Duration::ZERO).is_none(),
        "the processor lives on after {count} consumer errors ({code}): {}",
        worker.log_text()
    );
    drop(worker);
    it.cleanup().await;
}

/// A traceparent sent with the HTTP request travels in the event and the Kafka headers and
/// becomes the parent of the handler's span (seen in the processor's JSON log).
#[tokio::test(flavor = "multi_thread")]
async fn a_traceparent_sent_on_accept_reaches_the_handler_span() {
    let it = Installation::new("trace").await;
    it.create_topics().await;
    let (mut env, http) = processor_env(&it, &unique_name("processors"));
    env.insert("JOBFOLD_LOG_JSON".into(), "true".into());
    env.insert("RUST_LOG".into(), "info,jobfold_examples::index=debug".into());
    let _relay = Service::start("jobfold-relay", &env);
    let processor = Service::start("jobfold-test-processor", &env);
    wait_http(http).await;

    let trace_id = format!("{:032x}", rand::random::<u128>() | 1);
    let parent_id = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{parent_id}-01");
    let body = json!({"document_id": "traced", "kind": "index-document", "input_version": 1,
                      "input": {"text": "follow me"}});
    let headers = [("traceparent", traceparent.as_str()), ("tracestate", "k=v")];
    assert_eq!(post_job(http, body, &headers).await.status(), 201);
    eventually(Duration::from_secs(60), "the job to succeed", || async {
        state_count(&it, "succeeded").await == 1
    })
    .await;

    // The handler's log line, inside the job span that continues the trace.
    let span = eventually_some(Duration::from_secs(10), "the handler's log line", || async {
        processor.log_text().lines().find_map(|line| {
            let entry: Value = serde_json::from_str(line).ok()?;
            (entry["fields"]["message"] == "Document indexed.").then(|| entry["span"].clone())
        })
    })
    .await;
    assert_eq!(span["name"], "job");
    assert_eq!(span["trace_id"], trace_id.as_str(), "{span}");
    assert_eq!(span["parent_span_id"], parent_id, "{span}");
    let span_id = span["span_id"].as_str().unwrap();
    assert!(span_id.len() == 16 && span_id != parent_id, "a span of its own: {span}");

    // Every event on the topic carries the context as W3C headers, and its kind.
    // The job's log, in stream order: the succeeded job has all its events.
    let logged: Vec<String> =
        sqlx::query_scalar("SELECT kind FROM job_events ORDER BY stream_version")
            .fetch_all(&it.pool)
            .await
            .unwrap();
    let consumer: StreamConsumer = jobfold_tests::kafka::client_config()
        .set("group.id", unique_name("headers"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[&it.config.topics.events]).unwrap();
    let mut kinds = Vec::new();
    for _ in 0..logged.len() {
        let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
            .await
            .expect("an event on the topic")
            .unwrap();
        let headers = message.headers().expect("the event has headers");
        let header = |name: &str| {
            headers.iter().find(|h| h.key == name).and_then(|h| h.value).map(|v| v.to_vec())
        };
        assert_eq!(header("traceparent"), Some(traceparent.clone().into_bytes()));
        assert_eq!(header("tracestate"), Some(b"k=v".to_vec()));
        let kind = header("jobfold-event").expect("the event names its kind");
        kinds.push(String::from_utf8(kind).unwrap());
    }
    // As the headers name them.
    assert_eq!(kinds, logged);
    // The lease is an event of its own, or said by the success of a run that ended inside
    // its lease transaction.
    assert!(
        kinds == ["JobRequested", "JobLeased", "JobSucceeded"]
            || kinds == ["JobRequested", "JobSucceeded"],
        "{kinds:?}"
    );
    it.cleanup().await;
}

/// The database password, the SASL password, the API token and the registry's credentials
/// (written into its URL) appear nowhere in the logs (at debug level) or the metrics of a
/// relay and a processor that used them end to end.
#[tokio::test(flavor = "multi_thread")]
async fn secrets_appear_nowhere_in_logs_or_metrics() {
    let it = Installation::new("secrets").await;
    it.create_topics().await;
    // A role of its own with a password found nowhere else.
    let db_password = format!("pw-{}", Uuid::new_v4().simple());
    let role = format!("secret_{}", Uuid::new_v4().simple());
    let superuser = services::database_url().replacen("jobfold:jobfold@", "postgres@", 1);
    let admin = sqlx::PgPool::connect(&superuser).await.expect("the postgres superuser (trust)");
    sqlx::query(&format!("CREATE ROLE {role} LOGIN PASSWORD '{db_password}' IN ROLE jobfold"))
        .execute(&admin)
        .await
        .unwrap();
    let database_url = it.config.database_url.expose().replacen(
        "jobfold:jobfold@",
        &format!("{role}:{db_password}@"),
        1,
    );
    let (sasl_brokers, sasl_user, sasl_password) = services::sasl();
    services::require("Kafka's SASL listener", &sasl_brokers);

    let (mut env, http) = processor_env(&it, &unique_name("processors"));
    env.insert("RUST_LOG".into(), "debug".into());
    env.insert("JOBFOLD_DATABASE_URL".into(), database_url);
    env.insert("JOBFOLD_API_TOKEN".into(), TOKEN.into());
    env.insert("JOBFOLD_KAFKA_BROKERS".into(), sasl_brokers);
    env.insert("JOBFOLD_KAFKA__SECURITY_PROTOCOL".into(), "SASL_PLAINTEXT".into());
    env.insert("JOBFOLD_KAFKA__SASL_MECHANISMS".into(), "PLAIN".into());
    env.insert("JOBFOLD_KAFKA__SASL_USERNAME".into(), sasl_user);
    env.insert("JOBFOLD_KAFKA__SASL_PASSWORD".into(), sasl_password.clone());
    // The registry here asks for no credentials and takes the request with them as well.
    let registry_password = format!("reg-{}", Uuid::new_v4().simple());
    let registry_url = services::schema_registry_url().replacen(
        "http://",
        &format!("http://registry-user:{registry_password}@"),
        1,
    );
    env.insert("JOBFOLD_SCHEMA_REGISTRY_URL".into(), registry_url);
    // A kind run at a URL with credentials and a key in its query (nothing listens there).
    let hook_password = format!("hook-{}", Uuid::new_v4().simple());
    let hook_key = format!("key-{}", Uuid::new_v4().simple());
    let hook_port = jobfold_tests::harness::free_port();
    env.insert(
        "JOBFOLD_KINDS__WEBHOOK__URL".into(),
        format!("http://hook-user:{hook_password}@127.0.0.1:{hook_port}/run?api_key={hook_key}"),
    );
    let relay = Service::start("jobfold-relay", &env);
    let processor = Service::start("jobfold-test-processor", &env);
    wait_http(http).await;
    let body = json!({"document_id": "secret-doc", "kind": "index-document",
                      "input_version": 1, "input": {"text": "over SASL"}});
    let bearer = format!("Bearer {TOKEN}");
    assert_eq!(post_job(http, body, &[("authorization", &bearer)]).await.status(), 201);
    eventually(Duration::from_secs(60), "the job to succeed over SASL", || async {
        state_count(&it, "succeeded").await == 1
    })
    .await;

    let mut seen = vec![
        ("relay log", relay.log_text()),
        ("processor log", processor.log_text()),
        ("relay metrics", relay.scrape().await.unwrap_or_default()),
        ("processor metrics", processor.scrape().await.unwrap_or_default()),
    ];
    let api = reqwest::get(format!("http://127.0.0.1:{http}/metrics")).await.unwrap();
    seen.push(("API /metrics", api.text().await.unwrap()));
    for (what, text) in &seen {
        assert!(text.len() > 200, "{what} is too short to prove anything: {text}");
        for secret in [
            &db_password,
            &sasl_password,
            TOKEN,
            &registry_password,
            "registry-user",
            &hook_password,
            &hook_key,
        ] {
            assert!(!text.contains(secret), "{what} shows a secret");
        }
    }
    // The configuration was logged, with the secrets replaced.
    let log = &seen[1].1;
    let start = log.lines().find(|l| l.contains("Starting the processor")).expect("config logged");
    assert!(start.contains("sasl.password") && start.contains("*********"), "{start}");
    assert!(start.contains("http://*********@127.0.0.1:"), "the registry's URL: {start}");
    assert!(start.contains("/run?api_key=*********"), "the kind's URL: {start}");
    drop((relay, processor));
    it.cleanup().await;
    sqlx::query(&format!("DROP ROLE IF EXISTS {role}")).execute(&admin).await.unwrap();
}

/// The alert rules and the Grafana dashboard name only metrics the binaries export.
#[test]
fn alerts_and_dashboard_use_exported_metrics() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read = |path: &str| std::fs::read_to_string(root.join(path)).unwrap();
    let names = |text: &str| -> std::collections::BTreeSet<String> {
        let mut found = std::collections::BTreeSet::new();
        let mut rest = text;
        while let Some(at) = rest.find("jobfold_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(tail.len());
            found.insert(tail[..end].to_owned());
            rest = &tail[end..];
        }
        found
    };
    // Each crate names its own metrics.
    let exported = names(
        &["common/src/metrics.rs", "relay/src/metrics.rs", "processor/src/metrics.rs"]
            .map(read)
            .join("\n"),
    );
    assert!(exported.len() > 20, "{exported:?}");
    let dashboard: Value = serde_json::from_str(&read("docker/grafana/dashboards/jobfold.json"))
        .expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10);
    let exprs: Vec<String> = panels
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().to_owned())
        .collect();
    for (file, text) in [("dashboard", exprs.join("\n")), ("alerts", read("docker/alerts.yml"))] {
        let used = names(&text);
        assert!(!used.is_empty(), "{file} uses no metric");
        for name in used {
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            assert!(exported.contains(base), "{file} uses {name}, which nothing exports");
        }
    }
    for gauge in [
        "jobfold_oldest_queued_age_seconds",
        "jobfold_quarantined",
        "jobfold_relay_backlog",
        "jobfold_expired_leases",
        "jobfold_dead_letters",
    ] {
        assert!(read("docker/alerts.yml").contains(gauge), "no alert on {gauge}");
    }
}
