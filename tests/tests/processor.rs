//! The processor end to end, against real Postgres, Kafka and the registry: results
//! committed once, retries and budgets, supersession, duplicate delivery, and kill -9 at each
//! crash window with the processor as a separate OS process.

use std::sync::Arc;
use std::time::Duration;

use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_common::failpoint;
use jobfold_processor::handler::{Handlers, JobContext};
use jobfold_tests::harness::{
    Installation, LoggedLease, Pipeline, Service, eventually, eventually_some, fold_mismatches,
    index_job as job, logged_leases, metric_here,
};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Test timings: short leases and retries.
fn fast(it: &mut Installation) {
    it.fast();
}

/// An installation with [`fast`] timings, its topics and an acceptor.
async fn fast_installation(name: &str) -> (Installation, Acceptor) {
    let mut it = Installation::new(name).await;
    fast(&mut it);
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    (it, acceptor)
}

fn fast_env(it: &Installation) -> std::collections::HashMap<String, String> {
    it.fast_env(&it.config.processor.group)
}

async fn states(it: &Installation) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT state::text, count(*) FROM jobs GROUP BY 1 ORDER BY 1")
        .fetch_all(&it.pool)
        .await
        .unwrap()
}

/// A job's state and attempt count.
async fn state_and_attempt(it: &Installation, job_id: Uuid) -> (String, i32) {
    it.state_and_attempt(job_id).await
}

async fn count_where(it: &Installation, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&it.pool).await.unwrap()
}

/// No (job, input_version) has more than one business write, and every succeeded job has one.
async fn assert_exactly_one_write_per_success(it: &Installation) {
    let duplicated = count_where(
        it,
        "SELECT count(*) FROM (SELECT 1 FROM index_writes GROUP BY job_id, input_version HAVING count(*) > 1) d",
    )
    .await;
    assert_eq!(duplicated, 0, "a business write was committed twice");
    let missing = count_where(
        it,
        "SELECT count(*) FROM jobs j WHERE state = 'succeeded' AND NOT EXISTS \
         (SELECT 1 FROM index_writes w WHERE w.job_id = j.job_id AND w.input_version = j.input_version)",
    )
    .await;
    assert_eq!(missing, 0, "a succeeded job has no business write");
}

async fn all_finished(it: &Installation, total: i64) -> bool {
    count_where(
        it,
        "SELECT count(*) FROM jobs WHERE state IN ('succeeded', 'quarantined', 'superseded')",
    )
    .await
        == total
}

