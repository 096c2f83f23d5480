//! Provider quotas, with two shipped processors in one group over real Postgres, Kafka and
//! the registry, and a server on 127.0.0.1 standing in for the provider:
//!
//! - a kind's `rate_per_second` and `cost_per_minute` hold for the group as a whole: in
//!   every stretch of time, the provider sees no more requests and no more cost than the
//!   token buckets allow, though both processors call it;
//! - a 429 holds the whole kind back for its `Retry-After`, in both processors, and the
//!   throttled jobs succeed later on their first attempt's budget (`max_attempts = 1`);
//! - a job waiting for its kind's quota holds none of the processor's slots: other kinds run
//!   meanwhile, even with one slot in all;
//! - a redelivered dispatch takes no quota.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use jobfold_common::accept::NewJob;
use jobfold_tests::harness::{Installation, eventually, fold_mismatches, metric_value};
use serde_json::{Value, json};
use uuid::Uuid;

/// When the provider saw each call (its own clock, seconds since the first), and its cost.
type Calls = Arc<Mutex<Vec<(f64, u64)>>>;

/// The provider: `/metered` answers 200 to every call; `/busy` answers 429 with
/// `Retry-After: 2` to its calls number 6 and 7, and 200 to the others.
async fn provider() -> (String, Calls, Calls) {
    let (metered, busy): (Calls, Calls) = Default::default();
    let (m, b) = (Arc::clone(&metered), Arc::clone(&busy));
    let start = std::time::Instant::now();
    let app = axum::Router::new()
        .route(
            "/metered",
            axum::routing::post(move |body: axum::Json<Value>| async move {
                let cost = body["input"]["tokens"].as_u64().unwrap_or(1);
                m.lock().unwrap().push((start.elapsed().as_secs_f64(), cost));
                axum::Json(json!({"ok": true}))
            }),
        )
        .route(
            "/busy",
            axum::routing::post(move || async move {
                let call = {
                    let mut calls = b.lock().unwrap();
                    calls.push((start.elapsed().as_secs_f64(), 1));
                    calls.len()
                };
                if (6..=7).contains(&call) {
                    (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "2")], "slow down")
                        .into_response()
                } else {
                    axum::Json(json!({"ok": true})).into_response()
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, metered, busy)
}

fn job(kind: &str, n: usize, input: Value) -> NewJob {
    NewJob {
        document_id: format!("{kind}-{n}"),
        kind: kind.into(),
        input_version: 1,
        input,
        idempotency_key: None,
        trace: None,
        run_at: None,
    }
}

async fn succeeded(it: &Installation, kind: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = $1 AND state = 'succeeded'")
        .bind(kind)
        .fetch_one(&it.pool)
        .await
        .unwrap()
}

/// A token bucket of `cap` refilled at `rate` a second lets at most `cap + rate * T` through
/// in any stretch of length T. Checked for every stretch between two calls, with a second
/// of slack for a call's way from its grant to the provider: the quota is taken before the
/// lease, whose shared transaction comes between — in a debug build on a machine loaded by
/// the rest of the suite, a fresh processor's first calls once reached the provider 0.5 s
/// after their grants. The slack is worth two calls at the limits below; a bucket per
/// processor instead of one for the group would let twice the rate through, far past it.
fn within_bucket(calls: &[(f64, u64)], cap: f64, rate: f64, amount: impl Fn(u64) -> f64) {
    for i in 0..calls.len() {
        let mut sum = 0.0;
        for j in i..calls.len() {
            sum += amount(calls[j].1);
            let stretch = calls[j].0 - calls[i].0 + 1.0;
            assert!(
                sum <= cap + rate * stretch + 1e-9,
                "calls {i}..={j}: {sum} in {stretch:.3} s, past the bucket ({cap} + {rate}/s): {calls:?}"
            );
        }
    }
}

/// 14 jobs of 10 tokens against 2 requests a second and 120 tokens a minute (2 a second):
/// the first dozen go at the request rate, the rest at the token rate. Both processors
/// take quota; the provider never sees more than either bucket allows (without the
/// limits, all 14 would come within a second and fail both checks).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kinds_rate_limits_hold_across_the_processors_of_a_group() {
    let it = Installation::new("quota_rate").await;
    it.create_topics().await;
    let (url, metered, _) = provider().await;
    let group = it
        .start_group(
            "quota",
            &format!(
                "[kinds.metered]\nurl = \"{url}/metered\"\nrate_per_second = 2\n\
             cost_per_minute = 120\ncost_pointer = \"/tokens\"\n"
            ),
            2,
        )
        .await;
    let acceptor = it.acceptor().await;
    let jobs: Vec<NewJob> = (0..14).map(|n| job("metered", n, json!({"tokens": 10}))).collect();
    acceptor.accept_batch(&it.pool, &jobs).await.unwrap();
    eventually(Duration::from_secs(90), "every metered job to succeed", || async {
        succeeded(&it, "metered").await == 14
    })
    .await;
    let calls = metered.lock().unwrap().clone();
    assert_eq!(calls.len(), 14, "each job called once");
    within_bucket(&calls, 2.0, 2.0, |_| 1.0);
    within_bucket(&calls, 120.0, 2.0, |cost| cost as f64);
    // Both processors took their share of the one quota.
    let mut taken = Vec::new();
    for processor in &group.processors {
        let text = processor.scrape().await.unwrap_or_default();
        let labels = [("kind", "metered"), ("unit", "requests")];
        taken.push(metric_value(&text, "jobfold_quota_taken_total", &labels).unwrap_or(0.0));
    }
    assert!(taken.iter().all(|t| *t > 0.0), "requests taken by each processor: {taken:?}");
    assert_eq!(taken.iter().sum::<f64>(), 14.0);
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    drop(group);
    it.cleanup().await;
}

