//! `jobfold capacity` against a workload whose figures are known: Poisson arrivals at a set
//! rate, each job's service time drawn (and sent with it) from a known distribution, run by
//! the shipped processor over HTTP on real Postgres, Kafka and the registry.
//!
//! It must read the arrival rate and the service-time quantiles back from the event log
//! within a few percent, and the concurrency it recommends for a waiting-time objective
//! must meet that objective when the same workload is run again with that setting.

use std::time::Duration;

use jobfold_common::accept::NewJob;
use jobfold_tests::harness::{Installation, Service, eventually, jobfold_cli};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use uuid::Uuid;

/// Arrivals a second, and how long the workload lasts.
const RATE: f64 = 10.0;
const SECONDS: f64 = 20.0;
/// Service times: uniform in [500, 1500) ms.
const SERVICE_MS: std::ops::Range<u64> = 500..1500;
/// The objective: 99% of queue waits at most 1 s.
const OBJECTIVE: &str = "1s";
const OBJECTIVE_SECONDS: f64 = 1.0;
/// Headroom on service times asked of the tool. Its default (10%) is calibrated on a quiet
/// machine (docs/capacity.md); here the second run shares two cores with the rest of the
/// suite, whose load lengthens each slot's hold (lease and completion commits) by more than
/// the first run saw. At 10% a CI run measured a p99 of 1.085 s against 1 s.
const HEADROOM: &str = "25";
const HEADROOM_SHARE: f64 = 0.25;

/// The workload: (offset from its start in seconds, service time in ms), from a fixed seed.
fn workload() -> Vec<(f64, u64)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(26);
    let mut at = 0.0;
    let mut jobs = Vec::new();
    loop {
        // Exponential gaps: a Poisson process at RATE.
        at += -(1.0 - rng.random::<f64>()).ln() / RATE;
        if at >= SECONDS {
            return jobs;
        }
        jobs.push((at, rng.random_range(SERVICE_MS)));
    }
}

