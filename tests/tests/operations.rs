//! What operators do to jobs, against the real services: cancel in every state (a running
//! handler stopped and nothing committed), scheduled jobs (not leased before their time,
//! across a processor restart), finding jobs page by page while more are accepted (and the
//! indexes behind each filter), replaying a thousand quarantined jobs in bulk, fixing a
//! dead letter by sending it back to the intake, pausing and resuming a kind, and running a
//! scheduled or retry-waiting job now.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, DurationRound, Utc};
use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_processor::store;
use jobfold_schemas::event::ErrorClass;
use jobfold_tests::harness::{Installation, Running, eventually, logged_leases, metric_value};
use serde_json::{Value, json};
use uuid::Uuid;

const TOKEN: &str = "operations-test-token-0123456789";

/// An installation with short leases and heartbeats (1 s), its topics, and an acceptor.
async fn installation(name: &str) -> (Installation, Acceptor) {
    let mut it = Installation::new(name).await;
    let p = &mut it.config.processor;
    p.lease_ttl = Duration::from_secs(3);
    p.heartbeat = Duration::from_secs(1);
    p.group = jobfold_tests::kafka::unique_name("processors");
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    (it, acceptor)
}

/// Runs the `jobfold` command line against this installation; its standard output.
fn cli(it: &Installation, args: &[&str]) -> String {
    let output = jobfold_tests::harness::jobfold_cli().envs(it.env()).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "jobfold {args:?}: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn client() -> reqwest::Client {
    jobfold_tests::harness::http_client()
}

fn job(document: &str, input: Value) -> NewJob {
    jobfold_tests::harness::index_job(document, 1, input)
}

async fn state(it: &Installation, job_id: Uuid) -> String {
    it.state_and_attempt(job_id).await.0
}

/// The kinds of a job's events, in stream order.
async fn event_kinds(it: &Installation, job_id: Uuid) -> Vec<String> {
    sqlx::query_scalar("SELECT kind FROM job_events WHERE job_id = $1 ORDER BY stream_version")
        .bind(job_id)
        .fetch_all(&it.pool)
        .await
        .unwrap()
}

async fn count(it: &Installation, sql: &str, job_id: Uuid) -> i64 {
    sqlx::query_scalar(sql).bind(job_id).fetch_one(&it.pool).await.unwrap()
}

/// Puts `job_id` (of a kind no processor runs) into `retry_wait` with its retry an hour
/// away, through the processor's own transactions: leased, then failed retryably.
async fn into_retry_wait(it: &Installation, job_id: Uuid) {
    let events = it.events().await;
    let mut tx = it.pool.begin().await.unwrap();
    let mut jobs = store::lock_jobs(&mut tx, &[job_id]).await.unwrap();
    let job = &mut jobs[0];
    store::take_leases(&mut tx, &events, vec![(&mut *job, Uuid::now_v7(), None)], "test/1", |_| {
        Duration::from_secs(30)
    })
    .await
    .unwrap();
    let failed = store::Outcome::Failed {
        class: ErrorClass::Retryable,
        message: "the upstream is down".into(),
        throttled: false,
        snooze: None,
        released: false,
        ambiguous: false,
    };
    let later = Utc::now() + chrono::Duration::hours(1);
    store::complete(&mut tx, &events, job, failed, later, "test", None).await.unwrap();
    tx.commit().await.unwrap();
}

