//! The design's example jobs in `jobfold-examples`, and handlers in another language through
//! the shipped `jobfold-processor`: real Postgres, Kafka, registry, `sox` and Python.
//!
//! - summarize-conversation and convert-audio, with the processor killed (abort, as kill -9)
//!   at each crash window: every job succeeds, each business row is written once per (job,
//!   input version), the model is never asked again after a summary committed, and every
//!   converted file is whole and matches its committed checksum.
//! - the shipped processor runs kinds configured with a URL: the Python worker of
//!   `examples/python`, and the protocol's answers (503 with Retry-After, 404), while it
//!   leaves the `simulate` input of the test handler alone.

use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jobfold_common::accept::NewJob;
use jobfold_common::failpoint;
use jobfold_tests::harness::{Installation, Service, eventually};
use serde_json::{Value, json};
use sha2::Digest;
use uuid::Uuid;

/// Calls a test server saw: (route, idempotency key, when).
type Calls = Arc<Mutex<Vec<(String, String, chrono::DateTime<chrono::Utc>, Instant)>>>;

/// A server on 127.0.0.1 standing in for the outside services: `/v1/chat/completions` (the
/// model, 150 ms per answer), `/flaky` (503 with `Retry-After: 2` to each key's first call,
/// then 200), `/gone` (404) and `/huge` (a 4 MiB result). Returns its base URL and the calls it saw.
async fn outside_services() -> (String, Calls) {
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::IntoResponse;
    let calls: Calls = Arc::default();
    let seen = Arc::clone(&calls);
    let record = move |route: &str, headers: &HeaderMap| {
        let key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let mut calls = seen.lock().unwrap();
        calls.push((route.to_owned(), key.clone(), chrono::Utc::now(), Instant::now()));
        calls.iter().filter(|c| c.0 == route && c.1 == key).count()
    };
    let (model, flaky) = (record.clone(), record.clone());
    let (gone, huge) = (record.clone(), record);
    let app = axum::Router::new()
        .route(
            "/v1/chat/completions",
            axum::routing::post(move |headers: HeaderMap, body: axum::Json<Value>| async move {
                model("model", &headers);
                tokio::time::sleep(Duration::from_millis(150)).await;
                let turns = body["messages"].as_array().map_or(0, Vec::len);
                axum::Json(json!({"model": "test-model", "choices": [{"message":
                    {"role": "assistant", "content": format!("A summary of {turns} messages.")}}]}))
            }),
        )
        .route(
            "/flaky",
            axum::routing::post(move |headers: HeaderMap| async move {
                if flaky("flaky", &headers) == 1 {
                    (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "2")], "busy")
                        .into_response()
                } else {
                    axum::Json(json!({"ok": true})).into_response()
                }
            }),
        )
        .route(
            "/gone",
            axum::routing::post(move |headers: HeaderMap| async move {
                gone("gone", &headers);
                (StatusCode::NOT_FOUND, "no such thing").into_response()
            }),
        )
        .route(
            "/huge",
            axum::routing::post(move |headers: HeaderMap| async move {
                huge("huge", &headers);
                // 4 MiB of JSON, far past the kind's max_output_bytes (64 KiB).
                axum::Json(json!({ "blob": "x".repeat(4 << 20) })).into_response()
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, calls)
}

fn fast_env(it: &Installation) -> HashMap<String, String> {
    it.fast_env(&jobfold_tests::kafka::unique_name("examples"))
}

/// Every insert and update of the examples' business tables, in a table of the test's own
/// (no unique key): a write committed twice shows as two rows.
async fn audit_business_writes(it: &Installation) {
    for statement in [
        "CREATE TABLE business_writes (tbl text NOT NULL, job_id uuid NOT NULL, version bigint NOT NULL)",
        "CREATE FUNCTION audit_write() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         INSERT INTO business_writes VALUES (TG_TABLE_NAME, NEW.job_id, NEW.version); RETURN NEW; END $$",
        "CREATE TRIGGER audit AFTER INSERT OR UPDATE ON conversation_summaries \
         FOR EACH ROW EXECUTE FUNCTION audit_write()",
        "CREATE TRIGGER audit AFTER INSERT OR UPDATE ON audio_conversions \
         FOR EACH ROW EXECUTE FUNCTION audit_write()",
    ] {
        sqlx::query(statement).execute(&it.pool).await.unwrap();
    }
}

/// A job of `kind` for `document` at `version`.
fn new_job(document: String, kind: &str, version: i64, input: Value) -> NewJob {
    NewJob {
        document_id: document,
        kind: kind.into(),
        input_version: version,
        input,
        idempotency_key: None,
        trace: None,
        run_at: None,
    }
}

async fn count(it: &Installation, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&it.pool).await.unwrap()
}

