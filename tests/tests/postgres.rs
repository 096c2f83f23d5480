//! Postgres as production runs it: a primary with a synchronous standby, failed over, switched
//! over and losing its standby under load, and jobfold finding the primary by itself; and the
//! start-up check that refuses a primary without a synchronous standby.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use jobfold_tests::harness::{
    Installation, Running, Service, eventually, fold_mismatches, http_client, read_events,
};
use jobfold_tests::pair::Pair;
use jobfold_tests::services;
use serde_json::json;
use tokio::sync::Mutex;
use uuid::Uuid;

const TOKEN: &str = "jf_test_postgres_pair_token_0123456789";

/// With `database.require_sync_standby`, each binary refuses (exit 2, naming the key) the
/// test services' Postgres, which has no standby.
#[tokio::test(flavor = "multi_thread")]
async fn a_primary_without_a_synchronous_standby_is_refused_at_start() {
    let it = Installation::new("sync-standby-required").await;
    let mut env = it.env();
    env.insert("JOBFOLD_DATABASE__REQUIRE_SYNC_STANDBY".into(), "true".into());
    // Nothing here reads the metrics: a port of the system's choosing, bound at once, where a
    // port found free earlier may have been taken by another test's process meanwhile.
    env.insert("JOBFOLD_METRICS_ADDR".into(), "127.0.0.1:0".into());
    for binary in ["jobfold-relay", "jobfold-processor"] {
        let mut service = Service::start(binary, &env);
        let status = service.wait_exit(Duration::from_secs(60)).expect("it exits");
        let log = service.log_text();
        assert_eq!(status.code(), Some(2), "{binary}: {log}");
        assert!(
            log.contains("database.require_sync_standby")
                && log.contains("synchronous_standby_names is empty"),
            "{binary}: {log}"
        );
    }
    it.cleanup().await;
}

/// What the submitting client saw.
#[derive(Debug, Default)]
struct Submitted {
    /// Idempotency key → job id, once acknowledged (201, or 200 on a retry).
    acknowledged: BTreeMap<String, Uuid>,
    /// 503 answers, and other failures (a refused connection, a reset).
    unavailable: u64,
    /// Of them, `not_durable_yet`: the commit waited past accept.commit_timeout.
    not_durable: u64,
    /// The longest stretch with no acknowledgement while submitting.
    longest_gap: Duration,
}