/// Cancelling ends a job in each open state at once: queued (behind its document's running
/// job), scheduled, waiting to retry, quarantined; and a running 10-minute handler is
/// cancelled by its next heartbeat — its completion is fenced, so neither a result nor a
/// business write nor a success event exists, and the log folds to `cancelled`. A cancel
/// retried answers 200 again and appends nothing; a job that ended otherwise answers 409
/// with its state; a cancel without the token, 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_ends_each_open_state_and_a_running_handler_commits_nothing() {
    let (it, acceptor) = installation("ops-cancel").await;
    sqlx::query("INSERT INTO job_kinds (kind, registered_by) VALUES ('no-handler', 'test')")
        .execute(&it.pool)
        .await
        .unwrap();
    let running = Running::start(&it, TOKEN, &[]);
    running.ready().await;

    let long = json!({ "text": "long", "simulate": { "sleep_ms": 600_000 } });
    let runs = acceptor.accept(&it.pool, &job("doc-long", long)).await.unwrap().job_id;
    let mut behind = job("doc-long", json!({ "text": "behind" }));
    behind.input_version = 2;
    let behind = acceptor.accept(&it.pool, &behind).await.unwrap().job_id;
    let mut scheduled = job("doc-later", json!({ "text": "later" }));
    scheduled.run_at = Some(Utc::now() + chrono::Duration::hours(2));
    let scheduled = acceptor.accept(&it.pool, &scheduled).await.unwrap().job_id;
    let quarantined = json!({ "text": "bad", "simulate": { "permanent": true } });
    let quarantined = acceptor.accept(&it.pool, &job("doc-bad", quarantined)).await.unwrap().job_id;
    let mut waiting = job("doc-retry", json!({ "text": "retry" }));
    waiting.kind = "no-handler".into();
    let waiting = acceptor.accept(&it.pool, &waiting).await.unwrap().job_id;
    into_retry_wait(&it, waiting).await;

    eventually(Duration::from_secs(60), "the long job to run", || async {
        state(&it, runs).await == "leased"
    })
    .await;
    eventually(Duration::from_secs(60), "the bad job to be quarantined", || async {
        state(&it, quarantined).await == "quarantined"
    })
    .await;
    assert_eq!(state(&it, behind).await, "queued");
    assert_eq!(state(&it, scheduled).await, "queued");
    assert_eq!(state(&it, waiting).await, "retry_wait");

    let unauthorized =
        client().post(running.url(&format!("/v1/jobs/{runs}/cancel"))).send().await.unwrap();
    assert_eq!(unauthorized.status().as_u16(), 401);

    for (job_id, was) in [
        (behind, "queued"),
        (scheduled, "queued"),
        (waiting, "retry_wait"),
        (quarantined, "quarantined"),
        (runs, "leased"),
    ] {
        let (status, body) = running
            .post(
                &format!("/v1/jobs/{job_id}/cancel"),
                json!({ "reason": "no longer needed", "requested_by": "ops test" }),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["state"], "cancelled", "{body}");
        assert_eq!(body["was"], was, "{body}");
        assert_eq!(state(&it, job_id).await, "cancelled");
    }
    // Its quarantine row goes with the quarantine.
    assert_eq!(
        count(&it, "SELECT count(*) FROM quarantine WHERE job_id = $1", quarantined).await,
        0
    );

    // The running handler is cancelled by its heartbeat (1 s) and its completion fenced:
    // without the cancel it would sleep for ten minutes.
    eventually(Duration::from_secs(30), "the running handler to stop, fenced", || async {
        let text = running.processor.scrape().await.unwrap_or_default();
        metric_value(&text, "jobfold_fenced_completions_total", &[]).unwrap_or(0.0) >= 1.0
    })
    .await;
    let sql = "SELECT count(*) FROM jobs WHERE job_id = $1 AND result IS NOT NULL";
    assert_eq!(count(&it, sql, runs).await, 0, "the cancelled job committed a result");
    let sql = "SELECT count(*) FROM index_writes WHERE job_id = $1";
    assert_eq!(count(&it, sql, runs).await, 0, "the cancelled job committed to index_writes");
    assert_eq!(event_kinds(&it, runs).await, ["JobRequested", "JobLeased", "JobCancelled"]);
    let text = running.processor.scrape().await.unwrap_or_default();
    assert_eq!(metric_value(&text, "jobfold_cancelled_total", &[("was", "leased")]), Some(1.0));

    // A cancel retried (its answer lost) gets the same answer and appends nothing.
    let events = |job_id| {
        let pool = it.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM job_events WHERE job_id = $1")
                .bind(job_id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let before = events(runs).await;
    let (status, body) = running.post(&format!("/v1/jobs/{runs}/cancel"), json!({})).await;
    assert_eq!(
        (status, &body["state"], &body["was"]),
        (200, &json!("cancelled"), &json!("cancelled")),
        "{body}"
    );
    assert_eq!(events(runs).await, before, "a second cancel appended an event");
    // Jobs that ended otherwise answer 409 with their state; nothing is appended.
    let done = acceptor.accept(&it.pool, &job("doc-done", json!({ "text": "quick" }))).await;
    let done = done.unwrap().job_id;
    eventually(Duration::from_secs(60), "the quick job to succeed", || async {
        state(&it, done).await == "succeeded"
    })
    .await;
    let (status, body) = running.post(&format!("/v1/jobs/{done}/cancel"), json!({})).await;
    assert_eq!((status, body["error"]["state"].as_str()), (409, Some("succeeded")), "{body}");
    let (status, _) = running.post(&format!("/v1/jobs/{}/cancel", Uuid::now_v7()), json!({})).await;
    assert_eq!(status, 404);

    // The same from the command line.
    let mut later = job("doc-cli", json!({ "text": "later" }));
    later.run_at = Some(Utc::now() + chrono::Duration::hours(1));
    let later = acceptor.accept(&it.pool, &later).await.unwrap().job_id.to_string();
    let listed = cli(&it, &["jobs", "--state", "queued"]);
    assert!(listed.contains(&later) && listed.contains("due "), "{listed}");
    let said = cli(&it, &["cancel", &later, "--reason", "not needed"]);
    assert!(said.contains("cancelled (was queued)"), "{said}");
    let cancelled = cli(&it, &["jobs", "--state", "cancelled", "--json"]);
    assert_eq!(cancelled.lines().count(), 6, "{cancelled}");
    // In the audit trail: the command line's cancel as its operating-system user, in the
    // cancel's own transaction.
    let audited: (String, String, Option<String>) = sqlx::query_as(
        "SELECT actor, via, detail->>'was' FROM audit_log WHERE action = 'cancel' AND target = $1",
    )
    .bind(&later)
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert!(audited.0.starts_with("os:") || audited.0.starts_with("uid "), "{audited:?}");
    assert_eq!((audited.1.as_str(), audited.2.as_deref()), ("cli", Some("queued")));

    // Every delayed dispatch of the cancelled jobs reaches the processor and is skipped;
    // the log folds to the projection, cancelled jobs included.
    eventually(Duration::from_secs(60), "the log on Kafka", || async {
        it.unpublished().await <= 1 // the retry an hour away
    })
    .await;
    let mismatches = jobfold_tests::harness::fold_mismatches(&it).await;
    assert!(mismatches.is_empty(), "{mismatches:?}");
    it.cleanup().await;
}

/// A job accepted with `run_at` stays queued, shown with its due time and counted as
/// scheduled (not stuck), and is not leased before that time — not by the reaper (stalled
/// after 1 s here), not by a processor started meanwhile after another was killed — and
/// runs once after it. Times too far back or ahead are refused, 422 naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_scheduled_job_is_not_leased_before_its_time_across_a_restart() {
    let (it, acceptor) = installation("ops-schedule").await;
    let mut running = Running::start(&it, TOKEN, &[("JOBFOLD_PROCESSOR__STALL_AFTER", "1s")]);
    running.ready().await;
    let submit = |body: Value| running.post("/v1/jobs", body);
    let base = json!({ "document_id": "doc-s", "kind": "index-document", "input_version": 1,
                       "input": { "text": "on time" } });
    let with = |field: &str, value: Value| {
        let mut body = base.clone();
        body[field] = value;
        body
    };

    let long_ago = (Utc::now() - chrono::Duration::days(1)).to_rfc3339();
    let far = (Utc::now() + chrono::Duration::days(800)).to_rfc3339();
    for (body, field) in [
        (with("run_at", json!(long_ago)), "run_at"),
        (with("run_at", json!(far)), "run_at"),
        (with("delay", json!("soon")), "delay"),
        (with("delay", json!("1000days")), "run_at"),
    ] {
        let (status, answer) = submit(body).await;
        assert_eq!(status, 422, "{answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(&format!("`{field}`")), "{message}");
    }
    let mut both = with("delay", json!("10s"));
    both["run_at"] = json!(Utc::now().to_rfc3339());
    assert_eq!(submit(both).await.0, 422);

    let run_at = DateTime::from_timestamp_millis(
        (Utc::now() + chrono::Duration::seconds(15)).timestamp_millis(),
    )
    .unwrap();
    let (status, answer) = submit(with("run_at", json!(run_at.to_rfc3339()))).await;
    assert_eq!(status, 201, "{answer}");
    let job_id: Uuid = answer["job_id"].as_str().unwrap().parse().unwrap();
    let (_, shown) = running.get(&format!("/v1/jobs/{job_id}")).await;
    assert_eq!(shown["state"], "queued");
    assert_eq!(shown["run_at"].as_str().map(|t| t.parse::<DateTime<Utc>>().unwrap()), Some(run_at));
    let gauges = jobfold_common::gauges::read(&it.pool).await.unwrap();
    assert_eq!(gauges.scheduled, 1);
    assert!(gauges.oldest_queued_age_seconds < 1.0, "a scheduled job is not stuck: {gauges:?}");

    // The intake topic takes run_at too; one too far back is dead-lettered.
    let intake_id = Uuid::now_v7();
    let intake_run_at = run_at + chrono::Duration::seconds(2);
    send_request(&it, intake_id, "doc-i", Some(intake_run_at)).await;
    send_request(&it, Uuid::now_v7(), "doc-old", Some(Utc::now() - chrono::Duration::days(2)))
        .await;
    let intake_job = jobfold_tests::harness::eventually_some(
        Duration::from_secs(60),
        "the scheduled intake request to be accepted",
        || async {
            sqlx::query_scalar::<_, Uuid>("SELECT job_id FROM jobs WHERE idempotency_key = $1")
                .bind(format!("request:{intake_id}"))
                .fetch_optional(&it.pool)
                .await
                .unwrap()
        },
    )
    .await;
    eventually(Duration::from_secs(60), "the stale request to be dead-lettered", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM dead_letters WHERE raw_key = 'doc-old' AND error LIKE '%run_at%'",
        )
        .fetch_one(&it.pool)
        .await
        .unwrap()
            == 1
    })
    .await;

    // A batch with one scheduled job among others (the Rust API, one statement).
    let batch_run_at = run_at + chrono::Duration::seconds(1);
    let mut scheduled = job("doc-b1", json!({ "text": "batch, later" }));
    scheduled.run_at = Some(batch_run_at);
    let batch = [job("doc-b0", json!({ "text": "batch, now" })), scheduled];
    let accepted = acceptor.accept_batch(&it.pool, &batch).await.unwrap();
    let (now_job, batch_job) = (accepted[0].job_id, accepted[1].job_id);
    eventually(Duration::from_secs(60), "the batch's immediate job to run", || async {
        state(&it, now_job).await == "succeeded"
    })
    .await;
    assert_eq!(state(&it, batch_job).await, "queued", "its scheduled neighbour waits");

    // A processor dies and another takes its place while the jobs wait.
    tokio::time::sleep(Duration::from_secs(2)).await;
    running.restart_processor();
    for (job_id, run_at) in
        [(job_id, run_at), (intake_job, intake_run_at), (batch_job, batch_run_at)]
    {
        eventually(Duration::from_secs(60), "the scheduled job to run", || async {
            state(&it, job_id).await == "succeeded"
        })
        .await;
        let leased: Vec<DateTime<Utc>> =
            logged_leases(&it.pool, Some(job_id)).await.into_iter().map(|l| l.leased_at).collect();
        assert_eq!(leased.len(), 1, "leased once");
        assert!(leased[0] >= run_at, "leased at {} before its time {run_at}", leased[0]);
        println!("leased {} ms after its run_at", (leased[0] - run_at).num_milliseconds());
        // No stalled re-dispatch came before its time; the lease is an event of its own, or
        // said by the success of a run that ended inside its lease transaction.
        let kinds = event_kinds(&it, job_id).await;
        assert!(
            kinds == ["JobRequested", "JobLeased", "JobSucceeded"]
                || kinds == ["JobRequested", "JobSucceeded"],
            "{kinds:?}"
        );
    }
    assert_eq!(jobfold_common::gauges::read(&it.pool).await.unwrap().scheduled, 0);
    it.cleanup().await;
}

