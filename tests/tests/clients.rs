//! The worker libraries in `clients/` against the shipped processor, real Postgres, Kafka and
//! the registry: jobs submitted with the library's client, run by a worker written on the
//! library behind a proxy that cuts connections idle for a second (a load balancer's idle
//! time-out, scaled down), every call signed.
//!
//! The full-size run of the same (a 5-minute job through a proxy with a 30 s idle time-out),
//! past nextest's time-out, with the services running (`docker/services.sh start`, and its
//! `services.env` sourced): `TEST_LONG_JOB_SECONDS=300 TEST_PROXY_IDLE_SECONDS=30 cargo test
//! -p jobfold-tests --test suite clients::the_python_library`.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use jobfold_tests::harness::{Installation, fold_mismatches};
use serde_json::Value;

const SECRET: &str = "client-library-test-secret-0123456789";

fn clients() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../clients")
}

fn seconds_from_env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A worker process that prints its port first; killed on drop.
struct Worker(Child, u16);

impl Worker {
    fn start(program: &str, args: &[PathBuf], heartbeat_every: &str) -> Self {
        let mut child = Command::new(program)
            .args(args)
            .args(["--port", "0"])
            .env("JOBFOLD_SECRET", SECRET)
            .env("JOBFOLD_HEARTBEAT_EVERY", heartbeat_every)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("running {program}: {e}"));
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().parse().unwrap_or_else(|_| panic!("the worker said {line:?}"));
        Self(child, port)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs short and long jobs of the worker at `worker` (a library's example) through the
/// shipped processor, submitted by `submit` (the library's client); checks what each did.
async fn short_and_long_jobs_through(name: &str, worker: Worker, submit: (&str, Vec<PathBuf>)) {
    let long_seconds = seconds_from_env("TEST_LONG_JOB_SECONDS", 4);
    let idle = Duration::from_secs(seconds_from_env("TEST_PROXY_IDLE_SECONDS", 1));
    let it = Installation::new(name).await;
    it.create_topics().await;
    let target = format!("127.0.0.1:{}", worker.1).parse().unwrap();
    let (proxy, _cut) = jobfold_tests::proxy::idle_proxy(target, idle).await;

    // What the libraries refuse, before any processor: an unsigned call and a stale one.
    let client = reqwest::Client::new();
    let body = r#"{"job_id": "j", "kind": "count-words", "document_id": "d", "input_version": 1,
                   "input": {"text": "a b"}, "attempt": 1, "generation": 1}"#;
    let unsigned = client.post(format!("http://{target}/")).body(body).send().await.unwrap();
    assert_eq!(unsigned.status(), 401, "an unsigned call");
    let stale = jobfold_processor::signature::sign(
        SECRET.as_bytes(),
        chrono::Utc::now().timestamp() - 600,
        body.as_bytes(),
    );
    let stale = client
        .post(format!("http://{target}/"))
        .header("jobfold-signature", stale)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(stale.status(), 401, "a call signed 10 minutes ago");

    let kinds = format!(
        r#"
[processor]
run_timeout = "{run_timeout}s"
[kinds.count-words]
url = "http://{proxy}/"
secret = "{SECRET}"
[kinds.transcode]
url = "http://{proxy}/"
secret = "{SECRET}"
callback_timeout = "{callback_timeout}s"
"#,
        run_timeout = long_seconds * 2 + 60,
        callback_timeout = idle.as_secs() * 3 + 5,
    );
    let group = it.start_group(name, &kinds, 1).await;
    let (http, processor) = (group.http[0], group.processor());

    let (program, args) = submit;
    let output = tokio::process::Command::new(program)
        .args(&args)
        .args(["--api", &format!("http://127.0.0.1:{http}")])
        .args(["--job", "count-words", r#"{"text": "three little words"}"#])
        .args(["--job", "count-words", r#"{"text": 7}"#])
        .args([
            "--job",
            "transcode",
            &format!(r#"{{"seconds": {long_seconds}, "source": "a.wav"}}"#),
        ])
        .args(["--timeout", &(long_seconds * 3 + 120).to_string()])
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the submitter failed: {said}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let jobs: Vec<Value> = said.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(jobs.len(), 3, "{said}");
    assert_eq!(
        (jobs[0]["state"].as_str(), &jobs[0]["result"]["words"]),
        (Some("succeeded"), &3.into())
    );
    assert_eq!(jobs[1]["state"], "quarantined", "invalid input: {said}");
    // The long job ran far past the proxy's idle time-out and completed by calling back, in
    // one attempt.
    assert_eq!((jobs[2]["state"].as_str(), &jobs[2]["attempt"]), (Some("succeeded"), &1.into()));
    let ran = jobs[2]["result"]["seconds"].as_f64().unwrap();
    assert!(ran >= long_seconds as f64 && ran > idle.as_secs_f64() * 2.0, "{said}");
    assert_eq!(jobs[2]["result"]["source"], "a.wav");
    let beats = processor
        .scrape()
        .await
        .and_then(|text| {
            jobfold_tests::harness::metric_value(
                &text,
                "jobfold_callbacks_total",
                &[("route", "heartbeat"), ("outcome", "written")],
            )
        })
        .unwrap_or(0.0);
    assert!(beats >= 2.0, "{beats} heartbeats were recorded");
    assert_eq!(fold_mismatches(&it).await, Vec::<String>::new());
    drop(worker);
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_python_library_runs_short_and_long_jobs_against_the_processor() {
    let examples = clients().join("python/examples");
    let worker = Worker::start("python3", &[examples.join("worker.py")], "0.5");
    short_and_long_jobs_through("py-client", worker, ("python3", vec![examples.join("submit.py")]))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_typescript_library_runs_short_and_long_jobs_against_the_processor() {
    // Built by docker/test.sh (`npm ci && npm test` in clients/typescript) before the tests.
    let examples = clients().join("typescript/dist/examples");
    assert!(
        examples.join("worker.js").exists(),
        "clients/typescript is not built: run npm ci && npm run build there (docker/test.sh does)"
    );
    let worker = Worker::start("node", &[examples.join("worker.js")], "0.5");
    short_and_long_jobs_through("ts-client", worker, ("node", vec![examples.join("submit.js")]))
        .await;
}