async fn accept_all(acceptor: &Acceptor, it: &Installation, jobs: &[NewJob]) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for j in jobs {
        ids.push(acceptor.accept(&it.pool, j).await.unwrap().job_id);
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_run_once_and_the_index_holds_the_newest_version() {
    let (it, acceptor) = fast_installation("proc-happy").await;
    let pipeline = Pipeline::start(&it, true);

    // 40 documents, versions 1 and 2, and for doc-0 a version 3 after a version 4.
    let mut jobs = Vec::new();
    for v in 1..=2 {
        for d in 0..40 {
            jobs.push(job(
                &format!("doc-{d}"),
                v,
                json!({ "text": format!("doc {d} version {v} words words") }),
            ));
        }
    }
    jobs.push(job("doc-0", 4, json!({ "text": "four" })));
    jobs.push(job("doc-0", 3, json!({ "text": "three" })));
    let total = jobs.len() as i64;
    accept_all(&acceptor, &it, &jobs).await;

    eventually(Duration::from_secs(60), "every job to finish", || all_finished(&it, total)).await;
    pipeline.stop().await;

    assert_eq!(states(&it).await, [("succeeded".into(), total - 1), ("superseded".into(), 1)]);
    let index: Vec<(String, i64)> =
        sqlx::query_as("SELECT document_id, version FROM document_index ORDER BY document_id")
            .fetch_all(&it.pool)
            .await
            .unwrap();
    assert_eq!(index.len(), 40);
    for (doc, version) in &index {
        assert_eq!(*version, if doc == "doc-0" { 4 } else { 2 }, "{doc}");
    }
    let words: Value =
        sqlx::query_scalar("SELECT output FROM document_index WHERE document_id = 'doc-7'")
            .fetch_one(&it.pool)
            .await
            .unwrap();
    assert_eq!(words["terms"]["words"], 2);
    assert_exactly_one_write_per_success(&it).await;
    assert_eq!(
        count_where(&it, "SELECT count(*) FROM jobs WHERE result IS NOT NULL").await,
        total - 1
    );
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_back_off_and_stop_at_the_budget_and_invalid_input_is_not_retried() {
    let mut it = Installation::new("proc-retry").await;
    fast(&mut it);
    it.config.accept.default_max_attempts = 3;
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let pipeline = Pipeline::start(&it, true);

    let ids = accept_all(
        &acceptor,
        &it,
        &[
            job("flaky", 1, json!({ "text": "ok", "simulate": { "fail_attempts": 2 } })),
            job("hopeless", 1, json!({ "text": "no", "simulate": { "fail_attempts": 99 } })),
            job("invalid", 1, json!({ "words": "no text field" })),
            job("broken", 1, json!({ "text": "x", "simulate": { "permanent": true } })),
        ],
    )
    .await;
    eventually(Duration::from_secs(60), "every job to finish", || all_finished(&it, 4)).await;
    pipeline.stop().await;

    let row = |id: Uuid| state_and_attempt(&it, id);
    assert_eq!(row(ids[0]).await, ("succeeded".into(), 3), "two retryable failures, then success");
    assert_eq!(row(ids[1]).await, ("quarantined".into(), 3), "stops at the attempt budget");
    assert_eq!(row(ids[2]).await, ("quarantined".into(), 1), "invalid input is never retried");
    assert_eq!(
        row(ids[3]).await,
        ("quarantined".into(), 1),
        "a permanent failure is never retried"
    );

    let kinds: Vec<String> =
        sqlx::query_scalar("SELECT kind FROM job_events WHERE job_id = $1 ORDER BY stream_version")
            .bind(ids[0])
            .fetch_all(&it.pool)
            .await
            .unwrap();
    let mut expected = vec![
        "JobRequested",
        "JobLeased",
        "JobFailed",
        "JobRetryScheduled",
        "RetryDue",
        "JobLeased",
        "JobFailed",
        "JobRetryScheduled",
        "RetryDue",
        "JobLeased",
        "JobSucceeded",
    ];
    // The last run, ended inside its lease transaction, writes one event for its lease and
    // success; one that outlived it, both.
    if kinds.len() == expected.len() - 1 {
        expected.remove(expected.len() - 2);
    }
    assert_eq!(kinds, expected);
    // Each RetryDue was published no earlier than its backoff allowed.
    let early = count_where(
        &it,
        "SELECT count(*) FROM job_events e JOIN outbox o USING (seq) \
         WHERE e.kind = 'RetryDue' AND o.published_at < o.available_at",
    )
    .await;
    assert_eq!(early, 0);
    let quarantined: Vec<(String, String, i32, String)> = sqlx::query_as(
        "SELECT q.error_class, q.owner, q.attempts, q.reason FROM quarantine q ORDER BY q.attempts DESC, q.error_class",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert_eq!(quarantined.len(), 3);
    assert_eq!(quarantined[0].0, "RETRYABLE");
    assert_eq!(quarantined[0].2, 3);
    assert!(quarantined[0].3.contains("budget"), "{:?}", quarantined[0]);
    assert!(quarantined.iter().any(|q| q.0 == "INVALID_INPUT" && q.2 == 1));
    assert!(quarantined.iter().all(|q| q.1 == "jobfold-operators"));
    assert_exactly_one_write_per_success(&it).await;
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redelivered_event_is_skipped_without_running_the_handler() {
    let (it, acceptor) = fast_installation("proc-dup").await;
    let skipped = || metric_here("jobfold_duplicates_skipped_total", &[]).unwrap_or(0.0);
    assert_eq!(skipped(), 0.0);
    let pipeline = Pipeline::start(&it, true);
    let ids =
        accept_all(&acceptor, &it, &[job("doc-dup", 1, json!({ "text": "once only" }))]).await;
    eventually(Duration::from_secs(60), "the job to succeed", || all_finished(&it, 1)).await;

    // The relay publishes every event of the job again, as after a crash before marking.
    eventually(Duration::from_secs(30), "the job's events to go out", || async {
        it.unpublished().await == 0
    })
    .await;
    let job_events: i64 = sqlx::query_scalar("SELECT count(*) FROM job_events WHERE job_id = $1")
        .bind(ids[0])
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert_eq!(job_events, it.count("job_events").await, "only this job's events");
    it.republish_last(job_events).await;
    assert_eq!(it.unpublished().await, job_events);
    eventually(Duration::from_secs(30), "the republished events to go out", || async {
        it.unpublished().await == 0
    })
    .await;
    // The processor took the redelivered JobRequested and skipped it as a duplicate.
    eventually(Duration::from_secs(30), "the duplicate to be skipped", || async {
        skipped() >= 1.0
    })
    .await;
    pipeline.stop().await;

    let results =
        count_where(&it, "SELECT count(*) FROM job_events WHERE kind = 'JobSucceeded'").await;
    let writes = count_where(&it, "SELECT count(*) FROM index_writes").await;
    let leases = logged_leases(&it.pool, None).await.len();
    assert_eq!((results, writes, leases), (1, 1, 1), "the duplicate ran nothing");
    let dispatched = count_where(&it, "SELECT dispatch_version::bigint FROM jobs").await;
    assert_eq!(dispatched, 1, "the job row names the JobRequested that leased it");
    it.cleanup().await;
}

/// Empties the installation's schema and runs the migrations below `version`: the database
/// an upgrade test fills as an older jobfold would have left it, before it runs them all.
async fn migrated_below(it: &Installation, version: i64) {
    // language=PostgreSQL
    sqlx::raw_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        .execute(&it.pool)
        .await
        .unwrap();
    let all = &jobfold_common::db::MIGRATOR;
    let before = sqlx::migrate::Migrator {
        migrations: all.migrations.iter().filter(|m| m.version < version).cloned().collect(),
        ..*all
    };
    before.run(&it.pool).await.unwrap();
}

/// Upgrading a database that has dedupe rows (`consumed_events`, before migration 14) keeps
/// what they knew: each job's `dispatch_version` is the newest dispatch event it consumed, so
/// an event redelivered after the upgrade is still a duplicate. A job with none keeps 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upgrade_keeps_what_the_dedupe_rows_knew() {
    let it = Installation::new("proc-upgrade").await;
    migrated_below(&it, 14).await;
    // Job 1 succeeded on its JobRequested; job 3 on its RetryDue (version 4); job 2 is
    // leased, its dispatch not yet consumed.
    // language=PostgreSQL
    sqlx::raw_sql(
        r"
        INSERT INTO jobs (job_id, document_id, kind, payload, input_version, max_attempts,
                          stream_version, state, finished_at, lease_until, lease_owner)
        VALUES ('00000000-0000-0000-0000-000000000001', 'd1', 'k', '{}', 1, 3, 3,
                'succeeded', now(), NULL, NULL),
               ('00000000-0000-0000-0000-000000000002', 'd2', 'k', '{}', 1, 3, 2,
                'leased', NULL, now(), 'p'),
               ('00000000-0000-0000-0000-000000000003', 'd3', 'k', '{}', 1, 3, 6,
                'succeeded', now(), NULL, NULL);
        INSERT INTO job_events (event_id, job_id, stream_version, kind, body) VALUES
            ('10000000-0000-0000-0000-000000000001', '00000000-0000-0000-0000-000000000001',
             1, 'JobRequested', '\x00'),
            ('10000000-0000-0000-0000-000000000002', '00000000-0000-0000-0000-000000000002',
             1, 'JobRequested', '\x00'),
            ('10000000-0000-0000-0000-000000000003', '00000000-0000-0000-0000-000000000003',
             1, 'JobRequested', '\x00'),
            ('10000000-0000-0000-0000-000000000004', '00000000-0000-0000-0000-000000000003',
             4, 'RetryDue', '\x00');
        INSERT INTO consumed_events (consumer_group, event_id, topic, kafka_partition,
                                     kafka_offset, job_id) VALUES
            ('g', '10000000-0000-0000-0000-000000000001', 't', 0, 1,
             '00000000-0000-0000-0000-000000000001'),
            ('g', '10000000-0000-0000-0000-000000000003', 't', 0, 2,
             '00000000-0000-0000-0000-000000000003'),
            ('g', '10000000-0000-0000-0000-000000000004', 't', 0, 3,
             '00000000-0000-0000-0000-000000000003');
        ",
    )
    .execute(&it.pool)
    .await
    .unwrap();
    jobfold_common::db::MIGRATOR.run(&it.pool).await.unwrap();
    let dispatched: Vec<(i32,)> =
        sqlx::query_as("SELECT dispatch_version FROM jobs ORDER BY job_id")
            .fetch_all(&it.pool)
            .await
            .unwrap();
    assert_eq!(dispatched, [(1,), (0,), (4,)]);
    let gone: Option<String> = sqlx::query_scalar("SELECT to_regclass('consumed_events')::text")
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert_eq!(gone, None, "the dedupe table is dropped");
    it.cleanup().await;
}

/// Upgrading a database whose results are in `job_results` (before migration 24) moves each
/// into its job's row, where `GET /v1/jobs/{id}` reads it, and drops the table. A job
/// without a result keeps none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upgrade_moves_each_result_into_its_job_row() {
    let it = Installation::new("proc-upgrade-results").await;
    migrated_below(&it, 24).await;
    // language=PostgreSQL
    sqlx::raw_sql(
        r#"
        INSERT INTO jobs (job_id, document_id, kind, payload, input_version, max_attempts,
                          stream_version, state, finished_at)
        VALUES ('00000000-0000-0000-0000-000000000001', 'd1', 'k', '{}', 1, 3, 3,
                'succeeded', now()),
               ('00000000-0000-0000-0000-000000000002', 'd2', 'k', '{}', 1, 3, 1,
                'queued', NULL),
               ('00000000-0000-0000-0000-000000000003', 'd3', 'k', '{}', 2, 3, 3,
                'succeeded', now());
        INSERT INTO job_results (job_id, input_version, generation, result) VALUES
            ('00000000-0000-0000-0000-000000000001', 1, 1, '{"words": 2}'),
            ('00000000-0000-0000-0000-000000000003', 2, 1, 'null');
        "#,
    )
    .execute(&it.pool)
    .await
    .unwrap();
    jobfold_common::db::MIGRATOR.run(&it.pool).await.unwrap();
    let results: Vec<(Option<Value>,)> = sqlx::query_as("SELECT result FROM jobs ORDER BY job_id")
        .fetch_all(&it.pool)
        .await
        .unwrap();
    assert_eq!(results, [(Some(json!({ "words": 2 })),), (None,), (Some(Value::Null),)]);
    for (job, expected) in [(1, Some(json!({ "words": 2 }))), (2, None), (3, Some(Value::Null))] {
        let id = Uuid::from_u128(job);
        let read = jobfold_processor::status::result(&it.pool, id).await.unwrap();
        assert_eq!(read, Some(expected), "job {job} as the API reads it");
    }
    let gone: Option<String> = sqlx::query_scalar("SELECT to_regclass('job_results')::text")
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert_eq!(gone, None, "the results table is dropped");
    it.cleanup().await;
}

/// Kill -9 a processor process at `failpoint`, start another, and check the outcome; returns
/// the surviving processor, still running. `inline_window` is the processors'
/// (`processor.inline_window`): `0s` commits every lease before its handler runs.
async fn crash_at(
    name: &str,
    failpoint: &str,
    jobs: usize,
    inline_window: &str,
) -> (Installation, Service) {
    let mut it = Installation::new(name).await;
    fast(&mut it);
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let mut env = fast_env(&it);
    env.insert("JOBFOLD_PROCESSOR__INLINE_WINDOW".into(), inline_window.into());
    let _relay = Service::start("jobfold-relay", &env);
    let batch: Vec<NewJob> = (0..jobs)
        .map(|i| job(&format!("doc-{i}"), 1, json!({ "text": format!("text {i}") })))
        .collect();
    accept_all(&acceptor, &it, &batch).await;

    env.insert("JOBFOLD_FAILPOINT".into(), format!("{failpoint}@3"));
    let mut crashing = Service::start("jobfold-test-processor", &env);
    let status = crashing
        .wait_exit(Duration::from_secs(60))
        .expect("the processor should abort at the failpoint");
    assert!(!status.success(), "{}", crashing.log_text());
    assert!(crashing.log_text().contains(failpoint), "{}", crashing.log_text());

    env.remove("JOBFOLD_FAILPOINT");
    let survivor = Service::start("jobfold-test-processor", &env);
    eventually(Duration::from_secs(90), "every job to finish after the crash", || {
        all_finished(&it, jobs as i64)
    })
    .await;
    assert_eq!(states(&it).await, [("succeeded".into(), jobs as i64)]);
    assert_exactly_one_write_per_success(&it).await;
    assert_eq!(
        count_where(&it, "SELECT count(*) FROM jobs WHERE result IS NOT NULL").await,
        jobs as i64
    );
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    (it, survivor)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_completion_before_the_offset_store_the_redelivery_is_skipped() {
    let (it, survivor) = crash_at(
        "proc-crash-offset",
        failpoint::PROCESSOR_AFTER_COMPLETION_BEFORE_OFFSET,
        20,
        "5ms",
    )
    .await;
    // The third completion committed, then the process died before storing its offset: the
    // survivor gets the event again and skips it by its job row (its dispatch version and
    // state), running nothing. (Every job may be finished before the survivor joins:
    // completions share transactions.)
    let skipped =
        || async { survivor.metric("jobfold_duplicates_skipped_total").await.unwrap_or(0.0) };
    eventually(Duration::from_secs(60), "the survivor to skip a redelivered event", || async {
        skipped().await >= 1.0
    })
    .await;
    // No job completed twice (a lease after success would also fail the fold check).
    let completed_twice = count_where(
        &it,
        "SELECT count(*) FROM (SELECT job_id FROM job_events WHERE kind = 'JobSucceeded' \
         GROUP BY job_id HAVING count(*) > 1) d",
    )
    .await;
    assert_eq!(completed_twice, 0);
    let leases = logged_leases(&it.pool, None).await.len();
    let runs = survivor.metric("jobfold_handler_runs_total").await.unwrap_or(0.0);
    println!(
        "leases {leases} for 20 jobs; the survivor ran {runs} handlers and skipped {} duplicates",
        skipped().await
    );
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_lease_the_job_is_leased_again_with_a_higher_generation() {
    let (it, _) =
        crash_at("proc-crash-lease", failpoint::PROCESSOR_AFTER_LEASE_COMMIT, 20, "0s").await;
    // The job leased when the process died is finished by generation 2.
    let regenerated = count_where(&it, "SELECT count(*) FROM jobs WHERE generation > 1").await;
    assert!(regenerated >= 1, "the orphaned lease was never taken over");
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_in_the_handler_nothing_of_the_attempt_is_committed() {
    let (it, _) = crash_at("proc-crash-handler", failpoint::PROCESSOR_IN_HANDLER, 20, "0s").await;
    let regenerated = count_where(&it, "SELECT count(*) FROM jobs WHERE generation > 1").await;
    assert!(regenerated >= 1, "the orphaned lease was never taken over");
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_in_a_handler_run_within_its_lease_transaction_nothing_is_kept_and_the_run_counts() {
    // Handlers finish within the window: each lease commits with its attempt's outcome, so
    // the process dying in a handler leaves no lease behind to wait out or take over. The
    // runs its dead lease transaction had started (recorded before they ran) count: each
    // such job's crashed attempt is completed as a failure by the survivor (generation 1,
    // a crash counted), and its next attempt succeeds (generation 2); nothing of the dead
    // attempts was kept.
    let (it, _) = crash_at("proc-crash-inline", failpoint::PROCESSOR_IN_HANDLER, 20, "1s").await;
    // Counted, then back at 0 once its isolated run returned: the crash's record stays.
    let crashed =
        count_where(&it, "SELECT count(*) FROM job_counters WHERE last_crash_at IS NOT NULL").await;
    assert!(crashed >= 1, "the run that died was not counted");
    assert_eq!(count_where(&it, "SELECT count(*) FROM jobs WHERE generation > 1").await, crashed);
    assert_eq!(
        count_where(&it, "SELECT count(*) FROM job_events WHERE kind = 'JobFailed'").await,
        crashed
    );
    let leases = logged_leases(&it.pool, None).await;
    assert_eq!(
        leases.len() as i64,
        20 + crashed,
        "one lease a job, and one more for each crashed run"
    );
    // Every other lease was said by its success, in one event: none of a job that did not
    // crash is a JobLeased of its own.
    let crashed_jobs: Vec<Uuid> =
        sqlx::query_scalar("SELECT job_id FROM job_counters").fetch_all(&it.pool).await.unwrap();
    let apart: Vec<&LoggedLease> =
        leases.iter().filter(|l| !l.with_success && !crashed_jobs.contains(&l.job_id)).collect();
    assert_eq!(apart, Vec::<&LoggedLease>::new());
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_worker_past_its_lease_is_fenced_when_it_resumes() {
    let (it, acceptor) = fast_installation("proc-zombie").await;
    let env = fast_env(&it);
    let _relay = Service::start("jobfold-relay", &env);
    let zombie = Service::start("jobfold-test-processor", &env);
    let ids = accept_all(
        &acceptor,
        &it,
        &[job("doc-slow", 1, json!({ "text": "slow", "simulate": { "sleep_ms": 4000 } }))],
    )
    .await;
    eventually(Duration::from_secs(30), "the first worker to lease the job", || async {
        count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'leased'").await == 1
    })
    .await;
    // Paused mid-handler (a GC pause, a frozen VM): no heartbeats, the lease expires.
    zombie.signal("STOP");
    let survivor = Service::start("jobfold-test-processor", &env);
    eventually(Duration::from_secs(60), "the survivor to finish the job", || all_finished(&it, 1))
        .await;
    let generation: i64 = sqlx::query_scalar("SELECT generation FROM jobs WHERE job_id = $1")
        .bind(ids[0])
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert_eq!(generation, 2, "the survivor leased with the next generation");

    // The zombie wakes up and tries to complete with generation 1: refused and counted.
    zombie.signal("CONT");
    eventually(Duration::from_secs(30), "the zombie's completion to be fenced", || async {
        zombie.metric("jobfold_fenced_completions_total").await == Some(1.0)
    })
    .await;
    assert_eq!(count_where(&it, "SELECT count(*) FROM jobs WHERE result IS NOT NULL").await, 1);
    assert_exactly_one_write_per_success(&it).await;
    assert_eq!(count_where(&it, "SELECT count(*) FROM index_writes").await, 1);
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    drop(survivor);
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_and_leaving_mid_run_loses_and_repeats_nothing() {
    const JOBS: usize = 300;
    let (it, acceptor) = fast_installation("proc-rebalance").await;
    let env = fast_env(&it);
    let _relay = Service::start("jobfold-relay", &env);
    let first = Service::start("jobfold-test-processor", &env);
    let jobs: Vec<NewJob> = (0..JOBS)
        .map(|i| {
            let input = json!({ "text": format!("words {i}"), "simulate": { "sleep_ms": 20 } });
            job(&format!("doc-{}", i % 60), 1 + (i / 60) as i64, input)
        })
        .collect();
    accept_all(&acceptor, &it, &jobs[..JOBS / 2]).await;
    // A second member joins while jobs run, then leaves gracefully (SIGTERM) while more
    // arrive: two rebalances mid-run.
    let mut second = Service::start("jobfold-test-processor", &env);
    accept_all(&acceptor, &it, &jobs[JOBS / 2..]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    second.signal("TERM");
    let status = second.wait_exit(Duration::from_secs(30)).expect("the second member should stop");
    assert!(status.success(), "{}", second.log_text());

    eventually(Duration::from_secs(120), "every job to finish", || all_finished(&it, JOBS as i64))
        .await;
    let superseded = count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'superseded'").await;
    let succeeded = count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'succeeded'").await;
    assert_eq!(succeeded + superseded, JOBS as i64);
    assert_exactly_one_write_per_success(&it).await;
    let index_versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM document_index").fetch_all(&it.pool).await.unwrap();
    assert_eq!(index_versions.len(), 60);
    assert!(index_versions.iter().all(|v| *v == 5), "every document ends at its newest version");
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    drop(first);
    it.cleanup().await;
}

/// The partitions a processor's presence row shows, once it shows some.
async fn partitions_of(it: &Installation, processor: &Service) -> Vec<i32> {
    let owner = format!("%/{}", processor.pid());
    eventually_some(Duration::from_secs(60), "the processor's presence row", || {
        let (pool, owner) = (it.pool.clone(), owner.clone());
        async move {
            let partitions: Option<Vec<i32>> = sqlx::query_scalar(
                "SELECT partitions FROM processors WHERE owner LIKE $1 AND partitions <> '{}'",
            )
            .bind(owner)
            .fetch_optional(&pool)
            .await
            .unwrap();
            partitions.map(|mut p| {
                p.sort_unstable();
                p
            })
        }
    })
    .await
}

/// `env` for a processor named `name` in its group (`processor.group_instance_id`).
fn named(
    env: &std::collections::HashMap<String, String>,
    name: &str,
) -> std::collections::HashMap<String, String> {
    let mut env = env.clone();
    env.insert("JOBFOLD_PROCESSOR__GROUP_INSTANCE_ID".into(), name.into());
    env
}

/// Static membership (`processor.group_instance_id`): a processor killed and started again
/// under its name gets its partitions back at once — the group does not wait out the dead
/// one's session (two minutes here, longer than the test waits), and the other member takes
/// part in no rebalance. A second process under a name in use fences the first, which stops
/// saying which setting must differ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_started_again_under_its_name_takes_its_partitions_back_without_a_rebalance() {
    let (it, acceptor) = fast_installation("proc-static").await;
    let mut env = fast_env(&it);
    env.insert("JOBFOLD_KAFKA__SESSION_TIMEOUT_MS".into(), "120000".into());
    let named = |name: &str| named(&env, name);
    let _relay = Service::start("jobfold-relay", &env);
    let mut a = Service::start("jobfold-test-processor", &named("proc-a"));
    let mut b = Service::start("jobfold-test-processor", &named("proc-b"));
    let total = f64::from(it.config.topics.partitions);
    let assigned = "jobfold_assigned_partitions";
    eventually(Duration::from_secs(60), "the two members to share every partition", || async {
        let held = (a.metric(assigned).await, b.metric(assigned).await);
        matches!(held, (Some(x), Some(y)) if x > 0.0 && y > 0.0 && x + y == total)
    })
    .await;
    // The presence row is written every few seconds: it may still hold what a held before
    // b joined. Taken once it shows as many partitions as a reports holding.
    let held = a.metric(assigned).await.unwrap_or_default() as usize;
    let before = eventually_some(Duration::from_secs(60), "a's presence row, up to date", || {
        let (it, a) = (&it, &a);
        async move { Some(partitions_of(it, a).await).filter(|p| p.len() == held) }
    })
    .await;
    let rebalances = "jobfold_group_rebalances_total";
    let b_rebalances = b.metric(rebalances).await.expect("b's rebalances");

    a.kill9();
    let again = Service::start("jobfold-test-processor", &named("proc-a"));
    eventually(Duration::from_secs(60), "the restarted member to hold its partitions", || async {
        again.metric(assigned).await.unwrap_or(0.0) > 0.0
    })
    .await;
    // Its presence row is written once it holds them: looked at until it shows them all.
    let want = before.len();
    let back = eventually_some(Duration::from_secs(60), "the restarted member's row", || {
        let (it, again) = (&it, &again);
        async move { Some(partitions_of(it, again).await).filter(|p| p.len() == want) }
    })
    .await;
    assert_eq!(back, before, "the same partitions, back");
    assert_eq!(
        b.metric(rebalances).await,
        Some(b_rebalances),
        "the other member took part in no rebalance:\n{}",
        b.log_text()
    );
    // And it runs their jobs (the other member holds none of its partitions).
    let jobs: Vec<NewJob> =
        (0..40).map(|i| job(&format!("doc-{i}"), 1, json!({ "text": "x" }))).collect();
    accept_all(&acceptor, &it, &jobs).await;
    eventually(Duration::from_secs(60), "every job to finish", || all_finished(&it, 40)).await;

    // A second process under b's name: b is fenced, and stops naming the setting.
    let _twin = Service::start("jobfold-test-processor", &named("proc-b"));
    let status = b.wait_exit(Duration::from_secs(60)).expect("the fenced processor stops");
    assert!(!status.success());
    let log = b.log_text();
    assert!(
        log.contains("processor.group_instance_id \"proc-b\"")
            && log.contains("another process joined under it"),
        "{log}"
    );
    it.cleanup().await;
}

/// A named processor killed while it hands partitions on — its revoke waiting for running
/// jobs — and started again under its name at once: Kafka hands the new process the old
/// one's assignment with no rebalance, and the partitions that were on their way to the
/// other member belong to no one, for good. The processors see it past
/// `processor.revoke_timeout`, the session time-out and a look
/// (`processor.assignment_check`), one leaves and rejoins, and every partition is held
/// again: new jobs on each run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_a_named_processor_died_handing_on_are_given_out_again() {
    let (it, acceptor) = fast_installation("proc-orphans").await;
    let mut env = fast_env(&it);
    // Longer than a restart: the dead member is replaced under its name, not timed out.
    env.insert("JOBFOLD_KAFKA__SESSION_TIMEOUT_MS".into(), "20000".into());
    env.insert("JOBFOLD_PROCESSOR__REVOKE_TIMEOUT".into(), "10s".into());
    env.insert("JOBFOLD_PROCESSOR__ASSIGNMENT_CHECK".into(), "1s".into());
    let named = |name: &str| named(&env, name);
    let _relay = Service::start("jobfold-relay", &env);
    let mut a = Service::start("jobfold-test-processor", &named("proc-a"));
    let total = f64::from(it.config.topics.partitions);
    let assigned = "jobfold_assigned_partitions";
    eventually(Duration::from_secs(60), "a to hold every partition", || async {
        a.metric(assigned).await == Some(total)
    })
    .await;
    // Jobs running for minutes on every partition: a revoke waits for them.
    let long: Vec<NewJob> = (0..48)
        .map(|i| {
            job(
                &format!("long-{i}"),
                1,
                json!({ "text": "x", "simulate": { "sleep_ms": 600_000 } }),
            )
        })
        .collect();
    accept_all(&acceptor, &it, &long).await;
    eventually(Duration::from_secs(60), "the long jobs to run in a", || async {
        count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'leased'").await == 48
    })
    .await;
    // b joins: a keeps half, and revokes the other half for b, waiting on its jobs; b is
    // given nothing until a has revoked them and the group rebalances again.
    let b = Service::start("jobfold-test-processor", &named("proc-b"));
    eventually(Duration::from_secs(60), "b's first assignment", || async {
        b.metric("jobfold_group_rebalances_total").await.unwrap_or(0.0) >= 1.0
    })
    .await;
    a.kill9();
    let again = Service::start("jobfold-test-processor", &named("proc-a"));
    eventually(Duration::from_secs(180), "every partition held again", || async {
        let held = (again.metric(assigned).await, b.metric(assigned).await);
        matches!(held, (Some(x), Some(y)) if x > 0.0 && y > 0.0 && x + y == total)
    })
    .await;
    let rejoins = again.metric("jobfold_group_rejoins_total").await.unwrap_or(0.0)
        + b.metric("jobfold_group_rejoins_total").await.unwrap_or(0.0);
    assert!(
        rejoins >= 1.0,
        "a processor rejoined to give the unowned partitions out:\n{}\n{}",
        again.log_text(),
        b.log_text()
    );
    let quick: Vec<NewJob> =
        (0..40).map(|i| job(&format!("quick-{i}"), 1, json!({ "text": "x" }))).collect();
    accept_all(&acceptor, &it, &quick).await;
    eventually(Duration::from_secs(60), "a job on every partition to run", || async {
        count_where(
            &it,
            "SELECT count(*) FROM jobs WHERE document_id LIKE 'quick-%' AND state = 'succeeded'",
        )
        .await
            == 40
    })
    .await;
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_messages_among_a_thousand_each_become_one_dead_letter() {
    use rdkafka::message::{Header, OwnedHeaders};
    let (it, acceptor) = fast_installation("proc-poison").await;
    // The poison sits at the head of a partition, before the good events. Two more
    // undecodable messages name their kind in the `jobfold-event` header: the one naming a
    // kind processors do not act on is passed over without being decoded; the one naming a
    // dispatch is decoded, and dead-lettered like the first.
    let producer: rdkafka::producer::FutureProducer =
        jobfold_tests::kafka::client_config().create().unwrap();
    for (key, kind) in
        [("doc-3", None), ("doc-5", Some("JobSucceeded")), ("doc-7", Some("RetryDue"))]
    {
        let mut record = rdkafka::producer::FutureRecord::to(&it.config.topics.events)
            .key(key)
            .payload(&b"\x00\x00\x00\x00\x07garbage"[..]);
        if let Some(kind) = kind {
            record = record.headers(
                OwnedHeaders::new().insert(Header { key: "jobfold-event", value: Some(kind) }),
            );
        }
        producer.send(record, rdkafka::util::Timeout::Never).await.map_err(|(e, _)| e).unwrap();
    }
    let jobs: Vec<NewJob> = (0..1000)
        .map(|i| job(&format!("doc-{}", i % 100), 1 + i / 100, json!({ "text": "w" })))
        .collect();
    for chunk in jobs.chunks(100) {
        acceptor.accept_batch(&it.pool, chunk).await.unwrap();
    }
    let pipeline = Pipeline::start(&it, true);
    eventually(Duration::from_secs(120), "every job to finish", || all_finished(&it, 1000)).await;
    pipeline.stop().await;
    let dead: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT raw_key FROM dead_letters ORDER BY raw_key")
            .fetch_all(&it.pool)
            .await
            .unwrap();
    assert_eq!(dead, [b"doc-3".to_vec(), b"doc-7".to_vec()], "doc-5's message was passed over");
    let succeeded = count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'succeeded'").await;
    let superseded = count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'superseded'").await;
    assert_eq!(succeeded + superseded, 1000);
    assert_eq!(
        count_where(&it, "SELECT count(*) FROM jobs WHERE result IS NOT NULL").await,
        succeeded
    );
    assert_exactly_one_write_per_success(&it).await;
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quarantined_job_replayed_with_a_new_input_version_succeeds() {
    let (it, acceptor) = fast_installation("proc-replay").await;
    let pipeline = Pipeline::start(&it, true);
    let ids =
        accept_all(&acceptor, &it, &[job("doc-fix", 1, json!({ "body": "no text field" }))]).await;
    eventually(Duration::from_secs(60), "the invalid job to be quarantined", || async {
        count_where(&it, "SELECT count(*) FROM quarantine").await == 1
    })
    .await;

    // The operator sees it in the CLI, with its class and owner.
    let listed = std::process::Command::new(jobfold_tests::harness::binary("jobfold"))
        .args(["quarantine", "list"])
        .envs(it.env())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    assert!(text.contains(&ids[0].to_string()) && text.contains("INVALID_INPUT"), "{text}");
    assert!(text.contains("jobfold-operators"), "{text}");

    // Serve the API here and replay through it.
    let app = jobfold_processor::http::router(it.api_state().await, 1 << 20);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = reqwest::Client::new();
    let replay =
        |body: Value| client.post(format!("{url}/v1/jobs/{}/replay", ids[0])).json(&body).send();

    let stale =
        replay(json!({ "new_input_version": 1, "new_input": { "text": "x" } })).await.unwrap();
    assert_eq!(stale.status().as_u16(), 422, "a replay must raise the input version");
    let fixed = replay(json!({ "new_input_version": 2, "new_input": { "text": "fixed now" }, "requested_by": "ops" }))
        .await
        .unwrap();
    assert_eq!(fixed.status().as_u16(), 202);
    eventually(Duration::from_secs(60), "the replayed job to succeed", || async {
        count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'succeeded'").await == 1
    })
    .await;
    let again = replay(json!({})).await.unwrap();
    assert_eq!(again.status().as_u16(), 409, "only quarantined jobs are replayed");
    let missing =
        client.post(format!("{url}/v1/jobs/{}/replay", Uuid::new_v4())).send().await.unwrap();
    assert_eq!(missing.status().as_u16(), 404);
    pipeline.stop().await;

    let (version, words): (i64, Value) =
        sqlx::query_as("SELECT version, output FROM document_index WHERE document_id = 'doc-fix'")
            .fetch_one(&it.pool)
            .await
            .unwrap();
    assert_eq!(version, 2);
    assert_eq!(words["terms"]["fixed"], 1);
    assert_eq!(count_where(&it, "SELECT count(*) FROM quarantine").await, 0);
    assert_exactly_one_write_per_success(&it).await;
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_stop_at_the_time_budget() {
    let mut it = Installation::new("proc-deadline").await;
    fast(&mut it);
    // Plenty of attempts, but only five seconds from acceptance: time for several (each
    // retried within 400 ms), also on a loaded machine, where the first may take seconds to
    // be dispatched.
    it.config.accept.default_max_attempts = 1000;
    it.config.accept.default_deadline = Some(Duration::from_secs(5));
    it.config.processor.retry_base = Duration::from_millis(200);
    it.config.processor.retry_cap = Duration::from_millis(400);
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let pipeline = Pipeline::start(&it, true);
    let started = std::time::Instant::now();
    let ids = accept_all(
        &acceptor,
        &it,
        &[job("doc-late", 1, json!({ "text": "t", "simulate": { "fail_attempts": 1000 } }))],
    )
    .await;
    eventually(Duration::from_secs(60), "the job to be quarantined", || all_finished(&it, 1)).await;
    pipeline.stop().await;
    let (state, attempt, reason): (String, i32, String) = sqlx::query_as(
        "SELECT j.state::text, j.attempt, q.reason FROM jobs j JOIN quarantine q USING (job_id) \
         WHERE j.job_id = $1",
    )
    .bind(ids[0])
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(state, "quarantined");
    assert!(reason.contains("time budget"), "{reason}");
    assert!(attempt > 1 && attempt < 1000, "{attempt} attempts");
    // Its last attempt failed with the next one due past the deadline: at most the retry
    // cap (400 ms) before it.
    assert!(started.elapsed() >= Duration::from_secs(4), "quarantined before the budget ran out");
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeats_keep_a_long_job_leased_by_one_generation() {
    let (it, acceptor) = fast_installation("proc-heartbeat").await;
    let pipeline = Pipeline::start(&it, true);
    // Runs 7 s with a 3 s lease: only heartbeats keep it.
    let ids = accept_all(
        &acceptor,
        &it,
        &[job("doc-long", 1, json!({ "text": "long", "simulate": { "sleep_ms": 7000 } }))],
    )
    .await;
    eventually(Duration::from_secs(30), "the job to be leased", || async {
        count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'leased'").await == 1
    })
    .await;
    // Renewed past the lease it was first given, by the same generation, while it runs.
    let lease = "SELECT generation, lease_until FROM jobs WHERE job_id = $1 AND state = 'leased'";
    let (first_generation, first_until): (i64, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as(lease).bind(ids[0]).fetch_one(&it.pool).await.unwrap();
    eventually(Duration::from_secs(10), "a heartbeat to renew the lease", || async {
        let now: Option<(i64, chrono::DateTime<chrono::Utc>)> =
            sqlx::query_as(lease).bind(ids[0]).fetch_optional(&it.pool).await.unwrap();
        let (generation, until) = now.expect("the lease lapsed while the handler was running");
        assert_eq!(generation, first_generation, "leased again while it ran");
        until > first_until + chrono::Duration::seconds(2)
    })
    .await;
    eventually(Duration::from_secs(30), "the job to succeed", || all_finished(&it, 1)).await;
    pipeline.stop().await;
    let (state, generation): (String, i64) =
        sqlx::query_as("SELECT state::text, generation FROM jobs WHERE job_id = $1")
            .bind(ids[0])
            .fetch_one(&it.pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), generation), ("succeeded", 1), "no second generation was needed");
    it.cleanup().await;
}

/// One statement a beat keeps all of a processor's leases alive: 200 leases renewed together
/// carry one `lease_until` (one statement's `now()`); a row another transaction holds is
/// skipped, neither waited for (the others are renewed on time) nor taken as lost; a lease
/// another generation took fires its token alone; a dropped registration is renewed no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_heartbeat_statement_keeps_every_lease_alive_and_a_locked_row_holds_none_back() {
    use jobfold_processor::heartbeat::Heartbeats;
    let (it, acceptor) = fast_installation("proc-beats").await;
    let jobs: Vec<NewJob> =
        (0..200).map(|n| job(&format!("doc-beat-{n}"), 1, json!({ "text": "x" }))).collect();
    let ids = accept_all(&acceptor, &it, &jobs).await;
    // Leased by generation 1, as a lease transaction leaves them, with 2 s to run.
    sqlx::query(
        "UPDATE jobs SET state = 'leased', attempt = 1, generation = 1, lease_owner = 'beats', \
         lease_until = now() + interval '2 seconds' WHERE job_id = ANY($1)",
    )
    .bind(&ids)
    .execute(&it.pool)
    .await
    .unwrap();
    let until = |ids: Vec<Uuid>| {
        let pool = it.pool.clone();
        async move {
            sqlx::query_as::<_, (Uuid, chrono::DateTime<chrono::Utc>)>(
                "SELECT job_id, lease_until FROM jobs WHERE job_id = ANY($1)",
            )
            .bind(&ids)
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect::<std::collections::HashMap<_, _>>()
        }
    };
    let before = until(ids.clone()).await;

    let (beats, beat) = Heartbeats::new(it.pool.clone(), Duration::from_millis(300));
    let _beat = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(beat));
    let tokens: Vec<CancellationToken> = ids.iter().map(|_| CancellationToken::new()).collect();
    let mut leases: Vec<_> = ids
        .iter()
        .zip(&tokens)
        .map(|(id, lost)| {
            beats.register(*id, 1, Duration::from_millis(300), Duration::from_secs(2), lost.clone())
        })
        .collect();
    // Job 0's row is held by another transaction (a slow completion, say) the whole time.
    let mut holder = it.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM jobs WHERE job_id = $1 FOR UPDATE")
        .bind(ids[0])
        .execute(&mut *holder)
        .await
        .unwrap();
    eventually(Duration::from_secs(10), "the other leases to be renewed", || async {
        let now = until(ids.clone()).await;
        ids[1..].iter().all(|id| now[id] > before[id])
    })
    .await;
    let renewed = until(ids.clone()).await;
    let times: std::collections::HashSet<_> = ids[1..].iter().map(|id| renewed[id]).collect();
    assert_eq!(times.len(), 1, "199 leases renewed by {} statements, not one", times.len());
    assert_eq!(renewed[&ids[0]], before[&ids[0]], "the locked row was written");
    assert!(!tokens[0].is_cancelled(), "a lease whose row was busy was taken as lost");
    holder.rollback().await.unwrap();
    eventually(Duration::from_secs(10), "the freed lease to be renewed", || async {
        until(vec![ids[0]]).await[&ids[0]] > before[&ids[0]]
    })
    .await;

    // Another generation takes job 1: its handler's token fires, and no other.
    sqlx::query("UPDATE jobs SET generation = 2 WHERE job_id = $1")
        .bind(ids[1])
        .execute(&it.pool)
        .await
        .unwrap();
    eventually(Duration::from_secs(10), "the lost lease's token", || async {
        tokens[1].is_cancelled()
    })
    .await;
    assert_eq!(tokens.iter().filter(|t| t.is_cancelled()).count(), 1);

    // A run inside its lease transaction (an inline window, or a lease taken again after its
    // transaction failed): the row shows generation 2 until generation 3 commits. Its beats
    // neither renew nor cancel it; once it commits they renew it.
    let pending = CancellationToken::new();
    let mut lease_tx = it.pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE jobs SET generation = 3, attempt = 3, lease_until = now() + interval '2 seconds' \
         WHERE job_id = $1",
    )
    .bind(ids[1])
    .execute(&mut *lease_tx)
    .await
    .unwrap();
    let third = beats.register(
        ids[1],
        3,
        Duration::from_millis(300),
        Duration::from_secs(2),
        pending.clone(),
    );
    // Three renewals of the others after it was registered: at least two beats had it due.
    for _ in 0..3 {
        let seen = until(vec![ids[2]]).await[&ids[2]];
        eventually(Duration::from_secs(10), "a beat", || async {
            until(vec![ids[2]]).await[&ids[2]] > seen
        })
        .await;
    }
    assert!(
        !pending.is_cancelled(),
        "a lease its transaction had not committed yet was taken as lost"
    );
    lease_tx.commit().await.unwrap();
    let committed = until(vec![ids[1]]).await[&ids[1]];
    eventually(Duration::from_secs(10), "the committed lease to be renewed", || async {
        until(vec![ids[1]]).await[&ids[1]] > committed
    })
    .await;
    assert!(!pending.is_cancelled());
    drop(third);

    // Registrations dropped: their leases are left to run out. A beat under way when they
    // were dropped may still renew them; one that began after it may not.
    leases.truncate(100);
    let renewals = |n: usize| {
        let (ids, until) = (&ids, &until);
        async move {
            for _ in 0..n {
                let seen = until(vec![ids[2]]).await[&ids[2]];
                eventually(Duration::from_secs(10), "a beat", || async {
                    until(vec![ids[2]]).await[&ids[2]] > seen
                })
                .await;
            }
        }
    };
    renewals(2).await;
    let dropped = until(ids[100..].to_vec()).await;
    renewals(2).await;
    assert_eq!(until(ids[100..].to_vec()).await, dropped, "dropped leases were still renewed");
    let kept = until(ids[2..100].to_vec()).await;
    assert!(ids[2..100].iter().all(|id| kept[id] > dropped.values().max().copied().unwrap()));
    drop(leases);
    it.cleanup().await;
}

#[tokio::test]
async fn an_append_after_another_write_of_its_transaction_is_refused() {
    let it = Installation::new("proc-order").await;
    let acceptor = it.acceptor().await;
    let events = it.events().await;
    let ids = accept_all(&acceptor, &it, &[job("doc-order", 1, json!({ "text": "x" }))]).await;

    // A transaction with an xid from before it locked the job could commit an event with a
    // lower xid than the job's previous one: the relay would publish them out of order.
    let mut tx = it.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()").execute(&mut *tx).await.unwrap();
    let mut job = jobfold_processor::store::lock_job(&mut tx, ids[0]).await.unwrap().unwrap();
    assert!(!job.fresh_xid);
    let due = jobfold_schemas::Payload::RetryDue(jobfold_schemas::event::RetryDue {
        due_at: chrono::Utc::now(),
        reason: jobfold_schemas::event::DispatchReason::Stalled,
    });
    let refused = events.append(&mut tx, &mut job, due.clone(), None, None).await;
    assert!(refused.unwrap_err().to_string().contains("out of order"));
    tx.rollback().await.unwrap();

    // Locked first, the same append goes through.
    let mut tx = it.pool.begin().await.unwrap();
    let mut job = jobfold_processor::store::lock_job(&mut tx, ids[0]).await.unwrap().unwrap();
    assert!(job.fresh_xid);
    events.append(&mut tx, &mut job, due, None, None).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(it.count("job_events").await, 2);
    it.cleanup().await;
}

/// The processor moves its jobs by the schemas crate's state machine, the one the fold uses:
/// an event it refuses for the job's state is not written, and an accepted one sets the
/// state the job row gets.
#[tokio::test]
async fn an_append_the_state_machine_refuses_is_not_written() {
    use jobfold_schemas::Status;
    let it = Installation::new("proc-machine").await;
    let acceptor = it.acceptor().await;
    let events = it.events().await;
    let ids = accept_all(&acceptor, &it, &[job("doc-machine", 1, json!({ "text": "x" }))]).await;
    let succeeded = jobfold_schemas::Payload::JobSucceeded(jobfold_schemas::event::JobSucceeded {
        generation: 0,
        attempt: 0,
        result: "{}".into(),
        lease: None,
    });

    // Queued: a JobSucceeded without a lease cannot follow.
    let mut tx = it.pool.begin().await.unwrap();
    let mut job = jobfold_processor::store::lock_job(&mut tx, ids[0]).await.unwrap().unwrap();
    assert_eq!(job.state, Status::Queued);
    let refused = events.append(&mut tx, &mut job, succeeded, None, None).await.unwrap_err();
    let refused = refused.to_string();
    assert!(refused.contains("JobSucceeded cannot follow state queued"), "{refused}");
    assert!(refused.contains("allowed only in leased"), "{refused}");
    assert_eq!((job.state, job.stream_version), (Status::Queued, 1), "nothing moved");
    tx.rollback().await.unwrap();

    // A cancellation can: the state is the machine's.
    let mut tx = it.pool.begin().await.unwrap();
    let mut job = jobfold_processor::store::lock_job(&mut tx, ids[0]).await.unwrap().unwrap();
    let cancel = jobfold_schemas::Payload::JobCancelled(jobfold_schemas::event::JobCancelled {
        requested_by: "test".into(),
        reason: "no longer wanted".into(),
    });
    events.append(&mut tx, &mut job, cancel, None, None).await.unwrap();
    assert_eq!(job.state, Status::Cancelled);
    tx.rollback().await.unwrap();
    assert_eq!(it.count("job_events").await, 1);
    it.cleanup().await;
}

/// Holds every run until `together` runs have started, so their completions arrive at once.
/// The business write of `doc-bad`'s first attempt fails.
struct Together {
    started: Arc<std::sync::atomic::AtomicUsize>,
    together: usize,
}

impl jobfold_processor::handler::Handler for Together {
    async fn run(
        &self,
        _job: &JobContext,
        _cancel: CancellationToken,
    ) -> Result<Value, jobfold_processor::handler::HandlerError> {
        use std::sync::atomic::Ordering;
        self.started.fetch_add(1, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.started.load(Ordering::SeqCst) < self.together
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(json!({}))
    }

    async fn commit(
        &self,
        tx: &mut sqlx::PgConnection,
        job: &JobContext,
        _output: &Value,
    ) -> Result<jobfold_processor::handler::Committed, sqlx::Error> {
        if job.document_id == "doc-bad" && job.attempt == 1 {
            sqlx::query("SELECT 1 / 0").execute(&mut *tx).await?;
        }
        jobfold_tests::handlers::record_write(tx, job).await?;
        Ok(jobfold_processor::handler::Committed::Applied)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatches_and_attempts_arriving_together_share_a_transaction() {
    const JOBS: usize = 12;
    let (it, acceptor) = fast_installation("proc-together").await;
    let jobs: Vec<NewJob> =
        (0..JOBS).map(|i| job(&format!("doc-{i}"), 1, json!({ "text": "x" }))).collect();
    accept_all(&acceptor, &it, &jobs).await;

    let handler = Together { started: Default::default(), together: JOBS };
    let pipeline =
        Pipeline::with_handlers(&it, Handlers::new().with("index-document", handler)).await;
    eventually(Duration::from_secs(60), "every job to succeed", || all_finished(&it, JOBS as i64))
        .await;
    pipeline.stop().await;

    assert_eq!(states(&it).await, [("succeeded".into(), JOBS as i64)]);
    assert_exactly_one_write_per_success(&it).await;
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    // Several leases, and several successes, were committed by one transaction.
    let leases = logged_leases(&it.pool, None).await;
    let most_leases = leases
        .iter()
        .map(|l| leases.iter().filter(|other| other.xid == l.xid).count())
        .max()
        .unwrap_or(0);
    assert!(most_leases >= 2, "no transaction took two leases: {leases:?}");
    let most: i64 = sqlx::query_scalar(
        "SELECT max(n) FROM (SELECT count(*) AS n FROM job_events WHERE kind = 'JobSucceeded' \
         GROUP BY xid) t",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert!(most >= 2, "no transaction wrote two JobSucceeded events");
    it.cleanup().await;
}

/// Leases `job_id` through `leaser` as its `JobRequested` would, and returns its attempt
/// finished with `result`.
async fn leased_attempt(
    it: &Installation,
    leaser: &jobfold_processor::lease::Leaser,
    job_id: Uuid,
    result: Result<Value, jobfold_processor::handler::HandlerError>,
) -> std::sync::Arc<jobfold_processor::complete::Attempt> {
    use jobfold_processor::lease::{Dispatch, Leased, Request};
    let event_id: Uuid = sqlx::query_scalar("SELECT event_id FROM job_events WHERE job_id = $1")
        .bind(job_id)
        .fetch_one(&it.pool)
        .await
        .unwrap();
    let dispatch = Dispatch { job_id, event_id, input_version: 1, stream_version: 1, trace: None };
    let Leased::Run(leased) = leaser.submit(Request { dispatch, inline: None }).await.unwrap()
    else {
        panic!("job {job_id} was not leased");
    };
    let context = JobContext {
        job_id: leased.job_id,
        document_id: leased.document_id.clone(),
        kind: leased.kind.clone(),
        input_version: leased.input_version,
        input: leased.payload.clone(),
        attempt: leased.attempt,
        generation: leased.generation,
        trace: None,
        deadline: leased.deadline,
        max_attempts: leased.max_attempts,
        previous_outcome: Default::default(),
    };
    std::sync::Arc::new(jobfold_processor::complete::Attempt {
        job: *leased,
        context,
        result,
        trace: None,
        released: false,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_run_commits_with_its_lease_and_a_failing_one_costs_only_its_job() {
    let (mut it, acceptor) = fast_installation("proc-inline").await;
    it.config.processor.inline_window = Duration::from_secs(1);
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = Together { started: Arc::clone(&started), together: 0 };
    let pipeline =
        Pipeline::with_handlers(&it, Handlers::new().with("index-document", handler)).await;

    // Runs done within the window: each job's lease and success in one transaction.
    let good: Vec<NewJob> =
        (0..8).map(|i| job(&format!("doc-{i}"), 1, json!({ "text": "x" }))).collect();
    accept_all(&acceptor, &it, &good).await;
    eventually(Duration::from_secs(60), "every job to succeed", || all_finished(&it, 8)).await;
    let leases = logged_leases(&it.pool, None).await;
    assert_eq!(leases.iter().filter(|l| l.with_success).count(), 8, "{leases:?}");
    assert_eq!(leases.len(), 8, "a JobLeased of its own for a run done in the window: {leases:?}");

    // A business write Postgres refuses, run with others in one lease transaction: the
    // transaction fails, its leases are taken again on their own, and the attempts already
    // run complete after them — the bad one quarantined with the reason, none run twice.
    let mut more: Vec<NewJob> =
        (8..12).map(|i| job(&format!("doc-{i}"), 1, json!({ "text": "x" }))).collect();
    more.push(job("doc-bad", 1, json!({ "text": "x" })));
    accept_all(&acceptor, &it, &more).await;
    eventually(Duration::from_secs(60), "the new jobs to end", || async {
        count_where(&it, "SELECT count(*) FROM jobs WHERE state IN ('succeeded', 'quarantined')")
            .await
            == 13
    })
    .await;
    pipeline.stop().await;
    assert_eq!(states(&it).await, [("quarantined".into(), 1), ("succeeded".into(), 12)]);
    let reason: String =
        sqlx::query_scalar("SELECT reason FROM quarantine").fetch_one(&it.pool).await.unwrap();
    assert!(reason.contains("22012"), "{reason}");
    assert_eq!(started.load(std::sync::atomic::Ordering::SeqCst), 13, "one run a job");
    assert_eq!(count_where(&it, "SELECT count(*) FROM jobs WHERE generation <> 1").await, 0);
    assert_exactly_one_write_per_success(&it).await;
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_business_write_fails_its_attempt_alone() {
    use jobfold_processor::complete::{self, Completed};
    use jobfold_processor::lease;

    let it = Installation::new("proc-batchfail").await;
    let acceptor = it.acceptor().await;
    let mut jobs: Vec<NewJob> =
        (0..5).map(|i| job(&format!("doc-{i}"), 1, json!({ "text": "x" }))).collect();
    jobs.push(job("doc-bad", 1, json!({ "text": "x" })));
    let ids = accept_all(&acceptor, &it, &jobs).await;
    let events = it.events().await;

    // Lease all six (as dispatches arriving together would be).
    let leaser = lease::start(
        lease::Settings {
            config: it.config.clone(),
            pool: it.pool.clone(),
            events: events.clone(),
            owner: "test".into(),
            handlers: jobfold_tests::handlers::handlers(),
            wary: lease::Wary::default(),
        },
        &jobfold_processor::supervise::Work::default(),
    );
    let mut attempts = Vec::new();
    for job_id in &ids {
        attempts.push(leased_attempt(&it, &leaser, *job_id, Ok(json!({}))).await);
    }

    // One batch: the bad business write fails the transaction; each attempt is then
    // completed alone, and only the bad one fails. Its failure is a data error (division by
    // zero, SQLSTATE 22012): writing it again would fail the same way, so its job is
    // quarantined with the reason instead of being run again for ever.
    let handler = Handlers::new()
        .with("index-document", Together { started: Default::default(), together: 0 });
    let done = complete::complete_all(&it.config, &it.pool, &events, &handler, &attempts).await;
    for (attempt, done) in attempts.iter().zip(&done) {
        match (attempt.context.document_id.as_str(), done) {
            ("doc-bad", Ok(Completed::Committed { outcome: "quarantined", .. })) => {}
            (document, Ok(Completed::Committed { outcome: "succeeded", .. }))
                if document != "doc-bad" => {}
            (document, other) => panic!("{document}: {other:?}"),
        }
    }
    assert_eq!(states(&it).await, [("quarantined".into(), 1), ("succeeded".into(), 5)]);
    let reason: String =
        sqlx::query_scalar("SELECT reason FROM quarantine").fetch_one(&it.pool).await.unwrap();
    assert!(reason.contains("22012") && reason.contains("division by zero"), "{reason}");
    assert_exactly_one_write_per_success(&it).await;
    let consumed = count_where(&it, "SELECT count(*) FROM jobs WHERE dispatch_version = 1").await;
    assert_eq!(consumed, 6, "every dispatch is done with, the bad one too");

    // A result Postgres cannot store (U+0000 in jsonb, should a handler's output get past
    // the processor's check) quarantines its job the same way.
    let nul = job("doc-nul", 1, json!({ "text": "x" }));
    let id = accept_all(&acceptor, &it, &[nul]).await[0];
    let attempt = leased_attempt(&it, &leaser, id, Ok(json!({ "t": "a\u{0}b" }))).await;
    let done = complete::complete_all(&it.config, &it.pool, &events, &handler, &[attempt]).await;
    assert!(matches!(done[0], Ok(Completed::Committed { outcome: "quarantined", .. })), "{done:?}");
    it.cleanup().await;
}

/// Jobs a death found running before (one crash, a death short of being suspects) run inside
/// a lease transaction's window one at a time in a process: dispatched together, one is
/// offered its run and the others wait for a later transaction, so that the next death —
/// should one of them have caused the first — charges that one again and not all of them.
/// Once the transaction holding the turn ends, the next one is offered its run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_a_death_found_running_run_inside_lease_transactions_one_at_a_time() {
    use jobfold_processor::lease::{self, Dispatch, Inline, Leased, Request};
    let (it, acceptor) = fast_installation("proc-apart").await;
    assert_eq!(it.config.processor.max_crashes, 3);
    let jobs: Vec<NewJob> =
        (0..5).map(|i| job(&format!("doc-{i}"), 1, json!({ "text": "x" }))).collect();
    let ids = accept_all(&acceptor, &it, &jobs).await;
    sqlx::query(
        "INSERT INTO job_counters (job_id, crashes, last_crash_owner, last_crash_at) \
         SELECT unnest($1::uuid[]), 1, 'a process that died', now()",
    )
    .bind(&ids)
    .execute(&it.pool)
    .await
    .unwrap();
    let leaser = lease::start(
        lease::Settings {
            config: it.config.clone(),
            pool: it.pool.clone(),
            events: it.events().await,
            owner: "test".into(),
            handlers: jobfold_tests::handlers::handlers(),
            wary: lease::Wary::default(),
        },
        &jobfold_processor::supervise::Work::default(),
    );
    // Each dispatch offers an inline run; one offered is held (never answered), so its
    // transaction stays open for the whole window and then commits the lease alone. The
    // events are read first, so that a round's dispatches come in together.
    let round = |ids: Vec<Uuid>| {
        let (leaser, pool) = (leaser.clone(), it.pool.clone());
        async move {
            let mut dispatched = Vec::with_capacity(ids.len());
            for job_id in ids {
                let event_id: Uuid =
                    sqlx::query_scalar("SELECT event_id FROM job_events WHERE job_id = $1")
                        .bind(job_id)
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                dispatched.push((job_id, event_id));
            }
            let tasks: Vec<_> = dispatched
                .into_iter()
                .map(|(job_id, event_id)| {
                    let leaser = leaser.clone();
                    tokio::spawn(async move {
                        let dispatch = Dispatch {
                            job_id,
                            event_id,
                            input_version: 1,
                            stream_version: 1,
                            trace: None,
                        };
                        let (run, offered) = tokio::sync::oneshot::channel();
                        let inline = Some(Inline { window: Duration::from_millis(300), run });
                        let leased = leaser.submit(Request { dispatch, inline }).await.unwrap();
                        (job_id, leased, offered.await.is_ok())
                    })
                })
                .collect();
            let mut out = Vec::new();
            for task in tasks {
                out.push(task.await.unwrap());
            }
            out
        }
    };
    let mut waiting = ids.clone();
    for left in (1..=5).rev() {
        let decided = round(waiting).await;
        let offered: Vec<_> = decided.iter().filter(|(_, _, offered)| *offered).collect();
        assert_eq!(offered.len(), 1, "one run offered at a time: {decided:?}");
        assert!(matches!(offered[0].1, Leased::RunOn), "{decided:?}");
        waiting = decided
            .iter()
            .filter(|(_, leased, _)| matches!(leased, Leased::WaitUntil(_)))
            .map(|(job_id, _, _)| *job_id)
            .collect();
        assert_eq!(waiting.len(), left - 1, "the others wait: {decided:?}");
    }
    let leased = count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'leased'").await;
    assert_eq!(leased, 5, "each in turn");
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_appends_only_to_jobs_no_later_transaction_wrote() {
    let it = Installation::new("proc-late").await;
    // As operations lock jobs, and as a lease transaction does (with the newest versions
    // succeeded, in the same statement as the check).
    for with_newest in [false, true] {
        appends_only_to_jobs_no_later_transaction_wrote(&it, with_newest).await;
    }
    it.cleanup().await;
}

async fn appends_only_to_jobs_no_later_transaction_wrote(it: &Installation, with_newest: bool) {
    use jobfold_processor::store;
    let acceptor = it.acceptor().await;
    let events = it.events().await;
    let jobs: Vec<NewJob> = ["doc-a", "doc-b", "doc-c"]
        .iter()
        .map(|d| job(&format!("{d}-{with_newest}"), 1, json!({ "text": "x" })))
        .collect();
    let ids = accept_all(&acceptor, it, &jobs).await;
    let (a, b, c) = (ids[0], ids[1], ids[2]);
    let due = || {
        jobfold_schemas::Payload::RetryDue(jobfold_schemas::event::RetryDue {
            due_at: chrono::Utc::now(),
            reason: jobfold_schemas::event::DispatchReason::Stalled,
        })
    };
    let lock = move |mut tx: sqlx::Transaction<'static, sqlx::Postgres>, ids: Vec<uuid::Uuid>| async move {
        let rows = if with_newest {
            let rows = store::lock_jobs_and_newest(&mut tx, &ids).await.unwrap();
            assert!(rows.iter().all(|(_, newest)| newest.is_none()), "none succeeded yet");
            rows.into_iter().map(|(row, _)| row).collect()
        } else {
            store::lock_jobs(&mut tx, &ids).await.unwrap()
        };
        (tx, rows)
    };

    // A batch locks `a` first, which gives it its xid.
    let (batch, rows) = lock(it.pool.begin().await.unwrap(), vec![a]).await;
    assert!(rows[0].fresh_xid);
    // A transaction begun later (a higher xid) locks `b` and appends to it.
    let mut later = it.pool.begin().await.unwrap();
    let mut b_row = store::lock_job(&mut later, b).await.unwrap().unwrap();
    events.append(&mut later, &mut b_row, due(), None, None).await.unwrap();
    // The batch waits for `b` (and takes `c`) ...
    let later_pid: i32 =
        sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *later).await.unwrap();
    let waiting = tokio::spawn(lock(batch, vec![b, c]));
    eventually(Duration::from_secs(10), "the batch to wait for b's lock", || async {
        let blocked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(later_pid)
        .fetch_one(&it.pool)
        .await
        .unwrap();
        blocked == 1
    })
    .await;
    later.commit().await.unwrap();
    let (mut batch, mut rows) = waiting.await.unwrap();
    rows.sort_by_key(|r| r.job_id != b);
    let (b_row, c_row) = rows.split_at_mut(1);
    // ... and may not append to `b`: its xid is below that of `b`'s last event, so the relay
    // would publish the append first. `c`, which no later transaction wrote, is fine.
    assert!(!b_row[0].fresh_xid);
    let refused = events.append(&mut batch, &mut b_row[0], due(), None, None).await;
    assert!(refused.unwrap_err().to_string().contains("out of order"));
    assert!(c_row[0].fresh_xid);
    events.append(&mut batch, &mut c_row[0], due(), None, None).await.unwrap();
    batch.commit().await.unwrap();
}

/// A job whose result is larger than `processor.max_output_bytes` (its `JobSucceeded` would
/// be too large for the topic) ends quarantined with the reason, while every other
/// document's jobs and retries succeed, the relay's cursor keeps moving and no event is sent
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_result_too_large_for_the_topic_costs_only_its_own_job() {
    let mut it = Installation::new("proc-large").await;
    fast(&mut it);
    it.config.processor.max_output_bytes = 64 * 1024;
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let pipeline = Pipeline::start(&it, true);

    // 20,000 distinct words: the index's term list is far over 64 KiB.
    let text: String = (0..20_000).map(|i| format!("w{i} ")).collect();
    let mut jobs = vec![job("doc-huge", 1, json!({ "text": text }))];
    for i in 0..30 {
        let simulate = if i % 3 == 0 { json!({ "fail_attempts": 1 }) } else { json!({}) };
        jobs.push(job(&format!("doc-{i}"), 1, json!({ "text": "ok", "simulate": simulate })));
    }
    let ids = accept_all(&acceptor, &it, &jobs).await;
    eventually(Duration::from_secs(60), "every job to finish", || all_finished(&it, 31)).await;
    eventually(Duration::from_secs(30), "every event published", || async {
        it.unpublished().await == 0
    })
    .await;
    pipeline.stop().await;

    let (state, reason): (String, String) = sqlx::query_as(
        "SELECT j.state::text, q.reason FROM jobs j JOIN quarantine q USING (job_id) \
         WHERE j.job_id = $1",
    )
    .bind(ids[0])
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert_eq!(state, "quarantined");
    assert!(reason.contains("max_output_bytes (65536"), "{reason}");
    assert_eq!(states(&it).await, [("quarantined".into(), 1), ("succeeded".into(), 30)]);
    let retried = count_where(&it, "SELECT count(*) FROM jobs WHERE attempt = 2").await;
    assert_eq!(retried, 10, "the retries ran and succeeded");
    assert_eq!(it.count("relay_parked").await, 0);
    let logged = it.count("job_events").await;
    assert_eq!(jobfold_tests::harness::events_on_topic(&it), logged, "each event once on Kafka");
    assert_exactly_one_write_per_success(&it).await;
    it.cleanup().await;
}

/// A job whose `JobRequested` is as large as accept takes (`accept.max_input_bytes`, of
/// text lz4 cannot shrink) is far larger than what a processor fetches at once (256 KiB a
/// partition, 1 MiB a fetch): it is fetched whole all the same, and runs with the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dispatch_larger_than_a_fetch_is_read_whole_and_runs() {
    let (it, acceptor) = fast_installation("proc-big-input").await;
    let pipeline = Pipeline::start(&it, true);

    // Random letters and digits, nearly as many bytes compressed as not.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let blob: String = (0..it.config.accept.max_input_bytes - 1024)
        .map(|_| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[(seed >> 33) as usize % 36])
        })
        .collect();
    assert!(blob.len() > 512 * 1024, "{}", blob.len());
    let mut jobs = vec![job("doc-big", 1, json!({ "text": "ok", "blob": blob }))];
    jobs.extend((0..20).map(|i| job(&format!("doc-{i}"), 1, json!({ "text": "ok" }))));
    accept_all(&acceptor, &it, &jobs).await;
    eventually(Duration::from_secs(60), "every job to finish", || all_finished(&it, 21)).await;
    pipeline.stop().await;
    assert_eq!(states(&it).await, [("succeeded".into(), 21)]);
    it.cleanup().await;
}

/// A dispatch event whose lease Postgres refuses (a corrupt copy on the topic whose trace
/// state holds U+0000, which the `JobLeased` row cannot store) is dead-lettered with the
/// reason; the partition moves on and the job runs from its genuine event.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dispatch_postgres_refuses_to_lease_is_dead_lettered_and_the_partition_moves_on() {
    use jobfold_schemas::codec::{decode_body, split_frame};
    use jobfold_schemas::event::{JOB_EVENT_SCHEMA, TraceContext};
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let (it, acceptor) = fast_installation("proc-leasenul").await;
    let ids = accept_all(&acceptor, &it, &[job("doc-1", 1, json!({ "text": "x" }))]).await;
    let body: Vec<u8> = sqlx::query_scalar("SELECT body FROM job_events WHERE job_id = $1")
        .bind(ids[0])
        .fetch_one(&it.pool)
        .await
        .unwrap();
    let (_, avro) = split_frame(&body).unwrap();
    let mut forged: jobfold_schemas::JobEvent = decode_body(0, &JOB_EVENT_SCHEMA, avro).unwrap();
    forged.trace = Some(TraceContext {
        traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        tracestate: Some("vendor=a\0b".into()),
    });
    let codec = jobfold_schemas::Codec::<jobfold_schemas::JobEvent>::connect(
        it.registry(),
        &it.config.topics.events,
    )
    .await
    .unwrap();
    let producer: FutureProducer = jobfold_tests::kafka::client_config().create().unwrap();
    producer
        .send(
            FutureRecord::to(&it.config.topics.events)
                .key("doc-1")
                .payload(&codec.encode(&forged).unwrap()),
            rdkafka::util::Timeout::Never,
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();

    let pipeline = Pipeline::start(&it, true);
    eventually(Duration::from_secs(60), "the job to succeed", || all_finished(&it, 1)).await;
    pipeline.stop().await;
    let errors: Vec<String> =
        sqlx::query_scalar("SELECT error FROM dead_letters").fetch_all(&it.pool).await.unwrap();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("22021"), "{errors:?}");
    assert_eq!(states(&it).await, [("succeeded".into(), 1)]);
    it.cleanup().await;
}

/// A processor for `it` with one handler.
fn with_handler(
    it: &Installation,
    kind: &str,
    handler: impl jobfold_processor::handler::Handler,
) -> jobfold_processor::Processor {
    jobfold_processor::Processor::builder(it.config.clone()).handler(kind, handler)
}

/// An embedding service with an HTTP server of its own runs the worker alone: the jobs
/// accepted elsewhere run, and the processor's API address is not served. Without a
/// `callback_base_url` for remote handlers to call back, such a worker does not start.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_embedded_worker_runs_jobs_without_serving_the_api() {
    let (mut it, acceptor) = fast_installation("proc-worker-alone").await;
    let port = jobfold_tests::harness::free_port();
    it.config.http_addr = ([127, 0, 0, 1], port).into();
    let refused = with_handler(&it, "panics-once", PanicsOnce)
        .api(false)
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    let config = refused
        .chain()
        .find_map(|c| c.downcast_ref::<jobfold_common::config::ConfigError>())
        .unwrap_or_else(|| panic!("not a configuration error: {refused:#}"));
    assert!(config.to_string().contains("processor.callback_base_url"), "{config}");

    it.config.processor.callback_base_url = Some("http://127.0.0.1:9/".into());
    let worker =
        with_handler(&it, "panics-once", PanicsOnce).api(false).intake(false).gauges(false);
    let pipeline = Pipeline::with_processor(&it, worker).await;
    let jobs: Vec<NewJob> = (1..=3)
        .map(|d| NewJob { kind: "panics-once".into(), ..job(&format!("doc-w{d}"), 1, json!({})) })
        .collect();
    accept_all(&acceptor, &it, &jobs).await;
    eventually(Duration::from_secs(60), "the jobs to end", || all_finished(&it, 3)).await;
    // The worker ran them, so it is past the point where the API would have been bound.
    let connected = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
    assert!(connected.is_err(), "the API was served: {connected:?}");
    pipeline.stop().await;
    assert_eq!(states(&it).await, [("succeeded".into(), 3)]);
    it.cleanup().await;
}

/// Panics on its first attempt, then succeeds.
#[derive(Debug, Default)]
struct PanicsOnce;

impl jobfold_processor::handler::Handler for PanicsOnce {
    async fn run(
        &self,
        job: &JobContext,
        _cancel: CancellationToken,
    ) -> Result<Value, jobfold_processor::handler::HandlerError> {
        if job.attempt == 1 {
            panic!("boom on attempt {}", job.attempt);
        }
        Ok(json!({ "attempt": job.attempt }))
    }
}

/// A handler that panics costs its own attempt: the job is retried (the panic message as
/// its last error) and succeeds; the heartbeat stops and the document's next job runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_handler_is_retried_and_succeeds() {
    let (it, acceptor) = fast_installation("proc-panic").await;
    let pipeline =
        Pipeline::with_processor(&it, with_handler(&it, "panics-once", PanicsOnce)).await;
    let jobs: Vec<NewJob> = (1..=2)
        .map(|v| NewJob { kind: "panics-once".into(), ..job("doc-p", v, json!({})) })
        .collect();
    let ids = accept_all(&acceptor, &it, &jobs).await;
    eventually(Duration::from_secs(60), "both jobs to end", || all_finished(&it, 2)).await;
    pipeline.stop().await;
    let (state, attempt) = state_and_attempt(&it, ids[1]).await;
    assert_eq!((state.as_str(), attempt), ("succeeded", 2), "retried after the panic");
    let body: Vec<u8> =
        sqlx::query_scalar("SELECT body FROM job_events WHERE job_id = $1 AND kind = 'JobFailed'")
            .bind(ids[1])
            .fetch_one(&it.pool)
            .await
            .unwrap();
    let (_, avro) = jobfold_schemas::codec::split_frame(&body).unwrap();
    let failed: jobfold_schemas::JobEvent =
        jobfold_schemas::codec::decode_body(0, &jobfold_schemas::event::JOB_EVENT_SCHEMA, avro)
            .unwrap();
    let jobfold_schemas::Payload::JobFailed(failed) = failed.payload else { panic!("{failed:?}") };
    assert_eq!(failed.error_class, jobfold_processor::handler::ErrorClass::Retryable);
    assert!(failed.message.contains("panicked: boom on attempt 1"), "{}", failed.message);
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

/// Waits for its cancellation token (or two minutes), and says whether it fired.
#[derive(Debug, Default, Clone)]
struct WaitsForCancel {
    cancelled: std::sync::Arc<std::sync::atomic::AtomicBool>,
    started: std::sync::Arc<tokio::sync::Notify>,
}

impl jobfold_processor::handler::Handler for WaitsForCancel {
    async fn run(
        &self,
        _job: &JobContext,
        cancel: CancellationToken,
    ) -> Result<Value, jobfold_processor::handler::HandlerError> {
        self.started.notify_one();
        tokio::select! {
            _ = cancel.cancelled() => {
                self.cancelled.store(true, std::sync::atomic::Ordering::SeqCst);
                Err(jobfold_processor::handler::HandlerError::retryable("cancelled"))
            }
            _ = tokio::time::sleep(Duration::from_secs(120)) => Ok(json!({})),
        }
    }
}

/// Shutdown lets a running handler go on for `shutdown_timeout`, then cancels it through its
/// token and gives the job back: the cut-short attempt is not counted against the job, whose
/// lease is released and which is due again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_cancels_a_long_handler() {
    let mut it = Installation::new("proc-cancel").await;
    fast(&mut it);
    it.config.processor.revoke_timeout = Duration::from_secs(60);
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let handler = WaitsForCancel::default();
    let (cancelled, started) = (Arc::clone(&handler.cancelled), Arc::clone(&handler.started));
    let pipeline = Pipeline::with_processor(&it, with_handler(&it, "long", handler)).await;
    let long = NewJob { kind: "long".into(), ..job("doc-l", 1, json!({})) };
    let id = accept_all(&acceptor, &it, &[long]).await[0];
    tokio::time::timeout(Duration::from_secs(60), started.notified()).await.expect("it runs");
    // Its lease commits alone once the run outlasts the lease transaction's inline window.
    eventually(Duration::from_secs(10), "the lease to commit", || async {
        state_and_attempt(&it, id).await == ("leased".into(), 1)
    })
    .await;
    pipeline.stop().await;
    assert!(cancelled.load(std::sync::atomic::Ordering::SeqCst), "the token fired");
    let (state, attempt) = state_and_attempt(&it, id).await;
    assert_eq!(attempt, 0, "the attempt is given back");
    assert_ne!(state, "leased", "the lease is given back");
    let error: String = sqlx::query_scalar("SELECT last_error FROM jobs WHERE job_id = $1")
        .bind(id)
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert!(error.starts_with("released: its processor"), "{error}");
    it.cleanup().await;
}

/// A graceful stop (SIGTERM) hands the partitions to the group at once and lets running
/// handlers finish for up to `shutdown_timeout`, then gives back what still runs: a job
/// accepted after the signal is run by the next processor while the stopping one still
/// drains; a job that ends within the timeout succeeds at its one attempt, run once; a job
/// waiting on its token and one deaf to it are given back, their attempts not spent, and the
/// next processor leases them before their first leases (60 s) would have run out — not a
/// lease TTL later, as after `kill -9`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_finishes_what_it_can_and_gives_back_the_rest() {
    let it = Installation::new("proc-graceful").await;
    it.create_topics().await;
    let mut env = it.fast_env(&jobfold_tests::kafka::unique_name("graceful"));
    env.insert("JOBFOLD_PROCESSOR__LEASE_TTL".into(), "60s".into());
    env.insert("JOBFOLD_PROCESSOR__SHUTDOWN_TIMEOUT".into(), "8s".into());
    let _relay = Service::start("jobfold-relay", &env);
    let acceptor = it.acceptor().await;
    let jobs = [
        job("doc-short", 1, json!({ "text": "short", "simulate": { "sleep_ms": 1_500 } })),
        job("doc-long", 1, json!({ "text": "long", "simulate": { "sleep_ms": 12_000 } })),
        job("doc-deaf", 1, json!({ "text": "deaf", "simulate": { "hang_ms": 12_000 } })),
    ];
    let ids = accept_all(&acceptor, &it, &jobs).await;
    let (short, given_back) = (ids[0], [ids[1], ids[2]]);
    let mut first = Service::start("jobfold-test-processor", &env);
    eventually(Duration::from_secs(60), "all three to run", || async {
        count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'leased'").await == 3
    })
    .await;
    let mut leased_until = Vec::new();
    for id in given_back {
        let until: chrono::DateTime<chrono::Utc> =
            sqlx::query_scalar("SELECT lease_until FROM jobs WHERE job_id = $1")
                .bind(id)
                .fetch_one(&it.pool)
                .await
                .unwrap();
        leased_until.push(until);
    }
    first.signal("TERM");
    let _second = Service::start("jobfold-test-processor", &env);
    let after =
        accept_all(&acceptor, &it, &[job("doc-after", 1, json!({ "text": "after" }))]).await[0];
    eventually(Duration::from_secs(60), "the job accepted after the signal to succeed", || async {
        state_and_attempt(&it, after).await.0 == "succeeded"
    })
    .await;
    assert!(
        first.wait_exit(Duration::ZERO).is_none(),
        "the job accepted after the signal ran only once the stopping processor was gone: {}",
        first.log_text()
    );
    let status = first.wait_exit(Duration::from_secs(60)).expect("it stops on its own");
    let log = first.log_text();
    assert!(status.success(), "{status}: {log}");
    assert_eq!(state_and_attempt(&it, short).await, ("succeeded".into(), 1), "{log}");
    assert_eq!(log.matches("the job is given back").count(), 2, "{log}");
    // Its tasks ended before it did: the batchers, each document's, the API's.
    assert!(!log.contains("Stopping without waiting longer for its tasks"), "{log}");

    eventually(Duration::from_secs(120), "the jobs given back to succeed", || async {
        count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'succeeded'").await == 4
    })
    .await;
    for (id, until) in given_back.iter().zip(leased_until) {
        // Leased twice, one attempt spent: the first was given back.
        let leases = logged_leases(&it.pool, Some(*id)).await;
        assert_eq!((leases.len(), state_and_attempt(&it, *id).await.1), (2, 1), "{leases:?}");
        let leased_again = leases[1].leased_at;
        assert!(leased_again < until, "leased again at {leased_again}, its lease ran to {until}");
    }
    let short_leases = logged_leases(&it.pool, Some(short)).await.len();
    assert_eq!(short_leases, 1, "the short job ran once, to its end");
    assert_exactly_one_write_per_success(&it).await;
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    it.cleanup().await;
}

/// Counts its runs; its first business write fails (a statement time-out: the database's
/// trouble, not the job's).
#[derive(Debug, Default, Clone)]
struct CommitFailsOnce {
    runs: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    commits: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl jobfold_processor::handler::Handler for CommitFailsOnce {
    async fn run(
        &self,
        _job: &JobContext,
        _cancel: CancellationToken,
    ) -> Result<Value, jobfold_processor::handler::HandlerError> {
        self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(json!({ "done": true }))
    }

    async fn commit(
        &self,
        tx: &mut sqlx::PgConnection,
        job: &JobContext,
        _output: &Value,
    ) -> Result<jobfold_processor::handler::Committed, sqlx::Error> {
        if self.commits.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            sqlx::query("SET LOCAL statement_timeout = 1").execute(&mut *tx).await?;
            sqlx::query("SELECT pg_sleep(1)").execute(&mut *tx).await?;
        }
        jobfold_tests::handlers::record_write(tx, job).await?;
        Ok(jobfold_processor::handler::Committed::Applied)
    }
}

/// A completion that fails is tried again with the same generation: the handler is not run
/// again for it, and the business write commits once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_completion_does_not_run_the_handler_again() {
    let (it, acceptor) = fast_installation("proc-commitretry").await;
    let handler = CommitFailsOnce::default();
    let (runs, commits) = (Arc::clone(&handler.runs), Arc::clone(&handler.commits));
    let pipeline = Pipeline::with_processor(&it, with_handler(&it, "flaky-commit", handler)).await;
    let flaky = NewJob { kind: "flaky-commit".into(), ..job("doc-c", 1, json!({})) };
    accept_all(&acceptor, &it, &[flaky]).await;
    eventually(Duration::from_secs(60), "the job to succeed", || all_finished(&it, 1)).await;
    pipeline.stop().await;
    assert_eq!(commits.load(std::sync::atomic::Ordering::SeqCst), 2, "the completion ran twice");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1, "the handler ran once");
    let (generation, attempt): (i64, i32) =
        sqlx::query_as("SELECT generation, attempt FROM jobs").fetch_one(&it.pool).await.unwrap();
    assert_eq!((generation, attempt), (1, 1));
    assert_exactly_one_write_per_success(&it).await;
    it.cleanup().await;
}

/// A rolling deploy that adds a kind: a processor without its handler neither runs nor
/// quarantines the kind's jobs; they wait until a processor with the handler runs them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kind_without_a_handler_waits_for_a_processor_that_has_it() {
    let (it, acceptor) = fast_installation("proc-newkind").await;
    let index = with_handler(&it, "index-document", jobfold_tests::handlers::Simulated);
    let old = Pipeline::with_processor(&it, index).await;
    // The new version has started somewhere and registered its kind, so the kind's jobs are
    // accepted; here only the old version runs.
    with_handler(&it, "panics-once", PanicsOnce).register_kinds(&it.pool).await.unwrap();
    let new_kind = NewJob { kind: "panics-once".into(), ..job("doc-new", 1, json!({})) };
    let indexed = job("doc-old", 1, json!({ "text": "x" }));
    let ids = accept_all(&acceptor, &it, &[new_kind, indexed]).await;
    eventually(Duration::from_secs(60), "the known kind to succeed", || async {
        count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'succeeded'").await == 1
    })
    .await;
    // The processor took its dispatch and found no handler: it waits, not leased, not
    // quarantined.
    eventually(Duration::from_secs(30), "the job to wait for its handler", || async {
        metric_here("jobfold_waiting_for_handler", &[]) == Some(1.0)
    })
    .await;
    let (state, attempt) = state_and_attempt(&it, ids[0]).await;
    assert_eq!((state.as_str(), attempt), ("queued", 0));
    old.stop().await;

    // The new version has the handler.
    let new = Pipeline::with_processor(&it, with_handler(&it, "panics-once", PanicsOnce)).await;
    eventually(Duration::from_secs(60), "the new kind's job to succeed", || all_finished(&it, 2))
        .await;
    new.stop().await;
    it.cleanup().await;
}

/// Test handlers whose behaviour is their kind's name: `hangs` ignores its token for two
/// minutes, `chatty` returns 200 bytes, `one-at-a-time` takes 300 ms and counts how many run
/// at once, `long-lease` waits until released.
#[derive(Debug, Default, Clone)]
struct ByKind {
    running: Arc<std::sync::atomic::AtomicUsize>,
    most: Arc<std::sync::atomic::AtomicUsize>,
    release: Arc<tokio::sync::Notify>,
    started: Arc<tokio::sync::Notify>,
}

impl jobfold_processor::handler::Handler for ByKind {
    async fn run(
        &self,
        job: &JobContext,
        _cancel: CancellationToken,
    ) -> Result<Value, jobfold_processor::handler::HandlerError> {
        use std::sync::atomic::Ordering;
        match job.kind.as_str() {
            "hangs" => tokio::time::sleep(Duration::from_secs(120)).await,
            "chatty" => return Ok(json!("x".repeat(200))),
            "one-at-a-time" => {
                let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
                self.most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(300)).await;
                self.running.fetch_sub(1, Ordering::SeqCst);
            }
            _ => {
                self.started.notify_one();
                self.release.notified().await;
            }
        }
        Ok(json!({}))
    }
}

/// `[kinds.<kind>]` settings bound each kind on its own: a run time-out, an attempt budget,
/// an owner, a retry base and cap, an output limit, a concurrency and a lease time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_kind_runs_within_its_own_settings() {
    use jobfold_common::config::Kind;
    let mut it = Installation::new("proc-kinds").await;
    fast(&mut it);
    let kinds = [
        (
            "hangs",
            Kind {
                run_timeout: Some(Duration::from_secs(1)),
                max_attempts: Some(2),
                retry_base: Some(Duration::from_millis(10)),
                retry_cap: Some(Duration::from_millis(20)),
                owner: Some("hang-team".into()),
                ..Kind::default()
            },
        ),
        ("chatty", Kind { max_output_bytes: Some(64), ..Kind::default() }),
        ("one-at-a-time", Kind { concurrency: Some(1), ..Kind::default() }),
        (
            "long-lease",
            Kind {
                lease_ttl: Some(Duration::from_secs(40)),
                heartbeat: Some(Duration::from_secs(10)),
                ..Kind::default()
            },
        ),
    ];
    for (name, kind) in kinds.clone() {
        it.config.kinds.insert(name.into(), kind);
    }
    it.config.validate().unwrap();
    it.create_topics().await;
    let acceptor = it.acceptor().await;
    let handler = ByKind::default();
    let (most, release, started) =
        (Arc::clone(&handler.most), Arc::clone(&handler.release), Arc::clone(&handler.started));
    let mut processor = jobfold_processor::Processor::builder(it.config.clone());
    for (name, _) in &kinds {
        processor = processor.handler(*name, handler.clone());
    }
    let pipeline = Pipeline::with_processor(&it, processor).await;
    let mut jobs = vec![
        NewJob { kind: "hangs".into(), ..job("doc-hang", 1, json!({})) },
        NewJob { kind: "chatty".into(), ..job("doc-chat", 1, json!({})) },
        NewJob { kind: "long-lease".into(), ..job("doc-long", 1, json!({})) },
    ];
    for d in 0..4 {
        jobs.push(NewJob {
            kind: "one-at-a-time".into(),
            ..job(&format!("doc-{d}"), 1, json!({}))
        });
    }
    let ids = accept_all(&acceptor, &it, &jobs).await;

    // The long lease: 40 s, where the global one is 3 s (committed once the run outlasts the
    // inline window).
    tokio::time::timeout(Duration::from_secs(60), started.notified()).await.expect("it runs");
    eventually(Duration::from_secs(10), "the lease to commit", || async {
        state_and_attempt(&it, ids[2]).await.0 == "leased"
    })
    .await;
    let left: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM lease_until - now())::float8 FROM jobs WHERE job_id = $1",
    )
    .bind(ids[2])
    .fetch_one(&it.pool)
    .await
    .unwrap();
    assert!(left > 20.0, "the kind's lease_ttl: {left} s left");
    release.notify_one();
    eventually(Duration::from_secs(60), "every job to end", || all_finished(&it, 7)).await;
    pipeline.stop().await;

    let quarantined: Vec<(String, i32, String, String)> = sqlx::query_as(
        "SELECT j.kind, j.attempt, q.owner, q.reason FROM jobs j JOIN quarantine q USING (job_id) \
         ORDER BY j.kind",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert_eq!(quarantined.len(), 2, "{quarantined:?}");
    let (kind, attempt, owner, reason) = &quarantined[0];
    assert_eq!((kind.as_str(), *attempt), ("chatty", 1));
    assert!(reason.contains("max_output_bytes (64"), "{reason}");
    assert_eq!(owner, "jobfold-operators");
    let (kind, attempt, owner, reason) = &quarantined[1];
    assert_eq!((kind.as_str(), *attempt, owner.as_str()), ("hangs", 2, "hang-team"));
    assert!(reason.contains("budget"), "{reason}");
    let last_error: String = sqlx::query_scalar("SELECT last_error FROM jobs WHERE job_id = $1")
        .bind(ids[0])
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert!(last_error.contains("run_timeout"), "{last_error}");
    assert_eq!(most.load(std::sync::atomic::Ordering::SeqCst), 1, "one at a time");
    assert_eq!(count_where(&it, "SELECT count(*) FROM jobs WHERE state = 'succeeded'").await, 5);
    it.cleanup().await;
}

