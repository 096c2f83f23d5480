//! Accepting jobs: one transaction, idempotent, and nothing before the commit.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jobfold_common::accept::{AcceptError, NewJob};
use jobfold_processor::http::{ApiState, router};
use jobfold_tests::harness::{Installation, eventually, read_events};
use serde_json::json;
use tokio_util::sync::CancellationToken;

fn job(document: &str, version: i64, key: Option<&str>) -> NewJob {
    NewJob {
        document_id: document.into(),
        kind: "index-document".into(),
        input_version: version,
        input: json!({ "text": format!("{document} v{version}") }),
        idempotency_key: key.map(str::to_owned),
        trace: None,
        run_at: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accept_in_a_rolled_back_transaction_leaves_nothing() {
    let it = Installation::new("rollback").await;
    it.create_topics().await;
    let acceptor = it.acceptor().await;

    // The caller's transaction accepts a job, writes its own row, then rolls back.
    let mut tx = it.pool.begin().await.unwrap();
    let accepted =
        acceptor.accept_in(&mut tx, &job("doc-rolled-back", 1, Some("k1"))).await.unwrap();
    assert!(accepted.created);
    tx.rollback().await.unwrap();

    for table in ["jobs", "job_events"] {
        assert_eq!(it.count(table).await, 0, "{table} kept a row of a rolled-back accept");
    }

    // A committed job after it is published; the rolled-back one never is.
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()));
    let marker = acceptor.accept(&it.pool, &job("doc-marker", 1, Some("k2"))).await.unwrap();
    let events = read_events(&it, Duration::from_secs(30), |seen| {
        seen.iter().any(|p| p.event.job_id == marker.job_id)
    })
    .await;
    assert!(events.iter().any(|p| p.event.job_id == marker.job_id), "the marker never arrived");
    assert!(events.iter().all(|p| p.key != "doc-rolled-back"));
    assert_eq!(it.count("jobs").await, 1);

    shutdown.cancel();
    relay.await.unwrap().unwrap();
    it.cleanup().await;
}

#[tokio::test]
async fn the_same_idempotency_key_returns_the_same_job_or_a_conflict() {
    let it = Installation::new("idempotency").await;
    let acceptor = it.acceptor().await;
    let first = acceptor.accept(&it.pool, &job("doc-1", 1, Some("key"))).await.unwrap();
    let again = acceptor.accept(&it.pool, &job("doc-1", 1, Some("key"))).await.unwrap();
    assert!(first.created && !again.created);
    assert_eq!(first.job_id, again.job_id);

    let different = acceptor.accept(&it.pool, &job("doc-1", 2, Some("key"))).await;
    assert!(
        matches!(different, Err(AcceptError::Conflict { job_id, .. }) if job_id == first.job_id)
    );

    // Without a key every accept is a new job, and older versions are accepted too.
    let v4 = acceptor.accept(&it.pool, &job("doc-1", 4, None)).await.unwrap();
    let v3 = acceptor.accept(&it.pool, &job("doc-1", 3, None)).await.unwrap();
    assert!(v4.created && v3.created && v4.job_id != v3.job_id);
    assert_eq!(it.count("jobs").await, 3);
    assert_eq!(it.count("job_events").await, 3);
    it.cleanup().await;
}