/// Submits one job at a time, each retried with its idempotency key until acknowledged.
async fn submit(url: String, seen: Arc<Mutex<Submitted>>, stop: Arc<AtomicBool>) {
    let client = http_client();
    let mut last_ack = Instant::now();
    for i in 0u64.. {
        let key = format!("job-{i}");
        let body = json!({
            "kind": "index-document",
            "document_id": format!("doc-{i}"),
            "input_version": 1,
            "input": { "text": format!("text {i}") },
        });
        loop {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            let answer = client
                .post(&url)
                .bearer_auth(TOKEN)
                .header("idempotency-key", &key)
                .json(&body)
                .timeout(Duration::from_secs(30))
                .send()
                .await;
            let mut seen = seen.lock().await;
            match answer {
                Ok(a) if a.status().is_success() => {
                    let body: serde_json::Value = a.json().await.expect("a JSON answer");
                    let job = body["job_id"].as_str().expect("a job id").parse().unwrap();
                    seen.acknowledged.insert(key.clone(), job);
                    seen.longest_gap = seen.longest_gap.max(last_ack.elapsed());
                    last_ack = Instant::now();
                    break;
                }
                Ok(a) => {
                    let status = a.status().as_u16();
                    let body: serde_json::Value = a.json().await.unwrap_or_default();
                    assert_eq!(status, 503, "only unavailability is expected: {body}");
                    seen.unavailable += 1;
                    if body["error"]["code"] == "not_durable_yet" {
                        seen.not_durable += 1;
                    }
                }
                Err(_) => seen.unavailable += 1,
            }
            drop(seen);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Jobs go on being accepted and run, once each, across a kill -9 of the primary and the
/// standby's promotion, a planned switchover, and the standby's loss (commits wait; callers
/// get 503 `not_durable_yet` and retry with their key). Every acknowledged job exists once
/// and succeeded once, the relay published every event from the new primary on, and the
/// processor followed the primary by itself.
#[tokio::test(flavor = "multi_thread")]
async fn failovers_lose_no_acknowledged_job_and_run_none_twice() {
    services::require_all();
    let pair = Pair::start("failover");
    let mut it = Installation::on("failover", &pair.primary_url("jobfold"), |url| {
        pair.url(url.rsplit_once('/').expect("a database").1)
    })
    .await;
    it.fast();
    it.create_topics().await;
    let running = Running::start(
        &it,
        TOKEN,
        &[
            ("JOBFOLD_DATABASE__REQUIRE_SYNC_STANDBY", "true"),
            ("JOBFOLD_DATABASE__PRIMARY_CHECK", "200ms"),
            ("JOBFOLD_ACCEPT__COMMIT_TIMEOUT", "2s"),
            ("JOBFOLD_PROCESSOR__GAUGE_INTERVAL", "500ms"),
        ],
    );
    running.ready().await;

    let seen = Arc::new(Mutex::new(Submitted::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(submit(running.url("/v1/jobs"), Arc::clone(&seen), Arc::clone(&stop)));
    let more = |n: usize, what: &'static str| {
        let seen = Arc::clone(&seen);
        async move {
            let from = seen.lock().await.acknowledged.len();
            eventually(Duration::from_secs(120), what, || async {
                seen.lock().await.acknowledged.len() >= from + n
            })
            .await;
        }
    };
    more(20, "jobs acknowledged before any fault").await;
    let faults_from = chrono::Utc::now();
    let not_durable = || async { seen.lock().await.not_durable };
    let mut gaps = Vec::new();

    // 1. The primary's machine dies; the standby is promoted. Until the old primary comes
    //    back as a standby, the new one's commits wait for it: accepts are answered 503.
    let old = pair.primary();
    let before = not_durable().await;
    pair.run(&["failover"]).await;
    eventually(Duration::from_secs(60), "an accept answered not_durable_yet", || async {
        not_durable().await > before
    })
    .await;
    pair.run(&["rejoin", &old.to_string()]).await;
    more(20, "jobs acknowledged after the failover").await;
    assert_ne!(pair.primary(), old);
    gaps.push(("failover", std::mem::take(&mut seen.lock().await.longest_gap)));

    // 2. A planned switchover.
    let old = pair.primary();
    pair.run(&["switchover"]).await;
    more(20, "jobs acknowledged after the switchover").await;
    assert_ne!(pair.primary(), old);
    gaps.push(("switchover", std::mem::take(&mut seen.lock().await.longest_gap)));

    // 3. The standby dies: commits wait, the gauge shows them, callers get 503.
    let standby = 3 - pair.primary();
    let before = not_durable().await;
    pair.run(&["kill", &standby.to_string()]).await;
    eventually(Duration::from_secs(60), "commits shown waiting for the standby", || async {
        running.processor.metric("jobfold_commits_waiting_for_standby").await.unwrap_or(0.0) > 0.0
    })
    .await;
    eventually(Duration::from_secs(60), "an accept answered not_durable_yet", || async {
        not_durable().await > before
    })
    .await;
    pair.run(&["start-node", &standby.to_string()]).await;
    more(20, "jobs acknowledged after the standby came back").await;
    gaps.push(("standby lost for a while", std::mem::take(&mut seen.lock().await.longest_gap)));

    stop.store(true, Ordering::SeqCst);
    load.await.unwrap();
    let seen = seen.lock().await;
    let jobs: HashSet<Uuid> = seen.acknowledged.values().copied().collect();
    println!(
        "{} jobs acknowledged, {} answers unavailable ({} not durable in time); longest time without an acknowledgement: {gaps:?}",
        jobs.len(),
        seen.unavailable,
        seen.not_durable
    );
    assert!(seen.unavailable >= seen.not_durable && seen.not_durable >= 2, "{seen:?}");

    // Every acknowledged job exists once, and succeeds with one business write.
    let ids: Vec<Uuid> = jobs.iter().copied().collect();
    eventually(Duration::from_secs(120), "every acknowledged job to succeed", || async {
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE job_id = ANY($1) AND state = 'succeeded'",
        )
        .bind(&ids)
        .fetch_one(&it.pool)
        .await
        .unwrap_or(0);
        done == ids.len() as i64
    })
    .await;
    let (all_jobs, writes, written_jobs): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM index_writes), \
                (SELECT count(DISTINCT job_id) FROM index_writes)",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(all_jobs, ids.len() as i64, "one job per idempotency key, none lost");
    assert_eq!((writes, written_jobs), (all_jobs, all_jobs), "one business write per job");
    // Accept -> end at p99 before the faults and across them, for docs/postgres.md.
    let (before, across): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM finished_at - accepted_at)::float8) \
                    FILTER (WHERE accepted_at < $1), \
                percentile_cont(0.99) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM finished_at - accepted_at)::float8) \
                    FILTER (WHERE accepted_at >= $1) \
         FROM jobs",
    )
    .bind(faults_from)
    .fetch_one(&it.pool)
    .await
    .unwrap();
    println!("accept -> end at p99: {before:?} s before the faults, {across:?} s across them");

    // The relay went on from the new primary: every event is on the topic.
    eventually(Duration::from_secs(60), "the relay to publish every event", || async {
        it.unpublished().await == 0
    })
    .await;
    let events: HashSet<(Uuid, i32)> =
        sqlx::query_as::<_, (Uuid, i32)>("SELECT job_id, stream_version FROM job_events")
            .fetch_all(&it.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let published = read_events(&it, Duration::from_secs(60), |seen| {
        let on_topic: HashSet<_> =
            seen.iter().map(|p| (p.event.job_id, p.event.stream_version)).collect();
        events.is_subset(&on_topic)
    })
    .await;
    let on_topic: HashSet<_> =
        published.iter().map(|p| (p.event.job_id, p.event.stream_version)).collect();
    assert!(
        events.is_subset(&on_topic),
        "{} events missing from the topic",
        events.difference(&on_topic).count()
    );
    assert!(fold_mismatches(&it).await.is_empty());

    // The processor moved to the new primary twice by itself.
    let moved = running.processor.metric("jobfold_database_primary_changes_total").await;
    assert!(moved.unwrap_or(0.0) >= 2.0, "primary changes followed: {moved:?}");
    drop(running);
    it.cleanup().await;
}