/// Accepts `jobs` in one transaction (quicker than one each) and has a relay publish them, so
/// a processor started next finds them all on the topic, in this order.
async fn accept_and_publish(it: &Installation, acceptor: &Acceptor, jobs: &[NewJob]) {
    let mut tx = it.pool.begin().await.unwrap();
    for j in jobs {
        acceptor.accept_in(&mut tx, j).await.unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Pipeline::start(it, false);
    eventually(Duration::from_secs(60), "every event to be published", || async {
        it.unpublished().await == 0
    })
    .await;
    relay.stop().await;
}

/// A document with a thousand versions waiting holds one slot, not all of them: the hundred
/// documents accepted after it finish while it is still working through its versions, as
/// they would without it. (Were a waiting message to hold its slot, the busy document's
/// queue would take every slot, and the others would finish only after some 990 of its
/// versions.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_busy_document_does_not_starve_the_others() {
    let (mut it, acceptor) = fast_installation("proc-fair").await;
    it.config.processor.max_in_flight = 8;
    let mut jobs: Vec<NewJob> =
        (1..=1000).map(|v| job("busy", v, json!({ "text": format!("version {v}") }))).collect();
    jobs.extend((0..100).map(|d| job(&format!("quiet-{d}"), 1, json!({ "text": "quiet" }))));
    accept_and_publish(&it, &acceptor, &jobs).await;

    let pipeline = Pipeline::start(&it, true);
    eventually(Duration::from_secs(60), "the quiet documents to finish", || async {
        count_where(
            &it,
            "SELECT count(*) FROM jobs WHERE document_id LIKE 'quiet-%' AND state = 'succeeded'",
        )
        .await
            == 100
    })
    .await;
    let busy_done = count_where(
        &it,
        "SELECT count(*) FROM jobs WHERE document_id = 'busy' AND finished_at IS NOT NULL",
    )
    .await;
    eventually(Duration::from_secs(180), "every job to finish", || all_finished(&it, 1100)).await;
    pipeline.stop().await;
    println!("busy versions finished when the quiet documents were done: {busy_done} of 1000");
    assert!(busy_done < 500, "the quiet documents waited for {busy_done} busy versions");
    assert_eq!(states(&it).await, [("succeeded".into(), 1100)]);
    assert_exactly_one_write_per_success(&it).await;
    it.cleanup().await;
}