#[tokio::test]
async fn invalid_jobs_are_refused_naming_the_field() {
    let it = Installation::new("invalid").await;
    let acceptor = it.acceptor().await;
    let cases = [
        (job("", 1, None), "document_id"),
        (job("doc", 0, None), "input_version"),
        (NewJob { kind: " ".into(), ..job("doc", 1, None) }, "kind"),
        // Postgres's text and jsonb cannot hold U+0000: the request's fault, named.
        (job("doc\0", 1, None), "document_id"),
        (NewJob { kind: "index\0".into(), ..job("doc", 1, None) }, "kind"),
        (job("doc", 1, Some("key\0")), "idempotency_key"),
        (NewJob { input: json!({"a": [1, "x\0y"]}), ..job("doc", 1, None) }, "input"),
        (NewJob { input: json!({"a\0": 1}), ..job("doc", 1, None) }, "input"),
    ];
    for (bad, field) in cases {
        match acceptor.accept(&it.pool, &bad).await {
            Err(AcceptError::Invalid { field: named, .. }) => assert_eq!(named, field),
            other => panic!("expected an invalid `{field}`, got {other:?}"),
        }
    }
    let nested = NewJob { input: json!({"a": [1, "x\0y"]}), ..job("doc", 1, None) };
    let message = acceptor.accept(&it.pool, &nested).await.unwrap_err().to_string();
    assert!(message.contains("`input.a[1]`"), "{message}");
    let large = NewJob {
        input: json!("x".repeat(it.config.accept.max_input_bytes)),
        ..job("doc", 1, None)
    };
    assert!(matches!(
        acceptor.accept(&it.pool, &large).await,
        Err(AcceptError::TooLarge { limit, .. }) if limit == it.config.accept.max_input_bytes
    ));
    // A data error Postgres raises about the job's row (here a check constraint of this
    // test's own) is the request's fault too, not an outage.
    it.refuse_document("forbidden").await;
    let refused = acceptor.accept(&it.pool, &job("forbidden", 1, None)).await.unwrap_err();
    assert!(
        matches!(&refused, AcceptError::Unstorable { code, .. } if code == "23514"),
        "{refused:?}"
    );
    assert!(refused.is_request_fault());
    assert_eq!(it.count("jobs").await, 0);
    it.cleanup().await;
}

/// A kind no processor has registered is refused, alone or in a batch (which then stores
/// nothing); once a processor registers it, it is accepted; `accept.any_kind` takes any.
#[tokio::test]
async fn a_kind_no_processor_registered_is_refused_until_one_does() {
    let it = Installation::new("kinds").await;
    let acceptor = it.acceptor().await;
    let unknown = NewJob { kind: "transcribe".into(), ..job("doc-t", 1, None) };
    let refused = acceptor.accept(&it.pool, &unknown).await.unwrap_err();
    assert!(
        matches!(&refused, AcceptError::UnknownKind { kind } if kind == "transcribe"),
        "{refused:?}"
    );
    assert!(refused.is_request_fault());
    let batch = [job("doc-a", 1, None), unknown.clone()];
    assert!(matches!(
        acceptor.accept_batch(&it.pool, &batch).await,
        Err(AcceptError::UnknownKind { .. })
    ));
    assert_eq!(it.count("jobs").await, 0);

    // A processor with a handler for it starts (here: registers its kinds).
    let handlers = jobfold_processor::handler::Handlers::new()
        .with("transcribe", jobfold_tests::handlers::Simulated);
    jobfold_processor::handler::register(&handlers, &it.pool, "test").await.unwrap();
    assert!(acceptor.accept(&it.pool, &unknown).await.unwrap().created);

    let mut open = it.config.clone();
    open.accept.any_kind = true;
    let codec = jobfold_schemas::Codec::<jobfold_schemas::JobEvent>::connect(
        it.registry(),
        &it.config.topics.events,
    )
    .await
    .unwrap();
    let any = jobfold_common::accept::Acceptor::new(codec, open.accept_policy(), "test");
    let other = NewJob { kind: "anything".into(), ..job("doc-x", 1, None) };
    assert!(any.accept(&it.pool, &other).await.unwrap().created);
    it.cleanup().await;
}