/// The stand-in service: sleeps each job's `ms`, then answers.
async fn sleeper() -> String {
    let app = axum::Router::new().route(
        "/work",
        axum::routing::post(|body: axum::Json<Value>| async move {
            let ms = body["input"]["ms"].as_u64().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            axum::Json(json!({"slept_ms": ms}))
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Runs the workload open loop — each job accepted at its own time by a task of its own, so
/// a slow accept delays no other — and waits for it to end. Returns the window it was
/// accepted in: its length, and a quarter second for the last accepts to commit.
async fn run(
    it: &Installation,
    round: &str,
) -> (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) {
    let acceptor = it.acceptor().await;
    let start = tokio::time::Instant::now();
    let since = chrono::Utc::now();
    let mut accepts = tokio::task::JoinSet::new();
    for (i, (at, ms)) in workload().into_iter().enumerate() {
        let (acceptor, pool) = (acceptor.clone(), it.pool.clone());
        let job = NewJob {
            document_id: format!("{round}-{i}"),
            kind: "work".into(),
            input_version: 1,
            input: json!({"ms": ms}),
            idempotency_key: None,
            trace: None,
            run_at: None,
        };
        accepts.spawn(async move {
            tokio::time::sleep_until(start + Duration::from_secs_f64(at)).await;
            acceptor.accept(&pool, &job).await.unwrap();
        });
    }
    while let Some(done) = accepts.join_next().await {
        done.unwrap();
    }
    let until = since + chrono::Duration::milliseconds((SECONDS * 1000.0) as i64 + 250);
    eventually(Duration::from_secs(120), "the workload to end", || async {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE document_id LIKE $1 AND state <> 'succeeded'",
        )
        .bind(format!("{round}-%"))
        .fetch_one(&it.pool)
        .await
        .unwrap();
        open == 0
    })
    .await;
    // Everything on Kafka too, before the relay stops: the log is read from both.
    eventually(Duration::from_secs(60), "the relay to publish the log", || async {
        it.unpublished().await == 0
    })
    .await;
    (since, until)
}

/// The processor, with `concurrency` for the kind if given.
fn processor(
    it: &Installation,
    url: &str,
    concurrency: Option<usize>,
) -> (Service, Service, std::path::PathBuf) {
    let file =
        std::env::temp_dir().join(format!("jobfold-capacity-{}.toml", Uuid::new_v4().simple()));
    let mut kinds = format!("[kinds.work]\nurl = \"{url}/work\"\n");
    if let Some(c) = concurrency {
        kinds.push_str(&format!("concurrency = {c}\n"));
    }
    std::fs::write(&file, kinds).unwrap();
    let mut env = it.fast_env(&jobfold_tests::kafka::unique_name("capacity"));
    env.insert("JOBFOLD_CONFIG".into(), file.display().to_string());
    (Service::start("jobfold-relay", &env), Service::start("jobfold-processor", &env), file)
}

/// `jobfold capacity` over the window, with the objective; its JSON.
fn capacity(
    it: &Installation,
    from: &str,
    window: (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>),
) -> Value {
    let dir = std::env::temp_dir().join(format!("jobfold-capacity-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, plot) = (dir.join("figures.json"), dir.join("plot.svg"));
    let output = jobfold_cli()
        .envs(it.env())
        .args(["capacity", "--from", from, "--wait", OBJECTIVE, "--headroom", HEADROOM])
        .args(["--since", &window.0.to_rfc3339(), "--until", &window.1.to_rfc3339()])
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("kind work") && stdout.contains("Little's law"), "{stdout}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"), "a plot with lines");
    for panel in ["work: arrivals / s", "work: in service", "work: queue wait p99 (s)"] {
        assert!(svg.contains(panel), "the plot has {panel}");
    }
    let figures: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(dir);
    figures["kinds"].as_array().unwrap().iter().find(|k| k["kind"] == "work").unwrap().clone()
}

/// The most jobs of the workload that overlap when each runs `stretch` times its service
/// time from its arrival: the concurrency at which none would wait.
fn peak_overlap(jobs: &[(f64, u64)], stretch: f64) -> usize {
    let mut edges: Vec<(f64, i32)> = jobs
        .iter()
        .flat_map(|&(at, ms)| [(at, 1), (at + ms as f64 / 1000.0 * stretch, -1)])
        .collect();
    // Ends before starts at the same instant.
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut peak) = (0i32, 0i32);
    for (_, step) in edges {
        now += step;
        peak = peak.max(now);
    }
    peak as usize
}

fn within(measured: f64, known: f64, share: f64, what: &str) {
    assert!(
        (measured - known).abs() <= known * share,
        "{what}: measured {measured:.4}, known {known:.4} (more than {:.0}% apart)",
        share * 100.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn capacity_recovers_a_known_workload_and_its_concurrency_meets_the_objective() {
    let it = Installation::new("capacity").await;
    it.create_topics().await;
    let url = sleeper().await;
    let jobs = workload();
    // What the workload is, known in advance.
    let mut service: Vec<f64> = jobs.iter().map(|j| j.1 as f64 / 1000.0).collect();
    service.sort_by(f64::total_cmp);
    let known =
        |q: f64| service[((q * service.len() as f64).ceil() as usize).clamp(1, service.len()) - 1];
    let known_rate = jobs.len() as f64 / SECONDS;
    // The window is a quarter second longer than the workload (the last accepts' commits).
    let window_rate = jobs.len() as f64 / (SECONDS + 0.25);

    // 1. Measured with room for everything (max_in_flight 256).
    let (relay, worker, file) = processor(&it, &url, None);
    eventually(Duration::from_secs(90), "the processor to hold partitions", || async {
        worker.metric("jobfold_assigned_partitions").await.unwrap_or(0.0) > 0.0
    })
    .await;
    let window = run(&it, "measure").await;
    drop((worker, relay));
    let _ = std::fs::remove_file(file);
    let work = capacity(&it, "postgres", window);
    assert_eq!(work["arrivals"].as_u64().unwrap() as usize, jobs.len());
    within(work["arrival_rate"].as_f64().unwrap(), window_rate, 0.03, "arrival rate");
    within(work["arrival_rate"].as_f64().unwrap(), known_rate, 0.03, "arrival rate (known)");
    assert_eq!(work["attempts"].as_u64().unwrap() as usize, jobs.len(), "one attempt each");
    for (q, key) in [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")] {
        let measured = work["service_seconds"][key].as_f64().unwrap();
        within(measured, known(q), 0.05, &format!("service time {key}"));
    }
    let offered = known_rate * service.iter().sum::<f64>() / service.len() as f64;
    within(work["in_service_mean"].as_f64().unwrap(), offered, 0.05, "jobs in service (Little)");
    assert_eq!(work["retry_share"].as_f64().unwrap(), 0.0);
    // The same log read from Kafka gives the same counts.
    let from_kafka = capacity(&it, "kafka", window);
    assert_eq!(from_kafka["arrivals"], work["arrivals"]);
    assert_eq!(from_kafka["attempts"], work["attempts"]);
    let recommended = work["recommended_concurrency"].as_u64().unwrap() as usize;
    // More than the mean in service (stable), no more than the concurrency at which no job
    // of the known workload, its service times lengthened by the headroom, would wait at all
    // (plus one for the accepts' jitter).
    let stable = (work["in_service_mean"].as_f64().unwrap() * (1.0 + HEADROOM_SHARE)).floor();
    let no_wait = peak_overlap(&jobs, 1.0 + HEADROOM_SHARE) + 1;
    assert!(
        (stable as usize + 1..=no_wait).contains(&recommended),
        "recommended {recommended}, not in {}..={no_wait}: {work}",
        stable as usize + 1
    );

    // 2. The same workload with the kind's concurrency set to the recommendation.
    let (relay, worker, file) = processor(&it, &url, Some(recommended));
    eventually(Duration::from_secs(90), "the processor to hold partitions", || async {
        worker.metric("jobfold_assigned_partitions").await.unwrap_or(0.0) > 0.0
    })
    .await;
    let window = run(&it, "replay").await;
    drop((worker, relay));
    let _ = std::fs::remove_file(file);
    let replayed = capacity(&it, "postgres", window);
    let objective = OBJECTIVE_SECONDS;
    let p99 = replayed["wait_seconds"]["p99"].as_f64().unwrap();
    assert!(
        p99 <= objective,
        "at the recommended {recommended}, p99 wait {p99:.3} s is past the objective: {replayed}"
    );
    assert!(
        replayed["in_service_peak"].as_u64().unwrap() as usize <= recommended,
        "the setting held: {replayed}"
    );
    it.cleanup().await;
}