/// Sends an intake request for an `index-document` job of `document`.
async fn send_request(
    it: &Installation,
    request_id: Uuid,
    document: &str,
    run_at: Option<DateTime<Utc>>,
) {
    use jobfold_schemas::{Codec, JobRequest};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let codec: Codec<JobRequest> =
        Codec::connect(it.registry(), &it.config.topics.requests).await.unwrap();
    let request = JobRequest {
        request_id,
        document_id: document.into(),
        job_kind: "index-document".into(),
        input_version: 1,
        input: r#"{"text":"from upstream"}"#.into(),
        requested_at: Utc::now(),
        producer: "upstream".into(),
        trace: None,
        run_at,
    };
    let producer: FutureProducer = it.config.kafka_client().create().unwrap();
    let frame = codec.encode(&request).unwrap();
    let record = FutureRecord::to(&it.config.topics.requests).key(document).payload(&frame);
    producer.send(record, Duration::from_secs(30)).await.unwrap();
}

/// Paging through `GET /v1/jobs` returns every job that existed when it began exactly once,
/// in job id order, while jobs are being accepted; filters select what they name; and each
/// filter is served by an index on a table of 50,000 jobs (no sequential scan of `jobs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pages_return_every_job_once_while_jobs_are_accepted_and_each_filter_uses_an_index() {
    use jobfold_processor::status::{self, JobFilter, Order};
    let (it, acceptor) = installation("ops-find").await;
    let jobs: Vec<NewJob> = (0..600)
        .map(|i| {
            let mut j = job(&format!("doc-{}", i % 50), json!({ "text": "x" }));
            j.input_version = 1 + i64::from(i / 50);
            j
        })
        .collect();
    let mut before = HashSet::new();
    for chunk in jobs.chunks(100) {
        for accepted in acceptor.accept_batch(&it.pool, chunk).await.unwrap() {
            before.insert(accepted.job_id);
        }
    }
    // Only the HTTP API runs (no relay, no processor): every job stays queued.
    let api = jobfold_processor::http::router(it.api_state().await, 1 << 20);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, api).await });

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (pool, acceptor) = (it.pool.clone(), acceptor.clone());
        let stop = std::sync::Arc::clone(&stop);
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let more: Vec<NewJob> =
                    (0..5).map(|i| job(&format!("late-{n}-{i}"), json!({}))).collect();
                acceptor.accept_batch(&pool, &more).await.unwrap();
                n += 1;
                // 250 jobs a second: paging in acceptance order catches up with them.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            n * 5
        })
    };
    let page_through = |query: String| async move {
        let mut seen = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut url = format!("http://127.0.0.1:{port}/v1/jobs?limit=37{query}");
            if let Some(after) = &after {
                url.push_str(&format!("&after={after}"));
            }
            let page: Value = client().get(url).send().await.unwrap().json().await.unwrap();
            for j in page["jobs"].as_array().unwrap() {
                seen.push(j["job_id"].as_str().unwrap().parse::<Uuid>().unwrap());
            }
            match page["next"].as_str() {
                Some(next) => after = Some(next.to_owned()),
                None => return seen,
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    for query in ["", "&order=desc", "&state=queued&kind=index-document"] {
        let seen = page_through(query.to_owned()).await;
        let distinct: HashSet<Uuid> = seen.iter().copied().collect();
        assert_eq!(distinct.len(), seen.len(), "a job came twice ({query})");
        assert!(before.is_subset(&distinct), "a job was missed ({query})");
        let mut sorted = seen.clone();
        sorted.sort();
        if query.contains("desc") {
            sorted.reverse();
        }
        assert_eq!(seen, sorted, "pages out of order ({query})");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let added = writer.await.unwrap();
    assert!(added > 0, "no job was accepted while paging");

    let one_document = page_through("&document_id=doc-7".into()).await;
    assert_eq!(one_document.len(), 12);
    let since = Utc::now();
    let late = acceptor.accept(&it.pool, &job("after-since", json!({}))).await.unwrap().job_id;
    let since_query = format!("&since={}", since.to_rfc3339().replace('+', "%2B"));
    assert_eq!(page_through(since_query).await, [late]);
    let (status, body): (u16, Value) = {
        let a = client()
            .get(format!("http://127.0.0.1:{port}/v1/jobs?state=lost"))
            .send()
            .await
            .unwrap();
        (a.status().as_u16(), a.json().await.unwrap())
    };
    assert_eq!(status, 400, "{body}");

    // 50,000 more jobs, most of them ended, then the plans.
    sqlx::query(
        r#"
        INSERT INTO jobs (job_id, document_id, kind, payload, input_version, state, max_attempts,
                          stream_version, accepted_at, finished_at)
        SELECT id, 'bulk-' || (n % 5000), CASE WHEN n % 500 = 0 THEN 'rare-kind' ELSE 'index-document' END,
               '{}', 1 + n / 5000, CASE WHEN n % 100 = 0 THEN 'queued' ELSE 'succeeded' END::job_state,
               5, 1, now(), CASE WHEN n % 100 = 0 THEN NULL ELSE now() END
        FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, n)
        "#,
    )
    .bind((0..50_000).map(|_| Uuid::now_v7()).collect::<Vec<_>>())
    .execute(&it.pool)
    .await
    .unwrap();
    // Some of the queued ones quarantined, as the quarantine table holds them.
    sqlx::query(
        r#"
        WITH q AS (
            UPDATE jobs SET state = 'quarantined', finished_at = now()
            WHERE job_id IN (SELECT job_id FROM jobs WHERE state = 'queued' AND document_id LIKE 'bulk-%'
                             AND (input_version % 2) = 0)
            RETURNING job_id, input_version
        )
        INSERT INTO quarantine (job_id, reason, error_class, input_version, attempts, owner)
        SELECT job_id, 'permanent failure: x', 'PERMANENT', input_version, 1, 'team' FROM q
        "#,
    )
    .execute(&it.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE jobs, quarantine").execute(&it.pool).await.unwrap();
    let filters = [
        JobFilter::default(),
        JobFilter { order: Some(Order::Desc), ..Default::default() },
        JobFilter { kind: Some("rare-kind".into()), ..Default::default() },
        JobFilter { document_id: Some("bulk-42".into()), ..Default::default() },
        JobFilter { state: Some("queued".parse().unwrap()), ..Default::default() },
        JobFilter { state: Some("quarantined".parse().unwrap()), ..Default::default() },
        JobFilter { since: Some(since), ..Default::default() },
        JobFilter { after: Some(late), ..Default::default() },
    ];
    for filter in &filters {
        let plan = status::jobs_plan(&it.pool, filter).await.unwrap();
        assert!(!plan.contains("Seq Scan on jobs"), "{filter:?} scans jobs:\n{plan}");
        if filter.kind.is_some() {
            assert!(plan.contains("jobs_kind_idx"), "a rare kind is found by its index:\n{plan}");
        }
        println!("{filter:?}\n{plan}\n");
    }
    it.cleanup().await;
}

/// A thousand jobs quarantined for one reason are replayed in bulk by that reason — counted
/// first by a dry run that changes nothing, then by two operators at once — and each runs
/// exactly once more and succeeds; jobs quarantined for another reason stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bulk_replay_of_a_thousand_quarantined_jobs_runs_each_once() {
    let (it, acceptor) = installation("ops-bulk").await;
    let mut jobs: Vec<NewJob> = (0..1000)
        .map(|i| {
            job(
                &format!("doc-{i}"),
                json!({ "text": "x", "simulate": { "permanent_until_replayed": true } }),
            )
        })
        .collect();
    jobs.extend((0..50).map(|i| {
        job(&format!("other-{i}"), json!({ "text": "x", "simulate": { "permanent": true } }))
    }));
    for chunk in jobs.chunks(200) {
        acceptor.accept_batch(&it.pool, chunk).await.unwrap();
    }
    let running = Running::start(&it, TOKEN, &[]);
    running.ready().await;
    let quarantined = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM quarantine")
            .fetch_one(&it.pool)
            .await
            .unwrap()
    };
    eventually(Duration::from_secs(180), "every job to be quarantined", || async {
        quarantined().await == 1050
    })
    .await;

    let filter = json!({ "reason": "until replayed", "requested_by": "ops test" });
    let mut dry = filter.clone();
    dry["dry_run"] = json!(true);
    let (status, counted) = running.post("/v1/quarantine/replay", dry).await;
    assert_eq!(status, 200, "{counted}");
    assert_eq!((counted["matched"].as_i64(), counted["replayed"].as_i64()), (Some(1000), Some(0)));
    let said = cli(&it, &["quarantine", "replay", "--reason", "until replayed", "--dry-run"]);
    assert!(said.contains("1000 quarantined job(s) match"), "{said}");
    assert_eq!(quarantined().await, 1050, "a dry run replays nothing");

    let mut request = filter.clone();
    request["batch_size"] = json!(100);
    let (a, b) = tokio::join!(
        running.post("/v1/quarantine/replay", request.clone()),
        running.post("/v1/quarantine/replay", request)
    );
    assert_eq!((a.0, b.0), (200, 200), "{} {}", a.1, b.1);
    let replayed = a.1["replayed"].as_i64().unwrap() + b.1["replayed"].as_i64().unwrap();
    assert_eq!(replayed, 1000, "two bulk replays at once replay each job once: {} {}", a.1, b.1);
    assert!(a.1["batches"].as_i64().unwrap() + b.1["batches"].as_i64().unwrap() >= 10);

    eventually(Duration::from_secs(240), "every replayed job to succeed", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM jobs WHERE state = 'succeeded'")
            .fetch_one(&it.pool)
            .await
            .unwrap()
            == 1000
    })
    .await;
    // Leased twice: the generation counts every lease, whether its own event or its success's.
    let per_job: Vec<(i64, i64, i64)> = sqlx::query_as(
        r#"
        SELECT count(*) FILTER (WHERE e.kind = 'ReplayRequested'),
               min(j.generation),
               (SELECT count(*) FROM index_writes w WHERE w.job_id = j.job_id)
        FROM jobs j JOIN job_events e USING (job_id)
        WHERE j.document_id LIKE 'doc-%'
        GROUP BY j.job_id
        "#,
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert_eq!(per_job.len(), 1000);
    assert!(per_job.iter().all(|c| *c == (1, 2, 1)), "not once each: {:?}", &per_job[..5]);
    assert_eq!(quarantined().await, 50, "the other reason's jobs stay quarantined");
    it.cleanup().await;
}