/// Serves the HTTP API in this process; returns its base URL.
async fn serve_api(it: &Installation) -> (String, CancellationToken) {
    let state: ApiState = it.api_state().await;
    let app =
        router(state, it.config.accept.max_input_bytes + jobfold_processor::BODY_OVERHEAD_BYTES);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await.unwrap();
    });
    (url, shutdown)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_http_accepts_with_concurrent_retries_make_ten_thousand_jobs() {
    const JOBS: usize = 10_000;
    let it = Installation::new("http10k").await;
    let (url, shutdown) = serve_api(&it).await;
    let client = reqwest::Client::new();
    let created = Arc::new(std::sync::atomic::AtomicUsize::new(0));

    // Every request is sent twice at the same time, as a client retrying on a time-out would.
    let requests = (0..JOBS).flat_map(|i| [i, i]).map(|i| {
        let client = client.clone();
        let url = url.clone();
        let created = Arc::clone(&created);
        async move {
            let response = client
                .post(format!("{url}/v1/jobs"))
                .header("Idempotency-Key", format!("request-{i}"))
                .json(&json!({
                    "document_id": format!("doc-{}", i % 500),
                    "kind": "index-document",
                    "input_version": 1 + i / 500,
                    "input": { "n": i },
                }))
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let body: serde_json::Value = response.json().await.unwrap();
            assert!(status == 201 || status == 200, "status {status}: {body}");
            if status == 201 {
                created.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            (i, body["job_id"].as_str().unwrap().to_owned())
        }
    });
    let answers: Vec<(usize, String)> =
        futures::stream::iter(requests).buffer_unordered(64).collect().await;

    // Both copies of a request got the same job.
    let mut by_request = std::collections::HashMap::new();
    for (i, job_id) in answers {
        let first = by_request.entry(i).or_insert_with(|| job_id.clone());
        assert_eq!(*first, job_id, "request {i} got two jobs");
    }
    let distinct: HashSet<&String> = by_request.values().collect();
    assert_eq!(distinct.len(), JOBS);
    assert_eq!(created.load(std::sync::atomic::Ordering::Relaxed), JOBS);
    for table in ["jobs", "job_events"] {
        assert_eq!(it.count(table).await, JOBS as i64, "{table}");
    }
    // Requests in flight together shared transactions (group commit).
    let transactions: i64 = sqlx::query_scalar("SELECT count(DISTINCT xid) FROM job_events")
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert!(transactions < JOBS as i64, "{transactions} transactions for {JOBS} accepts");
    println!("{JOBS} accepts (and as many retries) in {transactions} transactions");
    shutdown.cancel();
    it.cleanup().await;
}

/// Among requests committed together, one that Postgres refuses (a constraint), one of an
/// unknown kind and one reusing a key each fail alone, with their own status; every other
/// request of their transactions is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_request_among_concurrent_ones_fails_only_itself() {
    let it = Installation::new("httpalone").await;
    it.refuse_document("forbidden").await;
    let (url, shutdown) = serve_api(&it).await;
    let client = reqwest::Client::new();
    let taken = client
        .post(format!("{url}/v1/jobs"))
        .header("Idempotency-Key", "taken")
        .json(&json!({ "document_id": "doc-t", "kind": "index-document", "input_version": 1, "input": {} }))
        .send()
        .await
        .unwrap();
    assert_eq!(taken.status().as_u16(), 201);
    let requests = (0..400).map(|i| {
        let (client, url) = (client.clone(), url.clone());
        let (document, kind, key, expect) = match i % 40 {
            0 => ("forbidden".to_owned(), "index-document", format!("k{i}"), "unstorable"),
            1 => (format!("doc-{i}"), "index-documnet", format!("k{i}"), "unknown_kind"),
            2 => (format!("doc-{i}"), "index-document", "taken".to_owned(), "idempotency_key_reused"),
            _ => (format!("doc-{i}"), "index-document", format!("k{i}"), "created"),
        };
        async move {
            let response = client
                .post(format!("{url}/v1/jobs"))
                .header("Idempotency-Key", key)
                .json(&json!({ "document_id": document, "kind": kind, "input_version": 1, "input": { "n": i } }))
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let body: serde_json::Value = response.json().await.unwrap();
            let got = if status == 201 { "created" } else { body["error"]["code"].as_str().unwrap_or("?") };
            assert_eq!(got, expect, "request {i}: {status} {body}");
        }
    });
    futures::stream::iter(requests).buffer_unordered(64).collect::<Vec<()>>().await;
    assert_eq!(it.count("jobs").await, 1 + 400 - 3 * 10);
    shutdown.cancel();
    it.cleanup().await;
}