/// The provider answers 429 (Retry-After: 2) to two calls of a kind limited to 4 a second:
/// no call of the kind comes from either processor between 1 s after the first 429 (what
/// was already on its way; on a loaded machine a call sent just before the 429 was answered
/// was seen arriving 0.64 s after it) and the pause's end, although the rate alone would have sent
/// several; the kind's rate halves; and every job succeeds although its
/// budget is one attempt — on attempt 1, with the log folding cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_429_holds_the_kind_back_everywhere_without_spending_attempts() {
    let it = Installation::new("quota_429").await;
    it.create_topics().await;
    let (url, _, busy) = provider().await;
    let group = it
        .start_group(
            "quota",
            &format!("[kinds.busy]\nurl = \"{url}/busy\"\nrate_per_second = 4\nmax_attempts = 1\n"),
            2,
        )
        .await;
    let acceptor = it.acceptor().await;
    let jobs: Vec<NewJob> = (0..16).map(|n| job("busy", n, json!({}))).collect();
    let ids: Vec<Uuid> =
        acceptor.accept_batch(&it.pool, &jobs).await.unwrap().iter().map(|a| a.job_id).collect();
    eventually(Duration::from_secs(90), "every busy job to succeed", || async {
        succeeded(&it, "busy").await == 16
    })
    .await;
    let calls = busy.lock().unwrap().clone();
    assert_eq!(calls.len(), 18, "16 jobs, two of them called twice: {calls:?}");
    let throttled_at = calls[5].0;
    let quiet: Vec<f64> = calls
        .iter()
        .map(|c| c.0 - throttled_at)
        .filter(|after| (1.0..1.9).contains(after))
        .collect();
    assert!(quiet.is_empty(), "calls during the pause, seconds after the 429: {quiet:?}");
    for id in &ids {
        assert_eq!(it.state_and_attempt(*id).await, ("succeeded".into(), 1));
    }
    let (throttles, factor): (i64, f64) =
        sqlx::query_as("SELECT throttles, factor FROM kind_quotas WHERE kind = 'busy'")
            .fetch_one(&it.pool)
            .await
            .unwrap();
    assert_eq!(throttles, 2);
    assert!(factor <= 0.5, "the kind's rate after the 429s: {factor}");
    // As the Kinds API and page show it.
    let shown = jobfold_processor::quota::throttles(&it.pool).await.unwrap();
    let busy_throttle = &shown["busy"];
    assert_eq!(busy_throttle.throttles, 2, "{shown:?}");
    assert!(busy_throttle.factor <= 1.0 && busy_throttle.throttled_at.is_some(), "{shown:?}");
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    let mut throttled = HashMap::new();
    for (i, processor) in group.processors.iter().enumerate() {
        let text = processor.scrape().await.unwrap_or_default();
        throttled.insert(i, metric_value(&text, "jobfold_throttled_total", &[("kind", "busy")]));
    }
    assert_eq!(throttled.values().map(|t| t.unwrap_or(0.0)).sum::<f64>(), 2.0, "{throttled:?}");
    drop(group);
    it.cleanup().await;
}