/// An intake request of a kind no processor ran yet is dead-lettered; an operator lists it,
/// reads its bytes, deploys the kind, and re-injects it: it is accepted, once — re-injected
/// again, the intake's request id dedupes it. Then it is deleted. Only the intake's dead
/// letters go back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_reinjected_after_its_cause_is_fixed_is_accepted_once() {
    use jobfold_schemas::{Codec, JobRequest};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let (it, _) = installation("ops-dead").await;
    let running = Running::start(&it, TOKEN, &[]);
    running.ready().await;
    let codec: Codec<JobRequest> =
        Codec::connect(it.registry(), &it.config.topics.requests).await.unwrap();
    let request_id = Uuid::now_v7();
    let request = JobRequest {
        request_id,
        document_id: "doc-late".into(),
        job_kind: "late-kind".into(),
        input_version: 1,
        input: r#"{"text":"early"}"#.into(),
        requested_at: Utc::now(),
        producer: "upstream".into(),
        trace: None,
        run_at: None,
    };
    let producer: FutureProducer = it.config.kafka_client().create().unwrap();
    let frame = codec.encode(&request).unwrap();
    let record = FutureRecord::to(&it.config.topics.requests).key("doc-late").payload(&frame);
    producer.send(record, Duration::from_secs(30)).await.unwrap();

    let id = jobfold_tests::harness::eventually_some(
        Duration::from_secs(60),
        "the request to be dead-lettered",
        || async {
            let (_, page) = running.get("/v1/dead-letters").await;
            page["dead_letters"].as_array()?.first()?["id"].as_i64()
        },
    )
    .await;
    let (status, letter) = running.get(&format!("/v1/dead-letters/{id}")).await;
    assert_eq!(status, 200);
    assert!(letter["error"].as_str().unwrap().contains("late-kind"), "{letter}");
    assert_eq!(letter["key_text"], "doc-late");
    assert_eq!(letter["value_hex"].as_str().unwrap(), hex::encode(&frame));
    assert!(letter["value_text"].as_str().unwrap().contains("doc-late"), "{letter}");
    let listed = cli(&it, &["dead-letters", "list"]);
    assert!(listed.contains("late-kind"), "{listed}");
    let shown = cli(&it, &["dead-letters", "show", &id.to_string()]);
    assert!(shown.contains(&hex::encode(&frame)), "{shown}");

    // The fix: the kind's handler is deployed (it registers the kind).
    sqlx::query("INSERT INTO job_kinds (kind, registered_by) VALUES ('late-kind', 'deploy')")
        .execute(&it.pool)
        .await
        .unwrap();
    let key = format!("request:{request_id}");
    let jobs_of_it = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM jobs WHERE idempotency_key = $1")
            .bind(&key)
            .fetch_one(&it.pool)
            .await
            .unwrap()
    };
    for _ in 0..2 {
        let (status, sent) =
            running.post(&format!("/v1/dead-letters/{id}/reinject"), json!({})).await;
        assert_eq!(status, 202, "{sent}");
        assert_eq!(sent["topic"], it.config.topics.requests.as_str());
    }
    eventually(Duration::from_secs(60), "the re-injected request to be accepted", || async {
        jobs_of_it().await == 1
    })
    .await;
    eventually(Duration::from_secs(60), "the second copy to be recognised", || async {
        let text = running.processor.scrape().await.unwrap_or_default();
        metric_value(&text, "jobfold_intake_duplicates_total", &[]).unwrap_or(0.0) >= 1.0
    })
    .await;
    assert_eq!(jobs_of_it().await, 1, "accepted once");
    let (_, letter) = running.get(&format!("/v1/dead-letters/{id}")).await;
    assert_eq!(letter["reinjected_count"], 2);
    assert_eq!(it.count("dead_letters").await, 1, "no new dead letter");

    // An events-topic dead letter is not a request: refused.
    let other: i64 = sqlx::query_scalar(
        "INSERT INTO dead_letters (consumer_group, topic, kafka_partition, kafka_offset, raw_value, error) \
         VALUES ('g', $1, 0, 7, '\\x00'::bytea, 'undecodable') RETURNING id",
    )
    .bind(&it.config.topics.events)
    .fetch_one(&it.pool)
    .await
    .unwrap();
    let (status, _) = running.post(&format!("/v1/dead-letters/{other}/reinject"), json!({})).await;
    assert_eq!(status, 409);

    let unauthorized = client().delete(running.url(&format!("/v1/dead-letters/{id}"))).send().await;
    assert_eq!(unauthorized.unwrap().status().as_u16(), 401);
    let deleted = client()
        .delete(running.url(&format!("/v1/dead-letters/{id}")))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status().as_u16(), 204);
    assert_eq!(running.get(&format!("/v1/dead-letters/{id}")).await.0, 404);

    // In bulk: the events topic's letters (three more) counted first, then deleted in one
    // statement; the requests topic's are kept. An operator may not; an admin may.
    for offset in [8, 9, 10] {
        sqlx::query(
            "INSERT INTO dead_letters (consumer_group, topic, kafka_partition, kafka_offset, raw_value, error) \
             VALUES ('g', $1, 0, $2, '\\x00'::bytea, 'undecodable')",
        )
        .bind(&it.config.topics.events)
        .bind(offset)
        .execute(&it.pool)
        .await
        .unwrap();
    }
    let kept: i64 = sqlx::query_scalar(
        "INSERT INTO dead_letters (consumer_group, topic, kafka_partition, kafka_offset, raw_value, error) \
         VALUES ('g', $1, 0, 1, '\\x00'::bytea, 'undecodable') RETURNING id",
    )
    .bind(&it.config.topics.requests)
    .fetch_one(&it.pool)
    .await
    .unwrap();
    let bulk = |token: &'static str, dry_run: bool| {
        let url = running
            .url(&format!("/v1/dead-letters?topic={}&dry_run={dry_run}", it.config.topics.events));
        async move {
            let answer = client().delete(url).bearer_auth(token).send().await.unwrap();
            (answer.status().as_u16(), answer.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (status, _) = bulk(jobfold_tests::harness::OPERATE_TOKEN, false).await;
    assert_eq!(status, 403, "deleting needs admin");
    let (status, counted) = bulk(TOKEN, true).await;
    assert_eq!(status, 200);
    assert_eq!(counted, json!({ "matched": 4, "deleted": 0, "dry_run": true }));
    let letters = "SELECT count(*) FROM dead_letters";
    assert_eq!(sqlx::query_scalar::<_, i64>(letters).fetch_one(&it.pool).await.unwrap(), 5);
    let (status, done) = bulk(TOKEN, false).await;
    assert_eq!((status, done["deleted"].as_i64()), (200, Some(4)), "{done}");
    let left: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM dead_letters").fetch_all(&it.pool).await.unwrap();
    assert_eq!(left, vec![kept], "the requests topic's letter is kept");
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_log WHERE action = 'delete_dead_letters' AND actor = 'api_token'",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(audited, 1, "the delete is audited, the dry run is not");
    it.cleanup().await;
}

/// What each processor ran is kept per minute (kind_minutes): the Kinds API shows a kind's
/// open jobs, what ended over the hour and its times' quantiles from it, and the overview's
/// history the jobs accepted each minute. A graceful stop writes the minute so far.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kinds_and_the_overview_show_the_last_hour_from_what_processors_recorded() {
    let (it, acceptor) = installation("ops-history").await;
    let mut running = Running::start(&it, TOKEN, &[]);
    running.ready().await;
    let slow = |i: i64| {
        jobfold_tests::harness::index_job(
            &format!("doc-slow-{i}"),
            1,
            json!({ "text": "x", "simulate": { "sleep_ms": 300 } }),
        )
    };
    let mut jobs: Vec<NewJob> = (0..6).map(slow).collect();
    jobs.push(jobfold_tests::harness::index_job("doc-bad", 1, json!({ "title": "no text" })));
    let accepted_from = Utc::now();
    for job in &jobs {
        acceptor.accept(&it.pool, job).await.unwrap();
    }
    eventually(Duration::from_secs(60), "every job to end", || async {
        let open: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE finished_at IS NULL")
            .fetch_one(&it.pool)
            .await
            .unwrap();
        open == 0
    })
    .await;
    // A graceful stop writes the minute so far.
    running.processor.signal("TERM");
    assert!(running.processor.wait_exit(Duration::from_secs(60)).is_some_and(|s| s.success()));
    let (runs, succeeded, quarantined, run_ms): (i64, i64, i64, Vec<i32>) = sqlx::query_as(
        "SELECT sum(runs)::bigint, sum(succeeded)::bigint, sum(quarantined)::bigint, \
                (SELECT ARRAY(SELECT sum(b)::int FROM kind_minutes k2, unnest(k2.run_ms) \
                              WITH ORDINALITY u(b, i) WHERE k2.kind = 'index-document' \
                              GROUP BY i ORDER BY i)) \
         FROM kind_minutes WHERE kind = 'index-document'",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!((runs, succeeded, quarantined), (7, 6, 1));
    let bucket = jobfold_processor::history::bucket(Duration::from_millis(300));
    assert_eq!(run_ms[bucket], 6, "each 300 ms run in the ≤ 500 ms bucket: {run_ms:?}");

    running.restart_processor();
    running.ready().await;
    let (status, kinds) = running.get("/v1/kinds").await;
    assert_eq!(status, 200, "{kinds}");
    let kind = kinds["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["kind"] == "index-document")
        .unwrap_or_else(|| panic!("{kinds}"))
        .clone();
    assert_eq!(kind["ended"]["succeeded"], 6, "{kind}");
    assert_eq!(kind["ended"]["quarantined"], 1, "{kind}");
    assert_eq!(kind["ended"]["run_p50_ms"], 500, "{kind}");
    assert_eq!(kind["open"]["queued"], 0, "{kind}");
    assert!(kind["ended"]["wait_p99_ms"].as_i64().is_some(), "{kind}");
    // The CLI's table has the same figures: none open, 6 done and 1 quarantined in the hour,
    // runs at most 500 ms.
    let listed = cli(&it, &["kinds", "list"]);
    let line = listed
        .lines()
        .find(|l| l.starts_with("index-document "))
        .unwrap_or_else(|| panic!("{listed}"));
    let cells: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(cells[1..8], ["running", "0", "0", "0", "6", "0", "1"], "{listed}");
    assert_eq!(cells[9], "500/500", "{listed}");
    let (status, one) = running.get("/v1/kinds/index-document?minutes=10").await;
    assert_eq!(status, 200, "{one}");
    let series = one["series"].as_array().unwrap();
    let ran: i64 = series.iter().map(|p| p["succeeded"].as_i64().unwrap()).sum();
    assert_eq!(ran, 6, "{one}");
    assert_eq!(running.get("/v1/kinds/no-such-kind").await.0, 404);
    assert_eq!(running.get("/v1/history?minutes=0").await.0, 400);

    // The overview's minute: what was accepted in it, counted on the job ids.
    let minute = accepted_from.duration_trunc(chrono::TimeDelta::minutes(1)).unwrap();
    let last = Utc::now().duration_trunc(chrono::TimeDelta::minutes(1)).unwrap();
    let mut at = minute;
    while at <= last {
        jobfold_processor::history::write_overview(&it.pool, at).await.unwrap();
        at += chrono::TimeDelta::minutes(1);
    }
    let (status, history) = running.get("/v1/history?minutes=30").await;
    assert_eq!(status, 200, "{history}");
    let points = history["points"].as_array().unwrap();
    let accepted: i64 = points.iter().map(|p| p["accepted"].as_i64().unwrap()).sum();
    let ended: i64 = points.iter().map(|p| p["succeeded"].as_i64().unwrap()).sum();
    assert_eq!((accepted, ended), (7, 6), "{history}");
    it.cleanup().await;
}

/// Pausing a kind holds its jobs in every processor — passed over unleased, their attempts
/// unspent, their documents' other jobs not held behind them — until it resumes; then each
/// runs once. The pause and the resume are logged with who and why; repeating either
/// changes nothing; an unknown kind is 404 naming the known ones; without the token, 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_kind_waits_unleased_while_its_documents_other_jobs_run_then_runs_once() {
    let (it, acceptor) = installation("ops-pause").await;
    let running = Running::start_examples(&it, TOKEN, &[("JOBFOLD_PROCESSOR__STALL_AFTER", "1s")]);
    running.ready().await;
    eventually(Duration::from_secs(60), "the examples' kinds to be registered", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM job_kinds WHERE kind = 'noop'")
            .fetch_one(&it.pool)
            .await
            .unwrap()
            == 1
    })
    .await;

    let unauthorized = client().post(running.url("/v1/kinds/noop/pause")).send().await.unwrap();
    assert_eq!(unauthorized.status().as_u16(), 401);
    let (status, body) = running.post("/v1/kinds/no-such-kind/pause", json!({})).await;
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("unknown_kind")), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("\"noop\""), "{body}");
    let control = json!({ "reason": "the provider is down", "requested_by": "ops test" });
    let (status, body) = running.post("/v1/kinds/noop/pause", control.clone()).await;
    assert_eq!((status, &body["paused"], &body["was_paused"]), (200, &json!(true), &json!(false)));
    let (status, body) = running.post("/v1/kinds/noop/pause", control).await;
    assert_eq!((status, &body["was_paused"]), (200, &json!(true)), "a pause repeated: {body}");
    eventually(Duration::from_secs(30), "the processor to hold noop paused", || async {
        let text = running.processor.scrape().await.unwrap_or_default();
        metric_value(&text, "jobfold_kind_paused", &[("kind", "noop")]) == Some(1.0)
    })
    .await;

    // Each document gets a noop job, then an index-document job behind it.
    let mut paused = Vec::new();
    let mut others = Vec::new();
    for i in 0..20 {
        let document = format!("doc-pause-{i}");
        let mut noop = job(&document, json!({}));
        noop.kind = "noop".into();
        paused.push(acceptor.accept(&it.pool, &noop).await.unwrap().job_id);
        others.push(acceptor.accept(&it.pool, &job(&document, json!({ "text": "t" }))).await);
    }
    let others: Vec<Uuid> = others.into_iter().map(|a| a.unwrap().job_id).collect();
    eventually(Duration::from_secs(60), "every noop dispatch to be passed over", || async {
        let text = running.processor.scrape().await.unwrap_or_default();
        metric_value(&text, "jobfold_paused_passed_over_total", &[("kind", "noop")]).unwrap_or(0.0)
            >= 20.0
    })
    .await;
    eventually(Duration::from_secs(60), "the documents' other jobs to succeed", || async {
        for job_id in &others {
            if state(&it, *job_id).await != "succeeded" {
                return false;
            }
        }
        true
    })
    .await;
    for job_id in &paused {
        assert_eq!(it.state_and_attempt(*job_id).await, ("queued".into(), 0), "{job_id}");
    }
    let (status, body) = running.get("/v1/kinds").await;
    assert_eq!(status, 200);
    let noop = body["kinds"].as_array().unwrap().iter().find(|k| k["kind"] == "noop").unwrap();
    assert_eq!(
        (&noop["paused"], &noop["waiting"], &noop["paused_by"], &noop["reason"]),
        (&json!(true), &json!(20), &json!("api_token"), &json!("the provider is down")),
        "{body}"
    );

    // Resumed from the command line: each waiting job is dispatched again and runs once.
    let said = cli(&it, &["kinds", "resume", "noop", "--reason", "it is back", "--by", "cli"]);
    assert!(said.contains("noop resumed; 20 jobs that waited dispatched again"), "{said}");
    eventually(Duration::from_secs(60), "the paused jobs to succeed", || async {
        for job_id in &paused {
            if state(&it, *job_id).await != "succeeded" {
                return false;
            }
        }
        true
    })
    .await;
    for job_id in &paused {
        assert_eq!(it.state_and_attempt(*job_id).await.1, 1, "{job_id} ran more than once");
        assert_eq!(
            count(
                &it,
                "SELECT count(*) FROM job_events WHERE job_id = $1 AND kind = 'JobFailed'",
                *job_id
            )
            .await,
            0
        );
    }
    let said = cli(&it, &["kinds", "resume", "noop"]);
    assert!(said.contains("noop was not paused; 0 jobs"), "{said}");
    let listed = cli(&it, &["kinds", "list"]);
    assert!(listed.lines().any(|l| l.starts_with("noop ") && l.contains("running")), "{listed}");
    let log: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT action, by_whom, reason FROM kind_pause_log WHERE kind = 'noop' ORDER BY id",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert_eq!(
        log,
        [
            ("pause".into(), "api_token".into(), Some("the provider is down".into())),
            ("resume".into(), "cli".into(), Some("it is back".into())),
        ]
    );
    // The audit trail: the API's change as the token's name, the CLI's as its OS user.
    let audit: Vec<(String, String, String, Option<String>)> = sqlx::query_as(
        "SELECT action, actor, via, role FROM audit_log WHERE target = 'noop' ORDER BY id",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert_eq!(audit.len(), 4, "{audit:?}");
    assert_eq!(
        audit[0],
        ("pause_kind".into(), "api_token".into(), "api".into(), Some("admin".into()))
    );
    let by_cli = &audit[2];
    assert_eq!((by_cli.0.as_str(), by_cli.2.as_str(), &by_cli.3), ("resume_kind", "cli", &None));
    assert!(by_cli.1.starts_with("os:") || by_cli.1.starts_with("uid "), "{audit:?}");
    assert_eq!(it.count("paused_dispatches").await, 0);
    let mismatches = jobfold_tests::harness::fold_mismatches(&it).await;
    assert!(mismatches.is_empty(), "{mismatches:?}");
    it.cleanup().await;
}