/// A partition holding more than `processor.max_buffered` messages is paused and resumed
/// when half is left: with a bound of 20 and 300 versions of one document, the processor
/// pauses (and counts it), and every job still finishes, the partition's other documents
/// too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_over_its_buffer_is_paused_and_resumed() {
    let (it, acceptor) = fast_installation("proc-buffer").await;
    let mut jobs: Vec<NewJob> =
        (1..=300).map(|v| job("busy", v, json!({ "text": format!("version {v}") }))).collect();
    jobs.extend((0..60).map(|d| job(&format!("quiet-{d}"), 1, json!({ "text": "quiet" }))));
    accept_and_publish(&it, &acceptor, &jobs).await;

    let mut env = fast_env(&it);
    env.insert("JOBFOLD_PROCESSOR__MAX_BUFFERED".into(), "20".into());
    let processor = Service::start("jobfold-test-processor", &env);
    eventually(Duration::from_secs(180), "every job to finish", || all_finished(&it, 360)).await;
    let pauses = processor.metric("jobfold_partition_pauses_total").await.unwrap_or(0.0);
    assert!(pauses >= 1.0, "the busy partition was never paused: {pauses}");
    let buffered = processor.metric("jobfold_buffered_messages").await;
    assert_eq!(buffered, Some(0.0), "nothing is held once every job is done");
    assert_eq!(states(&it).await, [("succeeded".into(), 360)]);
    assert_exactly_one_write_per_success(&it).await;
    it.cleanup().await;
}