/// One processor with one slot in all (`max_in_flight = 1`), a kind limited to one call in
/// 100 s and a kind with no limit. Of the limited kind's two jobs, the one that runs first
/// takes the bucket's one token; the other waits for the next. Meanwhile every job of the
/// other kind runs, and the waiting job is still unleased (attempt 0) when they are done.
/// Were the quota taken while holding the process's slot, the waiting job would hold the
/// only one for 100 s, and the other kind's jobs could run only after it was leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_waiting_for_quota_holds_no_process_slot() {
    let it = Installation::new("quota_slot").await;
    it.create_topics().await;
    let (url, metered, _) = provider().await;
    let group = it
        .start_group(
            "quota",
            &format!(
                "[processor]\nmax_in_flight = 1\n\n[kinds.limited]\nurl = \"{url}/metered\"\n\
             rate_per_second = 0.01\n\n[kinds.free]\nurl = \"{url}/metered\"\n"
            ),
            1,
        )
        .await;
    let acceptor = it.acceptor().await;
    let limited: Vec<NewJob> = (0..2).map(|n| job("limited", n, json!({}))).collect();
    let limited: Vec<Uuid> =
        acceptor.accept_batch(&it.pool, &limited).await.unwrap().iter().map(|a| a.job_id).collect();
    eventually(Duration::from_secs(60), "the first limited job to succeed", || async {
        succeeded(&it, "limited").await == 1
    })
    .await;
    // The second limited job is now at its kind's quota, which refills in 100 s.
    let free: Vec<NewJob> = (0..5).map(|n| job("free", n, json!({}))).collect();
    acceptor.accept_batch(&it.pool, &free).await.unwrap();
    eventually(Duration::from_secs(150), "every free job to succeed", || async {
        succeeded(&it, "free").await == 5
    })
    .await;
    // Either limited job may have been the first to run: the two are different documents.
    let mut states = Vec::new();
    for id in &limited {
        states.push(it.state_and_attempt(*id).await);
    }
    states.sort();
    assert_eq!(
        states,
        vec![("queued".into(), 0), ("succeeded".into(), 1)],
        "one limited job ran; the other still waits for its quota, unleased"
    );
    let text = group.processor().scrape().await.unwrap_or_default();
    assert_eq!(metric_value(&text, "jobfold_quota_waiting", &[("kind", "limited")]), Some(1.0));
    assert_eq!(metered.lock().unwrap().len(), 6, "one limited call and five free ones");
    drop(group);
    it.cleanup().await;
}

/// A redelivered dispatch takes no quota: a rebalance re-reading a partition's finished work
/// (its offsets trail its slowest document) would otherwise spend the provider's requests on
/// jobs already done, taken from the work still to do. Every event of five finished jobs
/// goes out again; the processor skips their five dispatches as duplicates, and the quota
/// its kind has taken stays where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redelivered_dispatch_takes_no_quota() {
    let it = Installation::new("quota_dup").await;
    it.create_topics().await;
    let (url, metered, _) = provider().await;
    let kinds = format!("[kinds.limited]\nurl = \"{url}/metered\"\nrate_per_second = 1000\n");
    let group = it.start_group("quota", &kinds, 1).await;
    let acceptor = it.acceptor().await;
    let jobs: Vec<NewJob> = (0..5).map(|n| job("limited", n, json!({}))).collect();
    acceptor.accept_batch(&it.pool, &jobs).await.unwrap();
    eventually(Duration::from_secs(60), "the jobs to succeed", || async {
        succeeded(&it, "limited").await == 5
    })
    .await;
    eventually(Duration::from_secs(30), "their events to go out", || async {
        it.unpublished().await == 0
    })
    .await;
    let processor = group.processor();
    let counters = || async {
        let text = processor.scrape().await.unwrap_or_default();
        let requests = [("kind", "limited"), ("unit", "requests")];
        (
            metric_value(&text, "jobfold_quota_taken_total", &requests).unwrap_or(0.0),
            metric_value(&text, "jobfold_duplicates_skipped_total", &[]).unwrap_or(0.0),
        )
    };
    let (taken, skipped) = counters().await;
    assert!(taken >= 5.0, "each job took a request: {taken}");
    it.republish_last(it.count("job_events").await).await;
    eventually(
        Duration::from_secs(60),
        "the five redelivered dispatches to be skipped",
        || async { counters().await.1 >= skipped + 5.0 },
    )
    .await;
    assert_eq!(counters().await.0, taken, "a redelivered dispatch took quota");
    assert_eq!(metered.lock().unwrap().len(), 5, "no job was called again");
    drop(group);
    it.cleanup().await;
}