/// A tone of `seconds` as a WAV file, made with sox.
fn tone(path: &Path, seconds: u32) {
    let status = std::process::Command::new("sox")
        .args(["-n", "-r", "22050", "-c", "2"])
        .arg(path)
        .args(["synth", &seconds.to_string(), "sine", "440"])
        .status()
        .expect("running sox (docker/test.sh installs it)");
    assert!(status.success());
}

/// Kill the examples processor at `window` (its third pass), start another; check.
async fn examples_survive_a_crash_at(name: &str, window: &str) {
    let it = Installation::new(name).await;
    it.create_topics().await;
    audit_business_writes(&it).await;
    let (outside, calls) = outside_services().await;
    let dir = std::env::temp_dir().join(format!("jobfold-{name}-{}", Uuid::new_v4().simple()));
    let (audio_in, audio_out) = (dir.join("in"), dir.join("out"));
    std::fs::create_dir_all(&audio_in).unwrap();
    for i in 0..4 {
        tone(&audio_in.join(format!("call-{i}.wav")), 1 + i);
    }
    // One processor runs the three example kinds and a handler in Python.
    let python = PythonWorker::start();
    let file = dir.join("kinds.toml");
    let url = format!("http://127.0.0.1:{}/count-words", python.1);
    std::fs::write(&file, format!("[kinds.count-words]\nurl = \"{url}\"\n")).unwrap();
    let mut env = fast_env(&it);
    env.insert("JOBFOLD_CONFIG".into(), file.display().to_string());
    env.insert("SUMMARIZE_MODEL_URL".into(), format!("{outside}/v1/chat/completions"));
    env.insert("AUDIO_INPUT_DIR".into(), audio_in.display().to_string());
    env.insert("AUDIO_OUTPUT_DIR".into(), audio_out.display().to_string());
    let relay = Service::start("jobfold-relay", &env);
    env.insert("JOBFOLD_FAILPOINT".into(), format!("{window}@3"));
    if window == failpoint::PROCESSOR_AFTER_LEASE_COMMIT {
        // A lease committed on its own: none is, for a run done within the inline window.
        env.insert("JOBFOLD_PROCESSOR__INLINE_WINDOW".into(), "0s".into());
    }
    let mut crashing = Service::start("jobfold-examples", &env);
    eventually(Duration::from_secs(60), "the examples' kinds to be registered", || async {
        count(&it, "SELECT count(*) FROM job_kinds WHERE kind IN ('summarize-conversation', 'convert-audio', 'count-words')").await == 3
    })
    .await;

    let acceptor = it.acceptor().await;
    let mut jobs = Vec::new();
    for c in 0..6 {
        for version in 1..=2 {
            let messages: Vec<Value> = (0..version)
                .map(|t| json!({"role": "user", "content": format!("conversation {c}, turn {t}")}))
                .collect();
            let input = json!({ "messages": messages });
            jobs.push(new_job(
                format!("conversation-{c}"),
                "summarize-conversation",
                version,
                input,
            ));
        }
    }
    for i in 0..4 {
        let input = json!({"source": format!("call-{i}.wav"), "format": "flac", "rate": 16000});
        jobs.push(new_job(format!("call-{i}"), "convert-audio", 1, input));
    }
    for i in 0..4 {
        let input = json!({"text": "one two three ".repeat(i + 1)});
        jobs.push(new_job(format!("note-{i}"), "count-words", 1, input));
    }
    for job in &jobs {
        acceptor.accept(&it.pool, job).await.unwrap();
    }
    let status = crashing.wait_exit(Duration::from_secs(60)).expect("the processor aborts");
    assert!(!status.success() && crashing.log_text().contains(window), "{}", crashing.log_text());
    env.remove("JOBFOLD_FAILPOINT");
    let survivor = Service::start("jobfold-examples", &env);
    // The processor runs with two malloc arenas and fixed thresholds: it starts itself again
    // in place (the same pid) with MALLOC_ARENA_MAX=2 and the thresholds set, which glibc
    // reads only as a program starts.
    assert!(
        std::env::var_os("MALLOC_ARENA_MAX").is_none(),
        "MALLOC_ARENA_MAX is set for the tests: the processor would inherit it, not set it"
    );
    // So does the relay.
    for (name, pid) in [("processor", survivor.pid()), ("relay", relay.pid())] {
        let environ = format!("/proc/{pid}/environ");
        eventually(
            Duration::from_secs(30),
            &format!("the {name} to run with two malloc arenas and fixed thresholds"),
            || async {
                std::fs::read(&environ).is_ok_and(|env| {
                    let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
                    [
                        &b"MALLOC_ARENA_MAX=2"[..],
                        b"MALLOC_TRIM_THRESHOLD_=131072",
                        b"MALLOC_MMAP_THRESHOLD_=131072",
                    ]
                    .iter()
                    .all(|wanted| vars.contains(wanted))
                })
            },
        )
        .await;
    }
    let total = jobs.len() as i64;
    eventually(Duration::from_secs(120), "every job to end after the crash", || async {
        count(
            &it,
            "SELECT count(*) FROM jobs WHERE state IN ('succeeded', 'superseded', 'quarantined')",
        )
        .await
            == total
    })
    .await;
    assert_eq!(count(&it, "SELECT count(*) FROM jobs WHERE state = 'quarantined'").await, 0);

    // Each business row once per (job, input version), and one for every job that applied.
    let twice = count(&it, "SELECT count(*) FROM (SELECT 1 FROM business_writes GROUP BY tbl, job_id, version HAVING count(*) > 1) d").await;
    assert_eq!(twice, 0, "a business write was committed twice");
    let succeeded =
        count(&it, "SELECT count(*) FROM jobs WHERE state = 'succeeded' AND kind <> 'count-words'")
            .await;
    assert_eq!(count(&it, "SELECT count(*) FROM business_writes").await, succeeded);
    // The Python handler's results, one per job.
    let words: Vec<i64> = sqlx::query_scalar(
        "SELECT (j.result->>'words')::bigint FROM jobs j \
         WHERE j.kind = 'count-words' ORDER BY j.document_id",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert_eq!(words, [3, 6, 9, 12]);
    // The newest version of every conversation is its summary.
    assert_eq!(count(&it, "SELECT count(*) FROM conversation_summaries WHERE version = 2 AND summary = 'A summary of 3 messages.'").await, 6);

    // The model is never asked again after a summary committed (a redelivery is stopped by
    // the job row first), and every call carried the job's idempotency key.
    let committed: Vec<(String, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT j.job_id::text || ':' || j.input_version, e.occurred_at FROM job_events e \
         JOIN jobs j USING (job_id) WHERE e.kind IN ('JobSucceeded', 'JobSuperseded')",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    let committed: BTreeMap<String, _> = committed.into_iter().collect();
    let calls = calls.lock().unwrap().clone();
    // Every summary that committed asked the model under its key. (A first version may be
    // superseded by its second before it runs, so how many calls there were is not fixed.)
    let summarized: Vec<String> = sqlx::query_scalar(
        "SELECT j.job_id::text || ':' || j.input_version FROM jobs j \
         WHERE j.kind = 'summarize-conversation' AND j.state = 'succeeded'",
    )
    .fetch_all(&it.pool)
    .await
    .unwrap();
    assert!(summarized.len() >= 6, "{summarized:?}");
    for key in &summarized {
        assert!(calls.iter().any(|(_, k, _, _)| k == key), "no model call for {key}: {calls:?}");
    }
    drop(python);
    for (_, key, at, _) in &calls {
        let done = committed.get(key).unwrap_or_else(|| panic!("a call with key {key:?}"));
        assert!(at <= done, "the model was called for {key} after its result committed");
    }

    // Every conversion is whole: the file at the committed path has the committed checksum,
    // and no partial file is left under the final names.
    let rows: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT path, sha256, bytes FROM audio_conversions ORDER BY document_id")
            .fetch_all(&it.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 4);
    for (path, sha256, bytes) in rows {
        let data = std::fs::read(&path).unwrap();
        assert_eq!((hex::encode(sha2::Sha256::digest(&data)), data.len() as i64), (sha256, bytes));
        let info = std::process::Command::new("soxi").arg("-r").arg(&path).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&info.stdout).trim(), "16000", "{path}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    it.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn example_jobs_commit_once_when_killed_after_the_lease() {
    examples_survive_a_crash_at("ex-lease", failpoint::PROCESSOR_AFTER_LEASE_COMMIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn example_jobs_commit_once_when_killed_in_the_handler() {
    examples_survive_a_crash_at("ex-handler", failpoint::PROCESSOR_IN_HANDLER).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn example_jobs_commit_once_when_killed_after_the_completion() {
    examples_survive_a_crash_at("ex-complete", failpoint::PROCESSOR_AFTER_COMPLETION_BEFORE_OFFSET)
        .await;
}

/// The Python worker, started on a free port; killed on drop.
struct PythonWorker(std::process::Child, u16);

impl PythonWorker {
    fn start() -> Self {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/python/worker.py");
        let mut child = std::process::Command::new("python3")
            .arg(script)
            .args(["--port", "0"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("running python3");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().rsplit(':').next().and_then(|p| p.parse().ok());
        Self(child, port.unwrap_or_else(|| panic!("worker.py said {line:?}")))
    }
}

impl Drop for PythonWorker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The Python worker answers each call in one write, headers and body together: written as
/// two, the body of a keep-alive call waits for the caller's delayed ACK (Nagle's algorithm),
/// about 40 ms a call, and the first read here would hold the headers alone.
#[test]
fn the_python_worker_answers_each_keep_alive_call_in_one_write() {
    use std::io::{Read, Write};
    let python = PythonWorker::start();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", python.1)).unwrap();
    let body = r#"{"job_id": "j", "input": {"text": "one two three"}}"#;
    let request = format!(
        "POST /count-words HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut took = Vec::new();
    for _ in 0..20 {
        let started = Instant::now();
        stream.write_all(request.as_bytes()).unwrap();
        let mut buffer = vec![0u8; 1 << 16];
        let n = stream.read(&mut buffer).unwrap();
        took.push(started.elapsed());
        let text = String::from_utf8_lossy(&buffer[..n]);
        let (head, answer) = text.split_once("\r\n\r\n").expect("the headers in one read");
        assert!(head.starts_with("HTTP/1.1 200"), "{text}");
        let length: usize = head
            .lines()
            .find_map(|line| {
                line.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse().unwrap())
            })
            .expect("a Content-Length");
        assert_eq!(answer.len(), length, "the body in the same read as its headers: {text:?}");
        assert!(answer.contains(r#""words": 3"#), "{answer}");
    }
    took.sort();
    eprintln!("a keep-alive call to worker.py: median {:?}, slowest {:?}", took[10], took[19]);
}

/// The shipped processor runs the kinds its configuration names a URL for, by the protocol:
/// the Python worker's results, its 422 as invalid input, a 503's Retry-After respected, a
/// 404 as permanent, an answer past `max_output_bytes` cut off; and a `simulate` input means nothing to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_shipped_processor_runs_handlers_in_any_language_over_http() {
    let it = Installation::new("remote").await;
    it.create_topics().await;
    let python = PythonWorker::start();
    let (outside, calls) = outside_services().await;
    let file =
        std::env::temp_dir().join(format!("jobfold-remote-{}.toml", Uuid::new_v4().simple()));
    std::fs::write(
        &file,
        format!(
            "[kinds.count-words]\nurl = \"http://127.0.0.1:{}/count-words\"\n\
             [kinds.flaky]\nurl = \"{outside}/flaky\"\n[kinds.gone]\nurl = \"{outside}/gone\"\n\
             [kinds.huge]\nurl = \"{outside}/huge\"\nmax_output_bytes = 65536\n",
            python.1
        ),
    )
    .unwrap();
    let mut env = fast_env(&it);
    env.insert("JOBFOLD_CONFIG".into(), file.display().to_string());
    let _relay = Service::start("jobfold-relay", &env);
    let processor = Service::start("jobfold-processor", &env);
    eventually(Duration::from_secs(60), "the configured kinds to be registered", || async {
        count(
            &it,
            "SELECT count(*) FROM job_kinds WHERE kind IN ('count-words', 'flaky', 'gone', 'huge')",
        )
        .await
            == 4
    })
    .await;
    let acceptor = it.acceptor().await;
    let job = |kind: &str, input: Value| {
        new_job(format!("doc-{kind}-{}", input.to_string().len()), kind, 1, input)
    };
    // The test handler's knobs would hang this job for ever and fail it; here they are data.
    let knobs = json!({"text": "three little words", "simulate": {"sleep_ms": 1_000_000_000_000u64, "permanent": true}});
    let mut ids = Vec::new();
    for j in [
        job("count-words", knobs),
        job("count-words", json!({"title": "no text"})),
        job("flaky", json!({})),
        job("gone", json!({})),
        job("huge", json!({})),
    ] {
        ids.push(acceptor.accept(&it.pool, &j).await.unwrap().job_id);
    }
    eventually(Duration::from_secs(60), "every job to end", || async {
        count(&it, "SELECT count(*) FROM jobs WHERE state IN ('succeeded', 'quarantined')").await
            == 5
    })
    .await;
    let state = |id: Uuid| it.state_and_attempt(id);
    assert_eq!(state(ids[0]).await, ("succeeded".into(), 1), "{}", processor.log_text());
    let result: Value = sqlx::query_scalar("SELECT result FROM jobs WHERE job_id = $1")
        .bind(ids[0])
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert_eq!(result["words"], 3);
    assert_eq!(result["idempotency_key"], format!("{}:1", ids[0]));
    let class = |id: Uuid| {
        let pool = it.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT lower(error_class) FROM quarantine WHERE job_id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(state(ids[1]).await.0, "quarantined");
    assert_eq!(class(ids[1]).await, "invalid_input");
    // The 503 with Retry-After snoozed the job: its one failed call spent no attempt.
    assert_eq!(state(ids[2]).await, ("succeeded".into(), 1));
    assert_eq!(state(ids[3]).await, ("quarantined".into(), 1));
    assert_eq!(class(ids[3]).await, "permanent");
    // An answer past the kind's max_output_bytes is read no further and fails for good.
    assert_eq!(state(ids[4]).await, ("quarantined".into(), 1));
    let reason: String = sqlx::query_scalar("SELECT reason FROM quarantine WHERE job_id = $1")
        .bind(ids[4])
        .fetch_one(&it.pool)
        .await
        .unwrap();
    assert!(reason.contains("answered with more than max_output_bytes (65536"), "{reason}");
    // The second call to /flaky waited out its Retry-After (2 s), not the 50 ms backoff.
    let calls = calls.lock().unwrap().clone();
    let flaky: Vec<Instant> = calls.iter().filter(|c| c.0 == "flaky").map(|c| c.3).collect();
    assert_eq!(flaky.len(), 2);
    assert!(flaky[1] - flaky[0] >= Duration::from_millis(1900), "{:?}", flaky[1] - flaky[0]);
    let _ = std::fs::remove_file(file);
    it.cleanup().await;
}

/// convert-audio's subprocess ends with the run: cancelled (a lost lease, shutdown) or past
/// its time-out, sox is killed and neither a partial nor a final file is left.
#[tokio::test]
async fn a_cancelled_or_timed_out_conversion_kills_sox_and_leaves_no_file() {
    use jobfold_examples::audio::ConvertAudio;
    use jobfold_processor::handler::{ErrorClass, Handler, JobContext};
    let dir = std::env::temp_dir().join(format!("jobfold-sox-{}", Uuid::new_v4().simple()));
    let (input, output) = (dir.join("in"), dir.join("out"));
    std::fs::create_dir_all(&input).unwrap();
    // Ten minutes of audio: seconds of work for sox, far more than the run is given.
    tone(&input.join("long.wav"), 600);
    let job = JobContext {
        job_id: Uuid::now_v7(),
        document_id: "long".into(),
        kind: "convert-audio".into(),
        input_version: 1,
        input: json!({"source": "long.wav", "format": "flac", "rate": 48000}),
        attempt: 1,
        generation: 1,
        trace: None,
        deadline: None,
        max_attempts: 3,
        previous_outcome: Default::default(),
    };
    // This process's children named sox, from /proc/<pid>/stat: "pid (comm) state ppid ...".
    let sox_children = || {
        let me = std::process::id().to_string();
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("stat")).ok())
            .filter(|stat| {
                let fields: Vec<&str> = stat.rsplit(") ").next().unwrap_or("").split(' ').collect();
                // A killed child not reaped yet is a zombie (Z): gone for this purpose.
                stat.contains("(sox)") && fields.get(1) == Some(&me.as_str()) && fields[0] != "Z"
            })
            .count()
    };

    let handler = ConvertAudio::new(&input, &output, "sox", Duration::from_secs(600));
    let cancel = tokio_util::sync::CancellationToken::new();
    let fire = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        fire.cancel();
    });
    let cancelled = handler.run(&job, cancel).await.unwrap_err();
    assert_eq!(cancelled.class, ErrorClass::Retryable, "{cancelled}");
    assert!(cancelled.message.contains("cancelled"), "{cancelled}");
    // Killed at once: sox alone would go on for seconds more.
    eventually(Duration::from_secs(1), "sox to be killed", || async { sox_children() == 0 }).await;

    let impatient = ConvertAudio::new(&input, &output, "sox", Duration::from_millis(300));
    let timed_out = impatient.run(&job, Default::default()).await.unwrap_err();
    assert!(timed_out.message.contains("ran longer"), "{timed_out}");
    eventually(Duration::from_secs(1), "sox to be killed", || async { sox_children() == 0 }).await;

    // Nothing written under any name.
    let left: Vec<_> = std::fs::read_dir(&output).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