/// A job whose worker died while its kind was paused: the reaper's dispatch for the expired
/// lease is passed over like any other, and the resume dispatches it again — the reaper
/// itself looks at the job only `processor.stall_after` (an hour here) later, so a resume
/// that took the expired lease for a live one would leave it for that hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_that_expired_while_its_kind_was_paused_is_dispatched_on_resume() {
    let (it, acceptor) = installation("ops-pause-expired").await;
    let running = Running::start(&it, TOKEN, &[("JOBFOLD_PROCESSOR__STALL_AFTER", "1h")]);
    running.ready().await;
    let kind = jobfold_tests::handlers::KIND;
    let (status, body) = running.post(&format!("/v1/kinds/{kind}/pause"), json!({})).await;
    assert_eq!(status, 200, "{body}");
    let passed_over = || async {
        let text = running.processor.scrape().await.unwrap_or_default();
        metric_value(&text, "jobfold_paused_passed_over_total", &[("kind", kind)]).unwrap_or(0.0)
    };
    eventually(Duration::from_secs(30), "the processor to hold the kind paused", || async {
        let text = running.processor.scrape().await.unwrap_or_default();
        metric_value(&text, "jobfold_kind_paused", &[("kind", kind)]) == Some(1.0)
    })
    .await;

    // Leased for a second by a worker that is gone at once (the processor's own lease
    // transaction, under another owner).
    let job_id = acceptor.accept(&it.pool, &job("doc-expired", json!({ "text": "t" }))).await;
    let job_id = job_id.unwrap().job_id;
    let events = it.events().await;
    let mut tx = it.pool.begin().await.unwrap();
    let mut jobs = store::lock_jobs(&mut tx, &[job_id]).await.unwrap();
    store::take_leases(
        &mut tx,
        &events,
        vec![(&mut jobs[0], Uuid::now_v7(), None)],
        "gone/1",
        |_| Duration::from_secs(1),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // Both dispatches passed over: the acceptance's, then the reaper's for the expired lease.
    eventually(Duration::from_secs(60), "the reaper's dispatch to be passed over", || async {
        passed_over().await >= 2.0
    })
    .await;
    let reaped = "SELECT count(*) FROM job_events WHERE job_id = $1 AND kind = 'RetryDue'";
    assert_eq!(count(&it, reaped, job_id).await, 1);
    assert_eq!(it.state_and_attempt(job_id).await, ("leased".into(), 1));

    let (status, body) = running.post(&format!("/v1/kinds/{kind}/resume"), json!({})).await;
    assert_eq!((status, &body["dispatched"]), (200, &json!(1)), "{body}");
    eventually(Duration::from_secs(60), "the job to succeed after the resume", || async {
        state(&it, job_id).await == "succeeded"
    })
    .await;
    let writes = count(&it, "SELECT count(*) FROM index_writes WHERE job_id = $1", job_id);
    assert_eq!(writes.await, 1);
    assert_eq!(it.count("paused_dispatches").await, 0);
    let mismatches = jobfold_tests::harness::fold_mismatches(&it).await;
    assert!(mismatches.is_empty(), "{mismatches:?}");
    it.cleanup().await;
}