/// A key another transaction holds (accepted there, not committed yet) makes its own
/// request wait, not the requests around it: with two such requests waiting (one in each of
/// the group commit's transactions), fifty others are still answered; once the holders
/// commit, the waiting two get the jobs the holders created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_by_an_open_transaction_holds_up_only_its_own_request() {
    let it = Installation::new("httpheld").await;
    let (url, shutdown) = serve_api(&it).await;
    let acceptor = it.acceptor().await;
    let client = reqwest::Client::new();
    let post = |document: String, key: String| {
        let request = client
            .post(format!("{url}/v1/jobs"))
            .header("Idempotency-Key", key)
            .json(&json!({ "document_id": document, "kind": "index-document",
                           "input_version": 1, "input": { "text": format!("{document} v1") } }));
        async move {
            let answer = request.send().await.unwrap();
            let status = answer.status().as_u16();
            (status, answer.json::<serde_json::Value>().await.unwrap())
        }
    };
    // Lock waits of this database's sessions.
    let waiting = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE NOT l.granted AND a.datname = current_database()",
        )
        .fetch_one(&it.pool)
        .await
        .unwrap()
    };
    let (mut holders, mut held, mut requests) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..2 {
        let mut tx = it.pool.begin().await.unwrap();
        let key = format!("held-{k}");
        let job = job(&key, 1, Some(&key));
        holders.push((acceptor.accept_in(&mut tx, &job).await.unwrap().job_id, tx));
        requests.push(tokio::spawn(post(key.clone(), key)));
        eventually(Duration::from_secs(30), "the request to wait for the held key", || async {
            waiting().await > k
        })
        .await;
    }
    let others =
        futures::future::join_all((0..50).map(|i| post(format!("free-{i}"), format!("free-{i}"))));
    let others = tokio::time::timeout(Duration::from_secs(60), others)
        .await
        .expect("requests with free keys waited behind the held ones");
    assert!(others.iter().all(|(status, _)| *status == 201), "{others:?}");
    assert!(requests.iter().all(|r| !r.is_finished()), "a held request did not wait");
    for (job_id, tx) in holders.drain(..) {
        tx.commit().await.unwrap();
        held.push(job_id);
    }
    for (request, job_id) in requests.into_iter().zip(held) {
        let (status, body) = request.await.unwrap();
        assert_eq!(
            (status, body["job_id"].as_str()),
            (200, Some(job_id.to_string().as_str())),
            "{body}"
        );
    }
    shutdown.cancel();
    it.cleanup().await;
}