/// `jobfold bench --failover` measures what a failover costs the callers and the jobs: run
/// against a pair, the command it is given fails the primary over and rejoins it, and the
/// table reports the time accepts were unavailable and accept -> succeeded across it, next
/// to the lease TTL. The bench itself fails should an acknowledged job not succeed once or
/// the processor not move to the new primary.
#[tokio::test(flavor = "multi_thread")]
async fn the_bench_reports_the_pause_a_failover_causes() {
    services::require_all();
    let pair = Pair::start("bench");
    let old = pair.primary();
    let command = pair.command(&["failover", "--rejoin"]);
    let url = pair.url("jobfold");
    let output = tokio::task::spawn_blocking(move || {
        jobfold_tests::harness::jobfold_cli()
            .env("JOBFOLD_DATABASE_URL", url)
            .env("JOBFOLD_DATABASE__REQUIRE_SYNC_STANDBY", "true")
            .env("JOBFOLD_DATABASE__PRIMARY_CHECK", "200ms")
            .env("JOBFOLD_ACCEPT__COMMIT_TIMEOUT", "2s")
            .args(["bench", "--smoke", "--failover", &command])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("running jobfold bench")
    })
    .await
    .unwrap();
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "jobfold bench --failover: {table}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_ne!(pair.primary(), old, "the command moved the primary");
    let row = |name: &str| {
        table.lines().find(|l| l.contains(name)).unwrap_or_else(|| panic!("no {name} row: {table}"))
    };
    let unavailable = row("accepts unavailable");
    let gap: f64 = unavailable
        .split("longest ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no gap in {unavailable}"));
    assert!(gap > 0.0, "{unavailable}");
    assert!(unavailable.contains("% of lease TTL"), "{unavailable}");
    let across = row("accept -> succeeded across it");
    let cells: Vec<&str> = across.split('|').map(str::trim).collect();
    let p99: f64 = cells[4].parse().unwrap_or_else(|_| panic!("no p99 in {across}"));
    assert!(p99 > 0.0 && across.contains("% of lease TTL"), "{across}");
    println!("{table}");
}