/// Run-now brings a job scheduled an hour away, and one whose retry is an hour away, forward:
/// each runs at once and once (no attempt spent on the way), the dispatches that waited for
/// the old times go out early and are passed over. Any other state is 409 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_now_brings_a_scheduled_job_and_a_waiting_retry_forward_each_once() {
    let (it, acceptor) = installation("ops-run-now").await;
    let running = Running::start(&it, TOKEN, &[]);
    running.ready().await;
    let in_an_hour = || Some(Utc::now() + chrono::Duration::hours(1));
    let mut scheduled = job("doc-now-1", json!({ "text": "scheduled" }));
    scheduled.run_at = in_an_hour();
    let scheduled = acceptor.accept(&it.pool, &scheduled).await.unwrap().job_id;
    // Scheduled too, so that no processor leases it before it waits to retry.
    let mut retry = job("doc-now-2", json!({ "text": "retry" }));
    retry.run_at = in_an_hour();
    let retry = acceptor.accept(&it.pool, &retry).await.unwrap().job_id;
    into_retry_wait(&it, retry).await;
    assert_eq!(it.state_and_attempt(scheduled).await, ("queued".into(), 0));
    assert_eq!(it.state_and_attempt(retry).await, ("retry_wait".into(), 1));

    let unauthorized =
        client().post(running.url(&format!("/v1/jobs/{scheduled}/run-now"))).send().await.unwrap();
    assert_eq!(unauthorized.status().as_u16(), 401);
    let (status, body) = running.post(&format!("/v1/jobs/{scheduled}/run-now"), json!({})).await;
    assert_eq!((status, &body["waited"]), (200, &json!("scheduled")), "{body}");
    let said = cli(&it, &["run-now", &retry.to_string()]);
    assert!(said.contains("was waiting to retry: dispatched now"), "{said}");

    for (job_id, attempts) in [(scheduled, 1), (retry, 2)] {
        eventually(Duration::from_secs(60), "the job brought forward to succeed", || async {
            state(&it, job_id).await == "succeeded"
        })
        .await;
        assert_eq!(it.state_and_attempt(job_id).await.1, attempts, "{job_id}");
        let writes = count(&it, "SELECT count(*) FROM index_writes WHERE job_id = $1", job_id);
        assert_eq!(writes.await, 1, "{job_id} committed more than once");
    }
    let (status, body) = running.post(&format!("/v1/jobs/{scheduled}/run-now"), json!({})).await;
    assert_eq!((status, body["error"]["state"].as_str()), (409, Some("succeeded")), "{body}");
    let (status, _) =
        running.post(&format!("/v1/jobs/{}/run-now", Uuid::now_v7()), json!({})).await;
    assert_eq!(status, 404);
    // The dispatches that waited for the old times went out early, behind nothing.
    eventually(Duration::from_secs(60), "the delayed dispatches on Kafka", || async {
        it.unpublished().await == 0
    })
    .await;
    let mismatches = jobfold_tests::harness::fold_mismatches(&it).await;
    assert!(mismatches.is_empty(), "{mismatches:?}");
    it.cleanup().await;
}