/// Each retention sweep deletes what ended jobs leave behind and nothing else: the results
/// and events (already on Kafka) of final jobs; the final jobs but each
/// document's newest succeeded version; the quarantined job, waiting for an operator, keeps
/// everything. The kept newest version still supersedes an older one submitted late, and the
/// events topic still holds the whole log.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_deletes_what_ended_jobs_leave_and_keeps_the_newest_version() {
    use jobfold_processor::retention::sweep;
    let (it, acceptor) = fast_installation("proc-retention").await;
    let pipeline = Pipeline::start(&it, true);
    let mut jobs: Vec<NewJob> =
        (1..=3).map(|v| job("doc-a", v, json!({ "text": format!("a {v}") }))).collect();
    jobs.push(job("doc-b", 1, json!({ "text": "b", "simulate": { "permanent": true } })));
    jobs.push(job("doc-c", 1, json!({ "text": "c" })));
    let ids = accept_all(&acceptor, &it, &jobs).await;
    eventually(Duration::from_secs(60), "every job to end", || all_finished(&it, 5)).await;
    eventually(Duration::from_secs(60), "every event on Kafka", || async {
        it.unpublished().await == 0
    })
    .await;
    pipeline.stop().await;
    let events_before = it.count("job_events").await;
    let succeeded = it.count("jobs WHERE state = 'succeeded'").await;
    assert!(succeeded >= 2, "doc-a's newest and doc-c succeed: {succeeded}");
    assert_eq!(it.count("jobs WHERE result IS NOT NULL").await, succeeded, "each success's result");

    for name in ["job_events", "job_results", "jobs"] {
        while sweep(&it.pool, name, Duration::ZERO, 2).await.unwrap() > 0 {}
    }
    let kept: Vec<(String, i64, String)> = sqlx::query_as(
        "SELECT document_id, input_version, state::text FROM jobs ORDER BY document_id",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert_eq!(
        kept,
        [
            ("doc-a".into(), 3, "succeeded".into()),
            ("doc-b".into(), 1, "quarantined".into()),
            ("doc-c".into(), 1, "succeeded".into()),
        ]
    );
    let quarantined = ids[3];
    let left = |table: &'static str| {
        let pool = it.pool.clone();
        async move {
            let sql = format!("SELECT count(*) FILTER (WHERE job_id <> $1), count(*) FROM {table}");
            let (others, all): (i64, i64) =
                sqlx::query_as(&sql).bind(quarantined).fetch_one(&pool).await.unwrap();
            (others, all)
        }
    };
    assert_eq!(
        it.count("jobs WHERE result IS NOT NULL").await,
        0,
        "results of final jobs are gone, from the versions kept too"
    );
    assert_eq!(left("job_events").await.0, 0, "events of final jobs are gone");
    assert!(left("job_events").await.1 >= 4, "the quarantined job keeps its events");
    assert_eq!(it.count("quarantine").await, 1);
    // No foreign key holds events to their job: retention itself leaves none behind a
    // deleted job.
    let orphans = it
        .count("job_events t WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.job_id = t.job_id)")
        .await;
    assert_eq!(orphans, 0, "job_events rows of deleted jobs");
    assert_eq!(
        jobfold_tests::harness::events_on_topic(&it),
        events_before,
        "the events topic holds the whole log"
    );

    // doc-a's version 3 is kept, so a late version 2 is superseded without running.
    let pipeline = Pipeline::start(&it, true);
    let late = acceptor.accept(&it.pool, &job("doc-a", 2, json!({ "text": "late" }))).await;
    let late = late.unwrap().job_id;
    eventually(Duration::from_secs(60), "the late version to end", || async {
        it.state_and_attempt(late).await.0 != "queued"
    })
    .await;
    pipeline.stop().await;
    assert_eq!(it.state_and_attempt(late).await, ("superseded".into(), 0));
    it.cleanup().await;
}