/// `POST /v1/jobs/batch` accepts up to 1,000 jobs in one transaction and answers each in
/// order: a malformed job, an unknown kind, an input over the limit, data Postgres refuses
/// and a reused key each fail only themselves; the same batch again answers 200 with the
/// same jobs; an empty batch, one over 1,000 jobs and a body over `accept.max_batch_bytes`
/// are refused whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batch_endpoint_answers_each_job_and_a_bad_one_fails_only_itself() {
    let mut it = Installation::new("httpbatch").await;
    it.config.accept.max_input_bytes = 1000;
    it.config.accept.max_batch_bytes = 200_000;
    it.refuse_document("forbidden").await;
    let (url, shutdown) = serve_api(&it).await;
    let client = reqwest::Client::new();
    let good = |i: usize| {
        json!({ "document_id": format!("doc-{}", i % 7), "kind": "index-document",
                "input_version": 1 + i / 7, "input": { "n": i }, "idempotency_key": format!("b{i}") })
    };
    let mut jobs: Vec<serde_json::Value> = (0..100).map(good).collect();
    jobs[10] = json!({ "document_id": "d", "kind": "index-document", "input_version": "one", "input": {} });
    jobs[20]["kind"] = json!("index-documnet");
    jobs[30]["input"] = json!({ "text": "x".repeat(2000) });
    jobs[40]["document_id"] = json!("forbidden");
    jobs[50]["idempotency_key"] = json!("b49"); // b49's key, another request
    let send =
        |body: serde_json::Value| client.post(format!("{url}/v1/jobs/batch")).json(&body).send();
    let answer = send(json!({ "jobs": jobs })).await.unwrap();
    assert_eq!(answer.status().as_u16(), 200);
    let first: serde_json::Value = answer.json().await.unwrap();
    let codes: Vec<(u64, &str)> = first["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| (j["status"].as_u64().unwrap(), j["error"]["code"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(codes.len(), 100);
    for (i, code) in codes.iter().enumerate() {
        let expect = match i {
            10 => (422, "invalid_field"),
            20 => (422, "unknown_kind"),
            30 => (413, "payload_too_large"),
            40 => (422, "unstorable"),
            50 => (409, "idempotency_key_reused"),
            _ => (201, ""),
        };
        assert_eq!(*code, expect, "job {i}: {}", first["jobs"][i]);
    }
    assert!(
        first["jobs"][10]["error"]["message"].as_str().unwrap().contains("jobs[10].input_version")
    );
    assert_eq!((first["created"].clone(), first["failed"].clone()), (json!(95), json!(5)));
    assert_eq!(it.count("jobs").await, 95);

    // The same batch again: the same jobs, 200 each.
    let again: serde_json::Value =
        send(json!({ "jobs": jobs })).await.unwrap().json().await.unwrap();
    assert_eq!((again["existing"].clone(), again["failed"].clone()), (json!(95), json!(5)));
    for i in [0, 1, 99] {
        assert_eq!(again["jobs"][i]["status"], 200);
        assert_eq!(again["jobs"][i]["job_id"], first["jobs"][i]["job_id"]);
    }
    assert_eq!(it.count("jobs").await, 95);

    // Refused whole: nothing, too many, too large.
    let status = |body: serde_json::Value| {
        let send = send(body);
        async move { send.await.unwrap().status().as_u16() }
    };
    assert_eq!(status(json!({ "jobs": [] })).await, 422);
    let many: Vec<serde_json::Value> = (1000..2001).map(good).collect();
    assert_eq!(status(json!({ "jobs": many })).await, 422);
    let large: Vec<serde_json::Value> =
        (0..300).map(|i| json!({ "document_id": format!("l{i}"), "kind": "index-document", "input_version": 1, "input": { "text": "y".repeat(900) } })).collect();
    assert_eq!(status(json!({ "jobs": large })).await, 413);
    assert_eq!(it.count("jobs").await, 95);
    shutdown.cancel();
    it.cleanup().await;
}