/// A bad deploy's 300 jobs cancelled by their kind: a dry run counts them and changes
/// nothing; a bulk cancel takes them 100 to a transaction up to its limit and says what is
/// left; the command line takes the rest. Each gets one `JobCancelled`; the other kinds' jobs
/// run untouched. No filter, or a state that is not open, is 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bulk_cancel_by_kind_counts_first_then_cancels_each_open_job_once() {
    let (it, acceptor) = installation("ops-bulk-cancel").await;
    sqlx::query("INSERT INTO job_kinds (kind, registered_by) VALUES ('wrong-kind', 'bad deploy')")
        .execute(&it.pool)
        .await
        .unwrap();
    let running = Running::start(&it, TOKEN, &[]);
    running.ready().await;
    let wrong: Vec<NewJob> = (0..300)
        .map(|i| {
            let mut j = job(&format!("doc-wrong-{i}"), json!({}));
            j.kind = "wrong-kind".into();
            j
        })
        .collect();
    for chunk in wrong.chunks(100) {
        acceptor.accept_batch(&it.pool, chunk).await.unwrap();
    }
    let mut right = Vec::new();
    for i in 0..5 {
        let j = job(&format!("doc-right-{i}"), json!({ "text": "right" }));
        right.push(acceptor.accept(&it.pool, &j).await.unwrap().job_id);
    }
    let cancelled = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM job_events e JOIN jobs j USING (job_id) \
             WHERE j.kind = 'wrong-kind' AND e.kind = 'JobCancelled'",
        )
        .fetch_one(&it.pool)
        .await
        .unwrap()
    };

    let (status, body) = running.post("/v1/jobs/cancel", json!({})).await;
    assert_eq!((status, body["error"]["code"].as_str()), (422, Some("invalid_field")), "{body}");
    let (status, _) = running.post("/v1/jobs/cancel", json!({ "state": "succeeded" })).await;
    assert_eq!(status, 422);
    let (status, body) =
        running.post("/v1/jobs/cancel", json!({ "kind": "wrong-kind", "dry_run": true })).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!((&body["matched"], &body["cancelled"]), (&json!(300), &json!(0)), "{body}");
    assert_eq!(cancelled().await, 0, "a dry run cancelled something");

    let request = json!({
        "kind": "wrong-kind", "batch_size": 100, "limit": 250,
        "reason": "a bad deploy", "requested_by": "ops test",
    });
    let (status, body) = running.post("/v1/jobs/cancel", request).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (&body["matched"], &body["cancelled"], &body["batches"], &body["remaining"]),
        (&json!(300), &json!(250), &json!(3), &json!(50)),
        "{body}"
    );
    let said = cli(&it, &["cancel", "--kind", "wrong-kind", "--reason", "a bad deploy"]);
    assert!(said.contains("50 of 50 jobs cancelled"), "{said}");
    assert!(said.contains("0 still match"), "{said}");
    assert_eq!(cancelled().await, 300, "each wrong job cancelled exactly once");
    // Each bulk cancel, not the dry run, in the audit trail with its filter and counts.
    type Row = (String, String, String, Option<String>, Option<String>);
    let audited: Vec<Row> = sqlx::query_as(
        "SELECT actor, via, coalesce(role, ''), detail->'done'->>'cancelled', \
                coalesce(detail->'request'->>'kind', detail->'request'->'filter'->>'kind') \
         FROM audit_log WHERE action = 'cancel_matching' ORDER BY id",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert_eq!(audited.len(), 2, "{audited:?}");
    assert_eq!(
        audited[0],
        (
            "api_token".into(),
            "api".into(),
            "admin".into(),
            Some("250".into()),
            Some("wrong-kind".into())
        )
    );
    assert_eq!((audited[1].1.as_str(), audited[1].3.as_deref()), ("cli", Some("50")));
    assert_eq!(audited[1].4.as_deref(), Some("wrong-kind"));
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM jobs WHERE kind = 'wrong-kind' AND state <> 'cancelled'",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(open, 0);
    for job_id in right {
        eventually(Duration::from_secs(60), "the other kind's job to succeed", || async {
            state(&it, job_id).await == "succeeded"
        })
        .await;
    }
    let mismatches = jobfold_tests::harness::fold_mismatches(&it).await;
    assert!(mismatches.is_empty(), "{mismatches:?}");
    it.cleanup().await;
}