/// Taking a lease writes no index entry: no index of `jobs` names a column the lease
/// changes, so the new row version is heap-only (HOT). An index on `state` (as there was)
/// makes every lease insert into every index of the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_a_heap_only_update() {
    use jobfold_processor::store;
    let it = Installation::new("proc-hot").await;
    let acceptor = it.acceptor().await;
    let events = it.events().await;
    let ids = accept_all(&acceptor, &it, &[job("doc-hot", 1, json!({ "text": "x" }))]).await;

    let mut tx = it.pool.begin().await.unwrap();
    let mut rows = store::lock_jobs(&mut tx, &ids).await.unwrap();
    let event_id = Uuid::now_v7();
    let leases = rows.iter_mut().map(|row| (row, event_id, None)).collect();
    store::take_leases(&mut tx, &events, leases, "test-owner", |_| Duration::from_secs(30))
        .await
        .unwrap();
    // This transaction's own counts for the table, before it commits.
    let (updated, hot): (i64, i64) = sqlx::query_as(
        "SELECT pg_stat_get_xact_tuples_updated('jobs'::regclass), \
                pg_stat_get_xact_tuples_hot_updated('jobs'::regclass)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!((updated, hot), (1, 1), "the lease's update of the job row was not heap-only");
    assert_eq!(state_and_attempt(&it, ids[0]).await, ("leased".to_owned(), 1));
    it.cleanup().await;
}