#[tokio::test]
async fn the_http_api_answers_errors_as_json_with_the_right_status() {
    let it = Installation::new("httperrors").await;
    let (url, shutdown) = serve_api(&it).await;
    let client = reqwest::Client::new();
    let post = |body: String| {
        client.post(format!("{url}/v1/jobs")).header("content-type", "application/json").body(body)
    };

    let response =
        post(r#"{"document_id":"d","kind":"k","input_version":"one","input":{}}"#.into())
            .send()
            .await
            .unwrap();
    assert_eq!(response.status().as_u16(), 422);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_field");
    assert!(body["error"]["message"].as_str().unwrap().contains("input_version"), "{body}");

    let response =
        post(r#"{"document_id":"d","kind":"k","input_version":1}"#.into()).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 422);
    let body: serde_json::Value = response.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("input"), "{body}");

    let huge = format!(
        r#"{{"document_id":"d","kind":"k","input_version":1,"input":"{}"}}"#,
        "x".repeat(it.config.accept.max_input_bytes + jobfold_processor::BODY_OVERHEAD_BYTES)
    );
    let response = post(huge).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 413);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "payload_too_large");

    // An input over the limit in a body under the body limit: 413 too, not 422.
    let over = format!(
        r#"{{"document_id":"d","kind":"k","input_version":1,"input":"{}"}}"#,
        "x".repeat(it.config.accept.max_input_bytes)
    );
    let response = post(over).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 413);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "payload_too_large");

    // U+0000, valid JSON, that Postgres cannot store: 422 naming the field, not 503.
    let response =
        post(r#"{"document_id":"d","kind":"k","input_version":1,"input":{"t":"a\u0000b"}}"#.into())
            .send()
            .await
            .unwrap();
    assert_eq!(response.status().as_u16(), 422);
    let body: serde_json::Value = response.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("`input.t`"), "{body}");
    let response =
        post(r#"{"document_id":"d\u0000","kind":"k","input_version":1,"input":{}}"#.into())
            .send()
            .await
            .unwrap();
    assert_eq!(response.status().as_u16(), 422);
    let body: serde_json::Value = response.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("document_id"), "{body}");

    // Only application/json is JSON.
    let response = client
        .post(format!("{url}/v1/jobs"))
        .header("content-type", "application/jsonx")
        .body(r#"{"document_id":"d","kind":"k","input_version":1,"input":{}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 415);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unsupported_media_type");

    // Unknown routes and wrong methods answer the JSON error shape.
    let response = client.get(format!("{url}/v1/nothing-here")).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 404);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "not_found");
    let response = client.delete(format!("{url}/v1/jobs")).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 405);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "method_not_allowed");

    // A kind no processor has registered (a misspelling): 422, naming it; nothing stored.
    let response =
        post(r#"{"document_id":"d","kind":"index-documnet","input_version":1,"input":{}}"#.into())
            .send()
            .await
            .unwrap();
    assert_eq!(response.status().as_u16(), 422);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unknown_kind");
    assert!(body["error"]["message"].as_str().unwrap().contains("index-documnet"), "{body}");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'index-documnet'")
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert_eq!(stored, 0);

    // A data error Postgres raises about the job's row: 422, not 503.
    it.refuse_document("forbidden").await;
    let response = post(
        r#"{"document_id":"forbidden","kind":"index-document","input_version":1,"input":{}}"#
            .into(),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(response.status().as_u16(), 422);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unstorable");

    let key = |k: &str, v: i64| {
        client.post(format!("{url}/v1/jobs")).header("Idempotency-Key", k).json(
            &json!({"document_id": "d", "kind": "index-document", "input_version": v, "input": {}}),
        )
    };
    assert_eq!(key("same", 1).send().await.unwrap().status().as_u16(), 201);
    assert_eq!(key("same", 1).send().await.unwrap().status().as_u16(), 200);
    assert_eq!(key("same", 2).send().await.unwrap().status().as_u16(), 409);

    let missing =
        client.get(format!("{url}/v1/jobs/{}", uuid::Uuid::new_v4())).send().await.unwrap();
    assert_eq!(missing.status().as_u16(), 404);
    assert_eq!(it.count("jobs").await, 1);
    shutdown.cancel();
    it.cleanup().await;
}

#[tokio::test]
async fn a_batch_is_one_transaction_in_order_with_repeats_folded() {
    let it = Installation::new("batch").await;
    let acceptor = it.acceptor().await;
    let jobs = vec![
        job("doc-a", 1, None),
        job("doc-b", 1, Some("b1")),
        job("doc-a", 2, Some("a2")),
        job("doc-a", 2, Some("a2")), // the same request twice in one batch
        job("doc-a", 3, None),
    ];
    let accepted = acceptor.accept_batch(&it.pool, &jobs).await.unwrap();
    assert_eq!(accepted.iter().filter(|a| a.created).count(), 4);
    assert_eq!(accepted[2].job_id, accepted[3].job_id);
    assert!(!accepted[3].created);

    // doc-a's events are in the log in the order of the batch.
    let versions: Vec<i64> = sqlx::query_scalar(
        "SELECT j.input_version FROM job_events e JOIN jobs j USING (job_id) \
         WHERE j.document_id = 'doc-a' ORDER BY e.seq",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert_eq!(versions, [1, 2, 3]);

    // Again, with one conflicting request: nothing of the batch is accepted.
    let conflicting = vec![job("doc-c", 1, None), job("doc-b", 9, Some("b1"))];
    assert!(matches!(
        acceptor.accept_batch(&it.pool, &conflicting).await,
        Err(AcceptError::Conflict { .. })
    ));
    assert_eq!(it.count("jobs").await, 4);
    assert_eq!(it.count("job_events").await, 4);
    it.cleanup().await;
}