/// A schedule of every second, run by two processors, through a kill -9 of the one holding
/// it: exactly one job per tick, none missing and none twice — the survivor takes the
/// schedules once the dead one's lease runs out and accepts the ticks passed meanwhile,
/// late. The API and the command line show the next tick. `PERIODIC_TEST_SECS`
/// runs it longer (20 s by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_schedule_of_every_second_makes_one_job_per_tick_through_a_kill_of_its_holder() {
    use jobfold_tests::harness::{Service, free_port, http_client};
    let (it, _) = installation("ops-periodic").await;
    let file = std::env::temp_dir().join(format!("periodic-{}.toml", Uuid::new_v4().simple()));
    std::fs::write(
        &file,
        "[periodic.tick]\nkind = \"index-document\"\ncron = \"* * * * * *\"\n\
         input = { text = \"tick\" }\n",
    )
    .unwrap();
    let mut env = it.fast_env(&it.config.processor.group);
    env.insert("JOBFOLD_CONFIG".into(), file.display().to_string());
    let _relay = Service::start("jobfold-relay", &env);
    let start = |env: &std::collections::HashMap<String, String>| {
        let mut env = env.clone();
        let http = free_port();
        env.insert("JOBFOLD_HTTP_ADDR".into(), format!("127.0.0.1:{http}"));
        (Service::start("jobfold-test-processor", &env), http)
    };
    let mut processors = vec![start(&env), start(&env)];
    let secs: u64 =
        std::env::var("PERIODIC_TEST_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let ticks = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT input_version FROM jobs WHERE document_id = 'periodic/tick' \
             ORDER BY input_version",
        )
        .fetch_all(&it.pool)
        .await
        .unwrap()
    };
    let holder = || async {
        sqlx::query_scalar::<_, String>("SELECT holder FROM periodic_leader WHERE id = 1")
            .fetch_optional(&it.pool)
            .await
            .unwrap()
            .and_then(|h| h.rsplit('/').next().and_then(|pid| pid.parse::<u32>().ok()))
    };
    eventually(Duration::from_secs(60), "the first ticks' jobs", || async {
        ticks().await.len() >= 3
    })
    .await;
    tokio::time::sleep(Duration::from_secs(secs / 2)).await;
    let pid = holder().await.expect("a holder");
    let dead = processors.iter().position(|(p, _)| p.pid() == pid).expect("the holder is ours");
    let (mut killed, _) = processors.remove(dead);
    killed.kill9();
    let killed_at = Utc::now().timestamp();
    let (survivor, http) = &processors[0];
    eventually(Duration::from_secs(60), "the survivor to hold the schedules", || async {
        holder().await == Some(survivor.pid())
    })
    .await;
    // Past the dead holder's lease (3 s here) and then some: ticks it never saw.
    eventually(Duration::from_secs(60), "jobs for ticks after the kill", || async {
        ticks().await.last().is_some_and(|t| *t >= killed_at + 6)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(secs / 2)).await;

    let ticks = ticks().await;
    assert!(ticks.len() as u64 >= secs, "{} ticks in {secs} s", ticks.len());
    for pair in ticks.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            1,
            "ticks {} then {}: one missing or twice",
            pair[0],
            pair[1]
        );
    }
    let keys: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT idempotency_key) FROM jobs WHERE document_id = 'periodic/tick'",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(keys as usize, ticks.len(), "each tick's job has its tick's key");
    let answer: Value = http_client()
        .get(format!("http://127.0.0.1:{http}/v1/periodic"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let schedule = &answer["schedules"][0];
    assert_eq!(schedule["name"], "tick", "{answer}");
    let next: DateTime<Utc> = schedule["next_tick"].as_str().unwrap().parse().unwrap();
    assert!(next > Utc::now() - chrono::Duration::seconds(1), "{answer}");
    assert!(schedule["holder"].as_str().unwrap().ends_with(&format!("/{}", survivor.pid())));
    let listed = jobfold_tests::harness::jobfold_cli()
        .envs(it.env())
        .env("JOBFOLD_CONFIG", &file)
        .arg("periodic")
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.lines().any(|l| l.starts_with("tick ")), "{listed}");
    std::fs::remove_file(&file).ok();
    it.cleanup().await;
}
